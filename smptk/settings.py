"""Every environment variable smptk reads, through one parser per kind of value.

The table :data:`VARIABLES` lists each variable with its kind, default and meaning; ``smptk info``
prints it with the current values (:func:`snapshot`). Code reads a variable only through its named
accessor here (``settings.kernels()``, ``settings.poison_outputs()``...), never through ``os.environ``,
so every variable is spelled, parsed and documented once.

Parsing rules, the same for every variable of a kind:

- surrounding whitespace is ignored, and an unset or empty variable means the default;
- **flag**: ``1/0``, ``true/false``, ``yes/no``, ``on/off``, in any case;
- **integer**: what ``int()`` reads (``"4"``, ``" 4 "``; not ``"4.0"``); **number**: what ``float()`` reads;
- **choice**: one of a fixed set of words, in any case;
- **text** / **path**: the value as given (a path, or a value holding paths, is kept out of
  ``smptk info`` and benchmark rows);
- anything else raises ``ValueError`` naming the variable, the value and what is accepted.

Accessors read the environment at every call (no caching here); a caller that wants a value fixed for
the process (``smptk.comm`` reads its settings once, on first use) keeps it itself.

``TRITON_INTERPRET`` is Triton's variable, not ours: :func:`triton_interpret` reads it with Triton's
own rule (``1/true/yes/on/y`` in any case, nothing stripped), because Triton's reading, not ours,
decides whether kernels are interpreted.

Example::

    >>> import os
    >>> os.environ["SMPTK_POISON_OUTPUTS"] = "Yes"
    >>> poison_outputs()
    True
    >>> os.environ["SMPTK_POISON_OUTPUTS"] = "2"
    >>> poison_outputs()
    Traceback (most recent call last):
    ValueError: SMPTK_POISON_OUTPUTS='2': expected one of 1/0, true/false, yes/no, on/off (any case), ...

The named accessors (one per variable of :data:`VARIABLES`), the parsers they share, and the table::

    >>> os.environ["SMPTK_COMM_MAX_SMS"] = " 4 "
    >>> os.environ["SMPTK_GEMM_PATH"] = "TMA"
    >>> comm_max_sms(), gemm_path()
    (4, 'tma')
    >>> del os.environ["SMPTK_COMM_MAX_SMS"], os.environ["SMPTK_GEMM_PATH"]
    >>> comm_max_sms(), gemm_path()                         # unset: the defaults
    (8, 'auto')
    >>> os.environ["MY_TOOL_STEPS"] = "12"
    >>> integer("MY_TOOL_STEPS", None, low=1), flag("MY_TOOL_UNSET", True)
    (12, True)
    >>> del os.environ["MY_TOOL_STEPS"]
    >>> snapshot()["SMPTK_GEMM_PATH"]["value"]
    'auto'
"""

from __future__ import annotations

import dataclasses
import os

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
# Triton's getenv_bool (triton/_C/libtriton): lower-cased, not stripped; anything else is false.
TRITON_TRUE_WORDS = ("1", "true", "yes", "on", "y")

KERNEL_PATHS = ("auto", "triton", "torch")
GEMM_PATHS = ("auto", "tma", "pointer")
COMM_COPY_PATHS = ("pointer", "tma")
BENCH_MODES = ("measure", "quick")


def _raw(name: str) -> str | None:
    """The variable's value stripped of whitespace, or None when it is unset or blank."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def flag(name: str, default: bool) -> bool:
    """A boolean variable: 1/0, true/false, yes/no, on/off (any case); unset or empty gives ``default``."""
    value = _raw(name)
    if value is None:
        return default
    word = value.lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(
        f"{name}={os.environ[name]!r}: expected one of 1/0, true/false, yes/no, on/off (any case), "
        f"or empty for the default ({default})"
    )


def integer(
    name: str, default: int | None, *, low: int | None = None, high: int | None = None, multiple: int = 1
) -> int | None:
    """An integer variable (in ``[low, high]`` where given, a multiple of ``multiple``); unset or empty
    gives ``default``."""
    value = _raw(name)
    if value is None:
        return default
    try:
        out = int(value)
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r}: expected an integer") from None
    if (low is not None and out < low) or (high is not None and out > high) or out % multiple:
        wanted = [f">= {low}"] if low is not None else []
        wanted += [f"<= {high}"] if high is not None else []
        wanted += [f"a multiple of {multiple}"] if multiple != 1 else []
        raise ValueError(f"{name}={os.environ[name]!r}: expected an integer {', '.join(wanted)}")
    return out


def number(
    name: str, default: float | None, *, positive: bool = False, high: float | None = None
) -> float | None:
    """A real-number variable (finite and > 0 with ``positive``, at most ``high`` where given); unset or
    empty gives ``default``."""
    value = _raw(name)
    if value is None:
        return default
    try:
        out = float(value)
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r}: expected a number") from None
    if positive and not 0 < out < float("inf"):
        raise ValueError(f"{name}={os.environ[name]!r}: expected a finite number > 0")
    if high is not None and not out <= high:
        raise ValueError(f"{name}={os.environ[name]!r}: expected a number <= {high:g}")
    return out


def choice(name: str, default: str | None, choices: tuple[str, ...]) -> str | None:
    """One of ``choices`` (lower-case words; the value is matched in any case); unset or empty gives
    ``default``. The error names the value lower-cased and stripped, as it was compared."""
    value = _raw(name)
    if value is None:
        return default
    word = value.lower()
    if word not in choices:
        expected = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name}={word!r}: expected one of {expected}")
    return word


def text(name: str, default: str | None) -> str | None:
    """A free-form variable (a path, an id), stripped; unset or empty gives ``default``."""
    value = _raw(name)
    return default if value is None else value


def _triton_flag(name: str, default: bool) -> bool:
    """A boolean read the way Triton reads its own variables (see the module docstring)."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.lower() in TRITON_TRUE_WORDS


@dataclasses.dataclass(frozen=True)
class Variable:
    """One environment variable: its kind ("flag", "integer", "number", "choice", "text", "path" or
    "triton flag"), its default (None: decided elsewhere, e.g. by whether CUDA is present), what it does,
    and for choices the accepted words."""

    name: str
    kind: str
    default: object
    meaning: str
    choices: tuple[str, ...] = ()
    low: int | None = None
    high: float | None = None  # integers and numbers: the largest value accepted
    multiple: int = 1  # integers: a multiple of this
    positive: bool = False

    def read(self) -> object:
        """The current value, parsed; raises ``ValueError`` on a value the kind does not accept."""
        if self.kind == "flag":
            return flag(self.name, self.default)
        if self.kind == "integer":
            return integer(self.name, self.default, low=self.low, high=self.high, multiple=self.multiple)
        if self.kind == "number":
            return number(self.name, self.default, positive=self.positive, high=self.high)
        if self.kind == "choice":
            return choice(self.name, self.default, self.choices)
        if self.kind in ("text", "path"):
            return text(self.name, self.default)
        if self.kind == "triton flag":
            return _triton_flag(self.name, self.default)
        raise AssertionError(f"unknown kind {self.kind!r} of {self.name}")


_TABLE = (
    # kernels
    Variable("SMPTK_KERNELS", "choice", "auto", "kernel ops: auto (Triton where it can run, else PyTorch), "
             "triton (forced; an error where it cannot run) or torch; read at every call",
             choices=KERNEL_PATHS),
    Variable("TRITON_INTERPRET", "triton flag", False, "Triton's interpreter (kernels on CPU tensors); "
             "Triton reads it when smptk.kernels is imported, so set it before that"),
    Variable("SMPTK_INTERPRETER_FAST_CALLS", "flag", True, "under TRITON_INTERPRET, skip Triton's "
             "re-patching of triton.language at every @jit helper call inside a running kernel (see "
             "smptk.kernels._triton); off: Triton's interpreter exactly as shipped. Read once, when smptk "
             "first imports triton (a later change is not seen)"),
    Variable("SMPTK_GEMM_PATH", "choice", "auto", "GEMM engine's main loop: auto (TMA where the GPU and "
             "shapes allow), tma or pointer (plain pointer loads)", choices=GEMM_PATHS),
    Variable("SMPTK_AUTOTUNE", "flag", True, "GEMM launches autotune their block sizes on CUDA "
             "(off: the first config, no tuning runs)"),
    Variable("SMPTK_POISON_OUTPUTS", "flag", False, "launchers fill each buffer they allocate with NaN "
             "first, so an element a kernel never writes shows up (tests)"),
    Variable("SMPTK_CHECK_OFFSETS", "flag", False, "grouped GEMMs check the expert offsets' values on "
             "CUDA too (one host sync per call; on CPU they are always checked)"),
    # comm (read once per process, on first use; smptk.comm.configure overrides them, and a variable it
    # replaces before that first use is not read). The ranges are smptk.comm's (high=256:
    # smptk.kernels.heap_layout.MAX_PROGRAMS; 1e6 s: the kernels' int64-nanosecond budget).
    Variable("SMPTK_COMM_MAX_SMS", "integer", 8, "programs (SMs) per collective launch (1..256); read once, "
             "on first use", low=1, high=256),
    Variable("SMPTK_COMM_TIMEOUT_S", "number", 300.0, "seconds one collective kernel launch (a chunk of at "
             "most SMPTK_COMM_HEAP_BYTES) may take, from its start, before it stops waiting on a peer "
             "(at most 1e6); read once, on first use", positive=True, high=1e6),
    Variable("SMPTK_COMM_HEAP_BYTES", "integer", 64 * 1024 * 1024, "symmetric heap bytes per rank (a "
             "multiple of 16, >= 4096); read once, on first use", low=4096, multiple=16),
    Variable("SMPTK_COMM_SYNC_CHECK", "flag", False, "on CUDA, check each collective's status at the end "
             "of every call (one host sync)"),
    Variable("SMPTK_COMM_COPY_PATH", "choice", "pointer", "collectives' loads: pointer (128-bit loads, one "
             "tile in flight a program) or tma (copies, and reductions at 2, 4 and 8 ranks, load through TMA "
             "descriptors, pipelined over shared memory, where the GPU has TMA (sm_90+) and under the "
             "interpreter; unmeasured on a GPU so far)",
             choices=COMM_COPY_PATHS),
    # tests and benchmarks
    Variable("SMPTK_COMPILE_ALL", "flag", False, "kernel compile test: the full variant table, not the "
             "quick set"),
    Variable("SMPTK_COMPILE_JOBS", "integer", None, "kernel compile test: worker processes (default: "
             "every usable CPU)", low=1),
    Variable("SMPTK_BENCH_MODE", "choice", None, "benchmarks: measure or quick (default: measure with "
             "CUDA, quick without)", choices=BENCH_MODES),
    Variable("SMPTK_BENCH_ROUNDS", "integer", None, "benchmarks: timed rounds (default by mode)", low=1),
    Variable("SMPTK_BENCH_WARMUP", "integer", None, "benchmarks: warm-up rounds (default by mode)", low=0),
    Variable("SMPTK_BENCH_JSONL", "path", None, "benchmarks: file rows are appended to"),
    Variable("SMPTK_BENCH_RUN_ID", "text", None, "benchmarks: this run's id (python -m bench sets it)"),
    Variable("SMPTK_BENCH_COMM_DIST_TIMEOUT_S", "number", None, "benchmarks: time limit of the torchrun "
             "comm suite (default by mode)", positive=True),
    Variable("SMPTK_BENCH_TP_DIST_TIMEOUT_S", "number", None, "benchmarks: time limit of the torchrun "
             "tensor-parallel suite (default by mode)", positive=True),
    Variable("SMPTK_GPU_CHECK", "path", None, "bench/gpu_check.py: the JSON a gpu-check run passes to its "
             "child pytest processes (log file, deadline); set by the parent"),
    Variable("SMPTK_TORCH_SPEC", "text", None, "make: the torch requirement scripts/bootstrap.py installs "
             "in the venv where torch is missing (default: torch==2.13.0, set in that script)"),
)  # fmt: skip
VARIABLES: dict[str, Variable] = {v.name: v for v in _TABLE}


def _read(name: str) -> object:
    return VARIABLES[name].read()


def snapshot() -> dict[str, dict[str, object]]:
    """Every variable's current value, for ``smptk info``; never raises.

    Returns ``{name: {"value": the parsed value, or "error: ..." for a bad one, "set": whether the
    environment gives a non-blank value, "meaning": str}}``.
    """
    out: dict[str, dict[str, object]] = {}
    for name, var in VARIABLES.items():
        try:
            value = var.read()
        except ValueError as exc:
            value = f"error: {exc}"
        out[name] = {"value": value, "set": _raw(name) is not None, "meaning": var.meaning}
    return out


# --- named accessors ------------------------------------------------------------------------------------


def kernels() -> str:
    """``SMPTK_KERNELS``: "auto", "triton" or "torch" (see :mod:`smptk.kernels.runtime`)."""
    return _read("SMPTK_KERNELS")


def triton_interpret() -> bool:
    """``TRITON_INTERPRET`` as Triton reads it: whether kernels are (or would be) interpreted."""
    return _read("TRITON_INTERPRET")


def interpreter_fast_calls() -> bool:
    """``SMPTK_INTERPRETER_FAST_CALLS``: skip the interpreter's re-patching at helper calls (default True)."""
    return _read("SMPTK_INTERPRETER_FAST_CALLS")


def gemm_path() -> str:
    """``SMPTK_GEMM_PATH``: "auto", "tma" or "pointer", the GEMM engine's main-loop variant."""
    return _read("SMPTK_GEMM_PATH")


def autotune() -> bool:
    """``SMPTK_AUTOTUNE``: whether GEMM launches autotune on CUDA (default True)."""
    return _read("SMPTK_AUTOTUNE")


def poison_outputs() -> bool:
    """``SMPTK_POISON_OUTPUTS``: NaN-fill every buffer a launcher allocates (default False)."""
    return _read("SMPTK_POISON_OUTPUTS")


def check_offsets() -> bool:
    """``SMPTK_CHECK_OFFSETS``: check grouped-GEMM offsets' values on CUDA too (default False)."""
    return _read("SMPTK_CHECK_OFFSETS")


def comm_max_sms() -> int:
    """``SMPTK_COMM_MAX_SMS`` (default 8), in 1..256."""
    return _read("SMPTK_COMM_MAX_SMS")


def comm_timeout_s() -> float:
    """``SMPTK_COMM_TIMEOUT_S`` (default 300), in (0, 1e6]."""
    return _read("SMPTK_COMM_TIMEOUT_S")


def comm_heap_bytes() -> int:
    """``SMPTK_COMM_HEAP_BYTES`` (default 64 MiB), a multiple of 16 of at least 4096."""
    return _read("SMPTK_COMM_HEAP_BYTES")


def comm_copy_path() -> str:
    """``SMPTK_COMM_COPY_PATH``: "pointer" (default) or "tma", how the collectives' copies load."""
    return _read("SMPTK_COMM_COPY_PATH")


def comm_sync_check() -> bool:
    """``SMPTK_COMM_SYNC_CHECK``: on CUDA, a host sync after every collective to check it (default False)."""
    return _read("SMPTK_COMM_SYNC_CHECK")


def compile_all() -> bool:
    """``SMPTK_COMPILE_ALL``: the compile test's full variant table (default False: the quick set)."""
    return _read("SMPTK_COMPILE_ALL")


def compile_jobs() -> int | None:
    """``SMPTK_COMPILE_JOBS``: compile-test workers, >= 1; None means every usable CPU."""
    return _read("SMPTK_COMPILE_JOBS")


def bench_mode() -> str | None:
    """``SMPTK_BENCH_MODE``: "measure", "quick", or None (decided by whether CUDA is present)."""
    return _read("SMPTK_BENCH_MODE")


def bench_rounds() -> int | None:
    """``SMPTK_BENCH_ROUNDS``: timed rounds, >= 1; None means the mode's default."""
    return _read("SMPTK_BENCH_ROUNDS")


def bench_warmup() -> int | None:
    """``SMPTK_BENCH_WARMUP``: warm-up rounds, >= 0; None means the mode's default."""
    return _read("SMPTK_BENCH_WARMUP")


def bench_jsonl() -> str | None:
    """``SMPTK_BENCH_JSONL``: the file benchmark rows are appended to, or None."""
    return _read("SMPTK_BENCH_JSONL")


def bench_run_id() -> str | None:
    """``SMPTK_BENCH_RUN_ID``: the benchmark run's id, or None (a new one is made)."""
    return _read("SMPTK_BENCH_RUN_ID")


def bench_comm_dist_timeout_s() -> float | None:
    """``SMPTK_BENCH_COMM_DIST_TIMEOUT_S``: seconds, > 0; None means the mode's default."""
    return _read("SMPTK_BENCH_COMM_DIST_TIMEOUT_S")


def bench_tp_dist_timeout_s() -> float | None:
    """``SMPTK_BENCH_TP_DIST_TIMEOUT_S``: seconds, > 0; None means the mode's default."""
    return _read("SMPTK_BENCH_TP_DIST_TIMEOUT_S")


def gpu_check() -> str | None:
    """``SMPTK_GPU_CHECK``: the gpu-check plugin's JSON configuration, or None outside a gpu-check child."""
    return _read("SMPTK_GPU_CHECK")


def torch_spec() -> str | None:
    """``SMPTK_TORCH_SPEC``: the torch requirement ``make`` installs, or None for scripts/bootstrap.py's."""
    return _read("SMPTK_TORCH_SPEC")
