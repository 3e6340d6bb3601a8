"""The benchmarks' own tools: the replay's equivalence hashes change with
any scheduler decision and with nothing else, the structure count counts
what it says, and the read throttle (a slow drive emulated) limits the
disk it names and puts back what was there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_TRACE = ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"


def _run(script: str, *args: str) -> None:
    env = dict(os.environ, PYTHONHASHSEED="0")
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        check=True,
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=300,
    )


def test_replay_hashes_repeat_and_follow_the_decisions(tmp_path):
    if not SHARED_TRACE.exists():
        pytest.skip(f"shared trace not found at {SHARED_TRACE}")
    runs = []
    for limit in ("300", "300", "301"):
        out = tmp_path / f"h{len(runs)}.json"
        _run(
            "replay_hash.py",
            "--trace",
            str(SHARED_TRACE),
            "--limit",
            limit,
            "--out",
            str(out),
        )
        runs.append(json.loads(out.read_text())["hashes"])
    assert len(runs[0]) == 7
    assert runs[0] == runs[1]  # the same replay, the same hashes
    # One more request: different decisions, every hash differs.
    assert all(runs[0][c] != runs[2][c] for c in runs[0])


def test_code_structure_counts_product_modules_only(tmp_path):
    pkg = tmp_path / "kvtier"
    (pkg / "store").mkdir(parents=True)
    (pkg / "testing").mkdir()
    (pkg / "__init__.py").write_text('"""x"""\n')
    (pkg / "store" / "__init__.py").write_text("")
    (pkg / "store" / "a.py").write_text("import os\nfrom kvtier.store import b\n")
    (pkg / "store" / "b.py").write_text("x = 1\ny = 2\nz = 3\n")
    (pkg / "testing" / "t.py").write_text("a = 1\n" * 50)
    out = tmp_path / "s.json"
    _run("code_structure.py", str(tmp_path), "--out", str(out))
    doc = json.loads(out.read_text())
    assert doc["total_lines"] == 1 + 0 + 2 + 3
    assert doc["files"] == 4
    assert doc["lines_per_package"] == {"(top)": 1, "store": 5}
    assert doc["folders"]["kvtier/store"] == {"files": 3, "lines": 5}
    assert doc["internal_imports_mean"] == 0.25


def _common(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import _common

    return _common


def test_block_device_of_names_the_whole_disk(tmp_path, monkeypatch):
    """The cgroup I/O controllers name whole disks: a path on a partition
    resolves to its disk; a path on no block device is refused."""
    common = _common(monkeypatch)
    st = os.stat(tmp_path)
    if not os.path.exists(
        f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    ):
        pytest.skip(f"{tmp_path} is on no block device")
    dev = common.block_device_of(str(tmp_path))
    node = f"/sys/dev/block/{dev}"
    assert os.path.isdir(node) and not os.path.exists(f"{node}/partition"), dev
    # The path's own device is that disk or one of its partitions.
    own = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    own_node = os.path.realpath(f"/sys/dev/block/{own}")
    assert own == dev or os.path.dirname(own_node) == os.path.realpath(node)
    if os.path.isdir("/dev/shm"):
        with pytest.raises(OSError, match="on no block device"):
            common.block_device_of("/dev/shm")


@pytest.mark.parametrize("op", ["read", "write"])
def test_io_throttle_sets_the_limit_and_puts_back_the_one_before(
    tmp_path, monkeypatch, op
):
    """The limit is in this cgroup's file while the block runs; on exit the
    rule before it is back (an outer limit, or none). Limits far above any
    drive's rate, so nothing else reading the disk meanwhile slows down."""
    common = _common(monkeypatch)
    try:
        dev = common.block_device_of(str(tmp_path))
        limit_file, kind = common._cgroup_limit_file(op)
    except OSError as exc:
        pytest.skip(str(exc))
    if not os.access(limit_file, os.W_OK):
        pytest.skip(f"{limit_file} is not writable here")

    def rule() -> str | None:
        with open(limit_file) as f:
            lines = [ln.split() for ln in f if ln.split()[:1] == [dev]]
        if not lines:
            return None
        if kind == "v1":
            return lines[0][1]
        key = "rbps=" if op == "read" else "wbps="
        bps = [x for x in lines[0] if x.startswith(key)]
        return bps[0].split("=")[1] if bps else None

    before = rule()
    outer, inner = 900_000_000_000, 800_000_000_000
    with common.io_throttle(str(tmp_path), outer, op) as named:
        assert named == dev and rule() == str(outer)
        with common.io_throttle(str(tmp_path), inner, op):
            assert rule() == str(inner)
        assert rule() == str(outer)
    assert rule() == before or (before is None and rule() in (None, "max"))


def test_procs_find_a_child_by_its_command_line():
    """``children`` and ``command`` (kvtier.testing.procs), with which the
    benchmarks and the release tests find an engine's processes: a child
    started here is listed under this process with its command line, and
    not once it exited."""
    from kvtier.testing.procs import children, command, descendants

    marker = "kvtier-procs-marker"
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()", marker],
        stdin=subprocess.PIPE,
    )
    try:
        assert child.pid in children(os.getpid())
        assert child.pid in descendants(os.getpid())
        assert marker in command(child.pid)
        assert os.getpid() not in children(os.getpid())
    finally:
        child.communicate(timeout=30)
    assert child.pid not in children(os.getpid())
    assert command(child.pid) is None
