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
``tcp://*:5557``) or ``::``, and an ``ipc://`` or ``inproc://`` one, and
*connects* otherwise; the subscriber does the opposite (``bind=True`` for
the latter case).

The stream is untrusted input: every message that cannot be read (wrong
frame count, bad sequence number, any decoding error) is counted in
``decode_errors`` and skipped, frames larger than ``max_message_bytes`` make
ZMQ drop the sender (``MAXMSGSIZE``), and a bound socket listens on loopback
unless told otherwise (:func:`bind_endpoint`): vLLM's ``BlockStored`` events
carry the token ids of each block, i.e. the prompts.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.tiers.events import ALL_MEDIA, VLLM_MEDIA

DECODERS = ("auto", "vllm", "plain")
# Unknown media get their own counters, up to this many; then "other".
MAX_MEDIA = 8
OTHER_MEDIUM = "other"
_MEDIUM_NAME_RE = re.compile(r"^[a-z0-9_.-]{1,32}\Z")  # \Z: no trailing newline
# Largest ZMQ frame accepted (MAXMSGSIZE); a bigger one disconnects its
# sender. A batch of one engine step with token ids is well under 1 MiB.
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
# Messages queued in the socket at most (vLLM's publisher uses the same hwm).
RCV_HWM = 100_000
# Messages handled per poll() call, so that deadlines hold under a flood.
MAX_PER_POLL = 1000


def kvtier_medium(medium: str | None) -> str:
    """vLLM medium -> kvtier medium (unknown names are lower-cased; names
    that are not short identifiers become ``other``)."""
    if medium is None:
        return "gpu"
    if medium in VLLM_MEDIA:
        return VLLM_MEDIA[medium]
    name = str(medium)[:64].lower()
    return name if _MEDIUM_NAME_RE.match(name) else OTHER_MEDIUM


_LOOPBACK_NAMES = ("localhost", "lo")
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


def _is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_endpoint(endpoint: str) -> None:
    """Raise ValueError for a ``tcp://`` endpoint whose port is not a TCP
    port: ZMQ connects to ``tcp://127.0.0.1:99999`` without a word, and the
    watch would wait for events that can never come."""
    transport, sep, rest = endpoint.partition("://")
    if not sep or transport != "tcp":
        return
    port = rest.rpartition(":")[2]
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(
            f"{endpoint!r}: port {port!r} is not a TCP port (1-65535); give "
            "the port of vLLM's kv_events_config endpoint"
        )


def bind_endpoint(endpoint: str, allow_remote: bool = False) -> tuple[str, str | None]:
    """The endpoint a subscriber should bind, and a note for the user.

    Without ``allow_remote`` a TCP wildcard (``tcp://*:5557``,
    ``tcp://0.0.0.0:5557``) becomes ``tcp://127.0.0.1:5557``, and any other
    non-loopback address or transport (other than ``ipc://`` and
    ``inproc://``) raises ValueError. With it the endpoint is kept and the
    note warns that anyone who can reach it can send events.
    """
    transport, sep, rest = endpoint.partition("://")
    if not sep:
        raise ValueError(f"not a ZMQ endpoint: {endpoint!r}")
    if transport in ("ipc", "inproc"):
        return endpoint, None
    if transport != "tcp":
        if allow_remote:
            return endpoint, f"binding {endpoint}: not restricted to this host"
        raise ValueError(
            f"refusing to bind {endpoint!r}: only tcp://127.0.0.1, ipc:// and "
            "inproc:// are bound without --allow-remote"
        )
    host, colon, port = rest.rpartition(":")
    if not colon:
        raise ValueError(f"tcp endpoint needs HOST:PORT: {endpoint!r}")
    if _is_loopback(host):
        return endpoint, None
    if allow_remote:
        return endpoint, (
            f"listening on {endpoint}: anyone who can reach it can send this "
            "command events (--allow-remote)"
        )
    if host in _WILDCARD_HOSTS:
        safe = f"tcp://127.0.0.1:{port}"
        return safe, (
            f"binding {safe} instead of {endpoint} (loopback only; give "
            "--allow-remote to listen on every interface)"
        )
    raise ValueError(
        f"refusing to bind non-loopback address {host!r} without --allow-remote"
    )


@dataclass(frozen=True, slots=True)
class Event:
    """``kind`` is ``stored``, ``removed`` or ``cleared``."""

    kind: str
    medium: str
    blocks: int


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


def decode_plain(payload: bytes) -> tuple[Event, ...]:
    """The events of one batch, decoded with plain msgpack (no vLLM needed);
    DecodeError (or the ValueError/TypeError of a non-numeric timestamp) if
    the payload is not a batch."""
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
    float(obj[0])  # a batch has a numeric timestamp
    return tuple(events)


class MalformedMessage(ValueError):
    """A ZMQ message that is not ``(topic, seq, payload)``."""


def read_message(
    frames: Sequence[bytes], nframes: int | None = None
) -> tuple[int, bytes]:
    """The sequence number and payload of one message, ``frames`` (its first
    three frames; ``nframes`` its frame count, if it had more); raises
    MalformedMessage if it has not three frames or an 8-byte sequence
    number."""
    if nframes is None:
        nframes = len(frames)
    if nframes != 3 or len(frames) != 3:
        raise MalformedMessage(f"{nframes} frames, expected 3")
    _topic, seq_b, payload = frames
    if len(seq_b) != 8:
        raise MalformedMessage(f"sequence frame of {len(seq_b)} bytes, expected 8")
    return int.from_bytes(seq_b, "big", signed=True), payload


def seq_gap(last_seq: int | None, seq: int) -> bool:
    """Whether the batch numbered ``seq`` does not follow the one numbered
    ``last_seq`` (None: it is the first one seen): batches were lost."""
    return last_seq is not None and seq != last_seq + 1


class BatchDecoder:
    """Payload -> the events of one batch (the kinds :class:`EventCounts`
    counts), via vLLM's ``KVEventBatch`` when available."""

    def __init__(self, mode: str = "auto") -> None:
        if mode not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {mode!r}")
        self._typed: Any = None
        if mode != "plain":
            try:
                self._typed = typed_decoder()
            except Exception:  # no or a broken vLLM: plain msgpack still works
                if mode == "vllm":
                    raise
        self.kind = "vllm" if self._typed is not None else "plain"
        self.fallbacks = 0  # payloads the vLLM classes rejected

    def decode(self, payload: bytes) -> tuple[Event, ...]:
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
        return tuple(events)


def typed_decoder() -> Any:
    """A ``msgspec`` decoder of vLLM's ``KVEventBatch`` (imports vLLM,
    through :mod:`kvtier.connector.compat`: seconds)."""
    import msgspec

    from kvtier.connector.compat import kv_event_batch_type

    return msgspec.msgpack.Decoder(type=kv_event_batch_type())


def _zero() -> dict[str, int]:
    return {"stored": 0, "removed": 0, "stored_events": 0, "removed_events": 0}


@dataclass
class EventCounts:
    """Running totals: blocks and events stored/removed per kvtier medium."""

    media: dict[str, dict[str, int]] = field(
        default_factory=lambda: {m: _zero() for m in ALL_MEDIA}
    )
    batches: int = 0
    events: int = 0
    cleared: int = 0
    decode_errors: int = 0
    last_decode_error: str | None = None
    # Connections dropped (publisher gone, or a frame over MAXMSGSIZE).
    disconnects: int = 0
    seq_gaps: int = 0
    last_seq: int | None = None

    def malformed(self, reason: str) -> None:
        """Count one message that could not be read."""
        self.decode_errors += 1
        self.last_decode_error = reason[:200]

    def add(self, events: Iterable[Event], seq: int | None = None) -> None:
        """Count one batch's events; ``seq`` is its sequence number."""
        if seq is not None:
            if seq_gap(self.last_seq, seq):
                self.seq_gaps += 1
            self.last_seq = seq
        self.batches += 1
        for ev in events:
            self.events += 1
            if ev.kind == "cleared":
                self.cleared += 1
                continue
            medium = ev.medium
            if medium not in self.media and len(self.media) >= MAX_MEDIA:
                medium = OTHER_MEDIUM
            c = self.media.setdefault(medium, _zero())
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
        if self.disconnects:
            tail += f", disconnects {self.disconnects}"
        return "  ".join(parts) + "  | " + tail

    def to_dict(self) -> dict[str, Any]:
        return {
            "media": {m: dict(c) for m, c in self.media.items()},
            "batches": self.batches,
            "events": self.events,
            "all_blocks_cleared": self.cleared,
            "decode_errors": self.decode_errors,
            "last_decode_error": self.last_decode_error,
            "seq_gaps": self.seq_gaps,
            "disconnects": self.disconnects,
        }


class EventSocket(ABC):
    """ZMQ SUB socket for vLLM's KV events; subclasses say what a message
    does (:meth:`handle`) and what a dropped connection does
    (:meth:`disconnected`).

    Created, it connects (or binds, ``bind``: the endpoint as given) at once;
    then call :meth:`poll` repeatedly (from one thread), and :meth:`close`.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        bind: bool = False,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        try:
            self._sock = self._ctx.socket(zmq.SUB)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RCVHWM, RCV_HWM)
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
            if "[" in endpoint or endpoint.count(":") > 2:
                self._sock.setsockopt(zmq.IPV6, 1)
            self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
            if bind:
                self._sock.bind(endpoint)
            else:
                self._sock.connect(endpoint)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self.endpoint = endpoint
        self.topic = topic
        self._bind = bind
        # A frame over MAXMSGSIZE is a protocol error: ZMQ drops that
        # connection and, on the connecting side, never reconnects. Watch for
        # disconnects to count them and to reconnect ourselves.
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    @abstractmethod
    def handle(self, frames: Iterable[bytes], nframes: int | None = None) -> None:
        """Take one message: its first three frames, and its frame count
        (None: ``len(frames)``). Must not raise on bad input."""

    @abstractmethod
    def disconnected(self) -> None:
        """A connection was dropped (publisher gone, or a frame over
        ``max_message_bytes``); the socket reconnects by itself."""

    def poll(self, timeout_ms: int, max_messages: int = MAX_PER_POLL) -> int:
        """Wait up to ``timeout_ms`` for messages, then take those queued, at
        most ``max_messages``, until ``timeout_ms`` after the call (at least
        one message: one decode, bounded by ``max_message_bytes``, is the
        most a call overruns). Returns the number of messages handled (malformed
        ones included)."""
        zmq = self._zmq
        timeout_ms = max(0, timeout_ms)
        # A big batch takes seconds to decode: a count alone would let a
        # flood of them hold the caller's deadline for hours.
        until = time.monotonic() + timeout_ms / 1000
        ready = dict(self._poller.poll(timeout_ms))
        n = 0
        drained = True
        if self._sock in ready:
            while True:
                if n >= max_messages or (n and time.monotonic() >= until):
                    drained = False
                    break
                try:
                    frames, nframes = self._recv()
                except zmq.Again:
                    break
                self.handle(frames, nframes)
                n += 1
        # After draining: reconnecting drops what is still queued.
        if self._monitor in ready and drained:
            self._check_monitor()
        return n

    def _check_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        zmq = self._zmq
        while True:
            try:
                msg = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg["event"] != zmq.EVENT_DISCONNECTED:
                continue
            self.disconnected()
            if not self._bind:
                # ZMQ would retry after a plain disconnect, not after a
                # protocol error (oversized frame): start over either way.
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.disconnect(self.endpoint)
                self._sock.connect(self.endpoint)

    def _recv(self) -> tuple[list[bytes], int]:
        """One multipart message: its first three frames and its frame count
        (the rest is read and dropped: none is kept past this call; ZMQ itself
        holds a whole message, every frame up to ``max_message_bytes``,
        before the first is read, and up to ``RCV_HWM`` messages queue while
        a big one decodes, so memory is bounded by their product, not by
        this)."""
        zmq = self._zmq
        frames: list[bytes] = []
        nframes = 0
        while True:
            frame = self._sock.recv(zmq.NOBLOCK)
            nframes += 1
            if nframes <= 3:
                frames.append(frame)
            if not self._sock.getsockopt(zmq.RCVMORE):
                return frames, nframes

    def close(self) -> None:
        with contextlib.suppress(self._zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()


class EventSubscriber(EventSocket):
    """:class:`EventSocket` feeding :class:`EventCounts`.

    Create it (which connects or binds at once), then set ``decoder`` (slow
    with vLLM), then call :meth:`poll` repeatedly. ``bind`` binds the
    endpoint as given: pass it through :func:`bind_endpoint` first.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        bind: bool = False,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        super().__init__(endpoint, topic, bind, max_message_bytes)
        self.counts = EventCounts()
        self.decoder: BatchDecoder | None = None

    def disconnected(self) -> None:
        self.counts.disconnects += 1

    def handle(self, frames: Iterable[bytes], nframes: int | None = None) -> None:
        """Count one message ``(topic, seq, payload)``; anything else, or
        anything that fails to decode, is counted as malformed and skipped."""
        if self.decoder is None:
            self.decoder = BatchDecoder("plain")
        try:
            seq, payload = read_message(list(frames), nframes)
        except MalformedMessage as exc:
            self.counts.malformed(str(exc))
            return
        try:
            events = self.decoder.decode(payload)
        except Exception as exc:  # untrusted input: never fatal
            self.counts.malformed(f"{type(exc).__name__}: {exc}")
            return
        self.counts.add(events, seq)
