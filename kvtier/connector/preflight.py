"""What kvtier's keys name, checked on this host at engine start: the disk
paths and the shared memory of the CPU tier.

:mod:`kvtier.connector.config` checks the values of the keys; this checks
what they name: each ``disk_path`` exists, is writable, is listed once and
holds its share of ``disk_bytes_to_use`` (counting the space of this
engine's own store directories, which a warm restart reuses); the CPU
tier's shared-memory file system holds ``cpu_bytes_to_use`` once dead
engines' files are reclaimed, and when it does not, the error names the
kvtier files that hold it. Every error is a
:class:`~kvtier.connector.config.ConfigError` naming the key and the fix.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
from collections.abc import Callable, Iterable, Sequence

from kvtier.connector.config import ConfigError, KvtierConfig
from kvtier.host.cpu_tier import (
    cpu_tier_dirs,
    held_by_another,
    is_cpu_tier_dir,
    mapped_bytes,
    reclaim_stale_cpu_files,
)


def check_disk_paths(
    cfg: KvtierConfig,
    *,
    free_bytes: Callable[[str], int] | None = None,
    reusable: Iterable[str] = (),
) -> None:
    """Fail fast on disk paths that are missing, listed twice under two
    names, not writable, or too small (:func:`check_disk_space`)."""
    if not cfg.disk_enabled:
        return
    for path in cfg.disk_path:
        if not os.path.isdir(path):
            raise ConfigError(
                "disk_path",
                f"{path!r} does not exist or is not a directory; create it first",
            )
    same = same_directory(cfg.disk_path)
    if same is not None:
        raise ConfigError("disk_path", same)
    for path in cfg.disk_path:
        refused = not_writable(path)
        if refused is not None:
            why, fix = refused
            raise ConfigError("disk_path", f"{path!r} {why}; {fix}")
        check_disk_space(cfg, path, free_bytes=free_bytes, reusable=reusable)


def not_writable(path: str) -> tuple[str, str] | None:
    """(why, fix) when this process cannot create files in directory
    ``path``, else None: a read-only mount (the fix is the mount, not the
    owner) or missing permission."""
    if os.access(path, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return (
            "is on a read-only file system",
            "remount it read-write, or choose a disk_path on a writable one",
        )
    return (
        f"is not writable by this process (uid {os.geteuid()})",
        f"chown <service user> {path} (or run as its owner)",
    )


def same_directory(paths: Sequence[str]) -> str | None:
    """Why two of ``paths`` are one directory under two names (a link or a
    bind mount), or None. A store's second directory would be its first one,
    whose lock it already holds: it would refuse itself as "in use by
    another engine". A path that cannot be stat'ed is left to the caller's
    other checks."""
    seen: dict[tuple[int, int], str] = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        other = seen.setdefault((st.st_dev, st.st_ino), path)
        if other != path:
            return (
                f"{other!r} and {path!r} are the same directory (a link or "
                "bind mount); list each directory once"
            )
    return None


def check_disk_space(
    cfg: KvtierConfig,
    path: str,
    *,
    free_bytes: Callable[[str], int] | None = None,
    reusable: Iterable[str] = (),
) -> None:
    """Fail fast when the disk path ``path`` cannot hold its share of
    ``disk_bytes_to_use`` (:attr:`KvtierConfig.disk_bytes_per_path`): a
    :class:`ConfigError` naming the key and the fix.

    Space used by the store directories named in ``reusable`` (this
    engine's own layout, which a warm restart reuses) counts as available;
    directories of other layouts (another model or block size) do not."""
    free_bytes = free_bytes or (lambda p: shutil.disk_usage(p).free)
    share = cfg.disk_bytes_per_path
    available = free_bytes(path) + _existing_slab_bytes(path, reusable)
    if available < share:
        raise ConfigError(
            "disk_bytes_to_use",
            f"{path!r} has {available} bytes free but needs {share} "
            f"(disk_bytes_to_use={cfg.disk_bytes_to_use} over {len(cfg.disk_path)} path(s)); "
            "lower disk_bytes_to_use or free space",
        )


def allocated_bytes(directory: str) -> int:
    """Bytes the files under ``directory`` take on disk (symbolic links are
    neither followed nor counted beyond themselves; unreadable files are
    skipped)."""
    total = 0
    for root, _dirs, files in os.walk(directory, followlinks=False):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def _existing_slab_bytes(path: str, names: Iterable[str] = ()) -> int:
    """Bytes held by the store directories ``names`` (not links) in ``path``."""
    total = 0
    for name in set(names):
        store = os.path.join(path, name)
        if os.path.isdir(store) and not os.path.islink(store):
            total += allocated_bytes(store)
    return total


def _kvtier_shm_files(directory: str, exclude: Sequence[str]) -> list[tuple[str, int]]:
    """Other kvtier CPU-tier files still holding shared memory: in our private
    directories (live engines; the fallbacks too) and directly in their
    parent (``/dev/shm/kvtier-*.cpu``), where older kvtier versions put them
    and where they stay until someone removes them."""
    skip = {os.path.abspath(p) for p in exclude}
    patterns = [os.path.join(d, "*.cpu") for d in _with_fallbacks(directory)]
    patterns.append(os.path.join(os.path.dirname(directory), "kvtier-*.cpu"))
    found: list[tuple[str, int]] = []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            if os.path.abspath(path) in skip:
                continue
            with contextlib.suppress(OSError):
                st = os.stat(path, follow_symlinks=False)
                if st.st_uid == os.geteuid():
                    found.append((path, st.st_blocks * 512))
    return found


def check_shm_space(
    shm_dir: str,
    needed: int,
    existing: Sequence[str] = (),
    *,
    free_bytes: Callable[[str], int] | None = None,
) -> None:
    """Fail fast when the CPU tier's shared-memory file system is too small:
    a :class:`ConfigError` naming ``cpu_bytes_to_use`` and the fix, and the
    other kvtier CPU-tier files that hold the space.

    ``shm_dir``: this user's CPU-tier directory (its file system is its
    parent's until the first CPU-tier file creates it); ``existing``: files
    whose space counts as available (this engine's own, created by its other
    role, or dead engines' that are reclaimed first)."""
    free_bytes = free_bytes or (lambda p: shutil.disk_usage(p).free)
    mounted = shm_dir if os.path.isdir(shm_dir) else os.path.dirname(shm_dir)
    available = free_bytes(mounted)
    for path in existing:
        with contextlib.suppress(OSError):
            available += os.stat(path).st_blocks * 512
    if available >= needed:
        return
    holders = ""
    others = _kvtier_shm_files(shm_dir, existing)
    if others:
        listed = ", ".join(f"{p} ({n} bytes)" for p, n in others)
        holders = (
            f". Other kvtier CPU-tier files hold {sum(n for _, n in others)} "
            f"bytes of it: {listed}. Files in {shm_dir} are held by running "
            "engines (stop them); files outside it were left by older kvtier "
            "versions: remove those no running engine uses"
        )
    raise ConfigError(
        "cpu_bytes_to_use",
        f"the CPU tier needs {needed} bytes of shared memory in {shm_dir!r} "
        f"but only {available} are free; enlarge it (e.g. docker run "
        f"--shm-size) or lower cpu_bytes_to_use{holders}",
    )


def prepare_cpu_tier(path: str, num_blocks: int, block_bytes: int) -> None:
    """Reclaim dead engines' CPU-tier files, then check shared memory for
    the CPU-tier file ``path`` about to be made: ``num_blocks`` rows of
    ``block_bytes`` (:func:`check_shm_space`).

    One rank's file, checked where it is made: other files (other ranks',
    or the scheduler's view of them) already hold their room. A file whose
    owner died (SIGKILL, OOM kill) keeps its shared memory until removed;
    its lock died with the owner, so it is removed here, in every one of
    this user's CPU-tier directories (the fallbacks too)."""
    directory = os.path.dirname(path)
    for each in _with_fallbacks(directory):
        reclaim_stale_cpu_files(each)
    check_shm_space(directory, mapped_bytes(num_blocks, block_bytes), [path])


def _with_fallbacks(directory: str) -> list[str]:
    """``directory`` and, when it is one of this user's CPU-tier
    directories, the others beside it (:func:`cpu_tier_dirs`)."""
    if not is_cpu_tier_dir(directory):
        return [directory]
    found = cpu_tier_dirs(os.path.dirname(directory))
    if directory in found or held_by_another(directory) is not None:
        return found  # never another user's directory
    return [directory, *found]
