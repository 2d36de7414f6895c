"""Expert parallelism as DTensors: the MoE experts' weights split over the ``ep`` mesh, the rows exchanged.

Legend: R ranks of the 1-D ``ep`` mesh, E experts, E_l = E / R experts per rank, H hidden size, F expert
FFN size, rows = (token, slot) pairs routed to experts.

:class:`ExpertParallel` is a torch ``ParallelStyle``: ``parallelize_module(model, ep_mesh, {"layers.0.moe":
ExpertParallel()})`` takes a :class:`~smptk.parallel.MoE` (or its :class:`~smptk.parallel.moe.GroupedExperts`)
and

1. replaces ``w_gate``, ``w_up`` ``[E, F, H]`` and ``w_down`` ``[E, H, F]`` by DTensors ``Shard(0)`` on
   the mesh (rank r keeps experts ``r * E_l .. (r + 1) * E_l - 1``, taken from group rank
   ``src_data_rank``'s full weights, or each rank's own when it is None);
2. wraps the experts module in the token exchange (a forward pre-hook and a forward hook, as torch's
   styles install their input and output functions): before the local grouped GEMMs each rank's rows go
   to the ranks that own their experts, after them the outputs come back (one all-gather of the
   ``[E]`` row counts, its one host read, and two all-to-alls of
   :func:`smptk.comm.functional.all_to_all`; backward: two all-to-alls, no host sync; see
   :mod:`smptk.parallel.moe`).

The experts module itself computes locally only (``weight.to_local()``), so the DTensor parameters are
what FSDP2 and torch.distributed.checkpoint see: ``fully_shard(moe.experts, mesh=expert_mesh[
"dp_replicate", "edp_shard"])`` shards each rank's ``E_l`` experts further over the data-parallel ranks
that the ``ep`` dim leaves (FSDP2 builds the ``(..., ep)`` DTensor and hands the ``Shard(0)`` one on
``ep`` back to the forward), and DCP saves global ``[E, ...]`` tensors that load under any other EP size
(EP1 included: plain tensors). :func:`apply_expert_parallel` does both for every MoE of a model under
the state of :func:`smptk.parallel.init`.

How FSDP2 shards the experts. FSDP2 shards dim 0 by default and pads it to a multiple of the shard ranks,
so a rank holding fewer experts than its shard group would leave a whole expert on rank 0 and none on
others (Mixtral 8x7B on 16 GPUs with ep 8: one expert per rank over 2 shard ranks, rank 0 keeping all of
it). :func:`expert_shard_dim` picks dim 1 there when it divides evenly (FSDP2 shards other dims only
evenly), and both :func:`apply_expert_parallel` and :func:`smptk.parallel.apply_data_parallel` (experts
left to the blocks' units, ep 1) pass it to ``fully_shard`` as ``shard_placement_fn``; torchtitan makes
the same choice. The memory planner counts the same placement.

Gradient scale. An expert's gradient already sums the rows of all R ranks of its ``ep`` group (the
all-to-all brings them), so FSDP2 over the ``(dp_replicate, edp_shard)`` ranks alone would divide it by
``dp / R`` where the dense parameters are divided by ``dp``: :func:`apply_expert_parallel` sets the
experts' gradient divide factor to ``dp`` (torchtitan does the same), so every gradient is the mean over
the data-parallel batch.

Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU), EP 2 x DP 1; a world of 4 makes
EP 2 x DP 2 with the same lines::

    >>> import torch
    >>> import torch.distributed as dist
    >>> from torch import nn
    >>> import smptk.parallel as sp
    >>> dist.init_process_group("gloo")
    >>> state = sp.init({"expert_parallel_degree": 2, "mixed_precision": "fp32"})
    >>> class Layer(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.moe = sp.MoE(16, 32, num_experts=4, top_k=2)
    ...     def forward(self, x):
    ...         return x + self.moe(x)
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.layers = nn.ModuleList(Layer() for _ in range(2))
    ...     def forward(self, x):
    ...         for layer in self.layers:
    ...             x = layer(x)
    ...         return x
    >>> model = Net()
    >>> sp.apply_expert_parallel(model, state)       # EP over "ep", FSDP2 over (dp_replicate, edp_shard)
    ['layers.0.moe', 'layers.1.moe']
    >>> model, report = sp.apply_data_parallel(model, state)   # the rest: FSDP2 over (dp_replicate, dp_shard)
    >>> model(torch.randn(5, 16)).sum().backward()
    >>> model.layers[0].moe.experts.w_gate.grad.to_local().shape   # this rank's 2 of the 4 experts
    torch.Size([2, 32, 16])
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

import smptk.comm.functional as cf
from smptk import comm
from smptk.parallel.moe import GroupedExperts, MoE
from smptk.parallel.tensor_parallel import _shard_of, _sharded_param

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def expert_major_order(counts_RE: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutation from (source rank, expert) row order to (expert, source rank) order, and the offsets.

    ``counts_RE[s, e]``: rows source s sent for local expert e, laid out source-major in the receive
    buffer. Returns ``(index [total] int64, offsets [E_l + 1] int64)`` with ``received[index]`` grouped
    by expert (sources in rank order within an expert) and expert e's rows at ``offsets[e]:offsets[e+1]``.
    ``total`` is ``counts_RE.sum()``, known on the host (passing it avoids a device sync).

    Example::

        >>> index, offsets = expert_major_order(torch.tensor([[2, 1], [0, 3]]), 6)
        >>> index.tolist(), offsets.tolist()     # received rows: s0e0 s0e0 s0e1 s1e1 s1e1 s1e1
        ([0, 1, 2, 3, 4, 5], [0, 2, 6])
        >>> expert_major_order(torch.tensor([[1, 1], [1, 1]]), 4)[0].tolist()
        [0, 2, 1, 3]
    """
    counts = counts_RE.to(torch.int64)
    flat = counts.reshape(-1)
    start_RE = (torch.cumsum(flat, 0) - flat).view_as(counts)  # receive offset of block (s, e)
    lens = counts.t().reshape(-1)  # blocks in (e, s) order
    starts = start_RE.t().reshape(-1)
    dst_start = torch.cumsum(lens, 0) - lens  # where each block starts in expert-major order
    shift = torch.repeat_interleave(starts - dst_start, lens, output_size=total)
    index = shift + torch.arange(total, device=counts.device, dtype=torch.int64)
    offsets = torch.zeros(counts.shape[1] + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts.sum(0), 0, out=offsets[1:])
    return index, offsets


class _TokenExchange:
    """The forward pre-hook and forward hook that carry an experts module's rows to their owners and back.

    The pre-hook turns the experts' input ``(x_grouped [rows, H] by global expert id, counts [E])`` into
    ``(rows received [rows', H] by local expert, counts [E_l])``; the hook turns the local output
    ``[rows', H]`` back into ``[rows, H]`` in the caller's order. What the hook needs from its pre-hook
    goes on a stack, so a module called again before its hook ran (never in one forward, but cheap to
    allow) still pairs them. On the meta device (shape propagation, delayed initialization) nothing is
    exchanged: the rows received are data-dependent, so this rank's own rows stand in for them (the
    layer's output shape does not depend on them) and no collective runs.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self._pending: list[tuple] = []

    def dispatch(self, module: nn.Module, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        x_grouped, counts_E = args
        g, R, me = self.mesh.get_group(), self.mesh.size(), self.mesh.get_local_rank()
        E = counts_E.numel()
        if module.num_experts != E:
            raise ValueError(
                f"counts: expected [{module.num_experts}] rows per expert, got {tuple(counts_E.shape)}"
            )
        E_l = E // R
        if x_grouped.is_meta:
            self._pending.append(None)
            return x_grouped, counts_E.new_empty(E_l)
        send_counts = counts_E.to(torch.int32)
        every = send_counts.new_empty(R * E)  # flat: gloo's all-gather takes no [R, E] output
        comm.all_gather_into_tensor(every, send_counts, group=g)
        every_RE = every.view(R, E)  # [s, r * E_l + e]: rows s sends r's expert e
        counts = every_RE.view(R, R, E_l).sum(dim=2).tolist()  # the one host sync: [s][r] rows s sends r
        send = counts[me]
        recv = [counts[s][me] for s in range(R)]
        peak = max(max(row) for row in counts)  # the same on every rank: no split exchange in the all-to-alls
        # rows arrive ordered (source rank, local expert); the backward returns the gradients without a sync
        x_recv = cf.all_to_all(x_grouped, g, recv, send, agreed_max_split=peak)
        recv_counts = every_RE[:, me * E_l : (me + 1) * E_l]
        index, _ = expert_major_order(recv_counts, sum(recv))
        # the inverse permutation takes the experts' output back to the receive order with a gather:
        # index_select keeps only the int64 index for backward, where index_copy's autograd would keep
        # its whole [rows', H] source (one more expert output per MoE layer held until backward)
        inverse = torch.empty_like(index).scatter_(0, index, torch.arange(index.numel(), device=index.device))
        self._pending.append((inverse, send, recv, peak, g))
        return x_recv.index_select(0, index), recv_counts.sum(0).to(torch.int64)

    def combine(self, module: nn.Module, args: tuple, y_local: torch.Tensor) -> torch.Tensor:
        pending = self._pending.pop()
        if pending is None:  # meta: nothing was exchanged
            return y_local
        inverse, send, recv, peak, g = pending
        return cf.all_to_all(y_local.index_select(0, inverse), g, send, recv, agreed_max_split=peak)


def _experts_of(module: object) -> GroupedExperts:
    if isinstance(module, MoE):
        return module.experts
    if isinstance(module, GroupedExperts):
        return module
    raise TypeError(
        f"module: expected a smptk.parallel.MoE or its GroupedExperts, got {type(module).__name__}"
    )


def _ep_mesh(mesh: object) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"device_mesh: expected a 1-D DeviceMesh (e.g. state.submesh('ep')), got {type(mesh).__name__}"
        )
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names or tuple(range(mesh.ndim))
        raise ValueError(
            f"device_mesh: expected a 1-D DeviceMesh, got {mesh.ndim} dimensions {tuple(names)}; "
            "pass mesh['ep']"
        )
    return mesh


def shard_experts(
    experts: GroupedExperts,
    mesh: DeviceMesh,
    *,
    src_data_rank: int | None = 0,
    device: torch.device | str | None = None,
) -> GroupedExperts:
    """Split ``experts``' weights over the 1-D ``mesh`` (DTensor ``Shard(0)``) and install the exchange.

    What :class:`ExpertParallel` does, in place. Materialized weights are cut by ``distribute_tensor``
    from group rank ``src_data_rank`` (None: every rank keeps the slice of its own full weights). Weights
    on the meta device become meta DTensors, or, with ``device``, this rank's uninitialized shard on
    ``device`` (for ``reset_parameters`` to fill).
    """
    experts = _experts_of(experts)
    mesh = _ep_mesh(mesh)
    R = mesh.size()
    if experts.ep_mesh is not None or any(isinstance(getattr(experts, n), DTensor) for n in EXPERT_WEIGHTS):
        raise ValueError("module: its experts are already expert-parallel (ExpertParallel applies once)")
    if experts.num_experts % R:
        raise ValueError(
            f"num_experts {experts.num_experts} is not divisible by the expert-parallel size {R}: each of "
            f"the {R} ranks holds an equal number of experts"
        )
    for name in EXPERT_WEIGHTS:
        w = getattr(experts, name)
        if w.is_meta and device is not None:  # allocate this rank's shard only, uninitialized
            param = _sharded_param(tuple(w.shape), Shard(0), mesh, torch.device(device), w.dtype)
            param.requires_grad_(w.requires_grad)
        else:
            param = _shard_of(w, Shard(0), mesh, src_data_rank)
        setattr(experts, name, param)
    exchange = _TokenExchange(mesh)
    experts.register_forward_pre_hook(exchange.dispatch)
    experts.register_forward_hook(exchange.combine)
    experts.ep_mesh = mesh
    return experts


class ExpertParallel(ParallelStyle):
    """Split a MoE layer's experts over a 1-D mesh (DTensor ``Shard(0)``) and exchange its rows.

    For ``parallelize_module(model, state.submesh("ep"), {"layers.0.moe": ExpertParallel()})``; the
    target is a :class:`~smptk.parallel.MoE` or its ``experts``. The module keeps its class and hooks;
    its router and shared experts stay plain (replicated) parameters for data parallelism. Weights come
    from group rank ``src_data_rank`` of the mesh (``parallelize_module``'s argument; None: each rank's
    own, which the MoE draws alike from the same seed).

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from torch.distributed.tensor.parallel import parallelize_module
        >>> import smptk.parallel as sp
        >>> from smptk.parallel import ExpertParallel
        >>> dist.init_process_group("gloo")
        >>> state = sp.init({"expert_parallel_degree": 2})
        >>> model = torch.nn.ModuleDict({"moe": sp.MoE(16, 32, num_experts=4, top_k=2)})
        >>> model = parallelize_module(model, state.submesh("ep"), {"moe": ExpertParallel()})
        >>> model["moe"].experts.w_gate.to_local().shape    # this rank's 2 of the 4 experts
        torch.Size([2, 32, 16])
        >>> model["moe"](torch.randn(5, 16)).shape            # rows exchanged with the other rank
        torch.Size([5, 16])
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard_experts(_experts_of(module), device_mesh, src_data_rank=self.src_data_rank)
        return module


def expert_shard_dim(local_shape, shard: int) -> int:
    """The dim FSDP2 shards a stacked expert tensor on (``[E_l, ...]``, this rank's experts) over ``shard``
    ranks: 0 when the experts divide evenly, else 1 when that dim does (FSDP2 shards dims other than 0
    only evenly), else 0 (FSDP2 pads it). 1-D tensors and one shard rank: 0.

    Example::

        >>> expert_shard_dim((4, 32, 64), 2), expert_shard_dim((1, 32, 64), 2), expert_shard_dim((3, 5, 7), 2)
        (0, 1, 0)
    """
    shape = tuple(local_shape)
    if shard <= 1 or len(shape) < 2 or shape[0] % shard == 0 or shape[1] % shard != 0:
        return 0
    return 1


def expert_placement_fn(shard: int, params=None):
    """A ``shard_placement_fn`` for ``fully_shard`` over ``shard`` ranks: ``Shard(expert_shard_dim(...))``
    for expert tensors (those in ``params``, a set of ids; None: every parameter), None (FSDP2's default,
    dim 0) for the others. A DTensor parameter (experts on ``ep``) is placed by its local shape."""

    def place(param: torch.Tensor):
        if params is not None and id(param) not in params:
            return None
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(expert_shard_dim(local.shape, shard))

    return place


def expert_parameter_ids(model: nn.Module) -> set[int]:
    """The ids of the stacked expert tensors (every :class:`GroupedExperts`' own parameters) in ``model``."""
    return {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters(False)}


def experts_without_unit(model: nn.Module) -> list[str]:
    """Qualified names of the expert modules of ``model`` whose weights are split over an ``ep`` mesh
    (DTensors: :class:`ExpertParallel`, ``MoE(ep_mesh=...)``) but that are no FSDP2 unit of their own: a
    data-parallel unit around them would put the ep mesh and the dp mesh on one parameter."""
    from torch.distributed.fsdp import FSDPModule

    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, GroupedExperts)
        and not isinstance(m, FSDPModule)
        and any(isinstance(p, DTensor) for p in m.parameters(False))
    ]


def apply_expert_parallel(
    model: nn.Module,
    state=None,
    *,
    fully_shard_experts: bool = True,
    mp_policy=None,
    reshard_after_forward: bool = True,
) -> list[str]:
    """Make every MoE of ``model`` expert-parallel under ``state`` (default :func:`smptk.parallel.current`).

    Each MoE's experts go on ``state.submesh("ep")`` (:class:`ExpertParallel`, in place); with
    ``fully_shard_experts`` each ``moe.experts`` then becomes its own FSDP2 unit over
    ``state.expert_mesh["dp_replicate", "edp_shard"]``, sharded on :func:`expert_shard_dim`, with
    gradient divide factor ``dp`` (see the module docstring; on gloo, which has no ``PREMUL_SUM``, a sum
    reduction and a separate scaling), ``mp_policy`` (a ``MixedPrecisionPolicy``; None: the config's
    ``mixed_precision``, as :func:`smptk.parallel.apply_data_parallel` gives the rest of the model) and
    ``reshard_after_forward``.
    Call it before sharding the rest of the model (``apply_data_parallel`` or ``fully_shard``: units go
    bottom-up, and the outer ones leave these parameters to their own unit). Returns the qualified names
    of the MoE modules converted.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if state is None:
        from smptk.parallel.config import current

        state = current()
    names = [name for name, m in model.named_modules() if isinstance(m, MoE)]
    if not names:
        raise ValueError("model: holds no smptk.parallel.MoE layer to make expert-parallel")
    ep_mesh = state.submesh("ep")
    modules = dict(model.named_modules())
    for name in names:
        shard_experts(modules[name].experts, ep_mesh, src_data_rank=0)
    if fully_shard_experts:
        from torch.distributed.fsdp import fully_shard

        from smptk.parallel.fsdp import mixed_precision_policy

        edp_mesh = state.expert_mesh["dp_replicate", "edp_shard"]
        policy = mp_policy if mp_policy is not None else mixed_precision_policy(state.config.mixed_precision)
        nccl = "nccl" in str(dist.get_backend(edp_mesh.get_group("edp_shard"))).lower()
        for name in names:
            unit = fully_shard(
                modules[name].experts,
                mesh=edp_mesh,
                mp_policy=policy,
                reshard_after_forward=reshard_after_forward,
                shard_placement_fn=expert_placement_fn(state.sizes["edp_shard"]),
            )
            unit.set_gradient_divide_factor(float(state.sizes["dp"]))
            # A custom factor is NCCL's PREMUL_SUM; gloo reduces with SUM and scales after. Not when the
            # shard dim has one rank: FSDP2 then skips the reduce-scatter, copying the gradient divided by
            # the factor, and would divide again after a forced SUM (HSDP with edp_shard 1: the experts'
            # gradients came out dp times too small, torch 2.13); without forcing, it all-reduces the
            # divided gradient with SUM over dp_replicate, which gloo has.
            if not nccl and state.sizes["edp_shard"] > 1:
                unit.set_force_sum_reduction_for_comms(True)
    return names


__all__ = [
    "ExpertParallel",
    "apply_expert_parallel",
    "expert_major_order",
    "expert_parameter_ids",
    "expert_placement_fn",
    "expert_shard_dim",
    "shard_experts",
]
