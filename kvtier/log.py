"""kvtier's loggers, named under vLLM's ``vllm`` logger so that vLLM's
logging configuration governs them.

vLLM configures one logger, ``vllm``: its level (``VLLM_LOGGING_LEVEL``),
its handler and format (or the ``dictConfig`` of
``VLLM_LOGGING_CONFIG_PATH``), and no propagation beyond it. kvtier's
loggers are its children (``vllm.kvtier.store``, ``vllm.kvtier.host``,
``vllm.kvtier.connector``),
so under ``vllm serve`` or ``LLM(...)`` their records take vLLM's level,
handler and format, like vLLM's own modules' (``vllm.logger.init_logger``);
``VLLM_LOGGING_LEVEL=DEBUG`` shows kvtier's debug lines. Nothing in kvtier
sets a level or adds a handler, but in its helper processes (the read and
spill processes, which do not import vLLM): there ``vllm.kvtier`` sends its
records, at ``VLLM_LOGGING_LEVEL``, to the engine process that started the
helper, whose loggers log them as the helper's
(:func:`kvtier.store.child_process.forward_logs`). Where vLLM configured
nothing (the ``kvtier`` command, a bare script), the records propagate to
the root logger, as any library's do.

No vLLM import: kvtier.store and kvtier.host log through here too.
"""

from __future__ import annotations

import logging

ROOT = "vllm.kvtier"


def get_logger(area: str) -> logging.Logger:
    """The logger of one kvtier package, ``area`` ``"store"``, ``"host"``
    or ``"connector"``."""
    return logging.getLogger(f"{ROOT}.{area}")
