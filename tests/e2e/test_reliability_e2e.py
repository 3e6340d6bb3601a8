"""Reliability on a real engine: disk faults, exceptions in the worker,
aborted requests, bounded soak.

Every fault must cost a miss or a failed store, never a wrong token or a
hung request: each test compares greedy outputs with the no-offload
baseline and checks that the tiers' bookkeeping (pins, reservations,
pending jobs, slots) returns to rest afterwards.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import pytest
from vllm import SamplingParams

from kvtier.store.slot import slot_size
from kvtier.testing.engine import drain, engine, run_prompts
from kvtier.testing.faults import FaultPlan, FaultRule, inject_faults
from kvtier.testing.model import make_prompt
from kvtier.testing.state import num_loads
from kvtier.tiers.slots import BlockState

from .workload import (
    FIRST,
    GPU_BLOCKS,
    MAX_TOKENS,
    RETURNING,
    kvtier_config,
    manager_of,
    run_each,
    run_settled,
)

pytestmark = pytest.mark.e2e


def assert_at_rest(mgr) -> None:
    """No pins, reservations, loads, writes or disk jobs left anywhere."""
    h = mgr.hierarchy
    deadline = time.monotonic() + 60
    while mgr.has_pending_work() and time.monotonic() < deadline:
        mgr.on_schedule_end(None)
        time.sleep(0.005)
    assert not mgr.has_pending_work()
    for tier in (h.cpu, h.disk):
        for key, block in tier.items():
            assert block.pins == 0, (tier.medium, key.hex(), block)
            assert block.state is BlockState.READY, (tier.medium, key.hex(), block)
    assert num_loads(h) == 0 and not mgr._corrupt_loads
    assert h._spills is None or not h._spills.spilling


@pytest.fixture
def inject(monkeypatch):
    """Wrap every disk back end kvtier creates in a FaultInjectingBackend:
    the scheduler's (spills) and the workers' (loads)."""
    return inject_faults(monkeypatch, FaultPlan(seed=7))


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("eio-on-read", FaultRule.error(errno.EIO, ops="read")),
        ("short-read", FaultRule.short(ops="read")),
        ("bit-flip-on-read", FaultRule.bit_flip(ops="read", flips=3)),
        ("enospc-on-write", FaultRule.error(errno.ENOSPC, ops="write")),
        ("eio-on-write", FaultRule.error(errno.EIO, ops="write")),
    ],
)
def test_disk_faults_cost_misses_never_tokens(
    model, block_bytes, baseline, tmp_path, inject, caplog, name, rule
):
    inject.add(rule)
    with (
        caplog.at_level(logging.WARNING, logger="vllm.kvtier"),
        engine(
            model, kvtier_config(block_bytes, tmp_path), num_gpu_blocks=GPU_BLOCKS
        ) as llm,
    ):
        first = run_each(llm, FIRST)
        again = run_prompts(llm, RETURNING, MAX_TOKENS)
        mgr = manager_of(llm)
        stats, failures = mgr.hierarchy.stats, mgr.hierarchy.disk_core.failures
        errors = (
            mgr.runtime.io_errors()
            + mgr.runtime.checksum_failures()
            + mgr.worker_totals.io_errors
            + mgr.worker_totals.checksum_failures
        )
        assert_at_rest(mgr)
        # The engine keeps serving, and correctly.
        assert run_prompts(llm, RETURNING, MAX_TOKENS).outputs == baseline[len(FIRST) :]
    # Correct tokens, recomputed instead of read from the failing disk.
    assert first.outputs + again.outputs == baseline
    assert inject.count() > 0
    if "write" in name:
        assert stats.spill_failures > 0 and stats.spills_completed == 0
        assert again.totals.get("disk", 0) == 0
    else:
        # Every failed block was reported to vLLM. Bad bytes dropped it from
        # the tier at once; an I/O error (EIO, a short read of a whole slab)
        # kept it for later requests, which read it again, until its reads
        # had failed MAX_READ_IO_ERRORS times in a row: each failed read was
        # either kept or dropped, once per load.
        assert stats.load_failures > 0
        if name == "bit-flip-on-read":
            assert stats.loads_disk + stats.load_failures == 2 * 4
            assert failures.corrupt > 0 and failures.io_errors_kept == 0
        else:
            assert failures.io_errors_kept > 0 and failures.corrupt == 0
            assert stats.load_failures == failures.io_errors_kept + failures.unreadable
    assert errors > 0
    # Logged, once per file and kind, naming the errno or the failed check.
    faults = [r for r in caplog.records if r.name.startswith("vllm.kvtier")]
    assert faults, "the fault was not logged"
    assert len(faults) <= 4, [r.getMessage() for r in faults]


def _worker(llm):
    """The engine's TieredOffloadingWorker (worker-side connector, in-process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().connector_worker.worker


def _raise_once(monkeypatch, obj, name: str, exc: Exception, when=None) -> list:
    """Make ``obj.name`` raise ``exc`` at its first call that ``when`` picks
    (any call by default); every other call goes through. Returns the
    calls' positional arguments."""
    real = getattr(obj, name)
    calls: list = []

    def patched(*args, **kwargs):
        picked = when is None or when(*args, **kwargs)
        calls.append((args, picked))
        if picked and sum(p for _, p in calls) == 1:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, patched)
    return calls


def test_a_disk_load_that_raises_is_recomputed_not_hung(
    model, block_bytes, baseline, tmp_path, monkeypatch, caplog
):
    with (
        caplog.at_level(logging.ERROR, logger="vllm.kvtier"),
        engine(
            model, kvtier_config(block_bytes, tmp_path), num_gpu_blocks=GPU_BLOCKS
        ) as llm,
    ):
        first = run_each(llm, FIRST)
        mgr = manager_of(llm)
        assert_at_rest(mgr)
        stats, failures = mgr.hierarchy.stats, mgr.hierarchy.disk_core.failures
        before, failures_before = dict(vars(stats)), dict(vars(failures))
        # Raised on the worker's load thread, where reads are verified.
        reads = _raise_once(
            monkeypatch, _worker(llm).reader, "complete", RuntimeError("reader bug")
        )
        # One at a time, stepped by hand under a deadline: RETURNING[0]'s
        # load raises in the worker, RETURNING[1]'s then reads from disk.
        again = run_settled(llm, RETURNING, timeout=120)
        assert_at_rest(mgr)
        after = dict(vars(stats))
        # The engine keeps serving, correctly, from the tiers once the GPU
        # cache forgot both prompts: RETURNING[0]'s disk copies were not
        # shown bad by the exception, so they stay and serve it now.
        assert llm.reset_prefix_cache()
        later = run_settled(llm, RETURNING, timeout=120)
        assert_at_rest(mgr)
        exceptions = mgr.worker_totals.exceptions
    assert first.outputs + again.outputs == baseline
    assert later.outputs == baseline[len(FIRST) :]
    assert len(reads) >= 2  # the raising read, and RETURNING[1]'s
    # Both loads were planned from disk; the first failed whole and was
    # recomputed (its disk copies kept: an exception is no evidence against
    # them), the second was served.
    assert [h.get("disk", 0) for h in again.hits_by_source] == [4 * 32, 4 * 32]
    assert after["load_failures"] - before["load_failures"] == 4
    # RETURNING[1]'s 4 only: after its failed load RETURNING[0] is
    # recomputed, not loaded again (its copies were kept for later requests).
    assert after["loads_disk"] - before["loads_disk"] == 4
    assert dict(vars(failures)) == failures_before  # nothing kept or dropped
    assert exceptions == 1
    errors = [r for r in caplog.records if "raised RuntimeError" in r.getMessage()]
    assert len(errors) == 1 and errors[0].exc_info is not None
    for hits in later.hits_by_source:
        assert hits.get("disk", 0) + hits.get("host", 0) == 4 * 32, later.hits_by_source


# A prompt needing more than half of the GPU cache (19 usable blocks).
LONG_PROMPT = make_prompt(900, 12 * 32 + 5)


def test_a_failed_load_of_a_long_prompt_is_recomputed_not_hung(
    model, block_bytes, tmp_path, inject
):
    """vLLM keeps a request whose asynchronous load failed with no valid
    token in its in-flight prefills, so loading it again would reserve its
    blocks twice: a prompt needing more than half of the free KV cache was
    never admitted again and the engine spun on it (the disk kept the
    blocks after an I/O error, so every lookup offered the load again).
    After a failed load the request is recomputed instead, under a
    deadline, with the baseline's tokens."""
    with engine(model, None, num_gpu_blocks=GPU_BLOCKS) as llm:
        (expected,) = run_prompts(llm, [LONG_PROMPT], MAX_TOKENS).outputs
    with engine(
        model, kvtier_config(block_bytes, tmp_path), num_gpu_blocks=GPU_BLOCKS
    ) as llm:
        first = run_settled(llm, [LONG_PROMPT, *FIRST], timeout=120)
        mgr = manager_of(llm)
        stats, failures = mgr.hierarchy.stats, mgr.hierarchy.disk_core.failures
        before = dict(vars(stats))
        inject.add(FaultRule.error(errno.EIO, ops="read"))
        again = run_settled(llm, [LONG_PROMPT], timeout=90)
        assert_at_rest(mgr)
        after = dict(vars(stats))
    assert first.outputs[0] == again.outputs[0] == expected
    # Planned from disk, its first block failed (nothing valid), recomputed:
    # one failed load, no second one.
    assert again.hits_by_source[0].get("disk", 0) >= 32, again.hits_by_source
    assert again.num_cached_tokens == [0]
    assert after["load_failures"] > before["load_failures"]
    assert after["loads_disk"] == before["loads_disk"]
    assert failures.io_errors_kept > 0  # the copies stay for later requests


def test_a_store_that_raises_is_not_offloaded_and_nothing_hangs(
    model, block_bytes, baseline, tmp_path, monkeypatch
):
    with engine(
        model, kvtier_config(block_bytes, tmp_path), num_gpu_blocks=GPU_BLOCKS
    ) as llm:
        worker = _worker(llm)
        stores = _raise_once(
            monkeypatch,
            worker.copies,
            "submit",
            TypeError("copy path bug"),
            when=lambda area, group, plan, to_host, *rest: to_host,
        )
        first = run_settled(llm, FIRST, timeout=120)
        mgr = manager_of(llm)
        assert_at_rest(mgr)
        h = mgr.hierarchy
        # FIRST[0]'s store raised: its blocks were never offloaded; the
        # others were, and FIRST[1] is on disk.
        assert sum(p for _, p in stores) > 1
        assert h.stats.stores_failed == 4 and mgr.worker_totals.exceptions == 1
        assert not mgr._failed_store_rows
        again = run_settled(llm, RETURNING, timeout=120)
        assert_at_rest(mgr)
    assert first.outputs + again.outputs == baseline
    assert again.hits_by_source[0].get("disk", 0) == 0, again.hits_by_source
    assert again.hits_by_source[1].get("disk", 0) == 4 * 32, again.hits_by_source


def test_aborted_requests_return_pins_and_slots(model, block_bytes, baseline, tmp_path):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with engine(
        model, kvtier_config(block_bytes, tmp_path), num_gpu_blocks=GPU_BLOCKS
    ) as llm:
        run_each(llm, FIRST)
        mgr = manager_of(llm)
        assert_at_rest(mgr)
        # Returning prompts load from disk; abort them in flight, at several
        # points of their life.
        for steps_before_abort in (0, 1, 2, 5):
            ids = [f"abort-{steps_before_abort}-{i}" for i in range(len(RETURNING))]
            for rid, prompt in zip(ids, RETURNING):
                llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            for _ in range(steps_before_abort):
                llm.llm_engine.step()
            llm.llm_engine.abort_request(ids)
            drain(llm)
            assert_at_rest(mgr)
        # The tiers still serve correct data afterwards.
        again = run_prompts(llm, RETURNING, MAX_TOKENS)
        assert again.outputs == baseline[len(FIRST) :]
        assert_at_rest(mgr)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


SOAK_ROUNDS = int(os.environ.get("KVTIER_SOAK_ROUNDS", "3"))


def soak_workload(rounds: int) -> list[list[list[int]]]:
    """Rounds of 8 concurrent requests over 4 shared prefixes: each request
    is a 2-4 block shared prefix plus its own 1-2 block suffix."""
    prefixes = [make_prompt(1000 + p, 32 * (2 + p % 3)) for p in range(4)]
    batches = []
    for r in range(rounds):
        batch = []
        for i in range(8):
            suffix = make_prompt(2000 + 100 * r + i, 32 * (1 + i % 2) + 3)
            batch.append(prefixes[(r + i) % 4] + suffix)
        batches.append(batch)
    return batches


def test_bounded_soak_outputs_and_resources_return(model, block_bytes, tmp_path):
    """Spills, evictions, promotions and loads overlap under tiny tiers;
    outputs equal the baseline and resources return to where they began."""
    batches = soak_workload(SOAK_ROUNDS)
    with engine(model, None, num_gpu_blocks=GPU_BLOCKS + 12, max_num_seqs=8) as llm:
        expected = [run_prompts(llm, b, MAX_TOKENS).outputs for b in batches]

    fds, threads = _open_fds(), threading.active_count()
    cfg = kvtier_config(
        block_bytes,
        tmp_path,
        spill_watermark=0.25,
        eviction_policy="arc",
        disk_bytes_to_use=24 * slot_size(block_bytes),  # smaller than the load
    )
    deadline = time.monotonic() + 240  # bounded: stops by itself
    with engine(model, cfg, num_gpu_blocks=GPU_BLOCKS + 12, max_num_seqs=8) as llm:
        mgr = manager_of(llm)
        for batch, want in zip(batches, expected):
            assert time.monotonic() < deadline, "soak exceeded its time bound"
            got = run_prompts(llm, batch, MAX_TOKENS).outputs
            assert got == want
        h = mgr.hierarchy
        assert h.stats.spills_completed > 0
        assert h.stats.disk_evictions > 0  # the disk budget was binding
        assert len(h.disk) <= h.disk.capacity
        assert_at_rest(mgr)

    # After shutdown: no leaked files or threads of ours (threads and fds are
    # released asynchronously: wait for it, with a deadline).
    def ours() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("kvtier")]

    def settled() -> bool:
        return (
            _open_fds() <= fds
            and not ours()
            and threading.active_count() <= threads + 1
        )

    deadline = time.monotonic() + 60.0
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _open_fds() <= fds
    leaked = ours()
    assert not leaked, leaked
    assert threading.active_count() <= threads + 1


def test_preempted_requests_return_pins_and_keep_outputs(model, block_bytes, tmp_path):
    """A GPU cache too small for the batch makes vLLM preempt requests while
    their prefixes come back from the CPU and disk tiers."""
    from kvtier.testing.engine import get_scheduler

    prompts = [make_prompt(3000 + i, 3 * 32 + 5) for i in range(6)]
    long_tokens = 64  # 6 requests x 6 blocks >> 11 usable GPU blocks
    small = dict(num_gpu_blocks=12, max_num_seqs=6)
    with engine(model, None, **small) as llm:
        expected = run_prompts(llm, prompts, long_tokens).outputs

    with engine(model, kvtier_config(block_bytes, tmp_path), **small) as llm:
        sched = get_scheduler(llm)
        preemptions = 0
        original = sched._preempt_request

        def counting(*args, **kwargs):
            nonlocal preemptions
            preemptions += 1
            return original(*args, **kwargs)

        sched._preempt_request = counting
        first = run_prompts(llm, prompts, long_tokens)
        mgr = manager_of(llm)
        assert_at_rest(mgr)
        again = run_prompts(llm, prompts, long_tokens)  # prefixes from the tiers
        assert_at_rest(mgr)
    assert preemptions > 0
    assert first.outputs == expected and again.outputs == expected
    assert sum(again.totals.get(s, 0) for s in ("host", "disk")) > 0


def test_a_reset_that_preempts_running_requests_reloads_them(
    model, block_bytes, tmp_path
):
    """``reset_prefix_cache(reset_running_requests=True)`` preempts the
    running requests and, in the same step, readmits them: a request whose
    chunks the CPU tier holds is loaded back while vLLM flushes the jobs of
    the requests it preempted. Found by the engine fuzz (running resets)."""
    from kvtier.testing.engine import get_connector, get_scheduler

    prompt = FIRST[0]
    tokens = 48
    with engine(model, None, num_gpu_blocks=GPU_BLOCKS) as llm:
        expected = run_prompts(llm, [prompt], tokens).outputs[0]

    sp = SamplingParams(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False
    )
    cfg = kvtier_config(block_bytes, tmp_path)
    with engine(model, cfg, num_gpu_blocks=GPU_BLOCKS) as llm:
        core = llm.llm_engine
        sched = get_scheduler(llm)
        conn = get_connector(llm).connector_scheduler
        mgr = manager_of(llm)
        rid = core.add_request("reset-running", {"prompt_token_ids": prompt}, sp)
        out: list[int] = []
        deadline = time.monotonic() + 60
        # Run until the prompt's chunks are in the CPU tier, their stores
        # complete, and the request still runs.
        while not (
            len(mgr.hierarchy.cpu) >= len(prompt) // 32
            and not conn._req_status[rid].transfer_jobs
        ):
            assert time.monotonic() < deadline, "the prompt's chunks were not stored"
            for o in core.step():
                out = list(o.outputs[0].token_ids)
        assert len(out) < tokens and sched.running
        assert llm.reset_prefix_cache(reset_running_requests=True)
        finished = False
        while not finished:
            assert time.monotonic() < deadline, "the request did not finish"
            for o in core.step():
                out, finished = list(o.outputs[0].token_ids), o.finished
        assert out == expected
        assert mgr.hierarchy.stats.loads_cpu > 0  # it was loaded back
        drain(llm)
        assert_at_rest(mgr)
