"""The disk tier's paths on the file system, checked at engine start.

:mod:`kvtier.connector.config` checks the values of kvtier's keys; this
checks what they name: each ``disk_path`` exists, is writable, is listed
once, and holds its share of ``disk_bytes_to_use`` (counting the space of
this engine's own store directories, which a warm restart reuses). Every
error is a :class:`~kvtier.connector.config.ConfigError` naming the key.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterable

from kvtier.connector.config import ConfigError, KvtierConfig


def check_disk_paths(
    cfg: KvtierConfig,
    *,
    free_bytes: Callable[[str], int] | None = None,
    reusable: Iterable[str] = (),
) -> None:
    """Fail fast on disk paths that are missing, not writable, or too small.

    Each path must hold its share of ``disk_bytes_to_use``. Space used by
    the store directories named in ``reusable`` (this engine's own layout,
    which a warm restart reuses) counts as available; directories of other
    layouts (another model or block size) do not."""
    if not cfg.disk_enabled:
        return
    free_bytes = free_bytes or (lambda p: shutil.disk_usage(p).free)
    share = -(-cfg.disk_bytes_to_use // len(cfg.disk_paths))
    seen: dict[tuple[int, int], str] = {}
    for path in cfg.disk_paths:
        if not os.path.isdir(path):
            raise ConfigError(
                "disk_path",
                f"{path!r} does not exist or is not a directory; create it first",
            )
        try:
            st = os.stat(path)
        except OSError:
            st = None  # raced away: the writability check below says so
        other = path if st is None else seen.setdefault((st.st_dev, st.st_ino), path)
        if other != path:
            # Else the store's second directory is its first one, whose
            # lock it already holds: "in use by another engine".
            raise ConfigError(
                "disk_path",
                f"{other!r} and {path!r} are the same directory (a link or "
                "bind mount); list each directory once",
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(
                "disk_path",
                f"{path!r} is not writable by this process (uid {os.getuid()})",
            )
        available = free_bytes(path) + _existing_slab_bytes(path, reusable)
        if available < share:
            raise ConfigError(
                "disk_bytes_to_use",
                f"{path!r} has {available} bytes free but needs {share} "
                f"(disk_bytes_to_use={cfg.disk_bytes_to_use} over {len(cfg.disk_paths)} path(s)); "
                "lower disk_bytes_to_use or free space",
            )


def _existing_slab_bytes(path: str, names: Iterable[str] = ()) -> int:
    wanted = set(names)
    total = 0
    try:
        entries = os.scandir(path)
    except OSError:
        return 0
    with entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False) and entry.name in wanted:
                for root, _dirs, files in os.walk(entry.path, followlinks=False):
                    for name in files:
                        with contextlib.suppress(OSError):
                            total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total
