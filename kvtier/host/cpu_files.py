"""Where the CPU tier's files live, and reclaiming those of dead engines.

Each rank's CPU tier is a file in this user's private shared-memory
directory (:func:`cpu_buffer_dir`, named by :func:`cpu_buffer_path` from the
engine id, rank and world size, so the scheduler process and the workers
derive the same name). A live owner holds an exclusive lock on its file
(:class:`~kvtier.host.cpu_buffer.CpuBlockBuffer`); the kernel drops it when
the process dies, which is how :func:`reclaim_stale_cpu_files` tells a dead
engine's leftover from a live engine's file. Nothing here follows a
symbolic link or touches another user's file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

from kvtier.log import get_logger
from kvtier.safe_open import flock_exclusive, open_private, open_private_dir

logger = get_logger("host")


def cpu_buffer_path(engine_id: str, rank: int, world_size: int) -> str:
    """Where rank ``rank``'s CPU tier lives, shared by scheduler and worker.

    Inside this user's private directory (``cpu_buffer_dir``: 0700, owner
    checked, created on first use), so other users can neither read the
    rows nor plant a file under the predictable name."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)
    return os.path.join(cpu_buffer_dir(), f"kvtier-{safe}-r{rank}of{world_size}.cpu")


def cpu_buffer_dir(base: str | None = None) -> str:
    """This user's private directory for CPU-tier files, created if needed.

    ``<base>/kvtier-<euid>`` (``base``: /dev/shm, or the temp directory where
    there is no /dev/shm), mode 0700, owned by the effective user and not a
    symbolic link, else PermissionError/OSError naming it: other users can
    neither read, plant nor replace files in it, and the names inside can
    stay predictable (the scheduler and the workers derive them from the
    same config)."""
    if base is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(base, f"kvtier-{os.geteuid()}")
    os.close(open_private_dir(path))
    return path


def same_name(path: str, fd: int) -> bool:
    """Whether ``path`` (not followed) still names the inode behind ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)


def rmdir_if_empty(directory: str) -> None:
    """Remove this user's private CPU-tier directory if no file is left."""
    if os.path.basename(directory) == f"kvtier-{os.geteuid()}":
        # The last engine leaves no trace in /dev/shm: rmdir fails while
        # other files remain, and a creator racing it re-creates the
        # directory (_create_owned).
        with contextlib.suppress(OSError):
            os.rmdir(directory)


# A temporary file is created and locked in two steps; a sweep leaves young
# ones alone so it never races an owner in between.
_TMP_GRACE_S = 60.0


def _younger_than(path: str, seconds: float) -> bool:
    try:
        return time.time() - os.stat(path, follow_symlinks=False).st_mtime < seconds
    except OSError:
        return True


def reclaim_stale_cpu_files(
    directory: str, *, dry_run: bool = False
) -> list[tuple[str, int]]:
    """Remove CPU-tier files in ``directory`` that no live engine holds.

    A live owner keeps an exclusive flock on its file; the kernel drops it
    when the process dies (SIGKILL and OOM kill included), so an unlocked
    ``*.cpu`` file (or half-built temporary) is a dead engine's leftover that
    still pins shared memory. Files of other users and symbolic links are
    skipped. Returns ``(path, bytes)`` of what was removed; with ``dry_run``
    (``kvtier doctor``) of what would be, and nothing is removed (the lock is
    taken and dropped again)."""
    removed: list[tuple[str, int]] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for entry in sorted(names):
        if not (entry.endswith(".cpu") or entry.endswith(".tmp")):
            continue
        path = os.path.join(directory, entry)
        if entry.endswith(".tmp") and _younger_than(path, _TMP_GRACE_S):
            continue  # an owner between creating and locking it: not stale
        try:
            fd = open_private(path, os.O_RDONLY, private=True)
        except OSError as exc:
            logger.warning("kvtier: leaving %s alone: %s", path, exc)
            continue
        try:
            if not flock_exclusive(fd) or not same_name(path, fd):
                continue
            size = os.fstat(fd).st_blocks * 512
            if dry_run:
                removed.append((path, size))
                continue
            os.unlink(path)
        except OSError as exc:
            logger.warning("kvtier: could not reclaim %s: %s", path, exc)
            continue
        finally:
            os.close(fd)
        logger.info(
            "kvtier: reclaimed stale CPU-tier file %s (%d bytes of shared memory) "
            "left by an engine that is no longer running",
            path,
            size,
        )
        removed.append((path, size))
    return removed
