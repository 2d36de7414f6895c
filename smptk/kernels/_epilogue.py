"""Elementwise math of the GEMM engine: activations, their derivatives, and the backward passes between GEMMs.

Part of the private GEMM engine (``_gemm.py`` holds the GEMM kernel, schedule and launch; ``_index.py``
the int64 row and expert index helpers; this file the elementwise math). Every op that multiplies
(fused_linear, swiglu, grouped_linear, grouped_swiglu) uses these, so each exists once:

- ``activation_fwd`` / ``activation_grad``: act(z) and act'(z) in fp32, by integer code (``ACT_*``); the
  GEMM epilogue applies the first, ``activation_backward`` the second.
- ``activation_backward``: ``dz = dy * act'(z)`` plus the column sums of dz (the bias gradient) as
  per-row-chunk fp32 partials and a second deterministic pass (no atomics).
- ``swiglu_dh``: ``dh = [dy * u * silu'(g) | dy * silu(g)]`` from ``h = [g | u]``.

Legend: M rows, N columns; ``*_MN`` names a tensor of shape [M, N].

Both backward passes are memory-bound (a few fp32 operations per element read). Their tiles are untuned.
"""

from __future__ import annotations

import torch

from smptk.kernels import runtime
from smptk.kernels._buffers import new_buffer
from smptk.kernels._triton import tl, triton

ACT_NONE, ACT_RELU, ACT_GELU, ACT_GELU_TANH, ACT_SILU = 0, 1, 2, 3, 4
ACTIVATION_CODES = {
    None: ACT_NONE,
    "relu": ACT_RELU,
    "gelu": ACT_GELU,
    "gelu_tanh": ACT_GELU_TANH,
    "silu": ACT_SILU,
}

# Globals read inside @triton.jit must be tl.constexpr (the compiler rejects plain Python globals; the
# interpreter does not, so CPU tests cannot catch this). Keep tensors on the left of each product.
_SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1/sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1/sqrt(2*pi)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2/pi)
_GELU_TANH_A = tl.constexpr(0.044715)

# dz tiles. ROWS_PER_PROG rows per program bound the partial-sum buffer to ceil(M/512) x N fp32
# (32 x 14336 x 4 B = 1.8 MB at M=16384) while leaving thousands of programs at LLM sizes. Untuned.
_ACT_BWD_BLOCK = {"BLOCK_M": 32, "BLOCK_N": 128, "ROWS_PER_PROG": 512}
# dy, z or dz without a unit stride along N (a view from autograd): every element has its own 64-bit
# addresses, so a quarter of the rows per step. At 32 rows ptxas spilled 248 B (sm_90, Triton 3.9; 1.4 KB on
# 3.6); at 8 nothing spills (62 registers on 3.9, 147 on 3.6).
_ACT_BWD_BLOCK_STRIDED = {"BLOCK_M": 8, "BLOCK_N": 128, "ROWS_PER_PROG": 512}
_ACT_BWD_BLOCK_INTERPRETER = {"BLOCK_M": 16, "BLOCK_N": 32, "ROWS_PER_PROG": 32}
_COLSUM_BLOCK_N = 256  # one program reduces 256 columns over all partial rows; untuned
_DH_BLOCK = {"BLOCK_M": 32, "BLOCK_N": 128}  # untuned
_DH_BLOCK_INTERPRETER = {"BLOCK_M": 16, "BLOCK_N": 32}


@triton.jit
def activation_fwd(z, ACTIVATION: tl.constexpr):
    """act(z) for fp32 ``z``. gelu_tanh uses 0.5*z*(1 + tanh(u)) == z * sigmoid(2u) (no tanh intrinsic)."""
    if ACTIVATION == 1:
        z = tl.where(z < 0.0, 0.0, z)  # NaN stays NaN, as torch.relu (tl.maximum returned 0 for it)
    elif ACTIVATION == 2:
        z = 0.5 * z * (1.0 + tl.math.erf(z * _SQRT1_2))
    elif ACTIVATION == 3:
        u = (z + z * z * z * _GELU_TANH_A) * _SQRT_2_OVER_PI
        z = z * tl.sigmoid(2.0 * u)
    elif ACTIVATION == 4:
        z = z * tl.sigmoid(z)
    return z


_FLAT = tl.constexpr(100.0)  # |z| beyond it: gelu' / gelu_tanh' / silu' are 0 (z < 0) or 1 in fp32
_FMAX = tl.constexpr(3.0e38)  # a finite stand-in for an infinite saved value (below fp32's 3.4e38)


@triton.jit
def _flat_tails(z, g):
    """``g`` (an activation's derivative at fp32 ``z``), but exactly 0 / 1 where ``|z| > 100``: there the
    formulas multiply 0 by an overflowed term, and a pre-activation saved in 16 bits is +-inf where the
    fp32 one passed 65504 (the forward, which reads the fp32 value, stays finite): NaN otherwise."""
    return tl.where(tl.abs(z) > _FLAT, tl.where(z > 0.0, 1.0, 0.0), g)


@triton.jit
def activation_grad(z, ACTIVATION: tl.constexpr):
    """d act(z) / dz for fp32 ``z`` (1 for no activation); finite for infinite ``z`` (see ``_flat_tails``)."""
    if ACTIVATION == 1:
        g = tl.where(z <= 0.0, 0.0, 1.0)  # 1 at NaN: torch's relu backward passes the gradient there
    elif ACTIVATION == 2:
        g = 0.5 * (1.0 + tl.math.erf(z * _SQRT1_2)) + z * tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
        g = _flat_tails(z, g)
    elif ACTIVATION == 3:
        s = tl.sigmoid((z + z * z * z * _GELU_TANH_A) * _SQRT_2_OVER_PI * 2.0)
        g = s + z * s * (1.0 - s) * (z * z * _GELU_TANH_A * 3.0 + 1.0) * _SQRT_2_OVER_PI * 2.0
        g = _flat_tails(z, g)
    elif ACTIVATION == 4:
        s = tl.sigmoid(z)
        g = _flat_tails(z, s * (1.0 + z * (1.0 - s)))
    else:
        g = tl.full(z.shape, 1.0, tl.float32)
    return g


@triton.jit
def _act_bwd_kernel(
    dy_ptr, z_ptr, dz_ptr, partial_ptr, M, N,
    s_dym, s_dyn, s_zm, s_zn, s_dzm, s_dzn,
    ACTIVATION: tl.constexpr, STORE_DZ: tl.constexpr, COLSUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS_PER_PROG: tl.constexpr,
):  # fmt: skip
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
        dz = tl.load(dy_ptr + rows[:, None] * s_dym + cols[None, :] * s_dyn, mask=mask, other=0.0)
        dz = dz.to(tl.float32)
        if ACTIVATION != 0:
            z = tl.load(z_ptr + rows[:, None] * s_zm + cols[None, :] * s_zn, mask=mask, other=0.0)
            dz = dz * activation_grad(z.to(tl.float32), ACTIVATION)
        if STORE_DZ:
            dz_ptrs = dz_ptr + rows[:, None] * s_dzm + cols[None, :] * s_dzn
            tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
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


@triton.jit
def _swiglu_dh_kernel(
    dy_ptr, h_ptr, dh_ptr, M, N, s_dym, s_dyn, s_hm, s_hn, s_dhm, s_dhn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dh = [dy * u * silu'(g) | dy * silu(g)] for one tile; dy [M, N]; h = [g | u] and dh are [M, 2N]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    dy = tl.load(dy_ptr + rows[:, None] * s_dym + cols[None, :] * s_dyn, mask=mask, other=0.0).to(tl.float32)
    h_ptrs = h_ptr + rows[:, None] * s_hm + cols[None, :] * s_hn
    g = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptrs + N * s_hn, mask=mask, other=0.0).to(tl.float32)
    # g and u are saved in 16 bits: +-inf where the fp32 products passed 65504 (fp16), though the forward
    # read the fp32 ones. silu and silu' take their exact tails there, u a finite stand-in, and u meets
    # silu' before dy, so a zero derivative gives 0, not inf * 0 = NaN.
    u = tl.where(tl.abs(u) == float("inf"), tl.where(u > 0.0, _FMAX, -_FMAX), u)
    s = tl.sigmoid(g)
    silu = tl.where(g < -_FLAT, 0.0, g * s)
    dsilu = _flat_tails(g, s * (1.0 + g * (1.0 - s)))
    dh_ptrs = dh_ptr + rows[:, None] * s_dhm + cols[None, :] * s_dhn
    tl.store(dh_ptrs, (dy * (u * dsilu)).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptrs + N * s_dhn, (dy * silu).to(dh_ptr.dtype.element_ty), mask=mask)


def activation_backward(
    dy_MN: torch.Tensor, z_MN: torch.Tensor | None, activation: int, want_colsum: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(dz, column sums of dz)``: dz = dy * act'(z) (dy itself without activation).

    ``want_colsum`` asks for the column sums (the bias gradient) in ``out_dtype``; otherwise None.
    """
    M, N = dy_MN.shape
    store_dz = activation != ACT_NONE
    if not store_dz and not want_colsum:
        return dy_MN, None
    dz = new_buffer((M, N), dy_MN.dtype, dy_MN.device) if store_dz else dy_MN
    colsum = new_buffer((N,), out_dtype, dy_MN.device) if want_colsum else None
    if M == 0 or N == 0:
        if colsum is not None:
            colsum.zero_()
        return dz, colsum
    z = z_MN if z_MN is not None else dy_MN
    if runtime.interpreter_enabled():
        blocks = _ACT_BWD_BLOCK_INTERPRETER
    elif any(t.stride(1) != 1 for t in (dy_MN, z, dz)):
        blocks = _ACT_BWD_BLOCK_STRIDED
    else:
        blocks = _ACT_BWD_BLOCK
    rows = triton.cdiv(M, blocks["ROWS_PER_PROG"])
    partial = new_buffer((rows, N), torch.float32, dy_MN.device) if want_colsum else dy_MN
    _act_bwd_kernel[(rows, triton.cdiv(N, blocks["BLOCK_N"]))](
        dy_MN, z, dz, partial, M, N, *dy_MN.stride(), *z.stride(), *dz.stride(),
        ACTIVATION=activation, STORE_DZ=store_dz, COLSUM=want_colsum, **blocks,
    )  # fmt: skip
    if want_colsum:
        _colsum_kernel[(triton.cdiv(N, _COLSUM_BLOCK_N),)](partial, colsum, rows, N, BLOCK_N=_COLSUM_BLOCK_N)
    return dz, colsum


def swiglu_dh(dy_MN: torch.Tensor, h_M2N: torch.Tensor) -> torch.Tensor:
    """``dh = [dy * u * silu'(g) | dy * silu(g)]`` ``[M, 2N]`` from dy ``[M, N]`` and ``h = [g | u]``."""
    M, N = dy_MN.shape
    dh = new_buffer((M, 2 * N), dy_MN.dtype, dy_MN.device)
    if M and N:
        blocks = _DH_BLOCK_INTERPRETER if runtime.interpreter_enabled() else _DH_BLOCK
        grid = (triton.cdiv(M, blocks["BLOCK_M"]), triton.cdiv(N, blocks["BLOCK_N"]))
        _swiglu_dh_kernel[grid](
            dy_MN, h_M2N, dh, M, N, *dy_MN.stride(), *h_M2N.stride(), *dh.stride(), **blocks
        )
    return dh
