"""kvtier in vLLM's own tiering mode (``TieringOffloadingSpec``).

The secondary-tier mode: vLLM's primary CPU tier and its tiering manager,
with kvtier's pieces plugged in by name (``module_path`` /
``spec_module_path`` ``"kvtier.connector.tiering"``):

- ``KvtierDiskTier`` (:mod:`~kvtier.connector.tiering.disk_tier`): kvtier's
  disk tier, the full spec's code, as an entry of ``secondary_tiers``;
- ``PortableTieringSpec`` (:mod:`~kvtier.connector.tiering.portable`):
  vLLM's ``TieringOffloadingSpec`` with a worker that also runs on the CPU
  platform;
- ``SharedFsTier`` (:mod:`~kvtier.connector.tiering.shared_fs`): vLLM's
  ``fs`` tier on a shared mount, behind a guard that takes the tier offline
  instead of hanging the engine (docs/scale-out.md).

``pull`` keeps locally what a lower tier supplied; the entry's keys and
their checks are :mod:`kvtier.connector.config`'s. Importing the package is
cheap: a class loads on first access. The config, and when to use this mode
instead of the full ``TieredOffloadingSpec``: docs/tiering-mode.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "KvtierDiskTier": "kvtier.connector.tiering.disk_tier",
    "PortableTieringSpec": "kvtier.connector.tiering.portable",
    "SharedFsTier": "kvtier.connector.tiering.shared_fs",
}

__all__ = ["KvtierDiskTier", "PortableTieringSpec", "SharedFsTier"]

if TYPE_CHECKING:
    from kvtier.connector.tiering.disk_tier import KvtierDiskTier
    from kvtier.connector.tiering.portable import PortableTieringSpec
    from kvtier.connector.tiering.shared_fs import SharedFsTier


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(
            f"module 'kvtier.connector.tiering' has no attribute {name!r}: it "
            f'provides {", ".join(__all__)}; fix the name (an entry\'s "type", '
            '"spec_name")'
        )
    return getattr(importlib.import_module(module), name)
