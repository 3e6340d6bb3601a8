"""``kvtier doctor``: would an existing store at the disk paths be adopted?

A warm restart adopts the store directory ``kvtier-<digest>`` whose layout
fingerprint equals the new engine's; any other store is set aside (left on
disk, its space not counted as free). The doctor cannot derive the whole
fingerprint without building vLLM's config (the KV geometry comes from the
model's attention layers), so it compares the part an operator changes by
accident: the model name and the identity of its contents
(:func:`kvtier.connector.identity.model_identity`), which a replaced
checkpoint changes.

:func:`store_verdicts` is the one place that decides; it lists stores only
through :func:`kvtier.store.slabs.find_stores` (layout.json) and
:data:`~kvtier.store.slabs.STORE_DIR_RE`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.tools.commands.common import fmt_bytes
from kvtier.tools.commands.doctor import OK, WARNING, Check

ADOPTED, SET_ASIDE, UNKNOWN = "adopted", "set aside", "unknown"


@dataclass(frozen=True)
class StoreVerdict:
    """One store found at the disk paths and what this config would do."""

    name: str  # kvtier-<digest16>
    directories: tuple[str, ...]
    model: str | None
    verdict: str  # ADOPTED / SET_ASIDE / UNKNOWN
    reason: str
    bytes_on_disk: int


def _bytes_of(directories: Sequence[str]) -> int:
    total = 0
    for d in directories:
        for root, _dirs, files in os.walk(d, followlinks=False):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def _contents(layout: dict) -> str | None:
    """The model-contents digest a store was written for: layout.json's
    ``identity.contents``; a store from before the settings identity has
    only ``model_id``, which was that digest."""
    ident = layout.get("identity") or {}
    return ident.get("contents") or (layout.get("model_id") if not ident else None)


def _settings(layout: dict) -> str:
    ident = layout.get("identity") or {}
    shown = {k: v for k, v in ident.items() if k not in ("contents", "settings")}
    return ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) or "not recorded"


def store_verdicts(paths: Sequence[str], model: str | None) -> list[StoreVerdict]:
    """The stores under ``paths`` and whether a config serving ``model``
    would adopt them (identity match) or set them aside. Raises
    OSError/ValueError for a store that cannot be read safely."""
    from kvtier.connector.identity import model_identity
    from kvtier.store.slabs import STORE_DIR_RE, find_stores

    with_stores = [
        p
        for p in paths
        if os.path.isdir(p) and any(STORE_DIR_RE.match(n) for n in os.listdir(p))
    ]
    if not with_stores:
        return []
    out: list[StoreVerdict] = []
    for view in find_stores(with_stores):
        layout = view.layout or {}
        name = layout.get("model")
        size = _bytes_of(view.dirs)
        if model is None:
            verdict, reason = (
                UNKNOWN,
                "pass --model to tell whether it would be adopted",
            )
        elif name != model:
            verdict, reason = SET_ASIDE, f"written for another model ({name!r})"
        elif _contents(layout) and _contents(layout) != model_identity(
            model, kv_cache_dtype=str(layout.get("dtype", ""))
        ):
            verdict, reason = (
                SET_ASIDE,
                "the model's files changed since it was written (another "
                "checkpoint at the same path)",
            )
        else:
            verdict, reason = (
                ADOPTED,
                "same model and contents; adopted if the settings that change "
                "KV (dtype, hf_overrides, quantization, kv_cache_dtype: "
                + _settings(layout)
                + ") and the KV layout (block_size, TP size) are unchanged too",
            )
        out.append(
            StoreVerdict(
                view.name, tuple(view.dirs), name, verdict, reason, size
            )
        )
    return out


def check_stores(
    paths: Sequence[str], model: str | None
) -> tuple[list[Check], dict[str, list[str]]]:
    """Checks, and per disk path the store directory names a restart would
    reuse (their space counts as available)."""
    try:
        verdicts = store_verdicts(paths, model)
    except (OSError, ValueError) as exc:
        return [
            Check(
                "warm-restart",
                "existing stores",
                WARNING,
                f"cannot read a store: {exc}",
                "kvtier inspect <disk_path> shows it; remove it if it is not kvtier's",
            )
        ], {}
    if not verdicts:
        return [
            Check(
                "warm-restart",
                "existing stores",
                OK,
                "none: the disk tier starts empty",
            )
        ], {}
    out: list[Check] = []
    reusable: dict[str, list[str]] = {}
    for v in verdicts:
        subject = f"store {v.name}"
        detail = f"{v.verdict}: {v.reason}; {fmt_bytes(v.bytes_on_disk)} on disk"
        if v.verdict == ADOPTED:
            for d in v.directories:
                reusable.setdefault(os.path.dirname(d), []).append(v.name)
            out.append(Check("warm-restart", subject, OK, detail))
        elif v.verdict == SET_ASIDE:
            out.append(
                Check(
                    "warm-restart",
                    subject,
                    WARNING,
                    detail + " (not reusable, not counted as free)",
                    f"remove {' '.join(v.directories)} once no engine needs it",
                )
            )
        else:
            out.append(
                Check("warm-restart", subject, OK, f"model {v.model!r}; {v.reason}")
            )
    return out, reusable
