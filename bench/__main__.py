"""``python -m bench`` (``make bench``): run the benchmark suites, write JSON lines and an HTML report.

On a GPU (measure mode) results go to ``bench/results/<gpu-slug>/<YYYY-MM-DD>-<shortsha>.jsonl`` and the
report beside it (same stem, ``.html``). On a CPU the same suites run in quick mode (Triton interpreter,
tiny shapes, fp16, few rounds) into ``bench/results/cpu-interpreter/``, and every row and the report say
"cpu-interpreter: not a performance measurement". ``--quick`` on a GPU writes ``<gpu-slug>-quick/``.
A second run with the same date and sha gets ``-2``, ``-3``... rather than overwriting a record.

Options: ``--quick``, ``--filter EXPR`` (pytest ``-k``), ``--out DIR`` (instead of bench/results),
``--rounds N`` / ``--warmup N``; anything else is passed to pytest (e.g. ``--benchmark-json=out.json``).

Example::

    $ python -m bench --filter "swiglu and fwd_bwd" --out /tmp/bench
    bench: quick mode on cpu -> /tmp/bench/cpu-interpreter/2026-11-22-e60bd426.jsonl
    ...
    bench: 2 benchmarks: 2 passed, 0 failed, 0 skipped in 12.0 s
    bench: rows: 2 measurement rows, 0 skipped, 0 failed (as in the report's header)
    bench: results /tmp/bench/cpu-interpreter/2026-11-22-e60bd426.jsonl
    bench: report  /tmp/bench/cpu-interpreter/2026-11-22-e60bd426.html

The first count is of benchmarks (pytest tests), the second of result rows: a benchmark writes one row
per case it runs, and each torchrun benchmark (bench/test_bench_comm_dist.py) writes many, so the two
differ; the report's header shows the row count.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "bench"
DEFAULT_OUT = BENCH_DIR / "results"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run smptk's benchmarks and write JSON-lines results plus a self-contained HTML report. "
        "Unrecognized options are passed to pytest.",
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes and few rounds, even on a GPU")
    p.add_argument("--filter", metavar="EXPR", default=None, help="pytest -k expression selecting benchmarks")
    p.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=None,
        help="results root (default: bench/results in this checkout)",
    )
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per benchmark")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up rounds per benchmark")
    return p


def results_path(out_root: Path, label: str, sha: str, today: _dt.date | None = None) -> Path:
    """``<out_root>/<label>/<YYYY-MM-DD>-<sha>.jsonl``, with ``-2``, ``-3``... when that file exists.

    Example::

        >>> results_path(Path("bench/results"), "cpu-interpreter", "e60bd426", _dt.date(2026, 11, 22))
        PosixPath('bench/results/cpu-interpreter/2026-11-22-e60bd426.jsonl')
    """
    stem = f"{(today or _dt.date.today()).isoformat()}-{sha}"
    directory = out_root / label
    path = directory / f"{stem}.jsonl"
    n = 2
    while path.exists() or path.with_suffix(".html").exists():
        path = directory / f"{stem}-{n}.jsonl"
        n += 1
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suites; returns pytest's exit status (0 all passed, 1 some failed, 5 nothing selected)."""
    args, pytest_args = _parser().parse_known_args(argv)
    from bench import config, rows

    if args.quick:
        os.environ[config.MODE_ENV] = "quick"
    if args.rounds is not None and args.rounds < 1:
        print(f"bench: --rounds {args.rounds}: expected an integer >= 1", file=sys.stderr)
        return 2
    if args.warmup is not None and args.warmup < 0:
        print(f"bench: --warmup {args.warmup}: expected an integer >= 0", file=sys.stderr)
        return 2
    out = args.out or DEFAULT_OUT
    if out.exists() and not out.is_dir():
        print(f"bench: --out {out}: exists and is not a directory", file=sys.stderr)
        return 2
    for value, name in ((args.rounds, config.ROUNDS_ENV), (args.warmup, config.WARMUP_ENV)):
        if value is not None:
            os.environ[name] = str(value)
    try:
        mode = config.prepare_process()  # before anything imports smptk.kernels
    except (RuntimeError, ValueError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2

    import pytest

    from bench.progress import ProgressPlugin
    from bench.report import counts_text, row_counts, write_report
    from bench.rows import read_rows
    from smptk._env import short_sha

    env = config.session_env()
    out_root = (args.out or DEFAULT_OUT).resolve()
    jsonl = results_path(out_root, mode.label, short_sha(env))
    os.environ[config.JSONL_ENV] = str(jsonl)
    os.environ[rows.RUN_ID_ENV] = rows.new_run_id()

    # A copy of stderr taken before pytest's fd capture starts: the progress display writes here.
    term = os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1, encoding="utf-8", errors="replace")
    print(f"bench: {mode.name} mode on {mode.device} ({mode.dtype}) -> {jsonl}", file=term)
    if mode.note:
        print(f"bench: {mode.note}", file=term)

    # Benchmarks never run under pytest-xdist (pytest-benchmark turns itself off there): without the plugin,
    # a bench started from an xdist test worker (the suite's end-to-end tests) measures as it does alone.
    pytest_argv = [str(BENCH_DIR), f"--rootdir={ROOT}", "-p", "no:cacheprovider", "-p", "no:xdist"]
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        os.environ.pop(name, None)  # what pytest-benchmark reads as "under xdist"
    if args.filter:
        pytest_argv += ["-k", args.filter]
    pytest_argv += pytest_args
    progress = ProgressPlugin(stream=term)
    status = int(pytest.main(pytest_argv, plugins=[progress]))

    if jsonl.exists():
        html_path = write_report(jsonl)
        rows_written = list(read_rows(jsonl))
        print(f"bench: rows: {counts_text(row_counts(rows_written))} (as in the report's header)", file=term)
        print(f"bench: results {jsonl}", file=term)
        print(f"bench: report  {html_path}", file=term)
    else:
        print("bench: no rows were written (nothing selected?); no report", file=term)
    term.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
