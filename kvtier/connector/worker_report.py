"""What the workers tell the scheduler side: one report per step.

vLLM carries a connector's worker metadata from every worker to the
scheduler once per step and sums it (``aggregate``). kvtier's part of it is
one :class:`WorkerReport`: which disk blocks loads could not use and why,
which stores failed, the workers' counters since their last report and the
latencies of their disk read batches. The
connector worker builds it (:mod:`kvtier.connector.connector`), the manager
applies it (``TieredOffloadingManager.note_worker_report``).

Counter names are the reader's (:class:`~kvtier.store.slabs.SlabStats`):
``read_bytes``, ``read_seconds``, ``checksum_failures``,
``io_errors``; and ``exceptions``, the jobs that raised in a worker.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, fields


@dataclass
class WorkerCounters:
    """Counters of the workers' disk reads and contained exceptions: since
    the last report in a :class:`WorkerReport`, cumulative in the manager."""

    read_bytes: int = 0
    read_seconds: float = 0.0
    checksum_failures: int = 0  # slots that failed verification, never loaded
    io_errors: int = 0
    exceptions: int = 0  # transfer jobs that raised (contained, failed whole)

    def __add__(self, other: WorkerCounters) -> WorkerCounters:
        return WorkerCounters(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )


@dataclass
class WorkerReport:
    """One step's report of one worker, or of all (:meth:`merge`).

    ``corrupt_keys``: per request, the disk blocks its load could not use
    because their bytes failed verification (the scheduler drops those
    copies). ``io_failed_keys``: per request, disk blocks whose read failed
    with an I/O error (the copies stay, counted). ``unread_keys``: per
    request, disk blocks not delivered for another reason (not read, the
    job raised or was given up: the copies are kept). The three are the
    disk core's read-failure rule (:mod:`kvtier.tiers.disk_core`).
    ``failed_store_rows``: CPU rows of stores that failed; never readable.
    ``failed_loads``: requests whose load failed whole (the job raised or
    was given up): none of its blocks landed, its CPU-tier blocks included.
    """

    corrupt_keys: dict[str, list[bytes]] = field(default_factory=dict)
    unread_keys: dict[str, list[bytes]] = field(default_factory=dict)
    failed_store_rows: list[int] = field(default_factory=list)
    counters: WorkerCounters = field(default_factory=WorkerCounters)
    io_failed_keys: dict[str, list[bytes]] = field(default_factory=dict)
    # Seconds each disk read batch took, issued to verified.
    read_latencies: list[float] = field(default_factory=list)
    failed_loads: list[str] = field(default_factory=list)

    def merge(self, other: WorkerReport) -> WorkerReport:
        """A new report with both reports' contents (neither is changed)."""

        def keys(mine: dict[str, list[bytes]], theirs: dict[str, list[bytes]]):
            out = {req_id: list(held) for req_id, held in mine.items()}
            for req_id, held in theirs.items():
                out.setdefault(req_id, []).extend(held)
            return out

        return WorkerReport(
            keys(self.corrupt_keys, other.corrupt_keys),
            keys(self.unread_keys, other.unread_keys),
            self.failed_store_rows + other.failed_store_rows,
            self.counters + other.counters,
            keys(self.io_failed_keys, other.io_failed_keys),
            self.read_latencies + other.read_latencies,
            self.failed_loads + other.failed_loads,
        )


class CounterDeltas:
    """What cumulative totals grew by since the previous call: the one
    place that turns totals into deltas (worker reports, Prometheus
    counters, which vLLM increases by deltas).

    ``delta(key, total)`` returns ``total`` minus the total given with the
    same key last time (0 the first time). Not thread-safe: one caller."""

    def __init__(self) -> None:
        self._last: dict[Hashable, float] = {}

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` was given a total before."""
        return key in self._last

    def delta(self, key: Hashable, total: float) -> float:
        last = self._last.get(key, 0)
        self._last[key] = total
        return total - last
