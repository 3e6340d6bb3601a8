"""Fault injection at the disk back-end boundary. FOR TESTS ONLY.

``FaultInjectingBackend(inner, plan)`` wraps any :class:`DiskBackend` and,
following a :class:`FaultPlan`, turns selected opens, reads and writes into
the failures real disks produce:

  ERROR     the operation raises ``OSError(errno, strerror, path)``
            (EIO, ENOSPC, EACCES, ...); nothing is transferred.
  SHORT     a read fills only the first ``short_bytes`` of the buffer (the
            rest is left untouched) and reports that count; a write stores
            only the first ``short_bytes`` (a torn write) and reports that.
  BIT_FLIP  one bit flipped per chosen byte (``flip_at``: absolute file
            offsets, flipped when the I/O covers them; else ``flips`` random
            bytes of the I/O): on reads in the caller's buffer after the
            transfer, on writes in a private copy before it (the caller's
            buffer is never modified).
  DELAY     sleep before the operation (at most ``MAX_DELAY_S`` per I/O).
  HANG      block before the operation until the rule's ``release`` event
            is set (a hung disk); then the I/O runs normally. A test sets
            the event when done; one that never does (it failed first)
            gets ``OSError(ETIMEDOUT)`` after ``fault_plan.MAX_HANG_S``, never a
            thread blocked for the rest of the run.

Each :class:`FaultRule` selects the I/Os it applies to by operation kind
(``open``/``read``/``write``), file path, byte ranges the I/O must overlap
(see :func:`on_slot`), a probability drawn from the plan's seeded RNG, a
number of matching I/Os to let through first (``skip``) and a maximum
number of injections (``first_n``). The first firing non-DELAY rule decides
the I/O's fault; DELAY rules all add up. Every injection is recorded in
``FaultPlan.injected``.

How it can be enabled: only by constructing it in code, as the tests do::

    plan = FaultPlan(seed=1)
    backend = FaultInjectingBackend(PosixBackend(), plan)
    store = DiskStore(paths, n, block_bytes, fp, backend=backend)
    plan.add(FaultRule.error(errno.EIO, ops="read", **on_slot(store, 3)))
    # ... every read of slot 3 now fails with EIO; backend.shutdown() at the end

No production code imports this module (it lives in ``kvtier.testing``,
which nothing outside that package imports): ``make_backend`` knows no such
``disk_io`` value, there is no ``kv_connector_extra_config`` key and no
environment variable for it, and no production module imports it. So it
cannot be switched on from a production configuration.

Like the inner back end, the wrapper offers ``read_sync``/``write_sync``
(which DiskStore prefers) exactly when the inner one does, unless ``sync``
says otherwise, so both of DiskStore's I/O paths can be exercised. Buffers
must be host memory (the layer inspects and copies bytes). With an O_DIRECT
inner handle, ``short_bytes`` of a write must be a multiple of
``IO_ALIGNMENT`` (the default, half the I/O rounded down, is).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.store.backends.base import DiskBackend
from kvtier.store.slot import aligned_empty
from kvtier.testing import fault_plan
from kvtier.testing.fault_plan import (
    MAX_DELAY_S,
    Decision,
    FaultKind,
    FaultPlan,
    FaultRule,
    InjectedFault,
    Op,
    on_slot,
    short_len,
)

__all__ = [
    "MAX_DELAY_S",
    "FaultHandle",
    "FaultInjectingBackend",
    "FaultKind",
    "FaultPlan",
    "FaultRule",
    "InjectedFault",
    "Op",
    "inject_faults",
    "on_slot",
]


def _as_view(buf: Any) -> memoryview:
    if hasattr(buf, "numpy") and not isinstance(buf, memoryview):
        buf = buf.numpy()  # CPU torch tensor: share memory through numpy
    return memoryview(buf).cast("B")


@dataclass(frozen=True)
class FaultHandle:
    """The inner back end's handle plus the path rules are matched against."""

    inner: Any
    path: str


_Transfer = Callable[[Any, Any, int], int]


class FaultInjectingBackend(DiskBackend):
    """A DiskBackend that injects the faults of ``plan`` around ``inner``.

    Tests only; see the module docstring. ``shutdown`` also shuts the inner
    back end down (the wrapper owns it).
    """

    name = "faults"

    def __init__(
        self, inner: DiskBackend, plan: FaultPlan, *, sync: bool | None = None
    ) -> None:
        self.inner = inner
        self.plan = plan
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvtier-faults")
        inner_read = getattr(inner, "read_sync", None)
        inner_write = getattr(inner, "write_sync", None)
        has_sync = inner_read is not None and inner_write is not None
        if sync and not has_sync:
            raise ValueError(f"{inner.describe()} has no read_sync/write_sync")
        if has_sync if sync is None else sync:
            assert inner_read is not None and inner_write is not None
            sync_read: _Transfer = inner_read
            sync_write: _Transfer = inner_write
            # Instance attributes, so getattr(backend, "read_sync", None) in
            # DiskStore finds them exactly when the inner back end has them.
            self.read_sync: _Transfer = lambda h, buf, off: self._read(
                sync_read, h, buf, off
            )
            self.write_sync: _Transfer = lambda h, buf, off: self._write(
                sync_write, h, buf, off
            )

    # -- the faults ---------------------------------------------------------

    def _async_read(self, handle: Any, buf: Any, offset: int) -> int:
        return self.inner.submit_read(handle, buf, offset).result()

    def _async_write(self, handle: Any, buf: Any, offset: int) -> int:
        return self.inner.submit_write(handle, buf, offset).result()

    def _begin(
        self, op: Op, handle: FaultHandle, offset: int, nbytes: int
    ) -> Decision:
        decision = self.plan._decide(op, handle.path, offset, nbytes)
        if decision.delay_s:
            time.sleep(decision.delay_s)
        rule = decision.fault
        if rule is not None and rule.kind is FaultKind.ERROR:
            raise OSError(rule.errno, os.strerror(rule.errno), handle.path)
        if rule is not None and rule.kind is FaultKind.HANG:
            assert rule.release is not None
            if not rule.release.wait(fault_plan.MAX_HANG_S):
                raise OSError(
                    errno.ETIMEDOUT, "injected hang not released", handle.path
                )
        return decision

    def _read(
        self, transfer: _Transfer, handle: FaultHandle, buf: Any, offset: int
    ) -> int:
        view = _as_view(buf)
        decision = self._begin(Op.READ, handle, offset, len(view))
        rule = decision.fault
        if rule is not None and rule.kind is FaultKind.SHORT:
            # Read everything privately, hand over only a prefix: the rest of
            # the caller's buffer keeps its old bytes, as after a real short read.
            scratch = aligned_empty(len(view))
            n = transfer(handle.inner, scratch, offset)
            keep = min(n, short_len(rule, len(view)))
            view[:keep] = scratch[:keep].data
            return keep
        n = transfer(handle.inner, buf, offset)
        if decision.flip_positions:
            arr = np.frombuffer(view, dtype=np.uint8)
            for bit in decision.flip_positions:
                if bit // 8 < n:
                    arr[bit // 8] ^= np.uint8(1 << (bit % 8))
        return n

    def _write(
        self, transfer: _Transfer, handle: FaultHandle, buf: Any, offset: int
    ) -> int:
        view = _as_view(buf)
        decision = self._begin(Op.WRITE, handle, offset, len(view))
        rule = decision.fault
        if rule is not None and rule.kind is FaultKind.SHORT:
            keep = short_len(rule, len(view))
            return transfer(handle.inner, view[:keep], offset) if keep else 0
        if decision.flip_positions:
            scratch = aligned_empty(len(view))
            scratch[:] = np.frombuffer(view, dtype=np.uint8)
            for bit in decision.flip_positions:
                scratch[bit // 8] ^= np.uint8(1 << (bit % 8))
            return transfer(handle.inner, scratch, offset)
        return transfer(handle.inner, buf, offset)

    # -- DiskBackend ------------------------------------------------------

    def open(self, path: str, writable: bool = True) -> FaultHandle:
        handle = FaultHandle(None, os.path.abspath(path))
        self._begin(Op.OPEN, handle, 0, 0)
        return FaultHandle(self.inner.open(path, writable), handle.path)

    def submit_read(self, handle: FaultHandle, buf: Any, offset: int) -> Future[int]:
        return self._pool.submit(self._read, self._async_read, handle, buf, offset)

    def submit_write(self, handle: FaultHandle, buf: Any, offset: int) -> Future[int]:
        return self._pool.submit(self._write, self._async_write, handle, buf, offset)

    def close(self, handle: FaultHandle) -> None:
        self.inner.close(handle.inner)

    def fileno(self, handle: FaultHandle) -> int | None:
        return self.inner.fileno(handle.inner)

    def describe(self) -> str:
        return f"faults({self.inner.describe()})"

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self.inner.shutdown()


def inject_faults(monkeypatch: Any, plan: FaultPlan) -> FaultPlan:
    """Wrap every disk back end kvtier builds from now on (the scheduler's
    spills and the workers' loads) in a :class:`FaultInjectingBackend`
    driven by ``plan`` (a worker's reads and the scheduler side's spills
    stay in their own processes: see ``ReadProcess.spawn`` and
    ``SpillProcess.spawn``); ``monkeypatch`` (pytest's) undoes it. Returns
    ``plan``, empty until a test adds a rule."""
    from kvtier.store import read_process as read_process_module
    from kvtier.store import spill_process as spill_process_module
    from kvtier.store import store as disk_store_module
    from kvtier.store.backends import factory as backends_module

    real = backends_module.make_backend

    def faulty(disk_io: str = "auto", **kw: Any) -> FaultInjectingBackend:
        return FaultInjectingBackend(real(disk_io, **kw), plan)

    monkeypatch.setattr(disk_store_module, "make_backend", faulty)
    monkeypatch.setattr(backends_module, "make_backend", faulty)
    # A worker's read process would read with a back end of its own, out of
    # the plan's reach: under a plan, its reads stay in the worker's process.
    monkeypatch.setattr(read_process_module.ReadProcess, "spawn", False)
    monkeypatch.setattr(spill_process_module.SpillProcess, "spawn", False)
    return plan


def flip_byte(path: str, offset: int, mask: int = 0xFF) -> None:
    """Corrupt a real file on disk: XOR the byte at ``offset`` of ``path``
    with ``mask`` (non-zero), then fsync, so a reader finds it so."""
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ mask]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
