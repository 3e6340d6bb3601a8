"""What kvtier's helper processes share: how one is started and stopped,
the pipes to it that never block the parent, and dying with the parent.

A helper process (the worker's read process, :mod:`kvtier.store.read_process`;
the scheduler's spill process, :mod:`kvtier.store.spill_process`) runs a
piece of kvtier's disk I/O beside the engine, out of reach of its
interpreter lock: the engine's loop and kvtier's I/O threads share one, and
every thread that takes it back from the loop delays the loop
(docs/benchmarks.md, "Engine step stalls", "Spills next to a busy loop").
The parent keeps what must touch its own memory and exchanges one message
per batch or job with the child.

Contract:
  - :func:`spawn` starts ``python -m <module>`` with this kvtier first on
    its path, no accelerator visible, in a process group of its own within
    the engine's session (a terminal's Ctrl-C is the engine's to handle),
    passing only the descriptors named and its ends of two pipes; the child
    calls :func:`die_with_parent` and :func:`stay_off_the_terminal` first.
  - :class:`ChildStarter` starts the child on a thread of its own and keeps
    that thread for the child's life: the thread that wants the child never
    waits for a process to start, and the child does not die with it.
  - :func:`stop` ends a child within a bound, however it is stuck: it waits,
    kills, waits again, and leaves (naming it in the log) a child the kill
    cannot end (stuck in the kernel on a hung disk) rather than hang the
    engine's shutdown.
  - :class:`PipeChannel` is the parent's end of the two pipes; the child
    keeps plain blocking ``Connection`` objects (the same frames).
  - The child logs through the parent (:func:`forward_logs`): its kvtier
    records go up its reply pipe as ``("log", ...)`` messages, and the
    parent's :func:`receive` logs each through its own loggers, so they
    take vLLM's level, handler and format (vLLM's logging costs a
    4-second, 400 MB import the child does not make) and name the child
    and its pid; unforwarded, they reached stderr bare, at WARNING and
    above only.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from kvtier.host.placement import name_this_thread, without_openmp_binding
from kvtier.log import ROOT, get_logger

logger = get_logger("store")

# Linux: F_SETPIPE_SZ. A larger pipe takes a batch's request (about 45
# bytes per slot) in one write; unprivileged processes may go up to
# /proc/sys/fs/pipe-max-size (1 MiB by default).
_F_SETPIPE_SZ = 1031
PIPE_BYTES = 1 << 20
_READ_PIECE = 1 << 20
# How long a child is waited for to be reaped once it is killed (stop's
# ``wait_s`` with ``kill``).
KILL_WAIT_S = 5.0
# The longest one wait on the pipe lasts before a blocking wait looks again.
PIPE_WAIT_S = 0.05


# Python 3.11+ sets the child's process group between fork and exec. Python
# 3.10 cannot without ``preexec_fn`` (unsafe in a process with threads):
# there the child has a session of its own, out of the terminal's reach as
# well, with the CPU share that gives it (see spawn).
_OWN_PROCESS_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
)


def spawn(
    module: str, fds: Sequence[int], args: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], PipeChannel]:
    """Start ``python -m module`` (see the module doc) with two pipes; its
    arguments: this process's pid, ``args``, its end of the request pipe
    and of the reply pipe. ``fds`` are passed to it besides those ends.
    Returns the child and this end of the pipes; OSError, with nothing left
    open, when it cannot start."""
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                module,
                str(os.getpid()),
                *args,
                str(req_r),
                str(resp_w),
            ],
            pass_fds=(*fds, req_r, resp_w),
            stdin=subprocess.DEVNULL,
            # Out of the engine's process group: a terminal's Ctrl-C (or
            # Ctrl-\) goes to the whole foreground group, and is the
            # engine's to handle; it killed a read process with a traceback,
            # and an engine that lived on read in its own process from then
            # on. The child still dies with its parent (its pipe,
            # ``die_with_parent``). A group, not a session of its own: with
            # the kernel's autogroups (a group per session) a read process
            # in a session of its own, on the CPU where vLLM's worker waited
            # for its load, ran 0.13 s in 16 s at nice 10 or 0 alike, every
            # load past its deadline; in the engine's session, milliseconds
            # (docs/benchmarks.md, "Helper processes and the CPU scheduler").
            **_OWN_PROCESS_GROUP,
            env=child_env(),
            # ``-m`` puts the working directory first on the child's path:
            # there, this kvtier's own directory, never whatever the
            # engine's working directory (/tmp, another checkout) holds.
            cwd=kvtier_root(),
        )
    except BaseException:
        os.close(req_w)
        os.close(resp_r)
        raise
    finally:  # the child's ends: it has its own copies, or there is none
        os.close(req_r)
        os.close(resp_w)
    return proc, PipeChannel(req_w, resp_r)


class ChildStarter:
    """Starts one helper process on a thread of its own, made with the
    starter, and keeps that thread for the child's life.

    Why not the thread that wants the child (a worker's load thread, the
    scheduler's engine loop):
      - Starting a process waits until the child runs (fork, then exec).
        From a load thread at nice 10, on a CPU the model's OpenMP threads
        and another engine kept busy, that took 9.3 s, near the worker's
        15 s load deadline, with every load in flight waiting.
      - A child inherits the nice level and CPUs of the thread that starts
        it; the starter has those of the thread that made it (the owner's
        maker: the worker's or the engine core's thread), and a child may
        lower its own priority afterwards, never raise it.
      - The kernel's parent-death signal (:func:`die_with_parent`) follows
        the thread that started a child, and a caller's thread may exit
        long before the engine (an in-process engine driven from a pool's
        threads): its child died with it.

    Contract:
      - ``start`` runs once, on the starter's thread, after :meth:`ask`. It
        returns what the owner takes (:meth:`take`: the process and its
        pipes), or None when no child could start (having logged why); an
        exception from it is logged and counts as None.
      - :meth:`ask` and :meth:`take` never wait. ``take`` hands over what
        ``start`` returned once, when it has (None before, and after);
        :attr:`failed` says that no child started.
      - :meth:`close`: once it returned no ``start`` runs; one under way
        finishes first, and what it returned, not taken yet, is returned to
        be stopped.
      - :meth:`release`: the child is gone (or left stuck in the kernel),
        or is not wanted: the thread leaves, and none starts; the kernel
        kills a child still there. Only once what a start made was taken
        (or :meth:`close` returned it): a child whose starter left before
        it armed its parent-death signal would outlive it.
      - ``ask``, ``take`` and ``close`` from the owner's threads, one at a
        time.
    """

    def __init__(self, name: str, start: Callable[[], Any]) -> None:
        self._start = start
        self._asked = threading.Event()
        self._released = threading.Event()
        self._starting = threading.Lock()  # held while ``start`` runs
        self._closed = False
        self._value: Any = None
        self._done = False
        self._failed = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    @property
    def asked(self) -> bool:
        return self._asked.is_set()

    @property
    def failed(self) -> bool:
        """Whether ``start`` returned and no child started."""
        return self._failed

    def ask(self) -> None:
        """Have ``start`` run (once); returns at once."""
        self._asked.set()

    def take(self) -> Any:
        if not self._done:
            return None
        value, self._value = self._value, None
        return value

    def close(self) -> Any:
        self._closed = True
        self._asked.set()  # a starter still waiting leaves
        with self._starting:  # one under way has finished
            pass
        return self.take()

    def release(self) -> None:
        self._closed = True  # a starter not asked yet never starts
        self._asked.set()
        self._released.set()

    def _run(self) -> None:
        name_this_thread()
        self._asked.wait()
        with self._starting:
            if self._closed:
                return
            try:
                value = self._start()
            except Exception:
                logger.exception("kvtier: a helper process could not start")
                value = None
            self._value = value
            self._failed = value is None
            self._done = True
        if value is not None:  # else there is no child to stay for
            self._released.wait()


def start_configured(
    module: str,
    fds: Sequence[int],
    args: Sequence[str],
    config: Any,
    what: str,
    fallback: str,
) -> tuple[subprocess.Popen[bytes], PipeChannel] | None:
    """:func:`spawn` ``module`` and send it ``config`` as its first message:
    the child and this end of its pipes, or None when it cannot start (a
    WARNING naming ``what`` and ``fallback``, where the work runs instead;
    a child that started is killed and reaped, its pipes closed). For a
    :class:`ChildStarter`'s ``start``."""
    try:
        proc, pipes = spawn(module, fds, args)
    except OSError as exc:
        logger.warning("kvtier: no %s (%s); %s", what, exc, fallback)
        return None
    try:
        pipes.send(config)
    except Exception as exc:  # a broken pipe, or a config that does not pickle
        pipes.close()
        stop(proc, KILL_WAIT_S, what, kill=True)
        logger.warning(
            "kvtier: the %s did not start (its configuration could not be sent: "
            "%r, exit status %s); %s",
            what,
            exc,
            proc.returncode,
            fallback,
        )
        return None
    return proc, pipes


def stop(
    proc: subprocess.Popen[bytes], wait_s: float, what: str, *, kill: bool = False
) -> bool:
    """End ``proc``: wait up to ``wait_s`` for it to exit (at once with
    ``kill``), then SIGKILL it and wait as long again. Returns whether it
    was reaped; one the kill does not end in time (stuck in the kernel: a
    hung disk or mount) is left, logged as ``what``, and dies when its
    system call returns."""
    if not kill:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
            return True
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(wait_s)
        return True
    except subprocess.TimeoutExpired:
        logger.error(
            "kvtier: %s %d did not exit %.0f s after SIGKILL (stuck in the "
            "kernel: a hung disk or mount?); left behind",
            what,
            proc.pid,
            wait_s,
        )
        return False


class SchedulingWatch:
    """What a helper process's threads get from the CPU scheduler, for the
    log line about a child that has not answered: at each look, their
    states now (R runnable, S sleeping, D in an uninterruptible wait: a
    hung disk or mount; T stopped) and, summed over them, the seconds they
    ran and waited to run since the last look (the first look: since the
    process started). A child starved of CPU shows R and a wait near the
    span; one stuck on its disk, D. Linux (``/proc``); elsewhere, and once
    the process exited, :meth:`look` says so. Used by one thread."""

    def __init__(self) -> None:
        self.pid: int | None = None  # the process looked at last
        # At the last look: (monotonic seconds, ns run, ns waited to run).
        self._last: tuple[float, int, int] | None = None

    def look(self, pid: int) -> str:
        """One look at process ``pid`` (a new one: counted from its start)."""
        if pid != self.pid:
            self.pid, self._last = pid, None
        return self._look() or "its state unknown"

    def _look(self) -> str | None:
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return None
        states: dict[str, int] = {}
        ran = waited = 0
        timed = False
        for tid in tids:
            task = f"/proc/{self.pid}/task/{tid}"
            try:
                with open(f"{task}/stat") as f:
                    # The name, in parentheses, may hold spaces and ')'.
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # that thread exited meanwhile
            states[state] = states.get(state, 0) + 1
            try:  # absent where the kernel keeps no scheduler statistics
                with open(f"{task}/schedstat") as f:
                    on_cpu, on_queue = (int(v) for v in f.read().split()[:2])
            except (OSError, ValueError):
                continue
            ran += on_cpu
            waited += on_queue
            timed = True
        if not states:
            return None
        listed = " ".join(f"{s}{n}" for s, n in sorted(states.items()))
        if not timed:
            return f"threads {listed}"
        now = time.monotonic()
        if self._last is None:
            span = self._age()
            since = "since it started" if span is None else f"in its {span:.1f} s"
            got_ran, got_waited = ran, waited
        else:
            last_at, last_ran, last_waited = self._last
            since = f"in the last {now - last_at:.1f} s"
            # A thread that exited since took its time with it.
            got_ran, got_waited = max(0, ran - last_ran), max(0, waited - last_waited)
        self._last = (now, ran, waited)
        return (
            f"threads {listed}; {since}: {got_ran / 1e9:.2f} s on a CPU, "
            f"{got_waited / 1e9:.2f} s waiting for one"
        )

    def _age(self) -> float | None:
        """Seconds since the process started."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            with open("/proc/uptime") as f:
                uptime = float(f.read().split()[0])
            return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
        except (OSError, IndexError, ValueError):
            return None


def kvtier_root() -> str:
    """The directory this kvtier package was imported from."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env() -> dict[str, str]:
    """This environment, with the directory this kvtier was imported from
    first on the child's path (it runs the same code as its parent), no
    accelerator visible, and without an OpenMP binding: the child keeps the
    CPUs of the thread that starts it (:mod:`kvtier.host.placement`)."""
    env = without_openmp_binding(os.environ)
    # A child moves bytes between disk and host memory: it never needs an
    # accelerator, and a back end that would make a CUDA context there
    # (kvikio) would take GPU memory outside vLLM's accounting, on GPU 0 for
    # every rank. Hidden, its ``auto`` back end is POSIX.
    env["CUDA_VISIBLE_DEVICES"] = ""
    # The child runs in another directory (:func:`spawn`): the parent's
    # relative entries are made absolute, so they name what they name here.
    inherited = env.get("PYTHONPATH", "").split(os.pathsep)
    env["PYTHONPATH"] = os.pathsep.join(
        [kvtier_root(), *(os.path.abspath(p) for p in inherited if p)]
    )
    return env


def frame(obj: Any) -> bytes:
    """``obj`` pickled, framed as ``Connection.send`` frames it."""
    payload = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    n = len(payload)
    head = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return head + payload


class PipeChannel:
    """The parent's end of the request pipe (``send_fd``, written) and the
    reply pipe (``recv_fd``, read), which never blocks the parent's thread
    (a worker's load thread, the scheduler's engine loop).

    A blocking ``Connection`` could stop that thread for as long as the
    child does not read (a request larger than the pipe's room while the
    child's one thread waits on a hung read, or a reply the child wrote half
    of). What is sent goes into an outbox written as far as the pipe takes
    it (the rest on the next call); what arrives is read into an inbox from
    which only whole messages come out. The frames are
    ``Connection.send_bytes``'s (a 4-byte big-endian length, or -1 and an
    8-byte length), so the child keeps a plain blocking ``Connection``.

    Contract: ``send`` and ``receive(0)`` never wait; ``receive(timeout)``
    waits at most ``timeout`` seconds (for a message, while the outbox
    drains). Messages arrive whole and in order. A closed other end raises
    EOFError from ``receive`` once every whole message before it was
    returned, BrokenPipeError from ``send``/``receive`` when it stopped
    reading. Used by one thread; it owns both fds (``close`` closes them)."""

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

    @property
    def unsent(self) -> int:
        """Bytes sent that the pipe has not taken yet."""
        return len(self._outbox)

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
                piece = os.read(self._recv_fd, _READ_PIECE)
            except BlockingIOError:
                break
            if not piece:
                self._eof = True
                break
            self._inbox += piece
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


def receive(pipes: PipeChannel, timeout: float) -> tuple[list[Any], str | None]:
    """``pipes.receive(timeout)`` as the parent reads it: ``(messages,
    None)``, or ``([], why)`` once the child is gone (its pipe closed or
    broke) or wrote what does not unpickle (a bug), after which the parent
    stops it. The child's log records (:func:`forward_logs`) are logged
    here and not returned: an answer-less return is no timeout."""
    try:
        msgs = pipes.receive(timeout)
    except (EOFError, OSError):
        return [], "it exited"
    except Exception as exc:
        return [], f"its answer could not be read: {exc!r}"
    answers = []
    for m in msgs:
        if isinstance(m, tuple) and m and m[0] == "log":
            try:
                _log_forwarded(m)
            except Exception as exc:  # not a record of ours: a bug
                return [], f"its log record could not be read: {exc!r}"
        else:
            answers.append(m)
    return answers, None


class _Forward(logging.Handler):
    """The child's handler: each record as a ``("log", ...)`` message."""

    def __init__(self, send: Callable[[tuple], None], process_name: str) -> None:
        super().__init__()
        self._send, self._process_name = send, process_name

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            trace = None
            if record.exc_info:
                trace = logging.Formatter().formatException(record.exc_info)
            self._send(
                (
                    "log",
                    record.levelno,
                    record.name,
                    record.pathname,
                    record.lineno,
                    text,
                    trace,
                    os.getpid(),
                    self._process_name,
                    record.created,
                )
            )
        except Exception:  # the parent is gone, or the record is broken
            with contextlib.suppress(Exception):
                trace = ""
                if record.exc_info:
                    trace = "\n" + logging.Formatter().formatException(record.exc_info)
                sys.stderr.write(
                    f"{record.levelname} {record.name} (pid {os.getpid()}): "
                    f"{_text(record)}{trace}\n"
                )


def _text(record: logging.LogRecord) -> str:
    # The message as a handler would print it; its raw parts where its
    # arguments do not fit its format.
    try:
        return record.getMessage()
    except Exception:
        return f"{record.msg} {record.args}"


def forward_logs(send: Callable[[tuple], None], process_name: str) -> None:
    """In the child: send kvtier's records (``vllm.kvtier.*``) to the
    parent through ``send`` (the reply pipe's, safe to call from any of the
    child's threads), at ``VLLM_LOGGING_LEVEL`` (INFO by default, as
    vLLM's) until the configuration says the parent's
    (:func:`set_log_level`): the parent logs them as ``process_name``'s."""
    level = logging.getLevelName(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    kvtier = logging.getLogger(ROOT)
    kvtier.setLevel(level if isinstance(level, int) else logging.INFO)
    kvtier.addHandler(_Forward(send, process_name))
    kvtier.propagate = False


def replying(resp_fd: int, process_name: str) -> Callable[[tuple], None]:
    """In the child: the send of its reply pipe ``resp_fd`` (a blocking
    ``Connection``), safe from any of its threads, its kvtier records
    forwarded through it (:func:`forward_logs`) as ``process_name``'s."""
    resp = Connection(resp_fd, readable=False)
    lock = threading.Lock()  # the answering thread(s) and any that logs

    def send(msg: tuple) -> None:
        with lock:
            resp.send(msg)

    forward_logs(send, process_name)
    return send


def log_level() -> int:
    """In the parent: the level kvtier's records are logged at here (vLLM's,
    or a ``VLLM_LOGGING_CONFIG_PATH`` entry for ``vllm.kvtier``), for the
    child's configuration."""
    return logging.getLogger(ROOT).getEffectiveLevel()


def set_log_level(level: int) -> None:
    """In the child: forward records from ``level`` up (the parent's)."""
    logging.getLogger(ROOT).setLevel(level)


def _log_forwarded(msg: tuple) -> None:
    """In the parent: log a child's ``("log", ...)`` record through this
    process's logger of its name (vLLM's handlers, level and format), with
    the child's time, file, line, pid and name."""
    _, level, name, path, lineno, text, trace, pid, process_name, created = msg
    target = logging.getLogger(name)
    if not target.isEnabledFor(level):
        return
    record = target.makeRecord(name, level, path, lineno, text, (), None)
    record.created, record.msecs = created, (created - int(created)) * 1000
    record.process, record.processName = pid, process_name
    record.vllm_process_name = process_name  # vLLM's format shows it
    record.exc_text = trace
    target.handle(record)


def stay_off_the_terminal() -> None:
    """In a helper process, first thing: never be stopped for writing to
    the terminal. Its log lines go to the engine's stdout, and a process
    group other than the terminal's foreground one (:func:`spawn`) is
    stopped at its first write where ``stty tostop`` is set."""
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)


def die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when the thread that started it exits
    (its :class:`ChildStarter`'s, which stays until the owner closes or
    lost the child), or exit now if ``parent`` (its pid) is already gone.
    Elsewhere it outlives its parent until its pipe closes."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it was gone before the line above
        os._exit(0)
