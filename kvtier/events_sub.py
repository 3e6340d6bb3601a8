"""Subscriber for vLLM's KV-cache events (``kvtier events``).

Wire format (vllm/distributed/kv_events.py, ``ZmqEventPublisher``): ZMQ
multipart ``(topic, seq as 8-byte big-endian int, payload)``; the payload is
``msgspec.msgpack`` of ``KVEventBatch``, an array ``[ts, events,
data_parallel_rank]`` whose events are maps tagged ``"type"``:
``BlockStored`` / ``BlockRemoved`` (with ``block_hashes`` and ``medium``
``"GPU"`` / ``"CPU"`` / ``"STORAGE"`` / None) or ``AllBlocksCleared``.

Decoding uses vLLM's own event classes when vLLM is importable (importing it
takes seconds, so the socket subscribes first and messages queue meanwhile)
and plain msgpack otherwise, or when a payload does not match the installed
vLLM's classes. kvtier media: CPU -> ``cpu``, STORAGE -> ``disk``, GPU or
None -> ``gpu``.

vLLM's publisher *binds* an endpoint containing ``*`` (e.g. the default
``tcp://*:5557``), and *connects* otherwise; the subscriber does the
opposite (``bind=True`` for the latter case).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

MEDIA = ("gpu", "cpu", "disk")
_MEDIUM_MAP = {"GPU": "gpu", "CPU": "cpu", "STORAGE": "disk"}
DECODERS = ("auto", "vllm", "plain")


def kvtier_medium(medium: str | None) -> str:
    """vLLM medium -> kvtier medium (unknown names are lower-cased)."""
    if medium is None:
        return "gpu"
    return _MEDIUM_MAP.get(medium, str(medium).lower())


@dataclass(frozen=True, slots=True)
class Event:
    """``kind`` is ``stored``, ``removed`` or ``cleared``."""

    kind: str
    medium: str
    blocks: int


@dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None


_KINDS = {"BlockStored": "stored", "BlockRemoved": "removed"}


def _event(type_name: str, medium: Any, hashes: Any) -> Event | None:
    if type_name == "AllBlocksCleared":
        return Event("cleared", kvtier_medium(medium), 0)
    kind = _KINDS.get(type_name)
    if kind is None:
        return None
    return Event(kind, kvtier_medium(medium), len(hashes or ()))


class DecodeError(ValueError):
    """A payload that is not a KV event batch."""


def decode_plain(payload: bytes) -> Batch:
    """Decode with plain msgpack (no vLLM needed)."""
    import msgspec

    try:
        obj = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(str(exc)) from None
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise DecodeError(f"not an event batch: {type(obj).__name__}")
    events: list[Event] = []
    for raw in obj[1]:
        if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
            raise DecodeError(f"untagged event {raw!r:.80}")
        ev = _event(raw["type"], raw.get("medium"), raw.get("block_hashes"))
        if ev is not None:
            events.append(ev)
    rank = obj[2] if len(obj) > 2 else None
    return Batch(float(obj[0]), tuple(events), rank)


class BatchDecoder:
    """Payload -> :class:`Batch`, via vLLM's ``KVEventBatch`` when available."""

    def __init__(self, mode: str = "auto") -> None:
        if mode not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {mode!r}")
        self._typed: Any = None
        if mode == "vllm":
            self._typed = _typed_decoder()
        elif mode == "auto" and _vllm_available():
            try:
                self._typed = _typed_decoder()
            except Exception:  # a broken vLLM install: plain msgpack still works
                self._typed = None
        self.kind = "vllm" if self._typed is not None else "plain"
        self.fallbacks = 0  # payloads the vLLM classes rejected

    def decode(self, payload: bytes) -> Batch:
        if self._typed is None:
            return decode_plain(payload)
        import msgspec

        try:
            batch = self._typed.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            # Another vLLM version's schema: count it, read it untyped.
            self.fallbacks += 1
            return decode_plain(payload)
        events = []
        for e in batch.events:
            ev = _event(
                type(e).__name__,
                getattr(e, "medium", None),
                getattr(e, "block_hashes", None),
            )
            if ev is not None:
                events.append(ev)
        return Batch(float(batch.ts), tuple(events), batch.data_parallel_rank)


def _typed_decoder() -> Any:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Decoder(type=KVEventBatch)


def _vllm_available() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def _zero() -> dict[str, int]:
    return {"stored": 0, "removed": 0, "stored_events": 0, "removed_events": 0}


@dataclass
class EventCounts:
    """Running totals: blocks and events stored/removed per kvtier medium."""

    media: dict[str, dict[str, int]] = field(
        default_factory=lambda: {m: _zero() for m in MEDIA}
    )
    batches: int = 0
    events: int = 0
    cleared: int = 0
    decode_errors: int = 0
    seq_gaps: int = 0
    last_seq: int | None = None

    def add(self, batch: Batch, seq: int | None = None) -> None:
        if seq is not None:
            if self.last_seq is not None and seq != self.last_seq + 1:
                self.seq_gaps += 1
            self.last_seq = seq
        self.batches += 1
        for ev in batch.events:
            self.events += 1
            if ev.kind == "cleared":
                self.cleared += 1
                continue
            c = self.media.setdefault(ev.medium, _zero())
            c[ev.kind] += ev.blocks
            c[f"{ev.kind}_events"] += 1

    def line(self) -> str:
        parts = [f"{m} +{c['stored']}/-{c['removed']}" for m, c in self.media.items()]
        tail = f"batches {self.batches}"
        if self.cleared:
            tail += f", cleared {self.cleared}"
        if self.decode_errors:
            tail += f", decode errors {self.decode_errors}"
        if self.seq_gaps:
            tail += f", seq gaps {self.seq_gaps}"
        return "  ".join(parts) + "  | " + tail

    def to_dict(self) -> dict[str, Any]:
        return {
            "media": {m: dict(c) for m, c in self.media.items()},
            "batches": self.batches,
            "events": self.events,
            "all_blocks_cleared": self.cleared,
            "decode_errors": self.decode_errors,
            "seq_gaps": self.seq_gaps,
        }


class EventSubscriber:
    """ZMQ SUB socket feeding :class:`EventCounts`.

    Create it (which connects or binds at once), then set ``decoder`` (slow
    with vLLM), then call :meth:`poll` repeatedly.
    """

    def __init__(self, endpoint: str, topic: str = "", bind: bool = False) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        if bind:
            self._sock.bind(endpoint)
        else:
            self._sock.connect(endpoint)
        self.endpoint = endpoint
        self.counts = EventCounts()
        self.decoder: BatchDecoder | None = None

    def poll(self, timeout_ms: int) -> int:
        """Wait up to ``timeout_ms`` for messages, then take all that are
        queued. Returns the number of batches handled."""
        zmq = self._zmq
        if not self._sock.poll(max(0, timeout_ms), zmq.POLLIN):
            return 0
        n = 0
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            self.handle(frames)
            n += 1

    def handle(self, frames: Iterable[bytes]) -> None:
        frames = list(frames)
        if self.decoder is None:
            self.decoder = BatchDecoder("plain")
        if len(frames) != 3:
            self.counts.decode_errors += 1
            return
        _topic, seq_b, payload = frames
        try:
            batch = self.decoder.decode(payload)
        except DecodeError:
            self.counts.decode_errors += 1
            return
        self.counts.add(batch, int.from_bytes(seq_b, "big", signed=True))

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
