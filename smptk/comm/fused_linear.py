"""Tensor-parallel linears fused with their collective, each one Triton kernel over the group's symmetric
heap: ``all_gather_linear`` (the column-parallel forward with sequence parallelism) and
``linear_reduce_scatter`` (the row-parallel one). Each one's backward runs the other's kernel, through the
other's dispatcher op (so FlopCounterMode counts its GEMM).

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
x_gathered``, where the forward keeps only ``x_local`` and backward gathers it again (as Megatron-LM does,
and :func:`smptk.comm.functional.saved_as_shard` for the unfused path); ``db = sum(dz)``.
After a fused forward, ``dx_local`` is one GEMM + reduce-scatter launch where its partials fit the heap.

``linear_reduce_scatter(x, weight_local, bias, group=g)``: every rank holds all ``T`` rows of its ``[T,
K_local]`` slice of the input features and its ``[N, K_local]`` weight shard; rank q gets rows ``[q *
T_w, (q + 1) * T_w)`` of ``sum over ranks of x @ weight_local.T``, plus ``bias`` (replicated, added once).
``"fused"``: one launch of :mod:`smptk.kernels._gemm_comm`'s GEMM + reduce-scatter (each tile stored into
its owner's heap slot by the GEMM's epilogue, the owner's ``max_sms`` programs sum the slots; checked and
bounded like every collective). ``"unfused: <why>"``: :func:`smptk.kernels.fused_linear` then
:func:`smptk.comm.functional.reduce_scatter`. Autograd: ``dy_full = all_gather(dy)``; ``dx = dy_full @ W``
(after a fused forward, one all-gather GEMM launch that also yields ``dy_full``), ``dW = dy_full.T @ x``,
``db = sum(dy_full)`` (the whole bias gradient on every rank: no further reduction).
:func:`last_backward_path` names the path of the latest backward of either op.

Legend: W ranks in the group, T_w rows per rank, T = W * T_w, K input features, N_local output features.

Example (under ``TRITON_INTERPRET=1 torchrun --nproc-per-node 2``, every rank; gloo on CPU; CUDA tensors
take the same kernels; without the interpreter, CPU tensors take the unfused path)::

    >>> import torch
    >>> import torch.distributed as dist
    >>> import torch.nn.functional as F
    >>> from smptk.comm.fused_linear import all_gather_linear, linear_reduce_scatter
    >>> dist.init_process_group("gloo")
    >>> r, W = dist.get_rank(), dist.get_world_size()
    >>> T_w, K, N, N2 = 4, 16, 24, 16
    >>> _ = torch.manual_seed(0)                    # the same whole tensors on every rank
    >>> x, w, b = torch.randn(W * T_w, K), torch.randn(N, K), torch.randn(N)
    >>> w2, b2 = torch.randn(N2, N), torch.randn(N2)
    >>> cols = slice(r * N // W, (r + 1) * N // W)  # this rank's N_local features
    >>> x_local = x[r * T_w : (r + 1) * T_w]        # this rank's block of the sequence
    >>> y, path = all_gather_linear(x_local, w[cols], b[cols], group=None, activation="gelu")
    >>> y.shape, path                               # (W * T_w, N_local)
    (torch.Size([8, 12]), 'fused')
    >>> out, path = linear_reduce_scatter(y, w2[:, cols].contiguous(), b2, group=None)
    >>> out.shape, path                             # (T_w, N2)
    (torch.Size([4, 16]), 'fused')
    >>> ref = F.linear(F.gelu(F.linear(x, w, b)), w2, b2)[r * T_w : (r + 1) * T_w]
    >>> torch.allclose(out, ref, atol=1e-4)
    True
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from smptk.comm import collectives as _coll
from smptk.comm import functional
from smptk.kernels import fused_linear, runtime
from smptk.kernels._buffers import new_buffer
from smptk.kernels._checks import (
    autocast_inputs,
    check_activation,
    check_bias,
    check_float_tensor,
    check_same,
    check_weight,
)
from smptk.kernels._dispatch import (
    dispatcher_op,
    first_derivative_only,
    gemm_flops,
    grads_wanted,
    none_if_empty,
)
from smptk.kernels._triton import kernel_module

_gc = kernel_module("smptk.kernels._gemm_comm")
_epilogue = kernel_module("smptk.kernels._epilogue")
_fl = kernel_module("smptk.kernels.fused_linear")

FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ALGORITHMS = ("auto", "fused", "unfused")


def _unfused_reason(x: torch.Tensor, w: torch.Tensor, heap, world: int, scatter: bool = False) -> str | None:
    """Why the all-gather GEMM (``scatter`` False: x is this rank's block) or the GEMM + reduce-scatter
    (True: x holds all rows) cannot run ``x @ w.T``, or None when it can."""
    if heap is None:
        return "no symmetric heap for this group and device"
    if x.dtype not in FUSED_DTYPES:
        return f"dtype {x.dtype}"
    if runtime.select_path(x, w) != "triton":
        return "the Triton kernels do not run on these tensors here"
    if min(x.shape[0], x.shape[1], w.shape[0]) == 0:
        return "an empty block or shard"
    rows = x.shape[0] if scatter else world * x.shape[0]
    if max(rows * x.shape[1], rows * w.shape[0]) >= 2**31:
        return "more than 2^31 elements"
    if scatter and rows * w.shape[0] * x.element_size() > heap.heap_bytes:  # W slots of T_w x N
        return (
            f"the partials ({rows * w.shape[0] * x.element_size()} bytes) exceed heap_bytes={heap.heap_bytes}"
        )
    if not scatter and x.numel() * x.element_size() > heap.heap_bytes:
        return f"a block of {x.numel() * x.element_size()} bytes exceeds heap_bytes={heap.heap_bytes}"
    return None


def _fused_scatter(x, w, bias, g: dist.ProcessGroup, heap, programs: int) -> torch.Tensor:
    """The GEMM + reduce-scatter: this rank's ``[T_w, N]`` block of ``sum over ranks of x @ w.T``, + bias."""
    world = heap.world_size
    T, N = x.shape[0], w.shape[0]
    out = new_buffer((T // world, N), x.dtype, x.device)
    ready = torch.zeros(2 + world, dtype=torch.int32, device=x.device)
    op = _gc.MatmulReduceScatter(
        x_TK=x, w_NK=w, out_TwN=out, ready=ready, comm_programs=programs, bias_N=bias
    )  # fmt: skip
    _coll._launch(
        heap, op, programs, (), (), call=_coll._Call("linear_reduce_scatter", x.dtype, -1, out.numel(), N)
    )  # the output block's shape is what every rank must agree on (K is each rank's own)
    return out


def _checked_bias(bias, weight_local: torch.Tensor, x_name: str, x: torch.Tensor) -> torch.Tensor | None:
    """``bias`` checked against the weight shard (``[N]``, x's dtype and device), contiguous; or None."""
    if bias is None:
        return None
    check_bias(bias, (weight_local.shape[0],), "weight_local's N", x, x_name)
    return bias.contiguous()


_last_backward: list[str] = ["none"]


def _unfused_backward(y: torch.Tensor, why: str) -> torch.Tensor:
    """``y`` (an unfused call's output), whose backward, when it runs, records ``"unfused: <why>"`` as the
    latest backward path (the fused Functions record theirs in their backward)."""
    if y.requires_grad:
        y.register_hook(lambda dy: _last_backward.__setitem__(0, f"unfused: {why}"))
    return y


def last_backward_path() -> str:
    """The path of the latest backward of :func:`all_gather_linear` or :func:`linear_reduce_scatter` in this
    process: "fused" (its collective ran inside the other op's kernel), "unfused: <why>", or "none"."""
    return _last_backward[0]


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
    _coll._launch(
        heap, op, programs, (), (), call=_coll._Call("all_gather_linear", x.dtype, -1, x.numel(), K)
    )  # the gathered blocks' shape is what every rank must agree on (N is each rank's own)
    return out, gathered, z


# The two forwards as dispatcher ops (smptk.kernels._dispatch): selective checkpointing keeps their outputs
# instead of running the GEMM and its collective again in backward. The group travels by name.
def _all_gather_linear_fake(x, w, bias, act, save_z, return_gathered, group_name, programs):
    T, N = dist.get_world_size(_coll._named_group(group_name)) * x.shape[0], w.shape[0]
    gathered = x.new_empty((T, x.shape[1]) if return_gathered else (0,))
    return x.new_empty((T, N)), gathered, x.new_empty((T, N) if save_z else (0,))


def _all_gather_linear_flops(x, w, *_, out_shape):
    return gemm_flops(out_shape[0][0], x[1], w[0])  # the gathered rows times this rank's weight


@dispatcher_op("all_gather_linear_fwd", fake=_all_gather_linear_fake, flops=_all_gather_linear_flops)
def _all_gather_linear_fwd(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    act: int,
    save_z: bool,
    return_gathered: bool,
    group_name: str,
    programs: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_fused_forward` on the named group's heap: ``(out, gathered, z)``, gathered empty unless
    ``return_gathered`` (selective checkpointing keeps every output of the op: the gathered input, W times
    this rank's block, is returned only to a caller that asked for it), z empty unless ``save_z``."""
    g = _coll._named_group(group_name)
    out, gathered, z = _fused_forward(x, w, bias, act, save_z, g, _coll._heap(g, x), programs)
    # a fresh empty tensor per output: outputs of a dispatcher op may not alias each other (torch checks
    # under a dispatch mode, e.g. selective checkpointing's)
    return out, (gathered if return_gathered else x.new_empty((0,))), (z if save_z else x.new_empty((0,)))


def _linear_reduce_scatter_fake(x, w, bias, group_name, programs):
    world = dist.get_world_size(_coll._named_group(group_name))
    return x.new_empty((x.shape[0] // world, w.shape[0]))


def _linear_reduce_scatter_flops(x, w, *_, out_shape):
    return gemm_flops(x[0], x[1], w[0])  # this rank's partial product over all rows


@dispatcher_op(
    "linear_reduce_scatter_fwd", fake=_linear_reduce_scatter_fake, flops=_linear_reduce_scatter_flops
)
def _linear_reduce_scatter_fwd(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, group_name: str, programs: int
) -> torch.Tensor:
    """:func:`_fused_scatter` on the named group's heap."""
    g = _coll._named_group(group_name)
    return _fused_scatter(x, w, bias, g, _coll._heap(g, x), programs)


class _AllGatherLinear(torch.autograd.Function):
    """Fused forward, unfused backward (see the module docstring); inputs checked, x contiguous 2-D."""

    @staticmethod
    def forward(ctx, x, w, bias, act: int, g, programs: int, max_sms, want_gathered: bool, grad_on: bool):
        save_z = act != _epilogue.ACT_NONE and any(grads_wanted(ctx, grad_on, 3))
        out, gathered, z = _all_gather_linear_fwd(
            x, w, bias, act, save_z, want_gathered, g.group_name, programs
        )
        # this rank's block, gathered again for dW in backward (see functional.saved_as_shard)
        ctx.save_for_backward(x, w, none_if_empty(z, save_z))
        ctx.act, ctx.group, ctx.max_sms, ctx.programs = act, g, max_sms, programs
        ctx.mark_non_differentiable(gathered)
        return out, gathered

    @staticmethod
    @first_derivative_only("all_gather_linear")
    def backward(ctx, dy, _dgathered):
        x_block, w, z = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        world = dist.get_world_size(ctx.group)
        dz, db = _epilogue.activation_backward(dy.contiguous(), z, ctx.act, need_db, w.dtype)
        wt = w.t()  # dz @ w = dz @ wt.T: the GEMM + reduce-scatter's nn.Linear-layout weight
        heap = _coll._heap(ctx.group, dz)
        why = _unfused_reason(dz, wt, heap, world, scatter=True) if need_dx else "no input gradient needed"
        _last_backward[0] = "fused" if why is None else f"unfused: {why}"
        gathered = x_block  # read below only by dW and the unfused dx, which gather it first
        if need_dw or (need_dx and why is not None):
            gathered = x_block.new_empty((world * x_block.shape[0], x_block.shape[1]))
            _coll.all_gather_into_tensor(gathered, x_block, ctx.group, max_sms=ctx.max_sms)
        dx_full, dw, _ = _fl.fused_linear_bwd(
            dz, gathered, w, None, _epilogue.ACT_NONE, (need_dx and why is not None, need_dw, False)
        )
        dx = None
        if need_dx and why is None:
            dx = _linear_reduce_scatter_fwd(dz, wt, None, ctx.group.group_name, ctx.programs)
        elif need_dx:
            dx = dx_full.new_empty((dx_full.shape[0] // world, dx_full.shape[1]))
            _coll.reduce_scatter_tensor(dx, dx_full, "sum", ctx.group, max_sms=ctx.max_sms)
        return dx, dw, db, None, None, None, None, None, None


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
            "fused" is about the forward: the backward takes the other op's fused kernel where the heap
            applies to it and the unfused path otherwise (partials larger than the heap), and
            :func:`last_backward_path` says which.

    Returns:
        ``out [W * T_w, N_local]`` (differentiable in x_local, weight_local and bias) and the path:
        ``"fused"`` or ``"unfused: <why>"`` (see the module docstring).
    """
    g = _coll._group(group)
    world = dist.get_world_size(g)
    check_float_tensor("x_local", x_local)
    x_local, weight_local, bias = autocast_inputs(x_local, weight_local, bias)  # as F.linear under autocast
    if x_local.dim() != 2:
        raise ValueError(f"x_local: expected a 2-D [T_w, K] block, got shape {tuple(x_local.shape)}")
    check_weight("weight_local", weight_local, x_local, "x_local")
    check_activation(activation)
    bias = _checked_bias(bias, weight_local, "x_local", x_local)
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
        if why is not None and algorithm == "fused":
            raise ValueError(f"algorithm: 'fused' cannot run this call: {why}")
    if why is None:
        act = _epilogue.ACTIVATION_CODES[activation]
        want = gathered_out is not None
        args = (x, weight_local, bias, act, g, programs, max_sms, want, torch.is_grad_enabled())
        out, gathered = _AllGatherLinear.apply(*args)
        if gathered_out is not None:
            gathered_out.copy_(gathered)
        return out, "fused"
    full = functional.all_gather(x, g, dim=0, max_sms=max_sms)
    if gathered_out is not None:
        gathered_out.copy_(full.detach())
    with functional.saved_as_shard(full, x, g, dim=0, max_sms=max_sms):  # as the fused path keeps x_local
        out = fused_linear(full, weight_local, bias, activation=activation)
    return _unfused_backward(out, why), f"unfused: {why}"


class _LinearReduceScatter(torch.autograd.Function):
    """Fused forward; the backward's all-gather runs inside the all-gather GEMM (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, w, bias, g, programs: int, max_sms):
        out = _linear_reduce_scatter_fwd(x, w, bias, g.group_name, programs)
        ctx.save_for_backward(x, w)
        ctx.group, ctx.max_sms, ctx.programs = g, max_sms, programs
        return out

    @staticmethod
    @first_derivative_only("linear_reduce_scatter")
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy = dy.contiguous()
        world = dist.get_world_size(ctx.group)
        wt = w.t()  # dy_full @ w = dy_full @ wt.T: the all-gather GEMM's nn.Linear-layout weight
        heap = _coll._heap(ctx.group, dy)
        why = _unfused_reason(dy, wt, heap, world) if need_dx else "no input gradient needed"
        _last_backward[0] = "fused" if why is None else f"unfused: {why}"
        dx = None
        if why is None:
            dx, dy_full, _ = _all_gather_linear_fwd(
                dy, wt, None, _epilogue.ACT_NONE, False, True, ctx.group.group_name, ctx.programs
            )
        else:
            dy_full = dy.new_empty((world * dy.shape[0], dy.shape[1]))
            _coll.all_gather_into_tensor(dy_full, dy, ctx.group, max_sms=ctx.max_sms)
        dx_unfused, dw, db = _fl.fused_linear_bwd(
            dy_full, x, w, None, _epilogue.ACT_NONE, (need_dx and why is not None, need_dw, need_db)
        )
        if dx is None:
            dx = dx_unfused
        return dx, dw, db, None, None, None


def linear_reduce_scatter(
    x: torch.Tensor,
    weight_local: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None,
    max_sms: int | None = None,
    algorithm: str = "auto",
) -> tuple[torch.Tensor, str]:
    """This rank's block of ``reduce_scatter(x @ weight_local.T) + bias`` over ``group``; ``(out, path)``.

    Args:
        x: ``[T, K_local]`` (fp32 / fp16 / bf16): all T rows of this rank's input features; T divisible by
            the group size W, every rank's of the same shape.
        weight_local: ``[N, K_local]``, same dtype and device. bias: ``[N]`` or None, added once.
        group: the tensor-parallel ProcessGroup (None: the world).
        max_sms: programs (SMs) of the reduce stage, 1..256 (default: :func:`smptk.comm.configure`'s).
        algorithm: "auto" (fused where the heap applies), "fused" (raise where it does not) or "unfused".
            "fused" is about the forward: the backward takes the other op's fused kernel where the heap
            applies to it and the unfused path otherwise (partials larger than the heap), and
            :func:`last_backward_path` says which.

    Returns:
        ``out [T / W, N]``, rows ``[rank * T / W, (rank + 1) * T / W)`` of the sum (differentiable in x,
        weight_local and bias), and the path: ``"fused"`` or ``"unfused: <why>"`` (module docstring).
    """
    g = _coll._group(group)
    world = dist.get_world_size(g)
    check_float_tensor("x", x)
    x, weight_local, bias = autocast_inputs(x, weight_local, bias)  # as F.linear under autocast
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [T, K_local] input, got shape {tuple(x.shape)}")
    if x.shape[0] % world:
        raise ValueError(f"x: {x.shape[0]} rows do not divide into the group's {world} ranks")
    check_weight("weight_local", weight_local, x)
    bias = _checked_bias(bias, weight_local, "x", x)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
    programs = _coll._max_sms(max_sms)
    x = x.contiguous()
    if algorithm == "unfused":
        why = "algorithm='unfused'"
    else:
        why = _unfused_reason(x, weight_local, _coll._heap(g, x), world, scatter=True)
        if why is not None and algorithm == "fused":
            raise ValueError(f"algorithm: 'fused' cannot run this call: {why}")
    if why is None:
        return _LinearReduceScatter.apply(x, weight_local, bias, g, programs, max_sms), "fused"
    y = functional.reduce_scatter(fused_linear(x, weight_local), g, dim=0, max_sms=max_sms)
    if bias is not None:
        y = y + functional.copy_to_group(bias, g, max_sms=max_sms)  # each rank's bias gradient: its rows
    return _unfused_backward(y, why), f"unfused: {why}"


__all__ = ["ALGORITHMS", "all_gather_linear", "last_backward_path", "linear_reduce_scatter"]
