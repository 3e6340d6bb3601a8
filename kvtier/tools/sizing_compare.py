"""Every eviction policy replayed on one trace, next to the offline optimum
(``kvtier size --compare``)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.tools.sizing import Progress, SizingResult, replay_trace
from kvtier.tools.trace import TraceRequest, infinite_cache_hit_rate, request_keys


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


def trace_optimal_hit_rate(
    requests: Sequence[TraceRequest | Sequence[Hashable]], capacity: int
) -> float:
    """:func:`kvtier.tiers.optimum.optimal_hit_rate` of a trace's requests."""
    from kvtier.tiers.optimum import optimal_hit_rate

    return optimal_hit_rate([request_keys(r) for r in requests], capacity)


def compare_policies(
    requests: Sequence[TraceRequest | Sequence[Hashable]],
    cpu_blocks: int,
    disk_blocks: int,
    *,
    spill_watermark: float = 0.75,
    promote_on_hit: bool = True,
    progress: Progress | None = None,
) -> PolicyComparison:
    """Replay every policy choice worth comparing (each policy alone without
    a disk tier; with one, every (cpu, disk) pair) and compute the optimum
    of one tier of ``cpu_blocks + disk_blocks``."""
    from kvtier.tiers.policy import policy_names

    names = policy_names()
    if disk_blocks > 0:
        pairs = [(c, d) for c in names for d in names]
    else:
        pairs = [(p, p) for p in names]
    results = [
        replay_trace(
            requests,
            cpu_blocks,
            disk_blocks,
            cp,
            dp,
            spill_watermark,
            promote_on_hit=promote_on_hit,
            progress=progress,
        )
        for cp, dp in pairs
    ]
    return PolicyComparison(
        cpu_blocks=cpu_blocks,
        disk_blocks=disk_blocks,
        optimal_hit_rate=trace_optimal_hit_rate(requests, cpu_blocks + disk_blocks),
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
