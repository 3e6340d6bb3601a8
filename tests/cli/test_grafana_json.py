"""docs/grafana-kvtier.json is an importable Grafana dashboard: unique
panel ids, one data source variable that every panel and query uses (no
import input beside it), no overlapping panels, every query a PromQL
expression over vLLM's series. (That every series is exported is
tests/e2e/test_grafana_dashboard.py, against a live server in each mode.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-kvtier.json"


def test_dashboard_structure():
    doc = json.loads(DASHBOARD.read_text())
    # The data source is the variable, picked at import or later; an import
    # input no panel used would only mislead (docs/operations.md's example
    # passes none).
    assert "__inputs" not in doc
    assert "DS_PROMETHEUS" not in DASHBOARD.read_text()
    panels = doc["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    cells: set[tuple[int, int]] = set()
    titles = []
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        mine = {
            (x, y)
            for x in range(g["x"], g["x"] + g["w"])
            for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        titles.append(p["title"])
        assert p["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and refs
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            assert re.search(r"vllm:[a-z_]+", t["expr"]), t["expr"]
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    for needed in (
        "occupancy",
        "source",
        "Load bandwidth",
        "spill",
        "Queue",
        "corrupt",
        "read latency",
        "Tiering: bandwidth",
    ):
        assert any(needed.lower() in t.lower() for t in titles), needed
    # The disk-read latency distribution, as its median and tail.
    exprs = [t["expr"] for p in panels if p["type"] != "row" for t in p["targets"]]
    for q in ("0.5", "0.99"):
        assert any(
            e.startswith(f"histogram_quantile({q}, ")
            and "vllm:kv_offload_kvtier_read_latency_seconds_bucket" in e
            for e in exprs
        ), q


def test_vllm_series_exist_in_vllm_033_too():
    """The dashboard's vLLM-owned series are named in vLLM 0.33's sources as
    well (the live test runs 0.32); kvtier's own come from kvtier."""
    import os

    import pytest

    tree = Path(
        os.environ.get("KVTIER_VLLM_NEXT_TREE")
        or Path(__file__).resolve().parents[2] / ".vllm-0.33"
    )
    if not (tree / "vllm").is_dir():
        pytest.skip(f"no vLLM 0.33 tree at {tree} (make vllm-next)")
    sources = "".join(
        (tree / "vllm" / rel).read_text()
        for rel in (
            "v1/metrics/loggers.py",
            "distributed/kv_transfer/kv_connector/v1/offloading/metrics.py",
            "v1/kv_offload/tiering/base.py",
        )
    )
    names = set(re.findall(r"vllm:[A-Za-z0-9_:]+", DASHBOARD.read_text()))
    theirs = {n.removesuffix("_total") for n in names if "kv_offload_kvtier_" not in n}
    assert len(theirs) >= 14
    assert sorted(n for n in theirs if f'"{n}"' not in sources) == []
