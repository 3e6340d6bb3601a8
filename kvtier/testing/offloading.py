"""Build vLLM's ``OffloadingConfig`` outside an engine.

vLLM derives this config from a running engine's model and cache; unit
tests, benchmarks and tools that drive a spec's manager (or a worker over
host tensors) directly need one by hand. One builder keeps them in step
when vLLM's config dataclasses change.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

if TYPE_CHECKING:
    from kvtier.connector.spec import TieredOffloadingSpec


def tiered_spec(config: OffloadingConfig) -> TieredOffloadingSpec:
    """A ``TieredOffloadingSpec`` built as kvtier's connector builds it, for
    tests and tools that drive its manager and worker without an engine."""
    from kvtier.connector.spec import ConnectorFacts, TieredOffloadingSpec

    return TieredOffloadingSpec(config, ConnectorFacts())


def offloading_config(
    extra_config: Mapping[str, Any],
    *,
    worker_kv_bytes_per_block: int,
    layers: int = 2,
    tokens_per_block: int = 32,
    world_size: int = 1,
    model: str = "tiny",
    dtype: str = "float16",
    enable_kv_cache_events: bool = True,
    engine_tag: str = "kvtier",
    parallelism_agnostic: bool = True,
) -> OffloadingConfig:
    """One KV-cache group of ``layers`` layers, rank 0 of ``world_size``
    (tensor parallel), one GPU block per offloaded block, a unique engine
    id (so shared-memory CPU tiers never collide)."""
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block, tuple(f"layer.{i}" for i in range(layers)), 0
            ),
        ),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=enable_kv_cache_events,
        extra_config=dict(extra_config),
        engine_id=f"{engine_tag}-{os.getpid()}-{time.monotonic_ns()}",
        model=OffloadingModelConfig(model, dtype),
        cache=OffloadingCacheConfig(
            tokens_per_hash=tokens_per_block, blocks_per_chunk=1
        ),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=parallelism_agnostic,
        ),
    )


def wait_finished(worker: Any, count: int = 1, timeout: float = 60.0) -> list:
    """A worker's ``get_finished``, called as vLLM calls it (once a step),
    until ``count`` jobs were reported; a load completes on the worker's
    load thread, not inside ``submit_load``."""
    deadline = time.monotonic() + timeout
    done = list(worker.get_finished())
    while len(done) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} job(s) not finished in {timeout} s: {done}")
        time.sleep(0.001)
        done += worker.get_finished()
    return done


def wait_jobs(worker: Any, job_ids: set[int], timeout: float = 60.0) -> None:
    """``worker.wait(job_ids)`` (vLLM's blocking wait, which takes no
    timeout) on a thread: TimeoutError if it has not returned within
    ``timeout``, so a job that never finishes fails the test, not hangs it."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            worker.wait(job_ids)
        except BaseException as exc:  # re-raised in the caller below
            failed.append(exc)

    waiter = threading.Thread(target=run, name="wait-jobs", daemon=True)
    waiter.start()
    waiter.join(timeout)
    if waiter.is_alive():
        raise TimeoutError(f"worker.wait({sorted(job_ids)}) not back in {timeout} s")
    if failed:
        raise failed[0]
