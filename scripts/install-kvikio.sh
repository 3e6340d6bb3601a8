#!/usr/bin/env bash
# Install the lean kvikio set into the active Python environment.
#
# Why not `pip install kvikio-cu12`: its declared dependencies pull the whole
# CUDA toolkit wheels (~1.8 GB: cupy, nvcomp, numba-cuda, ...). kvikio's file
# I/O only needs libcufile, the RAPIDS logger and cuda-pathfinder (~115 MB),
# so we install those and then kvikio itself with --no-deps.
#
# Idempotent: when the pinned versions are already importable it does nothing.
# Uses $PYTHON if set, else the active venv's python, else python3.
set -euo pipefail

KVIKIO_SERIES="${KVIKIO_SERIES:-26.10}"

if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then
    py="$VIRTUAL_ENV/bin/python"
else
    py="$(command -v python3)"
fi

installed_series() {
    # Prints the installed kvikio-cu12 version's major.minor, or nothing.
    "$py" - <<'PY' 2>/dev/null || true
from importlib.metadata import PackageNotFoundError, version
try:
    v = version("kvikio-cu12")
    version("libkvikio-cu12")
    version("nvidia-cufile-cu12")
    version("rapids-logger")
    version("cuda-pathfinder")
except PackageNotFoundError:
    raise SystemExit(0)
print(".".join(v.split(".")[:2]))
PY
}

if [[ "$(installed_series)" == "$KVIKIO_SERIES" ]]; then
    echo "install-kvikio: kvikio-cu12 ${KVIKIO_SERIES}.* already installed in $("$py" -c 'import sys; print(sys.prefix)')"
    exit 0
fi

echo "install-kvikio: installing lean kvikio ${KVIKIO_SERIES}.* with $py"
"$py" -m pip install --quiet nvidia-cufile-cu12 rapids-logger cuda-pathfinder
"$py" -m pip install --quiet --no-deps \
    "kvikio-cu12==${KVIKIO_SERIES}.*" "libkvikio-cu12==${KVIKIO_SERIES}.*"

if [[ "$(installed_series)" != "$KVIKIO_SERIES" ]]; then
    echo "install-kvikio: kvikio-cu12 ${KVIKIO_SERIES}.* not found after install" >&2
    exit 1
fi
echo "install-kvikio: done"
