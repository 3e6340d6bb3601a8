"""docs/grafana-kvtier.json is an importable Grafana dashboard: unique
panel ids, one data source variable, no overlapping panels, every query a
PromQL expression over vLLM's series. (That every series is exported is
tests/e2e/test_grafana_dashboard.py, against a live server.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-kvtier.json"


def test_dashboard_structure():
    doc = json.loads(DASHBOARD.read_text())
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
            assert re.search(r"vllm:[a-z_]+", t["expr"]), t["expr"]
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    for needed in (
        "occupancy",
        "source",
        "Load bandwidth",
        "spill",
        "Queue",
        "corrupt",
    ):
        assert any(needed.lower() in t.lower() for t in titles), needed
