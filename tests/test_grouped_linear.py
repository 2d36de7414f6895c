"""grouped_linear / grouped_swiglu against the per-expert fp32 reference: values and gradients, both paths.

CPU cases run the Triton kernels under the interpreter (fp32, fp16; bf16 only on CUDA) with
``SMPTK_POISON_OUTPUTS=1``, so a row or column no program writes is NaN and fails; the torch path runs in
every dtype. Expert boundaries sit inside the interpreter's 32-row tiles, so a tile that straddled two
experts would multiply rows by the wrong weight. Tolerances come from ``smptk.testing`` (dtype and reduction
length, expert by expert: ``smptk/testing/grouped.py``); empty experts' weight and bias gradients must be
exactly zero (``torch.equal``). The index math past 2^31 is checked through a tiny kernel over the same
``@triton.jit`` helpers, with offsets near 6e9 and no memory behind them.

Legend: T rows, K input features, N output features, E experts; counts = rows per expert.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import triton
import triton.language as tl
from helpers import (
    ACTIVATIONS,
    DEVICES,
    NO_INTERPRETER_REASON,
    act_id,
    autocast_params,
    device_path_dtype_params,
    generator,
    noncontiguous_x,
    randn,
    use_path,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from smptk.kernels import _gemm, _index, runtime
from smptk.kernels._index import expert_row_tile, expert_rows
from smptk.kernels.grouped_linear import (  # by module path: smptk.kernels re-exports the functions
    GroupedLinearFunction,
    GroupedSwiGLUFunction,
    grouped_linear,
    grouped_swiglu,
)
from smptk.testing import assert_close
from smptk.testing.grouped import (
    grouped_linear_error_scales,
    grouped_linear_reference,
    grouped_relu_kink_mask,
    grouped_swiglu_error_scales,
    grouped_swiglu_reference,
)

DEVICE_PATH_DTYPE = device_path_dtype_params()

# Rows per expert, K, N. CPU: boundaries 13 and 33 fall inside the interpreter's 32-row tiles, one expert is
# empty. CUDA: a real MoE layer's shape with uneven experts, empty ones and N odd.
MAIN = {"cpu": ([13, 0, 20, 12], 40, 17), "cuda": ([517, 0, 1024, 1, 2000, 33, 0, 700], 1024, 1027)}
# (id, counts, K, N); the activation cycles through ODD_ACTIVATIONS.
ODD = {
    "cpu": [
        ("K1-N1", [3, 4], 1, 1),
        ("E7-prime-K7-N33", [5, 0, 9, 1, 0, 33, 2], 7, 33),
        ("K33-N7-tile-tails", [40, 30], 33, 7),
        ("T1", [0, 1, 0], 17, 7),
        ("T-below-tile", [3, 2, 4], 33, 40),
        ("empty-first", [0, 20, 17], 17, 7),
        ("empty-middle", [20, 0, 17], 17, 7),
        ("empty-last", [20, 17, 0], 17, 7),
        ("all-on-one", [0, 0, 70, 0], 17, 33),
        ("E1", [45], 7, 17),
        ("T0", [0, 0, 0], 17, 7),
        ("three-col-tiles", [65, 31, 33], 40, 70),
    ],
    "cuda": [
        ("E7-prime", [300, 0, 129, 1, 0, 4000, 77], 1024, 511),
        ("all-on-one", [0, 0, 3000, 0], 4096, 1027),
        ("T1", [0, 1, 0], 4096, 1027),
        ("K1-N1", [500, 700], 1, 1),
        ("T0", [0, 0, 0], 128, 256),
    ],
}
ODD_ACTIVATIONS = ("gelu", "silu", "relu", "gelu_tanh", None)


def _offsets(counts, device) -> torch.Tensor:
    return torch.tensor([0, *counts], device=device).cumsum(0)


def _leaf(shape, dtype, device, gen, std=1.0) -> torch.Tensor:
    return randn(shape, dtype=dtype, device=device, gen=gen, std=std).requires_grad_()


def linear_case(counts, K, N, *, dtype, device, bias=True, seed=0):
    """x ~ N(0, 1), weight ~ N(0, 1/K) per expert (z is O(1)), bias ~ N(0, 1/4); leaves with grad."""
    gen = generator(device, seed)
    T, E = sum(counts), len(counts)
    x = _leaf((T, K), dtype, device, gen)
    w = _leaf((E, N, K), dtype, device, gen, std=1 / math.sqrt(max(K, 1)))
    b = _leaf((E, N), dtype, device, gen, std=0.5) if bias else None
    return x, w, _offsets(counts, device), b


def swiglu_case(counts, K, N, *, dtype, device, seed=0):
    gen = generator(device, seed)
    T, E = sum(counts), len(counts)
    x = _leaf((T, K), dtype, device, gen)
    wg = _leaf((E, N, K), dtype, device, gen, std=1 / math.sqrt(max(K, 1)))
    wu = _leaf((E, N, K), dtype, device, gen, std=1 / math.sqrt(max(K, 1)))
    return x, wg, wu, _offsets(counts, device)


def _compare(out, expected, named, leaves, scales, grad_out, offsets) -> dict[str, torch.Tensor]:
    """assert_close the output and every requested gradient against the fp32 reference computed from the fp32
    copies ``leaves`` of the inputs ``named``; the weight and bias grads of an empty expert must be 0."""
    dtype = named["x"].dtype
    assert out.dtype == dtype and out.shape == expected.shape and out.device == expected.device
    assert_close(out, expected, dtype=dtype, name="out", **scales["out"]._asdict())
    results = {"out": out}
    wants = {k: v for k, v in named.items() if v is not None and v.requires_grad}
    if not wants:
        return results
    grads = torch.autograd.grad(out, list(wants.values()), grad_out)
    ref_grads = torch.autograd.grad(expected, [leaves[k] for k in wants], grad_out.to(torch.float32))
    empty = (offsets[1:] == offsets[:-1]).nonzero().flatten().tolist()
    for name, grad, ref_grad in zip(wants, grads, ref_grads, strict=True):
        assert grad is not None, f"d{name}: no gradient returned"
        assert_close(grad, ref_grad, dtype=dtype, name=f"d{name}", **scales[name]._asdict())
        if name != "x":
            for e in empty:
                assert torch.equal(grad[e], torch.zeros_like(grad[e])), (
                    f"d{name}[{e}] of an empty expert != 0"
                )
        results[f"d{name}"] = grad
    return results


def _fp32_leaves(named):
    return {
        k: None if v is None else v.detach().float().requires_grad_(v.requires_grad) for k, v in named.items()
    }


def check_grouped_linear(x, w, offsets, b, activation, *, grad_out=None, seed=1):
    """grouped_linear vs the per-expert fp32 reference: output and the grads of every input needing one."""
    dtype = x.dtype
    out = grouped_linear(x, w, offsets, bias=b, activation=activation)
    named = {"x": x, "weight": w, "bias": b}
    leaves = _fp32_leaves(named)
    expected = grouped_linear_reference(leaves["x"], leaves["weight"], offsets, leaves["bias"], activation)
    wants = any(v is not None and v.requires_grad for v in named.values())
    if wants and grad_out is None:
        grad_out = randn(out.shape, dtype=dtype, device=x.device, gen=generator(x.device, seed))
        if activation == "relu":
            grad_out = grad_out.masked_fill(grouped_relu_kink_mask(x, w, offsets, b, dtype=dtype), 0)
    scales = grouped_linear_error_scales(x, w, offsets, b, activation, grad_out if wants else None)
    return _compare(out, expected, named, leaves, scales, grad_out, offsets)


def check_grouped_swiglu(x, wg, wu, offsets, *, grad_out=None, seed=1):
    dtype = x.dtype
    out = grouped_swiglu(x, wg, wu, offsets)
    named = {"x": x, "weight_gate": wg, "weight_up": wu}
    leaves = _fp32_leaves(named)
    expected = grouped_swiglu_reference(leaves["x"], leaves["weight_gate"], leaves["weight_up"], offsets)
    wants = any(v.requires_grad for v in named.values())
    if wants and grad_out is None:
        grad_out = randn(out.shape, dtype=dtype, device=x.device, gen=generator(x.device, seed))
    scales = grouped_swiglu_error_scales(x, wg, wu, offsets, grad_out if wants else None)
    return _compare(out, expected, named, leaves, scales, grad_out, offsets)


def _odd_params(with_activation: bool):
    params = []
    for p in DEVICE_PATH_DTYPE:
        for i, (name, counts, K, N) in enumerate(ODD[p.values[0]]):
            act = ODD_ACTIVATIONS[i % len(ODD_ACTIVATIONS)]
            extra = (act,) if with_activation else ()
            suffix = f"-{act_id(act)}" if with_activation else ""
            params.append(
                pytest.param(*p.values, counts, K, N, *extra, id=f"{p.id}-{name}{suffix}", marks=p.marks)
            )
    return params


# --- values and gradients --------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=act_id)
@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_values_and_grads(monkeypatch, device, path, dtype, activation, bias):
    use_path(monkeypatch, path, device)
    counts, K, N = MAIN[device]
    x, w, offsets, b = linear_case(counts, K, N, dtype=dtype, device=device, bias=bias)
    got = check_grouped_linear(x, w, offsets, b, activation)
    assert set(got) == {"out", "dx", "dweight"} | ({"dbias"} if bias else set())


@pytest.mark.parametrize(("device", "path", "dtype", "counts", "K", "N", "activation"), _odd_params(True))
def test_odd_shapes(monkeypatch, device, path, dtype, counts, K, N, activation):
    """Odd K and N, T = 0 and 1, T below a tile, prime E, empty experts anywhere, one busy expert, E = 1."""
    use_path(monkeypatch, path, device)
    x, w, offsets, b = linear_case(counts, K, N, dtype=dtype, device=device)
    got = check_grouped_linear(x, w, offsets, b, activation)
    assert got["dx"].shape == x.shape and got["dweight"].shape == w.shape and got["dbias"].shape == b.shape


@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_swiglu_values_and_grads(monkeypatch, device, path, dtype):
    use_path(monkeypatch, path, device)
    counts, K, N = MAIN[device]
    got = check_grouped_swiglu(*swiglu_case(counts, K, N, dtype=dtype, device=device))
    assert set(got) == {"out", "dx", "dweight_gate", "dweight_up"}


@pytest.mark.parametrize(("device", "path", "dtype", "counts", "K", "N"), _odd_params(False))
def test_swiglu_odd_shapes(monkeypatch, device, path, dtype, counts, K, N):
    use_path(monkeypatch, path, device)
    check_grouped_swiglu(*swiglu_case(counts, K, N, dtype=dtype, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_tiles_never_straddle_experts(monkeypatch, path, dtype):
    """Integer data make every result exact: x = 1, weight[e] = e + 1, bias[e] = 100 (e + 1), dy = 1.

    Boundaries at 1, 32, 34, 64, 97, 161 put one in nearly every 32-row tile, so a tile computing rows of
    two experts with one weight, or a dweight reduction reading a neighbour's rows, changes whole rows.
    """
    use_path(monkeypatch, path, "cpu")
    counts, K, N = [1, 31, 2, 30, 33, 0, 64, 5], 3, 40
    E, T = len(counts), sum(counts)
    offsets = _offsets(counts, "cpu")
    scale = torch.arange(1, E + 1, dtype=dtype)
    x = torch.ones(T, K, dtype=dtype, requires_grad=True)
    w = (scale[:, None, None] * torch.ones(E, N, K, dtype=dtype)).requires_grad_()
    b = (100 * scale[:, None] * torch.ones(E, N, dtype=dtype)).requires_grad_()
    out = grouped_linear(x, w, offsets, bias=b)
    dx, dw, db = torch.autograd.grad(out, [x, w, b], torch.ones_like(out))
    row_scale = scale.repeat_interleave(torch.tensor(counts))[:, None]
    rows = torch.tensor(counts, dtype=dtype)
    assert torch.equal(out, (K + 100) * row_scale.expand(T, N))
    assert torch.equal(dx, N * row_scale.expand(T, K))
    assert torch.equal(dw, rows[:, None, None].expand(E, N, K))
    assert torch.equal(db, rows[:, None].expand(E, N))


@pytest.mark.parametrize("layout", ["transposed", "column-slice", "every-other"])
@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_noncontiguous_x(monkeypatch, device, path, dtype, layout):
    use_path(monkeypatch, path, device)
    counts, K, N = MAIN[device]
    x = noncontiguous_x(layout, sum(counts), K, dtype=dtype, device=device)
    _, w, offsets, b = linear_case(counts, K, N, dtype=dtype, device=device, seed=2)
    assert check_grouped_linear(x, w, offsets, b, "gelu")["dx"].shape == x.shape
    _, wg, wu, _ = swiglu_case(counts, K, N, dtype=dtype, device=device, seed=3)
    assert check_grouped_swiglu(x, wg, wu, offsets)["dx"].shape == x.shape


@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_noncontiguous_weights(monkeypatch, device, path, dtype):
    """Weights stored ``[E, K, N]`` and passed as ``.transpose(1, 2)``, and a column-sliced bias."""
    use_path(monkeypatch, path, device)
    counts, K, N = MAIN[device]
    x, w, offsets, b = (t.detach() for t in linear_case(counts, K, N, dtype=dtype, device=device))
    w_t = w.transpose(1, 2).contiguous().requires_grad_()
    b_wide = torch.cat([b, b], 1).requires_grad_()
    w_view, b_view = w_t.transpose(1, 2), b_wide[:, 1::2]
    assert not w_view.is_contiguous() and not b_view.is_contiguous()
    check_grouped_linear(x.requires_grad_(), w_view, offsets, b_view, "silu")
    _, wg, wu, _ = (t.detach() for t in swiglu_case(counts, K, N, dtype=dtype, device=device))
    wg_view, wu_view = (t.transpose(1, 2).contiguous().requires_grad_().transpose(1, 2) for t in (wg, wu))
    check_grouped_swiglu(x, wg_view, wu_view, offsets)


@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_expanded_grad_out(monkeypatch, device, path, dtype):
    """``out.sum().backward()`` sends an expanded (stride 0) gradient."""
    use_path(monkeypatch, path, device)
    counts, K, N = MAIN[device]
    x, w, offsets, b = linear_case(counts, K, N, dtype=dtype, device=device)
    grad_out = torch.ones((), dtype=dtype, device=device).expand(sum(counts), N)
    check_grouped_linear(x, w, offsets, b, "silu", grad_out=grad_out)
    check_grouped_swiglu(*swiglu_case(counts, K, N, dtype=dtype, device=device), grad_out=grad_out)


@pytest.mark.parametrize(
    "wants", [("x",), ("weight",), ("bias",), ("weight", "bias")], ids=lambda w: "grad-" + "+".join(w)
)
@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_partial_grads(monkeypatch, device, path, dtype, wants):
    use_path(monkeypatch, path, device)
    counts, K, N = MAIN[device]
    x, w, offsets, b = linear_case(counts, K, N, dtype=dtype, device=device)
    for name, t in (("x", x), ("weight", w), ("bias", b)):
        t.requires_grad_(name in wants)
    got = check_grouped_linear(x, w, offsets, b, "relu")
    assert set(got) == {"out"} | {f"d{name}" for name in wants}


@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_forward_without_grad(monkeypatch, device, path, dtype):
    use_path(monkeypatch, path, device)
    counts, K, N = MAIN[device]
    x, w, offsets, b = (t.detach() for t in linear_case(counts, K, N, dtype=dtype, device=device))
    with torch.no_grad():
        out = grouped_linear(x, w, offsets, bias=b, activation="gelu_tanh")
    assert out.grad_fn is None
    assert check_grouped_linear(x, w, offsets, b, "gelu_tanh")["out"].grad_fn is None
    xs, wg, wu, _ = (t.detach() for t in swiglu_case(counts, K, N, dtype=dtype, device=device))
    assert check_grouped_swiglu(xs, wg, wu, offsets)["out"].grad_fn is None


@pytest.mark.parametrize(("device", "path", "dtype"), DEVICE_PATH_DTYPE)
def test_int32_offsets(monkeypatch, device, path, dtype):
    """int32 offsets are accepted and give bit-identical results to int64 ones."""
    use_path(monkeypatch, path, device)
    counts, K, N = MAIN[device]
    x, w, offsets, b = (t.detach() for t in linear_case(counts, K, N, dtype=dtype, device=device))
    want = grouped_linear(x, w, offsets, bias=b, activation="silu")
    assert torch.equal(grouped_linear(x, w, offsets.int(), bias=b, activation="silu"), want)


@pytest.mark.parametrize(("device", "path", "dtype"), autocast_params())
def test_autocast(monkeypatch, device, path, dtype):
    """Inside torch.autocast fp32 inputs run in the autocast dtype, as F.linear would; fp32 leaves get fp32
    gradients that carry the low-precision values."""
    use_path(monkeypatch, path, device)
    counts, K, N = MAIN[device]
    x, w, offsets, b = linear_case(counts, K, N, dtype=torch.float32, device=device)
    with torch.autocast(device_type=device, dtype=dtype):
        out = grouped_linear(x, w, offsets, bias=b, activation="gelu")
    assert out.dtype == dtype
    grad_out = randn(out.shape, dtype=dtype, device=device, gen=generator(device, 1))
    grads = torch.autograd.grad(out, [x, w, b], grad_out)
    assert [g.dtype for g in grads] == [torch.float32] * 3
    low = [t.detach().to(dtype) for t in (x, w, b)]
    leaves = [t.float().requires_grad_() for t in low]
    ref = grouped_linear_reference(leaves[0], leaves[1], offsets, leaves[2], "gelu")
    ref_grads = torch.autograd.grad(ref, leaves, grad_out.float())
    scales = grouped_linear_error_scales(low[0], low[1], offsets, low[2], "gelu", grad_out)
    assert_close(out, ref, dtype=dtype, name="out", **scales["out"]._asdict())
    for name, grad, ref_grad in zip(("x", "weight", "bias"), grads, ref_grads, strict=True):
        assert_close(grad.to(dtype), ref_grad, dtype=dtype, name=f"d{name}", **scales[name]._asdict())


def test_one_launch_per_gemm(monkeypatch):
    """The Triton path launches one grouped kernel per GEMM whatever E is: forward 1, backward 2 (dx and
    dweight + dbias together); the torch path launches none."""
    launched = []
    real = _gemm._Launch.run
    names = {(1, 0): "rows", (1, 2): "rows_swiglu", (1, 1): "rows_sum", (2, 0): "reduction"}
    monkeypatch.setattr(
        _gemm._Launch, "run", lambda self: (launched.append(names[self.grouping, self.dual]), real(self))
    )
    counts, K, N = ODD["cpu"][1][1:]  # E = 7 with empty experts
    use_path(monkeypatch, "triton", "cpu")
    x, w, offsets, b = linear_case(counts, K, N, dtype=torch.float32, device="cpu")
    out = grouped_linear(x, w, offsets, bias=b, activation="gelu")
    assert launched == ["rows"]
    out.sum().backward()
    assert sorted(launched) == ["reduction", "rows", "rows"]
    launched.clear()
    x2, wg, wu, _ = swiglu_case(counts, K, N, dtype=torch.float32, device="cpu")
    grouped_swiglu(x2, wg, wu, offsets).sum().backward()
    assert sorted(launched) == ["reduction", "rows_sum", "rows_swiglu"]
    launched.clear()
    monkeypatch.setenv("SMPTK_KERNELS", "torch")
    grouped_linear(x, w, offsets, bias=b).sum().backward()
    assert launched == []


@pytest.mark.parametrize(
    ("bad", "clamped"),
    [([0, 10, 1000], [0, 10, 20]), ([0, -5, 20], [0, 0, 20]), ([0, 20, 20, 99], [0, 20, 20, 20])],
    ids=["past-T", "negative", "last-past-T"],
)
def test_unchecked_offsets_stay_in_bounds(monkeypatch, bad, clamped):
    """Where offsets go unchecked (CUDA without SMPTK_CHECK_OFFSETS), the kernels clamp every expert's rows
    into [0, T] (end >= start): offsets out of range give the clamped offsets' result, never an
    out-of-bounds access (decreasing ones give overlapping experts, also in bounds). Called below the
    public checks, which reject these offsets on CPU."""
    use_path(monkeypatch, "triton", "cpu")
    counts = [b - a for a, b in itertools.pairwise(clamped)]
    x, w, offsets, b = (t.detach() for t in linear_case(counts, 17, 7, dtype=torch.float32, device="cpu"))
    x.requires_grad_()
    w.requires_grad_()
    want = grouped_linear(x, w, offsets, bias=b, activation="silu")
    got = GroupedLinearFunction.apply(x, w, torch.tensor(bad), b, 4, True)  # 4 = silu
    assert torch.equal(got, want)
    g = torch.ones_like(want)
    assert torch.equal(torch.autograd.grad(got, w, g)[0], torch.autograd.grad(want, w, g)[0])


@pytest.mark.parametrize("op", ["linear", "swiglu"])
def test_rows_of_no_expert_are_never_written(monkeypatch, op):
    """offsets[-1] = 15 < T = 40 (possible only unchecked): rows 15.. belong to no expert, so out and dx must
    keep their NaN poison there, while rows :15 and the weight grads equal the run on x[:15].

    This is the case that exposes a tile writing past its expert's end (rows masked by T instead of by the
    expert's end): with valid offsets those rows belong to the next expert, whose tile comes later in the
    interpreter's program order and overwrites them (on a GPU it is a race).
    """
    use_path(monkeypatch, "triton", "cpu")
    counts, T = [10, 0, 5], 40
    E, covered = len(counts), sum(counts)
    make = linear_case if op == "linear" else swiglu_case
    x, *params = (t.detach() for t in make([*counts, T - covered], 17, 40, dtype=torch.float32, device="cpu"))
    weights = [
        p[:E].clone().requires_grad_() for p in params if p.is_floating_point()
    ]  # drop the last expert

    def run(x_, offsets):
        if op == "linear":  # below the public checks, which reject offsets[-1] != T on CPU
            return GroupedLinearFunction.apply(x_, weights[0], offsets, weights[1], 2, True)  # 2 = gelu
        return GroupedSwiGLUFunction.apply(x_, *weights, offsets, True)

    offsets = _offsets(counts, "cpu")
    results = []
    for rows in (T, covered):
        x_ = x[:rows].clone().requires_grad_()
        out = run(x_, offsets)
        results.append((out, *torch.autograd.grad(out, [x_, *weights], torch.ones_like(out))))
    (out, dx, *dws), (out_ref, dx_ref, *dws_ref) = results
    assert out[covered:].isnan().all() and dx[covered:].isnan().all(), "rows of no expert were written"
    assert torch.equal(out[:covered], out_ref) and torch.equal(dx[:covered], dx_ref)
    for dw, dw_ref in zip(dws, dws_ref, strict=True):
        assert torch.equal(dw, dw_ref)


# --- index math past 2^31 ---------------------------------------------------------------------------------


@triton.jit
def _index_probe_kernel(
    offsets_ptr, tiles_ptr, out_ptr, E, T, stride, BLOCK_M: tl.constexpr, EB: tl.constexpr
):
    """out[p] = (expert, row_start, row_end, address of the tile's last row, expert_rows(expert)) for tile
    tiles[p], through the kernels' own helpers; addresses are ``row * stride`` as the kernels form them."""
    p = tl.program_id(0)
    expert, row_start, row_end = expert_row_tile(offsets_ptr, E, T, tl.load(tiles_ptr + p), BLOCK_M, EB)
    rows = row_start + tl.arange(0, BLOCK_M)
    last_addr = tl.max(tl.where(rows < row_end, rows * stride, -1), 0)
    lo, hi = expert_rows(offsets_ptr, T, tl.maximum(expert, 0))
    o = out_ptr + p * 6
    tl.store(o, expert)
    tl.store(o + 1, row_start)
    tl.store(o + 2, row_end)
    tl.store(o + 3, last_addr)
    tl.store(o + 4, lo)
    tl.store(o + 5, hi)


@pytest.mark.parametrize("device", DEVICES)
def test_index_math_past_int32(device):
    """Offsets near 6e9 rows (no tensor behind them): tile -> (expert, rows) and ``row * stride`` stay exact
    where int32 math would wrap. Row addresses reach 6e9 * 4099 ~ 2.5e13."""
    if device == "cpu" and not runtime.interpreter_enabled():
        pytest.skip(NO_INTERPRETER_REASON)
    BM, stride = 32, 4099
    bounds = [0, 3_000_000_001, 3_000_000_001, 3_000_000_038, 6_000_000_000 + 7]
    T, E = bounds[-1], len(bounds) - 1
    tiles_per = [-(-(b - a) // BM) for a, b in itertools.pairwise(bounds)]
    first = [sum(tiles_per[:e]) for e in range(E)]
    probe = [0, first[0] + tiles_per[0] - 1, first[2], first[2] + 1, first[3], first[3] + tiles_per[3] - 1]
    probe += [first[3] + tiles_per[3], first[3] + tiles_per[3] + 5]  # past the last tile: no expert
    expected = []
    for t in probe:
        e = next((e for e in range(E) if first[e] <= t < first[e] + tiles_per[e]), -1)
        if e < 0:
            expected.append([-1, 0, 0, -1, bounds[0], bounds[1]])
            continue
        start = bounds[e] + (t - first[e]) * BM
        last = min(start + BM, bounds[e + 1]) - 1
        expected.append([e, start, bounds[e + 1], last * stride, bounds[e], bounds[e + 1]])
    out = torch.full((len(probe), 6), -7, dtype=torch.int64, device=device)
    offsets = torch.tensor(bounds, dtype=torch.int64, device=device)
    tiles = torch.tensor(probe, dtype=torch.int64, device=device)
    _index_probe_kernel[(len(probe),)](offsets, tiles, out, E, T, stride, BLOCK_M=BM, EB=2)
    assert out.tolist() == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=40), st.sampled_from([16, 32, 64, 128]))
def test_row_tile_bound(counts, block_m):
    """The launch's upper bound covers every expert's tiles: sum cdiv(rows_e, BLOCK_M) <= bound."""
    T = sum(counts)
    assert sum(-(-c // block_m) for c in counts) <= _index.row_tile_bound(T, len(counts), block_m)


# --- bad input --------------------------------------------------------------------------------------------

# (id, builder from valid (x, w, offsets, b, activation), exception, argument named)
BAD_INPUTS = [
    ("x-list", lambda x, w, o, b, a: (x.tolist(), w, o, b, a), TypeError, "x"),
    ("x-int32", lambda x, w, o, b, a: (x.int(), w, o, b, a), TypeError, "x"),
    ("x-1d", lambda x, w, o, b, a: (x[0], w, o, b, a), ValueError, "x"),
    ("x-3d", lambda x, w, o, b, a: (x[None], w, o, b, a), ValueError, "x"),
    ("weight-none", lambda x, w, o, b, a: (x, None, o, b, a), TypeError, "weight"),
    ("weight-float16", lambda x, w, o, b, a: (x, w.half(), o, b, a), TypeError, "weight"),
    ("weight-2d", lambda x, w, o, b, a: (x, w[0], o, b, a), ValueError, "weight"),
    ("weight-no-experts", lambda x, w, o, b, a: (x, w[:0], o[:1], b[:0], a), ValueError, "weight"),
    ("weight-wrong-K", lambda x, w, o, b, a: (x, w[..., :-1], o, b, a), ValueError, "weight"),
    ("weight-other-device", lambda x, w, o, b, a: (x, w.to("meta"), o, b, a), ValueError, "weight"),
    ("bias-float16", lambda x, w, o, b, a: (x, w, o, b.half(), a), TypeError, "bias"),
    ("bias-1d", lambda x, w, o, b, a: (x, w, o, b[0], a), ValueError, "bias"),
    ("bias-wrong-N", lambda x, w, o, b, a: (x, w, o, b[:, :-1], a), ValueError, "bias"),
    ("bias-other-device", lambda x, w, o, b, a: (x, w, o, b.to("meta"), a), ValueError, "bias"),
    ("offsets-list", lambda x, w, o, b, a: (x, w, o.tolist(), b, a), TypeError, "offsets"),
    ("offsets-float", lambda x, w, o, b, a: (x, w, o.float(), b, a), TypeError, "offsets"),
    ("offsets-short", lambda x, w, o, b, a: (x, w, o[:-1], b, a), ValueError, "offsets"),
    ("offsets-2d", lambda x, w, o, b, a: (x, w, o[None], b, a), ValueError, "offsets"),
    ("offsets-other-device", lambda x, w, o, b, a: (x, w, o.to("meta"), b, a), ValueError, "offsets"),
    (
        "offsets-last-not-T",
        lambda x, w, o, b, a: (x, w, o - (o == o[-1]).long(), b, a),
        ValueError,
        "offsets",
    ),
    ("offsets-first-not-0", lambda x, w, o, b, a: (x, w, o + (o == 0).long(), b, a), ValueError, "offsets"),
    (
        "offsets-decreasing",
        lambda x, w, o, b, a: (x, w, torch.tensor([0, 30, 10, 33, 45]), b, a),
        ValueError,
        "offsets",
    ),
    ("activation-tanh", lambda x, w, o, b, a: (x, w, o, b, "tanh"), ValueError, "activation"),
]


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize(("build", "exc", "arg"), [pytest.param(*c[1:], id=c[0]) for c in BAD_INPUTS])
def test_bad_input(monkeypatch, path, build, exc, arg):
    """Each bad argument raises the documented error type, and the message names that argument."""
    use_path(monkeypatch, path, "cpu")
    x, w, o, b = (t.detach() for t in linear_case(*MAIN["cpu"], dtype=torch.float32, device="cpu"))
    x_, w_, o_, b_, a_ = build(x, w, o, b, "gelu")
    with pytest.raises(exc, match=rf"(?<!\w){arg}(?!\w)"):
        grouped_linear(x_, w_, o_, bias=b_, activation=a_)


SWIGLU_BAD_INPUTS = [
    ("x-2d-required", lambda x, g, u, o: (x[None], g, u, o), ValueError, "x"),
    ("weight_gate-2d", lambda x, g, u, o: (x, g[0], u, o), ValueError, "weight_gate"),
    ("weight_gate-float16", lambda x, g, u, o: (x, g.half(), u, o), TypeError, "weight_gate"),
    ("weight_up-wrong-N", lambda x, g, u, o: (x, g, u[:, :-1], o), ValueError, "weight_up"),
    ("weight_up-wrong-E", lambda x, g, u, o: (x, g, u[:-1], o), ValueError, "weight_up"),
    ("weight_up-other-device", lambda x, g, u, o: (x, g, u.to("meta"), o), ValueError, "weight_up"),
    ("offsets-short", lambda x, g, u, o: (x, g, u, o[:-1]), ValueError, "offsets"),
    ("offsets-last-not-T", lambda x, g, u, o: (x, g, u, o - (o == o[-1]).long()), ValueError, "offsets"),
]


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize(("build", "exc", "arg"), [pytest.param(*c[1:], id=c[0]) for c in SWIGLU_BAD_INPUTS])
def test_swiglu_bad_input(monkeypatch, path, build, exc, arg):
    use_path(monkeypatch, path, "cpu")
    args = (t.detach() for t in swiglu_case(*MAIN["cpu"], dtype=torch.float32, device="cpu"))
    with pytest.raises(exc, match=rf"(?<!\w){arg}(?!\w)"):
        grouped_swiglu(*build(*args))


# --- CUDA only --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_offsets_values_checked_on_cuda_only_on_request(monkeypatch):
    """On CUDA the values need a host sync: unchecked by default, checked with SMPTK_CHECK_OFFSETS=1."""
    use_path(monkeypatch, "triton", "cuda")
    x, w, _, _ = (t.detach() for t in linear_case([3, 4], 16, 8, dtype=torch.float16, device="cuda"))
    bad = torch.tensor([0, 5, 6], device="cuda")  # offsets[-1] != T = 7
    grouped_linear(x, w, bad)  # runs (clamped, in bounds)
    monkeypatch.setenv("SMPTK_CHECK_OFFSETS", "1")
    with pytest.raises(ValueError, match=r"(?<!\w)offsets(?!\w)"):
        grouped_linear(x, w, bad)


@pytest.mark.gpu
@pytest.mark.slow
def test_int64_indexing_cuda(monkeypatch):
    """x has (2**20 + 100) * 2048 elements; the last expert's 100 rows all start past element 2^31.

    Checks experts 0 and 2 whole (output, dx, dweight, dbias) and expert 1's first and last rows."""
    if torch.cuda.mem_get_info()[0] < 24 * 2**30:
        pytest.skip("needs 24 GiB of free GPU memory for a 4.3 GB x, its gradient and the references")
    use_path(monkeypatch, "triton", "cuda")
    T, K, N = 2**20 + 100, 2048, 16
    counts = [5, T - 105, 100]
    x, w, offsets, b = linear_case(counts, K, N, dtype=torch.float16, device="cuda")
    assert (T - 100) * K >= 2**31
    grad_out = randn((T, N), dtype=torch.float16, device="cuda", gen=generator("cuda", 5))
    out = grouped_linear(x, w, offsets, bias=b, activation="silu")
    dx, dw, db = torch.autograd.grad(out, [x, w, b], grad_out)
    for e, rows in (
        (0, slice(0, 5)),
        (2, slice(T - 100, T)),
        (1, slice(5, 69)),
        (1, slice(T - 164, T - 100)),
    ):
        xr, wr, br = (t.detach().float().requires_grad_() for t in (x[rows], w[e], b[e]))
        ref = grouped_linear_reference(xr, wr[None], [0, xr.shape[0]], br[None], "silu")
        ref_grads = torch.autograd.grad(ref, [xr, wr, br], grad_out[rows].float())
        sc = grouped_linear_error_scales(
            x[rows], w[e : e + 1], [0, xr.shape[0]], b[e : e + 1], "silu", grad_out[rows]
        )
        assert_close(out[rows], ref, dtype=torch.float16, name=f"out rows {rows}", **sc["out"]._asdict())
        assert_close(dx[rows], ref_grads[0], dtype=torch.float16, name=f"dx rows {rows}", **sc["x"]._asdict())
        if e != 1:
            assert_close(
                dw[e : e + 1],
                ref_grads[1][None],
                dtype=torch.float16,
                name=f"dw[{e}]",
                **sc["weight"]._asdict(),
            )
            assert_close(
                db[e : e + 1],
                ref_grads[2][None],
                dtype=torch.float16,
                name=f"db[{e}]",
                **sc["bias"]._asdict(),
            )


def test_docstring_examples():
    """The examples in the public docstrings and in smptk.testing.grouped run and print what they show."""
    import doctest

    from smptk.testing import grouped as testing_grouped

    for fn in (grouped_linear, grouped_swiglu):
        for test in doctest.DocTestFinder().find(fn, fn.__name__, globs={"torch": torch, fn.__name__: fn}):
            assert doctest.DocTestRunner().run(test).failed == 0, f"{fn.__name__}'s example failed"
    assert doctest.testmod(testing_grouped, extraglobs={"torch": torch}).failed == 0
