"""vLLM's OpenAI-compatible server (``python -m
vllm.entrypoints.openai.api_server``, the multiprocess engine ``vllm serve``
runs) on the tiny model with kvtier, on loopback and a free port, for e2e
tests that need the engine as operators run it: small tiers, so that a few
prompts reach disk, token-id prompts, greedy completions."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.testing.engine import offloading_kv_transfer_config

BLOCK_TOKENS = 32
PROMPT_TOKENS = 150
START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def complete(base: str, model: str, seed: int, max_tokens: int = 8) -> str:
    """The text of one greedy completion of a PROMPT_TOKENS-token prompt
    drawn from ``seed``: the same seed, the same prompt."""
    rng = random.Random(seed)
    prompt = [rng.randrange(4, 1000) for _ in range(PROMPT_TOKENS)]
    # 8 tokens: vLLM offers a store the CPU tier declined (its blocks still
    # spilling) again each step the request lives; 150 + 8 tokens stay within
    # 4 full blocks, the CPU tier's size.
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    req = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        doc = json.load(r)
    return doc["choices"][0]["text"]


def exported(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a /metrics text: name, labels, value."""
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def total(text: str, name: str, **labels: str) -> float:
    """The sum of sample ``name``'s values whose labels include ``labels``."""
    return sum(
        v
        for n, lab, v in exported(text)
        if n == name and all(lab.get(k) == x for k, x in labels.items())
    )


def kv_transfer_config(mode: str, disk: str) -> dict:
    """The server's --kv-transfer-config: a CPU tier of 4 blocks (so prompts
    reach disk) over an 8 MiB disk tier; ``mode`` "full" (kvtier's
    ``TieredOffloadingSpec``) or "tiering" (vLLM's tiering spec with
    ``KvtierDiskTier`` as its secondary tier)."""
    cpu, disk_bytes = 4 * 32768, 8 << 20
    if mode == "full":
        return offloading_kv_transfer_config(
            "TieredOffloadingSpec",
            "kvtier.connector",
            cpu_bytes_to_use=cpu,
            disk_bytes_to_use=disk_bytes,
            disk_path=disk,
            block_size=BLOCK_TOKENS,
        )
    return offloading_kv_transfer_config(
        "PortableTieringSpec",
        "kvtier.connector.tiering",
        cpu_bytes_to_use=cpu,
        block_size=BLOCK_TOKENS,
        secondary_tiers=[
            {
                "type": "KvtierDiskTier",
                "module_path": "kvtier.connector.tiering",
                "disk_path": disk,
                "disk_bytes_to_use": disk_bytes,
            }
        ],
    )


def server_command(
    model: str, kv: dict, port: int, extra_args: Sequence[str] = ()
) -> list[str]:
    """The server's command line: the tiny model, 16 KV-cache blocks of
    BLOCK_TOKENS tokens, ``kv`` as its --kv-transfer-config, then
    ``extra_args``."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--dtype", "float32", "--enforce-eager",
        "--block-size", str(BLOCK_TOKENS), "--num-gpu-blocks-override", "16",
        "--kv-cache-memory-bytes", "2000000", "--max-model-len", "256",
        "--max-num-seqs", "4", "--compilation-config", '{"mode": 0}',
        "--host", "127.0.0.1", "--port", str(port),
        "--kv-transfer-config", json.dumps(kv), *extra_args,
    ]  # fmt: skip


def server_env() -> dict[str, str]:
    """This environment for the server, less VLLM_ENABLE_V1_MULTIPROCESSING
    (tests/e2e pins in-process engines): the multiprocess engine, as vllm
    serve runs it."""
    return {
        k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"
    }


@contextlib.contextmanager
def api_server(
    model: str, kv: dict, log_path: Path, extra_args: Sequence[str] = ()
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The server with ``kv`` as its --kv-transfer-config (its
    ``engine_id`` set) and vLLM's ``extra_args``, its output in
    ``log_path``: ``(base URL, its process)`` once it answers /health;
    stopped (its whole process group) at the end."""
    port = free_port()
    cmd = server_command(model, kv, port, extra_args)
    env = server_env()
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"server exited {proc.returncode}: {log_path.read_text()[-3000:]}"
                )
            try:
                get(f"{base}/health", timeout=2.0)
                break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"server not up in {START_TIMEOUT_S} s: {log_path.read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield base, proc
    finally:
        # ProcessLookupError: the whole group exited already (a failure the
        # test reports, not to be hidden by this one).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
        # vLLM's tiering spec unlinks its primary region
        # (/dev/shm/vllm_offload_<engine id>.mmap) only when its scheduler
        # closes it; a SIGTERM to the whole group can end the engine core
        # first. vLLM's file, not kvtier's: remove it once nothing is left
        # to map it, so the run leaves /dev/shm as it found it.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/vllm_offload_{kv['engine_id']}.mmap")
