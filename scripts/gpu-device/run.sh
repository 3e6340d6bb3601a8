#!/bin/bash
# On the GPU machine (see bundle.sh): the gpu tests, then benchmarks/gpu_copy.py;
# logs and JSON in $OUT.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.txt 2>&1
env -u PYTHONPATH python3 .gpu/b/install.py > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
export PYTHONPATH=/tmp/site:/tmp/vl:$PWD
timeout 200 python3 -m pytest -q -m gpu tests/gpu tests/e2e/test_gpu_e2e.py -p no:cacheprovider -rs 2>&1 | tee $OUT/gpu_tests.log | tail -4
echo "=== gpu_copy"
timeout 300 python3 benchmarks/gpu_copy.py --blocks 64 512 --repeats 5 --disk-dir /var/tmp/kvtier-bench --out $OUT/gpu_copy.json > $OUT/gpu_copy.log 2>&1; tail -9 $OUT/gpu_copy.log
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/gpu_copy.json"))
for n, g in d["gpu_cpu"].items():
    if isinstance(g, dict):
        print(n, {k: round(v, 3) for k, v in g.items() if k.startswith("ratio")})
for k, v in d["disk_gpu"]["rows"].items():
    t = v["thread"]
    print(k, "cpu ms/GiB", round(t["cpu_ms_per_gib"], 3), "idle us", round(v["idle_get_finished_us"], 2))
PY
echo "=== done"
