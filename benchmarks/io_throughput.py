"""Spill/load throughput of the POSIX disk path next to a ``dd`` baseline.

Measures, for each block size, the full kvtier path (CpuBlockBuffer ->
TransferEngine -> DiskStore -> PosixBackend, checksums and headers included)
and ``dd`` with O_DIRECT on the same file system and block size:

    .venv/bin/python benchmarks/io_throughput.py [--dir /path] [--total-mib 256]

Prints a table and writes benchmarks/results/io_throughput.json. MB/s are
10^6 bytes of block payload per second (the 4 KiB slot headers are not
counted, so the kvtier figures are slightly conservative). Every figure is the
median of ``--repeats`` runs. dd runs one request at a time (queue depth 1), so
the kvtier row with threads=1 is the like-for-like comparison; threads=4 shows
what concurrency buys.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.io.cpu_buffer import CpuBlockBuffer  # noqa: E402
from kvtier.io.disk_store import DiskStore  # noqa: E402
from kvtier.io.engine import TransferEngine  # noqa: E402
from kvtier.io.format import LayoutFingerprint  # noqa: E402
from kvtier.io.posix_backend import PosixBackend  # noqa: E402

KIB = 1024
MIB = 1024 * KIB
RESULTS = Path(__file__).resolve().parent / "results" / "io_throughput.json"
_DD_RE = re.compile(r"^(\d+) bytes .* copied, ([0-9.e+-]+) s", re.MULTILINE)


def dd_run(args: list[str]) -> float:
    """Run dd, return MB/s computed from its byte count and seconds."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = _DD_RE.search(out.stderr)
    if m is None:
        raise RuntimeError(f"cannot parse dd output: {out.stderr!r}")
    return int(m.group(1)) / float(m.group(2)) / 1e6


def bench_dd(directory: str, block: int, count: int, repeats: int) -> dict[str, float]:
    path = os.path.join(directory, f"dd-{block}.bin")
    bs = f"bs={block}"
    # Create and fully write the file once so later runs overwrite allocated
    # extents, like kvtier's preallocated slabs.
    dd_run(["if=/dev/zero", f"of={path}", bs, f"count={count}", "oflag=direct"])
    writes = [
        dd_run(
            [
                "if=/dev/zero",
                f"of={path}",
                bs,
                f"count={count}",
                "oflag=direct",
                "conv=notrunc",
            ]
        )
        for _ in range(repeats)
    ]
    reads = [
        dd_run([f"if={path}", "of=/dev/null", bs, "iflag=direct"])
        for _ in range(repeats)
    ]
    os.unlink(path)
    return {
        "spill_mb_s": statistics.median(writes),
        "load_mb_s": statistics.median(reads),
    }


def bench_kvtier(
    directory: str, block: int, count: int, threads: int, repeats: int, compression: str
) -> dict[str, Any]:
    fp = LayoutFingerprint("bench", "bfloat16", block, f"bench-{block}", 0, 1)
    backend = PosixBackend(threads=threads)
    store = DiskStore(
        [directory], count, block, fp, backend=backend, compression=compression
    )
    buf = CpuBlockBuffer(2 * count, block)
    engine = TransferEngine(buf, store, threads=threads)
    try:
        # KV-like contents (bf16 normals) so compressed runs are meaningful.
        chunk = np.random.default_rng(0).standard_normal(
            min(block, 4 * MIB) // 2, np.float32
        )
        bf16 = (chunk.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        buf.array[:count] = np.resize(bf16, block)
        direct = (
            all(h.direct for h in store._handles)
            if hasattr(store, "_handles")
            else None
        )
        spills, loads = [], []
        job = 0
        for _ in range(repeats):
            job += 1
            t0 = time.perf_counter()
            engine.submit_spill(job, [(b"k%d" % i, i, i) for i in range(count)])
            engine.wait([job])
            spills.append(count * block / (time.perf_counter() - t0) / 1e6)
            job += 1
            t0 = time.perf_counter()
            engine.submit_promote(
                job, [(b"k%d" % i, i, 2 * count - 1 - i) for i in range(count)]
            )
            engine.wait([job])
            loads.append(count * block / (time.perf_counter() - t0) / 1e6)
            results = engine.get_finished()
            if not all(r.success for r in results):
                raise RuntimeError(f"transfer failed: {results}")
        if buf.array[2 * count - 1].tobytes() != buf.array[0].tobytes():
            raise RuntimeError("loaded bytes differ from spilled bytes")
        stats = store.stats()
        return {
            "spill_mb_s": statistics.median(spills),
            "load_mb_s": statistics.median(loads),
            "o_direct": direct,
            "disk_bytes_written": stats.bytes_written,
        }
    finally:
        engine.shutdown()
        store.close()
        buf.close()
        backend.shutdown()


def fs_type(directory: str) -> str:
    try:
        out = subprocess.run(
            ["stat", "-f", "-c", "%T", directory], capture_output=True, text=True
        )
        return out.stdout.strip() or "?"
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--dir",
        default=None,
        help="directory on the file system to test (default /tmp)",
    )
    ap.add_argument(
        "--total-mib", type=int, default=256, help="data moved per run and size"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--block-kib", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--compression", choices=["none", "zstd"], default="none")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()

    workdir = tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.dir or "/tmp")
    rows: list[dict[str, Any]] = []
    try:
        for kib in args.block_kib:
            block = kib * KIB
            count = max(1, args.total_mib * MIB // block)
            dd = bench_dd(workdir, block, count, args.repeats)
            rows.append(
                {"block_kib": kib, "engine": "dd O_DIRECT (qd1)", "threads": 1, **dd}
            )
            for threads in args.threads:
                kv = bench_kvtier(
                    workdir, block, count, threads, args.repeats, args.compression
                )
                rows.append(
                    {
                        "block_kib": kib,
                        "engine": "kvtier posix",
                        "threads": threads,
                        **kv,
                    }
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"dir={workdir} fs={fs_type(os.path.dirname(workdir))} total={args.total_mib} MiB "
        f"compression={args.compression} cores={os.cpu_count()} (MB/s = 1e6 B/s, median of "
        f"{args.repeats})"
    )
    print(
        f"{'block':>7}  {'engine':<20} {'threads':>7}  {'spill MB/s':>10}  {'load MB/s':>10}"
    )
    for r in rows:
        print(
            f"{r['block_kib']:>5}Ki  {r['engine']:<20} {r['threads']:>7}  "
            f"{r['spill_mb_s']:>10.0f}  {r['load_mb_s']:>10.0f}"
        )
    doc = {
        "benchmark": "io_throughput",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "fs_type": fs_type(os.path.dirname(workdir)),
            "dir": os.path.dirname(workdir),
        },
        "params": {
            "total_mib": args.total_mib,
            "repeats": args.repeats,
            "compression": args.compression,
            "unit": "MB/s (1e6 bytes of block payload per second), median",
        },
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
