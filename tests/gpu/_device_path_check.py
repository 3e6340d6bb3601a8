"""The device load path through kvikio, on CPU tensors or on CUDA: one body.

``check(device, work_dir)`` is the body of
``tests/gpu/test_gpu_device_staging.py``; it runs in a fresh interpreter
(``python tests/gpu/_device_path_check.py DEVICE WORK_DIR``) because kvikio
binds the CUDA driver once per process: on a host without a GPU the test
starts it with the test-only stub driver on ``LD_LIBRARY_PATH`` (kvikio's
compat mode into host memory), on a GPU host with the real one. It asserts
as it goes and prints one ``RESULT <json>`` line.

What it checks, with slots striped over two slab files:

1. kvikio's asynchronous reads (``KvikioBackend.start_read``) land straight
   in the ``SlotReader``'s staging tensor on ``device`` (no host bounce
   area), every slot verifies with the device checksum, and the rows equal
   byte for byte what the POSIX back end reads into the same kind of tensor
   (and what was written);
2. the real ``TieredOffloadingWorker`` over that reader (vLLM's transfer
   handlers on CUDA, kvtier's host copier on CPU) loads the slots into a KV
   cache on ``device``, byte-exact;
3. after one payload byte of one slot and one header byte of another are
   flipped on disk, kvikio and POSIX both refuse exactly those slots
   (CHECKSUM_MISMATCH, BAD_HEADER), and the worker reports them as a load
   error and leaves their KV blocks untouched while it fills the others.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

if __name__ == "__main__":  # run by path: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SLOTS = 8
PAGE = 8192
LAYERS = 3
BLOCK = LAYERS * PAGE
KV_BLOCKS = 32
PAYLOAD_FLIP_SLOT = 3
HEADER_FLIP_SLOT = 6


def _key(i: int) -> bytes:
    return hashlib.sha256(f"device-path/{i}".encode()).digest()


def _fingerprint():
    from kvtier.store.slot import LayoutFingerprint

    return LayoutFingerprint(
        model="test/device-path",
        dtype="int16",
        block_bytes=BLOCK,
        geometry="device-path",
        tp_rank=0,
        tp_size=1,
    )


def _reader(paths: list[str], backend_name: str, device: str):
    from kvtier.store.backends.factory import make_backend
    from kvtier.store.reader import SlotReader
    from kvtier.store.slabs import SlabFiles

    backend = make_backend(backend_name, threads=2)
    targets: list[str] = []
    start = getattr(backend, "start_read", None)
    if start is not None:
        # Note where each of kvikio's reads lands (the reader looks the
        # method up on the back end, so an instance attribute wraps it).
        def start_read(handle, buf, offset):
            kind = buf.device.type if isinstance(buf, torch.Tensor) else "host"
            targets.append(kind)
            return start(handle, buf, offset)

        backend.start_read = start_read
    files = SlabFiles.open(paths, _fingerprint(), SLOTS, backend, owns_backend=True)
    reader = SlotReader(files, device=device, capacity=SLOTS)
    return reader, targets


def _kv_caches(device: str):
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    g = torch.Generator(device="cpu").manual_seed(7)
    tensors = [
        torch.randint(-(2**15), 2**15, (KV_BLOCKS, PAGE // 2), generator=g)
        .to(torch.int16)
        .to(device)
        for _ in range(LAYERS)
    ]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]],
    )
    return caches, tensors


def _kv_block(tensors: list[torch.Tensor], block: int) -> bytes:
    return b"".join(bytes(t[block].view(torch.uint8).cpu().numpy()) for t in tensors)


def _load(worker, job_id: int, slots: list[int], gpu_blocks: list[int]):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvtier.connector.load_store_specs import TierLoadSpec
    from kvtier.tiers.events import MEDIUM_DISK
    from kvtier.tiers.plans import BlockLocation

    spec = TierLoadSpec(
        [_key(s) for s in slots], [BlockLocation(MEDIUM_DISK, s) for s in slots]
    )
    dst = GPULoadStoreSpec(gpu_blocks, [len(gpu_blocks)], [0])
    assert worker.submit_load(job_id, spec, dst)
    deadline = time.monotonic() + 60
    while True:
        done = worker.get_finished()
        if done:
            assert [d.job_id for d in done] == [job_id], done
            return done[0]
        assert time.monotonic() < deadline, "load never finished"
        time.sleep(0.001)


def _worker(paths: list[str], device: str, caches):
    from kvtier.connector.worker.worker import TieredOffloadingWorker
    from kvtier.host.cpu_tier import CpuBlockBuffer

    device_copies = None
    if device == "cuda":
        from kvtier.connector.worker.device_copy import DeviceCopies

        device_copies = DeviceCopies
    reader, targets = _reader(paths, "kvikio", device)
    worker = TieredOffloadingWorker(
        caches, CpuBlockBuffer(4, BLOCK), 1, reader, device_copies=device_copies
    )
    return worker, targets


def check(device: str, work: str) -> dict:
    from kvtier.store.slabs import locate
    from kvtier.store.slot import FIXED_HEADER_LEN, HEADER_SIZE, ReadOutcome
    from kvtier.store.store import DiskStore
    from kvtier.testing.faults import flip_byte

    paths = [os.path.join(work, "a"), os.path.join(work, "b")]
    rng = np.random.default_rng(11)
    blocks = rng.integers(0, 256, (SLOTS, BLOCK), dtype=np.uint8)
    store = DiskStore(paths, SLOTS, BLOCK, _fingerprint(), backend="posix")
    for slot in range(SLOTS):
        store.write_block(slot, _key(slot), blocks[slot], store.next_seq())
    store.close()
    items = [(s, _key(s)) for s in range(SLOTS)]
    out: dict = {"device": device}

    # 1. kvikio into the staging tensor == POSIX into the same kind of tensor.
    rows = {}
    for name in ("posix", "kvikio"):
        reader, targets = _reader(paths, name, device)
        try:
            assert reader.staging.device.type == device, reader.staging.device
            res = reader.read(items)
            assert [r.outcome for r in res] == [ReadOutcome.OK] * SLOTS, res
            rows[name] = reader.rows[[r.row for r in res]].clone()
            if name == "kvikio":
                out["mode"] = reader.mode
                assert reader.mode in ("gds", "compat"), reader.mode
                # kvikio read into the staging tensor itself, no bounce area
                # (on the CPU the host area *is* the staging tensor's memory).
                assert reader._area is None or (
                    reader._area.ctypes.data == reader.staging.data_ptr()
                )
                assert targets and set(targets) == {device}, targets
                out["kvikio_reads"] = len(targets)
        finally:
            reader.close()
    assert rows["kvikio"].device.type == device
    assert torch.equal(rows["kvikio"], rows["posix"])
    assert np.array_equal(rows["kvikio"].cpu().numpy(), blocks)

    # 2. The worker over the kvikio staging reader fills the KV cache.
    caches, tensors = _kv_caches(device)
    worker, targets = _worker(paths, device, caches)
    try:
        result = _load(worker, 1, list(range(SLOTS)), list(range(10, 10 + SLOTS)))
        assert result.success, worker.take_load_error(1)
        for i in range(SLOTS):
            assert _kv_block(tensors, 10 + i) == bytes(blocks[i]), i
        assert targets and set(targets) == {device}, targets
    finally:
        worker.shutdown()

    # 3. Corrupt one payload byte and one header byte: refused, never loaded.
    slab_paths = [str(sorted(Path(p).rglob("slab-*.kvt"))[0]) for p in paths]
    from kvtier.store.slot import slot_size

    for slot, at in (
        (PAYLOAD_FLIP_SLOT, HEADER_SIZE + 1234),
        (HEADER_FLIP_SLOT, FIXED_HEADER_LEN // 2),
    ):
        f, local = locate(slot, len(paths))
        flip_byte(slab_paths[f], local * slot_size(BLOCK) + at, 0x5A)
    want = {
        PAYLOAD_FLIP_SLOT: ReadOutcome.CHECKSUM_MISMATCH,
        HEADER_FLIP_SLOT: ReadOutcome.BAD_HEADER,
    }
    out["refused"] = {}
    for name in ("posix", "kvikio"):
        reader, _ = _reader(paths, name, device)
        try:
            res = reader.read(items)
            got = [r.outcome for r in res]
            assert got == [want.get(s, ReadOutcome.OK) for s in range(SLOTS)], got
            for s, r in enumerate(res):
                if s not in want:
                    assert np.array_equal(reader.rows[r.row].cpu().numpy(), blocks[s])
            stats = reader.stats()
            assert stats.checksum_failures == 2 and stats.blocks_ok == SLOTS - 2
            out["refused"][name] = [r.outcome.value for r in res]
        finally:
            reader.close()

    caches, tensors = _kv_caches(device)
    before = {b: _kv_block(tensors, b) for b in range(20, 20 + SLOTS)}
    worker, _ = _worker(paths, device, caches)
    try:
        result = _load(worker, 2, list(range(SLOTS)), list(range(20, 20 + SLOTS)))
        assert not result.success
        error = worker.take_load_error(2)
        assert error is not None
        assert sorted(error.corrupt) == sorted(_key(s) for s in want), error
        assert error.gpu_block_ids == {20 + s for s in want}, error
        for i in range(SLOTS):
            got = _kv_block(tensors, 20 + i)
            assert got == (before[20 + i] if i in want else bytes(blocks[i])), i
    finally:
        worker.shutdown()
    return out


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    print("RESULT " + json.dumps(check(sys.argv[1], sys.argv[2])))
