"""``kvtier size``: replay a trace through the tier hierarchy."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.tools.commands.common import emit_json, fmt_bytes, progress_bar


def _model_bytes_per_token(args: argparse.Namespace) -> int:
    """``--model``'s KV bytes per token (:mod:`kvtier.connector.model_kv`)."""
    from kvtier.connector.identity import ModelSource
    from kvtier.connector.model_kv import GeometryError, model_kv

    if args.bytes_per_token is not None:
        raise ValueError("give --bytes-per-token or --model, not both")
    source = ModelSource.resolve(args.model)
    if source.root is None:
        raise ValueError(
            f"--model {args.model!r}: no config.json here (give the model's "
            "directory, or a hub id in the Hugging Face cache), or give "
            "--bytes-per-token"
        )
    try:
        kv = model_kv(
            source.root,
            args.dtype or "auto",
            args.kv_cache_dtype or "auto",
            args.tensor_parallel_size or 1,
        )
    except GeometryError as exc:
        raise ValueError(
            f"--model {args.model!r}: {exc}; give --bytes-per-token"
        ) from exc
    return kv.bytes_per_token


def _size_blocks(args: argparse.Namespace) -> tuple[int, int, int | None]:
    """(cpu_blocks, disk_blocks, bytes_per_token) from the blocks or bytes form
    (the parser refuses sizes < 0 and bytes per token <= 0)."""
    from kvtier.tools.sizing import bytes_per_block

    if args.model is None and (
        args.dtype or args.kv_cache_dtype or args.tensor_parallel_size
    ):
        raise ValueError(
            "--dtype, --kv-cache-dtype and --tensor-parallel-size need --model"
        )
    bpt = args.bytes_per_token if args.model is None else _model_bytes_per_token(args)
    if (args.cpu_bytes is not None or args.disk_bytes is not None) and bpt is None:
        raise ValueError("--cpu-bytes/--disk-bytes need --bytes-per-token or --model")

    def blocks(tier: str, n_blocks: int | None, n_bytes: int | None) -> int | None:
        if n_blocks is not None and n_bytes is not None:
            raise ValueError(f"give --{tier}-blocks or --{tier}-bytes, not both")
        if n_bytes is None:
            return n_blocks
        n = n_bytes // bytes_per_block(bpt)
        # As the engine refuses a budget holding no block: a disk budget
        # that rounds to 0 is not "no disk tier" (that is --disk-bytes 0).
        if n == 0 and (n_bytes > 0 or tier == "cpu"):
            raise ValueError(
                f"--{tier}-bytes {n_bytes} holds no 512-token block "
                f"({fmt_bytes(bytes_per_block(bpt))} at {bpt} bytes/token); "
                f"raise --{tier}-bytes"
                + (", or give 0 for no disk tier" if tier == "disk" else "")
            )
        return n

    cpu = blocks("cpu", args.cpu_blocks, args.cpu_bytes)
    disk = blocks("disk", args.disk_blocks, args.disk_bytes) or 0
    if cpu is None:
        raise ValueError(
            "give --cpu-blocks, or --cpu-bytes with --bytes-per-token or --model"
        )
    return cpu, disk, bpt


def cmd_size(args: argparse.Namespace) -> int:
    from kvtier.tools import sizing, sizing_compare
    from kvtier.tools.trace import load_trace

    try:
        cpu, disk, bpt = _size_blocks(args)
    except ValueError as exc:
        print(f"kvtier size: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        # Before the replay, which can take minutes: not after it.
        from kvtier.tools.sizing_plot import check_plot_path

        try:
            check_plot_path(args.plot)
        except ValueError as exc:
            print(f"kvtier size: --plot: {exc}", file=sys.stderr)
            return 2
    try:
        requests = load_trace(args.trace, limit=args.limit)
    except (OSError, ValueError) as exc:
        print(f"kvtier size: cannot read trace: {exc}", file=sys.stderr)
        return 2
    show = not args.json
    replay = functools.partial(
        sizing.replay_trace,
        requests,
        cpu,
        cpu_policy=args.cpu_policy or args.policy,
        disk_policy=args.disk_policy or args.policy,
        spill_watermark=args.spill_watermark,
        promote_on_hit=args.promote_on_hit,
    )
    with progress_bar(show, len(requests), "replay", "req") as tick:
        result = replay(disk, progress=tick)
    doc: dict[str, Any] = {"trace": args.trace, **result.to_dict()}
    rec = None
    if bpt is not None or args.recommend:
        # The sweep's length is not known ahead (doubling, then bisection).
        with progress_bar(show, None, "sizing sweep", "replay") as tick:
            rec = sizing.recommend_disk_blocks(
                requests, cpu, replay, args.target, bytes_per_token=bpt, progress=tick
            )
        doc["bytes_per_token"] = bpt
        doc["recommendation"] = rec.to_dict()
    if bpt is not None:
        bpb = sizing.bytes_per_block(bpt)
        doc["cpu_bytes"] = cpu * bpb
        doc["disk_bytes"] = disk * bpb
    cmp = None
    if args.compare:
        with progress_bar(show, None, "compare", "req") as tick:
            cmp = sizing_compare.compare_policies(
                requests,
                cpu,
                disk,
                spill_watermark=args.spill_watermark,
                promote_on_hit=args.promote_on_hit,
                progress=tick,
            )
        doc["comparison"] = cmp.to_dict()
    if args.plot:
        if cmp is not None:
            from kvtier.tools.sizing_plot import plot_policy_comparison

            plot_policy_comparison(cmp, args.plot, title=args.trace)
        else:
            _plot_size(args, requests, replay, result, rec)
        doc["plot"] = args.plot
    if args.json:
        emit_json(doc)
    else:
        _print_size(args.trace, result, bpt, rec)
        if cmp is not None:
            print("policies:")
            for line in sizing_compare.format_comparison(cmp):
                print("  " + line)
    return 0


def _plot_size(
    args: argparse.Namespace,
    requests: Sequence[Any],
    replay: Callable[..., Any],
    result: Any,
    rec: Any,
) -> None:
    """Hit rate vs disk capacity, by tier: ``replay(disk_blocks)`` at the
    default sweep sizes, reusing the replays already done."""
    from kvtier.tools import sizing
    from kvtier.tools.sizing_plot import plot_tier_split
    from kvtier.tools.trace import unique_blocks

    known = {result.disk_blocks: result}
    if rec is not None:
        known.update({r.disk_blocks: r for r in rec.evaluated})
    cpu = result.cpu_blocks
    sizes = sizing.default_sweep_sizes(cpu, result.disk_blocks, unique_blocks(requests))
    if rec is not None and rec.disk_blocks is not None:
        sizes = sorted(set(sizes) | {rec.disk_blocks})
    todo = [d for d in sizes if d not in known]
    total = len(todo) * len(requests)
    with progress_bar(not args.json, total, "plot sweep", "req") as tick:
        for d in todo:
            known[d] = replay(d, progress=tick)
    title = (
        f"{args.trace}: CPU {cpu} blocks ({result.cpu_policy}), "
        f"disk policy {result.disk_policy}"
    )
    plot_tier_split(
        {"hit rate vs disk capacity": [known[d] for d in sizes]},
        args.plot,
        title=title,
        target_fraction=args.target,
    )


def _print_size(trace: str, r: Any, bpt: int | None, rec: Any) -> None:
    from kvtier.tools.sizing import bytes_per_block

    bpb = bytes_per_block(bpt) if bpt else None

    def size(blocks: int) -> str:
        return f"{blocks} blocks" + (f" ({fmt_bytes(blocks * bpb)})" if bpb else "")

    print(
        f"trace            {trace}: {r.requests} requests, {r.blocks} blocks of 512 tokens"
    )
    print(
        f"tiers            cpu {size(r.cpu_blocks)} [{r.cpu_policy}], "
        f"disk {size(r.disk_blocks)} [{r.disk_policy}], "
        f"spill watermark {r.spill_watermark}"
        + ("" if r.promote_on_hit else ", disk hits not promoted")
    )
    print(
        f"hit rate         {r.hit_rate:.4f}  (cpu {r.hit_rate_cpu:.4f}, "
        f"disk {r.hit_rate_disk:.4f})"
    )
    print(
        f"infinite cache   {r.infinite_hit_rate:.4f}  "
        f"(this configuration reaches {r.fraction_of_bound:.1%} of it)"
    )
    if r.stores_declined:
        print(
            f"stores declined  {r.stores_declined} ({r.blocks_not_stored} blocks not stored)"
        )
    if rec is None:
        return
    goal = (
        f"{rec.target_fraction:.0%} of the bound (hit rate {rec.target_hit_rate:.4f})"
    )
    if rec.disk_blocks is None:
        print(f"recommendation   {goal} is not reachable with this CPU tier")
    elif rec.disk_blocks == 0:
        print(
            f"recommendation   the CPU tier alone reaches {goal}; no disk tier needed"
        )
    else:
        print(
            f"recommendation   smallest disk reaching {goal}: "
            f"{size(rec.disk_blocks)}, hit rate {rec.hit_rate:.4f}"
        )
        verdict = "meets" if r.hit_rate >= rec.target_hit_rate else "falls short of"
        print(f"                 the given disk tier {verdict} that target")
