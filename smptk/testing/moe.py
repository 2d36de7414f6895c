"""fp32 references for the MoE routing ops, written from the math with plain PyTorch and Python loops.

Independent of :mod:`smptk.kernels` by construction (nothing is imported from it): the selection is a
pairwise rank count instead of a sort or an argmax, the grouping a Python loop over the pairs, the combine a
loop over slots. Slow, meant for test-sized inputs (a few thousand pairs).

Legend: T tokens, E experts, k slots per token, H hidden size; pair ``p = t * k + j``.

- :func:`moe_route_reference`: scores (softmax, or sigmoid), top-k by ``score + bias`` with ties to the lower
  expert id, weights from the unbiased scores (optionally renormalized over the k picks), counts, the
  switch load-balancing loss ``E * sum_e f_e P_e`` (Switch Transformer, Fedus et al. 2021; for sigmoid, P
  uses the scores normalized per token) and the z-loss ``mean_t logsumexp(logits_t)^2`` (ST-MoE, Zoph et al.
  2022). Differentiable in the logits through autograd.
- :func:`moe_dispatch_reference`: the stable grouping by expert with drop-by-position capacity.
- :func:`moe_combine_reference`: ``out[t] = sum_j w[t, j] * y[dest[t, j]]`` over kept pairs.

Example::

    >>> ref = moe_route_reference(torch.tensor([[1.0, 1.0, 0.0]]), 2)
    >>> ref.expert_ids.tolist(), ref.weights.tolist()
    ([[0, 1]], [[0.5, 0.5]])
"""

from __future__ import annotations

import decimal
import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "MoEDispatchReference",
    "MoERouteReference",
    "moe_capacity_reference",
    "moe_combine_reference",
    "moe_dispatch_reference",
    "moe_route_reference",
]


class MoERouteReference(NamedTuple):
    weights: Tensor  # [T, k] fp32
    expert_ids: Tensor  # [T, k] int64
    tokens_per_expert: Tensor  # [E] int64
    aux_loss: Tensor  # 0-d fp32
    z_loss: Tensor  # 0-d fp32


class MoEDispatchReference(NamedTuple):
    x_grouped: Tensor  # [R, H] fp32
    offsets: Tensor  # [E + 1] int64
    tokens_per_expert: Tensor  # [E] int64, kept
    dest: Tensor  # [T, k] int64, -1 where dropped
    source_token: Tensor  # [R] int64
    source_pair: Tensor  # [R] int64
    num_dropped: int
    capacity: int | None


def _rank_desc_lower_id_first(key: Tensor) -> Tensor:
    """``rank[t, e]`` = number of experts ahead of e in token t's order: those with a strictly larger key,
    plus those with an equal key and a lower id. A permutation of 0..E-1 per row (for NaN-free keys)."""
    E = key.shape[1]
    a = key[:, :, None]  # the expert being ranked, e
    b = key[:, None, :]  # every other expert, e'
    lower_id = torch.arange(E)[None, :] < torch.arange(E)[:, None]  # [e, e']: e' < e
    ahead = (b > a) | ((b == a) & lower_id.to(key.device)[None])
    return ahead.sum(dim=2)


def moe_route_reference(
    logits: Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    renormalize: bool = True,
    expert_bias: Tensor | None = None,
) -> MoERouteReference:
    """The routing of ``logits [T, E]`` in fp32 (see the module docstring). Pass an fp32 leaf that requires
    grad to differentiate weights, aux_loss and z_loss.

    >>> r = moe_route_reference(torch.tensor([[0.0, 2.0, 1.0]]), 2, score_func="sigmoid", renormalize=False)
    >>> r.expert_ids.tolist(), [round(w, 4) for w in r.weights[0].tolist()]
    ([[1, 2]], [0.8808, 0.7311])
    """
    s = logits.to(torch.float32)
    T, E = s.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k: expected 1..E = 1..{E}, got {top_k}")
    if score_func == "softmax":
        score = torch.exp(s - s.max(dim=1, keepdim=True).values)
        score = score / score.sum(dim=1, keepdim=True)
        prob = score
    elif score_func == "sigmoid":
        score = torch.sigmoid(s)  # 1 / (1 + exp(-s)) overflowed below s = -88.7: NaN gradients
        prob = score / score.sum(dim=1, keepdim=True)
    else:
        raise ValueError(f"score_func: unknown {score_func!r}")
    key = score.detach()
    if expert_bias is not None:
        key = key + expert_bias.detach().to(torch.float32)[None, :]
    rank = _rank_desc_lower_id_first(key)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=s.device)
    for r in range(top_k):
        ids[:, r] = (rank == r).to(torch.int64).argmax(dim=1)
    weights = torch.stack([score[torch.arange(T), ids[:, r]] for r in range(top_k)], dim=1)
    if renormalize:
        weights = weights / weights.sum(dim=1, keepdim=True)
    counts = torch.zeros(E, dtype=torch.int64, device=s.device)
    for e in range(E):
        counts[e] = (ids == e).sum()
    if T == 0:
        zero = s.sum() * 0.0
        return MoERouteReference(weights, ids, counts, zero, zero)
    f = counts.to(torch.float32) / (T * top_k)
    P = prob.sum(dim=0) / T
    aux = E * (f * P).sum()
    m = s.max(dim=1).values
    lse = m + torch.log(torch.exp(s - m[:, None]).sum(dim=1))
    z = (lse * lse).sum() / T
    return MoERouteReference(weights, ids, counts, aux, z)


def moe_capacity_reference(capacity_factor: float | None, T: int, k: int, E: int) -> int | None:
    """``ceil(capacity_factor * T * k / E)`` on the number as written (a float's shortest decimal, ``str``),
    in decimal arithmetic; None without a factor.

    >>> moe_capacity_reference(0.5, 4, 2, 3), moe_capacity_reference(0.8, 600, 2, 5)
    (2, 192)
    """
    if capacity_factor is None:
        return None
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor: expected None or a number > 0, got {capacity_factor!r}")
    value = capacity_factor if isinstance(capacity_factor, int) else float(capacity_factor)
    with decimal.localcontext(prec=60):
        return math.ceil(decimal.Decimal(str(value)) * T * k / E)


def moe_dispatch_reference(
    x: Tensor, expert_ids: Tensor, num_experts: int, capacity_factor: float | None = None
) -> MoEDispatchReference:
    """Group the rows of ``x [T, H]`` by expert, pair order inside each expert, earliest pairs kept.

    ``x_grouped`` is fp32 and differentiable in ``x`` (an fp32 leaf that requires grad).

    >>> ids = torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0]])
    >>> ref = moe_dispatch_reference(torch.zeros(4, 1), ids, 3, 0.5)
    >>> ref.dest.tolist(), ref.num_dropped
    ([[0, 4], [5, 2], [1, 3], [-1, -1]], 2)
    """
    T, k = expert_ids.shape
    E = num_experts
    cap = moe_capacity_reference(capacity_factor, T, k, E)
    per_expert: list[list[int]] = [[] for _ in range(E)]
    for p, e in enumerate(expert_ids.reshape(-1).tolist()):
        if not 0 <= e < E:
            raise ValueError(f"expert_ids: {e} is outside [0, {E})")
        if cap is None or len(per_expert[e]) < cap:
            per_expert[e].append(p)
    source_pair = [p for pairs in per_expert for p in pairs]
    dest = [-1] * (T * k)
    for row, p in enumerate(source_pair):
        dest[p] = row
    kept = [len(pairs) for pairs in per_expert]
    offsets = [0]
    for c in kept:
        offsets.append(offsets[-1] + c)
    source_token = [p // k for p in source_pair]
    as_long = lambda v: torch.tensor(v, dtype=torch.int64, device=x.device)
    x_grouped = x.to(torch.float32)[as_long(source_token)]
    return MoEDispatchReference(
        x_grouped=x_grouped,
        offsets=as_long(offsets),
        tokens_per_expert=as_long(kept),
        dest=as_long(dest).view(T, k),
        source_token=as_long(source_token),
        source_pair=as_long(source_pair),
        num_dropped=T * k - len(source_pair),
        capacity=cap,
    )


def moe_combine_reference(y: Tensor, dest: Tensor, weights: Tensor) -> Tensor:
    """``out[t] = sum_j weights[t, j] * y[dest[t, j]]`` over ``dest >= 0``, fp32 ``[T, H]``; differentiable
    in ``y`` and ``weights``.

    >>> moe_combine_reference(torch.tensor([[1.0], [10.0]]), torch.tensor([[1, -1], [0, 1]]),
    ...                       torch.tensor([[0.5, 7.0], [1.0, 2.0]])).tolist()
    [[5.0], [21.0]]
    """
    T, k = dest.shape
    y32 = y.to(torch.float32)
    w32 = weights.to(torch.float32)
    # A zero row after the last one stands in for every dropped pair (and keeps R = 0 indexable).
    y_pad = torch.cat([y32, y32.new_zeros(1, y32.shape[1])])
    rows = torch.where(dest >= 0, dest, y32.shape[0])
    out = y32.new_zeros(T, y32.shape[1])
    for j in range(k):
        out = out + w32[:, j : j + 1] * y_pad[rows[:, j]]
    return out
