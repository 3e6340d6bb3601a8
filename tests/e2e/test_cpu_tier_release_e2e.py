"""The CPU tier's shared memory goes back to the system however the server ends.

Each case starts the real OpenAI-compatible server
(``python -m vllm.entrypoints.openai.api_server``, the multiprocess engine
``vllm serve`` runs) on the tiny model, on loopback and a free port, with a
256 MiB CPU tier (so its shared memory shows in ``Shmem`` of
/proc/meminfo) and a small disk tier (so the scheduler side maps the
worker's file too), with an ``engine_id`` of its own. While up, the server
serves a repeated prompt from the CPU tier (kvtier's metrics at /metrics),
its tier shows in ``Shmem`` and has no name left under /dev/shm.
Then the server ends one way (SIGTERM to the API server;
SIGKILL of the engine core; SIGKILL of the API server; a worker failing at
start-up) and, once its whole process group is gone, no file of that
engine is left under /dev/shm and ``Shmem`` is back near its baseline.
Every wait has a deadline; teardown kills the process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.host.cpu_tier import reclaim_stale_cpu_files
from kvtier.testing.model import build_tiny_llama
from kvtier.testing.procs import (
    children,
    command,
    remove_shm_left_behind,
    shm_entries,
)

from .api_server import complete, free_port, get, server_command, server_env

# Shmem is host-wide: nothing else may run meanwhile (make test runs these
# after the parallel part).
pytestmark = [pytest.mark.e2e, pytest.mark.serial]

BLOCK_TOKENS = 32
CPU_TIER = 256 << 20
# Shared memory is host-wide and other processes use it too: "back near
# baseline" allows half the tier of noise, "visible" asks for 3/4 of it.
SLACK = CPU_TIER // 2
START_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 90.0
FREE_TIMEOUT_S = 30.0


# ------------------------------------------------------------------ helpers


def shmem_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


def run_files(engine_id: str) -> list[str]:
    """Every kvtier CPU-tier entry (file or half-built temporary) of this
    engine under /dev/shm, in the private directory or directly in it."""
    found = []
    for directory in ("/dev/shm", f"/dev/shm/kvtier-{os.geteuid()}"):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        found += [os.path.join(directory, n) for n in names if engine_id in n]
    return sorted(found)


def group_pids(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def wait_for(what: str, check, timeout: float, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def cpu_loaded_blocks(base: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(get(f"{base}/metrics")):
        for s in family.samples:
            if (
                s.name.startswith("vllm:kv_offload_kvtier_loaded_blocks")
                and s.labels.get("tier") == "cpu"
            ):
                total += s.value
    return total


# ------------------------------------------------------------------ the server


@dataclass
class Server:
    proc: subprocess.Popen
    base: str
    model: str
    engine_id: str
    log: Path
    baseline: int

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@pytest.fixture(scope="module")
def model() -> str:
    return build_tiny_llama()


@pytest.fixture
def launch(model, tmp_path) -> Iterator:
    started: list[Server] = []
    shm_before = shm_entries()

    def start(disk_tier: bool = True, **extra) -> Server:
        disk = tmp_path / f"disk{len(started)}"
        disk.mkdir(mode=0o700)
        engine_id = f"rel{uuid.uuid4().hex[:12]}"
        kv = {
            "kv_connector": "TieredOffloadingConnector",
            "kv_connector_module_path": "kvtier.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "engine_id": engine_id,
            "kv_connector_extra_config": {
                "spec_name": "TieredOffloadingSpec",
                "spec_module_path": "kvtier.connector",
                "cpu_bytes_to_use": CPU_TIER,
                "block_size": BLOCK_TOKENS,
                **(
                    {"disk_bytes_to_use": 8 << 20, "disk_path": str(disk)}
                    if disk_tier
                    else {}
                ),
                **extra,
            },
        }
        port = free_port()
        cmd = server_command(model, kv, port)
        env = server_env()
        log = tmp_path / f"server{len(started)}.log"
        # Dead engines' leftovers (an earlier failed run) would be reclaimed
        # by this start and hide its tier in the Shmem delta: clear first.
        reclaim_stale_cpu_files(f"/dev/shm/kvtier-{os.geteuid()}")
        baseline = shmem_bytes()
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        server = Server(
            proc, f"http://127.0.0.1:{port}", model, engine_id, log, baseline
        )
        started.append(server)
        return server

    yield start
    for server in started:
        for pid in group_pids(server.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(timeout=30)
        # The next case's baseline must not see this one's processes.
        with contextlib.suppress(AssertionError):
            pgid = server.proc.pid
            wait_for("the group to exit", lambda p=pgid: not group_pids(p), 30)
    # A server killed by force leaves vLLM's shared memory behind (its
    # message queues' segments, multiprocessing's semaphores): removed here,
    # as its operator would; kvtier's own files are asserted on above.
    remove_shm_left_behind(shm_before, ("psm_", "sem.mp-"))


def wait_up(server: Server) -> None:
    def up() -> bool:
        if server.proc.poll() is not None:
            raise AssertionError(
                f"server exited {server.proc.returncode}: {server.tail()}"
            )
        try:
            get(f"{server.base}/health", timeout=2.0)
            return True
        except (urllib.error.URLError, OSError):
            return False

    wait_for(f"the server to come up ({server.log})", up, START_TIMEOUT_S, 0.5)


def serve_from_cpu_tier(server: Server) -> None:
    """Prompt 1, three others that push its blocks out of the 16 GPU
    blocks, then prompt 1 again: loaded back from the CPU tier."""
    first = complete(server.base, server.model, 1, max_tokens=4)
    for seed in (2, 3, 4):
        complete(server.base, server.model, seed, max_tokens=4)
    assert complete(server.base, server.model, 1, max_tokens=4) == first
    wait_for(
        "CPU-tier loads in /metrics", lambda: cpu_loaded_blocks(server.base) > 0, 30
    )
    # Every process that needs the tier has it mapped: it has no name left
    # that could outlive them (however they end; the kills below race
    # vLLM's own clean-up, so this is what holds every time).
    assert run_files(server.engine_id) == [], run_files(server.engine_id)
    # The tier's memory is visible in Shmem while the engine runs.
    assert shmem_bytes() - server.baseline > CPU_TIER * 3 // 4, (
        server.baseline,
        shmem_bytes(),
    )


def assert_released(server: Server) -> None:
    """The whole process group ends, then no file of this engine is left in
    /dev/shm and its shared memory is free."""
    wait_for(
        f"the server's processes to exit (left: {group_pids(server.proc.pid)})",
        lambda: not group_pids(server.proc.pid),
        EXIT_TIMEOUT_S,
    )
    assert run_files(server.engine_id) == [], server.tail()
    wait_for(
        f"Shmem back near {server.baseline} (now {shmem_bytes()})",
        lambda: shmem_bytes() < server.baseline + SLACK,
        FREE_TIMEOUT_S,
    )


def engine_core_pid(server: Server) -> int:
    def find() -> int | None:
        for pid in children(server.proc.pid):
            if "EngineCore" in (command(pid) or ""):
                return pid
        return None

    return wait_for("the engine core process", find, 30)


# ------------------------------------------------------------------ tests


def test_sigterm_to_the_api_server(launch):
    server = launch()
    wait_up(server)
    serve_from_cpu_tier(server)
    server.proc.send_signal(signal.SIGTERM)
    assert_released(server)


@pytest.mark.parametrize("disk_tier", [True, False], ids=["cpu+disk", "cpu-only"])
def test_sigkill_of_the_engine_core(launch, disk_tier):
    # With a disk tier the engine core maps the worker's file too; without
    # one the worker alone does.
    server = launch(disk_tier=disk_tier)
    wait_up(server)
    serve_from_cpu_tier(server)
    core = engine_core_pid(server)
    os.kill(core, signal.SIGKILL)
    wait_for(
        "the engine core to die", lambda: core not in group_pids(server.proc.pid), 30
    )
    # Nothing of it stays behind, even while the API server still runs.
    assert run_files(server.engine_id) == [], server.tail()
    wait_for(
        f"Shmem back near {server.baseline} (now {shmem_bytes()})",
        lambda: shmem_bytes() < server.baseline + SLACK,
        FREE_TIMEOUT_S,
    )
    os.killpg(server.proc.pid, signal.SIGTERM)
    assert_released(server)


def test_sigkill_of_the_api_server(launch):
    server = launch()
    wait_up(server)
    serve_from_cpu_tier(server)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=30)
    # No name of this engine's tier is left for anyone to reclaim.
    assert run_files(server.engine_id) == [], server.tail()
    # vLLM 0.32's engine core does not notice its API server's death: it
    # and its worker run on as orphans, holding the tier (and the GPU) like
    # any live engine, until killed, as an operator would.
    left = group_pids(server.proc.pid)
    assert left, "expected vLLM's orphaned engine core"
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert_released(server)


def test_a_worker_failing_at_start_up(launch):
    # Passes the scheduler-side parse (>= one disk slot) but the worker's
    # bounce area of 1 PiB cannot be allocated: worker construction fails
    # after the CPU-tier file was created.
    server = launch(disk_load_buffer_bytes=1 << 50)
    wait_for(
        "the server to exit",
        lambda: server.proc.poll() is not None,
        START_TIMEOUT_S,
        0.5,
    )
    assert server.proc.returncode != 0
    log = server.log.read_text(errors="replace")
    # The read process's shared area (the CPU platform's default).
    assert "the disk load bounce area of" in log
    assert "cannot be allocated" in log and "lower disk_load_buffer_bytes" in log
    assert_released(server)
