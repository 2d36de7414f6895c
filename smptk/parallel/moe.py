"""Mixture-of-Experts layer: a top-k router and SwiGLU experts, on one device or expert-parallel.

Legend: T tokens on this rank, H hidden size, F expert FFN size, E experts, k experts per token, R ranks
of the expert-parallel group, E_l = E / R experts per rank, rows = kept (token, slot) pairs.

Forward, one device::

    logits_TE = x_TH @ router_EH.T                 fp32 (whatever x's dtype, under autocast too; FSDP2's
                                                   16-bit mixed precision rounds router_EH first)
    route     = moe_route(logits_TE, k)            weights_Tk fp32, expert ids, counts, aux and z losses
    xg, plan  = moe_dispatch(x_TH, ids_Tk, E)      rows grouped by expert; plan.offsets [E + 1]
    h         = grouped_swiglu(xg, w_gate, w_up, offsets)      [rows, F], one launch for all experts
    yg        = grouped_linear(h, w_down, offsets)             [rows, H]
    y_TH      = moe_combine(yg, plan, weights_Tk) (+ shared experts' SwiGLU MLP of x)

Expert parallel. The experts live in the submodule ``moe.experts`` (:class:`GroupedExperts`: local compute
only, weights ``[E, F, H]`` / ``[E, H, F]``). :class:`smptk.parallel.ExpertParallel` (a ParallelStyle, see
:mod:`smptk.parallel.expert_parallel`) makes those weights DTensors ``Shard(0)`` on a 1-D ``ep`` mesh of R
ranks (rank r owns experts ``r * E_l .. (r + 1) * E_l - 1``) and wraps ``moe.experts`` in the token
exchange: the grouped buffer is ordered by expert id, so the rows for rank r are one contiguous block,
and

1. every rank's per-expert row counts ``[E]`` go through ``smptk.comm.all_gather_into_tensor``, so every
   rank holds the whole ``[R, E]`` count matrix; its one host read (the forward's only host sync) gives
   the split sizes and the largest split of any rank, which every rank passes as ``agreed_max_split`` so
   the all-to-alls need no exchange of their own;
2. the rows go through ``smptk.comm.functional.all_to_all`` with those uneven splits; they arrive ordered
   (source rank, local expert) and are permuted to (local expert, source rank) for the grouped GEMMs;
3. the expert outputs are permuted back and return by the inverse all-to-all; combine runs locally.

Per forward: one host sync and three collectives (the counts, the rows out, the rows back; with a
``capacity_factor`` a second host sync: the dispatch reads how many rows it kept, to size them); backward:
two all-to-alls and no host sync (an all-to-all's gradient is the all-to-all with the splits swapped). A
rank that receives no rows runs its experts on an empty buffer (zero weight gradients). ``MoE(...,
ep_group=g)`` or ``MoE(..., ep_mesh=m)`` applies the same style at construction.

Side effects and activation checkpointing. The forward sets :attr:`aux_loss`, :attr:`last_routing`,
:attr:`last_plan` and adds this call's routed pairs to the buffer ``tokens_per_expert``, except when it
runs inside autograd's backward pass: that is a checkpoint recompute (``torch.utils.checkpoint``, reentrant
or not, and every wrapper built on it), which repeats the forward to rebuild activations, and counting
its tokens again would double the load that :meth:`MoE.update_expert_bias` balances. Only training
forwards count (``module.train()``): an evaluation or generation pass does not steer the balancing. The
test is the autograd engine's current graph task (``torch._C._current_graph_task_id() != -1``: what
torch's own checkpoint uses to tell the two apart); the one cost is that a MoE forward that a user runs
on purpose inside a backward hook is not counted either. Call :meth:`MoE.update_expert_bias` after
backward (with the optimizer step), so a recompute routes with the bias the forward used. Reentrant
checkpointing runs the first forward under no_grad, so its :attr:`aux_loss` has no gradient: the layer
warns (use ``use_reentrant=False`` or :func:`smptk.parallel.apply_activation_checkpointing`).
``expert_bias`` stays fp32 through ``.half()`` / ``.bfloat16()`` / ``.to(dtype)``. ``tokens_per_expert`` is
not saved in the state dict, and loading one (after ``to_empty`` too) starts the count at zero.

Losses: ``aux_loss`` after each forward holds ``aux_loss_coef * load-balancing loss + z_loss_coef *
router z-loss`` of this rank's tokens (Switch Transformer's and ST-MoE's definitions, see
:mod:`smptk.kernels.moe_route`); add it to the training loss. With ``expert_bias=True`` the router keeps
a per-expert selection bias (aux-loss-free balancing: it changes which experts are picked, not their
weights) that :meth:`MoE.update_expert_bias` nudges toward equal load, as in DeepSeek-V3.

Example::

    >>> moe = MoE(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2, aux_loss_coef=0.01)
    >>> y = moe(torch.randn(4, 16, 64))          # [batch, seq, H] -> same shape
    >>> loss = y.square().mean() + moe.aux_loss
    >>> loss.backward()
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import smptk.comm.functional as cf
from smptk.comm.functional import GroupLike, resolve_group
from smptk.kernels import fused_linear, swiglu
from smptk.kernels.grouped_linear import grouped_linear, grouped_swiglu
from smptk.kernels.moe_dispatch import MoEDispatchPlan, check_capacity_factor, moe_combine, moe_dispatch
from smptk.kernels.moe_route import moe_route
from smptk.parallel.shard_init import fill_shard, local
from smptk.parallel.tensor_parallel import (
    _check_bool,
    _check_sequence_dim,
    _GatherSequence,
    _seq_dim,
    _tp_mesh,
)

SCORE_FUNCS = ("softmax", "sigmoid")


def _finite(value: object) -> bool:
    """A real number (numpy's included) that is finite: any int, or a float that is not inf / NaN."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return isinstance(value, numbers.Integral) or math.isfinite(value)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as three stacked weights, computed by one grouped launch each (local compute only).

    ``w_gate``, ``w_up``: ``[E, F, H]``; ``w_down``: ``[E, H, F]``; plain parameters, or DTensors
    ``Shard(0)`` on a 1-D ``ep`` mesh after :class:`smptk.parallel.ExpertParallel` (this rank then holds
    ``E / R`` experts and the style exchanges the rows around :meth:`forward`). The forward reads only
    the local shards (``to_local()``), so FSDP2 can shard these weights further over the data-parallel
    ranks left to the experts: its forward hook gives back the ``Shard(0)`` DTensors on the ``ep`` mesh.

    Args:
        num_experts: E. hidden_size: H. ffn_hidden_size: F. device, dtype: of the parameters.

    Example::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> from smptk.parallel import GroupedExperts
        >>> _ = torch.manual_seed(0)
        >>> experts = GroupedExperts(num_experts=3, hidden_size=4, ffn_hidden_size=8)
        >>> experts.reset_parameters()              # the weights start uninitialized (torch.empty)
        >>> experts.w_gate.shape, experts.w_down.shape
        (torch.Size([3, 8, 4]), torch.Size([3, 4, 8]))
        >>> x_grouped = torch.randn(5, 4)               # rows already grouped by expert (moe_dispatch)
        >>> y = experts(x_grouped, torch.tensor([2, 0, 3]))  # expert 0: rows 0-1, 1: none, 2: rows 2-4
        >>> x2 = x_grouped[2:]
        >>> swiglu = (F.silu(x2 @ experts.w_gate[2].T) * (x2 @ experts.w_up[2].T)) @ experts.w_down[2].T
        >>> y.shape, torch.allclose(y[2:], swiglu, atol=1e-6)
        (torch.Size([5, 4]), True)
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        E, F_, H = num_experts, ffn_hidden_size, hidden_size
        self.num_experts, self.hidden_size, self.ffn_hidden_size = E, H, F_
        self.w_gate = nn.Parameter(torch.empty(E, F_, H, **factory))
        self.w_up = nn.Parameter(torch.empty(E, F_, H, **factory))
        self.w_down = nn.Parameter(torch.empty(E, H, F_, **factory))
        self.ep_mesh: DeviceMesh | None = None  # set by ExpertParallel

    @property
    def num_local_experts(self) -> int:
        """Experts whose weights this rank holds (E without expert parallelism)."""
        return self.num_experts // (self.ep_mesh.size() if self.ep_mesh is not None else 1)

    def reset_parameters(self) -> None:
        """Each weight uniform in +-1/sqrt(fan_in) (nn.Linear's bound), drawn whole from torch's default
        generator in the order w_gate, w_up, w_down; a sharded weight keeps its slice, so any R gives the
        unsharded layer's values."""
        for name in ("w_gate", "w_up", "w_down"):
            w = getattr(self, name)
            if not local(w).is_meta:
                bound = 1.0 / math.sqrt(w.shape[-1])
                fill_shard(w, _uniform(bound), torch.default_generator)

    def forward(self, x_grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x_grouped [rows, H]`` grouped by the experts this rank holds, ``counts [E_held]`` their rows
        -> ``[rows, H]``: ``down(silu(x @ gate.T) * (x @ up.T))`` per expert."""
        w_gate, w_up, w_down = (local(w) for w in (self.w_gate, self.w_up, self.w_down))
        if counts.dim() != 1 or counts.numel() != w_gate.shape[0]:
            why = (
                " (the weights are sharded over ep: the rows must go through ExpertParallel's exchange)"
                if isinstance(self.w_gate, DTensor)
                else ""
            )
            raise ValueError(
                f"counts: expected [{w_gate.shape[0]}] rows per held expert, got {tuple(counts.shape)}{why}"
            )
        offsets = counts.new_zeros(counts.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts.to(torch.int64), 0, out=offsets[1:])
        h = grouped_swiglu(x_grouped, w_gate, w_up, offsets)
        return grouped_linear(h, w_down, offsets)

    def extra_repr(self) -> str:
        text = f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, ffn={self.ffn_hidden_size}"
        if self.ep_mesh is not None:
            text += f", ep_size={self.ep_mesh.size()}, local_experts={self.num_local_experts}"
        return text


def _uniform(bound: float):
    return lambda block, gen: nn.init.uniform_(block, -bound, bound, generator=gen)


def _in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread: a checkpoint recompute."""
    return torch._C._current_graph_task_id() != -1


def _replicas() -> int:
    """Ranks that may keep a copy of a layer's router and route other tokens: the data-parallel ranks
    under smptk.parallel.init (tensor-parallel peers route the same tokens), else the world."""
    from smptk.parallel import config

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    if config.is_initialized() and "dp" in config.current().sizes:
        return config.current().sizes["dp"]
    return dist.get_world_size()


def _balancing_group(group: GroupLike, ep_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group`` as a ProcessGroup, refused (ValueError) when it cannot hold every rank whose router must
    keep this rank's bias: the layer's expert-parallel ranks and, under smptk.parallel.init, the
    data-parallel ranks (a smaller group leaves replicas of the router with other biases)."""
    from smptk.parallel import config

    pg = resolve_group(group)
    ranks = set(dist.get_process_group_ranks(pg))
    need = set(dist.get_process_group_ranks(ep_group)) if ep_group is not None else set()
    what = "the layer's expert-parallel ranks"
    if config.is_initialized() and "dp" in config.current().sizes:
        need |= set(config.current().ranks("dp"))
        what = "this rank's data-parallel ranks (state.group('dp'))"
    if not need <= ranks:
        raise ValueError(
            f"group: holds ranks {sorted(ranks)}, not all of {what} {sorted(need)}: the ranks left out would "
            "steer by another load and keep another bias; pass state.group('dp')"
        )
    if config.is_initialized() and config.current().sizes.get("tp", 1) > 1 and not ranks <= need:
        raise ValueError(
            f"group: holds ranks {sorted(ranks - need)} outside {what} {sorted(need)}: tensor-parallel peers "
            "route the same tokens, so their counts would be added once per peer; pass state.group('dp')"
        )
    return pg


class MoE(nn.Module):
    """Router + SwiGLU experts (+ optional shared experts), single device or expert-parallel.

    Args:
        hidden_size: H.
        ffn_hidden_size: F, each routed expert's SwiGLU width.
        num_experts: E (divisible by the expert-parallel group's size).
        top_k: experts per token, ``1 <= top_k <= E``.
        score_func: "softmax" (Mixtral) or "sigmoid" (DeepSeek-V3).
        renormalize: scale each token's k weights to sum to 1.
        num_shared_experts: experts every token goes through (DeepSeek-style), computed as one SwiGLU MLP
            of width ``num_shared_experts * shared_ffn_hidden_size`` (the same function as their sum).
        shared_ffn_hidden_size: width of each shared expert (default: ``ffn_hidden_size``).
        aux_loss_coef, z_loss_coef: weights of the load-balancing loss and the router z-loss in
            :attr:`aux_loss`.
        capacity_factor: None for dropless routing, else each expert keeps at most
            ``ceil(capacity_factor * T * k / E)`` of this rank's (token, slot) pairs, earliest first in
            the flattened token order (``x.reshape(-1, H)``: with ``[B, S, H]`` input, batch row 0's
            tokens before row 1's, so a later sequence loses every contested slot; Megatron's
            ``[S, B, H]`` drops by position instead). Any finite number > 0, numpy's included (a huge
            one drops nothing). The aux loss and the counts of :meth:`update_expert_bias` are
            over the routed pairs, before dropping.
        expert_bias: keep a per-expert selection bias (aux-loss-free balancing); see
            :meth:`update_expert_bias`.
        ep_mesh: 1-D DeviceMesh to split the experts over (None: every expert on this device): applies
            :class:`smptk.parallel.ExpertParallel` at construction, so each rank holds ``E / R`` experts
            (the slices of the weights the unsharded layer draws from the same seed) and its own tokens.
        ep_group: the same as a process group (kept from before meshes; made into a 1-D mesh with
            ``DeviceMesh.from_group``); give at most one of the two.
        sequence_parallel: the input and output hold this tp rank's block of the sequence (after and
            before sequence-parallel layers): the layer gathers the sequence, runs whole on every tp rank
            and returns this rank's block, so its gradients and aux loss are the unsharded layer's on
            every tp rank. Without it, under tensor parallelism every tp rank must pass the same tokens.
        sequence_dim: the input's sequence dimension (``[b, s, H]``: 1; ``[s, b, H]``: 0); its length
            must be the same on every tp rank (not checked: a collective per forward; unequal blocks
            fail in the all-gather, or worse on some backends).
        tp_mesh: the 1-D tensor-parallel mesh of ``sequence_parallel`` (default: the current state's
            ``tp`` submesh).
        device, dtype: of the parameters.

    Parameters: ``router_weight [E, H]`` and the shared experts' on this module, the routed experts'
    in :attr:`experts` (:class:`GroupedExperts`; ``moe.w_gate`` etc. read them there).

    Attributes after a forward: ``aux_loss`` (0-d fp32, differentiable; zero when both coefficients
    are 0), ``last_routing`` (the :class:`~smptk.kernels.moe_route.MoERouting`) and ``last_plan``
    (the :class:`~smptk.kernels.moe_dispatch.MoEDispatchPlan`, e.g. ``num_dropped``); with
    ``record_router_probs = True``, ``last_router_probs`` (the softmax of the router logits per token,
    ``[T, E]`` fp32, differentiable: for a load-balancing loss pooled over layers, padding left out).
    The buffer ``tokens_per_expert`` [E] accumulates routed pairs per expert until
    :meth:`update_expert_bias`.
    A checkpoint recompute changes none of these (see the module docstring). ``aux_loss``,
    ``last_routing`` and ``last_plan`` hold the latest forward's autograd graph until the next forward: a
    forward never followed by backward (an exception mid-step) keeps one forward's activations alive that
    long; set them to None to free it at once.

    On the ``meta`` device (delayed initialization) forward and backward propagate shapes; with a
    capacity the grouped buffer takes its bound ``min(T * k, E * C)`` rows (see :func:`moe_dispatch`).
    Expert-parallel too: no rows are exchanged (no collective runs), each rank's experts take its own rows.

    Under tensor parallelism the layer is whole on every tp rank (its weights are not on the tp mesh) and
    must see the same tokens on each, as :func:`smptk.parallel.transform` arranges. After
    sequence-parallel layers, whose outputs hold one sequence block per tp rank, build it with
    ``sequence_parallel=True``: without it each tp rank's router and expert gradients would hold only
    its own block's share, nothing would sum them over tp (the replicas then drift apart, silently),
    and the aux loss would be each block's.

    Example::

        >>> _ = torch.manual_seed(0)
        >>> moe = MoE(64, 128, num_experts=8, top_k=2, num_shared_experts=1, capacity_factor=1.25)
        >>> y = moe(torch.randn(32, 64))
        >>> moe.last_plan.num_dropped   # pairs past an expert's capacity (C = 10 here), for this seed
        3
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int = 2,
        *,
        score_func: str = "softmax",
        renormalize: bool = True,
        num_shared_experts: int = 0,
        shared_ffn_hidden_size: int | None = None,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        capacity_factor: float | None = None,
        expert_bias: bool = False,
        ep_mesh: DeviceMesh | None = None,
        ep_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        tp_mesh: DeviceMesh | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.sequence_parallel = _check_bool("sequence_parallel", sequence_parallel)
        self.sequence_dim = _check_sequence_dim(sequence_dim)
        if tp_mesh is not None and not self.sequence_parallel:
            raise ValueError(
                "tp_mesh: only with sequence_parallel=True (the layer is whole on every tp rank)"
            )
        self.tp_mesh = _tp_mesh(tp_mesh) if self.sequence_parallel else None
        for name, value in (
            ("hidden_size", hidden_size),
            ("ffn_hidden_size", ffn_hidden_size),
            ("num_experts", num_experts),
            ("top_k", top_k),
            ("shared_ffn_hidden_size", 1 if shared_ffn_hidden_size is None else shared_ffn_hidden_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if top_k > num_experts:
            raise ValueError(f"top_k: expected at most num_experts={num_experts}, got {top_k}")
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func: expected one of {SCORE_FUNCS}, got {score_func!r}")
        # here, not at the first forward (moe_route refuses a non-bool renormalize there); a truthy
        # expert_bias such as "false" would switch the bias on
        renormalize = _check_bool("renormalize", renormalize)
        expert_bias = _check_bool("expert_bias", expert_bias)
        shared_ok = isinstance(num_shared_experts, int) and not isinstance(num_shared_experts, bool)
        if not shared_ok or num_shared_experts < 0:
            raise ValueError(f"num_shared_experts: expected an integer >= 0, got {num_shared_experts!r}")
        for name, value in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef)):
            if not (_finite(value) and value >= 0):
                raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
        if ep_group is not None:
            if ep_mesh is not None:
                raise ValueError("ep_group, ep_mesh: give at most one (ep_group becomes a 1-D mesh)")
            ep_mesh = _mesh_from_group(ep_group, device)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.renormalize = score_func, renormalize
        self.aux_loss_coef, self.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
        self.capacity_factor = check_capacity_factor(capacity_factor)
        factory = {"device": device, "dtype": dtype}
        H = hidden_size
        self.router_weight = nn.Parameter(torch.empty(num_experts, H, **factory))
        # built on meta when it is split at once: only the local shards are ever allocated
        expert_device = "meta" if ep_mesh is not None else device
        self.experts = GroupedExperts(num_experts, H, ffn_hidden_size, device=expert_device, dtype=dtype)
        self.num_shared_experts = num_shared_experts
        if num_shared_experts:
            # shared_ffn_hidden_size None: the experts' width
            width = num_shared_experts * (shared_ffn_hidden_size or ffn_hidden_size)
            self.shared_gate = nn.Parameter(torch.empty(width, H, **factory))
            self.shared_up = nn.Parameter(torch.empty(width, H, **factory))
            self.shared_down = nn.Parameter(torch.empty(H, width, **factory))
        bias = torch.zeros(num_experts, dtype=torch.float32, device=device) if expert_bias else None
        self.register_buffer("expert_bias", bias)
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64, device=device), persistent=False
        )
        self.aux_loss: torch.Tensor | None = None
        self.last_routing = None
        self.last_plan: MoEDispatchPlan | None = None
        # Set True to keep ``last_router_probs``: the router's softmax probabilities of this forward's
        # tokens, [T, E] fp32, differentiable (for a loss pooled over layers: transform's moe_aux_loss,
        # Hugging Face's definition). One extra softmax over [T, E] per forward.
        self.record_router_probs = False
        self.last_router_probs: torch.Tensor | None = None
        if ep_mesh is not None:
            from smptk.parallel.expert_parallel import shard_experts

            shard_experts(self.experts, ep_mesh, src_data_rank=None, device=_shard_device(ep_mesh, device))
        self.reset_parameters()

    # The routed experts' weights and layout, read from :attr:`experts` (these were MoE attributes before
    # the experts became a submodule of their own).
    w_gate = property(lambda self: self.experts.w_gate, doc="Routed experts' gate weights ``[E, F, H]``.")
    w_up = property(lambda self: self.experts.w_up, doc="Routed experts' up weights ``[E, F, H]``.")
    w_down = property(lambda self: self.experts.w_down, doc="Routed experts' down weights ``[E, H, F]``.")

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The 1-D mesh the experts are split over (None: all on this device)."""
        return self.experts.ep_mesh

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The expert-parallel process group (None without expert parallelism)."""
        return self.ep_mesh.get_group() if self.ep_mesh is not None else None

    @property
    def ep_size(self) -> int:
        return self.ep_mesh.size() if self.ep_mesh is not None else 1

    @property
    def ep_rank(self) -> int:
        return self.ep_mesh.get_local_rank() if self.ep_mesh is not None else 0

    @property
    def num_local_experts(self) -> int:
        return self.experts.num_local_experts

    @property
    def local_expert_ids(self) -> range:
        """Global ids of the experts this rank holds (all of them without expert parallelism)."""
        return range(self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts)

    # What the latest forward left for the caller (attached to its autograd graph): not state. A copy
    # starts without them, so copy.deepcopy works mid-training (graph tensors refuse to be deep-copied).
    _PER_FORWARD = ("aux_loss", "last_routing", "last_plan", "last_router_probs")

    def __deepcopy__(self, memo: dict) -> MoE:
        copy_ = type(self).__new__(type(self))
        memo[id(self)] = copy_
        for name, value in self.__dict__.items():
            copy_.__dict__[name] = None if name in self._PER_FORWARD else copy.deepcopy(value, memo)
        return copy_

    def reset_parameters(self) -> None:
        """Router ~ N(0, 0.02^2); projections uniform in +-1/sqrt(fan_in), nn.Linear's default bound; the
        expert bias and the load counts back to zero.

        Also what delayed initialization calls: a layer built under ``torch.device("meta")`` and
        materialized with ``to_empty`` (which leaves buffers uninitialized too) is then the layer built
        directly, for the same random state.
        """
        nn.init.normal_(self.router_weight, std=0.02)
        self.experts.reset_parameters()
        for name in ("shared_gate", "shared_up", "shared_down"):
            w = getattr(self, name, None)
            if w is not None:
                bound = 1.0 / math.sqrt(w.shape[-1])
                nn.init.uniform_(w, -bound, bound)
        with torch.no_grad():
            if self.expert_bias is not None:
                self.expert_bias.zero_()
            self.tokens_per_expert.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]``; sets :attr:`aux_loss`, :attr:`last_routing`, :attr:`last_plan`.
        With ``sequence_parallel``, ``x`` and the output hold this tp rank's sequence block. ``x`` is a plain
        tensor: a DTensor (the output of torch's ``SequenceParallel`` style, which keeps DTensors by default)
        is refused, naming ``x.to_local()``."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden_size:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected [..., {self.hidden_size}], got {shape}")
        if isinstance(x, DTensor):
            block = "this rank's sequence block" if self.sequence_parallel else "this rank's tokens"
            raise TypeError(f"x: a DTensor; pass {block} as a plain tensor (x.to_local())")
        if self.sequence_parallel:
            return self._sequence_parallel_forward(x)
        return self._forward(x)

    def _sequence_parallel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence through the layer on every tp rank, this rank's block out. Gathered by an
        all-gather whose backward keeps this rank's block, and split by a copy whose backward sums the
        blocks: the gradient reaching the layer is then the whole sequence's, equal on every tp rank, and
        so are its router's and experts' gradients and the aux loss (they are the unsharded layer's:
        nothing needs summing over tp afterwards)."""
        dim = _seq_dim(self.sequence_dim, x.dim(), "x", tuple(x.shape))
        mesh = self.tp_mesh
        size, rank, n = mesh.size(), mesh.get_local_rank(), x.shape[dim]
        if x.is_meta:  # shapes only (delayed initialization)
            whole = torch.cat([x] * size, dim)
        else:
            whole = _GatherSequence.apply(x, mesh.get_group(), size, rank, dim)
        y = self._forward(whole)
        if not y.is_meta:
            y = cf.copy_to_group(y, mesh)
        return y.narrow(dim, rank * n, n)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TH = x.reshape(-1, self.hidden_size)
        no_autocast = (  # fp32 under autocast too (it cast the router to bf16); meta has no autocast
            contextlib.nullcontext()
            if x_TH.device.type == "meta"
            else torch.autocast(x_TH.device.type, enabled=False)
        )
        with no_autocast:
            logits_TE = F.linear(x_TH.float(), self.router_weight.float())
        routing = moe_route(
            logits_TE,
            self.top_k,
            score_func=self.score_func,
            renormalize=self.renormalize,
            expert_bias=self.expert_bias,
        )
        x_grouped, plan = moe_dispatch(
            x_TH, routing.expert_ids, self.num_experts, capacity_factor=self.capacity_factor
        )
        y_grouped = self.experts(x_grouped, plan.tokens_per_expert)
        y_TH = moe_combine(y_grouped, plan, routing.weights)
        if self.num_shared_experts:
            y_TH = y_TH + fused_linear(swiglu(x_TH, self.shared_gate, self.shared_up), self.shared_down)
        probs = None
        if self.record_router_probs:  # in a recompute too: it saves the same tensors as the forward
            probs = torch.softmax(logits_TE, dim=-1)
        if not _in_backward():  # a checkpoint recompute leaves the statistics of its forward alone
            aux = routing.aux_loss * self.aux_loss_coef + routing.z_loss * self.z_loss_coef
            self.aux_loss, self.last_routing, self.last_plan = aux, routing, plan
            if probs is not None:
                self.last_router_probs = probs
            if self.training:  # an eval or generation forward does not steer the balancing
                with torch.no_grad():
                    self.tokens_per_expert += routing.tokens_per_expert
            if self.training and not torch.is_grad_enabled() and self.router_weight.requires_grad:
                warnings.warn(
                    "MoE: a training-mode forward ran without grad mode (under torch.no_grad(): call "
                    "model.eval() for evaluation, which also leaves tokens_per_expert alone; or in reentrant "
                    "activation checkpointing, whose first forward runs under no_grad, so aux_loss "
                    "carries no gradient and the router gets no load-balancing gradient; use "
                    "torch.utils.checkpoint(use_reentrant=False) or smptk.parallel."
                    "apply_activation_checkpointing)",
                    stacklevel=2,
                )
        return y_TH.view(x.shape)

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (``.to``, ``.half()``, ``.cuda()``...), but ``expert_bias`` keeps fp32: its
        updates (``rate`` 1e-3 steps on values near 1) vanish in bf16, and moe_route takes an fp32 bias
        with any logits."""
        bias = self._buffers.get("expert_bias")
        if bias is None:
            return super()._apply(fn, recurse)
        del self._buffers["expert_bias"]
        try:
            super()._apply(fn, recurse)
            moved = fn(bias)
            self._buffers["expert_bias"] = bias.to(moved.device) if moved.dtype != bias.dtype else moved
        except BaseException:
            self._buffers["expert_bias"] = bias
            raise
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """A state-dict load (``load_state_dict``, DCP's ``set_model_state_dict``) also starts the count in
        ``tokens_per_expert`` afresh: the count is not saved (a non-persistent buffer), and after
        ``to_empty`` + load, the usual way to fill a meta-built model from a checkpoint, it would hold
        uninitialized memory that the next :meth:`update_expert_bias` steered the router by."""
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        with torch.no_grad():
            self.tokens_per_expert.zero_()

    @torch.no_grad()
    def update_expert_bias(self, rate: float = 1e-3, group: GroupLike = None) -> torch.Tensor:
        """Aux-loss-free balancing step: ``bias += rate * sign(mean load - load)``; returns the load used.

        The load is :attr:`tokens_per_expert` accumulated since the last update, summed over ``group``
        when given (the data-parallel group, ``state.group("dp")``, which holds the expert-parallel ranks:
        every rank that routes other tokens, so every rank applies the same update); the counts are then
        reset (``group``: a ProcessGroup, a 1-D DeviceMesh or ``(mesh, dim)``; it must hold the layer's
        expert-parallel ranks, and under :func:`smptk.parallel.init` every data-parallel rank of this one,
        or ``ValueError``: a smaller group leaves replicas of the router with other biases). Overloaded
        experts become less likely to be picked, underloaded ones more. An
        expert-parallel layer needs ``group`` (each rank's own load would leave each rank another bias, and
        the replicated router another rule per rank): ``ValueError`` without it; in a multi-process job
        without expert parallelism a missing ``group`` warns, for the same reason across replicas.

        Example::

            >>> moe = MoE(64, 128, num_experts=8, top_k=2, expert_bias=True)
            >>> for _ in range(4):
            ...     moe(torch.randn(32, 64)).square().mean().backward()
            >>> load = moe.update_expert_bias(rate=1e-3)   # the 4 batches' routed pairs per expert
            >>> int(load.sum())                              # 4 batches x 32 tokens x top_k 2
            256
        """
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias: the layer was built without expert_bias=True")
        if not (_finite(rate) and rate > 0):
            raise ValueError(f"rate: expected a finite number > 0, got {rate!r}")
        if group is None and self.ep_group is not None:
            raise ValueError(
                "group: this layer's experts are split over an expert-parallel group, so each rank counts "
                "other tokens; pass the data-parallel group (state.group('dp'), which holds the ep ranks) "
                "so every rank steers by the same summed load and keeps the same bias"
            )
        if group is not None:
            group = _balancing_group(group, self.ep_group)
        if group is None and _replicas() > 1:
            warnings.warn(
                "update_expert_bias: no group in a multi-process job: each rank steers by its own load, so "
                "data-parallel replicas end with different biases; pass group=state.group('dp')",
                stacklevel=2,
            )
        load = self.tokens_per_expert.clone()
        if group is not None:
            dist.all_reduce(load, group=group)
        load_f = load.to(torch.float32)
        self.expert_bias += rate * torch.sign(load_f.mean() - load_f)
        self.tokens_per_expert.zero_()
        return load

    def extra_repr(self) -> str:
        parts = [
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}",
            f"num_experts={self.num_experts}, top_k={self.top_k}, score_func={self.score_func!r}",
        ]
        if self.num_shared_experts:
            parts.append(f"num_shared_experts={self.num_shared_experts}")
        if self.capacity_factor is not None:
            parts.append(f"capacity_factor={self.capacity_factor}")
        if self.ep_group is not None:
            parts.append(f"ep_size={self.ep_size}, local_experts={list(self.local_expert_ids)}")
        if self.sequence_parallel:
            parts.append(
                f"sequence_parallel=True, sequence_dim={self.sequence_dim}, tp={self.tp_mesh.size()}"
            )
        return ", ".join(parts)


def _mesh_from_group(group: dist.ProcessGroup, device: torch.device | str | None) -> DeviceMesh:
    """A 1-D ``ep`` DeviceMesh over ``group`` (CUDA for an NCCL group or CUDA ``device``, else CPU)."""
    if not dist.is_initialized():
        raise RuntimeError("ep_group: torch.distributed is not initialized")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"ep_group: expected a ProcessGroup, got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError("ep_group: this rank is not a member of the group")
    kind = torch.device(device).type if device is not None else None
    if kind in (None, "meta"):
        kind = "cuda" if "nccl" in str(dist.get_backend(group)).lower() else "cpu"
    return DeviceMesh.from_group(group, kind, mesh_dim_names=("ep",))


def _shard_device(mesh: DeviceMesh, device: torch.device | str | None) -> torch.device:
    """Where a layer split at construction allocates its expert shards: ``device``, else meta under a
    ``torch.device("meta")`` context, else the mesh's device (the current CUDA device for a CUDA mesh)."""
    if device is not None:
        return torch.device(device)
    if torch.get_default_device().type == "meta":
        return torch.device("meta")
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
