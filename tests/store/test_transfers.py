from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.host.cpu_tier import CpuBlockBuffer
from kvtier.store.backends.posix import PosixBackend
from kvtier.store.compression import Codec
from kvtier.store.slot import HEADER_SIZE, LayoutFingerprint, ReadOutcome
from kvtier.store.store import DiskStore
from kvtier.store.transfers import (
    CANCELLED,
    IO_FAILED,
    SPILL_PRIORITY,
    TransferEngine,
    _Job,
)

BLOCK_BYTES = 64 * 1024  # matches the conftest fingerprint
N = 12  # blocks per round trip


@dataclass(frozen=True)
class JobOutcome:
    """What a job function of :class:`FnEngine` reports."""

    success: bool
    bytes: int = 0
    failed_keys: list[bytes] = field(default_factory=list)


class FnEngine(TransferEngine):
    """A TransferEngine that also runs plain functions as one-item jobs, to
    test the queue itself: pending jobs, waits, priorities, a job that
    raises."""

    def submit(
        self,
        job_id: int,
        fn: Callable[[], JobOutcome],
        *,
        priority: int = SPILL_PRIORITY,
    ) -> None:
        job = self._begin(job_id, [], 1, False)

        def task() -> None:
            try:
                outcome = fn()
                ok = outcome.success and not outcome.failed_keys
            except Exception:
                outcome, ok = JobOutcome(success=False), False
            job.item_done(b"fn", outcome.bytes if ok else IO_FAILED)
            self._finish(job)

        self._enqueue(priority, task)


def key(i: int) -> bytes:
    return i.to_bytes(32, "little") + b"\x00\x00\x00\x00"


def fill_kv(
    buf: CpuBlockBuffer, rows: range, dtype: torch.dtype, seed: int = 0
) -> None:
    """KV-shaped data: normal values in a 16-bit float dtype, viewed as bytes."""
    g = torch.Generator().manual_seed(seed)
    vals = torch.randn(len(rows), BLOCK_BYTES // 2, generator=g).to(dtype)
    buf.tensor[rows.start : rows.stop] = vals.view(torch.uint8)


@pytest.fixture
def engine_on(
    tmp_path: Path, shm_dir: str, fingerprint: LayoutFingerprint
) -> Iterator[Any]:
    made: list[Any] = []

    def build(where: str, npaths: int, compression: str, **kw: Any) -> FnEngine:
        base = Path(shm_dir) if where == "shm" else tmp_path
        paths = [str(base / f"p{i}") for i in range(npaths)]
        backend: Any = PosixBackend(threads=2, direct=where != "tmp-buffered")
        store = DiskStore(
            paths,
            2 * N,
            BLOCK_BYTES,
            fingerprint,
            backend=backend,
            compression=compression,
        )
        buf = CpuBlockBuffer(3 * N, BLOCK_BYTES)
        eng = FnEngine([store], [buf], threads=kw.get("threads", 4))
        made.append((eng, store, buf, backend))
        return eng

    yield build
    for eng, store, buf, backend in made:
        eng.shutdown()
        store.close()
        buf.close()
        backend.shutdown()


@pytest.mark.parametrize("where", ["tmp", "shm", "tmp-buffered"])
@pytest.mark.parametrize("npaths", [1, 2])
@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_spill_promote_roundtrip_is_byte_exact(
    engine_on: Any, where: str, npaths: int, compression: str, dtype: torch.dtype
) -> None:
    eng: TransferEngine = engine_on(where, npaths, compression)
    buf, store = eng.rows[0], eng.stores[0]
    fill_kv(buf, range(0, N), dtype)
    original = buf.array[:N].copy()

    # CPU rows 0..N-1 -> disk slots 2N-1, 2N-3, ... (odd slots, scattered)
    disk_slots = [2 * N - 1 - 2 * i for i in range(N)]
    eng.submit_spill(1, [(key(i), i, disk_slots[i]) for i in range(N)])
    assert eng.wait([1], timeout=30)
    [spill] = eng.get_finished()
    assert (spill.job_id, spill.success, spill.lost_keys) == (1, True, [])
    assert spill.bytes == N * BLOCK_BYTES and spill.seconds > 0

    # Disk -> different CPU rows (2N..3N-1, in reverse order), which hold junk.
    buf.array[N:] = 0xAB
    eng.submit_promote(2, [(key(i), disk_slots[i], 3 * N - 1 - i) for i in range(N)])
    assert eng.wait([2], timeout=30)
    [promote] = eng.get_finished()
    assert (promote.success, promote.lost_keys, promote.bytes) == (
        True,
        [],
        N * BLOCK_BYTES,
    )
    for i in range(N):
        assert buf.array[3 * N - 1 - i].tobytes() == original[i].tobytes(), i
    assert buf.array[:N].tobytes() == original.tobytes()  # sources untouched
    assert (buf.array[N : 2 * N] == 0xAB).all()  # rows nobody targeted

    stats = store.stats()
    codecs = {h.codec for _, h, _ in store.scan() if h is not None}
    if compression == "zstd":
        # KV data in 16-bit floats compresses by more than the 5% threshold.
        assert codecs == {Codec.ZSTD_BYTEPLANE}
        assert stats.write_bytes < N * (HEADER_SIZE + BLOCK_BYTES)
    else:
        assert codecs == {Codec.RAW}
        assert stats.write_bytes == N * (HEADER_SIZE + BLOCK_BYTES)
    handles_direct = {h.direct for h in store.files.handles}
    assert handles_direct == ({False} if where == "tmp-buffered" else handles_direct)


@pytest.mark.usefixtures("reject_o_direct")
def test_roundtrip_when_filesystem_rejects_o_direct(engine_on: Any) -> None:
    eng: TransferEngine = engine_on("shm", 2, "none")
    buf, store = eng.rows[0], eng.stores[0]
    assert {h.direct for h in store.files.handles} == {False}
    fill_kv(buf, range(0, 4), torch.bfloat16, seed=3)
    eng.submit_spill(1, [(key(i), i, i) for i in range(4)])
    eng.submit_promote(2, [(key(i), i, 10 + i) for i in range(4)])  # may run first...
    assert eng.wait([1, 2], timeout=30)
    eng.get_finished()
    eng.submit_promote(3, [(key(i), i, 20 + i) for i in range(4)])  # ...this one can't
    assert eng.wait([3], timeout=30)
    [res] = eng.get_finished()
    assert res.success
    assert buf.array[20:24].tobytes() == buf.array[0:4].tobytes()


def test_failed_promote_keys_leave_rows_untouched(engine_on: Any) -> None:
    eng: TransferEngine = engine_on("tmp", 1, "zstd")
    buf, store = eng.rows[0], eng.stores[0]
    fill_kv(buf, range(0, 3), torch.bfloat16)
    eng.submit_spill(1, [(key(i), i, i) for i in range(3)])
    assert eng.wait([1], timeout=30)
    # Corrupt slot 1's payload on disk.
    slab = store.slabs[0]
    with open(slab.path, "r+b") as f:
        f.seek(slab.offset(1) + HEADER_SIZE + 10)
        f.write(b"\x00\x01\x02")
    buf.array[10:15] = 0xEE
    items = [
        (key(0), 0, 10),  # ok
        (key(1), 1, 11),  # checksum mismatch
        (key(9), 2, 12),  # wrong key
        (key(3), 3, 13),  # empty slot
        (key(2), 2, 14),  # ok
    ]
    eng.submit_promote(2, items)
    assert eng.wait([2], timeout=30)
    results = {r.job_id: r for r in eng.get_finished()}
    res = results[2]
    assert not res.success
    assert sorted(res.lost_keys) == sorted([key(1), key(9), key(3)])
    assert res.bytes == 2 * BLOCK_BYTES
    assert buf.array[10].tobytes() == buf.array[0].tobytes()
    assert buf.array[14].tobytes() == buf.array[2].tobytes()
    assert (buf.array[11:14] == 0xEE).all()


def test_failed_spill_reports_keys(
    tmp_path: Path, fingerprint: LayoutFingerprint, fault_backend: Any
) -> None:
    backend = fault_backend(write_errno=errno.ENOSPC, fail_offsets={0})  # slot 0 only
    with (
        DiskStore(
            [str(tmp_path)], 4, BLOCK_BYTES, fingerprint, backend=backend
        ) as store,
        CpuBlockBuffer(2, BLOCK_BYTES) as buf,
    ):
        eng = TransferEngine([store], [buf], threads=2)
        eng.submit_spill(7, [(key(0), 0, 0), (key(1), 1, 1)])
        assert eng.wait([7], timeout=30)
        [res] = eng.get_finished()
        assert (res.success, res.lost_keys, res.bytes) == (
            False,
            [key(0)],
            BLOCK_BYTES,
        )
        eng.shutdown()


def test_a_spill_larger_than_its_threads_batches_is_written_whole(
    engine_on: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spill of more blocks than its threads' batches hold goes out in
    several batches per thread, each block written once, byte-exact."""
    from kvtier.store import store as store_module

    eng: TransferEngine = engine_on("tmp", 1, "none", threads=2)
    buf, store = eng.rows[0], eng.stores[0]
    monkeypatch.setattr(store_module, "BATCH_BYTES", 3 * store.slot_size)
    assert store.batch_capacity() == 3
    fill_kv(buf, range(0, N), torch.bfloat16)
    seen: list[int] = []
    real = store.write_blocks

    def write_blocks(slots: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(len(slots))
        return real(slots, *args, **kwargs)

    monkeypatch.setattr(store, "write_blocks", write_blocks)
    # Rows 0..N-1 into slots 2N-1, 2N-3, ... (no two adjacent).
    eng.submit_spill(1, [(key(i), i, 2 * N - 1 - 2 * i) for i in range(N)])
    assert eng.wait([1], timeout=30)
    [res] = eng.get_finished()
    assert (res.success, res.bytes) == (True, N * BLOCK_BYTES)
    assert sorted(seen) == [3] * (N // 3)
    assert store.stats().blocks_written == N
    out = np.zeros(BLOCK_BYTES, dtype=np.uint8)
    for i in range(N):
        assert store.read_block(2 * N - 1 - 2 * i, key(i), out) is ReadOutcome.OK
        assert out.tobytes() == buf.array[i].tobytes(), i


def test_an_item_that_raises_fails_its_key_and_keeps_the_engine(
    tmp_path: Path,
    fingerprint: LayoutFingerprint,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bug in moving a spill's batch or a promotion's item (an exception,
    not an I/O error) fails those keys as never moved (their disk copies are
    not shown bad), is logged, and the engine goes on with the next job."""
    with (
        DiskStore([str(tmp_path)], 4, BLOCK_BYTES, fingerprint) as store,
        CpuBlockBuffer(2, BLOCK_BYTES) as buf,
    ):
        eng = TransferEngine([store], [buf], threads=1)
        try:
            real = store.write_blocks

            def write_blocks(slots: Any, keys: Any, *args: Any, **kwargs: Any) -> Any:
                if key(0) in keys:
                    raise RuntimeError("a bug")
                return real(slots, keys, *args, **kwargs)

            monkeypatch.setattr(store, "write_blocks", write_blocks)
            eng.submit_spill(1, [(key(0), 0, 0), (key(1), 1, 1)])  # one batch
            assert eng.wait([1], timeout=30)
            [res] = eng.get_finished()
            assert (res.success, res.lost_keys, res.io_failed_keys, res.bytes) == (
                False,
                [key(0), key(1)],
                [key(0), key(1)],
                0,
            )
            assert "job 1 failed" in caplog.text
            eng.submit_spill(2, [(key(2), 0, 2)])
            assert eng.wait([2], timeout=30)
            assert [r.success for r in eng.get_finished()] == [True]
        finally:
            eng.shutdown()


def test_a_spill_copy_that_outlasts_abandon_is_never_written(
    engine_on: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """abandon() waits a bounded time for row copies in progress; after it
    gave up, the caller reuses the rows, so a spill still copying its row
    may have staged two blocks' bytes. Written under the key with a valid
    checksum, a warm restart would serve them: it must never be written."""
    eng: TransferEngine = engine_on("tmp", 1, "none", threads=1)
    buf, store = eng.rows[0], eng.stores[0]
    fill_kv(buf, range(0, 1), torch.bfloat16)
    copying, done_copying = threading.Event(), threading.Event()
    real = store.write_blocks

    def slow_copy(slots, keys, rows, row_ids, *, on_staged=None, seqs=None):
        def staged_late() -> None:  # the row copy takes this long
            copying.set()
            done_copying.wait(30)
            on_staged()

        return real(slots, keys, rows, row_ids, on_staged=staged_late, seqs=seqs)

    monkeypatch.setattr(store, "write_blocks", slow_copy)
    eng.submit_spill(1, [(key(0), 0, 0)])
    assert copying.wait(30)
    assert eng.abandon(timeout=0.1) is False  # gave up on the copy
    buf.array[0] = 0x5A  # the row's next owner writes it
    done_copying.set()
    assert eng.wait([1], timeout=30)
    [res] = eng.get_finished()
    assert res.lost_keys == [key(0)]
    out = np.zeros(BLOCK_BYTES, dtype=np.uint8)
    assert store.read_block(0, key(0), out) is ReadOutcome.EMPTY  # not written


def test_generic_jobs_wait_pending_and_errors(engine_on: Any) -> None:
    eng: FnEngine = engine_on("tmp", 1, "none", threads=2)
    gate = threading.Event()

    def blocked() -> JobOutcome:
        gate.wait(10)
        return JobOutcome(success=True, bytes=5)

    def broken() -> JobOutcome:
        raise RuntimeError("boom")

    eng.submit(1, blocked)
    eng.submit(2, broken)
    with pytest.raises(ValueError):
        eng.submit(1, blocked)  # id still pending
    assert eng.wait([2], timeout=10)
    assert not eng.wait([1], timeout=0.05)
    assert eng.pending() == 1
    gate.set()
    assert eng.wait([1, 2, 99], timeout=10)  # 99 was never submitted
    results = {r.job_id: r for r in eng.get_finished()}
    assert results[1].success and results[1].bytes == 5
    assert not results[2].success and results[2].bytes == 0
    assert eng.get_finished() == [] and eng.pending() == 0
    eng.submit_spill(3, [])
    assert [r.success for r in eng.get_finished()] == [True]
    eng.submit(4, lambda: JobOutcome(success=True, failed_keys=[b"k"]))
    assert eng.wait([4], timeout=30)
    assert not eng.get_finished()[0].success  # failed keys imply failure


def test_promotes_overtake_queued_spills(engine_on: Any) -> None:
    eng: FnEngine = engine_on("tmp", 1, "none", threads=1)
    fill_kv(eng.rows[0], range(0, 4), torch.bfloat16)
    eng.submit_spill(1, [(key(0), 0, 0)])
    assert eng.wait([1], timeout=30)
    eng.get_finished()
    started, gate = threading.Event(), threading.Event()

    def occupy() -> JobOutcome:
        started.set()
        gate.wait(10)
        return JobOutcome(success=True)

    eng.submit(2, occupy)  # holds the only worker while the others queue up
    assert started.wait(10)
    eng.submit_spill(3, [(key(i), i, i) for i in range(1, 4)])
    eng.submit_promote(4, [(key(0), 0, 20)])
    gate.set()
    assert eng.wait([2, 3, 4], timeout=30)
    order = [r.job_id for r in eng.get_finished()]
    assert order == [2, 4, 3]


def test_cancel_queued_fails_what_has_not_started_without_io(engine_on: Any) -> None:
    """A connector reset cancels the queue: the items submitted before
    ``cancel_queued`` that had not started fail without touching a slot or
    a row (every key failed, I/O-failed and cancelled, nothing shown bad),
    the one moving finishes, and the engine runs what comes after."""
    eng: FnEngine = engine_on("tmp", 1, "none", threads=1)
    buf, store = eng.rows[0], eng.stores[0]
    fill_kv(buf, range(0, 8), torch.bfloat16)
    started, gate = threading.Event(), threading.Event()

    def occupy() -> JobOutcome:
        started.set()
        gate.wait(10)
        return JobOutcome(success=True, bytes=1)

    eng.submit(1, occupy)  # moving when the cancel comes
    assert started.wait(10)
    spilled = [(key(i), i, i) for i in range(4)]
    eng.submit_spill(2, spilled)
    buf.array[20:22] = 0xEE
    eng.submit_promote(3, [(key(9), 9, 20), (key(10), 10, 21)])
    eng.cancel_queued()
    eng.submit_spill(4, [(key(i), i, i) for i in range(4, 6)])
    gate.set()
    assert eng.wait([1, 2, 3, 4], timeout=30)
    results = {r.job_id: r for r in eng.get_finished()}
    assert results[1].success
    keys = [k for k, _, _ in spilled]
    cancelled = results[2]
    assert not cancelled.success and cancelled.bytes == 0
    assert cancelled.lost_keys == cancelled.io_failed_keys == keys
    assert cancelled.cancelled_keys == keys
    promote = results[3]
    assert promote.cancelled_keys == promote.io_failed_keys == [key(9), key(10)]
    assert (buf.array[20:22] == 0xEE).all()  # rows untouched
    for i in range(4):  # the cancelled spill's slots were never written
        out = np.zeros(BLOCK_BYTES, np.uint8)
        assert store.read_block(i, key(i), out) is not ReadOutcome.OK
    after = results[4]
    assert after.success and after.cancelled_keys == []
    assert after.bytes == 2 * BLOCK_BYTES
    for i in range(4, 6):
        out = np.zeros(BLOCK_BYTES, np.uint8)
        assert store.read_block(i, key(i), out) is ReadOutcome.OK
        assert np.array_equal(out, buf.array[i])
    assert store.stats().blocks_written == 2


def test_a_key_cancelled_on_one_rank_and_failed_on_another_is_a_failure() -> None:
    """A job's ``cancelled_keys`` are the keys that failed only because of
    the cancel, on every rank they failed on: a key whose write failed on
    another rank is a failure (counted as one), not a cancellation."""
    job = _Job(1, [key(0), key(1)], 4, spill=True)
    job.item_done(key(0), CANCELLED)  # rank 0
    job.item_done(key(1), CANCELLED)
    job.item_done(key(0), IO_FAILED)  # rank 1: the drive failed it
    assert job.item_done(key(1), CANCELLED)
    res = job.result()
    assert res.lost_keys == res.io_failed_keys == [key(0), key(1)]
    assert res.cancelled_keys == [key(1)]


def test_shutdown_drains_then_rejects(engine_on: Any) -> None:
    eng: TransferEngine = engine_on("tmp", 1, "none", threads=1)
    fill_kv(eng.rows[0], range(0, 8), torch.float16)
    eng.submit_spill(1, [(key(i), i, i) for i in range(8)])
    eng.shutdown()
    [res] = eng.get_finished()
    assert res.success and res.bytes == 8 * BLOCK_BYTES
    with pytest.raises(RuntimeError):
        eng.submit_spill(2, [])
    eng.shutdown()


def test_geometry_mismatch(tmp_path: Path, fingerprint: LayoutFingerprint) -> None:
    with (
        DiskStore(
            [str(tmp_path)], 2, BLOCK_BYTES, fingerprint, backend="posix"
        ) as store,
        CpuBlockBuffer(2, BLOCK_BYTES // 2) as buf,
        pytest.raises(ValueError),
    ):
        TransferEngine([store], [buf])


def test_rows_are_numpy_views(engine_on: Any) -> None:
    eng: TransferEngine = engine_on("tmp", 1, "none")
    assert isinstance(eng.rows[0].array, np.ndarray)
