from __future__ import annotations

import errno
import json
import logging
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.store.backends.factory import make_backend
from kvtier.store.compression import Codec
from kvtier.store.reader import SlotReader
from kvtier.store.scan import scan
from kvtier.store.slabs import SlabFiles, locate, store_dirname
from kvtier.store.slot import (
    HEADER_SIZE,
    LayoutFingerprint,
    ReadOutcome,
    slot_size,
)
from kvtier.store.store import DiskStore
from kvtier.testing.state import read_header, verify

BLOCK_BYTES = 64 * 1024  # matches the conftest fingerprint
KEY = bytes(range(32)) + b"\x00\x00\x00\x01"  # 32-byte hash + 4-byte group
SENTINEL = 0xEE


def block(seed: int, n: int = BLOCK_BYTES) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def sentinel_out(n: int = BLOCK_BYTES) -> np.ndarray:
    return np.full(n, SENTINEL, dtype=np.uint8)


def location(store: DiskStore, slot: int) -> tuple[str, int]:
    idx, local = locate(slot, len(store.paths))
    return store.slabs[idx].path, local * store.slot_size


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture(params=["none", "zstd"])
def store(
    request: pytest.FixtureRequest, tmp_path: Path, fingerprint: LayoutFingerprint
) -> Any:
    with DiskStore(
        [str(tmp_path)],
        8,
        BLOCK_BYTES,
        fingerprint,
        backend="posix",
        compression=request.param,
    ) as s:
        yield s


def test_roundtrip_persists_across_reopen(
    tmp_path: Path, fingerprint: LayoutFingerprint
) -> None:
    data = block(1)
    with DiskStore([str(tmp_path)], 4, BLOCK_BYTES, fingerprint, backend="posix") as s:
        assert s.write_block(2, KEY, data, seq=7) == slot_size(BLOCK_BYTES)
        st = s.stats()
        assert st.write_bytes == slot_size(BLOCK_BYTES) and st.blocks_written == 1
    with DiskStore([str(tmp_path)], 4, BLOCK_BYTES, fingerprint, backend="posix") as s:
        out = sentinel_out()
        assert s.read_block(2, KEY, out) is ReadOutcome.OK
        assert out.tobytes() == data.tobytes()
        assert s.read_block(1, KEY, sentinel_out()) is ReadOutcome.EMPTY
        assert verify(s, 2) is ReadOutcome.OK
        st = s.stats()
        assert st.blocks_read == 3 and st.read_bytes > 0 and st.read_seconds > 0


def test_layout_permissions_and_striping(
    tmp_path: Path, fingerprint: LayoutFingerprint
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    with DiskStore([str(a), str(b)], 5, BLOCK_BYTES, fingerprint, backend="posix") as s:
        for slot in range(5):
            s.write_block(slot, KEY + bytes([slot]), block(slot), s.next_seq())
        sub = store_dirname(fingerprint)
        assert sub == "kvtier-" + fingerprint.digest().hex()[:16]
        slab_a, slab_b = a / sub / "slab-0.kvt", b / sub / "slab-1.kvt"
        assert s.dirs == [str(a / sub), str(b / sub)]
        # 5 slots over 2 paths: slots 0,2,4 on a; 1,3 on b.
        assert os.path.getsize(slab_a) == 3 * s.slot_size
        assert os.path.getsize(slab_b) == 2 * s.slot_size
        for slot in range(5):
            f = slab_a if slot % 2 == 0 else slab_b
            raw = f.read_bytes()[(slot // 2) * s.slot_size :][: s.slot_size]
            assert raw[32 : 32 + 37] == KEY + bytes([slot])  # key field of the header
            assert raw[HEADER_SIZE : HEADER_SIZE + BLOCK_BYTES] == block(slot).tobytes()
        for p in (slab_a, slab_b):
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
            assert stat.S_IMODE(os.stat(p.parent).st_mode) == 0o700
            layout = p.parent / "layout.json"
            assert stat.S_IMODE(os.stat(layout).st_mode) == 0o600
            assert (
                json.loads(layout.read_text())["digest"] == fingerprint.digest().hex()
            )


def test_disk_paths_listed_in_another_order_keep_their_blocks(
    tmp_path: Path, fingerprint: LayoutFingerprint, caplog: pytest.LogCaptureFixture
) -> None:
    """disk_path [a, b] then [b, a] (or striped mounts swapped at boot):
    each directory's one slab is renamed to its new index, and a warm
    restart's scan finds every block (headers name keys, not slots). It had
    started empty, beside a second slab preallocated in each directory."""
    a, b = tmp_path / "a", tmp_path / "b"
    keys = [KEY + bytes([slot]) for slot in range(5)]
    with DiskStore([str(a), str(b)], 5, BLOCK_BYTES, fingerprint, backend="posix") as s:
        for slot, key in enumerate(keys):
            s.write_block(slot, key, block(slot), s.next_seq())
    with DiskStore([str(b), str(a)], 5, BLOCK_BYTES, fingerprint, backend="posix") as s:
        sub = store_dirname(fingerprint)
        assert sorted(os.listdir(a / sub)) == ["layout.json", "slab-1.kvt"]
        assert sorted(os.listdir(b / sub)) == ["layout.json", "slab-0.kvt"]
        found = {
            header.key: slot
            for slot, header, outcome in s.scan()
            if outcome is ReadOutcome.OK and header is not None
        }
        # 5 slots over 2 paths: a held 3 (slots 0, 2, 4), now slab 1 of 2
        # slots: its third is outside the new layout (uneven stripes).
        assert sorted(found) == sorted(keys[:4])
        for slot, key in enumerate(keys[:4]):
            out = sentinel_out()
            assert s.read_block(found[key], key, out) is ReadOutcome.OK
            assert out.tobytes() == block(slot).tobytes()
    assert "disk_path listed in another order" in caplog.text


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_write_blocks_writes_what_write_block_writes(
    tmp_path: Path, fingerprint: LayoutFingerprint, compression: str
) -> None:
    """A batch in any order of slots (striped over two paths, some adjacent
    in one slab, some not) and of rows (runs and single rows): every slot
    holds its row under its key, verified as a single write's would be, each
    with its own sequence number; the adjacent ones went out together."""
    rows = np.stack([block(100 + i) for i in range(12)])
    slots = [9, 2, 4, 0, 6, 3, 11]  # 0, 2, 4, 6 adjacent on path a
    row_ids = [7, 1, 2, 3, 4, 11, 0]  # rows 1..4 consecutive
    keys = [KEY + bytes([s]) for s in slots]
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    with DiskStore(
        paths, 12, BLOCK_BYTES, fingerprint, backend="posix", compression=compression
    ) as s:
        writes = []
        real = s.files.write_all
        s.files.write_all = lambda op, idx, buf, off, **kw: (
            writes.append((idx, off, len(buf))) or real(op, idx, buf, off, **kw)
        )
        staged = []
        assert (
            s.write_blocks(
                slots, keys, rows, row_ids, on_staged=lambda: staged.append(1)
            )
            == [True] * 7
        )
        assert staged == [1]
        if compression == "none":
            # Path a: slots 0, 2, 4, 6 (local 0-3), one write; path b: slot 3
            # (local 1) alone, then 9 and 11 (local 4, 5) together.
            ssz = s.slot_size
            assert sorted(writes) == [
                (0, 0, 4 * ssz),
                (1, ssz, ssz),
                (1, 4 * ssz, 2 * ssz),
            ]
        seqs = set()
        for slot, key, row in zip(slots, keys, row_ids, strict=True):
            out = sentinel_out()
            assert s.read_block(slot, key, out) is ReadOutcome.OK
            assert out.tobytes() == rows[row].tobytes()
            assert verify(s, slot) is ReadOutcome.OK
            header, _ = read_header(s, slot)
            seqs.add(header.seq)
        assert len(seqs) == 7
        assert s.stats().blocks_written == 7
        assert s.read_block(1, KEY + b"\x01", sentinel_out()) is ReadOutcome.EMPTY
        with pytest.raises(ValueError, match="exceed the batch"):
            n = s.batch_capacity() + 1
            s.write_blocks([0] * n, [KEY] * n, rows, [0] * n)


def test_a_layout_json_that_cannot_be_written_costs_a_warning_not_the_store(
    tmp_path: Path, fingerprint: LayoutFingerprint, caplog: pytest.LogCaptureFixture
) -> None:
    """layout.json is only an aid: a directory in its place (or a full
    disk) is a warning naming it, the store opens and serves, and no
    temporary file is left behind."""
    caplog.set_level(logging.WARNING, logger="vllm.kvtier.store")
    store_dir = tmp_path / store_dirname(fingerprint)
    (store_dir / "layout.json").mkdir(parents=True, mode=0o700)
    store_dir.chmod(0o700)
    with DiskStore([str(tmp_path)], 4, BLOCK_BYTES, fingerprint, backend="posix") as s:
        s.write_block(1, KEY, block(1), s.next_seq())
        out = sentinel_out()
        assert s.read_block(1, KEY, out) is ReadOutcome.OK
        assert out.tobytes() == block(1).tobytes()
    assert sorted(p.name for p in store_dir.iterdir()) == ["layout.json", "slab-0.kvt"]
    assert any(
        str(store_dir / "layout.json") in r.getMessage() for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


def test_a_damaged_layout_json_is_replaced_not_a_failed_start(
    tmp_path: Path, fingerprint: LayoutFingerprint
) -> None:
    """layout.json is only an aid: one whose bytes are not UTF-8 (bit rot,
    an edit) is rewritten, and the store reopens and serves its blocks
    (it was read as text, and the UnicodeDecodeError failed every start)."""
    with DiskStore([str(tmp_path)], 4, BLOCK_BYTES, fingerprint, backend="posix") as s:
        s.write_block(1, KEY, block(1), s.next_seq())
    layout = tmp_path / store_dirname(fingerprint) / "layout.json"
    good = layout.read_bytes()
    layout.write_bytes(good[:20] + b"\xff\xfe" + good[22:])
    with DiskStore([str(tmp_path)], 4, BLOCK_BYTES, fingerprint, backend="posix") as s:
        found = {h.key: slot for slot, h, o in s.scan() if o is ReadOutcome.OK}
        assert found == {KEY: 1}
        out = sentinel_out()
        assert s.read_block(1, KEY, out) is ReadOutcome.OK
        assert out.tobytes() == block(1).tobytes()
    assert layout.read_bytes() == good


def test_corrupt_payload_is_checksum_mismatch(store: DiskStore) -> None:
    data = np.frombuffer(np.arange(BLOCK_BYTES // 2, dtype="<u2").tobytes(), np.uint8)
    store.write_block(3, KEY, data, store.next_seq())
    hdr, outcome = read_header(store, 3)
    assert outcome is ReadOutcome.OK and hdr is not None
    # The zstd store really compressed this (so both codecs are exercised).
    assert hdr.codec is (
        Codec.RAW if store.compression == "none" else Codec.ZSTD_BYTEPLANE
    )
    path, off = location(store, 3)
    flip(path, off + HEADER_SIZE + hdr.payload_len // 2)
    out = sentinel_out()
    assert store.read_block(3, KEY, out) is ReadOutcome.CHECKSUM_MISMATCH
    assert (out == SENTINEL).all()
    assert verify(store, 3) is ReadOutcome.CHECKSUM_MISMATCH
    assert store.stats().checksum_failures == 2


@pytest.mark.parametrize("pos", [0, 8, 20, 40, 100, 130, 140])
def test_corrupt_header_is_bad_header(store: DiskStore, pos: int) -> None:
    store.write_block(1, KEY, block(2), store.next_seq())
    path, off = location(store, 1)
    flip(path, off + pos)
    out = sentinel_out()
    assert store.read_block(1, KEY, out) is ReadOutcome.BAD_HEADER
    assert (out == SENTINEL).all()
    assert read_header(store, 1) == (None, ReadOutcome.BAD_HEADER)


@pytest.mark.parametrize("cut", ["slab_start", "mid_header", "mid_payload"])
def test_truncated_slab_never_returns_data(store: DiskStore, cut: str) -> None:
    data = block(3)
    store.write_block(4, KEY, data, store.next_seq())
    path, off = location(store, 4)
    size = {
        "slab_start": 0,
        "mid_header": off + 100,
        "mid_payload": off + HEADER_SIZE + 1000,
    }[cut]
    os.truncate(path, size)
    out = sentinel_out()
    assert store.read_block(4, KEY, out) in (
        ReadOutcome.TRUNCATED,
        ReadOutcome.IO_ERROR,
    )
    assert (out == SENTINEL).all()


def test_foreign_fingerprint_is_fingerprint_mismatch(
    tmp_path: Path, fingerprint: LayoutFingerprint, fingerprint_factory: Any
) -> None:
    other_fp = fingerprint_factory(model="another/model")
    with (
        DiskStore([str(tmp_path)], 4, BLOCK_BYTES, other_fp, backend="posix") as other,
        DiskStore(
            [str(tmp_path)], 4, BLOCK_BYTES, fingerprint, backend="posix"
        ) as ours,
    ):
        assert other.dirs != ours.dirs
        other.write_block(0, KEY, block(4), other.next_seq())
        # Transplant the foreign slot into our slab (e.g. files copied around).
        src, soff = location(other, 0)
        dst, doff = location(ours, 0)
        with open(src, "rb") as f:
            f.seek(soff)
            raw = f.read(ours.slot_size)
        with open(dst, "r+b") as f:
            f.seek(doff)
            f.write(raw)
        out = sentinel_out()
        assert ours.read_block(0, KEY, out) is ReadOutcome.FINGERPRINT_MISMATCH
        assert (out == SENTINEL).all()
        hdr, outcome = read_header(ours, 0)
        assert outcome is ReadOutcome.FINGERPRINT_MISMATCH
        assert hdr is not None and hdr.fingerprint == other_fp.digest()


def test_wrong_key_and_invalidate(store: DiskStore) -> None:
    store.write_block(5, KEY, block(5), store.next_seq())
    out = sentinel_out()
    assert store.read_block(5, b"another-key", out) is ReadOutcome.KEY_MISMATCH
    assert (out == SENTINEL).all()
    store.invalidate(5)
    assert store.read_block(5, KEY, out) is ReadOutcome.EMPTY
    assert (out == SENTINEL).all()
    assert verify(store, 5) is ReadOutcome.EMPTY


def test_a_scan_stopped_early_does_not_wait_for_a_hung_read(
    tmp_path: Path, fingerprint: LayoutFingerprint
) -> None:
    """A consumer that stops a scan (Ctrl-C in ``kvtier inspect``) gets
    control back while a batch's header read still hangs; the scan's
    threads end once the read returns."""
    import threading
    import time

    from kvtier.store.backends.posix import PosixBackend
    from kvtier.testing.faults import (
        FaultInjectingBackend,
        FaultPlan,
        FaultRule,
        on_slot,
    )

    def scan_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("kvtier-scan")]

    with DiskStore([str(tmp_path)], 64, BLOCK_BYTES, fingerprint, backend="posix") as s:
        for slot in range(64):
            s.write_block(slot, KEY + bytes([slot]), block(slot), slot + 1)
    plan = FaultPlan()
    backend = FaultInjectingBackend(PosixBackend(), plan)
    s = DiskStore([str(tmp_path)], 64, BLOCK_BYTES, fingerprint, backend=backend)
    release, closed = threading.Event(), threading.Event()
    try:
        plan.add(FaultRule.hang(release, ops="read", **on_slot(s, 40)))
        records = scan(s.files)
        assert [next(records).slot for _ in range(16)] == list(range(16))

        def stop() -> None:
            records.close()
            closed.set()

        threading.Thread(target=stop, daemon=True).start()
        assert closed.wait(30), "closing the scan waited for the hung read"
        assert scan_threads()  # still reading slot 40
        release.set()
        deadline = time.monotonic() + 30
        while scan_threads():
            assert time.monotonic() < deadline, "the scan's threads never ended"
            time.sleep(0.01)
    finally:
        release.set()
        s.close()
        backend.shutdown()


_EXIT_WITH_A_HUNG_READ = """
import pickle, sys, threading
from kvtier.store.backends.posix import PosixBackend
from kvtier.store.scan import scan
from kvtier.store.store import DiskStore
from kvtier.testing.faults import FaultInjectingBackend, FaultPlan, FaultRule, on_slot

path, fingerprint, block_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
plan = FaultPlan()
backend = FaultInjectingBackend(PosixBackend(), plan)
with open(fingerprint, "rb") as f:
    s = DiskStore([path], 64, block_bytes, pickle.load(f), backend=backend)
plan.add(FaultRule.hang(threading.Event(), ops="read", **on_slot(s, 40)))  # for ever
records = scan(s.files)
print([next(records).slot for _ in range(16)] == list(range(16)), flush=True)
records.close()
print("closed", flush=True)
"""


def test_a_process_exits_while_a_closed_scan_s_read_still_hangs(
    tmp_path: Path, fingerprint: LayoutFingerprint
) -> None:
    """A process that closed a scan exits although one of its header reads
    hangs on the disk for ever: the scan's threads are not joined at exit
    (a ``ThreadPoolExecutor``'s are)."""
    import pickle
    import subprocess
    import sys

    with DiskStore([str(tmp_path)], 64, BLOCK_BYTES, fingerprint, backend="posix") as s:
        for slot in range(64):
            s.write_block(slot, KEY + bytes([slot]), block(slot), slot + 1)
    (tmp_path / "fingerprint.pickle").write_bytes(pickle.dumps(fingerprint))
    args = [str(tmp_path), str(tmp_path / "fingerprint.pickle"), str(BLOCK_BYTES)]
    with subprocess.Popen(
        [sys.executable, "-c", _EXIT_WITH_A_HUNG_READ, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            out, err = child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            out, err = child.communicate()
            pytest.fail(f"the process did not exit: {out!r} {err[-2000:]}")
    assert out.split() == ["True", "closed"], err[-2000:]
    assert child.returncode == 0, err[-2000:]


def test_a_scan_whose_reader_cannot_start_leaves_no_thread(
    tmp_path: Path, fingerprint: LayoutFingerprint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The third of a scan's reader threads fails to start ("can't start new
    thread"): the scan raises, and the two started end instead of waiting
    for work for ever."""
    import threading
    import time

    with DiskStore([str(tmp_path)], 64, BLOCK_BYTES, fingerprint, backend="posix") as s:
        for slot in range(64):
            s.write_block(slot, KEY + bytes([slot]), block(slot), slot + 1)
        real_start, started = threading.Thread.start, []

        def start(thread: threading.Thread) -> None:
            if thread.name.startswith("kvtier-scan"):
                if len(started) == 2:
                    raise RuntimeError("can't start new thread")
                started.append(thread)
            real_start(thread)

        monkeypatch.setattr(threading.Thread, "start", start)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            next(scan(s.files))
        deadline = time.monotonic() + 30
        while any(t.is_alive() for t in started):
            assert time.monotonic() < deadline, "a reader never ended"
            time.sleep(0.01)
        assert len(started) == 2


def test_scan_reports_every_slot_and_raises_seq(
    tmp_path: Path, fingerprint: LayoutFingerprint
) -> None:
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    with DiskStore(paths, 7, BLOCK_BYTES, fingerprint, backend="posix") as s:
        for slot, seq in ((0, 10), (3, 2**62), (4, 11), (6, 12)):
            s.write_block(slot, KEY + bytes([slot]), block(slot), seq)
        s.invalidate(6)
        path, off = location(s, 4)
        flip(path, off + 50)
    with DiskStore(paths, 7, BLOCK_BYTES, fingerprint, backend="posix") as s:
        before = s.next_seq()
        results = list(s.scan(window=3))
        assert [r[0] for r in results] == list(range(7))
        outcomes = {slot: outcome for slot, _, outcome in results}
        assert outcomes == {
            0: ReadOutcome.OK,
            1: ReadOutcome.EMPTY,
            2: ReadOutcome.EMPTY,
            3: ReadOutcome.OK,
            4: ReadOutcome.BAD_HEADER,
            5: ReadOutcome.EMPTY,
            6: ReadOutcome.EMPTY,
        }
        headers = {slot: h for slot, h, _ in results if h is not None}
        assert headers[0].key == KEY + b"\x00" and headers[0].seq == 10
        assert headers[3].seq == 2**62 and headers[3].written_at > 0
        assert before < 2**62 < s.next_seq()


def test_warm_restart_reads_only_the_headers_of_slots_that_existed(
    tmp_path: Path, fingerprint: LayoutFingerprint
) -> None:
    """A start's restart scan reads no header of a slot its own create just
    made (a new slab, or a grown slab's new tail: they hold nothing), and
    still finds every block of the slots that were there, a torn one judged
    as before."""
    from kvtier.host.cpu_tier import AttachedRows
    from kvtier.store.runtime import DiskRuntime

    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    nowhere = str(tmp_path / "no-cpu-tier")

    def restart(num_slots: int) -> tuple[list[tuple[bytes, int]], int]:
        store = DiskStore(paths, num_slots, BLOCK_BYTES, fingerprint, backend="posix")
        runtime = DiskRuntime([store], [AttachedRows(nowhere, 1, BLOCK_BYTES)])
        try:
            return runtime.scan_restore(), store.stats().read_bytes
        finally:
            runtime.close()

    # A new store of 64 slots: not one header read.
    assert restart(64) == ([], 0)
    # Blocks in a store that existed: found, reading the existing slots only.
    with DiskStore(paths, 64, BLOCK_BYTES, fingerprint, backend="posix") as s:
        s.write_block(1, KEY + b"\x01", block(1), 5)
        s.write_block(62, KEY + b"\x3e", block(62), 6)
        s.write_block(63, KEY + b"\x3f", block(63), 7)
        path, off = location(s, 63)
        flip(path, off + 50)  # a torn header: a miss, as ever
    # Where the file system tells preallocated, never written bytes (ext4,
    # XFS: SEEK_DATA), only the three written headers are read; elsewhere
    # every slot that existed.
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, 1 << 20)
        try:
            holes = os.lseek(fd, 0, os.SEEK_DATA) != 0
        except OSError as exc:  # ENXIO: no data at all; else: cannot tell
            holes = exc.errno == errno.ENXIO
    finally:
        os.close(fd)
    found = [(KEY + b"\x01", 1), (KEY + b"\x3e", 62)]
    assert restart(64) == (found, (3 if holes else 64) * HEADER_SIZE)
    # Grown to 256 slots: the 64 old ones are read, the 192 new ones are not.
    assert restart(256) == (found, (3 if holes else 64) * HEADER_SIZE)
    with DiskStore(paths, 512, BLOCK_BYTES, fingerprint, backend="posix") as s:
        scanned = [slot for slot, _, _ in s.scan(skip_new=True)]
        assert scanned == ([1, 62, 63] if holes else list(range(256)))
    # And the next start has 512 slots that existed.
    assert restart(512) == (found, (3 if holes else 512) * HEADER_SIZE)


def test_blocks_written_after_a_reset_are_read_but_never_adopted(
    tmp_path: Path, fingerprint: LayoutFingerprint
) -> None:
    """After ``mark_reset`` (a connector reset: a sleep, a weight update)
    every block is written flagged: read like any other while the store is
    open, skipped by the next start's restart scan (its slot free), and an
    older unflagged copy of the same key is adopted instead. The flag ends
    with the store: the next one writes adoptable blocks again."""
    from kvtier.host.cpu_tier import AttachedRows
    from kvtier.store.runtime import DiskRuntime

    paths = [str(tmp_path / "a")]
    nowhere = str(tmp_path / "no-cpu-tier")

    def restart() -> list[tuple[bytes, int]]:
        store = DiskStore(paths, 16, BLOCK_BYTES, fingerprint, backend="posix")
        runtime = DiskRuntime([store], [AttachedRows(nowhere, 1, BLOCK_BYTES)])
        try:
            return runtime.scan_restore()
        finally:
            runtime.close()

    def key(i: int) -> bytes:
        return KEY + bytes([i])

    with DiskStore(paths, 16, BLOCK_BYTES, fingerprint, backend="posix") as s:
        s.write_block(0, key(0), block(0), s.next_seq())
        s.write_block(1, key(1), block(1), s.next_seq())  # older copy of key 1
        s.mark_reset()
        s.write_block(2, key(2), block(2), s.next_seq())
        s.write_block(3, key(1), block(1), s.next_seq())  # newer copy of key 1
        assert [read_header(s, slot)[0].after_reset for slot in range(4)] == [
            False,
            False,
            True,
            True,
        ]
        # Readable while this store is open, as any block.
        out = sentinel_out()
        assert s.read_block(2, key(2), out) is ReadOutcome.OK
        assert np.array_equal(out, block(2))
    assert restart() == [(key(0), 0), (key(1), 1)]
    # A store opened afterwards writes adoptable blocks.
    with DiskStore(paths, 16, BLOCK_BYTES, fingerprint, backend="posix") as s:
        s.write_block(4, key(4), block(4), s.next_seq())
    assert restart() == [(key(0), 0), (key(1), 1), (key(4), 4)]


@pytest.mark.parametrize("answer", ["empty data range", "data behind the offset"])
def test_a_restart_scan_lists_every_slot_where_lseek_answers_nonsense(
    tmp_path: Path, fingerprint: LayoutFingerprint, monkeypatch, answer: str
) -> None:
    """A file system whose SEEK_DATA / SEEK_HOLE answers make no sense (an
    empty data range; data before the offset asked for) is trusted no
    further: every slot that existed is listed, once and in order, instead
    of the scan asking again for ever."""
    from kvtier.store import scan as scan_mod

    paths = [str(tmp_path / "a")]
    with DiskStore(paths, 8, BLOCK_BYTES, fingerprint, backend="posix") as s:
        s.write_block(5, KEY + b"\x05", block(5), 1)
    calls = 0

    def lseek(fd: int, pos: int, how: int) -> int:
        nonlocal calls
        calls += 1
        if calls > 1000:  # the old loop asked again and again
            raise AssertionError("the scan keeps asking lseek")
        if answer == "empty data range":
            return pos  # data starts here and a hole starts here too
        return max(0, pos - 1) if how == os.SEEK_DATA else pos + 1

    monkeypatch.setattr(scan_mod.os, "lseek", lseek)
    with DiskStore(paths, 8, BLOCK_BYTES, fingerprint, backend="posix") as s:
        assert [slot for slot, _, _ in s.scan(skip_new=True)] == list(range(8))


def test_concurrent_distinct_slots(
    tmp_path: Path, fingerprint: LayoutFingerprint
) -> None:
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    with (
        DiskStore(paths, 32, BLOCK_BYTES, fingerprint, backend="posix") as s,
        ThreadPoolExecutor(8) as pool,
    ):
        list(
            pool.map(
                lambda i: s.write_block(i, KEY + bytes([i]), block(i), s.next_seq()),
                range(32),
            )
        )

        def check(i: int) -> bool:
            out = sentinel_out()
            return (
                s.read_block(i, KEY + bytes([i]), out) is ReadOutcome.OK
                and out.tobytes() == block(i).tobytes()
            )

        assert all(pool.map(check, range(32)))
        assert s.stats().blocks_written == 32


def test_read_io_error_is_outcome_logged_once(
    tmp_path: Path,
    fingerprint: LayoutFingerprint,
    caplog: pytest.LogCaptureFixture,
    fault_backend: Any,
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.kvtier.store")
    backend = fault_backend(read_errno=errno.EIO)
    with DiskStore([str(tmp_path)], 4, BLOCK_BYTES, fingerprint, backend=backend) as s:
        out = sentinel_out()
        assert s.read_block(0, KEY, out) is ReadOutcome.IO_ERROR
        assert s.read_block(1, KEY, out) is ReadOutcome.IO_ERROR
        assert (out == SENTINEL).all()
        assert {o for _, _, o in s.scan()} == {ReadOutcome.IO_ERROR}
        assert s.stats().io_errors == 6
    logged = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(logged) == 1 and "errno 5" in logged[0] and s.slabs[0].path in logged[0]


def test_write_error_raises_with_errno(
    tmp_path: Path, fingerprint: LayoutFingerprint, fault_backend: Any
) -> None:
    backend = fault_backend(write_errno=errno.ENOSPC)
    with DiskStore([str(tmp_path)], 4, BLOCK_BYTES, fingerprint, backend=backend) as s:
        with pytest.raises(OSError) as info:
            s.write_block(0, KEY, block(0), 1)
        assert info.value.errno == errno.ENOSPC
        assert s.stats().io_errors == 1
        with pytest.raises(OSError):
            s.invalidate(0)


def test_roundtrip_through_async_only_backend(
    tmp_path: Path, fingerprint: LayoutFingerprint, fault_backend: Any
) -> None:
    backend = fault_backend()  # no faults: exercises both the async and sync paths
    with DiskStore(
        [str(tmp_path)],
        4,
        BLOCK_BYTES,
        fingerprint,
        backend=backend,
        compression="zstd",
    ) as s:
        data = np.zeros(BLOCK_BYTES, np.uint8)
        data[::7] = 3
        s.write_block(1, KEY, data, 1)
        out = sentinel_out()
        assert s.read_block(1, KEY, out) is ReadOutcome.OK
        assert out.tobytes() == data.tobytes()
        s.invalidate(1)
        assert s.read_block(1, KEY, out) is ReadOutcome.EMPTY


def test_argument_validation(tmp_path: Path, fingerprint: LayoutFingerprint) -> None:
    with pytest.raises(ValueError, match="block_bytes"):
        DiskStore([str(tmp_path)], 4, BLOCK_BYTES * 2, fingerprint, backend="posix")
    with pytest.raises(ValueError, match="compression"):
        DiskStore(
            [str(tmp_path)],
            4,
            BLOCK_BYTES,
            fingerprint,
            backend="posix",
            compression="lz4",
        )
    with pytest.raises(ValueError):
        DiskStore([], 4, BLOCK_BYTES, fingerprint, backend="posix")
    with DiskStore([str(tmp_path)], 4, BLOCK_BYTES, fingerprint, backend="posix") as s:
        with pytest.raises(ValueError):
            s.write_block(0, KEY, block(0, BLOCK_BYTES - 1), 1)
        with pytest.raises(ValueError):
            s.write_block(0, b"k" * 65, block(0), 1)
        with pytest.raises(ValueError):
            s.read_block(0, KEY, np.zeros(10, np.uint8))
        with pytest.raises(IndexError):
            s.write_block(4, KEY, block(0), 1)
    with pytest.raises(RuntimeError):
        s.read_block(0, KEY, sentinel_out())


def test_read_header_raises_seq_too(
    tmp_path: Path, fingerprint: LayoutFingerprint
) -> None:
    with DiskStore([str(tmp_path)], 4, BLOCK_BYTES, fingerprint, backend="posix") as s:
        s.write_block(2, KEY, block(2), 2**62)
    with DiskStore([str(tmp_path)], 4, BLOCK_BYTES, fingerprint, backend="posix") as s:
        assert s.next_seq() < 2**62
        hdr, outcome = read_header(s, 2)
        assert outcome is ReadOutcome.OK and hdr is not None and hdr.seq == 2**62
        assert s.next_seq() > 2**62


def test_a_slot_with_the_largest_seq_leaves_room_for_the_next_writes(
    tmp_path: Path, fingerprint: LayoutFingerprint
) -> None:
    """A header's seq is a u64 anyone can set (its checksum is no MAC): a
    slot claiming the largest one must not push ``next_seq`` past what a
    header holds, which would make every later write raise."""
    with DiskStore([str(tmp_path)], 4, BLOCK_BYTES, fingerprint, backend="posix") as s:
        s.write_block(2, KEY, block(2), 2**64 - 1)
    with DiskStore([str(tmp_path)], 4, BLOCK_BYTES, fingerprint, backend="posix") as s:
        assert [outcome for _, _, outcome in s.scan()][2] is ReadOutcome.OK
        for slot in (0, 1):
            seq = s.next_seq()
            assert seq < 2**64
            s.write_block(slot, KEY + bytes([slot]), block(slot), seq)
            out = sentinel_out()
            assert s.read_block(slot, KEY + bytes([slot]), out) is ReadOutcome.OK
            assert np.array_equal(out, block(slot))


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_the_reader_stands_alone_over_slab_files(
    tmp_path: Path, fingerprint: LayoutFingerprint, compression: str
) -> None:
    """The read path needs only the shared files, not a DiskStore."""
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    data = block(7)
    with DiskStore(
        paths, 5, BLOCK_BYTES, fingerprint, backend="posix", compression=compression
    ) as s:
        s.write_block(3, KEY, data, 42)
    backend = make_backend("posix")
    files = SlabFiles.open(paths, fingerprint, 5, backend, owns_backend=True)
    seen: list[int] = []
    reader = SlotReader(files, capacity=1)
    try:
        (got,) = reader.read([(3, KEY)])
        assert got.outcome is ReadOutcome.OK
        assert reader.rows[got.row].tobytes() == data.tobytes()
        assert reader.read([(2, KEY)])[0].outcome is ReadOutcome.EMPTY
        recs = scan(files, on_header=lambda hdr: seen.append(hdr.seq))
        assert [r.outcome for r in recs].count(ReadOutcome.OK) == 1
        assert seen == [42]
        stats = files.stats()
        assert stats.blocks_read == 2 and stats.blocks_written == 0
        assert files.offset_of(3) == (1, files.slabs[1].offset(1))
    finally:
        reader.close()
    with pytest.raises(RuntimeError):
        reader.read([(3, None)])
