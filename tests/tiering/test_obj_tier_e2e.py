"""vLLM's ``obj`` tier under kvtier's local tier: two real engines, one bucket.

Each engine runs ``PortableTieringSpec`` with ``secondary_tiers`` = [kvtier's
disk tier on its own local directory, vLLM's ``obj`` tier], in its own
process (tests/tiering/_shared_engine.py, roles ``obj-a`` and ``obj-b``). The
``obj`` tier is vLLM's, unmodified, on real NIXL (its OBJ plugin, the AWS SDK
inside) against a real S3-compatible server: moto's, bound to 127.0.0.1 on an
ephemeral port, in its own process (tests/tiering/_s3_server.py), stopped by
the test.

Engine A computes a prompt and exits: its blocks are objects in the bucket.
Engine B, fresh, with an empty local disk, gets the prompt from the bucket
(outputs equal the no-offload baseline), keeps it on its local disk, and
serves the prompt's next hit from there. The server's request log shows B
fetching each of the prompt's objects exactly once. A second test runs an
engine whose bucket does not exist.

Needs nixl-cu12, nixl and moto's S3 server: ``bash scripts/install-obj-deps.sh``
(scripts/setup-venv.sh runs it). Without them the test skips, and fails under
``CI=true``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from ._s3_server import S3Server
from ._shared_engine import (
    BLOCK_TOKENS,
    BLOCKS_PER_PROMPT,
    assert_second_tier_then_local,
    run_engine,
)

pytestmark = pytest.mark.e2e
FULL = BLOCKS_PER_PROMPT * BLOCK_TOKENS
BUCKET = "kvtier-test"
# The modules vLLM's obj tier and the server need.
NEEDED = ("nixl", "nixl_cu12", "moto", "flask", "flask_cors")
# The AWS SDK must not look for instance metadata (169.254.169.254): the
# test talks to 127.0.0.1 and nothing else.
ENGINE_ENV = {"AWS_EC2_METADATA_DISABLED": "true"}

MISSING = [m for m in NEEDED if importlib.util.find_spec(m) is None]
UNDER_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
MESSAGE = (
    f"vLLM's obj tier test needs {', '.join(MISSING)}: run "
    "`PYTHON=.venv/bin/python bash scripts/install-obj-deps.sh`"
)
if MISSING and not UNDER_CI:  # before the baseline engine runs
    pytest.skip(MESSAGE, allow_module_level=True)


@pytest.fixture
def s3(tmp_path):
    if MISSING:  # under CI: a failure, not a skip
        pytest.fail(MESSAGE)
    server = S3Server(tmp_path / "s3")
    try:
        server.call("PUT", f"/{BUCKET}")  # create the bucket
        yield server
    finally:
        server.stop()


def object_gets(requests: list[tuple[str, str]], bucket: str = BUCKET) -> list[str]:
    prefix = f"/{bucket}/"
    return sorted(
        p.removeprefix(prefix)
        for m, p in requests
        if m == "GET" and p.startswith(prefix) and len(p) > len(prefix)
    )


def test_second_engine_gets_the_prompt_from_the_object_store_then_locally(
    shared_baseline, s3, tmp_path
):
    baseline = shared_baseline
    local_a, local_b = tmp_path / "a", tmp_path / "b"
    local_a.mkdir()
    local_b.mkdir()
    target = f"{s3.endpoint}/{BUCKET}"

    a = run_engine("obj-a", local_a, target, env=ENGINE_ENV)
    assert a["first"]["outputs"] == baseline["first"]
    assert a["first"]["hits"] == [{}]  # computed
    assert a["local_resident"] == BLOCKS_PER_PROMPT  # cascaded to A's disk
    stored = s3.keys(BUCKET)  # and written through to the bucket
    assert len(stored) == BLOCKS_PER_PROMPT, stored
    assert all(k.startswith("kvcache/") and k.endswith(".bin") for k in stored)
    assert object_gets(s3.requests()) == []  # A loaded nothing from the bucket

    mark = len(s3.requests())
    b = run_engine("obj-b", local_b, target, env=ENGINE_ENV)
    # Fresh engine, empty local disk: from the later tier, then kept locally.
    assert_second_tier_then_local(b, baseline)
    # Over B's whole run the server sent each of A's objects once: the first
    # hit; the second came from local NVMe, not from the bucket.
    assert object_gets(s3.requests()[mark:]) == stored


def test_missing_bucket_costs_misses_only(shared_baseline, s3, tmp_path):
    """The bucket does not exist. vLLM's start-up probe (one existence query)
    does not notice: the engine starts, every store to the bucket fails, every
    prompt is served right, and the local tier still serves the return."""
    baseline = shared_baseline
    local = tmp_path / "local"
    local.mkdir()
    missing = "no-such-bucket"
    out = run_engine("obj-dead", local, f"{s3.endpoint}/{missing}", env=ENGINE_ENV)
    assert out["first"]["outputs"] == baseline["first"]
    assert out["pushers"] == baseline["pushers"]
    assert out["again"]["outputs"] == baseline["again"]
    assert out["again"]["hits"] == [{"disk": FULL}]
    assert out["after_again"]["promotions_completed"] == BLOCKS_PER_PROMPT
    puts = [p for m, p in s3.requests() if m == "PUT" and p.startswith(f"/{missing}/")]
    assert puts, "the obj tier tried to store"
    assert object_gets(s3.requests(), missing) == []  # nothing came from there
