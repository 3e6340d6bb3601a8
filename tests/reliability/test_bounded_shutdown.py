"""Issue #11 items 6, 8, 9: failed starts show the real error, I/O set-up
failures cost misses, and a hung disk bounds drain and shutdown without
ever letting a late transfer touch a reused CPU row."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from reliability_common import (
    BLOCK_BYTES,
    SENTINEL,
    Rig,
    key_of,
    make_fingerprint,
    pattern,
)

from kvtier.host.cpu_tier import AttachedRows, CpuBlockBuffer
from kvtier.safe_open import InUseError
from kvtier.store import runtime as runtime_mod
from kvtier.store import slabs as slab_mod
from kvtier.store import store as disk_store_mod
from kvtier.store.backends.base import BackendUnavailableError
from kvtier.store.backends.posix import PosixBackend
from kvtier.store.runtime import DiskRuntime
from kvtier.store.slabs import store_dirname
from kvtier.store.store import open_stores
from kvtier.testing.faults import FaultInjectingBackend, FaultKind, FaultPlan, FaultRule
from kvtier.tiers.plans import PromoteOrder, SpillOrder, TransferItem

# -- TransferEngine ---------------------------------------------------------------


def test_shutdown_with_a_hung_disk_returns_within_its_bound(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig(num_slots=8)
    release = threading.Event()
    rig.plan.add(FaultRule.hang(release, ops="write"))
    keys = [key_of(i) for i in range(3)]
    for row, key in enumerate(keys):
        rig.cpu.array[row] = pattern(key)
    # Job 1: one batch per thread (one block each), both threads then
    # blocked in pwrite; job 2 waits in the queue behind them.
    rig.engine.submit_spill(1, [(k, i, i) for i, k in enumerate(keys[:2])])
    rig.engine.submit_spill(2, [(keys[2], 2, 2)])
    deadline = time.monotonic() + 10
    while rig.plan.count(FaultKind.HANG, "write") < 2:
        assert time.monotonic() < deadline, "the writes never reached the disk"
        time.sleep(0.01)
    t0 = time.monotonic()
    stopped = rig.engine.shutdown(timeout=1.0)
    elapsed = time.monotonic() - t0
    assert not stopped and elapsed < 20.0  # bounded: never the hung write
    release.set()  # the disk comes back: the blocked writes complete...
    # ...but the item still queued was dropped without touching its row.
    assert rig.engine.wait([1, 2], timeout=5.0)
    results = {r.job_id: r for r in rig.engine.get_finished()}
    assert sorted(results) == [1, 2]
    assert results[2].lost_keys == [keys[2]]


def test_abandoned_promotion_never_writes_its_row(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(num_slots=8)
    key = key_of(1)
    rig.cpu.array[0] = pattern(key)
    assert rig.spill(1, [(key, 0, 0)]).success
    release = threading.Event()
    rig.plan.add(FaultRule.hang(release, ops="read"))
    rig.cpu.array[5] = SENTINEL
    rig.engine.submit_promote(2, [(key, 0, 5)])
    assert not rig.engine.wait([2], timeout=0.5)  # hung in pread
    assert rig.engine.abandon(timeout=1.0)
    rig.cpu.array[5] = 0x11  # the row now belongs to someone else
    release.set()
    assert rig.engine.wait([2], timeout=5.0)
    (result,) = rig.engine.get_finished()
    assert result.lost_keys == [key]
    assert (rig.cpu.array[5] == 0x11).all()


# -- DiskRuntime --------------------------------------------------------------


@pytest.fixture
def shm_file(tmp_path: Path) -> Iterator[Callable[[int], CpuBlockBuffer]]:
    made: list[CpuBlockBuffer] = []

    def make(rows: int) -> CpuBlockBuffer:
        made.append(
            CpuBlockBuffer(rows, BLOCK_BYTES, str(tmp_path / "tier.cpu"))
        )
        return made[-1]

    yield make
    for b in made:
        b.close()


def make_runtime(tmp_path: Path, cpu_path: str, disk_io: str = "posix") -> DiskRuntime:
    stores = open_stores(
        [str(tmp_path / "disk")],
        [make_fingerprint()],
        8,
        BLOCK_BYTES,
        backend=disk_io,
        threads=2,
    )
    return DiskRuntime(stores, [AttachedRows(cpu_path, 8, BLOCK_BYTES)], threads=2)


def spill(job_id: int, keys: list[bytes]) -> SpillOrder:
    return SpillOrder(job_id, [TransferItem(k, i, i) for i, k in enumerate(keys)])


def poll_until(rt: DiskRuntime, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = rt.poll()
        if done:
            return done
        time.sleep(0.01)
    raise AssertionError("no job finished")


def test_failed_start_kvikio_absent_shows_the_real_error(tmp_path: Path) -> None:
    from kvtier.store.backends.factory import kvikio_status

    if kvikio_status()[0]:
        pytest.skip("kvikio is usable here")
    with pytest.raises(BackendUnavailableError, match="disk_io='kvikio'"):
        make_runtime(tmp_path, "/nonexistent", disk_io="kvikio")


def test_failed_start_file_where_the_store_dir_goes(tmp_path: Path) -> None:
    base = tmp_path / "disk"
    base.mkdir()
    (base / store_dirname(make_fingerprint())).write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        make_runtime(tmp_path, "/nonexistent")


def test_failed_start_enospc_at_preallocation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(slab_mod.os, "posix_fallocate", full)
    with pytest.raises(OSError, match="cannot preallocate") as info:
        make_runtime(tmp_path, "/nonexistent")
    assert info.value.errno == errno.ENOSPC
    # The store's lock died with the failed start: a retry is not "in use".
    monkeypatch.undo()
    make_runtime(tmp_path, "/nonexistent").close()


def test_io_threads_start_with_the_runtime(tmp_path: Path) -> None:
    def io_threads() -> set[int | None]:
        return {
            t.ident for t in threading.enumerate() if t.name.startswith("kvtier-xfer")
        }

    before = io_threads()
    rt = make_runtime(tmp_path, "/nonexistent")
    try:
        assert len(io_threads() - before) >= 2
    finally:
        rt.close()


def test_unmappable_cpu_tier_costs_misses_not_the_engine(tmp_path: Path) -> None:
    rt = make_runtime(tmp_path, str(tmp_path / "no-such-worker-file.cpu"))
    try:
        keys = [key_of(i) for i in range(2)]
        rt.submit_spill(spill(1, keys))  # does not raise into the step
        (done,) = poll_until(rt)
        assert done.job_id == 1 and set(done.lost_keys) == set(keys)
        assert rt.pending == 0
    finally:
        rt.close()


def test_drain_timeout_breaks_the_runtime_and_fails_what_it_held_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shm_file: Callable[[int], CpuBlockBuffer],
) -> None:
    release = threading.Event()
    plan = FaultPlan()
    real = disk_store_mod.make_backend

    def faulty(name: str, **kw):
        return FaultInjectingBackend(real(name, **kw), plan)

    monkeypatch.setattr(disk_store_mod, "make_backend", faulty)
    cpu = shm_file(8)
    rt = make_runtime(tmp_path, cpu.shm_path)
    try:
        keys = [key_of(i) for i in range(3)]
        for row, key in enumerate(keys):
            cpu.array[row] = pattern(key)
        rt.submit_spill(spill(1, keys))
        (done,) = poll_until(rt)
        assert not done.lost_keys
        plan.add(FaultRule.hang(release, ops=("read", "write")))
        cpu.array[4:7] = SENTINEL
        rt.submit_promote(
            PromoteOrder(2, [TransferItem(k, i, 4 + i) for i, k in enumerate(keys)])
        )
        t0 = time.monotonic()
        assert rt.drain(timeout=0.5) is False
        assert time.monotonic() - t0 < 15.0  # bounded, not the hung I/O
        assert rt.broken and rt.pending == 0
        # The caller may now reuse every row: nothing writes them any more.
        cpu.array[4:7] = 0x22
        rt.submit_spill(spill(3, keys[:1]))  # refused at once: a miss
        # The given-up promotion is reported once, failed whole (vLLM's
        # tiering manager asserts that every job came back after a drain),
        # and the refused spill with it.
        got = {r.job_id: set(r.lost_keys) for r in rt.poll()}
        assert got == {2: set(keys), 3: {keys[0]}}
        release.set()
        time.sleep(0.5)
        assert rt.poll() == []  # job 2's late result never surfaces again
        assert (cpu.array[4:7] == 0x22).all()
    finally:
        release.set()
        t0 = time.monotonic()
        rt.close()
        assert time.monotonic() - t0 < 15.0


def test_close_with_a_hung_disk_is_bounded(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shm_file: Callable[[int], CpuBlockBuffer],
) -> None:
    release = threading.Event()
    plan = FaultPlan([FaultRule.hang(release, ops="write")])
    made: list[FaultInjectingBackend] = []

    def faulty(name: str, *, threads: int = 4, **_why):
        made.append(FaultInjectingBackend(PosixBackend(threads), plan))
        return made[-1]

    monkeypatch.setattr(disk_store_mod, "make_backend", faulty)
    cpu = shm_file(8)
    rt = make_runtime(tmp_path, cpu.shm_path)
    try:
        rt.submit_spill(spill(1, [key_of(0), key_of(1)]))
        deadline = time.monotonic() + 10
        while plan.count(FaultKind.HANG, "write") < 1:
            assert time.monotonic() < deadline, "the write never reached the disk"
            time.sleep(0.01)
        t0 = time.monotonic()
        rt.close(timeout=1.0)
        assert time.monotonic() - t0 < 20.0  # bounded, not the hung write
        assert rt.broken
        # The store stays locked while the write is blocked (it may still
        # land), and is released once it returned: a new runtime in this
        # process takes it (it had been "in use" by this pid for good).
        with pytest.raises(InUseError):
            make_runtime(tmp_path, cpu.shm_path)
        release.set()
        deadline = time.monotonic() + 10
        while True:
            try:
                again = make_runtime(tmp_path, cpu.shm_path)
                break
            except InUseError:
                assert time.monotonic() < deadline, "the store was never released"
                time.sleep(0.05)
        again.close()
    finally:
        release.set()


@pytest.fixture
def stalled(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shm_file: Callable[[int], CpuBlockBuffer],
    caplog: pytest.LogCaptureFixture,
) -> Iterator[tuple[DiskRuntime, threading.Event]]:
    """A runtime whose writes hang until the event is set (STALL_S 0.3 s),
    its log captured; released and closed at the end."""
    release = threading.Event()
    plan = FaultPlan([FaultRule.hang(release, ops="write")])

    def faulty(name: str, *, threads: int = 4, **_why):
        return FaultInjectingBackend(PosixBackend(threads), plan)

    monkeypatch.setattr(disk_store_mod, "make_backend", faulty)
    monkeypatch.setattr(runtime_mod, "STALL_S", 0.3)
    rt = make_runtime(tmp_path, shm_file(8).shm_path)
    caplog.set_level(logging.INFO, logger="vllm.kvtier")
    try:
        yield rt, release
    finally:
        release.set()
        rt.close()


def _said_stalled(rt: DiskRuntime, caplog: pytest.LogCaptureFixture) -> None:
    deadline = time.monotonic() + 10
    while "no disk job has finished" not in caplog.text:
        assert time.monotonic() < deadline, "the stall was never said"
        assert rt.poll() == []
        time.sleep(0.01)


def test_a_hung_write_is_said_once_and_its_return_too(
    stalled: tuple[DiskRuntime, threading.Event], caplog: pytest.LogCaptureFixture
) -> None:
    """A write has no deadline (a pwrite cannot be taken back), so a hung
    drive held spills without a word until it recovered: the runtime says
    so once, from the polls, when no job returned for STALL_S while some
    wait, and again when they return."""
    rt, release = stalled
    rt.submit_spill(spill(1, [key_of(0)]))
    rt.submit_spill(spill(2, [key_of(1)]))
    _said_stalled(rt, caplog)
    said = [r for r in caplog.records if "no disk job" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR
    assert "2 waiting" in said[0].getMessage()
    assert "jobs run in the engine's process" in said[0].getMessage()
    time.sleep(0.4)
    rt.poll()  # still stalled: said once
    assert sum("no disk job" in r.getMessage() for r in caplog.records) == 1
    assert rt.stalled_s() > 0.7  # the disk_stalled_seconds gauge
    release.set()
    returned: set[int] = set()
    while returned != {1, 2}:
        returned |= {j.job_id for j in poll_until(rt)}
    assert "disk jobs return again" in caplog.text
    assert rt.stalled_s() == 0.0


def test_jobs_given_up_at_a_drain_are_no_sign_of_the_drive(
    stalled: tuple[DiskRuntime, threading.Event], caplog: pytest.LogCaptureFixture
) -> None:
    """Jobs a drain gave up (or refused) leave the runtime without their
    I/O returning: the write is still hung, so no 'return again' is said."""
    rt, _release = stalled
    rt.submit_spill(spill(1, [key_of(0)]))
    _said_stalled(rt, caplog)
    assert not rt.drain(timeout=0.3)  # a hung disk: broken
    rt.submit_spill(spill(2, [key_of(1)]))  # refused at once
    assert {j.job_id for j in rt.poll()} == {1, 2}
    assert "disk jobs return again" not in caplog.text


def test_second_runtime_on_one_disk_path_is_refused(tmp_path: Path) -> None:
    first = make_runtime(tmp_path, "/nonexistent")
    try:
        with pytest.raises(InUseError, match="disk_path") as info:
            make_runtime(tmp_path, "/nonexistent")
        assert str(tmp_path / "disk") in str(info.value)
    finally:
        first.close()
    make_runtime(tmp_path, "/nonexistent").close()  # free again
