"""smptk.comm.functional (differentiable collectives) on 2 and 4 gloo ranks vs single-process references.

One spawned job per world size (``comm_harness.run_ranks``: gloo, Triton interpreter, so fp32 runs the
symmetric-heap kernels and float64 the torch.distributed fallback); what each case checks is in
``functional_jobs.py``. Each test reads one case's outcome on every rank.

The ranks run with 1 program per collective and a 64 KiB heap (every message here is tiny): the
interpreter runs each program in Python, and building each group's default 64 MiB heap dominated the
job. Measured on 2 shared cores: the 2-rank job took 44 s with the defaults, 13.5 s with these.
"""

from __future__ import annotations

import pytest
from comm_harness import JobResult, run_ranks
from functional_jobs import CASES

WORLDS = (2, 4)
DEADLINE_S = {2: 120, 4: 180}
ENV = {"SMPTK_COMM_MAX_SMS": "1", "SMPTK_COMM_HEAP_BYTES": str(64 * 1024)}
_jobs: dict[int, JobResult] = {}


def _job(world: int) -> JobResult:
    if world not in _jobs:
        _jobs[world] = run_ranks("functional_jobs:run", world, timeout_s=DEADLINE_S[world], env=ENV)
    return _jobs[world]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
def test_functional_collective_matches_reference(world: int, case: str) -> None:
    result = _job(world)
    result.raise_for_failure()
    problems = [f"rank {r}: {o[case]}" for r, o in enumerate(result.values) if o[case] is not None]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
def test_job_leaves_no_shm(world: int) -> None:
    assert _job(world).leftover_shm == []
