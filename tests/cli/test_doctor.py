"""``kvtier doctor``'s host checks against real conditions built here:
modes, mounts (as root; skipped where mount is not permitted), stale
CPU-tier files, stores of another identity, the CUDA driver stub."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from doctor_util import MiB, doctor, flags, mounted

from kvtier.connector.config import ConfigError, parse_extra_config
from kvtier.connector.identity import model_identity
from kvtier.connector.preflight import check_disk_paths
from kvtier.store.slot import LayoutFingerprint
from kvtier.store.store import DiskStore
from kvtier.testing.model import build_tiny_llama
from kvtier.tools.cli import HASH_ALGOS


def test_a_healthy_path_passes(capsys, disk, shm):
    rc, checks = doctor(capsys, *flags(disk, shm))
    assert rc == 0
    assert checks[f"{disk}: owner and mode"]["status"] == "ok"
    assert checks[f"{disk}: free space"]["status"] == "ok"
    assert checks[f"{shm}: room for the CPU tier"]["status"] == "ok"
    assert checks["version"]["status"] == "ok"


def test_missing_path_is_an_error(capsys, tmp_path, shm):
    rc, checks = doctor(capsys, *flags(tmp_path / "nope", shm))
    assert rc == 1
    c = checks[f"{tmp_path / 'nope'}: exists"]
    assert c["status"] == "error" and "install -d -m 0700" in c["fix"]


def test_world_writable_path_without_sticky_bit_is_flagged(capsys, disk, shm):
    os.chmod(disk, 0o777)
    rc, checks = doctor(capsys, *flags(disk, shm))
    c = checks[f"{disk}: owner and mode"]
    assert c["status"] == "warning"
    assert "0777" in c["detail"] and "sticky" in c["detail"]
    assert rc == 0  # a warning, not an error
    os.chmod(disk, 0o1777)
    _, checks = doctor(capsys, *flags(disk, shm))
    c = checks[f"{disk}: owner and mode"]
    assert c["status"] == "warning" and "sticky" not in c["detail"]


def test_one_directory_under_two_names_is_an_error(capsys, tmp_path, disk, shm):
    """The engine refuses a directory listed twice (a link or bind mount);
    the doctor says so too, by the same rule, instead of "ready"."""
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(disk)
    rc, checks = doctor(capsys, *flags(disk, shm, "--disk-path", str(other)))
    assert checks["distinct paths"]["status"] == "ok"
    rc, checks = doctor(capsys, *flags(disk, shm, "--disk-path", str(link)))
    found = checks["distinct paths"]
    assert found["status"] == "error" and "same directory" in found["detail"]
    assert rc == 1


def test_unwritable_path_is_an_error(capsys, disk, shm):
    """A read-only mount is named as one, with the mount as the fix (a
    chown cannot help there); a directory of another owner gets chown."""
    if os.geteuid() == 0:
        # Root writes through any mode bits, not onto a read-only file
        # system (CI runs as root: a skip here never ran the test there).
        unwritable = mounted(disk, "tmpfs", "ro,size=1m,mode=0700")
        why, fix = "read-only file system", "remount it read-write"
    else:
        os.chmod(disk, 0o500)
        unwritable = contextlib.nullcontext()
        why, fix = "not writable by this process", "chown <service user>"
    with unwritable:
        rc, checks = doctor(capsys, *flags(disk, shm))
        found = checks[f"{disk}: writable"]
        assert rc == 1 and found["status"] == "error"
        assert why in found["detail"] and fix in found["fix"]
        engine = {"cpu_bytes_to_use": MiB, "disk_bytes_to_use": MiB}
        with pytest.raises(ConfigError, match=f"{why}.*; {fix}"):  # engine start
            check_disk_paths(parse_extra_config({**engine, "disk_path": str(disk)}))


def test_tmpfs_is_named_and_odirect_reported(capsys, tmp_path, shm):
    from kvtier.store.backends.posix import probe_direct

    with mounted(tmp_path / "mnt", "tmpfs", "size=16m,mode=0700") as mnt:
        rc, checks = doctor(capsys, *flags(mnt, shm))
        fs = checks[f"{mnt}: file system"]
        assert fs["status"] == "warning" and fs["detail"].startswith("tmpfs")
        direct = checks[f"{mnt}: O_DIRECT"]
        assert direct["status"] == ("ok" if probe_direct(str(mnt))[0] else "warning")
        assert os.listdir(mnt) == []  # the probe file is gone


def test_a_file_system_without_odirect_is_a_warning(capsys, tmp_path, shm):
    from kvtier.store.backends.posix import probe_direct

    # tmpfs takes O_DIRECT since Linux 6.6; ramfs never has.
    for fstype in ("tmpfs", "ramfs"):
        with mounted(tmp_path / fstype, fstype, "mode=0700") as mnt:
            if probe_direct(str(mnt))[0]:
                continue
            rc, checks = doctor(capsys, *flags(mnt, shm))
            c = checks[f"{mnt}: O_DIRECT"]
            assert c["status"] == "warning" and "buffered I/O" in c["detail"]
            assert "EINVAL" in c["detail"]
            return
    pytest.skip("every RAM file system here accepts O_DIRECT")


def _fill(mnt: Path) -> None:
    with open(mnt / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\xff" * MiB)


def test_a_full_file_system_is_an_error(capsys, tmp_path, shm):
    with mounted(tmp_path / "full", "tmpfs", "size=8m,mode=0700") as mnt:
        _fill(mnt)
        assert os.statvfs(mnt).f_bavail < 2 * MiB // os.statvfs(mnt).f_frsize
        rc, checks = doctor(capsys, *flags(mnt, shm, disk_bytes="4MiB"))
        assert rc == 1
        c = checks[f"{mnt}: free space"]
        assert c["status"] == "error" and "disk_bytes_to_use" in c["detail"]


def test_a_small_shm_is_an_error(capsys, tmp_path, disk):
    with mounted(tmp_path / "shm", "tmpfs", "size=4m,mode=0700") as small:
        rc, checks = doctor(
            capsys,
            "--disk-path", str(disk), "--cpu-bytes", "8MiB", "--disk-bytes", "1MiB",
            "--shm-dir", str(small), "--no-probe",
        )  # fmt: skip
        assert rc == 1
        c = checks[f"{small}: room for the CPU tier"]
        assert c["status"] == "error" and "--shm-size" in c["detail"]


def _cpu_file(directory: Path, name: str) -> int:
    fd = os.open(directory / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, MiB)
    return fd


def test_stale_cpu_tier_files_are_reported_then_reclaimed(capsys, disk, shm):
    own = shm / f"kvtier-{os.geteuid()}"
    own.mkdir(mode=0o700)
    os.close(_cpu_file(own, "kvtier-dead-r0of1.cpu"))  # no live owner
    live = _cpu_file(own, "kvtier-live-r0of1.cpu")
    fcntl.flock(live, fcntl.LOCK_EX)  # a running engine holds its lock
    try:
        rc, checks = doctor(capsys, *flags(disk, shm))
        c = checks[f"{own}: stale files"]
        assert c["status"] == "warning" and rc == 0
        assert "kvtier-dead-r0of1.cpu" in c["detail"] and "live" not in c["detail"]
        assert "--reclaim-stale" in c["fix"]
        assert sorted(os.listdir(own)) == [
            "kvtier-dead-r0of1.cpu",
            "kvtier-live-r0of1.cpu",
        ]
        _, checks = doctor(capsys, *flags(disk, shm, "--reclaim-stale"))
        assert "removed 1" in checks[f"{own}: stale files"]["detail"]
        assert os.listdir(own) == ["kvtier-live-r0of1.cpu"]
    finally:
        os.close(live)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_cpu_tier_dir_held_by_another_user_is_a_warning_and_its_fallback_swept(
    capsys, disk, shm
):
    """Another user holds ``kvtier-<euid>``: a warning naming the uid and the
    fix; a dead engine's file in this user's fallback beside it is found
    and reclaimed, the other user's directory left alone."""
    held = shm / f"kvtier-{os.geteuid()}"
    held.mkdir(mode=0o777)
    os.chown(held, 65534, 65534)
    fallback = shm / f"kvtier-{os.geteuid()}-x1"
    fallback.mkdir(mode=0o700)
    os.close(_cpu_file(fallback, "kvtier-dead-r0of1.cpu"))  # no live owner
    rc, checks = doctor(capsys, *flags(disk, shm))
    c = checks[f"{held}: owner"]
    assert c["status"] == "warning" and rc == 0
    assert "held by uid 65534" in c["detail"] and f"rm -r {held}" in c["fix"]
    assert "kvtier-dead-r0of1.cpu" in checks[f"{held}: stale files"]["detail"]
    _, checks = doctor(capsys, *flags(disk, shm, "--reclaim-stale"))
    assert "removed 1" in checks[f"{held}: stale files"]["detail"]
    assert os.listdir(fallback) == [] and held.stat().st_uid == 65534


def _store(disk: Path, model: str, model_id: str) -> str:
    fp = LayoutFingerprint(
        model=model, dtype="float32", block_bytes=4096, geometry="g", tp_rank=0,
        tp_size=1, model_id=model_id,
    )  # fmt: skip
    with DiskStore([str(disk)], 4, 4096, fp, backend="posix") as s:
        return os.path.basename(s.dirs[0])


def test_stores_of_another_identity_are_set_aside(capsys, disk, shm, monkeypatch):
    model = build_tiny_llama()
    same = model_identity(model, kv_cache_dtype="float32")
    _store(disk, model, same)
    _store(disk, model, "0" * 32)  # an older checkpoint at the same path
    _store(disk, "/models/other", "1" * 32)
    rc, checks = doctor(capsys, *flags(disk, shm, "--model", model))
    stores = {k: v for k, v in checks.items() if k.startswith("store kvtier-")}
    verdicts = sorted((v["status"], v["detail"].split(":")[0]) for v in stores.values())
    assert verdicts == [
        ("ok", "adopted"),
        ("warning", "set aside"),
        ("warning", "set aside"),
    ]
    details = " ".join(v["detail"] for v in stores.values())
    assert "files changed" in details and "another model ('/models/other')" in details
    # The model's files are read once for every store of its name and dtype.
    from kvtier.connector import identity

    reads: list[str] = []
    describe = identity._describe_files

    def counted(root: str):
        reads.append(root)
        return describe(root)

    monkeypatch.setattr(identity, "_describe_files", counted)
    doctor(capsys, *flags(disk, shm, "--model", model))
    assert len(reads) == 1, reads
    # Without --model nothing is claimed either way.
    _, checks = doctor(capsys, *flags(disk, shm))
    assert all(
        "pass --model" in v["detail"]
        for k, v in checks.items()
        if k.startswith("store ")
    )


def test_a_store_a_running_engine_holds_is_an_error(capsys, disk, shm):
    """The doctor said "adopted" and "ready" while a running engine held
    the store: a second engine with that model and layout is refused at
    start (InUseError). Its lock is read from /proc/locks, never taken."""
    model = build_tiny_llama()
    fp = LayoutFingerprint(
        model=model, dtype="float32", block_bytes=4096, geometry="g", tp_rank=0,
        tp_size=1, model_id=model_identity(model, kv_cache_dtype="float32"),
    )  # fmt: skip
    with DiskStore([str(disk)], 4, 4096, fp, backend="posix") as running:
        name = os.path.basename(running.dirs[0])
        rc, checks = doctor(capsys, *flags(disk, shm, "--model", model))
        check = checks[f"store {name}"]
        assert check["status"] == "error" and rc == 1, check
        held = f"in use by a running kvtier engine (held by pid {os.getpid()}"
        assert held in check["detail"]
        assert "InUseError" in check["detail"] and "own disk_path" in check["fix"]
        # Without --model: said, not judged.
        rc, checks = doctor(capsys, *flags(disk, shm))
        assert "in use by a running kvtier engine" in checks[f"store {name}"]["detail"]
    rc, checks = doctor(capsys, *flags(disk, shm, "--model", model))
    assert checks[f"store {name}"]["detail"].startswith("adopted:") and rc == 0


@pytest.mark.parametrize("identity", [["x"], "x", 7])
def test_a_layout_identity_that_is_no_object_is_a_warning(
    capsys, disk, shm, identity
):
    """layout.json is the store's (damaged, or planted in a shared path): an
    identity that is not an object is reported, not a traceback."""
    model = build_tiny_llama()
    name = _store(disk, model, model_identity(model, kv_cache_dtype="float32"))
    layout = disk / name / "layout.json"
    doc = json.loads(layout.read_text())
    doc["identity"] = identity
    layout.write_text(json.dumps(doc))
    rc, checks = doctor(capsys, *flags(disk, shm, "--model", model))
    store = checks[f"store {name}"]
    assert store["status"] == "warning" and store["detail"].startswith("unknown:")
    assert repr(identity) in store["detail"] and rc == 0


def test_a_planted_layout_sends_no_control_characters_to_the_terminal(
    capsys, disk, shm
):
    """A store planted in a shared disk path names the served model and
    carries escape sequences in its layout.json identity: the doctor's
    report of it ("adopted ... dtype=...") printed them raw, so the
    operator's terminal took them (retitled, cleared). They are shown."""
    from kvtier.tools.cli import main

    model = build_tiny_llama()
    name = _store(disk, model, model_identity(model, kv_cache_dtype="float32"))
    layout = disk / name / "layout.json"
    doc = json.loads(layout.read_text())
    doc["identity"] = {"dtype": "\x1b]0;pwned\x07\x1b[2J", "\x9bq": "x"}
    layout.write_text(json.dumps(doc))
    main(["doctor", *flags(disk, shm, "--model", model)])
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if f"store {name}" in s)
    assert "adopted" in line
    assert not any(c in out for c in "\x1b\x07\x9b")
    assert "dtype=\\x1b]0;pwned\\x07\\x1b[2J" in line and "\\x9bq=x" in line


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's store needs root")
def test_a_store_of_another_user_is_never_called_adopted(capsys, disk, shm):
    """Another user planted the engine's store directory (its layout.json
    copied, the model named) in a shared disk path: the doctor called it
    "adopted" (ok) and counted its slabs as free space, while the engine
    refuses to open it and so to start."""
    model = build_tiny_llama()
    name = _store(disk, model, model_identity(model, kv_cache_dtype="float32"))
    store = disk / name
    for p in (store, *store.iterdir()):
        os.chown(p, 65534, 65534)  # as if created by nobody
    rc, checks = doctor(capsys, *flags(disk, shm, "--model", model))
    check = checks[f"store {name}"]
    # Written for this model: most likely the engine's own store name, which
    # it refuses to open, so an error (the doctor said "ready" before).
    assert check["status"] == "error" and rc == 1, check
    assert check["detail"].startswith("not adopted:")
    assert "owned by uid 65534" in check["detail"]
    assert "adopted store" not in checks[f"{disk}: free space"]["detail"]
    # Without --model the doctor cannot tell whose it is: a warning.
    rc, checks = doctor(capsys, *flags(disk, shm))
    assert checks[f"store {name}"]["status"] == "warning" and rc == 0
    # Ours again but writable by others: refused as well.
    for p in (store, *store.iterdir()):
        os.chown(p, os.geteuid(), os.getegid())
    store.chmod(0o777)
    rc, checks = doctor(capsys, *flags(disk, shm, "--model", model))
    assert "mode 0777" in checks[f"store {name}"]["detail"] and rc == 1
    store.chmod(0o700)
    _, checks = doctor(capsys, *flags(disk, shm, "--model", model))
    assert checks[f"store {name}"]["detail"].startswith("adopted:")


def test_a_model_that_cannot_be_read_is_a_warning(capsys, disk, shm, monkeypatch):
    """A store whose model cannot be hashed (an I/O error reading its files)
    is a store that cannot be read: a warning, not a failed check."""
    model = build_tiny_llama()
    _store(disk, model, model_identity(model, kv_cache_dtype="float32"))

    def unreadable(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("kvtier.connector.identity.model_identity", unreadable)
    rc, checks = doctor(capsys, *flags(disk, shm, "--model", model))
    found = checks["existing stores"]
    assert found["status"] == "warning" and "cannot read a store" in found["detail"]
    assert rc == 0


def test_xxhash_without_seed_warns(capsys, disk, shm, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    _, checks = doctor(capsys, *flags(disk, shm, "--hash-algo", "xxhash"))
    c = checks["prefix hash xxhash"]
    assert c["status"] == "warning" and "PYTHONHASHSEED" in c["fix"]
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    _, checks = doctor(capsys, *flags(disk, shm, "--hash-algo", "xxhash"))
    assert checks["prefix hash xxhash"]["status"] == "ok"
    # vLLM seeds with any value set, even Python's words for a random seed.
    for seed in ("", "random"):
        monkeypatch.setenv("PYTHONHASHSEED", seed)
        _, checks = doctor(capsys, *flags(disk, shm, "--hash-algo", "xxhash"))
        c = checks["prefix hash xxhash"]
        assert c["status"] == "ok" and f"PYTHONHASHSEED={seed!r}" in c["detail"]


def test_hash_algos_are_vllms():
    from vllm.config.cache import PrefixCachingHashAlgo

    assert typing.get_args(PrefixCachingHashAlgo) == HASH_ALGOS


def test_throughput_probe_is_bounded_and_cleans_up(capsys, disk, shm):
    argv = [a for a in flags(disk, shm, disk_bytes="64MiB") if a != "--no-probe"]
    rc, checks = doctor(capsys, *argv, "--probe-seconds", "0.5")
    c = checks[f"{disk}: throughput"]
    assert c["status"] == "ok" and "write" in c["detail"] and "fill" in c["detail"]
    assert [n for n in os.listdir(disk) if n.startswith(".kvtier")] == []


# ------------------------------------------------------------- kvikio / GDS


def _stub_lib_dir(broken: bool) -> Path:
    """tests/stubs' libcuda.so.1 (the test-only CUDA driver stub)."""
    import importlib.util

    from tests.stubs.build_stub import stub_lib_dir

    if importlib.util.find_spec("kvikio") is None:
        pytest.skip("kvikio not installed (run scripts/install-kvikio.sh)")
    lib_dir = stub_lib_dir(broken)
    if lib_dir is None:
        pytest.skip("no C compiler (gcc) to build the CUDA driver stub")
    return lib_dir


@pytest.mark.parametrize("broken", [False, True], ids=["stub-driver", "broken-driver"])
def test_io_path_with_a_cuda_driver_stub(tmp_path, disk, shm, broken):
    """kvikio over a (stub) driver: usable, compat mode, chosen by 'auto'; a
    driver whose cuDriverGetVersion fails: refused, no hang."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVIKIO_")}
    env["LD_LIBRARY_PATH"] = str(_stub_lib_dir(broken))
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.tools.cli", "doctor", "--json", *flags(disk, shm)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    checks = {c["subject"]: c for c in json.loads(proc.stdout)["checks"]}
    kvikio, path = checks["kvikio"]["detail"], checks["disk I/O path"]["detail"]
    if broken:
        assert kvikio.startswith("not usable") and "cuDriverGetVersion" in kvikio
        assert path.startswith("posix threads")
    else:
        assert kvikio.startswith("usable, compat mode")
        assert path.startswith("kvikio, compat mode")


def _topology(root: Path, nodes: dict[str, str], smt: int = 1) -> str:
    """A host's /sys/devices/system: NUMA nodes' CPU lists, and physical
    cores of ``smt`` consecutive-by-half logical CPUs (x86 numbering)."""
    cpus = set()
    for node, cpulist in nodes.items():
        (root / "node" / node).mkdir(parents=True)
        (root / "node" / node / "cpulist").write_text(cpulist)
        lo, hi = (int(x) for x in cpulist.split("-"))
        cpus |= set(range(lo, hi + 1))
    n = len(cpus)
    for cpu in cpus:
        topo = root / "cpu" / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0")
        (topo / "core_id").write_text(str(cpu % (n // smt)))
    return str(root)


@pytest.mark.parametrize(
    ("env", "nodes", "smt", "status"),
    [
        # A list that leaves a CPU of the node outside the model's.
        ({"VLLM_CPU_OMP_THREADS_BIND": "0-14"}, {"node0": "0-15"}, 1, "ok"),
        # Two ranks on one node that take every CPU of it.
        ({"VLLM_CPU_OMP_THREADS_BIND": "0-7|8-15"}, {"node0": "0-15"}, 1, "warning"),
        # Two ranks, a node each, one CPU left on each.
        (
            {"VLLM_CPU_OMP_THREADS_BIND": "0-6|8-14"},
            {"node0": "0-7", "node1": "8-15"},
            1,
            "ok",
        ),
        # Rank 0 leaves CPUs only on the other rank's node.
        (
            {"VLLM_CPU_OMP_THREADS_BIND": "0-7|8-14"},
            {"node0": "0-7", "node1": "8-15"},
            1,
            "warning",
        ),
        ({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, {"node0": "0-15"}, 1, "warning"),
        ({"VLLM_CPU_OMP_THREADS_BIND": "zero"}, {"node0": "0-15"}, 1, "error"),
        # vLLM reads no stride and no spaces.
        ({"VLLM_CPU_OMP_THREADS_BIND": "0-14:2"}, {"node0": "0-15"}, 1, "error"),
        ({}, {"node0": "0-15"}, 1, "ok"),
        ({}, {"node0": "0-1"}, 1, "warning"),
        # 4 logical CPUs on 2 cores: vLLM reserves none.
        ({}, {"node0": "0-3"}, 2, "warning"),
        ({"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, {"node0": "0-1"}, 1, "ok"),
        ({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, {"node0": "0-15"}, 1, "warning"),
    ],
)
def test_cpu_placement(tmp_path, env, nodes, smt, status):
    from kvtier.tools.commands.doctor_host import check_cpu_placement

    root = _topology(tmp_path, nodes, smt)
    allowed = set()
    for cpulist in nodes.values():
        lo, hi = (int(x) for x in cpulist.split("-"))
        allowed |= set(range(lo, hi + 1))
    (c,) = check_cpu_placement(env, allowed, root)
    assert c.area == "cpu" and c.status == status, c
    assert bool(c.fix) == (status != "ok"), c
    if status == "error":
        assert "VLLM_CPU_OMP_THREADS_BIND" in c.fix


def test_cpu_placement_is_reported_on_the_cpu_platform(capsys, disk, shm, monkeypatch):
    from kvtier.tools.commands.doctor_config import vllm_distribution

    if (vllm_distribution() or ("",))[0] != "vllm-cpu":
        pytest.skip("the CPU placement check is vllm-cpu's")
    cpus = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    _, checks = doctor(capsys, *flags(disk, shm))
    c = checks[f"VLLM_CPU_OMP_THREADS_BIND={','.join(map(str, cpus))}"]
    assert c["area"] == "cpu" and c["status"] == "warning"  # nothing left
