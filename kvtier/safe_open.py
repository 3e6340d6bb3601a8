"""Opening kvtier's own files and directories without trusting their names.

kvtier keeps its disk tier under a configured ``disk_path`` (which may be a
shared, world-writable directory such as ``/tmp``) and its CPU tier under
``/dev/shm``. Anything another local user can create there must never be
followed, adopted or served. Every open of a slab, ``layout.json``, a store
directory or a CPU-tier file therefore goes through this module:

- the last path component is never followed when it is a symbolic link
  (``O_NOFOLLOW``), and descriptors are close-on-exec;
- the *opened descriptor* is checked with ``fstat`` (not the name, which
  could be swapped in between): the right file type, owned by the effective
  user, not writable by group or others;
- callers keep using the descriptor (or compare device and inode with it),
  so a name swapped after the check is never used.

Files kvtier only reads and does not own (another user's store that the
tools inspect, model weights, an operator's trace or config) are opened with
:func:`open_regular`: a regular file is all it asks for, and the open never
blocks.

Locks: an engine holds an exclusive ``flock`` on its store directory and on
its CPU-tier file for its lifetime. ``flock`` locks belong to the open file
description, so they vanish with the process (SIGKILL, OOM kill included):
a crash never leaves a stale lock, and a file whose lock can be taken has
no live owner. A child forked without exec (``os.fork``, multiprocessing's
fork start) would share those descriptions, and keep the locks after the
engine died; in such a child the lock descriptors are pointed at
``/dev/null`` (:func:`_drop_locks_in_child`).

No vLLM import (kvtier.store and kvtier.host stay plain).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat

__all__ = [
    "InUseError",
    "NotRegularFileError",
    "check_own_dir",
    "check_private_fd",
    "flock_exclusive",
    "is_locked",
    "lock_holders",
    "open_private",
    "open_private_dir",
    "open_regular",
    "same_file",
]

FILE_MODE = 0o600
DIR_MODE = 0o700


class InUseError(RuntimeError):
    """A file or directory is locked by another live kvtier engine."""

    def __init__(self, message: str, path: str):
        self.path = path
        super().__init__(message)


class NotRegularFileError(OSError):
    """:func:`open_regular` found something other than a regular file:
    ``errno`` EINVAL, ``filename`` the path, ``kind`` what it is
    (``"directory"``, ``"FIFO"``, ``"character device"``, ``"block
    device"``, ``"socket"`` or ``"special file"``)."""

    def __init__(self, path: str, kind: str):
        super().__init__(errno.EINVAL, f"not a regular file ({kind})", path)
        self.kind = kind


_FILE_KINDS = {
    stat.S_IFDIR: "directory",
    stat.S_IFIFO: "FIFO",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFSOCK: "socket",
}


def open_regular(
    path: str | os.PathLike[str],
    *,
    follow_links: bool = False,
    dir_fd: int | None = None,
) -> tuple[int, os.stat_result]:
    """A read-only, close-on-exec descriptor of the regular file ``path``,
    and its ``fstat``; the caller closes the descriptor.

    The open never blocks: it is made ``O_NONBLOCK`` (a FIFO would otherwise
    wait for a writer forever), which is cleared again on the descriptor
    returned, so reads block as usual. The opened descriptor must be a
    regular file (a device would be read endlessly, a directory not at all):
    anything else raises :class:`NotRegularFileError`. Without
    ``follow_links`` a symbolic link as the last component is refused
    (``O_NOFOLLOW``: OSError with errno ELOOP); with it, links are followed
    (a file the operator names, model files the hub cache links to). Any
    other failure of the open is its OSError, naming ``path``. ``dir_fd``:
    ``path`` is relative to that directory descriptor (a directory
    checked once, never looked up by name again). Type only:
    owner and mode are not checked (see :func:`open_private` for kvtier's
    own files)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
    if not follow_links:
        flags |= os.O_NOFOLLOW
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _FILE_KINDS.get(stat.S_IFMT(st.st_mode), "special file")
            raise NotRegularFileError(os.fsdecode(path), kind)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _refuse(code: int, why: str, path: str) -> OSError:
    cls = PermissionError if code in (errno.EPERM, errno.EACCES) else OSError
    return cls(code, f"kvtier refuses {path!r}: {why}", path)


def check_owned(st: os.stat_result, path: str, directory: bool) -> None:
    """Type, owner == euid, and no group/other write bit: what every object
    kvtier trusts must pass (``st`` from ``lstat`` or ``fstat``). Raises
    PermissionError/OSError naming ``path`` and the fix."""
    if directory and not stat.S_ISDIR(st.st_mode):
        raise _refuse(errno.ENOTDIR, "not a directory", path)
    if not directory and not stat.S_ISREG(st.st_mode):
        raise _refuse(errno.EINVAL, "not a regular file", path)
    euid = os.geteuid()
    if st.st_uid != euid:
        raise _refuse(
            errno.EPERM,
            f"owned by uid {st.st_uid}, not by this user (uid {euid}); another "
            "user may have placed it there. Remove it (after checking) or use a "
            "location only this user can write",
            path,
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise _refuse(
            errno.EPERM,
            f"mode {mode:04o} lets group or others write to it, so its contents "
            "cannot be trusted. Remove it (or chmod go-w after checking it)",
            path,
        )


def check_private_fd(
    fd: int, path: str, *, directory: bool = False, fix_mode: bool = False
) -> os.stat_result:
    """Check an open descriptor: type, owner == euid, no group/other bits.

    Group/other *write* bits are always refused. With ``fix_mode`` (for
    directories: their mode is checked at every lookup through them, so one
    made private is private from then on, even for a descriptor opened
    before) the mode is then set to exactly 0600 (files) or 0700
    (directories): the object is ours, only its mode was loose or too
    tight. Without it, group/other read or search bits are refused too. Raises
    PermissionError/OSError naming ``path``; returns the (possibly
    refreshed) ``fstat``."""
    st = os.fstat(fd)
    check_owned(st, path, directory)
    mode = stat.S_IMODE(st.st_mode)
    expected = DIR_MODE if directory else FILE_MODE
    if fix_mode:
        if mode != expected:
            os.fchmod(fd, expected)
            st = os.fstat(fd)
    elif mode & 0o077:
        raise _refuse(
            errno.EPERM,
            f"mode {mode:04o} is not private (expected {expected:04o})",
            path,
        )
    return st


def open_private(
    path: str,
    flags: int,
    mode: int = FILE_MODE,
    *,
    dir_fd: int | None = None,
    private: bool = False,
) -> int:
    """``os.open`` for kvtier's own regular files; returns the descriptor.

    Adds ``O_NOFOLLOW | O_CLOEXEC`` (a symbolic link in place of the file is
    refused with ELOOP) and opens ``O_NONBLOCK`` (cleared again unless asked
    for), so a FIFO in place of the file is refused instead of blocking the
    open forever; then checks the opened descriptor: a regular file,
    owned by the effective user, not writable by group or others. With
    ``private`` any group/other bit is refused too (a mode is checked only
    at open: a descriptor another user opened while the file was readable
    keeps reading it, so a loose file is not made private in place).
    ``path`` is relative to ``dir_fd`` when
    given. Raises PermissionError (foreign owner, loose mode) or OSError
    (symlink, not a regular file, the open's own errno), always naming the
    path; the descriptor is closed on failure.

    A read-only opener of slab files (workers) calls
    ``open_private(slab_path, os.O_RDONLY)``."""
    shown = _display(path, dir_fd)
    extra = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | extra, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            # O_WRONLY | O_NONBLOCK on a FIFO without a reader.
            raise _refuse(
                errno.EINVAL, "not a regular file (a FIFO or socket)", shown
            ) from exc
        if exc.errno == errno.ELOOP:
            raise _refuse(
                errno.ELOOP,
                "it is a symbolic link; kvtier never follows links to its own "
                "files (another user may have planted it). Remove it",
                shown,
            ) from exc
        if exc.errno == errno.EISDIR:  # opened for writing
            raise _refuse(
                errno.EISDIR,
                "it is a directory where kvtier keeps a file. Remove it",
                shown,
            ) from exc
        if exc.filename != shown:
            raise type(exc)(exc.errno, exc.strerror, shown) from exc
        raise
    try:
        if private:
            check_private_fd(fd, shown)
        else:
            # Readable by others is the caller's confidentiality matter (the
            # store keeps its files 0600); type, owner and write bits are
            # what make the contents trustworthy.
            check_owned(os.fstat(fd), shown, False)
        if not flags & os.O_NONBLOCK:
            fcntl.fcntl(
                fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _display(path: str, dir_fd: int | None) -> str:
    """``path`` as a full path for messages (resolving ``dir_fd`` on Linux)."""
    if dir_fd is None or os.path.isabs(path):
        return path
    try:
        return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    except OSError:
        return path


def check_own_dir(path: str, what: str = "kvtier's own directory") -> None:
    """Check, without creating or opening it, that ``path`` (``what``, for
    the message) is still a kvtier-owned directory: not a symbolic link
    (``lstat``), this user's, not writable by group or others. For a name a
    process uses after another made and checked the directory (a worker
    opening the slabs the scheduler side created). Raises
    OSError/PermissionError naming it."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(
            errno.ELOOP,
            f"it is a symbolic link where {what} belongs (another user may "
            "have planted it). Remove it",
            path,
        )
    check_owned(st, path, directory=True)


def open_private_dir(path: str) -> int:
    """Create (mode 0700) or open a kvtier-owned directory; returns its fd.

    The directory itself must not be a symbolic link, must be owned by the
    effective user and must not be writable by group or others (then it is
    refused: someone else may have put files in it); group/other read or
    search bits are removed. A plain file in its place is a clear error.
    Parent directories are the operator's choice and are followed."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, DIR_MODE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            # Linux answers ENOTDIR for O_DIRECTORY|O_NOFOLLOW on a link.
            raise _refuse(
                errno.ELOOP,
                "it is a symbolic link where kvtier's own directory belongs "
                "(another user may have planted it). Remove it",
                path,
            ) from exc
        if exc.errno == errno.ENOTDIR:
            raise _refuse(
                errno.ENOTDIR,
                "a file that is not a directory is in the place of kvtier's "
                "directory. Remove or rename it",
                path,
            ) from exc
        raise
    try:
        check_private_fd(fd, path, directory=True, fix_mode=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


# Descriptors this process took an exclusive lock on, with the inode each
# named then: a later close (and reuse of the number) needs no bookkeeping,
# since a forked child only touches a number that still names that inode.
_locked: dict[int, tuple[int, int]] = {}


def flock_exclusive(fd: int) -> bool:
    """Take an exclusive ``flock`` on ``fd`` without waiting; False if held.

    The lock lives as long as the open file description (it dies with the
    process, so a crash never leaves it behind; a child forked without exec
    gets no share of it, see :func:`_drop_locks_in_child`)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    st = os.fstat(fd)
    _locked[fd] = (st.st_dev, st.st_ino)
    return True


def _drop_locks_in_child() -> None:
    """In a child forked without exec: point each descriptor of a file this
    process holds a lock on at ``/dev/null``. The child would otherwise share
    the lock's open file description and keep the lock after the engine died
    (its store "in use by another running engine" at the restart, its
    CPU-tier file taken for a live owner's) for as long as the child runs.
    Every descriptor of such a file counts: ``mmap`` keeps a duplicate of the
    one it maps. The parent's locks are untouched (its own descriptors stay
    open); the numbers stay valid in the child, so nothing there closes an
    unrelated file."""
    held = list(_locked.items())
    _locked.clear()
    fds: set[int] = set()
    inodes: set[tuple[int, int]] = set()
    for fd, inode in held:
        with contextlib.suppress(OSError):
            st = os.fstat(fd)
            # Still open on that inode (so the inode is not a reused number).
            if (st.st_dev, st.st_ino) == inode:
                fds.add(fd)
                inodes.add(inode)
    if not fds:
        return
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                st = os.fstat(int(name))
                if (st.st_dev, st.st_ino) in inodes:
                    fds.add(int(name))
    try:
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    for fd in fds:
        with contextlib.suppress(OSError):
            os.dup2(null, fd, inheritable=False)
    os.close(null)


os.register_at_fork(after_in_child=_drop_locks_in_child)


def is_locked(fd: int) -> bool:
    """Whether another open file description holds an exclusive lock on the
    file behind ``fd`` (i.e. a live owner). Probes with a shared lock that is
    dropped again at once."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def same_file(fd_a: int, fd_b: int) -> bool:
    """Whether two descriptors refer to the same inode."""
    a, b = os.fstat(fd_a), os.fstat(fd_b)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def lock_holders(fd: int) -> str:
    """Who holds a ``flock`` on the file behind ``fd``, for a refusal's
    message: ``" (held by pid N, <its name>)"`` from /proc/locks, or ""
    where that cannot be told (no /proc, another pid namespace)."""
    try:
        st = os.fstat(fd)
        want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    pids = []
    for line in lines:
        fields = line.split()
        # "N: FLOCK ADVISORY WRITE <pid> <maj:min:ino> 0 EOF"; waiters: "N: -> ..."
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == want:
            pids.append(fields[4])
    held = []
    for pid in dict.fromkeys(pids):
        name = _process_name(pid)
        held.append(f"pid {pid}, {name!r}" if name else f"pid {pid}")
    return f" (held by {'; '.join(held)})" if held else ""


def _process_name(pid: str) -> str:
    """Process ``pid``'s command line (its title, for a process that sets
    one: vLLM's ``VLLM::EngineCore``), at most 120 characters; else its
    ``comm`` (cut to 15 by the kernel); "" if neither can be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            line = f.read(4096).replace(b"\0", b" ").decode("utf-8", "replace")
        line = line.strip()
        if line:
            return line if len(line) <= 120 else line[:119] + "…"
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""
