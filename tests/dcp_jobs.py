"""The multi-rank side of ``tests/test_dcp.py``: one 4-rank job that saves and loads across configs.

Phases, in one process group (process start-up dominates a job), each on a model rebuilt from another
seed so that only the load can make its values right:

1. ``tp2_dp2``: TP 2 (smptk's vocab-parallel embedding, column / row linears and a column-parallel head,
   through the ParallelStyles) x FSDP2 over dp_shard 2; one Adam step; save checkpoint ``tp2_dp2``.
2. ``dp4``: full shard over 4 ranks, no TP; load ``tp2_dp2``.
3. ``hsdp``: dp_replicate 2 x dp_shard 2; load ``tp2_dp2``, take one more Adam step, save ``hsdp``.
4. ``hsdp_to_dp4``: full shard over 4 ranks; load ``hsdp``.
5. ``broadcast``: TP 2 x DP 2 again; rank 0 alone holds the full state of phase 3 and
   ``load_full_state_dict`` broadcasts it.

Later phases check what a user meets: full state dicts that stay snapshots, refusals on every rank,
optimizer groups matched by name, ``extra`` from rank 0, and (14, 15) a resume with dropout (a
``fork_rng("tp")`` region and a replicated ``nn.Dropout``, full activation checkpointing) that repeats the
uninterrupted step bit for bit, and a save whose ranks' generators are out of step warning.

After every load, each parameter and each optimizer state tensor, gathered whole
(``get_full_state_dict(rank0_only=False)``), must equal what was saved bit for bit, and the step must
come back. The full states of phases 1 and 3 go back to the pytest process, which loads both
checkpoints into the plain model on one process.

Kernels take the PyTorch path (``SMPTK_KERNELS=torch``, set by the test) and FSDP2 runs torch's
collectives (``use_smptk_collectives=False``): checkpoints move values, which neither changes, and the
interpreted kernels and heap collectives would only add time (tests/test_fsdp.py covers those).
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from smptk.parallel.dcp import _map_tensors

VOCAB, HIDDEN, FFN, SEQ, BATCH = 12, 8, 16, 5, 4
LR = 1e-2
DROPOUT = 0.3


class Block(nn.Module):
    """``x + down(act(up(x)))`` on ``[b, s, HIDDEN]``; ``act`` is GELU, or Identity where ``up`` fuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN)
        self.act = nn.GELU()
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class DropoutBlock(Block):
    """``x + dropout(down(dropout_tp(act(up(x)))))``: ``dropout_tp`` on the tp-sharded ``[b, s, FFN/T]``
    activation inside ``state.fork_rng("tp")``, the other (``nn.Dropout``) on the replicated output."""

    def __init__(self, state) -> None:
        super().__init__()
        self.state = state
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.up(x))
        with self.state.fork_rng("tp"):
            h = F.dropout(h, DROPOUT, self.training)
        return x + self.drop(self.down(h))


class TinyLM(nn.Module):
    """ids ``[b, s]`` -> logits ``[b, s, VOCAB]`` (vocab-sharded ``[b, s, VOCAB/T]`` under TP); with a
    ``dropout_state``, its blocks are dropout blocks (:class:`DropoutBlock`)."""

    def __init__(self, seed: int, dropout_state=None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        if dropout_state is None:
            self.blocks = nn.ModuleList([Block(), Block()])
        else:
            self.blocks = nn.ModuleList([DropoutBlock(dropout_state), DropoutBlock(dropout_state)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tp_plan() -> dict:
    from smptk.parallel import SmptkColwiseParallel, SmptkRowwiseParallel, SmptkVocabParallel

    plan = {"embed": SmptkVocabParallel(), "head": SmptkColwiseParallel()}
    for i in range(2):
        plan[f"blocks.{i}.up"] = SmptkColwiseParallel(activation="gelu")
        plan[f"blocks.{i}.down"] = SmptkRowwiseParallel()
    return plan


def build(state, seed: int, dropout: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """TinyLM under ``state``'s config (TP when tp > 1, then apply_data_parallel) and its Adam; with
    ``dropout``, its dropout blocks under full activation checkpointing."""
    from smptk.parallel import apply_activation_checkpointing
    from smptk.parallel.fsdp import apply_data_parallel

    model = TinyLM(seed, state if dropout else None)
    if state.sizes["tp"] > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        for block in model.blocks:  # the GELU runs fused in the column-parallel up projection
            block.act = nn.Identity()
        parallelize_module(model, state.submesh("tp"), tp_plan())
    if dropout:
        apply_activation_checkpointing(model, mode="full")
    model, _ = apply_data_parallel(model, state, reshard_after_forward=False, use_smptk_collectives=False)
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def step(model: nn.Module, opt: torch.optim.Optimizer, state, n: int) -> float:
    """One Adam step on this data-parallel rank's rows of global batch ``n``."""
    from smptk.parallel import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(100 + n)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    dp, d = state.sizes["dp"], state.coords["dp"]
    rows = ids[d * BATCH // dp : (d + 1) * BATCH // dp]
    logits = model(rows[:, :-1])
    if state.sizes["tp"] > 1:
        loss = vocab_parallel_cross_entropy(logits, rows[:, 1:], group=state.group("tp"))
    else:
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Model and optimizer state with every tensor whole, cloned to CPU (collective)."""
    from smptk.parallel.dcp import get_full_state_dict

    state = get_full_state_dict(model, opt, rank0_only=False)
    return _map_tensors(state, lambda t: t.detach().cpu().clone())


def differences(got, want, where: str = "") -> list[str]:
    """Every place where ``got`` and ``want`` differ: keys, tensor shape / dtype / values (exact), values."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{where}: {type(got).__name__}, expected a tensor"]
        if got.shape != want.shape or got.dtype != want.dtype:
            return [f"{where}: {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}"]
        if not torch.equal(got, want):
            return [f"{where}: max |diff| {(got.double() - want.double()).abs().max().item():.3g}"]
        return []
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            got_keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            return [f"{where}: keys {got_keys}, expected {sorted(want)}"]
        return [p for k in want for p in differences(got[k], want[k], f"{where}.{k}" if where else str(k))]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return [f"{where}: {got!r}, expected {want!r}"]
        return [
            p
            for i, (g, w) in enumerate(zip(got, want, strict=True))
            for p in differences(g, w, f"{where}[{i}]")
        ]
    return [] if got == want else [f"{where}: {got!r}, expected {want!r}"]


CONFIGS = {
    "tp2_dp2": {"tensor_parallel_degree": 2, "hybrid_shard_degree": 0},
    "dp4": {"hybrid_shard_degree": 0},
    "hsdp": {"hybrid_shard_degree": 2},
}


def run(rank: int, world: int, ckpt_dir: str) -> dict:
    import smptk.comm as comm
    import smptk.parallel as sp
    from smptk.parallel.dcp import load_checkpoint, load_full_state_dict, save_checkpoint

    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    comm.configure(max_sms=1, heap_bytes=64 * 1024, timeout_s=60)
    out: dict = {"problems": {}}

    def init(name: str):
        sp.reset()
        return sp.init({**CONFIGS[name], "mixed_precision": "fp32", "random_seed": 5})

    def check(phase: str, got: dict, want: dict, got_step, want_step) -> None:
        problems = differences(got, want)
        if got_step != want_step:
            problems.append(f"step {got_step!r}, expected {want_step!r}")
        out["problems"][phase] = problems

    # 1. TP 2 x DP 2: one step, save.
    state = init("tp2_dp2")
    model, opt = build(state, seed=1)
    out["loss_tp2_dp2"] = step(model, opt, state, 0)
    saved_a = full_state(model, opt)
    save_checkpoint(os.path.join(ckpt_dir, "tp2_dp2"), model, opt, step=1)

    # 2. DP 4 full shard: load.
    state = init("dp4")
    model, opt = build(state, seed=2)
    got_step = load_checkpoint(os.path.join(ckpt_dir, "tp2_dp2"), model, opt)
    check("tp2_dp2 -> dp4", full_state(model, opt), saved_a, got_step, 1)

    # 3. HSDP: load, step, save.
    state = init("hsdp")
    model, opt = build(state, seed=3)
    got_step = load_checkpoint(os.path.join(ckpt_dir, "tp2_dp2"), model, opt)
    check("tp2_dp2 -> hsdp", full_state(model, opt), saved_a, got_step, 1)
    out["loss_hsdp"] = step(model, opt, state, 1)
    saved_b = full_state(model, opt)
    save_checkpoint(os.path.join(ckpt_dir, "hsdp"), model, opt, step=2)

    # 4. HSDP -> DP 4 full shard.
    state = init("dp4")
    model, opt = build(state, seed=4)
    got_step = load_checkpoint(os.path.join(ckpt_dir, "hsdp"), model, opt)
    check("hsdp -> dp4", full_state(model, opt), saved_b, got_step, 2)

    # 5. A full state dict on rank 0 only, broadcast into TP 2 x DP 2.
    state = init("tp2_dp2")
    model, opt = build(state, seed=6)
    load_full_state_dict(
        model,
        saved_b["model"] if rank == 0 else None,
        opt,
        saved_b["optim"] if rank == 0 else None,
    )
    check("broadcast from rank 0 -> tp2_dp2", full_state(model, opt), saved_b, 2, 2)

    # 6. A full state dict is a snapshot: the next step leaves it as it was (tensors that needed no
    # gathering, the replicated and the tp-replicated ones, came back as the live parameters themselves).
    from smptk.parallel.dcp import get_full_state_dict

    snaps = {flag: get_full_state_dict(model, opt, rank0_only=flag) for flag in (False, True)}
    before = {flag: _map_tensors(snap, lambda t: t.detach().clone()) for flag, snap in snaps.items()}
    step(model, opt, state, 2)
    for flag in (False, True):
        out["problems"][f"snapshot (rank0_only={flag})"] = differences(snaps[flag], before[flag])

    # 7. A tensor of the wrong shape on rank 0: every rank raises, naming it and both shapes.
    name, good = next((k, v) for k, v in saved_b["model"].items() if v.dim() == 2)
    wrong = {**saved_b["model"], name: torch.zeros(good.shape[0] + 1, good.shape[1])}
    try:
        load_full_state_dict(model, wrong if rank == 0 else None)
        out["problems"]["wrong shape"] = ["no error"]
    except ValueError as e:
        want = (name, str((good.shape[0] + 1, good.shape[1])), str(tuple(good.shape)))
        out["problems"]["wrong shape"] = [f"{e} lacks {w}" for w in want if w not in str(e)]

    # 8. Rank 0's state dicts that do not fit: every rank raises the same error (an unexpected key used to
    # raise on rank 0 only, leaving the others to hang at their next collective; torch's own position-keyed
    # optimizer.state_dict() used to load as nothing).
    position_keyed = {"state": {i: {} for i in range(3)}, "param_groups": []}
    bad_inputs = {
        "unexpected key": ({**saved_b["model"], "bogus": torch.zeros(1)}, None, ("unexpected ['bogus']",)),
        "position-keyed optimizer state": (saved_b["model"], position_keyed, ("[0, 1, 2]", "keyed by name")),
    }
    for label, (model_state, optim_state, words) in bad_inputs.items():
        try:
            load_full_state_dict(
                model,
                model_state if rank == 0 else None,
                opt if optim_state is not None else None,
                optim_state if rank == 0 else None,
            )
            out["problems"][label] = ["no error"]
        except ValueError as e:
            out["problems"][label] = [f"{e} lacks {w!r}" for w in words if w not in str(e)]

    # 9. Optimizer state from get_full_state_dict, loaded by name on every rank: an unstepped optimizer's
    # groups given in another order keep their own lr (torch matched them by position, and rank 0 alone
    # raised where the groups' sizes differed), and a parameter without saved state loads without state
    # (torch made some up: Adam's step count 1; and its strict check failed on rank 0 only).
    def grouped(order: str) -> torch.optim.Optimizer:
        parts = {"e": [], "r": []}
        for n, p in model.named_parameters():
            parts["e" if n.startswith(("embed", "head")) else "r"].append(p)
        settings = {"e": {"lr": 0.1}, "r": {"lr": 1e-3, "weight_decay": 0.5}}
        return torch.optim.AdamW([{"params": parts[k], **settings[k]} for k in order])

    unstepped = get_full_state_dict(model, grouped("er"))["optim"]
    swapped = grouped("re")
    load_full_state_dict(
        model, saved_b["model"] if rank == 0 else None, swapped, unstepped if rank == 0 else None
    )
    got = [(g["lr"], g["weight_decay"]) for g in swapped.param_groups]
    out["problems"]["unstepped groups by name"] = [
        f"{problem}" for problem in ([f"groups {got}"] if got != [(1e-3, 0.5), (0.1, 0.01)] else [])
    ] + ([f"{len(swapped.state)} parameters with made-up state"] if swapped.state else [])
    gone = ("blocks.1.up.weight", "blocks.1.up.bias")
    partial = {
        **saved_b["optim"],
        "state": {k: v for k, v in saved_b["optim"]["state"].items() if k not in gone},
    }
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    load_full_state_dict(model, saved_b["model"] if rank == 0 else None, opt, partial if rank == 0 else None)
    problems = differences(full_state(model, opt)["optim"], partial)
    out["problems"]["a parameter without state, broadcast"] = problems

    # 10. Groups that do not hold the saved groups' parameters: every rank raises, before any broadcast.
    try:
        load_full_state_dict(
            model,
            saved_b["model"] if rank == 0 else None,
            grouped("er"),
            saved_b["optim"] if rank == 0 else None,
        )
        out["problems"]["regrouped, broadcast"] = ["no error"]
    except ValueError as e:
        out["problems"]["regrouped, broadcast"] = [] if "split over" in str(e) else [str(e)]

    # 12. Rank 0's optimizer dict stays as it was after the load and further steps: torch keeps rank 0's
    # tensors of a parameter that is a plain tensor here (a layer off the tp mesh) as the optimizer's own,
    # so training changed the caller's snapshot (a second load of it started from the trained state).
    from torch.distributed.tensor.parallel import parallelize_module

    from smptk.parallel import SmptkColwiseParallel

    torch.manual_seed(7)
    mixed = nn.ModuleDict({"a": nn.Linear(4, 4), "c": nn.Linear(4, 4)})
    parallelize_module(mixed, state.submesh("tp"), {"a": SmptkColwiseParallel(gather_output=True)})
    adam = torch.optim.Adam(mixed.parameters(), lr=LR)

    def train(n: int) -> None:
        for i in range(n):
            adam.zero_grad()
            mixed["c"](mixed["a"](torch.full((2, 4), float(i + 1)))).square().sum().backward()
            adam.step()

    train(1)
    full = get_full_state_dict(mixed, adam)
    snapshot = full["optim"]
    kept = _map_tensors(snapshot, lambda t: t.clone())
    adam = torch.optim.Adam(mixed.parameters(), lr=LR)
    load_full_state_dict(mixed, full["model"] if rank == 0 else None, adam, snapshot if rank == 0 else None)
    train(2)
    out["problems"]["rank 0's dict untouched"] = [f"changed: {p}" for p in differences(snapshot, kept)]

    # 13. An empty parameter group (no parameters) gets the saved one's settings on every rank: torch left
    # the new optimizer's own (lr 9.0 where 0.5 was saved), as it does for load_checkpoint's.
    def spare(lrs: list[float]) -> torch.optim.Optimizer:
        a, c = list(mixed["a"].parameters()), list(mixed["c"].parameters())
        return torch.optim.AdamW(
            [
                {"params": [], "lr": lrs[0], "name": "spare"},
                {"params": a, "lr": lrs[1]},
                {"params": []},  # a second empty group takes the second saved one's (was refused: "split")
                {"params": c},
            ]
        )

    stepped = spare([0.5, 0.1])  # a stepped optimizer's: an unstepped one's groups came back right
    mixed["c"](mixed["a"](torch.ones(2, 4))).sum().backward()
    stepped.step()
    saved_spare = get_full_state_dict(mixed, stepped)["optim"]
    fresh = spare([9.0, 9.0])
    fresh.param_groups[2]["lr"] = 9.0
    load_full_state_dict(
        mixed, full["model"] if rank == 0 else None, fresh, saved_spare if rank == 0 else None
    )
    got = [(g["lr"], g.get("name")) for g in fresh.param_groups]
    want = [(0.5, "spare"), (0.1, None), (1e-3, None), (1e-3, None)]
    out["problems"]["empty group's settings, broadcast"] = [] if got == want else [f"groups {got}"]

    # 11. ``extra`` differing per rank: rank 0's is written (DCP used to keep another rank's).
    class Position:
        def __init__(self, value):
            self.value = value

        def state_dict(self):
            return {"pos": self.value, "t": torch.full((2,), float(self.value))}

        def load_state_dict(self, state):
            self.value = (state["pos"], state["t"].tolist())

    path = os.path.join(ckpt_dir, "extra")
    save_checkpoint(path, model, extra={"data": Position(100 + rank)})
    back = Position(None)
    load_checkpoint(path, model, extra={"data": back})
    out["problems"]["extra from rank 0"] = [] if back.value == (100, [100.0, 100.0]) else [str(back.value)]

    # 14. Dropout (a fork_rng("tp") region and a replicated nn.Dropout) under full activation checkpointing:
    # one step, save, one more step; then a model from another seed, the load, that step again gives the
    # same loss and state bit for bit (the generator state is in the checkpoint; without it the resumed
    # step drew other masks).
    path = os.path.join(ckpt_dir, "dropout")
    state = init("tp2_dp2")
    model, opt = build(state, seed=1, dropout=True)
    step(model, opt, state, 0)
    save_checkpoint(path, model, opt, step=1)
    want_loss, want = step(model, opt, state, 1), full_state(model, opt)
    state = init("tp2_dp2")
    model, opt = build(state, seed=8, dropout=True)
    load_checkpoint(path, model, opt)
    got_loss = step(model, opt, state, 1)
    problems = differences(full_state(model, opt), want)
    out["problems"]["dropout resumes exactly"] = problems + (
        [f"loss {got_loss!r}, uninterrupted {want_loss!r}"] if got_loss != want_loss else []
    )

    # 15. Generators out of step (rank 1 reseeded on its own): the save warns on every rank, and the load
    # gives every rank rank 0's state.
    if rank == 1:
        torch.manual_seed(99)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_checkpoint(path, model)
    said = [str(w.message) for w in caught if "generator states" in str(w.message)]
    problems = [] if any("ranks [1] differ from rank 0's" in m for m in said) else [f"warnings {said}"]
    load_checkpoint(path, model)
    states = [torch.empty_like(torch.get_rng_state()) for _ in range(world)]
    dist.all_gather(states, torch.get_rng_state())
    problems += [
        f"rank {r}'s state after the load is not rank 0's"
        for r in range(world)
        if not torch.equal(states[r], states[0])
    ]
    out["problems"]["generators out of step"] = problems

    sp.reset()
    if rank == 0:
        out["saved"] = {"tp2_dp2": saved_a, "hsdp": saved_b}
    return out
