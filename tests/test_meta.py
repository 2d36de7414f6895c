"""Tensors on the ``meta`` device: every public op propagates shapes and dtypes as it does on real tensors.

Each op runs twice on the same shapes: on CPU (the PyTorch path, the shapes to match) and on ``meta``
copies of the inputs under every ``SMPTK_KERNELS`` value (runtime routes meta to the PyTorch path, even
when Triton is forced); outputs and, through autograd, gradients must have the CPU run's shapes and
dtypes. The one documented difference: ``moe_dispatch`` with a capacity sizes ``x_grouped`` by the bound
``min(T * k, E * C)`` on meta, since there are no ids to count. ``smptk.parallel.MoE`` is built under
``torch.device("meta")`` (delayed initialization), run forward and backward, then materialized with
``to_empty`` + ``reset_parameters`` and checked against a layer built on CPU from the same seed.

grouped_linear / grouped_swiglu (and so the MoE layer) need two meta guards in
``smptk/kernels/grouped_linear.py`` (``_check_offsets`` and ``_per_expert``: no offsets to read on meta);
their tests here fail with "Cannot copy out of meta tensor" until those land.
"""

from __future__ import annotations

import pytest
import torch

from smptk.kernels import (
    fused_linear,
    grouped_linear,
    grouped_swiglu,
    moe_combine,
    moe_dispatch,
    moe_route,
    runtime,
    swiglu,
)
from smptk.parallel import MoE

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["float32", "float16", "bfloat16"]


def to_meta(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of t's shape, dtype and strides, a leaf that requires grad where t does."""
    return t.detach().to("meta").requires_grad_(t.requires_grad)


def flat(out) -> list[torch.Tensor]:
    """The tensors of an op's result (a tensor, a tuple, a MoERouting, a (tensor, plan) pair)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "offsets"):  # MoEDispatchPlan
        return [out.offsets, out.tokens_per_expert, out.dest, out.source_token, out.source_pair]
    return [t for item in out for t in flat(item)]


def assert_same_meta(meta_out, cpu_out) -> None:
    got, want = flat(meta_out), flat(cpu_out)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.device.type == "meta", f"output {i} is on {g.device}"
        assert (g.shape, g.dtype) == (w.shape, w.dtype), (
            f"output {i}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        )


def run_both(monkeypatch, path: str, op, inputs: list[torch.Tensor], grad_of=None) -> None:
    """op(*inputs) on CPU (torch path) and on meta (``path``): same output and gradient shapes/dtypes.

    ``grad_of`` picks the differentiable output (default: the op's result itself)."""
    grad_of = grad_of or (lambda out: out)
    monkeypatch.setenv("SMPTK_KERNELS", "torch")
    cpu_out = op(*inputs)
    grad_of(cpu_out).float().square().sum().backward()
    meta_inputs = [to_meta(t) for t in inputs]
    monkeypatch.setenv("SMPTK_KERNELS", path)
    meta_out = op(*meta_inputs)
    assert_same_meta(meta_out, cpu_out)
    grad_of(meta_out).float().square().sum().backward()
    for i, (m, c) in enumerate(zip(meta_inputs, inputs, strict=True)):
        if c.requires_grad:
            assert m.grad is not None, f"input {i} got no gradient on meta"
            assert (m.grad.device.type, m.grad.shape, m.grad.dtype) == ("meta", c.grad.shape, c.grad.dtype)


PATHS = pytest.mark.parametrize("path", ["auto", "triton", "torch"])
DTYPE = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)


def randn(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


@PATHS
@DTYPE
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_fused_linear(monkeypatch, path, dtype, activation):
    x, w, b = randn(2, 3, 16, dtype=dtype), randn(7, 16, dtype=dtype), randn(7, dtype=dtype)
    run_both(monkeypatch, path, lambda x, w, b: fused_linear(x, w, b, activation=activation), [x, w, b])


@PATHS
@DTYPE
def test_swiglu(monkeypatch, path, dtype):
    x, wg, wu = randn(2, 3, 16, dtype=dtype), randn(7, 16, dtype=dtype), randn(7, 16, dtype=dtype)
    run_both(monkeypatch, path, swiglu, [x, wg, wu])


def test_meta_under_autocast_is_left_alone():
    """Autocast does not exist for meta (asking raises); inputs pass unchanged, as in F.linear."""
    x, w = torch.randn(4, 8, device="meta"), torch.randn(5, 8, device="meta")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fused_linear(x, w)
    assert (y.device.type, y.shape, y.dtype) == ("meta", (4, 5), torch.float32)


OFFSETS = torch.tensor([0, 2, 2, 7])  # three experts, the middle one empty


@PATHS
@DTYPE
def test_grouped_linear(monkeypatch, path, dtype):
    x, w, b = randn(7, 16, dtype=dtype), randn(3, 5, 16, dtype=dtype), randn(3, 5, dtype=dtype)

    def op(x, w, b, offsets):
        return grouped_linear(x, w, offsets, bias=b, activation="silu")

    run_both(monkeypatch, path, op, [x, w, b, OFFSETS])


@PATHS
@DTYPE
def test_grouped_swiglu(monkeypatch, path, dtype):
    x, wg, wu = randn(7, 16, dtype=dtype), randn(3, 5, 16, dtype=dtype), randn(3, 5, 16, dtype=dtype)
    run_both(monkeypatch, path, grouped_swiglu, [x, wg, wu, OFFSETS])


@PATHS
@DTYPE
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "expert-bias"])
def test_moe_route(monkeypatch, path, dtype, score_func, bias):
    logits = randn(9, 6, dtype=dtype)
    inputs = [logits, torch.randn(6)] if bias else [logits]

    def op(logits, expert_bias=None):
        return moe_route(logits, 2, score_func=score_func, expert_bias=expert_bias)

    run_both(monkeypatch, path, op, inputs, grad_of=lambda r: r.weights.sum() + r.aux_loss + r.z_loss)


@PATHS
@DTYPE
def test_moe_dispatch_and_combine_without_capacity(monkeypatch, path, dtype):
    x, ids, w = randn(9, 16, dtype=dtype), torch.randint(0, 4, (9, 2)), randn(9, 2)

    def op(x, ids, w):
        x_grouped, plan = moe_dispatch(x, ids, 4)
        return moe_combine(x_grouped * 2, plan, w), (x_grouped, plan)

    run_both(monkeypatch, path, op, [x, ids, w], grad_of=lambda out: out[0])


@PATHS
@pytest.mark.parametrize(
    ("T", "k", "E", "factor", "rows"),
    [(9, 2, 4, 1.0, 18), (9, 2, 4, 0.5, 12), (8, 1, 4, 0.25, 4), (3, 2, 8, 4.0, 6)],
    ids=["C5-bound-P", "C3-bound-EC", "C1", "C-larger-than-P"],
)
def test_moe_dispatch_with_capacity_takes_the_row_bound(monkeypatch, path, T, k, E, factor, rows):
    """With a capacity the kept rows depend on the ids' values: meta gives R = min(T * k, E * C)."""
    monkeypatch.setenv("SMPTK_KERNELS", path)
    x = torch.randn(T, 16, device="meta", requires_grad=True)
    ids = torch.empty(T, k, dtype=torch.int32, device="meta")
    x_grouped, plan = moe_dispatch(x, ids, E, capacity_factor=factor)
    assert x_grouped.shape == (rows, 16) and plan.num_rows == rows
    assert plan.num_dropped == T * k - rows and plan.capacity is not None
    assert plan.offsets.shape == (E + 1,) and plan.dest.shape == (T, k) and plan.source_pair.shape == (rows,)
    out = moe_combine(x_grouped, plan, torch.empty(T, k, device="meta"))
    assert (out.device.type, out.shape) == ("meta", (T, 16))
    out.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("requested", ["auto", "triton", "torch"])
def test_select_path_sends_meta_to_torch_even_when_triton_is_forced(monkeypatch, requested):
    """Meta has nothing to compute: a process forcing Triton for training can still trace on meta."""
    monkeypatch.setenv("SMPTK_KERNELS", requested)
    for dtype in DTYPES:
        assert runtime.select_path(torch.empty(2, device="meta", dtype=dtype)) == "torch"
    y = fused_linear(torch.randn(4, 8, device="meta"), torch.randn(3, 8, device="meta"))
    assert (y.device.type, y.shape) == ("meta", (4, 3))


# --- the MoE layer ------------------------------------------------------------------------------------------

LAYERS = {
    "dropless": {},
    "capacity": {"capacity_factor": 1.0},
    "shared-sigmoid-bias": {"num_shared_experts": 1, "score_func": "sigmoid", "expert_bias": True},
    "losses": {"aux_loss_coef": 0.01, "z_loss_coef": 0.001},
}


@PATHS
@pytest.mark.parametrize("kwargs", LAYERS.values(), ids=LAYERS.keys())
def test_moe_layer_on_meta(monkeypatch, path, kwargs):
    monkeypatch.setenv("SMPTK_KERNELS", path)
    with torch.device("meta"):
        moe = MoE(16, 24, num_experts=4, top_k=2, **kwargs)
    x = torch.randn(2, 5, 16, device="meta")
    y = moe(x)
    assert (y.device.type, y.shape, y.dtype) == ("meta", x.shape, x.dtype)
    assert moe.aux_loss.shape == () and moe.tokens_per_expert.device.type == "meta"
    (y.square().mean() + moe.aux_loss).backward()
    for name, p in moe.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name


def test_moe_layer_delayed_initialization(monkeypatch):
    """Built on meta, materialized with to_empty + reset_parameters: the same layer as one built on CPU
    from the same seed, buffers included (to_empty leaves them uninitialized)."""
    monkeypatch.setenv("SMPTK_KERNELS", "torch")
    kwargs = {"num_shared_experts": 1, "expert_bias": True, "capacity_factor": 1.25}
    torch.manual_seed(0)
    eager = MoE(16, 24, num_experts=4, top_k=2, **kwargs)
    with torch.device("meta"):
        lazy = MoE(16, 24, num_experts=4, top_k=2, **kwargs)
    lazy.to_empty(device="cpu")
    torch.manual_seed(0)
    lazy.reset_parameters()
    for (name, a), (_, b) in zip(eager.state_dict().items(), lazy.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(eager.tokens_per_expert, lazy.tokens_per_expert)  # not in the state dict
    x = torch.randn(3, 16)
    assert torch.equal(eager(x), lazy(x))
