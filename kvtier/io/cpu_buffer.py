"""The CPU tier's storage: one contiguous, page-aligned host buffer of blocks.

One big mapping instead of many small tensors because (a) the disk path needs
page-aligned rows for O_DIRECT, (b) a single cudaHostRegister pins it all for
fast GPU<->CPU copies, and (c) backed by a file in /dev/shm it can be mapped by
the scheduler process and every worker, which then see the same bytes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
from types import TracebackType

import numpy as np
import torch

from kvtier.io.format import round_up

logger = logging.getLogger("kvtier.io")


class CpuBlockBuffer:
    """``num_blocks`` rows of ``block_bytes`` bytes in one page-aligned mapping.

    Contract:
      - ``array`` (numpy uint8, shape [num_blocks, block_bytes]) and
        ``tensor`` (torch.uint8) share the same memory; row ``i`` starts at a
        page-aligned address whenever ``block_bytes`` is a multiple of 4096.
      - Without ``shm_path`` the memory is anonymous and private to this
        process (and zero-filled). With ``shm_path`` it is a MAP_SHARED mapping
        of that file (mode 0o600): ``owner=None`` creates the file if absent
        and becomes its owner, ``owner=True`` creates or reuses it and owns it,
        ``owner=False`` opens an existing one. The file is grown to size
        (never shrunk) by whoever maps it first.
      - ``close`` unpins, unmaps and, for the owner, unlinks the file. Views
        handed out must be dropped first, or unmapping is left to the GC.
      - When CUDA is available the mapping is page-locked with
        cudaHostRegister (``pin=False`` to skip); on CPU-only hosts nothing
        happens.
    """

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        shm_path: str | None = None,
        *,
        owner: bool | None = None,
        pin: bool = True,
    ) -> None:
        if num_blocks < 1 or block_bytes < 1:
            raise ValueError(f"bad buffer geometry: {num_blocks} x {block_bytes}")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.nbytes = num_blocks * block_bytes
        self.shm_path = shm_path
        self._map_size = round_up(self.nbytes, mmap.PAGESIZE)
        if shm_path is None:
            self.owner = True
            self._mmap = mmap.mmap(-1, self._map_size)
        else:
            self._mmap, self.owner = _map_shared_file(shm_path, self._map_size, owner)
        self._array: np.ndarray | None = np.frombuffer(
            self._mmap, dtype=np.uint8, count=self.nbytes
        ).reshape(num_blocks, block_bytes)
        self._tensor: torch.Tensor | None = torch.from_numpy(self._array)
        self._pinned = pin and _pin(self._array)
        self._closed = False

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

    @property
    def pinned(self) -> bool:
        """Whether the buffer is registered with CUDA as page-locked memory."""
        return self._pinned

    def row(self, index: int) -> np.ndarray:
        """Row ``index`` as a 1-D uint8 view."""
        return self.array[index]

    def close(self) -> None:
        """Unpin, unmap and (owner) unlink. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pinned and self._array is not None:
            _unpin(self._array)
            self._pinned = False
        self._array = None
        self._tensor = None
        try:
            self._mmap.close()
        except BufferError:
            # Someone still holds a view; the mapping goes when they drop it.
            logger.warning(
                "CpuBlockBuffer closed while views are alive; unmap deferred"
            )
        if self.owner and self.shm_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shm_path)

    def __enter__(self) -> CpuBlockBuffer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _map_shared_file(
    path: str, size: int, owner: bool | None
) -> tuple[mmap.mmap, bool]:
    flags = os.O_RDWR | os.O_CLOEXEC
    if owner is None:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            owner = True
        except FileExistsError:
            fd = os.open(path, flags)
            owner = False
    elif owner:
        fd = os.open(path, flags | os.O_CREAT, 0o600)
    else:
        fd = os.open(path, flags)
    try:
        # Growing is idempotent, so a worker racing the scheduler's ftruncate
        # is harmless; shrinking would SIGBUS other mappers, so never do it.
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        # Reserve the pages now: a sparse file on a full tmpfs (/dev/shm is
        # 64 MiB in a default container) would otherwise SIGBUS the process
        # on first touch, long after start-up.
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                pass  # the file system cannot reserve; keep the sparse file
            else:
                if owner:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                raise OSError(
                    exc.errno,
                    f"cannot reserve {size} bytes for the kvtier CPU tier "
                    f"({os.strerror(exc.errno or 0)}); enlarge {os.path.dirname(path)} "
                    "(e.g. docker run --shm-size) or lower cpu_bytes_to_use",
                    path,
                ) from exc
        return mmap.mmap(
            fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        ), owner
    finally:
        os.close(fd)


def _pin(array: np.ndarray) -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        rc = torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 0)
    except Exception as exc:  # pinning is an optimisation, never fatal
        logger.warning("cudaHostRegister failed (%r); CPU tier stays pageable", exc)
        return False
    if int(rc) != 0:
        logger.warning("cudaHostRegister returned %s; CPU tier stays pageable", rc)
        return False
    return True


def _unpin(array: np.ndarray) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(array.ctypes.data)
    except Exception as exc:
        logger.warning("cudaHostUnregister failed: %r", exc)
