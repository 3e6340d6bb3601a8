"""kvtier: a multi-tier KV-cache hierarchy (GPU -> CPU DRAM -> NVMe) for vLLM.

Subpackages:
  kvtier.tiers      scheduler-side bookkeeping (no I/O, no vLLM)
  kvtier.io         worker-side data movement and the on-disk format (no vLLM)
  kvtier.connector  the vLLM plugin (the only code that imports vLLM)
"""

__version__ = "0.1.0"
