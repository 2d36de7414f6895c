"""Benchmark: the multi-process comm suites of :mod:`bench.comm_dist`, launched under torchrun.

One test per part (bandwidth, nccl, interference, ddp): each runs ``python -m torch.distributed.run
--standalone --nproc-per-node N -m bench.comm_dist --parts <part> --jsonl <tmp>`` and appends the rows
rank 0 wrote to the run's results file (``SMPTK_BENCH_JSONL``); rows carry the run id of
``python -m bench`` (``SMPTK_BENCH_RUN_ID`` is inherited).

- N is the number of GPUs when there are at least 2 (measure mode, or quick with ``--quick``);
- with exactly 1 GPU, N = 1: the ddp part runs at world 1 and the other parts write "skipped" rows that
  point to the simulated world of bench/test_bench_comm.py;
- on a CPU, N = 2 in quick mode: gloo, the Triton interpreter over a shared-memory heap, and rows that
  say "cpu-interpreter: not a performance measurement".

Where the installed torch cannot cap one NCCL communicator's CTAs (no
``ProcessGroupNCCL.Options().config.max_ctas``), the nccl part runs once more per cap in
:data:`bench.comm_dist.NCCL_MAX_CTAS` with ``NCCL_MAX_CTAS`` set for the whole run; those rows say
``nccl_config: "NCCL_MAX_CTAS=k (env)"``.

A test fails when torchrun exits non-zero (a rank raised, or a correctness check failed: the message
holds its stderr tail) or runs past its time limit (``SMPTK_BENCH_COMM_DIST_TIMEOUT_S`` overrides it;
torchrun and its ranks are then killed). Rows written before a failure are kept.

Select with ``-k``: ``python -m bench --filter comm_dist`` or ``--filter "comm_dist and ddp"``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from bench.comm_dist import NCCL_MAX_CTAS, PARTS, SUITES, launch, nccl_options_class
from bench.config import current_mode
from bench.rows import RowWriter, read_rows, run_id
from smptk import settings

MODE = current_mode()  # bench/conftest.py has already prepared the process
TIMEOUT_ENV = "SMPTK_BENCH_COMM_DIST_TIMEOUT_S"
# Measure mode on 8 GPUs: about 200 smptk and 170 NCCL cases (estimate, not yet measured) plus 8 DDP worlds.
TIMEOUT_S = {"quick": 600.0, "measure": 3 * 3600.0}


def ranks() -> int:
    """Ranks to launch: every GPU (1 on a one-GPU machine), or 2 CPU processes without CUDA."""
    return torch.cuda.device_count() if MODE.device == "cuda" else 2


def _timeout_s() -> float:
    value = settings.bench_comm_dist_timeout_s()  # SMPTK_BENCH_COMM_DIST_TIMEOUT_S, checked by smptk.settings
    return TIMEOUT_S[MODE.name] if value is None else value


def env_cap_runs(part: str, n: int) -> tuple[int, ...]:
    """NCCL max-CTAs values that need a torchrun of their own (``NCCL_MAX_CTAS`` set): the nccl part on
    >= 2 GPUs where this torch cannot cap one communicator (``ProcessGroupNCCL.Options().config``)."""
    if part != "nccl" or MODE.device != "cuda" or n < 2:
        return ()
    return NCCL_MAX_CTAS if nccl_options_class()[0] is None else ()


@pytest.mark.parametrize("part", PARTS)
def test_comm_dist(part: str, tmp_path: Path) -> None:
    run_id()  # make sure the ranks inherit this run's id
    args = ["--parts", part, "--rounds", str(MODE.rounds), "--warmup", str(MODE.warmup_rounds)]
    if MODE.quick:
        args.append("--quick")
    if MODE.device == "cpu":
        args += ["--device", "cpu"]
    n = ranks()
    timeout_s = _timeout_s()
    sink = settings.bench_jsonl()
    runs: list[tuple[str, dict[str, str] | None]] = [("", None)]
    runs += [
        (f" with NCCL_MAX_CTAS={c}", {**os.environ, "NCCL_MAX_CTAS": str(c)}) for c in env_cap_runs(part, n)
    ]
    for i, (what, env) in enumerate(runs):
        out = tmp_path / f"rows{i}.jsonl"
        done = launch(n, [*args, "--jsonl", str(out)], timeout_s=timeout_s, env=env)
        rows = list(read_rows(out)) if out.exists() else []
        if sink:
            writer = RowWriter(Path(sink))
            for row in rows:
                writer.write(row)
        if done.timed_out:
            pytest.fail(
                f"torchrun ({n} ranks, part {part}{what}) ran past {timeout_s:g} s and was killed "
                f"({len(rows)} rows kept); {TIMEOUT_ENV} sets the limit. Output tail:\n{done.tail()}"
            )
        if done.returncode != 0:
            pytest.fail(
                f"torchrun ({n} ranks, part {part}{what}) exited with {done.returncode} after "
                f"{done.wall_s:.0f} s ({len(rows)} rows kept). Output tail:\n{done.tail()}"
            )
        assert rows, f"part {part}{what}: torchrun succeeded but wrote no rows to {out}"
        suites = {row.get("suite") for row in rows}
        assert suites == {SUITES[part]}, f"part {part}{what}: rows of suites {sorted(map(str, suites))}"
