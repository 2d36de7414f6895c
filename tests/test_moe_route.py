"""moe_route against the fp32 reference (smptk.testing.moe): ids and counts exactly, weights, losses and
the logits' gradient within the derived tolerance, both paths, every dtype.

CPU: the Triton path under the interpreter (bf16 included: these kernels use no tl.dot) with
``SMPTK_POISON_OUTPUTS=1``, so any output element no program writes is NaN (floats) or the int minimum
(ids, counts) and fails; the torch path too. CUDA cases at real sizes carry the ``gpu`` marker.
The interpreter's blocks are 16 tokens per program in sub-blocks of <= 8 (``_FWD_BLOCKS_INTERPRETER``), so
T = 5 is smaller than one block and T = 37 or 40 crosses programs and sub-blocks.

Legend: T tokens, E experts, k = top_k.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import DTYPES, dtype_id, generator, randn, use_path

from smptk.kernels.moe_route import moe_route
from smptk.testing import assert_close
from smptk.testing.moe import moe_route_reference

PATHS = ("triton", "torch")
SCORE_FUNCS = ("softmax", "sigmoid")
# fp32 roundings inside the route on top of the sums: exp, log, and up to two divisions (normalization,
# renormalization) per value; r of the tolerance model (smptk/testing/tolerances.py).
ROUNDINGS = 4


def route_logits(T: int, E: int, *, dtype, device="cpu", seed=0, std=2.0) -> torch.Tensor:
    return randn((T, E), dtype=dtype, device=device, gen=generator(device, seed), std=std).requires_grad_()


def check_route(
    logits: torch.Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    renormalize: bool = True,
    expert_bias: torch.Tensor | None = None,
    seed: int = 1,
):
    """Run moe_route and the reference on the same values; compare every output and, when logits require
    grad, the gradient of ``sum(weights * g) + c_aux * aux_loss + c_z * z_loss`` (random g, c_aux, c_z)."""
    T, E = logits.shape
    kwargs = dict(score_func=score_func, renormalize=renormalize, expert_bias=expert_bias)
    r = moe_route(logits, top_k, **kwargs)
    leaf = logits.detach().float().requires_grad_(logits.requires_grad)
    ref = moe_route_reference(leaf, top_k, **kwargs)
    assert r.weights.dtype == torch.float32 and r.weights.shape == (T, top_k)
    assert r.expert_ids.dtype == torch.int32 and r.expert_ids.shape == (T, top_k)
    assert r.tokens_per_expert.dtype == torch.int64 and r.tokens_per_expert.shape == (E,)
    assert r.aux_loss.shape == () and r.z_loss.shape == ()
    assert torch.equal(r.expert_ids.long(), ref.expert_ids), "expert_ids differ from the reference"
    assert torch.equal(r.tokens_per_expert, ref.tokens_per_expert), "tokens_per_expert differ"
    assert int(r.tokens_per_expert.sum()) == T * top_k
    fp32 = torch.float32
    assert_close(r.weights, ref.weights, dtype=fp32, reduction_len=E, roundings=ROUNDINGS, name="weights")
    n = max(T * E, 1)
    assert_close(r.aux_loss, ref.aux_loss, dtype=fp32, reduction_len=n, roundings=ROUNDINGS, name="aux_loss")
    assert_close(r.z_loss, ref.z_loss, dtype=fp32, reduction_len=n, roundings=ROUNDINGS, name="z_loss")
    if logits.requires_grad:
        gen = generator(logits.device, seed)
        g = randn((T, top_k), dtype=fp32, device=logits.device, gen=gen)
        c_aux, c_z = (torch.rand(2, generator=gen, device=logits.device) + 0.5).tolist()
        loss = (r.weights * g).sum() + c_aux * r.aux_loss + c_z * r.z_loss
        (dlogits,) = torch.autograd.grad(loss, logits)
        ref_loss = (ref.weights * g).sum() + c_aux * ref.aux_loss + c_z * ref.z_loss
        (ref_dlogits,) = torch.autograd.grad(ref_loss, leaf)
        assert dlogits.dtype == logits.dtype and dlogits.shape == logits.shape
        assert_close(
            dlogits,
            ref_dlogits,
            dtype=logits.dtype,
            reduction_len=E + top_k,
            roundings=ROUNDINGS,
            name="dlogits",
        )
    return r


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "norenorm"])
@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("path", PATHS)
def test_values_and_grads(monkeypatch, path, dtype, score_func, renormalize):
    use_path(monkeypatch, path, "cpu")
    check_route(route_logits(37, 7, dtype=dtype), 2, score_func=score_func, renormalize=renormalize)


# (T, E, k): one token; T below one block; k = 1 and k = E; several programs and sub-blocks; E = 64 makes
# the interpreter's sub-block a single token; E = 1; T = 0.
SHAPES = [
    (1, 7, 3),
    (1, 1, 1),
    (5, 7, 1),
    (5, 7, 7),
    (40, 7, 2),
    (33, 16, 4),
    (17, 3, 3),
    (9, 64, 8),
    (0, 5, 2),
]


@pytest.mark.parametrize(("T", "E", "k"), SHAPES, ids=[f"T{t}-E{e}-k{k}" for t, e, k in SHAPES])
@pytest.mark.parametrize("path", PATHS)
def test_shapes(monkeypatch, path, T, E, k):
    use_path(monkeypatch, path, "cpu")
    check_route(route_logits(T, E, dtype=torch.float32, seed=T + E), k)
    bias = randn((E,), dtype=torch.float32, device="cpu", gen=generator("cpu", 3), std=0.1)
    check_route(route_logits(T, E, dtype=torch.float16, seed=k), k, score_func="sigmoid", expert_bias=bias)


@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("path", PATHS)
def test_ties_go_to_the_lower_id(monkeypatch, path, score_func):
    """All-equal logits: every token picks experts 0..k-1 in that order, for every k."""
    use_path(monkeypatch, path, "cpu")
    T, E = 11, 7
    for k in (1, 3, E):
        logits = torch.full((T, E), 0.25, requires_grad=True)
        r = check_route(logits, k, score_func=score_func)
        assert r.expert_ids.tolist() == [list(range(k))] * T
        assert_close(r.weights, torch.full((T, k), 1.0 / k), dtype=torch.float32, reduction_len=E, name="w")
    # Ties among the largest only: [1, 3, 3, 0, 3] -> 1, 2, 4 then 0.
    row = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]]).repeat(3, 1)
    assert check_route(row, 4, score_func=score_func).expert_ids.tolist() == [[1, 2, 4, 0]] * 3


@pytest.mark.parametrize("path", PATHS)
def test_the_losses_take_in_place_updates(monkeypatch, path):
    """``loss = r.aux_loss; loss *= c; loss += c2 * r.z_loss``: the Triton path returned views of its
    buffers, which refused in-place updates ("Output 3 of MoERouteFunction is a view"); now both paths
    take them, with the gradient of the out-of-place expression."""
    use_path(monkeypatch, path, "cpu")
    logits = route_logits(9, 5, dtype=torch.float32)
    r = moe_route(logits, 2)
    assert r.aux_loss.shape == () and r.z_loss.shape == () and not r.aux_loss._is_view()
    loss = r.aux_loss
    loss *= 0.01
    loss += 0.001 * r.z_loss
    (got,) = torch.autograd.grad(loss, logits)
    r = moe_route(logits, 2)
    (want,) = torch.autograd.grad(0.01 * r.aux_loss + 0.001 * r.z_loss, logits)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_the_ids_and_counts_take_in_place_edits(monkeypatch, path):
    """A caller's in-place edit of the returned ``expert_ids`` or ``tokens_per_expert`` leaves the gradient
    as it was: the Triton path saved those very tensors for backward, which then raised "one of the
    variables needed for gradient computation has been modified by an inplace operation" (the PyTorch
    path took the edits)."""
    use_path(monkeypatch, path, "cpu")
    logits = route_logits(9, 5, dtype=torch.float32)
    r = moe_route(logits, 2)
    (want,) = torch.autograd.grad(r.weights.sum() + r.aux_loss, logits)
    r = moe_route(logits, 2)
    r.expert_ids.add_(1)
    r.tokens_per_expert.zero_()
    (got,) = torch.autograd.grad(r.weights.sum() + r.aux_loss, logits)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_nan_keys_come_after_every_number(monkeypatch, path):
    """A NaN selection key (a diverged expert_bias entry; a NaN logit under sigmoid) is picked only after
    every number, then NaN keys by id, on both paths: the PyTorch path's sort put NaN first, so every token
    went to the NaN expert (and under sigmoid got NaN weights) where the kernel routed around it."""
    use_path(monkeypatch, path, "cpu")
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0, 0.0]]).repeat(3, 1)
    bias = torch.tensor([float("nan"), 0.0, 0.0, float("nan"), 0.0])
    r = moe_route(logits, 5, expert_bias=bias)
    assert r.expert_ids.tolist() == [[1, 2, 4, 0, 3]] * 3
    assert r.tokens_per_expert.tolist() == [3] * 5
    r = moe_route(logits, 2, expert_bias=bias)
    assert r.expert_ids.tolist() == [[1, 2]] * 3 and bool(torch.isfinite(r.weights).all())
    nan_logit = logits.clone()
    nan_logit[:, 1] = float("nan")
    r = moe_route(nan_logit, 2, score_func="sigmoid")
    assert r.expert_ids.tolist() == [[2, 0]] * 3 and bool(torch.isfinite(r.weights).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("path", PATHS)
def test_many_ties_low_precision(monkeypatch, path, dtype):
    """Small integer logits (exact in every dtype) tie often; ids must match the reference exactly."""
    use_path(monkeypatch, path, "cpu")
    gen = generator("cpu", 7)
    logits = torch.randint(-2, 3, (40, 7), generator=gen).to(dtype).requires_grad_()
    check_route(logits, 3)
    check_route(logits, 2, score_func="sigmoid", renormalize=False)


@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("path", PATHS)
def test_expert_bias_moves_selection_not_weights(monkeypatch, path, score_func):
    use_path(monkeypatch, path, "cpu")
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]], requires_grad=True)
    plain = moe_route(logits, 2, score_func=score_func)
    assert plain.expert_ids.tolist() == [[0, 1], [3, 2]]
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0], requires_grad=True)
    r = check_route(logits, 2, score_func=score_func, expert_bias=bias)
    assert r.expert_ids.tolist() == [[3, 0], [3, 2]]
    assert r.tokens_per_expert.tolist() == [1, 0, 1, 2]  # the counts follow the biased selection
    s = logits.detach()
    score = torch.softmax(s, -1) if score_func == "softmax" else torch.sigmoid(s)
    picked = score.gather(1, r.expert_ids.long())
    assert_close(
        r.weights, picked / picked.sum(1, keepdim=True), dtype=torch.float32, reduction_len=4, name="w"
    )
    again = moe_route(logits, 2, score_func=score_func, expert_bias=bias)
    (again.weights.sum() + again.aux_loss).backward()
    assert logits.grad is not None
    assert bias.grad is None, "expert_bias must get no gradient"
    rn = check_route(logits, 2, score_func=score_func, renormalize=False, expert_bias=bias)
    assert_close(rn.weights, picked, dtype=torch.float32, reduction_len=4, roundings=ROUNDINGS, name="w raw")


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("path", PATHS)
def test_every_token_on_one_expert(monkeypatch, path, k):
    """Expert 3 wins everywhere: it gets T tokens, the experts never picked get 0 (empty experts)."""
    use_path(monkeypatch, path, "cpu")
    T, E = 13, 7
    logits = route_logits(T, E, dtype=torch.float32, std=0.5).detach()
    logits[:, 3] += 20.0
    r = check_route(logits.requires_grad_(), k)
    assert r.tokens_per_expert[3] == T
    assert (r.expert_ids[:, 0] == 3).all()
    if k == 1:
        assert r.tokens_per_expert.tolist() == [0, 0, 0, T, 0, 0, 0]


@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("path", PATHS)
def test_uniform_router_losses(monkeypatch, path, score_func):
    """Equal logits c: P_e = 1/E so aux_loss = sum_e f_e = 1 however the picks fall; z = (c + log E)^2."""
    use_path(monkeypatch, path, "cpu")
    T, E, c = 9, 5, 0.5
    r = moe_route(torch.full((T, E), c), 2, score_func=score_func)
    assert abs(r.aux_loss.item() - 1.0) < 1e-6
    assert abs(r.z_loss.item() - (c + math.log(E)) ** 2) < 1e-5


@pytest.mark.parametrize("layout", ["transposed", "column-slice"])
@pytest.mark.parametrize("path", PATHS)
def test_noncontiguous_logits_and_grad(monkeypatch, path, layout):
    use_path(monkeypatch, path, "cpu")
    T, E = 21, 7
    if layout == "transposed":
        base = route_logits(E, T, dtype=torch.float16)
        logits = base.t()
    else:
        base = route_logits(T, E + 3, dtype=torch.float16)
        logits = base[:, 2 : 2 + E]
    assert not logits.is_contiguous()
    check_route(logits, 3, score_func="sigmoid")
    # weights.sum() sends an expanded (stride 0) gradient.
    r = moe_route(logits, 3)
    ref = moe_route_reference(leaf := logits.detach().float().requires_grad_(), 3)
    (g,) = torch.autograd.grad(r.weights.sum(), base)
    (ref_g,) = torch.autograd.grad(ref.weights.sum(), leaf)
    g = g.t() if layout == "transposed" else g[:, 2 : 2 + E]
    assert_close(g, ref_g, dtype=torch.float16, reduction_len=E, roundings=ROUNDINGS, name="dlogits")


@pytest.mark.parametrize("path", PATHS)
def test_renormalized_sigmoid_scores_that_underflow(monkeypatch, path):
    """A token whose sigmoid scores all underflow to 0 (logits below about -104) gets zero weights and a
    finite aux loss and gradient, not 0 / 0 = NaN: the sums that normalize the scores take ``RENORM_EPS``
    (1e-20); the other tokens' weights are unchanged (still summing to 1 in fp32)."""
    use_path(monkeypatch, path, "cpu")
    logits = torch.tensor([[5.0, 0.0, -1.0], [-120.0, -130.0, -125.0], [1.0, 2.0, 3.0]], requires_grad=True)
    r = moe_route(logits, 2, score_func="sigmoid", renormalize=True)
    assert torch.equal(r.weights[1], torch.zeros(2))
    ref = moe_route_reference(logits.detach(), 2, score_func="sigmoid", renormalize=True)
    torch.testing.assert_close(r.weights[[0, 2]], ref.weights[[0, 2]].float(), rtol=1e-6, atol=0)
    assert torch.isfinite(r.aux_loss)
    loss = (r.weights * torch.tensor([1.0, -2.0])).sum() + 0.5 * r.aux_loss
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(grad).all() and torch.equal(grad[1], torch.zeros(3))


@pytest.mark.parametrize("score_func", SCORE_FUNCS)
def test_infinite_and_nan_logits_give_the_torch_paths_values(monkeypatch, score_func):
    """Rows with an inf logit, a NaN logit or only -inf ones: the Triton path's weights, ids, z-loss and
    gradients are the PyTorch path's (autograd of the same math). Its backward added the unused z-loss's
    and (sigmoid) aux loss's terms times a zero gradient, so 0 * NaN turned such a row's whole gradient NaN
    where torch's is finite, and its logsumexp was NaN where torch.logsumexp is +-inf."""
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0], [inf, 0.0, 1.0, 2.0], [nan, 0.0, 1.0, 2.0], [-inf] * 4])
    g = torch.tensor([[1.0, 2.0]]).expand(4, 2)
    got = {}
    for path in PATHS:
        use_path(monkeypatch, path, "cpu")
        leaf = logits.clone().requires_grad_()
        r = moe_route(leaf, 2, score_func=score_func, renormalize=False)
        (grad,) = torch.autograd.grad((r.weights * g).sum(), leaf)
        got[path] = (r.weights, r.expert_ids, r.z_loss, grad)
    for name, a, b in zip(("weights", "ids", "z_loss", "dlogits"), *got.values(), strict=True):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=1e-6, atol=1e-7, msg=name)
    use_path(monkeypatch, "triton", "cpu")
    one_inf = moe_route(logits[:2], 2, score_func=score_func).z_loss  # no NaN row: torch.logsumexp's inf
    assert one_inf == inf, one_inf
    if score_func == "sigmoid":  # finite gradients where the picked scores are finite (rows 0, 1, 3)
        assert torch.isfinite(got["triton"][3][[0, 1, 3]]).all()


def test_paths_agree(monkeypatch):
    """SMPTK_KERNELS=torch and the Triton path: same ids and counts, weights and losses within rounding."""
    logits = route_logits(40, 7, dtype=torch.bfloat16, seed=5)
    bias = torch.linspace(-0.05, 0.05, 7)
    got = {}
    for path in PATHS:
        use_path(monkeypatch, path, "cpu")
        got[path] = moe_route(logits, 3, score_func="sigmoid", expert_bias=bias)
    a, b = got["triton"], got["torch"]
    assert torch.equal(a.expert_ids, b.expert_ids) and torch.equal(a.tokens_per_expert, b.tokens_per_expert)
    for name in ("weights", "aux_loss", "z_loss"):
        assert_close(
            getattr(a, name),
            getattr(b, name).detach(),
            dtype=torch.float32,
            reduction_len=280,
            roundings=ROUNDINGS,
            name=name,
        )


@pytest.mark.parametrize("path", PATHS)
def test_no_grad(monkeypatch, path):
    use_path(monkeypatch, path, "cpu")
    logits = route_logits(7, 5, dtype=torch.float32).detach()
    with torch.no_grad():
        r = moe_route(logits, 2)
    assert not r.weights.requires_grad and not r.aux_loss.requires_grad
    check_route(logits, 2)


# --- CUDA at real sizes ---------------------------------------------------------------------------------

CUDA_CASES = [
    (4096, 64, 8, "softmax"),
    (4097, 256, 8, "sigmoid"),
    (1, 7, 7, "softmax"),
    (1000, 160, 6, "softmax"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(("T", "E", "k", "score_func"), CUDA_CASES)
def test_cuda(monkeypatch, dtype, T, E, k, score_func):
    use_path(monkeypatch, "triton", "cuda")
    bias = randn((E,), dtype=torch.float32, device="cuda", gen=generator("cuda", 2), std=0.01)
    check_route(route_logits(T, E, dtype=dtype, device="cuda"), k, score_func=score_func, expert_bias=bias)


# --- bad input ----------------------------------------------------------------------------------------

BAD_INPUTS = [
    ("logits-list", lambda lg: ([[0.0, 1.0]], 1, {}), TypeError, "logits"),
    ("logits-int", lambda lg: (lg.long(), 1, {}), TypeError, "logits"),
    ("logits-1d", lambda lg: (lg[0], 1, {}), ValueError, "logits"),
    ("logits-3d", lambda lg: (lg[None], 1, {}), ValueError, "logits"),
    ("logits-no-experts", lambda lg: (lg[:, :0], 1, {}), ValueError, "logits"),
    ("top_k-0", lambda lg: (lg, 0, {}), ValueError, "top_k"),
    ("top_k-above-E", lambda lg: (lg, 6, {}), ValueError, "top_k"),
    ("top_k-float", lambda lg: (lg, 2.0, {}), TypeError, "top_k"),
    ("top_k-bool", lambda lg: (lg, True, {}), TypeError, "top_k"),
    ("score_func-relu", lambda lg: (lg, 2, {"score_func": "relu"}), ValueError, "score_func"),
    ("renormalize-str", lambda lg: (lg, 2, {"renormalize": "yes"}), TypeError, "renormalize"),
    ("expert_bias-long", lambda lg: (lg, 2, {"expert_bias": torch.zeros(6)}), ValueError, "expert_bias"),
    ("expert_bias-2d", lambda lg: (lg, 2, {"expert_bias": torch.zeros(1, 5)}), ValueError, "expert_bias"),
    (
        "expert_bias-int",
        lambda lg: (lg, 2, {"expert_bias": torch.zeros(5, dtype=torch.int64)}),
        TypeError,
        "expert_bias",
    ),
    (
        "expert_bias-other-device",
        lambda lg: (lg, 2, {"expert_bias": torch.zeros(5, device="meta")}),
        ValueError,
        "expert_bias",
    ),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("build", "exc", "arg"), [pytest.param(*c[1:], id=c[0]) for c in BAD_INPUTS])
def test_bad_input(monkeypatch, path, build, exc, arg):
    """Each bad argument raises the documented error type, and the message names that argument."""
    use_path(monkeypatch, path, "cpu")
    logits, k, kwargs = build(torch.randn(4, 5))
    with pytest.raises(exc, match=rf"(?<!\w){arg}(?!\w)"):
        moe_route(logits, k, **kwargs)


@pytest.mark.parametrize("path", PATHS)
def test_docstring_example(monkeypatch, path):
    """moe_route's CPU example (the 4-token worked example of the module docstring) runs as written."""
    import doctest

    use_path(monkeypatch, path, "cpu")
    fn = moe_route
    tests = doctest.DocTestFinder().find(fn, "moe_route", globs={"torch": torch, "moe_route": fn})
    results = [doctest.DocTestRunner().run(t) for t in tests]
    assert sum(r.attempted for r in results) > 0 and sum(r.failed for r in results) == 0
