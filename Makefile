# kvtier: `make demo` runs the main job, `make test` runs the test suite.
# Both create .venv on first use (scripts/setup-venv.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0

$(VENV)/.kvtier-ready: pyproject.toml scripts/setup-venv.sh scripts/install-kvikio.sh
	bash scripts/setup-venv.sh $(VENV)

.PHONY: venv test demo lint soak test-gpu
venv: $(VENV)/.kvtier-ready

test: $(VENV)/.kvtier-ready
	$(PY) -m pytest -q -m "not soak"

demo: $(VENV)/.kvtier-ready
	$(PY) scripts/demo.py

lint: $(VENV)/.kvtier-ready
	$(VENV)/bin/ruff check .

# The bounded soak at length (CI runs it with 3 rounds inside `make test`).
soak: $(VENV)/.kvtier-ready
	KVTIER_SOAK_ROUNDS=$${KVTIER_SOAK_ROUNDS:-30} $(PY) -m pytest -q tests/e2e/test_reliability_e2e.py -k soak

# The CUDA tests (tests/gpu, marked gpu) on a GPU host whose Python has torch
# with CUDA and vLLM's CUDA build; elsewhere they skip.
test-gpu:
	$${PYTHON:-python3} -m pytest -q -m gpu tests/gpu
