"""The multi-rank side of ``tests/test_comm.py``: the case catalog and the job every spawned rank runs.

``tests/comm_harness.py`` spawns W gloo ranks that each call :func:`run_job`. Every rank runs every case of
:func:`catalog` in the same order (a collective needs the same call sequence on every rank), compares
``smptk.comm``'s result with torch.distributed's (gloo, in the same ranks, on the same inputs) and returns
``{case id: None, or what went wrong}``. A failed comparison is recorded and the job goes on (no call
depends on a result); any other exception ends the job, naming the case, and fails every test of that
world size. ``test_comm.py`` reads the outcomes, one pytest test per case. Spawning costs seconds per job,
so one job per world size carries every case. (About 700 lines, over the usual 600: the catalog and every
case it names must sit in one module that both the pytest process and the spawned ranks import; the
checks and references live in ``comm_checks.py``.)

What the cases hold (legend: W ranks, n elements per rank, ``heap`` = HEAP_BYTES / element size):

- all_reduce / reduce_scatter: fp32, bf16, fp16, int32 x sum, avg, max, min (x one_shot, two_shot) on 2
  ranks, a cover of them (``REDUCTION_COVER``) on 3 and 4,
  sizes 0, 1, 7 and one past the heap (so the call is cut into chunks), exactly: sum/avg inputs are small
  integers, whose fp32 sums are exact, so the result must be the exact sum (or quotient by W) rounded
  once to the dtype; max, min and int32 are exact outright. Inputs drawn from N(0, 1) (1001 elements for
  all_reduce) are compared within the ``smptk.testing.tolerance`` of an fp32 sum of W terms. bf16 under
  the interpreter rounds toward zero (Triton 3.9's interpreter casts fp32 to bf16 by truncation): there
  either bf16 neighbour of the exact value passes, and the tolerance allows one ulp. int32 avg is not a
  kernel op: it is checked with the fallbacks.
- all_gather, all_to_all: copies, so compared exactly; uneven splits with zero-size splits, multi-dim
  rows, None splits, ranks that send or receive nothing, and segments larger than the heap.
- Outputs are views into buffers poisoned with NaN (int32: a sentinel) with 300 guard elements each side
  (more than one 256-element interpreter tile): an unwritten output element or a write past either end
  fails.
- Outputs over inputs (the in-place all-gather and reduce-scatter, other overlaps, all-to-all with
  output = input) on the kernel, copy-engine and fallback paths; all-to-all split sizes that disagree
  between ranks, on those paths too.
- Repeated, interleaved calls of all four collectives (signal-pad reuse across sizes, dtypes, max_sms);
  all four on a sub-group (``dist.new_group``) next to the default group.
- Fallback paths (float64; int32 avg) and ``last_path()``; bad arguments on every rank, after which the
  group must still work; a rank that never calls (CommTimeoutError naming it, a broken heap until
  ``reset()``, recovery).

Example (what ``test_comm.py`` does)::

    >>> from comm_harness import run_ranks
    >>> job = run_ranks("comm_jobs:run_job", world=2, timeout_s=240)
    >>> job.values[0]["all_reduce-float32-sum-one_shot"]   # None when every check passed on rank 0
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from comm_checks import (
    ALGORITHMS,
    ALL_REDUCE_NORMAL_N,
    DTYPES,
    GLOO_OP,
    GUARD,
    HEAP_BYTES,
    JOB_MAX_SMS,
    JOB_TIMEOUT_S,
    MISSING_TIMEOUT_S,
    OPS,
    Case,
    all_gather_sizes,
    all_reduce_sizes,
    dist_all_gather,
    dist_reduce_scatter,
    expect_raises,
    gloo_all_reduce,
    gloo_reduce_scatter,
    heap_elems,
    poisoned,
    reduce_scatter_normal_n,
    reduce_scatter_sizes,
    sample,
    seeded_gen,
)

import smptk.comm as comm

# ---------------------------------------------------------------------------------------------- cases


def case_all_reduce(c: Case, world: int, rank: int, *, dtype: str, op: str, algorithm: str) -> None:
    dt = DTYPES[dtype]
    kind = "int" if op in ("sum", "avg") else "normal"
    for n in all_reduce_sizes(dt):
        x = sample(kind, dt, (n,), seeded_gen(c.cid, n, rank))
        exact = gloo_all_reduce(x, op, world)  # exact in fp32: small integers, or max / min
        buf, y = poisoned((n,), dt)
        y.copy_(x)
        returned = comm.all_reduce(y, op=op, algorithm=algorithm)
        c.path(f"n={n}", "symmetric")
        c.same(f"n={n}", returned, y)
        c.rounded(f"n={n}", y, exact)
        c.guards(f"n={n}", buf, GUARD, n)
    if dt.is_floating_point and op in ("sum", "avg"):  # N(0, 1) inputs: not exact, a tolerance
        n = ALL_REDUCE_NORMAL_N
        x = sample("normal", dt, (n,), seeded_gen(c.cid, "normal", rank))
        expected = gloo_all_reduce(x, op, world)
        scale = gloo_all_reduce(x.float().square(), "sum", world).sqrt() / (world if op == "avg" else 1)
        y = x.clone()
        comm.all_reduce(y, op=op, algorithm=algorithm)
        c.close(f"N(0,1) n={n}", y, expected, world=world, scale=scale)


def case_all_reduce_shape(
    c: Case, world: int, rank: int, *, shape: tuple, max_sms: int | None = None, algorithm: str = "auto"
) -> None:
    """fp32 sum of small integers in an arbitrary shape (0-d, 2-d) and program count."""
    x = sample("int", torch.float32, shape, seeded_gen(c.cid, rank))
    expected = gloo_all_reduce(x, "sum", world)
    buf, y = poisoned(shape, torch.float32)
    y.copy_(x)
    comm.all_reduce(y, max_sms=max_sms, algorithm=algorithm)
    c.path("call", "symmetric")
    c.equal("result", y, expected)
    c.guards("result", buf, GUARD, x.numel())


def case_nan(c: Case, world: int, rank: int, *, dtype: str) -> None:
    """max / min propagate NaN from any rank, as torch.amax / amin do (it used to vanish: max(NaN, 1) = 1),
    on both all-reduce algorithms and in reduce-scatter; ops given as ``dist.ReduceOp`` work as names do."""
    dt = DTYPES[dtype]
    n = 3 * world * 4
    x = torch.arange(n, dtype=torch.float32).remainder(7).sub(3 * rank)
    x[rank :: 2 * world] = float("nan")  # every rank its own NaNs; odd multiples of world stay numbers
    x = x.to(dt)
    gathered = torch.empty(world * n)  # fp32: every rank's values, NaNs included (gloo's max drops some)
    dist_all_gather(gathered, x.float())
    gathered = gathered.view(world, n)
    for op, torch_op in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
        expected = gathered.amax(0) if op == "max" else gathered.amin(0)  # NaN wins
        for alg in ALGORITHMS:
            y = x.clone()
            comm.all_reduce(y, op=torch_op, algorithm=alg)
            c.path(f"{op} {alg}", "symmetric")
            c.equal(f"{op} {alg}: NaN pattern", y.isnan(), expected.isnan())
            c.equal(f"{op} {alg}: values", y.float().nan_to_num(), expected.nan_to_num())
        out = torch.empty(n // world, dtype=dt)
        comm.reduce_scatter_tensor(out, x, op=torch_op)
        mine = expected.view(world, -1)[rank]
        c.equal(f"reduce_scatter {op}: NaN pattern", out.isnan(), mine.isnan())
        c.equal(f"reduce_scatter {op}: values", out.float().nan_to_num(), mine.nan_to_num())


def case_reduce_scatter(c: Case, world: int, rank: int, *, dtype: str, op: str) -> None:
    dt = DTYPES[dtype]
    kind = "int" if op in ("sum", "avg") else "normal"
    for n in reduce_scatter_sizes(dt, world):
        x = sample(kind, dt, (world * n,), seeded_gen(c.cid, n, rank))
        exact = gloo_reduce_scatter(x, op, world)
        buf, out = poisoned((n,), dt)
        returned = comm.reduce_scatter_tensor(out, x, op=op)
        c.path(f"n={n}", "symmetric")
        c.same(f"n={n}", returned, out)
        c.rounded(f"n={n}", out, exact)
        c.guards(f"n={n}", buf, GUARD, n)
    if dt.is_floating_point and op in ("sum", "avg"):
        n = reduce_scatter_normal_n(dt, world)
        x = sample("normal", dt, (world * n,), seeded_gen(c.cid, "normal", rank))
        expected = gloo_reduce_scatter(x, op, world)
        scale = gloo_reduce_scatter(x.float().square(), "sum", world).sqrt() / (world if op == "avg" else 1)
        out = torch.full((n,), float("nan"), dtype=dt)
        comm.reduce_scatter_tensor(out, x, op=op)
        c.close(f"N(0,1) n={n}", out, expected, world=world, scale=scale)


def case_reduce_scatter_shape(
    c: Case, world: int, rank: int, *, out_shape: tuple, stacked: bool = False, max_sms: int | None = None
) -> None:
    """fp32 sum, multi-dim output; input ``[W * d0, ...]`` or stacked ``[W, *out_shape]``."""
    in_shape = (world, *out_shape) if stacked else (world * out_shape[0], *out_shape[1:])
    x = sample("int", torch.float32, in_shape, seeded_gen(c.cid, rank))
    expected = gloo_reduce_scatter(x, "sum", world).view(out_shape)
    buf, out = poisoned(out_shape, torch.float32)
    comm.reduce_scatter_tensor(out, x, max_sms=max_sms)
    c.path("call", "symmetric")
    c.equal("result", out, expected)
    c.guards("result", buf, GUARD, out.numel())


def case_all_gather(c: Case, world: int, rank: int, *, dtype: str, algorithm: str = "auto") -> None:
    dt = DTYPES[dtype]
    for n in all_gather_sizes(dt):
        x = sample("normal", dt, (n,), seeded_gen(c.cid, n, rank))
        expected = torch.empty(world * n, dtype=dt)
        dist_all_gather(expected, x)
        buf, out = poisoned((world * n,), dt)
        returned = comm.all_gather_into_tensor(out, x, algorithm=algorithm)
        c.path(f"n={n}", "copy_engine" if algorithm == "copy_engine" else "symmetric")
        c.same(f"n={n}", returned, out)
        c.equal(f"n={n}", out, expected)
        c.guards(f"n={n}", buf, GUARD, world * n)


def case_all_gather_shape(
    c: Case, world: int, rank: int, *, in_shape: tuple, stacked: bool = False, max_sms: int | None = None
) -> None:
    """fp32, multi-dim input; output ``[W * d0, ...]`` or stacked ``[W, *in_shape]``."""
    out_shape = (world, *in_shape) if stacked else (world * in_shape[0], *in_shape[1:])
    x = sample("normal", torch.float32, in_shape, seeded_gen(c.cid, rank))
    expected = torch.empty(world * x.numel())  # gloo takes only the [W * d0, ...] layout; view it after
    dist_all_gather(expected, x.reshape(-1))
    expected = expected.view(out_shape)
    buf, out = poisoned(out_shape, torch.float32)
    comm.all_gather_into_tensor(out, x, max_sms=max_sms)
    c.path("call", "symmetric")
    c.equal("result", out, expected)
    c.guards("result", buf, GUARD, out.numel())


def split_matrix(pattern: str, world: int, dtype: torch.dtype, row: int) -> list[list[int]]:
    """``S[r][d]``: rows rank r sends to rank d (rank d receives ``S[r][d]`` from r, in rank order)."""
    if pattern == "uneven":  # zeros, including some S[r][r], and different sizes everywhere
        return [[(2 * r + 3 * d + 1) % 5 for d in range(world)] for r in range(world)]
    if pattern == "silent":  # rank 0 sends nothing, rank W-1 receives nothing
        return [
            [0 if r == 0 or d == world - 1 else (r + d) % 3 + 1 for d in range(world)] for r in range(world)
        ]
    if pattern == "beyond_heap":  # some segments exceed a rank's staging slot (heap / W): several rounds
        big = heap_elems(dtype) // world // row + 3
        return [[big + r if (r + d) % 2 == 0 else (r * d) % 3 for d in range(world)] for r in range(world)]
    if pattern == "idle_beyond_heap":  # the last rank sends and receives nothing; rank 0 sends itself rounds
        big = heap_elems(dtype) // world // row + 3
        idle = world - 1
        sizes = [[0 if idle in (r, d) else 1 for d in range(world)] for r in range(world)]
        sizes[0][0] = big
        return sizes
    if pattern == "empty":
        return [[0] * world for _ in range(world)]
    raise ValueError(pattern)


def case_all_to_all(
    c: Case,
    world: int,
    rank: int,
    *,
    pattern: str,
    dtype: str,
    row_shape: tuple,
    max_sms: int | None = None,
    algorithm: str = "auto",
    splits: str = "lists",
) -> None:
    """``splits``: "lists"; "tensors" (1-D int64 tensors); "agreed" (lists plus ``agreed_max_split``, the
    largest entry of the split matrix every rank knows here, so no split exchange runs)."""
    dt = DTYPES[dtype]
    row = math.prod(row_shape)
    S = split_matrix(pattern, world, dt, row)
    send = S[rank]
    recv = [S[q][rank] for q in range(world)]
    x = sample("normal", dt, (sum(send), *row_shape), seeded_gen(c.cid, rank))
    expected = torch.empty((sum(recv), *row_shape), dtype=dt)
    dist.all_to_all_single(expected, x, recv, send)
    buf, out = poisoned((sum(recv), *row_shape), dt)
    kwargs: dict = {"max_sms": max_sms, "algorithm": algorithm}
    if splits == "agreed":
        kwargs["agreed_max_split"] = max(max(r) for r in S)
    if splits == "tensors":
        returned = comm.all_to_all_single(out, x, torch.tensor(recv), torch.tensor(send), **kwargs)
    else:
        returned = comm.all_to_all_single(out, x, recv, send, **kwargs)
    c.path(f"send {send} recv {recv}", "copy_engine" if algorithm == "copy_engine" else "symmetric")
    c.same("result", returned, out)
    c.equal(f"send {send} recv {recv}", out, expected)
    c.guards("result", buf, GUARD, out.numel())


def case_all_to_all_equal(
    c: Case, world: int, rank: int, *, in_shape_per_rank: tuple, explicit_out: bool = False
) -> None:
    """None splits (equal blocks); ``explicit_out``: input splits None, output splits given."""
    rows = in_shape_per_rank[0]
    shape = (world * rows, *in_shape_per_rank[1:])
    x = sample("normal", torch.float32, shape, seeded_gen(c.cid, rank))
    out_splits = [rows] * world if explicit_out else None
    expected = torch.empty(shape)
    dist.all_to_all_single(expected, x, out_splits, None)
    buf, out = poisoned(shape, torch.float32)
    comm.all_to_all_single(out, x, out_splits, None)
    c.path("call", "symmetric")
    c.equal("result", out, expected)
    c.guards("result", buf, GUARD, out.numel())


def case_aliased(c: Case, world: int, rank: int, *, collective: str, dtype: str) -> None:
    """``output`` over ``input``, against gloo on separate tensors: float32 on the kernel and copy-engine
    paths, float64 on the fallback. The in-place pattern engines use (all-gather: input = this rank's
    block of output; reduce-scatter: output = this rank's block of input) and other overlaps (one element
    off; all-to-all with output = input: a cyclic split matrix, whose rows move at W >= 3). The kernels'
    programs write output tiles while others still stage input, and gloo's all_to_all reads while it
    writes: the other overlaps were wrong before such inputs were copied first."""
    dt = getattr(torch, dtype)
    kernel = dt in DTYPES.values()
    algorithms = ("kernel", "copy_engine") if kernel and collective != "reduce_scatter" else ("auto",)

    def expect(alg: str) -> str:
        return {"copy_engine": "copy_engine"}.get(alg, "symmetric") if kernel else "torch.distributed:gloo"

    gen = seeded_gen(c.cid, rank)
    if collective == "all_gather":
        for n, offset in ((300, rank * 300), (300, 1)):  # 3 interpreter tiles of fp32
            for alg in algorithms:
                x = sample("int", dt, (n,), gen)
                expected = torch.empty(world * n, dtype=dt)
                dist_all_gather(expected, x)
                buf = torch.zeros(world * n + 1, dtype=dt)
                buf[offset : offset + n] = x
                out = buf[: world * n]
                comm.all_gather_into_tensor(out, buf[offset : offset + n], algorithm=alg)
                c.path(f"n={n} input at {offset} {alg}", expect(alg))
                c.equal(f"n={n} input at {offset} {alg}", out, expected)
    elif collective == "reduce_scatter":
        big = heap_elems(dt) // world + 7  # two chunks
        for n, offset in ((7, rank * 7), (big, rank * big), (300, 1)):
            x = sample("int", dt, (world * n + 1,), gen)
            expected = torch.empty(n, dtype=dt)
            dist_reduce_scatter(expected, x[: world * n].clone())
            out = x[offset : offset + n]
            comm.reduce_scatter_tensor(out, x[: world * n])
            c.path(f"n={n} output at {offset}", expect("auto"))
            c.equal(f"n={n} output at {offset}", out, expected)
    else:
        k = 120 if kernel else 5  # rows of one element; at W >= 3 the largest segment takes 2 rounds
        S = [[((d - r) % world + 1) * k for d in range(world)] for r in range(world)]
        send, recv = S[rank], [S[q][rank] for q in range(world)]
        for alg in algorithms:
            x = sample("int", dt, (sum(send),), gen)
            expected = torch.empty(sum(recv), dtype=dt)
            dist.all_to_all_single(expected, x.clone(), recv, send)
            comm.all_to_all_single(x, x, recv, send, algorithm=alg)
            c.path(f"send {send} recv {recv} {alg}", expect(alg))
            c.equal(f"send {send} recv {recv} {alg}", x, expected)


def case_split_mismatch(c: Case, world: int, rank: int, *, algorithm: str, dtype: str = "float32") -> None:
    """Rank W-1 expects one row more from rank 0 and one fewer from rank 1 than they send (its total
    right): every rank raises CommMismatchError naming the pairs, and the group stays usable. float64
    takes the fallback, where gloo's own all_to_all_single raised on rank W-1 and left the others
    waiting."""
    dt = getattr(torch, dtype)
    send = [2] * world
    recv = [2] * world
    if rank == world - 1:
        recv[0], recv[1] = 3, 1
    x = torch.randn(sum(send), 3, generator=seeded_gen(c.cid, rank), dtype=dt)
    out = torch.empty(sum(recv), 3, dtype=dt)
    expected = [0, 1, world - 1] if world > 2 else [0, 1]
    try:
        comm.all_to_all_single(out, x, recv, send, algorithm=algorithm)
        c.fail("the call with disagreeing splits returned")
    except comm.CommMismatchError as e:
        if e.ranks != expected:
            c.fail(f"ranks = {e.ranks}, expected {expected} (message: {e})")
        for q in (0, 1):
            pair = f"rank {q} sends 6 elements to rank {world - 1}, which expects {9 if q == 0 else 3}"
            if pair not in str(e):
                c.fail(f"message does not name the pair ({pair!r}): {e}")
    except Exception as e:
        c.fail(f"raised {type(e).__name__} instead of CommMismatchError: {e}")
    expected_out = torch.empty(2 * world, 3, dtype=dt)
    dist.all_to_all_single(expected_out, x)
    out = torch.empty(2 * world, 3, dtype=dt)
    comm.all_to_all_single(out, x, algorithm=algorithm)
    path = "copy_engine" if algorithm == "copy_engine" else "symmetric"
    c.path("the next call", path if dt == torch.float32 else "torch.distributed:gloo")
    c.equal("the next call", out, expected_out)


def case_interleaved(c: Case, world: int, rank: int, *, iterations: int) -> None:
    """All four collectives in turn, changing dtype, size, op, algorithm and max_sms at every call."""
    names = list(DTYPES)
    for i in range(iterations):
        dt = DTYPES[names[i % len(names)]]
        sms = 1 + i % 3
        n = 1 + (97 * i) % 600
        op = ("sum", "max", "min")[i % 3]
        x = sample("int", dt, (n,), seeded_gen(c.cid, i, "ar", rank))
        expected = gloo_all_reduce(x, op, world).to(dt)
        comm.all_reduce(x, op=op, max_sms=sms, algorithm=ALGORITHMS[i % 2])
        c.equal(f"iteration {i} all_reduce {dt} {op} n={n} max_sms={sms}", x, expected)
        x = sample("int", dt, (n,), seeded_gen(c.cid, i, "ag", rank))
        expected = torch.empty(world * n, dtype=dt)
        dist_all_gather(expected, x)
        out = torch.empty(world * n, dtype=dt)
        comm.all_gather_into_tensor(out, x, max_sms=4 - sms)
        c.equal(f"iteration {i} all_gather {dt} n={n} max_sms={4 - sms}", out, expected)
        x = sample("int", dt, (world * n,), seeded_gen(c.cid, i, "rs", rank))
        expected = gloo_reduce_scatter(x, op, world).to(dt)
        out = torch.empty(n, dtype=dt)
        comm.reduce_scatter_tensor(out, x, op=op, max_sms=sms)
        c.equal(f"iteration {i} reduce_scatter {dt} {op} n={n} max_sms={sms}", out, expected)
        S = [[(i + r + 2 * d) % 4 for d in range(world)] for r in range(world)]
        send, recv = S[rank], [S[q][rank] for q in range(world)]
        x = sample("int", dt, (sum(send), 3), seeded_gen(c.cid, i, "a2a", rank))
        expected = torch.empty(sum(recv), 3, dtype=dt)
        dist.all_to_all_single(expected, x, recv, send)
        out = torch.empty(sum(recv), 3, dtype=dt)
        comm.all_to_all_single(out, x, recv, send, max_sms=sms)
        c.equal(f"iteration {i} all_to_all {dt} send {send} max_sms={sms}", out, expected)
        c.path(f"iteration {i}", "symmetric")
    y = torch.full((1001,), float(rank + 1))
    comm.all_reduce(y)
    c.equal("final all_reduce of rank + 1", y, torch.full((1001,), world * (world + 1) / 2))


def case_fallback(c: Case, world: int, rank: int, *, which: str) -> None:
    """Calls the kernels do not take run on gloo, give gloo's result, and say so in last_path()."""
    gloo = "torch.distributed:gloo"
    if which == "float64":
        x = torch.randn(37, generator=seeded_gen(c.cid, rank), dtype=torch.float64)
        for op in ("sum", "max"):
            expected = x.clone()
            dist.all_reduce(expected, op=GLOO_OP[op])
            y = x.clone()
            comm.all_reduce(y, op=op)
            c.path(f"all_reduce {op}", gloo)
            c.equal(f"all_reduce {op}", y, expected)
        expected = torch.empty(world * 37, dtype=torch.float64)
        dist_all_gather(expected, x)
        out = torch.empty(world * 37, dtype=torch.float64)
        comm.all_gather_into_tensor(out, x)
        c.path("all_gather", gloo)
        c.equal("all_gather", out, expected)
        xs = torch.randn(world * 5, generator=seeded_gen(c.cid, "rs", rank), dtype=torch.float64)
        expected = torch.empty(5, dtype=torch.float64)
        dist_reduce_scatter(expected, xs)
        out = torch.empty(5, dtype=torch.float64)
        comm.reduce_scatter_tensor(out, xs)
        c.path("reduce_scatter", gloo)
        c.equal("reduce_scatter", out, expected)
        # shapes the heap path takes, of the same sizes: gloo's own call aborted the process on the first
        # (a failed CHECK) and segfaulted on the second
        out = torch.full((5,), float("nan"), dtype=torch.float64)
        comm.reduce_scatter_tensor(out, xs.view(world, 5))
        c.equal("reduce_scatter of a [world, 5] input", out, expected)
        out = torch.tensor(float("nan"), dtype=torch.float64)
        comm.reduce_scatter_tensor(out, torch.arange(world, dtype=torch.float64) + rank)  # block r: r + q
        want = torch.tensor(world * rank + world * (world - 1) / 2, dtype=torch.float64)
        c.equal("reduce_scatter into a 0-d output", out, want)
        xa = torch.randn(world * 2, 3, generator=seeded_gen(c.cid, "a2a", rank), dtype=torch.float64)
        expected = torch.empty_like(xa)
        dist.all_to_all_single(expected, xa)
        out = torch.empty_like(xa)
        comm.all_to_all_single(out, xa)
        c.path("all_to_all", gloo)
        c.equal("all_to_all", out, expected)
        out = torch.empty_like(xa)
        comm.all_to_all_single(out, xa, torch.full((world,), 2), torch.full((world,), 2))
        c.path("all_to_all, splits as tensors", gloo)
        c.equal("all_to_all, splits as tensors", out, expected)
        # dtypes gloo does not move (its "Invalid scalar type"): moved as bytes, compared as bytes
        for dt in (torch.int16, torch.uint32, torch.float8_e4m3fn):
            mine = [(torch.arange(world * 6).reshape(world * 2, 3) + 100 * q).to(dt) for q in range(world)]
            out = torch.empty(world * world * 6, dtype=dt)
            comm.all_gather_into_tensor(out, mine[rank].reshape(-1))
            c.path(f"all_gather {dt}", gloo)
            want = torch.cat([m.reshape(-1) for m in mine])
            c.equal(f"all_gather {dt}", out.view(torch.uint8), want.view(torch.uint8))
            out = torch.empty(world * 2, 3, dtype=dt)
            comm.all_to_all_single(out, mine[rank])
            c.path(f"all_to_all {dt}", gloo)
            want = torch.cat([m[2 * rank : 2 * rank + 2] for m in mine])
            c.equal(f"all_to_all {dt}", out.view(torch.uint8), want.view(torch.uint8))
    elif which == "int32_avg":
        # Values of both signs, so the rounding of a non-integer average shows: floor (floor_divide).
        x = torch.randint(-1000, 1000, (23,), generator=seeded_gen(c.cid, rank), dtype=torch.int32)
        total = x.clone()
        dist.all_reduce(total)
        y = x.clone()
        comm.all_reduce(y, op="avg")
        c.path("all_reduce avg", gloo)
        c.equal("all_reduce avg", y, torch.div(total, world, rounding_mode="floor"))
        xs = torch.randint(
            -1000, 1000, (world * 9,), generator=seeded_gen(c.cid, "rs", rank), dtype=torch.int32
        )
        total = torch.empty(9, dtype=torch.int32)
        dist_reduce_scatter(total, xs)
        out = torch.empty(9, dtype=torch.int32)
        comm.reduce_scatter_tensor(out, xs, op="avg")
        c.path("reduce_scatter avg", gloo)
        c.equal("reduce_scatter avg", out, torch.div(total, world, rounding_mode="floor"))
        # sums past the dtype's range (int8: 100 + 101 + ...), averages inside it: summed in int64
        for dt, base in ((torch.int8, 100), (torch.uint8, 200), (torch.int32, 2**30 + 7)):
            x = torch.full((5,), base + rank, dtype=dt)
            mean = torch.full((5,), base + (world - 1) // 2, dtype=dt)  # floor of base + mean(0..W-1)
            y = x.clone()
            comm.all_reduce(y, op="avg")
            c.equal(f"all_reduce avg {dt} of {base} + rank", y, mean)
            out = torch.empty(5, dtype=dt)
            comm.reduce_scatter_tensor(out, x.repeat(world, 1), op="avg")  # a [world, 5] input
            c.equal(f"reduce_scatter avg {dt} of {base} + rank", out, mean)
    # The next kernel-path call says "symmetric" again.
    y = torch.ones(3)
    comm.all_reduce(y)
    c.path("kernel call after the fallback", "symmetric")
    c.equal("kernel call after the fallback", y, torch.full((3,), float(world)))


def case_subgroup(c: Case, world: int, rank: int) -> None:
    """A group of ranks 1..W-1 (group rank = rank - 1; one rank at W=2) next to the default group: all
    four collectives match gloo on the same group. Rank 0 only takes part in ``new_group``."""
    members = list(range(1, world))
    g = dist.new_group(members)  # collective over the default group: every rank calls it
    if rank in members:
        gw = len(members)
        x = sample("int", torch.float32, (11,), seeded_gen(c.cid, "ar", rank))
        expected = x.clone()
        dist.all_reduce(expected, group=g)
        comm.all_reduce(x, group=g)
        c.path("all_reduce", "symmetric")
        c.equal("all_reduce", x, expected)
        x = sample("int", torch.float32, (5,), seeded_gen(c.cid, "ag", rank))
        expected = torch.empty(gw * 5)
        dist_all_gather(expected, x, group=g)
        out = torch.full((gw * 5,), float("nan"))
        comm.all_gather_into_tensor(out, x, group=g)
        c.equal("all_gather", out, expected)
        x = sample("int", torch.float32, (gw * 3,), seeded_gen(c.cid, "rs", rank))
        expected = torch.empty(3)
        dist_reduce_scatter(expected, x, group=g)
        out = torch.full((3,), float("nan"))
        comm.reduce_scatter_tensor(out, x, group=g)
        c.equal("reduce_scatter", out, expected)
        me = dist.get_rank(g)
        S = [[(r + 2 * d + 1) % 3 for d in range(gw)] for r in range(gw)]
        send, recv = S[me], [S[q][me] for q in range(gw)]
        x = sample("int", torch.float32, (sum(send), 2), seeded_gen(c.cid, "a2a", rank))
        expected = torch.empty(sum(recv), 2)
        dist.all_to_all_single(expected, x, recv, send, group=g)
        out = torch.full((sum(recv), 2), float("nan"))
        comm.all_to_all_single(out, x, recv, send, group=g)
        c.path("all_to_all", "symmetric")
        c.equal("all_to_all", out, expected)
        comm.reset(g)
    y = torch.full((3,), float(rank))  # the default group's heap still works next to the sub-group's
    comm.all_reduce(y)
    c.equal("default group after the sub-group", y, torch.full((3,), float(sum(range(world)))))


def case_subgroup_non_member(c: Case, world: int, rank: int) -> None:
    """Rank 0 calls a collective on a group of ranks 1..W-1: ValueError naming ``group`` (smptk's own
    "not a member" message), at once, with no communication."""
    g = dist.new_group(list(range(1, world)))
    if rank == 0:
        problem = expect_raises(
            lambda: comm.all_reduce(torch.ones(2), group=g), ValueError, "group: this rank is not a member"
        )
        if problem:
            c.fail(f"all_reduce on a group without this rank (new_group gave {g!r}): {problem}")


# ------------------------------------------------------------------------------------------ bad input


def bad_inputs(world: int) -> list[tuple[str, Callable[[], object], type, str]]:
    """``(id, call, exception type, text the message must contain)``: bad arguments, the same on every
    rank. Every check happens before any communication, so no rank waits on another."""
    W, V, T = world, ValueError, TypeError
    ar, ag, rs, a2a = (
        comm.all_reduce,
        comm.all_gather_into_tensor,
        comm.reduce_scatter_tensor,
        comm.all_to_all_single,
    )
    group, sms = "group: expected a torch.distributed ProcessGroup or None", "max_sms: expected 1..256"
    f16_vs_f32 = "output: dtype torch.float16 does not match input's torch.float32"
    splits = f"expected {W} non-negative sizes"

    def z(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    cases = []

    def bad(cid: str, exc: type, text: str, call: Callable[[], object]) -> None:
        cases.append((cid, call, exc, text))

    bad("all_reduce-not-a-tensor", T, "tensor: expected a torch.Tensor, got list", lambda: ar([1.0, 2.0]))
    bad("all_reduce-noncontiguous", V, "tensor: must be contiguous", lambda: ar(z(4, 6).t()))
    bad("all_reduce-unknown-op", V, "op: expected one of", lambda: ar(z(4), op="prod"))
    bad("all_reduce-reduceop-product", V, "op: expected one of", lambda: ar(z(4), op=dist.ReduceOp.PRODUCT))
    bad("all_reduce-unknown-algorithm", V, "algorithm: expected one of", lambda: ar(z(4), algorithm="ring"))
    bad("all_reduce-max_sms-0", V, sms, lambda: ar(z(4), max_sms=0))
    bad("all_reduce-max_sms-257", V, sms, lambda: ar(z(4), max_sms=257))
    bad("all_reduce-group-str", T, group, lambda: ar(z(4), group="world"))
    bad("all_reduce-group-object", T, group, lambda: ar(z(4), group=object()))
    bad(
        "all_gather-output-noncontiguous",
        V,
        "output: must be contiguous",
        lambda: ag(z(W * 8, 2)[:, 0], z(8)),
    )
    bad("all_gather-input-noncontiguous", V, "input: must be contiguous", lambda: ag(z(W * 8), z(2, 4).t()))
    bad("all_gather-dtype-mismatch", T, f16_vs_f32, lambda: ag(z(W * 4, dtype=torch.float16), z(4)))
    bad(
        "all_gather-device-mismatch",
        V,
        "output: on meta but input is on cpu",
        lambda: ag(z(W, device="meta"), z(1)),
    )
    numel = "output: expected world_size * input.numel()"
    bad("all_gather-output-too-big", V, numel, lambda: ag(z(W * 4 + 1), z(4)))
    bad("all_gather-output-too-small", V, numel, lambda: ag(z(W * 4 - 1), z(4)))
    bad("all_gather-max_sms-negative", V, sms, lambda: ag(z(W * 4), z(4), max_sms=-1))
    bad("all_gather-group-str", T, group, lambda: ag(z(W * 4), z(4), group="world"))
    numel = "input: expected world_size * output.numel()"
    bad("reduce_scatter-input-wrong-numel", V, numel, lambda: rs(z(4), z(W * 4 + 1)))
    bad("reduce_scatter-dtype-mismatch", T, f16_vs_f32, lambda: rs(z(4, dtype=torch.float16), z(W * 4)))
    bad(
        "reduce_scatter-output-noncontiguous",
        V,
        "output: must be contiguous",
        lambda: rs(z(4, 2).t(), z(W * 8)),
    )
    bad("reduce_scatter-unknown-op", V, "op: expected one of", lambda: rs(z(4), z(W * 4), op="product"))
    bad("reduce_scatter-max_sms-257", V, sms, lambda: rs(z(4), z(W * 4), max_sms=257))
    bad(
        "all_to_all-input-splits-too-many",
        V,
        f"input_split_sizes: {splits}",
        lambda: a2a(z(W + 1), z(W + 1), None, [1] * (W + 1)),
    )
    bad(
        "all_to_all-output-splits-too-few",
        V,
        f"output_split_sizes: {splits}",
        lambda: a2a(z(W), z(W), [1] * (W - 1), [1] * W),
    )
    bad(
        "all_to_all-negative-split",
        V,
        f"input_split_sizes: {splits}",
        lambda: a2a(z(W), z(W), [1] * W, [2] + [1] * (W - 2) + [-1]),
    )
    not_a_list = "output_split_sizes: expected a sequence of ints, a 1-D integer tensor or None, got 2"
    bad("all_to_all-split-sizes-an-int", T, not_a_list, lambda: a2a(z(2 * W), z(2 * W), 2, None))
    wrong_sum = f"input_split_sizes: sizes sum to {2 * W} but dim 0 of the tensor is {W}"
    bad("all_to_all-input-splits-sum", V, wrong_sum, lambda: a2a(z(W, 2), z(W, 2), [1] * W, [2] * W))
    wrong_sum = f"output_split_sizes: sizes sum to 0 but dim 0 of the tensor is {W}"
    bad("all_to_all-output-splits-sum", V, wrong_sum, lambda: a2a(z(W, 2), z(W, 2), [0] * W, [1] * W))
    rows = "output: rows of shape (4,) but input rows are (3,)"
    bad("all_to_all-row-shape-mismatch", V, rows, lambda: a2a(z(W, 4), z(W, 3)))
    bf16_vs_f32 = "output: dtype torch.bfloat16 does not match input's torch.float32"
    bad("all_to_all-dtype-mismatch", T, bf16_vs_f32, lambda: a2a(z(W, 2, dtype=torch.bfloat16), z(W, 2)))
    bad(
        "all_to_all-input-noncontiguous",
        V,
        "input: must be contiguous",
        lambda: a2a(z(W, 2), z(W, 4)[:, ::2]),
    )
    bad("all_to_all-max_sms-0", V, sms, lambda: a2a(z(W, 2), z(W, 2), max_sms=0))
    if W > 1:  # every row count divides by 1
        indivisible = f"input_split_sizes: None needs dim 0 ({W + 1}) divisible by the world size {W}"
        bad("all_to_all-none-indivisible", V, indivisible, lambda: a2a(z(W, 2), z(W + 1, 2), [1] * W, None))
    return cases


def case_bad_input(c: Case, world: int, rank: int, *, name: str) -> None:
    for cid, call, exc, text in bad_inputs(world):
        if cid == name:
            problem = expect_raises(call, exc, text)
            if problem:
                c.fail(problem)
            return
    raise KeyError(name)


def case_usable_after_errors(c: Case, world: int, rank: int) -> None:
    """After every rank raised on the bad arguments above, the group still runs collectives."""
    y = torch.full((5,), float(rank))
    comm.all_reduce(y)
    c.path("all_reduce", "symmetric")
    c.equal("all_reduce", y, torch.full((5,), float(sum(range(world)))))
    x = torch.arange(world * 2, dtype=torch.float32) + 100 * rank
    expected = torch.empty_like(x)
    dist.all_to_all_single(expected, x)
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x)
    c.equal("all_to_all", out, expected)


# ------------------------------------------------------------------------------ a rank that never calls


STAGGER_S = 0.4


def case_missing_rank(c: Case, world: int, rank: int, *, max_sms: int) -> None:
    """Ranks 0..W-2 call all_reduce; rank W-1 skips it and waits in a gloo barrier.

    Callers arrive staggered, caller r STAGGER_S * r late (well inside timeout_s), as real ranks do; so
    the late callers must not be named. Callers: CommTimeoutError naming exactly [W-1] after timeout_s
    and before 2 * timeout_s; then the heap is broken (CommError, at once) until reset(). Then every rank
    resets and the group works again.
    """
    T = MISSING_TIMEOUT_S
    assert STAGGER_S * (world - 2) < T / 2, "a late caller would look missing"
    missing = world - 1
    warm = torch.ones(8)
    comm.all_reduce(warm, max_sms=max_sms)  # every rank has the heap before one of them stops calling
    c.equal("warm-up", warm, torch.full((8,), float(world)))
    comm.configure(timeout_s=T)
    dist.barrier()
    if rank != missing:
        time.sleep(STAGGER_S * rank)
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(8), max_sms=max_sms)
            c.fail("all_reduce returned although a rank never called it")
        except comm.CommTimeoutError as e:
            took = time.monotonic() - start
            if e.missing_ranks != [missing]:
                c.fail(f"missing_ranks = {e.missing_ranks}, expected [{missing}] (message: {e})")
            if f"[{missing}]" not in str(e) or "timeout_s" not in str(e):
                c.fail(f"message does not name exactly [{missing}] and timeout_s: {e}")
            if not T <= took <= 2 * T:
                c.fail(f"raised after {took:.2f} s, expected between timeout_s={T} and {2 * T} s")
        start = time.monotonic()
        for name, call in (
            ("all_reduce", lambda: comm.all_reduce(torch.ones(8))),
            ("all_gather", lambda: comm.all_gather_into_tensor(torch.empty(world * 4), torch.ones(4))),
        ):
            problem = expect_raises(call, comm.CommError, "call smptk.comm.reset()")
            if problem:
                c.fail(f"{name} on the broken heap: {problem}")
        if time.monotonic() - start > 1.0:
            c.fail(
                f"calls on the broken heap took {time.monotonic() - start:.2f} s; they should fail at once"
            )
        problem = expect_raises(comm.check, comm.CommTimeoutError, f"[{missing}]")
        if problem:
            c.fail(f"check() after the timeout: {problem}")
    else:
        try:
            comm.check()  # nothing timed out on the rank that skipped
        except Exception as e:
            c.fail(f"check() on the skipping rank raised {type(e).__name__}: {e}")
    dist.barrier()  # the skipping rank waits here until the callers are done
    comm.reset()
    comm.configure(timeout_s=JOB_TIMEOUT_S)
    y = torch.full((8,), float(rank))
    comm.all_reduce(y, max_sms=max_sms)
    c.path("after reset()", "symmetric")
    c.equal("after reset()", y, torch.full((8,), float(sum(range(world)))))


def case_missing_at_build(c: Case, world: int, rank: int) -> None:
    """The first call on a new group builds its heap: ranks 0..W-2 call all_reduce on it, rank W-1 does not
    come (it waits in a gloo barrier). The callers raise CommTimeoutError naming exactly [W-1] within
    [timeout_s, 2 timeout_s] (the build's torch.distributed calls waited for gloo's own 30-minute timeout);
    rank W-1, coming afterwards, raises at once naming the ranks that gave up (no one-sided success); then
    every rank's next call builds the heap and runs."""
    T = MISSING_TIMEOUT_S
    missing, callers = world - 1, list(range(world - 1))
    group = dist.new_group(list(range(world)))
    comm.configure(timeout_s=T)
    try:
        if rank != missing:
            start = time.monotonic()
            call = lambda: comm.all_reduce(torch.ones(8), group=group)
            problem = expect_raises(call, comm.CommTimeoutError, f"group rank(s) [{missing}] did not come")
            took = time.monotonic() - start
            if problem:
                c.fail(f"callers: {problem}")
            elif not T <= took <= 2 * T:
                c.fail(f"raised after {took:.2f} s, expected between timeout_s={T} and {2 * T} s")
        dist.barrier()
        if rank == missing:
            start = time.monotonic()
            try:
                comm.all_reduce(torch.ones(8), group=group)
                c.fail("the late rank's call returned although its peers had given up")
            except comm.CommTimeoutError as e:
                if e.missing_ranks != callers or time.monotonic() - start > T:
                    c.fail(f"late rank: missing_ranks {e.missing_ranks}, expected {callers}, at once: {e}")
        dist.barrier()
        y = torch.full((8,), float(rank))
        comm.all_reduce(y, group=group)
        c.path("after the failed build", "symmetric")
        c.equal("after the failed build", y, torch.full((8,), float(sum(range(world)))))
    finally:
        comm.configure(timeout_s=JOB_TIMEOUT_S)
        comm.reset(group)
        dist.destroy_process_group(group)


class _LateWatchdog:
    """A ``threading.Timer`` that fires as it is cancelled: the interpreter's watchdog of a launch whose
    budget ran out after the kernel's last wait, so that it sets the abort word as the call returns."""

    def __init__(self, interval: float, function: Callable, args: tuple = ()) -> None:
        self.function, self.args, self.daemon = function, args, True

    def start(self) -> None:
        pass

    def cancel(self) -> None:
        self.function(*self.args)

    def join(self) -> None:
        pass


def case_late_watchdog(c: Case, world: int, rank: int) -> None:
    """A call whose watchdog fires as it returns (a launch that took longer than timeout_s, its waits all
    done) is a success, and so is the next call, in which rank 0 waits for its peers.

    The abort word the watchdog sets stayed set: the next call's first wait on rank 0 gave up at once with
    a CommTimeoutError naming live peers ("did not arrive within 2 s" after 0.01 s), and the peers timed out
    waiting for rank 0 (seen with timeout_s 1.5 on a launch of 2 s on a loaded rank).
    """
    comm.configure(timeout_s=MISSING_TIMEOUT_S)
    comm.all_reduce(torch.ones(4))  # the heap exists
    timer = threading.Timer
    threading.Timer = _LateWatchdog  # what smptk.comm.collectives starts for each interpreted launch
    try:
        y = torch.ones(5)
        comm.all_reduce(y)
    finally:
        threading.Timer = timer
    c.equal("the call its watchdog fired for as it ended", y, torch.full((5,), float(world)))
    dist.barrier()
    if rank != 0:
        time.sleep(0.3)  # rank 0 waits for its peers in the next call's barriers
    y = torch.full((5,), float(rank))
    try:
        comm.all_reduce(y)
        c.equal("the next call", y, torch.full((5,), float(sum(range(world)))))
    except comm.CommError as e:
        c.fail(f"the next call raised {type(e).__name__}: {e}")
    dist.barrier()
    comm.reset()
    comm.configure(timeout_s=JOB_TIMEOUT_S)


def case_heap_build(c: Case, world: int, rank: int) -> None:
    """Building a group's heap fails on rank W-1 alone, every rank raises the same error naming it, and the
    next call (the cause gone) builds the heap and runs:

    - rank W-1 configured another heap_bytes: CommMismatchError naming [W-1] and the sizes (before, the
      build went on and failed with an mmap or FileNotFoundError on some ranks only);
    - rank W-1's /dev/shm is full (posix_fallocate raises ENOSPC, as a full tmpfs does): CommError naming
      rank W-1 and heap_bytes (before, the segment was sparse and the first touch of a page /dev/shm could not
      hold killed the process with SIGBUS, no exception).
    """
    import errno
    import os

    odd = world - 1
    for kind in ("heap_bytes", "no_space"):
        group = dist.new_group(list(range(world)))
        real = os.posix_fallocate

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        try:
            if rank == odd and kind == "heap_bytes":
                comm.configure(heap_bytes=2 * HEAP_BYTES)
            if rank == odd and kind == "no_space":
                os.posix_fallocate = full
            if kind == "heap_bytes":
                exc, text, ranks = comm.CommMismatchError, "heap sizes differ between ranks", [odd]
            else:
                exc, ranks = comm.CommError, None
                text = f"could not allocate the {HEAP_BYTES}-byte symmetric heap (rank {odd}:"
            try:
                comm.all_reduce(torch.ones(8), group=group)
                c.fail(f"{kind}: the build succeeded")
            except exc as e:
                if text not in str(e) or (ranks is not None and e.ranks != ranks):
                    c.fail(f"{kind}: {type(e).__name__}: {e}; expected {text!r} naming {ranks}")
            except Exception as e:
                c.fail(f"{kind}: raised {type(e).__name__}: {e}, expected {exc.__name__}")
        finally:
            os.posix_fallocate = real
            comm.configure(heap_bytes=HEAP_BYTES)
        y = torch.full((8,), float(rank))
        comm.all_reduce(y, group=group)
        c.path(f"{kind}: after the failed build", "symmetric")
        c.equal(f"{kind}: after the failed build", y, torch.full((8,), float(sum(range(world)))))
        dist.destroy_process_group(group)
        comm.reset()  # rank W-1's configure(heap_bytes) dropped its heaps: every rank starts afresh


# ------------------------------------------------------------------------- calls that differ across ranks

MISMATCH_LIMIT_S = 10.0  # a mismatch must be reported this fast: far below JOB_TIMEOUT_S, so not by timeout
MISMATCHES = (
    "dtype",
    "numel",
    "empty",
    "op",
    "algorithm",
    "more_programs",
    "fewer_programs",
    "collective",
    "reduce_scatter_numel",
    "all_gather_numel",
    "all_to_all_programs",
)


def _mismatched_call(kind: str, world: int, odd: bool) -> Callable[[], object]:
    """What the ranks call in mismatch case ``kind``: rank W-1 (``odd``) differs from the others once."""
    n = 8
    if kind == "dtype":
        return lambda: comm.all_reduce(torch.ones(n, dtype=torch.float16 if odd else torch.float32))
    if kind == "numel":
        return lambda: comm.all_reduce(torch.ones(n + odd))
    if kind == "empty":  # an empty tensor on one rank only: it returned at once, its peers timed out
        return lambda: comm.all_reduce(torch.ones(0 if odd else n))
    if kind == "op":
        return lambda: comm.all_reduce(torch.ones(n), op="max" if odd else "sum")
    if kind == "algorithm":
        return lambda: comm.all_reduce(torch.ones(n), algorithm="two_shot" if odd else "one_shot")
    if kind in ("more_programs", "fewer_programs"):
        sms = 3 if odd == (kind == "more_programs") else 1
        return lambda: comm.all_reduce(torch.ones(n), max_sms=sms)
    if kind == "collective":
        if odd:
            return lambda: comm.all_gather_into_tensor(torch.empty(world * n), torch.ones(n))
        return lambda: comm.all_reduce(torch.ones(n))
    if kind == "reduce_scatter_numel":
        m = n + odd
        return lambda: comm.reduce_scatter_tensor(torch.empty(m), torch.ones(world * m))
    if kind == "all_gather_numel":
        m = n + odd
        return lambda: comm.all_gather_into_tensor(torch.empty(world * m), torch.ones(m))
    if kind == "all_to_all_programs":
        return lambda: comm.all_to_all_single(
            torch.empty(world * 2), torch.ones(world * 2), max_sms=2 if odd else 1
        )
    raise ValueError(kind)


def case_mismatch(c: Case, world: int, rank: int, *, kind: str) -> None:
    """Rank W-1 makes a different call (one argument differs) from the others.

    Every rank: CommMismatchError within MISMATCH_LIMIT_S (not a timeout), naming exactly the ranks whose
    call differed from its own ([W-1] on the others, all the others on rank W-1) and describing both
    calls; then CommError at once on the broken heap; reset() on every rank makes the group work again.
    """
    odd = rank == world - 1
    expected = list(range(world - 1)) if odd else [world - 1]
    warm = torch.ones(4)
    comm.all_reduce(warm)  # every rank has the heap and has made the same calls so far
    dist.barrier()
    start = time.monotonic()
    try:
        _mismatched_call(kind, world, odd)()
        c.fail("the mismatched call returned")
    except comm.CommMismatchError as e:
        took = time.monotonic() - start
        if e.ranks != expected:
            c.fail(f"ranks = {e.ranks}, expected {expected} (message: {e})")
        if "collective calls differ" not in str(e) or f"rank {expected[0]} made call #" not in str(e):
            c.fail(f"message does not describe the calls: {e}")
        if took > MISMATCH_LIMIT_S:
            c.fail(f"reported after {took:.1f} s (limit {MISMATCH_LIMIT_S} s)")
    except Exception as e:
        c.fail(f"raised {type(e).__name__} instead of CommMismatchError: {e}")
    problem = expect_raises(lambda: comm.all_reduce(torch.ones(4)), comm.CommError, "call smptk.comm.reset()")
    if problem:
        c.fail(f"all_reduce on the broken heap: {problem}")
    dist.barrier()
    comm.reset()
    y = torch.full((5,), float(rank))
    comm.all_reduce(y)
    c.path("after reset()", "symmetric")
    c.equal("after reset()", y, torch.full((5,), float(sum(range(world)))))


# ------------------------------------------------------------------------------------------- catalog


class CaseFailed(RuntimeError):
    """An unexpected exception inside a case (not a failed comparison): ends the job."""


@dataclass(frozen=True)
class Spec:
    """One case: ``fn(case, world, rank, **kwargs)``; ``family`` is fn's name without ``case_``."""

    cid: str
    fn: Callable[..., None]
    kwargs: dict

    @property
    def family(self) -> str:
        return self.fn.__name__.removeprefix("case_")


# Two ranks run every dtype x op (x algorithm for all_reduce). More ranks change how the data is split and
# how many peers each rank reads, not how a dtype is cast or how an op combines, so 3 and 4 ranks run this
# cover instead: every dtype with both algorithms, every op at least once per algorithm except min (one-shot
# only), and reduce_scatter every dtype and every op once (its one-shot rows, plus bf16 sum). 8 + 5 cases
# instead of 30 + 15 keep those jobs inside the suite's time budget.
REDUCTION_COVER = (
    ("float32", "sum", "one_shot"),
    ("float32", "max", "two_shot"),
    ("bfloat16", "avg", "one_shot"),
    ("bfloat16", "sum", "two_shot"),
    ("float16", "min", "one_shot"),
    ("float16", "avg", "two_shot"),
    ("int32", "max", "one_shot"),
    ("int32", "sum", "two_shot"),
)


def catalog(world: int) -> list[Spec]:
    """Every case of a W-rank job, in the order the ranks run them (the ids are the pytest ids)."""
    specs: list[Spec] = []

    def add(cid: str, case: Callable[..., None], **kwargs) -> None:
        specs.append(Spec(cid, case, kwargs))

    for name, *_ in bad_inputs(world):
        add(f"bad_input-{name}", case_bad_input, name=name)
    add("bad_input-then-usable", case_usable_after_errors)
    reductions = [(d, op) for d in DTYPES for op in OPS if (d, op) != ("int32", "avg")]  # int32 avg: fallback
    if world == 2:
        all_reduces = [(d, op, alg) for d, op in reductions for alg in ALGORITHMS]
        reduce_scatters = reductions
    else:  # a cover: see REDUCTION_COVER
        all_reduces = REDUCTION_COVER
        one_shot_rows = [(d, op) for d, op, alg in REDUCTION_COVER if alg == "one_shot"]
        reduce_scatters = [*one_shot_rows, ("bfloat16", "sum")]
    for dtype, op, alg in all_reduces:
        add(f"all_reduce-{dtype}-{op}-{alg}", case_all_reduce, dtype=dtype, op=op, algorithm=alg)
    for alg in ALGORITHMS:
        add(f"all_reduce-0d-{alg}", case_all_reduce_shape, shape=(), algorithm=alg)
        add(f"all_reduce-7x13-{alg}", case_all_reduce_shape, shape=(7, 13), algorithm=alg)
        for sms in (1, 3, 5):  # 1001 elements = 4 interpreter tiles: fewer, uneven, more programs than tiles
            add(
                f"all_reduce-max_sms{sms}-{alg}",
                case_all_reduce_shape,
                shape=(1001,),
                max_sms=sms,
                algorithm=alg,
            )
    for dtype, op in reduce_scatters:
        add(f"reduce_scatter-{dtype}-{op}", case_reduce_scatter, dtype=dtype, op=op)
    for dtype in ("float32", "bfloat16"):
        add(f"nan-{dtype}", case_nan, dtype=dtype)
    add("reduce_scatter-3x5", case_reduce_scatter_shape, out_shape=(3, 5))
    add("reduce_scatter-stacked-3x5", case_reduce_scatter_shape, out_shape=(3, 5), stacked=True)
    add("reduce_scatter-max_sms3", case_reduce_scatter_shape, out_shape=(301,), max_sms=3)
    for dtype in DTYPES:
        add(f"all_gather-{dtype}", case_all_gather, dtype=dtype)
    for dtype in ("bfloat16", "int32"):
        add(f"all_gather-copy_engine-{dtype}", case_all_gather, dtype=dtype, algorithm="copy_engine")
    add("all_gather-7x3", case_all_gather_shape, in_shape=(7, 3))
    add("all_gather-stacked-7x3", case_all_gather_shape, in_shape=(7, 3), stacked=True)
    add("all_gather-max_sms5", case_all_gather_shape, in_shape=(1001,), max_sms=5)
    for pattern, row_shape in (("uneven", (3, 2)), ("silent", (4,)), ("beyond_heap", (5,))):
        for dtype in DTYPES:
            add(
                f"all_to_all-{pattern}-{dtype}",
                case_all_to_all,
                pattern=pattern,
                dtype=dtype,
                row_shape=row_shape,
            )
    add("all_to_all-empty-float32", case_all_to_all, pattern="empty", dtype="float32", row_shape=(4,))
    for pattern, row_shape in (("uneven", (3, 2)), ("beyond_heap", (5,))):
        add(
            f"all_to_all-{pattern}-copy_engine",
            case_all_to_all,
            pattern=pattern,
            dtype="bfloat16",
            row_shape=row_shape,
            algorithm="copy_engine",
        )
    a2a = {"case": case_all_to_all, "dtype": "float32"}
    add("all_to_all-uneven-tensor-splits", **a2a, pattern="uneven", row_shape=(2,), splits="tensors")
    add("all_to_all-beyond_heap-agreed", **a2a, pattern="beyond_heap", row_shape=(5,), splits="agreed")
    # a rank with no rows counts the rounds from its rows' width too (it took 0 and ran 1 round, the
    # others several: a CommMismatchError; an expert-parallel rank without tokens did this)
    add("all_to_all-idle-agreed", **a2a, pattern="idle_beyond_heap", row_shape=(5,), splits="agreed")
    for alg in ("kernel", "copy_engine"):
        add(f"split_mismatch-{alg}", case_split_mismatch, algorithm=alg)
    add("split_mismatch-fallback", case_split_mismatch, algorithm="auto", dtype="float64")
    for collective in ("all_gather", "reduce_scatter", "all_to_all"):
        for dtype in ("float32", "float64"):
            add(f"aliased-{collective}-{dtype}", case_aliased, collective=collective, dtype=dtype)
    add(
        "all_to_all-uneven-max_sms3",
        case_all_to_all,
        pattern="uneven",
        dtype="float32",
        row_shape=(3, 2),
        max_sms=3,
    )
    add("all_to_all-none-splits-2d", case_all_to_all_equal, in_shape_per_rank=(3, 2))
    add("all_to_all-none-splits-1d", case_all_to_all_equal, in_shape_per_rank=(5,))
    add("all_to_all-none-in-explicit-out", case_all_to_all_equal, in_shape_per_rank=(2, 3), explicit_out=True)
    add("subgroup", case_subgroup)
    add("subgroup-non-member", case_subgroup_non_member)
    add("interleaved", case_interleaved, iterations=4)
    add("fallback-float64", case_fallback, which="float64")
    add("fallback-int32_avg", case_fallback, which="int32_avg")
    # Last: these break the heap on purpose (then reset and rebuild it).
    for kind in MISMATCHES:
        add(f"mismatch-{kind}", case_mismatch, kind=kind)
    add("missing_at_build", case_missing_at_build)
    add("heap_build", case_heap_build)
    add("late_watchdog", case_late_watchdog)
    add("missing_rank-max_sms1", case_missing_rank, max_sms=1)
    add("missing_rank-max_sms3", case_missing_rank, max_sms=3)
    return specs


def run_job(rank: int, world: int, families: tuple[str, ...] | None = None) -> dict[str, str | None]:
    """The spawned ranks' target: run every case of ``catalog(world)`` (or of these case families, to
    debug one: ``run_ranks("comm_jobs:run_job", 2, args=(("mismatch",),))``); {case id: None or failures}."""
    comm.configure(max_sms=JOB_MAX_SMS, timeout_s=JOB_TIMEOUT_S, heap_bytes=HEAP_BYTES)
    outcomes: dict[str, str | None] = {}
    for spec in catalog(world):
        if families is not None and spec.family not in families:
            continue
        c = Case(spec.cid, [])
        try:
            spec.fn(c, world, rank, **spec.kwargs)
        except Exception as e:
            raise CaseFailed(f"case {spec.cid} on rank {rank}: {type(e).__name__}: {e}") from e
        outcomes[spec.cid] = "\n".join(c.problems) or None
    return outcomes


# ------------------------------------------------------------------------------- the call check's race


def peer_moves_on_while_read(rank: int, world: int) -> dict:
    """Two identical calls on every rank (an all-gather, then an all-reduce of another size) while the
    call check is made to read slowly: rank 1 pauses after the all-gather's first barrier, so rank 0 waits
    for it in a later barrier and polls its announcement (``_differs``); rank 0 pauses between reading
    rank 1's tag and its numel / chunk words, long enough for rank 1 to finish the all-gather and announce
    the all-reduce. The words then belong to the next call: read against the earlier tag they made a
    false CommMismatchError (seen as a flaky 4-rank test on a loaded machine). Returns what each rank
    saw: its error (None) and how many slow reads it made."""
    import smptk.kernels.collectives as K

    comm.configure(max_sms=1, timeout_s=JOB_TIMEOUT_S, heap_bytes=HEAP_BYTES)
    comm.all_reduce(torch.ones(4))  # the heap exists before the pauses start
    slow_reads = []
    if rank == 1:
        verify = K._verify

        def late_verify(*args, **kwargs):
            time.sleep(1.0)
            return verify(*args, **kwargs)

        K._verify = late_verify  # the interpreter looks kernel helpers up at each call
    else:
        call_args = K._call_args

        def slow_call_args(peer_call, zero):
            if len(slow_reads) < 3:
                slow_reads.append(1)
                time.sleep(2.0)  # the tag was read; rank 1 finishes and announces its next call meanwhile
            return call_args(peer_call, zero)

        K._call_args = slow_call_args
    out = torch.empty(world * 16, dtype=torch.int32)
    error = None
    try:
        comm.all_gather_into_tensor(out, torch.full((16,), rank, dtype=torch.int32))
        comm.all_reduce(torch.ones(7))
    except comm.CommError as e:
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "slow_reads": len(slow_reads)}


# --------------------------------------------------------------------------------- harness self-tests


def fail_while_peer_waits(rank: int, world: int) -> str:
    """Rank 1 raises after the heap exists while rank 0 waits in a kernel for it (for the harness test)."""
    comm.configure(max_sms=1, timeout_s=JOB_TIMEOUT_S, heap_bytes=HEAP_BYTES)
    comm.all_reduce(torch.ones(4))
    if rank == 1:
        raise RuntimeError("planted failure on rank 1")
    comm.all_reduce(torch.ones(4))  # waits for rank 1 until the harness kills it
    return "rank 0 should not get here"


def hang(rank: int, world: int) -> None:
    """Every rank hangs (rank 0 in a kernel waiting for rank 1, which sleeps): for the deadline test."""
    comm.configure(max_sms=1, timeout_s=300, heap_bytes=HEAP_BYTES)
    comm.all_reduce(torch.ones(4))
    if rank == 0:
        comm.all_reduce(torch.ones(4))
    time.sleep(300)
