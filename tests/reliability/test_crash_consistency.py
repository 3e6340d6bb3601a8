"""Crash consistency: a writer process is SIGKILLed while it spills; the
reopened store serves every slot either as exactly the bytes its header
names or not at all, ``verify`` flags exactly the damaged slots, and a
restored hierarchy counts only intact blocks and reuses damaged slots."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from _spill_writer import block_for, crash_fingerprint, key_for
from reliability_common import SENTINEL

import kvtier
from kvtier.host.cpu_tier import CpuBlockBuffer
from kvtier.store.backends.posix import PosixBackend
from kvtier.store.slot import HEADER_SIZE, ReadOutcome, SlotHeader
from kvtier.store.store import DiskStore
from kvtier.store.transfers import TransferEngine
from kvtier.testing.faults import FaultInjectingBackend, FaultPlan, FaultRule, on_slot
from kvtier.testing.residency import replay, residency
from kvtier.testing.state import verify
from kvtier.tiers.events import TierEvent
from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.plans import Residency

BLOCK = 512 * 1024
SLOTS = 32
WRITER = Path(__file__).with_name("_spill_writer.py")
REPO = Path(kvtier.__file__).resolve().parent.parent


@dataclass
class Survey:
    """What a reopened store holds."""

    good: dict[int, SlotHeader] = field(default_factory=dict)
    damaged: set[int] = field(default_factory=set)  # header OK, payload not
    invalid: set[int] = field(default_factory=set)  # empty or bad header


def open_store(path: Path) -> DiskStore:
    return DiskStore(
        [str(path)], SLOTS, BLOCK, crash_fingerprint(BLOCK), backend=PosixBackend(2)
    )


def survey(store: DiskStore) -> Survey:
    s = Survey()
    out = np.empty(BLOCK, np.uint8)
    for slot, hdr, outcome in store.scan():
        out[:] = SENTINEL
        if outcome is ReadOutcome.OK:
            assert hdr is not None
            got = store.read_block(slot, hdr.key, out)
            if got is ReadOutcome.OK:
                # Served: it must be exactly the block its header names.
                assert np.array_equal(out, block_for(hdr.key, BLOCK)), slot
                s.good[slot] = hdr
            else:
                assert got in (ReadOutcome.CHECKSUM_MISMATCH, ReadOutcome.BAD_HEADER)
                assert (out == SENTINEL).all()
                s.damaged.add(slot)
        else:
            # Nothing else can happen to a slab of full size and our layout.
            assert outcome in (ReadOutcome.EMPTY, ReadOutcome.BAD_HEADER), outcome
            assert store.read_block(slot, b"any key", out) is not ReadOutcome.OK
            s.invalid.add(slot)
    # verify() (full read, no key) flags exactly the damaged slots among
    # those with an intact header, and passes exactly the good ones.
    verified = {slot: verify(store, slot) for slot in range(SLOTS)}
    assert {s_ for s_, o in verified.items() if o is ReadOutcome.OK} == set(s.good)
    assert {
        s_
        for s_ in range(SLOTS)
        if s_ not in s.invalid and verified[s_] is not ReadOutcome.OK
    } == s.damaged
    keys = [h.key for h in s.good.values()]
    assert len(set(keys)) == len(keys)  # a key lives in one slot at most
    return s


def restore_and_reuse(store: DiskStore, s: Survey) -> None:
    """Warm restart into a TierHierarchy, then refill every free slot."""
    h = TierHierarchy(cpu_blocks=SLOTS, disk_blocks=SLOTS, spill_watermark=0.0)
    events: list[TierEvent] = []
    entries = sorted(((hdr.seq, hdr.key, slot) for slot, hdr in s.good.items()))
    h.restore_disk([(key, slot) for _, key, slot in entries])
    assert h.disk is not None
    assert len(h.disk) == len(s.good)
    assert h.disk.num_free == SLOTS - len(s.good)
    assert all(h.lookup(hdr.key) is Residency.HIT_DISK for hdr in s.good.values())
    events += h.take_events()
    assert replay(events) == residency(h)

    # New blocks fill exactly the slots not holding a good block, the damaged
    # ones included, and read back intact afterwards.
    fresh = [b"fresh" + i.to_bytes(4, "little") for i in range(h.disk.num_free)]
    plan = h.prepare_store(fresh)
    assert plan is not None
    with CpuBlockBuffer(SLOTS, BLOCK) as cpu:
        for key, row in zip(plan.keys_to_store, plan.cpu_slots):
            cpu.array[row] = block_for(key, BLOCK)
        h.complete_store(plan.keys_to_store)
        orders = h.take_spills()
        targets = {it.dst_slot for o in orders for it in o.items}
        assert targets == set(range(SLOTS)) - set(s.good)
        assert s.damaged <= targets
        engine = TransferEngine([store], [cpu], threads=2)
        try:
            for order in orders:
                items = [(it.key, it.src_slot, it.dst_slot) for it in order.items]
                engine.submit_spill(order.job_id, items)
            assert engine.wait([o.job_id for o in orders], timeout=60)
            for result in engine.get_finished():
                assert result.success
                h.complete_spill(result.job_id, result.lost_keys)
        finally:
            engine.shutdown()
    assert len(h.disk) == SLOTS and h.disk.num_free == 0
    events += h.take_events()
    assert replay(events) == residency(h)
    out = np.empty(BLOCK, np.uint8)
    for key in fresh:
        block = h.disk.get(key)
        assert block is not None
        assert store.read_block(block.slot, key, out) is ReadOutcome.OK
        assert np.array_equal(out, block_for(key, BLOCK))


# -- real crashes --------------------------------------------------------------


def run_and_kill(path: Path, seed: int, direct: bool) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(WRITER.parent)]))
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(path), str(SLOTS), str(BLOCK), str(seed)]
        + ["1" if direct else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else b""
        assert line == b"ready\n", f"writer did not start: {proc.poll()=}"
        # Let it overwrite slots for a random while, then kill it mid-stream.
        signal_at = random.Random(seed).uniform(0.0, 0.3)
        select.select([], [], [], signal_at)
        assert proc.poll() is None, "writer stopped on its own"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if proc.stderr is not None:
            err = proc.stderr.read().decode(errors="replace")
            assert "Traceback" not in err, err
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize(
    "seed, direct",
    [(1, True), (2, False), (3, True), (4, False), (5, True)],
    ids=["o_direct-1", "buffered-2", "o_direct-3", "buffered-4", "o_direct-5"],
)
def test_sigkill_mid_spill_never_serves_torn_blocks(
    tmp_path: Path, seed: int, direct: bool
) -> None:
    run_and_kill(tmp_path, seed, direct)
    with open_store(tmp_path) as store:
        s = survey(store)
        # The writer wrote every slot once on average before "ready" and
        # then kept going, so the survey saw real blocks.
        assert s.good
        assert len(s.good) + len(s.damaged) + len(s.invalid) == SLOTS
        written_keys = {hdr.key for hdr in s.good.values()}
        assert all(k.startswith(key_for(seed, 0)[:9]) for k in written_keys)
        restore_and_reuse(store, s)
    # And a second restart sees the refilled store intact.
    with open_store(tmp_path) as store:
        s = survey(store)
        assert not s.damaged and not s.invalid and len(s.good) == SLOTS


# A store start killed between creating a file and renaming or removing it.
_KILLED_START = r"""
import os, signal, sys
from _spill_writer import crash_fingerprint
from kvtier.store.store import DiskStore
path, block, at = sys.argv[1], int(sys.argv[2]), sys.argv[3]
real_replace, real_unlink = os.replace, os.unlink
def replace(src, dst, **kw):
    if at == "layout":  # layout.json.<pid>.<tid>.tmp written, not renamed
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst, **kw)
def unlink(name, **kw):
    if at == "probe" and ".kvtier-odirect-probe-" in str(name):
        os.kill(os.getpid(), signal.SIGKILL)  # the O_DIRECT probe file made
    return real_unlink(name, **kw)
os.replace, os.unlink = replace, unlink
DiskStore([path], 4, block, crash_fingerprint(block), backend="posix")
"""


@pytest.mark.parametrize("at", ["layout", "probe"])
def test_a_start_killed_mid_file_creation_leaves_nothing_for_good(
    tmp_path: Path, at: str
) -> None:
    """A process SIGKILLed while it created ``layout.json`` (its temporary
    file written, not yet renamed) or probed O_DIRECT in the store directory
    (the probe file not yet removed) left that file there for good: no later
    start removed it. The next start that locks the directory does."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(WRITER.parent)]))
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_START, str(tmp_path), str(BLOCK), at],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    store_dir = next(tmp_path.glob("kvtier-*"))
    before = sorted(p.name for p in store_dir.iterdir())
    assert set(before) - {"layout.json", "slab-0.kvt"}, before  # the leftover
    with open_store(tmp_path) as store:
        assert store.read_block(0, b"any", np.empty(BLOCK, np.uint8)) is not (
            ReadOutcome.OK
        )
        assert sorted(p.name for p in store_dir.iterdir()) == [
            "layout.json",
            "slab-0.kvt",
        ]


# -- torn writes, deterministically ------------------------------------------------


def test_torn_writes_are_detected_after_restart(tmp_path: Path) -> None:
    """A write that stops part-way (the fault layer's short write; O_DIRECT
    off so any length is possible) leaves exactly the torn states a crash
    can: new header over an old payload, a half-new header, or nothing."""
    old = [key_for(99, i) for i in range(4)]
    new = [key_for(98, i) for i in range(4)]
    plan = FaultPlan()
    backend = FaultInjectingBackend(PosixBackend(1, direct=False), plan)
    try:
        with DiskStore(
            [str(tmp_path)], SLOTS, BLOCK, crash_fingerprint(BLOCK), backend=backend
        ) as store:
            for slot, key in enumerate(old):
                store.write_block(slot, key, block_for(key, BLOCK), store.next_seq())
            cuts = {
                1: HEADER_SIZE + BLOCK // 2,  # new header, half new payload
                2: 100,  # torn header (its checksum lives at byte 136)
                3: 0,  # nothing reached the disk: the old block stays valid
            }
            for slot, keep in cuts.items():
                rule = plan.add(
                    FaultRule.short(keep, ops="write", **on_slot(store, slot))
                )
                with pytest.raises(OSError, match="short write"):
                    store.write_block(
                        slot, new[slot], block_for(new[slot], BLOCK), store.next_seq()
                    )
                plan.remove(rule)
            assert store.stats().io_errors == 3
    finally:
        backend.shutdown()

    with open_store(tmp_path) as store:
        s = survey(store)
        assert {slot: hdr.key for slot, hdr in s.good.items()} == {
            0: old[0],
            3: old[3],
        }
        assert s.damaged == {1}
        assert s.invalid == {2} | set(range(4, SLOTS))
        assert verify(store, 1) is ReadOutcome.CHECKSUM_MISMATCH
        assert verify(store, 2) is ReadOutcome.BAD_HEADER
        restore_and_reuse(store, s)
