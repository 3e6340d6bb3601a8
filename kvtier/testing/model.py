"""Tiny random models built locally (no download) and prompts for them."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


DEFAULT_CACHE_DIR = Path(
    os.environ.get("KVTIER_E2E_CACHE", str(REPO_ROOT / ".work" / "e2e-models"))
)

_BUILDER_VERSION = 1

TINY_LLAMA_CONFIG: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    # Larger than HF's 0.02 so greedy top-1/top-2 logit margins are ~0.2
    # (vs ~0.05): greedy outputs are robust to tiny kernel-order differences
    # between a recomputed and a loaded KV prefix.
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    seed=0,
)

# Special ids of the saved tokenizer / config. Prompts should use ids >= 4.
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
FIRST_REGULAR_ID = 4


# meta-llama/Llama-3.1-8B's config.json (the geometry of the
# real-size benchmark and of the sizing tests; weights are random).
LLAMA_31_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}


def _config_hash(cfg: dict[str, Any]) -> str:
    blob = json.dumps({"v": _BUILDER_VERSION, **cfg}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _build_cached(
    name: str,
    cfg: dict[str, Any],
    out_dir: str | os.PathLike | None,
    write: Callable[[Path], None],
) -> str:
    """``<out_dir or DEFAULT_CACHE_DIR>/<name>-<config hash>``, built once.

    ``write(tmp)`` saves the model and tokenizer into a fresh temporary
    directory, which then replaces the target atomically (a concurrent
    builder's identical result wins the race harmlessly)."""
    root = Path(out_dir) if out_dir is not None else DEFAULT_CACHE_DIR
    target = root / f"{name}-{_config_hash(cfg)}"
    if (target / ".complete").exists():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=root))
    try:
        write(tmp)
        (tmp / "kvtier_tiny_config.json").write_text(json.dumps(cfg, indent=1))
        (tmp / ".complete").write_text("ok\n")
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / ".complete").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def build_tiny_llama(out_dir: str | os.PathLike | None = None, **overrides: Any) -> str:
    """Build (or reuse) a tiny random LlamaForCausalLM + WordLevel tokenizer.

    The model lands in ``<out_dir or DEFAULT_CACHE_DIR>/tiny-llama-<hash>``
    where the hash covers the config, so repeated calls are instant. Returns
    the model directory (loadable by vLLM and transformers, fully offline).
    """
    cfg = {**TINY_LLAMA_CONFIG, **overrides}

    def write(tmp: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg_kw = dict(cfg)
        seed = cfg_kw.pop("seed")
        rope_theta = cfg_kw.pop("rope_theta")
        hf_cfg = LlamaConfig(
            **cfg_kw,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            tie_word_embeddings=False,
        )
        torch.manual_seed(seed)
        LlamaForCausalLM(hf_cfg).to(torch.float32).save_pretrained(
            tmp, safe_serialization=True
        )
        _save_word_tokenizer(tmp, cfg["vocab_size"])

    return _build_cached("tiny-llama", cfg, out_dir, write)


# A Gemma-2-style model: sliding-window and full-attention layers
# alternate, so vLLM builds two KV-cache groups (one per attention type).
TINY_GEMMA2_CONFIG: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=32,
    max_position_embeddings=4096,
    sliding_window=64,
    layer_types=[
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ],
    # vLLM's Gemma2 always ties the head to the embeddings; then the scaled
    # own-token embedding dominates the residual and greedy decoding repeats
    # one token. Larger weights and post-norm gains (1 + w) let the layers,
    # i.e. the KV, decide the next token instead.
    initializer_range=0.3,
    post_norm_weight=4.0,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    seed=0,
)


def _save_word_tokenizer(target: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID, "<unk>": UNK_ID}
    for i in range(FIRST_REGULAR_ID, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    ).save_pretrained(target)


def build_tiny_gemma2(
    out_dir: str | os.PathLike | None = None, **overrides: Any
) -> str:
    """Like :func:`build_tiny_llama`, for a tiny random Gemma2ForCausalLM whose
    layers alternate sliding-window and full attention: vLLM gives it two
    KV-cache groups. Built locally, no download; cached by config hash."""
    cfg = {"arch": "gemma2", **TINY_GEMMA2_CONFIG, **overrides}

    def write(tmp: Path) -> None:
        import torch
        from transformers import Gemma2Config, Gemma2ForCausalLM

        cfg_kw = dict(cfg)
        cfg_kw.pop("arch")
        seed = cfg_kw.pop("seed")
        rope_theta = cfg_kw.pop("rope_theta")
        post_norm = cfg_kw.pop("post_norm_weight")
        hf_cfg = Gemma2Config(
            **cfg_kw,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        )
        torch.manual_seed(seed)
        model = Gemma2ForCausalLM(hf_cfg).to(torch.float32)
        post_norms = (
            "post_attention_layernorm.weight",
            "post_feedforward_layernorm.weight",
        )
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(post_norms):
                    param.fill_(post_norm)
        model.save_pretrained(tmp, safe_serialization=True)
        _save_word_tokenizer(tmp, cfg["vocab_size"])

    return _build_cached("tiny-gemma2", cfg, out_dir, write)


def kv_bytes_per_block(model_dir: str, block_size: int, dtype: str = "float32") -> int:
    """KV bytes of one block of ``block_size`` tokens across all layers (K
    and V), served in ``dtype``: vLLM's resolution of the model's config
    (:func:`kvtier.connector.model_kv.model_kv`)."""
    from kvtier.connector.model_kv import model_kv

    return model_kv(model_dir, dtype).bytes_per_token * block_size


def make_prompt(seed: int, length: int, vocab_size: int = 1024) -> list[int]:
    """Deterministic pseudo-random prompt of regular token ids (no specials)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(length)]
