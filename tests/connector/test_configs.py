"""The ready-made kv-transfer-config files in configs/ stay valid.

Each file is what ``vllm serve MODEL --kv-transfer-config "$(cat FILE)"``
receives: JSON for vLLM's ``KVTransferConfig`` whose
``kv_connector_extra_config`` names a spec that can load kvtier and passes
kvtier's schema (disk paths are not checked: they name production mounts).

Two kinds of file: kvtier's own spec (``TieredOffloadingSpec``, validated by
``parse_extra_config``), and vLLM's tiering spec with kvtier's disk tier as a
secondary tier (``vllm-tiering-*``, validated by ``parse_tier_config``).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.connector.config import parse_extra_config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
EXPECTED = {
    "cpu-only.json",
    "cpu-disk.json",
    "cpu-disk-multi-nvme.json",
    "cpu-disk-gds-zstd.json",
}
CONFIG_FILES = sorted(p for p in CONFIG_DIR.iterdir() if p.is_file())
HAVE_VLLM = importlib.util.find_spec("vllm") is not None

# spec_name -> the spec_module_path it must come with (None: vLLM's own).
TIERED = "TieredOffloadingSpec"
TIERING_SPECS = {
    "PortableTieringSpec": "kvtier.connector.tiering",
    "TieringOffloadingSpec": None,
}


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _extra(path: Path) -> dict[str, Any]:
    return _load(path)["kv_connector_extra_config"]


def test_expected_files_exist() -> None:
    assert {p.name for p in CONFIG_FILES} >= EXPECTED


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_file_is_valid(path: Path) -> None:
    assert path.suffix == ".json", f"{path.name}: configs/ holds JSON files only"
    cfg = _load(path)  # raises on invalid JSON
    assert cfg["kv_role"] == "kv_both"
    extra = cfg["kv_connector_extra_config"]
    spec = extra.get("spec_name")
    if spec == TIERED:
        # kvtier's connector, which recomputes a failed disk load.
        assert cfg["kv_connector"] == "TieredOffloadingConnector"
        assert cfg["kv_connector_module_path"] == "kvtier.connector"
        assert cfg["kv_load_failure_policy"] == "recompute"
        assert extra["spec_module_path"] == "kvtier.connector"
        parsed = parse_extra_config(extra)
        assert parsed.cpu_bytes_to_use > 0
        for disk_path in parsed.disk_path:
            assert disk_path.startswith("/mnt/"), disk_path
    elif spec in TIERING_SPECS:
        assert cfg["kv_connector"] == "OffloadingConnector"
        assert extra.get("spec_module_path") == TIERING_SPECS[spec]
        assert int(extra["cpu_bytes_to_use"]) > 0
        tiers = [
            t for t in extra.get("secondary_tiers", ()) if t["type"] == "KvtierDiskTier"
        ]
        assert tiers, f"{path.name}: no KvtierDiskTier in secondary_tiers"
        for tier in tiers:
            assert tier["module_path"] == "kvtier.connector.tiering"
        if HAVE_VLLM:
            from kvtier.connector.config import parse_tier_config

            for tier in tiers:
                conf = {
                    k: v for k, v in tier.items() if k not in ("type", "module_path")
                }
                assert parse_tier_config(conf).disk_enabled
    else:
        pytest.fail(f"{path.name}: spec_name {spec!r} does not load kvtier")


def test_each_config_shows_its_feature() -> None:
    by_name = {name: parse_extra_config(_extra(CONFIG_DIR / name)) for name in EXPECTED}
    assert not by_name["cpu-only.json"].disk_enabled
    disk = by_name["cpu-disk.json"]
    assert disk.disk_enabled and len(disk.disk_path) == 1
    multi = by_name["cpu-disk-multi-nvme.json"]
    assert multi.disk_enabled and len(multi.disk_path) == 2
    gds = by_name["cpu-disk-gds-zstd.json"]
    assert (gds.disk_io, gds.disk_compression) == ("kvikio", "zstd")


@pytest.mark.skipif(not HAVE_VLLM, reason="needs vLLM")
@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_vllm_cli_accepts_config_file_text(path: Path) -> None:
    """The documented form: the file's text as the flag's value."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--kv-transfer-config", path.read_text()])
    kv = args.kv_transfer_config
    cfg = _load(path)
    assert kv.kv_connector == cfg["kv_connector"]
    assert kv.kv_connector_module_path == cfg.get("kv_connector_module_path")
    assert kv.kv_load_failure_policy == cfg.get("kv_load_failure_policy", "fail")
    assert kv.kv_role == cfg["kv_role"]
    assert kv.kv_connector_extra_config == cfg["kv_connector_extra_config"]


@pytest.mark.skipif(not HAVE_VLLM, reason="needs vLLM")
def test_tiered_spec_is_importable_by_name() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.kv_offload.base import OffloadingSpec

    cfg = _load(CONFIG_DIR / "cpu-disk.json")
    extra = cfg["kv_connector_extra_config"]
    module = importlib.import_module(extra["spec_module_path"])
    assert issubclass(getattr(module, extra["spec_name"]), OffloadingSpec)
    module = importlib.import_module(cfg["kv_connector_module_path"])
    assert issubclass(getattr(module, cfg["kv_connector"]), OffloadingConnector)
