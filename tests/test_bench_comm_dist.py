"""bench/comm_dist.py: NCCL trace parsing, bandwidth math, row fields, and one quick run under torchrun.

The unit tests use synthetic inputs (a chrome trace written here, made-up times); none of their numbers
is a measurement. The end-to-end test runs ``torchrun --nproc-per-node 2 -m bench.comm_dist --quick
--device cpu --max-sms 1`` as ``make bench`` does on a CPU (gloo, Triton interpreter, POSIX shared-memory
heap; budgets 0 and 1, 2 rounds, to keep CI short) into a temporary JSONL file, checks every row, and
renders them into the report (labelled real processes and CPU functional numbers).
"""

from __future__ import annotations

import glob
import html
import math
import os
import re
import time
from pathlib import Path

import pytest

from bench.comm_dist import (
    NCCL_CTAS_CPU,
    PARTS,
    SUITES,
    bandwidth_fields,
    budget_label,
    case_numels,
    launch,
    make_row,
    nccl_cap_plan,
    nccl_ctas_from_trace,
    scaling_efficiency,
    sm_budgets,
    sm_use,
)
from bench.config import CPU_NOTE
from bench.counts import gemm_slowdown_bound
from bench.report import counts_text, render_html, row_counts
from bench.report_comm import CPU_TEXT, REAL_WORLD_TEXT, SIMULATED_FOOTER, WORLD_MODE_TEXT
from bench.rows import SCHEMA, read_rows

SHM_PATTERN = "/dev/shm/smptk-*"
E2E_TIMEOUT_S = 240
# Keys that hold a number measured or derived from a measurement: never in a skipped or failed row.
MEASURED_KEYS = (
    "time_s",
    "algbw_gbps",
    "busbw_gbps",
    "slowdown",
    "samples_per_s",
    "scaling_efficiency",
    "first_call_s",
    "gemm_alone_s",
    "tflops",
)


# ----------------------------------------------------------------------------- trace parser
def _kernel(name: str, grid: list[int] | None, cat: str = "kernel") -> dict:
    args = {"device": 0, "stream": 7}
    if grid is not None:
        args["grid"] = grid
    return {"ph": "X", "cat": cat, "name": name, "ts": 1, "dur": 5, "args": args}


def test_trace_parser_reads_grid_x_of_nccl_kernels_only() -> None:
    trace = {
        "traceEvents": [
            _kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", [8, 1, 1]),
            _kernel("ncclKernel_AllGather_RING_LL_Sum_int8_t", [2, 1, 1]),
            _kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_SIMPLE", [8, 1, 1]),
            _kernel("ncclDevKernel_SendRecv", [16, 1, 1], cat="Kernel"),  # older kineto spells it so
            _kernel("sm90_xmma_gemm_bf16bf16_bf16f32", [132, 1, 1]),  # a GEMM: not NCCL
            _kernel("_all_reduce_two_shot_kernel", [4, 1, 1]),  # smptk's own kernel: not NCCL
            _kernel("nccl:all_reduce", None, cat="cpu_op"),  # the host-side op: no grid
            _kernel("ncclDevKernel_Broadcast", [64, 1, 1], cat="cuda_runtime"),  # not a kernel event
            {"ph": "M", "name": "process_name", "args": {"name": "python"}},
        ]
    }
    assert nccl_ctas_from_trace(trace) == {"max": 16, "distinct": [2, 8, 16], "kernels": 4}


def test_trace_parser_without_nccl_kernels_returns_none() -> None:
    assert nccl_ctas_from_trace({}) is None
    assert nccl_ctas_from_trace({"traceEvents": []}) is None
    only_gemm = {"traceEvents": [_kernel("ampere_bf16_s16816gemm", [108, 1, 1])]}
    assert nccl_ctas_from_trace(only_gemm) is None
    no_grid = {"traceEvents": [_kernel("ncclDevKernel_AllReduce", None)]}
    assert nccl_ctas_from_trace(no_grid) is None


# ----------------------------------------------------------------------------- sizes and bandwidth math
def test_case_numels_follow_nccl_tests_sizes() -> None:
    # 4 KiB of bf16 = 2048 elements, rounded down to 2046 = 3 x 682 at world 3.
    assert case_numels("all_reduce", 4096, 3, 2) == (2046, 2046, 4092)
    assert case_numels("all_gather", 4096, 3, 2) == (682, 2046, 4092)
    assert case_numels("reduce_scatter", 4096, 3, 2) == (2046, 682, 4092)
    assert case_numels("all_to_all", 4096, 3, 2) == (2046, 2046, 4092)
    assert case_numels("all_gather", 1 << 30, 8, 2) == (1 << 26, 1 << 29, 1 << 30)
    with pytest.raises(ValueError, match="size_bytes"):
        case_numels("all_reduce", 6, 4, 2)
    with pytest.raises(ValueError, match="collective"):
        case_numels("broadcast", 4096, 2, 2)


def test_bandwidth_fields_use_nccl_tests_definitions() -> None:
    f = bandwidth_fields("all_reduce", "two_shot", world=8, size_bytes=10**9, seconds=0.01, smptk=True)
    assert f["algbw_gbps"] == pytest.approx(100.0)
    assert f["busbw_factor"] == pytest.approx(2 * 7 / 8)
    assert f["busbw_gbps"] == pytest.approx(175.0)
    assert f["peer_bytes"] == 2 * 7 * 10**9 // 8  # two phases of 7 slices of 1/8
    one = bandwidth_fields("all_reduce", "one_shot", world=8, size_bytes=10**9, seconds=0.01, smptk=True)
    assert one["busbw_gbps"] == pytest.approx(175.0) and one["peer_bytes"] == 7 * 10**9
    nccl = bandwidth_fields("all_reduce", None, world=8, size_bytes=10**9, seconds=0.01, smptk=False)
    assert nccl["busbw_gbps"] == pytest.approx(175.0) and nccl["peer_bytes"] is None
    ag = bandwidth_fields("all_gather", None, world=4, size_bytes=4 << 20, seconds=1e-3, smptk=True)
    assert ag["algbw_gbps"] == pytest.approx(4.194304)
    assert ag["busbw_gbps"] == pytest.approx(4.194304 * 3 / 4)
    assert ag["peer_bytes"] == 3 << 20
    for kind in ("reduce_scatter", "all_to_all"):
        g = bandwidth_fields(kind, None, world=2, size_bytes=2000, seconds=1e-6, smptk=False)
        assert (g["algbw_gbps"], g["busbw_gbps"]) == (pytest.approx(2.0), pytest.approx(1.0))
    zero = bandwidth_fields("all_gather", None, world=2, size_bytes=4096, seconds=0.0, smptk=True)
    assert zero["algbw_gbps"] is None and zero["busbw_gbps"] is None


def test_slowdown_bound_and_scaling_efficiency() -> None:
    assert gemm_slowdown_bound(8, 132) == pytest.approx(1 + 1.2 * 8 / 132)
    assert gemm_slowdown_bound(1, 108) == pytest.approx(1 + 1.2 / 108)
    assert gemm_slowdown_bound(0, 132) == 1.03  # the copy engine: at most 3%
    for k, sms, name in (
        (-1, 132, "k"),
        (1, 0, "sm_count"),
        (200, 132, "k"),
        (1.5, 132, "k"),
        (True, 132, "k"),
    ):
        with pytest.raises(ValueError, match=f"^{name}:"):
            gemm_slowdown_bound(k, sms)
    assert scaling_efficiency(1.0, 1.25) == pytest.approx(0.8)  # step 25% slower at w: 80% efficient
    assert scaling_efficiency(2.0, 2.0) == 1.0


def test_sm_budgets_add_the_copy_engine_where_the_op_has_it() -> None:
    assert sm_budgets("all_gather", (1, 2, 4)) == (0, 1, 2, 4)
    assert sm_budgets("all_to_all", (8,)) == (0, 8)
    assert sm_budgets("all_reduce", (1, 32)) == (1, 32)
    assert sm_budgets("reduce_scatter", (1,)) == (1,)
    with pytest.raises(ValueError, match="max_sms"):
        sm_budgets("all_gather", (0, 1))  # 0 is added, never asked for
    with pytest.raises(ValueError, match="collective"):
        sm_budgets("broadcast", (1,))
    assert (budget_label(0), budget_label(16)) == ("copy_engine", "sms16")
    assert sm_use(0)["ctas"] == 0 and sm_use(0)["signal_ctas"] == 1
    assert sm_use(8)["ctas"] == 8 and sm_use(8)["signal_ctas"] is None


def test_nccl_cap_plan() -> None:
    plan, skip = nccl_cap_plan(None, None, caps=(1, 8))
    assert plan == [("default", None), ("max_ctas=1", 1), ("max_ctas=8", 8)] and skip is None
    # no per-communicator option: the default communicator only, and the reason names the env route
    plan, skip = nccl_cap_plan("this torch has no max_ctas", None, caps=(1, 8))
    assert plan == [("default", None)] and "NCCL_MAX_CTAS=k" in skip and "no max_ctas" in skip
    # one of the per-cap runs: the environment caps the default communicator, nothing is skipped
    assert nccl_cap_plan("no max_ctas", "4", caps=(1, 8)) == ([("NCCL_MAX_CTAS=4 (env)", 4)], None)
    plan, _ = nccl_cap_plan(None, " 2 ", caps=(1,))
    assert plan == [("NCCL_MAX_CTAS=2 (env)", 2), ("max_ctas=1", 1)]


# ----------------------------------------------------------------------------- row fields
def test_make_row_fields() -> None:
    env = {"git_sha": "0" * 40, "world_size": 2, "note": "synthetic environment for a test"}
    common = {"mode": "quick", "backend": "gloo", "world_size": 2, "note": CPU_NOTE}
    fields = {"op": "all_gather", "impl": "smptk", "max_sms": 2, "world": 2, "time_s": {"median": 1.0}}
    row = make_row("measurement", "bandwidth", "all_gather-smptk-sms2-4096B", env, common, fields)
    assert row["schema"] == SCHEMA and row["kind"] == "measurement"
    assert row["suite"] == "comm_dist_bandwidth"
    assert row["test_id"] == "bench/comm_dist.py::bandwidth::all_gather-smptk-sms2-4096B"
    assert row["env"] is env and row["env_vars"]["TRITON_INTERPRET"] == os.environ.get("TRITON_INTERPRET")
    assert (row["mode"], row["backend"], row["world_size"], row["note"]) == ("quick", "gloo", 2, CPU_NOTE)
    assert (row["op"], row["impl"], row["max_sms"], row["world"]) == ("all_gather", "smptk", 2, 2)
    assert row["run_id"] and row["timestamp"]
    assert {SUITES[p] for p in PARTS} == {f"comm_dist_{p}" for p in PARTS}
    skipped = make_row("skipped", "nccl", "sweep", env, common, {"reason": "no NCCL"})
    assert skipped["kind"] == "skipped" and skipped["reason"] == "no NCCL"
    with pytest.raises(ValueError, match="reason"):
        make_row("skipped", "nccl", "sweep", env, common, {})
    with pytest.raises(ValueError, match="part"):
        make_row("measurement", "latency", "x", env, common, {})


# ----------------------------------------------------------------------------- end to end
def _shm() -> set[str]:
    return set(glob.glob(SHM_PATTERN))


def test_quick_run_under_torchrun_writes_valid_rows(tmp_path: Path) -> None:
    before = _shm()
    out = tmp_path / "rows.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMPTK_COMM_")}
    env["SMPTK_BENCH_RUN_ID"] = "test-comm-dist-e2e"
    args = ["--quick", "--device", "cpu", "--max-sms", "1", "--rounds", "2", "--warmup", "0"]
    done = launch(2, [*args, "--jsonl", str(out)], timeout_s=E2E_TIMEOUT_S, env=env)
    assert not done.timed_out, f"torchrun ran past {E2E_TIMEOUT_S} s:\n{done.tail()}"
    assert done.returncode == 0, f"torchrun exited with {done.returncode}:\n{done.tail()}"
    rows = list(read_rows(out))

    assert {r["suite"] for r in rows} == set(SUITES.values())
    for r in rows:
        assert r["schema"] == SCHEMA and r["run_id"] == "test-comm-dist-e2e", r["test_id"]
        assert r["kind"] in ("measurement", "skipped"), (r["test_id"], r.get("reason"))
        assert r["note"] == CPU_NOTE, r["test_id"]
        assert (r["mode"], r["device"], r["backend"], r["world_size"]) == ("quick", "cpu", "gloo", 2)
        assert r["world_mode"].startswith("real world: 2 CPU processes under torchrun"), r["test_id"]
        assert r["env"]["world_size"] == 2 and "git_sha" in r["env"]
        assert r["test_id"].startswith("bench/comm_dist.py::")
    measured = [r for r in rows if r["kind"] == "measurement"]
    for r in measured:
        t = r["time_s"]
        assert t["median"] > 0 and t["min"] > 0 and t["rounds"] == r["rounds"] == 2, r["test_id"]
        assert r["timer"] == "host"
    for r in (r for r in rows if r["kind"] == "skipped"):
        assert isinstance(r["reason"], str) and r["reason"].strip(), r["test_id"]
        assert not [k for k in MEASURED_KEYS if k in r], r["test_id"]

    bandwidth = [r for r in measured if r["suite"] == "comm_dist_bandwidth"]
    expected = {(op, k) for op in _smptk_ops() for k in (1,)} | {("all_gather", 0), ("all_to_all", 0)}
    assert {(r["op"], r["max_sms"]) for r in bandwidth} == expected
    for r in bandwidth:
        copy_engine = r["max_sms"] == 0
        assert r["impl"] == "smptk", r["test_id"]
        assert r["comm_path"] == ("copy_engine" if copy_engine else "symmetric"), r["test_id"]
        assert r["ctas"] == r["max_sms"] and (r["algorithm"] == "copy_engine") == copy_engine
        assert r["check"]["exact_equal"] is True, r["test_id"]
        assert r["size_bytes"] == 4096 and r["world"] == 2 and r["dtype"] == "bfloat16"
        median = r["time_s"]["median"]
        assert r["algbw_gbps"] == pytest.approx(4096 / median / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * r["busbw_factor"])
    nccl = [r for r in measured if r["suite"] == "comm_dist_nccl"]
    assert sorted(r["collective"] for r in nccl) == sorted(
        ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    )
    assert {r["impl"] for r in nccl} == {"torch.distributed:gloo"}
    for r in nccl:
        assert r["peer_bytes"] is None and r["busbw_gbps"] > 0 and r["nccl_config"] is None
        assert r["nccl_ctas_observed"] is None and r["nccl_ctas_note"] == NCCL_CTAS_CPU
    skipped_cases = {r["test_id"].split("::", 1)[1] for r in rows if r["kind"] == "skipped"}
    assert skipped_cases == {"nccl::max_ctas_sweep"}

    inter = [r for r in measured if r["suite"] == "comm_dist_interference"]
    assert [r["op"] for r in inter].count("gemm_alone") == 1
    cases = {(r["collective"], r["impl"], r["max_sms"]) for r in inter if r["op"] == "gemm_concurrent"}
    assert cases == {
        ("all_reduce", "smptk", 1),
        ("all_gather", "smptk", 0),  # the copy engine: SM budget 0
        ("all_gather", "smptk", 1),
        ("all_reduce", "torch.distributed:gloo", None),
        ("all_gather", "torch.distributed:gloo", None),
    }
    for r in (r for r in inter if r["op"] == "gemm_concurrent"):
        assert r["concurrency"].startswith("sequential") and r["covered"] is None
        assert r["slowdown_bound"] is None and r["bound_met"] is None  # no SM count on a CPU
        assert r["slowdown"] == pytest.approx(r["time_s"]["median"] / r["gemm_alone_s"]["median"])
        assert r["collective_calls"] >= 1

    ddp = [r for r in measured if r["suite"] == "comm_dist_ddp"]
    impls = ("torch.distributed:gloo", "smptk")
    assert sorted((r["world"], r["impl"]) for r in ddp) == sorted((w, i) for w in (1, 2) for i in impls)
    for r in ddp:
        check = r["check"]
        assert check["passed"] is True, (r["test_id"], check)
        # the check can fail: training moved the parameters by far more than the tolerance
        assert check["largest_update"] > 10 * check["tol"], check
        assert r["samples_per_s"] == pytest.approx(
            r["world"] * r["model"]["batch_per_rank"] / r["time_s"]["median"]
        )
        assert r["scaling_efficiency"] > 0 and math.isfinite(r["scaling_efficiency"])
        if r["world"] == 1:
            assert r["scaling_efficiency"] == 1.0
        if r["impl"] == "smptk":
            assert r["comm_path"] == "symmetric", r["test_id"]

    # The report of these real 2-process CPU rows: labelled real and CPU, never simulated or GPU.
    page = render_html(rows)
    assert counts_text(row_counts(rows)) in page
    assert REAL_WORLD_TEXT in html.unescape(page) and CPU_TEXT in html.unescape(page)
    text = html.unescape(page)
    assert WORLD_MODE_TEXT not in text and SIMULATED_FOOTER not in text
    assert "simulated world:" not in text.lower()  # no row's world_mode says it
    assert "Summary (smptk)" not in page and "None" not in _text(page)
    assert page.count("<svg") == 5 + 1  # a busbw chart per smptk op, one interference chart

    new = _shm() - before
    if new:  # another job's heap name lives a few ms; wait that out before blaming this run
        time.sleep(1.0)
        new &= _shm()
    assert not new, f"left behind in /dev/shm: {sorted(new)}"


def _text(page: str) -> str:
    """The page's visible text (tags and the SVG markup dropped)."""
    return re.sub(r"<[^>]+>", " ", page)


def _smptk_ops() -> tuple[str, ...]:
    return ("all_reduce_one_shot", "all_reduce_two_shot", "all_gather", "reduce_scatter", "all_to_all")


def test_launch_kills_torchrun_and_its_ranks_at_the_timeout(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    done = launch(2, ["--quick", "--device", "cpu", "--parts", "ddp", "--jsonl", str(out)], timeout_s=6)
    assert done.timed_out and done.returncode != 0
    time.sleep(0.5)
    survivors = []
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            text = Path(cmdline).read_bytes()
        except OSError:
            continue
        if str(out).encode() in text:
            survivors.append(cmdline)
    assert not survivors, f"still running after the timeout: {survivors}"
