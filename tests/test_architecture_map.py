"""docs/architecture.md's map of the tree names every module and folder of
``kvtier/``, and nothing that is not there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def map_entries() -> tuple[set[str], set[str]]:
    """(modules, folders) the map names, as paths relative to the root."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- map -->\n```\n(.*?)```\n<!-- /map -->", text, re.S)
    assert block, "docs/architecture.md has no <!-- map --> block"
    modules: set[str] = set()
    folders: set[str] = set()
    stack: list[str] = []
    for line in block.group(1).splitlines():
        name = line.split()[0]
        depth = (len(line) - len(line.lstrip(" "))) // 2
        stack[depth:] = []
        path = "".join(stack) + name
        if name.endswith("/"):
            folders.add(path.rstrip("/"))
            stack.append(name)
        else:
            modules.add(path)
    return modules, folders


def tree_entries() -> tuple[set[str], set[str]]:
    pkg = ROOT / "kvtier"
    modules = {
        str(p.relative_to(ROOT))
        for p in pkg.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    folders = {
        str(p.parent.relative_to(ROOT))
        for p in pkg.rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    return modules, folders


def test_the_map_names_every_module_and_folder_and_nothing_else():
    mapped_modules, mapped_folders = map_entries()
    modules, folders = tree_entries()
    assert sorted(modules - mapped_modules) == [], "modules missing from the map"
    assert sorted(mapped_modules - modules) == [], "the map names modules that are gone"
    assert sorted(folders - mapped_folders) == [], "folders missing from the map"
    assert sorted(mapped_folders - folders) == [], "the map names folders that are gone"
