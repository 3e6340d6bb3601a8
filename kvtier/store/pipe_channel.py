"""Messages over a pair of pipes that never block the caller.

The worker's load thread talks to its read process
(:mod:`kvtier.store.read_process`) through two pipes. A blocking
``multiprocessing.connection.Connection`` there could stop the load thread
for as long as the child does not read: a request larger than the pipe's
room waits in ``write`` while the child's one thread waits on a hung read
(or the child is stopped), and a reply the child wrote half of makes
``recv`` wait for the rest. Neither wait had a deadline, and a load thread
that waits serves no load, from the CPU tier either.

:class:`PipeChannel` is the worker's end: what it sends goes into an
outbox written as far as the pipe takes it (the rest on the next call),
and what it receives is read as far as it arrived, into an inbox from
which only whole messages come out. The frames are those of
``Connection.send_bytes`` (a 4-byte big-endian length, or -1 and an
8-byte length), so the other end may keep a plain blocking
``Connection``.

Contract:
  - ``send`` and ``receive(0)`` never wait; ``receive(timeout)`` waits at
    most ``timeout`` seconds (for a message, while the outbox drains).
  - Messages arrive whole and in the order sent.
  - A closed or broken other end raises ``EOFError`` from ``receive``
    once every whole message before it was returned (a reply written just
    before the child died still counts), and ``BrokenPipeError`` from
    ``send``/``receive`` when the other end stopped reading.
  - Used by one thread; the caller owns neither fd after construction
    (:meth:`close` closes both).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import select
import struct
from typing import Any

# Linux: F_SETPIPE_SZ. A larger pipe takes a batch's request (about 45
# bytes per slot) in one write; unprivileged processes may go up to
# /proc/sys/fs/pipe-max-size (1 MiB by default).
_F_SETPIPE_SZ = 1031
PIPE_BYTES = 1 << 20
_READ_CHUNK = 1 << 20


def frame(obj: Any) -> bytes:
    """``obj`` pickled, framed as ``Connection.send`` frames it."""
    payload = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    n = len(payload)
    head = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return head + payload


class PipeChannel:
    """The non-blocking end of a request pipe (``send_fd``, written) and a
    reply pipe (``recv_fd``, read); see the module doc."""

    def __init__(self, send_fd: int, recv_fd: int) -> None:
        self._send_fd = send_fd
        self._recv_fd = recv_fd
        for fd in (send_fd, recv_fd):
            os.set_blocking(fd, False)
            with contextlib.suppress(OSError, AttributeError):
                fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
        self._outbox = bytearray()
        self._inbox = bytearray()
        self._eof = False
        self._poller = select.poll()  # not select(): fds may exceed 1024
        self._poller.register(recv_fd, select.POLLIN)
        self._watching_send = False

    @property
    def unsent(self) -> int:
        """Bytes sent but not yet taken by the pipe."""
        return len(self._outbox)

    def send(self, obj: Any) -> None:
        """Queue ``obj`` and write as much of the outbox as the pipe takes."""
        self._outbox += frame(obj)
        self._flush()

    def receive(self, timeout: float = 0.0) -> list[Any]:
        """Every whole message that arrived, waiting up to ``timeout``
        seconds for the first; ``EOFError`` once the other end closed and
        nothing whole is left."""
        self._flush()
        got = self._take()
        if got or timeout <= 0 or self._eof:
            return self._or_eof(got)
        ms = max(1, int(timeout * 1000))
        for fd, _events in self._poller.poll(ms):
            if fd == self._send_fd:
                self._flush()
        return self._or_eof(self._take())

    def close(self) -> None:
        """Close both fds (the other end reads EOF). Idempotent."""
        for name in ("_send_fd", "_recv_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._outbox.clear()

    # ------------------------------------------------------------ internals

    def _flush(self) -> None:
        while self._outbox:
            try:
                n = os.write(self._send_fd, self._outbox)
            except BlockingIOError:
                break
            del self._outbox[:n]
        want = bool(self._outbox)
        if want != self._watching_send:  # wake receive() when it drains
            if want:
                self._poller.register(self._send_fd, select.POLLOUT)
            else:
                self._poller.unregister(self._send_fd)
            self._watching_send = want

    def _take(self) -> list[Any]:
        """Read what arrived, then cut whole frames from the inbox."""
        while not self._eof:
            try:
                chunk = os.read(self._recv_fd, _READ_CHUNK)
            except BlockingIOError:
                break
            if not chunk:
                self._eof = True
                break
            self._inbox += chunk
        out: list[Any] = []
        buf, at = self._inbox, 0
        while len(buf) - at >= 4:
            (n,) = struct.unpack_from("!i", buf, at)
            head = 4
            if n == -1:
                if len(buf) - at < 12:
                    break
                (n,) = struct.unpack_from("!Q", buf, at + 4)
                head = 12
            if len(buf) - at - head < n:
                break
            out.append(pickle.loads(buf[at + head : at + head + n]))
            at += head + n
        del buf[:at]
        return out

    def _or_eof(self, got: list[Any]) -> list[Any]:
        if not got and self._eof:
            raise EOFError("the other end closed its pipe")
        return got
