"""``SharedFsTier``: vLLM's ``fs`` tier on a shared mount, behind a guard.

vLLM's ``FileSystemTierManager`` (``"type": "fs"``) is a fine shared tier on
Lustre, CephFS, NFS or a 3FS FUSE mount, and kvtier composes with it as is
(``secondary_tiers = [KvtierDiskTier, fs]``). What it does not do is cope
with the mount itself failing:

- at start-up it ``makedirs`` its root: an unmounted root is silently
  created on the local disk (the fleet stops sharing without a word), and an
  unwritable or hung root raises or blocks, so the engine does not start;
- at run time its existence checks run on a helper thread, and while they
  are unanswered the lookup says ``RETRY``: on a hung mount every request
  that misses locally is deferred, step after step, forever.

This tier wraps an unmodified ``FileSystemTierManager`` and adds exactly
that guard. At start-up the root must already exist and accept an
exclusively created probe file within ``probe_timeout_s``; otherwise the
tier starts *offline*, with one warning naming the reason. A lookup left
unanswered for ``lookup_timeout_s``, or a store unfinished after
``store_timeout_s``, takes the tier offline at run time. Offline, lookups
are misses, stores and loads finish at once as failed (vLLM releases the
primary slots and recomputes), and nothing waits on the mount. The engine
runs on its GPU cache, CPU tier and local NVMe tier meanwhile. A restart
brings the tier back.

Two things stay vLLM's: a read or write already blocked in the kernel keeps
its primary slot pinned until it returns (it cannot be aborted safely), and
``reset_cache`` waits for in-flight I/O, as vLLM's contract for
``drain_jobs`` requires. Shutdown waits at most ``probe_timeout_s`` once the
tier is offline, and online at most as long as the guard would before calling
it a hang (``lookup_timeout_s``, or what is left of a store's
``store_timeout_s``).

Config (one ``secondary_tiers`` entry; the keys of ``fs`` plus the guard's,
:class:`kvtier.connector.config.SharedFsTierConfig`)::

    {"type": "SharedFsTier", "module_path": "kvtier.connector.tiering",
     "root_dir": "/mnt/shared/kv", "locality": "REMOTE",
     "enable_kv_events": true, "n_read_threads": 16, "n_write_threads": 16,
     "probe_timeout_s": 5, "lookup_timeout_s": 5, "store_timeout_s": 60}
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from typing_extensions import override
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import (
    JobId,
    JobResult,
    ParentManager,
    SecondaryTierManager,
    TransferJob,
)

from kvtier.connector.config import parse_shared_tier_config
from kvtier.log import get_logger

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

logger = get_logger("connector")

# Requests with a lookup answered RETRY tracked at most (vLLM reports each
# finished request; this only bounds the map should one never be).
_MAX_WAITING_REQUESTS = 65536


def probe_root(root: str, timeout: float) -> str | None:
    """None if ``root`` is a directory that takes an exclusively created file
    within ``timeout`` seconds, else why not. Runs on a daemon thread, so a
    hung mount costs ``timeout``, not the scheduler."""
    answer: list[str | None] = []

    def probe() -> None:
        try:
            if not stat.S_ISDIR(os.stat(root).st_mode):
                answer.append("is not a directory")
                return
            path = os.path.join(root, f".kvtier-probe-{os.getpid()}-{time.time_ns()}")
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            os.close(os.open(path, flags, 0o600))
            os.unlink(path)
            answer.append(None)
        except FileNotFoundError:
            answer.append(
                "does not exist (not mounted?); kvtier does not create it, so "
                "an absent mount is never replaced by a local directory"
            )
        except OSError as exc:
            answer.append(f"is not usable ({exc.strerror or exc})")

    thread = threading.Thread(target=probe, name="kvtier-shared-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive() or not answer:
        return f"did not answer within {timeout:g} s (probe_timeout_s)"
    return answer[0]


class SharedFsTier(SecondaryTierManager):
    """vLLM's ``fs`` tier with the guard described in the module doc."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **config: Any,
    ) -> None:
        super().__init__(
            offloading_spec, primary_kv_view, tier_type, backpressure_detector
        )
        entry = parse_shared_tier_config(config)
        root, locality = entry.root_dir, entry.locality
        self.root_dir = root
        self.locality = Locality(locality)
        self.probe_timeout_s = entry.probe_timeout_s
        self.lookup_timeout_s = entry.lookup_timeout_s
        self.store_timeout_s = entry.store_timeout_s
        self.inner: FileSystemTierManager | None = None
        self.offline_reason: str | None = probe_root(root, self.probe_timeout_s)
        if self.offline_reason is None:
            from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

            try:
                self.inner = FileSystemTierManager(
                    offloading_spec,
                    primary_kv_view,
                    tier_type,
                    root_dir=root,
                    locality=locality,
                    **entry.fs_keys(),
                )
            except OSError as exc:
                self.offline_reason = f"could not be prepared ({exc})"
        if self.offline_reason is not None:
            self._go_offline(self.offline_reason)
        else:
            logger.info("kvtier %s: shared tier on %s", tier_type, root)
        # Per request: when each of its lookups was first answered RETRY.
        # Per request, not per key: a key another request left unanswered
        # (it was aborted, or found the key in an earlier tier and stopped
        # asking) says nothing about how long this request's lookup waits.
        self._retry_since: dict[str, dict[OffloadKey, float]] = {}
        # Stores in flight and when each was submitted, in submission order:
        # the first is the oldest, which is all the per-step check reads (a
        # slow mount can hold thousands in flight).
        self._store_since: OrderedDict[JobId, float] = OrderedDict()
        self._done: list[JobResult] = []

    @property
    def online(self) -> bool:
        return self.offline_reason is None

    def _go_offline(self, reason: str) -> None:
        self.offline_reason = reason
        logger.warning(
            "kvtier %s: shared root %s %s; the shared tier is offline until the "
            "engine restarts (lookups miss, stores are skipped)",
            self.tier_type,
            self.root_dir,
            reason,
        )

    def _fail(self, job: TransferJob) -> None:
        self._done.append(JobResult(job.job_id, False, transfer_time=0.0))

    # ----------------------------------------------------------- contract

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if self.inner is None:
            return RequestOffloadingContext()
        return self.inner.on_new_request(req_context)

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self.online or self.inner is None:
            return LookupResult.MISS
        result = self.inner.lookup(key, req_context)
        waiting = self._retry_since.get(req_context.req_id)
        if result is not LookupResult.RETRY:
            if waiting:
                waiting.pop(key, None)
            return result
        now = time.monotonic()
        if waiting is None:
            if len(self._retry_since) >= _MAX_WAITING_REQUESTS:
                # The others' timers start again; nothing goes offline.
                self._retry_since.clear()
            waiting = self._retry_since[req_context.req_id] = {}
        since = waiting.setdefault(key, now)
        if now - since > self.lookup_timeout_s:
            self._retry_since.clear()
            self._go_offline(
                f"left a lookup unanswered for {self.lookup_timeout_s:g} s "
                "(lookup_timeout_s)"
            )
            return LookupResult.MISS
        return result

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if self.inner is not None:
            self.inner.touch(keys, req_context)

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        if not self.online or self.inner is None:
            self._fail(job_metadata)
            return
        self._store_since[job_metadata.job_id] = time.monotonic()
        self.inner.submit_store(job_metadata)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        if not self.online or self.inner is None:
            self._fail(job_metadata)
            return
        self.inner.submit_load(job_metadata)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        results, self._done = self._done, []
        if self.inner is None:
            return results
        for result in self.inner.get_finished_jobs():
            self._store_since.pop(result.job_id, None)
            results.append(result)
        if self.online and self._store_since:
            oldest = next(iter(self._store_since.values()))
            if time.monotonic() - oldest > self.store_timeout_s:
                self._go_offline(
                    f"left a store unfinished for {self.store_timeout_s:g} s "
                    "(store_timeout_s)"
                )
        return results

    @override
    def has_pending_work(self) -> bool:
        return bool(self._done)

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.inner is not None:
            yield from self.inner.take_events()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        if self.inner is not None:
            self.inner.on_request_finished(req_context)
        self._retry_since.pop(req_context.req_id, None)

    @override
    def serve_external_requests(self, parent: ParentManager) -> None:
        if self.inner is not None:
            self.inner.serve_external_requests(parent)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self.inner is not None:
            self.inner.on_schedule_end(context)

    @override
    def drain_jobs(self) -> None:
        # vLLM's contract: no I/O may touch primary memory after this
        # returns, so this waits even for a hung mount (reset_cache only).
        if self.inner is not None:
            self.inner.drain_jobs()

    @override
    def shutdown(self) -> None:
        inner, self.inner = self.inner, None
        if inner is None:
            return
        # vLLM's fs tier joins its lookup and I/O threads without a limit.
        # Offline (the mount stopped answering): give them probe_timeout_s.
        # Online: as long as the guard would have waited before calling it a
        # hang (lookup_timeout_s, or what is left of a store's
        # store_timeout_s); a mount that hangs just before shutdown must not
        # hang it. Then leave them (daemon threads); vLLM's primary region
        # stays mapped while a thread still holds a view of it.
        limit = self.probe_timeout_s
        if self.online:
            now = time.monotonic()
            stores = [t + self.store_timeout_s - now for t in self._store_since.values()]
            limit = max([self.lookup_timeout_s, *stores])
        closer = threading.Thread(target=inner.shutdown, daemon=True)
        closer.start()
        closer.join(limit)
        if closer.is_alive():
            logger.warning(
                "kvtier %s: shared root %s: I/O threads still busy after %g s at "
                "shutdown (a hung mount?); shutting down without them",
                self.tier_type,
                self.root_dir,
                limit,
            )
