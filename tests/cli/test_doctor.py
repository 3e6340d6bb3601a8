"""``kvtier doctor`` against real conditions built here: modes, mounts (as
root), stale CPU-tier files, stores of another identity, bad input."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import typing
from pathlib import Path

import pytest

from kvtier.cli import HASH_ALGOS, main
from kvtier.connector.identity import model_identity
from kvtier.io.disk_store import DiskStore
from kvtier.io.format import LayoutFingerprint
from kvtier.testing.model import build_tiny_llama

MiB = 1 << 20


def doctor(capsys, *argv: str) -> tuple[int, dict[str, dict]]:
    """Run ``kvtier doctor --json``; (exit status, checks by subject)."""
    rc = main(["doctor", "--json", *argv])
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] == (rc == 0)
    return rc, {c["subject"]: c for c in out["checks"]}


def flags(disk: Path, shm: Path, *more: str, disk_bytes: str = "1MiB") -> list[str]:
    return [
        "--disk-path", str(disk), "--cpu-bytes", "1MiB", "--disk-bytes", disk_bytes,
        "--shm-dir", str(shm), "--no-probe", *more,
    ]  # fmt: skip


@pytest.fixture
def disk(tmp_path) -> Path:
    d = tmp_path / "disk"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def shm(tmp_path) -> Path:
    d = tmp_path / "shm"
    d.mkdir(mode=0o700)
    return d


@contextlib.contextmanager
def mounted(target: Path, fstype: str, options: str):
    """A fresh file system at ``target``; skips where mount is not permitted."""
    target.mkdir(exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", fstype, "-o", options, fstype, str(target)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount {fstype}: {r.stderr.strip() or r.returncode}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


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


def test_unwritable_path_is_an_error(capsys, disk, shm):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: no unwritable directory to build")
    os.chmod(disk, 0o500)
    rc, checks = doctor(capsys, *flags(disk, shm))
    assert rc == 1 and checks[f"{disk}: writable"]["status"] == "error"


def test_tmpfs_is_named_and_odirect_reported(capsys, tmp_path, shm):
    from kvtier.io.posix_backend import probe_direct

    with mounted(tmp_path / "mnt", "tmpfs", "size=16m,mode=0700") as mnt:
        rc, checks = doctor(capsys, *flags(mnt, shm))
        fs = checks[f"{mnt}: file system"]
        assert fs["status"] == "warning" and fs["detail"].startswith("tmpfs")
        direct = checks[f"{mnt}: O_DIRECT"]
        assert direct["status"] == ("ok" if probe_direct(str(mnt))[0] else "warning")
        assert os.listdir(mnt) == []  # the probe file is gone


def test_a_file_system_without_odirect_is_a_warning(capsys, tmp_path, shm):
    from kvtier.io.posix_backend import probe_direct

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


def _store(disk: Path, model: str, model_id: str) -> str:
    fp = LayoutFingerprint(
        model=model, dtype="float32", block_bytes=4096, geometry="g", tp_rank=0,
        tp_size=1, model_id=model_id,
    )  # fmt: skip
    with DiskStore([str(disk)], 4, 4096, fp, backend="posix") as s:
        return os.path.basename(s.dirs[0])


def test_stores_of_another_identity_are_set_aside(capsys, disk, shm):
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
    # Without --model nothing is claimed either way.
    _, checks = doctor(capsys, *flags(disk, shm))
    assert all(
        "pass --model" in v["detail"]
        for k, v in checks.items()
        if k.startswith("store ")
    )


def test_xxhash_without_seed_warns(capsys, disk, shm, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    _, checks = doctor(capsys, *flags(disk, shm, "--hash-algo", "xxhash"))
    c = checks["prefix hash xxhash"]
    assert c["status"] == "warning" and "PYTHONHASHSEED" in c["fix"]
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    _, checks = doctor(capsys, *flags(disk, shm, "--hash-algo", "xxhash"))
    assert checks["prefix hash xxhash"]["status"] == "ok"


def test_hash_algos_are_vllms():
    from vllm.config.cache import PrefixCachingHashAlgo

    assert typing.get_args(PrefixCachingHashAlgo) == HASH_ALGOS


def test_throughput_probe_is_bounded_and_cleans_up(capsys, disk, shm):
    argv = [a for a in flags(disk, shm, disk_bytes="64MiB") if a != "--no-probe"]
    rc, checks = doctor(capsys, *argv, "--probe-seconds", "0.5")
    c = checks[f"{disk}: throughput"]
    assert c["status"] == "ok" and "write" in c["detail"] and "fill" in c["detail"]
    assert [n for n in os.listdir(disk) if n.startswith(".kvtier")] == []


# ------------------------------------------------------------- the config


def write(tmp_path: Path, doc: object, name: str = "kv.json") -> str:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


def good_config(disk: Path) -> dict:
    return json.loads(
        (Path(__file__).resolve().parents[2] / "configs" / "cpu-disk.json")
        .read_text()
        .replace("/mnt/nvme0/kvtier", str(disk))
        .replace("64000000000", str(MiB))
        .replace("1000000000000", str(MiB))
    )


def run_config(capsys, tmp_path, shm, doc) -> tuple[int, dict[str, dict]]:
    path = write(tmp_path, doc)
    return doctor(capsys, "--config", path, "--shm-dir", str(shm), "--no-probe")


def test_the_shipped_config_shape_passes(capsys, tmp_path, disk, shm):
    rc, checks = run_config(capsys, tmp_path, shm, good_config(disk))
    assert rc == 0, [c for c in checks.values() if c["status"] == "error"]
    assert checks["kv_connector"]["status"] == "ok"
    assert checks["kv_load_failure_policy"]["status"] == "ok"


def test_a_disk_tier_under_the_stock_connector_is_an_error(capsys, tmp_path, disk, shm):
    doc = good_config(disk)
    doc["kv_connector"] = "OffloadingConnector"
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 1 and checks["kv_connector"]["status"] == "error"
    assert "TieredOffloadingConnector" in checks["kv_connector"]["fix"]


def test_missing_recompute_policy_is_an_error(capsys, tmp_path, disk, shm):
    doc = good_config(disk)
    del doc["kv_load_failure_policy"]
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 1
    c = checks["kv_load_failure_policy"]
    assert c["status"] == "error" and '"recompute"' in c["fix"]


def test_kvikio_requested_without_a_driver_is_an_error(capsys, tmp_path, disk, shm):
    from kvtier.io.kvikio_backend import kvikio_usable

    if kvikio_usable():
        pytest.skip("kvikio is usable on this host")
    doc = good_config(disk)
    doc["kv_connector_extra_config"]["disk_io"] = "kvikio"
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 1 and checks["disk I/O path"]["status"] == "error"
    assert "'auto' or 'posix'" in checks["disk I/O path"]["fix"]


def test_missing_config_file(capsys, tmp_path):
    assert main(["doctor", "--config", str(tmp_path / "absent.json")]) == 2
    err = capsys.readouterr().err
    assert "cannot read --config" in err and "No such file" in err


def test_malformed_json(capsys, tmp_path):
    path = write(tmp_path, '{"kv_connector": "TieredOffloadingConnector",\n  oops}')
    assert main(["doctor", "--config", path]) == 2
    err = capsys.readouterr().err
    assert (
        "is not valid JSON (line 2, column 3" in err and "--kv-transfer-config" in err
    )


def test_not_an_object_and_no_extra_config(capsys, tmp_path):
    assert main(["doctor", "--config", write(tmp_path, [1, 2])]) == 2
    assert "expected an object" in capsys.readouterr().err
    assert main(["doctor", "--config", write(tmp_path, {"kv_role": "kv_both"})]) == 2
    assert "'kv_connector_extra_config' is missing" in capsys.readouterr().err


def test_unknown_keys_name_the_key(capsys, tmp_path, disk, shm):
    doc = good_config(disk)
    doc["kv_connector_extra_config"]["disk_bytes"] = 5
    doc["kv_conector"] = "x"
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 1
    assert checks["disk_bytes"]["status"] == "error"
    assert "unknown key; valid keys are" in checks["disk_bytes"]["detail"]
    assert checks["kv_conector"]["status"] == "error"
    assert "kv_connector" in checks["kv_conector"]["detail"]


def test_config_and_flags_together_or_neither(capsys, tmp_path, disk):
    path = write(tmp_path, good_config(disk))
    assert main(["doctor", "--config", path, "--disk-path", str(disk)]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["doctor"]) == 2
    assert "give --config FILE.json" in capsys.readouterr().err


def test_text_output_and_exit_status(capsys, tmp_path, shm):
    rc = main(["doctor", *flags(tmp_path / "nope", shm)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "[ERROR  ] disk" in out and "fix: install -d -m 0700" in out
    assert (
        out.rstrip().splitlines()[-1].startswith(f"{out.count('[')} checks: 1 error(s)")
    )


# ------------------------------------------------------------- kvikio / GDS


def _stub_lib_dir(broken: bool) -> Path:
    """tests/stubs' libcuda.so.1 (the test-only CUDA driver stub)."""
    import importlib.util

    if importlib.util.find_spec("kvikio") is None:
        pytest.skip("kvikio not installed (run scripts/install-kvikio.sh)")
    path = Path(__file__).resolve().parents[1] / "stubs" / "build_stub.py"
    spec = importlib.util.spec_from_file_location("kvtier_doctor_build_stub", path)
    assert spec is not None and spec.loader is not None
    build_stub = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_stub)
    if build_stub.compiler() is None:
        pytest.skip("no C compiler (gcc) to build the CUDA driver stub")
    if not broken:
        return build_stub.build_stub().parent
    out = build_stub.DEFAULT_OUT_DIR / "broken"
    return build_stub.build_stub(out, defines=["KVTIER_STUB_BROKEN_DRIVER"]).parent


@pytest.mark.parametrize("broken", [False, True], ids=["stub-driver", "broken-driver"])
def test_io_path_with_a_cuda_driver_stub(tmp_path, disk, shm, broken):
    """kvikio over a (stub) driver: usable, compat mode, chosen by 'auto'; a
    driver whose cuDriverGetVersion fails: refused, no hang."""
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVIKIO_")}
    env["LD_LIBRARY_PATH"] = str(_stub_lib_dir(broken))
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "doctor", "--json", *flags(disk, shm)],
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


def test_tiering_mode_config(capsys, tmp_path, disk, shm):
    text = (
        Path(__file__).resolve().parents[2]
        / "configs"
        / "vllm-tiering-kvtier-disk.json"
    ).read_text()
    doc = json.loads(
        text.replace("/mnt/nvme0/kvtier", str(disk))
        .replace("64000000000", str(MiB))
        .replace("1000000000000", str(MiB))
    )
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 0, [c for c in checks.values() if c["status"] == "error"]
    assert "tiering mode" in checks["kv_connector"]["detail"]
    assert checks[f"{disk}: free space"]["status"] == "ok"
    doc["kv_connector_extra_config"]["secondary_tiers"][0]["disk_bytez"] = 1
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 1 and "secondary_tiers" in checks["disk_bytez"]["detail"]


@pytest.mark.parametrize("kind", ["fifo", "directory", "missing", "binary"])
def test_unreadable_config_is_one_line_and_no_hang(tmp_path, kind):
    """In a subprocess with a timeout: a FIFO must not block the read."""
    import sys

    path = tmp_path / "kv.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe{")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "doctor", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier doctor: "), proc.stderr
    assert str(path) in lines[0] and "Traceback" not in proc.stderr
