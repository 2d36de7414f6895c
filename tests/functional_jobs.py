"""The multi-rank side of ``tests/test_comm_functional.py``: smptk.comm.functional on W gloo ranks.

Each check builds every member's input from one seed (so each rank knows all of them), runs the op on
its own input, takes ``torch.autograd.grad`` of the output against a seeded upstream gradient, and
compares both with a single-process reference: plain torch ops (cat, stack().sum / mean / amax / amin,
split) on float64 copies of all members' inputs, differentiated by torch's autograd with the objective
the module documents (the sum over ranks of ``<upstream_q, output_q>``; for ``reduce_from_group`` one
shared upstream gradient, counted once; for ``copy_to_group`` one replicated input).

Inputs and upstream gradients are small integers (-3..3): every sum, every average over W = 2 or 4 and
every gather or exchange is then exact in fp32, so values and gradients are compared exactly, and
max / min see many ties (the tie-split subgradient divides by 2 or 3, which both sides round once).

What the cases cover: every op along dim 0 and a non-zero dim, odd sizes, non-contiguous inputs, the
four group forms (ProcessGroup, 1-D DeviceMesh, (mesh, name), (mesh, index)) with a sub-group of 2
ranks at W = 4, uneven all-to-all splits with empty ones (lists, tensors, None, agreed_max_split),
fp32 on the symmetric heap and float64 on the torch.distributed fallback (``last_path()`` after the
forward and the backward), bad input raising the same error on every rank, a second derivative
raising, and the ops under selective checkpointing (their outputs kept: no forward collective runs
again in backward). A failed comparison is recorded and the job goes on; any other exception ends the job.

Example::

    >>> from comm_harness import run_ranks
    >>> run_ranks("functional_jobs:run", world=2, timeout_s=120).values[0]   # {case: None or problems}
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import smptk.comm as comm
import smptk.comm.functional as F

HEAP = ("symmetric", torch.float32)  # the path fp32 takes under the harness (TRITON_INTERPRET=1)
FALLBACK = ("torch.distributed:gloo", torch.float64)  # no kernel dtype: torch.distributed runs it


class _Ctx:
    """This rank's groups: "pg" (the world ProcessGroup), "none" (None = the world), "mesh1" (a 1-D
    DeviceMesh over the world), "sub" / "sub_idx" (dim "b" of a (W/2, 2) mesh, by name and index)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        mesh1 = init_device_mesh("cpu", (world,), mesh_dim_names=("w",))
        self.mesh2 = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("a", "b"))
        self.groups = {
            "pg": dist.group.WORLD,
            "none": None,
            "mesh1": mesh1,
            "sub": (self.mesh2, "b"),
            "sub_idx": (self.mesh2, 1),
        }
        self.seed = 0

    def members(self, name: str) -> tuple[list[int], int]:
        """(global ranks of the group, this rank's index in it)."""
        pg = F.resolve_group(self.groups[name])
        return dist.get_process_group_ranks(pg), dist.get_rank(pg)

    def next_seed(self) -> int:
        self.seed += 1
        return self.seed


def _ints(shape: tuple[int, ...], seed: int, who: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1009 + who)
    return torch.randint(-3, 4, shape, generator=gen).to(dtype)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dimensions' strides swapped (not contiguous)."""
    return t.mT.contiguous().mT if t.dim() >= 2 else t


def _same(problems: list[str], label: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    if got.shape != ref.shape:
        problems.append(f"{label}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
        return
    ref = ref.to(got.dtype)
    if not torch.equal(got, ref):
        bad = (got != ref).nonzero()
        where = tuple(bad[0].tolist())
        problems.append(
            f"{label}: {len(bad)} of {ref.numel()} elements differ; at {where} got {got[where].item()}, "
            f"expected {ref[where].item()}"
        )


def _check(
    ctx: _Ctx,
    problems: list[str],
    label: str,
    group: str,
    path: tuple[str, torch.dtype],
    shape_of: Callable[[int, int], tuple[int, ...]],
    op: Callable[[torch.Tensor, object], torch.Tensor],
    reference: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    *,
    strided: bool = False,
    replicated_input: bool = False,
    replicated_grad: bool = False,
    runs_forward: bool = True,
    runs_backward: bool = True,
) -> None:
    """One op on every member of ``group`` vs ``reference``: output and input gradient, exactly.

    ``shape_of(i, n)``: member i's input shape in a group of n; ``op(x, group)`` the op under test;
    ``reference(inputs)``: every member's output from float64 leaves of every member's input.
    ``runs_forward`` / ``runs_backward``: whether that pass runs a collective (``last_path`` checked).
    """
    ranks, me = ctx.members(group)
    n = len(ranks)
    label = f"{label} [{group}, {path[1]}]"
    want_path, dtype = path
    seed = ctx.next_seed()
    inputs = [_ints(shape_of(i, n), seed, 0 if replicated_input else i, dtype) for i in range(n)]
    leaves = [t.double().requires_grad_() for t in inputs[: 1 if replicated_input else n]]
    outs = reference(leaves * n if replicated_input else leaves)
    ups = [
        _ints(tuple(o.shape), seed + 10**6, 0 if replicated_grad else i, dtype) for i, o in enumerate(outs)
    ]
    objective = (
        (outs[0] * ups[0].double()).sum()
        if replicated_grad
        else sum((o * u.double()).sum() for o, u in zip(outs, ups, strict=True))
    )
    ref_grads = torch.autograd.grad(objective, leaves)

    x = (_strided(inputs[me]) if strided else inputs[me].clone()).requires_grad_()
    y = op(x, ctx.groups[group])
    if runs_forward and comm.last_path() != want_path:
        problems.append(f"{label}: forward took {comm.last_path()!r}, expected {want_path!r}")
    (dx,) = torch.autograd.grad(y, x, _strided(ups[me]) if strided else ups[me])
    if runs_backward and comm.last_path() != want_path:
        problems.append(f"{label}: backward took {comm.last_path()!r}, expected {want_path!r}")
    if runs_forward and not y.is_contiguous():
        problems.append(f"{label}: output not contiguous (strides {y.stride()})")
    if runs_forward and y._is_view():  # an output view refuses in-place updates (out += residual)
        problems.append(f"{label}: the output is a view")
    _same(problems, f"{label} output", y.detach(), outs[me].detach())
    _same(problems, f"{label} grad", dx, ref_grads[0 if replicated_input else me])
    if not torch.equal(x.detach(), inputs[me]):
        problems.append(f"{label}: the op changed its input")


def _reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack(xs)
    return {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]


def case_all_gather(ctx: _Ctx, problems: list[str]) -> None:
    def run(group: str, path, shape, dim: int, **kw) -> None:
        _check(ctx, problems, f"all_gather dim={dim} {shape}", group, path, lambda i, n: shape,
               lambda x, g: F.all_gather(x, g, dim=dim),
               lambda xs: [torch.cat(xs, dim)] * len(xs), **kw)  # fmt: skip

    run("pg", HEAP, (3, 5), 0)
    run("sub", HEAP, (2, 3, 5), 1, strided=True)
    run("mesh1", FALLBACK, (1, 7), -1)
    # the backward is differentiable once: asked for a graph of the gradient, it raises, naming the op
    x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    up = torch.ones(2 * ctx.world, 3, dtype=torch.float64, requires_grad=True)
    try:
        torch.autograd.grad(F.all_gather(x, None), x, up, create_graph=True)
        problems.append("second derivative: no error")
    except RuntimeError as e:
        if "all_gather: no second derivative" not in str(e):
            problems.append(f"second derivative: unexpected error {e}")


def case_reduce_scatter(ctx: _Ctx, problems: list[str]) -> None:
    def run(group: str, path, shape_of, dim: int, op: str, **kw) -> None:
        _check(ctx, problems, f"reduce_scatter {op} dim={dim}", group, path, shape_of,
               lambda x, g: F.reduce_scatter(x, g, dim=dim, op=op),
               lambda xs: list(_reduce(xs, op).chunk(len(xs), dim)), **kw)  # fmt: skip

    run("pg", HEAP, lambda i, n: (3 * n, 5), 0, "sum")
    run("sub", HEAP, lambda i, n: (2, 3, n), 2, "avg", strided=True)
    run("mesh1", HEAP, lambda i, n: (3, 2 * n, 1), 1, "max")
    run("sub_idx", HEAP, lambda i, n: (3 * n, 4), -2, "min", strided=True)
    run("none", FALLBACK, lambda i, n: (3, n), 1, "sum")
    run("pg", FALLBACK, lambda i, n: (n, 3), 0, "max")


def case_all_reduce(ctx: _Ctx, problems: list[str]) -> None:
    def run(group: str, path, shape, op: str, **kw) -> None:
        _check(ctx, problems, f"all_reduce {op} {shape}", group, path, lambda i, n: shape,
               lambda x, g: F.all_reduce(x, g, op=op),
               lambda xs: [_reduce(xs, op)] * len(xs), **kw)  # fmt: skip

    run("pg", HEAP, (3, 5), "sum")
    run("mesh1", HEAP, (7,), "avg")
    run("pg", HEAP, (4, 5), "max")
    run("sub_idx", HEAP, (3, 3), "min", strided=True)
    run("sub", FALLBACK, (), "sum")
    run("none", FALLBACK, (5,), "avg")
    run("pg", FALLBACK, (2, 3), "min")


def _split_matrix(n: int) -> list[list[int]]:
    """Rows member s sends member d: uneven, with empty splits (s + 2d) % 3 == 0."""
    return [[(s + 2 * d) % 3 for d in range(n)] for s in range(n)]


def case_all_to_all(ctx: _Ctx, problems: list[str]) -> None:
    def exchange(xs: list[torch.Tensor], splits: list[list[int]]) -> list[torch.Tensor]:
        parts = [x.split(s) for x, s in zip(xs, splits, strict=True)]
        return [torch.cat([p[d] for p in parts]) for d in range(len(xs))]

    def uneven(group: str, path, as_tensor=False, agreed=False, as_float=False, **kw) -> None:
        ranks, me = ctx.members(group)
        S = _split_matrix(len(ranks))
        send, recv = S[me], [row[me] for row in S]
        if as_tensor:
            send, recv = torch.tensor(send), torch.tensor(recv, dtype=torch.int32)
        if as_float:
            send, recv = [float(v) for v in send], [float(v) for v in recv]
        peak = max(map(max, S)) if agreed else None
        name = f"all_to_all uneven tensor={as_tensor} agreed={agreed} float={as_float}"
        _check(ctx, problems, name, group, path,
               lambda i, n: (sum(_split_matrix(n)[i]), 3),
               lambda x, g: F.all_to_all(x, g, recv, send, agreed_max_split=peak),
               lambda xs: exchange(xs, _split_matrix(len(xs))), **kw)  # fmt: skip

    uneven("pg", HEAP)
    uneven("sub", HEAP, as_tensor=True, strided=True)
    uneven("mesh1", HEAP, agreed=True)
    uneven("none", FALLBACK)
    uneven("pg", FALLBACK, as_float=True)  # integral floats, as the collectives take them (new_empty failed)
    _check(ctx, problems, "all_to_all equal splits", "sub_idx", FALLBACK, lambda i, n: (2 * n, 2, 3),
           lambda x, g: F.all_to_all(x, g),
           lambda xs: exchange(xs, [[2] * len(xs)] * len(xs)))  # fmt: skip
    # Equal sends (input splits None) from ranks holding different row counts, the receives given: rank i
    # sends i + 1 rows to each rank. The backward used to size dx from the gradient's rows and raise.
    n = len(ctx.members("pg")[0])
    _check(ctx, problems, "all_to_all equal sends, output splits given", "pg", HEAP,
           lambda i, n: ((i + 1) * n, 3),
           lambda x, g: F.all_to_all(x, g, [q + 1 for q in range(n)], None),
           lambda xs: exchange(xs, [[i + 1] * len(xs) for i in range(len(xs))]))  # fmt: skip


def case_copy_reduce_pair(ctx: _Ctx, problems: list[str]) -> None:
    for copy_at, reduce_at in ((("pg", HEAP), ("sub", HEAP)), (("none", FALLBACK), ("mesh1", FALLBACK))):
        _check(ctx, problems, "copy_to_group", *copy_at, lambda i, n: (3, 5),
               lambda x, g: F.copy_to_group(x, g), lambda xs: list(xs),
               replicated_input=True, runs_forward=False)  # fmt: skip
        _check(ctx, problems, "reduce_from_group", *reduce_at, lambda i, n: (2, 7),
               lambda x, g: F.reduce_from_group(x, g), lambda xs: [_reduce(xs, "sum")] * len(xs),
               replicated_grad=True, runs_backward=False, strided=True)  # fmt: skip


def case_bad_input(ctx: _Ctx, problems: list[str]) -> None:
    """Errors raised before any collective runs, the same on every rank; the group works afterwards."""
    W = ctx.world
    x = torch.ones(3 * W + 1, 2)
    tp = (ctx.mesh2, "b")
    calls = [
        (lambda: F.reduce_scatter(x, None), ValueError, f"dim 0 has size {3 * W + 1}, which is not "
         f"divisible by the group size {W}"),
        (lambda: F.reduce_scatter(torch.ones(2, 5), tp, dim=1), ValueError, "size 5, which is not divisible "
         "by the group size 2"),
        (lambda: F.all_gather(x, None, dim=2), ValueError,
         f"dim: 2 is out of range for x of shape ({3 * W + 1}, 2)"),
        (lambda: F.all_gather(torch.tensor(1.0), None), ValueError, "x: expected at least 1 dimension"),
        (lambda: F.all_gather([1.0], None), TypeError, "x: expected a torch.Tensor"),
        (lambda: F.all_reduce(x, None, op="prod"), ValueError, "op: expected one of"),
        (lambda: F.all_reduce(x, "tp"), TypeError, "group: expected a ProcessGroup, a 1-D DeviceMesh"),
        (lambda: F.all_reduce(x, ctx.mesh2), ValueError, "DeviceMesh with 2 dimensions ('a', 'b')"),
        (lambda: F.all_reduce(x, (ctx.mesh2, "tp")), ValueError, "no dimension 'tp'; its dimensions are"),
        (lambda: F.all_reduce(x, (ctx.mesh2, 2)), ValueError, "mesh dimension 2 is out of range"),
        (lambda: F.all_to_all(x, None, torch.ones(W), None), ValueError, "output_split_sizes: a tensor"),
        (lambda: F.all_to_all(x, None, [1.5] * W, None), ValueError,
         "output_split_sizes[0]: expected an integer"),
        (lambda: F.all_gather(x, None, max_sms=10**6), ValueError, "max_sms"),
    ]  # fmt: skip
    for i, (call, kind, words) in enumerate(calls):
        try:
            call()
            problems.append(f"bad input {i}: no error (expected {kind.__name__} with {words!r})")
        except kind as e:
            if words not in str(e):
                problems.append(f"bad input {i}: {kind.__name__} without {words!r}: {e}")
    y = F.all_reduce(torch.full((3,), float(ctx.rank)), None)
    if y.tolist() != [W * (W - 1) / 2] * 3:
        problems.append(f"after the errors: all_reduce gave {y.tolist()}")


def case_selective_checkpointing(ctx: _Ctx, problems: list[str]) -> None:
    """The four collectives as one block under smptk.parallel's selective checkpointing: their forwards are
    the dispatcher ops ``smptk::reduce_scatter`` etc., whose outputs the policy keeps, so backward runs only
    the backward collectives, as the plain block does, and the all-gather again (the policy recomputes it:
    its output is W times its input); full checkpointing runs the other forward collectives again too.
    Gradients equal the plain block's exactly."""
    from torch.utils.checkpoint import checkpoint

    from smptk.comm import collectives
    from smptk.parallel.checkpointing import _selective_contexts

    names = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")
    calls = dict.fromkeys(names, 0)

    def block(x: torch.Tensor) -> torch.Tensor:
        y = F.all_gather(x, None)  # [W * W, 4]
        y = F.reduce_scatter(torch.sin(y) * 2, None)  # [W, 4]
        y = F.all_reduce(torch.cos(y), None)
        return F.all_to_all(y * y, None)  # equal splits

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    x0 = _ints((ctx.world, 4), ctx.next_seed(), ctx.rank, torch.float32)
    up = _ints((ctx.world, 4), ctx.next_seed(), ctx.rank, torch.float32)
    grads, ran = {}, {}
    for mode in ("plain", "selective", "full"):
        x = x0.clone().requires_grad_()
        if mode == "plain":
            out = block(x)
        else:
            kw = {"context_fn": _selective_contexts} if mode == "selective" else {}
            out = checkpoint(block, x, use_reentrant=False, **kw)
        originals = {n: getattr(collectives, n) for n in names}
        calls.update(dict.fromkeys(names, 0))
        try:
            for n in names:
                setattr(collectives, n, counted(n, originals[n]))
            (grads[mode],) = torch.autograd.grad(out, x, up)
        finally:
            for n in names:
                setattr(collectives, n, originals[n])
        ran[mode] = dict(calls)
    # selective: the backward collectives of the plain block, and the all-gather again (its output, W times
    # its input, is recomputed, not kept); full: the other forward collectives again too
    again = {**ran["plain"], "all_gather_into_tensor": ran["plain"]["all_gather_into_tensor"] + 1}
    if ran["selective"] != again or sum(ran["full"].values()) <= sum(again.values()):
        problems.append(f"collectives run in backward: {ran}")
    for mode in ("selective", "full"):
        _same(problems, f"{mode} checkpointing grad", grads[mode], grads["plain"])


def case_saved_as_shard(ctx: _Ctx, problems: list[str]) -> None:
    """``saved_as_shard``: inside it, what autograd saves of a gathered tensor is this rank's block (an outer
    ``saved_tensors_hooks`` sees the block's shape, never the gathered one), backward gathers it again once
    for the two ops that saved views of it, and the gradients equal those of the plain run exactly. Inside
    torch's checkpoint it does nothing; a block modified in place after the forward makes backward raise."""
    from comm_checks import expect_raises
    from torch.utils.checkpoint import checkpoint

    from smptk.comm import collectives

    g = dist.group.WORLD
    x0 = _ints((3, 5), ctx.next_seed(), ctx.rank, torch.float32)
    w0 = _ints((2, 5), ctx.next_seed(), 0, torch.float32)
    up = _ints((3 * ctx.world, 2), ctx.next_seed(), ctx.rank, torch.float32)

    def block(x, w, keep: bool):
        full = F.all_gather(x, g)
        with F.saved_as_shard(full, x, g) if keep else contextlib.nullcontext():
            return torch.nn.functional.linear(full, w).sin() + torch.cos(full).sum(-1, keepdim=True)

    def run(mode: str):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        shapes: list[tuple] = []
        record = lambda t: shapes.append(tuple(t.shape)) or t
        with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
            if mode == "checkpoint":
                out = checkpoint(block, x, w, True, use_reentrant=False)
            else:
                out = block(x, w, mode == "shard")
        gathers, original = [0], collectives.all_gather_into_tensor

        def counted(*args, **kwargs):
            gathers[0] += 1
            return original(*args, **kwargs)

        collectives.all_gather_into_tensor = counted
        try:
            grads = torch.autograd.grad(out, (x, w), up)
        finally:
            collectives.all_gather_into_tensor = original
        return grads, shapes, gathers[0]

    plain, plain_shapes, plain_gathers = run("plain")
    shard, shard_shapes, shard_gathers = run("shard")
    full_shape = (3 * ctx.world, 5)
    if full_shape not in plain_shapes:
        problems.append(f"saved_as_shard: the plain run saved no gathered tensor: {plain_shapes}")
    if full_shape in shard_shapes or shard_shapes.count((3, 5)) != 2:
        problems.append(f"saved_as_shard: outer hooks saw {shard_shapes}, expected the block (3, 5) twice")
    if (plain_gathers, shard_gathers) != (0, 1):
        problems.append(f"saved_as_shard: backward all-gathers plain {plain_gathers}, kept {shard_gathers}")
    for name, got, ref in zip(("x", "w"), shard, plain, strict=True):
        _same(problems, f"saved_as_shard grad {name}", got, ref)
    ckpt, _, ckpt_gathers = run("checkpoint")
    for name, got, ref in zip(("x", "w"), ckpt, plain, strict=True):
        _same(problems, f"saved_as_shard under checkpoint grad {name}", got, ref)
    if ckpt_gathers != 1:  # the recompute's forward all-gather; the context added none
        problems.append(f"saved_as_shard under checkpoint: {ckpt_gathers} all-gathers in backward")

    # the gathered tensor modified in place inside the context before an op saves it: a gather again would
    # not give the saved values, so it is saved as it is (dW was 3x too small)
    def scaled(keep: bool):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        full = F.all_gather(x, g)
        with F.saved_as_shard(full, x, g) if keep else contextlib.nullcontext():
            full.mul_(3.0)
            out = torch.nn.functional.linear(full, w)
        return torch.autograd.grad(out, (x, w), up)

    for name, got, ref in zip(("x", "w"), scaled(True), scaled(False), strict=True):
        _same(problems, f"saved_as_shard, full modified inside: grad {name}", got, ref)
    # a block modified in place after the forward: every rank raises before any collective
    x = x0.clone().requires_grad_()
    out = block(x, w0, True)
    with torch.no_grad():
        x.add_(1)
    for label, call, exc, text in (
        ("a modified block", lambda: out.sum().backward(), RuntimeError, "modified in place"),
        ("a wrong full tensor", lambda: F.saved_as_shard(torch.zeros(3, 5), x0, g).__enter__(), ValueError,
         "expected the contiguous all-gather of local along dim 0"),
    ):  # fmt: skip
        if (problem := expect_raises(call, exc, text)) is not None:
            problems.append(f"saved_as_shard, {label}: {problem}")


CASES: dict[str, Callable[[_Ctx, list[str]], None]] = {
    "all_gather": case_all_gather,
    "reduce_scatter": case_reduce_scatter,
    "all_reduce": case_all_reduce,
    "all_to_all": case_all_to_all,
    "copy_reduce_pair": case_copy_reduce_pair,
    "selective_checkpointing": case_selective_checkpointing,
    "saved_as_shard": case_saved_as_shard,
    "bad_input": case_bad_input,
}


def run(rank: int, world: int) -> dict[str, str | None]:
    """Every case in order on this rank: ``{case: None, or its problems}``."""
    ctx = _Ctx(rank, world)
    outcomes = {}
    for name, case in CASES.items():
        problems: list[str] = []
        case(ctx, problems)
        outcomes[name] = "\n".join(problems) or None
    return outcomes
