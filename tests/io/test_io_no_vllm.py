from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

MODULES = [
    "kvtier.io",
    "kvtier.io.backend",
    "kvtier.io.backends",
    "kvtier.io.checksum",
    "kvtier.io.compression",
    "kvtier.io.cpu_buffer",
    "kvtier.io.disk_store",
    "kvtier.io.engine",
    "kvtier.io.format",
    "kvtier.io.posix_backend",
    "kvtier.io.slab",
]


def test_kvtier_io_imports_without_vllm() -> None:
    code = (
        "import importlib, sys\n"
        "sys.modules['vllm'] = None  # any 'import vllm' now raises ImportError\n"
        f"for name in {MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] == 'vllm' and sys.modules[m] is not None]\n"
        "assert not loaded, loaded\n"
        "import kvtier.io\n"
        "kvtier.io.make_backend('auto').shutdown()  # the auto probe must not need vllm either\n"
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


def test_lazy_exports_resolve() -> None:
    import kvtier.io

    assert sorted(kvtier.io.__all__) == sorted(kvtier.io._EXPORTS)
    for name in kvtier.io.__all__:
        assert getattr(kvtier.io, name) is not None
