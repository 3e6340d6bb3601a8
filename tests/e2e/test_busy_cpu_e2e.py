"""Disk hits served by the read process while every CPU is busy, under
``vllm serve``'s multiprocess engine.

While a request waits for its load, vLLM's worker process spins on the
CPU its model thread is bound to, the CPU the load thread and the read
process share when no CPU is spare (this VM's two). A read process in a
session of its own (the kernel's autogroup per session) got next to none
of that CPU there, at nice 10 or 0 alike: each load passed its deadline
and was recomputed (load errors counted, a 15 s TTFT), as one clean-clone
CI run of the dashboard test caught. In the engine's session, as it is
now, such loads return in milliseconds. Two busy processes besides keep
the other CPU taken too (the CI run had another test's engine there); the
test runs alone (``serial``), so they are all the load there is."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
import uuid

import pytest

from kvtier.testing.model import build_tiny_llama
from kvtier.testing.procs import read_processes, thread_names

from .api_server import api_server, complete, get, kv_transfer_config, total

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.serial,
    pytest.mark.skipif(sys.platform != "linux", reason="reads /proc"),
    pytest.mark.skipif(
        sys.version_info < (3, 11),
        reason="Python 3.10 starts the read process in a session of its own",
    ),
]

BUSY_PROCESSES = 2
WAIT_S = 120.0
# Each busy process ends by itself after this long: a test killed before
# its teardown leaves none spinning.
BUSY_S = 300


def _read_process_reading(server: int) -> int | None:
    """The server's read process once it read something (its disk back
    end starts its threads at the first read), else None."""
    for pid in read_processes(server):
        if any(n.startswith("kvtier-posix_") for n in thread_names(pid).values()):
            return pid
    return None


def _round(base: str, model: str, rnd: int) -> None:
    """Six prompts, then the first again: its blocks went GPU -> CPU ->
    disk as the next five came, and it comes back from disk (its output as
    the first time)."""
    seeds = range(10 * rnd + 1, 10 * rnd + 7)
    first = [complete(base, model, seed) for seed in seeds][0]
    assert complete(base, model, seeds[0]) == first


def grew(before: str, after: str, name: str, **labels: str) -> float:
    """How much kvtier's series ``name`` grew between two /metrics texts."""
    name = "vllm:kv_offload_kvtier_" + name
    return total(after, name, **labels) - total(before, name, **labels)


def test_disk_hits_on_busy_cpus_come_from_the_read_process_in_time(tmp_path):
    model = build_tiny_llama()
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    kv = kv_transfer_config("full", str(disk))
    kv["engine_id"] = f"kvtier-busy-{uuid.uuid4().hex[:12]}"
    log_path = tmp_path / "server.log"
    with api_server(model, kv, log_path) as (base, server):
        # Rounds until the read process has read (it starts once the store's
        # slabs exist, and imports for a while).
        deadline = time.monotonic() + WAIT_S
        rounds = 0
        while (child := _read_process_reading(server.pid)) is None:
            assert time.monotonic() < deadline, "the read process never read"
            _round(base, model, rounds)
            rounds += 1
        before = get(f"{base}/metrics")
        spin = f"import time\nend = time.monotonic() + {BUSY_S}\nwhile time.monotonic() < end: pass"
        busy = [
            subprocess.Popen([sys.executable, "-c", spin])
            for _ in range(BUSY_PROCESSES)
        ]
        try:
            # Two rounds, and more until one came back from disk: with the
            # CPUs busy the spills may fall behind, the CPU tier declines
            # stores meanwhile and a returning prompt is served from it.
            deadline = time.monotonic() + WAIT_S
            for rnd in itertools.count(rounds):
                _round(base, model, rnd)
                after = get(f"{base}/metrics")
                done = rnd >= rounds + 1 and grew(
                    before, after, "loaded_blocks_total", tier="disk"
                )
                if done or time.monotonic() > deadline:
                    break
        finally:
            for p in busy:
                p.kill()
                p.wait()
        assert _read_process_reading(server.pid) == child  # the same, alive
        sessions = os.getsid(child), os.getsid(server.pid)
    said = log_path.read_text()
    assert grew(before, after, "loaded_blocks_total", tier="disk") > 0, said[-3000:]
    # Every disk hit verified and served: none given up at its deadline.
    assert grew(before, after, "load_errors_total") == 0, said[-3000:]
    assert grew(before, after, "load_io_errors_total") == 0
    assert "have not returned" not in said
    assert sessions[0] == sessions[1]  # the engine's: its autogroup
