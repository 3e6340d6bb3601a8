"""The data path of :class:`kvtier.connector.tiering.KvtierDiskTier`.

Row layout. vLLM's primary tier is one ``SharedOffloadRegion`` mmap of
``num_chunks`` rows of ``kv_bytes_per_chunk`` bytes (page aligned)::

    | rank 0 page | rank 1 page | ... | rank W-1 page | padding |

Each rank page (``cpu_page_size_per_worker`` = KV bytes of one offloaded
block of one rank) is what kvtier's full spec calls one block: it goes to
that rank's own slab, under that rank's layout fingerprint (model, dtype,
block geometry, TP rank/size, plus ``host_layout=vllm-tiering`` because
vLLM orders a rank's page per KV tensor, which differs from the full spec's
per-group rows on hybrid models). A key is on disk iff every rank's slot is.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from typing_extensions import override

from kvtier.connector.scheduler.disk_runtime import DiskRuntime
from kvtier.store.engine import TransferEngine

HOST_LAYOUT = "vllm-tiering"


class PrimaryRows:
    """One rank's page of every primary-tier row, as the ``CpuBlockBuffer``
    face that :class:`~kvtier.store.engine.TransferEngine` reads and writes
    (``array[row]`` is a contiguous ``block_bytes`` view into the mmap)."""

    def __init__(self, array: np.ndarray, block_bytes: int):
        self.array = array
        self.block_bytes = block_bytes


class PrimaryViewRuntime(DiskRuntime):
    """kvtier's scheduler-side disk runtime, with vLLM's primary memoryview
    in place of kvtier's CPU-buffer files: rank ``r``'s engine moves bytes
    between rank ``r``'s slab and rank ``r``'s page of the primary rows."""

    def __init__(self, rows: list[PrimaryRows], **kwargs: Any):
        self._rows = rows
        super().__init__(**kwargs)

    @override
    def _attach_at_start(self, rank: int) -> None:
        return  # the rows are vLLM's primary tier: nothing of kvtier's to map

    @override
    def _engine(self, rank: int) -> TransferEngine:
        engine = self._engines[rank]
        if engine is None:
            engine = TransferEngine(
                self._rows[rank],  # type: ignore[arg-type]  (duck-typed buffer)
                self.stores[rank],
                threads=self._threads,
            )
            self._engines[rank] = engine
        return engine

    @override
    def close(self) -> None:
        super().close()
        # Drop the views into vLLM's mmap so the primary tier can unmap it.
        self._rows = []
