"""The disk tier's block store of one rank: writing blocks into slots, and
reading them back verified.

:class:`DiskStore` creates the store's slab files
(:meth:`kvtier.store.slabs.SlabFiles.create`: one directory and one
preallocated slab per path, slots striped over them) and is the store's
write path. A write builds header and payload (zstd on byte planes when
configured and worth it) in the calling thread's aligned bounce buffer,
zero-pads it to ``IO_ALIGNMENT`` and writes it at the slot's (aligned)
offset in one positioned write. Its reads go through the one reader
(:class:`kvtier.store.reader.SlotReader`, one row per thread over that same
bounce buffer) and its scans through the one scan
(:func:`kvtier.store.scan.scan`): a torn, stale or corrupted slot is
reported, never returned. :func:`open_stores` opens one per rank.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from kvtier.log import get_logger
from kvtier.store.backends.base import IO_ALIGNMENT, DiskBackend
from kvtier.store.backends.factory import make_backend
from kvtier.store.checksum import (
    device_checksum,
    device_checksum_rows,
    payload_checksum,
)
from kvtier.store.compression import COMPRESSION_CHOICES, Codec, compress
from kvtier.store.reader import SlotReader
from kvtier.store.scan import scan
from kvtier.store.slabs import SlabFiles, SlabStats
from kvtier.store.slot import (
    FLAGGED_HEADER_VERSION,
    HEADER_SIZE,
    HEADER_VERSION,
    MAX_KEY_LEN,
    LayoutFingerprint,
    ReadOutcome,
    SlotHeader,
    aligned_empty,
    round_up,
)

logger = get_logger("store")

# The most a seq seen on disk raises ``next_seq`` to: it leaves 2^63 writes
# below a header's u64 (see ``DiskStore._bump_seq``).
SEQ_CEILING = 1 << 63
# The most bytes of slots one ``write_blocks`` call stages. Its area is the
# calling thread's, shared by every store the thread writes to (a spill
# thread serves every TP rank): BATCH_BYTES (or one slot, if larger) per
# thread that ever wrote a batch.
BATCH_BYTES = 16 << 20
_batch = threading.local()


def flat_u8(arr: np.ndarray, nbytes: int, what: str) -> np.ndarray:
    """``arr`` as a flat uint8 view; ValueError unless it is a C-contiguous
    numpy array of exactly ``nbytes`` bytes."""
    if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
        raise ValueError(f"{what} must be a C-contiguous numpy array")
    flat = arr.reshape(-1).view(np.uint8)
    if flat.size != nbytes:
        raise ValueError(f"{what} has {flat.size} bytes, expected block_bytes={nbytes}")
    return flat


def _check_codec(compression: str, elem_size: int, block_bytes: int) -> None:
    if compression not in COMPRESSION_CHOICES:
        raise ValueError(
            f"compression must be one of {COMPRESSION_CHOICES}, got {compression!r}"
        )
    if elem_size < 1 or block_bytes % elem_size:
        raise ValueError(f"elem_size={elem_size} must divide block_bytes={block_bytes}")


def _reopened(
    files: Callable[[DiskBackend], SlabFiles],
    compression: str,
    elem_size: int,
    backend: DiskBackend,
) -> DiskStore:
    """:meth:`DiskStore.reopener`'s store, in the other process."""
    store = DiskStore.__new__(DiskStore)
    store._setup(files(backend), compression, elem_size)
    return store


def _of_files(name: str) -> Any:
    """A read-only attribute that is the slab files' own ``name``."""
    return property(lambda self: getattr(self.files, name), doc=f"``files.{name}``.")


class DiskStore:
    """Fixed-size block slots on one or more paths, verified on every read.

    Contract:
      - ``write_block``/``read_block``/``invalidate`` are synchronous and
        thread-safe for *distinct* slots (callers never touch one slot from
        two threads at once; the tier bookkeeping ensures that); ``next_seq``
        and ``stats`` from any thread.
      - ``write_block`` and ``invalidate`` raise OSError (with errno; a short
        write as EIO) on failure. ``read_block`` and ``scan`` never raise for
        I/O or data problems: they return a ReadOutcome
        (:class:`~kvtier.store.reader.SlotReads` says which), and
        ``read_block`` writes ``out`` only when returning OK. All raise
        IndexError for a slot out of range and RuntimeError once closed.
      - Failed writes and invalidations are counted in ``io_errors`` and
        logged once per slab and errno before the OSError propagates.
      - Slot contents survive process restarts; ``scan`` reports every slot's
        header so the caller can rebuild its index. ``seq`` values handed out
        by ``next_seq`` stay above any seq seen on disk by ``scan`` (or at
        least SEQ_CEILING, for a seq above it: they always fit a header).
      - ``backend`` given as a string is created (via make_backend, its
        choice logged with ``backend_why`` when given) and owned, i.e. shut
        down by ``close``; a DiskBackend instance is only borrowed.
      - ``files`` is the store's :class:`~kvtier.store.slabs.SlabFiles`,
        which owns its geometry (``num_slots``, ``block_bytes``,
        ``slot_size``, ``fingerprint``, ``dirs``, ``slabs``, ``backend``:
        the same attributes here), handles and counters.
    """

    num_slots = _of_files("num_slots")
    block_bytes = _of_files("block_bytes")
    slot_size = _of_files("slot_size")
    fingerprint = _of_files("fingerprint")
    dirs = _of_files("dirs")
    slabs = _of_files("slabs")
    backend = _of_files("backend")

    def __init__(
        self,
        paths: Sequence[str],
        num_slots: int,
        block_bytes: int,
        fingerprint: LayoutFingerprint,
        backend: DiskBackend | str = "auto",
        compression: str = "none",
        elem_size: int = 2,
        *,
        threads: int = 4,
        backend_why: str | None = None,
    ) -> None:
        if not paths:
            raise ValueError("DiskStore needs at least one path")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if block_bytes != fingerprint.block_bytes:
            raise ValueError(
                f"block_bytes={block_bytes} disagrees with fingerprint "
                f"block_bytes={fingerprint.block_bytes}"
            )
        _check_codec(compression, elem_size, block_bytes)
        self._setup(
            SlabFiles.create(
                [os.path.abspath(p) for p in paths],
                fingerprint,
                num_slots,
                make_backend(backend, threads=threads, why=backend_why)
                if isinstance(backend, str)
                else backend,
                owns_backend=isinstance(backend, str),
            ),
            compression,
            elem_size,
        )
        logger.debug(
            "DiskStore %s: %d slots x %d B on %s via %s",
            self.files.name,
            num_slots,
            self.slot_size,
            self.paths,
            self.backend.describe(),
        )

    def _setup(self, files: SlabFiles, compression: str, elem_size: int) -> None:
        self.files = files
        self.paths = [os.path.dirname(d) for d in files.dirs]
        self.compression = compression
        self.elem_size = elem_size
        # Wall-clock ns as the starting point keeps seq increasing across
        # restarts even before (or without) a scan; scan() raises it further.
        self._seq = time.time_ns()
        self._seq_lock = threading.Lock()
        # Set for good by mark_reset: every later block is written after_reset.
        self._after_reset = False
        self._zero_header = aligned_empty(HEADER_SIZE)
        self._zero_header[:] = 0
        self._tls = threading.local()  # per thread: bounce buffer, reader

    def reopener(self) -> Callable[[DiskBackend], DiskStore]:
        """This store for another process (the spill process), picklable:
        called there with that process's back end, it gives a store over
        the same slab files, reopened for writing
        (:meth:`~kvtier.store.slabs.SlabFiles.reopener`), with the same
        compression. It creates and locks nothing (this store keeps the
        locks) and writes with the seqs it is given (:meth:`reserve_seqs`
        here), so blocks written there and here order as one store's."""
        return functools.partial(
            _reopened,
            self.files.reopener(writable=True),
            self.compression,
            self.elem_size,
        )

    def _bounce(self) -> np.ndarray:
        """This thread's aligned slot-sized buffer (O_DIRECT needs the
        alignment; verifying in it keeps bad bytes away from callers)."""
        buf: np.ndarray | None = getattr(self._tls, "bounce", None)
        if buf is None:
            buf = self._tls.bounce = aligned_empty(self.slot_size)
        return buf

    def _reader(self) -> SlotReader:
        """This thread's one-row reader, over its bounce buffer."""
        reader: SlotReader | None = getattr(self._tls, "reader", None)
        if reader is None:
            reader = self._tls.reader = SlotReader(self.files, area=self._bounce())
        return reader

    def _bump_seq(self, seen: int) -> None:
        # A header's seq is a u64 anyone can set (its checksum is no MAC):
        # one seen above SEQ_CEILING raises the counter to the ceiling only,
        # so next_seq always fits a header (wall-clock ns reach 2^63 in 2262).
        with self._seq_lock:
            self._seq = max(self._seq, min(seen, SEQ_CEILING))

    def _on_header(self, hdr: SlotHeader) -> None:
        self._bump_seq(hdr.seq)

    # -- public API -----------------------------------------------------------

    def next_seq(self) -> int:
        """A sequence number greater than every one handed out or scanned."""
        with self._seq_lock:
            self._seq += 1
            return self._seq

    def reserve_seqs(self, n: int) -> int:
        """The first of ``n`` consecutive sequence numbers, each greater than
        every one handed out or scanned before (for blocks another process
        writes: ``write_blocks(seqs=...)`` there)."""
        with self._seq_lock:
            first = self._seq + 1
            self._seq += n
            return first

    @property
    def after_reset(self) -> bool:
        """Whether blocks are written with the after-reset flag now."""
        return self._after_reset

    def mark_reset(self) -> None:
        """Every block written from now on, until this store closes, carries
        the after-reset flag (:data:`~kvtier.store.slot.FLAG_AFTER_RESET`),
        so no warm restart adopts it; it reads as any other block meanwhile.

        Called at a connector reset (vLLM's ``reset_cache``: a sleep, a pause
        that clears the caches, the reset that follows a weight update): the
        blocks computed after it may come from weights other than those this
        store's identity names, and nothing in vLLM says which. A write in
        flight at the call carries the flag or not (callers drain the
        writes of the blocks computed before the reset first). No I/O."""
        self._after_reset = True

    def write_block(
        self,
        slot: int,
        key: bytes,
        data: np.ndarray,
        seq: int,
        *,
        on_staged: Callable[[], None] | None = None,
    ) -> int:
        """Write one block (header + payload in one aligned write).

        ``data`` is a C-contiguous array of exactly ``block_bytes`` bytes.
        Returns the bytes written to disk; raises OSError on failure.
        ``on_staged`` is called once ``data`` was copied into the private
        bounce buffer, before the write: ``data`` is not read after that.
        """
        if len(key) > MAX_KEY_LEN:
            raise ValueError(f"key is {len(key)} bytes, max {MAX_KEY_LEN}")
        flat = flat_u8(data, self.block_bytes, "data")
        idx, offset = self.files.offset_of(slot)
        t0 = time.perf_counter()
        bounce = self._bounce()
        if self.compression == "zstd":
            codec, packed = compress(flat, self.elem_size)
        else:
            codec, packed = Codec.RAW, flat
        n = len(packed)
        bounce[HEADER_SIZE : HEADER_SIZE + n] = np.frombuffer(packed, dtype=np.uint8)
        payload = bounce[HEADER_SIZE : HEADER_SIZE + n]
        header = self._header(
            key,
            payload,
            flat.size,
            codec,
            device_checksum(payload),
            seq,
            self._after_reset,  # read once: one flag, one version
        )
        bounce[:HEADER_SIZE] = np.frombuffer(header, dtype=np.uint8)
        end = round_up(HEADER_SIZE + n, IO_ALIGNMENT)
        bounce[HEADER_SIZE + n : end] = 0  # don't leak a previous block's tail
        if on_staged is not None:
            on_staged()
        self._bump_seq(seq)
        written = self.files.write_all("write", idx, bounce[:end], offset)
        self.files.count_write(written, time.perf_counter() - t0)
        return written

    def _header(
        self,
        key: bytes,
        payload: np.ndarray,
        raw_len: int,
        codec: Codec,
        device_sum: int,
        seq: int,
        after_reset: bool,
    ) -> bytes:
        """The packed header of one block whose stored bytes are ``payload``."""
        return SlotHeader(
            key=bytes(key),
            fingerprint=self.files.digest,
            payload_len=payload.size,
            raw_len=raw_len,
            codec=codec,
            checksum=payload_checksum(payload),
            device_checksum=device_sum,
            seq=seq,
            written_at=time.time(),
            elem_size=self.elem_size if codec is Codec.ZSTD_BYTEPLANE else 1,
            version=FLAGGED_HEADER_VERSION if after_reset else HEADER_VERSION,
            after_reset=after_reset,
        ).pack()

    def batch_capacity(self) -> int:
        """The most blocks one :meth:`write_blocks` call takes."""
        return max(1, BATCH_BYTES // self.slot_size)

    def _batch_area(self, k: int) -> np.ndarray:
        """``k`` slots of this thread's aligned batch area, as rows."""
        need = max(BATCH_BYTES, self.slot_size)
        area: np.ndarray | None = getattr(_batch, "area", None)
        if area is None or area.size < need:
            area = _batch.area = aligned_empty(need)
        return area[: k * self.slot_size].reshape(k, self.slot_size)

    def write_blocks(
        self,
        slots: Sequence[int],
        keys: Sequence[bytes],
        rows: np.ndarray,
        row_ids: Sequence[int],
        *,
        on_staged: Callable[[], None] | None = None,
        seqs: Sequence[int] | None = None,
    ) -> list[bool]:
        """Write blocks: ``rows[row_ids[i]]`` under ``keys[i]`` into slot
        ``slots[i]``, at most :meth:`batch_capacity` of them (else
        ValueError); the batch form of :meth:`write_block`, same slots and
        headers, each block with its own ``next_seq()`` (or ``seqs[i]``).

        ``rows`` is a 2-D uint8 array of ``block_bytes`` columns (a CPU
        tier's rows). All blocks are staged first into this thread's batch
        area (one copy per run of consecutive rows), then ``on_staged`` is
        called once (``rows`` is not read after that; what it raises
        propagates, nothing written). The device checksums of the batch take
        one pass; each run of blocks in adjacent slots of one slab goes out
        in one positioned write. So a writing thread lets the interpreter
        lock go a few times per batch and once or twice per block (its xxh3,
        its row copy unless the rows run on), where a block-at-a-time writer
        needs about ten per block: next to a thread that runs Python without
        pause (a busy engine's loop) each of those waits for the switch
        interval.

        Returns, per block, whether it was written (where not, the slab
        files counted and logged the errno and path). With compression each
        block is packed on its own, as by :meth:`write_block`.
        """
        k = len(slots)
        if not k == len(keys) == len(row_ids):
            raise ValueError("slots, keys and row_ids differ in length")
        if seqs is None:
            seqs = [self.next_seq() for _ in range(k)]
        elif len(seqs) != k:
            raise ValueError("seqs and slots differ in length")
        else:
            self._bump_seq(max(seqs, default=0))
        if k > self.batch_capacity():
            raise ValueError(f"{k} blocks exceed the batch of {self.batch_capacity()}")
        if (
            rows.ndim != 2
            or rows.dtype != np.uint8
            or rows.shape[1] != self.block_bytes
        ):
            raise ValueError(f"rows must be uint8 rows of {self.block_bytes} bytes")
        for key in keys:
            if len(key) > MAX_KEY_LEN:
                raise ValueError(f"key is {len(key)} bytes, max {MAX_KEY_LEN}")
        if k == 0:
            return []
        bb = self.block_bytes
        # Slot order: adjacent slots become one write.
        where = [self.files.offset_of(slot) for slot in slots]
        order = sorted(range(k), key=where.__getitem__)
        area = self._batch_area(k)
        payload = area[:, HEADER_SIZE : HEADER_SIZE + bb]
        t0 = time.perf_counter()
        # One copy per run of consecutive rows (a request's blocks usually
        # are); numpy's take is slower than row copies for rows this long.
        ids = [row_ids[i] for i in order]
        start = 0
        while start < k:
            end = start + 1
            while end < k and ids[end] == ids[start] + (end - start):
                end += 1
            payload[start:end] = rows[ids[start] : ids[start] + end - start]
            start = end
        if on_staged is not None:
            on_staged()
        if self.compression == "zstd":
            return self._write_each(slots, keys, payload, order, seqs)
        after_reset = self._after_reset  # read once: one flag, one version
        if bb % 4 == 0:
            sums = [int(v) for v in device_checksum_rows(payload, bb)]
        else:
            sums = [device_checksum(row) for row in payload]
        for pos, i in enumerate(order):
            area[pos, :HEADER_SIZE] = np.frombuffer(
                self._header(
                    keys[i],
                    payload[pos],
                    bb,
                    Codec.RAW,
                    sums[pos],
                    seqs[i],
                    after_reset,
                ),
                dtype=np.uint8,
            )
        # The padding after each payload: zero, never a previous batch's
        # bytes (the area is shared by stores of other slot sizes).
        area[:, HEADER_SIZE + bb :] = 0
        staged = time.perf_counter() - t0
        written = [False] * k
        ssz = self.slot_size
        start = 0
        while start < k:
            idx, offset = where[order[start]]
            end = start + 1
            while end < k and where[order[end]] == (idx, offset + (end - start) * ssz):
                end += 1
            t1 = time.perf_counter()
            done = self._write_run(
                area, start, end, [where[i] for i in order[start:end]]
            )
            share = staged / k + (time.perf_counter() - t1) / (end - start)
            for pos in done:
                written[order[pos]] = True
                self.files.count_write(ssz, share)
            start = end
        return written

    def _write_run(
        self, area: np.ndarray, start: int, end: int, where: list[tuple[int, int]]
    ) -> list[int]:
        """Write staged slots ``area[start:end]``, adjacent in one slab from
        ``where[0]`` on, in one write; returns the positions written. When
        that write fails, which block failed is unknown: each is written
        again on its own, so a bad block fails (and counts) alone, as it
        would written singly. If every one of them then succeeds, the first
        failure is counted and logged instead: an error the disk returned
        once is never silent."""
        idx, offset = where[0]
        first: OSError | None = None
        if end - start > 1:
            try:
                self.files.write_all(
                    "write", idx, area[start:end].reshape(-1), offset, report=False
                )
                return list(range(start, end))
            except OSError as exc:
                first = exc
        done = []
        for pos, (at, at_offset) in zip(range(start, end), where, strict=True):
            with contextlib.suppress(OSError):  # counted and logged by the files
                self.files.write_all("write", at, area[pos], at_offset)
                done.append(pos)
        if first is not None and len(done) == end - start:
            self.files.io_error("write", idx, first)
        return done

    def _write_each(
        self,
        slots: Sequence[int],
        keys: Sequence[bytes],
        payload: np.ndarray,
        order: list[int],
        seqs: Sequence[int],
    ) -> list[bool]:
        """:meth:`write_blocks`' compressed form: each staged block through
        :meth:`write_block` (its own codec and payload length)."""
        written = [False] * len(slots)
        for pos, i in enumerate(order):
            with contextlib.suppress(OSError):  # logged by the files
                self.write_block(slots[i], keys[i], payload[pos], seqs[i])
                written[i] = True
        return written

    def invalidate(self, slot: int) -> None:
        """Zero the slot's header so no reader or restart scan trusts it again.

        Raises OSError if the header could not be overwritten.
        """
        idx, offset = self.files.offset_of(slot)
        self.files.write_all("invalidate", idx, self._zero_header, offset)

    def read_block(
        self, slot: int, key: bytes, out: np.ndarray, *, guard: Any = None
    ) -> ReadOutcome:
        """Read the block stored under ``key`` in ``slot`` into ``out`` (a
        C-contiguous array of exactly ``block_bytes`` bytes, else ValueError),
        written only when the result is OK. With ``guard`` (e.g.
        :class:`kvtier.store.transfers.RowGuard`) ``out`` is written only
        between a successful ``guard.enter()`` and ``guard.leave()``; when
        ``enter()`` refuses (the caller gave ``out`` away meanwhile) ``out``
        is left alone and IO_ERROR is returned."""
        flat = flat_u8(out, self.block_bytes, "out")
        reader = self._reader()
        (got,) = reader.read([(slot, key)])
        if got.outcome is not ReadOutcome.OK:
            return got.outcome
        if guard is not None and not guard.enter():
            return ReadOutcome.IO_ERROR
        try:
            flat[:] = reader.rows[got.row]
        finally:
            if guard is not None:
                guard.leave()
        return ReadOutcome.OK

    def scan(
        self, window: int = 64, *, skip_new: bool = False
    ) -> Iterator[tuple[int, SlotHeader | None, ReadOutcome]]:
        """Yield ``(slot, header, outcome)`` for every slot, in slot order,
        reading headers only (``window`` in flight; see
        :func:`kvtier.store.scan.scan`). The header is there for OK and for
        FINGERPRINT_MISMATCH (another layout's slot). Raises ``next_seq``
        above every intact header seen. ``skip_new`` (warm restart): the
        slots this store's open just created are empty, neither read nor
        yielded."""
        for rec in scan(
            self.files, window=window, on_header=self._on_header, skip_new=skip_new
        ):
            yield rec.slot, rec.header, rec.outcome

    def stats(self) -> SlabStats:
        """A consistent snapshot of the counters."""
        return self.files.stats()

    def close(self) -> None:
        """Close slab handles, shut the back end down if owned, and release the
        store-directory locks. Idempotent."""
        self.files.close()

    def abandon(self) -> None:
        """Mark closed without closing anything: for a store whose I/O threads
        may still be blocked in a read or write (a hung disk); see
        :meth:`kvtier.store.slabs.SlabFiles.abandon`."""
        self.files.abandon()

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def open_stores(
    paths: Sequence[str],
    fingerprints: Sequence[LayoutFingerprint],
    num_slots: int,
    block_bytes: int,
    **kw: Any,
) -> list[DiskStore]:
    """One :class:`DiskStore` per rank (``fingerprints``), all on ``paths``;
    if one cannot be opened, those opened before are closed and the error
    propagates."""
    stores: list[DiskStore] = []
    try:
        for fp in fingerprints:
            stores.append(DiskStore(paths, num_slots, block_bytes, fp, **kw))
    except BaseException:
        for store in stores:
            store.close()
        raise
    return stores
