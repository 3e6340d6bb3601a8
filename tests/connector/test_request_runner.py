"""Scheduler + worker contract of TieredOffloadingSpec without an engine.

In the style of vLLM's own offloading-connector unit tests: a small request
runner plays vLLM's scheduler (lookup / prepare_store / complete_store /
prepare_load / complete_load in vLLM's order) and drives the real spec's
manager and worker over KV-cache tensors in host memory, with a real disk
tier on a real file system. Every load is checked byte for byte.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
import torch

vllm_base = pytest.importorskip("vllm.v1.kv_offload.base")
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingCounterMetadata,
    ReqContext,
    make_offload_key,
)

from kvtier.connector import metrics  # noqa: E402
from kvtier.connector.load_store_specs import TierLoadSpec  # noqa: E402
from kvtier.connector.worker_report import WorkerReport  # noqa: E402
from kvtier.store.slot import slot_size  # noqa: E402
from kvtier.testing.faults import flip_byte  # noqa: E402
from kvtier.testing.offloading import (  # noqa: E402
    offloading_config,
    tiered_spec,
    wait_finished,
)
from kvtier.testing.residency import residency  # noqa: E402
from kvtier.testing.state import num_loads  # noqa: E402

NUM_GPU_BLOCKS = 64
PAGE = 4096  # bytes of one block of one layer
LAYERS = 2
BLOCK_BYTES = PAGE * LAYERS


def make_config(tmp_path, cpu_blocks, disk_blocks, events=True, **extra):
    extra_config = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "kvtier.connector",
        "cpu_bytes_to_use": cpu_blocks * BLOCK_BYTES,
        "spill_watermark": 0.5,
        "disk_io": "posix",
    }
    if disk_blocks:
        extra_config["disk_bytes_to_use"] = disk_blocks * slot_size(BLOCK_BYTES)
        extra_config["disk_path"] = str(tmp_path)
    extra_config.update(extra)
    return offloading_config(
        extra_config,
        worker_kv_bytes_per_block=BLOCK_BYTES,
        layers=LAYERS,
        enable_kv_cache_events=events,
        engine_tag="runner",
    )


class RequestRunner:
    """Plays vLLM's scheduler and worker loop against one spec."""

    def __init__(self, spec):
        torch.manual_seed(0)
        self.kv = [
            torch.randint(-128, 127, (NUM_GPU_BLOCKS, PAGE), dtype=torch.int8)
            for _ in range(LAYERS)
        ]
        caches = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(t, PAGE) for t in self.kv],
            group_data_refs=[[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]],
        )
        self.worker = spec.get_worker(caches)
        self.manager = spec.get_manager()
        self.job = 0
        self.truth: dict[bytes, list[torch.Tensor]] = {}

    @staticmethod
    def keys(name: str, n: int) -> list[bytes]:
        return [
            make_offload_key(hashlib.sha256(f"{name}/{i}".encode()).digest(), 0)
            for i in range(n)
        ]

    def _run_job(self, submit, *args):
        self.job += 1
        assert submit(self.job, *args)
        finished = wait_finished(self.worker)
        assert [r.job_id for r in finished] == [self.job]
        return finished[0]

    def store(self, name: str, gpu_blocks: list[int], start: int = 0) -> list[bytes]:
        """A request computed ``gpu_blocks`` (its blocks ``start``, ``start`` +
        1, ...); offload them (vLLM order)."""
        keys = self.keys(name, start + len(gpu_blocks))[start:]
        ctx = ReqContext(req_id=name)
        self.manager.on_new_request(ctx)
        out = self.manager.prepare_store(keys, ctx)
        for _ in range(3):  # declined: vLLM asks again on a later step
            if out is not None:
                break
            self.settle()
            out = self.manager.prepare_store(keys, ctx)
        assert out is not None, "store declined"
        index = {k: b for k, b in zip(keys, gpu_blocks)}
        src = [index[k] for k in out.keys_to_store]
        if src:
            spec = GPULoadStoreSpec(src, [len(src)], [0])
            assert self._run_job(self.worker.submit_store, spec, out.store_spec).success
        for k, b in zip(keys, gpu_blocks):
            self.truth[k] = [t[b].clone() for t in self.kv]
        self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        return keys

    def settle(self, timeout: float = 60.0) -> None:
        """Step the scheduler until background disk work is done."""
        deadline = time.monotonic() + timeout
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "disk jobs did not finish"
            self.manager.on_schedule_end(None)
            time.sleep(0.005)

    def lookup(self, name: str, keys: list[bytes], timeout: float = 60.0) -> int:
        """vLLM's deferred prefix lookup: re-ask each step until settled."""
        ctx = ReqContext(req_id=name + "/load")
        self.ctx = ctx
        self.manager.on_new_request(ctx)
        deadline = time.monotonic() + timeout
        while True:
            hits, deferred = 0, False
            for key in keys:
                r = self.manager.lookup(key, ctx)
                if r is LookupResult.MISS:
                    break
                if r is LookupResult.HIT:
                    hits += 1
                else:
                    deferred = True
            if not deferred:
                return hits
            assert time.monotonic() < deadline, "lookup never settled"
            self.manager.on_schedule_end(None)
            time.sleep(0.005)

    def load(
        self, keys: list[bytes], gpu_blocks: list[int], *, expect_failed=()
    ) -> dict[str, int]:
        """Load ``keys`` into ``gpu_blocks`` as vLLM's connector does; keys in
        ``expect_failed`` must come back as a failed job whose GPU blocks
        were left untouched (and are reported to the manager)."""
        ctx = self.ctx
        spec = self.manager.prepare_load(keys, ctx)
        sources = {}
        for key in keys:
            src = self.manager.get_load_source(key, ctx).value
            sources[src] = sources.get(src, 0) + 1
        for t in self.kv:
            t[gpu_blocks] = 0  # the destination blocks hold garbage
        dst = GPULoadStoreSpec(gpu_blocks, [len(gpu_blocks)], [0])
        result = self._run_job(self.worker.submit_load, spec, dst)
        bad = set(expect_failed)
        assert result.success == (not bad)
        if bad:
            error = self.worker.take_load_error(result.job_id)
            # Shown bad (dropped) or unreadable (kept): failed either way.
            assert set(error.corrupt) | set(error.io_failed) == bad
            want = {b for k, b in zip(keys, gpu_blocks) if k in bad}
            assert error.gpu_block_ids == want
            self.manager.note_worker_report(
                WorkerReport(
                    {ctx.req_id: error.corrupt},
                    io_failed_keys={ctx.req_id: error.io_failed},
                )
            )
        self.manager.complete_load(keys, ctx)
        self.manager.on_request_finished(ctx)
        for key, b in zip(keys, gpu_blocks):
            for layer, t in enumerate(self.kv):
                if key in bad:  # never a byte of a block that failed
                    assert not t[b].any(), (key.hex(), layer)
                else:
                    assert torch.equal(t[b], self.truth[key][layer]), (key.hex(), layer)
        return sources

    def close(self):
        self.manager.shutdown()
        self.worker.shutdown()


@pytest.fixture(params=["host", "device"])
def runner(tmp_path, request):
    """Both ``disk_load_path`` readers: the host bounce area, and a staging
    area on the KV cache's device (host memory on the CPU platform)."""
    cfg = make_config(tmp_path, cpu_blocks=8, disk_blocks=32, disk_load_path=request.param)
    r = RequestRunner(tiered_spec(cfg))
    yield r
    r.close()


def push_to_disk(runner, first_blocks: list[int], others: str = "bcd") -> list[bytes]:
    """Store request "a", then enough others that a lives on disk only."""
    first = runner.store("a", first_blocks)
    runner.settle()
    for i, name in enumerate(others):
        runner.store(name, [10 + 4 * i + j for j in range(4)])
        runner.settle()
    h = runner.manager.hierarchy
    assert all(h.lookup(k).name == "HIT_DISK" for k in first)
    return first


def test_cpu_hit_roundtrip(runner):
    keys = runner.store("a", [1, 2, 3])
    assert runner.lookup("a", keys) == 3
    assert runner.load(keys, [40, 41, 42]) == {"host": 3}


def test_cascade_to_disk_and_back(runner):
    first = push_to_disk(runner, [1, 2, 3, 4])
    h = runner.manager.hierarchy
    # Disk hits are hits at once: no deferral, no promotion first.
    assert runner.lookup("a", first) == 4
    assert runner.load(first, [50, 51, 52, 53]) == {"disk": 4}
    assert h.stats.loads_disk == 4
    # Clean CPU rows could be given up, so the verified blocks went up too,
    # with the right bytes: a second load reads them from the CPU tier.
    assert h.stats.promotions_completed == 4
    assert all(h.lookup(k).name == "HIT_CPU" for k in first)
    assert runner.lookup("a", first) == 4
    assert runner.load(first, [54, 55, 56, 57]) == {"disk": 4}
    assert h.stats.loads_cpu == 4


def test_prefix_longer_than_the_cpu_tier_loads_from_disk(tmp_path):
    r = RequestRunner(tiered_spec(make_config(tmp_path, cpu_blocks=4, disk_blocks=64)))
    try:
        # 10 blocks, CPU holds 4: stored step by step, as vLLM offloads them
        first = []
        for start in (0, 4, 8):
            blocks = list(range(1 + start, min(11, 5 + start)))
            first += r.store("a", blocks, start=start)
            r.settle()
        for i, name in enumerate("bc"):
            r.store(name, [20 + 4 * i + j for j in range(4)])
            r.settle()
        h = r.manager.hierarchy
        assert sum(h.lookup(k).name == "HIT_DISK" for k in first) == 10
        # A bounce area of 3 slots: the load is read in four read batches.
        r.worker.reader.capacity = 3
        assert r.lookup("a", first) == 10
        assert r.load(first, list(range(40, 50))) == {"disk": 10}
        assert h.stats.loads_disk == 10
        assert num_loads(h) == 0 and all(b.pins == 0 for _, b in h.disk.items())
    finally:
        r.close()


def test_compressed_slots_load_verified(tmp_path):
    config = make_config(tmp_path, cpu_blocks=8, disk_blocks=32, disk_compression="zstd")
    r = RequestRunner(tiered_spec(config))
    try:
        for t in r.kv:  # compressible pages: zstd keeps the compressed form
            t[:, : PAGE // 2] = 0
        first = push_to_disk(r, [1, 2, 3, 4])
        assert r.lookup("a", first) == 4
        assert r.load(first, [50, 51, 52, 53]) == {"disk": 4}
        assert r.worker.reader.stats().blocks_ok == 4
    finally:
        r.close()


def _flip_payload_byte(runner, key: bytes) -> None:
    store = runner.manager.runtime.stores[0]
    slot = runner.manager.hierarchy.disk.get(key).slot
    idx, offset = store.files.offset_of(slot)
    flip_byte(store.slabs[idx].path, offset + 4096 + 100)


def test_an_empty_load_job_succeeds(runner):
    """vLLM's connector never submits a load with no blocks, but such a job
    is a success (every block of it loaded), as in vLLM's own workers."""
    r = runner
    done = r._run_job(
        r.worker.submit_load, TierLoadSpec([], []), GPULoadStoreSpec([], [0], [0])
    )
    assert done.success
    ctx = ReqContext(req_id="empty")
    r.manager.on_new_request(ctx)
    spec = r.manager.prepare_load([], ctx)
    assert len(spec.block_ids) == 0
    r.manager.complete_load([], ctx)
    assert num_loads(r.manager.hierarchy) == 0


def test_corrupt_disk_block_is_a_miss_never_data(runner):
    first = push_to_disk(runner, [1, 2, 3, 4])
    h = runner.manager.hierarchy
    victim = first[1]
    _flip_payload_byte(runner, victim)
    # The load is planned in full; the worker refuses the bad block, leaves
    # its GPU block untouched and reports it; the tier drops it.
    assert runner.lookup("a", first) == 4
    runner.load(first, [50, 51, 52, 53], expect_failed=[victim])
    assert h.lookup(victim).name == "MISS"
    assert h.disk_core.failures.corrupt == 1 and h.stats.load_failures == 1
    assert h.stats.loads_disk == 3 and h.stats.promotions_completed == 3
    assert runner.worker.reader.stats().checksum_failures == 1
    assert victim not in h.cpu  # its promotion row was given back unwritten
    # The rest is still a hit, from the CPU copies the load made.
    assert runner.lookup("a", first) == 1
    assert runner.load(first[:1], [54]) == {"disk": 1}


def test_a_corrupt_block_dropped_before_a_restart_is_a_miss_after_it(tmp_path):
    """The full spec drops a block whose load found its bytes bad, but its
    slot keeps its header (the workers read the slabs; nothing rewrites the
    slot until a later spill reuses it), so a restart adopts it again
    (docs/operations.md#checks-before-and-after-an-incident): its next load
    fails verification again and is dropped again, never served. Every
    block is spilled as soon as stored (watermark 0), so the shutdown has
    none left to spill, which could take the freed slot."""
    cfg = make_config(tmp_path, cpu_blocks=8, disk_blocks=32, spill_watermark=0.0)
    r = RequestRunner(tiered_spec(cfg))
    try:
        first = push_to_disk(r, [1, 2, 3, 4])
        victim = first[1]
        _flip_payload_byte(r, victim)
        assert r.lookup("a", first) == 4
        r.load(first, [50, 51, 52, 53], expect_failed=[victim])
        assert victim not in r.manager.hierarchy.disk
        truth = r.truth  # what each key's block held when it was stored
    finally:
        r.close()
    r = RequestRunner(tiered_spec(cfg))
    try:
        r.truth = truth
        h = r.manager.hierarchy
        assert h.lookup(victim).name == "HIT_DISK"  # adopted again
        assert r.lookup("a", first) == 4
        r.load(first, [50, 51, 52, 53], expect_failed=[victim])
        assert h.disk_core.failures.corrupt == 1 and h.lookup(victim).name == "MISS"
        # The others came back from disk with the bytes stored before the
        # restart (a hit from the CPU copies their load made).
        assert r.lookup("a", first[:1]) == 1
    finally:
        r.close()


def test_another_keys_slot_is_refused(runner):
    first = push_to_disk(runner, [1, 2, 3, 4])
    h = runner.manager.hierarchy
    # Point block 2's index entry at block 3's slot (a stale index, or a
    # slot reused under it): the header's key does not match.
    h.disk.get(first[2]).slot = h.disk.get(first[3]).slot
    assert runner.lookup("a", first[:3]) == 3
    runner.load(first[:3], [50, 51, 52], expect_failed=[first[2]])
    assert h.lookup(first[2]).name == "MISS"


def test_events_replay_to_residency(runner):
    from vllm.v1.kv_offload.base import Medium

    runner.store("a", [1, 2, 3, 4])
    runner.settle()
    for i, name in enumerate("bcd"):
        runner.store(name, [10 + 4 * i + j for j in range(4)])
        runner.settle()
    held = {Medium.CPU: set(), Medium.STORAGE: set()}
    for ev in runner.manager.take_events():
        if ev.removed:
            held[ev.medium] -= set(ev.keys)
        else:
            held[ev.medium] |= set(ev.keys)
    res = residency(runner.manager.hierarchy)
    assert held[Medium.CPU] == res["cpu"]
    assert held[Medium.STORAGE] == res["disk"]


def test_cpu_only_spec_runs_without_disk(tmp_path):
    r = RequestRunner(tiered_spec(make_config(tmp_path, cpu_blocks=4, disk_blocks=0)))
    try:
        a = r.store("a", [1, 2])
        r.store("b", [3, 4, 5])  # evicts one of a's blocks: no disk to spill to
        # The tail goes first, so a's head is still a (one-block) hit.
        assert r.lookup("a", a) == 1
        assert r.load(a[:1], [40]) == {"host": 1}
        assert r.manager.runtime is None
    finally:
        r.close()


def test_tier_gauges_before_the_first_spill(tmp_path):
    """The disk tier's gauges are exported while it is still empty (an
    empty tier is a tier, not a missing one); a CPU-only spec has none."""
    for disk_blocks, media in ((32, {"cpu", "disk"}), (0, {"cpu"})):
        cfg = make_config(tmp_path, 8, disk_blocks)
        r = RequestRunner(tiered_spec(cfg))
        try:
            gauges = r.manager.get_stats()._values
            capacity = {k[0]: v for k, v in gauges[metrics.TIER_CAPACITY].items()}
            assert set(capacity) == media
            assert capacity.get("disk", 0) == disk_blocks
            blocks = {k[0]: v for k, v in gauges[metrics.TIER_BLOCKS].items()}
            assert set(blocks) == media and blocks.get("disk", 0) == 0
        finally:
            r.close()


def test_counters_exported_from_the_first_step(tmp_path):
    """Which counters the full spec exports, at 0, from its first
    ``get_stats`` (docs/operations.md#metrics-reference): vLLM creates a
    labelled series only when it is first reported, so a counter left out
    here has no series at all, not a 0 (promotion_failures is tiering
    mode's; a CPU-only spec has no disk counters)."""
    counters = {
        name
        for name, meta in metrics.metric_definitions().items()
        if isinstance(meta, OffloadingCounterMetadata)
    }
    cpu_only = {
        metrics.WRITE_BYTES,
        metrics.READ_BYTES,
        metrics.EVICTIONS,
        metrics.LOADED_BLOCKS,
        metrics.STORES_DECLINED,
        metrics.WORKER_EXCEPTIONS,
    }
    for disk_blocks, want in (
        (32, counters - {metrics.PROMOTION_FAILURES}),
        (0, cpu_only),
    ):
        r = RequestRunner(tiered_spec(make_config(tmp_path, 8, disk_blocks)))
        try:
            stats = r.manager.get_stats()
            got = {n for n, t in stats._types.items() if t == "counter"}
            assert got == want, (disk_blocks, sorted(got ^ want))
            zero = all(v == 0 for n in got for v in stats._values[n].values())
            assert zero, stats._values
        finally:
            r.close()


def test_multi_chunk_rows_and_partial_first_chunk(tmp_path):
    """blocks_per_chunk=2: a load may enter the first chunk mid-way."""
    from kvtier.host.block_copy import plan_copy

    plan = plan_copy([7, 8, 9], [4, 5], 2, first_block_index=1)
    assert plan.row_ids.tolist() == [4, 5, 5]
    assert plan.sub_ids.tolist() == [1, 0, 1]
    with pytest.raises(ValueError):
        plan_copy([1, 2, 3], [0], 2, 0)
    assert np.array_equal(plan.gpu_ids, [7, 8, 9])


def test_disk_tier_refuses_the_stock_connector(tmp_path):
    """vLLM's stock OffloadingConnector asserts on a failed load: with a disk
    tier, the spec refuses to start under it and names the fix."""
    from kvtier.connector.config import TransferConfigError
    from kvtier.connector.spec import TieredOffloadingSpec

    with pytest.raises(TransferConfigError) as info:
        TieredOffloadingSpec(make_config(tmp_path, cpu_blocks=4, disk_blocks=8))
    text = str(info.value)
    assert "kv_transfer_config['kv_connector']" in text
    assert '"kv_connector": "TieredOffloadingConnector"' in text
    assert '"kv_load_failure_policy": "recompute"' in text
    # CPU-only has no load that can fail: the stock connector is fine.
    TieredOffloadingSpec(make_config(tmp_path, cpu_blocks=4, disk_blocks=0))



def transfer_threads() -> int:
    """The disk runtimes' I/O threads alive in this process."""
    import threading

    return sum(t.name.startswith("kvtier-xfer") for t in threading.enumerate())


def wait_transfer_threads(at_most: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while transfer_threads() > at_most:
        assert time.monotonic() < deadline, "the runtime's I/O threads stayed"
        time.sleep(0.01)


def fail_warm_restart(monkeypatch) -> None:
    """Every disk runtime's warm-restart scan fails with EIO from here on
    (``monkeypatch.undo()`` ends it)."""
    from kvtier.store.runtime import DiskRuntime

    def failing_scan(self):
        raise OSError(5, "scan failed")

    monkeypatch.setattr(DiskRuntime, "scan_restore", failing_scan)


def test_a_failed_warm_restart_leaves_no_store_behind(tmp_path, monkeypatch):
    """get_manager fails with the warm-restart scan's own error, and the
    disk runtime it built goes with it: its I/O threads end and the store
    directory's lock is free for the next engine on the same disk_path."""
    before = transfer_threads()
    fail_warm_restart(monkeypatch)
    spec = tiered_spec(make_config(tmp_path, cpu_blocks=8, disk_blocks=16))
    with pytest.raises(OSError, match="scan failed"):
        spec.get_manager()
    wait_transfer_threads(before)
    monkeypatch.undo()
    again = tiered_spec(make_config(tmp_path, cpu_blocks=8, disk_blocks=16))
    manager = again.get_manager()  # the store's lock was released
    try:
        assert manager.hierarchy.disk is not None
    finally:
        manager.shutdown()


def test_the_models_contents_are_hashed_once_per_spec(tmp_path, monkeypatch):
    """Hashing the model's files (its identity on disk) is start-up work:
    the spec does it once, however many places need the fingerprints."""
    from kvtier.connector import identity

    calls = []
    real = identity.model_identity

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(identity, "model_identity", counted)
    spec = tiered_spec(make_config(tmp_path, cpu_blocks=8, disk_blocks=16))
    manager = spec.get_manager()
    try:
        assert spec.fingerprints[0].model_id
        assert len(calls) == 1
    finally:
        manager.shutdown()


def test_a_cpu_only_load_the_worker_fails_whole_leaves_its_blocks(
    tmp_path, monkeypatch
):
    """A CPU tier alone has loads that can fail too: the worker contains an
    exception of its own (here, the CPU rows' copy) and fails the job
    whole, every key unread. The manager completed such a load through the
    disk tier's read release and asserted there was a disk tier: raised in
    vLLM's update_connector_output, that stopped the engine instead of
    recomputing the request."""
    from kvtier.host.block_copy import BlockCopier

    r = RequestRunner(tiered_spec(make_config(tmp_path, cpu_blocks=4, disk_blocks=0)))
    try:
        keys = r.store("a", [1, 2])
        assert r.lookup("a", keys) == 2
        ctx = r.ctx
        spec = r.manager.prepare_load(keys, ctx)

        def broken(self, plan, to_cpu):
            raise RuntimeError("a bug in the copy")

        monkeypatch.setattr(BlockCopier, "copy", broken)
        result = r._run_job(
            r.worker.submit_load, spec, GPULoadStoreSpec([40, 41], [2], [0])
        )
        assert not result.success
        error = r.worker.take_load_error(result.job_id)
        assert error.whole and error.gpu_block_ids == {40, 41}
        # What the connector's worker tells the scheduler of it.
        r.manager.note_worker_report(
            WorkerReport(
                {ctx.req_id: error.corrupt},
                unread_keys={ctx.req_id: error.unread},
                failed_loads=[ctx.req_id],
            )
        )
        r.manager.complete_load(keys, ctx)
        monkeypatch.undo()
        # The blocks stay, unpinned; the next request loads them.
        assert r.lookup("a", keys) == 2
        assert r.load(keys, [40, 41]) == {"host": 2}
    finally:
        r.close()
