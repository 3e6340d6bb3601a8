"""How long a connector reset waits for the disk: spills queued behind the
I/O threads cancelled (``cancel``, what ``reset_cache`` does) next to all
of them written first (``drain``, the baseline: what it did before), in
the same run, interleaved.

    .venv/bin/python benchmarks/reset_spills.py [--dir /var/tmp]
        [--queued-mib 512] [--block-kib 256] [--job-blocks 32] [--threads 4]
        [--settle-ms 100] [--write-mbps N] [--repeats 3] [--modes inproc,child]

A reset forgets every block, and a spill must finish before its CPU row
can be reused, so the reset's engine step waits for the spills in flight.
Spills are ordered ahead of need (everything dirty over
``spill_watermark``), so on a drive slower than the stores a CPU tier's
worth of them can be queued; waiting for all of them held the engine for
queued bytes / drive write rate, and past the drain's 60 s bound stopped
the disk tier for good.

Each case: a fresh ``DiskStore`` and ``DiskRuntime`` (``--threads`` I/O
threads) over a CPU tier file made and attached as the worker and the
scheduler side do; ``--queued-mib`` of spills submitted in jobs of
``--job-blocks`` blocks; ``--settle-ms`` later (the I/O threads are
writing then, as when a reset comes while spills run), timed, ``cancel_queued()`` + ``drain()``
(``cancel``) or ``drain()`` alone (``drain``). ``inproc``: the jobs on
threads of this process (``disk_spill_process: off``); ``child``: in the
spill process, running before the jobs are submitted. ``--write-mbps N``
(root, cgroup I/O controller) limits the drive's O_DIRECT writes, as a
slower drive. Reported per case (median of ``--repeats``): the wait, the
blocks written (before the reset and during its wait) and those
cancelled. Prints a table and
writes benchmarks/results/reset_spills.json.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._common import (  # noqa: E402
    SpillRig,
    filesystem_of,
    io_throttle,
    write_json,
)
from kvtier.tiers.plans import SpillOrder  # noqa: E402

CASES = ("cancel", "drain")
START_TIMEOUT_S = 60.0


def one_reset(
    base: str,
    mode: str,
    case: str,
    block: int,
    blocks: int,
    job_blocks: int,
    threads: int,
    settle_s: float,
) -> dict[str, Any]:
    """Queue ``blocks`` blocks of spills, then time the reset's wait."""
    directory = tempfile.mkdtemp(prefix="reset-spills-", dir=base)
    # One slot more than the queue: the spill that starts the child.
    try:
        rig = SpillRig(
            directory, block, blocks, blocks + 1, threads, mode == "child", "reset"
        )
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    runtime = rig.runtime
    try:
        job = 0
        if mode == "child":
            # The first job starts the child; later ones go to it once ready.
            runtime.submit_spill(SpillOrder(0, [(b"start", 0, blocks)]))
            rig.wait_for_spill_process(START_TIMEOUT_S)
            runtime.drain(START_TIMEOUT_S)
            runtime.poll()
        for first in range(0, blocks, job_blocks):
            job += 1
            items = [
                (i.to_bytes(8, "big") + b"reset", i, i)
                for i in range(first, min(blocks, first + job_blocks))
            ]
            runtime.submit_spill(SpillOrder(job, items))
        time.sleep(settle_s)
        t0 = time.perf_counter()
        if case == "cancel":
            runtime.cancel_queued()
        if not runtime.drain(600):
            raise RuntimeError("the drain timed out")
        wait = time.perf_counter() - t0
        done = runtime.poll()
        if len(done) != job:
            raise RuntimeError(f"{len(done)} of {job} jobs answered")
        failed = sum(len(j.lost_keys) - len(j.cancelled_keys) for j in done)
        if failed:
            raise RuntimeError(f"{failed} blocks failed (not cancelled)")
        if mode == "child" and runtime.spill_pid is None:
            raise RuntimeError("the spill process is gone")
        cancelled = sum(len(j.cancelled_keys) for j in done)
        return {
            "wait_s": wait,
            "written_blocks": blocks - cancelled,
            "cancelled_blocks": cancelled,
        }
    finally:
        rig.close()
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="where the disk tier goes")
    ap.add_argument("--queued-mib", type=int, default=512)
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--job-blocks", type=int, default=32)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--settle-ms", type=float, default=100.0)
    ap.add_argument("--write-mbps", type=float, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="inproc,child")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    block = args.block_kib << 10
    blocks = (args.queued_mib << 20) // block
    modes = args.modes.split(",")
    throttle: Any = contextlib.nullcontext()
    if args.write_mbps:
        throttle = io_throttle(args.dir, int(args.write_mbps * 1e6), "write")
    runs: dict[str, list[dict[str, Any]]] = {}
    with throttle:
        for r in range(args.repeats):
            order = [(m, c) for m in modes for c in CASES]
            shift = r % len(order)
            for mode, case in order[shift:] + order[:shift]:
                row = one_reset(
                    args.dir,
                    mode,
                    case,
                    block,
                    blocks,
                    args.job_blocks,
                    args.threads,
                    args.settle_ms / 1e3,
                )
                runs.setdefault(f"{mode} {case}", []).append(row)
                print(f"  round {r} {mode} {case}: {row['wait_s']:.3f} s", flush=True)
    summary = {
        name: {
            "wait_s": statistics.median(x["wait_s"] for x in rows),
            "wait_s_max": max(x["wait_s"] for x in rows),
            "written_blocks": statistics.median(x["written_blocks"] for x in rows),
            "cancelled_blocks": statistics.median(x["cancelled_blocks"] for x in rows),
        }
        for name, rows in runs.items()
    }
    print(
        f"\n{blocks} blocks of {args.block_kib} KiB queued ({args.queued_mib} MiB), "
        f"{args.threads} threads, writes "
        + (f"limited to {args.write_mbps:g} MB/s" if args.write_mbps else "unlimited")
    )
    print(f"{'case':<16}{'wait s (median / max)':>24}{'written':>10}{'cancelled':>11}")
    for name, s in summary.items():
        print(
            f"{name:<16}{s['wait_s']:>14.3f} / {s['wait_s_max']:<7.3f}"
            f"{s['written_blocks']:>10.0f}{s['cancelled_blocks']:>11.0f}"
        )
    path = write_json(
        "reset_spills",
        {
            "queued_mib": args.queued_mib,
            "block_bytes": block,
            "blocks": blocks,
            "job_blocks": args.job_blocks,
            "settle_ms": args.settle_ms,
            "threads": args.threads,
            "write_mbps": args.write_mbps,
            "dir_fs": filesystem_of(args.dir),
            "repeats": args.repeats,
            "summary": summary,
            "runs": runs,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
