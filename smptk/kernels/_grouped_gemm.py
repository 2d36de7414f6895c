"""Triton core of :mod:`smptk.kernels.grouped_linear`: grouped GEMM kernels over experts, and launchers.

What the kernels compute, the tile schedule and why, and a worked example are in grouped_linear.py's
docstring; this module holds the tunables, the ``@triton.jit`` helpers (``expert_row_tile`` maps a row
tile to its expert by scanning the offsets; ``expert_rows`` clamps an expert's row range into [0, T]), the
kernels (forward / dx GEMM with a fused epilogue, SwiGLU forward with two accumulators, weight + bias
gradient, SwiGLU's elementwise backward) and their launchers (check nothing, allocate nothing).

Legend: T rows, K input features, N output features, E experts; the generic grouped product is
``out[T, C] = a[T, R] @ b[e][R, C]`` (R the reduction, C output columns). Every row index and address is
int64 (``rows * stride`` can pass 2^31); offsets are ``[E + 1]`` int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from smptk.kernels import _matmul, runtime
from smptk.kernels._buffers import new_buffer
from smptk.kernels._matmul import activation_fwd

# Forward / dx tiles. MoE experts see a few hundred to a few thousand rows each, so the candidates stop at
# 128-row tiles (a 256-row tile would be mostly padding for small experts). Untuned (no GPU run yet).
_MM_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=8),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
]
# SwiGLU forward keeps two accumulators: the same register budget as the largest plain tile. Untuned.
_SWIGLU_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=8),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
]
# Weight-grad tiles: [BLOCK_N, BLOCK_K] outputs, BLOCK_M rows of the expert per step. Untuned.
_DW_CONFIGS = [
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_M": 64}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 64, "BLOCK_M": 64}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_M": 64}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_M": 32}, num_stages=5, num_warps=4),
]
# Interpreter: 32-wide tiles (tl.dot needs 16; 32 leaves room for masked tails at the tests' odd sizes) and
# 4 experts per offsets load, so the tests' E = 7 takes the scan's multi-chunk path.
_MM_INTERPRETER = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}
_DW_INTERPRETER = {"BLOCK_N": 32, "BLOCK_K": 32, "BLOCK_M": 32}
_EXPERT_BLOCK = 128  # experts per vector load of the offsets in the tile scan: E <= 128 is one load; untuned
_EXPERT_BLOCK_INTERPRETER = 4
_DH_BLOCK = {"BLOCK_M": 32, "BLOCK_N": 128}  # elementwise, memory-bound; untuned
_DH_BLOCK_INTERPRETER = {"BLOCK_M": 16, "BLOCK_N": 32}


@triton.jit
def expert_rows(offsets_ptr, T, e):
    """Rows ``[lo, hi)`` of expert ``e`` (int64), clamped into ``[0, T]`` so bad offsets stay in bounds."""
    e = e.to(tl.int64)
    lo = tl.minimum(tl.maximum(tl.load(offsets_ptr + e), 0), T)
    hi = tl.minimum(tl.maximum(tl.load(offsets_ptr + e + 1), lo), T)
    return lo, hi


@triton.jit
def expert_row_tile(offsets_ptr, E, T, tile, BLOCK_M: tl.constexpr, EXPERT_BLOCK: tl.constexpr):
    """(expert, first row, end row) of row tile ``tile``; (-1, 0, 0) when ``tile`` is past the last one.

    Expert e owns tiles ``[P(e), P(e) + cdiv(rows_e, BLOCK_M))`` with P the exclusive prefix sum of the
    tile counts, and tile ``P(e) + i`` covers rows ``[lo_e + i * BLOCK_M, min(lo_e + (i + 1) * BLOCK_M,
    hi_e))`` (the end row returned is hi_e; callers mask rows >= it). offsets_ptr: [E + 1] int64. All
    results are int64, so rows past 2^31 are exact.
    """
    tile = tile.to(tl.int64)
    expert = tile * 0  # int64 scalar zeros (loop-carried values keep one type)
    row_start = tile * 0
    row_end = tile * 0
    tiles_before = tile * 0
    for e0 in range(0, E, EXPERT_BLOCK):
        idx = e0 + tl.arange(0, EXPERT_BLOCK)
        ok = idx < E
        lo = tl.minimum(tl.maximum(tl.load(offsets_ptr + idx, mask=ok, other=0), 0), T)
        hi = tl.minimum(tl.maximum(tl.load(offsets_ptr + idx + 1, mask=ok, other=0), lo), T)
        n_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
        end = tiles_before + tl.cumsum(n_tiles, 0)  # inclusive prefix: expert idx ends before tile `end`
        first = end - n_tiles
        hit = (tile >= first) & (tile < end)  # at most one expert in all chunks (empty ones never hit)
        expert += tl.sum(tl.where(hit, idx + 1, 0).to(tl.int64), 0)
        row_start += tl.sum(tl.where(hit, lo + (tile - first) * BLOCK_M, 0), 0)
        row_end += tl.sum(tl.where(hit, hi, 0), 0)
        tiles_before += tl.sum(n_tiles, 0)
    return expert - 1, row_start, row_end


@triton.jit
def _swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Program id -> (row tile, column tile), GROUP_M row tiles per column sweep (keeps a weight tile hot)."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _dot_loop(
    acc, a_ptr, b_ptr, rows, cols, R, s_am, s_ar, s_br, s_bc, PRECISION: tl.constexpr, BLOCK_R: tl.constexpr
):
    """acc += a[rows, :R] @ b[:R, cols]; rows and cols are in range (clamped), only the R tail is masked.

    Offsets and pointer steps are int64: with a column-major x (s_ar = T) ``BLOCK_R * s_ar`` passes 2^31
    from T = 2^25 rows on.
    """
    offs = tl.arange(0, BLOCK_R).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * s_am + offs[None, :] * s_ar
    b_ptrs = b_ptr + offs[:, None] * s_br + cols[None, :] * s_bc
    a_step = tl.full([], BLOCK_R, tl.int64) * s_ar
    b_step = tl.full([], BLOCK_R, tl.int64) * s_br
    for r in range(0, tl.cdiv(R, BLOCK_R)):
        left = R - r * BLOCK_R
        a = tl.load(a_ptrs, mask=offs[None, :] < left, other=0.0)
        b = tl.load(b_ptrs, mask=offs[:, None] < left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += a_step
        b_ptrs += b_step
    return acc


@triton.jit
def _grouped_mm_kernel(
    a_ptr, b_ptr, a2_ptr, b2_ptr, c_ptr, bias_ptr, z_ptr, offsets_ptr,
    T, R, C, E, T_BUCKET,
    s_am, s_ar, s_be, s_br, s_bc, s_a2m, s_a2r, s_b2e, s_b2r, s_b2c,
    s_cm, s_cc, s_biase, s_zm, s_zc,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_Z: tl.constexpr, HAS_SECOND: tl.constexpr,
    PRECISION: tl.constexpr, EXPERT_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of ``out = act(a_e @ b[e] (+ a2_e @ b2[e]) + bias[e])`` inside one expert.

    a_ptr, a2_ptr [T, R] (s_am, s_ar); b_ptr, b2_ptr [E, R, C] (s_be, s_br, s_bc); c_ptr, z_ptr [T, C]
    (z: the pre-activation, if STORE_Z); bias_ptr [E, C] (s_biase, unit column stride); offsets_ptr
    [E + 1] int64. Forward: a = x, b[e] = weight[e].T (R = K, C = N). dx: a = dz, b[e] = weight[e]
    (R = N, C = K). T_BUCKET only keys the autotuner.
    """
    pid_m, pid_n = _swizzle(tl.program_id(0), T // BLOCK_M + tl.minimum(E, T), tl.cdiv(C, BLOCK_N), GROUP_M)
    expert, row_start, row_end = expert_row_tile(offsets_ptr, E, T, pid_m, BLOCK_M, EXPERT_BLOCK)
    if row_start >= row_end:  # an upper-bound tile with no rows
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Loads clamp tail rows onto the expert's last row and wrap tail columns (results never stored): the
    # loop masks only the reduction tail, and no load reads another expert's rows.
    rows_in = tl.minimum(rows, row_end - 1)
    cols_in = cols % C
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _dot_loop(
        acc, a_ptr, b_ptr + expert * s_be, rows_in, cols_in, R, s_am, s_ar, s_br, s_bc, PRECISION, BLOCK_K
    )
    if HAS_SECOND:
        acc = _dot_loop(
            acc, a2_ptr, b2_ptr + expert * s_b2e, rows_in, cols_in, R, s_a2m, s_a2r, s_b2r, s_b2c,
            PRECISION, BLOCK_K,
        )  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * s_biase + cols_in).to(tl.float32)[None, :]
    mask = (rows[:, None] < row_end) & (cols[None, :] < C)
    if STORE_Z:
        z_ptrs = z_ptr + rows[:, None] * s_zm + cols[None, :] * s_zc
        tl.store(z_ptrs, acc.to(z_ptr.dtype.element_ty), mask=mask)
    acc = activation_fwd(acc, ACTIVATION)
    tl.store(c_ptr + rows[:, None] * s_cm + cols[None, :] * s_cc, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_swiglu_fwd_kernel(
    x_ptr, wg_ptr, wu_ptr, y_ptr, h_ptr, offsets_ptr,
    T, K, N, E, T_BUCKET,
    s_xm, s_xk, s_wge, s_wgn, s_wgk, s_wue, s_wun, s_wuk, s_ym, s_yn, s_hm, s_hn,
    STORE_H: tl.constexpr, PRECISION: tl.constexpr, EXPERT_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of y = silu(g) * u inside one expert, x read once for both products.

    x_ptr [T, K]; wg_ptr, wu_ptr [E, N, K]; y_ptr [T, N]; h_ptr [T, 2N] (g in columns [0, N), u in
    [N, 2N)), written only if STORE_H; offsets_ptr [E + 1] int64. All with the given strides.
    """
    pid_m, pid_n = _swizzle(tl.program_id(0), T // BLOCK_M + tl.minimum(E, T), tl.cdiv(N, BLOCK_N), GROUP_M)
    expert, row_start, row_end = expert_row_tile(offsets_ptr, E, T, pid_m, BLOCK_M, EXPERT_BLOCK)
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = tl.minimum(rows, row_end - 1)
    cols_in = cols % N
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # int64 offsets and steps, as in _dot_loop
    x_ptrs = x_ptr + rows_in[:, None] * s_xm + offs_k[None, :] * s_xk
    # Weights are read as [K, N] tiles: element (k, n) of w[e].T is w[e, n, k].
    wg_ptrs = wg_ptr + expert * s_wge + offs_k[:, None] * s_wgk + cols_in[None, :] * s_wgn
    wu_ptrs = wu_ptr + expert * s_wue + offs_k[:, None] * s_wuk + cols_in[None, :] * s_wun
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_step = tl.full([], BLOCK_K, tl.int64) * s_xk
    wg_step = tl.full([], BLOCK_K, tl.int64) * s_wgk
    wu_step = tl.full([], BLOCK_K, tl.int64) * s_wuk
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        wg = tl.load(wg_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        wu = tl.load(wu_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc_g = tl.dot(x, wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(x, wu, acc_u, input_precision=PRECISION)
        x_ptrs += x_step
        wg_ptrs += wg_step
        wu_ptrs += wu_step
    mask = (rows[:, None] < row_end) & (cols[None, :] < N)
    if STORE_H:
        h_ptrs = h_ptr + rows[:, None] * s_hm + cols[None, :] * s_hn
        tl.store(h_ptrs, acc_g.to(h_ptr.dtype.element_ty), mask=mask)
        tl.store(h_ptrs + N * s_hn, acc_u.to(h_ptr.dtype.element_ty), mask=mask)
    y = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(y_ptr + rows[:, None] * s_ym + cols[None, :] * s_yn, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_dw_kernel(
    dz_ptr, x_ptr, dw_ptr, db_ptr, offsets_ptr,
    T, N, K, T_BUCKET,
    s_dzm, s_dzn, s_xm, s_xk, s_dwe, s_dwn, s_dwk, s_dbe,
    STORE_DW: tl.constexpr, STORE_DB: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """dw[e, n-tile, k-tile] = dz_e[:, n-tile].T @ x_e[:, k-tile], looping over expert e's rows.

    dz_ptr [T, N]; x_ptr [T, K]; dw_ptr [E, N, K]; db_ptr [E, N] (unit column stride): the programs of
    k-tile 0 store dz_e's column sums there if STORE_DB. Program id = (e * k_tiles + k-tile) * n_tiles +
    n-tile, k_tiles = cdiv(K, BLOCK_K) if STORE_DW else 1. An empty expert stores zeros.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K) if STORE_DW else 1
    expert = (pid // (num_n * num_k)).to(tl.int64)
    pid_k = (pid // num_n) % num_k
    pid_n = pid % num_n
    lo, hi = expert_rows(offsets_ptr, T, expert)
    cols_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_k = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_in = cols_n % N
    k_in = cols_k % K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    colsum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    for r in range(lo, hi, BLOCK_M):
        rows = r + offs_m
        ok = rows < hi
        dz_t = tl.load(dz_ptr + rows[None, :] * s_dzm + n_in[:, None] * s_dzn, mask=ok[None, :], other=0.0)
        if STORE_DW:
            x = tl.load(x_ptr + rows[:, None] * s_xm + k_in[None, :] * s_xk, mask=ok[:, None], other=0.0)
            acc = tl.dot(dz_t, x, acc, input_precision=PRECISION)
        if STORE_DB:
            colsum += tl.sum(dz_t.to(tl.float32), axis=1)
    if STORE_DW:
        dw_ptrs = dw_ptr + expert * s_dwe + cols_n[:, None] * s_dwn + cols_k[None, :] * s_dwk
        tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=(cols_n[:, None] < N) & (cols_k[None, :] < K))
    if STORE_DB:  # noqa: SIM102 (a constexpr and a runtime test: Triton cannot `and` them)
        if pid_k == 0:
            tl.store(db_ptr + expert * s_dbe + cols_n, colsum.to(db_ptr.dtype.element_ty), mask=cols_n < N)


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
    s = tl.sigmoid(g)
    dh_ptrs = dh_ptr + rows[:, None] * s_dhm + cols[None, :] * s_dhn
    tl.store(dh_ptrs, (dy * u * s * (1.0 + g * (1.0 - s))).to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptrs + N * s_dhn, (dy * g * s).to(dh_ptr.dtype.element_ty), mask=mask)


_MM_KEY = ["T_BUCKET", "R", "C", "E", "s_am", "s_ar", "s_br", "s_bc", "ACTIVATION", "HAS_BIAS", "STORE_Z"]
_MM_KEY += ["HAS_SECOND"]
_grouped_mm_kernel_tuned = triton.autotune(configs=_MM_CONFIGS, key=_MM_KEY)(_grouped_mm_kernel)
_grouped_swiglu_fwd_kernel_tuned = triton.autotune(
    configs=_SWIGLU_CONFIGS, key=["T_BUCKET", "K", "N", "E", "s_xm", "s_xk", "STORE_H"]
)(_grouped_swiglu_fwd_kernel)
_grouped_dw_kernel_tuned = triton.autotune(
    configs=_DW_CONFIGS, key=["T_BUCKET", "N", "K", "s_dzm", "s_dzn", "s_xm", "s_xk", "STORE_DW", "STORE_DB"]
)(_grouped_dw_kernel)


def row_tile_bound(T: int, E: int, block_m: int) -> int:
    """Upper bound on the row tiles of any offsets: sum_e cdiv(rows_e, block_m) <= T // block_m + min(E, T)
    (the full tiles fit in T // block_m, and at most one partial tile per non-empty expert)."""
    return T // block_m + min(E, T)


def _launch(tuned, kernel, interpreter_meta, grid_fn, *args, **kwargs) -> None:
    """The autotuned kernel on CUDA, the pinned interpreter config under TRITON_INTERPRET=1."""
    if runtime.interpreter_enabled():
        kernel[grid_fn(interpreter_meta)](*args, **kwargs, **interpreter_meta)
    else:
        tuned[grid_fn](*args, **kwargs)


def _expert_block() -> int:
    return _EXPERT_BLOCK_INTERPRETER if runtime.interpreter_enabled() else _EXPERT_BLOCK


def _row_grid(T: int, E: int, C: int):
    def grid(meta):
        programs = row_tile_bound(T, E, meta["BLOCK_M"]) * triton.cdiv(C, meta["BLOCK_N"])
        if programs >= 2**31:
            raise ValueError(f"x: {T} rows x {C} columns need {programs} programs, more than a launch takes")
        return (programs,)

    return grid


def grouped_matmul(
    a_TR: torch.Tensor,
    b_ERC: torch.Tensor,
    offsets: torch.Tensor,
    out_TC: torch.Tensor,
    *,
    bias_EC: torch.Tensor | None = None,
    activation: int = _matmul.ACT_NONE,
    z_TC: torch.Tensor | None = None,
    a2_TR: torch.Tensor | None = None,
    b2_ERC: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[rows of e] = act(a[rows of e] @ b[e] (+ a2 @ b2[e]) + bias[e])`` for every expert, one launch.

    Operands are strided views; ``offsets`` int64 [E + 1]; the caller has checked everything.
    """
    T, R = a_TR.shape
    E, C = b_ERC.shape[0], b_ERC.shape[2]
    if T == 0 or C == 0:
        return out_TC
    has_second = a2_TR is not None
    a2, b2 = (a2_TR, b2_ERC) if has_second else (a_TR, b_ERC)
    z = z_TC if z_TC is not None else out_TC
    bias = bias_EC if bias_EC is not None else out_TC
    _launch(
        _grouped_mm_kernel_tuned, _grouped_mm_kernel, _MM_INTERPRETER, _row_grid(T, E, C),
        a_TR, b_ERC, a2, b2, out_TC, bias, z, offsets,
        T, R, C, E, triton.next_power_of_2(T),
        *a_TR.stride(), *b_ERC.stride(), *a2.stride(), *b2.stride(),
        *out_TC.stride(), bias.stride(0), *z.stride(),
        ACTIVATION=activation, HAS_BIAS=bias_EC is not None, STORE_Z=z_TC is not None,
        HAS_SECOND=has_second, PRECISION=_matmul.input_precision(a_TR.dtype), EXPERT_BLOCK=_expert_block(),
    )  # fmt: skip
    return out_TC


def grouped_weight_grad(
    dz_TN: torch.Tensor,
    x_TK: torch.Tensor,
    offsets: torch.Tensor,
    dw_ENK: torch.Tensor | None,
    db_EN: torch.Tensor | None,
) -> None:
    """``dw[e] = dz_e.T @ x_e`` into ``dw_ENK`` and ``db[e] = sum of dz_e's rows`` into ``db_EN`` (each may be
    None), one launch; empty experts (and T = 0) get exact zeros."""
    T, N = dz_TN.shape
    K = x_TK.shape[1]
    E = offsets.shape[0] - 1
    store_dw = dw_ENK is not None and K > 0
    if T == 0 or N == 0 or not (store_dw or db_EN is not None):
        for t in (dw_ENK, db_EN):
            if t is not None:
                t.zero_()
        return
    dw = dw_ENK if store_dw else dz_TN.new_empty((1, 1, 1))
    db = db_EN if db_EN is not None else dz_TN.new_empty((1, 1))

    def grid(meta):
        k_tiles = triton.cdiv(K, meta["BLOCK_K"]) if store_dw else 1
        return (E * k_tiles * triton.cdiv(N, meta["BLOCK_N"]),)

    _launch(
        _grouped_dw_kernel_tuned, _grouped_dw_kernel, _DW_INTERPRETER, grid,
        dz_TN, x_TK, dw, db, offsets, T, N, K, triton.next_power_of_2(T),
        *dz_TN.stride(), *x_TK.stride(), *dw.stride(), db.stride(0),
        STORE_DW=store_dw, STORE_DB=db_EN is not None, PRECISION=_matmul.input_precision(x_TK.dtype),
    )  # fmt: skip


def swiglu_dh(dy_TN: torch.Tensor, h_T2N: torch.Tensor) -> torch.Tensor:
    """``dh = [dy * u * silu'(g) | dy * silu(g)]`` ``[T, 2N]`` from dy ``[T, N]`` and ``h = [g | u]``."""
    T, N = dy_TN.shape
    dh = new_buffer((T, 2 * N), dy_TN.dtype, dy_TN.device)
    if T and N:
        blocks = _DH_BLOCK_INTERPRETER if runtime.interpreter_enabled() else _DH_BLOCK
        grid = (triton.cdiv(T, blocks["BLOCK_M"]), triton.cdiv(N, blocks["BLOCK_N"]))
        _swiglu_dh_kernel[grid](
            dy_TN, h_T2N, dh, T, N, *dy_TN.stride(), *h_T2N.stride(), *dh.stride(), **blocks
        )
    return dh


def grouped_swiglu_fwd(
    x_TK: torch.Tensor,
    wg_ENK: torch.Tensor,
    wu_ENK: torch.Tensor,
    offsets: torch.Tensor,
    y_TN: torch.Tensor,
    h_T2N: torch.Tensor | None,
) -> None:
    """``y = silu(x_e @ wg[e].T) * (x_e @ wu[e].T)`` per expert into ``y_TN``, and ``h = [g | u]`` into
    ``h_T2N`` unless it is None; one launch."""
    T, K = x_TK.shape
    E, N = wg_ENK.shape[:2]
    if T == 0 or N == 0:
        return
    h = h_T2N if h_T2N is not None else y_TN
    _launch(
        _grouped_swiglu_fwd_kernel_tuned, _grouped_swiglu_fwd_kernel, _MM_INTERPRETER, _row_grid(T, E, N),
        x_TK, wg_ENK, wu_ENK, y_TN, h, offsets, T, K, N, E, triton.next_power_of_2(T),
        *x_TK.stride(), *wg_ENK.stride(), *wu_ENK.stride(), *y_TN.stride(), *h.stride(),
        STORE_H=h_T2N is not None, PRECISION=_matmul.input_precision(x_TK.dtype),
        EXPERT_BLOCK=_expert_block(),
    )  # fmt: skip
