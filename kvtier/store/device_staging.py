"""Disk slots read into a torch staging area and verified where they land.

The load path for a CUDA worker (issue 20, item 3): slots go from the slab
files into a ``torch.uint8`` staging tensor on the worker's device, their
headers are checked on the host (they are small) and their payloads on the
device with :func:`kvtier.store.checksum.device_checksums`, so no verified byte
has to travel back to the host. The same code runs with a CPU staging tensor,
which is how CI tests it.

How bytes arrive, by back end (the *mode*, logged once per reader):

  gds     kvikio with GPUDirect Storage: kvikio reads straight into the
          device tensor (``KvikioBackend.start_read``: kvikio's own
          asynchronous ``CuFile.pread`` futures, all runs in flight at once).
  compat  kvikio without GDS (no driver, file system without O_DIRECT, or
          ``KVIKIO_COMPAT_MODE=ON``): the same calls; kvikio bounces through
          its own host buffers internally.
  posix   any other back end (POSIX, the test fault layer): reads into a
          4 KiB-aligned host bounce area (page-locked when CUDA is present),
          then one copy per run into the staging tensor. With a CPU staging
          tensor the bounce area *is* the staging tensor.

Only slots written with a version 2 header and stored raw can be verified
on the device; an intact version 1 slot or a zstd slot is reported
``HOST_ONLY`` (read it with :class:`kvtier.store.slot_reader.SlotReader`),
never used unverified.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.log import get_logger
from kvtier.store.backends.base import DiskBackend
from kvtier.store.checksum import device_checksums
from kvtier.store.compression import Codec
from kvtier.store.read_waiter import ReadWaiter, wait_all
from kvtier.store.slabs import SlabFiles, SlabStats
from kvtier.store.slot import (
    FIXED_HEADER_LEN,
    HEADER_SIZE,
    ReadOutcome,
    verify_header,
)
from kvtier.store.slot_reader import Run, bounce_area, plan_runs

logger = get_logger("store")

MODES = ("gds", "compat", "posix")


def staging_mode(backend: DiskBackend) -> str:
    """``"gds"``, ``"compat"`` or ``"posix"`` for ``backend`` (see module doc)."""
    if getattr(backend, "name", "") == "kvikio":
        return "gds" if getattr(backend, "gds", False) else "compat"
    return "posix"


@dataclass
class PendingStage:
    """A batch submitted with :meth:`DeviceStagingReader.submit`: its items,
    the runs read and each item's row (:func:`~kvtier.store.slot.plan_runs`),
    and per run a function waiting for its read."""

    items: list[tuple[int, bytes]]
    first_row: int
    runs: list[Run]
    row_of: list[int]
    waiters: list[ReadWaiter | None]
    seconds: float = 0.0


@dataclass(frozen=True)
class StagedSlot:
    """Outcome of one requested slot. Only when ``outcome`` is OK does
    ``DeviceStagingReader.rows[row]`` hold the verified block."""

    outcome: ReadOutcome
    row: int
    detail: str = ""


class DeviceStagingReader:
    """Reads (slot, key) pairs into a torch staging tensor, verified.

    Contract:
      - ``read(items, first_row)`` reads ``items`` ((global slot, key) pairs,
        at most ``capacity - first_row`` of them) into rows ``first_row`` ..
        ``first_row + len(items) - 1`` of :attr:`staging` and returns one
        :class:`StagedSlot` per item, in order. Rows follow file order, not
        item order (:func:`~kvtier.store.slot.plan_runs`, as
        :class:`~kvtier.store.slot_reader.SlotReader` does): an item's row is
        its ``StagedSlot.row``, and slots consecutive in one slab file are
        read with one I/O. OK means: the read was complete, the header is
        intact (magic, version, header checksum), of this layout and this
        key, the payload is raw and its device checksum matches. Then
        ``rows[row]`` (a view of ``block_bytes`` bytes) holds the block until
        the next ``read`` that uses that row. Any other outcome means the row
        is garbage and must not be used (the load is a miss, i.e. recompute).
      - Errors: a failed read (any errno, from open or the I/O) is IO_ERROR
        for every slot of its run, logged once per slab and errno; a short
        read is, for the slots it did not cover, TRUNCATED where the slab
        now ends inside the slot and IO_ERROR elsewhere
        (:func:`~kvtier.store.slot.short_read_outcome`);
        bad bytes are BAD_HEADER / CHECKSUM_MISMATCH (logged once per slab);
        another key or layout is KEY_MISMATCH / FINGERPRINT_MISMATCH; a
        valid version 1 or compressed slot is HOST_ONLY. ``read`` never
        raises for disk or data problems; it raises ValueError / IndexError
        for bad arguments, RuntimeError after ``close``. An unexpected
        exception leaves only after every read it started has finished.
      - Blocking: ``read`` returns when every read landed and the checksums
        were computed and compared (one device synchronisation per call, by
        reading the checksums back). Call it on an I/O thread, never on the
        engine's step.
      - Alignment: offsets are slot starts (4 KiB multiples); the host bounce
        and CPU staging areas are 4 KiB-aligned. A CUDA staging tensor comes
        from torch's allocator (kvikio handles its alignment).
      - Streams: on CUDA, copies and checksums run on the current stream of
        the calling thread; rows are complete on that stream when ``read``
        returns (the readback synchronised it).
      - ``submit``/``complete`` split ``read`` for a caller that pipelines
        batches (the worker's load thread), as :class:`SlotReader` does;
        ``stats()`` counts as it does.
      - Not thread-safe: one reader per I/O thread (``stats`` from any).
        ``close`` is idempotent and closes the slab handles (and the back
        end when owned).
    """

    def __init__(
        self, files: SlabFiles, *, device: Any = "cpu", capacity: int = 64
    ) -> None:
        import torch

        if capacity < 1:
            raise ValueError("DeviceStagingReader needs capacity")
        self.files = files
        self.backend = backend = files.backend
        self.num_slots = files.num_slots
        self.block_bytes = block_bytes = files.block_bytes
        self.slot_size = files.slot_size
        self.capacity = capacity
        self.device = torch.device(device)
        self._digest = files.digest
        self.mode = staging_mode(backend)
        nbytes = capacity * self.slot_size
        self._bounce: np.ndarray | None = None
        self._bounce_owner: Any = None
        if self.device.type == "cpu":
            # 4 KiB-aligned (O_DIRECT), shared with numpy for the back ends.
            area, _ = bounce_area(nbytes, pin=False)
            self.staging = torch.from_numpy(area).view(capacity, self.slot_size)
        else:
            self.staging = torch.empty(
                capacity, self.slot_size, dtype=torch.uint8, device=self.device
            )
            if self.mode == "posix":
                area, self._bounce_owner = bounce_area(nbytes, pin=True)
                self._bounce = area.reshape(capacity, self.slot_size)
        self.rows = self.staging[:, HEADER_SIZE : HEADER_SIZE + block_bytes]
        self._direct = self.device.type == "cpu" or self.mode != "posix"
        self._closed = False
        self.pinned = False  # rows are device memory (or plain host memory)
        logger.info(
            "kvtier device staging: mode %s, staging on %s, back end %s",
            self.mode,
            self.device,
            backend.describe(),
        )

    # ----------------------------------------------------------------- API

    def read(
        self, items: Sequence[tuple[int, bytes]], first_row: int = 0
    ) -> list[StagedSlot]:
        """See the class contract."""
        return self.complete(self.submit(items, first_row))

    def submit(
        self, items: Sequence[tuple[int, bytes]], first_row: int = 0
    ) -> PendingStage:
        """Start reading ``items`` into rows ``first_row`` onwards and return
        at once (kvikio's futures, or the back end's threads);
        :meth:`complete` waits, checks and returns ``read``'s result. Batches
        in flight must use disjoint rows."""
        if self._closed:
            raise RuntimeError("DeviceStagingReader is closed")
        if not 0 <= first_row <= self.capacity - len(items):
            raise ValueError(
                f"{len(items)} slots from row {first_row} exceed capacity "
                f"{self.capacity}"
            )
        runs, row_of = plan_runs(
            [slot for slot, _key in items],
            self.files.stripes,
            num_slots=self.num_slots,
            first_row=first_row,
        )
        started = time.perf_counter()
        waiters = self._start_runs(runs)
        return PendingStage(
            list(items), first_row, runs, row_of, waiters, time.perf_counter() - started
        )

    def complete(self, pending: PendingStage) -> list[StagedSlot]:
        """Wait for a submitted batch and verify it (see the class contract)."""
        import torch

        items, first_row, runs = pending.items, pending.first_row, pending.runs
        started = time.perf_counter()
        got = self._collect(runs, pending.waiters)
        seconds = time.perf_counter() - started + pending.seconds
        # Per row (from first_row): 0 failed, 1 complete, 2 short.
        state = [0] * len(items)
        for run, n in zip(runs, got):
            if n is None:
                continue
            full = min(run.count, n // self.slot_size)
            for k in range(run.count):
                state[run.row - first_row + k] = 1 if k < full else 2
        # Per row, as state: the fixed header bytes.
        headers = self._headers(first_row, len(items))
        results: list[StagedSlot | None] = [None] * len(items)
        to_check: list[int] = []
        expected: list[int] = []
        for i, (slot, key) in enumerate(items):
            row = pending.row_of[i]
            at = row - first_row
            if state[at] == 0:
                results[i] = StagedSlot(ReadOutcome.IO_ERROR, row, "read failed")
                continue
            if state[at] == 2:
                outcome = self.files.short_read(slot)
                results[i] = StagedSlot(outcome, row, "short read")
                continue
            verdict = verify_header(
                headers[at],
                HEADER_SIZE,
                key=key,
                digest=self._digest,
                block_bytes=self.block_bytes,
                slot_bytes=self.slot_size,
            )
            if verdict.outcome is ReadOutcome.BAD_HEADER:
                self.files.rejected(slot, verdict.detail)
            if not verdict.ok:
                results[i] = StagedSlot(verdict.outcome, row, verdict.detail)
                continue
            hdr = verdict.header
            assert hdr is not None
            if hdr.device_checksum is None or hdr.codec is not Codec.RAW:
                why = (
                    f"header version {hdr.version} has no device checksum"
                    if hdr.device_checksum is None
                    else f"codec {hdr.codec.name} decodes on the host only"
                )
                self.files.host_only(slot, why)
                results[i] = StagedSlot(ReadOutcome.HOST_ONLY, row, why)
                continue
            to_check.append(i)
            expected.append(hdr.device_checksum)
        if to_check:
            # One batch over the rows of this call (a strided view, no copy);
            # rows that are not checked cost a little arithmetic, not a sync.
            padded = -(-self.block_bytes // 4) * 4
            payload = self.staging[
                first_row : first_row + len(items), HEADER_SIZE : HEADER_SIZE + padded
            ]
            if padded != self.block_bytes:
                # The checksum covers the payload zero-padded to 4 bytes; the
                # pad bytes on disk are the slot's (zeroed) tail: force them.
                payload[:, self.block_bytes :] = 0
            sums = device_checksums(payload, padded).tolist()  # synchronises
            for i, want in zip(to_check, expected):
                row = pending.row_of[i]
                have = sums[row - first_row]
                if want == have:
                    results[i] = StagedSlot(ReadOutcome.OK, row)
                else:
                    self.files.rejected(items[i][0], "device checksum mismatch")
                    results[i] = StagedSlot(
                        ReadOutcome.CHECKSUM_MISMATCH, row, "device checksum mismatch"
                    )
        if self.device.type == "cuda" and not to_check:
            # The bounce copies must land before the next read reuses it.
            torch.cuda.current_stream(self.device).synchronize()
        out = [r for r in results if r is not None]
        self._count(out, got, seconds)
        return out

    def ready(self, pending: PendingStage) -> bool:
        """Whether every read of a submitted batch returned (``complete``
        would not wait for the disk)."""
        return all(w.done() for w in pending.waiters if w is not None)

    def wait(self, pending: PendingStage, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a submitted batch's reads;
        whether they all returned."""
        return wait_all([w for w in pending.waiters if w is not None], timeout)

    def abandon(self, pending: PendingStage) -> None:
        """Wait for a submitted batch's reads without checking it (a caller
        that gives the job up): afterwards its rows may be reused."""
        for waiter in pending.waiters:
            if waiter is not None:
                with contextlib.suppress(Exception):
                    waiter()

    def stats(self) -> SlabStats:
        """Cumulative counters, as :meth:`SlotReader.stats` (HOST_ONLY slots
        count as neither corrupt nor I/O errors)."""
        return self.files.stats()

    def close(self) -> None:
        """Close the slab handles and, if owned, the back end. Idempotent."""
        if not self._closed:
            self._closed = True
            self.files.close()

    # ------------------------------------------------------------ internals

    def _target(self, row: int, count: int) -> Any:
        if self._bounce is not None:
            return self._bounce[row : row + count].reshape(-1)
        return self.staging[row : row + count].reshape(-1)

    def _start_runs(self, runs: list[Run]) -> list[ReadWaiter | None]:
        """Start every run's read: per run its waiter, or None where the
        open or start failed."""
        # kvikio: its own IOFutures (start_read); others: the back end's futures.
        start = getattr(self.backend, "start_read", None)
        waiters: list[ReadWaiter | None] = []
        try:
            for f, local, row, count in runs:
                try:
                    handle = self.files.handle(f)
                    target = self._target(row, count)
                    offset = local * self.slot_size
                    if start is not None:
                        waiters.append(start(handle, target, offset))
                    else:
                        fut = self.backend.submit_read(handle, target, offset)
                        waiters.append(ReadWaiter.of_future(fut))
                except OSError as exc:
                    self.files.io_error("read", f, exc)
                    waiters.append(None)
        except BaseException:
            # A bug: reads already in flight write into the staging area;
            # let them land before the exception leaves.
            for waiter in waiters:
                if waiter is not None:
                    with contextlib.suppress(Exception):
                        waiter()
            raise
        return waiters

    def _collect(
        self, runs: list[Run], waiters: list[ReadWaiter | None]
    ) -> list[int | None]:
        """Bytes read per run, or None where the open or the read failed;
        with a host bounce area, the landed runs are copied on to the device."""
        out: list[int | None] = [None] * len(runs)
        waited = 0
        try:
            for i, waiter in enumerate(waiters):
                waited = i + 1
                if waiter is None:
                    continue
                try:
                    out[i] = int(waiter())
                except OSError as exc:
                    self.files.io_error("read", runs[i].slab, exc)
        except BaseException:
            for waiter in waiters[waited:]:
                if waiter is not None:
                    with contextlib.suppress(Exception):
                        waiter()
            raise
        if self._bounce is not None:
            import torch

            for run, n in zip(runs, out):
                if n:
                    rows = slice(run.row, run.row + run.count)
                    src = torch.from_numpy(self._bounce[rows])
                    self.staging[rows].copy_(src, non_blocking=True)
        return out

    def _count(
        self, results: list[StagedSlot], got: list[int | None], seconds: float
    ) -> None:
        ok = sum(r.outcome is ReadOutcome.OK for r in results)
        bad = sum(
            r.outcome not in (ReadOutcome.OK, ReadOutcome.IO_ERROR, ReadOutcome.HOST_ONLY)
            for r in results
        )
        self.files.count_read(
            sum(n or 0 for n in got), seconds, blocks=len(results), ok=ok, bad=bad
        )

    def _headers(self, first_row: int, count: int) -> np.ndarray:
        """The rows' header bytes, on the host (the fixed part only)."""
        if self._bounce is not None:
            part = self._bounce[first_row : first_row + count, :FIXED_HEADER_LEN]
            heads = np.zeros((count, HEADER_SIZE), dtype=np.uint8)
            heads[:, :FIXED_HEADER_LEN] = part
            return heads
        part = self.staging[first_row : first_row + count, :FIXED_HEADER_LEN].cpu()
        heads = np.zeros((count, HEADER_SIZE), dtype=np.uint8)
        heads[:, :FIXED_HEADER_LEN] = part.numpy()
        return heads

