"""smptk.parallel.fsdp: apply_data_parallel trains as the single process does, and says which path ran.

One 4-rank gloo job (``fsdp_jobs.run``) trains the same 2-block model for 3 SGD-with-momentum steps under
full sharding, HSDP (hybrid_shard_degree 2), replication (hybrid 1: DDP with smptk's hook), tensor
parallelism 2 x FSDP (torch's ColwiseParallel / RowwiseParallel) and TP 2 x replication (smptk's
ColumnParallelLinear / RowParallelLinear through SmptkColwiseParallel / SmptkRowwiseParallel), with
smptk's collectives (symmetric heap, and the copy-engine all-gather) and with torch's, and once in bf16.
Every fp32 run must end within 1e-5 of the single-process run on the whole batch (the sums run in
another order: 3e-8 .. 6e-8 measured), smptk's path and torch's must agree as closely, and the report
must name the path each collective took, with the calls counted per path (a silent fallback to torch
fails). In this process, torch's fake backend checks the units, the errors and the engine choice
without starting ranks.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from comm_harness import run_ranks
from helpers import fake_world
from torch import nn

import smptk.parallel as parallel
from smptk.parallel.fsdp import DataParallelReport, apply_data_parallel, mixed_precision_policy, select_units

# fp32: the data-parallel average and the sharded GEMMs sum in another order than the single process
# (measured 3e-8 .. 6e-8 on O(0.5) parameters after 3 steps); 1e-5 catches a wrong average or a missed
# reduction (O(1e-2) here).
FP32_TOL = 1e-5
# bf16 parameters and activations (8 mantissa bits) for 3 steps: measured 5.1e-4 from the fp32 run.
BF16_TOL = 1e-2
UNITS = ["blocks.1", "blocks.0", ""]  # default units: the ModuleList's children, bottom-up, then the root


@pytest.fixture(scope="module")
def job():
    result = run_ranks("fsdp_jobs:run", world=4, timeout_s=400, env={"SMPTK_KERNELS": "torch"})
    result.raise_for_failure()
    return result.values


def _case(values, name):
    return [v[name] for v in values]


def _mean_losses(runs) -> list[float]:
    """Per step, the mean of the ranks' losses: each dp slice counted once per tp peer, so the global mean."""
    return [sum(r["losses"][s] for r in runs) / len(runs) for s in range(len(runs[0]["losses"]))]


FP32_CASES = [
    "full_shard_smptk",
    "full_shard_torch",
    "hsdp_copy_engine",
    "replicate_ddp",
    "tp2_fsdp",
    "tp2_replicate",
    "delayed_init_ac",
]


@pytest.mark.parametrize("name", FP32_CASES)
def test_fp32_steps_equal_single_process(job, name: str) -> None:
    runs = _case(job, name)
    for rank, run in enumerate(runs):
        worst = max(run["diff"].items(), key=lambda kv: kv[1])
        assert worst[1] <= FP32_TOL, f"{name} rank {rank}: parameter {worst[0]} differs by {worst[1]:.3g}"
    ref = job[0]["reference_losses"]
    got = _mean_losses(runs)
    assert got == pytest.approx(ref, abs=FP32_TOL), f"{name}: mean loss per step {got}, reference {ref}"
    # smptk.parallel.clip_grad_norm_ over the sharded gradients: the reference's norms, the infinity norm
    # included where a rank's shard is empty
    for rank, run in enumerate(runs):
        for norm, (ours, want) in run["clip"].items():
            assert ours == pytest.approx(want, rel=1e-5), f"{name} rank {rank}: {norm}-norm {ours} vs {want}"


def test_clip_infinity_norms_of_partial_and_nan_gradients(job) -> None:
    """The infinity norm of a Partial (sum) gradient is its sum's largest entry (4.0 on 4 ranks; it was the
    largest piece, 2.0), a NaN in the last rank's shard makes every rank's norm NaN (the max all-reduce
    dropped it: 2.0), and -inf takes the smallest over the groups (0.25; it took the largest, 1.0). At -inf
    the same NaN makes the norm NaN and error_if_nonfinite raise on every rank (the norm was 1.0 and no rank
    raised), and a one-element gradient whose shard is empty on ranks 1-3 gives 0.75 on every rank (those
    ranks raised torch's 'cannot compute the -inf norm on an empty tensor' while rank 0 waited)."""
    for rank in range(4):
        edges = job[rank]["clip_edges"]
        assert edges["partial_inf"] == 4.0, (rank, edges)
        assert math.isnan(edges["nan_inf"]), (rank, edges)
        assert edges["neg_inf"] == 0.25, (rank, edges)
        assert math.isnan(edges["nan_neg_inf"]) and edges["nonfinite_raised"], (rank, edges)
        assert edges["empty_neg_inf"] == 0.75, (rank, edges)


def test_first_forward_under_inference_mode_then_training(job) -> None:
    """See fsdp_jobs.inference_first: FSDP2's first forward under inference_mode broke the model."""
    for rank in range(4):
        assert job[rank]["inference_first"] == {"tp1": None, "tp2": None}, (
            rank,
            job[rank]["inference_first"],
        )


def test_delayed_init_materializes_the_one_process_values(job) -> None:
    """Built on meta, sharded by FSDP2 over 4 CPU ranks, then materialized: every parameter equals the one
    process model's initial value exactly (the FSDP-sharded torch layers' resets used to draw each shard
    locally: the same numbers on every rank, and the layers after them shifted)."""
    for rank, run in enumerate(_case(job, "delayed_init_ac")):
        assert run["init_diff"] and all(d == 0 for d in run["init_diff"].values()), (rank, run["init_diff"])


@pytest.mark.parametrize("config", ["fsdp", "hsdp", "tp2_fsdp", "ep2_fsdp", "tp2_ep2"])
def test_delayed_init_gives_the_eager_values_under_every_layout(job, config: str) -> None:
    """fsdp_jobs.delayed_init_cases: a model of torch's, smptk's and hand-written layers (a tied, padded
    embedding; norms, batch norm, MoE; a table its layers share; a reset that writes a child through
    ``.data``) built on meta under TP / EP / FSDP / HSDP and materialized: every parameter and buffer
    gathered whole equals the eager one-process build, the tie and the shared table hold, and each
    parameter stores only its local shard."""
    for rank in range(4):
        assert job[rank]["delayed_init"][config] == [], (rank, job[rank]["delayed_init"][config])


def test_delayed_init_names_an_unwritten_parameter_on_every_rank(job) -> None:
    """A LoRA-style parameter no reset writes, under FSDP2 over 4 ranks: nn.Linear's reset ran on
    full-size stand-ins (torch.empty) of the module's sharded parameters and copied every one back, so
    the unwritten one took the stand-in's uninitialized memory and no rank raised. Now every rank names
    it (ranks 2 and 3, whose shard is empty, by its version counter)."""
    for rank in range(4):
        message = job[rank]["delayed_init"]["lora"]
        assert message is not None and "gave 1.lora_a values" in message, (rank, message)


def test_offloading_under_fsdp2_stores_and_loads_each_block_input_once(job) -> None:
    """delayed_init_ac offloads its checkpointed blocks' inputs (the config's sm_activation_offloading at
    horizon 1, the host copies made on the CPU too) under FSDP2: each step stores both blocks' inputs in
    forward order and backward loads each on demand, none ahead, while the parameters end within FP32_TOL
    of the single process (test_fp32_steps_equal_single_process)."""
    step = [("store", 0), ("store", 1), ("load", 1, "on demand"), ("load", 0, "on demand")]
    for rank, run in enumerate(_case(job, "delayed_init_ac")):
        assert run["offload_log"] == step * 3, (rank, run["offload_log"])


def test_smptk_and_torch_collectives_give_the_same_parameters(job) -> None:
    for rank in range(4):
        a, b = job[rank]["full_shard_smptk"]["params"], job[rank]["full_shard_torch"]["params"]
        for n in a:
            assert (a[n] - b[n]).abs().max().item() <= FP32_TOL, f"rank {rank}: {n}"


def _units(run):
    return {u[0]: u for u in run["units"]}


def test_report_full_shard_smptk(job) -> None:
    for run in _case(job, "full_shard_smptk"):
        assert (run["mode"], run["engine"], run["smptk"], run["reason"]) == ("full_shard", "fsdp2", True, "")
        assert run["heap_bytes"] == 64 * 1024
        units = _units(run)
        assert list(units) == UNITS
        assert [units[n][2] for n in UNITS] == [228, 228, 75]  # elements per unit; the root keeps inp + head
        for name, _engine, _numel, ag, rs, ar, calls in run["units"]:
            assert ag == "smptk all-gather (max_sms=1)" and rs == "smptk reduce-scatter (max_sms=1)", name
            assert ar == "none (no dp_replicate dim)"
            # reshard_after_forward=True: forward + backward all-gather per step; one reduce-scatter per step
            assert calls == {
                ("all-gather", "symmetric", "float32"): 6,
                ("reduce-scatter", "symmetric", "float32"): 3,
            }, name


def test_report_torch_path(job) -> None:
    for run in _case(job, "full_shard_torch"):
        assert not run["smptk"] and run["reason"] == "use_smptk_collectives=False" and run["heap_bytes"] == 0
        for name, _engine, _numel, ag, rs, _ar, calls in run["units"]:
            assert ag == rs == "torch (use_smptk_collectives=False)" and calls == {}, name


def test_report_hsdp_copy_engine(job) -> None:
    for run in _case(job, "hsdp_copy_engine"):
        assert (run["mode"], run["engine"], run["smptk"]) == ("hybrid_shard", "fsdp2", True)
        for name, _engine, _numel, ag, rs, ar, calls in run["units"]:
            assert ag == "smptk all-gather (copy engine, max_sms=0)", name
            assert rs == "smptk reduce-scatter (max_sms=1: it has no copy-engine path)", name
            assert ar.startswith("torch (FSDP2 all-reduces across dp_replicate itself"), name
            # reshard_after_forward=False: one all-gather per step
            assert calls == {
                ("all-gather", "copy_engine", "float32"): 3,
                ("reduce-scatter", "symmetric", "float32"): 3,
            }, name


def test_report_replicate_on_ddp_with_smptk_hook(job) -> None:
    for run in _case(job, "replicate_ddp"):
        assert (run["mode"], run["engine"], run["smptk"]) == ("replicate", "ddp", True)
        ((name, engine, numel, ag, rs, ar, calls),) = run["units"]
        assert (name, engine, numel) == ("", "ddp", 531)
        assert ag == rs == "none (replicated parameters)"
        assert ar == "smptk all-reduce (DDP comm hook, max_sms=2)"  # comm_max_sms 2 reached the hook
        assert calls == {("all-reduce", "symmetric", "float32"): 3}  # one 531-value bucket per step
        assert run["ddp_options"] == (True, 1024 * 1024)  # ddp_options reached DistributedDataParallel


def test_report_tensor_parallel_cases(job) -> None:
    for run in _case(job, "tp2_fsdp"):
        assert run["up_layer"] == "Linear"  # torch's ColwiseParallel keeps the module, with DTensor weights
        assert (run["mode"], run["engine"], run["smptk"]) == ("full_shard", "fsdp2", True)
        for name, *_, calls in run["units"]:
            assert calls == {
                ("all-gather", "symmetric", "float32"): 3,
                ("reduce-scatter", "symmetric", "float32"): 3,
            }, name
    for run in _case(job, "tp2_replicate"):
        assert run["up_layer"] == "ColumnParallelLinear"  # smptk's layers, from SmptkColwiseParallel
        assert (run["mode"], run["engine"], run["smptk"]) == ("replicate", "fsdp2", False)
        assert "DDP cannot hold the DTensor parameters" in run["reason"]
        for name, _engine, _numel, ag, _rs, ar, calls in run["units"]:
            assert ag == "torch (the dp_shard group has 1 rank: there is nothing to gather or scatter)", name
            assert ar.startswith("torch (FSDP2 all-reduces") and calls == {}, name


def test_bf16_trains_with_fp32_reduction(job) -> None:
    runs = _case(job, "full_shard_bf16")
    ref = job[0]["reference_losses"]
    for rank, run in enumerate(runs):
        assert (run["param_dtype"], run["reduce_dtype"]) == (torch.bfloat16, torch.float32)
        worst = max(run["diff"].values())
        assert worst <= BF16_TOL, f"rank {rank}: bf16 run is {worst:.3g} from the fp32 reference"
        for name, *_, calls in run["units"]:
            assert calls == {
                ("all-gather", "symmetric", "bfloat16"): 3,  # parameters gathered in bf16
                ("reduce-scatter", "symmetric", "float32"): 3,  # gradients reduced in fp32
            }, name
    got = _mean_losses(runs)
    assert got == pytest.approx(ref, abs=BF16_TOL) and got[-1] < got[0], got


# ---------------------------------------------------------------------------------------------------------
# In this process


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.act = nn.GELU()
        self.head = nn.Linear(4, 3)


def _names(units) -> list[str]:
    return [n for n, _ in units]


def test_select_units() -> None:
    model = _Nested()
    assert _names(select_units(model)) == ["layers.1", "layers.0"]
    # no ModuleList: every direct child holding parameters (the GELU holds none)
    flat = nn.Sequential(nn.Linear(2, 3), nn.GELU(), nn.Linear(3, 2))
    assert _names(select_units(flat)) == ["2", "0"]
    assert _names(select_units(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))) == ["1", "0"]
    # classes: nested picks come children first
    assert _names(select_units(model, [_Block, nn.Linear])) == [
        "head",
        "layers.1.lin",
        "layers.1",
        "layers.0.lin",
        "layers.0",
    ]
    assert _names(select_units(model, ["head", "emb"])) == ["head", "emb"]
    assert _names(select_units(model, lambda name, m: isinstance(m, nn.Embedding))) == ["emb"]
    assert select_units(model, []) == []


def test_select_units_rejects_bad_specs() -> None:
    model = _Nested()
    with pytest.raises(ValueError, match=re.escape("modules: no submodule named 'layer.0'")):
        select_units(model, ["layer.0"])
    with pytest.raises(TypeError, match=r"modules: expected nn.Module subclasses or qualified module names"):
        select_units(model, [3])
    with pytest.raises(TypeError, match="modules: expected None, a callable"):
        select_units(model, "layers.0")


class _TitanLike(nn.Module):
    """torchtitan's layout: the blocks in an nn.ModuleDict keyed by their index."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(7, 4)
        self.layers = nn.ModuleDict({str(i): _Block() for i in range(2)})
        self.out = nn.Linear(4, 3)


def test_the_default_units_are_a_module_dicts_blocks() -> None:
    """The default picked the ModuleDict itself as a unit (a model without a ModuleList: every direct child
    holding parameters), and fully_shard refused it ('containers that do not implement forward')."""
    assert _names(select_units(_TitanLike())) == ["layers.1", "layers.0"]


def test_a_class_that_matches_nothing_is_refused() -> None:
    """An unmatched class left the root as the only unit (the whole model in one all-gather), silently,
    where an unmatched name raised."""
    with pytest.raises(ValueError, match=r"modules: no submodule is a Conv1d .*pass \[\] for that"):
        select_units(_Nested(), [nn.Conv1d, nn.Linear])


def test_mixed_precision_policy() -> None:
    bf16 = mixed_precision_policy("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    fp16 = mixed_precision_policy("fp16")
    assert (fp16.param_dtype, fp16.reduce_dtype) == (torch.float16, torch.float32)
    fp32 = mixed_precision_policy("fp32")
    assert (fp32.param_dtype, fp32.reduce_dtype) == (None, None)
    with pytest.raises(ValueError, match="mixed_precision: expected one of bf16, fp16, fp32, got 'tf32'"):
        mixed_precision_policy("tf32")


def test_argument_errors() -> None:
    with fake_world(2):
        with pytest.raises(RuntimeError, match=re.escape("call smptk.parallel.init(config) first")):
            apply_data_parallel(nn.Linear(2, 2))
        state = parallel.init({"mixed_precision": "fp32"})
        with pytest.raises(TypeError, match=r"model: expected an nn.Module, got Tensor"):
            apply_data_parallel(torch.zeros(2), state)
        with pytest.raises(TypeError, match=r"state: expected the ParallelState of smptk\.parallel\.init"):
            apply_data_parallel(nn.Linear(2, 2), {"hybrid_shard_degree": 0})
        with pytest.raises(ValueError, match="use_smptk_collectives: expected 'auto', True or False, got 1"):
            apply_data_parallel(nn.Linear(2, 2), state, use_smptk_collectives=1)
        with pytest.raises(
            TypeError, match="reshard_after_forward: expected a bool, an int or None, got str"
        ):
            apply_data_parallel(nn.Linear(2, 2), state, reshard_after_forward="yes")
        with pytest.raises(TypeError, match="ddp_options: expected a mapping of keyword arguments, got list"):
            apply_data_parallel(nn.Linear(2, 2), state, ddp_options=["static_graph"])
        with pytest.raises(ValueError, match="ddp_options: 'process_group' is set by apply_data_parallel"):
            apply_data_parallel(nn.Linear(2, 2), state, ddp_options={"process_group": None})
        with pytest.raises(ValueError, match=r"ddp_options: 'find_unused' is not an argument of Distributed"):
            apply_data_parallel(nn.Linear(2, 2), state, ddp_options={"find_unused": True})
        # full shard runs on FSDP2, where DDP's options would do nothing
        with pytest.raises(ValueError, match=r"ddp_options \['static_graph'\]: this model runs on FSDP2"):
            apply_data_parallel(nn.Linear(2, 2), state, ddp_options={"static_graph": True})
        # DDP's own mixed precision registers a comm hook, and smptk's then failed in torch ("can only be
        # called once"); named up front unless torch's collectives are asked for
        with pytest.raises(
            ValueError, match="ddp_options: DDP's 'mixed_precision' registers its own comm hook"
        ):
            apply_data_parallel(nn.Linear(2, 2), state, ddp_options={"mixed_precision": object()})


def test_the_ddp_path_checks_its_arguments() -> None:
    """The DDP path ignored ``modules`` (a typo surfaced only once the config moved the model to FSDP2) and
    wrapped its own result again (every gradient all-reduced twice, state_dict keys module.module.*)."""
    with fake_world(2):
        state = parallel.init({"hybrid_shard_degree": 1, "mixed_precision": "fp32"})
        with pytest.raises(ValueError, match=re.escape("modules: no submodule named 'no.such'")):
            apply_data_parallel(nn.Sequential(nn.Linear(2, 2)), state, modules=["no.such"])
        with pytest.raises(TypeError, match="modules: expected None, a callable"):
            apply_data_parallel(nn.Sequential(nn.Linear(2, 2)), state, modules=5)
        ddp, report = apply_data_parallel(nn.Sequential(nn.Linear(2, 2)), state, use_smptk_collectives=False)
        assert report.engine == "ddp"
        with pytest.raises(TypeError, match=r"a DistributedDataParallel already .*pass the model it wraps"):
            apply_data_parallel(ddp, state, use_smptk_collectives=False)


def test_a_module_shared_by_two_units_is_named() -> None:
    """ALBERT-style sharing (one Linear in every block): FSDP2 failed with "Cannot concatenate overlapping
    meshes"; the shared parameter is named, with what works instead. Nested units stay allowed."""

    class Block(nn.Module):
        def __init__(self, shared: nn.Module) -> None:
            super().__init__()
            self.norm, self.shared = nn.LayerNorm(4), shared

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            lin = nn.Linear(4, 4)
            self.blocks = nn.ModuleList([Block(lin), Block(lin)])

    with fake_world(2):
        state = parallel.init({"hybrid_shard_degree": 0, "mixed_precision": "fp32"})
        message = r"blocks\.1\.shared\.weight is also blocks\.0\.shared\.weight: a module shared by two units"
        with pytest.raises(ValueError, match=message):
            apply_data_parallel(Model(), state, use_smptk_collectives=False)
        # the whole model one unit (the root): the shared Linear sits in one unit
        _, report = apply_data_parallel(
            Model(), state, modules=lambda n, m: False, use_smptk_collectives=False
        )
        assert len(report.units) == 1


def test_an_empty_trainable_parameter_is_named_before_fsdp2_fails_in_backward() -> None:
    """A [0, 8] trainable weight passed fully_shard and failed in the first backward on every rank
    ("_chunk_cat expects non-empty tensor"); it is named up front. Frozen, it stays allowed."""
    with fake_world(2):
        state = parallel.init({"hybrid_shard_degree": 0, "mixed_precision": "fp32"})
        model = nn.Sequential(nn.Linear(4, 0), nn.Linear(4, 4))
        empty = r"\['0.weight', '0.bias'\]: trainable parameters with no elements"
        with pytest.raises(ValueError, match=empty):
            apply_data_parallel(model, state, use_smptk_collectives=False)
        model[0].requires_grad_(False)
        apply_data_parallel(model, state, use_smptk_collectives=False)


def test_replication_reason_names_every_cause() -> None:
    """At tp 1 smptk's layers still hold DTensors: the reason said "tensor parallelism
    (tensor_parallel_degree 1)", and never named bf16, the other cause."""
    with fake_world(2):
        state = parallel.init({"hybrid_shard_degree": 1, "mixed_precision": "bf16"})
        model = nn.Sequential(parallel.ColumnParallelLinear(4, 4))
        _, report = apply_data_parallel(model, state, use_smptk_collectives=False)
        assert report.engine == "fsdp2"
        assert "DDP cannot hold DTensor parameters (0.weight: smptk's parallel layers" in report.reason
        assert "mixed_precision 'bf16'" in report.reason and "tensor_parallel_degree 1)" not in report.reason


def test_ddp_leaves_the_moe_token_counts_out_of_its_buffer_broadcast() -> None:
    """DDP broadcasts rank 0's buffers before each forward: between two accumulated forwards it replaced
    every rank's tokens_per_expert with rank 0's, and update_expert_bias summed wrong loads. The counts
    are no longer broadcast; the expert bias (equal on every rank) and other buffers still are."""
    from smptk.parallel import MoE

    with fake_world(2):
        state = parallel.init({"hybrid_shard_degree": 1, "mixed_precision": "fp32"})
        model = nn.Sequential(nn.BatchNorm1d(4), MoE(4, 6, 4, top_k=2, expert_bias=True))
        model[1]._ddp_params_and_buffers_to_ignore = []  # a user's own list on a submodule: no effect
        ddp, report = apply_data_parallel(model, state, use_smptk_collectives=False)
        assert report.engine == "ddp"
        broadcast = {id(b) for b in ddp.modules_buffers}
        assert id(model[1].tokens_per_expert) not in broadcast
        assert id(model[1].expert_bias) in broadcast and id(model[0].running_mean) in broadcast


def test_replicating_a_meta_model_runs_on_fsdp2() -> None:
    """DDP checks and broadcasts allocated parameters at construction (Tensor.item() on meta used to crash
    in there), and transform's delayed-init flow (build on meta, transform, materialize) cannot materialize
    first: it was refused at hybrid_shard_degree 1 and fp32, where every other layout worked. A meta model
    replicates on FSDP2 over a 1-rank shard dim, saying why, and materialize allocates it after."""
    with fake_world(2):
        state = parallel.init({"hybrid_shard_degree": 1, "mixed_precision": "fp32"})
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
        out, report = apply_data_parallel(model, state, use_smptk_collectives=False)
        assert report.engine == "fsdp2" and report.mode == "replicate"
        assert "DDP needs allocated parameters and 0.weight is on the meta device" in report.reason
        parallel.materialize(out, state)
        assert not any(p.is_meta for p in out.parameters())


def test_smptk_required_where_it_cannot_run() -> None:
    with fake_world(2):
        state = parallel.init({"tensor_parallel_degree": 2, "mixed_precision": "fp32"})  # dp_shard has 1 rank
        msg = (
            "use_smptk_collectives=True, but smptk's collectives cannot run here: "
            "the dp_shard group has 1 rank"
        )
        with pytest.raises(RuntimeError, match=re.escape(msg)):
            apply_data_parallel(nn.Linear(2, 2), state, use_smptk_collectives=True)


def test_engine_choice_and_units_on_a_fake_world() -> None:
    """Replication in bf16 runs on FSDP2 (DDP's mixed precision excludes smptk's hook), units as chosen."""
    with fake_world(4):
        state = parallel.init({"hybrid_shard_degree": 1, "mixed_precision": "bf16"})
        model = _Nested()
        out, report = apply_data_parallel(model, state, modules=[_Block], use_smptk_collectives=False)
        assert out is model and isinstance(report, DataParallelReport)
        assert (report.mode, report.engine) == ("replicate", "fsdp2")
        assert report.reason.startswith(
            "replicate runs on FSDP2 with a 1-rank dp_shard dim: mixed_precision 'bf16'"
        )
        assert [u.name for u in report.units] == ["layers.1", "layers.0", ""]
        assert [u.num_params for u in report.units] == [20, 20, 28 + 15]
        assert report.sizes == {"dp_replicate": 4, "dp_shard": 1, "tp": 1}
        assert "replicate on fsdp2 (dp_replicate 4, dp_shard 1, tp 1" in report.describe()
