"""``parse_extra_config`` and ``check_disk_paths``: every bad input raises a
``ConfigError`` whose message names the key and what is accepted.

Table-driven: each case is (extra_config, key the error must name,
fragments the message must contain).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvtier.connector import preflight
from kvtier.connector.config import (
    KEYS,
    ConfigError,
    KvtierConfig,
    parse_extra_config,
)
from kvtier.connector.preflight import check_disk_paths
from kvtier.tiers.policy import policy_names

BASE: dict[str, Any] = {
    "spec_name": "TieredOffloadingSpec",
    "spec_module_path": "kvtier.connector",
    "cpu_bytes_to_use": 1 << 30,
}
DISK: dict[str, Any] = {**BASE, "disk_bytes_to_use": 1 << 30, "disk_path": "/mnt/d"}

INT_MIN1 = "integer >= 1"
THREADS = "integer in [1, 256]"
INT_MIN0 = "integer >= 0"
POLICY = " | ".join(policy_names())  # every registered policy, listed
BOOL = "true | false"
FRACTION = "number in [0, 1]"

# kvtier-read keys: (key, bad value, accepted-values fragment)
WRONG_TYPES: list[tuple[str, Any, str]] = []
for _key, _frag in (
    ("cpu_bytes_to_use", INT_MIN1),
    ("disk_bytes_to_use", INT_MIN0),
    ("disk_io_threads", THREADS),
    ("disk_load_buffer_bytes", "integer >= 1048576"),
):
    for _bad in (1.5, "1e9", "lots", True, None, [1], {"a": 1}):
        if _bad is None and _key != "cpu_bytes_to_use":
            continue  # None means "use the default" for optional keys
        WRONG_TYPES.append((_key, _bad, _frag if _bad is not None else "required"))
for _key, _frag in (
    ("eviction_policy", POLICY),
    ("cpu_eviction_policy", POLICY),
    ("disk_eviction_policy", POLICY),
    ("disk_io", "auto | posix | kvikio"),
    ("disk_compression", "none | zstd"),
    ("disk_load_path", "host | device"),
    ("disk_read_process", "auto | on | off"),
    ("disk_spill_process", "auto | on | off"),
):
    for _bad in (1, True, ["lru"], "", "fifo"):
        WRONG_TYPES.append((_key, _bad, _frag))
for _bad in (1, 0, "yes", "1", None, []):
    WRONG_TYPES.append(("promote_on_hit", _bad, BOOL))
for _bad in ("half", True, None, [0.5], -0.1, 1.01, float("nan"), 10**400):
    WRONG_TYPES.append(("spill_watermark", _bad, FRACTION))


def _expect(extra: dict[str, Any], key: str, *fragments: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_extra_config(extra)
    err = info.value
    assert err.key == key, str(err)
    assert f"[{key!r}]" in str(err)
    for fragment in fragments:
        assert fragment in str(err), (fragment, str(err))
    return err


@pytest.mark.parametrize(
    "key,value,accepted", WRONG_TYPES, ids=[f"{k}={v!r:.40}" for k, v, _ in WRONG_TYPES]
)
def test_wrong_type(key: str, value: Any, accepted: str) -> None:
    _expect({**DISK, key: value}, key, accepted)


def test_every_kvtier_key_has_a_wrong_type_case() -> None:
    kvtier_keys = {k.name for k in KEYS if k.owner == "kvtier"}
    covered = {k for k, _, _ in WRONG_TYPES} | {"disk_path"}
    assert kvtier_keys <= covered, kvtier_keys - covered


@pytest.mark.parametrize(
    "key,value,accepted",
    [
        ("cpu_bytes_to_use", 0, INT_MIN1),
        ("cpu_bytes_to_use", -1, INT_MIN1),
        ("cpu_bytes_to_use", "-5", INT_MIN1),
        ("disk_bytes_to_use", -1, INT_MIN0),
        ("disk_io_threads", 0, THREADS),
        ("disk_io_threads", -4, THREADS),
        ("disk_io_threads", 257, THREADS),
        ("disk_io_threads", 10**7, THREADS),
    ],
)
def test_zero_and_negative_sizes(key: str, value: Any, accepted: str) -> None:
    err = _expect({**DISK, key: value}, key, accepted)
    assert str(int(value)) in str(err)


def test_missing_cpu_bytes_is_required() -> None:
    extra = {k: v for k, v in BASE.items() if k != "cpu_bytes_to_use"}
    _expect(extra, "cpu_bytes_to_use", "required")


@pytest.mark.parametrize(
    "key", ["eviction_policy", "cpu_eviction_policy", "disk_eviction_policy"]
)
@pytest.mark.parametrize("policy", ["fifo", "LFU", "random"])
def test_unknown_policy(key: str, policy: str) -> None:
    _expect({**DISK, key: policy}, key, repr(policy), POLICY)


@pytest.mark.parametrize("key", ["cpu_bytes", "disk_paths", "CPU_BYTES_TO_USE", ""])
def test_unknown_key_lists_valid_keys(key: str) -> None:
    err = _expect({**DISK, key: 1}, key, "unknown key", "valid keys are")
    for name in KvtierConfig.model_fields:
        assert name in str(err)
    near = {
        "cpu_bytes": "cpu_bytes_to_use",
        "disk_paths": "disk_path",
        "CPU_BYTES_TO_USE": "cpu_bytes_to_use",
    }.get(key)
    assert str(err).endswith(
        f"; did you mean {near!r}?" if near else "canonical_layout"
    )


@pytest.mark.parametrize(
    "paths,fragment",
    [
        ("relative/dir", "is relative"),
        ("./kv", "is relative"),
        (["/mnt/a", "rel"], "is relative"),
        ([], "non-empty list"),
        ("", "non-empty path"),
        ([""], "non-empty path"),
        ([None], "non-empty path"),
        (5, "expected a path"),
        ({"/mnt/a": 1}, "expected a path"),
        (["/mnt/a", "/mnt/a/"], "listed twice"),
        (["/mnt/a", "/mnt/b/../a"], "listed twice"),
        ("/mnt/a\x00b", "NUL byte"),
        (["/mnt/a", "/mnt/\x00"], "NUL byte"),
    ],
)
def test_bad_disk_path(paths: Any, fragment: str) -> None:
    _expect({**DISK, "disk_path": paths}, "disk_path", fragment)


@pytest.mark.parametrize(
    "key,value",
    [
        ("eviction_policy", "x" * (1 << 20)),
        ("disk_io_threads", 10**4000),
        ("disk_path", "r" * (1 << 20)),
        ("disk_path", [1] * (1 << 18)),
    ],
    ids=["long-string", "huge-int", "long-relative-path", "long-list"],
)
def test_a_huge_value_is_shown_in_part(key: str, value: Any) -> None:
    """An error is one readable line: it shows the start of what was given,
    not all of a megabyte."""
    err = _expect({**DISK, key: value}, key)
    assert len(str(err)) < 1000, len(str(err))


def test_every_refused_key_is_named_at_once() -> None:
    """One start names every key to fix, not only the first: unknown keys
    first (sorted), then refused values in field order, each once; each
    further one is a ConfigError of its own for the doctor."""
    doc = {
        **DISK,
        "eviction_polcy": "lru",
        "disk_threads": 4,
        "disk_bytes_to_use": "lots",
        "disk_io": "spdk",
    }
    with pytest.raises(ConfigError) as info:
        parse_extra_config(doc)
    err = info.value
    assert [err.key] + [e.key for e in err.more] == [
        "disk_threads",
        "eviction_polcy",
        "disk_bytes_to_use",
        "disk_io",
    ]
    assert str(err).startswith(err.problem)
    assert (
        " (and 3 more key(s) refused: 'eviction_polcy', 'disk_bytes_to_use', "
        "'disk_io'; kvtier doctor --config gives each its message)"
    ) in str(err)
    assert "did you mean 'disk_io_threads'?" in err.problem
    assert "did you mean 'eviction_policy'?" in err.more[0].problem
    assert err.more[1].problem.startswith(
        "kvtier: kv_connector_extra_config['disk_bytes_to_use']: got 'lots'"
    )
    assert "'spdk'" in err.more[2].problem and "auto | posix | kvikio" in str(
        err.more[2]
    )
    assert all(not e.more for e in err.more)


@pytest.mark.parametrize("alone", [True, False])
def test_a_config_error_survives_pickling(alone: bool) -> None:
    """An executor that ships exceptions between processes pickles them:
    ConfigError's __init__ takes (key, message), its args hold the whole
    text, so unpickling raised TypeError (missing 'message')."""
    import pickle

    from kvtier.connector.config import TierConfigError, as_tier_error

    doc = {**DISK, "disk_io": "spdk"} if alone else {**DISK, "disk_io": "x", "y": 1}
    with pytest.raises(ConfigError) as info:
        parse_extra_config(doc)
    for err in (info.value, as_tier_error(info.value)):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert (back.key, back.message) == (err.key, err.message)
        assert [e.key for e in back.more] == [e.key for e in err.more]
        assert isinstance(back, TierConfigError) == isinstance(err, TierConfigError)


@pytest.mark.parametrize(
    "key, value", [("disk_io", "spdk"), ("eviction_policy", "fifo")]
)
def test_one_refused_key_is_said_alone(key: str, value: str) -> None:
    """Alone: cpu_/disk_eviction_policy take eviction_policy's value when
    not given, and are not named for it."""
    with pytest.raises(ConfigError) as info:
        parse_extra_config({**DISK, key: value})
    assert info.value.key == key
    assert info.value.more == () and str(info.value) == info.value.problem


def test_disk_budget_without_path() -> None:
    extra = {k: v for k, v in DISK.items() if k != "disk_path"}
    _expect(extra, "disk_path", "required when disk_bytes_to_use > 0")


@pytest.mark.parametrize(
    "other, fragment",
    [
        ({"disk_load_path": "device"}, "disk_load_path to host"),
        ({"disk_io": "kvikio"}, "set disk_io to auto or posix"),
    ],
)
def test_a_read_process_is_refused_where_it_cannot_read(
    other: dict[str, str], fragment: str
) -> None:
    """``disk_read_process: on`` reads in a child, into host memory, with no
    accelerator visible: not into a device staging area, not with kvikio."""
    _expect({**DISK, "disk_read_process": "on", **other}, "disk_read_process", fragment)
    for setting in ("auto", "off"):  # where the worker picks, or reads itself
        parse_extra_config({**DISK, "disk_read_process": setting, **other})


@pytest.mark.parametrize("budget", [None, 0])
def test_path_without_disk_budget(budget: Any) -> None:
    extra = {**BASE, "disk_path": "/mnt/d"}
    if budget is not None:
        extra["disk_bytes_to_use"] = budget
    _expect(extra, "disk_bytes_to_use", "disk_bytes_to_use > 0")


def test_vllm_keys_pass_through() -> None:
    vllm_keys = {k.name: 16 for k in KEYS if k.owner == "vllm"}
    vllm_keys.update(spec_name="TieredOffloadingSpec", spec_module_path="m")
    assert parse_extra_config({**BASE, **vllm_keys}).cpu_bytes_to_use == 1 << 30


def test_valid_config_and_defaults() -> None:
    cfg = parse_extra_config(
        {
            **BASE,
            "disk_bytes_to_use": "1000",
            "disk_path": ["/mnt/a", "/mnt/b/"],
            "eviction_policy": "ARC",
            "cpu_eviction_policy": "lru",
            "promote_on_hit": "false",
            "spill_watermark": "0.5",
        }
    )
    assert cfg == KvtierConfig(
        **BASE,
        disk_bytes_to_use=1000,
        disk_path=("/mnt/a", "/mnt/b"),
        eviction_policy="arc",
        cpu_eviction_policy="lru",
        promote_on_hit=False,
        spill_watermark=0.5,
    )
    assert cfg.disk_path == ("/mnt/a", "/mnt/b")
    assert (cfg.cpu_eviction_policy, cfg.disk_eviction_policy) == ("lru", "arc")
    plain = parse_extra_config(BASE)
    assert not plain.disk_enabled and plain.disk_path == ()
    defaults = {k.name: k.default for k in KEYS}
    assert plain.disk_io == defaults["disk_io"]
    assert plain.disk_compression == defaults["disk_compression"]
    assert plain.promote_on_hit is defaults["promote_on_hit"]
    assert plain.spill_watermark == defaults["spill_watermark"]
    assert plain.disk_io_threads == defaults["disk_io_threads"]
    assert plain.cpu_eviction_policy == defaults["eviction_policy"]


# ----------------------------------------------------------- check_disk_paths


def _cfg(paths: list[str], budget: int = 1 << 20) -> KvtierConfig:
    return parse_extra_config({**BASE, "disk_bytes_to_use": budget, "disk_path": paths})


def _expect_check(cfg: KvtierConfig, key: str, *fragments: str, **kw: Any) -> None:
    with pytest.raises(ConfigError) as info:
        check_disk_paths(cfg, **kw)
    assert info.value.key == key, str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_check_passes_and_ignores_disabled_disk(tmp_path) -> None:
    check_disk_paths(_cfg([str(tmp_path)]))
    check_disk_paths(parse_extra_config(BASE))  # no disk tier: nothing to check


def test_missing_path(tmp_path) -> None:
    missing = str(tmp_path / "nope")
    _expect_check(_cfg([missing]), "disk_path", repr(missing), "does not exist")


def test_path_is_a_file(tmp_path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    _expect_check(_cfg([str(f)]), "disk_path", "not a directory")


def test_second_path_missing(tmp_path) -> None:
    missing = str(tmp_path / "nvme1")
    _expect_check(_cfg([str(tmp_path), missing]), "disk_path", repr(missing))


def test_unwritable_path(tmp_path, monkeypatch) -> None:
    # root bypasses permission bits, so ask os.access what the check asks.
    target = str(tmp_path)
    real_access = os.access

    def access(path, mode, *a, **kw):
        if os.path.normpath(path) == target and mode & os.W_OK:
            return False
        return real_access(path, mode, *a, **kw)

    monkeypatch.setattr(preflight.os, "access", access)
    _expect_check(_cfg([target]), "disk_path", repr(target), "not writable")


def _check_unwritable_as_nobody(path: str) -> None:
    """Child of a root test run: become user nobody, then check ``path``."""
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    _expect_check(_cfg([path]), "disk_path", "not writable")


def test_unwritable_path_for_real(tmp_path) -> None:
    if os.geteuid() != 0:
        locked = tmp_path / "ro"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            _expect_check(_cfg([str(locked)]), "disk_path", "not writable")
        finally:
            locked.chmod(0o700)
        return
    # Root bypasses permission bits: run the check in a child that drops to
    # user nobody. The directory lives in a fresh root-owned directory that
    # nobody may enter (pytest's tmp_path parents are private to root).
    import multiprocessing
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="kvtier-perm-"))
    try:
        top.chmod(0o711)
        locked = top / "ro"
        locked.mkdir(mode=0o755)  # root's: not writable by nobody
        child = multiprocessing.get_context("fork").Process(
            target=_check_unwritable_as_nobody, args=(str(locked),)
        )
        child.start()
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
            child.join(timeout=10)
            raise AssertionError("the check as user nobody did not finish in 60 s")
        assert child.exitcode == 0, (
            f"the check as user nobody failed ({child.exitcode})"
        )
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_one_directory_listed_under_two_names(tmp_path) -> None:
    """A link (or bind mount) alias of a listed path: the second DiskStore
    directory would be refused as 'in use by another running engine' (its
    own lock), and the free space counted twice."""
    real = tmp_path / "kv"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    cfg = _cfg([str(real), str(tmp_path / "alias")])
    _expect_check(cfg, "disk_path", "same directory", str(real), "once")


def test_too_little_free_space(tmp_path) -> None:
    cfg = _cfg([str(tmp_path)], budget=10_000)
    _expect_check(
        cfg,
        "disk_bytes_to_use",
        "has 9999 bytes free but needs 10000",
        "lower disk_bytes_to_use",
        free_bytes=lambda _p: 9_999,
    )
    check_disk_paths(cfg, free_bytes=lambda _p: 10_000)


def test_free_space_is_per_path_share(tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    cfg = _cfg([str(a), str(b)], budget=10_001)  # ceil(10001 / 2) = 5001 each
    check_disk_paths(cfg, free_bytes=lambda _p: 5_001)
    _expect_check(
        cfg,
        "disk_bytes_to_use",
        "needs 5001",
        "over 2 path(s)",
        free_bytes=lambda p: 5_000 if p == str(b) else 10**9,
    )


def test_existing_kvtier_files_count_as_free(tmp_path) -> None:
    slab_dir = tmp_path / "kvtier-0123456789abcdef"
    slab_dir.mkdir()
    (slab_dir / "slab-0.kvt").write_bytes(b"\1" * 8192)
    cfg = _cfg([str(tmp_path)], budget=8192)
    reuse = ["kvtier-0123456789abcdef"]  # this engine's layout directory
    check_disk_paths(cfg, free_bytes=lambda _p: 0, reusable=reuse)  # reused
    _expect_check(
        _cfg([str(tmp_path)], budget=8192 * 4),
        "disk_bytes_to_use",
        "bytes free",
        free_bytes=lambda _p: 0,
        reusable=reuse,
    )


# ------------------------------------------------- layout-aware space checks


def test_only_this_layouts_slabs_count_as_reusable_space(tmp_path):

    (tmp_path / "kvtier-aaaa").mkdir()
    (tmp_path / "kvtier-aaaa" / "slab-0.kvt").write_bytes(b"\1" * (1 << 20))
    cfg = _cfg([str(tmp_path)])
    need = cfg.disk_bytes_to_use
    free = need - (1 << 19)  # short by half a MiB
    # Our own layout's slab is reused by a warm restart: it counts.
    check_disk_paths(cfg, free_bytes=lambda _p: free, reusable=["kvtier-aaaa"])
    # Another layout's (retired model / block size) does not.
    with pytest.raises(
        ConfigError, match=r"\['disk_bytes_to_use'\].*bytes free but needs"
    ):
        check_disk_paths(cfg, free_bytes=lambda _p: free, reusable=["kvtier-bbbb"])


def test_shared_memory_too_small_fails_at_start_up(tmp_path):
    from kvtier.connector.preflight import check_shm_space

    check_shm_space(str(tmp_path), 1000, free_bytes=lambda _p: 1000)
    with pytest.raises(ConfigError, match=r"\['cpu_bytes_to_use'\].*--shm-size"):
        check_shm_space(str(tmp_path), 1001, free_bytes=lambda _p: 1000)
    # This engine's already created CPU-tier file counts as available.
    existing = tmp_path / "kvtier-e-r0of1.cpu"
    existing.write_bytes(b"\1" * 8192)
    check_shm_space(str(tmp_path), 9000, [str(existing)], free_bytes=lambda _p: 1000)


def test_cpu_buffer_reserves_shared_memory_or_fails_clearly(tmp_path):
    import subprocess

    from kvtier.host.cpu_tier import CpuBlockBuffer

    mnt = tmp_path / "shm"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
        capture_output=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        # 4 MiB on a 1 MiB tmpfs: an error now, not a SIGBUS on first touch.
        with pytest.raises(OSError, match="cannot reserve .* --shm-size"):
            CpuBlockBuffer(64, 65536, str(mnt / "tier.cpu"))
        assert not (mnt / "tier.cpu").exists()
        with CpuBlockBuffer(8, 65536, str(mnt / "ok.cpu")) as buf:
            buf.array[:] = 7  # every page is really there
            assert int(buf.array.sum()) == 7 * 8 * 65536
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# ------------------------------------------------------------ size strings

SIZE_KEYS = ("cpu_bytes_to_use", "disk_bytes_to_use", "disk_load_buffer_bytes")


@pytest.mark.parametrize(
    "text,expected",
    [
        ("64G", 64 << 30),  # vLLM's rule: upper case binary
        ("64g", 64 * 10**9),  # lower case decimal
        ("2TiB", 2 << 40),
        ("1.5TB", 1_500_000_000_000),
        ("4096M", 4096 << 20),
    ],
)
def test_size_strings_read_as_vllm_reads_them(text: str, expected: int) -> None:
    cfg = parse_extra_config({**DISK, **dict.fromkeys(SIZE_KEYS, text)})
    assert [getattr(cfg, k) for k in SIZE_KEYS] == [expected] * 3


@pytest.mark.parametrize("key", SIZE_KEYS)
def test_a_binary_size_with_a_fraction_names_the_key_and_the_fix(key: str) -> None:
    _expect({**DISK, key: "1.5G"}, key, "'1.5G'", "1.5g")


def test_keys_vllm_reads_take_no_size_string() -> None:
    # vLLM reads sync_load_budget_bytes with int(): "64M" would stop it.
    _expect(
        {**BASE, "sync_load_budget_bytes": "64M"},
        "sync_load_budget_bytes",
        "integer >= 0",
        "no size string",
    )


# ------------------------------------------------- one schema, both modes


def test_every_key_is_described_with_what_it_accepts() -> None:
    from kvtier.connector.config import TIER_KEYS

    for k in (*KEYS, *TIER_KEYS):
        assert k.doc and k.accepted and k.accepted != "any value", k


def test_the_tier_entry_takes_the_full_specs_disk_keys() -> None:
    from kvtier.connector.config import (
        TIER_KEYS,
        TierConfigError,
        parse_tier_config,
    )

    full = {k.name: k for k in KEYS}
    shared = [k for k in TIER_KEYS if k.name in full]
    assert {k.name for k in shared} >= {"disk_bytes_to_use", "disk_path", "disk_io"}
    for k in shared:
        if k.required:  # the budget and the path: required, the budget > 0
            assert k.name in ("disk_bytes_to_use", "disk_path")
            continue
        assert (k.default, k.accepted, k.doc) == (
            full[k.name].default,
            full[k.name].accepted,
            full[k.name].doc,
        )
    entry = {"disk_bytes_to_use": "1G", "disk_path": "/mnt/d", "disk_io": "POSIX"}
    cfg = parse_tier_config(entry)
    assert (cfg.disk_bytes_to_use, cfg.disk_io, cfg.disk_io_threads) == (
        1 << 30,
        "posix",
        4,
    )
    for bad, key, fragment in [
        ({**entry, "disk_io_threads": 257}, "disk_io_threads", "integer in [1, 256]"),
        ({**entry, "disk_bytes_to_use": 0}, "disk_bytes_to_use", "integer >= 1"),
        ({**entry, "disk_bytes": 1}, "disk_bytes", "unknown key"),
        ({"disk_path": "/mnt/d"}, "disk_bytes_to_use", "is required"),
    ]:
        with pytest.raises(TierConfigError) as info:
            parse_tier_config(bad)
        assert info.value.key == key and fragment in str(info.value), str(info.value)
        assert "['secondary_tiers'][type=KvtierDiskTier]" in str(info.value)


# ------------------------------------------- kvtier's keys under another spec


@pytest.mark.parametrize(
    "extra,ignored",
    [
        # spec_name forgotten: vLLM's default, CPUOffloadingSpec, no disk tier
        ({**DISK, "spec_name": None}, "disk_bytes_to_use, disk_path"),
        (
            {**BASE, "spec_name": "CPUOffloadingSpec", "spill_watermark": 0.5},
            "spill_watermark",
        ),
    ],
    ids=["spec_name-missing", "vllm-cpu-spec"],
)
def test_kvtier_keys_under_a_spec_that_ignores_them_are_refused(
    extra: dict[str, Any], ignored: str
) -> None:
    """Under kvtier's connector a config without ``spec_name`` builds vLLM's
    CPUOffloadingSpec, which ignores kvtier's disk keys: the engine ran
    without its disk tier and said nothing. Refused, naming spec_name."""
    pytest.importorskip("vllm")
    from kvtier.connector.connector import _create_spec
    from kvtier.connector.spec import ConnectorFacts
    from kvtier.testing.offloading import offloading_config

    extra = {k: v for k, v in extra.items() if v is not None}
    extra.pop("spec_module_path", None)
    config = offloading_config(extra, worker_kv_bytes_per_block=4096)
    with pytest.raises(ConfigError) as info:
        _create_spec(config, ConnectorFacts())
    assert info.value.key == "spec_name", str(info.value)
    for fragment in (ignored, '"spec_name": "TieredOffloadingSpec"', "CPUOffloading"):
        assert fragment in str(info.value), (fragment, str(info.value))
    # vLLM's own keys alone: vLLM's spec is built as vLLM builds it.
    plain = {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1 << 20}
    spec = _create_spec(
        offloading_config(plain, worker_kv_bytes_per_block=4096), ConnectorFacts()
    )
    assert type(spec).__name__ == "CPUOffloadingSpec"


def test_a_disk_tier_smaller_than_the_cpu_tier_is_said_at_start(caplog) -> None:
    """A CPU block leaves its tier only once it is on disk, so a disk tier
    holding fewer blocks than the CPU tier starves the CPU tier (stores
    declined): the start says so, naming both keys; an equal or larger
    disk tier, or none, says nothing."""
    pytest.importorskip("vllm")
    from kvtier.connector.spec import warn_disk_smaller_than_cpu

    with caplog.at_level("WARNING", logger="vllm.kvtier.connector"):
        assert warn_disk_smaller_than_cpu(2000, 10)
        for disk_blocks in (0, 2000, 20000):
            assert not warn_disk_smaller_than_cpu(2000, disk_blocks)
    (said,) = {m for m in caplog.messages if "smaller than the CPU tier" in m}
    keys = ("disk_bytes_to_use", "cpu_bytes_to_use")
    for fragment in ("(10 blocks)", "(2000 blocks)", *keys):
        assert fragment in said, said


@pytest.mark.parametrize("name", ["TieredOffloadSpec", "TieredOffloadingConector"])
def test_a_misspelt_spec_or_connector_name_is_told_the_right_ones(name) -> None:
    """vLLM looks ``spec_name`` up in ``spec_module_path`` with getattr; a
    typo there gets kvtier's names and the fix, not a bare AttributeError."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    with pytest.raises(AttributeError) as info:
        OffloadingSpecFactory.get_spec_cls(
            {"spec_name": name, "spec_module_path": "kvtier.connector"}
        )
    message = str(info.value)
    assert repr(name) in message and "fix the name" in message
    assert '"spec_name"' in message and '"kv_connector"' in message


def test_tiering_modes_key_under_the_full_spec_says_which_mode_takes_it() -> None:
    """secondary_tiers under TieredOffloadingSpec was "unknown key"; it is
    tiering mode's, whose spec and module the message names."""
    entry = {"type": "KvtierDiskTier", "disk_path": "/mnt/d"}
    extra = {**DISK, "secondary_tiers": [entry]}
    told = str(_expect(extra, "secondary_tiers", "tiering mode"))
    assert '"PortableTieringSpec"' in told and "kvtier.connector.tiering" in told
    assert "takes disk_path and disk_bytes_to_use directly" in told


def test_a_missing_name_is_told_before_the_tiering_package_is_imported() -> None:
    """kvtier.connector's lookup of a missing name imports the tiering
    package for its message: done as ``from kvtier.connector import
    tiering`` it recursed into itself (RecursionError, not AttributeError)
    in a process that had not imported it yet."""
    import subprocess
    import sys

    code = (
        "import sys, kvtier.connector as c\n"
        "assert 'kvtier.connector.tiering' not in sys.modules\n"
        "print(hasattr(c, 'nope'))\n"
        "try:\n"
        "    c.KvtierDiskTier\n"
        "except AttributeError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "False"
    assert 'it is in "kvtier.connector.tiering"' in lines[1]
