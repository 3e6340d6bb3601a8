"""kvtier's LoadStoreSpecs: where the worker finds or puts a block.

vLLM passes these objects from the scheduler-side manager to the workers
(pickled when they run in other processes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec, LoadStoreSpec

from kvtier.tiers.events import MEDIUM_DISK
from kvtier.tiers.plans import BlockLocation


class CpuTierSpec(BlockIDsLoadStoreSpec):
    """CPU-tier rows (the shared host buffer); ``block_ids`` are row numbers.
    Stores always go here."""


class TierLoadSpec(LoadStoreSpec):
    """One load's blocks, each from the CPU tier or from disk.

    Parallel per offloaded block, in the order vLLM listed the keys:
      - ``block_ids``: the CPU row or the disk slot;
      - ``on_disk``: whether ``block_ids[i]`` is a disk slot;
      - ``keys``: the block's key for disk blocks (the worker checks it
        against the slot header), ``b""`` for CPU rows;
      - ``promote_rows``: a CPU row the worker also copies a verified disk
        block into, or -1.
    """

    def __init__(
        self,
        keys: Sequence[bytes],
        locations: Sequence[BlockLocation],
    ):
        n = len(locations)
        self.block_ids = np.fromiter((loc.slot for loc in locations), np.int64, n)
        self.on_disk = np.fromiter(
            (loc.medium == MEDIUM_DISK for loc in locations), np.bool_, n
        )
        self.keys = [
            bytes(k) if loc.medium == MEDIUM_DISK else b""
            for k, loc in zip(keys, locations)
        ]
        self.promote_rows = np.fromiter(
            (-1 if loc.promote_slot is None else loc.promote_slot for loc in locations),
            np.int64,
            n,
        )

    def __repr__(self) -> str:
        disk = int(self.on_disk.sum())
        return f"TierLoadSpec({len(self.block_ids)} blocks, {disk} from disk)"
