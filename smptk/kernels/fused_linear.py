"""fused_linear: ``y = act(x @ weight.T + bias)`` in one GEMM launch, forward and backward in Triton.

Shapes: x ``[..., K]`` (any leading dims, any strides), weight ``[N, K]`` (nn.Linear layout), bias ``[N]``,
y ``[..., N]`` in x's dtype. Activations: None, "relu", "gelu" (erf), "gelu_tanh", "silu".
Legend: M = prod(leading dims of x) rows, K input features, N output features; ``z = x @ w.T + b``.

Forward: one launch of the shared matmul core (``_matmul.py``) with bias and activation applied to the
fp32 accumulator before the only store, so y never makes the extra round trips through HBM that eager's
``addmm`` + ``gelu`` take (2 x M x N elements read and written for the separate epilogue op).

Backward (three launches, all Triton):
1. ``_act_bwd_kernel``: ``dz = dy * act'(z)`` and per-row-chunk partial column sums of dz (for dbias),
   then ``_colsum_kernel`` adds the partials. Partials + a second pass keep dbias deterministic (no atomics).
2. ``dx = dz @ w`` and 3. ``dw = dz.T @ x`` with the same matmul core; only the grads autograd asks for.

Pre-activation z is **saved, not recomputed**: with an activation the forward writes z (x's dtype) next
to y when grad is needed. Recomputing z would add a third M x N x K GEMM to the backward (+50% backward
FLOPs); saving costs one extra M x N store in the forward, about 5% of the forward at 16384 x 4096 ->
14336 in bf16 (0.47 GB at ~3 TB/s = ~0.16 ms against ~2.6 ms of GEMM at ~750 TFLOP/s; estimate from the
H100's public peak figures, not a measurement). Without grad (inference) z is not written at all. With no
activation nothing extra is saved (dz = dy).

Example::

    >>> x = torch.randn(4, 16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    >>> w = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    >>> y = fused_linear(x, w, activation="gelu")  # [4, 16, 128]
    >>> y.sum().backward()
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from smptk.kernels import _matmul, runtime
from smptk.kernels._buffers import new_buffer
from smptk.kernels._checks import (
    autocast_inputs,
    check_activation,
    check_float_tensor,
    check_input,
    check_same,
    check_weight,
)
from smptk.kernels._matmul import ACTIVATION_CODES, activation_grad

# dz kernel tiles. ROWS_PER_PROG rows per program bound the partial-sum buffer to ceil(M/512) x N fp32
# (32 x 14336 x 4 B = 1.8 MB at M=16384) while leaving thousands of programs at LLM sizes. Untuned.
_BWD_BLOCK = {"BLOCK_M": 32, "BLOCK_N": 128, "ROWS_PER_PROG": 512}
_BWD_BLOCK_INTERPRETER = {"BLOCK_M": 16, "BLOCK_N": 32, "ROWS_PER_PROG": 32}
_COLSUM_BLOCK_N = 256  # one program reduces 256 columns over all partial rows; memory-bound, untuned


@triton.jit
def _act_bwd_kernel(
    dy_ptr,
    z_ptr,
    dz_ptr,
    partial_ptr,
    M,
    N,
    stride_dym,
    stride_dyn,
    stride_zm,
    stride_zn,
    stride_dzm,
    stride_dzn,
    ACTIVATION: tl.constexpr,
    STORE_DZ: tl.constexpr,
    COLSUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROG: tl.constexpr,
):
    """dz = dy * act'(z) over rows [pid_r * ROWS_PER_PROG, +ROWS_PER_PROG) x columns of block pid_n.

    dy_ptr, z_ptr, dz_ptr: [M, N] with the given strides (z unused without activation).
    partial_ptr: [cdiv(M, ROWS_PER_PROG), N] fp32 contiguous; row pid_r gets this chunk's column sums of dz.
    """
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    colsum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row0 = pid_r.to(tl.int64) * ROWS_PER_PROG
    for r in range(0, ROWS_PER_PROG, BLOCK_M):
        rows = row0 + r + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < M) & col_ok[None, :]
        dz = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :] * stride_dyn, mask=mask, other=0.0)
        dz = dz.to(tl.float32)
        if ACTIVATION != 0:
            z = tl.load(z_ptr + rows[:, None] * stride_zm + cols[None, :] * stride_zn, mask=mask, other=0.0)
            dz = dz * activation_grad(z.to(tl.float32), ACTIVATION)
        if STORE_DZ:
            tl.store(
                dz_ptr + rows[:, None] * stride_dzm + cols[None, :] * stride_dzn,
                dz.to(dz_ptr.dtype.element_ty),
                mask=mask,
            )
        if COLSUM:
            colsum += tl.sum(dz, axis=0)
    if COLSUM:
        tl.store(partial_ptr + pid_r.to(tl.int64) * N + cols, colsum, mask=col_ok)


@triton.jit
def _colsum_kernel(partial_ptr, out_ptr, R, N, BLOCK_N: tl.constexpr):
    """out[N] = sum over r < R of partial[r, :]; partial is [R, N] fp32 contiguous, out in its own dtype."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    ptrs = partial_ptr + cols
    for _ in range(0, R):
        acc += tl.load(ptrs, mask=ok, other=0.0)
        ptrs += N  # pointer arithmetic is 64-bit: no int32 r * N product
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _bwd_blocks() -> dict[str, int]:
    return _BWD_BLOCK_INTERPRETER if runtime.interpreter_enabled() else _BWD_BLOCK


def activation_backward(
    dy_MN: torch.Tensor, z_MN: torch.Tensor | None, activation: int, want_colsum: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(dz, column sums of dz)``: dz = dy * act'(z) (dy itself without activation).

    ``want_colsum`` asks for the column sums (the bias gradient) in ``out_dtype``; otherwise None.
    """
    M, N = dy_MN.shape
    store_dz = activation != _matmul.ACT_NONE
    if not store_dz and not want_colsum:
        return dy_MN, None
    dz = new_buffer((M, N), dy_MN.dtype, dy_MN.device) if store_dz else dy_MN
    colsum = new_buffer((N,), out_dtype, dy_MN.device) if want_colsum else None
    if M == 0 or N == 0:
        if colsum is not None:
            colsum.zero_()
        return dz, colsum
    blocks = _bwd_blocks()
    rows = triton.cdiv(M, blocks["ROWS_PER_PROG"])
    partial = new_buffer((rows, N), torch.float32, dy_MN.device) if want_colsum else dy_MN
    z = z_MN if z_MN is not None else dy_MN
    _act_bwd_kernel[(rows, triton.cdiv(N, blocks["BLOCK_N"]))](
        dy_MN,
        z,
        dz,
        partial,
        M,
        N,
        dy_MN.stride(0),
        dy_MN.stride(1),
        z.stride(0),
        z.stride(1),
        dz.stride(0),
        dz.stride(1),
        ACTIVATION=activation,
        STORE_DZ=store_dz,
        COLSUM=want_colsum,
        **blocks,
    )
    if want_colsum:
        _colsum_kernel[(triton.cdiv(N, _COLSUM_BLOCK_N),)](partial, colsum, rows, N, BLOCK_N=_COLSUM_BLOCK_N)
    return dz, colsum


def fused_linear_fwd(
    x_MK: torch.Tensor, w_NK: torch.Tensor, bias_N: torch.Tensor | None, activation: int, save_z: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton forward on 2-D ``x``: returns ``(y [M, N], z [M, N] or None)``."""
    M, N = x_MK.shape[0], w_NK.shape[0]
    y = new_buffer((M, N), x_MK.dtype, x_MK.device)
    z = new_buffer((M, N), x_MK.dtype, x_MK.device) if save_z else None
    _matmul.matmul(x_MK, w_NK.t(), y, bias_N=bias_N, activation=activation, z_out_MN=z)
    return y, z


def fused_linear_bwd(
    dy_MN: torch.Tensor,
    x_MK: torch.Tensor,
    w_NK: torch.Tensor,
    z_MN: torch.Tensor | None,
    activation: int,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Triton backward: ``(dx [M, K], dw [N, K], dbias [N])``, each None unless ``needs`` asks for it."""
    need_dx, need_dw, need_db = needs
    dz, db = activation_backward(dy_MN, z_MN, activation, need_db, w_NK.dtype)
    dx = dw = None
    if need_dx:
        dx = new_buffer(x_MK.shape, x_MK.dtype, x_MK.device)
        if w_NK.shape[0] == 0:
            dx.zero_()
        else:
            _matmul.matmul(dz, w_NK, dx)
    if need_dw:
        dw = new_buffer(w_NK.shape, w_NK.dtype, w_NK.device)
        if x_MK.shape[0] == 0:
            dw.zero_()
        else:
            _matmul.matmul(dz.t(), x_MK, dw)
    return dx, dw, db


class FusedLinearFunction(torch.autograd.Function):
    """Autograd wrapper over the Triton forward and backward (inputs already checked and 2-D)."""

    @staticmethod
    def forward(ctx, x_MK, w_NK, bias_N, activation: int):
        save_z = activation != _matmul.ACT_NONE and any(ctx.needs_input_grad[:3])
        y, z = fused_linear_fwd(x_MK, w_NK, bias_N, activation, save_z)
        ctx.save_for_backward(x_MK, w_NK, z)
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_NK, z = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        dx, dw, db = fused_linear_bwd(dy_MN, x_MK, w_NK, z, ctx.activation, needs)
        return dx, dw, db, None


_TORCH_ACTIVATIONS = {
    None: lambda z: z,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}


def _fused_linear_torch(x, weight, bias, activation):
    return _TORCH_ACTIVATIONS[activation](F.linear(x, weight, bias))


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
        check_float_tensor("bias", bias)
        check_same("bias", bias, "x", x)
        if bias.shape != (weight.shape[0],):
            raise ValueError(
                f"bias: expected shape ({weight.shape[0]},) to match weight's N, got {tuple(bias.shape)}"
            )
    if runtime.select_path(x, weight) == "torch":
        return _fused_linear_torch(x, weight, bias, activation)
    lead = x.shape[:-1]
    x_MK = x.reshape(-1, x.shape[-1])
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()  # the epilogue reads bias as a contiguous [N] vector
    y = FusedLinearFunction.apply(x_MK, weight, bias, ACTIVATION_CODES[activation])
    return y.view(*lead, weight.shape[0])
