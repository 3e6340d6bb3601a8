"""kvtier under vLLM's multiprocess engine core, the mode `vllm serve` uses:
the scheduler and worker run in the engine-core process, the front end
elsewhere; the CPU tier is shared through its /dev/shm file."""

from __future__ import annotations

import os

import pytest

from .workload import run_multiprocess

pytestmark = pytest.mark.e2e


def _cpu_tier_files() -> set[str]:
    shm = "/dev/shm"
    if not os.path.isdir(shm):
        return set()
    return {
        p for p in os.listdir(shm) if p.startswith("kvtier-") and p.endswith(".cpu")
    }


def test_disk_tier_under_the_multiprocess_engine(
    model, block_bytes, baseline, tmp_path
):
    before = _cpu_tier_files()
    result = run_multiprocess(model, block_bytes, tmp_path)
    assert result["outputs"] == baseline
    metrics = result["metrics"]
    assert metrics["vllm:kv_offload_kvtier_spills"] > 0
    assert metrics["vllm:kv_offload_kvtier_promotions"] > 0

    def series(name: str, **labels: str) -> float:
        return sum(
            value
            for n, lab, value in result["series"]
            if n == "vllm:kv_offload_kvtier_" + name
            and all(lab.get(k) == v for k, v in labels.items())
        )

    # The returning prompts were loaded from disk by the engine core's
    # worker (2 prompts x 4 blocks), every slot verified, none failed.
    assert series("loaded_blocks", tier="disk") == 2 * 4, result["series"]
    assert series("load_errors") == 0
    assert series("corrupt_blocks") == 0
    assert series("checksum_failures") == 0
    assert series("read_bytes", tier="disk") > 0
    # A clean shutdown leaves no CPU-tier file behind in /dev/shm.
    assert _cpu_tier_files() <= before
