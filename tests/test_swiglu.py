"""swiglu against the fp32 reference: values and gradients, every dtype, both paths.

Same structure as test_fused_linear.py: CPU at small odd shapes (Triton under the interpreter in fp32 and
fp16, torch path in every dtype), CUDA at real shapes (skipped with a reason without a GPU), the Triton
path with ``SMPTK_POISON_OUTPUTS=1``, comparisons through ``smptk.testing.assert_close``.

Legend: M rows of x (all leading dims), K hidden size, N intermediate size.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    DTYPES,
    autocast_params,
    check_swiglu,
    device_path_dtype_params,
    dtype_id,
    generator,
    noncontiguous_x,
    randn,
    swiglu_inputs,
    use_path,
)

from smptk.kernels import swiglu
from smptk.testing import assert_close, swiglu_error_scales, swiglu_reference

DEVICE_PATH_DTYPE = device_path_dtype_params()

# (M, K, N) per device; see test_fused_linear.py. CUDA: a Llama-style MLP slice, N odd.
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


def _shape_params():
    params = []
    for p in DEVICE_PATH_DTYPE:
        for M, K, N in SHAPES[p.values[0]]:
            params.append(pytest.param(*p.values, (M, K, N), id=f"{p.id}-M{M}-K{K}-N{N}", marks=p.marks))
    return params


@pytest.mark.parametrize(("device", "path", "dtype", "shape"), _shape_params())
def test_values_and_grads(monkeypatch, device, path, dtype, shape):
    use_path(monkeypatch, path, device)
    M, K, N = shape
    got = check_swiglu(*swiglu_inputs((M, K), N, dtype=dtype, device=device))
    assert set(got) == {"out", "dx", "dweight_gate", "dweight_up"}


@pytest.mark.parametrize(
    "x_shape",
    [(2, 3, 17), (17,), (2, 1, 3, 17)],
    ids=["x-2x3xK", "x-1d", "x-2x1x3xK"],
)
@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_leading_dims(monkeypatch, device, path, dtype, x_shape):
    use_path(monkeypatch, path, device)
    got = check_swiglu(*swiglu_inputs(x_shape, 40, dtype=dtype, device=device))
    assert got["out"].shape == (*x_shape[:-1], 40)
    assert got["dx"].shape == x_shape
    assert not got["out"]._is_view()  # FSDP2 warns when a root module returns a view


@pytest.mark.parametrize("layout", ["transposed", "column-slice", "every-other", "permuted-3d"])
@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_noncontiguous_x(monkeypatch, device, path, dtype, layout):
    use_path(monkeypatch, path, device)
    M, K, N = (33, 40, 17) if device == "cpu" else (1000, 1024, 1027)
    x = noncontiguous_x(layout, M, K, dtype=dtype, device=device)
    _, wg, wu = swiglu_inputs((M, K), N, dtype=dtype, device=device, seed=2)
    got = check_swiglu(x, wg, wu)
    assert got["dx"].shape == x.shape


@pytest.mark.parametrize("x_shape", [(0, 17), (3, 0, 17)], ids=["x-0xK", "x-3x0xK"])
@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_zero_rows(monkeypatch, device, path, dtype, x_shape):
    """M = 0: an empty output and dx, and both weight gradients exactly zero."""
    use_path(monkeypatch, path, device)
    x, wg, wu = swiglu_inputs(x_shape, 7, dtype=dtype, device=device)
    got = check_swiglu(x, wg, wu)
    assert got["out"].shape == (*x_shape[:-1], 7)
    assert got["dx"].shape == x_shape
    assert torch.equal(got["dweight_gate"], torch.zeros_like(wg))
    assert torch.equal(got["dweight_up"], torch.zeros_like(wu))


@pytest.mark.parametrize("grad_layout", ["expanded", "transposed"])
@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_noncontiguous_grad_out(monkeypatch, device, path, dtype, grad_layout):
    use_path(monkeypatch, path, device)
    M, K, N = (33, 40, 17) if device == "cpu" else (1000, 1024, 1027)
    x, wg, wu = swiglu_inputs((M, K), N, dtype=dtype, device=device)
    if grad_layout == "expanded":
        grad_out = torch.ones((), dtype=dtype, device=device).expand(M, N)
    else:
        grad_out = randn((N, M), dtype=dtype, device=device, gen=generator(device, 3)).t()
    assert not grad_out.is_contiguous()
    got = check_swiglu(x, wg, wu, grad_out=grad_out)
    assert set(got) == {"out", "dx", "dweight_gate", "dweight_up"}


@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_forward_without_grad(monkeypatch, device, path, dtype):
    use_path(monkeypatch, path, device)
    M, K, N = MAIN_SHAPE[device]
    x, wg, wu = swiglu_inputs((M, K), N, dtype=dtype, device=device)
    with torch.no_grad():
        out = swiglu(x, wg, wu)
    assert out.grad_fn is None and not out.requires_grad
    scales = swiglu_error_scales(x, wg, wu)
    assert_close(
        out,
        swiglu_reference(x.detach(), wg.detach(), wu.detach()),
        dtype=dtype,
        name="out (no_grad)",
        **scales["out"]._asdict(),
    )
    got = check_swiglu(x.detach(), wg.detach(), wu.detach())
    assert got["out"].grad_fn is None


@pytest.mark.parametrize(
    "wants",
    [("x",), ("weight_gate",), ("weight_up",), ("weight_gate", "weight_up")],
    ids=lambda w: "grad-" + "+".join(w),
)
@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_partial_grads(monkeypatch, device, path, dtype, wants):
    use_path(monkeypatch, path, device)
    M, K, N = MAIN_SHAPE[device]
    x, wg, wu = swiglu_inputs((M, K), N, dtype=dtype, device=device)
    for name, t in (("x", x), ("weight_gate", wg), ("weight_up", wu)):
        t.requires_grad_(name in wants)
    got = check_swiglu(x, wg, wu)
    assert set(got) == {"out"} | {f"d{name}" for name in wants}


@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_sum_backward(monkeypatch, device, path, dtype):
    use_path(monkeypatch, path, device)
    M, K, N = MAIN_SHAPE[device]
    x, wg, wu = swiglu_inputs((M, K), N, dtype=dtype, device=device)
    swiglu(x, wg, wu).float().sum().backward()
    ref = [t.detach().float().requires_grad_() for t in (x, wg, wu)]
    swiglu_reference(*ref).sum().backward()
    scales = swiglu_error_scales(x, wg, wu, torch.ones(M, N, device=device))
    for name, leaf, ref_leaf in zip(("x", "weight_gate", "weight_up"), (x, wg, wu), ref, strict=True):
        assert leaf.grad is not None, f"{name}.grad was not filled"
        assert_close(leaf.grad, ref_leaf.grad, dtype=dtype, name=f"d{name}", **scales[name]._asdict())


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_auto_path_cpu_every_dtype(monkeypatch, dtype):
    """SMPTK_KERNELS=auto must give right answers on a CPU tensor of every supported dtype."""
    monkeypatch.setenv("SMPTK_KERNELS", "auto")
    check_swiglu(*swiglu_inputs((7, 40), 17, dtype=dtype, device="cpu"))


@pytest.mark.parametrize(("device", "path", "dtype"), autocast_params())
def test_autocast(monkeypatch, device, path, dtype):
    """Inside torch.autocast, fp32 inputs run in the autocast dtype (see test_fused_linear.py's twin)."""
    use_path(monkeypatch, path, device)
    M, K, N = MAIN_SHAPE[device]
    x, wg, wu = swiglu_inputs((M, K), N, dtype=torch.float32, device=device)
    with torch.autocast(device_type=device, dtype=dtype):
        out = swiglu(x, wg, wu)
    assert out.dtype == dtype
    grad_out = randn(out.shape, dtype=dtype, device=device, gen=generator(device, 1))
    grads = torch.autograd.grad(out, [x, wg, wu], grad_out)
    assert [g.dtype for g in grads] == [torch.float32] * 3
    low = [t.detach().to(dtype) for t in (x, wg, wu)]
    leaves = [t.float().requires_grad_() for t in low]
    ref = swiglu_reference(*leaves)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out.float())
    scales = swiglu_error_scales(*low, grad_out)
    assert_close(out, ref, dtype=dtype, name="out", **scales["out"]._asdict())
    for name, grad, ref_grad in zip(("x", "weight_gate", "weight_up"), grads, ref_grads, strict=True):
        assert_close(grad.to(dtype), ref_grad, dtype=dtype, name=f"d{name}", **scales[name]._asdict())


@pytest.mark.gpu
@pytest.mark.slow
def test_int64_indexing_cuda(monkeypatch):
    """x has (2**20 + 7) * 2048 = 2**31 + 14336 elements; see test_fused_linear.py's twin.

    Checks the whole output and both weight gradients (references in row chunks), and dx's first and last
    rows.
    """
    if torch.cuda.mem_get_info()[0] < 24 * 2**30:
        pytest.skip("needs 24 GiB of free GPU memory for a 4.3 GB x, its gradient and the references")
    use_path(monkeypatch, "triton", "cuda")
    M, K, N = 2**20 + 7, 2048, 16
    dtype = torch.float16
    x, wg, wu = swiglu_inputs((M, K), N, dtype=dtype, device="cuda")
    assert x.numel() > 2**31
    grad_out = randn((M, N), dtype=dtype, device="cuda", gen=generator("cuda", 5))
    out = swiglu(x, wg, wu)
    dx, dwg, dwu = torch.autograd.grad(out, [x, wg, wu], grad_out)
    assert torch.isfinite(dx).all(), "dx has NaN/inf (unwritten rows under SMPTK_POISON_OUTPUTS=1?)"

    ref_dwg = torch.zeros(N, K, device="cuda")
    ref_dwu = torch.zeros(N, K, device="cuda")
    dwg_scale2 = torch.zeros(N, K, device="cuda")
    dwu_scale2 = torch.zeros(N, K, device="cuda")
    chunk = 2**17
    for start in range(0, M, chunk):
        rows = slice(start, min(start + chunk, M))
        xc = x.detach()[rows]
        wgr, wur = (t.detach().float().requires_grad_() for t in (wg, wu))
        ref = swiglu_reference(xc, wgr, wur)
        scales = swiglu_error_scales(xc, wg, wu, grad_out[rows])
        assert_close(
            out[rows], ref, dtype=dtype, name=f"out rows {rows.start}:{rows.stop}", **scales["out"]._asdict()
        )
        gwg, gwu = torch.autograd.grad(ref, [wgr, wur], grad_out[rows].float())
        ref_dwg += gwg
        ref_dwu += gwu
        dwg_scale2 += scales["weight_gate"].scale.square()
        dwu_scale2 += scales["weight_up"].scale.square()
    r = scales["weight_gate"].roundings
    assert_close(
        dwg,
        ref_dwg,
        dtype=dtype,
        name="dweight_gate",
        reduction_len=M + K,
        scale=dwg_scale2.sqrt(),
        roundings=r,
    )
    assert_close(
        dwu,
        ref_dwu,
        dtype=dtype,
        name="dweight_up",
        reduction_len=M + K,
        scale=dwu_scale2.sqrt(),
        roundings=r,
    )
    for rows in (slice(0, 64), slice(M - 64, M)):
        xr = x.detach()[rows].float().requires_grad_()
        (ref_dx,) = torch.autograd.grad(swiglu_reference(xr, wg, wu), [xr], grad_out[rows].float())
        scales = swiglu_error_scales(x[rows], wg, wu, grad_out[rows])
        assert_close(
            dx[rows], ref_dx, dtype=dtype, name=f"dx rows {rows.start}:{rows.stop}", **scales["x"]._asdict()
        )


# (id, builder from valid (x, weight_gate, weight_up) to the call's arguments, exception, argument named)
BAD_INPUTS = [
    ("x-list", lambda x, g, u: (x.tolist(), g, u), TypeError, "x"),
    ("x-int32", lambda x, g, u: (x.to(torch.int32), g, u), TypeError, "x"),
    ("x-float64", lambda x, g, u: (x.double(), g, u), TypeError, "x"),
    ("x-scalar", lambda x, g, u: (x[0, 0], g, u), ValueError, "x"),
    ("weight_gate-none", lambda x, g, u: (x, None, u), TypeError, "weight_gate"),
    ("weight_gate-float16", lambda x, g, u: (x, g.half(), u), TypeError, "weight_gate"),
    ("weight_gate-1d", lambda x, g, u: (x, g[0], u), ValueError, "weight_gate"),
    ("weight_gate-wrong-K", lambda x, g, u: (x, g[:, :-1], u), ValueError, "weight_gate"),
    ("weight_gate-other-device", lambda x, g, u: (x, g.to("meta"), u), ValueError, "weight_gate"),
    ("weight_up-none", lambda x, g, u: (x, g, None), TypeError, "weight_up"),
    ("weight_up-bfloat16", lambda x, g, u: (x, g, u.bfloat16()), TypeError, "weight_up"),
    ("weight_up-3d", lambda x, g, u: (x, g, u[None]), ValueError, "weight_up"),
    ("weight_up-wrong-K", lambda x, g, u: (x, g, u[:, :-1]), ValueError, "weight_up"),
    ("weight_up-wrong-N", lambda x, g, u: (x, g, u[:-1]), ValueError, "weight_up"),
    ("weight_up-other-device", lambda x, g, u: (x, g, u.to("meta")), ValueError, "weight_up"),
]


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize(("build", "exc", "arg"), [pytest.param(*c[1:], id=c[0]) for c in BAD_INPUTS])
def test_bad_input(monkeypatch, path, build, exc, arg):
    """Each bad argument raises the documented error type, and the message names that argument."""
    use_path(monkeypatch, path, "cpu")
    x, wg, wu = (t.detach() for t in swiglu_inputs((7, 40), 17, dtype=torch.float32, device="cpu"))
    with pytest.raises(exc, match=rf"(?<!\w){arg}(?!\w)"):
        swiglu(*build(x, wg, wu))


@pytest.mark.gpu
def test_bad_input_cpu_weight_for_cuda_x():
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match=r"(?<!\w)weight_gate(?!\w)"):
        swiglu(x, torch.randn(3, 8), torch.randn(3, 8, device="cuda"))
    with pytest.raises(ValueError, match=r"(?<!\w)weight_up(?!\w)"):
        swiglu(x, torch.randn(3, 8, device="cuda"), torch.randn(3, 8))
