"""GPU<->CPU and disk->GPU throughput of kvtier's worker on CUDA.

Side by side in one run, interleaved (the order alternates every round):

- GPU -> CPU (store) and CPU -> GPU (load) of N blocks through kvtier's
  worker (vLLM's transfer handler over kvtier's CPU-tier rows) and through
  vLLM's stock ``CPUOffloadingWorker`` (its own pinned tensors), on the same
  KV-cache tensors. GB/s from submit until the job is reported finished
  (wall), and from vLLM's CUDA events (``transfer_time``).
- disk -> GPU: N blocks written by kvtier's DiskStore, page cache dropped
  before each round where the host allows it, loaded by the worker (read,
  verify, scatter) through the POSIX bounce area, and through kvikio where
  it loads; next to fio (O_DIRECT, 1 MiB sequential reads of the same slab
  span) where a fio binary is given.

Needs a CUDA host with vLLM's CUDA build. Prints and saves JSON
(benchmarks/results/gpu_copy.json by default)::

    python benchmarks/gpu_copy.py --blocks 512 --repeats 5 --disk-dir /mnt/nvme/x
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import drop_caches, fio_sequential_read  # noqa: E402


def _caches(layers: int, page: int, num_blocks: int):
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    tensors = [
        torch.randint(-100, 100, (num_blocks, page // 2), device="cuda").to(
            torch.bfloat16
        )
        for _ in range(layers)
    ]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, page) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(i, page) for i in range(layers)]],
    )


def _run_job(worker, submit, job_id: int, *args) -> tuple[float, float, bool]:
    """(wall seconds until reported finished, reported seconds, success)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    assert submit(job_id, *args)
    deadline = t0 + 120
    while True:
        for result in worker.get_finished():
            if result.job_id == job_id:
                return (
                    time.perf_counter() - t0,
                    result.transfer_time or 0.0,
                    result.success,
                )
        if time.perf_counter() > deadline:
            raise TimeoutError(f"job {job_id} did not finish")


def _fio(fio: str | None, path: str, size: int) -> dict[str, Any] | None:
    if not fio:
        return None
    drop_caches()
    return fio_sequential_read(fio, path, size, loops=3)


def _summary(walls: list[float], reported: list[float], nbytes: int) -> dict[str, Any]:
    return {
        "gbps_wall_median": nbytes / statistics.median(walls) / 1e9,
        "gbps_events_median": nbytes / statistics.median(reported) / 1e9
        if all(reported)
        else None,
        "wall_ms": [round(w * 1e3, 3) for w in walls],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page", type=int, default=64 << 10, help="bytes per layer-block")
    ap.add_argument("--blocks", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--disk-dir", default="/tmp/kvtier-gpu-bench")
    ap.add_argument("--fio", default=shutil.which("fio"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_copy.json"))
    args = ap.parse_args()

    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker

    from kvtier.connector.specs import TierLoadSpec
    from kvtier.connector.worker.device_copy import DeviceCopies
    from kvtier.connector.worker.worker import TieredOffloadingWorker
    from kvtier.io.backends import make_backend
    from kvtier.io.cpu_buffer import CpuBlockBuffer
    from kvtier.io.disk_store import DiskStore
    from kvtier.io.format import LayoutFingerprint
    from kvtier.io.slot_reader import SlotReader
    from kvtier.tiers.events import MEDIUM_DISK
    from kvtier.tiers.plans import BlockLocation

    most = max(args.blocks)
    block_bytes = args.layers * args.page
    caches = _caches(args.layers, args.page, most + 8)
    buffer = CpuBlockBuffer(most, block_bytes)
    kvt = TieredOffloadingWorker(caches, buffer, 1, None, device_copies=DeviceCopies)
    stock = CPUOffloadingWorker(caches, blocks_per_chunk=1, num_cpu_chunks=most)
    doc: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "layers": args.layers,
        "page_bytes": args.page,
        "block_bytes": block_bytes,
        "kvtier_cpu_tier_pinned": kvt.copies.areas["cpu"].pinned,
        "gpu_cpu": {},
    }
    job = 0
    for n in args.blocks:
        gpu = GPULoadStoreSpec(list(range(n)), [n], [0])
        rows = CPULoadStoreSpec(list(range(n)))
        times: dict[str, dict[str, list[float]]] = {}
        for r in range(args.repeats + 1):  # round 0 warms up
            order = [("kvtier", kvt), ("vllm", stock)]
            for name, w in order if r % 2 else order[::-1]:
                for direction in ("store", "load"):
                    job += 1
                    submit = w.submit_store if direction == "store" else w.submit_load
                    a, b = (gpu, rows) if direction == "store" else (rows, gpu)
                    wall, rep, ok = _run_job(w, submit, job, a, b)
                    assert ok
                    if r:
                        t = times.setdefault(
                            f"{name}_{direction}", {"wall": [], "rep": []}
                        )
                        t["wall"].append(wall)
                        t["rep"].append(rep)
        nbytes = n * block_bytes
        res = {k: _summary(v["wall"], v["rep"], nbytes) for k, v in times.items()}
        for d in ("store", "load"):
            res[f"ratio_{d}_kvtier_over_vllm"] = (
                res[f"kvtier_{d}"]["gbps_wall_median"]
                / res[f"vllm_{d}"]["gbps_wall_median"]
            )
        doc["gpu_cpu"][str(n)] = res
        print(f"GPU<->CPU {n} blocks x {block_bytes} B:", json.dumps(res, indent=1))
    stock.shutdown()
    kvt.shutdown()

    # ------------------------------------------------------------ disk -> GPU
    n = most
    disk = Path(args.disk_dir)
    shutil.rmtree(disk, ignore_errors=True)
    disk.mkdir(parents=True)
    fp = LayoutFingerprint(
        model="bench/gpu",
        dtype="bfloat16",
        block_bytes=block_bytes,
        geometry="gpu-copy",
        tp_rank=0,
        tp_size=1,
    )
    store = DiskStore([str(disk)], n, block_bytes, fp, backend="posix")
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, block_bytes, dtype=np.uint8)
    keys = [f"k{i}".encode().ljust(32, b"\0") for i in range(n)]
    for i in range(n):
        payload[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
        store.write_block(i, keys[i], payload, store.next_seq())
    store.close()
    slab = str(next(disk.rglob("slab-0.kvt")))
    spec = TierLoadSpec(keys, [BlockLocation(MEDIUM_DISK, i) for i in range(n)])
    dst = GPULoadStoreSpec(list(range(n)), [n], [0])
    disk_res: dict[str, Any] = {"blocks": n, "bytes": n * block_bytes}
    backends = ["posix"]
    try:
        make_backend("kvikio")
        backends.append("kvikio")
    except Exception as exc:  # noqa: BLE001 - report why it is absent
        disk_res["kvikio_unavailable"] = repr(exc)[:300]
    workers = {}
    for name in backends:
        reader = SlotReader(
            [str(disk)],
            n,
            block_bytes,
            fp,
            make_backend(name),
            bounce_bytes=64 << 20,
            pin=True,
        )
        buf = CpuBlockBuffer(4, block_bytes)
        workers[name] = TieredOffloadingWorker(
            caches, buf, 1, reader, device_copies=DeviceCopies
        )
    walls: dict[str, list[float]] = {name: [] for name in backends}
    dropped = []
    for r in range(args.repeats):
        for name in backends if r % 2 else backends[::-1]:
            dropped.append(drop_caches())
            job += 1
            wall, _, ok = _run_job(
                workers[name], workers[name].submit_load, job, spec, dst
            )
            assert ok, f"disk load failed ({name})"
            walls[name].append(wall)
    for name in backends:
        disk_res[name] = {
            "gbps_median": n * block_bytes / statistics.median(walls[name]) / 1e9,
            "wall_ms": [round(w * 1e3, 2) for w in walls[name]],
            "reader": vars(workers[name].reader.stats()),
        }
        workers[name].shutdown()
    disk_res["page_cache_dropped"] = all(dropped)
    disk_res["fio"] = _fio(args.fio, slab, n * (block_bytes + 4096))
    doc["disk_gpu"] = disk_res
    print("disk->GPU:", json.dumps(disk_res, indent=1, default=str))
    shutil.rmtree(disk, ignore_errors=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc["when"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
