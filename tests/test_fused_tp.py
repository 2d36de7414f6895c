"""The fused tensor-parallel linears (all-gather + GEMM, GEMM + reduce-scatter; each one's backward runs the
other's kernel) on 2 and 4 gloo ranks vs float64 references.

One spawned job per world size (``comm_harness.run_ranks``: gloo, Triton interpreter, so fp32 runs the fused
kernel on the CPU symmetric heap, and algorithm="unfused" the fallback); what each case checks is in
``fused_tp_jobs.py``. A 64 KiB heap per job (every block here is under 1 KiB), as the collectives' tests.
"""

from __future__ import annotations

import pytest
from comm_harness import JobResult, run_ranks
from fused_tp_jobs import ROWS

WORLDS = (2, 4)
DEADLINE_S = {2: 180, 4: 300}
ENV = {"SMPTK_COMM_HEAP_BYTES": str(64 * 1024)}
CASES = (
    "fused_gelu_bias",
    "fused_plain",
    "unfused",
    "bad_input",
    "mismatch",
    "shape_mismatch",
    "missing_rank",
)
SCATTER_CASES = tuple(f"scatter_{c}" for c in ("bias", "plain", "unfused", "bad_input", "missing_rank"))
PAIR_CASES = ("selective", "flops")
_jobs: dict[int, JobResult] = {}


def _job(world: int) -> JobResult:
    if world not in _jobs:
        _jobs[world] = run_ranks("fused_tp_jobs:run", world, timeout_s=DEADLINE_S[world], env=ENV)
    return _jobs[world]


def _assert_case(world: int, case: str) -> None:
    assert world in ROWS
    result = _job(world)
    result.raise_for_failure()
    problems = [f"rank {r}: {o[case]}" for r, o in enumerate(result.values) if o[case] is not None]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
def test_all_gather_linear(world: int, case: str) -> None:
    _assert_case(world, case)


@pytest.mark.parametrize("case", SCATTER_CASES)
@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
def test_linear_reduce_scatter(world: int, case: str) -> None:
    _assert_case(world, case)


@pytest.mark.parametrize("case", PAIR_CASES)
@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
def test_fused_pair(world: int, case: str) -> None:
    _assert_case(world, case)


@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
def test_job_leaves_no_shm(world: int) -> None:
    assert _job(world).leftover_shm == []
