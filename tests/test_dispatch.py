"""smptk's forwards as dispatcher ops (``smptk.kernels._dispatch``): what a torch dispatch mode sees of them.

- Under a pass-through mode every kernel's forward is one op ``smptk::<name>`` (the mode sees it, and not the
  Triton launch's ``empty``), and its outputs and gradients equal the direct call's bit for bit.
- Under FakeTensorMode the forwards propagate shapes through the ops' fake implementations, launching
  nothing (the grouped ones skip the check of fake offsets' values, which a fake tensor does not have).
- ``dispatcher_op`` itself: the function runs outside any mode either way, and the op joins ``OPS``; under
  ``torch.compile`` it is not traced (a graph break), so the Triton path runs as it does eagerly.
- Second derivatives: the Triton path's backward raises when asked to build a graph (``create_graph=True``)
  instead of dropping or miscomputing the second-order term (a gradient penalty through ``fused_linear``
  used to lose it silently, and ``swiglu``'s came out wrong).
Selective checkpointing, the reason for all this, is tested in tests/test_checkpointing.py (kernels) and in
the multi-rank jobs of tests/test_comm_functional.py and tests/test_fused_tp.py (collectives).
"""

from __future__ import annotations

import doctest

import pytest
import torch
from helpers import skip_unless_triton_on_cpu
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from smptk.kernels import _dispatch, fused_linear, grouped_linear, grouped_swiglu, swiglu


class _Seen(TorchDispatchMode):
    """Records the name of every op dispatched, and runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.name())
        return func(*args, **(kwargs or {}))


OFFSETS = torch.tensor([0, 3, 3, 7])


def _calls(offsets: torch.Tensor = OFFSETS):
    """Each kernel with small odd shapes: ``name -> (op name, fn(tensors) -> output, input tensors)``; the
    grouped ones take ``offsets`` (3 experts, 7 rows)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    return {
        "fused_linear": (
            "smptk::fused_linear_fwd",
            lambda x, w, b: fused_linear(x, w, b, activation="gelu"),
            [r(2, 5, 12), r(9, 12), r(9)],
        ),
        "swiglu": ("smptk::swiglu_fwd", swiglu, [r(7, 12), r(10, 12), r(10, 12)]),
        "grouped_linear": (
            "smptk::grouped_linear_fwd",
            lambda x, w, b: grouped_linear(x, w, offsets, bias=b, activation="silu"),
            [r(7, 12), r(3, 9, 12), r(3, 9)],
        ),
        "grouped_swiglu": (
            "smptk::grouped_swiglu_fwd",
            lambda x, wg, wu: grouped_swiglu(x, wg, wu, offsets),
            [r(7, 12), r(3, 10, 12), r(3, 10, 12)],
        ),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_a_mode_sees_one_op_with_the_same_results(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    skip_unless_triton_on_cpu(monkeypatch)
    op, fn, inputs = _calls()[name]
    results = {}
    for mode in ("direct", "mode"):
        leaves = [t.clone().requires_grad_() for t in inputs]
        seen = _Seen()
        if mode == "mode":
            with seen:
                out = fn(*leaves)
            assert seen.ops.count(op) == 1, seen.ops
            assert "aten::empty.memory_format" not in seen.ops, "the launch's buffers were dispatched"
        else:
            out = fn(*leaves)
        up = torch.ones_like(out)
        results[mode] = (out.detach(), *torch.autograd.grad(out, leaves, up))
    for got, want in zip(results["mode"], results["direct"], strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", list(_calls()))
def test_fake_tensors_get_shapes_without_a_launch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forwards propagate shapes through fake tensors; the grouped ones leave fake offsets' values
    unchecked (there are none: they used to read them and raise DataDependentOutputException)."""
    skip_unless_triton_on_cpu(monkeypatch)
    _, fn, inputs = _calls()[name]
    want = fn(*inputs).shape
    fake = FakeTensorMode()
    _, fn, inputs = _calls(fake.from_tensor(OFFSETS))[name]
    import smptk.kernels._gemm as gemm  # imported by the call above

    def no_launch(*args, **kwargs):
        raise AssertionError("a GEMM was launched on fake tensors")

    for launcher in ("matmul", "swiglu_matmul", "grouped_matmul", "grouped_swiglu_matmul"):
        monkeypatch.setattr(gemm, launcher, no_launch)
    with fake:
        out = fn(*[fake.from_tensor(t) for t in inputs])
    assert out.shape == want


@pytest.mark.parametrize("name", list(_calls()))
def test_second_derivatives_raise(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    skip_unless_triton_on_cpu(monkeypatch)
    _, fn, inputs = _calls()[name]
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    with pytest.raises(RuntimeError, match=rf"^{name}: no second derivative .*SMPTK_KERNELS=torch"):
        torch.autograd.grad(out.sum(), leaves[0], create_graph=True)  # a gradient penalty's first step
    (gx,) = torch.autograd.grad(fn(*leaves).sum(), leaves[0])  # without a graph: as before
    assert not gx.requires_grad and gx.shape == leaves[0].shape


@pytest.mark.parametrize("name", list(_calls()))
def test_torch_compile_runs_the_kernels_eagerly(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``torch.compile`` (graph breaks allowed) the Triton path is left out of the graph and runs as
    it does eagerly, forward and backward: Dynamo used to trace into the launch (under the interpreter, into
    the interpreter itself) and fail."""
    skip_unless_triton_on_cpu(monkeypatch)
    _, fn, inputs = _calls()[name]
    results = []
    for run in (fn, torch.compile(fn, backend="eager")):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = run(*leaves)
        results.append((out.detach(), *torch.autograd.grad(out.square().sum(), leaves)))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def test_dispatcher_op_registers_its_function() -> None:
    """The caller runs the function (directly without a mode, through ``smptk::<name>`` under one, where the
    mode sees the op and not what the function runs), and the op joins ``OPS``."""
    depth = []

    @_dispatch.dispatcher_op("test_probe", fake=lambda x: torch.empty_like(x))
    def probe(x: torch.Tensor) -> torch.Tensor:
        depth.append(torch._C._len_torch_dispatch_stack())
        return x + 1

    x, one = torch.zeros(2), torch.ones(2)
    assert torch.equal(probe(x), one)
    with _Seen() as seen:
        y = probe(x)
    assert torch.equal(y, one)
    assert seen.ops == ["smptk::test_probe"], "the mode sees the op, not the add inside it"
    assert depth == [0, 0], "the function runs outside any mode both times"
    assert probe.op is torch.ops.smptk.test_probe.default and probe.op in _dispatch.OPS


def test_examples() -> None:
    result = doctest.testmod(_dispatch, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
