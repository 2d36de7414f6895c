"""bench/tp_dist.py: shapes, FLOP count, the reference check, row fields, and one quick run under torchrun.

The end-to-end test runs ``torchrun --nproc-per-node 2 -m bench.tp_dist --quick --device cpu --rounds 1
--warmup 0`` as ``make bench`` does on a CPU (gloo, Triton interpreter over a POSIX shared-memory heap,
fp32, tiny shapes) into a temporary JSONL file and checks every row: each implementation passed its
correctness check before it was timed, smptk's fused case really ran the fused all-gather GEMM, the rows
are labelled CPU functional numbers, and torch's async TP is a skipped row that says why. The unit tests'
numbers are synthetic.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from bench.config import CPU_NOTE
from bench.rows import SCHEMA, read_rows
from bench.tp_dist import (
    IMPLS,
    NEEDS_RANKS,
    SUITE,
    async_tp_unavailable,
    launch,
    make_row,
    pair_flops,
    reference,
    shape_for,
)

E2E_TIMEOUT_S = 240


def test_shapes_and_flops() -> None:
    assert shape_for("measure", "cuda", 8) == {"S": 8192, "H": 8192, "F": 28672}
    assert shape_for("quick", "cpu", 2) == {"S": 12, "H": 20, "F": 24}
    assert shape_for("quick", "cuda", 4) == {"S": 512, "H": 256, "F": 512}
    with pytest.raises(ValueError, match=r"S=8192 \(tokens\) is not divisible by the tensor-parallel size 3"):
        shape_for("measure", "cuda", 3)
    with pytest.raises(ValueError, match="world"):
        shape_for("quick", "cpu", 0)
    with pytest.raises(ValueError, match="mode"):
        shape_for("fast", "cpu", 2)
    assert pair_flops({"S": 8192, "H": 8192, "F": 28672}) == 4 * 8192 * 8192 * 28672


def test_async_tp_reasons() -> None:
    assert "CUDA only" in async_tp_unavailable("cpu", 8)
    assert async_tp_unavailable("cuda", 1) == NEEDS_RANKS


def test_make_row_needs_a_reason_for_skips() -> None:
    env = {"git_sha": "0" * 40, "note": "synthetic environment for a test"}
    row = make_row("measurement", "smptk_fused-sp", env, {"world_size": 2}, {"impl": "smptk_fused"})
    assert row["schema"] == SCHEMA and row["suite"] == SUITE and row["kind"] == "measurement"
    assert row["test_id"] == "bench/tp_dist.py::smptk_fused-sp" and row["world_size"] == 2
    with pytest.raises(ValueError, match="reason"):
        make_row("skipped", "x", env, {}, {})


def test_reference_tolerance_passes_a_bf16_pipeline_and_catches_a_lost_block() -> None:
    gen = torch.Generator().manual_seed(3)
    S, H, F, world = 16, 40, 48, 4
    x = torch.randn(S, H, generator=gen).bfloat16()
    w1 = (torch.randn(F, H, generator=gen) / H**0.5).bfloat16()
    w2 = (torch.randn(H, F, generator=gen) / F**0.5).bfloat16()
    expected, scale, tol = reference(x, w1, w2, torch.bfloat16, world)
    # what a TP pair in bf16 does: GEMM, GELU stored in bf16, per-rank partial sums added in bf16
    h = torch.nn.functional.gelu((x.float() @ w1.float().T).bfloat16().float()).bfloat16()
    parts = [(h[:, r::world].float() @ w2[:, r::world].float().T).bfloat16() for r in range(world)]
    y = parts[0]
    for p in parts[1:]:
        y = (y.float() + p.float()).bfloat16()
    assert ((y.float() - expected).abs() <= tol.bound(expected, scale)).all()
    lost = sum(p.float() for p in parts[1:])  # one rank's partial sums never arrived
    assert not ((lost - expected).abs() <= tol.bound(expected, scale)).all()


def test_quick_run_under_torchrun_writes_checked_rows(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMPTK_COMM_")}
    env["SMPTK_BENCH_RUN_ID"] = "test-tp-dist-e2e"
    args = ["--quick", "--device", "cpu", "--rounds", "1", "--warmup", "0", "--jsonl", str(out)]
    done = launch(2, args, timeout_s=E2E_TIMEOUT_S, env=env)
    assert not done.timed_out, f"torchrun ran past {E2E_TIMEOUT_S} s:\n{done.tail()}"
    assert done.returncode == 0, f"torchrun exited with {done.returncode}:\n{done.tail()}"
    rows = {(r["impl"], r["config"]): r for r in read_rows(out)}
    assert set(rows) == {(impl, config) for impl in IMPLS for config in ("sp", "no_sp")}
    measured = [k for k, r in rows.items() if r["kind"] == "measurement"]
    expected = [("smptk_fused", "sp"), ("smptk_unfused", "sp"), ("smptk_unfused", "no_sp")]
    expected += [("torch_dtensor", "sp"), ("torch_dtensor", "no_sp")]
    assert sorted(measured) == sorted(expected)
    for key in measured:
        row = rows[key]
        assert row["check"]["passed"] and row["check"]["worst_err_over_tol"] < 1, (key, row["check"])
        assert (row["mode"], row["note"], row["timer"], row["backend"]) == ("quick", CPU_NOTE, "host", "gloo")
        assert (row["world"], row["tp"], row["world_size"], row["dtype"]) == (2, 2, 2, "float32")
        assert row["shape"] == {"S": 12, "H": 20, "F": 24} and row["run_id"] == "test-tp-dist-e2e"
        assert row["time_s"]["median"] > 0 and row["tflops"] > 0 and row["env"]["git_sha"]
        assert row["flops"] * row["world"] == row["flops_total"] == pair_flops(row["shape"])
        assert row["tflops"] == pytest.approx(row["flops"] / row["time_s"]["median"] / 1e12)
        assert row["sequence_parallel"] == (key[1] == "sp")
    fused = rows[("smptk_fused", "sp")]
    assert (fused["path"], fused["path_reason"], fused["comm_max_sms"]) == ("fused", None, 8)
    assert (fused["column_path"], fused["row_path"]) == ("fused", "fused")
    assert rows[("smptk_unfused", "sp")]["path"] == "unfused"
    assert rows[("smptk_unfused", "sp")]["sequence_dim"] == 1
    assert rows[("torch_dtensor", "sp")]["comm_max_sms"] is None
    for key in (("torch_async_tp", "sp"), ("torch_async_tp", "no_sp"), ("smptk_fused", "no_sp")):
        assert rows[key]["kind"] == "skipped" and "time_s" not in rows[key], key
    assert "CUDA only" in rows[("torch_async_tp", "sp")]["reason"]
    assert "no sequence parallelism" in rows[("smptk_fused", "no_sp")]["reason"]
