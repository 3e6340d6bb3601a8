"""Scheduler-call pauses as a tier grows: kvtier's hierarchy next to vLLM's
CPUOffloadingManager holding as many blocks, in the same run.

    .venv/bin/python benchmarks/tier_scale.py [--sizes 100000,300000,1000000]
        [--systems kvtier,kvtier-arcdk-2q,vllm] [--cpu-blocks 20000]
        [--churn 2] [--request-blocks 64] [--out FILE]

Every scheduler-side call is O(blocks touched), so the mean cost per block
does not grow with the tier (``scheduler_cost.py``). What does grow is the
rare long call: Python's dicts rebuild their table, O(entries), once their
insertions outnumber their live entries, and a tier that keeps evicting and
storing does that about once per tier-size of stores, in each of the dicts
that map its keys; the cyclic garbage collector's full passes walk every
object the tier holds. Both land inside whichever scheduler call happens to
trigger them, that is inside one engine step.

Per tier size N, each system runs in a fresh process: N + ``--cpu-blocks``
distinct blocks are stored (requests of ``--request-blocks`` new blocks:
lookup, store, events), then ``--churn`` x N more, each store evicting as
many old blocks. Only the churn requests are timed, one time per request
(all of its scheduler calls). kvtier: a CPU tier of ``--cpu-blocks`` over
a disk tier of N (LRU both, spills completed at once, as ``kvtier size``
replays them); kvtier-arcdk-2q: the same with the policies recommended
for hit rate (``arcdk`` on the CPU tier, ``2q`` on the disk tier); vLLM: ``CPUOffloadingManager`` of N chunks (LRU, events on),
as its OffloadingConnector's scheduler drives it. Garbage collection is on,
as in a serving engine, after ``gc.freeze()`` of the start-up heap (vLLM's
engine core freezes it too); the collector's own pauses are reported
beside the request times (``gc.callbacks``).

After the churn, one reset of the full tiers is timed with the drain of
events that follows it (kvtier: ``TierHierarchy.reset``, as the
connector's ``reset_cache`` runs it with no disk job in flight, then one
step's share of its removal events, which name every block; vLLM:
``reset_cache``, which announces no removal): what ``reset_prefix_cache()``
costs one engine step.

Prints a table and writes benchmarks/results/tier_scale.json: per system
and size, the request time's p50, p99, p99.9 and max (ms), the requests
over 10 and 100 ms, the longest collection and the reset.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is on the path, not ROOT
    sys.path.insert(0, str(ROOT))

from benchmarks._common import write_json  # noqa: E402

ns = time.perf_counter_ns


def _keys(start: int, n: int) -> list[bytes]:
    """vLLM OffloadKeys' shape: a 32-byte block hash and a 4-byte group."""
    return [
        (i * 2654435761 % 2**256).to_bytes(32, "big") + b"\0\0\0\0"
        for i in range(start, start + n)
    ]


# System -> (CPU tier policy, disk tier policy) of kvtier's runs: the
# default, and the pair docs/benchmarks.md recommends for hit rate.
KVTIER_POLICIES = {"kvtier": ("lru", "lru"), "kvtier-arcdk-2q": ("arcdk", "2q")}
SYSTEMS = (*KVTIER_POLICIES, "vllm")


def _kvtier(
    size: int, cpu_blocks: int, policies: tuple[str, str]
) -> tuple[Callable[[list[bytes]], None], Callable[[], None]]:
    from kvtier.tiers.events import EVENT_BACKLOG_PER_STEP
    from kvtier.tiers.hierarchy import TierHierarchy
    from kvtier.tools.sizing import TraceReplayer

    cpu_policy, disk_policy = policies
    replayer = TraceReplayer(
        TierHierarchy(cpu_blocks, size, cpu_policy=cpu_policy, disk_policy=disk_policy)
    )
    h = replayer.h

    def request(keys: list[bytes]) -> None:
        # TraceReplayer.replay's calls, without its hit accounting.
        n, _ = replayer.lookup(keys)
        replayer.load(keys[:n])
        replayer.store(keys[n:])
        h.take_events()

    def reset() -> None:
        # The connector's reset_cache (no disk jobs in flight here), then
        # the step's drain of its events: the removals of every block are
        # a backlog handed out EVENT_BACKLOG_PER_STEP keys a step.
        h.reset()
        h.take_events(EVENT_BACKLOG_PER_STEP)

    return request, reset


def _vllm(size: int) -> tuple[Callable[[list[bytes]], None], Callable[[], None]]:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    m = CPUOffloadingManager(num_chunks=size, cache_policy="lru", enable_events=True)
    hit = LookupResult.HIT
    ids = iter(range(1 << 62))

    def request(keys: list[bytes]) -> None:
        ctx = ReqContext(req_id=str(next(ids)))
        m.on_new_request(ctx)
        n = 0
        for key in keys:
            if m.lookup(key, ctx) is not hit:
                break
            n += 1
        if n:
            m.prepare_load(keys[:n], ctx)
            m.complete_load(keys[:n], ctx)
        out = m.prepare_store(keys[n:], ctx)
        if out is not None and out.keys_to_store:
            m.complete_store(out.keys_to_store, ctx)
        m.on_request_finished(ctx)
        list(m.take_events())

    def reset() -> None:
        m.reset_cache()
        list(m.take_events())

    return request, reset


def run_one(
    system: str, size: int, cpu_blocks: int, churn: float, per: int
) -> dict[str, Any]:
    """One system at one size, in this process: fill, then time the churn."""
    gc.collect()
    gc.freeze()  # the start-up heap, as vLLM's engine core freezes it
    if system in KVTIER_POLICIES:
        request, reset = _kvtier(size, cpu_blocks, KVTIER_POLICIES[system])
        fill = size + cpu_blocks
    else:
        request, reset = _vllm(size)
        fill = size
    t0 = time.monotonic()
    next_key = 0
    while next_key < fill:
        request(_keys(next_key, per))
        next_key += per
    fill_s = time.monotonic() - t0

    pauses: list[int] = []
    started = [0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = ns()
        elif info.get("generation") == 2:
            pauses.append(ns() - started[0])

    times: list[int] = []
    gc.callbacks.append(on_gc)
    try:
        for _ in range(int(churn * size) // per):
            keys = _keys(next_key, per)
            next_key += per
            t = ns()
            request(keys)
            times.append(ns() - t)
    finally:
        gc.callbacks.remove(on_gc)
    times.sort()
    t = ns()
    reset()
    reset_ns = ns() - t

    def pct(q: float) -> float:
        return times[min(len(times) - 1, int(q * len(times)))] / 1e6

    return {
        "system": system,
        "size": size,
        "requests": len(times),
        "fill_s": round(fill_s, 1),
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
        "p999_ms": pct(0.999),
        "max_ms": times[-1] / 1e6,
        "over_10ms": sum(t > 10_000_000 for t in times),
        "over_100ms": sum(t > 100_000_000 for t in times),
        "full_collections": len(pauses),
        "gc_max_ms": max(pauses, default=0) / 1e6,
        "reset_ms": reset_ns / 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100000,300000,1000000")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--cpu-blocks", type=int, default=20000)
    ap.add_argument("--churn", type=float, default=2.0)
    ap.add_argument("--request-blocks", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--one", nargs=2, metavar=("SYSTEM", "SIZE"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.one:
        system, size = args.one
        row = run_one(
            system, int(size), args.cpu_blocks, args.churn, args.request_blocks
        )
        print(json.dumps(row))
        return

    rows = []
    sizes = [int(s) for s in args.sizes.split(",")]
    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(
            f"--systems: unknown {sorted(unknown)}; accepted: {', '.join(SYSTEMS)}"
        )
    for i, size in enumerate(sizes):
        # Interleaved: each size runs the systems back to back, in an order
        # that rotates, each in a fresh process (its own heap).
        shift = i % len(systems)
        for system in systems[shift:] + systems[:shift]:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    system,
                    str(size),
                    "--cpu-blocks",
                    str(args.cpu_blocks),
                    "--churn",
                    str(args.churn),
                    "--request-blocks",
                    str(args.request_blocks),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(
                f"{system:15s} {size:>9,} blocks: p50 {row['p50_ms']:6.2f} ms  "
                f"p99 {row['p99_ms']:6.2f}  p99.9 {row['p999_ms']:7.2f}  "
                f"max {row['max_ms']:8.1f}  >10ms {row['over_10ms']:3d}  "
                f">100ms {row['over_100ms']:3d}  gc2 {row['full_collections']} "
                f"(max {row['gc_max_ms']:.0f} ms)  reset {row['reset_ms']:.0f} ms",
                flush=True,
            )
    path = write_json(
        "tier_scale",
        {
            "params": {
                "sizes": sizes,
                "cpu_blocks": args.cpu_blocks,
                "churn": args.churn,
                "request_blocks": args.request_blocks,
                "unit": "ms per request (all its scheduler calls), churn phase; "
                "reset_ms: one reset of the full tiers afterwards and the "
                "step's event drain (kvtier: TierHierarchy.reset, "
                "take_events(EVENT_BACKLOG_PER_STEP); vLLM: reset_cache)",
                "vllm_manager": "vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager"
                "(num_chunks=size, cache_policy='lru', enable_events=True)",
                "kvtier": "TierHierarchy(cpu_blocks, size), lru/lru, spills at once",
                "kvtier-arcdk-2q": "the same with cpu_policy arcdk, disk_policy 2q",
            },
            "results": rows,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
