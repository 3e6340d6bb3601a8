"""Trace-driven sizing of the CPU and disk tiers (``kvtier size``).

Replays a Mooncake-format trace (one JSON object per line: ``timestamp`` in
ms, ``input_length``, ``output_length``, ``hash_ids``: prefix hashes of
512-token blocks, where an id covers its block and everything before it)
through the real :class:`~kvtier.tiers.TierHierarchy`, as the plugin's
scheduler side would drive it, with every spill and load completing
instantly. Only the offload tiers are modelled: every block of every request
is looked up in CPU/disk (the GPU prefix cache is not simulated).

Hit rate is block-level: hit blocks / all blocks of all requests. The
infinite-cache bound counts every block seen earlier in the trace as a hit;
with prefix hashes that is exactly what a never-evicting prefix cache gets.

No vLLM import; pure Python on top of :mod:`kvtier.tiers`.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.tiers import Residency, TierHierarchy

TOKENS_PER_TRACE_BLOCK = 512
DEFAULT_TARGET_FRACTION = 0.95

Progress = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a Mooncake trace."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


# Input bounds for trace files. The shared 3,993-request trace is 1.1 MB with
# lines under 2 KB; a line holds the prefix hashes of one request (about 10
# bytes per 512-token block), so 4 MiB is ~200 M tokens.
MAX_TRACE_LINE_BYTES = 4 << 20
MAX_TRACE_BYTES = 4 << 30
# Hash ids are unsigned 64-bit integers (benchmarks turn them into 32-byte
# keys with ``int.to_bytes``, which refuses negatives).
_HASH_MAX = (1 << 64) - 1
_LENGTH_MAX = (1 << 63) - 1


class TraceError(ValueError):
    """A trace file that cannot be read; the message names file and line."""


def _int_field(obj: Mapping[str, Any], name: str) -> int:
    v = obj.get(name, 0)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name!r} must be an integer, got {v!r:.40}")
    if not 0 <= v <= _LENGTH_MAX:
        raise ValueError(f"{name!r} out of range: {v!r:.40}")
    return v


def parse_request(obj: Mapping[str, Any]) -> TraceRequest:
    """A :class:`TraceRequest` from one decoded trace line.

    Raises ValueError for anything that is not a trace record: a non-object,
    missing or non-list ``hash_ids``, a hash id that is not a 64-bit integer
    (``1e400``, ``"12"``, ``3.0``, ``true``), or a non-numeric timestamp.
    """
    if not isinstance(obj, Mapping):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "hash_ids" not in obj:
        raise ValueError("trace line has no 'hash_ids'")
    raw = obj["hash_ids"]
    if not isinstance(raw, list):
        raise ValueError(f"'hash_ids' must be a list, got {type(raw).__name__}")
    for i, h in enumerate(raw):
        if isinstance(h, bool) or not isinstance(h, int):
            raise ValueError(f"hash id #{i} is not an integer: {h!r:.40}")
        if not 0 <= h <= _HASH_MAX:
            raise ValueError(f"hash id #{i} is not in [0, 2**64): {h!r:.40}")
    ts = obj.get("timestamp", 0.0)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise ValueError(f"'timestamp' must be a number, got {ts!r:.40}")
    try:
        timestamp = float(ts)
    except OverflowError:
        raise ValueError(f"'timestamp' out of range: {ts!r:.40}") from None
    if not math.isfinite(timestamp):
        raise ValueError(f"'timestamp' must be finite, got {ts!r:.40}")
    return TraceRequest(
        timestamp=timestamp,
        input_length=_int_field(obj, "input_length"),
        output_length=_int_field(obj, "output_length"),
        hash_ids=tuple(raw),
    )


def _open_trace(path: str | os.PathLike[str]) -> Any:
    """A binary reader for a trace, which must be a regular file: devices
    (``/dev/zero``), FIFOs and directories are refused, and opening never
    blocks (``O_NONBLOCK``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise TraceError(f"{path}: is a directory, not a trace file")
        if not stat.S_ISREG(st.st_mode):
            kind = (
                "character device"
                if stat.S_ISCHR(st.st_mode)
                else "FIFO"
                if stat.S_ISFIFO(st.st_mode)
                else "special file"
            )
            raise TraceError(f"{path}: is a {kind}, not a regular trace file")
        if st.st_size > MAX_TRACE_BYTES:
            raise TraceError(
                f"{path}: {st.st_size} bytes, more than the {MAX_TRACE_BYTES} "
                "a trace may have"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def load_trace(
    path: str | os.PathLike[str], limit: int | None = None
) -> list[TraceRequest]:
    """Read a JSONL trace (blank lines skipped); at most ``limit`` requests.

    Raises :class:`TraceError` (a ValueError) naming the file and line for
    anything that is not a trace: not a regular file, a line longer than
    MAX_TRACE_LINE_BYTES (``/dev/zero``-like input has no newlines), more
    than MAX_TRACE_BYTES in all, invalid JSON or a bad record (see
    :func:`parse_request`), or no request at all.
    """
    requests: list[TraceRequest] = []
    total = 0
    with _open_trace(path) as f:
        lineno = 0
        while limit is None or len(requests) < limit:
            raw = f.readline(MAX_TRACE_LINE_BYTES + 1)
            if not raw:
                break
            lineno += 1
            total += len(raw)
            if len(raw) > MAX_TRACE_LINE_BYTES:
                raise TraceError(
                    f"{path}:{lineno}: line longer than {MAX_TRACE_LINE_BYTES} "
                    "bytes (not a JSONL trace?)"
                )
            if total > MAX_TRACE_BYTES:
                raise TraceError(
                    f"{path}:{lineno}: more than {MAX_TRACE_BYTES} bytes of trace"
                )
            line = raw.strip()
            if not line:
                continue
            try:
                requests.append(parse_request(json.loads(line)))
            except RecursionError:
                raise TraceError(f"{path}:{lineno}: JSON nested too deeply") from None
            except (ValueError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: {exc}") from None
    if not requests:
        raise TraceError(f"{path}: no trace records (empty file?)")
    return requests


def _keys(req: TraceRequest | Sequence[Hashable]) -> Sequence[Hashable]:
    return req.hash_ids if isinstance(req, TraceRequest) else req


def infinite_cache_hit_rate(
    requests: Iterable[TraceRequest | Sequence[Hashable]],
) -> float:
    """Block-level hit rate of a cache that never evicts."""
    seen: set[Hashable] = set()
    hits = total = 0
    for req in requests:
        keys = _keys(req)
        total += len(keys)
        hits += sum(1 for k in keys if k in seen)
        seen.update(keys)
    return hits / total if total else 0.0


def unique_blocks(requests: Iterable[TraceRequest]) -> int:
    """Distinct blocks in the trace (the capacity that never evicts)."""
    seen: set[Hashable] = set()
    for req in requests:
        seen.update(_keys(req))
    return len(seen)


@dataclass
class SizingResult:
    """Outcome of one replay. Rates are fractions of ``blocks``."""

    cpu_blocks: int
    disk_blocks: int
    cpu_policy: str
    disk_policy: str
    spill_watermark: float
    requests: int = 0
    blocks: int = 0
    hit_blocks_cpu: int = 0
    hit_blocks_disk: int = 0
    infinite_hit_rate: float = 0.0
    # Store batches refused even after completing the pending spills, and
    # the new blocks they would have stored (a later request misses them).
    stores_declined: int = 0
    blocks_not_stored: int = 0
    spills: int = 0
    promotions: int = 0
    cpu_evictions: int = 0
    disk_evictions: int = 0

    @property
    def hit_blocks(self) -> int:
        return self.hit_blocks_cpu + self.hit_blocks_disk

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def hit_rate_cpu(self) -> float:
        return self.hit_blocks_cpu / self.blocks if self.blocks else 0.0

    @property
    def hit_rate_disk(self) -> float:
        return self.hit_blocks_disk / self.blocks if self.blocks else 0.0

    @property
    def fraction_of_bound(self) -> float:
        """hit_rate / infinite_hit_rate (1.0 when the bound is 0)."""
        if self.infinite_hit_rate <= 0:
            return 1.0
        return self.hit_rate / self.infinite_hit_rate

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            hit_rate=self.hit_rate,
            hit_rate_cpu=self.hit_rate_cpu,
            hit_rate_disk=self.hit_rate_disk,
            hit_blocks=self.hit_blocks,
            fraction_of_bound=self.fraction_of_bound,
        )
        return d


class TraceReplayer:
    """Drives one :class:`TierHierarchy` request by request.

    Each phase is a method so benchmarks can time them separately; ``replay``
    runs them in order. I/O is instant: every spill order and every load is
    completed as soon as the hierarchy hands it out.
    """

    def __init__(self, hierarchy: TierHierarchy, max_store_blocks: int | None = None):
        self.h = hierarchy
        cap = hierarchy.cpu.capacity
        # A store larger than the CPU tier can never succeed in one call.
        self.max_store_blocks = min(max_store_blocks or cap, cap)
        self.result = SizingResult(
            cpu_blocks=cap,
            disk_blocks=hierarchy.disk.capacity if hierarchy.disk is not None else 0,
            cpu_policy=_policy_name(hierarchy.cpu.policy),
            disk_policy=(
                _policy_name(hierarchy.disk.policy) if hierarchy.disk else "lru"
            ),
            spill_watermark=hierarchy.spill_watermark,
        )
        self._seen: set[Hashable] = set()
        self._infinite_hits = 0

    # -- phases ---------------------------------------------------------------

    def lookup(self, keys: Sequence[Hashable]) -> tuple[int, list[Hashable]]:
        """Prefix lookup (same semantics as ``prefix_hits``): the number of
        leading keys ready in some tier, and those of them only on disk."""
        lookup = self.h.lookup
        n = 0
        on_disk: list[Hashable] = []
        for key in keys:
            r = lookup(key)
            if r is Residency.HIT_CPU:
                n += 1
            elif r is Residency.HIT_DISK:
                n += 1
                on_disk.append(key)
            else:
                break
        return n, on_disk

    def load(self, keys: Sequence[Hashable]) -> None:
        """Pin and release the hit blocks (loading them to the GPU); disk
        hits are read in place and copied up into free CPU rows, as the
        plugin's workers do."""
        if keys:
            plan = self.h.prepare_load(keys)
            self.h.complete_load(plan.load_id)

    def store(self, keys: Sequence[Hashable]) -> None:
        """Offer the computed blocks for storing, in CPU-sized batches."""
        step = self.max_store_blocks
        for i in range(0, len(keys), step):
            batch = keys[i : i + step]
            plan = self.h.prepare_store(batch)
            if plan is None:
                # Declined while dirty blocks wait for their spill: let the
                # spills finish (instant I/O) and retry once.
                self.drain_spills()
                plan = self.h.prepare_store(batch)
            if plan is None:
                self.result.stores_declined += 1
                self.result.blocks_not_stored += sum(
                    1 for k in batch if not self.h.lookup(k).is_hit
                )
                continue
            if plan.keys_to_store:
                self.h.complete_store(plan.keys_to_store)
            self.drain_spills()

    def drain_spills(self) -> None:
        for order in self.h.take_spills():
            self.h.complete_spill(order.job_id)

    # -- driver ---------------------------------------------------------------

    def replay(self, keys: Sequence[Hashable]) -> None:
        """One request: lookup, load the hits (CPU or disk), store the rest."""
        res = self.result
        n, disk_keys = self.lookup(keys)
        hits = keys[:n]
        self.load(hits)
        self.store(keys[n:])

        res.requests += 1
        res.blocks += len(keys)
        res.hit_blocks_disk += len(disk_keys)
        res.hit_blocks_cpu += n - len(disk_keys)
        seen = self._seen
        self._infinite_hits += sum(1 for k in keys if k in seen)
        seen.update(keys)

    def finish(self) -> SizingResult:
        res = self.result
        stats = self.h.stats
        res.spills = stats.spills_completed
        res.promotions = stats.promotions_completed
        res.cpu_evictions = stats.cpu_evictions
        res.disk_evictions = stats.disk_evictions
        res.infinite_hit_rate = self._infinite_hits / res.blocks if res.blocks else 0.0
        return res


def _policy_name(policy: object) -> str:
    if getattr(policy, "name", ""):
        return str(policy.name)  # type: ignore[attr-defined]
    name = type(policy).__name__.lower()
    return name.removesuffix("policy") or name


def replay_trace(
    requests: Iterable[TraceRequest | Sequence[Hashable]],
    cpu_blocks: int,
    disk_blocks: int,
    cpu_policy: str = "lru",
    disk_policy: str = "lru",
    spill_watermark: float = 0.75,
    *,
    max_store_blocks: int | None = None,
    progress: Progress | None = None,
) -> SizingResult:
    """Replay ``requests`` through a fresh ``TierHierarchy`` and count hits.

    Per request: prefix lookup (a hit block is credited to ``cpu`` when
    ``lookup`` says HIT_CPU, to ``disk`` when HIT_DISK), load of the hits
    (disk hits also copied into free CPU rows), store of the remaining
    blocks.
    ``progress`` is called with the number of requests done since its last
    call.
    """
    h = TierHierarchy(
        cpu_blocks,
        disk_blocks,
        cpu_policy=cpu_policy,
        disk_policy=disk_policy,
        spill_watermark=spill_watermark,
    )
    rep = TraceReplayer(h, max_store_blocks)
    rep.result.disk_policy = disk_policy
    pending = 0
    for req in requests:
        rep.replay(_keys(req))
        if progress is not None:
            pending += 1
            if pending == 64:
                progress(pending)
                pending = 0
    if progress is not None and pending:
        progress(pending)
    return rep.finish()


# ----------------------------------------------------------------- sizing


def bytes_per_block(
    bytes_per_token: int, tokens_per_block: int = TOKENS_PER_TRACE_BLOCK
) -> int:
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token}")
    return bytes_per_token * tokens_per_block


def blocks_for_bytes(
    nbytes: int, bytes_per_token: int, tokens_per_block: int = TOKENS_PER_TRACE_BLOCK
) -> int:
    """Whole trace blocks that fit in ``nbytes``."""
    if nbytes < 0:
        raise ValueError(f"byte budget must be >= 0, got {nbytes}")
    return nbytes // bytes_per_block(bytes_per_token, tokens_per_block)


@dataclass
class Recommendation:
    """Smallest disk tier (for a given CPU tier) reaching ``target_fraction``
    of the infinite-cache hit rate; ``disk_blocks`` is None if the bound
    cannot be reached (it always can with disk >= the trace's unique blocks,
    unless stores are declined)."""

    cpu_blocks: int
    target_fraction: float
    target_hit_rate: float
    infinite_hit_rate: float
    disk_blocks: int | None
    hit_rate: float | None
    unique_blocks: int
    bytes_per_block: int | None = None
    evaluated: list[SizingResult] = field(default_factory=list)

    @property
    def disk_bytes(self) -> int | None:
        if self.disk_blocks is None or self.bytes_per_block is None:
            return None
        return self.disk_blocks * self.bytes_per_block

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpu_blocks": self.cpu_blocks,
            "target_fraction": self.target_fraction,
            "target_hit_rate": self.target_hit_rate,
            "infinite_hit_rate": self.infinite_hit_rate,
            "disk_blocks": self.disk_blocks,
            "disk_bytes": self.disk_bytes,
            "hit_rate": self.hit_rate,
            "unique_blocks": self.unique_blocks,
            "bytes_per_block": self.bytes_per_block,
            "evaluated": [
                {"disk_blocks": r.disk_blocks, "hit_rate": r.hit_rate}
                for r in sorted(self.evaluated, key=lambda r: r.disk_blocks)
            ],
        }


def recommend_disk_blocks(
    requests: Sequence[TraceRequest],
    cpu_blocks: int,
    target_fraction: float = DEFAULT_TARGET_FRACTION,
    *,
    cpu_policy: str = "lru",
    disk_policy: str = "lru",
    spill_watermark: float = 0.75,
    tolerance: float = 0.02,
    bytes_per_token: int | None = None,
    on_replay: Callable[[SizingResult], None] | None = None,
) -> Recommendation:
    """Sweep disk capacities to find the smallest reaching the target.

    Doubles the disk tier from ``cpu_blocks`` until the target is met (or the
    disk holds every unique block), then bisects between the last miss and
    the first success until they are within ``tolerance`` (relative) of each
    other. Assumes the hit rate grows with disk capacity, which holds for
    these policies up to small non-monotonic wiggles.
    """
    if not 0 < target_fraction <= 1:
        raise ValueError(f"target_fraction must be in (0, 1], got {target_fraction}")
    runs: dict[int, SizingResult] = {}

    def run(disk: int) -> SizingResult:
        if disk not in runs:
            runs[disk] = replay_trace(
                requests, cpu_blocks, disk, cpu_policy, disk_policy, spill_watermark
            )
            if on_replay is not None:
                on_replay(runs[disk])
        return runs[disk]

    n_unique = unique_blocks(requests)
    bound = infinite_cache_hit_rate(requests)
    target = target_fraction * bound
    rec = Recommendation(
        cpu_blocks=cpu_blocks,
        target_fraction=target_fraction,
        target_hit_rate=target,
        infinite_hit_rate=bound,
        disk_blocks=None,
        hit_rate=None,
        unique_blocks=n_unique,
        bytes_per_block=bytes_per_block(bytes_per_token) if bytes_per_token else None,
    )

    def ok(r: SizingResult) -> bool:
        return r.hit_rate >= target - 1e-12

    lo, hi = 0, None
    if ok(run(0)):
        hi = 0
    else:
        disk = max(1, cpu_blocks)
        while True:
            if ok(run(disk)):
                hi = disk
                break
            lo = disk
            if disk >= n_unique:
                break
            disk = min(2 * disk, max(n_unique, 1))
    if hi is not None and hi > 0:
        while hi - lo > max(1, int(tolerance * hi)):
            mid = (lo + hi) // 2
            if ok(run(mid)):
                hi = mid
            else:
                lo = mid
    rec.evaluated = list(runs.values())
    if hi is not None:
        rec.disk_blocks = hi
        rec.hit_rate = runs[hi].hit_rate
    return rec


def sweep_disk(
    requests: Sequence[TraceRequest],
    cpu_blocks: int,
    disk_sizes: Iterable[int],
    *,
    cpu_policy: str = "lru",
    disk_policy: str = "lru",
    spill_watermark: float = 0.75,
    on_replay: Callable[[SizingResult], None] | None = None,
) -> list[SizingResult]:
    """One replay per disk size (sorted, deduplicated)."""
    out = []
    for disk in sorted(set(disk_sizes)):
        r = replay_trace(
            requests, cpu_blocks, disk, cpu_policy, disk_policy, spill_watermark
        )
        out.append(r)
        if on_replay is not None:
            on_replay(r)
    return out


def default_sweep_sizes(cpu_blocks: int, disk_blocks: int, n_unique: int) -> list[int]:
    """Disk sizes for a hit-rate-vs-disk plot: 0, powers of two times the
    CPU tier up to the trace's unique blocks, and the configured size."""
    sizes = {0, disk_blocks}
    mult = 1
    while True:
        d = int(cpu_blocks * mult)
        if d >= n_unique:
            sizes.add(n_unique)
            break
        if d > 0:
            sizes.add(d)
        mult *= 2
    return sorted(sizes)


# ------------------------------------------------------------- comparison


@dataclass
class PolicyComparison:
    """Every policy choice replayed on one trace and tier size, next to the
    offline optimum of one tier of the total capacity (an upper bound for
    any policy, see :mod:`kvtier.tiers.optimum`) and the infinite cache."""

    cpu_blocks: int
    disk_blocks: int
    optimal_hit_rate: float
    infinite_hit_rate: float
    results: list[SizingResult] = field(default_factory=list)

    def fraction_of_optimum(self, r: SizingResult) -> float:
        if self.optimal_hit_rate <= 0:
            return 1.0
        return r.hit_rate / self.optimal_hit_rate

    def best(self) -> SizingResult:
        return max(self.results, key=lambda r: r.hit_rate)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpu_blocks": self.cpu_blocks,
            "disk_blocks": self.disk_blocks,
            "optimal_hit_rate": self.optimal_hit_rate,
            "infinite_hit_rate": self.infinite_hit_rate,
            "policies": [
                {
                    "cpu_policy": r.cpu_policy,
                    "disk_policy": r.disk_policy if self.disk_blocks else None,
                    "hit_rate": r.hit_rate,
                    "hit_rate_cpu": r.hit_rate_cpu,
                    "hit_rate_disk": r.hit_rate_disk,
                    "fraction_of_optimum": self.fraction_of_optimum(r),
                    "fraction_of_bound": r.fraction_of_bound,
                }
                for r in self.results
            ],
        }


def policy_pairs(
    disk_blocks: int, policies: Sequence[str] | None = None
) -> list[tuple[str, str]]:
    """(cpu, disk) policy choices worth comparing: each policy alone without
    a disk tier; with one, every combination."""
    from kvtier.tiers.policy import POLICIES

    names = list(policies or POLICIES)
    if disk_blocks <= 0:
        return [(p, p) for p in names]
    return [(c, d) for c in names for d in names]


def optimal_hit_rate(
    requests: Sequence[TraceRequest | Sequence[Hashable]], capacity: int
) -> float:
    """Offline optimum (Belady on prefix hits) of one tier of ``capacity``."""
    from kvtier.tiers.optimum import optimal_hit_rate as _opt

    return _opt([_keys(r) for r in requests], capacity)


def compare_policies(
    requests: Sequence[TraceRequest | Sequence[Hashable]],
    cpu_blocks: int,
    disk_blocks: int,
    pairs: Sequence[tuple[str, str]] | None = None,
    spill_watermark: float = 0.75,
    *,
    progress: Progress | None = None,
) -> PolicyComparison:
    """Replay every (cpu, disk) policy pair (default :func:`policy_pairs`)
    and compute the optimum of one tier of ``cpu_blocks + disk_blocks``."""
    pairs = list(pairs or policy_pairs(disk_blocks))
    results = [
        replay_trace(
            requests,
            cpu_blocks,
            disk_blocks,
            cp,
            dp,
            spill_watermark,
            progress=progress,
        )
        for cp, dp in pairs
    ]
    return PolicyComparison(
        cpu_blocks=cpu_blocks,
        disk_blocks=disk_blocks,
        optimal_hit_rate=optimal_hit_rate(requests, cpu_blocks + disk_blocks),
        infinite_hit_rate=infinite_cache_hit_rate(requests),
        results=results,
    )


def format_comparison(cmp: PolicyComparison) -> list[str]:
    """The comparison as text lines (``kvtier size --compare``)."""
    with_disk = cmp.disk_blocks > 0
    head = f"{'cpu policy':<11}" + (f"{'disk policy':<12}" if with_disk else "")
    lines = [
        head + f"{'hit rate':>9}{'cpu':>8}{'disk':>8}{'of optimum':>12}{'of bound':>10}"
    ]
    for r in sorted(cmp.results, key=lambda r: -r.hit_rate):
        lines.append(
            f"{r.cpu_policy:<11}"
            + (f"{r.disk_policy:<12}" if with_disk else "")
            + f"{r.hit_rate:>9.4f}{r.hit_rate_cpu:>8.4f}{r.hit_rate_disk:>8.4f}"
            f"{cmp.fraction_of_optimum(r):>12.1%}{r.fraction_of_bound:>10.1%}"
        )
    total = cmp.cpu_blocks + cmp.disk_blocks
    lines.append(
        f"{'optimum':<11}"
        + (f"{'(one tier)':<12}" if with_disk else "")
        + f"{cmp.optimal_hit_rate:>9.4f}   offline Belady, one tier of {total} blocks"
    )
    lines.append(
        f"{'infinite':<11}"
        + (" " * 12 if with_disk else "")
        + f"{cmp.infinite_hit_rate:>9.4f}"
    )
    return lines
