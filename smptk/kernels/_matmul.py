"""Matmul core of the linear kernels: ``C = epilogue(A @ B (+ A2 @ B2))`` with A [M, K] and B [K, N].

One strided GEMM serves every product of the linear ops, so layouts are strides, never copies:

- forward ``z = x @ w.T``:        A = x ``[M, K]``,      B = w viewed as ``[K, N]`` (strides swapped).
- input grad ``dx = dz @ w``:     A = dz ``[M, N]``,     B = w ``[N, K]``.
- weight grad ``dw = dz.T @ x``:  A = dz viewed as ``[N, M]``, B = x ``[M, K]``.
- SwiGLU's ``dx = dg @ w_gate + du @ w_up`` uses the second pair (A2, B2) in the same accumulator, so the
  sum is taken in fp32 once instead of rounding a partial result to bf16 in between.

Epilogue (fused, in fp32, before the single store): ``+ bias[N]``, optional store of the pre-activation
``Z`` (what the backward needs), then the activation. Activations are integer codes (``ACT_*``).

Legend: M rows of the output, N columns, K the reduction; ``*_MK`` names a tensor of shape [M, K].

Design notes:
- fp32 accumulation for every input dtype; fp32 inputs use IEEE products unless
  ``torch.backends.cuda.matmul.allow_tf32`` is set (torch's own default for matmul is IEEE).
- Row and column offsets are int64 before they meet a stride, so tensors past 2^31 elements index right.
- Grouped ("super-grouping") program order keeps GROUP_M row-blocks of A hot in L2 while the
  program sweeps the columns of B; the standard schedule of Triton's matmul tutorial.
- On CUDA the block shape is autotuned per (M rounded up to a power of two, N, K, layout, epilogue);
  under the interpreter one small pinned config runs (the interpreter's cost is per program and per loop
  iteration, and 32-wide tiles still exercise every masked tail at the odd test sizes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from smptk.kernels import runtime

ACT_NONE, ACT_RELU, ACT_GELU, ACT_GELU_TANH, ACT_SILU = 0, 1, 2, 3, 4
ACTIVATION_CODES = {
    None: ACT_NONE,
    "relu": ACT_RELU,
    "gelu": ACT_GELU,
    "gelu_tanh": ACT_GELU_TANH,
    "silu": ACT_SILU,
}

# Candidate tiles for Hopper/Ampere bf16/fp16 GEMMs: the large 128x256 / 256x128 tiles with 3 stages are
# the shapes that reach peak on H100 in Triton's matmul tutorial; the small ones cover skinny problems.
# Untuned on our own suite so far (no GPU run yet): the autotuner picks among them per shape.
_CUDA_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=8),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=5, num_warps=2),
]
# Interpreter: one config; 32-wide tiles are the smallest that keep tl.dot's minimum shape (16) with room
# for a masked tail, and the fewest programs for the small shapes the CPU tests use.
_INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}

# Globals read inside @triton.jit must be tl.constexpr (the compiler rejects plain Python globals; the
# interpreter does not, so CPU tests cannot catch this). Keep tensors on the left of each product.
_SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1/sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1/sqrt(2*pi)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2/pi)
_GELU_TANH_A = tl.constexpr(0.044715)


@triton.jit
def activation_fwd(z, ACTIVATION: tl.constexpr):
    """act(z) for fp32 ``z``. gelu_tanh uses 0.5*z*(1 + tanh(u)) == z * sigmoid(2u) (no tanh intrinsic)."""
    if ACTIVATION == 1:
        z = tl.maximum(z, 0.0)
    elif ACTIVATION == 2:
        z = 0.5 * z * (1.0 + tl.math.erf(z * _SQRT1_2))
    elif ACTIVATION == 3:
        u = (z + z * z * z * _GELU_TANH_A) * _SQRT_2_OVER_PI
        z = z * tl.sigmoid(2.0 * u)
    elif ACTIVATION == 4:
        z = z * tl.sigmoid(z)
    return z


@triton.jit
def activation_grad(z, ACTIVATION: tl.constexpr):
    """d act(z) / dz for fp32 ``z`` (1 for no activation)."""
    if ACTIVATION == 1:
        g = tl.where(z > 0.0, 1.0, 0.0)
    elif ACTIVATION == 2:
        g = 0.5 * (1.0 + tl.math.erf(z * _SQRT1_2)) + z * tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
    elif ACTIVATION == 3:
        s = tl.sigmoid((z + z * z * z * _GELU_TANH_A) * _SQRT_2_OVER_PI * 2.0)
        g = s + z * s * (1.0 - s) * (z * z * _GELU_TANH_A * 3.0 + 1.0) * _SQRT_2_OVER_PI * 2.0
    elif ACTIVATION == 4:
        s = tl.sigmoid(z)
        g = s * (1.0 + z * (1.0 - s))
    else:
        g = tl.full(z.shape, 1.0, tl.float32)
    return g


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Map a linear program id to (row-block, column-block) in GROUP_M-tall column sweeps."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _accumulate(
    acc,
    a_ptr,
    b_ptr,
    offs_m,
    offs_n,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc += A[offs_m, :K] @ B[:K, offs_n]; offs_m/offs_n are wrapped in range, only K is masked."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _matmul_kernel(
    a_ptr,
    b_ptr,
    a2_ptr,
    b2_ptr,
    c_ptr,
    bias_ptr,
    z_ptr,
    M,
    N,
    K,
    K2,
    M_BUCKET,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_a2m,
    stride_a2k,
    stride_b2k,
    stride_b2n,
    stride_cm,
    stride_cn,
    stride_zm,
    stride_zn,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_Z: tl.constexpr,
    HAS_SECOND: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of C.

    a_ptr  [M, K]  strides (stride_am, stride_ak)     b_ptr  [K, N]  strides (stride_bk, stride_bn)
    a2_ptr [M, K2] strides (stride_a2m, stride_a2k)   b2_ptr [K2, N] strides (stride_b2k, stride_b2n)
    c_ptr  [M, N]  strides (stride_cm, stride_cn)     z_ptr  [M, N]  pre-activation, if STORE_Z
    bias_ptr [N] contiguous, if HAS_BIAS. M_BUCKET only keys the autotuner (M rounded up to 2^k).
    """
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Loads wrap out-of-range rows/columns back into range (their results are never stored), so the main
    # loop masks only the K tail.
    rows_in = rows % M
    cols_in = cols % N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _accumulate(
        acc,
        a_ptr,
        b_ptr,
        rows_in,
        cols_in,
        K,
        stride_am,
        stride_ak,
        stride_bk,
        stride_bn,
        INPUT_PRECISION,
        BLOCK_K,
    )
    if HAS_SECOND:
        acc = _accumulate(
            acc,
            a2_ptr,
            b2_ptr,
            rows_in,
            cols_in,
            K2,
            stride_a2m,
            stride_a2k,
            stride_b2k,
            stride_b2n,
            INPUT_PRECISION,
            BLOCK_K,
        )
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols_in).to(tl.float32)
        acc += bias[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if STORE_Z:
        tl.store(
            z_ptr + rows[:, None] * stride_zm + cols[None, :] * stride_zn,
            acc.to(z_ptr.dtype.element_ty),
            mask=mask,
        )
    acc = activation_fwd(acc, ACTIVATION)
    tl.store(
        c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=mask,
    )


_AUTOTUNE_KEY = [
    "M_BUCKET",
    "N",
    "K",
    "K2",
    "stride_am",
    "stride_ak",
    "stride_bk",
    "stride_bn",
    "ACTIVATION",
    "HAS_BIAS",
    "STORE_Z",
    "HAS_SECOND",
]
_matmul_kernel_tuned = triton.autotune(configs=_CUDA_CONFIGS, key=_AUTOTUNE_KEY)(_matmul_kernel)


def input_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision: IEEE fp32 unless torch allows TF32 for matmul; 16-bit inputs ignore it."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def launch(kernel_tuned, kernel, grid_fn, *args, **kwargs) -> None:
    """Launch the autotuned kernel on CUDA, or the pinned interpreter config under TRITON_INTERPRET=1."""
    if runtime.interpreter_enabled():
        meta = {**_INTERPRETER_CONFIG, **kwargs.pop("interpreter_config", {})}
        kernel[grid_fn(meta)](*args, **kwargs, **meta)
    else:
        kwargs.pop("interpreter_config", None)
        kernel_tuned[grid_fn](*args, **kwargs)


def matmul(
    a_MK: torch.Tensor,
    b_KN: torch.Tensor,
    out_MN: torch.Tensor,
    *,
    bias_N: torch.Tensor | None = None,
    activation: int = ACT_NONE,
    z_out_MN: torch.Tensor | None = None,
    a2_MK2: torch.Tensor | None = None,
    b2_K2N: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = act(a @ b (+ a2 @ b2) + bias)``, storing the pre-activation into ``z_out`` when given.

    Operands are any strided 2-D views; the caller has checked shapes, dtypes and devices.
    """
    M, K = a_MK.shape
    N = b_KN.shape[1]
    if M == 0 or N == 0:
        return out_MN
    has_second = a2_MK2 is not None
    a2 = a2_MK2 if has_second else a_MK
    b2 = b2_K2N if has_second else b_KN
    z = z_out_MN if z_out_MN is not None else out_MN
    bias = bias_N if bias_N is not None else out_MN

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    launch(
        _matmul_kernel_tuned,
        _matmul_kernel,
        grid,
        a_MK,
        b_KN,
        a2,
        b2,
        out_MN,
        bias,
        z,
        M,
        N,
        K,
        a2.shape[1],
        triton.next_power_of_2(M),
        a_MK.stride(0),
        a_MK.stride(1),
        b_KN.stride(0),
        b_KN.stride(1),
        a2.stride(0),
        a2.stride(1),
        b2.stride(0),
        b2.stride(1),
        out_MN.stride(0),
        out_MN.stride(1),
        z.stride(0),
        z.stride(1),
        ACTIVATION=activation,
        HAS_BIAS=bias_N is not None,
        STORE_Z=z_out_MN is not None,
        HAS_SECOND=has_second,
        INPUT_PRECISION=input_precision(a_MK.dtype),
    )
    return out_MN
