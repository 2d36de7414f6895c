"""moe_dispatch / moe_combine: group the (token, slot) pairs of a top-k routing by expert, and undo it.

Legend: T tokens, H hidden size, E experts, k slots per token (top_k), P = T * k pairs numbered
``p = t * k + j`` (token t, slot j), R rows of the grouped buffer (the pairs kept), C the capacity.

Shapes: x ``[T, H]`` (any float dtype, any strides), expert_ids ``[T, k]`` int32/int64 (from
:func:`smptk.kernels.moe_route`), x_grouped ``[R, H]`` in x's dtype; y ``[R, H]`` (the experts' outputs, same
row order), weights ``[T, k]`` (any float dtype), out ``[T, H]`` in y's dtype.

What it computes. Pairs are grouped by expert **stably**: inside one expert's rows the pairs keep their
order ``p``, so with a capacity the earliest tokens win. With ``capacity_factor`` each expert keeps at most
``C = ceil(capacity_factor * T * k / E)`` pairs (exact rational arithmetic on the number as written) and
drops the pairs whose position inside their expert is ``>= C``. Then ``x_grouped[dest[t, j]] = x[t]`` for
every kept pair, and ``moe_combine`` returns ``out[t] = sum_j weights[t, j] * y[dest[t, j]]`` over the kept
pairs (a dropped pair contributes nothing; a token with every pair dropped gets a zero row).

Worked example, 4 tokens, E = 3, k = 2 (p = 2t + j; ``expert_ids`` as :func:`moe_route` returns them)::

    expert_ids        = [[0, 2], [2, 1], [0, 1], [2, 0]]     pairs p0..p7 -> experts 0 2 2 1 0 1 2 0
    tokens_per_expert = [3, 2, 3]                            expert 0: p0 p4 p7, 1: p3 p5, 2: p1 p2 p6
    offsets           = [0, 3, 5, 8]                         expert e owns rows offsets[e]:offsets[e+1]
    source_pair       = [0, 4, 7, 3, 5, 1, 2, 6]             the pair in each grouped row
    source_token      = [0, 2, 3, 1, 2, 0, 1, 3]             = source_pair // k
    dest              = [[0, 5], [6, 3], [1, 4], [7, 2]]     the row each pair went to

    capacity_factor=0.5 -> C = ceil(0.5 * 4 * 2 / 3) = 2: p7 (expert 0's third) and p6 (expert 2's third)
    are dropped; tokens_per_expert = [2, 2, 2], offsets = [0, 2, 4, 6], source_token = [0, 2, 1, 2, 0, 1],
    dest = [[0, 4], [5, 2], [1, 3], [-1, -1]], num_dropped = 2, and combine gives token 3 a zero row.

Algorithm (no sort; four small launches for the plan and the gather, all Triton):

1. ``_dispatch_hist_kernel``: each program takes ``PAIRS_PER_PROG`` consecutive pairs and writes their
   per-expert histogram (a one-hot ``[BLOCK_P, BLOCK_E]`` summed over pairs) to ``hist [num_progs, E]``,
   plus its count of out-of-range ids.
2. ``_dispatch_scan_kernel`` (one program): exclusive scan of ``hist`` over programs -> ``base [num_progs,
   E]`` (how many of expert e's pairs come before program b), totals -> kept counts ``min(count, C)`` ->
   ``offsets`` (exclusive scan over experts) and a 2-element summary (rows kept, bad ids).
3. ``_dispatch_scatter_kernel``: each program re-reads its pairs; the position of a pair inside its expert
   is ``base[b, e]`` + the pairs of e before it in the program (a running count across chunks plus the
   in-chunk inclusive cumsum of the one-hot, minus one). Kept pairs get ``dest = offsets[e] + position``
   and write ``source_token`` / ``source_pair`` at that row; dropped ones get ``dest = -1``.
4. ``_gather_rows_kernel``: ``x_grouped[r] = x[source_token[r]]``, one program per row tile (every row
   written exactly once, contiguous stores).

The kernels live in ``_moe_dispatch_kernels.py``, imported with triton on the first Triton-path call (see
``_triton.py``); this file holds their tunables and launchers, the plan, the checks, the autograd wiring
and the PyTorch path.

Host syncs. Without ``capacity_factor`` R = T * k is known up front and the CUDA path reads nothing back.
With it, R (the rows kept) must be known to allocate ``x_grouped [R, H]``: the launcher reads the 16-byte
summary once (``tolist``), which also checks the ids and makes ``num_dropped`` a Python int. A
capacity-bounded ``[min(P, E * C), H]`` buffer would avoid that read but hand every consumer (grouped GEMM,
the expert-parallel all-to-all, which takes host split sizes anyway) dead rows to skip; we chose the exact
size. On CPU tensors the ids are always checked (reading a CPU tensor costs no device sync); on CUDA
without a capacity they are not (a check would be a sync): an id outside ``[0, E)`` then behaves as a
dropped pair (``dest = -1``) and leaves a zero row at the end of ``x_grouped``; it never writes out of
bounds.

Meta tensors (shape propagation, delayed initialization) take :func:`_dispatch_meta`: there are no ids
to read, so without a capacity R = T * k as always, and with one R is the bound ``min(P, E * C)`` (every
expert full) and ``num_dropped`` the matching ``P - R``; the plan's other shapes are exact.

Backward (Triton): dispatch's ``dx[t] = sum_j dx_grouped[dest[t, j]]`` (kept j) is the unweighted form of
the combine forward, one kernel ``_gather_sum_kernel`` for both (fp32 accumulation over j in slot order,
one rounding, no atomics: deterministic). Combine's ``dy[r] = weights[pair] * dout[token]`` over grouped rows
(``_combine_dy_kernel``) and ``dweights[t, j] = <dout[t], y[dest[t, j]]>`` (``_combine_dw_kernel``, 0 for a
dropped pair).

Index math: every offset that can pass 2^31 is int64. Where an int32 enters (program ids, loaded int32
ids) it goes through ``row_offset`` / ``pair_coords`` (``_index.py``; ``tests/test_moe_dispatch.py`` runs
them past 2^31); indices derived from their int64 results stay int64, loaded indices are int64 buffers,
and loops over slots step 64-bit pointers instead of multiplying ``j * stride``. (Each helper call costs
the interpreter ~2 ms, so they sit outside the inner loops.)

Example (on a GPU; the CPU examples are :func:`moe_dispatch`'s, :func:`moe_combine`'s and
:class:`MoEDispatchPlan`'s)::

    >>> x = torch.randn(4, 16, device="cuda", dtype=torch.bfloat16)  # needs CUDA  # doctest: +SKIP
    >>> ids = torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0]], device="cuda")  # needs CUDA  # doctest: +SKIP
    >>> x_grouped, plan = moe_dispatch(x, ids, 3)  # [8, 16]; offsets [0, 3, 5, 8]; CUDA  # doctest: +SKIP
    >>> out = moe_combine(x_grouped, plan, torch.ones(4, 2, device="cuda"))  # needs CUDA  # doctest: +SKIP
    >>> torch.equal(out, 2 * x)  # needs CUDA  # doctest: +SKIP
    True
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from fractions import Fraction

import torch

from smptk.kernels import runtime
from smptk.kernels._buffers import new_buffer, new_index_buffer
from smptk.kernels._checks import check_float_tensor
from smptk.kernels._dispatch import first_derivative_only, outside_graphs
from smptk.kernels._triton import cdiv, kernel_module, next_power_of_2

# The @triton.jit kernels, imported (with triton) on the first Triton-path call: see smptk.kernels._triton.
_kernels = kernel_module("smptk.kernels._moe_dispatch_kernels")

INDEX_DTYPES = (torch.int32, torch.int64)

# Plan kernels: a program covers PAIRS_PER_PROG pairs (so hist/base stay ~P/1024 x E: 1 MB at
# P = 512K pairs, E = 256) in chunks of BLOCK_P pairs; the one-hot chunk is BLOCK_P x BLOCK_E, held to
# ~2K elements (BLOCK_P = clamp(2048 // BLOCK_E, 16, 128); E > 128 takes 16 x BLOCK_E). At 4K, 64 x 64 for
# E = 64 took 180-194 registers on sm_90 (Triton 3.9) and spilled 80-124 B on Triton 3.6; at 32 x 64, 96-152
# and none. The scan walks up to SCAN_BLOCK_B programs' rows per step, held to a ~4K-element tile. Untuned
# for speed (no GPU run yet).
_PLAN_BLOCKS = {"PAIRS_PER_PROG": 1024, "CHUNK_ELEMS": 2048, "MIN_BLOCK_P": 16, "SCAN_BLOCK_B": 32}
_SCAN_TILE_ELEMS = 4096
# Interpreter: small blocks so the CPU tests (T * k >= 65) cross program, chunk (E <= 8: 2 chunks of 16 pairs)
# and scan-step boundaries.
_PLAN_BLOCKS_INTERPRETER = {"PAIRS_PER_PROG": 32, "CHUNK_ELEMS": 128, "MIN_BLOCK_P": 4, "SCAN_BLOCK_B": 2}
# Row kernels (copies, k-term weighted sums, H-long dots): memory-bound, untuned.
_ROW_BLOCKS = {"BLOCK_R": 32, "BLOCK_H": 128}
_ROW_BLOCKS_INTERPRETER = {"BLOCK_R": 8, "BLOCK_H": 16}


def _plan_blocks() -> dict[str, int]:
    return _PLAN_BLOCKS_INTERPRETER if runtime.interpreter_enabled() else _PLAN_BLOCKS


def _chunk_blocks(E: int, blocks: dict[str, int]) -> tuple[int, int]:
    """(BLOCK_E, BLOCK_P) of the plan kernels for E experts under the block table ``blocks``."""
    BLOCK_E = next_power_of_2(E)
    # Powers of two no larger than PAIRS_PER_PROG (a power of two), so chunks tile a program exactly.
    BLOCK_P = min(max(blocks["CHUNK_ELEMS"] // BLOCK_E, blocks["MIN_BLOCK_P"]), 128, blocks["PAIRS_PER_PROG"])
    return BLOCK_E, BLOCK_P


def _row_blocks() -> dict[str, int]:
    return _ROW_BLOCKS_INTERPRETER if runtime.interpreter_enabled() else _ROW_BLOCKS


@dataclasses.dataclass(frozen=True)
class MoEDispatchPlan:
    """Where every (token, slot) pair went; made by :func:`moe_dispatch`, consumed by :func:`moe_combine`.

    Attributes:
        offsets: ``[E + 1]`` int64; expert e's rows are ``offsets[e]:offsets[e + 1]`` of the grouped buffer.
        tokens_per_expert: ``[E]`` int64, the pairs each expert **kept** (after the capacity).
        dest: ``[T, k]`` int64, the grouped row of pair ``(t, j)``, or -1 where it was dropped.
        source_token: ``[R]`` int64, the token of each grouped row.
        source_pair: ``[R]`` int64, the pair ``t * k + j`` of each grouped row.
        num_dropped: pairs dropped by the capacity (a Python int; 0 without a capacity).
        capacity: C, or None without ``capacity_factor``.
        top_k: k. num_experts: E.

    Example (the module docstring's worked example, with ``capacity_factor=0.5``: C = 2)::

        >>> import torch
        >>> from smptk.kernels import moe_dispatch
        >>> ids = torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0]])    # moe_route's expert_ids: T 4, k 2, E 3
        >>> x_grouped, plan = moe_dispatch(torch.zeros(4, 8), ids, 3, capacity_factor=0.5)
        >>> plan.capacity, plan.num_dropped, plan.num_tokens, plan.num_rows
        (2, 2, 4, 6)
        >>> plan.offsets.tolist(), plan.tokens_per_expert.tolist()   # expert e: rows offsets[e]:offsets[e+1]
        ([0, 2, 4, 6], [2, 2, 2])
        >>> plan.dest.tolist()                  # the grouped row of pair (t, j); -1: dropped
        [[0, 4], [5, 2], [1, 3], [-1, -1]]
        >>> plan.source_token.tolist(), plan.source_pair.tolist()   # per grouped row
        ([0, 2, 1, 2, 0, 1], [0, 4, 3, 5, 1, 2])
    """

    offsets: torch.Tensor
    tokens_per_expert: torch.Tensor
    dest: torch.Tensor
    source_token: torch.Tensor
    source_pair: torch.Tensor
    num_dropped: int
    capacity: int | None
    top_k: int
    num_experts: int

    @property
    def num_tokens(self) -> int:
        """T."""
        return self.dest.shape[0]

    @property
    def num_rows(self) -> int:
        """R, the rows of the grouped buffer (the pairs kept)."""
        return self.source_token.shape[0]


def capacity_of(capacity_factor: float | None, num_tokens: int, top_k: int, num_experts: int) -> int | None:
    """``ceil(capacity_factor * T * k / E)`` in exact rational arithmetic on the number as written: a float is
    read as its shortest decimal (``repr``: 0.8 is 4/5, not the double just above it, which made C one too
    large at 0.8 * 600 * 2 / 5 = 192), so no rounding can push an exact integer up by one; None without a
    capacity factor.

    >>> capacity_of(0.5, 4, 2, 3), capacity_of(1.0, 6, 2, 3), capacity_of(None, 4, 2, 3)
    (2, 4, None)
    >>> capacity_of(0.8, 600, 2, 5), capacity_of(1.1, 1000, 2, 8), capacity_of(1.25, 4096, 6, 64)
    (192, 275, 480)
    """
    if capacity_factor is None:
        return None
    exact = Fraction(capacity_factor if isinstance(capacity_factor, int) else repr(float(capacity_factor)))
    # ceil(p * T * k / (q * E)) in integers: the same exact value, and T may be a SymInt (torch.compile
    # with dynamic shapes), which a Fraction does not multiply
    return -(-exact.numerator * num_tokens * top_k // (exact.denominator * num_experts))


def check_capacity_factor(capacity_factor: object) -> int | float | None:
    """``capacity_factor`` as a Python int or float (numpy scalars included), after checking that it is None
    or a finite number > 0; raises TypeError / ValueError naming it otherwise.

    >>> check_capacity_factor(None), check_capacity_factor(1.25), check_capacity_factor(2)
    (None, 1.25, 2)
    """
    if capacity_factor is None:
        return None
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real):
        raise TypeError(f"capacity_factor: expected None or a number, got {type(capacity_factor).__name__}")
    # an int is exact and finite however large (math.isfinite overflows past a double's range)
    value = int(capacity_factor) if isinstance(capacity_factor, numbers.Integral) else float(capacity_factor)
    if value <= 0 or not (isinstance(value, int) or math.isfinite(value)):
        raise ValueError(f"capacity_factor: expected None or a finite number > 0, got {capacity_factor!r}")
    return value


def _check_ids_result(bad: int, num_experts: int) -> None:
    if bad:
        raise ValueError(
            f"expert_ids: {bad} ids are outside [0, num_experts) = [0, {num_experts}); "
            "every id must name an expert"
        )


def _ids_checked_on_host(device: torch.device, capacity: int | None) -> bool:
    """Whether the launcher reads the summary back: with a capacity (it must, for R) or on CPU (free)."""
    return capacity is not None or device.type == "cpu"


def dispatch_plan(expert_ids: torch.Tensor, num_experts: int, capacity: int | None) -> MoEDispatchPlan:
    """Triton plan (histogram, scan, scatter) for checked ``expert_ids [T, k]``; see the module docstring."""
    T, k = expert_ids.shape
    E = num_experts
    P = T * k
    device = expert_ids.device
    blocks = _plan_blocks()
    BLOCK_E, BLOCK_P = _chunk_blocks(E, blocks)
    num_progs = cdiv(P, blocks["PAIRS_PER_PROG"])
    cap = P if capacity is None else torch.sym_min(capacity, P)  # C >= T * k drops nothing
    hist = new_index_buffer((num_progs, E), torch.int32, device)
    bad = new_index_buffer((num_progs,), torch.int32, device)
    base = new_index_buffer((num_progs, E), torch.int64, device)
    offsets = new_index_buffer((E + 1,), torch.int64, device)
    kept = new_index_buffer((E,), torch.int64, device)
    summary = new_index_buffer((2,), torch.int64, device)
    if num_progs:
        _kernels._dispatch_hist_kernel[(num_progs,)](
            expert_ids,
            hist,
            bad,
            P,
            E,
            k,
            expert_ids.stride(0),
            expert_ids.stride(1),
            BLOCK_P=BLOCK_P,
            BLOCK_E=BLOCK_E,
            PAIRS_PER_PROG=blocks["PAIRS_PER_PROG"],
        )
    _kernels._dispatch_scan_kernel[(1,)](
        hist,
        bad,
        base,
        offsets,
        kept,
        summary,
        num_progs,
        E,
        cap,
        BLOCK_B=max(1, min(blocks["SCAN_BLOCK_B"], _SCAN_TILE_ELEMS // BLOCK_E)),
        BLOCK_E=BLOCK_E,
    )
    checked = _ids_checked_on_host(device, capacity)
    if checked:
        rows, nbad = summary.tolist()  # the one host read (see the module docstring)
        _check_ids_result(nbad, E)
    else:
        rows = P
    dest = new_index_buffer((T, k), torch.int64, device)
    if checked:
        src_token = new_index_buffer((rows,), torch.int64, device)
        src_pair = new_index_buffer((rows,), torch.int64, device)
    else:  # unchecked ids: rows a bad id leaves unwritten must read as "no source"
        src_token = torch.full((rows,), -1, dtype=torch.int64, device=device)
        src_pair = torch.full((rows,), -1, dtype=torch.int64, device=device)
    if num_progs:
        _kernels._dispatch_scatter_kernel[(num_progs,)](
            expert_ids,
            base,
            offsets,
            dest,
            src_token,
            src_pair,
            P,
            E,
            k,
            cap,
            expert_ids.stride(0),
            expert_ids.stride(1),
            BLOCK_P=BLOCK_P,
            BLOCK_E=BLOCK_E,
            PAIRS_PER_PROG=blocks["PAIRS_PER_PROG"],
        )
    return MoEDispatchPlan(
        offsets=offsets,
        tokens_per_expert=kept,
        dest=dest,
        source_token=src_token,
        source_pair=src_pair,
        num_dropped=P - rows,
        capacity=capacity,
        top_k=k,
        num_experts=E,
    )


def gather_rows(x_TH: torch.Tensor, src_R: torch.Tensor) -> torch.Tensor:
    """``x[src]`` as a new contiguous ``[R, H]`` buffer in x's dtype (zero rows where src < 0)."""
    R, H = src_R.shape[0], x_TH.shape[1]
    out = new_buffer((R, H), x_TH.dtype, x_TH.device)
    if R and H:
        b = _row_blocks()
        _kernels._gather_rows_kernel[(cdiv(R, b["BLOCK_R"]), cdiv(H, b["BLOCK_H"]))](
            x_TH, src_R, out, R, H, x_TH.stride(0), x_TH.stride(1), **b
        )
    return out


def gather_sum(src_RH: torch.Tensor, dest_TK: torch.Tensor, w_TK: torch.Tensor | None) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * src[dest[t, j]]`` over kept j, ``[T, H]`` in src's dtype."""
    T, k = dest_TK.shape
    H = src_RH.shape[1]
    out = new_buffer((T, H), src_RH.dtype, src_RH.device)
    if T and H:
        b = _row_blocks()
        w = w_TK if w_TK is not None else src_RH
        sw = (w_TK.stride(0), w_TK.stride(1)) if w_TK is not None else (0, 0)
        _kernels._gather_sum_kernel[(cdiv(T, b["BLOCK_R"]), cdiv(H, b["BLOCK_H"]))](
            src_RH,
            dest_TK,
            w,
            out,
            T,
            H,
            k,
            src_RH.stride(0),
            src_RH.stride(1),
            *sw,
            HAS_WEIGHTS=w_TK is not None,
            **b,
        )
    return out


def combine_dy(dout_TH: torch.Tensor, w_TK: torch.Tensor, src_pair_R: torch.Tensor, dtype) -> torch.Tensor:
    """``dy[r] = w[pair(r)] * dout[token(r)]``, ``[R, H]`` in ``dtype``."""
    R, H = src_pair_R.shape[0], dout_TH.shape[1]
    dy = new_buffer((R, H), dtype, dout_TH.device)
    if R and H:
        b = _row_blocks()
        _kernels._combine_dy_kernel[(cdiv(R, b["BLOCK_R"]), cdiv(H, b["BLOCK_H"]))](
            dout_TH,
            w_TK,
            src_pair_R,
            dy,
            R,
            H,
            w_TK.shape[1],
            dout_TH.stride(0),
            dout_TH.stride(1),
            w_TK.stride(0),
            w_TK.stride(1),
            **b,
        )
    return dy


def combine_dw(dout_TH: torch.Tensor, y_RH: torch.Tensor, dest_TK: torch.Tensor, dtype) -> torch.Tensor:
    """``dw[t, j] = <dout[t], y[dest[t, j]]>`` (0 for dropped pairs), ``[T, k]`` in ``dtype``."""
    T, k = dest_TK.shape
    H = dout_TH.shape[1]
    dw = new_buffer((T, k), dtype, dout_TH.device)
    if T and k:  # k = 0: nothing to write, and a 0-wide slot block does not compile
        b = _row_blocks()
        _kernels._combine_dw_kernel[(cdiv(T, b["BLOCK_R"]),)](
            dout_TH,
            y_RH,
            dest_TK,
            dw,
            T,
            H,
            k,
            dout_TH.stride(0),
            dout_TH.stride(1),
            y_RH.stride(0),
            y_RH.stride(1),
            BLOCK_K=next_power_of_2(k),
            **b,
        )
    return dw


class MoEDispatchFunction(torch.autograd.Function):
    """``x[source_token]`` forward, ``dx[t] = sum_j dx_grouped[dest[t, j]]`` backward (plan precomputed)."""

    @staticmethod
    def forward(ctx, x_TH, src_token_R, dest_TK):
        ctx.save_for_backward(dest_TK)
        return gather_rows(x_TH, src_token_R)

    @staticmethod
    @first_derivative_only("moe_dispatch", torch_path=True)
    def backward(ctx, dxg_RH):
        (dest_TK,) = ctx.saved_tensors
        return gather_sum(dxg_RH, dest_TK, None), None, None


class MoECombineFunction(torch.autograd.Function):
    """Weighted gather-sum forward; ``dy`` per grouped row and ``dweights`` per pair backward."""

    @staticmethod
    def forward(ctx, y_RH, w_TK, dest_TK, src_pair_R):
        ctx.save_for_backward(y_RH, w_TK, dest_TK, src_pair_R)
        return gather_sum(y_RH, dest_TK, w_TK)

    @staticmethod
    @first_derivative_only("moe_combine", torch_path=True)
    def backward(ctx, dout_TH):
        y_RH, w_TK, dest_TK, src_pair_R = ctx.saved_tensors
        dy = combine_dy(dout_TH, w_TK, src_pair_R, y_RH.dtype) if ctx.needs_input_grad[0] else None
        dw = combine_dw(dout_TH, y_RH, dest_TK, w_TK.dtype) if ctx.needs_input_grad[1] else None
        return dy, dw, None, None


# --- pure-PyTorch path (SMPTK_KERNELS=torch, or where Triton cannot run) --------------------------------


def _dispatch_torch(
    x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, capacity: int | None
) -> tuple[torch.Tensor, MoEDispatchPlan]:
    T, k = expert_ids.shape
    ids = expert_ids.reshape(-1).long()
    bad = int(((ids < 0) | (ids >= num_experts)).sum())
    _check_ids_result(bad, num_experts)
    P = ids.numel()
    order = torch.sort(ids, stable=True).indices  # pairs grouped by expert, pair order inside each
    counts = torch.bincount(ids, minlength=num_experts)
    first = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(ids)
    pos[order] = torch.arange(P, device=ids.device) - first[ids[order]]
    if capacity is None:
        keep = torch.ones_like(ids, dtype=torch.bool)
    else:  # C >= T * k drops nothing; the clamp keeps the C of a huge capacity factor an int64
        keep = pos < torch.sym_min(capacity, P)
    kept = torch.bincount(ids[keep], minlength=num_experts)
    offsets = torch.cat([kept.new_zeros(1), torch.cumsum(kept, 0)])
    dest = torch.where(keep, offsets[ids] + pos, -1).view(T, k)
    source_pair = order[keep[order]]
    source_token = source_pair // k
    plan = MoEDispatchPlan(
        offsets=offsets,
        tokens_per_expert=kept,
        dest=dest,
        source_token=source_token,
        source_pair=source_pair,
        num_dropped=P - source_pair.numel(),
        capacity=capacity,
        top_k=k,
        num_experts=num_experts,
    )
    return x[source_token], plan


def _dispatch_meta(
    x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, capacity: int | None
) -> tuple[torch.Tensor, MoEDispatchPlan]:
    """The shapes of a dispatch on meta tensors; R is an upper bound with a capacity (module docstring)."""
    T, k = expert_ids.shape
    P = T * k
    R = P if capacity is None else min(P, num_experts * capacity)
    index = torch.empty(R, dtype=torch.int64, device=x.device)
    plan = MoEDispatchPlan(
        offsets=torch.empty(num_experts + 1, dtype=torch.int64, device=x.device),
        tokens_per_expert=torch.empty(num_experts, dtype=torch.int64, device=x.device),
        dest=torch.empty(T, k, dtype=torch.int64, device=x.device),
        source_token=index,
        source_pair=torch.empty_like(index),
        num_dropped=P - R,
        capacity=capacity,
        top_k=k,
        num_experts=num_experts,
    )
    return x.index_select(0, index), plan


def _combine_torch(y: torch.Tensor, plan: MoEDispatchPlan, weights: torch.Tensor) -> torch.Tensor:
    T, H = plan.num_tokens, y.shape[1]
    w_rows = weights.reshape(-1)[plan.source_pair].float()
    out = torch.zeros(T, H, dtype=torch.float32, device=y.device)
    out = out.index_add(0, plan.source_token, y.float() * w_rows[:, None])
    return out.to(y.dtype)


# --- public entry points --------------------------------------------------------------------------------


def _check_int_count(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name}: expected >= {low}, got {value}")


def _triton_path(*tensors: torch.Tensor) -> bool:
    # No tl.dot in these kernels: bf16 runs under the interpreter too (see runtime.select_path).
    return runtime.select_path(*tensors, dot=False) == "triton"


def moe_dispatch(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    num_experts: int,
    *,
    capacity_factor: float | None = None,
) -> tuple[torch.Tensor, MoEDispatchPlan]:
    """Group the rows of ``x`` by expert: one row per kept (token, slot) pair, stable within each expert.

    Args:
        x: ``[T, H]`` float32, float16 or bfloat16, any strides.
        expert_ids: ``[T, k]`` int32 or int64 on x's device, ids in ``[0, num_experts)`` (from moe_route).
        num_experts: E >= 1.
        capacity_factor: None (keep every pair) or > 0: each expert keeps at most
            ``ceil(capacity_factor * T * k / E)`` pairs, the earliest ones (pair order ``t * k + j``).

    Returns:
        ``(x_grouped [R, H] in x's dtype, plan)``: expert e's rows are ``plan.offsets[e]:plan.offsets[e+1]``;
        see :class:`MoEDispatchPlan` and the module docstring for the worked example. Differentiable in x
        (the backward sums each token's rows). With a capacity the call reads 16 bytes back to size
        ``x_grouped`` (one host sync); without one it reads nothing back on CUDA. On meta tensors with a
        capacity, R is the bound ``min(T * k, E * C)`` (the ids have no values to count).

    Example::

        >>> x = torch.arange(8.0).view(4, 2)
        >>> x_grouped, plan = moe_dispatch(x, torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0]]), 3)
        >>> plan.offsets.tolist(), plan.source_token.tolist()
        ([0, 3, 5, 8], [0, 2, 3, 1, 2, 0, 1, 3])
        >>> x_grouped[:3].tolist()  # expert 0's rows: tokens 0, 2, 3
        [[0.0, 1.0], [4.0, 5.0], [6.0, 7.0]]
    """
    check_float_tensor("x", x)
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [T, H] tensor, got shape {tuple(x.shape)}")
    if not isinstance(expert_ids, torch.Tensor):
        raise TypeError(f"expert_ids: expected a torch.Tensor, got {type(expert_ids).__name__}")
    if expert_ids.dtype not in INDEX_DTYPES:
        raise TypeError(f"expert_ids: dtype {expert_ids.dtype} is not supported; expected int32 or int64")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"expert_ids: expected shape [T, k] = [{x.shape[0]}, k] to match x's T, "
            f"got {tuple(expert_ids.shape)}"
        )
    if expert_ids.device != x.device:
        raise ValueError(f"expert_ids: on {expert_ids.device} but x is on {x.device}")
    _check_int_count("num_experts", num_experts, 1)
    capacity_factor = check_capacity_factor(capacity_factor)
    T, k = expert_ids.shape
    capacity = capacity_of(capacity_factor, T, k, num_experts)
    if x.device.type == "meta":
        return _dispatch_meta(x, expert_ids, num_experts, capacity)
    if not _triton_path(x, expert_ids):
        return _dispatch_torch(x, expert_ids, num_experts, capacity)
    return _dispatch_triton(x, expert_ids, num_experts, capacity)


@outside_graphs  # torch.compile: a graph break, then the Triton launches as in eager (see _dispatch)
def _dispatch_triton(x, expert_ids, num_experts: int, capacity: int | None):
    plan = dispatch_plan(expert_ids, num_experts, capacity)
    return MoEDispatchFunction.apply(x, plan.source_token, plan.dest), plan


def moe_combine(y: torch.Tensor, plan: MoEDispatchPlan, weights: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`moe_dispatch`: ``out[t] = sum_j weights[t, j] * y[plan.dest[t, j]]`` over kept pairs.

    Args:
        y: ``[R, H]`` float32, float16 or bfloat16, rows in ``x_grouped``'s order (R = ``plan.num_rows``).
        plan: the :class:`MoEDispatchPlan` of the dispatch.
        weights: ``[T, k]`` any supported float dtype (moe_route's fp32 weights), on y's device.

    Returns:
        ``[T, H]`` in y's dtype (fp32 accumulation over the k slots, one rounding); a token whose pairs were
        all dropped gets a zero row. Differentiable in y and weights.

    Example::

        >>> x = torch.arange(8.0).view(4, 2)
        >>> x_grouped, plan = moe_dispatch(x, torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0]]), 3)
        >>> moe_combine(x_grouped, plan, torch.full((4, 2), 0.5)).equal(x)
        True
    """
    if not isinstance(plan, MoEDispatchPlan):
        raise TypeError(f"plan: expected the MoEDispatchPlan from moe_dispatch, got {type(plan).__name__}")
    check_float_tensor("y", y)
    if y.dim() != 2 or y.shape[0] != plan.num_rows:
        raise ValueError(
            f"y: expected shape [R, H] with R = plan.num_rows = {plan.num_rows}, got {tuple(y.shape)}"
        )
    if y.device != plan.dest.device:
        raise ValueError(f"y: on {y.device} but the plan is on {plan.dest.device}")
    check_float_tensor("weights", weights)
    if weights.device != y.device:
        raise ValueError(f"weights: on {weights.device} but y is on {y.device}")
    if tuple(weights.shape) != tuple(plan.dest.shape):
        raise ValueError(
            f"weights: expected shape [T, k] = {tuple(plan.dest.shape)} (the plan's), "
            f"got {tuple(weights.shape)}"
        )
    if not _triton_path(y, weights):
        return _combine_torch(y, plan, weights)
    return _combine_triton(y, weights, plan.dest, plan.source_pair)


@outside_graphs  # torch.compile: a graph break, then the Triton launch as in eager (see _dispatch)
def _combine_triton(y, weights, dest, source_pair):
    return MoECombineFunction.apply(y, weights, dest, source_pair)
