"""The disk tier's store: one slot (``slot``), the slab files (``slabs``),
the write path (``store``), the one reader (``reader``; in a process of its
own: ``read_process``), the one header scan (``scan``), spills and
promotions (``transfers``) and the I/O back ends (``backends``). Never
imports vLLM; runs in the scheduler process (writes, spills, promotions) and
in the workers (loads)."""
