"""GPU<->CPU and disk->GPU throughput of kvtier's worker on CUDA, and the
model-runner thread's time per loaded GiB.

Side by side in one run, interleaved (the order alternates every round):

- GPU -> CPU (store) and CPU -> GPU (load) of N blocks through kvtier's
  worker (vLLM's transfer handler over kvtier's CPU-tier rows) and through
  vLLM's stock ``CPUOffloadingWorker`` (its own pinned tensors), on the same
  KV-cache tensors. GB/s from submit until the job is reported finished
  (wall), and from vLLM's CUDA events (``transfer_time``). CUDA only.
- disk -> GPU: N blocks written by kvtier's DiskStore, page cache dropped
  before each load where the host allows it, loaded by the real
  ``TieredOffloadingWorker`` (reads on its load thread, verification, copies
  into the KV cache) through each disk load path (``disk_load_path``):
  ``host`` (``SlotReader``: a pinned host bounce area, xxh3 on the host,
  vLLM's transfer handler copies host -> GPU) and ``device``
  (``SlotReader(device=...)``: slots read into a GPU staging tensor, verified
  there with the device checksum, copied device -> device), each over the
  POSIX back end and over kvikio where it loads (its mode, GDS or compat, as
  kvikio reports it). Next to an O_DIRECT 1 MiB sequential read of the same
  slab span in the same run (fio where a binary is given, else dd).
- model-runner thread: for every disk row, the time spent *inside the
  worker's calls on the calling thread* -- ``submit_load`` plus every
  ``get_finished`` until the job is reported (on CUDA, ``get_finished``
  issues the copies of each verified batch) -- per loaded GiB. Measured in
  a second pass per round that calls ``get_finished`` once per simulated
  engine step (``--step-ms`` of sleep in between, the forward pass), as vLLM
  does; ``net`` subtracts the median cost of an idle ``get_finished`` (no
  job in flight) per call, which a step pays anyway. Goal (issue 20):
  under 1 ms per GiB. The throughput pass (GB/s) calls ``get_finished``
  every ``--poll-ms`` (0.2 ms): a loop without pauses would hold the GIL
  and starve the worker's load thread (measured on the CPU platform: a
  4 MiB load took 1-4 s instead of ~10 ms).
- a busy model-runner thread: a third pass per round launches tiny ops on
  the worker's device for each simulated step instead of sleeping, and
  counts them: an eager forward pass is Python launching kernels, and each
  launch lets the interpreter lock go and takes it back (torch's bindings
  release it around every op), so a thread of the worker's that runs
  Python then costs the launching thread a wait per launch.
  The slowdown is the fraction of launches the load took away, against
  the same steps with an idle worker (``rows.<path>.busy.slowdown``). A
  loop of pure Python instead never lets the lock go but at the
  interpreter's switch interval, which is no engine's pattern: it loses
  nothing to the load and starves it (docs/benchmarks.md, GPU). The
  ``read-process`` rows (``disk_read_process: on``: reads and checks in a
  child process, the shared bounce area page-locked by the copy path) are
  the host path with its reads out of the engine's process; on the lent
  H100 the decoders' step doubled while a 32k-token prefix loaded from disk
  with the reads in it.

``--device cpu`` runs the disk rows with CPU tensors for the KV cache and
the staging area (the CPU platform's copy path, no vLLM CUDA build): the
same readers, back ends, worker and timing code, so the script can be
checked on a machine without a GPU; its figures say nothing about a GPU.
With the default ``--device cuda`` and no CUDA, it says so and exits 0.

Prints a table and saves JSON (benchmarks/results/gpu_copy.json by
default; ``--device cpu`` writes gpu_copy_cpu.json)::

    python benchmarks/gpu_copy.py --blocks 64 512 --repeats 5 --disk-dir /mnt/nvme/x
    python benchmarks/gpu_copy.py --device cpu --blocks 16 --repeats 2 --no-gpu-cpu
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import direct_read_baseline, drop_caches  # noqa: E402

# disk_load_path host, the same with disk_read_process on, disk_load_path device
LOAD_PATHS = ("host", "read-process", "device")
READER_CLASS = {
    "host": "SlotReader",
    "read-process": "ReadProcess",
    "device": "SlotReader(device)",
}


class Launcher:
    """Tiny in-place ops on a one-element tensor on ``device``, launched as
    an eager forward pass launches its kernels: each op lets the interpreter
    lock go and takes it back. A step ends with a synchronisation, as the
    sampler's does."""

    def __init__(self, device: str) -> None:
        self.x = torch.zeros(1, device=device)
        self.device = device

    def step(self, seconds: float) -> int:
        """Launch for ``seconds``; returns the ops launched."""
        n = 0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(16):
                self.x.add_(1)
            n += 16
        _sync(self.device)
        return n


def _caches(layers: int, page: int, num_blocks: int, device: str = "cuda"):
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    tensors = [
        torch.randint(-100, 100, (num_blocks, page // 2), device=device).to(
            torch.bfloat16
        )
        for _ in range(layers)
    ]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, page) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(i, page) for i in range(layers)]],
    )


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


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


def timed_load(
    worker,
    job_id: int,
    src,
    dst,
    *,
    step_s: float,
    device: str,
    busy: Launcher | None = None,
    timeout: float = 120,
) -> dict[str, Any]:
    """Load ``src`` into ``dst`` through ``worker`` as the model runner does
    (``submit_load``, then ``get_finished`` once per step of ``step_s``
    seconds; 0: without pausing) and time every worker call on this thread.
    ``busy``: each step launches ops (:class:`Launcher`) instead of sleeping.

    Returns wall seconds from submit until reported finished, the seconds
    spent inside the calls (wall and this thread's CPU time), the submit
    alone, the number of ``get_finished`` calls, the longest call, the
    job's success, and with ``busy`` the ops launched and the seconds spent
    launching."""
    _sync(device)
    # thread_time() is a system call (tens of microseconds on some VMs):
    # taken outside the wall-clock windows, so each call's wall time is the
    # worker's alone.
    c0 = time.thread_time()
    t0 = time.perf_counter()
    assert worker.submit_load(job_id, src, dst)
    t1 = time.perf_counter()
    cpu = time.thread_time() - c0
    inside = t1 - t0
    submit = longest = inside
    calls = launches = 0
    launch_s = 0.0
    deadline = t0 + timeout
    while True:
        if busy is not None:
            a = time.perf_counter()
            launches += busy.step(step_s)  # the engine's forward pass
            launch_s += time.perf_counter() - a
        elif step_s:
            time.sleep(step_s)  # the engine's forward pass
        ca = time.thread_time()
        a = time.perf_counter()
        done = worker.get_finished()
        b = time.perf_counter()
        cpu += time.thread_time() - ca
        inside += b - a
        longest = max(longest, b - a)
        calls += 1
        for result in done:
            if result.job_id == job_id:
                return {
                    "wall": b - t0,
                    "inside": inside,
                    "cpu": cpu,
                    "submit": submit,
                    "calls": calls,
                    "longest": longest,
                    "success": bool(result.success),
                    "launches": launches,
                    "launch_s": launch_s,
                }
        if b > deadline:
            raise TimeoutError(f"job {job_id} did not finish")


def idle_launch_rate(
    worker, launcher: Launcher, step_s: float, steps: int = 40
) -> float:
    """Ops per second of :class:`Launcher` over steps of ``step_s`` with an
    idle ``get_finished`` between them: the busy pass's baseline."""
    launches, spent = 0, 0.0
    for _ in range(steps):
        a = time.perf_counter()
        launches += launcher.step(step_s)
        spent += time.perf_counter() - a
        worker.get_finished()
    return launches / spent


def idle_get_finished_s(worker, step_s: float, calls: int = 100) -> float:
    """Median seconds of a ``get_finished`` with nothing in flight, called
    as in :func:`timed_load` (once per simulated step of ``step_s``: after
    a pause, with the caches as a forward pass leaves them), which a step
    pays whether or not a load is in flight."""
    times = []
    for _ in range(calls):
        if step_s:
            time.sleep(step_s)
        a = time.perf_counter()
        worker.get_finished()
        times.append(time.perf_counter() - a)
    return statistics.median(times)


def _summary(walls: list[float], reported: list[float], nbytes: int) -> dict[str, Any]:
    return {
        "gbps_wall_median": nbytes / statistics.median(walls) / 1e9,
        "gbps_events_median": nbytes / statistics.median(reported) / 1e9
        if all(reported)
        else None,
        "wall_ms": [round(w * 1e3, 3) for w in walls],
    }


def gpu_cpu_rows(args: argparse.Namespace, caches, most: int) -> dict[str, Any]:
    """GPU<->CPU rows: kvtier's worker next to vLLM's stock worker (CUDA)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker

    from kvtier.connector.worker.device_copy import DeviceCopies
    from kvtier.connector.worker.worker import TieredOffloadingWorker
    from kvtier.host.cpu_tier import CpuBlockBuffer

    block_bytes = args.layers * args.page
    buffer = CpuBlockBuffer(most, block_bytes)
    kvt = TieredOffloadingWorker(caches, buffer, 1, None, device_copies=DeviceCopies)
    stock = CPUOffloadingWorker(caches, blocks_per_chunk=1, num_cpu_chunks=most)
    doc: dict[str, Any] = {"kvtier_cpu_tier_pinned": kvt.copies.areas["cpu"].pinned}
    job = 1_000_000
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
        doc[str(n)] = res
        print(f"GPU<->CPU {n} blocks x {block_bytes} B:", json.dumps(res, indent=1))
    stock.shutdown()
    kvt.shutdown()
    return doc


def _expected_block(payload: np.ndarray, i: int) -> np.ndarray:
    """Block ``i``'s bytes as written: ``payload`` with ``i`` in its first 8."""
    block = payload.copy()
    block[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
    return block


def _kv_block(caches, block_id: int) -> np.ndarray:
    """One KV-cache block's bytes, layer after layer (the offloaded layout)."""
    parts = [
        t.tensor[block_id].view(torch.uint8).reshape(-1)[: t.page_size_bytes]
        for t in caches.tensors
    ]
    return torch.cat(parts).cpu().numpy()


def _backend_mode(backend) -> str:
    """``posix``, or kvikio's own mode: ``gds`` or ``compat``."""
    from kvtier.store.reader import staging_mode

    return staging_mode(backend)


def disk_rows(
    args: argparse.Namespace,
    caches,
    device: str,
    n: int,
    checkpoint: Callable[[dict[str, Any]], None] = lambda res: None,
) -> dict[str, Any]:
    """disk -> KV cache rows, {host, device} load path x {posix, kvikio},
    next to an O_DIRECT read of the same slab span (see the module doc).
    ``checkpoint`` gets the rows' figures after every round (a run cut off
    keeps the rounds it finished)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier.connector.load_store_specs import TierLoadSpec
    from kvtier.connector.worker.worker import TieredOffloadingWorker
    from kvtier.host.cpu_tier import CpuBlockBuffer
    from kvtier.store.backends.factory import make_backend
    from kvtier.store.read_process import ReadProcess
    from kvtier.store.reader import SlotReader
    from kvtier.store.slabs import SlabFiles
    from kvtier.store.slot import LayoutFingerprint, slot_size
    from kvtier.store.store import DiskStore
    from kvtier.tiers.events import MEDIUM_DISK
    from kvtier.tiers.plans import BlockLocation

    device_copies = None
    if device == "cuda":
        from kvtier.connector.worker.device_copy import DeviceCopies

        device_copies = DeviceCopies
    block_bytes = args.layers * args.page
    nbytes = n * block_bytes
    gib = nbytes / (1 << 30)
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
    payload = np.random.default_rng(0).integers(0, 256, block_bytes, dtype=np.uint8)
    keys = [f"k{i}".encode().ljust(32, b"\0") for i in range(n)]
    for i in range(n):
        store.write_block(i, keys[i], _expected_block(payload, i), store.next_seq())
    store.close()
    slab = str(next(disk.rglob("slab-0.kvt")))
    span = n * slot_size(block_bytes)
    spec = TierLoadSpec(keys, [BlockLocation(MEDIUM_DISK, i) for i in range(n)])
    dst_ids = list(range(n))
    dst = GPULoadStoreSpec(dst_ids, [n], [0])
    res: dict[str, Any] = {
        "device": device,
        "blocks": n,
        "bytes": nbytes,
        "slab_span_bytes": span,
        "staging_bytes": args.staging_bytes,
        "step_ms": args.step_ms,
        "rows": {},
    }
    backends = ["posix"]
    try:
        make_backend("kvikio").shutdown()
        backends.append("kvikio")
    except Exception as exc:  # noqa: BLE001 - report why it is absent
        res["kvikio_unavailable"] = repr(exc)[:300]

    workers: dict[str, Any] = {}
    rows: dict[str, dict[str, Any]] = res["rows"]
    for path in LOAD_PATHS:
        # The read process's own back end is the reads' only difference to
        # the host path: one row, over POSIX.
        for name in backends if path != "read-process" else ["posix"]:
            key = f"{path}/{name}"
            row: dict[str, Any] = {"reader": READER_CLASS[path], "backend": name}
            rows[key] = row
            backend = make_backend(name)
            row["mode"] = _backend_mode(backend)
            row["backend_describe"] = backend.describe()
            reader = None
            try:
                # As TieredOffloadingSpec._disk_reader builds them.
                files = SlabFiles.open([str(disk)], fp, n, backend, owns_backend=True)
                capacity = max(1, args.staging_bytes // slot_size(block_bytes))
                if path == "device":
                    reader = SlotReader(
                        files, device=caches.tensors[0].tensor.device, capacity=capacity
                    )
                    row["mode"] = reader.mode
                elif path == "read-process":
                    reader = ReadProcess(
                        files, capacity=capacity, disk_io=name, threads=4
                    )
                else:
                    reader = SlotReader(files, capacity=capacity, pin=True)
                workers[key] = TieredOffloadingWorker(
                    caches,
                    CpuBlockBuffer(4, block_bytes),
                    1,
                    reader,
                    device_copies=device_copies,
                )
            except Exception as exc:  # noqa: BLE001 - one row, not the run
                row["error"] = f"build: {exc!r}"[:400]
                if reader is not None:
                    reader.close()
                else:
                    backend.shutdown()

    job = 0
    launcher = Launcher(device)

    def load(
        key: str, step_s: float, busy: Launcher | None = None
    ) -> dict[str, Any] | None:
        nonlocal job
        job += 1
        try:
            out = timed_load(
                workers[key], job, spec, dst, step_s=step_s, device=device, busy=busy
            )
            if not out["success"]:
                raise RuntimeError(
                    f"load reported failed: {workers[key].take_load_error(job)}"
                )
            return out
        except Exception as exc:  # noqa: BLE001 - one row, not the run
            rows[key]["error"] = f"load: {exc!r}"[:400]
            workers.pop(key).shutdown()
            return None

    # Warm-up round: open the slabs, and check that every row lands the
    # bytes that were written (first, middle and last block).
    probe = sorted({0, n // 2, n - 1})
    for key in list(workers):
        for t in caches.tensors:
            t.tensor[:n].zero_()
        _sync(device)
        if load(key, args.poll_ms / 1e3) is None:
            continue
        _sync(device)
        bad = [
            i
            for i in probe
            if not np.array_equal(
                _kv_block(caches, dst_ids[i]), _expected_block(payload, i)
            )
        ]
        rows[key]["bytes_checked_blocks"] = probe
        if bad:
            rows[key]["error"] = f"wrong bytes in KV blocks {bad}"
            workers.pop(key).shutdown()
        else:
            rows[key]["idle_get_finished_us"] = 1e6 * idle_get_finished_s(
                workers[key], args.step_ms / 1e3
            )

    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        k: {"poll": [], "step": [], "busy": []} for k in workers
    }
    baseline: list[dict[str, Any]] = []
    dropped: list[bool] = []

    def summarize() -> None:
        """The rows' figures from the rounds so far."""
        gbps = [b["gbps"] for b in baseline if "gbps" in b]
        res["baseline"] = {
            "tool": baseline[0]["tool"] if baseline else None,
            "gbps_median": statistics.median(gbps) if gbps else None,
            "runs": baseline,
        }
        res["page_cache_dropped"] = bool(dropped) and all(dropped)
        base = res["baseline"]["gbps_median"]
        for key, row in rows.items():
            poll, step = runs.get(key, {}).get("poll"), runs.get(key, {}).get("step")
            busy = runs.get(key, {}).get("busy")
            if busy:
                shares = [
                    o["launches"] / o["launch_s"] / o["idle_launch_rate"]
                    for o in busy
                    if o["launch_s"]
                ]
                if shares:
                    row["busy"] = {
                        "slowdown": 1 - statistics.median(shares),
                        "gbps_median": nbytes
                        / statistics.median(o["wall"] for o in busy)
                        / 1e9,
                    }
            if poll:
                wall = statistics.median(o["wall"] for o in poll)
                row["gbps_median"] = nbytes / wall / 1e9
                row["x_baseline"] = row["gbps_median"] / base if base else None
                row["wall_ms"] = [round(o["wall"] * 1e3, 2) for o in poll]
                row["poll_thread_ms_per_gib"] = (
                    1e3 * statistics.median(o["inside"] for o in poll) / gib
                )
            if step:
                idle = row.get("idle_get_finished_us", 0.0) / 1e6
                med = statistics.median
                row["thread"] = {
                    "ms_per_gib": 1e3 * med(o["inside"] for o in step) / gib,
                    "net_ms_per_gib": 1e3
                    * med(max(0.0, o["inside"] - o["calls"] * idle) for o in step)
                    / gib,
                    "cpu_ms_per_gib": 1e3 * med(o["cpu"] for o in step) / gib,
                    "submit_ms": 1e3 * med(o["submit"] for o in step),
                    "get_finished_calls": med(o["calls"] for o in step),
                    "longest_call_ms": 1e3 * max(o["longest"] for o in step),
                    "stepped_gbps_median": nbytes / med(o["wall"] for o in step) / 1e9,
                }
            if key in workers:
                row["reader_stats"] = vars(workers[key].reader.stats())
                # Where the reads ran by the end: a read process whose child did
                # not start (or was lost) reads in this process.
                row["reader_describe"] = workers[key].reader.describe()

    for r in range(args.repeats):
        baseline.append(
            direct_read_baseline(args.fio, slab, span, drop=args.drop_caches)
        )
        order = list(workers)
        for key in order if r % 2 else order[::-1]:
            for mode, step_s in (
                ("poll", args.poll_ms / 1e3),
                ("step", args.step_ms / 1e3),
                ("busy", args.step_ms / 1e3),
            ):
                if key not in workers:
                    break
                idle_rate = None
                if mode == "busy":
                    # The launch rate with nothing loading, right before:
                    # the clock of this VM's CPU drifts between rounds.
                    idle_rate = idle_launch_rate(workers[key], launcher, step_s)
                dropped.append(args.drop_caches and drop_caches())
                out = load(key, step_s, busy=launcher if mode == "busy" else None)
                if out is not None and idle_rate is not None:
                    out["idle_launch_rate"] = idle_rate
                if out is not None:
                    runs[key][mode].append(out)
        summarize()
        checkpoint(res)
    summarize()  # also with no rounds
    for w in workers.values():
        w.shutdown()
    shutil.rmtree(disk, ignore_errors=True)
    return res


def print_disk_table(res: dict[str, Any]) -> None:
    base = res["baseline"]
    where = "GPU" if res["device"] == "cuda" else "CPU tensors"
    print(
        f"\ndisk -> {where}: {res['blocks']} blocks, {res['bytes'] / (1 << 20):.0f} MiB "
        f"per load; page cache dropped: {'yes' if res['page_cache_dropped'] else 'NO'}; "
        f"staging/bounce {res['staging_bytes'] >> 20} MiB"
    )
    bg = base["gbps_median"]
    print(
        f"  baseline {base['tool']} O_DIRECT 1 MiB sequential, same slab span: "
        + (f"{bg:.2f} GB/s" if bg else f"failed: {base['runs'][:1]}")
    )
    if "kvikio_unavailable" in res:
        print(f"  kvikio: not loaded here: {res['kvikio_unavailable'][:160]}")
    head = (
        f"  {'load path':<9} {'back end':<8} {'mode':<6} | {'GB/s':>6} | "
        f"{'x ' + str(base['tool']):>7} | {'thread ms/GiB':>13} | {'net ms/GiB':>10} | "
        f"{'submit ms':>9} | {'calls':>5} | {'longest ms':>10} | "
        f"{'busy: slowdown':>14} | {'GB/s':>5}"
    )
    print(head)
    print("  " + "-" * (len(head) - 2))
    for row in res["rows"].values():
        path = {v: k for k, v in READER_CLASS.items()}[row["reader"]]
        lead = f"  {path:<9} {row['backend']:<8} {row.get('mode', '?'):<6} | "
        if "gbps_median" not in row or "thread" not in row:
            print(lead + f"error: {row.get('error', 'no runs')}")
            continue
        t = row["thread"]
        x = row["x_baseline"]
        print(
            lead + f"{row['gbps_median']:>6.2f} | {(f'{x:.2f}' if x else '-'):>7} | "
            f"{t['ms_per_gib']:>13.3f} | {t['net_ms_per_gib']:>10.3f} | "
            f"{t['submit_ms']:>9.3f} | {t['get_finished_calls']:>5.0f} | "
            f"{t['longest_call_ms']:>10.3f} | "
            + (
                f"{row['busy']['slowdown']:>13.1%} | {row['busy']['gbps_median']:>5.2f}"
                if "busy" in row
                else f"{'-':>14} | {'-':>5}"
            )
        )
    timed = {k: r["thread"] for k, r in res["rows"].items() if "thread" in r}
    if timed:
        worst = max(timed, key=lambda k: timed[k]["ms_per_gib"])
        print(
            f"  model-runner thread ms per submitted GiB (goal < 1): worst row "
            f"{worst}: {timed[worst]['ms_per_gib']:.3f} "
            f"(net {timed[worst]['net_ms_per_gib']:.3f})"
        )
    print(
        f"  model-runner thread ms per submitted GiB = submit_load + every "
        f"get_finished until done, one call per {res['step_ms']} ms step; net: less "
        f"an idle get_finished per call; busy: the share of a launching model-"
        f"runner thread's ops (steps of {res['step_ms']} ms) the load took"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page", type=int, default=64 << 10, help="bytes per layer-block")
    ap.add_argument("--blocks", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--disk-dir", default="/tmp/kvtier-gpu-bench")
    ap.add_argument("--fio", default=shutil.which("fio"), help="else dd O_DIRECT")
    ap.add_argument(
        "--staging-bytes",
        type=int,
        default=64 << 20,
        help="bounce / staging area per reader (disk_load_buffer_bytes)",
    )
    ap.add_argument(
        "--step-ms",
        type=float,
        default=5.0,
        help="simulated engine step between get_finished calls (thread pass)",
    )
    ap.add_argument(
        "--poll-ms",
        type=float,
        default=0.2,
        help="pause between get_finished calls in the throughput pass (a busy "
        "loop would starve the load thread of the GIL)",
    )
    ap.add_argument(
        "--no-drop-caches",
        dest="drop_caches",
        action="store_false",
        help="do not drop the page cache before each load (a shared host)",
    )
    ap.add_argument(
        "--no-gpu-cpu", dest="gpu_cpu", action="store_false", help="disk rows only"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_copy: CUDA is not available here (torch.cuda.is_available() is "
            "False; torch " + torch.__version__ + "): nothing measured. "
            "`--device cpu` runs the disk rows on CPU tensors to check the code."
        )
        return 0
    device = args.device
    most = max(args.blocks)
    block_bytes = args.layers * args.page
    caches = _caches(args.layers, args.page, most + 8, device)
    doc: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "layers": args.layers,
        "page_bytes": args.page,
        "block_bytes": block_bytes,
    }
    default = "gpu_copy.json" if device == "cuda" else "gpu_copy_cpu.json"
    out = Path(args.out or ROOT / "benchmarks/results" / default)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        doc["when"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        out.write_text(json.dumps(doc, indent=2, default=str) + "\n")

    # Each part is saved as soon as it is measured, and a part that raises
    # is recorded as its error: a lent GPU's run keeps what it measured.
    failed = False
    try:
        if device == "cuda" and args.gpu_cpu:
            doc["gpu_cpu"] = gpu_cpu_rows(args, caches, most)
        else:
            doc["gpu_cpu"] = (
                "skipped (--no-gpu-cpu)"
                if args.gpu_cpu is False
                else "skipped: vLLM's stock CPUOffloadingWorker needs CUDA"
            )
    except Exception as exc:  # noqa: BLE001 - recorded, the disk rows still run
        traceback.print_exc()
        doc["gpu_cpu"] = f"failed: {exc!r}"
        failed = True
    save()

    def checkpoint(res: dict[str, Any]) -> None:
        doc["disk_gpu"] = res
        save()

    try:
        doc["disk_gpu"] = disk_rows(args, caches, device, most, checkpoint)
        print_disk_table(doc["disk_gpu"])
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON
        traceback.print_exc()
        doc["disk_gpu"] = f"failed: {exc!r}"
        failed = True
    save()
    print("wrote", out)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
