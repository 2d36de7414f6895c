"""The tensor-parallel MLP pair under torchrun: smptk's fused and unfused layers, torch DTensor, async TP.

Run from the checkout root (rank 0 appends one JSON row per case to ``--jsonl``; see :mod:`bench.rows`)::

    torchrun --standalone --nproc-per-node 8 -m bench.tp_dist --jsonl out.jsonl
    torchrun --standalone --nproc-per-node 2 -m bench.tp_dist --quick --device cpu --jsonl out.jsonl

``python -m bench`` runs it through bench/test_bench_tp_dist.py via :func:`launch`. Exit status: 0, or 1
when a correctness check failed or an implementation raised (its "failed" row is written first).

What is timed: the forward of a Llama-shaped MLP's tensor-parallel pair, ``y = gelu(x @ W1.T) @ W2.T``
(no bias), column-parallel ``W1 [F, H]`` (``Shard(0)``) then row-parallel ``W2 [H, F]`` (``Shard(1)``),
tensor-parallel size T = the world (every rank of the torchrun), under ``torch.no_grad()``. GELU stands for
the MLP's nonlinearity because smptk's fused all-gather GEMM takes an epilogue activation and no SwiGLU
pair; a SwiGLU MLP would need two column GEMMs. Shapes (``shape`` in the rows; S tokens in all, H hidden,
F the MLP width): measure mode S=8192 (one sequence of 8192), H=8192, F=28672 (Llama-3-70B's MLP), bf16;
quick mode on a GPU S=128*T, H=256, F=128*T, bf16; on a CPU S=6*T, H=20, F=12*T in fp32 (the Triton
interpreter's ``tl.dot`` is wrong for bf16, and fp32 keeps the check tight). Shapes that T does not divide
give a skipped row.

Configs (``config``): "sp" (sequence parallelism: rank r holds token block r, ``[S/T, H]``, and gets its
block of ``y`` back: all-gather before the column GEMM, reduce-scatter after the row GEMM) and "no_sp"
(``x [S, H]`` replicated on every rank, ``y`` all-reduced). Implementations (``impl``):

- ``smptk_fused``: :class:`smptk.parallel.ColumnParallelLinear` (``activation="gelu"``) and
  :class:`~smptk.parallel.RowParallelLinear` with ``sequence_parallel=True, sequence_dim=0`` (``x`` 2-D
  ``[S/T, H]``): the column layer runs :func:`smptk.comm.fused_linear.all_gather_linear`, one Triton kernel
  that all-gathers the blocks through the symmetric heap within ``comm_max_sms`` SMs while its GEMM tiles
  start; the row layer runs :func:`smptk.comm.fused_linear.linear_reduce_scatter`, one Triton kernel whose
  GEMM epilogue stores each tile into its owner's heap slot, summed there by ``comm_max_sms`` programs.
  ``path`` is "fused" when both layers fused (else "unfused", ``path_reason`` naming the layers' own
  ``last_fused_reason``); ``column_path`` / ``row_path`` are each layer's ``last_path``. "no_sp" has
  nothing to fuse: a skipped row.
- ``smptk_unfused``: the same layers with ``sequence_dim=1`` and ``x`` as ``[1, S/T, H]``: the layers have
  no switch that forces the unfused path, and sequence dim 1 always takes it (smptk's all-gather, then the
  GEMM; the data layout is the same as dim 0's when the batch is 1). "no_sp": the layers without
  sequence parallelism (local GEMM, then smptk's all-reduce).
- ``torch_dtensor``: ``nn.Sequential(Linear, GELU, Linear)`` through ``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel`` (for "sp": ``input_layouts=Shard(0)`` on the column and
  ``output_layouts=Shard(0)`` on the row, the SequenceParallel layouts): torch's non-overlapped path
  (all-gather, then cuBLAS; cuBLAS, then reduce-scatter; NCCL on GPUs, gloo on a CPU).
- ``torch_async_tp``: ``torch.ops.symm_mem.fused_all_gather_matmul`` (column) then GELU then
  ``torch.ops.symm_mem.fused_matmul_reduce_scatter`` (row): torch's async TP, micro-pipelined over
  symmetric memory (both ops exist in torch 2.11 and 2.13, with CUDA kernels only). "sp" on CUDA with
  >= 2 ranks only; elsewhere a skipped row says why.

Every case is checked before it is timed: each rank's output against its block of the fp32 reference
``gelu(x @ W1.T) @ W2.T`` computed from the same full tensors (every rank draws ``x``, ``W1``, ``W2`` from
one seed and keeps its shard), within :func:`smptk.testing.tolerances.tolerance` for ``dtype`` with
reduction length H + F and ``2 + T`` roundings (the stored pre-activation or GELU output, and the partial
sums the reduction adds in ``dtype``), scaled by the root-sum-square of the second GEMM's terms plus the
first GEMM's error carried through GELU's slope (:func:`reference`). A case that fails gets a "failed" row
and is not timed.

Timing (``bench.comm_dist``'s timer): per rank, CUDA events around ``iters_per_round`` back-to-back
forwards after a barrier (the host clock on a CPU); per round the max over ranks; ``time_s`` is
:func:`bench.timing.summarize` over rounds.
The L2 is not flushed: the pair's weights and activations (hundreds of MiB a rank at the measure shape)
exceed it. ``flops`` = 4 S H F / T (one GPU's share of the pair's FLOPs, as in bench/test_bench_tp_sim.py)
and ``tflops`` = flops / median; ``flops_total`` and ``tflops_total``: all ranks'. smptk rows record
``comm_max_sms`` (``smptk.parallel.init``'s ``comm_max_sms``; torch's rows have None: NCCL and
symmetric-memory copies pick their own SMs) and ``comm_settings``.

World: T = every rank of the torchrun. With one rank every case is a skipped row (a TP pair at T=1 has no
communication to fuse or overlap); the rows are never multi-GPU numbers faked on one GPU (the
single-GPU "simulated world" of the pair is bench/test_bench_tp_sim.py, labeled as such). Rows measured
on a CPU carry :data:`bench.config.CPU_NOTE`: functional numbers, not GPU results.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.comm_dist import Launch, _timed
from bench.comm_dist import launch as comm_dist_launch
from bench.config import CPU_NOTE, GPU_QUICK_NOTE
from bench.rows import RowWriter, base_row
from bench.timing import summarize

SUITE = "tp_dist"
OP = "tp_mlp_pair"
ACTIVATION = "gelu"
IMPLS = ("smptk_fused", "smptk_unfused", "torch_dtensor", "torch_async_tp")
CONFIGS = ("sp", "no_sp")
MEASURE_SHAPE = {"S": 8192, "H": 8192, "F": 28672}  # one 8k sequence through Llama-3-70B's MLP
DEFAULT_COMM_MAX_SMS = 8  # the target budget
ITERS = {"measure": 10, "quick": 1}  # forwards per timed round (measure: ~1.5 ms each at T=8, estimated)
GELU_MAX_SLOPE = 1.13  # max of GELU's derivative (1.1289 at z = 1.4142...): how far an error in z reaches y
NEEDS_RANKS = (
    "needs >= 2 ranks (GPUs): a tensor-parallel pair at T=1 has no communication to fuse or overlap; "
    "the single-GPU simulated world of the pair is bench/test_bench_tp_sim.py"
)
NO_FUSION_WITHOUT_SP = (
    "no sequence parallelism: no all-gather to fuse (the column GEMM is local, the row output is "
    "all-reduced), so this is the smptk_unfused case"
)


# ----------------------------------------------------------------------------- pure helpers (unit tested)
def shape_for(mode: str, device: str, world: int) -> dict[str, int]:
    """The pair's ``{"S", "H", "F"}`` for a run: measure (Llama-3-70B MLP), quick on CUDA, or the CPU's.

    Raises ``ValueError`` naming the numbers when T = ``world`` does not divide S or F.

    Example::

        >>> shape_for("quick", "cpu", 2)
        {'S': 12, 'H': 20, 'F': 24}
    """
    if mode not in ("measure", "quick"):
        raise ValueError(f"mode: expected 'measure' or 'quick', got {mode!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world: expected a positive int, got {world!r}")
    if mode == "measure":
        shape = dict(MEASURE_SHAPE)
    elif device == "cuda":
        shape = {"S": 128 * world, "H": 256, "F": 128 * world}
    else:
        shape = {"S": 6 * world, "H": 20, "F": 12 * world}
    for key, what in (("S", "tokens"), ("F", "MLP width")):
        if shape[key] % world:
            raise ValueError(
                f"shape: {key}={shape[key]} ({what}) is not divisible by the tensor-parallel size {world}"
            )
    return shape


def pair_flops(shape: dict[str, int]) -> int:
    """FLOPs of the whole pair's forward, all ranks together: two GEMMs of 2 S H F each.

    >>> pair_flops({"S": 2, "H": 3, "F": 5})
    120
    """
    return 4 * shape["S"] * shape["H"] * shape["F"]


def async_tp_unavailable(device_type: str, world: int) -> str | None:
    """Why torch's async-TP ops cannot run here, or None when they can."""
    if device_type != "cuda":
        return (
            "CUDA only: torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter have "
            "CUDA kernels only (symmetric memory); this run is on a CPU"
        )
    if world < 2:
        return NEEDS_RANKS
    try:
        import torch.distributed._symmetric_memory as _symm  # defines the symm_mem ops

        del _symm
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory does not import: {exc}"
    ops = torch.ops.symm_mem
    missing = [n for n in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter") if not hasattr(ops, n)]
    return f"this torch has no torch.ops.symm_mem.{', '.join(missing)}" if missing else None


def make_row(
    kind: str, case: str, env: dict[str, Any], common: dict[str, Any], fields: dict[str, Any]
) -> dict:
    """One row: :func:`bench.rows.base_row` + the run's common fields + the case's fields.

    A "skipped" or "failed" row must say why (``reason``) and carries no timing.
    """
    if kind != "measurement" and not fields.get("reason"):
        raise ValueError(f"a {kind!r} row needs a reason")
    row = base_row(kind, f"bench/tp_dist.py::{case}", env)
    row.update(common)
    row["suite"] = SUITE
    row.update(fields)
    return row


def reference(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype, world: int
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """fp32 ``gelu(x @ W1.T) @ W2.T`` ``[S, H]``, its error scale ``[S, H]`` and the tolerance.

    Scale: ``sqrt((h^2 + (1.13 s1)^2) @ (W2^2).T)`` with ``h`` the reference GELU output and ``s1 =
    sqrt(x^2 @ (W1^2).T)`` the first GEMM's root-sum-square (its error reaches ``h`` times GELU's slope,
    at most 1.13). Tolerance: ``tolerance(dtype, H + F, 2 + world)`` (module docstring).
    """
    from smptk.testing.references import gelu
    from smptk.testing.tolerances import tolerance

    x32, w1_32, w2_32 = x.float(), w1.float(), w2.float()
    h = gelu(x32 @ w1_32.T)
    s1 = (x32.square() @ w1_32.square().T).sqrt()
    scale = ((h.square() + (GELU_MAX_SLOPE * s1).square()) @ w2_32.square().T).sqrt()
    return h @ w2_32.T, scale, tolerance(dtype, x.shape[1] + w1.shape[0], 2 + world)


# ----------------------------------------------------------------------------- run context and timing
@dataclasses.dataclass
class Ctx:
    """What every case needs: mode, device, ranks, rounds, and where rows go (rank 0 only).

    ``bench.comm_dist._timed`` reads its ``cuda``, ``device``, ``local_rank``, ``rounds`` and ``warmup``.
    """

    quick: bool
    device: torch.device
    backend: str
    dtype: torch.dtype
    rounds: int
    warmup: int
    rank: int
    world: int
    local_rank: int
    comm_max_sms: int
    writer: RowWriter | None
    env: dict[str, Any]
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def mode(self) -> str:
        return "quick" if self.quick else "measure"

    @property
    def note(self) -> str | None:
        if not self.cuda:
            return CPU_NOTE
        return GPU_QUICK_NOTE if self.quick else None

    @property
    def world_mode(self) -> str:
        if self.cuda:
            return f"real world: {self.world} processes under torchrun, one GPU each, {self.backend}"
        return f"real world: {self.world} CPU processes under torchrun, gloo + a shared-memory heap"

    def emit(self, kind: str, case: str, **fields: Any) -> None:
        """Write a row from rank 0 (other ranks return at once)."""
        if self.rank != 0 or self.writer is None:
            return
        common = {
            "mode": self.mode,
            "device": self.device.type,
            "backend": self.backend,
            "world_size": self.world,
            "world_mode": self.world_mode,
            "note": self.note,
        }
        self.writer.write(make_row(kind, case, self.env, common, fields))

    def fail(self, case: str, reason: str, **fields: Any) -> None:
        self.failures.append(f"{case}: {reason.splitlines()[-1] if reason else reason}")
        self.emit("failed", case, reason=reason, **fields)


def _all_true(ctx: Ctx, flag: bool) -> bool:
    t = torch.tensor([int(flag)], dtype=torch.int32, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


# ----------------------------------------------------------------------------- the implementations
@dataclasses.dataclass
class Built:
    """One implementation, ready: ``run()`` is this rank's forward on its input, ``info()`` the row's
    path fields (read after a call)."""

    run: Callable[[], torch.Tensor]
    info: Callable[[], dict[str, Any]]


def _smptk(ctx: Ctx, state: Any, w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, sp: bool, fused: bool):
    import smptk.comm as comm
    import smptk.parallel as sp_mod

    mesh = state.submesh("tp")
    H, F = w1.shape[1], w1.shape[0]
    dim = 0 if fused else 1
    opts = {
        "sequence_parallel": sp,
        "sequence_dim": dim,
        "mesh": mesh,
        "device": ctx.device,
        "dtype": ctx.dtype,
    }
    col = sp_mod.ColumnParallelLinear(H, F, bias=False, activation=ACTIVATION, **opts)
    row = sp_mod.RowParallelLinear(F, H, bias=False, **opts)
    r, t = ctx.rank, ctx.world
    with torch.no_grad():
        col.weight.to_local().copy_(w1[r * F // t : (r + 1) * F // t])
        row.weight.to_local().copy_(w2[:, r * F // t : (r + 1) * F // t])
    inp = x if fused or not sp else x.unsqueeze(0)  # sequence dim 1: [1, S/T, H]

    def run() -> torch.Tensor:
        y = row(col(inp))
        return y if fused or not sp else y.squeeze(0)

    def info() -> dict[str, Any]:
        if not sp:
            reason = "sequence_parallel=False: column GEMM on the replicated input, row output all-reduced"
            row_path = "smptk all-reduce"
        elif fused:
            reasons = [
                f"{n}: {m.last_fused_reason}"
                for n, m in (("column", col), ("row", row))
                if m.last_fused_reason
            ]
            reason = "; ".join(reasons) or None
            row_path = row.last_path
        else:
            reason = "sequence_dim=1 layout: the layers take the unfused path there (no switch forces it)"
            row_path = "unfused: smptk reduce-scatter after the GEMM"
        return {
            "path": "fused" if fused and sp and col.last_path == row.last_path == "fused" else "unfused",
            "path_reason": reason,
            "column_path": col.last_path,
            "row_path": row_path,
            "kernel_path": col.last_kernel_path,
            "comm_path": comm.last_path(),
            "comm_max_sms": comm.settings()["max_sms"],
            "comm_settings": comm.settings(),
            "sequence_dim": dim,
        }

    return Built(run, info)


def _dtensor(ctx: Ctx, state: Any, w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, sp: bool) -> Built:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    H, F = w1.shape[1], w1.shape[0]
    model = torch.nn.Sequential(
        torch.nn.Linear(H, F, bias=False, device=ctx.device, dtype=ctx.dtype),
        torch.nn.GELU(),
        torch.nn.Linear(F, H, bias=False, device=ctx.device, dtype=ctx.dtype),
    )
    with torch.no_grad():
        model[0].weight.copy_(w1)
        model[2].weight.copy_(w2)
    if sp:
        plan = {"0": ColwiseParallel(input_layouts=Shard(0)), "2": RowwiseParallel(output_layouts=Shard(0))}
    else:
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    parallelize_module(model, state.submesh("tp"), plan)
    coll = f"{ctx.backend} " + ("all-gather / reduce-scatter" if sp else "all-reduce")
    fields = {
        "path": "dtensor",
        "path_reason": f"torch DTensor Colwise/RowwiseParallel: {coll} and the GEMMs one after the other",
        "column_path": "all-gather, then matmul" if sp else "matmul on the replicated input",
        "row_path": "matmul, then reduce-scatter" if sp else "matmul, then all-reduce",
        "kernel_path": "cuBLAS via torch" if ctx.cuda else "torch (CPU)",
        "comm_path": f"torch.distributed:{ctx.backend}",
        "comm_max_sms": None,
    }

    def run() -> torch.Tensor:
        # The row's reduce-scatter / all-reduce comes back as an AsyncCollectiveTensor: wait for it, so the
        # timed interval (and the check) holds the whole collective, as a consumer of y would.
        y = model(x)
        return y.wait() if isinstance(y, AsyncCollectiveTensor) else y

    return Built(run, lambda: dict(fields))


def _async_tp(ctx: Ctx, state: Any, w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> Built:
    import torch.distributed._symmetric_memory as symm_mem

    group = state.submesh("tp").get_group()
    name = group.group_name
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed on older torch; deprecated (a no-op warning) on newer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(name)
    F = w1.shape[0]
    r, t = ctx.rank, ctx.world
    b1 = w1[r * F // t : (r + 1) * F // t].T  # [H, F/T]
    b2 = w2[:, r * F // t : (r + 1) * F // t].contiguous().T  # [F/T, H]
    ops = torch.ops.symm_mem

    def run() -> torch.Tensor:
        _, (h,) = ops.fused_all_gather_matmul(x, [b1], 0, name)
        return ops.fused_matmul_reduce_scatter(torch.nn.functional.gelu(h), b2, "sum", 0, name)

    fields = {
        "path": "async_tp",
        "path_reason": "torch async TP: symmetric-memory all-gather / reduce-scatter micro-pipelined with "
        "the GEMM chunks (copies on a side stream)",
        "column_path": "torch.ops.symm_mem.fused_all_gather_matmul",
        "row_path": "torch.ops.symm_mem.fused_matmul_reduce_scatter",
        "kernel_path": "cuBLAS via torch",
        "comm_path": "torch symmetric memory",
        "comm_max_sms": None,
    }
    return Built(run, lambda: dict(fields))


# ----------------------------------------------------------------------------- the benchmark
def _data(ctx: Ctx, shape: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full ``x [S, H]``, ``W1 [F, H]``, ``W2 [H, F]`` in ``ctx.dtype``, equal on every rank (one seed)."""
    S, H, F = shape["S"], shape["H"], shape["F"]
    gen = torch.Generator(device=ctx.device).manual_seed(20261124)

    def draw(*size: int, fan_in: int = 1) -> torch.Tensor:
        t = torch.randn(*size, generator=gen, device=ctx.device, dtype=torch.float32) / math.sqrt(fan_in)
        return t.to(ctx.dtype)

    return draw(S, H), draw(F, H, fan_in=H), draw(H, F, fan_in=F)


def _check(
    ctx: Ctx, y: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor, tol: Any
) -> dict[str, Any]:
    """This rank's output vs its block of the reference; the verdict is agreed over the ranks."""
    err = (y.float() - expected).abs() if y.shape == expected.shape else None
    bound = tol.bound(expected, scale) if err is not None else None
    ok = err is not None and bool(torch.isfinite(y).all()) and bool((err <= bound).all())
    worst = (err / bound).max().item() if err is not None else float("inf")
    stats = torch.tensor([worst, err.max().item() if err is not None else float("inf")], dtype=torch.float64)
    stats = stats.to(ctx.device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    passed = _all_true(ctx, ok)
    return {
        "reference": "fp32 gelu(x @ W1.T) @ W2.T of the full tensors (smptk.testing)",
        "passed": passed,
        "max_abs_err": stats[1].item(),
        "worst_err_over_tol": stats[0].item(),
        "ref_max_abs": expected.abs().max().item(),
        "tol": tol.describe(),
        "shape_ok": y.shape == expected.shape,
    }


def run_config(ctx: Ctx, state: Any, shape: dict[str, int], config: str, impls: Sequence[str]) -> None:
    """Check, then time, every implementation of one config ("sp" / "no_sp")."""
    sp = config == "sp"
    x, w1, w2 = _data(ctx, shape)
    S, r, t = shape["S"], ctx.rank, ctx.world
    full, scale, tol = reference(x, w1, w2, ctx.dtype, t)
    block = slice(r * S // t, (r + 1) * S // t) if sp else slice(0, S)
    x_in, expected, scale = x[block].contiguous(), full[block], scale[block]
    del full
    flops = pair_flops(shape)
    desc = {
        "op": OP,
        "activation": ACTIVATION,
        "bias": False,
        "pass": "fwd",
        "config": config,
        "sequence_parallel": sp,
        "world": t,
        "tp": t,
        "shape": dict(shape),
        "dtype": str(ctx.dtype).removeprefix("torch."),
        "flops": flops // t,  # one rank's share, as every suite's flops is what the timed device does
        "flops_total": flops,
    }
    iters = ITERS[ctx.mode]
    for impl in impls:
        case = f"{impl}-{config}-S{shape['S']}-H{shape['H']}-F{shape['F']}-tp{t}"
        fields = {**desc, "impl": impl}
        if impl == "smptk_fused" and not sp:
            ctx.emit("skipped", case, reason=NO_FUSION_WITHOUT_SP, **fields)
            continue
        if impl == "torch_async_tp":
            why = async_tp_unavailable(ctx.device.type, t)
            if why is None and not sp:
                why = (
                    "async TP fuses the sequence-parallel all-gather / reduce-scatter; without SP it has none"
                )
            if why:
                ctx.emit("skipped", case, reason=why, **fields)
                continue
        try:
            if impl.startswith("smptk"):
                built = _smptk(ctx, state, w1, w2, x_in, sp, fused=impl == "smptk_fused")
            elif impl == "torch_dtensor":
                built = _dtensor(ctx, state, w1, w2, x_in, sp)
            else:
                built = _async_tp(ctx, state, w1, w2, x_in)
            with torch.no_grad():
                t0 = time.perf_counter()
                y = built.run()
                if ctx.cuda:
                    torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                info = built.info()
                check = _check(ctx, y, expected, scale, tol)
                del y
                if not check["passed"]:
                    reason = "output differs from the fp32 reference beyond the tolerance: not timed"
                    ctx.fail(case, reason, check=check, **fields, **info)
                    continue
                per_round = _timed(ctx, built.run, iters)
        except Exception:
            ctx.fail(case, traceback.format_exc()[-2000:], **fields)
            continue
        median = summarize(per_round)["median"]
        ctx.emit(
            "measurement",
            case,
            **fields,
            **info,
            check=check,
            first_call_s=first_s,
            time_s=summarize(per_round),
            rounds=len(per_round),
            warmup_rounds=ctx.warmup,
            iters_per_round=iters,
            timer="cuda_event" if ctx.cuda else "host",
            timing="per round: max over ranks of the mean forward time; time_s: statistics over rounds",
            l2_flush_bytes=0,
            tflops=flops / t / median / 1e12,
            tflops_total=flops / median / 1e12,
        )
        del built


# ----------------------------------------------------------------------------- launcher and main
def launch(nproc: int, args: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None) -> Launch:
    """``python -m torch.distributed.run --standalone --nproc-per-node nproc -m bench.tp_dist *args``.

    Runs from the checkout root with it on ``PYTHONPATH``; at ``timeout_s`` torchrun gets SIGTERM, and
    after a grace period what is left of torchrun and its ranks gets SIGKILL, by process id (as
    :func:`bench.comm_dist.launch`).

    Example::

        >>> done = launch(2, ["--quick", "--device", "cpu", "--jsonl", "/tmp/rows.jsonl"], timeout_s=120)
        >>> done.returncode, done.timed_out
        (0, False)
    """
    return comm_dist_launch(nproc, args, timeout_s=timeout_s, env=env, module="bench.tp_dist")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun ... -m bench.tp_dist", description=__doc__.split("\n")[0])
    p.add_argument("--jsonl", type=Path, required=True, help="rows are appended here (rank 0)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few rounds (always on a CPU)")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu: gloo + interpreter")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {IMPLS}")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (measure 20, quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up rounds (measure 3, quick 1)")
    p.add_argument(
        "--comm-max-sms", type=int, default=DEFAULT_COMM_MAX_SMS, help="smptk's comm_max_sms (default 8)"
    )
    return p


def _subset(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    items = [p.strip() for p in text.split(",") if p.strip()]
    if not items or any(p not in allowed for p in items):
        raise SystemExit(f"{option}: expected a comma-separated subset of {allowed}, got {text!r}")
    return items


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected configs and implementations on every rank; 0 when every case passed, else 1."""
    args = _parser().parse_args(argv)
    configs = _subset(args.configs, CONFIGS, "--configs")
    impls = _subset(args.impls, IMPLS, "--impls")
    if args.comm_max_sms < 1:
        raise SystemExit(f"--comm-max-sms: expected an SM count >= 1, got {args.comm_max_sms}")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if name not in os.environ:
            raise SystemExit(f"bench.tp_dist: {name} is not set; launch with torchrun (see the docstring)")
    cuda = torch.cuda.is_available() and args.device == "auto"
    if not cuda:
        if "smptk.kernels" in sys.modules:
            raise SystemExit("bench.tp_dist: smptk.kernels was imported before TRITON_INTERPRET was set")
        os.environ["TRITON_INTERPRET"] = "1"  # before smptk.kernels is imported: the CPU heap needs it
        torch.set_num_threads(1)
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    warnings.filterwarnings(
        "ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
    )
    quick = args.quick or not cuda
    dist.init_process_group("nccl" if cuda else "gloo")
    ctx = None
    try:
        import smptk.parallel as sp_mod

        env: dict[str, Any] = {}
        if dist.get_rank() == 0:
            from smptk._env import collect_environment

            env = collect_environment()
        ctx = Ctx(
            quick=quick,
            device=torch.device("cuda", local_rank) if cuda else torch.device("cpu"),
            backend="nccl" if cuda else "gloo",
            dtype=torch.bfloat16 if cuda else torch.float32,
            rounds=args.rounds or (2 if quick else 20),
            warmup=args.warmup if args.warmup is not None else (1 if quick else 3),
            rank=dist.get_rank(),
            world=dist.get_world_size(),
            local_rank=local_rank,
            comm_max_sms=args.comm_max_sms,
            writer=RowWriter(args.jsonl) if dist.get_rank() == 0 else None,
            env=env,
        )
        if ctx.world < 2:
            for config in configs:
                for impl in impls:
                    ctx.emit(
                        "skipped", f"{impl}-{config}", impl=impl, config=config, op=OP, reason=NEEDS_RANKS
                    )
            return 0
        try:
            shape = shape_for(ctx.mode, ctx.device.type, ctx.world)
        except ValueError as exc:
            for config in configs:
                ctx.emit("skipped", f"all-{config}", op=OP, config=config, world=ctx.world, reason=str(exc))
            return 0
        state = sp_mod.init(
            {"tensor_parallel_degree": ctx.world, "comm_max_sms": ctx.comm_max_sms},
            device_type=ctx.device.type,
        )
        for config in configs:
            t0 = time.perf_counter()
            run_config(ctx, state, shape, config, impls)
            if ctx.rank == 0:
                print(f"bench.tp_dist: {config} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        dist.barrier()  # before the exit (README: "Ending a job"); not after an error
    finally:
        if "smptk.comm" in sys.modules:
            sys.modules["smptk.comm"].reset()
        dist.destroy_process_group()
    if ctx.failures:
        print("bench.tp_dist: checks failed:\n  " + "\n  ".join(ctx.failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
