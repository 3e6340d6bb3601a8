"""The ``kvtier`` command line: ``size``, ``inspect``, ``verify``, ``events``,
``doctor``.

``python -m kvtier.tools.cli ...`` works too. Exit status: 0 on success, 1 when
``verify`` finds a bad slot (``doctor``: a check failed), 2 on bad usage or
unreadable input, 141 when the output's reader went away (``| head``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

from kvtier.connector.model_kv import KV_CACHE_DTYPES, MODEL_DTYPES
from kvtier.connector.sizes import SIZE_RULE, parse_size, quoted
from kvtier.tiers.policy import policy_names
from kvtier.tools.commands.doctor import cmd_doctor
from kvtier.tools.commands.events import cmd_events
from kvtier.tools.commands.size import cmd_size
from kvtier.tools.commands.store import cmd_inspect, cmd_verify
from kvtier.tools.events_sub import DEFAULT_MAX_MESSAGE_BYTES

# vLLM's PrefixCachingHashAlgo (vllm.config.cache); a test keeps them equal.
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

T = TypeVar("T")


def _size_arg(text: str) -> int:
    """An argparse type: a byte size by vLLM's rule (kvtier.connector.sizes)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {quoted(text)}") from None


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {quoted(text)}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be finite, got {quoted(text)}")
    return v


def _bounded(
    parse: Callable[[str], T], accept: Callable[[T], bool], rule: str
) -> Callable[[str], T]:
    """An argparse type: ``parse(text)``, refused unless ``accept`` takes it;
    the error names the ``rule`` ("> 0", "within [0, 1]", ...)."""

    def convert(text: str) -> T:
        v = parse(text)
        if not accept(v):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {quoted(text)}")
        return v

    return convert


_nonneg_bytes = _bounded(_size_arg, lambda v: v >= 0, ">= 0 bytes")
_pos_bytes = _bounded(_size_arg, lambda v: v > 0, "> 0 bytes")
_nonneg_int = _bounded(_int, lambda v: v >= 0, ">= 0")
_pos_int = _bounded(_int, lambda v: v > 0, "> 0")
_watermark = _bounded(_float, lambda v: 0.0 <= v <= 1.0, "within [0, 1]")
_target = _bounded(_float, lambda v: 0.0 < v <= 1.0, "within (0, 1]")
_pos_seconds = _bounded(_float, lambda v: v > 0, "> 0 seconds")


# -------------------------------------------------------------------- parser


def _model_kv_flags(p: argparse.ArgumentParser, prefix: str) -> None:
    """vllm serve's flags that change a model's KV bytes per token, as
    :mod:`kvtier.connector.model_kv` reads them."""
    p.add_argument(
        "--dtype",
        choices=MODEL_DTYPES,
        help=f"{prefix}vllm serve's --dtype (default auto: as vLLM serves the "
        "model on this platform)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        metavar="DTYPE",
        help=f"{prefix}vllm serve's --kv-cache-dtype (default auto: the model's, "
        f"or its checkpoint's; estimated for {', '.join(KV_CACHE_DTYPES)})",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=_pos_int,
        help=f"{prefix}vllm serve's --tensor-parallel-size (default 1)",
    )


class _Parser(argparse.ArgumentParser):
    """Usage errors on one line (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kvtier",
        description=(
            "kvtier tools: tier sizing, disk store inspection, KV events, host "
            f"checks. Byte sizes: {SIZE_RULE}."
        ),
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "size",
        help="replay a Mooncake trace through the tier hierarchy",
        description=(
            "Replay a Mooncake-format trace (512-token prefix-hash blocks) through "
            "kvtier's TierHierarchy and report block hit rates per tier. Sizes are "
            "given in blocks, or in bytes with --bytes-per-token (KV bytes of one "
            "token across all layers) or --model (read from its config.json), which "
            "also prints a disk-size recommendation. "
            f"Byte sizes: {SIZE_RULE}."
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
    s.add_argument(
        "--model",
        help="instead of --bytes-per-token: the model's directory (or a hub id "
        "in the Hugging Face cache), whose config.json gives its KV bytes per "
        "token",
    )
    _model_kv_flags(s, "with --model: ")
    s.add_argument(
        "--cpu-bytes", type=_nonneg_bytes, help="CPU budget, e.g. 64G (= 64 GiB)"
    )
    s.add_argument(
        "--disk-bytes", type=_nonneg_bytes, help="disk budget, e.g. 2T (= 2 TiB)"
    )
    # Any case, as the config's eviction policy keys take them.
    policy = dict(choices=policy_names(), type=str.lower)
    s.add_argument("--policy", default="lru", help="both tiers", **policy)
    s.add_argument("--cpu-policy", help="overrides --policy", **policy)
    s.add_argument("--disk-policy", help="overrides --policy", **policy)
    s.add_argument(
        "--spill-watermark",
        type=_watermark,
        default=0.75,
        help="fraction of the CPU tier that may be dirty, in [0, 1] (default 0.75)",
    )
    s.add_argument(
        "--promote-on-hit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="copy disk hits up into free CPU rows, as the engine's "
        "promote_on_hit (default: on)",
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
        help="seconds (default: until Ctrl-C or SIGTERM; either prints the summary)",
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
        "(default 64M = 64 MiB)",
    )
    e.add_argument("--decoder", choices=("auto", "vllm", "plain"), default="auto")
    e.add_argument("--max-batches", type=_pos_int, help="stop after N batches")
    e.add_argument("--json", action="store_true", help="print only the final counts")
    e.add_argument(
        "--progress",
        action="store_true",
        help="also report on stderr when listening and each new sequence number "
        "received ('kvtier events: seq N'), e.g. to know a publisher's last batch "
        "arrived",
    )
    e.set_defaults(func=cmd_events)

    d = sub.add_parser(
        "doctor",
        help="check this host and a kvtier config before vllm serve",
        description=(
            "Check vLLM, the connector keys, each disk path (owner and mode, free "
            "space, file system, O_DIRECT, a short throughput probe), the disk I/O "
            "path (kvikio/GDS or POSIX), /dev/shm for the CPU tier, prefix-hash "
            "reproducibility and existing stores. Exit status 1 if any check is "
            f"an error, 2 on unreadable input. Byte sizes: {SIZE_RULE}."
        ),
    )
    d.add_argument(
        "--config",
        metavar="JSON|FILE.json",
        help="the --kv-transfer-config value: its JSON text (as given to vllm "
        "serve, bare sizes like 64G included) or a file holding it",
    )
    d.add_argument(
        "--disk-path",
        action="append",
        metavar="DIR",
        help="instead of --config: a disk path (repeat for several)",
    )
    d.add_argument(
        "--cpu-bytes",
        type=_pos_bytes,
        help="instead of --config: CPU tier, e.g. 64G (= 64 GiB)",
    )
    d.add_argument(
        "--disk-bytes",
        type=_pos_bytes,
        help="instead of --config: disk tier, e.g. 2T (= 2 TiB)",
    )
    d.add_argument(
        "--model",
        help="the model vllm serve will load: tells whether an existing store "
        "would be adopted, and how many tokens each tier holds (from its "
        "config.json)",
    )
    d.add_argument(
        "--revision",
        help="with --model: vllm serve's --revision (a hub id's branch, tag or "
        "commit; default main), which picks the snapshot whose files are compared",
    )
    d.add_argument(
        "--download-dir",
        metavar="DIR",
        help="with --model: vllm serve's --download-dir (the Hugging Face cache "
        "a hub id is looked up in; default the hub's own)",
    )
    _model_kv_flags(d, "with --model: ")
    d.add_argument(
        "--block-size",
        type=_pos_int,
        help="with --model: vllm serve's --block-size, tokens per GPU block "
        "(default vLLM's: 16, 128 on the CPU platform); the config's block_size "
        "or blocks_per_chunk make the offloaded block",
    )
    d.add_argument(
        "--hash-algo",
        choices=HASH_ALGOS,
        default="sha256",
        help="vllm serve's --prefix-caching-hash-algo (default sha256)",
    )
    d.add_argument(
        "--probe-seconds",
        type=_pos_seconds,
        default=2.0,
        help="time budget of each path's throughput probe (default 2)",
    )
    d.add_argument("--no-probe", action="store_true", help="skip the throughput probe")
    d.add_argument(
        "--shm-dir",
        help="shared-memory directory of the CPU tier (default /dev/shm)",
    )
    d.add_argument(
        "--reclaim-stale",
        action="store_true",
        help="remove dead engines' CPU-tier files (default: only report them)",
    )
    d.add_argument("--json", action="store_true", help="print JSON")
    d.set_defaults(func=cmd_doctor)
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
