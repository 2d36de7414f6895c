"""fused_linear against the fp32 reference: values and gradients, every activation and dtype, both paths.

Each case runs on CPU at small odd shapes (Triton path under the interpreter, fp32 and fp16; torch path
all dtypes) and on CUDA at real shapes (skipped with a reason where there is no GPU). The Triton path runs
with ``SMPTK_POISON_OUTPUTS=1``, so an output element no program writes is NaN and fails the comparison.
Comparisons use ``smptk.testing.assert_close``, whose tolerance is derived from the dtype and the
reduction length (see ``smptk/testing/tolerances.py``).

Legend: M rows of x (all leading dims), K input features, N output features.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    ACTIVATIONS,
    DTYPES,
    act_id,
    autocast_params,
    check_fused_linear,
    device_path_dtype_params,
    dtype_id,
    generator,
    linear_inputs,
    noncontiguous_x,
    randn,
    use_path,
)

from smptk.kernels import fused_linear
from smptk.testing import (
    assert_close,
    linear_error_scales,
    linear_reference,
)

DEVICE_PATH_DTYPE = device_path_dtype_params()

# (M, K, N) per device. CPU: odd sizes around the interpreter's 32-wide tiles (K, N below one tile, one
# tile plus a tail, two tiles plus a tail; M=161 is six row blocks, more than one GROUP_M=4 group).
# CUDA: the sizes of a real MLP layer, N odd.
MAIN_SHAPE = {"cpu": (7, 40, 17), "cuda": (1000, 4096, 1027)}
SHAPES = {
    "cpu": [
        (1, 1, 1),
        (1, 7, 17),
        (7, 17, 1),
        (33, 40, 70),
        (33, 70, 7),
        (7, 1, 40),
        (65, 17, 40),
        (161, 33, 70),
        (97, 129, 65),
    ],
    "cuda": [(1, 4096, 1027), (1000, 4096, 1027), (4097, 1024, 511), (127, 127, 1), (7, 1, 4096)],
}
# The activation exercised at each entry of SHAPES (cycled), so the shapes between them meet every epilogue.
SHAPE_ACTIVATIONS = ("gelu", "silu", "relu", "gelu_tanh", None)


def _shape_params():
    params = []
    for p in DEVICE_PATH_DTYPE:
        device, path, dtype = p.values
        for i, (M, K, N) in enumerate(SHAPES[device]):
            act = SHAPE_ACTIVATIONS[i % len(SHAPE_ACTIVATIONS)]
            params.append(
                pytest.param(
                    device,
                    path,
                    dtype,
                    (M, K, N),
                    act,
                    id=f"{p.id}-M{M}-K{K}-N{N}-{act_id(act)}",
                    marks=p.marks,
                )
            )
    return params


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=act_id)
@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_values_and_grads(monkeypatch, device, path, dtype, activation, bias):
    use_path(monkeypatch, path, device)
    M, K, N = MAIN_SHAPE[device]
    x, w, b = linear_inputs((M, K), N, dtype=dtype, device=device, bias=bias)
    got = check_fused_linear(x, w, b, activation)
    assert set(got) == {"out", "dx", "dweight"} | ({"dbias"} if bias else set())


@pytest.mark.parametrize(("device", "path", "dtype", "shape", "activation"), _shape_params())
def test_odd_shapes(monkeypatch, device, path, dtype, shape, activation):
    use_path(monkeypatch, path, device)
    M, K, N = shape
    x, w, b = linear_inputs((M, K), N, dtype=dtype, device=device, bias=True)
    got = check_fused_linear(x, w, b, activation)
    assert got["out"].shape == (M, N)


@pytest.mark.parametrize(
    "x_shape",
    [(2, 3, 17), (17,), (2, 1, 3, 17)],
    ids=["x-2x3xK", "x-1d", "x-2x1x3xK"],
)
@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_leading_dims(monkeypatch, device, path, dtype, x_shape):
    use_path(monkeypatch, path, device)
    x, w, b = linear_inputs(x_shape, 40, dtype=dtype, device=device, bias=True)
    got = check_fused_linear(x, w, b, "silu")
    assert got["out"].shape == (*x_shape[:-1], 40)
    assert got["dx"].shape == x_shape
    # not a view (as F.linear's is not): FSDP2 warns when a root module returns one (the logits)
    assert not got["out"]._is_view()


@pytest.mark.parametrize("layout", ["transposed", "column-slice", "every-other", "permuted-3d"])
@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_noncontiguous_x(monkeypatch, device, path, dtype, layout):
    use_path(monkeypatch, path, device)
    M, K, N = (33, 40, 17) if device == "cpu" else (1000, 1024, 1027)
    x = noncontiguous_x(layout, M, K, dtype=dtype, device=device)
    _, w, b = linear_inputs((M, K), N, dtype=dtype, device=device, bias=True, seed=2)
    got = check_fused_linear(x, w, b, "gelu")
    assert got["dx"].shape == x.shape


@pytest.mark.parametrize("x_shape", [(0, 17), (3, 0, 17)], ids=["x-0xK", "x-3x0xK"])
@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_zero_rows(monkeypatch, device, path, dtype, x_shape):
    """M = 0: an empty output, an empty dx, and dweight and dbias exactly zero (not NaN, not garbage)."""
    use_path(monkeypatch, path, device)
    x, w, b = linear_inputs(x_shape, 7, dtype=dtype, device=device, bias=True)
    got = check_fused_linear(x, w, b, "gelu")
    assert got["out"].shape == (*x_shape[:-1], 7)
    assert got["dx"].shape == x_shape
    assert torch.equal(got["dweight"], torch.zeros_like(w))
    assert torch.equal(got["dbias"], torch.zeros_like(b))


@pytest.mark.parametrize("grad_layout", ["expanded", "transposed"])
@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_noncontiguous_grad_out(monkeypatch, device, path, dtype, grad_layout):
    """The incoming gradient is not always contiguous: ``y.sum().backward()`` sends an expanded one."""
    use_path(monkeypatch, path, device)
    M, K, N = (33, 40, 17) if device == "cpu" else (1000, 1024, 1027)
    x, w, b = linear_inputs((M, K), N, dtype=dtype, device=device, bias=True)
    if grad_layout == "expanded":
        grad_out = torch.ones((), dtype=dtype, device=device).expand(M, N)
    else:
        grad_out = randn((N, M), dtype=dtype, device=device, gen=generator(device, 3)).t()
    assert not grad_out.is_contiguous()
    got = check_fused_linear(x, w, b, "silu", grad_out=grad_out)
    assert set(got) == {"out", "dx", "dweight", "dbias"}


@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_sum_backward(monkeypatch, device, path, dtype):
    """The usual training call: ``.backward()`` on a scalar loss fills ``.grad`` of every leaf."""
    use_path(monkeypatch, path, device)
    M, K, N = MAIN_SHAPE[device]
    x, w, b = linear_inputs((M, K), N, dtype=dtype, device=device, bias=True)
    fused_linear(x, w, b, activation="gelu_tanh").float().sum().backward()
    ref = [t.detach().float().requires_grad_() for t in (x, w, b)]
    linear_reference(*ref, "gelu_tanh").sum().backward()
    scales = linear_error_scales(x, w, b, "gelu_tanh", torch.ones(M, N, device=device))
    for name, leaf, ref_leaf in zip(("x", "weight", "bias"), (x, w, b), ref, strict=True):
        assert leaf.grad is not None, f"{name}.grad was not filled"
        assert_close(leaf.grad, ref_leaf.grad, dtype=dtype, name=f"d{name}", **scales[name]._asdict())


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=act_id)
@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_forward_without_grad(monkeypatch, device, path, dtype, activation):
    """Inference, under no_grad and with inputs that do not require grad: same values, no graph."""
    use_path(monkeypatch, path, device)
    M, K, N = MAIN_SHAPE[device]
    x, w, b = linear_inputs((M, K), N, dtype=dtype, device=device, bias=True)
    with torch.no_grad():
        out = fused_linear(x, w, b, activation=activation)
    assert out.grad_fn is None and not out.requires_grad
    scales = linear_error_scales(x, w, b, activation)
    assert_close(
        out,
        linear_reference(x.detach(), w.detach(), b.detach(), activation),
        dtype=dtype,
        name="out (no_grad)",
        **scales["out"]._asdict(),
    )
    got = check_fused_linear(x.detach(), w.detach(), b.detach(), activation)
    assert got["out"].grad_fn is None


@pytest.mark.parametrize(
    "wants", [("x",), ("weight",), ("bias",), ("weight", "bias")], ids=lambda w: "grad-" + "+".join(w)
)
@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_partial_grads(monkeypatch, device, path, dtype, wants):
    """Only the inputs that require grad get one, and each of those is right (frozen weights, frozen x)."""
    use_path(monkeypatch, path, device)
    M, K, N = MAIN_SHAPE[device]
    x, w, b = linear_inputs((M, K), N, dtype=dtype, device=device, bias=True)
    for name, t in (("x", x), ("weight", w), ("bias", b)):
        t.requires_grad_(name in wants)
    got = check_fused_linear(x, w, b, "relu")
    assert set(got) == {"out"} | {f"d{name}" for name in wants}


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_relu_keeps_nan(monkeypatch, path):
    """A NaN in x or the bias stays NaN through relu, forward and backward, as with torch.relu (the Triton
    epilogue's max(z, 0) returned 0 for NaN, hiding it from any NaN check)."""
    use_path(monkeypatch, path, "cpu")
    gen = torch.Generator().manual_seed(3)
    x, w, b = (torch.randn(*shape, generator=gen) for shape in ((4, 12), (5, 12), (5,)))
    x[1, 4], b[0] = float("nan"), float("nan")
    ours = [t.clone().requires_grad_() for t in (x, w, b)]
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    y = fused_linear(*ours, activation="relu")
    want = torch.relu(torch.nn.functional.linear(*ref))
    assert y.isnan().sum() == want.isnan().sum() > 0
    torch.testing.assert_close(y, want, equal_nan=True, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    want.square().sum().backward()
    for got, exp in zip(ours, ref, strict=True):
        torch.testing.assert_close(got.grad, exp.grad, equal_nan=True, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "swiglu"])
def test_fp16_pre_activation_overflow_keeps_finite_gradients(monkeypatch, activation):
    """A pre-activation past fp16's 65504 (here -96000, summed in fp32) gives a finite output (the epilogue
    reads the fp32 sum) and was saved for backward as -inf, where act'(z) evaluated to NaN: every gradient
    of the layer was NaN under a finite loss. Now backward takes the derivative's exact tail there (0 for
    these activations), and the gradients equal the fp32 reference's."""
    from smptk.kernels import swiglu

    use_path(monkeypatch, "triton", "cpu")
    x = torch.full((3, 32), 100.0, dtype=torch.float16)
    x[1] = 0.5  # a row that does not overflow
    w = torch.full((4, 32), -30.0, dtype=torch.float16)
    w[2] = 0.01
    ours = [t.clone().requires_grad_() for t in (x, w)]
    ref = [t.float().requires_grad_() for t in (x, w)]
    if activation == "swiglu":
        y = swiglu(ours[0], ours[1], ours[1] * 0 + 0.01)
        g = ref[0] @ ref[1].T
        want = torch.nn.functional.silu(g) * (ref[0] @ (ref[1] * 0 + 0.01).T)
    else:
        y = fused_linear(*ours, activation=activation)
        z = ref[0] @ ref[1].T
        act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
        want = act[activation](z)
    assert y.isfinite().all()
    torch.testing.assert_close(y.float(), want, rtol=2e-3, atol=2e-3)
    y.float().sum().backward()
    want.sum().backward()
    for name, got, exp in zip(("x", "w"), ours, ref, strict=True):
        assert got.grad.isfinite().all(), f"{name}.grad: {got.grad}"
        torch.testing.assert_close(got.grad.float(), exp.grad, rtol=2e-2, atol=2e-2, msg=name)


@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_no_bias_no_bias_grad(monkeypatch, device, path, dtype):
    """bias=None: backward runs and gives dx and dweight; a bias that does not require grad gets none."""
    use_path(monkeypatch, path, device)
    M, K, N = MAIN_SHAPE[device]
    x, w, _ = linear_inputs((M, K), N, dtype=dtype, device=device, bias=False)
    fused_linear(x, w, None, activation="silu").float().sum().backward()
    assert x.grad is not None and w.grad is not None
    x.grad = w.grad = None
    b = torch.zeros(N, dtype=dtype, device=device)  # requires_grad=False
    fused_linear(x, w, b, activation="silu").float().sum().backward()
    assert b.grad is None
    assert x.grad is not None and w.grad is not None
    got = check_fused_linear(x, w, None, "silu")
    assert set(got) == {"out", "dx", "dweight"}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_auto_path_cpu_every_dtype(monkeypatch, dtype):
    """SMPTK_KERNELS=auto (the default) must give right answers on a CPU tensor of every supported dtype,
    whichever path it picks (under the interpreter it picks Triton)."""
    monkeypatch.setenv("SMPTK_KERNELS", "auto")
    x, w, b = linear_inputs((7, 40), 17, dtype=dtype, device="cpu", bias=True)
    check_fused_linear(x, w, b, "gelu")


@pytest.mark.parametrize(("device", "path", "dtype"), autocast_params())
def test_autocast(monkeypatch, device, path, dtype):
    """Inside torch.autocast, fp32 inputs (master weights) run in the autocast dtype, as F.linear would:
    the output has that dtype and matches the reference of the cast inputs; the fp32 leaves get fp32
    gradients carrying the low-precision values."""
    use_path(monkeypatch, path, device)
    M, K, N = MAIN_SHAPE[device]
    x, w, b = linear_inputs((M, K), N, dtype=torch.float32, device=device, bias=True)
    with torch.autocast(device_type=device, dtype=dtype):
        out = fused_linear(x, w, b, activation="gelu")
    assert out.dtype == dtype
    grad_out = randn(out.shape, dtype=dtype, device=device, gen=generator(device, 1))
    grads = torch.autograd.grad(out, [x, w, b], grad_out)
    assert [g.dtype for g in grads] == [torch.float32] * 3
    low = [t.detach().to(dtype) for t in (x, w, b)]
    leaves = [t.float().requires_grad_() for t in low]
    ref = linear_reference(*leaves, "gelu")
    ref_grads = torch.autograd.grad(ref, leaves, grad_out.float())
    scales = linear_error_scales(*low, "gelu", grad_out)
    assert_close(out, ref, dtype=dtype, name="out", **scales["out"]._asdict())
    for name, grad, ref_grad in zip(("x", "weight", "bias"), grads, ref_grads, strict=True):
        # The fp32 gradient is the upcast of a gradient computed in dtype: casting back is exact.
        assert_close(grad.to(dtype), ref_grad, dtype=dtype, name=f"d{name}", **scales[name]._asdict())


def test_autocast_leaves_float64_alone():
    """Autocast casts fp32 / fp16 / bf16 for a linear op and never float64, so F.linear refuses an fp64
    weight or bias beside an autocast input; fused_linear and swiglu cast it to the autocast dtype and
    computed. They refuse it now, naming it."""
    from smptk.kernels import swiglu

    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError):
            torch.nn.functional.linear(x, w.double())  # torch's behaviour, for reference
        with pytest.raises(TypeError, match="weight"):
            fused_linear(x, w.double())
        with pytest.raises(TypeError, match="bias"):
            fused_linear(x, w, b.double())
        with pytest.raises(TypeError, match="weight_gate"):
            swiglu(x, w.double(), w)
        assert fused_linear(x, w, b).dtype == torch.bfloat16


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_fp32_precision_set_through_torchs_new_api(monkeypatch, precision):
    """``torch.backends.cuda.matmul.fp32_precision`` (torch >= 2.9's TF32 switch) makes torch's legacy
    ``allow_tf32`` raise when read; the GEMM engine read that flag, so every fp32 GEMM raised once TF32 was
    turned on this way. The engine follows the setting: tf32 ``tl.dot`` precision for "tf32", IEEE else."""
    from smptk.kernels import _gemm

    use_path(monkeypatch, "triton", "cpu")
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    try:
        matmul.fp32_precision = precision
        x, w, b = linear_inputs((7, 40), 17, dtype=torch.float32, device="cpu", bias=True)
        y = fused_linear(x, w, b, activation="gelu")
        y.sum().backward()
        assert _gemm.input_precision(torch.float32) == precision
        assert _gemm.input_precision(torch.float16) == "tf32"  # 16-bit inputs: the setting does not apply
    finally:
        matmul.fp32_precision = saved


# --- int64 indexing: x with more than 2**31 elements -------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
def test_int64_indexing_cuda(monkeypatch):
    """x has (2**20 + 7) * 2048 = 2**31 + 14336 elements: row offsets times strides pass int32.

    Checks the whole output, dweight and dbias (references computed in row chunks), and dx's first and
    last rows, where a wrapped 32-bit offset would read or write the wrong rows.
    """
    if torch.cuda.mem_get_info()[0] < 24 * 2**30:
        pytest.skip("needs 24 GiB of free GPU memory for a 4.3 GB x, its gradient and the references")
    use_path(monkeypatch, "triton", "cuda")
    M, K, N = 2**20 + 7, 2048, 16
    dtype, act = torch.float16, "silu"
    x, w, b = linear_inputs((M, K), N, dtype=dtype, device="cuda", bias=True)
    assert x.numel() > 2**31
    gen = generator("cuda", 5)
    grad_out = randn((M, N), dtype=dtype, device="cuda", gen=gen)
    out = fused_linear(x, w, b, activation=act)
    dx, dw, db = torch.autograd.grad(out, [x, w, b], grad_out)
    assert torch.isfinite(dx).all(), "dx has NaN/inf (unwritten rows under SMPTK_POISON_OUTPUTS=1?)"

    ref_dw = torch.zeros(N, K, device="cuda")
    ref_db = torch.zeros(N, device="cuda")
    dw_scale2 = torch.zeros(N, K, device="cuda")
    db_scale2 = torch.zeros(N, device="cuda")
    chunk = 2**17
    for start in range(0, M, chunk):
        rows = slice(start, min(start + chunk, M))
        xc = x.detach()[rows]
        wr, br = (t.detach().float().requires_grad_() for t in (w, b))
        ref = linear_reference(xc, wr, br, act)
        scales = linear_error_scales(xc, w, b, act, grad_out[rows])
        assert_close(
            out[rows], ref, dtype=dtype, name=f"out rows {rows.start}:{rows.stop}", **scales["out"]._asdict()
        )
        gw, gb = torch.autograd.grad(ref, [wr, br], grad_out[rows].float())
        ref_dw += gw
        ref_db += gb
        dw_scale2 += scales["weight"].scale.square()
        db_scale2 += scales["bias"].scale.square()
    r = scales["weight"].roundings
    assert_close(
        dw, ref_dw, dtype=dtype, name="dweight", reduction_len=M + K, scale=dw_scale2.sqrt(), roundings=r
    )
    assert_close(
        db, ref_db, dtype=dtype, name="dbias", reduction_len=M + K, scale=db_scale2.sqrt(), roundings=r
    )
    for rows in (slice(0, 64), slice(M - 64, M)):
        xr = x.detach()[rows].float().requires_grad_()
        ref = linear_reference(xr, w, b, act)
        (ref_dx,) = torch.autograd.grad(ref, [xr], grad_out[rows].float())
        scales = linear_error_scales(x[rows], w, b, act, grad_out[rows])
        assert_close(
            dx[rows], ref_dx, dtype=dtype, name=f"dx rows {rows.start}:{rows.stop}", **scales["x"]._asdict()
        )


# --- bad input ----------------------------------------------------------------------------------------

# (id, builder from valid (x, w, b, activation) to the call's arguments, exception, argument named)
BAD_INPUTS = [
    ("x-list", lambda x, w, b, a: (x.tolist(), w, b, a), TypeError, "x"),
    ("x-int32", lambda x, w, b, a: (x.to(torch.int32), w, b, a), TypeError, "x"),
    ("x-float64", lambda x, w, b, a: (x.double(), w, b, a), TypeError, "x"),
    ("x-scalar", lambda x, w, b, a: (x[0, 0], w, b, a), ValueError, "x"),
    ("weight-none", lambda x, w, b, a: (x, None, b, a), TypeError, "weight"),
    ("weight-float16", lambda x, w, b, a: (x, w.half(), b, a), TypeError, "weight"),
    ("weight-1d", lambda x, w, b, a: (x, w[0], b, a), ValueError, "weight"),
    ("weight-3d", lambda x, w, b, a: (x, w[None], b, a), ValueError, "weight"),
    ("weight-wrong-K", lambda x, w, b, a: (x, w[:, :-1], b, a), ValueError, "weight"),
    ("weight-other-device", lambda x, w, b, a: (x, w.to("meta"), b, a), ValueError, "weight"),
    ("bias-list", lambda x, w, b, a: (x, w, b.tolist(), a), TypeError, "bias"),
    ("bias-float16", lambda x, w, b, a: (x, w, b.half(), a), TypeError, "bias"),
    ("bias-wrong-N", lambda x, w, b, a: (x, w, b[:-1], a), ValueError, "bias"),
    ("bias-2d", lambda x, w, b, a: (x, w, b[None], a), ValueError, "bias"),
    ("bias-other-device", lambda x, w, b, a: (x, w, b.to("meta"), a), ValueError, "bias"),
    ("activation-tanh", lambda x, w, b, a: (x, w, b, "tanh"), ValueError, "activation"),
    ("activation-GELU", lambda x, w, b, a: (x, w, b, "GELU"), ValueError, "activation"),
    ("activation-int", lambda x, w, b, a: (x, w, b, 1), ValueError, "activation"),
]


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize(("build", "exc", "arg"), [pytest.param(*c[1:], id=c[0]) for c in BAD_INPUTS])
def test_bad_input(monkeypatch, path, build, exc, arg):
    """Each bad argument raises the documented error type, and the message names that argument."""
    use_path(monkeypatch, path, "cpu")
    x, w, b = (t.detach() for t in linear_inputs((7, 40), 17, dtype=torch.float32, device="cpu", bias=True))
    x_, w_, b_, a_ = build(x, w, b, "gelu")
    with pytest.raises(exc, match=rf"(?<!\w){arg}(?!\w)"):
        fused_linear(x_, w_, b_, activation=a_)


@pytest.mark.gpu
def test_bad_input_cpu_weight_for_cuda_x():
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match=r"(?<!\w)weight(?!\w)"):
        fused_linear(x, torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"(?<!\w)bias(?!\w)"):
        fused_linear(x, torch.randn(3, 8, device="cuda"), torch.zeros(3))
