"""A worker job's GPU blocks, mapped onto the offloaded blocks they copy.

vLLM hands a worker each job as a GPU spec (block ids, group by group) and
a host spec (one offloaded block per ``blocks_per_chunk`` GPU blocks of a
group). :func:`split_by_group` pairs them up per KV-cache group; the
worker then picks each plan's rows (CPU rows, bounce rows) by medium, for a
load through :func:`split_load`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec

from kvtier.connector.load_store_specs import TierLoadSpec
from kvtier.host.block_copy import CopyPlan, plan_copy


@dataclass
class GroupPlan:
    """One KV-cache group's part of a job: GPU blocks and, per block, the
    position of its offloaded block in the job's spec."""

    group: int
    plan: CopyPlan  # row_ids are spec positions


def split_by_group(
    gpu: GPULoadStoreSpec, num_rows: int, blocks_per_chunk: int
) -> list[GroupPlan]:
    """Map every GPU block of a job onto its offloaded block's position.

    vLLM lists a job's GPU blocks group by group (``group_sizes``), each
    group's blocks logically consecutive from ``block_indices[g]``, and the
    offloaded blocks (rows) in the same group order."""
    gpu_ids = gpu.block_ids
    group_sizes = list(gpu.group_sizes) if gpu.group_sizes else [len(gpu_ids)]
    block_indices = list(gpu.block_indices) if gpu.block_indices else [0]
    plans: list[GroupPlan] = []
    g_start = r_start = 0
    for group, (size, first) in enumerate(zip(group_sizes, block_indices)):
        if size == 0:
            continue
        n_rows = (first + size - 1) // blocks_per_chunk - first // blocks_per_chunk + 1
        positions = np.arange(r_start, r_start + n_rows, dtype=np.int64)
        span = gpu_ids[g_start : g_start + size]
        plan = plan_copy(span, positions, blocks_per_chunk, first)
        plans.append(GroupPlan(group, plan))
        g_start += size
        r_start += n_rows
    if r_start != num_rows:
        raise ValueError(f"job lists {num_rows} offloaded blocks, GPU spec {r_start}")
    return plans


def select_rows(plan: CopyPlan, mask: np.ndarray, rows: np.ndarray) -> CopyPlan:
    """The blocks of ``plan`` under ``mask``, copied to or from ``rows``."""
    return CopyPlan(plan.gpu_ids[mask], rows, plan.sub_ids[mask])


@dataclass
class LoadSplit:
    """A load job split by medium: its per-group plans, and its blocks.
    ``cpu`` holds, per KV-cache group, the copies from CPU rows (row ids are
    CPU rows); ``spec`` is the load spec when some blocks are on disk
    (``on_disk`` marks them)."""

    groups: list[GroupPlan]
    cpu: list[tuple[int, CopyPlan]]
    on_disk: np.ndarray
    spec: TierLoadSpec | None


def split_load(
    src: LoadStoreSpec, dst: GPULoadStoreSpec, blocks_per_chunk: int
) -> LoadSplit:
    """Split a load into CPU-row copies and disk blocks. A plain row spec
    (vLLM's ``CPULoadStoreSpec``) loads every block from the CPU tier."""
    if isinstance(src, TierLoadSpec):
        slots, on_disk, spec = src.block_ids, src.on_disk, src
    else:
        slots = np.asarray(src.block_ids, dtype=np.int64)  # type: ignore[attr-defined]
        on_disk, spec = np.zeros(len(slots), dtype=np.bool_), None
    groups = split_by_group(dst, len(slots), blocks_per_chunk)
    cpu = []
    for gp in groups:
        mask = ~on_disk[gp.plan.row_ids]
        if mask.any():
            cpu.append((gp.group, select_rows(gp.plan, mask, slots[gp.plan.row_ids[mask]])))
    return LoadSplit(groups, cpu, on_disk, spec if on_disk.any() else None)
