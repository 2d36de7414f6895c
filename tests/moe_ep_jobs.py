"""The multi-rank side of ``tests/test_moe_ep.py``: expert-parallel MoE on W gloo ranks vs one device.

Every rank builds the same full set of weights from one seed, an expert-parallel layer
(``ep_group`` = the world: its expert weights are DTensors ``Shard(0)`` on a 1-D mesh over the group,
each rank holding E / W experts), and a single-device layer holding all E. Each rank
feeds its own tokens to both and compares:

- the output (the same kernels run the same rows, so only row order inside an expert differs);
- the gradients of x and of the router (replicated: each rank's own tokens only);
- the gradients of its local experts against the single-device gradients of those experts summed over
  all ranks' tokens (an all_reduce of the single-device gradients, with gloo);
- the aux loss and ``tokens_per_expert`` (each rank's own tokens, as on one device).

Cases: even routing; a rank with no tokens at all; every token of every rank routed to rank 0's first
expert, so the other ranks receive nothing; capacity drops; shared experts; sigmoid scores; ``[B, S, H]``
inputs of another batch and length per rank (rank 1's empty) with frozen experts, so the rows' gradients
return through the all-to-alls without expert weight gradients; and (2 ranks) the bias update's group and
shape propagation on the meta device.

Example::

    >>> from comm_harness import run_ranks
    >>> run_ranks("moe_ep_jobs:run", world=2, timeout_s=300).values[0]   # {case: None or problems}
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from helpers import compare_rel

from smptk.parallel import MoE

H, F_, E = 12, 20, 8
REL = 1e-4  # of the reference's largest value; see tests/test_moe_layer.py for why
_compare = functools.partial(compare_rel, rel=REL)

CASES = {
    "even": {"top_k": 2},
    "rank1_no_tokens": {"top_k": 2, "tokens": {1: 0}},
    "all_to_rank0": {"top_k": 1, "skew": True},
    "capacity": {"top_k": 2, "capacity_factor": 0.5},
    "shared_sigmoid": {"top_k": 3, "score_func": "sigmoid", "num_shared_experts": 1, "aux_loss_coef": 0.01},
    "frozen_experts_3d": {
        "top_k": 2,
        "z_loss_coef": 0.01,
        "frozen_experts": True,
        "batch": {0: (2, 4), 1: (3, 0)},
    },
}


def _pair(world: int, rank: int, group: dist.ProcessGroup, **options) -> tuple[MoE, MoE]:
    """(expert-parallel layer, single-device layer) with the same weights on every rank."""
    full = MoE(H, F_, E, **options)
    torch.manual_seed(1234)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape) * (0.5 if p is full.router_weight else p.shape[-1] ** -0.5))
    ep = MoE(H, F_, E, ep_group=group, **options)
    lo = rank * (E // world)
    with torch.no_grad():
        ep.router_weight.copy_(full.router_weight)
        for name in ("w_gate", "w_up", "w_down"):  # DTensors Shard(0) on the ep mesh: this rank's experts
            getattr(ep, name).to_local().copy_(getattr(full, name)[lo : lo + E // world])
        for name in ("shared_gate", "shared_up", "shared_down"):
            if hasattr(full, name):
                getattr(ep, name).copy_(getattr(full, name))
    return ep, full


def run_case(world: int, rank: int, name: str, options: dict) -> list[str]:
    options = dict(options)
    tokens = options.pop("tokens", {}).get(rank, 5 + 3 * rank)
    skew = options.pop("skew", False)
    frozen = options.pop("frozen_experts", False)
    shape = (*options.pop("batch")[rank], H) if "batch" in options else (tokens, H)
    group = dist.group.WORLD
    ep, full = _pair(world, rank, group, **options)
    if skew:
        with torch.no_grad():
            for layer in (ep, full):
                layer.router_weight.zero_()
                layer.router_weight[0] = 1.0  # positive inputs: expert 0 (rank 0's) wins every token
    for layer in (ep, full) if frozen else ():
        for wname in ("w_gate", "w_up", "w_down"):
            getattr(layer, wname).requires_grad_(False)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.rand(shape, generator=gen) + (0.1 if skew else -0.5)
    x_ep = x.clone().requires_grad_()
    x_full = x.clone().requires_grad_()
    dy = torch.randn(shape, generator=gen)
    y_ep = ep(x_ep)
    y_full = full(x_full)
    ((y_ep * dy).sum() + ep.aux_loss).backward()
    ((y_full * dy).sum() + full.aux_loss).backward()
    problems: list[str] = []
    _compare(problems, "y", y_ep.detach(), y_full.detach())
    _compare(problems, "dx", x_ep.grad, x_full.grad)
    _compare(problems, "drouter", ep.router_weight.grad, full.router_weight.grad)
    _compare(problems, "aux_loss", ep.aux_loss, full.aux_loss)
    if not torch.equal(ep.tokens_per_expert, full.tokens_per_expert):
        problems.append(
            f"tokens_per_expert {ep.tokens_per_expert.tolist()} vs {full.tokens_per_expert.tolist()}"
        )
    lo = rank * (E // world)
    for wname in ("w_gate", "w_up", "w_down") if not frozen else ():
        total = getattr(full, wname).grad.clone()
        dist.all_reduce(total)  # every rank's tokens reach this rank's experts
        _compare(problems, f"d{wname}", getattr(ep, wname).grad.to_local(), total[lo : lo + E // world])
    if frozen and any(getattr(ep, wname).grad is not None for wname in ("w_gate", "w_up", "w_down")):
        problems.append("frozen experts got a gradient")
    if skew and rank != 0:
        for wname in ("w_gate", "w_up", "w_down"):
            grad = getattr(ep, wname).grad.to_local()
            if not torch.equal(grad, torch.zeros_like(grad)):
                problems.append(f"d{wname}: experts that received no tokens got a nonzero gradient")
    return [f"{name} (rank {rank}): {p}" for p in problems]


# Capacity drops, shared experts and sigmoid scores are options of the local computation, the same at any
# world size: 2 ranks run them; 4 ranks run only the cases where the number of ranks shapes the traffic
# (which keeps the 4-rank job, about 20 s a case on 2 CPU cores, inside the suite's time budget).
ROUTING_CASES = ("even", "rank1_no_tokens", "all_to_rank0")


def cases(world: int) -> list[str]:
    """The cases a W-rank job runs, in order."""
    return [*CASES, "expert_bias_group", "meta_shapes"] if world == 2 else list(ROUTING_CASES)


def expert_bias_group(rank: int) -> list[str]:
    """An expert-parallel layer's bias update needs the group whose ranks route other tokens: without it
    each rank used to steer by its own load and keep another bias (the replicated router then chose by
    another rule per rank); with it every rank ends with the same bias."""
    problems = []
    torch.manual_seed(0)
    moe = MoE(H, F_, E, 2, expert_bias=True, ep_group=dist.group.WORLD)
    moe(torch.randn(4 + 3 * rank, H, generator=torch.Generator().manual_seed(rank)))
    try:
        moe.update_expert_bias(1e-3)
        problems.append("no error without group")
    except ValueError as e:
        if "expert-parallel" not in str(e):
            problems.append(f"message: {e}")
    load = moe.update_expert_bias(1e-3, group=dist.group.WORLD)
    biases = [torch.empty_like(moe.expert_bias) for _ in range(dist.get_world_size())]
    dist.all_gather(biases, moe.expert_bias)
    if not all(torch.equal(b, biases[0]) for b in biases) or int(load.sum()) != 2 * (4 + 7):
        problems.append(f"biases {[b.tolist() for b in biases]}, load {load.tolist()}")
    return problems


def meta_shapes(rank: int) -> list[str]:
    """A meta-built expert-parallel layer propagates shapes, as the unsharded one does: forward and backward
    on meta ran the pre-hook's count exchange and failed reading it ("Cannot copy out of meta tensor")."""
    problems = []
    for capacity_factor in (None, 1.0):
        try:
            with torch.device("meta"):
                moe = MoE(H, F_, E, 2, ep_group=dist.group.WORLD, capacity_factor=capacity_factor)
            x = torch.empty(2, 3 + rank, H, device="meta", requires_grad=True)
            y = moe(x)
            y.sum().backward()
            shapes = (y.shape, x.grad.shape, moe.w_gate.grad.to_local().shape)
            if shapes != (x.shape, x.shape, (E // dist.get_world_size(), F_, H)):
                problems.append(f"capacity_factor {capacity_factor}: shapes {shapes}")
        except Exception as e:  # reported as the case's problem
            problems.append(f"capacity_factor {capacity_factor}: {type(e).__name__}: {e}")
    return problems


def run(rank: int, world: int) -> dict[str, str | None]:
    """Every case of ``cases(world)`` on every rank, in order; {case: None or the problems}."""
    outcomes: dict[str, str | None] = {}
    for name in cases(world):
        problems = (
            expert_bias_group(rank)
            if name == "expert_bias_group"
            else meta_shapes(rank)
            if name == "meta_shapes"
            else run_case(world, rank, name, CASES[name])
        )
        outcomes[name] = "\n".join(problems) or None
    return outcomes
