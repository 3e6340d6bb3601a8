"""``kvtier doctor --model``: how many blocks and tokens of that model each
tier holds, and whether a budget holds a block at all.

The engine turns ``cpu_bytes_to_use`` and ``disk_bytes_to_use`` into blocks
from the KV geometry vLLM builds
(:func:`kvtier.connector.config.blocks_in_budget`, docs/configuration.md
"Sizing: from bytes to blocks") and refuses to start with a budget that
holds none. The doctor runs the same conversion on the geometry vLLM
resolves from the model's config.json (:mod:`kvtier.connector.model_kv`),
with vllm serve's ``--dtype``, ``--kv-cache-dtype``,
``--tensor-parallel-size`` and ``--block-size`` as given to it: the engine's
counts for a model in one KV-cache group, and its refusal. For a model vLLM
splits into several groups (interleaved sliding-window layers) a block
holds one group's layers, so the counts are a floor and a budget found to
hold no block is a warning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.store.slot import HEADER_SIZE, slot_size
from kvtier.tools.commands.common import fmt_bytes
from kvtier.tools.commands.doctor import ERROR, OK, WARNING, Check

if TYPE_CHECKING:
    from kvtier.connector.config import KvtierConfig
    from kvtier.connector.identity import ModelSource

AREA = "capacity"


def tokens_per_block(cfg: KvtierConfig, gpu_block_tokens: int) -> int:
    """Tokens in one offloaded block, as vLLM's offloading config reads the
    keys: ``block_size`` (tokens per offloaded block), else
    ``blocks_per_chunk`` GPU blocks, else one GPU block."""
    if cfg.block_size:
        return int(cfg.block_size)
    return int(cfg.blocks_per_chunk or 1) * gpu_block_tokens


def check_capacity(
    cfg: KvtierConfig,
    source: ModelSource,
    dtype: str,
    kv_cache_dtype: str,
    tensor_parallel_size: int,
    gpu_block_tokens: int,
) -> list[Check]:
    """The KV bytes per token of ``source``'s model, then each tier's blocks
    and tokens; an error (a warning, for several KV-cache groups) for a
    budget that holds no block."""
    from kvtier.connector.config import ConfigError, blocks_in_budget
    from kvtier.connector.model_kv import GeometryError, model_kv

    if source.root is None:
        return [
            Check(
                AREA,
                source.name,
                OK,
                "not estimated: no local config.json (not a directory, nor in "
                "the Hugging Face cache)",
            )
        ]
    try:
        kv = model_kv(source.root, dtype, kv_cache_dtype, tensor_parallel_size)
    except GeometryError as exc:
        return [
            Check(
                AREA,
                source.name,
                WARNING,
                f"not estimated: {exc}",
                'size the tiers by hand: docs/configuration.md, "Sizing: from '
                'bytes to blocks"',
            )
        ]
    tokens = tokens_per_block(cfg, gpu_block_tokens)
    row = kv.layers * kv.values_per_layer * kv.dtype_bytes * tokens  # one rank's
    groups = (
        "; vLLM puts this model's layers in several KV-cache groups and offloads "
        "each group's as blocks of their own, so each tier holds at least this"
        if kv.several_groups
        else ""
    )
    out = [
        Check(
            AREA,
            "KV per token",
            OK,
            f"{fmt_bytes(kv.bytes_per_token)} ({kv.how}; {source.root}/config.json), "
            f"{fmt_bytes(row * kv.ranks)} per block of {tokens} tokens{groups}",
        )
    ]
    tiers = [("CPU tier capacity", "cpu_bytes_to_use", cfg.cpu_bytes_to_use, row)]
    if cfg.disk_enabled:
        tiers.append(
            (
                "disk tier capacity",
                "disk_bytes_to_use",
                cfg.disk_bytes_to_use,
                slot_size(row),
            )
        )
    for subject, key, budget, per_rank in tiers:
        what = (
            f"{per_rank * kv.ranks:,} B per block"
            if per_rank == row
            else f"{per_rank * kv.ranks:,} B per block: a slot per rank, the "
            f"block's share and a {fmt_bytes(HEADER_SIZE)} header, rounded to 4 KiB"
        )
        try:
            blocks = blocks_in_budget(budget, per_rank, kv.ranks, key, "block")
        except ConfigError:
            out.append(
                Check(
                    AREA,
                    subject,
                    WARNING if kv.several_groups else ERROR,
                    f"{key} {fmt_bytes(budget)} holds no block of {tokens} tokens "
                    f"({what}): "
                    + (
                        "it may hold none of a group's either"
                        if kv.several_groups
                        else "vllm serve would refuse to start"
                    ),
                    f"raise {key} to at least {per_rank * kv.ranks} (bytes)",
                )
            )
            continue
        out.append(
            Check(
                AREA,
                subject,
                OK,
                f"{fmt_bytes(budget)} holds {blocks:,} block"
                f"{'s' if blocks > 1 else ''}, {blocks * tokens:,} tokens ({what})",
            )
        )
    return out
