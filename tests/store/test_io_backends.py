from __future__ import annotations

import logging
import sys
import types
from typing import Any

import pytest

from kvtier.store.backends import factory as backends
from kvtier.store.backends.base import BackendUnavailableError
from kvtier.store.backends.factory import make_backend
from kvtier.store.backends.posix import PosixBackend

PROBE = "kvtier.store.backends.kvikio_probe"
BACKEND = "kvtier.store.backends.kvikio"


class FakeKvikio(PosixBackend):
    name = "kvikio"

    def __init__(self, threads: int = 4) -> None:
        super().__init__(threads)
        self.threads = threads


def install_fake(monkeypatch: pytest.MonkeyPatch, usable: Any) -> None:
    probe = types.ModuleType(PROBE)
    mod = types.ModuleType(BACKEND)

    def usable_status() -> tuple[bool, str]:
        if isinstance(usable, Exception):
            raise usable
        return bool(usable), "fake"

    probe.usable_status = usable_status  # type: ignore[attr-defined]
    mod.KvikioBackend = FakeKvikio  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, PROBE, probe)
    monkeypatch.setitem(sys.modules, BACKEND, mod)


@pytest.fixture(autouse=True)
def fresh_log_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "_logged", set())


def test_posix(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vllm.kvtier.store")
    for _ in range(2):
        b = make_backend("posix", threads=2)
        assert type(b) is PosixBackend
        b.shutdown()
    chosen = [r for r in caplog.records if "back end" in r.getMessage()]
    assert len(chosen) == 1 and "posix" in chosen[0].getMessage()


def test_a_caller_that_does_not_follow_disk_io_says_why(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """The scheduler side spills with POSIX I/O whatever disk_io says; its
    line says so instead of naming disk_io='posix', which no one set."""
    from kvtier.connector.spec import TieredOffloadingSpec
    from kvtier.testing.offloading import tiered_spec
    from tests.connector.test_request_runner import make_config

    caplog.set_level(logging.INFO, logger="vllm.kvtier.store")
    cfg = make_config(tmp_path, cpu_blocks=4, disk_blocks=8, disk_io="auto")
    spec = tiered_spec(cfg)
    assert isinstance(spec, TieredOffloadingSpec)
    manager = spec.get_manager()
    try:
        lines = [r.getMessage() for r in caplog.records if "back end" in r.getMessage()]
        assert lines == [
            "kvtier disk I/O back end: posix (the scheduler side's spills; "
            "disk_io='auto' picks the workers' reads)"
        ]
    finally:
        manager.shutdown()


def test_auto_without_kvikio_module_is_posix(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vllm.kvtier.store")
    monkeypatch.setitem(sys.modules, PROBE, None)  # import raises ImportError
    b = make_backend("auto")
    assert type(b) is PosixBackend
    b.shutdown()
    (said,) = [r.getMessage() for r in caplog.records if "back end" in r.getMessage()]
    assert said.startswith(
        "kvtier disk I/O back end: posix (disk_io='auto': "
        "kvtier.store.backends.kvikio_probe unavailable: "
    ), said


@pytest.mark.parametrize("usable", [False, RuntimeError("no driver")])
def test_auto_with_unusable_kvikio_is_posix(
    monkeypatch: pytest.MonkeyPatch, usable: Any
) -> None:
    install_fake(monkeypatch, usable)
    b = make_backend("auto")
    assert type(b) is PosixBackend
    b.shutdown()


def test_auto_and_explicit_use_kvikio_when_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_fake(monkeypatch, True)
    for choice in ("auto", "kvikio"):
        b = make_backend(choice, threads=3)
        assert isinstance(b, FakeKvikio) and b.threads == 3
        b.shutdown()


def test_explicit_kvikio_unusable_raises_naming_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install_fake(monkeypatch, False)
    with pytest.raises(BackendUnavailableError, match="disk_io"):
        make_backend("kvikio")
    monkeypatch.setitem(sys.modules, PROBE, None)
    with pytest.raises(BackendUnavailableError, match="disk_io='kvikio'"):
        make_backend("kvikio")


def test_unknown_value() -> None:
    with pytest.raises(ValueError, match="disk_io.*'auto'.*'posix'.*'kvikio'"):
        make_backend("io_uring")
