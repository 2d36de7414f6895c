"""fp32 references and error scales for the grouped (Mixture-of-Experts) linear ops.

Expert e owns rows ``offsets[e]:offsets[e + 1]`` of x ``[T, K]`` and applies its own weight ``[N, K]`` (of a
stack ``[E, N, K]``). The references are a plain loop over experts calling the dense fp32 references of
:mod:`smptk.testing.references` on each expert's rows: nothing here imports :mod:`smptk.kernels`, and an
empty expert still runs (on zero rows), so autograd gives its weights exact-zero gradients.

The error scales apply the tolerance model of :mod:`smptk.testing.tolerances` expert by expert: per-row
tensors (out, dx) concatenate the experts' scales, per-expert tensors (dweight, dbias) stack them. Each
expert's weight gradient is a reduction over that expert's rows only, so ``reduction_len`` is the largest
expert's (max rows_e + K), not T + K. An empty expert's scale is 0: its gradient must be 0 to within the
subnormal spacing of the dtype (tests also check it with ``torch.equal``).

Legend: T rows, K input features, N output features, E experts.

Example::

    >>> x = torch.ones(3, 2)
    >>> w = torch.stack([torch.eye(2), 2 * torch.eye(2)])  # E = 2
    >>> grouped_linear_reference(x, w, torch.tensor([0, 1, 3]))
    tensor([[1., 1.],
            [2., 2.],
            [2., 2.]])
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from smptk.testing.references import linear_reference, swiglu_reference
from smptk.testing.tolerances import ErrorScale, linear_error_scales, relu_kink_mask, swiglu_error_scales

__all__ = [
    "expert_bounds",
    "grouped_linear_error_scales",
    "grouped_linear_reference",
    "grouped_relu_kink_mask",
    "grouped_swiglu_error_scales",
    "grouped_swiglu_reference",
]


def expert_bounds(offsets: Tensor | Sequence[int], T: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` row range per expert, after checking that the offsets partition ``range(T)``.

    >>> expert_bounds([0, 2, 2, 5], 5)
    [(0, 2), (2, 2), (2, 5)]
    """
    offs = [int(v) for v in (offsets.tolist() if isinstance(offsets, Tensor) else offsets)]
    if len(offs) < 2 or offs[0] != 0 or offs[-1] != T or any(b < a for a, b in itertools.pairwise(offs)):
        raise ValueError(f"offsets: expected non-decreasing values from 0 to T={T}, got {offs}")
    return list(itertools.pairwise(offs))


def _per_expert(x: Tensor, offsets, fn: Callable[[int, Tensor], Tensor], experts: int) -> Tensor:
    """``fn(e, x_e)`` for every expert's rows, concatenated; the offsets must name ``experts`` experts."""
    if len(offsets) != experts + 1:
        raise ValueError(
            f"offsets: {len(offsets)} entries for {experts} experts' weights; expected {experts + 1}"
        )
    return torch.cat([fn(e, x[a:b]) for e, (a, b) in enumerate(expert_bounds(offsets, x.shape[0]))])


def grouped_linear_reference(
    x: Tensor, weight: Tensor, offsets, bias: Tensor | None = None, activation: str | None = None
) -> Tensor:
    """``act(x_e @ weight[e].T + bias[e])`` for each expert's rows, in float32; ``[T, N]``.

    Args: x ``[T, K]``, weight ``[E, N, K]``, offsets ``[E + 1]`` (tensor or list), bias ``[E, N]``.
    """
    return _per_expert(
        x,
        offsets,
        lambda e, xe: linear_reference(xe, weight[e], None if bias is None else bias[e], activation),
        weight.shape[0],
    )


def grouped_swiglu_reference(x: Tensor, weight_gate: Tensor, weight_up: Tensor, offsets) -> Tensor:
    """``silu(x_e @ weight_gate[e].T) * (x_e @ weight_up[e].T)`` per expert, in float32; ``[T, N]``.

    Example::

        >>> import torch
        >>> from smptk.testing import grouped_swiglu_reference
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
        >>> w_gate = torch.stack([torch.eye(2), torch.eye(2)])      # E = 2: g = x for both experts
        >>> w_up = torch.stack([torch.eye(2), 2 * torch.eye(2)])    # expert 1: u = 2 x
        >>> grouped_swiglu_reference(x, w_gate, w_up, [0, 1, 3])  # expert 0: row 0; expert 1: rows 1, 2
        tensor([[0.7311, 0.0000],
                [0.0000, 7.0464],
                [1.4621, 1.4621]])
    """
    return _per_expert(
        x, offsets, lambda e, xe: swiglu_reference(xe, weight_gate[e], weight_up[e]), weight_gate.shape[0]
    )


def _combine(per_expert: list[dict[str, ErrorScale]], row_keys: tuple[str, ...]) -> dict[str, ErrorScale]:
    """Concatenate the per-row scales, stack the per-expert ones; the largest reduction length wins."""
    out = {}
    for key in per_expert[0]:
        parts = [s[key] for s in per_expert]
        join = torch.cat if key in row_keys else torch.stack
        out[key] = ErrorScale(
            max(p.reduction_len for p in parts), join([p.scale for p in parts]), parts[0].roundings
        )
    return out


def grouped_linear_error_scales(
    x: Tensor,
    weight: Tensor,
    offsets,
    bias: Tensor | None = None,
    activation: str | None = None,
    grad_out: Tensor | None = None,
) -> dict[str, ErrorScale]:
    """:func:`~smptk.testing.linear_error_scales` per expert: ``"out"`` ``[T, N]``, and with ``grad_out``
    also ``"x"`` ``[T, K]``, ``"weight"`` ``[E, N, K]`` and ``"bias"`` ``[E, N]`` (with a bias).

    Example::

        >>> import torch
        >>> from smptk.testing import assert_close, grouped_linear_error_scales, grouped_linear_reference
        >>> x = torch.ones(3, 2)
        >>> w = torch.stack([torch.eye(2), 2 * torch.eye(2)])  # E = 2; expert 0: row 0, expert 1: rows 1, 2
        >>> s = grouped_linear_error_scales(x, w, [0, 1, 3], grad_out=torch.ones(3, 2))
        >>> sorted(s), tuple(s["weight"].scale.shape)
        (['out', 'weight', 'x'], (2, 2, 2))
        >>> s["out"].scale      # each row its expert's scale: sqrt(x^2 @ w^2) + |z|
        tensor([[2., 2.],
                [4., 4.],
                [4., 4.]])
        >>> s["weight"].reduction_len   # the largest expert's rows (2) + K (2), not T + K
        4
        >>> ref = grouped_linear_reference(x, w, [0, 1, 3])
        >>> assert_close(ref.half(), ref, dtype=torch.float16, name="out", **s["out"]._asdict())
    """
    bounds = expert_bounds(offsets, x.shape[0])
    per_expert = [
        linear_error_scales(
            x[a:b],
            weight[e],
            None if bias is None else bias[e],
            activation,
            None if grad_out is None else grad_out[a:b],
        )
        for e, (a, b) in enumerate(bounds)
    ]
    return _combine(per_expert, ("out", "x"))


def grouped_swiglu_error_scales(
    x: Tensor, weight_gate: Tensor, weight_up: Tensor, offsets, grad_out: Tensor | None = None
) -> dict[str, ErrorScale]:
    """:func:`~smptk.testing.swiglu_error_scales` per expert: ``"out"``, and with ``grad_out`` also ``"x"``,
    ``"weight_gate"`` and ``"weight_up"`` (``[E, N, K]``).

    Example::

        >>> import torch
        >>> from smptk.testing import grouped_swiglu_error_scales
        >>> x = torch.ones(3, 2)
        >>> w_gate = torch.stack([torch.eye(2), torch.eye(2)])      # E = 2, N = K = 2
        >>> w_up = torch.stack([torch.eye(2), 2 * torch.eye(2)])
        >>> s = grouped_swiglu_error_scales(x, w_gate, w_up, [0, 1, 3], grad_out=torch.ones(3, 2))
        >>> {name: (e.reduction_len, tuple(e.scale.shape)) for name, e in s.items()}  # x: 2N + K
        {'out': (2, (3, 2)), 'x': (6, (3, 2)), 'weight_gate': (4, (2, 2, 2)), 'weight_up': (4, (2, 2, 2))}
    """
    bounds = expert_bounds(offsets, x.shape[0])
    per_expert = [
        swiglu_error_scales(x[a:b], weight_gate[e], weight_up[e], None if grad_out is None else grad_out[a:b])
        for e, (a, b) in enumerate(bounds)
    ]
    return _combine(per_expert, ("out", "x"))


def grouped_relu_kink_mask(
    x: Tensor, weight: Tensor, offsets, bias: Tensor | None = None, *, dtype: torch.dtype
) -> Tensor:
    """:func:`~smptk.testing.relu_kink_mask` per expert: ``[T, N]`` bool, True where z is within rounding
    of relu's kink (tests zero the incoming gradient there)."""
    return _per_expert(
        x,
        offsets,
        lambda e, xe: relu_kink_mask(xe, weight[e], None if bias is None else bias[e], dtype=dtype),
        weight.shape[0],
    )
