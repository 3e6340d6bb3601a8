"""The directory of one DiskStore path: its name, creation and lock.

Each configured path holds ``kvtier-<digest hex[:16]>/`` (named by the layout
fingerprint: :func:`store_dirname` makes the name, :data:`STORE_DIR_RE` and
:func:`store_digest_prefix` recognise one; nothing else spells it): created private to this user,
checked (no link, our owner, not group/other writable) and locked with
``flock`` for as long as its store is open, so two live engines never share
one. ``layout.json`` in it is a human/``kvtier inspect`` aid, never trusted
for reads; the slab opened by name is checked to be the inode found through
the locked directory.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import threading
from typing import Any

from kvtier.log import get_logger
from kvtier.safe_open import (
    InUseError,
    flock_exclusive,
    open_private,
    open_private_dir,
)
from kvtier.store.backends.base import DiskBackend
from kvtier.store.format import HEADER_SIZE, LayoutFingerprint
from kvtier.store.slab import SlabFile

logger = get_logger("store")

LAYOUT_FILE = "layout.json"

_PREFIX = "kvtier-"
_DIGEST_HEX = 16  # hex digits of the layout digest in the name
STORE_DIR_RE = re.compile(rf"^{_PREFIX}([0-9a-f]{{{_DIGEST_HEX}}})$")
"""Matches a store directory's name; group 1 is its digest hex prefix."""


def store_dirname(fingerprint: LayoutFingerprint) -> str:
    """Name of the per-layout directory created under each path (matches
    :data:`STORE_DIR_RE`)."""
    return f"{_PREFIX}{fingerprint.digest().hex()[:_DIGEST_HEX]}"


def store_digest_prefix(name: str) -> str | None:
    """The digest hex prefix that store directory ``name`` carries, or None
    when ``name`` is not a store directory's name."""
    m = STORE_DIR_RE.match(name)
    return m.group(1) if m else None


def open_store_dir(path: str, base: str) -> int:
    """Create or open a store directory, check it and lock it; returns its fd.

    Refused: a symbolic link, a non-directory, a directory of another owner,
    one writable by group or others (see kvtier.safe_open), and one locked
    by another live store (two engines on one ``disk_path`` would adopt each
    other's blocks and evict each other's slots)."""
    try:
        os.makedirs(base, exist_ok=True)
    except FileExistsError as exc:
        raise NotADirectoryError(
            errno.ENOTDIR, "kvtier disk_path exists but is not a directory", base
        ) from exc
    fd = open_private_dir(path)
    try:
        if not flock_exclusive(fd):
            raise InUseError(
                f"kvtier disk store {path!r} (disk_path {base!r}) is in use by "
                "another running kvtier engine with the same model and layout "
                "(another process, or another engine in this process). Give each "
                "engine its own disk_path, or stop the other engine first",
                path,
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_same_slab(backend: DiskBackend, handle: Any, slab: SlabFile) -> None:
    """The back end opened the slab by name: make sure it is the inode that
    was checked through the locked directory (no swap in between)."""
    fd = backend.fileno(handle)
    if fd is not None and not slab.matches(fd):
        raise PermissionError(
            errno.EPERM,
            "kvtier refuses the slab: the file opened by name is not the one "
            "checked a moment earlier (the directory was swapped?)",
            slab.path,
        )


def write_layout(
    directory: str, fingerprint: LayoutFingerprint, slot_bytes: int, *, dir_fd: int
) -> None:
    """Write ``layout.json`` (human/inspect aid; never trusted for reads)."""
    doc = dict(fingerprint.describe(), header_size=HEADER_SIZE, slot_size=slot_bytes)
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    path = os.path.join(directory, LAYOUT_FILE)
    try:
        fd = open_private(LAYOUT_FILE, os.O_RDONLY, dir_fd=dir_fd, private=True)
    except FileNotFoundError:
        pass
    except OSError as exc:
        # A link, or not private to us: it is only an aid, so replace it
        # (rename replaces the name itself, never a link's target).
        logger.info("replacing %s: %s", path, exc)
    else:
        with os.fdopen(fd, encoding="utf-8") as f:
            if f.read() == text:
                return
    tmp = f"{LAYOUT_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)  # a crashed run's leftover
    fd = open_private(
        tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dir_fd, private=True
    )
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, LAYOUT_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
