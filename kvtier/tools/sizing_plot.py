"""Plots of replay results: hit rate vs disk capacity, split by tier.

matplotlib (Agg, no display) is imported lazily: install ``kvtier[tools]``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.tools.sizing import SizingResult
from kvtier.tools.sizing_compare import PolicyComparison

CPU_COLOR = "#4c72b0"
DISK_COLOR = "#dd8452"


def _label(r: SizingResult) -> str:
    if r.disk_blocks == 0:
        return "CPU only"
    mult = r.disk_blocks / r.cpu_blocks
    shown = f"{mult:.0f}x" if abs(mult - round(mult)) < 0.05 else f"{mult:.2g}x"
    return f"+disk {r.disk_blocks}\n({shown} CPU)"


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _tier_bars(ax: Any, results: Sequence[SizingResult]) -> range:
    """Stacked bars, CPU hits below and disk hits above, one per result; the
    y axis is the block hit rate. Returns the bars' x positions."""
    xs = range(len(results))
    cpu = [r.hit_rate_cpu for r in results]
    disk = [r.hit_rate_disk for r in results]
    ax.bar(xs, cpu, color=CPU_COLOR, label="hit on CPU")
    ax.bar(xs, disk, bottom=cpu, color=DISK_COLOR, label="hit on disk")
    ax.set_xticks(list(xs))
    ax.set_ylim(0, 1.0)
    ax.set_ylabel("block hit rate")
    ax.grid(axis="y", alpha=0.3)
    return xs


def check_plot_path(out_path: str | os.PathLike[str]) -> None:
    """Raise ValueError unless a plot can be saved to ``out_path``.

    Meant to run before a long replay: matplotlib must import, the extension
    must be a format it writes (none means PNG), and the file must be
    creatable or, if it exists, a writable regular file. Nothing is left
    behind: an existing file is opened without truncation, a new one is
    created and removed again.
    """
    path = os.fspath(out_path)
    try:
        _pyplot()
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as exc:
        raise ValueError(
            f"plotting needs matplotlib (pip install 'kvtier[tools]'): {exc}"
        ) from None
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a directory")
    ext = os.path.splitext(path)[1][1:].lower()
    supported = FigureCanvasBase.get_supported_filetypes()
    if ext and ext not in supported:
        raise ValueError(
            f"{path}: unknown image format {ext!r} "
            f"(one of {', '.join(sorted(supported))})"
        )
    flags = os.O_WRONLY | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        if os.path.lexists(path):
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise ValueError(f"{path}: not a regular file")
            os.close(os.open(path, flags))
        else:
            os.close(os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(path)
    except OSError as exc:
        raise ValueError(f"{path}: cannot write: {exc.strerror or exc}") from None


def _save(fig: Any, out_path: str | os.PathLike[str]) -> None:
    """Save ``fig`` to exactly ``out_path``: in the format its extension
    names, PNG without one (matplotlib alone would write PATH.png, not the
    file :func:`check_plot_path` checked and the command reports)."""
    ext = os.path.splitext(os.fspath(out_path))[1][1:].lower()
    fig.savefig(out_path, dpi=110, format=ext or "png")


def plot_tier_split(
    panels: Mapping[str, Sequence[SizingResult]],
    out_path: str | os.PathLike[str],
    title: str = "",
    target_fraction: float | None = None,
) -> None:
    """One subplot per panel: stacked bars (CPU hits below, disk hits above)
    per disk capacity, with the infinite-cache bound as a dashed line."""
    plt = _pyplot()
    n = len(panels)
    cols = min(n, 2)
    rows = (n + cols - 1) // cols
    width = max(6.0, 0.9 * max((len(v) for v in panels.values()), default=1) + 2)
    fig, axes = plt.subplots(
        rows, cols, figsize=(width * cols, 4.2 * rows), squeeze=False, sharey=True
    )
    for ax, (name, results) in zip(axes.flat, panels.items()):
        results = sorted(results, key=lambda r: r.disk_blocks)
        xs = _tier_bars(ax, results)
        for x, r in zip(xs, results):
            ax.text(x, r.hit_rate + 0.01, f"{r.hit_rate:.3f}", ha="center", fontsize=8)
        if results:
            bound = results[0].infinite_hit_rate
            ax.axhline(
                bound, color="k", ls="--", lw=1, label=f"infinite cache {bound:.3f}"
            )
            if target_fraction is not None:
                ax.axhline(
                    bound * target_fraction,
                    color="grey",
                    ls=":",
                    lw=1,
                    label=f"{target_fraction:.0%} of bound",
                )
        ax.set_xticklabels([_label(r) for r in results], fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    _save(fig, out_path)
    plt.close(fig)


def plot_policy_comparison(
    cmp: PolicyComparison, out_path: str | os.PathLike[str], title: str = ""
) -> None:
    """One stacked bar (CPU hits below, disk hits above) per policy choice,
    best first, with the offline optimum and the infinite cache as lines."""
    plt = _pyplot()
    results = sorted(cmp.results, key=lambda r: -r.hit_rate)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(results) + 2), 4.5))
    xs = _tier_bars(ax, results)
    for x, r in zip(xs, results):
        ax.text(
            x,
            r.hit_rate + 0.01,
            f"{r.hit_rate:.3f}\n{cmp.fraction_of_optimum(r):.0%}",
            ha="center",
            fontsize=7,
        )
    ax.axhline(
        cmp.optimal_hit_rate,
        color="green",
        ls="-.",
        lw=1,
        label=f"offline optimum {cmp.optimal_hit_rate:.3f}",
    )
    ax.axhline(
        cmp.infinite_hit_rate,
        color="k",
        ls="--",
        lw=1,
        label=f"infinite cache {cmp.infinite_hit_rate:.3f}",
    )
    with_disk = cmp.disk_blocks > 0
    ax.set_xticklabels(
        [
            f"{r.cpu_policy}/{r.disk_policy}" if with_disk else r.cpu_policy
            for r in results
        ],
        fontsize=8,
        rotation=30 if len(results) > 5 else 0,
    )
    ax.set_xlabel("policy (cpu/disk)" if with_disk else "policy")
    ax.legend(fontsize=8, loc="upper right")
    tiers = f"CPU {cmp.cpu_blocks}" + (
        f" + disk {cmp.disk_blocks} blocks" if with_disk else " blocks"
    )
    ax.set_title(f"{title}\n{tiers}; labels: hit rate, share of optimum", fontsize=9)
    fig.tight_layout()
    _save(fig, out_path)
    plt.close(fig)
