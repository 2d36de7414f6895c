"""Benchmark: fused_linear (no activation and gelu, with bias) and swiglu against torch, fwd and fwd+bwd.

Implementations, side by side in the same run and on the same inputs:

- ``smptk``: :func:`smptk.kernels.fused_linear` / :func:`smptk.kernels.swiglu` (the path that ran is in
  each row's ``kernel_path``).
- ``torch_eager``: what an eager model does. fused_linear: ``act(F.linear(x, w, b))`` -- nn.Linear's own
  call (cuBLAS GEMM with the bias applied by the GEMM's addmm) followed by a separate activation op.
  Splitting the bias out into its own op would handicap the baseline with an M x N round trip no eager
  model makes, so it is not done. swiglu: ``F.silu(F.linear(x, wg)) * F.linear(x, wu)``, two GEMMs and
  separate silu and multiply.
- ``torch_compile``: ``torch.compile(<the eager function>, dynamic=False)``, recompiled per shape from a
  reset dynamo (so the recompile limit never silently drops a shape back to eager).
- ``torch_matmul``: ``x @ w.T`` alone, the cuBLAS ceiling for the ">= 90% of torch.matmul TFLOP/s"
  target. For swiglu it is one GEMM against a ``[2N, K]`` weight: the same FLOPs as gate + up, in one call.

FLOPs: 2*M*N*K per forward GEMM (swiglu: 2 GEMMs), backward 2x the forward; bytes are compulsory traffic
(:mod:`bench.counts`). Before timing, each ``fwd`` case checks its output against smptk.testing's fp32
reference with a coarse tolerance (3% of the reference's largest value): loose enough for any
implementation's rounding, tight enough to stop a wrong result from being timed. Exact numerics are the
job of tests/ (smptk.testing.assert_close and its rounding model); this only guards the benchmark.

Select with ``-k``: ids read ``<op>-<pass>-M<m>-K<k>-N<n>-<impl>``, e.g.
``python -m bench --filter "swiglu and fwd_bwd and smptk"``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from bench.config import current_mode
from bench.counts import linear_bytes, linear_flops
from bench.timing import CLOCK
from smptk.testing import linear_reference, swiglu_reference

pytestmark = pytest.mark.benchmark(timer=CLOCK, disable_gc=True, warmup=False)

MODE = current_mode()  # bench/conftest.py has already prepared the process (TRITON_INTERPRET on a CPU)
OPS = (("fused_linear", None), ("fused_linear", "gelu"), ("swiglu", None))
PASSES = ("fwd", "fwd+bwd")
IMPLS = ("smptk", "torch_eager", "torch_compile", "torch_matmul")
CHECK_REL_TOL = 0.03  # of max |reference|: rounding of bf16/fp16 outputs is < 0.4%, a wrong kernel is O(1)


@dataclasses.dataclass(frozen=True)
class LinearCase:
    """One benchmark: an op (+ activation), a pass, a shape and an implementation."""

    op: str
    activation: str | None
    pass_: str
    m: int
    k: int
    n: int
    impl: str

    @property
    def backward(self) -> bool:
        return self.pass_ == "fwd+bwd"

    @property
    def op_label(self) -> str:
        return f"{self.op}_{self.activation or 'none'}" if self.op == "fused_linear" else self.op

    @property
    def id(self) -> str:
        pass_id = self.pass_.replace("+", "_")
        return f"{self.op_label}-{pass_id}-M{self.m}-K{self.k}-N{self.n}-{self.impl}"

    def fields(self) -> dict[str, Any]:
        """The case as row fields (see :mod:`bench.rows`)."""
        return {
            "suite": "linear",
            "op": self.op,
            "activation": self.activation,
            "bias": self.op == "fused_linear",
            "pass": self.pass_,
            "impl": self.impl,
            "dtype": str(MODE.dtype).removeprefix("torch."),
            "shape": {"M": self.m, "K": self.k, "N": self.n},
        }


CASES = [
    LinearCase(op, act, pass_, m, k, n, impl)
    for op, act in OPS
    for pass_ in PASSES
    for m in MODE.m_values
    for k, n in MODE.kn_values
    for impl in IMPLS
]


def _eager_linear_none(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w, b)


def _eager_linear_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(F.linear(x, w, b))


def _eager_swiglu(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> torch.Tensor:
    return F.silu(F.linear(x, wg)) * F.linear(x, wu)


def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.T


def _eager_fn(case: LinearCase) -> Callable[..., torch.Tensor]:
    if case.op == "swiglu":
        return _eager_swiglu
    return _eager_linear_gelu if case.activation == "gelu" else _eager_linear_none


def _inputs(case: LinearCase) -> dict[str, torch.Tensor]:
    """Random inputs at nn.Linear-like scale (outputs O(1)), from a fixed seed; leaves need grad for bwd."""
    gen = torch.Generator(device=MODE.device).manual_seed(1000 * case.m + 10 * case.k + case.n)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, device=MODE.device, dtype=MODE.dtype) * scale
        return t.requires_grad_(case.backward)

    w_scale = case.k**-0.5
    t = {"x": rand(case.m, case.k)}
    if case.impl == "torch_matmul":
        t["w"] = rand(2 * case.n if case.op == "swiglu" else case.n, case.k, scale=w_scale)
    elif case.op == "swiglu":
        t["wg"], t["wu"] = rand(case.n, case.k, scale=w_scale), rand(case.n, case.k, scale=w_scale)
    else:
        t["w"], t["b"] = rand(case.n, case.k, scale=w_scale), rand(case.n, scale=0.1)
    return t


def _target(case: LinearCase, t: dict[str, torch.Tensor]) -> tuple[Callable[[], torch.Tensor], str]:
    """The forward call to time and a description of the code path it runs."""
    on_gpu = MODE.device == "cuda"
    if case.impl == "torch_matmul":
        return (lambda: _matmul(t["x"], t["w"])), "torch.matmul (cuBLAS)" if on_gpu else "torch.matmul (CPU)"
    args = (t["x"], t["wg"], t["wu"]) if case.op == "swiglu" else (t["x"], t["w"], t["b"])
    if case.impl == "torch_eager":
        fn = _eager_fn(case)
        return (lambda: fn(*args)), "torch eager (cuBLAS + epilogue ops)" if on_gpu else "torch eager (CPU)"
    if case.impl == "torch_compile":
        torch._dynamo.reset()
        compiled = torch.compile(_eager_fn(case), dynamic=False)
        return (lambda: compiled(*args)), "torch.compile (inductor, default mode)"
    from smptk.kernels import fused_linear, runtime, swiglu

    path = runtime.select_path(*args[:2])
    if path == "triton" and runtime.interpreter_enabled():
        path = "triton (interpreter)"
    if case.op == "swiglu":
        return (lambda: swiglu(*args)), path
    act = case.activation
    return (lambda: fused_linear(*args, activation=act)), path


def _reference(case: LinearCase, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp32 reference of what ``case.impl`` computes (smptk.testing's, independent of the kernels)."""
    if case.impl == "torch_matmul":
        return linear_reference(t["x"], t["w"])
    if case.op == "swiglu":
        return swiglu_reference(t["x"], t["wg"], t["wu"])
    return linear_reference(t["x"], t["w"], t["b"], case.activation)


def _check(case: LinearCase, t: dict[str, torch.Tensor], out: torch.Tensor) -> dict[str, float]:
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the references are IEEE fp32 (and refuse TF32)
    try:
        ref = _reference(case, t)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    assert out.shape == ref.shape, f"{case.id}: output shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    err = (out.detach().float() - ref).abs().max().item()
    ref_max = ref.abs().max().item()
    tol = CHECK_REL_TOL * ref_max + 1e-3
    assert err <= tol, (
        f"{case.id}: max |out - fp32 reference| = {err:.4g} > {tol:.4g} (max |ref| {ref_max:.4g})"
    )
    return {"max_abs_err": err, "ref_max_abs": ref_max, "tol": tol}


def _compile_skip_reason() -> str | None:
    """Why torch_compile cannot run here, or None.

    On a CPU, inductor generates C++ and needs a compiler. Quick mode on a CPU does run torch_compile
    otherwise: its 24 compilations took 35 s of a 63 s quick run on 2 cores with a cold inductor cache
    (the whole run took 30 s with a warm cache).
    """
    if MODE.device == "cpu" and not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")):
        return "torch.compile on a CPU needs a C++ compiler for inductor; none found (g++, clang++ or $CXX)"
    return None


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_linear(benchmark: Any, case: LinearCase, l2_flusher: Any, record: Callable[..., Any]) -> None:
    if case.impl == "torch_compile" and (reason := _compile_skip_reason()):
        pytest.skip(reason)
    t = _inputs(case)
    forward, kernel_path = _target(case, t)

    if case.backward:
        dy = torch.randn(
            case.m, 2 * case.n if (case.op, case.impl) == ("swiglu", "torch_matmul") else case.n,
            device=MODE.device, dtype=MODE.dtype,
        )  # fmt: skip
        leaves = list(t.values())

        def target() -> None:
            forward().backward(dy)

        def setup() -> None:
            for leaf in leaves:
                leaf.grad = None
            l2_flusher.flush()
    else:
        target, setup = forward, l2_flusher.flush

    # First call, untimed: Triton JIT + autotuning, inductor compilation, cuBLAS heuristics. Its host time
    # is recorded (first_call_s) because compile cost is part of what a user pays.
    t0 = time.perf_counter()
    first = target()
    if MODE.device == "cuda":
        torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0
    check = _check(case, t, first) if not case.backward else None
    del first

    benchmark.group = f"{case.op_label} {case.pass_} M={case.m} K={case.k} N={case.n}"
    benchmark.pedantic(target, setup=setup, rounds=MODE.rounds, warmup_rounds=MODE.warmup_rounds)

    is_swiglu = case.op == "swiglu"
    n_eff = 2 * case.n if is_swiglu and case.impl == "torch_matmul" else case.n
    gemms = 2 if is_swiglu and case.impl != "torch_matmul" else 1
    weights = 2 if is_swiglu and case.impl != "torch_matmul" else 1
    bias = case.op == "fused_linear" and case.impl != "torch_matmul"
    record(
        benchmark,
        flops=linear_flops(m=case.m, k=case.k, n=n_eff, backward=case.backward, gemms=gemms),
        nbytes=linear_bytes(
            m=case.m,
            k=case.k,
            n=n_eff,
            elem=MODE.dtype.itemsize,
            bias=bias,
            backward=case.backward,
            weights=weights,
        ),
        kernel_path=kernel_path,
        check=check,
        first_call_s=first_call_s,
        l2_flush_bytes=l2_flusher.nbytes,
        spin_us=l2_flusher.spin_us,
    )
    if case.impl == "torch_compile":
        torch._dynamo.reset()
