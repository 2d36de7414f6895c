"""``make gpu-check`` (bench/gpu_check.py) and its targets table (bench/targets.py), on any machine.

The targets are judged on synthetic rows (met, not met, missing rows, missing baselines, quick-mode rows,
skipped cases, too few GPUs, several configs where the worst decides); the benchmark order and the
child's deadline are checked on stand-in items and a throwaway test file; one end-to-end run of
``python -m bench.gpu_check`` in quick mode on one tiny case prints the table with every target
"not measured".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from bench import gpu_check
from bench import targets as T
from bench.config import CPU_NOTE

ROOT = Path(__file__).resolve().parent.parent
SHAPE = {"M": 16384, "K": 4096, "N": 14336}
ONE_CASE = "fused_linear_none and fwd and not fwd_bwd and M7 and K16 and smptk"


def row(impl: str, median_s: float, **fields: Any) -> dict[str, Any]:
    """A synthetic measure-mode measurement row (the fields a target reads, nothing else)."""
    base = {
        "kind": "measurement",
        "mode": "measure",
        "note": None,
        "device": "cuda",
        "run_id": "run-1",
        "test_id": f"synthetic::{impl}",
        "impl": impl,
        "time_s": {"median": median_s},
    }
    return base | fields


def linear(impl: str, median_s: float, pass_: str = "fwd", op: str = "fused_linear", **kw: Any) -> dict:
    act = "gelu" if op == "fused_linear" else None
    fields = {"suite": "linear", "op": op, "activation": act, "bias": op == "fused_linear", "pass": pass_}
    fields |= {"dtype": "bfloat16", "shape": dict(SHAPE)}
    return row(impl, median_s, **fields, **kw)


def target(target_id: str) -> T.Target:
    (found,) = [t for t in T.TARGETS if t.id == target_id]
    return found


def judge(target_id: str, rows: list[dict], gpu_count: int | None = 1) -> T.Result:
    return T.evaluate_one(target(target_id), rows, gpu_count)


# ----------------------------------------------------------------------------- the table itself
def test_targets_table_is_well_formed() -> None:
    ids = [t.id for t in T.TARGETS]
    assert len(ids) == len(set(ids))
    assert {t.issue for t in T.TARGETS} == {3, 4, 9, 10, 11, 12}
    for t in T.TARGETS:
        assert t.op in (">=", "<=") and t.description and t.threshold_text.startswith(t.op)


def test_readme_lists_every_target() -> None:
    """The README's targets table is the one bench/targets.py judges (regenerate it with
    ``bench.targets.markdown_table()`` when a target changes)."""
    assert T.markdown_table() in (ROOT / "README.md").read_text(encoding="utf-8")


def test_met_and_not_met_from_the_rows_ratios() -> None:
    rows = [
        linear("smptk", 1.0e-3, tflops=850.0),
        linear("torch_eager", 1.2e-3),
        linear("torch_matmul", 0.9e-3, tflops=1000.0),
    ]
    speedup = judge("linear.gelu_fwd_vs_eager", rows)
    assert speedup.status == "met" and speedup.value == pytest.approx(1.2)
    assert speedup.measured == "smptk 1 ms" and speedup.baseline == "torch_eager 1.2 ms"
    pct = judge("linear.gelu_fwd_vs_matmul", rows)
    assert pct.status == "not met" and pct.value == pytest.approx(85.0)
    assert pct.test_ids == ("synthetic::smptk", "synthetic::torch_matmul")
    # The baseline must be the same case: an eager row of another shape does not count.
    other = [rows[0], linear("torch_eager", 1.2e-3) | {"shape": {"M": 4096, "K": 4096, "N": 14336}}]
    assert judge("linear.gelu_fwd_vs_eager", other).status == "not measured"


def test_planner_memory_error_takes_the_worst_case() -> None:
    """The planner's target reads each case's own error (no baseline row); the largest error decides."""

    def planner(config: str, error: float) -> dict:
        fields = {"suite": "planner", "op": "train_step_memory"}
        return row(
            "reference_transformer", 1.0, **fields, config=config, memory_error_pct=error,
            measured_bytes=1e10, predicted_bytes=1e10 * (1 + error / 100), test_id=f"synthetic::{config}",
        )  # fmt: skip

    met = judge("planner.memory_error_1b", [planner("none", 3.0), planner("full", 7.5)])
    assert met.status == "met" and met.value == pytest.approx(7.5)
    missed = judge("planner.memory_error_1b", [planner("none", 3.0), planner("full", 12.0)])
    assert missed.status == "not met" and missed.value == pytest.approx(12.0)
    assert judge("planner.memory_error_1b", []).status == "not measured"


def test_missing_rows_and_missing_baseline_are_not_measured() -> None:
    none = judge("linear.gelu_fwd_vs_eager", [])
    assert none.status == "not measured" and "no row in this run" in none.reason
    alone = judge("linear.gelu_fwd_vs_eager", [linear("smptk", 1e-3)])
    assert alone.status == "not measured" and "no baseline row" in alone.reason
    assert alone.value is None and alone.status_text.startswith("not measured (")


def test_quick_mode_rows_are_not_measured() -> None:
    quick = [
        r | {"mode": "quick", "note": CPU_NOTE} for r in (linear("smptk", 1e-3), linear("torch_eager", 2e-3))
    ]
    result = judge("linear.gelu_fwd_vs_eager", quick)
    assert result.status == "not measured" and CPU_NOTE in result.reason
    # A quick run of other (tiny) shapes: the whole run is not a measurement.
    tiny = [r | {"shape": {"M": 7, "K": 16, "N": 24}} for r in quick]
    result = judge("linear.gelu_fwd_vs_eager", tiny)
    assert result.status == "not measured" and "no measurement in this run" in result.reason


def test_skipped_case_gives_its_reason() -> None:
    skipped = linear("smptk", 0.0) | {"kind": "skipped", "reason": "needs about 90 GiB", "time_s": None}
    result = judge("linear.gelu_fwd_vs_eager", [skipped, linear("torch_eager", 1e-3)])
    assert result.status == "not measured" and "skipped: needs about 90 GiB" in result.reason


def test_only_the_given_run_counts() -> None:
    rows = [linear("smptk", 1e-3), linear("torch_eager", 2e-3) | {"run_id": "run-0"}]
    (result,) = T.evaluate(rows, gpu_count=1, run_id="run-1", targets=[target("linear.gelu_fwd_vs_eager")])
    assert result.status == "not measured"


def test_rows_of_the_fallback_the_interpreter_or_a_cpu_are_not_measurements() -> None:
    eager = linear("torch_eager", 10e-3)
    assert judge("linear.gelu_fwd_vs_eager", [linear("smptk", 8e-3), eager]).status == "met"
    for other in ({"kernel_path": "torch"}, {"kernel_path": "triton (interpreter)"}, {"device": "cpu"}):
        result = judge("linear.gelu_fwd_vs_eager", [linear("smptk", 8e-3) | other, eager])
        assert result.status == "not measured", (other, result.status_text)


def test_values_that_are_not_finite_count_as_missing_in_any_row_order() -> None:
    nan = linear("smptk", float("nan"))
    inf = linear("torch_eager", float("inf"))
    for rows in ([nan, linear("torch_eager", 1e-3)], [inf, linear("smptk", 1e-3)]):
        for order in (rows, rows[::-1]):
            result = judge("linear.gelu_fwd_vs_eager", order)
            assert result.status == "not measured", result.status_text
    slow = row("smptk", 1e-3, suite="comm", tflops=float("inf"))
    assert T._num(slow, "tflops") is None and T._num(slow | {"tflops": float("nan")}, "tflops") is None


def test_rows_of_two_runs_are_judged_one_run_at_a_time() -> None:
    """Run 0 lacks its baseline, run 1 its measurement: together they must not pair into a verdict."""
    rows = [linear("smptk", 1e-3) | {"run_id": "run-0"}, linear("torch_eager", 2e-3)]
    with pytest.raises(ValueError, match="rows from 2 runs"):
        T.evaluate(rows, gpu_count=1)
    for run in ("run-0", "run-1"):
        (result,) = T.evaluate(rows, gpu_count=1, run_id=run, targets=[target("linear.gelu_fwd_vs_eager")])
        assert result.status == "not measured"


def moe(op: str, impl: str, median_s: float, config: str, pass_: str = "fwd+bwd", **kw: Any) -> dict:
    shape = {"mixtral": {"T": 16384, "H": 4096, "F": 14336, "E": 8, "k": 2}}.get(
        config, {"T": 16384, "H": 2048, "F": 1408, "E": 64, "k": 6}
    )
    fields = {"suite": "moe", "op": op, "pass": pass_, "config": config, "tokens": 16384, "shape": shape}
    return row(impl, median_s, **fields, **kw)


def test_worst_config_decides_and_routing_share() -> None:
    rows = [
        moe("moe_layer", "smptk", 10e-3, "mixtral"),
        moe("moe_layer", "eager_loop", 40e-3, "mixtral"),  # 4x
        moe("moe_layer", "smptk", 10e-3, "fine_grained"),
        moe("moe_layer", "eager_loop", 25e-3, "fine_grained"),  # 2.5x: the worst
        moe("moe_routing", "smptk_routing", 0.5e-3, "mixtral"),  # 5%
        moe("moe_routing", "smptk_routing", 1.5e-3, "fine_grained"),  # 15%: the worst
    ]
    layer = judge("moe.layer_vs_eager_loop", rows)
    assert layer.status == "not met" and layer.value == pytest.approx(2.5)
    assert layer.case.startswith("fine_grained fwd+bwd T=16384") and "worst of 2" in layer.case
    share = judge("moe.routing_share", rows)
    assert share.status == "not met" and share.value == pytest.approx(15.0)
    assert judge("moe.routing_share", rows[:5]).value == pytest.approx(5.0)
    assert judge("moe.layer_vs_grouped_mm", rows).status == "not measured"


def test_cases_without_a_baseline_leave_a_worst_case_undecided() -> None:
    """A case whose baseline row is missing (failed, or past the time budget) is not silently dropped: a
    worst-of verdict from the other cases stands only when it is "not met" (the missing case could only
    make it worse); a "met" becomes "not measured", naming the case left out. Per collective the same."""
    rows = [
        moe("moe_layer", "smptk", 10e-3, "mixtral"),  # its eager_loop row is missing
        moe("moe_layer", "smptk", 10e-3, "fine_grained"),
        moe("moe_layer", "eager_loop", 40e-3, "fine_grained"),  # 4x: met on its own
    ]
    result = judge("moe.layer_vs_eager_loop", rows)
    assert result.status == "not measured" and result.value is None
    assert "1 of 2 cases not judged (mixtral fwd+bwd T=16384: no baseline row" in result.reason
    assert "give 4x (met) at fine_grained" in result.reason
    rows[2] = moe("moe_layer", "eager_loop", 11e-3, "fine_grained")  # 1.1x: not met whatever mixtral gives
    result = judge("moe.layer_vs_eager_loop", rows)
    assert result.status == "not met" and result.value == pytest.approx(1.1)
    assert "1 of 2 cases not judged" in result.case
    bw = {"suite": "comm_dist_bandwidth", "size_bytes": 1 << 30}
    nccl = {"suite": "comm_dist_nccl", "size_bytes": 1 << 30, "nccl_config": "default"}
    comm = [
        row("smptk", 1.0, **bw, collective="all_gather", op="all_gather", max_sms=8, busbw_gbps=400.0),
        row("nccl", 1.0, **nccl, collective="all_gather", busbw_gbps=360.0, nccl_ctas_observed={"max": 24}),
        row(
            "smptk", 1.0, **bw, collective="all_reduce", op="all_reduce_two_shot", max_sms=8, busbw_gbps=180.0
        ),
        row("nccl", 1.0, **nccl, collective="all_reduce", busbw_gbps=360.0, nccl_ctas_observed=None),
    ]
    result = judge("comm.busbw_vs_nccl", comm, gpu_count=8)
    assert (
        result.status == "not measured" and "all_reduce: NCCL's CTA count was not observed" in result.reason
    )


def test_grouped_gemm_against_dense() -> None:
    shape = {"M": 32768, "K": 4096, "N": 14336, "E": 8}
    common = {"suite": "moe", "op": "grouped_gemm", "pass": "fwd", "config": "mixtral", "tokens": 16384}
    rows = [
        row("torch_matmul", 1e-3, **common, shape=shape, tflops=800.0),
        row("smptk", 1e-3, **common, shape=shape, tflops=640.0),
    ]
    assert judge("moe.grouped_vs_dense_85", rows).status == "not met"
    result = judge("moe.grouped_vs_dense_70", rows)
    assert result.status == "met" and result.value == pytest.approx(80.0)


def test_comm_best_peer_traffic_and_worst_slowdown() -> None:
    sim = {"suite": "comm_simulated", "world": 8, "op": "all_gather"}
    rows = [
        row("smptk", 1.0, **sim, max_sms=8, size_bytes=256 << 20, peer_gbps=470.0),
        row("smptk", 1.0, **sim, max_sms=4, size_bytes=256 << 20, peer_gbps=300.0),
        row("smptk", 1.0, **sim, max_sms=16, size_bytes=256 << 20, peer_gbps=900.0),  # > 8 SMs: not counted
        row("smptk", 1.0, **sim, max_sms=8, size_bytes=1 << 20, peer_gbps=990.0),  # < 64 MiB: not counted
    ]
    peer = judge("comm.simulated_peer_gbps", rows)
    assert peer.status == "met" and peer.value == pytest.approx(470.0)
    # the copy_path="tma" A/B rows do not count; rows of the default path, named or not, do
    tma = row("smptk", 1.0, **sim, max_sms=8, size_bytes=256 << 20, peer_gbps=480.0, copy_path="tma")
    assert judge("comm.simulated_peer_gbps", [*rows, tma]).value == pytest.approx(470.0)
    named = row("smptk", 1.0, **sim, max_sms=8, size_bytes=256 << 20, peer_gbps=475.0, copy_path="pointer")
    assert judge("comm.simulated_peer_gbps", [*rows, named]).value == pytest.approx(475.0)
    # ... but their cases run in the same tier as their default-path twins (a short GPU run still compares)
    case = {**sim, "max_sms": 8, "size_bytes": 256 << 20, "copy_path": "pointer"}
    tier = T.priority(case, "x")
    assert tier < len(T.TARGETS) and T.priority({**case, "copy_path": "tma"}, "x") == tier
    inter = {"suite": "comm_interference", "op": "all_reduce_one_shot", "gemm_alone_s": {"median": 1e-3}}
    slow = [
        row("smptk", 1.05e-3, **inter, max_sms=8, slowdown=1.05, slowdown_bound=1.0727),
        row("smptk", 1.40e-3, **inter, max_sms=32, slowdown=1.40, slowdown_bound=1.2909),
    ]
    result = judge("comm.gemm_slowdown", slow)
    assert result.status == "not met" and result.value == pytest.approx(1.40 / 1.2909)
    assert judge("comm.gemm_slowdown", slow[:1]).status == "met"


def test_busbw_target_needs_two_gpus_and_reads_nccl_ctas() -> None:
    bw = {"suite": "comm_dist_bandwidth", "collective": "all_reduce", "size_bytes": 1 << 30}
    nccl = {"suite": "comm_dist_nccl", "collective": "all_reduce", "size_bytes": 1 << 30}
    rows = [
        row("smptk", 1.0, **bw, op="all_reduce_two_shot", max_sms=8, busbw_gbps=380.0),
        row("smptk", 1.0, **bw, op="all_reduce_two_shot", max_sms=16, busbw_gbps=500.0),  # > 24/3 SMs
        row("torch.distributed:nccl", 1.0, **nccl, nccl_config="default", busbw_gbps=360.0)
        | {"nccl_ctas_observed": {"max": 24}},
    ]
    one = judge("comm.busbw_vs_nccl", rows, gpu_count=1)
    assert one.status == "not measured" and "needs >= 2 GPUs" in one.reason
    eight = judge("comm.busbw_vs_nccl", rows, gpu_count=8)
    assert eight.status == "met" and eight.value == pytest.approx(380.0 / 360.0)
    assert "8 SMs" in eight.measured and "24 CTAs" in eight.baseline
    unseen = [*rows[:2], rows[2] | {"nccl_ctas_observed": None, "nccl_ctas_note": "no trace"}]
    result = judge("comm.busbw_vs_nccl", unseen, gpu_count=8)
    assert result.status == "not measured" and "not observed" in result.reason


def test_issue10_targets_per_sm_peer_rate_and_copy_engine_vs_nccl() -> None:
    sim = {"suite": "comm_simulated", "world": 8, "size_bytes": 256 << 20}
    rows = [
        row("smptk", 1.0, **sim, op="all_gather", max_sms=8, peer_gbps=560.0),  # 70 GB/s per SM
        row("smptk", 1.0, **sim, op="reduce_scatter", max_sms=2, peer_gbps=120.0),  # 60 per SM
        row("smptk", 1.0, **sim, op="reduce_scatter", max_sms=8, peer_gbps=470.0),  # 58.75: worst
        row("smptk", 1.0, **sim, op="all_to_all", max_sms=0, peer_gbps=900.0),  # copy engine: not per SM
    ]
    per_sm = judge("comm.simulated_gbps_per_sm", rows)
    assert per_sm.status == "not met" and per_sm.value == pytest.approx(470.0 / 8)
    assert judge("comm.simulated_all_gather_gbps", rows).status == "met"
    rs = judge("comm.simulated_reduce_scatter_gbps", rows)
    assert rs.status == "not met" and rs.value == pytest.approx(470.0)

    bw = {"suite": "comm_dist_bandwidth", "collective": "all_gather", "size_bytes": 1 << 30}
    nccl = {"suite": "comm_dist_nccl", "collective": "all_gather", "size_bytes": 1 << 30}
    dist_rows = [
        row("smptk", 1.0, **bw, op="all_gather", max_sms=0, busbw_gbps=300.0),
        row("smptk", 1.0, **bw, op="all_gather", max_sms=16, busbw_gbps=380.0),  # <= 16 CTAs: counts
        row("smptk", 1.0, **bw, op="all_gather", max_sms=32, busbw_gbps=900.0),  # > NCCL's 16 CTAs
        row("torch.distributed:nccl", 1.0, **nccl, nccl_config="default", busbw_gbps=360.0)
        | {"nccl_ctas_observed": {"max": 16}},
    ]
    same = judge("comm.busbw_vs_nccl_same_ctas", dist_rows, gpu_count=8)
    assert same.status == "met" and same.value == pytest.approx(380.0 / 360.0)
    ce = judge("comm.copy_engine_all_gather_vs_nccl", dist_rows, gpu_count=8)
    assert ce.status == "not met" and ce.value == pytest.approx(300.0 / 360.0)
    assert "0 SMs" in ce.measured
    # the 1/3-of-NCCL's-CTAs target never takes the copy-engine row
    third = judge("comm.busbw_vs_nccl", dist_rows, gpu_count=8)
    assert third.status == "not measured" and "no smptk row" in third.reason


# ----------------------------------------------------------------------------- benchmark order
def _item(nodeid: str, fields: dict[str, Any] | None) -> Any:
    case = types.SimpleNamespace(fields=lambda: fields) if fields is not None else None
    params = {"case": case} if case is not None else {"part": "ddp"}
    return types.SimpleNamespace(nodeid=nodeid, callspec=types.SimpleNamespace(params=params))


def test_targets_cases_run_first_in_target_order() -> None:
    gelu = {
        "suite": "linear",
        "op": "fused_linear",
        "activation": "gelu",
        "dtype": "bfloat16",
        "shape": SHAPE,
    }
    items = [
        _item("bench/test_bench_comm_dist.py::test_comm_dist[ddp]", None),
        _item("bench/test_bench_comm_dist.py::test_comm_dist[nccl]", None),
        _item("a::other", {"suite": "linear", "op": "swiglu", "shape": {"M": 4096}}),
        _item("a::matmul", gelu | {"pass": "fwd", "impl": "torch_matmul"}),
        _item("a::smptk", gelu | {"pass": "fwd", "impl": "smptk"}),
        _item("a::eager", gelu | {"pass": "fwd", "impl": "torch_eager"}),
        _item("b::routing", {"suite": "moe", "op": "moe_routing", "tokens": 16384, "impl": "smptk_routing"}),
        _item("b::layer", {"suite": "moe", "op": "moe_layer", "tokens": 16384, "impl": "smptk"}),
    ]
    order, first = gpu_check.ordered(items)
    assert [i.nodeid for i in order] == [
        "a::smptk",
        "a::eager",
        "a::matmul",
        "b::routing",  # before the layer row whose routing_share reads its median
        "b::layer",
        "bench/test_bench_comm_dist.py::test_comm_dist[nccl]",
        "bench/test_bench_comm_dist.py::test_comm_dist[ddp]",
        "a::other",
    ]
    assert first == 6


# A test body that sleeps until just past the child's deadline (the plugin's JSON holds it).
PAST_DEADLINE = (
    f"    deadline = json.loads(os.environ[{gpu_check.PLUGIN_ENV!r}])['deadline']\n"
    "    time.sleep(max(0.0, deadline - time.time() + {late}))\n"
)


def _child(tmp_path: Path, name: str, source: str) -> gpu_check.Child:
    """``source`` as ``tmp_path / name``, run by gpu-check's child runner with a 12 s budget."""
    test_file = tmp_path / name
    test_file.write_text("import json, os, time\n\n" + source)
    argv = [sys.executable, "-m", "pytest", str(test_file), "-p", "bench.gpu_check", "-q"]
    argv += ["-p", "no:cacheprovider", "-p", "no:timeout", f"--rootdir={tmp_path}"]
    return gpu_check.run_child(argv, budget_s=12, order=False, test_timeout_s=None, env=dict(os.environ))


def test_a_relative_out_means_the_callers_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark child runs in the checkout; ``--out rel`` must still land where the caller stands, as
    ``python -m bench --out rel`` does (it landed in the checkout, which then counted as dirty)."""
    seen: list[list[str]] = []

    def child(argv: list[str], **_: Any) -> gpu_check.Child:
        seen.append(argv)
        return gpu_check.Child(returncode=0, killed=False, wall_s=0.0, events=[])

    monkeypatch.setattr(gpu_check, "run_child", child)
    monkeypatch.chdir(tmp_path)
    gpu_check.run_bench(60.0, dict(os.environ), gpu_check._parser().parse_args(["--out", "rel", "--quick"]))
    (argv,) = seen
    assert argv[argv.index("--out") + 1] == str(tmp_path / "rel")


def test_child_stops_at_its_deadline(tmp_path: Path) -> None:
    """No test starts after the deadline; the one running finishes; the rest are listed as not reached."""
    source = "def test_a():\n    pass\n\ndef test_b():  # ends just after the deadline\n"
    source += PAST_DEADLINE.format(late=0.5) + "\ndef test_c():\n    pass\n"
    child = _child(tmp_path, "test_sleepy.py", source)
    assert child.outcomes.get("test_sleepy.py::test_a") == "passed"
    assert gpu_check._not_reached(child) == {"test_sleepy.py": ["test_sleepy.py::test_c"]}
    assert child.budget_stop  # logged before the child exits (or, on a busy machine, is killed)
    assert child.wall_s < 12


def test_a_test_cut_off_by_the_budget_is_not_a_failure(tmp_path: Path) -> None:
    """A test whose limit is the time left and that fails at the deadline was cut off (the torchrun
    benchmarks kill their torchrun at that limit and fail): reported as "cut off", and the phase is clean;
    a test that fails before the deadline is still a failure."""
    source = "def test_early():\n    assert False, 'a real failure'\n\n"
    source += "def test_cut():  # a benchmark killed at the time left\n" + PAST_DEADLINE.format(late=0.2)
    source += "    raise AssertionError('ran past its limit and was killed')\n"
    child = _child(tmp_path, "test_cut.py", source)
    assert child.outcomes == {"test_cut.py::test_early": "failed", "test_cut.py::test_cut": "cut off"}
    assert gpu_check._cut_off(child) == ["test_cut.py::test_cut"]
    assert child.budget_stop and child.returncode in (1, 2, -15)  # 2: stopped; -15: killed on a busy machine
    summary = {"returncode": 1, "killed": False, "budget_stop": True}  # pytest's exit after the cut-off
    assert not gpu_check._clean(summary | {"failures": ["test_cut.py::test_early"]})
    assert gpu_check._clean(summary | {"failures": []})


# ----------------------------------------------------------------------------- end to end
def test_a_rebuilt_report_keeps_its_targets(tmp_path: Path) -> None:
    """``python -m bench.report`` on a ``make gpu-check`` results file keeps the targets table that
    gpu-check put into the page (the committed H100 reports lost it when rebuilt), with the same cells as
    the console table; a targets file of another run is left out."""
    from bench.report import main as report_main

    rows = [linear("smptk", 1.0e-3, tflops=850.0), linear("torch_eager", 1.2e-3)]
    results = T.evaluate(rows, gpu_count=1)
    summary = {"banner": "quick mode: nothing was measured", "benchmarks": {"run_id": "run-1"}}
    summary["targets"] = [r.as_dict() for r in results]
    jsonl = tmp_path / "run.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    jsonl.with_name("run.targets.json").write_text(json.dumps(summary))
    assert report_main([str(jsonl)]) == 0
    page = jsonl.with_suffix(".html").read_text()
    section = page.split("<h2>Targets (make gpu-check)</h2>")[1].split("</table>")[0]
    assert "quick mode: nothing was measured" in section
    cells = gpu_check.table_rows(results)
    assert cells[0][2] == "1.2x (fwd: smptk 1 ms)" and cells[0][-1] == "met"
    assert (
        section.count("<tr>") == 1 + len(T.TARGETS) and "<td class='l'>1.2x (fwd: smptk 1 ms)</td>" in section
    )
    summary["benchmarks"]["run_id"] = "run-0"
    jsonl.with_name("run.targets.json").write_text(json.dumps(summary))
    assert report_main([str(jsonl)]) == 0
    assert "Targets (make gpu-check)" not in jsonl.with_suffix(".html").read_text()


def test_gpu_check_end_to_end_quick(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMPTK_BENCH_", "SMPTK_GPU_CHECK"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--minutes", "2", "--skip-tests", "--quick",
         "--filter", ONE_CASE, "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    lines = [line for line in out.splitlines() if line.strip()]
    banner = "nothing was measured"
    assert banner in lines[0] and banner in lines[-1], (lines[0], lines[-1])
    if "cpu (no CUDA device)" in out:
        assert lines[0] == lines[-1] and lines[0].startswith("gpu-check: cpu: nothing was measured")
    assert "TARGETS" in out and "phase setup" in out and "phase benchmarks" in out
    assert f"targets 0 met, 0 not met, {len(T.TARGETS)} not measured" in out
    (summary_path,) = tmp_path.rglob("*.targets.json")
    summary = json.loads(summary_path.read_text())
    assert [t["id"] for t in summary["targets"]] == [t.id for t in T.TARGETS]
    assert {t["status"] for t in summary["targets"]} == {"not measured"}
    assert all(t["reason"] for t in summary["targets"])
    assert summary["benchmarks"]["counts"] == {"passed": 1} and summary["tests"] is None
    assert set(summary["phases_s"]) == {"setup", "benchmarks", "targets", "total"}
    jsonl = Path(summary["results"])
    assert summary_path.name == jsonl.stem + ".targets.json" and jsonl.exists()
    page = jsonl.with_suffix(".html").read_text()
    assert "Targets (make gpu-check)" in page and "linear.gelu_fwd_vs_eager" in page
