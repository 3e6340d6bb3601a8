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

import threading

import pytest
import torch
from vllm.distributed.kv_events import BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
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
from kvtier.connector.kv_events import KvtierEventsTracker
from kvtier.connector.manager import TieredOffloadingManager
from kvtier.connector.worker_report import WorkerReport
from kvtier.testing.events import replay
from kvtier.tiers.hierarchy import TierHierarchy

TOKENS = 16


def _group(hashes: int = 1) -> GroupOffloadConfig:
    """One full-attention group of ``hashes`` GPU blocks a chunk."""
    spec = FullAttentionSpec(
        block_size=TOKENS, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    values = dict(
        group_idx=0,
        tokens_per_block=TOKENS,
        tokens_per_chunk=TOKENS * hashes,
        hashes_per_chunk=hashes,
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


def _keys(req: Request, hashes: int = 1) -> list:
    """Its chunks' keys: each chunk's last block hash."""
    return [make_offload_key(h, 0) for h in req.block_hashes[hashes - 1 :: hashes]]


class _Setup:
    """kvtier's manager behind vLLM's connector scheduler and kvtier's
    connector, with only the parts their lookup and event paths read."""

    def __init__(
        self, cpu: int, disk: int, hashes: int = 1, self_describing: bool = True
    ) -> None:
        self.h = TierHierarchy(cpu, disk, spill_watermark=0.0, record_events=True)
        self.manager = TieredOffloadingManager(
            self.h, None, block_bytes=64, enable_events=True
        )
        # What TieredOffloadingConnector.__init__ puts in vLLM's place.
        self.tracker = KvtierEventsTracker(
            OffloadingKVEventsConfig(
                enable_kv_cache_events=True,
                self_describing_kv_events=self_describing,
            )
        )
        sched = OffloadingConnectorScheduler.__new__(OffloadingConnectorScheduler)
        sched.manager = self.manager
        sched._events_tracker = self.tracker
        sched._req_status = {}
        # What vLLM's scheduler reset does to the objects here (no request
        # or job in flight): kvtier's connector reset runs around it.
        sched.reset_cache = self._vllm_reset
        self.sched = sched
        conn = TieredOffloadingConnector.__new__(TieredOffloadingConnector)
        conn.connector_scheduler = sched
        conn._reset_events = []
        conn._reset_tracker = None
        self.connector = conn
        # What TieredOffloadingConnector.__init__ sets for a self-describing
        # tracker.
        if self_describing:
            self.manager.collect_left_keys = True
            self.manager.reset_removal_hashes = hashes
        # Block hashes each event names of a chunk (placeholders: one).
        self.named = hashes if self_describing else 1
        self.hashes = hashes
        self.group = _group(hashes)

        # Every KV event the connector handed out, in order.
        self.events: list = []

    def _vllm_reset(self) -> None:
        self.manager.reset_cache()
        self.tracker.reset()

    def step_events(self) -> list:
        """One engine step's events, through kvtier's connector."""
        events = list(self.connector.take_events())
        self.events.extend(events)
        return events

    def store(self, req: Request, step: bool = True) -> list:
        """Store ``req``'s blocks as vLLM does, written back; then an engine
        step's events, unless ``step`` is False."""
        keys = _keys(req, self.hashes)
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
        keys = _keys(req, self.hashes)
        return self.sched._maximal_prefix_lookup(keys, ctx, req, self.group, 0)

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


def _step_until_nothing_owed(s: _Setup) -> None:
    """Engine steps until no event from before a reset is owed."""
    for _ in range(1000):
        if s.connector._reset_tracker is None and not s.h.has_event_backlog:
            return
        s.step_events()
    raise AssertionError("the reset's events never all went out")


def _subscriber_matches_the_tiers(s: _Setup) -> None:
    """Replayed, the events hold each block of each tier by every hash of
    its chunk, once; no removal named a hash not held, no store one held."""
    for medium, tier in {"CPU": s.h.cpu, "STORAGE": s.h.disk}.items():
        seen = replay(s.events, medium)
        assert seen.removed_unheld == [] and seen.stored_held == [], medium
        assert len(seen.held) == s.named * len(tier)
        assert set(seen.held.values()) <= {1}


def test_a_reset_s_removals_go_out_over_the_next_steps_with_their_payloads(
    monkeypatch,
):
    """A connector reset hands out its removals over the steps after it, a
    bounded share a step (it translated them all inside the reset: seconds
    for a million disk blocks), each naming every block hash its store
    named although vLLM's tracker dropped the payloads at the reset. A
    chunk stored again while its removal is still owed keeps its new
    payload, and its removal goes out first; a second reset while the
    first one's removals are owed hands those out first."""
    monkeypatch.setattr("kvtier.connector.manager.EVENT_BACKLOG_PER_STEP", 4)
    s = _Setup(cpu=4, disk=8, hashes=2)
    reqs = [_request(f"R{i}", 6, seed=i) for i in range(4)]  # 3 chunks each
    chunks = {key for req in reqs for key in _keys(req, 2)}
    for req in reqs[:3]:
        s.store(req)
    _step_until_nothing_owed(s)
    assert len(s.h.cpu) == 4 and len(s.h.disk) == 8
    for resets in (1, 2):
        held = {key for key in chunks if s.h.holds(key)}
        s.connector.reset_cache()
        translated = sum(len(ev.block_hashes) for ev in s.connector._reset_events)
        if resets == 1:  # one step's share: 4 hashes, 2 keys of 2 hashes
            assert translated == 4
        # Owed now: removals of blocks held at this reset only.
        assert {key for key in chunks if s.h.event_owed(key)} <= held
        assert len(s.h.cpu) == len(s.h.disk) == 0
        s.store(reqs[2 - resets])  # stored again while its removals are owed
        assert s.h.has_event_backlog and s.connector._reset_tracker is not None
    s.store(reqs[3])
    _step_until_nothing_owed(s)
    _subscriber_matches_the_tiers(s)
    stores = [ev for ev in s.events if isinstance(ev, BlockStored)]
    assert all(len(ev.block_hashes) == 2 and ev.token_ids for ev in stores)
    # vLLM's tracker describes exactly the blocks held.
    held_now = {key for key in chunks if s.h.holds(key)}
    assert held_now and s.tracker._pending_event_metadata.keys() == held_now


def _prepare_store(s: _Setup, req: Request) -> None:
    """A step schedules ``req``: its store prepared, its payloads recorded
    (vLLM's _build_store_jobs), not completed."""
    keys = _keys(req, s.hashes)
    ctx = ReqContext(req.request_id)
    s.manager.on_new_request(ctx)
    out = s.manager.prepare_store(keys, ctx)
    for i, key in enumerate(keys):
        if key in out.keys_to_store:
            s.tracker.record_store(req, s.group, i, key)


def test_a_second_reset_with_a_store_in_flight_of_a_block_still_owed(monkeypatch):
    """A reset owes a block's CPU and STORAGE removals; the block's store is
    prepared again (vLLM records its new payload, a CPU residency only) and
    is still in flight at a second reset. The first reset's removals must
    go out with the payload from before it: taking the new one, the CPU
    removal emptied its residencies and the STORAGE removal went out by the
    chunk's last hash only."""
    monkeypatch.setattr("kvtier.connector.manager.EVENT_BACKLOG_PER_STEP", 2)
    s = _Setup(cpu=4, disk=8, hashes=2)
    req = _request("A", 8, seed=1)  # 4 chunks of 2 blocks
    s.store(req)
    _step_until_nothing_owed(s)
    assert all(s.h.cpu.is_ready(k) and s.h.disk.is_ready(k) for k in _keys(req, 2))
    s.connector.reset_cache()
    s.step_events()
    _prepare_store(s, _request("A2", 8, seed=1))
    s.step_events()
    s.connector.reset_cache()  # the store in flight is dropped
    _step_until_nothing_owed(s)
    _subscriber_matches_the_tiers(s)


def _restored(s: _Setup, n: int) -> list[Request]:
    """``n`` one-chunk requests whose chunks a warm restart adopted."""
    reqs = [_request(f"W{i}", s.hashes, seed=i) for i in range(n)]
    s.h.restore_disk([(_keys(r, s.hashes)[0], i) for i, r in enumerate(reqs)])
    return reqs


def test_a_block_a_reset_finds_not_announced_yet_is_stored_again(monkeypatch):
    """A warm restart's block is still owed its announcement at a reset,
    and is stored again: its announcement and its removal go out as they
    would have before the reset (without the new payload), then the new
    store with it."""
    monkeypatch.setattr("kvtier.connector.manager.EVENT_BACKLOG_PER_STEP", 1)
    s = _Setup(cpu=4, disk=8, hashes=2)
    reqs = _restored(s, 3)
    s.step_events()  # one restored block announced
    s.connector.reset_cache()
    s.store(reqs[2])  # the last one, still owed its announcement
    _step_until_nothing_owed(s)
    _subscriber_matches_the_tiers(s)


def test_a_block_a_lookup_described_before_its_announcement_and_a_reset(
    monkeypatch,
):
    """A lookup hits a warm restart's block still owed its announcement
    (vLLM records its payload), then a reset: the announcement and the
    removal both name every hash of the chunk."""
    monkeypatch.setattr("kvtier.connector.manager.EVENT_BACKLOG_PER_STEP", 1)
    s = _Setup(cpu=4, disk=8, hashes=2)
    reqs = _restored(s, 3)
    s.step_events()
    assert s.look_up(reqs[2]) == 1
    s.connector.reset_cache()
    _step_until_nothing_owed(s)
    _subscriber_matches_the_tiers(s)


@pytest.mark.parametrize("self_describing", [True, False])
def test_resets_faster_than_the_steps_hand_out_their_removals_owe_one_reset(
    monkeypatch, self_describing
):
    """Resets come more often than the steps hand out their removals: each
    reset first hands out what the last one still owes, so the steps owe
    the removals of one reset's blocks at most, and the payloads kept for
    them are those vLLM's tracker held at that reset."""
    monkeypatch.setattr("kvtier.connector.manager.EVENT_BACKLOG_PER_STEP", 2)
    s = _Setup(cpu=16, disk=64, hashes=2, self_describing=self_describing)
    chunks: set = set()
    seed = 0
    for _ in range(12):
        for _ in range(4):  # 8 chunks, on CPU and disk; 5 steps: 10 keys at most
            seed += 1
            chunks.update(s.store(_request(f"S{seed}", 4, seed=seed)))
        seed += 1
        _prepare_store(s, _request(f"F{seed}", 4, seed=seed))  # in flight
        s.step_events()
        held = {key for key in chunks if s.h.holds(key)}
        live = len(s.tracker._pending_event_metadata)
        s.connector.reset_cache()
        assert {key for key in chunks if s.h.event_owed(key)} <= held
        if self_describing:
            kept = s.connector._reset_tracker._pending_event_metadata
            assert len(kept) <= live
    _step_until_nothing_owed(s)
    _subscriber_matches_the_tiers(s)


def test_the_reset_s_payloads_go_with_its_last_removal_of_each_block(monkeypatch):
    """The payloads a reset keeps for its removals go once a block's last
    one went out, though vLLM's tracker still records a residency for it:
    a warm-restarted disk block that a lookup hit (its CPU residency) is
    removed from disk only."""
    monkeypatch.setattr("kvtier.connector.manager.EVENT_BACKLOG_PER_STEP", 1)
    s = _Setup(cpu=2, disk=8)
    restored = _request("W", 1, seed=9)
    (key,) = _keys(restored)
    s.h.restore_disk([(key, 0)])
    for i in range(3):
        s.store(_request(f"R{i}", 2, seed=i))
    while s.step_events() or s.h.has_event_backlog:
        pass
    assert s.look_up(restored) == 1 and s.payload(key) is not None
    s.connector.reset_cache()
    kept = s.connector._reset_tracker
    while s.connector._reset_tracker is not None:
        assert all(map(s.h.event_owed, kept._pending_event_metadata))
        s.step_events()
    assert kept._pending_event_metadata == {}


def test_a_promoted_block_s_removals_after_a_first_reset_with_no_cpu_block(
    monkeypatch,
):
    """The engine's first reset finds only a warm restart's disk blocks, so
    the event log records a disk removal before any CPU one. A block later
    promoted back to the CPU tier (vLLM 0.32 records no CPU residency for
    it) is held on both at a second reset and stored again while both its
    removals are owed: they must go out CPU first, as the tiers held it,
    or vLLM's tracker drops its payload after the disk removal and the CPU
    removal names the chunk's last hash only."""
    monkeypatch.setattr("kvtier.connector.manager.EVENT_BACKLOG_PER_STEP", 1)
    s = _Setup(cpu=2, disk=8, hashes=2)
    _restored(s, 1)
    _step_until_nothing_owed(s)
    s.connector.reset_cache()
    _step_until_nothing_owed(s)
    (key,) = s.store(_request("A", 2, seed=1))
    s.store(_request("X", 4, seed=2))  # pushes A's block out of the CPU tier
    assert not s.h.cpu.is_ready(key) and s.h.disk.is_ready(key)
    assert s.look_up(_request("A1", 2, seed=1)) == 1
    ctx = ReqContext("A1")
    s.manager.prepare_load([key], ctx)
    s.manager.complete_load([key], ctx)  # promoted back to the CPU tier
    s.step_events()
    assert s.h.cpu.is_ready(key) and s.h.disk.is_ready(key)
    s.connector.reset_cache()
    s.store(_request("A2", 2, seed=1))  # stored again while both are owed
    _step_until_nothing_owed(s)
    _subscriber_matches_the_tiers(s)


@pytest.mark.parametrize("self_describing", [True, False])
def test_a_reset_right_after_a_reset_leaves_its_removals_to_the_steps(
    monkeypatch, self_describing
):
    """vLLM's sleep resets the connector twice, with no step between. The
    second reset forgets no block, so the first one's removals, still owed,
    go on going out over the steps (handing them out inside the reset cost
    seconds at a million blocks), with the first one's payloads."""
    monkeypatch.setattr("kvtier.connector.manager.EVENT_BACKLOG_PER_STEP", 2)
    s = _Setup(cpu=4, disk=8, hashes=2, self_describing=self_describing)
    for i in range(3):
        s.store(_request(f"R{i}", 6, seed=i))
    _step_until_nothing_owed(s)
    s.connector.reset_cache()
    kept = s.connector._reset_tracker
    s.connector.reset_cache()  # back to back
    assert s.h.owes_events_of("reset")
    assert s.connector._reset_tracker is kept
    assert sum(len(ev.block_hashes) for ev in s.connector._reset_events) <= 4 * 2
    _step_until_nothing_owed(s)
    _subscriber_matches_the_tiers(s)


def test_a_reset_vllm_fails_leaves_the_payloads_where_they_were():
    """vLLM's part of the reset raises: the payloads the connector moved
    aside before it are vLLM's tracker's again, as vLLM left them."""
    s = _Setup(cpu=4, disk=8, hashes=2)
    keys = s.store(_request("A", 4, seed=1))

    def failing_reset() -> None:
        raise RuntimeError("vLLM's reset failed")

    s.sched.reset_cache = failing_reset
    with pytest.raises(RuntimeError, match="reset failed"):
        s.connector.reset_cache()
    assert all(s.payload(key) is not None for key in keys)


def _load(s: _Setup, keys: list, req_id: str) -> None:
    """A load of ``keys`` (looked up), completed: a disk block is promoted
    to the CPU tier."""
    ctx = ReqContext(req_id)
    s.manager.prepare_load(keys, ctx)
    s.manager.complete_load(keys, ctx)


def _keep_hot_until_off_disk(s: _Setup, req: Request) -> None:
    """``req``'s chunk read from the CPU tier again and again (kept there)
    while new blocks push its disk copy out."""
    (key,) = _keys(req, s.hashes)
    for i in range(8):
        if not s.h.disk.is_ready(key):
            break
        assert s.look_up(req) == 1
        _load(s, [key], f"hot{i}")
        s.store(_request(f"Z{i}", 2, seed=10 + i))
    assert s.h.cpu.is_ready(key) and not s.h.disk.is_ready(key)


def _everything_removed_as_announced(s: _Setup) -> None:
    """After a reset and its removals: the subscriber holds nothing, and no
    removal named a hash not held, nor a store one held."""
    s.connector.reset_cache()
    _step_until_nothing_owed(s)
    for medium in ("CPU", "STORAGE"):
        seen = replay(s.events, medium)
        assert seen.removed_unheld == [] and seen.stored_held == [], medium
        assert seen.held == {}, medium


@pytest.mark.parametrize(
    "then", ["evicted", "promoted-disk-copy-evicted-first", "reset"]
)
def test_a_warm_restart_block_s_removal_names_what_its_announcement_named(then):
    """A warm restart announces its blocks on STORAGE by their chunk's last
    hash: no request described them yet. A lookup then records a block's
    payload (every hash of its chunk), and its STORAGE removal must still
    name what its store named: naming the chunk's other hashes, it took a
    reference-counting subscriber (vLLM's events module asks consumers to
    count) below zero on them, and a set-based one was told of hashes it
    never held. Its CPU copy, stored with the payload, is named in full."""
    s = _Setup(cpu=2, disk=4, hashes=2)
    reqs = _restored(s, 2)
    keys = [_keys(r, 2)[0] for r in reqs]
    _step_until_nothing_owed(s)
    for r in reqs:
        assert s.look_up(r) == 1  # vLLM records the payload
    if then == "promoted-disk-copy-evicted-first":
        _load(s, keys[:1], "L")  # promoted to the CPU tier
        _keep_hot_until_off_disk(s, reqs[0])
    if then == "reset":
        s.connector.reset_cache()
    else:
        for i in range(3):  # new blocks push both out of both tiers
            s.store(_request(f"N{i}", 4, seed=50 + i))
    _step_until_nothing_owed(s)
    assert not any(s.h.holds(k) for k in keys)
    for medium in ("CPU", "STORAGE"):
        seen = replay(s.events, medium)
        assert seen.removed_unheld == [] and seen.stored_held == [], medium
    _subscriber_matches_the_tiers(s)
    assert [k for k in keys if s.payload(k) is not None] == []


def test_a_block_stored_again_in_the_step_its_cpu_copy_left_keeps_its_payload():
    """A block leaves the CPU tier and is stored there again within one
    engine step. vLLM's tracker keeps a set of residencies, not a count:
    the removal emptied it, a CPU store added none back, and the payload
    was dropped at the end of the step's events while the new copy was
    held; that copy's removal then named the chunk's last hash only, and a
    subscriber kept the others on CPU for ever."""
    s = _Setup(cpu=1, disk=0, hashes=2)
    (key,) = s.store(_request("A", 2, seed=1))
    s.store(_request("B", 2, seed=2), step=False)  # pushes A out
    s.store(_request("A2", 2, seed=1), step=False)  # and A is back
    s.step_events()
    assert s.h.cpu.is_ready(key) and s.payload(key) is not None
    _everything_removed_as_announced(s)


def test_a_store_completed_after_its_old_copy_s_removal_is_removed_as_announced():
    """A block's new store is in flight when its old copy's removal goes
    out: vLLM drops the payload there, so the new copy is announced by a
    placeholder; a lookup records the payload again, and vLLM's tracker
    named that copy's removal by every hash of the chunk (the CPU twin of
    a warm restart's blocks)."""
    s = _Setup(cpu=1, disk=0, hashes=2)
    (key,) = s.store(_request("A", 2, seed=1))
    s.store(_request("B", 2, seed=2), step=False)  # pushes A out
    _prepare_store(s, _request("A2", 2, seed=1))  # A again, in flight
    s.step_events()  # A's old copy's removal
    s.manager.complete_store([key], ReqContext("A2"))
    s.step_events()  # the new copy's store
    assert s.look_up(_request("A3", 2, seed=1)) == 1
    s.store(_request("C", 2, seed=3))  # pushes A out again
    _everything_removed_as_announced(s)


def test_a_promoted_block_keeps_its_payload_when_its_disk_copy_leaves_first():
    """A block on disk only is hit and promoted to the CPU tier, and kept
    there while its disk copy is evicted. vLLM 0.32's lookup adds no CPU
    residency to a payload it holds, so the disk removal emptied the
    payload's residencies and dropped it while the CPU copy was held."""
    s = _Setup(cpu=2, disk=3, hashes=2)
    req = _request("A", 2, seed=1)
    (key,) = s.store(req)
    s.store(_request("X", 4, seed=2))  # pushes A out of the CPU tier
    assert not s.h.cpu.is_ready(key) and s.h.disk.is_ready(key)
    assert s.look_up(req) == 1
    _load(s, [key], "L")
    s.step_events()
    _keep_hot_until_off_disk(s, req)
    assert s.payload(key) is not None
    _everything_removed_as_announced(s)


def test_the_connector_drains_the_manager_inside_vllm_s_manager_region(monkeypatch):
    """vLLM 0.33 drains the manager's events inside its manager region (a
    tier's poll thread may enter the manager); so does the connector where
    it drains them itself: at a reset, and in the steps after one."""
    if not hasattr(OffloadingConnectorScheduler, "_manager_locked"):
        pytest.skip("vLLM 0.32 has no manager region")
    lock = threading.Lock()
    monkeypatch.setattr(TieredOffloadingManager, "lock", property(lambda _: lock))
    s = _Setup(cpu=4, disk=8, hashes=2)
    s.store(_request("A", 8, seed=1))
    held: list[bool] = []
    take = s.manager.take_events

    def taking():
        held.append(lock.locked())
        return take()

    monkeypatch.setattr(s.manager, "take_events", taking)
    s.connector.reset_cache()
    _step_until_nothing_owed(s)
    assert len(held) >= 2 and all(held), held
