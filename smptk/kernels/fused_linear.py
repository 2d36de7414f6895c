"""fused_linear: ``y = act(x @ weight.T + bias)`` in one GEMM launch, forward and backward in Triton.

Shapes: x ``[..., K]`` (any leading dims, any strides), weight ``[N, K]`` (nn.Linear layout), bias ``[N]``,
y ``[..., N]`` in x's dtype. Activations: None, "relu", "gelu" (erf), "gelu_tanh", "silu".
Legend: M = prod(leading dims of x) rows, K input features, N output features; ``z = x @ w.T + b``.

Forward: one launch of the GEMM engine (``_gemm.py``: persistent; TMA loads and stores on Hopper) with bias
and activation applied to the fp32 accumulator before the only store, so y never makes the extra round trips
through HBM that eager's ``addmm`` + ``gelu`` take (2 x M x N elements read and written for the separate
epilogue op).

Backward (three launches, all Triton):
1. ``_epilogue.activation_backward``: ``dz = dy * act'(z)`` and the column sums of dz (dbias),
   deterministic (per-row-chunk partials and a second pass, no atomics).
2. ``dx = dz @ w`` and 3. ``dw = dz.T @ x`` with the GEMM engine; only the grads autograd asks for.

Pre-activation z is **saved, not recomputed**: with an activation the forward writes z (x's dtype) next
to y when grad is needed. Recomputing z would add a third M x N x K GEMM to the backward (+50% backward
FLOPs); saving costs one extra M x N store in the forward, about 5% of the forward at 16384 x 4096 ->
14336 in bf16 (0.47 GB at ~3 TB/s = ~0.16 ms against ~2.6 ms of GEMM at ~750 TFLOP/s; estimate from the
H100's public peak figures, not a measurement). Without grad (inference) z is not written at all. With no
activation nothing extra is saved (dz = dy). The epilogue applies the activation to the fp32 sum, so a z
past fp16's 65504 gives a finite output but is saved as +-inf; the backward takes the derivative's exact
tail for |z| > 100 (0 or 1 for gelu, gelu_tanh and silu), so the gradients stay those of the fp32 z (the
PyTorch path, which rounds z first, gives NaN there, as ``F.silu(F.linear(...))`` in fp16 does). The same
tails apply where z is truly infinite (an inf in x, the weight or the bias): the output holds the inf or
NaN torch gives, but the gradients are the tails' finite limits, where torch's autograd gives NaN.

Example::

    >>> x = torch.randn(4, 16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    >>> w = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    >>> y = fused_linear(x, w, activation="gelu")  # [4, 16, 128]
    >>> y.sum().backward()
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from smptk.kernels import runtime
from smptk.kernels._buffers import new_buffer
from smptk.kernels._checks import (
    TORCH_ACTIVATIONS,
    autocast_inputs,
    check_activation,
    check_bias,
    check_input,
    check_weight,
)
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


def _fused_linear_fwd_fake(x_MK, w_NK, bias_N, activation, save_z, lead):
    M, N = x_MK.shape[0], w_NK.shape[0]
    return x_MK.new_empty((*lead, N)), x_MK.new_empty((M, N) if save_z else (0,))


def _fused_linear_fwd_flops(x_MK, w_NK, *_, out_shape):
    return gemm_flops(x_MK[0], x_MK[1], w_NK[0])


@dispatcher_op("fused_linear_fwd", fake=_fused_linear_fwd_fake, flops=_fused_linear_fwd_flops)
def fused_linear_fwd(
    x_MK: torch.Tensor,
    w_NK: torch.Tensor,
    bias_N: torch.Tensor | None,
    activation: int,
    save_z: bool,
    lead: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward on 2-D ``x``: returns ``(y [*lead, N], z [M, N])`` (``lead``: x's leading dims, M
    rows in all), z empty unless ``save_z``. y is made in its final shape, so the caller returns no view
    (FSDP2 warns of a root module's view outputs). The op ``smptk::fused_linear_fwd`` (see
    :mod:`smptk.kernels._dispatch`)."""
    M, N = x_MK.shape[0], w_NK.shape[0]
    y = new_buffer((*lead, N), x_MK.dtype, x_MK.device)
    z = new_buffer((M, N) if save_z else (0,), x_MK.dtype, x_MK.device)
    _gemm.matmul(
        x_MK, w_NK.t(), y.view(M, N), bias_N=bias_N, activation=activation, z_out_MN=z if save_z else None
    )
    return y, z


def _fused_linear_bwd_fake(dy_MN, x_MK, w_NK, z_MN, activation, needs):
    need_dx, need_dw, need_db = needs
    return (
        x_MK.new_empty(x_MK.shape if need_dx else (0,)),
        w_NK.new_empty(w_NK.shape if need_dw else (0,)),
        w_NK.new_empty((w_NK.shape[0],) if need_db else (0,)),
    )


def _fused_linear_bwd_flops(dy_MN, x_MK, w_NK, z_MN, activation, needs, *, out_shape):
    return (needs[0] + needs[1]) * gemm_flops(dy_MN[0], x_MK[1], dy_MN[1])  # dx = dz @ w, dw = dz.T @ x


@dispatcher_op("fused_linear_bwd", fake=_fused_linear_bwd_fake, flops=_fused_linear_bwd_flops)
def _fused_linear_bwd(
    dy_MN: torch.Tensor,
    x_MK: torch.Tensor,
    w_NK: torch.Tensor,
    z_MN: torch.Tensor | None,
    activation: int,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op ``smptk::fused_linear_bwd``: :func:`fused_linear_bwd` with an empty tensor for each gradient
    ``needs`` does not ask for."""
    need_dx, need_dw, need_db = needs
    dz, db = _epilogue.activation_backward(dy_MN, z_MN, activation, need_db, w_NK.dtype)
    dx = new_buffer(x_MK.shape if need_dx else (0,), x_MK.dtype, x_MK.device)
    if need_dx:
        if w_NK.shape[0] == 0:
            dx.zero_()
        else:
            _gemm.matmul(dz, w_NK, dx)
    dw = new_buffer(w_NK.shape if need_dw else (0,), w_NK.dtype, w_NK.device)
    if need_dw:
        if x_MK.shape[0] == 0:
            dw.zero_()
        else:
            _gemm.matmul(dz.t(), x_MK, dw)
    return dx, dw, db if need_db else w_NK.new_empty((0,))


def fused_linear_bwd(
    dy_MN: torch.Tensor,
    x_MK: torch.Tensor,
    w_NK: torch.Tensor,
    z_MN: torch.Tensor | None,
    activation: int,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Triton backward: ``(dx [M, K], dw [N, K], dbias [N])``, each None unless ``needs`` asks for it."""
    grads = _fused_linear_bwd(dy_MN, x_MK, w_NK, z_MN, activation, [bool(n) for n in needs])
    return tuple(none_if_empty(g, bool(n)) for g, n in zip(grads, needs, strict=True))


class FusedLinearFunction(torch.autograd.Function):
    """Autograd wrapper over the Triton forward and backward (inputs already checked and 2-D)."""

    @staticmethod
    def forward(ctx, x_MK, w_NK, bias_N, activation: int, grad_enabled: bool, lead: list[int]):
        ctx.needs = needs = grads_wanted(ctx, grad_enabled, 3)
        save_z = activation != _epilogue.ACT_NONE and any(needs)
        y, z = fused_linear_fwd(x_MK, w_NK, bias_N, activation, save_z, lead)
        # x only for dw, w only for dx (frozen weights: x is not kept, as with F.linear)
        ctx.save_for_backward(saved_if(x_MK, needs[1]), saved_if(w_NK, needs[0]), none_if_empty(z, save_z))
        ctx.activation = activation
        return y

    @staticmethod
    @first_derivative_only("fused_linear", torch_path=True)
    def backward(ctx, dy):
        x_MK, w_NK, z = ctx.saved_tensors
        dy_MN = dy.reshape(math.prod(dy.shape[:-1]), dy.shape[-1])
        dx, dw, db = fused_linear_bwd(dy_MN, x_MK, w_NK, z, ctx.activation, ctx.needs)
        return dx, dw, db, None, None, None


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` with the bias and activation fused into the GEMM.

    Args:
        x: ``[..., K]`` float32, float16 or bfloat16; any leading dims and strides.
        weight: ``[N, K]`` (nn.Linear layout), same dtype and device as ``x``.
        bias: ``[N]`` or None.
        activation: None, "relu", "gelu" (erf form), "gelu_tanh" or "silu".

    Returns:
        ``[..., N]`` in x's dtype. Differentiable in x, weight and bias.

    Under ``torch.autocast`` the inputs are cast to the autocast dtype first, as ``F.linear`` does.
    Runs the Triton kernels on CUDA (and on CPU under ``TRITON_INTERPRET=1``), the PyTorch path otherwise;
    ``SMPTK_KERNELS=triton|torch`` forces one (see :mod:`smptk.kernels.runtime`).

    Example::

        >>> y = fused_linear(torch.randn(8, 64), torch.randn(32, 64), torch.zeros(32), activation="gelu")
        >>> y.shape
        torch.Size([8, 32])
    """
    check_input(x)
    x, weight, bias = autocast_inputs(x, weight, bias)
    check_weight("weight", weight, x)
    check_activation(activation)
    if bias is not None:
        check_bias(bias, (weight.shape[0],), "weight's N", x)
    if runtime.select_path(x, weight, bias) == "torch":
        return TORCH_ACTIVATIONS[activation](F.linear(x, weight, bias))
    lead = x.shape[:-1]
    x_MK = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()  # the epilogue reads bias as a contiguous [N] vector
    act = _epilogue.ACTIVATION_CODES[activation]
    return _fused_linear_triton(x_MK, weight, bias, act, torch.is_grad_enabled(), list(lead))


@outside_graphs  # torch.compile: a graph break, then the Function as in eager (see _dispatch)
def _fused_linear_triton(x_MK, weight, bias, act: int, grad_enabled: bool, lead: list[int]) -> torch.Tensor:
    return FusedLinearFunction.apply(x_MK, weight, bias, act, grad_enabled, lead)
