"""Fixtures and hooks of the whole suite.

- caplog sees kvtier's records (children of vLLM's ``vllm`` logger);
- the suite leaves nothing in /dev/shm: an entry created during the run
  that no live process maps at its end (kvtier's or vLLM's) fails the run,
  named;
- vLLM's ZMQ sockets go to a directory of the run's own, removed at its end
  (vLLM's multiprocess engine leaves its IPC socket files behind in
  ``VLLM_RPC_BASE_PATH``, /tmp by default);
- with ``KVTIER_FAILURE_LOG`` set, each failure's report is appended to that
  file as it happens: a run cut off at its time limit (a lent GPU's call)
  keeps the tracebacks pytest would print only at its end.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from kvtier.testing.procs import shm_entries, shm_left_behind


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


# ------------------------------------------------------------- /dev/shm


_SHM_BEFORE = pytest.StashKey[set]()
_SHM_LEFT = pytest.StashKey[list]()
# Set by the outermost run for its workers and subprocesses: a pytest that a
# test starts (tests/compat) leaves the check to the run around it.
_SHM_CHECK_ENV = "KVTIER_TESTS_SHM_CHECKED_BY"
# A process that ended leaves its semaphores to multiprocessing's resource
# tracker, which unlinks them as it exits, a moment later.
_SHM_SETTLE_S = 15.0
_RPC_DIR = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or os.environ.get(_SHM_CHECK_ENV):
        return
    os.environ[_SHM_CHECK_ENV] = str(os.getpid())
    config.stash[_SHM_BEFORE] = shm_entries()
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        rpc = tempfile.mkdtemp(prefix="kvtier-tests-rpc-")
        os.environ["VLLM_RPC_BASE_PATH"] = config.stash[_RPC_DIR] = rpc


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After every worker is gone: what this run left in /dev/shm."""
    rpc = session.config.stash.get(_RPC_DIR, None)
    if rpc is not None:
        shutil.rmtree(rpc, ignore_errors=True)
    before = session.config.stash.get(_SHM_BEFORE, None)
    if before is None:
        return
    deadline = time.monotonic() + _SHM_SETTLE_S
    while (left := shm_left_behind(before)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        session.config.stash[_SHM_LEFT] = left
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("KVTIER_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    left = config.stash.get(_SHM_LEFT, None)
    if left:
        terminalreporter.write_line(
            f"FAILED /dev/shm: the run left {left} (no live process maps them)",
            red=True,
        )
