"""Where a worker's background I/O work runs: its nice level, its CPUs, and
the name the OS shows for it.

The load thread (and the I/O threads it starts, which inherit both; the
read process takes both from it, :func:`thread_placement`) does work that
can wait a little; the model's step cannot.

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
without a move the load thread, and the read process that runs where it
does, would share the first OpenMP thread's single CPU: every batch it
verified or copied would hold back that thread and with it every parallel
region of the step.
:func:`spare_cpus` finds the CPUs left over on the worker's NUMA nodes (not
another worker's, and not a hyper-thread sibling of a model's core while
others are left) and the load thread moves there. When the OpenMP threads
took every CPU it stays (with a WARNING: reserve one). Nothing moves when
nothing was bound (GPU workers, an in-process engine without an OpenMP
binding).

A child process keeps the CPUs of the thread that started it only when it
does not inherit the binding too: vLLM preloads OpenMP (``LD_PRELOAD``) and
the runtime binds a new process's first thread to the first CPU of the list
as it loads. :func:`without_openmp_binding` is the environment to start
helper processes with.

Name: Python (before 3.14) leaves a thread's OS name (``top -H``, ``ps -L``,
``/proc/<pid>/task/<tid>/comm``) as its creator's, so kvtier's threads would
show as ``VLLM::Worker`` or ``python``; :func:`name_this_thread` gives each
long-lived one a ``kvtier-`` name, so an operator can see what they cost.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
from collections.abc import Callable, Mapping

from kvtier.log import get_logger

logger = get_logger("host")

# No CPU id above this is read from a list (a typo must not build a huge set).
MAX_CPU_ID = 1 << 16

# The variables that bind OpenMP threads to CPUs: Intel OpenMP's, GNU's, and
# the standard pair (vLLM's OpenMP manager writes one of the three).
OPENMP_BINDING = ("KMP_AFFINITY", "GOMP_CPU_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND")


def _lower_thread_priority(by: int) -> None:
    """Raise the calling thread's nice level by ``by`` (at most to 19).
    A sandbox without ``setpriority`` leaves it as it is (logged at debug)."""
    if by > 0:
        _raise_nice(lambda now: now + by)


def lower_thread_priority_to(nice: int | None) -> None:
    """Raise the calling thread's nice level to ``nice`` (at most 19) where
    it is lower; never lowers it (that needs a privilege). Nothing for
    None, off Linux, or in a sandbox without ``setpriority`` (logged at
    debug)."""
    if nice is not None:
        _raise_nice(lambda now: nice)


def _raise_nice(target: Callable[[int], int]) -> None:
    """Set the calling thread's nice level to ``target(now)`` (at most 19)
    where that is above ``now``, its level read once (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        nice = target(now)
        if nice > now:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, nice))
    except OSError as exc:
        logger.debug("kvtier: thread priority unchanged: %s", exc)


def thread_placement() -> tuple[int | None, set[int] | None]:
    """The calling thread's nice level and CPUs (Linux; None for what the
    platform does not keep per thread), for work another thread starts on
    its behalf to run where, and as, it does: the read process, started for
    the load thread by a thread that kept the worker's priority."""
    if not sys.platform.startswith("linux"):
        return None, None
    try:
        nice: int | None = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except OSError:
        nice = None
    try:
        cpus: set[int] | None = set(os.sched_getaffinity(0))  # this thread's
    except OSError:
        cpus = None
    return nice, cpus


def name_this_thread(name: str | None = None) -> None:
    """Linux: set the calling thread's OS name (``prctl(PR_SET_NAME)``, 15
    bytes kept) to ``name``, by default its Python name (``kvtier-load``,
    ``kvtier-posix_0``: one name for both). Never raises, as a
    ``ThreadPoolExecutor`` ``initializer`` must not: a name that does not
    encode, or a sandbox without ``prctl``, leaves the name as it is (logged
    at debug)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        if name is None:
            name = threading.current_thread().name
        raw = str(name).encode("utf-8", "replace")[:15]
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(15, ctypes.c_char_p(raw), 0, 0, 0) != 0:  # PR_SET_NAME
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NAME) failed")
    except Exception as exc:
        logger.debug("kvtier: thread name unchanged: %r", exc)


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
        if hi > MAX_CPU_ID:
            raise ValueError(f"CPU id over {MAX_CPU_ID}: {item!r}")
        cpus.update(range(lo, hi + 1, max(1, int(m.group(3) or 1))))
    return cpus


def _places(text: str) -> set[int]:
    """CPU ids of explicit ``OMP_PLACES`` like ``"{0,1},{2:2}"`` (vLLM writes
    ``"{0,1,2}"``); abstract names (``cores``, ``threads``) name no CPU.
    Place intervals (``{0}:4:2``) and exclusions (``!``) are not read:
    vLLM never writes them."""
    cpus: set[int] = set()
    for place in re.findall(r"\{([^}]*)\}", text):
        for item in place.split(","):
            parts = [int(p) for p in item.strip().split(":")] if item.strip() else []
            if len(parts) == 1:
                cpus.add(parts[0])
            elif len(parts) in (2, 3):
                start, length = parts[0], parts[1]
                stride = parts[2] if len(parts) == 3 else 1
                if start + length * abs(stride) > MAX_CPU_ID:
                    raise ValueError(f"CPU id over {MAX_CPU_ID}: {item!r}")
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


def bind_lists(value: str) -> list[set[int]]:
    """Each local rank's CPUs of a ``VLLM_CPU_OMP_THREADS_BIND`` list
    (``"0-31|32-63"``, vLLM's format: ids and ranges joined by commas, one
    list per rank joined by ``|``). Raises ValueError, naming the part,
    for anything vLLM would not read."""
    lists = []
    for part in value.strip().split("|"):
        if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", part.strip()):
            raise ValueError(
                f"VLLM_CPU_OMP_THREADS_BIND: {part!r} is not a CPU list like "
                "'0-14' or '0,2,4-7' (one per rank, joined by '|'), 'auto' or 'nobind'"
            )
        lists.append(_cpu_list(part))
    return lists


def listed_workers_cpus(env: Mapping[str, str] = os.environ) -> set[int]:
    """The CPUs of all workers' OpenMP threads on this host (this one's
    included) when the user listed them (:func:`bind_lists`, inherited by
    every worker); empty for ``auto`` (vLLM gives each rank a NUMA node of
    its own), ``nobind`` or a value vLLM would refuse."""
    value = env.get("VLLM_CPU_OMP_THREADS_BIND", "").strip()
    if value in ("", "auto", "nobind"):
        return set()
    try:
        return set().union(*bind_lists(value))
    except ValueError as exc:
        logger.debug("kvtier: %s", exc)
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


def hyperthread_siblings(
    cpus: set[int], root: str = "/sys/devices/system/cpu"
) -> set[int]:
    """The other logical CPUs of the physical cores of ``cpus`` (vLLM's
    automatic binding takes one per core on x86); empty where unknown."""
    out: set[int] = set()
    for cpu in cpus:
        path = os.path.join(root, f"cpu{cpu}", "topology", "thread_siblings_list")
        try:
            with open(path) as f:
                out |= _cpu_list(f.read())
        except (OSError, ValueError):
            continue
    return out - cpus


def physical_cores(cpus: set[int], root: str = "/sys/devices/system/cpu") -> int:
    """How many physical cores ``cpus`` span (each CPU its own where the
    topology cannot be read)."""
    cores = set()
    for cpu in cpus:
        topo = os.path.join(root, f"cpu{cpu}", "topology")
        try:
            with open(os.path.join(topo, "physical_package_id")) as f:
                package = f.read().strip()
            with open(os.path.join(topo, "core_id")) as f:
                cores.add((package, f.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return len(cores)


def spare_cpus(
    bound: set[int],
    allowed: set[int],
    *,
    taken: set[int] | None = None,
    near: set[int] | None = None,
    siblings: set[int] | None = None,
) -> set[int] | None:
    """The CPUs where a background thread should run, given this worker's
    OpenMP threads' ``bound`` CPUs, the CPUs the engine may use
    (``allowed``), all workers' OpenMP CPUs (``taken``), the CPUs of
    ``bound``'s NUMA nodes (``near``, None: unknown) and the hyper-thread
    siblings of ``bound`` (``siblings``): those near ``bound`` that no
    OpenMP thread was given, not sharing a core with one where others are
    left; empty when there are none. None when nothing is bound."""
    if not bound or not allowed:
        return None
    pool = allowed & near if near and allowed & near else set(allowed)
    free = pool - bound - (taken or set())
    return (free - (siblings or set())) or free


def _engine_cpus() -> set[int] | None:
    """The CPUs vLLM cut this worker's binding from: those of the process
    that started it, when that is vLLM's multiprocess executor (this
    process is its ``multiprocessing`` child). None otherwise: an
    in-process engine's parent is a shell or launcher whose CPUs may be
    wider than a ``taskset`` the user gave this process."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None or parent.pid != os.getppid():
        return None
    return set(os.sched_getaffinity(parent.pid))


def place_background_thread(nice: int) -> None:
    """Lower the calling thread's priority by ``nice`` and move it off the
    CPUs of this process's OpenMP threads (see the module doc), within the
    CPUs of the process that started the worker (vLLM's engine core, whose
    affinity vLLM's binding was cut from). Never raises: anything that
    fails leaves the thread where it is (logged)."""
    _lower_thread_priority(nice)
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        _move_off_openmp_cpus()
    except Exception as exc:  # never worth failing the load thread for
        logger.warning("kvtier: the load thread stays on its CPUs: %r", exc)


def _move_off_openmp_cpus() -> None:
    bound = openmp_cpus()
    if not bound:
        return  # GPU workers, in-process engines: nothing to move away from
    allowed = _engine_cpus()
    if allowed is None or not bound <= allowed:
        logger.debug("kvtier: OpenMP binding %s not vLLM's: CPUs kept", bound)
        return
    listed = listed_workers_cpus()
    where = spare_cpus(
        bound,
        allowed,
        taken=listed,
        near=numa_neighbours(bound),
        siblings=hyperthread_siblings(bound | listed),
    )
    if where is None:
        return
    if not where:
        # Nowhere else to go. Spreading over every OpenMP CPU measured no
        # better than staying on the first (docs/benchmarks.md, "Where
        # loads run"), so the thread stays.
        fix = (
            "drop a CPU from VLLM_CPU_OMP_THREADS_BIND's list"
            if listed
            else "raise VLLM_CPU_NUM_OF_RESERVED_CPU, or list the model's CPUs "
            "in VLLM_CPU_OMP_THREADS_BIND without one of them"
        )
        logger.warning(
            "kvtier: no CPU of this worker's NUMA node is left outside the "
            "workers' OpenMP CPUs (this worker's: %s): disk and CPU-tier loads "
            "share them and slow the model's steps. Leave one free: %s.",
            _ranges(bound),
            fix,
        )
        return
    os.sched_setaffinity(0, where)
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
