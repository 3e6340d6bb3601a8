"""`kvtier events` watching a real engine's KV-event publisher.

Both the engine and the CLI run in fresh processes: the CLI binds, vLLM's
publisher connects (an endpoint without '*'), and the CLI's per-medium
block counts must equal the hierarchy's own accounting."""

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

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
ENGINE = Path(__file__).with_name("_events_engine.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kvtier_events_counts_a_real_engines_events(tmp_path):
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
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
            "280",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        time.sleep(1.0)  # the CLI's SUB socket binds before anything else
        assert cli.poll() is None, cli.stderr.read()
        run = subprocess.run(
            [sys.executable, str(ENGINE), str(tmp_path), endpoint],
            capture_output=True,
            text=True,
            env=env,
            timeout=240,
        )
        found = [
            ln for ln in run.stdout.splitlines() if ln.startswith("KVTIER-RESULT ")
        ]
        assert run.returncode == 0 and found, run.stderr[-3000:]
        cli.send_signal(signal.SIGINT)
        out, err = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 0, err
    result = json.loads(found[-1].split(" ", 1)[1])
    stats, media = result["stats"], json.loads(out)["media"]
    assert result["disk_tokens"] > 0
    assert media["disk"]["stored"] == stats["spills_completed"] > 0
    assert media["disk"]["removed"] == stats["disk_evictions"]
    assert (
        media["cpu"]["stored"]
        == stats["stores_completed"] + stats["promotions_completed"]
    )
    assert media["cpu"]["removed"] == stats["cpu_evictions"] > 0
    assert media["gpu"]["stored"] > 0
