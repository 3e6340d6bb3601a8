"""The shape of kvtier's product code: lines, files, folders, imports.

    python3 benchmarks/code_structure.py [ROOT] [--out FILE]

Counts the physical lines of every module under ``ROOT/kvtier`` except
``kvtier/testing`` (helpers of tests, never used by the plugin): per
package and per folder, the median module, and the mean number of kvtier
modules each module imports. Run it on two checkouts to compare a
restructuring (docs/benchmarks.md, "The re-cut"). Writes
benchmarks/results/code_structure.json (with ``--out``, there).
"""

from __future__ import annotations

import argparse
import ast
import collections
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is on the path, not ROOT
    sys.path.insert(0, str(ROOT))

from benchmarks._common import write_json  # noqa: E402


def package_of(rel: str) -> str:
    parts = rel.split("/")
    return parts[1] if len(parts) > 2 else "(top)"


def internal_imports(tree: ast.AST) -> int:
    """How many distinct kvtier modules a module imports."""
    mods: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                mods.add("rel:" + (node.module or ""))
            elif node.module and node.module.startswith("kvtier"):
                mods.add(node.module)
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names if a.name.startswith("kvtier"))
    return len(mods)


def structure(root: Path) -> dict:
    pkg = root / "kvtier"
    lines: dict[str, int] = {}
    imports: dict[str, int] = {}
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "testing" in path.relative_to(pkg).parts or "__pycache__" in rel:
            continue
        text = path.read_text()
        lines[rel] = len(text.splitlines())
        imports[rel] = internal_imports(ast.parse(text))
    folders: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    packages: collections.Counter[str] = collections.Counter()
    for rel, n in lines.items():
        folder = folders[rel.rsplit("/", 1)[0]]
        folder[0] += 1
        folder[1] += n
        packages[package_of(rel)] += n
    return {
        "total_lines": sum(lines.values()),
        "files": len(lines),
        "median_lines": statistics.median(lines.values()),
        "lines_per_package": dict(packages),
        "folders": {k: {"files": f, "lines": n} for k, (f, n) in sorted(folders.items())},
        "internal_imports_mean": round(statistics.mean(imports.values()), 2),
        "internal_imports_mean_by_package": {
            p: round(statistics.mean(v for r, v in imports.items() if package_of(r) == p), 2)
            for p in packages
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", nargs="?", default=str(ROOT))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    doc = structure(Path(args.root).resolve())
    print(
        f"{doc['total_lines']} lines in {doc['files']} modules "
        f"(median {doc['median_lines']}), {doc['internal_imports_mean']} kvtier "
        "imports per module"
    )
    for name, n in sorted(doc["lines_per_package"].items()):
        print(f"  {name:<10} {n:>6}")
    print(f"wrote {write_json('code_structure', {'root': args.root, **doc}, args.out)}")


if __name__ == "__main__":
    main()
