"""Multi-node layouts are refused at start-up (kvtier.connector.topology):
the rule on its own, then through the specs' start-up with vLLM's own
``ParallelConfig`` current, as vLLM's workers build the connector."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from kvtier.connector.topology import (  # noqa: E402
    Topology,
    TopologyError,
    multi_node_reason,
)
from kvtier.host.cpu_tier import cpu_buffer_path  # noqa: E402
from kvtier.testing.offloading import offloading_config, tiered_spec  # noqa: E402

BLOCK = 8192


@pytest.mark.parametrize(
    ("topo", "refused"),
    [
        (Topology(world_size=1, nnodes_within_dp=4, measured_nodes=4), False),
        (Topology(world_size=8, nnodes_within_dp=1, measured_nodes=1), False),
        (Topology(world_size=8), False),  # nothing says otherwise
        (Topology(world_size=16, nnodes_within_dp=2), True),  # --nnodes 2, TP 16
        (Topology(world_size=4, measured_nodes=2, backend="ray"), True),
        # DP replicas on other nodes: the world group spans them, not one engine.
        (Topology(world_size=4, data_parallel_size=2, measured_nodes=2), False),
        (
            Topology(
                world_size=8,
                backend="external_launcher",
                launcher_world=8,
                launcher_local=4,
            ),
            True,
        ),
        (  # torchrun DP=2 over two nodes, one TP-8 engine per node
            Topology(
                world_size=8,
                backend="external_launcher",
                launcher_world=16,
                launcher_local=8,
            ),
            False,
        ),
    ],
)
def test_multi_node_rule(topo: Topology, refused: bool) -> None:
    assert (multi_node_reason(topo) is not None) is refused


@pytest.fixture
def two_nodes(monkeypatch):
    """vLLM's config for TP=2 over two nodes (--nnodes 2), current as on a
    worker building its connector."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config

    pc = ParallelConfig(nnodes=2, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert pc.nnodes_within_dp == 2
    with set_current_vllm_config(VllmConfig(parallel_config=pc)):
        yield


def _cpu_files(engine_id: str) -> list[str]:
    """This engine's CPU-tier files (every rank), where they would be."""
    paths = [cpu_buffer_path(engine_id, rank, 2) for rank in range(2)]
    return [p for p in paths if os.path.exists(p)]


def test_full_spec_refuses_workers_on_two_nodes(two_nodes, tmp_path) -> None:
    cfg = offloading_config(
        {"cpu_bytes_to_use": 4 * BLOCK * 2},
        worker_kv_bytes_per_block=BLOCK,
        world_size=2,
    )
    with pytest.raises(TopologyError, match=r"span 2 nodes .*scheduler's node"):
        tiered_spec(cfg)
    assert _cpu_files(cfg.engine_id) == []  # refused before any file exists


def test_full_spec_starts_on_one_node(tmp_path) -> None:
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config

    pc = ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="mp")
    cfg = offloading_config(
        {"cpu_bytes_to_use": 4 * BLOCK * 2},
        worker_kv_bytes_per_block=BLOCK,
        world_size=2,
    )
    with set_current_vllm_config(VllmConfig(parallel_config=pc)):
        spec = tiered_spec(cfg)
    assert spec.world_size == 2


def test_measured_node_count_refuses_ray_workers_elsewhere(monkeypatch) -> None:
    """Ray can place workers on other nodes with --nnodes unset; vLLM's own
    shared-memory node count (the world group's) catches that."""
    from vllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "_NODE_COUNT", 2)
    cfg = offloading_config(
        {"cpu_bytes_to_use": 4 * BLOCK * 2},
        worker_kv_bytes_per_block=BLOCK,
        world_size=2,
    )
    with pytest.raises(TopologyError, match="on 2 nodes"):
        tiered_spec(cfg)


def test_portable_tiering_spec_refuses_too(two_nodes, tmp_path) -> None:
    from kvtier.connector.tiering import PortableTieringSpec

    cfg = offloading_config(
        {
            "spec_name": "PortableTieringSpec",
            "cpu_bytes_to_use": 4 * BLOCK * 2,
            "secondary_tiers": [],
        },
        worker_kv_bytes_per_block=BLOCK,
        world_size=2,
    )
    with pytest.raises(TopologyError, match="docs/scale-out.md"):
        PortableTieringSpec(cfg)
