"""Choosing a disk back end from the ``disk_io`` setting."""

from __future__ import annotations

import importlib
import threading

from kvtier.log import get_logger
from kvtier.store.backends.base import BackendUnavailableError, DiskBackend
from kvtier.store.backends.posix import PosixBackend

logger = get_logger("store")

DISK_IO_CHOICES = ("auto", "posix", "kvikio")


_logged: set[tuple[str, str]] = set()
_logged_lock = threading.Lock()


def _log_choice(name: str, why: str) -> None:
    # Every worker builds a store; say which back end once, not per store.
    with _logged_lock:
        if (name, why) in _logged:
            return
        _logged.add((name, why))
    logger.info("kvtier disk I/O back end: %s (%s)", name, why)


def kvikio_status() -> tuple[bool, str]:
    """Whether kvikio can be used here, and why (not). Never raises."""
    try:
        # import_module (not "from kvtier.store.backends import ...") so sys.modules is
        # authoritative, which is what tests and a failed import rely on.
        kvikio_probe = importlib.import_module("kvtier.store.backends.kvikio_probe")
    except ImportError as exc:
        return False, f"kvtier.store.backends.kvikio_probe unavailable: {exc}"
    try:
        usable, why = kvikio_probe.usable_status()
    except Exception as exc:  # a probe must never take the worker down
        return False, f"the kvikio probe failed: {exc!r}"
    return bool(usable), why if usable else f"kvikio unusable: {why}"


def _make_kvikio(threads: int) -> DiskBackend:
    backend: DiskBackend = importlib.import_module(
        "kvtier.store.backends.kvikio"
    ).KvikioBackend(threads=threads)
    return backend


def make_backend(disk_io: str = "auto", *, threads: int = 4) -> DiskBackend:
    """Build the back end named by ``disk_io``.

    - ``"posix"``: PosixBackend.
    - ``"kvikio"``: KvikioBackend; raises BackendUnavailableError naming
      ``disk_io`` if kvikio cannot be used here.
    - ``"auto"``: kvikio when ``kvikio_status()`` says so, otherwise posix.
    Any other value raises ValueError.
    """
    if disk_io == "posix":
        _log_choice("posix", "disk_io='posix'")
        return PosixBackend(threads)
    if disk_io == "kvikio":
        usable, why = kvikio_status()
        if not usable:
            raise BackendUnavailableError(
                f"disk_io='kvikio' was requested but kvikio cannot be used: {why}; "
                "set disk_io='posix' or 'auto'"
            )
        backend = _make_kvikio(threads)
        _log_choice(backend.describe(), "disk_io='kvikio'")
        return backend
    if disk_io == "auto":
        usable, why = kvikio_status()
        if usable:
            backend = _make_kvikio(threads)
            _log_choice(backend.describe(), f"disk_io='auto': {why}")
            return backend
        _log_choice("posix", f"disk_io='auto': {why}")
        return PosixBackend(threads)
    raise ValueError(
        f"disk_io must be one of {', '.join(map(repr, DISK_IO_CHOICES))}; got {disk_io!r}"
    )
