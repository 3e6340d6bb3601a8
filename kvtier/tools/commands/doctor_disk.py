"""``kvtier doctor``: one disk path of the disk tier.

Each check reuses the code the engine runs: the owner/mode rules of
:mod:`kvtier.safe_open`, the space rule of
:func:`kvtier.connector.preflight.check_disk_space`, the O_DIRECT probe of
:mod:`kvtier.store.backends.posix`, and for the throughput probe the POSIX back
end itself (its thread pool, O_DIRECT where accepted, ``disk_io_threads``
threads), on a private probe file that is removed again.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import shutil
import stat
import time
from concurrent.futures import Future

from kvtier.connector.config import ConfigError, KvtierConfig
from kvtier.connector.preflight import check_disk_space, not_writable
from kvtier.tools.commands.common import fmt_bytes
from kvtier.tools.commands.doctor import ERROR, OK, WARNING, Check

# Network and shared file systems: the store's lock is host-local.
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "ceph", "glusterfs", "lustre", "gpfs")
# Throughput probe: piece size, and at most this much written per path.
PROBE_PIECE = 1 << 20
PROBE_MAX_BYTES = 1 << 30


def mount_of(path: str) -> tuple[str, str, str]:
    """(mount point, file system type, source) holding ``path``, from
    /proc/self/mountinfo (the longest mount point prefix); ("?", "?", "?")
    where it cannot be read."""
    real = os.path.realpath(path)
    best = ("?", "?", "?")
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best[0] == "?" or len(point) >= len(best[0])):
            best = (point, tail[0], tail[1])
    return best


def _mode_check(path: str) -> Check:
    """safe_open's rules for a directory kvtier creates files in."""
    from kvtier.safe_open import check_private_fd

    subject = f"{path}: owner and mode"
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        try:
            check_private_fd(fd, path, directory=True)
        except PermissionError:
            # Allowed for a disk path (kvtier's own store directory inside is
            # private), but see docs/operations.md#security.
            if st.st_uid != os.geteuid():
                detail = (
                    f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
                )
            elif mode & 0o022:
                detail = f"mode {mode:04o}: group or others can write here"
            else:
                detail = (
                    f"mode {mode:04o}: readable by others (the store inside is 0700)"
                )
            if mode & 0o002 and not mode & stat.S_ISVTX:
                detail += (
                    "; world-writable without the sticky bit: another user can "
                    "rename or remove kvtier's store directory"
                )
            elif st.st_uid != os.geteuid() or mode & 0o022:
                detail += (
                    "; anyone who creates kvtier's store directory here first "
                    "keeps the engine from starting"
                )
            return Check(
                "disk",
                subject,
                WARNING,
                detail,
                f"install -d -m 0700 -o <service user> {path} (a directory only "
                "the engine's user can write)",
            )
    finally:
        os.close(fd)
    return Check("disk", subject, OK, f"owned by uid {st.st_uid}, mode {mode:04o}")


def _space_check(cfg: KvtierConfig, path: str, reusable: list[str]) -> Check:
    share = cfg.disk_bytes_per_path
    subject = f"{path}: free space"
    try:
        check_disk_space(cfg, path, reusable=reusable)
    except ConfigError as exc:
        return Check(
            "disk", subject, ERROR, str(exc), "lower disk_bytes_to_use or free space"
        )
    usage = shutil.disk_usage(path)
    detail = (
        f"{fmt_bytes(usage.free)} free of {fmt_bytes(usage.total)}; this path "
        f"holds {fmt_bytes(share)} of disk_bytes_to_use"
    )
    if reusable:
        detail += f" (plus the adopted store's own slabs: {', '.join(reusable)})"
    left = usage.free - share
    if left < usage.total // 20:
        return Check(
            "disk",
            subject,
            WARNING,
            detail
            + f"; once full, {fmt_bytes(max(left, 0))} is left on the file system",
            "leave some room for other writers (logs, checkpoints)",
        )
    return Check("disk", subject, OK, detail)


_LOCAL_FS_FIX = "use a local NVMe file system (ext4, xfs)"


def _fs_problem(fstype: str) -> tuple[str, str] | None:
    """(what is wrong, fix) for a file system unfit for the disk tier."""
    if fstype in NETWORK_FS or fstype.startswith("fuse"):
        return (
            "a network or FUSE file system; the store's lock is host-local and "
            "latency is far above NVMe",
            _LOCAL_FS_FIX,
        )
    if fstype in ("tmpfs", "ramfs"):
        return (
            "RAM-backed, so the disk tier takes memory the CPU tier could use "
            "and is lost on reboot",
            _LOCAL_FS_FIX,
        )
    if fstype == "overlay":
        return (
            "a container's writable layer (slow, often no O_DIRECT)",
            "mount an NVMe volume into the container and point disk_path there",
        )
    return None


def _fs_checks(path: str) -> list[Check]:
    from kvtier.store.backends.posix import probe_direct

    point, fstype, source = mount_of(path)
    subject = f"{path}: file system"
    where = f"{fstype} on {source} (mounted at {point})"
    problem = _fs_problem(fstype)
    if problem is None:
        out = [Check("disk", subject, OK, where)]
    else:
        out = [Check("disk", subject, WARNING, f"{where}: {problem[0]}", problem[1])]
    ok, why, _settled = probe_direct(path)
    if ok:
        out.append(Check("disk", f"{path}: O_DIRECT", OK, "accepted"))
    else:
        out.append(
            Check(
                "disk",
                f"{path}: O_DIRECT",
                WARNING,
                f"refused ({why}): kvtier falls back to buffered I/O here, so "
                "spills go through the page cache and compete with the CPU tier "
                "for DRAM",
                "put disk_path on a file system that accepts O_DIRECT (ext4, xfs)",
            )
        )
    return out


def measure_throughput(
    directory: str, seconds: float, max_bytes: int, threads: int
) -> tuple[float, float, int, bool]:
    """(write B/s, read B/s, bytes, direct): a bounded probe of ``directory``
    through kvtier's POSIX back end. Writes ``PROBE_PIECE`` pieces with
    ``threads`` in flight until half of ``seconds`` or ``max_bytes``, syncs,
    drops the page cache of the file, reads them back the same way, and
    removes the file. Raises OSError."""
    from kvtier.safe_open import open_private
    from kvtier.store.backends.posix import PosixBackend

    path = os.path.join(
        directory, f".kvtier-doctor-probe-{os.getpid()}-{secrets.token_hex(4)}"
    )
    backend = PosixBackend(threads)
    bufs = [mmap.mmap(-1, PROBE_PIECE) for _ in range(threads)]
    for b in bufs:
        b.write(secrets.token_bytes(4096) * (PROBE_PIECE // 4096))
    handle = None
    try:
        os.close(open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
        handle = backend.open(path, writable=True)

        def phase(op, limit: int, budget: float) -> tuple[int, float]:
            start = time.monotonic()
            deadline = start + budget
            done = offset = 0
            pending: list[Future[int]] = []
            while offset < limit and time.monotonic() < deadline:
                while len(pending) < threads and offset < limit:
                    pending.append(op(handle, bufs[len(pending)], offset))
                    offset += PROBE_PIECE
                for fut in pending:
                    done += fut.result(timeout=max(budget, 1.0) + 30.0)
                pending = []
            if op == backend.submit_write:
                os.fsync(backend.fileno(handle))
            return done, max(time.monotonic() - start, 1e-9)

        written, w_s = phase(backend.submit_write, max_bytes, seconds / 2)
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(backend.fileno(handle), 0, 0, os.POSIX_FADV_DONTNEED)
        read, r_s = phase(backend.submit_read, written, seconds / 2)
        return written / w_s, read / r_s, written, handle.direct
    finally:
        if handle is not None:
            backend.close(handle)
        backend.shutdown()
        for b in bufs:
            b.close()
        with contextlib.suppress(OSError):
            os.unlink(path)


def _probe_check(cfg: KvtierConfig, path: str, seconds: float) -> Check:
    subject = f"{path}: throughput"
    if seconds <= 0:
        return Check("disk", subject, OK, "not probed (--no-probe)")
    share = cfg.disk_bytes_per_path
    limit = min(PROBE_MAX_BYTES, share, shutil.disk_usage(path).free // 4)
    limit -= limit % PROBE_PIECE
    if limit < PROBE_PIECE:
        return Check("disk", subject, OK, "not probed: too little free space")
    try:
        w_bps, r_bps, n, direct = measure_throughput(
            path, seconds, limit, cfg.disk_io_threads
        )
    except Exception as exc:  # a probe must not end the report
        return Check(
            "disk", subject, ERROR, f"probe I/O failed: {exc}", "check the device"
        )
    fill_s = share / max(w_bps, 1.0)
    fill = f"{fill_s:.1f}" if fill_s < 10 else f"{fill_s:,.0f}"
    detail = (
        f"write {fmt_bytes(int(w_bps))}/s, read {fmt_bytes(int(r_bps))}/s "
        f"({fmt_bytes(n)} probe, {cfg.disk_io_threads} threads, "
        f"{'O_DIRECT' if direct else 'buffered'}): spills fill this path's "
        f"{fmt_bytes(share)} in about {fill} s; disk hits load at up "
        f"to ~{fmt_bytes(int(r_bps))}/s from this path"
    )
    if n < 64 * PROBE_PIECE:
        detail += " (a short probe: figures are rough)"
    return Check("disk", subject, OK, detail)


def check_disk_path(
    cfg: KvtierConfig, path: str, reusable: list[str], probe_seconds: float
) -> list[Check]:
    """Exists, owner/mode, writable, free space, file system, O_DIRECT,
    throughput: one Check each (only the first when the path is unusable)."""
    if not os.path.isdir(path):
        return [
            Check(
                "disk",
                f"{path}: exists",
                ERROR,
                "does not exist or is not a directory",
                f"install -d -m 0700 -o <service user> {path}",
            )
        ]
    out = [_mode_check(path)]
    refused = not_writable(path)
    if refused is not None:
        why, fix = refused
        out.append(Check("disk", f"{path}: writable", ERROR, why, fix))
        return out
    out.append(_space_check(cfg, path, reusable))
    out += _fs_checks(path)
    out.append(_probe_check(cfg, path, probe_seconds))
    return out
