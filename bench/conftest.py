"""pytest glue for the benchmark suites: mode, environment, L2 flusher, clock, and row recording.

Imported by pytest before any ``test_bench_*.py``; its first act is :func:`bench.config.prepare_process`,
which sets ``TRITON_INTERPRET=1`` on a CPU before ``smptk.kernels`` can be imported.

Fixtures: ``bench_mode`` (:class:`bench.config.Mode`), ``bench_env`` (collect_environment(), once per
session), ``l2_flusher`` (:class:`bench.timing.L2Flusher`), ``record`` (turns a finished
``benchmark.pedantic`` into a row). Every test also gets the clock switched to its device and, after it,
its GPU memory released (the 16384 x 8192 x 28672 fwd+bwd cases hold several GiB).

Rows go to ``SMPTK_BENCH_JSONL`` when set, and always into pytest-benchmark's ``extra_info`` (so
``pytest bench --benchmark-json=out.json`` carries them too). Skipped and failed benchmarks get a row with
the reason and no numbers.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.config import Mode, prepare_process, session_env
from bench.rows import RowWriter, base_row
from bench.timing import CLOCK, L2Flusher, summarize
from smptk import settings
from smptk._env import current_sm_clock_mhz

MODE = prepare_process()


def _sink() -> RowWriter | None:
    path = settings.bench_jsonl()  # SMPTK_BENCH_JSONL (JSONL_ENV), blank counts as unset
    return RowWriter(Path(path)) if path else None


@pytest.fixture(scope="session")
def bench_mode() -> Mode:
    return MODE


@pytest.fixture(scope="session")
def bench_env() -> dict[str, Any]:
    return session_env()


@pytest.fixture(scope="session")
def l2_flusher() -> Iterator[L2Flusher]:
    flusher = L2Flusher(MODE.device)
    yield flusher
    flusher.release()


@pytest.fixture(autouse=True)
def _clock_and_memory() -> Iterator[None]:
    CLOCK.use(MODE.device)
    yield
    CLOCK.reset()
    gc.collect()
    if MODE.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _sm_clock_now(env: dict[str, Any]) -> int | None:
    """SM clock (MHz) of the GPU the benchmark ran on, sampled now; None on a CPU or without NVML."""
    if MODE.device != "cuda":
        return None
    index = torch.cuda.current_device()
    for gpu in env.get("gpus") or []:
        if gpu.get("torch_index") == index and gpu.get("nvml_index") is not None:
            return current_sm_clock_mhz(gpu["nvml_index"])
    return None


def _case_fields(item: pytest.Item) -> dict[str, Any]:
    callspec = getattr(item, "callspec", None)
    case = callspec.params.get("case") if callspec is not None else None
    return case.fields() if hasattr(case, "fields") else {}


@pytest.fixture
def record(request: pytest.FixtureRequest, bench_env: dict[str, Any]) -> Callable[..., dict[str, Any]]:
    """``record(benchmark, flops=..., nbytes=..., **fields)``: the measurement row of a finished pedantic run.

    Statistics come from pytest-benchmark's per-round durations (``benchmark.stats.stats.data``), i.e.
    from :data:`bench.timing.CLOCK`; nothing else is timed. Skips the test when pytest-benchmark was
    disabled (``--benchmark-disable``: the target ran once, untimed).
    """

    def _record(benchmark: Any, *, flops: int, nbytes: int, **fields: Any) -> dict[str, Any]:
        meta = getattr(benchmark, "stats", None)
        data = list(meta.stats.data) if meta is not None else []
        if not data:
            pytest.skip(
                "pytest-benchmark is disabled (--benchmark-disable): the target ran but was not timed"
            )
        summary = summarize(data)
        median = summary["median"]
        row = base_row("measurement", request.node.nodeid, bench_env)
        row.update(_case_fields(request.node))
        row.update(
            {
                "mode": MODE.name,
                "device": MODE.device,
                "gpu_index": torch.cuda.current_device() if MODE.device == "cuda" else None,
                "note": MODE.note,
                "timer": CLOCK.kind,
                "torch_threads": torch.get_num_threads(),
                "time_s": summary,
                "rounds": summary["rounds"],
                "warmup_rounds": MODE.warmup_rounds,
                "flops": flops,
                "bytes": nbytes,
                "tflops": flops / median / 1e12 if median > 0 else None,
                "gbps": nbytes / median / 1e9 if median > 0 and nbytes > 0 else None,  # 0: not counted
            }
        )
        row.update(fields)
        row["sm_clock_mhz_after"] = _sm_clock_now(bench_env)
        benchmark.extra_info.update(row)  # so --benchmark-json output carries the row, env included
        sink = _sink()
        if sink is not None:
            sink.write(row)
        return row

    return _record


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Write a "skipped" or "failed" row (reason, no numbers) for a benchmark that produced no measurement."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped or report.failed):
        return
    sink = _sink()
    if sink is None:
        return
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif call.excinfo is not None:
        reason = call.excinfo.exconly()[:2000]  # "ValueError: SMPTK_KERNELS='bogus': expected ..."
    else:
        reason = report.longreprtext.strip()[-2000:]
    row = base_row("skipped" if report.skipped else "failed", item.nodeid, session_env())
    row.update(_case_fields(item))
    row.update({"mode": MODE.name, "device": MODE.device, "note": MODE.note, "phase": report.when})
    row["reason"] = reason
    sink.write(row)
