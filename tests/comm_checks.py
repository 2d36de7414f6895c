"""Checks, inputs and torch.distributed references shared by the comm test jobs (``comm_jobs.py``).

- :class:`Case` collects one case's failures on one rank (``equal``, ``rounded``, ``close``, ``path``,
  ``same``, ``guards``): a failed check is recorded, not raised, so a job reports every failure at once.
- :func:`sample` draws seeded per-rank inputs; :func:`poisoned` returns an output view with poisoned
  guard elements on both sides (NaN, or ``INT_POISON`` for int32).
- :func:`gloo_all_reduce` / :func:`gloo_reduce_scatter`: gloo's result on the same inputs, in fp32
  (int32 stays int32), so sums of low-precision inputs are exact or fp32-accurate.
- :func:`expect_raises`: None when a call raises the expected error with the expected text.

Example::

    >>> c = Case("demo", [])
    >>> c.equal("x", torch.ones(2), torch.zeros(2))
    >>> c.problems
    ['x: 2 of 2 elements differ; first at flat index 0: got 1.0, expected 0.0']
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import smptk.comm as comm
from smptk.kernels import runtime
from smptk.testing import tolerance

HEAP_BYTES = 4096  # the smallest heap configure() takes: 1024 fp32 elements, so chunking is cheap to reach
JOB_MAX_SMS = 2  # default programs per call in the jobs; cases that vary it pass max_sms explicitly
JOB_TIMEOUT_S = 30.0  # comm timeout_s in the jobs: a desync surfaces as CommTimeoutError, not a harness kill
MISSING_TIMEOUT_S = 2.0  # timeout_s of the never-calling-rank cases
GUARD = 300  # poisoned elements each side of every output (> BLOCK_INTERPRETER = 256)
INT_POISON = -123456789

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
}
OPS = ("sum", "avg", "max", "min")
ALGORITHMS = ("one_shot", "two_shot")
GLOO_OP = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}

# torch 2.13 renamed these two (the old names warn); the GPU machine's torch 2.11 has only the old ones.
dist_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
dist_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def heap_elems(dtype: torch.dtype) -> int:
    return HEAP_BYTES // torch.empty((), dtype=dtype).element_size()


def all_reduce_sizes(dtype: torch.dtype) -> tuple[int, ...]:
    """Exact (small-integer) sizes; N(0, 1) inputs use ALL_REDUCE_NORMAL_N (one chunk, 4 tiles, odd)."""
    return (0, 1, 7, heap_elems(dtype) + 77)


ALL_REDUCE_NORMAL_N = 1001


def reduce_scatter_sizes(dtype: torch.dtype, world: int) -> tuple[int, ...]:
    """Exact output sizes; the last is past one chunk (a chunk stages W blocks of heap / W elements)."""
    return (0, 1, 7, heap_elems(dtype) // world + 7)


def reduce_scatter_normal_n(dtype: torch.dtype, world: int) -> int:
    """N(0, 1) output size: one chunk, odd."""
    return heap_elems(dtype) // world - 1


def all_gather_sizes(dtype: torch.dtype) -> tuple[int, ...]:
    return (0, 1, 7, 1001, heap_elems(dtype) + 3)


# --------------------------------------------------------------------------------------------- checking


@dataclass
class Case:
    """The failures one case collected on this rank; methods record, they do not raise."""

    cid: str
    problems: list[str]

    def fail(self, what: str) -> None:
        self.problems.append(what)

    def path(self, what: str, expected: str) -> None:
        got = comm.last_path()
        if got != expected:
            self.fail(f"{what}: last_path() = {got!r}, expected {expected!r}")

    def equal(self, what: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        """Exact equality (dtype, shape, every element; NaN never equals, so unwritten poison fails)."""
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            got = f"{actual.dtype}{tuple(actual.shape)}"
            self.fail(f"{what}: got {got}, expected {expected.dtype}{tuple(expected.shape)}")
            return
        if torch.equal(actual, expected):
            return
        a, e = actual.reshape(-1), expected.reshape(-1)
        bad = (a != e).nonzero().reshape(-1)
        i = int(bad[0])
        self.fail(
            f"{what}: {bad.numel()} of {a.numel()} elements differ; first at flat index {i}: "
            f"got {a[i].item()!r}, expected {e[i].item()!r}"
        )

    def rounded(self, what: str, actual: torch.Tensor, reference: torch.Tensor) -> None:
        """``actual`` is the exact fp32/int32 ``reference`` rounded once to actual's dtype.

        To nearest; bf16 under the interpreter may also round toward zero (Triton 3.9's interpreter
        converts fp32 to bf16 by truncation, see :meth:`close`), so there it may be either neighbour.
        """
        nearest = reference.to(actual.dtype)
        if (
            actual.dtype != torch.bfloat16
            or not runtime.interpreter_enabled()
            or torch.equal(actual, nearest)
        ):
            self.equal(what, actual, nearest)
            return
        toward_zero = (reference.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
        bad = ~((actual == nearest) | (actual == toward_zero))
        if bad.any():
            i = int(bad.reshape(-1).nonzero()[0])
            self.fail(
                f"{what}: {int(bad.sum())} of {actual.numel()} elements are neither neighbour of the exact "
                f"result; first at flat index {i}: got {actual.reshape(-1)[i].item()!r}, exact "
                f"{reference.reshape(-1)[i].item()!r}"
            )

    def close(
        self, what: str, actual: torch.Tensor, expected: torch.Tensor, *, world: int, scale: torch.Tensor
    ) -> None:
        """An fp32-accumulated sum of W terms, rounded once to actual's dtype, vs the fp32 reference.

        The bound is ``smptk.testing.tolerance(dtype, W)`` (final rounding u_d * |expected| plus fp32
        accumulation over W terms of root-sum-square ``scale``), except bf16 under the interpreter:
        Triton 3.9's interpreter converts fp32 to bf16 by truncation (``cast_impl`` calls ``_convert_float``
        with no rounding mode), so the final rounding there is up to one bf16 ulp, 2 * u_d * |expected|.
        """
        tol = tolerance(actual.dtype, world)
        e = expected.to(torch.float64)
        bound = tol.bound(e, scale.to(torch.float64))
        if actual.dtype == torch.bfloat16 and runtime.interpreter_enabled():
            bound = bound + tol.rtol * e.abs()
        err = (actual.to(torch.float64) - e).abs()
        bad = ~(err <= bound)  # NaN (unwritten poison) fails too
        if bad.any():
            i = int(bad.nonzero()[0])
            self.fail(
                f"{what}: {int(bad.sum())} of {e.numel()} elements outside the tolerance; first at {i}: "
                f"got {actual[i].item()!r}, expected {e[i].item()!r}, |error| {err[i].item():.3g} > "
                f"bound {bound[i].item():.3g} ({tol.describe()})"
            )

    def same(self, what: str, returned: object, output: torch.Tensor) -> None:
        if returned is not output:
            self.fail(f"{what}: returned {type(returned).__name__}, not the output tensor it was given")

    def guards(self, what: str, buf: torch.Tensor, start: int, numel: int) -> None:
        """The poisoned elements around ``buf[start : start + numel]`` are untouched."""
        outside = torch.cat([buf[:start], buf[start + numel :]])
        intact = outside.isnan().all() if buf.is_floating_point() else (outside == INT_POISON).all()
        if not bool(intact):
            self.fail(f"{what}: wrote outside the output (guard elements changed)")


def seeded_gen(*key: object) -> torch.Generator:
    """Same seed for the same key on every run (zlib, not hash(): str hashes differ across processes)."""
    return torch.Generator().manual_seed(zlib.crc32("/".join(map(str, key)).encode()))


def sample(kind: str, dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """int32: uniform in +-2^28 (sums of 4 fit). Floats: "int" = integers in [-8, 8] (sums and averages
    exact in every dtype), "normal" = N(0, 1) rounded to dtype."""
    if dtype == torch.int32:
        return torch.randint(-(2**28), 2**28, shape, generator=gen, dtype=torch.int32)
    if kind == "int":
        return torch.randint(-8, 9, shape, generator=gen).to(dtype)
    return torch.randn(shape, generator=gen).to(dtype)


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): a contiguous ``shape`` view at offset GUARD into a poisoned buffer with guards."""
    numel = math.prod(shape)
    fill = float("nan") if dtype.is_floating_point else INT_POISON
    buf = torch.full((numel + 2 * GUARD,), fill, dtype=dtype)
    return buf, buf[GUARD : GUARD + numel].view(shape)


def _reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reductions are referenced in fp32 (int32 in int32): exact upcasts, one rounding at the end."""
    return torch.int32 if dtype == torch.int32 else torch.float32


def gloo_all_reduce(x: torch.Tensor, op: str, world: int) -> torch.Tensor:
    ref = x.to(_reference_dtype(x.dtype), copy=True)  # never x itself: the caller still needs its input
    dist.all_reduce(ref, op=GLOO_OP[op])
    return ref / world if op == "avg" else ref


def gloo_reduce_scatter(x: torch.Tensor, op: str, world: int) -> torch.Tensor:
    src = x.to(_reference_dtype(x.dtype), copy=True)
    ref = torch.empty(x.numel() // world, dtype=src.dtype)
    dist_reduce_scatter(ref, src.reshape(-1), op=GLOO_OP[op])
    return ref / world if op == "avg" else ref


def expect_raises(call: Callable[[], object], exc: type, text: str) -> str | None:
    """None when ``call`` raises ``exc`` (or a subclass) with ``text`` in its message; else what happened."""
    try:
        call()
    except exc as e:
        return (
            None if text in str(e) else f"raised {type(e).__name__}({str(e)!r}); the message lacks {text!r}"
        )
    except Exception as e:
        return f"raised {type(e).__name__}({str(e)!r}), expected {exc.__name__} containing {text!r}"
    return f"no error, expected {exc.__name__} containing {text!r}"
