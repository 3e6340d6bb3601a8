"""The ``KvtierDiskTier`` entry of vLLM's ``secondary_tiers``: keys and checks.

:func:`parse_tier_config` validates one entry with the full spec's own
schema, so both modes accept exactly the same disk settings. The tier itself
is :class:`kvtier.connector.tiering.KvtierDiskTier`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.connector.config import (
    POLICY_CHOICES,
    ConfigError,
    KeySpec,
    KvtierConfig,
    parse_extra_config,
)
from kvtier.connector.disk_paths import check_disk_paths

TIER_TYPE = "KvtierDiskTier"

# Keys of one ``secondary_tiers`` entry. vLLM's factory consumes ``type``,
# ``module_path`` and ``backpressure`` and passes the rest to the tier.
TIER_KEYS: tuple[KeySpec, ...] = (
    KeySpec("type", f"`{TIER_TYPE}`.", None, "string", "vllm"),
    KeySpec("module_path", "`kvtier.connector.tiering`.", None, "string", "vllm"),
    KeySpec(
        "backpressure",
        "vLLM's per-tier back-pressure detector settings.",
        None,
        "object",
        "vllm",
    ),
    KeySpec(
        "disk_bytes_to_use",
        "Bytes of disk for this tier, all TP ranks and paths together.",
        None,
        "integer > 0 (required)",
    ),
    KeySpec(
        "disk_path",
        "Directory (or list of directories, one per NVMe device) for the slab "
        "files; blocks are striped across them.",
        None,
        "absolute path or non-empty list of absolute paths (required)",
    ),
    KeySpec("eviction_policy", "Eviction policy of this tier.", "lru", POLICY_CHOICES),
    KeySpec(
        "disk_compression",
        "zstd over byte planes (stored raw when it saves too little).",
        "none",
        "none | zstd",
    ),
    KeySpec(
        "disk_io",
        "Disk I/O back end (kvikio where it loads, else POSIX with O_DIRECT).",
        "auto",
        "auto | posix | kvikio",
    ),
    KeySpec("disk_io_threads", "I/O threads per TP rank.", 4, "integer >= 1"),
    KeySpec(
        "locality",
        "Where the storage is, for vLLM's tier filters; a local disk.",
        "LOCAL",
        "LOCAL",
        "vllm",
    ),
)
TIER_KEY_NAMES = tuple(k.name for k in TIER_KEYS)


class TierConfigError(ConfigError):
    """A bad key of the ``KvtierDiskTier`` entry in ``secondary_tiers``."""

    def __init__(self, key: str, message: str):
        self.key = key
        ValueError.__init__(
            self,
            f"kvtier: kv_connector_extra_config['secondary_tiers'][type={TIER_TYPE}]"
            f"[{key!r}]: {message}",
        )


def as_tier_error(exc: ConfigError) -> TierConfigError:
    """The same complaint, named as a key of the ``secondary_tiers`` entry."""
    text = str(exc)
    marker = f"[{exc.key!r}]: "
    return TierConfigError(exc.key, text.split(marker, 1)[-1])


def parse_tier_config(
    tier_config: Mapping[str, Any],
    *,
    check_paths: bool = True,
    cpu_bytes_to_use: int = 1,
) -> KvtierConfig:
    """Validate one ``KvtierDiskTier`` entry; raise :class:`TierConfigError`.

    The values are checked by the full spec's own schema
    (:func:`kvtier.connector.config.parse_extra_config`), so both modes
    accept exactly the same disk settings; ``check_paths`` also checks the
    directories (exist, writable, room for the budget). The primary (CPU)
    tier is vLLM's: ``cpu_bytes_to_use`` is its budget where a caller knows
    it (``kvtier doctor``), else a placeholder the tier never uses."""
    unknown = sorted(k for k in tier_config if k not in TIER_KEY_NAMES)
    if unknown:
        raise TierConfigError(
            unknown[0], f"unknown key; valid keys are: {', '.join(TIER_KEY_NAMES)}"
        )
    for key in ("disk_bytes_to_use", "disk_path"):
        if tier_config.get(key) is None:
            raise TierConfigError(key, f"is required ({_accepted(key)})")
    locality = tier_config.get("locality", "LOCAL")
    if locality != "LOCAL":
        raise TierConfigError(
            "locality", f"got {locality!r}; accepted values: LOCAL (a local disk)"
        )
    mapped: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes_to_use}
    for key in (
        "disk_bytes_to_use",
        "disk_path",
        "eviction_policy",
        "disk_compression",
        "disk_io",
        "disk_io_threads",
    ):
        if key in tier_config:
            mapped[key] = tier_config[key]
    try:
        cfg = parse_extra_config(mapped)
        if not cfg.disk_enabled:
            raise ConfigError("disk_bytes_to_use", "must be > 0 for a disk tier")
        if check_paths:
            check_disk_paths(cfg)
    except TierConfigError:
        raise
    except ConfigError as exc:
        raise as_tier_error(exc) from None
    return cfg


def _accepted(key: str) -> str:
    return next(k.accepted for k in TIER_KEYS if k.name == key)
