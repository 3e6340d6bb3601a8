"""A slab file: one preallocated file holding ``num_slots`` fixed-size slots.

Preallocating (rather than growing per write) means a spill never fails with
ENOSPC half-way and extents stay contiguous for sequential-ish NVMe access.
The file is owner-only (0o600): KV cache contents are derived from user
prompts and must not be readable by other local users.
"""

from __future__ import annotations

import errno
import os

from kvtier.log import get_logger
from kvtier.safe_open import open_private
from kvtier.store.layout import slot_offset

logger = get_logger("store")

SLAB_MODE = 0o600


class SlabFile:
    """Creates (or reopens) and sizes a slab file; performs no slot I/O itself.

    Contract: after construction ``path`` exists with mode 0o600 and is at
    least ``num_slots * slot_size`` bytes; ``offset(slot)`` is the layout's
    :func:`~kvtier.store.layout.slot_offset` of local ``slot``. An existing larger file is never shrunk (its tail
    is simply unused). Reading and writing go through a DiskBackend handle.

    The file is opened with :func:`~kvtier.safe_open.open_private`: a
    symbolic link, a file of another owner or a group/other-writable file is
    refused (looser read bits are tightened). With ``dir_fd`` the name is
    resolved inside that (already checked) directory descriptor.
    ``dev_ino`` identifies the inode, so a later open by name can be checked
    against it (:meth:`matches`).
    """

    def __init__(
        self, path: str, num_slots: int, slot_size: int, *, dir_fd: int | None = None
    ) -> None:
        if num_slots < 0 or slot_size <= 0:
            raise ValueError(f"bad slab geometry: {num_slots} x {slot_size}")
        self.path = path
        self.num_slots = num_slots
        self.slot_size = slot_size
        self.size = num_slots * slot_size
        name = os.path.basename(path) if dir_fd is not None else path
        fd = open_private(
            name, os.O_RDWR | os.O_CREAT, SLAB_MODE, dir_fd=dir_fd, fix_mode=True
        )
        try:
            st = os.fstat(fd)
            self.dev_ino = (st.st_dev, st.st_ino)
            if st.st_size < self.size:
                _preallocate(fd, self.size, path, st.st_size)
        finally:
            os.close(fd)

    def matches(self, fd: int) -> bool:
        """Whether ``fd`` refers to this slab's inode."""
        st = os.fstat(fd)
        return (st.st_dev, st.st_ino) == self.dev_ino

    def offset(self, slot: int) -> int:
        """Byte offset of ``slot`` within the file."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        return slot_offset(slot, self.slot_size)


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
