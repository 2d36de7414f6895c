"""smptk.parallel's ParallelConfig and init: every bad config rejected with its message, the documented mesh.

Layout checks run two ways. In this process, with torch's "fake" process-group backend (collectives are
no-ops, group membership is real), ``init`` runs as each of 8 ranks in turn, so the module docstring's
world-8 example is checked rank by rank without starting 8 processes. On 4 real gloo ranks, one job
builds four configs' meshes in the same process group and a real all-gather over each dim's group shows
who is in it. Expected groups are written out literally here, not computed with the library's formula.
"""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import json
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from comm_harness import run_ranks
from helpers import fake_world

import smptk.comm as comm
import smptk.parallel as parallel
from smptk.parallel import ParallelConfig
from smptk.parallel import config as config_mod

DIMS = config_mod.DIM_NAMES


# ---------------------------------------------------------------------------------------------------------
# ParallelConfig: construction, sources, rejection


def test_defaults_and_keys() -> None:
    cfg = ParallelConfig()
    assert cfg.to_dict() == {
        "tensor_parallel_degree": 1,
        "hybrid_shard_degree": 0,
        "expert_parallel_degree": 1,
        "context_parallel_degree": 1,
        "activation_checkpointing": "none",
        "sm_activation_offloading": False,
        "activation_loading_horizon": 2,
        "delayed_parameter_initialization": False,
        "mixed_precision": "bf16",
        "comm_max_sms": None,
        "random_seed": 0,
    }
    assert ParallelConfig.keys() == tuple(cfg.to_dict())


FULL = {
    "tensor_parallel_degree": 2,
    "hybrid_shard_degree": 2,
    "expert_parallel_degree": 2,
    "context_parallel_degree": 1,
    "activation_checkpointing": "selective",
    "sm_activation_offloading": True,
    "activation_loading_horizon": 3,
    "delayed_parameter_initialization": True,
    "mixed_precision": "fp16",
    "comm_max_sms": 0,
    "random_seed": 1234,
}


def test_dict_dataclass_and_json_sources(tmp_path) -> None:
    cfg = ParallelConfig.from_any(FULL)
    assert cfg.to_dict() == FULL
    assert ParallelConfig.from_any(cfg) is cfg
    assert ParallelConfig.from_any(None) == ParallelConfig()
    path = tmp_path / "smp.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert ParallelConfig.from_any(path) == cfg  # Path
    assert ParallelConfig.from_any(str(path)) == cfg  # str
    partial = tmp_path / "partial.json"
    partial.write_text('{"tensor_parallel_degree": 4, "comm_max_sms": null}')
    assert ParallelConfig.from_any(partial) == ParallelConfig(tensor_parallel_degree=4)


def test_json_with_a_repeated_key_or_given_as_text_is_refused(tmp_path) -> None:
    """A key given twice in the file (json keeps the last one silently) and JSON text passed where a path
    goes (it used to say only "No such file or directory: '{...}'") raise, saying what is wrong."""
    path = tmp_path / "twice.json"
    path.write_text('{"tensor_parallel_degree": 2, "random_seed": 1, "tensor_parallel_degree": 4}')
    with pytest.raises(ValueError, match=r"key 'tensor_parallel_degree' is given more than once"):
        ParallelConfig.from_any(path)
    with pytest.raises(FileNotFoundError, match=r"is JSON text, not a file path; pass a dict"):
        ParallelConfig.from_any('{"tensor_parallel_degree": 2}')


def test_activation_checkpointing_bools_become_policies() -> None:
    assert ParallelConfig(activation_checkpointing=True).activation_checkpointing == "full"
    assert ParallelConfig(activation_checkpointing=False).activation_checkpointing == "none"
    cfg = ParallelConfig.from_dict({"activation_checkpointing": True, "sm_activation_offloading": True})
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg


def test_config_is_frozen() -> None:
    cfg = ParallelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tensor_parallel_degree = 2  # type: ignore[misc]
    assert dataclasses.replace(cfg, tensor_parallel_degree=2).tensor_parallel_degree == 2


# (values, exception, message the error must contain)
INVALID = [
    (
        {"tensor_parallel_degre": 2},
        ValueError,
        "unknown config key 'tensor_parallel_degre' (did you mean 'tensor_parallel_degree'?); known keys: ",
    ),
    ({"hybrid_sharding_degree": 2}, ValueError, "did you mean 'hybrid_shard_degree'?"),
    ({"fsdp_cache_flush_warnings": True}, ValueError, "unknown config key 'fsdp_cache_flush_warnings'"),
    ({1: 2}, TypeError, "config keys must be strings, got int 1"),
    ({"tensor_parallel_degree": True}, TypeError, "tensor_parallel_degree: expected an int, got bool True"),
    ({"tensor_parallel_degree": 2.0}, TypeError, "tensor_parallel_degree: expected an int, got float 2.0"),
    ({"tensor_parallel_degree": "2"}, TypeError, "tensor_parallel_degree: expected an int, got str '2'"),
    ({"tensor_parallel_degree": 0}, ValueError, "tensor_parallel_degree: expected an int >= 1, got 0"),
    ({"hybrid_shard_degree": -1}, ValueError, "hybrid_shard_degree: expected an int >= 0, got -1"),
    ({"hybrid_shard_degree": None}, TypeError, "hybrid_shard_degree: expected an int, got NoneType None"),
    ({"expert_parallel_degree": 0}, ValueError, "expert_parallel_degree: expected an int >= 1, got 0"),
    ({"expert_parallel_degree": False}, TypeError, "expert_parallel_degree: expected an int, got bool"),
    (
        {"context_parallel_degree": 2},
        NotImplementedError,
        "context_parallel_degree 2: context parallelism is not supported yet",
    ),
    ({"context_parallel_degree": 0}, ValueError, "context_parallel_degree: expected an int >= 1, got 0"),
    (
        {"activation_checkpointing": "fulll"},
        ValueError,
        "activation_checkpointing: expected one of none, full, selective, got 'fulll' (did you mean 'full'?)",
    ),
    ({"activation_checkpointing": 1}, TypeError, "activation_checkpointing: expected one of none"),
    ({"sm_activation_offloading": 1}, TypeError, "sm_activation_offloading: expected a bool"),
    (
        {"sm_activation_offloading": True},
        ValueError,
        "sm_activation_offloading: offloading moves the inputs of checkpointed blocks",
    ),
    ({"activation_loading_horizon": 0}, ValueError, "activation_loading_horizon: expected an int >= 1"),
    ({"activation_loading_horizon": 2.5}, TypeError, "activation_loading_horizon: expected an int"),
    ({"delayed_parameter_initialization": "yes"}, TypeError, "delayed_parameter_initialization: expected"),
    (
        {"mixed_precision": "bfloat16"},
        ValueError,
        "mixed_precision: expected one of bf16, fp16, fp32, got 'bfloat16'",
    ),
    ({"mixed_precision": None}, TypeError, "mixed_precision: expected one of bf16, fp16, fp32, got NoneType"),
    ({"comm_max_sms": -1}, ValueError, "comm_max_sms: expected an int in 0..256, got -1"),
    ({"comm_max_sms": 257}, ValueError, "comm_max_sms: expected an int in 0..256, got 257"),
    ({"comm_max_sms": True}, TypeError, "comm_max_sms: expected an int, got bool True"),
    ({"random_seed": -1}, ValueError, "random_seed: expected an int in 0..9223372036854775807, got -1"),
    ({"random_seed": 2**63}, ValueError, "random_seed: expected an int in 0..9223372036854775807"),
    ({"random_seed": 1.5}, TypeError, "random_seed: expected an int, got float 1.5"),
]


@pytest.mark.parametrize(("values", "exc", "message"), INVALID, ids=lambda v: str(v)[:40])
def test_invalid_config_rejected(values, exc, message) -> None:
    with pytest.raises(exc, match=re.escape(message)):
        ParallelConfig.from_any(values)


def test_unknown_key_without_close_match_lists_known_keys() -> None:
    with pytest.raises(ValueError, match="unknown config key 'zzz'; known keys: tensor_parallel_degree, "):
        ParallelConfig.from_dict({"zzz": 1})


def test_bad_sources(tmp_path) -> None:
    with pytest.raises(TypeError, match="config: expected a ParallelConfig, a dict of keys or a JSON file"):
        ParallelConfig.from_any(42)  # type: ignore[arg-type]
    bad = tmp_path / "bad.json"
    bad.write_text("{tensor_parallel_degree: 2}")
    with pytest.raises(ValueError, match="is not valid JSON"):
        ParallelConfig.from_any(bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(TypeError, match="expected a JSON object of keys, got list"):
        ParallelConfig.from_any(arr)
    with pytest.raises(FileNotFoundError):
        ParallelConfig.from_any(tmp_path / "missing.json")
    typo = tmp_path / "typo.json"
    typo.write_text('{"expert_paralel_degree": 2}')
    with pytest.raises(ValueError, match="did you mean 'expert_parallel_degree'"):
        ParallelConfig.from_any(str(typo))


# ---------------------------------------------------------------------------------------------------------
# validate(world_size): sizes and divisibility

SIZES = [
    # (config, world, dp_replicate, dp_shard, dp, edp_shard, ep, tp)
    ({}, 1, 1, 1, 1, 1, 1, 1),
    ({}, 8, 1, 8, 8, 8, 1, 1),
    (
        {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2, "expert_parallel_degree": 2},
        8,
        2,
        2,
        4,
        1,
        2,
        2,
    ),
    ({"hybrid_shard_degree": 4, "expert_parallel_degree": 2}, 8, 2, 4, 8, 2, 2, 1),
    ({"hybrid_shard_degree": 1}, 4, 4, 1, 4, 1, 1, 1),
    ({"tensor_parallel_degree": 8}, 8, 1, 1, 1, 1, 1, 8),
    ({"tensor_parallel_degree": 2, "hybrid_shard_degree": 3}, 12, 2, 3, 6, 3, 1, 2),
    ({"tensor_parallel_degree": 2, "expert_parallel_degree": 3}, 12, 1, 6, 6, 2, 3, 2),
]


@pytest.mark.parametrize(("values", "world", *DIMS), SIZES)
def test_validate_sizes(values, world, dp_replicate, dp_shard, dp, edp_shard, ep, tp) -> None:
    sizes = ParallelConfig.from_any(values).validate(world)
    assert sizes == {
        "dp_replicate": dp_replicate,
        "dp_shard": dp_shard,
        "dp": dp,
        "edp_shard": edp_shard,
        "ep": ep,
        "tp": tp,
    }


WORLD_INVALID = [
    ({"tensor_parallel_degree": 3}, 8, "tensor_parallel_degree 3 does not divide world size 8"),
    ({"tensor_parallel_degree": 16}, 8, "tensor_parallel_degree 16 does not divide world size 8"),
    (
        {"tensor_parallel_degree": 2, "hybrid_shard_degree": 4},
        12,
        "hybrid_shard_degree 4 does not divide the data-parallel size 6 "
        "(world size 12 / tensor_parallel_degree 2)",
    ),
    (
        {"tensor_parallel_degree": 2, "hybrid_shard_degree": 8},
        8,
        "hybrid_shard_degree 8 exceeds the data-parallel size 4 (world size 8 / tensor_parallel_degree 2)",
    ),
    (
        {"expert_parallel_degree": 3},
        8,
        "expert_parallel_degree 3 does not divide dp_shard 8 (the sharding group, hybrid_shard_degree 0 of "
        "the data-parallel size 8 (world size 8 / tensor_parallel_degree 1))",
    ),
    (  # divides dp (4) but not dp_shard (1): the hint says how to fix it
        {"hybrid_shard_degree": 1, "expert_parallel_degree": 2},
        4,
        "expert_parallel_degree 2 does not divide dp_shard 1 (the sharding group, hybrid_shard_degree 1 of "
        "the data-parallel size 4 (world size 4 / tensor_parallel_degree 1)): expert parallelism is "
        "carved out of the sharding group; set hybrid_shard_degree to 0 or a multiple of 2 that divides 4",
    ),
    (
        {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2, "expert_parallel_degree": 4},
        8,
        "expert_parallel_degree 4 does not divide dp_shard 2",
    ),
]


@pytest.mark.parametrize(("values", "world", "message"), WORLD_INVALID)
def test_validate_rejects_with_numbers(values, world, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelConfig.from_any(values).validate(world)


def test_validate_world_size_type() -> None:
    with pytest.raises(ValueError, match="world_size: expected an int >= 1, got 0"):
        ParallelConfig().validate(0)
    with pytest.raises(TypeError, match="world_size: expected an int, got bool"):
        ParallelConfig().validate(True)


# ---------------------------------------------------------------------------------------------------------
# init in this process


def test_init_without_process_group_suggests_torchrun() -> None:
    assert not dist.is_initialized(), "another test left a process group behind"
    with pytest.raises(RuntimeError, match="torchrun"):
        parallel.init({})
    with pytest.raises(ValueError, match="unknown config key"):  # the config is checked first
        parallel.init({"bogus": 1})
    assert not parallel.is_initialized()
    with pytest.raises(RuntimeError, match=re.escape("call smptk.parallel.init(config) first")):
        parallel.current()


def _partition(groups: list[tuple[int, ...]], world: int) -> dict[int, tuple[int, ...]]:
    """rank -> its group; checks that ``groups`` (written by hand) cover every rank exactly once."""
    out = {r: g for g in groups for r in g}
    assert sorted(r for g in groups for r in g) == list(range(world)), groups
    return out


# The module docstring's worked example: world 8, tp 2, hybrid 2, ep 2.
EXAMPLE_8 = {
    "tp": [(0, 1), (2, 3), (4, 5), (6, 7)],
    "dp_shard": [(0, 2), (1, 3), (4, 6), (5, 7)],
    "dp_replicate": [(0, 4), (1, 5), (2, 6), (3, 7)],
    "dp": [(0, 2, 4, 6), (1, 3, 5, 7)],
    "ep": [(0, 2), (1, 3), (4, 6), (5, 7)],
    "edp_shard": [(r,) for r in range(8)],
}
# Its second example: world 8, tp 1, hybrid 4, ep 2 (ep is the inner half of each shard group).
EXAMPLE_8_EP_INNER = {
    "tp": [(r,) for r in range(8)],
    "dp_shard": [(0, 1, 2, 3), (4, 5, 6, 7)],
    "dp_replicate": [(0, 4), (1, 5), (2, 6), (3, 7)],
    "dp": [tuple(range(8))],
    "ep": [(0, 1), (2, 3), (4, 5), (6, 7)],
    "edp_shard": [(0, 2), (1, 3), (4, 6), (5, 7)],
}


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2, "expert_parallel_degree": 2}, EXAMPLE_8),
        ({"hybrid_shard_degree": 4, "expert_parallel_degree": 2}, EXAMPLE_8_EP_INNER),
    ],
    ids=["tp2-hsd2-ep2", "hsd4-ep2"],
)
def test_documented_layout_every_rank_of_8(values, expected) -> None:
    parts = {dim: _partition(groups, 8) for dim, groups in expected.items()}
    for rank in range(8):
        with fake_world(8, rank):
            state = parallel.init(values)
            assert (state.rank, state.world_size, state.device_type) == (rank, 8, "cpu")
            assert state.mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
            assert state.expert_mesh.mesh_dim_names == ("dp_replicate", "edp_shard", "ep", "tp")
            for dim in DIMS:
                assert state.ranks(dim) == parts[dim][rank], f"rank {rank}, dim {dim}"
                assert state.sizes[dim] == len(parts[dim][rank]), f"rank {rank}, dim {dim}"
                assert state.coords[dim] == parts[dim][rank].index(rank), f"rank {rank}, dim {dim}"
            # the 3-D mesh is row-major with tp innermost: rank = (r * dp_shard + s) * tp + t
            c = state.coords
            assert (
                rank
                == (c["dp_replicate"] * state.sizes["dp_shard"] + c["dp_shard"]) * state.sizes["tp"] + c["tp"]
            )
            assert state.mesh.mesh.flatten().tolist() == list(range(8))


def test_state_lookups_and_seeds_on_fake_world() -> None:
    values = {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2, "expert_parallel_degree": 2}
    seeds = []
    for rank in range(8):
        with fake_world(8, rank):
            state = parallel.init({**values, "random_seed": 11})
            assert parallel.current() is state and parallel.is_initialized()
            assert state.submesh("tp").mesh_dim_names == ("tp",)
            assert state.submesh("ep").mesh_dim_names == ("ep",)
            assert state.submesh("dp") is state.dp_mesh
            with pytest.raises(
                ValueError, match=r"dim: expected one of .* got 'tpp' \(did you mean 'tp'\?\)"
            ):
                state.group("tpp")
            with pytest.raises(ValueError, match="dim: expected one of"):
                state.seed_for("world")
            with pytest.raises(TypeError):
                state.sizes["tp"] = 4  # read-only view
            assert state.seed_for("tp", "dp") == state.seed_for("dp", "tp")
            g1, g2 = state.generator("tp"), state.generator("tp")
            assert torch.equal(torch.randn(4, generator=g1), torch.randn(4, generator=g2))
            seeds.append(
                {dims: state.seed_for(*dims) for dims in ((), ("tp",), ("dp",), ("ep",), ("dp", "tp"))}
                | {"coords": dict(state.coords)}
            )
        assert not parallel.is_initialized()
    _check_seeds(seeds, base=11)


def _check_seeds(seeds: list[dict], base: int) -> None:
    """seed_for(dims) agrees between two ranks exactly when their coordinates on ``dims`` agree."""
    for s in seeds:
        assert s[()] == base
    for dims in (("tp",), ("dp",), ("ep",), ("dp", "tp")):
        for a in seeds:
            for b in seeds:
                same = all(a["coords"][d] == b["coords"][d] for d in dims)
                assert (a[dims] == b[dims]) == same, (dims, a["coords"], b["coords"])
        assert all(0 <= s[dims] < 2**63 for s in seeds)


def test_fork_rng_masks_per_coordinate_new_every_call_and_the_default_generator_in_step() -> None:
    """``fork_rng(*dims)`` draws agree between two ranks exactly when their coordinates on ``dims`` agree;
    a second call draws anew; afterwards the default generator is where every rank has it (one draw past
    where it was), so dropout of replicated activations outside the region keeps agreeing."""
    values = {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2, "expert_parallel_degree": 2}
    draws = []
    for rank in range(8):
        with fake_world(8, rank):
            state = parallel.init({**values, "random_seed": 11})
            start = torch.get_rng_state()
            row = {"coords": dict(state.coords)}
            for dims in (("tp",), ("dp", "tp")):
                with state.fork_rng(*dims):
                    first = torch.rand(6)
                with state.fork_rng(*dims):
                    second = torch.rand(6)
                assert not torch.equal(first, second), dims
                row[dims] = first
            after = []
            for inside in (0, 100):  # what the region draws does not move the generator outside it
                torch.set_rng_state(start)
                with state.fork_rng("tp"):
                    torch.rand(inside)
                after.append(torch.rand(4))
            assert torch.equal(after[0], after[1])
            torch.set_rng_state(start)
            assert not torch.equal(after[0], torch.rand(4))  # but every call moves it: the next call's masks
            row["after"] = after[0]
            draws.append(row)
    for dims in (("tp",), ("dp", "tp")):
        for a in draws:
            for b in draws:
                same = all(a["coords"][d] == b["coords"][d] for d in dims)
                assert torch.equal(a[dims], b[dims]) == same, (dims, a["coords"], b["coords"])
    assert all(torch.equal(d["after"], draws[0]["after"]) for d in draws)


def test_comm_max_sms_applied_and_restored() -> None:
    before = comm.settings()["max_sms"]
    other = 3 if before != 3 else 5
    with fake_world(2, 0):
        state = parallel.init({"comm_max_sms": other})
        assert comm.settings()["max_sms"] == other and state.comm_max_sms == other
        state = parallel.init({"comm_max_sms": 0})  # re-init: the first init's setting goes back first
        assert comm.settings()["max_sms"] == before and state.comm_max_sms == 0
        parallel.init({"comm_max_sms": other})
        parallel.init({})  # None leaves smptk.comm's own setting
        assert comm.settings()["max_sms"] == before
        parallel.init({"comm_max_sms": other})
    assert comm.settings()["max_sms"] == before  # reset() (in fake_world) restored it


def test_init_does_not_warn_about_keys_it_applies() -> None:
    with fake_world(2, 0), warnings.catch_warnings():  # every key is applied by some smptk function
        warnings.simplefilter("error")
        parallel.init({"activation_checkpointing": "full", "sm_activation_offloading": True})
        parallel.init({"activation_checkpointing": "full", "delayed_parameter_initialization": True})


def test_init_rejects_world_mismatch_and_device_type() -> None:
    with fake_world(8, 0):
        with pytest.raises(ValueError, match="tensor_parallel_degree 3 does not divide world size 8"):
            parallel.init({"tensor_parallel_degree": 3})
        with pytest.raises(TypeError, match="device_type: expected a str"):
            parallel.init({}, device_type=0)  # type: ignore[arg-type]
        assert not parallel.is_initialized()


def test_module_docstring_example_runs() -> None:
    assert not dist.is_initialized()
    result = doctest.testmod(config_mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
    assert not dist.is_initialized() and not parallel.is_initialized()


# ---------------------------------------------------------------------------------------------------------
# 4 real gloo ranks: four configs' meshes in one job

REAL_CONFIGS = [
    {"tensor_parallel_degree": 2, "expert_parallel_degree": 2, "comm_max_sms": 4, "random_seed": 3},
    {"hybrid_shard_degree": 2, "expert_parallel_degree": 2},
    {"expert_parallel_degree": 2},
    {"hybrid_shard_degree": 1},
]
SINGLES = [(0,), (1,), (2,), (3,)]
REAL_EXPECTED = [
    {  # tp 2, dp 2 = dp_shard 2, ep 2 = dp_shard: mesh [[[0, 1], [2, 3]]]
        "tp": [(0, 1), (2, 3)],
        "dp_shard": [(0, 2), (1, 3)],
        "dp_replicate": SINGLES,
        "dp": [(0, 2), (1, 3)],
        "ep": [(0, 2), (1, 3)],
        "edp_shard": SINGLES,
    },
    {  # HSDP 2 x 2, ep inside each shard group
        "tp": SINGLES,
        "dp_shard": [(0, 1), (2, 3)],
        "dp_replicate": [(0, 2), (1, 3)],
        "dp": [(0, 1, 2, 3)],
        "ep": [(0, 1), (2, 3)],
        "edp_shard": SINGLES,
    },
    {  # full shard over 4, ep 2 inner, expert weights sharded over edp_shard 2
        "tp": SINGLES,
        "dp_shard": [(0, 1, 2, 3)],
        "dp_replicate": SINGLES,
        "dp": [(0, 1, 2, 3)],
        "ep": [(0, 1), (2, 3)],
        "edp_shard": [(0, 2), (1, 3)],
    },
    {  # hybrid_shard_degree 1: replicated over 4
        "tp": SINGLES,
        "dp_shard": SINGLES,
        "dp_replicate": [(0, 1, 2, 3)],
        "dp": [(0, 1, 2, 3)],
        "ep": SINGLES,
        "edp_shard": SINGLES,
    },
]


def test_meshes_on_four_gloo_ranks() -> None:
    job = run_ranks("parallel_jobs:mesh_layouts", world=4, args=(REAL_CONFIGS,), timeout_s=180)
    job.raise_for_failure()
    default_max_sms = job.values[0][-1]["max_sms_after_reset"]
    for rank, per_config in enumerate(job.values):
        assert per_config[-1]["max_sms_after_reset"] == default_max_sms
        for k, (got, expected) in enumerate(zip(per_config[:-1], REAL_EXPECTED, strict=True)):
            assert (got["rank"], got["world_size"], got["device_type"]) == (rank, 4, "cpu")
            for dim in DIMS:
                group = _partition(expected[dim], 4)[rank]
                where = f"config {REAL_CONFIGS[k]}, rank {rank}, dim {dim}"
                assert got["members"][dim] == group, where  # what a real all-gather over the group saw
                assert got["ranks"][dim] == group, where
                assert got["sizes"][dim] == len(group), where
                assert got["coords"][dim] == group.index(rank), where
            assert got["max_sms"] == (4 if k == 0 else default_max_sms)
            # one heap, the tp group's, named by every dim whose group has the same ranks
            tp = _partition(expected["tp"], 4)[rank]
            dims = tuple(d for d in DIMS if _partition(expected[d], 4)[rank] == tp)
            assert got["heaps"] == [(dims, tp, 4096, 1)], where
    for k, cfg in enumerate(REAL_CONFIGS):
        seeds = [{**per_config[k]["seeds"], "coords": per_config[k]["coords"]} for per_config in job.values]
        _check_seeds(seeds, base=cfg.get("random_seed", 0))
        for s in seeds:
            assert s[("dp", "tp")] == s[("tp", "dp")]


def test_fork_rng_draws_from_the_cpu_generator_whatever_the_default_device() -> None:
    """Under ``torch.set_default_device`` (or a ``with torch.device(...)`` block) the region's draw made a
    tensor on that device: from the CUDA generator with a host sync at ``.item()`` under "cuda", which the
    docstring's "one number from torch's default CPU generator" does not say, and under "meta" it raised
    ("Tensor.item() cannot be called on meta tensors"). It is drawn on the CPU in every case: the masks
    and the CPU generator afterwards are those drawn without a default device."""
    with fake_world(2, 0):
        state = parallel.init({"tensor_parallel_degree": 2, "random_seed": 3})
        x = torch.ones(16)
        out = []
        for device in (None, "meta"):
            torch.manual_seed(5)
            with torch.device(device) if device else contextlib.nullcontext(), state.fork_rng("tp"):
                mask = torch.nn.functional.dropout(x, 0.5)
            out.append((mask, torch.rand(4)))
        assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_fork_rng_under_torch_compile_in_a_disabled_function() -> None:
    """The docstring's torch.compile recipe: traced inline, the region left the rest of the compiled function
    eager (one graph, the code before it); in a ``torch.compiler.disable`` function the code on both sides
    compiles (two graphs) and the result is the eager one, masks included."""
    ops = []

    def backend(gm, inputs):
        ops.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    with fake_world(2, 0):
        state = parallel.init({"tensor_parallel_degree": 2, "random_seed": 3})

        @torch.compiler.disable
        def drop(x):
            with state.fork_rng("tp"):
                return torch.nn.functional.dropout(x, 0.5)

        def block(x):
            return (drop(x * 2) + 1) * 3

        torch._dynamo.reset()
        out = []
        for fn in (block, torch.compile(block, backend=backend)):
            torch.manual_seed(7)
            out.append(fn(torch.ones(16)))
        torch._dynamo.reset()
    assert torch.equal(out[0], out[1])
    assert len(ops) == 2 and all(ops), ops
