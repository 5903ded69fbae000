# `make demo` and `make test` each build the virtual environment they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
CORE_VENV := .venv-core
PIP := -m pip install -q --disable-pip-version-check -c constraints.txt

.PHONY: demo test test-core test-all bench clean

$(VENV)/.stamp: pyproject.toml constraints.txt
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	DS_BUILD_OPS=0 $(VENV)/bin/python $(PIP) -e '.[dev]'  # deepspeed: no compiled ops (CPU, no CUDA toolkit)
	touch $@

# framework-free: proves the core needs no framework
$(CORE_VENV)/.stamp: pyproject.toml constraints.txt
	rm -rf $(CORE_VENV)
	$(PYTHON) -m venv $(CORE_VENV)
	$(CORE_VENV)/bin/python $(PIP) -e '.[test]'
	touch $@

demo: $(VENV)/.stamp
	$(VENV)/bin/ampbridge demo

# prints its wall and CPU time at the end (bash's time counts every child process)
test:
	@TIMEFORMAT='make test: %0R s wall, %0U s user + %0S s system CPU'; time $(MAKE) --no-print-directory test-core test-all

test-core: $(CORE_VENV)/.stamp
	$(CORE_VENV)/bin/python -m pytest tests/core -q

# every backend is required here: a missing framework fails instead of skipping.
# Keras picks its backend once per process, so its tests run again under JAX and torch.
test-all: $(VENV)/.stamp
	AMPBRIDGE_REQUIRE=all KERAS_BACKEND=tensorflow $(VENV)/bin/python -m pytest -q
	AMPBRIDGE_REQUIRE=all KERAS_BACKEND=jax $(VENV)/bin/python -m pytest -q tests/backend_keras
	AMPBRIDGE_REQUIRE=all KERAS_BACKEND=torch $(VENV)/bin/python -m pytest -q tests/backend_keras

bench: $(VENV)/.stamp
	$(VENV)/bin/python benchmarks/run.py

clean:
	rm -rf $(VENV) $(CORE_VENV) build *.egg-info
