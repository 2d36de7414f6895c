"""The multi-rank side of ``tests/test_expert_parallel.py``: MoE experts as DTensors on the ``ep`` mesh.

One job per world size runs every case in one process group (process start-up dominates a job). Kernels
run on the PyTorch path (``SMPTK_KERNELS=torch``) and the collectives on gloo (the jobs run with
``TRITON_INTERPRET=0``, so smptk.comm takes its torch.distributed fallback; the symmetric-heap
all-to-all under the interpreter is what ``tests/test_moe_ep.py`` covers). Everything is fp32 and every
rank draws every rank's tokens from per-rank seeds, so each rank can run the unsharded reference.

World 2 (``init({"expert_parallel_degree": 2})``: ep = the world):

- ``style``: ``parallelize_module(model, ep_mesh, {"moe": ExpertParallel()})`` on a model holding a MoE
  (top-2 of 8 experts, one shared expert): weights become ``Shard(0)`` DTensors of global shape
  ``[E, ...]`` holding the unsharded layer's values; each rank feeds its own tokens (5 and 9 rows) and
  the output equals the unsharded MoE's on the full batch (the rank's rows of it), the input gradient
  likewise, the router and shared-expert gradients summed over ranks equal the full-batch ones, and the
  expert gradients (``grad.full_tensor()``) equal the full-batch ones;
- ``constructor``: ``MoE(..., ep_group=WORLD)`` (the argument kept from before DTensors) draws the
  unsharded layer's weights for the same seed and computes the same output;
- ``checkpoint``: under ``torch.utils.checkpoint`` (non-reentrant) the EP layer recomputes its forward,
  all-to-alls included, in backward; ``tokens_per_expert`` and every gradient equal the run without
  checkpointing;
- ``selective``: apply_expert_parallel, selective activation checkpointing, apply_data_parallel (the
  experts' unit nested in the checkpointed block, on a 1-rank shard mesh): gradients equal the unchecked
  model's;
- ``dcp``: the EP2 state dict saved with torch.distributed.checkpoint loads into an unsharded MoE (EP1)
  on every rank with the full weights;
- ``bad_input``: experts not divisible by the mesh, a second application, a non-MoE module, a 2-D mesh.

World 4 (``init({"expert_parallel_degree": 2})``: dp_shard 4, ep 2, edp_shard 2):

- ``bias_group``: ``update_expert_bias`` refuses the ep group (2 of the 4 dp ranks) and takes the dp
  DeviceMesh, after which every rank holds the same bias;
- ``ep2_dp2``: ``apply_expert_parallel`` (EP over ``ep``, FSDP2 over ``(dp_replicate, edp_shard)``)
  then ``apply_data_parallel`` (the rest: FSDP2 over ``(dp_replicate, dp_shard)``, the experts' units
  left as they are); three SGD (momentum) steps, each
  rank its own batch, loss ``mean(y * probe) + aux_loss``. The reference is one process running the
  unsharded model on each rank's batch and stepping on the mean of the four losses (FSDP2 averages
  gradients over the 4 data-parallel ranks; the experts' divide factor makes theirs the same mean).
  Losses per step and every parameter after the steps within 1e-5 relative.
- ``ep2_dp2_two_experts``: the same training with 2 experts: one per ``ep`` rank, fewer than the 2
  ``edp_shard`` ranks, so FSDP2 shards the expert weights on dim 1 (``expert_shard_dim``), checked on
  their placements; its DCP checkpoint loads into a plain EP1 module with the trained values.
- ``ep2_hsdp2`` (last): the same training under ``init({"expert_parallel_degree": 2,
  "hybrid_shard_degree": 2})``: dp_replicate 2, dp_shard 2, ep 2 carved from dp_shard, edp_shard 1 (the
  experts replicated across the two replicas, the rest HSDP).
- ``dcp_reshard``: the trained EP2 x DP2 state dict loads under EP4 (``init`` again with
  ``expert_parallel_degree`` 4, plain ``ExpertParallel``, no FSDP) and under EP1 (plain module) with
  the trained model's values (``full_tensor()`` of each parameter).
"""

from __future__ import annotations

import copy
import functools
import os

import torch
import torch.distributed as dist
from helpers import compare_rel
from torch import nn

H, F_, E = 8, 12, 8
REL = 1e-5
_close = functools.partial(compare_rel, rel=REL)


def _tokens(rank: int, rows: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens ``[rows, H]`` and probe for ``step`` (any rank can draw any rank's)."""
    gen = torch.Generator().manual_seed(1000 * step + 100 + rank)
    return torch.randn(rows, H, generator=gen), torch.randn(rows, H, generator=gen)


class Block(nn.Module):
    """``moe(relu(inp(x)))``: a dense layer ahead of the MoE, so FSDP2 has parameters of both kinds."""

    def __init__(self, num_experts: int = E, **moe_options) -> None:
        super().__init__()
        from smptk.parallel import MoE

        self.inp = nn.Linear(H, H)
        self.moe = MoE(H, F_, num_experts, **moe_options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(torch.relu(self.inp(x)))


def _spread_router(model: nn.Module) -> None:
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "router_weight"):
                m.router_weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(7))


# ------------------------------------------------------------------------------------------ world 2


def _style(state, problems: list[str]) -> None:
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from smptk.parallel import ExpertParallel, MoE

    rank, world = state.rank, state.world_size
    torch.manual_seed(0)
    model = nn.ModuleDict({"moe": MoE(H, F_, E, top_k=2, num_shared_experts=1)})
    _spread_router(model)
    ref = copy.deepcopy(model["moe"])
    parallelize_module(model, state.submesh("ep"), {"moe": ExpertParallel()})
    moe = model["moe"]
    for name in ("w_gate", "w_up", "w_down"):
        w = getattr(moe.experts, name)
        if not isinstance(w, DTensor) or tuple(w.placements) != (Shard(0),):
            problems.append(f"{name}: expected a Shard(0) DTensor, got {type(w).__name__}")
            return
        if w.to_local().shape[0] != E // world:
            problems.append(f"{name}: local shard of {w.to_local().shape[0]} experts, expected {E // world}")
        _close(problems, f"{name} values", w, getattr(ref, name))
    rows = [5, 9]
    xs, probes = zip(*(_tokens(r, rows[r]) for r in range(world)), strict=True)
    x = xs[rank].clone().requires_grad_()
    # the experts' output [rows', H] goes back to its senders; nothing may keep it for backward (combine's
    # reordering is a gather whose backward needs only its index: index_copy kept the whole output)
    expert_out, saved = [], set()
    hook = moe.experts.register_forward_hook(
        lambda m, a, out: expert_out.append(out.untyped_storage().data_ptr()), prepend=True
    )
    pack = lambda t: saved.add(t.untyped_storage().data_ptr()) or t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = moe(x)
    hook.remove()
    if expert_out and expert_out[0] in saved:
        problems.append("the experts' output is kept for backward (one more [rows', H] per layer)")
    (y * probes[rank]).sum().backward()
    x_full = torch.cat(xs).requires_grad_()
    y_full = ref(x_full)
    (y_full * torch.cat(probes)).sum().backward()
    lo = sum(rows[:rank])
    _close(problems, "y", y, y_full[lo : lo + rows[rank]])
    _close(problems, "dx", x.grad, x_full.grad[lo : lo + rows[rank]])
    for name in ("router_weight", "shared_gate", "shared_up", "shared_down"):
        total = getattr(moe, name).grad.clone()
        dist.all_reduce(total)  # replicated: each rank's own tokens
        _close(problems, f"d{name}", total, getattr(ref, name).grad)
    for name in ("w_gate", "w_up", "w_down"):
        _close(problems, f"d{name}", getattr(moe, name).grad, getattr(ref, name).grad)
    counts = moe.tokens_per_expert.clone()
    dist.all_reduce(counts)
    if not torch.equal(counts, ref.tokens_per_expert):
        problems.append(f"tokens_per_expert summed {counts.tolist()} vs {ref.tokens_per_expert.tolist()}")


def _constructor(state, problems: list[str]) -> None:
    from smptk.parallel import MoE

    torch.manual_seed(3)
    ep = MoE(H, F_, E, top_k=2, ep_group=dist.group.WORLD)
    torch.manual_seed(3)
    full = MoE(H, F_, E, top_k=2)
    if ep.ep_size != state.world_size or list(ep.local_expert_ids) != list(
        range(state.rank * E // 2, (state.rank + 1) * E // 2)
    ):
        problems.append(f"ep_size {ep.ep_size}, local experts {list(ep.local_expert_ids)}")
    for name, p in full.named_parameters():
        _close(problems, f"{name} init", dict(ep.named_parameters())[name], p)
    x, _ = _tokens(state.rank, 7)
    _close(problems, "y", ep(x), full(x))


def _checkpoint(state, problems: list[str]) -> None:
    from torch.utils.checkpoint import checkpoint

    from smptk.parallel import MoE

    grads, counts = [], []
    for use_ckpt in (False, True):
        torch.manual_seed(4)
        moe = MoE(H, F_, E, top_k=2, aux_loss_coef=0.01, ep_group=dist.group.WORLD)
        _spread_router(moe)
        x, probe = _tokens(state.rank, 6)
        x.requires_grad_()
        block = nn.Sequential(moe, nn.Tanh())  # the recompute runs all of moe (see test_expert_parallel.py)
        y = checkpoint(block, x, use_reentrant=False) if use_ckpt else block(x)
        ((y * probe).sum() + moe.aux_loss).backward()
        grads.append([x.grad] + [p.grad for p in moe.parameters()])
        counts.append(moe.tokens_per_expert.clone())
    if not torch.equal(counts[0], counts[1]):
        problems.append(f"tokens_per_expert with checkpoint {counts[1].tolist()} vs {counts[0].tolist()}")
    for i, (a, b) in enumerate(zip(grads[0], grads[1], strict=True)):
        _close(problems, f"grad {i} with checkpoint", b, a)


def _selective(state, problems: list[str]) -> None:
    """apply_expert_parallel + selective checkpointing + apply_data_parallel at ep = dp_shard (the experts'
    FSDP2 unit on a 1-rank shard mesh, nested in the checkpointed block): backward failed ("profiler.
    _record_function_enter_new ... invocation index 2 ... not found in storage": FSDP2's hook annotations
    differ between forward and recompute); gradients equal the unchecked model's."""
    import smptk.parallel as sp
    from smptk.parallel import MoE

    grads = {}
    for mode in ("none", "selective"):
        torch.manual_seed(6)
        model = nn.Sequential()
        model.layers = nn.ModuleList([nn.Sequential(MoE(H, F_, E, top_k=2), nn.Tanh())])
        model.forward = lambda x, model=model: model.layers[0](x)
        sp.apply_expert_parallel(model, state)
        if mode != "none":
            sp.apply_activation_checkpointing(model, mode=mode)
        model, _ = sp.apply_data_parallel(model, state)
        x, probe = _tokens(state.rank, 6)
        (model(x) * probe).sum().backward()
        grads[mode] = [p.grad.full_tensor() for p in model.parameters()]
    for i, (a, b) in enumerate(zip(grads["none"], grads["selective"], strict=True)):
        _close(problems, f"grad {i} under selective checkpointing", b, a)


def _bias_group(state, problems: list[str]) -> None:
    """update_expert_bias's group must hold every data-parallel rank: the layer's ep group alone (2 of the
    4 dp ranks) used to be accepted and left the two halves of the world with other biases; a 1-D
    DeviceMesh (``state.submesh("dp")``) is taken as its group (a raw torch error before)."""
    from smptk.parallel import MoE

    torch.manual_seed(7)
    moe = MoE(H, F_, E, top_k=2, expert_bias=True, ep_group=state.group("ep"))
    moe(_tokens(state.rank, 6)[0])
    try:
        moe.update_expert_bias(1e-2, group=state.group("ep"))
        problems.append("group=the ep group (2 of 4 dp ranks): accepted")
    except ValueError as e:
        if "not all of this rank's data-parallel ranks" not in str(e):
            problems.append(f"group=the ep group: {e}")
    moe.update_expert_bias(1e-2, group=state.submesh("dp"))
    biases = [torch.empty_like(moe.expert_bias) for _ in range(state.world_size)]
    dist.all_gather(biases, moe.expert_bias)
    if not all(torch.equal(b, biases[0]) for b in biases) or not biases[0].any():
        problems.append(f"biases after an update over dp: {[b.tolist() for b in biases]}")


def _dcp(state, problems: list[str], tmpdir: str) -> None:
    import torch.distributed.checkpoint as dcp

    from smptk.parallel import MoE

    torch.manual_seed(5)
    ep = MoE(H, F_, E, top_k=2, num_shared_experts=1, ep_group=dist.group.WORLD)
    path = os.path.join(tmpdir, "ep2")
    dcp.save(ep.state_dict(), checkpoint_id=path)
    torch.manual_seed(6)  # other values, overwritten by the load
    plain = MoE(H, F_, E, top_k=2, num_shared_experts=1)
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=path)
    plain.load_state_dict(sd)
    for name, p in ep.named_parameters():
        _close(problems, f"EP2 -> EP1 {name}", p, dict(plain.named_parameters())[name])


def _bad_input(state, problems: list[str]) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    from smptk.parallel import ExpertParallel, MoE

    mesh = state.submesh("ep")
    cases = [
        (lambda: parallelize_module(MoE(H, F_, 3), mesh, ExpertParallel()), ValueError, "num_experts 3"),
        (lambda: parallelize_module(nn.Linear(2, 2), mesh, ExpertParallel()), TypeError, "MoE"),
        (lambda: MoE(H, F_, E, ep_group=dist.group.WORLD, ep_mesh=mesh), ValueError, "at most one"),
    ]
    twice = MoE(H, F_, E, ep_mesh=mesh)
    cases.append((lambda: parallelize_module(twice, mesh, ExpertParallel()), ValueError, "already"))
    # experts split at construction, then data parallelism without apply_expert_parallel: torch's "Cannot
    # concatenate overlapping meshes" before; now the unit-less experts are named
    import smptk.parallel as sp

    loose = nn.Sequential(nn.Linear(H, H), MoE(H, F_, E, ep_mesh=mesh))
    cases.append((lambda: sp.apply_data_parallel(loose, state), ValueError, "['1.experts']: expert weights"))
    for i, (call, kind, text) in enumerate(cases):
        try:
            call()
            problems.append(f"bad input {i}: no error (expected {kind.__name__} with {text!r})")
        except kind as e:
            if text not in str(e):
                problems.append(f"bad input {i}: {kind.__name__} {e!s} does not name {text!r}")


# ------------------------------------------------------------------------------------------ world 4


def _ep2_dp2(
    state,
    problems: list[str],
    tmpdir: str | None,
    mode: str = "full_shard",
    num_experts: int = E,
    shard_dim: int = 0,
) -> None:
    """Three training steps under ``state`` against one process; saves the trained state under tmpdir.
    ``shard_dim``: the dim FSDP2 must shard the expert weights on (over the expert mesh's last dp dim)."""
    import torch.distributed.checkpoint as dcp

    from smptk.parallel import apply_data_parallel, apply_expert_parallel

    rank, world = state.rank, state.world_size
    opts = {"top_k": 2, "num_shared_experts": 1, "aux_loss_coef": 0.01}
    torch.manual_seed(0)
    model = Block(num_experts, **opts)
    _spread_router(model)
    ref = copy.deepcopy(model)
    names = apply_expert_parallel(model, state)
    if names != ["moe"]:
        problems.append(f"apply_expert_parallel converted {names}, expected ['moe']")
    model, report = apply_data_parallel(model, state)  # the rest over (dp_replicate, dp_shard)
    if report.mode != mode:
        problems.append(f"apply_data_parallel took mode {report.mode!r}, expected {mode!r}")
    for name in ("w_gate", "w_up", "w_down"):
        placements = tuple(getattr(model.moe.experts, name).placements)
        if getattr(placements[-2], "dim", None) != shard_dim:  # edp_shard's: Shard, or _StridedShard on 0
            problems.append(f"experts.{name}: FSDP2 placements {placements}, expected Shard({shard_dim})")
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    rows = [4, 7, 5, 6]
    for step in range(3):
        batches = [_tokens(r, rows[r], step) for r in range(world)]
        x, probe = batches[rank]
        y = model(x)
        loss = (y * probe).mean() + model.moe.aux_loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        ref_loss = 0.0
        for xr, pr in batches:  # the same objective in one process: mean of the per-rank losses
            ref_loss = ref_loss + ((ref(xr) * pr).mean() + ref.moe.aux_loss) / world
        ref_loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        _close(problems, f"loss step {step}", mean_loss, ref_loss)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        _close(problems, f"{name} after 3 steps", p, ref_params[name])
    if tmpdir is None:
        return
    tag = "" if num_experts == E else f"_e{num_experts}"
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(tmpdir, f"ep2dp2{tag}"))
    trained = {n: p.full_tensor() for n, p in model.named_parameters()}  # collective: every rank
    torch.save(trained, os.path.join(tmpdir, f"trained{tag}{rank}.pt"))
    if num_experts != E:  # the dim-1 expert shards load into a plain module (EP1, no FSDP)
        torch.manual_seed(9)
        plain = Block(num_experts, **opts)
        sd = plain.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(tmpdir, f"ep2dp2{tag}"))
        plain.load_state_dict(sd)
        for name, p in plain.named_parameters():
            _close(problems, f"EP2xDP2 (dim-1 experts) -> EP1 {name}", p, trained[name])


def _dcp_reshard(state, problems: list[str], tmpdir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor.parallel import parallelize_module

    import smptk.parallel as sp

    trained = torch.load(os.path.join(tmpdir, f"trained{state.rank}.pt"))
    path = os.path.join(tmpdir, "ep2dp2")
    state4 = sp.init({"expert_parallel_degree": 4})
    torch.manual_seed(9)
    ep4 = Block(top_k=2, num_shared_experts=1, aux_loss_coef=0.01)
    parallelize_module(ep4, state4.submesh("ep"), {"moe": sp.ExpertParallel()})
    torch.manual_seed(9)
    ep1 = Block(top_k=2, num_shared_experts=1, aux_loss_coef=0.01)
    for label, model in (("EP4", ep4), ("EP1", ep1)):
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=path)
        model.load_state_dict(sd)
        for name, p in model.named_parameters():
            _close(problems, f"EP2xDP2 -> {label} {name}", p, trained[name])
    if ep4.moe.w_gate.to_local().shape[0] != E // 4:
        problems.append(f"EP4: {ep4.moe.w_gate.to_local().shape[0]} local experts, expected {E // 4}")


CASES_2 = ("style", "constructor", "checkpoint", "selective", "dcp", "bad_input")
CASES_4 = ("bias_group", "ep2_dp2", "dcp_reshard", "ep2_dp2_two_experts", "ep2_hsdp2")


def run(rank: int, world: int, tmpdir: str) -> dict[str, str | None]:
    """Every case of this world size on this rank: {case: None or the problems}; ``"seconds"`` per case."""
    import time

    os.environ["SMPTK_KERNELS"] = "torch"
    import smptk.parallel as sp

    state = sp.init({"expert_parallel_degree": 2, "mixed_precision": "fp32"})  # exact against fp32
    calls = {
        "style": lambda p: _style(state, p),
        "constructor": lambda p: _constructor(state, p),
        "checkpoint": lambda p: _checkpoint(state, p),
        "selective": lambda p: _selective(state, p),
        "dcp": lambda p: _dcp(state, p, tmpdir),
        "bad_input": lambda p: _bad_input(state, p),
        "bias_group": lambda p: _bias_group(state, p),
        "ep2_dp2": lambda p: _ep2_dp2(state, p, tmpdir),
        "dcp_reshard": lambda p: _dcp_reshard(state, p, tmpdir),
        "ep2_dp2_two_experts": lambda p: _ep2_dp2(state, p, tmpdir, num_experts=2, shard_dim=1),
        "ep2_hsdp2": lambda p: _ep2_dp2(
            sp.init({"expert_parallel_degree": 2, "hybrid_shard_degree": 2, "mixed_precision": "fp32"}),
            p,
            None,
            "hybrid_shard",
        ),
    }
    out: dict = {"seconds": {}}
    for name in CASES_2 if world == 2 else CASES_4:
        t0 = time.perf_counter()
        problems: list[str] = []
        calls[name](problems)
        out["seconds"][name] = round(time.perf_counter() - t0, 2)
        out[name] = "\n".join(problems) or None
    sp.reset()
    return out
