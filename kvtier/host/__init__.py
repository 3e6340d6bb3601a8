"""The host side: the CPU tier's shared memory (``cpu_tier``), copies between the KV cache and host rows on the CPU
platform (``block_copy``), and where background work runs (``placement``).
Never imports vLLM."""
