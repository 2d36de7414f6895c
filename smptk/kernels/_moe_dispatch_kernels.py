"""The Triton kernels of moe_dispatch / moe_combine: the dispatch plan, the row gather and the backward.

Legend: T tokens, H hidden size, E experts, k slots per token (top_k), P = T * k pairs numbered
``p = t * k + j`` (token t, slot j), R rows of the grouped buffer (the pairs kept). Each kernel's docstring
gives its pointers' shapes and strides.

What they compute, the algorithm (histogram, scan, scatter, gather; no sort), the worked example and the
launchers with their block sizes are in ``moe_dispatch.py``. The kernels are a module of their own so that
importing ``smptk.kernels`` does not import triton: ``moe_dispatch.py`` imports this module on its first
Triton-path call (see ``_triton.py``).

Index math is int64 wherever an offset can pass 2^31: int32 values (program ids, loaded ids) enter through
``_index.row_offset`` / ``_index.pair_coords``.
"""

from __future__ import annotations

from smptk.kernels._index import pair_coords, row_offset
from smptk.kernels._triton import tl, triton


@triton.jit
def _dispatch_hist_kernel(
    ids_ptr,
    hist_ptr,
    bad_ptr,
    P,
    E,
    top_k,
    stride_it,
    stride_ik,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PAIRS_PER_PROG: tl.constexpr,
):
    """Per-program expert histogram of pairs [pid * PAIRS_PER_PROG, +PAIRS_PER_PROG).

    ids_ptr: [T, k] int32/int64 with strides (stride_it, stride_ik); pair p = t * k + j.
    hist_ptr: [num_progs, E] int32 contiguous (row pid written in full). bad_ptr: [num_progs] int32, the
    number of ids outside [0, E) among this program's pairs.
    """
    pid = tl.program_id(0)
    e_idx = tl.arange(0, BLOCK_E)
    hist = tl.zeros((BLOCK_E,), dtype=tl.int32)
    bad = tl.zeros((BLOCK_P,), dtype=tl.int32)
    p0 = row_offset(pid, PAIRS_PER_PROG)
    for c in range(0, PAIRS_PER_PROG, BLOCK_P):
        p = p0 + c + tl.arange(0, BLOCK_P)
        ok = p < P
        t, j = pair_coords(p, top_k)
        ids = tl.load(ids_ptr + t * stride_it + j * stride_ik, mask=ok, other=0).to(tl.int64)
        valid = ok & (ids >= 0) & (ids < E)
        onehot = (ids[:, None] == e_idx[None, :]) & valid[:, None]
        hist += tl.sum(onehot.to(tl.int32), axis=0)
        bad += (ok & ~valid).to(tl.int32)
    tl.store(hist_ptr + row_offset(pid, E) + e_idx, hist, mask=e_idx < E)
    tl.store(bad_ptr + pid, tl.sum(bad, axis=0))


@triton.jit
def _dispatch_scan_kernel(
    hist_ptr,
    bad_ptr,
    base_ptr,
    offsets_ptr,
    kept_ptr,
    summary_ptr,
    num_progs,
    E,
    capacity,
    BLOCK_B: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """One program: scans of the histograms over programs and of the kept counts over experts.

    hist_ptr: [num_progs, E] int32; bad_ptr: [num_progs] int32.
    base_ptr: [num_progs, E] int64, base[b, e] = sum over b' < b of hist[b', e].
    offsets_ptr: [E + 1] int64, exclusive scan of kept.
    kept_ptr: [E] int64, kept[e] = min(count[e], capacity).
    summary_ptr: [2] int64 = (rows kept = offsets[E], ids outside [0, E)).
    """
    e_idx = tl.arange(0, BLOCK_E)
    e_ok = e_idx < E
    carry = tl.zeros((BLOCK_E,), dtype=tl.int64)
    bad = tl.zeros((BLOCK_B,), dtype=tl.int64)
    for b0 in range(0, num_progs, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        mask = (b < num_progs)[:, None] & e_ok[None, :]
        offs = row_offset(b, E)[:, None] + e_idx[None, :]
        tile = tl.load(hist_ptr + offs, mask=mask, other=0).to(tl.int64)
        incl = tl.cumsum(tile, axis=0)
        tl.store(base_ptr + offs, incl - tile + carry[None, :], mask=mask)
        carry += tl.sum(tile, axis=0)
        bad += tl.load(bad_ptr + b, mask=b < num_progs, other=0).to(tl.int64)
    kept = tl.minimum(carry, capacity)
    kept_incl = tl.cumsum(kept, axis=0)
    total = tl.sum(kept, axis=0)
    tl.store(kept_ptr + e_idx, kept, mask=e_ok)
    tl.store(offsets_ptr + e_idx, kept_incl - kept, mask=e_ok)
    tl.store(offsets_ptr + E, total)
    tl.store(summary_ptr, total)
    tl.store(summary_ptr + 1, tl.sum(bad, axis=0))


@triton.jit
def _dispatch_scatter_kernel(
    ids_ptr,
    base_ptr,
    offsets_ptr,
    dest_ptr,
    src_token_ptr,
    src_pair_ptr,
    P,
    E,
    top_k,
    capacity,
    stride_it,
    stride_ik,
    BLOCK_P: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PAIRS_PER_PROG: tl.constexpr,
):
    """Stable positions and destinations of the pairs [pid * PAIRS_PER_PROG, +PAIRS_PER_PROG).

    ids_ptr: [T, k] as in the histogram kernel. base_ptr: [num_progs, E] int64; offsets_ptr: [E + 1] int64.
    dest_ptr: [T, k] int64 contiguous (flat index p), the grouped row of each pair or -1 when dropped.
    src_token_ptr, src_pair_ptr: [R] int64; row dest[p] gets t and p for every kept pair p.
    """
    pid = tl.program_id(0)
    e_idx = tl.arange(0, BLOCK_E)
    e_ok = e_idx < E
    running = tl.load(base_ptr + row_offset(pid, E) + e_idx, mask=e_ok, other=0)  # int64 [BLOCK_E]
    start = tl.load(offsets_ptr + e_idx, mask=e_ok, other=0)
    p0 = row_offset(pid, PAIRS_PER_PROG)
    for c in range(0, PAIRS_PER_PROG, BLOCK_P):
        p = p0 + c + tl.arange(0, BLOCK_P)
        ok = p < P
        t, j = pair_coords(p, top_k)
        ids = tl.load(ids_ptr + t * stride_it + j * stride_ik, mask=ok, other=0).to(tl.int64)
        valid = ok & (ids >= 0) & (ids < E)
        onehot = (ids[:, None] == e_idx[None, :]) & valid[:, None]
        oh = onehot.to(tl.int32)
        incl = tl.cumsum(oh, axis=0)  # in-chunk: pairs of each expert up to and including this one
        pos = tl.sum(tl.where(onehot, running[None, :] + (incl - 1), 0), axis=1)
        row0 = tl.sum(tl.where(onehot, start[None, :], 0), axis=1)
        keep = valid & (pos < capacity)
        d = tl.where(keep, row0 + pos, -1)
        tl.store(dest_ptr + p, d, mask=ok)
        tl.store(src_token_ptr + d, t, mask=keep)
        tl.store(src_pair_ptr + d, p, mask=keep)
        running += tl.sum(oh, axis=0).to(tl.int64)


@triton.jit
def _gather_rows_kernel(
    x_ptr,
    src_ptr,
    out_ptr,
    R,
    H,
    stride_xt,
    stride_xh,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[r, :] = x[src[r], :] (zeros where src[r] < 0).

    x_ptr: [T, H] with strides (stride_xt, stride_xh); src_ptr: [R] int64; out_ptr: [R, H] contiguous.
    """
    rows = row_offset(tl.program_id(0), BLOCK_R) + tl.arange(0, BLOCK_R)
    cols = row_offset(tl.program_id(1), BLOCK_H) + tl.arange(0, BLOCK_H)
    r_ok = rows < R
    c_ok = cols < H
    src = tl.load(src_ptr + rows, mask=r_ok, other=-1)
    v = tl.load(
        x_ptr + src[:, None] * stride_xt + cols[None, :] * stride_xh,
        mask=(src >= 0)[:, None] & c_ok[None, :],
        other=0.0,
    )
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], v, mask=r_ok[:, None] & c_ok[None, :])


@triton.jit
def _gather_sum_kernel(
    src_ptr,
    dest_ptr,
    w_ptr,
    out_ptr,
    T,
    H,
    top_k,
    stride_sr,
    stride_sh,
    stride_wt,
    stride_wk,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[t, :] = sum over j with dest[t, j] >= 0 of w[t, j] * src[dest[t, j], :] (w = 1 without weights).

    src_ptr: [R, H] with strides (stride_sr, stride_sh); dest_ptr: [T, k] int64 contiguous;
    w_ptr: [T, k] any float with strides (stride_wt, stride_wk); out_ptr: [T, H] contiguous.
    fp32 accumulation in slot order j = 0..k-1, one rounding to out's dtype.
    """
    rows = row_offset(tl.program_id(0), BLOCK_R) + tl.arange(0, BLOCK_R)
    cols = row_offset(tl.program_id(1), BLOCK_H) + tl.arange(0, BLOCK_H)
    r_ok = rows < T
    c_ok = cols < H
    acc = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    dest_row = dest_ptr + rows * top_k
    w_ptrs = w_ptr + rows * stride_wt
    for j in range(0, top_k):
        d = tl.load(dest_row + j, mask=r_ok, other=-1)
        v = tl.load(
            src_ptr + d[:, None] * stride_sr + cols[None, :] * stride_sh,
            mask=(d >= 0)[:, None] & c_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_WEIGHTS:  # a dropped pair's weight is not read: it adds nothing, whatever its value (inf, NaN)
            w = tl.load(w_ptrs, mask=r_ok & (d >= 0), other=0.0)
            v = v * w.to(tl.float32)[:, None]
        acc += v
        w_ptrs += stride_wk  # 64-bit pointer step: no j * stride product
    tl.store(
        out_ptr + rows[:, None] * H + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=r_ok[:, None] & c_ok[None, :],
    )


@triton.jit
def _combine_dy_kernel(
    dout_ptr,
    w_ptr,
    src_pair_ptr,
    dy_ptr,
    R,
    H,
    top_k,
    stride_dt,
    stride_dh,
    stride_wt,
    stride_wk,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """dy[r, :] = w[t, j] * dout[t, :] with (t, j) the pair of grouped row r (zeros where src_pair[r] < 0).

    dout_ptr: [T, H] with strides (stride_dt, stride_dh); w_ptr: [T, k] with strides (stride_wt, stride_wk);
    src_pair_ptr: [R] int64; dy_ptr: [R, H] contiguous.
    """
    rows = row_offset(tl.program_id(0), BLOCK_R) + tl.arange(0, BLOCK_R)
    cols = row_offset(tl.program_id(1), BLOCK_H) + tl.arange(0, BLOCK_H)
    r_ok = rows < R
    c_ok = cols < H
    pair = tl.load(src_pair_ptr + rows, mask=r_ok, other=-1)
    live = pair >= 0
    t, j = pair_coords(tl.maximum(pair, 0), top_k)
    w = tl.load(w_ptr + t * stride_wt + j * stride_wk, mask=live, other=0.0)
    g = tl.load(
        dout_ptr + t[:, None] * stride_dt + cols[None, :] * stride_dh,
        mask=live[:, None] & c_ok[None, :],
        other=0.0,
    )
    dy = g.to(tl.float32) * w.to(tl.float32)[:, None]
    tl.store(
        dy_ptr + rows[:, None] * H + cols[None, :],
        dy.to(dy_ptr.dtype.element_ty),
        mask=r_ok[:, None] & c_ok[None, :],
    )


@triton.jit
def _combine_dw_kernel(
    dout_ptr,
    y_ptr,
    dest_ptr,
    dw_ptr,
    T,
    H,
    top_k,
    stride_dt,
    stride_dh,
    stride_yr,
    stride_yh,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """dw[t, j] = sum over h of dout[t, h] * y[dest[t, j], h] (0 where dest[t, j] < 0), fp32 accumulation.

    dout_ptr: [T, H] with strides (stride_dt, stride_dh); y_ptr: [R, H] with strides (stride_yr, stride_yh);
    dest_ptr: [T, k] int64 contiguous; dw_ptr: [T, k] contiguous, weights' dtype.
    """
    rows = row_offset(tl.program_id(0), BLOCK_R) + tl.arange(0, BLOCK_R)
    r_ok = rows < T
    kk = tl.arange(0, BLOCK_K)
    h_idx = tl.arange(0, BLOCK_H).to(tl.int64)
    dest_row = dest_ptr + rows * top_k
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + h_idx
        c_ok = cols < H
        g = tl.load(
            dout_ptr + rows[:, None] * stride_dt + cols[None, :] * stride_dh,
            mask=r_ok[:, None] & c_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        for j in range(0, top_k):
            d = tl.load(dest_row + j, mask=r_ok, other=-1)
            v = tl.load(
                y_ptr + d[:, None] * stride_yr + cols[None, :] * stride_yh,
                mask=(d >= 0)[:, None] & c_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            part = tl.sum(g * v, axis=1)
            acc += tl.where(kk[None, :] == j, part[:, None], 0.0)
    tl.store(
        dw_ptr + rows[:, None] * top_k + kk[None, :],
        acc.to(dw_ptr.dtype.element_ty),
        mask=r_ok[:, None] & (kk < top_k)[None, :],
    )
