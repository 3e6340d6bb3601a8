"""kvtier: a multi-tier KV-cache hierarchy (GPU -> CPU DRAM -> NVMe) for vLLM.

Subpackages:
  kvtier.tiers      scheduler-side bookkeeping (no I/O, no vLLM)
  kvtier.store      the disk store: slot format, slab files, writes, verified
                    reads, spill/promote transfers, I/O back ends (no vLLM)
  kvtier.host       the host side: the CPU tier's shared memory, block copies
                    in host memory, where background work runs (no vLLM)
  kvtier.safe_open  opening kvtier's own files without trusting their names
  kvtier.connector  the vLLM plugin (the only code that imports vLLM):
                    the full spec, its ``scheduler`` and ``worker`` sides,
                    and the ``tiering`` mode (vLLM's TieringOffloadingSpec)
  kvtier.tools      the operator's tools: the ``kvtier`` CLI, sizing,
                    traces, the KV events subscriber
  kvtier.log        kvtier's loggers, named under vLLM's ``vllm`` logger
  (testing)         helpers for tests and benchmarks, never imported here
"""

__version__ = "0.1.0"
