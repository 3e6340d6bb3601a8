"""``kvtier events``: count a running vLLM's KV events per medium."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from types import FrameType

from kvtier.tools.commands.common import emit_json


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def cmd_events(args: argparse.Namespace) -> int:
    from kvtier.tools.events_sub import (
        BatchDecoder,
        EventSubscriber,
        bind_endpoint,
        check_endpoint,
    )

    endpoint = args.endpoint
    try:
        check_endpoint(endpoint)
    except ValueError as exc:
        print(f"kvtier events: {exc}", file=sys.stderr)
        return 2
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
    start = time.monotonic()  # reset once listening (Ctrl-C before: from here)
    live = not args.json
    tty = sys.stdout.isatty()
    # SIGTERM (kill, systemd, a supervisor) ends the watch like Ctrl-C: the
    # summary is still printed. SIGINT alone would not do for a watch started
    # in the background, where the shell ignores it.
    # (Only the main thread may set a handler; embedded callers keep theirs.)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stop) if main_thread else None
    try:
        # Subscribed already: batches queue while vLLM's classes import.
        try:
            sub.decoder = BatchDecoder(args.decoder)
        except ImportError as exc:
            print(f"kvtier events: --decoder vllm needs vLLM: {exc}", file=sys.stderr)
            return 2
        # --duration and the summary's seconds count from here: vLLM's
        # classes take seconds to import, which a 2 s watch spent entirely.
        start = time.monotonic()
        deadline = start + args.duration if args.duration else None
        listening = (
            f"listening on {endpoint} ({'bound' if args.bind else 'connected'}, "
            f"topic {args.topic!r}, decoder {sub.decoder.kind})"
        )
        if live:
            print(listening, flush=True)
        progress = getattr(args, "progress", False)
        if progress:
            print(f"kvtier events: {listening}", file=sys.stderr, flush=True)
        reported = None
        next_line = time.monotonic() + 1.0
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if args.max_batches and sub.counts.batches >= args.max_batches:
                break
            wake = next_line if deadline is None else min(next_line, deadline)
            sub.poll(int(max(0.0, wake - now) * 1000) + 1)
            if progress and sub.counts.last_seq != reported:
                reported = sub.counts.last_seq
                print(f"kvtier events: seq {reported}", file=sys.stderr, flush=True)
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
        if main_thread:  # None: a handler not set from Python
            signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)
    doc = sub.counts.to_dict()
    doc.update(
        endpoint=endpoint,
        seconds=round(time.monotonic() - start, 3),
        decoder=sub.decoder.kind if sub.decoder else None,
    )
    if args.json:
        emit_json(doc)
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
