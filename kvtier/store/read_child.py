"""The read process's own side: ``python -m kvtier.store.read_child``.

Started by :class:`kvtier.store.read_process.ReadProcess` (the worker's side,
whose docstring holds the contract). It maps the worker's bounce area (a
memory file passed by fd), reads and verifies each batch it is sent with a
:class:`~kvtier.store.slot_reader.SlotReader` over that area, and answers one
message per batch, in the order the batches came: ``("ready",)`` once, then
``("done", rid, outcome codes, rows, reader stats)``. It exits when the
request pipe closes and, on Linux, dies with the thread that started it.
Its pipes are plain blocking ``Connection``s: the worker's end never waits
on them (:mod:`kvtier.store.pipe_channel`).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import signal
import sys
from collections import deque
from dataclasses import astuple
from multiprocessing.connection import Connection

import numpy as np

from kvtier.host.placement import name_this_thread
from kvtier.log import get_logger
from kvtier.store.slabs import SlabFiles
from kvtier.store.slot import ReadOutcome
from kvtier.store.slot_reader import PendingRead, SlotRead, SlotReader

logger = get_logger("store")

# The child's name in ps and top (its read threads are kvtier-posix_N).
CHILD_NAME = "kvtier-read"


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when the thread that started it exits
    (the worker's load thread, alive as long as the worker's loads)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it was gone before the line above
        os._exit(0)


def _serve(fd: int, req: Connection, resp: Connection) -> None:
    from kvtier.store.backends.factory import make_backend

    cfg = req.recv()
    shared = mmap.mmap(fd, cfg["nbytes"], mmap.MAP_SHARED)
    area = np.frombuffer(shared, dtype=np.uint8)
    backend = make_backend(cfg["disk_io"], threads=cfg["threads"])
    files = SlabFiles.open(
        cfg["paths"], cfg["fingerprint"], cfg["num_slots"], backend, owns_backend=True
    )
    reader = SlotReader(files, area=area)
    reader.files.open_all()
    resp.send(("ready",))
    # One thread (the reader is single-threaded): start every batch that
    # arrived, then verify and answer the oldest; the back end's threads
    # read the others meanwhile.
    started: deque[tuple[int, int, PendingRead | None]] = deque()
    try:
        while True:
            while not started or req.poll(0):
                rid, items, first_row = req.recv()  # EOFError: the worker left
                try:
                    pending = reader.submit(items, first_row)
                except Exception:
                    logger.exception("kvtier read process: a batch could not start")
                    pending = None
                started.append((rid, len(items), pending))
            rid, count, pending = started.popleft()
            out: list[SlotRead] = []
            if pending is not None:
                try:
                    out = reader.complete(pending)
                except Exception:
                    logger.exception("kvtier read process: a batch raised")
            codes = [r.outcome.value for r in out] or [
                ReadOutcome.IO_ERROR.value
            ] * count
            rows = [r.row for r in out] or [-1] * count
            resp.send(("done", rid, codes, rows, astuple(reader.stats())))
    finally:
        for _rid, _count, pending in started:
            if pending is not None:
                reader.abandon(pending)
        reader.close()


def main(argv: list[str]) -> int:
    parent, fd, req_fd, resp_fd = (int(a) for a in argv[1:5])
    _die_with_parent(parent)
    name_this_thread(CHILD_NAME)
    req = Connection(req_fd, writable=False)
    resp = Connection(resp_fd, readable=False)
    with contextlib.suppress(BrokenPipeError, EOFError):
        _serve(fd, req, resp)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
