"""A ZMQ subscriber of vLLM's KV events, counting blocks per event and medium;
the residency that kvtier's own events (TierEvent) imply, and a hierarchy's."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from kvtier.tiers.events import MEDIUM_CPU, MEDIUM_DISK, TierEvent
from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.slots import BlockState
from kvtier.tiers.tier import Tier


@dataclass
class ReceivedEvent:
    seq: int
    ts: float
    # vllm.distributed.kv_events.BlockStored | BlockRemoved | AllBlocksCleared
    event: Any
    data_parallel_rank: int | None

    @property
    def type(self) -> str:
        return type(self.event).__name__

    @property
    def medium(self) -> str | None:
        return getattr(self.event, "medium", None)


class KVEventSubscriber:
    """ZMQ SUB for vLLM KV-cache events, collecting in a background thread.

    Wire format (vllm/distributed/kv_events.py, ZmqEventPublisher): multipart
    ``(topic: bytes, seq: 8-byte big-endian int, payload)`` where payload is
    ``msgspec.msgpack`` of ``KVEventBatch`` (array_like: ``[ts, events,
    data_parallel_rank]``; events are tagged structs ``BlockStored`` /
    ``BlockRemoved`` / ``AllBlocksCleared`` carrying ``medium`` "GPU" / "CPU" /
    "STORAGE", ``block_hashes``, ``group_idx``, ...).

    By default binds ``tcp://127.0.0.1:<free port>`` (loopback only); pass
    ``self.endpoint`` to ``make_llm(kv_events_endpoint=...)`` and the engine's
    PUB connects to it. If ``endpoint`` is given, it is connected instead (for
    a publisher that binds, e.g. an ``ipc://`` endpoint).
    """

    def __init__(self, endpoint: str | None = None, topic: str = "") -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        if endpoint is None:
            port = self._sock.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        else:
            self._sock.connect(endpoint)
            self.endpoint = endpoint
        self.topic = topic
        self.events: list[ReceivedEvent] = []
        self.batches = 0
        self.decode_errors: list[str] = []
        self.seq_gaps: list[tuple[int, int]] = []
        self._last_seq: int | None = None
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kv-event-sub", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(50)):
                continue
            while True:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(frames)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.decode_errors.append(f"unexpected {len(frames)} frames")
            return
        _topic, seq_b, payload = frames
        seq = int.from_bytes(seq_b, "big", signed=True)
        try:
            batch = self._decoder.decode(payload)
        except Exception as e:  # keep collecting; tests assert on this list
            self.decode_errors.append(repr(e))
            return
        with self._cv:
            if self._last_seq is not None and seq != self._last_seq + 1:
                self.seq_gaps.append((self._last_seq, seq))
            self._last_seq = seq
            self.batches += 1
            for ev in batch.events:
                self.events.append(
                    ReceivedEvent(seq, batch.ts, ev, batch.data_parallel_rank)
                )
            self._cv.notify_all()

    def counts(self) -> Counter[tuple[str, str | None]]:
        """Counter of (event type, medium) -> number of events."""
        with self._cv:
            return Counter((e.type, e.medium) for e in self.events)

    def block_counts(self) -> Counter[tuple[str, str | None]]:
        """Like counts() but summing len(block_hashes) per event."""
        with self._cv:
            c: Counter[tuple[str, str | None]] = Counter()
            for e in self.events:
                c[(e.type, e.medium)] += len(getattr(e.event, "block_hashes", ()) or ())
            return c

    def wait_for(
        self, predicate: Callable[[KVEventSubscriber], bool], timeout: float = 5.0
    ) -> bool:
        """Block until ``predicate(self)`` is true (events arrive async)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                if predicate(self):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)

    def filter(self, type_: str | None = None, medium: str | None = None) -> list[Any]:
        with self._cv:
            return [
                e.event
                for e in self.events
                if (type_ is None or e.type == type_)
                and (medium is None or e.medium == medium)
            ]

    def clear(self) -> None:
        with self._cv:
            self.events.clear()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def replay(events: Iterable[TierEvent]) -> dict[str, set[Hashable]]:
    """Residency per medium implied by an event stream that starts empty.

    Raises ``ValueError`` on an event that contradicts the state so far (a
    store of a key already there, a removal of a key that is not): the
    stream is then not a faithful log.
    """
    state: dict[str, set[Hashable]] = {MEDIUM_CPU: set(), MEDIUM_DISK: set()}
    for ev in events:
        held = state[ev.medium]
        for key in ev.keys:
            if ev.removed:
                if key not in held:
                    raise ValueError(f"removed {key!r} from {ev.medium} twice")
                held.discard(key)
            else:
                if key in held:
                    raise ValueError(f"stored {key!r} on {ev.medium} twice")
                held.add(key)
    return state


def residency(h: TierHierarchy) -> dict[str, set[Hashable]]:
    """The keys READY per medium of ``h`` (O(n)): what :func:`replay` of all
    its events must give."""

    def ready(tier: Tier | None) -> set[Hashable]:
        items = tier.items() if tier is not None else ()
        return {k for k, b in items if b.state is BlockState.READY}

    return {MEDIUM_CPU: ready(h.cpu), MEDIUM_DISK: ready(h.disk)}
