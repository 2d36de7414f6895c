"""The issue-11 targets of bench/targets.py (the fused TP pair vs torch DTensor and vs torch async TP under
torchrun, and vs the sequential torch path in the simulated world), judged on synthetic rows shaped like
bench/tp_dist.py's and bench/test_bench_tp_sim.py's: met, not met, a fallback to the unfused path, a
baseline of another config, too few GPUs, quick-mode rows. None of the numbers is a measurement. The
end-to-end test runs ``python -m bench --quick --filter tp_sim`` on the CPU (Triton interpreter): both
implementations' rows, checked against the fp32 reference, labeled as a simulated world."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import targets as T
from bench.config import CPU_NOTE
from bench.rows import read_rows

ROOT = Path(__file__).resolve().parent.parent

SHAPE = {"S": 8192, "H": 8192, "F": 28672}
VS_DTENSOR = "tp.fused_pair_vs_dtensor"
VS_ASYNC = "tp.fused_pair_vs_async_tp"
VS_SIM = "tp.fused_pair_vs_sequential_sim"
PATHS = {"smptk_fused": "fused", "smptk_unfused": "unfused", "torch_dtensor": "dtensor"}
PATHS["torch_async_tp"] = "async_tp"


def tp_row(impl: str, median_s: float, config: str = "sp", **kw: Any) -> dict[str, Any]:
    """A synthetic measure-mode row of bench/tp_dist.py (the fields the targets read)."""
    row = {
        "kind": "measurement",
        "mode": "measure",
        "note": None,
        "device": "cuda",
        "run_id": "run-1",
        "test_id": f"synthetic::{impl}-{config}",
        "suite": "tp_dist",
        "op": "tp_mlp_pair",
        "activation": "gelu",
        "bias": False,
        "pass": "fwd",
        "config": config,
        "sequence_parallel": config == "sp",
        "world": 8,
        "tp": 8,
        "shape": dict(SHAPE),
        "dtype": "bfloat16",
        "impl": impl,
        "path": PATHS[impl],
        "comm_max_sms": 8 if impl.startswith("smptk") else None,
        "time_s": {"median": median_s},
    }
    return row | kw


def judge(target_id: str, rows: list[dict], gpu_count: int = 8) -> T.Result:
    (target,) = [t for t in T.TARGETS if t.id == target_id]
    return T.evaluate_one(target, rows, gpu_count)


def test_the_targets_of_issue_11_are_in_the_table() -> None:
    found = {t.id: t for t in T.TARGETS if t.issue == 11}
    assert set(found) == {VS_DTENSOR, VS_ASYNC, VS_SIM}
    assert found[VS_DTENSOR].threshold == 1.15 and found[VS_ASYNC].threshold == 1.0
    assert found[VS_SIM].threshold == 1.15 and found[VS_SIM].min_gpus == 1
    assert found[VS_DTENSOR].min_gpus == found[VS_ASYNC].min_gpus == 8
    assert all(t.op == ">=" and t.metric is T.SPEEDUP for t in found.values())


def sim_row(impl: str, median_s: float, **kw: Any) -> dict[str, Any]:
    """A synthetic measure-mode row of bench/test_bench_tp_sim.py."""
    row = tp_row("smptk_fused" if impl == "smptk_fused" else "torch_dtensor", median_s)
    row.update(suite="tp_sim", impl=impl, test_id=f"synthetic::sim-{impl}", world_mode="simulated world: ...")
    row["comm_max_sms"] = 8 if impl == "smptk_fused" else None
    row.pop("path")
    return row | kw


def test_the_simulated_target_on_one_gpu() -> None:
    rows = [sim_row("smptk_fused", 1.0e-3), sim_row("torch_sequential", 1.2e-3)]
    met = judge(VS_SIM, rows, gpu_count=1)
    assert met.status == "met" and met.value == pytest.approx(1.2)
    assert judge(VS_SIM, [rows[0], sim_row("torch_sequential", 1.1e-3)], gpu_count=1).status == "not met"
    # a torchrun row is not a simulated one, nor the other way round
    assert judge(VS_SIM, [rows[0], tp_row("torch_dtensor", 2e-3)], gpu_count=1).status == "not measured"
    assert judge(VS_DTENSOR, [rows[0], tp_row("torch_dtensor", 2e-3)]).status == "not measured"
    wide = sim_row("smptk_fused", 1e-3, comm_max_sms=32)
    assert judge(VS_SIM, [wide, rows[1]], gpu_count=1).status == "not measured"


def test_quick_tp_sim_bench_end_to_end(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMPTK_BENCH_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--filter", "tp_sim", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (jsonl,) = sorted(tmp_path.rglob("*.jsonl"))
    rows = {(r["impl"], r["world"]): r for r in read_rows(jsonl)}
    assert sorted(rows) == sorted((i, w) for w in (2, 3) for i in ("smptk_fused", "torch_sequential"))
    for (impl, world), r in rows.items():
        assert r["kind"] == "measurement" and r["suite"] == "tp_sim" and r["note"] == CPU_NOTE
        assert r["world_mode"].startswith(f"simulated world: {world} peer buffers in one CPU process")
        assert r["check"]["passed"] and r["check"]["worst_err_over_tol"] < 1, r["check"]
        assert r["shape"] == {"S": 6 * world, "H": 20, "F": 12 * world} and r["dtype"] == "float32"
        assert r["time_s"]["median"] > 0 and r["flops"] == 4 * 6 * world * 20 * 12 * world // world
        assert r["gbps"] is None  # bytes are not counted here: no "0 GB/s"
        if impl == "smptk_fused":
            assert r["check"]["gathered_exact"] and r["comm_max_sms"] == 2
            assert r["kernel_path"] == "triton (interpreter)"


def test_met_and_not_met_against_each_baseline() -> None:
    rows = [
        tp_row("smptk_fused", 1.0e-3),
        tp_row("smptk_unfused", 1.3e-3),
        tp_row("torch_dtensor", 1.2e-3),
        tp_row("torch_async_tp", 0.95e-3),
    ]
    vs_dtensor = judge(VS_DTENSOR, rows)
    assert vs_dtensor.status == "met" and vs_dtensor.value == pytest.approx(1.2)
    assert vs_dtensor.test_ids == ("synthetic::smptk_fused-sp", "synthetic::torch_dtensor-sp")
    vs_async = judge(VS_ASYNC, rows)
    assert vs_async.status == "not met" and vs_async.value == pytest.approx(0.95)
    assert vs_async.baseline == "torch_async_tp 0.95 ms"
    # 1.14x is below the 1.15x bar
    assert judge(VS_DTENSOR, [rows[0], tp_row("torch_dtensor", 1.14e-3)]).status == "not met"


def test_the_fused_path_and_its_sm_budget_are_required() -> None:
    fell_back = tp_row("smptk_fused", 1e-3, path="unfused", path_reason="no symmetric heap")
    assert judge(VS_DTENSOR, [fell_back, tp_row("torch_dtensor", 2e-3)]).status == "not measured"
    wide = tp_row("smptk_fused", 1e-3, comm_max_sms=32)
    assert judge(VS_DTENSOR, [wide, tp_row("torch_dtensor", 2e-3)]).status == "not measured"


def test_a_baseline_of_another_config_or_world_does_not_count() -> None:
    fused = tp_row("smptk_fused", 1e-3)
    no_sp = judge(VS_DTENSOR, [fused, tp_row("torch_dtensor", 2e-3, config="no_sp")])
    assert no_sp.status == "not measured" and "no baseline row" in no_sp.reason
    four = judge(VS_DTENSOR, [fused, tp_row("torch_dtensor", 2e-3, world=4, tp=4)])
    assert four.status == "not measured"


def test_too_few_gpus_and_quick_rows_are_not_measured() -> None:
    rows = [tp_row("smptk_fused", 1e-3), tp_row("torch_dtensor", 2e-3)]
    few = judge(VS_DTENSOR, rows, gpu_count=2)
    assert few.status == "not measured" and "needs >= 8 GPUs" in few.reason
    quick = [r | {"mode": "quick", "note": CPU_NOTE} for r in rows]
    result = judge(VS_DTENSOR, quick)
    assert result.status == "not measured" and CPU_NOTE in result.reason
    skipped = tp_row("torch_async_tp", 0.0, kind="skipped", reason="CUDA only", time_s=None)
    missing = judge(VS_ASYNC, [rows[0], skipped])
    assert missing.status == "not measured" and "no baseline row" in missing.reason
