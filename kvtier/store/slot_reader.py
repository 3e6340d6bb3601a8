"""Read-only, verified access to one rank's disk slots, for loads.

The worker that loads a disk hit into the KV cache reads the slots itself:
the slab files written by the scheduler-side :class:`~kvtier.store.disk_store.DiskStore`
are opened read-only here, a batch of slots is read into a bounded bounce
area with one ``preadv`` per run of consecutive slots of one file, and each
slot is verified (header checksum, layout fingerprint, key, lengths, payload
checksum, and zstd decoding when the slot is compressed) before its payload
may be used. A slot that fails any check is reported, never returned.

Why a second reader next to ``DiskStore.read_block``: the store reads one
slot per call through a private per-thread bounce buffer and copies the
payload out, which is right for background work but costs a call, a copy
and (on a thread pool) a GIL hand-off per block. A load of a long prefix is
latency critical and arrives as one job: reading whole runs into one area
and scattering straight from it keeps the work per job, not per block.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvtier.log import get_logger
from kvtier.store.backends.base import IO_ALIGNMENT
from kvtier.store.compression import Codec
from kvtier.store.slabs import SlabFiles, SlabStats, locate
from kvtier.store.slot import (
    HEADER_SIZE,
    ReadOutcome,
    aligned_empty,
    decode_payload,
    verify_slot,
)

logger = get_logger("store")


class Run(NamedTuple):
    """One read of a batch: ``count`` slots from local slot ``local`` of slab
    ``slab`` into rows ``row`` .. ``row + count - 1`` (``count * slot_size``
    bytes from the local slot's offset)."""

    slab: int
    local: int
    row: int
    count: int


def plan_runs(
    slots: Sequence[int], stripes: int, *, num_slots: int, first_row: int = 0
) -> tuple[list[Run], list[int]]:
    """How to read the global ``slots`` of a batch into rows ``first_row``
    .. ``first_row + len(slots) - 1``: ``(runs, row_of)``.

    Rows follow file order (slab, then local slot), whatever the order of
    ``slots``, so slots consecutive in one slab file land in adjacent rows
    and make one :class:`Run` (one read); runs are in file order too.
    ``row_of[i]`` is the row of ``slots[i]``; the rows are a permutation of
    the range. A slot listed twice gets two rows (and two runs). IndexError
    for a slot outside ``[0, num_slots)``."""
    for slot in slots:
        if not 0 <= slot < num_slots:
            raise IndexError(f"slot {slot} out of range [0, {num_slots})")
    where = [locate(slot, stripes) for slot in slots]
    order = sorted(range(len(slots)), key=where.__getitem__)
    row_of = [0] * len(slots)
    runs: list[Run] = []
    for k, i in enumerate(order):
        row = first_row + k
        row_of[i] = row
        f, local = where[i]
        last = runs[-1] if runs else None
        if last is not None and last.slab == f and last.local + last.count == local:
            runs[-1] = last._replace(count=last.count + 1)
        else:
            runs.append(Run(f, local, row, 1))
    return runs, row_of


def bounce_area(nbytes: int, *, pin: bool) -> tuple[np.ndarray, Any]:
    """A host area of ``nbytes`` for slots to be read into, and the object
    keeping its memory alive (None for plain numpy memory).

    Contract: the area is uint8, C-contiguous and 4 KiB-aligned (O_DIRECT
    needs it). With ``pin`` and CUDA present it is page-locked through
    torch's pinned allocator, so host-to-device copies from it are
    asynchronous (the owner is that tensor); otherwise it is plain memory,
    touched once here so that the first load's reads do not fault its pages
    in while the engine steps. Its contents are unspecified (zeros unless
    pinned)."""
    if pin:
        import torch

        if torch.cuda.is_available():
            owner = torch.empty(nbytes + 4096, dtype=torch.uint8, pin_memory=True)
            raw = owner.numpy()
            start = (-raw.ctypes.data) % 4096
            return raw[start : start + nbytes], owner
    area = aligned_empty(nbytes)
    area.fill(0)
    return area, None


@dataclass
class PendingRead:
    """A batch submitted with :meth:`SlotReader.submit`: its items, the runs
    read and each item's row (:func:`~kvtier.store.slot.plan_runs`), and per
    run the future (or result) of its read."""

    items: list[tuple[int, bytes]]
    first_row: int
    runs: list[Run]
    row_of: list[int]
    parts: list[Any]
    seconds: float = 0.0


@dataclass(frozen=True)
class SlotRead:
    """Outcome of one requested slot; ``row`` indexes :attr:`SlotReader.rows`
    and holds the verified, decoded block only when ``outcome`` is OK."""

    outcome: ReadOutcome
    row: int

class SlotReader:
    """Verified batch reads of one rank's slots into a bounce area.

    Contract:
      - Construction opens nothing: slab files are created by the scheduler
        side and opened read-only on first use (and again after a failed
        open), so a worker may start before the store exists.
      - ``read(items)`` takes at most ``capacity`` ``(slot, key)`` pairs and
        returns one :class:`SlotRead` per item, in order. It never raises for
        I/O or data problems: an ``OSError`` (any errno) makes the affected
        slots IO_ERROR, a short read TRUNCATED where the slab now ends inside
        the slot and IO_ERROR elsewhere
        (:func:`~kvtier.store.slot.short_read_outcome`), and a slot that
        fails a check gets the matching outcome. Anything else raised (a bug)
        leaves only once none of its reads is still writing the area. Rows of OK items hold exactly the
        block's ``block_bytes`` decoded bytes until the next ``read``.
      - Reads are coalesced: rows follow file order, not item order, and
        slots that are consecutive in one slab file are read with one I/O
        (:func:`~kvtier.store.slot.plan_runs`); an item's row is its
        ``SlotRead.row``. Runs go to the back end's threads only when there
        are several; one run is read on the calling thread.
      - ``submit(items)`` starts the same reads on the back end's threads
        and returns a :class:`PendingRead`; ``complete(pending)`` waits and
        verifies, with ``read``'s result. Batches in flight must use
        disjoint rows.
      - Not thread-safe: one reader per worker, used by one thread at a
        time (``stats()`` may be called from any thread).
    """

    def __init__(
        self,
        files: SlabFiles,
        *,
        capacity: int = 64,
        pin: bool = False,
        area: np.ndarray | None = None,
    ) -> None:
        """``area``: read into this memory (uint8, 4 KiB-aligned, whole slots:
        e.g. a mapping shared with another process) instead of a bounce area
        of ``capacity`` slots of its own; the caller keeps it mapped until
        :meth:`close`."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.files = files
        self.backend = files.backend
        self.num_slots = files.num_slots
        self.block_bytes = block_bytes = files.block_bytes
        self.slot_size = files.slot_size
        self._digest = files.digest
        if area is not None:
            if area.dtype != np.uint8 or area.ctypes.data % IO_ALIGNMENT:
                raise ValueError("area must be uint8 memory aligned to IO_ALIGNMENT")
            if area.nbytes < self.slot_size:
                raise ValueError(f"area of {area.nbytes} B holds no slot of {self.slot_size} B")
            self.capacity = area.nbytes // self.slot_size
            area = area.reshape(-1)[: self.capacity * self.slot_size]
            self._area_owner = None
        else:
            self.capacity = capacity
            area, self._area_owner = bounce_area(
                self.capacity * self.slot_size, pin=pin
            )
        # Page-locked (torch's pinned allocator), so device copies from it
        # are asynchronous and vLLM's copy path may read it from the GPU.
        self.pinned = self._area_owner is not None
        self._area = area.reshape(self.capacity, self.slot_size)
        # The decoded blocks, one per bounce row: what loads copy from.
        self.rows = self._area[:, HEADER_SIZE : HEADER_SIZE + block_bytes]
        self._scratch: np.ndarray | None = None  # for zstd slots only
        self._read_sync = getattr(self.backend, "read_sync", None)
        self._closed = False

    # ----------------------------------------------------------------- API

    def read(
        self, items: Sequence[tuple[int, bytes]], first_row: int = 0
    ) -> list[SlotRead]:
        """Read and verify ``items`` ((slot, key) pairs) into bounce rows
        ``first_row`` onwards (a caller double-buffering the area reads into
        one part while copies still read another). One run is read on the
        calling thread."""
        return self.complete(self._start(items, first_row, inline=True))

    def submit(
        self, items: Sequence[tuple[int, bytes]], first_row: int = 0
    ) -> PendingRead:
        """Start reading ``items`` into rows ``first_row`` onwards on the back
        end's threads and return at once; :meth:`complete` waits for the
        reads and verifies. A caller pipelines by submitting the next batch
        (into other rows) before completing the previous one. Rows of a
        submitted batch must not be reused before it is completed."""
        return self._start(items, first_row, inline=False)

    def complete(self, pending: PendingRead) -> list[SlotRead]:
        """Wait for a submitted batch's reads and verify its slots: one
        :class:`SlotRead` per item, in order (see the class contract)."""
        items, first_row, runs = pending.items, pending.first_row, pending.runs
        t0 = time.perf_counter()
        got = self._collect(runs, pending.parts)
        dt = time.perf_counter() - t0 + pending.seconds
        # Rows a run filled completely; others failed (errno) or were cut short.
        filled = np.zeros(len(items), dtype=np.int8)  # 0 io error, 1 ok, 2 short
        nbytes = 0
        for run, n in zip(runs, got):
            if n is None:
                continue
            nbytes += n
            full = min(run.count, n // self.slot_size)
            at = run.row - first_row
            filled[at : at + full] = 1
            filled[at + full : at + run.count] = 2
        results: list[SlotRead] = []
        ok = corrupt = 0
        for i, (slot, key) in enumerate(items):
            row = pending.row_of[i]
            state = filled[row - first_row]
            if state == 0:
                outcome = ReadOutcome.IO_ERROR
            elif state == 2:
                outcome = self.files.short_read(slot)
            else:
                outcome = self._verify(row, key, slot)
            if outcome is ReadOutcome.OK:
                ok += 1
            elif outcome is not ReadOutcome.IO_ERROR:
                corrupt += 1
            results.append(SlotRead(outcome, row))
        self.files.count_read(nbytes, dt, blocks=len(items), ok=ok, bad=corrupt)
        return results

    def ready(self, pending: PendingRead) -> bool:
        """Whether every read of a submitted batch returned (``complete``
        would not wait)."""
        return all(f.done() for f in pending.parts if isinstance(f, Future))

    def wait(self, pending: PendingRead, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a submitted batch's reads;
        whether they all returned."""
        futures = [f for f in pending.parts if isinstance(f, Future)]
        return not wait(futures, timeout).not_done

    def abandon(self, pending: PendingRead) -> None:
        """Wait for a submitted batch's reads without verifying it (a caller
        that gives the job up): afterwards its rows may be reused."""
        wait([f for f in pending.parts if isinstance(f, Future)])

    def stats(self) -> SlabStats:
        return self.files.stats()

    def describe(self) -> str:
        """Where the reads run, for logs and reports."""
        return self.backend.describe()

    def close(self) -> None:
        """Close the slab handles and, if owned, the back end. Idempotent."""
        if not self._closed:
            self._closed = True
            self.files.close()

    # ------------------------------------------------------------ internals

    def _start(
        self, items: Sequence[tuple[int, bytes]], first_row: int, inline: bool
    ) -> PendingRead:
        if not 0 <= first_row <= self.capacity - len(items):
            raise ValueError(
                f"{len(items)} slots from row {first_row} exceed capacity "
                f"{self.capacity}"
            )
        if self._closed:
            raise RuntimeError("SlotReader is closed")
        runs, row_of = plan_runs(
            [slot for slot, _key in items],
            self.files.stripes,
            num_slots=self.num_slots,
            first_row=first_row,
        )
        t0 = time.perf_counter()
        parts = self._issue(runs, inline)
        return PendingRead(
            list(items), first_row, runs, row_of, parts, time.perf_counter() - t0
        )

    def _target(self, run: Run) -> tuple[Any, np.ndarray, int]:
        ss = self.slot_size
        flat = self._area.reshape(-1)
        target = flat[run.row * ss : (run.row + run.count) * ss]
        return self.files.handle(run.slab), target, run.local * ss

    def _issue(self, runs: list[Run], inline: bool) -> list[Any]:
        """Per run: a future of the bytes read, the bytes read (``inline``:
        one run read on this thread), or None where the open or submit
        failed (logged)."""
        if inline and len(runs) == 1 and self._read_sync is not None:
            try:
                return [int(self._read_sync(*self._target(runs[0])))]
            except OSError as exc:
                self.files.io_error("read", runs[0].slab, exc)
                return [None]
        parts: list[Any] = []
        try:
            for run in runs:
                try:
                    parts.append(self.backend.submit_read(*self._target(run)))
                except OSError as exc:
                    self.files.io_error("read", run.slab, exc)
                    parts.append(None)
        except BaseException:
            # Anything else (a bug): reads already in flight write into the
            # bounce area, which the caller may reuse once it contained this.
            wait([f for f in parts if isinstance(f, Future)])
            raise
        return parts

    def _collect(self, runs: list[Run], parts: list[Any]) -> list[int | None]:
        """Bytes read per run, or None where the read (or open) failed."""
        out: list[int | None] = [None] * len(runs)
        try:
            for i, part in enumerate(parts):
                if not isinstance(part, Future):
                    out[i] = part
                    continue
                try:
                    out[i] = int(part.result())
                except OSError as exc:
                    self.files.io_error("read", runs[i].slab, exc)
        except BaseException:
            wait([f for f in parts if isinstance(f, Future)])
            raise
        return out

    def _verify(self, row: int, key: bytes, slot: int) -> ReadOutcome:
        buf = self._area[row]
        verdict = verify_slot(
            buf,
            self.slot_size,
            key=key,
            digest=self._digest,
            block_bytes=self.block_bytes,
            slot_bytes=self.slot_size,
        )
        if verdict.outcome in (ReadOutcome.BAD_HEADER, ReadOutcome.CHECKSUM_MISMATCH):
            self.files.rejected(slot, verdict.detail)
        if not verdict.ok:
            # EMPTY, or another key or layout in this slot: stale, not damaged.
            return verdict.outcome
        hdr = verdict.header
        assert hdr is not None
        if hdr.codec is not Codec.RAW:
            # Decode through a scratch block: the output would overlap its
            # own input inside the row.
            if self._scratch is None:
                self._scratch = np.empty(self.block_bytes, dtype=np.uint8)
            stored = buf[HEADER_SIZE : HEADER_SIZE + hdr.payload_len]
            decoded = decode_payload(hdr, stored, self._scratch)
            if not decoded.ok:
                self.files.rejected(slot, decoded.detail)
                return decoded.outcome
            self.rows[row] = self._scratch
        return ReadOutcome.OK
