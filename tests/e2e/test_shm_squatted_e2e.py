"""Another local user holds this user's predictable CPU-tier directory name,
``/dev/shm/kvtier-<euid>`` (any user can create it first in the sticky
/dev/shm, and only root can remove it). The engine still starts: its worker
makes the CPU tier in a fallback directory of this user's own, where the
scheduler side finds and maps it, and returning prompts are served from
disk with the outputs of a run without kvtier. The other user's directory
is neither used nor changed, and no file is left after the engine.

Runs alone (``serial``): every engine of this user on the host takes the
fallback while the name is held."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator

import pytest

from kvtier.host.cpu_tier import cpu_tier_dir, cpu_tier_dirs

from .workload import run_multiprocess

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.serial,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user"),
]

NOBODY = 65534


@pytest.fixture
def held() -> Iterator[str]:
    """/dev/shm/kvtier-<euid>, made by ``nobody`` (0777), for the test."""
    primary = cpu_tier_dir()
    if os.path.lexists(primary):
        try:
            os.rmdir(primary)  # an empty leftover of ours
        except OSError:
            pytest.skip(f"{primary} holds files: an engine of this user runs")
    os.mkdir(primary)
    os.chown(primary, NOBODY, NOBODY)
    os.chmod(primary, 0o777)
    before = set(cpu_tier_dirs())
    try:
        yield primary
    finally:
        shutil.rmtree(primary, ignore_errors=True)
        for made in set(cpu_tier_dirs()) - before:  # the test's fallbacks
            shutil.rmtree(made, ignore_errors=True)


def test_an_engine_starts_and_serves_from_disk_when_another_user_holds_its_shm_dir(
    held, model, block_bytes, baseline, tmp_path
):
    result = run_multiprocess(model, block_bytes, tmp_path)
    assert result["outputs"] == baseline
    loaded = sum(
        value
        for name, labels, value in result["series"]
        if name == "vllm:kv_offload_kvtier_loaded_blocks" and labels.get("tier") == "disk"
    )
    # Spills need the scheduler side to map the worker's rows: 2 returning
    # prompts x 4 blocks came back from disk.
    assert loaded == 2 * 4, result["series"]
    st = os.lstat(held)
    assert (st.st_uid, stat.S_IMODE(st.st_mode), os.listdir(held)) == (
        NOBODY,
        0o777,
        [],
    )
    fallbacks = cpu_tier_dirs()
    assert fallbacks and all(os.listdir(d) == [] for d in fallbacks)
