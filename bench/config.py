"""Which mode the benchmarks run in, decided once per process before ``smptk.kernels`` is imported.

Two modes:

- **measure** (default on a CUDA machine): LLM shapes, bf16, many rounds, CUDA-event timing, L2 flushed
  before every round. Rows are measurements.
- **quick** (always on a CPU; ``--quick`` / ``SMPTK_BENCH_MODE=quick`` on a GPU): tiny shapes and few
  rounds, to prove that every benchmark runs and produces rows. On a CPU the Triton kernels run under the
  interpreter (``TRITON_INTERPRET=1``) in fp16, because the interpreter's ``tl.dot`` is wrong for bf16.
  Every row carries a note saying it is not a performance measurement.

Environment variables (``python -m bench`` sets them from its options; plain ``pytest bench`` reads them):

- ``SMPTK_BENCH_MODE``: "measure" or "quick"; default measure with CUDA, quick without.
- ``SMPTK_BENCH_ROUNDS`` / ``SMPTK_BENCH_WARMUP``: timed and warm-up rounds per benchmark.
- ``SMPTK_BENCH_JSONL``: where rows are appended (unset: rows only go into pytest-benchmark's JSON).

Example::

    >>> from bench.config import prepare_process
    >>> mode = prepare_process()  # on a CPU: sets TRITON_INTERPRET=1, returns quick mode
    >>> mode.name, mode.label, mode.dtype
    ('quick', 'cpu-interpreter', torch.float16)
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import Any

import torch

from smptk import settings

MODE_ENV = "SMPTK_BENCH_MODE"
ROUNDS_ENV = "SMPTK_BENCH_ROUNDS"
WARMUP_ENV = "SMPTK_BENCH_WARMUP"
JSONL_ENV = "SMPTK_BENCH_JSONL"

CPU_NOTE = "cpu-interpreter: not a performance measurement"
GPU_QUICK_NOTE = "quick mode (tiny shapes, few rounds): not a performance measurement"

# Shapes of the LLM projections the kernels exist for: tokens per batch M, and (K, N) of Llama-3-8B's
# MLP (4096 -> 14336), Llama-3-70B's MLP (8192 -> 28672) and a square attention projection.
MEASURE_M = (4096, 16384)
MEASURE_KN = ((4096, 14336), (8192, 28672), (4096, 4096))
# Quick mode: odd sizes that are not multiples of any block size, small enough for the interpreter.
QUICK_M = (7, 33)
QUICK_KN = ((16, 24), (40, 17))


@dataclasses.dataclass(frozen=True)
class Mode:
    """Everything a suite needs to know about the run it is part of."""

    name: str  # "measure" or "quick"
    device: str  # "cuda" or "cpu"
    dtype: torch.dtype
    m_values: tuple[int, ...]
    kn_values: tuple[tuple[int, int], ...]
    rounds: int
    warmup_rounds: int
    label: str  # results sub-directory: GPU slug, "<slug>-quick" or "cpu-interpreter"
    note: str | None  # None for measurements; otherwise why the rows are not measurements

    @property
    def quick(self) -> bool:
        return self.name == "quick"


def slugify(text: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``.

    Example::

        >>> slugify("NVIDIA H100 80GB HBM3")
        'nvidia-h100-80gb-hbm3'
    """
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def _rounds(default: int) -> int:
    value = settings.bench_rounds()  # SMPTK_BENCH_ROUNDS, checked (>= 1) by smptk.settings
    return default if value is None else value


def _warmup(default: int) -> int:
    value = settings.bench_warmup()  # SMPTK_BENCH_WARMUP, checked (>= 0) by smptk.settings
    return default if value is None else value


def current_mode() -> Mode:
    """The mode this process runs in, from ``SMPTK_BENCH_MODE`` and whether CUDA is available.

    Raises ``RuntimeError`` for ``SMPTK_BENCH_MODE=measure`` without CUDA (there is nothing to measure).
    """
    cuda = torch.cuda.is_available()
    requested = settings.bench_mode() or ("measure" if cuda else "quick")  # checked by smptk.settings
    if requested == "measure" and not cuda:
        raise RuntimeError(f"{MODE_ENV}=measure needs a CUDA GPU; this machine has none (use quick mode)")
    if requested == "measure":
        return Mode(
            name="measure",
            device="cuda",
            dtype=torch.bfloat16,
            m_values=MEASURE_M,
            kn_values=MEASURE_KN,
            rounds=_rounds(25),
            warmup_rounds=_warmup(5),
            label=slugify(torch.cuda.get_device_name(torch.cuda.current_device())),
            note=None,
        )
    if cuda:
        return Mode(
            name="quick",
            device="cuda",
            dtype=torch.bfloat16,
            m_values=QUICK_M,
            kn_values=QUICK_KN,
            rounds=_rounds(3),
            warmup_rounds=_warmup(1),
            label=slugify(torch.cuda.get_device_name(torch.cuda.current_device())) + "-quick",
            note=GPU_QUICK_NOTE,
        )
    return Mode(
        name="quick",
        device="cpu",
        dtype=torch.float16,  # the interpreter's tl.dot is wrong for bf16 (fp16 and fp32 are right)
        m_values=QUICK_M,
        kn_values=QUICK_KN,
        rounds=_rounds(3),
        warmup_rounds=_warmup(1),
        label="cpu-interpreter",
        note=CPU_NOTE,
    )


def prepare_process() -> Mode:
    """Decide the mode and, on a CPU, switch Triton to its interpreter before smptk.kernels loads.

    On a CPU it also sets ``TORCHINDUCTOR_COMPILE_THREADS=1`` (before torch.compile's config loads) and
    ``torch.set_num_threads(1)``; rows record ``torch_threads``.
    Call it before anything imports ``smptk.kernels`` (``bench/conftest.py`` does, at import). If the
    kernels were already imported without the interpreter, the smptk rows run the PyTorch path; each row
    records the path that ran (``kernel_path``), so this cannot pass unnoticed.
    """
    mode = current_mode()
    if mode.device == "cpu":
        if "smptk.kernels" not in sys.modules:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        # One thread for torch ops and for inductor's compiles: on a 2-core machine shared with other work,
        # 2 OpenMP threads made each tiny op wait for a descheduled worker (~8 ms instead of ~10 us), and
        # inductor's pool of compile workers kept a core busy. Quick mode checks function, not speed.
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        torch.set_num_threads(1)
    return mode


_SESSION_ENV: dict[str, Any] | None = None


def session_env() -> dict[str, Any]:
    """:func:`smptk._env.collect_environment`, taken once per process, after :func:`prepare_process`."""
    global _SESSION_ENV
    if _SESSION_ENV is None:
        from smptk._env import collect_environment

        _SESSION_ENV = collect_environment()
    return _SESSION_ENV
