"""``kvtier inspect`` and ``kvtier verify``: read-only disk store checks."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvtier.tools.commands.common import (
    emit_json,
    fmt_bytes,
    progress_bar,
    say,
)

# The layout.json keys ``kvtier inspect`` shows on its layout line.
LAYOUT_SHOWN = ("model", "dtype", "block_bytes", "geometry", "tp_rank", "tp_size")


def inspect_store(files: Any) -> dict[str, Any]:
    """Summary of one store found on disk (a
    :class:`~kvtier.store.slabs.SlabFiles`): slots used, bytes, fill,
    fingerprints, header versions, and the valid blocks written after a
    connector reset (``after_reset_blocks``: read by the engine that wrote
    them, never adopted by a restart)."""
    from kvtier.store.scan import scan
    from kvtier.store.slot import FORMAT_VERSION, HEADER_VERSIONS, ReadOutcome

    outcomes: Counter[str] = Counter()
    fingerprints: Counter[str] = Counter()
    versions: Counter[int] = Counter()
    payload_bytes = raw_bytes = after_reset = 0
    for rec in scan(files, file_order=True):
        outcomes[rec.outcome.value] += 1
        if rec.header is not None:
            fingerprints[rec.header.fingerprint.hex()] += 1
        if rec.version is not None and (
            rec.header is not None or rec.outcome is ReadOutcome.BAD_HEADER
        ):
            versions[rec.version] += 1
        if rec.outcome is ReadOutcome.OK:
            assert rec.header is not None
            payload_bytes += rec.header.payload_len
            raw_bytes += rec.header.raw_len
            after_reset += rec.header.after_reset
    total = files.num_slots
    used = total - outcomes.get(ReadOutcome.EMPTY.value, 0)
    return {
        "store": files.name,
        "directories": files.dirs,
        "layout": files.layout,
        "format_version": (files.layout or {}).get("format_version"),
        "reader_format_version": FORMAT_VERSION,
        "reader_header_versions": list(HEADER_VERSIONS),
        "header_format_versions": {str(k): v for k, v in sorted(versions.items())},
        "block_bytes": files.block_bytes,
        "slot_size": files.slot_size,
        "slabs": [
            {"path": s.path, "index": s.index, "bytes": s.size, "slots": s.num_slots}
            for s in files.slabs
        ],
        "slab_bytes": sum(s.size for s in files.slabs),
        "total_slots": total,
        "used_slots": used,
        "blocks": outcomes.get(ReadOutcome.OK.value, 0),
        "after_reset_blocks": after_reset,
        "fill": used / total if total else 0.0,
        "payload_bytes": payload_bytes,
        "raw_bytes": raw_bytes,
        "outcomes": dict(sorted(outcomes.items())),
        "fingerprints": dict(fingerprints.most_common()),
        "warnings": files.warnings,
    }


def verify_store(
    files: Any, progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Check every used slot's header and payload; list the bad ones.
    ``progress`` is called with 1 after each slot (every slot is scanned,
    used or not)."""
    from kvtier.store.scan import scan
    from kvtier.store.slot import ReadOutcome

    checked = ok = 0
    bad: list[dict[str, Any]] = []
    for rec in scan(files, file_order=True, payload=True):
        if progress is not None:
            progress(1)
        if not rec.used:
            continue
        checked += 1
        if rec.outcome is ReadOutcome.OK:
            ok += 1
        else:
            bad.append(rec.to_dict())
    return {
        "store": files.name,
        "directories": files.dirs,
        "checked": checked,
        "ok": ok,
        "bad": bad,
        "short_slabs": files.short,
        "warnings": files.warnings,
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    from kvtier.store.slabs import find_stores

    try:
        reports = [inspect_store(v) for v in find_stores(args.paths)]
    except (OSError, ValueError) as exc:  # also: a slab swapped for a FIFO since
        print(f"kvtier inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        emit_json({"stores": reports})
        return 0
    for rep in reports:
        say(f"store {rep['store']}")
        for d in rep["directories"]:
            say(f"  directory        {d}")
        layout = rep["layout"] or {}
        if layout:
            desc = ", ".join(f"{k}={layout[k]}" for k in LAYOUT_SHOWN if k in layout)
            say(f"  layout           {desc}")
            say(f"  digest           {layout.get('digest')}")
            if layout.get("model_id"):
                say(f"  model_id         {layout['model_id']}")
            ident = layout.get("identity")
            if ident:
                # As written: layout.json is the store's, not to be trusted.
                if isinstance(ident, dict):
                    ident = ", ".join(f"{k}={v}" for k, v in ident.items())
                say(f"  identity         {ident}")
        versions = ", ".join(
            f"v{v} x{n}" for v, n in rep["header_format_versions"].items()
        )
        say(
            f"  format version   {rep['format_version']} (layout.json); "
            f"headers: {versions or 'none'}; this kvtier reads format "
            f"v{rep['reader_format_version']}, header versions "
            + ", ".join(f"v{v}" for v in rep["reader_header_versions"])
        )
        say(
            f"  slabs            {len(rep['slabs'])} file(s), {rep['total_slots']} slots "
            f"x {rep['slot_size']} B = {fmt_bytes(rep['slab_bytes'])}"
        )
        say(
            f"  used             {rep['used_slots']} / {rep['total_slots']} slots "
            f"({rep['fill']:.1%}); {rep['blocks']} valid blocks, payload "
            f"{fmt_bytes(rep['payload_bytes'])} (raw {fmt_bytes(rep['raw_bytes'])})"
        )
        if rep["after_reset_blocks"]:
            say(
                f"  after a reset    {rep['after_reset_blocks']} of the valid "
                "blocks were written after a connector reset: a restart never "
                "adopts them (their weights may have changed)"
            )
        say(
            "  slot headers     "
            + ", ".join(f"{k} {v}" for k, v in rep["outcomes"].items())
        )
        for fp, n in rep["fingerprints"].items():
            say(f"  fingerprint      {fp} x{n}")
        for w in rep["warnings"]:
            say(f"  warning          {w}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from kvtier.store.slabs import find_stores

    try:
        views = find_stores(args.paths)
        total = sum(v.num_slots for v in views)
        with progress_bar(not args.json, total, "verify", "slot") as tick:
            reports = [verify_store(v, progress=tick) for v in views]
    except (OSError, ValueError) as exc:
        print(f"kvtier verify: {exc}", file=sys.stderr)
        return 2
    nbad = sum(len(r["bad"]) for r in reports)
    # A slab cut short lost the blocks past its end: damage, as a bad slot.
    nshort = sum(len(r["short_slabs"]) for r in reports)

    if args.json:
        emit_json(
            {
                "ok": nbad == 0 and nshort == 0,
                "bad_slots": nbad,
                "short_slabs": nshort,
                "stores": reports,
            }
        )
    else:
        for rep in reports:
            say(
                f"{rep['store']}: {rep['checked']} used slots checked, {rep['ok']} ok, "
                f"{len(rep['bad'])} bad"
                + (
                    f", {len(rep['short_slabs'])} slab(s) cut short (see below)"
                    if rep["short_slabs"]
                    else ""
                )
            )
            for b in rep["bad"]:
                say(
                    f"  slot {b['slot']}: {b['reason']}"
                    + (f" ({b['detail']})" if b.get("detail") else "")
                    + (
                        f" [{b['slab']} local slot {b['local_slot']}]"
                        if "slab" in b
                        else ""
                    )
                )
            for w in rep["warnings"]:
                say(f"  warning: {w}")
    return 1 if nbad or nshort else 0
