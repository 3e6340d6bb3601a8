"""One rank's slab files as the load path's readers see them.

Both readers of a worker's loads, :class:`~kvtier.store.slot_reader.SlotReader`
(host bounce area) and :class:`~kvtier.store.device_staging.DeviceStagingReader`
(staging tensor on the device), read the same files the same way: opened
read-only through the back end on first use (a worker may start before the
scheduler side created them), closed once. What goes wrong is logged once
per file and kind (repeats at debug) and counted, so an operator sees one
line per failing drive, not one per block. :class:`SlabFiles` is that shared
part; each reader owns one. :func:`bounce_area` allocates the host area both
read into.

Contract: ``handle(f)`` opens slab ``f`` (OSError from the back end passes
through; a later call tries again); ``io_error``, ``rejected`` and
``host_only`` log (and the first counts); ``count`` adds a chunk's outcome to
the stats; ``stats()`` may be called from any thread; ``close()`` is
idempotent and shuts the back end down when owned.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.log import get_logger
from kvtier.store.backends.base import DiskBackend
from kvtier.store.format import LayoutFingerprint, aligned_empty
from kvtier.store.layout import (
    ReadOutcome,
    locate,
    short_read_outcome,
    slab_name,
    slot_offset,
)
from kvtier.store.store_dir import store_dirname

logger = get_logger("store")


@dataclass
class SlotReaderStats:
    """Cumulative counters of one reader (``stats()`` returns a copy)."""

    read_bytes: int = 0
    read_seconds: float = 0.0
    blocks_ok: int = 0
    # Slots whose bytes failed verification (checksum, header, truncation)
    # and slots holding another key or layout: never loaded.
    checksum_failures: int = 0
    io_errors: int = 0


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


class SlabFiles:
    """The slab files of one rank's store, read-only (see the module doc)."""

    def __init__(
        self,
        paths: Sequence[str],
        fingerprint: LayoutFingerprint,
        backend: DiskBackend,
        owns_backend: bool,
    ) -> None:
        dirname = store_dirname(fingerprint)
        self.paths = [
            os.path.join(os.path.abspath(p), dirname, slab_name(i))
            for i, p in enumerate(paths)
        ]
        self.backend = backend
        self._owns_backend = owns_backend
        self._handles: list[Any] = [None] * len(self.paths)
        self._stats = SlotReaderStats()
        self._lock = threading.Lock()
        self._logged: set[tuple[str, str]] = set()

    def handle(self, f: int) -> Any:
        handle = self._handles[f]
        if handle is None:
            handle = self.backend.open(self.paths[f], writable=False)
            self._handles[f] = handle
        return handle

    def open_all(self) -> int:
        """Open every slab not open yet; a file that cannot be opened now
        (not created yet, or failing) is left for its first read. Returns how
        many are open."""
        for f in range(len(self.paths)):
            try:
                self.handle(f)
            except OSError as exc:
                logger.debug("slab %s not opened ahead: %s", self.paths[f], exc)
        return sum(h is not None for h in self._handles)

    def count(
        self, *, nbytes: int = 0, seconds: float = 0.0, ok: int = 0, checksum_failures: int = 0
    ) -> None:
        with self._lock:
            s = self._stats
            s.read_bytes += nbytes
            s.read_seconds += seconds
            s.blocks_ok += ok
            s.checksum_failures += checksum_failures

    def stats(self) -> SlotReaderStats:
        with self._lock:
            return SlotReaderStats(**vars(self._stats))

    def io_error(self, f: int, exc: OSError) -> None:
        """A read (or open) of slab ``f`` failed: counted and logged."""
        with self._lock:
            self._stats.io_errors += 1
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        self._log_once(
            ("io", f"{f}:{exc.errno}"),
            "kvtier disk load from %s failed: errno %s (%s): %s; the blocks are "
            "recomputed",
            self.paths[f],
            exc.errno,
            name,
            exc.strerror,
        )

    def short_read(self, slot: int, slot_size: int) -> ReadOutcome:
        """A read of ``slot`` came back short: TRUNCATED (counted with the
        rejected slots) when its slab now ends inside the slot, else
        IO_ERROR (counted and logged as an EIO): see
        :func:`~kvtier.store.layout.short_read_outcome`."""
        f, local = locate(slot, len(self.paths))
        handle = self._handles[f]
        size = None if handle is None else self.backend.size(handle)
        end = slot_offset(local, slot_size) + slot_size
        outcome = short_read_outcome(size, end)
        if outcome is ReadOutcome.TRUNCATED:
            self.rejected(slot, f"short read: the slab ends at byte {size} (truncated)")
        else:
            self.io_error(
                f, OSError(errno.EIO, f"short read of slot {slot} (not the file's end)")
            )
        return outcome

    def rejected(self, slot: int, what: str) -> None:
        """A slot's bytes failed a check (corrupt or torn): logged."""
        f, _ = locate(slot, len(self.paths))
        self._log_once(
            ("corrupt", str(f)),
            "kvtier disk load of slot %d from %s rejected: %s (corrupt or torn "
            "block, recomputed)",
            slot,
            self.paths[f],
            what,
        )

    def host_only(self, slot: int, why: str) -> None:
        """An intact slot that the device path cannot verify: logged."""
        f, _ = locate(slot, len(self.paths))
        self._log_once(
            ("host_only", str(f)),
            "kvtier slot %d of %s cannot be verified on the device (%s): the "
            "block is recomputed and stored again in a form the device path "
            "reads",
            slot,
            self.paths[f],
            why,
        )

    def close(self) -> None:
        for handle in self._handles:
            if handle is not None:
                try:
                    self.backend.close(handle)
                except OSError as exc:
                    logger.debug("closing slab handle failed: %s", exc)
        self._handles = [None] * len(self._handles)
        if self._owns_backend:
            self._owns_backend = False
            self.backend.shutdown()

    def _log_once(self, key: tuple[str, str], msg: str, *args: Any) -> None:
        first = key not in self._logged
        self._logged.add(key)
        if first:
            logger.warning(msg + "; repeats logged at debug", *args)
        else:
            logger.debug(msg, *args)
