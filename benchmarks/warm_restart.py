"""How long a warm restart takes to rebuild the disk tier's index.

Fills a disk tier of ``--gib`` GiB (default 10) with valid blocks, then
times what an engine start does with it: open the store, read every slot
header (``DiskRuntime.scan_restore``) and adopt the blocks into the
hierarchy (``TierHierarchy.restore_disk``). Runs with the page cache warm
and, when this process may drop it (root), cold. Baseline in the same run:
``dd`` reading the same number of 4 KiB headers' worth of bytes is not a
fair comparison for scattered reads, so the table reports headers/s next
to a sequential dd read of the whole slab for scale.

    .venv/bin/python benchmarks/warm_restart.py [--gib 10] [--block-kib 1024] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import drop_caches  # noqa: E402
from kvtier.host.cpu_tier import AttachedRows  # noqa: E402
from kvtier.store.runtime import DiskRuntime  # noqa: E402
from kvtier.store.slot import LayoutFingerprint, slot_size  # noqa: E402
from kvtier.store.store import DiskStore, open_stores  # noqa: E402
from kvtier.tiers.hierarchy import TierHierarchy  # noqa: E402


def fill(store: DiskStore, block_bytes: int) -> float:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, block_bytes, dtype=np.uint8)
    t0 = time.perf_counter()
    for slot in range(store.num_slots):
        key = slot.to_bytes(32, "big") + b"\0\0\0\0"
        store.write_block(slot, key, data, store.next_seq())
    return time.perf_counter() - t0


def restart(paths, n, block_bytes, fp) -> tuple[float, int]:
    t0 = time.perf_counter()
    stores = open_stores(paths, [fp], n, block_bytes, backend="posix")
    # No CPU tier file: nothing is mapped, no spill runs here.
    nowhere = os.path.join(paths[0], "no-cpu-tier")
    rt = DiskRuntime(stores, [AttachedRows(nowhere, 1, block_bytes)])
    entries = rt.scan_restore()
    h = TierHierarchy(1, n)
    h.restore_disk(entries)
    seconds = time.perf_counter() - t0
    rt.close()
    return seconds, len(h.disk)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=10.0)
    ap.add_argument("--block-kib", type=int, default=1024)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/warm_restart.json"))
    args = ap.parse_args()
    block_bytes = args.block_kib * 1024
    n = int(args.gib * 2**30) // slot_size(block_bytes)
    fp = LayoutFingerprint("bench", "bfloat16", block_bytes, "warm-restart", 0, 1)
    base = Path(tempfile.mkdtemp(prefix="kvtier-restart-", dir=args.dir))
    try:
        with DiskStore([str(base)], n, block_bytes, fp, backend="posix") as store:
            fill_s = fill(store, block_bytes)
            slab = store.slabs[0].path
        on_disk = n * slot_size(block_bytes)
        warm_s, adopted = restart([str(base)], n, block_bytes, fp)
        cold = drop_caches()
        cold_s, adopted_cold = (
            restart([str(base)], n, block_bytes, fp) if cold else (None, 0)
        )
        dd = subprocess.run(
            ["dd", f"if={slab}", "of=/dev/null", "bs=4M", "iflag=direct"],
            capture_output=True,
            text=True,
        )
        dd_line = dd.stderr.strip().splitlines()[-1] if dd.stderr else ""
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = [
        (
            "tier size",
            f"{on_disk / 2**30:.2f} GiB in {n} slots of {block_bytes // 1024} KiB",
        ),
        (
            "fill (write every slot)",
            f"{fill_s:.1f} s ({on_disk / fill_s / 1e6:.0f} MB/s)",
        ),
        (
            "restart, page cache warm",
            f"{warm_s:.3f} s ({n / warm_s:,.0f} headers/s), adopted {adopted}",
        ),
    ]
    if cold_s is not None:
        rows.append(
            (
                "restart, page cache dropped",
                f"{cold_s:.3f} s ({n / cold_s:,.0f} headers/s), adopted {adopted_cold}",
            )
        )
    else:
        rows.append(
            ("restart, page cache dropped", "not measured (cannot drop caches here)")
        )
    rows.append(("baseline: dd sequential read of the slab", dd_line))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    record = {
        "benchmark": "warm_restart",
        "machine": f"{platform.node()} {os.cpu_count()} cores, {args.dir}",
        "gib": on_disk / 2**30,
        "slots": n,
        "block_bytes": block_bytes,
        "fill_seconds": fill_s,
        "restart_seconds_warm_cache": warm_s,
        "restart_seconds_cold_cache": cold_s,
        "adopted": adopted,
        "dd_sequential_read": dd_line,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if adopted == n else 1


if __name__ == "__main__":
    sys.exit(main())
