"""The vLLM plugin. The only kvtier code that imports vLLM.

``kv_connector: "TieredOffloadingConnector"`` with
``kv_connector_module_path: "kvtier.connector"`` loads kvtier's connector
(:mod:`kvtier.connector.connector`), and ``spec_module_path:
"kvtier.connector"`` with ``spec_name: "TieredOffloadingSpec"`` its spec
(:class:`kvtier.connector.spec.TieredOffloadingSpec`).
Importing this package is cheap (vLLM's API server imports it to build
metric definitions); the spec and its dependencies load on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "TieredOffloadingConnector": "kvtier.connector.connector",
    "TieredOffloadingSpec": "kvtier.connector.spec",
}

__all__ = ["TieredOffloadingConnector", "TieredOffloadingSpec"]

if TYPE_CHECKING:
    from kvtier.connector.connector import TieredOffloadingConnector
    from kvtier.connector.spec import TieredOffloadingSpec


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        # Not "from kvtier.connector import tiering": that looks the name up
        # here first, i.e. in this function, before the submodule exists.
        tiering = importlib.import_module("kvtier.connector.tiering")  # cheap
        if name in tiering.__all__:
            raise AttributeError(
                f"module 'kvtier.connector' has no attribute {name!r}: it is in "
                '"kvtier.connector.tiering" (tiering mode): set "module_path" '
                '(an entry of secondary_tiers) or "spec_module_path" to it'
            )
        # vLLM looks spec_name and kv_connector up here: name what is.
        raise AttributeError(
            f"module 'kvtier.connector' has no attribute {name!r}: it provides "
            'TieredOffloadingSpec ("spec_name") and TieredOffloadingConnector '
            '("kv_connector"); fix the name in --kv-transfer-config'
        )
    return getattr(importlib.import_module(module), name)
