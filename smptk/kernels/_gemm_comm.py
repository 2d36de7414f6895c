"""The GEMM engine fused with a collective over the symmetric heap: all-gather + GEMM, and GEMM +
reduce-scatter, each one kernel.

All-gather + GEMM.

``out[T, N] = act(all_gather(x)[T, K] @ b[K, N] + bias)``: the column-parallel linear's forward under
sequence parallelism (each of the W ranks holds a ``[T/W, K]`` block of the sequence; ``b`` is its
``[N, K]`` weight shard seen as ``[K, N]``). One launch of ``_all_gather_gemm_kernel`` with
``COMM_PROGRAMS + G`` programs:

- **Copy stage**, programs ``0 .. COMM_PROGRAMS - 1`` (``comm_max_sms``; the only programs that touch a
  peer's memory): stage this rank's block ``x [T/W, K]`` in its heap data region and in its own rows of
  the local gather buffer ``g [T, K]``, raise ``ready[rank]``; barrier with the peers' copy programs (the
  collectives' barrier, call check and bounded waits: :mod:`smptk.kernels.collectives`); pull every
  peer's block from its region into ``g``, in rank-rotated order (rank + 1, rank + 2, ...), raising
  ``ready[q]`` after block q; a closing barrier keeps this rank's region in place until every peer has
  read it. Each copy program raises each flag once (release, after its part of the block): block q has
  arrived when ``ready[q] == COMM_PROGRAMS``. On a failed barrier (a peer missing or making another
  call) the programs skip the copies but still raise the flags, so no GEMM program waits on them; the
  host then raises from the heap's status words.
- **GEMM**, programs ``COMM_PROGRAMS ..``: the engine's persistent tile loop (``_gemm._gemm_tiles``)
  with ``GROUPING=3``: row tiles never straddle two ranks' blocks and go in rank-rotated order (this
  rank's own rows first, as torch's async TP multiplies its local shard while the others arrive); a tile
  of block q waits for ``ready[q]`` (acquire), then loads its A tiles from ``g`` like any dense GEMM
  (the pointer path, or TMA descriptors on Hopper: ``g`` is local, aligned memory).

Why a copy stage into a local buffer rather than GEMM tiles reading peers' regions directly: the
communication stays within ``COMM_PROGRAMS`` SMs (the GEMM programs never wait on NVLink loads, and
each peer block crosses NVLink once instead of once per column tile); the gathered input ``g`` is what
the backward's weight gradient needs anyway (``dW = dz.T @ g``); the GEMM keeps its TMA path (a
descriptor over a peer's address would need 16-byte aligned, peer-mapped bases in every block); and only
the copy programs read a peer's region, so the closing barrier among them is all that keeps a region
alive, as in the all-gather kernel (direct reads would need every GEMM program to sign off). Cost: one
extra write and read of ``T x K`` elements in local memory, small next to the GEMM's ``T x N x K``.
Triton-distributed's AG+GEMM makes the same choice with copy-engine producers and per-rank flags.

Deadlock freedom on a GPU: GEMM programs wait only on copy programs of the same launch, which have lower
program ids (dispatched first) and wait only on peers; the grid is at most the SM count.

No autotuning: a launch has side effects on the peers (signals), so benchmarking configs by relaunching
is not possible; the engine's default config for the shape is used.

GEMM + reduce-scatter. ``out[T_w, N] = (sum over ranks r of x_r[T, K_r] @ b_r[K_r, N])[this rank's rows]
+ bias``: the row-parallel linear's forward under sequence parallelism (each rank holds the partial
product of its ``K_r`` input features; rank q keeps rows ``[q * T_w, (q + 1) * T_w)`` of the sum), and the
column-parallel linear's input gradient. One launch of ``_gemm_reduce_scatter_kernel`` with
``1 + G + COMM_PROGRAMS`` programs:

- **Entry**, program 0: the collectives' call announcement, barrier and call check, then ``ready[1] =
  failed`` and ``ready[0] += 1`` (release). Passing the barrier means every peer has finished its previous
  call on this heap, so the slots of its data region are free to write.
- **GEMM**, programs ``1 .. G``: the engine's tile loop with ``GROUPING=4``: row tiles in rank-rotated
  order with this rank's own block last; each tile's epilogue waits for ``ready[0]`` (its K loop does
  not), then stores the fp32 accumulator, cast to the output dtype, into slot ``rank`` of the owner's
  data region (``[W, T_w, N]``: a remote store over NVLink, overlapping the tiles still to compute); the
  block's last tile raises the owner's arrival word for this rank to the call tag (release, system scope).
- **Reduce**, programs ``G + 1 ..`` (``comm_max_sms`` of them): wait for ``ready[0]`` and for every rank's
  arrival word of this rank's block (bounded: a peer that never delivers is recorded in the status
  words, and the host raises CommTimeoutError naming it), then ``out = sum over q of slot q + bias`` in
  fp32, ranks in order (the same summation order on every rank), from local memory only.

No closing barrier: a peer writes into this rank's slots only after the entry barrier of its next call,
which this rank reaches only after this kernel (its reads of the slots) has finished; the arrival words
carry the call tag (its sequence number grows with every call), so stale words never match and nothing
resets them. Deadlock freedom on a GPU: the GEMM programs wait only on program 0, the reduce programs on
GEMM programs (this rank's and the peers'), which never wait on a reduce program; the grid is at most the
SM count. Under the interpreter programs run in program order on each rank, so the same order works.

Why stores into the owner's memory (push) rather than reads of the peers' partials (pull): the transfer
then rides on the GEMM's own epilogue stores, posted writes that overlap the tiles still to compute, and
the reduction reads local memory only; pulling would put NVLink latency on the few reduce programs after
the GEMM. Torch's ``fused_matmul_reduce_scatter`` and Triton-distributed's GEMM + reduce-scatter also
push partials to their owners. Cost: the partials are rounded once to the output dtype before the sum
(as an unfused GEMM followed by a reduce-scatter rounds them), and the data region must hold ``W * T_w *
N`` elements (the host falls back to the unfused pair where it does not).

Legend: W ranks, T = W * T_w rows in all, K input features, N output features (this rank's shard).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from smptk.kernels import _gemm
from smptk.kernels._epilogue import ACT_NONE
from smptk.kernels._gemm import (
    DUAL_NONE,
    GROUP_RANKS,
    GROUP_RANKS_SCATTER,
    Config,
    Specialization,
    _gemm_tiles,
    _wait_ready,
)
from smptk.kernels._triton import ensure_allocator, tl, triton
from smptk.kernels.collectives import (
    _ABORT_WORD,
    _BLOCKS_WORD,
    _barrier,
    _copy,
    _enter,
    _expired,
    _i64,
    _missing,
    _record,
    _region,
    _start,
    _verify,
)

# As the collectives: an int argument equal to 1 (rank 1, world 1) would become a constant, one compile
# per rank; the sizes and strides stay specializable (multiples of 16 in real models).
_GROUP_RANKS = tl.constexpr(GROUP_RANKS)  # the Triton compiler reads only constexpr globals in kernels
_GROUP_RANKS_SCATTER = tl.constexpr(GROUP_RANKS_SCATTER)
_ACT_NONE = tl.constexpr(ACT_NONE)
_REDUCE_COLS = tl.constexpr(128)  # columns of a reduce tile: 256 or 512 contiguous bytes per row
_DUAL_NONE = tl.constexpr(DUAL_NONE)
_NO_SPECIALIZE = ["rank", "world", "timeout_ns", "call_tag", "call_numel", "call_chunk"]


@triton.jit
def _release(flag_ptr):
    """Raise ``*flag_ptr`` by one after every thread's earlier stores (CTA barrier, then a release add)."""
    tl.debug_barrier()
    tl.atomic_add(flag_ptr, 1, sem="release", scope="gpu")


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _all_gather_gemm_kernel(
    x_ptr, g_ptr, b_ptr, c_ptr, z_ptr, bias_ptr, ready_ptr,
    M, C, R, s_br, s_bc, s_cm, s_zm,
    data_W, signal_W, status_ptr, rank, world, timeout_ns,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_Z: tl.constexpr, TMA: tl.constexpr,
    B_T: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SUB: tl.constexpr, COMM_PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, USE_CLOCK: tl.constexpr,
    SIMULATED: tl.constexpr = False,
    call_tag=0, call_numel=0, call_chunk=0,
):  # fmt: skip
    """Copy stage on programs < COMM_PROGRAMS, GEMM tiles on the others (see the module docstring).

    x_ptr [M / world, R] contiguous: this rank's block      g_ptr [M, R] contiguous: the gathered input
    b_ptr [R, C] (s_br, s_bc): the weight shard as [K, N]   c_ptr [M, C] (s_cm, 1); z_ptr [M, C] (s_zm, 1)
    bias_ptr [C]; ready_ptr int32 [world], zero at launch: copy programs done with each rank's block
    data_W / signal_W / status_ptr / rank / world / timeout_ns / call_*: the heap's tables and the call, as
    every collective kernel takes them (:mod:`smptk.kernels.collectives`); BLOCK: the copy tile, in 16-bit
    elements (as theirs). SIMULATED: one device holds every rank's region; no barriers.
    """
    pid = tl.program_id(0)
    start_ns = _start(USE_CLOCK)
    if pid < COMM_PROGRAMS:
        entered = _enter(signal_W, status_ptr, rank, world, call_tag, call_numel, call_chunk, SIMULATED)
        DTYPE = x_ptr.dtype.element_ty
        TILE: tl.constexpr = BLOCK * 16 // DTYPE.primitive_bitwidth  # 2 * BLOCK bytes in every dtype
        n = _i64(M // world) * R  # elements of one rank's block
        own = _region(data_W, rank, DTYPE)
        if entered != 0:
            _copy(x_ptr, own, 0, 0, n, pid, COMM_PROGRAMS, TILE)  # for the peers
            _copy(x_ptr, g_ptr, 0, _i64(rank) * n, n, pid, COMM_PROGRAMS, TILE)  # this rank's rows
        _release(ready_ptr + rank)
        ok = _barrier(
            signal_W, status_ptr, rank, world, pid, entered, start_ns, timeout_ns, USE_CLOCK, SIMULATED
        )
        ok = _verify(signal_W, status_ptr, rank, world, entered, ok, SIMULATED)
        for j in range(1, world):
            q = (rank + j) % world
            if ok != 0:
                _copy(_region(data_W, q, DTYPE), g_ptr, 0, _i64(q) * n, n, pid, COMM_PROGRAMS, TILE)
            _release(ready_ptr + q)
        _barrier(signal_W, status_ptr, rank, world, pid, ok, start_ns, timeout_ns, USE_CLOCK, SIMULATED)
    else:
        abort_ptr = tl.load(signal_W + rank).to(tl.pointer_type(tl.int32)) + _ABORT_WORD
        _gemm_tiles(
            g_ptr, b_ptr, g_ptr, b_ptr, c_ptr, z_ptr, z_ptr, bias_ptr, bias_ptr, ready_ptr,
            M, C, R, 1, 0,
            R, 1, 0, s_br, s_bc,
            R, 1, 0, s_br, s_bc,
            0, s_cm, 1, s_zm, 1, 0, 0,
            _GROUP_RANKS, _DUAL_NONE, ACTIVATION, HAS_BIAS, STORE_Z, False, TMA,
            False, B_T, False, B_T, PRECISION, 1,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EPI_SUB,
            pid - COMM_PROGRAMS, tl.num_programs(0) - COMM_PROGRAMS, ready_ptr, rank, world, COMM_PROGRAMS,
            abort_ptr, start_ns, timeout_ns, data_W, signal_W, call_tag, USE_CLOCK,
        )  # fmt: skip


@triton.jit
def _wait_tag(word_ptr, tag, abort_ptr, start_ns, timeout_ns, USE_CLOCK: tl.constexpr):
    """Spin until the int64 ``*word_ptr`` equals ``tag`` (acquire, system scope); 1 when it did, 0 when the
    wait budget ran out first."""
    seen = tl.atomic_add(word_ptr, 0, sem="acquire", scope="sys")
    expired = (seen * 0).to(tl.int32)
    while (seen != tag) & (expired == 0):
        seen = tl.atomic_add(word_ptr, 0, sem="acquire", scope="sys")
        expired = _expired(start_ns, timeout_ns, abort_ptr, USE_CLOCK)
    return (seen == tag).to(tl.int32)


@triton.jit
def _reduce_own_block(
    out_ptr, bias_ptr, ready_ptr, data_W, signal_W, status_ptr, rank, world, T_w, C, call_tag, pid, P,
    abort_ptr, start_ns, timeout_ns, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_CLOCK: tl.constexpr,
):  # fmt: skip
    """The reduce stage (see the module docstring): ``out [T_w, C] = sum_q slot q + bias``, tiles of
    ``[RB, _REDUCE_COLS]`` (``BLOCK`` bytes of the output dtype), tile t on program t % P."""
    _wait_ready(ready_ptr, 1, abort_ptr, start_ns, timeout_ns, USE_CLOCK)
    if tl.load(ready_ptr + 1, volatile=True) == 0:
        arrivals = tl.load(signal_W + rank).to(tl.pointer_type(tl.int64)) + _BLOCKS_WORD
        for q in range(0, world):
            if _wait_tag(arrivals + q, call_tag, abort_ptr, start_ns, timeout_ns, USE_CLOCK) == 0:
                _record(status_ptr, signal_W, rank, world, q, 0)
        if _missing(status_ptr, world) == 0:
            DTYPE = out_ptr.dtype.element_ty
            RB: tl.constexpr = max(BLOCK * 8 // DTYPE.primitive_bitwidth // _REDUCE_COLS, 1)
            own = _region(data_W, rank, DTYPE)
            slot = _i64(T_w) * C
            n_c = tl.cdiv(C, _REDUCE_COLS)
            n_tiles = tl.cdiv(T_w, RB) * n_c
            for t in range(pid, n_tiles, P):
                rows = (t // n_c).to(tl.int64) * RB + tl.arange(0, RB)
                cols = (t % n_c).to(tl.int64) * _REDUCE_COLS + tl.arange(0, _REDUCE_COLS)
                mask = (rows[:, None] < T_w) & (cols[None, :] < C)
                offs = rows[:, None] * C + cols[None, :]
                acc = tl.zeros((RB, _REDUCE_COLS), dtype=tl.float32)
                for q in range(0, world):
                    acc += tl.load(own + _i64(q) * slot + offs, mask=mask, other=0.0).to(tl.float32)
                if HAS_BIAS:
                    acc += tl.load(bias_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
                tl.store(out_ptr + offs, acc.to(DTYPE), mask=mask)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _gemm_reduce_scatter_kernel(
    a_ptr, b_ptr, out_ptr, bias_ptr, ready_ptr,
    M, C, R, s_am, s_br, s_bc,
    data_W, signal_W, status_ptr, rank, world, timeout_ns,
    HAS_BIAS: tl.constexpr, TMA: tl.constexpr, B_T: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EPI_SUB: tl.constexpr, COMM_PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, USE_CLOCK: tl.constexpr,
    SIMULATED: tl.constexpr = False,
    call_tag=0, call_numel=0, call_chunk=0,
):  # fmt: skip
    """Entry on program 0, GEMM tiles on 1 .. G, the reduce stage on the last COMM_PROGRAMS (see the module
    docstring).

    a_ptr [M, R] (s_am, 1): this rank's input, all M rows     b_ptr [R, C] (s_br, s_bc): its weight as [K, N]
    out_ptr [M / world, C] contiguous: this rank's rows of the sum; bias_ptr [C]
    ready_ptr int32 [2 + world], zero at launch: [0] entry done, [1] entry failed, [2 + q] tiles of block q
    stored. data_W ... call_*: the heap's tables and the call, as every collective kernel takes them.
    SIMULATED (:mod:`smptk.comm.simulated`: one rank's kernel, every region in one device's memory): no
    barrier, and the entry program marks every peer's partial of this rank's block as arrived (the slots
    hold what the caller staged there), so the reduce waits for this rank's own tiles only.
    """
    pid = tl.program_id(0)
    start_ns = _start(USE_CLOCK)
    abort_ptr = tl.load(signal_W + rank).to(tl.pointer_type(tl.int32)) + _ABORT_WORD
    gemm_programs = tl.num_programs(0) - 1 - COMM_PROGRAMS
    if pid == 0:
        entered = _enter(signal_W, status_ptr, rank, world, call_tag, call_numel, call_chunk, SIMULATED)
        ok = _barrier(
            signal_W, status_ptr, rank, world, pid, entered, start_ns, timeout_ns, USE_CLOCK, SIMULATED
        )
        ok = _verify(signal_W, status_ptr, rank, world, entered, ok, SIMULATED)
        if SIMULATED:
            arrivals = tl.load(signal_W + rank).to(tl.pointer_type(tl.int64)) + _BLOCKS_WORD
            for q in range(0, world):
                if q != rank:
                    tl.atomic_xchg(arrivals + q, call_tag, sem="release", scope="sys")
        tl.store(ready_ptr + 1, 1 - ok)
        _release(ready_ptr)
    elif pid <= gemm_programs:
        _gemm_tiles(
            a_ptr, b_ptr, a_ptr, b_ptr, out_ptr, out_ptr, out_ptr, bias_ptr, bias_ptr, ready_ptr,
            M, C, R, 1, 0,
            s_am, 1, 0, s_br, s_bc,
            s_am, 1, 0, s_br, s_bc,
            0, C, 1, C, 1, 0, 0,
            _GROUP_RANKS_SCATTER, _DUAL_NONE, _ACT_NONE, False, False, False, TMA,
            False, B_T, False, B_T, PRECISION, 1,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EPI_SUB,
            pid - 1, gemm_programs, ready_ptr, rank, world, 1,
            abort_ptr, start_ns, timeout_ns, data_W, signal_W, call_tag, USE_CLOCK,
        )  # fmt: skip
    else:
        _reduce_own_block(
            out_ptr, bias_ptr, ready_ptr, data_W, signal_W, status_ptr, rank, world, M // world, C,
            call_tag, pid - 1 - gemm_programs, COMM_PROGRAMS, abort_ptr, start_ns, timeout_ns,
            HAS_BIAS, BLOCK, USE_CLOCK,
        )  # fmt: skip


# --- host side (kernels layer: no torch.distributed; smptk.comm.fused_linear launches it) ----------------


class _FusedGemm:
    """What the two fused launches share: the collectives' launch path indexes one with its grid of
    ``comm_programs`` (the copy or reduce programs, ``_stage``) and calls the result; the GEMM's load path
    is the engine's choice for its A operand, the weight shard seen as ``[K, N]`` and its store targets."""

    _stage = ""

    def __getitem__(self, grid: tuple[int]):
        if grid != (self.comm_programs,):
            raise ValueError(f"grid: expected ({self.comm_programs},) {self._stage} programs, got {grid}")
        return self._run

    def _choose_tma(self, a: torch.Tensor, *stores: torch.Tensor | None) -> bool:
        """Whether the GEMM takes the TMA load path, as the engine chooses it for these operands; recorded
        as the engine's :func:`~smptk.kernels._gemm.last_path`."""
        ops = [(t, t.stride(), *t.shape) for t in (a, self.w_NK.t(), *stores) if t is not None]
        tma = _gemm._choose_tma(a.device, a.dtype, ops)
        _gemm._LAST_PATH[0] = "tma" if tma else "pointer"
        return tma


@dataclasses.dataclass
class AllGatherMatmul(_FusedGemm):
    """One all-gather GEMM, ready to launch through the collectives' launch path.

    ``smptk.comm.collectives._launch(heap, op, comm_programs, (), (), call=...)`` calls
    ``op[(comm_programs,)](data_W, signal_W, status, rank, world, timeout_ns, BLOCK=..., USE_CLOCK=...,
    SIMULATED=..., call_tag=..., call_numel=..., call_chunk=...)`` as it calls every collective kernel;
    this object adds the GEMM's operands, its constexprs and the GEMM programs to the grid.

    x_TwK: this rank's contiguous block; w_NK: its weight shard (nn.Linear layout, any strides);
    out_TN, g_TK (the gathered input), z_TN (pre-activation, or None): contiguous outputs; ready_W:
    int32 zeros [world]; bias_N: contiguous or None.
    """

    x_TwK: torch.Tensor
    w_NK: torch.Tensor
    out_TN: torch.Tensor
    g_TK: torch.Tensor
    ready_W: torch.Tensor
    comm_programs: int
    bias_N: torch.Tensor | None = None
    z_TN: torch.Tensor | None = None
    activation: int = ACT_NONE
    _stage = "copy"

    def _run(self, data_W, signal_W, status, rank, world, timeout_ns, **collective_meta: Any) -> None:
        g, out = self.g_TK, self.out_TN
        M, R = g.shape
        C = out.shape[1]
        b = self.w_NK.t()  # [K, N] view
        tma = self._choose_tma(g, out, self.z_TN)
        cfg, gemm_programs = _plan(g, C, world, tma, self.comm_programs)
        z = self.z_TN if self.z_TN is not None else out
        bias = self.bias_N if self.bias_N is not None else out
        _all_gather_gemm_kernel[(self.comm_programs + gemm_programs,)](
            self.x_TwK, g, b, out, z, bias, self.ready_W,
            M, C, R, b.stride(0), b.stride(1), out.stride(0), z.stride(0),
            data_W, signal_W, status, rank, world, timeout_ns,
            ACTIVATION=self.activation, HAS_BIAS=self.bias_N is not None, STORE_Z=self.z_TN is not None,
            TMA=tma, B_T=tma and b.stride(1) != 1, PRECISION=_gemm.input_precision(g.dtype),
            COMM_PROGRAMS=self.comm_programs, **cfg.meta(), **collective_meta,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip


@dataclasses.dataclass
class MatmulReduceScatter(_FusedGemm):
    """One GEMM + reduce-scatter, ready to launch through the collectives' launch path (as
    :class:`AllGatherMatmul`).

    x_TK: this rank's contiguous input, all T rows; w_NK: its weight shard (nn.Linear layout, any strides);
    out_TwN: contiguous, this rank's block of the sum; ready: int32 zeros [2 + world]; bias_N: contiguous
    or None, added once after the sum. The heap's data region must hold ``world * T_w * N`` elements.
    """

    x_TK: torch.Tensor
    w_NK: torch.Tensor
    out_TwN: torch.Tensor
    ready: torch.Tensor
    comm_programs: int
    bias_N: torch.Tensor | None = None
    _stage = "reduce"

    def _run(self, data_W, signal_W, status, rank, world, timeout_ns, **collective_meta: Any) -> None:
        x, out = self.x_TK, self.out_TwN
        M, R = x.shape
        C = out.shape[1]
        b = self.w_NK.t()  # [K, N] view
        tma = self._choose_tma(x)  # its stores into the peers' regions are plain stores: not operands
        cfg, gemm_programs = _plan(x, C, world, tma, self.comm_programs + 1)
        bias = self.bias_N if self.bias_N is not None else out
        _gemm_reduce_scatter_kernel[(1 + gemm_programs + self.comm_programs,)](
            x, b, out, bias, self.ready,
            M, C, R, x.stride(0), b.stride(0), b.stride(1),
            data_W, signal_W, status, rank, world, timeout_ns,
            HAS_BIAS=self.bias_N is not None, TMA=tma, B_T=tma and b.stride(1) != 1,
            PRECISION=_gemm.input_precision(x.dtype), COMM_PROGRAMS=self.comm_programs, **cfg.meta(),
            **collective_meta, num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip


def _plan(a: torch.Tensor, C: int, world: int, tma: bool, other_programs: int) -> tuple[Config, int]:
    """The config (the engine's default tile for a dense ``[M, C]`` product) and GEMM program count of a
    launch whose A operand is ``a [M, R]`` (M rows in ``world`` blocks) and whose grid has ``other_programs``
    more: on CUDA the whole grid fits the SMs (see the module docstring)."""
    M = a.shape[0]
    cfg = _gemm._default_config(_gemm._configs(tma, DUAL_NONE, a.dtype), M, C)  # no autotuning: docstring
    tiles = world * triton.cdiv(M // world, cfg.block_m) * triton.cdiv(C, cfg.block_n)
    if a.device.type == "cuda":
        sms = _gemm._sm_count(a.device.index if a.device.index is not None else torch.cuda.current_device())
        programs = max(1, min(tiles, sms - other_programs))
    else:
        programs = _gemm._programs(a.device, tiles)
    if tma:
        ensure_allocator()
    return cfg, programs


# --- compile coverage ---------------------------------------------------------------------------------------

KERNEL = "smptk.kernels._gemm_comm:_all_gather_gemm_kernel"
SCATTER_KERNEL = "smptk.kernels._gemm_comm:_gemm_reduce_scatter_kernel"
# Arguments not of the GEMM dtype: the heap's address tables, status words and flags; the 300 s budget in ns.
TYPES = {"data_W": "*i64", "signal_W": "*i64", "status_ptr": "*i32", "ready_ptr": "*i32", "timeout_ns": "i64"}


def specializations(*, full: bool = False) -> list[Specialization]:
    """The variants the launchers produce on a GPU for contiguous operands, sizes multiples of 16: for each
    kernel and path (TMA on sm_90 in bf16; pointer in bf16 and fp32 with TF32 off), the default config of
    a large shape, the heaviest epilogue (all-gather GEMM: GELU with bias and the pre-activation store;
    GEMM + reduce-scatter: the bias of the reduce stage), 8 copy / reduce programs, the collectives' copy
    tile ``BLOCK``, the clock on (the CUDA path). ``full`` adds every shipped config.

    Each kernel in both weight layouts on the TMA path: a forward's ``[N, K]`` weight seen as ``[K, N]``
    (``B_T``, unit ``s_br``), and the other op's backward, which passes ``weight.t()`` (unit ``s_bc``):
    the all-gather GEMM computes ``linear_reduce_scatter``'s input gradient, the GEMM + reduce-scatter
    ``all_gather_linear``'s (names ``*_bwd``)."""
    from smptk.kernels import collectives
    from smptk.kernels._epilogue import ACTIVATION_CODES

    common = dict(COMM_PROGRAMS=8, BLOCK=collectives.BLOCK, USE_CLOCK=True, SIMULATED=False)
    kernels = {  # name of the forward it serves -> (kernel, backward name, constexprs, aligned ints)
        "all_gather_linear": (
            KERNEL, "linear_reduce_scatter_bwd",
            dict(ACTIVATION=ACTIVATION_CODES["gelu"], HAS_BIAS=True, STORE_Z=True),
            ("M", "C", "R", "s_cm", "s_zm"),
        ),
        "linear_reduce_scatter": (
            SCATTER_KERNEL, "all_gather_linear_bwd", dict(HAS_BIAS=True), ("M", "C", "R", "s_am"),
        ),
    }  # fmt: skip
    out = []
    for path, dtype, precision in (
        ("tma", "bf16", "tf32"),
        ("pointer", "bf16", "tf32"),
        ("pointer", "fp32", "ieee"),
    ):
        tma = path == "tma"
        if tma:
            configs = _gemm._tma_configs(DUAL_NONE)
        else:
            configs = _gemm._ptr_configs(DUAL_NONE, precision if dtype == "fp32" else None)
        for cfg in configs if full else configs[:1]:
            for fwd, (kernel, bwd, consts, aligned) in kernels.items():
                layouts = [(f"{fwd}_fwd", True)] + ([(bwd, False)] if tma else [])
                for name, b_t in layouts:
                    unit = {"s_br": 1} if b_t else {"s_bc": 1}
                    out.append(
                        Specialization(
                            name=name, path=path, dtype=dtype, config=cfg, kernel=kernel, types=TYPES,
                            aligned=(*aligned, "s_bc" if b_t else "s_br"),
                            constexprs=dict(
                                **consts, TMA=tma, B_T=tma and b_t, PRECISION=precision, **common, **unit,
                                **cfg.meta(),
                            ),
                        )
                    )  # fmt: skip
    return out
