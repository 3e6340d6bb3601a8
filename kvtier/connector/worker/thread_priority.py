"""The calling thread's CPU priority (Linux nice levels, per thread).

Linux keeps a nice level per thread, so a background thread can give the
cores to the thread that started it (the engine's) without touching the
rest of the process; raising one's own nice level is always permitted.
Elsewhere ``setpriority`` would reach the whole process, so nothing is done.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger("kvtier.connector")


def lower_thread_priority(by: int) -> None:
    """Raise the calling thread's nice level by ``by`` (at most to 19).
    A sandbox without ``setpriority`` leaves it as it is (logged at debug)."""
    if not sys.platform.startswith("linux") or by <= 0:
        return
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + by))
    except OSError as exc:
        logger.debug("kvtier: thread priority unchanged: %s", exc)
