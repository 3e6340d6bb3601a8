"""Cost of the slot checksums: xxh3_64 (every header) next to the device
checksum (version 2 headers), per block size, in one run.

Rows, each the median of ``--repeats`` timings of hashing ``--blocks``
distinct blocks (so caches see fresh data like a spill does):

- ``xxh3``: :func:`kvtier.store.checksum.payload_checksum`, the baseline;
- ``device_np``: :func:`kvtier.store.checksum.device_checksum` (numpy), what
  ``DiskStore.write_block`` adds to every spill;
- ``device_torch_cpu``: :func:`kvtier.store.checksum.device_checksums` on a CPU
  tensor of all blocks at once (what the staging reader does on CPU);
- ``device_torch_cuda``: the same on the GPU (only where CUDA exists; the
  JSON says why not otherwise), synchronised before the clock stops.

    .venv/bin/python benchmarks/checksum_cost.py [--sizes 65536,524288,2097152]

Prints JSON and writes benchmarks/results/checksum_cost.json. GB/s are 10^9
payload bytes per second; ``vs_xxh3`` is the time ratio to xxh3 at that size.
A benchmark, never a timed assertion in a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import write_json  # noqa: E402
from kvtier.store.checksum import (  # noqa: E402
    device_checksum,
    device_checksums,
    payload_checksum,
)


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up (weights, allocator, kernels)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(size: int, blocks: int, repeats: int) -> dict[str, Any]:
    data = np.random.default_rng(size).integers(0, 256, (blocks, size), dtype=np.uint8)
    total = blocks * size
    rows: dict[str, Any] = {}

    def row(name: str, seconds: float) -> None:
        rows[name] = {"seconds": seconds, "GBps": total / seconds / 1e9}

    row("xxh3", _median_s(lambda: [payload_checksum(b) for b in data], repeats))
    row("device_np", _median_s(lambda: [device_checksum(b) for b in data], repeats))
    try:
        import torch
    except ImportError as exc:
        rows["device_torch_cpu"] = {"skipped": f"torch unavailable: {exc}"}
        return {"block_bytes": size, "blocks": blocks, "rows": rows}
    t = torch.from_numpy(data)
    # Correctness first: the three implementations must agree.
    want = [device_checksum(b) for b in data[:4]]
    assert device_checksums(t[:4], size).tolist() == want
    row("device_torch_cpu", _median_s(lambda: device_checksums(t, size), repeats))
    if torch.cuda.is_available():
        g = t.cuda()
        assert device_checksums(g[:4], size).tolist() == want

        def on_gpu() -> None:
            device_checksums(g, size)
            torch.cuda.synchronize()

        row("device_torch_cuda", _median_s(on_gpu, repeats))
    else:
        rows["device_torch_cuda"] = {"skipped": "no CUDA device"}
    base = rows["xxh3"]["seconds"]
    for r in rows.values():
        if "seconds" in r:
            r["vs_xxh3"] = r["seconds"] / base
    return {"block_bytes": size, "blocks": blocks, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="65536,524288,2097152")
    ap.add_argument("--total-mib", type=int, default=64, help="bytes hashed per row")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        blocks = max(1, (args.total_mib << 20) // size)
        results.append(measure(size, blocks, args.repeats))
    doc = {"results": results, "args": vars(args)}
    path = write_json("checksum_cost", doc, args.out)
    print(json.dumps(doc, indent=2))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
