"""Hit rate of CPU-only vs CPU+disk tiers on the shared Mooncake trace.

    .venv/bin/python benchmarks/hit_rate.py [--trace FILE] [--cpu-blocks 2000]
        [--mults 5 10 20] [--jobs 2] [--no-vllm]

Replays the trace through kvtier's TierHierarchy (``kvtier.sizing``, the
replay behind ``kvtier size``) with a CPU tier of ``--cpu-blocks`` 512-token
blocks, alone and over a disk tier of 5x, 10x and 20x that capacity, for
every LRU/ARC choice per tier, next to the infinite-cache bound. As a cross-
check it also replays vLLM's own CPUOffloadingManager (LRU and ARC) at the
same CPU capacity. Prints a table, writes benchmarks/results/hit_rate.json
and the plot benchmarks/results/hit_rate.png.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from _common import DEFAULT_CPU_BLOCKS, DEFAULT_TRACE, RESULTS_DIR, write_json

from kvtier.sizing import (
    SizingResult,
    infinite_cache_hit_rate,
    load_trace,
    replay_trace,
    unique_blocks,
)
from kvtier.sizing_plot import plot_tier_split

_TRACE: list[Any] = []


def _init(path: str) -> None:
    _TRACE[:] = load_trace(path)


def _replay(cfg: tuple[int, int, str, str]) -> tuple[SizingResult, float]:
    cpu, disk, cpu_policy, disk_policy = cfg
    t0 = time.perf_counter()
    r = replay_trace(_TRACE, cpu, disk, cpu_policy, disk_policy)
    return r, time.perf_counter() - t0


def vllm_hit_rates(path: str, cpu: int) -> dict[str, float]:
    from scheduler_cost import run_vllm
    from vllm.v1.kv_offload.base import make_offload_key

    reqs = [
        [make_offload_key(h.to_bytes(32, "big"), 0) for h in r.hash_ids]
        for r in load_trace(path)
    ]
    return {p: run_vllm(reqs, cpu, p)[1]["hit_rate"] for p in ("lru", "arc")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--cpu-blocks", type=int, default=DEFAULT_CPU_BLOCKS)
    ap.add_argument("--mults", type=int, nargs="+", default=[5, 10, 20])
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM cross-check")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=str(RESULTS_DIR / "hit_rate.png"))
    args = ap.parse_args()

    trace = load_trace(args.trace)
    bound = infinite_cache_hit_rate(trace)
    n_unique = unique_blocks(trace)
    cpu = args.cpu_blocks
    policies = ("lru", "arc")
    cfgs = [(cpu, 0, p, "lru") for p in policies] + [
        (cpu, cpu * m, cp, dp)
        for m in args.mults
        for cp, dp in itertools.product(policies, policies)
    ]
    with ProcessPoolExecutor(
        args.jobs, initializer=_init, initargs=(args.trace,)
    ) as ex:
        done = list(ex.map(_replay, cfgs))
    results = [r for r, _ in done]
    vllm = {} if args.no_vllm else vllm_hit_rates(args.trace, cpu)

    rows = []
    for (r, secs), cfg in zip(done, cfgs):
        row = r.to_dict()
        row["disk_mult"] = r.disk_blocks // cpu
        row["replay_s"] = secs
        if cfg[1] == 0:
            row["disk_policy"] = None
        rows.append(row)

    print(
        f"trace {args.trace}: {len(trace)} requests, {results[0].blocks} blocks, "
        f"{n_unique} unique; infinite-cache hit rate {bound:.4f}; CPU tier {cpu} blocks "
        f"({cpu / n_unique:.1%} of unique blocks)"
    )
    print(
        f"{'cpu pol':<8}{'disk pol':<9}{'disk':>12}  {'hit rate':>8}  {'cpu':>6}  "
        f"{'disk':>6}  {'of bound':>8}  {'replay s':>8}"
    )
    for row in rows:
        disk = (
            f"{row['disk_blocks']} ({row['disk_mult']}x)" if row["disk_blocks"] else "-"
        )
        print(
            f"{row['cpu_policy']:<8}{row['disk_policy'] or '-':<9}{disk:>12}  "
            f"{row['hit_rate']:>8.4f}  {row['hit_rate_cpu']:>6.4f}  "
            f"{row['hit_rate_disk']:>6.4f}  {row['fraction_of_bound']:>8.1%}  "
            f"{row['replay_s']:>8.1f}"
        )
    for p, v in vllm.items():
        print(f"vLLM CPUOffloadingManager {p}, {cpu} blocks: hit rate {v:.4f}")

    panels: dict[str, list[SizingResult]] = {}
    for cp, dp in itertools.product(policies, policies):
        panels[f"CPU {cp.upper()}, disk {dp.upper()}"] = [
            r
            for r, cfg in zip(results, cfgs)
            if cfg[2] == cp and (cfg[1] == 0 or cfg[3] == dp)
        ]
    plot_tier_split(
        panels,
        args.plot,
        title=(
            f"Mooncake trace ({len(trace)} requests): block hit rate by tier, "
            f"CPU tier {cpu} blocks"
        ),
    )
    path = write_json(
        "hit_rate",
        {
            "params": {
                "trace": args.trace,
                "requests": len(trace),
                "blocks": results[0].blocks,
                "unique_blocks": n_unique,
                "cpu_blocks": cpu,
                "disk_mults": args.mults,
                "spill_watermark": 0.75,
                "hit_rate": "block-level: hit blocks / all blocks of all requests",
            },
            "infinite_hit_rate": bound,
            "rows": rows,
            "vllm_cpu_offloading_manager": vllm,
            "plot": os.path.relpath(args.plot, RESULTS_DIR.parent.parent),
        },
        args.out,
    )
    print(f"wrote {path} and {args.plot}")


if __name__ == "__main__":
    main()
