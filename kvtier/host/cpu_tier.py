"""The CPU tier's shared memory: one file per TP rank, from its creation to
its reclaim.

Each rank's CPU tier is one contiguous, page-aligned mapping of
``num_blocks`` rows (:class:`CpuBlockBuffer`): one mapping rather than many
tensors because the disk path needs page-aligned rows for O_DIRECT, one
registration page-locks it all for device copies, and, backed by a file in
this user's private shared-memory directory (``/dev/shm/kvtier-<euid>``,
named by :func:`cpu_buffer_path` from the engine id, rank and world size), the
scheduler process and the worker see the same bytes. When another user holds
that directory's name, this user's files go to a fallback directory of its
own beside it (:func:`worker_cpu_dir`), where the scheduler side finds them
(:func:`locate_cpu_file`).

Its life: the worker owns the file (:func:`open_worker_buffer`: created
exclusively, fully reserved, locked with ``flock`` for its lifetime); the
name lives only until every process that needs it has it mapped. The worker
removes it at once when no disk tier is configured (nobody else maps it),
else the scheduler side removes it right after mapping it
(:class:`AttachedRows`; vLLM builds the workers' KV caches before the
scheduler). From then on the kernel frees the memory when the last mapping
goes, however the processes end (SIGKILL and OOM kill included). A crash
inside that window leaves a file whose lock died with its owner:
:func:`reclaim_stale_cpu_files` removes it at the next start. Nothing here
follows a symbolic link or touches another user's file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import secrets
import stat
import tempfile
import time
import weakref
from types import TracebackType

import numpy as np
import torch

from kvtier.log import get_logger
from kvtier.safe_open import (
    InUseError,
    check_owned,
    flock_exclusive,
    is_locked,
    open_private,
    open_private_dir,
)

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
        (its lock is held), else FileNotFoundError; with ``keep_fd`` its
        descriptor stays open as ``fd`` (close-on-exec, closed by
        ``close``), for a helper process to map the same rows. ``owner=None``:
        the latter if possible, else the former.
      - :meth:`unlink_name` removes the file's name once every process that
        needs the rows has them mapped (the module doc has the file's life).
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
        keep_fd: bool = False,
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
        # An attached (not owned) file's descriptor, kept with ``keep_fd``
        # for a helper process to map the rows from.
        self.fd = -1
        if shm_path is None:
            self.owner = True
            self._mmap = mmap.mmap(-1, self._map_size)
        else:
            self._mmap, self.owner, fd, self._inode = _map_shared_file(
                shm_path, self._map_size, owner, keep_fd
            )
            if not self.owner:
                self.fd = fd
            else:
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
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

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
    return -(-num_blocks * block_bytes // mmap.PAGESIZE) * mmap.PAGESIZE


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


def _reclaim(
    path: str, *, dry_run: bool = False, dir_fd: int | None = None
) -> int | None:
    """Remove the CPU-tier file at ``path`` if no live engine holds it.

    A live owner keeps an exclusive flock on its file and the kernel drops
    it when the process dies, so a file whose lock can be taken is a dead
    engine's leftover. Returns the bytes of shared memory it pinned, or None
    when nothing was there to remove (the name went or changed meanwhile);
    with ``dry_run`` nothing is removed (the lock is taken and dropped
    again). Raises InUseError when a live process holds its lock,
    PermissionError/OSError when it is not ours (another user's file, a
    symbolic link): never adopted. With ``dir_fd`` the base name of
    ``path`` is taken inside that (checked) directory."""
    name = path if dir_fd is None else os.path.basename(path)
    try:
        fd = open_private(name, os.O_RDONLY, private=True, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        if not flock_exclusive(fd):
            raise InUseError(
                f"kvtier CPU-tier file {path!r} is in use by another live process",
                path,
            )
        if not same_name(name, fd, dir_fd=dir_fd):
            return None
        size = os.fstat(fd).st_blocks * 512
        if not dry_run:
            os.unlink(name, dir_fd=dir_fd)
            logger.info(
                "kvtier: reclaimed stale CPU-tier file %s (%d bytes of shared "
                "memory) left by an engine that is no longer running",
                path,
                size,
            )
        return size
    finally:
        os.close(fd)


# Tries at creating a CPU-tier file whose name keeps being taken, and the
# pause after finding its lock held (by a sweep, if not by a live owner).
CREATE_ATTEMPTS = 5
SWEEP_WAIT_S = 0.01


def _create_owned(path: str, size: int) -> int:
    """Create ``path`` exclusively, locked and fully sized; returns its fd.

    The file is built under a random temporary name (O_EXCL, O_NOFOLLOW,
    0600), locked (flock, held for the owner's lifetime and released by the
    kernel when the process dies), sized and reserved, and only then linked
    to ``path`` (link fails if the name exists). So the name never shows a
    half-built or unlocked file. An existing file is a dead engine's
    leftover if its lock can be taken (then it is removed and the creation
    retried) and otherwise a live engine's: InUseError, once its lock stayed
    held over :data:`CREATE_ATTEMPTS` tries (a sweep of dead engines' files,
    another rank's start, holds one for an instant).

    Everything is done inside the directory checked at the start (through
    its descriptor, never its name again): when the last other engine
    removes the (empty) directory meanwhile and another user creates one of
    that name, nothing is made in theirs (creating in a removed directory
    fails, and the name is checked again)."""
    directory, name = os.path.split(path)
    dir_fd = _open_dir(directory)
    try:
        for _attempt in range(CREATE_ATTEMPTS):
            tmp = f".{name}.{secrets.token_hex(8)}.tmp"
            try:
                fd = open_private(
                    tmp,
                    os.O_RDWR | os.O_CREAT | os.O_EXCL,
                    0o600,
                    dir_fd=dir_fd,
                    private=True,
                )
            except FileNotFoundError:
                # The last other engine removed the (empty) directory
                # meanwhile: create and check it again.
                os.close(dir_fd)
                dir_fd = -1
                dir_fd = _open_dir(directory)
                continue
            try:
                if not flock_exclusive(fd):  # a brand-new inode: cannot happen
                    raise InUseError(f"cannot lock {tmp!r}", tmp)
                _reserve(fd, size, path)
                try:
                    os.link(
                        tmp,
                        name,
                        src_dir_fd=dir_fd,
                        dst_dir_fd=dir_fd,
                        follow_symlinks=False,
                    )
                except FileExistsError:
                    os.unlink(tmp, dir_fd=dir_fd)
                    os.close(fd)
                    fd = -1
                    try:
                        _reclaim(path, dir_fd=dir_fd)
                    except InUseError:
                        # A live owner holds its lock for good; a sweep of
                        # dead engines' files (another rank starting,
                        # reclaim_stale_cpu_files) holds it for an instant.
                        if _attempt == CREATE_ATTEMPTS - 1:
                            raise
                        time.sleep(SWEEP_WAIT_S)
                    continue
                os.unlink(tmp, dir_fd=dir_fd)
                return fd
            except BaseException:
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=dir_fd)
                    os.close(fd)
                raise
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)
    raise InUseError(
        f"kvtier CPU-tier file {path!r} keeps being re-created by another process",
        path,
    )


def _open_dir(directory: str) -> int:
    """A descriptor of the directory CPU-tier files are made in. This
    user's private directory (``kvtier-<euid>``, or a fallback
    ``kvtier-<euid>-<random>``) is created if needed and checked (ours,
    0700, no link); any other (tests, tools) is the caller's choice and
    only opened."""
    if is_cpu_tier_dir(directory):
        return open_private_dir(directory)
    return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


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
    path: str, size: int, owner: bool | None, keep_fd: bool = False
) -> tuple[mmap.mmap, bool, int, tuple[int, int]]:
    """Map ``path``; returns (mapping, owner, fd, (st_dev, st_ino)). The
    owner's fd is open (it holds the lock) and must be closed by the caller,
    as must another's with ``keep_fd``; otherwise it is -1."""
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
    if owner:
        # The mapping holds the locked open file description too: a child
        # forked without exec would inherit it and keep the owner's lock
        # after the owner died (its file taken for a live engine's, never
        # reclaimed). Not inherited, it dies with the owner (the lock's
        # descriptors: kvtier.safe_open).
        with contextlib.suppress(AttributeError, OSError):
            mapping.madvise(mmap.MADV_DONTFORK)
    elif not keep_fd:
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


def cpu_buffer_path(
    engine_id: str, rank: int, world_size: int, directory: str | None = None
) -> str:
    """Where rank ``rank``'s CPU tier lives, shared by scheduler and worker.

    Inside ``directory``, by default this user's private directory
    ``<base>/kvtier-<euid>`` (``base``: /dev/shm, or the temp directory
    where there is no /dev/shm), so other users can neither read the rows
    nor plant a file under the predictable name; a worker gets its
    directory from :func:`worker_cpu_dir`, and the scheduler side finds the
    file with :func:`locate_cpu_file`. Only a name: the directory is
    created (0700, owned by the effective user, not a symbolic link, else
    PermissionError/OSError) when the worker creates the file, and goes
    with the last file, so an engine that never creates one leaves nothing
    behind.

    One name per engine id (:func:`_engine_part`), so an engine is refused
    only where another running engine has its very id."""
    name = f"kvtier-{_engine_part(engine_id)}-r{rank}of{world_size}.cpu"
    return os.path.join(directory or cpu_tier_dir(), name)


# Engine ids longer than this, or with characters other than letters,
# digits, "-" and "_", are named by a digest (_engine_part).
_MAX_ID_CHARS = 64


def _engine_part(engine_id: str) -> str:
    """``engine_id`` in a file name, one name per id: the id itself where
    it is made of letters, digits, "-" and "_" and fits; else those
    characters of it (others as "_", cut to 64), "." and a 16-hex-digit
    digest of the whole id. A "." never appears in a kept id, so a digest
    name never equals one: "llama.v1" and "llama_v1" get two files, where
    one name would refuse the second engine as if it had the first's id."""
    safe = "".join(
        c if c.isascii() and (c.isalnum() or c in "-_") else "_" for c in engine_id
    )
    if safe == engine_id and len(engine_id) <= _MAX_ID_CHARS:
        return engine_id
    digest = hashlib.blake2b(engine_id.encode(), digest_size=8).hexdigest()
    return f"{safe[:_MAX_ID_CHARS]}.{digest}"


def cpu_tier_dir(base: str | None = None) -> str:
    """This user's private CPU-tier directory, ``<base>/kvtier-<euid>``;
    ``base`` defaults to /dev/shm, or the temp directory where there is no
    /dev/shm. Only a name: nothing is created."""
    if base is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, _dir_name())


def _dir_name(fallback: bool = False) -> str:
    """This user's CPU-tier directory name (``kvtier-<euid>``), or the
    prefix of its fallbacks' (``kvtier-<euid>-``)."""
    return f"kvtier-{os.geteuid()}" + ("-" if fallback else "")


# When another user holds the predictable name (any local user can create
# ``/dev/shm/kvtier-<euid>`` first, and only root can remove it from the
# sticky /dev/shm), this user's files go to a directory of its own named
# ``kvtier-<euid>-<random>`` beside it. The random part is not the defence:
# the owner is. Another user can create an entry of any name there, but not
# one owned by this user, and a directory is only used, searched or swept
# as this user's when it is a real directory owned by this user.


def is_cpu_tier_dir(directory: str) -> bool:
    """Whether ``directory`` is named as one of this user's CPU-tier
    directories (the predictable one or a fallback); a name only."""
    name = os.path.basename(directory)
    return name == _dir_name() or name.startswith(_dir_name(fallback=True))


def held_by_another(directory: str) -> int | None:
    """The uid of the other user whose entry holds ``directory``'s name
    (not followed), else None (absent, or this user's)."""
    try:
        uid = os.lstat(directory).st_uid
    except OSError:
        return None
    return None if uid == os.geteuid() else uid


def _own_fallbacks(base: str) -> list[str]:
    """This user's fallback CPU-tier directories in ``base``, by name: real
    directories owned by this user (an entry another user made under such
    a name is ignored). One listing of ``base``: start-up and tools only."""
    prefix = _dir_name(fallback=True)
    try:
        names = sorted(n for n in os.listdir(base) if n.startswith(prefix))
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue  # gone meanwhile
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            found.append(path)
    return found


def cpu_tier_dirs(base: str | None = None) -> list[str]:
    """Every directory that may hold this user's CPU-tier files under
    ``base`` (as :func:`cpu_tier_dir`): the predictable one unless another
    user holds its name, then this user's fallbacks (see
    :func:`worker_cpu_dir`). Existing or not, checked or not: a caller
    opens each with its own checks."""
    primary = cpu_tier_dir(base)
    own = [] if held_by_another(primary) is not None else [primary]
    return own + _own_fallbacks(os.path.dirname(primary))


def worker_cpu_dir(base: str | None = None) -> str:
    """The directory a worker makes its CPU-tier file in: this user's
    predictable one (:func:`cpu_tier_dir`), unless another user holds that
    name; then a fallback of this user's own, ``kvtier-<euid>-<random>``
    beside it (the first one there, else one made now: exclusively, mode
    0700; kept, for the engines after this one), with a WARNING naming the
    other user. The scheduler side finds
    the file there (:func:`locate_cpu_file`). OSError where no fallback can
    be made (the base is full or not writable)."""
    primary = cpu_tier_dir(base)
    holder = held_by_another(primary)
    if holder is None:
        return primary
    parent = os.path.dirname(primary)
    found = _own_fallbacks(parent)
    directory = (
        found[0]
        if found
        else tempfile.mkdtemp(prefix=_dir_name(fallback=True), dir=parent)
    )
    logger.warning(
        "kvtier: %s is held by uid %d, not by this user (uid %d); this "
        "engine's CPU tier is in %s instead. Another local user made it, "
        "perhaps to keep kvtier from starting: only root can remove it from "
        "%s (then restart the engine), or run the engine with a /dev/shm of "
        "its own (a container)",
        primary,
        holder,
        os.geteuid(),
        directory,
        parent,
    )
    return directory


def locate_cpu_file(path: str) -> str:
    """Where the CPU-tier file named like ``path`` is now. A path in this
    user's predictable directory (:func:`cpu_buffer_path`'s default) is
    looked for in each of :func:`cpu_tier_dirs` (a worker whose predictable
    directory another user holds made it in a fallback); the first that
    has an entry of that name is returned, else ``path``. Any other path
    (a test's, a tool's) is returned as given. Only a name: the open
    checks what it finds (owner, mode, live lock)."""
    directory, name = os.path.split(path)
    if os.path.basename(directory) != _dir_name():
        return path
    # Where the predictable directory is this user's, the file is there
    # (a worker uses a fallback only when another user holds the name):
    # found without listing /dev/shm, which this may be asked at each spill
    # until the worker's file exists.
    if held_by_another(directory) is None and os.path.lexists(path):
        return path
    for candidate_dir in _own_fallbacks(os.path.dirname(directory)):
        candidate = os.path.join(candidate_dir, name)
        if os.path.lexists(candidate):
            return candidate
    return path


def same_name(path: str, fd: int, *, dir_fd: int | None = None) -> bool:
    """Whether ``path`` (not followed; relative to ``dir_fd`` when given)
    still names the inode behind ``fd``."""
    try:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    here = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)


def rmdir_if_empty(directory: str) -> None:
    """Remove this user's predictable CPU-tier directory if no file is left.
    A fallback stays (empty, this user's): removed, its name could be taken
    by another user before a worker that chose it makes its file there."""
    if os.path.basename(directory) == _dir_name():
        # The last engine leaves no trace in /dev/shm: rmdir fails while
        # other files remain, and a creator racing it re-creates the
        # directory (_create_owned).
        with contextlib.suppress(OSError):
            os.rmdir(directory)


# A temporary file is created and locked in two steps; a sweep leaves young
# ones alone so it never races an owner in between.
_TMP_GRACE_S = 60.0


def _younger_than(path: str, seconds: float, dir_fd: int | None = None) -> bool:
    try:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        return time.time() - st.st_mtime < seconds
    except OSError:
        return True


def reclaim_stale_cpu_files(
    directory: str, *, dry_run: bool = False
) -> list[tuple[str, int]]:
    """Remove CPU-tier files in ``directory`` that no live engine holds
    (:func:`_reclaim`): ``*.cpu`` files and half-built temporaries, a dead
    engine's leftovers that still pin shared memory. Files of other users
    and symbolic links are skipped; so is all of ``directory`` when it is a
    link or not this user's alone (nothing is removed through it). Returns
    ``(path, bytes)`` of what was removed; with ``dry_run`` (``kvtier
    doctor``) of what would be, and nothing is removed."""
    removed: list[tuple[str, int]] = []
    # The directory is listed and its files removed through one checked
    # descriptor: a link planted in its place (``/dev/shm`` is writable by
    # everyone) would otherwise make this remove this user's unlocked
    # ``*.cpu``/``*.tmp`` files wherever it points.
    try:
        dir_fd = os.open(
            directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        )
    except FileNotFoundError:
        return removed
    except OSError as exc:
        logger.warning("kvtier: not sweeping %s: %s", directory, exc)
        return removed
    try:
        try:
            check_owned(os.fstat(dir_fd), directory, directory=True)
        except OSError as exc:
            logger.warning("kvtier: not sweeping %s: %s", directory, exc.strerror)
            return removed
        for entry in sorted(os.listdir(dir_fd)):
            if not (entry.endswith(".cpu") or entry.endswith(".tmp")):
                continue
            path = os.path.join(directory, entry)
            if entry.endswith(".tmp") and _younger_than(entry, _TMP_GRACE_S, dir_fd):
                continue  # an owner between creating and locking it: not stale
            try:
                size = _reclaim(path, dry_run=dry_run, dir_fd=dir_fd)
            except InUseError:
                continue
            except OSError as exc:
                logger.warning("kvtier: leaving %s alone: %s", path, exc)
                continue
            if size is not None:
                removed.append((path, size))
    finally:
        os.close(dir_fd)
    return removed


def open_worker_buffer(
    engine_id: str,
    rank: int,
    world_size: int,
    num_blocks: int,
    block_bytes: int,
    *,
    shared: bool = True,
    directory: str | None = None,
) -> CpuBlockBuffer:
    """Create and own rank ``rank``'s CPU-tier file for the worker.

    ``shared=False`` (no other process maps it: no disk tier) removes the
    name at once, so the memory has no name from start-up on (and no other
    engine can reach its rows). A live engine holding a file of the same
    name (before its scheduler side mapped it) means two engines run with
    one ``engine_id`` on this host; they would share rows (wrong outputs), so
    that is refused with the fix. ``directory``: where the file is made
    (:func:`worker_cpu_dir`; by default this user's predictable one)."""
    path = cpu_buffer_path(engine_id, rank, world_size, directory)
    try:
        buffer = CpuBlockBuffer(num_blocks, block_bytes, path, owner=True)
    except InUseError as exc:
        raise InUseError(
            f"kvtier: another running engine on this host uses engine_id "
            f"{engine_id!r} (its CPU tier {path!r} is locked by a live process). "
            "Two engines with one engine_id would share CPU-tier rows; give each "
            "engine a unique engine_id (kv_transfer_config 'engine_id', or leave "
            "it unset so vLLM generates one), or stop the other engine",
            path,
        ) from exc
    if not shared:
        buffer.unlink_name()
    return buffer


class AttachedRows:
    """A rank's CPU-tier rows as the scheduler side maps them, once: at
    start-up when the worker created the file (:meth:`attach_at_start`),
    else at first use (``array``), which can only follow a completed store.
    Mapping removes the name (every process that needs it has it open now:
    the descriptor kept, :attr:`fd`, is what a spill process maps).
    ``array`` raises OSError (FileNotFoundError: no live worker's file yet)
    where it cannot map; the transfers turn that into misses. ``path`` is
    the file's default name (:func:`cpu_buffer_path`), looked for where the
    worker put it (:func:`locate_cpu_file`)."""

    def __init__(self, path: str, num_blocks: int, block_bytes: int) -> None:
        self.path, self.num_blocks, self.block_bytes = path, num_blocks, block_bytes
        self.buffer: CpuBlockBuffer | None = None

    @property
    def array(self) -> np.ndarray:
        if self.buffer is None:
            buffer = CpuBlockBuffer(
                self.num_blocks,
                self.block_bytes,
                locate_cpu_file(self.path),
                owner=False,
                keep_fd=True,
            )
            buffer.unlink_name()
            self.buffer = buffer
        return self.buffer.array

    @property
    def fd(self) -> int | None:
        """The mapped file's descriptor (close-on-exec), while mapped."""
        return None if self.buffer is None else self.buffer.fd

    def attach_at_start(self, rank: int) -> None:
        """Map now if the worker already created the file, else say so."""
        try:
            self.array  # noqa: B018
        except OSError as exc:
            logger.info(
                "kvtier: CPU tier of rank %d not mapped at start-up (%s); "
                "mapping it at the first spill",
                rank,
                exc,
            )

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
