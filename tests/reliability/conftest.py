"""Fixtures of the reliability tests (helpers live in reliability_common)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from reliability_common import (
    BLOCK_BYTES,
    Mounts,
    Rig,
    make_fingerprint,
)

from kvtier.host.cpu_tier import CpuBlockBuffer
from kvtier.store.backends.posix import PosixBackend
from kvtier.store.store import DiskStore
from kvtier.store.transfers import TransferEngine
from kvtier.testing.faults import FaultInjectingBackend, FaultPlan


@pytest.fixture
def make_rig(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    """make_rig(path=..., num_slots=16, cpu_blocks=16, sync=None, direct=True,
    compression="none", plan=None) -> Rig; all of it is torn down afterwards."""
    rigs: list[Rig] = []

    def make(
        path: str | None = None,
        num_slots: int = 16,
        cpu_blocks: int = 16,
        sync: bool | None = None,
        direct: bool = True,
        compression: str = "none",
        plan: FaultPlan | None = None,
    ) -> Rig:
        plan = plan if plan is not None else FaultPlan(seed=1234)
        backend = FaultInjectingBackend(
            PosixBackend(threads=2, direct=direct), plan, sync=sync
        )
        try:
            store = DiskStore(
                [path or str(tmp_path / "disk")],
                num_slots,
                BLOCK_BYTES,
                make_fingerprint(),
                backend=backend,
                compression=compression,
            )
        except BaseException:
            backend.shutdown()
            raise
        cpu = CpuBlockBuffer(cpu_blocks, BLOCK_BYTES)
        rig = Rig(plan, backend, store, cpu, TransferEngine([store], [cpu], threads=2))
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.engine.shutdown()
        rig.store.close()
        rig.backend.shutdown()
        rig.cpu.close()


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[Mounts]:
    """Small tmpfs/ext4 mounts (skips without mount permission); always
    unmounted at teardown."""
    m = Mounts(tmp_path)
    try:
        yield m
    finally:
        m.unmount_all()
