"""Stateful property test of TierHierarchy against a reference model.

The machine plays scheduler *and* worker: it issues random stores, loads,
completions (successful or failed), spill jobs and loads (disk reads that
may fail verification, with promotion rows) that finish in random order,
and simulates the bytes in every CPU and disk slot. After
every step it checks the contract:

- capacities are never exceeded;
- a pinned or pending block is never evicted or overwritten;
- every load reads a slot that really holds that key's bytes (no slot reuse
  race can serve another block's data);
- replaying all events gives exactly the residency per medium;
- prefix lookup equals the model's (the replayed residency);
- each tier's victim index equals a full scan of the tier (same blocks, in
  policy order).
"""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvtier.testing.residency import replay, residency
from kvtier.tiers.events import MEDIUM_CPU, MEDIUM_DISK
from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.plans import Residency
from kvtier.tiers.policy import policy_names
from tests.tiers.index_check import check_index, prefix_hits

KEYS = st.integers(min_value=0, max_value=11)


class HierarchyMachine(RuleBasedStateMachine):
    @initialize(
        cpu=st.integers(1, 6),
        disk=st.integers(0, 10),
        cpu_policy=st.sampled_from(policy_names()),
        disk_policy=st.sampled_from(policy_names()),
        watermark=st.sampled_from([0.0, 0.5, 0.75, 1.0]),
    )
    def setup(self, cpu, disk, cpu_policy, disk_policy, watermark):
        self.h = TierHierarchy(
            cpu,
            disk,
            cpu_policy=cpu_policy,
            disk_policy=disk_policy,
            spill_watermark=watermark,
            spill_batch=2,
        )
        self.events = []
        # Simulated bytes: slot -> key whose data is there (None = garbage).
        self.cpu_bytes: dict[int, object] = {}
        self.disk_bytes: dict[int, object] = {}
        self.pending_stores: list[tuple[list, list[int]]] = []
        self.loads: list[tuple[list, list]] = []
        self.spills: list = []
        self.spill_failed: set = set()

    # ------------------------------------------------------------- helpers

    def _drain_orders(self):
        self.spills.extend(self.h.take_spills())

    def _collect_events(self):
        self.events.extend(self.h.take_events())

    # --------------------------------------------------------------- rules

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4, unique=True))
    def store(self, keys):
        plan = self.h.prepare_store(keys)
        if plan is not None:
            assert len(plan.keys_to_store) == len(plan.cpu_slots)
            for key in plan.keys_to_store:
                assert key in keys
            for slot in plan.cpu_slots:
                # A slot handed out for writing must not be read by anyone.
                for _id, _lkeys, locs in self.loads:
                    for loc in locs:
                        assert not (loc.medium == MEDIUM_CPU and loc.slot == slot)
                        assert loc.promote_slot != slot
                for order in self.spills:
                    assert all(it.src_slot != slot for it in order.items)
            if plan.keys_to_store:
                self.pending_stores.append((plan.keys_to_store, plan.cpu_slots))
        self._drain_orders()
        self._collect_events()

    @precondition(lambda self: self.pending_stores)
    @rule(data=st.data(), success=st.booleans())
    def finish_store(self, data, success):
        idx = data.draw(st.integers(0, len(self.pending_stores) - 1))
        keys, slots = self.pending_stores.pop(idx)
        if success:
            for key, slot in zip(keys, slots):
                self.cpu_bytes[slot] = key  # the worker wrote the block
        self.h.complete_store(keys, success=success)
        self._drain_orders()
        self._collect_events()

    @rule(data=st.data(), extra=st.lists(KEYS, max_size=3, unique=True))
    def load(self, data, extra):
        # Mostly load what is resident (plus maybe a miss at the end), so
        # loads and evictions overlap often.
        res = residency(self.h)
        ready = sorted(res[MEDIUM_CPU] | res[MEDIUM_DISK])
        head = (
            data.draw(st.lists(st.sampled_from(ready), max_size=3, unique=True))
            if ready
            else []
        )
        keys = head + [k for k in extra if k not in head]
        if not keys:
            return
        n = prefix_hits(self.h, keys)
        if n == 0:
            return
        plan = self.h.prepare_load(keys[:n])
        # The worker reads now: every location must hold that key's bytes.
        for key, loc in zip(plan.keys, plan.locations):
            store = self.cpu_bytes if loc.medium == MEDIUM_CPU else self.disk_bytes
            assert store.get(loc.slot) == key, (key, loc)
        self.loads.append((plan.load_id, plan.keys, plan.locations))
        self._collect_events()

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def finish_load(self, data):
        idx = data.draw(st.integers(0, len(self.loads) - 1))
        load_id, keys, locs = self.loads.pop(idx)
        # Bytes must still be intact at the end of the read.
        failed, io_failed = set(), set()
        for key, loc in zip(keys, locs):
            store = self.cpu_bytes if loc.medium == MEDIUM_CPU else self.disk_bytes
            assert store.get(loc.slot) == key
            if loc.medium == MEDIUM_DISK:
                outcome = data.draw(st.integers(0, 9))
                if outcome == 0:
                    failed.add(key)  # the worker's verification refused it
                elif outcome == 1:
                    io_failed.add(key)  # its read failed (an I/O error)
        for key, loc in zip(keys, locs):
            if loc.promote_slot is not None:
                # The worker copies only verified blocks up.
                lost = key in failed or key in io_failed
                self.cpu_bytes[loc.promote_slot] = None if lost else key
        self.h.complete_load(load_id, failed, io_failed=io_failed)
        self._drain_orders()
        self._collect_events()

    @precondition(lambda self: self.spills)
    @rule(data=st.data())
    def finish_spill(self, data):
        idx = data.draw(st.integers(0, len(self.spills) - 1))
        order = self.spills.pop(idx)
        failed = set()
        for item in order.items:
            assert self.cpu_bytes.get(item.src_slot) == item.key
            if data.draw(st.integers(0, 9)) == 0:
                failed.add(item.key)
                self.spill_failed.add(item.key)
                self.disk_bytes[item.dst_slot] = None  # torn write
            else:
                self.disk_bytes[item.dst_slot] = item.key
        self.h.complete_spill(order.job_id, failed)
        self._drain_orders()
        self._collect_events()

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4, unique=True))
    def touch(self, keys):
        self.h.touch(keys)

    # ---------------------------------------------------------- invariants

    @invariant()
    def capacities(self):
        assert len(self.h.cpu) <= self.h.cpu.capacity
        if self.h.disk is not None:
            assert len(self.h.disk) <= self.h.disk.capacity
        slots = [b.slot for _, b in self.h.cpu.items()]
        assert len(slots) == len(set(slots))

    @invariant()
    def pinned_and_pending_survive(self):
        for keys, slots in self.pending_stores:
            for key, slot in zip(keys, slots):
                block = self.h.cpu.get(key)
                assert block is not None and block.slot == slot
        for _id, keys, locs in self.loads:
            for key, loc in zip(keys, locs):
                tier = self.h.cpu if loc.medium == MEDIUM_CPU else self.h.disk
                block = tier.get(key)
                assert block is not None and block.slot == loc.slot and block.pins > 0
                if loc.promote_slot is not None:
                    # The promotion row stays the key's, unreadable, until
                    # the load completes.
                    row = self.h.cpu.get(key)
                    assert row is not None and row.slot == loc.promote_slot
                    assert not self.h.cpu.is_ready(key)

    @invariant()
    def events_replay_to_residency(self):
        self._collect_events()
        assert replay(self.events) == residency(self.h)

    @invariant()
    def ready_blocks_hold_their_bytes(self):
        res = residency(self.h)
        for key in res[MEDIUM_CPU]:
            assert self.cpu_bytes.get(self.h.cpu.get(key).slot) == key
        for key in res[MEDIUM_DISK]:
            assert self.disk_bytes.get(self.h.disk.get(key).slot) == key

    @invariant()
    def prefix_lookup_matches_model(self):
        res = replay(self.events)
        ready = res[MEDIUM_CPU] | res[MEDIUM_DISK]
        probe = list(range(0, 12, 2))
        expected = 0
        for key in probe:
            if key not in ready:
                break
            expected += 1
        assert prefix_hits(self.h, probe) == expected
        for key in probe:
            r = self.h.lookup(key)
            assert r.is_hit == (key in ready)
            if r is Residency.HIT_DISK:
                assert key in res[MEDIUM_DISK] and key not in res[MEDIUM_CPU]

    @invariant()
    def cpu_evictions_keep_a_copy(self):
        # With a disk tier, a block leaves the CPU tier by eviction only
        # when it is ready on disk at that moment (or the disk refused it).
        if self.h.disk is None:
            return
        self._collect_events()
        disk: set = set()
        cpu: set = set()
        declined: set = set()  # CPU keys whose disk copy the disk evicted
        for ev in self.events:
            keys = set(ev.keys)
            if ev.medium == MEDIUM_DISK:
                if ev.removed:
                    disk -= keys
                    declined |= keys & cpu
                else:
                    disk |= keys
            elif ev.removed:
                if ev.reason == "evict":
                    for key in ev.keys:
                        assert (
                            key in disk or key in self.spill_failed or key in declined
                        ), key
                cpu -= keys
                declined -= keys
            else:
                cpu |= keys

    @invariant()
    def victim_index_matches_full_scan(self):
        # Each tier's index of eligible blocks (what victims walks) holds
        # exactly the evictable blocks its filter allows, in policy order:
        # the same victims, in the same order, as scanning the whole tier.
        check_index(self.h.cpu)
        if self.h.disk is not None:
            check_index(self.h.disk)

    @invariant()
    def no_dirty_drop_with_disk(self):
        # With a disk tier, a CPU removal by eviction is only legal when the
        # block is also on disk or its spill failed; replay already checks
        # consistency, here we check the dirty queue only holds CPU-ready,
        # disk-absent keys.
        if self.h._spills is None:
            return
        for key in self.h._spills.dirty:
            assert self.h.cpu.is_ready(key)
            assert not self.h.disk.is_ready(key)


TestHierarchy = HierarchyMachine.TestCase
TestHierarchy.settings = settings(
    max_examples=60,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class RestartResetMachine(HierarchyMachine):
    """The same machine over a warm restart (blocks adopted on disk at
    start), ``reset`` (vLLM's reset_cache, after the manager settled the
    spills in flight) and drains with a bounded backlog, as the connector
    takes them (``take_events(backlog=k)``): every drain replays without a
    contradiction, and with what the log still owes, to the residency."""

    @initialize(
        cpu=st.integers(1, 6),
        disk=st.integers(0, 10),
        watermark=st.sampled_from([0.0, 0.5, 1.0]),
        restored=st.lists(KEYS, unique=True, max_size=10),
        backlog=st.sampled_from([None, 0, 1, 2, 3]),
        data=st.data(),
    )
    def setup(self, cpu, disk, watermark, restored, backlog, data):
        super().setup(cpu, disk, "lru", "lru", watermark)
        self.backlog = backlog
        restored = restored[:disk]
        if restored:
            slots = data.draw(st.permutations(range(disk)))[: len(restored)]
            self.h.restore_disk(list(zip(restored, slots)))
            for key, slot in zip(restored, slots):
                self.disk_bytes[slot] = key

    def _collect_events(self):
        self.events.extend(self.h.take_events(self.backlog))
        replay(self.events)  # raises on a contradiction

    @rule()
    def reset(self):
        self._drain_orders()
        for order in self.spills:
            for item in order.items:
                self.disk_bytes[item.dst_slot] = item.key
            self.h.complete_spill(order.job_id, ())
        self.spills = []
        self.h.reset()
        # vLLM completes no store or load from before the reset.
        self.pending_stores, self.loads = [], []
        self._collect_events()

    @invariant()
    def events_replay_to_residency(self):
        self._collect_events()
        owed = copy.deepcopy(self.h._events).take()
        assert replay(self.events + owed) == residency(self.h)

    # Both read the residency from the events taken so far, which a
    # backlog delays.
    @invariant()
    def prefix_lookup_matches_model(self):
        pass

    @invariant()
    def cpu_evictions_keep_a_copy(self):
        pass


TestRestartReset = RestartResetMachine.TestCase
TestRestartReset.settings = settings(
    max_examples=100,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
