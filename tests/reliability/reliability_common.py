"""Helpers of the reliability tests (imported by conftest and the tests):
layouts, key-derived block contents, a TransferEngine rig over a
fault-injecting back end, small real file systems, hierarchy drivers."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvtier.host.cpu_tier import CpuBlockBuffer
from kvtier.store.slot import LayoutFingerprint
from kvtier.store.store import DiskStore
from kvtier.store.transfers import FinishedJob, TransferEngine
from kvtier.testing.faults import FaultInjectingBackend, FaultPlan
from kvtier.testing.residency import replay, residency
from kvtier.tiers.events import TierEvent
from kvtier.tiers.hierarchy import TierHierarchy

BLOCK_BYTES = 64 * 1024
SENTINEL = 0xCD


def make_fingerprint(block_bytes: int = BLOCK_BYTES) -> LayoutFingerprint:
    return LayoutFingerprint(
        model="test/reliability",
        dtype="bfloat16",
        block_bytes=block_bytes,
        geometry="layers=2,kv=2,heads=8,head=128,tokens=16",
        tp_rank=0,
        tp_size=1,
    )


def key_of(i: int) -> bytes:
    """A vLLM-shaped key: 32-byte hash + 4-byte group id."""
    return i.to_bytes(32, "little") + b"\x00\x00\x00\x01"


def pattern(key: bytes, nbytes: int = BLOCK_BYTES) -> np.ndarray:
    """Block content derived from the key alone."""
    seed = int.from_bytes(key[:8], "little") ^ len(key) ^ (key[-1] << 56)
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def kvtier_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "vllm.kvtier.store" and r.levelno >= logging.WARNING
    ]


@dataclass
class Rig:
    """DiskStore + TransferEngine over FaultInjectingBackend(PosixBackend)."""

    plan: FaultPlan
    backend: FaultInjectingBackend
    store: DiskStore
    cpu: CpuBlockBuffer
    engine: TransferEngine

    def spill(self, job_id: int, items: Iterable[tuple[bytes, int, int]]) -> FinishedJob:
        self.engine.submit_spill(job_id, items)
        return self._result(job_id)

    def promote(
        self, job_id: int, items: Iterable[tuple[bytes, int, int]]
    ) -> FinishedJob:
        self.engine.submit_promote(job_id, items)
        return self._result(job_id)

    def _result(self, job_id: int) -> FinishedJob:
        assert self.engine.wait([job_id], timeout=30)
        (result,) = [r for r in self.engine.get_finished() if r.job_id == job_id]
        return result


class EventLog:
    """Accumulates a hierarchy's events so replay can be checked at any time."""

    def __init__(self, h: TierHierarchy) -> None:
        self.h = h
        self.events: list[TierEvent] = []

    def check(self) -> None:
        self.events += self.h.take_events()
        assert replay(self.events) == residency(self.h)


# -- small real file systems ----------------------------------------------


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


class Mounts:
    """Mounts size-limited file systems; ``unmount_all`` always cleans up."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.mounted: list[str] = []

    def mount(self, kind: str, size_mib: int) -> str:
        if os.geteuid() != 0:
            pytest.skip("mounting a small file system needs root (CI runs as root)")
        point = self.base / f"{kind}-mnt-{len(self.mounted)}"
        point.mkdir()
        if kind == "tmpfs":
            cmd = ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs"]
        elif kind == "ext4":
            if shutil.which("mkfs.ext4") is None:
                pytest.skip("mkfs.ext4 is not installed")
            image = self.base / f"ext4-{len(self.mounted)}.img"
            with open(image, "wb") as f:
                f.truncate(size_mib << 20)
            made = _run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)])
            if made.returncode:
                pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
            cmd = ["mount", "-o", "loop", str(image)]
        else:
            raise ValueError(kind)
        done = _run([*cmd, str(point)])
        if done.returncode:
            pytest.skip(
                f"cannot mount a {kind} here ({done.stderr.strip()}); "
                "needs root with mount permission (CI has it)"
            )
        self.mounted.append(str(point))
        return str(point)

    def remount_readonly(self, point: str) -> None:
        done = _run(["mount", "-o", "remount,ro", point])
        assert done.returncode == 0, done.stderr

    def unmount_all(self) -> None:
        for point in reversed(self.mounted):
            if _run(["umount", point]).returncode:
                # Something still holds it (a failed test's open file):
                # detach lazily so the mount never outlives the test.
                with contextlib.suppress(Exception):
                    _run(["umount", "-l", point])
        self.mounted.clear()


def fill_file_system(path: str) -> str:
    """Write a filler file under ``path`` until the file system is full."""
    filler = os.path.join(path, "filler.bin")
    chunk = b"\xff" * (1 << 20)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            try:
                if os.write(fd, chunk) < len(chunk):
                    continue  # partial: the next write reports ENOSPC
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    break
                raise
        # Small writes to use up the last partial megabyte.
        with contextlib.suppress(OSError):
            while os.write(fd, chunk[:4096]):
                pass
    finally:
        os.close(fd)
    return filler


def run_hierarchy_spills(h: TierHierarchy, rig: Rig) -> list[FinishedJob]:
    """Execute every spill order of ``h`` through ``rig`` and complete it."""
    results = []
    for order in h.take_spills():
        items = [(it.key, it.src_slot, it.dst_slot) for it in order.items]
        result = rig.spill(order.job_id, items)
        h.complete_spill(order.job_id, result.lost_keys)
        results.append(result)
    return results


def store_keys(h: TierHierarchy, rig: Rig, keys: list[bytes]) -> None:
    """GPU -> CPU store of ``keys`` (contents: ``pattern(key)``)."""
    plan = h.prepare_store(keys)
    assert plan is not None
    for key, slot in zip(plan.keys_to_store, plan.cpu_slots):
        rig.cpu.array[slot] = pattern(key)
    h.complete_store(plan.keys_to_store)
