"""Time a load costs the model runner's thread: ``submit_load`` per GiB.

vLLM calls ``submit_load`` on the thread that runs the engine step; all it
may do is plan (vLLM 0.33: "Submission itself must still not block"). This
drives kvtier's real spec, manager and worker (real slab files; the CPU
platform's copy path) with loads of disk blocks and CPU-tier blocks, and
times ``submit_load`` alone, next to the whole load (submit until
``get_finished`` reports it), interleaved per repeat. Blocks are 2 MiB
(32 layers x 64 KiB, as on the H100 runs in docs/benchmarks.md).

    .venv/bin/python benchmarks/submit_cost.py [--blocks 256] [--repeats 7]

Prints a table and writes benchmarks/results/submit_cost.json.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYERS = 32
PAGE = 64 << 10
BLOCK_BYTES = LAYERS * PAGE


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/submit_cost.json"))
    args = ap.parse_args()

    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        ReqContext,
        make_offload_key,
    )

    from benchmarks._common import write_json
    from kvtier.store.slot import slot_size
    from kvtier.testing.offloading import offloading_config, tiered_spec, wait_finished

    n = args.blocks
    gpu_blocks = 2 * n + 8
    kv = [torch.zeros(gpu_blocks, PAGE, dtype=torch.uint8) for _ in range(LAYERS)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in kv],
        group_data_refs=[[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]],
    )
    rows: dict[str, list] = {"disk": [], "cpu": []}
    with tempfile.TemporaryDirectory(prefix="kvtier-submit-") as disk:
        cfg = offloading_config(
            {
                "spec_name": "TieredOffloadingSpec",
                "spec_module_path": "kvtier.connector",
                "cpu_bytes_to_use": n * BLOCK_BYTES,  # "c" pushes all of "d" out
                "disk_bytes_to_use": 3 * n * slot_size(BLOCK_BYTES),
                "disk_path": disk,
                "spill_watermark": 0.0,
                "promote_on_hit": False,
                "disk_io": "posix",
            },
            worker_kv_bytes_per_block=BLOCK_BYTES,
            layers=LAYERS,
        )
        spec = tiered_spec(cfg)
        worker = spec.get_worker(caches)
        manager = spec.get_manager()
        job = 0

        def keys(name: str) -> list[bytes]:
            return [
                make_offload_key(hashlib.sha256(f"{name}/{i}".encode()).digest(), 0)
                for i in range(n)
            ]

        def store(name: str) -> list[bytes]:
            nonlocal job
            ks = keys(name)
            ctx = ReqContext(req_id=name)
            manager.on_new_request(ctx)
            out = manager.prepare_store(ks, ctx)
            deadline = time.monotonic() + 60
            while out is None:  # declined until spills made room
                if time.monotonic() > deadline:
                    raise TimeoutError("store declined for 60 s")
                manager.on_schedule_end(None)
                time.sleep(0.005)
                out = manager.prepare_store(ks, ctx)
            job += 1
            src = list(range(len(out.keys_to_store)))
            worker.submit_store(job, GPULoadStoreSpec(src, [len(src)], [0]), out.store_spec)
            wait_finished(worker, timeout=60)
            manager.complete_store(out.keys_to_store, ctx)
            manager.on_request_finished(ctx)
            deadline = time.monotonic() + 120
            while manager.has_pending_work():
                if time.monotonic() > deadline:
                    raise TimeoutError("spills did not finish")
                manager.on_schedule_end(None)
                time.sleep(0.005)
            return ks

        on_disk = store("d")  # spilled, then pushed out of the CPU tier
        on_cpu = store("c")
        h = manager.hierarchy
        assert all(h.lookup(k).name == "HIT_DISK" for k in on_disk)
        assert all(h.lookup(k).name == "HIT_CPU" for k in on_cpu)

        def load(name: str, ks: list[bytes]) -> tuple[float, float]:
            nonlocal job
            ctx = ReqContext(req_id=f"load-{name}-{job}")
            manager.on_new_request(ctx)
            for k in ks:
                manager.lookup(k, ctx)
            spec_ = manager.prepare_load(ks, ctx)
            dst = GPULoadStoreSpec(list(range(n, 2 * n)), [n], [0])
            job += 1
            t0 = time.perf_counter()
            worker.submit_load(job, spec_, dst)
            t1 = time.perf_counter()
            done = wait_finished(worker, timeout=120)
            t2 = time.perf_counter()
            assert done[0].success
            manager.complete_load(ks, ctx)
            manager.on_request_finished(ctx)
            return t1 - t0, t2 - t0

        for _ in range(args.repeats):
            for name, ks in (("disk", on_disk), ("cpu", on_cpu)):
                rows[name].append(load(name, ks))
        worker.shutdown()
        manager.shutdown()
    gib = n * BLOCK_BYTES / (1 << 30)
    result = {}
    print(f"{n} blocks of {BLOCK_BYTES >> 20} MiB ({gib:.2f} GiB) per load, "
          f"median of {args.repeats}")
    print(f"{'source':>6} | {'submit ms':>9} | {'us/block':>8} | {'ms per GiB':>10} | "
          f"{'whole load ms':>13}")
    for name, runs in rows.items():
        submit = statistics.median(r[0] for r in runs)
        whole = statistics.median(r[1] for r in runs)
        result[name] = {
            "submit_ms": 1e3 * submit,
            "submit_us_per_block": 1e6 * submit / n,
            "submit_ms_per_gib": 1e3 * submit / gib,
            "whole_load_ms": 1e3 * whole,
        }
        print(f"{name:>6} | {1e3 * submit:>9.3f} | {1e6 * submit / n:>8.1f} | "
              f"{1e3 * submit / gib:>10.3f} | {1e3 * whole:>13.1f}")
    path = write_json(
        "submit_cost",
        {"blocks": n, "block_bytes": BLOCK_BYTES, "repeats": args.repeats, **result},
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
