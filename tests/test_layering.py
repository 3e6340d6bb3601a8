"""The layering rules of kvtier's packages, checked on the code itself.

- Only ``kvtier.connector`` (the plugin) and ``kvtier.testing`` (helpers
  that drive a real engine) import vLLM; the tools reach it through
  ``kvtier.connector.compat`` and ``kvtier.connector.model_kv``, when they
  need it.
- ``kvtier.tiers``, ``kvtier.store``, ``kvtier.host``, ``kvtier.safe_open``,
  ``kvtier.log`` and ``kvtier.tools`` import with ``vllm`` blocked, and
  choosing a disk back end does not need it either.
- ``store`` and ``host`` never import ``connector`` or ``tools``, and
  ``tiers`` imports nothing of kvtier but itself and ``kvtier.log``.
- the lower packages' modules import each other without cycles (module
  level, ``TYPE_CHECKING`` blocks and ``importlib.import_module`` alike).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
KVTIER = REPO_ROOT / "kvtier"
NO_VLLM = ("kvtier.tiers", "kvtier.store", "kvtier.host", "kvtier.safe_open", "kvtier.log")
VLLM_IMPORTERS = ("kvtier.connector", "kvtier.testing")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in KVTIER.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names), anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.add(str(node.args[0].value))
    return found


def _under(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def test_the_lower_packages_and_the_tools_import_without_vllm() -> None:
    names = sorted(m for m in _modules() if _under(m, (*NO_VLLM, "kvtier.tools")))
    code = (
        "import importlib, sys\n"
        "sys.modules['vllm'] = None  # any 'import vllm' now raises ImportError\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] == 'vllm' and sys.modules[m] is not None]\n"
        "assert not loaded, loaded\n"
        "from kvtier.store.backends.factory import make_backend\n"
        "make_backend('auto').shutdown()  # the auto probe must not need vllm either\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_import_edges_follow_the_layers() -> None:
    bad = []
    for name, path in _modules().items():
        deps = _imports(path)
        if not _under(name, VLLM_IMPORTERS):
            bad += [(name, d) for d in deps if d.split(".")[0] == "vllm"]
        if _under(name, ("kvtier.store", "kvtier.host", "kvtier.safe_open")):
            bad += [
                (name, d)
                for d in deps
                if _under(d, ("kvtier.connector", "kvtier.tools", "kvtier.testing"))
            ]
        if _under(name, ("kvtier.tiers",)):
            bad += [
                (name, d)
                for d in deps
                if d.startswith("kvtier") and not _under(d, ("kvtier.tiers", "kvtier.log"))
            ]
        if not _under(name, ("kvtier.testing",)):
            bad += [(name, d) for d in deps if _under(d, ("kvtier.testing",))]
    assert bad == []


def test_no_import_cycles() -> None:
    modules = _modules()
    deps = {
        name: {d for d in _imports(path) if d in modules and d != name}
        for name, path in modules.items()
        if _under(name, NO_VLLM)
    }
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(deps.get(m, ())):
            if state.get(d) == 1:
                cycles.append([*path[path.index(d) :], d])
            elif d in deps and d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(deps):
        if m not in state:
            visit(m, [m])
    assert cycles == []
