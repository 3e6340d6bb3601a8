"""`kvtier events` watching a real engine's KV-event publisher."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .harness import engine, run_prompts
from .workload import (
    FIRST,
    GPU_BLOCKS,
    MAX_TOKENS,
    RETURNING,
    kvtier_config,
    manager_of,
    run_each,
)

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kvtier_events_counts_a_real_engines_events(model, block_bytes, tmp_path):
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # The CLI binds (vLLM's publisher connects to an endpoint without '*').
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "events",
            "--endpoint",
            endpoint,
            "--bind",
            "--json",
            "--duration",
            "240",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        time.sleep(1.0)  # the SUB socket binds before anything else
        assert cli.poll() is None, cli.stderr.read()
        cfg = kvtier_config(block_bytes, tmp_path)
        with engine(
            model,
            cfg,
            num_gpu_blocks=GPU_BLOCKS,
            enable_kv_events=True,
            kv_events_endpoint=endpoint,
        ) as llm:
            run_each(llm, FIRST)
            again = run_prompts(llm, RETURNING, MAX_TOKENS)
            stats = manager_of(llm).hierarchy.stats
            time.sleep(1.5)  # let the last batches cross the socket
        cli.send_signal(signal.SIGINT)
        out, err = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 0, err
    doc = json.loads(out)
    media = doc["media"]
    assert again.totals.get("disk", 0) > 0
    assert doc["decode_errors"] == 0
    # The CLI's per-medium block counts are the tiers' own accounting.
    assert media["disk"]["stored"] == stats.spills_completed > 0
    assert media["disk"]["removed"] == stats.disk_evictions
    assert media["cpu"]["stored"] == stats.stores_completed + stats.promotions_completed
    assert media["cpu"]["removed"] == stats.cpu_evictions > 0
    assert media["gpu"]["stored"] > 0
