"""Benchmark: the tensor-parallel MLP pair with sequence parallelism in a single-GPU **simulated world**.

What this is, plainly: **rank 0's share of the pair, with its W - 1 peers' data in the same GPU's memory;
one rank's kernels timed, no peer, no barrier waits, all traffic local HBM** (:mod:`smptk.comm.simulated`).
Every row carries ``world_mode`` saying so. The numbers say how fast one rank's work runs when its
communication is fused into the GEMMs versus done around them; they are not multi-GPU measurements
(bench/tp_dist.py measures those under torchrun on N GPUs).

The pair (as :mod:`bench.tp_dist`): ``y = gelu(x @ W1.T) @ W2.T``, column-parallel ``W1 [F, H]`` then
row-parallel ``W2 [H, F]``, T = W ranks, rank 0 holding token block 0 ``x_0 [S/W, H]``, ``W1_0 [F/W, H]``,
``W2_0 [H, F/W]``. The peers' token blocks sit in their data regions, and the partial sums the peers'
row GEMMs would have pushed into rank 0's region (``(gelu(x @ W1_q.T) @ W2_q.T)`` rows of block 0, in
the dtype) sit in rank 0's slots for them. Implementations (``impl``):

- ``smptk_fused``: :mod:`smptk.comm.fused_linear`'s two kernels on the simulated world: the all-gather
  GEMM (``comm_max_sms`` programs copy the peers' blocks while the GEMM tiles start, GELU in the
  epilogue) and the GEMM + reduce-scatter (tiles stored into the owners' slots, ``comm_max_sms``
  programs sum rank 0's slots once its own tiles are in).
- ``torch_sequential``: what torch's non-overlapped DTensor path does on one rank, on the same buffers:
  gather the W blocks into one tensor (a copy, as an all-gather's output), ``F.linear`` + GELU (cuBLAS),
  ``F.linear`` (cuBLAS), then sum the W partial blocks of rank 0 (as a reduce-scatter's reduction).
  Here the "communication" is local copies and sums, which NCCL would do over NVLink with its own SMs.

torch's async TP (``torch.ops.symm_mem``) needs real peers: no simulated row (bench/tp_dist.py has it).

Shapes: :func:`bench.tp_dist.shape_for` (measure: S=8192, H=8192, F=28672 at W=8, bf16, comm_max_sms 8;
quick on CUDA: S=128W, H=256, F=128W; on a CPU: S=6W, H=20, F=12W at W=2 and 3 in fp32, the Triton
interpreter). Each case is checked before it is timed: rank 0's output against rows 0..S/W of the fp32
reference ``gelu(x @ W1.T) @ W2.T`` within :func:`bench.tp_dist.reference`'s tolerance (the fused case's
gathered input and its GELU output too). Each round is one forward of the pair, L2 flushed before it.
``flops`` = the pair's FLOPs / W (rank 0's share).

Select with ``-k``: ids read ``tp_sim-<impl>-W<w>``, e.g. ``python -m bench --filter tp_sim``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from bench.config import current_mode
from bench.timing import CLOCK, summarize
from bench.tp_dist import DEFAULT_COMM_MAX_SMS, pair_flops, reference, shape_for
from smptk.comm import fused_linear as _fl  # the fused ops' kernel-level entry points (private)
from smptk.comm.simulated import SimulatedWorld, world_mode_label
from smptk.kernels._epilogue import ACTIVATION_CODES

pytestmark = pytest.mark.benchmark(timer=CLOCK, disable_gc=True, warmup=False)

MODE = current_mode()  # bench/conftest.py has already prepared the process (TRITON_INTERPRET on a CPU)
SUITE = "tp_sim"
IMPLS = ("smptk_fused", "torch_sequential")
if MODE.quick:
    WORLDS = (2, 3) if MODE.device == "cpu" else (2, 8)
    COMM_MAX_SMS = 2
else:
    WORLDS = (8,)
    COMM_MAX_SMS = DEFAULT_COMM_MAX_SMS
DTYPE = torch.float32 if MODE.device == "cpu" else torch.bfloat16  # bf16 tl.dot is wrong in the interpreter


@dataclasses.dataclass(frozen=True)
class PairCase:
    impl: str
    world: int

    @property
    def id(self) -> str:
        return f"{SUITE}-{self.impl}-W{self.world}"

    @property
    def shape(self) -> dict[str, int]:
        return shape_for(MODE.name, MODE.device, self.world)

    def fields(self) -> dict[str, Any]:
        """The case as row fields (see :mod:`bench.rows`)."""
        return {
            "suite": SUITE,
            "op": "tp_mlp_pair",
            "impl": self.impl,
            "pass": "fwd",
            "config": "sp",
            "dtype": str(DTYPE).removeprefix("torch."),
            "world": self.world,
            "tp": self.world,
            "shape": self.shape,
            "comm_max_sms": COMM_MAX_SMS if self.impl == "smptk_fused" else None,
            "world_mode": world_mode_label(self.world, MODE.device),
        }


CASES = [PairCase(impl, w) for w in WORLDS for impl in IMPLS]


class SimulatedPair:
    """Rank 0's tensors and a simulated world staged as its peers would have left it (module docstring)."""

    def __init__(self, world: int, shape: dict[str, int]) -> None:
        S, H, Fw = shape["S"], shape["H"], shape["F"]
        self.world, self.t_w, self.f_w = world, S // world, Fw // world
        gen = torch.Generator(device=MODE.device).manual_seed(20261123 + world)

        def draw(*size: int, fan_in: int = 1) -> torch.Tensor:
            t = torch.randn(*size, generator=gen, device=MODE.device, dtype=torch.float32)
            return (t / math.sqrt(fan_in)).to(DTYPE)

        self.x, self.w1, self.w2 = draw(S, H), draw(Fw, H, fan_in=H), draw(H, Fw, fan_in=Fw)
        self.x0 = self.x[: self.t_w].contiguous()
        self.w1_0 = self.w1[: self.f_w].contiguous()
        self.w2_0 = self.w2[:, : self.f_w].contiguous()
        self.sim = SimulatedWorld(world, S * H * DTYPE.itemsize, MODE.device)
        self.expected, self.scale, self.tol = reference(self.x, self.w1, self.w2, DTYPE, world)
        self.stage()

    def blocks(self) -> list[torch.Tensor]:
        """Peer q's token block, in its data region (q >= 1)."""
        n = self.t_w * self.x.shape[1]
        return [self.sim.peer_region(q, DTYPE, n).view(self.t_w, -1) for q in range(1, self.world)]

    def slots(self) -> torch.Tensor:
        """Rank 0's region as ``[W, S/W, H]`` slots: slot q holds peer q's partial of block 0."""
        return self.sim.peer_region(0, DTYPE, self.world * self.t_w * self.x.shape[1]).view(
            self.world, self.t_w, -1
        )

    def stage(self) -> None:
        """(Re)write what the peers would have left: their token blocks and their partials of block 0."""
        for q, block in enumerate(self.blocks(), start=1):
            block.copy_(self.x[q * self.t_w : (q + 1) * self.t_w])
        slots = self.slots()
        for q in range(1, self.world):
            cols = slice(q * self.f_w, (q + 1) * self.f_w)
            h_q = F.gelu(self.x.float() @ self.w1[cols].float().T).to(DTYPE)  # what peer q's GEMM stores
            slots[q].copy_((h_q[: self.t_w].float() @ self.w2[:, cols].float().T).to(DTYPE))

    # --------------------------------------------------------------------------- the two implementations
    def smptk_fused(self) -> Callable[[], torch.Tensor]:
        gelu = ACTIVATION_CODES["gelu"]

        def run() -> torch.Tensor:
            h, self.gathered, _ = _fl._fused_forward(
                self.x0, self.w1_0, None, gelu, False, None, self.sim, COMM_MAX_SMS
            )
            self.h = h
            return _fl._fused_scatter(h, self.w2_0, None, None, self.sim, COMM_MAX_SMS)

        return run

    def torch_sequential(self) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            gathered = torch.cat([self.x0, *self.blocks()])
            h = F.gelu(F.linear(gathered, self.w1_0))
            partial = F.linear(h, self.w2_0)
            peers = self.slots()[1:]
            return partial[: self.t_w] + peers.sum(0, dtype=torch.float32).to(DTYPE)

        return run

    def check(self, impl: str, y: torch.Tensor) -> dict[str, Any]:
        """Rank 0's output against its rows of the fp32 reference (and the fused case's intermediates)."""
        want, scale = self.expected[: self.t_w], self.scale[: self.t_w]
        err = (y.float() - want).abs()
        bound = self.tol.bound(want, scale)
        worst = (err / bound).max().item()
        passed = bool(torch.isfinite(y).all()) and worst <= 1
        extra = {}
        if impl == "smptk_fused":
            extra["gathered_exact"] = bool(torch.equal(self.gathered, self.x))
            h_ref = F.gelu(self.x.float() @ self.w1_0.float().T)
            extra["h_max_abs_err"] = (self.h.float() - h_ref).abs().max().item()
            passed = passed and extra["gathered_exact"]
        assert passed, f"{impl} W={self.world}: worst error / tolerance {worst:.3g}, {extra}"
        return {
            "reference": "fp32 gelu(x @ W1.T) @ W2.T of the full tensors, rank 0's rows (smptk.testing)",
            "passed": passed,
            "worst_err_over_tol": worst,
            "max_abs_err": err.max().item(),
            "tol": self.tol.describe(),
            **extra,
        }


def _kernel_path(impl: str) -> str:
    if impl == "smptk_fused":
        from smptk.kernels import runtime

        return "triton (interpreter)" if runtime.interpreter_enabled() else "triton"
    return "cuBLAS via torch" if MODE.device == "cuda" else "torch (CPU)"


def _sync() -> None:
    if MODE.device == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_tp_sim(benchmark: Any, case: PairCase, l2_flusher: Any, record: Callable[..., Any]) -> None:
    pair = SimulatedPair(case.world, case.shape)
    run = getattr(pair, case.impl)()
    y = run()  # first call: Triton's JIT, then the check
    _sync()
    check = pair.check(case.impl, y)
    benchmark.group = f"{SUITE} W={case.world}"
    benchmark.pedantic(run, setup=l2_flusher.flush, rounds=MODE.rounds, warmup_rounds=MODE.warmup_rounds)
    median = summarize(list(benchmark.stats.stats.data))["median"]
    flops = pair_flops(case.shape) // case.world
    path = {
        "smptk_fused": "fused: all-gather GEMM, then GEMM + reduce-scatter (smptk.comm.fused_linear)",
        "torch_sequential": "torch.cat, F.linear + GELU, F.linear, sum of the W partial blocks",
    }[case.impl]
    record(
        benchmark,
        flops=flops,
        nbytes=0,
        check=check,
        path=path,
        kernel_path=_kernel_path(case.impl),
        l2_flush_bytes=l2_flusher.nbytes,
        time_per_pair_s=median,
    )
