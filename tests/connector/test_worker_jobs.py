"""A job is done only when every one of its transfers landed.

On accelerators a worker job is several asynchronous transfers (one per
KV-cache group and host area, and one per bounce-area chunk of a disk
load). This drives the real spec's manager and worker (real disk tier, real
files) with the copy path swapped for one that lands transfers late, as a
GPU's streams would: one per poll, or when waited on. The worker must not
report a job before all of its transfers landed, must wait for transfers
still reading the bounce area before the next disk read overwrites it (also
across jobs), and its ``wait`` must land a job's transfers."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext  # noqa: E402

from kvtier.io.block_copy import HostCopies  # noqa: E402
from kvtier.testing.offloading import tiered_spec  # noqa: E402
from tests.connector.test_request_runner import (  # noqa: E402
    RequestRunner,
    make_config,
    push_to_disk,
)


class LateCopies:
    """The CPU copy path, landing each transfer late: ``poll`` lands the
    oldest one per call (none on the first call after a submit) and reports
    what landed, ``wait`` lands the given ones (and, in order, those queued
    before them), as CUDA streams and events would."""

    synchronous = False

    def __init__(self, inner: HostCopies):
        self.inner = inner
        self.queued: OrderedDict[int, tuple] = OrderedDict()
        self.next_id = 0
        self.fresh = False
        self.landed: list[int] = []
        self.unreported: list[int] = []

    def submit(self, area, group, plan, to_host, expedited=False):
        self.next_id += 1
        self.queued[self.next_id] = (area, group, plan, to_host)
        self.fresh = True
        return self.next_id

    def _land(self, transfer: int) -> None:
        self.inner.submit(*self.queued.pop(transfer))
        self.landed.append(transfer)
        self.unreported.append(transfer)

    def poll(self) -> dict[int, float]:
        if not self.fresh and self.queued:
            self._land(next(iter(self.queued)))
        self.fresh = False
        done, self.unreported = self.unreported, []
        return {transfer: 0.001 for transfer in done}

    def wait(self, transfers: set[int]) -> None:
        if not transfers & set(self.queued):
            return
        last = max(transfers & set(self.queued))
        for transfer in [t for t in self.queued if t <= last]:
            self._land(transfer)

    def shutdown(self) -> None:
        for transfer in list(self.queued):
            self._land(transfer)
        self.inner.shutdown()


@pytest.fixture
def runner(tmp_path):
    r = RequestRunner(tiered_spec(make_config(tmp_path, cpu_blocks=8, disk_blocks=32)))
    r.worker.copies = LateCopies(r.worker.copies)
    yield r
    r.close()


def _submit_disk_load(r: RequestRunner, name: str, keys, gpu_blocks, job_id: int):
    assert r.lookup(name, keys) == len(keys)
    ctx = r.ctx
    spec = r.manager.prepare_load(keys, ctx)
    assert spec.on_disk.all()
    for t in r.kv:
        t[gpu_blocks] = 0
    dst = GPULoadStoreSpec(gpu_blocks, [len(gpu_blocks)], [0])
    assert r.worker.submit_load(job_id, spec, dst)
    return ctx


def _finish(r: RequestRunner, keys, gpu_blocks, ctx: ReqContext) -> None:
    r.manager.complete_load(keys, ctx)
    r.manager.on_request_finished(ctx)
    for key, b in zip(keys, gpu_blocks):
        for layer, t in enumerate(r.kv):
            assert torch.equal(t[b], r.truth[key][layer]), (key.hex(), layer)


def test_a_job_is_reported_only_when_every_transfer_landed(runner):
    r = runner
    late, r.worker.copies = r.worker.copies, r.worker.copies.inner
    keys = push_to_disk(r, [1, 2, 3, 4])
    r.worker.copies = late
    # Two bounce halves of one slot: four chunks, four transfers. The third
    # and fourth reads reuse a half, so they waited for transfers 1 and 2.
    r.worker.reader.capacity = 2
    ctx = _submit_disk_load(r, "a", keys, [40, 41, 42, 43], job_id=7)
    assert late.landed == [1, 2] and list(late.queued) == [3, 4]
    assert r.worker.get_finished() == []  # transfers 3 and 4 still in flight
    assert not any(t[[42, 43]].any() for t in r.kv)
    assert r.worker.get_finished() == []  # transfer 4 still in flight
    assert not any(t[43].any() for t in r.kv)
    done = r.worker.get_finished()
    assert [(d.job_id, d.success) for d in done] == [(7, True)]
    assert done[0].transfer_size == 4 * r.worker.block_bytes[0]
    _finish(r, keys, [40, 41, 42, 43], ctx)


def test_the_next_disk_read_waits_for_copies_still_reading_the_bounce_area(runner):
    r = runner
    late, r.worker.copies = r.worker.copies, r.worker.copies.inner
    first = push_to_disk(r, [1, 2], others="bcdef")
    second, third = r.keys("b", 4)[:2], r.keys("c", 4)[:2]
    on_disk = [r.manager.hierarchy.lookup(k).name for k in second + third]
    assert on_disk == ["HIT_DISK"] * 4
    r.worker.reader.capacity = 4  # two halves of two slots
    r.worker.copies = late
    ctx_a = _submit_disk_load(r, "a", first, [40, 41], job_id=1)
    assert list(late.queued) == [1]  # job 1's copy has not left its half
    # Job 2 reads into the other half while job 1's copy is in flight.
    ctx_b = _submit_disk_load(r, "b", second, [44, 45], job_id=2)
    assert late.landed == [] and list(late.queued) == [1, 2]
    # Job 3 would overwrite job 1's half: job 1's copy landed first, and
    # only it (job 2's copy reads the other half).
    ctx_c = _submit_disk_load(r, "c", third, [48, 49], job_id=3)
    assert late.landed == [1] and list(late.queued) == [2, 3]
    assert sorted(d.job_id for d in r.worker.get_finished()) == [1]
    r.worker.wait({2, 3})
    assert sorted(d.job_id for d in r.worker.get_finished()) == [2, 3]
    _finish(r, first, [40, 41], ctx_a)
    _finish(r, second, [44, 45], ctx_b)
    _finish(r, third, [48, 49], ctx_c)


def test_wait_lands_a_store(runner):
    r = runner
    keys = r.keys("s", 2)
    ctx = ReqContext(req_id="s")
    r.manager.on_new_request(ctx)
    out = r.manager.prepare_store(keys, ctx)
    src = GPULoadStoreSpec([5, 6], [2], [0])
    assert r.worker.submit_store(3, src, out.store_spec)
    rows = list(out.store_spec.block_ids)
    cpu = r.worker.cpu_buffer.array
    assert not cpu[rows].any()
    r.worker.wait({3})
    for row, b in zip(rows, [5, 6]):
        want = b"".join(bytes(t[b].numpy()) for t in r.kv)
        assert bytes(cpu[row][: len(want)]) == want
    assert [d.job_id for d in r.worker.get_finished()] == [3]
    r.manager.complete_store(out.keys_to_store, ctx)
    r.manager.on_request_finished(ctx)
