"""smptk.parallel.planner: clusters, estimate_memory's terms, advise's rules, step_time and ``smptk plan``.

The estimate's terms are restated here from the module docstring's formulas (an independent computation,
so a code change that drifts from the documented model fails) and checked for how each config key moves
them: sharding divides model states, TP divides only what smptk splits, EP divides experts, checkpointing
and offloading shrink activations as documented. tests/test_planner_validation.py checks the same terms
against real tensors and what autograd keeps; tests/test_planner_models.py the parameter counts.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from smptk.cli import main
from smptk.kernels.heap_layout import DATA_OFFSET
from smptk.parallel.expert_parallel import expert_shard_dim
from smptk.parallel.planner import (
    CLUSTERS,
    ModelSpec,
    advise,
    cluster,
    estimate_memory,
    model_spec,
    step_time,
)
from smptk.parallel.planner.estimate import local_numel

# The package's names shadow its modules (``planner.advise`` is the function): take the modules themselves.
advise_mod, clusters_mod, estimate_mod, models_mod = (
    importlib.import_module(f"smptk.parallel.planner.{m}")
    for m in ("advise", "clusters", "estimate", "models")
)

TINY = ModelSpec(
    "tiny", vocab_size=256, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=8,
    intermediate_size=128,
)  # fmt: skip
TINY_MOE = ModelSpec(
    "tiny-moe", vocab_size=256, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=8,
    intermediate_size=128, num_experts=8, experts_per_token=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, dense_layers=(0,),
)  # fmt: skip


@pytest.mark.parametrize(
    "module",
    [
        models_mod,
        clusters_mod,
        estimate_mod,
        advise_mod,
        importlib.import_module("smptk.testing.transformer"),
    ],
    ids=lambda m: m.__name__,
)
def test_docstring_examples_run(module) -> None:
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# -- clusters ------------------------------------------------------------------------------------------


def test_cluster_presets_and_aliases() -> None:
    assert set(CLUSTERS) >= {"p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5en.48xlarge", "dgx-h100"}
    assert cluster("p5", nodes=4).world_size == 32 and cluster("P5EN").gpu.name.startswith("H200")
    p4d, p4de = cluster("p4d.24xlarge"), cluster("p4de.24xlarge")
    assert p4d.gpu.memory_bytes * 2 == p4de.gpu.memory_bytes and p4d.inter_node_gbps == 400
    assert cluster("gb200-nvl72").gpus_per_node == 72
    # 3200 Gbps over 8 GPUs: 50 GB/s of network per GPU.
    assert cluster("p5.48xlarge").inter_node_bytes_per_gpu == pytest.approx(50e9)


def test_custom_cluster_and_errors() -> None:
    c = cluster(
        {"gpu": "x", "memory_gb": 24, "bf16_tflops": 100, "gpus_per_node": 4, "intra_node_gbps": 50,
         "inter_node_gbps": 100, "nodes": 3},
    )  # fmt: skip
    assert c.world_size == 12 and c.gpu.memory_bytes == 24 * 2**30
    with pytest.raises(ValueError, match=r"p4d\.24xlarge"):
        cluster("p9.huge")
    with pytest.raises(ValueError, match=r"missing keys \['bf16_tflops'\]"):
        cluster({"gpu": "x", "memory_gb": 1, "gpus_per_node": 1, "intra_node_gbps": 1, "inter_node_gbps": 1})
    with pytest.raises(ValueError, match="unknown keys"):
        cluster({**{k: 1 for k in clusters_mod._CUSTOM_KEYS}, "colour": "red"})
    with pytest.raises(ValueError, match="nodes must be an int >= 1"):
        cluster("p5", nodes=0)
    with pytest.raises(TypeError):
        cluster(3)


CUSTOM = {"gpu": "x", "memory_gb": 80, "bf16_tflops": 100, "gpus_per_node": 8, "intra_node_gbps": 100,
          "inter_node_gbps": 100}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "match"),
    [
        # accepted before: a negative latency ("dp comm -29967 overlapped"), 7.9 GPUs read as 7
        ({"inter_latency_us": -1e9}, "inter_latency_us must be a finite number >= 0, got -1000000000.0"),
        ({"intra_latency_us": float("nan")}, "intra_latency_us must be a finite number >= 0, got nan"),
        ({"gpus_per_node": 7.9}, "gpus_per_node must be an int >= 1, got 7.9"),
        ({"nodes": 1.9}, "nodes must be an int >= 1, got 1.9"),
        ({"gpus_per_node": True}, "gpus_per_node must be an int >= 1, got True"),
        ({"sms": -1}, "sms must be an int >= 0, got -1"),
        ({"bf16_tflops": 1e400}, "bf16_tflops must be a finite number > 0, got inf"),  # MFU nan%
        ({"memory_gb": float("inf")}, "memory_gb must be a finite number > 0, got inf"),  # OverflowError
        ({"memory_gb": float("nan")}, "memory_gb must be a finite number > 0, got nan"),  # int(nan)
        ({"memory_gb": 10**400}, "memory_gb must be a finite number > 0, got 1000"),  # past a double
        ({"memory_gb": 0}, "memory_gb must be a finite number > 0, got 0"),
        ({"intra_node_gbps": "fast"}, "intra_node_gbps must be a finite number > 0, got 'fast'"),
        ({"inter_node_gbps": -5}, "inter_node_gbps must be a finite number > 0, got -5"),
        ({"hbm_gbps": float("inf")}, "hbm_gbps must be a finite number >= 0, got inf"),
    ],
)
def test_custom_cluster_refuses_each_bad_value_by_key(change, match) -> None:
    with pytest.raises(ValueError, match="^cluster 'custom x': " + re.escape(match)):
        cluster({**CUSTOM, **change})


def test_custom_cluster_units_and_zero_defaults() -> None:
    """memory_gb is GiB; hbm_gbps / sms 0 mean unknown, a 0 latency is allowed; the H200 preset's
    "141 GB" is 1e9-byte GB: 131.3 GiB."""
    c = cluster({**CUSTOM, "memory_gb": 131.3, "hbm_gbps": 0, "sms": 0, "intra_latency_us": 0})
    assert c.gpu.memory_bytes == int(131.3 * 2**30) and c.intra_latency_us == 0.0
    assert abs(c.gpu.memory_bytes - cluster("p5en").gpu.memory_bytes) < 2**27
    with pytest.raises(ValueError, match="cluster 'x': inter_latency_us must be a finite number >= 0"):
        clusters_mod.Cluster("x", clusters_mod.H100, 8, 450.0, 3200.0, inter_latency_us=-1.0)
    with pytest.raises(ValueError, match="GPU 'g': bf16_tflops must be a finite number > 0, got nan"):
        clusters_mod.GPU("g", 2**30, float("nan"))


def test_plan_custom_cluster_errors_are_one_line(capsys, tmp_path) -> None:
    """JSON's 1e400 is inf: it ended in an OverflowError traceback."""
    path = tmp_path / "inf.json"
    path.write_text(json.dumps(CUSTOM).replace('"memory_gb": 80', '"memory_gb": 1e400'))
    assert main(["plan", "--model", "llama2-7b", "--instance", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == "smptk plan: error: cluster 'custom x': memory_gb must be a finite number > 0, got inf\n"


# -- estimate_memory: model states ---------------------------------------------------------------------


def test_model_states_are_16_bytes_per_sharded_parameter() -> None:
    """FSDP2 mixed precision keeps fp32 parameters, fp32 gradients and two fp32 Adam moments per shard."""
    n = TINY.num_parameters()
    for world in (1, 2, 4):
        est = estimate_memory(TINY, {}, seq_len=16, world_size=world)
        assert est.parameter_bytes == est.gradient_bytes == 4 * n // world
        assert est.optimizer_bytes == 8 * n // world
    sgd = estimate_memory(TINY, {}, seq_len=16, world_size=1, optimizer="sgd")
    assert sgd.optimizer_bytes == 0


def test_ddp_replication_counts_twenty_bytes_per_parameter() -> None:
    """hybrid_shard_degree 1, fp32, no TP runs DDP: fp32 param 4 + grad 4 + Adam 8 + bucket copy 4."""
    est = estimate_memory(
        TINY, {"hybrid_shard_degree": 1, "mixed_precision": "fp32"}, seq_len=16, world_size=4
    )
    assert est.engine == "ddp"
    model_states = est.parameter_bytes + est.gradient_bytes + est.optimizer_bytes
    assert model_states == 20 * TINY.num_parameters()
    assert not [t for t in est.terms if t.name.startswith("FSDP2")]


def test_fsdp2_on_a_one_rank_shard_group_computes_on_copies() -> None:
    """FSDP2 copies a 1-rank shard group's parameters into unsharded ones instead of gathering them, and its
    gradients into a reduce-scatter input (torch 2.13's FSDPParamGroup.wait_for_unshard and foreach_reduce),
    in fp32 too: the plan left both out wherever nothing was sharded or cast (tensor parallelism alone,
    replication on FSDP2), though transform applies FSDP2 there (tests/test_planner_validation.py sees the LM
    head's forward read a copy)."""
    for config, world in (
        ({"tensor_parallel_degree": 2}, 2),
        ({"tensor_parallel_degree": 2, "hybrid_shard_degree": 1}, 4),
    ):
        est = estimate_memory(TINY, {**config, "mixed_precision": "fp32"}, seq_len=16, world_size=world)
        assert est.engine == "fsdp2 (unsharded)"
        names = [t.name for t in est.terms if t.kind == "transient"]
        assert "FSDP2 gathered parameters" in names and "FSDP2 unsharded gradients" in names, names


def test_delayed_initialization_replicates_on_fsdp2_not_ddp() -> None:
    """A model built on the meta device (delayed_parameter_initialization's flow) cannot go to DDP, so
    apply_data_parallel replicates it on FSDP2: no bucket copy of the gradients (16 bytes per parameter,
    not 20) and no heap over dp. tests/test_planner_validation.py measures the flow on 2 ranks."""
    config = {"hybrid_shard_degree": 1, "mixed_precision": "fp32", "delayed_parameter_initialization": True}
    est = estimate_memory(TINY, config, seq_len=16, cluster="p5")
    assert est.engine == "fsdp2 (unsharded)"
    assert est.parameter_bytes + est.gradient_bytes + est.optimizer_bytes == 16 * TINY.num_parameters()
    assert not [t for t in est.terms if t.kind == "comm" or t.name == "DDP gradient buckets"]


def test_fsdp_pads_dim0_to_the_shard_count() -> None:
    """A [5] norm weight on 4 ranks: FSDP2's rank 0 holds ceil(5 / 4) = 2 rows."""
    spec = ModelSpec(
        "odd", vocab_size=7, hidden_size=5, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=5,
        intermediate_size=3,
    )  # fmt: skip
    sizes = {"tp": 1, "ep": 1, "dp_shard": 4, "edp_shard": 4}
    expected = sum(t.count * -(-t.shape[0] // 4) * (t.numel // t.count // t.shape[0]) for t in spec.tensors())
    assert local_numel(spec, sizes) == expected > spec.num_parameters() // 4


def test_tensor_parallelism_divides_only_what_smptk_splits() -> None:
    one = local_numel(TINY, {"tp": 1, "ep": 1, "dp_shard": 1, "edp_shard": 1})
    two = local_numel(TINY, {"tp": 2, "ep": 1, "dp_shard": 1, "edp_shard": 1})
    replicated = sum(t.numel for t in TINY.tensors() if t.split == "replicated")
    assert replicated == 2 * 4 * 64 + 64  # two norms per layer + the final norm
    assert two == (one - replicated) // 2 + replicated


def test_expert_parallelism_divides_the_experts() -> None:
    experts = sum(t.numel for t in TINY_MOE.tensors() if t.split == "experts")
    assert experts == 3 * 8 * 32 * 64 * 3  # 3 MoE layers x (gate, up, down) x [8, 32, 64]
    base = {"tp": 1, "dp_shard": 4}
    ep1 = local_numel(TINY_MOE, {**base, "ep": 1, "edp_shard": 4})
    ep4 = local_numel(TINY_MOE, {**base, "ep": 4, "edp_shard": 1})
    assert ep1 - ep4 == 0  # experts / 4 either way: over edp_shard (FSDP) or over ep
    ep2_hsdp = local_numel(TINY_MOE, {"tp": 1, "dp_shard": 2, "ep": 2, "edp_shard": 1})
    dense_hsdp = local_numel(TINY_MOE, {"tp": 1, "dp_shard": 2, "ep": 1, "edp_shard": 2})
    assert ep2_hsdp == dense_hsdp


def test_fewer_experts_per_rank_than_shard_ranks_split_on_dim_1() -> None:
    """8 experts on 16 ranks: whatever the ep / edp_shard split, rank 0 holds 1/16 of the experts (smptk
    shards them on dim 1 when its experts do not divide by edp_shard), not a whole padded expert."""
    experts = sum(t.numel for t in TINY_MOE.tensors() if t.split == "experts")
    dense = local_numel(TINY_MOE, {"tp": 1, "dp_shard": 16, "ep": 8, "edp_shard": 2}) - experts // 16
    for ep in (1, 2, 4, 8):
        sizes = {"tp": 1, "dp_shard": 16, "ep": ep, "edp_shard": 16 // ep}
        assert local_numel(TINY_MOE, sizes) == dense + experts // 16, sizes
    # an odd dim 1 cannot split evenly (FSDP2 shards other dims only evenly): dim 0, padded
    assert expert_shard_dim((1, 33, 64), 2) == 0
    assert expert_shard_dim((1, 32, 64), 2) == 1
    assert expert_shard_dim((6, 32, 64), 4) == 1  # 6 experts over 4 pads dim 0; 32 splits evenly
    assert expert_shard_dim((8, 32, 64), 4) == 0


def test_hsdp_shards_within_the_group_only() -> None:
    hsdp = estimate_memory(TINY, {"hybrid_shard_degree": 2}, seq_len=16, world_size=8)
    full2 = estimate_memory(TINY, {}, seq_len=16, world_size=2)
    assert hsdp.engine == "fsdp2 hybrid_shard" and hsdp.sizes["dp_replicate"] == 4
    assert hsdp.parameter_bytes == full2.parameter_bytes


# -- estimate_memory: activations ----------------------------------------------------------------------


def _documented_block(spec: ModelSpec, b: int, s: int, B: int, t: int = 1, sp: bool = False) -> int:
    """One dense block with no checkpointing, restated from estimate.py's docstring (flash attention)."""
    T = b * s
    Tr = T // t if sp else T
    h, d, a, g, f = (
        spec.hidden_size,
        spec.head_dim,
        spec.num_heads // t,
        spec.num_kv_heads // t,
        spec.intermediate_size // t,
    )
    norms = 2 * (Tr * h * B + 4 * Tr)
    inputs = 2 * Tr * h * B  # q / k / v's and gate / up's (under SP the sequence block: saved_as_shard)
    attention = T * d * (2 * a + 2 * g) * B + 4 * T * a  # the output is o_proj's input (a view)
    mlp = 4 * T * f * B
    return norms + inputs + attention + mlp


def _outside(spec: ModelSpec, b: int, s: int, B: int, t: int = 1, sp: bool = False) -> int:
    T = b * s
    Tr = T // t if sp else T
    ids = 16 * T + (3 * T if t > 1 else 0)  # ids and targets (int64), vocab-parallel bool masks (T + 2T)
    return ids + 2 * Tr * spec.hidden_size * B + 4 * Tr + 4 * T * spec.vocab_size // t  # norm, head inputs


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_activation_terms_follow_the_documented_formula(tp, sp, precision) -> None:
    B = 2 if precision == "bf16" else 4
    cfg = {"tensor_parallel_degree": tp, "mixed_precision": precision}
    est = estimate_memory(TINY, cfg, seq_len=32, micro_batch=3, world_size=tp, sequence_parallel=sp)
    want = TINY.num_layers * _documented_block(TINY, 3, 32, B, tp, sp) + _outside(TINY, 3, 32, B, tp, sp)
    assert est.activation_bytes == want


def test_gathered_logits_count_the_whole_vocabulary_on_every_rank() -> None:
    """transform's lm_head gathers its logits (Hugging Face's loss reads [T, V]): loss="gathered" counts
    the fp32 softmax and the logits at V, not V/tp; at tp 1 the two are the same."""
    kw = {"seq_len": 32, "micro_batch": 3, "world_size": 2, "sequence_parallel": True}
    cfg = {"tensor_parallel_degree": 2, "mixed_precision": "bf16"}
    split = estimate_memory(TINY, cfg, **kw)
    whole = estimate_memory(TINY, cfg, **kw, loss="gathered")
    T, V = 3 * 32, TINY.vocab_size
    # [T, V] fp32 softmax, without the vocab-parallel loss's two bool masks (the embedding keeps its one)
    assert whole.activation_bytes - split.activation_bytes == 4 * T * (V - V // 2) - 2 * T
    terms = [{x.name: x for x in e.terms}["logits and their gradient"] for e in (split, whole)]
    assert (
        terms[1].bytes - terms[0].bytes == T * (V - V // 2) * (2 + 4)
        and "[T, V] (gathered)" in terms[1].detail
    )
    one = {"seq_len": 32, "world_size": 1}
    assert (
        estimate_memory(TINY, {}, **one).total_bytes
        == estimate_memory(TINY, {}, **one, loss="gathered").total_bytes
    )


def test_tensor_parallelism_is_refused_where_smptk_refuses_it() -> None:
    """A vocabulary tp does not divide (VocabParallelEmbedding pads nothing) is refused, and advise does not
    offer such a tp. Tied embeddings at tp > 1 are estimated (transform keeps the tied table one
    vocab-parallel parameter: one [V / tp, H] shard fewer than the untied model's) and offered."""
    odd = dataclasses.replace(TINY, vocab_size=TINY.vocab_size + 1)
    with pytest.raises(
        ValueError, match=rf"vocab_size {odd.vocab_size} is not divisible by tensor_parallel_degree 2"
    ):
        estimate_memory(odd, {"tensor_parallel_degree": 2}, seq_len=32, world_size=2)
    tied = dataclasses.replace(TINY, tie_word_embeddings=True)
    tp2 = {"tensor_parallel_degree": 2, "mixed_precision": "fp32"}
    untied_bytes = estimate_memory(TINY, tp2, seq_len=32, world_size=2).parameter_bytes
    tied_bytes = estimate_memory(tied, tp2, seq_len=32, world_size=2).parameter_bytes
    assert untied_bytes - tied_bytes == TINY.vocab_size // 2 * TINY.hidden_size * 4
    llama = model_spec("llama3.1-8b")  # at 16384 tokens on one p5 node, advise offers tp > 1 too
    for spec in (llama, dataclasses.replace(llama, tie_word_embeddings=True)):
        candidates = advise(spec, "p5.48xlarge", seq_len=16384).candidates
        assert any(c.config.tensor_parallel_degree > 1 for c in candidates)
    adv = advise(dataclasses.replace(llama, vocab_size=128257), "p5.48xlarge", seq_len=16384)
    assert adv.candidates and {c.config.tensor_parallel_degree for c in adv.candidates} == {1}


def test_materialized_attention_adds_the_probabilities() -> None:
    flash = estimate_memory(TINY, {}, seq_len=64, micro_batch=2, world_size=1)
    mat = estimate_memory(TINY, {}, seq_len=64, micro_batch=2, world_size=1, attention="materialized")
    a, d, T, B = 8, 8, 128, 2
    # materialized: q, k and v at the query heads and b a s^2 probabilities; flash: k, v at kv heads + lse.
    per_block = (4 * T * a * d * B + 2 * a * 64 * 64 * B + 64 * 64) - (
        T * d * (a + 2 * 4) * B + T * a * d * B + 4 * T * a
    )
    assert mat.activation_bytes - flash.activation_bytes == TINY.num_layers * per_block


def test_checkpointing_keeps_block_inputs_and_offloading_moves_them() -> None:
    T, h, B = 64, 64, 2
    none = estimate_memory(TINY, {}, seq_len=64, world_size=1)
    full = estimate_memory(TINY, {"activation_checkpointing": "full"}, seq_len=64, world_size=1)
    sel = estimate_memory(TINY, {"activation_checkpointing": "selective"}, seq_len=64, world_size=1)
    outside = _outside(TINY, 1, 64, B)
    assert full.activation_bytes == TINY.num_layers * T * h * B + outside
    assert full.activation_bytes < sel.activation_bytes < none.activation_bytes
    recompute = [t.bytes for t in full.terms if t.name == "recomputed block"]
    assert recompute == [_documented_block(TINY, 1, 64, B)]
    cfg = {
        "activation_checkpointing": "full",
        "sm_activation_offloading": True,
        "activation_loading_horizon": 3,
    }
    off = estimate_memory(TINY, cfg, seq_len=64, world_size=1)
    assert off.host_bytes == TINY.num_layers * T * h * B
    assert off.activation_bytes == 3 * T * h * B + outside


def test_moe_terms_and_dispatch_buffers() -> None:
    est = estimate_memory(TINY_MOE, {"expert_parallel_degree": 2}, seq_len=32, world_size=2)
    names = [t.name for t in est.terms]
    assert "activations: 1 dense blocks" in names and "activations: 3 MoE blocks" in names
    (dispatch,) = [t.bytes for t in est.terms if t.name == "MoE dispatch buffers"]
    assert dispatch == 2 * 32 * 2 * 64 * 2


def test_an_all_moe_model_ignores_its_unused_dense_width() -> None:
    """A model whose blocks are all MoE has no dense MLP: its intermediate_size (Qwen3-MoE configs carry
    one) was still required to divide tp (6001 refused tp 2) and sized the recomputed block."""
    shape = dict(vocab_size=256, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=8,
                 num_experts=8, experts_per_token=2, moe_intermediate_size=32)  # fmt: skip
    odd = ModelSpec("odd", intermediate_size=6001, **shape)
    small = ModelSpec("small", intermediate_size=4, **shape)
    assert odd.num_moe_layers == odd.num_layers
    assert not [t for t in odd.tensors() if t.name.startswith("mlp.")]
    assert estimate_mod.tp_problem(odd, 2) is None
    for config in ({"tensor_parallel_degree": 2}, {"activation_checkpointing": "full"}):
        a, b = (estimate_memory(m, config, seq_len=32, world_size=2) for m in (odd, small))
        assert [(t.name, t.bytes) for t in a.terms] == [(t.name, t.bytes) for t in b.terms]
    # with a dense block the width is used, and checked
    dense_first = dataclasses.replace(odd, dense_layers=(0,))
    assert "intermediate_size 6001 is not divisible" in estimate_mod.tp_problem(dense_first, 2)


def test_heaps_count_the_groups_inside_a_node() -> None:
    p5 = cluster("p5", nodes=2)
    one_group = estimate_memory("llama2-7b", {"tensor_parallel_degree": 8}, seq_len=4096, cluster=p5)
    (heap,) = [t for t in one_group.terms if t.kind == "comm"]
    assert "tp" in heap.detail and heap.bytes == 64 * 2**20 + DATA_OFFSET
    # dp_shard spans both nodes: its collectives fall back to torch.distributed, no heap.
    assert not [
        t for t in estimate_memory("llama2-7b", {}, seq_len=4096, cluster=p5).terms if t.kind == "comm"
    ]
    # DDP (replicated, fp32): smptk's all-reduce hook holds one heap over the dp group inside a node.
    ddp = {"hybrid_shard_degree": 1, "mixed_precision": "fp32"}
    est = estimate_memory("llama2-7b", ddp, seq_len=1024, cluster="p5")
    (heap,) = [t for t in est.terms if t.kind == "comm"]
    assert est.engine == "ddp" and "(dp)" in heap.detail and heap.bytes == 64 * 2**20 + DATA_OFFSET
    assert not [
        t for t in estimate_memory("llama2-7b", ddp, seq_len=1024, cluster=p5).terms if t.kind == "comm"
    ]


def test_one_heap_where_dp_shard_and_ep_are_the_world_group() -> None:
    """A mesh dim over every rank is torch's default group, and a heap belongs to a group: Mixtral at
    expert_parallel_degree 8 fully sharded over one p5 holds one heap (tests/test_planner_validation.py
    counts what a step allocates), where the plan counted two (dp_shard and ep). With dp_replicate 2 the
    two dims are groups of their own, over the same ranks, and hold two."""
    seg = 64 * 2**20 + DATA_OFFSET
    heap_of = lambda est: [(t.bytes, t.detail) for t in est.terms if t.kind == "comm"]
    ep8 = estimate_memory("mixtral-8x7b", {"expert_parallel_degree": 8}, seq_len=4096, cluster="p5")
    assert heap_of(ep8) == [(seg, "1 group(s) inside a node (dp_shard = ep), 64 MiB + control each")]
    hsdp = {"expert_parallel_degree": 4, "hybrid_shard_degree": 4}
    est = estimate_memory("mixtral-8x7b", hsdp, seq_len=4096, cluster="p5")
    assert heap_of(est) == [(2 * seg, "2 group(s) inside a node (dp_shard, ep), 64 MiB + control each")]


def test_heap_segments_are_whole_pages() -> None:
    """A rank allocates the heap's segment in whole 4 KiB pages (smptk.comm.heap): a 4112-byte data region
    takes 8192 bytes after the control words, where the plan counted 4112."""
    one_group = {"tensor_parallel_degree": 8}
    est = estimate_memory("llama2-7b", one_group, seq_len=4096, cluster="p5", heap_bytes=4112)
    assert [t.bytes for t in est.terms if t.kind == "comm"] == [DATA_OFFSET + 8192]


def test_heap_bytes_default_is_what_smptk_comm_uses(capsys) -> None:
    """The heap term took a fixed 64 MiB whatever SMPTK_COMM_HEAP_BYTES or comm.configure set, and
    accepted sizes smptk.comm refuses (16 bytes); ``smptk plan`` had no way to give it."""
    from smptk import comm

    before = comm.settings()["heap_bytes"]
    one_group = {"tensor_parallel_degree": 8}
    heap_of = lambda est: [t.bytes for t in est.terms if t.kind == "comm"]
    try:
        comm.configure(heap_bytes=1 << 20)
        est = estimate_memory("llama2-7b", one_group, seq_len=4096, cluster="p5")
        assert heap_of(est) == [2**20 + DATA_OFFSET]
        adv = advise("llama2-7b", "p5", seq_len=4096)
        heaps = {b for c in adv.candidates for b in heap_of(c.estimate)}  # one or two groups' heaps
        assert heaps and all(b % (2**20 + DATA_OFFSET) == 0 for b in heaps), heaps
    finally:
        comm.configure(heap_bytes=before)
    est = estimate_memory("llama2-7b", one_group, seq_len=4096, cluster="p5", heap_bytes=4096)
    assert heap_of(est) == [4096 + DATA_OFFSET]
    with pytest.raises(ValueError, match="heap_bytes: expected a multiple of 16 of at least 4096, got 16"):
        advise("llama2-7b", "p5", seq_len=4096, heap_bytes=16)  # refused, not every candidate skipped
    assert main(["plan", "--model", "llama2-7b", "--instance", "p5", "--config", json.dumps(one_group),
                 "--heap-bytes", str(2**27), "--json"]) == 0  # fmt: skip
    terms = json.loads(capsys.readouterr().out)["terms"]
    assert [t["bytes"] for t in terms if t["kind"] == "comm"] == [2**27 + DATA_OFFSET]


def test_estimate_reports_a_table_json_and_fit() -> None:
    est = estimate_memory("llama2-7b", {}, seq_len=4096, cluster="p4d.24xlarge")
    text = est.table()
    assert "total" in text and "parameters (fp32 master)" in text and "of 40.0 GiB per GPU" in text
    doc = json.loads(est.to_json())
    assert doc["total_bytes"] == est.total_bytes == sum(t["bytes"] for t in doc["terms"])
    assert est.fits() == (est.total_bytes <= 40 * 2**30 - 2**29)
    margin = est.bytes_of("margin")
    assert margin == int(0.05 * (est.total_bytes - margin))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"config": {"tensor_parallel_degree": 3}, "world_size": 8},
            ValueError,
            "does not divide world size 8",
        ),
        (
            {"config": {"tensor_parallel_degree": 16}, "world_size": 16},
            ValueError,
            "num_kv_heads 8 is not divisible",
        ),
        ({"config": {"expert_parallel_degree": 2}, "world_size": 2}, ValueError, "dense model"),
        ({"config": {"tensor_parallel_degree": 2}, "world_size": 2, "seq_len": 33}, ValueError, "seq_len 33"),
        ({"optimizer": "lion"}, ValueError, "optimizer: expected one of"),
        ({"attention": "sparse"}, ValueError, "attention: expected one of"),
        ({"micro_batch": 0}, ValueError, "micro_batch"),
        ({"world_size": None}, ValueError, "pass cluster= or world_size="),
        ({"cluster": "p5", "world_size": 4}, ValueError, "disagrees"),
        ({"config": {"tensor_parallel": 2}}, ValueError, "did you mean 'tensor_parallel_degree'"),
        ({"sequence_parallel": "no"}, TypeError, "sequence_parallel: expected True, False or None"),
        ({"heap_bytes": -1}, ValueError, "heap_bytes: expected a multiple of 16 of at least 4096, got -1"),
        ({"heap_bytes": 100}, ValueError, "heap_bytes: expected a multiple of 16 of at least 4096, got 100"),
        ({"heap_bytes": 16}, ValueError, "heap_bytes: expected a multiple of 16 of at least 4096, got 16"),
        ({"heap_bytes": 4104}, ValueError, "heap_bytes: expected a multiple of 16 of at least 4096, got 41"),
        ({"heap_bytes": "64M"}, ValueError, "heap_bytes: expected an integer, got '64M'"),
        ({"loss": "chunked"}, ValueError, "loss: expected one of vocab_parallel, gathered"),
    ],
)
def test_estimate_rejects_bad_input(kwargs, error, match) -> None:
    args = {"config": {}, "seq_len": 32, "world_size": 1, **kwargs}
    with pytest.raises(error, match=match):
        estimate_memory("llama2-70b", args.pop("config"), **args)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"intermediate_size": -96}, "intermediate_size must be an int >= 0"),
        ({"intermediate_size": 0}, "intermediate_size must be a positive int"),
        ({"learned_positions": -3}, "learned_positions must be an int >= 0"),
        ({"hidden_size": "64"}, "hidden_size must be a positive int"),
    ],
)
def test_model_spec_rejects_nonsense_sizes(change: dict, match: str) -> None:
    """A negative (or, with dense layers, zero) width used to shrink the parameter count silently."""
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **change)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size must be an int >= 0"):
        dataclasses.replace(TINY_MOE, shared_expert_intermediate_size=-5)


def test_seq_len_past_learned_positions_is_refused() -> None:
    """A learned position table has no row past its length (GPT-2's n_positions); rotary models may run
    past max_position_embeddings (context extension), so that stays allowed."""
    gpt = dataclasses.replace(TINY, learned_positions=64)
    estimate_memory(gpt, {}, seq_len=64, world_size=1)
    with pytest.raises(ValueError, match=r"seq_len 65 exceeds .*64 learned positions"):
        estimate_memory(gpt, {}, seq_len=65, world_size=1)
    with pytest.raises(ValueError, match=r"seq_len 65 exceeds .*64 learned positions"):
        advise(gpt, "p4d", seq_len=65)
    estimate_memory(TINY, {}, seq_len=4 * TINY.max_position_embeddings, world_size=1)


def test_moe_models_are_estimated_without_sequence_parallelism() -> None:
    """smptk runs MoE layers without sequence parallelism (transform refuses it): by default a MoE model's
    activations are those of tp without it (the estimate assumed it, so configs that cannot be built were
    ranked as fitting), asking for it raises; a dense model takes it by default and says so in its title.
    Shared experts stay whole on every tp rank, so their width need not divide tp."""
    odd_shared = dataclasses.replace(TINY_MOE, shared_expert_intermediate_size=33)
    moe = estimate_memory(odd_shared, {"tensor_parallel_degree": 2}, seq_len=32, world_size=2)
    off = estimate_memory(odd_shared, {"tensor_parallel_degree": 2}, seq_len=32, world_size=2,
                          sequence_parallel=False)  # fmt: skip
    assert not moe.sequence_parallel and moe.total_bytes == off.total_bytes
    assert "sequence parallel" not in moe.title()
    with pytest.raises(ValueError, match="MoE layers, which smptk runs without sequence parallelism"):
        estimate_memory(TINY_MOE, {"tensor_parallel_degree": 2}, seq_len=32, world_size=2,
                        sequence_parallel=True)  # fmt: skip
    dense = estimate_memory(TINY, {"tensor_parallel_degree": 2}, seq_len=32, world_size=2)
    assert dense.sequence_parallel and "sequence parallel" in dense.title()


# -- step_time and advise ------------------------------------------------------------------------------


def test_step_time_model() -> None:
    p5 = cluster("p5", nodes=1)  # sharding inside the node: compute-bound
    base = step_time("llama3.1-8b", {}, p5, seq_len=4096)
    assert 0 < base.mfu <= 0.6 and base.step_s >= base.compute_s
    full = step_time("llama3.1-8b", {"activation_checkpointing": "full"}, p5, seq_len=4096)
    assert full.compute_s == pytest.approx(base.compute_s * 4 / 3, rel=0.05)  # one more forward of the blocks
    # The same model FLOPs, and MFU counts no recompute.
    assert full.model_flops == base.model_flops and full.mfu < base.mfu
    two_nodes = cluster("p5", nodes=2)
    full_shard = step_time("llama3.1-8b", {}, two_nodes, seq_len=4096)
    hsdp = step_time("llama3.1-8b", {"hybrid_shard_degree": 8}, two_nodes, seq_len=4096)
    assert hsdp.dp_comm_s < full_shard.dp_comm_s  # sharding inside the node: NVLink instead of the network
    tp = step_time("llama3.1-8b", {"tensor_parallel_degree": 4}, p5, seq_len=4096)
    # A tp group shares one data-parallel rank's micro-batch: each GPU computes a quarter of it.
    assert tp.tp_comm_s > 0 and tp.compute_s == pytest.approx(base.compute_s / 4, rel=1e-9)
    with pytest.raises(ValueError, match="compute_efficiency"):
        step_time("llama3.1-8b", {}, p5, seq_len=4096, compute_efficiency=1.5)
    for key, bad in (("grad_accum", 0), ("grad_accum", -3), ("micro_batch", -2), ("micro_batch", 1.5)):
        with pytest.raises(ValueError, match=f"{key}: expected an int >= 1"):  # were a negative MFU
            step_time("llama3.1-8b", {}, p5, seq_len=4096, **{key: bad})


def test_advise_ranks_configurations_that_fit() -> None:
    adv = advise("llama2-7b", "p4d.24xlarge", nodes=2, seq_len=4096)
    memory = 40 * 2**30 - 2**29
    assert adv.candidates and adv.best.config.tensor_parallel_degree == 1
    per_token = [c.time.step_s / c.global_batch_tokens for c in adv.candidates]
    assert per_token == sorted(per_token)
    for c in adv.candidates:
        assert c.fits and c.estimate.total_bytes <= memory and c.global_batch_tokens <= 4 * 2**20
        assert c.reason
    reasons = " | ".join(c.reason for c in adv.rejected)
    assert (
        "does not fit" in reasons
        and "TP not needed" in reasons
        and "a smaller sharding degree fits" in reasons
    )
    # The smallest sharding that fits: replication (16 B/param on every GPU) cannot hold 7B in 40 GB.
    assert all(c.estimate.sizes["dp_shard"] > 1 for c in adv.candidates)
    assert "fastest predicted" in adv.best.reason and "llama2-7b" in adv.summary()
    assert json.loads(json.dumps(adv.to_dict()))["candidates"][0]["fits"] is True


def test_advise_fills_the_global_batch_with_accumulation() -> None:
    adv = advise("llama2-7b", "p4d.24xlarge", nodes=2, seq_len=4096, global_batch_tokens=2**20)
    for c in adv.candidates:
        assert abs(c.global_batch_tokens - 2**20) <= 0.25 * 2**20
        assert (
            c.global_batch_tokens
            == 16 * c.micro_batch * 4096 * c.grad_accum // c.config.tensor_parallel_degree
        )
    with pytest.raises(ValueError, match="global_batch_tokens"):
        advise("llama2-7b", "p4d", seq_len=4096, global_batch_tokens=10)


def test_advise_allows_tensor_parallelism_for_long_sequences() -> None:
    adv = advise("llama3.1-8b", "p5.48xlarge", nodes=1, seq_len=16384)
    assert any(c.config.tensor_parallel_degree > 1 for c in adv.candidates)
    # The JSON says which candidates assume sequence parallelism (transform's sequence_parallel, not a
    # ParallelConfig key): without it a program had the config but not what the memory was counted for.
    rows = adv.to_dict(top=len(adv.candidates))["candidates"]
    for c, row in zip(adv.candidates, rows, strict=True):
        assert row["sequence_parallel"] is c.estimate.sequence_parallel
        assert row["sequence_parallel"] == (c.config.tensor_parallel_degree > 1) == (" sp " in c.label())


def test_advise_says_what_would_fit_when_nothing_does() -> None:
    adv = advise("llama3.1-405b", "p4d.24xlarge", nodes=1, seq_len=4096)
    assert adv.candidates == () and adv.best is None
    text = " ".join(adv.suggestions)
    assert "nodes" in text and "larger GPU" in text and "needs" in text
    assert re.search(r"a larger GPU: \d+ x \S+ = \d+ GPUs \(.+\) would fit", text), text  # with its GPU count
    assert "nothing fits" in adv.summary()


def test_advise_blames_the_global_batch_not_memory_when_configurations_fit() -> None:
    """On 2000 nodes every configuration that fits in memory exceeds the 4M-token batch: the suggestions
    used to say how much memory the smallest one needs and to ask for more nodes or larger GPUs (which
    make the batch larger); at 256 nodes the tp 8 pick said "needed to fit" though tp 1 fits."""
    adv = advise("llama2-7b", "p5.48xlarge", seq_len=4096, nodes=2000)
    assert adv.candidates == () and any(c.fits for c in adv.rejected)
    text = " ".join(adv.suggestions)
    assert "exceeds the 4M-token global batch" in text and "at most 1024 nodes" in text, text
    assert "larger GPU" not in text and "would fit" not in text and "needs" not in text, text
    assert "no configuration is within bounds" in adv.summary()
    best = advise("llama2-7b", "p5.48xlarge", seq_len=4096, nodes=256).best
    assert best.config.tensor_parallel_degree > 1 and "needed to fit" not in best.reason
    assert "keep the global batch within bounds" in best.reason


def test_advise_offers_tensor_parallelism_to_a_moe_model_at_any_sequence_length() -> None:
    """smptk runs a MoE model's tp without sequence parallelism, so estimate_memory takes any seq_len there;
    advise skipped every tp > 1 when seq_len % tp (sequence parallelism's rule), so a MoE model whose
    logits only fit split over tp found nothing at 4095 tokens and tp 2 at 4096 (1.40 GiB, where tp 1
    needs 2.72), and its "every tp tried" smallest configuration had not tried them."""
    moe = ModelSpec(
        "wide-vocab-moe", vocab_size=65536, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
        head_dim=8, intermediate_size=128, num_experts=4, experts_per_token=2, moe_intermediate_size=32,
    )  # fmt: skip
    two = {"gpu": "g", "memory_gb": 2.5, "bf16_tflops": 100, "gpus_per_node": 2, "intra_node_gbps": 100,
           "inter_node_gbps": 100}  # fmt: skip
    for seq_len in (4096, 4095):
        adv = advise(moe, two, seq_len=seq_len, heap_bytes=4096)
        assert adv.best is not None and adv.best.config.tensor_parallel_degree == 2, seq_len
    searched = {c.config.tensor_parallel_degree for c in advise("qwen3-30b-a3b", "p5", seq_len=4095).rejected}
    assert searched == {1, 2, 4}
    # a dense model runs tp with sequence parallelism, which needs seq_len % tp == 0: tp 1 only
    dense = advise("llama3.1-8b", "p5", seq_len=4095)
    assert {c.config.tensor_parallel_degree for c in (*dense.candidates, *dense.rejected)} == {1}


def test_advise_searches_expert_parallelism_for_moe() -> None:
    adv = advise("qwen3-30b-a3b", "p5.48xlarge", nodes=1, seq_len=4096)
    searched = {c.config.expert_parallel_degree for c in adv.candidates + adv.rejected}
    assert searched == {1, 2, 4, 8} and adv.candidates


# -- smptk plan ----------------------------------------------------------------------------------------


def test_plan_prints_recommendations_and_the_breakdown(capsys) -> None:
    assert main(["plan", "--model", "llama2-70b", "--instance", "p4d.24xlarge", "--nodes", "32",
                 "--seq-len", "4096"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "recommended configurations" in out and "llama2-70b: 68.98B parameters" in out
    assert "parameters (fp32 master)" in out and "total" in out


def test_plan_json_and_config(capsys, tmp_path) -> None:
    assert main(["plan", "--model", "llama3.1-8b", "--instance", "p5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "llama3.1-8b" and doc["candidates"][0]["fits"]
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"tensor_parallel_degree": 2, "activation_checkpointing": "selective"}))
    assert (
        main(
            ["plan", "--model", "llama3.1-8b", "--instance", "p5", "--config", str(cfg), "--micro-batch", "2"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tp 2" in out and "checkpointing selective" in out and "fits in" in out and "predicted step" in out
    assert main(["plan", "--model", "llama3.1-8b", "--instance", "p5", "--config",
                 '{"hybrid_shard_degree": 8}', "--json"]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["sizes"]["dp_shard"] == 8 and doc["fits"] in (True, False) and doc["step"]["step_s"] > 0


def test_cluster_description_prints_the_memory_the_plan_uses() -> None:
    """describe() rounded GiB to whole numbers: the p5's H100 (79.6 GiB, the budget the plan checks) read
    "80 GiB", the p5en's H200 "131 GiB" where the README says memory_gb 131.3 matches that preset."""
    assert "(79.6 GiB, 989 TFLOP/s" in cluster("p5.48xlarge").describe()
    assert "(131.3 GiB," in cluster("p5en.48xlarge").describe()
    assert "(40 GiB, 312 TFLOP/s" in cluster("p4d.24xlarge").describe()  # README's example output
    custom = {"gpu": "g", "memory_gb": 131.3, "bf16_tflops": 989, "gpus_per_node": 8, "intra_node_gbps": 450}
    assert "(131.3 GiB," in cluster({**custom, "inter_node_gbps": 3200}).describe()


NOTHING_FITS = ["--model", "llama3.1-70b", "--instance", "p5"]  # 70.6B x 16 bytes of states on 8 x 80 GB


@pytest.mark.parametrize("as_json", [False, True], ids=["tables", "json"])
def test_plan_exit_status_says_whether_a_configuration_fits(capsys, as_json: bool) -> None:
    """A launcher choosing a layout reads the exit status: ``smptk plan`` returned 0 when nothing fit (Llama
    3.1 70B on one p5 node; a --config of tp 8 there needs 153.6 GiB per GPU) as when something did. Now 0
    when a configuration is recommended or --config's fits, 3 when not, the plan printed either way."""
    flag = ["--json"] if as_json else []
    one = ["--config", '{"tensor_parallel_degree": 8}']
    cases = [
        (NOTHING_FITS, 3),
        ([*NOTHING_FITS, *one], 3),
        (["--model", "llama3.1-70b", "--instance", "p5", "--nodes", "2"], 0),
        (["--model", "llama3.1-8b", "--instance", "p5", *one], 0),
    ]
    for args, status in cases:
        assert main(["plan", *args, *flag]) == status, args
        out = capsys.readouterr().out
        if as_json:
            doc = json.loads(out)
            assert doc["fits"] == (status == 0) if "fits" in doc else bool(doc["candidates"]) == (status == 0)
        else:
            assert ("recommended configurations" in out or "fits in" in out) == (status == 0), out
    # The advice that fits in memory but not within the global-batch rules recommends nothing either
    assert main(["plan", "--model", "llama2-7b", "--instance", "p5", "--nodes", "256", "--seq-len", "8192",
                 "--global-batch-tokens", "8192", *flag]) == 3  # fmt: skip
    assert "miss the asked global batch" in capsys.readouterr().out


def test_plan_exit_status_through_the_console_entry_and_python_m() -> None:
    """The same status from the ``smptk`` console script (pyproject's [project.scripts] target, called as
    the script calls it: ``sys.exit(main())``) and from ``python -m smptk``, --json's object on stdout."""
    root = Path(__file__).resolve().parent.parent
    scripts = (root / "pyproject.toml").read_text().split("[project.scripts]", 1)[1]
    target = re.search(r'^smptk = "([\w.]+:\w+)"', scripts, re.M).group(1)  # no tomllib on Python 3.10
    module, func = target.split(":")
    script = f"import sys; from {module} import {func}; sys.argv[0] = 'smptk'; sys.exit({func}())"
    env = dict(os.environ, PYTHONPATH=str(root))
    for launcher in ([sys.executable, "-c", script], [sys.executable, "-m", "smptk"]):
        proc = subprocess.run(
            [*launcher, "plan", *NOTHING_FITS, "--json"], cwd=root, env=env, capture_output=True, text=True,
            timeout=120, check=False,
        )  # fmt: skip
        assert proc.returncode == 3, (launcher, proc.returncode, proc.stderr)
        assert json.loads(proc.stdout)["candidates"] == [] and proc.stderr == ""


def test_plan_custom_cluster_file(capsys, tmp_path) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"gpu": "mygpu", "memory_gb": 96, "bf16_tflops": 700, "gpus_per_node": 4,
                                "intra_node_gbps": 300, "inter_node_gbps": 800}))  # fmt: skip
    assert main(["plan", "--model", "mistral-7b", "--instance", str(path), "--nodes", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "custom mygpu"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            ["--model", "llama9", "--instance", "p5"],
            "error: --model: unknown model 'llama9'; presets: llama2-7b",
        ),
        (["--model", "llama2-7b", "--instance", "p9"], "unknown instance 'p9'; presets: p4d.24xlarge"),
        (["--model", "llama2-7b", "--instance", "p5", "--config", "{bad"], "--config is not valid JSON"),
        (
            # json.loads keeps the last value; a config file with the same text was already refused
            [
                "--model",
                "llama2-7b",
                "--instance",
                "p5",
                "--config",
                '{"tensor_parallel_degree": 2, "tensor_parallel_degree": 4}',
            ],
            "--config: key 'tensor_parallel_degree' is given more than once",
        ),
        (
            ["--model", "llama2-7b", "--instance", "p5", "--heap-bytes", "100"],
            "error: --heap-bytes: expected a",
        ),
        # the keyword arguments' checks, named as the flags the user typed (they said seq_len, micro_batch...)
        (
            ["--model", "llama2-7b", "--instance", "p5", "--seq-len", "0"],
            "error: --seq-len: expected an int >= 1",
        ),
        (
            ["--model", "llama2-7b", "--instance", "p5", "--global-batch-tokens", "5"],
            "error: --global-batch-tokens: expected an int from seq_len",
        ),
        (
            ["--model", "llama2-7b", "--instance", "p5", "--config", "{}", "--micro-batch", "0"],
            "error: --micro-batch: expected an int >= 1, got 0",
        ),
        (
            ["--model", "llama2-7b", "--instance", "p5", "--config", "{}", "--grad-accum", "-2"],
            "error: --grad-accum: expected an int >= 1, got -2",
        ),
        (
            ["--model", "llama2-7b", "--instance", "p5", "--config", '{"tensor_parallel_degree": 3}'],
            "does not divide",
        ),
    ],
)
def test_plan_errors_name_the_problem(capsys, args, match) -> None:
    assert main(["plan", *args]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--top", "0"], "--top: expected an int >= 1, got 0"),  # printed an empty table, exit 0
        (["--top", "-1"], "--top: expected an int >= 1, got -1"),  # printed all candidates but the last
        (["--micro-batch", "4"], "--micro-batch / --grad-accum apply to --config only"),  # ignored
        (["--grad-accum", "-7"], "--micro-batch / --grad-accum apply to --config only"),
        # the reverse: --config evaluates one configuration, these only shape the advice
        (["--config", "{}", "--top", "7"], "--global-batch-tokens / --top apply to the advice only"),
        (["--config", "{}", "--global-batch-tokens", "8192"], "--global-batch-tokens / --top apply to the"),
    ],
)
def test_plan_refuses_options_it_would_ignore_or_misread(capsys, extra, match) -> None:
    assert main(["plan", "--model", "llama2-7b", "--instance", "p5", *extra]) == 2
    assert match in capsys.readouterr().err


def test_plan_names_the_flag_of_a_cluster_file_that_is_not_an_object_and_of_nodes(capsys, tmp_path) -> None:
    """A cluster file holding a JSON list was refused as "cluster: expected a preset name, a Cluster or a
    dict, got list", one holding a string ("p5") was read as that preset, and --nodes 0 as "cluster
    'p5.48xlarge': nodes must be an int >= 1": none named the flag the user typed."""
    for text, kind in (("[1, 2]", "list"), ('"p5"', "str")):
        path = tmp_path / f"{kind}.json"
        path.write_text(text)
        assert main(["plan", "--model", "llama2-7b", "--instance", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"--instance: {str(path)!r} holds a JSON {kind}, expected an object (a custom cluster" in err
    assert main(["plan", "--model", "llama2-7b", "--instance", "p5", "--nodes", "0"]) == 2
    assert "error: --nodes: expected an int >= 1, got 0" in capsys.readouterr().err


def test_plan_names_a_model_or_cluster_file_that_is_not_json(capsys, tmp_path) -> None:
    """A --model file that is not JSON gave the bare parser message ("Expecting value: line 1 ...")."""
    bad = tmp_path / "config.json"
    bad.write_text("not json")
    assert main(["plan", "--model", str(bad), "--instance", "p5"]) == 2
    assert f"error: --model: {str(bad)!r} is not a JSON Hugging Face config" in capsys.readouterr().err
    assert main(["plan", "--model", "llama2-7b", "--instance", str(bad)]) == 2
    assert f"--instance: {str(bad)!r} is not valid JSON" in capsys.readouterr().err


def test_plan_names_a_file_argument_it_cannot_read(capsys, tmp_path) -> None:
    """A --config or --instance path that is a directory, or a --config / --instance / --model file that
    is not UTF-8, gave the bare "[Errno 21] Is a directory" or "'utf-8' codec can't decode byte",
    naming neither the flag nor the file."""
    folder = tmp_path / "cluster.json"
    folder.mkdir()
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'{"gpu": "\xd0\xff"}')
    cases = [
        (["--instance", "p5", "--config", str(folder)], f"--config: {str(folder)!r} is a directory"),
        (["--instance", str(folder)], f"--instance: {str(folder)!r} is a directory"),
        (["--instance", "p5", "--config", str(binary)], f"--config: {str(binary)!r} is not a UTF-8 JSON"),
        (["--instance", str(binary)], f"--instance: {str(binary)!r} is not a UTF-8 JSON file"),
    ]
    for args, match in cases:
        assert main(["plan", "--model", "llama2-7b", *args]) == 2, args
        assert match in capsys.readouterr().err, args
    assert main(["plan", "--model", str(binary), "--instance", "p5"]) == 2
    assert f"error: --model: {str(binary)!r} is not a JSON Hugging Face config" in capsys.readouterr().err


def test_plan_reads_an_instance_file_as_it_reads_a_model_file(capsys, tmp_path, monkeypatch) -> None:
    """--instance took a file only when it existed and its name ended in .json: cluster.conf holding a
    valid cluster, and a mistyped clusters.json, were both "unknown instance" with the preset list,
    where --model reads any existing file and names a missing path."""
    spec = {"gpu": "mygpu", "memory_gb": 96, "bf16_tflops": 700, "gpus_per_node": 4,
            "intra_node_gbps": 300, "inter_node_gbps": 800}  # fmt: skip
    (tmp_path / "cluster.conf").write_text(json.dumps(spec))
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "mistral-7b", "--instance", "cluster.conf", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == "custom mygpu"
    for missing in ("clusters.json", str(tmp_path / "nowhere" / "p5")):
        assert main(["plan", "--model", "mistral-7b", "--instance", missing]) == 2
        assert (
            f"--instance: {missing!r} does not exist (expected a cluster preset: p4d"
            in capsys.readouterr().err
        )
    assert main(["plan", "--model", "mistral-7b", "--instance", "p5", "--json"]) == 0  # presets still read
    assert json.loads(capsys.readouterr().out)["cluster"] == "p5.48xlarge"


def test_plan_names_the_model_flag_for_a_config_it_cannot_plan(capsys, tmp_path) -> None:
    """from_hf_config's refusals name its argument, ``config``, or the model type: on the command line
    they said "config: model_type 'bert' is not supported" or "llama: hidden_size must be ...", where the
    user typed --model (and --config is another flag). They now start with --model."""
    cases = [
        ({"model_type": "bert"}, "error: --model: model_type 'bert' is not supported; supported: llama"),
        (
            {"model_type": "llama", "hidden_size": "64"},
            "error: --model: llama: hidden_size must be a positive",
        ),
    ]
    for i, (config, match) in enumerate(cases):
        path = tmp_path / f"config{i}.json"
        path.write_text(json.dumps(config))
        assert main(["plan", "--model", str(path), "--instance", "p5"]) == 2
        assert match in capsys.readouterr().err, config


def test_a_model_path_that_does_not_exist_is_named(capsys, tmp_path) -> None:
    """A --model path with no file behind it (or a directory without config.json) gave the bare
    "[Errno 2] No such file or directory", naming neither the argument nor what was expected."""
    missing = str(tmp_path / "llama-3.json")
    with pytest.raises(
        FileNotFoundError, match=r"config: .*llama-3.json' does not exist \(expected a Hugging"
    ):
        model_spec(missing)
    with pytest.raises(FileNotFoundError, match=r"config: .*config.json' does not exist"):
        model_spec(str(tmp_path))  # a directory without config.json
    assert main(["plan", "--model", missing, "--instance", "p5"]) == 2
    assert f"error: --model: {missing!r} does not exist" in capsys.readouterr().err


def test_model_spec_describe_and_presets() -> None:
    assert model_spec("DeepSeek-V3").is_mla and model_spec("deepseek-v3").num_moe_layers == 58
    assert "MoE 8x top-2" in model_spec("mixtral-8x7b").describe()


def test_checkpointing_is_not_recommended_where_it_buys_nothing() -> None:
    """Llama 2 7B on 16 p4d nodes fits without checkpointing at the same predicted step (the recompute
    hides under FSDP's traffic): that configuration ranks first, and a checkpointed one of the same shape
    does not claim to be needed "to fit" (both used to be the other way round)."""
    adv = advise("llama2-7b", "p4d.24xlarge", nodes=16, seq_len=4096)
    assert adv.best.config.activation_checkpointing == "none", adv.best.reason
    optional = [c for c in adv.candidates if "optional (the same shape fits without it)" in c.reason]
    assert optional and all(c.config.activation_checkpointing != "none" for c in optional)
    assert not any("to fit" in c.reason and "checkpointing" in c.reason for c in optional)


SIX_GPU_NODES = {
    "gpu": "H100-6", "memory_gb": 80, "bf16_tflops": 989, "gpus_per_node": 6, "intra_node_gbps": 450,
    "inter_node_gbps": 400,
}  # fmt: skip


def test_a_tensor_parallel_group_stays_inside_a_node() -> None:
    """On 6-GPU nodes tp 4 made groups {4..7} across two nodes, priced at NVLink speed (qwen3-32b's top
    pick at 2 nodes); tp must divide the GPUs per node."""
    adv = advise("qwen3-32b", SIX_GPU_NODES, nodes=2, seq_len=8192)
    tps = {c.config.tensor_parallel_degree for c in (*adv.candidates, *adv.rejected)}
    assert tps <= {1, 2} and 2 in tps, tps


def test_tp_predicted_faster_than_every_tp1_configuration_is_kept() -> None:
    """Llama 3.1 70B on 3 p4de nodes: rule 3 rejected tp 2 (predicted 3.4x faster) because a tp 1
    configuration fit, so the top pick ran at 13% MFU; a tp > 1 configuration now stays when the step
    model predicts it faster per token than every tp 1 one, and the reason says so."""
    adv = advise("llama3.1-70b", "p4de.24xlarge", nodes=3, seq_len=4096)
    best = adv.best
    assert best.config.tensor_parallel_degree > 1, best.reason
    assert "predicted faster per token than every tp 1 configuration" in best.reason
    per_token = best.time.step_s / best.global_batch_tokens
    tp1 = [c for c in adv.candidates if c.config.tensor_parallel_degree == 1]
    assert all(c.time.step_s / c.global_batch_tokens > per_token for c in tp1)
    for c in adv.rejected:
        if c.reason.startswith("TP not needed"):
            assert c.time.step_s / c.global_batch_tokens >= per_token


def test_a_global_batch_above_the_limit_is_refused_up_front() -> None:
    """8M tokens was accepted, then advised 'at most 2 nodes' with arithmetic that left accumulation out."""
    with pytest.raises(
        ValueError, match=r"global_batch_tokens: expected an int from seq_len \(4096\) to the 4M"
    ):
        advise("llama3.1-8b", "p5", nodes=4, seq_len=4096, global_batch_tokens=8 * 2**20)
    assert advise("llama3.1-8b", "p5", nodes=4, seq_len=4096, global_batch_tokens=4 * 2**20).candidates


@pytest.mark.parametrize(
    ("key", "value", "choices"),
    [
        ("optimizer", "lion", "adamw, adam, sgd, sgd_momentum"),
        ("attention", "sdpa", "flash, materialized"),
        ("loss", "mean", "vocab_parallel, gathered"),
    ],
)
def test_advise_refuses_an_unknown_choice_up_front(key, value, choices) -> None:
    """The search skips every configuration estimate_memory refuses (a degree the model does not divide):
    an unknown optimizer or attention made it skip them all, and advise answered "nothing fits" with no
    suggestion instead of naming the argument."""
    with pytest.raises(ValueError, match=f"{key}: expected one of {choices}, got '{value}'"):
        advise("llama2-7b", "p5", seq_len=4096, **{key: value})
    with pytest.raises(ValueError, match=f"{key}: expected one of {choices}, got '{value}'"):
        estimate_memory("llama2-7b", {}, seq_len=4096, cluster="p5", **{key: value})


def test_moe_blocks_are_not_split_over_tp_in_the_step_time() -> None:
    """smptk keeps MoE blocks whole on every tp rank: their FLOPs are not divided by tp (mixtral's compute at
    tp 2 was half of tp 1's, though 88% of its active parameters are routed experts)."""
    times = {
        t: step_time("mixtral-8x7b", {"tensor_parallel_degree": t}, "p5", seq_len=4096).compute_s
        for t in (1, 2)
    }
    assert 0.85 * times[1] < times[2] < times[1], times
    dense = {
        t: step_time("llama3.1-8b", {"tensor_parallel_degree": t}, "p5", seq_len=4096).compute_s
        for t in (1, 2)
    }
    assert dense[2] == pytest.approx(dense[1] / 2)


def test_plan_takes_the_node_count_of_a_cluster_file(capsys, tmp_path) -> None:
    """A custom cluster file's "nodes" was overridden by --nodes' default 1."""
    path = tmp_path / "six.json"
    path.write_text(json.dumps(SIX_GPU_NODES | {"nodes": 4}))
    assert main(["plan", "--model", "llama2-7b", "--instance", str(path), "--top", "1"]) == 0
    assert "4 x 6 H100-6" in capsys.readouterr().out
    assert main(["plan", "--model", "llama2-7b", "--instance", str(path), "--nodes", "2", "--top", "1"]) == 0
    assert "2 x 6 H100-6" in capsys.readouterr().out


def test_nothing_fits_names_the_nearest_node_counts_that_do() -> None:
    """Mixtral 8x7B fits on 2 and 4 p5 nodes but not on 3 (its experts' width does not divide over 24
    data-parallel ranks): the advice said only "buy a larger GPU", and its "smallest configuration" tried
    full sharding alone (mixtral-8x22b on a GB200 NVL72: 273.6 GiB; the search's own smallest: 217.1)."""
    adv = advise("mixtral-8x7b", "p5", nodes=3, seq_len=4096)
    assert adv.best is None
    text = " | ".join(adv.suggestions)
    assert "2 nodes (16 GPUs) would fit" in text and "4 nodes (32 GPUs) would fit" in text, text
    big = advise("mixtral-8x22b", "gb200-nvl72", seq_len=4096)
    assert big.best is None
    smallest = min(
        c.estimate.total_bytes
        for c in big.rejected
        if c.micro_batch == 1
        and c.config.activation_checkpointing == "full"
        and c.config.sm_activation_offloading
    )
    assert f"needs {smallest / 2**30:.1f} GiB per GPU" in big.suggestions[0], big.suggestions


def test_a_hugging_face_model_through_transform_is_planned_with_its_excess(capsys, tmp_path) -> None:
    """A Llama config.json planned for training through transform: the plan counted smptk's own layers only,
    1.18x low on activations with no checkpointing (Llama 3.1 8B, 4096 tokens, bf16: 4.06 GiB), and the
    command line did not say which layers it assumed. ``implementation="hf"`` adds the measured excess as
    its own term (tests/test_planner_validation.py checks it against measured bytes) with the gathered
    logits; the plan says which it assumes; models the excess does not describe are refused up front."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rope_theta": 500000.0,
    }))  # fmt: skip
    spec = model_spec(str(config))
    assert spec.num_parameters() == model_spec("llama3.1-8b").num_parameters()
    own = estimate_memory(spec, {}, seq_len=4096, world_size=1, loss="gathered")
    hf = estimate_memory(spec, {}, seq_len=4096, world_size=1, implementation="hf")
    excess = [t for t in hf.terms if t.name == "activations: Hugging Face layers (transform)"]
    assert len(excess) == 1 and hf.activation_bytes == own.activation_bytes + excess[0].bytes
    assert round(hf.activation_bytes / own.activation_bytes, 2) == 1.18 and hf.implementation == "hf"
    assert round(excess[0].bytes / 2**30, 2) == 4.06
    assert hf.to_dict()["implementation"] == "hf" and own.to_dict()["implementation"] == "smptk"
    base = ["plan", "--model", str(config), "--instance", "p5", "--config", "{}"]
    main(base)
    assert "activations: smptk's own layers" in capsys.readouterr().out
    main([*base, "--implementation", "hf"])
    out = capsys.readouterr().out
    assert "activations: a Hugging Face model through transform" in out
    assert "activations: Hugging Face layers (transform)" in out
    main([*base[:-2], "--implementation", "hf", "--top", "1"])
    assert "activations: Hugging Face layers (transform)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="loss: 'vocab_parallel' with implementation 'hf'"):
        estimate_memory(spec, {}, seq_len=64, world_size=1, implementation="hf", loss="vocab_parallel")
    with pytest.raises(ValueError, match="implementation: expected one of smptk, hf, got 'transformers'"):
        estimate_memory(spec, {}, seq_len=64, world_size=1, implementation="transformers")
    for other, has in (("qwen3-8b", "q / k norms"), ("mixtral-8x7b", "MoE layers")):
        with pytest.raises(ValueError, match=f"implementation: 'hf' .* has {has}"):
            advise(other, "p5", seq_len=4096, implementation="hf")  # refused, not "nothing fits"
