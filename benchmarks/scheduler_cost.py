"""Scheduler-side cost per block: kvtier's TierHierarchy vs vLLM's
CPUOffloadingManager, replaying the same Mooncake trace in the same run.

    .venv/bin/python benchmarks/scheduler_cost.py [--trace FILE] [--cpu-blocks 2000]
        [--disk-mult 5] [--repeats 7] [--disk-repeats 3] [--limit N]

Three configurations see the identical request sequence and the identical
keys (vLLM ``OffloadKey``s: ``make_offload_key(hash_id.to_bytes(32, "big"),
0)``): kvtier CPU-only, kvtier CPU+disk (disk = ``--disk-mult`` x CPU) and
vLLM's ``CPUOffloadingManager`` (LRU, events on) at the same CPU capacity.
Per request: prefix lookup one key at a time, load of the hits
(prepare_load/complete_load), store of the rest (prepare_store/
complete_store), draining of events; kvtier CPU+disk also loads disk hits
and completes spills instantly, exactly as ``kvtier.tools.sizing.TraceReplayer``
(the replay behind ``kvtier size``) does: the kvtier runs *are* that
replayer, with a timer around each hierarchy call. vLLM's per-request
``on_new_request``/``on_request_finished`` are timed as "request
bookkeeping".

Reported: microseconds per block for each operation (time of all calls /
blocks passed to them; for lookup, per key looked up), median and minimum
over interleaved runs, and the ratio kvtier / vLLM as the median of the
per-run ratios of back-to-back runs (robust to background load). Prints a table and
writes benchmarks/results/scheduler_cost.json.

Slow spills (issue 11), ``--slow-spill-lag K [--slow-spill-cpu-blocks N]``:
the same replay through kvtier CPU+disk, once with instant spills and once
with a disk that falls behind (each spill order completes only K requests
after it was issued, so the CPU tier fills with dirty and in-flight
blocks and stores are declined). Reports microseconds per scheduler call
(prepare_store, prepare_load, ...) and per request step (all hierarchy
calls of one request: mean, p99, max) for both, and writes
benchmarks/results/scheduler_cost_slow_spill.json. ``--slow-spill-only``
skips the vLLM comparison (no vLLM needed).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is on the path, not ROOT
    sys.path.insert(0, str(ROOT))

from benchmarks._common import DEFAULT_CPU_BLOCKS, DEFAULT_TRACE, write_json  # noqa: E402
from kvtier.tiers.hierarchy import TierHierarchy  # noqa: E402
from kvtier.tools.sizing import TraceReplayer, replay_trace  # noqa: E402
from kvtier.tools.trace import load_trace  # noqa: E402

ns = time.perf_counter_ns
COMMON_OPS = (
    "lookup",
    "prepare_load",
    "complete_load",
    "prepare_store",
    "complete_store",
    "take_events",
)


class OpTimes:
    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self.blocks: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def add(self, op: str, elapsed: int, blocks: int) -> None:
        self.ns[op] += elapsed
        self.blocks[op] += blocks
        self.calls[op] += 1

    def us_per_block(self, op: str) -> float | None:
        b = self.blocks.get(op, 0)
        return self.ns[op] / b / 1000 if b else None


class TimedHierarchy(TierHierarchy):
    """TierHierarchy with a timer around each call the replay makes."""

    times: OpTimes

    def _timed(self, op: str, blocks: int, fn: Any, *args: Any) -> Any:
        t0 = ns()
        out = fn(*args)
        self.times.add(op, ns() - t0, blocks)
        return out

    def prepare_load(self, keys):  # type: ignore[override]
        return self._timed("prepare_load", len(keys), super().prepare_load, keys)

    def complete_load(self, load_id, failed=()):  # type: ignore[override]
        n = len(self._loads[load_id].keys)
        return self._timed("complete_load", n, super().complete_load, load_id, failed)

    def prepare_store(self, keys):  # type: ignore[override]
        return self._timed("prepare_store", len(keys), super().prepare_store, keys)

    def complete_store(self, keys, success=True):  # type: ignore[override]
        keys = list(keys)
        return self._timed(
            "complete_store", len(keys), super().complete_store, keys, success
        )

    def take_spills(self):  # type: ignore[override]
        t0 = ns()
        orders = super().take_spills()
        self.times.add("spill", ns() - t0, sum(len(o.items) for o in orders))
        return orders

    def complete_spill(self, job_id, lost_keys=()):  # type: ignore[override]
        return self._timed("spill", 0, super().complete_spill, job_id, lost_keys)


class TimedReplayer(TraceReplayer):
    """The sizing replayer; lookup is timed per request (one key at a time)
    and events are drained after each request, as the connector does."""

    def __init__(self, h: TimedHierarchy) -> None:
        super().__init__(h)
        self.times = h.times

    def lookup(self, keys: Sequence[Hashable]) -> tuple[int, list[Hashable]]:
        t0 = ns()
        n, on_disk = super().lookup(keys)
        self.times.add("lookup", ns() - t0, min(n + 1, len(keys)))
        return n, on_disk

    def replay(self, keys: Sequence[Hashable]) -> None:
        super().replay(keys)
        t0 = ns()
        self.h.take_events()
        self.times.add("take_events", ns() - t0, len(keys))


def run_kvtier(
    reqs: list[list[bytes]], cpu: int, disk: int
) -> tuple[OpTimes, dict[str, Any]]:
    h = TimedHierarchy(cpu, disk)
    h.times = OpTimes()
    rep = TimedReplayer(h)
    gc.collect()
    for keys in reqs:
        rep.replay(keys)
    res = rep.finish()
    return h.times, {
        "hit_rate": res.hit_rate,
        "hit_rate_cpu": res.hit_rate_cpu,
        "hit_rate_disk": res.hit_rate_disk,
        "hit_blocks": res.hit_blocks,
    }


class SlowSpillReplayer(TimedReplayer):
    """The timed replayer with a disk that falls behind: every spill order
    completes ``lag`` requests after it was issued (0: at once)."""

    def __init__(self, h: TimedHierarchy, lag: int) -> None:
        super().__init__(h)
        self.lag = lag
        self.request = 0
        self.in_flight: list[tuple[int, int]] = []  # (due request, job id)
        self.step_ns: list[int] = []

    def drain_spills(self) -> None:
        due = self.request + self.lag
        self.in_flight.extend((due, o.job_id) for o in self.h.take_spills())
        self._complete_due()

    def _complete_due(self) -> None:
        done = 0
        for due, job_id in self.in_flight:
            if due > self.request:
                break
            self.h.complete_spill(job_id)
            done += 1
        del self.in_flight[:done]

    def replay(self, keys: Sequence[Hashable]) -> None:
        before = sum(self.times.ns.values())
        self._complete_due()
        super().replay(keys)
        self.step_ns.append(sum(self.times.ns.values()) - before)
        self.request += 1


def run_slow_spill(
    reqs: list[list[bytes]], cpu: int, disk: int, lag: int
) -> dict[str, Any]:
    h = TimedHierarchy(cpu, disk)
    h.times = OpTimes()
    rep = SlowSpillReplayer(h, lag)
    gc.collect()
    t0 = time.perf_counter()
    for keys in reqs:
        rep.replay(keys)
    wall = time.perf_counter() - t0
    res = rep.finish()
    t = h.times
    steps = sorted(rep.step_ns)
    return {
        "lag_requests": lag,
        "us_per_call": {
            op: t.ns[op] / t.calls[op] / 1000 for op in sorted(t.calls) if t.calls[op]
        },
        "calls": dict(t.calls),
        "step_us_mean": sum(steps) / len(steps) / 1000,
        "step_us_p99": steps[int(0.99 * (len(steps) - 1))] / 1000,
        "step_us_max": steps[-1] / 1000,
        "stores_declined": h.stats.stores_declined,
        "spills_completed": h.stats.spills_completed,
        "victim_candidates_inspected": {
            "cpu": h.cpu.index.inspected,
            "disk": h.disk.index.inspected if h.disk is not None else None,
        },
        "hit_rate": res.hit_rate,
        "wall_s": wall,
    }


def slow_spill_main(args: argparse.Namespace, reqs: list[list[Any]]) -> None:
    cpu = args.slow_spill_cpu_blocks
    disk = cpu * args.disk_mult
    rows = [run_slow_spill(reqs, cpu, disk, lag) for lag in (0, args.slow_spill_lag)]
    ops = ("prepare_store", "complete_store", "prepare_load", "complete_load", "spill")
    print(
        f"\nslow spills: {len(reqs)} requests; CPU {cpu} blocks, disk {disk} blocks;"
        " us per scheduler call"
    )
    print(f"{'':<22}" + "".join(f"{'lag ' + str(r['lag_requests']):>14}" for r in rows))
    for op in ops:
        cells = "".join(
            f"{r['us_per_call'].get(op, float('nan')):>14.1f}" for r in rows
        )
        print(f"{op:<22}{cells}")
    for k in ("step_us_mean", "step_us_p99", "step_us_max"):
        print(
            f"{k.replace('_us', ' us'):<22}" + "".join(f"{r[k]:>14.1f}" for r in rows)
        )
    for k in ("stores_declined", "spills_completed"):
        print(f"{k:<22}" + "".join(f"{r[k]:>14}" for r in rows))
    insp = [r["victim_candidates_inspected"] for r in rows]
    print(
        f"{'candidates inspected':<22}"
        + "".join(f"{str(i['cpu']) + '/' + str(i['disk']):>14}" for i in insp)
    )
    path = write_json(
        "scheduler_cost_slow_spill",
        {
            "params": {
                "trace": args.trace,
                "requests": len(reqs),
                "cpu_blocks": cpu,
                "disk_blocks": disk,
                "lag": "a spill order completes this many requests after issue",
                "unit": "microseconds per call; step = all calls of one request",
            },
            "rows": rows,
        },
        args.slow_spill_out,
    )
    print(f"wrote {path}")


def run_vllm(
    reqs: list[list[bytes]], cpu: int, policy: str = "lru"
) -> tuple[OpTimes, dict[str, Any]]:
    """vLLM's manager driven as its OffloadingConnector scheduler drives it."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    m = CPUOffloadingManager(num_chunks=cpu, cache_policy=policy, enable_events=True)
    t = OpTimes()
    hits = blocks = 0
    HIT = LookupResult.HIT
    gc.collect()
    for i, keys in enumerate(reqs):
        ctx = ReqContext(req_id=str(i))
        t0 = ns()
        m.on_new_request(ctx)
        t.add("request_bookkeeping", ns() - t0, 0)

        t0 = ns()
        n = 0
        for key in keys:
            if m.lookup(key, ctx) is not HIT:
                break
            n += 1
        t.add("lookup", ns() - t0, min(n + 1, len(keys)))

        if n:
            hit = keys[:n]
            t0 = ns()
            m.prepare_load(hit, ctx)
            t.add("prepare_load", ns() - t0, n)
            t0 = ns()
            m.complete_load(hit, ctx)
            t.add("complete_load", ns() - t0, n)
        rest = keys[n:]
        if rest:
            t0 = ns()
            out = m.prepare_store(rest, ctx)
            t.add("prepare_store", ns() - t0, len(rest))
            if out is not None and out.keys_to_store:
                t0 = ns()
                m.complete_store(out.keys_to_store, ctx)
                t.add("complete_store", ns() - t0, len(out.keys_to_store))
        t0 = ns()
        m.on_request_finished(ctx)
        t.add("request_bookkeeping", ns() - t0, len(keys))
        t0 = ns()
        list(m.take_events())
        t.add("take_events", ns() - t0, len(keys))
        hits += n
        blocks += len(keys)
    return t, {"hit_rate": hits / blocks, "hit_blocks": hits}


def timer_overhead_ns(n: int = 200_000) -> float:
    """Cost of one empty timed region (two clock reads + bookkeeping)."""
    t = OpTimes()
    t0 = ns()
    for _ in range(n):
        t1 = ns()
        t.add("x", ns() - t1, 0)
    return (ns() - t0) / n


def total_us_per_block(t: OpTimes, nblocks: int) -> float:
    return sum(t.ns.values()) / nblocks / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--cpu-blocks", type=int, default=DEFAULT_CPU_BLOCKS)
    ap.add_argument("--disk-mult", type=int, default=5)
    ap.add_argument(
        "--repeats", type=int, default=7, help="runs of the CPU-only configurations"
    )
    ap.add_argument(
        "--disk-repeats", type=int, default=3, help="runs of kvtier CPU+disk (slow)"
    )
    ap.add_argument("--limit", type=int, default=None, help="first N requests only")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--slow-spill-lag",
        type=int,
        default=0,
        help="also replay with spills completing K requests late (0: skip)",
    )
    ap.add_argument("--slow-spill-cpu-blocks", type=int, default=32768)
    ap.add_argument("--slow-spill-only", action="store_true")
    ap.add_argument("--slow-spill-out", default=None)
    args = ap.parse_args()

    if args.slow_spill_only:
        trace = load_trace(args.trace, limit=args.limit)
        reqs = [[h.to_bytes(32, "big") for h in r.hash_ids] for r in trace]
        slow_spill_main(args, reqs)
        return

    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: F401

    trace = load_trace(args.trace, limit=args.limit)
    reqs = [
        [make_offload_key(h.to_bytes(32, "big"), 0) for h in r.hash_ids] for r in trace
    ]
    nblocks = sum(len(k) for k in reqs)
    cpu, disk = args.cpu_blocks, args.cpu_blocks * args.disk_mult
    # Same sequence as `kvtier size`: the timed replay must count the same hits.
    expect = {
        "kvtier_cpu": replay_trace(reqs, cpu, 0).hit_blocks,
        "kvtier_cpu_disk": replay_trace(reqs, cpu, disk).hit_blocks,
    }

    configs = {
        "kvtier_cpu": lambda: run_kvtier(reqs, cpu, 0),
        "kvtier_cpu_disk": lambda: run_kvtier(reqs, cpu, disk),
        "vllm_cpu": lambda: run_vllm(reqs, cpu),
    }
    runs: dict[str, list[OpTimes]] = defaultdict(list)
    hit: dict[str, dict[str, Any]] = {}
    wall: dict[str, list[float]] = defaultdict(list)
    wanted = {"kvtier_cpu_disk": args.disk_repeats}
    for rep in range(max(args.repeats, args.disk_repeats)):
        for name, fn in configs.items():
            if rep >= wanted.get(name, args.repeats):
                continue
            t0 = time.perf_counter()
            times, h = fn()
            wall[name].append(time.perf_counter() - t0)
            runs[name].append(times)
            hit[name] = h
            if name in expect and h["hit_blocks"] != expect[name]:
                raise SystemExit(f"{name}: timed replay diverged from replay_trace")
            print(f"run {rep + 1} {name}: {wall[name][-1]:.2f} s", flush=True)

    ops = COMMON_OPS + ("spill", "request_bookkeeping")
    result: dict[str, Any] = {}
    for name, tlist in runs.items():
        per_op = {}
        for op in ops:
            vals = [v for v in (t.us_per_block(op) for t in tlist) if v is not None]
            if vals:
                per_op[op] = {
                    "us_per_block": statistics.median(vals),
                    "us_per_block_min": min(vals),
                    "blocks": tlist[0].blocks[op],
                    "calls": tlist[0].calls[op],
                }
            elif any(t.calls.get(op) for t in tlist):
                # Calls that moved no blocks (e.g. no spill ever ordered).
                per_op[op] = {
                    "us_per_block": None,
                    "blocks": 0,
                    "calls": tlist[0].calls[op],
                }
        totals = [total_us_per_block(t, nblocks) for t in tlist]
        result[name] = {
            "ops": per_op,
            "total_us_per_trace_block": statistics.median(totals),
            "total_us_per_trace_block_min": min(totals),
            "runs": len(tlist),
            "wall_s_median": statistics.median(wall[name]),
            **hit[name],
        }

    def paired_ratio(cfg: str, op: str) -> float | None:
        """Median over repeats of kvtier / vLLM from back-to-back runs, which
        cancels most of the drift in background load on a shared machine."""
        vals = []
        for kv, vl in zip(runs[cfg], runs["vllm_cpu"]):
            if op == "total":
                vals.append(
                    total_us_per_block(kv, nblocks) / total_us_per_block(vl, nblocks)
                )
                continue
            x, y = kv.us_per_block(op), vl.us_per_block(op)
            if x and y:
                vals.append(x / y)
        return statistics.median(vals) if vals else None

    ratios = {
        cfg: {op: paired_ratio(cfg, op) for op in (*COMMON_OPS, "total")}
        for cfg in ("kvtier_cpu", "kvtier_cpu_disk")
    }

    def f(v: float | None, fmt: str = "8.3f") -> str:
        return format(v, fmt) if v is not None else f"{'-':>8}"

    print(
        f"\ntrace {args.trace}: {len(reqs)} requests, {nblocks} blocks; CPU {cpu} blocks, "
        f"disk {disk} blocks; us per block, median of {args.repeats} runs "
        f"({args.disk_repeats} for cpu+disk); ratio = median of paired runs"
    )
    print(
        f"{'op':<20} {'kvtier cpu':>10} {'vLLM cpu':>10} {'ratio':>7}   "
        f"{'kvtier cpu+disk':>15} {'ratio':>7}"
    )
    for op in ops + ("total",):
        if op == "total":
            a = result["kvtier_cpu"]["total_us_per_trace_block"]
            b = result["vllm_cpu"]["total_us_per_trace_block"]
            c = result["kvtier_cpu_disk"]["total_us_per_trace_block"]
            label = "total per trace blk"
        else:
            a = result["kvtier_cpu"]["ops"].get(op, {}).get("us_per_block")
            b = result["vllm_cpu"]["ops"].get(op, {}).get("us_per_block")
            c = result["kvtier_cpu_disk"]["ops"].get(op, {}).get("us_per_block")
            label = op
        r1 = ratios["kvtier_cpu"].get(op) if op in COMMON_OPS or op == "total" else None
        r2 = (
            ratios["kvtier_cpu_disk"].get(op)
            if op in COMMON_OPS or op == "total"
            else None
        )
        print(
            f"{label:<20} {f(a, '10.3f')} {f(b, '10.3f')} {f(r1, '7.2f')}   "
            f"{f(c, '15.3f')} {f(r2, '7.2f')}"
        )
    print(
        "hit rate: " + ", ".join(f"{k} {v['hit_rate']:.4f}" for k, v in result.items())
    )
    path = write_json(
        "scheduler_cost",
        {
            "params": {
                "trace": args.trace,
                "requests": len(reqs),
                "blocks": nblocks,
                "cpu_blocks": cpu,
                "disk_blocks": disk,
                "repeats": args.repeats,
                "disk_repeats": args.disk_repeats,
                "unit": "microseconds per block (median and min over repeats)",
                "ratio": "median over repeats of kvtier/vLLM from back-to-back runs",
                "timer_overhead_ns_per_timed_call": timer_overhead_ns(),
                "vllm_manager": "vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager"
                "(cache_policy='lru', enable_events=True)",
            },
            "results": result,
            "ratio_kvtier_over_vllm": ratios,
        },
        args.out,
    )
    print(f"wrote {path}")
    if args.slow_spill_lag:
        slow_spill_main(args, reqs)


if __name__ == "__main__":
    main()
