"""Tensor-parallel linears fused with their collective: ``all_gather_linear`` (column-parallel forward with
sequence parallelism), one Triton kernel over the group's symmetric heap.

``all_gather_linear(x_local, weight_local, bias, group=g)``: every rank of g holds a ``[T_w, K]`` block of the
sequence (rank order = sequence order) and its ``[N_local, K]`` column shard of the weight; every rank gets
``act(all_gather(x) @ weight_local.T + bias) [W * T_w, N_local]``. Returns ``(out, path)``:

- ``"fused"``: one launch of :mod:`smptk.kernels._gemm_comm`'s all-gather GEMM: ``max_sms`` programs copy
  the peers' blocks out of their heap regions while the other programs run GEMM tiles, each as soon as its
  rows have arrived (this rank's rows first). Through :func:`smptk.comm.collectives._launch`, so the call
  is numbered, checked against the peers' calls and bounded by ``timeout_s`` like every collective: a peer
  that never arrives makes this rank raise :class:`~smptk.comm.CommTimeoutError` naming it.
- ``"unfused: <why>"``: :func:`smptk.comm.functional.all_gather` then :func:`smptk.kernels.fused_linear`
  (where no heap applies: another node, tensors the Triton kernels do not run on, a block larger than the
  heap, or SMPTK_KERNELS=torch).

Autograd (both paths): ``dz = dy * act'(z)``; ``dx_local = reduce_scatter(dz @ W)`` (sum over the ranks'
partial products of each block: every rank multiplied every block by its own shard); ``dW = dz.T @
x_gathered`` from the gathered input the forward kept (the fused kernel writes it anyway); ``db = sum(dz)``.
The fused path's backward is not fused yet: the engine's GEMMs and :func:`smptk.comm.reduce_scatter_tensor`
one after the other.

Legend: W ranks in the group, T_w rows per rank, T = W * T_w, K input features, N_local output features.

Example (under torchrun, CUDA; CPU tensors under ``TRITON_INTERPRET=1`` take the same kernel)::

    >>> y, path = all_gather_linear(x_local, w_local, b_local, group=tp_group, activation="gelu")
    >>> y.shape, path                      # (W * T_w, N_local), "fused"
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from smptk.comm import collectives as _coll
from smptk.comm import functional
from smptk.kernels import fused_linear, runtime
from smptk.kernels._buffers import new_buffer
from smptk.kernels._checks import check_activation, check_float_tensor, check_same, check_weight
from smptk.kernels._triton import kernel_module
from smptk.kernels.heap_layout import SEQ_SHIFT

_gc = kernel_module("smptk.kernels._gemm_comm")
_epilogue = kernel_module("smptk.kernels._epilogue")
_fl = kernel_module("smptk.kernels.fused_linear")

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ALGORITHMS = ("auto", "fused", "unfused")
# The call's tag (see smptk.comm.collectives._Call): the all-gather kind with this bit set, so a rank in this
# op and a rank in a plain all_gather of the same size see different calls. Bits 18..SEQ_SHIFT-1 are free.
_FUSED_BIT = 1 << 18
assert _FUSED_BIT < 1 << SEQ_SHIFT


class _FusedCall(_coll._Call):
    """The all-gather GEMM's announcement: numel = one block's elements, chunk = N_local."""

    def tag(self, seq: int, programs: int) -> int:
        return super().tag(seq, programs) | _FUSED_BIT


def _unfused_reason(x: torch.Tensor, w: torch.Tensor, heap, world: int) -> str | None:
    """Why the fused kernel cannot run this call, or None when it can."""
    if heap is None:
        return "no symmetric heap for this group and device"
    if x.dtype not in FUSED_DTYPES:
        return f"dtype {x.dtype}"
    if runtime.select_path(x, w) != "triton":
        return "the Triton kernels do not run on these tensors here"
    if x.numel() * x.element_size() > heap.heap_bytes:
        return f"a block of {x.numel() * x.element_size()} bytes exceeds heap_bytes={heap.heap_bytes}"
    if world * x.numel() >= 2**31 or w.shape[0] * world * x.shape[0] >= 2**31:
        return "more than 2^31 elements"
    return None


def _fused_forward(x, w, bias, act: int, save_z: bool, g: dist.ProcessGroup, heap, programs: int):
    """The all-gather GEMM: ``(out [T, N], gathered [T, K], z [T, N] or None)``."""
    world = heap.world_size
    T, K, N = world * x.shape[0], x.shape[1], w.shape[0]
    out = new_buffer((T, N), x.dtype, x.device)
    gathered = new_buffer((T, K), x.dtype, x.device)
    z = new_buffer((T, N), x.dtype, x.device) if save_z else None
    ready = torch.zeros(world, dtype=torch.int32, device=x.device)
    op = _gc.AllGatherMatmul(
        x_TwK=x, w_NK=w, out_TN=out, g_TK=gathered, ready_W=ready, comm_programs=programs, bias_N=bias,
        z_TN=z, activation=act,
    )  # fmt: skip
    _coll._launch(heap, op, programs, (), (), call=_FusedCall("all_gather", x.dtype, -1, x.numel(), N))
    return out, gathered, z


class _AllGatherLinear(torch.autograd.Function):
    """Fused forward, unfused backward (see the module docstring); inputs checked, x contiguous 2-D."""

    @staticmethod
    def forward(ctx, x, w, bias, act: int, g, heap, programs: int, max_sms):
        save_z = act != _epilogue.ACT_NONE and any(ctx.needs_input_grad[:3])
        out, gathered, z = _fused_forward(x, w, bias, act, save_z, g, heap, programs)
        ctx.save_for_backward(gathered, w, z)
        ctx.act, ctx.group, ctx.max_sms = act, g, max_sms
        ctx.mark_non_differentiable(gathered)
        return out, gathered

    @staticmethod
    def backward(ctx, dy, _dgathered):
        gathered, w, z = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx_full, dw, db = _fl.fused_linear_bwd(
            dy.contiguous(), gathered, w, z, ctx.act, (need_dx, need_dw, need_db)
        )
        dx = None
        if need_dx:
            world = dist.get_world_size(ctx.group)
            dx = dx_full.new_empty((dx_full.shape[0] // world, dx_full.shape[1]))
            _coll.reduce_scatter_tensor(dx, dx_full, "sum", ctx.group, max_sms=ctx.max_sms)
        return dx, dw, db, None, None, None, None, None


def all_gather_linear(
    x_local: torch.Tensor,
    weight_local: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None,
    activation: str | None = None,
    max_sms: int | None = None,
    gathered_out: torch.Tensor | None = None,
    algorithm: str = "auto",
) -> tuple[torch.Tensor, str]:
    """``act(all_gather(x_local) @ weight_local.T + bias)`` over ``group``; returns ``(out, path)``.

    Args:
        x_local: ``[T_w, K]`` (fp32 / fp16 / bf16), this rank's block of rows; every rank's has the shape.
        weight_local: ``[N_local, K]``, same dtype and device. bias: ``[N_local]`` or None.
        group: the tensor-parallel ProcessGroup (None: the world).
        activation: None, "relu", "gelu", "gelu_tanh" or "silu", applied in the GEMM's epilogue.
        max_sms: programs (SMs) of the copy stage, 1..256 (default: :func:`smptk.comm.configure`'s).
        gathered_out: optional ``[W * T_w, K]`` tensor that receives the gathered input (for a weight
            gradient computed elsewhere); not differentiable.
        algorithm: "auto" (fused where the heap applies), "fused" (raise where it does not) or "unfused".

    Returns:
        ``out [W * T_w, N_local]`` (differentiable in x_local, weight_local and bias) and the path:
        ``"fused"`` or ``"unfused: <why>"`` (see the module docstring).
    """
    g = _coll._group(group)
    world = dist.get_world_size(g)
    check_float_tensor("x_local", x_local)
    if x_local.dim() != 2:
        raise ValueError(f"x_local: expected a 2-D [T_w, K] block, got shape {tuple(x_local.shape)}")
    check_weight("weight_local", weight_local, x_local)
    check_activation(activation)
    if bias is not None:
        check_float_tensor("bias", bias)
        check_same("bias", bias, "x_local", x_local)
        if bias.shape != (weight_local.shape[0],):
            raise ValueError(f"bias: expected shape ({weight_local.shape[0]},), got {tuple(bias.shape)}")
        bias = bias.contiguous()
    T, K = world * x_local.shape[0], x_local.shape[1]
    if gathered_out is not None:
        check_same("gathered_out", gathered_out, "x_local", x_local)
        if gathered_out.shape != (T, K):
            raise ValueError(f"gathered_out: expected shape ({T}, {K}), got {tuple(gathered_out.shape)}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
    programs = _coll._max_sms(max_sms)
    x = x_local.contiguous()
    if algorithm == "unfused":
        why = "algorithm='unfused'"
    else:
        why = _unfused_reason(x, weight_local, _coll._heap(g, x), world)
        if why is None and (x.shape[0] == 0 or weight_local.shape[0] == 0):
            why = "an empty block or shard"
        if why is not None and algorithm == "fused":
            raise ValueError(f"algorithm: 'fused' cannot run this call: {why}")
    if why is None:
        act = _epilogue.ACTIVATION_CODES[activation]
        heap = _coll._heap(g, x)
        out, gathered = _AllGatherLinear.apply(x, weight_local, bias, act, g, heap, programs, max_sms)
        if gathered_out is not None:
            gathered_out.copy_(gathered)
        return out, "fused"
    full = functional.all_gather(x, g, dim=0, max_sms=max_sms)
    if gathered_out is not None:
        gathered_out.copy_(full.detach())
    return fused_linear(full, weight_local, bias, activation=activation), f"unfused: {why}"


__all__ = ["ALGORITHMS", "all_gather_linear"]
