"""The one reader of disk slots: verified batch reads into the rows of an
area, declared by the :class:`SlotReads` protocol.

:class:`SlotReader` serves every read of a slot's block: the worker's loads
of disk hits into the KV cache (a batch per bounce part, pipelined by the
load thread), promotions into CPU-tier rows and ``verify``
(:class:`~kvtier.store.store.DiskStore`, one slot at a time through a
one-row reader per thread) and the read process's child
(:mod:`kvtier.store.read_process`, which implements the same protocol from
the worker's side). Where the bytes land is a parameter:

- a **host area** (no ``device``): the reader's own 4 KiB-aligned bounce
  area (page-locked with ``pin`` where CUDA is present) or memory the
  caller maps (``area``: the read process's shared memory file). Slots are
  verified there: header, layout, key, lengths, payload xxh3, zstd decoded
  through a scratch block.
- a **device staging area** (``device``; CI runs it with ``"cpu"``): a
  ``torch.uint8`` tensor. kvikio reads straight into it (``mode`` ``gds``,
  or ``compat`` where kvikio bounces internally); any other back end
  (``posix``) reads into a page-locked host area and one copy per run moves
  it to the device. Headers are checked on the host (they are small),
  payloads on the device with :func:`kvtier.store.checksum.device_checksums`,
  so no verified byte travels back. A version 1 header (no device checksum)
  or a zstd payload is HOST_ONLY: never used unverified.
"""

from __future__ import annotations

import time
from collections.abc import Container, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from kvtier.log import get_logger
from kvtier.store.backends.base import IO_ALIGNMENT, DiskBackend
from kvtier.store.checksum import device_checksums
from kvtier.store.compression import Codec
from kvtier.store.slabs import SlabFiles, SlabStats, locate
from kvtier.store.slot import (
    FIXED_HEADER_LEN,
    HEADER_SIZE,
    ReadOutcome,
    SlotVerdict,
    aligned_empty,
    check_payload,
    decode_payload,
    round_up,
    verify_header,
)

logger = get_logger("store")

# kvikio's reads have no timed wait: a batch of them is polled this often.
KVIKIO_POLL_S = 0.001
# Slots a reader reads alone after a read of several failed, at most: one
# bad sector is one slot's strike, not its neighbours' (see ``plan_runs``).
MAX_SUSPECT_SLOTS = 4096

# Outcomes of slots read whole but not served for what they hold: counted in
# ``checksum_failures`` (an empty slot, an I/O error or a slot for the host
# path are not).
_REJECTED = frozenset(
    {
        ReadOutcome.BAD_HEADER,
        ReadOutcome.CHECKSUM_MISMATCH,
        ReadOutcome.TRUNCATED,
        ReadOutcome.KEY_MISMATCH,
        ReadOutcome.FINGERPRINT_MISMATCH,
    }
)


@dataclass(frozen=True)
class SlotRead:
    """Outcome of one requested slot: ``rows[row]`` holds the verified,
    decoded block only when ``outcome`` is OK; ``detail`` says why not."""

    outcome: ReadOutcome
    row: int
    detail: str = ""


class SlotReads(Protocol):
    """Verified batch reads of one rank's slots into the rows of an area.

    ``files`` (the store's :class:`~kvtier.store.slabs.SlabFiles`),
    ``capacity`` (rows), ``slot_size``, ``rows`` (``(capacity, block_bytes)``
    decoded blocks: numpy for a host area, torch for a device staging area),
    ``pinned`` (page-locked: device copies from it are asynchronous).

    - ``start()``: open the slabs there are (``files.open_all()``) and start
      helpers (a read process's child, once every slab is open); called
      before the first batch and again until every slab is open (a new
      store's slabs exist once the scheduler side made them), so that a
      store directory removed later leaves the open descriptors reading. A
      slab not open yet is opened at its first read, and again after a
      failure. Never raises for I/O.
    - ``submit(items, first_row)``: start reading ``items`` ((global slot,
      key or None) pairs, at most ``capacity - first_row``) into rows
      ``first_row`` onwards and return at once. Rows follow file order, and
      slots consecutive in one slab are read with one I/O
      (:func:`plan_runs`). ValueError/IndexError for bad arguments,
      RuntimeError after ``close``. Batches in flight use disjoint rows.
    - ``ready(pending)`` never blocks; ``wait(pending, timeout)`` blocks at
      most ``timeout`` seconds; both say whether every read returned.
    - ``complete(pending)``: one :class:`SlotRead` per item, in order. OK:
      the row holds exactly the verified, decoded block until it is read
      into again. Never raises for disk or data problems: a failed read (any
      errno) is IO_ERROR for its run; a short read is TRUNCATED where the
      slab now ends inside the slot, IO_ERROR elsewhere; bad bytes are
      BAD_HEADER / CHECKSUM_MISMATCH (logged once per slab); another key or
      layout KEY_MISMATCH / FINGERPRINT_MISMATCH; a slot the device cannot
      verify HOST_ONLY. An unexpected exception leaves only once no read of
      the batch is still writing its rows.
    - ``abandon(pending)``: wait for the reads without judging them; the rows
      are then free.
    - ``stats()`` from any thread; ``describe()`` one line for logs;
      ``close()`` idempotent. Otherwise used by one thread at a time.
    """

    files: SlabFiles
    capacity: int
    slot_size: int
    rows: Any
    pinned: bool

    def start(self) -> None: ...
    def submit(self, items: Sequence[tuple[int, bytes | None]], first_row: int = 0) -> Any: ...
    def ready(self, pending: Any) -> bool: ...
    def wait(self, pending: Any, timeout: float) -> bool: ...
    def complete(self, pending: Any) -> list[SlotRead]: ...
    def abandon(self, pending: Any) -> None: ...
    def stats(self) -> SlabStats: ...
    def describe(self) -> str: ...
    def close(self) -> None: ...


class ReadRun(NamedTuple):
    """One read of a batch: ``count`` slots from local slot ``local`` of slab
    ``slab`` into rows ``row`` .. ``row + count - 1``."""

    slab: int
    local: int
    row: int
    count: int


def plan_runs(
    slots: Sequence[int],
    stripes: int,
    *,
    num_slots: int,
    first_row: int = 0,
    alone: Container[int] = (),
) -> tuple[list[ReadRun], list[int]]:
    """How to read the global ``slots`` of a batch into rows ``first_row``
    .. ``first_row + len(slots) - 1``: ``(runs, row_of)``.

    Rows follow file order (slab, then local slot), whatever the order of
    ``slots``, so slots consecutive in one slab file land in adjacent rows
    and make one :class:`ReadRun` (one read); runs are in file order too.
    ``row_of[i]`` is the row of ``slots[i]``; the rows are a permutation of
    the range. A slot listed twice gets two rows (and two runs); a slot in
    ``alone`` gets a run of its own. IndexError for a slot outside
    ``[0, num_slots)``."""
    for slot in slots:
        if not 0 <= slot < num_slots:
            raise IndexError(f"slot {slot} out of range [0, {num_slots})")
    where = [locate(slot, stripes) for slot in slots]
    order = sorted(range(len(slots)), key=where.__getitem__)
    row_of = [0] * len(slots)
    runs: list[ReadRun] = []
    joinable = False  # whether the last run may grow
    for k, i in enumerate(order):
        row = first_row + k
        row_of[i] = row
        f, local = where[i]
        last = runs[-1] if runs else None
        single = slots[i] in alone
        if (
            joinable
            and not single
            and last is not None
            and last.slab == f
            and last.local + last.count == local
        ):
            runs[-1] = last._replace(count=last.count + 1)
        else:
            runs.append(ReadRun(f, local, row, 1))
        joinable = not single
    return runs, row_of


def unallocatable(nbytes: int, exc: BaseException) -> MemoryError:
    """The error for a disk load area (host bounce, device staging, or the
    read process's shared area) of ``nbytes`` that could not be allocated:
    its size is ``disk_load_buffer_bytes``' doing, so it names that key."""
    return MemoryError(
        f"kvtier: the disk load bounce area of {nbytes} B cannot be allocated "
        f"({exc}); lower disk_load_buffer_bytes"
    )


def bounce_area(nbytes: int, *, pin: bool) -> tuple[np.ndarray, Any]:
    """A host area of ``nbytes`` for slots to be read into, and the object
    keeping its memory alive (None for plain numpy memory).

    The area is uint8, C-contiguous and 4 KiB-aligned (O_DIRECT needs it).
    With ``pin`` and CUDA present it is page-locked through torch's pinned
    allocator, so host-to-device copies from it are asynchronous (the owner
    is that tensor); otherwise it is plain memory, touched once here so the
    first load's reads do not fault its pages in while the engine steps. Its
    contents are unspecified (zeros unless pinned)."""
    if pin:
        import torch

        if torch.accelerator.is_available():
            owner = torch.empty(nbytes + IO_ALIGNMENT, dtype=torch.uint8, pin_memory=True)
            raw = owner.numpy()
            start = (-raw.ctypes.data) % IO_ALIGNMENT
            return raw[start : start + nbytes], owner
    area = aligned_empty(nbytes)
    area.fill(0)
    return area, None


def staging_mode(backend: DiskBackend) -> str:
    """How bytes reach a device staging area through ``backend``: ``"gds"``,
    ``"compat"`` (kvikio without GPUDirect Storage) or ``"posix"``."""
    if getattr(backend, "name", "") == "kvikio":
        return "gds" if getattr(backend, "gds", False) else "compat"
    return "posix"


def wait_reads(reads: Sequence[Any], timeout: float | None = None) -> bool:
    """Wait up to ``timeout`` seconds (None: without end) for every read (a
    ``Future``, or a kvikio read with ``done()``; an ``int`` or None is one
    that returned); whether all returned. Never raises a read's error."""
    deadline = None if timeout is None else time.monotonic() + timeout
    futures = [r for r in reads if isinstance(r, Future)]
    if futures and wait(futures, timeout).not_done:
        return False
    polled = [r for r in reads if r is not None and not isinstance(r, (Future, int))]
    while not all(r.done() for r in polled):
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(KVIKIO_POLL_S)
    return True


@dataclass
class PendingRead:
    """A submitted batch: its items, runs, each item's row, and per run the
    read in flight (a future), its byte count (read inline), or None where
    the open or the submission failed."""

    items: list[tuple[int, bytes | None]]
    first_row: int
    runs: list[ReadRun]
    row_of: list[int]
    parts: list[Any]
    seconds: float = 0.0


class SlotReader:
    """:class:`SlotReads` into a host area or a device staging area (see the
    module doc and the protocol for the contract).

    ``capacity`` (>= 1) rows of their own, or as many as ``area`` holds
    (uint8, 4 KiB-aligned, whole slots, kept mapped by the caller until
    :meth:`close`); ``pin``: page-lock the host area. ``device``: stage on
    that torch device instead (no ``area`` then). ``close`` closes ``files`` (the reader owns
    them). On CUDA the staging copies and checksums run on the calling
    thread's current stream; rows are complete on it when ``complete``
    returns (it reads the checksums back).

    A read of several slots that fails (an errno) fails them all; each of
    them is then read alone until it reads (at most
    :data:`MAX_SUSPECT_SLOTS`), so a bad sector costs its own slot's block,
    not its neighbours'. One thread submits and completes a reader's
    batches."""

    def __init__(
        self,
        files: SlabFiles,
        *,
        capacity: int = 64,
        device: Any = None,
        pin: bool = False,
        area: np.ndarray | None = None,
    ) -> None:
        self.files = files
        self.backend = files.backend
        self.slot_size = ssz = files.slot_size
        self.block_bytes = files.block_bytes
        self.mode = staging_mode(self.backend)
        self.staging: Any = None  # the device staging tensor
        self._owner: Any = None  # keeps a pinned host area alive
        if area is not None:
            capacity = area.nbytes // ssz
        self.capacity = capacity
        if device is not None:
            import torch

            device = torch.device(device)
        try:
            if device is None:
                if area is None:
                    area, self._owner = bounce_area(capacity * ssz, pin=pin)
            elif device.type == "cpu":
                area, _ = bounce_area(capacity * ssz, pin=False)
                self.staging = torch.from_numpy(area).view(capacity, ssz)
            else:
                self.staging = torch.empty(capacity, ssz, dtype=torch.uint8, device=device)
                area = None
                if self.mode == "posix":
                    area, self._owner = bounce_area(capacity * ssz, pin=True)
        # numpy: MemoryError, or ValueError past its largest array; torch's
        # out of memory is a RuntimeError.
        except (MemoryError, ValueError, RuntimeError) as exc:
            raise unallocatable(capacity * ssz, exc) from exc
        if device is not None:
            logger.info(
                "kvtier device staging: mode %s, staging on %s, back end %s",
                self.mode,
                device,
                self.backend.describe(),
            )
        self.device = device
        # Host memory the reads land in (None: kvikio reads into the device).
        self._area = None if area is None else area.reshape(capacity, ssz)
        whole = self.staging if self.staging is not None else self._area
        self.rows = whole[:, HEADER_SIZE : HEADER_SIZE + self.block_bytes]
        # A page-locked host area: device copies from it are asynchronous.
        self.pinned = self.staging is None and self._owner is not None
        self._start_read = (
            getattr(self.backend, "start_read", None) if device is not None else None
        )
        self._scratch: np.ndarray | None = None  # zstd decoding, host only
        self._closed = False
        self._suspect: set[int] = set()  # slots to read alone

    # ----------------------------------------------------------------- API

    def start(self) -> None:
        """Open the slabs there are; reads run on the back end's threads."""
        self.files.open_all()

    def read(
        self, items: Sequence[tuple[int, bytes | None]], first_row: int = 0
    ) -> list[SlotRead]:
        """``complete(submit(...))``; a batch of one run is read on this thread."""
        return self.complete(self._submit(items, first_row, inline=True))

    def submit(
        self, items: Sequence[tuple[int, bytes | None]], first_row: int = 0
    ) -> PendingRead:
        return self._submit(items, first_row, inline=False)

    def ready(self, pending: PendingRead) -> bool:
        # Polled by the load thread every turn: a plain check, without the
        # waiter that concurrent.futures.wait sets up on every future.
        parts = pending.parts
        return all(r.done() for r in parts if r is not None and not isinstance(r, int))

    def wait(self, pending: PendingRead, timeout: float) -> bool:
        return wait_reads(pending.parts, timeout)

    def abandon(self, pending: PendingRead) -> None:
        wait_reads(pending.parts)

    def complete(self, pending: PendingRead) -> list[SlotRead]:
        items, first = pending.items, pending.first_row
        t0 = time.perf_counter()
        got = self._collect(pending)
        seconds = time.perf_counter() - t0 + pending.seconds
        # Per row from ``first``: 0 the read failed, 1 complete, 2 short.
        state = np.zeros(len(items), dtype=np.int8)
        shared_failure: set[int] = set()  # rows of failed reads of several slots
        for run, n in zip(pending.runs, got):
            if n is not None:
                full = min(run.count, n // self.slot_size)
                at = run.row - first
                state[at : at + full] = 1
                state[at + full : at + run.count] = 2
            elif run.count > 1:
                shared_failure.update(range(run.row, run.row + run.count))
        heads = self._headers(first, len(items))
        out: list[SlotRead] = []
        on_device: list[tuple[int, int]] = []  # (item, expected checksum)
        for i, (slot, key) in enumerate(items):
            row = pending.row_of[i]
            if state[row - first] == 0:
                if row in shared_failure:
                    if len(self._suspect) >= MAX_SUSPECT_SLOTS:
                        self._suspect.clear()
                    self._suspect.add(slot)
                out.append(SlotRead(ReadOutcome.IO_ERROR, row, "read failed"))
                continue
            self._suspect.discard(slot)
            if state[row - first] == 2:
                out.append(SlotRead(self.files.short_read(slot), row, "short read"))
                continue
            verdict = self._judge(slot, key, row, heads[row - first])
            if verdict.ok and self.staging is not None:
                assert verdict.header is not None and verdict.header.device_checksum is not None
                on_device.append((i, verdict.header.device_checksum))
            out.append(SlotRead(verdict.outcome, row, verdict.detail))
        if self.staging is not None:
            self._check_on_device(first, items, out, on_device)
        self.files.count_read(
            sum(n or 0 for n in got),
            seconds,
            blocks=len(items),
            ok=sum(r.outcome is ReadOutcome.OK for r in out),
            bad=sum(r.outcome in _REJECTED for r in out),
        )
        return out

    def stats(self) -> SlabStats:
        return self.files.stats()

    def describe(self) -> str:
        return self.backend.describe()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.files.close()

    # ------------------------------------------------------------ reading

    def _submit(
        self, items: Sequence[tuple[int, bytes | None]], first_row: int, inline: bool
    ) -> PendingRead:
        if self._closed:
            raise RuntimeError("SlotReader is closed")
        if not 0 <= first_row <= self.capacity - len(items):
            raise ValueError(
                f"{len(items)} slots from row {first_row} exceed capacity "
                f"{self.capacity}"
            )
        runs, row_of = plan_runs(
            [slot for slot, _key in items],
            self.files.stripes,
            num_slots=self.files.num_slots,
            first_row=first_row,
            alone=self._suspect,
        )
        t0 = time.perf_counter()
        parts: list[Any] = []
        try:
            for run in runs:
                parts.append(self._issue(run, inline and len(runs) == 1))
        except BaseException:
            # A bug: reads already in flight write into the area, which the
            # caller may reuse once the exception left.
            wait_reads(parts)
            raise
        return PendingRead(
            list(items), first_row, runs, row_of, parts, time.perf_counter() - t0
        )

    def _issue(self, run: ReadRun, inline: bool) -> Any:
        """Start one run's read: its future, its byte count (``inline`` on a
        back end that reads on the calling thread), or None where the open
        or the start failed (logged)."""
        ssz = self.slot_size
        rows = slice(run.row, run.row + run.count)
        # kvikio reads into the staging tensor itself, whatever its device;
        # the other back ends into host memory (on the CPU, the staging
        # tensor's own).
        direct = self._start_read is not None or self._area is None
        target = (self.staging if direct else self._area)[rows].reshape(-1)
        try:
            offset = run.local * ssz
            if self._start_read is not None:
                return self._start_read(self.files.handle(run.slab), target, offset)
            if inline:  # read() waits for it anyway: on this thread where it can
                return self.files.read(run.slab, target, offset)
            return self.files.submit_read(run.slab, target, offset)
        except OSError as exc:
            self.files.io_error("read", run.slab, exc)
            return None

    def _collect(self, pending: PendingRead) -> list[int | None]:
        """Bytes read per run, or None where the open or the read failed;
        runs read into a host area for the device are copied on to it."""
        got: list[int | None] = [None] * len(pending.runs)
        try:
            for i, (run, part) in enumerate(zip(pending.runs, pending.parts)):
                if part is None or isinstance(part, int):
                    got[i] = part
                    continue
                try:
                    got[i] = int(part.result())
                except OSError as exc:
                    self.files.io_error("read", run.slab, exc)
        except BaseException:
            wait_reads(pending.parts)
            raise
        if self.staging is not None and self._area is not None and self.staging.is_cuda:
            import torch

            for run, n in zip(pending.runs, got):
                if n:
                    rows = slice(run.row, run.row + run.count)
                    src = torch.from_numpy(self._area[rows])
                    self.staging[rows].copy_(src, non_blocking=True)
        return got

    # ------------------------------------------------------------ judging

    def _headers(self, first: int, count: int) -> np.ndarray:
        """The rows' header bytes, on the host (the fixed part only)."""
        if self._area is not None:
            return self._area[first : first + count, :FIXED_HEADER_LEN]
        return self.staging[first : first + count, :FIXED_HEADER_LEN].cpu().numpy()

    def _judge(self, slot: int, key: bytes | None, row: int, head: np.ndarray) -> SlotVerdict:
        """A slot read whole: its header, then (host area) its payload's
        xxh3 and decoding; for a staging area, whether the device can
        verify it (its device checksum is checked with the batch's)."""
        verdict = verify_header(
            head, key=key, digest=self.files.digest, block_bytes=self.block_bytes
        )
        hdr = verdict.header
        if verdict.ok and self.staging is not None:
            assert hdr is not None
            if hdr.device_checksum is None or hdr.codec is not Codec.RAW:
                why = (
                    f"header version {hdr.version} has no device checksum"
                    if hdr.device_checksum is None
                    else f"codec {hdr.codec.name} decodes on the host only"
                )
                self.files.host_only(slot, why)
                return SlotVerdict(ReadOutcome.HOST_ONLY, hdr, why)
        elif verdict.ok:
            assert hdr is not None and self._area is not None
            stored = self._area[row, HEADER_SIZE : HEADER_SIZE + hdr.payload_len]
            verdict = check_payload(hdr, stored, hdr.payload_len)
            if verdict.ok and hdr.codec is not Codec.RAW:
                # Through a scratch block: the output would overlap its input.
                if self._scratch is None:
                    self._scratch = np.empty(self.block_bytes, dtype=np.uint8)
                verdict = decode_payload(hdr, stored, self._scratch)
                if verdict.ok:
                    self.rows[row] = self._scratch
        if verdict.outcome in (ReadOutcome.BAD_HEADER, ReadOutcome.CHECKSUM_MISMATCH):
            self.files.rejected(slot, verdict.detail)
        return verdict

    def _check_on_device(
        self,
        first: int,
        items: Sequence[tuple[int, bytes | None]],
        out: list[SlotRead],
        on_device: list[tuple[int, int]],
    ) -> None:
        """The device checksums of the rows judged OK on their headers, in
        one batch over this call's rows (a strided view, no copy)."""
        import torch

        if not on_device:
            if self.staging.device.type != "cpu":
                # The host area's copies must land before it is read into again.
                torch.accelerator.current_stream(self.staging.device).synchronize()
            return
        padded = round_up(self.block_bytes, 4)
        payload = self.staging[
            first : first + len(items), HEADER_SIZE : HEADER_SIZE + padded
        ]
        if padded != self.block_bytes:
            # The checksum covers the payload zero-padded to 4 bytes; the pad
            # bytes on disk are the slot's (zeroed) tail: force them.
            payload[:, self.block_bytes :] = 0
        sums = device_checksums(payload, padded).tolist()  # synchronises
        for i, want in on_device:
            row = out[i].row
            if sums[row - first] != want:
                self.files.rejected(items[i][0], "device checksum mismatch")
                out[i] = SlotRead(
                    ReadOutcome.CHECKSUM_MISMATCH, row, "device checksum mismatch"
                )
