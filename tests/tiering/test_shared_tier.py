"""kvtier's local disk tier over vLLM's shared ``fs`` tier (scheduler side).

``secondary_tiers = [KvtierDiskTier (local), fs (shared root)]`` through
vLLM's own ``TieringOffloadingManager`` (built by ``PortableTieringSpec``),
with real slab files and real ``fs`` block files. Two managers play two
engines on one shared root: A stores, B (fresh local disk) finds the blocks
in the shared tier, keeps them locally, and serves the next hit from its
local tier. Bytes are compared in primary memory.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.manager")
from vllm.v1.kv_offload.base import (  # noqa: E402
    Locality,
    LookupResult,
    Medium,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.backpressure import (  # noqa: E402
    BackpressureDetector,
    DropStorePolicy,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvtier.connector.tiering import KvtierDiskTier  # noqa: E402
from kvtier.store.slot import slot_size  # noqa: E402
from kvtier.testing.offloading import offloading_config  # noqa: E402

from .test_secondary_tier import BLOCK_BYTES, LAYERS, Driver  # noqa: E402


def shared_config(
    local: Path,
    shared: Path,
    *,
    cpu_chunks: int = 4,
    local_slots: int = 32,
    order: str = "local",
    guarded: bool = False,
    **guard,
):
    local_tier = {
        "type": "KvtierDiskTier",
        "module_path": "kvtier.connector.tiering",
        "disk_path": str(local),
        "disk_bytes_to_use": local_slots * slot_size(BLOCK_BYTES),
        "disk_io": "posix",
    }
    shared_tier = {
        "type": "fs",
        "root_dir": str(shared),
        "locality": "REMOTE",
        "enable_kv_events": True,
        "n_read_threads": 2,
        "n_write_threads": 2,
    }
    if guarded:
        shared_tier.update(
            type="SharedFsTier", module_path="kvtier.connector.tiering", **guard
        )
    tiers = [local_tier, shared_tier]
    if order != "local":
        tiers.reverse()
    return offloading_config(
        {
            "spec_name": "PortableTieringSpec",
            "spec_module_path": "kvtier.connector.tiering",
            "cpu_bytes_to_use": cpu_chunks * BLOCK_BYTES,
            "secondary_tiers": tiers,
        },
        worker_kv_bytes_per_block=BLOCK_BYTES,
        layers=LAYERS,
        engine_tag="kvtier-shared-test",
        parallelism_agnostic=False,
    )


class SharedDriver(Driver):
    def __init__(self, config, truth=None):
        super().__init__(config)
        # Driver expects one tier; here: [local kvtier, shared fs].
        self.local = next(
            t for t in self.manager.secondary_tiers if isinstance(t, KvtierDiskTier)
        )
        self.shared = next(
            t
            for t in self.manager.secondary_tiers
            if t.tier_type in ("fs", "SharedFsTier")
        )
        self.tier = self.local
        if truth is not None:
            self.truth = truth
            self.rng = np.random.default_rng(1)

    def storage_events(self):  # both STORAGE tiers: split by ownership
        self.events.extend(self.manager.take_events())
        return [e for e in self.events if e.medium is Medium.STORAGE]


@pytest.fixture
def drivers():
    made: list[SharedDriver] = []

    def make(config, truth=None) -> SharedDriver:
        d = SharedDriver(config, truth)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def fs_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.bin"))


def _stored_in_the_shared_tier(tmp_path, drivers):
    """Engine A stores a 4-block prompt, which reaches the shared tier (and
    A's own disk), and goes: (the shared root, the prompt's keys, their
    bytes)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "a").mkdir()
    a = drivers(shared_config(tmp_path / "a", shared))
    keys = a.store("prompt", 4)
    a.settle()
    assert len(fs_files(shared)) == 4  # cascaded to the shared tier
    assert all(a.local.tier.is_ready(k) for k in keys)  # and to A's disk
    truth = dict(a.truth)
    a.close()
    return shared, keys, truth


def test_a_block_from_the_shared_tier_is_kept_locally(tmp_path, drivers):
    shared, keys, truth = _stored_in_the_shared_tier(tmp_path, drivers)
    (tmp_path / "b").mkdir()
    b = drivers(shared_config(tmp_path / "b", shared), truth)
    assert len(b.local.tier) == 0
    b.rows[:, :] = 0xAB
    hits, ctx = b.lookup("b-first", keys)
    assert hits == 4
    # Served by the shared tier (vLLM reports both STORAGE tiers as disk).
    assert b.load_and_check(keys, ctx) == {CacheHitSource.DISK.value: 4}
    assert b.local.stats.promotions_completed == 0
    b.settle()
    # ... and kept on B's local disk, from the primary rows it landed in.
    assert b.local.stats.pulled == 4
    assert all(b.local.tier.is_ready(k) for k in keys)
    assert len(b.local._pull) == 0 and not b.manager.has_pending_work()

    # Push the blocks out of B's 4-chunk primary tier; the next hit is local.
    b.store("other", 4)
    b.settle()
    assert not any(b.in_primary(k) for k in keys)
    b.rows[:, :] = 0xCD
    before = len(fs_files(shared))
    hits, ctx = b.lookup("b-again", keys)
    assert hits == 4
    assert b.load_and_check(keys, ctx) == {CacheHitSource.DISK.value: 4}
    assert b.local.stats.promotions_completed == 4
    assert len(fs_files(shared)) == before
    # The local tier's events name it among the two STORAGE tiers.
    events = b.storage_events()
    ours = [e for e in events if e.ownership == "KvtierDiskTier"]
    assert ours and all(
        e.locality is Locality.LOCAL and e.removal_expected for e in ours
    )
    stored_here = {k for e in ours if not e.removed for k in e.keys}
    assert set(keys) <= stored_here
    theirs = [e for e in events if e.ownership is None]
    assert theirs and all(e.locality is Locality.REMOTE for e in theirs)


def test_keeping_a_pulled_block_never_evicts_one_this_step_promotes(tmp_path, drivers):
    """vLLM submits a step's promotions after the tiers' external requests:
    a block the local tier answered HIT for (its promotion queued) must not
    be the victim when the same step keeps blocks a later tier supplied,
    or its promotion fails and its tokens are recomputed."""
    shared, supplied, truth = _stored_in_the_shared_tier(tmp_path, drivers)

    (tmp_path / "b").mkdir()
    b = drivers(
        shared_config(tmp_path / "b", shared, cpu_chunks=5, local_slots=4), truth
    )
    mine = b.store("mine", 4)  # B's local disk is full of them
    b.settle()
    assert all(b.local.tier.is_ready(k) for k in mine)
    # The shared tier's blocks come into B's primary tier (pushing three of
    # "mine" out of its 5 chunks); B's tier keeps them at the next step end.
    hits, ctx = b.lookup("b-first", supplied)
    assert hits == 4 and all(b.in_primary(k) for k in supplied)
    victim = next(k for k in mine if not b.in_primary(k))
    # In that step a request hits the local tier: its promotion is queued
    # (the lookup steps until it completed).
    hits, ctx = b.lookup("mine-again", [victim])
    assert hits == 1
    assert b.local.stats.pulled == 4
    assert b.local.stats.promotion_failures == 0
    assert b.local.stats.promotions_completed == 1
    assert b.load_and_check([victim], ctx) == {CacheHitSource.DISK.value: 1}


class _Pressured(BackpressureDetector):
    """A detector whose tier is always under pressure, with vLLM's
    drop-store policy (what a slow disk's EMA detector turns into)."""

    def __init__(self) -> None:
        super().__init__(DropStorePolicy())

    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
        pass

    def is_under_pressure(self) -> bool:
        return True

    def reset(self) -> None:
        pass


def test_keeping_supplied_blocks_respects_back_pressure(tmp_path, drivers):
    """A tier under back-pressure gets no cascades from vLLM; it takes no
    blocks a later tier supplied either, and vLLM's policy counts them as
    dropped."""
    shared, keys, truth = _stored_in_the_shared_tier(tmp_path, drivers)

    (tmp_path / "b").mkdir()
    b = drivers(shared_config(tmp_path / "b", shared), truth)
    b.local._bp_detector = pressured = _Pressured()
    hits, ctx = b.lookup("b-first", keys)
    assert hits == 4
    assert b.load_and_check(keys, ctx) == {CacheHitSource.DISK.value: 4}
    b.settle()
    assert b.local.stats.pulled == 0 and len(b.local.tier) == 0
    assert len(b.local._pull) == 0
    assert pressured.policy.pop_stores_dropped()[0] >= 1


def test_local_miss_of_a_fresh_block_is_forgotten(tmp_path, drivers):
    """Keys nobody supplies are dropped at the end of the step: no store job,
    no pending work left behind."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "a").mkdir()
    d = drivers(shared_config(tmp_path / "a", shared))
    ctx = ReqContext(req_id="fresh")
    d.manager.on_new_request(ctx)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(3)]
    for key in keys:
        d.manager.lookup(key, ctx)
    assert len(d.local._pull) >= 1
    d.settle()
    assert len(d.local._pull) == 0
    assert d.local.stats.pulled == 0 and len(d.local.tier) == 0


# ------------------------------------------------- SharedFsTier, the guard


@pytest.mark.parametrize("case", ["absent", "file"])
def test_unusable_shared_root_starts_offline_and_costs_misses(tmp_path, drivers, case):
    (tmp_path / "a").mkdir()
    if case == "absent":
        shared = tmp_path / "not-mounted" / "kv"
    else:
        shared = tmp_path / "a-file"
        shared.write_bytes(b"x")
    d = drivers(shared_config(tmp_path / "a", shared, guarded=True))
    assert not d.shared.online
    assert ("does not exist" if case == "absent" else "not a directory") in (
        d.shared.offline_reason
    )
    if case == "absent":
        assert not shared.parent.exists()  # never created on the local disk
    # Stores to the shared tier fail at once (their primary pins released),
    # the local tier works, and nothing is left pending.
    first = d.store("a", 4)
    d.settle()
    second = d.store("b", 4)  # evicts "a" from the 4-chunk primary tier
    d.settle()
    assert not any(d.in_primary(k) for k in first)
    assert all(d.local.tier.is_ready(k) for k in first + second)
    d.rows[:, :] = 0xAB
    hits, ctx = d.lookup("a-again", first, timeout=60)
    assert hits == 4
    assert d.load_and_check(first, ctx) == {CacheHitSource.DISK.value: 4}
    assert d.local.stats.promotions_completed == 4
    assert not d.manager.has_pending_work()


def test_hung_shared_lookups_turn_into_misses(tmp_path, drivers):
    """A mount that stops answering: vLLM's fs tier would answer RETRY
    forever (the request deferred step after step); the guard answers MISS
    after lookup_timeout_s and takes the tier offline."""
    import threading

    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "a").mkdir()
    d = drivers(
        shared_config(tmp_path / "a", shared, guarded=True, lookup_timeout_s=0.3)
    )
    assert d.shared.online
    release = threading.Event()
    hung = d.shared.inner._lookup_manager

    def hanging_batch_lookup(keys, req_context):  # the injected fault
        release.wait(30)
        return [False] * len(keys)

    hung.batch_lookup = hanging_batch_lookup
    try:
        keys = [make_offload_key(bytes([7, i]) * 16, 0) for i in range(2)]
        start = time.monotonic()
        hits, _ = d.lookup("hung", keys, timeout=10)
        assert hits == 0
        assert time.monotonic() - start < 5
        assert not d.shared.online
        assert "lookup_timeout_s" in d.shared.offline_reason
        # Offline: a store fails at once instead of queueing on the mount.
        stored = d.store("after", 2)
        d.settle()
        assert all(d.local.tier.is_ready(k) for k in stored)
        assert not list(shared.rglob("*.bin"))
    finally:
        release.set()


def test_shutdown_on_a_mount_that_just_hung_is_bounded(tmp_path, drivers):
    """The mount stops answering just before shutdown, while the tier is
    still online: vLLM's fs tier joins its lookup thread without a limit, so
    shutdown would wait as long as the mount hangs. The guard waits at most
    lookup_timeout_s (no store in flight), then leaves the thread."""
    import threading

    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "a").mkdir()
    d = drivers(
        shared_config(tmp_path / "a", shared, guarded=True, lookup_timeout_s=0.5)
    )
    release = threading.Event()

    def hanging_batch_lookup(keys, req_context):  # the injected fault
        release.wait(60)
        return [False] * len(keys)

    d.shared.inner._lookup_manager.batch_lookup = hanging_batch_lookup
    closer = threading.Thread(target=d.shared.shutdown, daemon=True)
    try:
        ctx = ReqContext(req_id="hung")
        d.manager.on_new_request(ctx)
        key = make_offload_key(bytes([9]) * 32, 0)
        assert d.manager.lookup(key, ctx) is LookupResult.RETRY
        d.step()  # the lookup goes to the (hung) lookup thread
        assert d.shared.online
        closer.start()
        closer.join(20)
        assert not closer.is_alive(), "shutdown waited on the hung mount"
    finally:
        release.set()
        if closer.ident is not None:
            closer.join(30)


def test_a_lookup_another_request_gave_up_on_does_not_take_the_tier_offline(
    tmp_path, drivers
):
    """lookup_timeout_s times one request's unanswered lookup: a key an
    aborted request was told RETRY for (and never asked about again) must not
    make the next request's first RETRY of that key count as a hang."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "a").mkdir()
    a = drivers(shared_config(tmp_path / "a", shared))
    keys = a.store("prompt", 1)
    a.settle()
    assert len(fs_files(shared)) == 1
    truth = dict(a.truth)
    a.close()

    (tmp_path / "b").mkdir()
    b = drivers(
        shared_config(tmp_path / "b", shared, guarded=True, lookup_timeout_s=0.3),
        truth,
    )
    ctx = ReqContext(req_id="aborted")
    b.manager.on_new_request(ctx)
    assert b.manager.lookup(keys[0], ctx) is LookupResult.RETRY
    b.manager.on_request_finished(ctx)  # aborted while deferred
    b.step()
    time.sleep(0.5)  # longer than lookup_timeout_s since that RETRY
    b.rows[:, :] = 0xAB
    hits, ctx = b.lookup("next", keys, timeout=10)
    assert b.shared.online, b.shared.offline_reason
    assert hits == 1
    assert b.load_and_check(keys, ctx) == {CacheHitSource.DISK.value: 1}


def test_the_store_guard_reads_the_oldest_store_only(tmp_path, drivers):
    """A slow (not hung) mount: stores pile up in flight. Each step the
    guard checks the oldest against store_timeout_s; it read the start time
    of every store in flight to find it, O(stores in flight) in the
    scheduler's step (1.7 ms at 32k on a 2-core VM). Stores go in flight in
    submission order, so it reads the first only; and a store older than
    store_timeout_s still takes the tier offline."""
    from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

    shared = tmp_path / "shared"
    shared.mkdir()
    (tmp_path / "a").mkdir()
    d = drivers(
        shared_config(tmp_path / "a", shared, guarded=True, store_timeout_s=1.0)
    )
    tier = d.shared
    finished: list[JobResult] = []
    # The mount takes the stores and finishes none until told.
    tier.inner.submit_store = lambda job: None
    tier.inner.get_finished_jobs = lambda: [finished.pop() for _ in list(finished)]
    read = [0]

    class Counting(type(tier._store_since)):  # every read of the times
        def _count(self, items):
            for item in items:
                read[0] += 1
                yield item

        def values(self):
            return self._count(super().values())

        def items(self):
            return self._count(super().items())

        def __iter__(self):
            return self._count(super().__iter__())

    tier._store_since = Counting(tier._store_since)
    jobs = 1000
    for i in range(jobs):
        key = make_offload_key(i.to_bytes(32, "big"), 0)
        tier.submit_store(
            TransferJob(i, [key], np.array([0]), False, ReqContext(req_id=f"r{i}"))
        )
    steps = 20
    for _ in range(steps):
        assert tier.get_finished_jobs() == []
    assert tier.online
    assert read[0] <= 2 * steps, read[0]  # was jobs per step

    # The oldest half lands; the guard goes on with the oldest left.
    finished.extend(JobResult(i, True) for i in range(jobs // 2))
    assert len(tier.get_finished_jobs()) == jobs // 2
    deadline = time.monotonic() + 10
    while tier.online and time.monotonic() < deadline:
        time.sleep(0.05)
        tier.get_finished_jobs()
    assert not tier.online
    assert "store_timeout_s" in tier.offline_reason


@pytest.mark.parametrize(
    ("entry", "key"),
    [
        ({"root_dir": "relative/kv"}, "root_dir"),
        ({"root_dir": "/x", "lookup_timeout_s": 0}, "lookup_timeout_s"),
        ({"root_dir": "/x", "probe_timeout_s": "five"}, "probe_timeout_s"),
        ({"root_dir": "/x", "locality": "NEAR"}, "locality"),
        ({"root_dir": "/x", "rootdir": "/y"}, "rootdir"),
    ],
)
def test_bad_shared_tier_config_names_the_key(entry, key):
    from kvtier.connector.config import TierConfigError, parse_shared_tier_config

    with pytest.raises(TierConfigError, match=rf"\[type=SharedFsTier\]\['{key}'\]"):
        parse_shared_tier_config(entry)


def test_ready_shared_config_orders_local_before_shared():
    import json

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from kvtier.connector.config import parse_shared_tier_config, parse_tier_config
    from kvtier.connector.tiering.shared_fs import SharedFsTier

    path = Path(__file__).resolve().parents[2] / "configs"
    text = (path / "vllm-tiering-kvtier-disk-shared.json").read_text()
    extra = json.loads(text)["kv_connector_extra_config"]
    local, shared = extra["secondary_tiers"]
    # Local first: vLLM asks the tiers in list order and promotes from the
    # first hit, so a local NVMe hit is preferred to the shared tier.
    assert SecondaryTierFactory.get_tier_class(local) is KvtierDiskTier
    assert SecondaryTierFactory.get_tier_class(shared) is SharedFsTier
    parse_tier_config(local)
    rest = {k: v for k, v in shared.items() if k not in ("type", "module_path")}
    shared_entry = parse_shared_tier_config(rest)
    assert shared_entry.root_dir == "/mnt/shared/kvcache"
    assert shared_entry.locality == "REMOTE"
    assert shared_entry.fs_keys()["enable_kv_events"] is True
    assert extra["self_describing_kv_events"] is True
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--kv-transfer-config", text]
    )
    assert args.kv_transfer_config.kv_connector_extra_config == extra


def test_ready_obj_config_orders_local_before_the_object_store():
    import inspect
    import json

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.obj.config import ObjStoreConfig
    from vllm.v1.kv_offload.tiering.obj.manager import (
        ObjectStoreSecondaryTierManager,
    )

    from kvtier.connector.config import parse_tier_config

    path = Path(__file__).resolve().parents[2] / "configs"
    text = (path / "vllm-tiering-kvtier-disk-obj.json").read_text()
    extra = json.loads(text)["kv_connector_extra_config"]
    local, obj = extra["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(local) is KvtierDiskTier
    assert SecondaryTierFactory.get_tier_class(obj) is ObjectStoreSecondaryTierManager
    parse_tier_config(local)
    # Every key is one vLLM's obj tier takes (the factory passes them as
    # keyword arguments), and store_config is a valid ObjStoreConfig.
    rest = {k: v for k, v in obj.items() if k != "type"}
    inspect.signature(ObjectStoreSecondaryTierManager).bind(
        offloading_spec=None,
        primary_kv_view=None,
        tier_type="obj",
        backpressure_detector=None,
        **rest,
    )
    params = ObjStoreConfig(**obj["store_config"]).to_nixl_params()
    assert params["bucket"] == "BUCKET" and "access_key" not in params
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--kv-transfer-config", text]
    )
    assert args.kv_transfer_config.kv_connector_extra_config == extra


@pytest.mark.parametrize(("before", "after"), [(None, "y"), ("1", "1"), ("n", "n")])
def test_obj_tier_gets_nixl_telemetry_unless_turned_off(monkeypatch, before, after):
    """vLLM 0.32's obj tier reads every transfer's NIXL telemetry; kvtier's
    spec turns capture on (NIXL_TELEMETRY_ENABLE) and keeps a user's value."""
    from kvtier.connector.tiering.portable import enable_nixl_telemetry

    if before is None:
        monkeypatch.delenv("NIXL_TELEMETRY_ENABLE", raising=False)
    else:
        monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", before)
    enable_nixl_telemetry()
    assert os.environ["NIXL_TELEMETRY_ENABLE"] == after
