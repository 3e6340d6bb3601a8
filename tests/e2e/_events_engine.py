"""Runs the shared workload in a fresh process with KV events published to
argv[2] and prints the hierarchy's counters as JSON (for
test_cli_events_e2e.py; a fresh process keeps vLLM's global state clean).
Before shutting the engine down it prints the last event batch's sequence
number and waits for one line on stdin: the test's word that the external
subscriber received that batch."""

from __future__ import annotations

import dataclasses
import json
import select
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    from e2e.workload import (
        FIRST,
        GPU_BLOCKS,
        MAX_TOKENS,
        RETURNING,
        kvtier_config,
        manager_of,
        run_each,
    )
    from kvtier.testing.engine import engine, last_event_seq, run_prompts
    from kvtier.testing.model import build_tiny_llama, kv_bytes_per_block

    disk, endpoint = sys.argv[1], sys.argv[2]
    model = build_tiny_llama()
    cfg = kvtier_config(kv_bytes_per_block(model, 32), disk)
    with engine(
        model,
        cfg,
        num_gpu_blocks=GPU_BLOCKS,
        enable_kv_events=True,
        kv_events_endpoint=endpoint,
    ) as llm:
        run_each(llm, FIRST)
        again = run_prompts(llm, RETURNING, MAX_TOKENS)
        stats = dataclasses.asdict(manager_of(llm).hierarchy.stats)
        # The publisher's socket closes with the engine (linger 0): say which
        # batch was the last, and keep the engine up until the test saw
        # `kvtier events` receive it (one line on stdin), within a deadline.
        print(f"KVTIER-LASTSEQ {last_event_seq(llm)}", flush=True)
        ready, _, _ = select.select([sys.stdin], [], [], 120)
        if not ready or not sys.stdin.readline():
            raise SystemExit("the test never confirmed the last batch arrived")
    print(
        "KVTIER-RESULT "
        + json.dumps({"stats": stats, "disk_tokens": again.totals.get("disk", 0)})
    )


if __name__ == "__main__":
    main()
