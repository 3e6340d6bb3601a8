# kvtier: `make demo` runs the main job, `make test` runs the test suite.
# Both create .venv on first use (scripts/setup-venv.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0

$(VENV)/.kvtier-ready: pyproject.toml scripts/setup-venv.sh scripts/install-kvikio.sh
	bash scripts/setup-venv.sh $(VENV)

.PHONY: venv test demo lint bench
venv: $(VENV)/.kvtier-ready

test: $(VENV)/.kvtier-ready
	$(PY) -m pytest -q -m "not soak"

demo: $(VENV)/.kvtier-ready
	$(PY) scripts/demo.py

lint: $(VENV)/.kvtier-ready
	$(VENV)/bin/ruff check .
