"""Output helpers shared by the ``kvtier`` subcommands."""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

# C0 and C1 controls: ESC and CSI start a terminal's escape sequences.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """``text`` with its control characters shown as ``\\xNN``: for lines
    that carry what a store's files say (``layout.json``, headers), which an
    operator's terminal must not take for escape sequences (a store planted
    in a shared disk path could retitle or clear it)."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def say(line: str) -> None:
    """Print a line that carries what a store's files say (:func:`visible`)."""
    print(visible(line))


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@contextlib.contextmanager
def progress_bar(
    enabled: bool, total: int | None, desc: str, unit: str
) -> Iterator[Callable[[int], None] | None]:
    """The progress display of every long ``kvtier`` command (replays,
    sizing sweeps, ``verify``): a tqdm bar on stderr, counting ``unit``s
    up to ``total`` (None: unknown). Yields its ``update(n)``, or None, and
    shows nothing, when not ``enabled`` (callers pass ``not args.json``),
    when stderr is not a terminal, or without tqdm (the ``tools`` extra)."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield None
        return
    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)
    try:
        yield bar.update
    finally:
        bar.close()


def emit_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
