"""A slab file: one preallocated file holding ``num_slots`` fixed-size slots.

Preallocating (rather than growing per write) means a spill never fails with
ENOSPC half-way and extents stay contiguous for sequential-ish NVMe access.
The file is owner-only (0o600): KV cache contents are derived from user
prompts and must not be readable by other local users.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

logger = logging.getLogger("kvtier.io")

SLAB_MODE = 0o600


class SlabFile:
    """Creates (or reopens) and sizes a slab file; performs no slot I/O itself.

    Contract: after construction ``path`` exists with mode 0o600 and is at
    least ``num_slots * slot_size`` bytes; ``offset(slot)`` is
    ``slot * slot_size``. An existing larger file is never shrunk (its tail
    is simply unused). Reading and writing go through a DiskBackend handle.
    """

    def __init__(self, path: str, num_slots: int, slot_size: int) -> None:
        if num_slots < 0 or slot_size <= 0:
            raise ValueError(f"bad slab geometry: {num_slots} x {slot_size}")
        self.path = path
        self.num_slots = num_slots
        self.slot_size = slot_size
        self.size = num_slots * slot_size
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, SLAB_MODE)
        try:
            st = os.fstat(fd)
            if stat.S_IMODE(st.st_mode) != SLAB_MODE:
                # Pre-existing file with looser permissions: tighten it.
                os.fchmod(fd, SLAB_MODE)
            if st.st_size < self.size:
                _preallocate(fd, self.size, path, st.st_size)
        finally:
            os.close(fd)

    def offset(self, slot: int) -> int:
        """Byte offset of ``slot`` within the file."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        return slot * self.slot_size


def _preallocate(fd: int, size: int, path: str, old_size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as exc:
        # tmpfs/overlay/NFS may not implement fallocate; a sparse file is
        # still correct, only allocation moves to the first write.
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            # Fix: ext4 keeps what a failed fallocate allocated (and grows the
            # file), leaving the file system 100% full after a refused start,
            # and os.posix_fallocate's OSError names no file. Give the space
            # back and say which slab and size could not be had.
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
    os.ftruncate(fd, size)
