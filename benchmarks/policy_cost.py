"""Scheduler-side cost of each eviction policy against vLLM's CPU manager.

    .venv/bin/python benchmarks/policy_cost.py [--trace FILE] [--cpu-blocks 2000]
        [--repeats 5] [--limit N]

The CPU-only run of ``benchmarks/scheduler_cost.py`` (same timed replayer,
same keys, same per-operation timers) once per policy in ``policy_names()``,
each back to back with a run of vLLM's ``CPUOffloadingManager`` (LRU, events
on) at the same capacity. Reported: total microseconds per trace block
(median) and the ratio to vLLM as the median of the paired per-run ratios;
the issue's limit is 1.2x. Writes benchmarks/results/policy_cost.json.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is on the path, not ROOT
    sys.path.insert(0, str(ROOT))

from benchmarks._common import DEFAULT_CPU_BLOCKS, DEFAULT_TRACE, write_json  # noqa: E402
from benchmarks.scheduler_cost import (  # noqa: E402
    OpTimes,
    TimedHierarchy,
    TimedReplayer,
    run_vllm,
    total_us_per_block,
)
from kvtier.tiers.policy import policy_names  # noqa: E402
from kvtier.tools.trace import load_trace  # noqa: E402


def run_policy(reqs: list, cpu: int, policy: str) -> tuple[float, float]:
    h = TimedHierarchy(cpu, 0, cpu_policy=policy)
    h.times = OpTimes()
    rep = TimedReplayer(h)
    gc.collect()
    for keys in reqs:
        rep.replay(keys)
    res = rep.finish()
    nblocks = sum(map(len, reqs))
    return total_us_per_block(h.times, nblocks), res.hit_rate


def main() -> None:
    from vllm.v1.kv_offload.base import make_offload_key

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--cpu-blocks", type=int, default=DEFAULT_CPU_BLOCKS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    reqs = [
        [make_offload_key(h.to_bytes(32, "big"), 0) for h in r.hash_ids]
        for r in load_trace(args.trace, limit=args.limit)
    ]
    nblocks = sum(map(len, reqs))
    us: dict[str, list[float]] = {p: [] for p in (*policy_names(), "vllm")}
    ratios: dict[str, list[float]] = {p: [] for p in policy_names()}
    hit: dict[str, float] = {}
    for _ in range(args.repeats):
        for p in policy_names():
            t_vllm, r = run_vllm(reqs, args.cpu_blocks, "lru")
            v = total_us_per_block(t_vllm, nblocks)
            k, hit[p] = run_policy(reqs, args.cpu_blocks, p)
            us["vllm"].append(v)
            us[p].append(k)
            ratios[p].append(k / v)
            hit["vllm"] = r["hit_rate"]
    print(
        f"CPU-only, {args.cpu_blocks} blocks, {len(reqs)} requests, {nblocks} blocks; "
        f"median of {args.repeats} paired runs"
    )
    print(f"{'policy':<8}{'us/block':>10}{'vs vLLM':>9}{'hit rate':>10}")
    for p in policy_names():
        print(
            f"{p:<8}{statistics.median(us[p]):>10.3f}"
            f"{statistics.median(ratios[p]):>9.2f}{hit[p]:>10.4f}"
        )
    print(
        f"{'vLLM':<8}{statistics.median(us['vllm']):>10.3f}{'':>9}{hit['vllm']:>10.4f}"
    )
    path = write_json(
        "policy_cost",
        {
            "params": {
                "trace": args.trace,
                "cpu_blocks": args.cpu_blocks,
                "repeats": args.repeats,
                "requests": len(reqs),
                "blocks": nblocks,
            },
            "us_per_block": {p: statistics.median(v) for p, v in us.items()},
            "ratio_to_vllm": {p: statistics.median(v) for p, v in ratios.items()},
            "hit_rate": hit,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
