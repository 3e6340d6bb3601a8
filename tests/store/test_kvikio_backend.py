"""KvikioBackend against the real kvikio, on machines with no GPU.

kvikio needs ``libcuda.so.1`` for every I/O. CI has no driver, so these tests
build a test-only stub driver (tests/stubs/libcuda_stub.c) that answers "not
initialized"; kvikio then takes its real host-memory (POSIX compat-mode)
path. The dynamic loader reads LD_LIBRARY_PATH only at process start, and
kvikio keeps its driver state for the life of a process, so every scenario
runs in a fresh ``python -c`` child with its own LD_LIBRARY_PATH. The child
does the I/O and asserts byte equality itself (a failed assert fails the
child and so the test, with the child's traceback in the message); it ends
by printing one ``RESULT <json>`` line for the parent's further checks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.stubs.build_stub import real_driver_present, stub_lib_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
# A hang (kvikio deadlocking on a bad driver) must fail the test, not CI.
CHILD_TIMEOUT_S = 180


pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("kvikio") is None,
    reason="kvikio not installed (run scripts/install-kvikio.sh)",
)


@pytest.fixture(scope="module")
def stub_dir() -> Path:
    """Directory holding the stub libcuda.so.1 (built once, cached)."""
    return _stub(broken=False)


@pytest.fixture(scope="module")
def broken_stub_dir() -> Path:
    """A libcuda.so.1 whose cuDriverGetVersion fails, like the toolkit's stub."""
    return _stub(broken=True)


def _stub(broken: bool) -> Path:
    lib_dir = stub_lib_dir(broken)
    if lib_dir is None:
        pytest.skip("no C compiler (gcc) to build the CUDA driver stub")
    return lib_dir


def run_child(code: str, lib_dir: Path | None, work_dir: Path) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter with LD_LIBRARY_PATH=lib_dir only."""
    env = dict(os.environ)
    env.pop("LD_LIBRARY_PATH", None)
    if lib_dir is not None:
        env["LD_LIBRARY_PATH"] = str(lib_dir)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p
    )
    env["KVTIER_CUDA_STUB_TRACE"] = "1"
    env["KVTIER_TEST_DIR"] = str(work_dir)
    # Tests must not depend on the developer's kvikio tuning.
    for var in ("KVIKIO_COMPAT_MODE", "KVIKIO_NTHREADS"):
        env.pop(var, None)
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=env,
            cwd=work_dir,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"child did not finish within {CHILD_TIMEOUT_S} s (hang?)\n"
            f"stdout:\n{exc.stdout!r}\nstderr:\n{exc.stderr!r}"
        )
    elapsed = time.monotonic() - start
    detail = f"\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, f"child exited {proc.returncode}{detail}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, f"child printed no RESULT line{detail}"
    result: dict[str, Any] = json.loads(lines[0][len("RESULT ") :])
    result["_stderr"] = proc.stderr
    result["_elapsed"] = elapsed
    return result


UNUSABLE_CHILD = """
    import json
    import pytest
    from kvtier.store.backends.base import BackendUnavailableError
    from kvtier.store.backends.factory import make_backend
    from kvtier.store.backends.kvikio import KvikioBackend
    from kvtier.store.backends.kvikio_probe import gds_status, usable_status

    usable, reason = usable_status()
    assert not usable, "kvikio usable without a CUDA driver"
    assert reason, "no reason recorded"
    assert usable_status() == (False, reason)  # cached
    assert gds_status()[0] is False
    with pytest.raises(BackendUnavailableError):
        KvikioBackend()
    auto = make_backend("auto")
    assert auto.name == "posix", auto.describe()
    auto.shutdown()
    with pytest.raises(BackendUnavailableError):
        make_backend("kvikio")
    print("RESULT " + json.dumps({"reason": reason}))
"""


def test_unusable_without_driver(tmp_path: Path) -> None:
    if real_driver_present():
        pytest.skip("a real CUDA driver is installed; cannot test its absence")
    result = run_child(UNUSABLE_CHILD, None, tmp_path)
    assert "libcuda.so.1" in result["reason"]
    # libcufile must not have been asked either (it prints dlopen errors).
    assert "dlopen" not in result["_stderr"]


def test_unusable_with_broken_driver_does_not_hang(
    tmp_path: Path, broken_stub_dir: Path
) -> None:
    # kvikio itself deadlocks on this driver; the probe must refuse it first.
    result = run_child(UNUSABLE_CHILD, broken_stub_dir, tmp_path)
    assert "cuDriverGetVersion" in result["reason"]
    assert "CUresult 34" in result["reason"]


ROUNDTRIP_CHILD = """
    import json
    import os

    import numpy as np
    import torch

    from kvtier.store.backends.factory import make_backend
    from kvtier.store.backends.kvikio import KvikioBackend
    from kvtier.store.backends.kvikio_probe import gds_status, usable_status

    assert usable_status()[0], usable_status()[1]
    assert gds_status()[0] is False  # no GPU here: compat mode

    def aligned(n):
        raw = np.empty(n + 4096, dtype=np.uint8)
        start = (-raw.ctypes.data) % 4096
        return raw[start : start + n]

    def random_buf(rng, n):
        buf = aligned(n)
        buf[:] = rng.integers(0, 256, n, dtype=np.uint8)
        return buf

    work = os.environ["KVTIER_TEST_DIR"]
    path = os.path.join(work, "slab.bin")
    file_size = 32 << 20
    with open(path, "wb") as f:
        f.truncate(file_size)

    # (offset, size): page-sized, multi-page, 64 KiB, one larger than kvikio's
    # 4 MiB task size (split over its thread pool), and the file's last pages.
    cases = [
        (0, 4096),
        (8192, 8192),
        (1 << 20, 64 << 10),
        (3 << 20, (4 << 20) + 4096),
        (file_size - 12288, 12288),
    ]
    rng = np.random.default_rng(20261010)
    backend = KvikioBackend(threads=4)
    describe = backend.describe()
    handle = backend.open(path, writable=True)
    check_fd = os.open(path, os.O_RDWR)

    # 1. kvikio writes, concurrently; checked with plain os.pread.
    data = [random_buf(rng, n) for _, n in cases]
    futs = [backend.submit_write(handle, d, off) for d, (off, _) in zip(data, cases)]
    assert [f.result(timeout=60) for f in futs] == [n for _, n in cases]
    for d, (off, n) in zip(data, cases):
        assert os.pread(check_fd, n, off) == d.tobytes(), f"write mismatch at {off}"

    # 2. kvikio reads, concurrently, of bytes put there by os.pwrite.
    data = [random_buf(rng, n) for _, n in cases]
    for d, (off, _) in zip(data, cases):
        assert os.pwrite(check_fd, d.tobytes(), off) == d.nbytes
    outs = [aligned(n) for _, n in cases]
    for o in outs:
        o[:] = 0
    futs = [backend.submit_read(handle, o, off) for o, (off, _) in zip(outs, cases)]
    assert [f.result(timeout=60) for f in futs] == [n for _, n in cases]
    for d, o, (off, _) in zip(data, outs, cases):
        assert np.array_equal(d, o), f"read mismatch at {off}"

    # 3. kvikio write then kvikio read, with the other buffer kinds callers
    # pass: a CPU torch tensor and a bytearray.
    src = torch.from_numpy(random_buf(rng, 16384).copy())
    assert backend.submit_write(handle, src, 20 << 20).result(timeout=60) == 16384
    dst = torch.zeros(16384, dtype=torch.uint8)
    assert backend.submit_read(handle, dst, 20 << 20).result(timeout=60) == 16384
    assert torch.equal(src, dst)
    raw = bytearray(rng.integers(0, 256, 8192, dtype=np.uint8).tobytes())
    assert backend.submit_write(handle, raw, 24 << 20).result(timeout=60) == 8192
    back = bytearray(8192)
    assert backend.submit_read(handle, back, 24 << 20).result(timeout=60) == 8192
    assert back == raw

    # 4. Short transfers: across end of file the count is short, at it zero.
    tail = aligned(8192)
    assert backend.submit_read(handle, tail, file_size - 4096).result(timeout=60) == 4096
    assert tail[:4096].tobytes() == os.pread(check_fd, 4096, file_size - 4096)
    assert backend.submit_read(handle, aligned(4096), file_size).result(timeout=60) == 0

    # 5. Errors surface as OSError with an errno.
    try:
        backend.open(os.path.join(work, "missing.bin"))
    except OSError as exc:
        open_errno = exc.errno
    else:
        raise AssertionError("opening a missing file did not raise")
    ro = backend.open(path, writable=False)
    try:
        backend.submit_write(ro, aligned(4096), 0).result(timeout=60)
    except OSError as exc:
        ro_errno = exc.errno
    else:
        raise AssertionError("writing through a read-only handle did not raise")
    backend.close(ro)

    backend.close(handle)
    backend.shutdown()
    os.close(check_fd)

    auto = make_backend("auto")
    auto_name = auto.name
    auto.shutdown()
    print("RESULT " + json.dumps({
        "describe": describe,
        "cases": len(cases),
        "open_errno": open_errno,
        "ro_errno": ro_errno,
        "auto": auto_name,
    }))
"""


def test_roundtrip_through_real_kvikio(tmp_path: Path, stub_dir: Path) -> None:
    import errno

    result = run_child(ROUNDTRIP_CHILD, stub_dir, tmp_path)
    assert result["cases"] == 5
    assert result["describe"].startswith("kvikio ")
    assert "compat mode" in result["describe"]
    assert result["open_errno"] == errno.ENOENT
    assert result["ro_errno"] is not None
    assert result["auto"] == "kvikio"
    # The stub, not some real driver, served kvikio: it asked for the driver
    # version and classified the buffers through cuPointerGetAttributes.
    trace = result["_stderr"]
    assert "kvtier-cuda-stub: cuDriverGetVersion" in trace
    assert "kvtier-cuda-stub: cuPointerGetAttributes" in trace


DISK_STORE_CHILD = """
    import json
    import os

    import numpy as np

    from kvtier.store.store import DiskStore

    from kvtier.store.slot import LayoutFingerprint, ReadOutcome
    from kvtier.store.backends.kvikio import KvikioBackend

    work = os.environ["KVTIER_TEST_DIR"]
    block = 64 << 10
    fp = LayoutFingerprint(
        model="kvtier/test-model", dtype="float16", block_bytes=block,
        geometry="layers=2,heads=4,head_dim=64,block_tokens=16", tp_rank=0, tp_size=1,
    )
    rng = np.random.default_rng(7)
    backend = KvikioBackend(threads=2)
    checked = 0
    for compression in ("none", "zstd"):
        paths = [os.path.join(work, compression, "a"), os.path.join(work, compression, "b")]
        store = DiskStore(paths, 8, block, fp, backend=backend, compression=compression)
        blocks = {}
        for slot in range(8):
            if compression == "zstd":  # compressible: small fp16-like values
                data = rng.integers(0, 4, block, dtype=np.uint8)
            else:
                data = rng.integers(0, 256, block, dtype=np.uint8)
            key = f"key-{compression}-{slot}".encode()
            store.write_block(slot, key, data, store.next_seq())
            blocks[slot] = (key, data)
        for slot, (key, data) in blocks.items():
            out = np.zeros(block, dtype=np.uint8)
            outcome = store.read_block(slot, key, out)
            assert outcome == ReadOutcome.OK, (compression, slot, outcome)
            assert np.array_equal(out, data), (compression, slot)
            checked += 1
        out = np.zeros(block, dtype=np.uint8)
        assert store.read_block(0, b"some-other-key", out) == ReadOutcome.KEY_MISMATCH
        store.close()
    backend.shutdown()

    # A store that builds its own back end through the factory.
    path = os.path.join(work, "owned")
    with DiskStore([path], 2, block, fp, backend="kvikio") as store:
        name = store.backend.name
        data = rng.integers(0, 256, block, dtype=np.uint8)
        store.write_block(1, b"owned", data, store.next_seq())
        out = np.zeros(block, dtype=np.uint8)
        assert store.read_block(1, b"owned", out) == ReadOutcome.OK
        assert np.array_equal(out, data)
    print("RESULT " + json.dumps({"checked": checked, "owned_backend": name}))
"""


def test_disk_store_roundtrip_through_kvikio(tmp_path: Path, stub_dir: Path) -> None:
    result = run_child(DISK_STORE_CHILD, stub_dir, tmp_path)
    assert result["checked"] == 16
    assert result["owned_backend"] == "kvikio"


STAGING_CHILD = """
    import errno
    import json
    import logging
    import os
    import sys

    import numpy as np

    from kvtier.store.reader import SlotReader
    from kvtier.store.store import DiskStore
    from kvtier.store.backends.kvikio import KvikioBackend
    from kvtier.store.slot import HEADER_SIZE, LayoutFingerprint, ReadOutcome
    from kvtier.store.slabs import SlabFiles
    from kvtier.testing.faults import FaultInjectingBackend, FaultPlan, FaultRule, on_slot

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    work = os.environ["KVTIER_TEST_DIR"]
    block = 16 << 10
    fp = LayoutFingerprint("t/m", "float16", block, "g", 0, 1)
    paths = [os.path.join(work, "a"), os.path.join(work, "b")]
    backend = KvikioBackend(threads=2)
    store = DiskStore(paths, 8, block, fp, backend=backend)
    blocks = {}
    for slot in range(8):
        data = np.random.default_rng(slot).integers(0, 256, block, dtype=np.uint8)
        store.write_block(slot, b"k%d" % slot, data, slot + 1)
        blocks[slot] = data
    store.close()
    items = [(s, b"k%d" % s) for s in range(8)]

    def check(reader, hit, want):
        res = reader.read(items)
        rows = reader.rows.numpy()
        for (slot, _), r in zip(items, res):
            expect = want if slot in hit else ReadOutcome.OK
            assert r.outcome is expect, (slot, r, want)
            if r.outcome is ReadOutcome.OK:
                assert np.array_equal(rows[r.row], blocks[slot]), slot
        return [r.outcome.value for r in res]

    reader = SlotReader(SlabFiles.open(paths, fp, 8, backend), device="cpu", capacity=8)
    modes = [reader.mode]
    clean = check(reader, (), None)
    reader.close()
    out = {"mode": modes[0], "clean": clean}
    # Slab 1 holds slots 1, 3, 5, 7 (local 0..3): one read. A failed read
    # fails its whole run; a short one (the slab is whole: an I/O error)
    # the slots it did not cover.
    for fault, want, hit in (
        ("eio", ReadOutcome.IO_ERROR, (1, 3, 5, 7)),
        ("short", ReadOutcome.IO_ERROR, (5, 7)),
        ("flip", ReadOutcome.CHECKSUM_MISMATCH, (5,)),
    ):
        plan = FaultPlan(seed=1)
        where = on_slot(store, 5)
        if fault == "eio":
            plan.add(FaultRule.error(errno.EIO, ops="read", **where))
        elif fault == "short":
            cut = 2 * store.slot_size + HEADER_SIZE  # inside slot 5
            plan.add(FaultRule.short(cut, ops="read", **where))
        else:
            at = where["ranges"][0][0] + HEADER_SIZE + 99
            plan.add(FaultRule.bit_flip([at], ops="read", **where))
        faulty = FaultInjectingBackend(backend, plan)
        reader = SlotReader(SlabFiles.open(paths, fp, 8, faulty), device="cpu", capacity=8)
        out[fault] = check(reader, hit, want)
        assert plan.injected, fault
        reader.close()
    backend.shutdown()
    print("RESULT " + json.dumps(out))
"""


def test_device_staging_through_kvikio(tmp_path: Path, stub_dir: Path) -> None:
    """The staging reader on CPU tensors through real kvikio (compat mode on
    the stub driver): every slot verified, and EIO, a short read and a bit
    flip injected around kvikio fail only what they hit: the read of one
    slab's run, the slots after the cut, the flipped slot."""
    result = run_child(STAGING_CHILD, stub_dir, tmp_path)
    assert result["mode"] == "compat"
    assert "device staging: mode compat" in result["_stderr"]
    assert result["clean"] == ["ok"] * 8
    assert result["eio"][1::2] == ["io_error"] * 4 and result["eio"][::2] == ["ok"] * 4
    assert result["short"][5] == result["short"][7] == "io_error"
    assert result["short"].count("ok") == 6
    assert result["flip"][5] == "checksum_mismatch" and result["flip"].count("ok") == 7
