"""The Triton kernels of moe_route: top-k selection with routing weights, the load statistics, the backward.

Legend: T tokens, E experts, k = top_k slots per token; ``s`` the fp32 logits of a token, ``score`` the
per-expert score (softmax(s) or sigmoid(s)), ``sel = score + expert_bias`` the selection key, ``q`` the
router probabilities, ``lse`` the logsumexp of ``s``. Each kernel's docstring gives its pointers' shapes
and strides.

What they compute (tie rule, both losses, the gradients), the worked example and the launchers with their
block sizes are in ``moe_route.py``. The kernels are a module of their own so that importing
``smptk.kernels`` does not import triton: ``moe_route.py`` imports this module on its first Triton-path
call (see ``_triton.py``).
"""

from __future__ import annotations

from smptk.kernels._index import row_offset
from smptk.kernels._triton import tl, triton


@triton.jit
def _load_logits(logits_ptr, rows, e_idx, T, E, stride_lt, stride_le):
    """fp32 logits ``[BLOCK_T, BLOCK_E]``: padded experts -inf (they vanish from softmax, sigmoid and max),
    padded tokens 0 (finite, masked out later)."""
    row_ok = rows < T
    e_ok = e_idx < E
    s = tl.load(
        logits_ptr + rows[:, None] * stride_lt + row_offset(e_idx, stride_le)[None, :],
        mask=row_ok[:, None] & e_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    return tl.where(e_ok[None, :], s, -float("inf"))


@triton.jit
def _scores(s, SCORE_FUNC: tl.constexpr):
    """From fp32 logits ``s [BLOCK_T, BLOCK_E]``: (score, router probability q, softmax p, logsumexp)."""
    m = tl.max(s, axis=1)
    ex = tl.exp(s - m[:, None])
    den = tl.sum(ex, axis=1)
    p = ex / den[:, None]
    # torch.logsumexp's value where the max is infinite (an inf logit: inf; a row of -inf: -inf), not the
    # NaN of inf - inf above
    lse = tl.where(tl.abs(m) == float("inf"), m, m + tl.log(den))
    if SCORE_FUNC == 0:
        score = p
        q = p
    else:
        score = 1.0 / (1.0 + tl.exp(-s))  # -inf (padding) -> 0
        q = score / (tl.sum(score, axis=1) + 1e-20)[:, None]  # + moe_route.RENORM_EPS
    return score, q, p, lse


@triton.jit
def _route_fwd_kernel(
    logits_ptr,
    bias_ptr,
    w_ptr,
    ids_ptr,
    cnt_part_ptr,
    q_part_ptr,
    z_part_ptr,
    T,
    E,
    top_k,
    stride_lt,
    stride_le,
    SCORE_FUNC: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS_PER_PROG: tl.constexpr,
):
    """Top-k routing of tokens [pid * ROWS_PER_PROG, +ROWS_PER_PROG) plus this program's statistics.

    logits_ptr: [T, E] any float with strides (stride_lt, stride_le). bias_ptr: [E] float (read if HAS_BIAS).
    w_ptr: [T, k] fp32 and ids_ptr: [T, k] int32, contiguous.
    cnt_part_ptr: [num_progs, E] int32 (picks per expert); q_part_ptr: [num_progs, E] fp32 (sum of q);
    z_part_ptr: [num_progs] fp32 (sum of lse^2); row pid of each written in full.
    """
    pid = tl.program_id(0)
    e_idx = tl.arange(0, BLOCK_E)
    e_ok = e_idx < E
    kk = tl.arange(0, BLOCK_K)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e_idx, mask=e_ok, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_E,), dtype=tl.float32)
    cnt = tl.zeros((BLOCK_E,), dtype=tl.int32)
    qsum = tl.zeros((BLOCK_E,), dtype=tl.float32)
    zsum = tl.zeros((BLOCK_T,), dtype=tl.float32)
    row0 = row_offset(pid, ROWS_PER_PROG)
    for r in range(0, ROWS_PER_PROG, BLOCK_T):
        rows = row0 + r + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        s = _load_logits(logits_ptr, rows, e_idx, T, E, stride_lt, stride_le)
        score, q, _, lse = _scores(s, SCORE_FUNC)
        sel = score + bias[None, :]
        avail = row_ok[:, None] & e_ok[None, :]
        w_tile = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
        id_tile = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
        for j in range(0, top_k):
            cand = tl.where(avail, sel, -float("inf"))
            best = tl.max(cand, axis=1)
            # Lowest available id holding the maximum; if none compares equal (NaN), the lowest available id.
            idx = tl.min(tl.where(avail & (cand == best[:, None]), e_idx[None, :], BLOCK_E), axis=1)
            first = tl.min(tl.where(avail, e_idx[None, :], BLOCK_E), axis=1)
            idx = tl.where(idx < BLOCK_E, idx, first)
            pick = e_idx[None, :] == idx[:, None]
            w = tl.sum(tl.where(pick, score, 0.0), axis=1)
            avail = avail & ~pick
            w_tile = tl.where(kk[None, :] == j, w[:, None], w_tile)
            id_tile = tl.where(kk[None, :] == j, idx[:, None], id_tile)
        if RENORMALIZE:
            # + moe_route.RENORM_EPS; padded tokens divide by 1 (no 0 / 0)
            wsum = tl.where(row_ok, tl.sum(w_tile, axis=1) + 1e-20, 1.0)
            w_tile = w_tile / wsum[:, None]
        out_offs = rows[:, None] * top_k + kk[None, :]
        out_mask = row_ok[:, None] & (kk < top_k)[None, :]
        tl.store(w_ptr + out_offs, w_tile, mask=out_mask)
        tl.store(ids_ptr + out_offs, id_tile, mask=out_mask)
        picked = row_ok[:, None] & e_ok[None, :] & ~avail
        cnt += tl.sum(picked.to(tl.int32), axis=0)
        qsum += tl.sum(tl.where(row_ok[:, None] & e_ok[None, :], q, 0.0), axis=0)
        zsum += tl.where(row_ok, lse * lse, 0.0)
    part = row_offset(pid, E) + e_idx
    tl.store(cnt_part_ptr + part, cnt, mask=e_ok)
    tl.store(q_part_ptr + part, qsum, mask=e_ok)
    tl.store(z_part_ptr + pid, tl.sum(zsum, axis=0))


@triton.jit
def _route_stats_kernel(
    cnt_part_ptr,
    q_part_ptr,
    z_part_ptr,
    counts_ptr,
    aux_ptr,
    z_ptr,
    num_progs,
    T,
    E,
    top_k,
    BLOCK_B: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """One program: sums the partial rows over programs, in program order.

    cnt_part_ptr, q_part_ptr: [num_progs, E] (int32, fp32); z_part_ptr: [num_progs] fp32.
    counts_ptr: [E] int64 (tokens_per_expert); aux_ptr, z_ptr: 0-d fp32 each (0 when T == 0).
    """
    e_idx = tl.arange(0, BLOCK_E)
    e_ok = e_idx < E
    cnt = tl.zeros((BLOCK_E,), dtype=tl.int64)
    qsum = tl.zeros((BLOCK_E,), dtype=tl.float32)
    zsum = tl.zeros((BLOCK_B,), dtype=tl.float32)
    for b0 in range(0, num_progs, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        b_ok = b < num_progs
        mask = b_ok[:, None] & e_ok[None, :]
        offs = row_offset(b, E)[:, None] + e_idx[None, :]
        cnt += tl.sum(tl.load(cnt_part_ptr + offs, mask=mask, other=0).to(tl.int64), axis=0)
        qsum += tl.sum(tl.load(q_part_ptr + offs, mask=mask, other=0.0), axis=0)
        zsum += tl.load(z_part_ptr + b, mask=b_ok, other=0.0)
    tl.store(counts_ptr + e_idx, cnt, mask=e_ok)
    t_f = tl.maximum(T * 1.0, 1.0)  # T = 0: every sum is 0, so both losses are 0
    f = cnt.to(tl.float32) / (t_f * top_k)
    aux = E * tl.sum(f * (qsum / t_f), axis=0)
    tl.store(aux_ptr, aux)
    tl.store(z_ptr, tl.sum(zsum, axis=0) / t_f)


@triton.jit
def _route_bwd_kernel(
    logits_ptr,
    ids_ptr,
    dw_ptr,
    counts_ptr,
    daux_ptr,
    dz_ptr,
    dlogits_ptr,
    T,
    E,
    top_k,
    stride_lt,
    stride_le,
    stride_dwt,
    stride_dwk,
    SCORE_FUNC: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """dlogits for tokens [pid * BLOCK_T, +BLOCK_T) from the gradients of weights, aux_loss and z_loss.

    logits_ptr: [T, E] with strides (stride_lt, stride_le); ids_ptr: [T, k] int32 contiguous;
    dw_ptr: [T, k] fp32 with strides (stride_dwt, stride_dwk); counts_ptr: [E] int64;
    daux_ptr, dz_ptr: one fp32 element each; dlogits_ptr: [T, E] contiguous, logits' dtype.
    """
    rows = row_offset(tl.program_id(0), BLOCK_T) + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    e_idx = tl.arange(0, BLOCK_E)
    e_ok = e_idx < E
    s = _load_logits(logits_ptr, rows, e_idx, T, E, stride_lt, stride_le)
    score, q, p, lse = _scores(s, SCORE_FUNC)
    # Weights -> scores: G[t, e] = g[t, j] where e = ids[t, j].
    G = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    picked = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
    ids_row = ids_ptr + rows * top_k
    dw_ptrs = dw_ptr + rows * stride_dwt
    for j in range(0, top_k):
        idj = tl.load(ids_row + j, mask=row_ok, other=-1)
        gj = tl.load(dw_ptrs, mask=row_ok, other=0.0)
        dw_ptrs += stride_dwk  # 64-bit pointer step: no j * stride product
        pick = e_idx[None, :] == idj[:, None]
        G = tl.where(pick, gj.to(tl.float32)[:, None], G)
        picked = picked | pick
    if RENORMALIZE:
        Z = tl.where(row_ok, tl.sum(tl.where(picked, score, 0.0), axis=1) + 1e-20, 1.0)  # as the forward
        gw = tl.sum(G * score, axis=1) / Z  # sum_j g_j w_j
        gsc = tl.where(picked, (G - gw[:, None]) / Z[:, None], 0.0)
    else:
        gsc = G
    # aux_loss -> q: d aux / d q[t, e] = E * f_e / T = E * counts_e / (T^2 k), fp32 (T^2 passes int32).
    t_f = tl.maximum(T * 1.0, 1.0)
    counts = tl.load(counts_ptr + e_idx, mask=e_ok, other=0).to(tl.float32)
    # A loss the caller did not use (its gradient 0) adds nothing: not 0 * NaN where a row's logits make
    # q, p or lse NaN or infinite (an inf or NaN logit), which autograd of the same math never computes.
    daux = tl.load(daux_ptr)
    a = daux * E * counts / (t_f * t_f * top_k)
    if SCORE_FUNC == 0:
        gq = gsc + a[None, :]
        ds = p * (gq - tl.sum(p * gq, axis=1)[:, None])
    else:
        if daux != 0:
            ssum = tl.sum(score, axis=1) + 1e-20  # as the forward's q
            gsc += (a[None, :] - tl.sum(a[None, :] * q, axis=1)[:, None]) / ssum[:, None]
        ds = gsc * score / (1.0 + tl.exp(s))  # sigmoid' = sigmoid(s) * sigmoid(-s): no 1 - score cancellation
    dz = tl.load(dz_ptr)
    if dz != 0:
        ds += (2.0 * dz / t_f) * lse[:, None] * p
    tl.store(
        dlogits_ptr + rows[:, None] * E + e_idx[None, :],
        ds.to(dlogits_ptr.dtype.element_ty),
        mask=row_ok[:, None] & e_ok[None, :],
    )
