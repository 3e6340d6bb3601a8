"""``kvtier inspect`` and ``kvtier verify``: read-only disk store checks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from kvtier.tools.commands.common import emit_json, fmt_bytes, progress_bar


def _open_views(paths: Sequence[str], cmd: str) -> list[Any] | None:
    from kvtier.store.slabs import find_stores

    try:
        return find_stores(paths)
    except (OSError, ValueError) as exc:
        print(f"kvtier {cmd}: {exc}", file=sys.stderr)
        return None


def cmd_inspect(args: argparse.Namespace) -> int:
    from kvtier.store.inspect import inspect_store

    views = _open_views(args.paths, "inspect")
    if views is None:
        return 2
    try:
        reports = [inspect_store(v) for v in views]
    except (OSError, ValueError) as exc:  # a slab swapped for a FIFO since
        print(f"kvtier inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        emit_json({"stores": reports})
        return 0
    for rep in reports:
        print(f"store {rep['store']}")
        for d in rep["directories"]:
            print(f"  directory        {d}")
        layout = rep["layout"] or {}
        if layout:
            desc = ", ".join(
                f"{k}={layout[k]}"
                for k in (
                    "model",
                    "dtype",
                    "block_bytes",
                    "geometry",
                    "tp_rank",
                    "tp_size",
                )
                if k in layout
            )
            print(f"  layout           {desc}")
            print(f"  digest           {layout.get('digest')}")
            if layout.get("model_id"):
                print(f"  model_id         {layout['model_id']}")
            if layout.get("identity"):
                ident = ", ".join(f"{k}={v}" for k, v in layout["identity"].items())
                print(f"  identity         {ident}")
        versions = ", ".join(
            f"v{v} x{n}" for v, n in rep["header_format_versions"].items()
        )
        print(
            f"  format version   {rep['format_version']} (layout.json); "
            f"headers: {versions or 'none'}; this kvtier reads v{rep['reader_format_version']}"
        )
        print(
            f"  slabs            {len(rep['slabs'])} file(s), {rep['total_slots']} slots "
            f"x {rep['slot_size']} B = {fmt_bytes(rep['slab_bytes'])}"
        )
        print(
            f"  used             {rep['used_slots']} / {rep['total_slots']} slots "
            f"({rep['fill']:.1%}); {rep['blocks']} valid blocks, payload "
            f"{fmt_bytes(rep['payload_bytes'])} (raw {fmt_bytes(rep['raw_bytes'])})"
        )
        print(
            "  slot headers     "
            + ", ".join(f"{k} {v}" for k, v in rep["outcomes"].items())
        )
        for fp, n in rep["fingerprints"].items():
            print(f"  fingerprint      {fp} x{n}")
        for w in rep["warnings"]:
            print(f"  warning          {w}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from kvtier.store.inspect import verify_store

    views = _open_views(args.paths, "verify")
    if views is None:
        return 2
    total = sum(v.num_slots for v in views)
    try:
        with progress_bar(not args.json, total, "verify", "slot") as tick:
            reports = [verify_store(v, progress=tick) for v in views]
    except (OSError, ValueError) as exc:
        print(f"kvtier verify: {exc}", file=sys.stderr)
        return 2
    nbad = sum(len(r["bad"]) for r in reports)
    if args.json:
        emit_json({"ok": nbad == 0, "bad_slots": nbad, "stores": reports})
    else:
        for rep in reports:
            print(
                f"{rep['store']}: {rep['checked']} used slots checked, {rep['ok']} ok, "
                f"{len(rep['bad'])} bad"
            )
            for b in rep["bad"]:
                print(
                    f"  slot {b['slot']}: {b['reason']}"
                    + (f" ({b['detail']})" if b.get("detail") else "")
                    + (
                        f" [{b['slab']} local slot {b['local_slot']}]"
                        if "slab" in b
                        else ""
                    )
                )
            for w in rep["warnings"]:
                print(f"  warning: {w}")
    return 1 if nbad else 0
