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
            is set (a hung disk); then the I/O runs normally. Unbounded on
            purpose: tests set the event when done.

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

Nothing in kvtier imports this module: ``make_backend`` knows no such
``disk_io`` value, there is no ``kv_connector_extra_config`` key and no
environment variable for it, and ``kvtier.io`` does not export it. So it
cannot be switched on from a production configuration.

Like the inner back end, the wrapper offers ``read_sync``/``write_sync``
(which DiskStore prefers) exactly when the inner one does, unless ``sync``
says otherwise, so both of DiskStore's I/O paths can be exercised. Buffers
must be host memory (the layer inspects and copies bytes). With an O_DIRECT
inner handle, ``short_bytes`` of a write must be a multiple of
``IO_ALIGNMENT`` (the default, half the I/O rounded down, is).
"""

from __future__ import annotations

import errno as errno_mod
import os
import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.io.backend import IO_ALIGNMENT, DiskBackend
from kvtier.io.format import aligned_empty

if TYPE_CHECKING:
    from kvtier.io.disk_store import DiskStore

# Bound on the total injected delay of one I/O, so no plan can hang a test.
MAX_DELAY_S = 2.0


class Op(str, Enum):
    """Back-end operation a rule applies to."""

    OPEN = "open"
    READ = "read"
    WRITE = "write"


class FaultKind(Enum):
    ERROR = "error"
    SHORT = "short"
    BIT_FLIP = "bit_flip"
    DELAY = "delay"
    HANG = "hang"


_ALL_IO = frozenset({Op.READ, Op.WRITE})


def _ops(value: str | Op | Iterable[str | Op]) -> frozenset[Op]:
    if isinstance(value, (str, Op)):
        value = [value]
    return frozenset(Op(v) for v in value)


@dataclass(frozen=True)
class FaultRule:
    """One kind of fault and the I/Os it hits (see the module docstring).

    ``path`` matches the file's absolute path exactly; ``ranges`` are
    ``(start, end)`` byte ranges of which the I/O ``[offset, offset+len)``
    must overlap one (an open has no range and never matches a rule with
    ``ranges``). ``skip`` matching I/Os pass first; then at most
    ``first_n`` (None: unlimited) are hit, each with ``probability``.
    """

    kind: FaultKind
    ops: frozenset[Op] = _ALL_IO
    errno: int = errno_mod.EIO
    path: str | None = None
    ranges: tuple[tuple[int, int], ...] | None = None
    probability: float = 1.0
    skip: int = 0
    first_n: int | None = None
    short_bytes: int | None = None
    flip_at: tuple[int, ...] | None = None
    flips: int = 1
    delay_s: float = 0.0
    release: threading.Event | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", _ops(self.ops))
        if self.path is not None:
            object.__setattr__(self, "path", os.path.abspath(self.path))
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {self.probability}")
        if self.skip < 0 or (self.first_n is not None and self.first_n < 0):
            raise ValueError("skip and first_n must be >= 0")
        if not 0.0 <= self.delay_s <= MAX_DELAY_S:
            raise ValueError(f"delay_s must be within [0, {MAX_DELAY_S}] s")
        if self.short_bytes is not None and self.short_bytes < 0:
            raise ValueError("short_bytes must be >= 0")
        if self.flips < 1:
            raise ValueError("flips must be >= 1")
        if self.kind is FaultKind.HANG and self.release is None:
            raise ValueError("a HANG rule needs a release event")
        if Op.OPEN in self.ops and self.kind not in (
            FaultKind.ERROR,
            FaultKind.DELAY,
            FaultKind.HANG,
        ):
            raise ValueError(f"{self.kind.name} cannot apply to open")
        if self.kind is FaultKind.ERROR and self.errno <= 0:
            raise ValueError(f"bad errno {self.errno}")

    # -- convenience constructors -----------------------------------------

    @classmethod
    def error(cls, code: int, **kw: Any) -> FaultRule:
        """Fail with ``OSError(code)``; e.g. ``FaultRule.error(errno.ENOSPC)``."""
        return cls(FaultKind.ERROR, errno=code, **kw)

    @classmethod
    def short(cls, nbytes: int | None = None, **kw: Any) -> FaultRule:
        """Transfer only ``nbytes`` (default: half, aligned down)."""
        return cls(FaultKind.SHORT, short_bytes=nbytes, **kw)

    @classmethod
    def bit_flip(cls, at: Iterable[int] | None = None, **kw: Any) -> FaultRule:
        """Flip one bit in each byte at file offsets ``at`` that the I/O
        covers, or in ``flips`` random bytes of the I/O."""
        return cls(FaultKind.BIT_FLIP, flip_at=None if at is None else tuple(at), **kw)

    @classmethod
    def delay(cls, seconds: float, **kw: Any) -> FaultRule:
        """Sleep ``seconds`` (bounded by MAX_DELAY_S) before the I/O."""
        return cls(FaultKind.DELAY, delay_s=seconds, **kw)

    @classmethod
    def hang(cls, release: threading.Event, **kw: Any) -> FaultRule:
        """Block the I/O until ``release`` is set (a hung disk), then run it."""
        return cls(FaultKind.HANG, release=release, **kw)

    def _selects(self, op: Op, path: str, offset: int, nbytes: int) -> bool:
        if op not in self.ops or (self.path is not None and path != self.path):
            return False
        if self.flip_at is not None and not any(
            offset <= p < offset + nbytes for p in self.flip_at
        ):
            return False  # a targeted flip only hits the I/O covering its byte
        if self.ranges is None:
            return True
        if op is Op.OPEN:
            return False
        end = offset + max(nbytes, 1)
        return any(offset < hi and lo < end for lo, hi in self.ranges)


def on_slot(store: DiskStore, slot: int) -> dict[str, Any]:
    """``path`` and ``ranges`` keywords selecting every I/O on ``slot``."""
    idx = slot % len(store.paths)
    slab = store.slabs[idx]
    start = slab.offset(slot // len(store.paths))
    return {"path": slab.path, "ranges": ((start, start + store.slot_size),)}


@dataclass(frozen=True)
class InjectedFault:
    """Record of one injection."""

    op: Op
    kind: FaultKind
    path: str
    offset: int
    nbytes: int
    errno: int | None = None
    detail: str = ""


@dataclass
class _Decision:
    fault: FaultRule | None = None
    delay_s: float = 0.0
    flip_positions: list[int] = field(default_factory=list)


class FaultPlan:
    """Rules plus a seeded RNG and the record of what was injected.

    Thread-safe. ``armed = False`` lets every I/O through (rules keep their
    counters); rules can be added or removed while I/O is running.
    """

    def __init__(self, rules: Iterable[FaultRule] = (), *, seed: int = 0) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._rules: list[FaultRule] = []
        self._matched: dict[int, int] = {}
        self._fired: dict[int, int] = {}
        self._injected: list[InjectedFault] = []
        self.armed = True
        for rule in rules:
            self.add(rule)

    def add(self, rule: FaultRule) -> FaultRule:
        with self._lock:
            self._rules.append(rule)
            self._matched[id(rule)] = self._fired[id(rule)] = 0
        return rule

    def remove(self, rule: FaultRule) -> None:
        with self._lock:
            self._rules = [r for r in self._rules if r is not rule]

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    @property
    def injected(self) -> list[InjectedFault]:
        with self._lock:
            return list(self._injected)

    def count(self, kind: FaultKind | None = None, op: Op | str | None = None) -> int:
        """Injections so far, optionally of one kind and/or operation."""
        want_op = None if op is None else Op(op)
        return sum(
            1
            for f in self.injected
            if (kind is None or f.kind is kind) and (want_op is None or f.op is want_op)
        )

    def _decide(self, op: Op, path: str, offset: int, nbytes: int) -> _Decision:
        out = _Decision()
        if not self.armed:
            return out
        with self._lock:
            for rule in self._rules:
                if out.fault is not None and rule.kind is not FaultKind.DELAY:
                    continue
                if not rule._selects(op, path, offset, nbytes):
                    continue
                self._matched[id(rule)] += 1
                if self._matched[id(rule)] <= rule.skip:
                    continue
                if rule.first_n is not None and self._fired[id(rule)] >= rule.first_n:
                    continue
                if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                    continue
                self._fired[id(rule)] += 1
                if rule.kind is FaultKind.DELAY:
                    out.delay_s = min(MAX_DELAY_S, out.delay_s + rule.delay_s)
                    self._injected.append(
                        InjectedFault(op, rule.kind, path, offset, nbytes)
                    )
                    continue
                out.fault = rule
                if rule.kind is FaultKind.BIT_FLIP:
                    if rule.flip_at is not None:
                        out.flip_positions = [
                            p - offset
                            for p in rule.flip_at
                            if offset <= p < offset + nbytes
                        ]
                    elif nbytes:
                        out.flip_positions = self._rng.sample(
                            range(nbytes), min(rule.flips, nbytes)
                        )
                    # Bit within each byte, from the seeded RNG as well.
                    out.flip_positions = [
                        p * 8 + self._rng.randrange(8) for p in out.flip_positions
                    ]
                self._injected.append(
                    InjectedFault(
                        op,
                        rule.kind,
                        path,
                        offset,
                        nbytes,
                        rule.errno if rule.kind is FaultKind.ERROR else None,
                        _detail(rule, nbytes),
                    )
                )
        return out


def _detail(rule: FaultRule, nbytes: int) -> str:
    if rule.kind is FaultKind.SHORT:
        return f"{_short_len(rule, nbytes)} of {nbytes} bytes"
    if rule.kind is FaultKind.ERROR:
        return errno_mod.errorcode.get(rule.errno, str(rule.errno))
    return ""


def _short_len(rule: FaultRule, nbytes: int) -> int:
    if rule.short_bytes is not None:
        return min(rule.short_bytes, nbytes)
    return (nbytes // 2) // IO_ALIGNMENT * IO_ALIGNMENT


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
    ) -> _Decision:
        decision = self.plan._decide(op, handle.path, offset, nbytes)
        if decision.delay_s:
            time.sleep(decision.delay_s)
        rule = decision.fault
        if rule is not None and rule.kind is FaultKind.ERROR:
            raise OSError(rule.errno, os.strerror(rule.errno), handle.path)
        if rule is not None and rule.kind is FaultKind.HANG:
            assert rule.release is not None
            rule.release.wait()
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
            keep = min(n, _short_len(rule, len(view)))
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
            keep = _short_len(rule, len(view))
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
