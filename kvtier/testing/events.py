"""A ZMQ subscriber of vLLM's KV events that keeps every event (vLLM's own
objects) for tests to count and read. The socket, the message format and the
sequence numbers are :mod:`kvtier.tools.events_sub`'s, as ``kvtier events``
reads them."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvtier.tools.events_sub import EventSocket, read_message, seq_gap, typed_decoder


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


class KVEventSubscriber(EventSocket):
    """ZMQ SUB for vLLM KV-cache events, collecting in a background thread.

    Wire format: see :mod:`kvtier.tools.events_sub`. Payloads are decoded
    with vLLM's ``KVEventBatch``; each event is kept as vLLM's object
    (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, ``medium``
    "GPU" / "CPU" / "STORAGE", ``block_hashes``, ...). A message that cannot
    be read is kept in ``decode_errors``, a sequence number that does not
    follow the last in ``seq_gaps`` (``(last, seq)``).

    By default binds ``tcp://127.0.0.1:<free port>`` (loopback only); pass
    ``self.endpoint`` to ``make_llm(kv_events_endpoint=...)`` and the engine's
    PUB connects to it. If ``endpoint`` is given, it is connected instead (for
    a publisher that binds, e.g. an ``ipc://`` endpoint).
    """

    def __init__(self, endpoint: str | None = None, topic: str = "") -> None:
        import zmq

        self._decoder = typed_decoder()
        if endpoint is None:
            super().__init__("tcp://127.0.0.1:*", topic, bind=True)
            self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            super().__init__(endpoint, topic)
        self.events: list[ReceivedEvent] = []
        self.batches = 0
        self.decode_errors: list[str] = []
        self.seq_gaps: list[tuple[int, int]] = []
        self.last_seq: int | None = None
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kv-event-sub", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll(50)

    def disconnected(self) -> None:
        """Nothing to record: a test sees lost batches in ``seq_gaps``."""

    def handle(self, frames: Iterable[bytes], nframes: int | None = None) -> None:
        try:
            seq, payload = read_message(list(frames), nframes)
            batch = self._decoder.decode(payload)
        except Exception as e:  # keep collecting; tests assert on this list
            with self._cv:
                self.decode_errors.append(repr(e))
            return
        with self._cv:
            if seq_gap(self.last_seq, seq):
                self.seq_gaps.append((self.last_seq, seq))
            self.last_seq = seq
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
        self.close()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class Replay:
    """One medium's ``BlockStored`` / ``BlockRemoved`` events, replayed in
    order by a subscriber that counts each block hash's stores."""

    held: dict[Any, int]  # per hash, stores minus removals: the non-zero ones
    removed_unheld: list[Any]  # hashes a removal named while none was held
    stored_held: list[Any]  # hashes a store named while one was held


def replay(events: Iterable[Any], medium: str | None = None) -> Replay:
    """Replay ``events`` (vLLM's KV events, or a subscriber's decoded ones),
    those on ``medium`` (``"CPU"``, ``"STORAGE"``) if given."""
    counts: Counter[Any] = Counter()
    unheld: list[Any] = []
    twice: list[Any] = []
    for ev in events:
        if medium is not None and getattr(ev, "medium", None) != medium:
            continue
        kind = type(ev).__name__
        if kind == "BlockStored":
            twice.extend(h for h in ev.block_hashes if counts[h] > 0)
            counts.update(ev.block_hashes)
        elif kind == "BlockRemoved":
            unheld.extend(h for h in ev.block_hashes if counts[h] <= 0)
            counts.subtract(ev.block_hashes)
    held = {h: n for h, n in counts.items() if n}
    return Replay(held, unheld, twice)
