"""``sync_load_budget_bytes`` (vLLM >= 0.33): accepted where kvtier can report
a failed synchronous load, refused with the key and the fix elsewhere."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.connector.config import ConfigError, parse_extra_config

pytest.importorskip("vllm")

from kvtier.connector.compat import SYNC_LOADS, check_sync_load_budget  # noqa: E402

KEY = "sync_load_budget_bytes"
CPU: dict[str, Any] = {
    "spec_name": "TieredOffloadingSpec",
    "spec_module_path": "kvtier.connector",
    "cpu_bytes_to_use": 1 << 30,
}
DISK: dict[str, Any] = {**CPU, "disk_bytes_to_use": 1 << 30, "disk_path": "/mnt/d"}


@pytest.mark.parametrize("value", [-1, "x", True, 1.5, None])
def test_value_must_be_a_byte_count(value: Any) -> None:
    with pytest.raises(ConfigError) as err:
        parse_extra_config({**CPU, KEY: value})
    assert err.value.key == KEY and "integer >= 0" in str(err.value)


def test_default_is_off() -> None:
    assert parse_extra_config(CPU).sync_load_budget_bytes == 0
    assert parse_extra_config({**CPU, KEY: "4096"}).sync_load_budget_bytes == 4096


# (extra config, vLLM has sync loads, KV-cache groups, refusal fragments or None)
CASES = [
    (CPU, False, 1, ["vLLM >= 0.33", f"remove {KEY}"]),
    (DISK, False, 1, ["vLLM >= 0.33"]),
    (CPU, True, 1, None),
    (CPU, True, 3, None),  # a CPU-only hierarchy never fails a load
    (DISK, True, 1, None),  # block-level errors work for one group
    (DISK, True, None, None),  # groups unknown: kvtier's connector checks
    (DISK, True, 2, ["2 KV-cache groups", "block by block", "disk_bytes_to_use: 0"]),
]


@pytest.mark.parametrize("extra,sync_loads,groups,refusal", CASES)
def test_decision(
    extra: dict[str, Any], sync_loads: bool, groups: int | None, refusal: list[str] | None
) -> None:
    cfg = parse_extra_config({**extra, KEY: 1 << 20})
    if refusal is None:
        check_sync_load_budget(cfg, sync_loads=sync_loads, kv_cache_groups=groups)
        return
    with pytest.raises(ConfigError) as err:
        check_sync_load_budget(cfg, sync_loads=sync_loads, kv_cache_groups=groups)
    assert err.value.key == KEY
    message = str(err.value)
    assert f"kv_connector_extra_config['{KEY}']" in message
    assert str(1 << 20) in message
    for fragment in refusal:
        assert fragment in message


@pytest.mark.parametrize(
    "extra,batches,refused",
    [
        (DISK, 1, False),  # synchronous scheduling
        (DISK, None, False),  # not known: kvtier's connector checks
        (DISK, 2, True),  # async scheduling (vLLM 0.33's CUDA default)
        (DISK, 3, True),  # pipeline parallelism
        (CPU, 2, False),  # a CPU-only hierarchy never fails a load
    ],
)
def test_a_disk_tier_refuses_sync_loads_when_vllm_plans_ahead(
    extra: dict[str, Any], batches: int | None, refused: bool
) -> None:
    """Under async scheduling vLLM plans the next step before it learns a
    synchronous load failed, and keeps what a request planned there over
    the loaded blocks computed: a disk tier, whose loads fail, is refused."""
    cfg = parse_extra_config({**extra, KEY: 1 << 20})
    if not refused:
        check_sync_load_budget(
            cfg, sync_loads=True, kv_cache_groups=1, concurrent_batches=batches
        )
        return
    with pytest.raises(ConfigError) as err:
        check_sync_load_budget(
            cfg, sync_loads=True, kv_cache_groups=1, concurrent_batches=batches
        )
    assert err.value.key == KEY
    message = str(err.value)
    assert f"{batches} batches at once" in message
    for fix in (f"remove {KEY}", "--no-async-scheduling", "disk_bytes_to_use: 0"):
        assert fix in message, fix


@pytest.mark.parametrize(
    "extra,v2,batches,refused",
    [
        (DISK, False, 1, False),  # vLLM's V1 model runner, synchronous scheduling
        (DISK, None, 1, False),  # not known: kvtier's connector checks
        (DISK, True, 1, True),  # Model Runner V2 (vLLM 0.33's CUDA default)
        (DISK, True, 2, True),  # ... with async scheduling: both reasons
        (CPU, True, 2, False),  # a CPU-only hierarchy never fails a load
    ],
)
def test_a_disk_tier_refuses_sync_loads_under_model_runner_v2(
    extra: dict[str, Any], v2: bool | None, batches: int, refused: bool
) -> None:
    """vLLM recovers from a failed synchronous load by winding the running
    request back; Model Runner V2 keeps its own device-side count of the
    request's computed tokens and recomputes from the old offset
    (vllm-project/vllm#49250): wrong tokens. A disk tier, whose loads fail,
    is refused there, naming every reason and fix at once."""
    cfg = parse_extra_config({**extra, KEY: 1 << 20})
    kw = dict(
        sync_loads=True, kv_cache_groups=1, concurrent_batches=batches, model_runner_v2=v2
    )
    if not refused:
        check_sync_load_budget(cfg, **kw)  # type: ignore[arg-type]
        return
    with pytest.raises(ConfigError) as err:
        check_sync_load_budget(cfg, **kw)  # type: ignore[arg-type]
    assert err.value.key == KEY
    message = str(err.value)
    for fix in (
        "Model Runner V2",
        "VLLM_USE_V2_MODEL_RUNNER=0",
        f"remove {KEY}",
        "disk_bytes_to_use: 0",
    ):
        assert fix in message, fix
    assert ("--no-async-scheduling" in message) is (batches > 1), message
    assert (f"{batches} batches at once" in message) is (batches > 1), message


def test_zero_is_accepted_everywhere() -> None:
    cfg = parse_extra_config({**DISK, KEY: 0})
    check_sync_load_budget(cfg, sync_loads=False, kv_cache_groups=4)
    check_sync_load_budget(cfg, sync_loads=True, kv_cache_groups=4)
    check_sync_load_budget(cfg, sync_loads=True, concurrent_batches=2)
    check_sync_load_budget(cfg, sync_loads=True, model_runner_v2=True)


def test_the_spec_applies_the_decision_of_this_vllm() -> None:
    """The spec checks at start-up, before it creates any file."""
    from kvtier.testing.offloading import offloading_config, tiered_spec

    config = offloading_config({**CPU, KEY: 1 << 20}, worker_kv_bytes_per_block=4096)
    if SYNC_LOADS:
        spec = tiered_spec(config)
        assert spec.kvtier.sync_load_budget_bytes == 1 << 20
        return
    with pytest.raises(ConfigError, match="vLLM >= 0.33"):
        tiered_spec(config)


def test_the_spec_refuses_a_disk_tier_under_the_connectors_async_scheduling() -> None:
    """The connector hands the spec vLLM's ``max_concurrent_batches``
    (``ConnectorFacts.of``); the spec refuses before it creates any file."""
    from kvtier.connector.spec import ConnectorFacts, TieredOffloadingSpec
    from kvtier.testing.offloading import offloading_config

    config = offloading_config({**DISK, KEY: 1 << 20}, worker_kv_bytes_per_block=4096)
    facts = ConnectorFacts(kv_cache_groups=1, concurrent_batches=2)
    refusal = "2 batches at once" if SYNC_LOADS else "vLLM >= 0.33"
    with pytest.raises(ConfigError, match=refusal):
        TieredOffloadingSpec(config, facts)


def test_the_spec_refuses_a_disk_tier_under_the_connectors_model_runner_v2() -> None:
    """The connector hands the spec vLLM's ``use_v2_model_runner``
    (``ConnectorFacts.of``); the spec refuses before it creates any file."""
    from kvtier.connector.spec import ConnectorFacts, TieredOffloadingSpec
    from kvtier.testing.offloading import offloading_config

    config = offloading_config({**DISK, KEY: 1 << 20}, worker_kv_bytes_per_block=4096)
    facts = ConnectorFacts(kv_cache_groups=1, concurrent_batches=1, model_runner_v2=True)
    refusal = "VLLM_USE_V2_MODEL_RUNNER=0" if SYNC_LOADS else "vLLM >= 0.33"
    with pytest.raises(ConfigError, match=refusal):
        TieredOffloadingSpec(config, facts)
