"""Self-contained HTML report from benchmark rows (JSON lines): tables, inline SVG charts, environment.

Everything shown comes from the rows: medians, spreads and throughputs are the rows' own numbers, and
derived columns are ratios of rows of the same run (speedup = baseline median / median, the baseline
being torch_eager or the suite's own, :data:`SUITE_BASELINES`; "% of matmul" = TFLOP/s / torch_matmul
TFLOP/s). A missing implementation shows as a dash, never as an estimate. Sections whose rows count no
FLOPs (MoE routing) chart GB/s; rows with a ``routing_share`` (MoE layer) get a column for it. A page
of several runs (results files concatenated to compare commits or GPUs) names each row's run in its tables,
gives each run its own bars and summary lines, and compares rows only within their run.
The page has no script, no external CSS or font, and the charts are SVG written here.

Collective benchmarks (suites ``comm_*``) get their own part of the page, written by
:mod:`bench.report_comm`: the simulated world's rows under its banner, the torchrun rows under their own
``world_mode`` (real processes), each with bandwidth against message size and SM budget side by side
with NCCL (or gloo), GEMM interference and DDP. The header counts rows by kind (:func:`row_counts`),
which ``python -m bench`` prints too; rows are not benchmarks (a torchrun benchmark writes many). Rows
measured on a CPU are labelled functional numbers, not GPU results, in the notes and the footer.

Usage::

    python -m bench.report bench/results/nvidia-h100-80gb-hbm3/2026-11-22-e60bd426.jsonl [-o out.html]

Example::

    >>> from bench.report import render_html
    >>> html_text = render_html(rows)  # rows: list of dicts as written by bench.rows.RowWriter
    >>> "<svg" in html_text
    True
"""

from __future__ import annotations

import argparse
import html
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.rows import read_rows
from bench.targets import TABLE_COLUMNS, table_cells

IMPL_ORDER = (
    "smptk",
    "smptk_routing",
    "torch_eager",
    "eager_loop",
    "torch_grouped_mm",
    "torch_compile",
    "torch_matmul",
)
IMPL_COLORS = {
    "smptk": "#c0392b",
    "torch_eager": "#2e6da4",
    "torch_compile": "#3a9a48",
    "torch_matmul": "#7a7a7a",
}
_EXTRA_COLORS = ("#8e5ea2", "#e08a1e", "#17a2b8", "#6b4f2a", "#d35d8e", "#5b8c2a", "#3b4cc0", "#b8860b")
BASELINE = "torch_eager"
# Suites whose plain-PyTorch baseline has another name (bench/test_bench_moe.py: the HF-style expert loop;
# bench/test_bench_tp_sim.py: the unfused pair, which the target tp.fused_pair_vs_sequential_sim reads).
SUITE_BASELINES = {"moe": "eager_loop", "tp_sim": "torch_sequential"}
CEILING = "torch_matmul"

_CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, Roboto, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 4px; } h2 { font-size: 1.2em; margin-top: 32px; }
.meta { color: #555; margin-bottom: 16px; }
.note { border: 2px solid #c0392b; background: #fdecea; color: #8b1e12; padding: 10px 14px;
        font-weight: 600; margin: 12px 0; }
table { border-collapse: collapse; margin: 8px 0 16px 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f2f2f2; } td.l, th.l { text-align: left; }
tr.best td { font-weight: 600; }
.env td { text-align: left; } .muted { color: #777; }
svg { font-family: inherit; }
footer { margin-top: 32px; color: #555; font-size: 0.85em; max-width: 900px; }
footer p { margin: 6px 0; }
.world { border: 2px solid #b8860b; background: #fff6db; color: #5a4200; padding: 10px 14px;
         font-weight: 600; margin: 12px 0; }
.real { border: 2px solid #2e7d32; background: #e8f5e9; color: #1b4d1f; padding: 10px 14px;
        font-weight: 600; margin: 12px 0; }
h3 { font-size: 1.05em; margin-top: 24px; } figure { margin: 8px 0; }
.charts { display: flex; flex-wrap: wrap; gap: 8px 20px; } .charts figure { margin: 0; }
figcaption { font-size: 0.85em; color: #555; text-align: center; }
"""


def _esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _fmt(value: float | None, digits: int = 4) -> str:
    """``digits`` significant figures, plain notation; a dash for a missing value."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if value == 0:
        return "0"
    if abs(value) < 1e-3:
        return f"{value:.{digits}g}"
    magnitude = math.floor(math.log10(abs(value)))
    decimals = max(0, digits - 1 - magnitude)
    return f"{value:,.{decimals}f}"


def _impl_key(impl: str) -> tuple[int, str]:
    return (IMPL_ORDER.index(impl), impl) if impl in IMPL_ORDER else (len(IMPL_ORDER), impl)


def _impl_color(impl: str, others: list[str]) -> str:
    if impl in IMPL_COLORS:
        return IMPL_COLORS[impl]
    return _EXTRA_COLORS[others.index(impl) % len(_EXTRA_COLORS)] if impl in others else "#444"


def op_label(row: dict[str, Any]) -> str:
    """``fused_linear(gelu, bias)``, ``fused_linear(bias)``, ``swiglu``: the op as a reader names it."""
    parts = [p for p in (row.get("activation"), "bias" if row.get("bias") else None) if p]
    return f"{row.get('op')}({', '.join(parts)})" if parts else str(row.get("op"))


def _ordered_shape(shape: dict[str, int] | None) -> list[tuple[str, int]]:
    """Shape items with M, K, N first in that order (rows store keys sorted), then any others."""
    shape = shape or {}
    known = [(k, shape[k]) for k in ("M", "K", "N") if k in shape]
    return known + sorted((k, v) for k, v in shape.items() if k not in ("M", "K", "N"))


def _shape_label(shape: dict[str, int] | None) -> str:
    items = _ordered_shape(shape)
    return " × ".join(f"{k}={v}" for k, v in items) if items else "—"


def _cell(value: Any) -> str:
    """A row field as table text: a dash for a missing value (never "None")."""
    return "—" if value is None else str(value)


def _section_key(row: dict[str, Any]) -> tuple[str, str, str, str]:
    """(suite, op label, pass, dtype); a row's ``config`` (tensor-parallel "sp" / "no_sp", the MoE configs,
    the planner's checkpointing) joins the label, so rows of different configs never share a section."""
    label = op_label(row) + (f" [{row['config']}]" if row.get("config") else "")
    return (_cell(row.get("suite")), label, _cell(row.get("pass")), _cell(row.get("dtype")))


def _shape_key(row: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    return tuple(_ordered_shape(row.get("shape")))


def _median_s(row: dict[str, Any]) -> float | None:
    median = (row.get("time_s") or {}).get("median")
    return float(median) if isinstance(median, (int, float)) and median > 0 else None


def _tflops_at(row: dict[str, Any], seconds: float | None) -> float | None:
    """TFLOP/s of the row's FLOPs in ``seconds``; None for a row that counts none (MoE routing)."""
    flops = row.get("flops")
    if not seconds or not isinstance(flops, (int, float)) or flops <= 0:
        return None
    return flops / seconds / 1e12


def _peer(rows: list[dict[str, Any]], row: dict[str, Any], impl: str) -> dict[str, Any] | None:
    """The row of ``impl`` for the same run, op, pass, dtype and shape as ``row`` (latest if repeated)."""
    matches = [
        r
        for r in rows
        if r.get("impl") == impl
        and r.get("run_id") == row.get("run_id")
        and _section_key(r) == _section_key(row)
        and _shape_key(r) == _shape_key(row)
    ]
    return matches[-1] if matches else None


def pct_of_ceiling(rows: list[dict[str, Any]], row: dict[str, Any]) -> float | None:
    """``row``'s TFLOP/s as a percentage of torch_matmul's in the same run and case; None when absent."""
    ceiling = _peer(rows, row, CEILING)
    mine = _tflops_at(row, _median_s(row))
    theirs = _tflops_at(ceiling, _median_s(ceiling)) if ceiling else None
    return 100 * mine / theirs if mine and theirs else None


def baseline_of(row: dict[str, Any]) -> str:
    """The impl a row's speedup is measured against: ``torch_eager``, or its suite's own baseline."""
    return SUITE_BASELINES.get(str(row.get("suite")), BASELINE)


def speedup_vs(rows: list[dict[str, Any]], row: dict[str, Any], impl: str | None = None) -> float | None:
    """``impl``'s (default: :func:`baseline_of`) median time / ``row``'s within the same run and case;
    None when absent."""
    peer = _peer(rows, row, impl or baseline_of(row))
    mine, theirs = _median_s(row), (_median_s(peer) if peer else None)
    return theirs / mine if mine and theirs else None


def _nice_ceiling(value: float) -> tuple[float, float]:
    """(axis maximum, tick step): the smallest round step (1, 2, 2.5, 5 x 10^e) giving at most 6 ticks."""
    if value <= 0:
        return 1.0, 0.25
    exponent = math.floor(math.log10(value)) - 1
    for base in (1, 2, 2.5, 5, 10, 20):  # value / (20 * 10^exponent) < 5, so the loop always returns
        step = base * 10.0**exponent
        if value / step <= 6:
            return math.ceil(value / step) * step, step
    raise AssertionError("unreachable")


def svg_bar_chart(
    groups: list[str],
    series: list[str],
    values: dict[tuple[str, str], tuple[float, float, float]],
    *,
    unit: str,
    colors: dict[str, str] | None = None,
) -> str:
    """Grouped bar chart as an inline ``<svg>``: one group per label, one bar per series, with whiskers.

    ``values[(group, series)] = (value, low, high)``; missing pairs draw no bar. ``colors`` maps a series
    to its fill (default: :data:`IMPL_COLORS`, then a palette). Each bar has a
    ``<title>`` with its numbers, so hovering shows them without any script.

    Example::

        >>> svg = svg_bar_chart(["M=7"], ["smptk"], {("M=7", "smptk"): (1.0, 0.9, 1.1)}, unit="TFLOP/s")
        >>> svg.startswith("<svg")
        True
    """
    others = sorted(s for s in series if s not in IMPL_COLORS)

    def color(s: str) -> str:
        return (colors or {}).get(s) or _impl_color(s, others)

    vmax = max([hi for (_, _, hi) in values.values()] + [v for (v, _, _) in values.values()] + [0.0])
    axis_max, step = _nice_ceiling(vmax)
    ticks = round(axis_max / step)
    tick_labels = [_fmt(i * step, 3) for i in range(ticks + 1)]
    label_lines = [group.split(" × ") for group in groups]
    bar_w, gap, top, plot_h = 18, 26, 34, 200
    bottom = max(74, 24 + 13 * max((len(lines) for lines in label_lines), default=0))
    left = 34 + 7 * max(len(t) for t in tick_labels)  # room for the widest tick label and the axis title
    # Wide enough for the group's longest label line (about 6.5 px a character at font size 11).
    widest = max((len(part) for lines in label_lines for part in lines), default=0)
    group_w = max(max(1, len(series)) * bar_w + gap, math.ceil(6.5 * widest) + 12)
    legend_w = sum(24 + 7 * len(s) for s in series)
    width = max(320, left + len(groups) * group_w + 20, left + legend_w + 10)
    height = top + plot_h + bottom

    def y(v: float) -> float:
        return top + plot_h - (v / axis_max) * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{_esc(unit)} by shape and implementation">'
    ]
    # Legend along the top.
    x_leg = left
    for s in series:
        out.append(f'<rect x="{x_leg}" y="8" width="12" height="12" fill="{color(s)}"/>')
        out.append(f'<text x="{x_leg + 16}" y="18" font-size="12">{_esc(s)}</text>')
        x_leg += 24 + 7 * len(s)
    # Axis, grid and ticks.
    for i, label in enumerate(tick_labels):
        v = i * step
        out.append(
            f'<line x1="{left}" y1="{y(v):.1f}" x2="{width - 10}" y2="{y(v):.1f}" stroke="#e3e3e3"/>'
            f'<text x="{left - 6}" y="{y(v) + 4:.1f}" font-size="11" text-anchor="end">{label}</text>'
        )
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#555"/>')
    out.append(
        f'<text x="14" y="{top + plot_h / 2:.0f}" font-size="12" text-anchor="middle" '
        f'transform="rotate(-90 14 {top + plot_h / 2:.0f})">{_esc(unit)}</text>'
    )
    for gi, group in enumerate(groups):
        x0 = left + gi * group_w + (group_w - len(series) * bar_w) / 2  # the bars centred in their group
        for si, s in enumerate(series):
            if (group, s) not in values:
                continue
            v, lo, hi = values[(group, s)]
            x = x0 + si * bar_w
            out.append(
                f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{bar_w - 2}" height="{max(0.0, y(0) - y(v)):.1f}" '
                f'fill="{color(s)}"><title>{_esc(s)} {_esc(group)}: {_fmt(v)} {_esc(unit)} '
                f"(IQR {_fmt(lo)}–{_fmt(hi)})</title></rect>"
            )
            cx = x + (bar_w - 2) / 2
            out.append(f'<line x1="{cx:.1f}" y1="{y(hi):.1f}" x2="{cx:.1f}" y2="{y(lo):.1f}" stroke="#111"/>')
        label_x = x0 + len(series) * bar_w / 2
        for li, part in enumerate(label_lines[gi]):
            out.append(
                f'<text x="{label_x:.1f}" y="{top + plot_h + 16 + 13 * li}" font-size="11" '
                f'text-anchor="middle">{_esc(part)}</text>'
            )
    out.append("</svg>")
    return "".join(out)


def _runs(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The run ids of ``rows`` in the order they first appear."""
    return list(dict.fromkeys(str(r.get("run_id")) for r in rows))


def _section_html(
    rows: list[dict[str, Any]], key: tuple[str, str, str, str], section: list[dict], *, by_run: bool = False
) -> str:
    """One section's chart and table. With ``by_run`` (a page of several runs) every row names its run, and
    each (shape, run) is a group of its own: rows of two runs are never drawn as one bar or left to look
    alike in the table."""
    suite, label, pass_, dtype = key
    impls = sorted({str(r.get("impl")) for r in section}, key=_impl_key)
    cases: list[tuple] = []  # (shape, run) in the order they appear; run is "" on a one-run page
    for r in section:
        case = (_shape_key(r), str(r.get("run_id")) if by_run else "")
        if case not in cases:
            cases.append(case)
    notes = sorted({r["note"] for r in section if r.get("note")})
    baseline = SUITE_BASELINES.get(suite, BASELINE)
    # Rows that count no FLOPs (MoE routing: gathers and scatters) are charted in GB/s instead.
    unit = "TFLOP/s" if any((_num(r, "flops") or 0) > 0 for r in section) else "GB/s"
    shares = any("routing_share" in r for r in section)

    values: dict[tuple[str, str], tuple[float, float, float]] = {}
    body = []
    for shape, run in cases:
        shape_rows = sorted(
            (r for r in section if _shape_key(r) == shape and (not by_run or str(r.get("run_id")) == run)),
            key=lambda r: _impl_key(r["impl"]),
        )
        best = min((_median_s(r) or math.inf) for r in shape_rows)
        for r in shape_rows:
            t = r.get("time_s") or {}
            med = _median_s(r)
            tflops = _tflops_at(r, med)
            group = _group_label(shape, run)
            if unit == "GB/s":
                nbytes = _num(r, "bytes")
                if med and nbytes:
                    gbps = nbytes / med / 1e9
                    values[(group, r["impl"])] = (gbps, _at_time(r, nbytes, "q3"), _at_time(r, nbytes, "q1"))
            elif tflops is not None:
                values[(group, r["impl"])] = (
                    tflops,
                    _tflops_at(r, t.get("q3")) or 0.0,
                    _tflops_at(r, t.get("q1")) or 0.0,
                )
            pct = pct_of_ceiling(rows, r)
            speed = speedup_vs(rows, r)
            check = r.get("check") or {}
            iqr_ms = t.get("iqr") * 1e3 if isinstance(t.get("iqr"), (int, float)) else None
            rel = t.get("iqr_rel")
            share = _num(r, "routing_share")
            share_text = _fmt(100 * share, 3) + "%" if share is not None else "—"
            share_td = f"<td>{share_text}</td>" if shares else ""
            body.append(
                f'<tr class="{"best" if med is not None and med == best else ""}">'
                f'<td class="l">{_esc(_shape_label(r.get("shape")))}</td>'
                + (f'<td class="l">{_esc(run)}</td>' if by_run else "")
                + f'<td class="l">{_esc(r.get("impl"))}</td>'
                f'<td class="l muted">{_esc(r.get("kernel_path"))}</td>'
                f"<td>{_fmt(med * 1e3 if med else None)}</td>"
                f"<td>{_fmt(iqr_ms, 3)}"
                f"{f' ({_fmt(100 * rel, 2)}%)' if isinstance(rel, (int, float)) else ''}</td>"
                f"<td>{_fmt(t.get('min') * 1e3 if isinstance(t.get('min'), (int, float)) else None)}</td>"
                f"<td>{_fmt(tflops)}</td><td>{_fmt(r.get('gbps'))}</td>"
                f"<td>{_fmt(speed, 3) + '×' if speed else '—'}</td>"
                f"<td>{_fmt(pct, 3) + '%' if pct else '—'}</td>"
                f"<td>{_esc(r.get('rounds'))}</td>"
                f"<td>{_fmt(check.get('max_abs_err'), 2) if check else '—'}</td>{share_td}</tr>"
            )
    head = (
        "<tr><th class='l'>shape</th>"
        + ("<th class='l'>run</th>" if by_run else "")
        + "<th class='l'>impl</th><th class='l'>path</th><th>median ms</th>"
        "<th>IQR ms (% of median)</th><th>min ms</th><th>TFLOP/s</th><th>GB/s (compulsory)</th>"
        f"<th>speedup vs {baseline}</th><th>% of {CEILING} TFLOP/s</th><th>rounds</th>"
        "<th>max abs err vs fp32</th>"
        + ("<th>routing + dispatch + combine, % of layer time</th>" if shares else "")
        + "</tr>"
    )
    note_html = "".join(f'<p class="note">{_esc(n)}</p>' for n in notes)
    chart = svg_bar_chart([_group_label(shape, run) for shape, run in cases], impls, values, unit=unit)
    return (
        f'<section><h2>{_esc(label)} — {_esc(pass_)} — {_esc(dtype)} <span class="muted">({_esc(suite)})'
        f"</span></h2>{note_html}{chart}<table>{head}{''.join(body)}</table></section>"
    )


def _group_label(shape: tuple[tuple[str, int], ...], run: str) -> str:
    """A chart group's label: the shape, and on a page of several runs the run on a line of its own."""
    return _shape_label(dict(shape)) + (f" × run {run}" if run else "")


def _summary_html(
    rows: list[dict[str, Any]], sections: dict[tuple, list[dict]], *, by_run: bool = False
) -> str:
    """Per section (and per run, ``by_run``, on a page of several runs: speedups of two commits are never
    averaged together): geometric-mean speedup of smptk vs torch_eager (or its suite's baseline, see
    :data:`SUITE_BASELINES`) over its shapes, and smptk's lowest % of torch_matmul."""
    others = sorted({(key[0], SUITE_BASELINES[key[0]]) for key in sections if key[0] in SUITE_BASELINES})
    baseline_text = BASELINE + (f" ({'; '.join(f'{s} suite: {b}' for s, b in others)})" if others else "")
    lines = []
    for key, section in sections.items():
        for run in _runs(section) if by_run else [""]:
            ours = [r for r in _ours(section) if not by_run or str(r.get("run_id")) == run]
            speedups = [s for r in ours if (s := speedup_vs(rows, r)) is not None]
            pcts = [p for r in ours if (p := pct_of_ceiling(rows, r)) is not None]
            geo = math.exp(statistics.fmean(math.log(s) for s in speedups)) if speedups else None
            worst = min(pcts) if pcts else None
            lines.append(
                f"<tr><td class='l'>{_esc(key[1])}</td><td class='l'>{_esc(key[2])}</td><td class='l'>"
                f"{_esc(key[3])}</td>"
                + (f"<td class='l'>{_esc(run)}</td>" if by_run else "")
                + f"<td>{len({_shape_key(r) for r in ours})}</td>"
                f"<td>{_fmt(geo, 3) + '×' if geo else '—'}</td>"
                f"<td>{_fmt(worst, 3) + '%' if worst else '—'}</td></tr>"
            )
    return (
        "<h2>Summary (smptk)</h2><table><tr><th class='l'>op</th><th class='l'>pass</th><th class='l'>dtype"
        "</th>" + ("<th class='l'>run</th>" if by_run else "") + "<th>shapes</th>"
        f"<th>geo-mean speedup vs {baseline_text}</th><th>lowest % of {CEILING} TFLOP/s</th></tr>"
        + "".join(lines)
        + "</table>"
    )


def _ours(section: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The section's rows of smptk: impl "smptk", or where a suite names its own (``smptk_routing``,
    ``smptk_fused``, ...), the first of those in :data:`IMPL_ORDER`."""
    names = sorted(
        {str(r.get("impl")) for r in section if str(r.get("impl")).startswith("smptk")}, key=_impl_key
    )
    return [r for r in section if names and r.get("impl") == names[0]]


def _fmt_bytes(n: Any) -> str:
    """In the largest unit it reaches: whole (``256 MiB``, the L2 flush) or to 3 digits (``79.6 GiB``)."""
    if not isinstance(n, (int, float)) or not n > 0:
        return "—"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1)):
        if n >= scale or unit == "B":
            v = n / scale
            return f"{v:.0f} {unit}" if v.is_integer() else f"{v:.3g} {unit}"
    raise AssertionError("unreachable")


def _gpu_text(g: dict[str, Any]) -> str:
    l2 = g.get("l2_cache_bytes")
    return (
        f"{_cell(g.get('name'))}, {g.get('sm_count') or '?'} SMs, {_fmt_bytes(g.get('memory_total_bytes'))}, "
        f"L2 {f'{l2 / 2**20:.0f} MiB' if l2 else '?'}, "
        f"SM clock {_cell(g.get('sm_clock_mhz'))}/{_cell(g.get('sm_clock_max_mhz'))} MHz (now/max), "
        f"memory clock max {_cell(g.get('mem_clock_max_mhz'))} MHz, driver {_cell(g.get('driver_version'))}"
    )


def _kernel_path_text(path: Any) -> str:
    if not isinstance(path, dict):
        return _cell(path)
    return (
        f"SMPTK_KERNELS={path.get('requested')}, TRITON_INTERPRET={path.get('interpreter')}: CPU tensors run "
        f"{path.get('cpu')}, CUDA tensors run {path.get('cuda')}"
    )


def _env_html(rows: list[dict[str, Any]]) -> str:
    """One environment table per run id in the file (normally one)."""
    parts = []
    seen: dict[str, dict[str, Any]] = {}
    for r in rows:
        seen.setdefault(str(r.get("run_id")), r)
    for run, r in seen.items():
        env = r.get("env") or {}
        items: list[tuple[str, Any]] = [
            ("run id", run),
            ("mode", f"{_cell(r.get('mode'))} on {_cell(r.get('device'))}"),
            ("timer", _cell(r.get("timer"))),
            (
                "L2 flush per round",
                _fmt_bytes(r.get("l2_flush_bytes")) if r.get("l2_flush_bytes") else "none",
            ),
            (
                "git",
                f"{env.get('git_sha') or 'not a git checkout'}"
                + {True: " (uncommitted changes)", False: " (clean)"}.get(env.get("git_dirty"), ""),
            ),
            ("smptk / torch / triton", " / ".join(_cell(env.get(k)) for k in ("smptk", "torch", "triton"))),
            ("CUDA / NCCL", f"{env.get('cuda') or '—'} / {env.get('nccl') or '—'}"),
            ("python / platform", f"{_cell(env.get('python'))} / {_cell(env.get('platform'))}"),
            (
                "CPUs / world size / rank",
                " / ".join(_cell(env.get(k)) for k in ("cpu_count", "world_size", "rank")),
            ),
            ("kernel path", _kernel_path_text(env.get("kernel_path"))),
            (
                "env vars",
                ", ".join(f"{k}={v}" for k, v in (r.get("env_vars") or {}).items() if v is not None),
            ),
        ]
        gpus = env.get("gpus") or []
        if not gpus:
            items.append(("GPU", f"none ({_cell(env.get('gpu_note'))})"))
        items.extend((f"GPU {i}", _gpu_text(g)) for i, g in enumerate(gpus))
        rows_html = "".join(f"<tr><th class='l'>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in items)
        parts.append(f'<table class="env">{rows_html}</table>')
    return "<h2>Environment</h2>" + "".join(parts)


def _not_measured_html(rows: list[dict[str, Any]]) -> str:
    others = [r for r in rows if r.get("kind") in ("skipped", "failed")]
    if not others:
        return ""
    body = "".join(
        f"<tr><td class='l'>{_esc(r.get('kind'))}</td><td class='l'>{_esc(r.get('test_id'))}</td>"
        f"<td class='l'>{_esc(r.get('reason'))}</td></tr>"
        for r in others
    )
    return (
        f"<h2>Not measured ({len(others)})</h2><table><tr><th class='l'>kind</th><th class='l'>benchmark</th>"
        f"<th class='l'>reason</th></tr>{body}</table>"
    )


# ----------------------------------------------------------------------------- shared by the parts
def _size_text(nbytes: Any) -> str:
    """``4096`` -> ``4 KiB``, ``1 << 30`` -> ``1 GiB``, ``1500`` -> ``1500 B``."""
    if not isinstance(nbytes, int):
        return "—"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _num(row: dict[str, Any], key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _at_time(row: dict[str, Any], nbytes: float | None, quartile: str) -> float:
    """GB/s moving ``nbytes`` in the row's ``quartile`` time (q1 gives the high whisker); 0 when absent."""
    t = (row.get("time_s") or {}).get(quartile)
    return nbytes / t / 1e9 if nbytes and isinstance(t, (int, float)) and t > 0 else 0.0


ROWS_NOT_TESTS = (
    "rows, not benchmarks: a benchmark writes one row per case it runs, a torchrun benchmark many, so "
    "this count differs from the number of benchmarks pytest ran"
)


def row_counts(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Rows by kind: ``{"measurement": n, "skipped": n, "failed": n}`` (rows of other kinds not counted).

    The report's header and ``python -m bench``'s last line both print this, so they agree.
    """
    return {k: sum(1 for r in rows if r.get("kind") == k) for k in ("measurement", "skipped", "failed")}


def counts_text(counts: dict[str, int]) -> str:
    """``{"measurement": 30, "skipped": 3, "failed": 0}`` -> ``30 measurement rows, 3 skipped, 0 failed``."""
    return f"{counts['measurement']} measurement rows, {counts['skipped']} skipped, {counts['failed']} failed"


CPU_FOOTER = (
    "Rows whose device is cpu were measured in CPU quick mode (Triton interpreter, gloo, host clock, tiny "
    "shapes): functional numbers that show the benchmarks run and match their references, not GPU results."
)
_FOOTER = (
    "Times are medians over rounds of GPU time between two CUDA events (host clock in CPU quick mode), "
    "with the L2 cache flushed before every round by writing a buffer larger than it. Spread is the "
    "interquartile range (whiskers on the charts: TFLOP/s at the first and third quartile times). "
    "TFLOP/s counts only GEMM FLOPs (2·M·N·K per forward GEMM, backward twice the forward) so every "
    "implementation is credited the same work; GB/s counts compulsory traffic (inputs read once, outputs "
    "written once). Speedup and % of torch_matmul compare rows of the same run and shape."
)


def targets_html(summary: dict[str, Any]) -> str:
    """The targets section of a report from ``make gpu-check``'s summary (``<stem>.targets.json``): its
    banner (nothing measured), a re-judging note when there is one, and the table with each target's
    description."""
    head = "".join(f"<th class='l'>{_esc(c)}</th>" for c in TABLE_COLUMNS)
    body = []
    for target in summary.get("targets") or []:
        cells = table_cells(target)
        cells = (cells[0], f"{cells[1]}: {target.get('target')}", *cells[2:])
        body.append("<tr>" + "".join(f"<td class='l'>{_esc(c)}</td>" for c in cells) + "</tr>")
    notes = "".join(
        f"<p class='{cls}'>{_esc(summary[key])}</p>"
        for key, cls in (("banner", "note"), ("rejudged", "muted"))
        if summary.get(key)
    )
    return f"<h2>Targets (make gpu-check)</h2>{notes}<table><tr>{head}</tr>{''.join(body)}</table>"


def render_html(
    rows: Sequence[dict[str, Any]], *, title: str = "smptk benchmarks", targets: dict[str, Any] | None = None
) -> str:
    """The full HTML page for ``rows`` (measurement, skipped and failed rows; others are ignored), with
    ``targets`` (``make gpu-check``'s summary of the same run, :func:`targets_html`) under the heading.

    Example::

        >>> page = render_html(list(read_rows(Path("run.jsonl"))), title="run")
        >>> page.startswith("<!DOCTYPE html>")
        True
    """
    from bench import report_comm  # imported here: it imports this module's helpers

    rows = list(rows)
    measured_all = [r for r in rows if r.get("kind") == "measurement"]
    comm = [r for r in measured_all if r.get("suite") in report_comm.COMM_SUITES]
    measured = [r for r in measured_all if r.get("suite") not in report_comm.COMM_SUITES]
    sections: dict[tuple, list[dict]] = {}
    for r in measured:
        sections.setdefault(_section_key(r), []).append(r)
    notes = sorted({r["note"] for r in rows if r.get("note")})
    runs = sorted({str(r.get("run_id")) for r in rows})
    meta = f"{counts_text(row_counts(rows))} ({ROWS_NOT_TESTS}); run {', '.join(runs) or '—'}"
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_esc(title)}</h1><p class='meta'>{_esc(meta)}</p>",
        targets_html(targets) if targets else "",
        *(f"<p class='note'>{_esc(n)}</p>" for n in notes),
    ]
    if not measured_all:
        parts.append("<p>No measurements in this file.</p>")
    if measured:
        by_run = len(_runs(measured)) > 1
        parts.append(_summary_html(measured, sections, by_run=by_run))
        parts.extend(
            _section_html(measured, key, section, by_run=by_run) for key, section in sections.items()
        )
    parts.append(report_comm.comm_html(comm))
    parts.append(_not_measured_html(rows))
    if rows:
        parts.append(_env_html(rows))
    paragraphs = ([_FOOTER] if measured else []) + report_comm.comm_footers(comm)
    if any(r.get("device") == "cpu" for r in measured_all):
        paragraphs.append(CPU_FOOTER)
    footer = "".join(f"<p>{_esc(p)}</p>" for p in paragraphs)
    parts.append(f"<footer>{footer}</footer></body></html>")
    return "\n".join(parts)


def write_report(jsonl_path: Path, html_path: Path | None = None) -> Path:
    """Render ``jsonl_path`` to ``html_path`` (default: same stem, ``.html``) and return that path.

    A ``<stem>.targets.json`` beside the rows (``make gpu-check``'s targets of the same run) goes into the
    page, so a rebuilt report keeps its targets table.

    Example::

        >>> write_report(Path("bench/results/cpu-interpreter/2026-11-22-e60bd426.jsonl"))
        PosixPath('bench/results/cpu-interpreter/2026-11-22-e60bd426.html')
    """
    jsonl_path = Path(jsonl_path)
    html_path = Path(html_path) if html_path else jsonl_path.with_suffix(".html")
    if html_path.resolve() == jsonl_path.resolve():
        raise ValueError(f"{html_path}: the report would overwrite its own results file; name another output")
    if html_path.is_dir():
        raise ValueError(f"{html_path}: is a directory; name the HTML file (e.g. {html_path / 'r.html'})")
    if not html_path.parent.is_dir():
        raise ValueError(f"{html_path}: its directory {html_path.parent} does not exist")
    rows = [clean_row(r, f"{jsonl_path}: row {i}") for i, r in enumerate(read_rows(jsonl_path), start=1)]
    targets = _targets_of(jsonl_path, rows)
    page = render_html(rows, title=f"smptk benchmarks: {jsonl_path.stem}", targets=targets)
    html_path.write_text(page, encoding="utf-8")
    return html_path


def _targets_of(jsonl_path: Path, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``<stem>.targets.json`` beside ``jsonl_path`` when it judged a run of these rows, else None."""
    path = jsonl_path.with_name(jsonl_path.stem + ".targets.json")
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg})") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(summary).__name__}")
    run = (summary.get("benchmarks") or {}).get("run_id")
    return summary if run is None or run in {r.get("run_id") for r in rows} else None


_NOT_FINITE_TEXT = frozenset({"nan", "inf", "+inf", "-inf", "infinity", "-infinity"})


def clean_row(row: dict[str, Any], where: str = "row") -> dict[str, Any]:
    """``row`` as the report reads it: numbers that are not finite (a NaN / Infinity literal, or the
    "nan" / "inf" strings the row writer stores for them) become None, shown as "—"; a measurement row
    without an ``impl`` or with a ``shape`` that is not an object raises ValueError naming ``where``.

    Example::

        >>> clean_row({"kind": "measurement", "impl": "smptk", "gbps": "inf", "time_s": {"median": 1e400}})
        {'kind': 'measurement', 'impl': 'smptk', 'gbps': None, 'time_s': {'median': None}}
    """

    def finite(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, str) and value.strip().lower() in _NOT_FINITE_TEXT:
            return None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        return value

    out = {k: (v if k in ("note", "reason") else finite(v)) for k, v in row.items()}
    if out.get("kind") == "measurement" and not isinstance(out.get("impl"), str):
        raise ValueError(f"{where}: a measurement row needs an impl (a string), got {out.get('impl')!r}")
    if out.get("shape") is not None and not isinstance(out.get("shape"), dict):
        raise ValueError(f"{where}: shape must be an object of named sizes, got {out.get('shape')!r}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.report FILE.jsonl [-o OUT.html]``: regenerate the HTML report of a results file."""
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=main.__doc__)
    parser.add_argument("jsonl", type=Path, help="results file written by python -m bench")
    parser.add_argument("-o", "--output", type=Path, default=None, help="HTML path (default: beside FILE)")
    args = parser.parse_args(argv)
    if not args.jsonl.is_file():
        print(f"bench.report: {args.jsonl}: no such file", file=sys.stderr)
        return 2
    try:
        out = write_report(args.jsonl, args.output)
    except (ValueError, OSError) as exc:
        print(f"bench.report: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
