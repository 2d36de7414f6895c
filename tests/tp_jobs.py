"""The multi-rank side of ``tests/test_tensor_parallel.py``: smptk's tensor-parallel layers on W gloo ranks.

One job per world size runs every case in one process group (process start-up dominates a job). The
layer cases run at tensor-parallel size W (``smptk.parallel.init({"tensor_parallel_degree": W})``); the
FSDP2 case (W = 4) re-inits at TP 2 x DP 2.

Every case compares a sharded layer with the unsharded torch module it replaces (``nn.Linear``,
``nn.Embedding``, ``F.cross_entropy``), built from the same seed, in fp32: the initial weights exactly
(``reset_parameters`` draws the full weight and keeps the shard), then the output and the gradients of
the input and of every parameter shard within 1e-6 (absolute and relative: the shard's GEMM reduces over
the same K as the full one, but an input gradient summed over ranks rounds in another order). The loss
is ``sum(y * P)`` for a seeded probe P: on a replicated output every rank computes it once; on a sharded
output (features or sequence) each rank takes its slice of P, and the objective is their sum, which is
the reference's. Activations are ``[b, s, h]`` with ``sequence_dim=1`` or ``[s, b, h]`` with 0, sizes
odd where they are not split (K 5, N_local 3, b 2). Kernels run on the PyTorch path
(``SMPTK_KERNELS=torch``: the interpreter is slow) except in the "triton" case; collectives run on
smptk's symmetric heap when the job has ``TRITON_INTERPRET=1`` (the harness's default) and on the
torch.distributed (gloo) fallback when it is set to 0, and the column case checks
``smptk.comm.last_path()`` says so. A failed comparison is recorded and the job goes on; any other
exception ends the job.

Example::

    >>> from comm_harness import run_ranks
    >>> run_ranks("tp_jobs:run", world=2, args=(["column", "row"],), timeout_s=120).values[0]
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from smptk.comm.fused_linear import last_backward_path

TOL = 1e-6


class _Ctx:
    def __init__(self, state):
        from smptk import settings

        self.state = state
        self.mesh = state.submesh("tp")
        self.tp = self.mesh.size()
        self.r = self.mesh.get_local_rank()
        self.seed = 100
        # fp32 collectives run on smptk's symmetric heap under the interpreter, on gloo without it
        self.comm_path = "symmetric" if settings.triton_interpret() else "torch.distributed:gloo"

    def next_seed(self) -> int:
        self.seed += 1
        return self.seed

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        """The same values on every rank (a generator seeded per call)."""
        return torch.randn(shape, generator=torch.Generator().manual_seed(self.next_seed())) * scale


def _close(problems: list[str], label: str, got, ref, *, exact: bool = False, tol: float = TOL) -> None:
    if isinstance(got, DTensor):
        got = got.to_local()
    if got is None or ref is None:
        if got is not ref:
            problems.append(f"{label}: got {'None' if got is None else 'a tensor'}, expected the other")
        return
    got, ref = got.detach(), ref.detach()
    if got.shape != ref.shape:
        problems.append(f"{label}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
        return
    if exact:
        if not torch.equal(got, ref):
            problems.append(f"{label}: not equal (max |diff| {(got - ref).abs().max().item():.3g})")
        return
    both_nan = got.isnan() & ref.isnan()
    diff = torch.where(both_nan, 0.0, (got - ref).abs())
    limit = tol + tol * ref.abs()
    if not bool((diff <= limit).all()):
        i = int((diff - limit).flatten().argmax())
        problems.append(
            f"{label}: max |diff| {diff.max().item():.3g} > {tol} abs + rel; at flat index {i} got "
            f"{got.flatten()[i].item():.8g}, expected {ref.flatten()[i].item():.8g}"
        )


def _expected_local(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's piece of ``full`` under ``like``'s placements, cut by torch (no collective)."""
    return distribute_tensor(full.detach(), like.device_mesh, like.placements, src_data_rank=None).to_local()


def _reason_fits(reason: str | None, fusable: bool) -> bool:
    """``last_fused_reason`` after an unfused forward: a fallback's reason where the config could fuse, the
    config's own reason (no sequence parallelism, sequence dim 1, SwiGLU, gather_output) where not."""
    by_design = ("sequence parallelism", "sequence_dim", "SwiGLU", "gather_output")
    return bool(reason) and fusable != any(word in reason for word in by_design)


def _seq_shape(seq_dim: int, s: int, feat: int) -> tuple[int, int, int]:
    return (2, s, feat) if seq_dim == 1 else (s, 2, feat)


def _act(name: str | None) -> Callable[[torch.Tensor], torch.Tensor]:
    return {
        None: lambda z: z,
        "relu": F.relu,
        "gelu": F.gelu,
        "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
        "silu": F.silu,
    }[name]


# ------------------------------------------------------------------------------------------------- cases


def _column(
    ctx: _Ctx,
    problems: list[str],
    *,
    bias=True,
    activation=None,
    swiglu=False,
    sp=False,
    seq_dim=1,
    gather=False,
    k=5,
    n_local=3,
    tol=TOL,
) -> None:
    import smptk.comm as comm
    from smptk.parallel import ColumnParallelLinear

    T, r = ctx.tp, ctx.r
    N = n_local * T
    label = (
        f"column(bias={bias}, act={activation}, swiglu={swiglu}, sp={sp}, seq_dim={seq_dim}, gather={gather})"
    )
    seed = ctx.next_seed()
    torch.manual_seed(seed)
    if swiglu:
        gate, up = nn.Linear(k, N, bias=False), nn.Linear(k, N, bias=False)
        ref_fn = lambda x: F.silu(gate(x)) * up(x)
        refs = {"weight_gate": gate.weight, "weight_up": up.weight, "bias": None}
    else:
        lin = nn.Linear(k, N, bias=bias)
        ref_fn = lambda x: _act(activation)(lin(x))
        refs = {"weight": lin.weight, "bias": lin.bias}
    layer = ColumnParallelLinear(
        k,
        N,
        bias,
        activation=activation,
        swiglu=swiglu,
        sequence_parallel=sp,
        sequence_dim=seq_dim,
        gather_output=gather,
        mesh=ctx.mesh,
        device="meta",
    )
    layer.to_empty(device="cpu")
    layer.reset_parameters(torch.Generator().manual_seed(seed))
    for name, ref in refs.items():
        want = None if ref is None else ref[r * n_local : (r + 1) * n_local]
        _close(problems, f"{label} init {name}", getattr(layer, name), want, exact=True)

    x_full = ctx.randn(*_seq_shape(seq_dim, 2 * T, k))
    xr = x_full.clone().requires_grad_()
    y_ref = ref_fn(xr)
    probe = ctx.randn(*y_ref.shape)
    (y_ref * probe).sum().backward()

    x = (x_full.chunk(T, seq_dim)[r] if sp else x_full).clone().requires_grad_()
    y = layer(x)
    cols = slice(r * n_local, (r + 1) * n_local)
    want_y, p = (y_ref, probe) if gather else (y_ref[..., cols], probe[..., cols])
    (y * p).sum().backward()
    _close(problems, f"{label} output", y, want_y, tol=tol)
    _close(problems, f"{label} x.grad", x.grad, xr.grad.chunk(T, seq_dim)[r] if sp else xr.grad, tol=tol)
    for name, ref in refs.items():
        if ref is not None:
            _close(problems, f"{label} {name}.grad", getattr(layer, name).grad, ref.grad[cols], tol=tol)
    # SMPTK_KERNELS=torch here: the fused all-gather GEMM (sequence dim 0) falls back, saying why
    fusable = sp and seq_dim % x.dim() == 0 and not swiglu and not gather
    if layer.last_path != "unfused" or not _reason_fits(layer.last_fused_reason, fusable):
        why = getattr(layer, "last_fused_reason", None)
        problems.append(f"{label}: last_path {layer.last_path!r} ({why}), expected 'unfused' and a reason")
    if comm.last_path() != ctx.comm_path:
        problems.append(f"{label}: the collectives took {comm.last_path()!r}, expected {ctx.comm_path!r}")


def case_column(ctx: _Ctx, problems: list[str]) -> None:
    _column(ctx, problems, bias=True)
    _column(ctx, problems, bias=False, activation="gelu", sp=True)
    _column(ctx, problems, bias=True, activation="relu", sp=True, seq_dim=0)
    _column(ctx, problems, bias=True, activation="silu", gather=True)
    _column(ctx, problems, bias=False, activation="gelu_tanh", sp=True, gather=True)
    _column(ctx, problems, bias=False, swiglu=True)
    _column(ctx, problems, bias=False, swiglu=True, sp=True, seq_dim=0)


def _row(
    ctx: _Ctx,
    problems: list[str],
    *,
    bias=True,
    sp=False,
    seq_dim=1,
    parallel_in=True,
    k_local=3,
    n=5,
    tol=TOL,
) -> None:
    from smptk.parallel import RowParallelLinear

    T, r = ctx.tp, ctx.r
    K = k_local * T
    label = f"row(bias={bias}, sp={sp}, seq_dim={seq_dim}, input_is_parallel={parallel_in})"
    seed = ctx.next_seed()
    torch.manual_seed(seed)
    lin = nn.Linear(K, n, bias=bias)
    layer = RowParallelLinear(
        K,
        n,
        bias,
        sequence_parallel=sp,
        sequence_dim=seq_dim,
        input_is_parallel=parallel_in,
        mesh=ctx.mesh,
        device="meta",
    )
    layer.to_empty(device="cpu")
    layer.reset_parameters(torch.Generator().manual_seed(seed))
    cols = slice(r * k_local, (r + 1) * k_local)
    _close(problems, f"{label} init weight", layer.weight, lin.weight[:, cols], exact=True)
    _close(problems, f"{label} init bias", layer.bias, lin.bias, exact=True)

    x_full = ctx.randn(*_seq_shape(seq_dim, 2 * T, K))
    xr = x_full.clone().requires_grad_()
    y_ref = lin(xr)
    probe = ctx.randn(*y_ref.shape)
    (y_ref * probe).sum().backward()

    x = (x_full[..., cols] if parallel_in else x_full).clone().requires_grad_()
    y = layer(x)
    want_y, p = (y_ref.chunk(T, seq_dim)[r], probe.chunk(T, seq_dim)[r]) if sp else (y_ref, probe)
    (y * p).sum().backward()
    _close(problems, f"{label} output", y, want_y, tol=tol)
    _close(problems, f"{label} x.grad", x.grad, xr.grad[..., cols] if parallel_in else xr.grad, tol=tol)
    _close(problems, f"{label} weight.grad", layer.weight.grad, lin.weight.grad[:, cols], tol=tol)
    _close(
        problems,
        f"{label} bias.grad",
        None if layer.bias is None else layer.bias.grad,
        None if lin.bias is None else lin.bias.grad,
        tol=tol,
    )
    # SMPTK_KERNELS=torch here: the fused GEMM + reduce-scatter (sequence dim 0) falls back, saying why
    fusable = sp and seq_dim % x.dim() == 0
    if layer.last_path != "unfused" or not _reason_fits(layer.last_fused_reason, fusable):
        why = getattr(layer, "last_fused_reason", None)
        problems.append(f"{label}: last_path {layer.last_path!r} ({why}), expected 'unfused' and a reason")


def case_row(ctx: _Ctx, problems: list[str]) -> None:
    _row(ctx, problems, bias=True)
    _row(ctx, problems, bias=True, sp=True)
    _row(ctx, problems, bias=False, sp=True, seq_dim=0)
    _row(ctx, problems, bias=True, sp=True, seq_dim=0)
    _row(ctx, problems, bias=True, parallel_in=False)


def _embedding(ctx: _Ctx, problems: list[str], *, sp=False, seq_dim=1) -> None:
    from smptk.parallel import VocabParallelEmbedding

    T, r = ctx.tp, ctx.r
    vl, H = 7, 5
    V, pad = vl * T, vl + 2  # the padding row lives on rank 1
    label = f"embedding(sp={sp}, seq_dim={seq_dim})"
    seed = ctx.next_seed()
    torch.manual_seed(seed)
    emb = nn.Embedding(V, H, padding_idx=pad)
    layer = VocabParallelEmbedding(
        V, H, padding_idx=pad, sequence_parallel=sp, sequence_dim=seq_dim, mesh=ctx.mesh, device="meta"
    )
    layer.to_empty(device="cpu")
    layer.reset_parameters(torch.Generator().manual_seed(seed))
    rows = slice(r * vl, (r + 1) * vl)
    _close(problems, f"{label} init weight", layer.weight, emb.weight[rows], exact=True)

    shape = (2, 3 * T) if seq_dim == 1 else (3 * T, 2)
    ids = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(ctx.next_seed()))
    ids.view(-1)[:3] = torch.tensor([pad, 0, V - 1])
    y_ref = emb(ids)
    probe = ctx.randn(*y_ref.shape)
    (y_ref * probe).sum().backward()
    y = layer(ids)
    want_y, p = (y_ref.chunk(T, seq_dim)[r], probe.chunk(T, seq_dim)[r]) if sp else (y_ref, probe)
    (y * p).sum().backward()
    _close(problems, f"{label} output", y, want_y, exact=not sp)
    _close(problems, f"{label} weight.grad", layer.weight.grad, emb.weight.grad[rows])


def case_embedding(ctx: _Ctx, problems: list[str]) -> None:
    _embedding(ctx, problems)
    _embedding(ctx, problems, sp=True)
    _embedding(ctx, problems, sp=True, seq_dim=0)


def case_cross_entropy(ctx: _Ctx, problems: list[str]) -> None:
    from smptk.parallel import ColumnParallelLinear, vocab_parallel_cross_entropy

    T, r = ctx.tp, ctx.r
    vl = 7
    V = vl * T
    cols = slice(r * vl, (r + 1) * vl)
    gen = torch.Generator().manual_seed(ctx.next_seed())
    target = torch.randint(0, V, (2, 5), generator=gen)
    target[0, 1] = -100
    target[1, 3] = V - 1
    # Logits given directly, large (a stable max matters), each reduction, and a custom ignore_index.
    full = ctx.randn(2, 5, V, scale=30.0)
    for reduction, ignore in (("mean", -100), ("sum", -100), ("none", -100), ("mean", 3)):
        label = f"cross_entropy(reduction={reduction}, ignore_index={ignore})"
        t = target.masked_fill(target == -100, ignore)
        lr = full.clone().requires_grad_()
        ref = F.cross_entropy(lr.view(-1, V), t.view(-1), ignore_index=ignore, reduction=reduction)
        ref = ref.view(2, 5) if reduction == "none" else ref
        up = ctx.randn(*ref.shape)
        (ref * up).sum().backward()
        ll = full[..., cols].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(ll, t, group=ctx.mesh, ignore_index=ignore, reduction=reduction)
        (loss * up).sum().backward()
        _close(problems, f"{label} loss", loss, ref)
        _close(problems, f"{label} logits.grad", ll.grad, lr.grad[..., cols])
    # Shards of different widths (rank r: 3 + r columns) raise on every rank, naming the widths.
    uneven = torch.zeros(2, 5, 3 + r)
    words = (
        "logits_local",
        "same number of vocabulary columns",
        f"this rank has {3 + r}",
        f"from 3 to {2 + T}",
    )
    _raises(problems, "cross_entropy uneven widths", ValueError, words,
            lambda: vocab_parallel_cross_entropy(uneven, target.clamp(0, 2), group=ctx.mesh))  # fmt: skip
    # Logits as a DTensor sharded over the vocabulary: its mesh is the group, with no smptk state (a model
    # parallelized by torch's styles; it raised "no parallel state: call smptk.parallel.init"); the target
    # a replicated DTensor (it raised "aten.gather.default got mixed torch.Tensor and DTensor").
    from smptk.parallel import config

    ld = distribute_tensor(full, ctx.mesh, [Shard(2)]).requires_grad_()
    lr = full.clone().requires_grad_()
    ref = F.cross_entropy(lr.view(-1, V), target.view(-1))
    ref.backward()
    saved, config._state = config._state, None
    try:
        loss = vocab_parallel_cross_entropy(ld, distribute_tensor(target, ctx.mesh, [Replicate()]))
    finally:
        config._state = saved
    loss.backward()
    _close(problems, "cross_entropy(DTensor logits, no state) loss", loss, ref)
    _close(problems, "cross_entropy(DTensor logits, no state) logits.grad", ld.grad, lr.grad[..., cols])
    # A vocabulary padded to a multiple of T (V - 2 real ids; at T 2 rank 1 holds 5 real columns of 7),
    # the padded columns set to -inf as the docstring says: the real vocabulary's loss, no padded gradient.
    real = V - 2
    lr = full[..., :real].clone().requires_grad_()
    ref = F.cross_entropy(lr.view(-1, real), target.clamp(max=real - 1).view(-1))
    ref.backward()
    ll = full[..., cols].clone().requires_grad_()
    padded = torch.arange(r * vl, (r + 1) * vl) >= real
    loss = vocab_parallel_cross_entropy(ll.masked_fill(padded, float("-inf")), target.clamp(max=real - 1))
    loss.backward()
    _close(problems, "cross_entropy(padded vocabulary) loss", loss, ref)
    want = torch.cat([lr.grad, torch.zeros(2, 5, 2)], dim=-1)[..., cols]
    _close(problems, "cross_entropy(padded vocabulary) logits.grad", ll.grad, want)
    # Every target ignored: "mean" is NaN, as F.cross_entropy's.
    nan = vocab_parallel_cross_entropy(full[..., cols], torch.full((2, 5), -100), group=ctx.mesh)
    if not bool(nan.isnan()):
        problems.append(f"cross_entropy all ignored: {nan.item()}, expected nan")
    # Through a column-parallel head (gather_output=False), default group (the state's tp).
    seed = ctx.next_seed()
    torch.manual_seed(seed)
    head_ref = nn.Linear(6, V, bias=False)
    head = ColumnParallelLinear(6, V, bias=False, mesh=ctx.mesh, device="meta")
    head.to_empty(device="cpu")
    head.reset_parameters(torch.Generator().manual_seed(seed))
    h = ctx.randn(2, 5, 6)
    hr = h.clone().requires_grad_()
    F.cross_entropy(head_ref(hr).view(-1, V), target.view(-1)).backward()
    hl = h.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(head(hl), target)
    loss.backward()
    ref = F.cross_entropy(head_ref(h).view(-1, V), target.view(-1))
    _close(problems, "head + cross_entropy loss", loss, ref)
    _close(problems, "head + cross_entropy h.grad", hl.grad, hr.grad)
    _close(problems, "head + cross_entropy weight.grad", head.weight.grad, head_ref.weight.grad[cols])


class _Tiny(nn.Module):
    """Embedding, a residual MLP block and an LM head: the layers a transformer's TP plan covers."""

    def __init__(self, V: int, H: int, Fdim: int):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.up = nn.Linear(H, Fdim)
        self.act = nn.GELU()
        self.down = nn.Linear(Fdim, H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.down(self.act(self.up(h))))


def _lm_losses(ctx: _Ctx, problems: list[str], label: str, ref: nn.Module, model: nn.Module, V: int) -> None:
    """Seeded ids and targets ``[2, 2T]`` through the one-process ``ref`` (F.cross_entropy) and the
    parallelized ``model`` (vocab_parallel_cross_entropy): both losses compared, and backward run on each."""
    from smptk.parallel import vocab_parallel_cross_entropy

    T = ctx.tp
    ids = torch.randint(0, V, (2, 2 * T), generator=torch.Generator().manual_seed(ctx.next_seed()))
    target = torch.randint(0, V, (2, 2 * T), generator=torch.Generator().manual_seed(ctx.next_seed()))
    ref_loss = F.cross_entropy(ref(ids).view(-1, V), target.view(-1))
    ref_loss.backward()
    loss = vocab_parallel_cross_entropy(model(ids), target, group=ctx.mesh)
    loss.backward()
    _close(problems, f"{label} loss", loss, ref_loss)


def case_styles(ctx: _Ctx, problems: list[str]) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    from smptk.parallel import (
        ColumnParallelLinear,
        SmptkColwiseParallel,
        SmptkRowwiseParallel,
        SmptkVocabParallel,
    )

    T = ctx.tp
    V, H, Fdim = 5 * T, 5, 3 * T
    for sp in (False, True):
        label = f"parallelize_module(sp={sp})"
        torch.manual_seed(ctx.next_seed())
        ref = _Tiny(V, H, Fdim)
        model = copy.deepcopy(ref)
        hook_calls: list[int] = []
        model.up.register_forward_hook(lambda *a, calls=hook_calls: calls.append(1))
        plan = {
            "embed": SmptkVocabParallel(sequence_parallel=sp),
            "up": SmptkColwiseParallel(activation="gelu" if sp else None, sequence_parallel=sp),
            "down": SmptkRowwiseParallel(sequence_parallel=sp),
            "head": SmptkColwiseParallel(sequence_parallel=sp),
        }
        parallelize_module(model, ctx.mesh, plan)
        if sp:
            model.act = nn.Identity()  # the GELU is fused into up
        if not isinstance(model.up, ColumnParallelLinear) or model.up.activation != ("gelu" if sp else None):
            problems.append(f"{label}: up is {model.up!r}")
        _lm_losses(ctx, problems, label, ref, model, V)
        if not hook_calls:
            problems.append(f"{label}: a forward hook registered on the nn.Linear did not run after the swap")
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            if not isinstance(p, DTensor):
                problems.append(f"{label}: {name} is not a DTensor")
                continue
            _close(problems, f"{label} {name}", p, _expected_local(ref_params[name], p), exact=True)
            _close(problems, f"{label} {name}.grad", p.grad, _expected_local(ref_params[name].grad, p))

    # An embedding tied to the head (head.weight = embed.weight) stays one parameter through the styles, in
    # either order: the tied reference's gradient sums both uses (the styles used to untie it silently, each
    # copy getting its own part of the gradient). A tied layer the styles would split otherwise is refused.
    for order in (("embed", "head"), ("head", "embed")):
        label = f"tied embedding and head, converted {order[0]} first"
        torch.manual_seed(ctx.next_seed())
        ref = _Tiny(V, H, Fdim)
        ref.head.weight = ref.embed.weight
        model = copy.deepcopy(ref)
        styles = {"embed": SmptkVocabParallel(), "head": SmptkColwiseParallel()}
        parallelize_module(model, ctx.mesh, {name: styles[name] for name in order})
        if model.head.weight is not model.embed.weight:
            problems.append(f"{label}: head.weight is not embed.weight after parallelize_module")
        _lm_losses(ctx, problems, label, ref, model, V)
        w = model.embed.weight
        _close(problems, f"{label} weight.grad", w.grad, _expected_local(ref.embed.weight.grad, w))
    emb, lin = nn.Embedding(V, 2 * T), nn.Linear(2 * T, V)
    lin.weight = emb.weight
    parallelize_module(emb, ctx.mesh, SmptkVocabParallel())
    words = ("Linear.weight", "shared", "Shard(dim=0)", "RowParallelLinear", "Shard(dim=1)")
    _raises(problems, "tied weight split two ways", ValueError, words,
            lambda: parallelize_module(lin, ctx.mesh, SmptkRowwiseParallel()))  # fmt: skip

    # A converted layer keeps what its user set on it and gains the layer's own check that the weights a
    # forward saved are unchanged at backward (the swap used to drop both: a weight scaled between forward
    # and backward gave gradients of the new weights, silently).
    for style, make in ((SmptkColwiseParallel(), lambda: nn.Linear(3, 2 * T)),
                        (SmptkRowwiseParallel(), lambda: nn.Linear(2 * T, 3))):  # fmt: skip
        label = f"{type(style).__name__} conversion"
        torch.manual_seed(ctx.next_seed())
        lin = make()
        lin.init_std = 0.02
        parallelize_module(lin, ctx.mesh, style)
        if getattr(lin, "init_std", None) != 0.02:
            problems.append(f"{label}: the attribute set on the nn.Linear is gone")
        width = lin.in_features if isinstance(style, SmptkColwiseParallel) else lin.in_features // T
        x = torch.randn(2, width)
        y = lin(x.requires_grad_())
        with torch.no_grad():
            lin.weight.mul_(2)
        _raises(problems, f"{label}: weight changed before backward", RuntimeError,
                ("modified by an inplace operation", "expected version"),
                lambda y=y: y.sum().backward())  # fmt: skip


def case_autocast(ctx: _Ctx, problems: list[str]) -> None:
    """A column -> row pair of fp32 layers under ``torch.autocast`` computes in the autocast dtype and returns
    it, as ``nn.Linear`` does, with sequence dim 0 (the fused linears' entry: it used to refuse the mixed
    dtypes) and 1; the row layer's bias is cast too (its output used to come back fp32)."""
    from smptk.parallel import ColumnParallelLinear, RowParallelLinear

    T, r = ctx.tp, ctx.r
    for seq_dim in (0, 1):  # seeds of its own: the other cases' data stays as it was
        label = f"autocast(seq_dim={seq_dim})"
        torch.manual_seed(900 + seq_dim)
        up, down = nn.Linear(8, 4 * T), nn.Linear(4 * T, 8)
        col = ColumnParallelLinear.from_linear(
            up, mesh=ctx.mesh, src_data_rank=None, activation="gelu", sequence_parallel=True,
            sequence_dim=seq_dim,
        )  # fmt: skip
        row = RowParallelLinear.from_linear(
            down, mesh=ctx.mesh, src_data_rank=None, sequence_parallel=True, sequence_dim=seq_dim
        )
        x_full = torch.randn(*_seq_shape(seq_dim, 2 * T, 8))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_ref = down(F.gelu(up(x_full)))
            y = row(col(x_full.chunk(T, seq_dim)[r]))
        if y.dtype != y_ref.dtype:
            problems.append(f"{label}: output {y.dtype}, nn.Linear's {y_ref.dtype}")
        _close(problems, f"{label} output", y.float(), y_ref.chunk(T, seq_dim)[r].float(), tol=3e-2)
        y.float().sum().backward()
        grads = [p.grad for p in (*col.parameters(), *row.parameters())]
        if any(g is None or g.dtype != torch.float32 for g in grads):
            problems.append(f"{label}: parameter gradients {[None if g is None else g.dtype for g in grads]}")


def case_init_stream(ctx: _Ctx, problems: list[str]) -> None:
    """Layers built after init, smptk's and torch's mixed, draw from torch's generator, which init seeded
    with random_seed: the plain model built in the same order after torch.manual_seed(random_seed) has the
    same initial values (smptk's layers used to draw from a stream of their own, so the torch layer between
    them, and every layer after it, differed)."""
    from smptk.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    T, r = ctx.tp, ctx.r
    layers = [
        ColumnParallelLinear(5, 3 * T, mesh=ctx.mesh),
        nn.Linear(3 * T, 3 * T),  # a plain layer (a router, an adapter): replicated on every rank
        RowParallelLinear(3 * T, 5, mesh=ctx.mesh),
        VocabParallelEmbedding(7 * T, 4, mesh=ctx.mesh),
    ]
    torch.manual_seed(ctx.state.config.random_seed)
    refs = [nn.Linear(5, 3 * T), nn.Linear(3 * T, 3 * T), nn.Linear(3 * T, 5), nn.Embedding(7 * T, 4)]
    for layer, ref in zip(layers, refs, strict=True):
        for name, p in layer.named_parameters():
            _close(
                problems,
                f"init stream {type(layer).__name__}.{name}",
                p,
                _expected_local(getattr(ref, name), p) if isinstance(p, DTensor) else getattr(ref, name),
                exact=True,
            )
    del r


def case_triton(ctx: _Ctx, problems: list[str]) -> None:
    """A column + row pair (sequence parallel) on smptk's Triton kernels, under the interpreter: with
    ``[b, s, h]`` (sequence dim 1: the unfused all-gather, then the GEMM) and with ``[s, b, h]`` (sequence
    dim 0: where the symmetric heap applies, the column layer runs the fused all-gather GEMM and the row
    layer the fused GEMM + reduce-scatter, each backward the other's kernel). FlopCounterMode counts, on each
    rank, 1/T of the unsharded pair's GEMM FLOPs, forward and backward."""
    for seq_dim in (1, 0):
        _triton_pair(ctx, problems, seq_dim)


def _triton_pair(ctx: _Ctx, problems: list[str], seq_dim: int) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from smptk.parallel import ColumnParallelLinear, RowParallelLinear

    os.environ["SMPTK_KERNELS"] = "triton"
    try:
        T, r = ctx.tp, ctx.r
        label = f"triton seq_dim={seq_dim}"
        seed = ctx.next_seed()
        torch.manual_seed(seed)
        lin1, lin2 = nn.Linear(8, 2 * T), nn.Linear(2 * T, 8)
        kw = dict(sequence_parallel=True, sequence_dim=seq_dim, mesh=ctx.mesh, device="meta")
        col = ColumnParallelLinear(8, 2 * T, activation="gelu", **kw)
        row = RowParallelLinear(2 * T, 8, **kw)
        gen = torch.Generator().manual_seed(seed)
        for m in (col, row):
            m.to_empty(device="cpu")
            m.reset_parameters(gen)
        x_full = ctx.randn(*_seq_shape(seq_dim, T, 8))
        xr = x_full.clone().requires_grad_()
        with FlopCounterMode(display=False) as ref_flops:
            y_ref = lin2(F.gelu(lin1(xr)))
            probe = ctx.randn(*y_ref.shape)
            (y_ref * probe).sum().backward()
        x = x_full.chunk(T, seq_dim)[r].clone().requires_grad_()
        with FlopCounterMode(display=False) as flops:
            y = row(col(x))
            (y * probe.chunk(T, seq_dim)[r]).sum().backward()
        if T * flops.get_total_flops() != ref_flops.get_total_flops():  # each rank: 1/T of every GEMM
            problems.append(
                f"{label}: FlopCounterMode counted {flops.get_total_flops()} on this rank, "
                f"expected 1/{T} of the unsharded pair's {ref_flops.get_total_flops()}"
            )
        for m in (col, row):
            if m.last_kernel_path != "triton":
                problems.append(f"{label}: {type(m).__name__} ran {m.last_kernel_path!r}")
        want = "fused" if seq_dim == 0 and ctx.comm_path == "symmetric" else "unfused"
        for m in (col, row):
            if m.last_path != want:
                why = f"{m.last_path!r} ({getattr(m, 'last_fused_reason', None)})"
                problems.append(f"{label}: {type(m).__name__} took {why}, expected {want!r}")
        if want == "fused" and last_backward_path() != "fused":  # the column layer's backward ran last
            problems.append(f"{label}: the column layer's backward took {last_backward_path()!r}")
        _close(problems, f"{label} output", y, y_ref.chunk(T, seq_dim)[r], tol=1e-5)
        _close(problems, f"{label} x.grad", x.grad, xr.grad.chunk(T, seq_dim)[r], tol=1e-5)
        _close(
            problems,
            f"{label} col weight.grad",
            col.weight.grad,
            lin1.weight.grad[2 * r : 2 * r + 2],
            tol=1e-5,
        )
        _close(
            problems,
            f"{label} row weight.grad",
            row.weight.grad,
            lin2.weight.grad[:, 2 * r : 2 * r + 2],
            tol=1e-5,
        )
        _close(problems, f"{label} row bias.grad", row.bias.grad, lin2.bias.grad, tol=1e-5)
    finally:
        os.environ["SMPTK_KERNELS"] = "torch"


def case_moe_sequence_parallel(ctx: _Ctx, problems: list[str]) -> None:
    """MoE(sequence_parallel=True) on this rank's sequence block: its output is the block of the unsharded
    layer's, and every rank's router / expert / shared-expert gradients and aux loss are the unsharded
    layer's (without the option each rank's gradients held its own block's share, summed by nothing:
    ~100% off at tp2 x ep2). Both sequence layouts; the input gradient is this rank's block."""
    from smptk.parallel import MoE

    T, r = ctx.tp, ctx.r
    for dim, shape in ((1, (2, 3 * T, 8)), (0, (2 * T, 3, 8))):
        label = f"MoE sequence_parallel, sequence_dim {dim}"
        kwargs = dict(top_k=2, num_shared_experts=1, aux_loss_coef=0.1, z_loss_coef=0.01)
        torch.manual_seed(ctx.next_seed())
        ref = MoE(8, 12, 4, **kwargs)
        moe = MoE(8, 12, 4, **kwargs, sequence_parallel=True, sequence_dim=dim, tp_mesh=ctx.mesh)
        moe.load_state_dict(ref.state_dict())
        x_full, weight = ctx.randn(*shape).requires_grad_(), ctx.randn(*shape)
        n = shape[dim] // T
        x = x_full.detach().narrow(dim, r * n, n).clone().requires_grad_()
        y = moe(x)
        (y * weight.narrow(dim, r * n, n)).sum().add(moe.aux_loss).backward()  # this rank's share + aux
        y_ref = ref(x_full)
        (y_ref * weight).sum().add(ref.aux_loss).backward()
        _close(problems, f"{label} output", y, y_ref.narrow(dim, r * n, n))
        _close(problems, f"{label} aux_loss", moe.aux_loss, ref.aux_loss)
        _close(problems, f"{label} x.grad", x.grad, x_full.grad.narrow(dim, r * n, n))
        for (name, p), p_ref in zip(moe.named_parameters(), ref.parameters(), strict=True):
            _close(problems, f"{label} {name}.grad", p.grad, p_ref.grad)
    with torch.device("meta"):  # delayed initialization: shapes only, no collective
        meta = MoE(8, 12, 4, sequence_parallel=True, tp_mesh=ctx.mesh)
    y = meta(torch.empty(2, 3, 8, device="meta"))
    if y.shape != (2, 3, 8) or not y.is_meta:
        problems.append(f"MoE sequence_parallel on meta: {tuple(y.shape)} on {y.device}, expected (2, 3, 8)")
    on_features = MoE(8, 12, 4, sequence_parallel=True, sequence_dim=2, tp_mesh=ctx.mesh)
    _raises(problems, "MoE tp_mesh without sequence_parallel", ValueError,
            ("tp_mesh", "sequence_parallel=True"), lambda: MoE(8, 12, 4, tp_mesh=ctx.mesh))  # fmt: skip
    _raises(problems, "MoE sequence_dim on the features", ValueError, ("sequence_dim 2", "(2, 3, 8)"),
            lambda: on_features(torch.randn(2, 3, 8)))  # fmt: skip
    blocks = distribute_tensor(torch.randn(2, 2 * T, 8), ctx.mesh, [Shard(1)])
    _raises(problems, "MoE sequence_parallel DTensor input", TypeError, ("a DTensor", "x.to_local()"),
            lambda: MoE(8, 12, 4, sequence_parallel=True, tp_mesh=ctx.mesh)(blocks))  # fmt: skip
    # without sequence_parallel too (torch's SequenceParallel style hands the next module a DTensor): it
    # failed in the router's matmul with torch's "got mixed torch.Tensor and DTensor", naming no argument
    _raises(problems, "MoE DTensor input", TypeError, ("x: a DTensor", "this rank's tokens", "x.to_local()"),
            lambda: MoE(8, 12, 4)(blocks))  # fmt: skip


class _DropoutBlock(nn.Module):
    """Column -> GELU -> dropout of its tp-sharded features -> row -> dropout of the row's output: in the
    state's ``fork_rng("tp")`` region where that output is sequence-parallel (each tp rank's own tokens),
    torch's default generator where it is replicated. ``masks`` keeps the two masks of every forward."""

    def __init__(self, ctx: _Ctx, sequence_parallel: bool) -> None:
        super().__init__()
        from smptk.parallel import ColumnParallelLinear, RowParallelLinear

        T = ctx.tp
        self.state, self.sp = ctx.state, sequence_parallel
        self.col = ColumnParallelLinear(4, 2 * T, sequence_parallel=sequence_parallel, mesh=ctx.mesh)
        self.row = RowParallelLinear(2 * T, 4, sequence_parallel=sequence_parallel, mesh=ctx.mesh)
        self.masks: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.state.fork_rng("tp"):
            h = F.dropout(F.gelu(self.col(x)), 0.5)
        y = self.row(h)
        if self.sp:
            with self.state.fork_rng("tp"):
                y = F.dropout(y, 0.5)
        else:
            y = F.dropout(y, 0.5)
        self.masks.append((h == 0, y == 0))
        return x + y


def case_dropout(ctx: _Ctx, problems: list[str]) -> None:
    """Dropout under tensor parallelism as the README says to draw it: masks of tp-sharded and sequence-
    parallel activations (``state.fork_rng("tp")``) differ across the tp ranks, the mask of a replicated
    activation (torch's default generator) is the same on every tp rank, and the default generator stays in
    step; activation checkpointing (full, selective) gives the losses and gradients of no checkpointing bit
    for bit (its recompute draws the forward's masks)."""
    import torch.distributed as dist

    import smptk.parallel as sp

    T, r, group = ctx.tp, ctx.r, ctx.mesh.get_group()

    def gathered(t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(T)]
        dist.all_gather(out, t.contiguous(), group=group)
        return out

    for seq in (False, True):
        label = f"dropout, sequence_parallel={seq}"
        runs = {}
        x = ctx.randn(2, 2 * T, 4)
        for mode in ("none", "full", "selective"):
            torch.manual_seed(ctx.state.config.random_seed)
            model = nn.Sequential(*(_DropoutBlock(ctx, seq) for _ in range(2)))
            if mode != "none":
                sp.apply_activation_checkpointing(model, mode=mode, modules=[_DropoutBlock])
            losses, grads = [], []
            for _ in range(2):
                loss = model(x[:, 2 * r : 2 * r + 2] if seq else x).square().sum()
                loss.backward()
                losses.append(loss.detach())
                grads.append([p.grad.to_local().clone() for p in model.parameters()])
                model.zero_grad()
            runs[mode] = (losses, grads, model)
        for mode in ("full", "selective"):
            for step in range(2):
                _close(problems, f"{label}, {mode}: loss {step}", runs[mode][0][step], runs["none"][0][step],
                       exact=True)  # fmt: skip
                for i, (g, g_ref) in enumerate(zip(runs[mode][1][step], runs["none"][1][step], strict=True)):
                    _close(problems, f"{label}, {mode}: grad {i} step {step}", g, g_ref, exact=True)
        masks = runs["none"][2][0].masks
        sharded = gathered(masks[0][0])
        if any(torch.equal(sharded[0], m) for m in sharded[1:]):
            problems.append(f"{label}: the tp-sharded features' dropout mask is the same on two tp ranks")
        if torch.equal(masks[0][0], masks[1][0]):
            problems.append(f"{label}: the tp-sharded features' dropout mask is the same in two steps")
        out = gathered(masks[0][1])
        if seq and any(torch.equal(out[0], m) for m in out[1:]):
            problems.append(f"{label}: the sequence-parallel output's mask is the same on two tp ranks")
        if not seq and not all(torch.equal(out[0], m) for m in out[1:]):
            problems.append(f"{label}: the replicated output's mask differs across the tp ranks")
        states = gathered(torch.get_rng_state())
        if not all(torch.equal(states[0], s) for s in states[1:]):
            problems.append(f"{label}: torch's default generator is not in step across the tp ranks")


def _raises(
    problems: list[str], label: str, exc: type, words: tuple[str, ...], fn: Callable[[], object]
) -> None:
    try:
        fn()
    except exc as e:
        missing = [w for w in words if w not in str(e)]
        if missing:
            problems.append(f"{label}: message {str(e)!r} lacks {missing}")
        return
    except Exception as e:
        problems.append(f"{label}: raised {type(e).__name__}: {e}, expected {exc.__name__}")
        return
    problems.append(f"{label}: no error")


class _ScaledEmbedding(nn.Embedding):
    """An embedding whose output is scaled (Gemma's): converting it would drop the scale."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale


class _ZeroInitLinear(nn.Linear):
    """A linear initialized to zero (an output projection's usual init): converting it would lose it."""

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def _weight_normed(linear: nn.Linear) -> nn.Module:
    return nn.utils.parametrizations.weight_norm(linear)


def case_errors(ctx: _Ctx, problems: list[str]) -> None:
    """Bad input raises on every rank, before any collective, naming the argument and the numbers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel

    from smptk.parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        SmptkColwiseParallel,
        SmptkRowwiseParallel,
        VocabParallelEmbedding,
        vocab_parallel_cross_entropy,
    )

    T, m = ctx.tp, ctx.mesh
    N = 3 * T + 1
    mesh2 = init_device_mesh("cpu", (1, T), mesh_dim_names=("a", "tp"))
    col = ColumnParallelLinear(5, T, mesh=m)
    row = RowParallelLinear(3 * T, 5, mesh=m, sequence_parallel=True)
    col_sp = ColumnParallelLinear(5, T, mesh=m, sequence_parallel=True, sequence_dim=2)
    emb = VocabParallelEmbedding(2 * T, 3, mesh=m)
    logits, zeros = torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)
    sharded = distribute_tensor(torch.randn(2, 4, 5), m, [Shard(1)])
    col_sp1 = ColumnParallelLinear(5, T, mesh=m, sequence_parallel=True, sequence_dim=1)
    uneven = distribute_tensor(torch.randn(2, 2 * T + 1, 5), m, [Shard(1)])  # unequal blocks (torch's split)
    ce = vocab_parallel_cross_entropy

    def updated_before_backward(layer: nn.Module, x: torch.Tensor) -> None:
        y = layer(x)
        with torch.no_grad():
            layer.weight.mul_(2)  # an in-place update of the DTensor: its local shard's version stays
        y.sum().backward()

    inplace = ("modified by an inplace operation", "expected version")
    cases = [  # (label, exception, words the message must hold, the call)
        ("column weight updated", RuntimeError, (*inplace, "ColumnParallelLinear.weight"),
         lambda: updated_before_backward(ColumnParallelLinear(5, T, mesh=m), torch.randn(2, 5))),
        ("row weight updated", RuntimeError, (*inplace, "RowParallelLinear.weight"),
         lambda: updated_before_backward(RowParallelLinear(2 * T, 5, mesh=m), torch.randn(3, 2))),
        ("out_features", ValueError, ("out_features", str(N), f"tensor-parallel size {T}"),
         lambda: ColumnParallelLinear(5, N, mesh=m)),
        ("in_features", ValueError, ("in_features", str(N), str(T)),
         lambda: RowParallelLinear(N, 5, mesh=m)),
        ("vocab", ValueError, ("num_embeddings", str(N), f"multiple of {T}", str(4 * T)),
         lambda: VocabParallelEmbedding(N, 4, mesh=m)),
        ("swiglu bias", ValueError, ("bias", "bias=False"),
         lambda: ColumnParallelLinear(5, T, swiglu=True, mesh=m)),
        ("activation", ValueError, ("activation", "'tanh'"),
         lambda: ColumnParallelLinear(5, T, activation="tanh", mesh=m)),
        ("2-D mesh", ValueError, ("mesh", "1-D", "('a', 'tp')"),
         lambda: ColumnParallelLinear(5, T, mesh=mesh2)),
        ("column x", ValueError, ("x", "[..., 5]", "(2, 3, 4)"), lambda: col(torch.randn(2, 3, 4))),
        ("row x features", ValueError, ("x", "[..., 3]", f"in_features {3 * T}"),
         lambda: row(torch.randn(2, T, 3 * T))),
        ("row sequence", ValueError, ("sequence length", str(T + 1), f"size {T}"),
         lambda: row(torch.randn(2, T + 1, 3))),
        ("sequence_dim", ValueError, ("sequence_dim 2", "(2, 3, 5)"), lambda: col_sp(torch.randn(2, 3, 5))),
        ("ids range", IndexError, ("ids", str(2 * T), f"0..{2 * T - 1}"),
         lambda: emb(torch.tensor([[0, 2 * T]]))),
        ("ids dtype", TypeError, ("ids", "int64 or int32", "torch.uint8"),
         lambda: emb(torch.tensor([[0, 1]], dtype=torch.uint8))),
        ("ce target shape", ValueError, ("target", "(2, 3)", "(3, 2)"),
         lambda: ce(logits, zeros.mT, group=m)),
        ("ce target range", IndexError, ("target", str(4 * T)), lambda: ce(logits, zeros + 4 * T, group=m)),
        ("ce reduction", ValueError, ("reduction", "'avg'"),
         lambda: ce(logits, zeros, group=m, reduction="avg")),
        ("ce sharded DTensor target", ValueError, ("target", "replicated", "Shard(dim=0)"),
         lambda: ce(logits, distribute_tensor(zeros.repeat(T, 1), m, [Shard(0)]), group=m)),
        ("ce group of a DTensor", ValueError, ("group", f"ranks [{ctx.r}]", str(list(range(T)))),
         lambda: ce(distribute_tensor(logits.repeat(1, 1, T), m, [Shard(2)]), zeros, group=(mesh2, "a"))),
        ("style module", TypeError, ("nn.Linear", "Embedding"),
         lambda: SmptkColwiseParallel()._apply(nn.Embedding(4, 4), m)),
        ("scaled embedding", TypeError, ("_ScaledEmbedding", "its own forward", "['scale']", "would drop"),
         lambda: VocabParallelEmbedding.from_embedding(_ScaledEmbedding(2 * T, 3), mesh=m)),
        ("parametrized linear", TypeError, ("ParametrizedLinear", "['parametrizations']"),
         lambda: SmptkColwiseParallel()._apply(_weight_normed(nn.Linear(5, T)), m)),
        ("own init", TypeError, ("_ZeroInitLinear", "its own reset_parameters", "would drop"),
         lambda: SmptkColwiseParallel()._apply(_ZeroInitLinear(5, T), m)),
        ("already parallelized", TypeError, ("['weight', 'bias']", "DTensors already"),
         lambda: SmptkRowwiseParallel()._apply(ColwiseParallel()._apply(nn.Linear(T, T), m), m)),
        ("DTensor placement", ValueError, ("x", "Shard(dim=1)", "Replicate"), lambda: col(sharded)),
        ("uneven DTensor sequence", ValueError, ("sequence length", str(2 * T + 1), f"size {T}"),
         lambda: col_sp1(uneven)),
        ("column float64", TypeError, ("dtype", "float64"),
         lambda: ColumnParallelLinear(5, T, mesh=m, dtype=torch.float64)),
        ("row float64", TypeError, ("dtype", "float64"),
         lambda: RowParallelLinear.from_linear(nn.Linear(T, 5).double(), mesh=m)),
    ]  # fmt: skip
    for label, exc, words, call in cases:
        _raises(problems, label, exc, words, call)

    # A frozen module converts to frozen layers (they used to come out trainable).
    frozen = [nn.Linear(5, T).requires_grad_(False), nn.Linear(T, 5), nn.Embedding(2 * T, 3)]
    frozen[1].bias.requires_grad_(False)  # frozen in part
    frozen[2].requires_grad_(False)
    converted = [
        ColumnParallelLinear.from_linear(frozen[0], mesh=m),
        RowParallelLinear.from_linear(frozen[1], mesh=m),
        VocabParallelEmbedding.from_embedding(frozen[2], mesh=m),
    ]
    for source, layer in zip(frozen, converted, strict=True):
        want = {n: p.requires_grad for n, p in source.named_parameters()}
        got = {n: p.requires_grad for n, p in layer.named_parameters()}
        if got != want:
            problems.append(f"{type(layer).__name__}: requires_grad {got}, the source module's {want}")
    # Built under the meta device context (delayed initialization), the layers allocate nothing.
    with torch.device("meta"):
        metas = [
            ColumnParallelLinear(5, T, mesh=m),
            RowParallelLinear(T, 5, mesh=m),
            VocabParallelEmbedding(2 * T, 3, mesh=m),
        ]
    for layer in metas:
        devices = {p.to_local().device.type for p in layer.parameters()}
        if devices != {"meta"}:
            problems.append(f"{type(layer).__name__} under torch.device('meta'): parameters on {devices}")


def case_fsdp(ctx: _Ctx, problems: list[str]) -> None:
    """TP 2 x DP 2: meta -> fully_shard -> to_empty -> reset_parameters, then one SGD step, vs one process.

    Parameters are compared through ``full_tensor()`` (what every rank holds, gathered by torch), so the
    check does not depend on how the shards were cut."""
    from torch.distributed.fsdp import fully_shard

    import smptk.parallel as sp
    from smptk.parallel import ColumnParallelLinear, RowParallelLinear

    state = sp.init({"tensor_parallel_degree": 2, "random_seed": 11})
    dp, dpr = state.sizes["dp"], state.coords["dp"]
    H, Fdim = 5, 6

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = ColumnParallelLinear(H, Fdim, bias=False, swiglu=True, device="meta")
            self.down = RowParallelLinear(Fdim, H, device="meta")

        def forward(self, x):
            return self.down(self.up(x))

    model = MLP()
    fsdp_mesh = state.mesh["dp_replicate", "dp_shard"]
    for part in (model.up, model.down, model):
        fully_shard(part, mesh=fsdp_mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(23)
    model.up.reset_parameters(gen)
    model.down.reset_parameters(gen)
    torch.manual_seed(23)
    gate, up, down = nn.Linear(H, Fdim, bias=False), nn.Linear(H, Fdim, bias=False), nn.Linear(Fdim, H)
    refs = {
        "up.weight_gate": gate.weight,
        "up.weight_up": up.weight,
        "down.weight": down.weight,
        "down.bias": down.bias,
    }
    params = dict(model.named_parameters())
    for name, ref in refs.items():
        _close(problems, f"fsdp init {name}", params[name].full_tensor(), ref, exact=True)

    xs = ctx.randn(dp, 2, 3, H)
    probes = ctx.randn(dp, 2, 3, H)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    (model(xs[dpr]) * probes[dpr]).sum().backward()
    opt.step()
    ref_opt = torch.optim.SGD(list(refs.values()), lr=0.5)
    ref_loss = sum((down(F.silu(gate(xs[d])) * up(xs[d])) * probes[d]).sum() for d in range(dp)) / dp
    ref_loss.backward()
    ref_opt.step()
    for name, ref in refs.items():
        _close(problems, f"fsdp step {name}", params[name].full_tensor(), ref)

    # The embedding's padding row is a row of the full table: zeroed there, whatever FSDP2 cut (it used to
    # zero this rank's TP-local row in its FSDP piece: the wrong row, or an IndexError past the piece).
    from smptk.parallel import VocabParallelEmbedding

    for pad in (1, 7):  # [8, 3] over tp 2 x dp_shard 2: pieces of 2 rows; 7 is TP rank 1's local row 3
        emb = VocabParallelEmbedding(8, 3, padding_idx=pad, device="meta")
        fully_shard(emb, mesh=fsdp_mesh)
        emb.to_empty(device="cpu")
        emb.reset_parameters(torch.Generator().manual_seed(5))
        torch.manual_seed(5)
        ref_emb = nn.Embedding(8, 3, padding_idx=pad)
        _close(problems, f"fsdp init embedding (padding_idx {pad})", emb.weight.full_tensor(), ref_emb.weight,
               exact=True)  # fmt: skip

    # A layer of the root's unit called on its own: FSDP2 has not gathered its parameters (it used to compute
    # with this rank's piece of them: silently wrong, or an IndexError in an embedding).
    root_only = MLP()
    fully_shard(root_only, mesh=fsdp_mesh)
    root_only.to_empty(device="cpu")
    words = ("ColumnParallelLinear.weight_gate", "dp_shard", "not gathered", "root")
    _raises(problems, "submodule of a root unit", RuntimeError, words, lambda: root_only.up(xs[dpr]))
    try:
        root_only(xs[dpr])  # through the root: gathered
    except Exception as e:
        problems.append(f"the root unit's forward: {type(e).__name__}: {e}")


CASES: dict[str, Callable[[_Ctx, list[str]], None]] = {
    "init_stream": case_init_stream,
    "autocast": case_autocast,
    "column": case_column,
    "row": case_row,
    "embedding": case_embedding,
    "cross_entropy": case_cross_entropy,
    "styles": case_styles,
    "moe_sequence_parallel": case_moe_sequence_parallel,
    "dropout": case_dropout,
    "errors": case_errors,
    "triton": case_triton,
    "fsdp": case_fsdp,
}


def run(rank: int, world: int, cases: list[str]) -> dict[str, str | None]:
    """The named cases on this rank, in CASES order: {case: None, or the problems found, one per line};
    ``"seconds"``: {case: its wall time on this rank}."""
    import time

    os.environ["SMPTK_KERNELS"] = "torch"
    import smptk.parallel as sp

    state = sp.init({"tensor_parallel_degree": world, "random_seed": 7})
    ctx = _Ctx(state)
    out: dict = {"seconds": {}}
    for name, case in CASES.items():
        if name not in cases:
            continue
        t0 = time.perf_counter()
        problems: list[str] = []
        case(ctx, problems)
        out["seconds"][name] = round(time.perf_counter() - t0, 2)
        out[name] = "\n".join(problems) or None
    sp.reset()
    return out
