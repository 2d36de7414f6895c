"""swiglu: ``y = silu(x @ w_gate.T) * (x @ w_up.T)`` reading x once, forward and backward in Triton.

Shapes: x ``[..., K]``, w_gate and w_up ``[N, K]`` (nn.Linear layout), y ``[..., N]`` in x's dtype.
Legend: M rows (prod of x's leading dims), K hidden size, N intermediate size; ``g = x @ w_gate.T`` and
``u = x @ w_up.T`` are the gate and up pre-activations; ``h = [g | u]`` is them side by side, ``[M, 2N]``.

Forward: ``_swiglu_fwd_kernel`` keeps two fp32 accumulators per output tile and feeds both from the same
x tile, so x is read once per tile instead of once per GEMM, and silu(g) * u is formed in registers:
eager SwiGLU writes g and u to HBM, reads them back for silu and the product, and reads x twice.

Backward: g and u are **saved** (as one ``[M, 2N]`` buffer in x's dtype) when grad is needed, for the
same reason fused_linear saves its pre-activation: recomputing them would cost two more GEMMs.
1. ``_swiglu_bwd_kernel``: ``dg = dy * u * silu'(g)`` and ``du = dy * silu(g)`` into ``dh = [dg | du]``.
2. ``dx = dg @ w_gate + du @ w_up`` in one launch of the matmul core (second operand pair, one fp32
   accumulator, one rounding).
3. ``[dw_gate; dw_up] = dh.T @ x`` in one launch: the two weight grads are the halves of a ``[2N, K]``
   result, so x is read once for both.

Example::

    >>> x = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16)
    >>> wg, wu = (torch.randn(172, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    >>> swiglu(x, wg, wu).shape
    torch.Size([2, 8, 172])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from smptk.kernels import _matmul, runtime
from smptk.kernels._buffers import new_buffer
from smptk.kernels._checks import autocast_inputs, check_input, check_weight
from smptk.kernels._matmul import grouped_tile

# Two accumulators per program: the largest tiles hold 2 x 128 x 128 fp32, as much register state as one
# 128 x 256 tile of the plain GEMM. Candidates untuned on our suite so far (no GPU run yet).
_CUDA_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=4, num_warps=8),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=8),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=5, num_warps=2),
]
_BWD_BLOCK = {"BLOCK_M": 32, "BLOCK_N": 128}  # elementwise, memory-bound; untuned
_BWD_BLOCK_INTERPRETER = {"BLOCK_M": 16, "BLOCK_N": 32}


@triton.jit
def _swiglu_fwd_kernel(
    x_ptr,
    wg_ptr,
    wu_ptr,
    y_ptr,
    h_ptr,
    M,
    N,
    K,
    M_BUCKET,
    stride_xm,
    stride_xk,
    stride_wgn,
    stride_wgk,
    stride_wun,
    stride_wuk,
    stride_ym,
    stride_yn,
    stride_hm,
    stride_hn,
    STORE_H: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of y (and of g, u).

    x_ptr [M, K]; wg_ptr, wu_ptr [N, K]; y_ptr [M, N]; h_ptr [M, 2N] (g in columns [0, N), u in [N, 2N)),
    written only if STORE_H. All with the given strides. M_BUCKET only keys the autotuner.
    """
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = rows % M
    cols_in = cols % N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows_in[:, None] * stride_xm + offs_k[None, :] * stride_xk
    # Weights are read as [K, N] tiles: element (k, n) of w.T is w[n, k].
    wg_ptrs = wg_ptr + offs_k[:, None] * stride_wgk + cols_in[None, :] * stride_wgn
    wu_ptrs = wu_ptr + offs_k[:, None] * stride_wuk + cols_in[None, :] * stride_wun
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        wg = tl.load(wg_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        wu = tl.load(wu_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc_g = tl.dot(x, wg, acc_g, input_precision=INPUT_PRECISION)
        acc_u = tl.dot(x, wu, acc_u, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        wg_ptrs += BLOCK_K * stride_wgk
        wu_ptrs += BLOCK_K * stride_wuk
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if STORE_H:
        h_ptrs = h_ptr + rows[:, None] * stride_hm + cols[None, :] * stride_hn
        tl.store(h_ptrs, acc_g.to(h_ptr.dtype.element_ty), mask=mask)
        tl.store(h_ptrs + N * stride_hn, acc_u.to(h_ptr.dtype.element_ty), mask=mask)
    y = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn, y.to(y_ptr.dtype.element_ty), mask=mask
    )


_swiglu_fwd_kernel_tuned = triton.autotune(
    configs=_CUDA_CONFIGS, key=["M_BUCKET", "N", "K", "stride_xm", "stride_xk", "STORE_H"]
)(_swiglu_fwd_kernel)


@triton.jit
def _swiglu_bwd_kernel(
    dy_ptr,
    h_ptr,
    dh_ptr,
    M,
    N,
    stride_dym,
    stride_dyn,
    stride_hm,
    stride_hn,
    stride_dhm,
    stride_dhn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dh = [dy * u * silu'(g) | dy * silu(g)] for one tile; dy [M, N]; h = [g | u] and dh are [M, 2N]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :] * stride_dyn, mask=mask, other=0.0)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + cols[None, :] * stride_hn
    g = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptrs + N * stride_hn, mask=mask, other=0.0).to(tl.float32)
    dy = dy.to(tl.float32)
    s = tl.sigmoid(g)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    dh_ptrs = dh_ptr + rows[:, None] * stride_dhm + cols[None, :] * stride_dhn
    tl.store(dh_ptrs, dg.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptrs + N * stride_dhn, du.to(dh_ptr.dtype.element_ty), mask=mask)


def swiglu_fwd(
    x_MK: torch.Tensor, wg_NK: torch.Tensor, wu_NK: torch.Tensor, save_h: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton forward on 2-D ``x``: ``(y [M, N], h = [g | u] [M, 2N] or None)``."""
    M, K = x_MK.shape
    N = wg_NK.shape[0]
    y = new_buffer((M, N), x_MK.dtype, x_MK.device)
    h = new_buffer((M, 2 * N), x_MK.dtype, x_MK.device) if save_h else None
    if M == 0 or N == 0:
        return y, h
    hh = h if h is not None else y

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _matmul.launch(
        _swiglu_fwd_kernel_tuned,
        _swiglu_fwd_kernel,
        grid,
        x_MK,
        wg_NK,
        wu_NK,
        y,
        hh,
        M,
        N,
        K,
        triton.next_power_of_2(M),
        x_MK.stride(0),
        x_MK.stride(1),
        wg_NK.stride(0),
        wg_NK.stride(1),
        wu_NK.stride(0),
        wu_NK.stride(1),
        y.stride(0),
        y.stride(1),
        hh.stride(0),
        hh.stride(1),
        STORE_H=save_h,
        INPUT_PRECISION=_matmul.input_precision(x_MK.dtype),
    )
    return y, h


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
    M, N = dy_MN.shape
    dh = new_buffer((M, 2 * N), dy_MN.dtype, dy_MN.device)
    if M and N:
        blocks = _BWD_BLOCK_INTERPRETER if runtime.interpreter_enabled() else _BWD_BLOCK
        grid = (triton.cdiv(M, blocks["BLOCK_M"]), triton.cdiv(N, blocks["BLOCK_N"]))
        _swiglu_bwd_kernel[grid](
            dy_MN,
            h_M2N,
            dh,
            M,
            N,
            dy_MN.stride(0),
            dy_MN.stride(1),
            h_M2N.stride(0),
            h_M2N.stride(1),
            dh.stride(0),
            dh.stride(1),
            **blocks,
        )
    dx = dwg = dwu = None
    if need_dx:
        dx = new_buffer(x_MK.shape, x_MK.dtype, x_MK.device)
        if N == 0:
            dx.zero_()
        else:
            _matmul.matmul(dh[:, :N], wg_NK, dx, a2_MK2=dh[:, N:], b2_K2N=wu_NK)
    if need_dwg or need_dwu:
        dw = new_buffer((2 * N, x_MK.shape[1]), wg_NK.dtype, wg_NK.device)
        if M == 0:
            dw.zero_()
        else:
            _matmul.matmul(dh.t(), x_MK, dw)
        dwg = dw[:N] if need_dwg else None
        dwu = dw[N:] if need_dwu else None
    return dx, dwg, dwu


class SwiGLUFunction(torch.autograd.Function):
    """Autograd wrapper over the Triton forward and backward (inputs already checked and 2-D)."""

    @staticmethod
    def forward(ctx, x_MK, wg_NK, wu_NK):
        save_h = any(ctx.needs_input_grad)
        y, h = swiglu_fwd(x_MK, wg_NK, wu_NK, save_h)
        ctx.save_for_backward(x_MK, wg_NK, wu_NK, h)
        return y

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, wg_NK, wu_NK, h = ctx.saved_tensors
        return swiglu_bwd(dy_MN, x_MK, wg_NK, wu_NK, h, tuple(ctx.needs_input_grad))


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
    if runtime.select_path(x, weight_gate) == "torch":
        return F.silu(F.linear(x, weight_gate)) * F.linear(x, weight_up)
    lead = x.shape[:-1]
    y = SwiGLUFunction.apply(x.reshape(-1, x.shape[-1]), weight_gate, weight_up)
    return y.view(*lead, weight_gate.shape[0])
