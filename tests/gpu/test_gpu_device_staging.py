"""The device load path (``disk_load_path: device``) through kvikio, into a
staging tensor on CPU (runs in CI) and on CUDA (marked ``gpu``).

Both cases run the same body, :func:`tests/gpu/_device_path_check.check`
(see its module doc): kvikio's asynchronous reads land in the staging
tensor itself and equal the POSIX path's bytes, the real worker loads them
into the KV cache, and a corrupted payload byte or header byte is refused
by both back ends and reported as a load error by the worker. The body runs
in a fresh interpreter because kvikio binds the CUDA driver once per
process: without a GPU, the test-only stub driver (tests/stubs) sends kvikio
down its compat path into host memory; with one, the real driver is used
(GDS or compat, whatever kvikio finds).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stubs.build_stub import real_driver_present, stub_lib_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
BODY = Path(__file__).resolve().with_name("_device_path_check.py")
CHILD_TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("kvikio") is None,
    reason="kvikio not installed (run scripts/install-kvikio.sh)",
)


def _cuda_ready() -> str | None:
    """Why the CUDA case cannot run here, or None."""
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        import vllm._C_stable_libtorch  # noqa: F401  (vLLM's CUDA kernels)
    except ImportError as exc:  # pragma: no cover - depends on the host
        return f"needs vLLM's CUDA build: {exc}"
    return None


def _driver_dir(device: str) -> Path | None:
    """LD_LIBRARY_PATH for the child: the stub driver on a host without one."""
    if device == "cuda" or real_driver_present():
        return None
    lib_dir = stub_lib_dir()
    if lib_dir is None:
        pytest.skip("no C compiler (gcc) to build the CUDA driver stub")
    return lib_dir


def _run_body(device: str, work: Path, lib_dir: Path | None) -> dict:
    env = dict(os.environ)
    if lib_dir is not None:
        env["LD_LIBRARY_PATH"] = str(lib_dir)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p
    )
    for var in ("KVIKIO_COMPAT_MODE", "KVIKIO_NTHREADS"):
        env.pop(var, None)
    try:
        proc = subprocess.run(
            [sys.executable, str(BODY), device, str(work)],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"child did not finish within {CHILD_TIMEOUT_S} s: {exc!r}")
    detail = f"\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, f"child exited {proc.returncode}{detail}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, f"child printed no RESULT line{detail}"
    result = json.loads(lines[0][len("RESULT ") :])
    result["_stderr"] = proc.stderr
    return result


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kvikio_device_staging_matches_posix_and_refuses_corrupt_slots(
    device: str, tmp_path: Path
) -> None:
    if device == "cuda" and (why := _cuda_ready()) is not None:
        pytest.skip(why)
    result = _run_body(device, tmp_path, _driver_dir(device))
    assert result["device"] == device
    if device == "cpu" and not real_driver_present():
        assert result["mode"] == "compat"  # the stub driver has no GDS
    assert result["mode"] in ("gds", "compat")
    # The reader logs which mode it runs (issue 20: compat must say so).
    assert f"device staging: mode {result['mode']}" in result["_stderr"]
    assert result["kvikio_reads"] > 0
    want = ["ok"] * 8
    want[3], want[6] = "checksum_mismatch", "bad_header"
    assert result["refused"] == {"posix": want, "kvikio": want}
