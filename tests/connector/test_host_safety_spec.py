"""Issue #11 through the spec: model identity and DP rank in the layout
fingerprint, one engine_id per host, failed starts that show the real error
and leave no CPU-tier file."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)

from kvtier.connector.identity import (
    layout_fingerprints,  # noqa: E402
    model_identity,  # noqa: E402
)
from kvtier.safe_open import InUseError  # noqa: E402
from kvtier.store.slabs import store_dirname  # noqa: E402
from kvtier.store.slot import slot_size  # noqa: E402
from kvtier.testing.offloading import offloading_config, tiered_spec  # noqa: E402

BLOCK = 8192
PAGE = 4096


def make_model(root: Path) -> Path:
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001.safetensors"}})
    )
    (model / "model-00001.safetensors").write_bytes(b"\0" * 1000)
    (model / "tokenizer.json").write_text("{}")
    return model


def test_model_files_modified_in_place_change_the_identity(tmp_path: Path) -> None:
    model = make_model(tmp_path)
    first = model_identity(str(model))
    assert model_identity(str(model)) == first  # stable
    (model / "tokenizer.json").write_text('{"x": 1}')  # not part of it
    assert model_identity(str(model)) == first

    (model / "config.json").write_text(json.dumps({"hidden_size": 65}))
    second = model_identity(str(model))
    assert second != first

    weights = model / "model-00001.safetensors"
    st = weights.stat()
    weights.write_bytes(b"\1" * 1000)  # same size, rewritten in place
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    third = model_identity(str(model))
    assert third != second

    (model / "model-00002.safetensors").write_bytes(b"\0")  # a shard added
    assert model_identity(str(model)) != third
    # A name that is no local directory (nor in the HF cache) still works.
    assert model_identity("no/such-model-xyz") == model_identity("no/such-model-xyz")


def test_layout_fingerprint_covers_model_contents_and_dp_rank(tmp_path: Path) -> None:
    model = make_model(tmp_path)
    cfg = offloading_config(
        {"cpu_bytes_to_use": 1 << 20},
        worker_kv_bytes_per_block=BLOCK,
        model=str(model),
    )
    before = layout_fingerprints(cfg, BLOCK, 1)[0]
    assert layout_fingerprints(cfg, BLOCK, 1)[0].digest() == before.digest()
    (model / "config.json").write_text(json.dumps({"hidden_size": 128}))
    after = layout_fingerprints(cfg, BLOCK, 1)[0]
    assert after.digest() != before.digest()
    assert store_dirname(after) != store_dirname(before)

    dp1 = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(
            cfg.parallel, data_parallel_index=1, data_parallel_size=2
        ),
    )
    replica = layout_fingerprints(dp1, BLOCK, 1)[0]
    assert replica.dp_rank == 1 and replica.digest() != after.digest()


def test_layout_fingerprint_covers_which_layers_each_group_holds(
    tmp_path: Path,
) -> None:
    # Same group ids, block tokens and layer counts, other layers in the
    # group (a vLLM that groups layers otherwise): another store.
    cfg = offloading_config(
        {"cpu_bytes_to_use": 1 << 20},
        worker_kv_bytes_per_block=BLOCK,
        layers=4,
        model=str(make_model(tmp_path)),
    )
    (group,) = cfg.groups
    names = group.layer_names
    regrouped = dataclasses.replace(
        cfg,
        groups=(
            dataclasses.replace(group, layer_names=names[0::2] + names[1::2]),
        ),
    )
    before = layout_fingerprints(cfg, BLOCK, 1)[0]
    after = layout_fingerprints(regrouped, BLOCK, 1)[0]
    assert before.geometry.split("@")[0] == after.geometry.split("@")[0]
    assert before.digest() != after.digest()
    assert store_dirname(after) != store_dirname(before)
    # ... and one run's names always give the same store.
    assert layout_fingerprints(cfg, BLOCK, 1)[0].digest() == before.digest()


def caches() -> CanonicalKVCaches:
    layers = 2
    kv = [torch.zeros(8, PAGE, dtype=torch.int8) for _ in range(layers)]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in kv],
        group_data_refs=[[CanonicalKVCacheRef(i, PAGE) for i in range(layers)]],
    )


def spec_config(tmp_path: Path, **extra: Any):
    extra_config = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "kvtier.connector",
        "cpu_bytes_to_use": 8 * BLOCK,
        "disk_io": "posix",
        **extra,
    }
    return offloading_config(
        extra_config, worker_kv_bytes_per_block=BLOCK, layers=2, engine_tag="safety"
    )


def test_second_engine_with_the_same_engine_id_is_refused(tmp_path: Path) -> None:
    # With a disk tier the worker's file keeps its name until the scheduler
    # side maps it (issue #23); a second engine with that id meanwhile
    # would share its rows, so it is refused.
    disk = tmp_path / "disk"
    disk.mkdir()
    cfg = spec_config(
        tmp_path, disk_bytes_to_use=4 * slot_size(BLOCK), disk_path=str(disk)
    )
    first = tiered_spec(cfg).get_worker(caches())
    try:
        with pytest.raises(InUseError) as info:
            tiered_spec(cfg).get_worker(caches())
        assert repr(cfg.engine_id) in str(info.value)
    finally:
        first.shutdown()


def test_a_cpu_only_worker_tier_has_no_name(tmp_path: Path) -> None:
    # Nobody else maps it: the name goes at creation (issue #23), so the
    # kernel frees it with the process, and no other engine can reach it.
    cfg = spec_config(tmp_path)
    spec = tiered_spec(cfg)
    first = spec.get_worker(caches())
    try:
        assert not os.path.lexists(spec._buffer_path(0))
        second = tiered_spec(cfg).get_worker(caches())  # its own memory
        second.shutdown()
    finally:
        first.shutdown()


def test_failed_worker_construction_leaves_no_cpu_tier_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.connector.worker import worker as worker_mod

    def broken(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("copier set-up failed")

    monkeypatch.setattr(worker_mod.TieredOffloadingWorker, "__init__", broken)
    spec = tiered_spec(spec_config(tmp_path))
    path = spec._buffer_path(0)
    with pytest.raises(RuntimeError, match="copier set-up failed"):
        spec.get_worker(caches())
    assert not os.path.exists(path)


@pytest.mark.parametrize("failure", ["file_in_place", "kvikio_absent", "enospc"])
def test_failed_manager_start_shows_the_real_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    extra: dict[str, Any] = {
        "disk_bytes_to_use": 4 * slot_size(BLOCK),
        "disk_path": str(disk),
    }
    if failure == "kvikio_absent":
        from kvtier.store.backends.factory import kvikio_status

        if kvikio_status()[0]:
            pytest.skip("kvikio is usable here")
        extra["disk_io"] = "kvikio"
    spec = tiered_spec(spec_config(tmp_path, **extra))
    path = spec._buffer_path(0)
    if failure == "kvikio_absent":
        # Disk reads, and so kvikio, live in the workers only: the worker
        # fails to start, with the real reason, and leaves no CPU-tier file.
        with pytest.raises(Exception) as info:
            spec.get_worker(caches())
        assert not isinstance(info.value, AttributeError)
        assert "disk_io='kvikio'" in str(info.value)
        assert not os.path.exists(path)
        return
    worker = spec.get_worker(caches())
    if failure == "file_in_place":
        (disk / store_dirname(spec.fingerprints[0])).write_text("x")
        expected = "not a directory"
    elif failure == "enospc":
        import errno

        from kvtier.store import slabs as slab_mod

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        # (os is one module: patched only now that the worker's file exists)
        monkeypatch.setattr(slab_mod.os, "posix_fallocate", full)
        expected = "cannot preallocate"
    else:
        expected = "disk_io='kvikio'"
    try:
        with pytest.raises(Exception) as info:
            spec.get_manager()
        assert not isinstance(info.value, AttributeError)
        assert expected in str(info.value)
    finally:
        worker.shutdown()
    assert not os.path.exists(path)
