"""Cross-entropy over vocab-sharded logits, never materializing the full ``[.., V]`` logits on one rank.

Legend: ``T`` ranks of the tensor-parallel group, ``r`` this rank's index in it, ``V`` the vocabulary,
``Vl = V / T`` the shard, ``M`` tokens (the logits' leading dims flattened).

Rank r holds ``logits_local [.., Vl]``, the columns ``r*Vl .. (r+1)*Vl`` of the full logits: the output of
a :class:`~smptk.parallel.ColumnParallelLinear` head with ``gather_output=False``. Per token, in fp32
(Megatron-LM's vocab-parallel cross-entropy, whose three all-reduces of ``M`` values are two here, of
``M + 2`` and ``2 * M`` values, not ``M * V``):

1. ``m = max_v logits`` by a max all-reduce of the local maxima (for a stable exp), with the shard widths
   riding along (shards of different widths raise on every rank);
2. ``sum_v exp(logits - m)`` and the target's logit ``logits[target] - m`` (zero on the ranks whose
   shard does not hold the target) by one sum all-reduce of the two stacked;
3. ``loss = log(sum exp) - (logits[target] - m)``.

Backward, with no collective: ``softmax - onehot(target)`` on the local shard (softmax saved in fp32
from the forward), times the upstream gradient; tokens whose target is ``ignore_index`` get zero.
``reduction``: "mean" over the tokens not ignored (NaN when all are, as ``F.cross_entropy``), "sum" or
"none" (``[..]``, zero at ignored tokens). The loss is fp32 and the same on every rank (count it once);
the gradient has the logits' dtype. The collectives are :func:`smptk.comm.all_reduce`, so the symmetric
heap and its torch.distributed fallback apply.

A vocabulary padded to a multiple of T (the layers refuse one T does not divide) has its padded columns
in the softmax, which changes the loss of a model trained on the real V (V 10 padded to 12 with zero head
rows, random logits: 4.92 instead of 4.85). Set them to ``-inf`` first
(``logits_local.masked_fill(padded_cols, float("-inf"))``): the loss is then the real vocabulary's, and
their gradient zero.

Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU), a 2-rank tensor-parallel group,
vocabulary 1000::

    >>> import torch
    >>> import torch.distributed as dist
    >>> import torch.nn.functional as F
    >>> import smptk.parallel as sp
    >>> from smptk.parallel import ColumnParallelLinear, vocab_parallel_cross_entropy
    >>> dist.init_process_group("gloo")
    >>> state = sp.init({"tensor_parallel_degree": 2})
    >>> _ = torch.manual_seed(0)                       # the same h and target on every rank
    >>> h, target = torch.randn(2, 3, 64), torch.randint(0, 1000, (2, 3))
    >>> head = ColumnParallelLinear(64, 1000, bias=False)                 # weight Shard(0) over V
    >>> logits_local = head(h)
    >>> logits_local.shape
    torch.Size([2, 3, 500])
    >>> loss = vocab_parallel_cross_entropy(logits_local, target)
    >>> loss.backward()
    >>> ref = F.cross_entropy(F.linear(h, head.weight.full_tensor()).reshape(-1, 1000), target.reshape(-1))
    >>> torch.allclose(loss, ref, atol=1e-5)
    True
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from smptk import comm
from smptk.comm.functional import GroupLike, resolve_group
from smptk.kernels._dispatch import first_derivative_only
from smptk.parallel.tensor_parallel import _check_index_range

REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_MV, target_M, group, ignore_index, reduction, vocab_start):
        vl = logits_MV.shape[1]
        x = logits_MV.float()
        # The rows' maxima, and +-Vl riding on the same all-reduce: every rank learns the largest and the
        # smallest Vl of the group, so shards of different widths raise on every rank (they would give a
        # wrong loss, not a mismatch: the all-reduces are [M] long whatever Vl is).
        # On CUDA a device-side assert, as the target range check: no host sync stalls the step.
        m = torch.cat([x.amax(dim=1), x.new_tensor([vl, -vl])])
        comm.all_reduce(m, "max", group)
        same = "logits_local: every rank of the group must hold the same number of vocabulary columns"
        if m.device.type == "cuda":
            torch._assert_async(m[-2] == -m[-1], same)
        elif m.device.type != "meta" and int(m[-2]) != -int(m[-1]):
            raise ValueError(f"{same}; this rank has {vl}, others from {-int(m[-1])} to {int(m[-2])}")
        m = m[:-2]
        x = x - m.unsqueeze(1)
        e = x.exp()
        valid = target_M != ignore_index
        local_t = target_M - vocab_start
        in_shard = valid & (local_t >= 0) & (local_t < vl)
        idx = local_t.clamp(0, vl - 1).unsqueeze(1)
        picked = torch.where(in_shard, x.gather(1, idx).squeeze(1), 0.0)
        both = torch.stack([e.sum(dim=1), picked])  # [2, M]
        comm.all_reduce(both, "sum", group)
        sum_exp, target_logit = both[0], both[1]
        loss = torch.where(valid, sum_exp.log() - target_logit, 0.0)  # [M] fp32
        count = valid.sum()
        e /= sum_exp.unsqueeze(1)  # softmax, in place
        ctx.save_for_backward(e, idx, in_shard, valid, count)
        ctx.reduction, ctx.logits_dtype = reduction, logits_MV.dtype
        if reduction == "mean":
            return loss.sum() / count
        if reduction == "sum":
            return loss.sum()
        return loss

    @staticmethod
    @first_derivative_only("vocab_parallel_cross_entropy")
    def backward(ctx, g):
        softmax, idx, in_shard, valid, count = ctx.saved_tensors
        if ctx.reduction == "mean":
            scale = (g.float() / count).expand(valid.shape)
        elif ctx.reduction == "sum":
            scale = g.float().expand(valid.shape)
        else:
            scale = g.float()
        scale = torch.where(valid, scale, 0.0).unsqueeze(1)  # [M, 1]
        grad = softmax.clone()
        grad.scatter_add_(1, idx, -in_shard.to(grad.dtype).unsqueeze(1))
        grad *= scale
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor,
    target: torch.Tensor,
    *,
    group: GroupLike = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of vocab-sharded logits against global target ids; see the module docstring.

    Args:
        logits_local: ``[.., Vl]`` float (any float dtype; the math is fp32), this rank's vocabulary
            columns ``r*Vl .. (r+1)*Vl``; every rank of the group holds the same ``Vl``. A DTensor
            sharded on its last dim over a 1-D mesh is taken as its local shard, over that mesh. Not the
            full logits (a head with ``gather_output=True``): a plain tensor cannot say which it is, and
            full ``[.., V]`` logits on every rank would be read as T shards of a ``T*V`` vocabulary (the
            loss off by ``log T``); use ``F.cross_entropy`` on those.
        target: integer ``[..]`` (the logits' leading dims) of global ids in ``0 .. T*Vl - 1``, or
            ``ignore_index``; the same on every rank (a replicated DTensor is taken as its local copy).
        group: the tensor-parallel group (a ProcessGroup, a 1-D DeviceMesh or ``(mesh, dim)``); default
            a DTensor's mesh, else ``smptk.parallel.current().group("tp")``; another group than a
            DTensor's mesh is refused.
        ignore_index: target value that contributes no loss and no gradient.
        reduction: "mean" (over the tokens not ignored), "sum" or "none".

    Returns:
        fp32 loss: a scalar, or ``[..]`` for "none"; the same on every rank.
    """
    mesh_group = None  # a DTensor's: its shards are this group's
    if isinstance(logits_local, DTensor):
        if tuple(logits_local.placements) != (Shard(logits_local.dim() - 1),):
            raise ValueError(
                "logits_local: a DTensor must be sharded on its last (vocabulary) dim over a 1-D mesh (the "
                f"tensor-parallel group), got placements {tuple(logits_local.placements)} over a "
                f"{logits_local.device_mesh.ndim}-D mesh"
            )
        mesh_group = resolve_group(logits_local.device_mesh)
        logits_local = logits_local.to_local()
    if not isinstance(logits_local, torch.Tensor) or not logits_local.is_floating_point():
        raise TypeError(f"logits_local: expected a float tensor [..., V/T], got {_describe(logits_local)}")
    if logits_local.dim() < 1 or logits_local.shape[-1] == 0:
        raise ValueError(
            f"logits_local: expected shape [..., V/T] with V/T >= 1, got {tuple(logits_local.shape)}"
        )
    if isinstance(target, DTensor):
        if not all(p.is_replicate() for p in target.placements):
            raise ValueError(
                f"target: a DTensor must be replicated (the same ids on every rank), got placements "
                f"{tuple(target.placements)}"
            )
        target = target.to_local()
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.dtype == torch.bool:
        raise TypeError(f"target: expected an integer tensor of class ids, got {_describe(target)}")
    if tuple(target.shape) != tuple(logits_local.shape[:-1]):
        raise ValueError(
            f"target: expected shape {tuple(logits_local.shape[:-1])} (the logits' leading dims), got "
            f"{tuple(target.shape)} (logits_local {tuple(logits_local.shape)})"
        )
    if target.device != logits_local.device:
        raise ValueError(f"target: on {target.device} but logits_local is on {logits_local.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {ignore_index!r}")
    if group is None and mesh_group is not None:
        pg = mesh_group
    elif group is None:
        from smptk.parallel.config import current

        pg = current().group("tp")
    else:
        pg = resolve_group(group)
    if mesh_group is not None and (ranks := dist.get_process_group_ranks(pg)) != (
        mesh_ranks := dist.get_process_group_ranks(mesh_group)
    ):
        raise ValueError(
            f"group: the group of ranks {ranks}, but logits_local is a DTensor sharded over the ranks "
            f"{mesh_ranks} (its mesh); pass group=None to use the DTensor's mesh"
        )
    tp, rank = dist.get_world_size(pg), dist.get_rank(pg)
    vl = logits_local.shape[-1]
    _check_index_range("target", target, tp * vl, ignore_index)
    lead = target.shape
    loss = _VocabParallelCrossEntropy.apply(
        logits_local.reshape(-1, vl), target.reshape(-1).long(), pg, ignore_index, reduction, rank * vl
    )
    return loss.view(lead) if reduction == "none" else loss


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} of shape {tuple(t.shape)}"
    return type(t).__name__
