"""The processes an engine started, and the shared memory they leave, read
from ``/proc`` (Linux): for tests and benchmarks that check or measure a
multiprocess engine's core, workers and read processes from the process
that started it, and for tests that end one by force."""

from __future__ import annotations

import os
import time


def wait_gone(pid: int, timeout: float) -> bool:
    """Whether this process's child ``pid``, killed or told to exit, is gone
    within ``timeout`` seconds: reaped by its owner (a ``Popen``), or reaped
    here once it exited (its owner's wait for the kill may end before a
    loaded host lets it exit)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return True  # it had exited: reaped now
        except ChildProcessError:
            return True  # reaped already
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def parent_pid(pid: int) -> int | None:
    """``pid``'s parent, or None once it exited (or without ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The name, in parentheses, may hold spaces and ')': split after it.
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, theirs, ...), not ``pid``
    itself; empty without ``/proc``. A snapshot: processes start and exit."""
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return set()
    parent_of = {p: parent_pid(p) for p in entries}
    below: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, up in parent_of.items() if up in frontier} - below
        below |= frontier
    return below


def children(pid: int) -> list[int]:
    """``pid``'s direct children now; empty without ``/proc``."""
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    return [p for p in entries if parent_pid(p) == pid]


def command(pid: int) -> str | None:
    """``pid``'s name (what ``top`` shows; vLLM renames its processes, e.g.
    ``VLLM::EngineCore``) and command line, in one string; None once it
    exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return stat[stat.index("(") + 1 : stat.rindex(")")] + " " + cmdline.strip()


def read_processes(root: int) -> list[int]:
    """The kvtier read processes below ``root`` (by their command line,
    ``python -m kvtier.store.read_process``), named or not yet. A fork of
    one before its exec carries the same command line but is not one: its
    back end's import runs ``/sbin/ldconfig -p`` (kvikio's
    cuda.pathfinder, through ``ctypes.util.find_library``), and CI caught
    such a fork; a process whose parent has that command line is left out."""
    found = []
    for pid in sorted(descendants(root)):
        if _READ_PROCESS not in (command(pid) or ""):
            continue
        parent = parent_pid(pid)
        if parent is None or _READ_PROCESS in (command(parent) or ""):
            continue
        found.append(pid)
    return found


_READ_PROCESS = "-m kvtier.store.read_process"


def thread_names(pid: int) -> dict[int, str]:
    """``pid``'s threads and the names ``ps`` and ``top`` show for them;
    empty once it exited."""
    out: dict[int, str] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except OSError:
            continue  # it exited meanwhile
    return out


def terminal_standing(pid: int) -> tuple[bool, bool, bool]:
    """For a helper process ``pid`` of this process: (in this process's
    session, leads a process group of its own, ignores SIGTTOU)."""
    import re
    import signal

    with open(f"/proc/{pid}/status") as f:
        status = f.read()
    found = re.search(r"^SigIgn:\s*([0-9a-f]+)$", status, re.M)
    ignored = int(found[1], 16) if found else 0
    return (
        os.getsid(pid) == os.getsid(0),
        os.getpgid(pid) == pid != os.getpgid(0),
        bool(ignored >> (signal.SIGTTOU - 1) & 1),
    )


SHM = "/dev/shm"


def shm_entries() -> set[str]:
    """The names in ``/dev/shm`` now (empty where there is none)."""
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def shm_in_use() -> set[str]:
    """The names in ``/dev/shm`` that a live process maps or holds open
    (those of processes this user may not read are missed)."""
    held: set[str] = set()
    prefix = SHM + "/"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find(prefix)
                    if at >= 0:
                        held.add(line[at + len(prefix) :].split("/")[0].split()[0])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    held.add(target[len(prefix) :].split("/")[0])
        except OSError:
            continue  # it exited meanwhile, or is not ours to read
    return held


def shm_left_behind(before: set[str]) -> list[str]:
    """The names that appeared in ``/dev/shm`` since ``before`` and that no
    live process uses: what processes that ended left there."""
    return sorted((shm_entries() - before) - shm_in_use())


def remove_shm_left_behind(before: set[str], prefixes: tuple[str, ...]) -> list[str]:
    """Remove what :func:`shm_left_behind` finds among names starting with
    ``prefixes`` (a test that killed an engine cleans up after it, as its
    operator would); returns the names removed."""
    removed = []
    for name in shm_left_behind(before):
        if name.startswith(prefixes):
            try:
                os.unlink(os.path.join(SHM, name))
            except OSError:
                continue  # a directory, or gone meanwhile
            removed.append(name)
    return removed
