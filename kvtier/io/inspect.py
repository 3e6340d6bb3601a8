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
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    ValueError when a path holds no store.
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
            raise ValueError(f"{path}: no kvtier-<digest> store directory found")
        for d in dirs:
            by_name.setdefault(os.path.basename(d), []).append(d)
    return [open_store(name, dirs) for name, dirs in sorted(by_name.items())]


def _looks_like_store(path: str) -> bool:
    names = os.listdir(path)
    return LAYOUT_FILE in names or any(SLAB_RE.match(n) for n in names)


def _read_layout(directory: str) -> tuple[dict[str, Any] | None, str | None]:
    path = os.path.join(directory, LAYOUT_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None, f"{path}: missing"
    except (OSError, ValueError) as exc:
        return None, f"{path}: unreadable ({exc})"
    if not isinstance(doc, dict):
        return None, f"{path}: not a JSON object"
    return doc, None


def open_store(name: str, directories: Sequence[str]) -> StoreView:
    """Read ``layout.json`` and list the slabs of one store (no slot I/O)."""
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
        for n in sorted(os.listdir(d)):
            m = SLAB_RE.match(n)
            if m is None:
                continue
            path = os.path.join(d, n)
            view.slabs.append(Slab(path, int(m.group(1)), os.stat(path).st_size, 0))
    view.slabs.sort(key=lambda s: (s.index, s.path))

    if view.slot_size is None:
        _infer_geometry(view)
    if view.slot_size:
        view.slabs = [
            Slab(s.path, s.index, s.size, s.size // view.slot_size) for s in view.slabs
        ]
        for s in view.slabs:
            if s.size % view.slot_size:
                view.warnings.append(
                    f"{s.path}: size {s.size} is not a multiple of the slot size "
                    f"{view.slot_size}; the partial tail is ignored"
                )
    return view


def _apply_layout(view: StoreView, layout: dict[str, Any]) -> None:
    try:
        view.block_bytes = int(layout["block_bytes"])
        view.slot_size = int(layout.get("slot_size") or slot_size(view.block_bytes))
        if int(layout.get("header_size", HEADER_SIZE)) != HEADER_SIZE:
            view.warnings.append(
                f"layout.json header_size {layout['header_size']} != {HEADER_SIZE}"
            )
    except (KeyError, TypeError, ValueError) as exc:
        view.warnings.append(
            f"layout.json lacks a usable block_bytes/slot_size ({exc})"
        )
        view.block_bytes = view.slot_size = None
    digest = layout.get("digest")
    if isinstance(digest, str):
        try:
            view.digest = bytes.fromhex(digest)
        except ValueError:
            view.warnings.append(f"layout.json digest {digest!r} is not hex")
    m = STORE_DIR_RE.match(view.name)
    if view.digest is not None and m and view.digest.hex()[:16] != m.group(1):
        view.warnings.append(
            f"layout.json digest {view.digest.hex()} does not match the directory "
            f"name {view.name}"
        )


def _infer_geometry(view: StoreView) -> None:
    """Without layout.json: take the block size from slot 0's header."""
    for slab in view.slabs:
        try:
            hdr = SlotHeader.unpack(_pread(slab.path, HEADER_SIZE, 0))
        except (OSError, CorruptHeaderError, EmptySlotError):
            continue
        view.block_bytes = hdr.raw_len
        view.slot_size = slot_size(hdr.raw_len)
        view.warnings.append(
            f"slot size {view.slot_size} inferred from the header of slot 0 "
            f"of {slab.path}"
        )
        return
    if view.slabs:
        view.warnings.append(
            "no layout.json and no readable header at slot 0: slot size unknown, "
            "slots not scanned"
        )


def _pread(path: str, n: int, offset: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
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
        fd = os.open(slab.path, os.O_RDONLY | os.O_CLOEXEC)
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
