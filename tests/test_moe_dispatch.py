"""moe_dispatch / moe_combine against the fp32 references (smptk.testing.moe), both paths, every dtype.

The plan (offsets, counts, dest, source rows, drops) and the grouped rows are compared **exactly** (they are
integer bookkeeping and copies); the combine and the gradients within the derived tolerance. The identity
property (dispatch, identity experts, combine with weights 1 = k * x) is checked with torch.equal on values
whose sums are exact. CPU: Triton under the interpreter (bf16 included: no tl.dot here) with
``SMPTK_POISON_OUTPUTS=1`` (unwritten floats read NaN, unwritten ints the int minimum); the interpreter's
plan kernels take 32 pairs per program in chunks of 128 // BLOCK_E (2 chunks for E <= 8) and 2 programs
per scan step, so P = T * k >= 65 crosses every boundary. CUDA cases at real sizes carry the ``gpu`` marker.

Legend: T tokens, H hidden size, E experts, k slots per token, R grouped rows, C capacity.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from helpers import DTYPES, dtype_id, generator, randn, use_path

from smptk.kernels import _index
from smptk.kernels.moe_dispatch import MoEDispatchPlan, moe_combine, moe_dispatch
from smptk.kernels.moe_route import moe_route
from smptk.testing import assert_close
from smptk.testing.moe import (
    moe_capacity_reference,
    moe_combine_reference,
    moe_dispatch_reference,
    moe_route_reference,
)

# By full name: once smptk.kernels exports the function moe_dispatch, that attribute shadows the module.
md = importlib.import_module("smptk.kernels.moe_dispatch")
PATHS = ("triton", "torch")
REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_IDS = [[0, 2], [2, 1], [0, 1], [2, 0]]


def random_ids(T: int, E: int, k: int, *, seed: int = 0, device="cpu", dtype=torch.int64) -> torch.Tensor:
    """k distinct experts per token, uniformly at random (as a top-k router gives)."""
    gen = generator(device, seed)
    return torch.rand(T, E, generator=gen, device=device).argsort(dim=1)[:, :k].to(dtype)


def check_plan(plan: MoEDispatchPlan, ref, T: int, k: int, E: int) -> None:
    assert isinstance(plan, MoEDispatchPlan)
    for name in ("offsets", "tokens_per_expert", "dest", "source_token", "source_pair"):
        got, want = getattr(plan, name), getattr(ref, name)
        assert got.dtype == torch.int64, f"{name}: dtype {got.dtype}"
        assert torch.equal(got, want), f"{name}: {got.tolist()} != reference {want.tolist()}"
    assert plan.num_dropped == ref.num_dropped and isinstance(plan.num_dropped, int)
    assert plan.capacity == ref.capacity
    assert (plan.top_k, plan.num_experts, plan.num_tokens, plan.num_rows) == (
        k,
        E,
        T,
        ref.source_token.numel(),
    )


def interpreter_bf16_truncates(dtype: torch.dtype, device: torch.device) -> bool:
    """Triton 3.9's interpreter converts fp32 -> bf16 by truncating the mantissa (``cast_impl`` passes no
    rounding mode), an error of up to one bf16 ulp = 2 u |value| where CUDA rounds to nearest (u |value|).
    Outputs computed in fp32 and stored as bf16 by the CPU Triton path get that much slack, no more."""
    from smptk.kernels import runtime

    return dtype == torch.bfloat16 and device.type == "cpu" and runtime.requested_path() == "triton"


def close(actual, expected, *, rss, reduction_len, name, torch_roundings=0):
    """assert_close with the summands' root-sum-square ``rss`` as the error scale, plus |expected| as one
    extra rounding where the interpreter truncates bf16 (see interpreter_bf16_truncates).
    ``torch_roundings``: intermediate roundings of the torch path (its index backward accumulates in the
    input dtype, one rounding per slot); the Triton kernels accumulate in fp32 and round once."""
    from smptk.kernels import runtime

    extra = interpreter_bf16_truncates(actual.dtype, actual.device)
    scale = rss + expected.detach().abs() if extra else rss
    roundings = int(extra) + (torch_roundings if runtime.requested_path() == "torch" else 0)
    assert_close(
        actual,
        expected,
        dtype=actual.dtype,
        reduction_len=reduction_len,
        scale=scale,
        roundings=roundings,
        name=name,
    )


def check_dispatch_combine(x, expert_ids, E, *, capacity_factor=None, seed=1):
    """Dispatch x, combine random rows y with random weights; compare the plan and x_grouped exactly, out and
    the gradients of x, y and weights with the references (errors scaled by the summands' magnitudes)."""
    T, k = expert_ids.shape
    dtype = x.dtype
    xg, plan = moe_dispatch(x, expert_ids, E, capacity_factor=capacity_factor)
    x_leaf = x.detach().float().requires_grad_(x.requires_grad)
    ref = moe_dispatch_reference(x_leaf, expert_ids, E, capacity_factor)
    check_plan(plan, ref, T, k, E)
    assert xg.dtype == dtype and xg.shape == (ref.source_token.numel(), x.shape[1])
    assert torch.equal(xg.float(), ref.x_grouped.detach()), "x_grouped is not the exact copy of x's rows"

    gen = generator(x.device, seed)
    H = x.shape[1]
    R = xg.shape[0]
    y = randn((R, H), dtype=dtype, device=x.device, gen=gen).requires_grad_()
    w = (torch.rand(T, k, generator=gen, device=x.device) + 0.1).requires_grad_()
    out = moe_combine(y, plan, w)
    y_leaf = y.detach().float().requires_grad_()
    w_leaf = w.detach().requires_grad_()
    ref_out = moe_combine_reference(y_leaf, ref.dest, w_leaf)
    assert out.dtype == dtype and out.shape == (T, H)
    rss = moe_combine_reference(y_leaf.detach() ** 2, ref.dest, w.detach() ** 2).sqrt()
    close(out, ref_out, rss=rss, reduction_len=k, name="out")

    dout = randn((T, H), dtype=dtype, device=x.device, gen=gen)
    dy, dw = torch.autograd.grad(out, [y, w], dout)
    ref_dy, ref_dw = torch.autograd.grad(ref_out, [y_leaf, w_leaf], dout.float())
    assert dy.dtype == dtype and dw.dtype == torch.float32
    close(dy, ref_dy, rss=ref_dy.abs(), reduction_len=1, name="dy")
    # dweights: a length-H dot of dtype values; its summands' root-sum-square is the error scale.
    rows = y_leaf.detach()[ref.dest.clamp(min=0)] if R else torch.zeros(T, k, H)
    dw_rss = torch.sqrt((dout.float()[:, None, :] ** 2 * rows**2).sum(-1))
    close(dw, ref_dw, rss=dw_rss, reduction_len=H, name="dweights")

    if x.requires_grad:
        dxg = randn(xg.shape, dtype=dtype, device=x.device, gen=gen)
        (dx,) = torch.autograd.grad(xg, x, dxg)
        (ref_dx,) = torch.autograd.grad(ref.x_grouped, x_leaf, dxg.float())
        (dx_rss,) = torch.autograd.grad(
            moe_dispatch_reference(x_leaf, expert_ids, E, capacity_factor).x_grouped, x_leaf, dxg.float() ** 2
        )
        assert dx.dtype == dtype
        close(dx, ref_dx, rss=dx_rss.sqrt(), reduction_len=k, name="dx", torch_roundings=k)
    return xg, plan, out


def inputs(T, H, dtype, seed=0):
    return randn((T, H), dtype=dtype, device="cpu", gen=generator("cpu", seed)).requires_grad_()


# --- the worked example of the docstring ----------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_worked_example(monkeypatch, path):
    use_path(monkeypatch, path, "cpu")
    x = torch.arange(8.0).view(4, 2)
    ids = torch.tensor(EXAMPLE_IDS)
    xg, plan = moe_dispatch(x, ids, 3)
    assert plan.tokens_per_expert.tolist() == [3, 2, 3]
    assert plan.offsets.tolist() == [0, 3, 5, 8]
    assert plan.source_pair.tolist() == [0, 4, 7, 3, 5, 1, 2, 6]
    assert plan.source_token.tolist() == [0, 2, 3, 1, 2, 0, 1, 3]
    assert plan.dest.tolist() == [[0, 5], [6, 3], [1, 4], [7, 2]]
    assert (plan.num_dropped, plan.capacity) == (0, None)
    assert torch.equal(xg, x[[0, 2, 3, 1, 2, 0, 1, 3]])
    xg, plan = moe_dispatch(x, ids, 3, capacity_factor=0.5)
    assert plan.capacity == 2 and plan.num_dropped == 2
    assert plan.tokens_per_expert.tolist() == [2, 2, 2]
    assert plan.offsets.tolist() == [0, 2, 4, 6]
    assert plan.source_token.tolist() == [0, 2, 1, 2, 0, 1]
    assert plan.dest.tolist() == [[0, 4], [5, 2], [1, 3], [-1, -1]]
    out = moe_combine(xg, plan, torch.ones(4, 2))
    assert torch.equal(out, torch.cat([2 * x[:3], torch.zeros(1, 2)]))


# --- values and gradients -------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.5], ids=["nocap", "cap1", "cap0.5"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("path", PATHS)
def test_values_and_grads(monkeypatch, path, dtype, capacity_factor):
    use_path(monkeypatch, path, "cpu")
    T, H, E, k = 37, 19, 7, 2
    check_dispatch_combine(inputs(T, H, dtype), random_ids(T, E, k), E, capacity_factor=capacity_factor)


# (T, H, E, k): one token; T * k below one program; k = 1 and k = E; E = 1; many programs; H = 1; T = 0.
SHAPES = [
    (1, 5, 7, 3),
    (3, 19, 7, 2),
    (17, 8, 5, 1),
    (9, 4, 7, 7),
    (6, 3, 1, 1),
    (70, 17, 16, 4),
    (13, 1, 3, 2),
    (0, 5, 4, 2),
]


@pytest.mark.parametrize(("T", "H", "E", "k"), SHAPES, ids=[f"T{t}-H{h}-E{e}-k{k}" for t, h, e, k in SHAPES])
@pytest.mark.parametrize("path", PATHS)
def test_shapes(monkeypatch, path, T, H, E, k):
    use_path(monkeypatch, path, "cpu")
    ids = random_ids(T, E, k, seed=T)
    check_dispatch_combine(inputs(T, H, torch.float32, seed=T), ids, E)
    check_dispatch_combine(inputs(T, H, torch.float16, seed=T), ids.int(), E, capacity_factor=0.75)


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["nocap", "cap1"])
@pytest.mark.parametrize("path", PATHS)
def test_no_slots(monkeypatch, path, capacity_factor):
    """k = 0 (expert_ids ``[T, 0]``): nothing is grouped, combine gives zero rows, and the backward gives
    zero gradients on both paths (the Triton combine backward used to compile a 0-wide slot block)."""
    use_path(monkeypatch, path, "cpu")
    x = inputs(5, 4, torch.float32)
    xg, plan = moe_dispatch(x, torch.zeros(5, 0, dtype=torch.int64), 3, capacity_factor=capacity_factor)
    assert xg.shape == (0, 4) and plan.offsets.tolist() == [0, 0, 0, 0] and plan.dest.shape == (5, 0)
    y = (xg * 2).detach().requires_grad_()
    w = torch.zeros(5, 0, requires_grad=True)
    out = moe_combine(y, plan, w)
    assert torch.equal(out, torch.zeros(5, 4))
    dy, dw = torch.autograd.grad(out, [y, w], torch.ones(5, 4))
    assert dy.shape == (0, 4) and dw.shape == (5, 0)
    (dx,) = torch.autograd.grad(xg, x, torch.ones(0, 4))
    assert torch.equal(dx, torch.zeros(5, 4))


@pytest.mark.parametrize("path", PATHS)
def test_every_token_on_one_expert_and_capacity_drops(monkeypatch, path):
    """k = 1, all T tokens on expert 2 of 5: experts 0, 1, 3, 4 empty. With capacity C the first C tokens
    are kept, the rest dropped (dest -1, zero rows out of combine), and num_dropped = T - C."""
    use_path(monkeypatch, path, "cpu")
    T, H, E = 23, 6, 5
    ids = torch.full((T, 1), 2)
    x = inputs(T, H, torch.float32)
    _, plan, _ = check_dispatch_combine(x, ids, E)
    assert plan.offsets.tolist() == [0, 0, 0, T, T, T]
    assert plan.source_token.tolist() == list(range(T))
    for cf, C in ((1.0, 5), (2.0, 10), (0.1, 1), (100.0, 460)):  # C = ceil(cf * 23 / 5)
        _, plan, out = check_dispatch_combine(x, ids, E, capacity_factor=cf)
        kept = min(C, T)
        assert plan.capacity == C and plan.num_dropped == T - kept
        assert plan.tokens_per_expert.tolist() == [0, 0, kept, 0, 0]
        assert plan.dest[:, 0].tolist() == list(range(kept)) + [-1] * (T - kept)
        assert torch.equal(out[kept:], torch.zeros(T - kept, H))


@pytest.mark.parametrize("path", PATHS)
def test_capacity_drops_by_position(monkeypatch, path):
    """Random routing with a tight capacity: a pair is dropped exactly when C pairs of its expert come
    before it in pair order t * k + j (checked here from the definition, besides the reference)."""
    use_path(monkeypatch, path, "cpu")
    T, E, k = 40, 7, 3
    ids = random_ids(T, E, k, seed=4)
    _, plan, _ = check_dispatch_combine(inputs(T, 5, torch.float32), ids, E, capacity_factor=0.6)
    C = plan.capacity
    assert C == 11  # ceil(0.6 * 40 * 3 / 7) = ceil(10.29)
    flat = ids.reshape(-1).tolist()
    seen = [0] * E
    for p, e in enumerate(flat):
        assert (plan.dest.view(-1)[p] < 0).item() == (seen[e] >= C), f"pair {p} (expert {e})"
        seen[e] += 1
    assert plan.num_dropped == sum(max(c - C, 0) for c in seen) > 0


@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["nocap", "cap0.5"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("path", PATHS)
def test_identity_property(monkeypatch, path, dtype, capacity_factor):
    """Identity experts and weights 1: combine(dispatch(x)) = (kept slots of t) * x, bit for bit (small
    integers, exact in every dtype); without a capacity that is k * x. Same for the dispatch backward."""
    use_path(monkeypatch, path, "cpu")
    T, H, E, k = 41, 9, 5, 3
    gen = generator("cpu", 3)
    x = torch.randint(-8, 9, (T, H), generator=gen).to(dtype).requires_grad_()
    ids = random_ids(T, E, k, seed=2)
    xg, plan = moe_dispatch(x, ids, E, capacity_factor=capacity_factor)
    out = moe_combine(xg, plan, torch.ones(T, k))
    kept = (plan.dest >= 0).sum(1, keepdim=True).to(dtype)
    if capacity_factor is None:
        assert torch.equal(out, k * x.detach())
    assert torch.equal(out, kept * x.detach())
    (dx,) = torch.autograd.grad(xg, x, torch.ones_like(xg))
    assert torch.equal(dx, kept.expand(T, H))


@pytest.mark.parametrize("path", PATHS)
def test_noncontiguous_inputs(monkeypatch, path):
    use_path(monkeypatch, path, "cpu")
    T, H, E, k = 29, 11, 6, 2
    base = randn((H, T), dtype=torch.float16, device="cpu", gen=generator("cpu", 0)).requires_grad_()
    x = base.t()
    ids = random_ids(T, E, k, seed=1).t().contiguous().t()  # column-major [T, k]
    assert not x.is_contiguous() and not ids.is_contiguous()
    xg, plan, _ = check_dispatch_combine(x, ids, E, capacity_factor=0.8)
    y = torch.randn(xg.shape[0], 2 * H, dtype=torch.float16)[:, ::2].requires_grad_()
    w = torch.rand(k, T).t().requires_grad_()
    out = moe_combine(y, plan, w)
    ref = moe_combine_reference(y_leaf := y.detach().float().requires_grad_(), plan.dest, w)
    assert_close(out, ref, dtype=torch.float16, reduction_len=k, name="out")
    out.sum().backward()  # an expanded gradient
    (ref_dy,) = torch.autograd.grad(ref.sum(), y_leaf)
    assert_close(y.grad, ref_dy, dtype=torch.float16, reduction_len=1, name="dy")


@pytest.mark.parametrize("path", PATHS)
def test_capacity_of_a_decimal_factor(monkeypatch, path):
    """``capacity_factor=0.8`` is 4/5 as written: 0.8 * 300 * 2 / 5 = 96 pairs per expert. The double
    nearest 0.8 is slightly above it, and C used to come out 97 (an expert kept one pair too many)."""
    use_path(monkeypatch, path, "cpu")
    T, E, k = 300, 5, 2
    assert md.capacity_of(0.8, T, k, E) == moe_capacity_reference(0.8, T, k, E) == 96
    assert md.capacity_of(1.1, 1000, 2, 8) == 275 and md.capacity_of(3, 5, 1, 3) == 5
    ids = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], dim=1)  # 120 pairs per expert
    _, plan, _ = check_dispatch_combine(torch.randn(T, 4), ids, E, capacity_factor=0.8)
    assert plan.capacity == 96 and plan.dest.ge(0).sum() == E * 96 and plan.num_dropped == T * k - E * 96


@pytest.mark.parametrize("path", PATHS)
def test_route_dispatch_combine_pipeline(monkeypatch, path):
    """logits -> moe_route -> moe_dispatch -> expert (row scaling by expert) -> moe_combine, gradients to x
    and to the logits, against the same pipeline built from the references."""
    use_path(monkeypatch, path, "cpu")
    T, H, E, k = 30, 8, 5, 2
    gen = generator("cpu", 9)
    x = torch.randn(T, H, generator=gen).requires_grad_()
    logits = torch.randn(T, E, generator=gen).requires_grad_()
    scale = torch.linspace(0.5, 2.5, E)

    r = moe_route(logits, k)
    xg, plan = moe_dispatch(x, r.expert_ids, E, capacity_factor=1.0)
    row_scale = torch.repeat_interleave(scale, plan.tokens_per_expert)
    out = moe_combine(xg * row_scale[:, None], plan, r.weights)
    loss = (out * torch.linspace(-1, 1, H)).sum() + 0.01 * r.aux_loss

    xl, ll = (t.detach().clone().requires_grad_() for t in (x, logits))
    rr = moe_route_reference(ll, k)
    rd = moe_dispatch_reference(xl, rr.expert_ids, E, 1.0)
    ref_out = moe_combine_reference(
        rd.x_grouped * torch.repeat_interleave(scale, rd.tokens_per_expert)[:, None], rd.dest, rr.weights
    )
    ref_loss = (ref_out * torch.linspace(-1, 1, H)).sum() + 0.01 * rr.aux_loss
    assert_close(out, ref_out, dtype=torch.float32, reduction_len=k + E, roundings=4, name="out")
    gx, gl = torch.autograd.grad(loss, [x, logits])
    rgx, rgl = torch.autograd.grad(ref_loss, [xl, ll])
    assert_close(gx, rgx, dtype=torch.float32, reduction_len=k + E, roundings=4, name="dx")
    assert_close(gl, rgl, dtype=torch.float32, reduction_len=H + E, roundings=4, name="dlogits")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_combine_ignores_a_dropped_pairs_weight(monkeypatch, path, bad):
    """A dropped pair adds nothing whatever its weight: token 2's only pair is dropped (C = 2, every token
    to expert 0) and its weight inf or NaN, and its row is zeros on both paths (the Triton combine read the
    weight and multiplied the missing row's zeros by it: NaN)."""
    use_path(monkeypatch, path, "cpu")
    x = torch.arange(12.0).view(3, 4)
    xg, plan = moe_dispatch(x, torch.zeros(3, 1, dtype=torch.int64), 2, capacity_factor=1.0)
    assert plan.dest.view(-1).tolist() == [0, 1, -1]
    out = moe_combine(xg, plan, torch.tensor([[0.5], [2.0], [bad]]))
    assert torch.equal(out, torch.stack([0.5 * x[0], 2.0 * x[1], torch.zeros(4)]))


@pytest.mark.parametrize("path", PATHS)
def test_capacity_factor_any_real_number(monkeypatch, path):
    """numpy scalars are numbers (``np.float32(1.25)`` was refused as "not a finite number > 0"), and a
    capacity factor far past T * k / E drops nothing (1e30 and 10**400 overflowed: "int too big to
    convert"); the plan reports C as computed."""
    import numpy as np

    use_path(monkeypatch, path, "cpu")
    x, ids, E = inputs(40, 5, torch.float32).detach(), random_ids(40, 6, 2, seed=3), 6
    for cf, like in ((np.float32(1.25), 1.25), (np.int64(2), 2), (np.float64(0.5), 0.5)):
        xg, plan = moe_dispatch(x, ids, E, capacity_factor=cf)
        xr, ref = moe_dispatch(x, ids, E, capacity_factor=like)
        assert torch.equal(xg, xr) and torch.equal(plan.dest, ref.dest) and plan.capacity == ref.capacity
    dropless, _ = moe_dispatch(x, ids, E)
    for cf in (1e30, 10**400):
        xg, plan = moe_dispatch(x, ids, E, capacity_factor=cf)
        assert torch.equal(xg, dropless) and plan.num_dropped == 0
        assert plan.capacity == md.capacity_of(cf, 40, 2, E) > 2**63
    with pytest.raises(TypeError, match="capacity_factor"):
        moe_dispatch(x, ids, E, capacity_factor=np.array([1.0, 2.0]))


def test_paths_agree(monkeypatch):
    T, H, E, k = 50, 7, 9, 3
    x = inputs(T, H, torch.bfloat16).detach()
    ids = random_ids(T, E, k, seed=8, dtype=torch.int32)
    got = {}
    for path in PATHS:
        use_path(monkeypatch, path, "cpu")
        got[path] = moe_dispatch(x, ids, E, capacity_factor=0.9)
    (xa, pa), (xb, pb) = got["triton"], got["torch"]
    assert torch.equal(xa, xb)
    for f in ("offsets", "tokens_per_expert", "dest", "source_token", "source_pair"):
        assert torch.equal(getattr(pa, f), getattr(pb, f)), f
    assert (pa.num_dropped, pa.capacity) == (pb.num_dropped, pb.capacity)


def test_unchecked_bad_ids_stay_in_bounds(monkeypatch):
    """Where the ids are not checked (CUDA without a capacity: a check would cost a host sync), an id
    outside [0, E) acts as a dropped pair: dest -1, nothing written out of bounds, and the grouped rows it
    leaves unused at the end read as zeros. Simulated on CPU by switching the check off."""
    use_path(monkeypatch, "triton", "cpu")
    monkeypatch.setattr(md, "_ids_checked_on_host", lambda device, capacity: False)
    x = torch.arange(1.0, 9.0).view(4, 2)
    ids = torch.tensor([[0, 2], [2, 7], [-1, 1], [2, 0]])
    xg, plan = moe_dispatch(x, ids, 3)
    assert plan.dest.tolist() == [[0, 3], [4, -1], [-1, 2], [5, 1]]
    assert plan.offsets.tolist() == [0, 2, 3, 6]
    assert xg.shape == (8, 2)
    assert torch.equal(xg[6:], torch.zeros(2, 2))
    assert torch.equal(xg[:6], x[[0, 3, 2, 0, 1, 3]])


# --- index math past 2^31 -------------------------------------------------------------------------------


@triton.jit
def _index_math_probe_kernel(rows_ptr, pairs_ptr, out_ptr, stride, top_k, N: tl.constexpr):
    """out[0:N] = rows * stride, out[N:2N] = t, out[2N:3N] = j of pair index p, via the kernels' helpers."""
    i = tl.arange(0, N)
    rows = tl.load(rows_ptr + i)
    tl.store(out_ptr + i, _index.row_offset(rows, stride))
    t, j = _index.pair_coords(tl.load(pairs_ptr + i), top_k)
    tl.store(out_ptr + N + i, t)
    tl.store(out_ptr + 2 * N + i, j)
    tl.store(out_ptr + 3 * N + i, _index.row_offset(tl.program_id(0) + i, stride))


def test_index_math_past_2_31(monkeypatch):
    """row_offset and pair_coords (used by every kernel here for addresses and pair -> token) in int64:
    int32 rows times a 4096-wide stride (2^43) and pair indices above 2^31 come out exact. No large buffers:
    only the arithmetic runs (through a probe kernel, under the interpreter on CPU)."""
    use_path(monkeypatch, "triton", "cpu")
    rows = torch.tensor([2**31 - 1, 2**30 + 7, 5, 0], dtype=torch.int32)
    pairs = torch.tensor([2**31 + 5, 2**33 + 3, 2**40 + 17, 7], dtype=torch.int64)
    out = torch.zeros(16, dtype=torch.int64)
    stride, k = 4096, 8
    _index_math_probe_kernel[(1,)](rows, pairs, out, stride, k, N=4)
    assert out[:4].tolist() == [r * stride for r in rows.tolist()]
    assert out[4:8].tolist() == [p // k for p in pairs.tolist()]
    assert out[8:12].tolist() == [p % k for p in pairs.tolist()]
    assert out[12:].tolist() == [i * stride for i in range(4)]
    assert max(out[:8].tolist()) > 2**31


# --- CUDA at real sizes ---------------------------------------------------------------------------------

CUDA_CASES = [
    (16384, 1024, 64, 8, None),
    (16384, 512, 256, 8, 1.25),
    (4097, 1024, 7, 2, 0.5),
    (1, 4096, 8, 2, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize(("T", "H", "E", "k", "cf"), CUDA_CASES)
def test_cuda(monkeypatch, dtype, T, H, E, k, cf):
    """Plan and grouped rows exactly, combine and all gradients within tolerance, the identity exactly."""
    use_path(monkeypatch, "triton", "cuda")
    x = randn((T, H), dtype=dtype, device="cuda", gen=generator("cuda", 0)).requires_grad_()
    ids = random_ids(T, E, k, device="cuda")
    xg, plan, _ = check_dispatch_combine(x, ids, E, capacity_factor=cf)
    out = moe_combine(xg, plan, torch.ones(T, k, device="cuda"))
    kept = (plan.dest >= 0).sum(1, keepdim=True).to(dtype)
    assert torch.equal(out, kept * x.detach()), "identity experts with weights 1 must give (kept slots) * x"


# --- bad input ----------------------------------------------------------------------------------------

_X = torch.randn(4, 3)
_IDS = torch.tensor(EXAMPLE_IDS)

DISPATCH_BAD = [
    ("x-list", lambda: (_X.tolist(), _IDS, 3, None), TypeError, "x"),
    ("x-int", lambda: (_X.long(), _IDS, 3, None), TypeError, "x"),
    ("x-1d", lambda: (_X[0], _IDS, 3, None), ValueError, "x"),
    ("x-3d", lambda: (_X[None], _IDS, 3, None), ValueError, "x"),
    ("expert_ids-float", lambda: (_X, _IDS.float(), 3, None), TypeError, "expert_ids"),
    ("expert_ids-int16", lambda: (_X, _IDS.short(), 3, None), TypeError, "expert_ids"),
    ("expert_ids-1d", lambda: (_X, _IDS[:, 0], 3, None), ValueError, "expert_ids"),
    ("expert_ids-wrong-T", lambda: (_X, _IDS[:3], 3, None), ValueError, "expert_ids"),
    ("expert_ids-other-device", lambda: (_X, _IDS.to("meta"), 3, None), ValueError, "expert_ids"),
    ("expert_ids-too-large", lambda: (_X, _IDS, 2, None), ValueError, "expert_ids"),
    ("expert_ids-negative", lambda: (_X, _IDS - 1, 3, None), ValueError, "expert_ids"),
    ("expert_ids-too-large-cap", lambda: (_X, _IDS + 1, 3, 1.0), ValueError, "expert_ids"),
    ("num_experts-0", lambda: (_X, _IDS, 0, None), ValueError, "num_experts"),
    ("num_experts-float", lambda: (_X, _IDS, 3.0, None), TypeError, "num_experts"),
    ("capacity_factor-0", lambda: (_X, _IDS, 3, 0.0), ValueError, "capacity_factor"),
    ("capacity_factor-negative", lambda: (_X, _IDS, 3, -1.0), ValueError, "capacity_factor"),
    ("capacity_factor-inf", lambda: (_X, _IDS, 3, float("inf")), ValueError, "capacity_factor"),
    ("capacity_factor-str", lambda: (_X, _IDS, 3, "1"), TypeError, "capacity_factor"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("build", "exc", "arg"), [pytest.param(*c[1:], id=c[0]) for c in DISPATCH_BAD])
def test_dispatch_bad_input(monkeypatch, path, build, exc, arg):
    use_path(monkeypatch, path, "cpu")
    x, ids, E, cf = build()
    with pytest.raises(exc, match=rf"(?<!\w){arg}(?!\w)"):
        moe_dispatch(x, ids, E, capacity_factor=cf)


COMBINE_BAD = [
    ("plan-tuple", lambda xg, p, w: (xg, tuple(vars(p).values()), w), TypeError, "plan"),
    ("y-int", lambda xg, p, w: (xg.long(), p, w), TypeError, "y"),
    ("y-wrong-rows", lambda xg, p, w: (xg[:-1], p, w), ValueError, "y"),
    ("y-1d", lambda xg, p, w: (xg[:, 0], p, w), ValueError, "y"),
    ("y-other-device", lambda xg, p, w: (xg.to("meta"), p, w), ValueError, "y"),
    ("weights-wrong-shape", lambda xg, p, w: (xg, p, w[:, :1]), ValueError, "weights"),
    ("weights-transposed", lambda xg, p, w: (xg, p, w.t()), ValueError, "weights"),
    ("weights-int", lambda xg, p, w: (xg, p, w.long()), TypeError, "weights"),
    ("weights-other-device", lambda xg, p, w: (xg, p, w.to("meta")), ValueError, "weights"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("build", "exc", "arg"), [pytest.param(*c[1:], id=c[0]) for c in COMBINE_BAD])
def test_combine_bad_input(monkeypatch, path, build, exc, arg):
    use_path(monkeypatch, path, "cpu")
    xg, plan = moe_dispatch(_X, _IDS, 3)
    y, p, w = build(xg, plan, torch.ones(4, 2))
    with pytest.raises(exc, match=rf"(?<!\w){arg}(?!\w)"):
        moe_combine(y, p, w)


# --- docstring examples and reference independence ------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_docstring_examples(monkeypatch, path):
    """The CPU examples of the public functions here and of smptk.testing.moe run as written."""
    import doctest

    import smptk.testing.moe as testing_moe

    use_path(monkeypatch, path, "cpu")
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    attempted = 0
    for fn in (moe_dispatch, moe_combine, md.capacity_of):
        for test in doctest.DocTestFinder().find(fn, fn.__name__, globs={"torch": torch, **vars(md)}):
            result = doctest.DocTestRunner(optionflags=flags).run(test)
            assert result.failed == 0, f"{fn.__name__}: docstring example failed"
            attempted += result.attempted
    result = doctest.testmod(testing_moe, extraglobs={"torch": torch}, optionflags=flags, verbose=False)
    assert result.failed == 0 and attempted > 0 and result.attempted > 0


def test_references_do_not_import_kernels():
    code = "import sys, smptk.testing.moe; assert 'smptk.kernels' not in sys.modules, sorted(sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
