"""Runs the shared workload on vLLM's multiprocess engine core (the mode
``vllm serve`` uses) with kvtier, and prints outputs + kvtier metrics as
JSON. Invoked by test_multiprocess_e2e.py in a subprocess."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from e2e.workload import FIRST, GPU_BLOCKS, MAX_TOKENS, RETURNING, kvtier_config

    # tests/e2e pins in-process engines when imported (through the
    # workload); this script is about the other mode.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"

    model, block_bytes, disk = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        block_size=32,
        num_gpu_blocks_override=GPU_BLOCKS,
        kv_cache_memory_bytes=GPU_BLOCKS * block_bytes,
        max_model_len=(GPU_BLOCKS - 1) * 32,
        kv_transfer_config=kvtier_config(block_bytes, disk),
        seed=0,
        max_num_seqs=8,
        disable_log_stats=False,
        compilation_config={"mode": 0},
    )
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def run(prompts):
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    outputs = [o for p in FIRST for o in run([p])] + run(RETURNING)
    metrics = {
        m.name: m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:kv_offload_kvtier_") and hasattr(m, "value")
    }
    # Labelled series too (e.g. loaded_blocks{tier="disk"}), which the dict
    # above collapses to one value per name.
    series = [
        [m.name, dict(getattr(m, "labels", {}) or {}), m.value]
        for m in llm.get_metrics()
        if m.name.startswith("vllm:kv_offload_kvtier_") and hasattr(m, "value")
    ]
    print(
        "KVTIER-RESULT "
        + json.dumps(
            {
                "outputs": outputs,
                "metrics": metrics,
                "series": series,
                # Which engine-core client ran: SyncMPClient is the
                # multiprocess engine core, InprocClient the in-process one.
                "engine_core": type(llm.llm_engine.engine_core).__name__,
            }
        )
    )


if __name__ == "__main__":  # spawn re-imports this module in the engine core
    main()
