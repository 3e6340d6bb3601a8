"""ENOSPC on real, tiny file systems (tmpfs and a loop-mounted ext4 image).

Slabs are preallocated, so a full disk normally shows up when a store is
created, not during spills. Spills can only hit ENOSPC when the slab is
sparse (a file system without fallocate); then every failed write is a
failed key, never a crash, and the spills work again once space is freed.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable

import numpy as np
import pytest
from reliability_common import (
    BLOCK_BYTES,
    SENTINEL,
    EventLog,
    Mounts,
    Rig,
    fill_file_system,
    key_of,
    kvtier_warnings,
    make_fingerprint,
    pattern,
    run_hierarchy_spills,
    store_keys,
)

from kvtier.store import slabs as slab_mod
from kvtier.store.backends.posix import PosixBackend
from kvtier.store.slot import ReadOutcome
from kvtier.store.store import DiskStore
from kvtier.testing.residency import residency
from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.plans import Residency

FS_MIB = 16
KINDS = pytest.mark.parametrize("kind", ["tmpfs", "ext4"])


@KINDS
def test_store_larger_than_the_fs_fails_clearly_and_frees_space(
    mounts: Mounts, kind: str
) -> None:
    point = mounts.mount(kind, FS_MIB)
    free_before = shutil.disk_usage(point).free
    too_many = 2 * (FS_MIB << 20) // BLOCK_BYTES
    with pytest.raises(OSError) as info:
        DiskStore([point], too_many, BLOCK_BYTES, make_fingerprint(), backend="posix")
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename is not None and point in info.value.filename
    assert "slab" in str(info.value)
    # Nothing half-allocated is left behind to starve the file system.
    assert shutil.disk_usage(point).free >= free_before - (1 << 20)

    # A store that fits can then be created and used.
    with DiskStore(
        [point], 32, BLOCK_BYTES, make_fingerprint(), backend="posix"
    ) as store:
        store.write_block(0, key_of(0), pattern(key_of(0)), store.next_seq())
        out = np.empty(BLOCK_BYTES, np.uint8)
        assert store.read_block(0, key_of(0), out) is ReadOutcome.OK
        assert np.array_equal(out, pattern(key_of(0)))


@KINDS
def test_preallocated_slab_keeps_working_on_a_full_fs(
    mounts: Mounts, make_rig: Callable[..., Rig], kind: str
) -> None:
    point = mounts.mount(kind, FS_MIB)
    rig = make_rig(path=point, num_slots=32)
    fill_file_system(point)
    assert shutil.disk_usage(point).free < BLOCK_BYTES
    keys = [key_of(i) for i in range(8)]
    for i, key in enumerate(keys):
        rig.cpu.array[i] = pattern(key)
    res = rig.spill(1, [(k, i, i) for i, k in enumerate(keys)])
    assert res.success and res.lost_keys == []
    out = np.empty(BLOCK_BYTES, np.uint8)
    for i, key in enumerate(keys):
        assert rig.store.read_block(i, key, out) is ReadOutcome.OK
        assert np.array_equal(out, pattern(key))
    assert rig.store.stats().io_errors == 0


@KINDS
def test_sparse_slab_on_full_fs_fails_keys_then_recovers(
    mounts: Mounts,
    make_rig: Callable[..., Rig],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    kind: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.kvtier.store")
    point = mounts.mount(kind, FS_MIB)

    def no_fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    # A file system without fallocate: the slab falls back to a sparse file.
    monkeypatch.setattr(slab_mod.os, "posix_fallocate", no_fallocate)
    rig = make_rig(path=point, num_slots=32, cpu_blocks=8)
    monkeypatch.undo()
    slab = rig.store.slabs[0].path
    assert os.stat(slab).st_blocks == 0  # really sparse
    filler = fill_file_system(point)

    h = TierHierarchy(cpu_blocks=8, disk_blocks=32, spill_watermark=0.0)
    log = EventLog(h)
    keys = [key_of(i) for i in range(4)]
    store_keys(h, rig, keys)
    results = run_hierarchy_spills(h, rig)
    failed = [k for r in results for k in r.lost_keys]
    assert sorted(failed) == sorted(keys)
    for key in keys:
        assert h.lookup(key) is Residency.HIT_CPU  # still served from CPU
    assert residency(h)["disk"] == set() and h.stats.spill_failures == 4
    log.check()

    stats = rig.store.stats()
    assert stats.io_errors == 4 and stats.blocks_written == 0
    logged = kvtier_warnings(caplog)
    assert len(logged) == 1, logged
    assert "errno 28 (ENOSPC)" in logged[0] and slab in logged[0]
    out = np.full(BLOCK_BYTES, SENTINEL, np.uint8)
    for slot in range(32):
        # Nothing (or only a torn prefix) reached the disk: never served.
        assert rig.store.read_block(slot, keys[0], out) is not ReadOutcome.OK
    assert (out == SENTINEL).all()

    # Space comes back: the very same store spills again.
    os.unlink(filler)
    more = [key_of(100 + i) for i in range(4)]
    store_keys(h, rig, more)
    results = run_hierarchy_spills(h, rig)
    assert all(r.success for r in results)
    for key in more:
        assert h.lookup(key) is Residency.HIT_CPU and key in residency(h)["disk"]
        block = h.disk.get(key) if h.disk is not None else None
        assert block is not None
        assert rig.store.read_block(block.slot, key, out) is ReadOutcome.OK
        assert np.array_equal(out, pattern(key))
    log.check()


def test_posix_backend_reports_enospc_with_path(mounts: Mounts) -> None:
    """The raw back end surfaces ENOSPC as OSError naming the file."""
    point = mounts.mount("tmpfs", 1)
    path = os.path.join(point, "sparse")
    with open(path, "wb") as f:
        f.truncate(4 << 20)
    backend = PosixBackend(threads=1)
    handle = backend.open(path)
    try:
        buf = np.full(2 << 20, 7, np.uint8)
        with pytest.raises(OSError) as info:
            backend.write_sync(handle, buf, 0)
        assert info.value.errno == errno.ENOSPC and info.value.filename == path
    finally:
        backend.close(handle)
        backend.shutdown()
