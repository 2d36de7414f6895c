"""Result rows: one JSON object per line, each self-describing (what ran, how it was timed, where).

A row of ``kind: "measurement"`` holds, besides the case (``suite``, ``op``, ``activation``, ``bias``,
``pass``, ``impl``, ``dtype``, ``shape``):

- ``time_s``: :func:`bench.timing.summarize` of the per-round durations (median, q1, q3, iqr, min, ...),
  ``timer`` ("cuda_event" or "host"), ``rounds``/``warmup_rounds``, ``l2_flush_bytes``, ``spin_us``;
- ``flops``, ``bytes`` (:mod:`bench.counts`) and ``tflops`` / ``gbps`` = count / median time;
- ``sm_clock_mhz_after``: the GPU's SM clock sampled by NVML right after the timed rounds (throttling
  shows here; the clocks in ``env`` are from the start of the run);
- ``kernel_path``: what actually ran ("triton", "triton (interpreter)", "torch", "cuBLAS via torch"...);
- ``check``: forward output vs an fp32 reference (``max_abs_err``, ``ref_max_abs``, ``tol``) when done;
- ``mode``, ``device``, ``gpu_index`` (torch's index of the GPU that ran it; the matching entry of
  ``env["gpus"]`` has the same ``torch_index``), ``note`` (None for measurements, else why the row is
  not one), ``run_id``, ``timestamp``;
- ``env``: :func:`smptk._env.collect_environment` (GPU name, SM count, memory, clocks, driver, CUDA /
  torch / triton / NCCL versions, git sha and dirty flag, world size...) and ``env_vars`` (the
  SMPTK_* / TRITON_INTERPRET / CUDA_VISIBLE_DEVICES settings of the run).

Rows of kind "skipped" and "failed" record a benchmark that produced no number, with the reason; they
never carry timings.

Example::

    >>> writer = RowWriter(Path("out.jsonl"))
    >>> writer.write({"kind": "measurement", ...})
    >>> [row["kind"] for row in read_rows(Path("out.jsonl"))]
    ['measurement']
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from smptk import settings

SCHEMA = "smptk.bench.row/1"
RUN_ID_ENV = "SMPTK_BENCH_RUN_ID"
RECORDED_ENV_VARS = (
    "SMPTK_KERNELS",
    "SMPTK_POISON_OUTPUTS",
    "TRITON_INTERPRET",
    "CUDA_VISIBLE_DEVICES",
    "SMPTK_BENCH_MODE",
    "TORCHINDUCTOR_COMPILE_THREADS",
)


def new_run_id() -> str:
    """A run id: UTC time plus 6 random hex digits, e.g. ``20261122T113800Z-3fa2c1``."""
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{now}-{uuid.uuid4().hex[:6]}"


def run_id() -> str:
    """This run's id: ``SMPTK_BENCH_RUN_ID`` when set (``python -m bench`` sets it), else a new one.

    A new id is stored in the environment, so every row of the process shares it.
    """
    value = settings.bench_run_id()  # blank counts as unset (smptk.settings)
    if value is None:
        value = os.environ[RUN_ID_ENV] = new_run_id()
    return value


def recorded_env_vars() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in RECORDED_ENV_VARS}


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def base_row(kind: str, test_id: str, env: dict[str, Any]) -> dict[str, Any]:
    """The fields every row has, whatever its kind."""
    if kind not in ("measurement", "skipped", "failed"):
        raise ValueError(f"kind: {kind!r} is not one of 'measurement', 'skipped', 'failed'")
    return {
        "schema": SCHEMA,
        "kind": kind,
        "run_id": run_id(),
        "timestamp": utc_now(),
        "test_id": test_id,
        "env": env,
        "env_vars": recorded_env_vars(),
    }


def jsonable(value: Any) -> Any:
    """``value`` with non-finite floats replaced by their names ("nan", "inf"), which JSON cannot hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


class RowWriter:
    """Appends rows to a JSON-lines file, one ``json.dumps`` per line, flushed at once.

    Example::

        >>> RowWriter(Path("bench/results/x.jsonl")).write({"kind": "skipped", "reason": "no GPU"})
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict[str, Any]) -> None:
        line = json.dumps(jsonable(row), sort_keys=True, allow_nan=False, default=str)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a JSON-lines file; a line that is not a JSON object raises ``ValueError`` with its number.

    Example::

        >>> rows = list(read_rows(Path("bench/results/cpu-interpreter/2026-11-22-e60bd426.jsonl")))
    """
    with Path(path).open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            yield row
