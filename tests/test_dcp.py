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
    "phase", ["snapshot (rank0_only=False)", "snapshot (rank0_only=True)", "wrong shape"]
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
    assert sorted(keys) == sorted(f"model.{k}" for k in model.state_dict())
    other = dcp_jobs.TinyLM(seed=2)
    assert load_checkpoint(tmp_path / "m", other) is None  # no step saved
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


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
