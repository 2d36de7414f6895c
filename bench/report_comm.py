"""The collectives' part of the HTML report: the simulated world and the torchrun suites.

Rows of the single-GPU **simulated world** (suites ``comm_simulated`` and ``comm_interference``, written
by bench/test_bench_comm.py) get the simulated-world banner, a size x max_sms table of busbw, one bar
chart per collective and size, a detail table, and the GEMM slowdown table and chart.

Rows from **torchrun** (suites ``comm_dist_*``, written by bench/comm_dist.py on N real processes) get the
rows' own ``world_mode`` ("real world: ..."), never the simulated-world text, and per collective:

- one line chart of busbw against message size, one line per SM budget of smptk (copy engine = 0 SMs)
  and one per torch.distributed communicator (NCCL's default, NCCL capped to k CTAs: dashed, in the
  colour of the k-SM line; gloo on a CPU), each point's ``<title>`` holding its numbers;
- a size x line table of busbw, and a detail table with size, max_sms, the path that ran, the CTAs
  (ours by construction; NCCL's from the profiler trace, or why not), busbw, algbw, time and check;

then the GEMM interference rows (slowdown per SM budget, with bound and coverage) and the DDP rows.
Rows measured on a CPU carry a banner saying they are functional numbers, not GPU results.

Split from bench/report.py, whose page assembly calls :func:`comm_html` and :func:`comm_footers`; the
formatting helpers and the bar chart live there. This file runs past 600 lines because the two kinds of
collective rows share its line chart, line labels and CTA text; splitting them again would put the
simulated and the torchrun sections, which a reader compares, in different modules.

Example::

    >>> from bench.report_comm import comm_html
    >>> "<svg" in comm_html(rows)  # rows: comm_* rows as written by bench.rows.RowWriter
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from bench.counts import COLLECTIVES
from bench.report import (
    _EXTRA_COLORS,
    _at_time,
    _esc,
    _fmt,
    _median_s,
    _num,
    _shape_label,
    _size_text,
    svg_bar_chart,
)

SIMULATED_SUITES = ("comm_simulated", "comm_interference")
DIST_SUITES = ("comm_dist_bandwidth", "comm_dist_nccl", "comm_dist_interference", "comm_dist_ddp")
COMM_SUITES = SIMULATED_SUITES + DIST_SUITES
WORLD_MODE_TEXT = (
    "Simulated world: one rank's kernel, W buffers in one GPU's memory (one CPU process's in CPU quick "
    "mode), no peer, no barrier waits; all traffic is local HBM. These numbers are not multi-GPU "
    "measurements."
)
REAL_WORLD_TEXT = (
    "Real processes: every row in this part comes from separate ranks launched by torchrun (one GPU each "
    "on a GPU machine; CPU processes with gloo and a shared-memory heap on a CPU), not from the "
    "simulated world."
)
CPU_TEXT = (
    "Measured on a CPU in quick mode (Triton interpreter, gloo, host clock): functional numbers that show "
    "the code runs and matches its reference, not GPU results."
)
# One colour per SM budget: smptk's k-SM line and NCCL's line capped at k CTAs share it (NCCL dashed).
BUDGET_COLORS = {0: "#17a2b8", 1: "#f4a582", 2: "#e08a1e", 4: "#d6604d", 8: "#b2182b", 16: "#762a83",
                 32: "#2166ac"}  # fmt: skip
BASELINE_COLOR = "#111111"


def budget_text(k: Any) -> str:
    """``0`` -> ``copy engine (0 SMs)``, ``1`` -> ``1 SM``, ``8`` -> ``8 SMs``."""
    if k == 0:
        return "copy engine (0 SMs)"
    return f"{k} SM{'s' * (k != 1)}"


def _budget_color(k: int) -> str:
    return BUDGET_COLORS.get(k, _EXTRA_COLORS[k % len(_EXTRA_COLORS)])


# ----------------------------------------------------------------------------- simulated world
def _check_text(check: Any) -> str:
    if not isinstance(check, dict):
        return "—"
    if check.get("exact"):
        return f"exact ({check.get('mismatches')} of {check.get('elements')} differ)"
    return _fmt(check.get("max_abs_err"), 2)


def _world_banner(rows: list[dict[str, Any]]) -> str:
    labels = sorted({str(r["world_mode"]) for r in rows if r.get("world_mode")})
    return f'<p class="world">{_esc(WORLD_MODE_TEXT)}</p>' + "".join(
        f'<p class="world">world_mode: {_esc(label)}</p>' for label in labels
    )


def _iqr_pct(row: dict[str, Any]) -> str:
    """The row's interquartile range as a percentage of its median time, or a dash."""
    rel = (row.get("time_s") or {}).get("iqr_rel")
    return _fmt(100 * rel, 2) + "%" if isinstance(rel, (int, float)) else "—"


def _slowdown_bar(row: dict[str, Any]) -> tuple[float, float, float] | None:
    """(slowdown, and at the concurrent q1 / q3 times) of an interference row; None without the numbers."""
    alone = (row.get("gemm_alone_s") or {}).get("median")
    slowdown = _num(row, "slowdown")
    if slowdown is None or not isinstance(alone, (int, float)) or alone <= 0:
        return None
    t = row.get("time_s") or {}
    lo, hi = t.get("q1"), t.get("q3")
    return (
        slowdown,
        lo / alone if isinstance(lo, (int, float)) else slowdown,
        hi / alone if isinstance(hi, (int, float)) else slowdown,
    )


def _latest(rows: list[dict[str, Any]], key: Any) -> tuple[dict[Any, dict[str, Any]], str]:
    """Rows keyed by ``key(row)``, the last one winning (a re-run of a case, or a second run appended to the
    same file), and a note saying how many rows that left out and of which runs ("" when none)."""
    out: dict[Any, dict[str, Any]] = {}
    for r in rows:
        out[key(r)] = r
    left = len(rows) - len(out)
    if not left:
        return out, ""
    shown = sorted({str(r.get("run_id")) for r in out.values()})
    note = (
        f"<p class='muted'>{left} earlier row(s) of the same cases in this file are not shown (a re-run or "
        f"another run appended to it); shown: the last row of each case, run(s) {_esc(', '.join(shown))}.</p>"
    )
    return out, note


def ptx_text(row: dict[str, Any]) -> str:
    """The row's compiled-code column: ``sm_90a · 128-bit ld/st 49/20 · scalar 12/6 · 94 regs · 0 B local``
    (static counts in the PTX of the kernel that ran), or why there is none."""
    ptx = row.get("ptx")
    if not isinstance(ptx, dict):
        note = str(row.get("ptx_note") or "")
        if note.startswith("copy engine"):
            return "no kernel (copy engine)"
        return "— (interpreter: nothing compiled)" if note.startswith("nothing compiled") else "—"
    return (
        f"{ptx.get('target') or '?'} · 128-bit ld/st {ptx.get('v128_loads')}/{ptx.get('v128_stores')} · "
        f"scalar {ptx.get('scalar_loads')}/{ptx.get('scalar_stores')} · {ptx.get('registers')} regs · "
        f"{ptx.get('local_bytes')} B local"
    )


def _simulated_section(group: list[dict[str, Any]]) -> str:
    first = group[0]
    by_case, left_note = _latest(group, lambda r: (r.get("size_bytes"), r.get("max_sms")))
    sizes = sorted({s for s, _ in by_case if isinstance(s, int)})
    sms = sorted({k for _, k in by_case if isinstance(k, int)})
    pivot = "".join(
        f"<tr><td class='l'>{_esc(_size_text(size))}</td>"
        + "".join(
            f"<td>{_fmt(_num(by_case[(size, k)], 'busbw_gbps')) if (size, k) in by_case else '—'}</td>"
            for k in sms
        )
        + "</tr>"
        for size in sizes
    )
    pivot_head = "<tr><th class='l'>size</th>" + "".join(f"<th>{budget_text(k)}</th>" for k in sms) + "</tr>"
    charts = []
    for size in sizes:
        groups, values = [], {}
        for k in sms:
            r = by_case.get((size, k))
            if r is None:
                continue
            group_label = budget_text(k)
            groups.append(group_label)
            size_b, peer_b = _num(r, "size_bytes"), _num(r, "peer_bytes")
            factor = _num(r, "busbw_factor") or 0.0
            for series, nbytes, value in (
                ("busbw", (size_b or 0.0) * factor, _num(r, "busbw_gbps")),
                ("peer", peer_b, _num(r, "peer_gbps")),
            ):
                if value is not None:
                    values[(group_label, series)] = (
                        value,
                        _at_time(r, nbytes, "q3"),
                        _at_time(r, nbytes, "q1"),
                    )
        svg = svg_bar_chart(groups, ["busbw", "peer"], values, unit="GB/s")
        charts.append(f"<figure>{svg}<figcaption>{_esc(first.get('op'))}, {_esc(_size_text(size))}"
                      "</figcaption></figure>")  # fmt: skip
    detail = []
    for (size, k), r in sorted(by_case.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1] or 0)):
        med = _median_s(r)
        detail.append(
            f"<tr><td class='l'>{_esc(_size_text(size))}</td><td>{_esc(k)}</td>"
            f"<td>{_fmt(med * 1e6 if med else None)}</td>"
            f"<td>{_iqr_pct(r)}</td>"
            f"<td>{_fmt(_num(r, 'algbw_gbps'))}</td><td>{_fmt(_num(r, 'busbw_gbps'))}</td>"
            f"<td>{_esc(r.get('peer_bytes'))}</td><td>{_fmt(_num(r, 'peer_gbps'))}</td>"
            f"<td>{_esc(r.get('rounds'))}{' (capped)' if r.get('rounds_capped') else ''}</td>"
            f"<td class='l'>{_esc(_check_text(r.get('check')))}</td>"
            f"<td class='l muted'>{_esc(r.get('kernel_path'))}</td>"
            f"<td class='l muted'>{_esc(ptx_text(r))}</td></tr>"
        )
    detail_head = (
        "<tr><th class='l'>size</th><th>max_sms</th><th>median µs</th><th>IQR % of median</th>"
        "<th>algbw GB/s</th><th>busbw GB/s</th><th>peer bytes</th><th>peer GB/s</th><th>rounds</th>"
        "<th class='l'>check</th><th class='l'>path</th><th class='l'>compiled code</th></tr>"
    )
    return (
        f"<section><h2>{_esc(first.get('op'))} — W={_esc(first.get('world'))} — {_esc(first.get('dtype'))} "
        f"{'— copy_path=tma ' if first.get('copy_path') == 'tma' else ''}"
        f'<span class="muted">(comm_simulated)</span></h2>'
        f'<p class="world">world_mode: {_esc(first.get("world_mode"))}</p>'
        f"<p>busbw GB/s (nccl-tests definition) against the SM budget:</p>"
        f"<table>{pivot_head}{pivot}</table><div class='charts'>{''.join(charts)}</div>"
        f"<table>{detail_head}{''.join(detail)}</table>{left_note}</section>"
    )


def _interference_section(group: list[dict[str, Any]]) -> str:
    first = group[0]
    by_case, left_note = _latest(group, lambda r: (str(r.get("op")), r.get("max_sms")))
    ops = sorted({op for op, _ in by_case})
    sms = sorted({k for _, k in by_case if isinstance(k, int)})
    values, body = {}, []
    for (op, k), r in sorted(by_case.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        alone = (r.get("gemm_alone_s") or {}).get("median")
        slowdown, bound, met = _num(r, "slowdown"), _num(r, "slowdown_bound"), r.get("bound_met")
        if (bar := _slowdown_bar(r)) is not None:
            values[(budget_text(k), op)] = bar
        overlap = _num(r, "collective_overlap_peer_gbps")
        body.append(
            f"<tr><td class='l'>{_esc(op)}</td><td>{_esc(k)}</td>"
            f"<td>{_fmt(alone * 1e3 if isinstance(alone, (int, float)) else None)}</td>"
            f"<td>{_fmt(_median_s(r) * 1e3 if _median_s(r) else None)}</td>"
            f"<td>{_fmt(slowdown, 4) + '×' if slowdown is not None else '—'}</td>"
            f"<td>{_fmt(bound, 4) + '×' if bound is not None else '—'}</td>"
            f"<td>{ {True: 'yes', False: 'NO'}.get(met, '—') }</td>"
            f"<td>{_fmt(_num(r, 'collective_alone_peer_gbps'))}</td>"
            f"<td>{_fmt(overlap)}</td>"
            f"<td>{_esc(r.get('collective_calls_per_round', '—'))}</td>"
            f"<td class='l muted'>{_esc(r.get('concurrency'))}</td></tr>"
        )
    head = (
        "<tr><th class='l'>collective</th><th>max_sms</th><th>GEMM alone ms</th><th>GEMM concurrent ms</th>"
        "<th>slowdown</th><th>target bound 1 + 1.2·k/SMs</th><th>bound met</th>"
        "<th>collective alone peer GB/s</th><th>collective peer GB/s during GEMM</th>"
        "<th>calls per round</th><th class='l'>concurrency</th></tr>"
    )
    groups = [budget_text(k) for k in sms]
    chart = svg_bar_chart(groups, ops, values, unit="GEMM slowdown (×)")
    why: dict[str, list[str]] = {}  # note -> the cases it explains
    for (op, k), r in sorted(by_case.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        if r.get("overlap_gbps_note"):
            why.setdefault(str(r["overlap_gbps_note"]), []).append(f"{op} at {budget_text(k)}")
    notes_html = "".join(
        f"<p class='muted'>No collective GB/s during the GEMM for {_esc(', '.join(cases))}: {_esc(note)}</p>"
        for note, cases in why.items()
    )
    return (
        f"<section><h2>GEMM {_esc(_shape_label(first.get('shape')))} beside a collective of "
        f"{_esc(_size_text(first.get('size_bytes')))} — W={_esc(first.get('world'))} — "
        f'{_esc(first.get("dtype"))} <span class="muted">(comm_interference)</span></h2>'
        f'<p class="world">world_mode: {_esc(first.get("world_mode"))}</p>'
        f"{chart}<table>{head}{''.join(body)}</table>{notes_html}{left_note}</section>"
    )


# ----------------------------------------------------------------------------- torchrun rows
def line_of(row: dict[str, Any]) -> tuple[tuple, str, str, bool]:
    """(sort key, label, colour, dashed) of the chart line a torchrun row belongs to.

    smptk rows: one line per SM budget (``max_sms``; 0 = copy engine). torch.distributed rows: the
    backend's default communicator ("NCCL", or "gloo" on a CPU), then one dashed line per capped
    communicator (``nccl_config``, e.g. "NCCL max_ctas=8" in the 8-SM line's colour).

    Example::

        >>> line_of({"impl": "smptk", "max_sms": 8})[1:]
        ('8 SMs', '#b2182b', False)
        >>> line_of({"impl": "torch.distributed:nccl", "nccl_config": "max_ctas=8", "nccl_max_ctas": 8})[1:]
        ('NCCL max_ctas=8', '#b2182b', True)
    """
    impl = str(row.get("impl"))
    if impl == "smptk":
        k = row.get("max_sms")
        if not isinstance(k, int):
            return ((0, -1), "smptk", "#444", False)
        return ((0, k), budget_text(k), _budget_color(k), False)
    backend = impl.split(":", 1)[-1]
    name = "NCCL" if backend == "nccl" else backend
    config, cap = row.get("nccl_config"), row.get("nccl_max_ctas")
    if config in (None, "default"):
        return ((1, 0), name, BASELINE_COLOR, False)
    if isinstance(cap, int) and str(config).startswith("max_ctas="):
        return ((2, cap), f"{name} {config}", _budget_color(cap), True)
    return (
        (3, str(config)),
        f"{name} {config}",
        _budget_color(cap) if isinstance(cap, int) else "#777",
        True,
    )


def _nice_log_range(lo: float, hi: float) -> tuple[int, int]:
    """Decades ``(e0, e1)`` with ``10**e0 <= lo`` and ``hi <= 10**e1``."""
    e0 = math.floor(math.log10(lo))
    e1 = max(e0 + 1, math.ceil(math.log10(hi)))
    return e0, e1


def _decade_text(e: int) -> str:
    """``10**e`` as a tick label: ``0.001``, ``1``, ``1,000``; ``1e-5`` / ``1e+06`` beyond."""
    if 0 <= e <= 4:
        return f"{10**e:,}"
    if -3 <= e < 0:
        return f"{10.0**e:.{-e}f}"
    return f"1e{e:+03d}"


def svg_line_chart(
    xs: Sequence[int],
    lines: Sequence[tuple[str, str, bool, dict[int, tuple[float, float, float]]]],
    *,
    unit: str,
    x_text: Any = _size_text,
    x_title: str = "message size",
) -> str:
    """Line chart as an inline ``<svg>``: one line per ``(label, colour, dashed, {x: (value, low, high)})``.

    ``xs`` are placed evenly in their order (sizes in x4 steps: a log axis). The y axis starts at 0 and
    ends at a round number above the largest value, or is logarithmic (whole decades) when the positive
    values span more than 100x, so a line 100 times lower than another stays readable; its title says
    "log scale" then. Every point is a circle with a ``<title>`` holding its numbers, with a whisker from
    low to high; a line with one point shows as its circle. The legend lists the lines on the right.

    Example::

        >>> svg = svg_line_chart([4096], [("1 SM", "#f4a582", False, {4096: (1.0, 0.9, 1.1)})], unit="GB/s")
        >>> svg.startswith("<svg")
        True
    """
    from bench.report import _nice_ceiling

    values = [v for *_, pts in lines for trio in pts.values() for v in trio if v is not None]
    positive = [v for v in values if v > 0]
    log = bool(positive) and max(positive) / min(positive) > 100
    if log:
        e0, e1 = _nice_log_range(min(positive), max(positive))
        ticks = [10.0**e for e in range(e0, e1 + 1)]
    else:
        axis_max, step = _nice_ceiling(max([*values, 0.0]))
        ticks = [i * step for i in range(round(axis_max / step) + 1)]
    tick_labels = [_decade_text(round(math.log10(t))) for t in ticks] if log else [_fmt(t, 3) for t in ticks]
    top, plot_h, bottom = 16, 220, 52
    left = 40 + 7 * max(len(t) for t in tick_labels)
    plot_w = max(260, 64 * len(xs))
    legend_x = left + plot_w + 24
    legend_w = 40 + 7 * max([len(label) for label, *_ in lines] + [4])
    width = legend_x + legend_w
    height = max(top + plot_h + bottom, 24 + 18 * len(lines))

    def y(v: float) -> float:
        if log:
            v = max(v, ticks[0])
            frac = (math.log10(v) - math.log10(ticks[0])) / (math.log10(ticks[-1]) - math.log10(ticks[0]))
        else:
            frac = v / ticks[-1] if ticks[-1] else 0.0
        return top + plot_h - frac * plot_h

    def x(value: int) -> float:
        i = list(xs).index(value)
        return left + plot_w / 2 if len(xs) == 1 else left + 16 + i * (plot_w - 32) / (len(xs) - 1)

    y_title = f"{unit} (log scale)" if log else unit
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{_esc(y_title)} against {_esc(x_title)}">'
    ]
    for t, label in zip(ticks, tick_labels, strict=True):
        out.append(
            f'<line x1="{left}" y1="{y(t):.1f}" x2="{left + plot_w}" y2="{y(t):.1f}" stroke="#e3e3e3"/>'
            f'<text x="{left - 6}" y="{y(t) + 4:.1f}" font-size="11" text-anchor="end">{label}</text>'
        )
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#555"/>')
    out.append(
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#555"/>'
    )
    out.append(
        f'<text x="14" y="{top + plot_h / 2:.0f}" font-size="12" text-anchor="middle" '
        f'transform="rotate(-90 14 {top + plot_h / 2:.0f})">{_esc(y_title)}</text>'
    )
    for value in xs:
        out.append(
            f'<text x="{x(value):.1f}" y="{top + plot_h + 16}" font-size="11" text-anchor="middle">'
            f"{_esc(x_text(value))}</text>"
        )
    out.append(
        f'<text x="{left + plot_w / 2:.0f}" y="{top + plot_h + 38}" font-size="12" text-anchor="middle">'
        f"{_esc(x_title)}</text>"
    )
    for li, (label, color, dashed, pts) in enumerate(lines):
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        drawn = [(v, pts[v]) for v in xs if v in pts and pts[v][0] is not None and (pts[v][0] > 0 or not log)]
        if len(drawn) > 1:
            coords = " ".join(f"{x(v):.1f},{y(p[0]):.1f}" for v, p in drawn)
            out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        for v, (val, lo, hi) in drawn:
            cx = x(v)
            if lo is not None and hi is not None:
                out.append(
                    f'<line x1="{cx:.1f}" y1="{y(hi):.1f}" x2="{cx:.1f}" y2="{y(lo):.1f}" stroke="{color}"/>'
                )
            spread = f" (IQR {_fmt(lo)}–{_fmt(hi)})" if lo is not None and hi is not None else ""
            out.append(
                f'<circle cx="{cx:.1f}" cy="{y(val):.1f}" r="3.5" fill="{color}"><title>{_esc(label)}, '
                f"{_esc(x_text(v))}: {_fmt(val)} {_esc(unit)}{spread}</title></circle>"
            )
        ly = 24 + 18 * li
        out.append(
            f'<line x1="{legend_x}" y1="{ly - 4}" x2="{legend_x + 26}" y2="{ly - 4}" stroke="{color}" '
            f'stroke-width="2"{dash}/><circle cx="{legend_x + 13}" cy="{ly - 4}" r="3" fill="{color}"/>'
            f'<text x="{legend_x + 32}" y="{ly}" font-size="12">{_esc(label)}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def _op_key(op: str) -> tuple[int, str]:
    order = [*COLLECTIVES[:2], "all_reduce", *COLLECTIVES[2:]]  # torch.distributed's all_reduce after ours
    return (order.index(op), op) if op in order else (len(order), op)


def _busbw_points(row: dict[str, Any]) -> tuple[float | None, float, float]:
    """busbw of the row and at its q3 / q1 times (the whisker's low and high)."""
    nbytes = (_num(row, "size_bytes") or 0.0) * (_num(row, "busbw_factor") or 0.0)
    return _num(row, "busbw_gbps"), _at_time(row, nbytes, "q3"), _at_time(row, nbytes, "q1")


def ctas_text(row: dict[str, Any]) -> str:
    """The CTAs a row's collective occupied: ours by construction, NCCL's as the profiler saw them.

    Example::

        >>> ctas_text({"impl": "smptk", "max_sms": 0, "ctas": 0, "signal_ctas": 1})
        '0 (+ 1-CTA signal kernel)'
        >>> seen = {"max": 16, "distinct": [8, 16]}
        >>> ctas_text({"impl": "torch.distributed:nccl", "nccl_ctas_observed": seen})
        '16 (profiler: 8, 16)'
    """
    if row.get("impl") == "smptk":
        ctas = row.get("ctas", row.get("max_sms"))
        signal = row.get("signal_ctas")
        return f"{ctas}" + (f" (+ {signal}-CTA signal kernel)" if signal else "")
    seen = row.get("nccl_ctas_observed")
    if isinstance(seen, dict) and seen.get("max") is not None:
        return f"{seen['max']} (profiler: {', '.join(str(c) for c in seen.get('distinct') or [])})"
    return "not available" if row.get("nccl_ctas_note") else "—"


def _path_text(row: dict[str, Any]) -> str:
    if row.get("impl") == "smptk":
        return str(row.get("comm_path") or "—")
    config = row.get("nccl_config")
    return f"{row.get('impl')}" + (f" ({config})" if config else "")


def _dist_check_text(row: dict[str, Any]) -> str:
    check = row.get("check")
    if not isinstance(check, dict):
        return "reference" if row.get("impl") != "smptk" else "—"
    if "exact_equal" in check:
        return f"equal to {check.get('reference')}" if check["exact_equal"] else "DIFFERS"
    if "passed" in check:
        return "passed" if check["passed"] else "FAILED"
    return "—"


def _notes_under(rows: list[dict[str, Any]], key: str, lead: str) -> str:
    notes = sorted({str(r[key]) for r in rows if r.get(key)})
    return "".join(f"<p class='muted'>{_esc(lead)}: {_esc(n)}</p>" for n in notes)


def _device_banner(rows: list[dict[str, Any]]) -> str:
    return f'<p class="note">{_esc(CPU_TEXT)}</p>' if any(r.get("device") == "cpu" for r in rows) else ""


def _dist_bandwidth_section(op: str, world: Any, dtype: str, group: list[dict[str, Any]]) -> str:
    lines: dict[tuple, tuple[str, str, bool]] = {}
    by_case: dict[tuple, dict[str, Any]] = {}
    for r in group:
        key, label, color, dashed = line_of(r)
        lines[key] = (label, color, dashed)
        by_case[(r.get("size_bytes"), key)] = r  # the last row of a re-run case wins
    keys = sorted(lines)
    sizes = sorted({s for s, _ in by_case if isinstance(s, int)})
    chart_lines = []
    for key in keys:
        label, color, dashed = lines[key]
        pts = {s: _busbw_points(by_case[(s, key)]) for s in sizes if (s, key) in by_case}
        chart_lines.append((label, color, dashed, pts))
    cpu = any(r.get("device") == "cpu" for r in group)
    caption = f"{op}: busbw against message size, W={world}, {dtype}" + (
        " (CPU quick mode: functional numbers, not GPU results)" if cpu else ""
    )
    chart = svg_line_chart(sizes, chart_lines, unit="busbw GB/s")
    pivot_head = (
        "<tr><th class='l'>size</th>" + "".join(f"<th>{_esc(lines[k][0])}</th>" for k in keys) + "</tr>"
    )
    pivot = "".join(
        f"<tr><td class='l'>{_esc(_size_text(s))}</td>"
        + "".join(
            f"<td>{_fmt(_num(by_case[(s, k)], 'busbw_gbps')) if (s, k) in by_case else '—'}</td>"
            for k in keys
        )
        + "</tr>"
        for s in sizes
    )
    detail = []
    for (size, key), r in sorted(by_case.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1])):
        med = _median_s(r)
        iters = r.get("iters_per_round")
        detail.append(
            f"<tr><td class='l'>{_esc(_size_text(size))}</td><td class='l'>{_esc(lines[key][0])}</td>"
            f"<td>{_esc(r.get('max_sms') if r.get('max_sms') is not None else '—')}</td>"
            f"<td class='l'>{_esc(_path_text(r))}</td><td class='l'>{_esc(ctas_text(r))}</td>"
            f"<td>{_fmt(_num(r, 'busbw_gbps'))}</td><td>{_fmt(_num(r, 'algbw_gbps'))}</td>"
            f"<td>{_fmt(med * 1e6 if med else None)}</td>"
            f"<td>{_iqr_pct(r)}</td>"
            f"<td>{_esc(r.get('rounds'))}{f' × {iters}' if iters else ''}</td>"
            f"<td class='l'>{_esc(_dist_check_text(r))}</td>"
            f"<td class='l muted'>{_esc(ptx_text(r) if r.get('impl') == 'smptk' else '')}</td></tr>"
        )
    detail_head = (
        "<tr><th class='l'>size</th><th class='l'>line</th><th>max_sms</th><th class='l'>path</th>"
        "<th class='l'>CTAs</th><th>busbw GB/s</th><th>algbw GB/s</th><th>median µs</th>"
        "<th>IQR % of median</th><th>rounds × calls</th><th class='l'>check</th>"
        "<th class='l'>compiled code (smptk)</th></tr>"
    )
    return (
        f"<section><h3>{_esc(op)} — W={_esc(world)} — {_esc(dtype)} "
        f'<span class="muted">(comm_dist_bandwidth, comm_dist_nccl)</span></h3>'
        f"<figure>{chart}<figcaption>{_esc(caption)}</figcaption></figure>"
        f"<p>busbw GB/s (nccl-tests definition) by message size and line:</p>"
        f"<table>{pivot_head}{pivot}</table><table>{detail_head}{''.join(detail)}</table>"
        f"{_notes_under(group, 'nccl_ctas_note', 'NCCL CTAs')}</section>"
    )


def _dist_bandwidth_html(rows: list[dict[str, Any]]) -> list[str]:
    """One section per smptk op (all_reduce_one_shot, ...), with the baseline rows of its collective."""
    ours = [r for r in rows if r.get("suite") == "comm_dist_bandwidth"]
    base = [r for r in rows if r.get("suite") == "comm_dist_nccl"]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in ours:
        groups.setdefault((str(r.get("op")), r.get("world"), str(r.get("dtype"))), []).append(r)
    covered = {(str(r.get("collective")), w, d) for (_, w, d), g in groups.items() for r in g}
    for r in base:  # a collective with no smptk row still gets its baseline's section
        key = (str(r.get("collective")), r.get("world"), str(r.get("dtype")))
        if key not in covered:
            groups.setdefault(key, [])
    sections = []
    for (op, world, dtype), group in sorted(
        groups.items(), key=lambda kv: (_op_key(kv[0][0]), str(kv[0][1:]))
    ):
        collective = group[0].get("collective") if group else op
        same = [
            r
            for r in base
            if (r.get("collective"), r.get("world"), str(r.get("dtype"))) == (collective, world, dtype)
        ]
        sections.append(_dist_bandwidth_section(op, world, dtype, group + same))
    return sections


def _dist_interference_html(rows: list[dict[str, Any]]) -> str:
    alone = [r for r in rows if r.get("op") == "gemm_alone"]
    conc = [r for r in rows if r.get("op") == "gemm_concurrent"]
    if not conc and not alone:
        return ""
    first = (conc or alone)[0]
    gemm = first.get("gemm") or {}
    by_case = {}
    for r in conc:
        by_case[(str(r.get("collective")), line_of(r)[0])] = r
    labels: dict[tuple, tuple[str, str, bool]] = {line_of(r)[0]: line_of(r)[1:] for r in conc}
    colls = sorted({c for c, _ in by_case}, key=_op_key)
    values, body = {}, []
    for (coll, key), r in sorted(by_case.items(), key=lambda kv: (_op_key(kv[0][0]), kv[0][1])):
        alone_s = (r.get("gemm_alone_s") or {}).get("median")
        slowdown, bound, met = _num(r, "slowdown"), _num(r, "slowdown_bound"), r.get("bound_met")
        label = labels[key][0]
        if (bar := _slowdown_bar(r)) is not None:
            values[(coll, label)] = bar
        coll_t = (r.get("collective_alone_s") or {}).get("median")
        body.append(
            f"<tr><td class='l'>{_esc(coll)}</td><td class='l'>{_esc(label)}</td>"
            f"<td>{_esc(r.get('max_sms') if r.get('max_sms') is not None else '—')}</td>"
            f"<td class='l'>{_esc(r.get('algorithm') or '—')}</td><td class='l'>{_esc(ctas_text(r))}</td>"
            f"<td>{_fmt(coll_t * 1e6 if isinstance(coll_t, (int, float)) else None)}</td>"
            f"<td>{_esc(r.get('collective_calls'))}</td>"
            f"<td>{_fmt(alone_s * 1e3 if isinstance(alone_s, (int, float)) else None)}</td>"
            f"<td>{_fmt(_median_s(r) * 1e3 if _median_s(r) else None)}</td>"
            f"<td>{_fmt(slowdown, 4) + '×' if slowdown is not None else '—'}</td>"
            f"<td>{_fmt(bound, 4) + '×' if bound is not None else '—'}</td>"
            f"<td>{ {True: 'yes', False: 'NO'}.get(met, '—') }</td>"
            f"<td>{ {True: 'yes', False: 'NO'}.get(r.get('covered'), '—') }</td></tr>"
        )
    head = (
        "<tr><th class='l'>collective</th><th class='l'>line</th><th>max_sms</th><th class='l'>algorithm</th>"
        "<th class='l'>CTAs</th><th>collective alone µs</th><th>calls per round</th><th>GEMM alone ms</th>"
        "<th>GEMM with collective ms</th><th>slowdown</th><th>bound (1 + 1.2·k/SMs; 1.03 at 0)</th>"
        "<th>bound met</th><th>covered</th></tr>"
    )
    series = [labels[k][0] for k in sorted(labels)]
    colors = {labels[k][0]: labels[k][1] for k in labels}
    chart = svg_bar_chart(colls, series, values, unit="GEMM slowdown (×)", colors=colors) if values else ""
    if chart and any(r.get("device") == "cpu" for r in conc):
        caption = "CPU quick mode: the collectives run before the GEMMs (no streams); functional numbers"
        chart = f"<figure>{chart}<figcaption>{_esc(caption)}</figcaption></figure>"
    size = _size_text(first.get("size_bytes")) if conc else "—"
    per_round = gemm.get("calls_per_round")
    notes = _notes_under(conc, "concurrency", "concurrency") + _notes_under(
        conc, "nccl_ctas_note", "NCCL CTAs"
    )
    return (
        f"<section><h3>GEMM {_esc(gemm.get('M'))}³ ({_esc(gemm.get('dtype'))}, {_esc(per_round)} per round) "
        f"beside a {_esc(size)} collective — W={_esc(first.get('world'))} "
        f'<span class="muted">(comm_dist_interference)</span></h3>{chart}'
        f"<table>{head}{''.join(body)}</table>{notes}</section>"
    )


def _dist_ddp_html(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    model = rows[0].get("model") or {}
    body = []
    for r in sorted(rows, key=lambda r: (r.get("world") or 0, str(r.get("impl")))):
        med = _median_s(r)
        body.append(
            f"<tr><td>{_esc(r.get('world'))}</td><td class='l'>{_esc(r.get('impl'))}</td>"
            f"<td class='l'>{_esc(r.get('hook'))}</td><td>{_fmt(med * 1e3 if med else None)}</td>"
            f"<td>{_iqr_pct(r)}</td>"
            f"<td>{_fmt(_num(r, 'samples_per_s'))}</td><td>{_fmt(_num(r, 'scaling_efficiency'), 3)}</td>"
            f"<td class='l'>{_esc(r.get('comm_path') or '—')}</td>"
            f"<td class='l'>{_esc(_dist_check_text(r))}</td></tr>"
        )
    head = (
        "<tr><th>world</th><th class='l'>impl</th><th class='l'>hook</th><th>step ms (median)</th>"
        "<th>IQR % of median</th><th>samples/s</th><th>scaling efficiency</th><th class='l'>smptk path</th>"
        "<th class='l'>parameters vs default hook</th></tr>"
    )
    return (
        f"<section><h3>DDP step: {_esc(model.get('layers'))} × Linear({_esc(model.get('hidden'))}), batch "
        f"{_esc(model.get('batch_per_rank'))} per rank, {_esc(rows[0].get('dtype'))} "
        f'<span class="muted">(comm_dist_ddp)</span></h3><table>{head}{"".join(body)}</table></section>'
    )


def _dist_html(rows: list[dict[str, Any]]) -> str:
    worlds = sorted({str(r["world_mode"]) for r in rows if r.get("world_mode")})
    parts = [
        "<h2>Collectives under torchrun (real processes)</h2>",
        f'<p class="real">{_esc(REAL_WORLD_TEXT)}</p>',
        *(f'<p class="real">world_mode: {_esc(w)}</p>' for w in worlds),
        _device_banner(rows),
    ]
    parts.extend(_dist_bandwidth_html(rows))
    parts.append(_dist_interference_html([r for r in rows if r.get("suite") == "comm_dist_interference"]))
    parts.append(_dist_ddp_html([r for r in rows if r.get("suite") == "comm_dist_ddp"]))
    return "".join(parts)


def comm_html(rows: list[dict[str, Any]]) -> str:
    """The collectives' part of the page: the simulated world's sections, then the torchrun ones."""
    simulated_rows = [r for r in rows if r.get("suite") in SIMULATED_SUITES]
    dist_rows = [r for r in rows if r.get("suite") in DIST_SUITES]
    parts = []
    if simulated_rows:
        parts += ["<h2>Collectives (simulated world)</h2>", _world_banner(simulated_rows)]
        simulated: dict[tuple, list[dict[str, Any]]] = {}
        interference: dict[tuple, list[dict[str, Any]]] = {}
        for r in simulated_rows:
            if r.get("suite") == "comm_simulated":
                key = (
                    str(r.get("op")),
                    r.get("world"),
                    str(r.get("dtype")),
                    str(r.get("copy_path") or "pointer"),
                )
                simulated.setdefault(key, []).append(r)
            else:
                key = (r.get("world"), r.get("size_bytes"), _shape_label(r.get("shape")), str(r.get("dtype")))
                interference.setdefault(key, []).append(r)
        parts.extend(_simulated_section(g) for g in simulated.values())
        parts.extend(_interference_section(g) for g in interference.values())
    if dist_rows:
        parts.append(_dist_html(dist_rows))
    return "".join(parts)


SIMULATED_FOOTER = (
    "Collectives (simulated world): every number in that part comes from a single-GPU simulated world "
    "(one rank's kernel, W buffers in one GPU's memory, no peer, no barrier waits, all traffic local HBM); "
    "they are not multi-GPU measurements. peer GB/s = bytes one rank reads from its peers' buffers / "
    "median time."
)
DIST_FOOTER = (
    "Collectives under torchrun: every number in that part comes from N real processes (each row's "
    "world_mode says how many and on what), not from the simulated world. A round is the mean time of "
    "back-to-back calls, taken as the maximum over the ranks; the median is over rounds. smptk's CTAs "
    "are its max_sms by construction (the copy engine moves data with 0 SMs, beside a one-CTA signal "
    "kernel); NCCL's are the grid of its kernels in a torch.profiler trace."
)
DEFINITIONS_FOOTER = (
    "size is nccl-tests' size (all-reduce buffer, all-gather output, reduce-scatter input, all-to-all "
    "send buffer); algbw = size / median time; busbw = algbw × 2(W-1)/W for all-reduce and × (W-1)/W "
    "otherwise. Chart whiskers are the same quantities at the first and third quartile times. "
    "Interference: slowdown = median GEMM time beside the collective / median GEMM time alone, both "
    "measured in the same run."
)


def comm_footers(rows: list[dict[str, Any]]) -> list[str]:
    """The footer paragraphs that apply to ``rows``: one per kind of collective row present."""
    suites = {r.get("suite") for r in rows}
    out = []
    if suites & set(SIMULATED_SUITES):
        out.append(SIMULATED_FOOTER)
    if suites & set(DIST_SUITES):
        out.append(DIST_FOOTER)
    if suites & set(COMM_SUITES):
        out.append(DEFINITIONS_FOOTER)
    return out
