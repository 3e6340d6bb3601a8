"""The full spec's worker side (one per TP rank): vLLM's worker contract
(:mod:`~kvtier.connector.worker.worker`), the load pipeline
(:mod:`~kvtier.connector.worker.pipeline`), a job's plans and bookkeeping
(``plans``, ``jobs``), the KV cache checks (``kv_layout``) and the
accelerator copy path (``device_copy``)."""
