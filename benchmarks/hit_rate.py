"""Hit rate of every eviction policy against the offline optimum.

    .venv/bin/python benchmarks/hit_rate.py [--trace FILE] [--cpu-blocks 2000]
        [--mults 5 10 20] [--jobs 2] [--no-vllm] [--no-sweep]

Replays the trace through kvtier's TierHierarchy (``kvtier.tools.sizing``, the
replay behind ``kvtier size``) with a CPU tier of ``--cpu-blocks`` 512-token
blocks, alone (every policy) and over a disk tier of 5x, 10x and 20x that
capacity (every cpu/disk policy pair at 5x, the same policy on both tiers
and lru/2q at 10x and 20x), next to the offline optimum (Belady on prefix
hits, one tier of the total capacity: ``kvtier.tiers.optimum``),
clairvoyant references (LRU behind a perfect admission filter; the
most-used blocks of the whole trace; each block's true reuse rate, alone
and with its last use known) and the infinite cache. Then the *sweep*: the
trace cut into halves (first half for tuning, second for reporting; both
are shown), CPU-only tiers of 0.5x to 20x ``--cpu-blocks`` and CPU + disk
tiers of 0.5x to 20x of it, every policy against LRU and the optimum at
each size. As a cross-check it also replays vLLM's own
CPUOffloadingManager (LRU and ARC) at the same CPU capacity.
Prints tables, writes benchmarks/results/hit_rate.json and the plots
benchmarks/results/hit_rate.png (by tier) and hit_rate_sweep.png.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is on the path, not ROOT
    sys.path.insert(0, str(ROOT))

from benchmarks._common import (  # noqa: E402
    DEFAULT_CPU_BLOCKS,
    DEFAULT_TRACE,
    RESULTS_DIR,
    write_json,
)
from kvtier.testing.oracles import (  # noqa: E402
    oracle_admission_lru_hits,
    rate_oracle_hits,
    static_frequency_hits,
)
from kvtier.tiers.policy import policy_names  # noqa: E402
from kvtier.tools.sizing import SizingResult, replay_trace  # noqa: E402
from kvtier.tools.sizing_compare import trace_optimal_hit_rate  # noqa: E402
from kvtier.tools.sizing_plot import plot_tier_split  # noqa: E402
from kvtier.tools.trace import infinite_cache_hit_rate, load_trace, unique_blocks  # noqa: E402

_TRACE: list[Any] = []


def _init(path: str) -> None:
    _TRACE[:] = load_trace(path)


def _replay(cfg: tuple[int, int, str, str, str]) -> tuple[SizingResult, float]:
    cpu, disk, cpu_policy, disk_policy, part = cfg
    t0 = time.perf_counter()
    r = replay_trace(_part(part), cpu, disk, cpu_policy, disk_policy)
    return r, time.perf_counter() - t0


def _part(part: str) -> list[Any]:
    half = len(_TRACE) // 2
    return {"full": _TRACE, "first": _TRACE[:half], "second": _TRACE[half:]}[part]


SWEEP_MULTS = (0.5, 1, 2, 4, 8, 20)


def vllm_hit_rates(path: str, cpu: int) -> dict[str, float]:
    from vllm.v1.kv_offload.base import make_offload_key

    from benchmarks.scheduler_cost import run_vllm

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
    ap.add_argument("--no-sweep", action="store_true", help="skip the halves sweep")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=str(RESULTS_DIR / "hit_rate.png"))
    ap.add_argument("--sweep-plot", default=str(RESULTS_DIR / "hit_rate_sweep.png"))
    args = ap.parse_args()

    trace = load_trace(args.trace)
    _TRACE[:] = trace
    keys = [r.hash_ids for r in trace]
    bound = infinite_cache_hit_rate(trace)
    n_unique = unique_blocks(trace)
    cpu = args.cpu_blocks
    cfgs = [(cpu, 0, p, p, "full") for p in policy_names()]
    for i, m in enumerate(args.mults):
        pairs = (
            list(itertools.product(policy_names(), policy_names()))
            if i == 0
            else [(p, p) for p in policy_names()] + [("lru", "2q")]
        )
        cfgs += [(cpu, cpu * m, cp, dp, "full") for cp, dp in pairs]
    sweep_sizes: list[tuple[int, int]] = []
    if not args.no_sweep:
        sweep_sizes = [(max(1, int(cpu * m)), 0) for m in SWEEP_MULTS] + [
            (cpu, max(1, int(cpu * m))) for m in SWEEP_MULTS
        ]
        cfgs += [
            (c, d, p, p, part)
            for part in ("first", "second")
            for c, d in sweep_sizes
            for p in policy_names()
        ]
    with ProcessPoolExecutor(
        args.jobs, initializer=_init, initargs=(args.trace,)
    ) as ex:
        done = list(ex.map(_replay, cfgs))
    half = len(keys) // 2
    parts = {"full": keys, "first": keys[:half], "second": keys[half:]}
    optimum: dict[tuple[str, int], float] = {}
    for c, d, _, _, part in cfgs:
        if (part, c + d) not in optimum:
            optimum[part, c + d] = trace_optimal_hit_rate(parts[part], c + d)
    vllm = {} if args.no_vllm else vllm_hit_rates(args.trace, cpu)

    rows = []
    for (r, secs), cfg in zip(done, cfgs):
        row = r.to_dict()
        row["part"] = cfg[4]
        row["disk_mult"] = r.disk_blocks / cpu
        row["replay_s"] = secs
        row["optimal_hit_rate"] = optimum[cfg[4], r.cpu_blocks + r.disk_blocks]
        row["fraction_of_optimum"] = (
            r.hit_rate / row["optimal_hit_rate"] if row["optimal_hit_rate"] else 1.0
        )
        if cfg[1] == 0:
            row["disk_policy"] = None
        rows.append(row)
    full = [row for row in rows if row["part"] == "full"]

    print(
        f"trace {args.trace}: {len(trace)} requests, {sum(map(len, keys))} blocks, "
        f"{n_unique} unique; infinite-cache hit rate {bound:.4f}; CPU tier {cpu} blocks "
        f"({cpu / n_unique:.1%} of unique blocks)"
    )
    print(
        f"{'cpu pol':<8}{'disk pol':<9}{'disk':>13}  {'hit rate':>8}  {'cpu':>6}  "
        f"{'disk':>6}  {'optimum':>7}  {'of opt':>6}  {'of bound':>8}  {'replay s':>8}"
    )
    for row in full:
        disk = (
            f"{row['disk_blocks']} ({row['disk_mult']:.0f}x)"
            if row["disk_blocks"]
            else "-"
        )
        print(
            f"{row['cpu_policy']:<8}{row['disk_policy'] or '-':<9}{disk:>13}  "
            f"{row['hit_rate']:>8.4f}  {row['hit_rate_cpu']:>6.4f}  "
            f"{row['hit_rate_disk']:>6.4f}  {row['optimal_hit_rate']:>7.4f}  "
            f"{row['fraction_of_optimum']:>6.1%}  {row['fraction_of_bound']:>8.1%}  "
            f"{row['replay_s']:>8.1f}"
        )
    for p, v in vllm.items():
        print(f"vLLM CPUOffloadingManager {p}, {cpu} blocks: hit rate {v:.4f}")

    total = sum(map(len, keys))
    references = []
    print("\nclairvoyant references, one tier of the total capacity (hit rate)")
    print(
        f"{'blocks':>7}  {'optimum':>8}  {'oracle admission+LRU':>20}  {'static top-k':>12}"
        f"  {'rate':>6}  {'rate+last use':>13}"
    )
    for cap in sorted({row["cpu_blocks"] + row["disk_blocks"] for row in full}):
        ref = {
            "blocks": cap,
            "optimum": optimum["full", cap],
            "oracle_admission_lru": oracle_admission_lru_hits(keys, cap) / total,
            "static_top_k": static_frequency_hits(keys, cap) / total,
            "rate_oracle": rate_oracle_hits(keys, cap) / total,
            "rate_last_use_oracle": rate_oracle_hits(keys, cap, knows_last_use=True)
            / total,
        }
        references.append(ref)
        print(
            f"{cap:>7}  {ref['optimum']:>8.4f}  {ref['oracle_admission_lru']:>20.4f}  "
            f"{ref['static_top_k']:>12.4f}  {ref['rate_oracle']:>6.4f}  "
            f"{ref['rate_last_use_oracle']:>13.4f}"
        )

    sweep: dict[str, Any] = {}
    for part in ("first", "second") if sweep_sizes else ():
        print(f"\nsweep, {part} half of the trace (hit rate; optimum; vs LRU)")
        print(
            f"{'cpu':>6}{'disk':>7}  "
            + "".join(f"{p:>8}" for p in policy_names())
            + f"{'optimum':>9}"
        )
        table = []
        for c, d in sweep_sizes:
            by = {
                row["cpu_policy"]: row["hit_rate"]
                for row in rows
                if row["part"] == part
                and row["cpu_blocks"] == c
                and row["disk_blocks"] == d
            }
            table.append(
                {
                    "cpu_blocks": c,
                    "disk_blocks": d,
                    "optimum": optimum[part, c + d],
                    **by,
                }
            )
            print(
                f"{c:>6}{d:>7}  "
                + "".join(f"{by[p]:>8.4f}" for p in policy_names())
                + f"{optimum[part, c + d]:>9.4f}"
            )
        never_worse = {
            p: all(t[p] >= t["lru"] - 1e-12 for t in table) for p in policy_names()
        }
        print("never worse than LRU at any size:", never_worse)
        sweep[part] = {"sizes": table, "never_worse_than_lru": never_worse}

    panels: dict[str, list[SizingResult]] = {}
    for p in policy_names():
        panels[f"{p.upper()} on both tiers"] = [
            r
            for (r, _), cfg in zip(done, cfgs)
            if cfg[4] == "full" and cfg[2] == p and cfg[3] == p
        ]
    plot_tier_split(
        panels,
        args.plot,
        title=(
            f"Mooncake trace ({len(trace)} requests): block hit rate by tier, "
            f"CPU tier {cpu} blocks"
        ),
    )
    if sweep_sizes:
        _plot_sweep(sweep, sweep_sizes, args.sweep_plot, cpu)
    path = write_json(
        "hit_rate",
        {
            "params": {
                "trace": args.trace,
                "requests": len(trace),
                "blocks": sum(map(len, keys)),
                "unique_blocks": n_unique,
                "cpu_blocks": cpu,
                "disk_mults": args.mults,
                "sweep_mults": SWEEP_MULTS,
                "spill_watermark": 0.75,
                "hit_rate": "block-level: hit blocks / all blocks of all requests",
                "optimum": "offline Belady on prefix hits, one tier of cpu+disk blocks",
            },
            "infinite_hit_rate": bound,
            "rows": rows,
            "clairvoyant_references": references,
            "sweep": sweep,
            "vllm_cpu_offloading_manager": vllm,
            "plot": os.path.relpath(args.plot, RESULTS_DIR.parent.parent),
            "sweep_plot": os.path.relpath(args.sweep_plot, RESULTS_DIR.parent.parent),
        },
        args.out,
    )
    made = f" and {args.sweep_plot}" if sweep_sizes else ""
    print(f"wrote {path}, {args.plot}{made}")


def _plot_sweep(
    sweep: dict[str, Any], sizes: list[tuple[int, int]], out: str, cpu: int
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharey="row")
    for col, part in enumerate(("first", "second")):
        for row, with_disk in enumerate((False, True)):
            ax = axes[row][col]
            table = [
                t for t in sweep[part]["sizes"] if (t["disk_blocks"] > 0) == with_disk
            ]
            xs = [t["cpu_blocks"] + t["disk_blocks"] for t in table]
            for p in policy_names():
                ax.plot(xs, [t[p] for t in table], marker="o", ms=3, label=p)
            ax.plot(
                xs, [t["optimum"] for t in table], "k-.", label="optimum (one tier)"
            )
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
            ax.set_title(
                f"{part} half, "
                + (f"CPU {cpu} + disk (x = total blocks)" if with_disk else "CPU only"),
                fontsize=9,
            )
            ax.set_xlabel("total capacity (blocks)")
            ax.set_ylabel("block hit rate")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
