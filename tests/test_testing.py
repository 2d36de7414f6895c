"""smptk.testing itself: the references are right, and assert_close is loose enough and tight enough.

- References agree with torch.nn.functional where it has the op, and are independent of smptk.kernels.
- Positive controls: torch's own low-precision computations (what a correct kernel does, give or take
  the order of summation) pass assert_close in every dtype, at the kernel tests' shapes and larger.
- Negative controls: the bugs a kernel typically has (a missing bias, a dropped tail column of the K loop,
  an unwritten output column, a wrong activation or activation derivative, a wrong dbias, a swapped
  SwiGLU branch) are rejected in every dtype, at the same shapes.
"""

from __future__ import annotations

import doctest
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, act_id, dtype_id, linear_inputs, swiglu_inputs

from smptk.testing import (
    ACTIVATIONS,
    activation_fn,
    assert_close,
    linear_error_scales,
    linear_reference,
    references,
    relu_kink_mask,
    swiglu_error_scales,
    swiglu_reference,
    tolerance,
    tolerances,
)
from smptk.testing.tolerances import ACTIVATION_BOUNDS, UNIT_ROUNDOFF

TORCH_ACTIVATIONS = {
    None: lambda z: z,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}
SHAPES = [(7, 17, 40), (33, 70, 7), (65, 40, 17)]  # (M, K, N): the CPU kernel tests' sizes
LARGE = (256, 2048, 128)


def _kw(error_scale):
    return error_scale._asdict()


# --- references ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=act_id)
def test_activations_match_torch_functional(activation):
    """Values and derivatives on [-30, 30] (dense near 0), in fp32, against torch.nn.functional in fp64:
    within 4 u_32 * (|f| + |z|), i.e. a few ulp, or a few ulp of z where ``1 + tanh`` cancels."""
    z = torch.cat([torch.linspace(-30, 30, 6001), torch.linspace(-1e-3, 1e-3, 101)])
    z32 = z.clone().requires_grad_()
    z64 = z.double().requires_grad_()
    ours = activation_fn(activation)(z32)
    truth = TORCH_ACTIVATIONS[activation](z64)
    assert ours.dtype == torch.float32
    (d_ours,) = torch.autograd.grad(ours.sum(), z32)
    (d_truth,) = torch.autograd.grad(truth.sum(), z64)
    u_32 = UNIT_ROUNDOFF[torch.float32]
    for what, mine, exact in (("value", ours, truth), ("derivative", d_ours, d_truth)):
        err = (mine.detach().double() - exact.detach()).abs()
        bound = 4 * u_32 * (exact.detach().abs() + z64.detach().abs())
        worst = int((err - bound).argmax())
        assert (err <= bound).all(), (
            f"{what} at z={z[worst].item()}: {mine[worst].item()} vs {exact[worst].item()}"
        )


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=act_id)
@pytest.mark.parametrize(
    "x_shape", [(7, 17), (2, 3, 17), (17,), (0, 17)], ids=lambda s: "x" + "x".join(map(str, s))
)
def test_linear_reference_matches_torch(x_shape, activation, bias):
    x, w, b = linear_inputs(x_shape, 40, dtype=torch.float32, device="cpu", bias=bias)
    ours = linear_reference(x, w, b, activation)
    theirs = TORCH_ACTIVATIONS[activation](F.linear(x, w, b))
    assert ours.shape == (*x_shape[:-1], 40)
    torch.testing.assert_close(ours, theirs)
    g = torch.randn(ours.shape)
    inputs = [t for t in (x, w, b) if t is not None]
    for d_ours, d_theirs in zip(
        torch.autograd.grad(ours, inputs, g), torch.autograd.grad(theirs, inputs, g), strict=True
    ):
        torch.testing.assert_close(d_ours, d_theirs)


@pytest.mark.parametrize("x_shape", [(7, 17), (2, 3, 17), (17,)], ids=lambda s: "x" + "x".join(map(str, s)))
def test_swiglu_reference_matches_torch(x_shape):
    x, wg, wu = swiglu_inputs(x_shape, 40, dtype=torch.float32, device="cpu")
    ours = swiglu_reference(x, wg, wu)
    theirs = F.silu(F.linear(x, wg)) * F.linear(x, wu)
    torch.testing.assert_close(ours, theirs)
    g = torch.randn(ours.shape)
    for d_ours, d_theirs in zip(
        torch.autograd.grad(ours, [x, wg, wu], g), torch.autograd.grad(theirs, [x, wg, wu], g), strict=True
    ):
        torch.testing.assert_close(d_ours, d_theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_references_upcast_exactly_and_return_fp32(dtype):
    """A low-precision input is upcast exactly: the result equals the reference on the fp32 copy."""
    x, w, b = (t.detach() for t in linear_inputs((7, 17), 40, dtype=dtype, device="cpu", bias=True))
    out = linear_reference(x, w, b, "gelu")
    assert out.dtype == torch.float32
    assert torch.equal(out, linear_reference(x.float(), w.float(), b.float(), "gelu"))
    wu = w.flip(0)
    out = swiglu_reference(x, w, wu)
    assert out.dtype == torch.float32
    assert torch.equal(out, swiglu_reference(x.float(), w.float(), wu.float()))


def test_reference_rejects_unknown_activation():
    with pytest.raises(ValueError, match=r"^activation: 'tanh'"):
        linear_reference(torch.ones(2, 3), torch.ones(4, 3), activation="tanh")


def test_reference_rejects_mismatched_weight():
    with pytest.raises(ValueError, match=r"^weight_up:"):
        swiglu_reference(torch.ones(2, 3), torch.ones(4, 3), torch.ones(4, 2))


def test_testing_does_not_import_kernels():
    """References must stay independent of the kernels (and importable before TRITON_INTERPRET is set)."""
    code = "import sys, smptk.testing; assert 'smptk.kernels' not in sys.modules, sorted(sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("module", [references, tolerances], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=flags, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0


# --- the tolerance model's constants -------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
def test_activation_bounds_hold(activation):
    """ACTIVATION_BOUNDS are upper bounds of |f'| and |f''| (re-measured in fp64) and not loose (< 3%)."""
    z = torch.linspace(-20, 20, 400_001, dtype=torch.float64, requires_grad=True)
    y = TORCH_ACTIVATIONS[activation](z)
    (d1,) = torch.autograd.grad(y.sum(), z, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), z)
    slope, curvature = d1.abs().max().item(), d2.abs().max().item()
    bounds = ACTIVATION_BOUNDS[activation]
    assert slope <= bounds.slope < 1.03 * slope
    assert curvature <= bounds.curvature < 1.03 * curvature


def test_unit_roundoff_is_half_epsilon():
    for dtype, u in UNIT_ROUNDOFF.items():
        assert u == torch.finfo(dtype).eps / 2


def test_tolerance_formula():
    t = tolerance(torch.bfloat16, reduction_len=4096, roundings=2)
    assert t.rtol == 2.0**-8
    assert t.scale_coef == pytest.approx(6 * (64 * 2.0**-24 + 2 * 2.0**-8))
    assert t.atol == torch.finfo(torch.bfloat16).smallest_normal * torch.finfo(torch.bfloat16).eps


def test_relu_kink_mask_is_sparse():
    """The relu gradient checks zero grad_out only where z is within rounding of 0: a few percent at
    most, so they still test relu's derivative almost everywhere."""
    for dtype in DTYPES:
        x, w, b = linear_inputs((65, 70), 40, dtype=dtype, device="cpu", bias=True)
        frac = relu_kink_mask(x, w, b, dtype=dtype).float().mean().item()
        assert frac < 0.05, f"{dtype}: {frac:.1%} of the relu gradient would be masked"


# --- positive controls: correct low-precision computations pass ---------------------------------------


def _torch_linear_and_grads(x, w, b, activation, grad_out):
    """What a correct kernel computes: torch in x's dtype (fp32 accumulation inside the GEMMs)."""
    out = TORCH_ACTIVATIONS[activation](F.linear(x, w, b))
    return out, torch.autograd.grad(out, [x, w, b], grad_out)


def _reference_and_grads(x, w, b, activation, grad_out):
    leaves = [t.detach().float().requires_grad_() for t in (x, w, b)]
    out = linear_reference(*leaves, activation)
    return out, torch.autograd.grad(out, leaves, grad_out.float())


def _linear_case(shape, dtype, activation, seed=0):
    M, K, N = shape
    x, w, b = linear_inputs((M, K), N, dtype=dtype, device="cpu", bias=True, seed=seed)
    grad_out = torch.randn(M, N, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    if activation == "relu":
        grad_out = grad_out.masked_fill(relu_kink_mask(x, w, b, dtype=dtype), 0)
    return x, w, b, grad_out


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=act_id)
@pytest.mark.parametrize("shape", [*SHAPES, LARGE], ids=lambda s: "M{}-K{}-N{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_correct_linear_passes(dtype, shape, activation):
    x, w, b, grad_out = _linear_case(shape, dtype, activation)
    out, (dx, dw, db) = _torch_linear_and_grads(x, w, b, activation, grad_out)
    ref, (rdx, rdw, rdb) = _reference_and_grads(x, w, b, activation, grad_out)
    s = linear_error_scales(x, w, b, activation, grad_out)
    assert_close(out, ref, dtype=dtype, name="out", **_kw(s["out"]))
    assert_close(dx, rdx, dtype=dtype, name="dx", **_kw(s["x"]))
    assert_close(dw, rdw, dtype=dtype, name="dweight", **_kw(s["weight"]))
    assert_close(db, rdb, dtype=dtype, name="dbias", **_kw(s["bias"]))


@pytest.mark.parametrize("shape", [*SHAPES, LARGE], ids=lambda s: "M{}-K{}-N{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_correct_swiglu_passes(dtype, shape):
    M, K, N = shape
    x, wg, wu = swiglu_inputs((M, K), N, dtype=dtype, device="cpu")
    grad_out = torch.randn(M, N).to(dtype)
    out = F.silu(F.linear(x, wg)) * F.linear(x, wu)
    grads = torch.autograd.grad(out, [x, wg, wu], grad_out)
    leaves = [t.detach().float().requires_grad_() for t in (x, wg, wu)]
    ref = swiglu_reference(*leaves)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out.float())
    s = swiglu_error_scales(x, wg, wu, grad_out)
    assert_close(out, ref, dtype=dtype, name="out", **_kw(s["out"]))
    for name, g, rg in zip(("x", "weight_gate", "weight_up"), grads, ref_grads, strict=True):
        assert_close(g, rg, dtype=dtype, name=f"d{name}", **_kw(s[name]))


# --- negative controls: typical kernel bugs are rejected ----------------------------------------------


def _rejects(actual, expected, **kwargs):
    with pytest.raises(AssertionError, match=r"outside the tolerance|NaN"):
        assert_close(actual, expected, **kwargs)


@pytest.mark.parametrize("activation", [None, "gelu", "silu"], ids=act_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}-K{}-N{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rejects_missing_bias(dtype, shape, activation):
    x, w, b, _ = _linear_case(shape, dtype, activation)
    s = linear_error_scales(x, w, b, activation)["out"]
    buggy = TORCH_ACTIVATIONS[activation](F.linear(x, w)).detach()
    _rejects(buggy, linear_reference(x, w, b, activation), dtype=dtype, name="out", **_kw(s))


@pytest.mark.parametrize("dropped", [1, "tail"], ids=["last-column", "last-partial-tile"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}-K{}-N{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rejects_dropped_k_tail(dtype, shape, dropped):
    """A K loop that skips its masked tail: the last column of K, or the last K % 32 columns."""
    x, w, b, _ = _linear_case(shape, dtype, None)
    K = x.shape[-1]
    keep = K - (dropped if dropped == 1 else (K % 32 or 32))
    s = linear_error_scales(x, w, b)["out"]
    buggy = F.linear(x[:, :keep], w[:, :keep], b).detach()
    _rejects(buggy, linear_reference(x, w, b), dtype=dtype, name="out", **_kw(s))


@pytest.mark.parametrize("fill", [0.0, math.nan], ids=["zero", "nan"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rejects_unwritten_output_column(dtype, fill):
    """The last output column never stored: stale zeros, or the NaN of SMPTK_POISON_OUTPUTS=1."""
    x, w, b, _ = _linear_case(SHAPES[0], dtype, "gelu")
    s = linear_error_scales(x, w, b, "gelu")["out"]
    buggy = F.gelu(F.linear(x, w, b)).detach()
    buggy[:, -1] = fill
    _rejects(buggy, linear_reference(x, w, b, "gelu"), dtype=dtype, name="out", **_kw(s))


WRONG_DERIVATIVES = {
    # silu'(z) = s(1 + z(1 - s)); the bug forgets the second term.
    "silu": lambda z: torch.sigmoid(z),
    # gelu'(z) = Phi(z) + z phi(z); the bug forgets z phi(z).
    "gelu": lambda z: 0.5 * (1 + torch.erf(z / math.sqrt(2))),
    # relu'(z) = [z > 0]; the bug passes the gradient everywhere.
    "relu": lambda z: torch.ones_like(z),
}


@pytest.mark.parametrize("activation", list(WRONG_DERIVATIVES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}-K{}-N{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rejects_wrong_activation_derivative(dtype, shape, activation):
    """dz = dy * wrong'(z), rounded to dtype, fed to dx = dz @ w, dw = dz.T @ x and db = sum(dz)."""
    x, w, b, grad_out = _linear_case(shape, dtype, activation)
    _, (rdx, rdw, rdb) = _reference_and_grads(x, w, b, activation, grad_out)
    s = linear_error_scales(x, w, b, activation, grad_out)
    with torch.no_grad():
        z = F.linear(x, w, b)
        dz = (grad_out.float() * WRONG_DERIVATIVES[activation](z.float())).to(dtype)
        _rejects(dz @ w, rdx, dtype=dtype, name="dx", **_kw(s["x"]))
        _rejects(dz.t() @ x, rdw, dtype=dtype, name="dweight", **_kw(s["weight"]))
        _rejects(dz.float().sum(0).to(dtype), rdb, dtype=dtype, name="dbias", **_kw(s["bias"]))


@pytest.mark.parametrize("activation", ["gelu", "silu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rejects_dbias_without_activation_derivative(dtype, activation):
    """db = sum(dy) instead of sum(dy * act'(z))."""
    x, w, b, grad_out = _linear_case(SHAPES[2], dtype, activation)
    _, (_, _, rdb) = _reference_and_grads(x, w, b, activation, grad_out)
    s = linear_error_scales(x, w, b, activation, grad_out)["bias"]
    _rejects(grad_out.float().sum(0).to(dtype), rdb, dtype=dtype, name="dbias", **_kw(s))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}-K{}-N{}".format(*s))
def test_rejects_gelu_tanh_for_gelu_in_fp32(shape):
    """In fp32 the tolerance separates exact GELU from its tanh approximation (max gap 5e-4); in fp16 and
    bf16 the gap is below one rounding and no test can tell them apart at these magnitudes."""
    x, w, b, _ = _linear_case(shape, torch.float32, "gelu")
    s = linear_error_scales(x, w, b, "gelu")["out"]
    buggy = F.gelu(F.linear(x, w, b), approximate="tanh").detach()
    _rejects(buggy, linear_reference(x, w, b, "gelu"), dtype=torch.float32, name="out", **_kw(s))


SWIGLU_BUGS = {
    "gate-and-up-swapped": lambda g, u: F.silu(u) * g,
    "silu-missing": lambda g, u: g * u,
}


@pytest.mark.parametrize("bug", list(SWIGLU_BUGS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}-K{}-N{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rejects_swiglu_forward_bugs(dtype, shape, bug):
    M, K, N = shape
    x, wg, wu = (t.detach() for t in swiglu_inputs((M, K), N, dtype=dtype, device="cpu"))
    s = swiglu_error_scales(x, wg, wu)["out"]
    buggy = SWIGLU_BUGS[bug](F.linear(x, wg), F.linear(x, wu))
    _rejects(buggy, swiglu_reference(x, wg, wu), dtype=dtype, name="out", **_kw(s))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "M{}-K{}-N{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rejects_swiglu_dx_missing_up_branch(dtype, shape):
    """dx = dg @ w_gate alone, without + du @ w_up (a dropped second operand pair)."""
    M, K, N = shape
    x, wg, wu = swiglu_inputs((M, K), N, dtype=dtype, device="cpu")
    grad_out = torch.randn(M, N).to(dtype)
    leaves = [t.detach().float().requires_grad_() for t in (x, wg, wu)]
    (rdx,) = torch.autograd.grad(swiglu_reference(*leaves), leaves[:1], grad_out.float())
    s = swiglu_error_scales(x, wg, wu, grad_out)["x"]
    with torch.no_grad():
        g, u = F.linear(x, wg).float(), F.linear(x, wu).float()
        sig = torch.sigmoid(g)
        dg = (grad_out.float() * u * sig * (1 + g * (1 - sig))).to(dtype)
        _rejects(dg @ wg, rdx, dtype=dtype, name="dx", **_kw(s))


# --- assert_close's contract -------------------------------------------------------------------------


def test_message_names_the_worst_element():
    expected = torch.zeros(3, 4)
    actual = torch.zeros(3, 4)
    actual[1, 2] = 0.5
    with pytest.raises(AssertionError) as info:
        assert_close(actual, expected, dtype=torch.float32, reduction_len=16, name="dweight", scale=1.0)
    msg = str(info.value)
    assert msg.startswith("dweight: 1 of 12 elements outside the tolerance")
    assert "worst at index (1, 2): actual=0.5, expected=0" in msg
    assert "max |error| = 0.5 at index (1, 2)" in msg
    assert "tolerance = " in msg


def test_nan_where_reference_is_finite_is_reported_as_such():
    actual = torch.ones(2, 3, dtype=torch.float16)
    actual[1, 1] = math.nan
    with pytest.raises(AssertionError, match=r"1 of 6 elements are NaN/inf.*\n.*index \(1, 1\)"):
        assert_close(actual, torch.ones(2, 3), dtype=torch.float16, reduction_len=8, name="out")


def test_wrong_dtype_or_shape_is_rejected():
    with pytest.raises(AssertionError, match=r"dtype torch\.float32, expected torch\.bfloat16"):
        assert_close(torch.ones(2), torch.ones(2), dtype=torch.bfloat16, reduction_len=1, name="out")
    with pytest.raises(AssertionError, match=r"shape \(2, 1\), expected \(2,\)"):
        assert_close(torch.ones(2, 1), torch.ones(2), dtype=torch.float32, reduction_len=1, name="out")


def test_empty_tensors_compare_equal():
    assert_close(torch.empty(0, 5), torch.empty(0, 5), dtype=torch.float32, reduction_len=3, name="out")


def test_rounding_to_dtype_is_always_within_tolerance():
    """The final rounding alone, (1) of the model, passes even with scale 0: rtol is exactly u_d."""
    expected = torch.randn(10_000) * torch.logspace(-7, 4, 10_000)  # inside fp16 range
    for dtype in DTYPES:
        assert_close(expected.to(dtype), expected, dtype=dtype, reduction_len=1, name=str(dtype), scale=0.0)


# --- the references' own edges (found by fuzzing the kernels against fp64) -----------------------------


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
def test_reference_derivatives_keep_their_relative_accuracy_in_the_tails(activation):
    """Where the derivative is tiny (z from -9 to -3) the reference's stays within 1e-4 of fp64 relative to
    itself: gelu_tanh written with 1 + tanh was 30% off at z = -5 and 0 below -5.5, and rejected kernels
    that evaluate the tail stably."""
    z = torch.linspace(-9, -3, 601)
    z32, z64 = z.clone().requires_grad_(), z.double().requires_grad_()
    (mine,) = torch.autograd.grad(activation_fn(activation)(z32).sum(), z32)
    stable = {
        "gelu": lambda t: 0.5 * t * torch.erfc(-t / math.sqrt(2)),
        "gelu_tanh": lambda t: t * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (t + 0.044715 * t**3)),
        "silu": lambda t: t * torch.sigmoid(t),
    }[activation]
    (truth,) = torch.autograd.grad(stable(z64).sum(), z64)
    normal = truth.abs() > torch.finfo(torch.float32).tiny
    rel = ((mine.double() - truth).abs() / truth.abs())[normal]
    assert normal.sum() > 300 and rel.max() < 1e-4, f"worst relative error {rel.max().item():.3g}"


def test_relu_reference_and_assert_close_keep_nan() -> None:
    """relu keeps NaN (as torch.relu and the kernels do), and a kernel that turns a NaN into 0 fails."""
    z = torch.tensor([-1.0, 0.0, 2.0, math.nan])
    out = references.relu(z)
    assert torch.equal(out[:3], torch.tensor([0.0, 0.0, 2.0])) and out[3].isnan()
    expected = torch.tensor([1.0, math.nan, math.inf])
    assert_close(expected.clone(), expected, dtype=torch.float32, reduction_len=2, name="y")
    for wrong in ([1.0, 0.0, math.inf], [1.0, math.nan, -math.inf], [1.0, math.inf, math.inf]):
        with pytest.raises(AssertionError, match="non-finite reference values are not reproduced"):
            assert_close(torch.tensor(wrong), expected, dtype=torch.float32, reduction_len=2, name="y")


def test_sigmoid_routing_reference_has_finite_gradients_for_very_negative_logits() -> None:
    """1 / (1 + exp(-s)) overflowed below s = -88.7, and its gradient was NaN (inf / inf)."""
    from smptk.testing.moe import moe_route_reference

    logits = torch.tensor([[2.0, -100.0, 0.5, 1.0], [-200.0, 3.0, 0.0, -1.0]], requires_grad=True)
    ref = moe_route_reference(logits, 2, score_func="sigmoid")
    (g,) = torch.autograd.grad(ref.aux_loss + ref.weights.sum(), logits)
    assert torch.isfinite(g).all(), g


def test_error_scales_take_an_empty_reduction() -> None:
    """K = 0 (fused_linear returns the bias, or zeros): the error scales exist too (reshape(-1, 0) failed)."""
    x, w, wu = torch.empty(3, 0), torch.empty(4, 0), torch.empty(4, 0)
    s = linear_error_scales(x, w, torch.zeros(4), "gelu", torch.ones(3, 4))
    assert (
        s["out"].scale.shape == (3, 4) and s["x"].scale.shape == (3, 0) and s["weight"].scale.shape == (4, 0)
    )
    assert swiglu_error_scales(x, w, wu, torch.ones(3, 4))["x"].scale.shape == (3, 0)
    assert relu_kink_mask(x, w, dtype=torch.float16).shape == (3, 4)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
def test_one_row_gradients_pass_with_the_derivatives_own_error(activation):
    """One row (a MoE expert with one token): dweight's terms are dy * f'(z) * x with no sum to average
    f'(z)'s evaluation error away, and where f' is tiny (z far below 0) torch's fp32 f'(z), like a
    kernel's, is a few u_32 off absolutely: the model's derivative_error admits it (19 of 20 seeds failed
    for gelu without it)."""
    for seed in range(8):
        gen = torch.Generator().manual_seed(seed)
        # unscaled randn: z has a standard deviation of sqrt(32), so a third of the outputs sit in the tail
        x, w, b, grad_out = (
            torch.randn(*shape, generator=gen) for shape in ((1, 32), (16, 32), (16,), (1, 16))
        )
        x, w, b = (t.requires_grad_() for t in (x, w, b))
        _, (dx, dw, db) = _torch_linear_and_grads(x, w, b, activation, grad_out)
        _, (rdx, rdw, rdb) = _reference_and_grads(x, w, b, activation, grad_out)
        s = linear_error_scales(x, w, b, activation, grad_out)
        assert_close(dx, rdx, dtype=torch.float32, name=f"dx seed {seed}", **_kw(s["x"]))
        assert_close(dw, rdw, dtype=torch.float32, name=f"dweight seed {seed}", **_kw(s["weight"]))
        assert_close(db, rdb, dtype=torch.float32, name=f"dbias seed {seed}", **_kw(s["bias"]))


def test_a_nan_or_infinite_tolerance_is_refused() -> None:
    """``err > bound`` is False for a NaN bound, and an infinite one holds anything: both passed any finite
    result (5.0 for 1.0 with scale NaN). They now fail, naming the tolerance. The error scales square in
    fp64, so finite inputs past 1.8e19 no longer overflow the scale to inf (1234.0 passed for 2.0)."""
    expected = torch.tensor([1.0])
    for scale in (float("nan"), float("inf")):
        with pytest.raises(AssertionError, match=r"tolerance is .* it would accept any value"):
            assert_close(
                torch.tensor([5.0]), expected, dtype=torch.float32, reduction_len=1, scale=scale, name="y"
            )
    x, w = torch.tensor([[1e20, 1.0]]), torch.tensor([[1e-20, 1.0]])
    scales = linear_error_scales(x, w)["out"]
    assert torch.isfinite(scales.scale).all()
    with pytest.raises(AssertionError, match="outside the tolerance"):
        assert_close(
            torch.tensor([[1234.0]]),
            linear_reference(x, w),
            dtype=torch.float32,
            name="y",
            **scales._asdict(),
        )


def test_references_keep_infinities_as_torch() -> None:
    """relu(+-inf) and gelu_tanh(+inf) are torch's (inf, 0, inf), not the NaN of inf * 0; relu keeps NaN
    with derivative 0, as torch.relu."""
    from smptk.testing.references import gelu_tanh, relu

    z = torch.tensor([float("inf"), -float("inf"), 2.0, -3.0])
    assert torch.equal(relu(z), torch.relu(z))
    assert gelu_tanh(z)[0] == float("inf")
    torch.testing.assert_close(gelu_tanh(z[2:]), F.gelu(z[2:], approximate="tanh"))
    leaf = torch.tensor([float("nan"), 1.0, -1.0], requires_grad=True)
    relu(leaf).sum().backward()
    assert leaf.grad.tolist() == [0.0, 1.0, 0.0]


def test_references_refuse_what_they_cannot_compute() -> None:
    """top_k past E picked expert 0 again (argmax of an empty row), offsets for fewer experts than the
    weights ignored the rest, a negative capacity factor gave a negative capacity."""
    from smptk.testing import grouped_linear_reference, moe_route_reference
    from smptk.testing.moe import moe_capacity_reference

    with pytest.raises(ValueError, match="top_k"):
        moe_route_reference(torch.randn(1, 3), 5)
    with pytest.raises(ValueError, match="offsets"):
        grouped_linear_reference(torch.randn(4, 2), torch.randn(3, 5, 2), [0, 2, 4])
    with pytest.raises(ValueError, match="capacity_factor"):
        moe_capacity_reference(-1.0, 4, 2, 3)
