"""How many KV bytes one token of a model takes, as vLLM resolves the
model's ``config.json`` (its ``ModelConfig``: the model class's defaults for
fields the file leaves out, multi-head latent attention, the dtype this
platform serves it in), without weights or an engine: what ``kvtier doctor
--model`` and ``kvtier size --model`` turn byte budgets into blocks and
tokens with.

The figure counts every attention layer and every tensor-parallel rank, as
kvtier's budgets do (``cpu_bytes_to_use`` and ``disk_bytes_to_use`` are
totals over the ranks): one rank's KV of a token is ``layers x KV heads per
rank x head size x 2 (K, V) x dtype bytes`` (multi-head latent attention:
one latent of ``head size`` values, no K/V pair), and ranks that replicate
heads (fewer KV heads than ranks, or a latent) each keep their copy.

What it does not describe raises :class:`GeometryError` naming the
missing piece: state-space (hybrid) and attention-free models, layers of
different shapes, sparse attention's indexer cache, KV-cache dtypes packed
other than one element per value, a config vLLM cannot read (for example
one that needs ``trust_remote_code``). An estimate is exact or not given. Importing this module does not import vLLM (the CLI reads its
choices); :func:`model_kv` does.
"""

from __future__ import annotations

from dataclasses import dataclass

# vllm serve's --dtype values, and the --kv-cache-dtype values stored one
# element per value (vLLM's CacheDType less its packed layouts).
MODEL_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")

# Models whose layers vLLM splits into several KV-cache groups (full and
# sliding-window attention interleaved): each group's block is offloaded
# under its own key and holds that group's layers only.
_INTERLEAVED_MODEL_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text", "cohere2"})
_INTERLEAVED_KEYS = ("sliding_window_pattern", "interleaved_sliding_window")
# Sparse attention (DeepSeek-V3.2 and later) caches an index beside the KV.
_SPARSE_ATTENTION_KEYS = ("index_topk", "compress_ratios")


class GeometryError(ValueError):
    """vLLM's view of a model does not give its KV bytes per token."""


@dataclass(frozen=True)
class ModelKV:
    """One token's KV over ``ranks`` tensor-parallel ranks: ``layers``
    attention layers of ``values_per_layer`` values per rank, ``dtype_bytes``
    bytes a value. ``how`` says how, for a report line; ``several_groups``:
    vLLM puts the layers in several KV-cache groups, so one offloaded block
    holds a group's layers only; ``mla``: multi-head latent attention (its
    backends choose their own GPU block size)."""

    layers: int
    values_per_layer: int
    ranks: int
    dtype: str
    dtype_bytes: int
    how: str
    several_groups: bool = False
    mla: bool = False

    @property
    def rank_bytes_per_token(self) -> int:
        """One rank's share (its CPU row and disk slot hold this per token)."""
        return self.layers * self.values_per_layer * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.rank_bytes_per_token * self.ranks


def model_kv(
    model_dir: str,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    tensor_parallel_size: int = 1,
) -> ModelKV:
    """One token's KV for the model in ``model_dir`` (a directory holding its
    config.json: a local model or a Hugging Face cache snapshot; read
    offline), served with vllm serve's ``--dtype``, ``--kv-cache-dtype``
    and ``--tensor-parallel-size``. Raises :class:`GeometryError`. Takes
    seconds (vLLM's import and config resolution). Needs no GPU: the ranks
    are counted, not built (vLLM's ParallelConfig would check them against
    this host's GPUs)."""
    try:
        from vllm.config import ModelConfig, ParallelConfig
        from vllm.utils.torch_utils import (
            STR_DTYPE_TO_TORCH_DTYPE,
            resolve_kv_cache_dtype_string,
        )

        model = ModelConfig(model=model_dir, dtype=dtype, skip_tokenizer_init=True)
        # As vllm serve resolves "auto": a checkpoint's quantization config
        # may ask for an fp8 cache.
        cache_name = resolve_kv_cache_dtype_string(kv_cache_dtype, model)
    except Exception as exc:  # vLLM's own words: a missing field, bad JSON...
        raise GeometryError(f"vLLM cannot read {model_dir}'s config: {exc}") from exc
    if model.is_attention_free or model.is_hybrid:
        raise GeometryError(
            f"{model.architecture}: state-space or attention-free layers, whose "
            "state is not per token: not estimated"
        )
    text = model.hf_text_config
    if getattr(model.model_arch_config, "per_layer_overrides", None):
        raise GeometryError(
            f"{model.architecture}: layers of different shapes: not estimated"
        )
    if any(getattr(text, key, None) for key in _SPARSE_ATTENTION_KEYS):
        raise GeometryError(
            f"{model.architecture}: sparse attention keeps an indexer cache "
            "beside the KV cache: not estimated"
        )
    if cache_name not in KV_CACHE_DTYPES:
        raise GeometryError(
            f"kv_cache_dtype {cache_name!r}: not estimated (one of "
            f"{', '.join(KV_CACHE_DTYPES)}; others pack values otherwise)"
        )
    cache = (
        model.dtype if cache_name == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache_name]
    )
    name = (
        cache_name
        if cache_name.startswith("fp8")
        else str(cache).removeprefix("torch.")
    )
    size = cache.itemsize
    # Attention layers only (no-op layers hold no KV); one pipeline stage.
    layers = model.get_num_layers_by_block_type(ParallelConfig(), "attention")
    head = model.get_head_size()
    ranks = tensor_parallel_size
    if model.use_mla:
        values, shape = head, f"one {head}-value latent"
    else:
        # vLLM's rule (ModelConfig.get_num_kv_heads): the heads split over
        # the ranks, at least one each (replicated).
        heads = max(1, model.get_total_num_kv_heads() // ranks)
        values, shape = 2 * heads * head, f"{heads} KV heads x {head} x 2 (K, V)"
    kinds = getattr(text, "layer_types", None)
    several = (
        (isinstance(kinds, list) and len({str(k) for k in kinds}) > 1)
        or getattr(text, "model_type", None) in _INTERLEAVED_MODEL_TYPES
        or any(getattr(text, key, None) for key in _INTERLEAVED_KEYS)
    )
    per_rank = "" if ranks == 1 else f" per rank x {ranks} ranks"
    return ModelKV(
        layers,
        values,
        ranks,
        name,
        size,
        f"{layers} layers x {shape} x {size} B ({name}){per_rank}",
        several,
        bool(model.use_mla),
    )
