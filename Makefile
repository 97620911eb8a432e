# One command sets up and runs the main job (`make demo`), one sets up and passes the tests (`make test`).
# The CPU wheel of torch is installed first so that the dependency resolver never pulls a CUDA build;
# on a GPU machine install your CUDA torch into .venv before running make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.canzona-installed

.PHONY: setup demo test test-fast validate lab figures bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[notebooks,profiling,dev,torchtitan]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/canzona demo

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

validate: $(STAMP)
	$(VENV)/bin/canzona validate --quick

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

figures: $(STAMP)
	$(VENV)/bin/canzona figures --out figures/

bench: $(STAMP)
	$(PY) profiling/bench_planner.py
	$(PY) profiling/bench_optimizers.py
	$(PY) profiling/bench_strategies.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis figures runs
