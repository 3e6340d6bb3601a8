"""Permission problems, a store directory removed under a running store, a
truncated slab, and a disk that comes back read-only."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from reliability_common import (
    BLOCK_BYTES,
    SENTINEL,
    Mounts,
    Rig,
    key_of,
    kvtier_warnings,
    make_fingerprint,
    pattern,
)

from kvtier.store.slot import ReadOutcome
from kvtier.store.store import DiskStore
from kvtier.testing.faults import FaultPlan, FaultRule, on_slot
from kvtier.testing.state import verify

NOBODY = 65534


def write_keys(store: DiskStore, n: int) -> list[bytes]:
    keys = [key_of(i) for i in range(n)]
    for slot, key in enumerate(keys):
        store.write_block(slot, key, pattern(key), store.next_seq())
    return keys


def read_ok(store: DiskStore, slot: int, key: bytes) -> bool:
    out = np.full(BLOCK_BYTES, SENTINEL, np.uint8)
    outcome = store.read_block(slot, key, out)
    if outcome is not ReadOutcome.OK:
        assert (out == SENTINEL).all()
        return False
    assert np.array_equal(out, pattern(key))
    return True


# -- permission denied ---------------------------------------------------------


def test_chmod_000_after_open_does_not_disturb_the_open_store(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig(num_slots=8)
    keys = write_keys(rig.store, 4)
    store_dir, slab = rig.store.dirs[0], rig.store.slabs[0].path
    os.chmod(slab, 0)
    os.chmod(store_dir, 0)
    try:
        # Open descriptors keep their access mode: reads and writes go on.
        assert all(read_ok(rig.store, s, k) for s, k in enumerate(keys))
        rig.store.write_block(5, key_of(5), pattern(key_of(5)), rig.store.next_seq())
        assert read_ok(rig.store, 5, key_of(5))
        assert rig.store.stats().io_errors == 0
        if os.geteuid() == 0:
            # A restart (root ignores the modes) repairs them to 0700/0600
            # and finds the blocks written before and after the chmod. The
            # running store holds the directory's lock: close it first.
            rig.engine.shutdown()
            rig.store.close()
            with DiskStore(
                rig.store.paths, 8, BLOCK_BYTES, make_fingerprint(), backend="posix"
            ) as again:
                assert stat.S_IMODE(os.stat(store_dir).st_mode) == 0o700
                assert stat.S_IMODE(os.stat(slab).st_mode) == 0o600
                assert all(read_ok(again, s, k) for s, k in enumerate(keys))
                assert read_ok(again, 5, key_of(5))
    finally:
        os.chmod(store_dir, 0o700)
        os.chmod(slab, 0o600)


def test_permission_denied_io_is_a_failed_key(
    make_rig: Callable[..., Rig], caplog: pytest.LogCaptureFixture
) -> None:
    """Root ignores file modes, so EACCES on I/O (e.g. an LSM denying it) is
    injected at the back-end boundary."""
    caplog.set_level(logging.WARNING, logger="vllm.kvtier.store")
    rig = make_rig(num_slots=8)
    keys = [key_of(i) for i in range(3)]
    for row, key in enumerate(keys):
        rig.cpu.array[row] = pattern(key)
    assert rig.spill(1, [(k, i, i) for i, k in enumerate(keys)]).success
    rig.plan.add(FaultRule.error(errno.EACCES, **on_slot(rig.store, 1)))
    rig.cpu.array[4:7] = SENTINEL
    res = rig.promote(2, [(k, i, 4 + i) for i, k in enumerate(keys)])
    assert res.lost_keys == [keys[1]]
    assert (rig.cpu.array[5] == SENTINEL).all()
    res = rig.spill(3, [(keys[1], 1, 1)])
    assert res.lost_keys == [keys[1]]
    logged = kvtier_warnings(caplog)
    for op in ("read", "write"):  # once per operation and errno
        lines = [m for m in logged if f"disk {op} failed" in m]
        assert len(lines) == 1, logged
        assert "errno 13 (EACCES)" in lines[0]
        assert rig.store.slabs[0].path in lines[0]
    assert rig.store.stats().io_errors >= 2


def test_permission_denied_at_open_fails_store_creation(tmp_path: Path) -> None:
    from kvtier.store.backends.posix import PosixBackend
    from kvtier.testing.faults import FaultInjectingBackend

    backend = FaultInjectingBackend(
        PosixBackend(threads=1), FaultPlan([FaultRule.error(errno.EACCES, ops="open")])
    )
    try:
        with pytest.raises(PermissionError) as info:
            DiskStore(
                [str(tmp_path)], 4, BLOCK_BYTES, make_fingerprint(), backend=backend
            )
        assert info.value.filename is not None
        assert info.value.filename.endswith("slab-0.kvt")
    finally:
        backend.shutdown()


@pytest.fixture
def world_traversable_dir() -> Iterator[Path]:
    """A directory 'nobody' can reach (pytest's tmp_path is root-only)."""
    d = Path(tempfile.mkdtemp(prefix="kvtier-perm-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_other_users_cannot_read_the_cache(world_traversable_dir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("switching to user nobody needs root")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    probe = as_nobody("true")
    if probe.returncode:
        pytest.skip(f"setpriv cannot switch users here: {probe.stderr.strip()}")

    base = world_traversable_dir
    with DiskStore(
        [str(base)], 4, BLOCK_BYTES, make_fingerprint(), backend="posix"
    ) as store:
        write_keys(store, 2)
        store_dir, slab = Path(store.dirs[0]), Path(store.slabs[0].path)
        assert stat.S_IMODE(store_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(slab.stat().st_mode) == 0o600

        listed = as_nobody("ls", str(store_dir))
        assert listed.returncode != 0 and "Permission denied" in listed.stderr

        # Even with the directory opened up, the 0600 files stay private...
        store_dir.chmod(0o711)
        control = store_dir / "control.txt"
        control.write_text("readable")
        control.chmod(0o644)
        try:
            for private in (slab, store_dir / "layout.json"):
                got = as_nobody("cat", str(private))
                assert got.returncode != 0 and "Permission denied" in got.stderr
            # ...while a world-readable file next to them is readable, so the
            # refusal above comes from the files' own mode.
            got = as_nobody("cat", str(control))
            assert got.returncode == 0 and got.stdout == "readable"
        finally:
            store_dir.chmod(0o700)


# -- the store directory vanishes ------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_rm_rf_under_a_running_store(
    make_rig: Callable[..., Rig], tmp_path: Path, direct: bool
) -> None:
    base = tmp_path / "vanishing"
    rig = make_rig(path=str(base), num_slots=8, direct=direct)
    keys = write_keys(rig.store, 4)
    shutil.rmtree(base)
    assert not base.exists()

    # Open descriptors still reach the (now unlinked) slab: reads are still
    # verified and correct, and writes still land.
    assert all(read_ok(rig.store, s, k) for s, k in enumerate(keys))
    assert {verify(rig.store, s) for s in range(4)} == {ReadOutcome.OK}
    rig.store.write_block(6, key_of(6), pattern(key_of(6)), rig.store.next_seq())
    assert read_ok(rig.store, 6, key_of(6))
    headers = {slot: h for slot, h, o in rig.store.scan() if o is ReadOutcome.OK}
    assert sorted(headers) == [0, 1, 2, 3, 6]
    assert rig.store.stats().io_errors == 0

    # A new store on the same path starts from scratch: nothing of the old,
    # unlinked slab can be resurrected.
    with DiskStore(
        [str(base)], 8, BLOCK_BYTES, make_fingerprint(), backend="posix"
    ) as fresh:
        assert {o for _, _, o in fresh.scan()} == {ReadOutcome.EMPTY}
        assert not read_ok(fresh, 0, keys[0])


def test_vanished_disk_that_comes_back_read_only(mounts: Mounts) -> None:
    """The path is removed while running, then its file system turns
    read-only (what ext4 does on media errors): the running store kept
    serving; a new store fails at once with an error naming the path."""
    point = mounts.mount("tmpfs", 8)
    base = os.path.join(point, "kvcache")
    os.mkdir(base)
    with DiskStore(
        [base], 8, BLOCK_BYTES, make_fingerprint(), backend="posix"
    ) as store:
        keys = write_keys(store, 3)
        shutil.rmtree(base)
        assert all(read_ok(store, s, k) for s, k in enumerate(keys))
    mounts.remount_readonly(point)
    with pytest.raises(OSError) as info:
        DiskStore([base], 8, BLOCK_BYTES, make_fingerprint(), backend="posix")
    assert info.value.errno == errno.EROFS
    assert info.value.filename is not None and base in info.value.filename


# -- the slab is truncated --------------------------------------------------------


def test_truncated_slab_is_a_counted_logged_miss(
    make_rig: Callable[..., Rig], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.kvtier.store")
    rig = make_rig(num_slots=8)
    keys = write_keys(rig.store, 6)
    slab = rig.store.slabs[0]
    os.truncate(slab.path, slab.offset(3) + 5000)  # mid-payload of slot 3
    assert all(read_ok(rig.store, s, keys[s]) for s in range(3))
    assert [read_ok(rig.store, s, keys[s]) for s in range(3, 6)] == [False] * 3
    outcomes = {s: verify(rig.store, s) for s in range(3, 6)}
    assert set(outcomes.values()) == {ReadOutcome.TRUNCATED}
    # 3 reads + 3 verifies; a truncated slab lost those bytes (not an errno).
    stats = rig.store.stats()
    assert (stats.checksum_failures, stats.io_errors) == (6, 0)
    logged = kvtier_warnings(caplog)
    assert len(logged) == 1 and "short read" in logged[0] and slab.path in logged[0]
