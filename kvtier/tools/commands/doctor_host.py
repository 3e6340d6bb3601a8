"""``kvtier doctor``: the host beyond the disk paths.

- which disk I/O path kvtier takes here and why (the decision of
  :func:`kvtier.store.backends.factory.make_backend`, with kvikio's own probes, which
  never hang and never need a GPU to answer), and whether the host's memory
  holds each worker's disk load buffer;
- shared memory for the CPU tier (the engine's own space rule,
  :func:`kvtier.connector.preflight.check_shm_space`, which names the other
  kvtier files holding it) and dead engines' files in this user's CPU-tier
  directories (:func:`kvtier.host.cpu_tier.cpu_tier_dirs`,
  :func:`kvtier.host.cpu_tier.reclaim_stale_cpu_files`), and another user
  holding its predictable name;
- prefix hashing: whether block keys survive a restart;
- on the CPU platform, whether vLLM leaves a CPU outside the model's
  OpenMP threads for kvtier's loads (:mod:`kvtier.host.placement`).
"""

from __future__ import annotations

import ctypes.util
import os
import shutil

from kvtier.connector.config import ConfigError, KvtierConfig
from kvtier.connector.preflight import check_shm_space
from kvtier.host.cpu_tier import (
    cpu_tier_dir,
    cpu_tier_dirs,
    held_by_another,
    reclaim_stale_cpu_files,
)
from kvtier.host.placement import (
    bind_lists,
    numa_neighbours,
    physical_cores,
    spare_cpus,
)
from kvtier.tools.commands.common import fmt_bytes
from kvtier.tools.commands.doctor import ERROR, OK, WARNING, Check


def _gds_host_facts() -> str:
    """Driver and cuFile presence, from files only (nothing is loaded)."""
    driver = os.path.exists("/proc/driver/nvidia/version")
    nvidia_fs = os.path.exists("/proc/driver/nvidia-fs")
    cufile = ctypes.util.find_library("cufile")
    return (
        f"NVIDIA driver {'loaded' if driver else 'absent'}, "
        f"nvidia-fs (GDS) driver {'loaded' if nvidia_fs else 'absent'}, "
        f"libcufile {'found' if cufile else 'absent'}"
    )


def check_io_path(cfg: KvtierConfig) -> list[Check]:
    """kvikio/GDS status and the back end ``disk_io`` gets on this host."""
    if not cfg.disk_enabled:
        return []
    from kvtier.store.backends import kvikio_probe as kb

    facts = _gds_host_facts()
    usable, why = kb.usable_status()
    out: list[Check] = []
    if usable:
        gds, gds_why = kb.gds_status()
        mode = "GPUDirect Storage active" if gds else f"compat mode ({gds_why})"
        out.append(Check("io", "kvikio", OK, f"usable, {mode}; {facts}"))
    else:
        gds = False
        out.append(Check("io", "kvikio", OK, f"not usable: {why}; {facts}"))
    if cfg.disk_io == "posix":
        path, status, fix = "posix threads (disk_io='posix')", OK, ""
    elif cfg.disk_io == "kvikio" and not usable:
        path, status = (
            "none: engine start fails (disk_io='kvikio' but kvikio is not usable)",
            ERROR,
        )
        fix = "set disk_io to 'auto' or 'posix', or install kvikio with a CUDA driver (docs/gds.md)"
    elif usable:
        mode = (
            "GDS (NVMe <-> GPU, no host bounce)"
            if gds
            else "compat mode (POSIX I/O through a bounce buffer)"
        )
        path, fix = f"kvikio, {mode} (disk_io={cfg.disk_io!r})", ""
        status = WARNING if cfg.disk_io == "kvikio" and not gds else OK
        if status == WARNING:
            fix = "load nvidia-fs and use a GDS-capable file system for GPUDirect (docs/gds.md); compat mode is correct, only slower"
    else:
        path, status, fix = (
            "posix threads, O_DIRECT where the path accepts it (disk_io='auto', kvikio not usable)",
            OK,
            "",
        )
    out.append(Check("io", "disk I/O path", status, path, fix))
    try:  # each worker allocates it (page-locked on CUDA) as it starts
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        host = 0
    free = _available_memory()
    fix = "lower disk_load_buffer_bytes (the default, 64M, keeps a fast drive busy)"
    if host and cfg.disk_load_buffer_bytes > host:
        out.append(
            Check(
                "io",
                "disk load buffer",
                ERROR,
                f"disk_load_buffer_bytes, {fmt_bytes(cfg.disk_load_buffer_bytes)} "
                f"per worker, exceeds this host's {fmt_bytes(host)} of memory: "
                "every worker fails to start",
                fix,
            )
        )
    elif free is not None and cfg.disk_load_buffer_bytes > free:
        out.append(
            Check(
                "io",
                "disk load buffer",
                WARNING,
                f"disk_load_buffer_bytes, {fmt_bytes(cfg.disk_load_buffer_bytes)} "
                f"per worker, exceeds the {fmt_bytes(free)} of memory available "
                "now: a worker may be killed for memory as it starts",
                fix,
            )
        )
    return out


def _available_memory() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where unreadable):
    what can be allocated now without swapping."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_shm(cfg: KvtierConfig, base: str | None, reclaim: bool) -> list[Check]:
    """Room for ``cpu_bytes_to_use`` and stale CPU-tier files of this user
    in the CPU tier's shared-memory file system (``base``, else the one the
    engine chooses)."""
    if base is not None and not os.path.isdir(base):
        return [
            Check(
                "shm",
                f"{base}: exists",
                ERROR,
                "--shm-dir does not exist or is not a directory",
                "give the shared-memory mount the engine uses (/dev/shm unless "
                "the host has none), or leave --shm-dir out",
            )
        ]
    directory = cpu_tier_dir(base)
    base = os.path.dirname(directory)
    out: list[Check] = []
    holder = held_by_another(directory)
    if holder is not None:
        out.append(
            Check(
                "shm",
                f"{directory}: owner",
                WARNING,
                f"held by uid {holder}, not by this user: engines put their CPU "
                f"tier in a directory of this user's own beside it "
                f"(kvtier-{os.geteuid()}-<random>)",
                f"another local user made it; root can remove it (rm -r "
                f"{directory}), or run the engine with a /dev/shm of its own",
            )
        )
    stale: list[tuple[str, int]] = []
    for each in cpu_tier_dirs(base):
        if os.path.isdir(each) and not os.path.islink(each):
            stale += reclaim_stale_cpu_files(each, dry_run=not reclaim)
    stale_bytes = sum(n for _, n in stale)
    names = ", ".join(os.path.basename(p) for p, _ in stale)
    subject = f"{directory}: stale files"
    if stale and reclaim:
        removed = f"removed {len(stale)} dead engine file(s), {fmt_bytes(stale_bytes)}"
        out.append(Check("shm", subject, OK, f"{removed}: {names}"))
        stale_bytes = 0
    elif stale:
        out.append(
            Check(
                "shm",
                subject,
                WARNING,
                f"{len(stale)} CPU-tier file(s) of engines no longer running pin "
                f"{fmt_bytes(stale_bytes)} of shared memory: {names}",
                "kvtier doctor --reclaim-stale removes them (an engine starting "
                "here also does)",
            )
        )
    else:
        out.append(Check("shm", subject, OK, "none"))
    room = f"{base}: room for the CPU tier"
    try:
        check_shm_space(directory, cfg.cpu_bytes_to_use, [p for p, _ in stale])
    except ConfigError as exc:
        fix = "docker run --shm-size=<more>, or lower cpu_bytes_to_use"
        return [*out, Check("shm", room, ERROR, str(exc), fix)]
    out.append(
        Check(
            "shm",
            room,
            OK,
            f"needs {fmt_bytes(cfg.cpu_bytes_to_use)}, "
            f"{fmt_bytes(shutil.disk_usage(base).free)} free"
            + (
                f" (+{fmt_bytes(stale_bytes)} stale, reclaimed at start)"
                if stale_bytes
                else ""
            ),
        )
    )
    return out


def check_prefix_hash(algo: str) -> list[Check]:
    """Whether vLLM's prefix block hashes (kvtier's keys) are the same after a
    restart: ``--prefix-caching-hash-algo`` and ``PYTHONHASHSEED``."""
    from kvtier.connector.identity import HASH_FIX, prefix_hash_problem

    seed = os.environ.get("PYTHONHASHSEED")
    subject = f"prefix hash {algo}"
    problem = prefix_hash_problem(algo, seed)
    if problem:
        return [Check("warm-restart", subject, WARNING, problem, HASH_FIX)]
    if seed is not None:  # vLLM's rule: any value set, even empty, is the seed
        detail = (
            f"PYTHONHASHSEED={seed!r} seeds the hashes: keep it identical on "
            "every start, or the disk tier starts cold"
        )
    else:
        detail = (
            "reproducible across restarts (PYTHONHASHSEED unset; setting it "
            "later changes every key once)"
        )
    return [Check("warm-restart", subject, OK, detail)]


def _cpu_fix(auto: bool) -> str:
    if auto:
        return (
            "leave a CPU outside the model's: VLLM_CPU_NUM_OF_RESERVED_CPU (vLLM "
            "reserves only while the node has more cores than that), or list the "
            "model's CPUs in VLLM_CPU_OMP_THREADS_BIND without one (e.g. 0-14 on 16)"
        )
    return "leave a CPU outside the model's: drop one from VLLM_CPU_OMP_THREADS_BIND"


def check_cpu_placement(
    env: dict[str, str] | None = None,
    allowed: set[int] | None = None,
    topology: str = "/sys/devices/system",
) -> list[Check]:
    """CPU platform: where kvtier's loads will run. vLLM binds a CPU worker's
    OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``) and kvtier's load thread
    and read process take the CPUs of its NUMA node left over
    (:mod:`kvtier.host.placement`); with none left they share the model's
    and stretch its steps while a prefix loads. ``allowed``: the CPUs
    ``vllm serve`` would get (this process's); ``topology``: where the
    host's CPU and NUMA topology is read (``node/``, ``cpu/``)."""
    env = dict(os.environ) if env is None else env
    if allowed is None:
        allowed = (
            set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
        )
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "").strip() or "auto"
    status, detail, fix = _cpu_placement(bind, env, allowed, topology)
    return [Check("cpu", f"VLLM_CPU_OMP_THREADS_BIND={bind}", status, detail, fix)]


def _cpu_placement(
    bind: str, env: dict[str, str], allowed: set[int], topology: str
) -> tuple[str, str, str]:
    """(status, detail, fix) of the CPU placement check for ``bind``."""
    if bind == "nobind":
        return (
            WARNING,
            "the model's OpenMP threads are not bound: kvtier's loads cannot "
            "keep off their CPUs",
            _cpu_fix(auto=False).replace("drop one from", "set"),
        )
    if bind == "auto":
        # vLLM (utils/ompmultiprocessing.py) reserves one CPU per worker, and
        # one more per worker with a KV connector (kvtier is one), unless
        # VLLM_CPU_NUM_OF_RESERVED_CPU says otherwise; and only while the
        # node has more cores than it would reserve. Counted here for TP=1.
        reserved_env = env.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "").strip()
        try:
            reserve = int(reserved_env) if reserved_env else 2
        except ValueError:
            reserve = 2
        cores = physical_cores(allowed, os.path.join(topology, "cpu"))
        if reserve <= 0 or cores <= reserve:
            return (
                WARNING,
                f"{cores} core(s), {reserve} to reserve: vLLM's automatic binding "
                "keeps no CPU outside the model's here, so kvtier's loads share "
                "the model's cores",
                _cpu_fix(auto=True),
            )
        return (
            OK,
            f"{cores} cores: vLLM keeps {reserve} CPU(s) per worker outside the "
            "model's (one for the engine, one for a KV connector); kvtier's "
            "loads run there (the engine logs 'loads run on CPUs ...')",
            "",
        )
    try:
        lists = bind_lists(bind)
    except ValueError as exc:
        return ERROR, "vLLM cannot read this binding", str(exc)
    taken = set().union(*lists)
    crowded = [
        rank
        for rank, cpus in enumerate(lists)
        if not spare_cpus(
            cpus,
            allowed,
            taken=taken,
            near=numa_neighbours(cpus, os.path.join(topology, "node")),
        )
    ]
    if crowded:
        return (
            WARNING,
            f"rank(s) {crowded}: no CPU of their NUMA node is left outside the "
            "workers' OpenMP CPUs, so kvtier's loads share the model's",
            _cpu_fix(auto=False),
        )
    return (
        OK,
        "every rank has CPUs of its NUMA node outside the workers' OpenMP "
        "CPUs: kvtier's loads run there",
        "",
    )
