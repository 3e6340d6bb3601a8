"""SlotReader(device=...) on CPU tensors (and, marked ``gpu``, on CUDA): real
slabs written by DiskStore, faults injected at the back-end boundary."""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from kvtier.store.backends.posix import PosixBackend
from kvtier.store.reader import SlotReader, staging_mode, wait_reads
from kvtier.store.slabs import SlabFiles
from kvtier.store.slot import HEADER_SIZE, LayoutFingerprint, ReadOutcome
from kvtier.store.store import DiskStore
from kvtier.testing.faults import FaultInjectingBackend, FaultPlan, FaultRule, on_slot

torch = pytest.importorskip("torch")

BLOCK = 16384
SLOTS = 8


def fp() -> LayoutFingerprint:
    return LayoutFingerprint("t/m", "bfloat16", BLOCK, "g", 0, 1)


def key_of(slot: int) -> bytes:
    return b"k%03d" % slot


def block_of(slot: int) -> np.ndarray:
    return np.random.default_rng(100 + slot).integers(0, 256, BLOCK, dtype=np.uint8)


def write_store(paths: list[str], compression: str = "none") -> DiskStore:
    store = DiskStore(
        paths, SLOTS, BLOCK, fp(), backend="posix", compression=compression
    )
    for s in range(SLOTS):
        store.write_block(s, key_of(s), block_of(s), seq=s + 1)
    return store


@pytest.fixture
def two_paths(tmp_path: Path) -> Iterator[tuple[list[str], DiskStore]]:
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for p in paths:
        os.mkdir(p)
    store = write_store(paths)
    store.close()  # attributes (paths, slabs) stay usable for on_slot
    yield paths, store


def _files(paths: list[str], backend: object, owns: bool = False) -> SlabFiles:
    return SlabFiles.open(paths, fp(), SLOTS, backend, owns_backend=owns)  # type: ignore[arg-type]


def _reader(
    paths: list[str], backend: object, owns_backend: bool = False, **kw: object
) -> SlotReader:
    return SlotReader(_files(paths, backend, owns_backend), device="cpu", **kw)  # type: ignore[arg-type]


def _assert_rows(reader: SlotReader, res: list, items: list) -> None:
    rows = reader.rows.cpu().numpy()
    for (slot, _), r in zip(items, res):
        if r.outcome is ReadOutcome.OK:
            assert np.array_equal(rows[r.row], block_of(slot))


def test_posix_reads_and_verifies_all_slots(
    two_paths: tuple[list[str], DiskStore], caplog: pytest.LogCaptureFixture
) -> None:
    paths, _ = two_paths
    backend = PosixBackend(threads=2)
    caplog.set_level(logging.INFO, logger="vllm.kvtier.store")
    reader = _reader(paths, backend, capacity=SLOTS, owns_backend=True)
    try:
        assert reader.mode == "posix" == staging_mode(backend)
        assert "device staging: mode posix" in caplog.text
        items = [(s, key_of(s)) for s in (5, 0, 3, 6, 1)]
        res = reader.read(items, first_row=2)
        assert [r.outcome for r in res] == [ReadOutcome.OK] * 5
        # Rows follow file order (slab 0: slots 0, 6; slab 1: 1, 3, 5).
        assert [r.row for r in res] == [6, 2, 5, 3, 4]
        _assert_rows(reader, res, items)
        # The wrong key for a slot is refused.
        (bad,) = reader.read([(4, key_of(5))])
        assert bad.outcome is ReadOutcome.KEY_MISMATCH
        with pytest.raises(ValueError, match="capacity"):
            reader.read([(0, key_of(0))], first_row=SLOTS)
        with pytest.raises(IndexError):
            reader.read([(SLOTS, b"x")])
    finally:
        reader.close()
    with pytest.raises(RuntimeError, match="closed"):
        reader.read([(0, key_of(0))])


@pytest.mark.parametrize("fault", ["eio", "short", "bit_flip", "open_eio"])
def test_posix_faults_fail_only_what_they_hit(
    two_paths: tuple[list[str], DiskStore], fault: str
) -> None:
    """Slots 0..5 over two paths are two reads (slab 0: 0, 2, 4; slab 1: 1,
    3, 5). A failed read or open fails its slab's run; a read the device
    cut inside slot 3 (the slab is whole: an I/O error) fails 3 and 5 (1
    landed whole); a flipped byte its slot only."""
    paths, store = two_paths
    victim = 3
    plan = FaultPlan(seed=1)
    where = on_slot(store, victim)
    if fault == "eio":
        plan.add(FaultRule.error(errno.EIO, ops="read", **where))
        want, hit = ReadOutcome.IO_ERROR, {1, 3, 5}
    elif fault == "short":
        cut = store.slot_size + HEADER_SIZE + 4096
        plan.add(FaultRule.short(cut, ops="read", **where))
        want, hit = ReadOutcome.IO_ERROR, {3, 5}
    elif fault == "bit_flip":
        start = where["ranges"][0][0]
        plan.add(FaultRule.bit_flip([start + HEADER_SIZE + 777], ops="read", **where))
        want, hit = ReadOutcome.CHECKSUM_MISMATCH, {3}
    else:
        plan.add(FaultRule.error(errno.EIO, ops="open", path=where["path"]))
        want, hit = ReadOutcome.IO_ERROR, {1, 3, 5}
    backend = FaultInjectingBackend(PosixBackend(threads=2), plan)
    reader = _reader(paths, backend, capacity=SLOTS, owns_backend=True)
    try:
        items = [(s, key_of(s)) for s in (4, 3, 0, 5, 1, 2)]
        res = reader.read(items)
        assert plan.injected, "the fault never fired"
        for (slot, _), r in zip(items, res):
            assert r.outcome is (want if slot in hit else ReadOutcome.OK), (slot, r)
        _assert_rows(reader, res, items)
    finally:
        reader.close()


@pytest.mark.parametrize("cause", ["device", "truncated-slab"])
def test_short_read_inside_a_run_keeps_the_whole_slots(
    tmp_path: Path, cause: str
) -> None:
    """A read that stops inside a run fails the slots it did not cover:
    as an I/O error when the slab is whole (the device cut it short), as
    TRUNCATED when the slab now ends inside them."""
    store = write_store([str(tmp_path)])
    store.close()
    ss = store.slot_size
    plan = FaultPlan(seed=1)
    # One path: slots 2, 3, 4 are one run; the read stops 1.5 slots in.
    where = on_slot(store, 2)
    if cause == "device":
        plan.add(FaultRule.short(ss + ss // 2, ops="read", **where))
        want = ReadOutcome.IO_ERROR
    else:
        os.truncate(where["path"], where["ranges"][0][0] + ss + ss // 2)
        want = ReadOutcome.TRUNCATED
    backend = FaultInjectingBackend(PosixBackend(threads=1), plan)
    reader = SlotReader(_files([str(tmp_path)], backend, True), device="cpu", capacity=4)
    try:
        items = [(s, key_of(s)) for s in (2, 3, 4)]
        res = reader.read(items)
        assert [r.outcome for r in res] == [ReadOutcome.OK, want, want]
        _assert_rows(reader, res, items)
    finally:
        reader.close()


def test_compressed_and_old_slots_are_host_only(tmp_path: Path) -> None:
    store = write_store([str(tmp_path)], compression="zstd")
    # Compressible data so zstd is kept for this slot.
    store.write_block(0, key_of(0), np.zeros(BLOCK, np.uint8), seq=99)
    store.close()
    backend = PosixBackend(threads=1)
    reader = SlotReader(_files([str(tmp_path)], backend, True), device="cpu", capacity=2)
    try:
        (r,) = reader.read([(0, key_of(0))])
        assert r.outcome is ReadOutcome.HOST_ONLY and "codec" in r.detail
    finally:
        reader.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_staging_posix_bounce(two_paths: tuple[list[str], DiskStore]) -> None:
    paths, store = two_paths
    plan = FaultPlan(seed=1)
    start = on_slot(store, 2)["ranges"][0][0]
    plan.add(
        FaultRule.bit_flip([start + HEADER_SIZE + 5], ops="read", **on_slot(store, 2))
    )
    backend = FaultInjectingBackend(PosixBackend(threads=2), plan)
    reader = _reader(paths, backend, device="cuda", capacity=SLOTS, owns_backend=True)
    try:
        assert reader.staging.is_cuda and reader.mode == "posix"
        items = [(s, key_of(s)) for s in range(SLOTS)]
        res = reader.read(items)
        for (slot, _), r in zip(items, res):
            want = ReadOutcome.CHECKSUM_MISMATCH if slot == 2 else ReadOutcome.OK
            assert r.outcome is want
        _assert_rows(reader, res, items)
    finally:
        reader.close()


def test_both_readers_read_into_one_kind_of_host_area(tmp_path: Path) -> None:
    """``bounce_area``: 4 KiB-aligned, C-contiguous, touched (zeros) unless
    pinned; the host reader's area and a CPU staging tensor come from it."""
    from kvtier.store.reader import SlotReader, bounce_area

    for pin in (False, True):
        area, owner = bounce_area(3 * 4096 + 512, pin=pin)
        assert area.dtype == np.uint8 and area.flags.c_contiguous
        assert area.size == 3 * 4096 + 512 and area.ctypes.data % 4096 == 0
        assert (owner is not None) == (pin and torch.cuda.is_available())
        if owner is None:
            assert not area.any()
    backend = PosixBackend(threads=1)
    host = SlotReader(_files([str(tmp_path)], backend, True), capacity=SLOTS)
    staging = _reader([str(tmp_path)], backend, capacity=4)
    try:
        assert host.rows.ctypes.data % 4096 == HEADER_SIZE % 4096
        assert staging.staging.data_ptr() % 4096 == 0
        assert not staging.staging.any()
    finally:
        staging.close()
        host.close()
        backend.shutdown()


@pytest.mark.parametrize("device", [None, "cpu"])
def test_an_area_too_large_to_allocate_names_the_key(
    tmp_path: Path, device: str | None
) -> None:
    """A bounce (or staging) area past what the host can allocate fails the
    reader's construction with an error naming ``disk_load_buffer_bytes``,
    the key that sized it, not a bare allocator error."""
    backend = PosixBackend(threads=1)
    try:
        files = _files([str(tmp_path)], backend, True)
        with pytest.raises(MemoryError, match="lower disk_load_buffer_bytes") as info:
            SlotReader(files, device=device, capacity=1 << 50)
        assert f"area of {(1 << 50) * files.slot_size} B" in str(info.value)
    finally:
        backend.shutdown()


@pytest.mark.parametrize("kind", ["host", "device"])
def test_a_held_read_is_not_ready_and_a_timed_wait_gives_up(
    two_paths: tuple[list[str], DiskStore], kind: str
) -> None:
    """``ready`` / ``wait(timeout)``, what the load thread polls a batch
    with: False while one read of it is held, True once it returned; then
    the batch completes with every slot whole."""
    import threading

    from kvtier.store.reader import SlotReader

    paths, store = two_paths
    release = threading.Event()
    plan = FaultPlan(seed=1)
    plan.add(FaultRule.hang(release, ops="read", **on_slot(store, 3)))
    backend = FaultInjectingBackend(PosixBackend(threads=2), plan)
    if kind == "host":
        reader = SlotReader(_files(paths, backend, True), capacity=SLOTS)
    else:
        reader = _reader(paths, backend, capacity=SLOTS)
    try:
        items = [(s, key_of(s)) for s in (0, 2, 3, 5)]
        pending = reader.submit(items)
        assert not reader.wait(pending, 0.05)
        assert not reader.ready(pending)
        release.set()
        assert reader.wait(pending, 10.0)
        assert reader.ready(pending)
        res = reader.complete(pending)
        assert [r.outcome for r in res] == [ReadOutcome.OK] * 4
        rows = reader.rows if kind == "host" else reader.rows.numpy()
        for (slot, _), r in zip(items, res):
            assert np.array_equal(rows[r.row], block_of(slot))
    finally:
        release.set()
        reader.close()
        backend.shutdown()


# ------------------------------------------- waiting for reads of either kind


class _Polled:
    """A read that only says done() (no Future), like kvikio's."""

    def __init__(self, landed: threading.Event, nbytes: int) -> None:
        self.landed, self.nbytes = landed, nbytes

    def done(self) -> bool:
        return self.landed.is_set()

    def result(self) -> int:
        assert self.landed.wait(10)
        return self.nbytes


def test_a_held_read_of_either_kind_keeps_wait_reads_false_until_it_lands() -> None:
    """A Future-backed read and a polled one (kvikio's IOFuture has no timed
    wait) are waited for one way, with a deadline."""
    fut: Future[int] = Future()
    landed = threading.Event()
    reads = [fut, _Polled(landed, 4096)]
    assert not wait_reads(reads, 0.02)
    fut.set_result(8192)
    assert not wait_reads(reads, 0.02)  # the polled one is still out
    assert [r.done() for r in reads] == [True, False]
    landed.set()
    assert wait_reads(reads, 10.0)
    assert [r.result() for r in reads] == [8192, 4096]


def test_a_failed_read_raises_from_its_result_not_from_wait_reads() -> None:
    fut: Future[int] = Future()
    fut.set_exception(OSError(5, "EIO"))
    assert wait_reads([fut], 1.0) and fut.done()
    with pytest.raises(OSError):
        fut.result()
