"""One slab layout, one verification: the writer, the host readers, ``kvtier
inspect``/``verify`` and the device staging reader agree on every slot.

Real DiskStore slabs on a real file system are damaged the way disks and
stale files damage them; every reader is asked about the same slots and each
answer is compared with the expected outcome (and, where OK, with the bytes).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.store.backends.posix import PosixBackend
from kvtier.store.checksum import device_checksum
from kvtier.store.reader import SlotReader, plan_runs
from kvtier.store.scan import scan
from kvtier.store.slabs import (
    SlabFiles,
    find_stores,
    global_slot,
    locate,
)
from kvtier.store.slot import HEADER_SIZE, LayoutFingerprint, ReadOutcome, SlotHeader
from kvtier.store.store import DiskStore
from kvtier.testing.state import pack_version_1, verify

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_SLOTS = 8


def fp(block_bytes: int) -> LayoutFingerprint:
    return LayoutFingerprint("t/m", "bfloat16", block_bytes, "g", 0, 1)


def key_of(slot: int) -> bytes:
    return b"key-%04d" % slot


def block_of(slot: int, block_bytes: int) -> np.ndarray:
    return np.random.default_rng(slot).integers(0, 256, block_bytes, dtype=np.uint8)


def test_plan_runs_reads_file_order_in_as_few_runs_as_the_files_allow() -> None:
    rng = np.random.default_rng(5)
    for stripes in (1, 2, 3):
        slots = [int(s) for s in rng.permutation(12)]
        runs, row_of = plan_runs(slots, stripes, num_slots=12, first_row=4)
        # All of 0..11 are asked for: each slab's are consecutive, one run.
        assert len(runs) == stripes
        assert sorted(row_of) == list(range(4, 16))
        for run in runs:
            assert run.local == 0 and run.count == 12 // stripes
            for k in range(run.count):
                slot = global_slot(run.slab, run.local + k, stripes)
                assert row_of[slots.index(slot)] == run.row + k
        # Rows are contiguous across runs, in file order.
        assert [r.row for r in runs] == [4 + i * (12 // stripes) for i in range(stripes)]
    # Gaps and repeats split runs; the caller's order does not matter.
    runs, row_of = plan_runs([7, 3, 1, 3, 11, 0], 2, num_slots=16)
    assert runs == [(0, 0, 0, 1), (1, 0, 1, 2), (1, 1, 3, 1), (1, 3, 4, 1), (1, 5, 5, 1)]
    assert row_of == [4, 2, 1, 3, 5, 0]
    assert plan_runs([], 2, num_slots=8) == ([], [])
    # A slot to be read alone splits the run it would join, on both sides.
    runs, row_of = plan_runs([3, 0, 1, 2], 1, num_slots=8, alone={1})
    assert runs == [(0, 0, 0, 1), (0, 1, 1, 1), (0, 2, 2, 2)]
    assert row_of == [3, 0, 1, 2]
    for bad in (8, -1):
        with pytest.raises(IndexError):
            plan_runs([0, bad], 2, num_slots=8)


# ------------------------------------------------------------ the matrix


def _offset(store: DiskStore, slot: int) -> tuple[str, int]:
    f, local = locate(slot, len(store.paths))
    return store.slabs[f].path, store.slabs[f].offset(local)


def _forge_zstd(store: DiskStore, slot: int, frame: bytes) -> None:
    """Put ``frame`` in ``slot`` as its zstd payload, both checksums made to
    match (xxh3 is no MAC): only the payload's own decoding can refuse it."""
    import dataclasses

    from kvtier.store.checksum import payload_checksum
    from kvtier.store.compression import Codec

    path, off = _offset(store, slot)
    with open(path, "r+b") as f:
        f.seek(off)
        forged = dataclasses.replace(
            SlotHeader.unpack(f.read(HEADER_SIZE)),
            codec=Codec.ZSTD_BYTEPLANE,
            payload_len=len(frame),
            checksum=payload_checksum(frame),
            device_checksum=device_checksum(frame),
        )
        f.seek(off)
        f.write(forged.pack() + frame)


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x04]))


def _damage(store: DiskStore, kind: str, slot: int) -> None:
    path, off = _offset(store, slot)
    if kind == "payload_bit":
        _flip(path, off + HEADER_SIZE + store.block_bytes // 2 + 1)
    elif kind == "header_bit":
        _flip(path, off + 100)
    elif kind == "other_key":
        src_path, src_off = _offset(store, (slot + 1) % NUM_SLOTS)
        with open(src_path, "rb") as f:
            f.seek(src_off)
            data = f.read(store.slot_size)
        with open(path, "r+b") as f:
            f.seek(off)
            f.write(data)
    elif kind == "truncated":
        os.truncate(path, off + HEADER_SIZE + store.block_bytes // 3)
    elif kind in ("old_version", "newer_version"):
        with open(path, "rb") as f:
            f.seek(off)
            hdr = SlotHeader.unpack(f.read(HEADER_SIZE))
        if kind == "old_version":
            packed = pack_version_1(hdr)
        else:
            packed = bytearray(hdr.pack())
            packed[8:12] = (3).to_bytes(4, "little")
        with open(path, "r+b") as f:
            f.seek(off)
            f.write(bytes(packed))
    else:
        assert kind == "none"


# kind -> expected outcome per reader: store (read_block with the slot's
# key), slot_reader, inspect (verify: no key known), staging (device).
RO = ReadOutcome
MATRIX = {
    "none": (RO.OK, RO.OK, RO.OK, RO.OK),
    "payload_bit": (RO.CHECKSUM_MISMATCH,) * 4,
    "header_bit": (RO.BAD_HEADER,) * 4,
    "other_key": (RO.KEY_MISMATCH, RO.KEY_MISMATCH, RO.OK, RO.KEY_MISMATCH),
    "truncated": (RO.TRUNCATED,) * 4,
    "old_version": (RO.OK, RO.OK, RO.OK, RO.HOST_ONLY),
    "newer_version": (RO.BAD_HEADER,) * 4,
}


@pytest.mark.parametrize("block_bytes", [16384, 6146])
@pytest.mark.parametrize("kind", sorted(MATRIX))
def test_every_reader_judges_a_damaged_slot_alike(
    tmp_path: Path, kind: str, block_bytes: int
) -> None:
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for p in paths:
        os.mkdir(p)
    layout = fp(block_bytes)
    # The last slot (so truncation leaves every other slot whole), on slab 1.
    victim = NUM_SLOTS - 1
    with DiskStore(paths, NUM_SLOTS, block_bytes, layout, backend="posix") as store:
        for s in range(NUM_SLOTS):
            store.write_block(s, key_of(s), block_of(s, block_bytes), seq=s + 1)
        _damage(store, kind, victim)
        out = np.empty(block_bytes, np.uint8)
        got_store = store.read_block(victim, key_of(victim), out)
        if got_store is RO.OK:
            assert np.array_equal(out, block_of(victim, block_bytes))
        assert verify(store, victim) is (
            RO.OK if got_store is RO.KEY_MISMATCH else got_store
        )

    backend = PosixBackend(threads=1)
    reader = SlotReader(SlabFiles.open(paths, layout, NUM_SLOTS, backend), capacity=8)
    staging = SlotReader(
        SlabFiles.open(paths, layout, NUM_SLOTS, backend), device="cpu", capacity=4
    )
    try:
        items = [(s, key_of(s)) for s in (0, 1, victim)]
        sr = reader.read(items)
        got_reader = sr[2].outcome
        st = staging.read(items)
        got_staging = st[2].outcome
        for res, rows in ((sr, reader.rows), (st, staging.rows.numpy())):
            for (s, _), r in zip(items[:2], res[:2]):
                assert r.outcome is RO.OK
                assert np.array_equal(rows[r.row], block_of(s, block_bytes))
        if got_reader is RO.OK:
            assert np.array_equal(reader.rows[sr[2].row], block_of(victim, block_bytes))
        if got_staging is RO.OK:
            assert np.array_equal(
                staging.rows.numpy()[st[2].row], block_of(victim, block_bytes)
            )
    finally:
        staging.close()
        reader.close()
        backend.shutdown()

    (view,) = find_stores(paths)
    recs = {r.slot: r for r in scan(view, file_order=True, payload=True)}
    if victim in recs:
        got_inspect = recs[victim].outcome
    else:
        # inspect lists whole slots only: a slab cut inside its last slot
        # loses that slot, with a warning naming the partial tail.
        assert kind == "truncated"
        assert any("partial tail" in w for w in view.warnings)
        got_inspect = RO.TRUNCATED
    assert all(recs[s].outcome is RO.OK for s in range(NUM_SLOTS - 1))

    assert (got_store, got_reader, got_inspect, got_staging) == MATRIX[kind]


@pytest.mark.parametrize("which", [0, 1])
def test_a_slab_cut_after_it_was_found_is_reported_not_raised(
    tmp_path: Path, which: int
) -> None:
    """``kvtier inspect``/``verify`` of one path of a striped store (the
    other path's slab is not found): a slab cut after the store was found
    reads short. That slot is TRUNCATED and the scan goes on; the short
    read's judgement used to locate the slot in the whole store's striping
    (IndexError: another slab, or past the slots found)."""
    block_bytes = 4096
    paths = _striped_store(tmp_path, block_bytes)
    (view,) = find_stores([paths[which]])
    (slab,) = view.slabs
    assert slab.index == which
    cut = NUM_SLOTS // 2 - 1  # the slab's last local slot
    os.truncate(slab.path, cut * view.slot_size + 100)
    recs = list(scan(view, file_order=True, payload=True))
    assert [r.slot for r in recs] == [
        global_slot(which, local, view.stripes) for local in range(NUM_SLOTS // 2)
    ]
    assert [r.outcome for r in recs] == [RO.OK] * cut + [RO.TRUNCATED]
    # The slab holds global slots which, which + 2, ... of the store.
    assert [r.header.key for r in recs[:cut]] == [
        key_of(global_slot(which, local, 2)) for local in range(cut)
    ]


@pytest.mark.parametrize("which", [0, 1])
def test_one_directory_of_a_striped_store_is_numbered_store_wide_and_said_partial(
    tmp_path: Path, which: int
) -> None:
    """``kvtier inspect``/``verify`` of one directory of a store striped over
    two: each slot carries its store-wide number (the one its key was
    written under), and a warning names the slab not given, so a clean
    verify of half a store does not read as the whole store checked."""
    paths = _striped_store(tmp_path, 4096)
    (view,) = find_stores([paths[which]])
    other = f"slab-{1 - which}.kvt"
    assert [w for w in view.warnings if "stripes over 2" in w] == [
        f"the store stripes over 2 directories; {other} not under the paths "
        "given, so its slots were not checked: pass every directory of its "
        "disk_path to check the whole store"
    ]
    recs = list(scan(view, file_order=True, payload=True))
    assert [r.outcome for r in recs] == [RO.OK] * (NUM_SLOTS // 2)
    assert [r.slot for r in recs] == list(range(which, NUM_SLOTS, 2))
    assert [r.header.key for r in recs] == [key_of(r.slot) for r in recs]
    # Both directories: the whole store, no warning.
    (whole,) = find_stores(paths)
    assert not [w for w in whole.warnings if "stripes" in w]
    assert sorted(r.slot for r in scan(whole, file_order=True)) == list(
        range(NUM_SLOTS)
    )


def test_a_layout_json_naming_another_digest_does_not_change_the_verdicts(
    tmp_path: Path,
) -> None:
    """layout.json is never trusted for reads: one that states another
    layout's digest than the directory is named by is a warning, and
    ``kvtier inspect``/``verify`` judge the slots as the engine does, by the
    name's digest (the engine's own slots stay OK)."""
    paths = _striped_store(tmp_path, 4096)
    (store_dir,) = Path(paths[0]).iterdir()
    doc = json.loads((store_dir / "layout.json").read_text())
    doc["digest"] = fp(8192).digest().hex()
    (store_dir / "layout.json").write_text(json.dumps(doc))
    (view,) = find_stores([paths[0]])
    assert any("does not match the directory name" in w for w in view.warnings)
    recs = list(scan(view, file_order=True, payload=True))
    assert [r.outcome for r in recs] == [RO.OK] * (NUM_SLOTS // 2)
    assert [r.header.key for r in recs] == [key_of(s) for s in range(0, NUM_SLOTS, 2)]


# ------------------------------------------- one run rule, both readers


class CountingBackend(PosixBackend):
    """A real POSIX back end that counts the reads it is asked for (one
    per run: a read of several slots counts once)."""

    def __init__(self) -> None:
        super().__init__(threads=2)
        self.reads = 0

    def submit_read(self, handle: Any, buf: Any, offset: int) -> Any:
        self.reads += 1
        return super().submit_read(handle, buf, offset)

    def read_sync(self, handle: Any, buf: Any, offset: int) -> int:
        self.reads += 1
        return super().read_sync(handle, buf, offset)


def _striped_store(tmp_path: Path, block_bytes: int) -> list[str]:
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for p in paths:
        os.mkdir(p)
    layout = fp(block_bytes)
    with DiskStore(paths, NUM_SLOTS, block_bytes, layout, backend="posix") as store:
        for s in range(NUM_SLOTS):
            store.write_block(s, key_of(s), block_of(s, block_bytes), seq=s + 1)
    return paths


@pytest.mark.parametrize("order", ["ascending", "shuffled"])
def test_both_readers_coalesce_a_striped_batch_alike(
    tmp_path: Path, order: str
) -> None:
    """Over 2 slab paths, a batch of all slots is one read per slab for the
    host reader and the device staging reader alike, and both return the
    same verified bytes for every slot."""
    block_bytes = 16384
    paths = _striped_store(tmp_path, block_bytes)
    layout = fp(block_bytes)
    slots = list(range(NUM_SLOTS))
    if order == "shuffled":
        slots = [int(s) for s in np.random.default_rng(11).permutation(NUM_SLOTS)]
    items = [(s, key_of(s)) for s in slots]
    first_row = 2
    host_backend, dev_backend = CountingBackend(), CountingBackend()
    reader = SlotReader(
        SlabFiles.open(paths, layout, NUM_SLOTS, host_backend),
        capacity=NUM_SLOTS + first_row,
    )
    staging = SlotReader(
        SlabFiles.open(paths, layout, NUM_SLOTS, dev_backend),
        device="cpu",
        capacity=NUM_SLOTS + first_row,
    )
    try:
        pending_host = reader.submit(items, first_row)
        pending_dev = staging.submit(items, first_row)
        assert pending_dev.runs == pending_host.runs
        assert pending_dev.row_of == pending_host.row_of
        assert len(pending_host.runs) == 2  # one per slab file
        sr = reader.complete(pending_host)
        st = staging.complete(pending_dev)
        assert host_backend.reads == dev_backend.reads == 2
        host_rows, dev_rows = reader.rows, staging.rows.numpy()
        assert [r.row for r in sr] == [r.row for r in st]
        assert sorted(r.row for r in st) == list(range(first_row, first_row + NUM_SLOTS))
        for (slot, _), a, b in zip(items, sr, st):
            assert a.outcome is RO.OK and b.outcome is RO.OK, (slot, a, b)
            want = block_of(slot, block_bytes)
            assert np.array_equal(host_rows[a.row], want)
            assert np.array_equal(dev_rows[b.row], want)
    finally:
        staging.close()
        reader.close()
        host_backend.shutdown()
        dev_backend.shutdown()


@pytest.mark.parametrize("block_bytes", [16384, 6146])
def test_device_reader_judges_each_item_by_its_own_row(
    tmp_path: Path, block_bytes: int
) -> None:
    """Rows follow file order, not item order: a flipped payload byte, a
    wrong key and a slab cut inside its last slot, in a shuffled striped
    batch, fail exactly their items (device checksums, headers and read
    states are looked up by row)."""
    paths = _striped_store(tmp_path, block_bytes)
    layout = fp(block_bytes)
    with DiskStore(paths, NUM_SLOTS, block_bytes, layout, backend="posix") as store:
        _damage(store, "payload_bit", 2)
        _damage(store, "truncated", 7)  # slab 1's last slot
    slots = [5, 2, 7, 0, 3, 6, 1, 4]
    items = [(s, key_of(s)) for s in slots]
    items[slots.index(4)] = (4, key_of(1))  # wrong key for slot 4
    want = {s: RO.OK for s in slots}
    want[2], want[4], want[7] = RO.CHECKSUM_MISMATCH, RO.KEY_MISMATCH, RO.TRUNCATED
    backend = PosixBackend(threads=2)
    reader = SlotReader(SlabFiles.open(paths, layout, NUM_SLOTS, backend), capacity=NUM_SLOTS)
    staging = SlotReader(
        SlabFiles.open(paths, layout, NUM_SLOTS, backend), device="cpu", capacity=NUM_SLOTS
    )
    try:
        for res, rows in (
            (reader.read(items), reader.rows),
            (staging.read(items), staging.rows.numpy()),
        ):
            assert {s: r.outcome for s, r in zip(slots, res)} == want
            for s, r in zip(slots, res):
                if r.outcome is RO.OK:
                    assert np.array_equal(rows[r.row], block_of(s, block_bytes))
    finally:
        staging.close()
        reader.close()
        backend.shutdown()


def test_a_payload_that_does_not_decode_is_a_bad_header_for_every_host_reader(
    tmp_path: Path,
) -> None:
    """Both checksums match but the zstd payload is garbage (the header
    lies): ``decode_payload`` makes it BAD_HEADER for the store's reads,
    the load reader and ``kvtier verify`` alike, and none hands out a byte
    of it."""
    import dataclasses

    from kvtier.store.checksum import payload_checksum
    from kvtier.store.compression import Codec

    block_bytes = 16384
    layout = fp(block_bytes)
    paths = [str(tmp_path)]
    with DiskStore(
        paths, NUM_SLOTS, block_bytes, layout, backend="posix", compression="zstd"
    ) as store:
        store.write_block(1, key_of(1), np.zeros(block_bytes, np.uint8), seq=1)
        path, off = _offset(store, 1)
        with open(path, "r+b") as f:
            f.seek(off)
            hdr = SlotHeader.unpack(f.read(HEADER_SIZE))
            assert hdr.codec is Codec.ZSTD_BYTEPLANE
            garbage = bytes(range(256)) * (hdr.payload_len // 256 + 1)
            garbage = garbage[: hdr.payload_len]
            forged = dataclasses.replace(
                hdr,
                checksum=payload_checksum(garbage),
                device_checksum=device_checksum(garbage),
            )
            f.seek(off)
            f.write(forged.pack() + garbage)
        out = np.full(block_bytes, 7, np.uint8)
        assert store.read_block(1, key_of(1), out) is RO.BAD_HEADER
        assert (out == 7).all()
    backend = PosixBackend(threads=1)
    reader = SlotReader(SlabFiles.open(paths, layout, NUM_SLOTS, backend), capacity=8)
    try:
        (got,) = reader.read([(1, key_of(1))])
        assert got.outcome is RO.BAD_HEADER
    finally:
        reader.close()
        backend.shutdown()
    # ``kvtier verify`` (a scan with payloads) says so too.
    (view,) = find_stores(paths)
    recs = {r.slot: r for r in scan(view, file_order=True, payload=True)}
    assert recs[1].outcome is RO.BAD_HEADER
    assert "does not decode" in recs[1].detail


def _zstd_frame(declared: int | None, blocks: list[tuple[int, int]]) -> bytes:
    """A zstd frame by hand: its header declares ``declared`` bytes (None:
    no size), then one RLE block per ``(byte, size)``."""
    import struct

    fhd, size = (0x00, b"") if declared is None else (0xC0, struct.pack("<Q", declared))
    frame = struct.pack("<I", 0xFD2FB528) + bytes([fhd, 0x58]) + size
    for i, (byte, n) in enumerate(blocks):
        last = i == len(blocks) - 1
        frame += (int(last) | 2 | n << 3).to_bytes(3, "little") + bytes([byte])
    return frame


def test_a_zstd_frame_declaring_more_than_the_block_is_refused_before_it_is_decoded(
    tmp_path: Path,
) -> None:
    """A slot whose checksums match (xxh3 is no MAC) holds a zstd frame that
    declares more than a block: a few hundred bytes that decode to 64 blocks
    (a decompression bomb), a size no memory holds, no size, or no frame. Each
    is BAD_HEADER for every host reader (``kvtier verify`` too), nothing of
    it reaches ``out``, and no reader allocates more than a few blocks on
    the way."""
    import tracemalloc


    block_bytes = 16384
    chunk = 128 * 1024  # zstd's largest block
    frames = {
        1: _zstd_frame(64 * block_bytes, [(9, chunk)] * (64 * block_bytes // chunk)),
        2: _zstd_frame(1 << 62, [(9, 1000)]),
        3: _zstd_frame(None, [(9, chunk)] * 8),
        4: b"",  # no frame at all
    }
    layout = fp(block_bytes)
    paths = [str(tmp_path)]
    with DiskStore(
        paths, NUM_SLOTS, block_bytes, layout, backend="posix", compression="zstd"
    ) as store:
        for slot, frame in frames.items():
            store.write_block(slot, key_of(slot), np.zeros(block_bytes, np.uint8), seq=1)
            _forge_zstd(store, slot, frame)
        tracemalloc.start()
        try:
            for slot in frames:
                out = np.full(block_bytes, 7, np.uint8)
                assert store.read_block(slot, key_of(slot), out) is RO.BAD_HEADER
                assert (out == 7).all()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 * block_bytes
    backend = PosixBackend(threads=1)
    reader = SlotReader(SlabFiles.open(paths, layout, NUM_SLOTS, backend), capacity=8)
    try:
        got = reader.read([(slot, key_of(slot)) for slot in frames])
        assert [g.outcome for g in got] == [RO.BAD_HEADER] * len(frames)
    finally:
        reader.close()
        backend.shutdown()
    (view,) = find_stores(paths)
    recs = {r.slot: r for r in scan(view, file_order=True, payload=True)}
    assert [recs[slot].outcome for slot in frames] == [RO.BAD_HEADER] * len(frames)


def _frame(blocks: list[bytes], *, checksum: bool = False, size: int = 16384) -> bytes:
    """A zstd frame declaring ``size`` bytes, of the given block headers and
    contents, by hand."""
    import struct

    fhd = 0xC0 | (0x04 if checksum else 0)
    return struct.pack("<I", 0xFD2FB528) + bytes([fhd, 0x58]) + struct.pack(
        "<Q", size
    ) + b"".join(blocks)


def _rle(byte: int, n: int, last: bool) -> bytes:
    return (int(last) | 2 | n << 3).to_bytes(3, "little") + bytes([byte])


_EMPTY_LAST = (1).to_bytes(3, "little")  # a raw block of 0 bytes, the last


@pytest.mark.parametrize(
    "case",
    ["whole", "cut before its last block", "trailing bytes", "two frames", "checksum"],
)
def test_verify_judges_a_zstd_frame_as_a_load_does(
    tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvtier verify`` reads a payload in pieces and never holds the frame,
    a load decodes it in one go: their verdicts agree on frames whose
    payload checksum matches but whose end is odd (a frame without its
    last block, bytes after it, a second frame, a content checksum, which
    kvtier never writes), here read in pieces of one page."""

    import xxhash

    from kvtier.store import scan as scan_mod

    block_bytes = 16384
    whole = _frame([_rle(9, block_bytes, False), _EMPTY_LAST])
    frame = {
        "whole": whole,
        "cut before its last block": whole[: -len(_EMPTY_LAST)],
        "trailing bytes": whole + b"xyz",
        "two frames": whole + whole,
        "checksum": _frame([_rle(9, block_bytes, True)], checksum=True)
        + (xxhash.xxh64_intdigest(bytes([9]) * block_bytes) & 0xFFFFFFFF).to_bytes(
            4, "little"
        ),
    }[case]
    layout = fp(block_bytes)
    paths = [str(tmp_path)]
    with DiskStore(
        paths, NUM_SLOTS, block_bytes, layout, backend="posix", compression="zstd"
    ) as store:
        store.write_block(1, key_of(1), np.zeros(block_bytes, np.uint8), seq=1)
        _forge_zstd(store, 1, frame)
        out = np.empty(block_bytes, np.uint8)
        loaded = store.read_block(1, key_of(1), out)
    want = RO.BAD_HEADER if case in ("cut before its last block", "checksum") else RO.OK
    assert loaded is want
    monkeypatch.setattr(scan_mod, "PAYLOAD_PIECE", HEADER_SIZE)  # one page
    (view,) = find_stores(paths)
    try:
        recs = {r.slot: r for r in scan(view, file_order=True, payload=True)}
    finally:
        view.close()
    assert recs[1].outcome is want, recs[1]


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_verify_checks_a_block_larger_than_its_piece_without_holding_it(
    tmp_path: Path, compression: str
) -> None:
    """``kvtier verify``'s scan reads a payload in pieces: blocks of three
    and a half pieces (stored raw, or compressed to about two) are OK
    whole, one flipped byte in a block's last piece is CHECKSUM_MISMATCH,
    and the scan never holds a block (its peak stays under two pieces,
    where reading a block whole takes three blocks)."""
    import tracemalloc

    from kvtier.store.compression import Codec
    from kvtier.store.scan import PAYLOAD_PIECE

    block_bytes = 3 * PAYLOAD_PIECE + PAYLOAD_PIECE // 2
    data = np.zeros(block_bytes, np.uint8)
    data[: block_bytes // 2] = np.random.default_rng(0).integers(
        0, 256, block_bytes // 2, dtype=np.uint8
    )
    layout = fp(block_bytes)
    paths = [str(tmp_path)]
    with DiskStore(
        paths, 2, block_bytes, layout, backend="posix", compression=compression
    ) as store:
        for slot in (0, 1):
            store.write_block(slot, key_of(slot), data, seq=slot + 1)
        path, off = _offset(store, 1)
        with open(path, "r+b") as f:
            f.seek(off)
            hdr = SlotHeader.unpack(f.read(HEADER_SIZE))
            want = Codec.RAW if compression == "none" else Codec.ZSTD_BYTEPLANE
            assert hdr.codec is want
            assert hdr.payload_len > PAYLOAD_PIECE  # more than one piece
            f.seek(off + HEADER_SIZE + hdr.payload_len - 10)
            byte = f.read(1)[0]
            f.seek(off + HEADER_SIZE + hdr.payload_len - 10)
            f.write(bytes([byte ^ 0x40]))
    (view,) = find_stores(paths)
    tracemalloc.start()
    try:
        recs = {r.slot: r for r in scan(view, file_order=True, payload=True)}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert recs[0].outcome is RO.OK
    assert recs[1].outcome is RO.CHECKSUM_MISMATCH
    assert peak < 2 * PAYLOAD_PIECE


# ------------------------------------------------------- device checksum


def _ref(data: bytes) -> int:
    """The definition, in plain Python integers."""
    data = data + bytes(-len(data) % 4)
    words = [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4)]
    p = (1 << 31) - 1
    s1 = sum(words) % (1 << 32)
    s2 = sum((i + 1) * w for i, w in enumerate(words)) % p
    return (s2 << 32) | s1


def test_device_checksum_matches_its_definition_on_numpy_and_torch() -> None:
    torch = pytest.importorskip("torch")
    from kvtier.store.checksum import device_checksum_rows, device_checksums

    rng = np.random.default_rng(7)
    rows = rng.integers(0, 256, (5, 4096 + 12), dtype=np.uint8)
    rows[0] = 0xFF  # every word at its maximum
    rows[1] = 0
    for n in (4, 8, 4096, 4108):
        want = [_ref(bytes(r[:n])) for r in rows]
        assert [device_checksum(r[:n]) for r in rows] == want
        # A strided view (row stride != n), as the staging reader passes.
        assert device_checksums(torch.from_numpy(rows), n).tolist() == want
        # The host's batch form, on the same strided rows (a writer's batch).
        assert device_checksum_rows(rows, n).tolist() == want
    assert device_checksum(b"\x01\x02\x03") == _ref(b"\x01\x02\x03")


def _variants(base: np.ndarray) -> dict[str, list[np.ndarray]]:
    out: dict[str, list[np.ndarray]] = {"bit_flip": [], "swap": [], "tail": []}
    for byte in (0, 1, 2, 3, 4, 1001, base.size - 1):
        for bit in range(8):
            v = base.copy()
            v[byte] ^= 1 << bit
            out["bit_flip"].append(v)
    words = base.view("<u4")
    for i, j in ((0, 1), (3, 700), (10, words.size - 1)):
        v = words.copy()
        v[i], v[j] = words[j], words[i]
        assert v[i] != v[j]
        out["swap"].append(v.view(np.uint8))
    for keep in (0, 4, base.size // 2, base.size - 4):
        v = base.copy()
        v[keep:] = 0
        out["tail"].append(v)
    return out


def test_device_checksum_catches_each_corruption_class() -> None:
    base = np.random.default_rng(3).integers(1, 256, 8192, dtype=np.uint8)
    want = device_checksum(base)
    for kind, variants in _variants(base).items():
        for v in variants:
            assert device_checksum(v) != want, kind
    other = np.random.default_rng(4).integers(0, 256, 8192, dtype=np.uint8)
    assert device_checksum(other) != want
    # Two words each moved by the prime P: a word change invisible mod P,
    # still seen by the plain sum.
    words = base.view("<u4").copy()
    words[5] = (int(words[5]) + (1 << 31) - 1) % (1 << 32)
    assert device_checksum(words) != want


@pytest.mark.parametrize("planted", ["slab-\u0661.kvt", "slab-1.kvt\n"])
def test_a_name_that_only_looks_like_a_slab_is_not_one(
    tmp_path: Path, planted: str
) -> None:
    """``kvtier inspect``/``verify`` find a store's slabs by name: only
    ``slab-<ASCII digits>.kvt`` is one. A planted file whose name carries a
    non-ASCII digit (``int`` reads ``\\u0661`` as 1) or ends in a newline
    (``$`` matches before one) used to be taken for slab 1 too, and its
    bytes reported as the store's."""
    paths = _striped_store(tmp_path, 4096)
    (view,) = find_stores(paths)
    found = [(s.index, s.path) for s in view.slabs]
    real = found[1][1]
    with open(os.path.join(os.path.dirname(real), planted), "wb") as dst:
        dst.write(b"\xff" * os.path.getsize(real))
    (view,) = find_stores(paths)
    assert [(s.index, s.path) for s in view.slabs] == found
    recs = list(scan(view, file_order=True, payload=True))
    assert [r.outcome for r in recs] == [RO.OK] * NUM_SLOTS


def _holes_told(tmp_path: Path) -> bool:
    """Whether this file system reports a preallocated, never written range
    as a hole (``SEEK_DATA``: ext4, XFS)."""
    fd = os.open(tmp_path / "hole-probe", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, 1 << 20)
        try:
            return os.lseek(fd, 0, os.SEEK_DATA) != 0
        except OSError as exc:  # ENXIO: no data at all; else: cannot tell
            return exc.errno == errno.ENXIO
    finally:
        os.close(fd)
        os.unlink(tmp_path / "hole-probe")


def test_inspect_reads_only_the_headers_of_written_slots(tmp_path: Path) -> None:
    """``kvtier inspect``/``verify`` (file order) of a large, mostly
    unwritten store: a slot whose header lies in a hole is EMPTY without a
    read, so only the written slots' headers are read (where the file
    system tells holes; elsewhere every header, with the same verdicts).
    Slots the slab no longer reaches are still read, and TRUNCATED."""
    block_bytes, num_slots = 4096, 4096
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for p in paths:
        os.mkdir(p)
    written = [0, 1, 777, 2048, 4001, 4095]
    with DiskStore(paths, num_slots, block_bytes, fp(block_bytes), backend="posix") as s:
        for slot in written:
            s.write_block(slot, key_of(slot), block_of(slot, block_bytes), slot + 1)
    holes = _holes_told(tmp_path)
    (view,) = find_stores(paths)
    recs = list(scan(view, file_order=True, payload=True))
    read = view.stats().read_bytes
    assert sorted(r.slot for r in recs) == list(range(num_slots))
    assert sorted(r.slot for r in recs if r.outcome is RO.OK) == written
    assert all(r.outcome in (RO.OK, RO.EMPTY) for r in recs)
    assert [r.header.key for r in recs if r.outcome is RO.OK] == [
        key_of(r.slot) for r in recs if r.outcome is RO.OK
    ]
    payloads = len(written) * block_bytes
    headers = len(written) if holes else num_slots
    assert read == headers * HEADER_SIZE + payloads
    view.close()

    # The slab of path b cut to its first 100 local slots: the other 1948
    # are past its end, read short (TRUNCATED), not taken for holes.
    (view,) = find_stores(paths)
    b = next(s for s in view.slabs if s.index == 1)
    os.truncate(b.path, 100 * view.slot_size)
    recs = {r.slot: r.outcome for r in scan(view, file_order=True)}
    view.close()
    past = {global_slot(1, local, 2) for local in range(100, num_slots // 2)}
    assert {s for s, o in recs.items() if o is RO.TRUNCATED} == past
    assert {s for s, o in recs.items() if o is RO.OK} == {
        s for s in written if s not in past
    }
