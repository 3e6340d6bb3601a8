"""Hostile and malformed files where kvtier expects its own: FIFOs in place
of kvtier's files (a hang, not a refusal, would stall the engine for good),
slot headers whose fields disagree with each other, and the read-only
``kvtier inspect``/``verify`` on directories holding links.

Every case that could hang runs in a subprocess with a deadline, so a hang
fails the test instead of stalling the suite."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from reliability_common import BLOCK_BYTES, key_of, make_fingerprint, pattern

from kvtier.store.store import DiskStore

REPO_ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60  # each case takes about a second


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (reliability_common importable);
    a hang raises TimeoutExpired."""
    path = os.pathsep.join([str(REPO_ROOT), str(Path(__file__).parent)])
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def kvtier_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``kvtier ...`` in a subprocess; a hang raises TimeoutExpired."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run(
        [sys.executable, "-m", "kvtier.tools.cli", *argv],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def make_store(root: Path, blocks: int = 2) -> Path:
    """A closed store under ``root`` with ``blocks`` slots written; returns
    its kvtier-<digest> directory."""
    with DiskStore(
        [str(root)], 4, BLOCK_BYTES, make_fingerprint(), backend="posix"
    ) as store:
        for i in range(blocks):
            store.write_block(i, key_of(i), pattern(key_of(i)), store.next_seq())
    return Path(store.dirs[0])


# ------------------------------------------------------- FIFOs never block


def test_fifo_in_place_of_layout_json_does_not_hang_the_store_start(
    tmp_path: Path,
) -> None:
    d = make_store(tmp_path)
    (d / "layout.json").unlink()
    os.mkfifo(d / "layout.json")
    p = run_python(
        f"""
    from reliability_common import BLOCK_BYTES, make_fingerprint
    from kvtier.store.store import DiskStore
    with DiskStore([{str(tmp_path)!r}], 4, BLOCK_BYTES, make_fingerprint(),
                   backend="posix"):
        pass
    """
    )
    assert p.returncode == 0, p.stderr
    # layout.json is only an aid: the FIFO was replaced by a regular file.
    assert (d / "layout.json").is_file()


def test_fifo_named_like_a_cpu_tier_file_is_refused_not_waited_on(
    tmp_path: Path,
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    fifo = shm / "kvtier-e-r0of1.cpu"
    os.mkfifo(fifo, 0o600)
    p = run_python(
        f"""
    from kvtier.host.cpu_tier import CpuBlockBuffer
    from kvtier.host.cpu_tier import reclaim_stale_cpu_files
    assert reclaim_stale_cpu_files({str(shm)!r}) == []
    try:
        CpuBlockBuffer(4, 4096, {str(fifo)!r}, owner=True)
    except OSError as exc:
        print("refused:", exc)
    else:
        raise SystemExit("a FIFO was adopted as the CPU tier")
    """
    )
    assert p.returncode == 0, p.stderr
    assert "not a regular file" in p.stdout and str(fifo) in p.stdout
    assert fifo.exists()  # skipped, never removed or adopted


def test_worker_reader_refuses_a_fifo_swapped_in_for_the_slab(tmp_path: Path) -> None:
    """The worker opens the slab by name at its first load, after the
    scheduler created it: a FIFO put there meanwhile is an I/O error (a
    miss), not a load thread blocked forever."""
    d = make_store(tmp_path)
    (d / "slab-0.kvt").rename(d / "moved")
    os.mkfifo(d / "slab-0.kvt", 0o600)
    p = run_python(
        f"""
    from reliability_common import BLOCK_BYTES, key_of, make_fingerprint
    from kvtier.store.slot import ReadOutcome
    from kvtier.store.backends.posix import PosixBackend
    from kvtier.store.slabs import SlabFiles
    from kvtier.store.reader import SlotReader
    r = SlotReader(SlabFiles.open([{str(tmp_path)!r}], make_fingerprint(), 4,
                                  PosixBackend(threads=1), owns_backend=True))
    (res,) = r.read([(0, key_of(0))])
    assert res.outcome is ReadOutcome.IO_ERROR, res.outcome
    r.close()
    """
    )
    assert p.returncode == 0, p.stderr


def test_worker_reader_refuses_a_store_directory_swapped_for_a_link(
    tmp_path: Path,
) -> None:
    """The worker opens its slabs by name: a link put in place of the store
    directory since the scheduler made it (a disk_path others can write)
    was followed, the back end's O_DIRECT probe wrote its file where it
    pointed and a slab there was read. Now the read is an I/O error (a
    miss) and nothing is written there (the hostile-user review)."""
    d = make_store(tmp_path)
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    d.rename(elsewhere)
    d.symlink_to(elsewhere, target_is_directory=True)
    before = sorted(os.listdir(elsewhere))
    p = run_python(
        f"""
    from reliability_common import key_of, make_fingerprint
    from kvtier.store.slot import ReadOutcome
    from kvtier.store.backends.posix import PosixBackend
    from kvtier.store.slabs import SlabFiles
    from kvtier.store.reader import SlotReader
    files = SlabFiles.open([{str(tmp_path)!r}], make_fingerprint(), 4,
                           PosixBackend(threads=1), owns_backend=True)
    try:
        files.handle(0)
        raise AssertionError("the slab was opened through the link")
    except OSError as exc:
        assert "symbolic link where the store directory belongs" in str(exc), exc
    r = SlotReader(files)
    (res,) = r.read([(0, key_of(0))])
    assert res.outcome is ReadOutcome.IO_ERROR, res.outcome
    r.close()
    """
    )
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(elsewhere)) == before  # no probe file there


def test_a_worker_before_the_store_never_keeps_a_slab_it_replaces(
    tmp_path: Path,
) -> None:
    """A slab others can read (restored under umask 022) is replaced by a
    private one when the scheduler side opens the store; a worker that
    opened it first kept the old inode for good, every disk hit then a
    miss (the review's reproduction). The worker leaves such a slab for
    its next try and then reads the store's."""
    from kvtier.store.backends.posix import PosixBackend
    from kvtier.store.reader import SlotReader
    from kvtier.store.slabs import SlabFiles
    from kvtier.store.slot import ReadOutcome

    d = make_store(tmp_path)
    (d / "slab-0.kvt").chmod(0o644)
    files = SlabFiles.open(
        [str(tmp_path)], make_fingerprint(), 4, PosixBackend(threads=1),
        owns_backend=True,
    )  # fmt: skip
    reader = SlotReader(files)
    try:
        with pytest.raises(PermissionError, match="others can read it"):
            files.handle(0)
        with DiskStore(
            [str(tmp_path)], 4, BLOCK_BYTES, make_fingerprint(), backend="posix"
        ) as store:  # the scheduler side: the slab replaced
            store.write_block(3, key_of(3), pattern(key_of(3)), store.next_seq())
            (got,) = reader.read([(3, key_of(3))])
            assert got.outcome is ReadOutcome.OK
            assert os.fstat(files.backend.fileno(files.handles[0])).st_ino == (
                os.stat(d / "slab-0.kvt").st_ino
            )
    finally:
        reader.close()


def test_a_directory_in_place_of_the_slab_is_refused_by_name(tmp_path: Path) -> None:
    """A directory where a slab belongs: the store's start refuses it with
    kvtier's message naming the path and the fix, as for a FIFO or a link,
    not a bare IsADirectoryError."""
    d = make_store(tmp_path)
    (d / "slab-0.kvt").unlink()
    (d / "slab-0.kvt").mkdir()
    with pytest.raises(OSError, match="kvtier refuses .*slab-0.kvt.*a directory"):
        DiskStore([str(tmp_path)], 4, BLOCK_BYTES, make_fingerprint(), backend="posix")
    assert (d / "slab-0.kvt").is_dir()  # left as it was


# ------------------------------------- headers whose fields disagree


def test_raw_slot_checksummed_over_part_of_the_block_is_refused_everywhere(
    tmp_path: Path,
) -> None:
    """A raw slot whose header (valid header checksum, our fingerprint and
    key) says payload_len is half the block: the payload checksum covers
    only that half. The worker's reader used to load the whole block, the
    second half unverified; ``kvtier verify`` called the slot ok."""
    from kvtier.store.backends.posix import PosixBackend
    from kvtier.store.checksum import device_checksum, payload_checksum
    from kvtier.store.compression import Codec
    from kvtier.store.reader import SlotReader
    from kvtier.store.slabs import SlabFiles
    from kvtier.store.slot import HEADER_SIZE, ReadOutcome, SlotHeader

    d = make_store(tmp_path, blocks=1)
    key, half = key_of(0), BLOCK_BYTES // 2
    with open(d / "slab-0.kvt", "r+b") as f:
        f.seek(HEADER_SIZE)
        first = np.frombuffer(f.read(half), np.uint8)
        f.seek(0)
        f.write(
            SlotHeader(
                key=key,
                fingerprint=make_fingerprint().digest(),
                payload_len=half,
                raw_len=BLOCK_BYTES,
                codec=Codec.RAW,
                checksum=payload_checksum(first),
                device_checksum=device_checksum(first),
                seq=1,
                written_at=0.0,
            ).pack()
        )
        f.seek(HEADER_SIZE + half)
        f.write(b"\xee" * half)  # what an unverified read would serve

    reader = SlotReader(
        SlabFiles.open(
            [str(tmp_path)], make_fingerprint(), 4, PosixBackend(threads=1), owns_backend=True
        )
    )
    try:
        (res,) = reader.read([(0, key)])
        assert res.outcome is ReadOutcome.BAD_HEADER
    finally:
        reader.close()
    with DiskStore(
        [str(tmp_path)], 4, BLOCK_BYTES, make_fingerprint(), backend="posix"
    ) as store:
        out = np.zeros(BLOCK_BYTES, np.uint8)
        assert store.read_block(0, key, out) is ReadOutcome.BAD_HEADER
        assert not out.any()
        assert [o for _, _, o in store.scan()][0] is ReadOutcome.BAD_HEADER
    p = kvtier_cli("verify", str(d))
    assert p.returncode == 1 and "slot 0: bad_header" in p.stdout, p.stdout


# ------------------------------------------------- inspect/verify and links


def test_inspect_refuses_a_symlinked_store_directory(tmp_path: Path) -> None:
    """A ``kvtier-<digest>`` link in a (shared) disk path may point
    anywhere: listing the path must not follow it and report what it points
    to as this path's store."""
    real = make_store(tmp_path / "real")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / real.name).symlink_to(real)
    for command in ("inspect", "verify"):
        p = kvtier_cli(command, str(shared))
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert len(lines) == 1 and "symbolic link" in lines[0], p.stderr
        assert str(shared / real.name) in lines[0]
        assert p.stdout == ""
    # The directory itself, named by the operator, is still inspected.
    assert kvtier_cli("verify", str(real)).returncode == 0


def test_a_store_directory_swapped_for_a_link_after_it_was_found_is_not_followed(
    tmp_path: Path,
) -> None:
    """The tools find a store, then read its slabs: a directory another
    user swaps for a link meanwhile (in a shared disk path) is never
    followed; the reads go to the directory that was found."""
    from kvtier.store.scan import scan
    from kvtier.store.slabs import find_stores
    from kvtier.store.slot import ReadOutcome

    real = make_store(tmp_path / "shared", blocks=2)
    decoy = make_store(tmp_path / "decoy", blocks=0)  # same name, nothing in it
    (view,) = find_stores([str(tmp_path / "shared")])
    try:
        real.rename(tmp_path / "moved")
        real.symlink_to(decoy)
        got = {r.slot: r.outcome for r in scan(view, file_order=True, payload=True)}
    finally:
        view.close()
    assert got[0] is ReadOutcome.OK and got[1] is ReadOutcome.OK, got

