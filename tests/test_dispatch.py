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
import torch.nn.functional as F
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


class _Outputs(TorchDispatchMode):
    """Runs every op and records each smptk op's outputs' sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.name().startswith("smptk::"):
            self.sizes[func.name()] = [t.numel() for t in out]
        return out


@pytest.mark.parametrize("name", list(_calls()))
def test_no_grad_writes_no_saved_activation(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``torch.no_grad()`` (parameters still requiring grad, the usual inference) the forward writes
    no pre-activation / gate-up buffer for backward: its second output is empty. It used to write it,
    since a Function's ``needs_input_grad`` follows requires_grad whatever the grad mode."""
    skip_unless_triton_on_cpu(monkeypatch)
    op, fn, inputs = _calls()[name]
    leaves = [t.clone().requires_grad_() for t in inputs]
    for grad_mode, saved in ((True, True), (False, False)):
        with torch.set_grad_enabled(grad_mode), _Outputs() as seen:
            out = fn(*leaves)
        assert out.requires_grad == grad_mode
        assert (seen.sizes[op][1] > 0) == saved, (grad_mode, seen.sizes)


@pytest.mark.parametrize("name", list(_calls()))
@pytest.mark.parametrize("frozen", ["x", "weights"])
def test_unread_inputs_are_not_saved(name: str, frozen: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """x is saved only for the weights' gradient and the weights only for x's, as F.linear does: with the
    weights frozen (adapter fine-tuning) x's memory is not kept for backward, with x frozen the weights are
    not; the gradients equal the ones computed with everything trainable."""
    skip_unless_triton_on_cpu(monkeypatch)
    _, fn, inputs = _calls()[name]
    trainable = [t.clone().requires_grad_() for t in inputs]
    want = torch.autograd.grad(fn(*trainable).square().sum(), trainable)
    learns = [frozen == "weights"] + [frozen == "x"] * (len(inputs) - 1)
    leaves = [t.clone().requires_grad_(learn) for t, learn in zip(inputs, learns, strict=True)]
    kept = set()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.add(t.data_ptr()) or t, lambda t: t):
        out = fn(*leaves)
    unread = leaves[:1] if frozen == "weights" else leaves[1:]  # what no gradient asked for reads
    assert not kept & {t.data_ptr() for t in unread}, "an input no gradient reads was saved for backward"
    got = torch.autograd.grad(out.square().sum(), [t for t in leaves if t.requires_grad])
    for g, w in zip(got, [w for w, learn in zip(want, learns, strict=True) if learn], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_inference_inputs_with_a_trainable_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    """x and weight made under inference_mode, only the bias trainable: the bias gradient comes back, as
    with F.linear (saving x and weight, which no gradient reads, used to raise "Inference tensors cannot be
    saved for backward")."""
    skip_unless_triton_on_cpu(monkeypatch)
    _, fn, (x, w, b) = _calls()["fused_linear"]
    with torch.inference_mode():
        x, w = x.clone(), w.clone()
    b = b.clone().requires_grad_()
    (db,) = torch.autograd.grad(fn(x, w, b).square().sum(), b)
    ref = b.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(F.gelu(F.linear(x, w, ref)).square().sum(), ref)
    torch.testing.assert_close(db, want, rtol=1e-5, atol=1e-5)


def test_swiglu_one_trainable_weight_gets_a_gradient_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """With only weight_gate trainable, its gradient is its own ``[N, K]`` (it was a view of a ``[2N, K]``
    buffer holding the frozen weight_up's too, and the GEMM computed both)."""
    skip_unless_triton_on_cpu(monkeypatch)
    _, fn, (x, wg, wu) = _calls()["swiglu"]
    wg = wg.clone().requires_grad_()
    fn(x, wg, wu).square().sum().backward()
    ref = wg.detach().clone().requires_grad_()
    (F.silu(x @ ref.T) * (x @ wu.T)).square().sum().backward()
    assert wg.grad.untyped_storage().nbytes() == wg.numel() * wg.element_size()
    torch.testing.assert_close(wg.grad, ref.grad, rtol=1e-5, atol=1e-5)


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


def test_compiled_second_derivatives_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled, the Triton path's Function runs as it does eagerly (a graph break), so a second derivative
    through it raises naming the op, as an eager call does, instead of coming back without its term."""
    skip_unless_triton_on_cpu(monkeypatch)
    _, fn, inputs = _calls()["fused_linear"]
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = torch.compile(fn, backend="aot_eager")(*leaves)
    with pytest.raises(RuntimeError, match=r"^fused_linear: no second derivative"):
        torch.autograd.grad(out.square().sum(), leaves[0], create_graph=True)


def test_export_of_a_module_on_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Non-strict ``torch.export.export`` of a module calling fused_linear (bias, GELU) and swiglu, with a
    dynamic batch and sequence: the program holds the ops ``smptk::fused_linear_fwd`` / ``swiglu_fwd``
    (traced through their fake implementations) and runs to the eager module's results at other sizes."""
    skip_unless_triton_on_cpu(monkeypatch)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w, self.b = torch.nn.Parameter(torch.randn(9, 12)), torch.nn.Parameter(torch.randn(9))
            self.wg, self.wu = torch.nn.Parameter(torch.randn(5, 9)), torch.nn.Parameter(torch.randn(5, 9))

        def forward(self, x):
            return swiglu(fused_linear(x, self.w, self.b, activation="gelu"), self.wg, self.wu)

    block = Block()
    dims = {"x": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}}
    program = torch.export.export(block, (torch.randn(2, 7, 12),), dynamic_shapes=dims, strict=False)
    ops = {str(n.target) for n in program.graph_module.graph.nodes if n.op == "call_function"}
    assert {"smptk.fused_linear_fwd.default", "smptk.swiglu_fwd.default"} <= ops, ops
    for shape in ((2, 7, 12), (3, 5, 12), (1, 11, 12)):
        x = torch.randn(*shape)
        torch.testing.assert_close(program.module()(x), block(x), rtol=1e-5, atol=1e-5)


def test_torch_compile_runs_the_moe_kernels_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """moe_route, moe_dispatch and moe_combine (not dispatcher ops) are left out of the graph too: Dynamo
    traced into their Triton launches and failed (under the interpreter: KeyError(torch.uint64)); and a
    capacity under dynamic shapes (a second batch size) no longer multiplies a Fraction by a SymInt."""
    from smptk.kernels import moe_combine, moe_dispatch, moe_route

    gen = torch.Generator().manual_seed(0)

    def layer(logits, x):
        routing = moe_route(logits, 2)
        grouped, plan = moe_dispatch(x, routing.expert_ids, 4, capacity_factor=1.0)
        return moe_combine(grouped * 2, plan, routing.weights)

    for path in ("triton", "torch"):
        if path == "triton":
            skip_unless_triton_on_cpu(monkeypatch)
        else:
            monkeypatch.setenv("SMPTK_KERNELS", "torch")
        compiled = torch.compile(layer, backend="eager")
        for T in (8, 6):  # the second size makes T dynamic
            logits, x = torch.randn(T, 4, generator=gen), torch.randn(T, 16, generator=gen)
            results = []
            for run in (layer, compiled):
                leaves = [t.clone().requires_grad_() for t in (logits, x)]
                out = run(*leaves)
                results.append((out.detach(), *torch.autograd.grad(out.square().sum(), leaves)))
            for got, want in zip(*results, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{path} T={T}")


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


def test_a_compiled_model_on_every_kernel_stays_under_the_recompile_limit(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A model on all four GEMM ops and the MoE kernels, compiled (aot_eager), at two batch sizes: no Dynamo
    frame reaches the recompile limit (here a hard error), and the results equal eager's. The ops' callers
    (``outside_graphs``) shared one code object, on which Dynamo piled a compiled frame per wrapped function
    and per argument signature: it hit the limit (8) with this model."""
    from smptk.kernels import moe_combine, moe_dispatch, moe_route

    skip_unless_triton_on_cpu(monkeypatch)
    g = torch.Generator().manual_seed(0)
    r = lambda *s: (torch.randn(*s, generator=g) / 3).requires_grad_()
    w1, b1, wg, wu, wr = r(9, 12), r(9), r(10, 9), r(10, 9), r(3, 10)
    we, be, wge, wue = r(3, 7, 10), r(3, 7), r(3, 5, 7), r(3, 5, 7)
    params = [w1, b1, wg, wu, wr, we, be, wge, wue]

    def model(x):
        h = swiglu(fused_linear(x, w1, b1, activation="gelu"), wg, wu)
        routing = moe_route(h @ wr.t(), 2)
        grouped, plan = moe_dispatch(h, routing.expert_ids, 3)
        grouped = grouped_linear(grouped, we, plan.offsets, bias=be, activation="silu")
        out = moe_combine(grouped_swiglu(grouped, wge, wue, plan.offsets), plan, routing.weights)
        return fused_linear(out, w1[:, :5])

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for T in (6, 5):
                x = torch.randn(T, 12, generator=g)
                results = []
                for run in (model, compiled):
                    out = run(x)
                    results.append((out.detach(), *torch.autograd.grad(out.square().sum(), params)))
                for got, want in zip(*results, strict=True):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"T={T}")
    finally:
        torch._dynamo.reset()
    assert not [m for m in caplog.messages if "recompile_limit" in m]
