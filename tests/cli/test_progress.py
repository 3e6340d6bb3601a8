"""Long ``kvtier`` commands show a tqdm bar on a terminal, and nothing when
stderr is not a terminal or with ``--json``: ``verify`` (every slot of a
store that may hold terabytes) and the ``size`` sweep.

Each command runs in a subprocess whose stderr is a real pseudo-terminal.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from store_util import write_store

pytest.importorskip("tqdm")

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK_BYTES = 4096
SLOTS = 600  # enough for a bar to move


def _cli(*argv: str, tty: bool) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``kvtier ARGV``; with ``tty`` its
    stderr is a pseudo-terminal (100 columns), else a pipe."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    cmd = [sys.executable, "-m", "kvtier.tools.cli", *argv]
    if not tty:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=120, env=env,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        return proc.returncode, proc.stdout, proc.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, env=env
    )
    os.close(slave)
    err = b""
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child's side is closed
                break
            if not data:
                break
            err += data
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    return proc.returncode, out.decode(), err.decode(errors="replace")


@pytest.fixture
def store(tmp_path: Path) -> str:
    write_store([str(tmp_path)], n=5, slots=SLOTS, block_bytes=BLOCK_BYTES)
    return str(tmp_path)


def test_verify_shows_progress_on_a_terminal_only(store: str) -> None:
    rc, out, err = _cli("verify", store, tty=True)
    assert rc == 0 and "5 used slots checked, 5 ok, 0 bad" in out
    assert "verify" in err and f"/{SLOTS}" in err and "slot/s" in err, err
    rc, out, err = _cli("verify", store, tty=False)
    assert rc == 0 and "5 ok" in out and err == ""
    rc, out, err = _cli("verify", store, "--json", tty=True)
    assert rc == 0 and json.loads(out)["ok"] and err == ""


def test_sizing_sweep_shows_progress_on_a_terminal_only(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    with open(trace, "w") as f:
        for i in range(40):
            ids = [i % 7, 100 + i % 11, 200 + i]
            rec = {"timestamp": i, "input_length": 1536, "output_length": 1}
            f.write(json.dumps({**rec, "hash_ids": ids}) + "\n")
    argv = ("size", "--trace", str(trace), "--cpu-blocks", "2", "--recommend")
    rc, out, err = _cli(*argv, tty=True)
    assert rc == 0 and "recommendation" in out
    assert "sizing sweep" in err and "replay/s" in err, err
    rc, out, err = _cli(*argv, tty=False)
    assert rc == 0 and "recommendation" in out and err == ""
    rc, out, err = _cli(*argv, "--json", tty=True)
    assert rc == 0 and "recommendation" in json.loads(out) and err == ""
