"""The one header scan of a store: what every slot holds, judged by its
header (and, when asked, its payload).

Warm restart (:meth:`kvtier.store.store.DiskStore.scan`) and ``kvtier
inspect``/``verify`` both classify slots here, with the slot checks of
:mod:`kvtier.store.slot`, through the :class:`~kvtier.store.slabs.SlabFiles`
they were given (read-write, read-only, or found on disk by the tools).

Contract of :func:`scan`:
  - It yields one :class:`SlotRecord` per slot, in slot order or in file
    order (slab by slab: ``kvtier inspect``/``verify``); it keeps up to
    ``window`` (>= 1) header reads in flight, in batches of up to
    ``READ_BATCH`` read one after another by one of the scan's threads.
  - It never raises for I/O or data problems: a failed read (any errno) is
    IO_ERROR, counted and logged once per slab and errno by the files; a
    read that came back short is TRUNCATED when the slab now ends inside the
    slot, IO_ERROR otherwise. It raises RuntimeError once the files are
    closed, and StoreError when a found store's slab was swapped for
    something that is not a regular file.
  - OK means the header is intact and of this layout; the payload is checked
    only with ``payload`` (its xxh3 and, compressed, its decoding, like a
    load's), read in pieces of at most ``PAYLOAD_PIECE`` bytes through one
    buffer, never a block whole. Every OK header goes to
    ``on_header`` (the store raises its next ``seq`` above it).
  - With ``skip_new`` (warm restart, slot order) the slots that the files' ``create``
    just made (at or past a slab's size before it, ``SlabFiles.old_sizes``)
    are neither read nor yielded: they hold nothing, and a new store of
    millions of slots starts without reading one header. Nor, in slot
    order, are the slots whose header lies in a hole of the file
    (``lseek`` SEEK_DATA/SEEK_HOLE: never written, it reads as zeros, an
    empty slot); where the file system cannot tell, or answers nonsense,
    every slot that existed is read.
  - In file order (the tools), a slot whose header lies in a hole is
    yielded EMPTY without a read, so a large store that is mostly unwritten
    (preallocated) is checked at the cost of its written slots; slots at or
    past the slab's end are read (TRUNCATED), as are all where holes cannot
    be asked for.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, NamedTuple

import numpy as np

from kvtier.host.placement import name_this_thread
from kvtier.store.slabs import SlabFiles, global_slot
from kvtier.store.slot import (
    HEADER_SIZE,
    ReadOutcome,
    SlotHeader,
    aligned_empty,
    check_payload_in_pieces,
    header_version,
    round_up,
    verify_header,
)

PAYLOAD_PIECE = 8 << 20
# Header reads one task of the scan does, one after another.
READ_BATCH = 16


class SlotRecord(NamedTuple):
    """What one slot holds. ``header`` is set for OK, FINGERPRINT_MISMATCH
    and a payload that failed its check; ``version`` is the header version
    of any slot whose magic is kvtier's (even one this kvtier refuses).

    A named tuple, not a frozen dataclass: a scan makes one a slot, and a
    frozen dataclass's ``__init__`` sets its fields one ``__setattr__`` at
    a time."""

    slot: int
    slab: str
    local_slot: int
    outcome: ReadOutcome
    header: SlotHeader | None = None
    detail: str = ""
    version: int | None = None

    @property
    def used(self) -> bool:
        return self.outcome is not ReadOutcome.EMPTY

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "slot": self.slot,
            "slab": self.slab,
            "local_slot": self.local_slot,
            "reason": self.outcome.value,
        }
        if self.detail:
            d["detail"] = self.detail
        if self.header is not None:
            d["key"] = self.header.key.hex()
        return d


def scan(
    files: SlabFiles,
    *,
    file_order: bool = False,
    payload: bool = False,
    window: int = 64,
    on_header: Callable[[SlotHeader], None] | None = None,
    skip_new: bool = False,
) -> Iterator[SlotRecord]:
    """Every slot of ``files``, judged; see the module doc. ``skip_new``
    scans in slot order only (a warm restart's order)."""
    if skip_new and file_order:
        raise ValueError("scan: skip_new lists slots in slot order, not file order")
    # Payloads are checked in pieces of at most PAYLOAD_PIECE bytes through
    # one buffer: a store's block size (up to 4 GiB) is the store's to say.
    piece = min(PAYLOAD_PIECE, round_up(max(files.slot_size - HEADER_SIZE, 1)))
    pieces = aligned_empty(piece) if payload else None
    # The header reads go in batches of READ_BATCH slots, one task each on a
    # few threads of the scan's own (a batch's reads one after another, the
    # interpreter lock let go in each): one hand-off per batch, not one per
    # slot, whose future and locks cost more than the read of a cached
    # header.
    size = max(1, min(READ_BATCH, window))
    depth = max(1, window // size)
    where = _where(files, file_order, skip_new)
    inflight: deque[tuple[list[tuple[int, int, int, Any]], Future[list]]] = deque()
    readers = _Readers(files, depth)
    try:
        while True:
            while len(inflight) < depth:
                batch = list(itertools.islice(where, size))
                if not batch:
                    break
                rows = aligned_empty(len(batch) * HEADER_SIZE)
                rows = rows.reshape(len(batch), HEADER_SIZE)
                slots = [
                    (slot, idx, offset, rows[i] if data else None)
                    for i, (slot, idx, offset, data) in enumerate(batch)
                ]
                inflight.append((slots, readers.submit(slots)))
            if not inflight:
                return
            slots, reads = inflight.popleft()
            for (slot, idx, offset, buf), read in zip(
                slots, reads.result(), strict=True
            ):
                yield _judge(files, slot, idx, offset, buf, read, pieces, on_header)
    finally:
        # A consumer that stopped early (or a read that raised) does not
        # wait for the batches still reading (a hung disk: for ever): they
        # read into rows of their own, which nobody reads after.
        readers.close([reads for _slots, reads in inflight])


class _Readers:
    """The scan's header readers: ``count`` threads taking batches of slots
    from one queue, each batch's reads one after another.

    Daemon threads, where a ``ThreadPoolExecutor``'s are joined when the
    interpreter exits: a scan closed while a read hangs on a failing disk
    (``kvtier inspect`` stopped, a start given up) would hold the process's
    exit for as long as the read hangs. Once the scan is closed, a batch
    under way reads no further slot, and each thread ends after the read
    it is in."""

    def __init__(self, files: SlabFiles, count: int) -> None:
        self._files = files
        self._closed = False
        self._tasks: queue.SimpleQueue[tuple[Future[list], list] | None] = (
            queue.SimpleQueue()
        )
        self._count = 0
        try:
            for i in range(count):
                threading.Thread(
                    target=self._run, name=f"kvtier-scan-{i}", daemon=True
                ).start()
                self._count += 1
        except BaseException:
            self.close([])  # the threads started end, not wait for ever
            raise

    def submit(self, slots: list[tuple[int, int, int, Any]]) -> Future[list]:
        """Read ``slots``' headers (:meth:`_read`) on a reader."""
        future: Future[list] = Future()
        self._tasks.put((future, slots))
        return future

    def close(self, pending: list[Future[list]]) -> None:
        """Cancel the batches of ``pending`` not started; the threads end
        after the reads under way. Returns at once."""
        self._closed = True
        for future in pending:
            future.cancel()
        for _ in range(self._count):
            self._tasks.put(None)

    def _run(self) -> None:
        name_this_thread()
        while (task := self._tasks.get()) is not None:
            future, slots = task
            if not future.set_running_or_notify_cancel():
                continue  # cancelled by close
            try:
                future.set_result(self._read(slots))
            except BaseException as exc:  # to the consumer, with the result
                future.set_exception(exc)

    def _read(
        self, slots: list[tuple[int, int, int, Any]]
    ) -> list[int | OSError | None]:
        """Each slot's header read into its row, in order: the count read,
        the read's OSError, or None for a slot not read (its header in a
        hole, or the scan closed)."""
        out: list[int | OSError | None] = []
        for _slot, idx, offset, buf in slots:
            if buf is None or self._closed:
                out.append(None)
                continue
            try:
                out.append(self._files.read(idx, buf, offset))
            except OSError as exc:
                out.append(exc)
        return out


def _where(
    files: SlabFiles, file_order: bool, skip_new: bool = False
) -> Iterator[tuple[int, int, int, bool]]:
    """``(global slot, slab index, byte offset, data)`` of each slot to
    scan; ``data`` False: its header lies in a hole (file order only)."""
    if file_order:
        for idx, slab in enumerate(files.slabs):
            begun = _slots_begun(files, idx)
            data = _header_data(files, idx, begun)
            next_data = next(data, None)  # ascending local slots below begun
            for local in range(slab.num_slots):
                if local == next_data:
                    next_data = next(data, None)
                    has_data = True
                else:  # a hole, or past the slab's end (read: TRUNCATED)
                    has_data = local >= begun
                slot = global_slot(slab.index, local, files.stripes)
                yield slot, idx, local * files.slot_size, has_data
        return
    if not skip_new:
        for slot in range(files.num_slots):
            yield slot, *files.offset_of(slot), True
        return
    # Local slots of each slab to scan: those that begin before the slab's
    # size before this open (a slot cut by it is read: it may hold a torn
    # block, judged as any other).
    counts = [
        min(slab.num_slots, -(-old // files.slot_size))
        for slab, old in zip(files.slabs, files.old_sizes, strict=True)
    ]

    # Slot s is local slot s // stripes of slab s % stripes; each slab's
    # slots in order, merged into slot order.
    def slab_slots(idx: int, count: int) -> Iterator[tuple[int, int, int, bool]]:
        index = files.slabs[idx].index
        for local in _header_data(files, idx, count):
            slot = global_slot(index, local, files.stripes)
            yield slot, idx, local * files.slot_size, True

    yield from heapq.merge(*(slab_slots(i, n) for i, n in enumerate(counts)))


def _slots_begun(files: SlabFiles, idx: int) -> int:
    """How many local slots of slab ``idx`` begin before its end now (all
    of them where its size cannot be read)."""
    count = files.slabs[idx].num_slots
    try:
        fd = files.backend.fileno(files.handle(idx))
        if fd is None:
            return count
        size = os.fstat(fd).st_size
    except OSError:
        return count
    return min(count, -(-size // files.slot_size))


def _header_data(files: SlabFiles, idx: int, count: int) -> Iterator[int]:
    """The local slots below ``count`` of slab ``idx`` whose header bytes
    the file system may hold data for. A header in a hole (never written:
    ``lseek(SEEK_DATA)``; a preallocated, unwritten extent counts as one on
    ext4 and XFS) reads as zeros, an empty slot. Where holes cannot be
    asked for (no descriptor, an error) every slot is listed."""
    size, end = files.slot_size, count * files.slot_size
    try:
        fd = files.backend.fileno(files.handle(idx)) if count else None
    except OSError:
        fd = None
    if fd is None:
        yield from range(count)
        return
    local = 0  # the next slot not yet listed
    while local < count:
        try:
            start = os.lseek(fd, local * size, os.SEEK_DATA)
            stop = min(os.lseek(fd, start, os.SEEK_HOLE), end)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no data past here
                yield from range(local, count)
            return
        if start >= end:
            return
        if start < local * size or stop <= start:
            # Answers no file system should give (data behind the offset
            # asked for, an empty data range): trust them no further.
            yield from range(local, count)
            return
        # Slots whose header [l * size, l * size + HEADER_SIZE) meets
        # [start, stop).
        first = max(local, (start - HEADER_SIZE) // size + 1)
        last = min(count, -(-stop // size))
        yield from range(first, last)
        local = max(local + 1, last)


def _judge(
    files: SlabFiles,
    slot: int,
    idx: int,
    offset: int,
    buf: Any,
    read: int | OSError | None,
    payload: np.ndarray | None,
    on_header: Callable[[SlotHeader], None] | None,
) -> SlotRecord:
    path, local = files.slabs[idx].path, offset // files.slot_size

    def record(outcome: ReadOutcome, **kw: Any) -> SlotRecord:
        return SlotRecord(slot, path, local, outcome, **kw)

    if read is None:  # its header lies in a hole: zeros, never written
        return record(ReadOutcome.EMPTY)
    if isinstance(read, OSError):
        files.io_error("read", idx, read)
        return record(ReadOutcome.IO_ERROR, detail=str(read))
    n = read
    files.count_read(n)
    version = header_version(buf, n)
    if n < HEADER_SIZE:
        return record(
            files.short_read(slot, (idx, offset)),
            detail=f"read {n} of {HEADER_SIZE} bytes",
        )
    verdict = verify_header(
        buf, key=None, digest=files.digest, block_bytes=files.block_bytes
    )
    hdr, detail = verdict.header, verdict.detail
    if verdict.outcome is ReadOutcome.BAD_HEADER and detail.startswith("bad header ("):
        detail = detail[len("bad header (") : -1]
    if not verdict.ok:
        return record(verdict.outcome, header=hdr, detail=detail, version=version)
    assert hdr is not None
    if on_header is not None:
        on_header(hdr)
    if payload is not None:

        def read(pos: int, view: np.ndarray) -> int:
            n = files.read(idx, view, offset + HEADER_SIZE + pos)
            files.count_read(n)
            return n

        try:
            verdict = check_payload_in_pieces(hdr, read, payload)
        except OSError as exc:
            files.io_error("read", idx, exc)
            return record(
                ReadOutcome.IO_ERROR, header=hdr, detail=str(exc), version=version
            )
        if not verdict.ok:
            return record(
                verdict.outcome, header=hdr, detail=verdict.detail, version=version
            )
    return record(ReadOutcome.OK, header=hdr, version=version)
