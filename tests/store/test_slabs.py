from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from kvtier.store import slabs as slab_mod
from kvtier.store.slabs import (
    STORE_DIR_RE,
    SlabFile,
    create_slab,
    global_slot,
    local_slot_count,
    locate,
    slab_name,
    store_digest_prefix,
    store_dirname,
)
from kvtier.store.slot import LayoutFingerprint


def create(path: str, num_slots: int, slot_size: int) -> SlabFile:
    create_slab(path, num_slots, slot_size)
    return SlabFile(path, 0, num_slots, slot_size, num_slots * slot_size)


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o277, 0o000])
def test_created_owner_only_and_sized(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        s = create(str(tmp_path / "s.kvt"), 5, 8192)
    finally:
        os.umask(old)
    assert mode(s.path) == 0o600
    assert os.path.getsize(s.path) == 5 * 8192
    assert [s.offset(i) for i in range(5)] == [0, 8192, 16384, 24576, 32768]
    with pytest.raises(IndexError):
        s.offset(5)
    with pytest.raises(IndexError):
        s.offset(-1)


def test_preallocated_blocks_on_disk(tmp_path: Path) -> None:
    s = create(str(tmp_path / "s.kvt"), 16, 65536)
    # posix_fallocate reserves the space up front (not a sparse file).
    assert os.stat(s.path).st_blocks * 512 >= 16 * 65536


def test_fallocate_unsupported_falls_back_to_ftruncate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def nope(fd: int, off: int, size: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(slab_mod.os, "posix_fallocate", nope)
    s = create(str(tmp_path / "s.kvt"), 3, 4096)
    assert os.path.getsize(s.path) == 3 * 4096


def test_a_sparse_slab_is_preallocated_again_keeping_its_blocks(
    tmp_path: Path,
) -> None:
    """A slab copied with its holes (cp --sparse, rsync -S) was left sparse
    on reopen (only a short one was preallocated), so a spill into a hole
    on a full disk failed with ENOSPC."""
    path = tmp_path / "s.kvt"
    with open(path, "wb") as f:  # slot 1 of 16 written, the rest holes
        f.truncate(16 * 65536)
        f.seek(65536)
        f.write(b"k" * 65536)
    path.chmod(0o600)  # as kvtier keeps it
    if os.stat(path).st_blocks * 512 >= 16 * 65536:
        pytest.skip("this file system writes no sparse files")
    create(str(path), 16, 65536)
    assert os.stat(path).st_blocks * 512 >= 16 * 65536
    data = path.read_bytes()
    assert data[65536 : 2 * 65536] == b"k" * 65536 and len(data) == 16 * 65536
    assert data[:65536] == bytes(65536)


def test_fallocate_unsupported_never_shrinks_a_larger_slab(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.kvt"
    path.write_bytes(b"x" * 40000)
    path.chmod(0o600)

    def nope(fd: int, off: int, size: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(slab_mod.os, "posix_fallocate", nope)
    with open(path, "r+b") as f:  # a hole at the end: sparse, as restored
        f.truncate(3 * 65536)
    create(str(path), 2, 65536)
    assert os.path.getsize(path) == 3 * 65536
    assert path.read_bytes()[:40000] == b"x" * 40000


def test_reopen_keeps_contents_never_shrinks_and_tightens_mode(tmp_path: Path) -> None:
    path = tmp_path / "s.kvt"
    path.write_bytes(b"x" * 40000)
    os.chmod(path, 0o700)  # ours and private, only not 0600 (any user opens it)
    s = create(str(path), 2, 8192)
    assert os.path.getsize(path) == 40000
    assert path.read_bytes()[:5] == b"xxxxx"
    assert mode(s.path) == 0o600
    create(str(path), 10, 8192)
    assert os.path.getsize(path) == 10 * 8192
    assert path.read_bytes()[:5] == b"xxxxx"


def test_a_slab_readable_by_others_is_replaced_not_chmodded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A descriptor opened while the slab was readable (another user's)
    must not read what is written after the store took it: the store
    writes to a new private file, the old one keeps only its old bytes."""
    path = tmp_path / "s.kvt"
    path.write_bytes(b"x" * 40000)
    os.chmod(path, 0o644)
    opened_before = os.open(path, os.O_RDONLY)
    try:
        with caplog.at_level("WARNING", logger="vllm.kvtier"):
            dev_ino, old_size = create_slab(str(path), 2, 8192)
        assert old_size == 0  # nothing in it is reused
        assert mode(str(path)) == 0o600
        assert (os.stat(path).st_dev, os.stat(path).st_ino) == dev_ino
        assert os.fstat(opened_before).st_ino != dev_ino[1]
        with open(path, "r+b") as f:
            f.write(b"secret")
        assert os.pread(opened_before, 6, 0) == b"xxxxxx"
        assert path.read_bytes()[:6] == b"secret"
        assert os.path.getsize(path) == 2 * 8192
        assert "was readable by others (mode 0644)" in caplog.text
    finally:
        os.close(opened_before)


def test_striping_rule_round_trips() -> None:
    for stripes in (1, 2, 3, 5):
        counts = [local_slot_count(23, i, stripes) for i in range(stripes)]
        assert sum(counts) == 23
        seen = set()
        for s in range(23):
            f, local = locate(s, stripes)
            assert local < counts[f]
            assert global_slot(f, local, stripes) == s
            seen.add((f, local))
        assert len(seen) == 23
    assert slab_name(3) == "slab-3.kvt"
    slab = SlabFile("s", 0, 5, 8192, 5 * 8192)
    assert slab.offset(3) == 3 * 8192
    with pytest.raises(IndexError):
        slab.offset(-1)


def test_store_directory_name_round_trips() -> None:
    layout = LayoutFingerprint("t/m", "bfloat16", 16384, "g", 0, 1)
    name = store_dirname(layout)
    assert STORE_DIR_RE.match(name)
    assert store_digest_prefix(name) == layout.digest().hex()[:16]
    assert layout.digest().hex().startswith(store_digest_prefix(name) or "-")
    for other in ("kvtier-0123", "kvtier-0123456789ABCDEF", "x" + name, name + "0"):
        assert store_digest_prefix(other) is None
