"""kvtier's connector worker under vLLM's own ``start_kv_transfers``.

vLLM 0.33 added synchronous loads: a ``TransferJob`` with ``sync=True`` is
submitted with ``expedited=True`` and waited on within the step, and vLLM
records it in ``_load_jobs`` with no request (``None``), so it never shows
in ``finished_recving``. kvtier must still count it as a load, and report a
failed disk block of it block level, with the request's failed keys for the
manager. A failed store (an exception the worker contained) travels to the
scheduler as its CPU rows, which vLLM itself has no way to say. These tests drive vLLM's real worker-side code with a fake
``OffloadingWorker``; test_vllm_next.py runs them against vLLM 0.33 (where
the sync cases must run), ``make test`` against the venv's 0.32.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, TransferResult  # noqa: E402

from kvtier.connector.compat import SYNC_LOADS  # noqa: E402
from kvtier.connector.connector import (  # noqa: E402
    KvtierConnectorWorker,
    KvtierWorkerMetadata,
)
from kvtier.connector.load_store_specs import CpuTierSpec  # noqa: E402
from kvtier.connector.worker.jobs import LoadError  # noqa: E402
from kvtier.connector.worker_report import WorkerCounters, WorkerReport  # noqa: E402

needs_sync_loads = pytest.mark.skipif(
    not SYNC_LOADS and not os.environ.get("KVTIER_EXPECT_VLLM"),
    reason="vLLM < 0.33 has no synchronous loads",
)


class FakeWorker:
    """Completes every job at submission; fails the loads in ``fail``."""

    def __init__(
        self,
        fail: dict[int, LoadError] | None = None,
        failed_stores: dict[int, list[int]] | None = None,
    ):
        self.fail = dict(fail or {})
        self.failed_stores = dict(failed_stores or {})
        self.loads: list[tuple[int, bool]] = []  # (job_id, expedited)
        self.stores: list[int] = []  # job ids submitted
        self.waited: list[set[int]] = []
        self.given_up: list[list[int]] = []
        self.calls: list[str] = []
        self._done: list[TransferResult] = []
        self._errors: dict[int, LoadError] = {}

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self.stores.append(job_id)
        ok = job_id not in self.failed_stores
        self._done.append(TransferResult(job_id, ok, 100, 0.5))
        return True

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        self.loads.append((job_id, expedited))
        error = self.fail.pop(job_id, None)
        if error is not None:
            self._errors[job_id] = error
        self._done.append(TransferResult(job_id, error is None, 200, 0.25))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        self.waited.append(set(job_ids))
        self.calls.append("wait")

    def give_up_loads(self, job_ids: Any) -> None:
        self.given_up.append(sorted(job_ids))
        self.calls.append("give_up_loads")

    def take_load_error(self, job_id: int) -> LoadError | None:
        return self._errors.pop(job_id, None)

    def take_store_error(self, job_id: int) -> list[int] | None:
        return self.failed_stores.pop(job_id, None)


def _worker(
    fake: FakeWorker, batches_in_flight: int | None = None
) -> KvtierConnectorWorker:
    spec = SimpleNamespace(
        replicated_layout=False,
        config=SimpleNamespace(
            canonical_layout=False, parallel=SimpleNamespace(rank=0)
        ),
    )
    # vllm_config.max_concurrent_batches: 2 under async scheduling.
    vllm_config = (
        None
        if batches_in_flight is None
        else SimpleNamespace(max_concurrent_batches=batches_in_flight)
    )
    worker = KvtierConnectorWorker(spec, vllm_config, None)
    worker.worker = fake  # type: ignore[assignment]
    return worker


def _load(req_id: str, blocks: list[int], sync: bool = False) -> TransferJob:
    kwargs = {"sync": True} if sync else {}
    return TransferJob(
        req_id=req_id,
        src_spec=CpuTierSpec(list(range(len(blocks)))),
        dst_spec=GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0]),
        **kwargs,
    )


def _run(worker: KvtierConnectorWorker, loads: dict[int, TransferJob]):
    worker.start_kv_transfers(
        OffloadingConnectorMetadata(load_jobs=loads, store_jobs={}, jobs_to_flush=set())
    )
    sending, recving = worker.get_finished(set())
    meta = worker.build_connector_worker_meta()
    return sending, recving, worker.take_load_errors(), meta


def test_failed_async_load_is_reported_per_request_and_block() -> None:
    fake = FakeWorker({1: LoadError(corrupt=[b"k1"], gpu_block_ids={6})})
    worker = _worker(fake)
    sending, recving, errors, meta = _run(
        worker, {1: _load("r1", [5, 6]), 2: _load("r2", [7])}
    )
    assert fake.loads == [(1, False), (2, False)]
    assert fake.waited == []
    assert sending == set() and recving == {"r1", "r2"}
    assert errors == ({"r1"}, {6}, set())
    assert meta is not None and meta.report.corrupt_keys == {"r1": [b"k1"]}
    assert meta.completed_jobs == {1: 1, 2: 1}
    assert meta.transfer_stats.load.bytes == 400
    assert meta.transfer_stats.store.bytes == 0


def test_a_failed_store_travels_to_the_scheduler_as_its_rows() -> None:
    fake = FakeWorker(failed_stores={3: [4, 5]})
    fake.exceptions = SimpleNamespace(count=1)  # the worker contained one
    worker = _worker(fake)
    store = TransferJob(
        req_id="s",
        src_spec=GPULoadStoreSpec([1, 2], group_sizes=[2], block_indices=[0]),
        dst_spec=CpuTierSpec([4, 5]),
    )
    worker.prepare_store_kv(
        OffloadingConnectorMetadata(load_jobs={}, store_jobs={3: store})
    )
    sending, recving, errors, meta = _run(worker, {})  # submits it: no raise
    assert (sending, recving, errors) == (set(), set(), (set(), set(), set()))
    assert meta is not None and meta.completed_jobs == {3: 1}
    report = meta.report
    assert report.failed_store_rows == [4, 5] and report.corrupt_keys == {}
    assert report.counters.exceptions == 1
    # Every rank reports its rows; the scheduler gets them all.
    other = KvtierWorkerMetadata(
        completed_jobs={3: 1},
        report=WorkerReport(
            failed_store_rows=[4, 5], counters=WorkerCounters(exceptions=1)
        ),
    )
    merged = meta.aggregate(other)
    assert merged.completed_jobs == {3: 2} and merged.report.counters.exceptions == 2
    assert sorted(merged.report.failed_store_rows) == [4, 4, 5, 5]


def test_a_failed_store_with_no_rows_to_report_is_a_bug() -> None:
    fake = FakeWorker()
    worker = _worker(fake)
    fake._done.append(TransferResult(9, False, 0, 0.0))
    with pytest.raises(RuntimeError, match="store job 9 failed"):
        worker.get_finished(set())


def test_the_scheduler_refuses_failed_stores_a_manager_cannot_take() -> None:
    from kvtier.connector.connector import TieredOffloadingConnector

    reports: list[tuple] = []
    conn = TieredOffloadingConnector.__new__(TieredOffloadingConnector)
    inner = SimpleNamespace(update_connector_output=lambda out: reports.append(out))
    conn.connector_scheduler = inner
    meta = KvtierWorkerMetadata(
        completed_jobs={3: 1}, report=WorkerReport(failed_store_rows=[4, 5])
    )
    output = SimpleNamespace(kv_connector_worker_meta=meta)

    def note_worker_report(report):
        reports.append((report.corrupt_keys, report.failed_store_rows))
        assert report.counters.exceptions == 0

    inner.manager = SimpleNamespace(note_worker_report=note_worker_report)
    conn.update_connector_output(output)
    assert reports == [({}, [4, 5]), output]  # told before vLLM completes it
    # A manager that cannot be told (vLLM's own, tiering mode) would
    # complete the store as a success: stop instead.
    inner.manager = SimpleNamespace()
    with pytest.raises(RuntimeError, match="store failed"):
        conn.update_connector_output(output)
    assert reports == [({}, [4, 5]), output]


@needs_sync_loads
def test_sync_load_counts_as_a_load_without_finished_recving() -> None:
    assert SYNC_LOADS, "vLLM >= 0.33 expected to have TransferJob.sync"
    fake = FakeWorker()
    worker = _worker(fake)
    _, recving, errors, meta = _run(
        worker, {3: _load("r3", [1, 2], sync=True), 4: _load("r4", [3])}
    )
    assert sorted(fake.loads) == [(3, True), (4, False)]
    assert fake.waited == [{3}]
    assert recving == {"r4"}  # the sync load's request is already running
    assert errors == (set(), set(), set())
    assert meta is not None and meta.completed_jobs == {3: 1, 4: 1}
    # Both are loads: none of their bytes may count as stores.
    assert meta.transfer_stats.load.bytes == 400
    assert meta.transfer_stats.store.bytes == 0
    assert worker._sync_load_reqs == {}


@needs_sync_loads
def test_failed_sync_load_is_reported_block_level_with_its_keys() -> None:
    assert SYNC_LOADS, "vLLM >= 0.33 expected to have TransferJob.sync"
    fake = FakeWorker({5: LoadError(corrupt=[b"a", b"b"], gpu_block_ids={8, 9})})
    worker = _worker(fake)
    _, recving, errors, meta = _run(worker, {5: _load("r5", [7, 8, 9], sync=True)})
    assert recving == set()
    # Never request level: the request is not waiting for its KV.
    assert errors == (set(), set(), {8, 9})
    assert meta is not None and meta.report.corrupt_keys == {"r5": [b"a", b"b"]}
    assert meta.completed_jobs == {5: 1}


@needs_sync_loads
@pytest.mark.parametrize("request_level", [False, True], ids=["1-group", "n-groups"])
def test_connector_reports_sync_failures_block_level(request_level: bool) -> None:
    from kvtier.connector.connector import TieredOffloadingConnector

    fake = FakeWorker(
        {
            1: LoadError(corrupt=[b"x"], gpu_block_ids={2}),
            2: LoadError(corrupt=[b"y"], gpu_block_ids={5}),
        }
    )
    worker = _worker(fake)
    meta = OffloadingConnectorMetadata(
        load_jobs={1: _load("async", [1, 2]), 2: _load("sync", [4, 5], sync=True)},
        store_jobs={},
        jobs_to_flush=set(),
    )
    worker.start_kv_transfers(meta)
    # The connector as vLLM built it, minus the engine: only what
    # get_transfer_results reads.
    conn = TieredOffloadingConnector.__new__(TieredOffloadingConnector)
    conn.connector_worker = worker
    conn._connector_metadata = meta
    conn._request_level_errors = request_level
    conn._invalid_block_ids = set()
    results = conn.get_transfer_results(set())
    assert results.finished_recving == {"async"}
    if request_level:
        assert results.failed_recving == {"async"}
        assert conn.get_block_ids_with_load_errors() == {5}
    else:
        assert results.failed_recving == set()
        assert conn.get_block_ids_with_load_errors() == {2, 5}
    assert conn.get_block_ids_with_load_errors() == set()


def _store(req_id: str, gpu_blocks: list[int], rows: list[int]) -> TransferJob:
    return TransferJob(
        req_id=req_id,
        src_spec=GPULoadStoreSpec(
            gpu_blocks, group_sizes=[len(gpu_blocks)], block_indices=[0]
        ),
        dst_spec=CpuTierSpec(rows),
    )


@needs_sync_loads
@pytest.mark.parametrize("writer", [True, False], ids=["writer", "non-writer"])
@pytest.mark.parametrize("deferred", [False, True], ids=["finalize", "deferred"])
@pytest.mark.parametrize("sync_fails", [True, False], ids=["failed", "loaded"])
def test_a_failed_sync_load_drops_the_stores_of_its_step(
    sync_fails: bool, deferred: bool, writer: bool
) -> None:
    """A step with a synchronous load also stores the chunks it computes
    (vLLM 0.33 submits them at the next step's start). When the load fails,
    those chunks were computed over its unfilled blocks: no store of the
    step may be written, and each one's CPU rows go to the scheduler as
    failed, from every rank (a non-writer's too: under tensor parallelism
    the writer's KV went through the same all-reduce)."""
    fail = {1: LoadError(corrupt=[b"h1"], gpu_block_ids={4})} if sync_fails else {}
    fake = FakeWorker(fail)
    worker = _worker(fake)
    worker._is_store_writer = writer
    step = OffloadingConnectorMetadata(
        load_jobs={1: _load("a", [3, 4], sync=True)},
        # "a" computes past its hit; "b" shares nothing but runs in the step.
        store_jobs={7: _store("a", [5, 6], [20, 21]), 8: _store("b", [9], [22])},
        jobs_to_flush=set(),
    )
    worker.start_kv_transfers(step)
    if deferred:  # speculative decoding: wait_for_save after the results
        worker.get_finished(set())
        first = worker.build_connector_worker_meta()
        worker.prepare_store_kv(step)
    else:
        worker.prepare_store_kv(step)
        worker.get_finished(set())
        first = worker.build_connector_worker_meta()
    # The next step submits what the last one left queued.
    worker.start_kv_transfers(
        OffloadingConnectorMetadata(load_jobs={}, store_jobs={}, jobs_to_flush=set())
    )
    worker.get_finished(set())
    second = worker.build_connector_worker_meta()
    metas = [m for m in (first, second) if m is not None]
    completed: dict[int, int] = {}
    rows: list[int] = []
    for m in metas:
        completed.update(m.completed_jobs)
        rows += m.report.failed_store_rows
    if sync_fails:
        assert fake.stores == []
        assert sorted(rows) == [20, 21, 22]
    else:
        assert fake.stores == ([7, 8] if writer else [])
        assert rows == []
    # Every job of the step completes exactly once, on every rank.
    assert completed == {1: 1, 7: 1, 8: 1}


@needs_sync_loads
@pytest.mark.parametrize(
    "batches_in_flight", [1, 2, 3], ids=["sync-sched", "async-sched", "pp3"]
)
def test_a_failed_sync_load_drops_the_stores_of_steps_planned_before_it_was_seen(
    batches_in_flight: int,
) -> None:
    """Under async scheduling (``max_concurrent_batches`` 2; more with
    pipeline parallelism) the scheduler plans the steps after a synchronous
    load's step before it reads that step's output: the loading request
    computes its next prefill chunk (or decodes) over the block the load
    left unfilled, and vLLM builds that chunk's store job next to it. Only
    the steps planned after the scheduler wound the request back compute
    over a refilled block. So the store jobs of the sync load's step and of
    the ``max_concurrent_batches - 1`` steps after it are never written and
    their rows go to the scheduler as failed; a later step's are written."""
    fake = FakeWorker({1: LoadError(corrupt=[b"h1"], gpu_block_ids={4})})
    worker = _worker(fake, batches_in_flight)
    steps = [
        # Step n: "a" loads [3, 4] synchronously (4 fails), computes block 5.
        ({1: _load("a", [3, 4], sync=True)}, {7: _store("a", [5], [20])}),
        # Steps planned before the failure was seen: "a" goes on over block 4.
        ({}, {8: _store("a", [6], [21])}),
        ({}, {9: _store("a", [10], [22])}),
        # Planned after: "a" recomputed from block 4.
        ({}, {}),
        ({}, {11: _store("a", [4], [23])}),
        ({}, {}),  # submits what the last one left queued
    ]
    rows: list[int] = []
    completed: dict[int, int] = {}
    for loads, stores in steps:
        step = OffloadingConnectorMetadata(
            load_jobs=loads, store_jobs=stores, jobs_to_flush=set()
        )
        worker.handle_preemptions(step)
        worker.start_kv_transfers(step)
        worker.prepare_store_kv(step)
        worker.get_finished(set())
        meta = worker.build_connector_worker_meta()
        if meta is not None:
            rows += meta.report.failed_store_rows
            for job_id, count in meta.completed_jobs.items():
                completed[job_id] = completed.get(job_id, 0) + count
    planned_blind = [7, 8, 9][:batches_in_flight]
    assert sorted(rows) == [20, 21, 22][:batches_in_flight]
    assert fake.stores == [j for j in (7, 8, 9, 11) if j not in planned_blind]
    # Every job completes exactly once.
    assert completed == {1: 1, 7: 1, 8: 1, 9: 1, 11: 1}


class _Untouchable:
    """Stands for Model Runner V2's device-side count of computed tokens:
    records every use."""

    def __init__(self) -> None:
        self.uses: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.uses.append(name)
        return lambda *args, **kwargs: None


@needs_sync_loads
def test_model_runner_v2_winds_a_running_request_back_on_the_host_only() -> None:
    """Why kvtier refuses a disk tier with synchronous loads under vLLM's
    Model Runner V2 (``compat.check_sync_load_budget``): vLLM recovers from
    a failed synchronous load by sending the running request's wound-back
    ``num_computed_tokens`` in the next step's ``scheduled_cached_reqs``, and
    V2's ``update_requests`` writes it to its host mirror only; the device
    count, from which the recompute's input tokens and positions are read,
    keeps the old offset (vllm-project/vllm#49250). Runs vLLM's own
    ``update_requests``; once it winds the device count back too, this fails
    and the refusal can be lifted for that vLLM."""
    import numpy as np

    mrv2 = pytest.importorskip("vllm.v1.worker.gpu.model_runner")
    device_count = _Untouchable()
    req_states = SimpleNamespace(
        req_id_to_index={"r": 0},
        # After the failed step: 4 blocks of 32 loaded, 69 tokens computed.
        num_computed_tokens_np=np.array([197], dtype=np.int32),
        num_computed_prefill_tokens=np.zeros(1, dtype=np.int32),
        prefill_len=SimpleNamespace(np=np.array([197], dtype=np.int32)),
        num_computed_tokens=device_count,
    )
    runner = SimpleNamespace(req_states=req_states, block_tables=None)
    # The scheduler wound the request back to its failed block (block 1).
    step = SimpleNamespace(
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["r"], num_computed_tokens=[32], new_block_ids=[None]
        ),
        new_block_ids_to_zero=None,
        kv_cache_block_copies=None,
    )
    mrv2.GPUModelRunner.update_requests(runner, step)
    assert req_states.num_computed_tokens_np.tolist() == [32]
    assert req_states.num_computed_prefill_tokens.tolist() == [32]
    assert device_count.uses == [], (
        "vLLM's Model Runner V2 now updates its device count of computed "
        f"tokens on a rewind ({device_count.uses}): kvtier's refusal of "
        "sync_load_budget_bytes with a disk tier under it "
        "(kvtier.connector.compat) may be lifted for this vLLM"
    )


def test_loads_a_connector_reset_flushes_are_given_up_before_vllm_waits() -> None:
    """vLLM flushes every job in flight at a connector reset and waits for
    them at the next step's start (``handle_preemptions``); the loads among
    them are given up first (a disk read that stalls would stall that step),
    the other flushed jobs only waited for."""
    fake = FakeWorker()
    worker = _worker(fake)
    worker.start_kv_transfers(
        OffloadingConnectorMetadata(load_jobs={1: _load("a", [3, 4])}, store_jobs={})
    )
    step = OffloadingConnectorMetadata(
        load_jobs={},
        store_jobs={7: _store("b", [5], [20])},
        jobs_to_flush={1, 7},
    )
    worker.handle_preemptions(step)
    assert fake.given_up == [[1]]
    assert fake.calls == ["give_up_loads", "wait"] and fake.waited == [{1, 7}]
    assert fake.stores == [7]
