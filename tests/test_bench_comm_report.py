"""The HTML report's collective part (simulated world and torchrun suites), its counts, and one quick run.

The report tests feed synthetic rows (their ``note`` says so) shaped like what bench/test_bench_comm.py
and bench/comm_dist.py write, with times chosen so every derived number is easy to state: they check
that the page shows the rows' own numbers (busbw, peer GB/s, median, slowdown, bound), the label of
each kind of row (simulated world, real processes, CPU functional numbers) in banners and footer, one
chart per simulated collective and size, one busbw-against-size chart per torchrun collective with a
line per SM budget and per NCCL communicator, a detail row per torchrun case with its size, max_sms,
path and busbw, a header that counts rows as ``python -m bench`` does, no "None" anywhere, and that
the linear part of the report is unchanged beside them. The end-to-end test runs ``python -m bench`` on
three tiny comm cases in quick mode (CPU: Triton interpreter) and reads the rows, the terminal output
and the page it wrote.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from bench.counts import collective_counts
from bench.report import CPU_FOOTER, _fmt, counts_text, render_html, row_counts
from bench.report_comm import (
    BUDGET_COLORS,
    CPU_TEXT,
    DIST_FOOTER,
    REAL_WORLD_TEXT,
    SIMULATED_FOOTER,
    WORLD_MODE_TEXT,
    svg_line_chart,
)
from bench.rows import read_rows

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = "synthetic rows for a test: not a measurement"
LABEL = (
    "simulated world: 8 peer buffers in one GPU's memory, one rank's kernel timed; "
    "not a multi-GPU measurement"
)
SVG_NS = "{http://www.w3.org/2000/svg}"


def _times(median_s: float) -> dict[str, float]:
    return {"median": median_s, "q1": median_s * 0.9, "q3": median_s * 1.1, "iqr": median_s * 0.2,
            "iqr_rel": 0.2, "min": median_s * 0.8, "max": median_s * 1.3, "rounds": 25}  # fmt: skip


def _ptx(sms: int) -> dict:
    """A kernel's compiled-code facts, distinct per SM budget so a test can tell rows apart."""
    return {"target": "sm_90a", "v128_loads": 40 + sms, "v128_stores": 20, "scalar_loads": 12,
            "scalar_stores": 6, "registers": 94, "local_bytes": 0}  # fmt: skip


def _sim_row(op: str, size: int, sms: int, median_s: float, *, capped: bool = False) -> dict:
    counts = collective_counts(op, world=8, size_bytes=size)
    algbw = size / median_s / 1e9
    return {
        "kind": "measurement", "run_id": "run-c", "suite": "comm_simulated", "op": op, "impl": "smptk",
        "pass": "simulated", "dtype": "bfloat16", "world": 8, "max_sms": sms, "size_bytes": size,
        "shape": {"size_bytes": size, "world": 8, "max_sms": sms}, "world_mode": LABEL,
        "time_s": _times(median_s), "rounds": 5 if capped else 25, "rounds_capped": capped,
        "flops": 0, "bytes": counts["peer_bytes"], "gbps": counts["peer_bytes"] / median_s / 1e9,
        "algbw_gbps": algbw, "busbw_factor": counts["busbw_factor"],
        "busbw_gbps": algbw * counts["busbw_factor"], "peer_bytes": counts["peer_bytes"],
        "peer_gbps": counts["peer_bytes"] / median_s / 1e9,
        "check": {"exact": True, "elements": size // 2, "mismatches": 0},
        "kernel_path": "triton, SIMULATED=True", "ptx": _ptx(sms), "ptx_note": "static counts",
        "note": SYNTHETIC, "mode": "measure", "device": "cuda", "timer": "cuda_event",
        "env": {"torch": "2.11.0", "gpus": [{"name": "Test GPU 80GB", "sm_count": 132}]},
    }  # fmt: skip


def _if_row(op: str, sms: int, alone_s: float, concurrent_s: float, overlap_gbps: float | None) -> dict:
    slowdown = concurrent_s / alone_s
    bound = 1 + 1.2 * sms / 132
    row = {
        "kind": "measurement", "run_id": "run-c", "suite": "comm_interference", "op": op, "impl": "smptk",
        "pass": "beside torch.matmul", "dtype": "bfloat16", "world": 8, "max_sms": sms,
        "size_bytes": 64 << 20, "shape": {"M": 8192, "K": 8192, "N": 8192}, "world_mode": LABEL,
        "time_s": _times(concurrent_s), "gemm_alone_s": _times(alone_s), "rounds": 25,
        "flops": 2 * 8192**3, "bytes": 3 * 8192 * 8192 * 2, "slowdown": slowdown, "slowdown_bound": bound,
        "bound_met": slowdown <= bound, "collective_alone_peer_gbps": 123.4,
        "collective_overlap_peer_gbps": overlap_gbps, "collective_calls_per_round": 7,
        "concurrency": "side CUDA stream", "note": SYNTHETIC, "mode": "measure", "device": "cuda",
    }  # fmt: skip
    if overlap_gbps is None:
        row["overlap_gbps_note"] = "one collective call is longer than the GEMM"
    return row


def _comm_rows() -> list[dict]:
    return [
        _sim_row("all_gather", 4096, 1, 10e-6),
        _sim_row("all_gather", 4096, 8, 5e-6),
        _sim_row("all_gather", 1 << 20, 1, 100e-6),
        _sim_row("all_gather", 1 << 20, 8, 20e-6, capped=True),
        _if_row("all_reduce_two_shot", 1, 2e-3, 2.02e-3, None),
        _if_row("all_reduce_two_shot", 32, 2e-3, 2.8e-3, 55.5),
    ]


def test_comm_rows_show_their_numbers_and_the_world_label() -> None:
    page = render_html(_comm_rows())
    assert html.escape(WORLD_MODE_TEXT) in page and "not multi-GPU measurements" in page
    assert page.count(html.escape(LABEL)) >= 3  # banner, and each section repeats its rows' own label
    assert SYNTHETIC in page
    # all_gather at W=8: busbw factor 7/8. 4 KiB in 10 us: algbw 0.4096 GB/s, busbw 0.3584 GB/s;
    # peer bytes 7/8 x 4096 = 3584, so peer GB/s = 0.3584 as well.
    assert "<td>0.3584</td>" in page and "<td>0.4096</td>" in page and "<td>3584</td>" in page
    # 1 MiB at 8 SMs in 20 us: algbw 52.43 GB/s, busbw 45.88 GB/s; median 20.00 us; rounds capped.
    assert "<td>52.43</td>" in page and "<td>45.88</td>" in page and "<td>20.00</td>" in page
    assert "<td>5 (capped)</td>" in page
    assert "exact (0 of 2048 differ)" in page
    # the compiled code beside the bandwidth, per row (its SM budget's facts)
    for sms in (1, 8):
        code = f"sm_90a · 128-bit ld/st {40 + sms}/20 · scalar 12/6 · 94 regs · 0 B local"
        assert f"<td>{sms}</td>" in page and html.escape(code) in page
    # Size x SM-budget pivot: header with both budgets, a row per size.
    assert "<th>1 SM</th><th>8 SMs</th>" in page
    assert "<td class='l'>4 KiB</td><td>0.3584</td><td>0.7168</td></tr>" in page
    # Interference: 2.02 / 2.00 ms = 1.010x, bound 1 + 1.2/132 = 1.009x, not met; 32 SMs: 1.400x vs 1.291x.
    assert "<td>1.010×</td><td>1.009×</td><td>NO</td>" in page
    assert "<td>1.400×</td><td>1.291×</td><td>NO</td>" in page
    assert "<td>55.50</td>" in page and "<td>123.4</td>" in page
    assert "one collective call is longer than the GEMM" in page
    assert "GEMM M=8192 × K=8192 × N=8192 beside a collective of 64 MiB" in page
    assert "Summary (smptk)" not in page  # the linear summary has nothing to summarize here
    assert "<script" not in page and "src=" not in page


def test_a_second_run_in_the_file_is_named_not_dropped_silently() -> None:
    """Two runs appended to one file: the comm tables show the last row of each case and say that the
    earlier rows are left out (they showed one run's rows and nothing about the other)."""
    rows = _comm_rows()
    assert "earlier row(s)" not in render_html(rows)
    again = [r | {"run_id": "run-d"} for r in rows]
    page = render_html(rows + again)
    assert page.count("earlier row(s) of the same cases in this file are not shown") == 2  # both sections
    assert "run(s) run-d" in page


def test_one_chart_per_collective_and_size_plus_interference() -> None:
    page = render_html(_comm_rows())
    svgs = [page[i : page.index("</svg>", i) + 6] for i in range(len(page)) if page.startswith("<svg", i)]
    assert len(svgs) == 2 + 1  # all_gather at 4 KiB and at 1 MiB; one slowdown chart
    for svg in svgs:
        ET.fromstring(svg)  # well-formed
    bars = ET.fromstring(svgs[1]).findall(f"{SVG_NS}rect")[2:]  # after the two legend swatches
    titles = [b.find(f"{SVG_NS}title").text for b in bars]
    assert titles[0].startswith("busbw 1 SM: 9.175 GB/s")  # 1 MiB x 7/8 in 100 us
    assert titles[1].startswith("peer 1 SM: 9.175 GB/s")
    assert "figcaption>all_gather, 1 MiB</figcaption>" in page


def test_linear_rows_render_as_before_beside_comm_rows() -> None:
    from test_bench_harness import _row as linear_row

    rows = [linear_row("smptk", 0.002), linear_row("torch_eager", 0.004), *_comm_rows()]
    page = render_html(rows)
    summary = page.split("<h2>Summary (smptk)</h2>")[1].split("</table>")[0]
    assert summary.count("<tr>") == 2  # header + fused_linear: no comm row in the linear summary
    assert "<td>2.00×</td>" in page  # linear speedup unchanged
    assert page.index("Summary (smptk)") < page.index("Collectives (simulated world)")
    assert "algbw = size / median time" in page.split("<footer>")[1]


def _subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMPTK_BENCH_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU quick-mode rows; on a GPU see bench")
def test_quick_comm_bench_end_to_end(tmp_path: Path) -> None:
    # 2 bandwidth cases (4 KiB, 1500 B), 1 interference, and the copy_path="tma" case (2 SMs, 4 KiB)
    selection = "comm and all_gather and W2 and (sms1 or tma)"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--filter", selection, "--out", str(tmp_path)],
        cwd=ROOT, env=_subprocess_env(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (jsonl,) = sorted(tmp_path.rglob("*.jsonl"))
    rows = list(read_rows(jsonl))
    all_rows = rows
    tma = [r for r in rows if r.get("copy_path") == "tma"]
    assert len(tma) == 1 and tma[0]["max_sms"] == 2 and tma[0]["check"]["exact"], tma
    assert tma[0]["kernel_path"].endswith("copy_path=tma")
    rows = [r for r in rows if r.get("copy_path") != "tma"]
    assert [(r["kind"], r["suite"]) for r in rows] == [
        ("measurement", "comm_simulated"),
        ("measurement", "comm_simulated"),
        ("measurement", "comm_interference"),
    ]
    for r in rows[:2]:  # the interpreter compiles nothing: no code facts, and the row says why
        assert r["ptx"] is None and r["ptx_note"].startswith("nothing compiled: the kernel ran in Triton's")
    for r in rows:
        assert r["world_mode"].startswith("simulated world: 2 peer buffers")
        assert "not a multi-GPU measurement" in r["world_mode"]
        assert r["check"]["exact"] and r["check"]["mismatches"] == 0
        assert r["note"] == "cpu-interpreter: not a performance measurement"
    sim = rows[0]
    assert (sim["op"], sim["max_sms"], sim["world"], sim["size_bytes"]) == ("all_gather", 1, 2, 4096)
    median = sim["time_s"]["median"]
    assert sim["peer_bytes"] == 2048 and sim["gbps"] == pytest.approx(2048 / median / 1e9)
    assert sim["algbw_gbps"] == pytest.approx(4096 / median / 1e9)
    assert sim["busbw_gbps"] == pytest.approx(sim["algbw_gbps"] / 2)
    assert rows[1]["size_bytes"] == 1500
    inter = rows[2]
    assert inter["slowdown"] == pytest.approx(inter["time_s"]["median"] / inter["gemm_alone_s"]["median"])
    assert inter["slowdown_bound"] is None and inter["concurrency"].startswith("sequential")
    page = jsonl.with_suffix(".html").read_text()
    assert html.escape(WORLD_MODE_TEXT) in page and "comm_interference" in page and page.count("<svg") == 4
    assert "all_gather — W=2 — float16 — copy_path=tma" in html.unescape(page)  # a section of its own
    # the header and the terminal count the same rows, and say that rows are not benchmarks
    counts = counts_text(row_counts(all_rows))
    assert counts == "4 measurement rows, 0 skipped, 0 failed"
    assert counts in page and f"bench: rows: {counts}" in proc.stderr
    assert "bench: 4 benchmarks: 4 passed, 0 failed, 0 skipped" in proc.stderr
    assert REAL_WORLD_TEXT not in html.unescape(page) and html.escape(CPU_FOOTER) in page
    assert "— (interpreter: nothing compiled)" in html.unescape(page)


# ----------------------------------------------------------------------------- torchrun rows
MiB = 1 << 20
DIST_SIZES = (1 * MiB, 4 * MiB, 16 * MiB)
REAL = "real world: 8 processes under torchrun, one GPU each, nccl"
REAL_CPU = "real world: 2 CPU processes under torchrun, gloo + a shared-memory heap"


def _dist_busbw(impl: str, k: int | None, cap: int | None, size: int) -> float:
    """Made-up busbw in GB/s, distinct per line and size: smptk 40 k + size in MiB (k = 0: 300 + ...);
    NCCL default 350 + size in MiB, NCCL at k CTAs 20 k + size in MiB."""
    mib = size // MiB
    if impl == "smptk":
        return (300 if k == 0 else 40 * k) + mib
    return (350 if cap is None else 20 * cap) + mib


def _dist_row(
    suite: str,
    op: str,
    collective: str,
    size: int,
    *,
    impl: str = "smptk",
    max_sms: int | None = None,
    config: str | None = None,
    cap: int | None = None,
    device: str = "cuda",
) -> dict:
    world = 8 if device == "cuda" else 2
    factor = (2 if collective == "all_reduce" else 1) * (world - 1) / world
    busbw = _dist_busbw(impl, max_sms, cap, size)
    median = size * factor / (busbw * 1e9)
    row = {
        "kind": "measurement", "run_id": "run-d", "suite": suite, "op": op, "collective": collective,
        "impl": impl, "max_sms": max_sms, "world": world, "world_size": world, "dtype": "bfloat16",
        "size_bytes": size, "busbw_factor": factor, "algbw_gbps": busbw / factor, "busbw_gbps": busbw,
        "time_s": _times(median), "rounds": 20, "iters_per_round": 4, "mode": "measure", "device": device,
        "backend": "nccl" if device == "cuda" else "gloo",
        "world_mode": REAL if device == "cuda" else REAL_CPU, "note": SYNTHETIC, "timer": "cuda_event",
        "test_id": f"bench/comm_dist.py::x::{op}-{max_sms}-{cap}-{size}",
        "env": {"torch": "2.11.0", "gpus": [{"name": "Test GPU 80GB", "sm_count": 132}]},
    }  # fmt: skip
    if impl == "smptk":
        check = {"exact_equal": True, "reference": f"torch.distributed:{row['backend']}"}
        row.update(ctas=max_sms, signal_ctas=1 if max_sms == 0 else None, check=check,
                   comm_path="copy_engine" if max_sms == 0 else "symmetric",
                   ptx=None if max_sms == 0 else _ptx(max_sms),
                   ptx_note="copy engine: no kernel" if max_sms == 0 else "static counts")  # fmt: skip
    else:
        row.update(nccl_config=config, nccl_max_ctas=cap)
        if device == "cuda":
            row["nccl_ctas_observed"] = {"max": cap or 24, "distinct": [cap or 24], "kernels": 2}
        else:
            row.update(nccl_ctas_observed=None, nccl_ctas_note="not available: gloo on a CPU")
    return row


def _dist_rows(device: str = "cuda") -> list[dict]:
    rows = []
    nccl = "torch.distributed:nccl" if device == "cuda" else "torch.distributed:gloo"
    for size in DIST_SIZES:
        for k in (1, 8):
            rows.append(_dist_row("comm_dist_bandwidth", "all_reduce_two_shot", "all_reduce", size, max_sms=k,
                                  device=device))  # fmt: skip
        for k in (0, 1, 8):
            rows.append(
                _dist_row("comm_dist_bandwidth", "all_gather", "all_gather", size, max_sms=k, device=device)
            )
        configs = (
            [("default", None), ("max_ctas=1", 1), ("max_ctas=8", 8)] if device == "cuda" else [(None, None)]
        )
        for collective in ("all_reduce", "all_gather"):
            for config, cap in configs:
                rows.append(_dist_row("comm_dist_nccl", collective, collective, size, impl=nccl,
                                      config=config, cap=cap, device=device))  # fmt: skip
    return rows


def _svgs(page: str) -> list[str]:
    return re.findall(r"<svg.*?</svg>", page, flags=re.S)


def _torchrun_part(page: str) -> str:
    return page[page.index("Collectives under torchrun") :]


def _visible(page: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def test_torchrun_rows_show_size_max_sms_path_ctas_and_busbw() -> None:
    rows = _dist_rows()
    page = render_html(rows)
    part = _torchrun_part(page)
    sections = {c.split(" — ")[0]: c for c in part.split("<section><h3>")[1:]}
    assert list(sections)[:2] == ["all_reduce_two_shot", "all_gather"]
    for r in rows:
        size = f"{r['size_bytes'] // MiB} MiB"
        if r["impl"] == "smptk":
            label = {0: "copy engine (0 SMs)", 1: "1 SM", 8: "8 SMs"}[r["max_sms"]]
            head = f"<tr><td class='l'>{size}</td><td class='l'>{label}</td><td>{r['max_sms']}</td>"
            path = r["comm_path"]
            ctas = "0 (+ 1-CTA signal kernel)" if r["max_sms"] == 0 else str(r["max_sms"])
            section = sections[r["op"]]
        else:
            label = "NCCL" if r["nccl_config"] == "default" else f"NCCL {r['nccl_config']}"
            head = f"<tr><td class='l'>{size}</td><td class='l'>{label}</td><td>—</td>"
            path = f"torch.distributed:nccl ({r['nccl_config']})"
            seen = r["nccl_max_ctas"] or 24
            ctas = f"{seen} (profiler: {seen})"
            section = sections["all_reduce_two_shot" if r["collective"] == "all_reduce" else "all_gather"]
        lines = re.findall(r"<tr><td class='l'>[^<]*</td><td class='l'>.*?</tr>", section)
        (line,) = [line for line in lines if line.startswith(head)]  # one detail row per case
        assert f"<td class='l'>{path}</td><td class='l'>{ctas}</td><td>{_fmt(r['busbw_gbps'])}</td>" in line
        if r["impl"] != "smptk":
            code = ""
        elif r["max_sms"] == 0:
            code = "no kernel (copy engine)"
        else:
            code = html.escape(
                f"sm_90a · 128-bit ld/st {40 + r['max_sms']}/20 · scalar 12/6 · 94 regs · 0 B local"
            )
        assert line.endswith(f"<td class='l muted'>{code}</td></tr>"), line
    # the size x line pivot of all_gather: header in line order, one row per size
    assert (
        "<tr><th class='l'>size</th><th>copy engine (0 SMs)</th><th>1 SM</th><th>8 SMs</th><th>NCCL</th>"
        "<th>NCCL max_ctas=1</th><th>NCCL max_ctas=8</th></tr>"
    ) in part
    assert "<tr><td class='l'>4 MiB</td><td>304.0</td><td>44.00</td><td>324.0</td><td>354.0</td>" in part
    assert REAL in part and html.escape(REAL_WORLD_TEXT) in part


def test_one_busbw_chart_per_collective_with_a_line_per_budget_and_nccl() -> None:
    page = render_html(_dist_rows())
    svgs = _svgs(_torchrun_part(page))
    assert len(svgs) == 2  # all_reduce_two_shot, all_gather
    expected = {
        0: ["1 SM", "8 SMs", "NCCL", "NCCL max_ctas=1", "NCCL max_ctas=8"],
        1: ["copy engine (0 SMs)", "1 SM", "8 SMs", "NCCL", "NCCL max_ctas=1", "NCCL max_ctas=8"],
    }
    for i, svg in enumerate(svgs):
        root = ET.fromstring(svg)
        texts = [t.text for t in root.iter(f"{SVG_NS}text")]
        assert texts[-len(expected[i]) :] == expected[i]  # the legend, one entry per line
        assert "busbw GB/s" in svg and "message size" in svg and "log scale" not in svg
        assert [t for t in texts if t in ("1 MiB", "4 MiB", "16 MiB")] == ["1 MiB", "4 MiB", "16 MiB"]
        polylines = root.findall(f"{SVG_NS}polyline")
        assert len(polylines) == len(expected[i])  # one line per budget and per NCCL communicator
        circles = [c for c in root.iter(f"{SVG_NS}circle") if c.find(f"{SVG_NS}title") is not None]
        assert len(circles) == 3 * len(expected[i])  # a point per size on every line
        # the axis reaches the data: the top tick is at least the largest busbw, and below twice it
        ticks = [float(t.replace(",", "")) for t in texts if re.fullmatch(r"[\d,]+(\.\d+)?", t or "")]
        largest = 366.0  # NCCL's default communicator at 16 MiB: 350 + 16 GB/s, the top of both charts
        assert largest <= max(ticks) < 2 * largest
        ys = sorted(float(c.get("cy")) for c in circles)
        assert ys[0] < ys[-1]  # not all on one height (the old charts: empty, on a 0-1 axis)
    ag = ET.fromstring(svgs[1])
    by_title = {c.find(f"{SVG_NS}title").text.split(":")[0]: c for c in ag.iter(f"{SVG_NS}circle")
                if c.find(f"{SVG_NS}title") is not None}  # fmt: skip
    assert by_title["8 SMs, 16 MiB"].get("fill") == by_title["NCCL max_ctas=8, 16 MiB"].get("fill")
    assert by_title["8 SMs, 16 MiB"].get("fill") == BUDGET_COLORS[8]
    dashed = [p.get("stroke") for p in ag.findall(f"{SVG_NS}polyline") if p.get("stroke-dasharray")]
    assert dashed == [BUDGET_COLORS[1], BUDGET_COLORS[8]]  # NCCL capped lines, in their budget's colour
    assert "copy engine (0 SMs), 16 MiB: 316.0 busbw GB/s (IQR " in svgs[1]


def test_line_chart_goes_logarithmic_across_decades() -> None:
    cpu = render_html(_dist_rows(device="cpu"))
    svgs = _svgs(_torchrun_part(cpu))
    assert len(svgs) == 2
    # CPU-sized numbers: smptk lines near 40-330 GB/s here, but a gloo line 100x off would flatten them
    wide = svg_line_chart(
        [4096], [("1 SM", "#f00", False, {4096: (1e-5, 9e-6, 1.1e-5)}), ("gloo", "#000", False,
                 {4096: (6e-3, 5e-3, 7e-3)})], unit="busbw GB/s",
    )  # fmt: skip
    root = ET.fromstring(wide)
    assert "busbw GB/s (log scale)" in wide
    ys = [float(c.get("cy")) for c in root.iter(f"{SVG_NS}circle") if c.find(f"{SVG_NS}title") is not None]
    assert abs(ys[0] - ys[1]) > 100  # 2.8 decades apart on a 220-pixel axis
    texts = [t.text for t in root.iter(f"{SVG_NS}text")]
    assert "1e-05" in texts and "0.01" in texts


def test_cpu_torchrun_rows_say_functional_and_real() -> None:
    page = render_html(_dist_rows(device="cpu"))
    text = _visible(page)
    assert CPU_TEXT in text and CPU_FOOTER in text and DIST_FOOTER in text and REAL_WORLD_TEXT in text
    assert REAL_CPU in text and "gloo" in text
    assert "(CPU quick mode: functional numbers, not GPU results)" in text  # every chart caption
    assert WORLD_MODE_TEXT not in text and SIMULATED_FOOTER not in text
    assert "NCCL CTAs: not available: gloo on a CPU" in text
    assert "<td class='l'>torch.distributed:gloo</td><td class='l'>not available</td>" in page


def test_footer_and_banners_follow_the_row_kinds() -> None:
    gpu = _visible(render_html(_dist_rows()))
    assert DIST_FOOTER in gpu and REAL_WORLD_TEXT in gpu
    assert SIMULATED_FOOTER not in gpu and WORLD_MODE_TEXT not in gpu  # real rows are not called simulated
    assert CPU_TEXT not in gpu and CPU_FOOTER not in gpu  # GPU rows are not called CPU numbers
    sim = _visible(render_html(_comm_rows()))
    assert SIMULATED_FOOTER in sim and WORLD_MODE_TEXT in sim
    assert DIST_FOOTER not in sim and REAL_WORLD_TEXT not in sim
    both = _visible(render_html(_comm_rows() + _dist_rows()))
    assert (
        both.index(WORLD_MODE_TEXT) < both.index("Collectives under torchrun") < both.index(REAL_WORLD_TEXT)
    )
    assert both.index(SIMULATED_FOOTER) < both.index(DIST_FOOTER)


def _interference_rows() -> list[dict]:
    def conc(
        impl: str, k: int | None, slowdown: float, bound: float | None, config: str | None = None
    ) -> dict:
        return {
            "kind": "measurement", "run_id": "run-d", "suite": "comm_dist_interference",
            "op": "gemm_concurrent",
            "impl": impl, "collective": "all_gather", "algorithm": "copy_engine" if k == 0 else None,
            "max_sms": k, "nccl_config": config, "nccl_max_ctas": None, "world": 8, "size_bytes": 64 * MiB,
            "gemm": {"M": 8192, "N": 8192, "K": 8192, "dtype": "bfloat16", "calls_per_round": 20},
            "sm_count": 132, "time_s": _times(2e-3 * slowdown), "gemm_alone_s": _times(2e-3),
            "slowdown": slowdown, "slowdown_bound": bound,
            "bound_met": None if bound is None else slowdown <= bound,
            "collective_alone_s": _times(150e-6), "collective_calls": 30, "covered": True,
            "concurrency": "side CUDA stream", "device": "cuda", "world_mode": REAL, "note": SYNTHETIC,
            "ctas": k, "signal_ctas": 1 if k == 0 else None,
            **({"nccl_ctas_observed": {"max": 24, "distinct": [24]}} if impl != "smptk" else {}),
        }  # fmt: skip

    return [
        conc("smptk", 0, 1.02, 1.03),
        conc("smptk", 8, 1.10, 1 + 1.2 * 8 / 132),
        conc("torch.distributed:nccl", None, 1.25, None, "default"),
    ]


def test_torchrun_interference_and_ddp_rows() -> None:
    ddp = {
        "kind": "measurement", "run_id": "run-d", "suite": "comm_dist_ddp", "op": "ddp_step", "impl": "smptk",
        "hook": "smptk.comm.adapters.ddp_comm_hook", "world": 2, "dtype": "bfloat16", "device": "cuda",
        "model": {"layers": 8, "hidden": 4096, "batch_per_rank": 4096}, "time_s": _times(0.05),
        "samples_per_s": 163840.0, "scaling_efficiency": 0.9, "comm_path": "symmetric",
        "check": {"passed": True}, "world_mode": REAL, "note": SYNTHETIC,
    }  # fmt: skip
    page = render_html([*_interference_rows(), ddp])
    part = _torchrun_part(page)
    # 1.02x under the copy engine's 1.03 bound; 1.10x over 1 + 1.2 x 8 / 132 = 1.073x
    assert "<td>1.020×</td><td>1.030×</td><td>yes</td><td>yes</td>" in part
    assert "<td>1.100×</td><td>1.073×</td><td>NO</td><td>yes</td>" in part
    assert "<td class='l'>0 (+ 1-CTA signal kernel)</td><td>150.0</td><td>30</td><td>2.000</td>" in part
    assert "<td>1.250×</td><td>—</td><td>—</td>" in part and "24 (profiler: 24)" in part
    assert "GEMM 8192³ (bfloat16, 20 per round) beside a 64 MiB collective — W=8" in part
    (chart,) = _svgs(part)
    bars = [r for r in ET.fromstring(chart).iter(f"{SVG_NS}rect") if r.find(f"{SVG_NS}title") is not None]
    assert [b.find(f"{SVG_NS}title").text.split(":")[0] for b in bars] == [
        "copy engine (0 SMs) all_gather",
        "8 SMs all_gather",
        "NCCL all_gather",
    ]
    assert bars[0].get("fill") == BUDGET_COLORS[0]
    assert "DDP step: 8 × Linear(4096), batch 4096 per rank, bfloat16" in part
    assert "<td>2</td><td class='l'>smptk</td>" in part and "<td>0.900</td>" in part


def test_header_counts_rows_and_no_none_anywhere() -> None:
    from test_bench_harness import _row as linear_row

    no_pass = linear_row("smptk", 0.002) | {"pass": None}  # a suite whose rows have no pass
    failed = {"kind": "failed", "run_id": "run-d", "test_id": "bench/comm_dist.py::bandwidth::x",
              "reason": "smptk's first result differs", "suite": "comm_dist_bandwidth"}  # fmt: skip
    skipped = {"kind": "skipped", "run_id": "run-d", "test_id": "bench/comm_dist.py::nccl::max_ctas_sweep",
               "reason": "no NCCL here", "suite": "comm_dist_nccl"}  # fmt: skip
    eager = linear_row("torch_eager", 0.004) | {"pass": None}
    rows = [no_pass, eager, *_comm_rows(), *_dist_rows(), *_interference_rows()]
    rows += [failed, skipped, dict(skipped)]
    page = render_html(rows)
    measured = len(rows) - 3
    assert counts_text(row_counts(rows)) == f"{measured} measurement rows, 2 skipped, 1 failed"
    header = page.split("<p class='meta'>")[1].split("</p>")[0]
    assert header.startswith(f"{measured} measurement rows, 2 skipped, 1 failed (rows, not benchmarks")
    summary = page.split("<h2>Summary (smptk)</h2>")[1].split("</table>")[0]
    assert summary.count("<tr>") == 2  # header + fused_linear: no collective row in the linear summary
    assert "<td class='l'>fused_linear(gelu, bias)</td><td class='l'>—</td>" in summary  # no pass: a dash
    assert "<td>2.00×</td>" in summary
    assert "None" not in _visible(page)
    assert "Not measured (3)" in page
