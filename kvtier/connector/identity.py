"""What a block on disk belongs to (:func:`layout_fingerprints`): its layout,
the model's contents and every setting that changes KV values.

The disk tier outlives the engine, so a warm restart may serve a block only
to the model and settings that wrote it. Two parts enter the store's
``model_id`` (and so its directory name and every slot header):

- :func:`model_identity`, the model's contents: ``config.json`` and weight
  index files (``*.index.json``) by content; every weight file's name, size,
  ``mtime_ns`` and a **sampled digest** (:func:`sampled_digest`: the
  safetensors header plus 16 small reads spread over the file), so a
  same-size rewrite that kept the mtime (``cp -p``, ``rsync -a``,
  ``touch -r``) still changes the identity; the link target for Hugging Face
  cache snapshots (blob names are content hashes). A hub id that is not a
  local directory falls back to its Hugging Face cache snapshot (offline)
  at the engine's ``revision`` in its ``download_dir``
  (:class:`ModelSource`), else to the name alone.
- :func:`settings_identity`, vLLM's *resolved* configuration: the model
  config's hash factors as vLLM computes them (the effective HF config after
  ``hf_overrides``, dtype, quantization and its config, revision, ...) less
  the fields that cannot change a KV value (:data:`KV_NEUTRAL_MODEL_FIELDS`;
  plus what vLLM's model code decides from them: LongRoPE's factors, Llama
  4's temperature tuning, an Engram model's tokenizer), the exact
  KV-cache dtype and KV-scale settings, the load format and its loader's
  source (``dummy`` is random weights), the weights' source
  (:func:`weights_source`: a hub id's snapshot commit; weights a trainer
  pushes at runtime, whose stores are never adopted), speculative
  decoding's draft model (:func:`draft_identity`: its layers' KV is
  offloaded in the target's blocks), context parallelism's interleave and
  LoRA's target modules. docs/operations.md
  ("Store identity") lists every field in and why each field out is out.

A start looks a hub id up in the cache once (:meth:`ModelSource.of`): the
snapshot it finds is both the weights' source and the directory whose
contents are hashed.

:func:`model_identity` imports no vLLM (``kvtier doctor`` uses it);
:func:`settings_identity` imports vLLM lazily.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Any

from kvtier.log import get_logger
from kvtier.safe_open import open_regular
from kvtier.store.slot import LayoutFingerprint

logger = get_logger("connector")

CONFIG_FILES = ("config.json",)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5")
INDEX_SUFFIX = ".index.json"
# Small files hashed by content; anything bigger is described by stat and a
# sampled digest.
_MAX_HASHED_BYTES = 16 << 20
# Sampled digest of a weight file: this many reads of _SAMPLE_BYTES, evenly
# spread from the first byte to the last (~64 KiB per file, whatever its size).
_SAMPLES = 16
_SAMPLE_BYTES = 4096
# A safetensors header longer than this is sampled, not read whole.
_MAX_HEADER_BYTES = 16 << 20

# ModelConfig hash factors (vllm.config.utils.get_hash_factors) that cannot
# change a KV value: limits, sampling and output options, tokenizer and
# serving plumbing, memory management, paths whose effect is already in
# hf_config. Everything else vLLM hashes is in the identity; a field vLLM
# adds later is in by default (stricter, never wrong).
KV_NEUTRAL_MODEL_FIELDS = frozenset(
    {
        "max_model_len",  # how long a sequence may grow (LongRoPE, Llama 4: below)
        "spec_target_max_model_len",
        "max_logprobs",
        "logprobs_mode",
        "return_sampling_mask",
        "use_fp64_gumbel",
        "generation_config",  # sampling defaults (Llama 4: _model_code_effects)
        "override_generation_config",
        "logits_processors",
        "seed",  # sampling seed
        "served_model_name",
        "tokenizer",  # prompts arrive as token ids (Engram: _model_code_effects)
        "tokenizer_mode",
        "tokenizer_revision",
        "skip_tokenizer_init",
        "hf_token",
        "hf_config_path",  # its effect is hf_config, which is in
        "hf_overrides",  # idem
        "config_format",  # idem
        "enforce_eager",  # CUDA graphs replay the same kernels
        "enable_trace_replay",
        "enable_sleep_mode",
        "sleep_mode_backend",
        "sleep_mode_offload_cudagraph",
        "sleep_preserve_parameter_names",
        "enable_cumem_allocator",
        "enable_nccl_comm_suspend",
        "renderer_num_workers",
        "io_processor_plugin",
        "allowed_local_media_path",
        "allowed_media_domains",
    }
)
# CacheConfig fields that change what a KV value is.
KV_CACHE_FIELDS = (
    "cache_dtype",
    "calculate_kv_scales",
    "kv_cache_dtype_skip_layers",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
)
# LoadConfig fields that change the weights loaded: "dummy" is random
# weights, "tensorizer" and other loaders read the weights from where
# model_loader_extra_config says, ignore_patterns picks the files. The rest
# (download_dir, device, progress bars, safetensors read strategy) moves the
# same bytes.
KV_LOAD_FIELDS = ("load_format", "model_loader_extra_config", "ignore_patterns")
# AttentionConfig fields that change what a KV value is: the sparse-attention
# indexer's K cache (DeepSeek, MiniMax) is KV-cache bytes in its own dtype.
KV_ATTENTION_FIELDS = ("indexer_kv_dtype",)
# Speculative decoding methods that propose from the token history alone:
# no draft layers, so no draft KV. Every other method (draft_model, EAGLE,
# EAGLE-3, MTP, DFlash, ...) runs a draft model whose attention layers keep
# their KV in the target's blocks, offloaded with the target's.
DRAFTLESS_METHODS = frozenset({"ngram", "ngram_gpu", "suffix"})
# SpeculativeConfig fields that change the draft layers' KV values or bytes:
# how the draft is fed (method), its own KV-cache dtype (None: the
# target's, already in), its tensor-parallel size (its heads per rank).
KV_DRAFT_FIELDS = ("method", "kv_cache_dtype", "draft_tensor_parallel_size")
# LoRAConfig fields that change an adapter's KV: which modules get its
# weights (an adapter's blocks are keyed by its name and path only). Its
# version is the operator's to name (docs/operations.md, LoRA).
KV_LORA_FIELDS = (
    "target_modules",
    "enable_tower_connector_lora",
    "enable_moe_shared_loras",
    "lora_dtype",
)


def resolve_model_dir(
    model: str, revision: str | None = None, cache_dir: str | None = None
) -> str | None:
    """The local directory holding ``model``: the path itself, or the Hugging
    Face cache snapshot a hub id resolves to (offline) at ``revision``
    (default: main) in ``cache_dir`` (default: the hub's own cache). None if
    neither."""
    if os.path.isdir(model):
        return os.path.realpath(model)
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(
            model, "config.json", cache_dir=cache_dir, revision=revision
        )
    except Exception as exc:  # not a valid repo id, no hub library, ...
        logger.debug("no HF cache snapshot for %r: %r", model, exc)
        return None
    if isinstance(found, str) and os.path.isfile(found):
        return os.path.dirname(found)
    return None


@dataclass(frozen=True)
class ModelSource:
    """Where the engine reads model ``name``'s files, looked up once
    (:meth:`resolve`): ``root``, the directory itself or the Hugging Face
    cache snapshot a hub id resolves to at ``revision`` in ``download_dir``
    (vLLM's names; None: main, the hub's own cache), None if neither;
    ``snapshot``, that snapshot's commit for a hub id ("" for a local
    directory or none found)."""

    name: str
    root: str | None
    snapshot: str = ""

    @classmethod
    def resolve(
        cls, name: str, revision: str | None = None, download_dir: str | None = None
    ) -> ModelSource:
        if os.path.isdir(name):
            return cls(name, os.path.realpath(name))
        root = resolve_model_dir(name, revision=revision, cache_dir=download_dir)
        return cls(name, root, os.path.basename(root) if root else "")

    @classmethod
    def of(cls, vllm_config: Any) -> ModelSource:
        """The source of ``vllm_config``'s model under its own ``revision``
        and ``download_dir``."""
        model = vllm_config.model_config
        load = getattr(vllm_config, "load_config", None)
        return cls.resolve(
            model.model,
            revision=getattr(model, "revision", None),
            download_dir=getattr(load, "download_dir", None),
        )


def sampled_digest(path: str, size: int) -> str:
    """A 32-hex-digit digest of ``path``'s safetensors header (when it is
    one) and ``_SAMPLES`` reads of ``_SAMPLE_BYTES`` evenly spread over its
    ``size`` bytes. Cost: ~17 small reads per file, whatever its size.
    Raises OSError (EINVAL for anything but a regular file: a FIFO planted
    in a model directory never hangs engine start or ``kvtier doctor``)."""
    h = hashlib.blake2b(digest_size=16, person=b"kvtier-weights")
    fd, _ = open_regular(path, follow_links=True)  # hub cache: links to blobs
    try:
        if path.endswith(".safetensors") and size >= 8:
            (hlen,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            h.update(os.pread(fd, min(hlen, _MAX_HEADER_BYTES), 8))
        span = max(size - _SAMPLE_BYTES, 0)
        for i in range(_SAMPLES):
            h.update(os.pread(fd, _SAMPLE_BYTES, span * i // (_SAMPLES - 1)))
    finally:
        os.close(fd)
    return h.hexdigest()


def _describe_files(root: str) -> dict[str, Any]:
    files: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            hashed = name in CONFIG_FILES or name.endswith(INDEX_SUFFIX)
            if not hashed and not name.endswith(WEIGHT_SUFFIXES):
                continue
            try:
                st = os.stat(path)
            except OSError as exc:
                files[rel] = {"error": exc.errno}
                continue
            entry: dict[str, Any] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
            if os.path.islink(path):
                # HF cache: snapshots link to blobs named by their hash.
                entry["target"] = os.path.basename(os.readlink(path))
            if not hashed:
                try:
                    entry["sample"] = sampled_digest(path, st.st_size)
                except OSError as exc:
                    entry["error"] = exc.errno
            elif st.st_size <= _MAX_HASHED_BYTES:
                try:
                    with open(open_regular(path, follow_links=True)[0], "rb") as f:
                        entry["blake2b"] = hashlib.blake2b(
                            f.read(_MAX_HASHED_BYTES + 1), digest_size=16
                        ).hexdigest()
                except OSError as exc:
                    entry["error"] = exc.errno
            files[rel] = entry
    return files


def model_identity(
    model: str | ModelSource, dtype: str = "", kv_cache_dtype: str = ""
) -> str:
    """A 32-hex-digit identity of ``model``'s contents (plus the dtypes).

    ``model``: a :class:`ModelSource` (a hub id at the engine's revision in
    its cache), or a name, resolved here with the defaults.

    Changes when ``config.json`` or a weight index changes, or when a weight
    file is added, removed, resized, touched or rewritten (the sampled
    digest sees a rewrite that kept size and mtime). For a name that
    resolves to no local directory the identity covers the name only."""
    source = model if isinstance(model, ModelSource) else ModelSource.resolve(model)
    doc = {
        "name": source.name,
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype,
        "files": "unresolved" if source.root is None else _describe_files(source.root),
    }
    return _canonical_digest(doc, b"kvtier-model")


def _canonical_digest(doc: Any, person: bytes) -> str:
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(
        canonical.encode(), digest_size=16, person=person
    ).hexdigest()


def settings_identity(
    vllm_config: Any, source: ModelSource | None = None
) -> dict[str, Any]:
    """Every setting of ``vllm_config`` (a resolved ``VllmConfig``) that
    changes KV values, as a JSON-able dict: vLLM's own ModelConfig hash
    factors (``get_hash_factors``: the effective HF config after
    ``hf_overrides``, dtype, quantization and its config, revision, runner,
    model implementation, ...) less :data:`KV_NEUTRAL_MODEL_FIELDS` (plus
    what ``max_model_len`` decides for LongRoPE), the cache config's
    :data:`KV_CACHE_FIELDS` (the exact KV-cache dtype string, KV-scale
    settings), the load config's :data:`KV_LOAD_FIELDS` (dummy weights,
    another loader's source), the attention config's
    :data:`KV_ATTENTION_FIELDS`, :func:`weights_source` (of ``source``,
    the model's :class:`ModelSource`, looked up here when None) and, with
    a draft model, :func:`draft_identity`.
    Deterministic across processes and restarts."""
    cache = vllm_config.cache_config
    load = getattr(vllm_config, "load_config", None)
    attn = getattr(vllm_config, "attention_config", None)
    settings = {
        "model_factors": _model_factors(vllm_config.model_config),
        "kv_cache": {f: str(getattr(cache, f, None)) for f in KV_CACHE_FIELDS},
        "load": {f: str(getattr(load, f, None)) for f in KV_LOAD_FIELDS},
        "attention": {f: str(getattr(attn, f, None)) for f in KV_ATTENTION_FIELDS},
        "weights": weights_source(vllm_config, source),
    }
    draft = draft_identity(vllm_config)
    if draft is not None:  # absent otherwise: those stores keep their names
        settings["draft"] = draft
    # Each below only where it applies, so that other stores keep their names.
    context = _context_parallel(getattr(vllm_config, "parallel_config", None))
    if context is not None:
        settings["context_parallel"] = context
    lora = getattr(vllm_config, "lora_config", None)
    if lora is not None:
        settings["lora"] = {f: _lora_field(lora, f) for f in KV_LORA_FIELDS}
    return settings


def _lora_field(lora: Any, name: str) -> str:
    """A LoRAConfig field as the identity holds it (a module list sorted:
    vLLM matches modules against it as a set)."""
    value = getattr(lora, name, None)
    if isinstance(value, (list, tuple)):
        value = sorted(map(str, value))
    return str(value)


def _context_parallel(parallel: Any) -> dict[str, int] | None:
    """Under decode or prefill context parallelism, which tokens of a block
    each rank holds (vLLM's slot mapping, ``cp_kv_cache_interleave_size``:
    its sizes alone give the same geometry for another interleave); None
    without it."""
    if parallel is None:
        return None
    sizes = {
        "dcp": int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
        "pcp": int(getattr(parallel, "prefill_context_parallel_size", 1) or 1),
    }
    if sizes["dcp"] * sizes["pcp"] == 1:
        return None
    sizes["interleave"] = int(getattr(parallel, "cp_kv_cache_interleave_size", 1))
    return sizes


def _model_factors(model: Any) -> dict[str, str]:
    """What ``model`` (a ``ModelConfig``, the target's or a draft's) says
    produces KV values: vLLM's hash factors less
    :data:`KV_NEUTRAL_MODEL_FIELDS`, the HF config as configured
    (:func:`_as_configured`), what ``max_model_len`` decides for LongRoPE."""
    from vllm.config.utils import get_hash_factors, normalize_value

    factors = get_hash_factors(model, set(KV_NEUTRAL_MODEL_FIELDS))
    loaded = _as_configured(model)
    for name in ("hf_config", "hf_text_config"):
        if name in factors:
            factors[name] = normalize_value(getattr(loaded, name))
    factors.update(_max_model_len_effects(loaded))
    factors.update(_model_code_effects(model))
    return {k: str(v) for k, v in sorted(factors.items())}


def draft_identity(vllm_config: Any) -> dict[str, Any] | None:
    """What produces the KV values of speculative decoding's draft layers,
    or None when the engine runs no draft model (no speculative config, or
    a method in :data:`DRAFTLESS_METHODS`).

    vLLM gives a draft model's attention layers (``draft_model``, EAGLE,
    MTP, ...) KV-cache specs like the target's: their KV lives in the same
    blocks, under the same block hashes, and is offloaded with the
    target's. Another draft of the same shape leaves the geometry as it
    was, so the draft's own identity is in: the method and
    :data:`KV_DRAFT_FIELDS`, the draft model config's factors
    (:func:`_model_factors`), its contents (:func:`model_identity`, at its
    own ``revision``, in its load config's ``download_dir``) and snapshot,
    and its load config's :data:`KV_LOAD_FIELDS`."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if spec is None or draft is None or spec.method in DRAFTLESS_METHODS:
        return None
    load = getattr(spec, "draft_load_config", None) or getattr(
        vllm_config, "load_config", None
    )
    source = ModelSource.resolve(
        draft.model,
        revision=getattr(draft, "revision", None),
        download_dir=getattr(load, "download_dir", None),
    )
    return {
        **{f: str(getattr(spec, f, None)) for f in KV_DRAFT_FIELDS},
        "model_factors": _model_factors(draft),
        "contents": model_identity(source),
        "snapshot": source.snapshot,
        "load": {f: str(getattr(load, f, None)) for f in KV_LOAD_FIELDS},
    }


def _as_configured(model: Any) -> Any:
    """``model`` (a ``ModelConfig``) as vLLM configured it, before any model
    class ran: rebuilt from its own init fields, so its HF config is read and
    overridden (``hf_overrides``) again by vLLM's own code.

    Some model classes write into ``model_config.hf_config`` in their
    ``__init__`` (Llama 4's ``attn_temperature_tuning``, TeleChat2's
    ``hidden_act`` and biases, MiniMax-M2's ``max_model_len``, the
    Transformers back end's ``dtype``), and only in the process that builds
    the model. Under vLLM's multiprocess executor (TP > 1,
    ``distributed_executor_backend="mp"``) the scheduler's config never sees
    those writes while every worker's does: hashed as they stand, the two
    sides would name different stores, and the scheduler would spill where
    no worker reads. The rebuilt config is the same on both sides. If it
    cannot be rebuilt, ``model`` as it stands (warned)."""
    import dataclasses
    import logging

    kw = {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.init}
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.WARNING)  # its start-up lines, said once already
    try:
        return type(model)(**kw)
    except Exception as exc:
        logger.warning(
            "kvtier: could not rebuild the model config (%r): the store "
            "identity hashes the HF config as it stands, which model code may "
            "have changed in this process only",
            exc,
        )
        return model
    finally:
        vllm_logger.setLevel(level)


def weights_source(
    vllm_config: Any, source: ModelSource | None = None
) -> dict[str, str]:
    """Where the weights come from, beyond what :func:`model_identity` sees
    of the model's name:

    - ``snapshot``: for a hub id, the Hugging Face cache snapshot (a commit
      hash) it resolves to under the engine's own ``revision`` and
      ``download_dir``, so a branch that moved to new weights is another
      store ("" for a local directory or no snapshot found);
    - ``runtime_updates``: vLLM's ``weight_transfer_config`` backend, or
      "none". With it a trainer pushes new weights into the running engine,
      so no block on disk can name the weights that made it: such a store
      is never adopted at start (:func:`weights_change_at_runtime`).

    ``source``: the model's :class:`ModelSource` (:meth:`ModelSource.of`
    ``vllm_config``), looked up here when None."""
    if source is None:
        source = ModelSource.of(vllm_config)
    snapshot = source.snapshot
    transfer = getattr(vllm_config, "weight_transfer_config", None)
    return {
        "snapshot": snapshot,
        "runtime_updates": str(transfer.backend) if transfer is not None else "none",
    }


def weights_change_at_runtime(settings: dict[str, Any] | None) -> bool:
    """Whether :func:`settings_identity`'s ``settings`` say the engine's
    weights change while it runs (vLLM's ``weight_transfer_config``): its
    disk blocks are then never adopted by a later engine."""
    weights = (settings or {}).get("weights", {})
    return weights.get("runtime_updates", "none") != "none"


def _max_model_len_effects(model: Any) -> dict[str, Any]:
    """What ``max_model_len`` (KV-neutral otherwise) decides about KV values:
    vLLM's LongRoPE (``Phi3LongRoPEScaledRotaryEmbedding``) rotates every
    key with its long factors when ``max_model_len`` exceeds
    ``original_max_position_embeddings``, with its short ones otherwise."""
    text = getattr(model, "hf_text_config", None)
    rope = getattr(text, "rope_parameters", None) or {}
    if not isinstance(rope, dict):
        return {}
    # One dict, or one per layer type (transformers' nested form).
    params = [rope] if "rope_type" in rope else list(rope.values())
    for p in params:
        if isinstance(p, dict) and p.get("rope_type") in ("longrope", "su"):
            original = p.get(
                "original_max_position_embeddings",
                getattr(text, "original_max_position_embeddings", None),
            )
            if original is None:  # vLLM would fail; never share a store
                return {"longrope_long_factors": "unknown"}
            return {"longrope_long_factors": model.max_model_len > original}
    return {}


# Llama 4's model types: its model class turns on attention temperature
# tuning (NoPE layers' queries scaled past position 8191) from settings
# the identity otherwise leaves out.
_LLAMA4_TYPES = frozenset({"llama4", "llama4_text"})


def _model_code_effects(model: Any) -> dict[str, Any]:
    """What vLLM's model code decides about KV values from fields that are
    KV-neutral elsewhere, where it does:

    - Llama 4 (``Llama4ForCausalLM.__init__``): attention temperature tuning
      is ``generation_config``'s ``attn_temperature_tuning`` (the model
      directory's generation_config.json, after
      ``override_generation_config``), else ``max_model_len > 32768``;
    - models with n-gram embedding (Engram) layers build their token map
      from the tokenizer's strings, so the tokenizer feeds the hidden
      states."""
    effects: dict[str, Any] = {}
    text = getattr(model, "hf_text_config", None)
    if (
        getattr(text, "model_type", None) in _LLAMA4_TYPES
        or getattr(getattr(model, "hf_config", None), "model_type", None)
        in _LLAMA4_TYPES
    ):
        generation = dict(model.try_get_generation_config() or {})
        generation.update(getattr(model, "override_generation_config", None) or {})
        effects["llama4_attn_temperature_tuning"] = bool(
            generation.get("attn_temperature_tuning", model.max_model_len > 32768)
        )
    try:
        from vllm.config.engram import model_has_engram_layers
    except ImportError:  # a vLLM without Engram models
        return effects
    if model_has_engram_layers(model):
        effects["engram_tokenizer"] = (
            f"{getattr(model, 'tokenizer', None)}@"
            f"{getattr(model, 'tokenizer_revision', None)}"
        )
    return effects


def settings_digest(settings: dict[str, Any]) -> str:
    """32 hex digits naming :func:`settings_identity`'s result."""
    return _canonical_digest(settings, b"kvtier-settings")


def describe_settings(settings: dict[str, Any]) -> dict[str, str]:
    """The fields an operator reads first (log line, layout.json)."""
    factors = settings.get("model_factors", {})
    out = {k: factors[k] for k in ("dtype", "quantization", "revision") if k in factors}
    out["kv_cache_dtype"] = settings.get("kv_cache", {}).get("cache_dtype", "")
    if "hf_config" in factors:
        out["hf_config"] = _canonical_digest(factors["hf_config"], b"kvtier-hfconf")[
            :16
        ]
    out["settings"] = settings_digest(settings)[:16]
    return out


def describe_group(group: Any) -> str:
    """One KV-cache group in a store's geometry: ``id:tokens_per_block x
    layers @ digest of the layer names``. The names, not only their count:
    a block of group ``id`` holds those layers' KV, so an engine that
    put other layers in that group (a vLLM that groups layers otherwise,
    another split of the layers) must not read it back."""
    names = _canonical_digest(list(group.layer_names), b"kvtier-layers")[:16]
    return f"{group.group_id}:{group.tokens_per_block}x{len(group.layer_names)}@{names}"


def layout_fingerprints(
    config: Any,
    block_bytes: int,
    world_size: int,
    host_layout: str | None = None,
    settings: dict[str, Any] | None = None,
    source: ModelSource | None = None,
) -> list[LayoutFingerprint]:
    """The disk layout identity of each rank's blocks (one per rank of
    ``world_size``; the model's contents are hashed once), from vLLM's
    ``OffloadingConfig`` (duck-typed): what must match for a disk block to be
    reusable. Used by the full spec and the tiering-mode disk tier;
    ``host_layout`` names a CPU-row layout other than the full spec's, so the
    two never share slab directories.

    Beyond the geometry: ``model_id`` covers the model's contents (with its
    KV-cache dtype) and, under kvtier's connector, the resolved
    configuration's :func:`settings_identity` (``settings``); ``dp_rank``
    keeps DP replicas sharing one config (and one disk_path) in separate
    store directories; ``identity`` describes both parts for layout.json
    (``contents`` is the model contents' own digest, which ``kvtier doctor``
    recomputes from ``--model``, ``--revision`` and ``--download-dir``).
    ``source``: the model's :class:`ModelSource` as the engine resolved it
    (its ``revision`` and ``download_dir``); None: ``config.model.name``
    resolved with the defaults (a hub id at main in the hub's own cache)."""
    groups = ",".join(map(describe_group, config.groups))
    geometry = (
        f"groups={groups};blocks_per_chunk={config.cache.blocks_per_chunk};"
        f"tokens_per_hash={config.cache.tokens_per_hash};"
        f"layout={config.kv_cache_layout};"
        f"canonical={config.canonical_layout}"
    )
    if host_layout is not None:
        geometry += f";host_layout={host_layout}"
    par = config.parallel
    dp_rank = getattr(par, "data_parallel_index", None)
    if dp_rank is None:
        dp_rank = getattr(par, "data_parallel_rank", 0) or 0
    if source is not None and source.name != config.model.name:
        raise ValueError(
            f"model source {source.name!r} is not the model {config.model.name!r}"
        )
    contents = model_identity(
        source if source is not None else config.model.name,
        kv_cache_dtype=str(config.model.dtype),
    )
    described = {"contents": contents}
    model_id = contents
    if settings is not None:
        described.update(describe_settings(settings))
        model_id = _canonical_digest(
            {"model": contents, "settings": settings_digest(settings)},
            b"kvtier-model",
        )
    return [
        LayoutFingerprint(
            model=config.model.name,
            dtype=str(config.model.dtype),
            block_bytes=block_bytes,
            geometry=geometry,
            tp_rank=rank,
            tp_size=world_size,
            model_id=model_id,
            dp_rank=int(dp_rank),
            identity=tuple(sorted(described.items())),
        )
        for rank in range(world_size)
    ]


# Said at start when LoRA serves from a disk tier: vLLM keys an adapter's
# blocks by its name and path (its block-hash extra keys), not its contents.
LORA_ON_DISK = (
    "LoRA with a disk tier: vLLM names an adapter's blocks by the adapter's "
    "name and path, not its contents, so an adapter rewritten in place would "
    "be served the old adapter's KV from disk after a restart; give each "
    "adapter version its own path"
)

# The fix, named wherever a non-reproducible prefix hash is reported.
HASH_FIX = (
    "export PYTHONHASHSEED=<a fixed value> before vllm serve, or "
    "--prefix-caching-hash-algo sha256"
)


def prefix_hash_problem(algo: str, seed: str | None) -> str | None:
    """Why vLLM's prefix block hashes (kvtier's keys) would differ after a
    restart under ``--prefix-caching-hash-algo algo`` and PYTHONHASHSEED
    ``seed`` (None: unset), or None when they are reproducible. vLLM seeds
    its non-cryptographic hashes (xxhash*) randomly per process unless
    PYTHONHASHSEED is set, so no block on disk would ever match. Set to any
    value, even empty or ``random`` (Python's own words for a random seed),
    the value itself is vLLM's seed (``resolve_none_hash_seed``)."""
    if algo.startswith("xxhash") and seed is None:
        return (
            "non-cryptographic hashing without PYTHONHASHSEED: vLLM seeds it "
            "randomly per process, so nothing on disk matches after a restart"
        )
    return None
