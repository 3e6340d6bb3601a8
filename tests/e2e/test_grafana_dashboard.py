"""docs/grafana-kvtier.json names only series a live server exports, in
both of kvtier's modes.

One OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``,
the multiprocess engine ``vllm serve`` runs) on the tiny model with a disk
tier, on loopback and a free port, per mode: kvtier's full spec
(``TieredOffloadingSpec``), then tiering mode (vLLM's tiering spec with
``KvtierDiskTier`` as its secondary tier). Each serves prompts until some
reach disk and come back from it, then every used disk slot's payload is
overwritten and one more prompt comes back from disk: its blocks fail
verification, so the error series have counted something. The test scrapes
/metrics and checks every series (and every label value matched with ``=``)
that a dashboard expression names; vLLM's tiering series
(``vllm:kv_offload_tiering_*``) only in tiering mode, where they exist.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvtier.store.slot import HEADER_SIZE
from kvtier.testing.model import build_tiny_llama

from .api_server import api_server, complete, exported, get, kv_transfer_config, total

pytestmark = pytest.mark.e2e

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-kvtier.json"
SERIES_RE = re.compile(r"(vllm:[A-Za-z0-9_:]+)(\{[^}]*\})?")
MATCHER_RE = re.compile(r'(\w+)\s*=\s*"([^"$]*)"')
# Series of vLLM's tiering manager: exported in tiering mode only.
TIERING_ONLY = "vllm:kv_offload_tiering_"
MODES = ("full", "tiering")


# ------------------------------------------------------------------ helpers


def dashboard_selectors(doc: Any) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """(series name, equality matchers) of every ``vllm:`` series that any
    string of the dashboard (expressions, variable queries) names."""
    found: set[tuple[str, tuple[tuple[str, str], ...]]] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, str):
            for name, braces in SERIES_RE.findall(node):
                # `=` only: `=~` (template variables) matches any value.
                eq = tuple(
                    sorted(
                        (k, v)
                        for k, v in MATCHER_RE.findall(braces or "")
                        if not re.search(rf"{k}\s*=~", braces)
                    )
                )
                found.add((name, eq))

    walk(doc)
    return found


def exported_samples(text: str) -> list[tuple[str, dict[str, str]]]:
    return [(name, labels) for name, labels, _ in exported(text)]


def missing_series(doc: Any, metrics_text: str, mode: str = "full") -> list[str]:
    """Selectors of the dashboard that match no exported sample (in
    ``mode``: vLLM's tiering series are looked for in tiering mode only)."""
    samples = exported_samples(metrics_text)
    missing = []
    for name, eq in sorted(dashboard_selectors(doc)):
        if name.startswith(TIERING_ONLY) and mode != "tiering":
            continue
        if not any(
            n == name and all(labels.get(k) == v for k, v in eq)
            for n, labels in samples
        ):
            missing.append(
                name + ("{" + ",".join(f'{k}="{v}"' for k, v in eq) + "}" if eq else "")
            )
    return missing


def _corrupt_slabs(disk_path: str) -> int:
    """Overwrite 64 payload bytes of every slot of every slab; returns slots."""
    n = 0
    for layout_path in glob.glob(os.path.join(disk_path, "kvtier-*", "layout.json")):
        with open(layout_path) as f:
            slot = json.load(f)["slot_size"]
        for slab in glob.glob(os.path.join(os.path.dirname(layout_path), "slab-*.kvt")):
            fd = os.open(slab, os.O_RDWR)
            try:
                for i in range(os.fstat(fd).st_size // slot):
                    os.pwrite(fd, os.urandom(64), i * slot + HEADER_SIZE)
                    n += 1
                os.fsync(fd)
            finally:
                os.close(fd)
    return n


# ------------------------------------------------------------------ the server


@pytest.fixture(scope="module", params=MODES)
def live(request, tmp_path_factory) -> tuple[str, str]:
    """(mode, the /metrics text once the corrupted disk hit was counted)."""
    mode = request.param
    model = build_tiny_llama()
    disk = tmp_path_factory.mktemp(f"dash-disk-{mode}")
    os.chmod(disk, 0o700)
    log_path = tmp_path_factory.mktemp(f"dash-log-{mode}") / "server.log"
    kv = kv_transfer_config(mode, str(disk))
    # A known engine id names vLLM's tiering primary region (api_server).
    kv["engine_id"] = f"kvtier-dash-{mode}-{uuid.uuid4().hex[:12]}"
    with api_server(model, kv, log_path) as (base, _proc):
        # A round's first prompt's blocks cascade GPU -> CPU -> disk as the
        # next five are stored, and it comes back from disk: if the spills
        # kept up. Under CI's load they may not (the CPU tier declines stores
        # while its rows are dirty, and the first prompt stays in it): then
        # a fresh round is served, until a disk hit was counted.
        deadline = time.monotonic() + 120.0
        for rnd in itertools.count():
            seeds = range(10 * rnd + 1, 10 * rnd + 7)
            for seed in seeds:
                complete(base, model, seed)
            complete(base, model, seeds[0])  # a verified disk hit
            text = get(f"{base}/metrics")
            loaded = total(
                text, "vllm:kv_offload_kvtier_loaded_blocks_total", tier="disk"
            )
            if loaded > 0 or time.monotonic() > deadline:
                break
        assert _corrupt_slabs(str(disk)) > 0
        # Until a load error and a corrupt verdict were both counted: under
        # CI's load one clean-clone run counted a load error, but no corrupt
        # block yet, in the scrape that ended this wait.
        deadline = time.monotonic() + 120.0
        for seed in itertools.cycle(seeds[1:]):
            complete(base, model, seed)  # a disk hit that fails verification
            text = get(f"{base}/metrics")
            if (
                total(text, "vllm:kv_offload_kvtier_load_errors_total") > 0
                and total(text, "vllm:kv_offload_kvtier_corrupt_blocks_total") > 0
            ):
                return mode, text
            if time.monotonic() > deadline:
                return mode, text  # the tests name what is missing
            time.sleep(0.5)


# ------------------------------------------------------------------ tests


def test_every_dashboard_series_is_exported(live):
    mode, text = live
    doc = json.loads(DASHBOARD.read_text())
    assert len(dashboard_selectors(doc)) >= 25
    assert sum(n.startswith(TIERING_ONLY) for n, _ in dashboard_selectors(doc)) >= 5
    assert missing_series(doc, text, mode) == []


def test_the_corrupted_disk_hit_was_counted(live):
    _mode, text = live
    k = "vllm:kv_offload_kvtier_"
    assert total(text, k + "load_errors_total") > 0
    assert total(text, k + "corrupt_blocks_total") > 0
    # No I/O error happened: nothing was kept or dropped for one (the
    # series exist, at 0, from the first step).
    names = {n for n, _ in exported_samples(text)}
    for name in ("load_io_errors_total", "unreadable_blocks_total"):
        assert k + name in names
        assert total(text, k + name) == 0


def test_both_modes_feed_kvtier_disk_series(live):
    """The disk tier's traffic reaches kvtier's series in either mode: bytes
    and seconds both ways, blocks loaded from disk, the read latency
    histogram; in tiering mode vLLM's own tiering series count it too."""
    mode, text = live
    k = "vllm:kv_offload_kvtier_"
    for name in (
        "read_bytes_total",
        "read_seconds_total",
        "write_bytes_total",
        "write_seconds_total",
        "loaded_blocks_total",
    ):
        assert total(text, k + name, tier="disk") > 0, (mode, name)
    assert total(text, k + "spills_total") > 0
    assert total(text, k + "read_latency_seconds_count") > 0
    if mode == "tiering":
        t = "vllm:kv_offload_tiering_"
        assert total(text, t + "read_bytes_total") > 0
        assert total(text, t + "write_bytes_total") > 0
        assert total(text, t + "promotion_job_failures_total") > 0  # the corrupt hit


def test_a_panel_naming_an_unexported_series_fails(live):
    mode, text = live
    doc = json.loads(DASHBOARD.read_text())
    doc["panels"].append(
        {
            "type": "timeseries",
            "title": "probe",
            "targets": [
                {"expr": "rate(vllm:kv_offload_kvtier_bogus_total[5m])"},
                {"expr": 'vllm:prompt_tokens_cached_by_source_total{source="ssd"}'},
            ],
        }
    )
    assert missing_series(doc, text, mode) == [
        "vllm:kv_offload_kvtier_bogus_total",
        'vllm:prompt_tokens_cached_by_source_total{source="ssd"}',
    ]
