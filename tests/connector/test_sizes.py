"""Byte sizes mean what they mean in vLLM: ``64G`` is 64 GiB, ``64g`` 64 GB.

``kvtier.connector.sizes`` is checked against vLLM's own
``human_readable_int`` and JSON expansion on generated inputs, so the two
cannot drift apart.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.connector.sizes import MAX_SIZE, expand_bare_sizes, parse_size

arg_utils = pytest.importorskip("vllm.engine.arg_utils")
vllm_args = pytest.importorskip("vllm.utils.argparse_utils")

GiB = 1 << 30


@pytest.mark.parametrize(
    "text,expected",
    [
        ("64G", 64 * GiB),
        ("64g", 64 * 10**9),
        ("64GiB", 64 * GiB),
        ("64gib", 64 * GiB),
        ("64GB", 64 * 10**9),
        ("64kB", 64_000),
        ("128KiB", 131072),
        ("1K", 1024),
        ("1k", 1000),
        ("25.6k", 25_600),
        ("1.5TB", 1_500_000_000_000),
        ("2T", 2 << 40),
        (" 4096 ", 4096),
        ("-5", -5),  # a number: the caller checks the range
        ("0", 0),
    ],
)
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("1.5G", "decimals are not allowed with binary units"),
        ("1.5GiB", "decimals are not allowed with binary units"),
        ("64 G", "not a byte size"),
        ("64P", "not a byte size"),
        ("1e9", "not a byte size"),
        ("lots", "K/M/G/T are binary"),
        ("", "not a byte size"),
        ("9" * 40 + "T", "too large"),
        ("9" * 100, "too large"),
        ("9" * 100 + "x", "too long"),
    ],
)
def test_not_sizes(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_size(text)


_tokens = st.builds(
    lambda whole, frac, suffix: f"{whole}{frac}{suffix}",
    st.integers(min_value=0, max_value=10**6).map(str),
    st.one_of(st.just(""), st.integers(0, 999).map(lambda f: f".{f}")),
    st.sampled_from(["", *"kKmMgGtT"]),
)


def _or_none(fn: Callable[[str], Any], text: str) -> Any:
    """``fn(text)``, or None where it refuses the text."""
    try:
        return fn(text)
    except (ValueError, argparse.ArgumentTypeError):  # vLLM raises either
        return None


@given(_tokens)
def test_same_number_as_vllm(text: str) -> None:
    ours = _or_none(parse_size, text)
    assert ours == _or_none(vllm_args.human_readable_int, text), text
    assert ours is None or abs(ours) <= MAX_SIZE


@given(st.lists(st.one_of(_tokens, st.sampled_from(['"64G"', ", ", ": ", "{", "}"]))))
def test_json_expansion_is_vllms(parts: list[str]) -> None:
    """The same text as vLLM's, except that a size over ``MAX_SIZE`` (joined
    tokens make long numbers) is refused where vLLM expands it."""
    text = "".join(parts)
    theirs = _or_none(arg_utils._expand_json_human_readable_numbers, text)
    ours = _or_none(expand_bare_sizes, text)
    if ours is None and theirs is not None:
        assert any(_too_large(t) for t in _BARE_TOKEN.findall(text)), text
    else:
        assert ours == theirs, text


def test_json_expansion_refuses_what_is_too_large() -> None:
    text = '{"cpu_bytes_to_use": 1180610000t}'  # > MAX_SIZE; vLLM expands it
    assert _or_none(arg_utils._expand_json_human_readable_numbers, text)
    with pytest.raises(ValueError, match="too large"):
        expand_bare_sizes(text)


_BARE_TOKEN = re.compile(r"\b[0-9]+(?:\.[0-9]+)?[kKmMgGtT]\b")  # as vLLM finds them


def _too_large(token: str) -> bool:
    try:
        parse_size(token)
    except ValueError as exc:
        return "too large" in str(exc)
    return False


def test_json_expansion_leaves_strings() -> None:
    text = '{"cpu_bytes_to_use": 64G, "disk_path": "/mnt/64G", "x": 2k}'
    assert expand_bare_sizes(text) == (
        f'{{"cpu_bytes_to_use": {64 * GiB}, "disk_path": "/mnt/64G", "x": 2000}}'
    )
