"""Spill throughput while the process's main thread runs Python without a
pause, as a busy engine's loop does, next to the same spill with the main
thread waiting, in the same run.

    .venv/bin/python benchmarks/spill_busy_loop.py [--dir /path]
        [--blocks 256KiB,2MiB] [--total-mib 256] [--threads 4] [--repeats 3]

Spills run in the scheduler's process (``DiskRuntime``: a
``TransferEngine`` over ``DiskStore``; unless ``disk_spill_process`` puts
them in a child), on ``disk_io_threads`` Python threads, in batches
(``DiskStore.write_blocks``): staged, hashed and
written by calls some of which let the interpreter lock go, and each time
a thread wants it back it waits for the main thread's next switch interval
(5 ms) when the main thread never blocks. An engine's loop blocks little while it is busy
(vLLM's engine core launches a step's kernels in Python; an in-process
engine spins even when idle), so what a spill gets there is the "busy"
column, not the "waiting" one.

Contenders, each with the main thread waiting (``waiting``), running a
Python loop until the spill is done (``busy``), and running steps of 100
small torch ops until then (``torch``: each op lets the lock go and takes
it back, as a model's forward pass on the CPU does; its step times during
the spill are set beside its step times alone just before and after):

- ``kvtier``: ``DiskRuntime.submit_spill`` of ``--total-mib`` of blocks
  from a CPU tier file (made and attached as the worker and the scheduler
  side do) into a fresh ``DiskStore`` (POSIX back end, O_DIRECT where the
  file system takes it), ``--threads`` threads, ``disk_spill_process``
  off: the jobs in this process;
- ``kvtier spill process``: the same with ``disk_spill_process`` on (the
  product's spill process, ``kvtier.store.spill_process``: the same engine
  and threads in a child over the same files and rows; the main thread
  polls for its answer as the scheduler does);
- ``py pwrite``: the floor of any design that writes from Python threads
  one block per call: ``--threads`` threads each ``os.pwrite`` their share
  of the same blocks, aligned, into one file in the same directory
  (O_DIRECT likewise), no header, no checksum.

Rows and slots go in order (a fresh tier's spills: kvtier writes each run
of adjacent slots at once), or with ``--shuffle`` each in a random order
(a tier that churned: one write per block; py pwrite's offsets likewise).

Interleaved: every repeat runs the nine (contender x main thread) in a
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
``--repeats``; torch steps' p50, p99 and max, medians of the runs').
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is on the path, not ROOT
    sys.path.insert(0, str(ROOT))

from benchmarks._common import DEFAULT_TRACE, SpillRig, percentile, write_json  # noqa: E402
from kvtier.tiers.plans import SpillOrder  # noqa: E402

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


def _torch_steps_until(done: Callable[[], bool]) -> list[float]:
    """The main thread runs steps of 100 small torch ops until ``done()``
    (asked between steps); returns each step's seconds. torch lets the
    interpreter lock go and takes it back around each op, as a model's
    forward pass on the CPU does in an engine's process."""
    import torch

    x = torch.zeros(64)
    steps: list[float] = []
    while not done():
        t0 = time.perf_counter()
        for _ in range(100):
            x = x + 1
        steps.append(time.perf_counter() - t0)
    return steps


def _torch_steps_alone(seconds: float = 0.3) -> list[float]:
    t0 = time.perf_counter()
    return _torch_steps_until(lambda: time.perf_counter() - t0 >= seconds)


MAINS = ("waiting", "busy", "torch")
TORCH_DESCRIPTION = (
    "main thread runs steps of 100 torch ops on a 64-float tensor until the "
    "spill is done; step_*: that run's step p50/p99/max, alone_step_*: 0.3 s "
    "of steps just before and just after it; each the median over repeats"
)


def _step_figures(runs: list[list[float]], prefix: str) -> dict[str, float]:
    """Median over runs of each run's step p50, p99 and max, in ms."""
    figures = {}
    for name, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0)):
        per_run = [percentile(r, q) for r in runs if r]
        figures[f"{prefix}_{name}_ms"] = round(statistics.median(per_run) * 1e3, 3)
    return figures


def _drive(
    main: str, done: Callable[[], bool], wait: Callable[[], None]
) -> tuple[int, list[float]]:
    """What the main thread does until the spill is done: ``waiting``
    (blocked in ``wait``), ``busy`` (a Python loop: its rounds) or
    ``torch`` (steps of torch ops: their seconds)."""
    if main == "busy":
        return _busy_until(done), []
    if main == "torch":
        return 0, _torch_steps_until(done)
    wait()
    return 0, []


def _loop_rate(seconds: float = 0.5) -> float:
    """Rounds per second of ``_busy_until``'s loop with nothing beside it."""
    t0 = time.perf_counter()
    rounds = _busy_until(lambda: time.perf_counter() - t0 >= seconds)
    return rounds / (time.perf_counter() - t0)


def _spill_items(count: int, shuffle: bool) -> list[tuple[bytes, int, int]]:
    """A spill's items (key, CPU row, disk slot): rows and slots in order
    (a fresh tier's), or each in a random order (a tier that churned: no
    two rows or slots adjacent)."""
    rng = np.random.default_rng(2)
    order = np.arange(count)
    rows = rng.permutation(order) if shuffle else order
    slots = rng.permutation(order) if shuffle else order
    return [
        (b"k%d" % i, int(r), int(s))
        for i, (r, s) in enumerate(zip(rows, slots, strict=True))
    ]


class KvtierSpill:
    """The scheduler side's spill path as the engine runs it: a
    ``DiskRuntime`` (one ``DiskStore``, ``threads`` I/O threads) spilling
    rows of a CPU tier file (made here as a worker makes it, attached as
    the scheduler side attaches it), its jobs in this process or, with
    ``spill_process``, in its spill process (which must be running before
    the first timed run: ``ready``)."""

    def __init__(
        self,
        directory: str,
        block: int,
        count: int,
        threads: int,
        shuffle: bool,
        spill_process: bool,
    ):
        self.rig = SpillRig(
            directory, block, count, count, threads, spill_process, "busy"
        )
        self.runtime = self.rig.runtime
        self.spill_process = spill_process
        self.job = 0
        self.items = _spill_items(count, shuffle)
        self.finished: list[Any] = []

    def _done(self) -> bool:
        self.finished += self.runtime.poll()
        return any(job.job_id == self.job for job in self.finished)

    def run(self, main: str, where: bool = True) -> tuple[float, int, list[float]]:
        """One spill, timed; ``where``: fail unless it ran where it should."""
        self.job += 1
        self.finished = []
        t0 = time.perf_counter()
        self.runtime.submit_spill(SpillOrder(self.job, self.items))
        rounds, steps = _drive(main, self._done, lambda: self.runtime.drain(600))
        while not self._done():  # waiting: drained, the result taken now
            time.sleep(0.001)
        dt = time.perf_counter() - t0
        if not all(job.success for job in self.finished):
            raise RuntimeError(f"kvtier spill failed: {self.finished}")
        if where and self.spill_process and self.runtime.spill_pid is None:
            raise RuntimeError("kvtier's spill process is gone")
        return dt, rounds, steps

    def ready(self) -> None:
        """Run untimed spills until jobs run where they should (the spill
        process starts at the first job and takes jobs once ready)."""
        self.run("waiting", where=False)
        if self.spill_process:
            self.rig.wait_for_spill_process()
        self.run("waiting")  # untimed: allocate the extents

    def close(self) -> None:
        self.rig.close()


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

    def ready(self) -> None:
        self.run("waiting")  # untimed: allocate the extents

    def run(self, main: str) -> tuple[float, int, list[float]]:
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
        rounds, steps = _drive(main, lambda: left[0] == 0, lambda: None)
        for w in workers:
            w.join()
        return time.perf_counter() - t0, rounds, steps

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
            child_dir = os.path.join(root, f"child-{block}")
            os.mkdir(child_dir)
            rigs = {
                "kvtier": KvtierSpill(
                    kv_dir, block, count, args.threads, args.shuffle, False
                ),
                "kvtier spill process": KvtierSpill(
                    child_dir, block, count, args.threads, args.shuffle, True
                ),
                "py pwrite": PyPwrite(root, block, count, args.threads, args.shuffle),
            }
            try:
                for rig in rigs.values():
                    rig.ready()
                runs = [(name, main) for name in rigs for main in MAINS]
                seconds: dict[tuple[str, str], list[float]] = {r: [] for r in runs}
                # busy: the loop's share of its own pace kept during the spill;
                # torch: steps during the spill, and alone around it.
                shares: dict[tuple[str, str], list[float]] = {r: [] for r in runs}
                steps: dict[tuple[str, str], list[list[float]]] = {r: [] for r in runs}
                alone: dict[tuple[str, str], list[list[float]]] = {r: [] for r in runs}
                for rep in range(args.repeats):
                    k = rep % len(runs)
                    for name, main in runs[k:] + runs[:k]:
                        rate = _loop_rate() if main == "busy" else 0.0
                        quiet = _torch_steps_alone() if main == "torch" else []
                        dt, rounds, during = rigs[name].run(main)
                        seconds[(name, main)].append(dt)
                        if main == "busy":
                            rate = (rate + _loop_rate()) / 2
                            shares[(name, main)].append(rounds / dt / rate)
                        if main == "torch":
                            alone[(name, main)].append(quiet + _torch_steps_alone())
                            steps[(name, main)].append(during)
                for name, main in runs:
                    median_s = statistics.median(seconds[(name, main)])
                    row: dict[str, Any] = {
                        "contender": name,
                        "block_bytes": block,
                        "main_thread": main,
                        "mb_s": round(count * block / median_s / 1e6, 1),
                        "runs_s": [round(s, 3) for s in seconds[(name, main)]],
                    }
                    if main == "busy":
                        share = statistics.median(shares[(name, main)])
                        row["loop_share"] = round(share, 3)
                        # What the spill took from the loop, per GB written.
                        row["loop_ms_lost_per_gb"] = round(
                            median_s * (1 - share) * 1e3 / (count * block / 1e9), 1
                        )
                    if main == "torch":
                        row.update(_step_figures(steps[(name, main)], "step"))
                        row.update(_step_figures(alone[(name, main)], "alone_step"))
                    rows.append(row)
            finally:
                for rig in rigs.values():
                    rig.close()
            for name in rigs:
                wait, busy, torch_ = (
                    next(
                        r
                        for r in rows
                        if r["contender"] == name
                        and r["block_bytes"] == block
                        and r["main_thread"] == m
                    )
                    for m in MAINS
                )
                print(
                    f"{block // 1024:>6} KiB  {name:12s} waiting "
                    f"{wait['mb_s']:8.0f} MB/s   busy {busy['mb_s']:8.0f} MB/s   "
                    f"({busy['mb_s'] / wait['mb_s']:.2f}x); the loop kept "
                    f"{busy['loop_share']:.0%} of its pace, lost "
                    f"{busy['loop_ms_lost_per_gb']:.0f} ms per GB",
                    flush=True,
                )
                print(
                    f"{'':>6}      {name:12s} torch steps {torch_['mb_s']:6.0f} MB/s; "
                    f"step p50 {torch_['step_p50_ms']:.3f} ms "
                    f"(alone {torch_['alone_step_p50_ms']:.3f}), p99 "
                    f"{torch_['step_p99_ms']:.3f} ({torch_['alone_step_p99_ms']:.3f}), "
                    f"max {torch_['step_max_ms']:.2f} ({torch_['alone_step_max_ms']:.2f})",
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
                "torch": TORCH_DESCRIPTION,
            },
            "results": rows,
            "trace_spill_runs": runs,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
