"""kvtier under vLLM's multiprocess engine core, the mode `vllm serve` uses:
the scheduler and worker run in the engine-core process, the front end
elsewhere; the CPU tier is shared through its /dev/shm file."""

from __future__ import annotations

import os

import pytest

from kvtier.host.cpu_tier import cpu_tier_dir
from kvtier.host.placement import hyperthread_siblings, numa_neighbours, spare_cpus

from .workload import run_multiprocess

pytestmark = pytest.mark.e2e


def _cpu_tier_files() -> set[str]:
    """This user's CPU-tier files (named while a disk tier needs them)."""
    directory = cpu_tier_dir()
    if not os.path.isdir(directory):
        return set()
    return {p for p in os.listdir(directory) if p.endswith(".cpu")}


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


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs",
)
def test_loads_run_beside_the_cpus_vllm_gave_the_model(
    model, block_bytes, baseline, tmp_path
):
    """vLLM binds a CPU worker's OpenMP threads, the model runner's among
    them, to VLLM_CPU_OMP_THREADS_BIND and leaves the other CPUs to the rest
    of the engine. The disk reads run in the read process, which the load
    thread starts: both on those other CPUs, never on the model's."""
    allowed = os.sched_getaffinity(0)
    model_cpu = min(allowed)
    result = run_multiprocess(
        model, block_bytes, tmp_path, env={"VLLM_CPU_OMP_THREADS_BIND": str(model_cpu)}
    )
    assert result["outputs"] == baseline
    procs = result["read_processes"]
    assert len(procs) == 1, procs  # one worker, one read process
    assert procs[0]["parent_cpus"] == [model_cpu]  # vLLM's binding held
    # Named for ps and top: the read process, and the worker's load thread.
    assert procs[0]["name"] == "kvtier-read"
    assert "kvtier-load" in procs[0]["parent_threads"], procs[0]["parent_threads"]
    spare = spare_cpus(
        {model_cpu},
        allowed,
        near=numa_neighbours({model_cpu}),
        siblings=hyperthread_siblings({model_cpu}),
    )
    assert spare and procs[0]["cpus"] == sorted(spare)
