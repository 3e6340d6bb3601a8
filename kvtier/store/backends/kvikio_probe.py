"""Can kvikio run on this host, and with GPUDirect Storage? (cached probes)

Two facts shape these probes:

- kvikio dlopen()s the CUDA driver (``libcuda.so.1``) on the first read or
  write, *even into host memory*, and fails every I/O without it. So
  :func:`usable_status` checks the driver up front and the back-end factory
  falls back to POSIX instead of handing out a back end whose every I/O
  fails.
- kvikio 26.10 deadlocks (recursive static initialisation of its driver shim)
  when ``cuDriverGetVersion`` fails, e.g. with the CUDA toolkit's stub
  libcuda on the library path. The probe therefore calls it itself, and runs
  in a watchdog thread so that no probe can hang a worker.

Every function here never raises and never blocks longer than
``PROBE_TIMEOUT_S``; results are cached per process. kvikio is imported
lazily: this module imports cleanly where kvikio is not installed.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

CUDA_DRIVER_SONAME = "libcuda.so.1"

# Driver entry points kvikio 26.10 resolves unconditionally when it first
# touches the driver; a libcuda without one of them makes every kvikio I/O
# fail, so the probe reports it as unusable instead. Names carry the _v2
# suffixes cuda.h maps them to (that is what kvikio dlsym()s).
KVIKIO_REQUIRED_CUDA_SYMBOLS: tuple[str, ...] = (
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyAsync",
    "cuPointerGetAttribute",
    "cuPointerGetAttributes",
    "cuCtxCreate_v2",
    "cuCtxDestroy_v2",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxGetCurrent",
    "cuCtxGetDevice",
    "cuMemGetAddressRange_v2",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuStreamSynchronize",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuEventSynchronize",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuLaunchHostFunc",
)

# Generous: importing kvikio maps ~100 MB of shared libraries, which can be
# slow on a cold network file system, but a real hang must still end.
PROBE_TIMEOUT_S = 60.0

_INSTALL_HINT = "install the lean set with scripts/install-kvikio.sh"


def _with_watchdog(
    probe: Callable[[], tuple[bool, str]], what: str
) -> tuple[bool, str]:
    """Run ``probe`` in a daemon thread; (False, reason) if it raises or hangs.

    A daemon thread is the only portable way to bound a call into native
    code; if it never returns it is abandoned and does not block exit.
    """
    result: list[tuple[bool, str]] = []

    def target() -> None:
        try:
            result.append(probe())
        except Exception as exc:  # a probe must never take the worker down
            result.append((False, f"{what} raised {exc!r}"))

    thread = threading.Thread(target=target, name=f"kvtier-{what}", daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT_S)
    if thread.is_alive() or not result:
        return False, f"{what} did not finish within {PROBE_TIMEOUT_S:.0f} s"
    return result[0]


def _probe_usable() -> tuple[bool, str]:
    try:
        import kvikio
    except ModuleNotFoundError as exc:
        return False, f"kvikio is not installed ({exc}); {_INSTALL_HINT}"
    except Exception as exc:  # broken install: missing libcufile, ABI mismatch
        return False, f"import kvikio failed: {exc!r}; {_INSTALL_HINT}"
    try:
        lib = ctypes.CDLL(CUDA_DRIVER_SONAME)
    except OSError as exc:
        return False, (
            f"the CUDA driver ({CUDA_DRIVER_SONAME}) cannot be loaded ({exc}); "
            "kvikio needs it for every read and write, even into host memory"
        )
    missing = [s for s in KVIKIO_REQUIRED_CUDA_SYMBOLS if not hasattr(lib, s)]
    if missing:
        return False, (
            f"{CUDA_DRIVER_SONAME} lacks {', '.join(missing[:3])}"
            f"{' and more' if len(missing) > 3 else ''}; driver too old for kvikio"
        )
    version = ctypes.c_int(0)
    rc = lib.cuDriverGetVersion(ctypes.byref(version))
    if rc != 0 or version.value <= 0:
        # e.g. the CUDA toolkit's stub libcuda answers 34 (STUB_LIBRARY);
        # kvikio would deadlock on this, so refuse before it gets the chance.
        return False, (
            f"cuDriverGetVersion() in {CUDA_DRIVER_SONAME} failed "
            f"(CUresult {rc}, version {version.value}); not a working CUDA driver"
        )
    return True, f"kvikio {kvikio.__version__}, CUDA driver API {version.value}"


def _probe_gds() -> tuple[bool, str]:
    import kvikio.cufile_driver
    import kvikio.defaults

    # True when KVIKIO_COMPAT_MODE=ON, or AUTO and cuFile cannot open its
    # driver: kvikio then never attempts GDS, whatever cuFile reports.
    if kvikio.defaults.is_compat_mode_preferred():
        mode = getattr(kvikio.defaults.get("compat_mode"), "name", "?")
        if mode == "ON":
            return False, "compat mode forced (KVIKIO_COMPAT_MODE=ON)"
        return False, f"compat_mode={mode} and the cuFile driver cannot be opened"
    if not kvikio.cufile_driver.get("is_gds_available"):
        return False, "cuFile reports GDS unavailable (nvidia-fs driver not loaded?)"
    return True, "cuFile reports GDS available"


_lock = threading.Lock()
_usable: tuple[bool, str] | None = None
_gds: tuple[bool, str] | None = None


def usable_status() -> tuple[bool, str]:
    """(kvikio importable and the CUDA driver able to serve it, one-line
    reason), probed once per process."""
    global _usable
    with _lock:
        if _usable is None:
            _usable = _with_watchdog(_probe_usable, "kvikio-probe")
        return _usable


def gds_status() -> tuple[bool, str]:
    """(kvikio will use GPUDirect Storage, not compat mode; one-line reason),
    probed once per process: False whenever kvikio is unusable (cuFile is
    then never asked), compat mode is forced or preferred, or cuFile reports
    GDS unavailable. kvikio may still fall back to compat mode per file
    (a file system that rejects O_DIRECT)."""
    global _gds
    usable, why = usable_status()
    # Never ask cuFile without a working driver: it prints dlopen errors to
    # stdout and may block in driver initialisation.
    if not usable:
        return False, f"kvikio unusable: {why}"
    with _lock:
        if _gds is None:
            _gds = _with_watchdog(_probe_gds, "gds-probe")
        return _gds
