"""Index helpers shared by the kernels: int64 offsets, tile order, and an expert's rows and tiles.

Used by the GEMM engine (see ``_gemm.py``'s docstring for what lives where) and by the MoE routing and
dispatch kernels. Every result that can meet a stride is int64: ``rows * stride`` passes 2^31 long before a
tensor stops fitting in memory.

- ``row_offset``: ``rows * stride`` in int64 for int32 rows (program ids, loaded indices).
- ``pair_coords``: MoE pair index ``p = t * k + j`` -> ``(t, j)`` in int64.
- ``swizzle``: tile index -> (row tile, column tile) in GROUP_M-tall column sweeps, so GROUP_M row blocks
  of A stay hot in L2 while the programs sweep B's columns (the schedule of Triton's matmul tutorial).
- ``expert_rows``: rows ``[lo, hi)`` of one expert, clamped into ``[0, T]``.
- ``expert_row_tile``: row tile id -> (expert, first row, end row) for tiles that never straddle experts.

Worked example of ``expert_row_tile``, offsets = [0, 2, 2, 5] (E = 3, T = 5), BLOCK_M = 2::

    expert 0: rows 0-1 -> 1 tile; expert 1: no rows -> 0 tiles; expert 2: rows 2-4 -> 2 tiles
    tile 0 -> (0, 0, 2); tile 1 -> (2, 2, 5); tile 2 -> (2, 4, 5); tile 3 -> (-1, 0, 0) (no such tile)
"""

from __future__ import annotations

from smptk.kernels._triton import tl, triton


@triton.jit
def row_offset(rows, stride):
    """``rows * stride`` in int64: ``rows`` may be int32 (program ids, loaded indices) and the product pass
    2^31 (row 2^20 of a 4096-wide buffer already does)."""
    return tl.cast(rows, tl.int64) * stride  # tl.cast: also takes the interpreter's plain-int loop indices


@triton.jit
def pair_coords(p, top_k):
    """Pair index ``p = t * top_k + j`` (any int type) -> ``(t, j)`` in int64."""
    p64 = tl.cast(p, tl.int64)
    return p64 // top_k, p64 % top_k


@triton.jit
def swizzle(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Tile index -> (row tile, column tile), GROUP_M row tiles per column sweep."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % size_m
    pid_n = (tile % per_group) // size_m
    return pid_m, pid_n


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
    hi_e))`` (the end row returned is hi_e; callers mask rows >= it). offsets_ptr: [E + 1] int64, read
    EXPERT_BLOCK experts per vector load. All results are int64.
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


def row_tile_bound(T: int, E: int, block_m: int) -> int:
    """Upper bound on the row tiles of any offsets: sum_e cdiv(rows_e, block_m) <= T // block_m + min(E, T)
    (the full tiles fit in T // block_m, and at most one partial tile per non-empty expert)."""
    return T // block_m + min(E, T)
