"""KvtierDiskTier through vLLM's own TieringOffloadingManager (scheduler side).

The spec under test is ``PortableTieringSpec`` built from an
``OffloadingConfig`` exactly as vLLM builds it: ``get_manager`` creates vLLM's
CPU primary tier over a ``SharedOffloadRegion`` and loads our tier through
vLLM's ``SecondaryTierFactory`` from the ``secondary_tiers`` entry. A small
driver plays vLLM's connector scheduler (on_new_request, lookup re-asked
every step, prepare/complete store and load, on_schedule_end) and plays the
worker by writing random bytes into the primary rows, as vLLM's worker does
after a GPU -> CPU store. Every promoted block is compared byte for byte in
primary memory; one test also runs the CPU-platform worker end to end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.manager")
import torch  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvtier.connector.config import (  # noqa: E402
    CANONICAL_LAYOUT_REFUSAL,
    ConfigError,
    TierConfigError,
)
from kvtier.connector.tiering import KvtierDiskTier, PortableTieringSpec  # noqa: E402
from kvtier.connector.tiering.disk_tier import (  # noqa: E402
    VLLM_HOLDS_PROMOTIONS_AFTER_RESET,
)
from kvtier.store.slot import HEADER_SIZE, slot_size  # noqa: E402
from kvtier.testing.faults import flip_byte  # noqa: E402
from kvtier.testing.offloading import offloading_config, wait_finished  # noqa: E402
from kvtier.testing.state import io_error_count, read_header

PAGE = 4096  # bytes of one block of one layer
LAYERS = 2
BLOCK_BYTES = PAGE * LAYERS  # one rank's page of a primary row
NUM_GPU_BLOCKS = 64
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def make_config(
    disk_path,
    *,
    cpu_chunks: int,
    disk_blocks: int,
    world_size: int = 1,
    model: str = "tiny",
    tier: dict | None = None,
    replace_tier: dict | None = None,
) -> OffloadingConfig:
    entry = {
        "type": "KvtierDiskTier",
        "module_path": "kvtier.connector.tiering",
        "disk_path": str(disk_path),
        "disk_bytes_to_use": disk_blocks * slot_size(BLOCK_BYTES) * world_size,
        "disk_io": "posix",
        **(tier or {}),
    }
    if replace_tier is not None:
        entry = replace_tier
    return offloading_config(
        {
            "spec_name": "PortableTieringSpec",
            "spec_module_path": "kvtier.connector.tiering",
            "cpu_bytes_to_use": cpu_chunks * BLOCK_BYTES * world_size,
            "secondary_tiers": [entry],
        },
        worker_kv_bytes_per_block=BLOCK_BYTES,
        layers=LAYERS,
        world_size=world_size,
        model=model,
        engine_tag="kvtier-tiering-test",
        parallelism_agnostic=False,
    )


def keys_of(name: str, n: int) -> list[bytes]:
    return [
        make_offload_key(hashlib.sha256(f"{name}/{i}".encode()).digest(), 0)
        for i in range(n)
    ]


class Driver:
    """Plays vLLM's connector scheduler (and, for stores, its worker) against
    the spec's TieringOffloadingManager."""

    def __init__(self, config: OffloadingConfig):
        self.spec = PortableTieringSpec(config)
        self.manager = self.spec.get_manager()
        assert type(self.manager) is TieringOffloadingManager
        self.tier = self.manager.secondary_tiers[0]  # the first (or only) one
        assert type(self.tier) is KvtierDiskTier
        view = self.manager.primary_tier.get_kv_memoryview()
        self.rows = np.asarray(view).view(np.uint8)
        self.used = config.parallel.world_size * BLOCK_BYTES  # rank pages
        self.truth: dict[bytes, np.ndarray] = {}
        self.events: list = []
        self.rng = np.random.default_rng(0)

    def store(self, name: str, n: int) -> list[bytes]:
        """A request computed ``n`` blocks: offload them in vLLM's order."""
        keys = keys_of(name, n)
        ctx = ReqContext(req_id=name)
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None, "primary tier declined the store"
        for key, chunk in zip(out.keys_to_store, out.store_spec.block_ids):
            data = self.rng.integers(0, 256, self.used, dtype=np.uint8)
            self.rows[chunk, : self.used] = data  # the worker's GPU -> CPU copy
            self.truth[key] = data
        self.manager.complete_store(out.keys_to_store, ctx)  # cascades to disk
        self.manager.on_request_finished(ctx)
        return keys

    def step(self) -> None:
        self.manager.on_schedule_end(STEP)
        self.events.extend(self.manager.take_events())

    def pass_reset_hold(self) -> None:
        """Step past the steps whose lookups miss after a reset: the tier's
        own hold under vLLM 0.32 (KvtierDiskTier.drain_jobs); under 0.33,
        the manager's own, which the scheduler ends once the workers
        flushed (``on_reset_flushed``)."""
        for _ in range(self.tier.reset_hold_steps):
            self.step()
        flushed = getattr(self.manager, "on_reset_flushed", None)
        if flushed is not None:
            flushed()

    def settle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        self.step()
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "tier jobs did not finish"
            time.sleep(0.002)
            self.step()

    def lookup(self, name: str, keys: list[bytes], timeout: float = 60.0):
        """vLLM's deferred prefix lookup: re-asked every step until settled."""
        ctx = ReqContext(req_id=name)
        self.manager.on_new_request(ctx)
        deadline = time.monotonic() + timeout
        while True:
            hits, deferred = 0, False
            for key in keys:
                r = self.manager.lookup(key, ctx)
                if r is LookupResult.MISS:
                    break
                hits += 1
                if r is not LookupResult.HIT:
                    deferred = True
            if not deferred:
                return hits, ctx
            assert time.monotonic() < deadline, "lookup never settled"
            self.step()
            time.sleep(0.002)

    def load_and_check(self, keys: list[bytes], ctx) -> dict[str, int]:
        """prepare_load, then compare the primary rows with what was stored."""
        spec = self.manager.prepare_load(keys, ctx)
        sources: dict[str, int] = {}
        for key, chunk in zip(keys, spec.block_ids):
            src = self.manager.get_load_source(key, ctx).value
            sources[src] = sources.get(src, 0) + 1
            assert np.array_equal(self.rows[chunk, : self.used], self.truth[key]), (
                key.hex()
            )
        self.manager.complete_load(keys, ctx)
        self.manager.on_request_finished(ctx)
        return sources

    def storage_events(self) -> tuple[list[bytes], list[bytes]]:
        self.events.extend(self.manager.take_events())
        stored, removed = [], []
        for ev in self.events:
            if ev.medium is Medium.STORAGE:
                assert ev.locality is Locality.LOCAL
                (removed if ev.removed else stored).extend(ev.keys)
        return stored, removed

    def in_primary(self, key: bytes) -> bool:
        ctx = ReqContext(req_id="probe")
        return self.manager.primary_tier.lookup(key, ctx) is LookupResult.HIT

    def close(self) -> None:
        if self.rows is not None:
            self.rows = None  # our view of the mmap: vLLM unmaps it now
            self.manager.shutdown()


@pytest.fixture
def make_driver():
    made: list[Driver] = []

    def make(config: OffloadingConfig) -> Driver:
        d = Driver(config)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


@pytest.fixture
def fault_plan(monkeypatch):
    """A FaultPlan every store made from now on does its I/O through."""
    from kvtier.store import store as disk_store
    from kvtier.testing.faults import FaultInjectingBackend, FaultPlan

    plan = FaultPlan()
    real = disk_store.make_backend
    monkeypatch.setattr(
        disk_store,
        "make_backend",
        lambda name, **kw: FaultInjectingBackend(real(name, **kw), plan),
    )
    return plan


def wait_until_hung(plan, hangs_before: int = 0, timeout: float = 30.0) -> None:
    """Until an I/O of ``plan``'s hang rules began (started, not queued)."""
    from kvtier.testing.fault_plan import FaultKind

    deadline = time.monotonic() + timeout
    while plan.count(FaultKind.HANG) == hangs_before:
        assert time.monotonic() < deadline, "the I/O to hang never started"
        time.sleep(0.002)


def corrupt_payload(tier: KvtierDiskTier, key: bytes, rank: int = 0) -> None:
    store = tier.runtime.stores[rank]
    slot = tier.tier.get(key).slot
    flip_byte(store.slabs[0].path, store.slabs[0].offset(slot) + HEADER_SIZE + 100)


# --------------------------------------------------------------------- tests


def test_store_cascade_evict_promote_is_byte_exact(tmp_path, make_driver):
    d = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    first = d.store("a", 4)
    d.settle()
    stored, removed = d.storage_events()
    assert stored == first and removed == []  # cascaded: BlockStored STORAGE
    assert all(d.tier.tier.is_ready(k) for k in first)

    second = d.store("b", 4)  # the primary tier (4 chunks) evicts "a"
    d.settle()
    assert not any(d.in_primary(k) for k in first)
    assert all(d.in_primary(k) for k in second)
    # Reuse "b"'s rows: promotions must write the exact bytes of "a" back.
    d.rows[:, :] = 0xAB

    hits, ctx = d.lookup("a-again", first)
    assert hits == 4
    assert d.load_and_check(first, ctx) == {CacheHitSource.DISK.value: 4}
    assert d.tier.stats.promotions_completed == 4
    assert d.tier.stats.promotion_failures == 0
    # Served from the primary tier now: host hits, no second disk read.
    hits, ctx = d.lookup("a-third", first)
    assert hits == 4
    assert d.load_and_check(first, ctx) == {CacheHitSource.HOST.value: 4}
    assert d.tier.stats.promotions_completed == 4


def test_tp2_each_rank_page_has_its_own_slab(tmp_path, make_driver):
    d = make_driver(make_config(tmp_path, cpu_chunks=2, disk_blocks=16, world_size=2))
    tier = d.tier
    assert tier.num_ranks == 2 and tier.block_bytes == BLOCK_BYTES
    fps = [s.fingerprint for s in tier.runtime.stores]
    assert [(f.tp_rank, f.tp_size) for f in fps] == [(0, 2), (1, 2)]
    assert len({s.dirs[0] for s in tier.runtime.stores}) == 2
    assert "host_layout=vllm-tiering" in fps[0].geometry

    first = d.store("a", 2)
    d.settle()
    d.store("b", 2)
    d.settle()
    assert not any(d.in_primary(k) for k in first)
    d.rows[:, :] = 0
    hits, ctx = d.lookup("a-again", first)
    assert hits == 2
    assert d.load_and_check(first, ctx) == {"disk": 2}

    # A block is whole only if every rank's page is intact: corrupt rank 1's.
    third = d.store("c", 2)
    d.settle()
    d.store("d", 2)
    d.settle()
    corrupt_payload(tier, third[0], rank=1)
    hits, _ctx = d.lookup("c-again", third)
    assert hits == 0
    assert not tier.tier.is_ready(third[0])


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_disk_budget_bounds_usage_and_emits_removals(tmp_path, make_driver, policy):
    capacity = 6
    d = make_driver(
        make_config(
            tmp_path,
            cpu_chunks=4,
            disk_blocks=capacity,
            tier={"eviction_policy": policy},
        )
    )
    budget = capacity * slot_size(BLOCK_BYTES)
    assert d.tier.capacity == capacity
    written: list[bytes] = []
    for name in "abcde":
        written += d.store(name, 4)
        d.settle()
    tier = d.tier
    assert len(tier.tier) == capacity
    slabs = [p for p in Path(tmp_path).rglob("*.kvt")]
    assert len(slabs) == 1
    assert os.path.getsize(slabs[0]) <= budget
    assert os.stat(slabs[0]).st_blocks * 512 <= budget

    stored, removed = d.storage_events()
    assert len(stored) == len(written) == 20
    assert len(removed) == tier.stats.evictions == 20 - capacity
    resident = set(stored) - set(removed)
    assert resident == set(tier.tier.keys())
    if policy == "lru":
        assert resident == set(written[-capacity:])

    stats = d.manager.get_stats().data["data"]
    assert stats["vllm:kv_offload_kvtier_evictions"][("disk",)] == 20 - capacity
    assert stats["vllm:kv_offload_kvtier_tier_blocks"][("disk",)] == capacity

    # Evicted from both tiers: a miss. Still on disk (reused slots): exact.
    gone = [k for k in written if k not in resident and not d.in_primary(k)]
    assert gone
    assert d.lookup("gone", gone[:1])[0] == 0
    on_disk = [k for k in written if k in resident and not d.in_primary(k)]
    assert on_disk
    hits, ctx = d.lookup("resident", on_disk[:1])
    assert hits == 1
    assert d.load_and_check(on_disk[:1], ctx) == {"disk": 1}


def test_corrupt_slot_is_a_miss_not_data(tmp_path, make_driver):
    d = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    first = d.store("a", 4)
    d.settle()
    d.store("b", 4)
    d.settle()
    victim = first[1]
    store = d.tier.runtime.stores[0]
    slot = d.tier.tier.get(victim).slot
    corrupt_payload(d.tier, victim)
    d.rows[:, :] = 0

    # The prefix stops at the corrupt block: block 0 loads from disk, block 1
    # failed its checksum, so vLLM recomputes it and everything after it.
    hits, ctx = d.lookup("a-again", first)
    assert hits == 1
    assert d.load_and_check(first[:1], ctx) == {"disk": 1}
    assert not d.tier.tier.is_ready(victim)
    assert not d.in_primary(victim)
    assert d.tier.stats.promotion_failures == 1
    assert d.tier.runtime.checksum_failures() == 1
    assert read_header(store, slot)[1].name == "EMPTY"  # invalidated
    _stored, removed = d.storage_events()
    assert victim in removed
    # Dropped at once, as corrupt: not an I/O error to read again.
    failures = d.tier.core.failures
    assert (failures.corrupt, failures.io_errors_kept, failures.unreadable) == (
        1,
        0,
        0,
    )
    # Asked again: a clean miss, no second read of the bad slot.
    assert d.lookup("a-third", [victim])[0] == 0
    assert d.tier.runtime.checksum_failures() == 1
    series = d.manager.get_stats().data["data"]
    assert series["vllm:kv_offload_kvtier_corrupt_blocks"][()] == 1
    assert series["vllm:kv_offload_kvtier_load_io_errors"][()] == 0


def test_an_empty_load_job_succeeds(tmp_path, make_driver):
    """vLLM's contract: a job succeeds when every key did, vacuously so for
    a job with no keys (vLLM's own tiers and kvtier's submit_store agree)."""
    from vllm.v1.kv_offload.tiering.base import TransferJob

    d = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=8))
    empty = np.zeros(0, dtype=np.int64)
    ctx = ReqContext(req_id="empty")
    d.tier.submit_load(TransferJob(7, [], empty, True, ctx))
    d.tier.submit_store(TransferJob(8, [], empty, False, ctx))
    results = {r.job_id: r for r in d.tier.get_finished_jobs()}
    assert (results[7].success, results[8].success) == (True, True)
    assert results[7].transfer_bytes == 0
    assert not d.tier.has_pending_work()
    # A job whose only key is gone still fails.
    d.tier.submit_load(TransferJob(9, keys_of("gone", 1), np.zeros(1, np.int64), True, ctx))
    assert [(r.job_id, r.success) for r in d.tier.get_finished_jobs()] == [(9, False)]


@pytest.fixture
def faulty_disk(monkeypatch):
    """Every disk back end the tier builds from here on goes through a
    fault layer; its plan is empty until a test adds a rule."""
    from kvtier.testing.faults import FaultPlan, inject_faults

    return inject_faults(monkeypatch, FaultPlan(seed=5))


def _on_disk_only(d: Driver) -> list[bytes]:
    first = d.store("a", 4)
    d.settle()
    d.store("b", 4)  # evicts "a" from the primary tier
    d.settle()
    assert not any(d.in_primary(k) for k in first)
    d.rows[:, :] = 0
    return first


def test_an_io_error_fails_the_load_and_keeps_the_block(
    tmp_path, make_driver, faulty_disk
):
    """One EIO on a slot read: that promotion job fails, the block stays on
    disk, and the next promotion of it (vLLM's manager asks the tier again
    while the request's lookup is pending) succeeds, byte for byte."""
    import errno

    from kvtier.testing.faults import FaultRule, on_slot

    d = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    first = _on_disk_only(d)
    victim = first[1]
    store = d.tier.runtime.stores[0]
    where = on_slot(store, d.tier.tier.get(victim).slot)
    faulty_disk.add(FaultRule.error(errno.EIO, ops="read", first_n=1, **where))

    hits, ctx = d.lookup("a-again", first)
    assert faulty_disk.count() == 1
    # Kept: no removal announced, the slot intact, read again and served.
    assert victim not in d.storage_events()[1]
    assert hits == 4
    assert d.load_and_check(first, ctx) == {"disk": 4}
    assert read_header(store, d.tier.tier.get(victim).slot)[1].name == "OK"
    assert d.tier.stats.load_errors == 1  # a promotion job failed on it
    failures = d.tier.core.failures
    assert (failures.io_errors_kept, failures.corrupt, failures.unreadable) == (
        1,
        0,
        0,
    )
    assert io_error_count(d.tier.core, victim) == 0  # a good read resets it
    series = d.manager.get_stats().data["data"]
    assert series["vllm:kv_offload_kvtier_load_io_errors"][()] == 1
    assert series["vllm:kv_offload_kvtier_load_errors"][()] == 1
    assert series["vllm:kv_offload_kvtier_corrupt_blocks"][()] == 0
    assert series["vllm:kv_offload_kvtier_unreadable_blocks"][()] == 0
    assert series["vllm:kv_offload_kvtier_read_latency_seconds"][()]


def test_io_errors_in_a_row_drop_the_block(tmp_path, make_driver, faulty_disk):
    """A slot whose reads keep failing (a dead sector) is dropped after
    MAX_READ_IO_ERRORS of them, so it stops costing failed promotions: the
    lookup ends at it."""
    import errno

    from kvtier.testing.faults import FaultRule, on_slot

    d = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    first = _on_disk_only(d)
    victim = first[1]
    where = on_slot(d.tier.runtime.stores[0], d.tier.tier.get(victim).slot)
    faulty_disk.add(FaultRule.error(errno.EIO, ops="read", **where))
    hits, _ctx = d.lookup("a-again", first)
    assert hits == 1
    assert faulty_disk.count() == 3  # read three times, then dropped
    assert victim not in d.tier.tier
    from kvtier.tiers.disk_core import MAX_READ_IO_ERRORS

    assert MAX_READ_IO_ERRORS == 3
    assert victim in d.storage_events()[1]  # its removal announced
    failures = d.tier.core.failures
    assert (failures.io_errors_kept, failures.unreadable, failures.corrupt) == (
        MAX_READ_IO_ERRORS - 1,
        1,
        0,
    )
    assert d.tier.stats.load_errors == MAX_READ_IO_ERRORS
    # Gone: a clean miss, no further read of the bad slot.
    assert d.lookup("a-after", [victim])[0] == 0
    assert faulty_disk.count() == MAX_READ_IO_ERRORS
    series = d.manager.get_stats().data["data"]
    assert series["vllm:kv_offload_kvtier_unreadable_blocks"][()] == 1


def test_a_warm_restart_is_announced_over_several_steps(
    tmp_path, make_driver, monkeypatch
):
    """The restore event names every adopted block; vLLM builds one KV event
    per key within the step that drains it, so each step takes at most
    EVENT_BACKLOG_PER_STEP keys of it (all of them, in order, in the end)."""
    from kvtier.connector.tiering import disk_tier

    first = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    keys = first.store("a", 4)
    first.settle()
    keys += first.store("b", 4)
    first.settle()
    first.close()

    monkeypatch.setattr(disk_tier, "EVENT_BACKLOG_PER_STEP", 3)
    second = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    assert second.tier.stats.restored == 8
    per_step = []
    while True:
        events = list(second.tier.take_events())
        if not events:
            break
        per_step.append([k for ev in events for k in ev.keys])
    assert [len(s) for s in per_step] == [3, 3, 2]
    assert sorted(k for s in per_step for k in s) == sorted(keys)


def test_warm_restart_and_kvtier_inspect(tmp_path, make_driver, capsys, caplog):
    from kvtier.tools.cli import main as kvtier_cli

    first = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    keys = first.store("a", 4)
    first.settle()  # the cascade pins "a" in the primary tier until it lands
    keys += first.store("b", 4)
    first.settle()
    truth = dict(first.truth)
    first.close()

    # The same on-disk format as the full spec: kvtier's tools read it.
    store_dir = next(Path(tmp_path).glob("kvtier-*"))
    assert kvtier_cli(["verify", "--json", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["stores"][0]["checked"] == 8
    assert kvtier_cli(["inspect", "--json", str(store_dir)]) == 0
    (rep,) = json.loads(capsys.readouterr().out)["stores"]
    assert rep["blocks"] == 8
    assert rep["layout"]["block_bytes"] == BLOCK_BYTES
    assert "host_layout=vllm-tiering" in rep["layout"]["geometry"]

    # A new engine (new engine id, empty primary tier) on the same disk path.
    with caplog.at_level("INFO", logger="vllm.kvtier"):
        second = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    second.truth = truth
    assert second.tier.stats.restored == 8
    # What its identity could not compare is said with the adoption.
    (adopted,) = [r for r in caplog.records if "warm restart adopted" in r.message]
    assert adopted.levelname == "INFO"
    assert "adopted 8 disk blocks" in adopted.message
    assert "hf_overrides, quantization, revision" in adopted.message
    assert "give it its own disk_path" in adopted.message
    second.step()
    stored, _ = second.storage_events()
    assert sorted(stored) == sorted(keys)  # restored blocks are announced
    hits, ctx = second.lookup("a-again", keys[:4])
    assert hits == 4
    assert second.load_and_check(keys[:4], ctx) == {"disk": 4}

    # Another model is another layout: nothing is adopted, nothing is read.
    other = make_driver(
        make_config(tmp_path, cpu_chunks=4, disk_blocks=32, model="other")
    )
    assert other.tier.stats.restored == 0
    assert other.lookup("a", keys[:1])[0] == 0


def test_reset_cache_keeps_the_disk(tmp_path, make_driver):
    """The blocks on disk at a reset are served after it (what was still
    queued is not: test_a_reset_cancels_the_cascades_not_yet_started)."""
    d = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    keys = d.store("a", 4)
    d.settle()  # cascaded
    d.manager.reset_cache()
    assert not d.tier.has_pending_work()
    assert not any(d.in_primary(k) for k in keys)
    d.settle()
    d.pass_reset_hold()
    d.rows[:, :] = 0
    hits, ctx = d.lookup("a-again", keys)
    assert hits == 4
    assert d.load_and_check(keys, ctx) == {"disk": 4}


def test_blocks_stored_after_a_reset_serve_this_engine_and_are_never_adopted(
    tmp_path, make_driver
):
    """vLLM keeps a secondary tier's blocks across its reset (a sleep, a
    weight update), and so does this tier; but the blocks stored after it
    may come from other weights: read by this engine, never adopted by a
    later one. Those from before it are."""
    d = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    before = d.store("a", 4)
    d.settle()  # on disk before the reset
    d.manager.reset_cache()
    d.settle()
    after = d.store("b", 4)
    d.settle()
    truth = dict(d.truth)
    d.manager.reset_cache()  # out of the primary tier: read from disk
    d.pass_reset_hold()
    d.rows[:, :] = 0
    hits, ctx = d.lookup("b-again", after)
    assert hits == 4
    assert d.load_and_check(after, ctx) == {"disk": 4}
    d.close()

    second = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    second.truth = truth
    assert second.tier.stats.restored == 4
    hits, ctx = second.lookup("a-again", before)
    assert hits == 4
    assert second.load_and_check(before, ctx) == {"disk": 4}
    assert second.lookup("b-again", after)[0] == 0


@pytest.mark.skipif(
    VLLM_HOLDS_PROMOTIONS_AFTER_RESET,
    reason="vLLM holds promotions after a reset itself (on_reset_flushed)",
)
def test_after_a_reset_lookups_miss_until_the_flush_has_run(tmp_path, make_driver):
    """Under vLLM 0.32 a reset frees primary rows that store jobs flushed at
    the next step's start still write: for as many scheduler steps as
    batches can be in flight, the tier's lookups miss (no promotion into
    such a row), then hit again."""
    d = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    keys = d.store("a", 4)
    d.settle()
    d.manager.reset_cache()
    assert d.tier.reset_hold_steps == 3  # pp_size 1: async scheduling's 2, + 1
    for step in range(d.tier.reset_hold_steps):
        assert d.lookup(f"held-{step}", keys)[0] == 0
        d.step()
    hits, ctx = d.lookup("a-again", keys)
    assert hits == 4
    assert d.load_and_check(keys, ctx) == {"disk": 4}


def test_jobs_after_shutdown_fail_at_once(tmp_path, make_driver):
    """A cascade or promotion that reaches the tier after its shutdown fails
    whole through vLLM's path (primary pins released), not an assertion
    in the scheduler."""
    from vllm.v1.kv_offload.tiering.base import TransferJob

    d = make_driver(make_config(tmp_path, cpu_chunks=8, disk_blocks=32))
    first = d.store("a", 2)
    d.settle()
    d.tier.shutdown()
    second = d.store("b", 2)  # cascades to the shut-down tier
    d.settle()
    assert not d.manager._jobs  # its result came, the pins were released
    assert all(d.in_primary(k) for k in second)
    ctx = ReqContext(req_id="late")
    assert all(d.tier.lookup(k, ctx) is LookupResult.MISS for k in first + second)
    load = TransferJob(10**6, first, np.array([0, 1]), True, ctx)
    d.tier.submit_load(load)
    assert [(r.job_id, r.success) for r in d.tier.get_finished_jobs()] == [
        (10**6, False)
    ]


def test_a_hung_disk_at_reset_costs_misses_not_the_engine(
    tmp_path, make_driver, monkeypatch, fault_plan
):
    """reset_cache with the tier's writes hung: its drain gives up after
    its deadline and every job it held comes back failed. vLLM's tiering
    manager asserts that every job came back after drain_jobs; a given-up
    job that was forgotten instead raised there (and left its slots
    WRITING, the tier pending for good)."""
    import threading

    from kvtier.store import runtime as disk_runtime
    from kvtier.testing.faults import FaultRule

    release = threading.Event()
    plan = fault_plan
    drain = disk_runtime.DiskRuntime.drain
    monkeypatch.setattr(
        disk_runtime.DiskRuntime, "drain", lambda rt, timeout=0.5: drain(rt, timeout)
    )
    d = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    try:
        before = d.store("a", 4)
        d.settle()
        d.store("b", 4)  # evicts "a" from the primary tier: on disk only
        d.settle()
        assert all(d.tier.tier.is_ready(k) for k in before)
        plan.add(FaultRule.hang(release, ops="write"))  # the disk hangs now
        keys = d.store("c", 2)  # cascades to our tier: its writes hang
        d.step()
        wait_until_hung(plan)
        assert d.tier.has_pending_work()
        d.manager.reset_cache()  # raised AssertionError in vLLM before
        assert not d.tier.has_pending_work()
        assert not any(k in d.tier.tier and d.tier.tier.is_ready(k) for k in keys)
        assert d.tier.runtime.broken
        # A stopped tier answers MISS at once: no promotion round that can
        # only fail, for each block it still lists.
        hits, _ = d.lookup("a-again", before)
        assert hits == 0
        assert not d.tier.has_pending_work()
    finally:
        release.set()


def test_a_reset_cancels_the_cascades_not_yet_started(
    tmp_path, make_driver, fault_plan
):
    """reset_cache waits for the batch being written, not for the queue
    behind it: the queued cascades come back failed (vLLM's contract allows
    it) and their blocks are not stored; the one being written is. Waiting
    for the whole queue held the engine as long as the drive took."""
    import threading

    from kvtier.testing.faults import FaultRule

    release = threading.Event()
    plan = fault_plan
    config = make_config(
        tmp_path, cpu_chunks=8, disk_blocks=32, tier={"disk_io_threads": 1}
    )
    d = make_driver(config)
    try:
        plan.add(FaultRule.hang(release, ops="write", first_n=1))
        (moving,) = d.store("a", 1)
        d.step()  # its cascade is written, and hangs
        wait_until_hung(plan)
        queued = d.store("b", 4)
        d.step()  # queued behind it: one I/O thread
        timer = threading.Timer(0.3, release.set)
        timer.start()
        try:
            d.manager.reset_cache()
        finally:
            timer.cancel()
            release.set()
        d.settle()
        assert d.tier.tier.is_ready(moving)
        assert [k for k in queued if k in d.tier.tier] == []
        # Cancelled, not failed: no disk fault to count.
        assert (d.tier.stats.stores_completed, d.tier.stats.store_failures) == (1, 0)
        assert not d.tier.runtime.broken
        # The tier goes on storing after the reset.
        d.pass_reset_hold()
        later = d.store("c", 2)
        d.settle()
        assert all(d.tier.tier.is_ready(k) for k in later)
    finally:
        release.set()


def test_a_promotion_a_reset_cancelled_is_no_read_error(
    tmp_path, make_driver, fault_plan
):
    """A promotion cancelled by a reset before its read started was never
    read: it counts no I/O error and no load error, and its block stays.
    Counted as one, three resets in a row dropped a healthy block as
    unreadable (the read-failure rule)."""
    import threading

    from vllm.v1.kv_offload.tiering.base import TransferJob

    from kvtier.testing.fault_plan import FaultKind
    from kvtier.testing.faults import FaultRule

    plan = fault_plan
    config = make_config(
        tmp_path, cpu_chunks=8, disk_blocks=32, tier={"disk_io_threads": 1}
    )
    d = make_driver(config)
    blocker, victim = d.store("a", 2)
    d.settle()
    assert d.tier.tier.is_ready(victim)
    ctx = ReqContext(req_id="p")
    job = 1000
    for _ in range(3):
        release = threading.Event()
        plan.add(FaultRule.hang(release, ops="read", first_n=1))
        hangs = plan.count(FaultKind.HANG)
        d.tier.submit_load(TransferJob(job, [blocker], np.array([4]), True, ctx))
        wait_until_hung(plan, hangs)  # the blocker's read hangs
        d.tier.submit_load(TransferJob(job + 1, [victim], np.array([5]), True, ctx))
        timer = threading.Timer(0.2, release.set)
        timer.start()
        try:
            d.tier.drain_jobs()  # vLLM's reset_cache
        finally:
            timer.cancel()
            release.set()
        results = {r.job_id: r.success for r in d.tier.get_finished_jobs()}
        assert results == {job: True, job + 1: False}
        job += 2
    failures = d.tier.core.failures
    assert (failures.io_errors_kept, failures.unreadable) == (0, 0), failures
    assert d.tier.stats.load_errors == 0
    assert d.tier.tier.is_ready(victim)


def test_portable_worker_shares_the_primary_memory(tmp_path, make_driver):
    """GPU -> primary -> disk -> primary -> GPU through the CPU-platform
    worker: the worker writes the very rows the scheduler-side tier reads."""
    d = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    torch.manual_seed(0)
    kv = [
        torch.randint(-128, 127, (NUM_GPU_BLOCKS, PAGE), dtype=torch.int8)
        for _ in range(LAYERS)
    ]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in kv],
        group_data_refs=[[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]],
    )
    worker = d.spec.get_worker(caches)
    assert type(worker).__name__ == "PortableTieringWorker"
    try:
        job = 0

        def run(submit, *args) -> None:
            nonlocal job
            job += 1
            assert submit(job, *args)
            # A load completes on the worker's load thread.
            assert [(r.job_id, r.success) for r in wait_finished(worker)] == [
                (job, True)
            ]

        def offload(name: str, gpu_blocks: list[int]) -> list[bytes]:
            keys = keys_of(name, len(gpu_blocks))
            ctx = ReqContext(req_id=name)
            d.manager.on_new_request(ctx)
            out = d.manager.prepare_store(keys, ctx)
            run(
                worker.submit_store,
                GPULoadStoreSpec(gpu_blocks, [len(gpu_blocks)], [0]),
                out.store_spec,
            )
            for b, chunk in zip(gpu_blocks, out.store_spec.block_ids):
                # vLLM's row layout: tensor 0's page, then tensor 1's.
                want = torch.cat([t[b] for t in kv]).view(torch.uint8).numpy()
                assert np.array_equal(d.rows[chunk, :BLOCK_BYTES], want)
            d.manager.complete_store(out.keys_to_store, ctx)
            d.manager.on_request_finished(ctx)
            return keys

        first = offload("a", [1, 2, 3])
        d.settle()
        offload("b", [10, 11, 12, 13])  # evicts "a" from the primary tier
        d.settle()
        want = [torch.stack([t[b] for t in kv]).clone() for b in (1, 2, 3)]
        d.rows[:, :] = 0
        hits, ctx = d.lookup("a-again", first)
        assert hits == 3
        spec = d.manager.prepare_load(first, ctx)
        assert [d.manager.get_load_source(k, ctx) for k in first] == [
            CacheHitSource.DISK
        ] * 3
        dst = [40, 41, 42]
        for t in kv:
            t[dst] = 0
        run(worker.submit_load, spec, GPULoadStoreSpec(dst, [3], [0]))
        d.manager.complete_load(first, ctx)
        for b, w in zip(dst, want):
            assert torch.equal(torch.stack([t[b] for t in kv]), w)
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    ("tier", "pattern"),
    [
        ({"disk_cache_size": 1}, r"\['disk_cache_size'\]: unknown key; valid keys"),
        ({"eviction_policy": "fifo"}, r"\['eviction_policy'\].*lru \| arc"),
        ({"disk_compression": "lz4"}, r"\['disk_compression'\].*none \| zstd"),
        ({"disk_path": "relative/dir"}, r"\['disk_path'\].*relative"),
        ({"disk_path": "/nonexistent/kvtier"}, r"\['disk_path'\].*does not exist"),
        ({"disk_bytes_to_use": 4096}, r"\['disk_bytes_to_use'\].*hold no block"),
        ({"disk_bytes_to_use": "lots"}, r"\['disk_bytes_to_use'\].*integer"),
        ({"locality": "REMOTE"}, r"\['locality'\].*LOCAL"),
    ],
)
def test_bad_tier_config_names_the_key(tmp_path, tier, pattern):
    spec = PortableTieringSpec(
        make_config(tmp_path, cpu_chunks=4, disk_blocks=8, tier=tier)
    )
    with pytest.raises(TierConfigError, match=r"secondary_tiers.*" + pattern):
        spec.get_manager()


def test_a_failed_start_removes_the_workers_region_file(tmp_path):
    """The workers map the primary tier's /dev/shm file first (its
    creator, without a barrier), then the scheduler side's tiers are
    refused: the file, cpu_bytes_to_use large, outlived every such start.
    The refusal removes it; the scheduler side alone (no worker) was
    already cleaned by vLLM."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    bad = {"eviction_policy": "x"}
    spec = PortableTieringSpec(
        make_config(tmp_path, cpu_chunks=4, disk_blocks=8, tier=bad)
    )
    region = SharedOffloadRegion(  # as the worker maps it
        engine_id=spec._engine_id,
        num_chunks=spec.num_chunks,
        rank=0,
        kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
        cpu_page_size=spec.cpu_page_size_per_worker,
    )
    try:
        assert os.path.exists(region.mmap_path)
        with pytest.raises(TierConfigError, match="eviction_policy"):
            spec.get_manager()
        assert not os.path.exists(region.mmap_path)
    finally:
        if not os.path.exists(region.mmap_path):
            region._creator = False  # its name is gone: nothing to unlink
        region.cleanup()


def test_missing_disk_path_names_the_key(tmp_path):
    entry = {"type": "KvtierDiskTier", "module_path": "kvtier.connector.tiering"}
    entry["disk_bytes_to_use"] = 1 << 20
    spec = PortableTieringSpec(
        make_config(tmp_path, cpu_chunks=4, disk_blocks=8, replace_tier=entry)
    )
    with pytest.raises(TierConfigError, match=r"\['disk_path'\]: is required"):
        spec.get_manager()


def test_canonical_layout_is_refused_as_the_full_spec_and_the_doctor_refuse_it(
    tmp_path,
):
    """vLLM's canonical_layout (a key of kv_connector_extra_config, not of
    the tier's entry) is refused by the disk tier with the one message the
    full spec and ``kvtier doctor`` give."""
    config = make_config(tmp_path, cpu_chunks=4, disk_blocks=8)
    spec = PortableTieringSpec(dataclasses.replace(config, canonical_layout=True))
    with pytest.raises(ConfigError) as refused:
        spec.get_manager()
    assert (refused.value.key, refused.value.message) == (
        "canonical_layout",
        CANONICAL_LAYOUT_REFUSAL,
    )
    assert not isinstance(refused.value, TierConfigError)


def test_a_second_kvtier_disk_tier_is_refused_by_name(tmp_path, make_driver):
    """vLLM writes every chunk to every secondary tier: a second kvtier disk
    tier would hold a second copy and share the first's series and events.
    Engine start refuses it under ``secondary_tiers`` and builds no store;
    one kvtier tier beside another type of tier is fine."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    config = make_config(tmp_path / "a", cpu_chunks=4, disk_blocks=8)
    (entry,) = config.extra_config["secondary_tiers"]
    second = {**entry, "disk_path": str(tmp_path / "b")}
    config.extra_config["secondary_tiers"].append(second)
    spec = PortableTieringSpec(config)
    with pytest.raises(ConfigError) as refused:
        spec.get_manager()
    assert refused.value.key == "secondary_tiers"
    assert "lists 2 entries of type 'KvtierDiskTier'" in refused.value.message
    assert "disk_path" in refused.value.message
    assert not any((tmp_path / "a").iterdir()) and not any((tmp_path / "b").iterdir())
    # One KvtierDiskTier and vLLM's example tier: both are built.
    config = make_config(tmp_path / "a", cpu_chunks=4, disk_blocks=8)
    config.extra_config["secondary_tiers"].append({"type": "example"})
    d = make_driver(config)
    assert [t.tier_type for t in d.manager.secondary_tiers] == [
        "KvtierDiskTier",
        "example",
    ]


CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
TIERING_CONFIGS = {
    "vllm-tiering-kvtier-disk.json": "TieringOffloadingSpec",
    "vllm-tiering-kvtier-disk-cpu.json": "PortableTieringSpec",
}


@pytest.mark.parametrize(("name", "spec_name"), sorted(TIERING_CONFIGS.items()))
def test_ready_config_files_load_our_tier(name, spec_name):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from kvtier.connector.config import parse_tier_config

    text = (CONFIG_DIR / name).read_text()
    cfg = json.loads(text)
    assert cfg["kv_connector"] == "OffloadingConnector"
    extra = cfg["kv_connector_extra_config"]
    assert extra["spec_name"] == spec_name
    spec_cls = OffloadingSpecFactory.get_spec_cls(extra)
    assert issubclass(spec_cls, TieringOffloadingSpec)
    (entry,) = extra["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(entry) is KvtierDiskTier
    settings = parse_tier_config(entry)
    assert settings.disk_path[0].startswith("/mnt/")
    assert settings.disk_bytes_to_use > 0
    # The documented form: the file's text as --kv-transfer-config.
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--kv-transfer-config", text])
    assert args.kv_transfer_config.kv_connector_extra_config == extra



def test_a_failed_warm_restart_leaves_no_store_behind(tmp_path, make_driver, monkeypatch):
    """The tier's construction fails with the warm-restart scan's own error,
    and the disk runtime it built goes with it: its I/O threads end and the
    store's lock is free for the next engine on the same disk_path."""
    from tests.connector.test_request_runner import (
        fail_warm_restart,
        transfer_threads,
        wait_transfer_threads,
    )

    before = transfer_threads()
    fail_warm_restart(monkeypatch)
    with pytest.raises(OSError, match="scan failed"):
        Driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    wait_transfer_threads(before)
    monkeypatch.undo()
    d = make_driver(make_config(tmp_path, cpu_chunks=4, disk_blocks=32))
    assert d.tier.runtime is not None  # the store's lock was released


@pytest.mark.parametrize("module", ["kvtier.connector.tierin", "kvtier.conector.x", ""])
def test_a_misspelt_tier_module_path_names_the_key(tmp_path, module):
    """vLLM's factory imports an entry's module_path before kvtier runs: a
    typo there ended the start in a bare ModuleNotFoundError."""
    spec = PortableTieringSpec(
        make_config(tmp_path, cpu_chunks=4, disk_blocks=8, tier={"module_path": module})
    )
    with pytest.raises(TierConfigError) as refused:
        spec.get_manager()
    assert refused.value.key == "module_path"
    assert "KvtierDiskTier is in 'kvtier.connector.tiering'" in str(refused.value)


def test_a_tier_looked_up_in_the_wrong_kvtier_module_is_told_where_it_is():
    """module_path "kvtier.connector" (the full spec's) for a tier type:
    vLLM's getattr there names the tiering package."""
    import kvtier.connector

    with pytest.raises(AttributeError, match='is in "kvtier.connector.tiering"'):
        kvtier.connector.KvtierDiskTier  # noqa: B018
