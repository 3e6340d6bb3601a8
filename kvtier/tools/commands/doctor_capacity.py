"""``kvtier doctor --model``: how many blocks and tokens of that model each
tier holds, and whether a budget holds a block at all.

The engine turns ``cpu_bytes_to_use`` and ``disk_bytes_to_use`` into blocks
from the KV geometry vLLM builds
(:func:`kvtier.connector.config.blocks_in_budget`, docs/configuration.md
"Sizing: from bytes to blocks") and refuses to start with a budget that
holds none. The doctor runs the same conversion on the geometry vLLM
resolves from the model's config.json (:mod:`kvtier.connector.model_kv`),
with vllm serve's ``--dtype``, ``--kv-cache-dtype``,
``--tensor-parallel-size`` and ``--block-size`` as given to it
(:class:`ServeFlags`), and vLLM's own refusals that need the GPU block
size (``block_size`` a multiple of it) and the spec's (a
``disk_load_buffer_bytes`` that holds no disk slot). Where a refusal is
certain it is an error; where it is not, a warning:

- a model vLLM splits into several KV-cache groups (interleaved
  sliding-window layers): a block holds one group's layers, so the counts
  are a floor;
- a GPU block size the doctor assumed where vLLM's choice depends on the
  attention backend (multi-head latent attention off the CPU platform);
- vLLM's tiering mode with multi-head latent attention over several ranks
  (vLLM's replicated layout keeps one copy).

The tiering mode's CPU tier is vLLM's own: its rows are rounded up to a
page, so its counts are "about" (a budget below one rounded row is still
refused for sure).
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.store.slot import HEADER_SIZE, round_up, slot_size
from kvtier.tools.commands.common import fmt_bytes
from kvtier.tools.commands.doctor import ERROR, OK, WARNING, Check

if TYPE_CHECKING:
    from kvtier.connector.config import KvtierConfig
    from kvtier.connector.identity import ModelSource
    from kvtier.connector.model_kv import ModelKV

AREA = "capacity"
# vLLM's default --block-size (CacheConfig.DEFAULT_BLOCK_SIZE), and its CPU
# platform's (vllm/platforms/cpu.py: 128; 16 for its MLA kernel).
GPU_BLOCK_TOKENS = 16
CPU_PLATFORM_BLOCK_TOKENS = 128


@dataclass(frozen=True)
class ServeFlags:
    """vllm serve's flags that change a block's bytes, as the doctor got
    them; ``block_size`` None: not given (vLLM picks it)."""

    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    block_size: int | None = None


@dataclass(frozen=True)
class OffloadKeys:
    """The config's ``block_size`` (tokens per offloaded block) and
    ``blocks_per_chunk`` (GPU blocks per offloaded block); None: not set."""

    block_size: int | None = None
    blocks_per_chunk: int | None = None


def gpu_block_tokens(
    flags: ServeFlags, kv: ModelKV, cpu_platform: bool
) -> tuple[int, str, bool]:
    """Tokens per GPU block, where that figure comes from, and whether it
    is the engine's for sure."""
    if flags.block_size:
        return flags.block_size, "--block-size", True
    if cpu_platform:
        if kv.mla:
            return GPU_BLOCK_TOKENS, "vLLM's CPU MLA kernel's", True
        return CPU_PLATFORM_BLOCK_TOKENS, "vLLM's default on the CPU platform", True
    if kv.mla:
        return (
            GPU_BLOCK_TOKENS,
            "vLLM's default; its MLA backends choose their own",
            False,
        )
    return GPU_BLOCK_TOKENS, "vLLM's default", True


def check_capacity(
    cfg: KvtierConfig,
    keys: OffloadKeys,
    source: ModelSource,
    flags: ServeFlags,
    *,
    tiering: bool,
    cpu_platform: bool,
) -> list[Check]:
    """The KV bytes per token of ``source``'s model, then each tier's blocks
    and tokens; an error (a warning where the figure is not sure to be the
    engine's) for a budget that holds no block."""
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
        kv = model_kv(
            source.root, flags.dtype, flags.kv_cache_dtype, flags.tensor_parallel_size
        )
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
    gpu_tokens, whence, sure = gpu_block_tokens(flags, kv, cpu_platform)
    # Where a block is refused, or holds nothing: an error where that is
    # certain (one KV-cache group, a known GPU block size, and each rank's
    # copy counted as the engine counts it), else a warning.
    refused = ERROR if sure and not kv.several_groups else WARNING
    if tiering and kv.mla and kv.ranks > 1:
        refused = WARNING  # vLLM's replicated layout keeps one copy
    if keys.block_size and keys.block_size % gpu_tokens:
        return [
            Check(
                AREA,
                "block_size",
                refused,
                f"{keys.block_size} tokens per offloaded block is no multiple of "
                f"the GPU block ({gpu_tokens} tokens, {whence}): vllm serve would "
                + ("refuse to start" if refused == ERROR else "likely refuse to start"),
                f"set block_size to {round_up(keys.block_size, gpu_tokens)}, or "
                "blocks_per_chunk (GPU blocks per offloaded block)",
            )
        ]
    if keys.block_size:
        tokens, whence = keys.block_size, "the config's block_size"
        # The offloaded block's tokens are the config's, whatever the GPU's.
        if not kv.several_groups and not (tiering and kv.mla and kv.ranks > 1):
            refused = ERROR
    else:
        tokens = (keys.blocks_per_chunk or 1) * gpu_tokens
        if keys.blocks_per_chunk:
            whence = f"blocks_per_chunk x {gpu_tokens} ({whence})"
    row = kv.rank_bytes_per_token * tokens  # one rank's CPU row of a block
    notes = []
    if kv.several_groups:
        notes.append(
            "vLLM puts this model's layers in several KV-cache groups and "
            "offloads each group's as blocks of their own: each tier holds at "
            "least this"
        )
    if tiering:
        notes.append("the CPU tier is vLLM's: about")
    exact = refused == ERROR and not tiering  # counts are the engine's
    out = [
        Check(
            AREA,
            "KV per token",
            OK,
            f"{fmt_bytes(kv.bytes_per_token)} ({kv.how}; {source.root}/config.json), "
            f"{fmt_bytes(row * kv.ranks)} per block of {tokens} tokens ({whence})"
            + "".join(f"; {n}" for n in notes),
            "" if sure else "give --block-size as vllm serve gets it",
        )
    ]
    # (subject, key, budget, bytes of a block per rank, ranks, what it is)
    cpu_rank = row
    if tiering:  # vLLM's CPU tier: a chunk of every rank, rounded to a page
        cpu_rank = round_up(row * kv.ranks, mmap.PAGESIZE) // kv.ranks
    tiers = [("CPU tier capacity", "cpu_bytes_to_use", cfg.cpu_bytes_to_use, cpu_rank)]
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
        per_block = per_rank * kv.ranks
        what = (
            f"{per_block:,} B per block"
            if key == "cpu_bytes_to_use"
            else f"{per_block:,} B per block: a slot per rank, the block's share "
            f"and a {fmt_bytes(HEADER_SIZE)} header, rounded to 4 KiB"
        )
        try:
            blocks = blocks_in_budget(budget, per_rank, kv.ranks, key, "block")
        except ConfigError:
            out.append(
                Check(
                    AREA,
                    subject,
                    refused,
                    f"{key} {fmt_bytes(budget)} holds no block of {tokens} tokens "
                    f"({what}): vllm serve would "
                    + (
                        "refuse to start"
                        if refused == ERROR
                        else "likely refuse to start"
                    ),
                    f"raise {key} to at least {per_block} (bytes)",
                )
            )
            continue
        about = "" if exact else "about "
        out.append(
            Check(
                AREA,
                subject,
                OK,
                f"{fmt_bytes(budget)} holds {about}{blocks:,} block"
                f"{'s' if blocks > 1 else ''}, {blocks * tokens:,} tokens ({what})",
            )
        )
    # The full spec's worker reads disk slots through its load buffer: it
    # must hold one (the spec refuses it at start otherwise).
    if cfg.disk_enabled and not tiering and cfg.disk_load_buffer_bytes < slot_size(row):
        out.append(
            Check(
                AREA,
                "disk_load_buffer_bytes",
                refused,
                f"{fmt_bytes(cfg.disk_load_buffer_bytes)} holds no disk slot of "
                f"{slot_size(row):,} B: vllm serve would "
                + ("refuse to start" if refused == ERROR else "likely refuse to start"),
                f"raise disk_load_buffer_bytes to at least {slot_size(row)} (bytes)",
            )
        )
    return out
