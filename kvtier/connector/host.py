"""Host-level safety of the CPU tier: one owner per file, no leftovers.

The CPU tier of rank ``r`` lives in ``cpu_buffer_path(engine_id, r, world)``
inside this user's private shared-memory directory. The worker owns (creates,
locks) the file; the name lives only until every process that needs it has
it mapped: the worker removes it at once when no disk tier is configured
(nobody else maps it), else the scheduler-side DiskRuntime removes it right
after mapping it at start-up (vLLM builds the workers' KV caches before the
scheduler). From then on the kernel frees the memory when the last mapping
goes, however the processes end. A crash inside that window leaves a file
whose lock died with its owner: the next start reclaims it. This module holds what the
spec does around that, so ``spec.py`` only calls in:

- :func:`prepare_cpu_tier` (both roles, at start-up): reclaim files of dead
  engines (their lock is gone), then check that shared memory suffices,
  naming the kvtier files that still hold it when it does not;
- :func:`open_worker_buffer` (worker): create the rank's file, with a clear
  error naming ``engine_id`` when a live engine already uses that id;
- :func:`close_on_error`: a half-built worker never leaves its file behind.

No vLLM import.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from kvtier.connector.config import ConfigError
from kvtier.host.cpu_buffer import CpuBlockBuffer, mapped_bytes
from kvtier.host.cpu_files import cpu_buffer_path, reclaim_stale_cpu_files
from kvtier.log import get_logger
from kvtier.safe_open import InUseError

logger = get_logger("connector")


def _kvtier_shm_files(directory: str, exclude: Sequence[str]) -> list[tuple[str, int]]:
    """Other kvtier CPU-tier files still holding shared memory: in our private
    directory (live engines) and, from older kvtier versions, directly in its
    parent (``/dev/shm/kvtier-*.cpu``)."""
    skip = {os.path.abspath(p) for p in exclude}
    patterns = [
        os.path.join(directory, "*.cpu"),
        os.path.join(os.path.dirname(directory), "kvtier-*.cpu"),
    ]
    found: list[tuple[str, int]] = []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            if os.path.abspath(path) in skip:
                continue
            with contextlib.suppress(OSError):
                st = os.stat(path, follow_symlinks=False)
                if st.st_uid == os.geteuid():
                    found.append((path, st.st_blocks * 512))
    return found


def shm_available(
    shm_dir: str,
    existing: Iterable[str] = (),
    *,
    free_bytes: Callable[[str], int] | None = None,
) -> int:
    """Bytes of shared memory the CPU tier can have in ``shm_dir``: what is
    free, plus what ``existing`` (this engine's CPU-tier files, created by
    its other role) already hold."""
    free_bytes = free_bytes or (lambda p: shutil.disk_usage(p).free)
    available = free_bytes(shm_dir)
    for path in existing:
        with contextlib.suppress(OSError):
            available += os.stat(path).st_blocks * 512
    return available


def check_shm_space(
    shm_dir: str,
    needed: int,
    existing: Iterable[str] = (),
    *,
    free_bytes: Callable[[str], int] | None = None,
    holders: str = "",
) -> None:
    """Fail fast when the CPU tier's shared-memory file system is too small:
    a :class:`ConfigError` naming ``cpu_bytes_to_use`` and the fix.
    ``holders``: a sentence naming other files that hold the space."""
    available = shm_available(shm_dir, existing, free_bytes=free_bytes)
    if available < needed:
        raise ConfigError(
            "cpu_bytes_to_use",
            f"the CPU tier needs {needed} bytes of shared memory in {shm_dir!r} "
            f"but only {available} are free; enlarge it (e.g. docker run "
            f"--shm-size) or lower cpu_bytes_to_use{holders}",
        )


def prepare_cpu_tier(paths: Sequence[str], num_blocks: int, block_bytes: int) -> None:
    """Reclaim dead engines' CPU-tier files, then check shared memory for
    one CPU tier of ``num_blocks`` rows of ``block_bytes`` per path.

    ``paths`` are this engine's files (one per rank, all in one directory).
    A file whose owner died (SIGKILL, OOM kill) keeps its shared memory
    until removed; its lock died with the owner, so it is removed here. When
    space is still short, the error names the kvtier files that hold it."""
    directory = os.path.dirname(paths[0])
    reclaim_stale_cpu_files(directory)
    needed = len(paths) * mapped_bytes(num_blocks, block_bytes)
    if shm_available(directory, paths) >= needed:
        return
    others = _kvtier_shm_files(directory, paths)
    holders = ""
    if others:
        listed = ", ".join(f"{p} ({n} bytes)" for p, n in others)
        holders = (
            f". Other kvtier CPU-tier files hold {sum(n for _, n in others)} "
            f"bytes of it: {listed}. Files in {directory} are held by running "
            "engines (stop them); files outside it were left by older kvtier "
            "versions: remove those no running engine uses"
        )
    check_shm_space(directory, needed, paths, holders=holders)


def open_worker_buffer(
    engine_id: str,
    rank: int,
    world_size: int,
    num_blocks: int,
    block_bytes: int,
    *,
    shared: bool = True,
) -> CpuBlockBuffer:
    """Create and own rank ``rank``'s CPU-tier file for the worker.

    ``shared=False`` (no other process maps it: no disk tier) removes the
    name at once, so the memory has no name from start-up on (and no other
    engine can reach its rows). A live engine holding a file of the same
    name (before its scheduler side mapped it) means two engines run with
    one ``engine_id`` on this host; they would share rows (wrong outputs), so
    that is refused with the fix."""
    path = cpu_buffer_path(engine_id, rank, world_size)
    try:
        buffer = CpuBlockBuffer(num_blocks, block_bytes, path, owner=True)
    except InUseError as exc:
        raise InUseError(
            f"kvtier: another running engine on this host uses engine_id "
            f"{engine_id!r} (its CPU tier {path!r} is locked by a live process). "
            "Two engines with one engine_id would share CPU-tier rows; give each "
            "engine a unique engine_id (kv_transfer_config 'engine_id', or leave "
            "it unset so vLLM generates one), or stop the other engine",
            path,
        ) from exc
    if not shared:
        buffer.unlink_name()
    return buffer


@contextlib.contextmanager
def close_on_error(resource: Any) -> Iterator[Any]:
    """Close ``resource`` (and so unlink an owned CPU-tier file) if the block
    raises, e.g. when building the worker around it fails."""
    try:
        yield resource
    except BaseException:
        try:
            resource.close()
        except Exception as exc:  # the original error matters more
            logger.warning("kvtier: cleanup after a failed start failed: %r", exc)
        raise
