"""Runs a tensor-parallel (TP=2) engine with kvtier, and a no-offload TP=2
baseline, and prints what test_tp2_e2e.py checks as JSON. Invoked by that
test in a subprocess: vLLM's CPU workers bind their OpenMP threads from
VLLM_CPU_OMP_THREADS_BIND, which vLLM reads once per process (its env cache),
and the test process may have started engines with another value.

The engine core runs in this process (in-process engine, so the scheduler,
kvtier's manager and the hit recorder can be read); vLLM's multiprocess
executor runs the two workers, one process per rank, each with its own
kvtier worker, CPU-tier file and disk store.

Phases (one kvtier engine):
  first      FIRST, one at a time; every block spilled (spill_watermark 0).
  returning  the GPU prefix cache emptied; FIRST[5] (still in the CPU tier)
             then FIRST[0] (on disk only): cached tokens from host and disk.
  corrupt    FIRST[1] is on disk only; one payload byte of its first block
             is flipped in rank 1's slab (rank 0's slot left intact), the
             GPU cache emptied, FIRST[1] run again.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

TP = dict(tensor_parallel_size=2, distributed_executor_backend="mp")
CORRUPT_RANK = 1


# vLLM's CPU communicator keeps a /dev/shm segment per TP group, named after
# the engine's distributed init file; a worker that had to be killed at
# shutdown (slow to exit on a loaded machine) leaves it behind. Ours are
# named by the init files recorded here, and removed after each engine.
INIT_IDENTS: list[str] = []


def _record_init_files() -> None:
    import vllm.v1.executor.multiproc_executor as mpe

    real = mpe.get_file_store_init_method

    def recorded() -> str:
        method = real()
        INIT_IDENTS.append(os.path.basename(method.removeprefix("file://")))
        return method

    mpe.get_file_store_init_method = recorded


def _remove_vllm_segments() -> list[str]:
    removed = []
    for ident in INIT_IDENTS:
        for path in glob.glob(f"/dev/shm/{glob.escape(ident)}-*"):
            os.unlink(path)
            removed.append(os.path.basename(path))
    return removed


def main() -> None:
    from e2e.workload import (
        FIRST,
        GPU_BLOCKS,
        kvtier_config,
        manager_of,
        run_each,
    )
    from kvtier.store.slot import HEADER_SIZE
    from kvtier.testing.engine import engine, settle
    from kvtier.testing.faults import flip_byte
    from kvtier.testing.model import kv_bytes_per_block

    model, disk = sys.argv[1], sys.argv[2]
    _record_init_files()
    # kvtier's budgets are for all ranks together: the full model's block.
    block_bytes = kv_bytes_per_block(model, 32)
    returning = [FIRST[5], FIRST[0]]

    with engine(model, None, num_gpu_blocks=GPU_BLOCKS, **TP) as llm:
        base_first = run_each(llm, FIRST).outputs
        assert llm.reset_prefix_cache()
        base_returning = run_each(llm, returning).outputs
        assert llm.reset_prefix_cache()
        base_corrupt = run_each(llm, [FIRST[1]]).outputs
    leaked = _remove_vllm_segments()

    cfg = kvtier_config(block_bytes, disk, spill_watermark=0.0)
    with engine(model, cfg, num_gpu_blocks=GPU_BLOCKS, **TP) as llm:
        mgr = manager_of(llm)
        h = mgr.hierarchy
        rows = mgr.runtime.rows  # the scheduler's map of each rank's rows

        # Each prompt's keys in block order, as the scheduler stores them.
        stored: list[list] = []
        real_prepare_store = mgr.prepare_store

        def prepare_store(keys, req_context):
            stored.append(list(keys))
            return real_prepare_store(keys, req_context)

        mgr.prepare_store = prepare_store
        first_keys = []
        first_out = []
        for prompt in FIRST:
            stored.clear()
            first_out += run_each(llm, [prompt]).outputs
            settle(mgr)
            first_keys.append([k for keys in stored for k in keys])
        mgr.prepare_store = real_prepare_store

        def where(keys) -> list[str]:
            return [h.lookup(k).name for k in keys]

        # Each rank's CPU-tier row of each of FIRST[5]'s blocks: its own
        # file, its own shard of the block's KV.
        cpu_rows = {
            "files": [os.path.basename(r.path) for r in rows],
            "mapped": [r.buffer is not None for r in rows],
            "rows": [
                [bool(r.array[h.cpu.get(k).slot].any()) for r in rows]
                for k in first_keys[5]
            ],
            "differ": [
                bool((rows[0].array[h.cpu.get(k).slot] != rows[1].array[h.cpu.get(k).slot]).any())
                for k in first_keys[5]
            ],
        }
        row_paths = [r.path for r in rows]
        before_returning = {
            "FIRST[5]": where(first_keys[5]),
            "FIRST[0]": where(first_keys[0]),
        }
        assert llm.reset_prefix_cache()
        s0 = dict(vars(h.stats))
        again = run_each(llm, returning)
        settle(mgr)
        s1 = dict(vars(h.stats))

        # The negative control: rank 1's copy of FIRST[1]'s first block.
        keys = first_keys[1]
        before_corrupt = where(keys)
        store = mgr.runtime.stores[CORRUPT_RANK]
        slot = h.disk.get(keys[0]).slot
        idx, offset = store.files.offset_of(slot)
        slab = store.files.slabs[idx].path
        flip_byte(slab, offset + HEADER_SIZE + 100)

        # What the scheduler was told: the merged workers' failed blocks,
        # and the tokens it took back from the loaded prefix.
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        invalid: list[dict] = []
        real_update = sched._update_requests_with_invalid_blocks

        def update(requests, invalid_block_ids, *a, **kw):
            requests = list(requests)
            res = real_update(requests, invalid_block_ids, *a, **kw)
            invalid.append(
                {"blocks": len(invalid_block_ids), "affected_tokens": res[1]}
            )
            return res

        sched._update_requests_with_invalid_blocks = update
        w0 = mgr.worker_totals
        f0 = dict(vars(h.disk_core.failures))
        assert llm.reset_prefix_cache()
        corrupt = run_each(llm, [FIRST[1]])
        settle(mgr)
        s2 = dict(vars(h.stats))
        w1 = mgr.worker_totals
        f1 = dict(vars(h.disk_core.failures))
        sched._update_requests_with_invalid_blocks = real_update

        # Served again once the GPU forgot it, twice: nothing of the bad
        # slot comes back; the request that recomputed after the failed load
        # stored its first block again (its stores restart after a failed
        # load), so both are served from the tiers.
        after = []
        for _ in range(2):
            assert llm.reset_prefix_cache()
            after.append(run_each(llm, [FIRST[1]]))
            settle(mgr)
    leaked += _remove_vllm_segments()

    def delta(a: dict, b: dict) -> dict:
        return {k: b[k] - a[k] for k in b if isinstance(b[k], int) and b[k] != a[k]}

    print(
        "KVTIER-RESULT "
        + json.dumps(
            {
                "baseline": {
                    "first": base_first,
                    "returning": base_returning,
                    "corrupt": base_corrupt,
                },
                "first": first_out,
                "first_keys": [[k.hex() for k in ks] for ks in first_keys],
                "returning": {
                    "outputs": again.outputs,
                    "hits": again.hits_by_source,
                    "num_cached_tokens": again.num_cached_tokens,
                    "where_before": before_returning,
                    "stats": delta(s0, s1),
                },
                "corrupt": {
                    "outputs": corrupt.outputs,
                    "hits": corrupt.hits_by_source,
                    "num_cached_tokens": corrupt.num_cached_tokens,
                    "where_before": before_corrupt,
                    "slab": slab,
                    "slot": slot,
                    "stats": delta(s1, s2),
                    "checksum_failures": w1.checksum_failures - w0.checksum_failures,
                    "io_errors": w1.io_errors - w0.io_errors,
                    "failures": delta(f0, f1),
                    "invalid": invalid,
                },
                "after": [{"outputs": a.outputs, "hits": a.hits_by_source} for a in after],
                "cpu_rows": cpu_rows,
                "cpu_files_left": [p for p in row_paths if os.path.exists(p)],
                "vllm_segments_left": leaked,
            }
        )
    )


if __name__ == "__main__":  # spawned workers re-import this module
    main()
