"""Smoke test of the e2e harness: real vLLM engine (CPU), no offloading.

Proves the baseline the offloading tests compare against: greedy outputs are
deterministic within an engine and identical across two engines, prefix-cache
(device) hits are visible per request, and KV events reach a ZMQ subscriber.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvtier.testing.engine import make_llm, run_prompts, shutdown_llm  # noqa: E402
from kvtier.testing.events import KVEventSubscriber  # noqa: E402
from kvtier.testing.model import build_tiny_llama, make_prompt  # noqa: E402

pytestmark = pytest.mark.e2e

BLOCK = 32
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_llama()


def _prompts() -> list[list[int]]:
    # 3 full blocks + a partial one each; distinct first tokens => no sharing.
    return [make_prompt(seed, 3 * BLOCK + 7) for seed in range(4)]


def test_baseline_deterministic_and_kv_events(model_dir: str) -> None:
    prompts = _prompts()
    sub = KVEventSubscriber()
    llm = make_llm(
        model_dir,
        None,
        num_gpu_blocks=64,
        block_size=BLOCK,
        enable_kv_events=True,
        kv_events_endpoint=sub.endpoint,
    )
    try:
        first = run_prompts(llm, prompts, MAX_TOKENS)
        assert all(len(o) == MAX_TOKENS for o in first.outputs)
        assert first.num_cached_tokens == [0, 0, 0, 0]
        assert first.totals == {}

        # Same batch again: full prompt blocks come from the GPU prefix cache.
        second = run_prompts(llm, prompts, MAX_TOKENS)
        assert second.outputs == first.outputs
        assert second.num_cached_tokens == [3 * BLOCK] * 4
        assert second.hits_by_source == [{"device": 3 * BLOCK}] * 4
        assert second.aggregate.get("device") == 4 * 3 * BLOCK
        assert "host" not in second.totals and "disk" not in second.totals

        # GPU-medium BlockStored events for at least the 4 x 3 full prompt blocks.
        assert sub.wait_for(
            lambda s: s.block_counts()[("BlockStored", "GPU")] >= 12, timeout=60
        ), sub.counts()
        assert not sub.decode_errors
        assert not sub.seq_gaps
        assert all(m == "GPU" for (_, m) in sub.counts())
    finally:
        shutdown_llm(llm)
        sub.stop()

    # A second, independent engine produces the same greedy tokens.
    llm2 = make_llm(model_dir, None, num_gpu_blocks=64, block_size=BLOCK)
    try:
        other = run_prompts(llm2, prompts, MAX_TOKENS)
        assert other.outputs == first.outputs
    finally:
        shutdown_llm(llm2)
