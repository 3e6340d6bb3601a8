"""Worker-side data movement and the on-disk format (never imports vLLM).

  format        slot header, layout fingerprint, alignment helpers
  checksum      xxh3_64 for payloads and headers; the device checksum
  compression   optional zstd over byte planes
  backend       the DiskBackend interface
  posix_backend preadv/pwritev thread pool with O_DIRECT where supported
  backends      make_backend("auto" | "posix" | "kvikio")
  slab          preallocated owner-only slab files
  layout        slab names, slot striping and the one slot verification
  disk_store    verified fixed-size block slots striped over paths
  device_staging slots read into a torch staging area, verified on the device
  cpu_buffer    the CPU tier's page-aligned (optionally shared) host buffer
  engine        asynchronous spill/promote jobs

Names below are resolved lazily (PEP 562) so that importing one submodule,
e.g. ``kvtier.io.format`` for ``kvtier inspect``, does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "IO_ALIGNMENT": "kvtier.io.backend",
    "DiskBackend": "kvtier.io.backend",
    "BackendUnavailableError": "kvtier.io.backend",
    "make_backend": "kvtier.io.backends",
    "compress": "kvtier.io.compression",
    "decompress": "kvtier.io.compression",
    "CpuBlockBuffer": "kvtier.io.cpu_buffer",
    "DiskStore": "kvtier.io.disk_store",
    "DiskStoreStats": "kvtier.io.store_files",
    "ReadOutcome": "kvtier.io.layout",
    "JobOutcome": "kvtier.io.engine",
    "JobResult": "kvtier.io.engine",
    "TransferEngine": "kvtier.io.engine",
    "FORMAT_VERSION": "kvtier.io.format",
    "HEADER_SIZE": "kvtier.io.format",
    "Codec": "kvtier.io.format",
    "LayoutFingerprint": "kvtier.io.format",
    "SlotHeader": "kvtier.io.format",
    "slot_size": "kvtier.io.format",
    "PosixBackend": "kvtier.io.posix_backend",
    "SlabFile": "kvtier.io.slab",
}

# Kept literal (tools read it); must list exactly the keys of _EXPORTS.
__all__ = [
    "BackendUnavailableError",
    "Codec",
    "CpuBlockBuffer",
    "DiskBackend",
    "DiskStore",
    "DiskStoreStats",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "IO_ALIGNMENT",
    "JobOutcome",
    "JobResult",
    "LayoutFingerprint",
    "PosixBackend",
    "ReadOutcome",
    "SlabFile",
    "SlotHeader",
    "TransferEngine",
    "compress",
    "decompress",
    "make_backend",
    "slot_size",
]

if TYPE_CHECKING:
    from kvtier.io.backend import IO_ALIGNMENT, BackendUnavailableError, DiskBackend
    from kvtier.io.backends import make_backend
    from kvtier.io.compression import compress, decompress
    from kvtier.io.cpu_buffer import CpuBlockBuffer
    from kvtier.io.disk_store import DiskStore
    from kvtier.io.engine import JobOutcome, JobResult, TransferEngine
    from kvtier.io.format import (
        FORMAT_VERSION,
        HEADER_SIZE,
        Codec,
        LayoutFingerprint,
        SlotHeader,
        slot_size,
    )
    from kvtier.io.layout import ReadOutcome
    from kvtier.io.posix_backend import PosixBackend
    from kvtier.io.slab import SlabFile
    from kvtier.io.store_files import DiskStoreStats


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier.io' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
