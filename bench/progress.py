"""Progress display for ``python -m bench``: a pytest plugin driving a rich progress bar, or plain lines.

The plugin unregisters pytest's own terminal reporter once options are parsed, so it is what the user
sees: one bar (rich, on a terminal) or one line per finished benchmark (no rich, or output not a
terminal, as in CI logs), then the failures with their tracebacks and a count of benchmarks by outcome
(benchmarks, not result rows: ``python -m bench`` prints the row count after it, as the report's
header shows it).

It writes to a stream duplicated from stderr *before* pytest starts capturing, so the bar keeps drawing
while a benchmark runs under pytest's file-descriptor capture.

Example::

    >>> plugin = ProgressPlugin(stream=sys.stderr)
    >>> pytest.main(["bench"], plugins=[plugin])
    >>> plugin.counts  # printed as "bench: 96 benchmarks: 96 passed, 0 failed, 0 skipped in ..."
    {'passed': 96, 'failed': 0, 'skipped': 0}
"""

from __future__ import annotations

import time
from typing import Any, TextIO

import pytest


def _short(nodeid: str) -> str:
    return nodeid.rsplit("::", 1)[-1]


class ProgressPlugin:
    """Counts outcomes and shows progress; ``use_rich=None`` picks rich when importable and on a tty."""

    def __init__(self, stream: TextIO, use_rich: bool | None = None) -> None:
        self.stream = stream
        if use_rich is None:
            try:
                import rich  # noqa: F401

                use_rich = stream.isatty()
            except ImportError:
                use_rich = False
        self.use_rich = use_rich
        self.outcomes: dict[str, str] = {}
        self.failures: list[tuple[str, str]] = []
        self.total = 0
        self.done = 0
        self._progress: Any = None
        self._task: Any = None
        self._t0 = time.perf_counter()
        self._test_t0 = self._t0

    def _print(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    @pytest.hookimpl(trylast=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        """Silence pytest's terminal output (after option parsing, so ini options like -ra still parse)."""
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)

    @pytest.hookimpl
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.total = len(session.items)
        if self.use_rich:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}", markup=False),  # ids hold [...]
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(file=self.stream),
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("benchmarks", total=self.total)
        else:
            self._print(f"bench: {self.total} benchmarks collected")

    @pytest.hookimpl
    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self._test_t0 = time.perf_counter()
        if self._progress is not None:
            self._progress.update(self._task, description=_short(nodeid))

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        first = report.nodeid not in self.outcomes
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = report.outcome
        elif report.when == "teardown" and report.failed:
            outcome = "failed"  # a teardown error turns a passed benchmark into a failed one
        else:
            return
        self.outcomes[report.nodeid] = outcome
        if outcome == "failed":
            self.failures.append((report.nodeid, report.longreprtext))
        if not first:
            return
        self.done += 1
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done)
            if outcome != "passed":
                self._print(f"{outcome.upper()}: {_short(report.nodeid)}")
        else:
            took = time.perf_counter() - self._test_t0
            width = len(str(self.total))
            self._print(
                f"[{self.done:>{width}}/{self.total}] {outcome:<7} {_short(report.nodeid)}  ({took:.1f} s)"
            )

    @property
    def counts(self) -> dict[str, int]:
        """Benchmarks by final outcome: passed, failed, skipped."""
        out = {"passed": 0, "failed": 0, "skipped": 0}
        for outcome in self.outcomes.values():
            out[outcome] = out.get(outcome, 0) + 1
        return out

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        for nodeid, text in self.failures:
            self._print(f"\n---- FAILED {nodeid}\n{text}")
        summary = ", ".join(f"{v} {k}" for k, v in self.counts.items())
        took = time.perf_counter() - self._t0
        self._print(f"bench: {len(self.outcomes)} benchmarks: {summary} in {took:.1f} s")
