"""Read-only inspection of disk-tier stores (``kvtier inspect`` / ``verify``).

:class:`~kvtier.io.disk_store.DiskStore` creates its directory, rewrites
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
is derived from the slot format (:func:`~kvtier.io.format.slot_size` of
``block_bytes``) and checked against ``layout.json``'s ``slot_size`` and the
slab sizes. A store that cannot be read raises :class:`StoreError`.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import struct
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.io.backend import IO_ALIGNMENT
from kvtier.io.checksum import payload_checksum
from kvtier.io.disk_store import LAYOUT_FILE, ReadOutcome
from kvtier.io.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    CorruptHeaderError,
    EmptySlotError,
    SlotHeader,
    slot_size,
)

STORE_DIR_RE = re.compile(r"^kvtier-([0-9a-f]{16})$")
SLAB_RE = re.compile(r"^slab-(\d+)\.kvt$")
_VERSION = struct.Struct("<I")

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
        return local * max(self.stripes, 1) + slab.index


@dataclass(frozen=True)
class SlotRecord:
    """What one slot holds. ``header`` is set for OK and FINGERPRINT_MISMATCH
    (and for CHECKSUM_MISMATCH / TRUNCATED found by a payload check)."""

    slot: int
    slab: str
    local_slot: int
    outcome: ReadOutcome
    header: SlotHeader | None = None
    detail: str = ""

    @property
    def used(self) -> bool:
        return self.outcome is not ReadOutcome.EMPTY

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "slot": self.slot,
            "slab": self.slab,
            "local_slot": self.local_slot,
            "reason": self.outcome.value,
        }
        if self.detail:
            d["detail"] = self.detail
        if self.header is not None:
            d["key"] = self.header.key.hex()
        return d


# ----------------------------------------------------------------- discovery


def find_stores(paths: Sequence[str]) -> list[StoreView]:
    """Stores under ``paths`` (disk paths or ``kvtier-*`` directories).

    The same store name found under several paths is merged into one view.
    Raises FileNotFoundError / NotADirectoryError for a bad path, and
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
                if STORE_DIR_RE.match(n) and os.path.isdir(os.path.join(path, n))
            )
        if not dirs:
            raise StoreError(f"{path}: no kvtier-<digest> store directory found")
        for d in dirs:
            by_name.setdefault(os.path.basename(d), []).append(d)
    return [open_store(name, dirs) for name, dirs in sorted(by_name.items())]


def _looks_like_store(path: str) -> bool:
    names = os.listdir(path)
    return LAYOUT_FILE in names or any(SLAB_RE.match(n) for n in names)


def _open_regular(path: str) -> tuple[int, os.stat_result]:
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
    fd, st = _open_regular(path)
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
            fd, st = _open_regular(path)
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
    m = STORE_DIR_RE.match(view.name)
    if view.digest is not None and m and view.digest.hex()[:16] != m.group(1):
        view.warnings.append(
            f"layout.json digest {view.digest.hex()} does not match the directory "
            f"name {view.name}"
        )


def _infer_geometry(view: StoreView) -> None:
    """Without a usable layout.json: take the block size from the header of
    slot 0 of the first slab that has a valid one (within MAX_BLOCK_BYTES)."""
    for slab in view.slabs:
        try:
            hdr = SlotHeader.unpack(_pread(slab.path, HEADER_SIZE, 0))
        except (OSError, CorruptHeaderError, EmptySlotError):
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


def _pread(path: str, n: int, offset: int) -> bytes:
    fd, _ = _open_regular(path)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ scanning


def _expected_fingerprint(view: StoreView, hdr: SlotHeader) -> bool:
    if view.digest is not None:
        return hdr.fingerprint == view.digest
    m = STORE_DIR_RE.match(view.name)
    return m is None or hdr.fingerprint.hex()[:16] == m.group(1)


def _classify(view: StoreView, slab: Slab, local: int, buf: bytes) -> SlotRecord:
    slot = view.global_slot(slab, local)

    def rec(
        outcome: ReadOutcome, hdr: SlotHeader | None = None, detail: str = ""
    ) -> SlotRecord:
        return SlotRecord(slot, slab.path, local, outcome, hdr, detail)

    if len(buf) < HEADER_SIZE:
        return rec(
            ReadOutcome.TRUNCATED, detail=f"read {len(buf)} of {HEADER_SIZE} bytes"
        )
    try:
        hdr = SlotHeader.unpack(buf)
    except EmptySlotError:
        return rec(ReadOutcome.EMPTY)
    except CorruptHeaderError as exc:
        return rec(ReadOutcome.BAD_HEADER, detail=str(exc))
    if not _expected_fingerprint(view, hdr):
        return rec(
            ReadOutcome.FINGERPRINT_MISMATCH,
            hdr,
            f"header fingerprint {hdr.fingerprint.hex()}",
        )
    assert view.slot_size is not None
    if view.block_bytes is not None and hdr.raw_len != view.block_bytes:
        return rec(
            ReadOutcome.BAD_HEADER,
            detail=f"raw_len {hdr.raw_len} != block_bytes {view.block_bytes}",
        )
    if HEADER_SIZE + hdr.payload_len > view.slot_size:
        return rec(
            ReadOutcome.BAD_HEADER,
            detail=f"payload_len {hdr.payload_len} overflows the slot",
        )
    return rec(ReadOutcome.OK, hdr)


def scan(view: StoreView, verify_payload: bool = False) -> Iterator[SlotRecord]:
    """Every slot of every slab, slab by slab. With ``verify_payload``, OK
    slots also get their payload read and checksummed (like
    ``DiskStore.verify``), which may turn them into CHECKSUM_MISMATCH or
    TRUNCATED."""
    if not view.slot_size:
        return
    ssz = view.slot_size
    for slab in view.slabs:
        fd, _ = _open_regular(slab.path)  # StoreError if it was swapped since
        try:
            for local in range(slab.num_slots):
                offset = local * ssz
                try:
                    buf = os.pread(fd, HEADER_SIZE, offset)
                except OSError as exc:
                    yield SlotRecord(
                        view.global_slot(slab, local),
                        slab.path,
                        local,
                        ReadOutcome.IO_ERROR,
                        detail=str(exc),
                    )
                    continue
                rec = _classify(view, slab, local, buf)
                if verify_payload and rec.outcome is ReadOutcome.OK:
                    rec = _verify_payload(fd, offset, rec)
                yield rec
        finally:
            os.close(fd)


def _verify_payload(fd: int, offset: int, rec: SlotRecord) -> SlotRecord:
    hdr = rec.header
    assert hdr is not None
    try:
        payload = os.pread(fd, hdr.payload_len, offset + HEADER_SIZE)
    except OSError as exc:
        return SlotRecord(
            rec.slot, rec.slab, rec.local_slot, ReadOutcome.IO_ERROR, hdr, str(exc)
        )
    if len(payload) < hdr.payload_len:
        return SlotRecord(
            rec.slot,
            rec.slab,
            rec.local_slot,
            ReadOutcome.TRUNCATED,
            hdr,
            f"payload: read {len(payload)} of {hdr.payload_len} bytes",
        )
    if payload_checksum(payload) != hdr.checksum:
        return SlotRecord(
            rec.slot,
            rec.slab,
            rec.local_slot,
            ReadOutcome.CHECKSUM_MISMATCH,
            hdr,
            "payload checksum does not match the header",
        )
    return rec


def _header_version(view: StoreView, slab: Slab, local: int) -> int | None:
    """Format version of a slot whose magic is ours (even if unsupported)."""
    assert view.slot_size is not None
    buf = _pread(slab.path, len(MAGIC) + _VERSION.size, local * view.slot_size)
    if len(buf) < len(MAGIC) + _VERSION.size or buf[: len(MAGIC)] != MAGIC:
        return None
    return _VERSION.unpack_from(buf, len(MAGIC))[0]


# ------------------------------------------------------------------- reports


def inspect_store(view: StoreView) -> dict[str, Any]:
    """Summary of one store: slots used, bytes, fill, fingerprints, versions."""
    outcomes: Counter[str] = Counter()
    fingerprints: Counter[str] = Counter()
    versions: Counter[int] = Counter()
    payload_bytes = raw_bytes = 0
    slabs = {s.path: s for s in view.slabs}
    for rec in scan(view):
        outcomes[rec.outcome.value] += 1
        if rec.header is not None:
            fingerprints[rec.header.fingerprint.hex()] += 1
            versions[rec.header.version] += 1
        elif rec.outcome is ReadOutcome.BAD_HEADER:
            v = _header_version(view, slabs[rec.slab], rec.local_slot)
            if v is not None:
                versions[v] += 1
        if rec.outcome is ReadOutcome.OK:
            assert rec.header is not None
            payload_bytes += rec.header.payload_len
            raw_bytes += rec.header.raw_len
    total = view.total_slots
    used = total - outcomes.get(ReadOutcome.EMPTY.value, 0) if view.slot_size else 0
    layout_version = (view.layout or {}).get("format_version")
    return {
        "store": view.name,
        "directories": view.directories,
        "layout": view.layout,
        "format_version": layout_version,
        "reader_format_version": FORMAT_VERSION,
        "header_format_versions": {str(k): v for k, v in sorted(versions.items())},
        "block_bytes": view.block_bytes,
        "slot_size": view.slot_size,
        "slabs": [
            {"path": s.path, "index": s.index, "bytes": s.size, "slots": s.num_slots}
            for s in view.slabs
        ],
        "slab_bytes": sum(s.size for s in view.slabs),
        "total_slots": total,
        "used_slots": used,
        "blocks": outcomes.get(ReadOutcome.OK.value, 0),
        "fill": used / total if total else 0.0,
        "payload_bytes": payload_bytes,
        "raw_bytes": raw_bytes,
        "outcomes": dict(sorted(outcomes.items())),
        "fingerprints": dict(fingerprints.most_common()),
        "warnings": view.warnings,
    }


def verify_store(view: StoreView) -> dict[str, Any]:
    """Check every used slot's header and payload; list the bad ones."""
    checked = ok = 0
    bad: list[dict[str, Any]] = []
    for rec in scan(view, verify_payload=True):
        if not rec.used:
            continue
        checked += 1
        if rec.outcome is ReadOutcome.OK:
            ok += 1
        else:
            bad.append(rec.to_dict())
    if view.slabs and not view.slot_size:
        bad.append(
            {"slot": None, "reason": "unknown_geometry", "detail": view.warnings[-1]}
        )
    return {
        "store": view.name,
        "directories": view.directories,
        "checked": checked,
        "ok": ok,
        "bad": bad,
        "warnings": view.warnings,
    }
