"""Byte sizes as operators write them, read by vLLM's rule.

vLLM reads ``64G`` as 64 GiB and ``64g`` as 64 GB (its
``vllm.utils.argparse_utils.human_readable_int``: ``K/M/G/T`` binary,
``k/m/g/t`` decimal, a fraction only with a decimal suffix), in its flags
and in the bare tokens of a JSON flag such as ``--kv-transfer-config``. kvtier
reads every size the same way, so one text means one number everywhere: the
``kvtier`` command line and the size keys of the connector config. On top of
vLLM's suffixes it accepts units spelled out, ``KiB/MiB/GiB/TiB`` (binary)
and ``kB/MB/GB/TB`` (decimal), in any case.

No vLLM import: the command line uses this without vLLM installed.
"""

from __future__ import annotations

import re

# One line for --help texts and error messages.
SIZE_RULE = (
    "bytes, or a number with a unit: K/M/G/T are binary (64G = 64 GiB), "
    "k/m/g/t decimal (64g = 64 GB), as vLLM reads sizes; KiB/MiB/GiB/TiB and "
    "kB/MB/GB/TB spelled out"
)

# More than any budget, small enough for exact arithmetic.
MAX_SIZE = 1 << 70

_EXPONENT = {"k": 1, "m": 2, "g": 3, "t": 4}
_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
_LETTER = re.compile(_NUMBER + r"([kKmMgGtT])")
_SPELLED = re.compile(_NUMBER + r"([kmgt])(i?)b", re.IGNORECASE)
_PLAIN = re.compile(r"[+-]?[0-9]+")
# vLLM's _expand_json_human_readable_numbers: bare tokens outside strings.
_JSON_STRING = re.compile(r'("(?:[^"\\]|\\.)*")')
_BARE_TOKEN = re.compile(r"\b[0-9]+(?:\.[0-9]+)?[kKmMgGtT]\b")


class NotASize(ValueError):
    """Text that is no size at all (not a number, an unknown unit); the
    message states the rule."""


def parse_size(text: str) -> int:
    """The number of bytes ``text`` names (see the module docstring); a
    plain integer is bytes and may be negative (callers check ranges).
    Raises :class:`NotASize`, or ValueError for a size vLLM refuses too
    (``1.5G``) or one too large."""
    value = text.strip()
    if len(value) > 64:  # before int(): no parsing of megabyte numbers
        if _PLAIN.fullmatch(value):
            raise ValueError(f"byte size too large: {quoted(value)}")
        raise NotASize(f"not a byte size: {quoted(value)} (too long)")
    if _PLAIN.fullmatch(value):
        return _checked(int(value), value)
    m = _LETTER.fullmatch(value)
    if m is not None:
        number, suffix = m.groups()
        return _scaled(number, suffix.lower(), binary=suffix.isupper(), text=value)
    m = _SPELLED.fullmatch(value)
    if m is not None:
        number, unit, binary = m.groups()
        return _scaled(number, unit.lower(), binary=bool(binary), text=value)
    raise NotASize(f"not a byte size: {quoted(value)}; give {SIZE_RULE}")


def _scaled(number: str, unit: str, *, binary: bool, text: str) -> int:
    exponent = _EXPONENT[unit]
    if binary:
        if "." in number:
            # vLLM's words: a binary multiple of a fraction is refused.
            raise ValueError(
                f"{text!r}: decimals are not allowed with binary units; did you "
                f"mean {number}{unit} (decimal), or a whole number of a smaller "
                "binary unit?"
            )
        return _checked(int(number) * 1024**exponent, text)
    # As vLLM computes it (int of a float), so both read the same number.
    scaled = float(number) * 1000**exponent
    if scaled > MAX_SIZE:
        raise ValueError(f"byte size too large: {quoted(text)}")
    return int(scaled)


def _checked(n: int, text: str) -> int:
    if abs(n) > MAX_SIZE:
        raise ValueError(f"byte size too large: {quoted(text)}")
    return n


def quoted(text: str, n: int = 40) -> str:
    """``text`` for an error message: quoted, cut after ``n`` characters."""
    return repr(text) if len(text) <= n else repr(text[:n]) + "..."


def expand_bare_sizes(json_text: str) -> str:
    """``json_text`` with each bare size token outside its strings (``64G``,
    ``80m``) replaced by its number of bytes: what vLLM does to a JSON flag
    such as ``--kv-transfer-config`` before parsing it. Raises ValueError
    for a token vLLM refuses (``1.5G``)."""
    parts = _JSON_STRING.split(json_text)
    for i in range(0, len(parts), 2):  # even indices: outside strings
        parts[i] = _BARE_TOKEN.sub(lambda m: str(parse_size(m.group())), parts[i])
    return "".join(parts)
