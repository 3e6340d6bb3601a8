"""Real-engine tests. Every engine here is in-process and offline: pinned
before any test module builds one (vLLM caches its env at the first engine)."""

from kvtier.testing.engine import use_in_process_engines

use_in_process_engines()
