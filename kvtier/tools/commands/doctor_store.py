"""``kvtier doctor``: would an existing store at the disk paths be adopted?

A warm restart adopts the store directory ``kvtier-<digest>`` whose layout
fingerprint equals the new engine's; any other store is set aside (left on
disk, its space not counted as free). The doctor cannot derive the whole
fingerprint without building vLLM's config (the KV geometry comes from the
model's attention layers), so it compares the part an operator changes by
accident: the model name and the identity of its contents
(:func:`kvtier.connector.identity.model_identity`), which a replaced
checkpoint changes. A hub id's contents are those of the snapshot the
engine would load: ``--revision`` and ``--download-dir``, as given to
``vllm serve``, pick it as they pick the engine's.

:func:`check_stores` lists stores only through
:func:`kvtier.store.slabs.find_stores` (layout.json) and
:data:`~kvtier.store.slabs.STORE_DIR_RE`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.connector.preflight import allocated_bytes
from kvtier.safe_open import check_owned, lock_holders
from kvtier.tools.commands.common import fmt_bytes, visible
from kvtier.tools.commands.doctor import ERROR, OK, WARNING, Check

if TYPE_CHECKING:
    from kvtier.connector.identity import ModelSource


def _contents(layout: dict) -> str | None:
    """The model-contents digest a store was written for: layout.json's
    ``identity.contents``; a store from before the settings identity has
    only ``model_id``, which was that digest."""
    ident = layout.get("identity") or {}
    return ident.get("contents") or (layout.get("model_id") if not ident else None)


def _settings(layout: dict) -> str:
    """The settings a store's ``layout.json`` records, for a line: its
    strings are the file's (planted, in a shared disk path), so control
    characters are shown, never sent to the operator's terminal."""
    ident = layout.get("identity") or {}
    shown = {k: v for k, v in ident.items() if k not in ("contents", "settings")}
    return visible(", ".join(f"{k}={v}" for k, v in sorted(shown.items()))) or (
        "not recorded"
    )


def _verdict(
    layout: dict, model: ModelSource | None, contents_of: Callable[[str], str]
) -> tuple[str, str]:
    """(status, "<verdict>: <reason>") of a store whose layout.json is
    ``layout``, for a config serving ``model`` whose contents digest at a KV
    dtype is ``contents_of(dtype)``: adopted on an identity match, else set
    aside (unknown without ``model``)."""
    name = layout.get("model")
    if model is None:
        return OK, f"model {name!r}; pass --model to tell whether it would be adopted"
    if name != model.name:
        return WARNING, f"set aside: written for another model ({name!r})"
    ident = layout.get("identity")
    if ident is not None and not isinstance(ident, dict):
        # layout.json is the store's, not to be trusted; the engine adopts by
        # the fingerprint in the slots' headers, which this cannot predict.
        return WARNING, (
            f"unknown: its layout.json's identity is {ident!r:.80}, not an object "
            "(damaged, or not kvtier's); the engine adopts it only if its slots "
            "carry this config's fingerprint"
        )
    contents = _contents(layout)
    if contents and contents != contents_of(str(layout.get("dtype", ""))):
        return WARNING, (
            "set aside: the model's files changed since it was written (another "
            "checkpoint at the same path)"
        )
    return OK, (
        "adopted: same model and contents; adopted if the settings that change "
        f"KV (dtype, hf_overrides, quantization, kv_cache_dtype: {_settings(layout)}"
        ") and the KV layout (block_size, TP size) are unchanged too"
    )


def _not_ours(view: Any) -> str | None:
    """Why the engine would refuse to open store ``view`` (its directories
    and slabs must pass :func:`kvtier.safe_open.check_owned`: this user's,
    not writable by group or others), or None. Such a store, e.g. one
    another user planted in a shared disk path, is never adopted: the
    engine whose layout it is named for refuses to start."""
    objects = [(d, True) for d in view.dirs] + [(s.path, False) for s in view.slabs]
    for path, directory in objects:
        try:
            st = os.lstat(path)
        except OSError:
            continue  # gone meanwhile: nothing the engine would refuse
        try:
            check_owned(st, path, directory)
        except OSError as exc:
            return visible(exc.strerror or str(exc))
    return None


def _in_use(view: Any) -> str | None:
    """Who holds store ``view``'s lock (a running engine: its directories'
    ``flock``, from /proc/locks), or None. Read without taking the lock,
    so an engine starting meanwhile is never refused because of the
    doctor; where /proc/locks cannot tell (no /proc, or a holder in
    another PID namespace, which it does not show), None."""
    for d in view.dirs:
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            held = lock_holders(fd)
        finally:
            os.close(fd)
        if held:
            return held.strip()
    return None


def _find(paths: Sequence[str]) -> list:
    """The stores under ``paths`` (:class:`~kvtier.store.slabs.SlabFiles`).
    Raises OSError/ValueError for a store that cannot be read safely."""
    from kvtier.store.slabs import STORE_DIR_RE, find_stores

    with_stores = [
        p
        for p in paths
        if os.path.isdir(p) and any(STORE_DIR_RE.match(n) for n in os.listdir(p))
    ]
    return find_stores(with_stores) if with_stores else []


def check_stores(
    paths: Sequence[str],
    model: str | None,
    revision: str | None = None,
    download_dir: str | None = None,
) -> tuple[list[Check], dict[str, list[str]]]:
    """One check per store under ``paths``: whether a config serving
    ``model`` (at ``revision`` in ``download_dir``, as vLLM takes them)
    would adopt it (identity match) or set it aside; and per disk path the
    store directory names a restart would reuse (their space counts as
    available)."""
    from kvtier.connector.identity import ModelSource, model_identity

    try:
        views = _find(paths)
        source = None
        if model is not None and views:  # one lookup, as at engine start
            source = ModelSource.resolve(model, revision, download_dir)

        @functools.cache
        def contents_of(dtype: str) -> str:  # the model's files read once
            assert source is not None
            return model_identity(source, kv_cache_dtype=dtype)

        verdicts = [_verdict(view.layout or {}, source, contents_of) for view in views]
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
    if not views:
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
    for view, (status, verdict) in zip(views, verdicts):
        subject = f"store {view.name}"
        foreign = _not_ours(view)
        if foreign is not None:
            # Written for this model and its contents, it is most likely
            # the store of this engine's layout, whose name the engine
            # opens and refuses: an error (the KV layout, which the doctor
            # cannot derive, could still differ: then the fix, a private
            # disk_path, costs nothing). For another model, a warning.
            mine = model is not None and status == OK
            out.append(
                Check(
                    "warm-restart",
                    subject,
                    ERROR if mine else WARNING,
                    f"not adopted: {foreign}; the engine refuses to open it, and "
                    "to start if it is the store of the engine's layout"
                    + (
                        " (written for this model and its contents, so it "
                        "most likely is)"
                        if mine
                        else ""
                    ),
                    f"remove {' '.join(view.dirs)} after checking it (another "
                    "user may have placed it there), or use a disk_path only "
                    "this user can write",
                )
            )
            continue
        held = _in_use(view)
        if held is not None and model is not None and status == OK:
            # This model's store, so most likely this engine's layout (as
            # above): a second engine on it is refused at start.
            out.append(
                Check(
                    "warm-restart",
                    subject,
                    ERROR,
                    f"in use by a running kvtier engine {held}: an engine with "
                    "this model and layout on this disk_path is refused at "
                    "start (InUseError)",
                    "stop that engine first, or give this one its own disk_path",
                )
            )
            continue
        if held is not None:
            verdict += f"; in use by a running kvtier engine {held}"
        if model is None:
            out.append(Check("warm-restart", subject, status, verdict))
            continue
        detail = f"{verdict}; {fmt_bytes(sum(map(allocated_bytes, view.dirs)))} on disk"
        if status == OK:
            for d in view.dirs:
                reusable.setdefault(os.path.dirname(d), []).append(view.name)
            out.append(Check("warm-restart", subject, OK, detail))
        else:
            out.append(
                Check(
                    "warm-restart",
                    subject,
                    WARNING,
                    detail + " (not reusable, not counted as free)",
                    f"remove {' '.join(view.dirs)} once no engine needs it",
                )
            )
    return out, reusable
