"""The shared e2e workload: six 4-block prompts, then the first two again.

Sized so the returning prompts have left the GPU cache (20 blocks) and the
CPU tier (8 blocks) and must come back from disk."""

from __future__ import annotations

import itertools
import time
from collections import Counter

from kvtier.testing.engine import (
    RunResult,
    get_connector,
    offloading_kv_transfer_config,
    run_prompts,
    settle,
)
from kvtier.testing.model import make_prompt

BLOCKS_PER_PROMPT = 4
PROMPT_LEN = BLOCKS_PER_PROMPT * 32 + 5  # 4 full 32-token blocks + a tail
GPU_BLOCKS = 20
CPU_BLOCKS = 8
DISK_BLOCKS = 64
MAX_TOKENS = 8
FIRST = [make_prompt(i, PROMPT_LEN) for i in range(6)]
RETURNING = [FIRST[0], FIRST[1]]


def kvtier_config(block_bytes: int, disk, **extra) -> dict:
    from kvtier.store.slot import slot_size

    settings = dict(
        cpu_bytes_to_use=CPU_BLOCKS * block_bytes,
        disk_bytes_to_use=DISK_BLOCKS * slot_size(block_bytes),
        disk_path=str(disk),
        spill_watermark=0.5,
    )
    settings.update(extra)
    return offloading_kv_transfer_config(
        "TieredOffloadingSpec", "kvtier.connector", **settings
    )


def manager_of(llm):
    return get_connector(llm).connector_scheduler.manager


def run_each(llm, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> RunResult:
    """Run prompts one at a time (engine drained after each) and merge.

    Sequential requests make the GPU cache's eviction order deterministic:
    a batch can leave a few blocks of an early prompt cached on the GPU,
    depending on scheduling."""
    parts = [run_prompts(llm, [p], max_tokens) for p in prompts]
    totals: Counter[str] = Counter()
    aggregate: Counter[str] = Counter()
    for part in parts:
        totals.update(part.totals)
        aggregate.update(part.aggregate)
    return RunResult(
        outputs=[o for part in parts for o in part.outputs],
        num_cached_tokens=[n for part in parts for n in part.num_cached_tokens],
        hits_by_source=[h for part in parts for h in part.hits_by_source],
        totals=dict(totals),
        aggregate=dict(aggregate),
        request_ids=[r for part in parts for r in part.request_ids],
        wall_s=sum(part.wall_s for part in parts),
    )


def run_settled(
    llm, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, timeout: float = 120.0
) -> RunResult:
    """Like :func:`run_each`, stepping the engine by hand and letting every
    spill finish between two steps (as if the disk kept up with the GPU).

    With chunked prefill (small ``max_num_batched_tokens``) each step stores
    a few blocks; settling the spills in between makes the CPU tier's clean
    victims available to the next step's store deterministically, so a
    prompt longer than the whole CPU tier reaches the disk tier in full."""
    from vllm import SamplingParams

    from kvtier.testing.engine import collect_result, get_hit_recorder, get_scheduler

    mgr = manager_of(llm)
    sched = get_scheduler(llm)
    rec = get_hit_recorder(llm)
    sp = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    deadline = time.monotonic() + timeout
    finals = []
    before = rec.snapshot()
    t0 = time.perf_counter()
    for prompt in prompts:
        rid = f"settled{next(_SETTLED_IDS)}"
        llm.llm_engine.add_request(rid, {"prompt_token_ids": list(prompt)}, sp)
        final = None
        while final is None or sched.has_requests():
            if time.monotonic() > deadline:
                raise TimeoutError(f"run_settled exceeded {timeout}s")
            for out in llm.llm_engine.step():
                if out.finished:
                    final = out
            settle(mgr, timeout=max(0.1, deadline - time.monotonic()))
        finals.append(final)
    return collect_result(rec, before, finals, time.perf_counter() - t0)


_SETTLED_IDS = itertools.count()


# -- decoding while a returning prefix loads --------------------------------

DECODERS = [make_prompt(500 + i, 40) for i in range(3)]
DECODE_TOKENS = 64
# Decoder tokens that must come out while the returning prefix's read is
# held (the engine kept stepping while a load was in flight).
TOKENS_WHILE_HELD = 8


def decode_while_loading(llm, prompt: list[int], hold=None, timeout: float = 120.0):
    """Three requests decode; ``prompt`` arrives. Returns ``(outputs,
    cached, held)``: every request's greedy tokens (decoders first,
    ``prompt`` last), the prompt's cached tokens, and, with ``hold``, the
    decoder tokens produced while it held the prompt's load back.

    ``hold`` is ``(loading, release)``: ``loading()`` tells whether the
    prompt's disk read has started (and is being held); once it has, the
    engine is stepped until every decoder produced ``TOKENS_WHILE_HELD``
    more tokens while the prompt produced none, then ``release()`` lets the
    read go. Works on both engine modes (``LLMEngine.add_request`` and
    ``step()``); every wait has a deadline."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    dec_sp = SamplingParams(
        temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True, detokenize=False
    )
    sp = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False
    )
    tag = f"dwl{next(_SETTLED_IDS)}"
    ids = [f"{tag}-d{i}" for i in range(len(DECODERS))] + [f"{tag}-x"]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    cached: dict[str, int] = {}
    deadline = time.monotonic() + timeout

    def step() -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"decode_while_loading exceeded {timeout}s")
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
            if out.num_cached_tokens is not None:
                cached[out.request_id] = out.num_cached_tokens

    for rid, p in zip(ids, DECODERS):
        engine.add_request(rid, {"prompt_token_ids": list(p)}, dec_sp)
    while min(len(tokens[rid]) for rid in ids[:-1]) < 2:
        step()
    engine.add_request(ids[-1], {"prompt_token_ids": list(prompt)}, sp)
    held = None
    if hold is not None:
        loading, release = hold
        try:
            while not loading():
                step()
            start = {rid: len(tokens[rid]) for rid in ids[:-1]}
            while min(len(tokens[r]) - start[r] for r in start) < TOKENS_WHILE_HELD:
                step()
                assert not tokens[ids[-1]], "the held prompt produced a token"
            held = min(len(tokens[r]) - start[r] for r in start)
        finally:
            release()
    while engine.has_unfinished_requests():
        step()
    return [tokens[rid] for rid in ids], cached.get(ids[-1], 0), held


def run_multiprocess(
    model: str, block_bytes: int, disk, *mode: str, hold_dir=None, env=None
) -> dict:
    """Run ``_mp_engine.py`` (the workload, or ``mode``) on vLLM's
    multiprocess engine core in a child process; its result as a dict
    (outputs, kvtier's series, which engine-core client ran). With
    ``hold_dir`` (decode-while-loading), the returning prefix's disk read is
    held in the engine core until the decoders produced more tokens.
    ``env``: more environment for the engine (e.g. vLLM's CPU binding)."""
    extra = dict(env or {})
    if hold_dir is not None:
        extra["KVTIER_TEST_HOLD_DIR"] = str(hold_dir)
    result = run_child(
        "_mp_engine.py", [model, str(block_bytes), str(disk), *mode], extra, 300
    )
    assert result["engine_core"] == "SyncMPClient", result["engine_core"]
    return result


def run_child(script: str, args: list[str], env: dict, timeout: float) -> dict:
    """Run ``script`` (a file beside this one) in a child Python with the
    test's environment less VLLM_ENABLE_V1_MULTIPROCESSING, plus ``env``;
    the JSON of its last ``KVTIER-RESULT`` line (asserted present, and the
    child's exit status 0)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    full = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    full.update(env)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(script)), *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
    )
    # The child's kvtier lines and tracebacks, for pytest to show beside a
    # failing test's assertion (a failure seen once under CI's load, with
    # only counts to go on, could not be explained afterwards).
    # vLLM's handler, which kvtier's loggers use, writes to stdout.
    said = [
        ln
        for ln in (proc.stdout + proc.stderr).splitlines()
        if ("kvtier" in ln and not ln.startswith("KVTIER-RESULT "))
        or "Error" in ln
        or "Traceback" in ln
    ]
    sys.stderr.write("".join(f"{script}: {ln}\n" for ln in said[-300:]))
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("KVTIER-RESULT ")]
    assert proc.returncode == 0 and found, proc.stderr[-4000:]
    return json.loads(found[-1].split(" ", 1)[1])
