"""A store's slab files: their names, where a slot lives, creating or
opening them, the raw I/O on them, and reporting what goes wrong.

One rank's store keeps, on each of its ``P`` paths, a directory
``kvtier-<digest hex[:16]>`` (named by the layout fingerprint,
:func:`store_dirname`, so different models, dtypes or ranks never share
files) holding ``layout.json`` (a human and ``kvtier inspect`` aid, never
trusted for reads) and one preallocated slab ``slab-<path index>.kvt``
(:func:`slab_name`). Global slot ``s`` lives in slab ``s % P`` at local slot
``s // P`` (:func:`locate`), so consecutive slots go to different devices;
local slot ``l`` starts at byte ``l * slot_size``. See docs/on-disk-format.md.

:class:`SlabFiles` is one store's files, opened in one of four ways:

- :meth:`SlabFiles.create` (the writer, scheduler side): each directory is
  created private to this user, checked (no link, our owner, not
  group/other writable) and locked with ``flock`` while the store is open,
  so two live engines never share one; each slab is preallocated (a spill
  never fails half-way with ENOSPC), owner-only, and opened read-write
  through the back end, which must have opened the inode checked through
  the locked directory.
- :meth:`SlabFiles.open` (the readers, workers): creates nothing; a slab is
  opened read-only on first use and again after a failed open, so a worker
  may start before the scheduler side created the store.
- :meth:`SlabFiles.reopener` (the read process, for a worker's store;
  with ``writable`` the spill process, for the scheduler side's store):
  creates nothing and takes no lock (the creating store holds them); each
  slab open in the parent is taken over from the descriptor the helper
  inherited (:meth:`SlabFiles.descriptors`), so a store directory removed
  or swapped under a running engine changes nothing in its helpers; a
  slab reopened by name for writing must be the inode the creating store
  opened.
- :func:`find_stores` (``kvtier inspect``/``verify``/``doctor``): stores
  found on disk, read with ``os.preadv`` on descriptors that refuse links
  and anything but a regular file; the slot size is derived from the slot
  format and checked against ``layout.json`` and the slab sizes, never
  taken on trust (:class:`StoreError` otherwise). Nothing is written.

Contract:
  - ``offset_of(slot)`` gives ``(slab index, byte offset)``, a multiple of
    IO_ALIGNMENT; IndexError for a slot out of range, RuntimeError once
    closed.
  - ``read``/``submit_read``/``write`` move bytes as the back end does: the
    count transferred (a short transfer is the smaller count, never padded)
    or OSError with errno; ``write_all`` turns a short write into
    OSError(EIO). Buffers follow the back end's alignment rules.
  - ``io_error`` (counted in ``io_errors``), ``rejected`` (bytes that failed
    a check) and ``host_only`` (a slot the device path cannot verify) log at
    warning once per kind, slab (and errno), repeats at debug: one line per
    failing drive, not one per block. ``count_read``/``count_write`` add to
    the one :class:`SlabStats`.
  - Thread-safe: the counters, the log-once set and lazy opens are guarded
    by one lock. Callers keep one slot to one thread at a time.
  - ``close`` is idempotent: it closes the handles (and inherited
    descriptors never taken over), shuts the back end down when owned and
    closes the directory descriptors (releasing the locks). ``abandon``
    only marks the files closed, for I/O still blocked on them; a later
    ``close`` closes them (see there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import json
import os
import re
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvtier.log import get_logger
from kvtier.safe_open import (
    FILE_MODE,
    InUseError,
    NotRegularFileError,
    check_own_dir,
    check_private_fd,
    flock_exclusive,
    lock_holders,
    open_private,
    open_private_dir,
    open_regular,
)
from kvtier.store.backends.base import IO_ALIGNMENT, DiskBackend
from kvtier.store.slot import (
    HEADER_SIZE,
    HeaderError,
    LayoutFingerprint,
    ReadOutcome,
    SlotHeader,
    slot_size,
)

logger = get_logger("store")

LAYOUT_FILE = "layout.json"
_DIGEST_HEX = 16  # hex digits of the layout digest in a store directory's name
# Name patterns end in \Z, not $ ($ also matches before a trailing newline),
# and spell digits [0-9]: \d matches any Unicode digit, which int() reads,
# so a planted "slab-\u0661.kvt" would pass for slab 1.
STORE_DIR_RE = re.compile(rf"^kvtier-([0-9a-f]{{{_DIGEST_HEX}}})\Z")
"""Matches a store directory's name; group 1 is its digest hex prefix."""
SLAB_RE = re.compile(r"^slab-([0-9]+)\.kvt\Z")

# Sanity bounds on geometry read from layout.json or a slot header. A 16-token
# block of a 405B model in bf16 is about 8 MiB per rank; 4 GiB is absurd.
MAX_BLOCK_BYTES = 1 << 32
MAX_SLOT_SIZE = slot_size(MAX_BLOCK_BYTES)
MIN_SLOT_SIZE = slot_size(1)  # header + one aligned payload unit
MAX_LAYOUT_BYTES = 1 << 20  # layout.json is a few hundred bytes
MAX_STRIPES = 1 << 12  # directories one store stripes over (layout.json)


def store_dirname(fingerprint: LayoutFingerprint) -> str:
    """Name of the per-layout directory under each path (matches
    :data:`STORE_DIR_RE`)."""
    return f"kvtier-{fingerprint.digest().hex()[:_DIGEST_HEX]}"


def store_digest_prefix(name: str) -> str | None:
    """The digest hex prefix store directory ``name`` carries, or None when
    ``name`` is not a store directory's name."""
    m = STORE_DIR_RE.match(name)
    return m.group(1) if m else None


def slab_name(index: int) -> str:
    """File name of the slab of path ``index`` (inside the store directory)."""
    return f"slab-{index}.kvt"


def locate(slot: int, stripes: int) -> tuple[int, int]:
    """``(slab index, local slot)`` of global ``slot`` (>= 0) striped over
    ``stripes`` (>= 1)."""
    return slot % stripes, slot // stripes


def global_slot(index: int, local: int, stripes: int) -> int:
    """Inverse of :func:`locate`."""
    return local * stripes + index


def local_slot_count(num_slots: int, index: int, stripes: int) -> int:
    """How many of ``num_slots`` global slots live in slab ``index``."""
    return (num_slots - index + stripes - 1) // stripes


class StoreError(ValueError):
    """A store that cannot be read safely: a slab or layout.json that is not
    a regular file, an impossible geometry, no slabs. The message names the
    file and the problem; ``errno``, the error of a failed open, if any."""

    errno: int | None = None


@dataclass
class SlabStats:
    """Cumulative counters of one store's files (``stats()`` returns a copy)."""

    write_bytes: int = 0
    write_seconds: float = 0.0
    blocks_written: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    blocks_read: int = 0  # slots a read asked for, whatever the outcome
    blocks_ok: int = 0
    # Slots read whole but not served: bytes that failed a check (header,
    # checksum, decoding, a truncated slab) or another block's (key, layout).
    checksum_failures: int = 0
    # Failed I/O (any errno), including short reads and writes (as EIO).
    io_errors: int = 0


@dataclass(frozen=True)
class SlabFile:
    """One slab: its path, path index, local slots and bytes (on disk when
    found; the full size otherwise)."""

    path: str
    index: int
    num_slots: int
    slot_size: int
    size: int

    def offset(self, local: int) -> int:
        """Byte offset of local slot ``local``; IndexError outside the slab."""
        if not 0 <= local < self.num_slots:
            raise IndexError(f"slot {local} out of range [0, {self.num_slots})")
        return local * self.slot_size


class SlabFiles:
    """One store's slab files (see the module doc). Build it with
    :meth:`create`, :meth:`open` or :func:`find_stores`.

    ``name`` (the directory name), ``fingerprint`` (None for a found
    store), ``dirs``, ``slabs`` (one
    :class:`SlabFile` per path, in path order), ``slot_size``,
    ``block_bytes``, ``num_slots``, ``stripes``; ``digest``: what slot
    headers must carry (the full digest, or for a found store without a
    readable ``layout.json`` the directory name's hex prefix); ``layout``
    and ``warnings``: what ``layout.json`` said and what was odd (found
    stores)."""

    def __init__(
        self,
        name: str,
        dirs: list[str],
        slabs: list[SlabFile],
        block_bytes: int,
        digest: bytes | str | None,
        backend: DiskBackend,
        *,
        owns_backend: bool,
        fingerprint: LayoutFingerprint | None = None,
        inodes: Sequence[tuple[int, int]] | None = None,
        inherited: Sequence[tuple[int, tuple[int, int]] | None] | None = None,
        inherited_from: int | None = None,
        engines: bool = False,
    ) -> None:
        self.name = name
        self.fingerprint = fingerprint
        self.dirs = dirs
        self.slabs = slabs
        self.block_bytes = block_bytes
        self.slot_size = slot_size(block_bytes)
        self.num_slots = sum(s.num_slots for s in slabs)
        self.stripes = max((s.index for s in slabs), default=-1) + 1
        self.digest = digest
        self.backend = backend
        self.layout: dict[str, Any] | None = None
        self.warnings: list[str] = []
        # Found on disk: slabs shorter than layout.json's slots (also in
        # warnings), damage kvtier verify fails on.
        self.short: list[str] = []
        self._owns_backend = owns_backend
        self.handles: list[Any] = [None] * len(slabs)
        # Reopened for writing in another process (:meth:`reopener`): each
        # slab's (st_dev, st_ino) as the writer checked it; a slab opened by
        # name must be that file.
        self._inodes = None if inodes is None else list(inodes)
        # Reopened in a helper process: per slab, the descriptor it was
        # given open (and the (st_dev, st_ino) it must be), used instead of
        # opening by name: a store directory removed or swapped under the
        # engine keeps working in the helper as it does in the engine.
        self._inherited = None if inherited is None else list(inherited)
        # The process that gave them: where it is this one (a reopener
        # called in its own process), they are its own and are duplicated.
        self._inherited_from = inherited_from
        # An engine's store (``engines``: :meth:`open`, and its reopeners):
        # a slab opened by name for reading must be in the engine's private
        # directory and private itself (_open). The tools (find_stores)
        # read any store they are pointed at, another user's too.
        self._engines = engines
        # Per slab, the bytes it held before this open: slots at or past
        # that offset were made by :meth:`create` just now and hold nothing
        # (the full size where nothing was created: open, find_stores).
        self.old_sizes: list[int] = [s.size for s in slabs]
        self._dir_fds: list[int] = []  # create: held, with their locks, until close
        self._lock = threading.Lock()  # counters and the log-once set
        self._open_lock = threading.Lock()  # lazy opens (may take a while)
        self._stats = SlabStats()
        self._logged: set[tuple[str, int, int | None]] = set()
        self._closed = False
        self._abandoned = False  # closed by abandon: close() still releases
        # Optional blocking fast paths (PosixBackend has them): callers on
        # their own threads skip a hop to the back end's pool.
        self._read_sync: Callable[[Any, Any, int], int] | None = getattr(
            backend, "read_sync", None
        )
        self._write_sync: Callable[[Any, Any, int], int] | None = getattr(
            backend, "write_sync", None
        )

    @classmethod
    def open(
        cls,
        paths: Sequence[str],
        fingerprint: LayoutFingerprint,
        num_slots: int,
        backend: DiskBackend,
        *,
        owns_backend: bool = False,
    ) -> SlabFiles:
        """The store on ``paths`` for reading: opens nothing yet (see the
        module doc)."""
        if not paths or num_slots < 1:
            raise ValueError("a store needs paths and slots")
        name, ssz = store_dirname(fingerprint), slot_size(fingerprint.block_bytes)
        slabs = []
        for i, base in enumerate(paths):
            count = local_slot_count(num_slots, i, len(paths))
            path = os.path.join(os.path.abspath(base), name, slab_name(i))
            slabs.append(SlabFile(path, i, count, ssz, count * ssz))
        return cls(
            name,
            [os.path.dirname(slab.path) for slab in slabs],
            slabs,
            fingerprint.block_bytes,
            fingerprint.digest(),
            backend,
            owns_backend=owns_backend,
            fingerprint=fingerprint,
            engines=True,
        )

    @classmethod
    def create(
        cls,
        paths: Sequence[str],
        fingerprint: LayoutFingerprint,
        num_slots: int,
        backend: DiskBackend,
        *,
        owns_backend: bool = False,
    ) -> SlabFiles:
        """Create or reopen the store on ``paths``, read-write (see the
        module doc). On any failure whatever was opened is closed (the back
        end too, when owned) and the exception propagates: OSError from the
        file system (ENOSPC naming the slab and size), InUseError when
        another live engine holds a directory, PermissionError for a link,
        a foreign owner or a swapped file."""
        files = cls.open(paths, fingerprint, num_slots, backend, owns_backend=owns_backend)
        try:
            for i, slab in enumerate(files.slabs):
                d = files.dirs[i]
                dir_fd = _open_store_dir(d, os.path.dirname(d))
                files._dir_fds.append(dir_fd)
                names = _listing(dir_fd)  # once for both tidy-ups
                _remove_leftovers(d, dir_fd, names)
                _take_misplaced_slab(d, dir_fd, slab.index, names)
                _write_layout(
                    d,
                    fingerprint,
                    slab.slot_size,
                    len(files.slabs),
                    num_slots,
                    dir_fd=dir_fd,
                )
                dev_ino, files.old_sizes[i] = create_slab(
                    slab.path, slab.num_slots, slab.slot_size, dir_fd=dir_fd
                )
                files.handles[i] = backend.open(slab.path, writable=True)
                fd = backend.fileno(files.handles[i])
                if fd is not None and _dev_ino(fd) != dev_ino:
                    raise PermissionError(
                        errno.EPERM,
                        "kvtier refuses the slab: the file opened by name is not "
                        "the one checked a moment earlier (the directory was "
                        "swapped?)",
                        slab.path,
                    )
        except BaseException:
            files.close()
            raise
        return files

    def descriptors(self) -> list[int]:
        """The descriptors of the slabs open here: what a helper process
        started with a :meth:`reopener` made now must be given
        (``pass_fds``), under the same numbers."""
        fds = (None if h is None else self.backend.fileno(h) for h in self.handles)
        return [fd for fd in fds if fd is not None]

    def reopener(self, *, writable: bool = False) -> Callable[[DiskBackend], SlabFiles]:
        """The same slabs for another process, picklable: called there with
        that process's back end (which the result owns), it gives these
        files opened for reading, as :meth:`open` does, or with ``writable``
        (files made by :meth:`create`, which holds their locks) for writing
        too. A slab open here is taken over from the descriptor the process
        inherited (:meth:`descriptors`), never reopened by name, so that a
        store directory removed, renamed or swapped under a running engine
        changes nothing there either. One not open here is opened on first
        use by name; with ``writable`` every slab must be open here, and one
        opened by name after the inherited descriptor was lost is refused
        (PermissionError) unless it is the very file this writer checked and
        opened, so a file swapped in under the name is never written."""
        inherited: list[tuple[int, tuple[int, int]] | None] = []
        for slab, handle in zip(self.slabs, self.handles, strict=True):
            fd = None if handle is None else self.backend.fileno(handle)
            if fd is None and writable:
                raise ValueError(f"slab {slab.path} is not open for writing here")
            inherited.append(None if fd is None else (fd, _dev_ino(fd)))
        inodes = [ino for _, ino in inherited] if writable else None
        return functools.partial(
            SlabFiles,
            self.name,
            list(self.dirs),
            list(self.slabs),
            self.block_bytes,
            self.digest,
            owns_backend=True,
            fingerprint=self.fingerprint,
            inodes=inodes,
            inherited=inherited,
            inherited_from=os.getpid(),
            engines=self._engines,
        )

    # -- where and how bytes move -----------------------------------------

    def offset_of(self, slot: int) -> tuple[int, int]:
        """``(slab index, byte offset)`` of global ``slot`` (the module's
        :func:`locate` gives its local slot)."""
        if self._closed:
            raise RuntimeError("the store is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        idx, local = locate(slot, self.stripes)
        return idx, local * self.slot_size

    def handle(self, idx: int) -> Any:
        """Slab ``idx``'s back-end handle, opened on first use (read-only,
        unless reopened for writing); OSError from the open passes through
        and the next call tries again."""
        handle = self.handles[idx]
        if handle is None:
            with self._open_lock:
                handle = self.handles[idx]
                if handle is None:
                    if self._closed:
                        raise RuntimeError("the store is closed")
                    handle = self._open(idx)
                    self.handles[idx] = handle
        return handle

    def _open(self, idx: int) -> Any:
        path = self.slabs[idx].path
        with self._lock:  # close() takes the rest of the list under it
            given = None if self._inherited is None else self._inherited[idx]
            if given is not None:
                self._inherited[idx] = None  # taken over once; later by name
        if given is not None:
            handle = self._adopt(path, *given)
            if handle is not None:
                return handle
        if self._inodes is None:
            if not self._engines:
                return self.backend.open(path, writable=False)
            # The directory the scheduler side made and checked: a link
            # put in its place since is not followed (the back end's
            # O_DIRECT probe would write where it points).
            check_own_dir(os.path.dirname(path), "the store directory")
            handle = self.backend.open(path, writable=False)
            fd = self.backend.fileno(handle)
            try:
                if fd is not None:
                    check_private_fd(fd, path)
            except PermissionError:
                # Not the store's slab yet: the engine's scheduler side
                # replaces a slab others can read by a private one (see
                # create_slab) when it opens the store, which a worker may
                # come before. This one's inode would be read for good.
                self.backend.close(handle)
                raise PermissionError(
                    errno.EPERM,
                    "kvtier refuses the slab for now: others can read it, so "
                    "the engine has not taken it yet (it replaces such a slab "
                    "by a private one); tried again later",
                    path,
                ) from None
            return handle
        handle = self.backend.open(path, writable=True)
        fd = self.backend.fileno(handle)
        if fd is None or _dev_ino(fd) != self._inodes[idx]:
            self.backend.close(handle)
            raise PermissionError(
                errno.EPERM,
                "kvtier refuses the slab: the file opened by name is not the "
                "one its store checked and opened (it was swapped?)",
                path,
            )
        return handle

    def _adopt(self, path: str, fd: int, dev_ino: tuple[int, int]) -> Any:
        """A handle over the inherited ``fd`` of ``path``, or None when it
        is not the file it was given as (another file of this process under
        that number: left alone), not open for writing where this store
        writes, or the back end opens files only by name (then closed)."""
        copied = self._inherited_from == os.getpid()
        if copied:  # the giver's own descriptor: a copy of it
            try:
                fd = os.dup(fd)
            except OSError:
                return None
        if not _is_file(fd, dev_ino):
            if copied:
                os.close(fd)
            return None
        handle = None
        with contextlib.suppress(OSError):
            writes = self._inodes is not None
            mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
            if mode == os.O_RDWR or not writes:
                os.set_inheritable(fd, False)
                handle = self.backend.adopt(fd, path)
        if handle is None:
            with contextlib.suppress(OSError):
                os.close(fd)
        return handle

    def open_all(self) -> int:
        """Open every slab not open yet; one that cannot be opened now (not
        created yet, or failing) is left for its first read. Returns how
        many are open."""
        for idx, slab in enumerate(self.slabs):
            try:
                self.handle(idx)
            except OSError as exc:
                logger.debug("slab %s not opened ahead: %s", slab.path, exc)
        return sum(h is not None for h in self.handles)

    def read(self, idx: int, buf: Any, offset: int) -> int:
        """Blocking positioned read from slab ``idx``: the count read."""
        handle = self.handle(idx)
        if self._read_sync is not None:
            return int(self._read_sync(handle, buf, offset))
        return int(self.backend.submit_read(handle, buf, offset).result())

    def submit_read(self, idx: int, buf: Any, offset: int) -> Future[int]:
        """Asynchronous positioned read from slab ``idx`` (the back end's)."""
        return self.backend.submit_read(self.handle(idx), buf, offset)

    def write_all(
        self, op: str, idx: int, buf: Any, offset: int, *, report: bool = True
    ) -> int:
        """Write all of ``buf`` or raise OSError (a short write as EIO); a
        failure is reported with ``io_error(op, ...)`` before it is raised,
        unless ``report`` is False (a write of several blocks that the
        caller retries block by block, so each failing block counts once)."""
        try:
            handle = self.handle(idx)
            if self._write_sync is not None:
                n = int(self._write_sync(handle, buf, offset))
            else:
                n = int(self.backend.submit_write(handle, buf, offset).result())
            if n != len(buf):
                raise OSError(
                    errno.EIO,
                    f"short write ({n} of {len(buf)} bytes)",
                    self.slabs[idx].path,
                )
        except OSError as exc:
            if report:
                self.io_error(op, idx, exc)
            raise
        return n

    # -- counters and reports ---------------------------------------------

    def count_write(self, nbytes: int, seconds: float) -> None:
        """One block written."""
        with self._lock:
            self._stats.write_bytes += nbytes
            self._stats.write_seconds += seconds
            self._stats.blocks_written += 1

    def count_read(
        self, nbytes: int, seconds: float = 0.0, *, blocks: int = 0, ok: int = 0, bad: int = 0
    ) -> None:
        """Bytes read; ``blocks`` slots asked for (header-only reads count
        none), ``ok`` of them served, ``bad`` rejected."""
        with self._lock:
            s = self._stats
            s.read_bytes += nbytes
            s.read_seconds += seconds
            s.blocks_read += blocks
            s.blocks_ok += ok
            s.checksum_failures += bad

    def stats(self) -> SlabStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def io_error(self, op: str, idx: int, exc: OSError) -> None:
        """``op`` on slab ``idx`` failed with ``exc``: counted and logged."""
        with self._lock:
            self._stats.io_errors += 1
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        self._log_once(
            (op, idx, exc.errno),
            "kvtier disk %s failed on %s: errno %s (%s): %s",
            op,
            self.slabs[idx].path,
            exc.errno,
            name,
            exc.strerror,
        )

    def rejected(self, slot: int, what: str, idx: int | None = None) -> None:
        """The bytes read from ``slot`` (of slab ``idx``, located when not
        given) failed a check: logged (the reader counts them)."""
        if idx is None:
            idx = locate(slot, self.stripes)[0]
        self._log_once(
            ("corrupt", idx, None),
            "kvtier disk read of slot %d on %s rejected: %s (corrupt or torn "
            "block, treated as a miss)",
            slot,
            self.slabs[idx].path,
            what,
        )

    def short_read(self, slot: int, at: tuple[int, int] | None = None) -> ReadOutcome:
        """What a read of ``slot`` that came back short means. Slabs are
        preallocated to their full size, so one that now ends inside the
        slot was truncated: TRUNCATED, the block is gone for good (logged
        with the rejected slots). One long enough, or of unknown size, had
        the read cut short by the device: IO_ERROR, transient like an errno
        (counted and logged as an EIO). ``at``: the ``(slab index, byte
        offset)`` that was read, where the caller has it (the slabs of a
        found store need not cover the striping :func:`locate` follows)."""
        idx, offset = self.offset_of(slot) if at is None else at
        handle = self.handles[idx]
        size = None if handle is None else self.backend.size(handle)
        if size is not None and size < offset + self.slot_size:
            self.rejected(
                slot, f"short read: the slab ends at byte {size} (truncated)", idx
            )
            return ReadOutcome.TRUNCATED
        self.io_error(
            "read",
            idx,
            OSError(errno.EIO, f"short read of slot {slot} (not the file's end)"),
        )
        return ReadOutcome.IO_ERROR

    def host_only(self, slot: int, why: str) -> None:
        """An intact slot that the device path cannot verify: logged."""
        idx = locate(slot, self.stripes)[0]
        self._log_once(
            ("host_only", idx, None),
            "kvtier slot %d of %s cannot be verified on the device (%s): the "
            "block is recomputed and stored again in a form the device path "
            "reads",
            slot,
            self.slabs[idx].path,
            why,
        )

    def _log_once(self, key: tuple[str, int, int | None], msg: str, *args: Any) -> None:
        with self._lock:
            first = key not in self._logged
            self._logged.add(key)
        if first:
            logger.warning(msg + "; repeats logged at debug", *args)
        else:
            logger.debug(msg, *args)

    # -- lifetime ------------------------------------------------------------

    def close(self) -> None:
        """Close slab handles, the back end when owned, and the directory
        descriptors (releasing the store locks). Idempotent."""
        with self._lock:
            if self._closed and not self._abandoned:
                return
            self._closed, self._abandoned = True, False
            handles, self.handles = self.handles, [None] * len(self.handles)
            inherited, self._inherited = self._inherited, None
        for handle in handles:
            if handle is not None:
                with contextlib.suppress(OSError):
                    self.backend.close(handle)
        if self._inherited_from != os.getpid():
            for given in inherited or ():
                # Inherited, never taken over: closed if still that file.
                if given is not None and _is_file(*given):
                    with contextlib.suppress(OSError):
                        os.close(given[0])
        if self._owns_backend:
            self.backend.shutdown()
        for fd in self._dir_fds:  # releases the store-directory locks
            with contextlib.suppress(OSError):
                os.close(fd)
        self._dir_fds.clear()

    def abandon(self) -> None:
        """Mark closed without closing anything: for files whose I/O threads
        may still be blocked in a read or write (a hung disk). The
        descriptors stay open (a closed number could be reused by another
        file while a blocked write still targets it) and the locks stay
        held, until a later :meth:`close` (once those threads returned) or
        the process's exit."""
        with self._lock:
            self._abandoned = not self._closed or self._abandoned
            self._closed = True


# ------------------------------------------------------------------ create


def create_slab(
    path: str, num_slots: int, slot_bytes: int, *, dir_fd: int | None = None
) -> tuple[tuple[int, int], int]:
    """Create (or reopen) the slab at ``path``, at least ``num_slots *
    slot_bytes`` bytes and mode 0o600, preallocated (a sparse one too); its ``(st_dev,
    st_ino)`` and the size it had before (0 for a new file: past that
    offset it holds nothing yet). A larger file is never shrunk (its tail
    is unused). A link,
    another owner's file or a group/other-writable one is refused; with
    ``dir_fd`` the name is resolved inside that (already checked)
    directory.

    Our own slab readable by group or others (copied or restored under
    umask 022) is replaced by a new private file, its blocks not reused,
    rather than made private with ``chmod``: a mode is checked only when
    a file is opened, so a descriptor another user opened meanwhile would
    go on reading every block written from now on."""
    size = num_slots * slot_bytes
    name = os.path.basename(path) if dir_fd is not None else path
    fd = open_private(name, os.O_RDWR | os.O_CREAT, FILE_MODE, dir_fd=dir_fd)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & 0o077:
            os.close(fd)
            fd = -1
            os.unlink(name, dir_fd=dir_fd)
            logger.warning(
                "kvtier: slab %s was readable by others (mode %04o): a "
                "descriptor another user opened meanwhile would read every "
                "block written from now on, so it is replaced by a new "
                "private file and its blocks are not reused. Keep slabs "
                "0600 when copying or restoring them (cp -p, umask 077)",
                path,
                mode,
            )
            fd = open_private(
                name, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE, dir_fd=dir_fd
            )
        elif mode != FILE_MODE:  # ours and private, only too tight
            os.fchmod(fd, FILE_MODE)
        st = os.fstat(fd)
        if st.st_size < size or st.st_blocks * 512 < size:
            # Short, or sparse: a slab copied or restored with its holes
            # (cp --sparse, rsync -S, tar -S) takes their space only when a
            # spill writes there, which on a full disk fails with ENOSPC.
            # Preallocating keeps what is written.
            _preallocate(fd, size, path, st.st_size)
    finally:
        if fd >= 0:
            os.close(fd)
    return (st.st_dev, st.st_ino), st.st_size


def _dev_ino(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _is_file(fd: int, dev_ino: tuple[int, int]) -> bool:
    """Whether descriptor ``fd`` is open here on the file ``dev_ino``."""
    try:
        return _dev_ino(fd) == dev_ino
    except OSError:
        return False


def _open_store_dir(path: str, base: str) -> int:
    """Create or open a store directory, check it and lock it; its fd.

    Refused: a symbolic link, a non-directory, a directory of another owner,
    one writable by group or others (see kvtier.safe_open), and one locked
    by another live store (two engines on one ``disk_path`` would adopt each
    other's blocks and evict each other's slots)."""
    try:
        os.makedirs(base, exist_ok=True)
    except FileExistsError as exc:
        raise NotADirectoryError(
            errno.ENOTDIR, "kvtier disk_path exists but is not a directory", base
        ) from exc
    fd = open_private_dir(path)
    try:
        if not flock_exclusive(fd):
            raise InUseError(
                f"kvtier disk store {path!r} (disk_path {base!r}) is in use by "
                "another running kvtier engine with the same model and layout "
                f"(another process, or another engine in this process){lock_holders(fd)}. "
                "Give each engine its own disk_path, or stop the other engine "
                "first (a server killed with SIGKILL may leave its engine core "
                "process running)",
                path,
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


# What a process killed while it held a store directory may leave there:
# a temporary layout.json (_write_layout) or an O_DIRECT probe file
# (kvtier.store.backends.posix.probe_direct); group 1 or 2: its pid.
_LEFTOVER_RE = re.compile(
    rf"^(?:{re.escape(LAYOUT_FILE)}\.([0-9]+)\.[0-9]+\.tmp"
    r"|\.kvtier-odirect-probe-([0-9]+)-[0-9a-f]+)\Z"
)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True


def _listing(dir_fd: int) -> list[str]:
    """The names in a store directory, [] if it cannot be listed."""
    try:
        return os.listdir(dir_fd)
    except OSError:
        return []


def _remove_leftovers(directory: str, dir_fd: int, names: list[str]) -> None:
    """Remove from the store directory (locked by this process; ``names``,
    its listing) the files that processes killed half-way through creating
    or removing them left behind, so a crash at such a moment does not
    leave them for good. Only those of processes that are gone: the
    engine's own workers probe O_DIRECT here too."""
    for name in names:
        m = _LEFTOVER_RE.match(name)
        if m is None or _pid_alive(int(m.group(1) or m.group(2))):
            continue
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            continue
        logger.info("removed %s/%s, left by a process that is gone", directory, name)


def _take_misplaced_slab(
    directory: str, dir_fd: int, index: int, listing: list[str]
) -> None:
    """Name slab ``index`` the one slab of another index this store
    directory (locked by this process; ``listing``, its names) holds, when
    it has none of its own: ``disk_path`` was listed in another order, the
    striped file systems came up mounted the other way round, or a path
    left the list. A slab's blocks live anywhere in the store (slot headers
    name their keys, not their slots), so the warm restart adopts them
    where they now are (all but those of local slots past the new index's
    share, with uneven stripes); without this the store would start empty,
    with a second slab preallocated beside the first and the old one left
    taking its space. A directory with its own slab, or several others, is
    left as it is."""
    names = [n for n in listing if SLAB_RE.match(n)]
    own = slab_name(index)
    if own in names or len(names) != 1:
        return
    try:
        os.rename(names[0], own, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        logger.warning("kvtier: %s/%s not renamed %s: %s", directory, names[0], own, exc)
        return
    logger.warning(
        "kvtier: %s held %s of this store, not %s (disk_path listed in another "
        "order, or its file systems mounted the other way round?): renamed %s, "
        "its blocks kept",
        directory,
        names[0],
        own,
        own,
    )


def _write_layout(
    directory: str,
    fingerprint: LayoutFingerprint,
    slot_bytes: int,
    stripes: int,
    slots: int,
    *,
    dir_fd: int,
) -> None:
    """Write ``layout.json`` unless it already says the same. It is only an
    aid (reads never trust it), so a failure to write it is a warning, and
    the temporary file goes with it. ``stripes``: how many directories the
    store stripes over (``kvtier inspect`` of some of them says so);
    ``slots``: the store's slots, what its slabs were preallocated to hold
    (``kvtier verify`` of a slab cut short says how many were lost)."""
    doc = dict(
        fingerprint.describe(),
        header_size=HEADER_SIZE,
        slot_size=slot_bytes,
        stripes=stripes,
        slots=slots,
    )
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    data = text.encode("utf-8")
    path = os.path.join(directory, LAYOUT_FILE)
    try:
        fd = open_private(LAYOUT_FILE, os.O_RDONLY, dir_fd=dir_fd, private=True)
        # Compared as bytes, at most one past ours: whatever else is there
        # (bytes that are not UTF-8, a huge file) is only replaced.
        with os.fdopen(fd, "rb") as f:
            if f.read(len(data) + 1) == data:
                return
    except FileNotFoundError:
        pass
    except OSError as exc:
        # A link, not private to us, unreadable: it is only an aid, so
        # replace it (rename replaces the name itself, never a link's target).
        logger.info("replacing %s: %s", path, exc)
    tmp = f"{LAYOUT_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)  # a crashed run's leftover
    try:
        fd = open_private(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd, private=True
        )
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, LAYOUT_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        logger.warning(
            "kvtier could not write %s (%s); the store works without it, but "
            "kvtier inspect shows less (remove what is in its place)",
            path,
            exc,
        )


def _preallocate(fd: int, size: int, path: str, old_size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as exc:
        # tmpfs/overlay/NFS may not implement fallocate; a sparse file is
        # still correct, only allocation moves to the first write.
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            # ext4 keeps what a failed fallocate allocated (and grows the
            # file), which would leave the file system full after a refused
            # start; os.posix_fallocate's OSError names no file.
            try:
                os.ftruncate(fd, old_size)
            except OSError as undo:
                logger.warning("could not shrink %s back: %s", path, undo)
            raise OSError(
                exc.errno,
                f"cannot preallocate {size} bytes for the kvtier slab "
                f"({exc.strerror}); lower disk_bytes_to_use or free space",
                path,
            ) from exc
        logger.info(
            "posix_fallocate unsupported for %s (%s); using ftruncate", path, exc
        )
    os.ftruncate(fd, max(size, old_size))  # never shrinks a larger slab


# -------------------------------------------------------------------- find


class _ReadOnly(DiskBackend):
    """The tools' back end: ``os.preadv`` on the calling thread, on
    descriptors from :func:`_open_store_file`, each slab opened by its name
    in its store directory's pinned descriptor (``dirs``: directory path ->
    descriptor); it never writes."""

    name = "pread"

    def __init__(self, dirs: dict[str, int]) -> None:
        self._dirs = dirs

    def open(self, path: str, writable: bool = True) -> int:
        return _open_store_file(path, self._dirs[os.path.dirname(path)])[0]

    def submit_read(self, handle: int, buf: Any, offset: int) -> Future[int]:
        fut: Future[int] = Future()
        try:
            fut.set_result(os.preadv(handle, [memoryview(buf).cast("B")], offset))
        except OSError as exc:
            fut.set_exception(exc)
        return fut

    def submit_write(self, handle: int, buf: Any, offset: int) -> Future[int]:
        raise PermissionError(errno.EBADF, "kvtier tools never write a store")

    def close(self, handle: int) -> None:
        os.close(handle)

    def fileno(self, handle: int) -> int:
        return handle


def _open_store_file(path: str, dir_fd: int) -> tuple[int, os.stat_result]:
    """:func:`~kvtier.safe_open.open_regular` (no link followed) for the
    tools: ``path``'s file opened by its name in ``dir_fd`` (its store
    directory, pinned by :func:`find_stores`), its refusals as
    :class:`StoreError` naming ``path``, the open's errno kept."""
    try:
        return open_regular(os.path.basename(path), dir_fd=dir_fd)
    except NotRegularFileError as exc:
        raise StoreError(f"{path}: not a regular file ({exc.kind})") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError(f"{path}: is a symbolic link (refused)") from None
        refused = StoreError(f"{path}: cannot open: {exc.strerror or exc}")
        refused.errno = exc.errno
        raise refused from None


def find_stores(paths: Sequence[str]) -> list[SlabFiles]:
    """Stores under ``paths`` (disk paths or ``kvtier-*`` directories),
    read-only; the same store name found under several paths is one store.

    A ``kvtier-*`` entry found by listing a path must be a directory, never
    a symbolic link (another user may have planted it in a shared disk
    path). Raises FileNotFoundError / NotADirectoryError for a bad path, and
    :class:`StoreError` when a path holds no store or a store cannot be read
    safely: a slab or layout.json that is not a regular file, an impossible
    or inconsistent geometry, no slab, or no slot size to be had.

    Each store directory is opened once (:func:`_pin_dir`) and everything in
    it is listed, read and opened through that descriptor: a directory
    swapped for a link afterwards is never followed. The descriptors close
    with the returned files."""
    by_name: dict[str, list[str]] = {}
    given: set[str] = set()  # store directories named by the caller
    for path in paths:
        path = os.path.abspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such file or directory")
        if not os.path.isdir(path):
            raise NotADirectoryError(f"{path}: not a directory")
        names = os.listdir(path)
        if STORE_DIR_RE.match(os.path.basename(path.rstrip(os.sep))) or any(
            n == LAYOUT_FILE or SLAB_RE.match(n) for n in names
        ):
            dirs = [path]
            given.add(path)
        else:
            dirs = sorted(
                os.path.join(path, n)
                for n in names
                if STORE_DIR_RE.match(n) and _store_dir(os.path.join(path, n))
            )
        if not dirs:
            raise StoreError(f"{path}: no kvtier-<digest> store directory found")
        for d in dirs:
            found = by_name.setdefault(os.path.basename(d), [])
            # One directory given twice (P and P/, a link to P, P and its
            # store) is one store, not two copies of it.
            if not any(_same_dir(d, other) for other in found):
                found.append(d)
    stores: list[SlabFiles] = []
    try:
        for name, dirs in sorted(by_name.items()):
            pinned: dict[str, int] = {}
            try:
                for d in dirs:
                    pinned[d] = _pin_dir(d, follow=d in given)
                stores.append(_found(name, dirs, pinned))
            except BaseException:
                for fd in pinned.values():
                    os.close(fd)
                raise
    except BaseException:
        for files in stores:
            files.close()
        raise
    return stores


def _pin_dir(path: str, *, follow: bool) -> int:
    """A descriptor of the store directory ``path``; a symbolic link is
    refused (:func:`_store_dir`'s refusal) unless ``follow`` (a directory
    the operator named). StoreError if it cannot be opened."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        return os.open(path, flags if follow else flags | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise _link_refused(path) from None
        raise StoreError(f"{path}: cannot open: {exc.strerror or exc}") from None


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # gone meanwhile: the read says so
        return False


def _store_dir(path: str) -> bool:
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False  # gone meanwhile
    if stat.S_ISLNK(mode):
        raise _link_refused(path)
    return stat.S_ISDIR(mode)


def _link_refused(path: str) -> StoreError:
    return StoreError(
        f"{path}: is a symbolic link (refused: kvtier never follows links "
        "to its store directories). Remove it, or pass the directory it "
        "points to"
    )


def _found(name: str, directories: Sequence[str], pinned: dict[str, int]) -> SlabFiles:
    """One store found on disk: its layout.json, slabs and geometry, read
    through each directory's pinned descriptor (which the files then own)."""
    where = ", ".join(directories)
    layout: dict[str, Any] | None = None
    warnings: list[str] = []
    for d in directories:
        doc, err = _read_layout(d, pinned[d])
        if err is not None:
            warnings.append(err)
        elif layout is None:
            layout = doc
        elif doc != layout:
            warnings.append(f"{d}: layout.json differs from {directories[0]}")
    block_bytes, digest = _geometry(f"{directories[0]}/{LAYOUT_FILE}", layout, warnings)
    if digest is not None and not digest.hex().startswith(
        store_digest_prefix(name) or ""
    ):
        # The engine's slots carry the digest the directory is named by.
        warnings.append(
            f"layout.json digest {digest.hex()} does not match the directory name "
            f"{name}; slots are judged by the name's digest"
        )
        digest = None
    found: list[tuple[int, str, int]] = []
    for d in directories:
        try:
            names = sorted(os.listdir(pinned[d]))
        except OSError as exc:
            raise StoreError(f"{d}: cannot list: {exc.strerror or exc}") from None
        for n in names:
            m = SLAB_RE.match(n)
            if m is not None:
                fd, st = _open_store_file(os.path.join(d, n), pinned[d])
                os.close(fd)
                found.append((int(m.group(1)), os.path.join(d, n), st.st_size))
    found.sort()
    if not found:
        raise StoreError(f"{where}: no slab-<n>.kvt file in the store")
    for (i, first, _), (j, second, _) in zip(found, found[1:]):
        if i == j:
            # Two copies of one store (a backup beside the original): one
            # stripe twice would number two slots alike and mix them up.
            raise StoreError(
                f"{first} and {second} are both {slab_name(i)} of store {name}: "
                "two copies of one store, not its stripes; check each copy "
                "on its own (one path at a time)"
            )
    if block_bytes is None:
        block_bytes = _infer_block_bytes([p for _i, p, _s in found], pinned, warnings)
    if block_bytes is None:
        raise StoreError(f"{where}: {warnings[-1]}")
    ssz = slot_size(block_bytes)
    slabs = []
    for index, path, size in found:
        if 0 < size < ssz:
            raise StoreError(
                f"{path}: {size} bytes, smaller than one slot of {ssz} bytes "
                f"(block_bytes {block_bytes}): wrong layout.json?"
            )
        if size % ssz:
            warnings.append(
                f"{path}: size {size} is not a multiple of the slot size "
                f"{ssz}; the partial tail is ignored"
            )
        slabs.append(SlabFile(path, index, size // ssz, ssz, size))
    if not any(s.num_slots for s in slabs):
        raise StoreError(f"{where}: every slab is empty (0 bytes, no slots)")
    stripes = _declared_stripes(where, layout, [s.index for s in slabs], warnings)
    short = _short_slabs(layout, slabs, stripes)
    warnings += short
    files = SlabFiles(
        name,
        list(directories),
        slabs,
        block_bytes,
        digest if digest is not None else store_digest_prefix(name),
        _ReadOnly(pinned),
        owns_backend=False,
    )
    files._dir_fds = list(pinned.values())  # closed with the files
    files.layout, files.warnings, files.short = layout, warnings, short
    if stripes is not None:
        files.stripes = stripes  # slots numbered store-wide, as the engine does
    return files


def _short_slabs(
    layout: dict[str, Any] | None, slabs: list[SlabFile], stripes: int | None
) -> list[str]:
    """Each slab shorter than the slots ``layout.json`` says the store was
    preallocated with (a file cut short: truncated, restored from a partial
    copy), one line each; the slots past its end, and the blocks they held,
    are gone. Nothing when layout.json does not say (older stores)."""
    declared = (layout or {}).get("slots")
    if isinstance(declared, bool) or not isinstance(declared, int) or declared < 1:
        return []
    count = stripes or max(s.index for s in slabs) + 1
    out = []
    for slab in slabs:
        expected = local_slot_count(declared, slab.index, count)
        if slab.num_slots < expected:
            out.append(
                f"{slab.path}: holds {slab.num_slots} of the {expected} slots "
                f"layout.json says it was made with ({slab.size} bytes): the "
                f"blocks of the other {expected - slab.num_slots} are lost "
                "(file truncated?)"
            )
    return out


def _declared_stripes(
    where: str, layout: dict[str, Any] | None, found: list[int], warnings: list[str]
) -> int | None:
    """The directory count ``layout.json`` states, when it is plausible (no
    smaller than the slabs found imply); a warning names the slabs not
    found, so a check of some directories of a striped store says that it
    did not see the whole store."""
    declared = (layout or {}).get("stripes")
    if isinstance(declared, bool) or not isinstance(declared, int):
        return None
    if not max(found) < declared <= MAX_STRIPES:
        warnings.append(
            f"{where}: layout.json says the store stripes over {declared} "
            f"directories, but slab-{max(found)}.kvt was found; ignored"
        )
        return None
    missing = sorted(set(range(declared)) - set(found))
    if missing:
        names = ", ".join(slab_name(i) for i in missing)
        warnings.append(
            f"the store stripes over {declared} directories; {names} not under "
            "the paths given, so its slots were not checked: pass every "
            "directory of its disk_path to check the whole store"
        )
    return declared


def _read_layout(
    directory: str, dir_fd: int
) -> tuple[dict[str, Any] | None, str | None]:
    """(layout, None), or (None, warning) for a missing or unparsable file
    (read through ``dir_fd``, ``directory``'s descriptor). StoreError for a
    layout.json that is not a regular file or is implausibly large."""
    path = os.path.join(directory, LAYOUT_FILE)
    try:
        os.stat(LAYOUT_FILE, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None, f"{path}: missing"
    except OSError:
        pass  # the open says what is wrong
    try:
        fd, st = _open_store_file(path, dir_fd)
    except StoreError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM):
            raise
        return None, f"{exc} (an aid only: read without it)"  # as if missing
    try:
        if st.st_size > MAX_LAYOUT_BYTES:
            raise StoreError(f"{path}: {st.st_size} bytes, not a kvtier layout.json")
        data = os.pread(fd, MAX_LAYOUT_BYTES + 1, 0)
    except OSError as exc:
        return None, f"{path}: unreadable ({exc})"
    finally:
        os.close(fd)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        return None, f"{path}: unreadable ({exc})"
    if not isinstance(doc, dict):
        return None, f"{path}: not a JSON object"
    return doc, None


def _layout_int(layout: dict[str, Any], key: str, where: str) -> int:
    v = layout[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise StoreError(f"{where}: {key} {v!r:.40} is not an integer")
    return v


def _geometry(
    where: str, layout: dict[str, Any] | None, warnings: list[str]
) -> tuple[int | None, bytes | None]:
    """``(block_bytes, digest)`` that layout.json states, each None when it
    does not. StoreError when its geometry is impossible (non-integer,
    non-positive, not 4 KiB-aligned, absurdly large, or inconsistent)."""
    if layout is None:
        return None, None
    block_bytes = None
    if "block_bytes" not in layout:
        warnings.append(f"{where}: no block_bytes; geometry taken from headers")
    else:
        bb = _layout_int(layout, "block_bytes", where)
        if not 0 < bb <= MAX_BLOCK_BYTES:
            raise StoreError(
                f"{where}: block_bytes {bb} is not within [1, {MAX_BLOCK_BYTES}]"
            )
        expected = slot_size(bb)
        if "slot_size" in layout:
            ssz = _layout_int(layout, "slot_size", where)
            if not MIN_SLOT_SIZE <= ssz <= MAX_SLOT_SIZE or ssz % IO_ALIGNMENT:
                raise StoreError(
                    f"{where}: slot_size {ssz} is impossible (a slot is a "
                    f"{HEADER_SIZE} B header plus the payload, a multiple of "
                    f"{IO_ALIGNMENT} B between {MIN_SLOT_SIZE} and {MAX_SLOT_SIZE})"
                )
            if ssz != expected:
                raise StoreError(
                    f"{where}: slot_size {ssz} does not match block_bytes {bb} "
                    f"(this format's slot is {expected} B)"
                )
        block_bytes = bb
    if layout.get("header_size", HEADER_SIZE) != HEADER_SIZE:
        warnings.append(
            f"layout.json header_size {layout['header_size']!r:.40} != {HEADER_SIZE}"
        )
    digest = layout.get("digest")
    if isinstance(digest, str):
        try:
            return block_bytes, bytes.fromhex(digest)
        except ValueError:
            warnings.append(f"layout.json digest {digest!r:.80} is not hex")
    return block_bytes, None


def _infer_block_bytes(
    paths: list[str], pinned: dict[str, int], warnings: list[str]
) -> int | None:
    """Without a usable layout.json: the block size in the header of slot 0
    of the first slab that has a valid one (within MAX_BLOCK_BYTES); each
    opened through its directory's descriptor in ``pinned``."""
    for path in paths:
        try:
            fd, _ = _open_store_file(path, pinned[os.path.dirname(path)])
        except StoreError:
            continue
        try:
            buf = os.pread(fd, HEADER_SIZE, 0)
        except OSError:
            continue
        finally:
            os.close(fd)
        if len(buf) < HEADER_SIZE:
            continue
        try:
            hdr = SlotHeader.unpack(buf)
        except HeaderError:  # empty or corrupt
            continue
        if not 0 < hdr.raw_len <= MAX_BLOCK_BYTES:
            warnings.append(f"{path}: slot 0 header raw_len {hdr.raw_len} is implausible")
            continue
        warnings.append(
            f"slot size {slot_size(hdr.raw_len)} inferred from the header of slot 0 "
            f"of {path}"
        )
        return hdr.raw_len
    warnings.append(
        "no usable layout.json and no readable header at slot 0 of any slab: "
        "slot size unknown"
    )
    return None
