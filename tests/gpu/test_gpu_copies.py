"""kvtier's worker on CUDA: copies through vLLM's transfer code, byte-exact.

Marked ``gpu``; skipped where CUDA (or vLLM's CUDA kernels) is absent, so
the CPU-only CI collects and skips them. Run on a GPU host with::

    python -m pytest -m gpu tests/gpu

They need vLLM's CUDA build (its ``swap_blocks_batch`` kernel) and no model:
KV caches are random tensors on the GPU, laid out as vLLM allocates them
(block-first, padded pages, tensors shared by two KV-cache groups), and the
disk tier is real slab files written by kvtier's DiskStore. Every check is
on bytes: what the CPU tier holds after a store equals what kvtier's CPU
copier produces from the same blocks (the layout the disk tier persists),
and what lands in the KV cache after a load equals what was stored.
"""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")
try:
    import vllm._C_stable_libtorch  # noqa: F401  (vLLM's CUDA kernels)
except ImportError as exc:  # pragma: no cover - depends on the host
    pytest.skip(f"needs vLLM's CUDA build: {exc}", allow_module_level=True)

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

from kvtier.connector.load_store_specs import TierLoadSpec  # noqa: E402
from kvtier.connector.worker.device_copy import DeviceCopies  # noqa: E402
from kvtier.connector.worker.kv_layout import group_views  # noqa: E402
from kvtier.connector.worker.worker import TieredOffloadingWorker  # noqa: E402
from kvtier.host.block_copy import HostArea, HostCopies, plan_copy  # noqa: E402
from kvtier.host.cpu_tier import CpuBlockBuffer  # noqa: E402
from kvtier.store.backends.factory import make_backend  # noqa: E402
from kvtier.store.read_process import ReadProcess  # noqa: E402
from kvtier.store.reader import SlotReader  # noqa: E402
from kvtier.store.slabs import SlabFiles  # noqa: E402
from kvtier.store.slot import HEADER_SIZE, LayoutFingerprint  # noqa: E402
from kvtier.store.store import DiskStore  # noqa: E402
from kvtier.tiers.events import MEDIUM_DISK  # noqa: E402
from kvtier.tiers.plans import BlockLocation  # noqa: E402

NUM_BLOCKS = 64
PAGE = 8192  # padded page of every tensor
SHORT = 6144  # the second group's layers use less of each page


def hybrid_caches(device: str) -> tuple[CanonicalKVCaches, list[torch.Tensor]]:
    """Three tensors, two groups: group 0 (full attention) uses tensors 0-2
    whole, group 1 (sliding window) shares tensors 0 and 1 with 6 KiB pages
    (vLLM's hybrid allocator shares tensors across groups)."""
    g = torch.Generator(device="cpu").manual_seed(1)
    raw = [
        torch.randint(-(2**15), 2**15, (NUM_BLOCKS, PAGE // 2), generator=g).to(
            torch.int16
        )
        for _ in range(3)
    ]
    tensors = [t.to(device) for t in raw]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        group_data_refs=[
            [CanonicalKVCacheRef(i, PAGE) for i in range(3)],
            [CanonicalKVCacheRef(0, SHORT), CanonicalKVCacheRef(1, SHORT)],
        ],
    )
    return caches, tensors


def _drain(copies, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while getattr(copies, "_handlers", None) and any(
        h._transfers for h in copies._handlers.values()
    ):
        copies.poll()
        assert time.monotonic() < deadline, "transfers did not finish"
        time.sleep(0.001)


@pytest.mark.parametrize("bpc", [1, 2])
def test_stores_and_loads_match_the_host_layout_byte_for_byte(bpc):
    rows_n, row_bytes = 40, bpc * 3 * PAGE
    gpu_caches, gpu_tensors = hybrid_caches("cuda")
    cpu_caches, _ = hybrid_caches("cpu")
    gpu_views = group_views(gpu_caches, row_bytes, bpc)
    cpu_views = group_views(cpu_caches, row_bytes, bpc, device_kind="cpu")
    with (
        CpuBlockBuffer(rows_n, row_bytes) as dev_buf,
        CpuBlockBuffer(rows_n, row_bytes) as ref_buf,
    ):
        dev = DeviceCopies(gpu_views, [HostArea("cpu", dev_buf.tensor)], bpc)
        ref = HostCopies(cpu_views, [HostArea("cpu", ref_buf.tensor)], bpc)
        assert dev.areas["cpu"].pinned  # vLLM's host_register took it
        # A request's blocks 1..9 (unaligned first chunk when bpc=2), per
        # group, into distinct rows.
        jobs = []
        for group, first_row in ((0, 0), (1, 20)):
            gpu = np.arange(9) + 3 + 10 * group
            n_rows = (1 + 9 - 1) // bpc - 1 // bpc + 1
            plan = plan_copy(gpu, np.arange(n_rows) + first_row, bpc, 1)
            jobs.append((group, plan))
            ref.submit("cpu", group, plan, to_host=True)
            dev.submit("cpu", group, plan, to_host=True)
        _drain(dev)
        assert np.array_equal(dev_buf.array, ref_buf.array)
        assert dev_buf.array.any()
        # Loads: clear the destination blocks, copy back, compare.
        want = [t.clone() for t in gpu_tensors]
        for t in gpu_tensors:
            t.zero_()
        for group, plan in jobs:
            dev.submit("cpu", group, plan, to_host=False)
        _drain(dev)
        torch.cuda.synchronize()
        for group, plan in jobs:
            blocks = torch.as_tensor(plan.gpu_ids, device="cuda")
            for layer in gpu_caches.group_data_refs[group]:
                t = gpu_tensors[layer.tensor_idx].view(torch.uint8)
                w = want[layer.tensor_idx].view(torch.uint8)
                page = layer.page_size_bytes
                assert torch.equal(t[blocks, :page], w[blocks, :page]), (group, layer)
        dev.shutdown()
        ref.shutdown()


@pytest.mark.parametrize("where", ["host", "device"])
def test_drain_from_another_thread_completes_every_transfer_submitted(where):
    """``drain`` is what the worker calls, on the engine's thread, for a
    load thread stuck past its deadline after it issued copies it will not
    poll: once it returns, every transfer submitted so far has landed, so
    the next poll reports them at once. Both kinds of area: vLLM's handlers
    (host rows) and kvtier's scatter (rows in device memory). What lands is
    what kvtier's CPU copier writes from the same rows."""
    rows_n, row_bytes = 40, 3 * PAGE
    gpu_caches, gpu_tensors = hybrid_caches("cuda")
    cpu_caches, cpu_tensors = hybrid_caches("cpu")
    g = torch.Generator(device="cpu").manual_seed(2)
    rows = torch.randint(0, 256, (rows_n, row_bytes), generator=g)
    plan = plan_copy(np.arange(rows_n) + 3, np.arange(rows_n), 1, 1)
    with CpuBlockBuffer(rows_n, row_bytes) as buf:
        buf.tensor.copy_(rows.to(torch.uint8))
        ref = HostCopies(
            group_views(cpu_caches, row_bytes, 1, device_kind="cpu"),
            [HostArea("stage", buf.tensor)],
            1,
        )
        ref.submit("stage", 0, plan, to_host=False)
        ref.shutdown()
        assert not torch.equal(cpu_tensors[0], hybrid_caches("cpu")[1][0])
        area = buf.tensor if where == "host" else buf.tensor.to("cuda")
        dev = DeviceCopies(
            group_views(gpu_caches, row_bytes, 1), [HostArea("stage", area)], 1
        )
        try:
            torch.cuda.synchronize()
            transfers = {dev.submit("stage", 0, plan, to_host=False)}
            drained = threading.Thread(target=dev.drain)
            drained.start()
            drained.join(30)
            assert not drained.is_alive(), "drain did not return"
            assert set(dev.poll()) == transfers  # landed: reported at once
            for got, want in zip(gpu_tensors, cpu_tensors, strict=True):
                assert torch.equal(got.cpu(), want)
        finally:
            dev.shutdown()


FINGERPRINT = LayoutFingerprint(
    model="test/gpu",
    dtype="int16",
    block_bytes=3 * PAGE,
    geometry="gpu-test",
    tp_rank=0,
    tp_size=1,
)


def _key(i: int) -> bytes:
    return hashlib.sha256(f"gpu/{i}".encode()).digest()


@pytest.fixture(params=["host", "device", "read-process"])
def disk_worker(tmp_path, request):
    """A worker over CUDA KV caches, a CPU tier and a real disk tier whose
    slots 0..15 hold the blocks of keys 0..15 (random bytes), read through
    the host bounce area or a CUDA staging area (``disk_load_path``), or
    by a read process into a shared area the copy path page-locks
    (``disk_read_process: on``)."""
    caches, tensors = hybrid_caches("cuda")
    buffer = CpuBlockBuffer(16, 3 * PAGE)
    store = DiskStore([str(tmp_path)], 32, 3 * PAGE, FINGERPRINT, backend="posix")
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (16, 3 * PAGE), dtype=np.uint8)
    for slot in range(16):
        store.write_block(slot, _key(slot), blocks[slot], store.next_seq())
    store.close()
    files = SlabFiles.open(
        [str(tmp_path)], FINGERPRINT, 32, make_backend("posix"), owns_backend=True
    )
    if request.param == "device":
        reader = SlotReader(files, device="cuda", capacity=4)
    elif request.param == "read-process":
        reader = ReadProcess(files, capacity=4, disk_io="posix", threads=2)
    else:
        reader = SlotReader(files, capacity=4, pin=True)
    worker = TieredOffloadingWorker(
        caches, buffer, 1, reader, device_copies=DeviceCopies
    )
    yield worker, tensors, blocks, tmp_path
    worker.shutdown()


def _disk_spec(slots) -> TierLoadSpec:
    slots = [int(s) for s in slots]
    return TierLoadSpec(
        [_key(s) for s in slots], [BlockLocation(MEDIUM_DISK, s) for s in slots]
    )


def _run(worker, submit, *args, job_id: int):
    assert submit(job_id, *args)
    deadline = time.monotonic() + 30
    while True:
        done = worker.get_finished()
        if done:
            assert [d.job_id for d in done] == [job_id]
            return done[0]
        assert time.monotonic() < deadline, "job never finished"
        time.sleep(0.001)


def test_disk_slots_load_straight_into_the_kv_cache(disk_worker):
    worker, tensors, blocks, _ = disk_worker
    slots = np.arange(10)  # 10 slots through a 4-slot bounce area
    spec = _disk_spec(slots)
    gpu = list(range(20, 30))
    result = _run(
        worker, worker.submit_load, spec, GPULoadStoreSpec(gpu, [10], [0]), job_id=1
    )
    assert result.success and result.transfer_size == 10 * 3 * PAGE
    for i, b in enumerate(gpu):
        got = b"".join(bytes(t[b].view(torch.uint8).cpu().numpy()) for t in tensors)
        assert got == bytes(blocks[i]), i


def test_a_corrupt_slot_fails_its_block_and_leaves_it_untouched(disk_worker):
    worker, tensors, blocks, path = disk_worker
    slab = next(path.rglob("slab-0.kvt"))
    with open(slab, "r+b") as f:  # flip one payload byte of slot 3
        offset = worker.reader.slot_size * 3 + HEADER_SIZE + 100
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    for t in tensors:
        t[40:46] = 0
    spec = _disk_spec(range(6))
    result = _run(
        worker,
        worker.submit_load,
        spec,
        GPULoadStoreSpec(list(range(40, 46)), [6], [0]),
        job_id=2,
    )
    assert not result.success
    error = worker.take_load_error(2)
    assert error.corrupt == [_key(3)] and error.gpu_block_ids == {43}
    for i, b in enumerate(range(40, 46)):
        got = b"".join(bytes(t[b].view(torch.uint8).cpu().numpy()) for t in tensors)
        assert got == (bytes(len(got)) if i == 3 else bytes(blocks[i])), i


def test_cpu_rows_round_trip_through_the_worker(disk_worker):
    worker, tensors, _, _ = disk_worker
    want = b"".join(bytes(t[7].view(torch.uint8).cpu().numpy()) for t in tensors)
    store = _run(
        worker,
        worker.submit_store,
        GPULoadStoreSpec([7], [1], [0]),
        CPULoadStoreSpec([5]),
        job_id=3,
    )
    assert store.success and bytes(worker.cpu_buffer.array[5]) == want
    for t in tensors:
        t[9] = 0
    load = _run(
        worker,
        worker.submit_load,
        CPULoadStoreSpec([5]),
        GPULoadStoreSpec([9], [1], [0]),
        job_id=4,
    )
    assert load.success
    got = b"".join(bytes(t[9].view(torch.uint8).cpu().numpy()) for t in tensors)
    assert got == want


def test_a_disk_load_lands_after_the_model_streams_earlier_writes(disk_worker):
    """The load thread issues a disk job's copies on a stream of its own;
    they must land after what the model's stream queued before
    ``submit_load`` (vLLM zeroes newly allocated blocks there). The model's
    stream is held busy (``torch.cuda._sleep``, ~0.5 s) and then fills the
    destination blocks with 0x5A: copies that did not wait for it would land
    first and be overwritten by the fill."""
    worker, tensors, blocks, _ = disk_worker
    # A first load opens the slab files and compiles vLLM's copy kernel, so
    # that the checked load's copies are ready within milliseconds.
    warm = _run(
        worker,
        worker.submit_load,
        _disk_spec(range(4, 8)),
        GPULoadStoreSpec(list(range(56, 60)), [4], [0]),
        job_id=6,
    )
    assert warm.success
    gpu = list(range(50, 54))
    # A stream of its own, as the model may run on one: no implicit
    # ordering with the legacy default stream.
    model = torch.cuda.Stream()
    with torch.cuda.stream(model):
        torch.cuda._sleep(1_000_000_000)  # GPU cycles: ~0.5 s
        for t in tensors:
            t[50:54].view(torch.uint8).fill_(0x5A)
        result = _run(
            worker,
            worker.submit_load,
            _disk_spec(range(4)),
            GPULoadStoreSpec(gpu, [4], [0]),
            job_id=5,
        )
    assert result.success
    torch.cuda.synchronize()
    for i, b in enumerate(gpu):
        got = b"".join(bytes(t[b].view(torch.uint8).cpu().numpy()) for t in tensors)
        assert got == bytes(blocks[i]), i
