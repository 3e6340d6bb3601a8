#!/usr/bin/env bash
# Install what vLLM's `obj` tier and its test need into the active Python
# environment (tests/tiering/test_obj_tier_e2e.py, docs/scale-out.md):
#
# - nixl-cu12: NIXL, whose OBJ plugin (AWS SDK inside, a 68 MB manylinux
#   wheel) is the S3 client of vLLM's `obj` tier. The agent and the OBJ
#   backend run without a GPU or a CUDA driver.
# - nixl: the meta package vLLM imports (`nixl._api`). It declares both
#   nixl-cu12 and nixl-cu13 and uses whichever is installed, so it goes in
#   with --no-deps (nixl-cu13 would be another large wheel, unused).
# - moto's S3 server (the local S3-compatible store the test runs against):
#   moto[s3] with flask and flask-cors, without moto[server]'s other services.
#
# None of these changes a package already in the venv. Idempotent: when the
# pinned versions are installed it does nothing.
# Uses $PYTHON if set, else the active venv's python, else python3.
set -euo pipefail

NIXL_VERSION=1.5.1
MOTO_VERSION=5.2.5
FLASK_VERSION=3.1.3
FLASK_CORS_VERSION=6.0.5

if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then
    py="$VIRTUAL_ENV/bin/python"
else
    py="$(command -v python3)"
fi

installed() {
    "$py" - "$NIXL_VERSION" "$MOTO_VERSION" "$FLASK_VERSION" "$FLASK_CORS_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import PackageNotFoundError, version
nixl, moto, flask, cors = sys.argv[1:5]
want = {"nixl-cu12": nixl, "nixl": nixl, "moto": moto, "flask": flask,
        "flask-cors": cors}
try:
    ok = all(version(name) == v for name, v in want.items())
except PackageNotFoundError:
    ok = False
raise SystemExit(0 if ok else 1)
PY
}

if installed; then
    echo "install-obj-deps: nixl ${NIXL_VERSION}, moto ${MOTO_VERSION} already installed"
    exit 0
fi

echo "install-obj-deps: installing nixl-cu12 ${NIXL_VERSION} and moto ${MOTO_VERSION} with $py"
"$py" -m pip install --quiet "nixl-cu12==${NIXL_VERSION}" \
    "moto[s3]==${MOTO_VERSION}" "flask==${FLASK_VERSION}" "flask-cors==${FLASK_CORS_VERSION}"
"$py" -m pip install --quiet --no-deps "nixl==${NIXL_VERSION}"

if ! installed; then
    echo "install-obj-deps: pinned versions not found after install" >&2
    exit 1
fi
echo "install-obj-deps: done"
