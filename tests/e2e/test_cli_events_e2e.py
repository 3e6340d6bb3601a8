"""`kvtier events` watching a real engine's KV-event publisher.

Both the engine and the CLI run in fresh processes: the CLI binds, vLLM's
publisher connects (an endpoint without '*'), and the CLI's per-medium
block counts must equal the hierarchy's own accounting."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
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


class _Lines:
    """A process's stream read line by line on a thread, waited on with
    deadlines."""

    def __init__(self, stream):
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))

    def wait(self, match, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no matching line within {timeout} s: {self.seen[-5:]}"
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(line)
            if match(line):
                return line


def test_kvtier_events_counts_a_real_engines_events(tmp_path):
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier.tools.cli",
            "events",
            "--endpoint",
            endpoint,
            "--bind",
            "--json",
            "--progress",
            "--duration",
            "280",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    eng = None
    try:
        cli_err = _Lines(cli.stderr)
        # The CLI's SUB socket binds before the engine's publisher connects.
        cli_err.wait(lambda ln: "listening on" in ln, timeout=60)
        # The engine's log goes to a file: a pipe nobody reads would fill up
        # and stall the engine.
        eng_log = open(tmp_path / "engine.log", "w+")  # noqa: SIM115
        disk = tmp_path / "disk"
        disk.mkdir()
        eng = subprocess.Popen(
            [sys.executable, str(ENGINE), str(disk), endpoint],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=eng_log,
            text=True,
            env=env,
        )
        eng_out = _Lines(eng.stdout)
        line = eng_out.wait(lambda ln: ln.startswith("KVTIER-LASTSEQ "), timeout=240)
        last = line.split()[1]
        if last != "None":  # wait until the CLI received the last batch
            cli_err.wait(
                lambda ln: (
                    ln.startswith("kvtier events: seq ")
                    and ln.split()[-1] != "None"
                    and int(ln.split()[-1]) >= int(last)
                ),
                timeout=60,
            )
        eng.stdin.write("received\n")
        eng.stdin.flush()
        found = eng_out.wait(lambda ln: ln.startswith("KVTIER-RESULT "), timeout=120)
        if eng.wait(timeout=120) != 0:
            eng_log.seek(0)
            raise AssertionError(eng_log.read()[-3000:])
        # SIGTERM, as a supervisor stops it: SIGINT may be ignored in a
        # process started from one that ignores it (seen under xdist), and
        # the watch would then run its whole --duration.
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=60) == 0  # --json: stdout holds one summary
        out = cli.stdout.read()
    finally:
        for proc in (eng, cli):
            if proc is not None and proc.poll() is None:
                proc.kill()
    result = json.loads(found.split(" ", 1)[1])
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
