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


def make_backend(
    disk_io: str = "auto", *, threads: int = 4, why: str | None = None
) -> DiskBackend:
    """Build the back end named by ``disk_io``.

    - ``"posix"``: PosixBackend.
    - ``"kvikio"``: KvikioBackend; raises BackendUnavailableError naming
      ``disk_io`` if kvikio cannot be used here.
    - ``"auto"``: kvikio when ``kvikio_status()`` says so, otherwise posix.
    Any other value raises ValueError. The choice is logged once with the
    setting, or with ``why`` from a caller that does not follow the
    configured ``disk_io`` (the scheduler side's spills: always POSIX), so
    the line never names a setting the operator did not give.
    """
    if disk_io not in DISK_IO_CHOICES:
        raise ValueError(
            f"disk_io must be one of {', '.join(map(repr, DISK_IO_CHOICES))}; "
            f"got {disk_io!r}"
        )
    setting = f"disk_io={disk_io!r}"
    if disk_io != "posix":
        usable, status = kvikio_status()
        if disk_io == "kvikio" and not usable:
            raise BackendUnavailableError(
                f"{setting} was requested but kvikio cannot be used: {status}; "
                "set disk_io='posix' or 'auto'"
            )
        if disk_io == "auto":
            setting = f"{setting}: {status}"
        if usable:
            module = importlib.import_module("kvtier.store.backends.kvikio")
            backend: DiskBackend = module.KvikioBackend(threads=threads)
            _log_choice(backend.describe(), why or setting)
            return backend
    _log_choice("posix", why or setting)
    return PosixBackend(threads)
