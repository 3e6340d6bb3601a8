"""Session-wide e2e fixtures: the tiny model and the no-offload baseline."""

from __future__ import annotations

import pytest

from kvtier.testing.engine import engine, run_prompts
from kvtier.testing.model import build_tiny_llama, kv_bytes_per_block

from .workload import FIRST, GPU_BLOCKS, MAX_TOKENS, RETURNING, run_each


@pytest.fixture(scope="session")
def model() -> str:
    return build_tiny_llama()


@pytest.fixture(scope="session")
def block_bytes(model) -> int:
    return kv_bytes_per_block(model, 32)


@pytest.fixture(scope="session")
def baseline(model) -> list[list[int]]:
    """Greedy outputs of FIRST then RETURNING without any offloading."""
    with engine(model, None, num_gpu_blocks=GPU_BLOCKS) as llm:
        first = run_each(llm, FIRST)
        again = run_prompts(llm, RETURNING, MAX_TOKENS)
    return first.outputs + again.outputs
