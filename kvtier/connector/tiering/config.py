"""The ``KvtierDiskTier`` entry of vLLM's ``secondary_tiers``: keys and checks.

The entry's disk keys are the full spec's own fields
(:class:`kvtier.connector.config.KvtierConfig`), taken as they are, so both
modes accept exactly the same disk settings, with the same defaults and
messages; :data:`KvtierDiskTierConfig` adds the keys of vLLM's tier factory
and makes the budget and the path required. The tier itself is
:class:`kvtier.connector.tiering.KvtierDiskTier`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model
from pydantic.fields import FieldInfo, PydanticUndefined

from kvtier.connector.config import (
    Accepts,
    ConfigError,
    KvtierConfig,
    VllmString,
    choice,
    key_specs,
    parse_extra_config,
    validate_keys,
)
from kvtier.connector.preflight import check_disk_paths

DISK_TIER_TYPE = "KvtierDiskTier"


class _FactoryKeys(BaseModel):
    """The keys vLLM's tier factory reads from the entry (``type``,
    ``module_path``, ``backpressure``; the rest is passed to the tier) and
    ``locality``, which the tier reports to vLLM's tier filters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: VllmString = Field(None, description=f"`{DISK_TIER_TYPE}`.")
    module_path: VllmString = Field(None, description="`kvtier.connector.tiering`.")
    backpressure: Annotated[Any, Accepts("object", owner="vllm")] = Field(
        None, description="vLLM's per-tier back-pressure detector settings."
    )
    locality: Annotated[
        str, BeforeValidator(choice(("LOCAL",))), Accepts("LOCAL (a local disk)")
    ] = Field(
        "LOCAL",
        description="Where the storage is, for vLLM's per-request tier filters.",
    )


def _shared(
    name: str, *, required: bool = False, minimum: int | None = None
) -> tuple[Any, FieldInfo]:
    """The full spec's field ``name`` as it is, or made ``required`` (no
    default) and with ``minimum`` as its lower bound."""
    field = KvtierConfig.model_fields[name]
    if required or minimum is not None:
        field = copy.copy(field)
    if required:
        field.default = PydanticUndefined
    if minimum is not None:
        bound = Field(ge=minimum).metadata  # replaces the lower bound
        field.metadata = [m for m in field.metadata if not hasattr(m, "ge")] + bound
    return field.annotation, field


# The full spec's keys a tier entry takes.
DISK_KEYS = (
    "disk_bytes_to_use",
    "disk_path",
    "eviction_policy",
    "disk_compression",
    "disk_io",
    "disk_io_threads",
)
KvtierDiskTierConfig = create_model(
    "KvtierDiskTierConfig",
    __base__=_FactoryKeys,
    __doc__="One ``KvtierDiskTier`` entry of ``secondary_tiers``.",
    disk_bytes_to_use=_shared("disk_bytes_to_use", required=True, minimum=1),
    disk_path=_shared("disk_path", required=True),
    **{name: _shared(name) for name in DISK_KEYS[2:]},
)
TIER_KEYS = key_specs(KvtierDiskTierConfig)


class TierConfigError(ConfigError):
    """A bad key of a kvtier entry (``tier``: its type) in ``secondary_tiers``."""

    def __init__(self, key: str, message: str, tier: str = DISK_TIER_TYPE):
        self.key = key
        ValueError.__init__(
            self,
            f"kvtier: kv_connector_extra_config['secondary_tiers'][type={tier}]"
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

    Returns the full spec's config holding the entry's disk settings;
    ``check_paths`` also checks the directories (exist, writable, room for
    the budget). The primary (CPU) tier is vLLM's: ``cpu_bytes_to_use`` is
    its budget where a caller knows it (``kvtier doctor``), else a
    placeholder the tier never uses."""
    entry = validate_keys(KvtierDiskTierConfig, tier_config, TierConfigError)
    disk = {name: getattr(entry, name) for name in DISK_KEYS}
    try:
        cfg = parse_extra_config({"cpu_bytes_to_use": cpu_bytes_to_use, **disk})
        if check_paths:
            check_disk_paths(cfg)
    except ConfigError as exc:
        raise as_tier_error(exc) from None
    return cfg
