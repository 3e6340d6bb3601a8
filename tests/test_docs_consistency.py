"""What the operator docs point at exists.

Every log line README.md and docs/ quote with its level (``WARNING `...```,
``ERROR `...```, ``INFO `...```) is one kvtier logs, at that level; every
relative link names a file that exists, and a heading there for its anchor.

An operator greps the log for the words the troubleshooting and fault
tables give; a line the code no longer writes (or writes at another level)
sends them nowhere. The quoted text may shorten the message: ``...``,
``<name>``, a single capital letter (``N``) and numbers stand for the
variable parts; everything else must be the code's own words, in order.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]

QUOTED = re.compile(r"\b(WARNING|ERROR|INFO)(?: line)? `([^`]+)`")
# What a doc quote writes for a variable part (an errno name too).
DOC_HOLE = re.compile(r"\.\.\.|…|<[^>]*>|\b[A-Z]\b|\bE[A-Z]+\b|\b\d+(?:\.\d+)?\b")
# What a format string has for one.
CODE_HOLE = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdrfxg]|\x00")
LEVELS = {"warning": "WARNING", "error": "ERROR", "exception": "ERROR", "info": "INFO"}
# kvtier's helpers that log their message at a fixed level.
HELPERS = {"_log_once": "WARNING"}


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            v.value if isinstance(v, ast.Constant) else "\x00" for v in node.values
        )
    return None


def _call_level(call: ast.Call) -> str | None:
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name in LEVELS:
        return LEVELS[name]
    if name in HELPERS:
        return HELPERS[name]
    if name == "log" and call.args:
        first = ast.unparse(call.args[0])
        for level in ("ERROR", "WARNING", "INFO"):
            if level in first.split(" if ")[0]:
                return level
    return None


def _pieces() -> tuple[list[tuple[str | None, str]], str]:
    """(level or None, literal run between holes) of every string in
    kvtier/, the level being that of the logging call it is the message of."""
    out: list[tuple[str | None, str]] = []
    for path in sorted((REPO_ROOT / "kvtier").rglob("*.py")):
        tree = ast.parse(path.read_text())
        leveled: dict[int, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (level := _call_level(node)):
                for arg in node.args:
                    for sub in ast.walk(arg):
                        leveled[id(sub)] = level
        for node in ast.walk(tree):
            text = _text(node)
            if text is None:
                continue
            for piece in CODE_HOLE.split(text):
                if piece:
                    out.append((leveled.get(id(node)), piece))
    return out, "\n".join(p for _, p in out)


def _quotes() -> list[tuple[str, str, str]]:
    found = []
    for doc in DOCS:
        for m in QUOTED.finditer(doc.read_text()):
            found.append(
                (f"{doc.name}: {m.group(1)} {m.group(2)}", m.group(1), m.group(2))
            )
    return found


QUOTES = _quotes()


@pytest.fixture(scope="module")
def pieces() -> tuple[list[tuple[str | None, str]], str]:
    return _pieces()


def test_docs_quote_log_lines() -> None:
    assert len(QUOTES) >= 15, "the troubleshooting and fault tables quote log lines"


@pytest.mark.parametrize("where,level,quote", QUOTES, ids=[q[0][:80] for q in QUOTES])
def test_quoted_log_line_is_logged_at_its_level(
    pieces: tuple[list[tuple[str | None, str]], str], where: str, level: str, quote: str
) -> None:
    fragments = [f.strip() for f in DOC_HOLE.split(quote)]
    fragments = [f for f in fragments if f]
    assert fragments, where
    every = [p for _, p in pieces[0]]
    at_level = [p for lv, p in pieces[0] if lv == level]
    head = fragments[0]
    # The message's first words are the logging call's own (at its level);
    # a message may go on in text passed in for one of its holes.
    start = next(
        (
            len(head) - k
            for k in range(len(head))
            if any(head[: len(head) - k] in p for p in at_level)
        ),
        0,
    )
    assert start >= min(len(head), 8), (
        f"{where}: no {level} log call in kvtier/ says {head!r}"
    )
    rest = [head[start:].strip(), *fragments[1:]]
    for fragment in rest:
        if not fragment:
            continue
        # One hole of the code may take another literal: split the fragment
        # where one piece ends and the next begins.
        ok = fragment in pieces[1] or any(
            fragment[:i] in pieces[1] and fragment[i:].lstrip() in pieces[1]
            for i in range(4, len(fragment) - 3)
            if any(p.endswith(fragment[:i]) for p in every)
        )
        assert ok, f"{where}: kvtier/ has no message with {fragment!r}"


def _slugs(doc: Path) -> set[str]:
    """GitHub's anchors of ``doc``'s headings."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#+\s+(.*?)\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_and_anchors_resolve() -> None:
    broken = []
    for doc in DOCS:
        for m in re.finditer(r"\]\(([^)\s]+)\)", doc.read_text()):
            link = m.group(1)
            if re.match(r"[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (doc.parent / path) if path else doc
            if not target.exists():
                broken.append(f"{doc.name}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _slugs(target):
                broken.append(f"{doc.name}: {link} (no such heading)")
    assert not broken, broken
