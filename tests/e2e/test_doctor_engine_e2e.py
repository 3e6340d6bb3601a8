"""``kvtier doctor`` says "ready for vllm serve" exactly where a real engine
starts: each config here goes to the doctor (with the engine's geometry:
``--model``, ``--block-size 32``, ``--dtype float32``) and to a vLLM CPU
engine, and the two verdicts must agree. The cases are those where they
once did not: vLLM's refusals of its offloaded-block keys, the spec's load
buffer, the tiering mode's budgets and vLLM's own CPU-tier policy, and a
key vLLM reads with ``int()`` given as a string."""

from __future__ import annotations

import json
import re

import pytest

from kvtier.store.slot import slot_size
from kvtier.testing.engine import (
    engine,
    offloading_kv_transfer_config,
    tiering_kv_transfer_config,
)
from kvtier.testing.model import build_tiny_llama, kv_bytes_per_block
from kvtier.tools.cli import main

pytestmark = pytest.mark.e2e

GPU_BLOCKS = 20


@pytest.fixture(scope="module")
def model() -> tuple[str, int]:
    """The tiny Llama and its 32-token block's bytes (float32)."""
    path = build_tiny_llama()
    return path, kv_bytes_per_block(path, 32)


def _doctor(capsys, model_dir: str, cfg: dict, shm) -> tuple[int, list[dict]]:
    """The doctor's exit status and its error checks."""
    capsys.readouterr()  # what the engine printed before
    rc = main(
        [
            "doctor", "--config", json.dumps(cfg), "--no-probe", "--shm-dir",
            str(shm), "--model", model_dir, "--block-size", "32", "--dtype",
            "float32", "--json",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    # In this process vLLM's own log lines (an engine configured its logger
    # here) may come first; the report is the JSON object after them.
    checks = json.loads(out[out.index("{\n") :])["checks"]
    return rc, [c for c in checks if c["status"] == "error"]


def _refusal(model_dir: str, cfg: dict) -> str | None:
    """None when the engine starts (and is shut down again), else its
    refusal: the messages of the exception chain."""
    try:
        with engine(model_dir, cfg, num_gpu_blocks=GPU_BLOCKS, block_size=32):
            return None
    except Exception as exc:  # any refusal: its words are compared below
        chain = []
        cause: BaseException | None = exc
        while cause is not None:
            chain.append(f"{type(cause).__name__}: {cause}")
            cause = cause.__cause__ or cause.__context__
        return " | ".join(chain)


def _full(**extra) -> dict:
    return offloading_kv_transfer_config(
        "TieredOffloadingSpec", "kvtier.connector", **extra
    )


def _config(case: str, block: int, disk: str) -> dict:
    full = dict(
        cpu_bytes_to_use=8 * 2 * block,
        disk_bytes_to_use=64 * slot_size(2 * block),
        disk_path=disk,
    )
    big = 32 * block  # 1024-token offloaded blocks: 1 MiB, its slot more
    cases = {
        "block_size_string": lambda: _full(**full, block_size="64"),
        "block_size_48": lambda: _full(**full, block_size=48),
        "blocks_per_chunk_0": lambda: _full(**full, blocks_per_chunk=0),
        "both_block_keys": lambda: _full(**full, block_size=64, blocks_per_chunk=2),
        "load_buffer_below_a_slot": lambda: _full(
            cpu_bytes_to_use=4 * big,
            disk_bytes_to_use=40 * slot_size(big),
            disk_path=disk,
            block_size=1024,
            disk_load_buffer_bytes=1 << 20,
        ),
        "tiering_disk_below_a_slot": lambda: tiering_kv_transfer_config(
            8 * block, disk, slot_size(block) - 1
        ),
        "tiering_vllm_policy_fifo": lambda: tiering_kv_transfer_config(
            8 * block, disk, 64 * slot_size(block), eviction_policy="fifo"
        ),
        "tiering_cpu_below_a_block": lambda: tiering_kv_transfer_config(
            1000, disk, 64 * slot_size(block)
        ),
    }
    return cases[case]()


# (case, the engine's refusal, or None where it starts); the last case last:
# in one process, tiering engines started after a refused tiering start are
# refused another way (a region file vLLM leaves behind), which the first
# pattern allows.
CASES = [
    ("block_size_string", None),
    ("block_size_48", r"'block_size'=48 .* must be a multiple of the GPU"),
    ("blocks_per_chunk_0", r"'blocks_per_chunk' must be greater than 0"),
    ("both_block_keys", r"Specify only one of 'block_size' or 'blocks_per_chunk'"),
    ("load_buffer_below_a_slot", r"\['disk_load_buffer_bytes'\].*hold no disk slot"),
    ("tiering_disk_below_a_slot", r"\['disk_bytes_to_use'\]: \d+ bytes hold no block"),
    ("tiering_vllm_policy_fifo", r"Unknown cache policy: 'fifo'"),
    ("tiering_cpu_below_a_block", r"holds no primary-tier chunk|cannot mmap an empty"),
]


@pytest.mark.parametrize(("case", "refusal"), CASES, ids=[c for c, _ in CASES])
def test_the_doctor_is_ready_exactly_where_the_engine_starts(
    capsys, tmp_path, model, case, refusal
):
    model_dir, block = model
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    cfg = _config(case, block, str(disk))
    got = _refusal(model_dir, cfg)
    rc, errors = _doctor(capsys, model_dir, cfg, shm)
    if refusal is None:
        assert got is None, got
        assert rc == 0, errors
        return
    assert got is not None and re.search(refusal, got), got
    assert rc == 1, f"doctor said ready; the engine refused: {got}"
    # The doctor's error names a key and says what to do.
    assert errors and all(e["fix"] for e in errors), errors
