from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.host.cpu_tier import CpuBlockBuffer

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_anonymous_buffer_geometry_alignment_and_views() -> None:
    with CpuBlockBuffer(6, 8192) as buf:
        assert buf.array.shape == (6, 8192) and buf.array.dtype == np.uint8
        assert buf.tensor.shape == (6, 8192) and buf.tensor.dtype == torch.uint8
        assert buf.array.ctypes.data % 4096 == 0
        assert all(buf.array[i].ctypes.data % 4096 == 0 for i in range(6))
        assert not buf.array.any()
        buf.tensor[2].fill_(7)  # writes through the tensor are seen by numpy
        assert (buf.array[2] == 7).all() and not buf.array[1].any()
        assert buf.tensor.data_ptr() == buf.array.ctypes.data
    with pytest.raises(RuntimeError):
        _ = buf.array


def test_shared_file_is_seen_by_two_mappings(shm_dir: str) -> None:
    path = os.path.join(shm_dir, "cpu.buf")
    owner = CpuBlockBuffer(4, 4096, shm_path=path)
    other = CpuBlockBuffer(4, 4096, shm_path=path)
    assert owner.owner and not other.owner
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.path.getsize(path) == 4 * 4096
    owner.array[3, :5] = [1, 2, 3, 4, 5]
    assert other.array[3, :5].tolist() == [1, 2, 3, 4, 5]
    other.close()
    assert os.path.exists(path)  # only the owner unlinks
    owner.close()
    assert not os.path.exists(path)


def test_shared_file_across_processes(shm_dir: str) -> None:
    path = os.path.join(shm_dir, "cpu.buf")
    with CpuBlockBuffer(2, 4096, shm_path=path) as buf:
        buf.array[0, :4] = [9, 8, 7, 6]
        code = (
            "import sys; from kvtier.host.cpu_tier import CpuBlockBuffer as B;"
            f"b = B(2, 4096, shm_path={path!r}, owner=False);"
            "assert b.array[0, :4].tolist() == [9, 8, 7, 6], b.array[0, :4];"
            "b.array[1, -3:] = [1, 2, 3]; b.close()"
        )
        subprocess.run(
            [sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=60
        )
        assert buf.array[1, -3:].tolist() == [1, 2, 3]
        assert os.path.exists(path)
    assert not os.path.exists(path)


def test_open_missing_without_ownership_fails(shm_dir: str) -> None:
    with pytest.raises(FileNotFoundError):
        CpuBlockBuffer(1, 4096, shm_path=os.path.join(shm_dir, "nope"), owner=False)


def test_close_with_live_view_does_not_raise(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.kvtier.host")
    buf = CpuBlockBuffer(2, 4096)
    view = buf.array[1]
    buf.close()
    view[:] = 3  # still valid memory: unmapping was deferred
    assert "deferred" in caplog.text
    buf.close()  # idempotent


def test_bad_geometry() -> None:
    with pytest.raises(ValueError):
        CpuBlockBuffer(0, 4096)


def test_last_owner_leaves_nothing_in_the_shared_memory_directory(tmp_path):
    import os

    from kvtier.host.cpu_tier import CpuBlockBuffer
    from kvtier.testing.host import cpu_buffer_dir

    # A private base: the real /dev/shm/kvtier-<euid> is shared with any
    # engine this user runs meanwhile, whose files would keep it alive.
    d = cpu_buffer_dir(str(tmp_path))
    a = CpuBlockBuffer(1, 4096, os.path.join(d, "kvtier-t1-r0of1.cpu"), owner=True)
    b = CpuBlockBuffer(1, 4096, os.path.join(d, "kvtier-t2-r0of1.cpu"), owner=True)
    a.close()
    assert sorted(os.listdir(d)) == ["kvtier-t2-r0of1.cpu"]  # b's stays
    b.close()
    assert not os.path.exists(d)  # the last owner removed the empty directory
    # A later engine re-creates it.
    c = CpuBlockBuffer(
        1,
        4096,
        os.path.join(cpu_buffer_dir(str(tmp_path)), "kvtier-t3-r0of1.cpu"),
        owner=True,
    )
    c.close()
    assert not os.path.exists(d)
