"""docs/grafana-kvtier.json names only series a live server exports.

One OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``,
the multiprocess engine ``vllm serve`` runs) on the tiny model with a disk
tier, on loopback and a free port, is shared by the module. It serves
prompts until some spill to disk and come back from it, then every used
disk slot's payload is overwritten and one more prompt comes back from disk:
its blocks fail verification, so the error series exist too. The test
scrapes /metrics and checks every series (and every label value matched
with ``=``) that a dashboard expression names.
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.io.format import HEADER_SIZE
from kvtier.testing.model import build_tiny_llama

pytestmark = pytest.mark.e2e

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-kvtier.json"
SERIES_RE = re.compile(r"(vllm:[A-Za-z0-9_:]+)(\{[^}]*\})?")
MATCHER_RE = re.compile(r'(\w+)\s*=\s*"([^"$]*)"')
BLOCK_TOKENS = 32
PROMPT_TOKENS = 150
START_TIMEOUT_S = 300.0


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
    return [
        (s.name, dict(s.labels))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def missing_series(doc: Any, metrics_text: str) -> list[str]:
    """Selectors of the dashboard that match no exported sample."""
    samples = exported_samples(metrics_text)
    missing = []
    for name, eq in sorted(dashboard_selectors(doc)):
        if not any(
            n == name and all(labels.get(k) == v for k, v in eq)
            for n, labels in samples
        ):
            missing.append(
                name + ("{" + ",".join(f'{k}="{v}"' for k, v in eq) + "}" if eq else "")
            )
    return missing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _complete(base: str, model: str, seed: int) -> list[int]:
    rng = random.Random(seed)
    prompt = [rng.randrange(4, 1000) for _ in range(PROMPT_TOKENS)]
    # 8 tokens: vLLM offers a store the CPU tier declined (its blocks still
    # spilling) again each step the request lives; 150 + 8 tokens stay within
    # 4 full blocks, the CPU tier's size.
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        doc = json.load(r)
    return doc["choices"][0]["text"]


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


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory) -> str:
    model = build_tiny_llama()
    disk = tmp_path_factory.mktemp("dash-disk")
    os.chmod(disk, 0o700)
    log_path = tmp_path_factory.mktemp("dash-log") / "server.log"
    port = _free_port()
    kv = {
        "kv_connector": "TieredOffloadingConnector",
        "kv_connector_module_path": "kvtier.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "TieredOffloadingSpec",
            "spec_module_path": "kvtier.connector",
            "cpu_bytes_to_use": 4 * 32768,  # 4 blocks: prompts spill to disk
            "disk_bytes_to_use": 8 << 20,
            "disk_path": str(disk),
            "block_size": BLOCK_TOKENS,
        },
    }
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--dtype", "float32", "--enforce-eager",
        "--block-size", str(BLOCK_TOKENS), "--num-gpu-blocks-override", "16",
        "--kv-cache-memory-bytes", "2000000", "--max-model-len", "256",
        "--max-num-seqs", "4", "--compilation-config", '{"mode": 0}',
        "--host", "127.0.0.1", "--port", str(port),
        "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    # The multiprocess engine, as vllm serve runs it.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"server exited {proc.returncode}: {log_path.read_text()[-3000:]}"
                )
            try:
                _get(f"{base}/health", timeout=2.0)
                break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"server not up in {START_TIMEOUT_S} s: {log_path.read_text()[-3000:]}"
                )
            time.sleep(0.5)
        for seed in range(1, 7):  # 1's blocks cascade GPU -> CPU -> disk
            _complete(base, model, seed)
        _complete(base, model, 1)  # a verified disk hit
        assert _corrupt_slabs(str(disk)) > 0
        _complete(base, model, 2)  # a disk hit that fails verification
        deadline = time.monotonic() + 60.0
        while True:
            text = _get(f"{base}/metrics")
            names = {n for n, _ in exported_samples(text)}
            if "vllm:kv_offload_kvtier_load_errors_total" in names:
                return text
            if time.monotonic() > deadline:
                return text  # the test names what is missing
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)


# ------------------------------------------------------------------ tests


def test_every_dashboard_series_is_exported(live_metrics):
    doc = json.loads(DASHBOARD.read_text())
    assert len(dashboard_selectors(doc)) >= 20
    assert missing_series(doc, live_metrics) == []


def test_the_corrupted_disk_hit_was_counted(live_metrics):
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(live_metrics):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    assert values["vllm:kv_offload_kvtier_load_errors_total"] > 0
    assert values["vllm:kv_offload_kvtier_corrupt_blocks_total"] > 0


def test_a_panel_naming_an_unexported_series_fails(live_metrics):
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
    assert missing_series(doc, live_metrics) == [
        "vllm:kv_offload_kvtier_bogus_total",
        'vllm:prompt_tokens_cached_by_source_total{source="ssd"}',
    ]
