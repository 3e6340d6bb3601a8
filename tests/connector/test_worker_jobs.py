"""A job is done only when every one of its transfers landed.

On accelerators a worker job is several asynchronous transfers (one per
KV-cache group and host area, and one per read batch of a disk
load), issued by two threads: the model runner's (stores, CPU-tier rows)
and the worker's load thread (disk batches), each through a copy path of
its own. This drives the real spec's manager and worker (real disk tier,
real files) with both copy paths swapped for ones that land transfers late,
as a GPU's streams would: one per poll, or when waited on. The worker must
not report a job before all of its transfers landed, the load thread must
wait for transfers still reading the bounce area before the next disk read
overwrites it (also across jobs), and ``wait`` must return once a job's
transfers landed."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from contextlib import contextmanager

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext  # noqa: E402

from kvtier.connector import metrics  # noqa: E402
from kvtier.connector.worker_report import WorkerCounters, WorkerReport  # noqa: E402
from kvtier.host.block_copy import HostCopies  # noqa: E402
from kvtier.store.runtime import DiskRuntime  # noqa: E402
from kvtier.testing.faults import (  # noqa: E402
    FaultKind,
    FaultPlan,
    FaultRule,
    inject_faults,
)
from kvtier.testing.offloading import tiered_spec, wait_jobs  # noqa: E402
from kvtier.testing.state import num_loads
from tests.connector.test_request_runner import (  # noqa: E402
    RequestRunner,
    make_config,
    push_to_disk,
)


class LateCopies:
    """The CPU copy path, landing each transfer late: ``poll`` lands the
    oldest one per call (none on the first call after a submit) and reports
    what landed, ``wait`` lands the given ones (and, in order, those queued
    before them), as CUDA streams and events would."""

    synchronous = False

    def __init__(self, inner: HostCopies):
        self.inner = inner
        self.queued: OrderedDict[int, tuple] = OrderedDict()
        self.next_id = 0
        self.fresh = False
        self.landed: list[int] = []
        self.unreported: list[int] = []
        # Stream order, as on CUDA: marks handed out (model runner's path),
        # and the latest mark followed when each transfer was submitted (load
        # thread's path). A stream's waits add up: following mark 1 after
        # mark 2 (job 2's batch read first) leaves mark 2 in force.
        self.marks = 0
        self.followed: list[int] = []
        self.after: dict[int, tuple[int | None, list[int]]] = {}

    def submit(self, area, group, plan, to_host, expedited=False):
        self.next_id += 1
        self.queued[self.next_id] = (area, group, plan, to_host)
        last = max(self.followed) if self.followed else None
        self.after[self.next_id] = (last, [int(b) for b in plan.gpu_ids])
        self.fresh = True
        return self.next_id

    def _land(self, transfer: int) -> None:
        self.inner.submit(*self.queued.pop(transfer))
        self.landed.append(transfer)
        self.unreported.append(transfer)

    def poll(self) -> dict[int, float]:
        if not self.fresh and self.queued:
            self._land(next(iter(self.queued)))
        self.fresh = False
        done, self.unreported = self.unreported, []
        return {transfer: 0.001 for transfer in done}

    def wait(self, transfers: set[int]) -> None:
        if not transfers & set(self.queued):
            return
        last = max(transfers & set(self.queued))
        for transfer in [t for t in self.queued if t <= last]:
            self._land(transfer)

    def drain(self) -> None:
        for transfer in list(self.queued):
            self._land(transfer)

    def mark(self) -> int:
        self.marks += 1
        return self.marks

    def follow(self, mark: int) -> None:
        self.followed.append(mark)

    def shutdown(self) -> None:
        for transfer in list(self.queued):
            self._land(transfer)
        self.inner.shutdown()


@pytest.fixture
def runner(tmp_path):
    r = RequestRunner(tiered_spec(make_config(tmp_path, cpu_blocks=8, disk_blocks=32)))
    inner = r.worker.copies
    assert r.worker.loads.copies is inner  # the CPU platform shares one
    # One late path per thread, as on accelerators.
    r.worker.copies = LateCopies(inner)
    r.worker.loads.copies = LateCopies(inner)
    yield r
    r.close()


@contextmanager
def landing_at_once(r: RequestRunner):
    """Inside the block both threads copy synchronously (to set data up)."""
    model, load = r.worker.copies, r.worker.loads.copies
    r.worker.copies, r.worker.loads.copies = model.inner, load.inner
    try:
        yield
    finally:
        r.worker.copies, r.worker.loads.copies = model, load


def _no_copy_in_flight(r: RequestRunner) -> None:
    ring = r.worker.loads.ring
    assert not ring.transfers and not any(part.transfers for part in ring.parts)


def _book_empty(r: RequestRunner) -> bool:
    """No job and no transfer in flight."""
    return not r.worker.book.jobs and not r.worker.book._owner


def _submit_disk_load(r: RequestRunner, name: str, keys, gpu_blocks, job_id: int):
    assert r.lookup(name, keys) == len(keys)
    ctx = r.ctx
    spec = r.manager.prepare_load(keys, ctx)
    assert spec.on_disk.all()
    for t in r.kv:
        t[gpu_blocks] = 0
    dst = GPULoadStoreSpec(gpu_blocks, [len(gpu_blocks)], [0])
    assert r.worker.submit_load(job_id, spec, dst)
    return ctx


def _finish(r: RequestRunner, keys, gpu_blocks, ctx: ReqContext) -> None:
    r.manager.complete_load(keys, ctx)
    r.manager.on_request_finished(ctx)
    for key, b in zip(keys, gpu_blocks):
        for layer, t in enumerate(r.kv):
            assert torch.equal(t[b], r.truth[key][layer]), (key.hex(), layer)


def _guard_reads(r: RequestRunner, late: LateCopies) -> list[tuple[int, int]]:
    """Check, at every disk read the load thread starts, that no transfer
    still in flight reads the bounce rows it is about to overwrite; returns
    the (first row, slots) of each read, in order."""
    reader = r.worker.reader
    real = reader.submit
    reads: list[tuple[int, int]] = []

    def submit(items, first_row=0):
        rows = set(range(first_row, first_row + len(items)))
        for area, _group, plan, _to_host in list(late.queued.values()):
            if area == "disk":
                assert not rows & {int(x) for x in plan.row_ids}, (
                    "a read overwrites bounce rows a copy still reads"
                )
        reads.append((first_row, len(items)))
        return real(items, first_row=first_row)

    reader.submit = submit
    return reads


def _poll_until(r: RequestRunner, job_ids: set[int], timeout: float = 10.0):
    """``get_finished`` each step until ``job_ids`` were reported; returns
    the results and how many polls it took."""
    deadline = time.monotonic() + timeout
    done, polls = [], 0
    while {d.job_id for d in done} != job_ids:
        assert time.monotonic() < deadline, f"jobs {job_ids} not finished: {done}"
        done += r.worker.get_finished()
        polls += 1
        time.sleep(0.001)
    return done, polls


def test_a_job_is_reported_only_when_every_transfer_landed(runner):
    r = runner
    with landing_at_once(r):
        keys = push_to_disk(r, [1, 2, 3, 4])
    late = r.worker.loads.copies
    # Two bounce parts of one slot: four read batches, four transfers. The third
    # and fourth reads reuse a part: each waits for the copy of the batch
    # that was in it, which lands only on a later poll (checked at every
    # read, see _guard_reads).
    r.worker.reader.capacity = 2
    reads = _guard_reads(r, late)
    # What was still in flight when the load thread gave the task back.
    in_flight_at_return: list[list[int]] = []
    give_back = r.worker.loads._done

    def done(task):
        in_flight_at_return.append(list(late.queued))
        give_back(task)

    r.worker.loads._done = done
    ctx = _submit_disk_load(r, "a", keys, [40, 41, 42, 43], job_id=7)
    seen = []
    deadline = time.monotonic() + 10
    while not seen:
        assert time.monotonic() < deadline
        seen = r.worker.get_finished()
        if not seen:
            # Never reported while a block is unfilled.
            landed = sum(1 for t in late.landed if t <= 4)
            assert landed < 4 or not late.queued
        time.sleep(0.001)
    assert [(d.job_id, d.success) for d in seen] == [(7, True)]
    assert in_flight_at_return == [[]]
    assert late.landed == [1, 2, 3, 4] and not late.queued
    # Which part the third and fourth reads reuse depends on which batch's
    # read returned (and copy landed) first: a slow first read may hold part
    # 0 while part 1 serves both.
    assert reads[:2] == [(0, 1), (1, 1)] and len(reads) == 4
    assert set(reads) == {(0, 1), (1, 1)}
    assert seen[0].transfer_size == 4 * r.worker.block_bytes[0]
    _no_copy_in_flight(r)
    _finish(r, keys, [40, 41, 42, 43], ctx)


def test_disk_copies_follow_the_model_stream_as_it_was_at_submission(runner):
    """On CUDA the load thread issues a job's copies on its own stream, which
    must first wait for what the model runner's stream did before
    ``submit_load`` (vLLM orders loads after pending writes to their
    blocks): every disk transfer of a job is submitted after its thread
    followed the mark taken at that job's submission (or a later one: the
    model's stream runs in order)."""
    r = runner
    with landing_at_once(r):
        first = push_to_disk(r, [1, 2], others="bcdef")
    model, late = r.worker.copies, r.worker.loads.copies
    second = r.keys("b", 4)[:2]
    r.worker.reader.capacity = 2  # a batch per block
    ctx_a = _submit_disk_load(r, "a", first, [40, 41], job_id=1)
    ctx_b = _submit_disk_load(r, "b", second, [44, 45], job_id=2)
    assert model.marks == 2  # one per job, on the model runner's path
    done, _ = _poll_until(r, {1, 2})
    assert all(d.success for d in done)
    # Four transfers, each after its own job's mark (1 or 2) was followed.
    job_mark = {40: 1, 41: 1, 44: 2, 45: 2}
    assert sorted(late.after) == [1, 2, 3, 4]
    for followed, gpu_ids in late.after.values():
        assert followed is not None and followed >= job_mark[gpu_ids[0]]
    assert sorted(late.followed) == [1, 2]
    assert not model.followed and late.marks == 0  # each path its own role
    _finish(r, first, [40, 41], ctx_a)
    _finish(r, second, [44, 45], ctx_b)


def test_the_next_disk_read_waits_for_copies_still_reading_the_bounce_area(runner):
    r = runner
    with landing_at_once(r):
        first = push_to_disk(r, [1, 2], others="bcdef")
    late = r.worker.loads.copies
    second, third = r.keys("b", 4)[:2], r.keys("c", 4)[:2]
    on_disk = [r.manager.hierarchy.lookup(k).name for k in second + third]
    assert on_disk == ["HIT_DISK"] * 4
    reader = r.worker.reader
    reader.capacity = 4  # two parts of two slots
    reads = _guard_reads(r, late)
    # No read returns before all three jobs are in: jobs 1 and 2 take a
    # part each, whatever the threads' timing.
    gate = threading.Event()
    real_ready, real_wait = reader.ready, reader.wait
    reader.ready = lambda p: gate.is_set() and real_ready(p)
    reader.wait = lambda p, timeout: gate.wait(timeout) and real_wait(p, timeout)
    # Three jobs in flight at once: job 3 reads into the part of job 1 or of
    # job 2 (whichever's read returned and copy landed first), so only after
    # that job's copy landed (checked at the read, see _guard_reads).
    ctx_a = _submit_disk_load(r, "a", first, [40, 41], job_id=1)
    ctx_b = _submit_disk_load(r, "b", second, [44, 45], job_id=2)
    ctx_c = _submit_disk_load(r, "c", third, [48, 49], job_id=3)
    gate.set()
    done, _ = _poll_until(r, {1, 2, 3})
    assert all(d.success for d in done)
    assert reads[:2] == [(0, 2), (2, 2)] and reads[2] in reads[:2]
    assert len(reads) == 3
    _finish(r, first, [40, 41], ctx_a)
    _finish(r, second, [44, 45], ctx_b)
    _finish(r, third, [48, 49], ctx_c)


def test_wait_returns_once_loads_landed(runner):
    """vLLM 0.33 waits on a synchronous load right after submitting it:
    ``wait`` returns once the load thread's copies landed, whoever polls."""
    r = runner
    with landing_at_once(r):
        keys = push_to_disk(r, [1, 2, 3, 4])
    late = r.worker.loads.copies
    r.worker.reader.capacity = 2
    ctx = _submit_disk_load(r, "a", keys, [40, 41, 42, 43], job_id=7)
    wait_jobs(r.worker, {7})
    assert late.landed == [1, 2, 3, 4] and not late.queued
    assert [(d.job_id, d.success) for d in r.worker.get_finished()] == [(7, True)]
    _finish(r, keys, [40, 41, 42, 43], ctx)


def test_wait_lands_a_store(runner):
    r = runner
    keys = r.keys("s", 2)
    ctx = ReqContext(req_id="s")
    r.manager.on_new_request(ctx)
    out = r.manager.prepare_store(keys, ctx)
    src = GPULoadStoreSpec([5, 6], [2], [0])
    assert r.worker.submit_store(3, src, out.store_spec)
    rows = list(out.store_spec.block_ids)
    cpu = r.worker.cpu_buffer.array
    assert not cpu[rows].any()
    wait_jobs(r.worker, {3})
    for row, b in zip(rows, [5, 6]):
        want = b"".join(bytes(t[b].numpy()) for t in r.kv)
        assert bytes(cpu[row][: len(want)]) == want
    assert [d.job_id for d in r.worker.get_finished()] == [3]
    r.manager.complete_store(out.keys_to_store, ctx)
    r.manager.on_request_finished(ctx)


# --------------------------------------------------------------------------
# A job that raises: contained, failed whole, reported after its transfers
# --------------------------------------------------------------------------


def _results(r: RequestRunner, polls: int = 6) -> list[tuple[int, bool]]:
    """Every job the worker reports over ``polls`` polls."""
    return [
        (d.job_id, d.success) for _ in range(polls) for d in r.worker.get_finished()
    ]


def test_a_load_that_raises_mid_job_fails_whole_after_its_transfers_landed(
    runner, monkeypatch, caplog
):
    r = runner
    with landing_at_once(r):
        on_disk = push_to_disk(r, [1, 2, 3, 4], others="bcdef")
        on_cpu = r.store("z", [30, 31])
    late_cpu, late = r.worker.copies, r.worker.loads.copies
    r.worker.reader.capacity = 2  # two parts of one slot: a read per block
    keys = on_cpu + on_disk[:3]
    gpu_blocks = [50, 51, 52, 53, 54]
    assert r.lookup("mixed", keys) == len(keys)
    ctx = r.ctx
    spec = r.manager.prepare_load(keys, ctx)
    assert list(spec.on_disk) == [False, False, True, True, True]
    for t in r.kv:
        t[gpu_blocks] = 0
    reads = []
    real_complete = r.worker.reader.complete

    def complete(pending):
        reads.append(len(pending.items))
        if len(reads) == 2:
            raise RuntimeError("a bug in the reader")
        return real_complete(pending)

    monkeypatch.setattr(r.worker.reader, "complete", complete)
    dst = GPULoadStoreSpec(gpu_blocks, [len(gpu_blocks)], [0])
    with caplog.at_level("DEBUG", logger="vllm.kvtier.connector"):
        assert r.worker.submit_load(9, spec, dst)  # never raises here
        # The CPU rows' copy left at submission, the first disk block's
        # copy when its batch came back; the second batch raised.
        done, _ = _poll_until(r, {9})
    assert done[0].success is False
    assert reads == [1, 1] and late_cpu.landed == [1] and late.landed == [1]
    assert not late_cpu.queued and not late.queued
    _no_copy_in_flight(r)
    assert _book_empty(r)
    # Every block of the job counts as failed, the CPU ones included; the
    # disk copies are reported unread, not corrupt (nothing showed them bad).
    error = r.worker.take_load_error(9)
    assert error.corrupt == []
    assert error.unread == on_disk[:3]
    assert error.gpu_block_ids == set(gpu_blocks)
    assert r.worker.take_load_error(9) is None
    assert r.worker.exceptions.count == 1
    logged = [rec for rec in caplog.records if "load job 9 raised" in rec.message]
    assert len(logged) == 1 and logged[0].levelname == "ERROR"
    assert logged[0].exc_info is not None  # with its traceback
    # The manager keeps the disk copies (an exception is no evidence
    # against them) and gives their promotion rows back.
    r.manager.note_worker_report(
        WorkerReport({ctx.req_id: error.corrupt}, {ctx.req_id: error.unread})
    )
    r.manager.complete_load(keys, ctx)
    r.manager.on_request_finished(ctx)
    h = r.manager.hierarchy
    assert all(h.disk.is_ready(k) for k in on_disk[:3])
    assert h.disk_core.failures.corrupt == 0
    assert [h.lookup(k).name for k in on_cpu] == ["HIT_CPU"] * 2
    assert num_loads(h) == 0

    # The next jobs work, through both parts of the bounce area; the same
    # cause raising again is counted and logged at debug only.
    monkeypatch.setattr(r.worker.reader, "complete", real_complete)
    second = r.keys("b", 4)[:2]
    ctx = _submit_disk_load(r, "b", second, [56, 57], job_id=10)
    wait_jobs(r.worker, {10})
    assert [(d.job_id, d.success) for d in r.worker.get_finished()] == [(10, True)]
    _finish(r, second, [56, 57], ctx)
    reads.clear()
    monkeypatch.setattr(r.worker.reader, "complete", complete)
    with caplog.at_level("DEBUG", logger="vllm.kvtier.connector"):
        ctx = _submit_disk_load(r, "last", [on_disk[3]], [58], job_id=11)
        assert [d.success for d in _poll_until(r, {11})[0]] == [True]
        third = r.keys("c", 4)[:2]
        ctx_c = _submit_disk_load(r, "c", third, [60, 61], job_id=12)
        assert [d.success for d in _poll_until(r, {12})[0]] == [False]
    assert reads == [1, 1]  # job 12's first read batch raised
    assert r.worker.exceptions.count == 2
    again = [rec for rec in caplog.records if "load job 12 raised" in rec.message]
    assert len(again) == 1 and again[0].levelname == "DEBUG"
    error = r.worker.take_load_error(12)
    assert error.corrupt == [] and error.unread == third
    assert error.gpu_block_ids == {60, 61}
    _finish(r, [on_disk[3]], [58], ctx)
    r.manager.note_worker_report(
        WorkerReport({ctx_c.req_id: error.corrupt}, {ctx_c.req_id: error.unread})
    )
    r.manager.complete_load(third, ctx_c)
    assert [h.lookup(k).name for k in third] == ["HIT_DISK"] * 2


def test_a_batch_copy_that_raises_fails_its_job_not_the_engine(runner, monkeypatch):
    """On accelerators the load thread issues a verified batch's copies; an
    exception there (vLLM's handler, the scatter) fails that job whole, is
    reported once the copies it issued landed, never leaves
    ``get_finished``, and the bounce parts go back."""
    r = runner
    with landing_at_once(r):
        on_disk = push_to_disk(r, [1, 2, 3, 4], others="bcdef")
    late = r.worker.loads.copies
    r.worker.reader.capacity = 2  # a batch per block
    real_submit = late.submit
    issued: list[str] = []

    def submit(area, group, plan, to_host, expedited=False):
        issued.append(area)
        if area == "disk" and len(issued) == 2:
            raise RuntimeError("a bug in the copy path")
        return real_submit(area, group, plan, to_host, expedited)

    monkeypatch.setattr(late, "submit", submit)
    ctx = _submit_disk_load(r, "a", on_disk[:3], [50, 51, 52], job_id=9)
    done, _ = _poll_until(r, {9})  # never raises from get_finished
    assert done[0].success is False
    assert r.worker.exceptions.count == 1
    error = r.worker.take_load_error(9)
    assert error.corrupt == [] and error.unread == on_disk[:3]
    assert error.gpu_block_ids == {50, 51, 52}
    _no_copy_in_flight(r)
    assert late.landed == [1]  # the first batch's, before the job was reported
    assert _book_empty(r) and not late.queued
    r.manager.note_worker_report(
        WorkerReport({ctx.req_id: error.corrupt}, {ctx.req_id: error.unread})
    )
    r.manager.complete_load(on_disk[:3], ctx)
    r.manager.on_request_finished(ctx)
    # Both parts serve the next job.
    monkeypatch.setattr(late, "submit", real_submit)
    ctx = _submit_disk_load(r, "a2", on_disk, [56, 57, 58, 59], job_id=10)
    assert [d.success for d in _poll_until(r, {10})[0]] == [True]
    _finish(r, on_disk, [56, 57, 58, 59], ctx)


def test_a_store_that_raises_fails_and_its_rows_are_given_back(runner, monkeypatch):
    r = runner
    assert r.worker.contain_exceptions  # built under kvtier's connector
    late = r.worker.copies
    keys = r.keys("s", 2)
    ctx = ReqContext(req_id="s")
    r.manager.on_new_request(ctx)
    out = r.manager.prepare_store(keys, ctx)
    rows = [int(x) for x in out.store_spec.block_ids]
    # Another job's copy is in flight; the store's own copy raises.
    other = r.keys("o", 1)
    other_ctx = ReqContext(req_id="o")
    r.manager.on_new_request(other_ctx)
    other_out = r.manager.prepare_store(other, other_ctx)
    assert r.worker.submit_store(
        1, GPULoadStoreSpec([7], [1], [0]), other_out.store_spec
    )

    def submit(*args, **kwargs):
        raise TypeError("a bug in the copy path")

    monkeypatch.setattr(late, "submit", submit)
    assert r.worker.submit_store(2, GPULoadStoreSpec([5, 6], [2], [0]), out.store_spec)
    monkeypatch.undo()
    assert r.worker.exceptions.count == 1
    assert _results(r) == [(2, False), (1, True)]  # 2 at once: nothing in flight
    assert r.worker.take_store_error(2) == rows
    assert r.worker.take_store_error(1) is None
    # vLLM completes every store as a success; the worker's report makes
    # the manager give the rows back unwritten.
    h = r.manager.hierarchy
    used = len(h.cpu)
    r.manager.get_stats()  # what vLLM exported so far
    r.manager.note_worker_report(
        WorkerReport(failed_store_rows=rows, counters=WorkerCounters(exceptions=1))
    )
    counted = r.manager.get_stats()._values[metrics.WORKER_EXCEPTIONS]
    assert counted == {(): 1}
    r.manager.complete_store(out.keys_to_store, ctx)
    r.manager.complete_store(other_out.keys_to_store, other_ctx)
    assert [h.lookup(k).name for k in keys] == ["MISS", "MISS"]
    assert h.lookup(other[0]).name == "HIT_CPU"
    assert len(h.cpu) == used - 2 and h.stats.stores_failed == 2
    assert not r.manager._failed_store_rows

    # The next store of the same blocks works, and loads back byte for byte.
    r.worker.copies = late.inner
    assert r.store("s", [5, 6]) == keys
    assert [h.lookup(k).name for k in keys] == ["HIT_CPU", "HIT_CPU"]
    assert r.lookup("s", keys) == 2
    assert r.load(keys, [20, 21]) == {"host": 2}


def test_outside_kvtiers_connector_an_exception_propagates(tmp_path, monkeypatch):
    """vLLM's stock connector cannot take a failed job (it asserts success):
    a worker built outside kvtier's connector raises, as vLLM's would."""
    from kvtier.connector.spec import TieredOffloadingSpec

    # A CPU-only spec is allowed under the stock connector.
    r = RequestRunner(
        TieredOffloadingSpec(make_config(tmp_path, cpu_blocks=8, disk_blocks=0))
    )
    try:
        assert not r.worker.contain_exceptions
        keys = r.keys("s", 1)
        ctx = ReqContext(req_id="s")
        r.manager.on_new_request(ctx)
        out = r.manager.prepare_store(keys, ctx)

        def submit(*args, **kwargs):
            raise TypeError("a bug in the copy path")

        monkeypatch.setattr(r.worker.copies, "submit", submit)
        with pytest.raises(TypeError):
            r.worker.submit_store(1, GPULoadStoreSpec([5], [1], [0]), out.store_spec)
        assert r.worker.exceptions.count == 0 and r.worker.get_finished() == []
    finally:
        r.close()


def test_a_report_from_before_reset_cache_never_reaches_a_later_load():
    """vLLM completes no load job from before reset_cache, but the worker's
    report of one may still arrive; applied to the same request's next load
    it dropped a healthy disk block as corrupt."""
    from kvtier.connector.manager import TieredOffloadingManager
    from kvtier.tiers.hierarchy import TierHierarchy

    key = b"k" * 36
    h = TierHierarchy(4, 8)
    h.restore_disk([(key, 0)])
    m = TieredOffloadingManager(h, None, block_bytes=4096)
    m.prepare_load([key], ReqContext(req_id="R"))  # in flight at the reset
    m.reset_cache()
    m.note_worker_report(WorkerReport({"R": [key]}, {"R": [key]}))  # it failed
    h.restore_disk([(key, 0)])  # the block is on disk again
    again = ReqContext(req_id="R")
    m.prepare_load([key], again)  # the same request loads it again: fine
    m.complete_load([key], again)
    assert h.disk.is_ready(key)
    assert h.stats.load_failures == 0


def _connector_worker(worker):
    """kvtier's connector worker (vLLM's worker-side code) over ``worker``."""
    from types import SimpleNamespace

    from kvtier.connector.connector import KvtierConnectorWorker

    spec = SimpleNamespace(
        replicated_layout=False,
        config=SimpleNamespace(canonical_layout=False, parallel=SimpleNamespace(rank=0)),
    )
    conn = KvtierConnectorWorker(spec, None, None)
    conn.worker = worker
    return conn


class _Exported:
    """The counters a manager exports (``get_stats``, which vLLM feeds to
    Prometheus), summed from construction: ``grew(name)`` is what each
    series grew by since then (series that did not grow left out)."""

    def __init__(self, manager):
        self.manager = manager
        self.start = self._totals()

    def _totals(self):
        totals = getattr(self, "totals", {})
        stats = self.manager.get_stats()
        for name, series in stats._values.items():
            if stats._types[name] == "counter":
                for labels, value in series.items():
                    key = (name, labels)
                    totals[key] = totals.get(key, 0) + value
        self.totals = totals
        return dict(totals)

    def collect(self):
        self.now = self._totals()

    def grew(self, name):
        return {
            labels: value - self.start.get((n, labels), 0)
            for (n, labels), value in self.now.items()
            if n == name and value != self.start.get((n, labels), 0)
        }


def test_a_load_that_raises_counts_no_block_as_loaded(runner, monkeypatch):
    """A load job that raised delivered nothing (every GPU block reported
    unfilled): neither its CPU-tier blocks nor its disk blocks count in
    ``loaded_blocks`` or ``read_bytes``. They had: the CPU blocks of a job
    that failed whole still counted as loaded from the CPU tier."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )

    from kvtier.store.read_process import ReadProcess

    # Reads in this process: a read process's child counts the bytes it
    # read (read_bytes is the drive's traffic) before the raising complete.
    monkeypatch.setattr(ReadProcess, "spawn", False)
    r = runner
    with landing_at_once(r):
        on_disk = push_to_disk(r, [1, 2, 3, 4], others="bcdef")
        on_cpu = r.store("z", [30, 31])
    conn = _connector_worker(r.worker)
    exported = _Exported(r.manager)
    keys = on_cpu + on_disk[:2]
    assert r.lookup("mixed", keys) == len(keys)
    ctx = r.ctx
    spec = r.manager.prepare_load(keys, ctx)
    assert list(spec.on_disk) == [False, False, True, True]

    def complete(pending):
        raise RuntimeError("a bug in the reader")

    monkeypatch.setattr(r.worker.reader, "complete", complete)
    dst = GPULoadStoreSpec([50, 51, 52, 53], [4], [0])
    job = TransferJob(req_id=ctx.req_id, src_spec=spec, dst_spec=dst)
    conn.start_kv_transfers(
        OffloadingConnectorMetadata(load_jobs={9: job}, store_jobs={}, jobs_to_flush=set())
    )
    deadline = time.monotonic() + 10
    while ctx.req_id not in conn.get_finished(set())[1]:
        assert time.monotonic() < deadline, "the load was never reported"
        time.sleep(0.001)
    assert conn.take_load_errors()[1] == {50, 51, 52, 53}  # nothing landed
    assert getattr(r.worker.reader, "pid", None) is None  # read here
    meta = conn.build_connector_worker_meta()
    r.manager.note_worker_report(meta.report)
    r.manager.complete_load(keys, ctx)
    r.manager.on_request_finished(ctx)
    exported.collect()
    assert exported.grew(metrics.LOADED_BLOCKS) == {}
    assert exported.grew(metrics.READ_BYTES) == {}
    assert exported.grew(metrics.WORKER_EXCEPTIONS) == {(): 1}
    h = r.manager.hierarchy
    assert (h.stats.loads_cpu, h.stats.loads_disk) == (0, 0)
    # Nothing was lost: the blocks are where they were, and load next time.
    assert [h.lookup(k).name for k in keys] == ["HIT_CPU"] * 2 + ["HIT_DISK"] * 2
    monkeypatch.undo()
    with landing_at_once(r):
        assert r.lookup("mixed", keys) == len(keys)
        r.load(keys, [54, 55, 56, 57])
    exported.collect()
    assert exported.grew(metrics.LOADED_BLOCKS) == {("cpu",): 2, ("disk",): 2}


def test_a_warm_restart_is_announced_over_several_steps(monkeypatch):
    """vLLM drains take_events once per engine step and builds one KV event
    per key in it: a warm restart adopting a million blocks handed them all
    to the first step (about 5 s of it on a 2-core VM). Each step now takes
    at most EVENT_BACKLOG_PER_STEP keys of it, in order, until all are out."""
    from kvtier.connector import manager as manager_module
    from kvtier.connector.manager import TieredOffloadingManager
    from kvtier.tiers.hierarchy import TierHierarchy

    monkeypatch.setattr(manager_module, "EVENT_BACKLOG_PER_STEP", 16)
    keys = [i.to_bytes(36, "big") for i in range(100)]
    h = TierHierarchy(4, 100)
    h.restore_disk([(k, i) for i, k in enumerate(keys)])
    m = TieredOffloadingManager(h, None, block_bytes=4096, enable_events=True)
    steps = []
    while True:
        events = list(m.take_events())
        if not events:
            break
        steps.append([k for ev in events for k in ev.keys])
    assert [len(s) for s in steps] == [16] * 6 + [4]
    assert [k for s in steps for k in s] == keys


def test_spills_finishing_in_reset_cache_count_alike_in_spills_and_write_bytes(
    tmp_path,
):
    """Every spill that reaches the drive counts in ``spills`` and in
    ``write_bytes{disk}`` alike, those that finish inside reset_cache too.
    The reset ordered more spills after applying the finished ones (a disk
    as small as half the CPU tier takes half the dirty blocks per round),
    waited for them and dropped their results: the drive wrote blocks that
    the reset forgot at once, counted in write_bytes and not in spills."""
    config = make_config(tmp_path, cpu_blocks=8, disk_blocks=4, spill_watermark=0.0)
    r = RequestRunner(tiered_spec(config))
    try:
        exported = _Exported(r.manager)
        r.store("a", list(range(1, 9)))  # 8 dirty blocks, room on disk for 4
        h = r.manager.hierarchy
        assert h.stats.spills_started == 4
        r.manager.reset_cache()
        exported.collect()
        # The reset cancels what had not started (as many as 4, by how far
        # the I/O threads got): neither a spill nor a failure.
        spills = exported.grew(metrics.SPILLS).get((), 0)
        written = exported.grew(metrics.WRITE_BYTES).get(("disk",), 0)
        assert written == spills * r.manager.block_bytes, (written, spills)
        assert h.stats.spills_completed == spills
        assert h.stats.spill_failures == 0
        assert not r.manager.has_pending_work()
        assert len(h.cpu) == len(h.disk) == 0
    finally:
        r.close()


def _four_spills_behind_a_hung_write(tmp_path, monkeypatch, release):
    """A runner with one disk I/O thread and four spill jobs of two blocks
    (requests "a" to "d"), the first one's write hung until ``release``
    is set, which the runtime's ``cancel_queued`` does, and the other
    three queued behind it. Returns (runner, fault
    plan, config, keys stored per request)."""
    plan = inject_faults(monkeypatch, FaultPlan())
    plan.add(FaultRule.hang(release, ops="write"))
    # The hung write goes on once the queue behind it was cancelled.
    cancel_queued = DiskRuntime.cancel_queued

    def cancel_then_release(runtime):
        cancel_queued(runtime)
        release.set()

    monkeypatch.setattr(DiskRuntime, "cancel_queued", cancel_then_release)
    config = make_config(
        tmp_path, cpu_blocks=8, disk_blocks=8, spill_watermark=0.0, disk_io_threads=1
    )
    r = RequestRunner(tiered_spec(config))
    stored = {}
    for name, blocks in (("a", [1, 2]), ("b", [3, 4]), ("c", [5, 6]), ("d", [7, 8])):
        stored[name] = r.store(name, blocks)
        r.manager.take_events()  # a scheduler step: the spill is submitted
    assert r.manager.hierarchy.stats.spills_started == 8
    deadline = time.monotonic() + 30
    while plan.count(FaultKind.HANG, "write") < 1:
        assert time.monotonic() < deadline, "the first spill never wrote"
        time.sleep(0.005)
    return r, plan, config, stored


def test_reset_cache_waits_for_the_spills_being_written_not_the_queue(
    tmp_path, monkeypatch
):
    """reset_cache forgets every block, so the spills still queued are
    cancelled, not written: the reset waits for the batch being written
    only. Waiting for the whole queue held the engine for as long as the
    drive took to write it (a CPU tier's worth on a slow disk), and past
    the drain's bound stopped the disk tier for good. One I/O thread, whose
    first write hangs until the reset has begun: of four spill jobs the
    first is written, the other three never reach the drive, and none
    counts as a failure."""
    release = threading.Event()
    r, plan, _, _ = _four_spills_behind_a_hung_write(tmp_path, monkeypatch, release)
    try:
        exported = _Exported(r.manager)
        h = r.manager.hierarchy
        r.manager.reset_cache()
        exported.collect()
        spills = exported.grew(metrics.SPILLS).get((), 0)
        written = exported.grew(metrics.WRITE_BYTES).get(("disk",), 0)
        assert spills == 2, spills
        assert written == 2 * r.manager.block_bytes
        assert plan.count(op="write") == 1  # the three others never wrote
        assert h.stats.spill_failures == 0
        assert r.manager.runtime.broken is None
        assert not r.manager.has_pending_work()
        assert len(h.cpu) == len(h.disk) == 0
        # The disk tier goes on: a new block spills and is written.
        r.store("e", [9])
        r.settle()
        assert h.stats.spills_completed == 3
    finally:
        release.set()
        r.close()


def test_shutdown_writes_the_queued_spills_for_a_while_then_cancels_the_rest(
    tmp_path, monkeypatch
):
    """Shutdown goes on writing the spills queued for SHUTDOWN_SPILL_S (a
    warm restart adopts their blocks), then cancels those not started and
    waits for the batch being written: a slow drive behind a long queue
    no longer holds the engine's exit for up to the drain's minute (which
    then also logged the disk tier stopped). One I/O thread, its first
    write hung past the grace: the first of four spill jobs is written and
    adopted by the next start, the three others never reach the drive."""
    from kvtier.store import runtime as runtime_module

    monkeypatch.setattr(runtime_module, "SHUTDOWN_SPILL_S", 0.2)
    release = threading.Event()
    r, plan, config, stored = _four_spills_behind_a_hung_write(
        tmp_path, monkeypatch, release
    )
    try:
        runtime = r.manager.runtime
        r.close()
    finally:
        release.set()
    assert plan.count(op="write") == 1  # the three others never wrote
    assert runtime.broken is None  # no "disk tier stopped"
    r = RequestRunner(tiered_spec(config))
    try:
        h = r.manager.hierarchy
        on_disk = {
            name: [h.lookup(k).name for k in keys] for name, keys in stored.items()
        }
        assert on_disk == {
            "a": ["HIT_DISK"] * 2,
            "b": ["MISS"] * 2,
            "c": ["MISS"] * 2,
            "d": ["MISS"] * 2,
        }
        assert r.lookup("a", stored["a"]) == 2
    finally:
        r.close()


@pytest.mark.parametrize("bound", [None, 3])
def test_shutdown_spills_the_blocks_only_the_cpu_tier_holds(
    tmp_path, monkeypatch, bound
):
    """Below the watermark nothing spills while the engine runs; a
    shutdown spills what only the CPU tier holds, newest first and at most
    SHUTDOWN_SPILL_BLOCKS, so the next start adopts every prompt whole
    (where they were lost with the CPU tier before), or the newest."""
    from kvtier.connector import manager as manager_module

    if bound is not None:
        monkeypatch.setattr(manager_module, "SHUTDOWN_SPILL_BLOCKS", bound)
    config = make_config(tmp_path, cpu_blocks=8, disk_blocks=16, spill_watermark=1.0)
    r = RequestRunner(tiered_spec(config))
    try:
        older = r.store("a", [1, 2, 3])
        newer = r.store("b", [4, 5, 6])
        r.manager.take_events()  # a scheduler step
        assert r.manager.hierarchy.stats.spills_started == 0
    finally:
        r.close()
    r = RequestRunner(tiered_spec(config))
    try:
        h = r.manager.hierarchy
        adopted = [h.lookup(k).name for k in newer + older]
        kept = 6 if bound is None else bound
        assert adopted == ["HIT_DISK"] * kept + ["MISS"] * (6 - kept)
        assert r.lookup("b", newer) == 3
    finally:
        r.close()


def test_a_shutdown_after_a_reset_leaves_the_blocks_from_before_it(tmp_path):
    """After a connector reset (a sleep, a weight update) what is stored is
    written flagged, never adopted, into slots the reset freed in the index
    while their blocks from before it stay adoptable: spilling it at
    shutdown overwrote those for nothing (the review's reproduction: "a"
    was lost to the third start)."""
    config = make_config(tmp_path, cpu_blocks=8, disk_blocks=4, spill_watermark=1.0)
    r = RequestRunner(tiered_spec(config))
    try:
        a = r.store("a", [1, 2, 3])
        r.manager.take_events()
    finally:
        r.close()  # its shutdown spills "a"
    r = RequestRunner(tiered_spec(config))
    try:
        h = r.manager.hierarchy
        assert [h.lookup(k).name for k in a] == ["HIT_DISK"] * 3  # adopted
        r.manager.reset_cache()
        b = r.store("b", [4, 5, 6])
        r.manager.take_events()
    finally:
        r.close()
    r = RequestRunner(tiered_spec(config))
    try:
        h = r.manager.hierarchy
        assert [h.lookup(k).name for k in a] == ["HIT_DISK"] * 3
        assert [h.lookup(k).name for k in b] == ["MISS"] * 3
    finally:
        r.close()


def test_the_shutdowns_spills_start_no_spill_process(tmp_path, monkeypatch):
    """Below the watermark no spill ran, so no spill process was asked for:
    the shutdown's spills run in the engine, not in a child forked and
    execed only to be closed again within the same two seconds."""
    from kvtier.store import spill_process

    asked = []
    start = spill_process.SpillProcess.start

    def counted(process):
        running = start(process)
        if process._starter is not None and process._starter.asked:
            asked.append(process)
        return running

    monkeypatch.setattr(spill_process.SpillProcess, "start", counted)
    config = make_config(
        tmp_path, cpu_blocks=8, disk_blocks=8, spill_watermark=1.0,
        disk_spill_process="on",
    )  # fmt: skip
    r = RequestRunner(tiered_spec(config))
    try:
        stored = r.store("a", [1, 2, 3])
        r.manager.take_events()
    finally:
        r.close()
    assert asked == []
    r = RequestRunner(tiered_spec(config))
    try:
        h = r.manager.hierarchy
        assert [h.lookup(k).name for k in stored] == ["HIT_DISK"] * 3
    finally:
        r.close()


def _copy_then_stuck_read(r, second):
    """Make the load thread hold in its next batch copy, once issued, until
    ``go_on`` is set (``issued`` says it was), then get stuck starting the
    read of keys ``second`` until ``stuck`` is set; the stuck-thread
    deadline is 0.3 s. Returns ``(issued, go_on, stuck)``."""
    late = r.worker.loads.copies
    r.worker.loads.deadline_s = 0.3
    issued, go_on, stuck = threading.Event(), threading.Event(), threading.Event()
    real_submit = late.submit

    def submit(*args, **kwargs):
        transfer = real_submit(*args, **kwargs)
        issued.set()
        go_on.wait(10)
        return transfer

    late.submit = submit
    reader = r.worker.reader
    real_read = reader.submit

    def read(items, first_row=0):
        if items[0][1] in second:
            stuck.wait(30)  # the step that does not come back
        return real_read(items, first_row=first_row)

    reader.submit = read
    return issued, go_on, stuck


def test_a_stuck_load_thread_never_holds_back_a_job_whose_copies_it_issued(runner):
    """The load thread issues job 1's batch copy and, before any later poll
    of its copy path could report it, gets stuck starting job 2's read (a
    slab open or a kvikio read start on a hung mount). Past the deadline the
    worker gives up both jobs. Job 2 had nothing in flight: reported at
    once. Job 1's copy was issued before its cancellation and is only ever
    reported by the stuck thread's poll, so job 1 was never reported, and
    its request (and a flush waiting on it) waited for ever. The worker
    now waits for that copy on the device (the path's ``drain``), which does
    not need the thread, and reports job 1 failed whole."""
    r = runner
    with landing_at_once(r):
        first = push_to_disk(r, [1, 2], others="bcdef")
    second = r.keys("b", 4)[:2]
    late = r.worker.loads.copies
    issued, go_on, stuck = _copy_then_stuck_read(r, second)
    try:
        ctx_a = _submit_disk_load(r, "a", first, [40, 41], job_id=1)
        assert issued.wait(10)
        ctx_b = _submit_disk_load(r, "b", second, [44, 45], job_id=2)
        go_on.set()
        done, _ = _poll_until(r, {1, 2}, timeout=5.0)
        assert sorted((d.job_id, d.success) for d in done) == [(1, False), (2, False)]
        for job, keys, ctx in ((1, first, ctx_a), (2, second, ctx_b)):
            error = r.worker.take_load_error(job)
            assert error.whole and error.unread == keys
            r.manager.complete_load(keys, ctx)
            r.manager.on_request_finished(ctx)
    finally:
        go_on.set()
        stuck.set()
    # Back from its step: nothing more is reported, nothing written later.
    deadline = time.monotonic() + 10
    while r.worker.loads._turns or r.worker.loads.ring.transfers:
        assert time.monotonic() < deadline, "the load thread never came back"
        assert r.worker.get_finished() == []
        time.sleep(0.002)
    assert not late.queued
    assert not any(t[[44, 45]].any() for t in r.kv)


def test_a_flushed_load_never_holds_the_step_on_a_load_thread_stuck_after_its_copy(
    runner,
):
    """A connector reset flushes job 1 (``give_up_loads``, then vLLM's
    ``wait``) while the load thread is inside job 1's batch copy; the thread
    then gets stuck starting job 2's read. Job 1 was given up already, so
    the worker's deadline for a stuck thread passed it over, and ``wait``
    (the engine's step) waited for a thread that did not come back. It
    returns once the deadline passed and the copy drained."""
    r = runner
    with landing_at_once(r):
        first = push_to_disk(r, [1, 2], others="bcdef")
    second = r.keys("b", 4)[:2]
    issued, go_on, stuck = _copy_then_stuck_read(r, second)
    waiter = threading.Thread(target=r.worker.wait, args=({1},))
    try:
        _submit_disk_load(r, "a", first, [40, 41], job_id=1)
        assert issued.wait(10)
        r.worker.give_up_loads([1])  # the thread is inside job 1's copy
        _submit_disk_load(r, "b", second, [44, 45], job_id=2)
        go_on.set()
        waiter.start()
        waiter.join(5.0)
        assert not waiter.is_alive(), "wait() held the step on a stuck load thread"
        done, _ = _poll_until(r, {1, 2}, timeout=5.0)
        assert sorted((d.job_id, d.success) for d in done) == [(1, False), (2, False)]
    finally:
        go_on.set()
        stuck.set()
        if waiter.is_alive():
            waiter.join(10.0)
