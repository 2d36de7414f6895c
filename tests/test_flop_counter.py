"""``torch.utils.flop_counter.FlopCounterMode`` counts smptk's GEMMs as torch's, forward and backward.

Users measure MFU with FlopCounterMode. Each GEMM op registers its matmul FLOPs with the op
(``dispatcher_op(..., flops=...)``, :mod:`smptk.kernels._dispatch`), and each backward that runs GEMMs is a
dispatcher op of its own, so the counter sees it. Here a model built from smptk's kernels and the same model
in plain torch (``F.linear`` per expert for the grouped ops) give the same total, forward + backward, on the
Triton path (it counted 0 before) and on the PyTorch path; an MoE layer (router, dispatch with a capacity that
drops pairs, grouped SwiGLU experts, shared experts) gives the Triton path the PyTorch path's count. Only
products count, as torch counts only ``mm``-like ops: no bias, activation or SwiGLU epilogue. Each op's
backward, for every set of inputs that want a gradient, counts the products it launches, and launches one
only for a gradient asked for.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
import torch.utils.flop_counter as flop_counter
from helpers import skip_unless_triton_on_cpu
from torch.utils.flop_counter import FlopCounterMode

from smptk.kernels import _dispatch, fused_linear, grouped_linear, grouped_swiglu, swiglu
from smptk.testing import (
    grouped_linear_reference,
    grouped_swiglu_reference,
    linear_reference,
    swiglu_reference,
)

OFFSETS = (0, 4, 4, 11)  # 3 experts, the middle one empty, 11 rows


def _weights(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 11, 12), (9, 12), (9,), (10, 9), (10, 9), (3, 7, 10), (3, 7), (3, 5, 7), (3, 5, 7)]
    return [torch.randn(*s, generator=g) / 2 for s in shapes]


def _smptk_model(x, w1, b1, wg, wu, we, be, wge, wue):
    offsets = torch.tensor(OFFSETS)
    h = fused_linear(x, w1, b1, activation="gelu")
    h = swiglu(h, wg, wu).reshape(-1, wg.shape[0])[: OFFSETS[-1]]
    h = grouped_linear(h, we, offsets, bias=be, activation="silu")
    return grouped_swiglu(h, wge, wue, offsets)


def _torch_model(x, w1, b1, wg, wu, we, be, wge, wue):
    h = F.gelu(F.linear(x, w1, b1))
    h = (F.silu(F.linear(h, wg)) * F.linear(h, wu)).reshape(-1, wg.shape[0])[: OFFSETS[-1]]
    rows = [slice(OFFSETS[e], OFFSETS[e + 1]) for e in range(len(OFFSETS) - 1)]
    h = torch.cat([F.silu(F.linear(h[r], we[e], be[e])) for e, r in enumerate(rows)])
    return torch.cat([F.silu(F.linear(h[r], wge[e])) * F.linear(h[r], wue[e]) for e, r in enumerate(rows)])


def _count(model, inputs) -> tuple[int, torch.Tensor, tuple[torch.Tensor, ...]]:
    leaves = [t.clone().requires_grad_() for t in inputs]
    with FlopCounterMode(display=False) as counter:
        out = model(*leaves)
        grads = torch.autograd.grad(out.square().sum(), leaves)
    return counter.get_total_flops(), out.detach(), grads


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_a_model_counts_as_its_plain_torch_twin(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "triton":
        skip_unless_triton_on_cpu(monkeypatch)
    else:
        monkeypatch.setenv("SMPTK_KERNELS", "torch")
    inputs = _weights()
    want, ref_out, ref_grads = _count(_torch_model, inputs)
    x, w1, wg, we, wge = (inputs[i] for i in (0, 1, 3, 5, 7))
    M, T, K, N1, N2, N3, N4 = (
        22,
        OFFSETS[-1],
        x.shape[-1],
        w1.shape[0],
        wg.shape[0],
        we.shape[1],
        wge.shape[1],
    )
    # forward + dx + dw of every product: 3 x (linear, gate and up, grouped linear, grouped gate and up)
    assert want == 3 * 2 * (M * K * N1 + 2 * M * N1 * N2 + T * N2 * N3 + 2 * T * N3 * N4)
    got, out, grads = _count(_smptk_model, inputs)
    assert got == want, f"{path} path: FlopCounterMode counted {got}, the plain torch model {want}"
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_frozen_weights_count_no_weight_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backward counts only the products it runs: with the weights frozen, dx alone (one product per
    GEMM, two for a SwiGLU pair), as torch's own linear does."""
    skip_unless_triton_on_cpu(monkeypatch)
    inputs = _weights(1)
    counts = []
    for model in (_smptk_model, _torch_model):
        x = inputs[0].clone().requires_grad_()
        with FlopCounterMode(display=False) as counter:
            model(x, *inputs[1:]).sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1], counts


def test_a_counter_made_before_the_formulas_were_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A FlopCounterMode copies torch's registry when it is made; smptk registers its formulas on the first
    call under a dispatch mode (importing the registry at ``import smptk`` would import triton), so a counter
    made earlier gets them added, and the registry has them for the next one."""
    skip_unless_triton_on_cpu(monkeypatch)
    bare = {k: v for k, v in flop_counter.flop_registry.items() if k not in _dispatch.FLOPS}
    monkeypatch.setattr(flop_counter, "flop_registry", bare)
    x, w = torch.randn(3, 8), torch.randn(5, 8, requires_grad=True)
    for _ in range(2):  # the first counter predates the registration, the second one copies it
        with FlopCounterMode(display=False) as counter:
            fused_linear(x, w).sum().backward()
        assert counter.get_total_flops() == 2 * (2 * 3 * 8 * 5)  # forward and dw (x is not trainable)
    assert torch.ops.smptk.fused_linear_bwd in bare


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_an_moe_layer_counts_the_tokens_it_routes(capacity_factor, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped ops' FLOPs follow the rows they get: the routed pairs, fewer where a capacity drops some.
    The Triton path counts what the PyTorch path (plain torch ops) counts."""
    from smptk.parallel import MoE

    skip_unless_triton_on_cpu(monkeypatch)
    torch.manual_seed(0)
    moe = MoE(8, 6, num_experts=4, top_k=2, num_shared_experts=1, capacity_factor=capacity_factor)
    x = torch.randn(2, 5, 8)
    counts, dropped = {}, {}
    for path in ("triton", "torch"):
        monkeypatch.setenv("SMPTK_KERNELS", path)
        moe.zero_grad()
        with FlopCounterMode(display=False) as counter:
            moe(x).square().sum().backward()
        counts[path], dropped[path] = counter.get_total_flops(), moe.last_plan.num_dropped
    assert dropped["triton"] == dropped["torch"] and (dropped["torch"] > 0) == (capacity_factor is not None)
    assert counts["triton"] == counts["torch"], counts


def _launched_products(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the matmul FLOPs of every GEMM-engine launch from now on: ``2 * M * R * C`` per product (two
    for a launch with a second operand pair or the SwiGLU mode); a one-column product that only carries a
    bias gradient's row sums (``grouped_weight_grad`` without a weight gradient) counts 0, as torch counts a
    bias gradient's ``sum``."""
    from smptk.kernels import _gemm

    launched: list[int] = []
    run = _gemm._Launch.run

    def recording(self) -> None:
        M, R = self.a.shape
        C = self.b.shape[2]
        bias_carrier = self.rowsum is not None and C == 1 and not self.b.any()
        pairs = 2 if self.a2 is not None or self.dual != _gemm.DUAL_NONE else 1
        launched.append(0 if bias_carrier else pairs * 2 * M * R * C)
        run(self)

    monkeypatch.setattr(_gemm._Launch, "run", recording)
    return launched


_OPS = {  # name -> (fn(x, *params), fp32 reference(x, *params), shapes of x and the parameters)
    "fused_linear": (
        lambda x, w, b: fused_linear(x, w, b, activation="gelu"),
        lambda x, w, b: linear_reference(x, w, b, "gelu"),
        [(2, 5, 12), (9, 12), (9,)],
    ),
    "swiglu": (swiglu, swiglu_reference, [(10, 12), (9, 12), (9, 12)]),
    "grouped_linear": (
        lambda x, w, b: grouped_linear(x, w, torch.tensor(OFFSETS), bias=b, activation="silu"),
        lambda x, w, b: grouped_linear_reference(x, w, OFFSETS, b, "silu"),
        [(11, 12), (3, 9, 12), (3, 9)],
    ),
    "grouped_swiglu": (
        lambda x, wg, wu: grouped_swiglu(x, wg, wu, torch.tensor(OFFSETS)),
        lambda x, wg, wu: grouped_swiglu_reference(x, wg, wu, OFFSETS),
        [(11, 12), (3, 9, 12), (3, 9, 12)],
    ),
}


@pytest.mark.parametrize("name", list(_OPS))
def test_every_backward_counts_the_products_it_launches(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """For each set of inputs that want a gradient (x, the weight(s), the bias: all 7 non-empty ones), the
    backward launches a product only for a gradient asked for, FlopCounterMode counts what it launches, the
    PyTorch path (plain torch ops) counts the same, and the gradients equal the fp32 reference's.
    grouped_swiglu computed both weights' gradients ([E, 2N, K]) when one was asked for, and counted both."""
    skip_unless_triton_on_cpu(monkeypatch)
    fn, reference, shapes = _OPS[name]
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(*s, generator=g) / 2 for s in shapes]
    launched = _launched_products(monkeypatch)
    for wanted in itertools.product((False, True), repeat=3):
        if not any(wanted):
            continue
        counts, grads = {}, {}
        for path in ("triton", "torch"):
            monkeypatch.setenv("SMPTK_KERNELS", path)
            leaves = [t.clone().requires_grad_(w) for t, w in zip(inputs, wanted, strict=True)]
            out = fn(*leaves)
            launched.clear()
            with FlopCounterMode(display=False) as counter:
                grads[path] = torch.autograd.grad(out.square().sum(), [t for t in leaves if t.requires_grad])
            counts[path] = counter.get_total_flops()
            if path == "triton":
                assert counts[path] == sum(launched), f"{name} {wanted}: counted {counts[path]}, {launched}"
        assert counts["triton"] == counts["torch"], f"{name} {wanted}: {counts}"
        leaves = [t.clone().requires_grad_(w) for t, w in zip(inputs, wanted, strict=True)]
        want = torch.autograd.grad(reference(*leaves).square().sum(), [t for t in leaves if t.requires_grad])
        for got, ref in zip(grads["triton"], want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=f"{name} {wanted}")
