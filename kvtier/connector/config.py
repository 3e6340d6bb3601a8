"""Every config schema kvtier accepts: its keys in
``kv_connector_extra_config`` and the tiering mode's ``KvtierDiskTier`` entry.

:class:`KvtierConfig` is a pydantic model (``extra="forbid"``): each key's
type, default, range and description are written once, in its field, and
everything else comes from there: validation (:func:`parse_extra_config`,
at engine start and in ``kvtier doctor``), the key tables of
docs/configuration.md (scripts/gen_config_docs.py, through :data:`KEYS` and
:data:`TIER_KEYS`), and the ``KvtierDiskTier`` entry of vLLM's
``secondary_tiers`` (:data:`KvtierDiskTierConfig`, :func:`parse_tier_config`),
which takes the same disk fields, so both modes accept exactly the same disk
settings, with the same defaults and messages.

This module does not import vLLM, so the CLI, the docs generator and unit
tests can use the schema directly. Every error is a :class:`ConfigError`
naming the key, what was given and what is accepted, because it surfaces at
engine start in an operator's log.
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic.fields import FieldInfo, PydanticUndefined

from kvtier.connector.sizes import NotASize, parse_size
from kvtier.store.backends.factory import DISK_IO_CHOICES
from kvtier.store.compression import COMPRESSION_CHOICES
from kvtier.tiers.policy import policy_names


class ConfigError(ValueError):
    """A bad ``kv_connector_extra_config`` value; the message names the key
    (``where``: the config it is a key of).

    ``more``: the other keys the same validation refused, each its own
    ConfigError (:func:`validate_keys` finds every key-level problem at
    once). The message names them after the first, so one engine start
    shows every key to fix; ``kvtier doctor`` reports each with its own
    message. A rule over several keys (a disk path without a disk budget)
    is checked only once every key's own value is accepted."""

    where = "kv_connector_extra_config"
    more: tuple[ConfigError, ...] = ()

    def __init__(
        self, key: str, message: str, more: tuple[ConfigError, ...] = ()
    ) -> None:
        self.key, self.message, self.more = key, message, more
        super().__init__(f"kvtier: {self.where}[{key!r}]: {message}")

    @property
    def problem(self) -> str:
        """This key's problem alone, without the others of ``more``."""
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        if not self.more:
            return self.problem
        keys = ", ".join(repr(e.key) for e in self.more)
        return (
            f"{self.problem} (and {len(self.more)} more key(s) refused: {keys}; "
            "kvtier doctor --config gives each its message)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt without __init__ (whose arguments differ per subclass:
        # TierConfigError's tier, TopologyError's message alone): a
        # pickled ConfigError (an executor that ships exceptions) keeps
        # its key, message and the keys in ``more``.
        return (_rebuilt, (type(self), self.args, self.__dict__))


def _rebuilt(
    cls: type[ConfigError], args: tuple[Any, ...], state: dict[str, Any]
) -> ConfigError:
    """A ConfigError from its pickled parts (:meth:`ConfigError.__reduce__`)."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class TransferConfigError(ConfigError):
    """A bad top-level ``--kv-transfer-config`` value (not an extra-config
    key): the connector class or vLLM's ``kv_load_failure_policy``."""

    where = "kv_transfer_config"


# The names an operator's config gives vLLM for kvtier's classes: the full
# spec, its connector and their module; the tiering mode's spec (kvtier's
# worker for the CPU platform) and its package.
SPEC_NAME = "TieredOffloadingSpec"
CONNECTOR_NAME = "TieredOffloadingConnector"
SPEC_MODULE = "kvtier.connector"
PORTABLE_SPEC_NAME = "PortableTieringSpec"
TIERING_MODULE = "kvtier.connector.tiering"

# How to run under kvtier's connector; a disk tier needs it (kvtier.connector
# .connector reports a failed disk load to vLLM instead of crashing).
CONNECTOR_HINT = (
    f'set "kv_connector": "{CONNECTOR_NAME}", '
    f'"kv_connector_module_path": "{SPEC_MODULE}" and '
    '"kv_load_failure_policy": "recompute" in --kv-transfer-config'
)


# Why every kvtier spec refuses vLLM's canonical_layout (vLLM reads the key
# with bool(): any non-empty value, "false" included, asks for it).
CANONICAL_LAYOUT_REFUSAL = (
    "kvtier's rows and disk slots hold each rank's pages as its KV cache lays "
    "them out (the direct layout), so vLLM's canonical host layout cannot be "
    "honoured; remove canonical_layout"
)


# ------------------------------------------------------------ value kinds


@dataclass(frozen=True)
class Accepts:
    """Field metadata: what a key accepts, as its docs row and its errors say
    it. ``text`` may hold ``{range}``, filled from the field's own bounds
    (``>= 1``, ``in [1, 256]``); a callable is asked each time (the
    eviction policies registered by then). ``owner`` "vllm": vLLM reads the
    key itself; kvtier lets it through its unknown-key check."""

    text: str | Callable[[], str]
    owner: str = "kvtier"


class _Refusal(ValueError):
    """Raised by a validator: a complete message for :func:`validate_keys`
    to show as is; ``key`` names the key of a rule over several keys."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


def _size(value: Any) -> Any:
    # bool is an int subclass; "true" is never a byte count. A float is
    # refused rather than rounded.
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError()
    try:
        return parse_size(value) if isinstance(value, str) else value
    except NotASize:
        raise ValueError() from None  # the accepted values say the rule


def _integer(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError()
    try:
        return int(value)
    except ValueError:
        raise ValueError() from None


def _number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError()
    try:
        return float(value)
    except (ValueError, OverflowError):  # an int past float's range: not ValueError
        raise ValueError() from None


def _boolean(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError()


def choice(choices: tuple[str, ...] | Callable[[], tuple[str, ...]]):
    """Case-insensitive: the accepted spelling of the given choice."""

    def check(value: Any) -> Any:
        names = choices() if callable(choices) else choices
        by_lower = {c.lower(): c for c in names}
        if not isinstance(value, str) or value.lower() not in by_lower:
            raise ValueError()
        return by_lower[value.lower()]

    return check


def _paths(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not items:
        raise _Refusal(f"got {value!r:.200}; expected a path or a non-empty list of paths")
    out: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item:
            raise _Refusal(f"got {item!r:.200}; each entry must be a non-empty path string")
        if "\0" in item:  # no file name holds one: os calls raise ValueError
            raise _Refusal(f"{item!r:.200} holds a NUL byte; give the directory's path")
        if not os.path.isabs(item):
            raise _Refusal(f"{item!r:.200} is relative; use an absolute path")
        norm = os.path.normpath(item)
        if norm in out:
            raise _Refusal(f"{item!r:.200} is listed twice")
        out.append(norm)
    return tuple(out)


# kvtier.connector.sizes has the whole rule; docs/configuration.md#sizes.
_SIZE = Accepts(
    'integer {range}, or a size string ("64G" or "64GiB" = 64 GiB, "64g" or '
    '"64GB" = 64 GB)'
)
Size = Annotated[int, BeforeValidator(_size), _SIZE]
Count = Annotated[int, BeforeValidator(_integer), Accepts("integer {range}")]
Fraction = Annotated[float, BeforeValidator(_number), Accepts("number {range}")]
Flag = Annotated[bool, BeforeValidator(_boolean), Accepts("true | false")]


def _one_of(*choices: str) -> Any:
    return Annotated[
        str, BeforeValidator(choice(choices)), Accepts(" | ".join(choices))
    ]


DiskIo = _one_of(*DISK_IO_CHOICES)
Compression = _one_of(*COMPRESSION_CHOICES)
LoadPath = _one_of("host", "device")
AutoOnOff = _one_of("auto", "on", "off")


def _policies() -> str:
    return " | ".join(policy_names())


# The eviction policies registered when asked (a policy registered after
# this module is imported is accepted too).
Policy = Annotated[str, BeforeValidator(choice(policy_names)), Accepts(_policies)]
TierPolicy = Annotated[
    str | None,
    BeforeValidator(choice(policy_names)),
    Accepts(lambda: f"{_policies()} (default: eviction_policy)"),
]
Paths = Annotated[
    tuple[str, ...],
    BeforeValidator(_paths),
    Accepts("absolute path or non-empty list of absolute paths"),
]


def _vllm(accepted: str) -> Any:
    """A key vLLM reads itself; kvtier lets any value through."""
    return Annotated[Any, Accepts(accepted, owner="vllm")]


VllmString = _vllm("string")
VllmInteger = _vllm("integer")
VllmFlag = _vllm("true | false")
# vLLM reads this one with int() (a size string would stop it) and kvtier
# checks it: an integer only; vLLM expands a bare 64M in the flag's JSON.
VllmBytes = Annotated[
    int,
    BeforeValidator(_integer),
    Accepts(
        "integer {range} (vLLM reads it with int(): no size string; a bare 64M "
        "in the --kv-transfer-config text is expanded by vLLM)",
        owner="vllm",
    ),
]


# ----------------------------------------------------------------- schema


class KvtierConfig(BaseModel):
    """kvtier's spec config, ``kv_connector_extra_config`` (validated; byte
    budgets are totals over TP ranks). Build it with :func:`parse_extra_config`
    for errors that name the key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec_name: VllmString = Field(
        None, description="Offloading spec class: `TieredOffloadingSpec`."
    )
    spec_module_path: VllmString = Field(
        None, description="Module of the spec: `kvtier.connector`."
    )
    cpu_bytes_to_use: Size = Field(
        ge=1,
        description="Bytes of host DRAM for the CPU tier, all TP ranks together "
        "(as vLLM's CPU offloading).",
    )
    disk_bytes_to_use: Size = Field(
        0,
        ge=0,
        description="Bytes of disk for the disk tier, all TP ranks and paths "
        "together (in the full spec 0, the default, means no disk tier).",
    )
    disk_path: Paths = Field(
        (),
        description="Directory (or list of directories, one per NVMe device) "
        "holding the slab files; blocks are striped across them. Required with "
        "a disk tier.",
    )
    eviction_policy: Policy = Field(
        "lru",
        description="Eviction policy of both tiers (overridden per tier below; in "
        "tiering mode, of the disk tier); see Choosing an eviction policy.",
    )
    cpu_eviction_policy: TierPolicy = Field(
        None, description="Eviction policy of the CPU tier."
    )
    disk_eviction_policy: TierPolicy = Field(
        None, description="Eviction policy of the disk tier."
    )
    disk_io: DiskIo = Field(
        "auto",
        description="Disk I/O back end: kvikio (cuFile/GDS) where it loads, else "
        "POSIX threads with O_DIRECT where accepted.",
    )
    disk_compression: Compression = Field(
        "none",
        description="Compress disk blocks with zstd over byte planes (stored raw "
        "when it saves too little).",
    )
    promote_on_hit: Flag = Field(
        True,
        description="When a disk hit is loaded and a CPU row is free (or a clean "
        "block can give one up), also copy the verified block into the CPU tier; "
        "the load never waits for room (false: disk hits stay on disk only).",
    )
    spill_watermark: Fraction = Field(
        0.75,
        ge=0.0,
        le=1.0,
        description="Fraction of the CPU tier allowed to hold blocks not yet on "
        "disk; above it blocks are spilled ahead of need.",
    )
    # Threads start with the engine (per TP rank, plus as many in the back
    # end); beyond a few dozen they only add contention.
    disk_io_threads: Count = Field(
        4,
        ge=1,
        le=256,
        description="Threads of the disk I/O pool (per TP rank); they start with "
        "the engine. Each writes spills in batches and keeps a 16 MiB batch area "
        "(host memory) once it wrote one.",
    )
    disk_load_buffer_bytes: Size = Field(
        64 << 20,
        ge=1 << 20,
        description="Host bounce area per worker for loading disk hits "
        "(page-locked on CUDA), read into in parts of about 8 MiB, several in "
        "flight; it bounds how much of a long prefix is read ahead of its "
        "verification.",
    )
    disk_load_path: LoadPath = Field(
        "host",
        description="Where a worker receives and verifies disk hits: host (the "
        "bounce area above, xxh3; copied into the KV cache by vLLM's transfer "
        "code) or device (a staging area of the same size on the KV cache's "
        "device, filled by kvikio, straight from NVMe under GDS, verified there "
        "with the device checksum and copied device-to-device; needs "
        "disk_compression none). docs/gds.md.",
    )
    disk_read_process: AutoOnOff = Field(
        "auto",
        description="Whether a worker reads and verifies disk hits in a child "
        "process of its own (kvtier.store.read_process: a shared bounce area, one "
        "message per batch), so the reads and checks do not compete with the "
        "engine's loop for the interpreter lock: auto (on the CPU platform with "
        "disk_load_path host; elsewhere in the worker's process), on (with "
        "disk_load_path host on every platform; on an accelerator the shared "
        "area is page-locked like the CPU tier) or off (always in the worker's "
        "process).",
    )
    disk_spill_process: AutoOnOff = Field(
        "auto",
        description="Whether the scheduler side's spills and promotions run in a "
        "child process of its own (kvtier.store.spill_process: the same slab "
        "files and CPU tier rows, one message per job), so the spill threads do "
        "not compete with the engine's loop and forward pass for the "
        "interpreter lock: auto (on the CPU platform, where it was measured; "
        "elsewhere in the engine's process until measured there), on (every "
        "platform) or off (always in the engine's process). Jobs run in the "
        "engine's process until the child is ready and after it is gone "
        "(docs/benchmarks.md, \"Spills next to a busy loop\").",
    )
    sync_load_budget_bytes: VllmBytes = Field(
        0,
        ge=0,
        description="KV bytes per step (per worker) that vLLM may load within the "
        "step that schedules a hit, instead of holding the request for a step; "
        "vLLM >= 0.33, 0 = off. Refused on vLLM 0.32, and with a disk tier on a "
        "model with several KV-cache groups, under async scheduling (vLLM's "
        "CUDA default) or pipeline parallelism, or under vLLM's Model Runner V2 "
        "(its CUDA default too) (docs/compatibility.md).",
    )
    block_size: VllmInteger = Field(
        None,
        description="Tokens per offloaded block (a multiple of vLLM's block "
        "size); read by vLLM.",
    )
    blocks_per_chunk: VllmInteger = Field(
        None, description="GPU blocks per offloaded block; read by vLLM."
    )
    offload_prompt_only: VllmFlag = Field(
        True, description="Offload only prompt blocks; read by vLLM."
    )
    self_describing_kv_events: VllmFlag = Field(
        False, description="Include token ids in offloading KV events; read by vLLM."
    )
    canonical_layout: VllmFlag = Field(
        False,
        description="vLLM's canonical host layout; read by vLLM. "
        "TieredOffloadingSpec refuses it (its rows and disk slots are the direct "
        "layout), as do KvtierDiskTier and PortableTieringSpec's CPU-platform "
        "worker, with the same message; kvtier doctor reports it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _per_tier_policies(cls, data: Any) -> Any:
        """cpu_/disk_eviction_policy default to eviction_policy."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        default = data.get(
            "eviction_policy", cls.model_fields["eviction_policy"].default
        )
        for key in ("cpu_eviction_policy", "disk_eviction_policy"):
            if data.get(key) is None:
                data[key] = default
        return data

    @model_validator(mode="after")
    def _disk_rules(self) -> KvtierConfig:
        if self.disk_bytes_to_use > 0 and not self.disk_path:
            raise _Refusal(
                "is required when disk_bytes_to_use > 0: a directory or a list of "
                "directories",
                "disk_path",
            )
        if self.disk_bytes_to_use == 0 and "disk_path" in self.model_fields_set:
            # A path without a budget is almost certainly a forgotten budget.
            raise _Refusal(
                "disk_path is set but disk_bytes_to_use is 0 (or missing); set "
                "disk_bytes_to_use > 0 to enable the disk tier",
                "disk_bytes_to_use",
            )
        if self.disk_load_path == "device" and self.disk_compression != "none":
            raise _Refusal(
                "device cannot verify zstd slots (they decode on the host); set "
                "disk_compression to none, or disk_load_path to host",
                "disk_load_path",
            )
        if self.disk_read_process == "on" and self.disk_load_path == "device":
            raise _Refusal(
                "on reads into a host area, but disk_load_path device reads into "
                "the KV cache's device; set disk_read_process to auto or off, or "
                "disk_load_path to host",
                "disk_read_process",
            )
        if self.disk_read_process == "on" and self.disk_io == "kvikio":
            raise _Refusal(
                "on reads in a child process that sees no accelerator, where "
                "kvikio has no driver (into host memory kvikio reads through "
                "POSIX anyway); set disk_io to auto or posix, or "
                "disk_read_process to auto or off",
                "disk_read_process",
            )
        return self

    @property
    def disk_enabled(self) -> bool:
        return self.disk_bytes_to_use > 0

    @property
    def disk_bytes_per_path(self) -> int:
        """The bytes of ``disk_bytes_to_use`` each disk path must hold (its
        share, rounded up; 0 without a disk tier)."""
        return -(-self.disk_bytes_to_use // max(len(self.disk_path), 1))


# ------------------------------------------------------ validation, docs

M = TypeVar("M", bound=BaseModel)


def accepted(field: FieldInfo) -> str:
    """What ``field`` accepts, in words (its :class:`Accepts` with its bounds)."""
    accepts = next((m for m in field.metadata if isinstance(m, Accepts)), None)
    if accepts is None:
        return "any value"
    text = accepts.text() if callable(accepts.text) else accepts.text
    # The bounds of Field(ge=..., le=...), kept as metadata.
    low = next((m.ge for m in field.metadata if hasattr(m, "ge")), None)
    high = next((m.le for m in field.metadata if hasattr(m, "le")), None)
    if high is None:
        bounds = f">= {low}" if low is not None else ""
    else:
        bounds = f"in [{low:g}, {high:g}]"
    return " ".join(text.replace("{range}", bounds).split())


def validate_keys(
    model: type[M],
    doc: Mapping[str, Any],
    error: Callable[[str, str], ConfigError] = ConfigError,
    elsewhere: Mapping[str, str] | None = None,
) -> M:
    """``doc`` validated by ``model``, or ``error(key, message)`` for its
    first problem, with every other refused key in its ``more``: unknown
    keys first (sorted; those of ``elsewhere``, key -> where it belongs,
    before the others), then the refused values in field order, one per
    key. Each message says what was given and what is accepted."""
    try:
        return model.model_validate(dict(doc))
    except ValidationError as exc:
        problems = exc.errors(include_url=False)
    given = set(doc)
    # A key not given whose value was refused took it from another key
    # (cpu_eviction_policy from eviction_policy): that key is the one named.
    said = [p for p in problems if p["type"] == "missing" or _key_of(p) in given]
    refused = _refusals(model.model_fields, said or problems, error, elsewhere or {})
    first = refused[0]
    first.more = tuple(refused[1:])
    raise first


def _key_of(problem: Any) -> str:
    """The key a pydantic error is about (a rule over several keys names
    its own)."""
    cause = (problem.get("ctx") or {}).get("error")
    key = str(problem["loc"][0]) if problem["loc"] else ""
    return (cause.key or key) if isinstance(cause, _Refusal) else key


def _refusals(
    fields: Mapping[str, FieldInfo],
    problems: list[Any],
    error: Callable[[str, str], ConfigError],
    elsewhere: Mapping[str, str],
) -> list[ConfigError]:
    """One error per refused key of a validation's ``problems``, in the
    order :func:`validate_keys` reports them."""
    unknown = sorted(
        {str(p["loc"][0]) for p in problems if p["type"] == "extra_forbidden"}
    )
    out = [error(k, elsewhere[k]) for k in unknown if k in elsewhere]
    for key in (k for k in unknown if k not in elsewhere):
        near = difflib.get_close_matches(key.lower(), list(fields), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        out.append(
            error(key, f"unknown key; valid keys are: {', '.join(fields)}{hint}")
        )
    seen = set(unknown)
    for p in problems:
        if p["type"] == "extra_forbidden":
            continue
        cause = (p.get("ctx") or {}).get("error")
        key = _key_of(p)
        if key in seen:
            continue  # one problem per key: its first
        seen.add(key)
        if isinstance(cause, _Refusal):
            out.append(error(key, str(cause)))
            continue
        want = accepted(fields[key])
        if p["type"] == "missing" or (p["input"] is None and fields[key].is_required()):
            out.append(error(key, f"is required: {want}"))
            continue
        detail = str(cause or "")
        out.append(
            error(
                key,
                f"got {p['input']!r:.200}; accepted values: {want}"
                + (f" ({detail})" if detail else ""),
            )
        )
    return out


def parse_extra_config(extra: Mapping[str, Any]) -> KvtierConfig:
    """Validate ``kv_connector_extra_config``; raise :class:`ConfigError`.

    Checks values only; :func:`kvtier.connector.preflight.check_disk_paths`
    checks the file system."""
    return validate_keys(KvtierConfig, extra, elsewhere=_OTHER_MODES_KEYS)


@dataclass(frozen=True)
class KeySpec:
    """One accepted key as the docs show it, read off its model field."""

    name: str
    doc: str
    default: Any
    accepted: str
    owner: str = "kvtier"  # "kvtier" or "vllm" (read by vLLM itself)
    required: bool = False


def key_specs(model: type[BaseModel]) -> tuple[KeySpec, ...]:
    """The keys of ``model``, in field order."""
    out = []
    for name, field in model.model_fields.items():
        accepts = next((m for m in field.metadata if isinstance(m, Accepts)), None)
        out.append(
            KeySpec(
                name,
                field.description or "",
                None if field.is_required() else field.default,
                accepted(field),
                accepts.owner if accepts else "kvtier",
                field.is_required(),
            )
        )
    return tuple(out)


KEYS = key_specs(KvtierConfig)
# The keys only kvtier's spec reads: vLLM's own specs (CPUOffloadingSpec,
# TieringOffloadingSpec) read cpu_bytes_to_use and eviction_policy too, and
# ignore these without a word.
KVTIER_ONLY_KEYS = tuple(
    k.name
    for k in KEYS
    if k.owner == "kvtier" and k.name not in ("cpu_bytes_to_use", "eviction_policy")
)


def check_kvtier_keys_are_read(extra: Mapping[str, Any], spec: str) -> None:
    """Refuse kvtier's own keys in an extra config whose spec, ``spec``, is
    not kvtier's: it would ignore them (``spec_name`` missing builds vLLM's
    CPUOffloadingSpec: no disk tier, silently). Raises :class:`ConfigError`
    naming ``spec_name``."""
    ignored = [k for k in KVTIER_ONLY_KEYS if k in extra]
    if ignored:
        named = f"is missing, so vLLM builds {spec}"
        if "spec_name" in extra:
            named = f"is {extra['spec_name']!r:.100} ({spec})"
        raise ConfigError(
            "spec_name",
            f"{named}, which ignores kvtier's keys {', '.join(ignored)}; "
            f'set "spec_name": "{SPEC_NAME}" and "spec_module_path": '
            f'"{SPEC_MODULE}" (in tiering mode the disk keys go in the '
            f"{DISK_TIER_TYPE} entry of secondary_tiers)",
        )


# The keys that take a size string ("64G"): kvtier reads them itself.
SIZE_KEYS = tuple(
    name for name, field in KvtierConfig.model_fields.items() if _SIZE in field.metadata
)


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


# ------------------------------------- the tiering mode's KvtierDiskTier entry

DISK_TIER_TYPE = "KvtierDiskTier"


# Keys of vLLM's tiering mode that the full spec does not take: where they
# belong, said instead of "unknown key".
_OTHER_MODES_KEYS = {
    "secondary_tiers": (
        "is tiering mode's key (vLLM's OffloadingConnector with "
        f'"spec_name": "{PORTABLE_SPEC_NAME}" and "spec_module_path": '
        f'"{TIERING_MODULE}", or vLLM\'s TieringOffloadingSpec, the '
        f"disk keys in a {DISK_TIER_TYPE} entry; docs/tiering-mode.md); the "
        f"full spec ({SPEC_NAME}) takes disk_path and "
        "disk_bytes_to_use directly: use one or the other"
    ),
}


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


# The keys vLLM's tier factory takes out of an entry before the tier gets
# the rest (0.32, 0.33): any tier's entry, kvtier's or SharedFsTier's.
FACTORY_KEYS = tuple(k for k in _FactoryKeys.model_fields if k != "locality")


def _shared(
    name: str, *, required: bool = False, minimum: int | None = None
) -> tuple[Any, FieldInfo]:
    """:class:`KvtierConfig`'s field ``name`` as it is, or made ``required``
    (no default) and with ``minimum`` as its lower bound."""
    field = KvtierConfig.model_fields[name]
    if required or minimum is not None:
        field = copy.copy(field)
    if required:
        field.default = PydanticUndefined
    if minimum is not None:
        bound = Field(ge=minimum).metadata  # replaces the lower bound
        field.metadata = [m for m in field.metadata if not hasattr(m, "ge")] + bound
    return field.annotation, field


# The KvtierConfig keys a tier entry takes.
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


def check_one_disk_tier(secondary_tiers: Any) -> None:
    """Refuse ``secondary_tiers`` naming more than one ``KvtierDiskTier``.

    vLLM's tiering manager writes every chunk to every secondary tier, so a
    second kvtier disk tier would keep a second copy of each chunk on local
    disk, and kvtier's series (``tier="disk"``) and events (``ownership``)
    could not tell the two apart. One tier stripes over several directories.
    Raises :class:`ConfigError` under ``secondary_tiers``."""
    count = sum(
        isinstance(t, dict) and t.get("type") == DISK_TIER_TYPE
        for t in (secondary_tiers if isinstance(secondary_tiers, list) else [])
    )
    if count > 1:
        raise ConfigError(
            "secondary_tiers",
            f"lists {count} entries of type {DISK_TIER_TYPE!r}; accepted: one "
            "(vLLM writes every chunk to every secondary tier, so a second "
            "would hold a second copy of each chunk, and kvtier's metrics and "
            "events could not tell them apart): list every directory in one "
            "entry's disk_path, which stripes over them",
        )


class TierConfigError(ConfigError):
    """A bad key of a kvtier entry (``tier``: its type) in ``secondary_tiers``."""

    def __init__(self, key: str, message: str, tier: str = DISK_TIER_TYPE):
        self.where = f"kv_connector_extra_config['secondary_tiers'][type={tier}]"
        super().__init__(key, message)


def as_tier_error(exc: ConfigError) -> TierConfigError:
    """The same complaint (and those of its ``more``), named as a key of the
    ``secondary_tiers`` entry."""
    error = TierConfigError(exc.key, exc.message)
    error.more = tuple(TierConfigError(e.key, e.message) for e in exc.more)
    return error


def parse_tier_config(
    tier_config: Mapping[str, Any], *, cpu_bytes_to_use: int = 1
) -> KvtierConfig:
    """Validate one ``KvtierDiskTier`` entry; raise :class:`TierConfigError`.

    Returns a :class:`KvtierConfig` holding the entry's disk settings.
    Checks values only: the tier checks its directories
    (:func:`kvtier.connector.preflight.check_disk_paths`) once it knows
    which store directories a warm restart may reuse. The primary (CPU) tier
    is vLLM's: ``cpu_bytes_to_use`` is its budget where a caller knows it
    (``kvtier doctor``), else a placeholder the tier never uses."""
    entry = validate_keys(KvtierDiskTierConfig, tier_config, TierConfigError)
    disk = {name: getattr(entry, name) for name in DISK_KEYS}
    try:
        return parse_extra_config({"cpu_bytes_to_use": cpu_bytes_to_use, **disk})
    except ConfigError as exc:
        raise as_tier_error(exc) from None


# ---------------------------------------- the tiering mode's SharedFsTier entry

SHARED_TIER_TYPE = "SharedFsTier"
# kvtier's secondary-tier types: an entry of one of them names kvtier's
# tiering package (TIERING_MODULE) as its module_path.
TIER_TYPES = (DISK_TIER_TYPE, SHARED_TIER_TYPE)


def _absolute(value: Any) -> Any:
    if not isinstance(value, str) or not os.path.isabs(value):
        raise _Refusal(f"got {value!r:.200}; give the shared mount's absolute path")
    return value


def _seconds(value: Any) -> Any:
    # A number stays as given, so a refusal quotes it as written.
    return (
        value
        if isinstance(value, int | float) and not isinstance(value, bool)
        else _number(value)
    )


Seconds = Annotated[float, BeforeValidator(_seconds), Accepts("seconds > 0")]
AbsolutePath = Annotated[str, BeforeValidator(_absolute), Accepts("absolute path")]
SharedLocality = _one_of("REMOTE", "LOCAL")


class SharedFsTierConfig(BaseModel):
    """One ``SharedFsTier`` entry of ``secondary_tiers`` as the tier gets it
    (vLLM's factory has taken :data:`FACTORY_KEYS` out): vLLM's ``fs`` tier
    keys, passed on, and the guard's timeouts (docs/scale-out.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    root_dir: AbsolutePath = Field(
        description="The shared mount's directory (vLLM's fs tier's root); it "
        "must exist at start, or the tier starts offline."
    )
    locality: SharedLocality = Field(
        "REMOTE", description="Where the storage is, for vLLM's tier filters."
    )
    n_read_threads: VllmInteger = Field(
        None, description="vLLM's fs tier's reader threads (vLLM's default)."
    )
    n_write_threads: VllmInteger = Field(
        None, description="vLLM's fs tier's writer threads (vLLM's default)."
    )
    enable_kv_events: VllmFlag = Field(
        None, description="vLLM's fs tier's KV events (STORAGE medium)."
    )
    probe_timeout_s: Seconds = Field(
        5.0,
        gt=0,
        description="Start-up probe of the root (exists, is a directory, takes "
        "an exclusively created file, no symlink followed for it), at most; "
        "past it the tier is offline.",
    )
    lookup_timeout_s: Seconds = Field(
        5.0,
        gt=0,
        description="Longest a key's lookup may stay unanswered; past it the "
        "lookup is a miss and the tier goes offline.",
    )
    store_timeout_s: Seconds = Field(
        60.0,
        gt=0,
        description="Longest a store may stay unfinished; past it the tier "
        "goes offline.",
    )

    def fs_keys(self) -> dict[str, Any]:
        """The keys given that vLLM's ``fs`` tier reads, as given."""
        vllms = {k.name for k in SHARED_TIER_KEYS if k.owner == "vllm"}
        return {k: getattr(self, k) for k in self.model_fields_set & vllms}


SHARED_TIER_KEYS = key_specs(SharedFsTierConfig)


def parse_shared_tier_config(entry: Mapping[str, Any]) -> SharedFsTierConfig:
    """Validate one ``SharedFsTier`` entry (without vLLM's factory keys);
    raise :class:`TierConfigError` naming the key (and every other refused
    key in its ``more``)."""
    return validate_keys(
        SharedFsTierConfig,
        entry,
        lambda key, message: TierConfigError(key, message, SHARED_TIER_TYPE),
    )


def check_tier_modules(secondary_tiers: Any) -> None:
    """Refuse an entry of one of kvtier's tier types whose ``module_path``
    does not import: vLLM's factory imports it before any kvtier code runs,
    so a misspelt one would otherwise end the start in a bare
    ModuleNotFoundError naming no key. Raises :class:`TierConfigError`
    naming ``module_path`` and the package that has the type."""
    for entry in secondary_tiers if isinstance(secondary_tiers, list) else []:
        if not isinstance(entry, dict):
            continue
        kind, module = entry.get("type"), entry.get("module_path")
        if kind not in TIER_TYPES or module in (None, TIERING_MODULE):
            continue
        try:
            found = importlib.util.find_spec(str(module)) is not None
        except (ImportError, ValueError):  # a missing parent package, ""
            found = False
        if not found:
            raise TierConfigError(
                "module_path",
                f"no module {module!r}; {kind} is in {TIERING_MODULE!r}",
                tier=str(kind),
            )
