"""Worker construction validates the KV cache before it copies a byte.

Every refused layout is one that kvtier would otherwise copy wrong (and
checksum, and persist): a permuted tensor, a first dimension that is not the
block, a page outside its tensor, rows too small for a group's block. A
refused start leaves no CPU-tier file behind."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)

from kvtier.connector.config import ConfigError  # noqa: E402
from kvtier.connector.worker.kv_layout import KVLayoutError, group_views  # noqa: E402
from kvtier.testing.offloading import offloading_config, tiered_spec  # noqa: E402

PAGE = 512
BLOCKS = 8


def _caches(tensors, refs, pages=None) -> CanonicalKVCaches:
    pages = pages or [PAGE] * len(tensors)
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, p) for t, p in zip(tensors, pages)],
        group_data_refs=refs,
    )


def test_views_are_the_blocks_bytes_each_tensor_once_unpadded() -> None:
    # Two groups sharing tensor 0 (vLLM's hybrid allocator does this); the
    # second group's layers use only 384 B of each 512 B (padded) page.
    t0 = torch.arange(BLOCKS * PAGE // 2, dtype=torch.int16).reshape(BLOCKS, -1)
    t1 = torch.randint(0, 255, (BLOCKS, 4, PAGE // 4), dtype=torch.uint8)
    caches = _caches(
        [t0, t1],
        [
            [CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)],
            [CanonicalKVCacheRef(0, 384), CanonicalKVCacheRef(0, 384)],
        ],
    )
    views = group_views(caches, row_bytes=2 * PAGE, blocks_per_chunk=1)
    assert [len(g) for g in views] == [2, 1]
    assert [tuple(v.shape) for v in views[0]] == [(BLOCKS, PAGE), (BLOCKS, PAGE)]
    assert tuple(views[1][0].shape) == (BLOCKS, 384)
    # Views, not copies: the bytes are the tensors' own.
    assert views[0][0].data_ptr() == t0.data_ptr()
    assert views[1][0].stride(0) == PAGE
    assert bytes(views[0][1][3].numpy()) == bytes(t1[3].flatten().numpy())
    assert bytes(views[1][0][2].numpy()) == bytes(t0[2].numpy().tobytes()[:384])


@pytest.mark.parametrize(
    "case, message",
    [
        ("permuted", "not contiguous"),
        ("not-block-first", "first dimension must be the block"),
        ("page-outside", "does not fit tensor"),
        ("bad-index", "refers to tensor 3"),
        ("row-too-small", "rows hold"),
        ("block-counts", "different block counts"),
        ("device", "is on meta"),
    ],
)
def test_unsupported_layouts_are_refused_with_the_reason(case, message) -> None:
    good = torch.zeros(BLOCKS, PAGE, dtype=torch.uint8)
    refs = [[CanonicalKVCacheRef(0, PAGE)]]
    row = PAGE
    tensors, pages = [good], None
    if case == "permuted":
        tensors = [torch.zeros(PAGE, BLOCKS, dtype=torch.uint8).t()]
    elif case == "not-block-first":
        tensors = [torch.zeros(BLOCKS // 2, 2 * PAGE + 64, dtype=torch.uint8)]
    elif case == "page-outside":
        refs = [[CanonicalKVCacheRef(0, PAGE + 1)]]
    elif case == "bad-index":
        refs = [[CanonicalKVCacheRef(3, PAGE)]]
    elif case == "row-too-small":
        row = PAGE - 1
    elif case == "block-counts":
        tensors = [good, torch.zeros(BLOCKS + 1, PAGE, dtype=torch.uint8)]
        refs = [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]]
        row = 2 * PAGE
    elif case == "device":
        tensors = [torch.zeros(BLOCKS, PAGE, dtype=torch.uint8, device="meta")]
    with pytest.raises(KVLayoutError, match=message):
        group_views(_caches(tensors, refs, pages), row, 1, device_kind="cpu")


@pytest.mark.parametrize(
    "case, message",
    [("permuted", "not contiguous"), ("bad-index", "refers to tensor 3")],
)
def test_the_tiering_modes_worker_refuses_what_the_full_specs_refuses(
    case, message
) -> None:
    """The tiering mode's copies over vLLM's region rows check the KV cache
    as the full spec's worker does, with its reasons, before they take a
    row of the region."""
    from kvtier.connector.tiering.portable import _RegionCopies

    class Region:
        taken = 0

        def create_next_worker_view(self, nbytes: int) -> torch.Tensor:
            self.taken += 1
            return torch.zeros(4, nbytes, dtype=torch.uint8)  # 4 chunks

    good = torch.zeros(BLOCKS, PAGE, dtype=torch.uint8)
    tensors, refs = [good], [[CanonicalKVCacheRef(0, PAGE)]]
    if case == "permuted":
        tensors = [torch.zeros(PAGE, BLOCKS, dtype=torch.uint8).t()]
    else:
        refs = [[CanonicalKVCacheRef(3, PAGE)]]
    region = Region()
    with pytest.raises(KVLayoutError, match=message):
        _RegionCopies(_caches(tensors, refs), region, blocks_per_chunk=1)
    assert region.taken == 0
    # The same cache, laid out right, takes one row per tensor.
    copies = _RegionCopies(_caches([good], [[CanonicalKVCacheRef(0, PAGE)]]), region, 1)
    assert region.taken == 1 and copies.block_bytes == [PAGE]


def test_tensors_on_two_devices_are_refused() -> None:
    tensors = [
        torch.zeros(BLOCKS, PAGE, dtype=torch.uint8),
        torch.zeros(BLOCKS, PAGE, dtype=torch.uint8, device="meta"),
    ]
    refs = [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]]
    with pytest.raises(KVLayoutError, match="spans devices"):
        group_views(_caches(tensors, refs), 2 * PAGE, 1)


def _spec_config(**extra):
    return offloading_config(
        {
            "spec_name": "TieredOffloadingSpec",
            "spec_module_path": "kvtier.connector",
            "cpu_bytes_to_use": 8 * 2 * PAGE,
            "disk_io": "posix",
            **extra,
        },
        worker_kv_bytes_per_block=2 * PAGE,
        layers=2,
        engine_tag="layout",
    )


def test_a_refused_kv_cache_leaves_no_cpu_tier_file(tmp_path: Path) -> None:
    spec = tiered_spec(_spec_config())
    path = spec._buffer_path(0)
    permuted = [torch.zeros(PAGE, BLOCKS, dtype=torch.uint8).t() for _ in range(2)]
    caches = _caches(
        permuted, [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]]
    )
    with pytest.raises(KVLayoutError, match="not contiguous"):
        spec.get_worker(caches)
    assert not os.path.exists(path)


def test_a_good_kv_cache_builds_a_worker(tmp_path: Path) -> None:
    spec = tiered_spec(_spec_config())
    tensors = [torch.zeros(BLOCKS, PAGE, dtype=torch.int8) for _ in range(2)]
    worker = spec.get_worker(
        _caches(tensors, [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]])
    )
    try:
        assert worker.block_bytes == [2 * PAGE]
    finally:
        worker.shutdown()
    assert not os.path.exists(spec._buffer_path(0))


def test_canonical_layout_is_refused_by_the_full_spec() -> None:
    cfg = dataclasses.replace(_spec_config(), canonical_layout=True)
    with pytest.raises(ConfigError, match="canonical_layout"):
        tiered_spec(cfg)


def test_replicated_layout_keeps_a_copy_per_rank() -> None:
    # vLLM's replicated layout (MLA under TP) lets only rank 0 store when the
    # spec says so; kvtier's rows and slots are per rank, so its spec keeps
    # the flag off and every rank stores (and later loads) its own copy.
    spec = tiered_spec(dataclasses.replace(_spec_config(), replicated_layout=True))
    assert spec.config.replicated_layout is True
    assert spec.replicated_layout is False
