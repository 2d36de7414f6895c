"""smptk.parallel.MoE on one device against the dense fp32 reference (values and gradients), its options,
edge cases and bad arguments; expert parallelism across 2 and 4 CPU ranks is in test_moe_ep.py.

Under the interpreter the kernels run in fp32 (fp16 for one case); tolerances are relative to the
reference's scale because every output mixes routing weights, three GEMMs and a weighted sum: an error
of 1e-4 of the output's largest value is far above fp32 rounding and far below any wrong routing, a
dropped pair or a transposed weight (all of which move outputs by O(1) of their scale).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import NO_INTERPRETER_REASON

from smptk.kernels import runtime
from smptk.parallel import MoE
from smptk.testing.moe_layer import moe_layer_reference

pytestmark = pytest.mark.skipif(not runtime.interpreter_enabled(), reason=NO_INTERPRETER_REASON)

H, F_, E = 16, 24, 5


def _layer(**kw) -> MoE:
    torch.manual_seed(kw.pop("seed", 0))
    moe = MoE(kw.pop("hidden_size", H), kw.pop("ffn_hidden_size", F_), kw.pop("num_experts", E), **kw)
    with torch.no_grad():
        moe.router_weight.normal_(0, 0.5)  # spread the scores so routing is not decided by rounding
    return moe


def _reference(moe: MoE, x: torch.Tensor):
    """Reference output/aux with fp32 leaf copies of the layer's weights (their grads are the reference's)."""
    names = ["router_weight", "w_gate", "w_up", "w_down"]
    if moe.num_shared_experts:
        names += ["shared_gate", "shared_up", "shared_down"]
    leaves = {n: getattr(moe, n).detach().float().clone().requires_grad_() for n in names}
    x32 = x.detach().float().clone().requires_grad_()
    shared = tuple(leaves[n] for n in names[4:]) or None
    y, aux = moe_layer_reference(
        x32.reshape(-1, moe.hidden_size),
        leaves["router_weight"],
        leaves["w_gate"],
        leaves["w_up"],
        leaves["w_down"],
        moe.top_k,
        score_func=moe.score_func,
        renormalize=moe.renormalize,
        expert_bias=moe.expert_bias,
        capacity_factor=moe.capacity_factor,
        shared=shared,
        aux_loss_coef=moe.aux_loss_coef,
        z_loss_coef=moe.z_loss_coef,
    )
    return y.view(x.shape), aux, x32, leaves


def _close(name: str, got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-4) -> None:
    got, ref = got.detach().float(), ref.detach().float()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} vs reference {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    scale = ref.abs().max().item()
    err = (got - ref).abs().max().item()
    assert err <= rel * scale + 1e-6, f"{name}: max |error| {err:.3g} > {rel:g} x max |ref| {scale:.3g}"


def _check(moe: MoE, x: torch.Tensor, rel: float = 1e-4) -> None:
    """Output, aux loss and every gradient (x and all weights) against the reference."""
    x = x.clone().requires_grad_()
    y = moe(x)
    y_ref, aux_ref, x32, leaves = _reference(moe, x)
    _close("y", y, y_ref, rel)
    _close("aux_loss", moe.aux_loss, aux_ref, rel)
    dy = torch.randn_like(y_ref)
    ((y.float() * dy).sum() + moe.aux_loss).backward()
    ((y_ref * dy).sum() + aux_ref).backward()
    _close("dx", x.grad, x32.grad, rel)
    for name, leaf in leaves.items():
        _close(f"d{name}", getattr(moe, name).grad, leaf.grad, rel)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_matches_reference(score_func: str, top_k: int) -> None:
    moe = _layer(top_k=top_k, score_func=score_func, aux_loss_coef=0.01, z_loss_coef=0.001)
    _check(moe, torch.randn(3, 7, H))


def test_shared_experts_capacity_and_no_renormalize() -> None:
    moe = _layer(
        top_k=2, num_shared_experts=2, shared_ffn_hidden_size=8, capacity_factor=0.75, renormalize=False
    )
    x = torch.randn(19, H)
    _check(moe, x)
    assert moe.last_plan.num_dropped > 0, "capacity 0.75 should drop pairs at T=19, k=2, E=5"


def test_fp16() -> None:
    moe = _layer(top_k=2, dtype=torch.float16)
    _check(moe, torch.randn(11, H, dtype=torch.float16), rel=2e-2)  # fp16 storage of h, y and grads


@pytest.mark.parametrize("case", ["T1", "k_equals_E", "one_expert_takes_all"])
def test_edge_cases(case: str) -> None:
    if case == "T1":
        _check(_layer(top_k=2), torch.randn(1, H))
    elif case == "k_equals_E":
        _check(_layer(top_k=E), torch.randn(6, H))
    else:
        moe = _layer(top_k=1)
        with torch.no_grad():
            moe.router_weight.zero_()
            moe.router_weight[3] = 1.0  # expert 3 wins for every token with positive row sum
        x = torch.rand(9, H) + 0.1
        _check(moe, x)
        assert moe.last_routing.tokens_per_expert.tolist() == [0, 0, 0, 9, 0]
        for e in (0, 1, 2, 4):  # empty experts: gradients exactly zero
            for name in ("w_gate", "w_up", "w_down"):
                assert torch.equal(getattr(moe, name).grad[e], torch.zeros_like(getattr(moe, name)[e])), (
                    f"{name}[{e}] of an empty expert got a nonzero gradient"
                )


def test_no_tokens() -> None:
    moe = _layer(top_k=2)
    y = moe(torch.randn(0, H))
    assert y.shape == (0, H)


def test_expert_bias_changes_selection_and_update_balances() -> None:
    moe = _layer(top_k=1, expert_bias=True)
    x = torch.randn(40, H)
    moe(x)
    load = moe.update_expert_bias(rate=0.5)
    assert load.sum().item() == 40
    assert moe.tokens_per_expert.sum().item() == 0, "counts are reset by the update"
    mean = load.float().mean()
    expected = 0.5 * torch.sign(mean - load.float())
    assert torch.equal(moe.expert_bias, expected)
    with torch.no_grad():
        moe.expert_bias.zero_()
        moe.expert_bias[2] = 100.0  # a huge bias: every token picks expert 2, weights still unbiased
    y = moe(x)
    assert moe.last_routing.expert_ids.unique().tolist() == [2]
    _check(moe, x)  # the reference gets the same bias
    assert torch.isfinite(y).all()


def test_only_training_forwards_count_tokens() -> None:
    """Evaluation and generation forwards (module.eval()) leave tokens_per_expert alone: they used to add
    to the load update_expert_bias balances (10 validation batches outweighed the training batch)."""
    moe = _layer(top_k=2, expert_bias=True)
    x = torch.randn(9, H)
    moe(x)
    assert moe.tokens_per_expert.sum().item() == 9 * 2
    moe.eval()
    with torch.no_grad():
        for _ in range(3):
            moe(x)
    assert moe.tokens_per_expert.sum().item() == 9 * 2 and moe.aux_loss is not None


def test_expert_bias_stays_fp32_through_dtype_casts() -> None:
    """.bfloat16() / .half() / .to(dtype) cast parameters, not expert_bias: a 1e-3 update of a bias near
    0.5 used to vanish in bf16 for the underloaded experts (and overshoot for the overloaded one)."""
    moe = _layer(top_k=1, expert_bias=True)
    with torch.no_grad():
        moe.expert_bias.fill_(0.5)
    for cast in (lambda m: m.bfloat16(), lambda m: m.half(), lambda m: m.to(torch.bfloat16)):
        cast(moe)
        assert moe.expert_bias.dtype == torch.float32 and moe.router_weight.dtype != torch.float32
        assert moe.tokens_per_expert.dtype == torch.int64
    moe.float()
    x = torch.randn(40, H)
    moe.bfloat16()
    moe(x.bfloat16())
    load = moe.update_expert_bias(rate=1e-3)
    want = 0.5 + 1e-3 * torch.sign(load.float().mean() - load.float())
    assert torch.equal(moe.expert_bias, want)
    assert "expert_bias" in moe.state_dict()


def test_loading_a_state_dict_starts_the_token_count_afresh() -> None:
    """tokens_per_expert is not saved; after to_empty (uninitialized memory) + load_state_dict, the usual
    way to fill a meta-built model, it held garbage that update_expert_bias steered the router by."""
    src = _layer(top_k=2, expert_bias=True)
    with torch.no_grad():
        src.expert_bias.uniform_(-0.1, 0.1)
    src(torch.randn(9, H))
    assert "tokens_per_expert" not in src.state_dict() and src.tokens_per_expert.sum() == 18
    with torch.device("meta"):
        moe = _layer(top_k=2, expert_bias=True)
    moe.to_empty(device="cpu")
    moe.tokens_per_expert.fill_(123456)  # what uninitialized memory may hold
    moe.load_state_dict(src.state_dict())
    assert torch.equal(moe.tokens_per_expert, torch.zeros_like(moe.tokens_per_expert))
    assert torch.equal(moe.expert_bias, src.expert_bias)
    x = torch.randn(5, H)
    moe(x)
    assert int(moe.tokens_per_expert.sum()) == 10


def test_recorded_router_probs_survive_checkpoint_recompute() -> None:
    """record_router_probs under non-reentrant checkpointing: the recompute saves what the forward saved
    (the probabilities were computed in the forward only: "a different number of tensors was saved"),
    and last_router_probs is the forward's, with its gradient reaching the router."""
    from torch.utils.checkpoint import checkpoint

    moe = _layer(top_k=2)
    moe.record_router_probs = True
    x = torch.randn(9, H)
    y = checkpoint(moe, x, use_reentrant=False)
    probs = moe.last_router_probs
    assert probs.shape == (9, E) and torch.allclose(probs.sum(1), torch.ones(9))
    (y.sum() + probs.mean(0).square().sum()).backward()
    assert moe.router_weight.grad is not None and moe.last_router_probs is probs


def test_router_runs_in_fp32_under_autocast() -> None:
    """The router's logits are fp32 whatever x's dtype; under autocast F.linear re-cast its fp32 operands to
    bf16, so the routing (weights, and for some tokens the experts) changed."""
    moe = _layer(top_k=2)
    x = torch.randn(64, H)
    moe(x)
    plain = moe.last_routing
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe(x)
    assert torch.equal(moe.last_routing.expert_ids, plain.expert_ids)
    assert torch.equal(moe.last_routing.weights, plain.weights)


def test_reentrant_checkpointing_warns_that_aux_loss_has_no_gradient() -> None:
    """Reentrant activation checkpointing runs the forward under no_grad: aux_loss then has no gradient and
    the router silently lost its load-balancing gradient; the layer warns. Non-reentrant does not."""
    from torch.utils.checkpoint import checkpoint

    moe = _layer(top_k=2, aux_loss_coef=0.01)
    x = torch.randn(7, H, requires_grad=True)
    with pytest.warns(UserWarning, match="aux_loss carries no gradient"):
        checkpoint(moe, x, use_reentrant=True)
    assert not moe.aux_loss.requires_grad
    with warnings.catch_warnings():
        # smptk's warnings (UserWarning), not Triton 3.6's interpreter's NumPy DeprecationWarning (its int()
        # of a 1-element array, on the loop over top_k) under the GPU image's versions
        warnings.simplefilter("error", UserWarning)
        checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.aux_loss.requires_grad


def test_update_expert_bias_needs_the_option() -> None:
    with pytest.raises(RuntimeError, match="expert_bias=True"):
        _layer().update_expert_bias()


def test_update_expert_bias_counts_each_token_once_under_tensor_parallelism() -> None:
    """tp = world (no data parallelism): every rank routes the same tokens, so no group is needed and none
    is warned about (it warned of data-parallel replicas that do not exist); a group holding tensor-parallel
    peers is refused (their counts were added once per peer: the load came back tp times too large). With
    dp 2 the missing group is still warned about. This process plays rank 0 on torch's fake group."""
    import torch.distributed as dist
    from helpers import fake_world

    import smptk.parallel as sp

    with fake_world(4):
        state = sp.init({"tensor_parallel_degree": 4})
        moe = MoE(8, 16, 4, 2, expert_bias=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            moe.update_expert_bias(1e-3)
        with pytest.raises(ValueError, match=r"holds ranks \[1, 2, 3\] outside .*tensor-parallel peers"):
            moe.update_expert_bias(1e-3, group=dist.group.WORLD)
        moe.update_expert_bias(1e-3, group=state.group("dp"))
        sp.reset()
        sp.init({"tensor_parallel_degree": 2})
        with pytest.warns(UserWarning, match="no group in a multi-process job"):
            moe.update_expert_bias(1e-3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 6}, "top_k: expected at most num_experts=5"),
        ({"top_k": 0}, "top_k: expected a positive integer"),
        ({"score_func": "relu"}, "score_func"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"aux_loss_coef": -1.0}, "aux_loss_coef"),
        ({"num_shared_experts": -1}, "num_shared_experts"),
        (
            {"num_shared_experts": 1, "shared_ffn_hidden_size": 0},
            "shared_ffn_hidden_size: expected a positive",
        ),
        (
            {"num_shared_experts": 1, "shared_ffn_hidden_size": -3},
            "shared_ffn_hidden_size: expected a positive",
        ),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MoE(H, F_, E, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"renormalize": 1}, {"renormalize": "no"}, {"expert_bias": "false"}, {"expert_bias": torch.zeros(E)}],
)
def test_non_bool_flags_are_refused_at_construction(kwargs: dict) -> None:
    """renormalize and expert_bias take bools: a truthy string switched the expert bias on, a tensor bias
    failed with torch's "Boolean value of Tensor ... is ambiguous", and renormalize=1 was refused only at
    the first forward (by moe_route)."""
    (name,) = kwargs
    with pytest.raises(TypeError, match=f"{name}: expected a bool"):
        MoE(H, F_, E, **kwargs)


def test_numpy_and_huge_capacity_factors() -> None:
    """numpy scalars are taken as the numbers they are (np.float32(1.25) was refused as "not a finite number
    > 0"), and a capacity factor past every expert's share (1e30, 10**400) drops nothing."""
    import numpy as np

    x = torch.randn(9, H, generator=torch.Generator().manual_seed(4))
    assert MoE(H, F_, E, capacity_factor=np.float32(1.25)).capacity_factor == 1.25
    assert MoE(H, F_, E, aux_loss_coef=np.float64(0.01)).aux_loss_coef == 0.01
    for cf in (1e30, 10**400):
        moe = _layer(top_k=2, capacity_factor=cf)
        dropless = _layer(top_k=2)
        assert torch.equal(moe(x), dropless(x)) and moe.last_plan.num_dropped == 0


def test_deepcopy_after_a_training_forward() -> None:
    """The copy (an EMA or reference model) has the layer's state and none of its latest forward's outputs,
    which are attached to the autograd graph (deep-copying them raised); it computes what the layer does."""
    import copy

    moe = _layer(top_k=2, num_shared_experts=1, aux_loss_coef=0.01)
    moe.record_router_probs = True  # as transform sets it for output_router_logits: probs on the graph too
    x = torch.randn(7, H, requires_grad=True)
    y = moe(x)
    assert moe.aux_loss is not None and moe.aux_loss.requires_grad and moe.last_router_probs.requires_grad
    twin = copy.deepcopy(moe)
    assert twin.aux_loss is None and twin.last_routing is None and twin.last_plan is None
    assert twin.last_router_probs is None
    assert moe.aux_loss is not None, "the original keeps its loss for the backward"
    for (name, p), q in zip(moe.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), name
    assert torch.equal(twin(x.detach()), y.detach())
    (y.sum() + moe.aux_loss).backward()  # the original's graph is intact
    assert moe.router_weight.grad is not None and twin.router_weight.grad is None


def test_bad_input_shape() -> None:
    with pytest.raises(ValueError, match=r"x: expected \[\.\.\., 16\]"):
        _layer()(torch.randn(4, H + 1))
