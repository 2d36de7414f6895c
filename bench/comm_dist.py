"""Multi-process comm benchmarks under torchrun: smptk vs torch.distributed on real ranks.

Run from the checkout root (rank 0 appends one JSON row per case to ``--jsonl``; see :mod:`bench.rows`)::

    torchrun --standalone --nproc-per-node 8 -m bench.comm_dist --jsonl out.jsonl
    torchrun --standalone --nproc-per-node 2 -m bench.comm_dist --quick --jsonl out.jsonl --parts ddp

Options: ``--parts``, ``--quick``, ``--device cpu`` (gloo + interpreter even where CUDA exists),
``--rounds`` / ``--warmup``, ``--max-sms`` (the SM budgets). ``python -m bench`` runs it through
bench/test_bench_comm_dist.py, one torchrun per part, via :func:`launch` (which kills torchrun and its
ranks at a time limit). Exit status: 0, or 1 when a correctness check failed (its rows are written
first), or a rank's exception.

Every row says what it is: ``world_mode`` ("real world: N processes under torchrun..."; these rows are
never from the simulated world of bench/test_bench_comm.py), ``device``, ``backend``, ``mode`` and
``note`` (:data:`bench.config.CPU_NOTE` on a CPU: functional numbers, not GPU results).

Parts (``--parts``, comma-separated; default all):

- **bandwidth** (suite ``comm_dist_bandwidth``): smptk's all_reduce (one-shot and two-shot, via
  ``algorithm=``), all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single at every SM budget
  ``max_sms`` in 1, 2, 4, 8, 16, 32, plus 0 = ``algorithm="copy_engine"`` for all-gather and all-to-all
  (tensor copies of the peers' heap regions: no SM moves data; a one-CTA signal kernel runs twice per
  heap chunk), at sizes 1 MiB..1 GiB (x4 steps), bf16. Rows record ``ctas`` (the data-moving CTAs: our
  kernels launch exactly ``max_sms`` programs) and ``comm_path`` (what ran). Before timing, the first
  call's result is compared with torch.distributed's on the same input: the inputs are integers in
  [-8, 8], so every sum is exact in bf16 and the two must be *equal*; output buffers start as NaN so
  unwritten memory fails. A case that differs gets a "failed" row and is not timed; the program then
  exits 1.
- **nccl** (``comm_dist_nccl``): the same four collectives through torch.distributed with the group's
  backend (NCCL on GPUs, gloo on a CPU): the default communicator, and one communicator per NCCL
  max-CTAs value equal to our SM budgets (``ProcessGroupNCCL.Options().config.max_ctas``; NCCL reads
  ``NCCL_MAX_CTAS`` once per process, so a per-communicator config is the only way to sweep it in one
  run). Where this torch has no such option, the run's default communicator honours ``NCCL_MAX_CTAS``
  from the environment and its rows say so (``nccl_config``); bench/test_bench_comm_dist.py then starts
  one run per value. Each row records the CTAs NCCL really launched (``nccl_ctas_observed``: max and
  distinct grid x of the kernels named ``nccl*`` in a torch.profiler trace of 2 calls on rank 0), or
  ``nccl_ctas_note`` saying why not (on a CPU: not available, gloo launches no NCCL kernel).
- **interference** (``comm_dist_interference``): on every rank a bf16 8192^3 ``torch.matmul`` runs while
  a 64 MiB collective runs on a side stream (normal priority, as the DDP hook's): smptk's two-shot
  all-reduce at each SM budget, smptk's all-gather at each SM budget and at 0 (copy engine), and
  torch.distributed's all-reduce and all-gather (default communicator and per max-CTAs). The collective
  is timed alone first; then enough calls are enqueued to last ``COVER_FACTOR`` times the GEMMs' solo
  time, ahead of the GEMMs, and the row says whether the side stream really outlasted the GEMMs
  (``covered``). slowdown = GEMM time concurrent / GEMM time alone; smptk rows carry ``slowdown_bound``
  (:func:`bench.counts.gemm_slowdown_bound`: 1 + 1.2 k / SM count, 1.03 at k = 0) and ``bound_met``.
  On a CPU (no streams) the collectives run before the GEMMs, ``concurrency`` says "sequential", there is
  no bound, and only the budgets 0 and 1 run (each interpreted call takes 0.1-0.5 s): it proves the code
  runs, nothing more. The single-GPU version of this measurement, at every budget for all five
  collectives, is ``comm_interference`` in bench/test_bench_comm.py.
- **ddp** (``comm_dist_ddp``): a DDP step (forward, backward, SGD step) of 8 bias-free Linear(4096, 4096)
  bf16 layers, batch 4096 per rank, at world sizes 1..N (``dist.new_group(range(w))``; ranks >= w wait
  at a barrier), with DDP's default hook and with ``smptk.comm.adapters.ddp_comm_hook``. Rows: step time,
  samples/s = w * batch / step time, scaling efficiency = (samples/s at w) / (w * samples/s at world 1)
  of the same hook. Both hooks train identical copies on identical data; ``check`` compares their
  parameters afterwards (tolerance: 2 ulps of the largest parameter plus 1% of the largest update).

Definitions (nccl-tests, doc/PERFORMANCE.md): ``size_bytes`` is the all-reduce buffer, all-gather's
output, reduce-scatter's input, all-to-all's send buffer (rounded down to a multiple of world x element
size); algbw = size / time (GB/s, 1e9); busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n otherwise
(:func:`bench.counts.collective_counts`). Time: per rank, CUDA events around ``iters_per_round``
back-to-back calls (64 MiB of traffic per round, 1..100 calls) after a barrier; per round the max over
ranks (all_reduce MAX of the per-rank times); the row's ``time_s`` is :func:`bench.timing.summarize` over
rounds. All-reduces are timed in place on a zero buffer so repeated sums stay finite (the arithmetic
does not depend on the values).

Modes: **measure** on CUDA (NCCL backend, the shapes above). **quick** (``--quick``; always on a CPU, or
with ``--device cpu``): 4 KiB, max_sms {0 (copy engine), 1, 2}, 3 rounds; on a CPU the backend is gloo,
tensors live on the CPU and smptk's kernels run under ``TRITON_INTERPRET=1`` over a POSIX shared-memory
heap; the baseline is torch.distributed with gloo, everything NCCL-specific gets a "skipped" row or a
note with the reason, the interference GEMM is 128^3, the DDP model is 2 x Linear(32, 32) (fp32 on a
CPU, batch 8), and every row says ``bench.config.CPU_NOTE``.
With one rank only the ddp part runs (world 1); the others need >= 2 GPUs (on one GPU,
bench/test_bench_comm.py simulates the world).

This file is longer than the usual 600 lines: the four parts share the launcher, timer, checks and row
writer, and splitting them would scatter one torchrun program over several modules.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.config import CPU_NOTE, GPU_QUICK_NOTE
from bench.counts import collective_counts, gemm_slowdown_bound, kernel_code_fields
from bench.rows import RowWriter, base_row
from bench.timing import summarize

PARTS = ("bandwidth", "nccl", "interference", "ddp")
SUITES = {part: f"comm_dist_{part}" for part in PARTS}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
SMPTK_CASES = (
    ("all_reduce", "one_shot"),
    ("all_reduce", "two_shot"),
    ("all_gather", None),
    ("reduce_scatter", None),
    ("all_to_all", None),
)
MEASURE_SIZES = tuple((1 << 20) * 4**i for i in range(6))  # 1 MiB, 4 MiB, ..., 1 GiB
QUICK_SIZES = (4096,)
MEASURE_MAX_SMS = (1, 2, 4, 8, 16, 32)
QUICK_MAX_SMS = (1, 2)
# Collectives with algorithm="copy_engine": their SM budget 0 (no SM moves data) runs that algorithm.
COPY_ENGINE = ("all_gather", "all_to_all")
NCCL_MAX_CTAS = MEASURE_MAX_SMS  # NCCL capped to each of our SM budgets
ROUND_BYTES = 64 << 20  # traffic per timed round on a GPU; untuned, amortizes the event pair at 4 KiB
MAX_ITERS = 100
GEMM_N = {"measure": 8192, "quick": 1024, "cpu": 128}
GEMM_ITERS = {"measure": 20, "quick": 3, "cpu": 3}  # 20 x 8192^3 is about 30 ms on an H100 (~1.1 TFLOP each)
INTERFERENCE_BYTES = {"measure": 64 << 20, "quick": 4096}
INTERFERENCE_CASES = (("all_reduce", "two_shot"), ("all_gather", None))
CPU_INTERFERENCE_MAX_SMS = (1,)  # plus 0: interpreted calls take 0.1-0.5 s each on a CPU
COVER_FACTOR = 2.0  # side-stream work enqueued = 2x the GEMMs' solo time, so a 2x slowdown stays covered
MAX_COVER_CALLS = 5000
DDP_SHAPES = {"measure": (8, 4096, 4096), "quick": (2, 32, 8)}  # layers, hidden, batch per rank
DDP_LR = 1e-2
NEEDS_RANKS = (
    "needs >= 2 ranks (GPUs) and this run has 1; with one GPU see the simulated world in "
    "bench/test_bench_comm.py"
)
NO_NCCL = "no NCCL here: the CPU run uses gloo"
NCCL_CTAS_CPU = (
    "not available: gloo on a CPU launches no NCCL kernel (NCCL's CTA count is read from CUDA kernel "
    "events in a torch.profiler trace)"
)
KILL_GRACE_S = 45  # torchrun gives its ranks 30 s after SIGTERM before it kills them itself
NCCL_ENV = ("NCCL_MAX_CTAS", "NCCL_MIN_CTAS", "NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE")


# ----------------------------------------------------------------------------- pure helpers (unit tested)
def nccl_ctas_from_trace(trace: dict[str, Any]) -> dict[str, Any] | None:
    """NCCL's CTA counts in a torch.profiler chrome trace: grid x of every kernel event named ``nccl*``.

    Returns ``{"max", "distinct" (sorted), "kernels" (how many events)}``, or None when the trace holds
    no such kernel. CPU-side events named ``nccl:all_reduce`` have no grid and are ignored.

    Example::

        >>> kernel = {"cat": "kernel", "name": "ncclDevKernel_AllReduce_RING_LL", "args": {"grid": [8, 1, 1]}}
        >>> nccl_ctas_from_trace({"traceEvents": [kernel]})
        {'max': 8, 'distinct': [8], 'kernels': 1}
    """
    grids = []
    for event in trace.get("traceEvents") or []:
        if not isinstance(event, dict) or str(event.get("cat", "")).lower() != "kernel":
            continue
        name = event.get("name")
        grid = (event.get("args") or {}).get("grid")
        if isinstance(name, str) and name.startswith("nccl") and isinstance(grid, list) and grid:
            grids.append(int(grid[0]))
    if not grids:
        return None
    return {"max": max(grids), "distinct": sorted(set(grids)), "kernels": len(grids)}


def case_numels(collective: str, size_bytes: int, world: int, elem: int) -> tuple[int, int, int]:
    """(input numel, output numel, size in bytes) of a collective of nccl-tests size ``size_bytes``.

    The element count is rounded down to a multiple of ``world``, as nccl-tests does.

    Example::

        >>> case_numels("all_gather", 4096, 3, 2)  # 2048 elements -> 2046: 682 per rank in, 2046 out
        (682, 2046, 4092)
    """
    n = (size_bytes // elem) // world * world
    if n == 0:
        raise ValueError(f"size_bytes: {size_bytes} is less than world ({world}) x element size ({elem})")
    numels = {"all_reduce": (n, n), "all_gather": (n // world, n), "reduce_scatter": (n, n // world)}
    numels["all_to_all"] = (n, n)
    if collective not in numels:
        raise ValueError(f"collective: expected one of {COLLECTIVES}, got {collective!r}")
    return (*numels[collective], n * elem)


def bandwidth_fields(
    collective: str, algorithm: str | None, *, world: int, size_bytes: int, seconds: float, smptk: bool
) -> dict[str, Any]:
    """algbw / busbw (GB/s = 1e9 B/s) of one call of ``seconds``, nccl-tests' definitions.

    ``peer_bytes`` (what one rank of smptk's kernels reads from peers) is None for other implementations.

    Example::

        >>> bandwidth_fields("all_reduce", "two_shot", world=8, size_bytes=10**9, seconds=0.01, smptk=False)
        {'size_bytes': 1000000000, 'algbw_gbps': 100.0, 'busbw_gbps': 175.0, 'busbw_factor': 1.75, ...}
    """
    kind = f"all_reduce_{algorithm or 'two_shot'}" if collective == "all_reduce" else collective
    counts = collective_counts(kind, world=world, size_bytes=size_bytes)
    algbw = size_bytes / seconds / 1e9 if seconds > 0 else None
    return {
        "size_bytes": size_bytes,
        "algbw_gbps": algbw,
        "busbw_gbps": None if algbw is None else algbw * counts["busbw_factor"],
        "busbw_factor": counts["busbw_factor"],
        "peer_bytes": counts["peer_bytes"] if smptk else None,
    }


def sm_budgets(collective: str, max_sms: Sequence[int]) -> tuple[int, ...]:
    """The SM budgets a collective runs at: ``max_sms``, led by 0 (copy engine) where the op has it.

    Example::

        >>> sm_budgets("all_gather", (1, 2)), sm_budgets("reduce_scatter", (1, 2))
        ((0, 1, 2), (1, 2))
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"collective: expected one of {COLLECTIVES}, got {collective!r}")
    bad = [k for k in max_sms if isinstance(k, bool) or not isinstance(k, int) or k < 1]
    if bad:
        raise ValueError(f"max_sms: expected SM counts >= 1 (0 is added for the copy engine), got {bad}")
    return ((0,) if collective in COPY_ENGINE else ()) + tuple(max_sms)


def budget_label(max_sms: int) -> str:
    """``0`` -> ``copy_engine``, ``8`` -> ``sms8``: the budget as it appears in case ids."""
    return "copy_engine" if max_sms == 0 else f"sms{max_sms}"


def scaling_efficiency(step_s_world1: float, step_s: float) -> float:
    """Weak scaling at a fixed batch per rank: (samples/s at w) / (w x samples/s at world 1) = t1 / tw."""
    return step_s_world1 / step_s


def make_row(
    kind: str, part: str, case: str, env: dict[str, Any], common: dict[str, Any], fields: dict[str, Any]
) -> dict[str, Any]:
    """One row: :func:`bench.rows.base_row` + the run's common fields + the case's fields.

    A "skipped" or "failed" row must say why (``reason``) and carries no timing.
    """
    if part not in SUITES:
        raise ValueError(f"part: expected one of {PARTS}, got {part!r}")
    if kind != "measurement" and not fields.get("reason"):
        raise ValueError(f"a {kind!r} row needs a reason")
    row = base_row(kind, f"bench/comm_dist.py::{part}::{case}", env)
    row.update(common)
    row["suite"] = SUITES[part]
    row.update(fields)
    return row


# ----------------------------------------------------------------------------- run context and timing
@dataclasses.dataclass
class Ctx:
    """What every part needs: mode, device, ranks, shapes, and where rows go (rank 0 only)."""

    quick: bool
    device: torch.device
    backend: str
    dtype: torch.dtype
    sizes: tuple[int, ...]
    max_sms: tuple[int, ...]
    rounds: int
    warmup: int
    rank: int
    world: int
    local_rank: int
    writer: RowWriter | None
    env: dict[str, Any]
    failures: list[str] = dataclasses.field(default_factory=list)
    nccl_groups: dict[int, Any] = dataclasses.field(default_factory=dict)  # max_ctas -> communicator

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

    def emit(self, kind: str, part: str, case: str, **fields: Any) -> None:
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
        self.writer.write(make_row(kind, part, case, self.env, common, fields))

    def fail(self, part: str, case: str, reason: str, **fields: Any) -> None:
        self.failures.append(f"{part}::{case}: {reason}")
        self.emit("failed", part, case, reason=reason, **fields)


def _sync(ctx: Ctx, group: dist.ProcessGroup | None = None) -> None:
    """Every rank of ``group`` has finished its queued work and reached this point."""
    if ctx.cuda:
        torch.cuda.synchronize()
        dist.barrier(group=group, device_ids=[ctx.local_rank])
        torch.cuda.synchronize()
    else:
        dist.barrier(group=group)


def _round_s(ctx: Ctx, fn: Callable[[], object], iters: int, group: dist.ProcessGroup | None) -> float:
    """Seconds per call of ``iters`` back-to-back calls on this rank (CUDA events, or the host clock)."""
    _sync(ctx, group)
    if ctx.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _max_over_ranks(ctx: Ctx, values: Sequence[float], group: dist.ProcessGroup | None = None) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _timed(
    ctx: Ctx, fn: Callable[[], object], iters: int = 1, group: dist.ProcessGroup | None = None
) -> list[float]:
    """Per-round seconds per call, each the max over the ranks of ``group``, after the warm-up rounds."""
    for _ in range(ctx.warmup):
        _round_s(ctx, fn, iters, group)
    local = [_round_s(ctx, fn, iters, group) for _ in range(ctx.rounds)]
    return _max_over_ranks(ctx, local, group)


def _iters(ctx: Ctx, size_bytes: int) -> int:
    return max(1, min(MAX_ITERS, ROUND_BYTES // max(size_bytes, 1))) if ctx.cuda else 1


def _timing_fields(ctx: Ctx, per_round: list[float], iters: int) -> dict[str, Any]:
    return {
        "time_s": summarize(per_round),
        "rounds": len(per_round),
        "warmup_rounds": ctx.warmup,
        "iters_per_round": iters,
        "timer": "cuda_event" if ctx.cuda else "host",
        "timing": "per round: max over ranks of the mean call time; time_s: statistics over rounds",
    }


def _int_data(ctx: Ctx, numel: int, seed: int) -> torch.Tensor:
    """Integers in [-8, 8] as ``ctx.dtype``: sums over <= 32 ranks are exact in bf16."""
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    ints = torch.randint(-8, 9, (numel,), generator=gen, device=ctx.device, dtype=torch.int8)
    return ints.to(ctx.dtype)


def _smptk_call(
    collective: str, algorithm: str | None, inp: torch.Tensor, out: torch.Tensor, group: Any, max_sms: int
) -> Callable[[], object]:
    """smptk's ``collective`` at ``max_sms`` SMs; 0 = ``algorithm="copy_engine"`` (all-gather, all-to-all)."""
    import smptk.comm as comm

    if max_sms == 0:
        if collective not in COPY_ENGINE:
            raise ValueError(f"max_sms: 0 (copy engine) exists for {COPY_ENGINE}, not {collective!r}")
        if collective == "all_gather":
            return lambda: comm.all_gather_into_tensor(out, inp, group, algorithm="copy_engine")
        return lambda: comm.all_to_all_single(out, inp, group=group, algorithm="copy_engine")
    if collective == "all_reduce":
        return lambda: comm.all_reduce(out, group=group, max_sms=max_sms, algorithm=algorithm)
    if collective == "all_gather":
        return lambda: comm.all_gather_into_tensor(out, inp, group, max_sms=max_sms)
    if collective == "reduce_scatter":
        return lambda: comm.reduce_scatter_tensor(out, inp, group=group, max_sms=max_sms)
    return lambda: comm.all_to_all_single(out, inp, group=group, max_sms=max_sms)


def sm_use(max_sms: int) -> dict[str, Any]:
    """The SMs a smptk case occupies, by construction: ``ctas`` move data, ``signal_ctas`` only signal.

    Our kernels launch exactly ``max_sms`` programs; the copy engine (``max_sms`` 0) launches none that
    move data, and a one-program signal kernel twice per heap chunk.
    """
    if max_sms == 0:
        return {"ctas": 0, "signal_ctas": 1, "sm_use": "0 SMs move data (copy engine); 1-CTA signal kernel"}
    return {"ctas": max_sms, "signal_ctas": None, "sm_use": f"{max_sms} CTAs (max_sms)"}


def _torch_call(collective: str, inp: torch.Tensor, out: torch.Tensor, group: Any) -> Callable[[], object]:
    if collective == "all_reduce":
        return lambda: dist.all_reduce(out, group=group)
    if collective == "all_gather":
        return lambda: dist.all_gather_into_tensor(out, inp, group=group)
    if collective == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(out, inp, group=group)
    return lambda: dist.all_to_all_single(out, inp, group=group)


def _host_time(ctx: Ctx, fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    if ctx.cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- part: bandwidth
def _check_smptk(
    ctx: Ctx, collective: str, algorithm: str | None, inp: torch.Tensor, n_out: int, max_sms: int
) -> tuple[dict[str, Any], float, str | None]:
    """smptk's first call vs torch.distributed's on the same input: (check, first-call seconds, path)."""
    import smptk.comm as comm

    poison = float("nan")
    if collective == "all_reduce":
        mine, ref = inp.clone(), inp.clone()
    else:
        mine = torch.full((n_out,), poison, dtype=ctx.dtype, device=ctx.device)
        ref = torch.full((n_out,), poison, dtype=ctx.dtype, device=ctx.device)
    first_s = _host_time(ctx, _smptk_call(collective, algorithm, inp, mine, None, max_sms))
    path = comm.last_path()
    if ctx.cuda:
        comm.check()
    _torch_call(collective, inp, ref, None)()
    equal = bool(torch.equal(mine, ref))
    diff = 0.0 if equal else (mine.float() - ref.float()).abs().nan_to_num(nan=float("inf")).max().item()
    agree = torch.tensor([int(equal)], dtype=torch.int32, device=ctx.device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    check = {
        "reference": f"torch.distributed:{ctx.backend}",
        "exact_equal": bool(agree.item()),
        "max_abs_diff_rank0": diff,
        "inputs": "integers in [-8, 8]: exact in bf16, so equality is required",
    }
    return check, first_s, path


def part_bandwidth(ctx: Ctx) -> None:
    if ctx.world < 2:
        ctx.emit("skipped", "bandwidth", "all", impl="smptk", reason=NEEDS_RANKS)
        return
    import smptk.comm as comm

    elem = ctx.dtype.itemsize
    for si, size in enumerate(ctx.sizes):
        for ci, (collective, algorithm) in enumerate(SMPTK_CASES):
            n_in, n_out, nbytes = case_numels(collective, size, ctx.world, elem)
            inp = _int_data(ctx, n_in, seed=ctx.rank * 7919 + si * 31 + ci)
            op = f"all_reduce_{algorithm}" if algorithm else collective
            for k in sm_budgets(collective, ctx.max_sms):
                case = f"{op}-smptk-{budget_label(k)}-{nbytes}B"
                desc = {
                    "op": op,
                    "collective": collective,
                    "algorithm": "copy_engine" if k == 0 else algorithm,
                    "impl": "smptk",
                    "max_sms": k,
                    "world": ctx.world,
                    "dtype": str(ctx.dtype).removeprefix("torch."),
                    "size_bytes": nbytes,
                    **sm_use(k),
                }
                check, first_s, path = _check_smptk(ctx, collective, algorithm, inp, n_out, k)
                if not check["exact_equal"]:
                    reason = "smptk's first result differs from torch.distributed's: not timed"
                    ctx.fail("bandwidth", case, reason, check=check, **desc)
                    continue
                out = torch.zeros(n_out, dtype=ctx.dtype, device=ctx.device)
                iters = _iters(ctx, nbytes)
                per_round = _timed(ctx, _smptk_call(collective, algorithm, inp, out, None, k), iters)
                if ctx.cuda:
                    comm.check()
                median = summarize(per_round)["median"]
                bw = bandwidth_fields(
                    collective, algorithm, world=ctx.world, size_bytes=nbytes, seconds=median, smptk=True
                )
                extra = {"comm_path": path, "check": check, "first_call_s": first_s}
                extra["comm_settings"] = comm.settings()
                extra |= kernel_code_fields(op, k)
                ctx.emit(
                    "measurement",
                    "bandwidth",
                    case,
                    **(desc | bw | _timing_fields(ctx, per_round, iters) | extra),
                )
                del out
            del inp


# ----------------------------------------------------------------------------- part: nccl
def nccl_options_class() -> tuple[Any, str | None]:
    """(ProcessGroupNCCL.Options, None), or (None, why the max-CTAs config cannot be set).

    Needs no process group: the parent of the torchrun ranks asks too (bench/test_bench_comm_dist.py).
    """
    pg_nccl = getattr(dist, "ProcessGroupNCCL", None)
    options = getattr(pg_nccl, "Options", None)
    if options is None:
        return None, "this torch has no dist.ProcessGroupNCCL.Options (built without NCCL?)"
    if not hasattr(getattr(options(), "config", None), "max_ctas"):
        return None, "dist.ProcessGroupNCCL.Options().config has no max_ctas in this torch build"
    return options, None


def nccl_cap_plan(
    option_missing: str | None, env_max_ctas: str | None, caps: Sequence[int] = NCCL_MAX_CTAS
) -> tuple[list[tuple[str, int | None]], str | None]:
    """The NCCL communicators the nccl part times, as ``[(nccl_config label, max_ctas)]``, and why the
    max-CTAs sweep does not run (None when it does).

    The default communicator comes first: "default", or "NCCL_MAX_CTAS=k (env)" when the environment
    caps every communicator of the process. Then one "max_ctas=k" per cap, when
    ``ProcessGroupNCCL.Options().config.max_ctas`` exists (``option_missing`` is None); without it each
    cap needs a process of its own with ``NCCL_MAX_CTAS`` set: the reason says so, unless this process
    is one of those (the environment sets a cap).

    Example::

        >>> nccl_cap_plan(None, None, caps=(1, 8))
        ([('default', None), ('max_ctas=1', 1), ('max_ctas=8', 8)], None)
        >>> nccl_cap_plan("no max_ctas", "4", caps=(1, 8))[0]
        [('NCCL_MAX_CTAS=4 (env)', 4)]
    """
    env = (env_max_ctas or "").strip()
    plan: list[tuple[str, int | None]] = [
        (f"NCCL_MAX_CTAS={env} (env)", int(env) if env.isdigit() else None) if env else ("default", None)
    ]
    if option_missing is not None:
        if env:  # this process is one of those runs
            return plan, None
        return plan, (
            f"{option_missing}; NCCL reads NCCL_MAX_CTAS once per process, so each cap needs a run of "
            "its own with NCCL_MAX_CTAS=k set (bench/test_bench_comm_dist.py starts one per cap)"
        )
    return plan + [(f"max_ctas={c}", c) for c in caps], None


def _nccl_group(ctx: Ctx, options: Any, max_ctas: int) -> Any:
    """A communicator over all ranks whose NCCL config caps the CTAs at ``max_ctas`` (made once)."""
    if max_ctas not in ctx.nccl_groups:
        opts = options()
        opts.config.max_ctas = max_ctas
        ranks = list(range(ctx.world))
        ctx.nccl_groups[max_ctas] = dist.new_group(ranks, backend="nccl", pg_options=opts)
    return ctx.nccl_groups[max_ctas]


def _observe_nccl_ctas(ctx: Ctx, call: Callable[[], object], calls: int = 2) -> dict[str, Any]:
    """Run ``calls`` calls on every rank; rank 0 profiles them and reads NCCL's grid from the trace."""
    result: dict[str, Any] = {"nccl_ctas_observed": None, "nccl_ctas_note": None}
    prof = None
    if ctx.rank == 0:
        try:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.start()
        except Exception as exc:  # the calls below must still run: the peers are waiting in them
            prof, result["nccl_ctas_note"] = None, f"profiler did not start: {exc}"
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    if prof is not None:
        try:
            prof.stop()
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "trace.json"
                prof.export_chrome_trace(str(path))
                trace = json.loads(path.read_text())
            result["nccl_ctas_observed"] = nccl_ctas_from_trace(trace)
            if result["nccl_ctas_observed"] is None:
                result["nccl_ctas_note"] = "no kernel named nccl* with a grid in the profiler trace"
        except Exception as exc:
            result["nccl_ctas_note"] = f"profiler trace unusable: {exc}"
    return result


def part_nccl(ctx: Ctx) -> None:
    impl = f"torch.distributed:{ctx.backend}"
    if ctx.world < 2:
        ctx.emit("skipped", "nccl", "all", impl=impl, reason=NEEDS_RANKS)
        return
    configs: list[tuple[str | None, int | None, Any]] = []
    if not ctx.cuda:
        configs.append((None, None, None))
        ctx.emit("skipped", "nccl", "max_ctas_sweep", impl="torch.distributed:nccl", reason=NO_NCCL)
    else:
        options, why = nccl_options_class()
        plan, skip = nccl_cap_plan(why, os.environ.get("NCCL_MAX_CTAS"))
        if skip:
            ctx.emit("skipped", "nccl", "max_ctas_sweep", impl=impl, reason=skip)
        for label, cap in plan:
            group = _nccl_group(ctx, options, cap) if label.startswith("max_ctas=") else None
            configs.append((label, cap, group))
    elem = ctx.dtype.itemsize
    nccl_env = {name: os.environ.get(name) for name in NCCL_ENV}
    for label, max_ctas, group in configs:
        for si, size in enumerate(ctx.sizes):
            for ci, collective in enumerate(COLLECTIVES):
                n_in, n_out, nbytes = case_numels(collective, size, ctx.world, elem)
                inp = _int_data(ctx, n_in, seed=ctx.rank * 7919 + si * 31 + ci)
                out = torch.zeros(n_out, dtype=ctx.dtype, device=ctx.device)
                call = _torch_call(collective, inp, out, group)
                first_s = _host_time(ctx, call)
                iters = _iters(ctx, nbytes)
                per_round = _timed(ctx, call, iters)
                if ctx.cuda:
                    ctas = _observe_nccl_ctas(ctx, call)
                else:
                    ctas = {"nccl_ctas_observed": None, "nccl_ctas_note": NCCL_CTAS_CPU}
                median = summarize(per_round)["median"]
                ctx.emit(
                    "measurement",
                    "nccl",
                    f"{collective}-{impl}-{label or 'default'}-{nbytes}B",
                    op=collective,
                    collective=collective,
                    algorithm=None,
                    impl=impl,
                    max_sms=None,
                    nccl_config=label,
                    nccl_max_ctas=max_ctas,
                    world=ctx.world,
                    dtype=str(ctx.dtype).removeprefix("torch."),
                    **bandwidth_fields(
                        collective, None, world=ctx.world, size_bytes=nbytes, seconds=median, smptk=False
                    ),
                    **_timing_fields(ctx, per_round, iters),
                    **ctas,
                    first_call_s=first_s,
                    nccl_env_vars=nccl_env if ctx.backend == "nccl" else None,
                )
                del inp, out


# ----------------------------------------------------------------------------- part: interference
def _concurrent_round(
    ctx: Ctx, gemm: Callable[[], object], gemm_iters: int, coll: Callable[[], object], calls: int, side: Any
) -> tuple[float, bool | None]:
    """(seconds per GEMM while ``calls`` collectives run on ``side``, whether they outlasted the GEMMs).

    On a CPU (no streams) the collectives run first and the GEMMs after them; coverage is None.
    """
    _sync(ctx)
    if not ctx.cuda:
        for _ in range(calls):
            coll()
        t0 = time.perf_counter()
        for _ in range(gemm_iters):
            gemm()
        return (time.perf_counter() - t0) / gemm_iters, None
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    side_end = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        for _ in range(calls):
            coll()
        side_end.record()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(gemm_iters):
        gemm()
    end.record()
    end.synchronize()
    side_end.synchronize()
    gemm_ms = start.elapsed_time(end)
    return gemm_ms / 1e3 / gemm_iters, start.elapsed_time(side_end) >= gemm_ms


@dataclasses.dataclass
class _InterferenceCase:
    """One collective beside the GEMMs: smptk at an SM budget, or torch.distributed with a config."""

    impl: str
    collective: str
    algorithm: str | None
    max_sms: int | None
    nccl_config: str | None
    nccl_max_ctas: int | None
    call: Callable[[], object]

    @property
    def label(self) -> str:
        if self.max_sms is not None:
            return budget_label(self.max_sms)
        return (self.nccl_config or "default").replace(" ", "")


def _interference_cases(ctx: Ctx, nbytes: int) -> list[_InterferenceCase]:
    """smptk's two-shot all-reduce and all-gather at each budget (all-gather also at 0: copy engine),
    then torch.distributed's all-reduce and all-gather per communicator of :func:`nccl_cap_plan`."""
    budgets = ctx.max_sms if ctx.cuda else CPU_INTERFERENCE_MAX_SMS
    impl = f"torch.distributed:{ctx.backend}"
    plan: list[tuple[str | None, int | None]] = [(None, None)]
    options = None
    if ctx.cuda:
        options, why = nccl_options_class()
        plan = nccl_cap_plan(why, os.environ.get("NCCL_MAX_CTAS"))[0]
    cases = []
    for collective, algorithm in INTERFERENCE_CASES:
        n_in, n_out, _ = case_numels(collective, nbytes, ctx.world, 2)
        inp = torch.zeros(n_in, device=ctx.device, dtype=torch.bfloat16)
        out = (
            inp if collective == "all_reduce" else torch.zeros(n_out, device=ctx.device, dtype=torch.bfloat16)
        )
        for k in sm_budgets(collective, budgets):
            call = _smptk_call(collective, algorithm, inp, out, None, k)
            alg = "copy_engine" if k == 0 else algorithm
            cases.append(_InterferenceCase("smptk", collective, alg, k, None, None, call))
        for label, cap in plan:
            group = _nccl_group(ctx, options, cap) if label and label.startswith("max_ctas=") else None
            call = _torch_call(collective, inp, out, group)
            cases.append(_InterferenceCase(impl, collective, None, None, label, cap, call))
    return cases


def part_interference(ctx: Ctx) -> None:
    if ctx.world < 2:
        ctx.emit("skipped", "interference", "all", impl="smptk", reason=NEEDS_RANKS)
        return
    import smptk.comm as comm

    n = GEMM_N[ctx.mode if ctx.cuda else "cpu"]
    gemm_iters = GEMM_ITERS[ctx.mode if ctx.cuda else "cpu"]
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.rank)
    a = torch.randn(n, n, generator=gen, device=ctx.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, generator=gen, device=ctx.device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=ctx.device, dtype=torch.bfloat16)
    gemm = lambda: torch.matmul(a, b, out=c)
    sm_count = torch.cuda.get_device_properties(ctx.device).multi_processor_count if ctx.cuda else None
    gemm_desc = {"gemm": {"M": n, "N": n, "K": n, "dtype": "bfloat16", "calls_per_round": gemm_iters}}
    gemm_desc["sm_count"] = sm_count
    if ctx.cuda:
        concurrency = "side CUDA stream (normal priority), collectives enqueued ahead of the GEMMs"
    else:
        concurrency = "sequential: a CPU has no streams; the collectives run before the GEMMs of each round"
    alone = _timed(ctx, gemm, gemm_iters)
    alone_s = summarize(alone)["median"]
    ctx.emit(
        "measurement",
        "interference",
        f"gemm{n}-alone",
        op="gemm_alone",
        impl="torch.matmul (cuBLAS)" if ctx.cuda else "torch.matmul (CPU)",
        world=ctx.world,
        tflops=2 * n**3 / alone_s / 1e12,
        **gemm_desc,
        **_timing_fields(ctx, alone, gemm_iters),
    )
    nbytes = case_numels("all_reduce", INTERFERENCE_BYTES[ctx.mode], ctx.world, 2)[2]
    side = torch.cuda.Stream() if ctx.cuda else None
    for case in _interference_cases(ctx, nbytes):
        coll = case.call
        coll()  # first call: heap / communicator set-up, Triton compile
        coll_rounds = _timed(ctx, coll)
        coll_s = summarize(coll_rounds)["median"]
        # alone_s and coll_s are maxima over ranks, so every rank enqueues the same number of calls
        calls = min(MAX_COVER_CALLS, math.ceil(COVER_FACTOR * gemm_iters * alone_s / coll_s) + 1)
        for _ in range(ctx.warmup):
            _concurrent_round(ctx, gemm, gemm_iters, coll, calls, side)
        local, covered = [], True
        for _ in range(ctx.rounds):
            t, cov = _concurrent_round(ctx, gemm, gemm_iters, coll, calls, side)
            local.append(t)
            covered = covered and cov is not False
        conc = _max_over_ranks(ctx, local)
        if ctx.cuda:
            flag = torch.tensor([int(covered)], dtype=torch.int32, device=ctx.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            all_covered: bool | None = bool(flag.item())
            if case.impl == "smptk":
                comm.check()
        else:
            all_covered = None
        slowdown = summarize(conc)["median"] / alone_s
        bound = gemm_slowdown_bound(case.max_sms, sm_count) if case.max_sms is not None and sm_count else None
        if case.impl == "smptk":
            ctas = sm_use(case.max_sms)
        elif ctx.cuda:
            ctas = _observe_nccl_ctas(ctx, coll)
        else:
            ctas = {"nccl_ctas_observed": None, "nccl_ctas_note": NCCL_CTAS_CPU}
        note = ctx.note
        if all_covered is False:
            note = "collectives ended before the GEMMs: slowdown understated"
        ctx.emit(
            "measurement",
            "interference",
            f"gemm{n}-with-{case.collective}-{case.impl}-{case.label}",
            op="gemm_concurrent",
            impl=case.impl,
            collective=case.collective,
            algorithm=case.algorithm,
            max_sms=case.max_sms,
            nccl_config=case.nccl_config,
            nccl_max_ctas=case.nccl_max_ctas,
            world=ctx.world,
            size_bytes=nbytes,
            **gemm_desc,
            **_timing_fields(ctx, conc, gemm_iters),
            gemm_alone_s=summarize(alone),
            slowdown=slowdown,
            slowdown_bound=bound,
            bound_met=None if bound is None else slowdown <= bound,
            collective_alone_s=summarize(coll_rounds),
            collective_calls=calls,
            covered=all_covered,
            concurrency=concurrency,
            **ctas,
            note=note,
        )


# ----------------------------------------------------------------------------- part: ddp
def _ddp_model(ctx: Ctx, dtype: torch.dtype) -> torch.nn.Module:
    layers, hidden, _ = DDP_SHAPES[ctx.mode]
    torch.manual_seed(0)  # same initial weights on every rank and for both hooks
    blocks = [
        torch.nn.Linear(hidden, hidden, bias=False, device=ctx.device, dtype=dtype) for _ in range(layers)
    ]
    return torch.nn.Sequential(*blocks)


def _ddp_run(ctx: Ctx, group: Any, dtype: torch.dtype, smptk_hook: bool) -> dict[str, Any]:
    """This rank's per-round step seconds, initial and final parameters, and the collectives' path."""
    from torch.nn.parallel import DistributedDataParallel

    from smptk.comm.adapters import SmptkHookState, ddp_comm_hook

    _, hidden, batch = DDP_SHAPES[ctx.mode]
    model = _ddp_model(ctx, dtype)
    initial = [p.detach().clone() for p in model.parameters()]
    ddp = DistributedDataParallel(
        model, device_ids=[ctx.local_rank] if ctx.cuda else None, process_group=group
    )
    if smptk_hook:
        ddp.register_comm_hook(SmptkHookState(group=group), ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=DDP_LR)
    times = []
    for step in range(ctx.warmup + ctx.rounds):
        gen = torch.Generator(device=ctx.device).manual_seed(1000 * step + ctx.rank)
        x = torch.randn(batch, hidden, generator=gen, device=ctx.device, dtype=dtype)
        target = torch.randn(batch, hidden, generator=gen, device=ctx.device, dtype=dtype)

        def train_step(x: torch.Tensor = x, target: torch.Tensor = target) -> None:
            opt.zero_grad(set_to_none=True)
            loss = (ddp(x).float() - target.float()).square().sum() / batch
            loss.backward()
            opt.step()

        t = _round_s(ctx, train_step, 1, group)
        if step >= ctx.warmup:
            times.append(t)
    path = f"torch.distributed:{ctx.backend}"
    if smptk_hook:
        import smptk.comm as comm

        if ctx.cuda:
            comm.check(group)
        path = comm.last_path()
    final = [p.detach().clone() for p in model.parameters()]
    return {"times": times, "initial": initial, "final": final, "path": path}


def _params_check(
    dtype: torch.dtype, initial: list[torch.Tensor], default: list[torch.Tensor], mine: list[torch.Tensor]
) -> dict[str, Any]:
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(default, mine, strict=True))
    update = max((a.float() - b.float()).abs().max().item() for a, b in zip(default, initial, strict=True))
    largest = max(p.float().abs().max().item() for p in default)
    tol = 2 * torch.finfo(dtype).eps * largest + 0.01 * update
    return {"max_abs_diff": diff, "largest_update": update, "largest_param": largest, "tol": tol}


def part_ddp(ctx: Ctx) -> None:
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    layers, hidden, batch = DDP_SHAPES[ctx.mode]
    impls = (f"torch.distributed:{ctx.backend}", "smptk")
    step1: dict[str, float] = {}
    model_desc = {"layers": layers, "hidden": hidden, "batch_per_rank": batch, "bias": False}
    model_desc["params"] = layers * hidden * hidden
    for w in range(1, ctx.world + 1):
        group = dist.new_group(list(range(w)))
        member = ctx.rank < w
        times = torch.zeros(2, ctx.rounds, dtype=torch.float64, device=ctx.device)
        stats = torch.zeros(5, dtype=torch.float64, device=ctx.device)  # ranks >= w add zeros
        if member:
            default = _ddp_run(ctx, group, dtype, smptk_hook=False)
            mine = _ddp_run(ctx, group, dtype, smptk_hook=True)
            times = torch.tensor([default["times"], mine["times"]], dtype=torch.float64, device=ctx.device)
            check = _params_check(dtype, default["initial"], default["final"], mine["final"])
            fell_back = float(mine["path"] != "symmetric")
            values = [check["max_abs_diff"], check["largest_update"], check["largest_param"], check["tol"]]
            stats = torch.tensor([*values, fell_back], dtype=torch.float64, device=ctx.device)
        _sync(ctx)  # ranks >= w wait here while the group trains
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        diff, update, largest, tol, fell_back = stats.tolist()
        check = {
            "compared": "parameters after all steps: default hook vs smptk hook",
            "max_abs_diff": diff,
            "largest_update": update,
            "largest_param": largest,
            "tol": tol,
            "tol_rule": "2 ulps of the largest parameter + 1% of the largest update",
            "passed": diff <= tol,
        }
        if not check["passed"]:
            ctx.failures.append(f"ddp::world{w}: parameters differ by {diff:.3g} > tol {tol:.3g}")
        for i, impl in enumerate(impls):
            per_round = times[i].tolist()
            median = summarize(per_round)["median"]
            if w == 1:
                step1[impl] = median
            ctx.emit(
                "measurement",
                "ddp",
                f"ddp-{impl}-world{w}",
                op="ddp_step",
                impl=impl,
                hook="smptk.comm.adapters.ddp_comm_hook" if impl == "smptk" else "default",
                world=w,
                dtype=str(dtype).removeprefix("torch."),
                model=model_desc,
                **_timing_fields(ctx, per_round, 1),
                samples_per_s=w * batch / median,
                scaling_efficiency=scaling_efficiency(step1[impl], median) if impl in step1 else None,
                check=check,
                lr=DDP_LR,
                comm_path=None if impl != "smptk" else ("fallback" if fell_back else "symmetric"),
            )


# ----------------------------------------------------------------------------- launcher and main
@dataclasses.dataclass
class Launch:
    """How a :func:`launch` ended: exit status (None if killed before it had one), output, wall time."""

    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool

    def tail(self, chars: int = 4000) -> str:
        """The ranks' last ``[rankN]:`` lines (their tracebacks), then the end of stderr (else stdout).

        torchrun's own summary of a failure is long and says little, so the ranks' lines come first.
        """
        text = self.stderr.strip() or self.stdout.strip()
        ranks = [line for line in text.splitlines() if line.startswith("[rank")]
        head = "\n".join(ranks)[-(chars // 2) :]
        rest = text[-(chars - len(head)) :]
        return f"{head}\n...\n{rest}" if head else rest


def launch(
    nproc: int,
    args: Sequence[str],
    *,
    timeout_s: float,
    env: dict[str, str] | None = None,
    module: str = "bench.comm_dist",
) -> Launch:
    """``python -m torch.distributed.run --standalone --nproc-per-node nproc -m <module> *args`` (default
    module bench.comm_dist; :func:`bench.tp_dist.launch` passes its own).

    Runs from the checkout root with it on ``PYTHONPATH``. At ``timeout_s``, or when the wait is interrupted
    (then the exception goes on), torchrun and its ranks are stopped (:func:`_stop`).

    Example::

        >>> done = launch(2, ["--quick", "--jsonl", "/tmp/rows.jsonl"], timeout_s=300)
        >>> done.returncode, done.timed_out
        (0, False)
    """
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", module, *args]
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), full_env.get("PYTHONPATH")) if p)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=root, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop(proc, module)
        out, err = proc.communicate()
    except BaseException:  # pytest-timeout's alarm, Ctrl-C: no torchrun or rank outlives this call
        _stop(proc, module)
        raise
    return Launch(proc.returncode, out, err, time.monotonic() - t0, timed_out)


def _stop(proc: subprocess.Popen, module: str) -> None:
    """SIGTERM torchrun (it stops its ranks, which run in sessions of their own), then after a grace period
    SIGKILL whatever is left of it and the ranks it had started, by process id."""
    started = _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_GRACE_S)
    for pid in (proc.pid, *started):
        if _is_ours(pid, module):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_GRACE_S)


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (Linux /proc; empty where it cannot be read)."""
    found, todo = [], [pid]
    while todo:
        for path in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            with contextlib.suppress(OSError, ValueError):
                kids = [int(k) for k in path.read_text().split()]
                found += kids
                todo += kids
    return found


def _is_ours(pid: int, module: str = "bench.comm_dist") -> bool:
    """``pid`` is still a torchrun or ``module`` process (not a reused id)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return module.encode() in cmdline or b"torch.distributed.run" in cmdline


PART_FUNCS: dict[str, Callable[[Ctx], None]] = {
    "bandwidth": part_bandwidth,
    "nccl": part_nccl,
    "interference": part_interference,
    "ddp": part_ddp,
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun ... -m bench.comm_dist", description=__doc__.split("\n")[0])
    p.add_argument("--jsonl", type=Path, required=True, help="rows are appended here (rank 0)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few rounds (always on a CPU)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu: gloo + interpreter")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (measure 20, quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up rounds (measure 3, quick 1)")
    p.add_argument(
        "--max-sms",
        default=None,
        help="comma-separated SM budgets >= 1 (measure 1,2,4,8,16,32; quick 1,2); 0, the copy engine, is "
        "always added for all-gather and all-to-all",
    )
    return p


def _parse_max_sms(text: str | None, quick: bool) -> tuple[int, ...]:
    if text is None:
        return QUICK_MAX_SMS if quick else MEASURE_MAX_SMS
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"--max-sms: expected comma-separated integers >= 1, got {text!r}")
    return values


def _parse_parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise SystemExit(f"--parts: expected a comma-separated subset of {PARTS}, got {text!r}")
    return parts


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected parts on every rank; 0 when every check passed, 1 otherwise."""
    args = _parser().parse_args(argv)
    parts = _parse_parts(args.parts)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if name not in os.environ:
            raise SystemExit(f"bench.comm_dist: {name} is not set; launch with torchrun (see the docstring)")
    cuda = torch.cuda.is_available() and args.device == "auto"
    if not cuda:
        if "smptk.kernels" in sys.modules:
            raise SystemExit("bench.comm_dist: smptk.kernels was imported before TRITON_INTERPRET was set")
        os.environ["TRITON_INTERPRET"] = "1"  # before smptk.kernels is imported: the CPU heap needs it
        torch.set_num_threads(1)
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    # torch >= 2.12 renames all_gather_into_tensor / reduce_scatter_tensor; the GPU machines' 2.11 has only
    # these names, and they are the ones smptk mirrors.
    warnings.filterwarnings(
        "ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
    )
    quick = args.quick or not cuda
    max_sms = _parse_max_sms(args.max_sms, quick)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        env: dict[str, Any] = {}
        if dist.get_rank() == 0:
            from smptk._env import collect_environment

            env = collect_environment()
        ctx = Ctx(
            quick=quick,
            device=torch.device("cuda", local_rank) if cuda else torch.device("cpu"),
            backend="nccl" if cuda else "gloo",
            dtype=torch.bfloat16,
            sizes=QUICK_SIZES if quick else MEASURE_SIZES,
            max_sms=max_sms,
            rounds=args.rounds or (3 if quick else 20),
            warmup=args.warmup if args.warmup is not None else (1 if quick else 3),
            rank=dist.get_rank(),
            world=dist.get_world_size(),
            local_rank=local_rank,
            writer=RowWriter(args.jsonl) if dist.get_rank() == 0 else None,
            env=env,
        )
        for part in parts:
            t0 = time.perf_counter()
            try:
                PART_FUNCS[part](ctx)
            except Exception:
                text = traceback.format_exc()
                ctx.emit("failed", part, "part", reason=text[-2000:])
                raise
            if ctx.rank == 0:
                print(f"bench.comm_dist: {part} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        dist.barrier()  # before the exit (README: "Ending a job"); not after an error
    finally:
        if "smptk.comm" in sys.modules:
            sys.modules["smptk.comm"].reset()
        dist.destroy_process_group()
    if ctx.failures:
        print("bench.comm_dist: checks failed:\n  " + "\n  ".join(ctx.failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
