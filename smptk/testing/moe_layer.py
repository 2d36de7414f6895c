"""fp32 reference of the whole MoE layer: routing, a dense loop over experts, the weighted sum.

Written from the math with plain PyTorch (the routing from :func:`smptk.testing.moe.moe_route_reference`,
itself independent of the kernels); differentiable through autograd, so the tests compare values and
gradients of :class:`smptk.parallel.MoE` against it. Slow: meant for test-sized inputs.

For each expert e, in pair order ``t * k + j``, the pairs routed to e (the first ``capacity`` of them when
a capacity factor is given) are gathered, run through e's SwiGLU MLP
``(silu(x @ w_gate[e].T) * (x @ w_up[e].T)) @ w_down[e].T`` and added to their tokens' outputs with their
routing weights. Shared experts add ``(silu(x @ shared_gate.T) * (x @ shared_up.T)) @ shared_down.T``.

Example::

    >>> import torch
    >>> from smptk.testing import moe_layer_reference
    >>> _ = torch.manual_seed(0)
    >>> T, H, F, E = 4, 8, 16, 4                  # tokens, hidden, expert MLP width, experts
    >>> x, router_weight = torch.randn(T, H), torch.randn(E, H)
    >>> w_gate, w_up, w_down = torch.randn(E, F, H), torch.randn(E, F, H), torch.randn(E, H, F)
    >>> y, aux = moe_layer_reference(x, router_weight, w_gate, w_up, w_down, top_k=2, aux_loss_coef=0.01)
    >>> y.shape, y.dtype, aux.shape
    (torch.Size([4, 8]), torch.float32, torch.Size([]))
    >>> y1, _ = moe_layer_reference(x, router_weight, w_gate, w_up, w_down, top_k=1)
    >>> e = int((x[0] @ router_weight.T).argmax())   # top-1: token 0 goes to its best expert, weight 1
    >>> mlp = (torch.nn.functional.silu(x[0] @ w_gate[e].T) * (x[0] @ w_up[e].T)) @ w_down[e].T
    >>> torch.allclose(y1[0], mlp)
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from smptk.testing.moe import moe_capacity_reference, moe_route_reference

__all__ = ["moe_layer_reference"]


def _mlp(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    return (F.silu(x @ gate.float().T) * (x @ up.float().T)) @ down.float().T


def moe_layer_reference(
    x: Tensor,
    router_weight: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    renormalize: bool = True,
    expert_bias: Tensor | None = None,
    capacity_factor: float | None = None,
    shared: tuple[Tensor, Tensor, Tensor] | None = None,
    aux_loss_coef: float = 0.0,
    z_loss_coef: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """``(y [T, H] fp32, aux fp32 [])`` of the MoE layer on ``x [T, H]`` (all E experts on one device).

    Args: the layer's weights (``router_weight [E, H]``, ``w_gate``/``w_up [E, F, H]``, ``w_down [E, H, F]``,
    shared ``(gate [S, H], up [S, H], down [H, S])``) and options, as :class:`smptk.parallel.MoE` takes
    them. ``aux = aux_loss_coef * load-balancing loss + z_loss_coef * z-loss``.
    """
    x32 = x.float()
    T, H = x32.shape
    E = router_weight.shape[0]
    routing = moe_route_reference(
        x32 @ router_weight.float().T,
        top_k,
        score_func=score_func,
        renormalize=renormalize,
        expert_bias=expert_bias,
    )
    capacity = moe_capacity_reference(capacity_factor, T, top_k, E)
    ids = routing.expert_ids.tolist()
    y = x32.new_zeros(T, H)
    for e in range(E):
        pairs = [(t, j) for t in range(T) for j in range(top_k) if ids[t][j] == e]
        if capacity is not None:
            pairs = pairs[:capacity]
        if not pairs:
            continue
        tok = torch.tensor([t for t, _ in pairs], device=x.device)
        slot = torch.tensor([j for _, j in pairs], device=x.device)
        y_e = _mlp(x32[tok], w_gate[e], w_up[e], w_down[e])
        y = y.index_add(0, tok, y_e * routing.weights[tok, slot].unsqueeze(1))
    if shared is not None:
        y = y + _mlp(x32, *shared)
    aux = routing.aux_loss * aux_loss_coef + routing.z_loss * z_loss_coef
    return y, aux
