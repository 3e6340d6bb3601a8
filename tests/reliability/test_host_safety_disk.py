"""Issue #11, disk side: symlink and ownership attacks on a world-writable
``disk_path``, pre-placed slabs, and two engines on one store directory.

Tests run as root here; "another user" is ``nobody`` (a forked child that
drops to that uid), so the files it creates really are foreign-owned."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import stat
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from reliability_common import BLOCK_BYTES, SENTINEL, key_of, make_fingerprint, pattern

from kvtier.safe_open import InUseError, open_private, open_private_dir
from kvtier.store.slabs import store_dirname
from kvtier.store.slot import ReadOutcome
from kvtier.store.store import DiskStore

NOBODY = 65534


def as_user(uid: int, fn: Callable[[], None]) -> None:
    """Run ``fn`` in a forked child that switched to ``uid``; assert success."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            fn()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the child as uid {uid} did not finish in 30 s")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(done[1]) == 0


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="creating files as another user needs root"
)


@pytest.fixture
def sticky_dir() -> Iterator[Path]:
    """A /tmp-like directory: mode 1777, anyone may create entries."""
    d = Path(tempfile.mkdtemp(prefix="kvtier-1777-"))
    d.chmod(0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def open_store(base: Path | str, slots: int = 4) -> DiskStore:
    return DiskStore(
        [str(base)], slots, BLOCK_BYTES, make_fingerprint(), backend="posix"
    )


def write_keys(store: DiskStore, n: int) -> list[bytes]:
    keys = [key_of(i) for i in range(n)]
    for slot, key in enumerate(keys):
        store.write_block(slot, key, pattern(key), store.next_seq())
    return keys


def read_ok(store: DiskStore, slot: int, key: bytes) -> bool:
    out = np.full(BLOCK_BYTES, SENTINEL, np.uint8)
    if store.read_block(slot, key, out) is not ReadOutcome.OK:
        return False
    return bool(np.array_equal(out, pattern(key)))


# -- the safe opener itself ---------------------------------------------------


def test_open_private_refuses_links_foreign_and_writable_files(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"secret")
    target.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(OSError) as info:
        open_private(str(link), os.O_RDONLY)
    assert info.value.errno == errno.ELOOP and "symbolic link" in str(info.value)

    target.chmod(0o666)
    with pytest.raises(PermissionError, match="group or others write"):
        open_private(str(target), os.O_RDONLY)
    target.chmod(0o644)
    with pytest.raises(PermissionError, match="not private"):
        open_private(str(target), os.O_RDONLY, private=True)
    os.close(open_private(str(target), os.O_RDONLY))  # owner's, not writable: ok

    (tmp_path / "adir").mkdir()
    with pytest.raises(OSError):
        open_private(str(tmp_path / "adir"), os.O_RDONLY)


@needs_root
def test_open_private_refuses_another_users_file(sticky_dir: Path) -> None:
    planted = sticky_dir / "planted"

    squatted = sticky_dir / "squatted"

    def plant() -> None:
        os.close(os.open(planted, os.O_CREAT | os.O_WRONLY, 0o600))
        squatted.mkdir(mode=0o700)

    as_user(NOBODY, plant)
    assert planted.stat().st_uid == NOBODY
    with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
        open_private(str(planted), os.O_RDWR)
    with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
        open_private_dir(str(squatted))
    # Our own directory, but writable by everyone (1777): refused as well.
    with pytest.raises(PermissionError, match="group or others write"):
        open_private_dir(str(sticky_dir))


# -- store directories and slabs ----------------------------------------------


def test_symlink_in_place_of_a_slab_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "disk"
    with open_store(base) as store:
        slab = Path(store.slabs[0].path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"do not touch")
    slab.unlink()
    slab.symlink_to(victim)
    with pytest.raises(OSError) as info:
        open_store(base)
    assert info.value.errno == errno.ELOOP
    assert str(slab) in str(info.value) and "symbolic link" in str(info.value)
    assert victim.read_bytes() == b"do not touch"


def test_symlink_in_place_of_the_store_directory_is_refused(
    sticky_dir: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (sticky_dir / store_dirname(make_fingerprint())).symlink_to(elsewhere)
    with pytest.raises(OSError) as info:
        open_store(sticky_dir)
    assert info.value.errno == errno.ELOOP
    assert list(elsewhere.iterdir()) == []  # nothing created through the link


@needs_root
def test_foreign_owned_slab_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "disk"
    with open_store(base) as store:
        slab = store.slabs[0].path
    os.chown(slab, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
        open_store(base)


@needs_root
def test_foreign_owned_store_dir_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "disk"
    with open_store(base) as store:
        store_dir = store.dirs[0]
    os.chown(store_dir, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=f"owned by uid {NOBODY}"):
        open_store(base)


def test_group_or_world_writable_store_dir_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "disk"
    with open_store(base) as store:
        store_dir = Path(store.dirs[0])
    store_dir.chmod(0o777)
    with pytest.raises(PermissionError, match="group or others write"):
        open_store(base)
    # Merely readable by others: ours, so the mode is tightened instead.
    store_dir.chmod(0o755)
    with open_store(base):
        assert stat.S_IMODE(store_dir.stat().st_mode) == 0o700


@needs_root
def test_preplaced_slab_in_a_world_writable_dir_is_never_served(
    sticky_dir: Path, tmp_path: Path
) -> None:
    """Another user builds a store directory with a perfectly valid slab for
    our layout (crafted blocks under keys we will look up) in a 1777
    disk_path, before we start: we refuse the directory, never read it."""
    genuine = tmp_path / "genuine"
    with open_store(genuine) as store:
        keys = write_keys(store, 2)
        src_dir = Path(store.dirs[0])
    name = src_dir.name
    slab_bytes = (src_dir / "slab-0.kvt").read_bytes()
    layout = (src_dir / "layout.json").read_bytes()

    def plant() -> None:
        d = sticky_dir / name
        d.mkdir(mode=0o700)
        (d / "slab-0.kvt").write_bytes(slab_bytes)
        (d / "layout.json").write_bytes(layout)

    as_user(NOBODY, plant)
    with pytest.raises(PermissionError) as info:
        open_store(sticky_dir)
    assert f"owned by uid {NOBODY}" in str(info.value)
    assert name in str(info.value)
    # Sanity: the planted slab would have been served (valid blocks).
    assert keys


def test_plain_file_where_the_store_directory_goes(tmp_path: Path) -> None:
    base = tmp_path / "disk"
    base.mkdir()
    (base / store_dirname(make_fingerprint())).write_text("not a directory")
    with pytest.raises(OSError) as info:
        open_store(base)
    assert info.value.errno == errno.ENOTDIR
    assert "not a directory" in str(info.value)


# -- one engine per store directory --------------------------------------------


def test_second_store_on_one_disk_path_is_refused_until_the_first_closes(
    tmp_path: Path,
) -> None:
    base = tmp_path / "disk"
    first = open_store(base, slots=8)
    keys = write_keys(first, 3)
    with pytest.raises(InUseError) as info:
        open_store(base, slots=8)
    assert str(base) in str(info.value) and "disk_path" in str(info.value)
    first.close()
    with open_store(base, slots=8) as second:  # warm restart finds the blocks
        found = {h.key: slot for slot, h, o in second.scan() if o is ReadOutcome.OK}
        assert set(found) == set(keys)
        assert all(read_ok(second, found[k], k) for k in keys)


def test_the_refusal_names_the_holder_by_its_whole_title(tmp_path: Path) -> None:
    """The holder's name was its kernel comm, cut to 15 characters
    ("VLLM::EngineCor" for vLLM's engine core, whose docs say
    "VLLM::EngineCore"): now its command line, where a process title is."""
    import subprocess
    import sys

    base = tmp_path / "disk"
    setproctitle = pytest.importorskip("setproctitle")  # vLLM's, for its titles
    code = (
        "import sys, time\n"
        f"import {setproctitle.__name__}\n"
        "setproctitle.setproctitle(sys.argv[3])  # as vLLM titles its processes\n"
        "sys.path[:0] = sys.argv[2:3]\n"
        "from reliability_common import make_fingerprint\n"
        "from kvtier.store.store import DiskStore\n"
        f"s = DiskStore([sys.argv[1]], 8, {BLOCK_BYTES}, make_fingerprint(), "
        "backend='posix')\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    title = "holder-with-a-title-longer-than-fifteen"
    here = str(Path(__file__).parent)
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(base), here, title],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        with pytest.raises(InUseError) as info:
            open_store(base, slots=8)
        assert f"held by pid {holder.pid}, " in str(info.value)
        assert title in str(info.value)
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_sigkilled_engine_leaves_no_stale_lock(tmp_path: Path) -> None:
    base = tmp_path / "disk"
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(ready_r)
            store = open_store(base, slots=8)
            write_keys(store, 3)
            os.write(ready_w, b"1")
            while True:
                time.sleep(1)
        finally:
            os._exit(1)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1"
        with pytest.raises(InUseError) as info:
            open_store(base, slots=8)
        # The holder is named: an orphan (a killed server's engine core
        # lives on) is otherwise hard to find.
        assert f"pid {pid}" in str(info.value), str(info.value)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready_r)
    with open_store(base, slots=8) as store:
        found = {h.key: slot for slot, h, o in store.scan() if o is ReadOutcome.OK}
        assert set(found) == {key_of(i) for i in range(3)}
        assert all(read_ok(store, s, k) for k, s in found.items())


def test_a_child_forked_by_a_killed_engine_keeps_none_of_its_locks(
    tmp_path: Path,
) -> None:
    """The engine forks a helper without exec (os.fork, multiprocessing's
    fork start) after its store and CPU-tier file are open, then is
    SIGKILLed while the helper lives on. The helper shared the locks' open
    file descriptions: the restart was refused as "in use by another
    running kvtier engine" and the CPU-tier file taken for a live owner's,
    for as long as the helper ran. The locks must die with the engine."""
    from kvtier.host.cpu_tier import CpuBlockBuffer

    base, shm = tmp_path / "disk", tmp_path / "shm"
    shm.mkdir(mode=0o700)
    cpu = str(shm / "kvtier-e-r0of1.cpu")
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the engine
        try:
            os.close(ready_r)
            store = open_store(base, slots=8)
            write_keys(store, 3)
            rows = CpuBlockBuffer(4, 4096, cpu, owner=True)
            helper = os.fork()
            if helper == 0:  # the helper: outlives the engine
                time.sleep(120)
                os._exit(0)
            os.write(ready_w, helper.to_bytes(4, "little"))
            while store and rows:
                time.sleep(1)
        finally:
            os._exit(1)
    os.close(ready_w)
    helper = 0
    try:
        helper = int.from_bytes(os.read(ready_r, 4), "little")
        assert helper > 0
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.kill(helper, 0)  # the helper still runs
        with open_store(base, slots=8) as store:  # not "in use"
            found = {h.key for _s, h, o in store.scan() if o is ReadOutcome.OK}
            assert found == {key_of(i) for i in range(3)}
        with pytest.raises(FileNotFoundError, match="no live owner"):
            CpuBlockBuffer(4, 4096, cpu, owner=False)
        with CpuBlockBuffer(4, 4096, cpu, owner=True) as rows:  # reclaimed
            assert not rows.array.any()
    finally:
        os.close(ready_r)
        if helper > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(helper, signal.SIGKILL)
