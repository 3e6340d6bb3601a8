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


class _FileGate:
    """A release for ``FaultRule.hang`` that works across processes: once
    ``armed`` exists, a read that consults it marks ``entered`` and waits
    (up to two minutes) until ``released`` exists; before, it passes."""

    def __init__(self, hold_dir: Path) -> None:
        self.armed = hold_dir / "armed"
        self.entered = hold_dir / "entered"
        self.released = hold_dir / "released"

    def wait(self, timeout: float | None = None) -> bool:
        import time

        if not self.armed.exists():
            return True
        self.entered.touch()
        deadline = time.monotonic() + 120
        while not self.released.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        return True


def _hold_reads(hold_dir: Path) -> _FileGate:
    """Wrap every disk back end kvtier builds in this process (and in the
    engine core: forked, it inherits the wrapper; spawned, it imports this
    module again) in the fault layer, holding reads at a file gate."""
    from _pytest.monkeypatch import MonkeyPatch

    from kvtier.testing.fault_plan import FaultPlan, FaultRule
    from kvtier.testing.faults import inject_faults

    gate = _FileGate(hold_dir)
    plan = inject_faults(MonkeyPatch(), FaultPlan(seed=5))
    plan.add(FaultRule.hang(gate, ops="read"))  # type: ignore[arg-type]
    return gate


GATE = (
    _hold_reads(Path(os.environ["KVTIER_TEST_HOLD_DIR"]))
    if os.environ.get("KVTIER_TEST_HOLD_DIR")
    else None
)


def _read_processes(timeout: float = 60.0) -> list[dict]:
    """kvtier's read processes below this process: the CPUs each may run on,
    and those of its parent's first thread (the worker's model runner); its
    name and its parent's threads' names (as ps and top show them).

    A read process names itself once its interpreter has imported its
    modules; on a loaded machine that can come after the workload's last
    load (its loads meanwhile run in the worker). So this looks again, up to
    ``timeout`` seconds, until each one found carries its name; past the
    deadline it returns what it saw, and the caller's check fails on it."""
    import time

    from kvtier.store.read_process import CHILD_NAME

    deadline = time.monotonic() + timeout
    while True:
        found = _scan_read_processes()
        named = found and all(p["name"] == CHILD_NAME for p in found)
        if named or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _scan_read_processes() -> list[dict]:
    from kvtier.testing.procs import parent_pid, read_processes, thread_names

    found = []
    for pid in read_processes(os.getpid()):
        try:
            worker = parent_pid(pid)
            if worker is None:
                continue
            found.append(
                {
                    "cpus": sorted(os.sched_getaffinity(pid)),
                    "parent_cpus": sorted(os.sched_getaffinity(worker)),
                    "name": thread_names(pid).get(pid),
                    "parent_threads": sorted(set(thread_names(worker).values())),
                }
            )
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from e2e.workload import FIRST, GPU_BLOCKS, MAX_TOKENS, RETURNING, kvtier_config

    # tests/e2e pins in-process engines when imported (through the
    # workload); this script is about the other mode.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"

    model, block_bytes, disk = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    # "workload" (default): FIRST then RETURNING; "decode-while-loading":
    # FIRST, then FIRST[0] returns from disk while three requests decode
    # (test_async_load_e2e.py, same sizes as there).
    mode = sys.argv[4] if len(sys.argv) > 4 else "workload"
    gpu_blocks = 48 if mode == "decode-while-loading" else GPU_BLOCKS
    with open(Path(model) / "config.json") as f:
        max_pos = json.load(f)["max_position_embeddings"]
    # Spill each block as it is stored: a prompt leaves the CPU tier for disk
    # only once its spills are done, and here nothing drains them between
    # prompts (as the in-process workload's run_each does).
    extra: dict = {"spill_watermark": 0.0}
    kw: dict = {}
    if mode == "decode-while-loading":  # as kvtier.testing.engine.make_llm
        kw = {"max_num_batched_tokens": 2048}
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=True,
        block_size=32,
        num_gpu_blocks_override=gpu_blocks,
        kv_cache_memory_bytes=gpu_blocks * block_bytes,
        max_model_len=min((gpu_blocks - 1) * 32, max_pos),
        kv_transfer_config=kvtier_config(block_bytes, disk, **extra),
        seed=0,
        max_num_seqs=8,
        disable_log_stats=False,
        compilation_config={"mode": 0},
        **kw,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def run(prompts):
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    cached = held = None
    if mode == "decode-while-loading":
        from e2e.workload import decode_while_loading

        for p in FIRST:
            run([p])
        assert llm.reset_prefix_cache()
        hold = None
        if GATE is not None:  # the returning prefix's read is held
            GATE.armed.touch()
            hold = (GATE.entered.exists, GATE.released.touch)
        outputs, cached, held = decode_while_loading(llm, FIRST[0], hold=hold)
    else:
        outputs = [o for p in FIRST for o in run([p])] + run(RETURNING)
    # Where the read processes run is the default workload's question. Under
    # a fault plan (the held read) the worker starts none (its reads stay in
    # its process: kvtier.testing.faults), so a scan would wait out its
    # deadline for nothing.
    # kvtier's counters reach vLLM's metrics with an engine step's stats: a
    # sub-block prompt (nothing to look up or store) steps once more, so
    # the last jobs' counts (a promotion reported by the worker after its
    # request finished) are in before they are read. CI once read
    # promotions 0 without it.
    run([list(range(1, 9))])
    read_processes = (
        _read_processes()
        if mode != "decode-while-loading" and hasattr(os, "sched_getaffinity")
        else []
    )
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
                "cached": cached,
                "held": held,
                "metrics": metrics,
                "series": series,
                "read_processes": read_processes,
                # Which engine-core client ran: SyncMPClient is the
                # multiprocess engine core, InprocClient the in-process one.
                "engine_core": type(llm.llm_engine.engine_core).__name__,
            }
        )
    )


if __name__ == "__main__":  # spawn re-imports this module in the engine core
    main()
