"""``kvtier size --compare``: every policy next to the offline optimum."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.policy import policy_names
from kvtier.tools import sizing, sizing_compare
from kvtier.tools.cli import main


def _trace(path: Path, prefixes: list[list[int]]) -> str:
    with open(path, "w") as f:
        for i, ids in enumerate(prefixes):
            f.write(json.dumps({"timestamp": i, "hash_ids": ids}) + "\n")
    return str(path)


# A hot prefix reused after a scan of one-time prompts longer than the tier.
HOT = [1, 2, 3]
SCAN = [[100 + 10 * i, 101 + 10 * i] for i in range(4)]
PREFIXES = [HOT, *SCAN[:2], HOT, *SCAN[2:], HOT, HOT]


def test_size_compare_json_lists_every_policy_under_the_optimum(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _trace(tmp_path / "t.jsonl", PREFIXES)
    assert (
        main(["size", "--trace", trace, "--cpu-blocks", "4", "--compare", "--json"])
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    cmp = doc["comparison"]
    assert [p["cpu_policy"] for p in cmp["policies"]] == list(policy_names())
    assert cmp["optimal_hit_rate"] == pytest.approx(
        sizing_compare.trace_optimal_hit_rate(PREFIXES, 4)
    )
    for p in cmp["policies"]:
        assert p["hit_rate"] <= cmp["optimal_hit_rate"] + 1e-12
        assert p["fraction_of_optimum"] == pytest.approx(
            p["hit_rate"] / cmp["optimal_hit_rate"]
        )
    # The optimum keeps the hot prefix through the scan: 3 reuses x 3 blocks.
    assert cmp["optimal_hit_rate"] == pytest.approx(9 / sum(map(len, PREFIXES)))


def test_size_compare_with_disk_pairs_text_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    trace = _trace(tmp_path / "t.jsonl", PREFIXES)
    png = tmp_path / "cmp.png"
    argv = ["size", "--trace", trace, "--cpu-blocks", "2", "--disk-blocks", "3"]
    assert main([*argv, "--compare", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "optimum" in out and "one tier of 5 blocks" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
    pairs = {(r[0], r[1]) for r in rows if r[0] in policy_names()}
    assert pairs == {(c, d) for c in policy_names() for d in policy_names()}
    assert png.stat().st_size > 0


def test_size_compare_each_policy_matches_a_plain_replay(tmp_path: Path) -> None:
    cmp = sizing_compare.compare_policies(PREFIXES, 4, 0)
    for r in cmp.results:
        again = sizing.replay_trace(PREFIXES, 4, 0, r.cpu_policy)
        assert again.hit_rate == r.hit_rate
    assert max(r.hit_rate for r in cmp.results) <= cmp.optimal_hit_rate


@pytest.mark.parametrize("disk_policy", policy_names())
def test_a_replayer_names_its_disk_policy_before_the_first_spill(disk_policy) -> None:
    """The result names the disk tier's policy while that tier is still
    empty (an empty tier has len 0, not a missing one)."""
    h = TierHierarchy(4, 8, cpu_policy="lru", disk_policy=disk_policy)
    assert sizing.TraceReplayer(h).result.disk_policy == disk_policy
