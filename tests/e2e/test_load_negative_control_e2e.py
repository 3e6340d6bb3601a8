"""A negative control for every load path: wrong bytes in the KV cache
after a load change the outputs.

The e2e tests prove a load path by greedy outputs equal to a no-offload
run; that proof holds only if wrong loaded bytes would have made them
differ. Here each load path the platform has serves a returning prompt
twice from one medium: once as it is (outputs equal the baseline, every
cached token from that medium), once with
:class:`~kvtier.testing.kv_corruption.LoadCorruptor` flipping bits in the
GPU blocks each finished load filled, through the KV cache's own tensors
(not in a path-specific copy): the outputs must differ.

Paths: on the CPU platform (CI) CPU-tier rows and disk slots through
kvtier's CPU copy, disk slots read in the read process and in the worker's
process, and the device staging reader (a staging area on the KV cache's
device, the CPU here); on CUDA (``make test-gpu``, collected again by
test_gpu_e2e.py) CPU-tier rows through vLLM's transfer handler, disk slots
through the host bounce area and vLLM's handler, and through the device
staging area (posix, and kvikio where it loads) and kvtier's
device-to-device scatter.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.testing.engine import engine, run_prompts, settle
from kvtier.testing.kv_corruption import LoadCorruptor
from kvtier.testing.state import evict_clean
from kvtier.tiers.plans import Residency

from .workload import (
    BLOCKS_PER_PROMPT,
    FIRST,
    GPU_BLOCKS,
    MAX_TOKENS,
    kvtier_config,
    manager_of,
)

pytestmark = pytest.mark.e2e

PROMPT = FIRST[0]  # the baseline fixture's first output is its greedy output

# id: (kvtier settings, medium the prompt comes back from, the worker's
# reader class, the disk back end's name)
CPU_PATHS = {
    "cpu-rows": ({}, "host", None, None),
    "disk-read-process": ({}, "disk", "ReadProcess", None),
    "disk-in-process": ({"disk_read_process": "off"}, "disk", "SlotReader", None),
    "disk-device": (
        {"disk_load_path": "device", "disk_io": "posix"},
        "disk",
        "SlotReader(device)",
        "posix",
    ),
}
CUDA_PATHS = {
    "cpu-rows": ({}, "host", None, None),
    "disk-host": ({}, "disk", "SlotReader", None),
    "disk-read-process": ({"disk_read_process": "on"}, "disk", "ReadProcess", None),
    "disk-device-posix": (
        {"disk_load_path": "device", "disk_io": "posix"},
        "disk",
        "SlotReader(device)",
        "posix",
    ),
    "disk-device-kvikio": (
        {"disk_load_path": "device", "disk_io": "kvikio"},
        "disk",
        "SlotReader(device)",
        "kvikio",
    ),
}
LOAD_PATHS = CUDA_PATHS if torch.cuda.is_available() else CPU_PATHS


def _worker(llm):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().connector_worker.worker


def _only_in(llm, medium: str) -> None:
    """Leave the prompt's blocks only in ``medium``: every spill finished,
    the CPU copies dropped for ``disk`` (their disk copies stay), the GPU
    prefix cache emptied."""
    mgr = manager_of(llm)
    settle(mgr)
    h = mgr.hierarchy
    keys = list(h.cpu.keys())
    assert len(keys) == BLOCKS_PER_PROMPT, len(keys)
    for key in keys:
        if medium == "disk":
            assert evict_clean(h, key), key.hex()
            assert h.lookup(key) is Residency.HIT_DISK, key.hex()
        else:
            assert h.lookup(key) is Residency.HIT_CPU, key.hex()
    assert llm.reset_prefix_cache()


@pytest.mark.parametrize("path", list(LOAD_PATHS))
def test_wrong_bytes_in_the_kv_cache_change_the_output(
    model, block_bytes, baseline, tmp_path, monkeypatch, path
):
    settings, medium, reader, backend = LOAD_PATHS[path]
    if backend == "kvikio":
        from kvtier.store.backends.kvikio_probe import usable_status

        usable, why = usable_status()
        if not usable:
            pytest.skip(f"kvikio unusable: {why}")
    corruptor = LoadCorruptor().install(monkeypatch)
    # Every block spilled at once: a CPU copy is always clean, droppable.
    cfg = kvtier_config(block_bytes, tmp_path, spill_watermark=0.0, **settings)
    with engine(model, cfg, num_gpu_blocks=GPU_BLOCKS) as llm:
        worker = _worker(llm)
        if reader is not None:
            kind = type(worker.reader).__name__
            if getattr(worker.reader, "staging", None) is not None:
                kind += "(device)"  # a staging area on the KV cache's device
            assert kind == reader
        if backend is not None:
            assert worker.reader.backend.name == backend
        want_copies = "DeviceCopies" if torch.cuda.is_available() else "HostCopies"
        assert type(worker.copies).__name__ == want_copies
        stats = manager_of(llm).hierarchy.stats

        first = run_prompts(llm, [PROMPT], MAX_TOKENS)
        _only_in(llm, medium)
        loads_before = stats.loads_cpu + stats.loads_disk
        clean = run_prompts(llm, [PROMPT], MAX_TOKENS)
        _only_in(llm, medium)
        corruptor.enabled = True
        wrong = run_prompts(llm, [PROMPT], MAX_TOKENS)
        corruptor.enabled = False
        loads = stats.loads_cpu + stats.loads_disk - loads_before
        failures = stats.load_failures

    want = baseline[0]
    assert first.outputs == [want]
    # Served from the medium in full, as it is: the outputs are equal.
    cached = {medium: BLOCKS_PER_PROMPT * 32}
    assert clean.hits_by_source == [cached], clean.hits_by_source
    assert clean.outputs == [want]
    # The same load, its bytes changed in the KV cache: they differ.
    assert wrong.hits_by_source == [cached], wrong.hits_by_source
    assert corruptor.jobs == 1 and corruptor.blocks == BLOCKS_PER_PROMPT, (
        corruptor.jobs,
        corruptor.blocks,
    )
    assert wrong.outputs != [want], wrong.outputs
    assert loads == 2 * BLOCKS_PER_PROMPT and failures == 0, (loads, failures)
