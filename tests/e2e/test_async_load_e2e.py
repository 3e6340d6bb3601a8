"""A disk hit never stops the engine: three requests decode while a
returning prefix is read from disk on the worker's load thread.

In-process engine (its loop spins): the prefix's disk read is held back by
kvtier's fault layer until the decoders produced several more tokens, which
they can only do if ``submit_load`` returned without waiting for the read
and the engine kept stepping. Then the read goes, the prefix is served from
disk in full, and every output equals the no-offload engine's. The same
workload runs under the multiprocess engine core too, with and without the
read held there (the fault layer is installed in the engine core, the gate
is a file). Both load
paths (``disk_load_path`` host and device) run the in-process case."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.testing.engine import engine
from kvtier.testing.fault_plan import FaultKind, FaultPlan, FaultRule
from kvtier.testing.faults import inject_faults

from .test_reliability_e2e import assert_at_rest
from .workload import (
    DECODE_TOKENS,
    DECODERS,
    FIRST,
    MAX_TOKENS,
    TOKENS_WHILE_HELD,
    decode_while_loading,
    kvtier_config,
    manager_of,
    run_each,
    run_multiprocess,
)

pytestmark = pytest.mark.e2e
GPU_BLOCKS = 48
RETURNING = FIRST[0]
WATCHDOG_S = 60.0


@pytest.fixture(scope="module")
def expected(model):
    """The no-offload engine's greedy outputs of the same workload."""
    with engine(model, None, num_gpu_blocks=GPU_BLOCKS) as llm:
        run_each(llm, FIRST)
        outputs, _, _ = decode_while_loading(llm, RETURNING)
    return outputs


def _worker(llm):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().connector_worker.worker


def _only_on_disk(llm) -> None:
    """Compute FIRST (pushing RETURNING's blocks through the small CPU tier
    onto disk), then make the GPU cache forget them."""
    run_each(llm, FIRST)
    assert llm.reset_prefix_cache()


@pytest.mark.parametrize("load_path", ["host", "device"])
def test_decoders_keep_stepping_while_a_disk_read_is_held(
    model, block_bytes, expected, tmp_path, monkeypatch, load_path
):
    plan = inject_faults(monkeypatch, FaultPlan(seed=5))
    release = threading.Event()
    cfg = kvtier_config(
        block_bytes, tmp_path, spill_watermark=0.0, disk_load_path=load_path
    )
    with engine(model, cfg, num_gpu_blocks=GPU_BLOCKS) as llm:
        _only_on_disk(llm)
        if load_path == "device":  # a staging area on the KV cache's device
            assert _worker(llm).reader.staging is not None
        stats = manager_of(llm).hierarchy.stats
        loads_before, failures_before = stats.loads_disk, stats.load_failures
        rule = plan.add(FaultRule.hang(release, ops="read"))
        # A step that waited for the held read would never return: let the
        # read go after a while, and fail the test if that had to happen.
        fired = threading.Event()

        def let_go() -> None:
            fired.set()
            release.set()

        watchdog = threading.Timer(WATCHDOG_S, let_go)
        watchdog.start()
        try:
            outputs, cached, held = decode_while_loading(
                llm,
                RETURNING,
                hold=(lambda: plan.count(FaultKind.HANG) >= 1, release.set),
            )
        finally:
            watchdog.cancel()
            release.set()
            plan.remove(rule)
        # While the read was held the decoders went on producing tokens.
        assert held is not None and held >= TOKENS_WHILE_HELD
        assert not fired.is_set(), "an engine step waited for the held read"
        assert outputs == expected
        # The whole 4-block prefix came from disk, verified.
        assert cached == 4 * 32
        assert stats.loads_disk - loads_before == 4
        assert stats.load_failures == failures_before


@pytest.mark.parametrize("held", [False, True], ids=["free", "read-held"])
def test_disk_hit_while_decoding_under_the_multiprocess_engine(
    model, block_bytes, expected, tmp_path, held
):
    """The engine core (``vllm serve``'s mode) keeps stepping the decoders
    while the returning prefix's read is held inside it (``read-held``: the
    fault layer wraps the engine core's back ends, the gate is a file)."""
    disk, hold_dir = tmp_path / "disk", tmp_path / "hold"
    disk.mkdir()
    hold_dir.mkdir()
    result = run_multiprocess(
        model,
        block_bytes,
        disk,
        "decode-while-loading",
        hold_dir=hold_dir if held else None,
    )
    if held:
        assert result["held"] is not None and result["held"] >= TOKENS_WHILE_HELD
    assert result["outputs"] == expected
    assert result["cached"] == 4 * 32
    loaded = sum(
        value
        for n, lab, value in result["series"]
        if n == "vllm:kv_offload_kvtier_loaded_blocks" and lab.get("tier") == "disk"
    )
    assert loaded == 4, result["series"]


def test_a_connector_reset_never_waits_for_a_held_disk_read(
    model, block_bytes, expected, tmp_path, monkeypatch
):
    """``reset_prefix_cache(reset_connector=True)`` while the returning
    prefix's disk read is held: vLLM flushes every job in flight at a reset
    and waits for them at the next step's start, so that step waited for the
    read (up to the load thread's batch deadline, 15 s). The load still
    reading the disk is given up instead (its tokens recomputed, as after
    any reset): the decoders go on while the read is held, well within the
    watchdog, and every output equals the no-offload engine's."""
    from vllm import SamplingParams

    plan = inject_faults(monkeypatch, FaultPlan(seed=5))
    release = threading.Event()
    cfg = kvtier_config(block_bytes, tmp_path, spill_watermark=0.0)
    dec_sp = SamplingParams(
        temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True, detokenize=False
    )
    sp = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False
    )
    ids = [f"d{i}" for i in range(len(DECODERS))] + ["x"]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    with engine(model, cfg, num_gpu_blocks=GPU_BLOCKS) as llm:
        _only_on_disk(llm)
        core = llm.llm_engine
        deadline = time.monotonic() + 120

        def step() -> None:
            assert time.monotonic() < deadline, "the engine did not finish"
            for out in core.step():
                tokens[out.request_id.split("-")[0]] = list(out.outputs[0].token_ids)

        rule = plan.add(FaultRule.hang(release, ops="read"))
        fired = threading.Event()

        def let_go() -> None:
            fired.set()
            release.set()

        # Shorter than the batch deadline, which bounded the wait before.
        watchdog = threading.Timer(10.0, let_go)
        try:
            for rid, p in zip(ids, DECODERS):
                core.add_request(rid, {"prompt_token_ids": list(p)}, dec_sp)
            while min(len(tokens[rid]) for rid in ids[:-1]) < 2:
                step()
            core.add_request("x", {"prompt_token_ids": list(RETURNING)}, sp)
            while plan.count(FaultKind.HANG) < 1:
                step()
            # The GPU cache's reset fails (requests run), the connector's runs.
            assert not llm.reset_prefix_cache(reset_connector=True)
            watchdog.start()
            start = {rid: len(tokens[rid]) for rid in ids[:-1]}
            while min(len(tokens[r]) - start[r] for r in start) < TOKENS_WHILE_HELD:
                step()
            assert not fired.is_set(), "an engine step waited for the held read"
            release.set()
            while core.has_unfinished_requests():
                step()
        finally:
            watchdog.cancel()
            release.set()
            plan.remove(rule)
        assert [tokens[rid] for rid in ids] == expected
        assert_at_rest(manager_of(llm))
