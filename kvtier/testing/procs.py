"""The processes an engine started, read from ``/proc`` (Linux): for tests
and benchmarks that check or measure a multiprocess engine's core, workers
and read processes from the process that started it."""

from __future__ import annotations

import os


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
