"""What a SIGTERM to ``vllm serve`` keeps on disk for the next start.

The blocks only the CPU tier holds (below ``spill_watermark`` nothing
spills ahead) are lost with the engine unless its shutdown writes them:
kvtier's manager spills them all at shutdown, newest first, for up to
``SHUTDOWN_SPILL_S``. vLLM gives the engine core that time only with
``--shutdown-timeout`` above 0: at its default, 0, vLLM's process manager
kills the engine core at SIGTERM without waiting, which kvtier warns of at
start. Both are run: with 10 s the restarted server serves every
returning prompt from disk; with 0 not all of them (the negative control:
the same workload, nothing written at shutdown in time)."""

from __future__ import annotations

import signal
import sys
import uuid

import pytest

from kvtier.testing.model import build_tiny_llama

from .api_server import (
    BLOCK_TOKENS,
    PROMPT_TOKENS,
    api_server,
    complete,
    get,
    kv_transfer_config,
    total,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.serial,
    pytest.mark.skipif(sys.platform != "linux", reason="vllm serve on Linux"),
]

SEEDS = (1, 2, 3)
# The full blocks of a returning prompt a lookup can hit (its last token
# is always computed).
BLOCKS = (PROMPT_TOKENS - 1) // BLOCK_TOKENS
STOP_TIMEOUT_S = 90.0


def _config(disk: str) -> dict:
    """A CPU tier of 16 blocks that never spills ahead (watermark 1): the
    prompts' 12 blocks are only on CPU when the server stops."""
    kv = kv_transfer_config("full", disk)
    extra = kv["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = 16 * extra["cpu_bytes_to_use"] // 4
    extra["spill_watermark"] = 1.0
    kv["engine_id"] = f"kvtier-stop-{uuid.uuid4().hex[:12]}"
    return kv


@pytest.mark.parametrize("shutdown_timeout", [10, 0])
def test_a_sigterm_keeps_what_only_the_cpu_tier_held(tmp_path, shutdown_timeout):
    model = build_tiny_llama()
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    args = ["--shutdown-timeout", str(shutdown_timeout)]
    with api_server(model, _config(str(disk)), first_log, args) as (base, server):
        firsts = [complete(base, model, seed) for seed in SEEDS]
        before_stop = get(f"{base}/metrics")
        # What an operator's `kill` or `systemctl stop` sends the server.
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=STOP_TIMEOUT_S)
    said = first_log.read_text()
    spilled = total(before_stop, "vllm:kv_offload_kvtier_spills_total")
    assert spilled == 0, said[-3000:]  # all of it only on CPU at the SIGTERM
    warned = "kvtier: vLLM's shutdown_timeout is 0" in said
    assert warned == (shutdown_timeout == 0), said[-3000:]

    with api_server(model, _config(str(disk)), second_log) as (base, _):
        again = [complete(base, model, seed) for seed in SEEDS]
        after = get(f"{base}/metrics")
    assert again == firsts
    loaded = total(after, "vllm:kv_offload_kvtier_loaded_blocks_total", tier="disk")
    if shutdown_timeout:
        assert loaded == len(SEEDS) * BLOCKS, second_log.read_text()[-3000:]
    else:
        assert loaded < len(SEEDS) * BLOCKS, said[-3000:]
