"""The benchmark harness: counts, statistics, clock, rows, HTML report, and one end-to-end quick run.

The report tests feed synthetic rows (marked as such in their ``note``) and check that the page shows
exactly their numbers and the ratios between them. The end-to-end tests run ``python -m bench`` and
``pytest bench --benchmark-json`` on one tiny case in a temporary directory, as ``make bench`` would on
this machine (quick mode on a CPU: Triton interpreter, fp16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

# `bench` lives at the repository root beside `smptk`; pytest's `pythonpath = ["."]` makes it importable.
from bench.__main__ import results_path
from bench.config import CPU_NOTE, slugify
from bench.counts import linear_bytes, linear_flops
from bench.report import main as report_main
from bench.report import render_html, svg_bar_chart
from bench.rows import RowWriter, base_row, read_rows

ROOT = Path(__file__).resolve().parent.parent
from bench.timing import BenchClock, summarize  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
SYNTHETIC = "synthetic rows for a test: not a measurement"
ENV_FIELDS = (
    "smptk",
    "torch",
    "triton",
    "cuda",
    "nccl",
    "python",
    "git_sha",
    "git_dirty",
    "world_size",
    "gpus",
)
ONE_CASE = "fused_linear_none and fwd and not fwd_bwd and M7 and K16 and smptk"


# ----------------------------------------------------------------------------- counts and statistics
def test_flop_counts() -> None:
    assert linear_flops(m=4096, k=4096, n=14336, backward=False) == 2 * 4096 * 4096 * 14336
    assert linear_flops(m=7, k=16, n=24, backward=True) == 3 * 2 * 7 * 16 * 24
    assert linear_flops(m=7, k=16, n=24, backward=False, gemms=2) == 2 * 2 * 7 * 16 * 24


def test_byte_counts() -> None:
    # fwd: x 7x16, w 24x16, b 24, y 7x24, fp16
    assert linear_bytes(m=7, k=16, n=24, elem=2, bias=True, backward=False) == (112 + 384 + 24 + 168) * 2
    # swiglu fwd: x, two weights, one output; no bias
    assert (
        linear_bytes(m=7, k=16, n=24, elem=2, bias=False, backward=False, weights=2) == (112 + 768 + 168) * 2
    )
    # fwd+bwd adds dy read, x and w read again, dx and dw written
    fwd = 112 + 384 + 168
    bwd = 168 + 112 + 384 + 112 + 384
    assert linear_bytes(m=7, k=16, n=24, elem=4, bias=False, backward=True) == (fwd + bwd) * 4


def test_summarize_quartiles() -> None:
    s = summarize([4.0, 1.0, 3.0, 2.0])
    assert s["median"] == 2.5
    assert (s["q1"], s["q3"], s["iqr"]) == (1.75, 3.25, 1.5)
    assert (s["min"], s["max"], s["rounds"]) == (1.0, 4.0, 4)
    assert s["iqr_rel"] == pytest.approx(0.6)
    one = summarize([0.5])
    assert (one["median"], one["iqr"], one["stdev"]) == (0.5, 0.0, 0.0)
    with pytest.raises(ValueError, match="at least one round"):
        summarize([])


def test_host_clock_is_monotonic() -> None:
    clock = BenchClock()
    clock.use("cpu")
    a, b = clock(), clock()
    assert clock.kind == "host" and b >= a > 0


@pytest.mark.gpu
def test_cuda_clock_measures_gpu_time_between_start_and_stop() -> None:
    clock = BenchClock()
    clock.use("cuda")
    torch.cuda.synchronize()
    start = clock()
    assert start == 0.0  # the start call only records an event
    torch.cuda._sleep(2_000_000)  # ~1 ms of GPU spin at ~2 GHz
    stop = clock()
    assert 2e-4 < stop - start < 0.1


def test_slugify() -> None:
    assert slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert slugify("  ") == "unknown"


def test_results_path_never_overwrites(tmp_path: Path) -> None:
    import datetime as dt

    day = dt.date(2026, 11, 22)
    first = results_path(tmp_path, "cpu-interpreter", "abcdef12", day)
    assert first == tmp_path / "cpu-interpreter" / "2026-11-22-abcdef12.jsonl"
    first.parent.mkdir(parents=True)
    first.write_text("")
    assert results_path(tmp_path, "cpu-interpreter", "abcdef12", day).name == "2026-11-22-abcdef12-2.jsonl"


# ----------------------------------------------------------------------------- rows
def test_bench_variables_go_through_smptk_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """SMPTK_BENCH_* are parsed by smptk.settings like every variable (bench had parsers of its own): a
    blank run id is unset (it was used as the id), warm-up 0 is allowed and -1 refused with the settings
    message, a blank torchrun time limit means the default (gpu-check's plugin crashed on it)."""
    from bench import config, gpu_check, rows

    monkeypatch.setenv("SMPTK_BENCH_RUN_ID", "  ")
    assert rows.run_id().strip() and rows.run_id() == rows.run_id()
    monkeypatch.setenv("SMPTK_BENCH_WARMUP", "0")
    monkeypatch.setenv("SMPTK_BENCH_ROUNDS", "2")
    mode = config.current_mode()
    assert (mode.warmup_rounds, mode.rounds) == (0, 2)
    monkeypatch.setenv("SMPTK_BENCH_WARMUP", "-1")
    with pytest.raises(ValueError, match="SMPTK_BENCH_WARMUP"):
        config.current_mode()
    monkeypatch.setenv("SMPTK_BENCH_COMM_DIST_TIMEOUT_S", " ")
    monkeypatch.setenv("SMPTK_BENCH_TP_DIST_TIMEOUT_S", "90")
    watch = gpu_check._Watch(types.SimpleNamespace(), {"log": os.devnull})
    assert set(watch.torchrun_timeouts.values()) == {None, 90.0}


def test_rows_round_trip_and_carry_env(tmp_path: Path) -> None:
    env = {"torch": "2.13.0", "gpus": [], "git_sha": None}
    row = base_row("measurement", "bench/x.py::t[a]", env)
    row["check"] = {"max_abs_err": float("nan")}
    path = tmp_path / "sub" / "r.jsonl"
    writer = RowWriter(path)
    writer.write(row)
    writer.write(base_row("skipped", "bench/x.py::t[b]", env) | {"reason": "no GPU"})
    back = list(read_rows(path))
    assert [r["kind"] for r in back] == ["measurement", "skipped"]
    assert back[0]["env"] == env and back[0]["schema"] == "smptk.bench.row/1"
    assert back[0]["run_id"] == back[1]["run_id"]
    assert "TRITON_INTERPRET" in back[0]["env_vars"]
    assert back[0]["check"]["max_abs_err"] == "nan"  # JSON has no NaN; the name is kept
    with pytest.raises(ValueError, match="kind"):
        base_row("bogus", "t", env)


def test_read_rows_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"kind": "measurement"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        list(read_rows(path))


# ----------------------------------------------------------------------------- report
def _row(impl: str, median_s: float, *, m: int = 4096, op: str = "fused_linear", pass_: str = "fwd") -> dict:
    flops = linear_flops(m=m, k=4096, n=14336, backward=pass_ == "fwd+bwd")
    return {
        "kind": "measurement", "run_id": "run-1", "suite": "linear", "op": op, "activation": "gelu",
        "bias": True, "pass": pass_, "dtype": "bfloat16", "impl": impl,
        "shape": {"K": 4096, "M": m, "N": 14336},
        "flops": flops, "bytes": 10**9, "tflops": flops / median_s / 1e12, "gbps": 1e9 / median_s / 1e9,
        "time_s": {"median": median_s, "q1": median_s * 0.99, "q3": median_s * 1.01, "iqr": median_s * 0.02,
                   "iqr_rel": 0.02, "min": median_s * 0.98, "max": median_s * 1.05, "rounds": 25},
        "rounds": 25, "timer": "cuda_event", "mode": "measure", "device": "cuda", "note": SYNTHETIC,
        "kernel_path": "triton", "l2_flush_bytes": 256 * 2**20,
        "env": {"torch": "2.11.0", "triton": "3.6.0", "git_sha": "f" * 40, "git_dirty": False,
                "gpus": [{"name": "Test GPU 80GB", "sm_count": 132, "memory_total_bytes": 80 * 2**30}]},
    }  # fmt: skip


def test_report_shows_the_rows_numbers_and_ratios() -> None:
    rows = [_row("smptk", 0.002), _row("torch_eager", 0.004), _row("torch_matmul", 0.0016)]
    rows.append(
        {"kind": "skipped", "run_id": "run-1", "test_id": "bench/t.py::t[compile]", "reason": "no C++"}
    )
    page = render_html(rows)
    assert page.startswith("<!DOCTYPE html>")
    assert page.count("<svg") == 1
    assert "<td>2.000</td>" in page  # smptk median ms
    assert "<td>4.000</td>" in page  # torch_eager median ms
    assert "<td>0.0400 (2.0%)</td>" in page  # smptk IQR ms and IQR / median
    assert f"<td>{rows[0]['tflops']:,.1f}</td>" in page  # 240.5 TFLOP/s
    assert "<td>2.00×</td>" in page  # speedup of smptk vs torch_eager: 0.004 / 0.002
    assert "<td>80.0%</td>" in page  # smptk TFLOP/s / torch_matmul TFLOP/s: 0.0016 / 0.002
    assert SYNTHETIC in page
    assert "no C++" in page and "bench/t.py::t[compile]" in page
    assert "Test GPU 80GB" in page and "132 SMs" in page
    assert "fused_linear(gelu, bias)" in page and "M=4096 × K=4096 × N=14336" in page
    assert "<script" not in page and "<link" not in page and "src=" not in page


def test_report_sections_split_by_config_and_count_the_suites_own_impl() -> None:
    """Rows of two configs ("sp" / "no_sp") get a section each (they used to share one, with two
    same-labeled rows per impl); a section whose smptk impl has its own name (``smptk_fused``) counts its
    shapes in the summary (it showed 0); the environment shows a 256 MiB L2 flush as such (not 0.2 GiB)."""
    rows = [
        _row("smptk_fused", 0.002) | {"config": "sp"},
        _row("smptk_unfused", 0.003) | {"config": "sp"},
        _row("smptk_unfused", 0.004) | {"config": "no_sp"},
    ]
    page = render_html(rows)
    assert page.count("<section><h2>fused_linear(gelu, bias) [sp] — fwd") == 1
    assert page.count("<section><h2>fused_linear(gelu, bias) [no_sp] — fwd") == 1
    summary = page.split("<h2>Summary (smptk)</h2>")[1].split("</table>")[0]
    assert summary.count("<td>1</td>") == 2 and "<td>0</td>" not in summary
    assert "256 MiB" in page and "0.2 GiB" not in page


def test_report_keeps_the_rows_of_two_runs_apart() -> None:
    """Two runs' files loaded together (two commits side by side): each row names its run, each run has its
    own bars and summary line (speedup 2.00x in one, 1.25x in the other, never their 1.58x geo-mean over
    "2 shapes" of one shape), and a row that counts no FLOPs shows no TFLOP/s."""
    rows = [_row("smptk", 0.002), _row("torch_eager", 0.004)]
    rows += [_row("smptk", 0.004) | {"run_id": "run-2"}, _row("torch_eager", 0.005) | {"run_id": "run-2"}]
    page = render_html(rows)
    summary = page.split("<h2>Summary (smptk)</h2>")[1].split("</table>")[0]
    assert "<td class='l'>run-1</td><td>1</td><td>2.00×</td>" in summary
    assert "<td class='l'>run-2</td><td>1</td><td>1.25×</td>" in summary
    assert "1.58×" not in page
    section = page.split("<section>")[1]
    assert section.count('<td class="l">run-1</td>') == 2 and section.count('<td class="l">run-2</td>') == 2
    bars = [t for t in ET.fromstring(section[section.index("<svg") :].split("</svg>")[0] + "</svg>").iter()
            if t.tag.endswith("title")]  # fmt: skip
    assert len(bars) == 4 and sum("run-2" in t.text for t in bars) == 2
    routing = _row("smptk_routing", 0.001) | {
        "op": "moe_routing",
        "activation": None,
        "flops": 0,
        "tflops": 0.0,
    }
    table = render_html([routing]).split("<section>")[1]
    assert table.split('<td class="l muted">triton</td>')[1].split("</td>")[3] == "<td>—"  # TFLOP/s


def test_report_leaves_missing_baselines_blank() -> None:
    page = render_html([_row("smptk", 0.002)])  # no torch_eager, no torch_matmul row
    summary = page.split("<h2>Summary (smptk)</h2>")[1].split("</table>")[0]
    assert "<td>1</td><td>—</td><td>—</td></tr>" in summary
    assert "×" not in page.split("<footer>")[0].replace(" × ", ""), "a speedup was shown without a baseline"


def test_svg_chart_is_well_formed() -> None:
    values = {("M=7", "smptk"): (1.0, 0.9, 1.1), ("M=7", "torch_eager"): (2.0, 1.8, 2.2)}
    svg = svg_bar_chart(["M=7", "M=33"], ["smptk", "torch_eager"], values, unit="TFLOP/s")
    root = ET.fromstring(svg)
    rects = root.findall("{http://www.w3.org/2000/svg}rect")
    assert len(rects) == 2 + 2  # two legend swatches, two bars (M=33 has no values: no bar)
    titles = [r.find("{http://www.w3.org/2000/svg}title").text for r in rects[2:]]
    assert titles[0].startswith("smptk M=7: 1.000 TFLOP/s") and titles[1].startswith("torch_eager M=7: 2.000")


def test_report_cli_regenerates_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (_row("smptk", 0.002), _row("torch_eager", 0.003))))
    assert report_main([str(path)]) == 0
    html_path = tmp_path / "run.html"
    assert capsys.readouterr().out.strip() == str(html_path)
    assert "1.50×" in html_path.read_text()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n")
    assert report_main([str(bad)]) == 1
    assert report_main([str(tmp_path / "missing.jsonl")]) == 2


def test_report_cli_refuses_outputs_that_would_lose_data_and_rows_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in (_row("smptk", 0.002), _row("torch_eager", 0.003)))
    path.write_text(text)
    for output in (path, tmp_path, tmp_path / "missing" / "r.html"):  # the results file, a dir, no dir
        assert report_main([str(path), "-o", str(output)]) == 1
    assert path.read_text() == text  # the results are intact
    err = capsys.readouterr().err
    assert "overwrite its own results file" in err and "is a directory" in err and "does not exist" in err
    # what the row writer stores for a number that is not finite ("inf" / "nan"), and the JSON literals,
    # show as a dash instead of crashing or drawing a log(0)
    odd = [_row("smptk", 0.002) | {"gbps": "inf", "check": {"max_abs_err": "nan"}}]
    odd.append(_row("torch_eager", 0.003))
    odd[1]["time_s"]["median"] = float("inf")
    path.write_text("".join(json.dumps(r) + "\n" for r in odd))
    assert report_main([str(path)]) == 0
    for broken, why in (({"impl": None}, "needs an impl"), ({"shape": [7, 16]}, "shape must be an object")):
        path.write_text(json.dumps(_row("smptk", 0.002) | broken) + "\n")
        assert report_main([str(path)]) == 1
        assert f"row 1: {why}" in capsys.readouterr().err.replace("a measurement row ", "")


def test_bench_refuses_an_out_that_is_a_file_and_bad_round_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.__main__ import main as bench_main

    afile = tmp_path / "afile"
    afile.write_text("x")
    assert bench_main(["--out", str(afile)]) == 2
    assert bench_main(["--rounds", "0"]) == 2 and bench_main(["--warmup", "-1"]) == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and "--rounds 0" in err and "--warmup -1" in err


# ----------------------------------------------------------------------------- end to end
def _subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMPTK_BENCH_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_quick_bench_end_to_end(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--filter", ONE_CASE, "--out", str(tmp_path)],
        cwd=ROOT, env=_subprocess_env(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(tmp_path.rglob("*.jsonl"))
    assert len(files) == 1, files
    label = "cpu-interpreter" if not HAS_CUDA else slugify(torch.cuda.get_device_name(0)) + "-quick"
    assert files[0].parent.name == label
    rows = list(read_rows(files[0]))
    assert [r["kind"] for r in rows] == ["measurement"]
    row = rows[0]
    assert row["op"] == "fused_linear" and row["impl"] == "smptk" and row["pass"] == "fwd"
    assert row["shape"] == {"M": 7, "K": 16, "N": 24}
    assert row["flops"] == 2 * 7 * 16 * 24
    assert row["time_s"]["median"] > 0 and row["time_s"]["rounds"] == row["rounds"] >= 1
    assert row["tflops"] == pytest.approx(row["flops"] / row["time_s"]["median"] / 1e12)
    assert row["check"]["max_abs_err"] <= row["check"]["tol"]
    for field in ENV_FIELDS:
        assert field in row["env"], field
    if HAS_CUDA:
        assert row["timer"] == "cuda_event" and row["kernel_path"] == "triton"
        assert row["env"]["gpus"] and row["env"]["gpus"][0]["sm_count"] > 0
    else:
        assert row["timer"] == "host" and row["kernel_path"] == "triton (interpreter)"
        assert row["note"] == CPU_NOTE and row["dtype"] == "float16"
        assert row["env"]["gpus"] == [] and row["env"]["gpu_note"]
    page = files[0].with_suffix(".html").read_text()
    assert "<svg" in page and row["note"] in page
    assert "1 benchmarks collected" in proc.stderr or "1/1" in proc.stderr
    # the terminal counts benchmarks, then the rows exactly as the report's header does
    assert "bench: 1 benchmarks: 1 passed, 0 failed, 0 skipped" in proc.stderr
    assert "bench: rows: 1 measurement rows, 0 skipped, 0 failed" in proc.stderr
    assert "<p class='meta'>1 measurement rows, 0 skipped, 0 failed (rows, not benchmarks" in page


def test_pytest_bench_benchmark_json(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    env = _subprocess_env() | {"SMPTK_BENCH_MODE": "quick"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "bench", "-q", "-p", "no:cacheprovider", "-k", ONE_CASE,
         f"--benchmark-json={out}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    (bench,) = data["benchmarks"]
    extra = bench["extra_info"]
    assert extra["impl"] == "smptk" and extra["flops"] == 2 * 7 * 16 * 24
    assert extra["time_s"]["median"] == pytest.approx(bench["stats"]["median"])
    assert bench["options"]["timer"] == "BenchClock"
    for field in ENV_FIELDS:
        assert field in extra["env"], field


def test_cuda_clock_pairs_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch's bookkeeping, on any machine: start records only, stop syncs and converts ms -> s."""
    now = [0.0]

    class FakeEvent:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing
            self.t: float | None = None
            self.synced = False

        def record(self) -> None:
            self.t = now[0]

        def synchronize(self) -> None:
            self.synced = True

        def elapsed_time(self, end: FakeEvent) -> float:
            assert end.synced, "elapsed_time before the stop event completed"
            return (end.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    clock = BenchClock()
    clock.use("cuda")
    now[0] = 5.0
    start = clock()
    now[0] = 5.25
    stop = clock()
    assert (start, clock.kind) == (0.0, "cuda_event")
    assert stop - start == pytest.approx(0.25)
    assert clock() == 0.0  # a new pair starts
    clock.reset()
    now[0] = 7.0
    clock()
    now[0] = 7.5
    assert clock() == pytest.approx(0.5)  # after reset, the pair is (7.0, 7.5), not (5.25.., 7.0)
