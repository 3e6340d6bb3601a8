"""Finding and opening disk-tier stores read-only (``kvtier inspect`` /
``verify``; the per-slot scan and reports are :mod:`kvtier.store.inspect`).

:class:`~kvtier.store.disk_store.DiskStore` creates its directory, rewrites
``layout.json`` and preallocates slabs when constructed, so it cannot be used
to look at a store without changing it. This module reads the same files
with ``os.pread`` on descriptors opened ``O_RDONLY`` and applies the same
checks (see docs/on-disk-format.md): it never creates, truncates or writes
anything.

A *disk path* (what the connector is configured with) holds one directory
``kvtier-<digest hex[:16]>`` per layout; each holds ``layout.json`` and the
slab ``slab-<path index>.kvt`` of that path. With several disk paths, global
slot ``s`` lives in slab ``s % P`` at local slot ``s // P``; pass every path
of such a store together so global slot numbers can be reconstructed
(``P`` is taken as the highest slab index found + 1).

Nothing found on disk is trusted: slab and ``layout.json`` candidates are
opened ``O_NOFOLLOW | O_NONBLOCK`` and refused unless they are regular files
(a FIFO named like a slab would otherwise block forever), and the slot size
is derived from the slot format (:func:`~kvtier.store.format.slot_size` of
``block_bytes``) and checked against ``layout.json``'s ``slot_size`` and the
slab sizes. A store that cannot be read raises :class:`StoreError`.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.store.backends.base import IO_ALIGNMENT
from kvtier.store.format import HEADER_SIZE, slot_size
from kvtier.store.layout import SLAB_RE, global_slot, parse_header
from kvtier.store.store_dir import LAYOUT_FILE, STORE_DIR_RE, store_digest_prefix

# Sanity bounds on geometry read from layout.json or a slot header. A 16-token
# block of a 405B model in bf16 is about 8 MiB per rank; 4 GiB is absurd.
MAX_BLOCK_BYTES = 1 << 32
MAX_SLOT_SIZE = slot_size(MAX_BLOCK_BYTES)
MIN_SLOT_SIZE = slot_size(1)  # header + one aligned payload unit
MAX_LAYOUT_BYTES = 1 << 20  # layout.json is a few hundred bytes


class StoreError(ValueError):
    """A store that cannot be read safely: a slab or layout.json that is not
    a regular file, an impossible geometry, no slabs. The message names the
    file and the problem."""


@dataclass(frozen=True)
class Slab:
    """One slab file of a store (read-only view)."""

    path: str
    index: int
    size: int
    num_slots: int


@dataclass
class StoreView:
    """A store directory (or the same store's directories on several paths)."""

    name: str  # kvtier-<digest16>
    directories: list[str]
    layout: dict[str, Any] | None
    slot_size: int | None
    block_bytes: int | None
    digest: bytes | None  # full digest from layout.json, if readable
    slabs: list[Slab] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def stripes(self) -> int:
        return max((s.index for s in self.slabs), default=-1) + 1

    @property
    def total_slots(self) -> int:
        return sum(s.num_slots for s in self.slabs)

    def global_slot(self, slab: Slab, local: int) -> int:
        return global_slot(slab.index, local, max(self.stripes, 1))


# ----------------------------------------------------------------- discovery


def find_stores(paths: Sequence[str]) -> list[StoreView]:
    """Stores under ``paths`` (disk paths or ``kvtier-*`` directories).

    The same store name found under several paths is merged into one view.
    A ``kvtier-*`` entry found by listing a path must be a directory, not a
    symbolic link (see :func:`_store_dir`). Raises FileNotFoundError / NotADirectoryError for a bad path, and
    ValueError (:class:`StoreError`) when a path holds no store or a store
    cannot be read safely (see :func:`open_store`).
    """
    by_name: dict[str, list[str]] = {}
    for path in paths:
        path = os.path.abspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such file or directory")
        if not os.path.isdir(path):
            raise NotADirectoryError(f"{path}: not a directory")
        base = os.path.basename(path.rstrip(os.sep))
        if STORE_DIR_RE.match(base) or _looks_like_store(path):
            dirs = [path]
        else:
            dirs = sorted(
                os.path.join(path, n)
                for n in os.listdir(path)
                if STORE_DIR_RE.match(n) and _store_dir(os.path.join(path, n))
            )
        if not dirs:
            raise StoreError(f"{path}: no kvtier-<digest> store directory found")
        for d in dirs:
            by_name.setdefault(os.path.basename(d), []).append(d)
    return [open_store(name, dirs) for name, dirs in sorted(by_name.items())]


def _store_dir(path: str) -> bool:
    """Whether ``path`` (found by listing) is a directory; a symbolic link
    is refused, never followed (another user may have planted it in a
    shared disk path, pointing anywhere)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False  # gone meanwhile
    if stat.S_ISLNK(mode):
        raise StoreError(
            f"{path}: is a symbolic link (refused: kvtier never follows links "
            "to its store directories). Remove it, or pass the directory it "
            "points to"
        )
    return stat.S_ISDIR(mode)


def _looks_like_store(path: str) -> bool:
    names = os.listdir(path)
    return LAYOUT_FILE in names or any(SLAB_RE.match(n) for n in names)


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """``os.open`` for reading that never blocks or follows a symlink, and
    accepts only a regular file (a FIFO named like a slab would otherwise
    block forever, a device would be read endlessly)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError(f"{path}: is a symbolic link (refused)") from None
        raise StoreError(f"{path}: cannot open: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise StoreError(f"{path}: cannot stat: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise StoreError(f"{path}: not a regular file ({_file_kind(st.st_mode)})")
    return fd, st


def _file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "special file"


def _read_layout(directory: str) -> tuple[dict[str, Any] | None, str | None]:
    """(layout, None), or (None, warning) for a missing or unparsable file.
    Raises StoreError for a layout.json that is not a regular file or is
    implausibly large."""
    path = os.path.join(directory, LAYOUT_FILE)
    if not os.path.lexists(path):
        return None, f"{path}: missing"
    fd, st = open_regular(path)
    try:
        if st.st_size > MAX_LAYOUT_BYTES:
            raise StoreError(f"{path}: {st.st_size} bytes, not a kvtier layout.json")
        data = os.pread(fd, MAX_LAYOUT_BYTES + 1, 0)
    except OSError as exc:
        return None, f"{path}: unreadable ({exc})"
    finally:
        os.close(fd)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        return None, f"{path}: unreadable ({exc})"
    if not isinstance(doc, dict):
        return None, f"{path}: not a JSON object"
    return doc, None


def open_store(name: str, directories: Sequence[str]) -> StoreView:
    """Read ``layout.json`` and list the slabs of one store (no slot I/O).

    The slot size is derived from the slot format (``slot_size(block_bytes)``)
    and checked against layout.json's ``slot_size`` and the slab sizes; it is
    never taken on trust. Raises :class:`StoreError` when a slab candidate or
    layout.json is not a regular file, when layout.json's geometry is
    impossible (non-integer, non-positive, not 4 KiB-aligned, absurdly large,
    or inconsistent), when there is no slab, or when no slot size can be
    established.
    """
    view = StoreView(
        name=name,
        directories=list(directories),
        layout=None,
        slot_size=None,
        block_bytes=None,
        digest=None,
    )
    for d in directories:
        doc, err = _read_layout(d)
        if err is not None:
            view.warnings.append(err)
        elif view.layout is None:
            view.layout = doc
        elif doc != view.layout:
            view.warnings.append(f"{d}: layout.json differs from {directories[0]}")
    if view.layout is not None:
        _apply_layout(view, view.layout)

    for d in directories:
        try:
            names = sorted(os.listdir(d))
        except OSError as exc:
            raise StoreError(f"{d}: cannot list: {exc.strerror or exc}") from None
        for n in names:
            m = SLAB_RE.match(n)
            if m is None:
                continue
            path = os.path.join(d, n)
            fd, st = open_regular(path)
            os.close(fd)
            view.slabs.append(Slab(path, int(m.group(1)), st.st_size, 0))
    view.slabs.sort(key=lambda s: (s.index, s.path))
    if not view.slabs:
        raise StoreError(
            f"{', '.join(view.directories)}: no slab-<n>.kvt file in the store"
        )

    if view.slot_size is None:
        _infer_geometry(view)
    if view.slot_size is None:
        raise StoreError(f"{', '.join(view.directories)}: {view.warnings[-1]}")
    ssz = view.slot_size
    for s in view.slabs:
        if 0 < s.size < ssz:
            raise StoreError(
                f"{s.path}: {s.size} bytes, smaller than one slot of {ssz} bytes "
                f"(block_bytes {view.block_bytes}): wrong layout.json?"
            )
    view.slabs = [Slab(s.path, s.index, s.size, s.size // ssz) for s in view.slabs]
    for s in view.slabs:
        if s.size % ssz:
            view.warnings.append(
                f"{s.path}: size {s.size} is not a multiple of the slot size "
                f"{ssz}; the partial tail is ignored"
            )
    if view.total_slots == 0:
        raise StoreError(
            f"{', '.join(view.directories)}: every slab is empty (0 bytes, no slots)"
        )
    return view


def _layout_int(layout: dict[str, Any], key: str) -> int:
    v = layout[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise StoreError(f"{key} {v!r:.40} is not an integer")
    return v


def _apply_layout(view: StoreView, layout: dict[str, Any]) -> None:
    where = f"{view.directories[0]}/{LAYOUT_FILE}"
    if "block_bytes" not in layout:
        view.warnings.append(f"{where}: no block_bytes; geometry taken from headers")
    else:
        try:
            bb = _layout_int(layout, "block_bytes")
        except StoreError as exc:
            raise StoreError(f"{where}: {exc}") from None
        if not 0 < bb <= MAX_BLOCK_BYTES:
            raise StoreError(
                f"{where}: block_bytes {bb} is not within [1, {MAX_BLOCK_BYTES}]"
            )
        expected = slot_size(bb)
        if "slot_size" in layout:
            try:
                ssz = _layout_int(layout, "slot_size")
            except StoreError as exc:
                raise StoreError(f"{where}: {exc}") from None
            if not MIN_SLOT_SIZE <= ssz <= MAX_SLOT_SIZE or ssz % IO_ALIGNMENT:
                raise StoreError(
                    f"{where}: slot_size {ssz} is impossible (a slot is a "
                    f"{HEADER_SIZE} B header plus the payload, a multiple of "
                    f"{IO_ALIGNMENT} B between {MIN_SLOT_SIZE} and {MAX_SLOT_SIZE})"
                )
            if ssz != expected:
                raise StoreError(
                    f"{where}: slot_size {ssz} does not match block_bytes {bb} "
                    f"(this format's slot is {expected} B)"
                )
        view.block_bytes = bb
        view.slot_size = expected
    if layout.get("header_size", HEADER_SIZE) != HEADER_SIZE:
        view.warnings.append(
            f"layout.json header_size {layout['header_size']!r:.40} != {HEADER_SIZE}"
        )
    digest = layout.get("digest")
    if isinstance(digest, str):
        try:
            view.digest = bytes.fromhex(digest)
        except ValueError:
            view.warnings.append(f"layout.json digest {digest!r:.80} is not hex")
    named = store_digest_prefix(view.name)
    if view.digest is not None and named and not view.digest.hex().startswith(named):
        view.warnings.append(
            f"layout.json digest {view.digest.hex()} does not match the directory "
            f"name {view.name}"
        )


def _infer_geometry(view: StoreView) -> None:
    """Without a usable layout.json: take the block size from the header of
    slot 0 of the first slab that has a valid one (within MAX_BLOCK_BYTES)."""
    for slab in view.slabs:
        try:
            buf = pread_file(slab.path, HEADER_SIZE, 0)
        except OSError:
            continue
        hdr = parse_header(buf, len(buf)).header
        if hdr is None:
            continue
        if not 0 < hdr.raw_len <= MAX_BLOCK_BYTES:
            view.warnings.append(
                f"{slab.path}: slot 0 header raw_len {hdr.raw_len} is implausible"
            )
            continue
        view.block_bytes = hdr.raw_len
        view.slot_size = slot_size(hdr.raw_len)
        view.warnings.append(
            f"slot size {view.slot_size} inferred from the header of slot 0 "
            f"of {slab.path}"
        )
        return
    view.warnings.append(
        "no usable layout.json and no readable header at slot 0 of any slab: "
        "slot size unknown"
    )


def pread_file(path: str, n: int, offset: int) -> bytes:
    fd, _ = open_regular(path)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)
