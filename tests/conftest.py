"""Shared test setup: the Triton interpreter on CPU-only machines, the ``gpu`` marker, IEEE fp32 matmuls.

Triton decides whether a ``@triton.jit`` function is interpreted when the decorator runs, that is when
``smptk.kernels`` is first imported; so ``TRITON_INTERPRET=1`` is set here, at conftest import, before any
test module imports the kernels. It is set only where torch sees no CUDA device (on a GPU machine the
kernels compile for the GPU and the CPU-interpreter tests skip) and only if the caller has not set it.

Tests that need a GPU carry ``@pytest.mark.gpu`` (registered in pyproject.toml) and skip with
``helpers.CUDA_SKIP_REASON`` where none is visible (the hook below); ``helpers.DEVICES`` parametrizes a
test over CPU and CUDA that way. Shared non-fixture helpers live in ``tests/helpers.py``.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Triton fixes interpretation when it is imported: import it now, under the setting above, so that no test
# decides it for the tests after it in the same process (smptk.kernels.runtime's docstring example imports
# triton with TRITON_INTERPRET cleared; the interpreted collectives run after it then failed).
with contextlib.suppress(ImportError):  # the no-triton tests run without it
    import triton  # noqa: F401
# An xdist worker's PYTEST_XDIST_* variables would reach the processes tests start (the benchmark runs of
# the end-to-end tests), where pytest-benchmark reads PYTEST_XDIST_WORKER as "under xdist" and turns itself
# off. Those processes are not xdist workers: drop the variables (xdist itself keeps its own state).
for _name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
    os.environ.pop(_name, None)

# Imported after TRITON_INTERPRET is set, on purpose (helpers itself never imports smptk.kernels).
from helpers import CUDA_SKIP_REASON, HAS_CUDA  # noqa: E402

# Under pytest-xdist (``make test TEST_WORKERS=2``: ``-n 2 --dist loadgroup``), the modules that
# start processes (multi-rank jobs through tests/comm_harness.py, torchrun) run on one worker, one job at a
# time, as they would without xdist: two jobs at once would oversubscribe the cores and could see each
# other's /dev/shm entries in the leak check. The GEMM compile check compiles in its own worker processes
# and keeps one module-scoped compile per session. Everything else spreads over the workers.
_SPAWNS = ("run_ranks(", "torchrun")
_GROUPS: dict[str, str | None] = {}


def _xdist_group(path: str) -> str | None:
    if path not in _GROUPS:
        name = os.path.basename(path)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if name == "test_kernels_compile.py":
            _GROUPS[path] = "compile"
        elif any(s in text for s in _SPAWNS):
            _GROUPS[path] = "processes"
        else:
            _GROUPS[path] = None
    return _GROUPS[path]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        group = _xdist_group(str(item.path))
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not HAS_CUDA:
        pytest.skip(CUDA_SKIP_REASON)


@pytest.fixture(autouse=True)
def _ieee_fp32_matmul():
    """fp32 references must be IEEE fp32 on CUDA, and the kernels read the same flag: force TF32 off."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved
