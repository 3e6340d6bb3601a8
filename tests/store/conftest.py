"""Shared fixtures for the kvtier.store tests."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from kvtier.store.backends import posix as posix_backend
from kvtier.store.backends.base import DiskBackend
from kvtier.store.backends.posix import PosixBackend
from kvtier.store.slot import LayoutFingerprint

BLOCK_BYTES = 64 * 1024


def make_fingerprint(
    block_bytes: int = BLOCK_BYTES, model: str = "test/model", tp_rank: int = 0
) -> LayoutFingerprint:
    return LayoutFingerprint(
        model=model,
        dtype="bfloat16",
        block_bytes=block_bytes,
        geometry="layers=2,kv=2,heads=8,head=128,tokens=16",
        tp_rank=tp_rank,
        tp_size=2,
    )


@pytest.fixture
def fingerprint() -> LayoutFingerprint:
    """A layout with 64 KiB blocks."""
    return make_fingerprint()


@pytest.fixture
def fingerprint_factory() -> Callable[..., LayoutFingerprint]:
    """make_fingerprint(block_bytes=..., model=..., tp_rank=...)."""
    return make_fingerprint


@pytest.fixture
def reject_o_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every O_DIRECT open fail with EINVAL, as older tmpfs/FUSE do."""
    real: Callable[..., int] = posix_backend._open_fd

    def fake(path: str, flags: int, mode: int = 0o600) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real(path, flags, mode)

    monkeypatch.setattr(posix_backend, "_open_fd", fake)


class FaultBackend(DiskBackend):
    """PosixBackend through the async interface only, with injectable errors.

    ``read_errno``/``write_errno`` make every read/write (or, with
    ``fail_offsets``, those at the given offsets) fail with that errno.
    """

    name = "fault"

    def __init__(
        self,
        read_errno: int | None = None,
        write_errno: int | None = None,
        fail_offsets: set[int] | None = None,
    ) -> None:
        self.inner = PosixBackend(threads=1)
        self.read_errno, self.write_errno = read_errno, write_errno
        self.fail_offsets = fail_offsets

    def _fault(self, code: int | None, handle: Any, offset: int) -> OSError | None:
        if code is None or (
            self.fail_offsets is not None and offset not in self.fail_offsets
        ):
            return None
        return OSError(code, os.strerror(code), handle.path)

    def _failed(self, exc: OSError) -> Future[int]:
        f: Future[int] = Future()
        f.set_exception(exc)
        return f

    def open(self, path: str, writable: bool = True) -> Any:
        return self.inner.open(path, writable)

    def submit_read(self, handle: Any, buf: Any, offset: int) -> Future[int]:
        exc = self._fault(self.read_errno, handle, offset)
        return self._failed(exc) if exc else self.inner.submit_read(handle, buf, offset)

    def submit_write(self, handle: Any, buf: Any, offset: int) -> Future[int]:
        exc = self._fault(self.write_errno, handle, offset)
        return (
            self._failed(exc) if exc else self.inner.submit_write(handle, buf, offset)
        )

    def close(self, handle: Any) -> None:
        self.inner.close(handle)

    def shutdown(self) -> None:
        self.inner.shutdown()


class SyncFaultBackend(FaultBackend):
    """FaultBackend that also offers the blocking read_sync/write_sync fast path."""

    def read_sync(self, handle: Any, buf: Any, offset: int) -> int:
        exc = self._fault(self.read_errno, handle, offset)
        if exc:
            raise exc
        return self.inner.read_sync(handle, buf, offset)

    def write_sync(self, handle: Any, buf: Any, offset: int) -> int:
        exc = self._fault(self.write_errno, handle, offset)
        if exc:
            raise exc
        return self.inner.write_sync(handle, buf, offset)


@pytest.fixture(params=["async", "sync"])
def fault_backend(
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., FaultBackend]]:
    """Factory for fault-injecting back ends, with and without the sync fast path."""
    made: list[FaultBackend] = []
    cls = FaultBackend if request.param == "async" else SyncFaultBackend

    def make(**kw: Any) -> FaultBackend:
        made.append(cls(**kw))
        return made[-1]

    yield make
    for b in made:
        b.shutdown()
