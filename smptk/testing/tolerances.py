"""Tolerances for comparing a kernel with its fp32 reference, derived from a rounding model, not tuned.

The model. An element a kernel computes is a dot product of length R (a GEMM output, or one element of a
gradient GEMM), ``y = sum_k t_k`` (maybe plus a bias, then an activation), formed from inputs stored in
dtype d, accumulated in fp32 and rounded to d once. The reference (:mod:`smptk.testing.references`) forms
the same sum from the same inputs, upcast exactly, in fp32. The two differ by at most::

    |y_kernel - y_ref| <= u_d * |y_ref|                          (1) the final rounding to d
                        + C * (sqrt(R) * u_32 + r * u_d) * s     (2) accumulation and stored intermediates
                        + tiny_d                                 (3) the subnormal spacing of d

- ``u_d`` is the unit roundoff, half the machine epsilon: 2^-24 for float32, 2^-11 for float16, 2^-8 for
  bfloat16. (1) is exact: round-to-nearest moves a value by at most u_d of itself.
- ``s`` is the root-sum-square of the summed terms, ``s = sqrt(sum_k t_k^2)``: the size the errors of the
  individual terms add up to in quadrature. It is computed element by element from the inputs (the
  ``*_error_scales`` functions below), weighted by how much what follows the sum can amplify an error
  (the activation's largest slope for a forward output, so an output near zero still gets the tolerance
  its summands earned; the activation's derivatives at the reference z for a gradient's summands). It
  plays the role of ``|x| |w|`` in the usual ``sqrt(K) * eps * |x| |w|`` bound, computed per element.
- ``sqrt(R) * u_32``: fp32 accumulation. Each of the R additions commits a relative error of at most u_32
  of its running partial sum; for random-sign terms the partial sums grow like ``sqrt(k / R) * s``, and
  the R independent errors add in quadrature to about ``u_32 * sqrt(R / 2) * s``, for the kernel and for
  the reference alike (they sum in different orders).
- ``r * u_d``: r intermediates stored in d along the way (a pre-activation saved for the backward,
  ``dz = dy * act'(z)`` rounded to d before a gradient GEMM, the torch path's rounding of ``x @ w.T``
  before its separate activation op). Each gives every term an independent relative error of at most
  u_d, and those add in quadrature to at most ``u_d * s``. ``ROUNDINGS`` counts r per op.
- ``C = 6``: for independent zero-mean errors bounded by ``delta * |t_k|``, Hoeffding's inequality gives
  ``P(|sum| > C * delta * s) <= 2 * exp(-C^2 / 2) = 3e-8`` per element, so a million-element check
  passes a correct kernel with probability > 0.97 under the model; the tests also fix their seeds.
- (3) covers the subnormal range of d, where (1) does not hold.

Gradients use the same form with R the reduction length of the gradient GEMM plus K: the error of the
forward pre-activation z (accumulated over K, or rounded when z is saved) reaches ``act'(z)`` through the
curvature ``act''``, which ``linear_error_scales`` puts into s.

What it catches. At the tests' shapes the tolerance is a few u_d of the summands, so in fp32 and fp16 an
error of the size of one summand fails: a dropped tail column or row of the K loop, a missing bias, a
wrong activation or activation derivative, an unwritten element (NaN with ``SMPTK_POISON_OUTPUTS=1``).
``tests/test_testing.py`` checks that it does. Measured there (CPU, torch 2.13, shapes up to
256 x 2048 x 128): correct low-precision computations use at most 0.2 of the tolerance; the planted bugs
exceed it by at least 2.8x in bf16 (a wrong silu' seen through dbias), 13x in fp16 and 2e4x in fp32.

Its limits, measured (CPU, planted bugs against correct bf16 results):

- bf16 is a check of magnitude, not of percent-level errors. ``C * r * u_d`` treats each stored
  intermediate as an independent error on every summand, times the confidence factor: with u_bf16 = 2^-8
  and r = 3 (fused_linear's backward) that is about 7% of the summands' root-sum-square. These passed:
  an output 1% too large (0.42 of the tolerance; correct results use 0.10-0.18), dweight 3% too large
  (0.51), a bias dropped at K >= 512 with nn.Linear's init, one row of a 1024-row reduction missing from
  dbias, fp32 accumulation replaced by bf16 at K = 64 (0.96). The CPU tests check the kernels in fp32
  and fp16 (the interpreter's bf16 ``tl.dot`` is wrong), which reject all of these by 2.6x to 1e5x; the
  bf16 checks run on GPUs, where tightening the stored-intermediate term needs the correct results'
  margins measured first.
- Sums of same-sign terms: the model takes random signs (partial sums growing like sqrt(k)). A correct
  fp32 bias gradient of a positive ``dy`` accumulated in 64-row tiles uses 0.48 of the tolerance at
  M = 4096 and exceeds it at M = 65536 (2.1x); the tests' reductions are far shorter.

Example::

    >>> expected = torch.tensor([1.0, -2.0])
    >>> assert_close(expected.half(), expected, dtype=torch.float16, reduction_len=64, name="y")
    >>> assert_close(torch.tensor([1.0, -1.9]).half(), expected, dtype=torch.float16,
    ...              reduction_len=64, name="y")
    Traceback (most recent call last):
    ...
    AssertionError: y: 1 of 2 elements outside the tolerance (torch.float16, reduction_len=64, roundings=0)...
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from smptk.testing.references import ACTIVATIONS, silu

__all__ = [
    "ACTIVATION_BOUNDS",
    "CONFIDENCE",
    "ROUNDINGS",
    "UNIT_ROUNDOFF",
    "ActivationBounds",
    "ErrorScale",
    "Tolerance",
    "assert_close",
    "linear_error_scales",
    "relu_kink_mask",
    "swiglu_error_scales",
    "tolerance",
]

UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}

CONFIDENCE = 6.0  # C above: 2 * exp(-C^2 / 2) = 3e-8 per element

# Intermediates rounded to the input dtype, per op and direction (r above). Counted on the unfused torch
# path, which rounds the most; the fused Triton kernels round fewer, so they are checked at least as
# tightly as this.
ROUNDINGS: dict[str, int] = {
    # torch path: x @ w.T (+ b) is rounded to d before the activation op reads it.
    "fused_linear.forward": 1,
    # z saved in d (act'(z) is evaluated at the rounded z), dz = dy * act'(z) rounded to d before the
    # gradient GEMMs, one spare for the torch path's separate multiply.
    "fused_linear.backward": 3,
    # torch path: g, u and silu(g) each rounded to d before the product.
    "swiglu.forward": 2,
    # u and g saved in d, dy * u rounded, dg and du rounded, and the torch path's two GEMMs for dx rounded
    # to d before they are added.
    "swiglu.backward": 4,
}


@dataclass(frozen=True)
class ActivationBounds:
    """Global bounds on an activation's derivatives, used to carry pre-activation errors through it.

    ``slope`` = max |f'(z)|, ``curvature`` = max |f''(z)| over all real z. relu's curvature is 0 away
    from its kink; the kink itself is handled by :func:`relu_kink_mask`. ``derivative_error``: the
    absolute error of evaluating f'(z) in fp32, in units of ``C * u_32`` (the least the tolerance's scale
    coefficient is): f' cancels where it is small (``1 + erf`` and ``1 + tanh`` for negative z, ``1 -
    sigmoid`` for large z), so a kernel's f'(z), like torch's, is off by a few u_32 absolute there, far
    more than relative to the tiny true value, and no other term of the model covers it.
    """

    slope: float
    curvature: float
    derivative_error: float = 0.0


# Maxima measured on a float64 grid of [-20, 20] in steps of 1e-5 (tests/test_testing.py re-measures them):
# gelu' 1.12890 at z=+-2.4 (and gelu_tanh' 1.12899), gelu'' 0.79788 = 2/sqrt(2 pi) at 0; silu' 1.09984,
# silu'' 0.5 at 0. Rounded up.
ACTIVATION_BOUNDS: dict[str | None, ActivationBounds] = {
    None: ActivationBounds(slope=1.0, curvature=0.0),
    "relu": ActivationBounds(slope=1.0, curvature=0.0),
    "gelu": ActivationBounds(slope=1.13, curvature=0.8, derivative_error=1.0),
    "gelu_tanh": ActivationBounds(slope=1.13, curvature=0.8, derivative_error=1.0),
    "silu": ActivationBounds(slope=1.1, curvature=0.5, derivative_error=1.0),
}
assert set(ACTIVATION_BOUNDS) == set(ACTIVATIONS)


def unit_roundoff(dtype: torch.dtype) -> float:
    """u_d for a supported dtype.

    >>> unit_roundoff(torch.bfloat16)
    0.00390625
    """
    try:
        return UNIT_ROUNDOFF[dtype]
    except KeyError:
        raise ValueError(f"dtype: no tolerance for {dtype}; expected one of {tuple(UNIT_ROUNDOFF)}") from None


@dataclass(frozen=True)
class Tolerance:
    """``bound = rtol * |expected| + scale_coef * scale + atol`` element by element (see module doc).

    Example::

        >>> import torch
        >>> from smptk.testing import tolerance
        >>> tol = tolerance(torch.bfloat16, reduction_len=64, roundings=1)
        >>> tol.rtol == 2**-8, tol.describe()   # scale_coef = C * (sqrt(64) * u_32 + 1 * u_bf16)
        (True, '0.00391*|expected| + 0.0234*scale + 9.18e-41')
        >>> tol.bound(torch.tensor([1.0, -4.0]), scale=2.0)   # the allowed |error|, element by element
        tensor([0.0508, 0.0625])
    """

    dtype: torch.dtype
    reduction_len: int
    roundings: int
    rtol: float
    scale_coef: float
    atol: float

    def bound(self, expected: Tensor, scale: Tensor | float) -> Tensor:
        return self.rtol * expected.abs() + self.scale_coef * scale + self.atol

    def describe(self) -> str:
        return f"{self.rtol:.3g}*|expected| + {self.scale_coef:.3g}*scale + {self.atol:.3g}"


def tolerance(dtype: torch.dtype, reduction_len: int, roundings: int = 0) -> Tolerance:
    """The tolerance of the module docstring for outputs in ``dtype`` summed over ``reduction_len`` terms.

    >>> t = tolerance(torch.float32, reduction_len=4096)
    >>> round(t.scale_coef / 2**-24 / 6)  # C * sqrt(R) * u_32, in units of C * u_32
    64
    """
    if reduction_len < 0 or roundings < 0:
        raise ValueError(f"reduction_len and roundings must be >= 0, got {reduction_len} and {roundings}")
    u_d = unit_roundoff(dtype)
    u_32 = UNIT_ROUNDOFF[torch.float32]
    info = torch.finfo(dtype)
    return Tolerance(
        dtype=dtype,
        reduction_len=reduction_len,
        roundings=roundings,
        rtol=u_d,
        scale_coef=CONFIDENCE * (math.sqrt(max(reduction_len, 1)) * u_32 + roundings * u_d),
        atol=info.smallest_normal * info.eps,  # the spacing of d's subnormals
    )


def _index(flat_index: int, shape: torch.Size) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), shape))


def assert_close(
    actual: Tensor,
    expected: Tensor,
    *,
    dtype: torch.dtype,
    reduction_len: int,
    name: str,
    scale: Tensor | float | None = None,
    roundings: int = 0,
) -> None:
    """Assert that a kernel result ``actual`` (in ``dtype``) matches the fp32 reference ``expected``.

    Args:
        actual: the kernel's tensor; its dtype must be ``dtype`` and its shape ``expected``'s.
        expected: the fp32 reference.
        dtype: the dtype the kernel computed in (the inputs' dtype).
        reduction_len: R, the length of the dot products behind each element.
        name: what is compared ("out", "dx", ...), for the failure message.
        scale: s of the module docstring, a tensor broadcastable to ``expected`` or a number; from
            :func:`linear_error_scales` / :func:`swiglu_error_scales`. Default: the root-mean-square of
            ``expected``, the typical s of a sum of random-sign terms.
        roundings: r of the module docstring (see ``ROUNDINGS``).

    Raises:
        AssertionError: naming the number of failing elements, the worst one (index, values, error,
        tolerance), the largest absolute error and where, and the tolerance formula.
    """
    if not isinstance(actual, Tensor):
        raise AssertionError(f"{name}: expected a tensor, got {type(actual).__name__}")
    if actual.dtype != dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype}, expected {dtype}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    tol = tolerance(dtype, reduction_len, roundings)
    header = f"{name}: {{}} ({dtype}, reduction_len={reduction_len}, roundings={roundings})"
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    if a.numel() == 0:
        return
    e_finite = torch.isfinite(e)
    bad_nonfinite = e_finite & ~torch.isfinite(a)
    if bad_nonfinite.any():
        idx = _index(int(bad_nonfinite.flatten().nonzero()[0]), a.shape)
        raise AssertionError(
            header.format(
                f"{int(bad_nonfinite.sum())} of {a.numel()} elements are NaN/inf where the "
                "reference is finite"
            )
            + f"\n  first at index {idx}: actual={a[idx].item()!r}, expected={e[idx].item()!r}"
            + "\n  (an element the kernel never wrote reads as NaN under SMPTK_POISON_OUTPUTS=1)"
        )
    if not e_finite.all():  # NaN where the reference has NaN, the same infinity where it has one
        a_nf, e_nf = a[~e_finite], e[~e_finite]
        if not ((a_nf == e_nf) | (a_nf.isnan() & e_nf.isnan())).all():
            raise AssertionError(header.format("non-finite reference values are not reproduced"))
    if scale is None:
        scale = e[e_finite].square().mean().sqrt().item() if e_finite.any() else 0.0
    if isinstance(scale, Tensor):
        scale = scale.detach().to(device=e.device, dtype=torch.float64)
    bound = torch.broadcast_to(tol.bound(e, scale), e.shape)
    unusable = e_finite & ~torch.isfinite(bound)
    if unusable.any():  # NaN > bound is False: a NaN or infinite tolerance would pass any value
        idx = _index(int(unusable.flatten().nonzero()[0]), a.shape)
        raise AssertionError(
            header.format(f"the tolerance is {bound[idx].item()} at index {idx} (a NaN or infinite scale)")
            + "; it would accept any value: give a finite scale"
        )
    err = torch.where(e_finite, (a - e).abs(), torch.zeros_like(e))
    bad = err > bound
    if not bad.any():
        return
    ratio = torch.where(bad, err / bound, torch.zeros_like(err))
    worst = _index(int(ratio.flatten().argmax()), a.shape)
    biggest = _index(int(err.flatten().argmax()), a.shape)
    worst_scale = scale[worst].item() if isinstance(scale, Tensor) and scale.dim() else float(scale)
    raise AssertionError(
        header.format(f"{int(bad.sum())} of {a.numel()} elements outside the tolerance")
        + f"\n  worst at index {worst}: actual={a[worst].item():.7g}, expected={e[worst].item():.7g}, "
        f"|error|={err[worst].item():.3g}, tolerance={bound[worst].item():.3g} "
        f"({ratio[worst].item():.3g}x), scale={worst_scale:.3g}"
        + f"\n  max |error| = {err[biggest].item():.3g} at index {biggest} "
        f"(tolerance there {bound[biggest].item():.3g}); max |expected| = {e.abs().max().item():.3g}"
        + f"\n  tolerance = {tol.describe()}"
    )


class ErrorScale(NamedTuple):
    """What :func:`assert_close` needs for one compared tensor besides the values.

    Its fields are :func:`assert_close`'s keyword arguments of the same names.

    Example::

        >>> import torch
        >>> from smptk.testing import assert_close, linear_error_scales, linear_reference
        >>> x, w = torch.ones(2, 3), torch.ones(4, 3)
        >>> s = linear_error_scales(x, w)["out"]
        >>> s.reduction_len, s.roundings, round(s.scale[0, 0].item(), 3)   # K; r; sqrt(3) + |z| = sqrt(3) + 3
        (3, 1, 4.732)
        >>> y = x.half() @ w.half().T                   # the op computed in fp16
        >>> assert_close(y, linear_reference(x, w), dtype=torch.float16, name="out", **s._asdict())
    """

    reduction_len: int
    scale: Tensor
    roundings: int


def _rss(a: Tensor, b: Tensor) -> Tensor:
    """Root-sum-square of the products in ``a @ b``: ``sqrt((a * a) @ (b * b))``, squared in fp64 (in fp32
    a finite |x| past 1.8e19 overflowed to an infinite scale, which tolerated anything)."""
    return torch.sqrt(a.double().square() @ b.double().square()).to(a.dtype)


def _as_fp32_2d(x: Tensor) -> Tensor:
    return x.detach().to(torch.float32).reshape(math.prod(x.shape[:-1]), x.shape[-1])  # K = 0 too


def _derivatives(activation: str | None, z: Tensor) -> tuple[Tensor, Tensor]:
    """``|f'(z)|`` and ``|f''(z)|`` of the reference activation, element by element, by autograd."""
    with torch.enable_grad():
        zz = z.detach().requires_grad_()
        (d1,) = torch.autograd.grad(ACTIVATIONS[activation](zz).sum(), zz, create_graph=True)
        if d1.requires_grad:
            (d2,) = torch.autograd.grad(d1.sum(), zz, allow_unused=True, materialize_grads=True)
        else:  # piecewise linear: f'' = 0
            d2 = torch.zeros_like(z)
    return d1.detach().abs(), d2.detach().abs()


def linear_error_scales(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    grad_out: Tensor | None = None,
) -> dict[str, ErrorScale]:
    """Error scales for ``act(x @ weight.T + bias)`` and its gradients.

    Per element, with ``z = x @ w.T + b`` and ``q_z = sqrt(x^2 @ (w^2).T + b^2)`` (root-sum-square of the
    summands of z), ``z_mag = q_z + |z|`` (q_z for the accumulation, |z| for rounding z itself):

    - ``"out"``: ``L * z_mag`` with L = max|act'| (``ACTIVATION_BOUNDS``), the largest factor by which
      the activation can amplify an error in z (global, so that a relu output next to its kink keeps the
      tolerance of its summands). R = K (+1 with a bias).
    - the summands of every gradient GEMM are ``dz = dy * act'(z)``; rounding moves them by a multiple of
      ``|dy * act'(z)|``, and an error e_z in z (of size ~ z_mag) by ``|dy * act''(z)| * e_z``. So each
      term is weighted by ``|dy| * (|act'(z)| + |act''(z)| * z_mag + e')`` (derivatives of the reference
      activation at the reference z; e' the ``derivative_error`` of ``ACTIVATION_BOUNDS``), and ``"x"``
      (dx = dz @ w, R = N + K), ``"weight"`` (dw = dz.T @ x, R = M + K) and ``"bias"`` (db = sum of dz
      over rows, R = M + K) are the root-sum-squares of those terms times w, x and 1.

    Args:
        x, weight, bias, activation: the op's inputs (any dtype; computed in fp32).
        grad_out: dy, the gradient flowing into the output; without it only ``"out"`` is returned.

    Returns:
        name -> :class:`ErrorScale`, each scale shaped like the tensor it checks.

    >>> s = linear_error_scales(torch.ones(2, 3), torch.ones(4, 3), activation="gelu")
    >>> s["out"].reduction_len, tuple(s["out"].scale.shape), round(s["out"].scale[0, 0].item(), 3)
    (3, (2, 4), 5.347)
    """
    bounds = ACTIVATION_BOUNDS[activation]
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = _as_fp32_2d(x)
    w = weight.detach().to(torch.float32)
    z = x2 @ w.t()
    q = _rss(x2, w.t())
    if bias is not None:
        b = bias.detach().to(torch.float32)
        z = z + b
        q = torch.hypot(q, b)
    z_mag = q + z.abs()
    roundings_fwd = ROUNDINGS["fused_linear.forward"]
    out_shape = (*x.shape[:-1], N)
    scales = {
        "out": ErrorScale(K + (bias is not None), (bounds.slope * z_mag).reshape(out_shape), roundings_fwd)
    }
    if grad_out is None:
        return scales
    M = x2.shape[0]
    d1, d2 = _derivatives(activation, z)
    dz = grad_out.detach().to(torch.float32).reshape(M, N).abs() * (d1 + d2 * z_mag + bounds.derivative_error)
    r = ROUNDINGS["fused_linear.backward"]
    scales["x"] = ErrorScale(N + K, _rss(dz, w).reshape(x.shape), r)
    scales["weight"] = ErrorScale(M + K, _rss(dz.t(), x2), r)
    if bias is not None:
        scales["bias"] = ErrorScale(M + K, _rss(dz.t(), torch.ones_like(dz[:, :1])).squeeze(1), r)
    return scales


def swiglu_error_scales(
    x: Tensor, weight_gate: Tensor, weight_up: Tensor, grad_out: Tensor | None = None
) -> dict[str, ErrorScale]:
    """Error scales for ``silu(g) * u`` with ``g = x @ weight_gate.T``, ``u = x @ weight_up.T``.

    With ``q_g``, ``q_u`` the root-sum-squares of the summands of g and u, ``g_mag = q_g + |g|`` and
    ``u_mag = q_u + |u|`` (accumulation plus the rounding of g and u themselves):

    - ``"out"``: an error e_g moves the output by at most ``L * |u| * e_g`` (L = max|silu'| = 1.1), e_u
      by ``|silu(g)| * e_u``: ``L * |u| * g_mag + |silu(g)| * u_mag``. R = K.
    - the backward's summands are ``dg = dy * u * silu'(g)`` and ``du = dy * silu(g)``. Errors in u and
      g move dg by ``|dy * silu'(g)| * e_u + |dy * u * silu''(g)| * e_g`` and du by
      ``|dy * silu'(g)| * e_g``, rounding by multiples of |dg| and |du|; so the terms are weighted by
      ``|dy| * (|silu'(g)| * u_mag + |silu''(g)| * |u| * g_mag)`` and
      ``|dy| * (|silu(g)| + |silu'(g)| * g_mag)``. ``"x"`` (dx = dg @ w_gate + du @ w_up, R = 2N + K),
      ``"weight_gate"`` (dg.T @ x, R = M + K) and ``"weight_up"`` (du.T @ x, R = M + K) are the
      root-sum-squares of their terms.

    >>> s = swiglu_error_scales(torch.ones(2, 3), torch.ones(4, 3), torch.ones(4, 3), torch.ones(2, 4))
    >>> sorted(s), tuple(s["x"].scale.shape)
    (['out', 'weight_gate', 'weight_up', 'x'], (2, 3))
    """
    bounds = ACTIVATION_BOUNDS["silu"]
    K = x.shape[-1]
    N = weight_gate.shape[0]
    x2 = _as_fp32_2d(x)
    wg = weight_gate.detach().to(torch.float32)
    wu = weight_up.detach().to(torch.float32)
    g = x2 @ wg.t()
    u = x2 @ wu.t()
    g_mag = _rss(x2, wg.t()) + g.abs()
    u_mag = _rss(x2, wu.t()) + u.abs()
    silu_g = silu(g).abs()
    out = bounds.slope * u.abs() * g_mag + silu_g * u_mag
    scales = {"out": ErrorScale(K, out.reshape(*x.shape[:-1], N), ROUNDINGS["swiglu.forward"])}
    if grad_out is None:
        return scales
    M = x2.shape[0]
    d1, d2 = _derivatives("silu", g)
    dy = grad_out.detach().to(torch.float32).reshape(M, N).abs()
    dg = dy * (d1 * u_mag + d2 * u.abs() * g_mag + bounds.derivative_error * u.abs())
    du = dy * (silu_g + d1 * g_mag)
    r = ROUNDINGS["swiglu.backward"]
    dx = torch.sqrt((dg * dg) @ (wg * wg) + (du * du) @ (wu * wu))
    scales["x"] = ErrorScale(2 * N + K, dx.reshape(x.shape), r)
    scales["weight_gate"] = ErrorScale(M + K, _rss(dg.t(), x2), r)
    scales["weight_up"] = ErrorScale(M + K, _rss(du.t(), x2), r)
    return scales


def relu_kink_mask(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, dtype: torch.dtype) -> Tensor:
    """Output positions whose pre-activation z is within its own tolerance of relu's kink at 0.

    There relu'(z) is 0 or 1 depending on rounding, and one flipped element moves a gradient by a whole
    summand. Tests zero the incoming gradient at these positions (they are a few percent at most) so
    that the gradient check is well posed; the forward value is continuous there and is checked as is.

    >>> w = torch.tensor([[1.0, -1.0], [1.0, 0.0]])  # z = [0, 1]
    >>> relu_kink_mask(torch.tensor([[1.0, 1.0]]), w, dtype=torch.float32)
    tensor([[ True, False]])
    """
    K = x.shape[-1]
    x2 = _as_fp32_2d(x)
    w = weight.detach().to(torch.float32)
    z = x2 @ w.t()
    q = _rss(x2, w.t())
    if bias is not None:
        b = bias.detach().to(torch.float32)
        z = z + b
        q = torch.hypot(q, b)
    tol = tolerance(dtype, K + (bias is not None), roundings=1)
    near = z.abs() <= tol.scale_coef * q + tol.atol
    return near.reshape(*x.shape[:-1], weight.shape[0])
