"""Issue #11, CPU tier: one owner per /dev/shm file, nothing adopted from
another user or a dead engine, nothing left behind by a failed start.

Tests run as root here; "another user" is ``nobody`` (a forked child that
drops to that uid)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_host_safety_disk import NOBODY, as_user, needs_root

from kvtier.connector.config import ConfigError
from kvtier.connector.preflight import prepare_cpu_tier
from kvtier.host import cpu_tier as cpu_buffer_mod
from kvtier.host.cpu_tier import (
    CpuBlockBuffer,
    cpu_buffer_path,
    open_worker_buffer,
    reclaim_stale_cpu_files,
)
from kvtier.safe_open import InUseError
from kvtier.testing.host import cpu_buffer_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
ROW = 4096


@pytest.fixture
def private_dir() -> Iterator[str]:
    """A fresh 0700 directory on /dev/shm (like cpu_buffer_dir)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(prefix="kvtier-test-", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sticky_dir() -> Iterator[Path]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = Path(tempfile.mkdtemp(prefix="kvtier-1777-", dir=base))
    d.chmod(0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def unique_engine_id() -> str:
    return f"host-safety-{os.getpid()}-{time.monotonic_ns()}"


# -- one engine_id, one owner --------------------------------------------------


def test_two_engines_with_one_engine_id_never_share_rows() -> None:
    engine_id = unique_engine_id()
    first = open_worker_buffer(engine_id, 0, 1, 4, ROW)
    try:
        path = cpu_buffer_path(engine_id, 0, 1)
        assert first.shm_path == path and first.owner
        first.array[1, :3] = [1, 2, 3]
        with pytest.raises(InUseError) as info:
            open_worker_buffer(engine_id, 0, 1, 4, ROW)
        message = str(info.value)
        assert repr(engine_id) in message and "unique engine_id" in message
        # The refused attempt left the first engine's file and rows alone.
        assert os.path.exists(path)
        assert first.array[1, :3].tolist() == [1, 2, 3]
        # The scheduler side of the live engine still maps the same rows.
        with CpuBlockBuffer(4, ROW, path, owner=False) as sched:
            assert sched.array[1, :3].tolist() == [1, 2, 3]
    finally:
        first.close()
    assert not os.path.exists(path)
    # Once the first engine is gone, the id is free again.
    with open_worker_buffer(engine_id, 0, 1, 4, ROW) as again:
        assert not again.array.any()


@pytest.mark.parametrize(
    "ids",
    [
        ("{u}.v1", "{u}_v1"),  # "." is not kept in a file name
        ("{u}/a", "{u}_a"),
        ("{u}-" + "x" * 70, "{u}-" + "x" * 70 + "y"),  # cut to 64 characters
        ("{u}é", "{u}_"),
    ],
    ids=["dot", "slash", "long", "non-ascii"],
)
def test_two_engine_ids_never_share_a_file_name(private_dir: str, ids) -> None:
    """Ids that read alike once made a file name (other characters as "_",
    cut to fit) still get one file each: the second engine starts, with
    rows of its own, where one name refused it as a second engine with the
    first's id."""
    u = unique_engine_id()
    a_id, b_id = (i.format(u=u) for i in ids)
    paths = {cpu_buffer_path(i, 0, 1, private_dir) for i in (a_id, b_id)}
    assert len(paths) == 2
    assert all(len(os.path.basename(p)) < 120 for p in paths)
    a = open_worker_buffer(a_id, 0, 1, 4, ROW, directory=private_dir)
    try:
        with open_worker_buffer(b_id, 0, 1, 4, ROW, directory=private_dir) as b:
            a.array[:] = 1
            b.array[:] = 2
            assert int(a.array.max()) == 1 and int(b.array.min()) == 2
    finally:
        a.close()
    # An id of letters, digits, "-" and "_" names its file itself.
    assert os.path.basename(cpu_buffer_path(u, 3, 4)) == f"kvtier-{u}-r3of4.cpu"


def test_cpu_buffer_dir_is_private_and_owner_checked(sticky_dir: Path) -> None:
    d = Path(cpu_buffer_dir(str(sticky_dir)))
    assert d.name == f"kvtier-{os.geteuid()}"
    st = d.stat()
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    d.chmod(0o755)  # ours but readable by others: tightened
    cpu_buffer_dir(str(sticky_dir))
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    d.chmod(0o777)  # writable by others: refused
    with pytest.raises(PermissionError, match="group or others write"):
        cpu_buffer_dir(str(sticky_dir))
    d.rmdir()
    d.symlink_to(sticky_dir)
    with pytest.raises(OSError) as info:
        cpu_buffer_dir(str(sticky_dir))
    assert info.value.errno == errno.ELOOP


@needs_root
def test_cpu_buffer_dir_squatted_by_another_user_is_refused(sticky_dir: Path) -> None:
    d = sticky_dir / f"kvtier-{os.geteuid()}"
    as_user(NOBODY, lambda: d.mkdir(mode=0o777))
    with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
        cpu_buffer_dir(str(sticky_dir))


@needs_root
def test_cpu_tier_moves_beside_a_dir_another_user_holds_and_is_found_there(
    sticky_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another user made this user's ``kvtier-<euid>`` (and a look-alike
    fallback name): the worker makes its file in a fallback of this user's
    own, with a WARNING naming the other uid; the scheduler side, given the
    default name, maps that file (the same rows); the fallback is left
    empty and the other user's entries as they were."""
    primary = sticky_dir / f"kvtier-{os.geteuid()}"
    decoy = sticky_dir / f"kvtier-{os.geteuid()}-0"  # sorts first; not ours
    as_user(NOBODY, lambda: (primary.mkdir(mode=0o777), decoy.mkdir(mode=0o777)))
    with caplog.at_level(logging.WARNING, logger="vllm.kvtier"):
        directory = cpu_buffer_mod.worker_cpu_dir(str(sticky_dir))
    assert directory not in (str(primary), str(decoy))
    assert os.path.basename(directory).startswith(f"kvtier-{os.geteuid()}-")
    st = os.lstat(directory)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 0o700)
    assert f"is held by uid {NOBODY}" in caplog.text and directory in caplog.text
    assert cpu_buffer_mod.worker_cpu_dir(str(sticky_dir)) == directory  # reused

    engine_id = unique_engine_id()
    worker = open_worker_buffer(engine_id, 0, 1, 4, ROW, directory=directory)
    attached = cpu_buffer_mod.AttachedRows(
        cpu_buffer_path(engine_id, 0, 1, str(primary)), 4, ROW
    )
    try:
        worker.array[2, :4] = [9, 8, 7, 6]
        assert list(attached.array[2, :4]) == [9, 8, 7, 6]
        assert os.listdir(directory) == []  # mapped by both: the name is gone
    finally:
        attached.close()
        worker.close()
    # The fallback stays, empty and this user's: removed, its name could be
    # taken before the next worker that chose it made its file there.
    assert os.listdir(directory) == [] and os.lstat(directory).st_uid == os.geteuid()
    assert os.listdir(primary) == [] and primary.stat().st_uid == NOBODY
    assert decoy.stat().st_uid == NOBODY


@needs_root
@pytest.mark.parametrize("owner", [True, None, False])
def test_file_precreated_by_another_user_is_never_adopted(
    sticky_dir: Path, owner: bool | None
) -> None:
    path = sticky_dir / "kvtier-e-r0of1.cpu"

    def plant() -> None:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o666)
        os.fchmod(fd, 0o666)
        os.write(fd, b"\x5a" * (4 * ROW))
        os.close(fd)

    as_user(NOBODY, plant)
    with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
        CpuBlockBuffer(4, ROW, str(path), owner=owner)
    assert path.read_bytes() == b"\x5a" * (4 * ROW)  # neither used nor removed
    assert path.stat().st_uid == NOBODY


@needs_root
def test_directory_swapped_after_its_check_gets_no_file(
    sticky_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The private directory goes with its last file (another engine of
    this user removes it while this one starts), and another user creates
    one of that name before this engine's file is made. The file must not
    be made in the other user's directory, where its owner could rename
    ranks' files into each other's names before the scheduler side maps
    them (wrong rows), or remove them."""
    directory = sticky_dir / f"kvtier-{os.geteuid()}"
    path = directory / "kvtier-e-r0of1.cpu"
    real_open_dir = cpu_buffer_mod.open_private_dir
    swapped: list[bool] = []

    def open_dir_then_lose_it(p: str) -> int:
        fd = real_open_dir(p)
        if not swapped:  # right after the check: the race, made certain
            swapped.append(True)
            os.rmdir(p)  # the last other engine's rmdir_if_empty

            def squat() -> None:
                os.mkdir(p)
                os.chmod(p, 0o777)

            as_user(NOBODY, squat)
        return fd

    monkeypatch.setattr(cpu_buffer_mod, "open_private_dir", open_dir_then_lose_it)
    with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
        CpuBlockBuffer(4, ROW, str(path), owner=True)
    assert swapped and directory.stat().st_uid == NOBODY
    assert os.listdir(directory) == []  # nothing of ours in their directory


def test_symlink_in_place_of_the_cpu_file_is_refused(private_dir: str) -> None:
    target = Path(private_dir) / "target"
    target.write_bytes(b"\0" * ROW)
    target.chmod(0o600)
    link = Path(private_dir) / "tier.cpu"
    link.symlink_to(target)
    for owner in (True, None, False):
        with pytest.raises(OSError) as info:
            CpuBlockBuffer(1, ROW, str(link), owner=owner)
        assert info.value.errno == errno.ELOOP, owner
    assert link.is_symlink() and target.read_bytes() == b"\0" * ROW


@needs_root
def test_start_sweep_never_removes_files_through_a_planted_directory_link(
    sticky_dir: Path, tmp_path: Path
) -> None:
    """Another user plants ``<shm>/kvtier-<euid>`` as a link to a directory
    of ours before our engine starts. The start-up sweep of dead engines'
    files (prepare_cpu_tier) followed it and removed every unlocked 0600
    ``*.cpu`` and old ``*.tmp`` file of ours there; it must remove nothing
    (the start is then refused by the directory check)."""
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    old = time.time() - 3600
    for name in ("notes.tmp", "archive.cpu"):
        f = ours / name
        f.write_bytes(b"precious")
        f.chmod(0o600)
        os.utime(f, (old, old))
    link = sticky_dir / f"kvtier-{os.geteuid()}"
    as_user(NOBODY, lambda: link.symlink_to(ours))
    prepare_cpu_tier(str(link / "kvtier-e-r0of1.cpu"), 4, ROW)
    assert sorted(p.name for p in ours.iterdir()) == ["archive.cpu", "notes.tmp"]
    assert reclaim_stale_cpu_files(str(link), dry_run=True) == []
    # A directory of another user's is not swept either.
    link.unlink()
    theirs = sticky_dir / "theirs"
    as_user(NOBODY, lambda: theirs.mkdir(mode=0o777))
    for name in ("a.cpu", "b.tmp"):
        shutil.copy2(ours / "notes.tmp", theirs / name)  # ours, 0600, unlocked
    assert reclaim_stale_cpu_files(str(theirs)) == []
    assert sorted(p.name for p in theirs.iterdir()) == ["a.cpu", "b.tmp"]


def test_scheduler_side_never_maps_a_file_without_a_live_owner(
    private_dir: str,
) -> None:
    path = os.path.join(private_dir, "stale.cpu")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)  # nobody holds its lock
    os.ftruncate(fd, ROW)
    os.close(fd)
    with pytest.raises(FileNotFoundError, match="no live owner"):
        CpuBlockBuffer(1, ROW, path, owner=False)


# -- dead engines' leftovers -----------------------------------------------------


def _child_holding(paths: list[str]) -> int:
    """Fork a child that owns a CPU buffer at each path; returns its pid once
    the buffers exist."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(ready_r)
            held = [CpuBlockBuffer(4, ROW, p, owner=True) for p in paths]
            for i, b in enumerate(held):
                b.array[:] = 0x40 + i
            os.write(ready_w, b"1")
            while True:
                time.sleep(1)
        finally:
            os._exit(1)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"1"
    os.close(ready_r)
    return pid


def test_a_dead_engines_file_locked_by_a_sweep_is_reclaimed_after_it(
    private_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another rank's start sweeps dead engines' files and holds each one's
    lock while it removes it. A rank that finds its own dead file locked at
    that instant tries again instead of refusing to start ("in use by
    another live process"); a live owner's lock stays held and is refused
    (test_two_engines_with_one_engine_id_never_share_rows)."""
    path = os.path.join(private_dir, "kvtier-e3-r0of1.cpu")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"\x5a" * (4 * ROW))  # the dead engine's rows
    sweep = os.open(path, os.O_RDONLY)
    fcntl.flock(sweep, fcntl.LOCK_EX)  # the other rank's sweep, mid-way
    real_reclaim = cpu_buffer_mod._reclaim
    refused: list[str] = []

    def sweep_ends_after_the_first_refusal(*args, **kwargs):
        try:
            return real_reclaim(*args, **kwargs)
        except InUseError:
            refused.append(args[0])
            os.close(sweep)  # the sweep lets go
            raise

    monkeypatch.setattr(cpu_buffer_mod, "_reclaim", sweep_ends_after_the_first_refusal)
    try:
        with CpuBlockBuffer(4, ROW, path, owner=True) as mine:
            assert refused == [path]
            assert not mine.array.any()  # its own rows, not the dead engine's
    finally:
        os.close(fd)


def test_sigkilled_owner_leaves_a_file_that_a_restart_reclaims(
    private_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vllm.kvtier.host")
    same = os.path.join(private_dir, "kvtier-e1-r0of1.cpu")  # engine id reused
    other = os.path.join(private_dir, "kvtier-e0-r0of1.cpu")  # a new engine id
    pid = _child_holding([same, other])
    try:
        with pytest.raises(InUseError):  # alive: refused, not reclaimed
            CpuBlockBuffer(4, ROW, same, owner=True)
        assert reclaim_stale_cpu_files(private_dir) == []
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    # SIGKILL ran no cleanup: both files still hold shared memory...
    assert os.path.exists(same) and os.path.exists(other)
    # ...the scheduler side refuses the dead engine's rows...
    with pytest.raises(FileNotFoundError, match="no live owner"):
        CpuBlockBuffer(4, ROW, other, owner=False)
    # ...a restart with the same engine id reclaims its file and starts clean,
    with CpuBlockBuffer(4, ROW, same, owner=True) as buf:
        assert not buf.array.any()
        # ...and the start-up sweep removes the other dead engine's file while
        # leaving the live one (ours, locked) alone.
        removed = reclaim_stale_cpu_files(private_dir)
        assert [p for p, _ in removed] == [other]
        assert os.path.exists(same) and not os.path.exists(other)
    assert "reclaimed stale CPU-tier file" in caplog.text


def test_a_start_sweeps_dead_files_in_every_fallback(sticky_dir: Path) -> None:
    """TP ranks starting beside a held ``kvtier-<euid>`` may each make a
    fallback: a start reclaims dead engines' files in all of this user's
    CPU-tier directories, not only the one it makes its file in."""
    own = f"kvtier-{os.geteuid()}"
    dead = []
    for suffix in ("a", "b"):
        d = sticky_dir / f"{own}-{suffix}"
        d.mkdir(mode=0o700)
        path = d / f"kvtier-dead{suffix}-r0of1.cpu"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.posix_fallocate(fd, 0, 4 * ROW)
        os.close(fd)  # no lock: its engine is gone
        dead.append(path)
    prepare_cpu_tier(str(sticky_dir / f"{own}-a" / "kvtier-new-r0of1.cpu"), 4, ROW)
    assert not any(p.exists() for p in dead)


def test_shm_space_error_names_the_files_holding_it(private_dir: str) -> None:
    live = os.path.join(private_dir, "kvtier-live-r0of1.cpu")
    dead = os.path.join(private_dir, "kvtier-dead-r0of1.cpu")
    fd = os.open(dead, os.O_CREAT | os.O_RDWR, 0o600)
    os.posix_fallocate(fd, 0, 8 * ROW)
    os.close(fd)
    mine = os.path.join(private_dir, "kvtier-me-r0of1.cpu")
    with CpuBlockBuffer(4, ROW, live, owner=True):
        with pytest.raises(ConfigError) as info:
            prepare_cpu_tier(mine, 1 << 40, 1 << 22)
        message = str(info.value)
        assert live in message and "--shm-size" in message
        assert not os.path.exists(dead)  # reclaimed before the check
        assert dead not in message
    prepare_cpu_tier(mine, 1, ROW)  # enough space: passes


# -- failed starts leave nothing behind ----------------------------------------


def test_enospc_while_reserving_leaves_no_file(
    private_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cpu_buffer_mod.os, "posix_fallocate", full)
    path = os.path.join(private_dir, "tier.cpu")
    with pytest.raises(OSError, match="cannot reserve .* --shm-size") as info:
        CpuBlockBuffer(4, ROW, path, owner=True)
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(private_dir) == []


def test_owner_that_exits_without_close_leaves_no_file(private_dir: str) -> None:
    """A failed start that raises out of the process (no close()) must not
    leave the file: the owner's finalizer runs at interpreter exit."""
    path = os.path.join(private_dir, "tier.cpu")
    code = (
        "from kvtier.host.cpu_tier import CpuBlockBuffer as B;"
        f"b = B(2, 4096, {path!r}, owner=True);"
        "import os; assert os.path.exists(b.shm_path);"
        "raise SystemExit('engine start failed')"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert r.returncode == 1 and "engine start failed" in r.stderr, r.stderr
    assert os.listdir(private_dir) == []


def test_owner_close_unlinks_only_its_own_file(private_dir: str) -> None:
    path = os.path.join(private_dir, "tier.cpu")
    buf = CpuBlockBuffer(2, ROW, path, owner=True)
    os.unlink(path)  # an operator removed it; a successor created a new one
    successor = CpuBlockBuffer(2, ROW, path, owner=True)
    buf.close()
    assert os.path.exists(path)  # the successor's file survives
    successor.close()
    assert not os.path.exists(path)


# -- the shared-memory check at start ------------------------------------------

_SPEC_BOTH_ROLES = r"""
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor,
)
from kvtier.testing.offloading import offloading_config, tiered_spec

PAGE = 32768  # per layer; two layers: 64 KiB rows
config = offloading_config(
    {"spec_name": "TieredOffloadingSpec", "spec_module_path": "kvtier.connector",
     "cpu_bytes_to_use": 64 * 2 * PAGE},  # 4 MiB of a 6 MiB /dev/shm
    worker_kv_bytes_per_block=2 * PAGE, layers=2,
)
kv = [torch.zeros(4, PAGE, dtype=torch.int8) for _ in range(2)]
caches = CanonicalKVCaches(
    tensors=[CanonicalKVCacheTensor(t, PAGE) for t in kv],
    group_data_refs=[[CanonicalKVCacheRef(i, PAGE) for i in range(2)]],
)
# vLLM's order: the worker's spec and CPU tier (its KV cache), then the
# scheduler's spec (EngineCore builds the Scheduler after the KV caches).
worker_spec = tiered_spec(config)
worker = worker_spec.get_worker(caches)  # kept: its tier holds the room
tiered_spec(config).get_manager()
print("started", flush=True)
"""


def test_cpu_tier_that_fits_shared_memory_starts_both_roles() -> None:
    """A CPU tier that fits /dev/shm once must start: the scheduler's spec is
    built after the worker created its file (without a disk tier the name is
    gone at once), so a check there counted the worker's own tier as taken
    and asked for the room a second time."""
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace: {probe.stderr!r}")
    r = subprocess.run(
        [
            "unshare", "-m", "sh", "-c",
            'mount -t tmpfs -o size=6m tmpfs /dev/shm && exec "$0" -c "$1"',
            sys.executable, _SPEC_BOTH_ROLES,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO_ROOT,
    )
    assert r.returncode == 0 and "started" in r.stdout, r.stderr[-3000:]
