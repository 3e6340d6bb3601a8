"""The ``kvtier`` command line: ``size``, ``inspect``, ``verify``, ``events``.

``python -m kvtier.cli ...`` works too. Exit status: 0 on success, 1 when
``verify`` finds a bad slot, 2 on bad usage or unreadable input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from kvtier.events_sub import DEFAULT_MAX_MESSAGE_BYTES
from kvtier.tiers.policy import POLICIES

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)
_EXPONENT = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_bytes(text: str) -> int:
    """``"64GiB"`` -> 68719476736; ``"1.5TB"`` -> 1.5e12; plain numbers are bytes."""
    m = _SIZE_RE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}")
    value, unit, binary = m.groups()
    base = 1024 if binary or unit == "" else 1000
    v = float(value) * base ** _EXPONENT[unit.lower()]
    if not math.isfinite(v) or v > _MAX_BYTES:
        raise argparse.ArgumentTypeError(f"byte size too large: {_short(text)}")
    return int(v)


# 2**70 B (1 ZiB): more than any budget, small enough for exact arithmetic.
_MAX_BYTES = float(1 << 70)


def _pos_bytes(text: str) -> int:
    v = parse_bytes(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 bytes, got {text!r}")
    return v


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _short(text: str, n: int = 40) -> str:
    return repr(text) if len(text) <= n else repr(text[:n]) + "..."


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {_short(text)}") from None


def _nonneg_int(text: str) -> int:
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _pos_int(text: str) -> int:
    v = _int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {_short(text)}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be finite, got {_short(text)}")
    return v


def _watermark(text: str) -> float:
    v = _float(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], got {text}")
    return v


def _target(text: str) -> float:
    v = _float(text)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within (0, 1], got {text}")
    return v


def _pos_seconds(text: str) -> float:
    v = _float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return v


@contextlib.contextmanager
def _progress(
    enabled: bool, total: int | None, desc: str
) -> Iterator[Callable[[int], None] | None]:
    """A tqdm bar on stderr, or None when disabled / not a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield None
        return
    bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)
    try:
        yield bar.update
    finally:
        bar.close()


def _emit_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


# ---------------------------------------------------------------------- size


def _size_blocks(args: argparse.Namespace) -> tuple[int, int, int | None]:
    """(cpu_blocks, disk_blocks, bytes_per_token) from the blocks or bytes form."""
    from kvtier.sizing import blocks_for_bytes

    bpt = args.bytes_per_token
    if (args.cpu_bytes is not None or args.disk_bytes is not None) and bpt is None:
        raise ValueError("--cpu-bytes/--disk-bytes need --bytes-per-token")
    if args.cpu_blocks is not None and args.cpu_bytes is not None:
        raise ValueError("give --cpu-blocks or --cpu-bytes, not both")
    if args.disk_blocks is not None and args.disk_bytes is not None:
        raise ValueError("give --disk-blocks or --disk-bytes, not both")
    if args.cpu_blocks is not None:
        cpu = args.cpu_blocks
    elif args.cpu_bytes is not None:
        cpu = blocks_for_bytes(args.cpu_bytes, bpt)
    else:
        raise ValueError("give --cpu-blocks, or --cpu-bytes with --bytes-per-token")
    if args.disk_blocks is not None:
        disk = args.disk_blocks
    elif args.disk_bytes is not None:
        disk = blocks_for_bytes(args.disk_bytes, bpt)
    else:
        disk = 0
    if cpu <= 0:
        raise ValueError(
            "the CPU tier must hold at least one 512-token block "
            f"({_fmt_bytes(512 * (bpt or 0))} at {bpt} bytes/token)"
        )
    return cpu, disk, bpt


def cmd_size(args: argparse.Namespace) -> int:
    from kvtier import sizing

    try:
        cpu, disk, bpt = _size_blocks(args)
    except ValueError as exc:
        print(f"kvtier size: {exc}", file=sys.stderr)
        return 2
    cpu_policy = args.cpu_policy or args.policy
    disk_policy = args.disk_policy or args.policy
    if args.plot:
        # Before the replay, which can take minutes: not after it.
        from kvtier.sizing_plot import check_plot_path

        try:
            check_plot_path(args.plot)
        except ValueError as exc:
            print(f"kvtier size: --plot: {exc}", file=sys.stderr)
            return 2
    try:
        requests = sizing.load_trace(args.trace, limit=args.limit)
    except (OSError, ValueError) as exc:
        print(f"kvtier size: cannot read trace: {exc}", file=sys.stderr)
        return 2
    show = not args.json

    def replay(disk_blocks: int, desc: str) -> sizing.SizingResult:
        with _progress(show, len(requests), desc) as tick:
            return sizing.replay_trace(
                requests,
                cpu,
                disk_blocks,
                cpu_policy,
                disk_policy,
                args.spill_watermark,
                progress=tick,
            )

    result = replay(disk, "replay")
    doc: dict[str, Any] = {"trace": args.trace, **result.to_dict()}
    rec = None
    if bpt is not None or args.recommend:
        rec = _recommend(requests, cpu, cpu_policy, disk_policy, args, bpt)
        doc["bytes_per_token"] = bpt
        doc["recommendation"] = rec.to_dict()
    if bpt is not None:
        bpb = sizing.bytes_per_block(bpt)
        doc["cpu_bytes"] = cpu * bpb
        doc["disk_bytes"] = disk * bpb
    cmp = None
    if args.compare:
        with _progress(show, None, "compare") as tick:
            cmp = sizing.compare_policies(
                requests, cpu, disk, spill_watermark=args.spill_watermark, progress=tick
            )
        doc["comparison"] = cmp.to_dict()
    if args.plot and cmp is not None:
        from kvtier.sizing_plot import plot_policy_comparison

        plot_policy_comparison(cmp, args.plot, title=args.trace)
        doc["plot"] = args.plot
    elif args.plot:
        _plot_size(args, requests, cpu, disk, cpu_policy, disk_policy, result, rec)
        doc["plot"] = args.plot
    if args.json:
        _emit_json(doc)
    else:
        _print_size(args.trace, result, bpt, rec)
        if cmp is not None:
            print("policies:")
            for line in sizing.format_comparison(cmp):
                print("  " + line)
    return 0


def _recommend(
    requests: Sequence[Any],
    cpu: int,
    cpu_policy: str,
    disk_policy: str,
    args: argparse.Namespace,
    bpt: int | None,
) -> Any:
    from kvtier import sizing

    n = 0

    def on_replay(_r: Any) -> None:
        nonlocal n
        n += 1
        if not args.json and sys.stderr.isatty():
            print(f"\rsizing sweep: {n} replays", end="", file=sys.stderr, flush=True)

    rec = sizing.recommend_disk_blocks(
        requests,
        cpu,
        args.target,
        cpu_policy=cpu_policy,
        disk_policy=disk_policy,
        spill_watermark=args.spill_watermark,
        bytes_per_token=bpt,
        on_replay=on_replay,
    )
    if n and not args.json and sys.stderr.isatty():
        print(file=sys.stderr)
    return rec


def _plot_size(
    args: argparse.Namespace,
    requests: Sequence[Any],
    cpu: int,
    disk: int,
    cpu_policy: str,
    disk_policy: str,
    result: Any,
    rec: Any,
) -> None:
    from kvtier import sizing
    from kvtier.sizing_plot import plot_tier_split

    known = {result.disk_blocks: result}
    if rec is not None:
        known.update({r.disk_blocks: r for r in rec.evaluated})
    sizes = sizing.default_sweep_sizes(cpu, disk, sizing.unique_blocks(requests))
    if rec is not None and rec.disk_blocks is not None:
        sizes = sorted(set(sizes) | {rec.disk_blocks})
    todo = [d for d in sizes if d not in known]
    with _progress(not args.json, len(todo) * len(requests), "plot sweep") as tick:
        for d in todo:
            known[d] = sizing.replay_trace(
                requests,
                cpu,
                d,
                cpu_policy,
                disk_policy,
                args.spill_watermark,
                progress=tick,
            )
    title = f"{args.trace}: CPU {cpu} blocks ({cpu_policy}), disk policy {disk_policy}"
    plot_tier_split(
        {"hit rate vs disk capacity": [known[d] for d in sizes]},
        args.plot,
        title=title,
        target_fraction=args.target,
    )


def _print_size(trace: str, r: Any, bpt: int | None, rec: Any) -> None:
    from kvtier.sizing import bytes_per_block

    bpb = bytes_per_block(bpt) if bpt else None

    def size(blocks: int) -> str:
        return f"{blocks} blocks" + (f" ({_fmt_bytes(blocks * bpb)})" if bpb else "")

    print(
        f"trace            {trace}: {r.requests} requests, {r.blocks} blocks of 512 tokens"
    )
    print(
        f"tiers            cpu {size(r.cpu_blocks)} [{r.cpu_policy}], "
        f"disk {size(r.disk_blocks)} [{r.disk_policy}], "
        f"spill watermark {r.spill_watermark}"
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


# ----------------------------------------------------------- inspect/verify


def _open_views(paths: Sequence[str], cmd: str) -> list[Any] | None:
    from kvtier.io.inspect import find_stores

    try:
        return find_stores(paths)
    except (OSError, ValueError) as exc:
        print(f"kvtier {cmd}: {exc}", file=sys.stderr)
        return None


def cmd_inspect(args: argparse.Namespace) -> int:
    from kvtier.io.inspect import inspect_store

    views = _open_views(args.paths, "inspect")
    if views is None:
        return 2
    try:
        reports = [inspect_store(v) for v in views]
    except (OSError, ValueError) as exc:  # a slab swapped for a FIFO since
        print(f"kvtier inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _emit_json({"stores": reports})
        return 0
    for rep in reports:
        print(f"store {rep['store']}")
        for d in rep["directories"]:
            print(f"  directory        {d}")
        layout = rep["layout"] or {}
        if layout:
            desc = ", ".join(
                f"{k}={layout[k]}"
                for k in (
                    "model",
                    "dtype",
                    "block_bytes",
                    "geometry",
                    "tp_rank",
                    "tp_size",
                )
                if k in layout
            )
            print(f"  layout           {desc}")
            print(f"  digest           {layout.get('digest')}")
        versions = ", ".join(
            f"v{v} x{n}" for v, n in rep["header_format_versions"].items()
        )
        print(
            f"  format version   {rep['format_version']} (layout.json); "
            f"headers: {versions or 'none'}; this kvtier reads v{rep['reader_format_version']}"
        )
        print(
            f"  slabs            {len(rep['slabs'])} file(s), {rep['total_slots']} slots "
            f"x {rep['slot_size']} B = {_fmt_bytes(rep['slab_bytes'])}"
        )
        print(
            f"  used             {rep['used_slots']} / {rep['total_slots']} slots "
            f"({rep['fill']:.1%}); {rep['blocks']} valid blocks, payload "
            f"{_fmt_bytes(rep['payload_bytes'])} (raw {_fmt_bytes(rep['raw_bytes'])})"
        )
        print(
            "  slot headers     "
            + ", ".join(f"{k} {v}" for k, v in rep["outcomes"].items())
        )
        for fp, n in rep["fingerprints"].items():
            print(f"  fingerprint      {fp} x{n}")
        for w in rep["warnings"]:
            print(f"  warning          {w}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from kvtier.io.inspect import verify_store

    views = _open_views(args.paths, "verify")
    if views is None:
        return 2
    try:
        reports = [verify_store(v) for v in views]
    except (OSError, ValueError) as exc:
        print(f"kvtier verify: {exc}", file=sys.stderr)
        return 2
    nbad = sum(len(r["bad"]) for r in reports)
    if args.json:
        _emit_json({"ok": nbad == 0, "bad_slots": nbad, "stores": reports})
    else:
        for rep in reports:
            print(
                f"{rep['store']}: {rep['checked']} used slots checked, {rep['ok']} ok, "
                f"{len(rep['bad'])} bad"
            )
            for b in rep["bad"]:
                print(
                    f"  slot {b['slot']}: {b['reason']}"
                    + (f" ({b['detail']})" if b.get("detail") else "")
                    + (
                        f" [{b['slab']} local slot {b['local_slot']}]"
                        if "slab" in b
                        else ""
                    )
                )
            for w in rep["warnings"]:
                print(f"  warning: {w}")
    return 1 if nbad else 0


# -------------------------------------------------------------------- events


def cmd_events(args: argparse.Namespace) -> int:
    from kvtier.events_sub import BatchDecoder, EventSubscriber, bind_endpoint

    endpoint = args.endpoint
    if args.bind:
        try:
            endpoint, note = bind_endpoint(endpoint, args.allow_remote)
        except ValueError as exc:
            print(f"kvtier events: {exc}", file=sys.stderr)
            return 2
        if note:
            print(f"kvtier events: {note}", file=sys.stderr)
    try:
        sub = EventSubscriber(
            endpoint,
            args.topic,
            bind=args.bind,
            max_message_bytes=args.max_message_bytes,
        )
    except Exception as exc:  # zmq.ZMQError: bad endpoint, port in use
        print(f"kvtier events: cannot subscribe to {endpoint}: {exc}", file=sys.stderr)
        return 2
    start = time.monotonic()
    deadline = start + args.duration if args.duration else None
    live = not args.json
    tty = sys.stdout.isatty()
    try:
        # Subscribed already: batches queue while vLLM's classes import.
        try:
            sub.decoder = BatchDecoder(args.decoder)
        except ImportError as exc:
            print(f"kvtier events: --decoder vllm needs vLLM: {exc}", file=sys.stderr)
            return 2
        if live:
            print(
                f"listening on {endpoint} ({'bound' if args.bind else 'connected'}, "
                f"topic {args.topic!r}, decoder {sub.decoder.kind})",
                flush=True,
            )
        next_line = time.monotonic() + 1.0
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if args.max_batches and sub.counts.batches >= args.max_batches:
                break
            wake = next_line if deadline is None else min(next_line, deadline)
            sub.poll(int(max(0.0, wake - now) * 1000) + 1)
            if live and time.monotonic() >= next_line:
                line = f"[{time.monotonic() - start:6.0f}s] {sub.counts.line()}"
                print(
                    ("\r" + line) if tty else line, end="" if tty else "\n", flush=True
                )
                next_line += 1.0
    except KeyboardInterrupt:
        pass
    finally:
        # Count what already arrived: batches still queued in the socket when
        # Ctrl-C or --duration ends the watch belong to the summary.
        with contextlib.suppress(KeyboardInterrupt):
            if sub.decoder is None:
                sub.decoder = BatchDecoder("auto")
            drain_until = time.monotonic() + 5.0
            while sub.poll(200) and time.monotonic() < drain_until:
                pass
        sub.close()
    doc = sub.counts.to_dict()
    doc.update(
        endpoint=endpoint,
        seconds=round(time.monotonic() - start, 3),
        decoder=sub.decoder.kind if sub.decoder else None,
    )
    if args.json:
        _emit_json(doc)
    else:
        if tty:
            print()
        print(f"summary after {doc['seconds']:.1f}s: {sub.counts.line()}")
        if sub.counts.decode_errors:
            print(
                f"skipped {sub.counts.decode_errors} malformed message(s); last: "
                f"{sub.counts.last_decode_error}"
            )
    return 0


# -------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """Usage errors on one line (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kvtier",
        description="kvtier tools: tier sizing, disk store inspection, KV events.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "size",
        help="replay a Mooncake trace through the tier hierarchy",
        description=(
            "Replay a Mooncake-format trace (512-token prefix-hash blocks) through "
            "kvtier's TierHierarchy and report block hit rates per tier. Sizes are "
            "given in blocks, or in bytes with --bytes-per-token (KV bytes of one "
            "token across all layers), which also prints a disk-size recommendation."
        ),
    )
    s.add_argument("--trace", required=True, help="JSONL trace file")
    s.add_argument(
        "--cpu-blocks", type=_pos_int, help="CPU tier capacity in trace blocks"
    )
    s.add_argument(
        "--disk-blocks", type=_nonneg_int, help="disk tier capacity (default 0)"
    )
    s.add_argument("--bytes-per-token", type=_pos_bytes, help="KV bytes per token")
    s.add_argument("--cpu-bytes", type=parse_bytes, help="CPU budget, e.g. 64GiB")
    s.add_argument("--disk-bytes", type=parse_bytes, help="disk budget, e.g. 2TiB")
    s.add_argument("--policy", choices=POLICIES, default="lru", help="both tiers")
    s.add_argument("--cpu-policy", choices=POLICIES, help="overrides --policy")
    s.add_argument("--disk-policy", choices=POLICIES, help="overrides --policy")
    s.add_argument(
        "--spill-watermark",
        type=_watermark,
        default=0.75,
        help="fraction of the CPU tier that may be dirty, in [0, 1] (default 0.75)",
    )
    s.add_argument("--limit", type=_pos_int, help="replay only the first N requests")
    s.add_argument(
        "--target",
        type=_target,
        default=0.95,
        help="fraction of the infinite-cache bound to recommend for (default 0.95)",
    )
    s.add_argument(
        "--recommend",
        action="store_true",
        help="also sweep disk sizes for a recommendation (implied by --bytes-per-token)",
    )
    s.add_argument("--json", action="store_true", help="print JSON, no progress bar")
    s.add_argument(
        "--compare",
        action="store_true",
        help="also replay every policy (every cpu/disk pair with a disk tier) and "
        "print them next to the offline optimum; --plot then plots them",
    )
    s.add_argument(
        "--plot", metavar="PNG", help="plot hit rate vs disk capacity by tier"
    )
    s.set_defaults(func=cmd_size)

    for name, fn, text in (
        ("inspect", cmd_inspect, "summarize a disk store (read-only)"),
        ("verify", cmd_verify, "check every used slot's header and payload checksum"),
    ):
        c = sub.add_parser(
            name,
            help=text,
            description=(
                f"{text[0].upper()}{text[1:]}. PATH is a configured disk path or a "
                "kvtier-<digest> directory under it; give every path of a "
                "multi-path store to get global slot numbers. Nothing is created "
                "or modified."
            ),
        )
        c.add_argument("paths", nargs="+", metavar="PATH")
        c.add_argument("--json", action="store_true")
        c.set_defaults(func=fn)

    e = sub.add_parser(
        "events",
        help="count a running vLLM's KV events per medium",
        description=(
            "Subscribe to vLLM's KV-cache events (ZMQ) and show BlockStored / "
            "BlockRemoved block counts per medium (gpu, cpu, disk) every second."
        ),
    )
    e.add_argument("--endpoint", required=True, help="e.g. tcp://HOST:5557")
    e.add_argument("--topic", default="", help="topic prefix (default: all)")
    e.add_argument(
        "--duration",
        type=_pos_seconds,
        default=None,
        help="seconds (default: until Ctrl-C)",
    )
    e.add_argument(
        "--bind",
        action="store_true",
        help=(
            "bind the endpoint instead of connecting (when vLLM's endpoint has no "
            "'*'); a tcp wildcard binds 127.0.0.1, other non-loopback addresses "
            "need --allow-remote"
        ),
    )
    e.add_argument(
        "--allow-remote",
        action="store_true",
        help="with --bind: listen on the endpoint as given, even off this host",
    )
    e.add_argument(
        "--max-message-bytes",
        type=_pos_bytes,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest ZMQ frame accepted; a sender of a bigger one is dropped "
        "(default 64MiB)",
    )
    e.add_argument("--decoder", choices=("auto", "vllm", "plain"), default="auto")
    e.add_argument("--max-batches", type=_pos_int, help="stop after N batches")
    e.add_argument("--json", action="store_true", help="print only the final counts")
    e.set_defaults(func=cmd_events)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # kvtier ... | head
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - no flush error at exit
        return 141


if __name__ == "__main__":
    sys.exit(main())
