"""Issue #23: the CPU tier's name lives only until every process that needs
it has it mapped, so the kernel frees the memory however the processes end.

(The end-to-end cases, with the real server and real kills, are in
tests/e2e/test_cpu_tier_release_e2e.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
from test_bounded_shutdown import BLOCK_BYTES, make_runtime

from kvtier.host.cpu_tier import CpuBlockBuffer, cpu_buffer_path, open_worker_buffer


def unique_engine_id() -> str:
    return f"release-{os.getpid()}-{time.monotonic_ns()}"


def test_a_worker_without_a_disk_tier_leaves_no_name():
    engine_id = unique_engine_id()
    path = cpu_buffer_path(engine_id, 0, 1)
    with open_worker_buffer(engine_id, 0, 1, 4, 4096, shared=False) as buf:
        assert not os.path.lexists(path)
        buf.array[3, :] = 7  # the rows stay usable without a name
        assert int(buf.array[3].sum()) == 7 * 4096


def test_a_shared_worker_file_keeps_its_name_until_attached(tmp_path: Path):
    engine_id = unique_engine_id()
    path = cpu_buffer_path(engine_id, 0, 1)
    with open_worker_buffer(engine_id, 0, 1, 8, BLOCK_BYTES) as worker:
        assert os.path.exists(path)
        worker.array[5, :] = 42
        rt = make_runtime(tmp_path, path)
        try:
            # The scheduler side mapped the worker's rows at start-up and
            # removed the name: nothing is left to outlive the processes.
            assert not os.path.lexists(path)
            mapped = rt.rows[0].buffer
            assert mapped is not None
            assert np.array_equal(mapped.array[5], worker.array[5])
            worker.array[6, :] = 9  # same memory, not a copy
            assert int(mapped.array[6, 0]) == 9
        finally:
            rt.close()


def test_unlink_name_never_removes_a_successors_file(tmp_path: Path):
    path = str(tmp_path / "tier.cpu")
    first = CpuBlockBuffer(2, 4096, path, owner=True)
    try:
        assert first.unlink_name() is True
        assert first.unlink_name() is False  # idempotent
        with CpuBlockBuffer(2, 4096, path, owner=True) as successor:
            assert first.unlink_name() is False
            assert os.path.exists(path)
            successor.array[0, :] = 1
        assert not os.path.lexists(path)
    finally:
        first.close()


def test_a_runtime_started_before_the_worker_maps_at_the_first_job(tmp_path: Path):
    engine_id = unique_engine_id()
    path = cpu_buffer_path(engine_id, 0, 1)
    rt = make_runtime(tmp_path, path)  # no file yet: not mapped
    try:
        assert rt.rows[0].buffer is None
        with open_worker_buffer(engine_id, 0, 1, 8, BLOCK_BYTES):
            rt.rows[0].array  # noqa: B018  (first use maps it)
            assert rt.rows[0].buffer is not None
            assert not os.path.lexists(path)
    finally:
        rt.close()
