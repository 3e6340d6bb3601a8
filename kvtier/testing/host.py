"""The CPU tier's private directory under a base a test chooses."""

from __future__ import annotations

import os

from kvtier.host.cpu_tier import cpu_tier_dir
from kvtier.safe_open import open_private_dir


def cpu_buffer_dir(base: str) -> str:
    """``<base>/kvtier-<euid>``, created and checked as the worker creates
    this user's private CPU-tier directory (:mod:`kvtier.host.cpu_tier`):
    mode 0700, owned by the effective user and not a symbolic link, else
    PermissionError/OSError naming it."""
    path = cpu_tier_dir(base)
    os.close(open_private_dir(path))
    return path
