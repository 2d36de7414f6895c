"""Benchmark: the MoE layer (forward and forward+backward) against PyTorch baselines, its routing share,
and smptk's grouped GEMM against a dense cuBLAS GEMM of the same FLOPs.

Legend: T tokens, H hidden size, F expert FFN width, E experts, k experts per token, P = T * k pairs.
Shapes (measure mode, bf16): Mixtral-like ``E=8 k=2 H=4096 F=14336`` and fine-grained ``E=64 k=6 H=2048
F=1408`` at T = 4096, 16384, 32768. Quick mode (fp16 on a CPU under the Triton interpreter; bf16 with
``--quick`` on a GPU): ``E=4 k=2 H=16 F=24`` and ``E=7 k=3 H=16 F=8`` at T = 7, 33 (torch_compile at T = 33
only, see :func:`build_cases`), under the same config names ("mixtral", "fine_grained") so ``-k``
filters work in both modes.

Every implementation runs on the same inputs and weights (one seeded generator per config and T), with
the same routing: fp32 router logits ``x.float() @ router.float().T``, softmax, top-k, weights
renormalized over the k picks, dropless (every pair computed). So every row of a shape does the same
GEMM work and is credited the same FLOPs (:func:`bench.counts.moe_layer_flops`: router ``2*T*H*E`` plus
3 GEMMs of ``2*P*H*F`` per forward, backward 2x the forward).

Layer implementations (``moe_layer`` rows):

- ``smptk``: :class:`smptk.parallel.MoE` (moe_route, moe_dispatch, grouped SwiGLU + grouped linear
  GEMMs, moe_combine; the path that ran is in ``kernel_path``).
- ``eager_loop``: plain PyTorch the way a Hugging Face Mixtral block does it: router linear, softmax,
  ``torch.topk``, then a Python loop over experts: ``torch.where(ids == e)`` (a host sync per expert),
  ``index_select`` of that expert's tokens, SwiGLU MLP with ``F.linear``, and a weighted ``index_add_``
  into the output. The routing weights are cast to the activations' dtype before the product, as HF does.
- ``torch_grouped_mm``: the same routing, a stable sort of the pairs by expert (``searchsorted`` gives the
  int32 cumulative row ends, no host sync), ``index_select``, three ``torch._grouped_mm`` calls with
  ``mat_b = w.transpose(-2, -1)`` ``[E, K, N]``, and the weighted ``index_add_``. What the installed torch
  says about ``_grouped_mm`` (2.13, CPU build, read in ``torch/_meta_registrations.py`` and
  ``torch/nn/functional.py``): ``offs`` is 1-D int32, ``mat_b`` 2-D or 3-D, strides 16-byte aligned; the
  meta function (what torch.compile traces with) accepts bf16 only, and the docstring says bf16 on CUDA
  SM >= 80. The CUDA dispatch itself is C++, not in the wheel; in pytorch/pytorch's sources on GitHub
  (recent versions, not necessarily 2.13's) ``GroupedBlas.cpp`` takes a fast grouped-GEMM path (CUTLASS;
  cuBLASLt on CUDA >= 13.3 builds) on sm90/sm100 with bf16 in and out, and otherwise
  ``_grouped_mm_fallback`` (``GroupedMMUtils.h``): it copies ``offs`` to the host (a sync) and runs one
  ``mm`` per expert, for fp32/fp16/bf16 and on CPU. This build's CPU op runs fp16 and bf16, forward and
  backward (tried here), so quick mode runs it; ``kernel_path`` says which path a CUDA row is expected
  to have taken (inferred from the capability, not observed). Expert row counts are not padded
  (torchtitan pads them to multiples of 8 for bf16 grouped_mm; the checks above ask only for 16-byte
  aligned strides): a wrong forward would fail the first-call check, the backward is not checked. Where
  the op is missing or a tiny probe call raises, the case is skipped with that reason.
- ``torch_compile``: ``torch.compile(<eager_loop>, dynamic=False)`` from a reset dynamo per case, with
  ``torch._dynamo.config.capture_dynamic_output_shape_ops = True``. Without that flag dynamo meets the
  data-dependent ``nonzero`` of ``torch.where`` inside the expert loop, reports "graph break in loop" and
  skips the whole frame (seen with torch 2.13 on CPU), so the row would time eager code under another
  name. With it the loop traces into one graph (per-expert sizes become unbacked symbols; the syncs stay).
  Rows record ``compile_graphs`` and ``compile_graph_breaks`` from dynamo's counters after the first call.

Routing share (``moe_routing`` rows, impl ``smptk_routing``): ``moe_route`` on the fp32 router logits
(a leaf, so the router GEMM is not in it), ``moe_dispatch`` of x and ``moe_combine`` of the dispatched
rows (standing in for the experts' output: same shape and dtype), forward and forward+backward, on the
same x and router weights as the layer rows. FLOPs are 0; bytes are the three ops' compulsory traffic
(:func:`bench.counts.moe_routing_bytes`). The ``smptk`` layer row of the same config, T and pass records
``routing_share`` = routing median / layer median, both from this run (the routing test runs first; when
it did not run, e.g. filtered out, the share is None). The layer's router GEMM and its fp32 cast of x are
outside the share.

Grouped vs dense (``grouped_gemm`` rows, Mixtral-like config only): ``smptk``'s ``grouped_linear`` of
``[P, H]`` rows spread evenly over E experts (sizes differ by at most one row) with weight ``[E, F, H]``
against ``torch_matmul``: ``x @ w.T`` with one ``[F, H]`` weight, the same ``2*P*H*F`` FLOPs. Both rows
carry the shape ``{M: P, K: H, N: F, E}`` so the report pairs them; the smptk row records
``pct_of_dense`` = its TFLOP/s as a percentage of the torch_matmul row of the same pass and shape, from
this run (torch_matmul runs first).

Checks: the first call of every case is checked before timing (its forward output; a fwd+bwd case's
first call is checked, then its backward runs once untimed). Quick mode: layer rows against
:func:`smptk.testing.moe_layer.moe_layer_reference` (fp32). Measure mode (too big for that reference's
per-pair Python loop): against the eager loop run in fp32 on the same inputs with TF32 off, computed once
per config and T and kept on the host. Tolerance 3% of max |reference| (as in test_bench_linear.py): it
stops a wrong result from being timed; exact numerics are the job of tests/. Routing rows: the picked
experts' probabilities equal ``torch.topk``'s (robust to ties), the weights are those renormalized, and
combine(dispatch(x)) equals x (the weights sum to 1). Grouped rows: smptk.testing's grouped and dense
fp32 references.

Memory: the bench conftest frees GPU memory after every case; nothing here keeps a device tensor across
cases. A layer case whose :func:`bench.counts.moe_memory_estimate` exceeds the device's free memory is
skipped with that estimate in the reason (the largest, Mixtral-like T=32768 fwd+bwd, is estimated at
38.3 GiB; fine-grained T=32768 fwd+bwd at 16.1 GiB).

Select with ``-k``: ids read ``<op>-<pass>-<config>-E<E>-k<k>-H<H>-F<F>-T<T>-<impl>``, e.g.
``python -m bench --filter "moe_layer and fwd_bwd and fine_grained"``.

Why this file runs past 600 lines: it holds three benchmarks that share one input generator, reference
cache, checked-first-call timing helper and the medians they divide by, plus the baselines' own code
(part of what is measured); split, those would have to cross files through module state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from bench.config import current_mode
from bench.counts import (
    linear_bytes,
    linear_flops,
    moe_layer_bytes,
    moe_layer_flops,
    moe_memory_estimate,
    moe_routing_bytes,
)
from bench.timing import CLOCK, summarize

pytestmark = pytest.mark.benchmark(timer=CLOCK, disable_gc=True, warmup=False)

MODE = current_mode()  # bench/conftest.py has already prepared the process (TRITON_INTERPRET on a CPU)
PASSES = ("fwd", "fwd+bwd")
LAYER_IMPLS = ("smptk", "eager_loop", "torch_grouped_mm", "torch_compile")
GROUPED_IMPLS = ("torch_matmul", "smptk")  # dense first: the smptk row's pct_of_dense reads its median
CHECK_REL_TOL = 0.03  # of max |reference|: bf16/fp16 rounding is < 1%, a wrong kernel is O(1)
ROUTER_STD = 0.02  # MoE.reset_parameters' router init


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """A layer configuration: its name and E, k, H, F."""

    name: str
    E: int
    k: int
    H: int
    F: int


MEASURE_SHAPES = (MoEShape("mixtral", 8, 2, 4096, 14336), MoEShape("fine_grained", 64, 6, 2048, 1408))
MEASURE_T = (4096, 16384, 32768)
# Quick mode: odd sizes, small enough for the interpreter; E=7, k=3 leaves experts of unequal load.
QUICK_SHAPES = (MoEShape("mixtral", 4, 2, 16, 24), MoEShape("fine_grained", 7, 3, 16, 8))
QUICK_T = (7, 33)


@dataclasses.dataclass(frozen=True)
class MoECase:
    """One benchmark: an op ("moe_layer", "moe_routing", "grouped_gemm"), a pass, a shape, T and an impl."""

    op: str
    pass_: str
    shape: MoEShape
    t: int
    impl: str

    @property
    def backward(self) -> bool:
        return self.pass_ == "fwd+bwd"

    @property
    def pairs(self) -> int:
        return self.t * self.shape.k

    @property
    def id(self) -> str:
        s = self.shape
        pass_id = self.pass_.replace("+", "_")
        return f"{self.op}-{pass_id}-{s.name}-E{s.E}-k{s.k}-H{s.H}-F{s.F}-T{self.t}-{self.impl}"

    def fields(self) -> dict[str, Any]:
        """The case as row fields (see :mod:`bench.rows`)."""
        s = self.shape
        grouped = self.op == "grouped_gemm"
        if grouped:  # rows of a T-token top-k layer, spread evenly; dense rows carry E to pair with them
            shape = {"M": self.pairs, "K": s.H, "N": s.F, "E": s.E}
        else:
            shape = {"T": self.t, "H": s.H, "F": s.F, "E": s.E, "k": s.k}
        return {
            "suite": "moe",
            "op": self.op,
            "activation": None,
            "bias": False,
            "pass": self.pass_,
            "impl": self.impl,
            "dtype": str(MODE.dtype).removeprefix("torch."),
            "shape": shape,
            "config": s.name,
            "tokens": self.t,
            "top_k": s.k,
            "routing": None if grouped else "softmax top-k, renormalized, dropless",
        }


def build_cases(quick: bool) -> dict[str, list[MoECase]]:
    """The cases of each test, in run order, for quick or measure mode.

    Quick mode compiles torch_compile at the last T only: inductor's C++ compiles of the unrolled expert
    loop took 105 s for both T (8 cases) with a cold cache on a 2-core CPU, 42 s of it at T=33.
    """
    shapes, ts = (QUICK_SHAPES, QUICK_T) if quick else (MEASURE_SHAPES, MEASURE_T)
    return {
        "routing": [
            MoECase("moe_routing", p, s, t, "smptk_routing") for s in shapes for t in ts for p in PASSES
        ],
        "layer": [
            MoECase("moe_layer", p, s, t, impl)
            for s in shapes
            for t in ts
            for p in PASSES
            for impl in LAYER_IMPLS
            if not (quick and impl == "torch_compile" and t != ts[-1])
        ],
        "grouped": [
            MoECase("grouped_gemm", p, shapes[0], t, impl)
            for t in ts
            for p in PASSES
            for impl in GROUPED_IMPLS
        ],
    }


CASES = build_cases(MODE.quick)

# Medians of this run that later rows divide by: (config, T, pass) -> routing median; (T, pass) -> dense
# TFLOP/s. Floats only: no device memory survives a case.
_ROUTING_MEDIAN_S: dict[tuple[str, int, str], float] = {}
_DENSE_TFLOPS: dict[tuple[int, str], float] = {}
# The measure-mode fp32 layer reference of one (config, T), on the host; replaced when the shape changes.
_REFERENCE: dict[tuple[str, int], torch.Tensor] = {}


# ----------------------------------------------------------------------------- implementations
def route_topk(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-style routing: fp32 logits, softmax, topk, renormalize; weights in x's dtype ``[T, k]``, ids."""
    probs = torch.softmax(F.linear(x.float(), router.float()), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype), ids


def eager_loop_moe(
    x: torch.Tensor,
    router: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """The per-expert Python loop of a typical HF MoE block; ``x [T, H]`` -> ``[T, H]``."""
    weights, ids = route_topk(x, router, top_k)
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        token, slot = torch.where(ids == e)
        x_e = x.index_select(0, token)
        y_e = F.linear(F.silu(F.linear(x_e, w_gate[e])) * F.linear(x_e, w_up[e]), w_down[e])
        out.index_add_(0, token, y_e * weights[token, slot].unsqueeze(1))
    return out


def grouped_mm_moe(
    x: torch.Tensor,
    router: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """Sort-based grouping and ``torch._grouped_mm`` experts; same routing and result as the eager loop."""
    weights, ids = route_topk(x, router, top_k)
    E = w_gate.shape[0]
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    experts = torch.arange(E, device=x.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)  # cumulative row ends [E]
    token = order // top_k
    xg = x.index_select(0, token)
    gate = torch._grouped_mm(xg, w_gate.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(xg, w_up.transpose(-2, -1), offs=offs)
    yg = torch._grouped_mm(F.silu(gate) * up, w_down.transpose(-2, -1), offs=offs)
    yg = yg * weights.reshape(-1)[order].unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, token, yg)


def routing_forward(
    logits: torch.Tensor, x: torch.Tensor, top_k: int, num_experts: int
) -> tuple[torch.Tensor, Any]:
    """smptk's routing alone: moe_route, moe_dispatch of x, moe_combine of the dispatched rows."""
    from smptk.kernels.moe_dispatch import moe_combine, moe_dispatch
    from smptk.kernels.moe_route import moe_route

    routing = moe_route(logits, top_k)
    x_grouped, plan = moe_dispatch(x, routing.expert_ids, num_experts)
    return moe_combine(x_grouped, plan, routing.weights), routing


def even_offsets(rows: int, experts: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[E + 1]`` int64 offsets spreading ``rows`` over ``experts`` as evenly as possible.

    >>> even_offsets(14, 4).tolist()
    [0, 3, 7, 10, 14]
    """
    return torch.tensor([e * rows // experts for e in range(experts + 1)], dtype=torch.int64, device=device)


# ----------------------------------------------------------------------------- inputs and paths
def _seed(case: MoECase) -> int:
    s = case.shape
    return 1_000_003 * case.t + 10_007 * s.E + 101 * s.k + 7 * s.H + s.F


def _layer_tensors(case: MoECase, *, weights: bool = True) -> dict[str, torch.Tensor]:
    """x, router and (if ``weights``) the expert weights of the case's config and T, from a fixed seed.

    The draw order is fixed, so every impl (and the routing case, which stops after the router) sees the
    same values. Experts: N(0, 1/fan_in), the scale of nn.Linear's init, so activations stay O(1).
    """
    s = case.shape
    gen = torch.Generator(device=MODE.device).manual_seed(_seed(case))

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=MODE.device, dtype=MODE.dtype).mul_(scale)

    t = {"x": randn(case.t, s.H, scale=1.0), "router": randn(s.E, s.H, scale=ROUTER_STD)}
    if weights:
        t["w_gate"] = randn(s.E, s.F, s.H, scale=s.H**-0.5)
        t["w_up"] = randn(s.E, s.F, s.H, scale=s.H**-0.5)
        t["w_down"] = randn(s.E, s.H, s.F, scale=s.F**-0.5)
    return t


def _triton_path(*tensors: torch.Tensor) -> str:
    from smptk.kernels import runtime

    path = runtime.select_path(*tensors)
    return "triton (interpreter)" if path == "triton" and runtime.interpreter_enabled() else path


def _compile_skip_reason() -> str | None:
    """Why torch_compile cannot run here, or None (the same rule as test_bench_linear.py's).

    On a CPU, inductor generates C++ and needs a compiler.
    """
    if MODE.device == "cpu" and not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")):
        return "torch.compile on a CPU needs a C++ compiler for inductor; none found (g++, clang++ or $CXX)"
    return None


@functools.cache
def _grouped_mm_skip_reason() -> str | None:
    """None when ``torch._grouped_mm`` runs forward and backward on this device and dtype, else why not."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        a = torch.randn(16, 16, device=MODE.device, dtype=MODE.dtype, requires_grad=True)
        b = torch.randn(2, 16, 16, device=MODE.device, dtype=MODE.dtype, requires_grad=True)
        offs = torch.tensor([8, 16], device=MODE.device, dtype=torch.int32)
        y = torch._grouped_mm(a, b, offs=offs)
        y.backward(torch.ones_like(y))
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return f"torch._grouped_mm does not run on {MODE.device} with {MODE.dtype} here: {exc}"[:500]
    return None


def _grouped_mm_path() -> str:
    if MODE.device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        if major in (9, 10) and MODE.dtype == torch.bfloat16:
            return f"torch._grouped_mm (sm{major}{minor} bf16: grouped-GEMM fast path per GroupedBlas.cpp)"
        return (
            f"torch._grouped_mm (sm{major}{minor} {MODE.dtype}: fallback, host read of offs + mm per expert)"
        )
    return "torch._grouped_mm (CPU fallback: mm per expert)"


def _memory_skip_reason(case: MoECase) -> str | None:
    """Why the case would not fit in the GPU's free memory (by the analytic estimate), or None."""
    if MODE.device != "cuda":
        return None
    s = case.shape
    need = moe_memory_estimate(
        tokens=case.t,
        hidden=s.H,
        ffn=s.F,
        experts=s.E,
        top_k=s.k,
        elem=MODE.dtype.itemsize,
        backward=case.backward,
    )
    free, total = torch.cuda.mem_get_info()
    if need <= free:
        return None
    return (
        f"needs about {need / 2**30:.1f} GiB (bench.counts.moe_memory_estimate) but only "
        f"{free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB is free"
    )


def _sync() -> None:
    if MODE.device == "cuda":
        torch.cuda.synchronize()


def _median_s(benchmark: Any) -> float | None:
    """Median of the timed rounds pytest-benchmark holds (None when it was disabled)."""
    meta = getattr(benchmark, "stats", None)
    data = list(meta.stats.data) if meta is not None else []
    return summarize(data)["median"] if data else None


def _close(name: str, out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Max abs error of ``out`` vs the fp32 ``ref``, asserted within CHECK_REL_TOL of max |ref| (+1e-3)."""
    ref = ref.to(out.device)
    assert out.shape == ref.shape, f"{name}: output shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    err = (out.detach().float() - ref).abs().max().item() if out.numel() else 0.0
    ref_max = ref.abs().max().item() if ref.numel() else 0.0
    tol = CHECK_REL_TOL * ref_max + 1e-3
    assert err <= tol, f"{name}: max |out - fp32 reference| = {err:.4g} > {tol:.4g} (max |ref| {ref_max:.4g})"
    return {"max_abs_err": err, "ref_max_abs": ref_max, "tol": tol}


class _NoTF32:
    """fp32 references are IEEE fp32: TF32 off inside the block (smptk.testing refuses TF32)."""

    def __enter__(self) -> None:
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc: object) -> None:
        torch.backends.cuda.matmul.allow_tf32 = self.saved


def _layer_reference(case: MoECase, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 output of the layer on the case's inputs; cached on the host per (config, T)."""
    key = (case.shape.name, case.t)
    if key not in _REFERENCE:
        _REFERENCE.clear()
        args = [t[n].detach() for n in ("x", "router", "w_gate", "w_up", "w_down")]
        with torch.no_grad(), _NoTF32():
            if MODE.quick:
                from smptk.testing.moe_layer import moe_layer_reference

                ref = moe_layer_reference(*args, case.shape.k)[0]
            else:  # the fp32 eager loop: moe_layer_reference's per-pair Python loop is too slow at these T
                ref = eager_loop_moe(*(a.float() for a in args), case.shape.k)
        _REFERENCE[key] = ref.cpu()
        del ref
    return _REFERENCE[key]


def _time(
    benchmark: Any,
    case: MoECase,
    forward: Callable[[], torch.Tensor],
    leaves: list[torch.Tensor],
    check: Callable[[torch.Tensor], dict[str, Any]],
    grad_shape: tuple[int, ...],
    l2_flusher: Any,
) -> dict[str, Any]:
    """Untimed checked first call, then the timed pedantic rounds; returns check and first_call_s."""
    dy = torch.randn(*grad_shape, device=MODE.device, dtype=MODE.dtype) if case.backward else None

    if case.backward:

        def target() -> None:
            forward().backward(dy)

        def setup() -> None:
            for leaf in leaves:
                leaf.grad = None
            l2_flusher.flush()
    else:
        target, setup = forward, l2_flusher.flush

    # First call, untimed: Triton JIT and autotuning, inductor compilation, cuBLAS heuristics. Its host time
    # (forward, plus the backward for fwd+bwd, without the check) is recorded: a user pays it once.
    t0 = time.perf_counter()
    out = forward()
    _sync()
    first_call_s = time.perf_counter() - t0
    result = check(out)
    if case.backward:
        t0 = time.perf_counter()
        out.backward(dy)
        _sync()
        first_call_s += time.perf_counter() - t0
    del out
    for leaf in leaves:
        leaf.grad = None

    benchmark.pedantic(target, setup=setup, rounds=MODE.rounds, warmup_rounds=MODE.warmup_rounds)
    return {"check": result, "first_call_s": first_call_s}


# ----------------------------------------------------------------------------- benchmarks
@pytest.mark.parametrize("case", CASES["routing"], ids=[c.id for c in CASES["routing"]])
def test_moe_routing(benchmark: Any, case: MoECase, l2_flusher: Any, record: Callable[..., Any]) -> None:
    s = case.shape
    t = _layer_tensors(case, weights=False)
    x = t["x"].requires_grad_(case.backward)
    logits = F.linear(x.detach().float(), t["router"].float()).requires_grad_(case.backward)

    def check(out: torch.Tensor) -> dict[str, Any]:
        with torch.no_grad():
            _, routing = routing_forward(logits.detach(), x.detach(), s.k, s.E)
            probs = torch.softmax(logits.detach().float(), dim=-1)
            top = torch.topk(probs, s.k, dim=-1).values
            picked = probs.gather(1, routing.expert_ids.long())
            ids_err = (picked - top).abs().max().item()
            w_err = (routing.weights - top / top.sum(-1, keepdim=True)).abs().max().item()
        assert ids_err <= 1e-5, (
            f"{case.id}: picked experts' probabilities differ from torch.topk's by {ids_err}"
        )
        assert w_err <= 1e-5, f"{case.id}: routing weights differ from the renormalized top-k by {w_err}"
        return _close(case.id, out, x.detach().float()) | {"topk_prob_err": ids_err, "weights_err": w_err}

    benchmark.group = f"moe_routing {case.pass_} {s.name} T={case.t}"
    timed = _time(
        benchmark,
        case,
        lambda: routing_forward(logits, x, s.k, s.E)[0],
        [x, logits],
        check,
        (case.t, s.H),
        l2_flusher,
    )
    median = _median_s(benchmark)
    if median is not None:
        _ROUTING_MEDIAN_S[(s.name, case.t, case.pass_)] = median
    record(
        benchmark,
        flops=0,
        nbytes=moe_routing_bytes(
            tokens=case.t,
            hidden=s.H,
            experts=s.E,
            top_k=s.k,
            elem=MODE.dtype.itemsize,
            backward=case.backward,
        ),
        kernel_path=_triton_path(torch.empty(0, device=MODE.device)),
        l2_flush_bytes=l2_flusher.nbytes,
        spin_us=l2_flusher.spin_us,
        **timed,
    )


@pytest.mark.parametrize("case", CASES["layer"], ids=[c.id for c in CASES["layer"]])
def test_moe_layer(
    benchmark: Any,
    case: MoECase,
    l2_flusher: Any,
    record: Callable[..., Any],
    request: pytest.FixtureRequest,
) -> None:
    if case.impl == "torch_compile" and (reason := _compile_skip_reason()):
        pytest.skip(reason)
    if case.impl == "torch_grouped_mm" and (reason := _grouped_mm_skip_reason()):
        pytest.skip(reason)
    if reason := _memory_skip_reason(case):
        pytest.skip(reason)
    s = case.shape
    t = _layer_tensors(case)
    on_gpu = MODE.device == "cuda"
    extra: dict[str, Any] = {}
    if case.impl == "smptk":
        from smptk.parallel import MoE

        moe = MoE(s.H, s.F, s.E, s.k, device=MODE.device, dtype=MODE.dtype)
        with torch.no_grad():
            for name, param in (
                ("router", moe.router_weight),
                ("w_gate", moe.w_gate),
                ("w_up", moe.w_up),
                ("w_down", moe.w_down),
            ):
                param.copy_(t[name])
                t[name] = param  # the reference reads the module's own tensors
        moe.requires_grad_(case.backward)
        x = t["x"].requires_grad_(case.backward)
        leaves = [x, *moe.parameters()]
        forward = lambda: moe(x)
        kernel_path = _triton_path(x, moe.w_gate)
    else:
        leaves = [v.requires_grad_(case.backward) for v in t.values()]
        args = (t["x"], t["router"], t["w_gate"], t["w_up"], t["w_down"], s.k)
        if case.impl == "eager_loop":
            forward = lambda: eager_loop_moe(*args)
            kernel_path = (
                "torch eager (cuBLAS per expert, host sync per expert)" if on_gpu else "torch eager (CPU)"
            )
        elif case.impl == "torch_grouped_mm":
            forward = lambda: grouped_mm_moe(*args)
            kernel_path = _grouped_mm_path()
        else:
            torch._dynamo.reset()
            counters.clear()
            patches = contextlib.ExitStack()  # undone after the test, whatever its outcome
            request.addfinalizer(patches.close)
            request.addfinalizer(torch._dynamo.reset)  # before the conftest's gc + empty_cache
            patches.enter_context(torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True))
            compiled = torch.compile(eager_loop_moe, dynamic=False)
            forward = lambda: compiled(*args)
            kernel_path = "torch.compile (inductor, default mode, capture_dynamic_output_shape_ops)"

    def check(out: torch.Tensor) -> dict[str, Any]:
        return _close(case.id, out, _layer_reference(case, t))

    benchmark.group = f"moe_layer {case.pass_} {s.name} T={case.t}"
    timed = _time(benchmark, case, forward, leaves, check, (case.t, s.H), l2_flusher)
    if case.impl == "torch_compile":
        extra["compile_graphs"] = counters["stats"].get("unique_graphs", 0)
        extra["compile_graph_breaks"] = sum(counters["graph_break"].values())
    if case.impl == "smptk":
        routing = _ROUTING_MEDIAN_S.get((s.name, case.t, case.pass_))
        median = _median_s(benchmark)
        extra["routing_share"] = routing / median if routing is not None and median else None
    record(
        benchmark,
        flops=moe_layer_flops(
            tokens=case.t, hidden=s.H, ffn=s.F, experts=s.E, top_k=s.k, backward=case.backward
        ),
        nbytes=moe_layer_bytes(
            tokens=case.t,
            hidden=s.H,
            ffn=s.F,
            experts=s.E,
            top_k=s.k,
            elem=MODE.dtype.itemsize,
            backward=case.backward,
        ),
        kernel_path=kernel_path,
        l2_flush_bytes=l2_flusher.nbytes,
        spin_us=l2_flusher.spin_us,
        **timed,
        **extra,
    )


@pytest.mark.parametrize("case", CASES["grouped"], ids=[c.id for c in CASES["grouped"]])
def test_grouped_gemm(benchmark: Any, case: MoECase, l2_flusher: Any, record: Callable[..., Any]) -> None:
    s = case.shape
    M = case.pairs
    gen = torch.Generator(device=MODE.device).manual_seed(_seed(case) + 1)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, device=MODE.device, dtype=MODE.dtype).mul_(scale)
        return t.requires_grad_(case.backward)

    x = randn(M, s.H, scale=1.0)
    if case.impl == "torch_matmul":
        w = randn(s.F, s.H, scale=s.H**-0.5)
        forward = lambda: torch.matmul(x, w.T)
        kernel_path = "torch.matmul (cuBLAS)" if MODE.device == "cuda" else "torch.matmul (CPU)"

        def reference() -> torch.Tensor:
            from smptk.testing import linear_reference

            return linear_reference(x.detach(), w.detach())
    else:
        from smptk.kernels.grouped_linear import grouped_linear

        w = randn(s.E, s.F, s.H, scale=s.H**-0.5)
        offsets = even_offsets(M, s.E, MODE.device)
        forward = lambda: grouped_linear(x, w, offsets)
        kernel_path = _triton_path(x, w)

        def reference() -> torch.Tensor:
            from smptk.testing.grouped import grouped_linear_reference

            return grouped_linear_reference(x.detach(), w.detach(), offsets.tolist())

    def check(out: torch.Tensor) -> dict[str, Any]:
        with torch.no_grad(), _NoTF32():
            ref = reference()
        return _close(case.id, out, ref)

    benchmark.group = f"grouped_gemm {case.pass_} M={M} K={s.H} N={s.F} E={s.E}"
    timed = _time(benchmark, case, forward, [x, w], check, (M, s.F), l2_flusher)
    flops = linear_flops(m=M, k=s.H, n=s.F, backward=case.backward)
    median = _median_s(benchmark)
    tflops = flops / median / 1e12 if median else None
    extra: dict[str, Any] = {}
    if case.impl == "torch_matmul":
        if tflops:
            _DENSE_TFLOPS[(case.t, case.pass_)] = tflops
    else:
        dense = _DENSE_TFLOPS.get((case.t, case.pass_))
        extra["pct_of_dense"] = 100 * tflops / dense if tflops and dense else None
    record(
        benchmark,
        flops=flops,
        nbytes=linear_bytes(
            m=M,
            k=s.H,
            n=s.F,
            elem=MODE.dtype.itemsize,
            bias=False,
            backward=case.backward,
            weights=s.E if case.impl == "smptk" else 1,
        ),
        kernel_path=kernel_path,
        l2_flush_bytes=l2_flusher.nbytes,
        spin_us=l2_flusher.spin_us,
        **timed,
        **extra,
    )
