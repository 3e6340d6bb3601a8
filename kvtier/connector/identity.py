"""A cheap identity of a model's contents, for the disk tier's namespace.

The layout fingerprint used to name the model by its path only, so a
checkpoint replaced at the same path (a fine-tune copied over the base, a
re-downloaded revision) would be served the old checkpoint's KV blocks after
a warm restart. :func:`model_identity` hashes what changes when the weights
change, without reading any weights:

- the model's ``config.json`` (contents);
- its weight index files (``*.index.json``, contents);
- every weight file's name, size and ``mtime_ns`` (one ``stat`` each), plus
  the link target for Hugging Face cache snapshots (whose blob names are
  content hashes).

A hub id that is not a local directory falls back to the Hugging Face cache
snapshot it resolves to (offline, no download), else to the name alone.

No vLLM import.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

logger = logging.getLogger("kvtier.connector")

CONFIG_FILES = ("config.json",)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5")
INDEX_SUFFIX = ".index.json"
# Small files hashed by content; anything bigger is described by stat only.
_MAX_HASHED_BYTES = 16 << 20


def resolve_model_dir(model: str) -> str | None:
    """The local directory holding ``model``: the path itself, or the Hugging
    Face cache snapshot a hub id resolves to (offline). None if neither."""
    if os.path.isdir(model):
        return os.path.realpath(model)
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json")
    except Exception as exc:  # not a valid repo id, no hub library, ...
        logger.debug("no HF cache snapshot for %r: %r", model, exc)
        return None
    if isinstance(found, str) and os.path.isfile(found):
        return os.path.dirname(found)
    return None


def _describe_files(root: str) -> dict[str, Any]:
    files: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            hashed = name in CONFIG_FILES or name.endswith(INDEX_SUFFIX)
            if not hashed and not name.endswith(WEIGHT_SUFFIXES):
                continue
            try:
                st = os.stat(path)
            except OSError as exc:
                files[rel] = {"error": exc.errno}
                continue
            entry: dict[str, Any] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
            if os.path.islink(path):
                # HF cache: snapshots link to blobs named by their hash.
                entry["target"] = os.path.basename(os.readlink(path))
            if hashed and st.st_size <= _MAX_HASHED_BYTES:
                try:
                    with open(path, "rb") as f:
                        entry["blake2b"] = hashlib.blake2b(
                            f.read(), digest_size=16
                        ).hexdigest()
                except OSError as exc:
                    entry["error"] = exc.errno
            files[rel] = entry
    return files


def model_identity(model: str, dtype: str = "", kv_cache_dtype: str = "") -> str:
    """A 32-hex-digit identity of ``model``'s contents (plus the dtypes).

    Changes when ``config.json`` or a weight index changes, or when a weight
    file is added, removed, resized or rewritten (its mtime changes); reads
    no weight data. For a name that resolves to no local directory the
    identity covers the name only (and says so)."""
    root = resolve_model_dir(model)
    doc: dict[str, Any] = {
        "name": model,
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype,
    }
    if root is None:
        doc["files"] = "unresolved"
    else:
        doc["files"] = _describe_files(root)
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(
        canonical, digest_size=16, person=b"kvtier-model"
    ).hexdigest()


def namespace(config: Any) -> dict[str, Any]:
    """``LayoutFingerprint`` keyword arguments beyond the layout, from vLLM's
    ``OffloadingConfig`` (duck-typed): the model's content identity (with
    its KV-cache dtype) and the data-parallel rank, so DP replicas sharing
    one config (and one disk_path) get separate store directories."""
    par = config.parallel
    dp_rank = getattr(par, "data_parallel_index", None)
    if dp_rank is None:
        dp_rank = getattr(par, "data_parallel_rank", 0) or 0
    return {
        "model_id": model_identity(
            config.model.name, kv_cache_dtype=str(config.model.dtype)
        ),
        "dp_rank": int(dp_rank),
    }
