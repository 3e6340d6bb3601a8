"""kvtier's LoadStoreSpecs: where the worker finds a block.

vLLM passes these opaque objects from the scheduler-side manager to the
worker; ``medium`` says which tier the block ids index.
"""

from __future__ import annotations

from typing import ClassVar

from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec


class TierLoadStoreSpec(BlockIDsLoadStoreSpec):
    """Rows of one kvtier tier; ``block_ids`` are slot numbers."""

    MEDIUM: ClassVar[str]

    @classmethod
    def medium(cls) -> str:
        return cls.MEDIUM


class CpuTierSpec(TierLoadStoreSpec):
    """CPU-tier rows (the shared host buffer). Disk blocks always reach the
    GPU through a verified promotion into these rows first."""

    MEDIUM = "cpu"


class DiskTierSpec(TierLoadStoreSpec):
    """Disk-tier slots (for tools and direct-read back ends)."""

    MEDIUM = "disk"
