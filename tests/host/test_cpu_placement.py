"""Where the load thread runs: read from the OpenMP binding vLLM sets, and
moved with the real kernel calls (a child process, so the test's own
threads keep their CPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtier.host.placement import (
    hyperthread_siblings,
    listed_workers_cpus,
    name_this_thread,
    numa_neighbours,
    openmp_cpus,
    spare_cpus,
    without_openmp_binding,
)
from kvtier.testing.procs import descendants, parent_pid, thread_names

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
        ({"GOMP_CPU_AFFINITY": "0-4294967295"}, set()),  # refused, not built
        ({"OMP_PLACES": "{0:4294967295}", "OMP_PROC_BIND": "true"}, set()),
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
    # x86 auto binding, one logical CPU per core (0-3; siblings 4-7), 7 kept
    # out: not the busy cores' siblings while another CPU is left.
    assert spare_cpus({0, 1, 2}, set(range(8)), siblings={4, 5, 6}) == {3, 7}
    assert spare_cpus({0, 1, 2, 3}, set(range(4)) | {4}, siblings={4}) == {4}


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
def test_listed_workers_cpus(value, cpus):
    assert listed_workers_cpus({"VLLM_CPU_OMP_THREADS_BIND": value}) == cpus


def test_hyperthread_siblings(tmp_path):
    for cpu, sib in ((0, "0,4"), (4, "0,4"), (1, "1,5"), (5, "1,5"), (2, "2")):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(sib)
    assert hyperthread_siblings({0, 1, 2}, str(tmp_path)) == {4, 5}
    assert hyperthread_siblings({0, 4}, str(tmp_path)) == set()
    assert hyperthread_siblings({9}, str(tmp_path)) == set()


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
    import json, multiprocessing, os, sys, threading
    from kvtier.host.placement import place_background_thread

    def worker(q):
        # vLLM sets the binding for the worker process only (its executor
        # stays unbound: with libgomp preloaded, a bound executor would be
        # pinned as it starts), and OpenMP binds the model runner's thread
        # before the worker starts its load thread, which inherits it.
        os.environ["GOMP_CPU_AFFINITY"] = os.environ["BOUND"]
        bound = sorted(int(c) for c in os.environ["BOUND"].split())
        os.sched_setaffinity(0, {bound[0]})
        seen = {}

        def load_thread():
            place_background_thread(0)
            seen["load"] = sorted(os.sched_getaffinity(0))

        t = threading.Thread(target=load_thread)
        t.start()
        t.join()
        seen["main"] = sorted(os.sched_getaffinity(0))
        q.put(seen)

    if sys.argv[1] == "executor":  # a multiprocessing child, as vLLM's workers
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=worker, args=(q,))
        p.start()
        print(json.dumps(q.get(timeout=30)))
        p.join(30)
    else:  # started by a shell or launcher (an in-process engine)
        import queue
        q = queue.Queue()
        worker(q)
        print(json.dumps(q.get()))
    """
)


def _placed(bound: set[int], how: str = "executor") -> dict:
    env = without_openmp_binding(os.environ)
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    env["BOUND"] = " ".join(map(str, sorted(bound)))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, how],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@linux_only
def test_the_load_thread_leaves_the_openmp_cpus():
    allowed = os.sched_getaffinity(0)  # the worker's parent: the child here
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    first = min(allowed)
    seen = _placed({first})
    # The CPUs of its NUMA node left by OpenMP (not a hyper-thread sibling
    # of the model's CPU while there are others).
    expected = spare_cpus(
        {first},
        allowed,
        near=numa_neighbours({first}),
        siblings=hyperthread_siblings({first}),
    )
    assert expected and seen["load"] == sorted(expected)
    assert seen["main"] == [first]  # the model's thread is not moved


@linux_only
def test_the_load_thread_stays_when_openmp_took_every_cpu():
    allowed = os.sched_getaffinity(0)
    seen = _placed(set(allowed))
    # Nowhere spare: it keeps the CPU it inherited (the first OpenMP one).
    assert seen["load"] == [min(allowed)]
    assert seen["main"] == [min(allowed)]


@linux_only
def test_a_worker_not_started_by_an_executor_keeps_its_cpus():
    """An in-process engine's parent (a shell) may have more CPUs than a
    taskset gave the engine: nothing is moved there."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    first = min(allowed)
    seen = _placed({first}, how="direct")
    assert seen["load"] == [first]


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_thread_takes_the_name_ps_and_top_show():
    main_before = _comm(threading.get_native_id())
    got: dict[str, str] = {}

    def run() -> None:
        name_this_thread("kvtier-a-long-thread-name")
        got["own"] = _comm(threading.get_native_id())
        name_this_thread("\udc80")  # does not encode: replaced, never raised
        got["kept"] = _comm(threading.get_native_id())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert got["own"] == "kvtier-a-long-t"  # the kernel keeps 15 bytes
    assert got["kept"] == "?"
    assert _comm(threading.get_native_id()) == main_before  # the caller's only


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_pool_threads_take_their_python_names():
    """As the back ends' pools do: the initializer names each thread after
    its Python name, and the process helpers of kvtier.testing see it."""
    with ThreadPoolExecutor(2, "kvtier-t", initializer=name_this_thread) as pool:
        tid = pool.submit(threading.get_native_id).result(timeout=10)
        assert thread_names(os.getpid())[tid] == "kvtier-t_0"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in descendants(os.getpid())
        assert parent_pid(child.pid) == os.getpid()
    finally:
        child.kill()
        child.wait(10)


def _comm(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()
