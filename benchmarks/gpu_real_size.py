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

and, in kvtier's engine, ``dd_beside``: no returning prompt; where it would
arrive, ``dd`` (fio where installed) reads as many bytes of the disk tier's
slab, O_DIRECT 1 MiB, in a process of its own, and the decoders step until
it exits: what the drive alone costs them, kvtier's code out of the picture
(its "TTFT" is the read's wall time). Read ``kvtier_disk``'s decoder
latency against it: a drive (or a virtual disk's host) that slows the
decoders by itself does the same under any cache.

Each run starts 8 decoders (prompts one token short of a block: nothing of
theirs is stored or loaded, and every run starts them the same way),
records their inter-token latency for 16 steps with nothing loading
(``no_load``), then adds the returning prompt: its time to first token
(TTFT, from ``add_request`` to the step that returns its first token: 8
decoders run beside it) and the decoders' inter-token latency until then
(``itl_ms``: p50 and max over the repeats; ``itl_loading_ms``: of the steps
begun before the load was reported, what the decoders feel while the
prefix arrives, not the request's own compute after it). A loading run is
followed by the same prompt from the same engine's GPU prefix cache.

Each engine runs in a process of its own (vLLM's connector is a
per-process global; a process's exit frees all an engine held, so one that
fails costs the next nothing). kvtier's engine and vLLM's CPU offloading
engine are alive together and their sources interleave run by run (the
order alternates every repeat): on the H100 the same decoders stepped in
25 ms in one engine and 38-43 ms in the next, a drift far above the 5 %
the CPU-tier goal must resolve; engines run one after the other would
each take their own share of it. Then the engine without a connector (``gpu_cache``,
``recompute``), then any ``--disk-read-process`` variant.

Also, in the same run: the disk tier's load rate (each load job's bytes
over the time from ``submit_load`` to its report, median) next to ``dd``
O_DIRECT reading the same number of bytes of the disk tier's slab in the
same directory (page cache dropped first where allowed); and the greedy
outputs (16 tokens) of the returning prompt served alone once per source:
equal wherever stored KV is reused (``outputs_equal``); recompute's tokens
beside them (``recompute_equal``: bf16 prefill shapes can differ). With
random weights the greedy tokens are often one token repeated, which says
little: each token's top logprobs are compared too (``logprobs_equal``:
they move with every bit of the KV they were computed over).
``goals``: the issue's four goals as measured (see :func:`_goals`).
``ttft_over_gpu_cache_s``: each loading source's TTFT less that of the same
prompt from its own engine's GPU cache, served right after (what the
engines' drift leaves out). ``threads_per_step``: per source, what the
engine's threads did per step with nothing loading (``no_load``) and from
the arrival to the first token (``arrival``): on a CPU, waiting for one,
and sleeps, of the engine's loop, kvtier's threads, the process's other
threads and its other children
(:func:`benchmarks._common.thread_times`), so a step that got slower says
whether it waited for a lock or the GPU, or for a CPU. Also ``ttft_alone_s``
(each source served alone, the run that gives its outputs),
``ttft_phases_ms``, ``dd``, ``engines``, ``outputs``, ``logprobs``, every
run (``runs``) and ``notes``; docs/benchmarks.md lists them.

``--disk-read-process auto on`` adds a second kvtier engine, after the
others, with its disk reads and checks in a read process of their own,
that serves the disk source only (``kvtier_disk[on]``): where the reads
run, an A/B in one run (on the H100 the decoders' step doubled while a 32k prefix loaded from
disk with the reads in the engine's process).

``--budget-s`` bounds the whole run: a repeat that would not fit is not
started, no wait of the engines outlasts the budget and none of the
driver's outlasts it by more than 5 s, an engine that fails is noted and
the next one still runs, and the JSON, written after every repeat and
every engine, says what completed (``complete``: every stage ran to its
end).
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
import contextlib
import functools
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SOURCES = ("gpu_cache", "kvtier_cpu", "kvtier_disk", "recompute", "vllm_cpu_offload")
# How much earlier than the driver's the children's budget ends.
CHILD_MARGIN_S = 15.0
# Top logprobs kept per output token (compared across the sources too).
LOGPROBS = 5
# Sources whose outputs reuse stored KV (compared for equality).
REUSE = ("gpu_cache", "kvtier_cpu", "kvtier_disk", "vllm_cpu_offload")


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

    @classmethod
    def tiny_llama(cls, prefixes: list[int], repeats: int, **kw: Any) -> Setup:
        """``--tiny``'s set-up: vllm-cpu and the tests' tiny random Llama
        (float32, 32-token blocks, short runs); ``kw`` overrides fields."""
        if "model_dir" not in kw:
            from kvtier.testing.model import build_tiny_llama

            kw["model_dir"] = build_tiny_llama(
                max_position_embeddings=4 * max(prefixes)
            )
        fields: dict[str, Any] = dict(
            dtype="float32",
            block=32,
            vocab=1024,
            decoder_tokens=512,
            no_load_steps=8,
            out_tokens=8,
            load_format="auto",
            tiny=True,
        )
        return cls(prefixes=prefixes, repeats=repeats, **{**fields, **kw})

    @functools.cached_property
    def geometry(self) -> dict[str, Any]:
        """The model's geometry for the JSON, resolved once (vLLM reads its
        config: model_kv)."""
        from kvtier.testing.model import kv_bytes_per_block

        cfg = json.loads((Path(self.model_dir) / "config.json").read_text())
        return {
            "hidden_size": cfg["hidden_size"],
            "num_hidden_layers": cfg["num_hidden_layers"],
            "num_key_value_heads": cfg["num_key_value_heads"],
            "dtype": self.dtype,
            "kv_bytes_per_token": kv_bytes_per_block(self.model_dir, 1, self.dtype),
        }


@dataclass
class Run:
    """One returning prompt served beside the decoders."""

    source: str
    prefix: int
    ttft_s: float
    itl_no_load_ms: list[float]
    itl_ms: list[float]
    hits: dict[str, int]
    engine: str = ""  # the engine (label) that served it
    loaded: dict[str, int] = field(default_factory=dict)
    load: dict[str, float] | None = None
    # Where the TTFT went (ms): arrival to the first load's submit_load,
    # that to the last load's report, that to the first token.
    phases_ms: dict[str, float] | None = None
    # The decoders' gaps (ms) of the steps begun before the load was
    # reported (loading sources only).
    itl_loading_ms: list[float] | None = None
    # A loading run: its TTFT less that of the same prompt from the same
    # engine's GPU cache, served right after.
    over_gpu_cache_s: float | None = None
    # Per engine step, what the engine's threads did with nothing loading
    # and from the arrival to the first token (benchmarks._common.thread_times).
    threads: dict[str, Any] | None = None


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    from kvtier.testing.model import make_prompt

    return make_prompt(seed, n, vocab_size=vocab)


class Clock:
    """The run's budget. ``t0``: when it started (``time.monotonic``, one
    clock for every process of the machine), so the engines' processes
    share the driver's budget."""

    def __init__(self, budget_s: float, t0: float | None = None) -> None:
        self.t0 = time.monotonic() if t0 is None else t0
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


class EngineHost:
    """One engine and the sources it serves, in a process of its own
    (:func:`_serve`; vLLM's connector is a per-process global).

    ``kind``: ``kvtier`` (``kvtier_cpu`` and the disk source), ``vllm_cpu_offload``
    (vLLM's ``CPUOffloadingSpec``) or ``baseline`` (no connector:
    ``gpu_cache``, ``recompute``). A kvtier engine with ``variant`` set
    serves the disk source only, labelled ``kvtier_disk[<read_process>]``.
    Every method returns plain data (it crosses the pipe); what it noted on
    the way is in ``notes``."""

    def __init__(
        self,
        setup: Setup,
        disk_dir: str,
        clock: Clock,
        kind: str,
        cpu_bytes: int = 0,
        read_process: str = "auto",
        variant: bool = False,
        engine_kw: dict[str, Any] | None = None,
    ) -> None:
        self.s = setup
        self.disk_dir = disk_dir
        self.clock = clock
        self.kind = kind
        self.cpu_bytes = cpu_bytes
        self.read_process = read_process
        self.variant = variant
        self.engine_kw = engine_kw or {}
        self.label = f"kvtier[{read_process}]" if variant else kind
        self.disk_source = f"kvtier_disk[{read_process}]" if variant else "kvtier_disk"
        self.notes: list[str] = []
        self.llm = None
        self.timer: LoadTimer | None = None
        self.info: dict[str, Any] = {}
        self._ids = iter(range(10**9))
        # (add_request, first token) of the last returning prompt.
        self.last_arrival = (0.0, 0.0)
        self.token_bytes = setup.geometry["kv_bytes_per_token"]
        self.prefix_prompts = {
            n: _prompt(1000 + i, n, setup.vocab) for i, n in enumerate(setup.prefixes)
        }
        self.first_tail = _prompt(7, setup.tail, setup.vocab)
        self.tail = _prompt(8, setup.tail, setup.vocab)
        self.decoder_prompts = [
            _prompt(500 + i, setup.block - 1, setup.vocab)
            for i in range(setup.decoders)
        ]
        # kvtier: the blocks of each prefix (its keys), the disk tier's
        # directory, whether each page-cache drop was allowed.
        self.keys: dict[int, list[bytes]] = {}
        self.disk = os.path.join(disk_dir, self.label)
        self.dropped: list[bool] = []

    def take_notes(self) -> list[str]:
        """What was noted since the last call (sent with each answer)."""
        notes, self.notes = self.notes, []
        return notes

    # ------------------------------------------------------------ engine

    def start(self) -> dict[str, Any]:
        """Build the engine and serve every prefix once (its first visit);
        what it took."""
        from kvtier.testing.engine import make_llm, offloading_kv_transfer_config

        s = self.s
        longest = max(s.prefixes)
        if self.kind == "baseline":
            # Room for every prefix returning, a fresh one of each length per
            # repeat (recompute's, each kept in vLLM's prefix cache) and the
            # decoders: sized for one repeat's fresh prefixes, vLLM's LRU
            # evicted the returning prefix's blocks, freed before the next
            # repeat's fresh ones, and "gpu_cache" was partly a recompute
            # (run.sh's 8k and 32k prefixes, 3 repeats, on the tiny Llama:
            # repeat 2's 8k prefix found 6112 of its 8192 tokens cached).
            tokens = (1 + s.repeats) * sum(s.prefixes) + longest
        else:
            # A returning prefix loading while another stays cached.
            tokens = 2 * longest
        tokens += s.decoders * (s.decoder_tokens + 2 * s.block)
        kw: dict[str, Any] = dict(
            num_gpu_blocks=tokens // s.block + 8,
            block_size=s.block,
            dtype=s.dtype,
            max_model_len=longest + 4 * s.block,
            max_num_seqs=s.decoders + 8,
            max_num_batched_tokens=max(2048, 8 * s.block) if s.tiny else 8192,
            skip_tokenizer_init=True,
            **self.engine_kw,
        )
        if s.load_format != "auto":
            kw["load_format"] = s.load_format
        if s.attention_backend is not None:
            kw["attention_backend"] = s.attention_backend
        cfg = None
        if self.kind == "kvtier":
            from kvtier.store.slot import slot_size

            shutil.rmtree(self.disk, ignore_errors=True)  # each engine starts empty
            os.makedirs(self.disk, exist_ok=True)
            block_bytes = s.block * self.token_bytes
            disk_bytes = (
                2
                * sum(-(-n // s.block) + 8 for n in s.prefixes)
                * slot_size(block_bytes)
            )
            cfg = offloading_kv_transfer_config(
                "TieredOffloadingSpec",
                "kvtier.connector",
                cpu_bytes_to_use=self.cpu_bytes,
                disk_bytes_to_use=disk_bytes,
                disk_path=self.disk,
                spill_watermark=0.0,  # every block reaches disk at once
                disk_read_process=self.read_process,
            )
            self.info.update(
                disk_bytes_to_use=disk_bytes, disk_read_process=self.read_process
            )
        elif self.kind == "vllm_cpu_offload":
            cfg = offloading_kv_transfer_config(
                "CPUOffloadingSpec", cpu_bytes_to_use=self.cpu_bytes
            )
        if cfg is not None:
            self.info["cpu_bytes_to_use"] = self.cpu_bytes
        if not s.tiny:
            import torch

            # CUDA's initialisation is no engine's start (its own figure).
            t0 = time.monotonic()
            torch.cuda.init()
            self.info["cuda_init_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        self.llm = make_llm(s.model_dir, cfg, **kw)
        self.info["start_s"] = time.monotonic() - t0
        if cfg is not None:
            self.timer = LoadTimer()
        t0 = time.monotonic()
        if self.kind == "kvtier":
            h = self._hierarchy()
            for n in s.prefixes:
                before = set(h.cpu.keys())
                self._alone(self.prefix_prompts[n] + self.first_tail, 1)
                self._settle()
                stored = h.cpu.keys()
                self.keys[n] = [k for k in stored if k not in before]
                if len(self.keys[n]) != n // s.block:
                    self.notes.append(
                        f"{self.label}: {len(self.keys[n])} of {n // s.block} blocks "
                        f"of the {n}-token prefix reached the CPU tier"
                    )
        else:
            for n in s.prefixes:
                self._alone(self.prefix_prompts[n] + self.first_tail, 1)
        self.info["warm_s"] = time.monotonic() - t0
        return dict(self.info)

    def measure(self, source: str, n: int, r: int) -> list[dict[str, Any]]:
        """Serve the ``n``-token returning prompt beside the decoders with
        its prefix from ``source``, then from this engine's GPU prefix cache
        (each loading source's own-engine reference); the runs."""
        s = self.s
        prompt = self.prefix_prompts[n] + self.tail
        if source == "recompute":
            fresh = _prompt(2000 + 10 * r + s.prefixes.index(n), n, s.vocab)
            return [self._record("recompute", n, fresh + self.tail)]
        if source == "gpu_cache":
            return [self._record("gpu_cache", n, prompt)]
        if source == "dd_beside":
            return self._dd_beside(n)
        if source == "kvtier_cpu" and not self._on_cpu(n):
            self.notes.append(f"kvtier_cpu {n}: prefix not all on CPU")
        if source == self.disk_source:
            self._only_on_disk(n)
        self._reset()
        loaded = self._record(source, n, prompt)
        cached = self._record("gpu_cache", n, prompt)
        # Its cost over this engine's GPU cache, served right after: what
        # the engine's own step time (it drifts between engines) leaves out.
        loaded["over_gpu_cache_s"] = loaded["ttft_s"] - cached["ttft_s"]
        return [loaded, cached]

    def outputs(self) -> dict[str, dict[str, Any]]:
        """Each of this engine's sources served alone once per prefix: its
        TTFT, greedy tokens and top logprobs per token (see ``_alone``),
        ``{str(n): {source: (ttft, tokens, logprobs)}}``."""
        s = self.s
        out: dict[str, dict[str, Any]] = {str(n): {} for n in s.prefixes}
        if self.kind == "baseline":
            # Every prefix from the GPU cache first (all of them are cached
            # after the runs), then, after one reset, every one recomputed:
            # a reset between them would make the next "GPU cache" a
            # recompute.
            for n in s.prefixes:
                prompt = self.prefix_prompts[n] + self.tail
                out[str(n)]["gpu_cache_baseline"] = self._alone(prompt, s.out_tokens)
            self._reset()
            for n in s.prefixes:
                prompt = self.prefix_prompts[n] + self.tail
                out[str(n)]["recompute"] = self._alone(prompt, s.out_tokens)
            return out
        sources = (
            [self.disk_source]
            if self.variant
            else ["kvtier_cpu", "kvtier_disk"]
            if self.kind == "kvtier"
            else ["vllm_cpu_offload"]
        )
        for n in s.prefixes:
            prompt = self.prefix_prompts[n] + self.tail
            got = out[str(n)]
            for source in sources:
                if source == self.disk_source:
                    self._only_on_disk(n)
                self._reset()
                got[source] = self._alone(prompt, s.out_tokens)
                if self.kind == "kvtier" and "gpu_cache" not in got:
                    got["gpu_cache"] = self._alone(prompt, s.out_tokens)
        return out

    def finish(self) -> dict[str, Any]:
        """What this engine reports beside its runs: ``engine`` (start,
        warm-up, sizes, kvtier's reader and counters) and ``dd`` (kvtier's
        main engine: dd O_DIRECT over as many bytes of its slab as each
        prefix's load read, ``{str(n): result}``)."""
        dd: dict[str, Any] = {}
        if self.kind == "kvtier":
            from benchmarks._common import direct_read_baseline

            for n in self.s.prefixes if not self.variant else []:
                span = self._slab_span(n)
                if span is not None:
                    dd[str(n)] = direct_read_baseline(None, *span)
            reader = _reader()
            self.info.update(
                reader=type(reader).__name__,
                # Where the reads ran by the end (a read process whose child
                # never started or was lost reads in the engine's process).
                reader_describe=reader.describe(),
                disk_fs=_fs(self.disk),
                page_cache_dropped=all(self.dropped) if self.dropped else None,
                stats=dict(vars(self._hierarchy().stats)),
            )
        return {"engine": dict(self.info), "dd": dd}

    def close(self) -> None:
        """Shut the engine down (its tiers, their files and threads)."""
        if self.llm is not None:
            from kvtier.testing.engine import shutdown_llm

            llm, self.llm = self.llm, None
            shutdown_llm(llm)

    # ------------------------------------------------------------- kvtier

    def _reset(self) -> None:
        """Empty the GPU prefix cache (the next prompt's prefix comes from
        the source under test); vLLM refuses while requests run."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache")

    def _hierarchy(self):
        from kvtier.testing.engine import get_connector

        return get_connector(self.llm).connector_scheduler.manager.hierarchy

    def _settle(self) -> None:
        """Every spill finished (within the budget)."""
        from kvtier.testing.engine import get_connector, settle

        settle(
            get_connector(self.llm).connector_scheduler.manager,
            self.clock.wait_s(300),
        )

    def _on_cpu(self, n: int) -> bool:
        from kvtier.tiers.plans import Residency

        h = self._hierarchy()
        return all(h.lookup(k) is Residency.HIT_CPU for k in self.keys[n])

    def _slab_span(self, n: int) -> tuple[str, int] | None:
        """The disk tier's first slab and as many bytes as the ``n``-token
        prefix's slots take (what dd reads beside kvtier's figures); None
        before the slab holds that much."""
        from kvtier.store.slot import slot_size

        s = self.s
        slabs = sorted(glob.glob(os.path.join(self.disk, "*", "slab-0.kvt")))
        size = (n // s.block) * slot_size(s.block * self.token_bytes)
        if not slabs or os.path.getsize(slabs[0]) < size:
            return None
        return slabs[0], size

    def _only_on_disk(self, n: int) -> None:
        """Drop the prefix's CPU copies (clean: each is on disk) and the
        page cache (where allowed): its next hit reads the drive."""
        from benchmarks._common import drop_caches
        from kvtier.testing.state import evict_clean

        self._settle()
        h = self._hierarchy()
        for k in self.keys[n]:
            evict_clean(h, k)
        self.dropped.append(drop_caches())

    # ------------------------------------------------------------- serving

    def _params(self, max_tokens: int):
        from vllm import SamplingParams

        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )

    def _alone(
        self, prompt: list[int], max_tokens: int
    ) -> tuple[float, list[int], list[dict[str, float]]]:
        """Serve ``prompt`` with nothing beside it: its TTFT, greedy tokens,
        and each token's top logprobs (``{str(token id): logprob}``). With
        random weights the greedy tokens are often one token repeated; the
        logprobs still move with every bit of the KV they were computed
        over."""
        eng = self.llm.llm_engine
        rid = f"alone{next(self._ids)}"
        params = self._params(max_tokens)
        params.logprobs = LOGPROBS
        t0 = time.perf_counter()
        eng.add_request(rid, {"prompt_token_ids": list(prompt)}, params)
        ttft, tokens, logprobs = None, [], []
        wait_s = self.clock.wait_s(600)
        deadline = time.monotonic() + wait_s
        while eng.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise TimeoutError(f"a request did not finish in {wait_s:.0f} s")
            for out in eng.step():
                if out.request_id == rid:
                    tokens = list(out.outputs[0].token_ids)
                    logprobs = [
                        {str(t): lp.logprob for t, lp in top.items()}
                        for top in out.outputs[0].logprobs or []
                    ]
                    if ttft is None and tokens:
                        ttft = time.perf_counter() - t0
        self._drain()
        assert ttft is not None
        return ttft, tokens, logprobs

    def _drain(self) -> None:
        from kvtier.testing.engine import drain

        drain(self.llm, timeout=self.clock.wait_s(120))

    def _beside_decoders(
        self, prompt: list[int] | None, beside: list[str] | None = None
    ) -> tuple[float, list[float], list[tuple[float, float]], str, dict | None]:
        """Decoders run; ``prompt`` arrives. Returns its TTFT, the decoders'
        inter-token latencies (ms) before it arrived, their gaps until it
        answered (``(step start, ms)``, perf_counter seconds), its request
        id, and what the engine's threads did per step in each of the two
        windows (``{"no_load": ..., "arrival": ...}``, see
        :func:`benchmarks._common.thread_times`: whether a slower step was
        spent waiting for a lock or the GPU, or for a CPU).

        With ``beside`` (a command line) and no ``prompt``, the command
        starts where the prompt would arrive and the decoders step until it
        exits: the "TTFT" is its wall time, and it must exit 0."""
        from benchmarks._common import thread_times, times_delta

        s = self.s
        eng = self.llm.llm_engine
        tag = next(self._ids)
        dec = [f"d{tag}x{i}" for i in range(s.decoders)]
        rid = f"ret{tag}"
        last: dict[str, tuple[float, int]] = {}
        gaps: list[tuple[float, float]] = []  # (step start, gap s)
        first: list[float] = []
        steps = [0]
        wait_s = self.clock.wait_s(600)
        deadline = time.monotonic() + wait_s
        me = threading.get_native_id()

        def step() -> None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"a run did not finish in {wait_s:.0f} s")
            outs = eng.step()
            steps[0] += 1
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
                    gaps.extend((prev[0], per) for _ in range(n - prev[1]))
                if prev is None or n > prev[1]:
                    last[out.request_id] = (now, n)

        def snapshot() -> tuple[dict | None, int]:
            """The threads' times now, between two steps; the time it took
            is taken out of the next gap (it is no step's)."""
            a = time.perf_counter()
            times = thread_times(me)
            took = time.perf_counter() - a
            for r, (t, n) in last.items():
                last[r] = (t + took, n)
            return times, steps[0]

        sp = self._params(s.decoder_tokens)
        for d, p in zip(dec, self.decoder_prompts):
            eng.add_request(d, {"prompt_token_ids": list(p)}, sp)
        while len(last) < s.decoders or min(n for _, n in last.values()) < 2:
            step()
        gaps.clear()
        quiet = snapshot()
        while len(gaps) < s.no_load_steps * s.decoders:
            step()
        no_load = [g * 1e3 for _, g in gaps]
        gaps.clear()
        arrival = snapshot()
        t0 = time.perf_counter()
        if beside is None:
            eng.add_request(rid, {"prompt_token_ids": list(prompt)}, self._params(1))
            while not first:
                step()
        else:
            cmd = subprocess.Popen(
                beside, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
            try:
                # At least one step: a read that ends before the first poll
                # (a tiny span) still has the step it overlapped, not an
                # empty window (the CI run at ef2622a saw one).
                step()
                while cmd.poll() is None:
                    step()
            finally:
                if cmd.poll() is None:  # a step ran past its deadline
                    cmd.kill()
                    cmd.wait()
                err = cmd.stderr.read().decode(errors="replace")[-500:]
                cmd.stderr.close()
            first.append(time.perf_counter())
            if cmd.returncode:
                raise RuntimeError(f"{beside[0]} exited {cmd.returncode}: {err}")
        ttft = first[0] - t0
        self.last_arrival = (t0, first[0])
        end = snapshot()
        window = [(t, g * 1e3) for t, g in gaps if t < first[0]]
        threads = None
        if quiet[0] is not None:
            threads = {
                "no_load": times_delta(quiet[0], arrival[0], arrival[1] - quiet[1]),
                "arrival": times_delta(arrival[0], end[0], end[1] - arrival[1]),
            }
        eng.abort_request(dec)
        while eng.has_unfinished_requests():
            step()
        self._drain()
        return ttft, no_load, window, rid, threads

    def _dd_beside(self, n: int) -> list[dict[str, Any]]:
        """The decoders while ``dd`` (fio where installed) reads the
        ``n``-token prefix's span of the disk tier's slab, O_DIRECT, in a
        process of its own: the drive's own cost to them, no kvtier load in
        flight (see the module doc). Its "TTFT" is the read's wall time."""
        from benchmarks._common import direct_read_argv

        span = self._slab_span(n)
        if span is None:
            self.notes.append(f"dd_beside {n}: the slab is shorter than the prefix")
            return []
        argv = direct_read_argv(shutil.which("fio"), *span)
        wall, no_load, window, _, threads = self._beside_decoders(None, argv)
        run = Run("dd_beside", n, wall, no_load, [g for _, g in window], {})
        run.engine = self.label
        run.threads = threads
        run.load = {"bytes": span[1], "seconds": wall, "gbps": span[1] / wall / 1e9}
        # Every step while the read ran is one the drive could slow.
        run.itl_loading_ms = list(run.itl_ms)
        print(
            f"  {'dd_beside':>16} {n:>6} tokens: read {wall * 1e3:9.1f} ms "
            f"({run.load['gbps']:.2f} GB/s), decoder ITL p50 {_p50(run.itl_ms):6.1f} "
            f"max {max(run.itl_ms, default=float('nan')):7.1f} ms "
            f"(no load p50 {_p50(no_load):6.1f})",
            flush=True,
        )
        return [vars(run)]

    def _record(self, source: str, n: int, prompt: list[int]) -> dict[str, Any]:
        from kvtier.testing.engine import get_hit_recorder

        stats = self._hierarchy().stats if self.kind == "kvtier" else None
        before = (stats.loads_cpu, stats.loads_disk) if stats else (0, 0)
        timer = self.timer if source != "gpu_cache" else None
        jobs = len(timer.jobs) if timer else 0
        ttft, no_load, window, rid, threads = self._beside_decoders(prompt)
        hits = get_hit_recorder(self.llm).take(rid)
        run = Run(source, n, ttft, no_load, [g for _, g in window], dict(hits))
        run.engine = self.label
        run.threads = threads
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
            # The steps that began before the load was reported: what the
            # decoders feel while the prefix arrives (the steps after it
            # are the request's own compute, whatever its source).
            run.itl_loading_ms = [g for t, g in window if t < reported]
        print(
            f"  {source:>16} {n:>6} tokens: TTFT {ttft * 1e3:9.1f} ms, decoder ITL "
            f"p50 {_p50(run.itl_ms):6.1f} max {max(run.itl_ms, default=float('nan')):7.1f} ms "
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
        return vars(run)


def _serve(
    conn,
    setup: Setup,
    disk_dir: str,
    t0: float,
    budget_s: float,
    kw: dict[str, Any],
    parent: int,
) -> None:
    """A child process's loop: one :class:`EngineHost`, one call per
    message ``(method, args)``, each answered ``(status, value, notes)``;
    ``close`` shuts the engine down and ends the process. The first answer
    says what the process took to import vLLM (and initialise CUDA). The
    process dies with the driver (run.sh's timeout kills the driver: an
    engine left behind would hold its GPU memory into the next step)."""
    from kvtier.store.child_process import die_with_parent
    from kvtier.testing.engine import use_in_process_engines

    die_with_parent(parent)
    use_in_process_engines()
    # The child's own deadlines end CHILD_MARGIN_S before the driver's, so
    # a request that hangs fails in the child, which says so, before the
    # driver gives up on it.
    clock = Clock(budget_s - CHILD_MARGIN_S, t0)
    host: EngineHost | None = None
    try:
        t_import = time.monotonic()
        import torch
        import vllm
        import vllm.entrypoints.llm  # noqa: F401

        # No CUDA here: a process waiting for its stage holds no context
        # (on a GPU in exclusive-process mode it would keep the others out).
        host = EngineHost(setup, disk_dir, clock, **kw)
        conn.send(
            (
                "ok",
                {
                    "torch": torch.__version__,
                    "vllm": getattr(vllm, "__version__", None),
                    "import_s": time.monotonic() - t_import,
                },
                [],
            )
        )
        while True:
            method, args = conn.recv()
            try:
                if method == "close":
                    host.close()
                    conn.send(("ok", None, host.take_notes()))
                    return
                value = getattr(host, method)(*args)
                conn.send(("ok", value, host.take_notes()))
            except Exception as exc:  # noqa: BLE001 - reported to the driver
                traceback.print_exc()
                conn.send(("err", repr(exc), host.take_notes()))
    except (EOFError, KeyboardInterrupt):
        return  # the driver went away
    except Exception as exc:  # noqa: BLE001 - reported to the driver
        traceback.print_exc()
        with contextlib.suppress(OSError):
            conn.send(("err", repr(exc), host.take_notes() if host else []))


class EngineProcess:
    """The driver's handle on one :class:`EngineHost` in a child process.

    Each call waits at most its timeout; a child that does not answer in
    time is killed (a hung request or load must not cost the stages
    after it), and one that died or raised fails the call with its error.
    A child's exit frees all it held (GPU memory, CPU tiers), so an engine
    that failed costs the next one nothing."""

    def __init__(
        self, label: str, setup: Setup, disk_dir: str, clock: Clock, **kw: Any
    ) -> None:
        import multiprocessing as mp

        self.label = label
        self.clock = clock
        self.notes: list[str] = []
        # spawn: a fresh interpreter (CUDA cannot be forked into).
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve,
            args=(child, setup, disk_dir, clock.t0, clock.budget_s, kw, os.getpid()),
            name=f"engine-{label}",
        )
        self.proc.start()
        child.close()
        self._facts: dict[str, Any] | None = None

    @property
    def facts(self) -> dict[str, Any]:
        """What the child took to import vLLM, and the versions of torch
        and vLLM: its first answer, waited for here (the children import
        side by side)."""
        if self._facts is None:
            self._facts = self._answer(600)
        return self._facts

    def call(self, method: str, *args: Any, limit_s: float = 600) -> Any:
        """``method(*args)`` in the child; what it returned (see
        ``_answer`` for how long it waits)."""
        if not self.facts:  # the first answer, read before this call's
            raise RuntimeError(f"{self.label}: no first answer")
        try:
            self.conn.send((method, args))
        except OSError:  # the child's end is gone
            self._exited()
        return self._answer(limit_s)

    def _exited(self) -> NoReturn:
        self.proc.join(5)
        raise RuntimeError(
            f"{self.label}: its process exited (code {self.proc.exitcode})"
        ) from None

    def _answer(self, limit_s: float) -> Any:
        """The child's answer, waited for ``limit_s`` (within the budget)
        plus the margin by which the child's deadlines come first, and never
        more than 5 s past the budget: run.sh's timeout kills this process
        10 s after it, and the JSON must be written before."""
        timeout = min(
            self.clock.wait_s(limit_s) + CHILD_MARGIN_S + 15,
            max(2.0, self.clock.left() + 5),
        )
        if not self.conn.poll(timeout):
            self.kill()
            raise TimeoutError(f"{self.label}: no answer in {timeout:.0f} s (killed)")
        try:
            status, value, notes = self.conn.recv()
        except (EOFError, OSError):
            self._exited()
        self.notes.extend(notes)
        if status != "ok":
            raise RuntimeError(f"{self.label}: {value}")
        return value

    def close(self) -> None:
        """Shut the engine down and end the process: killed if it has not
        ended within a minute, or 5 s past the budget if that comes first."""
        end = time.monotonic() + max(2.0, min(60.0, self.clock.left() + 5))
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.conn.send(("close", ()))
                if self.conn.poll(max(0.0, end - time.monotonic())):
                    self.notes.extend(self.conn.recv()[2])
            self.proc.join(max(0.0, end - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """End the process now (SIGKILL) and close the pipe."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        with contextlib.suppress(OSError):
            self.conn.close()


class Bench:
    """The driver: starts the engines (each in a process of its own),
    interleaves their runs, and gathers what they measured.

    Every engine's process is spawned at once (:meth:`spawn`), so their
    imports of vLLM (tens of seconds on a fresh machine) overlap; each
    stage then starts its engines. ``save`` (set by the caller) writes the
    JSON; it runs after every repeat and every engine's outputs, so a run
    cut off keeps what it measured."""

    def __init__(self, setup: Setup, disk_dir: str, clock: Clock, cuda: bool) -> None:
        self.s = setup
        self.disk_dir = disk_dir
        self.clock = clock
        self.cuda = cuda
        self.runs: list[dict[str, Any]] = []
        self.outputs: dict[int, dict[str, list[int]]] = {n: {} for n in setup.prefixes}
        self.logprobs: dict[int, dict[str, list[dict[str, float]]]] = {
            n: {} for n in setup.prefixes
        }
        self.ttft_alone: dict[int, dict[str, float]] = {n: {} for n in setup.prefixes}
        self.engines: dict[str, dict[str, Any]] = {}
        self.notes: list[str] = []
        self.dd: dict[int, dict[str, Any]] = {}
        self.facts: dict[str, Any] = {}
        self.spawned: dict[str, EngineProcess] = {}
        self._kw: dict[str, dict[str, Any]] = {}  # each label's spawn arguments
        self.save: Callable[[bool], None] = lambda complete: None

    # ----------------------------------------------------------- engines

    def spawn(self, label: str, **kw: Any) -> None:
        """A child process for engine ``label`` (importing vLLM while the
        others do; :meth:`_start` builds its engine)."""
        self._kw[label] = dict(kw)
        if self.cuda:
            # The KV cache is sized explicitly (make_llm), so vLLM's
            # gpu_memory_utilization is only its start's check that this
            # share of the GPU is free: with two engines alive, each must
            # pass it beside the other (an offloading engine takes ~26 GB
            # of an H100's 80; the baseline, alone, ~43 with 3 repeats of 8k
            # and 32k: its KV cache holds every repeat's fresh prefixes).
            kw["engine_kw"] = {"gpu_memory_utilization": 0.45}
        self.spawned[label] = EngineProcess(
            label, self.s, self.disk_dir, self.clock, **kw
        )

    def wait_facts(self) -> None:
        """The torch and vLLM of the first child that says."""
        for proc in self.spawned.values():
            try:
                self.facts = dict(proc.facts)
                return
            except Exception as exc:  # noqa: BLE001 - its stage says so
                self.notes.append(f"{proc.label}: {exc!r}")

    def _start(self, label: str) -> EngineProcess:
        """Build engine ``label`` and serve its prefixes once; its process
        is ended if that fails."""
        proc = self.spawned[label]
        try:
            info = proc.call("start")
            self.engines[label] = {
                "import_s": proc.facts["import_s"],
                **info,
            }
        except BaseException:
            self._close(label)
            raise
        return proc

    def _close(self, label: str) -> None:
        proc = self.spawned.pop(label, None)
        if proc is not None:
            proc.close()
            self.notes.extend(proc.notes)

    def release(self, everything: bool = False) -> None:
        """End the processes whose engine was started and is still up (a
        failed stage's), or with ``everything`` every one still running."""
        for label in list(self.spawned):
            if everything or label in self.engines:
                self.spawned[label].kill()
                self._close(label)

    def _gather(self, label: str) -> None:
        """The engine's outputs served alone, and what it reports."""
        proc = self.spawned[label]
        for n, by_source in proc.call("outputs").items():
            for source, (ttft, tokens, logprobs) in by_source.items():
                # The first engine to serve a source gives all three (the
                # GPU cache: kvtier's; the baseline's is gpu_cache_baseline).
                self.outputs[int(n)].setdefault(source, tokens)
                self.logprobs[int(n)].setdefault(source, logprobs)
                self.ttft_alone[int(n)].setdefault(source, ttft)
        end = proc.call("finish")
        self.engines[label].update(end["engine"])
        for n, result in end["dd"].items():
            self.dd[int(n)] = result
        self.save(False)

    def _repeats(self, label: str, reserve_s: float):
        """The repeats to run: each, while the previous one's time and
        ``reserve_s`` (the later stages') still fit the budget; the JSON is
        saved after each."""
        per_repeat = None
        for r in range(self.s.repeats):
            if per_repeat is not None and self.clock.left() < per_repeat + reserve_s:
                self.notes.append(f"{label}: stopped after {r} repeats (budget)")
                return
            t_r = time.monotonic()
            yield r
            per_repeat = time.monotonic() - t_r
            self.save(False)

    def _interleave(
        self,
        labels: list[str],
        plan: list[tuple[str, str]],
        stage: str,
        reserve_s: float,
    ) -> list[str]:
        """Start the engines ``labels`` (one after the other: vLLM's start
        checks the GPU memory free beside the engines already up), run
        ``plan``'s ``(engine, source)`` pairs for every prefix and repeat,
        the order alternating every repeat, then gather each engine's
        outputs. An engine that fails is noted and ended, the others go on.
        Returns the errors, each once."""
        s = self.s
        up: list[str] = []
        errors: list[str] = []
        for label in labels:
            try:
                self._start(label)
                up.append(label)
            except Exception as exc:  # noqa: BLE001 - the others go on
                errors.append(f"{label}: failed to start: {exc!r}")
        try:
            for r in self._repeats(stage, reserve_s) if up else ():
                for n in s.prefixes if r % 2 == 0 else s.prefixes[::-1]:
                    for label, source in plan if r % 2 == 0 else plan[::-1]:
                        if label not in up:
                            continue
                        try:
                            self.runs += self.spawned[label].call(
                                "measure", source, n, r
                            )
                        except Exception as exc:  # noqa: BLE001 - the others go on
                            errors.append(f"{label}: {source} {n}: {exc!r}")
                            up.remove(label)
                            self._close(label)
            for label in list(up):
                try:
                    self._gather(label)
                except Exception as exc:  # noqa: BLE001 - the others go on
                    errors.append(f"{label}: {exc!r}")
        finally:
            for label in up:
                self._close(label)
        return errors

    # ------------------------------------------------------------ stages

    def offloading(self, reserve_s: float) -> None:
        """kvtier's engine and vLLM's CPU offloading engine, alive together
        in two processes, their sources interleaved run by run: the
        machine's drift between engines (on the H100 the same decoders
        stepped in 25 ms in one engine and 38-43 ms in the next) falls on
        both alike. If one of them cannot start beside the other (a GPU in
        exclusive-process mode, too little memory), it runs alone after
        the other ended, noted as not interleaved."""
        plan = [
            ("kvtier", "kvtier_cpu"),
            ("vllm_cpu_offload", "vllm_cpu_offload"),
            ("kvtier", "kvtier_disk"),
            ("kvtier", "dd_beside"),
        ]
        labels = [
            label for label in ("kvtier", "vllm_cpu_offload") if label in self.spawned
        ]
        if "vllm_cpu_offload" not in labels:
            self.notes.append(
                "vllm_cpu_offload: vLLM's CPUOffloadingSpec runs on CUDA/XPU only"
            )
        errors = self._interleave(labels, plan, "offloading", reserve_s)
        unstarted = [
            label
            for label in labels
            if any(e.startswith(f"{label}: failed to start") for e in errors)
        ]
        if len(unstarted) == 1 and len(labels) == 2:
            # Respawned: a failed start ended its process.
            label = unstarted[0]
            kw = self._kw[label]
            self.spawn(label, **kw)
            self.notes.append(
                f"{label}: ran alone after the other engine (not interleaved)"
            )
            errors += self._interleave([label], plan, f"{label} alone", reserve_s)
        if errors:
            raise RuntimeError("\n".join(errors))

    def baseline(self, reserve_s: float) -> None:
        """An engine without a connector: the GPU prefix cache and
        recompute, interleaved."""
        plan = [("baseline", "gpu_cache"), ("baseline", "recompute")]
        errors = self._interleave(["baseline"], plan, "baseline", reserve_s)
        if errors:
            raise RuntimeError("\n".join(errors))

    def variant(self, read_process: str, reserve_s: float) -> None:
        """A further kvtier engine, ``disk_read_process`` set to
        ``read_process``, serving the disk source only."""
        label = f"kvtier[{read_process}]"
        plan = [(label, f"kvtier_disk[{read_process}]")]
        errors = self._interleave([label], plan, label, reserve_s)
        if errors:
            raise RuntimeError("\n".join(errors))

    # -------------------------------------------------------------- JSON

    def result(self, device: str, complete: bool) -> dict[str, Any]:
        """The JSON document of what was measured so far (see the module
        doc); ``complete``: every stage ran to its end."""
        s = self.s
        runs = self.runs
        ttft: dict[str, list[float | None]] = {}
        itl: dict[str, dict[str, list[float | None]]] = {}
        itl_loading: dict[str, dict[str, list[float | None]]] = {}
        extra = sorted({r["source"] for r in runs} - set(SOURCES))
        for source in (*SOURCES, *extra):
            ttft[source] = []
            itl[source] = {"p50": [], "max": []}
            for n in s.prefixes:
                mine = [r for r in runs if r["source"] == source and r["prefix"] == n]
                ttft[source].append(
                    statistics.median(r["ttft_s"] for r in mine) if mine else None
                )
                window = [x for r in mine for x in r["itl_ms"]]
                itl[source]["p50"].append(_p50(window) if window else None)
                itl[source]["max"].append(max(window) if window else None)
                loading = [x for r in mine for x in r.get("itl_loading_ms") or []]
                if any(r.get("itl_loading_ms") is not None for r in mine):
                    by = itl_loading.setdefault(
                        source,
                        {
                            "p50": [None] * len(s.prefixes),
                            "max": [None] * len(s.prefixes),
                        },
                    )
                    i = s.prefixes.index(n)
                    by["p50"][i] = _p50(loading) if loading else None
                    by["max"][i] = max(loading) if loading else None
        over: dict[str, list[float | None]] = {}
        for source in {
            r["source"] for r in runs if r.get("over_gpu_cache_s") is not None
        }:
            over[source] = []
            for n in s.prefixes:
                xs = [
                    r["over_gpu_cache_s"]
                    for r in runs
                    if r["source"] == source
                    and r["prefix"] == n
                    and r.get("over_gpu_cache_s") is not None
                ]
                over[source].append(statistics.median(xs) if xs else None)
        # Nothing loading: the decoders of kvtier's engine before each prompt.
        itl["no_load"] = {"p50": [], "max": []}
        for n in s.prefixes:
            quiet = [
                x
                for r in runs
                if r["prefix"] == n and r["source"] in ("kvtier_cpu", "kvtier_disk")
                for x in r["itl_no_load_ms"]
            ] or [x for r in runs if r["prefix"] == n for x in r["itl_no_load_ms"]]
            itl["no_load"]["p50"].append(_p50(quiet) if quiet else None)
            itl["no_load"]["max"].append(max(quiet) if quiet else None)
        disk_gbps, dd_gbps = [], []
        for n in s.prefixes:
            loads = [
                r["load"]["gbps"]
                for r in runs
                if r["source"] == "kvtier_disk" and r["prefix"] == n and r["load"]
            ]
            disk_gbps.append(statistics.median(loads) if loads else None)
            dd_gbps.append(self.dd.get(n, {}).get("gbps"))
        # Where each loading source's TTFT went: median per phase and length.
        phases: dict[str, dict[str, dict[str, Any]]] = {}
        for r in runs:
            if r["phases_ms"]:
                by_n = phases.setdefault(r["source"], {}).setdefault(
                    str(r["prefix"]), {}
                )
                for k, v in r["phases_ms"].items():
                    by_n.setdefault(k, []).append(v)
        phases = {
            src: {
                n: {k: statistics.median(v) for k, v in ph.items()}
                for n, ph in by.items()
            }
            for src, by in phases.items()
        }
        # What the engine's threads did per step (medians over the runs):
        # ms on a CPU and waiting for one, and sleeps, per thread group.
        threads: dict[str, dict[str, dict[str, Any]]] = {}
        for r in runs:
            for window, groups in (r.get("threads") or {}).items():
                if not groups:
                    continue
                by = threads.setdefault(r["source"], {}).setdefault(
                    str(r["prefix"]), {}
                )
                for g, v in groups.items():
                    cell = by.setdefault(window, {}).setdefault(g, {})
                    cell.setdefault("cpu_ms", []).append(1e3 * v["cpu_s"])
                    cell.setdefault("runqueue_ms", []).append(1e3 * v["runqueue_s"])
                    cell.setdefault("sleeps", []).append(v["voluntary_switches"])
        for by in threads.values():
            for windows in by.values():
                for groups in windows.values():
                    for g, cell in groups.items():
                        groups[g] = {k: statistics.median(x) for k, x in cell.items()}
        equal, recompute_equal, logprobs_equal = True, True, True
        for n in s.prefixes:
            outs, lps = self.outputs[n], self.logprobs[n]
            names = [k for k in (*REUSE, *extra, "gpu_cache_baseline") if k in outs]
            reuse = [outs[k] for k in names]
            equal &= len(reuse) >= 2 and all(o == reuse[0] for o in reuse)
            if "recompute" in outs and reuse:
                recompute_equal &= outs["recompute"] == reuse[0]
            same = [lps[k] for k in names if k in lps]
            logprobs_equal &= len(same) >= 2 and all(x == same[0] for x in same)
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
            "ttft_over_gpu_cache_s": dict(sorted(over.items())),
            "ttft_alone_s": {str(n): v for n, v in self.ttft_alone.items()},
            "ttft_phases_ms": phases,
            "threads_per_step": threads,
            "disk_gbps": disk_gbps,
            "dd_gbps": dd_gbps,
            "dd": {str(n): v for n, v in self.dd.items()},
            "itl_ms": itl,
            "itl_loading_ms": itl_loading,
            "goals": _goals(
                s.prefixes, ttft, disk_gbps, dd_gbps, itl_loading, runs, equal
            ),
            "outputs_equal": equal,
            "recompute_equal": recompute_equal,
            "logprobs_equal": logprobs_equal,
            "outputs": {str(n): v for n, v in self.outputs.items()},
            "logprobs": {str(n): v for n, v in self.logprobs.items()},
            "engines": self.engines,
            "runs": runs,
            "notes": self.notes,
        }


def _goals(
    prefixes: list[int],
    ttft: dict[str, list[float | None]],
    disk_gbps: list[float | None],
    dd_gbps: list[float | None],
    itl_loading: dict[str, dict[str, list[float | None]]],
    runs: list[dict[str, Any]],
    equal: bool,
) -> dict[str, Any]:
    """The issue's four goals as measured; a ``*_met`` is None where a
    figure is missing. kvtier's CPU-tier TTFT over vLLM's CPU offloading's
    (<= 1.05 at every length); the disk tier's load rate over dd's
    (>= 0.8); per disk source, the decoders' longest inter-token latency
    while the longest prefix loaded (the steps begun before its load was
    reported) over their p50 with nothing loading in the same runs (<= 2;
    ``itl_met`` is a dict, one verdict per disk source: the main engine's
    and each ``--disk-read-process`` variant's; ``dd_beside``'s ratio sits
    beside them, the drive's own share, with no verdict); outputs equal."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    def met(xs: list[float | None], ok: Callable[[float], bool]) -> bool | None:
        if not xs or any(x is None for x in xs):
            return None
        return all(ok(x) for x in xs)  # type: ignore[arg-type]

    cpu = [ratio(a, b) for a, b in zip(ttft["kvtier_cpu"], ttft["vllm_cpu_offload"])]
    disk = [ratio(a, b) for a, b in zip(disk_gbps, dd_gbps)]
    longest = max(prefixes)
    itl: dict[str, float | None] = {}
    for source, by in itl_loading.items():
        if not source.startswith("kvtier_disk") and source != "dd_beside":
            continue
        quiet = [
            x
            for r in runs
            if r["source"] == source and r["prefix"] == longest
            for x in r["itl_no_load_ms"]
        ]
        at = by["max"][prefixes.index(longest)]
        itl[source] = ratio(at, _p50(quiet) if quiet else None)
    return {
        "prefix_tokens": prefixes,
        "kvtier_cpu_over_vllm_ttft": cpu,
        "kvtier_cpu_met": met(cpu, lambda x: x <= 1.05),
        "disk_over_dd": disk,
        "disk_met": met(disk, lambda x: x >= 0.8),
        "loading_itl_max_over_no_load_p50": itl,
        "itl_met": {
            k: met([v], lambda x: x <= 2.0)
            for k, v in itl.items()
            if k.startswith("kvtier_disk")
        },
        "outputs_equal": equal,
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
    deadline, a CUDA error) is noted with its error, ``release`` ends what
    its engines left running (a process still holding GPU memory would
    leave the next engine's start too little), and the next stage still
    runs: a lent GPU's minutes are not spent again for the stages that would
    have worked. A stage with less than ``min_left_s`` of the budget left is
    noted and not started. The last save is ``complete`` only if
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
            for line in str(exc).splitlines() or [""]:
                notes.append(f"{label}: failed: {type(exc).__name__}: {line}")
            failed.append(label)
            release()
        save(False)
    save(not failed and not skipped)
    return failed


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _reader():
    """The in-process worker's reader of disk hits."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().connector_worker.worker.reader


def _fs(path: str) -> str | None:
    from benchmarks._common import filesystem_of

    return filesystem_of(path)


def _shm_free() -> int:
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return 0


def _device_name() -> str:
    """The GPU's name as ``nvidia-smi`` reports it (as torch would), read
    without a CUDA context in this process; ``cuda`` if it cannot say."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        name = out.stdout.strip().splitlines()[0] if out.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired, IndexError):
        name = ""
    return name or "cuda"


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
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the children's
    import torch

    tmp = tempfile.mkdtemp(prefix="kvtier-real-")
    try:
        if args.tiny:
            setup = Setup.tiny_llama(
                args.prefix_tokens or [256, 1024],
                args.repeats,
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
            from kvtier.testing.model import LLAMA_31_8B_CONFIG

            Path(model_dir, "config.json").write_text(
                json.dumps(LLAMA_31_8B_CONFIG, indent=1)
            )
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
        disk_dir = args.disk_dir or os.path.join(tmp, "disk")
        os.makedirs(disk_dir, exist_ok=True)
        per_token = setup.geometry["kv_bytes_per_token"]
        # The same CPU bytes for kvtier and vLLM: every prefix, a quarter more
        # (their tails, the decoders' prompts), within /dev/shm (both keep
        # the CPU tier there, and on CUDA both engines are alive at once).
        cuda = not args.tiny
        want = int(1.25 * sum(setup.prefixes) * per_token) + (64 << 20)
        shm = _shm_free()
        share = 0.4 if cuda else 0.8
        cpu_bytes = min(want, int(share * shm)) if shm else want
        bench = Bench(setup, disk_dir, clock, cuda)
        if cpu_bytes < want:
            bench.notes.append(
                f"/dev/shm has {shm} bytes free: CPU tiers of {cpu_bytes} bytes, "
                f"not {want} (the longest prefixes may not fit the CPU tier)"
            )
        print(
            f"{setup.geometry}, prefixes {setup.prefixes}, repeats "
            f"{setup.repeats}, CPU bytes {cpu_bytes}, disk {disk_dir} ({_fs(disk_dir)})",
            flush=True,
        )

        device = _device_name() if cuda else "cpu"

        def path() -> Path:
            if args.out:
                return Path(args.out)
            name = f"gpu_real_size_{_slug(device) if cuda else 'cpu-tiny'}"
            return Path(args.out_dir) / f"{name}.json"

        def save(complete: bool) -> None:
            doc = bench.result(device, complete)
            doc["budget_s"] = args.budget_s
            doc["elapsed_s"] = args.budget_s - clock.left()
            doc["when"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            doc["torch"] = bench.facts.get("torch")
            doc["vllm"] = bench.facts.get("vllm")
            out = path()
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=1) + "\n")

        bench.save = save
        # Every engine's process now: their imports of vLLM overlap.
        bench.spawn(
            "kvtier",
            kind="kvtier",
            cpu_bytes=cpu_bytes,
            read_process=setup.disk_read_process[0],
        )
        if cuda:  # vLLM's CPUOffloadingSpec: CUDA/XPU only
            bench.spawn(
                "vllm_cpu_offload", kind="vllm_cpu_offload", cpu_bytes=cpu_bytes
            )
        bench.spawn("baseline", kind="baseline")
        # The A/B's further kvtier engines run last: the goals' sources
        # (kvtier, vLLM's CPU offloading, recompute) come first.
        extra = setup.disk_read_process[1:]
        for v in extra:
            bench.spawn(
                f"kvtier[{v}]",
                kind="kvtier",
                cpu_bytes=cpu_bytes,
                read_process=v,
                variant=True,
            )
        bench.wait_facts()
        # What a later stage needs at least (its engine's start and
        # warm-up, one repeat, its outputs; its process already imported).
        reserve = 50.0 if not args.tiny else 10.0
        variants = [
            (
                f"kvtier[{v}]",
                lambda v=v, i=i: bench.variant(v, (len(extra) - 1 - i) * reserve + 5.0),
            )
            for i, v in enumerate(extra)
        ]
        try:
            failed = run_stages(
                [
                    (
                        "offloading",
                        lambda: bench.offloading((1 + len(extra)) * reserve),
                    ),
                    ("baseline", lambda: bench.baseline(len(extra) * reserve + 5.0)),
                    *variants,
                ],
                clock,
                reserve / 2,
                bench.notes,
                save,
                bench.release,
            )
        finally:
            bench.release(everything=True)
        doc = json.loads(path().read_text())
        _print_table(doc)
        print(f"wrote {path()}")
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
    for label, table in (("", doc["itl_ms"]), ("loading ", doc["itl_loading_ms"])):
        for source, v in table.items():
            cells = [
                f"{f(a, fmt='{:.1f}')}/{f(b, fmt='{:.1f}')}"
                for a, b in zip(v["p50"], v["max"])
            ]
            name = f"{label}{source}"
            print(f"{name:>16} | " + " | ".join(f"{c:>17}" for c in cells))
    print(f"disk GB/s {doc['disk_gbps']}  dd O_DIRECT GB/s {doc['dd_gbps']}")
    print(
        f"outputs equal (reuse): {doc['outputs_equal']}; top logprobs equal: "
        f"{doc['logprobs_equal']}; recompute equal: {doc['recompute_equal']}"
    )
    print("goals:", json.dumps(doc["goals"]))
    for note in doc["notes"]:
        print("note:", note)


if __name__ == "__main__":
    sys.exit(main())
