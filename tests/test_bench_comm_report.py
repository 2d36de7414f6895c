"""The HTML report's collective part (suites comm_simulated and comm_interference), and one quick run.

The report tests feed synthetic rows (their ``note`` says so) shaped like what bench/test_bench_comm.py
writes, with times chosen so every derived number is easy to state: they check that the page shows the
rows' own numbers (busbw, peer GB/s, median, slowdown, bound), the simulated-world label, one chart per
collective and size, and that the linear part of the report is unchanged beside them. The end-to-end
test runs ``python -m bench`` on three tiny comm cases in quick mode (CPU: Triton interpreter) and reads
the rows and the page it wrote.
"""

from __future__ import annotations

import html
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from bench.counts import collective_counts
from bench.report import WORLD_MODE_TEXT, render_html
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
        "kernel_path": "triton, SIMULATED=True",
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
    selection = "comm and all_gather and W2 and sms1"  # 2 bandwidth cases (4 KiB, 1500 B), 1 interference
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--filter", selection, "--out", str(tmp_path)],
        cwd=ROOT, env=_subprocess_env(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (jsonl,) = sorted(tmp_path.rglob("*.jsonl"))
    rows = list(read_rows(jsonl))
    assert [(r["kind"], r["suite"]) for r in rows] == [
        ("measurement", "comm_simulated"),
        ("measurement", "comm_simulated"),
        ("measurement", "comm_interference"),
    ]
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
    assert html.escape(WORLD_MODE_TEXT) in page and "comm_interference" in page and page.count("<svg") == 3
