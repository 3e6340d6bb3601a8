"""Loads run on the worker's load thread: ``submit_load`` never waits for
the disk, reads are pipelined, and a read that fails, hangs or raises costs
that job a recompute, never a hang, a crash or wrong KV.

Drives the real spec's manager and worker (real disk tier, real slab files)
with every disk back end the worker builds wrapped in kvtier's fault layer,
whose plan holds a read back (``FaultRule.hang``) until the test lets it go,
fails it (EIO), or cuts it short."""

from __future__ import annotations

import errno
import os
import shutil
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import GPULoadStoreSpec  # noqa: E402

from kvtier.connector.worker import pipeline  # noqa: E402
from kvtier.connector.worker import worker as worker_mod  # noqa: E402
from kvtier.connector.worker_report import WorkerReport  # noqa: E402
from kvtier.store.slot import HEADER_SIZE  # noqa: E402
from kvtier.testing.fault_plan import (  # noqa: E402
    FaultKind,
    FaultPlan,
    FaultRule,
    on_slot,
)
from kvtier.testing.faults import inject_faults  # noqa: E402
from kvtier.testing.offloading import tiered_spec, wait_finished, wait_jobs  # noqa: E402
from kvtier.testing.state import evict_clean, io_error_count
from tests.connector.test_request_runner import (  # noqa: E402
    RequestRunner,
    make_config,
    push_to_disk,
)

DEADLINE_S = 60.0


@pytest.fixture
def plan(monkeypatch) -> FaultPlan:
    """The fault plan of every back end the spec builds from here on."""
    return inject_faults(monkeypatch, FaultPlan(seed=3))


@pytest.fixture
def runner(tmp_path, plan):
    r = RequestRunner(tiered_spec(make_config(tmp_path, cpu_blocks=8, disk_blocks=32)))
    yield r
    r.close()


def _wait_for(cond, what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _idle(loads: pipeline.LoadPipeline):
    """A probe of the load thread's state: no task queued or held, every
    bounce part free."""

    def idle() -> bool:
        busy = loads._queue or loads._expedited or loads._turns
        return not busy and all(p.state is pipeline.FREE for p in loads.ring.parts)

    return idle


def _submit(r: RequestRunner, keys, gpu_blocks, job_id: int):
    """Plan a load of ``keys`` and submit it from another thread: a
    ``submit_load`` that waited for a held read would never return, and the
    test must fail, not hang."""
    assert r.lookup(f"load{job_id}", keys) == len(keys)
    ctx = r.ctx
    spec = r.manager.prepare_load(keys, ctx)
    for t in r.kv:
        t[gpu_blocks] = 0
    dst = GPULoadStoreSpec(gpu_blocks, [len(gpu_blocks)], [0])
    caller = threading.Thread(target=r.worker.submit_load, args=(job_id, spec, dst))
    caller.start()
    caller.join(DEADLINE_S)
    assert not caller.is_alive(), "submit_load waited for the disk"
    return ctx


def _landed(r: RequestRunner, keys, gpu_blocks) -> list[bool]:
    return [
        all(torch.equal(t[b], r.truth[k][i]) for i, t in enumerate(r.kv))
        for k, b in zip(keys, gpu_blocks)
    ]


def _complete(r: RequestRunner, keys, ctx, error=None) -> None:
    if error is not None:
        r.manager.note_worker_report(
            WorkerReport(
                {ctx.req_id: error.corrupt},
                {ctx.req_id: error.unread},
                io_failed_keys={ctx.req_id: error.io_failed},
            )
        )
    r.manager.complete_load(keys, ctx)
    r.manager.on_request_finished(ctx)


def test_submit_returns_before_the_read_and_the_job_completes_after(runner, plan):
    r = runner
    keys = push_to_disk(r, [1, 2, 3, 4])
    release = threading.Event()
    plan.add(FaultRule.hang(release, ops="read"))
    try:
        ctx = _submit(r, keys, [40, 41, 42, 43], job_id=1)
        _wait_for(lambda: plan.count(FaultKind.HANG) >= 1, "the held read")
        # The engine steps on: nothing finished, nothing written yet.
        for _ in range(20):
            assert r.worker.get_finished() == []
        assert not any(_landed(r, keys, [40, 41, 42, 43]))
    finally:
        release.set()
    done = wait_finished(r.worker)
    assert [(d.job_id, d.success) for d in done] == [(1, True)]
    assert _landed(r, keys, [40, 41, 42, 43]) == [True] * 4
    _complete(r, keys, ctx)


def _log_reads_and_checks(reader) -> list[str]:
    """Record, in order, each batch the load thread starts reading
    (``read@<first row>``) and verifies (``verify@<first row>``)."""
    calls: list[str] = []
    real_submit, real_complete = reader.submit, reader.complete

    def submit(items, first_row=0):
        calls.append(f"read@{first_row}")
        return real_submit(items, first_row=first_row)

    def complete(pending):
        calls.append(f"verify@{pending.first_row}")
        return real_complete(pending)

    reader.submit, reader.complete = submit, complete
    return calls


def test_chunk_reads_overlap_the_previous_chunks_verification(runner):
    r = runner
    keys = push_to_disk(r, [1, 2, 3, 4], others="bcdef")
    reader = r.worker.reader
    reader.capacity = 2  # two parts of one slot: a read batch per block
    calls = _log_reads_and_checks(reader)
    ctx = _submit(r, keys, [40, 41, 42, 43], job_id=1)
    assert [d.success for d in wait_finished(r.worker)] == [True]
    # Read batch k+1 is read (into the other part) before batch k is verified.
    # After the first two, a batch goes into whichever part was verified
    # first (a slow read may hold its part while the other serves every later
    # batch): neither an order nor a count per part is fixed, but a part is
    # never read into again before its batch was verified.
    parts = [c.split("@")[1] for c in calls if c.startswith("read")]
    assert parts[:2] == ["0", "1"] and len(parts) == 4, calls
    assert calls[1].startswith("read") and calls[2].startswith("verify"), calls
    unverified: set[str] = set()
    for c in calls:
        part = c.split("@")[1]
        if c.startswith("read"):
            assert part not in unverified, calls
            unverified.add(part)
        else:
            assert part in unverified, calls
            unverified.discard(part)
    assert not unverified, calls
    assert _landed(r, keys, [40, 41, 42, 43]) == [True] * 4
    _complete(r, keys, ctx)


def test_every_bounce_part_is_read_into_before_the_first_verification(
    runner, monkeypatch
):
    """With the bounce area cut into four parts, a four-batch load has all
    four reads in flight before the first batch is verified: the load
    pipelines over every part, not two halves."""
    r = runner
    keys = push_to_disk(r, [1, 2, 3, 4], others="bcdef")
    reader = r.worker.reader
    reader.capacity = 4
    monkeypatch.setattr(pipeline, "PART_BYTES", reader.slot_size)
    assert pipeline.part_layout(reader.capacity, reader.slot_size) == (4, 1)
    calls = _log_reads_and_checks(reader)
    ctx = _submit(r, keys, [40, 41, 42, 43], job_id=1)
    assert [d.success for d in wait_finished(r.worker)] == [True]
    assert calls[:4] == ["read@0", "read@1", "read@2", "read@3"], calls
    assert sorted(calls[4:]) == [f"verify@{i}" for i in range(4)], calls
    assert _landed(r, keys, [40, 41, 42, 43]) == [True] * 4
    _complete(r, keys, ctx)


@pytest.mark.parametrize(
    "capacity, slot, expected",
    [
        (127, 516 << 10, (8, 15)),  # 64 MiB of 512 KiB blocks: ~8 MiB parts
        (2, 516 << 10, (2, 1)),  # two slots: still read one, verify the other
        (1, 516 << 10, (1, 1)),
        (3, 64 << 20, (3, 1)),  # slots over a part's size: one each
        (2047, 516 << 10, (16, 127)),  # a large area: larger parts, not more
        (64, 4 << 10, (2, 32)),  # small slots: at least two parts
    ],
)
def test_bounce_part_sizes(capacity, slot, expected):
    assert pipeline.part_layout(capacity, slot) == expected


@pytest.mark.parametrize("fault", ["eio", "short", "bit-flip"])
def test_a_failed_read_in_flight_fails_only_its_block(runner, plan, fault):
    r = runner
    keys = push_to_disk(r, [1, 2, 3, 4])
    store = r.manager.runtime.stores[0]
    target = on_slot(store, r.manager.hierarchy.disk.get(keys[2]).slot)
    rule = {
        "eio": FaultRule.error(errno.EIO, ops="read", **target),
        "short": FaultRule.short(100, ops="read", **target),
        # A byte inside the payload (random ones may hit the slot's padding).
        "bit-flip": FaultRule.bit_flip(
            at=[target["ranges"][0][0] + HEADER_SIZE + 100], ops="read", **target
        ),
    }[fault]
    r.worker.reader.capacity = 2  # the bad block is a read batch of its own
    plan.add(rule)
    ctx = _submit(r, keys, [40, 41, 42, 43], job_id=1)
    done = wait_finished(r.worker)
    assert [(d.job_id, d.success) for d in done] == [(1, False)]
    error = r.worker.take_load_error(1)
    assert error.gpu_block_ids == {42}
    if fault == "bit-flip":
        assert (error.corrupt, error.io_failed) == ([keys[2]], [])  # shown bad
    else:
        # An errno, or a short read of a full-size slab: an I/O error.
        assert (error.corrupt, error.io_failed) == ([], [keys[2]])
    # Never a byte of the failed block; the others are whole.
    assert not any(t[42].any() for t in r.kv)
    good = [keys[0], keys[1], keys[3]]
    assert _landed(r, good, [40, 41, 43]) == [True, True, True]
    _complete(r, keys, ctx, error)
    h = r.manager.hierarchy
    # Dropped as bad, or kept after an I/O error (read again next time).
    assert h.lookup(keys[2]).name == ("MISS" if fault == "bit-flip" else "HIT_DISK")
    assert all(h.lookup(k).name != "MISS" for k in keys[:2] + keys[3:])


def test_io_errors_in_a_row_drop_the_block_and_a_good_read_resets_them(runner, plan):
    """Through the worker and the manager: a slot read that fails with EIO
    keeps its block for the next request, a good read starts the count
    again, and MAX_READ_IO_ERRORS failures in a row drop it."""
    from kvtier.tiers.disk_core import MAX_READ_IO_ERRORS

    r = runner
    keys = push_to_disk(r, [1, 2, 3, 4])
    h = r.manager.hierarchy
    victim = keys[2]
    target = on_slot(r.manager.runtime.stores[0], h.disk.get(victim).slot)
    r.worker.reader.capacity = 2  # the bad block is a read batch of its own
    job = 0

    def load(fail: bool) -> None:
        nonlocal job
        job += 1
        # CPU copies (promotions) of earlier loads go: all from disk again.
        for k in keys:
            evict_clean(h, k)
        rule = plan.add(FaultRule.error(errno.EIO, ops="read", **target)) if fail else None
        ctx = _submit(r, keys, [40, 41, 42, 43], job_id=job)
        (done,) = wait_finished(r.worker)
        if rule is not None:
            plan.remove(rule)
        assert done.success is not fail
        error = r.worker.take_load_error(job) if fail else None
        if fail:
            assert (error.corrupt, error.io_failed) == ([], [victim])
        _complete(r, keys, ctx, error)

    for _ in range(MAX_READ_IO_ERRORS - 1):
        load(fail=True)
    assert h.lookup(victim).name == "HIT_DISK"
    assert io_error_count(h.disk_core, victim) == MAX_READ_IO_ERRORS - 1
    load(fail=False)  # read and verified: the count starts again
    assert _landed(r, keys, [40, 41, 42, 43]) == [True] * 4
    assert io_error_count(h.disk_core, victim) == 0
    for _ in range(MAX_READ_IO_ERRORS - 1):
        load(fail=True)
    assert h.lookup(victim).name == "HIT_DISK"
    load(fail=True)  # the third in a row
    assert h.lookup(victim).name == "MISS"
    failures = h.disk_core.failures
    assert (failures.io_errors_kept, failures.unreadable, failures.corrupt) == (
        2 * (MAX_READ_IO_ERRORS - 1),
        1,
        0,
    )
    assert all(h.lookup(k).name != "MISS" for k in keys if k != victim)


def test_a_read_that_never_returns_is_given_up_at_the_deadline(runner, plan, caplog):
    r = runner
    keys = push_to_disk(r, [1, 2, 3, 4])
    r.worker.loads.deadline_s = 0.3
    release = threading.Event()
    rule = plan.add(FaultRule.hang(release, ops="read"))
    try:
        with caplog.at_level("ERROR", logger="vllm.kvtier.connector"):
            ctx = _submit(r, keys, [40, 41, 42, 43], job_id=1)
            done = wait_finished(r.worker)
        assert [(d.job_id, d.success) for d in done] == [(1, False)]
        assert any("have not returned" in m for m in caplog.messages)
        error = r.worker.take_load_error(1)
        # A read past its deadline is an I/O error: the copies are kept (one
        # strike) for a later request.
        assert error.corrupt == [] and error.io_failed == keys
        assert error.gpu_block_ids == {40, 41, 42, 43}
        _complete(r, keys, ctx, error)
        assert not any(_landed(r, keys, [40, 41, 42, 43]))
    finally:
        plan.remove(rule)
        release.set()
    # The held read returns late: its job was given up, so it writes
    # nothing into the blocks vLLM has since handed to other requests.
    _wait_for(_idle(r.worker.loads), "the load thread to go idle")
    time.sleep(0.05)
    assert r.worker.get_finished() == []
    assert not any(_landed(r, keys, [40, 41, 42, 43]))
    r.worker.loads.deadline_s = pipeline.BATCH_DEADLINE_S
    ctx = _submit(r, keys, [44, 45, 46, 47], job_id=2)
    assert [(d.job_id, d.success) for d in wait_finished(r.worker)] == [(2, True)]
    assert _landed(r, keys, [44, 45, 46, 47]) == [True] * 4
    _complete(r, keys, ctx)


def test_a_hung_read_is_given_up_at_its_deadline_while_other_loads_keep_coming(
    runner, plan, monkeypatch
):
    """The deadline holds on a busy load thread too: CPU-tier loads queued
    behind a disk load whose read hangs keep the thread working well past
    the deadline, and the disk load is still given up at it, not after the
    others are done."""
    r = runner
    disk = push_to_disk(r, [1, 2])
    on_cpu = r.store("z", [30, 31])
    r.worker.loads.deadline_s = 0.2
    copies = r.worker.loads.copies
    copy = copies.submit

    def slow_copy(*args, **kwargs):
        time.sleep(0.005)  # each CPU-tier load keeps the thread >= 5 ms
        return copy(*args, **kwargs)

    monkeypatch.setattr(copies, "submit", slow_copy)
    cpu_loads = []
    for job in range(2, 202):  # >= 1 s of work, five deadlines
        assert r.lookup(f"cpu{job}", on_cpu) == 2
        cpu_loads.append((job, r.ctx, r.manager.prepare_load(on_cpu, r.ctx)))
    release = threading.Event()
    rule = plan.add(FaultRule.hang(release, ops="read"))
    try:
        ctx1 = _submit(r, disk, [40, 41], job_id=1)
        _wait_for(lambda: plan.count(FaultKind.HANG) >= 1, "the held read")
        dst = GPULoadStoreSpec([50, 51], [2], [0])
        for job, _, spec in cpu_loads:
            r.worker.submit_load(job, spec, dst)
        done = wait_finished(r.worker, count=201)
        order = [d.job_id for d in done]
        results = {d.job_id: d.success for d in done}
        assert results == {1: False, **{job: True for job, _, _ in cpu_loads}}
        # Given up while CPU-tier loads were still running, not last.
        assert order.index(1) < len(order) - 50, order
        error = r.worker.take_load_error(1)
        assert error.io_failed == disk and error.corrupt == []
        _complete(r, disk, ctx1, error)
        for _, ctx, _ in cpu_loads:
            _complete(r, on_cpu, ctx)
    finally:
        plan.remove(rule)
        release.set()
    assert _landed(r, on_cpu, [50, 51]) == [True, True]
    assert not any(_landed(r, disk, [40, 41]))


def _runner_with_an_unopened_slab(tmp_path, plan) -> RequestRunner:
    """A runner whose load thread failed to open the slab at start-up, so
    its first disk read opens it on the load thread."""
    r = RequestRunner(tiered_spec(make_config(tmp_path, cpu_blocks=8, disk_blocks=32)))
    failed_open = plan.add(FaultRule.error(errno.EIO, ops="open", first_n=1))
    r.worker.get_finished()  # the load thread starts, its opens fail
    _wait_for(lambda: plan.count(FaultKind.ERROR) >= 1, "the failed open")
    plan.remove(failed_open)
    return r


def test_an_open_that_never_returns_costs_its_job_not_a_hang(tmp_path, plan):
    """A slab not opened ahead (its open at start-up failed) is opened at
    its first read, on the load thread. If that open never returns (a hung
    mount), the thread is stuck outside any read's deadline: the job is
    still reported, failed, at its own deadline (it has no copy in flight),
    and its blocks are never written afterwards."""
    r = _runner_with_an_unopened_slab(tmp_path, plan)
    release = threading.Event()
    try:
        keys = push_to_disk(r, [1, 2, 3, 4])
        plan.add(FaultRule.hang(release, ops="open"))
        r.worker.loads.deadline_s = 0.3
        ctx = _submit(r, keys, [40, 41, 42, 43], job_id=1)
        _wait_for(lambda: plan.count(FaultKind.HANG) >= 1, "the held open")
        done = wait_finished(r.worker)
        assert [(d.job_id, d.success) for d in done] == [(1, False)]
        error = r.worker.take_load_error(1)
        assert error.unread == keys and error.gpu_block_ids == {40, 41, 42, 43}
        _complete(r, keys, ctx, error)
        release.set()  # the open returns: the cancelled job issues nothing
        _wait_for(_idle(r.worker.loads), "the load thread to drop it")
        assert r.worker.get_finished() == []
        assert not any(_landed(r, keys, [40, 41, 42, 43]))
    finally:
        release.set()
        r.close()


def test_a_stuck_load_thread_costs_every_load_it_holds(tmp_path, plan):
    """A load submitted while the thread is stuck in one step (an open that
    does not return) cannot start either: past the deadline the worker
    gives up every load it holds, whole and kept on disk; once the thread
    is back, loads work again."""
    r = _runner_with_an_unopened_slab(tmp_path, plan)
    release = threading.Event()
    try:
        first = push_to_disk(r, [1, 2], others="bcdef")
        second = r.keys("b", 4)[:2]
        hang = plan.add(FaultRule.hang(release, ops="open"))
        r.worker.loads.deadline_s = 0.3
        ctx1 = _submit(r, first, [40, 41], job_id=1)
        _wait_for(lambda: plan.count(FaultKind.HANG) >= 1, "the held open")
        ctx2 = _submit(r, second, [44, 45], job_id=2)
        done = wait_finished(r.worker, count=2)
        assert sorted((d.job_id, d.success) for d in done) == [(1, False), (2, False)]
        for job, keys, ctx in ((1, first, ctx1), (2, second, ctx2)):
            error = r.worker.take_load_error(job)
            assert error.unread == keys and error.corrupt == error.io_failed == []
            _complete(r, keys, ctx, error)
        plan.remove(hang)
        release.set()
        _wait_for(_idle(r.worker.loads), "the load thread to come back")
        assert not any(_landed(r, first + second, [40, 41, 44, 45]))
        r.worker.loads.deadline_s = pipeline.BATCH_DEADLINE_S
        ctx3 = _submit(r, first, [48, 49], job_id=3)
        assert [(d.job_id, d.success) for d in wait_finished(r.worker)] == [(3, True)]
        assert _landed(r, first, [48, 49]) == [True, True]
        _complete(r, first, ctx3)
    finally:
        release.set()
        r.close()


def _record_reads(r: RequestRunner, jobs: dict[bytes, int]) -> list[int]:
    """The job of every read batch the load thread starts, in order
    (``jobs`` maps each job's first key to its id)."""
    reader = r.worker.reader
    real = reader.submit
    order: list[int] = []

    def submit(items, first_row=0):
        order.append(jobs[items[0][1]])
        return real(items, first_row=first_row)

    reader.submit = submit
    return order


def test_jobs_take_turns_and_expedited_loads_go_first(runner, plan):
    """While job 1's read is held, job 3 (expedited) and then job 2 are read
    through the other bounce part and finish: no job waits for another's
    disk."""
    r = runner
    first = push_to_disk(r, [1, 2], others="bcdef")
    second, third = r.keys("b", 4)[:2], r.keys("c", 4)[:2]
    order = _record_reads(r, {first[0]: 1, second[0]: 2, third[0]: 3})
    release = threading.Event()
    rule = plan.add(FaultRule.hang(release, ops="read", first_n=1))
    try:
        ctxs = [_submit(r, first, [40, 41], job_id=1)]
        _wait_for(lambda: plan.count(FaultKind.HANG) >= 1, "the held read")
        # Both queued while the thread waits on job 1's read: then the
        # expedited one goes first.
        reader, parked, gate = r.worker.reader, threading.Event(), threading.Event()
        real_wait = reader.wait

        def wait(pending, timeout):
            parked.set()
            gate.wait(DEADLINE_S)
            return real_wait(pending, timeout)

        reader.wait = wait
        assert parked.wait(DEADLINE_S)
        ctxs.append(_submit(r, second, [44, 45], job_id=2))
        assert r.lookup("x", third) == 2
        spec = r.manager.prepare_load(third, r.ctx)
        ctxs.append(r.ctx)
        r.worker.submit_load(3, spec, GPULoadStoreSpec([48, 49], [2], [0]), expedited=True)
        gate.set()
        done = []
        _wait_for(
            lambda: done.extend(r.worker.get_finished()) or len(done) == 2,
            "jobs 2 and 3 while job 1's read is held",
        )
        assert sorted((d.job_id, d.success) for d in done) == [(2, True), (3, True)]
        assert order == [1, 3, 2]
        assert _landed(r, second + third, [44, 45, 48, 49]) == [True] * 4
    finally:
        release.set()
    assert [(d.job_id, d.success) for d in wait_finished(r.worker)] == [(1, True)]
    plan.remove(rule)
    for keys, ctx in zip([first, second, third], ctxs):
        _complete(r, keys, ctx)


def test_a_stalled_read_costs_its_own_blocks_not_later_loads(runner, plan, caplog):
    """A read that does not return costs its batch (reported failed after
    ``deadline_s``) and, until it returns, its bounce part: later loads go
    through the other part; with both parts held, disk blocks fail at once
    while CPU-tier rows still load; once the reads return, all is well."""
    r = runner
    r.worker.reader.capacity = 4  # two parts of two slots
    first = push_to_disk(r, [1, 2], others="bcdef")
    second, third, fourth = (r.keys(n, 4)[:2] for n in "bcd")
    on_cpu = r.store("z", [30, 31])
    r.worker.loads.deadline_s = 0.3
    release = threading.Event()
    rule = plan.add(FaultRule.hang(release, ops="read", first_n=2))
    try:
        with caplog.at_level("WARNING", logger="vllm.kvtier.connector"):
            ctx1 = _submit(r, first, [40, 41], job_id=1)
            _wait_for(lambda: plan.count(FaultKind.HANG) >= 1, "the first held read")
            ctx2 = _submit(r, second, [44, 45], job_id=2)
            _wait_for(lambda: plan.count(FaultKind.HANG) >= 2, "the second held read")
            done = wait_finished(r.worker, count=2)
            assert sorted((d.job_id, d.success) for d in done) == [(1, False), (2, False)]
            for job, keys, ctx in ((1, first, ctx1), (2, second, ctx2)):
                error = r.worker.take_load_error(job)
                # The stalled reads' blocks: I/O errors, their copies stay.
                assert error.io_failed == keys and error.corrupt == []
                _complete(r, keys, ctx, error)
            h = r.manager.hierarchy
            assert all(h.lookup(k).name == "HIT_DISK" for k in first + second)
            assert sum("have not returned" in m for m in caplog.messages) == 2
            # Both parts wait for their reads: a disk block fails at once
            # (long before any deadline), a CPU-tier row still loads.
            mixed = on_cpu + third
            started = time.monotonic()
            ctx3 = _submit(r, mixed, [50, 51, 52, 53], job_id=3)
            done = wait_finished(r.worker)
            assert time.monotonic() - started < DEADLINE_S / 2
            assert [(d.job_id, d.success) for d in done] == [(3, False)]
            error = r.worker.take_load_error(3)
            assert error.unread == third and error.gpu_block_ids == {52, 53}
            assert error.corrupt == error.io_failed == []  # never read
            assert _landed(r, on_cpu, [50, 51]) == [True, True]
            _complete(r, mixed, ctx3, error)
    finally:
        release.set()
    # The reads return: their parts are used again, and they wrote nothing
    # where vLLM might look.
    plan.remove(rule)
    assert not any(_landed(r, first + second, [40, 41, 44, 45]))
    _wait_for(lambda: not r.worker.loads.ring.stuck(), "the stalled reads to be reaped")
    ctx4 = _submit(r, fourth, [56, 57], job_id=4)
    assert [(d.job_id, d.success) for d in wait_finished(r.worker)] == [(4, True)]
    assert _landed(r, fourth, [56, 57]) == [True, True]
    _complete(r, fourth, ctx4)


def test_a_job_that_raises_never_waits_for_its_held_read(runner, plan, monkeypatch):
    """Job 1's first batch raises while its second batch's read is held:
    the job fails at once (the held read is set aside, not waited for) and
    job 2 loads through the other part."""
    r = runner
    keys = push_to_disk(r, [1, 2], others="bcdef")
    second = r.keys("b", 4)[:2]
    reader = r.worker.reader
    reader.capacity = 2  # a batch per block
    store = r.manager.runtime.stores[0]
    target = on_slot(store, r.manager.hierarchy.disk.get(keys[1]).slot)
    release = threading.Event()
    rule = plan.add(FaultRule.hang(release, ops="read", **target))
    real_complete = reader.complete
    calls = []

    def complete(pending):
        calls.append(pending.items[0][1])
        if pending.items[0][1] == keys[0]:
            raise RuntimeError("a bug in the reader")
        return real_complete(pending)

    monkeypatch.setattr(reader, "complete", complete)
    try:
        ctx = _submit(r, keys, [40, 41], job_id=1)
        _wait_for(lambda: plan.count(FaultKind.HANG) >= 1, "the held read")
        done = wait_finished(r.worker)
        assert [(d.job_id, d.success) for d in done] == [(1, False)]
        error = r.worker.take_load_error(1)
        assert error.corrupt == [] and error.unread == keys
        _complete(r, keys, ctx, error)
        ctx2 = _submit(r, second, [44, 45], job_id=2)
        assert [(d.job_id, d.success) for d in wait_finished(r.worker)] == [(2, True)]
        assert _landed(r, second, [44, 45]) == [True, True]
        _complete(r, second, ctx2)
    finally:
        release.set()
        plan.remove(rule)
    _wait_for(lambda: not r.worker.loads.ring.stuck(), "the held read to be reaped")
    assert not any(_landed(r, keys, [40, 41]))


def test_shutdown_mid_read_is_bounded_and_never_unmaps_under_a_read(
    tmp_path, plan, monkeypatch, caplog
):
    monkeypatch.setattr(worker_mod, "STOP_DEADLINE_S", 0.3)
    r = RequestRunner(tiered_spec(make_config(tmp_path, cpu_blocks=8, disk_blocks=32)))
    keys = push_to_disk(r, [1, 2, 3, 4])
    release = threading.Event()
    plan.add(FaultRule.hang(release, ops="read"))
    buffer = r.worker.cpu_buffer
    try:
        _submit(r, keys, [40, 41, 42, 43], job_id=1)
        _wait_for(lambda: plan.count(FaultKind.HANG) >= 1, "the held read")
        with caplog.at_level("ERROR", logger="vllm.kvtier.connector"):
            started = time.monotonic()
            r.worker.shutdown()
            assert time.monotonic() - started < DEADLINE_S
        assert any("did not stop within" in m for m in caplog.messages)
        # The held read still targets the bounce area: nothing was unmapped.
        assert not buffer._closed
    finally:
        release.set()
    thread = r.worker.loads.thread
    thread.join(DEADLINE_S)
    assert not thread.is_alive()
    # The read returned after shutdown: nothing of it reached the KV cache.
    assert not any(_landed(r, keys, [40, 41, 42, 43]))
    r.worker.reader.close()
    buffer.close()
    r.manager.shutdown()


def test_the_store_is_opened_ahead_of_the_first_load(runner):
    """The first open probes O_DIRECT (tens of ms); the load thread does it
    at the first step, not during the first disk hit."""
    r = runner
    files = r.worker.reader.files
    assert files.handles == [None]  # the worker started before the store
    assert r.worker.get_finished() == []  # the first step
    _wait_for(lambda: files.handles[0] is not None, "the slab opened ahead")
    keys = push_to_disk(r, [1, 2, 3, 4])
    ctx = _submit(r, keys, [40, 41, 42, 43], job_id=1)
    assert [d.success for d in wait_finished(r.worker)] == [True]
    _complete(r, keys, ctx)


def test_a_slab_that_could_not_open_is_opened_before_any_load(tmp_path, plan):
    """A slab that could not be opened ahead (not made yet, or its open
    failed) is tried again while the load thread is idle, not left for the
    first disk hit, maybe hours later: once open, a store directory removed
    meanwhile still reads."""
    r = _runner_with_an_unopened_slab(tmp_path, plan)
    try:
        files = r.worker.reader.files
        _wait_for(lambda: files.handles[0] is not None, "the slab opened again")
        keys = push_to_disk(r, [1, 2, 3, 4])
        shutil.rmtree(files.dirs[0])
        ctx = _submit(r, keys, [40, 41, 42, 43], job_id=1)
        assert [d.success for d in wait_finished(r.worker)] == [True]
        _complete(r, keys, ctx)
        assert all(_landed(r, keys, [40, 41, 42, 43]))
    finally:
        r.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice")
def test_the_load_thread_yields_the_cpu_to_the_engine(runner):
    """The load thread runs LOAD_THREAD_NICE nice levels below the engine's
    thread, which keeps its own."""
    r = runner
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert r.worker.get_finished() == []  # the first step starts the thread
    thread = r.worker.loads.thread
    assert thread is not None
    if base >= 19:
        pytest.skip("already at the lowest priority")
    want = min(19, base + pipeline.LOAD_THREAD_NICE)
    assert want > base
    _wait_for(
        lambda: thread.native_id is not None
        and os.getpriority(os.PRIO_PROCESS, thread.native_id) == want,
        "the load thread's nice level",
    )
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base


def test_a_load_thread_that_cannot_start_costs_loads_not_the_engine(
    tmp_path, plan, monkeypatch
):
    """No thread can start (RuntimeError, as with no threads left): the
    worker's warm-up step says so and goes on, a load submitted meanwhile
    fails whole (a recompute) and is never run later, and once a thread can
    start again the next load starts it and completes."""
    start = threading.Thread.start
    refuse = threading.Event()
    refuse.set()

    def guarded_start(self):
        if self.name == "kvtier-load" and refuse.is_set():
            raise RuntimeError("can't start new thread")
        return start(self)

    monkeypatch.setattr(threading.Thread, "start", guarded_start)
    r = RequestRunner(tiered_spec(make_config(tmp_path, cpu_blocks=8, disk_blocks=32)))
    try:
        assert r.worker.get_finished() == []  # the warm-up step goes on
        keys = push_to_disk(r, [1, 2, 3, 4])
        ctx = _submit(r, keys, [40, 41, 42, 43], job_id=1)
        assert [(d.job_id, d.success) for d in wait_finished(r.worker)] == [(1, False)]
        error = r.worker.take_load_error(1)
        assert error.unread == keys
        _complete(r, keys, ctx, error)
        refuse.clear()
        ctx = _submit(r, keys, [44, 45, 46, 47], job_id=2)
        assert [(d.job_id, d.success) for d in wait_finished(r.worker)] == [(2, True)]
        assert _landed(r, keys, [44, 45, 46, 47]) == [True] * 4
        _complete(r, keys, ctx)
        # Job 1's task left with its error: nothing wrote its blocks.
        assert not any(_landed(r, keys, [40, 41, 42, 43]))
    finally:
        r.close()


def test_a_copy_that_never_returns_never_stops_the_engine_step(runner, monkeypatch):
    """The load thread is stuck inside a CPU-tier load's copy (it holds the
    task's lock): past the deadline the worker gives the job up without
    waiting for that lock, so get_finished returns; the job is reported,
    failed, once the copy returns."""
    r = runner
    on_cpu = r.store("z", [30, 31])
    r.worker.loads.deadline_s = 0.3
    copies = r.worker.loads.copies
    copy = copies.submit
    entered, release = threading.Event(), threading.Event()

    def stuck_copy(*args, **kwargs):
        entered.set()
        release.wait(DEADLINE_S)
        return copy(*args, **kwargs)

    monkeypatch.setattr(copies, "submit", stuck_copy)
    try:
        ctx = _submit(r, on_cpu, [50, 51], job_id=1)
        assert entered.wait(DEADLINE_S), "the copy never started"
        _wait_for(r.worker.loads.overdue, "the thread to be overdue")
        steps: list[list] = []
        step = threading.Thread(target=lambda: steps.append(r.worker.get_finished()))
        step.start()
        step.join(10)
        assert not step.is_alive(), "get_finished waited for the stuck copy"
        assert steps == [[]]  # given up, reported once the copy is back
    finally:
        release.set()
    done = wait_finished(r.worker)
    assert [(d.job_id, d.success) for d in done] == [(1, False)]
    error = r.worker.take_load_error(1)
    _complete(r, on_cpu, ctx, error)


def test_a_task_that_raises_as_the_thread_takes_it_in_is_still_reported(
    runner, monkeypatch
):
    """The load thread cuts each task it takes from the queue into units
    (and lays the bounce area out for it). A task that raises there (a bug)
    fails whole and is reported, as one that raises later does; it was out
    of the queue and not yet among the held tasks, so it was handed back
    by no one and its request waited for its load for ever. Later loads
    are served."""
    r = runner
    keys = push_to_disk(r, [1, 2], others="bcdef")
    second = r.keys("b", 4)[:2]
    real_cut = pipeline.LoadTask.cut

    def cut(task, per_unit):
        if task.job_id == 1:
            raise RuntimeError("a bug while the thread takes the task in")
        return real_cut(task, per_unit)

    monkeypatch.setattr(pipeline.LoadTask, "cut", cut)
    ctx = _submit(r, keys, [40, 41], job_id=1)
    done = wait_finished(r.worker, timeout=10.0)
    assert [(d.job_id, d.success) for d in done] == [(1, False)]
    error = r.worker.take_load_error(1)
    assert error.whole and error.unread == keys
    assert error.gpu_block_ids == {40, 41}
    _complete(r, keys, ctx, error)
    ctx2 = _submit(r, second, [44, 45], job_id=2)
    assert [(d.job_id, d.success) for d in wait_finished(r.worker)] == [(2, True)]
    assert _landed(r, second, [44, 45]) == [True, True]
    _complete(r, second, ctx2)
    assert not any(_landed(r, keys, [40, 41]))


def test_an_expedited_loads_returned_batch_goes_before_other_loads_copies(
    runner, monkeypatch
):
    """vLLM 0.33 waits within the engine step for an expedited (synchronous)
    load. On the CPU platform the load thread also copies the CPU-tier rows
    of the other loads, a unit per turn. Once the expedited load's read
    returned, its batch is verified and copied next: it went first only to
    be read, then waited, and the step with it, until every queued
    CPU-tier copy of the other loads was done."""
    r = runner
    disk_keys = push_to_disk(r, [1, 2], others="bcdef")
    cpu_keys = r.keys("f", 4)  # stored last: in the CPU tier
    h = r.manager.hierarchy
    assert [h.lookup(k).name for k in cpu_keys] == ["HIT_CPU"] * 4
    loads = r.worker.loads
    monkeypatch.setattr(loads, "_per_unit", 1)  # four units of CPU-row copies
    events: list[str] = []
    copies = r.worker.copies
    real_copy = copies.submit

    def read_returned() -> bool:
        reading = loads.ring.reading()
        return bool(reading) and all(r.worker.reader.ready(p.pending) for p in reading)

    def copy(area, group, plan, to_host, expedited=False):
        if area == "cpu" and not to_host:
            if not events:
                # The first unit: until the expedited load's read returned.
                _wait_for(read_returned, "the expedited read")
            events.append("cpu unit")
        return real_copy(area, group, plan, to_host, expedited)

    monkeypatch.setattr(copies, "submit", copy)
    real_done = loads._done

    def done(task):
        events.append(f"job {task.job_id} back")
        real_done(task)

    monkeypatch.setattr(loads, "_done", done)
    assert r.lookup("f", cpu_keys) == 4
    ctx1, spec1 = r.ctx, r.manager.prepare_load(cpu_keys, r.ctx)
    assert r.lookup("a", disk_keys) == 2
    ctx2, spec2 = r.ctx, r.manager.prepare_load(disk_keys, r.ctx)
    for t in r.kv:
        t[[40, 41, 42, 43, 48, 49]] = 0
    r.worker.submit_load(1, spec1, GPULoadStoreSpec([40, 41, 42, 43], [4], [0]))
    r.worker.submit_load(2, spec2, GPULoadStoreSpec([48, 49], [2], [0]), expedited=True)
    wait_jobs(r.worker, {2})
    done_jobs = wait_finished(r.worker, count=2)
    assert sorted((d.job_id, d.success) for d in done_jobs) == [(1, True), (2, True)]
    assert events.index("job 2 back") < events.index("cpu unit") + 2, events
    assert _landed(r, cpu_keys + disk_keys, [40, 41, 42, 43, 48, 49]) == [True] * 6
    _complete(r, cpu_keys, ctx1)
    _complete(r, disk_keys, ctx2)
