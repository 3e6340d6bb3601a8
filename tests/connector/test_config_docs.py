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
