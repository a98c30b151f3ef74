# `make demo` and `make test` each set up .venv on first use (quick no-op afterwards).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DATA_DIR ?= ../shared/data

.PHONY: venv demo test lint test-fast clean

$(STAMP): pyproject.toml requirements-lock.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, so pip takes the local CPU wheel instead of a multi-GB CUDA build.
	$(PY) -m pip install -q -c requirements-lock.txt torch==2.13.0
	$(PY) -m pip install -q -c requirements-lock.txt -e ".[test,demo]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m hf_dpfilter.demo --data_dir $(DATA_DIR)/glue/SST-2

test: $(STAMP)
	$(PY) -m ruff check hf_dpfilter tests recipes benchmarks
	$(PY) -m pytest -q -m "not slow" tests
	# smoke stage: the README's other command runs as written, so it cannot rot
	$(MAKE) demo

test-fast: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow" tests

lint: $(STAMP)
	$(PY) -m ruff check hf_dpfilter tests recipes benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
