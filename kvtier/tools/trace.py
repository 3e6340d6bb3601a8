"""Mooncake-format traces: reading and validating them (``kvtier size``).

One JSON object per line: ``timestamp`` in ms, ``input_length``,
``output_length``, ``hash_ids``: prefix hashes of 512-token blocks, where an
id covers its block and everything before it. No vLLM import; pure Python.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.safe_open import NotRegularFileError, open_regular

TOKENS_PER_TRACE_BLOCK = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a Mooncake trace."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


# Input bounds for trace files: a line holds the prefix hashes of one request
# (about 10 bytes per 512-token block), so 4 MiB is ~200 M tokens.
MAX_TRACE_LINE_BYTES = 4 << 20
MAX_TRACE_BYTES = 4 << 30
# Hash ids are unsigned 64-bit integers (benchmarks turn them into 32-byte
# keys with ``int.to_bytes``, which refuses negatives).
_HASH_MAX = (1 << 64) - 1
_LENGTH_MAX = (1 << 63) - 1


class TraceError(ValueError):
    """A trace file that cannot be read; the message names file and line."""


def _int_field(obj: Mapping[str, Any], name: str) -> int:
    v = obj.get(name, 0)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name!r} must be an integer, got {v!r:.40}")
    if not 0 <= v <= _LENGTH_MAX:
        raise ValueError(f"{name!r} out of range: {v!r:.40}")
    return v


def parse_request(obj: Mapping[str, Any]) -> TraceRequest:
    """A :class:`TraceRequest` from one decoded trace line.

    Raises ValueError for anything that is not a trace record: a non-object,
    missing or non-list ``hash_ids``, a hash id that is not a 64-bit integer
    (``1e400``, ``"12"``, ``3.0``, ``true``), or a non-numeric timestamp.
    """
    if not isinstance(obj, Mapping):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "hash_ids" not in obj:
        raise ValueError("trace line has no 'hash_ids'")
    raw = obj["hash_ids"]
    if not isinstance(raw, list):
        raise ValueError(f"'hash_ids' must be a list, got {type(raw).__name__}")
    for i, h in enumerate(raw):
        if isinstance(h, bool) or not isinstance(h, int):
            raise ValueError(f"hash id #{i} is not an integer: {h!r:.40}")
        if not 0 <= h <= _HASH_MAX:
            raise ValueError(f"hash id #{i} is not in [0, 2**64): {h!r:.40}")
    ts = obj.get("timestamp", 0.0)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise ValueError(f"'timestamp' must be a number, got {ts!r:.40}")
    try:
        timestamp = float(ts)
    except OverflowError:
        raise ValueError(f"'timestamp' out of range: {ts!r:.40}") from None
    if not math.isfinite(timestamp):
        raise ValueError(f"'timestamp' must be finite, got {ts!r:.40}")
    return TraceRequest(
        timestamp=timestamp,
        input_length=_int_field(obj, "input_length"),
        output_length=_int_field(obj, "output_length"),
        hash_ids=tuple(raw),
    )


def _open_trace(path: str | os.PathLike[str]) -> Any:
    """A binary reader for a trace, which must be a regular file (a link to
    one is followed): devices (``/dev/zero``), FIFOs and directories are
    refused, and opening never blocks (:func:`~kvtier.safe_open.open_regular`)."""
    try:
        fd, st = open_regular(path, follow_links=True)
    except NotRegularFileError as exc:
        if exc.kind == "directory":
            raise TraceError(f"{path}: is a directory, not a trace file") from None
        raise TraceError(f"{path}: is a {exc.kind}, not a regular trace file") from None
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror or exc}") from None
    try:
        if st.st_size > MAX_TRACE_BYTES:
            raise TraceError(
                f"{path}: {st.st_size} bytes, more than the {MAX_TRACE_BYTES} "
                "a trace may have"
            )
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def load_trace(
    path: str | os.PathLike[str], limit: int | None = None
) -> list[TraceRequest]:
    """Read a JSONL trace (blank lines skipped); at most ``limit`` requests.

    Raises :class:`TraceError` (a ValueError) naming the file and line for
    anything that is not a trace: not a regular file, a line longer than
    MAX_TRACE_LINE_BYTES (``/dev/zero``-like input has no newlines), more
    than MAX_TRACE_BYTES in all, invalid JSON or a bad record (see
    :func:`parse_request`), or no request at all.
    """
    requests: list[TraceRequest] = []
    total = 0
    with _open_trace(path) as f:
        lineno = 0
        while limit is None or len(requests) < limit:
            raw = f.readline(MAX_TRACE_LINE_BYTES + 1)
            if not raw:
                break
            lineno += 1
            total += len(raw)
            if len(raw) > MAX_TRACE_LINE_BYTES:
                raise TraceError(
                    f"{path}:{lineno}: line longer than {MAX_TRACE_LINE_BYTES} "
                    "bytes (not a JSONL trace?)"
                )
            if total > MAX_TRACE_BYTES:
                raise TraceError(
                    f"{path}:{lineno}: more than {MAX_TRACE_BYTES} bytes of trace"
                )
            line = raw.strip()
            if not line:
                continue
            try:
                requests.append(parse_request(json.loads(line)))
            except RecursionError:
                raise TraceError(f"{path}:{lineno}: JSON nested too deeply") from None
            except (ValueError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: {exc}") from None
    if not requests:
        raise TraceError(f"{path}: no trace records (empty file?)")
    return requests


def request_keys(req: TraceRequest | Sequence[Hashable]) -> Sequence[Hashable]:
    return req.hash_ids if isinstance(req, TraceRequest) else req


def infinite_cache_hit_rate(
    requests: Iterable[TraceRequest | Sequence[Hashable]],
) -> float:
    """Block-level hit rate of a cache that never evicts: every block seen
    earlier in the trace is a hit (with prefix hashes, exactly what a
    never-evicting prefix cache gets)."""
    seen: set[Hashable] = set()
    hits = total = 0
    for req in requests:
        keys = request_keys(req)
        total += len(keys)
        hits += sum(1 for k in keys if k in seen)
        seen.update(keys)
    return hits / total if total else 0.0


def unique_blocks(requests: Iterable[TraceRequest]) -> int:
    """Distinct blocks in the trace (the capacity that never evicts)."""
    seen: set[Hashable] = set()
    for req in requests:
        seen.update(request_keys(req))
    return len(seen)
