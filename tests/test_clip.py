"""``smptk.parallel.clip_grad_norm_`` on plain tensors: torch's results, every norm type, its errors. The
multi-mesh case (tp, dp and ep DTensors in one model, where torch's refuses) is checked against torch's on
the plain model in every multi-rank transform case (``tests/transform_jobs.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from smptk.parallel import clip_grad_norm_


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((3, 4), (5,), (2, 2, 2))]
    for p in params[:2]:  # the last has no gradient: skipped
        p.grad = torch.randn(p.shape, generator=gen)
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.5, math.inf])
@pytest.mark.parametrize("max_norm", [0.1, 1e3, 0.0])
def test_matches_torch_on_plain_tensors(norm_type: float, max_norm: float) -> None:
    ours, theirs = _params(0), _params(0)
    total = clip_grad_norm_(ours, max_norm, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    torch.testing.assert_close(total, want)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)


def test_edge_cases_and_errors() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    assert clip_grad_norm_(p, 1.0).item() == 0.0  # no gradient at all
    p.grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm_(p, 1.0).item() == pytest.approx(5.0)  # one tensor, not a list
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.8]), rtol=1e-5, atol=1e-6)
    p.grad = torch.tensor([math.nan, 1.0])
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(p, 1.0, error_if_nonfinite=True)
    for bad in (-1.0, True, "1"):
        with pytest.raises(ValueError, match="max_norm: expected a number >= 0"):
            clip_grad_norm_(p, bad)


def test_max_norm_forms_norm_zero_and_the_result_dtype() -> None:
    """A one-element tensor or a NumPy float as max_norm works as in torch's (they were refused); a NaN
    max_norm is refused (it made every gradient NaN); norm_type 0, which torch takes to count the nonzero
    gradients, is refused (it raised ZeroDivisionError); fp64 gradients get an fp64 norm (it was computed in
    fp32)."""
    import numpy as np

    for max_norm in (torch.tensor(1.0), torch.tensor([1.0]), np.float32(1.0)):
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.tensor([3.0, 4.0])
        assert clip_grad_norm_(p, max_norm).item() == pytest.approx(5.0)
        torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.8]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="max_norm: expected a number >= 0, got nan"):
        clip_grad_norm_(p, math.nan)
    with pytest.raises(ValueError, match="norm_type: 0 is not a norm to clip by"):
        clip_grad_norm_(p, 1.0, norm_type=0)
    q, r = (torch.nn.Parameter(torch.ones(2, dtype=torch.float64)) for _ in range(2))
    q.grad, r.grad = (torch.tensor([1.0, 1e-4], dtype=torch.float64) for _ in range(2))
    total = clip_grad_norm_(q, 10.0)
    want = torch.nn.utils.clip_grad_norm_(r, 10.0)
    assert total.dtype == torch.float64 and total.item() == want.item() == math.sqrt(1 + 1e-8) != 1.0
