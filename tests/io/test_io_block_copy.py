"""BlockCopier on the CPU platform: word-sized copies, byte for byte.

The copier reinterprets pages as the widest machine word that sizes,
strides and offsets allow; whatever the word, every byte must land where a
byte-wise copy would put it, in both directions, including rows that are
strided views (the disk bounce area's payloads)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.io.block_copy import BlockCopier, plan_copy, word_size


@pytest.mark.parametrize(
    ("pages", "word"), [((4096, 2048), 8), ((4100, 2052), 4), ((4098,), 2), ((33,), 1)]
)
@pytest.mark.parametrize("row_stride_extra", [0, 4096])
def test_copies_are_byte_exact_at_every_word_size(pages, word, row_stride_extra):
    gen = torch.Generator().manual_seed(0)
    kv = [torch.randint(0, 256, (16, p), dtype=torch.uint8, generator=gen) for p in pages]
    bpc = 2
    row_bytes = bpc * sum(pages)
    # Rows as a strided view of a larger area, like payloads in the bounce area.
    area = torch.zeros((6, row_bytes + row_stride_extra), dtype=torch.uint8)
    rows = area[:, :row_bytes]
    copier = BlockCopier(kv, rows, bpc)
    assert copier.word == min(word, word_size([rows]))

    plan = plan_copy([3, 4, 9], [1, 4], bpc, first_block_index=1)
    assert copier.to_cpu(plan) is None  # CPU platform: done on return
    offset = 0
    for t, page in zip(kv, pages):
        for g, r, sub in zip(plan.gpu_ids, plan.row_ids, plan.sub_ids):
            got = rows[r, offset + sub * page : offset + (sub + 1) * page]
            assert torch.equal(got, t[g])
        offset += bpc * page
    # Untouched bytes stay untouched (sub-block 0 of row 1 was not written).
    assert not rows[1, : pages[0]].any()

    back = [torch.zeros_like(t) for t in kv]
    BlockCopier(back, rows, bpc).to_gpu(plan)
    for t, b in zip(kv, back):
        assert torch.equal(b[plan.gpu_ids], t[plan.gpu_ids])
        mask = np.ones(16, dtype=bool)
        mask[plan.gpu_ids] = False
        assert not b[torch.from_numpy(mask)].any()
