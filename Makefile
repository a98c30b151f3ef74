# `make demo` and `make test` each set up .venv on first use (quick no-op afterwards).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DATA_DIR ?= ../shared/data

.PHONY: venv demo test lint test-fast gpu-report clean

$(STAMP): pyproject.toml requirements-lock.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, so pip takes the local CPU wheel instead of a multi-GB CUDA build.
	$(PY) -m pip install -q -c requirements-lock.txt torch==2.13.0
	$(PY) -m pip install -q -c requirements-lock.txt -e ".[test,demo]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py --data_dir $(DATA_DIR)/glue/SST-2

# HF_DPFILTER_NO_SKIP=1: the tests that need the test extra or the data (the quickstart notebook) fail
# instead of skipping, so `make test` always executes them.
test: $(STAMP)
	$(PY) -m ruff check hf_dpfilter tests recipes benchmarks
	HF_DPFILTER_NO_SKIP=1 HF_DPFILTER_DATA=$(abspath $(DATA_DIR)) $(PY) -m pytest -q -m "not slow" --durations=25 tests
	# smoke stage: the README's other command runs as written, so it cannot rot
	$(MAKE) demo

test-fast: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow" tests

# The GPU figures of docs/performance.md (about 25 min on one H100; one line and exit 0 without CUDA). No
# dependency on the set-up stamp: on a machine without network the environment is carried, not installed
# (docs/performance.md, "GPU report"). GPU_PYTHON: the interpreter to use (default .venv's, else python3).
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-report:
	@$(GPU_PYTHON) -m benchmarks gpu-report $(GPU_REPORT_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check hf_dpfilter tests recipes benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
