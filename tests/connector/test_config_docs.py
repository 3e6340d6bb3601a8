"""docs/configuration.md is generated from the code and stays in step with it.

It must mention every key of the schema and every kvtier metric, and
re-running scripts/gen_config_docs.py must reproduce it byte for byte.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvtier.connector.config import KEYS

pytest.importorskip("vllm")  # the metric definitions are vLLM types

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "configuration.md"
GENERATOR = REPO_ROOT / "scripts" / "gen_config_docs.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def doc_text() -> str:
    return DOC.read_text()


def test_every_key_is_documented(doc_text: str) -> None:
    from kvtier.connector.config import TIER_KEYS

    missing = [k.name for k in (*KEYS, *TIER_KEYS) if f"`{k.name}`" not in doc_text]
    assert not missing, f"undocumented keys: {missing}"


def test_every_metric_is_documented(doc_text: str) -> None:
    from kvtier.connector.metrics import metric_definitions

    names = list(metric_definitions())
    assert names
    missing = [n for n in names if n not in doc_text]
    assert not missing, f"undocumented metrics: {missing}"


def test_generator_reproduces_the_file(doc_text: str) -> None:
    rendered = _generator().render()
    assert rendered == doc_text, (
        "docs/configuration.md is stale: run "
        ".venv/bin/python scripts/gen_config_docs.py"
    )


def test_generator_check_mode(tmp_path: Path) -> None:
    gen = _generator()
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n")
    assert gen.main(["--check", "--out", str(stale)]) == 1
    assert gen.main(["--out", str(stale)]) == 0
    assert gen.main(["--check", "--out", str(stale)]) == 0


def _documented_defaults(doc_text: str, heading: str) -> dict[str, object]:
    """key -> the default the table under ``heading`` shows (JSON values
    only: "required" and "—" say there is none to give)."""
    import json
    import re

    table = doc_text.split(heading, 1)[1].split("\n## ", 1)[0]
    out = {}
    for m in re.finditer(r"^\| `(\w+)` \| `([^`]*)` \|", table, re.M):
        out[m.group(1)] = json.loads(m.group(2))
    assert out, heading
    return out


def test_documented_defaults_are_the_defaults(doc_text: str) -> None:
    """Writing a key's documented default gives the config that leaving
    the key out gives: an operator copies the table's value into a config
    file (a default of ``[]`` for disk_path was refused as an empty list,
    and as a path without a disk budget)."""
    from kvtier.connector.config import parse_extra_config, parse_tier_config

    base = {"cpu_bytes_to_use": 1 << 30}
    for key, value in _documented_defaults(doc_text, "## Keys").items():
        assert parse_extra_config({**base, key: value}) == parse_extra_config(base), key
    entry = {"disk_bytes_to_use": 1 << 30, "disk_path": "/mnt/nvme0/kvtier"}
    tier = _documented_defaults(doc_text, "## The `KvtierDiskTier` entry")
    for key, value in tier.items():
        got = parse_tier_config({**entry, key: value})
        assert got == parse_tier_config(entry), key
