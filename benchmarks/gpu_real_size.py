"""Real-size model on GPU: where a returning prefix comes from, and what it
costs the first token and the decoders running beside it.

A vLLM CUDA engine (in-process, ``LLMEngine.add_request`` + ``step()``) on a
Llama-3.1-8B geometry: its ``config.json`` written locally, random weights
(``load_format="dummy"``), bf16, vLLM's own attention backend choice (Triton
where the flash-attention kernels are absent), token-id prompts, no
tokenizer. For each returning prefix length (``--prefix-tokens``), the
prompt ``prefix + 8 new tokens`` is served with its prefix from:

  gpu_cache         vLLM's GPU prefix cache (the prefix computed just before)
  kvtier_cpu        kvtier's CPU tier (the GPU cache reset)
  kvtier_disk       kvtier's disk tier only (its CPU copies dropped, page
                    cache dropped where allowed)
  recompute         nowhere: a fresh prefix of the same length
  vllm_cpu_offload  vLLM's own ``CPUOffloadingSpec`` with the same CPU bytes

Each run starts 8 decoders (prompts one token short of a block: nothing of
theirs is stored or loaded, and every run starts them the same way),
records their inter-token latency for 16 steps with nothing loading
(``no_load``), then adds the
returning prompt: its time to first token (TTFT, from ``add_request`` to the
step that returns its first token: 8 decoders run beside it) and the
decoders' inter-token latency until then (``itl_ms``: p50 and max over the
repeats). Sources and repeats are interleaved within each engine (the
order alternates every repeat); the engines run one after the other
(vLLM's connector is a per-process global): kvtier's, vLLM's CPU
offloading, then one without a connector (gpu_cache, recompute).

Also, in the same run: the disk tier's load rate (each load job's bytes
over the time from ``submit_load`` to its report, median) next to ``dd``
O_DIRECT reading the same number of bytes of the disk tier's slab in the
same directory (page cache dropped first where allowed); and the greedy
outputs (16 tokens) of the returning prompt served alone once per source:
equal wherever stored KV is reused (``outputs_equal``); recompute's tokens
beside them (``recompute_equal``: bf16 prefill shapes can differ).

``--disk-read-process auto on`` adds a second kvtier engine, with its disk
reads and checks in a read process of their own, that serves the disk
source only (``kvtier_disk[on]``): where the reads run, side by side in one
run (on the H100 the decoders' step doubled while a 32k prefix loaded from
disk with the reads in the engine's process).

``--budget-s`` bounds the whole run: a repeat that would not fit is not
started, no wait outlasts the budget, an engine that fails is noted and the
next one still runs, and the JSON written after each engine says what
completed (``complete``: every engine ran to its end).
Writes ``benchmarks/results/gpu_real_size_<device>.json``::

    python3 benchmarks/gpu_real_size.py --prefix-tokens 8192 32768 --repeats 2 \\
        --disk-dir /var/tmp/kvtier-real --budget-s 190

``--tiny`` runs the same harness on vllm-cpu with the tests' tiny random
Llama (float32, 32-token blocks, short prefixes; vLLM's CPU offloading does
not run on the CPU platform, so that source is null): it proves the script
end to end on a machine without a GPU; its figures say nothing.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SOURCES = ("gpu_cache", "kvtier_cpu", "kvtier_disk", "recompute", "vllm_cpu_offload")
# Sources whose outputs reuse stored KV (compared for equality).
REUSE = ("gpu_cache", "kvtier_cpu", "kvtier_disk", "vllm_cpu_offload")

# meta-llama/Llama-3.1-8B's config.json (the geometry; weights are random).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class Setup:
    """What one run of the benchmark uses (GPU defaults, or ``--tiny``)."""

    model_dir: str
    dtype: str
    block: int  # tokens per GPU (and offloaded) block
    prefixes: list[int]
    repeats: int
    vocab: int
    decoders: int = 8
    decoder_tokens: int = 1024  # upper bound: aborted once the prefix answered
    no_load_steps: int = 16
    tail: int = 8  # new tokens after the prefix (less than a block)
    out_tokens: int = 16
    load_format: str = "dummy"
    tiny: bool = False
    # vLLM's attention backend by name (``--attention-backend``), or None for
    # vLLM's own choice. A machine whose vLLM carries no flash-attention
    # kernels (scripts/gpu-device) names TRITON_ATTN: vLLM 0.33 picks
    # FLASH_ATTN for bf16 without checking that its kernels loaded.
    attention_backend: str | None = None
    # kvtier's ``disk_read_process`` (``--disk-read-process``): where the
    # disk tier's reads and checks run (auto: in the engine's process on
    # CUDA; on: a read process of their own). Each further value is one more
    # kvtier engine that serves the disk source only, as
    # ``kvtier_disk[<value>]``: an A/B in the same run.
    disk_read_process: tuple[str, ...] = ("auto",)

    @property
    def geometry(self) -> dict[str, Any]:
        from kvtier.testing.engine import kv_bytes_per_block

        cfg = json.loads((Path(self.model_dir) / "config.json").read_text())
        return {
            "hidden_size": cfg["hidden_size"],
            "num_hidden_layers": cfg["num_hidden_layers"],
            "num_key_value_heads": cfg["num_key_value_heads"],
            "dtype": self.dtype,
            "kv_bytes_per_token": kv_bytes_per_block(
                self.model_dir, 1, DTYPE_BYTES[self.dtype]
            ),
        }


@dataclass
class Run:
    """One returning prompt served beside the decoders."""

    source: str
    prefix: int
    ttft_s: float
    itl_no_load_ms: list[float]
    itl_ms: list[float]
    cached_tokens: int
    hits: dict[str, int]
    loaded: dict[str, int] = field(default_factory=dict)
    load: dict[str, float] | None = None
    # Where the TTFT went (ms): arrival to the first load's submit_load,
    # that to the last load's report, that to the first token.
    phases_ms: dict[str, float] | None = None


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    from kvtier.testing.engine import make_prompt

    return make_prompt(seed, n, vocab_size=vocab)


class Clock:
    def __init__(self, budget_s: float) -> None:
        self.t0 = time.monotonic()
        self.budget_s = budget_s

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def wait_s(self, limit: float) -> float:
        """How long one wait may take: ``limit``, or what is left of the
        budget if less (at least 1 s), so that a request or spill that hangs
        ends the stage while the JSON can still be written, not the
        caller's ``timeout`` (run.sh gives the script its cap less 10 s)."""
        return max(1.0, min(limit, self.left()))


class LoadTimer:
    """Each load job of the engine's offloading worker (in-process; kvtier's
    or vLLM's, both vLLM ``OffloadingWorker`` objects): its bytes, when
    ``submit_load`` took it and when the ``get_finished`` that reported it
    returned (``perf_counter`` seconds)."""

    def __init__(self) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().connector_worker.worker
        self.jobs: list[tuple[int, float, float]] = []
        self._started: dict[int, float] = {}
        submit_load, get_finished = worker.submit_load, worker.get_finished

        def timed_submit_load(job_id, *args, **kwargs):
            self._started[job_id] = time.perf_counter()
            return submit_load(job_id, *args, **kwargs)

        def timed_get_finished():
            results = get_finished()
            now = time.perf_counter()
            for r in results:
                t = self._started.pop(r.job_id, None)
                if t is not None and r.success and r.transfer_size:
                    self.jobs.append((int(r.transfer_size), t, now))
            return results

        worker.submit_load = timed_submit_load
        worker.get_finished = timed_get_finished


class Bench:
    """The engines, the runs, and what they measured."""

    def __init__(self, setup: Setup, disk_dir: str, clock: Clock) -> None:
        self.s = setup
        self.disk_dir = disk_dir
        self.clock = clock
        self.runs: list[Run] = []
        self.outputs: dict[int, dict[str, list[int]]] = {n: {} for n in setup.prefixes}
        self.ttft_alone: dict[int, dict[str, float]] = {n: {} for n in setup.prefixes}
        self.engines: dict[str, dict[str, Any]] = {}
        self.notes: list[str] = []
        self.dd: dict[int, dict[str, Any]] = {}
        self._ids = iter(range(10**9))
        # (add_request, first token) of the last returning prompt.
        self.last_arrival = (0.0, 0.0)
        g = setup.geometry
        self.token_bytes = g["kv_bytes_per_token"]
        self.prefix_prompts = {
            n: _prompt(1000 + i, n, setup.vocab) for i, n in enumerate(setup.prefixes)
        }
        self.first_tail = _prompt(7, setup.tail, setup.vocab)
        self.tail = _prompt(8, setup.tail, setup.vocab)
        self.decoder_prompts = [
            _prompt(500 + i, setup.block - 1, setup.vocab)
            for i in range(setup.decoders)
        ]

    # ------------------------------------------------------------ engines

    def _engine(self, cfg: dict | None):
        from kvtier.testing.engine import make_llm

        s = self.s
        longest = max(s.prefixes)
        # Room for two prefixes of each length (one returning, one fresh)
        # and the decoders.
        tokens = (
            2 * sum(s.prefixes)
            + longest
            + s.decoders * (s.decoder_tokens + 2 * s.block)
        )
        kw: dict[str, Any] = dict(
            num_gpu_blocks=tokens // s.block + 8,
            block_size=s.block,
            dtype=s.dtype,
            max_model_len=longest + 4 * s.block,
            max_num_seqs=s.decoders + 8,
            max_num_batched_tokens=max(2048, 8 * s.block) if s.tiny else 8192,
            skip_tokenizer_init=True,
        )
        if s.load_format != "auto":
            kw["load_format"] = s.load_format
        if s.attention_backend is not None:
            kw["attention_backend"] = s.attention_backend
        t0 = time.monotonic()
        llm = make_llm(s.model_dir, cfg, **kw)
        return llm, time.monotonic() - t0

    def _params(self, max_tokens: int):
        from vllm import SamplingParams

        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )

    def _alone(
        self, llm, prompt: list[int], max_tokens: int
    ) -> tuple[float, list[int], str]:
        """Serve ``prompt`` with nothing beside it: (TTFT, tokens, request id)."""
        eng = llm.llm_engine
        rid = f"alone{next(self._ids)}"
        t0 = time.perf_counter()
        eng.add_request(
            rid, {"prompt_token_ids": list(prompt)}, self._params(max_tokens)
        )
        ttft, tokens = None, []
        wait_s = self.clock.wait_s(600)
        deadline = time.monotonic() + wait_s
        while eng.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise TimeoutError(f"a request did not finish in {wait_s:.0f} s")
            for out in eng.step():
                if out.request_id == rid:
                    tokens = list(out.outputs[0].token_ids)
                    if ttft is None and tokens:
                        ttft = time.perf_counter() - t0
        self._drain(llm)
        assert ttft is not None
        return ttft, tokens, rid

    def _drain(self, llm) -> None:
        from kvtier.testing.engine import drain

        drain(llm, timeout=self.clock.wait_s(120))

    def _beside_decoders(
        self, llm, prompt: list[int]
    ) -> tuple[float, list[float], list[float], str]:
        """Decoders run; ``prompt`` arrives. Returns its TTFT, the decoders'
        inter-token latencies (ms) before it arrived and until it answered,
        and its request id."""
        s = self.s
        eng = llm.llm_engine
        tag = next(self._ids)
        dec = [f"d{tag}x{i}" for i in range(s.decoders)]
        rid = f"ret{tag}"
        last: dict[str, tuple[float, int]] = {}
        gaps: list[tuple[float, float]] = []  # (arrival, gap)
        first: list[float] = []
        wait_s = self.clock.wait_s(600)
        deadline = time.monotonic() + wait_s

        def step() -> None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"a run did not finish in {wait_s:.0f} s")
            outs = eng.step()
            now = time.perf_counter()
            for out in outs:
                n = len(out.outputs[0].token_ids)
                if out.request_id == rid:
                    if n and not first:
                        first.append(now)
                    continue
                prev = last.get(out.request_id)
                if prev is not None and n > prev[1]:
                    # Tokens that arrive together share the gap.
                    per = (now - prev[0]) / (n - prev[1])
                    gaps.extend((now, per) for _ in range(n - prev[1]))
                if prev is None or n > prev[1]:
                    last[out.request_id] = (now, n)

        sp = self._params(s.decoder_tokens)
        for d, p in zip(dec, self.decoder_prompts):
            eng.add_request(d, {"prompt_token_ids": list(p)}, sp)
        while len(last) < s.decoders or min(n for _, n in last.values()) < 2:
            step()
        gaps.clear()
        while len(gaps) < s.no_load_steps * s.decoders:
            step()
        no_load = [g * 1e3 for _, g in gaps]
        gaps.clear()
        t0 = time.perf_counter()
        eng.add_request(rid, {"prompt_token_ids": list(prompt)}, self._params(1))
        while not first:
            step()
        ttft = first[0] - t0
        self.last_arrival = (t0, first[0])
        window = [g * 1e3 for t, g in gaps if t <= first[0]]
        eng.abort_request(dec)
        while eng.has_unfinished_requests():
            step()
        self._drain(llm)
        return ttft, no_load, window, rid

    def _record(
        self, llm, source: str, n: int, prompt: list[int], hierarchy=None, timer=None
    ) -> None:
        from kvtier.testing.engine import get_hit_recorder

        stats = hierarchy.stats if hierarchy is not None else None
        before = (stats.loads_cpu, stats.loads_disk) if stats else (0, 0)
        jobs = len(timer.jobs) if timer else 0
        ttft, no_load, window, rid = self._beside_decoders(llm, prompt)
        hits = get_hit_recorder(llm).per_request.get(rid, {})
        run = Run(source, n, ttft, no_load, window, 0, dict(hits))
        if stats:
            run.loaded = {
                "cpu": stats.loads_cpu - before[0],
                "disk": stats.loads_disk - before[1],
            }
        if timer and len(timer.jobs) > jobs:
            mine = timer.jobs[jobs:]
            nbytes = sum(b for b, _, _ in mine)
            secs = sum(done - t for _, t, done in mine)
            run.load = {"bytes": nbytes, "seconds": secs, "gbps": nbytes / secs / 1e9}
            arrival, first_token = self.last_arrival
            submitted, reported = min(t for _, t, _ in mine), max(d for _, _, d in mine)
            run.phases_ms = {
                "to_submit": (submitted - arrival) * 1e3,
                "load": (reported - submitted) * 1e3,
                "to_first_token": (first_token - reported) * 1e3,
            }
        self.runs.append(run)
        print(
            f"  {source:>16} {n:>6} tokens: TTFT {ttft * 1e3:9.1f} ms, decoder ITL "
            f"p50 {_p50(window):6.1f} max {max(window, default=float('nan')):7.1f} ms "
            f"(no load p50 {_p50(no_load):6.1f}), hits {hits}"
            + (f", load {run.load['gbps']:.2f} GB/s" if run.load else "")
            + (
                " (ms: to submit {to_submit:.1f}, load {load:.1f}, to first token "
                "{to_first_token:.1f})".format(**run.phases_ms)
                if run.phases_ms
                else ""
            ),
            flush=True,
        )

    def _repeats(self, label: str, reserve_s: float):
        """The repeats to run: each, while the previous one's time and
        ``reserve_s`` (the later engines') still fit the budget."""
        per_repeat = None
        for r in range(self.s.repeats):
            if per_repeat is not None and self.clock.left() < per_repeat + reserve_s:
                self.notes.append(f"{label}: stopped after {r} repeats (budget)")
                return
            t_r = time.monotonic()
            yield r
            per_repeat = time.monotonic() - t_r

    def _warm(self, llm) -> float:
        """Serve every prefix once (its first visit); the seconds it took."""
        t0 = time.monotonic()
        for n in self.s.prefixes:
            self._alone(llm, self.prefix_prompts[n] + self.first_tail, 1)
        return time.monotonic() - t0

    # ------------------------------------------------------------- kvtier

    def kvtier(
        self, cpu_bytes: int, reserve_s: float, read_process: str | None = None
    ) -> None:
        """kvtier's engine: the CPU and disk sources (``read_process`` None:
        ``disk_read_process`` the first value), or, for a further value,
        the disk source only, labelled ``kvtier_disk[<value>]``."""
        from benchmarks._common import direct_read_baseline, drop_caches
        from kvtier.store.slot import slot_size
        from kvtier.testing.engine import get_connector, offloading_kv_transfer_config
        from kvtier.testing.state import evict_clean
        from kvtier.tiers.plans import Residency

        s = self.s
        variant = read_process is not None
        read_process = read_process or s.disk_read_process[0]
        label = f"kvtier[{read_process}]" if variant else "kvtier"
        disk_source = f"kvtier_disk[{read_process}]" if variant else "kvtier_disk"
        sources = [disk_source] if variant else ["kvtier_cpu", "kvtier_disk"]
        block_bytes = s.block * self.token_bytes
        disk = os.path.join(self.disk_dir, label)
        shutil.rmtree(disk, ignore_errors=True)  # each engine starts empty
        os.makedirs(disk, exist_ok=True)
        disk_bytes = (
            2 * sum(-(-n // s.block) + 8 for n in s.prefixes) * slot_size(block_bytes)
        )
        cfg = offloading_kv_transfer_config(
            "TieredOffloadingSpec",
            "kvtier.connector",
            cpu_bytes_to_use=cpu_bytes,
            disk_bytes_to_use=disk_bytes,
            disk_path=disk,
            spill_watermark=0.0,  # every block reaches disk at once
            disk_read_process=read_process,
        )
        llm, start_s = self._engine(cfg)
        try:
            mgr = get_connector(llm).connector_scheduler.manager
            h = mgr.hierarchy
            timer = LoadTimer()
            keys: dict[int, list[bytes]] = {}
            t0 = time.monotonic()
            for n in s.prefixes:
                before = set(h.cpu.keys())
                self._alone(llm, self.prefix_prompts[n] + self.first_tail, 1)
                _settle(mgr, self.clock.wait_s(300))
                stored = h.cpu.keys()
                keys[n] = [k for k in stored if k not in before]
                if len(keys[n]) != n // s.block:
                    self.notes.append(
                        f"kvtier: {len(keys[n])} of {n // s.block} blocks of the "
                        f"{n}-token prefix reached the CPU tier"
                    )
            warm_s = time.monotonic() - t0

            def on_cpu(n: int) -> bool:
                return all(h.lookup(k) is Residency.HIT_CPU for k in keys[n])

            dropped: list[bool] = []

            def only_on_disk(n: int) -> None:
                _settle(mgr, self.clock.wait_s(300))
                for k in keys[n]:
                    evict_clean(h, k)
                dropped.append(drop_caches())

            for r in self._repeats(label, reserve_s):
                order = s.prefixes if r % 2 == 0 else s.prefixes[::-1]
                for n in order:
                    prompt = self.prefix_prompts[n] + self.tail
                    for source in sources if r % 2 == 0 else sources[::-1]:
                        if source == "kvtier_cpu" and not on_cpu(n):
                            self.notes.append(f"kvtier_cpu {n}: prefix not all on CPU")
                        if source == disk_source:
                            only_on_disk(n)
                        assert llm.reset_prefix_cache()
                        self._record(llm, source, n, prompt, h, timer)
                        self._record(llm, "gpu_cache", n, prompt, h, timer)
            # The outputs, each source served alone once.
            for n in s.prefixes:
                prompt = self.prefix_prompts[n] + self.tail
                for source in sources:
                    if source == disk_source:
                        only_on_disk(n)
                    assert llm.reset_prefix_cache()
                    ttft, out, _ = self._alone(llm, prompt, s.out_tokens)
                    self.outputs[n][source] = out
                    self.ttft_alone[n][source] = ttft
                    ttft, out, _ = self._alone(llm, prompt, s.out_tokens)
                    self.outputs[n].setdefault("gpu_cache", out)
            slabs = sorted(glob.glob(os.path.join(disk, "*", "slab-0.kvt")))
            for n in s.prefixes if not variant else []:
                size = (n // s.block) * slot_size(block_bytes)
                if slabs and os.path.getsize(slabs[0]) >= size:
                    self.dd[n] = direct_read_baseline(None, slabs[0], size)
            self.engines[label] = {
                "start_s": start_s,
                "warm_s": warm_s,
                "cpu_bytes_to_use": cpu_bytes,
                "disk_bytes_to_use": disk_bytes,
                "disk_read_process": read_process,
                "reader": type(_reader()).__name__,
                # Where the reads ran by the end (a read process whose child
                # never started or was lost reads in the engine's process).
                "reader_describe": _reader().describe(),
                "disk_fs": _fs(disk),
                "page_cache_dropped": all(dropped) if dropped else None,
                "stats": dict(vars(h.stats)),
            }
        finally:
            _shutdown(llm)

    # ------------------------------------------------------ vLLM offload

    def vllm_offload(self, cpu_bytes: int, reserve_s: float) -> None:
        from vllm.platforms import current_platform

        if not (current_platform.is_cuda_alike() or current_platform.is_xpu()):
            self.notes.append(
                "vllm_cpu_offload: vLLM's CPUOffloadingSpec runs on CUDA/XPU only"
            )
            return
        from kvtier.testing.engine import offloading_kv_transfer_config

        s = self.s
        cfg = offloading_kv_transfer_config(
            "CPUOffloadingSpec", cpu_bytes_to_use=cpu_bytes
        )
        llm, start_s = self._engine(cfg)
        try:
            timer = LoadTimer()
            warm_s = self._warm(llm)
            for r in self._repeats("vllm_cpu_offload", reserve_s):
                for n in s.prefixes if r % 2 == 0 else s.prefixes[::-1]:
                    prompt = self.prefix_prompts[n] + self.tail
                    assert llm.reset_prefix_cache()
                    self._record(llm, "vllm_cpu_offload", n, prompt, timer=timer)
                    self._record(llm, "gpu_cache", n, prompt)
            for n in s.prefixes:
                assert llm.reset_prefix_cache()
                ttft, out, _ = self._alone(
                    llm, self.prefix_prompts[n] + self.tail, s.out_tokens
                )
                self.outputs[n]["vllm_cpu_offload"] = out
                self.ttft_alone[n]["vllm_cpu_offload"] = ttft
            self.engines["vllm_cpu_offload"] = {
                "start_s": start_s,
                "warm_s": warm_s,
                "cpu_bytes_to_use": cpu_bytes,
            }
        finally:
            _shutdown(llm)

    # ---------------------------------------------------------- baseline

    def baseline(self, reserve_s: float) -> None:
        s = self.s
        llm, start_s = self._engine(None)
        try:
            warm_s = self._warm(llm)
            for r in self._repeats("baseline", reserve_s):
                for n in s.prefixes if r % 2 == 0 else s.prefixes[::-1]:
                    fresh = _prompt(2000 + 10 * r + s.prefixes.index(n), n, s.vocab)
                    runs = [
                        ("gpu_cache", self.prefix_prompts[n] + self.tail),
                        ("recompute", fresh + self.tail),
                    ]
                    for source, prompt in runs if r % 2 == 0 else runs[::-1]:
                        self._record(llm, source, n, prompt)
            for n in s.prefixes:
                prompt = self.prefix_prompts[n] + self.tail
                ttft, out, _ = self._alone(llm, prompt, s.out_tokens)
                self.outputs[n]["gpu_cache_baseline"] = out
                self.ttft_alone[n]["gpu_cache"] = ttft
                assert llm.reset_prefix_cache()
                ttft, out, _ = self._alone(llm, prompt, s.out_tokens)
                self.outputs[n]["recompute"] = out
                self.ttft_alone[n]["recompute"] = ttft
            self.engines["baseline"] = {"start_s": start_s, "warm_s": warm_s}
        finally:
            _shutdown(llm)

    # -------------------------------------------------------------- JSON

    def result(self, device: str, complete: bool) -> dict[str, Any]:
        s = self.s
        ttft: dict[str, list[float | None]] = {}
        itl: dict[str, dict[str, list[float | None]]] = {}
        extra = sorted({r.source for r in self.runs} - set(SOURCES))
        for source in (*SOURCES, *extra):
            ttft[source] = []
            itl[source] = {"p50": [], "max": []}
            for n in s.prefixes:
                runs = [r for r in self.runs if r.source == source and r.prefix == n]
                ttft[source].append(
                    statistics.median(r.ttft_s for r in runs) if runs else None
                )
                window = [x for r in runs for x in r.itl_ms]
                itl[source]["p50"].append(_p50(window) if window else None)
                itl[source]["max"].append(max(window) if window else None)
        # Nothing loading: the decoders of kvtier's engine before each prompt.
        itl["no_load"] = {"p50": [], "max": []}
        for n in s.prefixes:
            quiet = [
                x
                for r in self.runs
                if r.prefix == n and r.source in ("kvtier_cpu", "kvtier_disk")
                for x in r.itl_no_load_ms
            ] or [x for r in self.runs if r.prefix == n for x in r.itl_no_load_ms]
            itl["no_load"]["p50"].append(_p50(quiet) if quiet else None)
            itl["no_load"]["max"].append(max(quiet) if quiet else None)
        disk_gbps, dd_gbps = [], []
        for n in s.prefixes:
            loads = [
                r.load["gbps"]
                for r in self.runs
                if r.source == "kvtier_disk" and r.prefix == n and r.load
            ]
            disk_gbps.append(statistics.median(loads) if loads else None)
            dd_gbps.append(self.dd.get(n, {}).get("gbps"))
        # Where each loading source's TTFT went: median per phase and length.
        phases: dict[str, dict[str, dict[str, float]]] = {}
        for r in self.runs:
            if r.phases_ms:
                by_n = phases.setdefault(r.source, {}).setdefault(str(r.prefix), {})
                for k, v in r.phases_ms.items():
                    by_n.setdefault(k, []).append(v)
        phases = {
            src: {
                n: {k: statistics.median(v) for k, v in ph.items()}
                for n, ph in by.items()
            }
            for src, by in phases.items()
        }
        equal, recompute_equal = True, True
        for n in s.prefixes:
            outs = self.outputs[n]
            reuse = [
                outs[k] for k in (*REUSE, *extra, "gpu_cache_baseline") if k in outs
            ]
            equal &= len(reuse) >= 2 and all(o == reuse[0] for o in reuse)
            if "recompute" in outs and reuse:
                recompute_equal &= outs["recompute"] == reuse[0]
        return {
            "device": device,
            "complete": complete,
            "model": {
                "name": "Llama-3.1-8B geometry, random weights"
                if not s.tiny
                else "tiny random Llama (tests' harness)",
                **s.geometry,
            },
            "attention_backend": s.attention_backend or "vLLM's choice",
            "block_tokens": s.block,
            "prefix_tokens": s.prefixes,
            "repeats": s.repeats,
            "ttft_s": ttft,
            "ttft_alone_s": {str(n): v for n, v in self.ttft_alone.items()},
            "ttft_phases_ms": phases,
            "disk_gbps": disk_gbps,
            "dd_gbps": dd_gbps,
            "dd": {str(n): v for n, v in self.dd.items()},
            "itl_ms": itl,
            "outputs_equal": equal,
            "recompute_equal": recompute_equal,
            "outputs": {str(n): v for n, v in self.outputs.items()},
            "engines": self.engines,
            "runs": [vars(r) for r in self.runs],
            "notes": self.notes,
        }


def run_stages(
    stages: list[tuple[str, Callable[[], None]]],
    clock: Clock,
    min_left_s: float,
    notes: list[str],
    save: Callable[[bool], None],
    release: Callable[[], None] = lambda: None,
) -> list[str]:
    """Run the engines' stages in order and save the JSON after each.

    A stage that raises (an engine that fails to start, a request past its
    deadline, a CUDA error) is noted with its error, ``release`` frees what
    its engine held (an engine that failed in its constructor leaves its
    weights on the GPU, and the next engine's start finds too little free
    memory), and the next stage still runs: a lent GPU's minutes are not
    spent again for the stages that would have worked. A stage with less than ``min_left_s`` of the budget
    left is noted and not started. The last save is ``complete`` only if
    every stage ran to its end. Returns the labels of the stages that
    failed."""
    failed: list[str] = []
    skipped = False
    for label, stage in stages:
        if clock.left() < min_left_s:
            notes.append(f"{label}: not run (budget)")
            skipped = True
            continue
        print(f"== {label} ({clock.left():.0f} s left)", flush=True)
        try:
            stage()
        except Exception as exc:  # noqa: BLE001 - noted, the next stage runs
            traceback.print_exc()
            notes.append(f"{label}: failed: {exc!r}")
            failed.append(label)
            # The traceback's frames hold the failed engine.
            traceback.clear_frames(exc.__traceback__)
        if failed and failed[-1] == label:
            # Outside the handler: there the exception being handled still
            # holds its frames, and with them the engine.
            release()
        save(False)
    save(not failed and not skipped)
    return failed


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _settle(mgr, timeout: float = 300.0) -> None:
    """Pump kvtier's disk runtime until no spill is in flight."""
    deadline = time.monotonic() + timeout
    while mgr.has_pending_work():
        if time.monotonic() > deadline:
            raise TimeoutError(f"spills still pending after {timeout} s")
        mgr.on_schedule_end(None)
        time.sleep(0.005)


def _shutdown(llm) -> None:
    from kvtier.testing.engine import shutdown_llm

    shutdown_llm(llm)
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort between engines
        pass


def _reader():
    """The in-process worker's reader of disk hits."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().connector_worker.worker.reader


def _release_failed_engine() -> None:
    """Free what an engine that raised still holds: its worker's KV
    connector (vLLM creates it before the warm-up that failed on the H100,
    and would hand the next engine the same one, bound to the failed
    engine's KV cache), its distributed state, model and KV cache, with
    vLLM's own cleanup between engines."""
    import gc

    gc.collect()
    for cleanup in (
        "vllm.distributed.kv_transfer:ensure_kv_transfer_shutdown",
        "vllm.distributed.parallel_state:cleanup_dist_env_and_memory",
    ):
        module, name = cleanup.split(":")
        try:
            getattr(importlib.import_module(module), name)()
        except Exception:  # noqa: BLE001 - best effort: the next stage says if not
            traceback.print_exc()


def _fs(path: str) -> str | None:
    from benchmarks._common import filesystem_of

    return filesystem_of(path)


def _shm_free() -> int:
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return 0


def _device_name(tiny: bool) -> str:
    import torch

    if torch.cuda.is_available() and not tiny:
        return torch.cuda.get_device_name()
    return "cpu"


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-tokens", type=int, nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--disk-dir",
        default=None,
        help="the disk tier's directory (a temporary one by default)",
    )
    ap.add_argument("--budget-s", type=float, default=600.0)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--out", default=None, help="the JSON's path (overrides --out-dir)")
    ap.add_argument(
        "--tiny", action="store_true", help="vllm-cpu, the tests' tiny Llama"
    )
    ap.add_argument(
        "--attention-backend",
        default=None,
        help="vLLM's attention backend by name (TRITON_ATTN where vLLM's "
        "flash-attention kernels are absent); vLLM's choice by default",
    )
    ap.add_argument(
        "--disk-read-process",
        choices=["auto", "on", "off"],
        nargs="+",
        default=["auto"],
        help="kvtier's disk_read_process for its engine (default auto); each "
        "further value adds a kvtier engine serving the disk source only "
        "(kvtier_disk[<value>]), an A/B in the same run",
    )
    args = ap.parse_args()
    clock = Clock(args.budget_s)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from kvtier.testing.engine import use_in_process_engines

    use_in_process_engines()
    import torch

    tmp = tempfile.mkdtemp(prefix="kvtier-real-")
    try:
        if args.tiny:
            from kvtier.testing.engine import build_tiny_llama

            prefixes = args.prefix_tokens or [256, 1024]
            setup = Setup(
                model_dir=build_tiny_llama(max_position_embeddings=4 * max(prefixes)),
                dtype="float32",
                block=32,
                prefixes=prefixes,
                repeats=args.repeats,
                vocab=1024,
                decoder_tokens=512,
                no_load_steps=8,
                out_tokens=8,
                load_format="auto",
                tiny=True,
                disk_read_process=tuple(args.disk_read_process),
            )
        else:
            if not torch.cuda.is_available():
                print(
                    "gpu_real_size: no CUDA here (--tiny runs the harness on vllm-cpu)"
                )
                return 0
            model_dir = os.path.join(tmp, "llama-3.1-8b-geometry")
            os.makedirs(model_dir)
            Path(model_dir, "config.json").write_text(json.dumps(LLAMA_31_8B, indent=1))
            setup = Setup(
                model_dir=model_dir,
                dtype="bfloat16",
                block=16,
                prefixes=args.prefix_tokens or [8192, 32768],
                repeats=args.repeats,
                vocab=32000,
                attention_backend=args.attention_backend,
                disk_read_process=tuple(args.disk_read_process),
            )
        device = _device_name(args.tiny)
        disk_dir = args.disk_dir or os.path.join(tmp, "disk")
        os.makedirs(disk_dir, exist_ok=True)
        bench = Bench(setup, disk_dir, clock)
        # vLLM's first import in a process (its modules compiled on a fresh
        # machine) and CUDA's initialisation are no engine's start: on the
        # H100 they made 24 s of the first engine's 48 s. The first engine
        # still pays the process's first model load and kernel compiles.
        t_import = time.monotonic()
        import vllm.entrypoints.llm  # noqa: F401

        if torch.cuda.is_available() and not args.tiny:
            torch.cuda.init()
        bench.engines["process"] = {
            "import_and_cuda_init_s": time.monotonic() - t_import,
            "first_engine": "kvtier",
        }
        per_token = bench.token_bytes
        # The same CPU bytes for kvtier and vLLM: every prefix, a quarter more
        # (their tails, the decoders' prompts), within /dev/shm (both keep
        # the CPU tier there).
        want = int(1.25 * sum(setup.prefixes) * per_token) + (64 << 20)
        shm = _shm_free()
        cpu_bytes = min(want, int(0.8 * shm)) if shm else want
        if cpu_bytes < want:
            bench.notes.append(
                f"/dev/shm has {shm} bytes free: CPU tiers of {cpu_bytes} bytes, "
                f"not {want} (the longest prefixes may not fit the CPU tier)"
            )
        name = f"gpu_real_size_{_slug(device) if not args.tiny else 'cpu-tiny'}"
        out = Path(args.out) if args.out else Path(args.out_dir) / f"{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        print(
            f"{device}: {setup.geometry}, prefixes {setup.prefixes}, repeats "
            f"{setup.repeats}, CPU bytes {cpu_bytes}, disk {disk_dir} ({_fs(disk_dir)})",
            flush=True,
        )

        def save(complete: bool) -> None:
            doc = bench.result(device, complete)
            doc["budget_s"] = args.budget_s
            doc["elapsed_s"] = args.budget_s - clock.left()
            doc["when"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            doc["torch"] = torch.__version__
            import vllm

            doc["vllm"] = getattr(vllm, "__version__", None)
            out.write_text(json.dumps(doc, indent=1) + "\n")

        # What the later engines need at least (start, warm-up, one repeat).
        reserve = 60.0 if not args.tiny else 10.0
        # The A/B's further kvtier engines run last: the goals' sources
        # (kvtier, vLLM's CPU offloading, recompute) come first.
        extra = setup.disk_read_process[1:]
        variants = [
            (
                f"kvtier[{v}]",
                lambda v=v, i=i: bench.kvtier(
                    cpu_bytes, (len(extra) - 1 - i) * reserve + 5.0, v
                ),
            )
            for i, v in enumerate(extra)
        ]
        failed = run_stages(
            [
                (
                    "kvtier",
                    lambda: bench.kvtier(cpu_bytes, (2 + len(extra)) * reserve),
                ),
                (
                    "vllm_cpu_offload",
                    lambda: bench.vllm_offload(cpu_bytes, (1 + len(extra)) * reserve),
                ),
                ("baseline", lambda: bench.baseline(len(extra) * reserve + 5.0)),
                *variants,
            ],
            clock,
            reserve / 2,
            bench.notes,
            save,
            _release_failed_engine,
        )
        doc = json.loads(out.read_text())
        _print_table(doc)
        print(f"wrote {out}")
        return 0 if doc["outputs_equal"] and not failed else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _print_table(doc: dict) -> None:
    def f(x, scale=1.0, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x * scale)

    print(
        f"{'source':>16} | "
        + " | ".join(f"{n:>8} tok TTFT s" for n in doc["prefix_tokens"])
    )
    for source, values in doc["ttft_s"].items():
        print(f"{source:>16} | " + " | ".join(f"{f(v):>17}" for v in values))
    print(
        f"{'ITL ms p50/max':>16} | "
        + " | ".join(f"{n:>17}" for n in doc["prefix_tokens"])
    )
    for source, v in doc["itl_ms"].items():
        cells = [
            f"{f(a, fmt='{:.1f}')}/{f(b, fmt='{:.1f}')}"
            for a, b in zip(v["p50"], v["max"])
        ]
        print(f"{source:>16} | " + " | ".join(f"{c:>17}" for c in cells))
    print(f"disk GB/s {doc['disk_gbps']}  dd O_DIRECT GB/s {doc['dd_gbps']}")
    print(
        f"outputs equal (reuse): {doc['outputs_equal']}; recompute equal: {doc['recompute_equal']}"
    )
    for note in doc["notes"]:
        print("note:", note)


if __name__ == "__main__":
    sys.exit(main())
