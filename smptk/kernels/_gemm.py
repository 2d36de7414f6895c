"""The GEMM engine: one Triton kernel for every matrix product of the linear and MoE ops, two load paths.

What lives where (the private engine; op modules call it and never each other):

- ``_gemm.py`` (this file): the kernel ``_gemm_kernel``, its tile schedule, configs, path choice and the
  host entry points ``matmul`` / ``swiglu_matmul`` (dense), ``grouped_matmul`` / ``grouped_swiglu_matmul``
  / ``grouped_weight_grad`` (MoE), and ``specializations()`` (every compile variant the launchers can
  produce, which the instruction-level CI check compiles).
- ``_epilogue.py``: activations and their derivatives, and the elementwise backward kernels.
- ``_index.py``: int64 index helpers (tile order, an expert's rows and tiles from MoE offsets).

The product. ``out[e][rows, cols] = epi(sum_r A[rows, r] * B[e][r, cols])`` with A ``[M, R]`` and B
``[E, R, C]`` as strided views (layouts are strides, never copies). Three ways a tile finds its rows:

- ``GROUPING=0`` dense: tile -> (row block, column block) of ``[M, C]``; E = 1.
- ``GROUPING=1`` rows by expert (MoE forward and dx): A's rows are grouped by expert (``offsets[E+1]``);
  a tile never straddles two experts and multiplies by its expert's B (see ``_index.expert_row_tile``).
- ``GROUPING=2`` reduction by expert (MoE weight grad): ``out[e] = A_e @ B_e`` where expert e's rows of
  dz / x are the reduction range; ``ROWSUM`` also stores the row sums of A (the bias gradient).
- ``GROUPING=3`` / ``4`` rows by rank block, for the GEMMs fused with a collective
  (:mod:`smptk.kernels._gemm_comm`): 3 waits for each block's rows to arrive (all-gather GEMM); 4 stores
  each tile into the data region of the rank that owns its rows and signals it (GEMM + reduce-scatter).

Epilogue, in fp32 before the only store: ``+ bias``, the pre-activation ``z`` stored when the backward
needs it, then the activation. ``DUAL=1`` adds a second operand pair into the same accumulator (SwiGLU's
``dx = dg @ wg + du @ wu``, one rounding); ``DUAL=2`` keeps two accumulators that share A's tile (SwiGLU
forward: ``silu(x @ wg) * (x @ wu)`` reading x once) and can store both pre-activations.

Schedule: persistent. ``min(tiles, SMs)`` programs loop over the tiles in grouped order (GROUP_M row
blocks per column sweep, so A's rows stay in L2), which also lets Triton prefetch the next tile's first
K step during the epilogue (``flatten``).

Two load paths, one kernel (``TMA`` constexpr):

- **TMA** (Hopper, sm_90+, and under the interpreter when forced): A/B tiles come through tensor
  descriptors (``tl.make_tensor_descriptor`` -> ``cp.async.bulk.tensor`` + mbarrier) and C tiles leave the
  same way, sub-tiled in halves along N (``EPI_SUB=2``) so the epilogue holds half the accumulator's
  values at a time. Grouped tiles build per-expert descriptors on the device (bounded at the expert's
  last row, so a store never crosses into the next expert). Needs 16-bit operands, a unit stride in one
  dim of each operand, 16-byte aligned bases and strides, and dims below 2^31.
- **Pointer** (sm_80, fp32, odd strides): masked ``tl.load`` tiles with int64 offsets and K steps.

``SMPTK_GEMM_PATH=auto|tma|pointer`` picks: ``auto`` = TMA on sm_90+ CUDA devices where the operands
allow it; ``tma`` = TMA wherever the operands allow it, the interpreter included (how the CPU tests run
it); ``pointer`` = never TMA. ``last_path()`` says what the latest launch took.

Measured on H100 (bf16, 16384 x 4096 -> 14336, bench/results/nvidia-h100-80gb-hbm3/
2026-11-23-probe-gemm-tma.json, do_bench medians; cuBLAS 712 TFLOP/s in the same run): persistent TMA
128x256x64, 4 stages, epilogue in halves: 717 TFLOP/s plain and 638 with bias + GELU; 128x128x64 /
4 stages: 671 and 606; 256x128x64 / 3 stages: 690 and 622. Warp specialization (``tl.range(...,
warp_specialize=True)``) compiled to the same code as without it on sm_90 with Triton 3.9 and measured
the same on Triton 3.6 (625 vs 623 TFLOP/s), so it is not used.

Legend: M output rows, C output columns, R reduction, E experts; ``*_MR`` is a tensor of shape [M, R].
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from smptk import settings
from smptk._precision import tf32_matmul
from smptk.kernels import runtime
from smptk.kernels._epilogue import ACT_NONE, ACTIVATION_CODES, activation_fwd
from smptk.kernels._index import expert_row_tile, expert_rows, row_tile_bound, swizzle
from smptk.kernels._triton import HAVE_TRITON, ensure_allocator, tl, triton
from smptk.kernels.collectives import _BLOCKS_WORD, _expired, _i64, _region

GROUP_NONE, GROUP_ROWS, GROUP_REDUCTION, GROUP_RANKS, GROUP_RANKS_SCATTER = 0, 1, 2, 3, 4
DUAL_NONE, DUAL_SUM, DUAL_SWIGLU = 0, 1, 2
_INT32_LIMIT = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Config:
    """One tile shape: BLOCK_M x BLOCK_N output tile, BLOCK_K reduction step, pipeline depth, warps."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int
    epi_sub: int = 1  # epilogue sub-tiles along N (TMA path)
    group_m: int = 8

    def meta(self) -> dict[str, int]:
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "GROUP_M": self.group_m,
            "EPI_SUB": self.epi_sub,
        }


# TMA path (sm_90, 16-bit). From the H100 probe above; every entry compiles without spills for every
# epilogue (checked in CI by tests/test_kernels_compile.py) but where ``_tma_configs`` drops it on Triton
# 3.6. 128x256 needs the halved epilogue to fit 4 stages in shared memory. Two accumulators (DUAL_SWIGLU)
# double the register tile, so SwiGLU uses the 128-wide tiles. The small tiles serve skinny problems (few
# rows per expert, small N).
_TMA_CONFIGS = (
    Config(128, 256, 64, 4, 8, epi_sub=2),
    Config(256, 128, 64, 3, 8, epi_sub=2),
    Config(128, 128, 64, 4, 8, epi_sub=2),
    Config(128, 64, 64, 4, 4),
    Config(64, 128, 64, 4, 4),
)
_TMA_SWIGLU_CONFIGS = (
    Config(128, 128, 64, 3, 8, epi_sub=2),
    Config(128, 64, 64, 4, 8),
    Config(64, 128, 64, 4, 4),
)
# Pointer path (sm_80; fp32; operands TMA cannot take): Triton's matmul-tutorial tiles, cut to what ptxas fits
# in registers under every op kind's heaviest epilogue on sm_80 and sm_90 (Triton 3.9; CI:
# tests/test_kernels_compile.py, every config with SMPTK_COMPILE_ALL=1): at most 64 fp32 accumulators a
# thread (SwiGLU's two count twice), the 128x128 tiles' epilogue in halves (EPI_SUB=2). Out for spilling
# (with vectorized loads): 128x256x64 / 8 warps (up to 2.2 KB, 1.1 KB with EPI_SUB=2), 128x128x32 / 4 warps
# (up to 2.1 KB), SwiGLU's 128x128x64 / 8 warps (up to 0.7 KB, 0.4 KB with EPI_SUB=2). Tails are masked, not
# clamped, so loads along either unit-stride dim vectorize (clamped, the 16-bit dx / dw products loaded
# 2-byte scalars and spilled up to 10.8 KB). Untuned for speed on our suite.
_PTR_CONFIGS = (
    Config(128, 128, 64, 4, 8, epi_sub=2),
    Config(128, 128, 32, 4, 8, epi_sub=2),
    Config(128, 64, 64, 4, 8),
    Config(64, 128, 64, 4, 8),
    Config(64, 64, 64, 3, 4),
    Config(32, 64, 64, 5, 2),
)
_PTR_SWIGLU_CONFIGS = (
    Config(128, 64, 64, 4, 8),
    Config(64, 128, 64, 4, 8),
    Config(64, 64, 64, 4, 4),
)
# fp32 with TF32 (tensor-core MMA): K steps of 32, a stage's bytes those of 16-bit at 64; 16 for 128x128 (at
# 32: up to 172 B of spills). The smallest tile takes 4 warps (at 2 some op kinds spilled 4-12 B) and 2
# stages: at 4, Triton 3.6 spilled 4 B in SwiGLU's dx on sm_80; at 3, 4-8 B in other SwiGLU dx kinds on
# 3.6 and 3.9; at 2, no op kind of the full table spills on either (sm_80 and sm_90).
_PTR_TF32_CONFIGS = (
    Config(128, 128, 16, 4, 8, epi_sub=2),
    Config(128, 64, 32, 4, 8),
    Config(64, 128, 32, 4, 8),
    Config(64, 64, 32, 4, 4),
    Config(32, 32, 32, 2, 4),
)
_PTR_TF32_SWIGLU_CONFIGS = (
    Config(128, 64, 32, 4, 8),
    Config(64, 64, 32, 4, 4),
)
# IEEE fp32 (TF32 off: an FMA loop): K steps of 16, the least tl.dot takes on Triton 3.6 (K=8 compiled on
# 3.9 but raised "K >= 16" on the H100's 3.6). Each thread holds its rows and columns of both operands for a
# whole K step, so the tiles are small: at K=32 every tile spilled for some op kind (up to 4.8 KB); 32x64x16
# compiles without spills for every op kind on sm_80 and sm_90 but SwiGLU's two accumulators (8-16 B), which
# take 32x32x16. Larger K=16 tiles are not shipped until they are compile-checked and launched on a GPU.
_PTR_IEEE_CONFIGS = (Config(32, 64, 16, 3, 4),)
_PTR_IEEE_SWIGLU_CONFIGS = (Config(32, 32, 16, 3, 4),)
# Interpreter: 32-wide tiles are the smallest that keep tl.dot's minimum (16) with room for masked tails
# at the tests' odd sizes; the epilogue runs in halves so that path is tested too.
_INTERPRETER_CONFIG = Config(32, 32, 32, 1, 4, epi_sub=2, group_m=4)
_INTERPRETER_PROGRAMS = 3  # fewer programs than tiles: every persistent loop runs several tiles
_EXPERT_BLOCK = 128  # experts per vector load of the offsets in the tile scan: E <= 128 is one load
_EXPERT_BLOCK_INTERPRETER = 4  # so the tests' E = 7 takes the multi-chunk path


@triton.jit
def _desc_a(ptr, M, R, s_am, s_ar, A_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Descriptor over A [M, R]; stored as [R, M] (unit stride on M) when A_T."""
    if A_T:
        d = tl.make_tensor_descriptor(ptr, shape=[R, M], strides=[s_ar, 1], block_shape=[BLOCK_K, BLOCK_M])
    else:
        d = tl.make_tensor_descriptor(ptr, shape=[M, R], strides=[s_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    return d


@triton.jit
def _desc_b(ptr, R, C, s_br, s_bc, B_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Descriptor over B [R, C]; stored as [C, R] (unit stride on R, an nn.Linear weight) when B_T."""
    if B_T:
        d = tl.make_tensor_descriptor(ptr, shape=[C, R], strides=[s_bc, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        d = tl.make_tensor_descriptor(ptr, shape=[R, C], strides=[s_br, 1], block_shape=[BLOCK_K, BLOCK_N])
    return d


@triton.jit
def _load_a(desc, m, r, A_T: tl.constexpr):
    if A_T:
        t = desc.load([r, m]).T
    else:
        t = desc.load([m, r])
    return t


@triton.jit
def _load_b(desc, r, n, B_T: tl.constexpr):
    if B_T:
        t = desc.load([n, r]).T
    else:
        t = desc.load([r, n])
    return t


@triton.jit
def _halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] -> its left and right [BLOCK_M, BLOCK_N // 2] halves."""
    acc = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
    return tl.split(acc)


@triton.jit
def _epilogue(
    acc, acc2, row0, col0, row_end, C, expert,
    c_ptr, c_desc, z_ptr, z_desc, z2_ptr, z2_desc, bias_ptr,
    s_cm, s_cc, s_zm, s_zc, s_biase,
    DUAL: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_Z: tl.constexpr,
    TMA: tl.constexpr, BLOCK_M: tl.constexpr, SUB_N: tl.constexpr,
):  # fmt: skip
    """Bias, pre-activation store, activation (or silu(g) * u) and the store of one [BLOCK_M, SUB_N] tile.

    row0 / col0: the tile's first row and column (int64); rows >= row_end and columns >= C are not stored
    (the pointer path masks them, the TMA path's descriptors end there).
    """
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, SUB_N)
    mask = (rows[:, None] < row_end) & (cols[None, :] < C)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * s_biase + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    if STORE_Z:
        if TMA:
            z_desc.store([row0.to(tl.int32), col0.to(tl.int32)], acc.to(z_ptr.dtype.element_ty))
            if DUAL == 2:
                z2_desc.store([row0.to(tl.int32), col0.to(tl.int32)], acc2.to(z_ptr.dtype.element_ty))
        else:
            z_ptrs = rows[:, None] * s_zm + cols[None, :] * s_zc
            tl.store(z_ptr + z_ptrs, acc.to(z_ptr.dtype.element_ty), mask=mask)
            if DUAL == 2:
                tl.store(z2_ptr + z_ptrs, acc2.to(z_ptr.dtype.element_ty), mask=mask)
    if DUAL == 2:
        out = acc * tl.sigmoid(acc) * acc2
    else:
        out = activation_fwd(acc, ACTIVATION)
    if TMA:
        c_desc.store([row0.to(tl.int32), col0.to(tl.int32)], out.to(c_ptr.dtype.element_ty))
    else:
        c_ptrs = c_ptr + rows[:, None] * s_cm + cols[None, :] * s_cc
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _wait_ready(flag_ptr, target, abort_ptr, start_ns, timeout_ns, USE_CLOCK: tl.constexpr):
    """Spin until the int32 ``*flag_ptr`` reaches ``target`` (acquire: the writes released before each
    increment are visible after it), or the wait budget is spent (then return: the copy stage that owns
    the flag has recorded the missing peer in the heap's status words, which the host raises on)."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    expired = seen * 0
    while (seen < target) & (expired == 0):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
        expired = _expired(start_ns, timeout_ns, abort_ptr, USE_CLOCK)


@triton.jit
def _tile_stored(ready_ptr, signal_W, q, rank, tiles_per_block, call_tag):
    """GROUPING=4, after a tile of block q is in rank q's data region: count it in ``ready_ptr[2 + q]``; the
    program that stores the block's last tile raises rank q's arrival word for this rank to the call tag.

    The count is an acq_rel add at system scope, so the last program has seen every other program's release
    (their tiles' stores) before its own release of the arrival word publishes the whole block to rank q.
    """
    tl.debug_barrier()  # every thread's stores of this tile precede the count
    done = tl.atomic_add(ready_ptr + 2 + q, 1, sem="acq_rel", scope="sys") + 1
    if done == tiles_per_block:
        arrival = tl.load(signal_W + q).to(tl.pointer_type(tl.int64)) + _BLOCKS_WORD + rank
        tl.atomic_xchg(arrival, call_tag, sem="release", scope="sys")


@triton.jit
def _gemm_tiles(
    a_ptr, b_ptr, a2_ptr, b2_ptr, c_ptr, z_ptr, z2_ptr, bias_ptr, rowsum_ptr, offsets_ptr,
    M, C, R, E, M_BUCKET,
    s_am, s_ar, s_be, s_br, s_bc,
    s_a2m, s_a2r, s_b2e, s_b2r, s_b2c,
    s_ce, s_cm, s_cc, s_zm, s_zc, s_biase, s_rse,
    GROUPING: tl.constexpr, DUAL: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
    STORE_Z: tl.constexpr, ROWSUM: tl.constexpr, TMA: tl.constexpr,
    A_T: tl.constexpr, B_T: tl.constexpr, A2_T: tl.constexpr, B2_T: tl.constexpr,
    PRECISION: tl.constexpr, EXPERT_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SUB: tl.constexpr,
    first_tile, tile_step, ready_ptr, rank, world, ready_target, abort_ptr, start_ns, timeout_ns,
    data_W, signal_W, call_tag,
    USE_CLOCK: tl.constexpr,
):  # fmt: skip
    """The persistent tile loop of :func:`_gemm_kernel` (tiles first_tile, first_tile + tile_step, ...), with
    every argument of the kernel; :func:`smptk.kernels._gemm_comm._all_gather_gemm_kernel` runs it on the
    programs its copy stage leaves.

    GROUPING=3 (rows by rank block, the all-gather GEMM): A is the gathered ``[M, R]`` input, ``world``
    blocks of ``M // world`` rows in rank order. Row tiles never straddle two blocks, and they go in
    rank-rotated order: this rank's block first, then rank + 1, ... Before its loads, a tile of block q
    waits until ``ready_ptr[q]`` (int32) reaches ``ready_target`` (acquire; bounded by the budget of
    ``smptk.kernels.collectives._expired``).

    GROUPING=4 (rows by rank block, the GEMM + reduce-scatter): A is this rank's ``[M, R]`` input, whose
    block q of ``M // world`` rows rank q owns. Row tiles go in rank-rotated order with this rank's block
    last (rank + 1 first: the peers' partials travel while the GEMM goes on). A tile's epilogue waits
    until ``ready_ptr[0]`` reaches ``ready_target`` (the launch's entry barrier is done: the peers have
    finished their previous call, so their data regions are free), then, unless ``ready_ptr[1]`` says the
    barrier failed, stores the tile into slot ``rank`` of rank q's data region (``[world, M // world, C]``,
    reached through the heap's ``data_W`` table; C's pointer only gives the dtype) and counts it
    (:func:`_tile_stored`: the block's last tile raises rank q's arrival word, through ``signal_W``, to
    ``call_tag``). The store takes the pointer path on both load paths: its completion must precede the
    release that publishes it, which plain stores guarantee and TMA's asynchronous bulk stores do not.

    The other groupings ignore ready_ptr ... call_tag.
    """
    num_n = tl.cdiv(C, BLOCK_N)
    if GROUPING == 1:
        num_m = M // BLOCK_M + tl.minimum(E, M)
    elif GROUPING >= 3:
        block_rows = M // world
        per_block = tl.cdiv(block_rows, BLOCK_M)
        num_m = world * per_block
    else:
        num_m = tl.cdiv(M, BLOCK_M)
    num_tiles = num_m * num_n
    if GROUPING == 2:
        num_tiles = num_tiles * E
    SUB_N: tl.constexpr = BLOCK_N // EPI_SUB
    EPI_TMA: tl.constexpr = TMA and (GROUPING != 4)  # see the docstring: GROUPING=4 stores with pointers
    if TMA:
        # Built once where every tile shares them: A but for GROUPING=2 (its reduction range is the tile's
        # expert's rows), B where no expert picks it (GROUPING 0, 3, 4), C for GROUPING=0 (1 and 3 end it at
        # the tile's expert or block). The others are built per tile (below).
        if GROUPING != 2:
            a_desc = _desc_a(a_ptr, M, R, s_am, s_ar, A_T, BLOCK_M, BLOCK_K)
        if (GROUPING == 0) or (GROUPING >= 3):
            b_desc = _desc_b(b_ptr, R, C, s_br, s_bc, B_T, BLOCK_K, BLOCK_N)
        if GROUPING == 0:
            c_desc = tl.make_tensor_descriptor(c_ptr, [M, C], [s_cm, 1], [BLOCK_M, SUB_N])
        if (GROUPING <= 1) and (DUAL == 1):
            a2_desc = _desc_a(a2_ptr, M, R, s_a2m, s_a2r, A2_T, BLOCK_M, BLOCK_K)
        if (GROUPING == 0) and (DUAL != 0):
            b2_desc = _desc_b(b2_ptr, R, C, s_b2r, s_b2c, B2_T, BLOCK_K, BLOCK_N)
    # Flattened (the next tile's loads issue during this tile's epilogue) for the dense GEMMs but SwiGLU's
    # forward: H100, triton 3.6, 16384x4096->14336 bf16 (do_bench medians, one run): GELU fwd 3.15 -> 2.94 ms
    # flattened; SwiGLU fwd 5.47 ms nested, 6.89 ms flattened (two accumulators in flight).
    flat: tl.constexpr = (GROUPING == 0) and (DUAL != 2)
    for tile in tl.range(first_tile, num_tiles, tile_step, flatten=flat):
        # -- which rows, columns, expert and reduction range this tile covers --
        if GROUPING == 2:
            per_expert = num_m * num_n
            expert = (tile // per_expert).to(tl.int64)
            pid_m, pid_n = swizzle(tile % per_expert, num_m, num_n, GROUP_M)
            row0 = pid_m.to(tl.int64) * BLOCK_M
            row_end = M + row0 * 0
            r_lo, r_hi = expert_rows(offsets_ptr, R, expert)
        else:
            pid_m, pid_n = swizzle(tile, num_m, num_n, GROUP_M)
            if GROUPING >= 3:
                # rank-rotated: GROUPING=3 this rank's rows first, 4 this rank's rows last
                q = (rank + (GROUPING - 3) + pid_m // per_block) % world
                expert = pid_m.to(tl.int64) * 0
                row_end = (q.to(tl.int64) + 1) * block_rows
                row0 = row_end - block_rows + (pid_m % per_block).to(tl.int64) * BLOCK_M
                if GROUPING == 3:
                    _wait_ready(ready_ptr + q, ready_target, abort_ptr, start_ns, timeout_ns, USE_CLOCK)
            elif GROUPING == 1:
                expert, row0, row_end = expert_row_tile(offsets_ptr, E, M, pid_m, BLOCK_M, EXPERT_BLOCK)
            else:
                expert = pid_m.to(tl.int64) * 0
                row0 = pid_m.to(tl.int64) * BLOCK_M
                row_end = M + row0 * 0
            r_lo = row0 * 0  # the whole reduction (GROUPING=2's is the tile's expert's rows)
            r_hi = R + row0 * 0
        col0 = pid_n.to(tl.int64) * BLOCK_N
        # GROUPING=1 launches an upper bound of row tiles; the extra ones have no rows. Elsewhere every tile
        # has rows, and the test stays a compile-time True: a runtime branch around the tile body keeps
        # Triton from flattening the persistent loop (next tile's loads overlapping this tile's epilogue).
        has_rows = True
        if GROUPING == 1:
            has_rows = row0 < row_end
        if has_rows:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            rsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
            if TMA:
                # -- per-tile descriptors where the expert picks the base or the bounds --
                if GROUPING == 1:
                    b_desc = _desc_b(b_ptr + expert * s_be, R, C, s_br, s_bc, B_T, BLOCK_K, BLOCK_N)
                    if DUAL != 0:
                        b2_desc = _desc_b(b2_ptr + expert * s_b2e, R, C, s_b2r, s_b2c, B2_T, BLOCK_K, BLOCK_N)
                if (GROUPING == 1) or (GROUPING == 3):  # C ends at the last row of the tile's expert / block
                    c_desc = tl.make_tensor_descriptor(
                        c_ptr, [row_end.to(tl.int32), C], [s_cm, 1], [BLOCK_M, SUB_N]
                    )
                if GROUPING == 2:
                    n_red = (r_hi - r_lo).to(tl.int32)
                    a_desc = _desc_a(a_ptr + r_lo * s_ar, M, n_red, s_am, s_ar, A_T, BLOCK_M, BLOCK_K)
                    b_desc = _desc_b(b_ptr + r_lo * s_br, n_red, C, s_br, s_bc, B_T, BLOCK_K, BLOCK_N)
                    c_desc = tl.make_tensor_descriptor(
                        c_ptr + expert * s_ce, [M, C], [s_cm, 1], [BLOCK_M, SUB_N]
                    )
                m_i = row0.to(tl.int32)
                n_i = col0.to(tl.int32)
                n_steps = tl.cdiv((r_hi - r_lo).to(tl.int32), BLOCK_K)
                for k in range(0, n_steps):
                    r_i = k * BLOCK_K
                    if GROUPING != 2:
                        r_i = r_i + r_lo.to(tl.int32)
                    a = _load_a(a_desc, m_i, r_i, A_T)
                    acc = tl.dot(a, _load_b(b_desc, r_i, n_i, B_T), acc, input_precision=PRECISION)
                    if DUAL == 2:
                        acc2 = tl.dot(a, _load_b(b2_desc, r_i, n_i, B2_T), acc2, input_precision=PRECISION)
                    if ROWSUM:
                        rsum += tl.sum(a.to(tl.float32), axis=1)
                if DUAL == 1:
                    for k in range(0, n_steps):
                        r_i = k * BLOCK_K + r_lo.to(tl.int32)
                        a2 = _load_a(a2_desc, m_i, r_i, A2_T)
                        acc = tl.dot(a2, _load_b(b2_desc, r_i, n_i, B2_T), acc, input_precision=PRECISION)
            else:
                # Tail rows and columns are masked, not clamped: with the row and column counts multiples
                # of 16 (the launcher's specialization), a mask along the unit-stride dim is constant over
                # 16 elements, so the loads stay 128-bit; a clamped index (tl.minimum(col0 + arange, C - 1))
                # has no provable contiguity and made the 16-bit dx / dw loads scalar (and spill: linear_dx
                # 32x64x64 on sm_80, 10.8 KB of spill stores). Masked rows also never read another expert's.
                rows = row0 + tl.arange(0, BLOCK_M)
                cols = col0 + tl.arange(0, BLOCK_N)
                row_ok = rows < row_end
                col_ok = cols < C
                offs = tl.arange(0, BLOCK_K).to(tl.int64)
                a_ptrs = a_ptr + rows[:, None] * s_am + (r_lo + offs)[None, :] * s_ar
                b_ptrs = b_ptr + expert * s_be + (r_lo + offs)[:, None] * s_br + cols[None, :] * s_bc
                b2_ptrs = b2_ptr + expert * s_b2e + (r_lo + offs)[:, None] * s_b2r + cols[None, :] * s_b2c
                a_step = s_ar * BLOCK_K  # int64 steps: with a column-major A, BLOCK_K * s_ar passes 2^31
                b_step = s_br * BLOCK_K
                b2_step = s_b2r * BLOCK_K
                for r in range(r_lo, r_hi, BLOCK_K):
                    left = r_hi - r
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs[None, :] < left), other=0.0)
                    b = tl.load(b_ptrs, mask=(offs[:, None] < left) & col_ok[None, :], other=0.0)
                    acc = tl.dot(a, b, acc, input_precision=PRECISION)
                    if DUAL == 2:
                        b2 = tl.load(b2_ptrs, mask=(offs[:, None] < left) & col_ok[None, :], other=0.0)
                        acc2 = tl.dot(a, b2, acc2, input_precision=PRECISION)
                        b2_ptrs += b2_step
                    if ROWSUM:
                        rsum += tl.sum(a.to(tl.float32), axis=1)
                    a_ptrs += a_step
                    b_ptrs += b_step
                if DUAL == 1:
                    a2_ptrs = a2_ptr + rows[:, None] * s_a2m + (r_lo + offs)[None, :] * s_a2r
                    a2_step = s_a2r * BLOCK_K
                    for r in range(r_lo, r_hi, BLOCK_K):
                        left = r_hi - r
                        a2 = tl.load(a2_ptrs, mask=row_ok[:, None] & (offs[None, :] < left), other=0.0)
                        b2 = tl.load(b2_ptrs, mask=(offs[:, None] < left) & col_ok[None, :], other=0.0)
                        acc = tl.dot(a2, b2, acc, input_precision=PRECISION)
                        a2_ptrs += a2_step
                        b2_ptrs += b2_step
                c_desc = c_ptr
            # -- epilogue --
            if ROWSUM:
                if pid_n == 0:
                    rs_rows = row0 + tl.arange(0, BLOCK_M)
                    tl.store(
                        rowsum_ptr + expert * s_rse + rs_rows,
                        rsum.to(rowsum_ptr.dtype.element_ty),
                        mask=rs_rows < M,
                    )
            c_base = c_ptr + expert * s_ce
            store = True
            if GROUPING == 4:
                _wait_ready(ready_ptr, ready_target, abort_ptr, start_ns, timeout_ns, USE_CLOCK)
                store = tl.load(ready_ptr + 1, volatile=True) == 0
                # slot `rank` of rank q's region, shifted so that the tile's global row indices address it
                region = _region(data_W, q, c_ptr.dtype.element_ty)  # stated 16-byte aligned: 128-bit stores
                c_base = region + (_i64(rank) - q) * block_rows * s_cm
                c_desc = c_base
            z_desc = z_ptr
            z2_desc = z2_ptr
            if EPI_TMA:
                if STORE_Z:
                    z_desc = tl.make_tensor_descriptor(
                        z_ptr, [row_end.to(tl.int32), C], [s_zm, 1], [BLOCK_M, SUB_N]
                    )
                    if DUAL == 2:
                        z2_desc = tl.make_tensor_descriptor(
                            z2_ptr, [row_end.to(tl.int32), C], [s_zm, 1], [BLOCK_M, SUB_N]
                        )
            if store:
                if EPI_SUB == 2:  # the accumulators in halves along N, half h stored at its columns
                    parts = _halves(acc, BLOCK_M, BLOCK_N)
                    parts2 = _halves(acc2, BLOCK_M, BLOCK_N)
                else:
                    parts = (acc,)
                    parts2 = (acc2,)
                for h in tl.static_range(EPI_SUB):
                    _epilogue(
                        parts[h], parts2[h], row0, col0 + h * SUB_N, row_end, C, expert, c_base, c_desc,
                        z_ptr, z_desc, z2_ptr, z2_desc, bias_ptr, s_cm, s_cc, s_zm, s_zc, s_biase,
                        DUAL, ACTIVATION, HAS_BIAS, STORE_Z, EPI_TMA, BLOCK_M, SUB_N,
                    )  # fmt: skip
                if GROUPING == 4:
                    _tile_stored(ready_ptr, signal_W, q, rank, per_block * num_n, call_tag)


@triton.jit
def _gemm_kernel(
    a_ptr, b_ptr, a2_ptr, b2_ptr, c_ptr, z_ptr, z2_ptr, bias_ptr, rowsum_ptr, offsets_ptr,
    M, C, R, E, M_BUCKET,
    s_am, s_ar, s_be, s_br, s_bc,
    s_a2m, s_a2r, s_b2e, s_b2r, s_b2c,
    s_ce, s_cm, s_cc, s_zm, s_zc, s_biase, s_rse,
    GROUPING: tl.constexpr, DUAL: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
    STORE_Z: tl.constexpr, ROWSUM: tl.constexpr, TMA: tl.constexpr,
    A_T: tl.constexpr, B_T: tl.constexpr, A2_T: tl.constexpr, B2_T: tl.constexpr,
    PRECISION: tl.constexpr, EXPERT_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SUB: tl.constexpr,
):  # fmt: skip
    """Persistent GEMM: program p computes tiles p, p + P, p + 2P, ... of ``out``.

    a_ptr  [M, R] (s_am, s_ar)             b_ptr  [E, R, C] (s_be, s_br, s_bc); s_be = 0 unless GROUPING=1
    a2_ptr [M, R] (s_a2m, s_a2r)           b2_ptr [E, R, C] (s_b2e, s_b2r, s_b2c): DUAL=1 adds a2 @ b2,
                                           DUAL=2 uses b2 with a (a2 unused)
    c_ptr  [E, M, C] (s_ce, s_cm, s_cc); s_ce = 0 unless GROUPING=2
    z_ptr, z2_ptr [M, C] (s_zm, s_zc): pre-activation (DUAL=2: the gate's and the up projection's)
    bias_ptr [E, C] (s_biase, unit column stride); rowsum_ptr [E, M] (s_rse, unit stride): sum_r A[m, r]
    offsets_ptr [E + 1] int64 (GROUPING 1: A's rows by expert; 2: the reduction's rows by expert)
    A_T / B_T (TMA only): A is stored [R, M] / B is stored [C, R], each with a unit stride.
    M_BUCKET only keys the autotuner.
    """
    # Every argument through, then: tiles from this program on, every P-th; no ready flags (offsets_ptr
    # stands in for the unused pointers), rank 0 of 1, no wait budget.
    _gemm_tiles(
        a_ptr, b_ptr, a2_ptr, b2_ptr, c_ptr, z_ptr, z2_ptr, bias_ptr, rowsum_ptr, offsets_ptr,
        M, C, R, E, M_BUCKET,
        s_am, s_ar, s_be, s_br, s_bc,
        s_a2m, s_a2r, s_b2e, s_b2r, s_b2c,
        s_ce, s_cm, s_cc, s_zm, s_zc, s_biase, s_rse,
        GROUPING, DUAL, ACTIVATION, HAS_BIAS, STORE_Z, ROWSUM, TMA, A_T, B_T, A2_T, B2_T, PRECISION,
        EXPERT_BLOCK, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EPI_SUB,
        tl.program_id(0), tl.num_programs(0), offsets_ptr, 0, 1, 0, offsets_ptr, 0, 0,
        offsets_ptr, offsets_ptr, 0, False,
    )  # fmt: skip


# --- host side: path choice, configs, launch --------------------------------------------------------------

_LAST_PATH: list[str] = ["none"]


def last_path() -> str:
    """The load path of the latest GEMM launch in this process: "tma", "pointer" or "none"."""
    return _LAST_PATH[0]


def input_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision: IEEE fp32 unless torch allows TF32 for matmul (either of its APIs, see
    :mod:`smptk._precision`); 16-bit inputs ignore it."""
    if dtype == torch.float32 and not tf32_matmul():
        return "ieee"
    return "tf32"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _tma_operand_ok(t: torch.Tensor, strides: tuple[int, ...], *dims: int) -> bool:
    """A view with these (logical) strides can be read by a TMA descriptor: one unit stride among the last
    two, the other one nonzero, every other stride and the base 16-byte aligned, every dim below 2^31.

    A stride of 0 (an ``expand``-ed operand: every row the same memory) is 16-byte aligned but outside what
    a tensor map describes (CUDA asks for each global stride to span the dims inside it), so such views take
    the pointer path. The leading (expert) stride is only added to the base pointer, never described, so 0
    is fine there (dense products are E = 1 views with a leading stride of 0)."""
    es = t.element_size()
    if t.data_ptr() % 16 or any(d > _INT32_LIMIT for d in dims):
        return False
    s0, s1 = strides[-2], strides[-1]
    if s1 != 1 and s0 != 1:
        return False
    other, other_dim = (s0, dims[-2]) if s1 == 1 else (s1, dims[-1])
    if other == 0 and other_dim > 1:
        return False
    lead = strides[:-2]
    return all((s * es) % 16 == 0 for s in (other, *lead))


def _choose_tma(device: torch.device, dtype: torch.dtype, operands: list[tuple] | None) -> bool:
    """TMA or pointer path for one launch (see the module docstring for SMPTK_GEMM_PATH); ``operands``
    None means a store target TMA cannot write."""
    path = settings.gemm_path()
    if path == "pointer" or operands is None or dtype not in (torch.float16, torch.bfloat16):
        return False
    if path == "auto" and not (_hopper(device) and not runtime.interpreter_enabled()):
        return False
    return all(_tma_operand_ok(*op) for op in operands)


def _ptr_configs(dual: int, fp32: str | None) -> tuple[Config, ...]:
    """The pointer path's configs: 16-bit operands (``fp32`` None) or fp32 with ``fp32`` "tf32" / "ieee"."""
    swiglu = dual == DUAL_SWIGLU
    if fp32 == "ieee":
        return _PTR_IEEE_SWIGLU_CONFIGS if swiglu else _PTR_IEEE_CONFIGS
    if fp32 == "tf32":
        return _PTR_TF32_SWIGLU_CONFIGS if swiglu else _PTR_TF32_CONFIGS
    return _PTR_SWIGLU_CONFIGS if swiglu else _PTR_CONFIGS


def _descriptors_per_thread() -> bool:
    """Whether the installed Triton fills an on-device tensor descriptor from every thread of a program
    (before 3.9; 3.9 branches to one warp). Grouped tiles build theirs per tile (see the module docstring),
    so there they hold registers through the tile: the grouped forward reaches 255 registers at 128x256 and
    256x128 on Triton 3.6 (sm_90), 183-216 on 3.9."""
    version = triton.__version__  # None when Triton is missing
    return version is not None and tuple(int(p) for p in version.split(".")[:2]) < (3, 9)


def _tma_configs(dual: int, grouping: int = GROUP_NONE, store_z: bool = False) -> tuple[Config, ...]:
    """The TMA path's configs for an op kind. Where the descriptors are filled per thread, the grouped
    forward that stores its pre-activation (training with an activation) drops the 256-wide tiles: there,
    compiled for sm_90 with Triton 3.6, GELU without bias spilled 28 B (128x256) and 40 B (256x128), and fp16
    GELU-tanh / SiLU with bias 4 B (256x128); the other epilogues are at 245-255 registers without a spill.
    It keeps 128x128, the largest tile that does not spill there."""
    if dual == DUAL_SWIGLU:
        return _TMA_SWIGLU_CONFIGS
    if grouping == GROUP_ROWS and store_z and _descriptors_per_thread():
        return tuple(c for c in _TMA_CONFIGS if max(c.block_m, c.block_n) < 256)
    return _TMA_CONFIGS


def _configs(
    tma: bool,
    dual: int,
    dtype: torch.dtype = torch.bfloat16,
    grouping: int = GROUP_NONE,
    store_z: bool = False,
) -> tuple[Config, ...]:
    if runtime.interpreter_enabled():
        return (_INTERPRETER_CONFIG,)
    if tma:
        return _tma_configs(dual, grouping, store_z)
    return _ptr_configs(dual, input_precision(dtype) if dtype == torch.float32 else None)


def _default_config(configs: tuple[Config, ...], M: int, C: int) -> Config:
    """Without autotuning: the first config whose tile is not much larger than the problem."""
    for cfg in configs:
        if cfg.block_m <= max(64, triton.next_power_of_2(M)) and cfg.block_n <= max(
            64, triton.next_power_of_2(C)
        ):
            return cfg
    return configs[-1]


def _programs(device: torch.device, tiles: int) -> int:
    if runtime.interpreter_enabled() or device.type != "cuda":
        return max(1, min(tiles, _INTERPRETER_PROGRAMS))
    return max(
        1, min(tiles, _sm_count(device.index if device.index is not None else torch.cuda.current_device()))
    )


_KEY = [
    "M_BUCKET", "C", "R", "E", "s_am", "s_ar", "s_br", "s_bc", "GROUPING", "DUAL", "ACTIVATION", "HAS_BIAS",
    "STORE_Z", "ROWSUM", "TMA", "A_T", "B_T", "A2_T", "B2_T", "PRECISION",
]  # fmt: skip


@functools.cache
def _autotuned(configs: tuple[Config, ...]):
    """``_gemm_kernel`` autotuned over ``configs`` (one autotuner per config list)."""
    return triton.autotune(
        configs=[triton.Config(c.meta(), num_stages=c.stages, num_warps=c.warps) for c in configs], key=_KEY
    )(_gemm_kernel)


@dataclasses.dataclass
class _Launch:
    """Everything one launch of ``_gemm_kernel`` needs, as logical views (see the kernel's docstring)."""

    a: torch.Tensor  # [M, R]
    b: torch.Tensor  # [E_b, R, C]
    c: torch.Tensor  # [E_c, M, C]
    offsets: torch.Tensor | None = None
    a2: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    z: torch.Tensor | None = None
    z2: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # [E, C]
    rowsum: torch.Tensor | None = None  # [E, M]
    grouping: int = GROUP_NONE
    dual: int = DUAL_NONE
    activation: int = ACT_NONE
    E: int = 1

    def tma_operands(self) -> list[tuple] | None:
        """(tensor, strides, dims...) of every operand a descriptor would cover; None when a store target
        lacks a unit column stride (TMA stores need one)."""
        M, R = self.a.shape
        C = self.b.shape[2]
        stores = [self.c[0]] + [t for t in (self.z, self.z2) if t is not None]
        if any(t.stride(1) != 1 for t in stores):
            return None
        ops = [
            (self.a, self.a.stride(), M, R),
            (self.b, self.b.stride(), R, C),
            (self.c, self.c.stride(), M, C),
        ]
        if self.a2 is not None:
            ops.append((self.a2, self.a2.stride(), M, R))
        if self.b2 is not None:
            ops.append((self.b2, self.b2.stride(), R, C))
        ops += [(t, t.stride(), M, C) for t in (self.z, self.z2) if t is not None]
        return ops

    def run(self) -> None:
        a, b, c = self.a, self.b, self.c
        M, R = a.shape
        C = b.shape[2]
        if M == 0 or C == 0:  # an empty output: nothing to launch
            return
        device = a.device
        tma = _choose_tma(device, a.dtype, self.tma_operands())
        _LAST_PATH[0] = "tma" if tma else "pointer"
        a2 = self.a2 if self.a2 is not None else a
        b2 = self.b2 if self.b2 is not None else b
        z = self.z if self.z is not None else c[0]
        z2 = self.z2 if self.z2 is not None else z
        bias = self.bias if self.bias is not None else c[0]
        rowsum = self.rowsum if self.rowsum is not None else c[0]
        offsets = self.offsets if self.offsets is not None else c
        configs = _configs(tma, self.dual, a.dtype, self.grouping, self.z is not None)
        E = self.E

        def tiles(cfg_m: int, cfg_n: int) -> int:
            if self.grouping == GROUP_ROWS:
                rows = row_tile_bound(M, E, cfg_m)
            else:
                rows = triton.cdiv(M, cfg_m)
            n = rows * triton.cdiv(C, cfg_n) * (E if self.grouping == GROUP_REDUCTION else 1)
            if n >= 2**31:
                raise ValueError(f"a GEMM of {M} x {C} (E={E}) needs {n} tiles, more than one launch takes")
            return n

        def grid(meta: dict[str, Any]) -> tuple[int]:
            return (_programs(device, tiles(meta["BLOCK_M"], meta["BLOCK_N"])),)

        args = (
            a, b, a2, b2, c, z, z2, bias, rowsum, offsets,
            M, C, R, E, triton.next_power_of_2(M),
            *a.stride(), *b.stride(), *a2.stride(), *b2.stride(),
            *c.stride(), *z.stride(), bias.stride(0), rowsum.stride(0),
        )  # fmt: skip
        a_t = tma and a.stride(1) != 1
        kwargs = dict(
            GROUPING=self.grouping, DUAL=self.dual, ACTIVATION=self.activation,
            HAS_BIAS=self.bias is not None, STORE_Z=self.z is not None, ROWSUM=self.rowsum is not None,
            TMA=tma, A_T=a_t, B_T=tma and b.stride(2) != 1,
            A2_T=tma and self.a2 is not None and a2.stride(1) != 1,
            B2_T=tma and self.b2 is not None and b2.stride(2) != 1,
            PRECISION=input_precision(a.dtype),
            EXPERT_BLOCK=_EXPERT_BLOCK_INTERPRETER if runtime.interpreter_enabled() else _EXPERT_BLOCK,
        )  # fmt: skip
        if tma:
            ensure_allocator()
        if runtime.interpreter_enabled() or not settings.autotune():
            cfg = _default_config(configs, M, C)
            meta = cfg.meta()
            _gemm_kernel[grid(meta)](*args, **kwargs, **meta, num_warps=cfg.warps, num_stages=cfg.stages)
        else:
            _autotuned(configs)[grid](*args, **kwargs)


# --- entry points (operands are checked by the ops; these only arrange views and launch) ------------------


def _lift(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view as a 3-D one with a leading dim of 1 and stride 0 (E = 1 for dense products)."""
    return t.as_strided((1, *t.shape), (0, *t.stride()))


def matmul(
    a_MK: torch.Tensor,
    b_KN: torch.Tensor,
    out_MN: torch.Tensor,
    *,
    bias_N: torch.Tensor | None = None,
    activation: int = ACT_NONE,
    z_out_MN: torch.Tensor | None = None,
    a2_MK: torch.Tensor | None = None,
    b2_KN: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = act(a @ b (+ a2 @ b2) + bias)``, storing the pre-activation into ``z_out`` when given.

    Operands are any strided 2-D views (``a2`` has ``a``'s shape, ``b2`` ``b``'s); bias ``[N]`` contiguous.
    """
    _Launch(
        a=a_MK, b=_lift(b_KN), c=_lift(out_MN), a2=a2_MK, b2=None if b2_KN is None else _lift(b2_KN),
        z=z_out_MN, bias=None if bias_N is None else _lift(bias_N),
        dual=DUAL_SUM if a2_MK is not None else DUAL_NONE, activation=activation,
    ).run()  # fmt: skip
    return out_MN


def swiglu_matmul(
    x_MK: torch.Tensor,
    wg_KN: torch.Tensor,
    wu_KN: torch.Tensor,
    y_MN: torch.Tensor,
    h_M2N: torch.Tensor | None,
) -> torch.Tensor:
    """``y = silu(x @ wg) * (x @ wu)`` reading x once; ``h = [x @ wg | x @ wu]`` stored when given."""
    N = y_MN.shape[1]
    _Launch(
        a=x_MK, b=_lift(wg_KN), b2=_lift(wu_KN), c=_lift(y_MN),
        z=None if h_M2N is None else h_M2N[:, :N], z2=None if h_M2N is None else h_M2N[:, N:],
        dual=DUAL_SWIGLU,
    ).run()  # fmt: skip
    return y_MN


def grouped_matmul(
    a_TR: torch.Tensor,
    b_ERC: torch.Tensor,
    offsets: torch.Tensor,
    out_TC: torch.Tensor,
    *,
    bias_EC: torch.Tensor | None = None,
    activation: int = ACT_NONE,
    z_TC: torch.Tensor | None = None,
    a2_TR: torch.Tensor | None = None,
    b2_ERC: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[rows of e] = act(a[rows of e] @ b[e] (+ a2 @ b2[e]) + bias[e])`` for every expert, one launch."""
    _Launch(
        a=a_TR, b=b_ERC, c=_lift(out_TC), offsets=offsets, a2=a2_TR, b2=b2_ERC, z=z_TC, bias=bias_EC,
        grouping=GROUP_ROWS, dual=DUAL_SUM if a2_TR is not None else DUAL_NONE, activation=activation,
        E=b_ERC.shape[0],
    ).run()  # fmt: skip
    return out_TC


def grouped_swiglu_matmul(
    x_TK: torch.Tensor,
    wg_EKN: torch.Tensor,
    wu_EKN: torch.Tensor,
    offsets: torch.Tensor,
    y_TN: torch.Tensor,
    h_T2N: torch.Tensor | None,
) -> torch.Tensor:
    """``y = silu(x_e @ wg[e]) * (x_e @ wu[e])`` per expert, x read once; ``h = [g | u]`` when given."""
    N = y_TN.shape[1]
    _Launch(
        a=x_TK, b=wg_EKN, b2=wu_EKN, c=_lift(y_TN), offsets=offsets,
        z=None if h_T2N is None else h_T2N[:, :N], z2=None if h_T2N is None else h_T2N[:, N:],
        grouping=GROUP_ROWS, dual=DUAL_SWIGLU, E=wg_EKN.shape[0],
    ).run()  # fmt: skip
    return y_TN


def grouped_weight_grad(
    dz_TN: torch.Tensor,
    x_TK: torch.Tensor,
    offsets: torch.Tensor,
    dw_ENK: torch.Tensor | None,
    db_EN: torch.Tensor | None,
) -> None:
    """``dw[e] = dz_e.T @ x_e`` and ``db[e] = sum of dz_e's rows`` (each may be None), one launch; the rows
    of expert e (``offsets[e]:offsets[e+1]``) are the reduction. Empty experts get exact zeros.

    ``db`` alone still runs the product (into scratch): the row sums ride on the GEMM's loads of dz.
    """
    T, N = dz_TN.shape
    K = x_TK.shape[1]
    E = offsets.shape[0] - 1
    if dw_ENK is None and db_EN is None:
        return
    if T == 0 or N == 0:
        for t in (dw_ENK, db_EN):
            if t is not None:
                t.zero_()
        return
    if K == 0 or dw_ENK is None:  # bias grad only: a one-column product carries the row sums
        x_TK = x_TK.new_zeros((T, 1))
        dw = x_TK.new_empty((E, N, 1))
    else:
        dw = dw_ENK
    _Launch(
        a=dz_TN.t(), b=_lift(x_TK), c=dw, offsets=offsets, rowsum=db_EN, grouping=GROUP_REDUCTION, E=E
    ).run()


# --- compile coverage: every specialization the launchers above can produce --------------------------------


@dataclasses.dataclass(frozen=True)
class Specialization:
    """One compile variant of ``_gemm_kernel`` as Triton's launcher specializes it for the ops' launches.

    ``constexprs``: the kernel's constexprs, plus the integer arguments equal to 1 (the launcher turns those
    into constexprs: unit strides, E = 1); ``aligned``: the integer arguments that are multiples of 16 (the
    launcher marks them ``tt.divisibility = 16``). Pointers are 16-byte aligned (the launchers' tensors are).
    """

    name: str
    path: str  # "tma" or "pointer"
    dtype: str  # Triton pointer element type: "bf16", "fp16", "fp32"
    config: Config
    constexprs: dict[str, Any]
    aligned: tuple[str, ...] = ()
    kernel: str = "smptk.kernels._gemm:_gemm_kernel"  # "module:function" of the engine kernel compiled
    types: dict[str, str] = dataclasses.field(default_factory=dict)  # pointers not of dtype, i64 ints

    @property
    def id(self) -> str:
        c = self.config
        tile = f"{c.block_m}x{c.block_n}x{c.block_k}-s{c.stages}-w{c.warps}-e{c.epi_sub}"
        dtype = self.dtype + (
            "-tf32" if self.dtype == "fp32" and self.constexprs["PRECISION"] == "tf32" else ""
        )
        return f"{self.name}-{self.path}-{dtype}-{tile}"

    def signature(self) -> dict[str, str]:
        """Triton signature: pointer types, int64 offsets, i32 ints; constexprs (unit ints included)."""
        module, function = self.kernel.split(":")
        sig = {}
        for name in getattr(importlib.import_module(module), function).arg_names:
            if name in self.constexprs or name in Config(1, 1, 1, 1, 1).meta():
                sig[name] = "constexpr"
            elif name in self.types:
                sig[name] = self.types[name]
            elif name == "offsets_ptr":
                sig[name] = "*i64"
            elif name == "rowsum_ptr" or name.endswith("_ptr"):
                sig[name] = f"*{self.dtype}"
            else:
                sig[name] = "i32"
        return sig


# (name, grouping, dual, A_T, B_T, A2_T, B2_T, epilogue variants as (ACTIVATION, HAS_BIAS, STORE_Z, ROWSUM)).
# A_T / B_T / A2_T / B2_T name each operand's layout on both paths (the TMA path also passes them): A [M, R]
# with unit stride on R (activations, gradients), or on M when A_T (a transposed gradient, weight grads);
# B [R, C] with unit stride on C (weights in dx, activations in dw), or on R when B_T (nn.Linear weights).
_ALL_ACTS = tuple(ACTIVATION_CODES.values())
_ACT_EPILOGUES = [
    (a, b, z, False) for a in _ALL_ACTS for b in (False, True) for z in ((False, True) if a else (False,))
]
_PLAIN = [(ACT_NONE, False, False, False)]
_ROWSUM_EPILOGUES = [(ACT_NONE, False, False, r) for r in (False, True)]
_SWIGLU_EPILOGUES = [(ACT_NONE, False, z, False) for z in (False, True)]
_KINDS = (
    ("linear_fwd", GROUP_NONE, DUAL_NONE, False, True, False, False, _ACT_EPILOGUES),
    ("linear_dx", GROUP_NONE, DUAL_NONE, False, False, False, False, _PLAIN),
    ("linear_dw", GROUP_NONE, DUAL_NONE, True, False, False, False, _PLAIN),
    ("swiglu_fwd", GROUP_NONE, DUAL_SWIGLU, False, True, False, True, _SWIGLU_EPILOGUES),
    ("swiglu_dx", GROUP_NONE, DUAL_SUM, False, False, False, False, _PLAIN),
    ("grouped_fwd", GROUP_ROWS, DUAL_NONE, False, True, False, False, _ACT_EPILOGUES),
    ("grouped_dx", GROUP_ROWS, DUAL_NONE, False, False, False, False, _PLAIN),
    ("grouped_swiglu_fwd", GROUP_ROWS, DUAL_SWIGLU, False, True, False, True, _SWIGLU_EPILOGUES),
    ("grouped_swiglu_dx", GROUP_ROWS, DUAL_SUM, False, False, False, False, _PLAIN),
    ("grouped_dw", GROUP_REDUCTION, DUAL_NONE, True, False, False, False, _ROWSUM_EPILOGUES),
)  # fmt: skip


def _unit_ints(grouping: int, dual: int, a_t: bool, b_t: bool, a2_t: bool, b2_t: bool) -> dict[str, int]:
    """The integer arguments equal to 1 in an op kind's launches with contiguous inputs and dense gradients:
    each operand's unit stride (a2 / b2 are aliases of a / b where the product has no second operand, and
    share their strides), c's and z's column stride (z aliases c's first matrix when not stored), and E for
    dense products (B and C are lifted to E = 1)."""
    a2_t = a2_t if dual == DUAL_SUM else a_t
    b2_t = b2_t if dual != DUAL_NONE else b_t
    unit = [
        "s_am" if a_t else "s_ar", "s_br" if b_t else "s_bc", "s_a2m" if a2_t else "s_a2r",
        "s_b2r" if b2_t else "s_b2c", "s_cc", "s_zc",
    ]  # fmt: skip
    if grouping == GROUP_NONE:
        unit.append("E")
    return dict.fromkeys(unit, 1)


def _aligned_ints(grouping: int, unit: dict[str, int]) -> tuple[str, ...]:
    """The integer arguments that are multiples of 16 in the launches a specialization stands for: every size
    and stride but the unit ones (the models' hidden sizes, expert widths and tokens per batch are; stride 0
    of a lifted operand is too; M_BUCKET is a power of two >= 16), and not the number of experts (8, 60,
    160 ... in the MoE models served)."""
    fn = getattr(_gemm_kernel, "fn", _gemm_kernel)  # the JITFunction's or the interpreter's Python function
    params = inspect.signature(fn).parameters
    ints = [n for n, p in params.items() if not n.endswith("_ptr") and "constexpr" not in str(p.annotation)]
    return tuple(n for n in ints if n not in unit and not (n == "E" and grouping != GROUP_NONE))


def _heaviest(epilogues: list[tuple]) -> tuple:
    """The epilogue with the most live state: GELU (erf) with bias and the pre-activation store."""
    return max(epilogues, key=lambda e: (e[0] == ACTIVATION_CODES["gelu"], e[1], e[2], e[3], e[0]))


def specializations(*, full: bool = False) -> Iterator[Specialization]:
    """Every ``_gemm_kernel`` variant the launchers launch on a GPU, for contiguous inputs, dense gradients
    and sizes that are multiples of 16 (other strides and sizes compile other variants of the same code).

    Per op kind, path and shipped config: the heaviest epilogue shipped with that config (the register
    high-water mark, for the spill check); with ``full`` every epilogue shipped with it. TMA variants are
    16-bit (bf16, and fp16 with ``full``); pointer variants bf16, fp32 with TF32 off ("ieee") and on
    ("tf32", as ``input_precision`` reads torch's flag), and fp16 with ``full``.
    """
    tma_dtypes = [("bf16", "tf32"), ("fp16", "tf32")] if full else [("bf16", "tf32")]
    ptr_dtypes = [("bf16", "tf32"), ("fp32", "ieee"), ("fp32", "tf32"), ("fp16", "tf32")][: 4 if full else 3]
    for name, grouping, dual, a_t, b_t, a2_t, b2_t, epilogues in _KINDS:
        unit = _unit_ints(grouping, dual, a_t, b_t, a2_t, b2_t)
        for path, dtypes in (("tma", tma_dtypes), ("pointer", ptr_dtypes)):
            tma = path == "tma"
            for dtype, precision in dtypes:
                if tma:  # by STORE_Z, as _configs picks them on a GPU
                    by_z = {z: _tma_configs(dual, grouping, z) for z in (False, True)}
                else:
                    ptr = _ptr_configs(dual, precision if dtype == "fp32" else None)
                    by_z = {False: ptr, True: ptr}
                for cfg in by_z[False]:  # the largest set: storing z only ever drops configs
                    epis = [e for e in epilogues if cfg in by_z[e[2]]]
                    for act, bias, z, rowsum in epis if full else [_heaviest(epis)]:
                        yield Specialization(
                            name=f"{name}-a{act}b{int(bias)}z{int(z)}r{int(rowsum)}" if full else name,
                            path=path, dtype=dtype, config=cfg, aligned=_aligned_ints(grouping, unit),
                            constexprs=dict(
                                GROUPING=grouping, DUAL=dual, ACTIVATION=act, HAS_BIAS=bias, STORE_Z=z,
                                ROWSUM=rowsum, TMA=tma, A_T=tma and a_t, B_T=tma and b_t, A2_T=tma and a2_t,
                                B2_T=tma and b2_t, PRECISION=precision, EXPERT_BLOCK=_EXPERT_BLOCK,
                                **cfg.meta(), **unit,
                            ),
                        )  # fmt: skip


__all__ = [
    "HAVE_TRITON",
    "grouped_matmul",
    "grouped_swiglu_matmul",
    "grouped_weight_grad",
    "last_path",
    "matmul",
    "specializations",
    "swiglu_matmul",
]
