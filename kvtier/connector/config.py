"""kvtier's keys in ``kv_connector_extra_config``: schema, defaults, checks.

This module does not import vLLM, so the CLI, the docs test and unit tests
can use the schema directly. Every error names the key, what was given and
what is accepted, because it surfaces at engine start in an operator's log.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.tiers.policy import policy_names

DISK_IO_CHOICES = ("auto", "posix", "kvikio")
# Threads are started at engine start-up (per TP rank, plus as many in the
# back end); beyond a few dozen they only add contention.
MAX_DISK_IO_THREADS = 256
COMPRESSION_CHOICES = ("none", "zstd")
LOAD_PATH_CHOICES = ("host", "device")
READ_PROCESS_CHOICES = ("auto", "off")
# The eviction policies registered when this module is imported (the
# built-ins of kvtier.tiers.policy), as the key docs below list them.
# parse_extra_config asks the registry itself, so it also accepts a policy
# registered later.
POLICY_CHOICES = " | ".join(policy_names())


class ConfigError(ValueError):
    """A bad ``kv_connector_extra_config`` value; the message names the key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"kvtier: kv_connector_extra_config[{key!r}]: {message}")


class TransferConfigError(ConfigError):
    """A bad top-level ``--kv-transfer-config`` value (not an extra-config
    key): the connector class or vLLM's ``kv_load_failure_policy``."""

    def __init__(self, key: str, message: str):
        self.key = key
        ValueError.__init__(self, f"kvtier: kv_transfer_config[{key!r}]: {message}")


@dataclass(frozen=True)
class KeySpec:
    """One accepted key: its meaning, default and accepted values (docs)."""

    name: str
    doc: str
    default: Any
    accepted: str
    owner: str = "kvtier"  # "kvtier" or "vllm" (read by vLLM itself)


KEYS: tuple[KeySpec, ...] = (
    KeySpec(
        "spec_name",
        "Offloading spec class: `TieredOffloadingSpec`.",
        None,
        "string",
        "vllm",
    ),
    KeySpec(
        "spec_module_path",
        "Module of the spec: `kvtier.connector`.",
        None,
        "string",
        "vllm",
    ),
    KeySpec(
        "cpu_bytes_to_use",
        "Bytes of host DRAM for the CPU tier, all TP ranks together (as vLLM's CPU offloading).",
        None,
        "integer > 0 (required)",
    ),
    KeySpec(
        "disk_bytes_to_use",
        "Bytes of disk for the disk tier, all ranks and paths together; 0 disables the disk tier.",
        0,
        "integer >= 0",
    ),
    KeySpec(
        "disk_path",
        "Directory (or list of directories, one per NVMe device) holding the slab files; blocks are striped across them.",
        None,
        "absolute path or non-empty list of absolute paths; required when disk_bytes_to_use > 0",
    ),
    KeySpec(
        "eviction_policy",
        "Eviction policy of both tiers (overridden per tier below); see Choosing an eviction policy.",
        "lru",
        POLICY_CHOICES,
    ),
    KeySpec(
        "cpu_eviction_policy",
        "Eviction policy of the CPU tier.",
        None,
        f"{POLICY_CHOICES} (default: eviction_policy)",
    ),
    KeySpec(
        "disk_eviction_policy",
        "Eviction policy of the disk tier.",
        None,
        f"{POLICY_CHOICES} (default: eviction_policy)",
    ),
    KeySpec(
        "disk_io",
        "Disk I/O back end: kvikio (cuFile/GDS) where it loads, else POSIX threads with O_DIRECT where accepted.",
        "auto",
        "auto | posix | kvikio",
    ),
    KeySpec(
        "disk_compression",
        "Compress disk blocks with zstd over byte planes (stored raw when it saves too little).",
        "none",
        "none | zstd",
    ),
    KeySpec(
        "promote_on_hit",
        "When a disk hit is loaded and a CPU row is free (or a clean block can give one up), also copy the verified block into the CPU tier; the load never waits for room (false: disk hits stay on disk only).",
        True,
        "true | false",
    ),
    KeySpec(
        "spill_watermark",
        "Fraction of the CPU tier allowed to hold blocks not yet on disk; above it blocks are spilled ahead of need.",
        0.75,
        "number in [0, 1]",
    ),
    KeySpec(
        "disk_io_threads",
        "Threads of the disk I/O pool (per TP rank); they start with the engine.",
        4,
        "integer in [1, 256]",
    ),
    KeySpec(
        "disk_load_buffer_bytes",
        "Host bounce area per worker for loading disk hits (page-locked on CUDA), read into in parts of about 8 MiB, several in flight; it bounds how much of a long prefix is read ahead of its verification.",
        64 << 20,
        "integer >= 1048576",
    ),
    KeySpec(
        "disk_load_path",
        "Where a worker receives and verifies disk hits: host (the bounce area above, xxh3; copied into the KV cache by vLLM's transfer code) or device (a staging area of the same size on the KV cache's device, filled by kvikio, straight from NVMe under GDS, verified there with the device checksum and copied device-to-device; needs disk_compression none). docs/gds.md.",
        "host",
        "host | device",
    ),
    KeySpec(
        "disk_read_process",
        "Whether a worker reads and verifies disk hits in a child process of its own (kvtier.io.read_process: a shared bounce area, one message per batch), so the reads and checks do not compete with the engine's loop for the interpreter lock: auto (on the CPU platform with disk_load_path host; elsewhere in the worker's process) or off (always in the worker's process).",
        "auto",
        "auto | off",
    ),
    KeySpec(
        "sync_load_budget_bytes",
        "KV bytes per step (per worker) that vLLM may load within the step that schedules a hit, instead of holding the request for a step; vLLM >= 0.33, 0 = off. Refused on vLLM 0.32, and with a disk tier on a model with several KV-cache groups (docs/compatibility.md).",
        0,
        "integer >= 0",
        "vllm",
    ),
    KeySpec(
        "block_size",
        "Tokens per offloaded block (a multiple of vLLM's block size); read by vLLM.",
        None,
        "integer",
        "vllm",
    ),
    KeySpec(
        "blocks_per_chunk",
        "GPU blocks per offloaded block; read by vLLM.",
        None,
        "integer",
        "vllm",
    ),
    KeySpec(
        "offload_prompt_only",
        "Offload only prompt blocks; read by vLLM.",
        True,
        "true | false",
        "vllm",
    ),
    KeySpec(
        "self_describing_kv_events",
        "Include token ids in offloading KV events; read by vLLM.",
        False,
        "true | false",
        "vllm",
    ),
    KeySpec(
        "canonical_layout",
        "vLLM's canonical host layout; read by vLLM. TieredOffloadingSpec refuses it (its rows and disk slots are the direct layout), as does PortableTieringSpec's CPU-platform worker.",
        False,
        "true | false",
        "vllm",
    ),
)
KEY_NAMES = tuple(k.name for k in KEYS)


@dataclass(frozen=True)
class KvtierConfig:
    """Validated kvtier settings (byte budgets are totals over TP ranks)."""

    cpu_bytes_to_use: int
    disk_bytes_to_use: int = 0
    disk_paths: tuple[str, ...] = ()
    cpu_eviction_policy: str = "lru"
    disk_eviction_policy: str = "lru"
    disk_io: str = "auto"
    disk_compression: str = "none"
    promote_on_hit: bool = True
    spill_watermark: float = 0.75
    disk_io_threads: int = 4
    disk_load_buffer_bytes: int = 64 << 20
    disk_load_path: str = "host"
    disk_read_process: str = "auto"
    sync_load_budget_bytes: int = 0  # read by vLLM >= 0.33

    @property
    def disk_enabled(self) -> bool:
        return self.disk_bytes_to_use > 0


def _int(
    extra: Mapping[str, Any],
    key: str,
    default: int | None,
    minimum: int,
    maximum: int | None = None,
) -> int:
    want = (
        f"an integer >= {minimum}"
        if maximum is None
        else f"an integer in [{minimum}, {maximum}]"
    )
    value = extra.get(key, default)
    if value is None:
        raise ConfigError(key, f"is required: {want}")
    # bool is an int subclass; "true" is never a byte count.
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(key, f"expected {want}, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(key, f"expected {want}, got {value!r}") from None
    if number < minimum or (maximum is not None and number > maximum):
        raise ConfigError(key, f"expected {want}, got {number}")
    return number


def _choice(
    extra: Mapping[str, Any], key: str, default: str, choices: tuple[str, ...]
) -> str:
    value = extra.get(key, default)
    if not isinstance(value, str) or value.lower() not in choices:
        raise ConfigError(key, f"got {value!r}; accepted values: {' | '.join(choices)}")
    return value.lower()


def _bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(key, f"got {value!r}; accepted values: true | false")


def _fraction(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool):
        raise ConfigError(key, f"got {value!r}; expected a number in [0, 1]")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(key, f"got {value!r}; expected a number in [0, 1]") from None
    if not 0.0 <= number <= 1.0:
        raise ConfigError(key, f"got {number}; expected a number in [0, 1]")
    return number


def _paths(extra: Mapping[str, Any]) -> tuple[str, ...]:
    key = "disk_path"
    value = extra.get(key)
    if value is None:
        raise ConfigError(
            key,
            "is required when disk_bytes_to_use > 0: a directory or a list of directories",
        )
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not items:
        raise ConfigError(
            key, f"got {value!r}; expected a path or a non-empty list of paths"
        )
    out: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item:
            raise ConfigError(
                key, f"got {item!r}; each entry must be a non-empty path string"
            )
        if not os.path.isabs(item):
            raise ConfigError(key, f"{item!r} is relative; use an absolute path")
        norm = os.path.normpath(item)
        if norm in out:
            raise ConfigError(key, f"{item!r} is listed twice")
        out.append(norm)
    return tuple(out)


def parse_extra_config(extra: Mapping[str, Any]) -> KvtierConfig:
    """Validate ``kv_connector_extra_config``; raise :class:`ConfigError`.

    Checks values only; :func:`kvtier.connector.disk_paths.check_disk_paths`
    checks the file system."""
    unknown = sorted(k for k in extra if k not in KEY_NAMES)
    if unknown:
        raise ConfigError(
            unknown[0],
            f"unknown key; valid keys are: {', '.join(KEY_NAMES)}",
        )
    policies = policy_names()
    policy = _choice(extra, "eviction_policy", "lru", policies)
    disk_bytes = _int(extra, "disk_bytes_to_use", 0, 0)
    cfg = KvtierConfig(
        cpu_bytes_to_use=_int(extra, "cpu_bytes_to_use", None, 1),
        disk_bytes_to_use=disk_bytes,
        disk_paths=_paths(extra) if disk_bytes > 0 else (),
        cpu_eviction_policy=_choice(extra, "cpu_eviction_policy", policy, policies),
        disk_eviction_policy=_choice(extra, "disk_eviction_policy", policy, policies),
        disk_io=_choice(extra, "disk_io", "auto", DISK_IO_CHOICES),
        disk_compression=_choice(
            extra, "disk_compression", "none", COMPRESSION_CHOICES
        ),
        promote_on_hit=_bool(extra, "promote_on_hit", True),
        spill_watermark=_fraction(extra, "spill_watermark", 0.75),
        disk_io_threads=_int(
            extra, "disk_io_threads", 4, 1, maximum=MAX_DISK_IO_THREADS
        ),
        disk_load_buffer_bytes=_int(extra, "disk_load_buffer_bytes", 64 << 20, 1 << 20),
        disk_load_path=_choice(extra, "disk_load_path", "host", LOAD_PATH_CHOICES),
        disk_read_process=_choice(
            extra, "disk_read_process", "auto", READ_PROCESS_CHOICES
        ),
        sync_load_budget_bytes=_int(extra, "sync_load_budget_bytes", 0, 0),
    )
    if cfg.disk_load_path == "device" and cfg.disk_compression != "none":
        raise ConfigError(
            "disk_load_path",
            "device cannot verify zstd slots (they decode on the host); set "
            "disk_compression to none, or disk_load_path to host",
        )
    if disk_bytes == 0 and "disk_path" in extra:
        # A path without a budget is almost certainly a forgotten budget.
        raise ConfigError(
            "disk_bytes_to_use",
            "disk_path is set but disk_bytes_to_use is 0 (or missing); "
            "set disk_bytes_to_use > 0 to enable the disk tier",
        )
    return cfg


def blocks_in_budget(
    budget: int, block_bytes: int, ranks: int, key: str, unit: str
) -> int:
    """How many blocks a byte budget holds: ``budget // (block_bytes *
    ranks)``, where one block takes ``block_bytes`` per rank (a CPU row, or
    a disk slot with its header). The one conversion of ``cpu_bytes_to_use``
    and ``disk_bytes_to_use`` into capacities, for every spec. Raises
    :class:`ConfigError` naming ``key`` when the budget holds no block
    (``unit`` names what one block is, for the message). O(1)."""
    per_block = block_bytes * ranks
    blocks = budget // per_block if per_block > 0 else 0
    if blocks < 1:
        raise ConfigError(
            key,
            f"{budget} bytes hold no block: one {unit} takes {per_block} bytes "
            f"over {ranks} rank(s); raise {key}",
        )
    return blocks
