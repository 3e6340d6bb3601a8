"""Refuse engines whose workers span nodes (kvtier's full spec, and
``PortableTieringSpec``'s CPU-platform worker).

Both keep the CPU tier in per-rank shared-memory files that the scheduler
and the workers map *by name* (``/dev/shm``). Names only meet on one host:
a tensor- or pipeline-parallel worker on another node would create its own
file there, so the scheduler would spill that rank's zeros (with valid
checksums) and promotions would land where no worker reads. Until the CPU
tier is carried between nodes, kvtier refuses such a layout at start-up.
Data-parallel replicas on different nodes are fine: each replica is its
own engine, with its own scheduler next to its workers.

Facts used, whichever this process has (vLLM hands the spec only an
``OffloadingConfig``, which has no node count):

- ``ParallelConfig.nnodes_within_dp`` (``--nnodes`` with the ``mp``
  back end): nodes that one engine's workers span. Set on the worker side,
  where vLLM builds the connector under ``set_current_vllm_config``.
- vLLM's measured node count of the world group
  (``parallel_state.get_node_count``, found by shared-memory tests, so it
  also catches Ray placing workers on other nodes), when the world group is
  this engine's alone (no data parallelism).
- torchrun's ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE`` under the
  ``external_launcher`` back end.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvtier.connector.config import ConfigError


class TopologyError(ConfigError):
    """This engine's workers span nodes; kvtier cannot serve that layout."""

    def __init__(self, message: str):
        self.key = "parallel"
        ValueError.__init__(self, f"kvtier: {message}")


@dataclass(frozen=True)
class Topology:
    """What this process knows about where one engine's workers run."""

    world_size: int  # workers of this engine (TP x PP x ...)
    data_parallel_size: int = 1
    nnodes_within_dp: int | None = None  # vLLM's ParallelConfig
    measured_nodes: int | None = None  # vLLM's world-group node count
    backend: str | None = None  # distributed_executor_backend
    launcher_world: int | None = None  # torchrun WORLD_SIZE
    launcher_local: int | None = None  # torchrun LOCAL_WORLD_SIZE


def multi_node_reason(t: Topology) -> str | None:
    """Why ``t`` spans nodes, or None if it fits on one (or nothing says
    otherwise)."""
    if t.world_size <= 1:
        return None
    if t.nnodes_within_dp is not None and t.nnodes_within_dp > 1:
        return (
            f"each engine's {t.world_size} workers span {t.nnodes_within_dp} "
            "nodes (--nnodes / nnodes_within_dp)"
        )
    if (
        t.measured_nodes is not None
        and t.measured_nodes > 1
        and t.data_parallel_size <= 1
    ):
        return (
            f"vLLM found the engine's {t.world_size} workers on "
            f"{t.measured_nodes} nodes"
            + (f" (backend {t.backend})" if t.backend else "")
        )
    if (
        t.backend == "external_launcher"
        and t.launcher_local is not None
        and t.launcher_world is not None
        and t.launcher_local < t.launcher_world
        and t.launcher_local % t.world_size != 0
    ):
        return (
            f"torchrun runs {t.launcher_local} of {t.launcher_world} ranks on "
            f"this node, which splits an engine of {t.world_size} workers"
        )
    return None


def observe(config: Any) -> Topology:
    """This process's facts for the spec's ``OffloadingConfig``."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.distributed import parallel_state

    par = config.parallel
    topo: dict[str, Any] = {
        "world_size": max(int(par.world_size), 1),
        "data_parallel_size": max(int(par.data_parallel_size), 1),
    }
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is not None:
        pc = vllm_config.parallel_config
        try:
            topo["nnodes_within_dp"] = int(pc.nnodes_within_dp)
        except (AttributeError, ValueError, ZeroDivisionError):
            topo["nnodes_within_dp"] = int(getattr(pc, "nnodes", 1) or 1)
        backend = pc.distributed_executor_backend
        topo["backend"] = backend if isinstance(backend, str) else None
    # Private: get_node_count() asserts before the distributed environment
    # exists, where this reads None.
    topo["measured_nodes"] = parallel_state._NODE_COUNT
    for key, env in (
        ("launcher_world", "WORLD_SIZE"),
        ("launcher_local", "LOCAL_WORLD_SIZE"),
    ):
        value = os.environ.get(env, "")
        if value.isdigit():
            topo[key] = int(value)
    return Topology(**topo)


def check_single_node(config: Any) -> None:
    """Raise :class:`TopologyError` if this engine's workers span nodes."""
    reason = multi_node_reason(observe(config))
    if reason is not None:
        raise TopologyError(
            f"{reason}. kvtier's CPU tier lives in per-rank shared-memory "
            "files that the scheduler and the workers open by name, so every "
            "worker of an engine must run on the scheduler's node: a rank on "
            "another node would spill zeros and load promotions nobody reads. "
            "Keep tensor/pipeline parallelism within one node and scale out "
            "with data-parallel replicas or more engines sharing a tier "
            "(docs/scale-out.md); vLLM's CPUOffloadingSpec, whose scheduler "
            "never reads the CPU tier's bytes, does serve this layout."
        )
