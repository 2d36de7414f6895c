"""Checkpoints across configs (smptk.parallel.dcp): saved under one parallel config, loaded under another.

One 4-rank gloo job (``tests/dcp_jobs.py``) saves under TP 2 x DP 2 and under HSDP and loads into DP 4
full shard, HSDP and (broadcast from rank 0) TP 2 x DP 2; every parameter and optimizer state must come
back bit for bit. This process then loads both checkpoints into the plain model on one process (no
process group), and checks the errors a user meets.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dcp_jobs
from comm_harness import run_ranks

from smptk.parallel.dcp import (
    checkpoint_keys,
    get_full_state_dict,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
)

PHASES = ("tp2_dp2 -> dp4", "tp2_dp2 -> hsdp", "hsdp -> dp4", "broadcast from rank 0 -> tp2_dp2")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("dcp")
    result = run_ranks(
        "dcp_jobs:run", world=4, args=(str(ckpt),), timeout_s=300, env={"SMPTK_KERNELS": "torch"}
    )
    result.raise_for_failure()
    return ckpt, result.values


@pytest.mark.parametrize("phase", PHASES)
def test_loads_under_another_config_exactly(job, phase: str) -> None:
    _, values = job
    for rank, value in enumerate(values):
        assert value["problems"][phase] == [], f"rank {rank}, {phase}:\n" + "\n".join(
            value["problems"][phase]
        )


@pytest.mark.parametrize(
    "phase",
    [
        "snapshot (rank0_only=False)",
        "snapshot (rank0_only=True)",
        "wrong shape",
        "unexpected key",
        "position-keyed optimizer state",
        "unstepped groups by name",
        "a parameter without state, broadcast",
        "regrouped, broadcast",
        "extra from rank 0",
        "rank 0's dict untouched",
        "empty group's settings, broadcast",
        "dropout resumes exactly",
        "generators out of step",
    ],
)
def test_full_state_dict_is_a_copy_and_a_wrong_shape_is_named(job, phase: str) -> None:
    """``get_full_state_dict`` shares no memory with the live model (a step leaves it as it was), and
    ``load_full_state_dict`` with a tensor of the wrong shape raises on every rank, naming it."""
    _, values = job
    for rank, value in enumerate(values):
        assert value["problems"][phase] == [], f"rank {rank}, {phase}:\n" + "\n".join(
            value["problems"][phase]
        )


def test_job_trained_and_saved_optimizer_state(job) -> None:
    _, values = job
    saved = values[0]["saved"]
    # One Adam step before the first checkpoint, two before the second: the state is real, not empty.
    for name, steps in (("tp2_dp2", 1.0), ("hsdp", 2.0)):
        optim = saved[name]["optim"]["state"]
        assert set(optim) == set(saved[name]["model"])  # every parameter has Adam state (no buffers here)
        assert all(s["step"].item() == steps for s in optim.values()), name
        assert all(s["exp_avg"].abs().sum() > 0 for s in optim.values()), name
    assert not torch.equal(saved["tp2_dp2"]["model"]["head.weight"], saved["hsdp"]["model"]["head.weight"])
    assert all(v["loss_tp2_dp2"] > 0 and v["loss_hsdp"] > 0 for v in values)


@pytest.mark.parametrize("name", ["tp2_dp2", "hsdp"])
def test_one_process_loads_into_the_plain_model(job, name: str) -> None:
    ckpt, values = job
    saved = values[0]["saved"][name]
    model = dcp_jobs.TinyLM(seed=9)
    opt = torch.optim.Adam(model.parameters(), lr=dcp_jobs.LR)
    step = load_checkpoint(ckpt / name, model, opt)
    assert step == {"tp2_dp2": 1, "hsdp": 2}[name]
    got = dcp_jobs._map_tensors(
        get_full_state_dict(model, opt, rank0_only=False), lambda t: t.detach().clone()
    )
    problems = dcp_jobs.differences(got, saved)
    assert problems == [], "\n".join(problems)


def test_model_only_round_trip_and_keys(tmp_path) -> None:
    model = dcp_jobs.TinyLM(seed=1)
    save_checkpoint(tmp_path / "m", model)
    keys = checkpoint_keys(tmp_path / "m")
    assert sorted(keys) == sorted([*(f"model.{k}" for k in model.state_dict()), "rng"])
    other = dcp_jobs.TinyLM(seed=2)
    assert load_checkpoint(tmp_path / "m", other) is None  # no step saved
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def _dropout_run(tmp_path, resume: bool, **load_kwargs) -> tuple[list[float], torch.Tensor]:
    """Two SGD steps of a model with dropout, a save, two more steps (``resume``: after a new model from
    another seed and the load, as a new process would); the last two losses and the final weight."""

    def build(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.5), torch.nn.Linear(6, 1))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def train(model, opt, n: int) -> list[float]:
        losses = []
        for i in range(n):
            opt.zero_grad()
            loss = model(torch.full((4, 6), float(i + 1))).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    model, opt = build(0)
    train(model, opt, 2)
    save_checkpoint(tmp_path / "c", model, opt, step=2)
    if resume:
        model, opt = build(1)
        load_checkpoint(tmp_path / "c", model, opt, **load_kwargs)
    return train(model, opt, 2), model[2].weight.detach().clone()


def test_a_resume_draws_the_dropout_masks_of_the_uninterrupted_run(tmp_path) -> None:
    """The checkpoint keeps torch's default generator state (rank 0's, the same on every rank) and the load
    restores it: 2 steps + save + a new model + load + 2 steps equals 4 straight steps, bit for bit, with
    dropout (without it the resumed run drew other masks: losses 0.051 and weights 0.064 apart)."""
    losses, weight = _dropout_run(tmp_path / "a", resume=False)
    resumed_losses, resumed_weight = _dropout_run(tmp_path / "b", resume=True)
    assert resumed_losses == losses
    assert torch.equal(resumed_weight, weight)
    assert "rng" in checkpoint_keys(tmp_path / "b" / "c")


def test_rng_false_and_checkpoints_without_rng_leave_the_generators_alone(tmp_path) -> None:
    model = torch.nn.Linear(3, 2)
    save_checkpoint(tmp_path / "with", model)
    save_checkpoint(tmp_path / "without", model, rng=False)  # as checkpoints saved before it was kept
    assert "rng" not in checkpoint_keys(tmp_path / "without")
    for path, kwargs in (("without", {}), ("with", {"rng": False})):
        torch.manual_seed(123)
        expected = torch.rand(4)
        torch.manual_seed(123)
        load_checkpoint(tmp_path / path, model, **kwargs)
        assert torch.equal(torch.rand(4), expected), (path, kwargs)
    for call in (save_checkpoint, load_checkpoint):
        with pytest.raises(TypeError, match="rng: expected a bool, got str"):
            call(tmp_path / "with", model, rng="yes")


def test_a_cuda_generator_state_is_kept_and_restored_where_cuda_is(monkeypatch) -> None:
    """The current CUDA device's generator state is taken where CUDA is initialized, restored where CUDA
    is available, and left out (the CPU state still restored) on a machine without it. CUDA is faked
    (DCP itself would then look for streams), so the helpers save_checkpoint and load_checkpoint call are
    checked directly."""
    from smptk.parallel.dcp import _from_bytes, _rng_states, _set_rng_states, _to_bytes

    cuda_state = torch.arange(16, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: cuda_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    torch.manual_seed(5)
    saved = _from_bytes(_to_bytes(_rng_states()))  # as the checkpoint holds it
    expected = torch.rand(4)
    assert sorted(saved) == ["cpu", "cuda"] and torch.equal(saved["cuda"], cuda_state)
    torch.manual_seed(6)
    _set_rng_states(saved)
    assert torch.equal(torch.rand(4), expected)
    assert len(restored) == 1 and torch.equal(restored[0], cuda_state)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch.manual_seed(6)
    _set_rng_states(saved)  # a GPU run's checkpoint resumed on a CPU
    assert torch.equal(torch.rand(4), expected) and len(restored) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert sorted(_rng_states()) == ["cpu"]  # an uninitialized CUDA is not asked (nor initialized)


def test_errors(tmp_path) -> None:
    model = dcp_jobs.TinyLM(seed=1)
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(FileNotFoundError, match=r"no \.metadata"):
        load_checkpoint(tmp_path / "missing", model)
    save_checkpoint(tmp_path / "m", model, step=3)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        load_checkpoint(tmp_path / "m", model, opt)
    with pytest.raises(TypeError, match=r"model: expected an nn\.Module"):
        save_checkpoint(tmp_path / "x", {"w": torch.ones(1)})
    with pytest.raises(TypeError, match="optimizer: expected"):
        save_checkpoint(tmp_path / "x", model, model)
    with pytest.raises(ValueError, match="step: expected an int >= 0"):
        save_checkpoint(tmp_path / "x", model, step=-1)
    with pytest.raises(TypeError, match="path: expected"):
        save_checkpoint(3, model)
    bigger = torch.nn.Sequential(dcp_jobs.TinyLM(seed=1))  # every name gains a "0." prefix
    with pytest.raises(KeyError, match=r"missing \['0\.blocks"):
        load_checkpoint(tmp_path / "m", bigger)
    with pytest.raises(RuntimeError, match="default process group, and there is none"):
        load_full_state_dict(model, model.state_dict())


def _adam_run(tmp_path, save_at_0: bool, **opt_kwargs) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, **opt_kwargs)
    if save_at_0:
        save_checkpoint(tmp_path / "at0", model, opt, step=0)
        assert not opt.state, "saving changed the optimizer"
    model(torch.ones(2, 4)).square().sum().backward()
    opt.step()
    return model.weight.detach().clone(), opt.state[model.weight]


def test_an_unstepped_optimizer_saves_and_loads_as_new(tmp_path) -> None:
    """Torch's get_state_dict makes an unstepped optimizer's state by a step at lr 0 (Adam's step count 1,
    moments wd * p): saving at step 0 used to change the training that followed, and the checkpoint
    held that made-up state. Now the optimizer is left as it was, and the checkpoint loads as a new one."""
    w_plain, _ = _adam_run(tmp_path, False, weight_decay=0.1)
    w_saved, state_saved = _adam_run(tmp_path, True, weight_decay=0.1)
    assert torch.equal(w_plain, w_saved) and state_saved["step"].item() == 1.0
    assert not any(k.startswith("optim.state.") for k in checkpoint_keys(tmp_path / "at0"))
    # Loading it into a stepped optimizer resets that one to "new"; its groups' settings come back.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert load_checkpoint(tmp_path / "at0", model, opt) == 0
    assert not opt.state and opt.param_groups[0]["lr"] == 0.1
    opt.zero_grad()
    model(torch.ones(2, 4)).square().sum().backward()
    opt.step()
    assert torch.equal(model.weight.detach(), w_plain)
    fresh = torch.optim.Adam(model.parameters())
    assert get_full_state_dict(model, fresh)["optim"]["state"] == {} and not fresh.state


def test_load_with_gradients_present_loads_the_optimizer_state(tmp_path) -> None:
    """Torch skips making an optimizer's state while a parameter holds .grad, which used to load the
    weights and silently drop the saved state."""
    model = dcp_jobs.TinyLM(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "c", model, opt, step=1)
    other = dcp_jobs.TinyLM(seed=2)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.01)
    other(torch.zeros(2, 3, dtype=torch.long)).sum().backward()  # a warm-up: grads present
    grads = {n: p.grad.clone() for n, p in other.named_parameters()}
    assert load_checkpoint(tmp_path / "c", other, other_opt) == 1
    assert len(other_opt.state) == len(opt.state) > 0
    for (_, a), (_, b) in zip(opt.state.items(), other_opt.state.items(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and a["step"] == b["step"]
    assert all(torch.equal(p.grad, grads[n]) for n, p in other.named_parameters())  # put back


@pytest.mark.parametrize("strict", [True, False])
def test_a_parameter_without_optimizer_state_resumes_exactly(tmp_path, strict: bool) -> None:
    """A parameter that had no gradient before the save (a branch used from a later step on) has no state
    in the checkpoint. The load used to make some for it (torch's step at lr 0: Adam's count 1, so the
    first real step's bias correction was wrong: up to 0.07 off after 4 steps) under strict=False, and to
    refuse the checkpoint under strict=True; now it loads without state and the run resumes exactly."""

    def run(resume: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        for step in range(5):
            if resume and step == 1:
                save_checkpoint(tmp_path / "c", model, opt, step=step)
                torch.manual_seed(1)
                model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})
                opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
                assert load_checkpoint(tmp_path / "c", model, opt, strict=strict) == 1
                assert model.b.weight not in opt.state and model.a.weight in opt.state
            y = model.a(torch.randn(3, 4, generator=torch.Generator().manual_seed(step)))
            loss = (model.b(y) if step >= 2 else y).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return model

    straight, resumed = run(False), run(True)
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: differs from the straight run by {(p - q).abs().max()}"


def test_extra_state_resumes_the_lr_schedule(tmp_path) -> None:
    """An LR scheduler passed as ``extra`` comes back: 3 steps + save + new objects + load + 3 steps equals
    6 straight steps (without it the schedule would restart at its first value)."""

    def run(resume: bool) -> tuple[torch.Tensor, list[float]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)

        def make(model):
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)

        opt, sched = make(model)
        lrs = []
        for step in range(6):
            if resume and step == 3:
                save_checkpoint(tmp_path / "c", model, opt, step=step, extra={"sched": sched})
                model = torch.nn.Linear(4, 3)
                opt, sched = make(model)
                assert load_checkpoint(tmp_path / "c", model, opt, extra={"sched": sched}) == 3
            model(torch.ones(2, 4) * step).square().sum().backward()
            opt.step()
            opt.zero_grad()
            lrs.append(opt.param_groups[0]["lr"])
            sched.step()
        return model.weight.detach(), lrs

    (w, lrs), (w_resumed, lrs_resumed) = run(False), run(True)
    assert lrs_resumed == lrs == [0.1 * 0.5**s for s in range(6)]
    assert torch.equal(w, w_resumed)
    assert "extra.sched" in checkpoint_keys(tmp_path / "c")  # one value: the state as saved


def test_extra_refusals(tmp_path) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"extra\['x'\]: expected an object with state_dict"):
        save_checkpoint(tmp_path / "c", model, extra={"x": 3})
    with pytest.raises(ValueError, match="names must be non-empty strings without"):
        save_checkpoint(tmp_path / "c", model, extra={"a.b": torch.optim.SGD(model.parameters(), lr=1)})
    save_checkpoint(tmp_path / "c", model)
    with pytest.raises(KeyError, match=r"holds no state named \['sched'\]"):
        load_checkpoint(tmp_path / "c", model, extra={"sched": torch.optim.SGD(model.parameters(), lr=1)})


def test_save_warns_of_moe_counts_it_does_not_keep(tmp_path) -> None:
    """tokens_per_expert since the last update_expert_bias is not saved (a per-rank statistic): a save
    with counts pending warns; right after an update it does not."""
    import warnings

    from smptk.parallel import MoE

    moe = MoE(8, 16, num_experts=4, top_k=2, expert_bias=True)
    moe(torch.randn(5, 8))
    with pytest.warns(UserWarning, match=r"MoE layers \[''\] hold token counts"):
        save_checkpoint(tmp_path / "c", moe)
    moe.update_expert_bias(rate=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*overwrit")  # DCP's note on an existing directory
        save_checkpoint(tmp_path / "c", moe)


def test_load_refusals_name_the_problem(tmp_path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    groups = [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters(), "lr": 1e-3}]
    opt = torch.optim.SGD(groups, momentum=0.9)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "c", model, opt)
    with pytest.raises(ValueError, match="holds 2 parameter groups, the optimizer has 1"):
        load_checkpoint(tmp_path / "c", model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    with pytest.raises(RuntimeError, match=r"on the meta device .*materialize"):
        load_checkpoint(tmp_path / "c", meta)
    # DCP's CheckpointException derives from BaseException; it comes as a RuntimeError with its reason.
    wider = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    with pytest.raises(RuntimeError, match=r"loading the checkpoint at .*0\.weight"):
        load_checkpoint(tmp_path / "c", wider)


class _WithExtraState(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.extra = {"scale": 1.0, "n": 0}

    def get_extra_state(self) -> dict:
        return dict(self.extra)

    def set_extra_state(self, state: dict) -> None:
        self.extra = dict(state)


def test_strict_load_accepts_dict_extra_state(tmp_path) -> None:
    """DCP flattens a dict from get_extra_state into ``_extra_state.<key>`` keys, which strict=True used to
    call missing and unexpected."""
    model = _WithExtraState()
    model.extra = {"scale": 0.5, "n": 3}
    save_checkpoint(tmp_path / "c", model, step=1)
    other = _WithExtraState()
    assert load_checkpoint(tmp_path / "c", other) == 1
    assert other.extra == {"scale": 0.5, "n": 3}
    assert torch.equal(other.lin.weight, model.lin.weight)


def _two_groups(model: torch.nn.Module, order: str) -> torch.optim.AdamW:
    """AdamW with ``a`` at lr 0.1 / no decay and ``b`` at lr 1e-3 / decay 0.5, groups in ``order``."""
    settings = {"a": {"lr": 0.1, "weight_decay": 0.0}, "b": {"lr": 1e-3, "weight_decay": 0.5}}
    return torch.optim.AdamW([{"params": model[k].parameters(), **settings[k]} for k in order], lr=1.0)


def _ab() -> torch.nn.ModuleDict:
    return torch.nn.ModuleDict({"a": torch.nn.Linear(3, 3), "b": torch.nn.Linear(3, 3)})


def _save_ab(path, stepped: bool) -> None:
    """Save an ``_ab`` model with its groups [a, b] (``_two_groups``), after one step or before any."""
    model = _ab()
    opt = _two_groups(model, "ab")
    if stepped:
        (model.a(torch.ones(2, 3)) + model.b(torch.ones(2, 3))).sum().backward()
        opt.step()
    save_checkpoint(path, model, opt)


@pytest.mark.parametrize("stepped", [False, True])
def test_parameter_groups_are_matched_by_name_not_position(tmp_path, stepped: bool) -> None:
    """Groups saved as [a, b] loaded into an optimizer built as [b, a]: each gets its own lr and decay.
    Saved before the first step, torch matched them by position (b got a's lr 0.1 and no decay, silently)."""
    _save_ab(tmp_path / "c", stepped)
    other = _ab()
    swapped = _two_groups(other, "ba")
    load_checkpoint(tmp_path / "c", other, swapped)
    got = [(g["lr"], g["weight_decay"], len(g["params"])) for g in swapped.param_groups]
    assert got == [(1e-3, 0.5, 2), (0.1, 0.0, 2)]
    assert swapped.param_groups[0]["params"][0] is other.b.weight
    assert (other.a.weight in swapped.state) == stepped and (len(swapped.state) == 4) == stepped


@pytest.mark.parametrize("stepped", [False, True])
def test_parameter_groups_split_differently_are_refused_before_anything_loads(tmp_path, stepped) -> None:
    """Saved [a.*], [b.*]; the new optimizer groups [a.weight, b.weight], [a.bias, b.bias]. Torch's stepped
    load left group 0 without lr or betas (KeyError at the next step) and gave a.bias b's lr; now every
    mode refuses it, naming the group, with the model and the new optimizer left as they were."""
    _save_ab(tmp_path / "c", stepped)
    other = _ab()
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    for strict in (True, False):
        regrouped = torch.optim.AdamW(
            [{"params": [other.a.weight, other.b.weight]}, {"params": [other.a.bias, other.b.bias]}]
        )
        with pytest.raises(
            ValueError, match=r"parameter group 0 holds parameters of the checkpoint's groups"
        ):
            load_checkpoint(tmp_path / "c", other, regrouped, strict=strict)
        assert not regrouped.state, "a refused load left made-up optimizer state"
        assert all(torch.equal(p, before[n]) for n, p in other.named_parameters()), "the model was loaded"


def test_strict_false_loads_matching_groups_and_names_what_it_skipped(tmp_path) -> None:
    """A new module in its own group: strict refuses; strict=False loads the others' groups by name, keeps
    the new group's settings, and warns naming the keys it did not load."""
    model = _ab()
    opt = _two_groups(model, "ab")
    save_checkpoint(tmp_path / "c", model, opt)
    grown = torch.nn.ModuleDict({**_ab(), "c": torch.nn.Linear(3, 3)})
    three = torch.optim.AdamW(
        [{"params": grown[k].parameters(), "lr": lr} for k, lr in (("c", 7.0), ("b", 1.0), ("a", 1.0))]
    )
    with pytest.raises(ValueError, match="holds 2 parameter groups, the optimizer has 3"):
        load_checkpoint(tmp_path / "c", grown, three)
    with pytest.raises(KeyError, match=r"missing \['c\.bias', 'c\.weight'\]"):
        load_checkpoint(tmp_path / "c", grown)
    with pytest.warns(UserWarning, match=r"2 of the model's entries were not in the checkpoint .*'c\.bias'"):
        load_checkpoint(tmp_path / "c", grown, three, strict=False)
    assert [g["lr"] for g in three.param_groups] == [7.0, 1e-3, 0.1]
    assert torch.equal(grown.a.weight, model.a.weight) and not three.state


def test_a_checkpoint_without_model_state_is_refused_in_every_mode(tmp_path) -> None:
    """A plain ``dcp.save(model.state_dict())`` has no 'model.' keys: strict=False used to load nothing and
    return, and strict named nothing ('unexpected []')."""
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(3, 2)
    with pytest.warns(UserWarning):  # DCP: saving in one process
        dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "plain"))
    for strict in (True, False):
        with pytest.raises(KeyError, match=r"holds no model state \(its keys: \['bias', 'weight'\]\)"):
            load_checkpoint(tmp_path / "plain", torch.nn.Linear(3, 2), strict=strict)


def test_a_failed_optimizer_load_leaves_a_new_optimizer_new(tmp_path) -> None:
    """An Adam checkpoint into an Adam with amsgrad fails (no max_exp_avg_sq saved); the new optimizer used
    to keep the template's made-up state (step 1), so a run that caught the error and went on trained
    off. (An optimizer of another class is refused before, by name.)"""
    model = torch.nn.Linear(3, 2)
    plain = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    plain.step()
    save_checkpoint(tmp_path / "c", model, plain)
    amsgrad = torch.optim.Adam(model.parameters(), lr=0.1, amsgrad=True)
    with pytest.raises(RuntimeError, match=r"Missing key in checkpoint state_dict: optim\.state\.weight"):
        load_checkpoint(tmp_path / "c", model, amsgrad)
    assert not amsgrad.state


class _Positions:
    """A data position whose state gains keys in training (per-source offsets), as loaders' do."""

    def __init__(self) -> None:
        self.offsets: dict = {}
        self.seen: list = []

    def state_dict(self) -> dict:
        return {"offsets": dict(self.offsets), "seen": list(self.seen)}

    def load_state_dict(self, state: dict) -> None:
        self.offsets, self.seen = dict(state["offsets"]), list(state["seen"])


def test_extra_state_comes_back_whole(tmp_path) -> None:
    """The load used the new object's state_dict as DCP's template: keys it lacked were never read (the
    offsets came back {}), a list of tensors that grew failed, and an empty state was 'not saved'."""
    model = torch.nn.Linear(2, 2)
    pos = _Positions()
    pos.offsets = {"wiki": 1200, "code": 340}
    pos.seen = [torch.arange(3), torch.ones(2, 2)]
    save_checkpoint(tmp_path / "c", model, extra={"pos": pos, "empty": _Positions()})
    back, empty = _Positions(), _Positions()
    empty.offsets = {"stale": 1}
    load_checkpoint(tmp_path / "c", model, extra={"pos": back, "empty": empty})
    assert back.offsets == {"wiki": 1200, "code": 340}
    assert len(back.seen) == 2 and all(torch.equal(a, b) for a, b in zip(back.seen, pos.seen, strict=True))
    assert empty.offsets == {} and empty.seen == []


@pytest.mark.parametrize("stepped", [False, True])
def test_a_tensor_learning_rate_loads(tmp_path, stepped: bool) -> None:
    """``lr=torch.tensor(...)`` (for a compiled or capturable step) is saved as a tensor: reading the saved
    groups by name must ask DCP for a tensor there (a placeholder failed: 'expected BytesStorageMetadata')."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    if stepped:
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    save_checkpoint(tmp_path / "c", model, opt)
    other = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.5))
    load_checkpoint(tmp_path / "c", model, other)
    assert torch.equal(other.param_groups[0]["lr"], torch.tensor(0.01))
    assert len(other.state) == (2 if stepped else 0)


def test_a_damaged_metadata_file_is_named(tmp_path) -> None:
    """A truncated .metadata (an interrupted save) surfaced as pickle's UnpicklingError, naming no path."""
    save_checkpoint(tmp_path / "c", torch.nn.Linear(2, 2))
    metadata = tmp_path / "c" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:20])
    with pytest.raises(ValueError, match=r"\.metadata file could not be read .*damaged"):
        checkpoint_keys(tmp_path / "c")
    with pytest.raises(ValueError, match=r"\.metadata file could not be read"):
        load_checkpoint(tmp_path / "c", torch.nn.Linear(2, 2))


def test_nested_values_and_empty_groups_come_back_as_saved(tmp_path) -> None:
    """A group's dict value came back flattened into dotted keys ('meta.tag'), and an empty group that was
    not last came back without lr / betas (torch gave it the last saved group's settings: KeyError at the
    next step)."""
    model = torch.nn.Linear(3, 2)
    groups = [
        {"params": [], "lr": 0.5, "name": "spare"},
        {"params": [model.weight], "lr": 0.1, "meta": {"tag": "decay", "layer": 3}},
        {"params": [model.bias], "lr": 0.01, "weight_decay": 0.0},
        {"params": [], "lr": 0.7},  # a second empty group (torch's loader refused two)
    ]
    opt = torch.optim.AdamW(groups)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "c", model, opt)
    other = torch.optim.AdamW(
        [
            {"params": [], "lr": 9.0},
            {"params": [model.weight], "lr": 9.0},
            {"params": [model.bias], "lr": 9.0},
            {"params": [], "lr": 9.0},
        ]
    )
    load_checkpoint(tmp_path / "c", model, other)
    for got, want in zip(other.param_groups, opt.param_groups, strict=True):
        assert {k: v for k, v in got.items() if k != "params"} == {
            k: v for k, v in want.items() if k != "params"
        }
    other.step()  # every group has its betas


def test_an_optimizer_of_another_class_is_refused(tmp_path) -> None:
    """An AdamW checkpoint loaded into an Adam: the Adam silently took AdamW's settings (lr, weight decay,
    decoupled_weight_decay) and state, though the docstring promised another class raises. Refused before
    anything is copied; a checkpoint without optimizer loads as before."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "c", model, opt, step=3)
    assert load_checkpoint(tmp_path / "c", model, torch.optim.AdamW(model.parameters())) == 3
    before = {k: v.clone() for k, v in model.state_dict().items()}
    other = torch.optim.Adam(model.parameters(), lr=0.5)
    with pytest.raises(
        ValueError, match=r"holds the state of a torch\.optim\.adamw\.AdamW, this optimizer is a torch"
    ):
        load_checkpoint(tmp_path / "c", model, other)
    assert other.param_groups[0]["lr"] == 0.5 and not other.state
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class _ScriptAdam(torch.optim.Adam):
    """An optimizer class defined in a training script."""


@pytest.mark.parametrize("saved_in, loaded_in", [("__mp_main__", "__main__"), ("__main__", "train")])
def test_an_optimizer_class_saved_under_another_module_path_loads(
    tmp_path, monkeypatch: pytest.MonkeyPatch, saved_in: str, loaded_in: str
) -> None:
    """A class from the training script is ``__mp_main__.X`` in torch.multiprocessing's spawned workers,
    ``__main__.X`` under torchrun and ``train.X`` when imported: one class, which the class check refused
    ("holds the state of a __mp_main__._ScriptAdam, this optimizer is a __main__._ScriptAdam")."""
    model = torch.nn.Linear(4, 2)
    monkeypatch.setattr(_ScriptAdam, "__module__", saved_in)
    opt = _ScriptAdam(model.parameters(), lr=0.01)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "c", model, opt)
    monkeypatch.setattr(_ScriptAdam, "__module__", loaded_in)
    again = _ScriptAdam(model.parameters(), lr=0.5)
    load_checkpoint(tmp_path / "c", model, again)
    assert again.param_groups[0]["lr"] == 0.01
    assert torch.equal(again.state[model.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])
    with pytest.raises(ValueError, match=r"_ScriptAdam, this optimizer is a torch\.optim\.adam\.Adam"):
        load_checkpoint(tmp_path / "c", model, torch.optim.Adam(model.parameters()))
