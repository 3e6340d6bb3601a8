"""Helpers for kvtier's tests, benchmarks and demo; never used by the plugin.

- :mod:`kvtier.testing.engine`: a real vLLM engine on a tiny random model,
  per-source hit recording.
- :mod:`kvtier.testing.model`: the tiny random models, built locally (no
  download), and prompts for them.
- :mod:`kvtier.testing.events`: a subscriber of vLLM's KV events.
- :mod:`kvtier.testing.residency`: the residency that kvtier's own events
  imply, and a hierarchy's.
- :mod:`kvtier.testing.offloading`: vLLM's ``OffloadingConfig`` and kvtier's
  spec built outside an engine.
- :mod:`kvtier.testing.kv_corruption`: wrong bytes in the KV cache after
  each load, the negative control of every load path.
- :mod:`kvtier.testing.oracles`: exhaustive and clairvoyant reference
  points for the offline optimum (``kvtier.tiers.optimum``).
- :mod:`kvtier.testing.procs`: an engine's processes and their threads'
  names, from ``/proc`` (imports nothing beyond the standard library).
- :mod:`kvtier.testing.host`: the CPU tier's private directory under a
  base of the test's choosing (no vLLM import).
- :mod:`kvtier.testing.state`: reads and moves of the plugin's inner state
  (a slot's verdict or header, a clean CPU eviction, counters) that only
  tests and benchmarks need (no vLLM import).

Importing this package imports nothing else; each module imports vLLM.
"""
