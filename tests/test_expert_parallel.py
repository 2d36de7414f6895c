"""Expert parallelism as DTensors (smptk.parallel.ExpertParallel, apply_expert_parallel) and a MoE forward
that an activation-checkpoint recompute leaves without side effects.

In-process (one device): the recompute statistics, reentrant and not, and what a recompute must not
change. Multi-rank: one 2-rank and one 4-rank gloo job (``comm_harness.run_ranks``), whose cases are
described in ``ep_jobs.py``; each test reads one case's outcome.
"""

from __future__ import annotations

import pytest
import torch
from comm_harness import JobResult, run_ranks
from ep_jobs import CASES_2, CASES_4
from torch import nn
from torch.utils.checkpoint import checkpoint

from smptk.parallel import GroupedExperts, MoE

H, F_, E = 8, 12, 5
DEADLINE_S = {2: 150, 4: 240}
ENV = {"TRITON_INTERPRET": "0"}  # gloo collectives and the PyTorch kernel path: see ep_jobs.py
_jobs: dict[int, JobResult] = {}


def _job(world: int, tmp_path_factory: pytest.TempPathFactory) -> JobResult:
    if world not in _jobs:
        tmpdir = str(tmp_path_factory.mktemp(f"ep{world}"))
        _jobs[world] = run_ranks("ep_jobs:run", world, args=(tmpdir,), timeout_s=DEADLINE_S[world], env=ENV)
    return _jobs[world]


@pytest.mark.parametrize(
    ("world", "case"), [(2, c) for c in CASES_2] + [(4, c) for c in CASES_4], ids=lambda v: str(v)
)
def test_multi_rank(world: int, case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    result = _job(world, tmp_path_factory)
    result.raise_for_failure()
    problems = [f"rank {r}: {v[case]}" for r, v in enumerate(result.values) if v[case] is not None]
    assert not problems, "\n".join(problems)


def _layer(aux: bool = True) -> MoE:
    torch.manual_seed(0)
    coefs = {"aux_loss_coef": 0.01, "z_loss_coef": 0.001} if aux else {}
    moe = MoE(H, F_, E, top_k=2, **coefs)
    with torch.no_grad():
        moe.router_weight.normal_(0, 0.5)
    return moe


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_recompute_counts_once(monkeypatch: pytest.MonkeyPatch, use_reentrant: bool) -> None:
    """One forward + backward under torch.utils.checkpoint: the same tokens_per_expert, aux_loss,
    last_plan and gradients as without checkpointing (the recompute runs the forward again). The
    reentrant checkpoint runs the first forward under no_grad, so aux_loss would carry no gradient there:
    that case runs without the auxiliary losses. The layer is checkpointed with a tanh after it, as in a
    block: torch's non-reentrant recompute stops once it has rebuilt the last saved tensor, so a MoE
    checkpointed alone would stop before its statistics and hide a double count."""
    monkeypatch.setenv("SMPTK_KERNELS", "torch")
    x = torch.randn(2, 7, H)
    dy = torch.randn(2, 7, H)
    runs = []
    for ckpt in (False, True):
        moe = _layer(aux=not use_reentrant)
        calls = []
        moe.experts.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        xi = x.clone().requires_grad_()
        block = nn.Sequential(moe, nn.Tanh())  # tanh saves its output: the recompute runs all of moe
        y = checkpoint(block, xi, use_reentrant=use_reentrant) if ckpt else block(xi)
        aux, plan = moe.aux_loss, moe.last_plan
        ((y * dy).sum() + aux).backward()
        assert len(calls) == (2 if ckpt else 1), f"{len(calls)} expert forwards: the recompute did not run"
        assert moe.aux_loss is aux and moe.last_plan is plan, (
            "the recompute replaced the forward's statistics"
        )
        runs.append(
            (
                moe.tokens_per_expert.clone(),
                aux.detach(),
                xi.grad,
                {n: p.grad for n, p in moe.named_parameters()},
            )
        )
    (counts, aux, dx, grads), (counts_c, aux_c, dx_c, grads_c) = runs
    assert counts.sum().item() == 2 * 7 * 2, "every (token, slot) pair counted once"
    assert torch.equal(counts_c, counts), f"checkpointed {counts_c.tolist()} vs {counts.tolist()}"
    assert torch.equal(aux_c, aux)
    assert torch.equal(dx_c, dx)
    for name, g in grads.items():
        assert torch.allclose(grads_c[name], g, rtol=1e-6, atol=1e-7), name


def test_forward_in_no_grad_still_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a backward-time forward (a recompute) is skipped: inference forwards count as before."""
    monkeypatch.setenv("SMPTK_KERNELS", "torch")
    moe = _layer()
    with torch.no_grad():
        moe(torch.randn(9, H))
        moe(torch.randn(4, H))
    assert moe.tokens_per_expert.sum().item() == (9 + 4) * 2


def test_experts_submodule_and_aliases() -> None:
    """The routed experts are one submodule (an FSDP2 unit of their own); ``moe.w_gate`` etc. alias it."""
    moe = _layer()
    assert isinstance(moe.experts, GroupedExperts)
    assert moe.w_gate is moe.experts.w_gate and moe.w_down.shape == (E, H, F_)
    assert {n for n, _ in moe.named_parameters()} == {
        "router_weight",
        "experts.w_gate",
        "experts.w_up",
        "experts.w_down",
    }
    assert moe.ep_size == 1 and moe.ep_group is None and list(moe.local_expert_ids) == list(range(E))


def test_grouped_experts_checks_counts() -> None:
    experts = GroupedExperts(E, H, F_)
    with pytest.raises(ValueError, match=r"counts: expected \[5\] rows per held expert"):
        experts(torch.randn(4, H), torch.tensor([4, 0]))
