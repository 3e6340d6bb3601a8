#!/bin/bash
# On the GPU machine (see bundle.sh): `make test-gpu`'s tests (the real-engine
# e2e tests on vLLM 0.33's CUDA engine, in-process, then tests/gpu),
# benchmarks/gpu_real_size.py and benchmarks/gpu_copy.py, then, where time is
# left, benchmarks/spill_busy_loop.py (CPU only: what spill threads do to a
# busy loop and to torch steps on a machine with many cores, where on the
# 2-core dev VM CPU contention and the interpreter lock cannot be told apart);
# logs and JSON in $OUT.
#
#   bash .gpu/b/run.sh [STEP...]   STEP: tests, real_size, copy, spill
#                                  (default: all)
#
# The tests alone fill one call (about 5-6 minutes on an H100), so a session
# runs them in one call and the benchmarks in the next, on the same warm
# machine: `run.sh tests`, then `run.sh real_size copy spill`.
#
# gpu_real_size.py runs a second kvtier engine with disk_read_process on
# after the default one (the A/B of where the disk reads run, for the ITL
# goal); REAL_SIZE_ARGS adds or overrides its arguments.
#
# One call stays within BUDGET_S seconds (default 460: under 8 minutes; give
# the call's own timeout less 15 s, e.g. `BUDGET_S=435 bash .gpu/b/run.sh
# tests` under a 450 s limit, so the summary is printed before it ends);
# each step gets at most its own cap and what is left. The e2e tests run in
# the order test_gpu_e2e.py collects them (newest checks first);
# gpu_tests.log lists each test as it ran, gpu_failures.log each failure's
# traceback as it happened (a run cut off at its cap keeps them), and where
# pytest-timeout is installed a test stops after PER_TEST_S (150) seconds
# with its traceback instead of holding the rest.
# Each step runs under `timeout -k 10`: SIGKILL 10 s after the SIGTERM, so a
# process whose SIGTERM handler hangs (an engine shutting down) cannot hold the
# call past its cap. A later call on the same warm machine skips the install (/tmp/vl,
# /tmp/site stay) and can run the steps that did not fit.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
BUDGET_S=${BUDGET_S:-460}
start=$SECONDS
steps=${*:-tests real_size copy spill}
left() { echo $((BUDGET_S - (SECONDS - start))); }
# cap N: N seconds, or what is left of the budget if less (at least 1).
cap() { local l; l=$(left); l=$((l < $1 ? l : $1)); echo $((l < 1 ? 1 : l)); }

{ nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv
  df -h /dev/shm /var/tmp; free -g; nproc; } > "$OUT/env.txt" 2>&1
if ! cmp -s .gpu/b/so.sha256 /tmp/site/.kvtier-installed 2>/dev/null; then
    env -u PYTHONPATH python3 .gpu/b/install.py > "$OUT/install.log" 2>&1 ||
        { tail -5 "$OUT/install.log"; exit 1; }
    cp .gpu/b/so.sha256 /tmp/site/.kvtier-installed
fi
echo "=== installed after $((SECONDS - start)) s"
export PYTHONPATH=/tmp/site:/tmp/vl:$PWD
# flashinfer does not travel (its sampler would be picked otherwise); the
# e2e tests and the benchmark use in-process engines.
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0

for step in $steps; do
    case $step in
    tests)
        echo "=== tests (cap $(cap 430) s)"
        per_test=()
        if python3 -c "import pytest_timeout" 2>/dev/null; then
            per_test=(--timeout "${PER_TEST_S:-150}" --timeout-method signal)
        fi
        KVTIER_FAILURE_LOG="$OUT/gpu_failures.log" timeout -k 10 "$(cap 430)" \
            python3 -m pytest -v -m gpu tests/e2e/test_gpu_e2e.py tests/gpu "${per_test[@]}" \
            -p no:cacheprovider -rfEs --durations=15 > "$OUT/gpu_tests.log" 2>&1
        echo "rc=$? (124: timed out; gpu_tests.log lists each test as it ran)"
        grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed)" "$OUT/gpu_tests.log" | tail -15
        ;;
    real_size)
        if (($(left) < 90)); then echo "=== real_size: skipped, $(left) s left"; continue; fi
        echo "=== gpu_real_size (cap $(cap 300) s)"
        timeout -k 10 "$(cap 300)" python3 benchmarks/gpu_real_size.py --prefix-tokens 8192 32768 \
            --repeats 3 --disk-dir /var/tmp/kvtier-real --budget-s "$(($(cap 300) - 10))" \
            --attention-backend TRITON_ATTN --disk-read-process auto on $REAL_SIZE_ARGS --out-dir "$OUT" > "$OUT/gpu_real_size.log" 2>&1
        echo "rc=$?"
        tail -25 "$OUT/gpu_real_size.log"
        rm -rf /var/tmp/kvtier-real
        ;;
    copy)
        if (($(left) < 60)); then echo "=== gpu_copy: skipped, $(left) s left"; continue; fi
        echo "=== gpu_copy (cap $(cap 200) s)"
        timeout -k 10 "$(cap 200)" python3 benchmarks/gpu_copy.py --blocks 64 512 --repeats 3 \
            --disk-dir /var/tmp/kvtier-bench --out "$OUT/gpu_copy.json" > "$OUT/gpu_copy.log" 2>&1
        echo "rc=$?"
        tail -9 "$OUT/gpu_copy.log"
        python3 - <<'PY'
import json, os
path = os.environ["OUT"] + "/gpu_copy.json"
d = json.load(open(path)) if os.path.exists(path) else {}
g_all, disk = d.get("gpu_cpu"), d.get("disk_gpu")
for n, g in (g_all.items() if isinstance(g_all, dict) else [("gpu_cpu", g_all)]):
    if isinstance(g, dict):
        print(n, {k: round(v, 3) for k, v in g.items() if k.startswith("ratio")})
    else:
        print(n, g)
for k, v in (disk["rows"].items() if isinstance(disk, dict) else [("disk_gpu", disk)]):
    t = v.get("thread") if isinstance(v, dict) else None
    if t is None:
        print(k, v.get("error", "no runs") if isinstance(v, dict) else v)
        continue
    busy = v.get("busy") or {}
    print(k, "cpu ms/GiB", round(t["cpu_ms_per_gib"], 3), "idle us", round(v.get("idle_get_finished_us", float("nan")), 2),
          "busy slowdown", round(busy.get("slowdown", float("nan")), 3), "busy GB/s", round(busy.get("gbps_median", float("nan")), 2))
PY
        ;;
    spill)
        if (($(left) < 75)); then echo "=== spill_busy_loop: skipped, $(left) s left"; continue; fi
        echo "=== spill_busy_loop (cap $(cap 150) s)"
        timeout -k 10 "$(cap 150)" python3 benchmarks/spill_busy_loop.py --dir /var/tmp \
            --repeats 2 --trace /nonexistent --out "$OUT/spill_busy_loop_gpu_host.json" \
            > "$OUT/spill_busy_loop.log" 2>&1
        echo "rc=$?"
        grep KiB "$OUT/spill_busy_loop.log"
        grep torch "$OUT/spill_busy_loop.log"
        ;;
    *) echo "run.sh: unknown step $step (tests, real_size, copy, spill)"; exit 2 ;;
    esac
done
echo "=== done after $((SECONDS - start)) s"
