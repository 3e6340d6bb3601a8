"""Decoders' steps while the CPU tier spills, on a real engine: the spills in
the engine's process (``disk_spill_process: off``) or in the spill process
(``on``), next to an engine without offloading.

Three requests decode; a fourth arrives whose long prompt is in no tier. Its
prefill is computed chunk by chunk (``max_num_batched_tokens`` 512, the
decoders in every step), each chunk's blocks are stored in kvtier's CPU tier
and, with ``spill_watermark: 0``, spilled to disk at once: the spills run
beside the prefill's remaining steps and the decode-only steps after it.
Every engine step is timed (``LLMEngine.add_request`` + ``step()``):

  quiet    the decoders' 40 steps before the prompt arrives
  prefill  from its arrival to its first token: each a step of the decoders'
           tokens plus one chunk (what a decoder waits per token meanwhile)
  spill    after its first token, until kvtier's counters show every stored
           block on disk (read every 4 steps, outside the timed steps):
           the decoders alone, beside the last spills
  after    40 steps once the spills are done: the decoders alone, nothing
           beside (the control for ``spill``, at the same context lengths)

Cases, each engine in a fresh child process, the cases taking turns round
by round: ``none`` (no offloading: the floor for ``prefill`` and ``after``),
``off`` (kvtier, spills on ``disk_io_threads`` threads of the engine's
process) and ``on`` (kvtier, spills in the spill process: the child is
checked to exist under the engine). Both engine modes: in-process (whose
loop spins) and the multiprocess engine core of ``vllm serve``. The
prompt's first generated token is compared across cases (the same
prompts: nothing is reused, so kvtier must not change it).

Model: ``step_stall.py``'s tiny random Llama (8 layers x 4 KV heads x 64,
fp32, 16 KiB of KV per token, 32-token blocks): an 8,192-token prompt
stores and spills 128 MiB. The model gets cores - 1 CPUs, as in
``step_stall.py``.

    .venv/bin/python benchmarks/spill_decode.py [--length 8192] [--repeats 3]
        [--rounds 2] [--modes inproc,mp] [--disk-dir DIR] [--write-mbps N]

``--write-mbps N`` limits O_DIRECT writes to the disk tier's drive to N MB/s
for the whole run (root: the kernel's cgroup throttle,
:func:`benchmarks._common.io_throttle`): spills that slow outlast the
prefill, so they run beside the decoders' own steps too.

Prints a table and writes benchmarks/results/spill_decode.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._common import (  # noqa: E402
    bench_llm,
    filesystem_of,
    io_throttle,
    kvtier_counters,
    model_cores_env,
    step_summary,
    write_json,
)
from benchmarks.step_stall import BLOCK, MODEL  # noqa: E402

DECODERS = 3
DECODE_PROMPT = 64
QUIET_STEPS = 40
AFTER_STEPS = 40
CHECK_EVERY = 4  # steps between two looks at the counters while spilling
CASES = ("none", "off", "on")
PHASES = ("quiet", "prefill", "spill", "after")
SPILLED = "vllm:kv_offload_kvtier_spills"
STORED = "vllm:kv_offload_kvtier_write_bytes{cpu}"


def _spill_children() -> list[int]:
    """Pids of this process's descendants running the spill process."""
    from kvtier.testing.procs import command, descendants

    return sorted(
        pid
        for pid in descendants(os.getpid())
        if "kvtier.store.spill_process" in (command(pid) or "")
    )


def _child(
    mode: str, case: str, length: int, repeats: int, seed0: int, where: str | None
) -> dict:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if mode == "mp" else "0"
    from vllm import SamplingParams

    from kvtier.store.slot import slot_size
    from kvtier.testing.engine import offloading_kv_transfer_config
    from kvtier.testing.model import build_tiny_llama, kv_bytes_per_block, make_prompt

    model = build_tiny_llama(max_position_embeddings=2 * length, **MODEL)
    bpb = kv_bytes_per_block(model, BLOCK)
    blocks = length // BLOCK
    gpu_blocks = blocks + 64
    disk_dir = tempfile.mkdtemp(prefix="kvtier-spill-decode-", dir=where)
    cfg = None
    if case != "none":
        cfg = offloading_kv_transfer_config(
            "TieredOffloadingSpec",
            "kvtier.connector",
            # One prompt and the decoders' blocks: every run's blocks fit.
            cpu_bytes_to_use=(blocks + 64) * bpb,
            disk_bytes_to_use=(repeats + 2) * (blocks + 64) * slot_size(bpb),
            disk_path=disk_dir,
            spill_watermark=0.0,
            disk_spill_process=case,
        )
    llm = bench_llm(model, bpb, gpu_blocks, length + 128, cfg, BLOCK)
    engine = llm.llm_engine
    decode_sp = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    first_sp = SamplingParams(temperature=0.0, max_tokens=2)

    def step(into: list[float]) -> list:
        t0 = time.perf_counter()
        outs = engine.step()
        into.append(time.perf_counter() - t0)
        return outs

    def run(k: int) -> dict:
        """One arrival (run ``k``: its own prompts, so nothing is cached)."""
        ids = [f"r{k}-d{i}" for i in range(DECODERS)]
        for i, rid in enumerate(ids):
            prompt = make_prompt(seed0 + 1000 * k + i, DECODE_PROMPT)
            engine.add_request(rid, {"prompt_token_ids": prompt}, decode_sp)
        produced: dict[str, int] = {}
        deadline = time.monotonic() + 120
        while min(produced.get(r, 0) for r in ids) < 2:
            for out in engine.step():
                produced[out.request_id] = len(out.outputs[0].token_ids)
            if time.monotonic() > deadline:
                raise TimeoutError("the decoders did not start")
        steps: dict[str, list[float]] = {p: [] for p in PHASES}
        for _ in range(QUIET_STEPS):
            step(steps["quiet"])
        before = kvtier_counters()
        rid = f"r{k}-x"
        engine.add_request(
            rid,
            {"prompt_token_ids": make_prompt(seed0 + 1000 * k + 99, length)},
            first_sp,
        )
        first: list[int] = []
        deadline = time.monotonic() + 600
        while not first:
            for out in step(steps["prefill"]):
                if out.request_id == rid and out.outputs[0].token_ids:
                    first = list(out.outputs[0].token_ids[:1])
            if time.monotonic() > deadline:
                raise TimeoutError("no first token")
        at_first = kvtier_counters()
        stored = spilled = 0.0
        if case != "none":
            deadline = time.monotonic() + 600
            while True:
                now = kvtier_counters()
                stored = (now.get(STORED, 0) - before.get(STORED, 0)) / bpb
                spilled = now.get(SPILLED, 0) - before.get(SPILLED, 0)
                if stored and spilled >= stored:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("the spills did not finish")
                for _ in range(CHECK_EVERY):
                    step(steps["spill"])
        for _ in range(AFTER_STEPS):
            step(steps["after"])
        engine.abort_request(ids + [rid])
        while engine.has_unfinished_requests():
            engine.step()
        return {
            "steps": steps,
            "first": first,
            "stored_blocks": stored,
            "spilled_blocks": spilled,
            "spilled_by_first_token": at_first.get(SPILLED, 0) - before.get(SPILLED, 0),
        }

    try:
        run(-1)  # untimed: first-use costs (slab files, O_DIRECT probe, pages)
        runs = [run(k) for k in range(repeats)]
        children = _spill_children()
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    return {
        "mode": mode,
        "case": case,
        "seed": seed0,
        "runs": runs,
        "spill_children": children,
    }


def _row(results: list[dict]) -> dict:
    """Per phase, every run's steps together: p50 / p99 / max."""
    row: dict = {}
    for phase in PHASES:
        steps = [s for r in results for run in r["runs"] for s in run["steps"][phase]]
        row[phase] = step_summary(steps) if steps else {"steps": 0}
    prefill = [sum(run["steps"]["prefill"]) for r in results for run in r["runs"]]
    row["ttft_s"] = statistics.median(prefill)
    row["spilled_by_first_token"] = statistics.median(
        run["spilled_by_first_token"] / max(run["stored_blocks"], 1)
        for r in results
        for run in r["runs"]
    )
    return row


def _table(summary: dict) -> None:
    print(
        "\nmode    case  | quiet p50/max | prefill p50/p99/max, TTFT s "
        "| spill steps p50/p99/max | after p50/max   (ms)"
    )
    for mode, cases in summary.items():
        for case, row in cases.items():
            q, p, s, a = (row[x] for x in PHASES)
            spill = (
                f"{s['steps']:4d}: {s['p50_ms']:5.1f} / {s['p99_ms']:6.1f} / "
                f"{s['max_ms']:6.1f}"
                if s["steps"]
                else " " * 29
            )
            print(
                f"{mode:7s} {case:5s} | {q['p50_ms']:5.1f} / {q['max_ms']:6.1f} "
                f"| {p['p50_ms']:5.1f} / {p['p99_ms']:6.1f} / {p['max_ms']:6.1f}, "
                f"{row['ttft_s']:5.2f} | {spill} "
                f"| {a['p50_ms']:5.1f} / {a['max_ms']:6.1f}"
            )


def _run_children(args: argparse.Namespace) -> list[dict] | None:
    """Every engine child, cases taking turns round by round; None when one
    failed (its stderr printed)."""
    env, chosen = model_cores_env()
    print(chosen)
    results: list[dict] = []
    for mode in args.modes.split(","):
        for rnd in range(args.rounds):
            for case in CASES:
                argv = [sys.executable, __file__, "--child", mode, case, str(rnd)]
                argv += ["--length", str(args.length), "--repeats", str(args.repeats)]
                if args.disk_dir:
                    argv += ["--disk-dir", args.disk_dir]
                proc = subprocess.run(
                    argv, capture_output=True, text=True, env=env, timeout=1800
                )
                found = [
                    ln
                    for ln in proc.stdout.splitlines()
                    if ln.startswith("KVTIER-SPILL-DECODE ")
                ]
                if proc.returncode or not found:
                    print(proc.stderr[-4000:], file=sys.stderr)
                    return None
                results.append(json.loads(found[-1].split(" ", 1)[1]))
                print(f"  {mode} round {rnd} {case}: done", flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3, help="arrivals per engine")
    ap.add_argument("--rounds", type=int, default=2, help="engines per case")
    ap.add_argument("--modes", default="inproc,mp")
    ap.add_argument("--disk-dir", default=None, help="where the disk tier goes")
    ap.add_argument(
        "--write-mbps",
        type=float,
        default=None,
        help="limit writes to the disk tier's drive to this many MB/s for the "
        "whole run (root: the kernel's cgroup throttle)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/spill_decode.json"))
    ap.add_argument("--child", nargs=3, metavar=("MODE", "CASE", "SEED"))
    args = ap.parse_args()
    if args.child:
        mode, case, seed = args.child
        result = _child(mode, case, args.length, args.repeats, int(seed), args.disk_dir)
        print("KVTIER-SPILL-DECODE " + json.dumps(result))
        return 0
    with contextlib.ExitStack() as stack:
        if args.write_mbps:
            where = args.disk_dir or tempfile.gettempdir()
            try:
                stack.enter_context(
                    io_throttle(where, int(args.write_mbps * 1e6), "write")
                )
            except OSError as exc:
                print(f"spill_decode: --write-mbps: {exc}", file=sys.stderr)
                return 2
        results = _run_children(args)
    if results is None:
        return 1
    summary: dict = {}
    firsts: dict[tuple[int, int], set] = {}  # (round, run): across cases, modes
    problems = []
    for r in results:
        summary.setdefault(r["mode"], {})
        for k, run in enumerate(r["runs"]):
            firsts.setdefault((r["seed"], k), set()).add(tuple(run["first"]))
            if r["case"] != "none" and run["spilled_blocks"] < run["stored_blocks"]:
                problems.append(f"{r['mode']} {r['case']}: run {k} not all spilled")
        if r["case"] == "on" and not r["spill_children"]:
            problems.append(f"{r['mode']} on: no spill process under the engine")
        if r["case"] == "off" and r["spill_children"]:
            problems.append(f"{r['mode']} off: a spill process under the engine")
    for mode in summary:
        for case in CASES:
            mine = [r for r in results if r["mode"] == mode and r["case"] == case]
            summary[mode][case] = _row(mine)
    equal = all(len(v) == 1 for v in firsts.values())
    path = write_json(
        "spill_decode",
        {
            "model": "tiny random Llama, 8 layers x 4 KV heads x 64, fp32, "
            "16 KiB KV per token, block 32 tokens",
            "prompt_tokens": args.length,
            "decoders": DECODERS,
            "repeats": args.repeats,
            "rounds": args.rounds,
            "omp_threads": int(model_cores_env()[0]["OMP_NUM_THREADS"]),
            "write_mbps": args.write_mbps,
            "disk_dir_fs": filesystem_of(args.disk_dir or tempfile.gettempdir()),
            "summary": summary,
            "p99_note": "p99 over every run's steps of that phase together",
            "outputs_equal": equal,
            "problems": problems,
            "results": results,
        },
        args.out,
    )
    print(f"wrote {path}")
    _table(summary)
    print(f"first tokens equal across cases: {equal}")
    for p in problems:
        print(f"PROBLEM: {p}")
    return 0 if equal and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
