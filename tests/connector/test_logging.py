"""kvtier's log lines follow vLLM's logging configuration.

A real subprocess configures logging as ``vllm serve`` and ``LLM(...)`` do
(``vllm.logger.configure_logging``), then runs kvtier code that logs at
DEBUG: ``VLLM_LOGGING_LEVEL=DEBUG`` shows the line in vLLM's format,
``INFO`` hides it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO_ROOT = Path(__file__).resolve().parents[2]
LINE = "no HF cache snapshot for 'not a repo id!'"
CODE = """
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging

configure_logging(LoggingConfig())  # what vllm serve and LLM() do at start

from kvtier.connector.identity import resolve_model_dir

assert resolve_model_dir("not a repo id!") is None  # logs LINE at DEBUG
"""


def _run(level: str) -> str:
    env = {
        **os.environ,
        "VLLM_LOGGING_LEVEL": level,
        "VLLM_CONFIGURE_LOGGING": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO_ROOT),
    }
    env.pop("VLLM_LOGGING_CONFIG_PATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", CODE],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_vllm_logging_level_debug_shows_kvtier_debug_lines() -> None:
    lines = [line for line in _run("DEBUG").splitlines() if LINE in line]
    assert len(lines) == 1, lines
    # vLLM's handler and format: level, then [file:line] of kvtier's module.
    assert "DEBUG" in lines[0] and "identity.py:" in lines[0], lines[0]


def test_vllm_logging_level_info_hides_them() -> None:
    assert LINE not in _run("INFO")
