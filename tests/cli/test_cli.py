"""The ``kvtier`` command line: size, inspect, verify, events.

``size`` is checked on synthetic traces whose hit rates follow by
construction and on the shared Mooncake trace; ``inspect``/``verify`` on real
DiskStore files; ``events`` against batches encoded exactly as vLLM's
publisher encodes them, sent over real ZMQ sockets on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from store_util import BLOCK_BYTES, fingerprint, key_of, write_store

from kvtier.store.slot import HEADER_SIZE
from kvtier.store.store import DiskStore
from kvtier.tools import sizing
from kvtier.tools.cli import main
from kvtier.tools.trace import (
    TraceRequest,
    infinite_cache_hit_rate,
    load_trace,
    unique_blocks,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_TRACE = REPO_ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"

A = [1, 2, 3, 4]
B = [11, 12, 13, 14]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(list(argv))
    return rc, capsys.readouterr().out


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    rc, out = run_cli(capsys, *argv, "--json")
    assert rc == 0, out
    return json.loads(out)


def write_trace(path: Path, prefixes: Sequence[Sequence[int]]) -> str:
    with open(path, "w") as f:
        for i, ids in enumerate(prefixes):
            rec = {
                "timestamp": i,
                "input_length": 512 * len(ids),
                "output_length": 1,
                "hash_ids": list(ids),
            }
            f.write(json.dumps(rec) + "\n")
    return str(path)


# ---------------------------------------------------------------------- size


@pytest.mark.parametrize(
    "cpu,disk,blocks",
    [
        # 1 KiB/token: one 512-token block is 512 KiB.
        ("2M", "1M", (4, 2)),  # vLLM's rule: upper case is binary (2 MiB)
        ("2m", "1m", (3, 1)),  # lower case decimal (2,000,000 B)
        ("2MiB", "1MB", (4, 1)),  # spelled out
        ("2097152", "0", (4, 0)),
    ],
)
def test_size_flags_read_sizes_as_vllm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cpu: str, disk: str, blocks
) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [A, B])
    argv = ["size", "--trace", trace, "--bytes-per-token", "1K"]
    doc = run_json(capsys, *argv, "--cpu-bytes", cpu, "--disk-bytes", disk)
    assert (doc["cpu_blocks"], doc["disk_blocks"]) == blocks
    assert doc["bytes_per_token"] == 1024


def test_size_repeated_prefix_hits_everything_after_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The same 4-block prompt 10 times: 4 misses, then 36 CPU hits.
    trace = write_trace(tmp_path / "t.jsonl", [A] * 10)
    for disk in ("0", "16"):
        doc = run_json(
            capsys, "size", "--trace", trace, "--cpu-blocks", "8", "--disk-blocks", disk
        )
        assert doc["requests"] == 10 and doc["blocks"] == 40
        assert doc["hit_rate"] == pytest.approx(36 / 40)
        assert doc["hit_rate_cpu"] == pytest.approx(36 / 40)
        assert doc["hit_rate_disk"] == 0.0
        assert doc["infinite_hit_rate"] == pytest.approx(36 / 40)


def test_size_disk_tier_catches_what_cpu_evicts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # CPU holds one 4-block prefix. Pattern A A B B, 4 times (64 blocks):
    # the repeat of each prefix hits on CPU (8 per cycle -> 32 = 0.5) in both
    # setups; the first request of a prefix from cycle 2 on misses without a
    # disk tier but hits on disk with one (8 per cycle x 3 = 24 -> 0.375).
    # Watermark 0 spills everything at once, so loads of disk hits always
    # find a clean CPU row to copy the block up into.
    trace = write_trace(tmp_path / "t.jsonl", [A, A, B, B] * 4)
    common = ("size", "--trace", trace, "--cpu-blocks", "4", "--spill-watermark", "0")
    cpu_only = run_json(capsys, *common)
    tiered = run_json(capsys, *common, "--disk-blocks", "8")

    assert cpu_only["blocks"] == tiered["blocks"] == 64
    assert (cpu_only["hit_rate_cpu"], cpu_only["hit_rate_disk"]) == (0.5, 0.0)
    assert (tiered["hit_rate_cpu"], tiered["hit_rate_disk"]) == (0.5, 0.375)
    assert tiered["hit_rate"] == tiered["infinite_hit_rate"] == 0.875
    assert tiered["promotions"] == 24  # every disk hit also went up to CPU


def test_size_replays_promote_on_hit_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A A A B B B, 3 times, CPU one prefix, disk two. From cycle 2 on, with
    # promotion: A from disk (and up to CPU, evicting B), A A from CPU, B
    # likewise: 8 disk + 16 CPU blocks a cycle. Without (the engine's
    # promote_on_hit: false): A never comes back to CPU, so every A is a
    # disk hit and B never leaves CPU: 12 + 12. Cycle 1: 16 CPU hits.
    trace = write_trace(tmp_path / "t.jsonl", [A, A, A, B, B, B] * 3)
    common = ("size", "--trace", trace, "--cpu-blocks", "4", "--disk-blocks", "8")
    common += ("--spill-watermark", "0")
    on = run_json(capsys, *common, "--promote-on-hit")
    off = run_json(capsys, *common, "--no-promote-on-hit")
    assert (on["promote_on_hit"], off["promote_on_hit"]) == (True, False)
    assert (on["hit_blocks_cpu"], on["hit_blocks_disk"], on["promotions"]) == (
        48,
        16,
        16,
    )
    assert (off["hit_blocks_cpu"], off["hit_blocks_disk"], off["promotions"]) == (
        40,
        24,
        0,
    )
    rc, out = run_cli(capsys, *common, "--no-promote-on-hit")
    assert rc == 0 and "disk hits not promoted" in out


def test_size_alternating_prefixes_only_disk_hits(tmp_path: Path) -> None:
    # A B A B ...: CPU-only never hits; with disk every request after the
    # first two hits all 4 blocks on disk.
    reqs = [A, B] * 5
    cpu_only = sizing.replay_trace(reqs, 4, 0, spill_watermark=0.0)
    tiered = sizing.replay_trace(reqs, 4, 8, spill_watermark=0.0)
    assert cpu_only.hit_blocks == 0
    assert (tiered.hit_blocks_cpu, tiered.hit_blocks_disk) == (0, 32)
    assert (
        tiered.hit_rate
        == pytest.approx(0.8)
        == infinite_cache_hit_rate(
            [TraceRequest(0, 0, 0, tuple(r)) for r in reqs]
        )
    )


def test_size_policy_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [A, B, A])
    base = ("size", "--trace", trace, "--cpu-blocks", "4", "--disk-blocks", "8")
    doc = run_json(capsys, *base, "--policy", "arc")
    assert (doc["cpu_policy"], doc["disk_policy"]) == ("arc", "arc")
    doc = run_json(capsys, *base, "--policy", "arc", "--cpu-policy", "lru")
    assert (doc["cpu_policy"], doc["disk_policy"]) == ("lru", "arc")
    # Any case, as the config's eviction_policy takes it.
    doc = run_json(capsys, *base, "--policy", "ARC", "--disk-policy", "2Q")
    assert (doc["cpu_policy"], doc["disk_policy"]) == ("arc", "2q")


def test_size_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [A])
    assert main(["size", "--trace", trace]) == 2
    assert main(["size", "--trace", trace, "--cpu-bytes", "1GiB"]) == 2
    assert (
        main(["size", "--trace", str(tmp_path / "missing"), "--cpu-blocks", "4"]) == 2
    )


def test_size_bytes_form_converts_and_recommends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [A, B] * 5)
    # 1 KiB/token -> 512 KiB per 512-token block: 2 MiB = 4 blocks, 1 MiB = 2.
    doc = run_json(
        capsys,
        "size",
        "--trace",
        trace,
        "--bytes-per-token",
        "1024",
        "--cpu-bytes",
        "2MiB",
        "--disk-bytes",
        "1MiB",
        "--spill-watermark",
        "0",
    )
    assert (doc["cpu_blocks"], doc["disk_blocks"]) == (4, 2)
    assert doc["cpu_bytes"] == 4 * 512 * 1024
    rec = doc["recommendation"]
    assert rec["target_hit_rate"] == pytest.approx(0.95 * 0.8)
    d = rec["disk_blocks"]
    assert d is not None and rec["disk_bytes"] == d * 512 * 1024
    # The recommended size meets the target; one block less does not.
    reqs = load_trace(trace)
    at = sizing.replay_trace(reqs, 4, d, spill_watermark=0.0)
    below = sizing.replay_trace(reqs, 4, d - 1, spill_watermark=0.0)
    assert at.hit_rate >= rec["target_hit_rate"] > below.hit_rate
    assert rec["hit_rate"] == pytest.approx(at.hit_rate)


@pytest.mark.parametrize(
    "sizes",
    [
        ("--cpu-blocks", str(10**25)),  # more than an index: was an OverflowError
        ("--cpu-blocks", "4", "--disk-blocks", str(10**25)),
        # 2 TiB of disk at a mistyped 1 byte/token: 2**32 blocks, whose 2q
        # doorkeeper alone was ~200 GiB (a MemoryError, or the OOM killer).
        ("--cpu-blocks", "4", "--disk-bytes", "2T", "--bytes-per-token", "1"),
    ],
)
@pytest.mark.parametrize("extra", [(), ("--compare",)])
def test_size_tier_larger_than_the_trace_replays_as_never_evicting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sizes, extra
) -> None:
    # A B A A B: 8 distinct blocks. A tier of any size >= 8 never evicts,
    # so it gets the hits of an 8-block tier, reported at the size given.
    trace = write_trace(tmp_path / "t.jsonl", [A, B, A, A, B])
    doc = run_json(capsys, "size", "--trace", trace, "--policy", "2q", *sizes, *extra)
    huge_cpu = sizes[1] != "4"
    exact = sizing.replay_trace(load_trace(trace), 8 if huge_cpu else 4, 8, "2q", "2q")
    assert doc["hit_blocks"] == exact.hit_blocks == 12  # the bound: 12 / 20
    assert (doc["hit_blocks_cpu"], doc["hit_blocks_disk"]) == (
        exact.hit_blocks_cpu,
        exact.hit_blocks_disk,
    )
    given = int(sizes[1]) if huge_cpu else 4
    assert doc["cpu_blocks"] == given
    if not huge_cpu:
        disk = int(sizes[3]) if "--disk-blocks" in sizes else 2**41 // 512
        assert doc["disk_blocks"] == disk
    if extra:
        cmp = doc["comparison"]
        assert cmp["optimal_hit_rate"] == pytest.approx(12 / 20)
        assert all(p["hit_rate"] == pytest.approx(12 / 20) for p in cmp["policies"])


def test_replay_trace_caps_a_tier_at_the_traces_distinct_blocks(
    tmp_path: Path,
) -> None:
    # The cap is replay_trace's own, so every caller (kvtier size, its
    # sweep and --compare, the benchmarks) gets it; a generator is read once.
    reqs = load_trace(write_trace(tmp_path / "t.jsonl", [A, B, A, A, B]))
    exact = sizing.replay_trace(reqs, 8, 8, "arcdk", "2q")
    huge = sizing.replay_trace(iter(reqs), 10**25, 2**32, "arcdk", "2q")
    assert (huge.cpu_blocks, huge.disk_blocks) == (10**25, 2**32)
    assert (huge.hit_blocks_cpu, huge.hit_blocks_disk, huge.blocks) == (
        exact.hit_blocks_cpu,
        exact.hit_blocks_disk,
        exact.blocks,
    )
    assert huge.blocks == 20


def test_size_text_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [A, A, B, B] * 3)
    png = tmp_path / "sweep.png"
    rc, out = run_cli(
        capsys,
        "size",
        "--trace",
        trace,
        "--cpu-blocks",
        "4",
        "--disk-blocks",
        "8",
        "--plot",
        str(png),
    )
    assert rc == 0
    assert "hit rate" in out and "infinite cache" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("compare", [False, True])
def test_size_plot_without_extension_is_png_at_that_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], compare: bool
) -> None:
    """No extension means PNG, written to the path given (the one checked
    before the replay and reported), not to PATH.png."""
    pytest.importorskip("matplotlib")
    trace = write_trace(tmp_path / "t.jsonl", [A, A, B, B] * 3)
    plot = tmp_path / "sweep"
    argv = ["size", "--trace", trace, "--cpu-blocks", "4", "--disk-blocks", "8"]
    rc, out = run_cli(
        capsys,
        *argv,
        *(["--compare"] if compare else []),
        "--plot",
        str(plot),
        "--json",
    )
    assert rc == 0 and json.loads(out)["plot"] == str(plot)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep", "t.jsonl"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_infinite_cache_definition(tmp_path: Path) -> None:
    # Blocks seen before count as hits, wherever they are in the request.
    reqs = [TraceRequest(0, 0, 0, ids) for ids in [(1, 2), (1, 3), (4, 2)]]
    assert infinite_cache_hit_rate(reqs) == pytest.approx(2 / 6)
    assert unique_blocks(reqs) == 4


def _shared_trace() -> str:
    if not SHARED_TRACE.exists():
        pytest.skip(f"shared trace not found at {SHARED_TRACE}")
    return str(SHARED_TRACE)


def test_size_real_trace_infinite_capacity_reproduces_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The whole trace (3,993 requests) replays in well under a second when
    # nothing is ever evicted.
    doc = run_json(
        capsys, "size", "--trace", _shared_trace(), "--cpu-blocks", "1000000"
    )
    assert doc["requests"] == 3993
    assert doc["hit_rate"] == pytest.approx(0.640, abs=0.001)
    assert doc["hit_rate"] == pytest.approx(doc["infinite_hit_rate"])
    assert doc["hit_rate_disk"] == 0.0


def test_size_real_trace_disk_tier_adds_hits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A prefix (1,500 requests): a CPU+disk replay costs ~0.3 s there while
    # the whole trace takes ~13 s (see docs/benchmarks.md).
    base = (
        "size",
        "--trace",
        _shared_trace(),
        "--limit",
        "1500",
        "--cpu-blocks",
        "1024",
    )
    cpu_only = run_json(capsys, *base)
    tiered = run_json(capsys, *base, "--disk-blocks", "8192")
    assert cpu_only["hit_rate_disk"] == 0.0
    assert tiered["hit_rate_disk"] > 0.05
    assert tiered["hit_rate"] > cpu_only["hit_rate"] + 0.05
    assert tiered["hit_rate"] <= tiered["infinite_hit_rate"]
    assert tiered["hit_rate"] == pytest.approx(
        tiered["hit_rate_cpu"] + tiered["hit_rate_disk"]
    )


# ----------------------------------------------------------- inspect/verify


def _tree(root: Path) -> dict[str, tuple[int, int, str]]:
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        out[str(p)] = (st.st_mode, st.st_mtime_ns, digest)
    return out


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_inspect_and_verify_real_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], compression: str
) -> None:
    store = write_store([str(tmp_path)], n=5, compression=compression)
    before = _tree(tmp_path)

    doc = run_json(capsys, "inspect", str(tmp_path))
    (rep,) = doc["stores"]
    assert rep["blocks"] == 5 and rep["used_slots"] == 5 and rep["total_slots"] == 8
    assert rep["fill"] == pytest.approx(5 / 8)
    assert rep["raw_bytes"] == 5 * BLOCK_BYTES
    if compression == "zstd":
        assert rep["payload_bytes"] < rep["raw_bytes"]
    assert rep["fingerprints"] == {fingerprint().digest().hex(): 5}
    assert rep["format_version"] == 1 and rep["header_format_versions"] == {"2": 5}
    assert rep["reader_header_versions"] == [1, 2, 3]
    assert rep["after_reset_blocks"] == 0
    assert rep["layout"]["model"] == "test/model"

    rc, out = run_cli(capsys, "verify", str(tmp_path))
    assert rc == 0 and "5 ok, 0 bad" in out
    assert _tree(tmp_path) == before  # neither command created or changed anything

    # The text report names the format version and the header versions read
    # apart: version 2 headers are read, so it must not say "reads v1" only.
    rc, out = run_cli(capsys, "inspect", str(tmp_path))
    (line,) = [ln for ln in out.splitlines() if "format version" in ln]
    assert line.split(None, 2)[2] == (
        "1 (layout.json); headers: v2 x5; "
        "this kvtier reads format v1, header versions v1, v2, v3"
    )
    assert "after a reset" not in out

    # Corrupt one payload byte of slot 3: exactly that slot is reported.
    slab = store.slabs[0]
    _flip(slab.path, slab.offset(3) + HEADER_SIZE + 17)
    rc, out = run_cli(capsys, "verify", "--json", str(tmp_path))
    assert rc == 1
    bad = json.loads(out)["stores"][0]["bad"]
    assert [(b["slot"], b["reason"]) for b in bad] == [(3, "checksum_mismatch")]
    assert bad[0]["key"] == key_of(3).hex()
    rc, out = run_cli(capsys, "verify", str(tmp_path))
    assert rc == 1 and "slot 3: checksum_mismatch" in out


def test_inspect_counts_blocks_written_after_a_reset_and_verify_passes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Blocks written after a connector reset are valid (version 3 headers,
    verified like any other) and counted apart: a restart never adopts
    them."""
    store = DiskStore(
        [str(tmp_path)], 8, BLOCK_BYTES, fingerprint(BLOCK_BYTES), backend="posix"
    )
    data = np.arange(BLOCK_BYTES, dtype=np.uint64).astype(np.uint8)
    store.write_block(0, key_of(0), data, store.next_seq())
    store.mark_reset()
    for i in (1, 2):
        store.write_block(i, key_of(i), data, store.next_seq())
    store.close()
    rep = run_json(capsys, "inspect", str(tmp_path))["stores"][0]
    assert rep["blocks"] == 3 and rep["after_reset_blocks"] == 2
    assert rep["header_format_versions"] == {"2": 1, "3": 2}
    rc, out = run_cli(capsys, "inspect", str(tmp_path))
    (line,) = [ln for ln in out.splitlines() if "after a reset" in ln]
    assert "2 of the valid blocks were written after a connector reset" in line
    rc, out = run_cli(capsys, "verify", str(tmp_path))
    assert rc == 0 and "3 ok, 0 bad" in out


def test_verify_reports_bad_header_and_inspect_counts_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = write_store([str(tmp_path)], n=4)
    slab = store.slabs[0]
    _flip(slab.path, slab.offset(1) + 40)  # inside the key: header checksum fails
    store_dir = store.dirs[0]  # a kvtier-<digest> directory works as PATH too
    rep = run_json(capsys, "inspect", store_dir)["stores"][0]
    assert rep["blocks"] == 3 and rep["used_slots"] == 4
    assert rep["outcomes"] == {"bad_header": 1, "empty": 4, "ok": 3}
    rc, out = run_cli(capsys, "verify", "--json", store_dir)
    assert rc == 1
    assert [(b["slot"], b["reason"]) for b in json.loads(out)["stores"][0]["bad"]] == [
        (1, "bad_header")
    ]


def test_verify_multi_path_store_uses_global_slots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    store = write_store(paths, n=6, slots=8)
    doc = run_json(capsys, "inspect", *paths)
    (rep,) = doc["stores"]  # one store, striped over two slabs
    assert rep["blocks"] == 6 and rep["total_slots"] == 8 and len(rep["slabs"]) == 2
    # Global slot 3 lives in path 1, local slot 1.
    _flip(store.slabs[1].path, store.slabs[1].offset(1) + HEADER_SIZE)
    rc, out = run_cli(capsys, "verify", "--json", *paths)
    assert rc == 1
    bad = json.loads(out)["stores"][0]["bad"]
    assert [(b["slot"], b["local_slot"], b["reason"]) for b in bad] == [
        (3, 1, "checksum_mismatch")
    ]


def test_verify_fails_on_a_slab_cut_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A slab truncated to whole slots looked like a smaller, clean store
    (every slot left checked ok, exit 0) while the blocks past its end were
    gone: layout.json's ``slots`` says what the slabs were made to hold.
    Seven slots over two paths: slab 0 holds 4, slab 1 holds 3."""
    paths = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    store = write_store(paths, n=6, slots=7)
    rc, out = run_cli(capsys, "verify", *paths)
    assert rc == 0 and "6 ok, 0 bad" in out and "cut short" not in out
    slab = store.slabs[1]
    os.truncate(slab.path, slab.offset(1))  # keeps local slot 0 (global 1)
    rc, out = run_cli(capsys, "verify", "--json", *paths)
    doc = json.loads(out)
    assert rc == 1 and not doc["ok"] and doc["short_slabs"] == 1
    (rep,) = doc["stores"]
    assert rep["checked"] == rep["ok"] == 4 and not rep["bad"]
    (short,) = rep["short_slabs"]
    assert short.startswith(slab.path) and "holds 1 of the 3 slots" in short
    assert "the other 2 are lost" in short
    rc, out = run_cli(capsys, "verify", *paths)
    assert rc == 1 and "1 slab(s) cut short" in out and "are lost" in out


def test_inspect_missing_path_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    assert main(["inspect", str(missing)]) == 2
    assert main(["verify", str(missing)]) == 2
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["inspect", str(empty)]) == 2
    assert list(empty.iterdir()) == []


# -------------------------------------------------------------------- events


def _vllm_batches() -> tuple[list[bytes], dict[str, dict[str, int]]]:
    """Two KVEventBatch payloads encoded as ZmqEventPublisher does, and the
    per-medium block counts they carry."""
    import msgspec

    kv = pytest.importorskip("vllm.distributed.kv_events")

    def stored(n: int, medium: str | None) -> Any:
        return kv.BlockStored(
            block_hashes=[bytes([i]) * 32 for i in range(n)],
            parent_block_hash=None,
            token_ids=list(range(16 * n)),
            block_size=16,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )

    def removed(n: int, medium: str | None) -> Any:
        return kv.BlockRemoved(block_hashes=list(range(n)), medium=medium)

    batches = [
        kv.KVEventBatch(
            ts=1.0,
            events=[
                stored(3, "CPU"),
                stored(2, "STORAGE"),
                stored(4, "GPU"),
                stored(1, None),
            ],
        ),
        kv.KVEventBatch(
            ts=2.0,
            events=[removed(1, "CPU"), removed(2, "STORAGE"), kv.AllBlocksCleared()],
            data_parallel_rank=0,
        ),
    ]
    enc = msgspec.msgpack.Encoder()
    expected = {
        "gpu": {"stored": 5, "removed": 0, "stored_events": 2, "removed_events": 0},
        "cpu": {"stored": 3, "removed": 1, "stored_events": 1, "removed_events": 1},
        "disk": {"stored": 2, "removed": 2, "stored_events": 1, "removed_events": 1},
    }
    return [enc.encode(b) for b in batches], expected


def test_decoders_agree_on_vllm_payloads() -> None:
    from kvtier.tools.events_sub import BatchDecoder, EventCounts, decode_plain

    payloads, expected = _vllm_batches()
    typed = BatchDecoder("vllm")
    assert typed.kind == "vllm"
    for decode in (typed.decode, decode_plain):
        counts = EventCounts()
        for p in payloads:
            counts.add(decode(p))
        assert counts.to_dict()["media"] == expected
        assert counts.cleared == 1 and counts.events == 7
    assert typed.fallbacks == 0


def _run_events_cli(argv: list[str]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def target() -> None:
        box["rc"] = main(argv)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


@pytest.mark.parametrize("decoder", ["vllm", "plain"])
def test_events_cli_counts_published_batches(
    capsys: pytest.CaptureFixture[str], decoder: str
) -> None:
    import zmq

    payloads, expected = _vllm_batches()
    ctx = zmq.Context()
    # XPUB is a PUB socket that also hands us subscriptions, so the batches
    # are sent only once the CLI is listening (no slow-joiner loss).
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.RCVTIMEO, 30_000)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    capsys.readouterr()
    t, box = _run_events_cli(
        [
            "events",
            "--endpoint",
            f"tcp://127.0.0.1:{port}",
            "--json",
            "--decoder",
            decoder,
            "--max-batches",
            "2",
            "--duration",
            "120",
        ]
    )
    try:
        assert pub.recv() == b"\x01"  # subscribe-all from the CLI
        for seq, payload in enumerate(payloads):
            pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
        t.join(timeout=120)
    finally:
        pub.close(linger=0)
        ctx.term()
    assert not t.is_alive() and box.get("rc") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["media"] == expected
    assert doc["batches"] == 2 and doc["all_blocks_cleared"] == 1
    assert doc["decode_errors"] == 0 and doc["seq_gaps"] == 0
    assert doc["decoder"] == decoder


def test_events_cli_with_vllm_publisher(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's own ZmqEventPublisher, connecting to the CLI's bound socket."""
    kv = pytest.importorskip("vllm.distributed.kv_events")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    capsys.readouterr()
    t, box = _run_events_cli(
        [
            "events",
            "--endpoint",
            endpoint,
            "--bind",
            "--json",
            "--max-batches",
            "1",
            "--duration",
            "120",
        ]
    )
    pub = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint)
    deadline = time.monotonic() + 120
    try:
        # PUB drops batches until the CLI's subscription has arrived, so keep
        # publishing identical batches until the CLI has counted one.
        while t.is_alive():
            assert time.monotonic() < deadline, "the CLI never counted a batch"
            pub.publish(
                kv.KVEventBatch(
                    ts=0.0,
                    events=[
                        kv.BlockStored(
                            block_hashes=[7, 8],
                            parent_block_hash=None,
                            token_ids=[],
                            block_size=16,
                            lora_id=None,
                            medium="STORAGE",
                            lora_name=None,
                        ),
                        kv.BlockRemoved(block_hashes=[9], medium="CPU"),
                    ],
                )
            )
            t.join(timeout=0.05)
    finally:
        pub.shutdown()
    assert not t.is_alive() and box.get("rc") == 0
    doc = json.loads(capsys.readouterr().out)
    n = doc["batches"]
    assert n >= 1 and doc["decode_errors"] == 0
    assert doc["media"]["disk"] == {
        "stored": 2 * n,
        "removed": 0,
        "stored_events": n,
        "removed_events": 0,
    }
    assert doc["media"]["cpu"]["removed"] == n and doc["media"]["gpu"]["stored"] == 0


def test_events_cli_duration_bound_without_publisher(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, out = run_cli(
        capsys,
        "events",
        "--endpoint",
        f"tcp://127.0.0.1:{port}",
        "--duration",
        "0.2",
        "--decoder",
        "plain",
        "--json",
    )
    assert rc == 0
    doc = json.loads(out)
    assert doc["batches"] == 0
    assert all(c["stored"] == 0 for c in doc["media"].values())


def test_events_cli_duration_counts_from_listening(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--duration is time listened: vLLM's decoder classes import in
    seconds, and the clock started before them, so "--duration 2" listened
    for none of its 2 s and reported the import's 6 s. Here the (real)
    decoder takes 2 s to build; the summary's seconds are the 0.3 s
    listened (and a drain), not the 2.3 s since the command started."""
    from kvtier.tools import events_sub

    real = events_sub.BatchDecoder

    def slow(kind: str) -> events_sub.BatchDecoder:
        time.sleep(2.0)  # as vLLM's import does
        return real(kind)

    monkeypatch.setattr(events_sub, "BatchDecoder", slow)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    argv = ["events", "--endpoint", endpoint, "--duration", "0.3", "--json"]
    rc, out = run_cli(capsys, *argv, "--decoder", "plain")
    seconds = json.loads(out)["seconds"]
    assert rc == 0 and 0.3 <= seconds < 2.0, seconds


def test_events_cli_stops_on_sigterm_with_its_summary_even_if_sigint_is_ignored(
    tmp_path: Path,
) -> None:
    """A watch started where SIGINT is ignored (a shell's background job)
    still stops on SIGTERM, exits 0 and prints its summary."""
    import os
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli = subprocess.Popen(
        [sys.executable, "-m", "kvtier.tools.cli", "events", "--endpoint",
         f"tcp://127.0.0.1:{port}", "--bind", "--json", "--progress",
         "--decoder", "plain", "--duration", "600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    watchdog = threading.Timer(120, cli.kill)  # a CLI that never listens
    watchdog.start()
    try:
        assert cli.stderr is not None
        line = cli.stderr.readline()  # the CLI says so once it listens
        assert "listening on" in line, line
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=60) == 0
        doc = json.loads(cli.stdout.read())
        assert doc["batches"] == 0 and doc["endpoint"].endswith(str(port))
    finally:
        watchdog.cancel()
        if cli.poll() is None:
            cli.kill()
