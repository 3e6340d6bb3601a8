#!/usr/bin/env bash
# Builds what a CUDA check on a lent GPU machine needs that its image lacks,
# into .gpu/ (git-ignored): vLLM 0.33.0's Python modules and its stable-ABI
# kernels (_C_stable_libtorch: they load on the machine's torch 2.11 and run
# a vLLM engine there), and cp312 wheels of kvikio-cu13 and of what vLLM
# imports. vLLM's flash-attention kernels (300+ MB) and flashinfer do not
# travel: install.py lets vLLM pick its Triton attention backend, and
# run.sh sets VLLM_USE_FLASHINFER_SAMPLER=0 (docs/compatibility.md, "A vLLM
# 0.33 CUDA engine on a lent GPU").
#
# The kernels alone compress to ~61 MiB and one call carries at most 64 MiB
# (the working tree included), so the carry is split in two: .gpu/a (the
# first part of the kernels) is carried by a first call that stashes it in
# /tmp/stash on the machine; .gpu/b (the rest, the wheels, install.py and
# run.sh) by a second call on the same warm machine, which runs the checks:
#
#   device run 1: carry [".gpu/a"]  mkdir -p /tmp/stash && cp .gpu/a/* /tmp/stash/
#   device run 2: carry [".gpu/b"]  bash .gpu/b/run.sh
#
# run.sh installs (install.py: only the wheels the image lacks, into
# /tmp/site), runs `make test-gpu`'s tests (tests/gpu and the real-engine
# e2e tests on vLLM 0.33's CUDA engine), benchmarks/gpu_real_size.py and,
# with time left, benchmarks/gpu_copy.py, within one call's time, and
# leaves logs and JSON in $OUT.
#
# Usage: bash scripts/gpu-device/bundle.sh   (downloads ~380 MB, ~2 min)
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-.venv/bin/python}
VERSION=0.33.0
SHA256=4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

echo "vllm==$VERSION --hash=sha256:$SHA256" >"$tmp/req.txt"
"$py" -m pip download -q --no-deps --only-binary=:all: --require-hashes \
    -r "$tmp/req.txt" -d "$tmp/wheel"
rm -rf .gpu && mkdir -p .gpu/a .gpu/b/whl "$tmp/x"
(cd "$tmp/x" && unzip -q "$tmp"/wheel/vllm-*.whl 'vllm/*.py' \
    'vllm/_C_stable_libtorch.abi3.so' "vllm-$VERSION.dist-info/*")
(cd "$tmp/x" && tar cJf "$OLDPWD/.gpu/b/vllm_py.tar.xz" --exclude='*.so' vllm "vllm-$VERSION.dist-info")
sha256sum "$tmp/x/vllm/_C_stable_libtorch.abi3.so" | cut -d' ' -f1 >.gpu/b/so.sha256
xz -9 -T2 -c "$tmp/x/vllm/_C_stable_libtorch.abi3.so" >"$tmp/so.xz"
# Part a is the first 48 MiB; b the rest (with the wheels, ~51 MiB).
split -b 48M "$tmp/so.xz" "$tmp/so.xz.part"
mv "$tmp/so.xz.partaa" .gpu/a/
mv "$tmp/so.xz.partab" .gpu/b/

plat=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_5_x86_64
      --platform manylinux1_x86_64)
for req in "kvikio-cu13==26.10.*" "libkvikio-cu13==26.10.*" rapids-logger \
    msgspec pyzmq zstandard dill "pydantic==2.14.4" "pydantic-core==2.50.5" \
    typing-inspection annotated-types typing-extensions cbor2 "openai>=2.25" \
    jiter distro httpx2 httpcore2 truststore sniffio pybase64 cachetools \
    more-itertools "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11" \
    "fastapi<0.137,>=0.133" "starlette>=1.0.1" partial-json-parser \
    "llguidance<1.8,>=1.7" "oss-harmony>=0.0.11" \
    "compressed-tensors==0.17.0" loguru astor "depyf==0.20.0" blake3 orjson \
    setproctitle "lark==1.2.2" "outlines_core==0.2.14" \
    "lm-format-enforcer==0.11.3" interegular jsonschema \
    jsonschema-specifications referencing rpds-py ijson python-json-logger \
    watchfiles gguf prometheus-fastapi-instrumentator; do
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plat[@]}" -d .gpu/b/whl "$req"
done
cp scripts/gpu-device/install.py scripts/gpu-device/run.sh .gpu/b/

# What each call carries: its part plus the working tree (tracked files and
# untracked ones git does not ignore).
tree=$( (git ls-files -z; git ls-files -z -o --exclude-standard) |
    xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
limit=$((64 * 1024 * 1024))
for part in a b; do
    bytes=$(( $(du -sb ".gpu/$part" | cut -f1) + tree ))
    awk -v p="$part" -v b="$bytes" -v t="$tree" 'BEGIN {printf "call carrying .gpu/%s: %.1f MiB (working tree %.1f MiB), limit 64 MiB\n", p, b / 1048576, t / 1048576}'
    if (( bytes > limit )); then
        echo "bundle.sh: .gpu/$part and the working tree exceed 64 MiB" >&2
        exit 1
    fi
done
