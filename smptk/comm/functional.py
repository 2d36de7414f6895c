"""Differentiable collectives: smptk's collectives as autograd ops, out of place, along any dimension.

Legend: W ranks in the group, r this rank's index in it, ``x`` this rank's input, ``y`` its output,
``g`` the gradient arriving at ``y``, ``d = x.shape[dim]``.

- :func:`all_gather`: ``y = cat([x_0 .. x_{W-1}], dim)``, ``d -> W * d``; backward: the
  reduce-scatter (sum) of ``g``.
- :func:`reduce_scatter`: block r along ``dim`` of ``op(x_0 .. x_{W-1})``, ``W * b -> b``; backward:
  the all-gather of ``g`` (see ``op`` below).
- :func:`all_reduce`: ``y = op(x_0 .. x_{W-1})``, out of place; backward: the all-reduce of ``g``.
- :func:`all_to_all`: rows of ``x`` (dim 0) to each rank by uneven splits; backward: the all-to-all
  with the splits swapped.
- :func:`copy_to_group`: identity (``x`` replicated on every rank); backward: the all-reduce (sum) of
  ``g``.
- :func:`reduce_from_group`: ``y = sum(x_0 .. x_{W-1})``; backward: identity.
- :func:`saved_as_shard`: a context in which what autograd saves of an all-gather's output is kept as this
  rank's input and gathered again when backward needs it (sequence parallelism's memory saving).

Gradient convention. Each rank's backward seeds the gradient of its own output, and the gradient of
an input is the sum of what every rank's output contributes to it: the objective is the sum of the
ranks' losses, as when the computation after the collective differs between ranks (each rank holds a
different weight shard, or computes its own loss). The first four ops follow it. Tensor parallelism
also has regions where the computation after an all-reduce is replicated, every rank then holds the
same, whole gradient, and the loss counts once: :func:`reduce_from_group` (backward: identity) is the
all-reduce for that case, and :func:`copy_to_group` is its mirror, the entry into such a region
(Megatron-LM's "copy to / reduce from tensor-parallel region"). ``all_reduce(op="sum")`` there would
count the gradient W times.

``op`` of :func:`reduce_scatter` and :func:`all_reduce`: "sum"; "avg" (the sum divided by W; its
backward is the gradient's all-gather / all-reduce divided by W; on integer tensors, which have no
gradient, the fallback's floor of the mean); "max" and "min" take the subgradient ``torch.amax`` /
``torch.amin`` take: the summed gradient of an output element goes to the inputs equal to it, split
evenly between ties; unlike torch's, an element whose result is NaN passes no gradient (torch.amax
gives every input of it NaN). That backward runs
two collectives for reduce_scatter (an all-gather of the outputs with their gradients, an all-reduce
of the tie counts) and one for all_reduce (the gradients and tie counts, stacked).

``group`` of every op (:func:`resolve_group` turns it into a ProcessGroup):

- a ``torch.distributed.ProcessGroup``;
- a 1-D ``DeviceMesh`` (its only dimension);
- ``(mesh, dim)``: a dimension of a DeviceMesh by name (``(mesh, "tp")``) or index;
- None: the default (world) group.

Every op routes through :mod:`smptk.comm.collectives`, so the symmetric heap, its torch.distributed
fallback and ``max_sms`` apply, and :func:`smptk.comm.last_path` names the path of the last collective
run (forward or backward). Inputs need not be contiguous: the op moves ``dim`` to the front, makes the
tensor contiguous, runs the collective and moves the dimension back; outputs are contiguous. All
ranks must call with the same shapes apart from ``d`` where the op allows it (all_to_all's rows).
Backward is differentiable once: a backward with ``create_graph=True`` (for a second derivative) raises.

Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU), a ``(1, 2)`` mesh named
``("dp", "tp")``::

    >>> import torch
    >>> import torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> import smptk.comm.functional as F
    >>> dist.init_process_group("gloo")
    >>> mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    >>> x = torch.randn(8, 6, requires_grad=True)
    >>> y = F.all_gather(x, (mesh, "tp"), dim=1)
    >>> y.shape
    torch.Size([8, 12])
    >>> z = F.reduce_scatter(y, (mesh, "tp"), dim=0)
    >>> z.shape
    torch.Size([4, 12])
    >>> z.sum().backward()
    >>> x.grad.unique()      # each element of x is in both ranks' y, and so in both ranks' losses
    tensor([2.])
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from smptk.comm import collectives
from smptk.kernels._dispatch import dispatcher_op, first_derivative_only

__all__ = [
    "GroupLike",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "copy_to_group",
    "reduce_from_group",
    "reduce_scatter",
    "resolve_group",
    "saved_as_shard",
]

OPS = ("sum", "avg", "max", "min")

GroupLike = dist.ProcessGroup | DeviceMesh | tuple[DeviceMesh, str | int] | None  # see resolve_group
Splits = Sequence[int] | torch.Tensor | None


def resolve_group(group: GroupLike) -> dist.ProcessGroup:
    """The ProcessGroup that ``group`` names: a ProcessGroup, a 1-D DeviceMesh, ``(mesh, dim)`` or None.

    ``dim`` of a mesh is a dimension name (``"tp"``) or an index; None is the default group.

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from smptk.comm.functional import resolve_group
        >>> dist.init_process_group("gloo")
        >>> mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        >>> dist.get_world_size(resolve_group((mesh, "tp"))), dist.get_world_size(resolve_group((mesh, 0)))
        (2, 1)
        >>> resolve_group(None) is dist.group.WORLD
        True
    """
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group: a DeviceMesh with {group.ndim} dimensions {_mesh_dims(group)} needs one of "
                "them named: pass (mesh, dim_name)"
            )
        return collectives._group(group.get_group())
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh, mesh_dim = group
        names = mesh.mesh_dim_names or ()
        if isinstance(mesh_dim, str):
            if mesh_dim not in names:
                raise ValueError(f"group: the mesh has no dimension {mesh_dim!r}; its dimensions are {names}")
        elif isinstance(mesh_dim, int) and not isinstance(mesh_dim, bool):
            if not 0 <= mesh_dim < mesh.ndim:
                raise ValueError(f"group: mesh dimension {mesh_dim} is out of range for a {mesh.ndim}-D mesh")
        else:
            raise TypeError(f"group: a mesh dimension is a name or an index, got {mesh_dim!r}")
        return collectives._group(mesh.get_group(mesh_dim))
    if group is None or group is dist.GroupMember.NON_GROUP_MEMBER or isinstance(group, dist.ProcessGroup):
        return collectives._group(group)  # None: the default group; checks this rank is a member
    raise TypeError(
        "group: expected a ProcessGroup, a 1-D DeviceMesh, a (DeviceMesh, dim name or index) pair or None, "
        f"got {type(group).__name__}"
    )


def _mesh_dims(mesh) -> tuple:
    return tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else tuple(range(mesh.ndim))


def _check_x(x: object, *, min_dim: int = 0) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(f"x: expected at least {min_dim} dimension(s), got shape {tuple(x.shape)}")
    return x


def _check_dim(x: torch.Tensor, dim: object) -> int:
    """``dim`` as an index in ``0 .. x.dim() - 1`` (negative counts from the end)."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int, got {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: {dim} is out of range for x of shape {tuple(x.shape)}")
    return dim % x.dim()


def _check_op(op: object) -> str:
    return collectives._op_name(op)


def _front(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with ``dim`` moved to dimension 0, contiguous (no copy when it already is)."""
    return t.movedim(dim, 0).contiguous()


def _back(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of :func:`_front`: dimension 0 of the contiguous ``t`` back to ``dim``, contiguous, and
    never a view: an op's output that is a view of its internal buffer refuses in-place updates (``out +=
    residual``). Where the move needs no copy (dim 0, or only size-1 dims in between), the result is a
    tensor of its own over ``t``'s storage, which nothing else holds."""
    moved = t.movedim(0, dim)
    if not moved.is_contiguous():
        return moved.contiguous()
    own = t.new_empty(0)
    return own.set_(t.untyped_storage(), t.storage_offset(), moved.shape, moved.stride())


def _gather_front(x_front: torch.Tensor, group: dist.ProcessGroup, max_sms: int | None) -> torch.Tensor:
    """All-gather along dim 0 of a contiguous ``[d, ...]`` tensor: ``[W * d, ...]``, rank-major."""
    world = dist.get_world_size(group)
    out = x_front.new_empty((world * x_front.shape[0], *x_front.shape[1:]))
    collectives.all_gather_into_tensor(out, x_front, group, max_sms=max_sms)
    return out


def _scatter_front(
    x_front: torch.Tensor, group: dist.ProcessGroup, op: str, max_sms: int | None
) -> torch.Tensor:
    """Reduce-scatter along dim 0 of a contiguous ``[W * b, ...]`` tensor: block r, ``[b, ...]``."""
    world = dist.get_world_size(group)
    out = x_front.new_empty((x_front.shape[0] // world, *x_front.shape[1:]))
    collectives.reduce_scatter_tensor(out, x_front, op, group, max_sms=max_sms)
    return out


def _all_reduced(t: torch.Tensor, group: dist.ProcessGroup, op: str, max_sms: int | None) -> torch.Tensor:
    """An all-reduced contiguous copy of ``t`` (``t`` itself is left alone)."""
    out = t.clone(memory_format=torch.contiguous_format)
    collectives.all_reduce(out, op, group, max_sms=max_sms)
    return out


def _share(counts: torch.Tensor, mask: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``total / counts`` where ``mask`` holds, 0 elsewhere (also where ``total`` is inf or NaN)."""
    return torch.where(mask, total / counts.clamp_min(1), torch.zeros((), dtype=total.dtype))


# The forwards as dispatcher ops (smptk.kernels._dispatch), so selective checkpointing keeps their outputs
# instead of running the collective again in backward. The group travels by name.
def _gather_fake(x, group_name, dim, max_sms):
    shape = list(x.shape)
    shape[dim] *= dist.get_world_size(collectives._named_group(group_name))
    return x.new_empty(shape)


@dispatcher_op("all_gather", fake=_gather_fake)
def _all_gather_fwd(x: torch.Tensor, group_name: str, dim: int, max_sms: int | None) -> torch.Tensor:
    group = collectives._named_group(group_name)
    return _back(_gather_front(_front(x, dim), group, max_sms), dim)


def _scatter_fake(x, group_name, dim, op, max_sms):
    shape = list(x.shape)
    shape[dim] //= dist.get_world_size(collectives._named_group(group_name))
    return x.new_empty(shape)


@dispatcher_op("reduce_scatter", fake=_scatter_fake)
def _reduce_scatter_fwd(
    x: torch.Tensor, group_name: str, dim: int, op: str, max_sms: int | None
) -> torch.Tensor:
    group = collectives._named_group(group_name)
    return _back(_scatter_front(_front(x, dim), group, op, max_sms), dim)


@dispatcher_op("all_reduce", fake=lambda x, group_name, op, max_sms: torch.empty_like(x))
def _all_reduce_fwd(x: torch.Tensor, group_name: str, op: str, max_sms: int | None) -> torch.Tensor:
    return _all_reduced(x, collectives._named_group(group_name), op, max_sms)


def _all_to_all_fake(x, group_name, out_splits, in_splits, max_sms, agreed_max_split):
    rows = x.shape[0] if out_splits is None else sum(out_splits)
    return x.new_empty((rows, *x.shape[1:]))


@dispatcher_op("all_to_all", fake=_all_to_all_fake)
def _all_to_all_fwd(
    x: torch.Tensor,
    group_name: str,
    out_splits: list[int] | None,
    in_splits: list[int] | None,
    max_sms: int | None,
    agreed_max_split: int | None,
) -> torch.Tensor:
    out = _all_to_all_fake(x, group_name, out_splits, in_splits, max_sms, agreed_max_split)
    collectives.all_to_all_single(
        out, x.contiguous(), out_splits, in_splits, collectives._named_group(group_name),
        max_sms=max_sms, agreed_max_split=agreed_max_split,
    )  # fmt: skip
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, max_sms):
        ctx.group, ctx.dim, ctx.max_sms = group, dim, max_sms
        return _all_gather_fwd(x, group.group_name, dim, max_sms)

    @staticmethod
    @first_derivative_only("all_gather")
    def backward(ctx, g):
        return (
            _back(_scatter_front(_front(g, ctx.dim), ctx.group, "sum", ctx.max_sms), ctx.dim),
            None,
            None,
            None,
        )


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, op, max_sms):
        ctx.group, ctx.dim, ctx.op, ctx.max_sms = group, dim, op, max_sms
        y = _reduce_scatter_fwd(x, group.group_name, dim, op, max_sms)
        if op in ("max", "min"):
            ctx.save_for_backward(x, y)
        return y

    @staticmethod
    @first_derivative_only("reduce_scatter")
    def backward(ctx, g):
        group, dim, op, max_sms = ctx.group, ctx.dim, ctx.op, ctx.max_sms
        world = dist.get_world_size(group)
        if op in ("sum", "avg"):
            dx = _back(_gather_front(_front(g, dim), group, max_sms), dim)
            return (dx / world if op == "avg" else dx), None, None, None, None
        # max / min: every rank learns every block's result and gradient, keeps its inputs equal to the
        # result, and splits each gradient over the ranks that tie for it.
        x, y = ctx.saved_tensors
        x_front = _front(x, dim)
        pair = torch.stack([_front(y, dim), _front(g, dim).to(y.dtype)])  # [2, d / W, ...]
        both = x.new_empty((world * 2, *pair.shape[1:]))  # [W * 2, ...]: what every path accepts
        collectives.all_gather_into_tensor(both, pair, group, max_sms=max_sms)
        both = both.view(world, *pair.shape)
        y_all = both[:, 0].reshape(x_front.shape)
        g_all = both[:, 1].reshape(x_front.shape)
        mask = x_front == y_all
        counts = _all_reduced(mask.to(g.dtype), group, "sum", max_sms)
        dx = _share(counts, mask, g_all.to(g.dtype))
        return _back(dx, dim), None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, op, max_sms):
        ctx.group, ctx.op, ctx.max_sms = group, op, max_sms
        y = _all_reduce_fwd(x, group.group_name, op, max_sms)
        if op in ("max", "min"):
            ctx.save_for_backward(x, y)
        return y

    @staticmethod
    @first_derivative_only("all_reduce")
    def backward(ctx, g):
        group, op, max_sms = ctx.group, ctx.op, ctx.max_sms
        if op in ("sum", "avg"):
            return _all_reduced(g, group, op, max_sms), None, None, None
        x, y = ctx.saved_tensors
        mask = x == y
        both = _all_reduced(torch.stack([g, mask.to(g.dtype)]), group, "sum", max_sms)  # [2, *shape]
        return _share(both[1], mask, both[0]), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, max_sms, agreed_max_split):
        ctx.group, ctx.splits, ctx.rows = group, (out_splits, in_splits), x.shape[0]
        ctx.max_sms, ctx.agreed_max_split = max_sms, agreed_max_split
        return _all_to_all_fwd(x, group.group_name, out_splits, in_splits, max_sms, agreed_max_split)

    @staticmethod
    @first_derivative_only("all_to_all")
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        dx = g.new_empty((ctx.rows, *g.shape[1:]))  # x's rows (not g's: the splits may be uneven)
        collectives.all_to_all_single(
            dx,
            g.contiguous(),
            in_splits,
            out_splits,
            ctx.group,
            max_sms=ctx.max_sms,
            agreed_max_split=ctx.agreed_max_split,
        )
        return dx, None, None, None, None, None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, max_sms):
        ctx.group, ctx.max_sms = group, max_sms
        return x

    @staticmethod
    @first_derivative_only("copy_to_group")
    def backward(ctx, g):
        return _all_reduced(g, ctx.group, "sum", ctx.max_sms), None, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, max_sms):
        return _all_reduce_fwd(x, group.group_name, "sum", max_sms)

    @staticmethod
    @first_derivative_only("reduce_from_group")
    def backward(ctx, g):
        return g, None, None


def all_gather(
    x: torch.Tensor, group: GroupLike, *, dim: int = 0, max_sms: int | None = None
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order: ``[.., d, ..]`` -> ``[.., W * d, ..]``.

    Every rank's ``x`` has the same shape. Backward: the reduce-scatter (sum) of the gradient along
    ``dim``, so rank r receives the sum over ranks of the gradients of its block.

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from smptk.comm.functional import all_gather
        >>> dist.init_process_group("gloo")
        >>> y = all_gather(torch.full((2, 3), float(dist.get_rank())), None, dim=1)     # [2, 3 * W]
        >>> y.tolist()
        [[0.0, 0.0, 0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]]
    """
    x = _check_x(x, min_dim=1)
    return _AllGather.apply(x, resolve_group(group), _check_dim(x, dim), max_sms)


def reduce_scatter(
    x: torch.Tensor, group: GroupLike, *, dim: int = 0, op: str = "sum", max_sms: int | None = None
) -> torch.Tensor:
    """``op`` of every rank's ``x``, keeping block r along ``dim``: ``[.., W * b, ..]`` -> ``[.., b, ..]``.

    ``x.shape[dim]`` must be divisible by the group size W. Backward: the all-gather of the gradient
    (divided by W for "avg"; the tie-split subgradient for "max" / "min", see the module docstring).

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from smptk.comm.functional import reduce_scatter
        >>> dist.init_process_group("gloo")
        >>> W = dist.get_world_size()
        >>> y = reduce_scatter(torch.ones(5, 4 * W), None, dim=1)
        >>> y.shape, y.unique()                    # [5, 4], every element W
        (torch.Size([5, 4]), tensor([2.]))
    """
    x = _check_x(x, min_dim=1)
    g = resolve_group(group)
    d = _check_dim(x, dim)
    world = dist.get_world_size(g)
    if x.shape[d] % world:
        raise ValueError(
            f"x: dim {d} has size {x.shape[d]}, which is not divisible by the group size {world} "
            f"(shape {tuple(x.shape)})"
        )
    return _ReduceScatter.apply(x, g, d, _check_op(op), max_sms)


def all_reduce(
    x: torch.Tensor, group: GroupLike, *, op: str = "sum", max_sms: int | None = None
) -> torch.Tensor:
    """``op`` of every rank's ``x``, out of place (``x`` is left alone); the same shape on every rank.

    Backward: the all-reduce (sum) of the gradient for "sum", its average for "avg", the tie-split
    subgradient for "max" / "min" (module docstring). For an all-reduce whose consumers are replicated,
    with the loss counted once (a tensor-parallel region), use :func:`reduce_from_group`.

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from smptk.comm.functional import all_reduce
        >>> dist.init_process_group("gloo")
        >>> scores = torch.tensor([1.0, 5.0]) if dist.get_rank() == 0 else torch.tensor([3.0, 2.0])
        >>> all_reduce(scores, None, op="max")     # scores itself is left alone
        tensor([3., 5.])
    """
    x = _check_x(x)
    return _AllReduce.apply(x, resolve_group(group), _check_op(op), max_sms)


def all_to_all(
    x: torch.Tensor,
    group: GroupLike,
    output_split_sizes: Splits = None,
    input_split_sizes: Splits = None,
    *,
    max_sms: int | None = None,
    agreed_max_split: int | None = None,
) -> torch.Tensor:
    """Rows ``input_split_sizes[d]`` of ``x`` (dim 0, in order) go to rank d; rank q's arrive in block q.

    Splits are lists of row counts per rank, 1-D integer tensors (read on the host once, in the
    forward) or None (equal splits; the output then has ``x.shape[0]`` rows). As in
    ``dist.all_to_all_single``, rank r's ``input_split_sizes[d]`` must equal rank d's
    ``output_split_sizes[r]`` (checked by the collective: :class:`smptk.comm.CommMismatchError`).
    ``agreed_max_split``: the largest split any rank sends, in rows, when every rank knows it and passes
    the same value; forward and backward then skip the collective's split exchange and its host read
    (see :func:`smptk.comm.all_to_all_single`). Output: ``[sum(output_split_sizes), *x.shape[1:]]``.
    Backward: the same exchange with the splits swapped.

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from smptk.comm.functional import all_to_all
        >>> dist.init_process_group("gloo")
        >>> rank = dist.get_rank()
        >>> send_counts = [1, 2] if rank == 0 else [3, 1]   # rows this rank sends to rank 0, rank 1
        >>> recv_counts = [1, 3] if rank == 0 else [2, 1]   # rows it receives from rank 0, rank 1
        >>> x = torch.full((sum(send_counts), 2), float(rank), requires_grad=True)
        >>> y = all_to_all(x, None, output_split_sizes=recv_counts, input_split_sizes=send_counts)
        >>> received = [None, None]
        >>> dist.all_gather_object(received, y[:, 0].tolist())
        >>> received                                        # rank 0's rows, rank 1's rows: by sender
        [[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0]]
        >>> y.sum().backward()                              # back along the swapped splits
        >>> x.grad.shape == x.shape
        True
    """
    x = _check_x(x, min_dim=1)
    g = resolve_group(group)
    # as lists (one host read of a tensor), so the backward reuses them without a sync
    out_splits = collectives._split_list("output_split_sizes", output_split_sizes)
    in_splits = collectives._split_list("input_split_sizes", input_split_sizes)
    return _AllToAll.apply(x, g, out_splits, in_splits, max_sms, agreed_max_split)


def copy_to_group(x: torch.Tensor, group: GroupLike, *, max_sms: int | None = None) -> torch.Tensor:
    """Identity forward; backward all-reduces (sums) the gradient over ``group``.

    The entry into a region where each rank computes a different part from the same, replicated ``x``
    (a column-parallel linear's input): ``x``'s gradient is the sum of every rank's part.

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from smptk.comm.functional import copy_to_group
        >>> dist.init_process_group("gloo")
        >>> w = torch.full((3, 4), float(dist.get_rank() + 1), requires_grad=True)  # this rank's 3 rows
        >>> x = torch.ones(2, 4, requires_grad=True)           # the same input on every rank
        >>> y = copy_to_group(x, None) @ w.T                   # [2, 3]: this rank's output columns
        >>> y.sum().backward()
        >>> x.grad.tolist()    # summed over the ranks: 3 * 1 + 3 * 2, not this rank's 3 * (rank + 1)
        [[9.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]]
    """
    return _CopyToGroup.apply(_check_x(x), resolve_group(group), max_sms)


def reduce_from_group(x: torch.Tensor, group: GroupLike, *, max_sms: int | None = None) -> torch.Tensor:
    """All-reduce (sum) forward, out of place; identity backward.

    The exit from a tensor-parallel region (a row-parallel linear's partial outputs): what follows is
    replicated on every rank, so every rank holds the whole gradient already and passes it through.

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from smptk.comm.functional import reduce_from_group
        >>> dist.init_process_group("gloo")
        >>> part = torch.full((2, 3), float(dist.get_rank() + 1), requires_grad=True)  # a partial sum
        >>> y = reduce_from_group(part, None)      # None: the default group; a mesh dim works too
        >>> y.tolist()                             # every rank: 1 + 2
        [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
        >>> y.sum().backward()
        >>> part.grad.tolist()   # identity backward: the replicated loss counts once, not once per rank
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    """
    return _ReduceFromGroup.apply(_check_x(x), resolve_group(group), max_sms)


# -- keeping a gathered tensor as its shard while autograd holds it ------------------------------------------


def _innermost_saved_tensor_hooks() -> tuple | None:
    """The ``(pack, unpack)`` pair autograd applies now (the innermost ``saved_tensors_hooks``), or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _shard_saving_applies() -> bool:
    """Whether :func:`saved_as_shard` acts here: not where autograd saves nothing (no_grad, inference_mode,
    whose tensors have no version counter to read), not inside torch's checkpoint (whose own hooks are
    innermost: a checkpointed region keeps only its inputs, or what the selective policy names, and
    recomputes the gather), and only where this torch has the hook query it needs."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return False
    if not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"):
        return False
    hooks = _innermost_saved_tensor_hooks()
    return hooks is None or getattr(hooks[0], "__module__", None) != "torch.utils.checkpoint"


class _Shard:
    """What autograd holds for a saved view of the gathered tensor: the shard (packed by any outer hooks),
    its version when packed, and the view's geometry."""

    __slots__ = ("held", "offset", "shape", "stride", "version")

    def __init__(self, held, version: int, view: torch.Tensor) -> None:
        self.held, self.version = held, version
        self.shape, self.stride, self.offset = view.shape, view.stride(), view.storage_offset()


@contextlib.contextmanager
def saved_as_shard(
    full: torch.Tensor, local: torch.Tensor, group: GroupLike, *, dim: int = 0, max_sms: int | None = None
) -> Iterator[None]:
    """Inside, autograd keeps what it saves of ``full`` (``all_gather(local, group, dim=dim)``) as ``local``,
    and gathers it again when backward unpacks it.

    A sequence-parallel column-parallel layer all-gathers its input's sequence blocks and runs its GEMM on
    the gathered input, which the GEMM's backward needs for the weight gradient: kept as is, that is ``W``
    times this rank's block per layer, alive from forward to backward. Megatron-LM keeps the block and
    gathers again in backward; this context does that for whatever runs inside it (smptk's kernels, torch's
    ops): a saved tensor that is a view of ``full``'s storage is packed as ``local`` (one reference, shared
    by every view and layer that saves it) and unpacked as the same view of a fresh all-gather, the same
    collective with the same result. Other saved tensors pass through, and so does a view saved after
    ``full`` or ``local`` was modified in place inside the context (a gather again would not give it).

    Composes with ``saved_tensors_hooks`` around it (they see ``local`` where they would have seen
    ``full``), and does nothing inside torch's activation checkpointing (:func:`_shard_saving_applies`:
    there the region keeps only its inputs, or what the selective policy names, and the recompute runs
    the all-gather again). Backward raises if ``local`` was modified in place after the forward, as autograd
    does for a tensor it saved. Every rank must run the backward of the same layers (the unpack is a
    collective), as they do for the gradient collectives.

    Args:
        full: the output of :func:`all_gather` of ``local`` over ``group`` along ``dim`` (contiguous).
        local: this rank's input to that all-gather.
        group, dim, max_sms: as given to :func:`all_gather`.

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from smptk.comm.functional import all_gather, saved_as_shard
        >>> dist.init_process_group("gloo")
        >>> x_local = torch.ones(4, 3, requires_grad=True)   # this rank's 3 of the 6 features
        >>> w = torch.ones(5, 6, requires_grad=True)
        >>> x_full = all_gather(x_local, None, dim=1)        # [4, 6]
        >>> with saved_as_shard(x_full, x_local, None, dim=1):
        ...     y = torch.nn.functional.linear(x_full, w)    # autograd keeps x_local, not x_full
        >>> y.sum().backward()                              # gathers x_local again for w.grad
        >>> w.grad.unique(), x_local.grad.unique()          # x_local: summed over both ranks' losses
        (tensor([4.]), tensor([10.]))
    """
    g = resolve_group(group)
    d = _check_dim(_check_x(local, min_dim=1), dim)
    want = list(local.shape)
    want[d] *= dist.get_world_size(g)
    if not isinstance(full, torch.Tensor) or list(full.shape) != want or not full.is_contiguous():
        got = tuple(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__
        raise ValueError(
            f"full: expected the contiguous all-gather of local along dim {d}, shape {tuple(want)}, got {got}"
        )
    if not _shard_saving_applies() or full.device.type == "meta":
        yield
        return
    outer = _innermost_saved_tensor_hooks()
    outer_pack, outer_unpack = outer if outer is not None else (None, None)
    # what pack compares against, not ``full`` itself: the hooks live as long as what they packed, and
    # holding ``full`` would keep it alive to backward, the memory this context is for
    device, storage = full.device, full.untyped_storage().data_ptr()
    # a gather again gives the saved values only while neither tensor was written since the gather: a view
    # shares its base's version counter, so a saved view of ``full`` shows ``full``'s writes
    full_version, local_version = full._version, local._version
    group_name = g.group_name
    # The views packed and not yet unpacked, and the re-gathered tensor: kept from the first unpack to the
    # last, so the views that several ops saved share one gather (a graph kept for a second backward
    # unpacks again: it then gathers again).
    cache: dict = {"pending": 0, "full": None}

    def pack(t: torch.Tensor):
        # plain tensors only: a subclass (a DTensor's wrapper) has no storage of its own to compare
        if (
            type(t) is torch.Tensor
            and t.device == device
            and t.untyped_storage().data_ptr() == storage
            and t._version == full_version
            and local._version == local_version
        ):
            cache["pending"] += 1
            return _Shard(outer_pack(local) if outer_pack else local, local._version, t)
        return outer_pack(t) if outer_pack else t

    def unpack(packed):
        if not isinstance(packed, _Shard):
            return outer_unpack(packed) if outer_unpack else packed
        shard = outer_unpack(packed.held) if outer_unpack else packed.held
        if shard._version != packed.version:
            raise RuntimeError(
                "saved_as_shard: the local input of a gathered tensor that autograd saved was modified in "
                f"place after the forward (version {packed.version} -> {shard._version})"
            )
        again = cache["full"]
        if again is None:
            with torch.no_grad():
                again = _all_gather_fwd(shard.detach(), group_name, d, max_sms)
        cache["pending"] -= 1
        cache["full"] = again if cache["pending"] > 0 else None
        return again.as_strided(packed.shape, packed.stride, packed.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
