"""The docstring examples run as written: ``doctest`` over every module whose examples are self-contained.

One test case per entry of ``MODULES``: each ``>>>`` example of the module (its docstring, its functions',
classes' and methods') runs with the module's globals and ``ELLIPSIS | NORMALIZE_WHITESPACE``, and a
failure carries doctest's report. ``OBJECTS`` adds single functions whose examples are self-contained in
modules whose other examples are not. In the modules listed, an example that needs CUDA carries the
doctest directive ``+SKIP`` after a comment saying so. Left out: the modules whose examples need a
multi-process job (smptk.comm, most of smptk.parallel) or a GPU (the dense kernels' module docstrings),
and smptk._env and smptk.cli (their outputs are this machine's versions and GPUs). smptk.kernels.runtime's
examples set ``SMPTK_KERNELS`` / ``TRITON_INTERPRET`` themselves, so conftest's interpreter does not matter.

The examples run on the PyTorch path (``SMPTK_KERNELS=torch``): what a CPU user pasting them gets by
default (no ``TRITON_INTERPRET``), and far faster than the interpreter conftest enables (the MoE layer's
examples: about 2 s against 30 s there). The kernels' own tests cover the Triton path. What an example
changes for the rest of the session is put back: the environment (the settings example leaves an invalid
``SMPTK_POISON_OUTPUTS``), torch's CPU generator (examples seed it), smptk.parallel's state and the
default process group (the config examples make and end one; an example that fails midway would not).
"""

from __future__ import annotations

import doctest
import importlib
import io
import os

import pytest
import torch
import torch.distributed as dist

import smptk.parallel as sp

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

MODULES = [
    "smptk._precision",
    "smptk.settings",
    "smptk.kernels._codegen",
    "smptk.kernels._dispatch",
    "smptk.kernels.moe_dispatch",
    "smptk.kernels.moe_route",
    "smptk.kernels.runtime",
    "smptk.parallel.checkpointing",
    "smptk.parallel.clip",
    "smptk.parallel.config",
    "smptk.parallel.moe",
    "smptk.parallel.planner.advise",
    "smptk.parallel.planner.clusters",
    "smptk.parallel.planner.estimate",
    "smptk.parallel.planner.models",
    "smptk.testing.grouped",
    "smptk.testing.moe",
    "smptk.testing.moe_layer",
    "smptk.testing.references",
    "smptk.testing.tolerances",
    "smptk.testing.transformer",
]

# "module:function": the examples of that function alone (one process, no process group).
OBJECTS = [
    "smptk.comm.collectives:configure",
    "smptk.comm.simulated:world_mode_label",
    "smptk.parallel.dcp:checkpoint_keys",
    "smptk.parallel.dcp:get_full_state_dict",
    "smptk.parallel.dcp:save_checkpoint",
    "smptk.parallel.transform:hf_layout",
    "smptk.parallel.transform:smptk_layout",
]


def _doctests(entry: str) -> list[doctest.DocTest]:
    module_name, _, qualname = entry.partition(":")
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder()
    if not qualname:
        return finder.find(module)
    return finder.find(getattr(module, qualname), f"{module_name}.{qualname}", module=module)


def _restore_environ(saved: dict[str, str]) -> None:
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@pytest.fixture
def isolated():
    """The torch path, and the session's state back as it was after the examples."""
    environ, rng = os.environ.copy(), torch.random.get_rng_state()
    had_group, had_state = dist.is_initialized(), sp.is_initialized()
    os.environ["SMPTK_KERNELS"] = "torch"
    try:
        yield
    finally:
        if sp.is_initialized() and not had_state:
            sp.reset()
        if dist.is_initialized() and not had_group:
            dist.destroy_process_group()
        _restore_environ(environ)
        torch.random.set_rng_state(rng)


@pytest.mark.parametrize("entry", MODULES + OBJECTS)
def test_docstring_examples(entry, isolated):
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in _doctests(entry):
        runner.run(test, out=report.write)
    if runner.failures:
        pytest.fail(f"{entry}: {runner.failures} of {runner.tries} examples failed\n{report.getvalue()}")
    assert runner.tries > 0, f"{entry}: no example ran (all skipped, or none left)"
