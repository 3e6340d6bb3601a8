"""Where the load thread runs: read from the OpenMP binding vLLM sets, and
moved with the real kernel calls (a child process, so the test's own
threads keep their CPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvtier.io.cpu_placement import (
    numa_neighbours,
    openmp_cpus,
    other_workers_cpus,
    spare_cpus,
    without_openmp_binding,
)

linux_only = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity"
)


@pytest.mark.parametrize(
    ("env", "cpus"),
    [
        # The three forms vLLM's OpenMP manager writes for a CPU worker
        # (vllm/utils/ompmultiprocessing.py, configure_omp_envs).
        ({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}, {0, 1, 2}),
        ({"GOMP_CPU_AFFINITY": "4 5 6"}, {4, 5, 6}),
        ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[3,7]"}, {3, 7}),
        # Written by hand: GNU ranges with a stride, OpenMP intervals.
        ({"GOMP_CPU_AFFINITY": "0 3 1-2 8-12:2"}, {0, 1, 2, 3, 8, 10, 12}),
        (
            {"OMP_PLACES": "{0:4},{8:2:2}", "OMP_PROC_BIND": "close"},
            {0, 1, 2, 3, 8, 10},
        ),
        # Nothing bound, or nothing that names CPUs.
        ({}, set()),
        ({"OMP_PLACES": "{0,1}"}, set()),
        ({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "false"}, set()),
        ({"OMP_PLACES": "cores", "OMP_PROC_BIND": "true"}, set()),
        ({"GOMP_CPU_AFFINITY": "zero"}, set()),
        ({"KMP_AFFINITY": "compact"}, set()),
    ],
)
def test_openmp_cpus_reads_the_binding(env, cpus):
    assert openmp_cpus(env) == cpus


def test_spare_cpus():
    assert spare_cpus({0, 1, 2}, set(range(8))) == {3, 4, 5, 6, 7}
    # Every CPU bound: none spare (the thread stays where it is).
    assert spare_cpus({0, 1}, {0, 1}) == set()
    # Nothing bound: nothing to move away from.
    assert spare_cpus(set(), {0, 1}) is None


def test_spare_cpus_stay_on_the_workers_node_and_off_other_workers():
    allowed = set(range(16))
    node0, node1 = set(range(8)), set(range(8, 16))
    # vLLM's auto binding, TP=2: rank 0 has 0-6 (7 reserved), rank 1 8-14.
    assert spare_cpus(set(range(7)), allowed, near=node0) == {7}
    assert spare_cpus(set(range(8, 15)), allowed, near=node1) == {15}
    # Listed by hand on one node: the other rank's CPUs are not spare.
    assert spare_cpus(
        {0, 1, 2}, allowed, taken={0, 1, 2, 3, 4, 5}, near=allowed
    ) == set(range(6, 16))
    # Nothing left near: none (not another node's CPUs).
    assert spare_cpus(node0 - {7}, allowed, taken={7}, near=node0) == set()
    # The topology unknown: the whole of allowed.
    assert spare_cpus({0}, {0, 1}, near=None) == {1}


@pytest.mark.parametrize(
    ("value", "cpus"),
    [
        ("0-3|4-7", set(range(8))),
        ("0,2|5", {0, 2, 5}),
        ("auto", set()),
        ("nobind", set()),
        ("", set()),
        ("0-x", set()),
    ],
)
def test_other_workers_cpus(value, cpus):
    assert other_workers_cpus({"VLLM_CPU_OMP_THREADS_BIND": value}) == cpus


def test_numa_neighbours(tmp_path):
    for node, cpulist in (("node0", "0-3,8-11\n"), ("node1", "4-7,12-15\n")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpulist)
    (tmp_path / "online").write_text("0-1\n")  # not a node
    assert numa_neighbours({1}, str(tmp_path)) == {0, 1, 2, 3, 8, 9, 10, 11}
    assert numa_neighbours({1, 12}, str(tmp_path)) == set(range(16))
    assert numa_neighbours({99}, str(tmp_path)) is None
    assert numa_neighbours({1}, str(tmp_path / "missing")) is None


_CHILD = textwrap.dedent(
    """
    import json, os, threading
    from kvtier.io.cpu_placement import place_background_thread

    # As OpenMP binds the model runner's thread before the worker starts
    # its load thread (which inherits the binding).
    bound = sorted(int(c) for c in os.environ["GOMP_CPU_AFFINITY"].split())
    os.sched_setaffinity(0, {bound[0]})
    seen = {}

    def load_thread():
        place_background_thread(0)
        seen["load"] = sorted(os.sched_getaffinity(0))

    t = threading.Thread(target=load_thread)
    t.start()
    t.join()
    seen["main"] = sorted(os.sched_getaffinity(0))
    print(json.dumps(seen))
    """
)


def _placed(bound: set[int]) -> dict:
    env = dict(os.environ, GOMP_CPU_AFFINITY=" ".join(map(str, sorted(bound))))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@linux_only
def test_the_load_thread_leaves_the_openmp_cpus():
    allowed = os.sched_getaffinity(0)  # the child's parent: this process
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    first = min(allowed)
    seen = _placed({first})
    assert seen["load"] == sorted(allowed - {first})
    assert seen["main"] == [first]  # the model's thread is not moved


@linux_only
def test_the_load_thread_stays_when_openmp_took_every_cpu():
    allowed = os.sched_getaffinity(0)
    seen = _placed(set(allowed))
    # Nowhere spare: it keeps the CPU it inherited (the first OpenMP one).
    assert seen["load"] == [min(allowed)]
    assert seen["main"] == [min(allowed)]


def test_a_helper_process_gets_no_openmp_binding():
    env = {
        "OMP_PLACES": "{0}",
        "OMP_PROC_BIND": "true",
        "GOMP_CPU_AFFINITY": "0",
        "KMP_AFFINITY": "granularity=fine,explicit,proclist=[0]",
        "OMP_NUM_THREADS": "1",
        "LD_PRELOAD": "libgomp.so.1",
        "PATH": "/usr/bin",
    }
    assert without_openmp_binding(env) == {
        "OMP_NUM_THREADS": "1",
        "LD_PRELOAD": "libgomp.so.1",
        "PATH": "/usr/bin",
    }
    assert openmp_cpus(without_openmp_binding(env)) == set()
