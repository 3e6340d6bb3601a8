"""The fault plan of :mod:`kvtier.testing.faults`: which I/Os fail, and how.

FOR TESTS ONLY. :class:`FaultRule` selects I/Os (operation, path, byte
ranges, probability, skip, first_n) and says what happens to them;
:class:`FaultPlan` holds the rules, decides each I/O's fault with a seeded
RNG and records every injection. The back end that applies the decisions
is :class:`kvtier.testing.faults.FaultInjectingBackend`.
"""

from __future__ import annotations

import errno as errno_mod
import os
import random
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from kvtier.store.backends.base import IO_ALIGNMENT
from kvtier.store.slabs import locate

if TYPE_CHECKING:
    from kvtier.store.store import DiskStore

# Bound on the total injected delay of one I/O, so no plan can hang a test.
MAX_DELAY_S = 2.0
# Bound on a HANG: a test that fails before it sets the release event must
# not leave a thread blocked for the rest of the run (a pytest process that
# never exits). Past it the I/O fails with ETIMEDOUT, as a hung disk's
# request does once the kernel gives up on it.
MAX_HANG_S = 300.0


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
    idx, local = locate(slot, len(store.paths))
    slab = store.slabs[idx]
    start = slab.offset(local)
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
class Decision:
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

    def _decide(self, op: Op, path: str, offset: int, nbytes: int) -> Decision:
        out = Decision()
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
        return f"{short_len(rule, nbytes)} of {nbytes} bytes"
    if rule.kind is FaultKind.ERROR:
        return errno_mod.errorcode.get(rule.errno, str(rule.errno))
    return ""


def short_len(rule: FaultRule, nbytes: int) -> int:
    if rule.short_bytes is not None:
        return min(rule.short_bytes, nbytes)
    return (nbytes // 2) // IO_ALIGNMENT * IO_ALIGNMENT
