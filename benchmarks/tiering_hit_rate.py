"""Hit rate of vLLM's tiering mode with kvtier's disk tier vs kvtier's full
spec, on the shared Mooncake trace at the same CPU and disk capacities.

    .venv/bin/python benchmarks/tiering_hit_rate.py [--trace FILE]
        [--cpu-blocks 2000] [--mults 5 10 20] [--policies lru arc]
        [--disk-dir DIR] [--limit N]

Tiering mode is replayed through vLLM's own ``TieringOffloadingManager``
(built by ``PortableTieringSpec.get_manager()``: vLLM's CPU primary tier
over a real ``SharedOffloadRegion``) with ``KvtierDiskTier`` as its secondary
tier, doing real slab I/O (checksummed 4 KiB rows, 8 KiB slots) in a temp
directory. Per request, as vLLM's connector scheduler drives it: a prefix
lookup re-asked every step until settled (a disk hit starts a promotion and
answers HIT_PENDING), ``prepare_load``/``complete_load`` of the hits, then
``prepare_store``/``complete_store`` of the rest (which cascades every new
block to disk). I/O is made instant by draining the tier after each step,
as ``kvtier.tools.sizing`` completes every spill and promotion instantly. A hit is
credited to the tier vLLM reports through ``get_load_source`` (``host`` or
``disk``).

The full spec's numbers come from ``kvtier.tools.sizing.replay_trace`` (the replay
behind ``kvtier size`` and benchmarks/hit_rate.py) with the same capacities,
policies and keys: once with the default ``spill_watermark`` 0.75 (write-back)
and once with 0 (``full_spec_write_through``: every stored block goes to disk
at once, the write policy vLLM's tiering cascade imposes). Hit rate is
block-level: hit blocks / all blocks. Writes
benchmarks/results/tiering_hit_rate.json.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is on the path, not ROOT
    sys.path.insert(0, str(ROOT))

from benchmarks._common import DEFAULT_CPU_BLOCKS, DEFAULT_TRACE, write_json  # noqa: E402
from kvtier.tools.sizing import replay_trace  # noqa: E402
from kvtier.tools.trace import infinite_cache_hit_rate, load_trace  # noqa: E402

ROW_BYTES = 4096  # one trace block's row in the primary tier (page aligned)


def make_config(cpu: int, disk: int, cpu_policy: str, disk_policy: str, path: str):
    from kvtier.store.slot import slot_size
    from kvtier.testing.offloading import offloading_config

    tiers = []
    if disk:
        tiers.append(
            {
                "type": "KvtierDiskTier",
                "module_path": "kvtier.connector.tiering",
                "disk_path": path,
                "disk_bytes_to_use": disk * slot_size(ROW_BYTES),
                "eviction_policy": disk_policy,
                "disk_io": "posix",
            }
        )
    return offloading_config(
        {
            "spec_name": "PortableTieringSpec",
            "spec_module_path": "kvtier.connector.tiering",
            "cpu_bytes_to_use": cpu * ROW_BYTES,
            "eviction_policy": cpu_policy,
            "secondary_tiers": tiers,
        },
        worker_kv_bytes_per_block=ROW_BYTES,
        layers=1,
        tokens_per_block=512,
        model="trace",
        enable_kv_cache_events=False,
        engine_tag="kvtier-bench",
        parallelism_agnostic=False,
    )


def replay_tiering(
    reqs: Sequence[Sequence[bytes]],
    cpu: int,
    disk: int,
    cpu_policy: str,
    disk_policy: str,
    disk_dir: str,
) -> dict[str, Any]:
    """One replay through vLLM's TieringOffloadingManager + KvtierDiskTier."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from kvtier.connector.tiering import PortableTieringSpec

    path = tempfile.mkdtemp(prefix="tiering-hit-rate-", dir=disk_dir)
    spec = PortableTieringSpec(make_config(cpu, disk, cpu_policy, disk_policy, path))
    m = spec.get_manager()
    tiers = m.secondary_tiers
    step_ctx = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    HIT, MISS = LookupResult.HIT, LookupResult.MISS

    def step() -> None:
        m.on_schedule_end(step_ctx)  # submits the promotions found this step
        for tier in tiers:
            tier.drain_jobs()  # instant I/O: done before the next step

    hits_cpu = hits_disk = blocks = declined = steps = 0
    t0 = time.perf_counter()
    try:
        for i, keys in enumerate(reqs):
            ctx = ReqContext(req_id=f"r{i}")
            m.on_new_request(ctx)
            while True:
                n, deferred = 0, False
                for key in keys:
                    r = m.lookup(key, ctx)
                    if r is MISS:
                        break
                    n += 1
                    if r is not HIT:
                        deferred = True
                if not deferred:
                    break
                step()
                steps += 1
            hit = keys[:n]
            if hit:
                for key in hit:
                    if m.get_load_source(key, ctx) is CacheHitSource.DISK:
                        hits_disk += 1
                    else:
                        hits_cpu += 1
                m.prepare_load(hit, ctx)
                m.complete_load(hit, ctx)
            rest = keys[n:]
            if rest:
                out = m.prepare_store(rest, ctx)
                if out is None:
                    declined += 1
                elif out.keys_to_store:
                    m.complete_store(out.keys_to_store, ctx)
            m.on_request_finished(ctx)
            step()
            blocks += len(keys)
        m.on_schedule_end(step_ctx)  # apply the last drained completions
        seconds = time.perf_counter() - t0
        tier_stats = vars(tiers[0].stats).copy() if tiers else {}
    finally:
        m.shutdown()
        shutil.rmtree(path, ignore_errors=True)
    return {
        "mode": "vllm_tiering+KvtierDiskTier",
        "cpu_blocks": cpu,
        "disk_blocks": disk,
        "cpu_policy": cpu_policy,
        "disk_policy": disk_policy if disk else None,
        "blocks": blocks,
        "hit_rate": (hits_cpu + hits_disk) / blocks,
        "hit_rate_cpu": hits_cpu / blocks,
        "hit_rate_disk": hits_disk / blocks,
        "stores_declined": declined,
        "disk_writes": tier_stats.get("stores_completed", 0),
        "promotions": tier_stats.get("promotions_completed", 0),
        "promotion_steps": steps,
        "disk_tier": tier_stats,
        "replay_s": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--cpu-blocks", type=int, default=DEFAULT_CPU_BLOCKS)
    ap.add_argument("--mults", type=int, nargs="+", default=[5, 10, 20])
    ap.add_argument("--policies", nargs="+", default=["lru", "arc"])
    ap.add_argument("--disk-dir", default=None, help="where the slabs go (temp)")
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from vllm.v1.kv_offload.base import make_offload_key

    trace = load_trace(args.trace, limit=args.limit)
    reqs = [
        [make_offload_key(h.to_bytes(32, "big"), 0) for h in r.hash_ids] for r in trace
    ]
    cpu = args.cpu_blocks
    bound = infinite_cache_hit_rate(trace)
    configs = [(cpu, 0, p, p) for p in args.policies] + [
        (cpu, cpu * mult, p, p) for mult in args.mults for p in args.policies
    ]
    print(
        f"trace {args.trace}: {len(trace)} requests, {sum(map(len, reqs))} blocks; "
        f"infinite-cache hit rate {bound:.4f}; CPU tier {cpu} blocks"
    )
    print(
        f"{'policy':<7}{'disk':>7}  {'full spec':>9} {'(cpu':>6} {'disk)':>6}  "
        f"{'wm=0':>6}  {'tiering':>8} {'(cpu':>6} {'disk)':>6}  {'delta':>7}  "
        f"{'replay s':>8}"
    )
    rows = []
    for cpu_blocks, disk, cp, dp in configs:
        full = replay_trace(reqs, cpu_blocks, disk, cp, dp)
        # The full spec with spill_watermark 0 writes every stored block to
        # disk at once: the write-through policy vLLM's tiering imposes.
        wt = replay_trace(reqs, cpu_blocks, disk, cp, dp, spill_watermark=0.0)
        tier = replay_tiering(reqs, cpu_blocks, disk, cp, dp, args.disk_dir)
        rows.append(
            {
                "cpu_blocks": cpu_blocks,
                "disk_blocks": disk,
                "disk_mult": disk // cpu_blocks,
                "policy": cp,
                "full_spec": {
                    "hit_rate": full.hit_rate,
                    "hit_rate_cpu": full.hit_rate_cpu,
                    "hit_rate_disk": full.hit_rate_disk,
                    "spill_watermark": full.spill_watermark,
                    "stores_declined": full.stores_declined,
                    "disk_writes": full.spills,
                    "promotions": full.promotions,
                },
                "full_spec_write_through": {
                    "hit_rate": wt.hit_rate,
                    "hit_rate_cpu": wt.hit_rate_cpu,
                    "hit_rate_disk": wt.hit_rate_disk,
                    "spill_watermark": wt.spill_watermark,
                    "disk_writes": wt.spills,
                    "promotions": wt.promotions,
                },
                "tiering": tier,
                "delta": tier["hit_rate"] - full.hit_rate,
            }
        )
        print(
            f"{cp:<7}{disk:>7}  {full.hit_rate:>9.4f} {full.hit_rate_cpu:>6.4f} "
            f"{full.hit_rate_disk:>6.4f}  {wt.hit_rate:>6.4f}  {tier['hit_rate']:>8.4f} "
            f"{tier['hit_rate_cpu']:>6.4f} {tier['hit_rate_disk']:>6.4f}  "
            f"{rows[-1]['delta']:>+7.4f}  {tier['replay_s']:>8.1f}",
            flush=True,
        )
    path = write_json(
        "tiering_hit_rate",
        {
            "params": {
                "trace": args.trace,
                "requests": len(trace),
                "blocks": sum(map(len, reqs)),
                "cpu_blocks": cpu,
                "disk_mults": args.mults,
                "policies": "same policy on the CPU and disk tier",
                "hit_rate": "block-level: hit blocks / all blocks of all requests",
                "tiering_row_bytes": ROW_BYTES,
            },
            "infinite_hit_rate": bound,
            "rows": rows,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
