# Two commands to start with: `make bench` and `make test`. Each builds .venv from nothing when needed
# (scripts/bootstrap.py: reuses an installed torch, installs only what is missing) and then runs.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP_TEST := $(VENV)/.smptk-test
STAMP_DEV := $(VENV)/.smptk-dev
export PYTHONUNBUFFERED := 1

.PHONY: test bench lint format info clean

$(STAMP_TEST): pyproject.toml scripts/bootstrap.py
	$(PYTHON) scripts/bootstrap.py --venv $(VENV) --extras test
	touch $@

$(STAMP_DEV): pyproject.toml scripts/bootstrap.py
	$(PYTHON) scripts/bootstrap.py --venv $(VENV) --extras dev
	touch $@

## test: the whole test suite (CPU: kernels under the Triton interpreter; GPU: real shapes too)
test: $(STAMP_TEST)
	$(VPY) -m pytest $(PYTEST_ARGS)

## bench: the benchmark suite and its report (GPU: measured; CPU: quick functional mode)
bench: $(STAMP_TEST)
	$(VPY) -m bench $(BENCH_ARGS)

## info: versions, GPUs and which kernel path will run
info: $(STAMP_TEST)
	$(VPY) -m smptk info

## lint: ruff check and format check
lint: $(STAMP_DEV)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP_DEV)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .benchmarks
