"""Injected back-end faults, seen through DiskStore + TransferEngine and fed
into a real TierHierarchy: every fault is a failed key (never a crash, never
bad data), logged once with errno and path, and counted in DiskStore stats."""

from __future__ import annotations

import errno
import logging
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reliability_common import (
    BLOCK_BYTES,
    SENTINEL,
    EventLog,
    Rig,
    key_of,
    kvtier_warnings,
    pattern,
    run_hierarchy_spills,
    store_keys,
)

import kvtier
from kvtier.store.backends.factory import make_backend
from kvtier.store.reader import SlotReader
from kvtier.store.slabs import SlabFiles
from kvtier.store.slot import HEADER_SIZE, ReadOutcome
from kvtier.testing import fault_plan
from kvtier.testing.faults import (
    MAX_DELAY_S,
    FaultKind,
    FaultPlan,
    FaultRule,
    on_slot,
)
from kvtier.testing.residency import residency
from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.plans import Residency

SYNC = pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])


def fill_rows(rig: Rig, rows: range, first_key: int = 0) -> list[bytes]:
    keys = [key_of(first_key + i) for i in range(len(rows))]
    for key, row in zip(keys, rows):
        rig.cpu.array[row] = pattern(key)
    return keys


def _files(rig: Rig, backend: Any) -> SlabFiles:
    s = rig.store
    return SlabFiles.open(s.paths, s.fingerprint, s.num_slots, backend)


def slot_data(rig: Rig, slot: int, key: bytes) -> tuple[ReadOutcome, np.ndarray]:
    out = np.full(BLOCK_BYTES, SENTINEL, np.uint8)
    return rig.store.read_block(slot, key, out), out


# -- spill (write) faults -----------------------------------------------------


@SYNC
@pytest.mark.parametrize(
    "code", [errno.EIO, errno.ENOSPC, errno.EACCES], ids=["EIO", "ENOSPC", "EACCES"]
)
def test_write_error_fails_only_that_key(
    make_rig: Callable[..., Rig],
    caplog: pytest.LogCaptureFixture,
    sync: bool,
    code: int,
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.kvtier.store")
    rig = make_rig(sync=sync)
    keys = fill_rows(rig, range(4))
    before = rig.cpu.array[:4].copy()
    rig.plan.add(FaultRule.error(code, ops="write", **on_slot(rig.store, 2)))

    res = rig.spill(1, [(k, i, i) for i, k in enumerate(keys)])
    assert not res.success
    assert res.lost_keys == [keys[2]]
    assert res.bytes == 3 * BLOCK_BYTES
    for slot in (0, 1, 3):
        outcome, out = slot_data(rig, slot, keys[slot])
        assert outcome is ReadOutcome.OK
        assert np.array_equal(out, pattern(keys[slot]))
    assert slot_data(rig, 2, keys[2])[0] is ReadOutcome.EMPTY
    assert np.array_equal(rig.cpu.array[:4], before)  # a spill never writes CPU

    # The same fault again: counted again, logged only the first time.
    res = rig.spill(2, [(keys[2], 2, 2)])
    assert res.lost_keys == [keys[2]]
    stats = rig.store.stats()
    assert stats.io_errors == 2 and stats.checksum_failures == 0
    assert stats.blocks_written == 3
    logged = kvtier_warnings(caplog)
    assert len(logged) == 1, logged
    name = errno.errorcode[code]
    assert f"errno {code} ({name})" in logged[0]
    assert rig.store.slabs[0].path in logged[0]
    # The fault was hit three times: by the first spill's one write of
    # adjacent slots 2 and 3, by slot 2 written again alone (which block
    # of a failed write failed is unknown), and by the second spill.
    assert rig.plan.count(FaultKind.ERROR, "write") == 3


@SYNC
def test_an_error_of_a_write_of_several_blocks_that_passes_again_is_counted(
    make_rig: Callable[..., Rig],
    caplog: pytest.LogCaptureFixture,
    sync: bool,
) -> None:
    """Slots 2 and 3 go out in one write, which fails once; written again
    one by one they succeed. Every block is on disk, and the disk's error is
    still counted and logged once, as a block-at-a-time writer's would be
    (it was silent: nothing failed in the end)."""
    caplog.set_level(logging.WARNING, logger="vllm.kvtier.store")
    rig = make_rig(sync=sync)
    keys = fill_rows(rig, range(4))
    rig.plan.add(
        FaultRule.error(errno.EIO, ops="write", first_n=1, **on_slot(rig.store, 2))
    )
    res = rig.spill(1, [(k, i, i) for i, k in enumerate(keys)])
    assert res.success and res.bytes == 4 * BLOCK_BYTES
    for slot in range(4):
        outcome, out = slot_data(rig, slot, keys[slot])
        assert outcome is ReadOutcome.OK
        assert np.array_equal(out, pattern(keys[slot]))
    stats = rig.store.stats()
    assert (stats.io_errors, stats.blocks_written) == (1, 4)
    logged = kvtier_warnings(caplog)
    assert len(logged) == 1 and "errno 5 (EIO)" in logged[0], logged


@SYNC
def test_short_write_fails_the_key_and_never_reads_back(
    make_rig: Callable[..., Rig], caplog: pytest.LogCaptureFixture, sync: bool
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.kvtier.store")
    rig = make_rig(sync=sync)
    keys = fill_rows(rig, range(2))
    rig.plan.add(FaultRule.short(ops="write", **on_slot(rig.store, 1)))
    res = rig.spill(1, [(k, i, i) for i, k in enumerate(keys)])
    assert res.lost_keys == [keys[1]]
    # Half a slot reached the disk (new header, half the payload): torn.
    outcome, out = slot_data(rig, 1, keys[1])
    assert outcome is ReadOutcome.CHECKSUM_MISMATCH
    assert (out == SENTINEL).all()
    stats = rig.store.stats()
    assert stats.io_errors == 1 and stats.checksum_failures == 1
    logged = kvtier_warnings(caplog)
    short = [m for m in logged if "short write" in m]
    assert len(short) == 1 and "errno 5 (EIO)" in short[0]
    assert rig.store.slabs[0].path in short[0]


def test_bit_flip_on_write_is_caught_at_read(make_rig: Callable[..., Rig]) -> None:
    """Corruption on the way to the disk (the caller's row is never touched)
    is a checksum failure at the next read, not bad data."""
    rig = make_rig(num_slots=4)
    keys = fill_rows(rig, range(2))
    start = on_slot(rig.store, 1)["ranges"][0][0]
    rig.plan.add(
        FaultRule.bit_flip(at=[start + HEADER_SIZE + 5], ops="write", first_n=1)
    )
    assert rig.spill(1, [(k, i, i) for i, k in enumerate(keys)]).success
    assert np.array_equal(rig.cpu.array[1], pattern(keys[1]))
    assert slot_data(rig, 0, keys[0])[0] is ReadOutcome.OK
    outcome, out = slot_data(rig, 1, keys[1])
    assert outcome is ReadOutcome.CHECKSUM_MISMATCH and (out == SENTINEL).all()
    assert rig.store.stats().checksum_failures == 1


# -- promote (read) faults ------------------------------------------------------

READ_FAULTS: dict[str, Callable[[Rig, int], FaultRule]] = {
    "eio": lambda rig, slot: FaultRule.error(
        errno.EIO, ops="read", **on_slot(rig.store, slot)
    ),
    "short": lambda rig, slot: FaultRule.short(ops="read", **on_slot(rig.store, slot)),
    "flip_payload": lambda rig, slot: FaultRule.bit_flip(
        at=[on_slot(rig.store, slot)["ranges"][0][0] + HEADER_SIZE + 777],
        ops="read",
        **on_slot(rig.store, slot),
    ),
    "flip_header": lambda rig, slot: FaultRule.bit_flip(
        at=[on_slot(rig.store, slot)["ranges"][0][0] + 40],  # inside the key
        ops="read",
        **on_slot(rig.store, slot),
    ),
}
# fault -> (counter that must grow, text every log line must carry)
EXPECTED: dict[str, tuple[str, str]] = {
    "eio": ("io_errors", "errno 5 (EIO)"),
    "short": ("io_errors", "errno 5 (EIO): short read"),
    "flip_payload": ("checksum_failures", "payload checksum mismatch"),
    "flip_header": ("checksum_failures", "bad header"),
}


@SYNC
@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("fault", list(READ_FAULTS))
def test_read_fault_fails_promote_and_leaves_row_untouched(
    make_rig: Callable[..., Rig],
    caplog: pytest.LogCaptureFixture,
    sync: bool,
    compression: str,
    fault: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.kvtier.store")
    rig = make_rig(sync=sync, compression=compression)
    keys = fill_rows(rig, range(4))
    assert rig.spill(1, [(k, i, i) for i, k in enumerate(keys)]).success
    for slot in (1, 2):
        rig.plan.add(READ_FAULTS[fault](rig, slot))
    rig.cpu.array[8:12] = SENTINEL
    base = rig.store.stats()

    res = rig.promote(2, [(k, i, 8 + i) for i, k in enumerate(keys)])
    assert not res.success
    assert sorted(res.lost_keys) == sorted([keys[1], keys[2]])
    assert res.bytes == 2 * BLOCK_BYTES
    assert (rig.cpu.array[9:11] == SENTINEL).all()  # failed rows untouched
    for row in (8, 11):
        assert np.array_equal(rig.cpu.array[row], pattern(keys[row - 8]))

    counter, text = EXPECTED[fault]
    stats = rig.store.stats()
    grown = {
        "io_errors": stats.io_errors - base.io_errors,
        "checksum_failures": stats.checksum_failures - base.checksum_failures,
    }
    assert grown == {
        "io_errors": 2 if counter == "io_errors" else 0,
        "checksum_failures": 2 if counter == "checksum_failures" else 0,
    }
    logged = kvtier_warnings(caplog)
    assert len(logged) == 1, logged  # two faults, one line
    assert text in logged[0] and rig.store.slabs[0].path in logged[0]
    assert rig.plan.count(op="read") >= 2


def test_random_bit_flips_never_return_wrong_bytes(
    make_rig: Callable[..., Rig],
) -> None:
    """Flips anywhere in the slot (header padding included): whatever the
    outcome, OK always comes with exactly the written bytes."""
    rig = make_rig(num_slots=8)
    keys = fill_rows(rig, range(8))
    assert rig.spill(1, [(k, i, i) for i, k in enumerate(keys)]).success
    rig.plan.add(FaultRule.bit_flip(ops="read", flips=3))
    outcomes = []
    for _ in range(6):
        for slot, key in enumerate(keys):
            outcome, out = slot_data(rig, slot, key)
            outcomes.append(outcome)
            if outcome is ReadOutcome.OK:
                assert np.array_equal(out, pattern(key))
            else:
                assert outcome in (
                    ReadOutcome.CHECKSUM_MISMATCH,
                    ReadOutcome.BAD_HEADER,
                )
                assert (out == SENTINEL).all()
    rejected = sum(o is not ReadOutcome.OK for o in outcomes)
    assert rejected == rig.store.stats().checksum_failures
    assert rejected > 0  # 144 header + 64 KiB payload bytes of 68 KiB are checked


# -- rule selection: first-N, skip, probability, delay -------------------------


def test_skip_and_first_n_select_exact_ios(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(num_slots=6)
    rig.plan.add(FaultRule.error(errno.EIO, ops="write", skip=1, first_n=2))
    data = pattern(key_of(0))
    failed = []
    for slot in range(6):
        try:
            rig.store.write_block(slot, key_of(slot), data, rig.store.next_seq())
        except OSError as exc:
            assert exc.errno == errno.EIO
            failed.append(slot)
    assert failed == [1, 2]


def test_probability_is_seeded(tmp_path: Path, make_rig: Callable[..., Rig]) -> None:
    def failed_slots(name: str, seed: int) -> list[int]:
        plan = FaultPlan(
            [FaultRule.error(errno.EIO, ops="write", probability=0.5)], seed=seed
        )
        rig = make_rig(path=str(tmp_path / name), num_slots=32, plan=plan)
        failed = []
        for slot in range(32):  # sequential, so the RNG order is the slot order
            try:
                rig.store.write_block(
                    slot, key_of(slot), pattern(key_of(slot)), rig.store.next_seq()
                )
            except OSError:
                failed.append(slot)
        return failed

    a, b, c = failed_slots("a", 7), failed_slots("b", 7), failed_slots("c", 8)
    assert 0 < len(a) < 32
    assert a == b and a != c


def test_delays_are_bounded_and_change_no_data(make_rig: Callable[..., Rig]) -> None:
    with pytest.raises(ValueError):
        FaultRule.delay(MAX_DELAY_S + 1)
    rig = make_rig(num_slots=4)
    rig.plan.add(FaultRule.delay(0.02))
    keys = fill_rows(rig, range(4))
    assert rig.spill(1, [(k, i, i) for i, k in enumerate(keys)]).success
    rig.cpu.array[8:12] = SENTINEL
    assert rig.promote(2, [(k, i, 8 + i) for i, k in enumerate(keys)]).success
    for i, key in enumerate(keys):
        assert np.array_equal(rig.cpu.array[8 + i], pattern(key))
    # One write per batch of adjacent slots (two threads: two batches of
    # two), one read per promoted block.
    assert rig.plan.count(FaultKind.DELAY, "write") == 2
    assert rig.plan.count(FaultKind.DELAY, "read") == 4


def test_a_hang_never_released_fails_its_io_after_the_bound(
    make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test that fails before it releases a HANG must not leave a thread
    blocked for the rest of the run: past ``MAX_HANG_S`` the I/O fails as
    a hung disk's request does once the kernel gives up (ETIMEDOUT)."""
    monkeypatch.setattr(fault_plan, "MAX_HANG_S", 0.2)
    rig = make_rig(num_slots=4)
    keys = fill_rows(rig, range(4))
    assert rig.spill(1, [(k, i, i) for i, k in enumerate(keys)]).success
    never = threading.Event()
    rig.plan.add(FaultRule.hang(never, ops="read", **on_slot(rig.store, 2)))
    rig.cpu.array[8:12] = SENTINEL
    res = rig.promote(2, [(k, i, 8 + i) for i, k in enumerate(keys)])
    assert not never.is_set()
    assert not res.success and res.lost_keys == [keys[2]]
    assert (rig.cpu.array[10] == SENTINEL).all()
    for row in (8, 9, 11):
        assert np.array_equal(rig.cpu.array[row], pattern(keys[row - 8]))
    assert rig.plan.count(FaultKind.HANG, "read") == 1


def test_open_fault_fails_store_creation_clearly(
    tmp_path: Path, make_rig: Callable[..., Rig]
) -> None:
    plan = FaultPlan([FaultRule.error(errno.EACCES, ops="open")])
    with pytest.raises(PermissionError) as info:
        make_rig(path=str(tmp_path / "denied"), plan=plan)
    assert info.value.errno == errno.EACCES
    assert str(tmp_path / "denied") in str(info.value)


# -- production can never enable it ---------------------------------------------


def test_fault_layer_cannot_be_enabled_from_config() -> None:
    for name in ("faults", "fault", "FaultInjectingBackend"):
        with pytest.raises(ValueError):
            make_backend(name)
    # Production code is everything outside kvtier.testing (test helpers,
    # the fault layer among them); it never names the fault layer, and never
    # imports kvtier.testing at all.
    root = Path(kvtier.__file__).parent
    production = [
        p for p in root.rglob("*.py") if "testing" not in p.relative_to(root).parts
    ]
    assert root / "tools" / "cli.py" in production and root / "store" / "store.py" in production
    users = [
        str(p.relative_to(root))
        for p in production
        if re.search(
            r"\bfaults\b|FaultInjecting|FaultPlan|kvtier\.testing|from kvtier import testing",
            p.read_text(),
        )
    ]
    assert users == [], f"production code refers to the fault layer: {users}"


# -- into the hierarchy ------------------------------------------------------------


@pytest.mark.parametrize("read_fault", ["eio", "short", "flip_payload"])
def test_failed_jobs_drive_the_hierarchy(
    make_rig: Callable[..., Rig], read_fault: str
) -> None:
    rig = make_rig(num_slots=8, cpu_blocks=4)
    h = TierHierarchy(cpu_blocks=4, disk_blocks=8, spill_watermark=0.0)
    log = EventLog(h)
    first = [key_of(i) for i in range(4)]

    # Spill: EIO on the write of first[1]'s disk slot.
    store_keys(h, rig, first)
    orders = h.take_spills()
    dst = {it.key: it.dst_slot for o in orders for it in o.items}
    assert set(dst) == set(first)
    rule = rig.plan.add(
        FaultRule.error(errno.EIO, ops="write", **on_slot(rig.store, dst[first[1]]))
    )
    for order in orders:
        items = [(it.key, it.src_slot, it.dst_slot) for it in order.items]
        res = rig.spill(order.job_id, items)
        h.complete_spill(order.job_id, res.lost_keys)
        assert res.lost_keys == [first[1]]
    rig.plan.remove(rule)
    assert h.lookup(first[1]) is Residency.HIT_CPU  # stays CPU-only
    assert first[1] not in residency(h)["disk"]
    assert {first[0], first[2], first[3]} <= residency(h)["disk"]
    assert h.stats.spill_failures == 1
    log.check()

    # New blocks push the first ones out of CPU; they stay on disk (the
    # unspillable first[1] is simply dropped: a miss, not a wedge).
    second = [key_of(100 + i) for i in range(4)]
    store_keys(h, rig, second)
    assert all(r.success for r in run_hierarchy_spills(h, rig))
    assert h.lookup(first[1]) is Residency.MISS
    assert [h.lookup(k) for k in (first[2], first[3])] == [Residency.HIT_DISK] * 2
    log.check()

    # Load first[2] (read fault) and first[3] (clean) as a worker does:
    # straight from their slots, verified, with promotion rows.
    reader = SlotReader(_files(rig, rig.backend))
    for key, ok in ((first[2], False), (first[3], True)):
        plan = h.prepare_load([key])
        (loc,) = plan.locations
        assert loc.promote_slot is not None
        if not ok:
            rig.plan.add(READ_FAULTS[read_fault](rig, loc.slot))
        (read,) = reader.read([(loc.slot, key)])
        assert (read.outcome is ReadOutcome.OK) == ok
        if ok:
            assert np.array_equal(reader.rows[read.row], pattern(key))
        io_error = read.outcome is ReadOutcome.IO_ERROR
        h.complete_load(
            plan.load_id,
            [] if ok or io_error else [key],
            io_failed=[key] if io_error else [],
        )
    reader.close()

    # Bad bytes drop the copy; an I/O error (EIO, or a short read of a
    # full-size slab) keeps it, counted.
    transient = read_fault in ("eio", "short")
    assert h.lookup(first[2]) is (Residency.HIT_DISK if transient else Residency.MISS)
    assert h.lookup(first[3]) is Residency.HIT_CPU
    failures = h.disk_core.failures
    assert h.stats.load_failures == 1
    assert (failures.corrupt, failures.io_errors_kept) == (
        (0, 1) if transient else (1, 0)
    )
    log.check()
    read_errors = reader.stats().io_errors + reader.stats().checksum_failures
    assert read_errors == 1
    stats: Any = rig.store.stats()
    assert stats.io_errors + stats.checksum_failures == 1  # the write


def test_an_io_error_in_a_read_of_several_slots_is_pinned_to_its_slot_next_time(
    make_rig: Callable[..., Rig],
) -> None:
    """Consecutive slots are one read: an EIO from one bad sector fails the
    whole read, so every slot in it fails once. From the next batch on they
    are read alone until they read: only the bad slot keeps failing (its
    neighbours are not struck again) and stays alone, and once it reads all
    join up."""
    rig = make_rig()
    keys = [key_of(i) for i in range(4)]
    for slot, key in enumerate(keys):
        rig.store.write_block(slot, key, pattern(key), rig.store.next_seq())
    items = list(enumerate(keys))
    reader = SlotReader(_files(rig, rig.backend), capacity=4)
    reads = []  # (slab, offset) of each read the reader issues

    def counting(call: Callable[..., Any]) -> Callable[..., Any]:
        def counted(idx: int, buf: Any, offset: int) -> Any:
            reads.append((idx, offset))
            return call(idx, buf, offset)

        return counted

    files = reader.files
    files.read = counting(files.read)  # type: ignore[method-assign]
    files.submit_read = counting(files.submit_read)  # type: ignore[method-assign]
    rule = rig.plan.add(FaultRule.error(errno.EIO, ops="read", **on_slot(rig.store, 2)))
    try:
        first = reader.read(items)
        assert [r.outcome for r in first] == [ReadOutcome.IO_ERROR] * 4
        assert len(reads) == 1
        for attempt in range(3):
            reads.clear()
            again = reader.read(items)
            assert [r.outcome for r in again] == [
                ReadOutcome.OK,
                ReadOutcome.OK,
                ReadOutcome.IO_ERROR,
                ReadOutcome.OK,
            ]
            for slot in (0, 1, 3):
                assert np.array_equal(reader.rows[again[slot].row], pattern(keys[slot]))
            # First each slot alone; then only the bad one (0 and 1 join up).
            assert len(reads) == (4 if attempt == 0 else 3)
        rig.plan.remove(rule)  # the sector is remapped: the slot reads again
        healed = reader.read(items)
        assert [r.outcome for r in healed] == [ReadOutcome.OK] * 4
        reads.clear()
        assert [r.outcome for r in reader.read(items)] == [ReadOutcome.OK] * 4
        assert len(reads) == 1  # one read of the four again
    finally:
        reader.close()


def test_reads_into_part_of_the_bounce_area_leave_the_rest_alone(
    make_rig: Callable[..., Rig],
) -> None:
    # The load thread reads into parts of the bounce area: a read into
    # one part must not touch the others, whose rows copies may still read.
    rig = make_rig()
    keys = [key_of(i) for i in range(4)]
    for slot, key in enumerate(keys):
        rig.store.write_block(slot, key, pattern(key), rig.store.next_seq())
    reader = SlotReader(_files(rig, rig.backend), capacity=4)
    try:
        assert reader.capacity == 4
        low = reader.read([(0, keys[0]), (1, keys[1])])
        assert [r.row for r in low] == [0, 1]
        high = reader.read([(3, keys[3]), (2, keys[2])], first_row=2)
        assert [r.outcome for r in high] == [ReadOutcome.OK] * 2
        assert sorted(r.row for r in high) == [2, 3]
        for slot, r in zip((3, 2), high):
            assert np.array_equal(reader.rows[r.row], pattern(keys[slot]))
        for slot in (0, 1):  # the first part still holds its blocks
            assert np.array_equal(reader.rows[slot], pattern(keys[slot]))
        with pytest.raises(ValueError, match="exceed capacity"):
            reader.read([(0, keys[0]), (1, keys[1])], first_row=3)
    finally:
        reader.close()


def test_a_read_that_raises_leaves_no_io_writing_the_bounce_area(
    make_rig: Callable[..., Rig],
) -> None:
    # The worker contains an exception from a read and may read into the
    # same rows next: no run of the failed read may still be landing there.
    rig = make_rig()
    keys = [key_of(i) for i in range(3)]
    for slot, key in enumerate(keys):
        rig.store.write_block(slot, key, pattern(key), rig.store.next_seq())
    pool = ThreadPoolExecutor(1)
    futures: list[Future[int]] = []

    class Flaky:
        """The first run fails with a bug at once, the second lands late."""

        def __getattr__(self, name: str) -> Any:
            return getattr(rig.backend, name)

        def submit_read(self, handle: Any, buf: Any, offset: int) -> Future[int]:
            if not futures:
                fut: Future[int] = Future()
                fut.set_exception(RuntimeError("a bug in the back end"))
            else:

                def late() -> int:
                    time.sleep(0.2)  # a slow disk
                    return rig.backend.submit_read(handle, buf, offset).result()

                fut = pool.submit(late)
            futures.append(fut)
            return fut

    reader = SlotReader(_files(rig, Flaky()), capacity=4)  # type: ignore[arg-type]
    try:
        with pytest.raises(RuntimeError, match="a bug"):
            reader.read([(0, keys[0]), (2, keys[2])])  # two runs
        assert len(futures) == 2 and all(f.done() for f in futures)
    finally:
        reader.close()
        pool.shutdown()
