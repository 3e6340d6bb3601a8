"""Scheduler-side bookkeeping of kvtier: tiers, policies, the cascading
hierarchy and its residency events. Pure Python: no I/O, no vLLM."""

# The built-in policies beyond LRU register themselves on import, so the
# registry holds every one whenever kvtier.tiers is imported.
from kvtier.tiers import scan_resistant  # noqa: F401
