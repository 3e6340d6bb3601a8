"""kvtier's copy plans as vLLM's transfer handler takes them.

vLLM's ``SingleDirectionOffloadingHandler`` receives, per group, the GPU
blocks, one host row per chunk and the sub-blocks skipped in the first
chunk; it enumerates sub-blocks contiguously from there. These tests pin
the translation (every plan the worker builds, including the subsets of a
load split between the CPU tier and disk) and that a plan vLLM would
misread is refused instead of copied wrong. The copies themselves run on
CUDA in tests/gpu."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from kvtier.connector.worker.device_copy import vllm_block_spec  # noqa: E402
from kvtier.host.block_copy import CopyPlan, plan_copy  # noqa: E402


def _expand(gpu, rows, skip, bpc):
    """What vLLM's handler reads from (gpu, rows, skip): per GPU block, the
    (row, sub-block) it copies, as vLLM's compute_sub_block_ptrs walks it."""
    flat = [(int(r), s) for r in rows for s in range(bpc)][skip : skip + len(gpu)]
    return list(zip(map(int, gpu), flat))


@pytest.mark.parametrize("bpc", [1, 2, 4])
@pytest.mark.parametrize("first", [0, 1, 3, 5])
@pytest.mark.parametrize("count", [1, 2, 7, 12])
def test_a_request_plan_maps_onto_the_same_rows_and_sub_blocks(bpc, first, count):
    n_rows = (first + count - 1) // bpc - first // bpc + 1
    rows = np.arange(100, 100 + n_rows) * 3  # any distinct rows
    gpu = np.arange(count) + 40
    plan = plan_copy(gpu, rows, bpc, first)
    got_gpu, got_rows, skip = vllm_block_spec(plan, bpc)
    assert len(got_rows) == n_rows and skip == first % bpc
    want = [(int(g), (int(r), int(s))) for g, r, s in zip(*vars(plan).values())]
    assert _expand(got_gpu, got_rows, skip, bpc) == want


@pytest.mark.parametrize("bpc", [1, 2, 3])
def test_subsets_of_whole_chunks_map_too(bpc):
    # A load whose chunks alternate between the CPU tier and disk: each
    # medium's subset is whole chunks (plus the partial first/last).
    first, count = 1, 5 * bpc
    n_rows = (first + count - 1) // bpc - first // bpc + 1
    plan = plan_copy(np.arange(count) + 10, np.arange(n_rows), bpc, first)
    for medium in (0, 1):
        mask = (plan.row_ids % 2) == medium
        sub = CopyPlan(plan.gpu_ids[mask], plan.row_ids[mask] + 50, plan.sub_ids[mask])
        if not len(sub):
            continue
        gpu, rows, skip = vllm_block_spec(sub, bpc)
        want = [(int(g), (int(r), int(s))) for g, r, s in zip(*vars(sub).values())]
        assert _expand(gpu, rows, skip, bpc) == want


def test_plans_vllm_would_misread_are_refused():
    # A hole inside a chunk (sub-block 1 missing) would shift every later
    # block by one page in vLLM's enumeration.
    holed = CopyPlan(np.array([1, 2, 3]), np.array([7, 7, 8]), np.array([0, 2, 0]))
    with pytest.raises(ValueError, match="not contiguous"):
        vllm_block_spec(holed, 4)
    # Two rows inside one chunk.
    split = CopyPlan(np.array([1, 2]), np.array([7, 9]), np.array([0, 1]))
    with pytest.raises(ValueError, match="not contiguous"):
        vllm_block_spec(split, 2)
