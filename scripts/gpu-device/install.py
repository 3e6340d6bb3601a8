"""On the GPU machine (see bundle.sh): unpack vLLM 0.33's Python modules and
its ``_C_stable_libtorch`` into /tmp/vl, make its flash-attention package
importable without its kernels, and install into /tmp/site the carried
wheels whose modules the image lacks (``typing_extensions`` always: the
carried pydantic needs a newer one than some images have).

The flash-attention kernels (``_vllm_fa2_C``, ``_vllm_fa3_C``: 300+ MB) do
not travel, and ``vllm/vllm_flash_attn/__init__.py`` raises ImportError
without them, which stops the engine while it imports its attention
backends. The shim turns that raise into a no-op on the machine only (the
product never sees it): the package then reports both versions unavailable
and vLLM's own backend selection picks ``TRITON_ATTN``.

Run from the repository root with the image's python3 and no PYTHONPATH.
"""

from __future__ import annotations

import hashlib
import importlib.util
import lzma
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

CARRY = Path(".gpu/b")
STASH = Path("/tmp/stash")  # where the first call left .gpu/a's part
VLLM_DIR = Path("/tmp/vl")
SITE = Path("/tmp/site")
ALWAYS = {"typing_extensions"}


def unpack_vllm() -> None:
    VLLM_DIR.mkdir(parents=True, exist_ok=True)
    with tarfile.open(CARRY / "vllm_py.tar.xz") as tf:
        tf.extractall(VLLM_DIR, filter="data")
    parts = [STASH / "so.xz.partaa", CARRY / "so.xz.partab"]
    decompressor = lzma.LZMADecompressor()
    digest = hashlib.sha256()
    with open(VLLM_DIR / "vllm/_C_stable_libtorch.abi3.so", "wb") as out:
        for part in parts:
            data = decompressor.decompress(part.read_bytes())
            digest.update(data)
            out.write(data)
    want = (CARRY / "so.sha256").read_text().strip()
    if digest.hexdigest() != want:
        sys.exit(f"_C_stable_libtorch: sha256 {digest.hexdigest()}, expected {want}")
    print("vLLM unpacked, kernels sha256 ok", flush=True)
    shim_flash_attn(VLLM_DIR / "vllm/vllm_flash_attn/__init__.py")


# The raise in vLLM 0.33.0's vllm/vllm_flash_attn/__init__.py, and what it
# becomes on the machine.
FLASH_ATTN_GUARD = "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError("
FLASH_ATTN_SHIM = (
    "if False:  # kvtier device shim (scripts/gpu-device/install.py): no kernels\n"
    "    raise ImportError("
)


def shim_flash_attn(init: Path) -> None:
    """Neutralise the ImportError of a flash-attention package carried
    without its kernels (see the module doc)."""
    text = init.read_text()
    if FLASH_ATTN_SHIM in text:
        return
    if text.count(FLASH_ATTN_GUARD) != 1:
        sys.exit(f"{init}: the flash-attention guard changed; update FLASH_ATTN_GUARD")
    init.write_text(text.replace(FLASH_ATTN_GUARD, FLASH_ATTN_SHIM))
    print("vllm_flash_attn: ImportError without kernels neutralised", flush=True)


def wheels_to_install() -> list[str]:
    todo = []
    for wheel in sorted((CARRY / "whl").glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            tops = {name.split("/")[0] for name in zf.namelist()}
        modules = sorted(
            top.removesuffix(".py")
            for top in tops
            if not top.endswith((".dist-info", ".data", ".libs", ".pth"))
            and not top.startswith("_")
        )
        present = [m for m in modules if importlib.util.find_spec(m) is not None]
        need = bool(ALWAYS & set(modules)) or len(present) < len(modules) or not modules
        print(f"{wheel.name}: in image {present} of {modules} -> "
              f"{'install' if need else 'skip'}", flush=True)
        if need:
            todo.append(str(wheel))
    return todo


def main() -> None:
    unpack_vllm()
    SITE.mkdir(parents=True, exist_ok=True)
    todo = wheels_to_install()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
         "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE), *todo],
        check=True,
    )
    print(f"installed {len(todo)} wheels into {SITE}", flush=True)


if __name__ == "__main__":
    main()
