"""Plain-PyTorch fp32 references for the ops in :mod:`smptk.kernels`, written from the math.

Every reference upcasts its inputs to float32, computes in float32 and returns float32. Nothing here
imports or calls :mod:`smptk.kernels` or ``torch.nn.functional``'s fused ops: the activations are written
out from their definitions, so a kernel and its reference never share a formula by accident. A reference
is never edited to match a kernel; when they disagree, the kernel (or the tolerance) is what gets checked.

The references are differentiable: run autograd through them (with float32 leaves) to get the fp32
reference gradients.

On CUDA the float32 matmul must be IEEE float32, not TF32, or the reference is only a TF32 one; the
references refuse to run while torch lets fp32 matmuls use TF32 (``torch.backends.cuda.matmul.fp32_precision``
"tf32", or the legacy ``allow_tf32`` set; torch's default is neither).

Legend: M rows of x (all leading dims together), K input features, N output features.

Example::

    >>> x = torch.tensor([[1.0, -2.0]])
    >>> w = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    >>> linear_reference(x, w, torch.tensor([0.0, 1.0]), activation="relu")
    tensor([[0., 2.]])
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from smptk._precision import tf32_matmul

__all__ = [
    "ACTIVATIONS",
    "activation_fn",
    "gelu",
    "gelu_tanh",
    "identity",
    "linear_reference",
    "relu",
    "silu",
    "swiglu_reference",
]

_SQRT_2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_CUBIC = 0.044715  # the cubic coefficient of the tanh approximation (Hendrycks & Gimpel, 2016)


def identity(z: Tensor) -> Tensor:
    """No activation: ``z`` unchanged."""
    return z


def relu(z: Tensor) -> Tensor:
    """``max(z, 0)``; its derivative at exactly 0 is taken as 0 (torch's convention); NaN stays NaN (with
    derivative 0, as torch.relu's), inf stays inf.

    >>> relu(torch.tensor([-1.0, 0.0, 2.0, float("nan"), float("inf"), -float("inf")]))
    tensor([0., 0., 2., nan, inf, 0.])
    """
    return torch.where(z.isnan(), z.detach(), torch.where(z > 0, z, torch.zeros_like(z)))


def gelu(z: Tensor) -> Tensor:
    """Exact GELU, ``z * Phi(z) = 0.5 * z * (1 + erf(z / sqrt(2)))`` with Phi the standard normal CDF.

    Evaluated as ``0.5 * z * erfc(-z / sqrt(2))``, the same function without the cancellation of
    ``1 + erf`` for negative z (which costs the erf form its relative accuracy below z = -3).

    >>> gelu(torch.tensor([-1.0, 0.0, 1.0]))
    tensor([-0.1587,  0.0000,  0.8413])
    """
    return 0.5 * z * torch.erfc(-z / _SQRT_2)


def gelu_tanh(z: Tensor) -> Tensor:
    """Tanh approximation of GELU, ``0.5 * z * (1 + tanh(sqrt(2/pi) * (z + 0.044715 * z**3)))``.

    Evaluated as ``z * sigmoid(v)`` for negative z and ``z - z * sigmoid(-v)`` otherwise, with ``v = 2 *
    sqrt(2/pi) * (z + 0.044715 * z**3)``: the same function, whose derivatives keep their relative accuracy
    on both sides (written with ``1 + tanh``, the derivative was 30% off at z = -5 and 0 below -5.5).

    >>> gelu_tanh(torch.tensor([-1.0, 0.0, 1.0, float("inf")]))
    tensor([-0.1588,  0.0000,  0.8412,     inf])
    """
    v = 2.0 * _SQRT_2_OVER_PI * (z + _GELU_TANH_CUBIC * z * z * z)
    # sigmoid's derivative s * (1 - s) cancels where s is near 1: each side takes the form whose s is small;
    # +inf is itself (as torch's), not inf - inf * 0
    out = torch.where(z < 0, z * torch.sigmoid(v), z - z * torch.sigmoid(-v))
    return torch.where(z == float("inf"), z, out)


def silu(z: Tensor) -> Tensor:
    """SiLU (swish), ``z * sigmoid(z) = z / (1 + exp(-z))``.

    >>> silu(torch.tensor([-1.0, 0.0, 1.0]))
    tensor([-0.2689,  0.0000,  0.7311])
    """
    return z * torch.sigmoid(z)


ACTIVATIONS: dict[str | None, Callable[[Tensor], Tensor]] = {
    None: identity,
    "relu": relu,
    "gelu": gelu,
    "gelu_tanh": gelu_tanh,
    "silu": silu,
}


def activation_fn(activation: str | None) -> Callable[[Tensor], Tensor]:
    """The reference activation called ``activation`` (None, "relu", "gelu", "gelu_tanh" or "silu").

    >>> activation_fn("silu") is silu
    True
    """
    try:
        return ACTIVATIONS[activation]
    except (KeyError, TypeError):
        raise ValueError(
            f"activation: {activation!r} is not supported; expected one of {tuple(ACTIVATIONS)}"
        ) from None


def _fp32(name: str, t: Tensor) -> Tensor:
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point torch.Tensor, got {type(t).__name__}")
    if t.is_cuda and tf32_matmul():
        raise RuntimeError(
            f"{name}: torch lets fp32 matmuls use TF32 (torch.backends.cuda.matmul.fp32_precision is "
            "'tf32', or allow_tf32 is set), so an fp32 matmul would be TF32; turn it off for the reference"
        )
    return t.to(torch.float32)


def _matmul_nt(x32: Tensor, name: str, w: Tensor) -> Tensor:
    """``x @ w.T`` in float32 for x ``[..., K]`` (or ``[K]``) and the weight ``name`` ``[N, K]``."""
    w32 = _fp32(name, w)
    if w32.dim() != 2 or w32.shape[1] != x32.shape[-1]:
        raise ValueError(f"{name}: expected shape [N, {x32.shape[-1]}], got {tuple(w32.shape)}")
    return torch.matmul(x32, w32.t())


def linear_reference(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None
) -> Tensor:
    """``act(x @ weight.T + bias)`` in float32.

    Args:
        x: ``[..., K]`` (a 1-D ``[K]`` gives a 1-D ``[N]`` result).
        weight: ``[N, K]`` (nn.Linear layout).
        bias: ``[N]`` or None.
        activation: None, "relu", "gelu", "gelu_tanh" or "silu".

    Returns:
        ``[..., N]`` float32, whatever the input dtype.

    >>> x = torch.ones(3, 2, dtype=torch.float16)
    >>> linear_reference(x, torch.ones(4, 2, dtype=torch.float16), activation="gelu").dtype
    torch.float32
    >>> linear_reference(torch.tensor([1.0, 2.0]), torch.tensor([[3.0, 4.0]]), torch.tensor([-1.0]))
    tensor([10.])
    """
    act = activation_fn(activation)
    z = _matmul_nt(_fp32("x", x), "weight", weight)
    if bias is not None:
        z = z + _fp32("bias", bias)
    return act(z)


def swiglu_reference(x: Tensor, weight_gate: Tensor, weight_up: Tensor) -> Tensor:
    """``silu(x @ weight_gate.T) * (x @ weight_up.T)`` in float32.

    Args:
        x: ``[..., K]``.
        weight_gate, weight_up: ``[N, K]`` each.

    Returns:
        ``[..., N]`` float32.

    >>> x = torch.tensor([[1.0, 1.0]])
    >>> swiglu_reference(x, torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 1.0]]))
    tensor([[2.1932]])
    """
    x32 = _fp32("x", x)
    gate = _matmul_nt(x32, "weight_gate", weight_gate)
    up = _matmul_nt(x32, "weight_up", weight_up)
    return silu(gate) * up
