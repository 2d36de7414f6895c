"""Benchmark: the tensor-parallel MLP pair of :mod:`bench.tp_dist`, launched under torchrun.

One test runs ``python -m torch.distributed.run --standalone --nproc-per-node N -m bench.tp_dist --jsonl
<tmp>`` and appends the rows rank 0 wrote to the run's results file (``SMPTK_BENCH_JSONL``); rows carry the
run id of ``python -m bench`` (``SMPTK_BENCH_RUN_ID`` is inherited).

- N is the number of GPUs (measure mode, or quick with ``--quick``); with exactly 1 GPU every case is a
  skipped row saying it needs >= 2 GPUs (no multi-GPU number is made up on one GPU);
- on a CPU, N = 2 in quick mode: gloo, the Triton interpreter over a shared-memory heap, fp32, and rows
  that say "cpu-interpreter: not a performance measurement"; torch's async TP is a skipped row (CUDA only).

The test fails when torchrun exits non-zero (a case failed its correctness check or raised: the message
holds the ranks' stderr tail) or runs past its time limit (``SMPTK_BENCH_TP_DIST_TIMEOUT_S`` overrides it;
torchrun and its ranks are then killed). Rows written before a failure are kept.

Select with ``-k``: ``python -m bench --filter tp_dist``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.config import current_mode
from bench.rows import RowWriter, read_rows, run_id
from bench.tp_dist import SUITE, launch
from smptk import settings

MODE = current_mode()  # bench/conftest.py has already prepared the process
TIMEOUT_ENV = "SMPTK_BENCH_TP_DIST_TIMEOUT_S"
# Measure mode on 8 GPUs: 2 configs x 4 implementations, each a reference check plus 23 rounds of 10
# forwards of ~1.5 ms (estimate, not yet measured), and the NCCL / heap set-up: minutes, not hours.
TIMEOUT_S = {"quick": 600.0, "measure": 1800.0}


def ranks() -> int:
    """Ranks to launch: every GPU (1 on a one-GPU machine), or 2 CPU processes without CUDA."""
    return torch.cuda.device_count() if MODE.device == "cuda" else 2


def _timeout_s() -> float:
    value = settings.bench_tp_dist_timeout_s()  # SMPTK_BENCH_TP_DIST_TIMEOUT_S, checked by smptk.settings
    return TIMEOUT_S[MODE.name] if value is None else value


def test_tp_dist(tmp_path: Path) -> None:
    run_id()  # make sure the ranks inherit this run's id
    args = ["--rounds", str(MODE.rounds), "--warmup", str(MODE.warmup_rounds)]
    if MODE.quick:
        args.append("--quick")
    if MODE.device == "cpu":
        args += ["--device", "cpu"]
    n = ranks()
    timeout_s = _timeout_s()
    out = tmp_path / "rows.jsonl"
    done = launch(n, [*args, "--jsonl", str(out)], timeout_s=timeout_s)
    rows = list(read_rows(out)) if out.exists() else []
    sink = settings.bench_jsonl()
    if sink:
        writer = RowWriter(Path(sink))
        for row in rows:
            writer.write(row)
    assert not done.timed_out, (
        f"torchrun ({n} ranks) ran past {timeout_s:g} s and was killed ({len(rows)} rows kept); "
        f"{TIMEOUT_ENV} sets the limit. Output tail:\n{done.tail()}"
    )
    assert done.returncode == 0, (
        f"torchrun ({n} ranks) exited with {done.returncode} after {done.wall_s:.0f} s ({len(rows)} rows "
        f"kept). Output tail:\n{done.tail()}"
    )
    assert rows, f"torchrun succeeded but wrote no rows to {out}"
    assert {row.get("suite") for row in rows} == {SUITE}
