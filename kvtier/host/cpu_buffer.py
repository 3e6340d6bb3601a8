"""The CPU tier's storage: one contiguous, page-aligned host buffer of blocks.

One big mapping instead of many small tensors because (a) the disk path needs
page-aligned rows for O_DIRECT, (b) a single registration page-locks it all for
fast GPU<->CPU copies, and (c) backed by a file in /dev/shm it can be mapped by
the scheduler process and every worker, which then see the same bytes.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import weakref
from types import TracebackType

import numpy as np
import torch

from kvtier.host.cpu_files import rmdir_if_empty, same_name
from kvtier.log import get_logger
from kvtier.safe_open import (
    InUseError,
    flock_exclusive,
    is_locked,
    open_private,
    open_private_dir,
)
from kvtier.store.slot import round_up

logger = get_logger("host")


class CpuBlockBuffer:
    """``num_blocks`` rows of ``block_bytes`` bytes in one page-aligned mapping.

    Contract:
      - ``array`` (numpy uint8, shape [num_blocks, block_bytes]) and
        ``tensor`` (torch.uint8) share the same memory; row ``i`` starts at a
        page-aligned address whenever ``block_bytes`` is a multiple of 4096.
      - Without ``shm_path`` the memory is anonymous and private to this
        process (and zero-filled). With ``shm_path`` it is a MAP_SHARED mapping
        of that file (mode 0o600, never followed through a symbolic link,
        owner and mode checked on the opened descriptor). ``owner=True``
        creates the file exclusively, fully sized, and holds an exclusive
        flock on it for its lifetime (the kernel drops it when the process
        dies): a file already there is removed if its lock can be taken (a
        dead engine's leftover) and otherwise refused with InUseError (a
        live engine uses that name); another user's file is refused, never
        adopted. ``owner=False`` maps an existing file whose owner is alive
        (its lock is held), else FileNotFoundError. ``owner=None``: the
        latter if possible, else the former.
      - ``unlink_name`` removes the file's name (only while it still names
        the mapped inode) once every process that needs the rows has them
        mapped: the memory then goes back to the system when the last
        mapping goes, however its processes end (SIGKILL and OOM kill
        included). Until then a dead owner's file is reclaimed by the next
        start (its lock died with it).
      - ``close`` unmaps and, for the owner, unlinks the file and
        releases the lock (also done at garbage collection or interpreter
        exit, so a failed start leaves no file). Views handed out must be
        dropped first, or unmapping is left to the GC.
      - Page-locking for an accelerator is not done here: the worker's copy
        path registers the rows it transfers (vLLM's ``host_register``, see
        kvtier.connector.worker.device_copy) and unregisters them before close.
    """

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        shm_path: str | None = None,
        *,
        owner: bool | None = None,
    ) -> None:
        if num_blocks < 1 or block_bytes < 1:
            raise ValueError(f"bad buffer geometry: {num_blocks} x {block_bytes}")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.nbytes = num_blocks * block_bytes
        self.shm_path = shm_path
        self._map_size = mapped_bytes(num_blocks, block_bytes)
        self._closed = False
        self._array: np.ndarray | None = None
        self._tensor: torch.Tensor | None = None
        self._release: weakref.finalize | None = None
        self._inode: tuple[int, int] | None = None
        if shm_path is None:
            self.owner = True
            self._mmap = mmap.mmap(-1, self._map_size)
        else:
            self._mmap, self.owner, fd, self._inode = _map_shared_file(
                shm_path, self._map_size, owner
            )
            if self.owner:
                # Unlinks the file and drops the lock on close(), on garbage
                # collection or at interpreter exit, whichever comes first.
                self._release = weakref.finalize(self, _release_owned, shm_path, fd)
        try:
            self._array = np.frombuffer(
                self._mmap, dtype=np.uint8, count=self.nbytes
            ).reshape(num_blocks, block_bytes)
            self._tensor = torch.from_numpy(self._array)
        except BaseException:
            self.close()
            raise

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            raise RuntimeError("CpuBlockBuffer is closed")
        return self._array

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeError("CpuBlockBuffer is closed")
        return self._tensor

    def row(self, index: int) -> np.ndarray:
        """Row ``index`` as a 1-D uint8 view."""
        return self.array[index]

    def unlink_name(self) -> bool:
        """Remove ``shm_path`` if it still names the mapped inode (never a
        successor's file); the mapping stays valid. Returns whether it was
        removed. Idempotent; False for an anonymous buffer."""
        if self.shm_path is None or self._inode is None:
            return False
        try:
            st = os.stat(self.shm_path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) != self._inode:
                return False
            os.unlink(self.shm_path)
        except OSError:
            return False
        rmdir_if_empty(os.path.dirname(self.shm_path))
        return True

    def close(self) -> None:
        """Unmap and (owner) unlink. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._array = None
        self._tensor = None
        try:
            self._mmap.close()
        except BufferError:
            # Someone still holds a view; the mapping goes when they drop it.
            logger.warning(
                "CpuBlockBuffer closed while views are alive; unmap deferred"
            )
        if self._release is not None:
            self._release()

    def __enter__(self) -> CpuBlockBuffer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def mapped_bytes(num_blocks: int, block_bytes: int) -> int:
    """Shared memory one rank's CPU tier of ``num_blocks`` rows of
    ``block_bytes`` takes: the rows, rounded up to a page."""
    return round_up(num_blocks * block_bytes, mmap.PAGESIZE)


def _unlink_if_same(path: str, fd: int) -> None:
    """Unlink ``path`` only if it still names our inode (never a successor's)."""
    with contextlib.suppress(OSError):
        if same_name(path, fd):
            os.unlink(path)


def _reserve(fd: int, size: int, path: str) -> None:
    os.ftruncate(fd, size)
    # Reserve the pages now: a sparse file on a full tmpfs (/dev/shm is
    # 64 MiB in a default container) would otherwise SIGBUS the process on
    # first touch, long after start-up.
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return  # the file system cannot reserve; keep the sparse file
        raise OSError(
            exc.errno,
            f"cannot reserve {size} bytes for the kvtier CPU tier "
            f"({os.strerror(exc.errno or 0)}); enlarge {os.path.dirname(path)} "
            "(e.g. docker run --shm-size) or lower cpu_bytes_to_use",
            path,
        ) from exc


def _try_reclaim(path: str) -> bool:
    """The file at ``path`` exists: reclaim it if no live engine holds it.

    Returns True when it was removed (a dead engine's leftover). Raises
    InUseError when a live process holds its lock, PermissionError/OSError
    when it is not ours (another user's file, a symlink): never adopted."""
    try:
        fd = open_private(path, os.O_RDONLY, private=True)
    except FileNotFoundError:
        return True  # gone meanwhile: try creating again
    try:
        if not flock_exclusive(fd):
            raise InUseError(
                f"kvtier CPU-tier file {path!r} is in use by another live process",
                path,
            )
        if not same_name(path, fd):
            return True
        size = os.fstat(fd).st_size
        os.unlink(path)
        logger.info(
            "kvtier: reclaimed stale CPU-tier file %s (%d bytes) left by an "
            "engine that is no longer running",
            path,
            size,
        )
        return True
    finally:
        os.close(fd)


def _create_owned(path: str, size: int) -> int:
    """Create ``path`` exclusively, locked and fully sized; returns its fd.

    The file is built under a random temporary name (O_EXCL, O_NOFOLLOW,
    0600), locked (flock, held for the owner's lifetime and released by the
    kernel when the process dies), sized and reserved, and only then linked
    to ``path`` (link fails if the name exists). So the name never shows a
    half-built or unlocked file. An existing file is a dead engine's
    leftover if its lock can be taken (then it is removed and the creation
    retried) and otherwise a live engine's: InUseError."""
    directory, name = os.path.split(path)
    for _attempt in range(5):
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = open_private(
                tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600, private=True
            )
        except FileNotFoundError:
            # The last other engine removed the (empty) directory meanwhile.
            os.close(open_private_dir(directory))
            continue
        try:
            if not flock_exclusive(fd):  # a brand-new inode: cannot happen
                raise InUseError(f"cannot lock {tmp!r}", tmp)
            _reserve(fd, size, path)
            try:
                os.link(tmp, path, follow_symlinks=False)
            except FileExistsError:
                os.unlink(tmp)
                os.close(fd)
                fd = -1
                _try_reclaim(path)
                continue
            os.unlink(tmp)
            return fd
        except BaseException:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                os.close(fd)
            raise
    raise InUseError(
        f"kvtier CPU-tier file {path!r} keeps being re-created by another process",
        path,
    )


def _open_attached(path: str, size: int) -> int:
    """Open a live owner's file: ours, 0600, not a link, locked by its owner,
    big enough. Raises FileNotFoundError/OSError/PermissionError otherwise."""
    fd = open_private(path, os.O_RDWR, private=True)
    try:
        if not is_locked(fd):
            raise FileNotFoundError(
                errno.ENOENT,
                "kvtier CPU-tier file has no live owner (a stale leftover of an "
                "engine that is no longer running); refusing to map its rows",
                path,
            )
        have = os.fstat(fd).st_size
        if have < size:
            raise OSError(
                errno.EINVAL,
                f"kvtier CPU-tier file holds {have} bytes but {size} are expected "
                "(another engine's geometry?)",
                path,
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map_shared_file(
    path: str, size: int, owner: bool | None
) -> tuple[mmap.mmap, bool, int, tuple[int, int]]:
    """Map ``path``; returns (mapping, owner, fd, (st_dev, st_ino)). The
    owner's fd is open (it holds the lock) and must be closed by the caller;
    otherwise it is -1."""
    if owner is None:
        try:
            fd, owner = _open_attached(path, size), False
        except FileNotFoundError:
            fd, owner = _create_owned(path, size), True
    elif owner:
        fd = _create_owned(path, size)
    else:
        fd = _open_attached(path, size)
    try:
        st = os.fstat(fd)
        mapping = mmap.mmap(
            fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    except BaseException:
        if owner:
            _unlink_if_same(path, fd)
        os.close(fd)
        raise
    if not owner:
        os.close(fd)
        fd = -1
    return mapping, owner, fd, (st.st_dev, st.st_ino)


def _release_owned(path: str, fd: int) -> None:
    """Unlink the owner's file (if the name is still ours) and drop its lock.
    Runs from close(), from the GC, or at interpreter exit (weakref.finalize),
    so a failed start never leaves the file behind."""
    _unlink_if_same(path, fd)
    with contextlib.suppress(OSError):
        os.close(fd)
    rmdir_if_empty(os.path.dirname(path))
