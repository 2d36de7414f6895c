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

# compat-check's environment: the GPU image's Triton beside the CI's torch (numpy < 2: Triton 3.6's
# interpreter calls int() on 1-element arrays, which NumPy 2 refuses)
COMPAT_VENV ?= .venv-triton36
COMPAT_PINS ?= triton==3.6.0 numpy<2
STAMP_COMPAT := $(COMPAT_VENV)/.smptk-compat

.PHONY: test compat-check bench gpu-check lint format info clean

$(STAMP_TEST): pyproject.toml scripts/bootstrap.py
	$(PYTHON) scripts/bootstrap.py --venv $(VENV) --extras test --optional-extras parallel-tests,planner-tests
	touch $@

$(STAMP_COMPAT): pyproject.toml scripts/bootstrap.py
	$(PYTHON) scripts/bootstrap.py --venv $(COMPAT_VENV) --extras test $(foreach p,$(COMPAT_PINS),--pin '$(p)')
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

## compat-check: the compile checks (every kernel compiles; the GEMMs' wgmma / TMA, the collectives' 128-bit
## accesses, spills) for sm_90 under Triton 3.6, the version of the GPU image, which CI's .venv does not have:
## the quick set, then every TMA GEMM variant of the full table (every epilogue, bf16 and fp16: the code an
## H100 runs, where Triton 3.6's per-tile descriptors take the grouped kernels to 255 registers)
compat-check: $(STAMP_COMPAT)
	$(COMPAT_VENV)/bin/python -m pytest tests/test_kernels_compile.py tests/test_comm_ptx.py -k "not sm80" \
	    -p no:cacheprovider -q $(PYTEST_ARGS)
	SMPTK_COMPILE_ALL=1 $(COMPAT_VENV)/bin/python -m pytest tests/test_kernels_compile.py \
	    -k "gemm-sm90 and -tma-" -p no:cacheprovider -q $(PYTEST_ARGS)

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
	rm -rf $(VENV) $(COMPAT_VENV) .pytest_cache .ruff_cache .benchmarks
