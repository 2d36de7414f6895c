"""Measured validation of ``smptk.parallel.planner.estimate_memory`` on CPU: predicted against real bytes.

The planner sizes a training step from formulas (estimate.py's docstring); this module builds the model
those formulas describe (:mod:`smptk.testing.transformer`, from small ModelSpecs) under smptk's own
parallelism and measures it (``tests/planner_jobs.py``):

- Model states must be exact: this rank's bytes of parameters, of gradients after backward and of AdamW's
  two moments after a step (local shards of DTensors), the largest over the ranks, equal the estimate's
  parameter / gradient / optimizer bytes. Single process (dense and MoE), tensor parallelism 2 (with and
  without sequence parallelism), FSDP2 full shard over 2 and 4 ranks, HSDP (2 x 2), TP 2 x FSDP 2, and
  expert parallelism (EP 2, EP 2 x DP 2, EP 4) on the MoE spec. Vocabulary 126 and MLP width 90 make
  FSDP2 pad (rank 0 holds the rounded-up rows), which the estimate must reproduce. Bytes are those of the
  storages under the local shards, each counted once. Also on Hugging Face models through ``transform``:
  every configuration ``advise`` ranks for a tiny Llama and Mixtral on 4 ranks, and the delayed-
  initialization flow (built on meta, replicated on FSDP2) on 2.
- A Hugging Face Llama through ``transform`` (one process, tp 1, fp32 and bf16, sdpa and eager, each
  checkpointing mode) must keep exactly the estimate plus the excess the README states for it
  (:func:`hf_llama_excess`: Hugging Face's RMSNorm, RoPE tables, the blocks' call arguments, its loss).
- Activations must be within 10% of the estimate (they come out within 0.5% here): what one forward of
  the model and its loss leaves for backward, counted by saved-tensor hooks (no checkpointing) and by the
  storages created in the forward that outlive it (full and selective checkpointing, which keep tensors
  the hooks cannot see); with no checkpointing the two counts must agree within 3%. Single process:
  flash and materialized attention, each with no / full / selective checkpointing, in fp32, and flash in
  bf16 (a ``.to(bfloat16)`` model against the estimate with ``mixed_precision="bf16"``; its model states
  are not compared: the estimate counts FSDP2's fp32 master weights, which a bf16 model does not have).
  Tensor parallelism 2 with and without sequence parallelism, no / full / selective checkpointing (the
  collectives' outputs, which "selective" keeps, included), on 2 ranks. The
  MoE spec (4 experts, top 2, one shared expert) with no / full / selective checkpointing, measured on
  smptk's Triton kernels (the GPU path; Triton's interpreter here), skipped where they cannot run on CPU.

Multi-rank cases run as one job per world size (2 and 4 gloo ranks, every case in one spawn: starting
processes dominates), with ``SMPTK_KERNELS=torch`` and ``TRITON_INTERPRET=0`` (smptk's collectives then
take torch.distributed, and the interpreted heap would take minutes). The symmetric heaps are checked on
their own: one 2-rank step per ``planner_jobs.HEAP_CASES`` case with smptk's collectives under
``TRITON_INTERPRET=1`` (the heap's CPU backend), whose segments' bytes must equal the estimate's heap term.
Single-process cases run in this process on a 1-rank gloo group.
"""

from __future__ import annotations

import planner_jobs as jobs
import pytest
import torch
from comm_harness import run_ranks
from helpers import one_rank_group

from smptk.parallel.planner import estimate_memory, from_hf_config

TOLERANCE = 0.10  # activations, measured / predicted - 1
AGREEMENT = 0.03  # hooks against live storages, no checkpointing
STATES = ("parameters", "gradients", "optimizer")
JOB_ENV = {"SMPTK_KERNELS": "torch", "TRITON_INTERPRET": "0"}


def estimate(world: int, name: str):
    spec, config, attention, sp, _ = jobs.CASES[world][name]
    return estimate_memory(
        jobs.SPECS[spec], config, seq_len=jobs.SEQ, micro_batch=jobs.MICRO_BATCH, world_size=world,
        attention=attention, sequence_parallel=sp,
    )  # fmt: skip


def _triton_runs_on_cpu() -> bool:
    from smptk.kernels import runtime

    with jobs.kernels("auto"):
        try:
            return runtime.select_path(torch.empty(0)) == "triton"
        except RuntimeError:  # TRITON_INTERPRET set after triton was imported
            return False


TRITON = _triton_runs_on_cpu()


@pytest.fixture(scope="module")
def single():
    """Every single-process case, on a 1-rank gloo group in this process."""
    with one_rank_group():
        out = {}
        for name, case in jobs.SINGLE.items():
            measure = "triton" if name in jobs.TRITON_MEASURED and TRITON else "torch"
            out[name] = jobs.run_case(*case, step_kernels="torch", measure_kernels=measure)
        yield out


def _job(world: int) -> list:
    result = run_ranks("planner_jobs:run", world=world, timeout_s=300, env=JOB_ENV)
    result.raise_for_failure()
    return result.values


@pytest.fixture(scope="module")
def world2():
    return _job(2)


@pytest.fixture(scope="module")
def world4():
    return _job(4)


def _ranks(request, world: int) -> list[dict]:
    """Per rank, the case results of the ``world``-rank job (a list of one for the single process)."""
    if world == 1:
        return [request.getfixturevalue("single")]
    return request.getfixturevalue(f"world{world}")


def _check_activations(name: str, measured: dict, predicted: int, checkpointing: str) -> None:
    if checkpointing == "none":
        hooks, live = measured["hooks"], measured["live"]
        assert abs(live / hooks - 1) <= AGREEMENT, (
            f"{name}: saved-tensor hooks {hooks} B, live storages {live} B"
        )
        got = hooks
    else:
        got = measured["live"]
    ratio = got / predicted
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{name}: measured {got} B, predicted {predicted} B (ratio {ratio:.4f})"
    )


STATE_CASES = [
    (world, name)
    for world, cases in jobs.CASES.items()
    for name, (_, config, *_) in cases.items()
    if config["mixed_precision"] == "fp32"
]
ACTIVATION_CASES = [
    (world, name)
    for world, cases in jobs.CASES.items()
    for name, case in cases.items()
    if case[4] == "activations"
]


@pytest.mark.parametrize(("world", "name"), STATE_CASES, ids=[f"w{w}-{n}" for w, n in STATE_CASES])
def test_model_states_are_exact(request, world: int, name: str) -> None:
    ranks = _ranks(request, world)
    est = estimate(world, name)
    predicted = {
        "parameters": est.parameter_bytes,
        "gradients": est.gradient_bytes,
        "optimizer": est.optimizer_bytes,
    }
    for kind in STATES:
        per_rank = [r[name]["states"][kind] for r in ranks]
        assert max(per_rank) == predicted[kind], (
            f"{name} {kind}: ranks hold {per_rank} B, predicted {predicted[kind]}"
        )
        # the busiest rank is rank 0 (FSDP2's padding leaves the last ranks the fewest rows)
        assert per_rank[0] == max(per_rank), f"{name} {kind}: {per_rank}"


@pytest.mark.parametrize(("world", "name"), ACTIVATION_CASES, ids=[f"w{w}-{n}" for w, n in ACTIVATION_CASES])
def test_activations_match_what_autograd_keeps(request, world: int, name: str) -> None:
    if name in jobs.TRITON_MEASURED and not TRITON:
        pytest.skip("smptk's Triton kernels cannot run on CPU here (no Triton, or no TRITON_INTERPRET=1)")
    ranks = _ranks(request, world)
    config = jobs.CASES[world][name][1]
    predicted = estimate(world, name).activation_bytes
    for rank, results in enumerate(ranks):
        _check_activations(
            f"{name} rank {rank}", results[name]["activations"], predicted, config["activation_checkpointing"]
        )


def test_advised_configurations_run_and_hold_the_estimated_states(world4) -> None:
    """Every configuration ``advise`` ranks for a tiny Llama and Mixtral on a 4-GPU cluster
    (``planner_jobs.ADVISED_*``: tp 1 and 2, DDP, HSDP, full sharding, ep 2 and 4) fits by its own estimate,
    and runs: ``transform`` with it and one AdamW step on 4 ranks, after which the busiest rank holds the
    estimate's parameter, gradient and optimizer bytes (DDP's gradient buckets live inside DDP's reducer,
    not in ``.grad``: left out of the gradients compared)."""
    measured = [r["advised"] for r in world4]
    seen = set()
    for model in jobs.ADVISED_MODELS:
        for key, c in jobs.advised(model).items():
            est = c.estimate
            assert c.fits and est.fits(), f"{key}: {est.total_bytes} B advised"
            buckets = sum(t.bytes for t in est.terms if t.name == "DDP gradient buckets")
            predicted = {
                "parameters": est.parameter_bytes,
                "gradients": est.gradient_bytes - buckets,
                "optimizer": est.optimizer_bytes,
            }
            # FSDP2 computes on a copy of the parameters (on a 1-rank shard group too); DDP on them
            gathered = any(t.name == "FSDP2 gathered parameters" for t in est.terms)
            assert [r[key]["head_gathered"] for r in measured] == [gathered] * len(measured), (
                key,
                est.engine,
            )
            for kind in STATES:
                per_rank = [r[key][kind] for r in measured]
                assert max(per_rank) == predicted[kind], (
                    f"{key} {kind}: ranks hold {per_rank}, predicted {predicted}"
                )
            seen.add((est.engine, est.sizes["tp"], est.sizes["ep"]))
    engines = {e for e, _, _ in seen}
    assert {"ddp", "fsdp2 hybrid_shard", "fsdp2 full_shard"} <= engines, seen
    assert {t for _, t, _ in seen} == {1, 2} and {ep for _, _, ep in seen} == {1, 2, 4}, seen


def test_delayed_initialization_holds_the_estimated_states(world2) -> None:
    """hybrid_shard_degree 1 in fp32 with delayed_parameter_initialization (``planner_jobs.DELAYED_INIT``:
    built on meta, transformed, materialized) replicates on FSDP2, with one gradient per parameter."""
    est = estimate_memory(
        from_hf_config(jobs.ADVISED_MODELS["llama"]), jobs.DELAYED_INIT, seq_len=16, world_size=2
    )
    for rank, results in enumerate(world2):
        got = results["delayed_init"]
        assert got["engine"] == "fsdp2" and est.engine == "fsdp2 (unsharded)", (
            rank,
            got["engine"],
            est.engine,
        )
        predicted = {"parameters": est.parameter_bytes, "gradients": est.gradient_bytes}
        predicted["optimizer"] = est.optimizer_bytes
        assert got["states"] == predicted, f"rank {rank}: holds {got['states']}, predicted {predicted}"
        assert got["gathered"] and any(t.name == "FSDP2 gathered parameters" for t in est.terms)


HEAP_BYTES = 2**20 + 16  # a data region that is not whole pages: the segment rounds it up


HF_CASES = [
    (attention, checkpointing, mp)
    for mp in ("fp32", "bf16")
    for attention in ("sdpa", "eager")
    for checkpointing in ("none", "full", "selective")
]


def hf_llama_excess(
    attention: str, checkpointing: str, mixed_precision: str, tp: int = 1, sp: bool = False
) -> int:
    """Bytes a Hugging Face Llama prepared with ``transform`` keeps beyond ``estimate_memory``'s activations
    (``loss="gathered"``), by the rule the README states: its RMSNorms' extra ``4 T_r h`` each (every one
    with no checkpointing, else the final one alone; ``T_r`` the tokens a norm sees, ``T / tp`` with
    sequence parallelism), RoPE's ``[1, s, d]`` cos and sin, under checkpointing the position ids (and
    under eager attention the additive mask) the blocks are called with (with sequence parallelism the
    first block keeps its sequence block, as the others do), eager's attention without the boolean mask
    (and in 16 bits with its fp32 softmax over this rank's ``a / tp`` heads), the loss's total weight and at
    b = 1 the padded labels' extra element."""
    spec = from_hf_config({"model_type": "llama", **jobs.HF_LLAMA})
    B = 4 if mixed_precision == "fp32" else 2
    b, s, h, L, a, d = (
        jobs.MICRO_BATCH,
        jobs.SEQ,
        spec.hidden_size,
        spec.num_layers,
        spec.num_heads,
        spec.head_dim,
    )
    T = b * s
    Tr = T // tp if sp else T
    norms = 2 * L + 1 if checkpointing == "none" else 1
    excess = norms * 4 * Tr * h + 2 * s * d * B + 4 + (8 if b == 1 else 0)
    if checkpointing != "none":
        excess += 8 * s + (b * s * s * B if attention == "eager" else 0)
    elif attention == "eager":
        excess += -L * s * s + (4 * L * b * (a // tp) * s * s if B == 2 else 0)
    return excess


@pytest.mark.parametrize(("attention", "checkpointing", "mp"), HF_CASES, ids=["-".join(c) for c in HF_CASES])
def test_hugging_face_llama_keeps_the_stated_excess(attention: str, checkpointing: str, mp: str) -> None:
    """A transformed Hugging Face Llama keeps exactly the estimate plus :func:`hf_llama_excess` (FSDP2's
    unsharded parameters, which a 1-rank shard group computes on, are the plan's transients, not counted),
    which is what ``estimate_memory(..., implementation="hf")`` plans for it."""
    with one_rank_group():
        measured = jobs.run_hf_activations(attention, checkpointing, mp)
    config = {"activation_checkpointing": checkpointing, "mixed_precision": mp}
    est = estimate_memory(
        from_hf_config({"model_type": "llama", **jobs.HF_LLAMA}), config, seq_len=jobs.SEQ,
        micro_batch=jobs.MICRO_BATCH, world_size=1, loss="gathered",
        attention="flash" if attention == "sdpa" else "materialized",
    )  # fmt: skip
    if checkpointing == "none":
        assert measured["live"] == measured["hooks"], measured
    got = measured["hooks"] if checkpointing == "none" else measured["live"]
    predicted = est.activation_bytes + hf_llama_excess(attention, checkpointing, mp)
    assert got == predicted, (
        f"measured {got} B, estimate + stated excess {predicted} B ({got / predicted:.4f})"
    )
    hf = estimate_memory(
        from_hf_config({"model_type": "llama", **jobs.HF_LLAMA}), config, seq_len=jobs.SEQ,
        micro_batch=jobs.MICRO_BATCH, world_size=1, implementation="hf",
        attention="flash" if attention == "sdpa" else "materialized",
    )  # fmt: skip
    assert hf.activation_bytes == got, f"measured {got} B, implementation='hf' plans {hf.activation_bytes} B"


@pytest.mark.parametrize(
    "case", jobs.HF_TP2, ids=["-".join(map(str, c)).replace("True", "sp") for c in jobs.HF_TP2]
)
def test_hugging_face_llama_keeps_the_stated_excess_at_tp2(world2, case: tuple) -> None:
    """The same at tensor-parallel degree 2 on 2 ranks (``planner_jobs.HF_TP2``), with and without sequence
    parallelism: every rank keeps exactly the estimate plus :func:`hf_llama_excess` at tp 2, what
    ``implementation="hf"`` plans."""
    attention, checkpointing, mp, sp = case
    config = {"activation_checkpointing": checkpointing, "mixed_precision": mp, "tensor_parallel_degree": 2}
    est = estimate_memory(
        from_hf_config({"model_type": "llama", **jobs.HF_LLAMA}), config, seq_len=jobs.SEQ,
        micro_batch=jobs.MICRO_BATCH, world_size=2, loss="gathered", sequence_parallel=sp,
        attention="flash" if attention == "sdpa" else "materialized",
    )  # fmt: skip
    predicted = est.activation_bytes + hf_llama_excess(attention, checkpointing, mp, tp=2, sp=sp)
    hf = estimate_memory(
        from_hf_config({"model_type": "llama", **jobs.HF_LLAMA}), config, seq_len=jobs.SEQ,
        micro_batch=jobs.MICRO_BATCH, world_size=2, sequence_parallel=sp, implementation="hf",
        attention="flash" if attention == "sdpa" else "materialized",
    )  # fmt: skip
    assert hf.activation_bytes == predicted, (hf.activation_bytes, predicted)  # the measured rule, planned
    for rank, results in enumerate(world2):
        measured = results["hf_tp2"][case]
        if checkpointing == "none":
            assert measured["live"] == measured["hooks"], (rank, measured)
        got = measured["hooks"] if checkpointing == "none" else measured["live"]
        assert got == predicted, (
            f"rank {rank}: measured {got} B, estimate + stated excess {predicted} B ({got / predicted:.4f})"
        )


def test_symmetric_heaps_are_what_a_step_allocates() -> None:
    """The heap term against the segments a training step allocates on 2 ranks (TP 2 with sequence
    parallelism, FSDP2 over 2, EP 2: ``planner_jobs.HEAP_CASES``) under TRITON_INTERPRET=1, where smptk's
    collectives take the heap's CPU backend; every rank holds the same."""
    env = {"SMPTK_KERNELS": "torch", "TRITON_INTERPRET": "1", "SMPTK_COMM_HEAP_BYTES": str(HEAP_BYTES)}
    result = run_ranks("planner_jobs:heaps", world=2, timeout_s=300, env=env)
    result.raise_for_failure()
    for name, (spec, config, attention, sp, _) in jobs.HEAP_CASES.items():
        est = estimate_memory(
            jobs.SPECS[spec], config, seq_len=jobs.SEQ, micro_batch=jobs.MICRO_BATCH, world_size=2,
            attention=attention, sequence_parallel=sp, heap_bytes=HEAP_BYTES,
        )  # fmt: skip
        predicted = est.bytes_of("comm")
        for rank, measured in enumerate(result.values):
            got = measured[name]
            assert got["bytes"] == predicted, f"{name} rank {rank}: {got} against the plan's {predicted} B"
