"""swiglu: ``y = silu(x @ w_gate.T) * (x @ w_up.T)`` reading x once, forward and backward in Triton.

Shapes: x ``[..., K]``, w_gate and w_up ``[N, K]`` (nn.Linear layout), y ``[..., N]`` in x's dtype.
Legend: M rows (prod of x's leading dims), K hidden size, N intermediate size; ``g = x @ w_gate.T`` and
``u = x @ w_up.T`` are the gate and up pre-activations; ``h = [g | u]`` is them side by side, ``[M, 2N]``.

Forward: the GEMM engine's SwiGLU mode (``_gemm.py``, ``DUAL=2``) keeps two fp32 accumulators per
output tile and feeds both from the same
x tile, so x is read once per tile instead of once per GEMM, and silu(g) * u is formed in registers:
eager SwiGLU writes g and u to HBM, reads them back for silu and the product, and reads x twice.

Backward: g and u are **saved** (as one ``[M, 2N]`` buffer in x's dtype) when grad is needed, for the
same reason fused_linear saves its pre-activation: recomputing them would cost two more GEMMs.
1. ``_epilogue.swiglu_dh``: ``dg = dy * u * silu'(g)`` and ``du = dy * silu(g)`` into ``dh = [dg | du]``.
2. ``dx = dg @ w_gate + du @ w_up`` in one launch of the GEMM engine (second operand pair, one fp32
   accumulator, one rounding).
3. ``[dw_gate; dw_up] = dh.T @ x`` in one launch: the two weight grads are the halves of a ``[2N, K]``
   result, so x is read once for both.

fp16 range: the forward forms silu(g) * u from the fp32 accumulators, so y is right where g or u passes
65504 but y does not; the saved h then holds +-inf. A saved g takes silu's exact tails (as fused_linear's
z), but a saved u has lost its magnitude: dg = dy * u * silu'(g) comes out inf / NaN unless silu'(g) is
exactly 0 (g < -100), even where the fp32 gradient is tiny (u = 9e4, g = -30: 2e-8). bf16 has the range.

Example::

    >>> x = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16)
    >>> wg, wu = (torch.randn(172, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    >>> swiglu(x, wg, wu).shape
    torch.Size([2, 8, 172])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from smptk.kernels import runtime
from smptk.kernels._buffers import new_buffer
from smptk.kernels._checks import autocast_inputs, check_input, check_weight
from smptk.kernels._dispatch import (
    dispatcher_op,
    first_derivative_only,
    gemm_flops,
    grads_wanted,
    none_if_empty,
    outside_graphs,
    saved_if,
)
from smptk.kernels._triton import kernel_module

# The GEMM engine and its elementwise kernels, imported (with triton) on the first Triton-path call: see
# smptk.kernels._triton.
_gemm = kernel_module("smptk.kernels._gemm")
_epilogue = kernel_module("smptk.kernels._epilogue")


def _swiglu_fwd_fake(x_MK, wg_NK, wu_NK, save_h, lead):
    M, N = x_MK.shape[0], wg_NK.shape[0]
    return x_MK.new_empty((*lead, N)), x_MK.new_empty((M, 2 * N) if save_h else (0,))


def _swiglu_fwd_flops(x_MK, wg_NK, *_, out_shape):
    return 2 * gemm_flops(x_MK[0], x_MK[1], wg_NK[0])  # g = x @ w_gate.T and u = x @ w_up.T


@dispatcher_op("swiglu_fwd", fake=_swiglu_fwd_fake, flops=_swiglu_fwd_flops)
def swiglu_fwd(
    x_MK: torch.Tensor, wg_NK: torch.Tensor, wu_NK: torch.Tensor, save_h: bool, lead: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward on 2-D ``x``: ``(y [*lead, N], h = [g | u] [M, 2N])`` (``lead``: x's leading dims;
    y made in its final shape, so the caller returns no view), h empty unless ``save_h``. The op
    ``smptk::swiglu_fwd`` (see :mod:`smptk.kernels._dispatch`)."""
    M, N = x_MK.shape[0], wg_NK.shape[0]
    y = new_buffer((*lead, N), x_MK.dtype, x_MK.device)
    h = new_buffer((M, 2 * N) if save_h else (0,), x_MK.dtype, x_MK.device)
    _gemm.swiglu_matmul(x_MK, wg_NK.t(), wu_NK.t(), y.view(M, N), h if save_h else None)
    return y, h


def _swiglu_bwd_fake(dy_MN, x_MK, wg_NK, wu_NK, h_M2N, needs):
    need_dx, need_dwg, need_dwu = needs
    rows = wg_NK.shape[0] * (need_dwg + need_dwu)
    return x_MK.new_empty(x_MK.shape if need_dx else (0,)), wg_NK.new_empty((rows, x_MK.shape[1]))


def _swiglu_bwd_flops(dy_MN, x_MK, wg_NK, wu_NK, h_M2N, needs, *, out_shape):
    # dx = dg @ w_gate + du @ w_up (two products), one product per weight gradient asked for
    return (2 * needs[0] + needs[1] + needs[2]) * gemm_flops(dy_MN[0], x_MK[1], dy_MN[1])


@dispatcher_op("swiglu_bwd", fake=_swiglu_bwd_fake, flops=_swiglu_bwd_flops)
def _swiglu_bwd(
    dy_MN: torch.Tensor,
    x_MK: torch.Tensor,
    wg_NK: torch.Tensor,
    wu_NK: torch.Tensor,
    h_M2N: torch.Tensor,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op ``smptk::swiglu_bwd``: ``(dx or empty, the weight gradients asked for, stacked)``: ``[2N, K]``
    ``[dw_gate; dw_up]`` for both, ``[N, K]`` for one, ``[0, K]`` for none."""
    need_dx, need_dwg, need_dwu = needs
    M, N = dy_MN.shape
    dh = _epilogue.swiglu_dh(dy_MN, h_M2N)
    dx = new_buffer(x_MK.shape if need_dx else (0,), x_MK.dtype, x_MK.device)
    if need_dx:
        if N == 0:
            dx.zero_()
        else:
            _gemm.matmul(dh[:, :N], wg_NK, dx, a2_MK=dh[:, N:], b2_KN=wu_NK)
    # both: [dw_gate | dw_up] in one GEMM (x read once); one: only its half (a frozen other weight)
    rows = slice(0, 2 * N) if need_dwg and need_dwu else slice(0, N) if need_dwg else slice(N, 2 * N)
    dw = new_buffer((N * (need_dwg + need_dwu), x_MK.shape[1]), wg_NK.dtype, wg_NK.device)
    if need_dwg or need_dwu:
        if M == 0:
            dw.zero_()
        else:
            _gemm.matmul(dh[:, rows].t(), x_MK, dw)
    return dx, dw


def swiglu_bwd(
    dy_MN: torch.Tensor,
    x_MK: torch.Tensor,
    wg_NK: torch.Tensor,
    wu_NK: torch.Tensor,
    h_M2N: torch.Tensor,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Triton backward: ``(dx, dw_gate, dw_up)``, each None unless ``needs`` asks for it."""
    need_dx, need_dwg, need_dwu = needs
    dx, dw = _swiglu_bwd(dy_MN, x_MK, wg_NK, wu_NK, h_M2N, [bool(n) for n in needs])
    N = wg_NK.shape[0]
    return none_if_empty(dx, need_dx), (dw[:N] if need_dwg else None), (dw[-N:] if need_dwu else None)


class SwiGLUFunction(torch.autograd.Function):
    """Autograd wrapper over the Triton forward and backward (inputs already checked and 2-D)."""

    @staticmethod
    def forward(ctx, x_MK, wg_NK, wu_NK, grad_enabled: bool, lead: list[int]):
        ctx.needs = needs = grads_wanted(ctx, grad_enabled, 3)
        save_h = any(needs)
        y, h = swiglu_fwd(x_MK, wg_NK, wu_NK, save_h, lead)
        need_x, need_w = needs[1] or needs[2], needs[0]  # x only for the weights' gradients, w only for dx
        ctx.save_for_backward(
            saved_if(x_MK, need_x), saved_if(wg_NK, need_w), saved_if(wu_NK, need_w), none_if_empty(h, save_h)
        )
        return y

    @staticmethod
    @first_derivative_only("swiglu", torch_path=True)
    def backward(ctx, dy):
        x_MK, wg_NK, wu_NK, h = ctx.saved_tensors
        dy_MN = dy.reshape(math.prod(dy.shape[:-1]), dy.shape[-1])
        return (*swiglu_bwd(dy_MN, x_MK, wg_NK, wu_NK, h, ctx.needs), None, None)


def swiglu(x: torch.Tensor, weight_gate: torch.Tensor, weight_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP input projection: ``silu(x @ weight_gate.T) * (x @ weight_up.T)``, reading x once.

    Args:
        x: ``[..., K]`` float32, float16 or bfloat16; any leading dims and strides.
        weight_gate, weight_up: ``[N, K]`` each (nn.Linear layout), x's dtype and device.

    Returns:
        ``[..., N]`` in x's dtype; differentiable in all three inputs.

    Under ``torch.autocast`` the inputs are cast to the autocast dtype first, as ``F.linear`` does.
    Runs the Triton kernels on CUDA (and on CPU under ``TRITON_INTERPRET=1``), the PyTorch path otherwise;
    ``SMPTK_KERNELS=triton|torch`` forces one.

    Example::

        >>> y = swiglu(torch.randn(8, 64), torch.randn(172, 64), torch.randn(172, 64))
        >>> y.shape
        torch.Size([8, 172])
    """
    check_input(x)
    x, weight_gate, weight_up = autocast_inputs(x, weight_gate, weight_up)
    check_weight("weight_gate", weight_gate, x)
    check_weight("weight_up", weight_up, x)
    if weight_up.shape != weight_gate.shape:
        raise ValueError(
            f"weight_up: shape {tuple(weight_up.shape)} must equal weight_gate's {tuple(weight_gate.shape)}"
        )
    if runtime.select_path(x, weight_gate, weight_up) == "torch":
        return F.silu(F.linear(x, weight_gate)) * F.linear(x, weight_up)
    lead = x.shape[:-1]
    x_MK = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    return _swiglu_triton(x_MK, weight_gate, weight_up, torch.is_grad_enabled(), list(lead))


@outside_graphs  # torch.compile: a graph break, then the Function as in eager (see _dispatch)
def _swiglu_triton(x_MK, weight_gate, weight_up, grad_enabled: bool, lead: list[int]) -> torch.Tensor:
    return SwiGLUFunction.apply(x_MK, weight_gate, weight_up, grad_enabled, lead)
