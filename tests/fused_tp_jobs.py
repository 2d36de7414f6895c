"""The multi-rank side of ``tests/test_fused_tp.py``: ``comm.fused_linear.all_gather_linear`` and
``linear_reduce_scatter`` on W gloo ranks.

Every rank builds every member's block of x, weight shard, bias shard and upstream gradient from one seed,
so each knows the whole problem; the reference is plain float64 torch on those full tensors: ``out_r =
act(X @ W_r.T + b_r)`` for this rank r, and the gradients of ``sum over ranks q of <U_q, out_q>`` (x's
gradient sums every rank's term, restricted to this rank's rows; W_r's and b_r's come from rank r's term).

Cases (each returns None or what went wrong; a failure is recorded and the job goes on, but the last):

- ``fused_gelu_bias``: fp32 with bias and GELU, 2 copy programs (a block's flag must reach 2): path
  "fused", values and all three gradients against the reference, and the gathered input (``gathered_out``)
  equal to the ranks' blocks exactly.
- ``fused_plain``: fp32, no bias, no activation, 1 copy program; the second fused call on the heap, so
  it restages this rank's region after the first call's closing barrier.
- ``unfused``: ``algorithm="unfused"`` takes the fallback (all_gather, then fused_linear) and says so,
  same checks.
- ``bad_input``: a 3-D x_local and a wrong bias shape raise ValueError naming the argument.
- ``mismatch``: rank 0 calls the all-gather GEMM while the others call a plain all-gather with the same
  block: every rank raises CommMismatchError, and the message names each side's call by its own kind
  ("all_gather_linear" against "all_gather"). The heap is rebuilt after it.
- ``shape_mismatch``: blocks of one element count in other shapes, in either fused linear: every rank
  raises CommMismatchError naming both shapes.
- ``missing_rank``: rank W-1 never calls; every other rank raises CommTimeoutError naming [W-1]
  within the short timeout.

The fused cases also require ``last_backward_path() == "fused"``: x's gradient came out of one GEMM +
reduce-scatter launch; the unfused ones the forward's ``"unfused: <why>"`` (it kept the last fused
backward's name). ``linear_reduce_scatter`` (every rank holds all ``W * T_w`` rows of its ``K``
input features and an ``[N_LOCAL, K]`` weight shard; the reference sums the ranks' float64 products and
keeps each rank's block, + bias; its backward ran inside one all-gather GEMM launch):

- ``scatter_bias``: fp32 with bias, 2 reduce programs; ``scatter_plain``: no bias, 1 program, the second
  call on the heap (the arrival words of the first call must not count); ``scatter_unfused``: the
  fallback, same checks.
- ``scatter_bad_input``: a 3-D x, rows that do not divide among the ranks, a wrong bias shape,
  ``algorithm="fused"`` where the partials exceed the heap: ValueError naming the argument, on every rank.
- ``selective``: the pair as one block under smptk's selective checkpointing: backward launches only the
  two backward kernels and the all-gather of x's block for dW, as the plain pair does (the forwards'
  outputs are kept), full checkpointing launches the forwards again; gradients equal the plain pair's
  exactly.
- ``flops``: the fused pair forward and backward (both backwards fused) under FlopCounterMode counts what
  the plain-torch twin on this rank's shards counts.
- ``scatter_missing_rank`` (last): as ``missing_rank``, on a heap rebuilt after it.

Sizes are tiny and odd (T_w = 5 at W = 2, 7 at W = 4; K = 24 < one K step; N_local = 40: two column tiles,
the second partial), as the interpreter runs each program in Python.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import smptk.comm as comm
from smptk.comm.fused_linear import all_gather_linear, last_backward_path, linear_reduce_scatter

K, N_LOCAL = 24, 40
ROWS = {2: 5, 4: 7}
ACTS = {None: lambda z: z, "gelu": F.gelu}


def _problem(world: int, seed: int, dtype: torch.dtype):
    """Every rank's (x block, weight shard, bias shard, upstream grad), in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    t_w = ROWS[world]

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    xs = [rand(t_w, K) for _ in range(world)]
    ws = [rand(N_LOCAL, K, scale=0.3) for _ in range(world)]
    bs = [rand(N_LOCAL) for _ in range(world)]
    us = [rand(world * t_w, N_LOCAL) for _ in range(world)]
    return xs, ws, bs, us


def _reference(rank: int, xs, ws, bs, us, activation, use_bias: bool):
    """float64 (out_r, dx_r, dW_r, db_r) from the full tensors."""
    X = torch.cat([x.double() for x in xs]).requires_grad_()
    Wq = [w.double().requires_grad_() for w in ws]
    Bq = [b.double().requires_grad_() for b in bs]
    outs = [ACTS[activation](F.linear(X, Wq[q], Bq[q] if use_bias else None)) for q in range(len(ws))]
    loss = sum((o * u.double()).sum() for o, u in zip(outs, us, strict=True))
    loss.backward()
    t_w = xs[0].shape[0]
    db = Bq[rank].grad if use_bias else None
    return outs[rank].detach(), X.grad[rank * t_w : (rank + 1) * t_w], Wq[rank].grad, db


def _compare(name: str, got, want, tol: float) -> list[str]:
    if got is None and want is None:
        return []
    try:
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    except AssertionError as e:
        return [f"{name}: {str(e).splitlines()[0:4]}"]
    return []


def _check_case(
    rank, world, seed, dtype, activation, use_bias, max_sms, want_path, algorithm="auto"
) -> str | None:
    xs, ws, bs, us = _problem(world, seed, dtype)
    ref = _reference(rank, xs, ws, bs, us, activation, use_bias)
    problems = []
    x = xs[rank].clone().requires_grad_()
    w = ws[rank].clone().requires_grad_()
    b = bs[rank].clone().requires_grad_() if use_bias else None
    gathered = torch.full((world * xs[0].shape[0], K), float("nan"), dtype=dtype)
    out, path = all_gather_linear(
        x,
        w,
        b,
        group=None,
        activation=activation,
        max_sms=max_sms,
        gathered_out=gathered,
        algorithm=algorithm,
    )
    if not path.startswith(want_path):
        problems.append(f"path {path!r}, expected {want_path!r}")
    if not torch.equal(gathered, torch.cat(xs)):
        problems.append("gathered_out differs from the ranks' blocks")
    grads = torch.autograd.grad(out, [x, w] + ([b] if use_bias else []), us[rank])
    want_backward = "fused" if want_path == "fused" else path  # an unfused call's backward: its reason
    if last_backward_path() != want_backward:
        problems.append(f"backward path {last_backward_path()!r}, expected {want_backward!r}")
    tol = 1e-4  # fp32 against float64, K = 24
    problems += _compare("out", out, ref[0], tol)
    problems += _compare("dx", grads[0], ref[1], tol)
    problems += _compare("dw", grads[1], ref[2], tol)
    problems += _compare("db", grads[2] if use_bias else None, ref[3], tol)
    return "; ".join(problems) or None


def _bad_input(rank: int, world: int) -> str | None:
    from comm_checks import expect_raises

    x = torch.zeros(1, ROWS[world], K)
    w = torch.zeros(N_LOCAL, K)
    problems = [
        expect_raises(lambda: all_gather_linear(x, w, group=None), ValueError, "x_local"),
        expect_raises(lambda: all_gather_linear(x[0], w, torch.zeros(3), group=None), ValueError, "bias"),
        expect_raises(
            lambda: all_gather_linear(x[0], w.half(), group=None),
            TypeError,
            "weight_local: dtype torch.float16 does not match x_local's torch.float32",  # named it "x"
        ),
    ]
    return "; ".join(p for p in problems if p) or None


def _scatter_problem(world: int, seed: int):
    """Every rank's (x [W * T_w, K], weight shard [N_LOCAL, K]), the bias [N_LOCAL] and every rank's upstream
    gradient block [T_w, N_LOCAL], fp32."""
    gen = torch.Generator().manual_seed(seed)
    t = world * ROWS[world]

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).float()

    xs = [rand(t, K) for _ in range(world)]
    ws = [rand(N_LOCAL, K, scale=0.3) for _ in range(world)]
    return xs, ws, rand(N_LOCAL), [rand(ROWS[world], N_LOCAL) for _ in range(world)]


def _check_scatter(rank, world, seed, use_bias, max_sms, want_path, algorithm="auto") -> str | None:
    xs, ws, bias, us = _scatter_problem(world, seed)
    X = [x.double().requires_grad_() for x in xs]
    Wq = [w.double().requires_grad_() for w in ws]
    B = bias.double().requires_grad_()
    total = sum(x @ w.T for x, w in zip(X, Wq, strict=True)) + (B if use_bias else 0)
    (total * torch.cat(us).double()).sum().backward()
    t_w = ROWS[world]
    x = xs[rank].clone().requires_grad_()
    w = ws[rank].clone().requires_grad_()
    b = bias.clone().requires_grad_() if use_bias else None
    out, path = linear_reduce_scatter(x, w, b, group=None, max_sms=max_sms, algorithm=algorithm)
    problems = [] if path.startswith(want_path) else [f"path {path!r}, expected {want_path!r}"]
    grads = torch.autograd.grad(out, [x, w] + ([b] if use_bias else []), us[rank])
    want_backward = "fused" if want_path == "fused" else path  # an unfused call's backward: its reason
    if last_backward_path() != want_backward:
        problems.append(f"backward path {last_backward_path()!r}, expected {want_backward!r}")
    tol = 1e-4  # fp32 against float64, K = 24, W terms
    problems += _compare("out", out, total[rank * t_w : (rank + 1) * t_w].detach(), tol)
    problems += _compare("dx", grads[0], X[rank].grad, tol)
    problems += _compare("dw", grads[1], Wq[rank].grad, tol)
    problems += _compare("db", grads[2] if use_bias else None, B.grad if use_bias else None, tol)
    return "; ".join(problems) or None


def _scatter_bad_input(rank: int, world: int) -> str | None:
    from comm_checks import expect_raises

    t = world * ROWS[world]
    x, w = torch.zeros(t, K), torch.zeros(N_LOCAL, K)
    big_w = torch.zeros(64 * 1024 // (4 * t) + 1, 1)  # the partials of [t, 1] x [.., 1]: past the 64 KiB heap
    problems = [
        expect_raises(lambda: linear_reduce_scatter(x[None], w, group=None), ValueError, "x: expected a 2-D"),
        expect_raises(lambda: linear_reduce_scatter(x[1:], w, group=None), ValueError, "do not divide"),
        expect_raises(lambda: linear_reduce_scatter(x, w, torch.zeros(3), group=None), ValueError, "bias"),
        expect_raises(
            lambda: linear_reduce_scatter(torch.zeros(t, 1), big_w, group=None, algorithm="fused"),
            ValueError,
            "exceed heap_bytes",
        ),
    ]
    return "; ".join(p for p in problems if p) or None


def _mismatch(rank: int, world: int) -> str | None:
    """Rank 0 in the all-gather GEMM, the others in a plain all-gather of the same block: CommMismatchError
    on every rank, naming both kinds of call."""
    xs, ws, bs, _ = _problem(world, 4, torch.float32)
    if rank == 0:
        mine, theirs = "all_gather_linear", "all_gather"
        try:
            all_gather_linear(xs[0], ws[0], bs[0], group=None, max_sms=1)
        except comm.CommMismatchError as e:
            error = str(e)
        else:
            error = None
    else:
        mine, theirs = "all_gather", "all_gather_linear"
        out = torch.empty(world * xs[rank].numel())
        try:
            comm.all_gather_into_tensor(out, xs[rank].reshape(-1), max_sms=1)
        except comm.CommMismatchError as e:
            error = str(e)
        else:
            error = None
    comm.reset()
    _rebuilt_heap()
    if error is None:
        return "no CommMismatchError"
    this, _, others = error.partition("; ")
    if f": {mine} float32" not in this or f": {theirs} float32" not in others:
        return f"the message does not name this rank's {mine} and the peers' {theirs}: {error!r}"
    return None


def _shape_mismatch(rank: int, world: int) -> str | None:
    """Blocks of one element count in other shapes: rank 0's x block [6, 4] against the others' [4, 6] in
    the all-gather GEMM, and rank 0's output block [3, 4] against the others' [2, 6] in the GEMM +
    reduce-scatter (rows and weight rows traded): CommMismatchError on every rank naming both shapes (the
    count alone was compared, and every rank read the others' blocks in its own shape, silently)."""
    x_ag, w_ag = ((6, 4), (3, 4)) if rank == 0 else ((4, 6), (3, 6))
    x_rs, w_rs = ((world * 3, 5), (4, 5)) if rank == 0 else ((world * 2, 5), (6, 5))
    calls = {
        ("block 6 x 4", "block 4 x 6"): lambda: all_gather_linear(
            torch.ones(x_ag), torch.ones(w_ag), group=None, max_sms=1
        ),
        ("output block 3 x 4", "output block 2 x 6"): lambda: linear_reduce_scatter(
            torch.ones(x_rs), torch.ones(w_rs), group=None, max_sms=1
        ),
    }
    problems = []
    for shapes, call in calls.items():
        try:
            call()
        except comm.CommMismatchError as e:
            if not all(s in str(e) for s in shapes):
                problems.append(f"the message does not name {shapes}: {e}")
        else:
            problems.append(f"no CommMismatchError for {shapes}")
        comm.reset()
        _rebuilt_heap()
    return "; ".join(problems) or None


def _missing_rank(rank: int, world: int, op: str = "all_gather") -> str | None:
    """Rank W-1 never calls ``op``'s fused linear; the others must raise CommTimeoutError naming it."""
    from comm_checks import expect_raises

    comm.configure(timeout_s=3)  # the heap exists from the cases before (building one is collective)
    problem = None
    if rank != world - 1:
        xs, ws, bs, _ = _problem(world, 5, torch.float32)
        xs_t, ws_t, *_ = _scatter_problem(world, 5)
        calls = {
            "all_gather": lambda: all_gather_linear(xs[rank], ws[rank], bs[rank], group=None, max_sms=1),
            "reduce_scatter": lambda: linear_reduce_scatter(xs_t[rank], ws_t[rank], group=None, max_sms=1),
        }
        t0 = time.monotonic()
        problem = expect_raises(calls[op], comm.CommTimeoutError, f"[{world - 1}]")
        if problem is None and time.monotonic() - t0 > 60:
            problem = f"took {time.monotonic() - t0:.0f} s to give up with a 3 s timeout"
    dist.barrier()  # the missing rank stays alive (its heap mapped) until the others have given up
    comm.reset()
    return problem


class _CountLaunches:
    """Counts the collective launches (``smptk.comm.collectives._launch``: every fused linear's kernel) in a
    ``with`` block."""

    def __enter__(self):
        from smptk.comm import collectives

        self.module, self.original, self.count = collectives, collectives._launch, 0

        def counted(*args, **kwargs):
            self.count += 1
            return self.original(*args, **kwargs)

        collectives._launch = counted
        return self

    def __exit__(self, *exc) -> None:
        self.module._launch = self.original


def _selective(rank: int, world: int, seed: int) -> str | None:
    """The fused pair (all_gather_linear with GELU, then linear_reduce_scatter) as a block under smptk's
    selective checkpointing: the forwards are the dispatcher ops smptk::all_gather_linear_fwd and
    smptk::linear_reduce_scatter_fwd, whose outputs the policy keeps, so backward launches only the two
    backward kernels and the all-gather of x's block for dW (as the plain pair does); full checkpointing
    launches the two forwards again. Gradients equal the plain pair's."""
    from torch.utils.checkpoint import checkpoint

    from smptk.parallel.checkpointing import _selective_contexts

    xs, ws, bs, _ = _problem(world, seed, torch.float32)
    w2 = torch.randn(6, N_LOCAL, generator=torch.Generator().manual_seed(seed + rank), dtype=torch.float32)
    up = torch.randn(ROWS[world], 6, generator=torch.Generator().manual_seed(seed + 99))

    def block(x, w, b, w2):
        y, _ = all_gather_linear(x, w, b, group=None, activation=activation, algorithm="fused")
        return linear_reduce_scatter(y, w2, group=None, algorithm="fused")[0]

    problems, grads = [], {}
    # no activation: the op returns no z and no gathered input, two empty outputs that must not alias
    # (torch refuses aliased outputs of a custom op under the selective policy's dispatch mode)
    activation = None
    leaves = [t.clone().requires_grad_() for t in (xs[rank], ws[rank], bs[rank], w2)]
    got = torch.autograd.grad(
        checkpoint(block, *leaves, use_reentrant=False, context_fn=_selective_contexts), leaves, up
    )
    ref = torch.autograd.grad(block(*leaves), leaves, up)
    problems += [f"no activation, selective: grad {i} differs" for i in range(4) if not got[i].equal(ref[i])]
    activation = "gelu"
    for mode in ("plain", "selective", "full"):
        leaves = [t.clone().requires_grad_() for t in (xs[rank], ws[rank], bs[rank], w2)]
        if mode == "plain":
            out = block(*leaves)
        else:
            kw = {"context_fn": _selective_contexts} if mode == "selective" else {}
            out = checkpoint(block, *leaves, use_reentrant=False, **kw)
        with _CountLaunches() as launches:
            grads[mode] = torch.autograd.grad(out, leaves, up)
        # the two backward kernels and the all-gather of x for dW (the forward keeps x's block), under
        # selective checkpointing too (the policy keeps the forwards' outputs: no forward launch);
        # full: the two forwards again too
        want = {"plain": 3, "selective": 3, "full": 5}[mode]
        if launches.count != want:
            problems.append(f"{mode}: backward launched {launches.count} kernels, expected {want}")
    for mode in ("selective", "full"):
        for name, got, ref in zip(("dx", "dw", "db", "dw2"), grads[mode], grads["plain"], strict=True):
            if not torch.equal(got, ref):
                problems.append(f"{mode} {name}: differs from the plain pair by {(got - ref).abs().max()}")
    return "; ".join(problems) or None


def _flops(rank: int, world: int, seed: int) -> str | None:
    """The fused pair (all_gather_linear with GELU and bias, then linear_reduce_scatter), forward and backward
    under FlopCounterMode, both backwards fused: the count equals the plain-torch twin's on this rank's
    shards (each backward's dx is the other op's fused kernel, counted through its dispatcher op)."""
    from torch.utils.flop_counter import FlopCounterMode

    xs, ws, bs, _ = _problem(world, seed, torch.float32)
    w2 = torch.randn(6, N_LOCAL, generator=torch.Generator().manual_seed(seed + rank))
    counts = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_() for t in (xs[rank], ws[rank], bs[rank], w2)]
        with FlopCounterMode(display=False) as counter:
            if fused:
                y, _ = all_gather_linear(*leaves[:3], group=None, activation="gelu", algorithm="fused")
                linear_reduce_scatter(y, leaves[3], group=None, algorithm="fused")[
                    0
                ].square().sum().backward()
            else:  # this rank's share of the work in plain torch: all rows times its shards
                y = F.gelu(F.linear(torch.cat(xs).requires_grad_(), leaves[1], leaves[2]))
                F.linear(y, leaves[3]).square().sum().backward()
        counts.append(counter.get_total_flops())
    want = 3 * 2 * world * ROWS[world] * N_LOCAL * (K + 6)  # forward, dx and dW of both GEMMs
    if counts != [want, want] or last_backward_path() != "fused":
        return f"counted {counts} (fused, plain torch), expected {want}; backward {last_backward_path()!r}"
    return None


def run(rank: int, world: int) -> dict[str, str | None]:
    f32 = torch.float32
    return {
        "fused_gelu_bias": _check_case(rank, world, 1, f32, "gelu", True, 2, "fused"),
        "fused_plain": _check_case(rank, world, 2, f32, None, False, 1, "fused"),
        "unfused": _check_case(
            rank, world, 3, f32, "gelu", True, 1, "unfused: algorithm", algorithm="unfused"
        ),
        "bad_input": _bad_input(rank, world),
        "mismatch": _mismatch(rank, world),
        "shape_mismatch": _shape_mismatch(rank, world),
        "missing_rank": _missing_rank(rank, world),
        "scatter_bias": _rebuilt_heap() or _check_scatter(rank, world, 6, True, 2, "fused"),
        "scatter_plain": _check_scatter(rank, world, 7, False, 1, "fused"),
        "selective": _selective(rank, world, 9),
        "flops": _flops(rank, world, 10),
        "scatter_unfused": _check_scatter(rank, world, 8, True, 1, "unfused: algorithm", algorithm="unfused"),
        "scatter_bad_input": _scatter_bad_input(rank, world),
        "scatter_missing_rank": _missing_rank(rank, world, "reduce_scatter"),
    }


def _rebuilt_heap() -> None:
    """After ``missing_rank``'s reset: one collective call on every rank builds the next heap."""
    comm.configure(timeout_s=30)
    comm.all_reduce(torch.ones(4))
