"""The full spec's worker side (one per TP rank): vLLM's worker contract
(:mod:`~kvtier.connector.worker.worker`), the load thread
(:mod:`~kvtier.connector.worker.load_runner`), a job's plan, bookkeeping and
errors (``job_plan``, ``job_book``, ``job_errors``), the KV cache checks
(``kv_layout``) and the accelerator copy path (``device_copy``)."""
