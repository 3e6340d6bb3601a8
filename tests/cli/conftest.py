"""Fixtures of the ``kvtier doctor`` tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def disk(tmp_path) -> Path:
    d = tmp_path / "disk"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def shm(tmp_path) -> Path:
    d = tmp_path / "shm"
    d.mkdir(mode=0o700)
    return d
