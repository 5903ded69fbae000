# `make demo` and `make test` each build the virtual environment they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
CORE_VENV := .venv-core
MIN_VENV := .venv-min
DEMO_VENV := .venv-demo
CORE313_VENV := .venv-core313
PYTHON313 ?= $(shell python3.13 -c 'import sys; print(sys.executable)' 2>/dev/null || ls -d $$(pyenv root 2>/dev/null)/versions/3.13*/bin/python3.13 2>/dev/null | tail -1)
PIP := -m pip install -q --disable-pip-version-check -c constraints.txt

help:  ## this list
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 16

.PHONY: help demo test test-core test-all test-min test-core-313 fuzz bench clean

$(VENV)/.stamp: pyproject.toml constraints.txt
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	DS_BUILD_OPS=0 $(VENV)/bin/python $(PIP) -e '.[dev]'  # deepspeed: no compiled ops (CPU, no CUDA toolkit)
	# keras-hub (the Keras model zoo's BERT/GPT-2/Llama backbones) without its deps: they pull
	# tensorflow-text, hence full tensorflow, which clashes with tensorflow-cpu; the backbones built
	# from arguments need only what .[dev] already has (absl-py, numpy, packaging, regex, rich, tokenizers)
	$(VENV)/bin/python $(PIP) --no-deps keras-hub==0.32.0
	# flaxmodels (the Flax zoo's linen ResNet18) without its deps: it lists the `dataclasses` backport;
	# the rest is already in .[dev]. (recurrentgemma pins numpy<2.4 and absl-py<2; gemma 4 needs Python 3.12)
	$(VENV)/bin/python $(PIP) --no-deps flaxmodels==0.1.3
	# tf-keras (Keras 2) requires full tensorflow, which clashes with tensorflow-cpu (same files): the
	# CPU build already installed is its TensorFlow. torchao (float8 training) would pull another torch.
	$(VENV)/bin/python $(PIP) --no-deps tf-keras==2.21.0 torchao==0.18.0
	touch $@

# framework-free: proves the core needs no framework
$(CORE_VENV)/.stamp: pyproject.toml constraints.txt
	rm -rf $(CORE_VENV)
	$(PYTHON) -m venv $(CORE_VENV)
	$(CORE_VENV)/bin/python $(PIP) -e '.[test]'
	touch $@

# the oldest supported releases (constraints-min.txt), for `make test-min`; the test suites' own
# helpers (jmp, orbax-checkpoint) come from the same file
$(MIN_VENV)/.stamp: pyproject.toml constraints-min.txt
	rm -rf $(MIN_VENV)
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install -q --disable-pip-version-check -c constraints-min.txt \
		-e '.[test,torch,tensorflow,jax]' jmp orbax-checkpoint
	touch $@

# the demo's own environment: the three frameworks and matplotlib, none of the test tools
$(DEMO_VENV)/.stamp: pyproject.toml constraints.txt
	rm -rf $(DEMO_VENV)
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python $(PIP) -e '.[all]'
	touch $@

demo: $(DEMO_VENV)/.stamp  ## train the example policy in torch, Keras and Flax (builds .venv-demo)
	$(DEMO_VENV)/bin/ampbridge demo

# prints its wall and CPU time at the end (bash's time counts every child process)
test:  ## every suite: the core without frameworks, then every backend (CI runs this)
	@TIMEFORMAT='make test: %0R s wall, %0U s user + %0S s system CPU'; time $(MAKE) --no-print-directory test-core test-all

test-core: $(CORE_VENV)/.stamp  ## the framework-free core suite only (about a minute)
	$(CORE_VENV)/bin/python -m pytest tests/core -q

# every backend is required here: a missing framework fails instead of skipping.
# Keras picks its backend once per process, so its tests run again under JAX and torch; tf.keras 2
# (tf_keras) needs TF_USE_LEGACY_KERAS=1 before TensorFlow resolves tf.keras: its own process too.
# The TensorFlow pass (every suite, ~1,900 tests) runs on TEST_WORKERS pytest-xdist workers, a file per
# worker (--dist loadfile: a file's tests run in order in one process, as in a serial run); TEST_WORKERS=0
# runs it serially. The Keras-on-JAX pass stays serial: XLA already compiles on every core (two workers:
# 233 s against 277 s serial, for twice the memory).
# Each worker holds TensorFlow, torch and JAX (up to ~5 GB resident): raise it only with the memory for it.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test-all: $(VENV)/.stamp  ## every backend's suite, Keras under TensorFlow, JAX and torch, and tf.keras 2
	AMPBRIDGE_REQUIRE=all KERAS_BACKEND=tensorflow $(VENV)/bin/python -m pytest -q $(XDIST) --durations=25
	AMPBRIDGE_REQUIRE=all KERAS_BACKEND=jax $(VENV)/bin/python -m pytest -q -m "not heavy" tests/backend_keras
	AMPBRIDGE_REQUIRE=all KERAS_BACKEND=torch $(VENV)/bin/python -m pytest -q -m "not heavy" tests/backend_keras
	AMPBRIDGE_REQUIRE=all TF_USE_LEGACY_KERAS=1 $(VENV)/bin/python -m pytest -q tests/backend_tf_keras

# the differential fuzzers (every tests/**/test_fuzz*.py) with many more, fresh examples than make test's
# seeded few (AMPBRIDGE_FUZZ=1: ampbridge._testing.fuzz_settings); the Keras ones under each Keras backend,
# and the heavy Keras tests (make test runs them under TensorFlow only) under JAX and torch
FUZZ_FILES = $(shell find tests -name 'test_fuzz*.py' | sort)
fuzz: $(VENV)/.stamp  ## the differential fuzzers with many more examples
	@TIMEFORMAT='make fuzz: %0R s wall, %0U s user + %0S s system CPU'; time ( set -e; \
	AMPBRIDGE_FUZZ=1 AMPBRIDGE_REQUIRE=all KERAS_BACKEND=tensorflow $(VENV)/bin/python -m pytest -q $(FUZZ_FILES); \
	for backend in jax torch; do \
		AMPBRIDGE_FUZZ=1 AMPBRIDGE_REQUIRE=all KERAS_BACKEND=$$backend $(VENV)/bin/python -m pytest -q \
			$(filter tests/backend_keras/%,$(FUZZ_FILES)); \
		AMPBRIDGE_REQUIRE=all KERAS_BACKEND=$$backend $(VENV)/bin/python -m pytest -q -m heavy tests/backend_keras; \
	done )

# the floors: the Keras suite on each Keras backend and the JAX suite at constraints-min.txt (the
# torch floor is the newest pin, so the torch suite runs once, in test-all). .ci/run calls it after test.
test-min: $(MIN_VENV)/.stamp  ## the suites at the oldest supported releases
	@TIMEFORMAT='make test-min: %0R s wall, %0U s user + %0S s system CPU'; time ( set -e; \
	for backend in tensorflow jax torch; do \
		AMPBRIDGE_REQUIRE=all KERAS_BACKEND=$$backend $(MIN_VENV)/bin/python -m pytest -q tests/backend_keras; \
	done; \
	AMPBRIDGE_REQUIRE=all KERAS_BACKEND=tensorflow $(MIN_VENV)/bin/python -m pytest -q tests/backend_jax )

# the core suite on Python 3.13 (requires-python's newest tested): python3.13 on PATH or pyenv's,
# else one line saying so (no download of an interpreter)
test-core-313:  ## the core suite on Python 3.13
	@if [ -z "$(PYTHON313)" ]; then echo "test-core-313: no python3.13 (PATH or pyenv): the core suite ran on $$($(PYTHON) --version) only"; else \
	set -e; [ -f $(CORE313_VENV)/.stamp ] && [ $(CORE313_VENV)/.stamp -nt pyproject.toml ] && [ $(CORE313_VENV)/.stamp -nt constraints.txt ] || { \
	rm -rf $(CORE313_VENV); $(PYTHON313) -m venv $(CORE313_VENV); \
	$(CORE313_VENV)/bin/python $(PIP) -e '.[test]'; touch $(CORE313_VENV)/.stamp; }; \
	$(CORE313_VENV)/bin/python --version; $(CORE313_VENV)/bin/python -m pytest tests/core -q; fi

bench: $(VENV)/.stamp  ## speed and counts against native AMP (docs/benchmarks.md)
	$(VENV)/bin/python benchmarks/run.py

clean:  ## remove the virtual environments
	rm -rf $(VENV) $(CORE_VENV) $(MIN_VENV) $(CORE313_VENV) $(DEMO_VENV) build *.egg-info
