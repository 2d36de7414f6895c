"""smptk.comm's engine adapters: DDP and FSDP2 steps give the parameters of the default collectives.

Two and three real processes (gloo + the CPU symmetric heap under the Triton interpreter). Each job trains
one model with the engine's own collectives and a copy with smptk's adapters on identical per-rank data;
parameters must agree to float32 rounding (the sums run in a different order), and the smptk copy must
really have gone through the symmetric path (counted per call), so a silent fallback fails the test.
"""

from __future__ import annotations

import pytest
from comm_adapter_jobs import ENGINES
from comm_harness import run_ranks

# fp32 rounding of a W-term sum taken in another order, over 3 SGD steps with lr 0.1: ~1e-7 relative;
# 1e-5 absolute on O(1) parameters leaves room for it and catches any wrong average (O(1e-2) or more).
ATOL = 1e-5


_jobs: dict = {}


def _job(world: int):
    """One spawned job per world size runs every engine (``comm_adapter_jobs.all_engines``)."""
    if world not in _jobs:
        _jobs[world] = run_ranks("comm_adapter_jobs:all_engines", world=world, timeout_s=300)
    return _jobs[world]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_adapter_matches_default_collectives(engine: str, world: int) -> None:
    job = _job(world)
    job.raise_for_failure()
    for rank, values in enumerate(job.values):
        value = values[engine]
        assert value["max_diff"] <= ATOL, f"rank {rank}: parameters differ by {value['max_diff']}"
        assert value["symmetric_calls"] > 0, f"rank {rank}: no collective took smptk's path"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("edge", ["sparse", "fp16_avg", "fp16_avg_rs"])
def test_adapter_edges(edge: str, world: int) -> None:
    """Sparse DDP buckets match plain DDP; the fallback's fp16 average does not overflow (see
    ``comm_adapter_jobs.edges``)."""
    job = _job(world)
    job.raise_for_failure()
    for rank, values in enumerate(job.values):
        got = values["edges"][edge]
        assert got <= ATOL, f"rank {rank}, {edge}: off by {got}"


def test_adapter_arguments_are_checked_when_made() -> None:
    """A bad max_sms used to be taken, then fail at the first backward inside DDP's reducer or FSDP. 0 is
    the copy-engine path for the all-gather only."""
    from smptk.comm.adapters import SmptkAllGather, SmptkHookState, SmptkReduceScatter

    for make in (SmptkHookState, SmptkReduceScatter, SmptkAllGather):
        for bad in (-1, 257, 2.5, True):
            with pytest.raises(ValueError, match="max_sms: expected"):
                make(max_sms=bad)
    with pytest.raises(ValueError, match="max_sms: expected"):
        SmptkHookState(max_sms=0)
    with pytest.raises(ValueError, match="max_sms: expected"):
        SmptkReduceScatter(max_sms=0)
    assert SmptkAllGather(max_sms=0).max_sms == 0 and SmptkHookState(max_sms=7).max_sms == 7
    with pytest.raises(TypeError, match="group: expected a ProcessGroup or None, got int"):
        SmptkHookState(group=0)
