"""The disk tier's store: the slot format, the slab files, the write path,
the verified read paths, spill and promotion transfers, and the I/O back
ends (``kvtier.store.backends``). Never imports vLLM; runs in the scheduler
process (writes, spills, promotions) and in the workers (loads)."""
