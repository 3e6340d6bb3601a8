from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from kvtier.store.backends.base import IO_ALIGNMENT
from kvtier.store.backends.posix import PosixBackend, probe_direct
from kvtier.store.slot import aligned_empty

WAIT_S = 30.0  # each I/O wait's deadline: a hung back end fails the test


def make_file(path: Path, size: int) -> str:
    with open(path, "wb") as f:
        f.truncate(size)
    return str(path)


def pattern(n: int, seed: int = 0) -> np.ndarray:
    buf = aligned_empty(n)
    buf[:] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return buf


def o_direct_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "vllm.kvtier.store"
        and r.levelno == logging.WARNING
        and "O_DIRECT" in r.getMessage()
    ]


def roundtrip(backend: PosixBackend, path: str) -> None:
    h = backend.open(path)
    try:
        data = pattern(3 * IO_ALIGNMENT)
        assert backend.submit_write(h, data, IO_ALIGNMENT).result(WAIT_S) == data.nbytes
        back = aligned_empty(data.nbytes)
        back[:] = 0
        assert backend.submit_read(h, back, IO_ALIGNMENT).result(WAIT_S) == data.nbytes
        assert back.tobytes() == data.tobytes()
    finally:
        backend.close(h)
    with open(path, "rb") as f:
        f.seek(IO_ALIGNMENT)
        assert f.read(data.nbytes) == data.tobytes()


def test_roundtrip_on_disk_uses_o_direct_where_probe_says_so(tmp_path: Path) -> None:
    backend = PosixBackend(threads=2)
    try:
        path = make_file(tmp_path / "f", 8 * IO_ALIGNMENT)
        roundtrip(backend, path)
        h = backend.open(path)
        assert h.direct == probe_direct(str(tmp_path))[0]
        backend.close(h)
    finally:
        backend.shutdown()


def test_a_probe_that_failed_for_another_reason_is_tried_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory that does not exist yet (a worker may open its slabs
    before the scheduler side created the store) says nothing about
    O_DIRECT: warned once, and once the directory exists the next open
    probes again and gets what the file system gives."""
    caplog.set_level(logging.WARNING, logger="vllm.kvtier.store")
    backend = PosixBackend(threads=1)
    later = tmp_path / "later"
    try:
        for _ in range(3):
            assert backend.direct_supported(str(later)) is False
        assert len(o_direct_warnings(caplog)) == 1
        later.mkdir()
        h = backend.open(make_file(later / "f", 8 * IO_ALIGNMENT))
        assert h.direct == probe_direct(str(later))[0]
        backend.close(h)
    finally:
        backend.shutdown()


def test_roundtrip_on_tmpfs_logs_at_most_once(
    shm_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.kvtier.store")
    backend = PosixBackend(threads=2)
    try:
        for name in ("a", "b"):
            roundtrip(backend, make_file(Path(shm_dir) / name, 8 * IO_ALIGNMENT))
        # Kernels before 6.6 reject O_DIRECT on tmpfs (fallback + one warning);
        # newer ones accept it.
        expected = 0 if probe_direct(shm_dir)[0] else 1
        assert len(o_direct_warnings(caplog)) == expected
    finally:
        backend.shutdown()


@pytest.mark.usefixtures("reject_o_direct")
@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_fallback_to_buffered_warns_once(
    where: str, tmp_path: Path, shm_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.kvtier.store")
    base = tmp_path if where == "tmp" else Path(shm_dir)
    backend = PosixBackend(threads=2)
    try:
        for name in ("a", "b", "c"):
            path = make_file(base / name, 8 * IO_ALIGNMENT)
            roundtrip(backend, path)
            h = backend.open(path)
            assert not h.direct
            backend.close(h)
        warnings = o_direct_warnings(caplog)
        assert len(warnings) == 1
        assert "buffered" in warnings[0].getMessage()
        assert "EINVAL" in warnings[0].getMessage()
        assert "buffered" in backend.describe()
    finally:
        backend.shutdown()
    # No probe files left behind.
    assert sorted(os.listdir(base)) == ["a", "b", "c"]


def test_direct_false_never_probes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.kvtier.store")
    backend = PosixBackend(threads=1, direct=False)
    try:
        path = make_file(tmp_path / "f", 4 * IO_ALIGNMENT)
        roundtrip(backend, path)
        assert not backend.open(path).direct
        assert not o_direct_warnings(caplog)
    finally:
        backend.shutdown()


@pytest.mark.parametrize("direct", [True, False])
def test_short_read_at_eof_reports_count(tmp_path: Path, direct: bool) -> None:
    backend = PosixBackend(threads=1, direct=direct)
    try:
        aligned = make_file(tmp_path / "aligned", 2 * IO_ALIGNMENT)
        odd = make_file(tmp_path / "odd", 5000)
        buf = aligned_empty(4 * IO_ALIGNMENT)
        for path, expect in ((aligned, 2 * IO_ALIGNMENT), (odd, 5000)):
            h = backend.open(path)
            assert backend.submit_read(h, buf, 0).result(WAIT_S) == expect
            assert backend.submit_read(h, buf, 8 * IO_ALIGNMENT).result(WAIT_S) == 0
            backend.close(h)
    finally:
        backend.shutdown()


def test_errors_carry_errno(tmp_path: Path) -> None:
    backend = PosixBackend(threads=1)
    try:
        path = make_file(tmp_path / "f", 2 * IO_ALIGNMENT)
        ro = backend.open(path, writable=False)
        with pytest.raises(OSError) as info:
            backend.submit_write(ro, aligned_empty(IO_ALIGNMENT), 0).result(WAIT_S)
        assert info.value.errno == errno.EBADF
        assert info.value.filename == path
        backend.close(ro)
        with pytest.raises(FileNotFoundError):
            backend.open(str(tmp_path / "missing"))
    finally:
        backend.shutdown()


def test_rejects_bad_thread_count() -> None:
    with pytest.raises(ValueError):
        PosixBackend(threads=0)
