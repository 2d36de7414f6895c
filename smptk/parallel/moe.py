"""Mixture-of-Experts layer: a top-k router and SwiGLU experts, on one device or expert-parallel.

Legend: T tokens on this rank, H hidden size, F expert FFN size, E experts, k experts per token, R ranks
of the expert-parallel group, E_l = E / R experts per rank, rows = kept (token, slot) pairs.

Forward, one device::

    logits_TE = x_TH @ router_EH.T                 fp32 (the router runs in fp32 whatever x's dtype)
    route     = moe_route(logits_TE, k)            weights_Tk fp32, expert ids, counts, aux and z losses
    xg, plan  = moe_dispatch(x_TH, ids_Tk, E)      rows grouped by expert; plan.offsets [E + 1]
    h         = grouped_swiglu(xg, w_gate, w_up, offsets)      [rows, F], one launch for all experts
    yg        = grouped_linear(h, w_down, offsets)             [rows, H]
    y_TH      = moe_combine(yg, plan, weights_Tk) (+ shared experts' SwiGLU MLP of x)

Expert parallel (``ep_group`` of R ranks; rank r owns experts ``r * E_l .. (r + 1) * E_l - 1``). The
grouped buffer is ordered by expert id, so the rows for rank r are one contiguous block:

1. every rank's per-expert row counts ``[E]`` go through ``smptk.comm.all_gather_into_tensor``, so every
   rank holds the whole ``[R, E]`` count matrix; its one host read (the forward's only host sync) gives
   the split sizes (all_to_all_single takes Python lists, as torch.distributed does) and the largest
   split of any rank, which every rank passes as ``agreed_max_split`` so the all-to-alls need no
   exchange of their own;
2. the rows go through ``smptk.comm.all_to_all_single`` with those uneven splits; they arrive ordered
   (source rank, local expert) and are permuted to (local expert, source rank) for the grouped GEMMs;
3. the expert outputs are permuted back and return by the inverse all-to-all; combine runs locally.

Per forward: one host sync and three collectives (the counts, the rows out, the rows back); backward:
two all-to-alls and no host sync (an all-to-all's gradient is the all-to-all with the splits swapped). A
rank that receives no rows runs its experts on an empty buffer (zero weight gradients).

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

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from smptk import comm
from smptk.kernels import fused_linear, swiglu
from smptk.kernels.grouped_linear import grouped_linear, grouped_swiglu
from smptk.kernels.moe_dispatch import MoEDispatchPlan, moe_combine, moe_dispatch
from smptk.kernels.moe_route import moe_route

SCORE_FUNCS = ("softmax", "sigmoid")


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
            ``ceil(capacity_factor * T * k / E)`` of this rank's (token, slot) pairs, earliest first.
        expert_bias: keep a per-expert selection bias (aux-loss-free balancing); see
            :meth:`update_expert_bias`.
        ep_group: expert-parallel process group (None: every expert on this device). Each rank holds
            ``E / R`` experts and its own tokens.
        device, dtype: of the parameters.

    Attributes after a forward: ``aux_loss`` (0-d fp32, differentiable; zero when both coefficients
    are 0), ``last_routing`` (the :class:`~smptk.kernels.moe_route.MoERouting`) and ``last_plan``
    (the :class:`~smptk.kernels.moe_dispatch.MoEDispatchPlan`, e.g. ``num_dropped``). The buffer
    ``tokens_per_expert`` [E] accumulates routed pairs per expert until :meth:`update_expert_bias`.

    On the ``meta`` device (delayed initialization) forward and backward propagate shapes; with a
    capacity the grouped buffer takes its bound ``min(T * k, E * C)`` rows (see :func:`moe_dispatch`).

    Example::

        >>> moe = MoE(64, 128, num_experts=8, top_k=2, num_shared_experts=1, capacity_factor=1.25)
        >>> y = moe(torch.randn(32, 64))
        >>> moe.last_plan.num_dropped
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
        ep_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("hidden_size", hidden_size),
            ("ffn_hidden_size", ffn_hidden_size),
            ("num_experts", num_experts),
            ("top_k", top_k),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if top_k > num_experts:
            raise ValueError(f"top_k: expected at most num_experts={num_experts}, got {top_k}")
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func: expected one of {SCORE_FUNCS}, got {score_func!r}")
        shared_ok = isinstance(num_shared_experts, int) and not isinstance(num_shared_experts, bool)
        if not shared_ok or num_shared_experts < 0:
            raise ValueError(f"num_shared_experts: expected an integer >= 0, got {num_shared_experts!r}")
        for name, value in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef)):
            if not (_finite(value) and value >= 0):
                raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
        if capacity_factor is not None and not (_finite(capacity_factor) and capacity_factor > 0):
            raise ValueError(
                f"capacity_factor: expected None or a finite number > 0, got {capacity_factor!r}"
            )
        ep_size, ep_rank = 1, 0
        if ep_group is not None:
            if not dist.is_initialized():
                raise RuntimeError("ep_group: torch.distributed is not initialized")
            ep_size, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
            if ep_rank < 0:
                raise ValueError("ep_group: this rank is not a member of the group")
        if num_experts % ep_size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the expert-parallel group's size {ep_size}"
            )
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.renormalize = score_func, renormalize
        self.aux_loss_coef, self.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
        self.capacity_factor = capacity_factor
        self.ep_group, self.ep_size, self.ep_rank = ep_group, ep_size, ep_rank
        self.num_local_experts = num_experts // ep_size
        factory = {"device": device, "dtype": dtype}
        E_l, F_, H = self.num_local_experts, ffn_hidden_size, hidden_size
        self.router_weight = nn.Parameter(torch.empty(num_experts, H, **factory))
        self.w_gate = nn.Parameter(torch.empty(E_l, F_, H, **factory))
        self.w_up = nn.Parameter(torch.empty(E_l, F_, H, **factory))
        self.w_down = nn.Parameter(torch.empty(E_l, H, F_, **factory))
        self.num_shared_experts = num_shared_experts
        if num_shared_experts:
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
        self.reset_parameters()

    @property
    def local_expert_ids(self) -> range:
        """Global ids of the experts this rank holds (all of them without expert parallelism)."""
        return range(self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts)

    def reset_parameters(self) -> None:
        """Router ~ N(0, 0.02^2); projections uniform in +-1/sqrt(fan_in), nn.Linear's default bound; the
        expert bias and the load counts back to zero.

        Also what delayed initialization calls: a layer built under ``torch.device("meta")`` and
        materialized with ``to_empty`` (which leaves buffers uninitialized too) is then the layer built
        directly, for the same random state.
        """
        nn.init.normal_(self.router_weight, std=0.02)
        for name in ("w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down"):
            w = getattr(self, name, None)
            if w is not None:
                bound = 1.0 / math.sqrt(w.shape[-1])
                nn.init.uniform_(w, -bound, bound)
        with torch.no_grad():
            if self.expert_bias is not None:
                self.expert_bias.zero_()
            self.tokens_per_expert.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` -> ``[..., H]``; sets :attr:`aux_loss`, :attr:`last_routing`, :attr:`last_plan`."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden_size:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected [..., {self.hidden_size}], got {shape}")
        x_TH = x.reshape(-1, self.hidden_size)
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
        if self.ep_group is None:
            y_grouped = self._experts(x_grouped, plan.offsets)
        else:
            y_grouped = self._experts_parallel(x_grouped, plan)
        y_TH = moe_combine(y_grouped, plan, routing.weights)
        if self.num_shared_experts:
            y_TH = y_TH + fused_linear(swiglu(x_TH, self.shared_gate, self.shared_up), self.shared_down)
        aux = routing.aux_loss * self.aux_loss_coef + routing.z_loss * self.z_loss_coef
        self.aux_loss, self.last_routing, self.last_plan = aux, routing, plan
        with torch.no_grad():
            self.tokens_per_expert += routing.tokens_per_expert
        return y_TH.view(x.shape)

    def _experts(self, x_grouped: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        h = grouped_swiglu(x_grouped, self.w_gate, self.w_up, offsets)
        return grouped_linear(h, self.w_down, offsets)

    def _experts_parallel(self, x_grouped: torch.Tensor, plan: MoEDispatchPlan) -> torch.Tensor:
        R, E_l, g = self.ep_size, self.num_local_experts, self.ep_group
        me = dist.get_rank(g)
        send_counts = plan.tokens_per_expert.to(torch.int32)
        every_RE = send_counts.new_empty(R, self.num_experts)  # [s, r * E_l + e]: rows s sends r's expert e
        comm.all_gather_into_tensor(every_RE, send_counts, group=g)
        counts = every_RE.view(R, R, E_l).sum(dim=2).tolist()  # the one host sync: [s][r] rows s sends r
        send = counts[me]
        recv = [counts[s][me] for s in range(R)]
        peak = max(max(row) for row in counts)  # the same on every rank: no split exchange in the all-to-alls
        # rows ordered (source rank, local expert); the backward sends the gradients back, also without a sync
        x_recv = comm.functional.all_to_all(x_grouped, g, recv, send, agreed_max_split=peak)
        recv_counts = every_RE[:, me * E_l : (me + 1) * E_l]
        index, offsets = expert_major_order(recv_counts, sum(recv))
        y_local = self._experts(x_recv.index_select(0, index), offsets)
        y_recv = y_local.new_empty(y_local.shape).index_copy(0, index, y_local)
        return comm.functional.all_to_all(y_recv, g, send, recv, agreed_max_split=peak)

    @torch.no_grad()
    def update_expert_bias(self, rate: float = 1e-3, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Aux-loss-free balancing step: ``bias += rate * sign(mean load - load)``; returns the load used.

        The load is :attr:`tokens_per_expert` accumulated since the last update, summed over ``group``
        when given (e.g. the data-parallel group, so every replica applies the same update); the counts
        are then reset. Overloaded experts become less likely to be picked, underloaded ones more.

        Example::

            >>> moe = MoE(64, 128, num_experts=8, top_k=2, expert_bias=True)
            >>> for batch in batches: ...; moe(batch); ...
            >>> moe.update_expert_bias(rate=1e-3)
        """
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias: the layer was built without expert_bias=True")
        if not (_finite(rate) and rate > 0):
            raise ValueError(f"rate: expected a finite number > 0, got {rate!r}")
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
        return ", ".join(parts)
