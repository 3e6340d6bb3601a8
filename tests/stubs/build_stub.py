"""Build the TEST-ONLY CUDA driver stub (libcuda_stub.c -> libcuda.so.1).

kvikio needs ``libcuda.so.1`` for every I/O, even into host memory; CI has no
GPU and no driver. The stub answers "not initialized", which sends kvikio
down its host-memory (POSIX compat-mode) path, so the kvikio back end can be
tested for real. Built at test time with gcc; never shipped in the package.

Usage: ``build_stub(out_dir)`` returns the path of ``<out_dir>/libcuda.so.1``;
put ``out_dir`` on ``LD_LIBRARY_PATH`` of a *fresh* process (the dynamic
loader reads it only at start-up). ``python tests/stubs/build_stub.py [DIR]``
does the same from a shell.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

STUB_SOURCE = Path(__file__).resolve().with_name("libcuda_stub.c")
# Gitignored; cached so each test session compiles at most once.
DEFAULT_OUT_DIR = Path(__file__).resolve().parents[1] / "_stub_build"
SONAME = "libcuda.so.1"


class StubBuildError(RuntimeError):
    """No compiler, or the compiler rejected the stub."""


def compiler() -> str | None:
    """The C compiler to use ($CC, else gcc), or None when there is none."""
    return shutil.which(os.environ.get("CC", "gcc"))


def real_driver_present() -> bool:
    """Whether this process can load a real ``libcuda.so.1``."""
    import ctypes

    try:
        ctypes.CDLL(SONAME)
    except OSError:
        return False
    return True


def stub_lib_dir(broken: bool = False) -> Path | None:
    """The directory to put on a child's ``LD_LIBRARY_PATH`` for the stub
    driver (built once, cached), or None when no compiler can build it.
    ``broken``: the variant whose ``cuDriverGetVersion`` fails, like the CUDA
    toolkit's own stub."""
    if compiler() is None:
        return None
    if not broken:
        return build_stub().parent
    out = DEFAULT_OUT_DIR / "broken"
    return build_stub(out, defines=["KVTIER_STUB_BROKEN_DRIVER"]).parent


def build_stub(
    out_dir: str | os.PathLike[str] | None = None, defines: Sequence[str] = ()
) -> Path:
    """Compile the stub into ``<out_dir>/libcuda.so.1`` (reused if up to date).

    ``defines`` are ``-D`` macros selecting stub variants (e.g.
    ``KVTIER_STUB_BROKEN_DRIVER``); use a separate ``out_dir`` per variant.
    """
    cc = compiler()
    if cc is None:
        raise StubBuildError("no C compiler found (set $CC or install gcc)")
    out = Path(out_dir) if out_dir is not None else DEFAULT_OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    target = out / SONAME
    flags = [
        "-shared",
        "-fPIC",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-fvisibility=hidden",
    ]
    flags += [f"-D{d}" for d in defines]
    # Rebuild when the source, flags or compiler change, not on every run.
    stamp_text = hashlib.sha256(
        STUB_SOURCE.read_bytes() + "\0".join([cc, *flags]).encode()
    ).hexdigest()
    stamp = out / f"{SONAME}.sha256"
    if target.exists() and stamp.exists() and stamp.read_text() == stamp_text:
        return target
    # Compile to a temporary name and rename: concurrent test processes may
    # build at once, and none must ever load a half-written library.
    fd, tmp = tempfile.mkstemp(prefix=".libcuda-", suffix=".so", dir=out)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *flags, "-o", tmp, str(STUB_SOURCE)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            raise StubBuildError(f"{cc} failed ({proc.returncode}):\n{proc.stderr}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    stamp.write_text(stamp_text)
    return target


if __name__ == "__main__":
    print(build_stub(sys.argv[1] if len(sys.argv) > 1 else None))
