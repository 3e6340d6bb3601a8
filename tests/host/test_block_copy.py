"""BlockCopier on the CPU platform: word-sized copies, byte for byte.

The copier reinterprets pages as the widest machine word that sizes,
strides and offsets allow; whatever the word, every byte must land where a
byte-wise copy would put it, in both directions, including rows that are
strided views (the disk bounce area's payloads)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.host.block_copy import BlockCopier, plan_copy, word_size


@pytest.mark.parametrize(
    ("pages", "word"), [((4096, 2048), 8), ((4100, 2052), 4), ((4098,), 2), ((33,), 1)]
)
@pytest.mark.parametrize("row_stride_extra", [0, 4096])
def test_copies_are_byte_exact_at_every_word_size(pages, word, row_stride_extra):
    gen = torch.Generator().manual_seed(0)
    kv = [
        torch.randint(0, 256, (16, p), dtype=torch.uint8, generator=gen) for p in pages
    ]
    bpc = 2
    row_bytes = bpc * sum(pages)
    # Rows as a strided view of a larger area, like payloads in the bounce area.
    area = torch.zeros((6, row_bytes + row_stride_extra), dtype=torch.uint8)
    rows = area[:, :row_bytes]
    copier = BlockCopier(kv, rows, bpc)
    assert copier.word == min(word, word_size([rows]))

    plan = plan_copy([3, 4, 9], [1, 4], bpc, first_block_index=1)
    assert copier.copy(plan, to_cpu=True) is None  # CPU platform: done on return
    offset = 0
    for t, page in zip(kv, pages):
        for g, r, sub in zip(plan.gpu_ids, plan.row_ids, plan.sub_ids):
            got = rows[r, offset + sub * page : offset + (sub + 1) * page]
            assert torch.equal(got, t[g])
        offset += bpc * page
    # Untouched bytes stay untouched (sub-block 0 of row 1 was not written).
    assert not rows[1, : pages[0]].any()

    back = [torch.zeros_like(t) for t in kv]
    BlockCopier(back, rows, bpc).copy(plan, to_cpu=False)
    for t, b in zip(kv, back):
        assert torch.equal(b[plan.gpu_ids], t[plan.gpu_ids])
        mask = np.ones(16, dtype=bool)
        mask[plan.gpu_ids] = False
        assert not b[torch.from_numpy(mask)].any()


def _reference(kv, rows, bpc, plan, to_cpu):
    """Byte-wise, block by block: where every byte must land."""
    offset = 0
    for t in kv:
        page = t.shape[1]
        for g, r, s in zip(plan.gpu_ids, plan.row_ids, plan.sub_ids):
            cpu = rows[r, offset + s * page : offset + (s + 1) * page]
            if to_cpu:
                cpu.copy_(t[g])
            else:
                t[g].copy_(cpu)
        offset += bpc * page


@pytest.mark.parametrize("host_numpy", [True, False], ids=["numpy", "device-path"])
@pytest.mark.parametrize("bpc", [1, 3])
@pytest.mark.parametrize(
    "shape", ["ascending", "descending", "permuted", "two_runs", "scattered"]
)
def test_host_copies_from_runs_and_gathers_equal_a_blockwise_copy(
    bpc, shape, host_numpy
):
    """Plans whose source blocks form one run (in any order), a few runs or
    more runs than MAX_RUNS (a gathered copy): every byte lands where a
    block-by-block copy puts it, in both directions, and nothing else moves;
    through numpy (host memory) and through torch's indexing (the path a
    device staging area takes on CUDA, here on CPU tensors)."""
    from kvtier.host.block_copy import MAX_RUNS, CopyPlan, source_runs

    rng = np.random.default_rng(bpc * 10 + len(shape))
    pages, blocks, nrows = (4096, 1024), 64, 40
    row_bytes = bpc * sum(pages)
    n = 24
    if shape == "ascending":
        gpu, pos = np.arange(5, 5 + n), np.arange(3, 3 + n)
    elif shape == "descending":
        gpu, pos = np.arange(40, 40 - n, -1), np.arange(3, 3 + n)
    elif shape == "permuted":
        gpu, pos = rng.permutation(blocks)[:n], rng.permutation(np.arange(6, 6 + n))
    elif shape == "two_runs":
        gpu = rng.permutation(blocks)[:n]
        pos = np.concatenate([np.arange(0, 10), np.arange(20, 20 + n - 10)])
    else:
        gpu = rng.permutation(blocks)[:n]
        pos = rng.permutation(nrows * bpc)[:n]
    plan = CopyPlan(gpu.astype(np.int64), pos // bpc, pos % bpc)
    for src_pos in (plan.gpu_ids, pos):  # the runs each direction copies from
        runs = len(source_runs(src_pos)[1]) - 1
        if shape == "scattered":
            assert runs > MAX_RUNS
    gen = torch.Generator().manual_seed(1)
    for to_cpu in (True, False):
        kv = [
            torch.randint(0, 256, (blocks, p), dtype=torch.uint8, generator=gen)
            for p in pages
        ]
        area = torch.randint(
            0, 256, (nrows, row_bytes + 512), dtype=torch.uint8, generator=gen
        )
        rows = area[:, :row_bytes]  # strided rows, like the bounce area's payloads
        want_kv = [t.clone() for t in kv]
        want_area = area.clone()
        _reference(want_kv, want_area[:, :row_bytes], bpc, plan, to_cpu)
        copier = BlockCopier(kv, rows, bpc, host_numpy=host_numpy)
        copier.copy(plan, to_cpu)
        assert torch.equal(area, want_area)
        for got, want in zip(kv, want_kv):
            assert torch.equal(got, want)


@pytest.mark.parametrize("host_numpy", [True, False])
@pytest.mark.parametrize(
    ("gpu", "rows", "subs", "to_cpu"),
    [
        ([0, 1], [2, 3], [0, 0], False),  # a row past the end (a run of rows)
        ([0], [-1], [0], False),  # a negative row
        ([4, 5], [0, 1], [0, 0], True),  # a GPU block past the end (a run)
        ([0], [0], [1], True),  # a sub-block past blocks_per_chunk
        ([1], [0], [-1], False),  # a negative sub-block
    ],
)
def test_a_plan_out_of_range_is_refused_and_copies_nothing(
    gpu, rows, subs, to_cpu, host_numpy
):
    """A plan naming a block, row or sub-block that does not exist is refused
    with IndexError before any byte moves, on every path: a slice past the
    end must not quietly copy a neighbour's bytes (wrong KV) and a negative
    index must not wrap around to the last row."""
    from kvtier.host.block_copy import CopyPlan

    kv = [torch.arange(5 * 8, dtype=torch.uint8).reshape(5, 8)]
    area = torch.arange(100, 100 + 3 * 8, dtype=torch.uint8).reshape(3, 8)
    kv_before, area_before = kv[0].clone(), area.clone()
    copier = BlockCopier(kv, area, 1, host_numpy=host_numpy)
    plan = CopyPlan(*(np.array(x, dtype=np.int64) for x in (gpu, rows, subs)))
    with pytest.raises(IndexError, match="out of range"):
        copier.copy(plan, to_cpu=to_cpu)
    assert torch.equal(kv[0], kv_before) and torch.equal(area, area_before)
