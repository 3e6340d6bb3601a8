"""A model's KV bytes per token as vLLM resolves its config.json
(kvtier.connector.model_kv), which ``kvtier doctor --model`` and ``kvtier
size --model`` size the tiers with: the published figures of real
geometries, vLLM's model-class defaults for fields a config.json leaves
out, tensor-parallel replication, and a clear refusal of what it cannot
describe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.connector.model_kv import GeometryError, model_kv
from kvtier.testing.model import LLAMA_31_8B_CONFIG, build_tiny_gemma2

LLAMA_8B = LLAMA_31_8B_CONFIG
LLAMA_70B = {
    **LLAMA_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
}
# DeepSeek-V3's geometry (multi-head latent attention).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "vocab_size": 129280,
    "torch_dtype": "bfloat16",
}
QWEN2_NO_KV_HEADS = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "vocab_size": 151936,
    "torch_dtype": "float16",
}


def write_model(root: Path, doc: dict) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(doc))
    return str(root)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    docs = {
        "llama-8b": LLAMA_8B,
        "llama-70b": LLAMA_70B,
        "deepseek-v3": DEEPSEEK_V3,
        "qwen2": QWEN2_NO_KV_HEADS,
    }
    return {name: write_model(root / name, doc) for name, doc in docs.items()}


def test_published_geometries(models):
    """Llama-3.1-8B: 128 KiB a token in bf16; 70B: 320 KiB; DeepSeek-V3:
    61 layers of one 576-value latent, 70,272 B; fp8 halves them."""
    assert model_kv(models["llama-8b"]).bytes_per_token == 128 << 10
    assert model_kv(models["llama-70b"]).bytes_per_token == 320 << 10
    assert model_kv(models["deepseek-v3"]).bytes_per_token == 61 * 576 * 2 == 70272
    fp8 = model_kv(models["llama-8b"], kv_cache_dtype="fp8")
    assert fp8.bytes_per_token == 64 << 10 and fp8.dtype == "fp8"
    assert model_kv(models["llama-8b"], dtype="float32").bytes_per_token == 256 << 10
    # --kv-cache-dtype wins over --dtype.
    assert model_kv(models["llama-8b"], "float32", "bfloat16").bytes_per_token == (
        128 << 10
    )
    assert not model_kv(models["llama-8b"]).several_groups


def test_interleaved_sliding_window_layers_are_several_groups():
    """The tests' tiny Gemma-2, whose engine has two KV-cache groups of two
    layers each: 4 layers of 2 KV heads x 32 in float32."""
    kv = model_kv(build_tiny_gemma2(), "float32")
    assert kv.several_groups
    assert kv.bytes_per_token == 4 * 2 * 32 * 2 * 4


def test_a_field_left_out_takes_the_model_classs_default(models):
    """Qwen2's config class defaults num_key_value_heads to 32, not to
    num_attention_heads (16): vLLM serves 32 KV heads, so the figure is
    24 x 32 x 64 x 2 x 2 B, twice what the file's own fields suggest."""
    assert model_kv(models["qwen2"]).bytes_per_token == 24 * 32 * 64 * 2 * 2


def test_tensor_parallel_ranks_keep_replicated_heads(models):
    """8 KV heads over 2 ranks: 4 each, the same total; over 16 ranks each
    keeps one (replicated): twice the bytes. A latent is kept by every
    rank."""
    assert model_kv(models["llama-8b"], tensor_parallel_size=2).bytes_per_token == (
        128 << 10
    )
    tp16 = model_kv(models["llama-8b"], tensor_parallel_size=16)
    assert tp16.bytes_per_token == 256 << 10 and tp16.values_per_layer == 2 * 128
    assert model_kv(models["deepseek-v3"], tensor_parallel_size=8).bytes_per_token == (
        8 * 70272
    )


@pytest.mark.parametrize(
    "doc, told",
    [
        ({"model_type": "llama", "num_attention_heads": 8, "hidden_size": 64,
          "num_hidden_layers": "four"}, "vLLM cannot read"),
        ({"architectures": ["MambaForCausalLM"], "model_type": "mamba",
          "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100,
          "state_size": 16}, "state-space"),
        ({**DEEPSEEK_V3, "index_topk": 2048}, "sparse attention"),
    ],
    ids=["bad-field", "mamba", "sparse-mla"],
)  # fmt: skip
def test_what_it_cannot_describe_is_refused_by_name(tmp_path, doc, told):
    with pytest.raises(GeometryError, match=told):
        model_kv(write_model(tmp_path / "m", doc))


def test_no_config_and_packed_cache_dtypes_are_refused(tmp_path, models):
    with pytest.raises(GeometryError, match="vLLM cannot read"):
        model_kv(str(tmp_path))
    with pytest.raises(GeometryError, match="fp8_ds_mla"):
        model_kv(models["deepseek-v3"], kv_cache_dtype="fp8_ds_mla")
