"""smptk.parallel's tensor-parallel layers, styles and vocab-parallel cross-entropy on 2, 3 and 4 gloo ranks.

One spawned job per world size (``comm_harness.run_ranks``); the cases, each comparing a sharded layer
with the unsharded torch module from the same seed, are in ``tp_jobs.py``; each test reads one case's
outcome on every rank. The 2-rank job runs the collectives on smptk's symmetric heap under the Triton
interpreter (1 program, 64 KiB heap: the messages are tiny) and one layer pair on the Triton kernels;
the 3- and 4-rank jobs run with ``TRITON_INTERPRET=0``, so their collectives take the torch.distributed
(gloo) fallback: four interpreted ranks on 2 shared cores took 104 s for these cases, against 37 s for the
2-rank job (load average 9). The 3-rank job runs the vocabulary cases (embedding, cross-entropy, styles)
at an odd tensor-parallel size (24 s); the FSDP2 case needs TP 2 x DP 2, so it runs in the 4-rank job.

The in-process tests below check what needs no process group: the initialization blocks and argument
checks of the styles.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from comm_harness import JobResult, run_ranks
from torch import nn
from tp_jobs import CASES

from smptk.kernels import runtime
from smptk.parallel import shard_init, tp_styles
from smptk.parallel import tensor_parallel as tp

COMMON = [
    "init_stream",
    "autocast",
    "column",
    "row",
    "embedding",
    "cross_entropy",
    "styles",
    "moe_sequence_parallel",
    "errors",
]
JOB_CASES = {
    2: [*COMMON, "triton", "dropout"],
    3: ["embedding", "cross_entropy", "styles"],
    4: [*COMMON, "fsdp"],
}
DEADLINE_S = {2: 150, 3: 120, 4: 180}
ENV = {
    2: {"SMPTK_COMM_MAX_SMS": "1", "SMPTK_COMM_HEAP_BYTES": str(64 * 1024)},
    3: {"TRITON_INTERPRET": "0"},
    4: {"TRITON_INTERPRET": "0"},
}
_jobs: dict[int, JobResult] = {}


def _job(world: int) -> JobResult:
    if world not in _jobs:
        _jobs[world] = run_ranks(
            "tp_jobs:run", world, args=(JOB_CASES[world],), timeout_s=DEADLINE_S[world], env=ENV[world]
        )
    return _jobs[world]


PARAMS = [(w, c) for w, cases in JOB_CASES.items() for c in cases]


@pytest.mark.parametrize(("world", "case"), PARAMS, ids=[f"W{w}-{c}" for w, c in PARAMS])
def test_sharded_matches_unsharded(world: int, case: str) -> None:
    assert case in CASES
    result = _job(world)
    result.raise_for_failure()
    problems = [f"rank {r}: {v[case]}" for r, v in enumerate(result.values) if v[case] is not None]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", sorted(JOB_CASES), ids=[f"W{w}" for w in sorted(JOB_CASES)])
def test_job_leaves_no_shm(world: int) -> None:
    assert _job(world).leftover_shm == []


@pytest.mark.parametrize(("rows", "cols"), [(50, 7), (37, 5), (64, 3), (1000, 1), (3, 1)])
def test_init_blocks_draw_what_one_call_draws(rows: int, cols: int, monkeypatch) -> None:
    """Row blocks keep torch's CPU normal_ (16 values at a time) and uniform_ streams: the blocked draw
    equals one whole draw, for sizes that leave a tail shorter than 16 elements."""
    target = 48  # elements per block: several blocks for every shape here
    blocks = shard_init.row_blocks(rows, cols, target)
    assert blocks[0][0] == 0 and blocks[-1][1] == rows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
    assert all((r1 - r0) * cols % 16 == 0 for r0, r1 in blocks[:-1])
    for draw in (
        lambda t, g: nn.init.normal_(t, generator=g),
        lambda t, g: nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g),
    ):
        whole = torch.empty(rows, cols)
        draw(whole, torch.Generator().manual_seed(4))
        gen = torch.Generator().manual_seed(4)
        parts = []
        for r0, r1 in blocks:
            part = torch.empty(r1 - r0, cols)
            draw(part, gen)
            parts.append(part)
        assert torch.equal(torch.cat(parts), whole)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: tp_styles.SmptkColwiseParallel(activation="swish"), ("activation", "'swish'")),
        (lambda: tp_styles.SmptkRowwiseParallel(sequence_parallel=1), ("sequence_parallel", "bool")),
        (lambda: tp_styles.SmptkVocabParallel(sequence_dim="1"), ("sequence_dim", "int")),
    ],
)
def test_style_arguments_are_checked(make, words) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        make()
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize(
    ("option", "words"),
    [
        ({"max_norm": 1.0}, ("max_norm=1.0", "expected None")),
        ({"scale_grad_by_freq": True}, ("scale_grad_by_freq=True", "expected False")),
        ({"sparse": True}, ("sparse=True", "expected False")),
        ({"max_norm": 2.0, "sparse": True}, ("max_norm=2.0", "sparse=True")),
    ],
)
def test_from_embedding_refuses_options_naming_the_one_set(option, words) -> None:
    """An nn.Embedding option the layer lacks is refused by name, with the value it needs; the message
    listed all three whatever was set, and neither value."""
    with pytest.raises(ValueError) as info:
        tp.VocabParallelEmbedding.from_embedding(nn.Embedding(4, 3, **option))
    assert all(w in str(info.value) for w in words), str(info.value)
    assert "scale_grad_by_freq" not in str(info.value) or "scale_grad_by_freq" in option


def test_layer_without_state_or_mesh_says_what_to_do(monkeypatch) -> None:
    from smptk.parallel import config

    monkeypatch.setattr(config, "_state", None)
    with pytest.raises(RuntimeError, match=r"smptk\.parallel\.init"):
        tp.ColumnParallelLinear(4, 4)
    with pytest.raises(TypeError, match="1-D DeviceMesh"):
        tp.RowParallelLinear(4, 4, mesh="tp")


def test_a_layer_of_a_destroyed_process_group_refuses_to_run() -> None:
    """A mesh finds its group by name, and names are reused after destroy_process_group: a layer built in
    an earlier job failed with torch's "Could not resolve the process group", or ran on whichever group now
    had its name. It raises, saying the model was built in a destroyed group."""
    from helpers import fake_world

    import smptk.parallel as sp

    with fake_world(4, rank=3):
        sp.init({"tensor_parallel_degree": 2, "mixed_precision": "fp32"})
        layer = tp.ColumnParallelLinear(8, 8)
        assert layer.group is not None
    with fake_world(4, rank=3):
        sp.init({"hybrid_shard_degree": 2, "mixed_precision": "fp32"})
        with pytest.raises(
            RuntimeError, match=r"built for the tensor-parallel group of ranks \[2, 3\].*destroyed"
        ):
            _ = layer.group
        fresh = tp.ColumnParallelLinear(8, 8, mesh=sp.current().submesh("tp"))
        assert fresh.group is not None


def test_sequence_parallel_column_under_autocast_keeps_its_block(monkeypatch) -> None:
    """Under autocast with an fp32 input, the sequence-parallel column layer gathered the fp32 input and
    the GEMM's cast of the gathered tensor made a new one that saved_as_shard does not know: backward kept
    the whole gathered bf16 input (2x this rank's fp32 block at tp 4), not the block the README promises.
    The input is cast first, so the all-gather moves bf16 and backward keeps the bf16 block; and
    last_kernel_path names the GEMM's path (bf16 under the interpreter: torch), not the fp32 input's."""
    from helpers import fake_world

    import smptk.parallel as sp
    from smptk.comm import collectives

    monkeypatch.setattr(collectives, "_heap", lambda group, tensor: None)  # torch's (fake) collectives
    with fake_world(2):
        sp.init({"tensor_parallel_degree": 2, "mixed_precision": "fp32"})
        layer = tp.ColumnParallelLinear(16, 8, sequence_parallel=True)  # sequence_dim 1
        x = torch.randn(2, 4, 16, requires_grad=True)  # this rank's block of a [2, 8, 16] input
        saved = []

        def pack(t):
            saved.append((tuple(t.shape), t.dtype))
            return t

        with (
            torch.autocast("cpu", dtype=torch.bfloat16),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == (2, 8, 4)
        assert (tuple(x.shape), torch.bfloat16) in saved, saved
        assert all(math.prod(shape) <= x.numel() for shape, _ in saved), saved
        if runtime.interpreter_enabled():
            assert layer.last_kernel_path == "torch"


def test_sequence_parallel_column_runs_under_inference_mode(monkeypatch) -> None:
    """Evaluating a sequence-parallel model under torch.inference_mode raised "Inference tensors do not
    track version counter": the column layer's saved_as_shard read the gathered input's version though
    autograd saves nothing there. It steps aside where nothing is saved (no_grad too)."""
    from helpers import fake_world

    import smptk.parallel as sp
    from smptk.comm import collectives

    monkeypatch.setattr(collectives, "_heap", lambda group, tensor: None)  # torch's (fake) collectives
    with fake_world(2):
        sp.init({"tensor_parallel_degree": 2, "mixed_precision": "fp32"})
        layer = tp.ColumnParallelLinear(16, 8, sequence_parallel=True, gather_output=True)
        for mode in (torch.inference_mode, torch.no_grad):
            with mode():
                assert layer(torch.randn(2, 4, 16)).shape == (2, 8, 8)


def test_cross_entropy_names_the_1d_mesh_a_dtensor_needs() -> None:
    """Logits sharded on their vocabulary dim over a 2-D mesh (a tp dim beside a replicated dp dim) were
    refused with 'must be sharded on its last (vocabulary) dim, got placements (Replicate(), Shard(dim=1))',
    which they are; the message now says the mesh must be 1-D (the tensor-parallel group) and names its."""
    from helpers import fake_world
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from smptk.parallel import vocab_parallel_cross_entropy

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        logits = DTensor.from_local(torch.randn(3, 4), mesh, [Replicate(), Shard(1)], run_check=False)
        with pytest.raises(
            ValueError, match=r"over a 1-D mesh \(the tensor-parallel group\).* over a 2-D mesh"
        ):
            vocab_parallel_cross_entropy(logits, torch.zeros(3, dtype=torch.int64))
