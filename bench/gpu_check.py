"""``make gpu-check`` (``python -m bench.gpu_check``): the one command a GPU machine runs.

Within one time budget (``--minutes``, default 25), everything included, it runs three phases and prints
the time each took:

1. **tests**: ``pytest tests -m gpu`` in a child process, with ``SMPTK_AUTOTUNE=0`` (kernels take their
   default config rather than autotuning every odd test shape), in at most 30% of the budget. Every test
   runs (no ``-x``); when the share is spent no further test starts, pytest-timeout (when installed) ends
   the one running (``signal`` method, at most 300 s per test), and a child still alive after a grace
   period is killed with its processes. It reports counts by outcome, the failures, and the tests that
   did not finish.
2. **benchmarks**: ``python -m bench`` in a child process: every suite, in measure mode on a GPU (quick
   mode on a CPU or with ``--quick``), the cases that :data:`bench.targets.TARGETS` need first
   (:func:`bench.targets.priority`; the rest keep their usual order), until the budget less a reserve
   for phase 3 is spent. Rows and the HTML report land where ``python -m bench`` writes them
   (``bench/results/<gpu-slug>/<YYYY-MM-DD>-<sha>.jsonl``); the rows written stay, and the cases not
   reached are listed by suite.
3. **targets**: the targets judged on this run's rows (:func:`bench.targets.evaluate`), printed as a table
   (rich when importable, plain text otherwise), written as ``<stem>.targets.json`` beside the rows
   (with the phase times and the test and benchmark summaries) and put at the top of the HTML report.

Both children load this module as a pytest plugin (``-p bench.gpu_check``, configured by the JSON in
``SMPTK_GPU_CHECK``): it logs collected, started and finished tests to a file the parent reads (so a
killed child still tells what ran), stops the session at its deadline, gives pytest-timeout the time
left, and in the benchmark child puts the targets' cases first.

On a CPU the tests skip (no CUDA) and the benchmarks run in quick mode under the Triton interpreter:
the first and last lines say "cpu: nothing was measured" and every target is "not measured".

It installs nothing (``make gpu-check`` bootstraps ``.venv`` as ``make test`` does, which installs only
what is missing). Exit status: 0 when nothing that ran failed (whether targets were met or not, and
whether every case was reached or not); 1 when a test or benchmark failed or a child had to be killed;
2 for bad arguments.

The plugin and the command that reads its log live in one module (``-p bench.gpu_check`` loads this
file in the children), which is why it runs a little past 600 lines.

Options: ``--minutes N``, ``--quick`` (benchmarks in quick mode on a GPU too), ``--skip-tests``,
``--filter EXPR`` (pytest ``-k`` for the benchmarks), ``--out DIR`` (results root, as ``python -m bench``),
``--since EPOCH`` (the budget's start; ``make gpu-check`` passes its own, so the bootstrap counts).

Example::

    $ make gpu-check GPU_CHECK_MINUTES=25
    gpu-check: NVIDIA H100 80GB HBM3 (1 GPU), measure mode, budget 25.0 min
    ...
    gpu-check: targets -> bench/results/nvidia-h100-80gb-hbm3/2026-11-23-ab12cd34.targets.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from bench import targets as _targets
from smptk import settings

ROOT = Path(__file__).resolve().parent.parent
PLUGIN_ENV = "SMPTK_GPU_CHECK"
AUTOTUNE_ENV = "SMPTK_AUTOTUNE"
# The torchrun benchmarks read their time limit from these per test (through smptk.settings) and kill their
# torchrun at it: the plugin sets them to the time left instead of arming pytest-timeout
TORCHRUN_TIMEOUT_ENVS = {
    "bench/test_bench_comm_dist.py": "SMPTK_BENCH_COMM_DIST_TIMEOUT_S",
    "bench/test_bench_tp_dist.py": "SMPTK_BENCH_TP_DIST_TIMEOUT_S",
}
DEFAULT_MINUTES = 25.0
TEST_SHARE = 0.30  # of the budget, at most, for the tests: the benchmarks are what only a GPU can do
TEST_TIMEOUT_S = 300  # one test; untuned (the sm_90 compile test is the longest one we know of)
CUT_OFF_SLACK_S = 2.0  # a budget-limited test failing this close to the deadline (or after) was cut off
MIN_PHASE_S = 5.0  # a phase with less time than this does not start
SCHEMA = "smptk.gpu_check/1"
_PLUGINS = {"pytest-timeout": "pytest_timeout", "rich": "rich", "pytest-xdist": "xdist"}  # reported only


def _clamp(x: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, x))


# ----------------------------------------------------------------------------- pytest plugin (children)
class _Watch:
    """Event log, deadline and case order for one child pytest session (see the module docstring)."""

    def __init__(self, config: pytest.Config, cfg: dict[str, Any]) -> None:
        self.config = config
        self.log_path = Path(cfg["log"])
        self.deadline: float | None = cfg.get("deadline")  # time.time() after which no test starts
        self.order = bool(cfg.get("order"))
        self.test_timeout_s: float | None = cfg.get("test_timeout_s")
        self.first = 0
        self.torchrun_timeouts = {  # the user's own limits, checked by smptk.settings (None: the default)
            env: settings.VARIABLES[env].read() for env in TORCHRUN_TIMEOUT_ENVS.values()
        }
        self.budget_limited: set[str] = set()  # tests whose time limit was the budget's time left

    def _log(self, **event: Any) -> None:
        with self.log_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(event, default=str) + "\n")

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self._log(
            event="start",
            jsonl=settings.bench_jsonl(),
            run_id=settings.bench_run_id(),
            mode=settings.bench_mode(),
        )

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        if self.order:
            items[:], self.first = ordered(items)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._log(event="collected", nodeids=[item.nodeid for item in session.items], first=self.first)

    def _left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.time()

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        """Outermost wrapper: limit the test to the time left (before pytest-timeout reads its marker).

        A test due to start after the deadline (collection ran past it) is skipped with that reason. A
        test whose limit is the time left, and that fails once the deadline has passed, was cut off by the
        budget: it is reported as "cut off", not as a failure (:meth:`pytest_runtest_logreport`).
        """
        left = self._left()
        if left is not None and left <= 0:
            item.add_marker(pytest.mark.skip(reason="gpu-check: time budget spent before it started"))
        elif left is not None:
            env = next((v for f, v in TORCHRUN_TIMEOUT_ENVS.items() if item.nodeid.startswith(f)), None)
            if env is not None:
                own = self.torchrun_timeouts[env] or float("inf")
                limit = min(left, own)
                os.environ[env] = f"{max(1.0, limit):.0f}"
            elif self.config.pluginmanager.hasplugin("timeout"):
                own = float("inf") if self.test_timeout_s is None else self.test_timeout_s
                marker = item.get_closest_marker("timeout")
                if marker and marker.args and isinstance(marker.args[0], (int, float)) and marker.args[0] > 0:
                    own = min(own, float(marker.args[0]))
                limit = min(left, own)
                item.add_marker(pytest.mark.timeout(max(1, round(limit)), method="signal"), append=False)
            else:
                own = limit = left  # no per-test limit: the parent kills the child at the budget's end
            if left <= own:
                self.budget_limited.add(item.nodeid)
        yield
        left = self._left()
        if left is not None and left <= 0 and not item.session.shouldstop:
            item.session.shouldstop = "gpu-check: time budget spent"
            self._log(event="stop", after=item.nodeid)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            lines = [line for line in report.longreprtext.splitlines() if line.strip()]
            message = lines[-1].removeprefix("E").strip() if lines else "collection failed"
            self._log(event="collect_error", nodeid=report.nodeid, message=message[:500])

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self._log(event="begin", nodeid=nodeid, t=time.time())

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        xfail = hasattr(report, "wasxfail")
        if report.when == "call":
            outcome = ("xfailed" if report.skipped else "xpassed") if xfail else report.outcome
        elif report.when == "setup" and not report.passed:
            outcome = "error" if report.failed else ("xfailed" if xfail else "skipped")
        elif report.when == "teardown" and report.failed:
            outcome = "error"
        else:
            return
        message = None
        if outcome in ("failed", "error"):
            crash = getattr(report.longrepr, "reprcrash", None)
            lines = report.longreprtext.strip().splitlines()
            message = str(getattr(crash, "message", None) or (lines[-1] if lines else ""))[:500]
            left = self._left()
            if report.nodeid in self.budget_limited and left is not None and left <= CUT_OFF_SLACK_S:
                outcome = "cut off"  # stopped at the budget's end, by its time-left limit
        self._log(event="end", nodeid=report.nodeid, outcome=outcome, message=message, t=time.time())


def ordered(items: Sequence[Any]) -> tuple[list[Any], int]:
    """``items`` with the cases the targets need first, in target order, each tier in collection order;
    and how many those are. An item's case is ``item.callspec.params["case"]`` (its ``fields()``)."""
    keys = []
    for i, item in enumerate(items):
        case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
        fields = case.fields() if hasattr(case, "fields") else None
        keys.append((_targets.priority(fields, item.nodeid), i))
    order = sorted(range(len(items)), key=lambda i: keys[i])
    return [items[i] for i in order], sum(1 for k in keys if k[0] < len(_targets.TARGETS))


def pytest_configure(config: pytest.Config) -> None:
    """Register :class:`_Watch` when this module is loaded with ``-p bench.gpu_check`` by a gpu-check run."""
    raw = settings.gpu_check()  # PLUGIN_ENV
    if raw:
        config.pluginmanager.register(_Watch(config, json.loads(raw)), "smptk-gpu-check")


# ----------------------------------------------------------------------------- running a child
@dataclasses.dataclass
class Child:
    """What one child pytest process did, from its exit and its event log."""

    returncode: int | None
    killed: bool
    wall_s: float
    events: list[dict[str, Any]]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    @property
    def collected(self) -> list[str]:
        found = self.of("collected")
        return list(found[-1]["nodeids"]) if found else []

    @property
    def outcomes(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for e in self.of("end"):
            if out.get(e["nodeid"]) not in ("failed", "error"):  # a teardown error keeps the failure
                out[e["nodeid"]] = e["outcome"]
        return out

    @property
    def begun(self) -> list[str]:
        return [e["nodeid"] for e in self.of("begin")]

    @property
    def budget_stop(self) -> bool:
        return bool(self.of("stop"))


def _kill(proc: subprocess.Popen, wait_s: float) -> None:
    """SIGTERM the child's process group, then SIGKILL it and every process it had started (by id)."""
    from bench.comm_dist import _descendants  # torchrun's ranks run in sessions of their own

    started = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=wait_s)
    for pid in started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_child(
    argv: list[str], *, budget_s: float, order: bool, test_timeout_s: float | None, env: dict[str, str]
) -> Child:
    """Run ``argv`` (a pytest-running command) with this module as its plugin, within ``budget_s``.

    No test starts after ``budget_s - grace``; a child still running at ``budget_s - kill_wait`` gets
    SIGTERM, and SIGKILL ``kill_wait`` later. Its output goes to this process's stdout and stderr.
    """
    grace = _clamp(0.1 * budget_s, 5.0, 60.0)
    kill_wait = min(10.0, grace / 2)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        log = Path(tmp) / "events.jsonl"
        cfg = {"log": str(log), "deadline": time.time() + budget_s - grace, "order": order}
        cfg["test_timeout_s"] = test_timeout_s
        child_env = env | {PLUGIN_ENV: json.dumps(cfg)}
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        t0 = time.monotonic()
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=child_env, stdin=subprocess.DEVNULL, start_new_session=True
        )
        killed = False
        try:
            proc.wait(timeout=max(1.0, budget_s - kill_wait))
        except subprocess.TimeoutExpired:
            killed = True
            print(f"gpu-check: child ran to its {budget_s:.0f} s limit; killing it", file=sys.stderr)
            _kill(proc, kill_wait)
        except BaseException:
            _kill(proc, kill_wait)
            raise
        wall = time.monotonic() - t0
        events = []
        if log.exists():
            for line in log.read_text(encoding="utf-8").splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    events.append(json.loads(line))
    return Child(proc.returncode, killed, wall, events)


def _not_reached(child: Child) -> dict[str, list[str]]:
    """Collected tests that never started, by file."""
    begun = set(child.begun)
    out: dict[str, list[str]] = {}
    for nodeid in child.collected:
        if nodeid not in begun:
            out.setdefault(nodeid.split("::")[0], []).append(nodeid)
    return out


def _counts(outcomes: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def _why_not_started(child: Child) -> str:
    if child.budget_stop:
        return "time budget spent"
    if child.killed:
        return "the run was killed at its time limit"
    if child.of("collect_error"):
        return f"the session stopped after collection errors (exit status {child.returncode})"
    return f"the session ended first (exit status {child.returncode})"


def _cut_off(child: Child) -> list[str]:
    """Tests stopped by their time-left limit at the budget's end (not failures: see ``_Watch``)."""
    return [n for n, outcome in child.outcomes.items() if outcome == "cut off"]


def _unfinished(child: Child) -> list[str]:
    """Tests that started but reported no outcome (the one running when the child was killed)."""
    done = child.outcomes
    return [n for n in dict.fromkeys(child.begun) if n not in done]


# ----------------------------------------------------------------------------- phases
def run_tests(budget_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Phase 1: ``pytest tests -m gpu`` with SMPTK_AUTOTUNE=0; a summary dict."""
    argv = [sys.executable, "-m", "pytest", "tests", "-m", "gpu", "-p", "bench.gpu_check"]
    argv += ["-p", "no:cacheprovider", "-q", "-rfE", "--tb=short", "--continue-on-collection-errors"]
    child = run_child(
        argv, budget_s=budget_s, order=False, test_timeout_s=TEST_TIMEOUT_S, env=env | {AUTOTUNE_ENV: "0"}
    )
    outcomes = child.outcomes
    failures = [
        {"nodeid": e["nodeid"], "outcome": "collection error", "message": e.get("message")}
        for e in child.of("collect_error")
    ]
    failures += [
        {"nodeid": e["nodeid"], "outcome": e["outcome"], "message": e.get("message")}
        for e in child.of("end")
        if e["outcome"] in ("failed", "error")
    ]
    return {
        "command": " ".join(argv[1:]) + f"  ({AUTOTUNE_ENV}=0)",
        "cut_off": _cut_off(child),
        "budget_s": budget_s,
        "wall_s": child.wall_s,
        "returncode": child.returncode,
        "killed": child.killed,
        "budget_stop": child.budget_stop,
        "collected": len(child.collected),
        "counts": _counts(outcomes),
        "failures": failures,
        "unfinished": _unfinished(child),
        "not_started": [n for ids in _not_reached(child).values() for n in ids],
        "not_started_why": _why_not_started(child),
        "timeout_plugin": importlib.util.find_spec("pytest_timeout") is not None,
    }


def run_bench(budget_s: float, env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """Phase 2: ``python -m bench`` with the targets' cases first; a summary dict (jsonl path included)."""
    argv = [sys.executable, "-m", "bench", "-p", "bench.gpu_check"]
    if args.quick:
        argv.append("--quick")
    if args.filter:
        argv += ["--filter", args.filter]
    if args.out:  # the child runs in the checkout: a relative --out means the caller's directory
        argv += ["--out", str(Path(args.out).resolve())]
    child = run_child(argv, budget_s=budget_s, order=True, test_timeout_s=None, env=env)
    start = child.of("start")
    jsonl = Path(start[-1]["jsonl"]) if start and start[-1].get("jsonl") else None
    not_reached = _not_reached(child)
    return {
        "command": " ".join(argv[1:]),
        "budget_s": budget_s,
        "wall_s": child.wall_s,
        "returncode": child.returncode,
        "killed": child.killed,
        "budget_stop": child.budget_stop,
        "jsonl": str(jsonl) if jsonl else None,
        "run_id": start[-1].get("run_id") if start else None,
        "collected": len(child.collected),
        "targets_first": (child.of("collected") or [{}])[-1].get("first", 0),
        "counts": _counts(child.outcomes),
        "failures": [e["nodeid"] for e in child.of("end") if e["outcome"] in ("failed", "error")]
        + [f"{e['nodeid']} (collection error: {e.get('message')})" for e in child.of("collect_error")],
        "unfinished": _unfinished(child),
        "cut_off": _cut_off(child),
        "not_reached": not_reached,
        "not_reached_why": _why_not_started(child),
    }


# ----------------------------------------------------------------------------- output
COLUMNS = _targets.TABLE_COLUMNS


def table_rows(results: Sequence[_targets.Result]) -> list[tuple[str, ...]]:
    """The targets table's cells, one tuple per target, in :data:`COLUMNS` order, as the report shows them."""
    return [_targets.table_cells(r.as_dict()) for r in results]


def print_table(results: Sequence[_targets.Result], stream: Any = None) -> None:
    """The targets table: rich when importable, aligned plain text otherwise; then what each id means."""
    stream = stream or sys.stdout
    cells = table_rows(results)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is not None:
        table = Table(title="TARGETS")
        for name in COLUMNS:
            table.add_column(name, overflow="fold")
        style = {"met": "green", "not met": "red"}
        for r, row in zip(results, cells, strict=True):
            table.add_row(*row[:-1], row[-1], style=style.get(r.status))
        Console(file=stream, width=max(160, Console(file=stream).width), soft_wrap=False).print(table)
    else:
        widths = [max(len(c) for c in col) for col in zip(COLUMNS, *cells, strict=True)]
        line = lambda cols: " | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()
        print("TARGETS", file=stream)
        print(line(COLUMNS), file=stream)
        print("-+-".join("-" * w for w in widths), file=stream)
        for row in cells:
            print(line(row), file=stream)
    for r in results:
        print(f"  {r.target.id}: {r.target.description}", file=stream)


def _print_tests(summary: dict[str, Any]) -> None:
    counts = ", ".join(f"{v} {k}" for k, v in sorted(summary["counts"].items())) or "no test ran"
    print(f"gpu-check: tests: {summary['collected']} collected; {counts}")
    for f in summary["failures"][:30]:
        print(f"  {f['outcome'].upper()} {f['nodeid']}: {f['message']}")
    if len(summary["failures"]) > 30:
        print(f"  ... and {len(summary['failures']) - 30} more failures")
    if summary["cut_off"]:
        print(f"gpu-check: tests cut off by the time budget (not failures): {summary['cut_off']}")
    if summary["unfinished"]:
        print(f"gpu-check: tests not finished (stopped or killed while running): {summary['unfinished']}")
    if summary["not_started"]:
        print(
            f"gpu-check: {len(summary['not_started'])} tests not started: {summary['not_started_why']} "
            f"(first: {summary['not_started'][0]})"
        )
    if summary["killed"]:
        print("gpu-check: the test run was killed at the end of its time share")


def _print_bench(summary: dict[str, Any]) -> None:
    counts = ", ".join(f"{v} {k}" for k, v in sorted(summary["counts"].items())) or "none ran"
    print(
        f"gpu-check: benchmarks: {summary['collected']} selected ({summary['targets_first']} for the "
        f"targets, run first); {counts}"
    )
    for nodeid in summary["failures"][:30]:
        print(f"  FAILED {nodeid}")
    if summary["cut_off"]:
        print(
            f"gpu-check: benchmarks cut off by the time budget (not failures; rows written stay): "
            f"{summary['cut_off']}"
        )
    if summary["unfinished"]:
        print(f"gpu-check: benchmarks cut off while running: {summary['unfinished']}")
    for suite, ids in summary["not_reached"].items():
        why = summary["not_reached_why"]
        print(f"gpu-check: not reached ({why}): {suite}: {len(ids)} cases, first {ids[0]}")
    if summary["killed"]:
        print("gpu-check: the benchmark run was killed at the end of its time budget")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=DEFAULT_MINUTES, help="the whole run's time budget")
    p.add_argument("--quick", action="store_true", help="benchmarks in quick mode, even on a GPU")
    p.add_argument("--skip-tests", action="store_true", help="no test phase: the benchmarks get its time")
    p.add_argument("--filter", metavar="EXPR", default=None, help="pytest -k expression for the benchmarks")
    p.add_argument(
        "--out", metavar="DIR", type=Path, default=None, help="results root (default bench/results)"
    )
    p.add_argument(
        "--since",
        metavar="EPOCH",
        type=float,
        default=None,
        help="when the budget started, in seconds since the epoch (make passes its start time)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    t_start = time.monotonic()
    args = _parser().parse_args(argv)
    if not args.minutes > 0:
        print(f"gpu-check: --minutes {args.minutes}: expected a positive number", file=sys.stderr)
        return 2
    total = args.minutes * 60
    before = max(0.0, time.time() - args.since) if args.since is not None else 0.0  # make's bootstrap
    t_start -= before
    deadline = t_start + total
    reserve = _clamp(0.05 * total, 5.0, 30.0)  # phase 3: reading rows, the table, the report
    phases: dict[str, float] = {"bootstrap": before} if args.since is not None else {}

    import torch  # after argument parsing: --help stays fast

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cpu = gpus == 0
    device = torch.cuda.get_device_name(0) if gpus else "cpu (no CUDA device)"
    quick = cpu or args.quick
    banner = None
    if cpu:
        banner = "cpu: nothing was measured (no CUDA device: GPU tests skip, benchmarks run in quick mode)"
    elif quick:
        banner = "quick mode: nothing was measured (tiny shapes, few rounds)"
    if banner:
        print(f"gpu-check: {banner}")
    plugins = {n: importlib.util.find_spec(m) is not None for n, m in _PLUGINS.items()}
    print(
        f"gpu-check: {device} ({gpus} GPU{'s' if gpus != 1 else ''}), torch {torch.__version__}, "
        f"{'quick' if quick else 'measure'} mode, budget {args.minutes:g} min; "
        + ", ".join(f"{n} {'yes' if ok else 'no'}" for n, ok in plugins.items())
    )
    env = dict(os.environ)
    phases["setup"] = time.monotonic() - t_start - before
    print(f"gpu-check: phase setup {phases['setup']:.1f} s")

    tests: dict[str, Any] | None = None
    budget = min(TEST_SHARE * total, deadline - time.monotonic() - reserve)
    if not args.skip_tests and budget < MIN_PHASE_S:
        print(f"gpu-check: no time left for the tests ({budget:.0f} s)")
    elif not args.skip_tests:
        print(f"gpu-check: phase tests: pytest tests -m gpu ({AUTOTUNE_ENV}=0), at most {budget:.0f} s")
        t0 = time.monotonic()
        tests = run_tests(budget, env)
        phases["tests"] = time.monotonic() - t0
        _print_tests(tests)
        print(f"gpu-check: phase tests {phases['tests']:.1f} s (share {budget:.0f} s)")

    bench: dict[str, Any] | None = None
    budget = deadline - time.monotonic() - reserve
    if budget >= MIN_PHASE_S:
        print(f"gpu-check: phase benchmarks: python -m bench, at most {budget:.0f} s")
        t0 = time.monotonic()
        bench = run_bench(budget, env, args)
        phases["benchmarks"] = time.monotonic() - t0
        _print_bench(bench)
        print(f"gpu-check: phase benchmarks {phases['benchmarks']:.1f} s (budget {budget:.0f} s)")
    else:
        print(f"gpu-check: no time left for the benchmarks ({budget:.0f} s)")

    t0 = time.monotonic()
    jsonl = Path(bench["jsonl"]) if bench and bench.get("jsonl") else None
    rows: list[dict[str, Any]] = []
    if jsonl is not None and jsonl.exists():
        from bench.rows import read_rows

        rows = list(read_rows(jsonl))
    results = _targets.evaluate(rows, gpu_count=gpus, run_id=(bench or {}).get("run_id"))
    print_table(results)
    phases["targets"] = time.monotonic() - t0
    phases["total"] = time.monotonic() - t_start
    summary = {
        "schema": SCHEMA,
        "device": device,
        "gpus": gpus,
        "mode": "quick" if quick else "measure",
        "banner": banner,
        "minutes": args.minutes,
        "phases_s": phases,
        "tests": tests,
        "benchmarks": bench,
        "results": str(jsonl) if jsonl else None,
        "targets": [r.as_dict() for r in results],
    }
    if jsonl is not None:
        out = jsonl.with_name(jsonl.stem + ".targets.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=1, default=str) + "\n", encoding="utf-8")
        if jsonl.exists():  # the report again, now with the targets (and written if the child was killed)
            from bench.report import write_report

            write_report(jsonl)
        print(f"gpu-check: results {jsonl}\ngpu-check: targets -> {out}")
    else:
        print("gpu-check: no results file (the benchmark run did not start); targets not written")
    met = sum(r.status == "met" for r in results)
    unmet = sum(r.status == "not met" for r in results)
    print(
        f"gpu-check: targets {met} met, {unmet} not met, {len(results) - met - unmet} not measured; "
        + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
        + f" (budget {total:.0f} s)"
    )
    if banner:
        print(f"gpu-check: {banner}")
    return 1 if any(s is not None and not _clean(s) for s in (tests, bench)) else 0


def _clean(summary: dict[str, Any]) -> bool:
    """A phase that ran to its end or to its budget with no failure (exit 5: nothing was selected; 1 or 2
    after a budget stop: a test cut off by the budget, or the stop itself)."""
    rc = summary["returncode"]
    ended = rc in (0, 5) or (rc in (1, 2) and summary["budget_stop"])
    return ended and not summary["killed"] and not summary["failures"]


if __name__ == "__main__":
    sys.exit(main())
