"""Gradient clipping for a model whose parameters live on several meshes.

``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms into one tensor, which DTensor refuses
when they sit on different meshes ("All operands in aten.stack.default must have the same mesh"). A
model made parallel here has such a mix: tensor-parallel weights on ``(dp_replicate, dp_shard, tp)``
after FSDP2, norms and routers on ``(dp_replicate, dp_shard)``, experts on ``(dp_replicate, edp_shard,
ep)``, plain tensors under DDP. :func:`clip_grad_norm_` groups the gradients by mesh, takes each group's
norm with torch's ``get_total_norm`` (a DTensor norm of sharded gradients is a partial one, reduced over
that mesh by ``full_tensor``; a replicated gradient counts once), combines the groups' norms into the
total and scales every gradient's local shard by torch's clip coefficient. No host sync; one all-reduce
per mesh that holds sharded gradients.

Example (one process; under torchrun every rank runs the same lines on its parallelized model)::

    >>> import torch
    >>> from smptk.parallel import clip_grad_norm_
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> loss = model(torch.ones(3, 4)).sum()
    >>> loss.backward()
    >>> total = clip_grad_norm_(model.parameters(), max_norm=1.0)   # as torch's, on any mix of meshes
    >>> total                                 # the norm before clipping: sqrt(8 * 3**2 + 2 * 3**2)
    tensor(9.4868)
    >>> opt.step()
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters on any mix of meshes (see the module docstring).

    Args:
        parameters: the parameters (or one tensor) whose ``.grad`` is clipped; those without one are skipped.
        max_norm: the largest total norm the gradients keep (0 zeroes them, as torch's does): a number or
            a one-element tensor.
        norm_type: the p of the p-norm, any nonzero p (``inf`` for the largest absolute value, ``-inf``
            for the smallest). 0, which torch takes to count the nonzero gradients, is refused: it is no
            norm to clip by.
        error_if_nonfinite: raise when the total norm is NaN or infinite (as torch's; a host sync).
        foreach: torch's argument, for the per-group norms and the scaling.

    Returns:
        The total norm of all gradients as one plain tensor, the same on every rank, before clipping: fp32
        (fp64 when a gradient is fp64; torch's is the gradients' dtype, bf16 for bf16 gradients). A NaN in
        any gradient on any rank makes it NaN, as torch's.

    Example (one process; every rank of a job runs the same call)::

        >>> import torch
        >>> from smptk.parallel import clip_grad_norm_
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> p.grad = torch.tensor([3.0, 4.0])
        >>> clip_grad_norm_([p], max_norm=1.0)
        tensor(5.)
        >>> p.grad
        tensor([0.6000, 0.8000])
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list(parameters)
    if isinstance(max_norm, torch.Tensor):
        if max_norm.numel() != 1 or max_norm.dtype.is_complex:
            raise ValueError(f"max_norm: expected a number or a one-element real tensor, got {max_norm!r}")
    elif isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not max_norm >= 0:
        raise ValueError(f"max_norm: expected a number >= 0, got {max_norm!r}")
    norm_type = float(norm_type)
    if norm_type == 0:
        raise ValueError("norm_type: 0 is not a norm to clip by (torch's counts the nonzero gradients)")
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for mesh, group in groups.items():
        if math.isinf(norm_type):  # torch's fails on an empty shard (a small tensor on many ranks)
            norms.append(_extreme_norm(mesh, group, largest=norm_type > 0).to(dtype))
            continue
        norm = torch.nn.utils.get_total_norm(group, norm_type, False, foreach)  # no copies of the gradients
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).to(dtype))
    device = norms[0].device
    norms = [n.to(device) for n in norms]
    if norm_type == math.inf:
        total = torch.stack(norms).max()
    elif norm_type == -math.inf:
        total = torch.stack(norms).min()
    else:
        total = torch.stack(norms).pow(norm_type).sum().pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it "
            "cannot be clipped; error_if_nonfinite=False clips anyway"
        )
    if isinstance(max_norm, torch.Tensor):
        max_norm = max_norm.reshape(()).to(total.device, total.dtype)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g  # the shard itself: scaled in place
        by_device.setdefault(local.device, []).append(local)
    for dev, tensors in by_device.items():
        torch._foreach_mul_(tensors, coef.to(dev))
    return total


def _extreme_norm(mesh, grads: list[torch.Tensor], largest: bool) -> torch.Tensor:
    """The largest (``largest``, the inf norm) or smallest (the -inf norm) absolute value of ``grads`` (one
    mesh's DTensors, or plain tensors for ``mesh`` None), fp32, the same on every rank: each rank's over its
    non-empty shards (without one: 0 for the largest, inf for the smallest), then over the mesh. torch's
    ``_foreach_norm`` refuses either norm of an empty tensor, which FSDP2 gives a rank whose shard of a small
    parameter is empty (that rank would raise while the others wait in the all-reduce).

    A partial gradient (a replicated weight over sequence-parallel activations, before any data-parallel
    reduction) is summed first: its pieces' extreme value is not its sum's. A NaN travels as a flag beside
    the value: a max or min all-reduce keeps or drops a NaN operand by rank order (gloo drops rank 1's), so
    the ranks would disagree on the norm and on whether ``error_if_nonfinite`` raises."""
    local = []
    for g in grads:
        if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
            g = g.redistribute(placements=[Replicate() if p.is_partial() else p for p in g.placements])
        local.append(g.to_local() if isinstance(g, DTensor) else g)
    values = [
        (t.detach().abs().amax() if largest else t.detach().abs().amin()).float() for t in local if t.numel()
    ]
    if values:
        m = torch.stack(values).amax() if largest else torch.stack(values).amin()
    else:
        m = torch.full((), 0.0 if largest else math.inf, dtype=torch.float32, device=local[0].device)
    if mesh is None:
        return m
    sign = 1.0 if largest else -1.0  # the smallest is minus the largest of the negated values
    flagged = torch.stack([torch.where(m.isnan(), -math.inf, sign * m), m.isnan().float()])
    m, nan = DTensor.from_local(flagged, mesh, [Partial("max")] * mesh.ndim).full_tensor().unbind()
    return torch.where(nan > 0, torch.full_like(m, math.nan), sign * m)


__all__ = ["clip_grad_norm_"]
