"""Shared bits of the trace benchmarks: paths, host description, output."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

# Imported as ``benchmarks._common``: a script run as ``python
# benchmarks/X.py`` puts the repository root on ``sys.path`` first.
REPO_ROOT = Path(__file__).resolve().parents[1]

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"
# 2,000 blocks of 512 tokens: ~4.6 % of the trace's 43,924 unique blocks
# (see docs/benchmarks.md for why).
DEFAULT_CPU_BLOCKS = 2000


def host_info() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "description": "2-core CPU-only VM" if os.cpu_count() == 2 else None,
    }


def write_json(name: str, doc: dict[str, Any], out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": host_info(),
        **doc,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def kvtier_counters() -> dict[str, float]:
    """kvtier's counters in this process's Prometheus registry, summed over
    every label but ``tier`` (``name{tier}``). Read directly: vLLM's
    ``LLM.get_metrics()`` casts counters to int, which truncates seconds."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if not name.startswith("vllm:kv_offload_kvtier_"):
                continue
            if sample.name.endswith("_created"):
                continue
            tier = sample.labels.get("tier")
            key = name + (f"{{{tier}}}" if tier else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def offload_load_totals() -> tuple[float, float]:
    """vLLM's own offloading load counters in this process's Prometheus
    registry, summed over labels: (bytes loaded, seconds the loads took end
    to end, as the workers reported each job)."""
    from prometheus_client import REGISTRY

    want = {
        "vllm:kv_offload_load_bytes_total": 0,
        "vllm:kv_offload_load_time_total": 1,
    }
    out = [0.0, 0.0]
    for family in REGISTRY.collect():
        for sample in family.samples:
            i = want.get(sample.name)
            if i is not None:
                out[i] += sample.value
    return out[0], out[1]


def drop_caches() -> bool:
    """Drop the page cache (root only); False where the host does not allow it."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def block_device_of(path: str) -> str:
    """``major:minor`` of the whole block device that holds ``path`` (a
    partition's disk), as the cgroup I/O controllers name it; OSError where
    ``path`` is on no block device (tmpfs, overlay)."""
    st = os.stat(path)
    node = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if not os.path.exists(node):
        raise OSError(f"{path} is on no block device (tmpfs, overlay?)")
    if os.path.exists(os.path.join(node, "partition")):
        node = os.path.join(os.path.realpath(node), os.pardir)
    with open(os.path.join(node, "dev")) as f:
        return f.read().strip()


def _cgroup_limit_file(op: str) -> tuple[str, str]:
    """This process's cgroup file that limits ``op``'s (``read`` or
    ``write``) byte rate, and its kind (``v2``: ``io.max``; ``v1``:
    ``blkio.throttle.<op>_bps_device``)."""
    if op not in ("read", "write"):
        raise ValueError(f"op must be read or write, got {op!r}")
    with open("/proc/self/cgroup") as f:
        lines = [ln.rstrip("\n").split(":", 2) for ln in f]
    for _, controllers, where in lines:
        if "blkio" in controllers.split(","):
            return (
                f"/sys/fs/cgroup/blkio{where.rstrip('/')}/blkio.throttle.{op}_bps_device",
                "v1",
            )
    for hid, _, where in lines:
        if hid == "0" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            return f"/sys/fs/cgroup{where.rstrip('/')}/io.max", "v2"
    raise OSError("no cgroup I/O controller for this process")


@contextlib.contextmanager
def io_throttle(path: str, bytes_per_s: int, op: str = "read"):
    """``op`` (``read`` or ``write``) of the block device holding ``path``
    limited to ``bytes_per_s`` for this process's cgroup (its children
    included) while the block runs: a drive that slow, emulated on a faster
    one, so a load or a spill lasts as long as on the lent GPU's disk. The
    kernel's throttle (cgroup v1 ``blkio.throttle.<op>_bps_device`` or v2
    ``io.max``'s ``rbps``/``wbps``) counts O_DIRECT I/O, kvtier's and dd's
    alike (v1 does not count buffered writes, which the page cache absorbs);
    the other direction is not limited. Root only: an OSError naming the
    cgroup file where the host does not allow it. The limit that was there
    before is put back on exit."""
    dev = block_device_of(path)
    limit_file, kind = _cgroup_limit_file(op)
    key = "rbps" if op == "read" else "wbps"
    try:
        with open(limit_file) as f:
            before = [ln.split() for ln in f if ln.split()[:1] == [dev]]
        with open(limit_file, "w") as f:
            f.write(
                f"{dev} {bytes_per_s}" if kind == "v1" else f"{dev} {key}={bytes_per_s}"
            )
    except OSError as exc:
        raise OSError(
            f"cannot limit {op}s of {dev} in {limit_file}: {exc} (root and a "
            "writable cgroup I/O controller are needed)"
        ) from exc
    try:
        yield dev
    finally:
        if kind == "v1":
            old = before[0][1] if before else "0"  # 0 removes the rule
        else:
            bps = [x for x in (before[0] if before else []) if x.startswith(key + "=")]
            old = bps[0] if bps else f"{key}=max"
        with open(limit_file, "w") as f:
            f.write(f"{dev} {old}")


def direct_read_argv(
    fio: str | None, path: str, size: int, loops: int = 1
) -> list[str]:
    """The command line of an O_DIRECT, 1 MiB sequential read of the first
    ``size`` bytes of ``path``: fio's (JSON report) when ``fio`` is given,
    else dd's (its byte count on stderr)."""
    if fio is None:
        count = max(1, size >> 20)
        dd = ["dd", f"if={path}", "of=/dev/null", "bs=1M", f"count={count}"]
        return dd + ["iflag=direct"]
    return [
        fio,
        "--name=span",
        f"--filename={path}",
        "--rw=read",
        "--bs=1M",
        "--direct=1",
        "--ioengine=psync",
        f"--size={size}",
        "--offset=0",
        "--output-format=json",
        f"--loops={loops}",
    ]


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs``, nearest rank."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def step_summary(steps: list[float]) -> dict[str, Any]:
    """Engine step times (seconds) as the step benchmarks report them: how
    many, p50, p99 and max in milliseconds."""
    return {
        "steps": len(steps),
        "p50_ms": 1e3 * statistics.median(steps),
        "p99_ms": 1e3 * percentile(steps, 0.99),
        "max_ms": 1e3 * max(steps),
    }


def fio_sequential_read(
    fio: str, path: str, size: int, loops: int = 5, timeout: float = 300
) -> dict[str, Any]:
    """fio's O_DIRECT, 1 MiB sequential read of ``size`` bytes of ``path``
    from offset 0: the raw-drive baseline for kvtier's disk reads."""
    res = subprocess.run(
        direct_read_argv(fio, path, size, loops),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if res.returncode:
        return {"error": res.stderr[-300:]}
    job = json.loads(res.stdout)["jobs"][0]["read"]
    return {"gbps": job["bw_bytes"] / 1e9, "bytes": size}


def dd_direct_read(path: str, size: int, timeout: float = 300) -> dict[str, Any]:
    """dd's O_DIRECT, 1 MiB sequential read of the first ``size`` bytes of
    ``path``: the raw-drive baseline where no fio binary is at hand."""
    import re

    t0 = time.perf_counter()
    res = subprocess.run(
        direct_read_argv(None, path, size),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    seconds = time.perf_counter() - t0
    m = re.search(r"(\d+) bytes", res.stderr)
    if res.returncode or not m:
        return {"error": res.stderr[-300:]}
    return {"gbps": int(m.group(1)) / seconds / 1e9, "bytes": int(m.group(1))}


def direct_read_baseline(
    fio: str | None, path: str, size: int, drop: bool = True
) -> dict[str, Any]:
    """O_DIRECT sequential read of ``size`` bytes of ``path`` from offset 0
    (page cache dropped first where allowed and ``drop``): fio when given,
    else dd."""
    dropped = drop and drop_caches()
    if fio:
        out = {"tool": "fio", **fio_sequential_read(fio, path, size, loops=3)}
    else:
        out = {"tool": "dd", **dd_direct_read(path, size)}
    out["page_cache_dropped"] = dropped
    return out


def thread_times(main_tid: int) -> dict[str, dict[str, float]] | None:
    """What this process's threads and its descendants' ran and waited so
    far, grouped: ``main`` (thread ``main_tid``, the engine's loop; -1 for
    none), ``kvtier`` (kvtier's named threads, ``kvtier-*``, in any of them),
    ``other`` (the rest of this process: vLLM's, torch's, an I/O library's)
    and ``children`` (the rest below it). Per group: ``cpu_s`` (on a CPU),
    ``runqueue_s`` (runnable, waiting for a CPU) from
    ``/proc/<pid>/task/<tid>/schedstat``, and ``voluntary_switches`` (the
    times it slept: a wait for a lock such as the interpreter's, for I/O, or
    for a blocking GPU synchronisation) from its ``status``. Take two and
    subtract (:func:`times_delta`): threads that start or end between them
    skew the groups. None without ``/proc`` schedstat."""
    from kvtier.testing.procs import descendants, thread_names

    if not os.path.isdir("/proc/self/task"):
        return None
    me = os.getpid()
    groups = {
        g: {"cpu_s": 0.0, "runqueue_s": 0.0, "voluntary_switches": 0.0}
        for g in ("main", "kvtier", "other", "children")
    }
    read = 0
    for pid in {me, *descendants(me)}:
        for tid, name in thread_names(pid).items():
            if name.startswith("kvtier-"):
                group = "kvtier"
            elif pid != me:
                group = "children"
            else:
                group = "main" if tid == main_tid else "other"
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    cpu_ns, wait_ns = (int(x) for x in f.read().split()[:2])
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    switches = next(
                        int(line.split()[1])
                        for line in f
                        if line.startswith("voluntary_ctxt_switches")
                    )
            except (OSError, ValueError, StopIteration):
                continue  # it exited meanwhile, or no schedstat
            read += 1
            g = groups[group]
            g["cpu_s"] += cpu_ns / 1e9
            g["runqueue_s"] += wait_ns / 1e9
            g["voluntary_switches"] += switches
    return groups if read else None


def times_delta(
    before: dict[str, dict[str, float]] | None,
    after: dict[str, dict[str, float]] | None,
    per: float = 1.0,
) -> dict[str, dict[str, float]] | None:
    """``after - before`` of two :func:`thread_times`, each divided by
    ``per`` (e.g. the steps between them); None if either is."""
    if before is None or after is None or not per:
        return None
    return {g: {k: (after[g][k] - before[g][k]) / per for k in after[g]} for g in after}


def kvtier_threads_cpu_s() -> float | None:
    """CPU seconds run so far by kvtier's named threads (``kvtier-*``: the
    load thread, the read process and its read threads, the spill threads)
    in this process and every process below it (a multiprocess engine's
    core and workers): :func:`thread_times`'s ``kvtier`` group; None where
    that cannot be read (not Linux, a kernel without schedstat). Threads that
    exited are not counted: take it around a window in which kvtier's
    threads live on. Spills running in the window count too."""
    times = thread_times(main_tid=-1)
    return None if times is None else times["kvtier"]["cpu_s"]


def filesystem_of(path: str) -> str | None:
    """The file-system type ``path`` lives on (``/proc/mounts``, the longest
    mount point above it), e.g. ``ext4`` or ``tmpfs``; None if unknown."""
    real = os.path.realpath(path)
    best, fs = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                # Spaces and the like are octal escapes there (\040).
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1])
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fs = point, fields[2]
    except OSError:
        return None
    return fs


def model_cores_env() -> tuple[dict[str, str], str]:
    """The environment for an engine child whose model gets cores - 1 CPUs
    (``OMP_NUM_THREADS``), bound to the first ones in both engine modes
    (``VLLM_CPU_OMP_THREADS_BIND``: the multiprocess executor binds a CPU
    worker's OpenMP threads itself, to every CPU unless told), so kvtier's
    threads and children keep a core. The engine's OpenMP threads on every
    core would make any other work on the host stall their barriers: one
    busy neighbour took the decode step's max from 7 to 182 ms on a 2-core
    VM; vLLM's CPU deployment guide leaves one core free too. Either
    variable set in the environment wins. Returns (environment, a line
    saying what was chosen)."""
    omp = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 2) - 1))
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or ",".join(
        map(str, cpus[: int(omp)])
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["OMP_NUM_THREADS"] = omp
    if bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return env, f"OMP_NUM_THREADS={omp} VLLM_CPU_OMP_THREADS_BIND={bind or 'auto'}"


def bench_llm(
    model: str,
    bytes_per_block: int,
    gpu_blocks: int,
    max_model_len: int,
    kv_transfer_config: dict[str, Any] | None,
    block_size: int,
    max_num_batched_tokens: int | None = 512,
) -> Any:
    """The vllm-cpu engine of the real-engine benchmarks (``step_stall.py``,
    ``spill_decode.py``, ``e2e_ttft.py``): fp32, eager, prefix caching, a
    KV cache of ``gpu_blocks``, stats on (kvtier's counters are read from
    this process's Prometheus registry); steps of up to
    ``max_num_batched_tokens`` tokens (None: vLLM's default)."""
    from vllm import LLM

    return LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        block_size=block_size,
        num_gpu_blocks_override=gpu_blocks,
        kv_cache_memory_bytes=gpu_blocks * bytes_per_block,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_transfer_config=kv_transfer_config,
        seed=0,
        disable_log_stats=False,
        compilation_config={"mode": 0},
    )


class SpillRig:
    """A disk tier's spill path without an engine, built as the engine
    builds it, for the benchmarks that time spills (``spill_busy_loop.py``,
    ``reset_spills.py``): a CPU tier file of ``rows`` rows of random bytes
    (made as a worker makes it, attached as the scheduler side attaches
    it), a ``DiskStore`` of ``slots`` slots in ``directory`` (POSIX back
    end) and a ``DiskRuntime`` with ``threads`` I/O threads, running its
    jobs in this process or, with ``spill_process``, in its spill process.
    ``close()`` releases all of it (the directory stays the caller's)."""

    def __init__(
        self,
        directory: str,
        block: int,
        rows: int,
        slots: int,
        threads: int,
        spill_process: bool,
        tag: str,
    ):
        import numpy as np

        from kvtier.host.cpu_tier import AttachedRows, CpuBlockBuffer
        from kvtier.store.runtime import DiskRuntime
        from kvtier.store.slot import LayoutFingerprint
        from kvtier.store.store import DiskStore

        fp = LayoutFingerprint("bench", "bfloat16", block, f"{tag}-{block}", 0, 1)
        store = DiskStore([directory], slots, block, fp, backend="posix")
        path = os.path.join(directory, "cpu", "tier.cpu")
        os.mkdir(os.path.dirname(path), 0o700)
        self.buf = CpuBlockBuffer(rows, block, path, owner=True)
        try:
            rng = np.random.default_rng(0)
            self.buf.array[:] = rng.integers(0, 256, (rows, block), dtype=np.uint8)
            self.runtime = DiskRuntime(
                [store],
                [AttachedRows(path, rows, block)],
                threads=threads,
                spill_process=spill_process,
            )
        except BaseException:
            self.buf.close()
            raise

    def wait_for_spill_process(self, timeout: float = 60.0) -> None:
        """Wait until the spill process runs (it starts at the first job
        and takes jobs once ready); ``RuntimeError`` past ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.runtime.spill_pid is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the spill process did not start in {timeout} s")
            self.runtime.poll()
            time.sleep(0.01)

    def close(self) -> None:
        self.runtime.close()
        self.buf.close()
