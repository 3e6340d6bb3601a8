"""Helpers of the ``kvtier doctor`` tests (test_doctor*.py)."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import pytest

from kvtier.tools.cli import main

MiB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[2]


def doctor(capsys, *argv: str) -> tuple[int, dict[str, dict]]:
    """Run ``kvtier doctor --json``; (exit status, checks by subject)."""
    rc = main(["doctor", "--json", *argv])
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] == (rc == 0)
    return rc, {c["subject"]: c for c in out["checks"]}


def flags(disk: Path, shm: Path, *more: str, disk_bytes: str = "1MiB") -> list[str]:
    return [
        "--disk-path", str(disk), "--cpu-bytes", "1MiB", "--disk-bytes", disk_bytes,
        "--shm-dir", str(shm), "--no-probe", *more,
    ]  # fmt: skip


@contextlib.contextmanager
def mounted(target: Path, fstype: str, options: str):
    """A fresh file system at ``target``; skips where mount is not permitted."""
    target.mkdir(exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", fstype, "-o", options, fstype, str(target)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount {fstype}: {r.stderr.strip() or r.returncode}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def write(tmp_path: Path, doc: object, name: str = "kv.json") -> str:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


def shipped_config(name: str, disk: Path) -> dict:
    """A file of configs/ pointed at ``disk``, its sizes cut to 1 MiB."""
    return json.loads(
        (REPO_ROOT / "configs" / name)
        .read_text()
        .replace("/mnt/nvme0/kvtier", str(disk))
        .replace("64000000000", str(MiB))
        .replace("1000000000000", str(MiB))
    )


def run_config(capsys, tmp_path, shm, doc) -> tuple[int, dict[str, dict]]:
    path = write(tmp_path, doc)
    return doctor(capsys, "--config", path, "--shm-dir", str(shm), "--no-probe")
