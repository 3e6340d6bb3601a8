"""Fixtures of the whole suite."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _vllm_records_reach_caplog(request: pytest.FixtureRequest) -> Iterator[None]:
    """For a test that uses ``caplog``: let records of the ``vllm`` logger
    and its children (kvtier's loggers are ``vllm.kvtier.*``) reach caplog's
    handler on the root logger.

    vLLM's logging configuration (applied when an engine starts, possibly
    inside the test) sets ``propagate=False`` on ``vllm``; here its default
    configuration propagates for the test's duration, as does the logger."""
    if "caplog" not in request.fixturenames or importlib.util.find_spec("vllm") is None:
        yield
        return
    import vllm.logger

    config = vllm.logger.DEFAULT_LOGGING_CONFIG["loggers"]["vllm"]
    logger = logging.getLogger("vllm")
    saved = config["propagate"], logger.propagate
    config["propagate"] = logger.propagate = True
    try:
        yield
    finally:
        config["propagate"], logger.propagate = saved


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A fresh directory on tmpfs (/dev/shm)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)
