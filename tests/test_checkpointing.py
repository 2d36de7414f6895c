"""smptk.parallel.apply_activation_checkpointing and smptk.parallel.materialize in one process.

Checkpointing: gradients equal the model without it, bit for bit (the recompute runs the same CPU ops on
the same inputs); "full" recomputes each block's forward in backward (its forward hook runs again and
``aten.addmm``, the linears' forward op, reappears in backward), "selective" recomputes the block but
keeps the matrix products' outputs (no ``addmm`` in backward), smptk's Triton GEMMs included (their
forwards are the dispatcher ops ``torch.ops.smptk.*`` under the policy's mode: none runs again in
backward); the units, names and errors.
Materialize: a meta-built model (smptk's ColumnParallelLinear among torch layers) gets memory on the
state's device and the values of the same resets run under the state's seed on a CPU-built copy.
The multi-rank composition with FSDP2 (meta build, checkpointing, sharding, materialize, train) is
``delayed_init_ac`` in tests/test_fsdp.py.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import skip_unless_triton_on_cpu
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import smptk.parallel as parallel
from smptk.kernels import runtime
from smptk.parallel import ParallelConfig, apply_activation_checkpointing, checkpointing, materialize


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 6)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class QuietBlock(Block):
    """A Block that counts nothing (a compiled block's counter is a guard: each call would recompile)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, blocks: int = 2, block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.blocks = nn.ModuleList([block() for _ in range(blocks)])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _model(blocks: int = 2, block: type[nn.Module] = Block) -> Model:
    torch.manual_seed(0)
    return Model(blocks, block)


def _backward_ops(model: Model) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """Ops dispatched during backward, and the gradients."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    loss = model(x).square().sum()
    counter = _CountOps()
    with counter:
        loss.backward()
    return counter.counts, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_gradients_equal_and_what_is_recomputed(mode: str) -> None:
    plain = _model()
    ops_plain, grads_plain = _backward_ops(plain)
    model = _model()
    assert apply_activation_checkpointing(model, mode=mode) == ["blocks.0", "blocks.1"]
    ops, grads = _backward_ops(model)
    for name, g in grads_plain.items():
        assert torch.equal(grads[name], g), name
    assert [b.calls for b in model.blocks] == [2, 2], "each block's forward runs again in backward"
    assert ops_plain.get("addmm", 0) == 0
    # "full" recomputes each block's up projection (the down projection's output is not needed by backward,
    # and torch's checkpoint stops its recompute once it has what backward needs); "selective" keeps it
    assert ops.get("addmm", 0) == (2 if mode == "full" else 0), ops
    assert ops.get("gelu", 0) == 2, "selective recomputes the activation functions too"


class KernelBlock(nn.Module):
    """A block on smptk's Triton kernels: fused_linear (bias + GELU), swiglu, and a MoE layer with a shared
    expert (grouped_swiglu, grouped_linear, and the shared expert's swiglu / fused_linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 12)
        self.gate = nn.Linear(12, 10, bias=False)
        self.lin = nn.Linear(12, 10, bias=False)
        self.down = nn.Linear(10, 8, bias=False)
        self.moe = parallel.MoE(8, 6, num_experts=3, top_k=2, num_shared_experts=1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from smptk.kernels import fused_linear, swiglu

        self.calls += 1
        h = fused_linear(x, self.up.weight, self.up.bias, activation="gelu")
        x = x + fused_linear(torch.sin(swiglu(h, self.gate.weight, self.lin.weight)), self.down.weight)
        return x + self.moe(x)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_selective_keeps_smptk_kernel_outputs(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """smptk's forwards are dispatcher ops while a mode is active (smptk.kernels._dispatch), so the selective
    policy keeps their outputs: backward launches no forward GEMM. "full" launches them all again."""
    skip_unless_triton_on_cpu(monkeypatch)
    torch.manual_seed(0)
    plain = nn.Sequential(KernelBlock(), KernelBlock())
    model = copy.deepcopy(plain)
    assert apply_activation_checkpointing(model, mode=mode, modules=["0", "1"]) == ["0", "1"]
    x = torch.randn(7, 8, generator=torch.Generator().manual_seed(1))
    plain(x).square().sum().backward()
    loss = model(x).square().sum()
    counter = _CountOps()
    with counter:
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert [b.calls for b in model] == [2, 2], "each block's forward runs again in backward"
    forwards = ("fused_linear_fwd", "swiglu_fwd", "grouped_swiglu_fwd", "grouped_linear_fwd")
    recomputed = {op: counter.counts.get(op, 0) for op in forwards}
    # per block: up and down (fused_linear) + the shared expert's down; swiglu + the shared expert's; the
    # routed experts' grouped pair
    expected = {"fused_linear_fwd": 6, "swiglu_fwd": 4, "grouped_swiglu_fwd": 2, "grouped_linear_fwd": 2}
    assert recomputed == (expected if mode == "full" else dict.fromkeys(forwards, 0)), recomputed


SELECTIVE_INDUCTOR_FIRST_CALL = textwrap.dedent(
    """
    import torch
    from torch import nn
    from smptk.kernels import fused_linear, grouped_linear, grouped_swiglu, swiglu
    from smptk.parallel import apply_activation_checkpointing

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.wg, self.wu = nn.Parameter(torch.randn(10, 6) / 3), nn.Parameter(torch.randn(10, 6) / 3)
            self.wd, self.b = nn.Parameter(torch.randn(6, 10) / 3), nn.Parameter(torch.randn(6))
            self.eg, self.eu = nn.Parameter(torch.randn(2, 4, 6) / 3), nn.Parameter(torch.randn(2, 4, 6) / 3)
            self.ed = nn.Parameter(torch.randn(2, 6, 4) / 3)

        def forward(self, x):
            x = x + fused_linear(swiglu(x, self.wg, self.wu), self.wd, self.b, activation="gelu")
            offsets = torch.tensor([0, 2, x.shape[0]])
            return x + grouped_linear(grouped_swiglu(x, self.eg, self.eu, offsets), self.ed, offsets)

    def grads(compiled):
        torch.manual_seed(0)
        model = nn.Sequential(Block(), Block())
        if compiled:
            apply_activation_checkpointing(model, mode="selective")
            for block in model:
                block.compile()  # Inductor
        model(torch.randn(5, 6, generator=torch.Generator().manual_seed(1))).square().sum().backward()
        return [p.grad for p in model.parameters()]

    got = grads(compiled=True)  # the process's first calls: compiled, under the policy
    want = grads(compiled=False)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), "gradients differ"
    print("SAC INDUCTOR OK")
    """
)


@pytest.mark.skipif(not runtime.triton_available(), reason="triton is not installed: no interpreter")
@pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="Inductor needs a C++ compiler on CPU"
)
def test_selective_with_inductor_compiled_blocks_in_a_fresh_process() -> None:
    """README's recipe, blocks compiled in place by Inductor under "selective", in a fresh process (the
    first calls compile; Dynamo's caches are empty): the first block's input needs no gradient, so the
    Triton ops' Functions save a stand-in (``saved_if``: ``aten.new_empty`` and ``expand``) for the
    weights' inputs. Dynamo compiled the Functions' forwards in pieces around the launch, the stand-in ran
    inside Inductor's code in forward, unseen by the checkpoint, and eagerly in the recompute, so backward
    raised "aten.new_empty.default encountered during backward but not found in storage" for all four
    ops. The Functions now run outside the graph; the gradients equal eager's without checkpointing."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMPTK_", "TORCH_", "TORCHINDUCTOR_"))}
    env.update(PYTHONPATH=str(root), TRITON_INTERPRET="1", SMPTK_KERNELS="triton")
    proc = subprocess.run(
        [sys.executable, "-c", SELECTIVE_INDUCTOR_FIRST_CALL],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0 and "SAC INDUCTOR OK" in proc.stdout, proc.stderr[-3000:]


def test_selective_policy_lists_smptk_ops() -> None:
    import smptk.comm.functional  # registers the collectives' ops
    import smptk.comm.fused_linear  # noqa: F401  (registers the fused tensor-parallel linears' ops)
    from smptk.parallel.checkpointing import SAVED_OPS, saved_ops

    names = {op.name() for op in saved_ops() - SAVED_OPS}
    kernels = ("fused_linear_fwd", "swiglu_fwd", "grouped_linear_fwd", "grouped_swiglu_fwd")
    comm = ("reduce_scatter", "all_reduce", "all_to_all")
    fused = ("all_gather_linear_fwd", "linear_reduce_scatter_fwd")
    assert names >= {f"smptk::{n}" for n in kernels + comm + fused}, names
    assert all(n.startswith("smptk::") for n in names)
    # an all-gather's output is W times its input: recomputed (gathered again), not kept
    assert "smptk::all_gather" not in names and torch.ops.smptk.all_gather.default not in saved_ops()
    assert torch.ops._c10d_functional.all_gather_into_tensor.default not in saved_ops()
    assert torch.ops.aten.mm.default in saved_ops()


def test_none_mode_and_the_config_mode() -> None:
    model = _model()
    assert apply_activation_checkpointing(model, mode="none") == []
    _, _ = _backward_ops(model)
    assert [b.calls for b in model.blocks] == [1, 1]
    state = types.SimpleNamespace(config=ParallelConfig(activation_checkpointing=True))  # read as "full"
    assert apply_activation_checkpointing(_model(), state) == ["blocks.0", "blocks.1"]


def test_units_nested_and_named() -> None:
    model = _model()
    names = apply_activation_checkpointing(model, mode="full", modules=["blocks.1.up", "blocks.1", "head"])
    assert names == ["blocks.1", "head"], "blocks.1.up is inside blocks.1, which recomputes it anyway"


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="mode: expected one of 'none', 'full', 'selective', got 'all'"):
        apply_activation_checkpointing(_model(), mode="all")
    with pytest.raises(TypeError, match=r"model: expected an nn\.Module"):
        apply_activation_checkpointing([1], mode="full")
    model = _model()
    apply_activation_checkpointing(model, mode="full")
    with pytest.raises(ValueError, match=r"'blocks\.0' is checkpointed already"):
        apply_activation_checkpointing(model, mode="selective")


@pytest.mark.parametrize("horizon", [1, 2, 3])
def test_offloading_moves_inputs_out_and_back_ahead(horizon: int) -> None:
    """offload_cpu: the CPU run of the GPU bookkeeping. Each block's kept input is stored (one host copy
    per block, in forward order); backward loads the last block's on demand and each block's
    predecessors up to horizon - 1 ahead; gradients stay bit-equal; a second step repeats it."""
    plain = _model(4)
    apply_activation_checkpointing(plain, mode="full")
    _, grads_plain = _backward_ops(plain)
    model = _model(4)
    off = parallel.ActivationOffloader(horizon, offload_cpu=True)
    assert apply_activation_checkpointing(model, mode="full", offloader=off) == [
        f"blocks.{i}" for i in range(4)
    ]
    for step in range(2):
        off.log.clear()
        for p in model.parameters():
            p.grad = None
        _, grads = _backward_ops(model)
        for name, g in grads_plain.items():
            assert torch.equal(grads[name], g), (step, name)
        stores, loads = list(off.log)[:4], list(off.log)[4:]
        assert stores == [("store", i) for i in range(4)], off.log
        # on demand: block i when no earlier unpack prefetched it; prefetch: the horizon - 1 blocks before
        expected, loaded = [], set()
        for i in (3, 2, 1, 0):
            if i not in loaded:
                expected.append(("load", i, "on demand"))
                loaded.add(i)
            for j in range(i - 1, max(i - horizon, -1), -1):
                if j not in loaded:
                    expected.append(("load", j, "prefetch"))
                    loaded.add(j)
        assert loads == expected, (horizon, off.log)


def test_offloading_brings_a_units_other_inputs_before_the_next_unit() -> None:
    """Units that save two inputs (a Llama block's hidden state and its rotary tables): backward's first
    read of a unit loads that tensor on demand, then prefetches the unit's other input, then the unit
    before (it prefetched the unit before first, and the unit's own other input came on demand, on the
    compute stream, after it)."""

    class TwoInputs(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.inner(x) * scale

    model = _model(3)
    model.blocks = nn.ModuleList([TwoInputs(b) for b in model.blocks])
    scale = torch.full((6,), 1.5)

    def forward(x):
        x = model.inp(x)
        for b in model.blocks:
            x = b(x, scale + 0)  # a fresh tensor per block, saved by that block
        return model.head(x)

    model.forward = forward
    off = parallel.ActivationOffloader(2, offload_cpu=True)
    apply_activation_checkpointing(model, mode="full", offloader=off)
    model(torch.randn(5, 4, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    loads = [e for e in off.log if e[0] == "load"]
    assert loads == [
        ("load", 2, "on demand"), ("load", 2, "prefetch"), ("load", 1, "prefetch"), ("load", 1, "prefetch"),
        ("load", 0, "prefetch"), ("load", 0, "prefetch"),
    ], off.log  # fmt: skip


def test_offloading_one_backward_over_two_forwards() -> None:
    """Two forwards, then one backward over both (two micro-batches' losses summed): gradients equal the
    plain model's, every stored input comes back once (the first forward's last block is prefetched from
    the second's first), and no host copy stays listed after backward."""
    plain, model = _model(4), _model(4)
    off = parallel.ActivationOffloader(2, offload_cpu=True)
    apply_activation_checkpointing(model, mode="full", offloader=off)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(5, 4, generator=gen), torch.randn(5, 4, generator=gen)
    (plain(a).square().sum() + 2 * plain(b).square().sum()).backward()
    (model(a).square().sum() + 2 * model(b).square().sum()).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-6), name
    stores = [e for e in off.log if e[0] == "store"]
    loads = [e for e in off.log if e[0] == "load"]
    assert len(stores) == 8 and len(loads) == 8, off.log
    assert not any(off._away.values()), "host copies still listed after backward"
    assert off.log.maxlen == checkpointing.LOG_ENTRIES  # a long run keeps the latest events, not all


def test_offloading_keeps_the_value_a_unit_saw_under_a_later_in_place_write() -> None:
    """An in-place write to a block's input after the block: plain checkpointing reports it in backward;
    with offloading torch checks nothing (saved-tensor hooks), so the offloader makes the host copy final
    before anything after the block runs (on a GPU the compute stream waits for the copy where the block
    ends) and backward gives the gradients of the forward that ran (the block's input as it saw it)."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def run(model, write: bool):
        h = model.inp(x)
        y = model.blocks[0](h)
        if write:
            h.mul_(3)  # after the block: the block saw h before this write
        model.blocks[1](y).square().sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = run(_model(), write=False)
    plain = _model()
    apply_activation_checkpointing(plain, mode="full")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(plain, write=True)
    model = _model()
    off = parallel.ActivationOffloader(2, offload_cpu=True)
    apply_activation_checkpointing(model, mode="full", offloader=off)
    got = run(model, write=True)
    assert want.keys() == got.keys() and want
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("where", ["after", "inside"])
def test_offloading_checks_the_version_of_what_it_leaves_in_place(where: str) -> None:
    """What the offloader does not move (a CPU tensor without ``offload_cpu``, as the config's offloading
    runs on a CPU; parameters; empty tensors) it hands back as saved, and torch checks no version of what
    saved-tensor hooks keep: an in-place write to a block's input after the block, or inside it, gave
    gradients off by up to 2.2 (against the unchecked model's) without an error, where plain
    checkpointing raises. The offloader raises the same error, naming the unit; a parameter given
    positionally and written in place before backward raises too."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))

    class WritesInput(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            if where == "inside":
                h.mul_(2)
            return self.inner(h)

    def run(off: parallel.ActivationOffloader | None) -> None:
        model = _model()
        model.blocks = nn.ModuleList([WritesInput(b) for b in model.blocks])
        apply_activation_checkpointing(model, mode="full", offloader=off)
        h = model.inp(x)
        y = model.blocks[0](h)
        if where == "after":
            h.mul_(3)
        model.blocks[1](y).square().sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(None)
    cfg = ParallelConfig(activation_checkpointing="full", sm_activation_offloading=True)
    off = parallel.ActivationOffloader(cfg.activation_loading_horizon)  # what the config builds
    unit = 0 if where == "after" else 1  # inside: both blocks write, and backward reaches block 1 first
    with pytest.raises(
        RuntimeError, match=rf"modified by an inplace operation: .*input of unit {unit} \(\[5, 6\]"
    ):
        run(off)
    assert off.log.maxlen and not off.log, "CPU tensors stay where they are"

    model = _model(1)
    scale = nn.Parameter(torch.full((6,), 1.5))
    block = model.blocks[0]
    model.blocks[0].forward = lambda h, s: Block.forward(block, h) * s
    apply_activation_checkpointing(
        model, mode="full", offloader=parallel.ActivationOffloader(2, offload_cpu=True)
    )
    y = model.blocks[0](model.inp(x), scale)
    with torch.no_grad():
        scale.add_(1.0)  # an optimizer step between forward and backward
    with pytest.raises(
        RuntimeError, match=r"input of unit 0 \(\[6\], torch.float32, on cpu, not offloaded\)"
    ):
        y.sum().backward()


def test_offloading_brings_inputs_back_with_their_strides() -> None:
    """An input comes back from the host with the strides it was saved with (a transposed tensor, a view
    with gaps, a column of an integer table): the recompute sees the layout the forward saw, and the
    gradients equal plain checkpointing's bit for bit. Before, a view with gaps came back packed (strides
    (1, 2) for (1, 6)) and its sum rounded differently: gradients off by 2.5e-7 relative, 0.25 absolute."""

    class Strided(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner
            self.strides: list[tuple] = []

        def forward(self, h, view, transposed, ids):
            self.strides.append((view.stride(), transposed.stride(), ids.stride()))
            return self.inner(h)[ids] * view.sum() + transposed.sum(0)

    def run(off: parallel.ActivationOffloader | None) -> tuple[dict, list]:
        model = _model(3)
        model.blocks = nn.ModuleList([Strided(b) for b in model.blocks])
        apply_activation_checkpointing(model, mode="full", offloader=off)
        h = model.inp(torch.randn(5, 4, generator=torch.Generator().manual_seed(1)))
        table = torch.tensor([[0, 4], [2, 3], [4, 2], [1, 1], [3, 0]])
        for block in model.blocks:
            wide = h * 1.0
            h = block(h, wide.t()[1:3], (h * 2.0).t().contiguous().t(), table[:, 1])
        model.head(h).square().sum().backward()
        return _grads(model), [b.strides for b in model.blocks]

    want, strides = run(None)
    off = parallel.ActivationOffloader(2, offload_cpu=True)
    got, strides_off = run(off)
    assert sum(e[0] == "store" for e in off.log) == 12, off.log  # h, the view, the transposed, the ids
    assert strides_off == strides and strides[0][0] == ((1, 6), (1, 5), (2,)), strides
    for name, g in want.items():
        assert torch.equal(got[name], g), name


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _records_held(off: parallel.ActivationOffloader) -> int:
    """Inputs the offloader still lists as away whose host copies are alive."""
    return sum(ref() is not None for refs in off._away.values() for ref in refs)


def test_offloading_two_micro_batches_in_flight_keeps_each_backward_to_its_own_forward() -> None:
    """F1 F2 B1 B2 (a 1F1B pipeline stage; every forward, then each loss's backward): B1 loads F1's inputs
    only, on demand and then prefetched, so at most ``horizon`` blocks' inputs are on the device; F2's stay
    on the host until B2 loads them the same way (B1 used to prefetch F2's by block index and hold every
    one of them to B2). Gradients equal the plain model's, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(5, 4, generator=gen), torch.randn(5, 4, generator=gen)
    plain = _model(4)
    plain(a).square().sum().backward()
    plain(b).square().sum().backward()
    model = _model(4)
    off = parallel.ActivationOffloader(2, offload_cpu=True)
    apply_activation_checkpointing(model, mode="full", offloader=off)
    loss_a, loss_b = model(a).square().sum(), model(b).square().sum()
    one_backward = [("load", 3, "on demand")] + [("load", i, "prefetch") for i in (2, 1, 0)]
    off.log.clear()
    loss_a.backward()
    assert list(off.log) == one_backward, off.log
    assert _records_held(off) == 4 and all(r().back is None for refs in off._away.values() for r in refs)
    off.log.clear()
    loss_b.backward()
    assert list(off.log) == one_backward, off.log
    assert _records_held(off) == 0
    for name, g in _grads(plain).items():
        assert torch.equal(_grads(model)[name], g), name


def test_offloading_follows_call_order_and_frees_a_dropped_graphs_copies() -> None:
    """Prefetch goes by the order the blocks ran, not the order they were registered: blocks called last
    to first still have their inputs prefetched one block ahead (they all came on demand). A graph
    dropped without backward takes its host copies with it."""
    model = _model(4)
    off = parallel.ActivationOffloader(2, offload_cpu=True)
    apply_activation_checkpointing(model, mode="full", offloader=off)

    def backwards(x):
        h = model.inp(x)
        for blk in reversed(model.blocks):
            h = blk(h)
        return model.head(h)

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    backwards(x).square().sum().backward()
    assert [e for e in off.log if e[0] == "load"] == [
        ("load", 0, "on demand"), ("load", 1, "prefetch"), ("load", 2, "prefetch"), ("load", 3, "prefetch")
    ], off.log  # fmt: skip
    loss = model(x).sum()
    assert _records_held(off) == 4
    del loss
    assert _records_held(off) == 0


def test_offloading_refuses_an_in_place_write_through_aliased_inputs() -> None:
    """A block given two inputs that share memory (``t`` and ``t[:, :3]``) that writes one in place: the
    host copies are separate tensors, so the recompute would not see the write through the other (the
    gradients came out wrong by up to 1e2, silently); plain checkpointing raises in backward, the
    offloader where the block's forward ends. One input written in place stays exact (the recompute
    starts from the value the block saw)."""

    class Pair(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            x.mul_(2)
            return self.inner(x) * y.sum(-1, keepdim=True)

    model = _model(2)
    model.blocks = nn.ModuleList([Pair(b) for b in model.blocks])
    off = parallel.ActivationOffloader(2, offload_cpu=True)
    apply_activation_checkpointing(model, mode="full", offloader=off)
    t = model.inp(torch.randn(5, 4, generator=torch.Generator().manual_seed(1))) * 1.0
    with pytest.raises(RuntimeError, match="wrote in place to one of 2 inputs that share memory"):
        model.blocks[0](t, t[:, :3])
    y = model.blocks[0](t * 1.0, t.detach()[:, :3].clone())  # separate memory: offloaded, no error
    assert y.shape == (5, 6)


def test_offloading_leaves_parameters_and_warns_about_keyword_inputs() -> None:
    """What torch's checkpoint keeps in its recompute (keyword arguments, tensors inside tuples) is not
    offloaded: a block that gets its hidden state that way warns once (it used to offload nothing,
    silently); a parameter given positionally is not copied (it stays on the device anyway); blocks
    with positional inputs warn about nothing."""

    class Keyword(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x=None, scale=None):
            return self.inner(x) * scale

    model = _model(2)
    model.blocks = nn.ModuleList([Keyword(b) for b in model.blocks])
    scale = nn.Parameter(torch.full((6,), 1.5))
    off = parallel.ActivationOffloader(2, offload_cpu=True)
    apply_activation_checkpointing(model, mode="full", offloader=off)
    h = model.inp(torch.randn(5, 4))
    with pytest.warns(UserWarning, match="unit 0 .*keyword arguments or inside containers.*nothing of it"):
        model.blocks[0](x=h, scale=scale)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.blocks[0](x=h, scale=scale)  # once per unit
        off.log.clear()
        model.blocks[1](h * 1.0, scale).sum().backward()
    assert [e for e in off.log if e[0] == "store"] == [("store", 1)], off.log  # h, not the parameter


def _steps_with_stats(model: Model, off: parallel.ActivationOffloader | None, compiled: bool) -> tuple:
    """Three steps of ``model`` (its blocks compiled in place when ``compiled``, Dynamo's caches fresh):
    each step's offload log and gradients, then Dynamo's graph count and graph breaks."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    if compiled:
        for block in model.blocks:
            block.compile(backend="aot_eager")
    gen, steps = torch.Generator().manual_seed(2), []
    try:
        for _ in range(3):
            model.zero_grad()
            if off is not None:
                off.log.clear()
            model(torch.randn(5, 4, generator=gen)).square().sum().backward()
            steps.append((list(off.log) if off is not None else None, _grads(model)))
        return steps, counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_offloading_under_block_compile_adds_no_graphs(mode: str) -> None:
    """Blocks compiled in place (``block.compile()``, as the README advises with checkpointing) keep their
    offloading, with the graphs and graph breaks of the same blocks compiled without it: the offloader's
    hooks run outside the compiled code (before, they broke each block's graph 7 times a step and
    recompiled it on the offloader's entry counter, until the cache limit sent it back to eager). The
    stores and loads, in order, and the gradients are the eager model's."""
    runs = {}
    for name, compiled, offload in (("eager", False, True), ("plain", True, False), ("offload", True, True)):
        model = _model(3, QuietBlock)
        off = parallel.ActivationOffloader(2, offload_cpu=True) if offload else None
        apply_activation_checkpointing(model, mode=mode, offloader=off)
        runs[name] = _steps_with_stats(model, off, compiled)
    (eager, _, _), (_, graphs, breaks), (steps, graphs_off, breaks_off) = runs.values()
    assert (graphs_off, breaks_off) == (graphs, breaks)
    for (log, grads), (log_eager, grads_eager) in zip(steps, eager, strict=True):
        assert log == log_eager and ("load", 0, "prefetch") in log, log
        for name, g in grads.items():
            torch.testing.assert_close(g, grads_eager[name], rtol=1e-6, atol=1e-6, msg=name)


def test_offloading_from_the_config_and_bad_arguments() -> None:
    cfg = ParallelConfig(activation_checkpointing="selective", sm_activation_offloading=True)
    model = _model()
    apply_activation_checkpointing(model, types.SimpleNamespace(config=cfg))  # CPU tensors: nothing moves
    _, grads = _backward_ops(model)
    _, grads_plain = _backward_ops(_model())
    for name, g in grads_plain.items():
        assert torch.equal(grads[name], g), name
    for bad in (0, -1):
        with pytest.raises(ValueError, match=r"horizon: expected an int >= 1, got -?[01]"):
            parallel.ActivationOffloader(bad)
    for bad in (1.5, 2.0, True, "2"):
        with pytest.raises(TypeError, match=r"horizon: expected an int >= 1, got (float|bool|str)"):
            parallel.ActivationOffloader(bad)
    with pytest.raises(TypeError, match="offloader: expected an ActivationOffloader"):
        apply_activation_checkpointing(_model(), mode="full", offloader="cpu")


@pytest.fixture
def world1(tmp_path):
    assert not dist.is_initialized(), "another test left a process group initialized"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield parallel.init({"delayed_parameter_initialization": True, "random_seed": 7})
    finally:
        parallel.reset()
        dist.destroy_process_group()


def test_offloading_moves_a_dtensor_inputs_local_shard(world1) -> None:
    """A block given a DTensor positionally (torch's sequence-parallel styles hand blocks DTensors): the
    offloader copies its local shard to a plain host tensor (the CUDA path pins one: copying a DTensor
    into it raised "got mixed torch.Tensor and DTensor"; the CPU path kept a DTensor "host copy") and
    rebuilds the DTensor around the shard on the way back. Gradients equal plain checkpointing's."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))

    class Elementwise(nn.Module):  # DTensor ops all through (a block's plain parameters would mix types)
        def forward(self, x):
            return x * x.sin() + x.cos()

    def run(off: parallel.ActivationOffloader | None) -> tuple[torch.Tensor, list]:
        blocks = nn.Sequential(Elementwise(), Elementwise())
        apply_activation_checkpointing(blocks, mode="full", modules=["0", "1"], offloader=off)
        x = distribute_tensor(torch.randn(5, 6, generator=torch.Generator().manual_seed(1)), mesh, [Shard(0)])
        x.requires_grad_()
        y = blocks(x * 1.0)
        hosts = [] if off is None else [r().host for refs in off._away.values() for r in refs]
        y.to_local().square().sum().backward()
        return x.grad.to_local(), hosts

    want, _ = run(None)
    off = parallel.ActivationOffloader(2, offload_cpu=True)
    got, hosts = run(off)
    assert len(hosts) == 2 and all(type(t) is torch.Tensor for t in hosts), [type(t) for t in hosts]
    assert [e[0] for e in off.log] == ["store", "store", "load", "load"], off.log
    assert torch.equal(got, want)


class DropoutBlock(nn.Module):
    """torch's dropouts (nn.Dropout, F.dropout, attention dropout inside SDPA) and one inside the state's
    ``fork_rng("tp")`` region (a sequence-parallel activation's), each mask recorded."""

    def __init__(self, state: parallel.ParallelState) -> None:
        super().__init__()
        self.state = state
        self.qkv = nn.Linear(8, 24)
        self.up = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)
        self.masks: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 4).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.25, is_causal=True)
        x = x + self.drop(a.transpose(1, 2).reshape(x.shape))
        with self.state.fork_rng("tp"):
            h = torch.nn.functional.dropout(self.up(x), 0.4)
        self.masks.append(h == 0)
        return x + torch.nn.functional.dropout(torch.nn.functional.gelu(h), 0.2)


@pytest.mark.parametrize("offload", [False, True], ids=["", "offloaded"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_dropout_masks_and_gradients_as_without_checkpointing(world1, mode: str, offload: bool) -> None:
    """The recompute draws the forward's masks: torch's dropouts (the checkpoint restores the default
    generators) and those of a ``fork_rng`` region (its seed is a draw of the default generator), so the
    losses and gradients of two steps equal the model's without checkpointing bit for bit; the region draws
    a new mask in every block and step."""

    def steps(mode: str) -> tuple[list, list]:
        torch.manual_seed(0)
        blocks = [DropoutBlock(world1) for _ in range(2)]
        model = nn.Sequential(nn.Linear(4, 8), *blocks)
        if mode != "none":
            off = parallel.ActivationOffloader(2, offload_cpu=True) if offload else None
            assert apply_activation_checkpointing(model, mode=mode, modules=[DropoutBlock], offloader=off)
        x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(3)
        out = []
        for _ in range(2):
            loss = model(x).square().sum()
            loss.backward()
            out.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
            model.zero_grad()
        return out, [m for b in blocks for m in b.masks[::-1][:2]]

    plain, plain_masks = steps("none")
    got, _ = steps(mode)
    for (loss, grads), (ref_loss, ref_grads) in zip(got, plain, strict=True):
        assert torch.equal(loss, ref_loss)
        for name, g in ref_grads.items():
            assert torch.equal(grads[name], g), name
    assert len({m.numpy().tobytes() for m in plain_masks}) == 4, "a new mask per block and step"


class WithTP(nn.Module):
    def __init__(self, device=None) -> None:
        super().__init__()
        self.body = Model()
        self.col = parallel.ColumnParallelLinear(3, 8, device=device)


def test_materialize_meta_model(world1) -> None:
    with torch.device("meta"):
        model = WithTP(device="meta")
    assert all(p.is_meta for p in model.parameters())
    ran = materialize(model, world1)
    assert ran == sum(callable(getattr(m, "reset_parameters", None)) for m in model.modules())
    assert all(p.device.type == "cpu" and not p.is_meta for p in model.parameters())
    # the values of the same resets under the state's seed, on a model built on the CPU (smptk's layers
    # drawing from the default generator as well)
    ref = WithTP()
    torch.manual_seed(world1.seed_for())
    for m in ref.modules():
        if isinstance(m, parallel.ColumnParallelLinear):
            m.reset_parameters(torch.default_generator)
        elif callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        q = q.full_tensor() if hasattr(q, "full_tensor") else q
        assert torch.equal(p, q), name
    assert torch.isfinite(model.body.blocks[0].norm.weight).all()


def test_delayed_init_key_warns_about_a_real_model(world1) -> None:
    """delayed_parameter_initialization set (world1's config) and a model built with real parameters:
    apply_data_parallel says so; a meta-built model passes without a warning."""
    from smptk.parallel.fsdp import apply_data_parallel

    with pytest.warns(UserWarning, match=r"delayed_parameter_initialization is set, but .* allocated"):
        apply_data_parallel(_model(), world1)
    with torch.device("meta"):
        model = WithTP(device="meta")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*delayed_parameter_initialization")
        model, _ = apply_data_parallel(model, world1)
    assert materialize(model, world1) > 0


def test_materialize_refuses_a_module_it_cannot_initialize(world1) -> None:
    """A module with a parameter of its own and no reset_parameters (a hand-written norm, say) would keep
    to_empty's uninitialized memory (the example's RMSNorm did: NaN losses): refused, naming it, before
    anything is allocated."""

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(ValueError, match=r"model: 1 hold parameters or buffers but have no reset_parameters"):
        materialize(model, world1)
    assert all(p.is_meta for p in model.parameters()), "nothing was allocated"


def test_materialize_refuses_the_meta_device(world1) -> None:
    """device="meta" gave torch's "Cannot copy out of meta tensor; no data!" from inside the resets (a
    NotImplementedError, after to_empty had run): now refused, naming ``device``, with the model untouched."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    for device in ("meta", torch.device("meta")):
        with pytest.raises(ValueError, match=r"device: expected a device with memory .*, got meta"):
            materialize(model, world1, device=device)
    assert all(p.is_meta for p in model.parameters()), "nothing was allocated"


@pytest.mark.parametrize(
    "extra",
    [{}, {"tie_word_embeddings": True}, {"pad_token_id": 3, "attention_bias": True, "mlp_bias": True}],
    ids=["untied", "tied", "padded_with_biases"],
)
def test_materialize_gives_a_hugging_face_model_its_eager_values(world1, extra: dict) -> None:
    """A Hugging Face Llama built on meta for training from scratch was refused (its RMSNorms have no
    reset_parameters), and with allow_uninitialized its norms stayed NaN and its Linear / Embedding layers
    got torch's default init (the embedding N(0, 1), not N(0, initializer_range)). materialize now replays
    the eager construction: torch's resets, then each model's post_init() (_init_weights) where its
    constructor ends. Every parameter and buffer equals the eager build from the same seed, ties hold."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        **extra,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    assert materialize(model, world1) == 9  # the embedding, 7 projections and the head
    torch.manual_seed(world1.seed_for())
    eager = transformers.LlamaForCausalLM(cfg)
    got = dict(
        (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
    )
    want = dict(
        (*eager.named_parameters(remove_duplicate=False), *eager.named_buffers(remove_duplicate=False))
    )
    assert got.keys() == want.keys()
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == cfg.tie_word_embeddings
    assert abs(model.model.layers[0].mlp.up_proj.weight.std().item() - cfg.initializer_range) < 0.005
    assert all(getattr(m, "_is_hf_initialized", False) for m in model.modules())


def test_materialize_refuses_parameters_no_reset_wrote(world1) -> None:
    """A subclass that adds parameters and inherits its parent's reset_parameters (LoRA-style) passed the
    check above, and its extra parameters kept to_empty's memory; now they are named after the resets."""

    class LoRALinear(nn.Linear):
        def __init__(self, n: int) -> None:
            super().__init__(n, n)
            self.lora_a = nn.Parameter(torch.zeros(2, n))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), LoRALinear(4))
    with pytest.raises(RuntimeError, match=r"no reset_parameters\(\) gave 1\.lora_a values"):
        materialize(model, world1)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), LoRALinear(4))
    materialize(model, world1, allow_uninitialized=True)  # a checkpoint load follows


def test_materialize_keeps_tied_parameters_tied_with_the_eager_values(world1) -> None:
    """to_empty unties a shared parameter, and a second reset of it overwrote the first owner's values:
    now it stays one tensor holding what the eager build gives (tied after both modules were built)."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(6, 4)
            self.head = nn.Linear(4, 6, bias=False)
            self.head.weight = self.emb.weight
            self.after = nn.Linear(4, 3)  # the head's draw still happens: the layers after it agree too

    with torch.device("meta"):
        model = Tied()
    materialize(model, world1)
    assert model.head.weight is model.emb.weight
    torch.manual_seed(world1.seed_for())
    ref = Tied()
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_materialize_keeps_a_shared_buffer_shared(world1) -> None:
    """A table the model registers in every layer too (one tensor, refilled by the model's reset): to_empty
    gave each layer a copy of its own, which no reset wrote, and materialize refused the model naming
    ``layers.0.slopes`` (allow_uninitialized left the copies NaN). Now it stays one tensor, and a layer
    whose only own tensor it is still runs its reset (the model's write is no reason to skip it)."""

    class Attn(nn.Module):
        def __init__(self, slopes: torch.Tensor) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.register_buffer("slopes", slopes, persistent=False)
            self.reset_parameters()

        def reset_parameters(self) -> None:
            nn.init.zeros_(self.proj.bias)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("slopes", torch.linspace(0, 1, 4), persistent=False)
            self.layers = nn.ModuleList([Attn(self.slopes), Attn(self.slopes)])

        def reset_parameters(self) -> None:
            self.slopes.copy_(torch.linspace(0, 1, 4))

    with torch.device("meta"):
        lazy = Net()
    materialize(lazy, world1)
    assert all(layer.slopes is lazy.slopes for layer in lazy.layers)
    torch.manual_seed(world1.seed_for())
    eager = Net()
    assert not eager.layers[1].proj.bias.any()
    for name, want in (*eager.named_parameters(), *eager.named_buffers(remove_duplicate=False)):
        assert torch.equal(lazy.get_buffer(name) if "slopes" in name else lazy.get_parameter(name), want), (
            name
        )


def test_materialize_resets_a_moe_once(world1) -> None:
    """MoE's reset_parameters resets its experts; materialize reset the experts module again (a second
    draw), so the experts and every later layer differed from the eager build."""

    def build() -> nn.Module:
        return nn.Sequential(parallel.MoE(8, 16, 4, 2, num_shared_experts=1), nn.Linear(8, 3))

    with torch.device("meta"):
        lazy = build()
    materialize(lazy, world1)
    torch.manual_seed(world1.seed_for())
    eager = build()
    for (name, got), want in zip(lazy.state_dict().items(), eager.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_materialize_decides_the_same_on_a_rank_whose_expert_shard_is_empty() -> None:
    """FSDP2 over 4 ranks shards 2 experts' rows on dim 0: ranks 2 and 3 hold none. materialize skipped the
    experts (MoE's reset wrote them) by a NaN test of the local values, which an empty shard cannot pass:
    those ranks drew the experts again, and every later layer (the head here) got other values there,
    silently. Now that rank's shard of the head is the eager head's rows (this process plays rank 3 on
    torch's fake process group; one rank per process: torch keeps a mesh's coordinates across groups)."""
    from helpers import fake_world

    rank = 3

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([parallel.MoE(6, 6, num_experts=2, top_k=1)])
            self.head = nn.Linear(6, 8)

    with fake_world(4, rank=rank):
        state = parallel.init({"random_seed": 3, "mixed_precision": "fp32"})
        with torch.device("meta"):
            model = Net()
        model, _ = parallel.apply_data_parallel(model, state)
        assert materialize(model, state) == 2  # the MoE and the head; the experts not again
        assert model.layers[0].experts.w_gate.to_local().shape[0] == 0
        head = model.head.weight.to_local()
    torch.manual_seed(3)
    eager = Net()
    torch.testing.assert_close(head, eager.head.weight[2 * rank : 2 * rank + 2], rtol=0, atol=0)


def _materialized_and_eager(build, state) -> tuple[nn.Module, nn.Module]:
    """``build()`` on meta then materialized, and built eagerly after seeding with the state's seed; their
    state dicts are checked equal."""
    with torch.device("meta"):
        lazy = build()
    materialize(lazy, state)
    torch.manual_seed(state.seed_for())
    eager = build()
    for (name, got), want in zip(lazy.state_dict().items(), eager.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    return lazy, eager


def test_materialize_keeps_what_a_parents_reset_wrote_into_a_child(world1) -> None:
    """A parent whose reset zero-initializes its output projection's weight (not its bias), as residual
    branches do: materialize reset the projection after the parent (its bias was unwritten) and drew the
    weight again (std 0.15 where the eager build has 0). Now the projection's reset runs (its draws, as
    eager) and keeps the parent's zeros."""

    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(6, 6)
            self.out = nn.Linear(6, 6)
            self.reset_parameters()

        def reset_parameters(self) -> None:
            nn.init.zeros_(self.out.weight)

    def build() -> nn.Module:
        return nn.Sequential(Branch(), nn.Linear(6, 3))

    _, eager = _materialized_and_eager(build, world1)
    assert not eager[0].out.weight.any()


def test_materialize_counts_writes_through_data(world1) -> None:
    """Writes through ``.data`` bump no version counter of the parameter or buffer: a parent whose reset
    zeroed ``self.out.weight.data`` had its zeros drawn over by the projection's own reset (max difference
    0.39 from the eager build), and a reset that filled an integer buffer through ``.data`` (or set it,
    ``t.data = value``) was refused as never written. They now count as writes."""

    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(6, 6)
            self.out = nn.Linear(6, 6)
            self.register_buffer("position_ids", torch.arange(6), persistent=False)
            self.register_buffer("mask", torch.ones(6, 6, dtype=torch.bool).tril(), persistent=False)
            self.reset_parameters()

        def reset_parameters(self) -> None:
            self.out.weight.data.zero_()
            self.position_ids.data = torch.arange(6)  # the setter still sets
            self.mask.data.copy_(torch.ones(6, 6, dtype=torch.bool).tril())

    def build() -> nn.Module:
        return nn.Sequential(Branch(), nn.Linear(6, 3))

    lazy, eager = _materialized_and_eager(build, world1)
    assert not eager[0].out.weight.any()
    assert torch.equal(lazy[0].position_ids, torch.arange(6))
    assert torch.equal(lazy[0].mask, eager[0].mask)


def test_materialize_leaves_a_rotary_module_with_its_own_reset_to_it(world1) -> None:
    """A module named like Hugging Face's rotary ones (``...RotaryEmbedding`` holding a ``config``) but with
    a reset_parameters and constructor of its own: materialize ran its reset, then rebuilt it from its
    config alone to refill Hugging Face's tables, and raised TypeError (``missing 1 required positional
    argument: 'dim'``) after allocating the model. Its own reset refills it now."""

    class RotaryEmbedding(nn.Module):
        def __init__(self, config: dict, dim: int) -> None:
            super().__init__()
            self.config, self.dim = config, dim
            self.register_buffer("inv_freq", self._freqs(), persistent=False)

        def _freqs(self) -> torch.Tensor:
            return 1.0 / (self.config["theta"] ** (torch.arange(0, self.dim, 2).float() / self.dim))

        def reset_parameters(self) -> None:
            self.inv_freq.copy_(self._freqs())

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), RotaryEmbedding({"theta": 10000.0}, 8))

    with torch.device("meta"):
        lazy = build()
    materialize(lazy, world1)
    eager = build()
    assert torch.equal(lazy[1].inv_freq, eager[1].inv_freq)


def test_materialize_names_integer_buffers_no_reset_wrote(world1) -> None:
    """Integer and bool buffers cannot hold the NaN fill: a position-id or causal-mask buffer built in
    ``__init__`` and not rebuilt by the reset came back as whatever memory to_empty gave (values near
    +-4.7e18), without an error. Now they are named unless allow_uninitialized."""

    class WithIds(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.register_buffer("position_ids", torch.arange(16), persistent=False)
            self.register_buffer("mask", torch.ones(4, 4, dtype=torch.bool).tril(), persistent=False)

        def reset_parameters(self) -> None:
            pass

    with torch.device("meta"):
        model = WithIds()
    with pytest.raises(RuntimeError, match=r"no reset_parameters\(\) gave position_ids, mask values"):
        materialize(model, world1)
    with torch.device("meta"):
        model = WithIds()
    materialize(model, world1, allow_uninitialized=True)


def test_materialize_rejects_a_real_model(world1) -> None:
    model = _model()
    before = copy.deepcopy(model.state_dict())
    shown = r"inp\.weight, inp\.bias, blocks\.0\.norm\.weight and \d+ more not on the meta device"
    with pytest.raises(ValueError, match=shown):
        materialize(model, world1)
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), "nothing changed"
    with pytest.raises(TypeError, match=r"model: expected an nn\.Module"):
        materialize("model", world1)
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    for bad in ({"random_seed": 1}, ParallelConfig()):  # the config where init's state belongs
        with pytest.raises(TypeError, match=rf"state: expected the ParallelState .* {type(bad).__name__}"):
            materialize(model, bad)
    assert model.weight.is_meta, "nothing was allocated"
