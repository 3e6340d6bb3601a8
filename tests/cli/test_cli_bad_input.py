"""Bad input to the ``kvtier`` command: one line on stderr naming the
problem, exit status 2, no traceback and no hang.

Every case runs ``python -m kvtier.tools.cli`` in a subprocess with a timeout, so
a hang fails the test instead of stalling the suite; ``kvtier events`` is
fed malformed messages over a real ZMQ socket on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.store.slot import LayoutFingerprint
from kvtier.store.store import DiskStore

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60  # seconds for any one command; all of them take about one


def kvtier(*argv: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run(
        [sys.executable, "-m", "kvtier.tools.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def assert_usage_error(p: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2 and exactly one stderr line that contains every needle."""
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ---------------------------------------------------------------------- size

GOOD = (
    '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n'
)


def _trace(tmp: Path, text: str | bytes, name: str = "t.jsonl") -> str:
    path = tmp / name
    if isinstance(text, str):
        path.write_text(text)
    else:
        path.write_bytes(text)
    return str(path)


def _size(trace: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return kvtier("size", "--trace", trace, "--cpu-blocks", "4", *extra)


TRACE_CASES: dict[str, tuple[str | bytes, list[str]]] = {
    # name: (file content, what the error line must say)
    "hash id 1e400": ('{"hash_ids": [1, 1e400]}\n', [":1:", "hash id #1", "inf"]),
    "hash id string": ('{"hash_ids": ["12"]}\n', [":1:", "not an integer"]),
    "hash id float": ('{"hash_ids": [3.5]}\n', [":1:", "not an integer"]),
    "hash id 2**64": (
        '{"hash_ids": [18446744073709551616]}\n',
        [":1:", "not in [0, 2**64)"],
    ),
    "hash id negative": ('{"hash_ids": [-1]}\n', [":1:", "not in [0, 2**64)"]),
    "hash id 5000 digits": (
        '{"hash_ids": [' + "9" * 5000 + "]}\n",
        [":1:"],
    ),
    "bad third line": (GOOD + "\n" + '{"hash_ids": [1e400]}\n', [":3:", "hash id"]),
    "not json": ("hello\n", [":1:"]),
    "hash_ids not a list": ('{"hash_ids": "123"}\n', [":1:", "must be a list"]),
    "no hash_ids": ('{"timestamp": 1}\n', [":1:", "no 'hash_ids'"]),
    "not an object": ("[1, 2]\n", [":1:", "expected a JSON object"]),
    "input_length 1e400": (
        '{"hash_ids": [1], "input_length": 1e400}\n',
        [":1:", "input_length"],
    ),
    "deep nesting": ('{"hash_ids": ' + "[" * 100_000 + "]" * 100_000 + "}\n", [":1:"]),
    "empty": ("", ["no trace records"]),
    "no newline, 5 MiB": (b"x" * (5 << 20), [":1:", "line longer than"]),
}


@pytest.mark.parametrize("case", list(TRACE_CASES))
def test_size_rejects_bad_trace(tmp_path: Path, case: str) -> None:
    text, needles = TRACE_CASES[case]
    p = _size(_trace(tmp_path, text))
    assert_usage_error(p, "kvtier size: cannot read trace", *needles)


def test_size_rejects_devices_directories_and_missing(tmp_path: Path) -> None:
    assert_usage_error(_size("/dev/zero"), "/dev/zero: is a character device")
    assert_usage_error(_size(str(tmp_path)), "is a directory")
    assert_usage_error(_size(str(tmp_path / "nope")), "No such file")


def test_size_refuses_a_fifo_promptly(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    p = _size(str(fifo))  # TimeoutExpired (a failure) if opening it blocked
    assert_usage_error(p, "is a FIFO, not a regular trace file")


ARG_CASES: dict[str, tuple[list[str], list[str]]] = {
    "watermark 5": (["--spill-watermark", "5"], ["--spill-watermark", "[0, 1]"]),
    "watermark nan": (["--spill-watermark", "nan"], ["--spill-watermark", "finite"]),
    "watermark -0.1": (["--spill-watermark", "-0.1"], ["--spill-watermark"]),
    "target 2": (["--target", "2"], ["--target", "(0, 1]"]),
    "target 0": (["--target", "0"], ["--target", "(0, 1]"]),
    "target abc": (["--target", "abc"], ["--target", "not a number"]),
    "bytes per token 0": (
        ["--bytes-per-token", "0"],
        ["--bytes-per-token", "must be > 0"],
    ),
    "cpu bytes 400 digits": (
        ["--bytes-per-token", "1", "--cpu-bytes", "9" * 400],
        ["--cpu-bytes", "too large"],
    ),
    "disk blocks abc": (["--disk-blocks", "abc"], ["--disk-blocks", "not an integer"]),
    "limit 0": (["--limit", "0"], ["--limit", "must be > 0"]),
}


@pytest.mark.parametrize("case", list(ARG_CASES))
def test_size_rejects_bad_arguments(tmp_path: Path, case: str) -> None:
    argv, needles = ARG_CASES[case]
    p = _size(_trace(tmp_path, GOOD), *argv)
    assert_usage_error(p, "kvtier size: error: argument", *needles)


@pytest.mark.parametrize(
    "flag,argv",
    [
        # 1 KiB/token: a 512-token block is 512 KiB. The disk budget used to
        # become a disk tier of 0 blocks without a word (the engine refuses
        # such a disk_bytes_to_use), the CPU one an error not naming its flag.
        ("--disk-bytes", ["--cpu-blocks", "4", "--disk-bytes", "100K"]),
        ("--cpu-bytes", ["--cpu-bytes", "100K"]),
    ],
)
def test_size_budget_holding_no_block_is_an_error_naming_its_flag(
    tmp_path: Path, flag: str, argv: list[str]
) -> None:
    p = kvtier(
        "size", "--trace", _trace(tmp_path, GOOD), "--bytes-per-token", "1K", *argv
    )
    line = assert_usage_error(p, "kvtier size:", f"{flag} 102400", "512.0 KiB")
    assert f"raise {flag}" in line


def test_size_checks_plot_path_before_reading_the_trace(tmp_path: Path) -> None:
    # /dev/zero as the trace: the --plot error must come first, i.e. before
    # the trace is read, let alone replayed.
    cases = {
        str(tmp_path / "no" / "such" / "dir.png"): "No such file or directory",
        str(tmp_path): "is a directory",
        str(tmp_path / "plot.xyz"): "unknown image format 'xyz'",
    }
    for plot, needle in cases.items():
        p = _size("/dev/zero", "--plot", plot)
        assert_usage_error(p, "kvtier size: --plot", needle)
    assert sorted(os.listdir(tmp_path)) == []  # the check leaves nothing behind


# ----------------------------------------------------------- inspect/verify

BLOCK_BYTES = 64 * 1024
SLOT = 69632  # slot_size(64 KiB): 4 KiB header + payload


@pytest.fixture(scope="module")
def good_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kvtier-<digest> directory: layout.json and one slab, 3 of 8 slots
    written."""
    root = tmp_path_factory.mktemp("store")
    fp = LayoutFingerprint("m", "bf16", BLOCK_BYTES, "g", 0, 1)
    store = DiskStore([str(root)], 8, BLOCK_BYTES, fp, backend="posix")
    for i in range(3):
        data = np.full(BLOCK_BYTES, i, np.uint8)
        store.write_block(i, bytes([i]) * 36, data, store.next_seq())
    store.close()
    (d,) = store.dirs
    return Path(d)


def _copy(good: Path, tmp: Path) -> Path:
    d = tmp / good.name
    shutil.copytree(good, d)
    return d


def _edit_layout(**changes: Any) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        doc = json.loads((d / "layout.json").read_text())
        doc.update(changes)
        (d / "layout.json").write_text(json.dumps(doc))

    return edit


def _fifo_slab(d: Path) -> None:
    (d / "slab-0.kvt").rename(d / "moved")
    os.mkfifo(d / "slab-0.kvt")


def _fifo_layout(d: Path) -> None:
    (d / "layout.json").unlink()
    os.mkfifo(d / "layout.json")


def _symlink_slab(d: Path) -> None:
    (d / "slab-0.kvt").rename(d / "real")
    (d / "slab-0.kvt").symlink_to("real")


def _no_slabs(d: Path) -> None:
    (d / "slab-0.kvt").unlink()


def _empty_slab(d: Path) -> None:
    os.truncate(d / "slab-0.kvt", 0)


def _short_slab(d: Path) -> None:
    os.truncate(d / "slab-0.kvt", 4096)


def _unknown_geometry(d: Path) -> None:
    (d / "layout.json").unlink()
    with open(d / "slab-0.kvt", "r+b") as f:
        f.write(bytes(4096))  # slot 0 now empty: no header to infer from


STORE_CASES: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "FIFO named like a slab": (_fifo_slab, ["slab-0.kvt", "not a regular file (FIFO)"]),
    "FIFO layout.json": (_fifo_layout, ["layout.json", "not a regular file (FIFO)"]),
    "symlinked slab": (_symlink_slab, ["slab-0.kvt", "symbolic link"]),
    "slot_size 1": (_edit_layout(slot_size=1), ["slot_size 1 is impossible"]),
    "negative slot_size": (
        _edit_layout(slot_size=-SLOT),
        [f"slot_size {-SLOT} is impossible"],
    ),
    "unaligned slot_size": (
        _edit_layout(slot_size=SLOT + 1),
        [f"slot_size {SLOT + 1} is impossible"],
    ),
    "absurd slot_size": (_edit_layout(slot_size=1 << 60), ["is impossible"]),
    "slot_size mismatch": (
        _edit_layout(slot_size=8192),
        ["slot_size 8192 does not match block_bytes 65536", str(SLOT)],
    ),
    "slot_size string": (_edit_layout(slot_size="69632"), ["not an integer"]),
    "block_bytes 0": (_edit_layout(block_bytes=0), ["block_bytes 0 is not within"]),
    "block_bytes bool": (_edit_layout(block_bytes=True), ["not an integer"]),
    "no slabs": (_no_slabs, ["no slab-<n>.kvt file"]),
    "empty slab": (_empty_slab, ["every slab is empty"]),
    "slab smaller than a slot": (_short_slab, ["smaller than one slot"]),
    "unknown geometry": (_unknown_geometry, ["slot size unknown"]),
}


@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("case", list(STORE_CASES))
def test_unreadable_store_is_an_error(
    good_store: Path, tmp_path: Path, command: str, case: str
) -> None:
    mutate, needles = STORE_CASES[case]
    d = _copy(good_store, tmp_path)
    mutate(d)
    p = kvtier(command, str(tmp_path))  # a hang fails with TimeoutExpired
    assert_usage_error(p, f"kvtier {command}: ", *needles)


def test_an_unreadable_layout_json_is_a_warning_as_a_missing_one(
    good_store: Path, tmp_path: Path
) -> None:
    """layout.json is only an aid: unreadable (EACCES) it is a warning and
    the slots are read without it, as when it is missing or damaged (it
    stopped the command with exit 2). As root, the read runs without the
    capabilities that override file modes."""
    d = _copy(good_store, tmp_path)
    (d / "layout.json").chmod(0)
    argv = [sys.executable, "-m", "kvtier.tools.cli", "verify", str(d)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("as root this needs setpriv to drop CAP_DAC_OVERRIDE")
        drop = "-dac_override,-dac_read_search"
        argv = ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", *argv]
    p = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    assert p.returncode == 0, p.stderr
    assert "3 used slots checked, 3 ok, 0 bad" in p.stdout
    assert "layout.json: cannot open: Permission denied (an aid only" in p.stdout


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_two_copies_of_one_store_are_not_taken_for_its_stripes(
    good_store: Path, tmp_path: Path, command: str
) -> None:
    """A copy beside the original (a backup) given with it: both hold
    slab-0 of one store. They were merged into one store of twice the
    slots, with slot numbers that named two different slots."""
    copies = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        copies.append(_copy(good_store, tmp_path / name))
    p = kvtier(command, *map(str, copies))
    assert_usage_error(
        p, f"kvtier {command}: ", "are both slab-0.kvt of store", "two copies"
    )
    for copy in copies:  # each on its own is a store
        assert kvtier(command, str(copy)).returncode == 0
    # One store given twice, under any of its names, is one store.
    alias = tmp_path / "alias"
    alias.symlink_to(tmp_path / "a")
    for twice in (
        [tmp_path / "a", tmp_path / "a"],
        [tmp_path / "a", f"{tmp_path / 'a'}/"],
        [tmp_path / "a", alias],
        [tmp_path / "a", copies[0]],
    ):
        p = kvtier(command, *map(str, twice))
        assert p.returncode == 0, (twice, p.stderr)


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's store needs root")
def test_the_tools_read_another_users_store_and_a_readable_slab(
    good_store: Path, tmp_path: Path
) -> None:
    """The checks a worker makes before it opens its own slabs by name (its
    private directory, a private slab) are the engine's: root checking the
    service user's store, or a restored copy, is read as before."""
    d = _copy(good_store, tmp_path)
    (d / "slab-0.kvt").chmod(0o644)
    for p in (d, *d.iterdir()):
        os.chown(p, 65534, 65534)
    for command in ("verify", "inspect"):
        p = kvtier(command, str(d))
        assert p.returncode == 0, p.stderr
    assert "3 used slots checked, 3 ok, 0 bad" in kvtier("verify", str(d)).stdout


def test_good_store_still_inspects_and_verifies(good_store: Path) -> None:
    p = kvtier("verify", str(good_store))
    assert p.returncode == 0 and "3 used slots checked, 3 ok, 0 bad" in p.stdout
    p = kvtier("inspect", "--json", str(good_store))
    assert p.returncode == 0, p.stderr
    (rep,) = json.loads(p.stdout)["stores"]
    assert (rep["slot_size"], rep["total_slots"], rep["blocks"]) == (SLOT, 8, 3)


@pytest.mark.parametrize("identity", [["a", "b"], "text", 5, {"contents": "c0ffee"}])
def test_inspect_shows_any_identity_as_written(
    good_store: Path, tmp_path: Path, identity: Any
) -> None:
    """layout.json's ``identity`` is an object when kvtier wrote it; any other
    JSON value there is shown as it is, not a traceback."""
    d = _copy(good_store, tmp_path)
    _edit_layout(identity=identity)(d)
    p = kvtier("inspect", str(d))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    shown = "contents=c0ffee" if isinstance(identity, dict) else str(identity)
    assert f"  identity         {shown}\n" in p.stdout


def test_inspect_shows_a_layouts_control_characters_escaped(
    good_store: Path, tmp_path: Path
) -> None:
    """A planted layout.json's strings reach the operator's terminal with
    their control characters shown, not as escape sequences (retitle,
    clear screen)."""
    d = _copy(good_store, tmp_path)
    evil = "\x1b]0;owned\x07\x1b[2J"
    _edit_layout(model=evil, identity={"contents": evil})(d)
    p = kvtier("inspect", str(d))
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and "\x07" not in p.stdout
    assert "model=\\x1b]0;owned\\x07\\x1b[2J" in p.stdout
    assert "contents=\\x1b]0;owned" in p.stdout


def test_store_without_layout_uses_slot_header(
    good_store: Path, tmp_path: Path
) -> None:
    d = _copy(good_store, tmp_path)
    (d / "layout.json").unlink()
    p = kvtier("verify", str(d))
    assert p.returncode == 0, p.stderr
    assert "3 ok, 0 bad" in p.stdout and f"slot size {SLOT} inferred" in p.stdout


def test_inspect_missing_path(tmp_path: Path) -> None:
    for command in ("inspect", "verify"):
        p = kvtier(command, str(tmp_path / "nope"))
        assert_usage_error(p, "no such file or directory")
        p = kvtier(command, str(tmp_path))
        assert_usage_error(p, "no kvtier-<digest> store directory")


# -------------------------------------------------------------------- events


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_events_bind_wildcard_uses_loopback() -> None:
    port = _free_port()
    p = kvtier(
        "events",
        "--bind",
        "--endpoint",
        f"tcp://*:{port}",
        "--duration",
        "0.2",
        "--decoder",
        "plain",
        "--json",
    )
    assert p.returncode == 0, p.stderr
    assert f"binding tcp://127.0.0.1:{port} instead of tcp://*:{port}" in p.stderr
    assert json.loads(p.stdout)["endpoint"] == f"tcp://127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (
            ["--bind", "--endpoint", "tcp://192.0.2.1:5557"],
            ["refusing to bind non-loopback address '192.0.2.1'", "--allow-remote"],
        ),
        (["--bind", "--endpoint", "pgm://eth0;239.1.1.1:5555"], ["refusing to bind"]),
        (["--endpoint", "tcp://127.0.0.1:1", "--duration", "-1"], ["must be > 0"]),
        (["--endpoint", "tcp://127.0.0.1:1", "--duration", "inf"], ["finite"]),
        (
            ["--endpoint", "tcp://127.0.0.1:1", "--max-message-bytes", "0"],
            ["--max-message-bytes"],
        ),
        (["--endpoint", "nonsense"], ["cannot subscribe to nonsense"]),
        (["--endpoint", "tcp://127.0.0.1:99999"], ["port '99999' is not a TCP port"]),
        (["--endpoint", "tcp://127.0.0.1:0"], ["port '0' is not a TCP port"]),
        (["--bind", "--endpoint", "tcp://127.0.0.1:x"], ["port 'x' is not a TCP"]),
    ],
)
def test_events_rejects_bad_arguments(argv: list[str], needles: list[str]) -> None:
    assert_usage_error(kvtier("events", *argv), *needles)


def test_events_survives_and_counts_malformed_messages() -> None:
    """Garbage of every kind, then a frame over --max-message-bytes (ZMQ drops
    the connection and would not reconnect by itself; the CLI does), then one
    good batch: the CLI keeps going, counts each malformed message and the
    disconnect, and stops on the good batch."""
    import msgspec
    import zmq

    enc = msgspec.msgpack.Encoder()
    good = enc.encode(
        [1.0, [{"type": "BlockStored", "block_hashes": [1, 2], "medium": "CPU"}], 0]
    )
    seq = (7).to_bytes(8, "big")
    malformed: list[list[bytes]] = [
        [b"only one frame"],
        [b"", seq],
        [b"", seq, good, b"extra", b"frames"],
        [b"", b"abc", good],  # sequence number not 8 bytes
        [b"", seq, b"\xc1\xff not msgpack"],
        [b"", seq, enc.encode({"not": "a batch"})],
        [b"", seq, enc.encode(["ts is text", []])],  # float() fails
        [b"", seq, enc.encode([1.0, [{"type": "BlockStored", "block_hashes": 5}]])],
        [b"", seq, enc.encode([1.0, ["untagged event"]])],
        [b"", seq, enc.encode([2**64 - 1, [{"medium": "CPU"}]])],
        [b"", seq, b"\x91" * 50_000],  # nested arrays, 50k deep (< 64 KiB)
    ]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # hands us subscriptions: no slow-joiner loss
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.RCVTIMEO, TIMEOUT * 1000)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.tools.cli", "events"]
        + ["--endpoint", f"tcp://127.0.0.1:{port}", "--decoder", "plain", "--json"]
        + ["--max-batches", "1", "--duration", str(TIMEOUT)]
        + ["--max-message-bytes", "64KiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=env,
    )
    try:
        assert pub.recv() == b"\x01"  # the CLI subscribed (30 s timeout)
        for frames in malformed:
            pub.send_multipart(frames)
        pub.send_multipart([b"", seq, b"\x00" * (128 << 10)])  # > 64 KiB
        # The subscriber drops the connection (unsubscribe) and reconnects.
        assert pub.recv() == b"\x00"
        assert pub.recv() == b"\x01"
        pub.send_multipart([b"", (8).to_bytes(8, "big"), good])
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=TIMEOUT)
        pub.close(linger=0)
        ctx.term()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    doc = json.loads(out)
    assert doc["batches"] == 1
    assert doc["decode_errors"] == len(malformed)
    assert doc["last_decode_error"]
    assert doc["disconnects"] == 1  # the oversized frame
    assert doc["media"]["cpu"]["stored"] == 2


def test_events_text_summary_reports_malformed() -> None:
    import msgspec
    import zmq

    good = msgspec.msgpack.Encoder().encode(
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "medium": "CPU"}], 0]
    )
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.RCVTIMEO, TIMEOUT * 1000)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.tools.cli", "events"]
        + ["--endpoint", f"tcp://127.0.0.1:{port}", "--decoder", "plain"]
        # Stopped by the good batch sent after the garbage, not by a short
        # --duration: that ran from the CLI's start, so a test process not
        # scheduled within it lost the garbage (0 decode errors).
        + ["--max-batches", "1", "--duration", str(TIMEOUT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env=env,
    )
    try:
        assert pub.recv() == b"\x01"
        pub.send_multipart([b"", (1).to_bytes(8, "big"), b"garbage"])
        pub.send_multipart([b"", (2).to_bytes(8, "big"), good])
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=TIMEOUT)
        pub.close(linger=0)
        ctx.term()
    assert proc.returncode == 0, err
    assert "decode errors 1" in out and "batches 1" in out
    assert "skipped 1 malformed message(s); last: " in out


def test_handle_counts_every_kind_of_garbage() -> None:
    """In-process: no exception escapes handle(), each message counts once,
    and unknown media cannot grow the counters without bound."""
    import msgspec

    from kvtier.tools.events_sub import MAX_MEDIA, EventSubscriber

    sub = EventSubscriber("inproc://kvtier-test-garbage", bind=True)
    try:
        enc = msgspec.msgpack.Encoder()
        seq = (0).to_bytes(8, "big")
        sub.handle([b"", seq, b"\xc1"])
        sub.handle([b"", seq, enc.encode([None, []])])
        sub.handle([b"", seq, b""], nframes=1000)
        assert sub.counts.decode_errors == 3 and sub.counts.batches == 0
        for i in range(3 * MAX_MEDIA):
            ev = {"type": "BlockStored", "block_hashes": [1], "medium": f"M{i}"}
            sub.handle([b"", (i + 1).to_bytes(8, "big"), enc.encode([0.0, [ev]])])
        ev = {"type": "BlockStored", "block_hashes": [1], "medium": "x" * 10_000}
        sub.handle([b"", (99).to_bytes(8, "big"), enc.encode([0.0, [ev]])])
        assert sub.counts.batches == 3 * MAX_MEDIA + 1
        assert len(sub.counts.media) == MAX_MEDIA + 1  # + "other"
        assert sub.counts.media["other"]["stored"] == 3 * MAX_MEDIA + 1 - (
            MAX_MEDIA - 3
        )
    finally:
        sub.close()


def test_poll_returns_by_its_timeout_under_a_flood_of_big_batches() -> None:
    """Batches that take long to decode (a few MiB each, here about a tenth
    of a second apiece) queued at once: one ``poll(1)`` handles one of them
    and returns, rather than up to MAX_PER_POLL of them (the watch would
    then overrun --duration, or a SIGTERM's summary, by hours)."""
    import time

    import msgspec
    import zmq

    from kvtier.tools.events_sub import EventSubscriber

    ev = {"type": "BlockStored", "block_hashes": [1], "medium": "CPU"}
    heavy = msgspec.msgpack.encode([1.0, [ev] * 50_000, 0])
    sent = 4
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.RCVTIMEO, TIMEOUT * 1000)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = EventSubscriber(f"tcp://127.0.0.1:{port}")
    try:
        assert pub.recv() == b"\x01"
        for seq in range(sent):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), heavy])
        handled: list[int] = []
        deadline = time.monotonic() + TIMEOUT
        while sum(handled) < sent:
            assert time.monotonic() < deadline, handled
            n = sub.poll(1)
            if n:
                handled.append(n)
    finally:
        sub.close()
        pub.close(linger=0)
        ctx.term()
    assert handled == [1] * sent
    assert sub.counts.batches == sent and sub.counts.decode_errors == 0
    assert sub.counts.media["cpu"]["stored"] == sent * 50_000


def test_output_closed_early_exits_141_without_a_traceback(good_store: Path) -> None:
    """``kvtier inspect ... | head``: the reader went away before the
    output did; the status is the shell's for SIGPIPE (128 + 13), as
    docs/operations.md says, and nothing is printed about it."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.tools.cli", "inspect", str(good_store)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        cwd=REPO_ROOT,
        env=env,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # before the interpreter has started: no line read
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 141, (proc.returncode, err)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err


def test_a_medium_name_with_a_newline_is_other() -> None:
    """A medium name becomes a counter's label only when it is a short
    identifier: a trailing newline (which ``$`` let through) makes it
    ``other``, as any other control character does."""
    from kvtier.tools.events_sub import OTHER_MEDIUM, kvtier_medium

    assert kvtier_medium("NVMe") == "nvme"
    assert kvtier_medium("nvme\n") == OTHER_MEDIUM
    assert kvtier_medium("nv\nme") == OTHER_MEDIUM
