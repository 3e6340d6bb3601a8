"""``TieredOffloadingSpec``: kvtier as an out-of-tree vLLM OffloadingSpec,
built by kvtier's connector (:mod:`kvtier.connector.connector` has the
``--kv-transfer-config`` that enables both; vLLM's stock connector may build
it too, without a disk tier).

vLLM builds one spec per role: the scheduler calls ``get_manager`` and each
worker calls ``get_worker``. Both sides derive the same geometry from the
same ``OffloadingConfig`` and meet on the shared CPU-tier files.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from typing_extensions import override
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier.connector.compat import check_sync_load_budget
from kvtier.connector.config import (
    CANONICAL_LAYOUT_REFUSAL,
    CONNECTOR_HINT,
    ConfigError,
    KvtierConfig,
    TransferConfigError,
    blocks_in_budget,
    parse_extra_config,
)
from kvtier.connector.identity import (
    ModelSource,
    describe_settings,
    layout_fingerprints,
    settings_identity,
    weights_change_at_runtime,
)
from kvtier.connector.metrics import metric_definitions
from kvtier.connector.preflight import check_disk_paths, prepare_cpu_tier
from kvtier.connector.topology import check_single_node
from kvtier.host.cpu_tier import (
    AttachedRows,
    cpu_buffer_path,
    open_worker_buffer,
    worker_cpu_dir,
)
from kvtier.log import get_logger
from kvtier.store.compression import element_bytes
from kvtier.store.slabs import store_dirname
from kvtier.store.slot import LayoutFingerprint, slot_size

logger = get_logger("connector")


def in_child_process(setting: str) -> bool:
    """Whether a helper-process setting (``disk_spill_process``,
    ``disk_read_process``: auto, on, off) runs that disk work in a child
    process on this platform. ``auto`` does on the CPU platform, where the
    child keeps the reads, checks and writes from under the engine's
    interpreter lock (docs/benchmarks.md, "Engine step stalls", "Spills
    next to a busy loop"), and keeps them in the engine's process on an
    accelerator, where the child's effect is not measured (docs/benchmarks.md,
    "Real-size model on GPU")."""
    from vllm.platforms import current_platform

    return setting == "on" or (setting == "auto" and current_platform.is_cpu())


def device_copy_path() -> Any:
    """The worker's copy path for this platform: vLLM's transfer code
    (:class:`kvtier.connector.worker.device_copy.DeviceCopies`) on the platforms
    vLLM's CPU offloading supports, ``None`` (kvtier's host copier) on the
    CPU platform, where the KV cache lives in host memory."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return None
    if not (current_platform.is_cuda_alike() or current_platform.is_xpu()):
        raise RuntimeError(
            f"kvtier: KV-cache offloading copies through vLLM's CPU offloading "
            f"code, which supports CUDA-alike and XPU platforms, not "
            f"{current_platform.device_name}"
        )
    from kvtier.connector.worker.device_copy import DeviceCopies

    return DeviceCopies


@dataclass(frozen=True)
class ConnectorFacts:
    """What kvtier's connector knows of the engine and hands to the spec it
    builds; vLLM's ``OffloadingConfig`` carries neither.

    ``kv_cache_groups``: the model's number of KV-cache groups,
    ``concurrent_batches``: vLLM's ``max_concurrent_batches``, and
    ``model_runner_v2``: vLLM's ``use_v2_model_runner`` (each refuses a
    synchronous-load budget a disk tier cannot honour). ``settings``: what
    the resolved ``VllmConfig`` says produces KV values
    (:func:`~kvtier.connector.identity.settings_identity`), part of the disk
    tier's namespace; the scheduler's and every worker's connector compute
    it from the same config. ``source``: where the engine reads the model
    (:class:`~kvtier.connector.identity.ModelSource`: a hub id's snapshot
    at the engine's ``revision`` in its ``download_dir``), whose contents
    the disk tier's namespace hashes. None: not known (tests and tools).

    :meth:`of` looks the model up once for both: the snapshot named in
    ``settings`` is the one whose contents are hashed."""

    kv_cache_groups: int | None = None
    settings: dict[str, Any] | None = None
    source: ModelSource | None = None
    concurrent_batches: int | None = None
    model_runner_v2: bool | None = None

    @classmethod
    def of(cls, vllm_config: Any, kv_cache_groups: int) -> ConnectorFacts:
        """The facts of the engine ``vllm_config`` describes."""
        source = ModelSource.of(vllm_config)
        return cls(
            kv_cache_groups,
            settings_identity(vllm_config, source),
            source,
            int(vllm_config.max_concurrent_batches),
            bool(vllm_config.use_v2_model_runner),
        )


def warn_disk_smaller_than_cpu(num_cpu_blocks: int, num_disk_blocks: int) -> bool:
    """Warn, and return True, when a disk tier holds fewer blocks than the
    CPU tier. A CPU block leaves its tier only once it is on disk
    (write-back), so such a disk tier makes CPU stores wait for spills into
    it: the CPU tier is declined stores and holds fewer blocks than it
    would with no disk tier at all (docs/configuration.md gives the
    figures)."""
    if not 0 < num_disk_blocks < num_cpu_blocks:
        return False
    logger.warning(
        "kvtier: the disk tier (%d blocks) is smaller than the CPU tier (%d "
        "blocks): CPU blocks leave only once spilled to disk, so stores into "
        "the CPU tier wait for room on disk and are declined. Raise "
        "disk_bytes_to_use above cpu_bytes_to_use, or give disk_bytes_to_use 0 "
        "for no disk tier",
        num_disk_blocks,
        num_cpu_blocks,
    )
    return True


class TieredOffloadingSpec(OffloadingSpec):
    """GPU -> CPU DRAM -> disk, with cascade, promotion and checksums.

    ``facts`` None: built by vLLM's factory under the stock connector, which
    asserts on a failed load, so a disk tier is refused; kvtier's connector
    passes its :class:`ConnectorFacts`."""

    @override
    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    def __init__(self, config: OffloadingConfig, facts: ConnectorFacts | None = None):
        super().__init__(config)
        check_single_node(config)  # workers on another node: refuse
        self.kvtier: KvtierConfig = parse_extra_config(self.extra_config)
        # Only kvtier's connector turns a failed job into a miss.
        self.under_kvtier_connector = facts is not None
        facts = facts or ConnectorFacts()
        self.settings = facts.settings
        self.source = facts.source
        check_sync_load_budget(
            self.kvtier,
            kv_cache_groups=facts.kv_cache_groups,
            concurrent_batches=facts.concurrent_batches,
            model_runner_v2=facts.model_runner_v2,
        )
        if config.canonical_layout:
            raise ConfigError("canonical_layout", CANONICAL_LAYOUT_REFUSAL)
        # vLLM's replicated layout (MLA under TP) keeps one host copy that
        # rank 0 writes; kvtier keeps one per rank (its rows and slots are
        # per-rank files), so it leaves ``self.replicated_layout`` False and
        # every rank stores its own copy: correct, world_size x the bytes.
        par = config.parallel
        self.rank = par.rank
        self.world_size = max(par.world_size, 1)
        # One CPU-tier row (and one disk slot) holds one offloaded block of
        # one rank: blocks_per_chunk GPU blocks of every layer of one KV-cache group.
        self.block_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        self.num_cpu_blocks = 0
        self.num_disk_blocks = 0
        if self.block_bytes > 0:
            self.num_cpu_blocks = blocks_in_budget(
                self.kvtier.cpu_bytes_to_use,
                self.block_bytes,
                self.world_size,
                "cpu_bytes_to_use",
                "offloaded block",
            )
            if self.kvtier.disk_enabled:
                self.num_disk_blocks = blocks_in_budget(
                    self.kvtier.disk_bytes_to_use,
                    slot_size(self.block_bytes),
                    self.world_size,
                    "disk_bytes_to_use",
                    "disk slot",
                )
        if self.kvtier.disk_enabled and not self.under_kvtier_connector:
            # The stock connector asserts on a failed load: a corrupt disk
            # block would crash the engine. Say how to fix it, at start.
            raise TransferConfigError(
                "kv_connector",
                "kvtier's disk tier needs kvtier's connector, which reports a "
                "corrupt disk block to vLLM for recomputation instead of "
                "crashing: " + CONNECTOR_HINT,
            )
        if self.num_disk_blocks and self.kvtier.disk_load_buffer_bytes < slot_size(
            self.block_bytes
        ):
            raise ConfigError(
                "disk_load_buffer_bytes",
                f"{self.kvtier.disk_load_buffer_bytes} bytes hold no disk slot of "
                f"{slot_size(self.block_bytes)} B; raise disk_load_buffer_bytes",
            )
        if self.block_bytes > 0:
            if self.kvtier.disk_enabled:  # the fingerprints hash the model
                check_disk_paths(
                    self.kvtier,
                    reusable=[store_dirname(fp) for fp in self.fingerprints],
                )
        else:
            check_disk_paths(self.kvtier)
        self._manager: OffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    # ------------------------------------------------------------- helpers

    @functools.cached_property
    def fingerprints(self) -> list[LayoutFingerprint]:
        """Per rank, what must match for a disk block to be reusable by this
        engine (the model's contents hashed once per spec)."""
        return layout_fingerprints(
            self.config,
            self.block_bytes,
            self.world_size,
            settings=self.settings,
            source=self.source,
        )

    def _buffer_path(self, rank: int) -> str:
        return cpu_buffer_path(self.config.engine_id, rank, self.world_size)

    # ------------------------------------------------------------ contract

    @override
    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            from kvtier.connector.manager import TieredOffloadingManager
            from kvtier.store.runtime import DiskRuntime
            from kvtier.store.store import open_stores
            from kvtier.tiers.hierarchy import TierHierarchy

            cfg = self.kvtier
            hierarchy = TierHierarchy(
                self.num_cpu_blocks,
                self.num_disk_blocks,
                cpu_policy=cfg.cpu_eviction_policy,
                disk_policy=cfg.disk_eviction_policy,
                spill_watermark=cfg.spill_watermark,
                promote_on_hit=cfg.promote_on_hit,
                record_events=self.kv_events_config.enable_kv_cache_events,
            )
            runtime = None
            if self.num_disk_blocks > 0:
                stores = open_stores(
                    cfg.disk_path,
                    self.fingerprints,
                    self.num_disk_blocks,
                    self.block_bytes,
                    # Spills only: disk reads happen in the workers, so
                    # kvikio (needing libcuda) is never loaded here.
                    backend="posix",
                    backend_why=(
                        f"the scheduler side's spills; disk_io={cfg.disk_io!r} "
                        "picks the workers' reads"
                    ),
                    compression=cfg.disk_compression,
                    elem_size=element_bytes(self.config.model.dtype),
                    threads=cfg.disk_io_threads,
                )
                rows = [
                    AttachedRows(
                        self._buffer_path(r), self.num_cpu_blocks, self.block_bytes
                    )
                    for r in range(self.world_size)
                ]
                runtime = DiskRuntime(
                    stores,
                    rows,
                    threads=cfg.disk_io_threads,
                    spill_process=in_child_process(cfg.disk_spill_process),
                )
                # Blocks written under weights a trainer since replaced
                # (weight_transfer_config) must not outlive this engine.
                adopt = not weights_change_at_runtime(self.settings)
                try:
                    restored = runtime.scan_restore() if adopt else []
                    if restored:
                        hierarchy.restore_disk(restored)
                except BaseException:
                    # Its threads, slab files and store locks go with it.
                    runtime.close()
                    raise
                fp = self.fingerprints[0]
                logger.info(
                    "kvtier store identity: model %s, model_id %s, %s; store %s: %s",
                    fp.model,
                    fp.model_id[:16],
                    describe_settings(self.settings)
                    if self.settings is not None
                    else "settings unknown (not under kvtier's connector)",
                    store_dirname(fp),
                    f"warm restart adopted {len(restored)} disk blocks"
                    if restored
                    else "no blocks adopted (new or empty store)"
                    if adopt
                    else "no blocks adopted (weights change at runtime: "
                    "weight_transfer_config)",
                )
            self._manager = TieredOffloadingManager(
                hierarchy,
                runtime,
                block_bytes=self.block_bytes,
                world_size=self.world_size,
                enable_events=self.kv_events_config.enable_kv_cache_events,
            )
            warn_disk_smaller_than_cpu(self.num_cpu_blocks, self.num_disk_blocks)
            logger.info(
                "kvtier: CPU tier %d blocks (%s), disk tier %d blocks (%s), "
                "block %d B x %d rank(s)",
                self.num_cpu_blocks,
                cfg.cpu_eviction_policy,
                self.num_disk_blocks,
                cfg.disk_eviction_policy,
                self.block_bytes,
                self.world_size,
            )
        return self._manager

    def _disk_reader(
        self, cfg: Any, backend: Any, kv_caches: CanonicalKVCaches
    ) -> Any:
        """The worker's reader of disk hits (``disk_load_path``): a host
        bounce area, or a staging area on the KV cache's device. Owns
        ``backend`` once built."""
        from kvtier.store.reader import SlotReader
        from kvtier.store.slabs import SlabFiles

        files = SlabFiles.open(
            cfg.disk_path,
            self.fingerprints[self.rank],
            self.num_disk_blocks,
            backend,
            owns_backend=True,
        )
        capacity = max(1, cfg.disk_load_buffer_bytes // slot_size(self.block_bytes))
        device = kv_caches.tensors[0].tensor.device
        try:
            if cfg.disk_load_path == "device":
                return SlotReader(files, device=device, capacity=capacity)
            if in_child_process(cfg.disk_read_process):
                # On an accelerator the copy path page-locks the shared
                # area (DeviceCopies, as it does the CPU tier's).
                from kvtier.store.read_process import ReadProcess

                return ReadProcess(
                    files,
                    capacity=capacity,
                    disk_io=cfg.disk_io,
                    threads=cfg.disk_io_threads,
                )
            return SlotReader(files, capacity=capacity, pin=True)
        except BaseException:
            backend.shutdown()
            raise

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from kvtier.connector.worker.worker import TieredOffloadingWorker
            from kvtier.store.backends.factory import make_backend

            cfg = self.kvtier
            # Shared memory is checked here, where this rank's file is made,
            # and for that file alone. The scheduler's spec is built after the
            # workers made theirs, and other ranks may have made theirs
            # already (without a disk tier their names go at once): a check
            # there, or of every rank, asked again for room they already hold.
            directory = worker_cpu_dir()
            prepare_cpu_tier(
                cpu_buffer_path(
                    self.config.engine_id, self.rank, self.world_size, directory
                ),
                self.num_cpu_blocks,
                self.block_bytes,
            )
            buffer = open_worker_buffer(
                self.config.engine_id,
                self.rank,
                self.world_size,
                self.num_cpu_blocks,
                self.block_bytes,
                # Only the scheduler's DiskRuntime (disk tier) maps it too.
                shared=self.num_disk_blocks > 0,
                directory=directory,
            )
            reader: Any = None
            try:
                if self.num_disk_blocks > 0:
                    # This rank's slots, read-only, verified before use; the
                    # back end (kvikio where configured) lives only here.
                    backend = make_backend(cfg.disk_io, threads=cfg.disk_io_threads)
                    reader = self._disk_reader(cfg, backend, kv_caches)
                self._worker = TieredOffloadingWorker(
                    kv_caches,
                    buffer,
                    self.blocks_per_chunk,
                    reader,
                    device_copies=device_copy_path(),
                    contain_exceptions=self.under_kvtier_connector,
                )
            except BaseException:
                # Nothing of a failed start may outlive it (cf. vLLM's
                # CPUOffloadingSpec): the reader's threads, the /dev/shm file.
                if reader is not None:
                    reader.close()
                buffer.close()
                raise
        return self._worker
