"""kvtier's state is bounded by its tiers, not by the requests served.

A real in-process engine serves many more requests than its tiers hold
blocks: prompts drawn from a pool of shared prefixes (so blocks are stored,
spill, are evicted and come back), some aborted while running, with KV events
and self-describing payloads on. Every so many requests the test walks the
scheduler-side and worker-side connectors' objects (kvtier's, and vLLM's
offloading objects they drive, such as its KV-event tracker) and records the
length of every dict, set, list and deque it reaches. Each length must stay
within the tiers' capacity plus the requests in flight; the process's file
descriptors must not change and its threads grow only by thread pools
reaching their caps. A per-request or per-step entry that is never dropped
exceeds that bound long before the run ends, and one left by aborted
requests only keeps growing after the tiers filled, which is checked too.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import time
import types

import pytest

from kvtier.store.slot import slot_size
from kvtier.testing.engine import (
    get_connector,
    make_llm,
    offloading_kv_transfer_config,
    shutdown_llm,
    tiering_kv_transfer_config,
)
from kvtier.testing.model import make_prompt

pytestmark = pytest.mark.e2e

BLOCK = 32  # the offloaded block, as e2e's block_bytes fixture
CPU_BLOCKS, DISK_BLOCKS, GPU_BLOCKS = 12, 48, 40
IN_FLIGHT, MAX_PREFIX_BLOCKS = 6, 6
REQUESTS, SAMPLE_EVERY = 600, 100
DEADLINE_S = 300.0

# Objects of these modules are walked into; anything else (tensors, vLLM's
# model and configs, threads) is a leaf.
_FOLLOW = (
    "kvtier",
    "vllm.distributed.kv_transfer",
    "vllm.distributed.kv_events",
    "vllm.v1.kv_offload",
)
_CONTAINERS = (dict, set, frozenset, list, collections.deque)
_LEAVES = (int, float, str, bytes, bool, type, types.ModuleType, types.FunctionType)
# The harness's own record of hits is the test's, not the engine's.
_SKIP = {"vllm_config", "model_config", "cache_config", "kv_caches", "_kvtier_hits"}


def _attributes(obj):
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        yield from state.items()
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()) or ():
            slot = isinstance(name, str) and name not in ("__dict__", "__weakref__")
            if slot and hasattr(obj, name):
                yield name, getattr(obj, name)


def container_lengths(roots: dict[str, object], depth: int = 10) -> dict[str, int]:
    """{attribute path: length} of every container reachable from ``roots``
    through objects of kvtier's and vLLM's offloading modules (a container's
    first few elements are walked too: its values may hold containers)."""
    lengths: dict[str, int] = {}
    seen: set[int] = set()
    stack = [(name, obj, 0) for name, obj in roots.items()]
    while stack:
        path, obj, level = stack.pop()
        if obj is None or isinstance(obj, _LEAVES) or level > depth or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (*_CONTAINERS, tuple)):
            if not isinstance(obj, tuple):
                lengths[path] = max(lengths.get(path, 0), len(obj))
            values = obj.values() if isinstance(obj, dict) else obj
            for _, value in zip(range(3), values):
                stack.append((f"{path}[]", value, level + 1))
            continue
        if not (type(obj).__module__ or "").startswith(_FOLLOW):
            continue
        if hasattr(obj, "__len__") and hasattr(obj, "__iter__"):
            with contextlib.suppress(TypeError):  # kvtier's own (StampOrder)
                lengths[path + ".len()"] = len(obj)
        for name, value in _attributes(obj):
            if name not in _SKIP:
                stack.append((f"{path}.{name}", value, level + 1))
    return lengths


def _process() -> tuple[int, int]:
    with open("/proc/self/status") as f:
        threads = next(
            int(line.split()[1]) for line in f if line.startswith("Threads:")
        )
    return len(os.listdir("/proc/self/fd")), threads


def _prompts(seed: int):
    """Endless prompts: one of 60 documents (the lower numbers more often)
    and a tail of its own. A document is an earlier one's blocks plus one or
    two of its own, up to 6, so documents share prefixes; together they hold
    more blocks than the GPU cache and the tiers, so blocks are evicted and
    return from the CPU tier and from disk."""
    rng = random.Random(seed)
    docs: list[list[int]] = []
    for i in range(60):
        parent = docs[rng.randrange(i)] if i and rng.random() < 0.7 else []
        own = rng.randint(1, 2)
        blocks = parent[: MAX_PREFIX_BLOCKS - own] + [
            1000 + 10 * i + j for j in range(own)
        ]
        docs.append(blocks)
    while True:
        doc = docs[min(int(rng.expovariate(0.06)), 59)]
        prefix = [t for b in doc for t in make_prompt(b, BLOCK)]
        yield prefix + make_prompt(rng.randrange(1 << 30), rng.randint(1, 20))


def _config(mode: str, block_bytes: int, disk) -> dict:
    if mode == "tiering":
        return tiering_kv_transfer_config(
            CPU_BLOCKS * block_bytes, str(disk), DISK_BLOCKS * slot_size(block_bytes)
        )
    return offloading_kv_transfer_config(
        "TieredOffloadingSpec",
        "kvtier.connector",
        cpu_bytes_to_use=CPU_BLOCKS * block_bytes,
        disk_bytes_to_use=DISK_BLOCKS * slot_size(block_bytes),
        disk_path=str(disk),
        spill_watermark=0.5,
        self_describing_kv_events=True,
    )


def _churn(llm, requests: int, on_sample=None) -> None:
    """Serve ``requests`` prompts, ``IN_FLIGHT`` at a time, one in five
    longer and aborted at its third step; ``on_sample`` after every
    ``SAMPLE_EVERY`` of them."""
    from vllm import SamplingParams

    core = llm.llm_engine
    short = SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False)
    longer = SamplingParams(max_tokens=24, ignore_eos=True, detokenize=False)
    prompts, live, served, n, samples = _prompts(0), {}, 0, 0, 0
    deadline = time.monotonic() + DEADLINE_S
    while served < requests:
        assert time.monotonic() < deadline, f"{served} requests in {DEADLINE_S} s"
        while len(live) < IN_FLIGHT:
            n += 1
            rid = f"r{n}"
            params = longer if n % 5 == 0 else short
            core.add_request(rid, {"prompt_token_ids": next(prompts)}, params)
            live[rid] = 0
        for out in core.step():
            if out.finished and live.pop(out.request_id, None) is not None:
                served += 1
        for rid in list(live):
            live[rid] += 1
            if int(rid[1:]) % 5 == 0 and live[rid] == 3:  # abort while running
                core.abort_request([rid])
                del live[rid]
                served += 1
        if on_sample is not None and served >= SAMPLE_EVERY * (samples + 1):
            samples += 1
            on_sample()
    while live:  # let the last ones finish: the next engine starts clean
        assert time.monotonic() < deadline, f"{len(live)} requests still running"
        for out in core.step():
            if out.finished:
                live.pop(out.request_id, None)


def _disk_hits(llm) -> int:
    """Blocks served from kvtier's disk tier: loaded into the KV cache (full
    spec) or promoted to vLLM's CPU tier (tiering mode)."""
    from kvtier.connector.tiering import KvtierDiskTier

    manager = get_connector(llm).connector_scheduler.manager
    if hasattr(manager, "hierarchy"):
        return manager.hierarchy.stats.loads_disk
    (tier,) = [t for t in manager.secondary_tiers if isinstance(t, KvtierDiskTier)]
    return tier.stats.promotions_completed


@pytest.mark.parametrize("mode", ["full-spec", "tiering"])
def test_state_is_bounded_by_the_tiers_not_the_requests(
    model, block_bytes, tmp_path, mode
):
    """The full spec starts over the store an earlier engine left (a warm
    restart: its adopted blocks have no event payload until a hit makes
    one)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    config = _config(mode, block_bytes, disk)
    start = dict(
        num_gpu_blocks=GPU_BLOCKS,
        enable_kv_events=True,
        max_model_len=(MAX_PREFIX_BLOCKS + 2) * BLOCK,
    )
    if mode == "full-spec":
        llm = make_llm(model, config, **start)
        try:
            _churn(llm, 2 * SAMPLE_EVERY)
        finally:
            shutdown_llm(llm)
    llm = make_llm(model, config, **start)
    samples: list[dict[str, int]] = []
    processes: list[tuple[int, int]] = []
    try:
        roots = {"scheduler": get_connector(llm), "worker": get_kv_transfer_group()}

        def sample() -> None:
            samples.append(container_lengths(roots))
            processes.append(_process())

        _churn(llm, REQUESTS, sample)
        served_from_disk = _disk_hits(llm)
    finally:
        shutdown_llm(llm)
    assert served_from_disk > 0  # the workload reached the disk tier

    bound = CPU_BLOCKS + DISK_BLOCKS + IN_FLIGHT * (MAX_PREFIX_BLOCKS + 2) + 16
    paths = set().union(*samples)
    over = {
        p: [s.get(p, 0) for s in samples]
        for p in sorted(paths)
        if max(s.get(p, 0) for s in samples) > bound
    }
    assert not over, f"grew past {bound} entries over {REQUESTS} requests: {over}"
    # Nor does any keep growing once the tiers are full (from the second
    # sample on) by more than the requests in flight can hold: an entry left
    # by each aborted request alone (one in five) grows by ~80 there.
    slack = IN_FLIGHT * (MAX_PREFIX_BLOCKS + 2)
    growing = {
        p: [s.get(p, 0) for s in samples]
        for p in sorted(paths)
        if max(s.get(p, 0) for s in samples[2:]) - samples[1].get(p, 0) > slack
    }
    assert not growing, f"kept growing after the tiers filled: {growing}"
    # The walk reached the state it is meant to bound.
    assert any(".tracker." in p or "event" in p.lower() for p in paths), sorted(paths)
    assert sum(samples[-1].values()) > 0
    fds, threads = zip(*processes)
    assert set(fds[1:]) == {fds[1]}, fds  # after the first sample: helpers started
    assert max(threads[1:]) <= threads[1] + 4, threads
