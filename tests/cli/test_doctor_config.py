"""``kvtier doctor``'s config checks and its bad input: clear errors that
name the key or the file, exit status 1 (a check failed) or 2 (unreadable)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from doctor_util import (
    REPO_ROOT,
    MiB,
    doctor,
    flags,
    run_config,
    shipped_config,
    write,
)

from kvtier.tools.cli import main


def good_config(disk: Path) -> dict:
    return shipped_config("cpu-disk.json", disk)


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


def test_a_missing_or_misspelt_spec_name_is_told_as_the_engine_tells_it(
    capsys, tmp_path, disk, shm
):
    """Without spec_name vLLM builds its CPUOffloadingSpec, which ignores
    kvtier's keys: the doctor says so in the engine's words (it said "None
    is not a kvtier spec"); a misspelt one gets the name it is closest to."""
    from kvtier.connector.config import ConfigError, check_kvtier_keys_are_read

    doc = good_config(disk)
    extra = doc["kv_connector_extra_config"]
    del extra["spec_name"]
    with pytest.raises(ConfigError) as engine:
        check_kvtier_keys_are_read(extra, "CPUOffloadingSpec")
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 1 and checks["spec_name"]["detail"] == str(engine.value)
    assert "is missing, so vLLM builds CPUOffloadingSpec" in str(engine.value)
    extra["spec_name"] = "TieredOffloadSpec"
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    found = checks["spec_name"]
    assert rc == 1 and "did you mean 'TieredOffloadingSpec'?" in found["detail"]


def test_a_size_refused_from_the_flags_names_the_flag(capsys, disk, shm):
    """The doctor's flags set the config's keys: the fix names the flag the
    operator typed, not the key."""
    argv = ["--disk-path", str(disk), "--cpu-bytes", "1MiB", "--shm-dir", str(shm)]
    rc, checks = doctor(capsys, *argv, "--no-probe")
    found = checks["disk_bytes_to_use"]
    assert rc == 1 and found["status"] == "error"
    assert found["fix"] == "give or fix --disk-bytes (it sets disk_bytes_to_use)"
    # A --shm-dir that is not there: named, not "the check itself failed".
    rc, checks = doctor(capsys, *flags(disk, disk / "no-shm"))
    found = checks[f"{disk / 'no-shm'}: exists"]
    assert rc == 1 and "--shm-dir does not exist" in found["detail"]


def test_missing_recompute_policy_is_an_error(capsys, tmp_path, disk, shm):
    doc = good_config(disk)
    del doc["kv_load_failure_policy"]
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 1
    c = checks["kv_load_failure_policy"]
    assert c["status"] == "error" and '"recompute"' in c["fix"]


def test_kvikio_requested_without_a_driver_is_an_error(capsys, tmp_path, disk, shm):
    from kvtier.store.backends.kvikio_probe import usable_status

    if usable_status()[0]:
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


def test_every_refused_key_is_a_check_of_its_own(capsys, tmp_path, disk, shm):
    doc = good_config(disk)
    extra = doc["kv_connector_extra_config"]
    extra.update(disk_io="spdk", disk_io_threads=0, eviction_polcy="lru")
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 1
    for key, fragment in (
        ("eviction_polcy", "did you mean 'eviction_policy'?"),
        ("disk_io", "got 'spdk'; accepted values: auto | posix | kvikio"),
        ("disk_io_threads", "got 0; accepted values: integer in [1, 256]"),
    ):
        assert checks[key]["status"] == "error", key
        assert fragment in checks[key]["detail"]
        assert "more key(s) refused" not in checks[key]["detail"]


def test_config_and_flags_together_or_neither(capsys, tmp_path, disk):
    path = write(tmp_path, good_config(disk))
    assert main(["doctor", "--config", path, "--disk-path", str(disk)]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["doctor"]) == 2
    assert "give --config FILE.json" in capsys.readouterr().err


def test_revision_and_download_dir_need_the_model(capsys, tmp_path, disk):
    """They pick the snapshot of --model (vllm serve's flags): alone they
    would be silently ignored."""
    path = write(tmp_path, good_config(disk))
    assert main(["doctor", "--config", path, "--revision", "v2"]) == 2
    err = capsys.readouterr().err
    assert "--revision" in err and "give --model" in err
    argv = ["doctor", "--config", path, "--download-dir", str(tmp_path)]
    assert main(argv) == 2
    assert "--download-dir" in capsys.readouterr().err


def test_a_model_that_is_no_model_is_refused(capsys, tmp_path, disk, shm):
    """A mistyped local --model made every store of the real model "written
    for another model", with "remove it" as the fix: refused instead (a
    file, a path that is not there); a hub id is left to the hub."""
    config = tmp_path / "config.json"
    config.write_text("{}")
    for model, told in (
        (str(tmp_path / "nope"), "no such directory"),
        ("./nope", "no such directory"),
        ("org/name/extra", "no such directory"),
        (str(config), "is a file"),
    ):
        assert main(["doctor", *flags(disk, shm, "--model", model)]) == 2, model
        err = capsys.readouterr().err
        assert repr(model) in err and told in err, err
    assert main(["doctor", *flags(disk, shm, "--model", str(tmp_path))]) == 0
    assert main(["doctor", *flags(disk, shm, "--model", "org/name")]) == 0
    capsys.readouterr()


def test_text_output_and_exit_status(capsys, tmp_path, shm):
    rc = main(["doctor", *flags(tmp_path / "nope", shm)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "[ERROR  ] disk" in out and "fix: install -d -m 0700" in out
    assert (
        out.rstrip().splitlines()[-1].startswith(f"{out.count('[')} checks: 1 error(s)")
    )


@pytest.mark.parametrize(
    "shipped", ["vllm-tiering-kvtier-disk.json", "vllm-tiering-kvtier-disk-cpu.json"]
)
def test_tiering_mode_config(capsys, tmp_path, disk, shm, shipped):
    # vLLM's TieringOffloadingSpec and kvtier's PortableTieringSpec alike.
    doc = shipped_config(shipped, disk)
    doc["kv_connector_extra_config"]["secondary_tiers"][0]["disk_bytes_to_use"] = (
        1 << 30
    )
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 0, [c for c in checks.values() if c["status"] == "error"]
    assert "tiering mode" in checks["kv_connector"]["detail"]
    assert checks[f"{disk}: free space"]["status"] == "ok"
    doc["kv_connector_extra_config"]["secondary_tiers"][0]["disk_bytez"] = 1
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 1 and "secondary_tiers" in checks["disk_bytez"]["detail"]
    # A second kvtier disk tier is refused, as at engine start.
    tiers = doc["kv_connector_extra_config"]["secondary_tiers"]
    del tiers[0]["disk_bytez"]
    tiers.append(dict(tiers[0]))
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 1
    assert "lists 2 entries of type 'KvtierDiskTier'" in (
        checks["secondary_tiers"]["detail"]
    )


@pytest.mark.parametrize(
    "shipped", ["vllm-tiering-kvtier-disk.json", "vllm-tiering-kvtier-disk-cpu.json"]
)
def test_a_tier_module_path_that_does_not_import_is_an_error(
    capsys, tmp_path, disk, shm, shipped
):
    """Engine start refuses a kvtier tier entry whose module_path does not
    import (vLLM's factory would end it in a bare ModuleNotFoundError); the
    doctor says so, naming the key, instead of 'ready'."""
    doc = shipped_config(shipped, disk)
    tier = doc["kv_connector_extra_config"]["secondary_tiers"][0]
    tier["disk_bytes_to_use"] = 1 << 30
    tier["module_path"] = "kvtier.connector.tierin"
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 1
    c = checks["module_path"]
    assert c["status"] == "error", c
    assert "no module 'kvtier.connector.tierin'" in c["detail"], c
    assert "[type=KvtierDiskTier]" in c["detail"], c


@pytest.mark.parametrize(
    "tiers", [5, "KvtierDiskTier", {"type": "KvtierDiskTier"}, None, True]
)
def test_secondary_tiers_not_a_list_is_an_error_not_a_traceback(
    capsys, tmp_path, disk, shm, tiers
):
    """vLLM's tiering spec refuses a secondary_tiers that is no list; the
    doctor says so, naming the key, instead of raising (an int) or
    reporting "no entry" (a dict, a string: their keys or letters)."""
    doc = shipped_config("vllm-tiering-kvtier-disk.json", disk)
    doc["kv_connector_extra_config"]["secondary_tiers"] = tiers
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 1
    c = checks["secondary_tiers"]
    assert c["status"] == "error" and "a list of tier entries" in c["detail"], c


@pytest.mark.parametrize(
    "shipped", ["cpu-disk.json", "cpu-only.json", "vllm-tiering-kvtier-disk.json"]
)
@pytest.mark.parametrize("value", [True, "false", 1, False])
def test_canonical_layout_is_refused_as_at_engine_start(
    capsys, tmp_path, disk, shm, shipped, value
):
    """Every kvtier spec and disk tier refuses vLLM's canonical_layout at
    engine start; vLLM reads the key with bool(), so "false" asks for it."""
    doc = shipped_config(shipped, disk)
    extra = doc["kv_connector_extra_config"]
    for tier in extra.get("secondary_tiers", []):
        tier["disk_bytes_to_use"] = 1 << 30
    extra["canonical_layout"] = value
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    if not value:
        assert rc == 0 and "canonical_layout" not in checks
        return
    assert rc == 1
    c = checks["canonical_layout"]
    assert c["status"] == "error"
    assert "remove canonical_layout" in c["detail"], c


def test_sync_load_budget_is_refused_where_the_engine_refuses_it(
    capsys, tmp_path, disk, shm
):
    """sync_load_budget_bytes on a vLLM without synchronous loads (0.32):
    the spec refuses it at engine start, so the doctor does too. With
    synchronous loads and a disk tier (0.33), a warning: the engine refuses
    it under async scheduling and under Model Runner V2, both its defaults
    on CUDA, which only the engine's own flags decide."""
    compat = pytest.importorskip("kvtier.connector.compat")
    doc = good_config(disk)
    doc["kv_connector_extra_config"]["sync_load_budget_bytes"] = 256 * MiB
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    if compat.SYNC_LOADS:
        assert rc == 0
        c = checks["sync_load_budget_bytes"]
        assert c["status"] == "warning" and "--no-async-scheduling" in c["fix"], c
        assert "VLLM_USE_V2_MODEL_RUNNER=0" in c["fix"], c
        return
    assert rc == 1
    c = checks["sync_load_budget_bytes"]
    assert c["status"] == "error" and "no synchronous loads" in c["detail"], c


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("lookup_timeout_s", 0, "got 0; accepted values: seconds > 0"),
        ("root_dir", "shared/kvcache", "absolute path"),
        ("lookup_timeout", 5, "unknown key"),
    ],
)
def test_shared_tier_keys_are_refused_as_at_engine_start(
    capsys, tmp_path, disk, shm, key, value, needle
):
    """SharedFsTier refuses a bad key when vLLM builds it
    (parse_shared_tier_config); the
    doctor must not call such a config ready for vllm serve."""
    doc = json.loads(
        json.dumps(
            shipped_config("vllm-tiering-kvtier-disk-shared.json", disk)
        ).replace("/mnt/shared/kvcache", str(tmp_path))
    )
    tiers = doc["kv_connector_extra_config"]["secondary_tiers"]
    tiers[0]["disk_bytes_to_use"] = 1 << 30
    # vLLM's factory takes its own keys out before the tier sees the rest.
    tiers[1]["backpressure"] = {"backpressure_cls": "EMABackpressureDetector"}
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 0, [c for c in checks.values() if c["status"] == "error"]
    tiers[1][key] = value
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 1
    c = checks[key]
    assert c["status"] == "error" and needle in c["detail"], c
    assert "[type=SharedFsTier]" in c["detail"], c


@pytest.mark.parametrize("kind", ["fifo", "directory", "missing", "binary", "deep"])
def test_unreadable_config_is_one_line_and_no_hang(tmp_path, kind):
    """In a subprocess with a timeout: a FIFO must not block the read."""
    path = tmp_path / "kv.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe{")
    elif kind == "deep":
        path.write_text('{"kv_role": ' + "[" * 100_000)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.tools.cli", "doctor", "--config", str(path)],
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


def test_config_as_json_text_like_vllm_serve(capsys, disk, shm):
    """--config takes the --kv-transfer-config text itself, as vllm serve
    does, with its bare size tokens (2M = 2 MiB) and quoted size strings."""
    doc = good_config(disk)
    doc["kv_connector_extra_config"]["disk_bytes_to_use"] = "3MiB"
    text = json.dumps(doc).replace(
        f'"cpu_bytes_to_use": {MiB}', '"cpu_bytes_to_use": 2M'
    )
    assert '"cpu_bytes_to_use": 2M' in text
    rc, checks = doctor(capsys, "--config", text, "--shm-dir", str(shm), "--no-probe")
    assert rc == 0, [c for c in checks.values() if c["status"] == "error"]
    assert "CPU 2.0 MiB, disk 3.0 MiB over 1 path(s)" in checks["kvtier keys"]["detail"]


@pytest.mark.parametrize(
    "text,fragment",
    [
        ('{"kv_role": "kv_both", oops}', "--config (JSON text) is not valid JSON"),
        ('{"kv_connector_extra_config": {"cpu_bytes_to_use": 1.5G}}', "decimals"),
        ('  {"kv_role": "kv_both"}', "'kv_connector_extra_config' is missing"),
        ('{"kv_role": ' + "[" * 100_000, "JSON nested too deeply"),
    ],
)
def test_bad_json_text(capsys, text, fragment):
    assert main(["doctor", "--config", text]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier doctor: ") and fragment in err, err


def test_tiering_mode_sizes(capsys, disk, shm):
    """Under vLLM's tiering spec the disk tier's budget is kvtier's (a size
    string works), the CPU budget vLLM's (read with int(): a bare token in
    the flag's text works, a numeric string too, a size string does not)."""
    doc = shipped_config("vllm-tiering-kvtier-disk.json", disk)
    extra = doc["kv_connector_extra_config"]
    extra["secondary_tiers"][0]["disk_bytes_to_use"] = "1G"
    text = json.dumps(doc).replace(
        f'"cpu_bytes_to_use": {MiB}', '"cpu_bytes_to_use": 2M'
    )
    rc, checks = doctor(capsys, "--config", text, "--shm-dir", str(shm), "--no-probe")
    assert rc == 0, [c for c in checks.values() if c["status"] == "error"]
    assert "CPU 2.0 MiB, disk 1.0 GiB" in checks["kvtier keys"]["detail"]
    extra["cpu_bytes_to_use"] = "2M"
    rc, checks = run_config(capsys, disk.parent, shm, doc)
    assert rc == 1 and "int()" in checks["cpu_bytes_to_use"]["detail"]
    extra["cpu_bytes_to_use"] = str(2 * MiB)  # int() reads it, as vLLM does
    rc, checks = run_config(capsys, disk.parent, shm, doc)
    assert rc == 0, [c for c in checks.values() if c["status"] == "error"]
    assert "CPU 2.0 MiB" in checks["kvtier keys"]["detail"]


def test_a_load_buffer_past_the_hosts_memory_is_an_error(
    capsys, monkeypatch, tmp_path, disk, shm
):
    """Each worker allocates disk_load_buffer_bytes as it starts, where
    more than the host's memory fails every worker: the doctor says so; more
    than the memory available now (a worker killed for memory at start, as
    a differential run against the engine saw) is a warning."""
    doc = good_config(disk)
    doc["kv_connector_extra_config"]["disk_load_buffer_bytes"] = 1 << 60
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    assert rc == 1
    c = checks["disk load buffer"]
    assert c["status"] == "error" and "disk_load_buffer_bytes" in c["detail"]
    assert "lower disk_load_buffer_bytes" in c["fix"]
    # The default is no error, and no line.
    rc, checks = run_config(capsys, tmp_path, shm, good_config(disk))
    assert rc == 0 and "disk load buffer" not in checks
    from kvtier.tools.commands import doctor_host

    free = doctor_host._available_memory()
    assert free is not None and 0 < free <= os.sysconf("SC_PHYS_PAGES") * (
        os.sysconf("SC_PAGE_SIZE")
    )
    # A fixed "available now" below the host's memory, so the case does not
    # ride on what other processes hold.
    monkeypatch.setattr(doctor_host, "_available_memory", lambda: 1 << 30)
    doc["kv_connector_extra_config"]["disk_load_buffer_bytes"] = 2 << 30
    rc, checks = run_config(capsys, tmp_path, shm, doc)
    c = checks["disk load buffer"]
    assert c["status"] == "warning" and "available" in c["detail"]
