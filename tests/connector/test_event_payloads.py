"""With ``self_describing_kv_events``, vLLM's event tracker keeps a payload
(token ids, block hashes) per offloaded block until a removal clears the
last residency it recorded. Its lookup records a CPU residency for every
hit, and its store path one for every store it builds, because vLLM's own
managers answer hits from the CPU tier only and announce a failed store.
kvtier also answers disk hits and fails stores a worker reported: a block
gone from every tier must not leave its payload behind (an unbounded leak
of the scheduler process), and a block still held must keep it.

Real vLLM pieces: its ``OffloadingEventsTracker``, its connector scheduler's
lookup (``_maximal_prefix_lookup``) and ``take_events``, ``Request`` and its
block hasher, over kvtier's manager and connector. Runs under vLLM 0.33 too
(tests/compat/test_vllm_next.py), whose lookup records the CPU residency
for every hit, where 0.32 records it only for a key without a payload.
"""

from __future__ import annotations

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
    get_offloading_event_group_spec,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    GroupOffloadConfig,
    OffloadingConnectorScheduler,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.kv_offload.base import (
    OffloadingKVEventsConfig,
    ReqContext,
    make_offload_key,
)
from vllm.v1.request import Request

from kvtier.connector.connector import TieredOffloadingConnector
from kvtier.connector.manager import TieredOffloadingManager
from kvtier.connector.worker_report import WorkerReport
from kvtier.tiers.hierarchy import TierHierarchy

TOKENS = 16


def _group() -> GroupOffloadConfig:
    spec = FullAttentionSpec(
        block_size=TOKENS, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    values = dict(
        group_idx=0,
        tokens_per_block=TOKENS,
        tokens_per_chunk=TOKENS,
        hashes_per_chunk=1,
        kv_event_group_spec=get_offloading_event_group_spec(
            KVCacheGroupSpec(["l0"], spec)
        ),
        sliding_window_size_in_chunks=None,
        kv_cache_spec=spec,
        manager_cls=FullAttentionManager,
    )
    # The fields of this vLLM's GroupOffloadConfig (0.32 and 0.33 differ).
    return GroupOffloadConfig(
        **{k: values[k] for k in GroupOffloadConfig._fields if k in values}
    )


def _request(req_id: str, blocks: int, seed: int) -> Request:
    init_none_hash(sha256)
    tokens = [(seed * 1000 + i) % 30000 + 1 for i in range(blocks * TOKENS + 1)]
    return Request(
        req_id,
        tokens,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(TOKENS, sha256),
    )


def _keys(req: Request) -> list:
    return [make_offload_key(h, 0) for h in req.block_hashes]


class _Setup:
    """kvtier's manager behind vLLM's connector scheduler and kvtier's
    connector, with only the parts their lookup and event paths read."""

    def __init__(self, cpu: int, disk: int) -> None:
        self.h = TierHierarchy(cpu, disk, spill_watermark=0.0, record_events=True)
        self.manager = TieredOffloadingManager(
            self.h, None, block_bytes=64, enable_events=True
        )
        self.tracker = OffloadingEventsTracker(
            OffloadingKVEventsConfig(
                enable_kv_cache_events=True, self_describing_kv_events=True
            )
        )
        sched = OffloadingConnectorScheduler.__new__(OffloadingConnectorScheduler)
        sched.manager = self.manager
        sched._events_tracker = self.tracker
        self.sched = sched
        conn = TieredOffloadingConnector.__new__(TieredOffloadingConnector)
        conn.connector_scheduler = sched
        conn._reset_events = []
        self.connector = conn
        # What TieredOffloadingConnector.__init__ sets for a self-describing
        # tracker.
        self.manager.collect_left_keys = True
        self.group = _group()

    def step_events(self) -> list:
        """One engine step's events, through kvtier's connector."""
        return list(self.connector.take_events())

    def store(self, req: Request, step: bool = True) -> list:
        """Store ``req``'s blocks as vLLM does, written back; then an engine
        step's events, unless ``step`` is False."""
        keys = _keys(req)
        ctx = ReqContext(req.request_id)
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None
        for i, key in enumerate(keys):
            self.tracker.record_store(req, self.group, i, key)
        self.manager.complete_store(keys, ctx)
        for order in self.h.take_spills():  # written back
            self.h.complete_spill(order.job_id)
        if step:
            self.step_events()
        return keys

    def look_up(self, req: Request) -> int:
        ctx = ReqContext(req.request_id)
        self.manager.on_new_request(ctx)
        return self.sched._maximal_prefix_lookup(_keys(req), ctx, req, self.group, 0)

    def payload(self, key):
        return self.tracker._pending_event_metadata.get(key)


def test_a_disk_hit_dropped_from_disk_leaves_no_payload():
    """A block pushed out of the CPU tier is hit on disk, and its load finds
    it corrupt: kvtier drops it from disk, so it is in no tier, and its
    payload must go (on 0.33 the lookup's CPU residency kept it)."""
    s = _Setup(cpu=2, disk=4)
    (key,) = s.store(_request("A", 1, seed=0))
    s.store(_request("X", 2, seed=7))  # pushes A's block out of the CPU tier
    assert not s.h.cpu.is_ready(key) and s.h.disk.is_ready(key)
    b = _request("B", 1, seed=0)
    assert s.look_up(b) == 1  # a disk hit, through vLLM's lookup
    ctx = ReqContext("B")
    s.manager.prepare_load([key], ctx)
    s.manager.note_worker_report(WorkerReport(corrupt_keys={"B": [key]}))
    s.manager.complete_load([key], ctx)
    removed = [e.medium for e in s.step_events() if type(e).__name__ == "BlockRemoved"]
    assert not s.h.holds(key)
    assert "STORAGE" in removed
    assert s.payload(key) is None


def test_warm_restart_blocks_hit_then_evicted_leave_no_payload():
    """Blocks adopted at a warm restart have no payload; a disk hit makes
    one (with a CPU residency) that the block's disk eviction never
    clears: vLLM 0.32 and 0.33 alike."""
    s = _Setup(cpu=4, disk=2)
    reqs = [_request(f"R{i}", 1, seed=i) for i in range(2)]
    keys = [_keys(r)[0] for r in reqs]
    s.h.restore_disk([(k, i) for i, k in enumerate(keys)])
    s.step_events()
    for r in reqs:
        assert s.look_up(r) == 1  # hit, but not scheduled this step
    assert all(s.payload(k) is not None for k in keys)
    s.store(_request("N", 2, seed=99))  # written back: the disk evicts both
    assert not any(s.h.holds(k) for k in keys)
    assert [k for k in keys if s.payload(k) is not None] == []


def test_a_failed_store_leaves_no_payload():
    """A worker reports a store's CPU row failed; vLLM completes the job as
    a success and kvtier drops the key without an event: vLLM's store path
    had already recorded its payload."""
    s = _Setup(cpu=4, disk=0)
    req = _request("A", 1, seed=0)
    (key,) = _keys(req)
    ctx = ReqContext("A")
    s.manager.on_new_request(ctx)
    out = s.manager.prepare_store([key], ctx)
    s.tracker.record_store(req, s.group, 0, key)  # vLLM's _build_store_jobs
    (row,) = out.store_spec.block_ids
    s.manager.note_worker_report(WorkerReport(failed_store_rows=[int(row)]))
    s.manager.complete_store([key], ctx)
    s.step_events()
    assert key not in s.h.cpu
    assert s.payload(key) is None


def test_a_block_still_held_keeps_its_payload():
    """The cleanup forgets only keys in no tier: a block evicted from the
    CPU tier but on disk keeps its payload; one that leaves its last tier
    and is stored again within one step keeps the new store's payload."""
    s = _Setup(cpu=2, disk=4)
    (key,) = s.store(_request("A", 1, seed=0))
    s.store(_request("X", 2, seed=7))
    assert not s.h.cpu.is_ready(key) and s.h.disk.is_ready(key)
    assert s.payload(key) is not None
    # In one step: the disk evicts A's block, and A is stored again.
    s.store(_request("Y", 4, seed=11), step=False)
    assert not s.h.holds(key)
    (again,) = s.store(_request("A2", 1, seed=0), step=False)
    assert again == key
    s.step_events()
    assert s.h.holds(key) and s.payload(key) is not None
    # Now gone for good: pushed out of both tiers by new blocks.
    for i in range(3):
        s.store(_request(f"Z{i}", 2, seed=20 + i))
    assert not s.h.holds(key) and s.payload(key) is None
