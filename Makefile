# Two commands to start with: `make bench` and `make test`. Each builds .venv from nothing when needed
# (scripts/bootstrap.py: reuses an installed torch, installs only what is missing) and then runs.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP_TEST := $(VENV)/.smptk-test
STAMP_DEV := $(VENV)/.smptk-dev
GPU_CHECK_MINUTES ?= 25
# make's start time: gpu-check's budget counts the venv bootstrap too
GPU_CHECK_T0 := $(shell date +%s)
export PYTHONUNBUFFERED := 1

.PHONY: test bench gpu-check lint format info clean

$(STAMP_TEST): pyproject.toml scripts/bootstrap.py
	$(PYTHON) scripts/bootstrap.py --venv $(VENV) --extras test --optional-extras parallel-tests,planner-tests
	touch $@

$(STAMP_DEV): pyproject.toml scripts/bootstrap.py
	$(PYTHON) scripts/bootstrap.py --venv $(VENV) --extras dev
	touch $@

## test: the whole test suite (CPU: kernels under the Triton interpreter; GPU: real shapes too). TEST_WORKERS=N
## spreads it over N pytest-xdist workers where xdist is installed (tests/conftest.py keeps the multi-process
## jobs on one worker); the default, 0, runs in one process: on 2 cores, two workers oversubscribed the
## machine and the multi-rank jobs ran past their deadlines
TEST_WORKERS ?= 0
test: $(STAMP_TEST)
	$(VPY) -m pytest $$($(VPY) -c 'import xdist' 2>/dev/null && [ "$(TEST_WORKERS)" != 0 ] \
	    && echo "-n $(TEST_WORKERS) --dist loadgroup") $(PYTEST_ARGS)

## bench: the benchmark suite and its report (GPU: measured; CPU: quick functional mode)
bench: $(STAMP_TEST)
	$(VPY) -m bench $(BENCH_ARGS)

## gpu-check: the one command a GPU machine runs: GPU tests, every benchmark (targets' cases first) and
## the targets table, all within GPU_CHECK_MINUTES (bench/gpu_check.py; GPU_CHECK_ARGS passes options)
gpu-check: $(STAMP_TEST)
	$(VPY) -m bench.gpu_check --minutes $(GPU_CHECK_MINUTES) --since $(GPU_CHECK_T0) $(GPU_CHECK_ARGS)

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
