"""Per-slot scan and reports of a disk-tier store (``kvtier inspect`` /
``verify``).

Stores are found and opened read-only by :func:`kvtier.store.slabs.find_stores`, which
validates ``layout.json`` and the slab files; this module reads every slot's
header (and, for ``verify``, its payload) with ``os.pread`` on descriptors
opened ``O_RDONLY``, and never creates, truncates or writes anything.
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvtier.store.slabs import SlabFile, SlabFiles, global_slot, open_regular
from kvtier.store.slot import (
    FORMAT_VERSION,
    HEADER_SIZE,
    HEADER_VERSIONS,
    MAGIC,
    ReadOutcome,
    SlotHeader,
    check_payload,
    verify_header,
)

_VERSION = struct.Struct("<I")


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


# ------------------------------------------------------------------ scanning


def _gslot(view: SlabFiles, slab: SlabFile, local: int) -> int:
    return global_slot(slab.index, local, max(view.stripes, 1))


def _classify(view: SlabFiles, slab: SlabFile, local: int, buf: bytes) -> SlotRecord:
    verdict = verify_header(
        buf,
        len(buf),
        key=None,
        digest=view.digest,
        block_bytes=view.block_bytes,
        slot_bytes=view.slot_size,
    )
    detail = verdict.detail
    if verdict.outcome is ReadOutcome.BAD_HEADER and detail.startswith("bad header ("):
        detail = detail[len("bad header (") : -1]
    return SlotRecord(
        _gslot(view, slab, local),
        slab.path,
        local,
        verdict.outcome,
        verdict.header,
        "" if verdict.ok else detail,
    )


def scan(view: SlabFiles, verify_payload: bool = False) -> Iterator[SlotRecord]:
    """Every slot of every slab, slab by slab. With ``verify_payload``, OK
    slots also get their payload read and checksummed (like
    ``DiskStore.verify``), which may turn them into CHECKSUM_MISMATCH or
    TRUNCATED."""
    if not view.slot_size:
        return
    ssz = view.slot_size
    for slab in view.slabs:
        fd, _ = open_regular(slab.path)  # StoreError if it was swapped since
        try:
            for local in range(slab.num_slots):
                offset = local * ssz
                try:
                    buf = os.pread(fd, HEADER_SIZE, offset)
                except OSError as exc:
                    yield SlotRecord(
                        _gslot(view, slab, local),
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
    verdict = check_payload(hdr, payload, len(payload))
    if not verdict.ok:
        return SlotRecord(
            rec.slot, rec.slab, rec.local_slot, verdict.outcome, hdr, verdict.detail
        )
    return rec


def _header_version(view: SlabFiles, slab: SlabFile, local: int) -> int | None:
    """Format version of a slot whose magic is ours (even if unsupported)."""
    fd, _ = open_regular(slab.path)
    try:
        buf = os.pread(fd, len(MAGIC) + _VERSION.size, local * view.slot_size)
    finally:
        os.close(fd)
    if len(buf) < len(MAGIC) + _VERSION.size or buf[: len(MAGIC)] != MAGIC:
        return None
    return _VERSION.unpack_from(buf, len(MAGIC))[0]


# ------------------------------------------------------------------- reports


def inspect_store(view: SlabFiles) -> dict[str, Any]:
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
    total = view.num_slots
    used = total - outcomes.get(ReadOutcome.EMPTY.value, 0) if view.slot_size else 0
    layout_version = (view.layout or {}).get("format_version")
    return {
        "store": view.name,
        "directories": view.dirs,
        "layout": view.layout,
        "format_version": layout_version,
        "reader_format_version": FORMAT_VERSION,
        "reader_header_versions": list(HEADER_VERSIONS),
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


# Slots scanned between two calls of verify_store's ``progress``.
PROGRESS_STEP = 256


def verify_store(
    view: SlabFiles, progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Check every used slot's header and payload; list the bad ones.
    ``progress`` is called with the number of slots scanned since its last
    call (every slot of the view's slabs is scanned, used or not)."""
    checked = ok = pending = 0
    bad: list[dict[str, Any]] = []
    for rec in scan(view, verify_payload=True):
        if progress is not None:
            pending += 1
            if pending == PROGRESS_STEP:
                progress(pending)
                pending = 0
        if not rec.used:
            continue
        checked += 1
        if rec.outcome is ReadOutcome.OK:
            ok += 1
        else:
            bad.append(rec.to_dict())
    if progress is not None and pending:
        progress(pending)
    if view.slabs and not view.slot_size:
        bad.append(
            {"slot": None, "reason": "unknown_geometry", "detail": view.warnings[-1]}
        )
    return {
        "store": view.name,
        "directories": view.dirs,
        "checked": checked,
        "ok": ok,
        "bad": bad,
        "warnings": view.warnings,
    }
