"""Spill throughput while the process's main thread runs Python without a
pause, as a busy engine's loop does, next to the same spill with the main
thread waiting, in the same run.

    .venv/bin/python benchmarks/spill_busy_loop.py [--dir /path]
        [--blocks 256KiB,2MiB] [--total-mib 256] [--threads 4] [--repeats 3]

Spills run in the scheduler's process (``DiskRuntime``: a
``TransferEngine`` over ``DiskStore``), on ``disk_io_threads`` Python
threads, in batches (``DiskStore.write_blocks``): staged, hashed and
written by calls some of which let the interpreter lock go, and each time
a thread wants it back it waits for the main thread's next switch interval
(5 ms) when the main thread never blocks. An engine's loop blocks little while it is busy
(vLLM's engine core launches a step's kernels in Python; an in-process
engine spins even when idle), so what a spill gets there is the "busy"
column, not the "waiting" one.

Contenders, each with the main thread waiting (``wait``) and running a
Python loop until the spill is done (``busy``):

- ``kvtier``: ``TransferEngine.submit_spill`` of ``--total-mib`` of
  blocks from a CPU buffer into a fresh ``DiskStore`` (POSIX back end,
  O_DIRECT where the file system takes it), ``--threads`` threads;
- ``py pwrite``: the floor of any design that writes from Python threads
  one block per call: ``--threads`` threads each ``os.pwrite`` their share
  of the same blocks, aligned, into one file in the same directory
  (O_DIRECT likewise), no header, no checksum.

Rows and slots go in order (a fresh tier's spills: kvtier writes each run
of adjacent slots at once), or with ``--shuffle`` each in a random order
(a tier that churned: one write per block; py pwrite's offsets likewise).

Interleaved: every repeat runs the four (contender x main thread) in a
rotated order. What a spill costs the loop: its pace (rounds of work per
second) during each busy run, over its pace alone just before and just
after it (``loop_share``), and the loop time that took per GB spilled
(``loop_ms_lost_per_gb``). On a machine with few cores that includes the
spill threads' CPU work (copies, checksums), not only the lock.

Which of the two orders spills see in practice: the Mooncake trace is
replayed through the hierarchy (``kvtier size``'s replay, CPU 2,000 and
disk 10,000 blocks; ``--split 8`` replays it at blocks 8x finer, tiers 8x
larger) and every spill order it hands out is measured: its disk slots'
runs of adjacent slots, and how many of its CPU rows follow another. Prints a table and writes
benchmarks/results/spill_busy_loop.json (MB/s of payload, median of
``--repeats``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import DEFAULT_TRACE, write_json

from kvtier.host.cpu_tier import CpuBlockBuffer
from kvtier.store.backends.factory import make_backend
from kvtier.store.slot import LayoutFingerprint
from kvtier.store.store import DiskStore
from kvtier.store.transfers import TransferEngine

MIB = 1 << 20


def _size(text: str) -> int:
    text = text.strip()
    for unit, mult in (("KiB", 1 << 10), ("MiB", MIB)):
        if text.endswith(unit):
            return int(text[: -len(unit)]) * mult
    return int(text)


def _busy_until(done: Callable[[], bool]) -> int:
    """The main thread runs Python without blocking until ``done()``;
    returns the rounds of work it did meanwhile."""
    rounds = 0
    while not done():
        # ``done`` is asked once per 10 rounds (about 40 us), so what it
        # costs (a clock, a lock) barely weighs on the pace.
        for _ in range(10):
            for _ in range(200):
                pass
        rounds += 10
    return rounds


def _loop_rate(seconds: float = 0.5) -> float:
    """Rounds per second of ``_busy_until``'s loop with nothing beside it."""
    t0 = time.perf_counter()
    rounds = _busy_until(lambda: time.perf_counter() - t0 >= seconds)
    return rounds / (time.perf_counter() - t0)


class KvtierSpill:
    def __init__(
        self, directory: str, block: int, count: int, threads: int, shuffle: bool
    ):
        fp = LayoutFingerprint("bench", "bfloat16", block, f"busy-{block}", 0, 1)
        self.store = DiskStore(
            [directory], count, block, fp, backend=make_backend("posix")
        )
        self.buf = CpuBlockBuffer(count, block)
        rng = np.random.default_rng(0)
        self.buf.array[:] = rng.integers(0, 256, (count, block), dtype=np.uint8)
        self.engine = TransferEngine([self.store], [self.buf], threads=threads)
        self.count, self.job = count, 0
        # Rows and slots in order (a fresh tier's), or each in a random
        # order (a tier that churned: no two rows or slots adjacent).
        rng = np.random.default_rng(2)
        order = np.arange(count)
        self.rows = rng.permutation(order) if shuffle else order
        self.slots = rng.permutation(order) if shuffle else order

    def run(self, busy: bool) -> tuple[float, int]:
        self.job += 1
        items = [
            (b"k%d" % i, int(r), int(s))
            for i, (r, s) in enumerate(zip(self.rows, self.slots, strict=True))
        ]
        t0 = time.perf_counter()
        self.engine.submit_spill(self.job, items)
        rounds = 0
        if busy:
            rounds = _busy_until(lambda: not self.engine.pending())
        else:
            self.engine.wait([self.job])
        dt = time.perf_counter() - t0
        results = self.engine.get_finished()
        if not all(r.success for r in results):
            raise RuntimeError(f"kvtier spill failed: {results}")
        return dt, rounds

    def close(self) -> None:
        self.engine.shutdown()
        self.store.close()
        self.buf.close()


class PyPwrite:
    def __init__(
        self, directory: str, block: int, count: int, threads: int, shuffle: bool
    ):
        self.path = os.path.join(directory, "py-pwrite.dat")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            self.fd = os.open(self.path, flags | getattr(os, "O_DIRECT", 0), 0o600)
            self.direct = hasattr(os, "O_DIRECT")
        except OSError:
            self.fd = os.open(self.path, flags, 0o600)
            self.direct = False
        os.ftruncate(self.fd, block * count)
        area = mmap.mmap(-1, block * count)  # page-aligned, as O_DIRECT needs
        self.mm = np.frombuffer(area, dtype=np.uint8).reshape(count, block)
        self.mm[:] = np.random.default_rng(1).integers(
            0, 256, (count, block), dtype=np.uint8
        )
        self.block, self.count, self.threads = block, count, threads
        order = np.arange(count)
        self.offsets = np.random.default_rng(3).permutation(order) if shuffle else order

    def run(self, busy: bool) -> tuple[float, int]:
        left = [self.threads]
        lock = threading.Lock()

        def write(first: int) -> None:
            for i in range(first, self.count, self.threads):
                offset = int(self.offsets[i]) * self.block
                os.pwrite(self.fd, memoryview(self.mm[i]), offset)
            with lock:
                left[0] -= 1

        workers = [
            threading.Thread(target=write, args=(t,)) for t in range(self.threads)
        ]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        rounds = 0
        if busy:
            rounds = _busy_until(lambda: left[0] == 0)
        for w in workers:
            w.join()
        return time.perf_counter() - t0, rounds

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)


def trace_spill_runs(trace: str, split: int) -> dict[str, Any]:
    """Adjacency of the spill orders of a trace replay (see the module doc)."""
    from kvtier.tiers.hierarchy import TierHierarchy
    from kvtier.tools.sizing import TraceReplayer
    from kvtier.tools.trace import load_trace, request_keys

    h = TierHierarchy(2000 * split, 10000 * split)
    replayer = TraceReplayer(h)
    counts = {"blocks": 0, "runs": 0, "rows_following": 0}
    take = h.take_spills

    def measured() -> Any:
        orders = take()
        for order in orders:
            slots = sorted(item[2] for item in order.items)
            rows = sorted(item[1] for item in order.items)
            counts["blocks"] += len(slots)
            counts["runs"] += len(slots) - sum(
                b == a + 1 for a, b in zip(slots, slots[1:])
            )
            counts["rows_following"] += sum(b == a + 1 for a, b in zip(rows, rows[1:]))
        return orders

    h.take_spills = measured  # type: ignore[method-assign]
    for request in load_trace(trace):
        keys = request_keys(request)
        replayer.replay([(k, j) for k in keys for j in range(split)])
    return {
        "split": split,
        **counts,
        "blocks_per_run": counts["blocks"] / max(counts["runs"], 1),
        "rows_following_fraction": counts["rows_following"] / max(counts["blocks"], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to test")
    ap.add_argument("--blocks", default="256KiB,2MiB")
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--shuffle",
        action="store_true",
        help="rows and slots (offsets) in random order: no write covers two blocks",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    args = ap.parse_args()

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtier-busy-") as root:
        for block in (_size(b) for b in args.blocks.split(",")):
            count = args.total_mib * MIB // block
            kv_dir = os.path.join(root, f"kvtier-{block}")
            os.mkdir(kv_dir)
            rigs = {
                "kvtier": KvtierSpill(kv_dir, block, count, args.threads, args.shuffle),
                "py pwrite": PyPwrite(root, block, count, args.threads, args.shuffle),
            }
            try:
                for rig in rigs.values():
                    rig.run(busy=False)  # untimed: allocate the extents
                runs = [(name, busy) for name in rigs for busy in (False, True)]
                seconds: dict[tuple[str, bool], list[float]] = {r: [] for r in runs}
                # The busy loop's share of its own pace, kept during the spill.
                shares: dict[tuple[str, bool], list[float]] = {r: [] for r in runs}
                for rep in range(args.repeats):
                    k = rep % len(runs)
                    for name, busy in runs[k:] + runs[:k]:
                        before = _loop_rate() if busy else 0.0
                        dt, rounds = rigs[name].run(busy)
                        seconds[(name, busy)].append(dt)
                        if busy:
                            alone = (before + _loop_rate()) / 2
                            shares[(name, busy)].append(rounds / dt / alone)
                for name, busy in runs:
                    median_s = statistics.median(seconds[(name, busy)])
                    row = {
                        "contender": name,
                        "block_bytes": block,
                        "main_thread": "busy" if busy else "waiting",
                        "mb_s": round(count * block / median_s / 1e6, 1),
                        "runs_s": [round(s, 3) for s in seconds[(name, busy)]],
                    }
                    if busy:
                        share = statistics.median(shares[(name, busy)])
                        row["loop_share"] = round(share, 3)
                        # What the spill took from the loop, per GB written.
                        row["loop_ms_lost_per_gb"] = round(
                            median_s * (1 - share) * 1e3 / (count * block / 1e9), 1
                        )
                    rows.append(row)
            finally:
                for rig in rigs.values():
                    rig.close()
            for name in rigs:
                wait, busy = (
                    next(
                        r
                        for r in rows
                        if r["contender"] == name
                        and r["block_bytes"] == block
                        and r["main_thread"] == m
                    )
                    for m in ("waiting", "busy")
                )
                print(
                    f"{block // 1024:>6} KiB  {name:10s} waiting "
                    f"{wait['mb_s']:8.0f} MB/s   busy {busy['mb_s']:8.0f} MB/s   "
                    f"({busy['mb_s'] / wait['mb_s']:.2f}x); the loop kept "
                    f"{busy['loop_share']:.0%} of its pace, lost "
                    f"{busy['loop_ms_lost_per_gb']:.0f} ms per GB",
                    flush=True,
                )
    runs = []
    if os.path.exists(args.trace):
        for split in (1, 8):
            r = trace_spill_runs(args.trace, split)
            runs.append(r)
            print(
                f"trace replay, blocks 1/{split} of 512 tokens: spill orders' disk "
                f"slots in runs of {r['blocks_per_run']:.1f} adjacent slots; "
                f"{r['rows_following_fraction']:.0%} of CPU rows follow another",
                flush=True,
            )
    path = write_json(
        "spill_busy_loop",
        {
            "params": {
                "dir": args.dir or tempfile.gettempdir(),
                "total_mib": args.total_mib,
                "threads": args.threads,
                "repeats": args.repeats,
                "shuffle": args.shuffle,
                "unit": "MB/s of payload (10^6 B/s), median of repeats",
                "busy": "main thread runs a Python loop that never blocks "
                "until the spill is done",
                "loop_share": "the busy loop's rounds per second during the "
                "spill over its rate alone just before and after (mean), "
                "median of repeats",
                "loop_ms_lost_per_gb": "spill seconds x (1 - loop_share), "
                "per GB of payload: the loop's time the spill took",
            },
            "results": rows,
            "trace_spill_runs": runs,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
