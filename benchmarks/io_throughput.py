"""Disk spill/load throughput of kvtier's back ends next to fio (O_DIRECT).

For every block size and thread count this measures, in one run and on one
file system:

- kvtier **spill** (CPU buffer rows -> DiskStore slots) and **load** (disk
  slots -> CPU rows) through the real path: CpuBlockBuffer -> TransferEngine
  (``threads`` workers) -> DiskStore (slot headers, xxh3 checksums, verify on
  read) -> back end. Back ends: ``posix`` always, ``kvikio`` only where
  ``kvtier.store.backends.factory.kvikio_status()`` says it is usable
  (otherwise its reason is recorded). Where a CUDA GPU exists, **disk -> GPU** is measured as well
  (load into the pinned CPU rows, then one host -> device copy, timed
  together); without one the JSON says why not.
- **fio** with ``--direct=1``, the same block size, ``--numjobs`` = threads
  (queue depth 1 per job, like one kvtier worker), the same total bytes split
  into one contiguous range per job, on a file in the same directory; engine
  ``psync`` plus ``libaio`` and ``io_uring`` where they work. fio is installed
  with apt-get when missing; only if that is impossible does the run fall
  back to ``dd`` (queue depth 1), and it says so in the table and the JSON.
- A diagnostic, not a baseline: the fio psync job done by Python threads
  (``py psync``), which separates Python's per-call cost from kvtier's own
  per-block work (copy into the bounce buffer, xxh3, header, queueing).

    .venv/bin/python benchmarks/io_throughput.py [--dir /path] [--total-mib 256]

Prints a table and writes benchmarks/results/io_throughput.json. MB/s are
10^6 bytes of block payload per second: kvtier also moves a 4 KiB slot
header per block that is not counted, so its figures are slightly
conservative. Every figure is the median of ``--repeats`` runs. Each
contender writes its bytes and reads them straight back, and the order of
contenders rotates every repeat, so all see the same machine conditions and
equally fresh data in any cache below the guest. One untimed write pass
before timing lets every contender overwrite allocated extents. The target is
kvtier >= 0.9x the best fio engine at the same block size and thread count
(the JSON also gives the ratio to fio psync alone, the like-for-like one);
this is a benchmark, never a timed assertion in a test.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
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

from benchmarks._common import write_json  # noqa: E402
from kvtier.host.cpu_tier import CpuBlockBuffer  # noqa: E402
from kvtier.store.backends.base import DiskBackend  # noqa: E402
from kvtier.store.backends.factory import kvikio_status  # noqa: E402
from kvtier.store.backends.posix import PosixBackend  # noqa: E402
from kvtier.store.slot import LayoutFingerprint  # noqa: E402
from kvtier.store.store import DiskStore  # noqa: E402
from kvtier.store.transfers import TransferEngine  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
TARGET = 0.9
FIO_ENGINES = ("psync", "libaio", "io_uring")
_DD_RE = re.compile(r"^(\d+) bytes .* copied, ([0-9.e+-]+) s", re.MULTILINE)


# -- setup: fio -----------------------------------------------------------------


def _run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def ensure_fio(install: bool) -> tuple[str | None, str]:
    """Path of fio (installing it with apt-get if missing) and how it got there."""
    fio = shutil.which("fio")
    if fio:
        return fio, "already installed"
    if not install:
        return None, "fio not installed and --no-install given"
    apt = shutil.which("apt-get")
    if apt is None:
        return None, "fio not installed and apt-get not found"
    if os.geteuid() != 0:
        return None, "fio not installed and not root (run: apt-get install -y fio)"
    tail = ""
    for step in ([], [[apt, "update"]]):
        for cmd in step:
            print(f"setup: {' '.join(cmd)}", file=sys.stderr)
            _run(cmd)
        print(f"setup: {apt} install -y fio", file=sys.stderr)
        res = _run([apt, "install", "-y", "fio"])
        fio = shutil.which("fio")
        if res.returncode == 0 and fio:
            return fio, "installed by this run with apt-get"
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:]
        tail = tail[0] if tail else f"exit {res.returncode}"
    return None, f"apt-get install -y fio failed: {tail}"


def fio_version(fio: str) -> str:
    return _run([fio, "--version"]).stdout.strip()


def fio_job(
    fio: str,
    path: str,
    engine: str,
    rw: str,
    block: int,
    jobs: int,
    total: int,
) -> float:
    """One fio run: ``total`` bytes over ``jobs`` jobs, MB/s of the group."""
    per_job = total // jobs
    cmd = [
        fio,
        "--name=kvtier-bench",
        f"--filename={path}",
        "--direct=1",
        f"--ioengine={engine}",
        "--iodepth=1",
        f"--rw={rw}",
        f"--bs={block}",
        f"--numjobs={jobs}",
        f"--size={per_job}",
        f"--offset_increment={per_job}",
        "--thread",
        "--group_reporting",
        "--output-format=json",
    ]
    res = _run(cmd)
    try:
        doc = json.loads(res.stdout[res.stdout.index("{") :])
        job = doc["jobs"][0]
    except (ValueError, KeyError, IndexError) as exc:
        raise RuntimeError(
            f"fio {engine} {rw} failed (exit {res.returncode}): "
            f"{(res.stderr or res.stdout).strip()[-300:]}"
        ) from exc
    side = job["write" if rw == "write" else "read"]
    if res.returncode != 0 or job.get("error") or side["io_bytes"] != per_job * jobs:
        raise RuntimeError(
            f"fio {engine} {rw}: exit {res.returncode}, error {job.get('error')}, "
            f"{side['io_bytes']} of {per_job * jobs} bytes: {res.stderr.strip()[-300:]}"
        )
    return float(side["bw_bytes"]) / 1e6


def usable_fio_engines(fio: str, directory: str, engines: list[str]) -> dict[str, str]:
    """Try each engine on a one-block O_DIRECT job: 'ok' or why not."""
    status: dict[str, str] = {}
    path = os.path.join(directory, "fio-probe.bin")
    for engine in engines:
        try:
            fio_job(fio, path, engine, "write", 64 * KIB, 1, 256 * KIB)
            fio_job(fio, path, engine, "read", 64 * KIB, 1, 256 * KIB)
            status[engine] = "ok"
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            status[engine] = f"unavailable: {exc}"
    with contextlib.suppress(OSError):
        os.unlink(path)
    return status


# -- fallback baseline: dd ------------------------------------------------------


def dd_run(args: list[str]) -> float:
    """Run dd, return MB/s computed from its byte count and seconds."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = _DD_RE.search(out.stderr)
    if m is None:
        raise RuntimeError(f"cannot parse dd output: {out.stderr!r}")
    return int(m.group(1)) / float(m.group(2)) / 1e6


def dd_job(path: str, rw: str, block: int, count: int) -> float:
    if rw == "write":
        return dd_run(
            [
                "if=/dev/zero",
                f"of={path}",
                f"bs={block}",
                f"count={count}",
                "oflag=direct",
                "conv=notrunc",
            ]
        )
    return dd_run([f"if={path}", "of=/dev/null", f"bs={block}", "iflag=direct"])


# -- diagnostic: the same I/O from Python, without kvtier -------------------------


def python_psync(path: str, rw: str, block: int, threads: int, total: int) -> float:
    """fio psync's job, done by Python threads: O_DIRECT pwritev/preadv of
    ``block`` bytes from an aligned buffer, one contiguous range per thread.

    Not a baseline for the target: it separates what Python's per-call cost
    takes from what kvtier's own per-block work (copy, checksum, header,
    queueing) takes.
    """
    per = total // threads
    op = os.pwritev if rw == "write" else os.preadv
    flags = (os.O_WRONLY if rw == "write" else os.O_RDONLY) | os.O_DIRECT
    fd = os.open(path, flags)
    bufs = [mmap.mmap(-1, block) for _ in range(threads)]
    for b in bufs:
        b.write(b"\x5a" * block)

    def work(i: int) -> None:
        view = [bufs[i]]
        for off in range(i * per, (i + 1) * per, block):
            if op(fd, view, off) != block:
                raise OSError(f"short {rw} at {off} in {path}")

    try:
        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return total / (time.perf_counter() - t0) / 1e6
    finally:
        os.close(fd)
        for b in bufs:
            b.close()


def baseline_run(
    fio: str | None,
    path: str,
    engine: str,
    block: int,
    threads: int,
    total: int,
    rw: str,
) -> float:
    """One baseline measurement: fio ``engine``, dd, or the Python diagnostic."""
    if engine == "dd":
        return dd_job(path, rw, block, total // block)
    if engine == "python_psync":
        return python_psync(path, rw, block, threads, total)
    assert fio is not None
    return fio_job(fio, path, engine, rw, block, threads, total)


# -- kvtier ---------------------------------------------------------------------


class KvtierRig:
    """A CPU buffer, a DiskStore and a TransferEngine for one configuration."""

    def __init__(
        self,
        directory: str,
        backend: DiskBackend,
        block: int,
        count: int,
        threads: int,
        compression: str,
    ) -> None:
        # One store directory per back end: a store locks its directory.
        fp = LayoutFingerprint(
            "bench", "bfloat16", block, f"bench-{block}-{backend.name}", 0, 1
        )
        self.block, self.count, self.backend = block, count, backend
        self.store = DiskStore(
            [directory], count, block, fp, backend=backend, compression=compression
        )
        # Rows [0, count) are spilled; loads land in [count, 2*count).
        self.buf = CpuBlockBuffer(2 * count, block)
        self.engine = TransferEngine([self.store], [self.buf], threads=threads)
        self.job = 0
        # KV-like contents (bf16 normals) so compressed runs are meaningful.
        chunk = np.random.default_rng(0).standard_normal(
            min(block, 4 * MIB) // 2, np.float32
        )
        bf16 = (chunk.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        self.buf.array[:count] = np.resize(bf16, block)
        self.o_direct = all(getattr(h, "direct", False) for h in self.store.files.handles)

    def _run(self, promote: bool) -> float:
        self.job += 1
        n = self.count
        t0 = time.perf_counter()
        if promote:
            self.engine.submit_promote(
                self.job, [(b"k%d" % i, i, 2 * n - 1 - i) for i in range(n)]
            )
        else:
            self.engine.submit_spill(self.job, [(b"k%d" % i, i, i) for i in range(n)])
        self.engine.wait([self.job])
        dt = time.perf_counter() - t0
        results = self.engine.get_finished()
        if not all(r.success for r in results):
            raise RuntimeError(f"kvtier transfer failed: {results}")
        return n * self.block / dt / 1e6

    def spill(self) -> float:
        return self._run(promote=False)

    def transfer(self, rw: str) -> float:
        """Spill for ``"write"``, load for ``"read"``; MB/s."""
        return self.spill() if rw == "write" else self.load()

    def load(self) -> float:
        mb_s = self._run(promote=True)
        if self.buf.array[2 * self.count - 1].tobytes() != self.buf.array[0].tobytes():
            raise RuntimeError("loaded bytes differ from spilled bytes")
        return mb_s

    def load_to_gpu(self, dst: Any) -> float:
        """Load into CPU rows, then copy them to ``dst`` on the GPU; MB/s."""
        import torch

        t0 = time.perf_counter()
        self._run(promote=True)
        rows = torch.from_numpy(self.buf.array[self.count :])
        dst.copy_(rows, non_blocking=True)
        torch.cuda.synchronize()
        return self.count * self.block / (time.perf_counter() - t0) / 1e6

    def disk_bytes_written(self) -> int:
        return self.store.stats().write_bytes

    def close(self) -> None:
        self.engine.shutdown()
        self.store.close()
        self.buf.close()
        self.backend.shutdown()


def make_backend(name: str, threads: int) -> DiskBackend:
    if name == "posix":
        return PosixBackend(threads=threads)
    from kvtier.store.backends.kvikio import KvikioBackend

    return KvikioBackend(threads=threads)


def gpu_status() -> tuple[bool, str]:
    try:
        import torch
    except ImportError as exc:
        return False, f"torch not importable ({exc})"
    if torch.cuda.is_available():
        return True, f"CUDA device: {torch.cuda.get_device_name(0)}"
    return False, (
        f"no CUDA GPU on this machine (torch {torch.__version__}: "
        "torch.cuda.is_available() is False)"
    )


# -- host facts -----------------------------------------------------------------


def fs_info(directory: str) -> dict[str, Any]:
    info: dict[str, Any] = {"dir": directory}
    res = _run(["findmnt", "-n", "-o", "FSTYPE,SOURCE,TARGET", "--target", directory])
    parts = res.stdout.split()
    if res.returncode == 0 and len(parts) >= 3:
        info.update(fs_type=parts[0], source=parts[1], mount=parts[2])
        dev = os.path.basename(parts[1])
        driver = Path(f"/sys/block/{dev}/device/driver")
        if driver.exists():
            info["block_driver"] = os.path.basename(os.path.realpath(driver))
    else:
        res = _run(["stat", "-f", "-c", "%T", directory])
        info["fs_type"] = res.stdout.strip() or "?"
    return info


# -- the run --------------------------------------------------------------------


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    base = args.dir or tempfile.gettempdir()
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-", dir=base)
    fio, install_note = ensure_fio(not args.no_install)
    baseline: dict[str, Any]
    if fio:
        engines = usable_fio_engines(fio, workdir, args.fio_engines)
        baseline = {
            "tool": "fio",
            "version": fio_version(fio),
            "setup": install_note,
            "engines": engines,
            "options": "--direct=1 --iodepth=1 --numjobs=<threads> --thread "
            "--size=<total/threads> --offset_increment=<total/threads>",
        }
        run_engines = [e for e, s in engines.items() if s == "ok"]
        if "psync" not in run_engines:
            raise SystemExit(f"fio's psync engine does not work here: {engines}")
    else:
        print(
            f"WARNING: fio is not available ({install_note}); falling back to dd "
            "O_DIRECT (queue depth 1) as the baseline",
            file=sys.stderr,
        )
        baseline = {
            "tool": "dd",
            "fallback_because": install_note,
            "options": "oflag/iflag=direct, one request at a time",
        }
        run_engines = ["dd"]

    kvikio_ok, kvikio_why = kvikio_status()
    backends = {
        "posix": {"measured": True},
        "kvikio": {"measured": kvikio_ok, "reason": kvikio_why},
    }
    if not kvikio_ok:
        backends["kvikio"]["reason"] = f"not usable here: {kvikio_why}"
    gpu_ok, gpu_why = gpu_status()
    run_backends = ["posix"] + (["kvikio"] if kvikio_ok else [])

    rows: list[dict[str, Any]] = []
    total = args.total_mib * MIB
    try:
        for kib in args.block_kib:
            block = kib * KIB
            count = max(1, total // block)
            nbytes = count * block
            for threads in args.threads:
                if nbytes % (threads * block):
                    raise SystemExit(
                        f"--total-mib must split into whole {kib} KiB blocks per job "
                        f"for {threads} threads"
                    )
                fio_path = os.path.join(workdir, f"fio-{kib}k-{threads}.bin")
                rigs = {
                    b: KvtierRig(
                        workdir,
                        make_backend(b, threads),
                        block,
                        count,
                        threads,
                        args.compression,
                    )
                    for b in run_backends
                }
                gpu_dst = None
                if gpu_ok:
                    import torch

                    gpu_dst = torch.empty(
                        (count, block), dtype=torch.uint8, device="cuda"
                    )
                res: dict[str, dict[str, list[float]]] = {
                    "spill": {},
                    "load": {},
                    "load_gpu": {},
                }
                try:
                    # Untimed first pass: allocate extents in every file.
                    for rig in rigs.values():
                        rig.spill()
                    baseline_run(
                        fio, fio_path, run_engines[0], block, threads, nbytes, "write"
                    )
                    # Each contender writes its 256 MiB and reads it straight
                    # back, so every read finds its data equally fresh in any
                    # cache below the guest (the host's, on a VM); the order of
                    # contenders rotates every repeat so drift hits all alike.
                    pairs: list[tuple[str, Callable[[str], float]]] = [
                        (b, rig.transfer) for b, rig in rigs.items()
                    ]
                    pairs += [
                        (
                            f"fio:{e}" if e != "python_psync" else f"diag:{e}",
                            functools.partial(
                                baseline_run, fio, fio_path, e, block, threads, nbytes
                            ),
                        )
                        for e in [*run_engines, "python_psync"]
                    ]
                    for rep in range(args.repeats):
                        k = rep % len(pairs)
                        for name, fn in pairs[k:] + pairs[:k]:
                            res["spill"].setdefault(name, []).append(fn("write"))
                            res["load"].setdefault(name, []).append(fn("read"))
                        if gpu_dst is not None:
                            for b, rig in rigs.items():
                                rig.spill()
                                res["load_gpu"].setdefault(b, []).append(
                                    rig.load_to_gpu(gpu_dst)
                                )
                    o_direct = {b: rig.o_direct for b, rig in rigs.items()}
                finally:
                    for rig in rigs.values():
                        rig.close()
                    with contextlib.suppress(OSError):
                        os.unlink(fio_path)
                rows.extend(summarise(kib, threads, res, run_backends, o_direct))
                print(
                    f"  done block={kib} KiB threads={threads} "
                    f"({time.perf_counter() - t_start:.0f} s)",
                    file=sys.stderr,
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    return {
        "machine": args.machine,
        "filesystem": fs_info(base),
        "params": {
            "total_mib": args.total_mib,
            "repeats": args.repeats,
            "block_kib": args.block_kib,
            "threads": args.threads,
            "compression": args.compression,
            "unit": "MB/s (1e6 bytes of block payload per second), median of repeats",
            "target": f"kvtier >= {TARGET}x the best baseline engine, same block "
            "size and threads",
        },
        "baseline": baseline,
        "backends": backends,
        "disk_to_gpu": {
            "measured": gpu_ok,
            "reason": gpu_why,
            "path": "TransferEngine load into pinned CPU rows, then one "
            "host -> device copy (torch), timed together",
        },
        "wall_seconds": round(time.perf_counter() - t_start, 1),
        "rows": rows,
        "summary": {
            "target_met": sum(r["target_met"] for r in rows),
            "target_missed": sum(not r["target_met"] for r in rows),
            "target_met_like_for_like": sum(
                r["target_met_like_for_like"] for r in rows
            ),
        },
    }


OPS = {
    "spill": "spill (CPU -> disk)",
    "load": "load (disk -> CPU)",
    "load_gpu": "load (disk -> GPU)",
}


def summarise(
    kib: int,
    threads: int,
    res: dict[str, dict[str, list[float]]],
    backends: list[str],
    o_direct: dict[str, bool],
) -> list[dict[str, Any]]:
    """Rows for one (block, threads): medians, ratios to every baseline engine."""
    rows = []
    for op, runs in res.items():
        # Baseline runs are stored as "fio:<engine>"; disk -> GPU compares
        # with the disk -> CPU reads (fio has no GPU target).
        base_op = "spill" if op == "spill" else "load"
        base_runs = {
            k.split(":", 1)[1]: v
            for k, v in res[base_op].items()
            if k.startswith("fio:")
        }
        ref = {e: median(v) for e, v in base_runs.items()}
        best = max(ref, key=ref.__getitem__)
        first = next(iter(ref))
        for b in backends:
            if b not in runs:
                continue
            mb = median(runs[b])
            ratio = {e: mb / v for e, v in ref.items()}
            rows.append(
                {
                    "block_kib": kib,
                    "threads": threads,
                    "op": OPS[op],
                    "backend": b,
                    "o_direct": o_direct[b],
                    "kvtier_mb_s": mb,
                    "kvtier_runs_mb_s": runs[b],
                    "baseline_mb_s": ref,
                    "baseline_runs_mb_s": base_runs,
                    "ratio": ratio,
                    "best_baseline": best,
                    "ratio_vs_best": ratio[best],
                    "target_met": ratio[best] >= TARGET,
                    # fio psync (or dd) issues the very syscalls kvtier does:
                    # the like-for-like reference, less exposed to the noise
                    # that picking the best of three engines favours.
                    "like_for_like": first,
                    "target_met_like_for_like": ratio[first] >= TARGET,
                    "python_psync_mb_s": median(res[base_op]["diag:python_psync"]),
                    "python_psync_runs_mb_s": res[base_op]["diag:python_psync"],
                }
            )
    return rows


def default_machine() -> str:
    cpus = os.cpu_count()
    gpu_ok, gpu_why = gpu_status()
    kind = gpu_why.split(": ", 1)[1] if gpu_ok else "CPU-only"
    try:
        vm = " VM" if "hypervisor" in Path("/proc/cpuinfo").read_text() else ""
    except OSError:
        vm = ""
    return f"{cpus}-core {kind}{vm}"


def print_table(doc: dict[str, Any]) -> None:
    fs = doc["filesystem"]
    base = doc["baseline"]
    engines = list(doc["rows"][0]["baseline_mb_s"]) if doc["rows"] else []
    print(
        f"\nmachine: {doc['machine']}; dir {fs['dir']} on {fs.get('fs_type')} "
        f"({fs.get('source', '?')}, driver {fs.get('block_driver', '?')}); "
        f"{doc['params']['total_mib']} MiB per measurement, median of "
        f"{doc['params']['repeats']}; MB/s = 1e6 B/s of block payload"
    )
    if base["tool"] == "fio":
        print(f"baseline: {base['version']} ({base['setup']}), {base['options']}")
        for e, s in base["engines"].items():
            if s != "ok":
                print(f"  fio {e}: {s}")
    else:
        print(
            "baseline: dd O_DIRECT qd1 -- FALLBACK, fio missing: "
            f"{base['fallback_because']}"
        )
    for name, b in doc["backends"].items():
        if not b["measured"]:
            print(f"{name}: {b['reason']}")
    if not doc["disk_to_gpu"]["measured"]:
        print(f"disk -> GPU: not measured: {doc['disk_to_gpu']['reason']}")
    head = (
        f"{'block':>7} {'thr':>3}  {'op':<19} {'backend':<7} {'O_DIRECT':<8} "
        f"{'kvtier':>7}"
        + "".join(f" {'fio ' + e if base['tool'] == 'fio' else e:>12}" for e in engines)
        + f" {'py psync':>9} {'/' + (engines[0] if engines else ''):>7} {'/best':>7}  target {TARGET}x"
    )
    print(head)
    for r in doc["rows"]:
        line = (
            f"{r['block_kib']:>5}Ki {r['threads']:>3}  {r['op']:<19} {r['backend']:<7} "
            f"{'yes' if r['o_direct'] else 'NO':<8} {r['kvtier_mb_s']:>7.0f}"
            + "".join(f" {r['baseline_mb_s'][e]:>12.0f}" for e in engines)
            + f" {r['python_psync_mb_s']:>9.0f} {r['ratio'][engines[0]]:>6.2f}x"
            + f" {r['ratio_vs_best']:>6.2f}x  "
            + ("met" if r["target_met"] else f"MISSED (vs {r['best_baseline']})")
        )
        print(line)
    s = doc["summary"]
    print(
        f"target {TARGET}x met in {s['target_met']} of "
        f"{s['target_met'] + s['target_missed']} rows against the best engine, "
        f"{s['target_met_like_for_like']} against "
        f"{doc['rows'][0]['like_for_like'] if doc['rows'] else '-'} alone; "
        f"wall {doc['wall_seconds']} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--dir",
        default=None,
        help="directory on the file system to test (default /tmp)",
    )
    ap.add_argument(
        "--total-mib", type=int, default=256, help="data moved per measurement"
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--block-kib", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--compression", choices=["none", "zstd"], default="none")
    ap.add_argument(
        "--fio-engines", nargs="+", default=list(FIO_ENGINES), choices=FIO_ENGINES
    )
    ap.add_argument(
        "--no-install", action="store_true", help="do not apt-get install fio"
    )
    ap.add_argument(
        "--machine",
        default=None,
        help="machine description recorded with the results (default: detected)",
    )
    ap.add_argument("--out", default=None, help="JSON path (default results/)")
    args = ap.parse_args()
    args.machine = args.machine or default_machine()
    doc = measure(args)
    print_table(doc)
    print(f"wrote {write_json('io_throughput', doc, args.out)}")


if __name__ == "__main__":
    main()
