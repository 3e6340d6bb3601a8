"""Where a worker's background I/O work runs: its nice level and its CPUs.

The load thread (and the read process and I/O threads it starts, which
inherit both) does work that can wait a little; the model's step cannot.

Nice level: Linux keeps one per thread, so a background thread can give the
cores to the thread that started it without touching the rest of the
process; raising one's own nice level is always permitted. Elsewhere
``setpriority`` would reach the whole process, so nothing is done.

CPUs: on the CPU platform vLLM's multiprocess executor binds each worker's
OpenMP threads, the model runner's thread among them, to a list of CPUs
(``VLLM_CPU_OMP_THREADS_BIND``; with ``auto`` one NUMA node per rank) and
leaves the rest of the engine's CPUs (``VLLM_CPU_NUM_OF_RESERVED_CPU``, one
more when a KV connector is configured) to the engine core, the API server
and a KV connector's threads. A thread inherits its creator's affinity, so
without a move the load thread, and the read process it spawns, would share
the first OpenMP thread's single CPU: every batch it verified or copied
would hold back that thread and with it every parallel region of the step.
:func:`spare_cpus` finds the CPUs left over on the worker's NUMA nodes (not
another worker's) and the load thread moves there. When the OpenMP threads
took every CPU it stays (with a WARNING: reserve one). Nothing moves when
nothing was bound (GPU workers, an in-process engine without an OpenMP
binding).

A child process keeps the CPUs of the thread that started it only when it
does not inherit the binding too: vLLM preloads OpenMP (``LD_PRELOAD``) and
the runtime binds a new process's first thread to the first CPU of the list
as it loads. :func:`without_openmp_binding` is the environment to start
helper processes with.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from collections.abc import Mapping

logger = logging.getLogger("kvtier.io")

# The variables that bind OpenMP threads to CPUs: Intel OpenMP's, GNU's, and
# the standard pair (vLLM's OpenMP manager writes one of the three).
OPENMP_BINDING = ("KMP_AFFINITY", "GOMP_CPU_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND")


def lower_thread_priority(by: int) -> None:
    """Raise the calling thread's nice level by ``by`` (at most to 19).
    A sandbox without ``setpriority`` leaves it as it is (logged at debug)."""
    if not sys.platform.startswith("linux") or by <= 0:
        return
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + by))
    except OSError as exc:
        logger.debug("kvtier: thread priority unchanged: %s", exc)


def _cpu_list(text: str) -> set[int]:
    """CPU ids of a list like ``"0,2-4"``, ``"0 3 1-2 8-15:2"`` (GNU
    ``GOMP_CPU_AFFINITY``, ranges with an optional stride)."""
    cpus: set[int] = set()
    for item in re.split(r"[\s,]+", text.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", item)
        if m is None:
            raise ValueError(f"not a CPU list item: {item!r}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        cpus.update(range(lo, hi + 1, int(m.group(3) or 1)))
    return cpus


def _places(text: str) -> set[int]:
    """CPU ids of explicit ``OMP_PLACES`` like ``"{0,1},{2:2}"`` (vLLM writes
    ``"{0,1,2}"``); abstract names (``cores``, ``threads``) name no CPU."""
    cpus: set[int] = set()
    for place in re.findall(r"\{([^}]*)\}", text):
        for item in place.split(","):
            parts = [int(p) for p in item.strip().split(":")] if item.strip() else []
            if len(parts) == 1:
                cpus.add(parts[0])
            elif len(parts) in (2, 3):
                start, length = parts[0], parts[1]
                stride = parts[2] if len(parts) == 3 else 1
                cpus.update(start + i * stride for i in range(length))
    return cpus


def openmp_cpus(env: Mapping[str, str] = os.environ) -> set[int]:
    """The CPUs this process's OpenMP threads are bound to, from the
    variables vLLM's OpenMP manager sets for a CPU worker (the same ones a
    user sets by hand): Intel OpenMP's ``KMP_AFFINITY`` proclist, GNU
    ``GOMP_CPU_AFFINITY``, or ``OMP_PLACES`` with ``OMP_PROC_BIND`` on.
    Empty when nothing is bound or the value cannot be read."""
    try:
        kmp = re.search(r"proclist=\[([^\]]*)\]", env.get("KMP_AFFINITY", ""))
        if kmp:
            return _cpu_list(kmp.group(1))
        if env.get("GOMP_CPU_AFFINITY", "").strip():
            return _cpu_list(env["GOMP_CPU_AFFINITY"])
        bind = env.get("OMP_PROC_BIND", "").strip().lower()
        if bind and bind != "false" and env.get("OMP_PLACES"):
            return _places(env["OMP_PLACES"])
    except ValueError as exc:
        logger.debug("kvtier: OpenMP binding not understood: %s", exc)
    return set()


def without_openmp_binding(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less :data:`OPENMP_BINDING`: for a helper process that runs
    no OpenMP code and should keep the CPUs of the thread that starts it."""
    return {k: v for k, v in env.items() if k not in OPENMP_BINDING}


def other_workers_cpus(env: Mapping[str, str] = os.environ) -> set[int]:
    """The CPUs of every worker's OpenMP threads on this host when the user
    listed them (``VLLM_CPU_OMP_THREADS_BIND="0-31|32-63"``, one list per
    local rank, inherited by every worker); empty for ``auto`` (vLLM gives
    each rank a NUMA node of its own) and ``nobind``."""
    value = env.get("VLLM_CPU_OMP_THREADS_BIND", "").strip()
    if value in ("", "auto", "nobind"):
        return set()
    try:
        return set().union(*(_cpu_list(part) for part in value.split("|")))
    except ValueError as exc:
        logger.debug("kvtier: VLLM_CPU_OMP_THREADS_BIND not understood: %s", exc)
        return set()


def numa_neighbours(
    cpus: set[int], root: str = "/sys/devices/system/node"
) -> set[int] | None:
    """Every CPU of the NUMA nodes that hold ``cpus`` (where a worker's
    memory is bound too); None where the topology cannot be read."""
    near: set[int] = set()
    try:
        for node in os.listdir(root):
            if not re.fullmatch(r"node\d+", node):
                continue
            with open(os.path.join(root, node, "cpulist")) as f:
                members = _cpu_list(f.read())
            if members & cpus:
                near |= members
    except (OSError, ValueError):
        return None
    return near or None


def spare_cpus(
    bound: set[int],
    allowed: set[int],
    *,
    taken: set[int] | None = None,
    near: set[int] | None = None,
) -> set[int] | None:
    """The CPUs where a background thread should run, given this worker's
    OpenMP threads' ``bound`` CPUs, the CPUs the engine may use
    (``allowed``), the other workers' OpenMP CPUs (``taken``) and the CPUs
    of ``bound``'s NUMA nodes (``near``, None: unknown): those near
    ``bound`` that no OpenMP thread was given; empty when there are none.
    None when nothing is bound."""
    if not bound or not allowed:
        return None
    pool = allowed & near if near and allowed & near else set(allowed)
    return pool - bound - (taken or set())


def place_background_thread(nice: int) -> None:
    """Lower the calling thread's priority by ``nice`` and move it off the
    CPUs of this process's OpenMP threads (see the module doc). The CPUs
    the engine may use are its parent's (vLLM's engine core under the
    multiprocess executor, whose affinity vLLM's binding was cut from).
    Never raises: a refused ``sched_setaffinity`` leaves the thread where it
    is (logged)."""
    lower_thread_priority(nice)
    if not hasattr(os, "sched_setaffinity"):
        return
    bound = openmp_cpus()
    try:
        allowed = os.sched_getaffinity(os.getppid())
    except OSError:
        return
    where = spare_cpus(
        bound, allowed, taken=other_workers_cpus(), near=numa_neighbours(bound)
    )
    if where is None:
        return
    if not where:
        # Nowhere else to go. Spreading over every OpenMP CPU measured no
        # better than staying on the first (docs/benchmarks.md, "Where
        # loads run"), so the thread stays.
        logger.warning(
            "kvtier: the model's OpenMP threads are bound to every CPU (%s): disk "
            "and CPU-tier loads share them and slow its steps. Leave one free "
            "(VLLM_CPU_NUM_OF_RESERVED_CPU, or VLLM_CPU_OMP_THREADS_BIND).",
            _ranges(bound),
        )
        return
    try:
        os.sched_setaffinity(0, where)
    except OSError as exc:
        logger.warning("kvtier: the load thread stays on its CPUs: %s", exc)
        return
    logger.info(
        "kvtier: loads run on CPUs %s, beside the model's OpenMP CPUs %s",
        _ranges(where),
        _ranges(bound),
    )


def _ranges(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` as ``"0-2,5"``."""
    out: list[str] = []
    for cpu in sorted(cpus):
        if out and out[-1].split("-")[-1] == str(cpu - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{cpu}"
        else:
            out.append(str(cpu))
    return ",".join(out)
