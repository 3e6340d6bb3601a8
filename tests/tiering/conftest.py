"""Fixtures shared by the shared-tier e2e tests (fs and obj)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def shared_baseline() -> dict[str, list]:
    """_shared_engine.py's workload on one engine without offloading (run
    once for test_shared_tier_e2e.py and test_obj_tier_e2e.py)."""
    from ._shared_engine import baseline_outputs

    return baseline_outputs()
