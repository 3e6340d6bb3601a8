"""kvikio disk back end: CuFile pread/pwrite, GPUDirect Storage where available.

kvikio (RAPIDS) reads and writes files into host or device memory. With GDS
(the nvidia-fs driver plus a supported file system) device buffers go
NVMe <-> GPU without a host bounce; otherwise kvikio runs in "compat mode":
POSIX I/O on its own thread pool, staging device buffers through a pinned
bounce buffer.

Two facts shape this module:

- kvikio dlopen()s the CUDA driver (``libcuda.so.1``) on the first read or
  write, *even into host memory*, and fails every I/O without it. So
  ``kvikio_usable()`` checks the driver up front and the factory falls back
  to POSIX instead of handing out a back end whose every I/O fails.
- kvikio 26.10 deadlocks (recursive static initialisation of its driver shim)
  when ``cuDriverGetVersion`` fails, e.g. with the CUDA toolkit's stub
  libcuda on the library path. The probe therefore calls it itself, and runs
  in a watchdog thread so that no probe can hang a worker.

kvikio is imported lazily: this module must import cleanly (for
``kvikio_usable()``) where kvikio is not installed.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvtier.io.backend import BackendUnavailableError, DiskBackend
from kvtier.io.safe_open import open_private, same_file

logger = logging.getLogger("kvtier.io")

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


# -- probes -------------------------------------------------------------------


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


def _usable_status() -> tuple[bool, str]:
    global _usable
    with _lock:
        if _usable is None:
            _usable = _with_watchdog(_probe_usable, "kvikio-probe")
        return _usable


def _gds_status() -> tuple[bool, str]:
    global _gds
    usable, why = _usable_status()
    # Never ask cuFile without a working driver: it prints dlopen errors to
    # stdout and may block in driver initialisation.
    if not usable:
        return False, f"kvikio unusable: {why}"
    with _lock:
        if _gds is None:
            _gds = _with_watchdog(_probe_gds, "gds-probe")
        return _gds


def kvikio_usable() -> bool:
    """Whether kvikio is importable and the CUDA driver can serve it (cached).

    Never raises and never blocks longer than ``PROBE_TIMEOUT_S``. When False,
    ``kvikio_unusable_reason()`` says why in one line.
    """
    return _usable_status()[0]


def kvikio_unusable_reason() -> str | None:
    """One line saying why ``kvikio_usable()`` is False; None when it is True."""
    usable, why = _usable_status()
    return None if usable else why


def gds_available() -> bool:
    """Whether kvikio will use GPUDirect Storage (not compat mode); cached.

    False whenever kvikio is unusable, compat mode is forced or preferred, or
    cuFile reports GDS unavailable. Individual files can still fall back to
    compat mode (e.g. a file system that rejects O_DIRECT); kvikio does that
    per file.
    """
    return _gds_status()[0]


def gds_unavailable_reason() -> str | None:
    """One line saying why ``gds_available()`` is False (compat mode forced
    or preferred, cuFile without GDS, kvikio unusable); None when True."""
    available, why = _gds_status()
    return None if available else why


def _reset_probes() -> None:
    """Forget cached probe results (tests only)."""
    global _usable, _gds
    with _lock:
        _usable = None
        _gds = None


# -- buffers and errors -------------------------------------------------------


def _as_target(buf: Any, for_read: bool) -> tuple[Any, int]:
    """The object to hand kvikio and its size in bytes.

    Bad arguments are caller bugs, not I/O failures, so they raise here, at
    submission, rather than through the future.
    """
    if type(buf).__module__.startswith("torch") and hasattr(buf, "is_cuda"):
        if not buf.is_contiguous():
            raise ValueError("tensor must be contiguous")
        if buf.is_cuda:
            # kvikio takes CUDA tensors through __cuda_array_interface__.
            return buf, buf.numel() * buf.element_size()
        buf = buf.numpy()  # CPU tensor: share its memory through numpy
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is not None:
        if cai.get("strides") is not None:
            raise ValueError("device buffer must be C-contiguous")
        itemsize = int(cai["typestr"][2:])
        return buf, math.prod(cai["shape"]) * itemsize
    view = memoryview(buf)
    if not view.contiguous:
        raise ValueError("buffer must be contiguous")
    if for_read and view.readonly:
        raise ValueError("cannot read into a read-only buffer")
    # A flat byte view is what kvikio's buffer-protocol path expects.
    return view.cast("B"), view.nbytes


_STRERROR_TO_ERRNO: dict[str, int] = {
    os.strerror(code): code for code in errno.errorcode
}


def _errno_of(message: str) -> int:
    """Recover errno from kvikio's message text ("... POSIX error: <strerror>").

    kvikio raises RuntimeError with strerror() text but no errno attribute;
    callers (the disk store's error logging) want a real errno.
    """
    tail = message.rsplit(": ", 1)[-1].strip()
    if tail in _STRERROR_TO_ERRNO:
        return _STRERROR_TO_ERRNO[tail]
    for text, code in sorted(_STRERROR_TO_ERRNO.items(), key=lambda kv: -len(kv[0])):
        if text in message:
            return code
    return errno.EIO


def _to_oserror(exc: Exception, op: str, path: str) -> OSError:
    if isinstance(exc, OSError):
        return exc if exc.filename else OSError(exc.errno, exc.strerror, path)
    message = str(exc)
    return OSError(_errno_of(message), f"kvikio {op} failed: {message}", path)


# -- the back end -------------------------------------------------------------


@dataclass(frozen=True)
class KvikioHandle:
    """An open kvikio.CuFile plus what the back end needs around it."""

    file: Any  # kvikio.CuFile
    path: str
    writable: bool


class KvikioBackend(DiskBackend):
    """kvikio CuFile I/O (see DiskBackend for the contract).

    Each submit runs ``CuFile.pread/pwrite(...).get()`` on a small thread
    pool: kvikio's IOFuture is not a concurrent.futures.Future, and calling
    kvikio from the pool also keeps submission non-blocking where kvikio
    would run small or deferred transfers in the caller's thread. ``.get()``
    releases the GIL, and kvikio splits each transfer over its own thread
    pool, which is raised to ``threads`` unless KVIKIO_NTHREADS is set
    (kvikio defaults to a single thread, serialising all I/O).

    Reads are clamped to the file's size so a read across end of file is
    reported short, as the contract requires; kvikio itself raises there.
    """

    name = "kvikio"
    supports_device_memory = True

    def __init__(self, threads: int = 4) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        usable, why = _usable_status()
        if not usable:
            raise BackendUnavailableError(f"kvikio cannot be used here: {why}")
        import kvikio
        import kvikio.defaults

        self._kvikio: Any = kvikio
        self._threads = threads
        if "KVIKIO_NTHREADS" not in os.environ:
            try:
                if int(kvikio.defaults.get("num_threads")) < threads:
                    # Process-wide setting; only ever raised, never lowered,
                    # so another kvikio user in the process loses nothing.
                    kvikio.defaults.set("num_threads", threads)
            except Exception as exc:  # a tuning knob must not block I/O
                logger.warning("could not raise kvikio's thread count: %r", exc)
        self._gds, self._gds_why = _gds_status()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-kvikio")

    def open(self, path: str, writable: bool = True) -> KvikioHandle:
        # kvikio opens by name: check the name first (no symlink, our own
        # regular file, not group/other-writable), then make sure kvikio
        # opened that very inode.
        checked = open_private(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            try:
                # "r+" never creates or truncates: the disk store preallocates.
                cufile = self._kvikio.CuFile(path, "r+" if writable else "r")
            except Exception as exc:
                raise _to_oserror(exc, "open", path) from exc
            try:
                same = same_file(checked, cufile.fileno())
            except Exception:
                same = True  # no descriptor to compare (a stub); name was checked
            if not same:
                cufile.close()
                raise PermissionError(
                    errno.EPERM,
                    "kvtier refuses the file: it was replaced while being opened",
                    path,
                )
        finally:
            os.close(checked)
        return KvikioHandle(cufile, path, writable)

    def fileno(self, handle: KvikioHandle) -> int | None:
        try:
            return int(handle.file.fileno())
        except Exception:
            return None

    def submit_read(self, handle: KvikioHandle, buf: Any, offset: int) -> Future[int]:
        target, nbytes = _as_target(buf, for_read=True)
        _check_offset(offset)
        return self._pool.submit(_read, handle, target, nbytes, offset)

    def start_read(
        self, handle: KvikioHandle, buf: Any, offset: int
    ) -> Callable[[], int]:
        """Start ``len(buf)`` bytes at ``offset`` with kvikio's own
        asynchronous ``CuFile.pread`` (an IOFuture that kvikio splits over its
        thread pool; device buffers go NVMe -> GPU under GDS) and return a
        function that waits for it and returns the byte count (short at end
        of file, like ``submit_read``) or raises OSError. Bad arguments raise
        here; so does a failure to start (as OSError)."""
        target, nbytes = _as_target(buf, for_read=True)
        _check_offset(offset)
        try:
            size = os.fstat(handle.file.fileno()).st_size
            count = min(nbytes, max(0, size - offset))
            fut = handle.file.pread(target, count, offset) if count else None
        except Exception as exc:
            raise _to_oserror(exc, "read", handle.path) from exc

        def wait() -> int:
            if fut is None:
                return 0
            try:
                return int(fut.get())
            except Exception as exc:
                raise _to_oserror(exc, "read", handle.path) from exc

        return wait

    def submit_write(self, handle: KvikioHandle, buf: Any, offset: int) -> Future[int]:
        target, nbytes = _as_target(buf, for_read=False)
        _check_offset(offset)
        if not handle.writable:
            # kvikio would fail with a misleading EPERM; say what happened.
            fut: Future[int] = Future()
            fut.set_exception(
                OSError(errno.EBADF, "handle opened read-only", handle.path)
            )
            return fut
        return self._pool.submit(_write, handle, target, nbytes, offset)

    def close(self, handle: KvikioHandle) -> None:
        try:
            handle.file.close()
        except Exception as exc:
            raise _to_oserror(exc, "close", handle.path) from exc

    @property
    def gds(self) -> bool:
        """Whether reads go through GPUDirect Storage (else compat mode)."""
        return bool(self._gds)

    def describe(self) -> str:
        version = getattr(self._kvikio, "__version__", "?")
        mode = "GDS" if self._gds else f"compat mode, POSIX I/O: {self._gds_why}"
        try:
            kthreads = int(self._kvikio.defaults.get("num_threads"))
        except Exception:
            kthreads = -1
        return f"kvikio {version} ({mode}; threads={self._threads}, kvikio_threads={kthreads})"

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _check_offset(offset: int) -> None:
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")


def _read(handle: KvikioHandle, target: Any, nbytes: int, offset: int) -> int:
    try:
        size = os.fstat(handle.file.fileno()).st_size
        count = min(nbytes, max(0, size - offset))
        if count == 0:
            return 0
        return int(handle.file.pread(target, count, offset).get())
    except Exception as exc:
        raise _to_oserror(exc, "read", handle.path) from exc


def _write(handle: KvikioHandle, target: Any, nbytes: int, offset: int) -> int:
    if nbytes == 0:
        return 0
    try:
        return int(handle.file.pwrite(target, nbytes, offset).get())
    except Exception as exc:
        raise _to_oserror(exc, "write", handle.path) from exc
