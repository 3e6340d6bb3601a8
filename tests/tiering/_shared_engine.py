"""One engine of the shared-tier e2e test (test_shared_tier_e2e.py), run in
its own process: ``PortableTieringSpec`` with ``secondary_tiers`` = [kvtier's
disk tier on a local directory, vLLM's ``fs`` tier on a shared root].

``python _shared_engine.py ROLE LOCAL_DIR SHARED_ROOT`` prints one line
``KVTIER-RESULT {json}``. ROLE ``a``: run PROMPT once. ROLE ``b``: run PROMPT,
push it out of the GPU cache and the CPU tier with PUSHERS, run it again;
KV events (self-describing) are collected by a real ZMQ subscriber.
ROLE ``dead``: ROLE b's workload with the shared root given as-is (absent
or unusable), for the failure test. A uses vLLM's ``fs`` tier, B and dead
kvtier's ``SharedFsTier`` (the same files, behind a guard).
ROLES ``obj-a`` and ``obj-b``: A's and B's workloads with vLLM's ``obj`` tier
(NIXL's OBJ plugin) as the shared tier; SHARED_ROOT is then
``HOST:PORT/BUCKET`` of an S3-compatible server (test_obj_tier_e2e.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvtier.testing.model import make_prompt  # noqa: E402

BLOCK_TOKENS = 32
BLOCKS_PER_PROMPT = 4
PROMPT_LEN = BLOCKS_PER_PROMPT * BLOCK_TOKENS + 5
GPU_BLOCKS = 20
CPU_CHUNKS = 8
LOCAL_BLOCKS = 64
MAX_TOKENS = 8
PROMPT = make_prompt(300, PROMPT_LEN)
# Seven prompts of four blocks push PROMPT out of the 19-block GPU cache and
# the 8-chunk CPU tier (cf. tests/tiering/test_tiering_e2e.py).
PUSHERS = [make_prompt(301 + i, PROMPT_LEN) for i in range(7)]


def run_engine(
    role: str,
    local: Path,
    shared: Path | str,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> dict:
    """Run this script as ROLE in a fresh process; its KVTIER-RESULT."""
    full_env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **(env or {}))
    proc = subprocess.run(
        [sys.executable, __file__, role, str(local), str(shared)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("KVTIER-RESULT ")]
    assert proc.returncode == 0 and found, proc.stderr[-4000:]
    return json.loads(found[-1].split(" ", 1)[1])


def baseline_outputs() -> dict[str, list]:
    """The workload's outputs on one engine without offloading."""
    from kvtier.testing.engine import engine, run_prompts
    from kvtier.testing.model import build_tiny_llama

    model = build_tiny_llama()
    with engine(model, None, num_gpu_blocks=GPU_BLOCKS) as llm:
        first = run_prompts(llm, [PROMPT], MAX_TOKENS).outputs
        pushers = [run_prompts(llm, [p], MAX_TOKENS).outputs[0] for p in PUSHERS]
        again = run_prompts(llm, [PROMPT], MAX_TOKENS).outputs
    return {"first": first, "pushers": pushers, "again": again}


def assert_second_tier_then_local(b: dict, baseline: dict) -> None:
    """Engine B's run when its local disk started empty and the prompt sat in
    the tier after it (shared fs, object store): the first hit came from
    that tier, the blocks were kept on B's local disk, and the prompt's
    return, pushed out of GPU and CPU, came from local NVMe; every output
    equals the no-offload baseline."""
    full = BLOCKS_PER_PROMPT * BLOCK_TOKENS
    # Both STORAGE tiers count as "disk" in vLLM's hit source; B's local
    # tier promoted nothing yet, so these came from the later tier.
    assert b["first"]["hits"] == [{"disk": full}]
    assert b["after_first"]["promotions_completed"] == 0
    assert b["first"]["outputs"] == baseline["first"]
    # Kept on B's local disk (pulled from the primary rows they landed in).
    assert b["after_first"]["pulled"] == BLOCKS_PER_PROMPT
    assert b["after_first"]["stores_completed"] == BLOCKS_PER_PROMPT
    # Pushed out of GPU and CPU, the next hit is B's local disk tier.
    assert b["pushers"] == baseline["pushers"]
    assert b["again"]["hits"] == [{"disk": full}]
    assert b["after_again"]["promotions_completed"] == BLOCKS_PER_PROMPT
    assert b["after_again"]["promotion_failures"] == 0
    assert b["again"]["outputs"] == baseline["again"]


def shared_tiering_config(
    block_bytes: int,
    local: str,
    shared: str,
    *,
    events: bool = False,
    shared_type: str = "fs",
) -> dict[str, Any]:
    from kvtier.store.slot import slot_size
    from kvtier.testing.engine import offloading_kv_transfer_config

    extra: dict[str, Any] = {}
    if events:
        extra["self_describing_kv_events"] = True
    return offloading_kv_transfer_config(
        "PortableTieringSpec",
        "kvtier.connector.tiering",
        cpu_bytes_to_use=CPU_CHUNKS * block_bytes,
        secondary_tiers=[
            {  # first: asked first, so a local hit wins over the shared tier
                "type": "KvtierDiskTier",
                "module_path": "kvtier.connector.tiering",
                "disk_path": local,
                "disk_bytes_to_use": LOCAL_BLOCKS * slot_size(block_bytes),
                "disk_io": "posix",
            },
            obj_tier_entry(shared)
            if shared_type == "obj"
            else {
                "type": shared_type,
                **(
                    {"module_path": "kvtier.connector.tiering"}
                    if shared_type == "SharedFsTier"
                    else {}
                ),
                "root_dir": shared,
                "locality": "REMOTE",
                "enable_kv_events": True,
                "n_read_threads": 2,
                "n_write_threads": 2,
            },
        ],
        **extra,
    )


def obj_tier_entry(endpoint_bucket: str) -> dict[str, Any]:
    """vLLM's ``obj`` tier on ``HOST:PORT/BUCKET`` (plain http, the test's
    local S3-compatible server, which takes any credentials)."""
    endpoint, bucket = endpoint_bucket.rsplit("/", 1)
    return {
        "type": "obj",
        "locality": "REMOTE",
        "prefix": "kvcache",
        "io_threads": 2,
        "store_config": {
            "bucket": bucket,
            "endpoint_override": endpoint,
            "scheme": "http",
            "region": "us-east-1",
            "access_key": "testing",
            "secret_key": "testing",
        },
    }


def _event(ev: Any) -> dict[str, Any]:
    def h(x: Any) -> Any:
        return x.hex() if isinstance(x, bytes) else x

    return {
        "type": type(ev).__name__,
        "medium": getattr(ev, "medium", None),
        "ownership": getattr(ev, "ownership", None),
        "locality": getattr(ev, "locality", None),
        "block_hashes": [h(x) for x in getattr(ev, "block_hashes", ()) or ()],
        "token_ids": list(getattr(ev, "token_ids", ()) or ()),
        "block_size": getattr(ev, "block_size", None),
    }


def main() -> None:
    from kvtier.testing.engine import (
        engine_with_events,
        get_connector,
        run_prompts,
        wait_events_delivered,
    )
    from kvtier.testing.model import build_tiny_llama, kv_bytes_per_block

    role, local, shared = sys.argv[1:4]
    obj = role.startswith("obj-")
    role = role.removeprefix("obj-")
    model = build_tiny_llama()
    cfg = shared_tiering_config(
        kv_bytes_per_block(model, BLOCK_TOKENS),
        local,
        shared,
        events=role == "b" and not obj,
        # A: vLLM's own fs tier; B and the failure runs: kvtier's guard
        # around it (the same files, so B reads what A wrote).
        shared_type="obj" if obj else "fs" if role == "a" else "SharedFsTier",
    )
    out: dict[str, Any] = {}
    with engine_with_events(
        model, cfg, num_gpu_blocks=GPU_BLOCKS, enable_kv_events=role == "b" and not obj
    ) as (sub, llm):
        manager = get_connector(llm).connector_scheduler.manager
        tier = manager.secondary_tiers[0]
        assert type(tier).__name__ == "KvtierDiskTier", tier

        def stats() -> dict[str, int]:
            return dataclasses.asdict(tier.stats)

        first = run_prompts(llm, [PROMPT], MAX_TOKENS)
        out["first"] = {"outputs": first.outputs, "hits": first.hits_by_source}
        out["after_first"] = stats()
        if role != "a":
            pushed = [run_prompts(llm, [p], MAX_TOKENS).outputs[0] for p in PUSHERS]
            again = run_prompts(llm, [PROMPT], MAX_TOKENS)
            out["pushers"] = pushed
            out["again"] = {"outputs": again.outputs, "hits": again.hits_by_source}
            out["after_again"] = stats()
        if role == "b" and not obj:
            out["events_delivered"] = wait_events_delivered(llm, sub, timeout=30)
            out["events"] = [
                _event(e.event) for e in sub.events if e.medium == "STORAGE"
            ]
        out["local_resident"] = len(tier.tier)
        shared_tier = manager.secondary_tiers[1]
        out["shared_online"] = getattr(shared_tier, "online", True)
    print("KVTIER-RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
