"""Grouped GEMM for Mixture-of-Experts: one launch computes every expert's linear layer.

``grouped_linear``: ``y[rows of e] = act(x[rows of e] @ weight[e].T + bias[e])`` for every expert e, and
``grouped_swiglu``: ``y[rows of e] = silu(x_e @ w_gate[e].T) * (x_e @ w_up[e].T)``, forward and backward in
Triton. Rows of x are grouped by expert (``moe_dispatch`` output): expert e owns rows
``offsets[e]:offsets[e + 1]``.

Legend: T tokens (rows of x), K input features, N output features, E experts. x ``[T, K]``, weight
``[E, N, K]`` (a stack of nn.Linear weights), bias ``[E, N]``, offsets ``[E + 1]`` int64 with
``offsets[0] == 0``, ``offsets[E] == T``, non-decreasing; y ``[T, N]`` in x's dtype. Inside a kernel a
generic grouped product is ``out[T, C] = a[T, R] @ b[e][R, C]`` (R the reduction, C output columns).

Schedule. A row tile never straddles two experts: expert e's rows are cut into ``cdiv(rows_e, BLOCK_M)``
tiles of its own (the last one partial), so each tile multiplies by one weight. Tile ids are numbered
expert by expert. The host knows T and E but not the offsets (reading them would stall the stream and
break CUDA graphs), so it launches an upper bound of ``T // BLOCK_M + min(E, T)`` row tiles (each expert
adds at most one partial tile) times the column tiles, and each program finds its expert itself:
``expert_row_tile`` reads the offsets EXPERT_BLOCK experts at a time, forms the per-expert tile counts
and their prefix sum in registers, and picks the expert whose tile range holds its tile id. Programs past
the last tile return at once. Cost estimate (no GPU measurement yet): one or two vector loads of offsets
per program against a K loop of K / BLOCK_K MMA steps, and at most ``min(E, T) x cdiv(N, BLOCK_N)`` idle
programs (64 x 112 at E=64, N=14336), each a load and an exit. A host-built tile table would need either
that host read or a second launch per BLOCK_M the autotuner tries; the scan needs neither.

Weight gradients are a reduction over each expert's rows: ``dweight[e] = dz_e.T @ x_e`` runs as one launch
over (E, N tiles, K tiles) whose programs loop over their expert's rows, and the programs of the first
K tile also sum dz's columns for ``dbias[e]`` (deterministic, no atomics). An empty expert's programs run
no iterations and store zeros: its weight and bias gradients are exactly zero. ``dx`` is the forward's
grouped product with ``dz`` and ``weight[e]`` (no transpose needed, strides pick the layout). As in
fused_linear / swiglu, the pre-activation (``z``, or swiglu's ``[g | u]``) is saved in x's dtype for the
backward instead of recomputed (recomputing costs one or two more GEMMs).

Worked example, E = 3, offsets = [0, 2, 2, 5] (T = 5), with BLOCK_M = 2 for illustration::

    expert 0: rows 0-1 -> 1 tile (rows 0, 1)          y[0:2] = act(x[0:2] @ w[0].T + b[0])
    expert 1: no rows  -> 0 tiles                     dweight[1] = 0, dbias[1] = 0 exactly
    expert 2: rows 2-4 -> 2 tiles (rows 2, 3; row 4)  y[2:5] = act(x[2:5] @ w[2].T + b[2])
    tiles per expert [1, 0, 2], prefix sums [1, 1, 3]: tile 0 -> expert 0, tiles 1 and 2 -> expert 2.
    grid: 5 // 2 + min(3, 5) = 5 row tiles; the programs of tiles 3 and 4 return without work.

The kernels, their tunables and launchers live in ``_gemm.py`` (split off to keep each file under
about 600 lines); this file holds the checks, the autograd wiring and the PyTorch path.

Offsets are validated (dtype, shape, device) on every call. Their values (``offsets[0] == 0``,
``offsets[E] == T``, non-decreasing) need a device read: they are checked when the offsets live on the
CPU (no sync to pay), on the PyTorch path (which reads them anyway), or on any device when
``SMPTK_CHECK_OFFSETS=1`` (debug; one host sync per call).
Unchecked bad offsets give wrong results but never touch memory out of bounds: the kernels clamp every
expert's row range into ``[0, T]``. Addresses are int64 throughout (``rows * stride`` can pass 2^31).

Example::

    >>> x = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
    >>> w = torch.randn(3, 128, 64, device="cuda", dtype=torch.bfloat16)
    >>> offsets = torch.tensor([0, 2, 2, 5], device="cuda")
    >>> grouped_linear(x, w, offsets, activation="gelu").shape
    torch.Size([5, 128])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from smptk import settings
from smptk.kernels import runtime
from smptk.kernels._buffers import new_buffer
from smptk.kernels._checks import (
    TORCH_ACTIVATIONS,
    autocast_inputs,
    check_activation,
    check_bias,
    check_float_tensor,
    check_input,
    check_same,
)
from smptk.kernels._dispatch import (
    dispatcher_op,
    first_derivative_only,
    gemm_flops,
    grads_wanted,
    none_if_empty,
    outside_graphs,
    saved_if,
)
from smptk.kernels._triton import kernel_module

# The GEMM engine and its elementwise kernels, imported (with triton) on the first Triton-path call: see
# smptk.kernels._triton.
_gemm = kernel_module("smptk.kernels._gemm")
_epilogue = kernel_module("smptk.kernels._epilogue")


def _grouped_fwd_fake(x_TK, w_ENK, offsets, bias_EN, activation, save_z):
    T, N = x_TK.shape[0], w_ENK.shape[1]
    return x_TK.new_empty((T, N)), x_TK.new_empty((T, N) if save_z else (0,))


def _grouped_fwd_flops(x_TK, w_ENK, *_, out_shape):
    # every row is multiplied by its own expert's [N, K] weight: the experts' GEMMs sum to T rows
    return gemm_flops(x_TK[0], x_TK[1], w_ENK[1])


@dispatcher_op("grouped_linear_fwd", fake=_grouped_fwd_fake, flops=_grouped_fwd_flops)
def grouped_linear_fwd(
    x_TK: torch.Tensor,
    w_ENK: torch.Tensor,
    offsets: torch.Tensor,
    bias_EN: torch.Tensor | None,
    activation: int,
    save_z: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward: ``(y [T, N], z [T, N])``, z empty unless ``save_z``. The op
    ``smptk::grouped_linear_fwd`` (see :mod:`smptk.kernels._dispatch`)."""
    T, N = x_TK.shape[0], w_ENK.shape[1]
    y = new_buffer((T, N), x_TK.dtype, x_TK.device)
    z = new_buffer((T, N) if save_z else (0,), x_TK.dtype, x_TK.device)
    _gemm.grouped_matmul(
        x_TK, w_ENK.transpose(1, 2), offsets, y, bias_EC=bias_EN, activation=activation,
        z_TC=z if save_z else None,
    )  # fmt: skip
    return y, z


def _grouped_swiglu_fwd_fake(x_TK, wg_ENK, wu_ENK, offsets, save_h):
    T, N = x_TK.shape[0], wg_ENK.shape[1]
    return x_TK.new_empty((T, N)), x_TK.new_empty((T, 2 * N) if save_h else (0,))


def _grouped_swiglu_fwd_flops(x_TK, wg_ENK, *_, out_shape):
    return 2 * gemm_flops(x_TK[0], x_TK[1], wg_ENK[1])  # the gate and the up products


@dispatcher_op("grouped_swiglu_fwd", fake=_grouped_swiglu_fwd_fake, flops=_grouped_swiglu_fwd_flops)
def grouped_swiglu_fwd(
    x_TK: torch.Tensor, wg_ENK: torch.Tensor, wu_ENK: torch.Tensor, offsets: torch.Tensor, save_h: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward: ``(y [T, N], h = [g | u] [T, 2N])``, h empty unless ``save_h``. The op
    ``smptk::grouped_swiglu_fwd``."""
    T, N = x_TK.shape[0], wg_ENK.shape[1]
    y = new_buffer((T, N), x_TK.dtype, x_TK.device)
    h = new_buffer((T, 2 * N) if save_h else (0,), x_TK.dtype, x_TK.device)
    _gemm.grouped_swiglu_matmul(
        x_TK, wg_ENK.transpose(1, 2), wu_ENK.transpose(1, 2), offsets, y, h if save_h else None
    )
    return y, h


def _grouped_bwd_fake(dy_TN, x_TK, w_ENK, offsets, z_TN, activation, needs):
    need_dx, need_dw, _, need_db = needs
    return (
        x_TK.new_empty(x_TK.shape if need_dx else (0,)),
        w_ENK.new_empty(w_ENK.shape if need_dw else (0,)),
        w_ENK.new_empty(w_ENK.shape[:2] if need_db else (0,)),
    )


def _grouped_bwd_flops(dy_TN, x_TK, w_ENK, offsets, z_TN, activation, needs, *, out_shape):
    return (needs[0] + needs[1]) * gemm_flops(dy_TN[0], x_TK[1], dy_TN[1])  # dx and dweight


@dispatcher_op("grouped_linear_bwd", fake=_grouped_bwd_fake, flops=_grouped_bwd_flops)
def grouped_linear_bwd(
    dy_TN: torch.Tensor,
    x_TK: torch.Tensor,
    w_ENK: torch.Tensor,
    offsets: torch.Tensor,
    z_TN: torch.Tensor | None,
    activation: int,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton backward: ``(dx [T, K], dweight [E, N, K], dbias [E, N])``, each empty unless ``needs`` (x,
    weight, offsets, bias) asks for it. The op ``smptk::grouped_linear_bwd``."""
    need_dx, need_dw, _, need_db = needs
    dz, _ = _epilogue.activation_backward(dy_TN, z_TN, activation, False, w_ENK.dtype)
    dx = new_buffer(x_TK.shape if need_dx else (0,), x_TK.dtype, x_TK.device)
    if need_dx:
        if w_ENK.shape[1] == 0:
            dx.zero_()
        else:
            _gemm.grouped_matmul(dz, w_ENK, offsets, dx)
    dw = new_buffer(w_ENK.shape if need_dw else (0,), w_ENK.dtype, w_ENK.device)
    db = new_buffer(w_ENK.shape[:2] if need_db else (0,), w_ENK.dtype, w_ENK.device)
    if need_dw or need_db:
        _gemm.grouped_weight_grad(dz, x_TK, offsets, dw if need_dw else None, db if need_db else None)
    return dx, dw, db


def _grouped_swiglu_bwd_fake(dy_TN, x_TK, wg_ENK, wu_ENK, offsets, h_T2N, needs):
    E, N, K = wg_ENK.shape
    rows = N * (needs[1] + needs[2])
    return x_TK.new_empty(x_TK.shape if needs[0] else (0,)), wg_ENK.new_empty((E, rows, K))


def _grouped_swiglu_bwd_flops(dy_TN, x_TK, wg_ENK, wu_ENK, offsets, h_T2N, needs, *, out_shape):
    # dx = dg_e @ w_gate[e] + du_e @ w_up[e] (two products), one product per weight gradient asked for
    return (2 * needs[0] + needs[1] + needs[2]) * gemm_flops(dy_TN[0], x_TK[1], dy_TN[1])


@dispatcher_op("grouped_swiglu_bwd", fake=_grouped_swiglu_bwd_fake, flops=_grouped_swiglu_bwd_flops)
def grouped_swiglu_bwd(
    dy_TN: torch.Tensor,
    x_TK: torch.Tensor,
    wg_ENK: torch.Tensor,
    wu_ENK: torch.Tensor,
    offsets: torch.Tensor,
    h_T2N: torch.Tensor,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton backward: ``(dx [T, K], the weight gradients asked for)``, dx empty unless ``needs`` (x,
    weight_gate, weight_up) asks for it; ``[dw_gate | dw_up]`` ``[E, 2N, K]`` for both weights, ``[E, N, K]``
    for one, ``[E, 0, K]`` for none. The op ``smptk::grouped_swiglu_bwd``."""
    need_dx, need_dwg, need_dwu = needs
    N = wg_ENK.shape[1]
    dh = _epilogue.swiglu_dh(dy_TN, h_T2N)
    dx = new_buffer(x_TK.shape if need_dx else (0,), x_TK.dtype, x_TK.device)
    if need_dx:
        if N == 0:
            dx.zero_()
        else:
            _gemm.grouped_matmul(dh[:, :N], wg_ENK, offsets, dx, a2_TR=dh[:, N:], b2_ERC=wu_ENK)
    E, _, K = wg_ENK.shape
    # both: [dw_gate | dw_up] = dh_e.T @ x_e in one launch (x read once); one: only its half (a frozen other)
    cols = slice(0, 2 * N) if need_dwg and need_dwu else slice(0, N) if need_dwg else slice(N, 2 * N)
    dw = new_buffer((E, N * (need_dwg + need_dwu), K), wg_ENK.dtype, wg_ENK.device)
    if need_dwg or need_dwu:
        _gemm.grouped_weight_grad(dh[:, cols], x_TK, offsets, dw, None)
    return dx, dw


class GroupedLinearFunction(torch.autograd.Function):
    """Autograd over the Triton forward and backward (inputs checked, offsets int64 contiguous)."""

    @staticmethod
    def forward(ctx, x_TK, w_ENK, offsets, bias_EN, activation: int, grad_enabled: bool):
        ctx.needs = needs = grads_wanted(ctx, grad_enabled, 4)
        save_z = activation != _epilogue.ACT_NONE and any(needs)
        y, z = grouped_linear_fwd(x_TK, w_ENK, offsets, bias_EN, activation, save_z)
        # x only for dw, w only for dx (as in fused_linear); z (or dy) gives db
        ctx.save_for_backward(
            saved_if(x_TK, needs[1]), saved_if(w_ENK, needs[0]), offsets, none_if_empty(z, save_z)
        )
        ctx.activation = activation
        return y

    @staticmethod
    @first_derivative_only("grouped_linear", torch_path=True)
    def backward(ctx, dy_TN):
        x_TK, w_ENK, offsets, z = ctx.saved_tensors
        need_dx, need_dw, _, need_db = ctx.needs
        dx, dw, db = grouped_linear_bwd(dy_TN, x_TK, w_ENK, offsets, z, ctx.activation, list(ctx.needs))
        return (
            none_if_empty(dx, need_dx),
            none_if_empty(dw, need_dw),
            None,
            none_if_empty(db, need_db),
            None,
            None,
        )


class GroupedSwiGLUFunction(torch.autograd.Function):
    """Autograd over the Triton forward and backward (inputs checked, offsets int64 contiguous)."""

    @staticmethod
    def forward(ctx, x_TK, wg_ENK, wu_ENK, offsets, grad_enabled: bool):
        ctx.needs = needs = grads_wanted(ctx, grad_enabled, 3)
        save_h = any(needs)
        y, h = grouped_swiglu_fwd(x_TK, wg_ENK, wu_ENK, offsets, save_h)
        need_x, need_w = needs[1] or needs[2], needs[0]  # x only for the weights' gradients, w only for dx
        saved = (saved_if(x_TK, need_x), saved_if(wg_ENK, need_w), saved_if(wu_ENK, need_w))
        ctx.save_for_backward(*saved, offsets, none_if_empty(h, save_h))
        return y

    @staticmethod
    @first_derivative_only("grouped_swiglu", torch_path=True)
    def backward(ctx, dy_TN):
        x_TK, wg_ENK, wu_ENK, offsets, h = ctx.saved_tensors
        need_dx, need_dwg, need_dwu = ctx.needs
        N = wg_ENK.shape[1]
        dx, dw = grouped_swiglu_bwd(dy_TN, x_TK, wg_ENK, wu_ENK, offsets, h, list(ctx.needs))
        dwg = dw[:, :N] if need_dwg else None
        dwu = dw[:, -N:] if need_dwu else None
        return none_if_empty(dx, need_dx), dwg, dwu, None, None


# --- checks and the PyTorch path ------------------------------------------------------------------------


def _check_expert_weight(name: str, w: object, x: torch.Tensor) -> torch.Tensor:
    check_float_tensor(name, w)
    check_same(name, w, "x", x)
    if w.dim() != 3:
        raise ValueError(
            f"{name}: expected a 3-D [E, N, K] weight (one [N, K] per expert), got {tuple(w.shape)}"
        )
    if w.shape[0] == 0:
        raise ValueError(f"{name}: expected at least one expert, got shape {tuple(w.shape)}")
    if w.shape[2] != x.shape[1]:
        raise ValueError(f"{name}: shape {tuple(w.shape)} needs K={w.shape[2]} but x has {x.shape[1]}")
    return w


def _check_x(x: object) -> None:
    check_input(x)
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D [T, K] input (rows grouped by expert), got {tuple(x.shape)}")


def _check_offsets(offsets: object, x: torch.Tensor, E: int, path: str) -> torch.Tensor:
    """Return ``offsets`` as a contiguous int64 tensor. Dtype, shape and device are always checked; the
    values when they cost no sync: on CPU, on the torch path (which reads them anyway), or when
    ``SMPTK_CHECK_OFFSETS=1``."""
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"offsets: expected a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"offsets: dtype {offsets.dtype} is not supported; expected int64 (or int32)")
    if offsets.shape != (E + 1,):
        raise ValueError(f"offsets: expected shape ({E + 1},) for E={E} experts, got {tuple(offsets.shape)}")
    if offsets.device != x.device:
        raise ValueError(f"offsets: on {offsets.device} but x is on {x.device}")
    offsets = offsets.to(torch.int64).contiguous()
    if offsets.device.type == "meta" or is_fake(offsets):  # shapes only: there are no values to check
        return offsets
    debug = settings.check_offsets()
    if offsets.device.type == "cpu" or path == "torch" or debug:
        T = x.shape[0]
        first, last = (int(v) for v in offsets[[0, -1]].tolist())
        if first != 0 or last != T:
            raise ValueError(
                f"offsets: expected offsets[0] == 0 and offsets[-1] == T == {T}, got {first}, {last}"
            )
        if bool((offsets[1:] < offsets[:-1]).any()):
            e = int((offsets[1:] < offsets[:-1]).nonzero()[0])
            raise ValueError(f"offsets: must be non-decreasing, but offsets[{e + 1}] < offsets[{e}]")
    return offsets


def _per_expert(x, offsets, fn) -> torch.Tensor:
    """Concatenate ``fn(e, x_e)`` over experts; one host read of the offsets (the PyTorch path only).
    Empty experts run too, so their weights get exact-zero gradients from autograd."""
    if x.device.type == "meta":  # no offsets to read; expert 0 over every row gives the [T, N] shape
        return fn(0, x)
    bounds = offsets.tolist()
    return torch.cat([fn(e, x[bounds[e] : bounds[e + 1]]) for e in range(len(bounds) - 1)])


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """``act(x_e @ weight[e].T + bias[e])`` for every expert e, one kernel launch for all of them.

    Args:
        x: ``[T, K]`` float32, float16 or bfloat16, rows grouped by expert; any strides.
        weight: ``[E, N, K]``, x's dtype and device.
        offsets: ``[E + 1]`` int64 (int32 accepted) on x's device: expert e owns rows
            ``offsets[e]:offsets[e + 1]``; ``offsets[0] == 0``, ``offsets[E] == T``, non-decreasing
            (values checked on CPU, on the PyTorch path, or with ``SMPTK_CHECK_OFFSETS=1``; see the
            module docstring).
        bias: ``[E, N]`` or None.
        activation: None, "relu", "gelu" (erf form), "gelu_tanh" or "silu".

    Returns:
        ``[T, N]`` in x's dtype; differentiable in x, weight and bias (empty experts get exact zeros).

    Honours ``torch.autocast`` like ``fused_linear``; ``SMPTK_KERNELS=triton|torch`` picks the path.

    Example::

        >>> x, w = torch.randn(5, 64), torch.randn(3, 32, 64)
        >>> grouped_linear(x, w, torch.tensor([0, 2, 2, 5]), bias=torch.zeros(3, 32), activation="silu").shape
        torch.Size([5, 32])
    """
    _check_x(x)
    x, weight, bias = autocast_inputs(x, weight, bias)
    _check_expert_weight("weight", weight, x)
    check_activation(activation)
    E, N = weight.shape[:2]
    if bias is not None:
        check_bias(bias, (E, N), "weight's [E, N]", x)
    path = runtime.select_path(x, weight, bias)
    offsets = _check_offsets(offsets, x, E, path)
    if path == "torch":
        act = TORCH_ACTIVATIONS[activation]
        return _per_expert(
            x, offsets, lambda e, xe: act(F.linear(xe, weight[e], None if bias is None else bias[e]))
        )
    if bias is not None and bias.stride(1) != 1:
        bias = bias.contiguous()  # the epilogue reads bias rows as contiguous [N] vectors
    act = _epilogue.ACTIVATION_CODES[activation]
    return _grouped_linear_triton(x, weight, offsets, bias, act, torch.is_grad_enabled())


@outside_graphs  # torch.compile: a graph break, then the Function as in eager (see _dispatch)
def _grouped_linear_triton(x, weight, offsets, bias, act: int, grad_enabled: bool) -> torch.Tensor:
    return GroupedLinearFunction.apply(x, weight, offsets, bias, act, grad_enabled)


def grouped_swiglu(
    x: torch.Tensor, weight_gate: torch.Tensor, weight_up: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """``silu(x_e @ weight_gate[e].T) * (x_e @ weight_up[e].T)`` per expert, one launch, x read once per tile.

    Args:
        x: ``[T, K]``, rows grouped by expert; weight_gate, weight_up: ``[E, N, K]`` each, x's dtype and
            device; offsets: as in :func:`grouped_linear`.

    Returns:
        ``[T, N]`` in x's dtype; differentiable in x and both weights.

    Example::

        >>> x, wg, wu = torch.randn(5, 64), torch.randn(3, 172, 64), torch.randn(3, 172, 64)
        >>> grouped_swiglu(x, wg, wu, torch.tensor([0, 2, 2, 5])).shape
        torch.Size([5, 172])
    """
    _check_x(x)
    x, weight_gate, weight_up = autocast_inputs(x, weight_gate, weight_up)
    _check_expert_weight("weight_gate", weight_gate, x)
    _check_expert_weight("weight_up", weight_up, x)
    if weight_up.shape != weight_gate.shape:
        raise ValueError(
            f"weight_up: shape {tuple(weight_up.shape)} must equal weight_gate's {tuple(weight_gate.shape)}"
        )
    path = runtime.select_path(x, weight_gate, weight_up)
    offsets = _check_offsets(offsets, x, weight_gate.shape[0], path)
    if path == "torch":
        return _per_expert(
            x, offsets, lambda e, xe: F.silu(F.linear(xe, weight_gate[e])) * F.linear(xe, weight_up[e])
        )
    return _grouped_swiglu_triton(x, weight_gate, weight_up, offsets, torch.is_grad_enabled())


@outside_graphs  # torch.compile: a graph break, then the Function as in eager (see _dispatch)
def _grouped_swiglu_triton(x, weight_gate, weight_up, offsets, grad_enabled: bool) -> torch.Tensor:
    return GroupedSwiGLUFunction.apply(x, weight_gate, weight_up, offsets, grad_enabled)
