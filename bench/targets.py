"""The performance targets, one table, and how a run's rows are judged against them.

A :class:`Target` says which rows hold the measurement (``measured``, a :data:`Selector` over row
fields), which row of the same run it is compared with (``baseline``: the fields that change, e.g.
``{"impl": "torch_eager"}``; every other case field must be equal), how the pair becomes one number
(a :class:`Metric`: a speedup, a % of the baseline's TFLOP/s, a field of the row...) and the threshold.
When several rows match (both MoE configs, every interference case), the worst one decides (``best``
for targets that ask for a best case, e.g. the peak peer bandwidth). A new target is a new entry in
:data:`TARGETS`; nothing else changes.

Only rows that are measurements count: kind "measurement", ``mode == "measure"``, no ``note``, a CUDA
device, and for smptk's rows its Triton kernels (not the fallback, not the interpreter); numbers that are
not finite count as missing. A
target with no such row (quick mode, the CPU interpreter, a case skipped, filtered out or not reached in
the time budget, too few GPUs) is "not measured", with the reason. No number is built in: every value
is a ratio or a field of rows of the run being judged.

:func:`evaluate` judges a list of rows; :func:`priority` tells ``bench.gpu_check`` which benchmark cases
the targets need, so that they run first.

Example::

    >>> rows = read_rows(Path("bench/results/nvidia-h100-80gb-hbm3/2026-11-23-ab12cd34.jsonl"))
    >>> results = evaluate(list(rows))   # one run's file; several runs: pass run_id=
    >>> [(r.target.id, r.status) for r in results][:2]
    [('linear.gelu_fwd_vs_eager', 'met'), ('linear.gelu_fwd_vs_matmul', 'not met')]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

Row = dict[str, Any]
# field -> wanted: a value (equal), a tuple (one of), a dict (the field is a dict holding these items),
# or a predicate on the field's value.
Selector = dict[str, Any]

# The fields that name a case: a baseline row equals its measured row on all of them but the overridden.
CASE_KEYS = (
    "suite",
    "op",
    "activation",
    "bias",
    "pass",
    "impl",
    "dtype",
    "shape",
    "config",
    "world",
    "size_bytes",
    "max_sms",
    "collective",
)
MiB = 1 << 20
# The simulated-world targets count the rows of the default copy path (rows from before copy_path existed
# have none); the benchmark's copy_path="tma" rows are an A/B beside them (bench/test_bench_comm.py).
DEFAULT_COPY_PATH = ("pointer", None)


def matches(fields: dict[str, Any], selector: Selector) -> bool:
    """Whether ``fields`` (a row, or a benchmark case's ``fields()``) has everything ``selector`` asks.

    >>> matches({"op": "swiglu", "shape": {"M": 7, "K": 16}}, {"op": ("swiglu",), "shape": {"M": 7}})
    True
    """
    for key, wanted in selector.items():
        value = fields.get(key)
        if callable(wanted):
            ok = value is not None and bool(wanted(value))
        elif isinstance(wanted, tuple):
            ok = value in wanted
        elif isinstance(wanted, dict):
            ok = isinstance(value, dict) and matches(value, wanted)
        else:
            ok = value == wanted
        if not ok:
            return False
    return True


def is_measurement(row: Row) -> bool:
    """A row that may count for a target: a measure-mode measurement with no note, taken on a GPU, and for
    smptk's own rows (``impl`` "smptk...") on its Triton kernels: a row whose ``kernel_path`` says the
    PyTorch fallback or the interpreter ran (``SMPTK_KERNELS=torch`` on a GPU) measured something else.

    >>> is_measurement({"kind": "measurement", "mode": "measure", "device": "cuda", "impl": "smptk",
    ...                 "kernel_path": "torch"})
    False
    """
    if row.get("kind") != "measurement" or row.get("mode") != "measure" or row.get("note"):
        return False
    if row.get("device") != "cuda":
        return False
    path = row.get("kernel_path")
    if str(row.get("impl", "")).startswith("smptk") and isinstance(path, str):
        return not (path.startswith("torch") or "interpreter" in path)
    return True


# ----------------------------------------------------------------------------- metrics
def _finite(value: Any) -> float | None:
    """A JSON number as a float; None for anything else (NaN and infinities included: Python's json reads
    the ``NaN`` / ``Infinity`` literals, and ``min`` / ``max`` would make a verdict depend on row order)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _median(row: Row | None) -> float | None:
    value = _finite(((row or {}).get("time_s") or {}).get("median"))
    return value if value is not None and value > 0 else None


def _num(row: Row | None, key: str) -> float | None:
    return _finite((row or {}).get(key))


def _ms(row: Row) -> str:
    m = _median(row)
    return f"{row.get('impl')} {m * 1e3:.4g} ms" if m else f"{row.get('impl')} (no time)"


def _tflops_text(row: Row) -> str:
    t = _num(row, "tflops")
    return f"{row.get('impl')} {t:.4g} TFLOP/s" if t else f"{row.get('impl')} (no TFLOP/s)"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


@dataclasses.dataclass(frozen=True)
class Metric:
    """How a measured row and its baseline row (None for targets without one) become one number."""

    unit: str  # printed after the value and the threshold: "x", "%", " GB/s"
    value: Callable[[Row, Row | None], float | None]
    measured: Callable[[Row], str]  # what the measured row shows in the table
    baseline: Callable[[Row], str] = lambda row: "—"  # what the baseline row shows


SPEEDUP = Metric("x", lambda r, b: _ratio(_median(b), _median(r)), _ms, _ms)
TFLOPS_PCT = Metric(
    "%",
    lambda r, b: None if (v := _ratio(_num(r, "tflops"), _num(b, "tflops"))) is None else 100 * v,
    _tflops_text,
    _tflops_text,
)
TIME_PCT = Metric(
    "%", lambda r, b: None if (v := _ratio(_median(r), _median(b))) is None else 100 * v, _ms, _ms
)
PEER_GBPS = Metric(
    " GB/s",
    lambda r, b: _num(r, "peer_gbps"),
    lambda r: f"{r.get('op')} {_size(r.get('size_bytes'))} at {r.get('max_sms')} SMs",
)
PEER_GBPS_PER_SM = Metric(
    " GB/s",
    lambda r, b: None if (v := _num(r, "peer_gbps")) is None or not r.get("max_sms") else v / r["max_sms"],
    lambda r: (
        f"{r.get('op')} {_size(r.get('size_bytes'))}: {_num(r, 'peer_gbps') or 0:.4g} GB/s at "
        f"{r.get('max_sms')} SMs"
    ),
)
SLOWDOWN_OVER_BOUND = Metric(
    "x",
    lambda r, b: _ratio(_num(r, "slowdown"), _num(r, "slowdown_bound")),
    lambda r: (
        f"{r.get('op')} at {r.get('max_sms')} SMs: slowdown {_num(r, 'slowdown') or 0:.4g}, "
        f"bound {_num(r, 'slowdown_bound') or 0:.4g}"
    ),
    lambda r: f"GEMM alone {_median({'time_s': r.get('gemm_alone_s')}) or 0:.4g} s",
)


def _size(nbytes: Any) -> str:
    if not isinstance(nbytes, int):
        return str(nbytes)
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


# ----------------------------------------------------------------------------- targets
@dataclasses.dataclass(frozen=True)
class Candidate:
    """One measured row (or group of rows) and the value it gives."""

    value: float
    label: str  # which case: "mixtral fwd+bwd T=16384"
    measured: str
    baseline: str
    test_ids: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Missing:
    """A case a target covers that this run cannot judge (its baseline row is missing, or a field)."""

    label: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Target:
    """One performance target: the rows it reads, how it turns them into a number, the threshold."""

    id: str
    issue: int
    description: str
    measured: Selector
    metric: Metric
    op: str  # ">=" or "<="
    threshold: float
    baseline: Selector | None = None  # fields that differ in the baseline row; the other case keys are equal
    aggregate: str = "worst"  # several candidates: the "worst" or the "best" decides
    min_gpus: int = 1
    # For targets no (measured, baseline) pair expresses: eligible rows -> candidates (and a Missing for
    # each case that cannot be judged), or why there are none.
    candidates: Callable[[Sequence[Row]], list[Candidate | Missing] | str] | None = None
    # Benchmark node ids (substrings) to run early, for suites whose tests are not parametrized by a case.
    bench_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.op not in (">=", "<="):
            raise ValueError(f"{self.id}: op must be '>=' or '<=', got {self.op!r}")
        if self.aggregate not in ("worst", "best"):
            raise ValueError(f"{self.id}: aggregate must be 'worst' or 'best', got {self.aggregate!r}")

    @property
    def threshold_text(self) -> str:
        return f"{self.op} {self.threshold:g}{self.metric.unit}"

    def met(self, value: float) -> bool:
        return value >= self.threshold if self.op == ">=" else value <= self.threshold

    def selectors(self) -> list[Selector]:
        """The measured rows' selector and, when there is one, the baseline rows'."""
        return [self.measured] + ([{**self.measured, **self.baseline}] if self.baseline else [])


def _busbw_vs_nccl(
    rows: Sequence[Row], *, cta_share: float = 1 / 3, copy_engine: bool = False, collectives: tuple = ()
) -> list[Candidate | Missing] | str:
    """Per collective, at the largest size both ran: smptk's best busbw over NCCL's (default communicator).

    SM-kernel rows (``copy_engine`` False) count at ``1 <= max_sms <= cta_share`` x the CTAs NCCL launched
    (``nccl_ctas_observed.max``); with ``copy_engine`` only the 0-SM copy-engine rows count, at any CTA count
    of NCCL's. ``collectives`` limits the collectives judged (empty: all)."""
    nccl = [r for r in rows if r.get("suite") == "comm_dist_nccl" and r.get("nccl_config") == "default"]
    smptk = [
        r
        for r in rows
        if r.get("suite") == "comm_dist_bandwidth"
        and r.get("impl") == "smptk"
        and isinstance(r.get("max_sms"), int)
        and ((r["max_sms"] == 0) if copy_engine else (r["max_sms"] >= 1))
    ]
    if collectives:
        nccl = [r for r in nccl if r.get("collective") in collectives]
    if not nccl or not smptk:
        return "needs comm_dist_bandwidth (smptk) and comm_dist_nccl (default communicator) rows"
    out: list[Candidate] = []
    why: list[Missing] = []
    for coll in sorted({str(r.get("collective")) for r in nccl}):
        sizes = {r.get("size_bytes") for r in smptk if r.get("collective") == coll}
        ours = [r for r in nccl if r.get("collective") == coll and r.get("size_bytes") in sizes]
        if not ours:
            why.append(Missing(coll, "no size that both ran"))
            continue
        ref = max(ours, key=lambda r: r.get("size_bytes") or 0)
        ctas = (ref.get("nccl_ctas_observed") or {}).get("max")
        if not copy_engine and (not isinstance(ctas, int) or ctas < 1):
            why.append(Missing(coll, f"NCCL's CTA count was not observed ({ref.get('nccl_ctas_note')})"))
            continue
        cands = [
            r
            for r in smptk
            if r.get("collective") == coll
            and r.get("size_bytes") == ref.get("size_bytes")
            and (copy_engine or r["max_sms"] <= cta_share * ctas)
            and _num(r, "busbw_gbps")
        ]
        if not cands or not _num(ref, "busbw_gbps"):
            where = "copy-engine row" if copy_engine else f"row at <= {cta_share:.3g} x {ctas} CTAs"
            why.append(Missing(coll, f"no smptk {where}"))
            continue
        best = max(cands, key=lambda r: _num(r, "busbw_gbps") or 0)
        ours_gbps = f"{_num(best, 'busbw_gbps'):.4g} GB/s"
        out.append(
            Candidate(
                value=_num(best, "busbw_gbps") / _num(ref, "busbw_gbps"),
                label=f"{coll} {_size(ref.get('size_bytes'))}",
                measured=f"smptk {best.get('op')} {ours_gbps} at {best['max_sms']} SMs",
                baseline=f"NCCL {_num(ref, 'busbw_gbps'):.4g} GB/s at {ctas or '?'} CTAs",
                test_ids=(str(best.get("test_id")), str(ref.get("test_id"))),
            )
        )
    return [*out, *why] if out else "; ".join(f"{m.label}: {m.reason}" for m in why)


LINEAR_SHAPE = {"M": 16384, "K": 4096, "N": 14336}
GELU = {"suite": "linear", "op": "fused_linear", "activation": "gelu", "shape": LINEAR_SHAPE}
SWIGLU = {"suite": "linear", "op": "swiglu", "shape": LINEAR_SHAPE}
MOE_T = 16384
GROUPED = {"suite": "moe", "op": "grouped_gemm", "config": "mixtral", "tokens": MOE_T, "pass": "fwd"}
LAYER = {"suite": "moe", "op": "moe_layer", "tokens": MOE_T, "pass": "fwd+bwd", "impl": "smptk"}
BF16 = {"dtype": "bfloat16"}

# bench/tp_dist.py: the Llama-3-70B-shaped MLP pair (S=8192, H=8192, F=28672) with sequence parallelism at
# TP = 8 real ranks; the smptk row must have run the fused all-gather GEMM within comm_max_sms = 8. The
# baselines' comm_max_sms is None (torch picks its own SMs).
TP_PAIR = {
    "suite": "tp_dist",
    "op": "tp_mlp_pair",
    "pass": "fwd",
    "config": "sp",
    "world": 8,
    "tp": 8,
    "shape": {"S": 8192, "H": 8192, "F": 28672},
    **BF16,
}
TP_FUSED = {**TP_PAIR, "impl": "smptk_fused", "path": "fused", "comm_max_sms": 8}
# bench/test_bench_tp_sim.py: the same pair and shape in the single-GPU simulated world at TP = 8 (rank 0's
# kernels, its peers' data in the same GPU's memory): the issue's own form of the target, and the one a
# one-GPU machine can measure.
TP_SIM = {**{k: v for k, v in TP_PAIR.items() if k != "suite"}, "suite": "tp_sim"}
PLANNER = {"suite": "planner", "op": "train_step_memory"}
MEMORY_ERROR_PCT = Metric(
    "%",
    lambda r, b: _num(r, "memory_error_pct"),
    lambda r: (
        f"{r.get('config')}: measured {_num(r, 'measured_bytes') or 0:.4g} B, "
        f"predicted {_num(r, 'predicted_bytes') or 0:.4g} B"
    ),
)

TARGETS: tuple[Target, ...] = (
    Target(
        "linear.gelu_fwd_vs_eager",
        9,
        "fused_linear bias+GELU fwd, M=16384 K=4096 N=14336 bf16: speedup over torch_eager",
        {**GELU, **BF16, "pass": "fwd", "impl": "smptk"},
        SPEEDUP,
        ">=",
        1.15,
        baseline={"impl": "torch_eager"},
    ),
    Target(
        "linear.gelu_fwd_vs_matmul",
        9,
        "fused_linear bias+GELU fwd, same shape: TFLOP/s as % of torch_matmul's (x @ w.T alone)",
        {**GELU, **BF16, "pass": "fwd", "impl": "smptk"},
        TFLOPS_PCT,
        ">=",
        90,
        baseline={"impl": "torch_matmul"},
    ),
    Target(
        "linear.gelu_fwd_bwd_vs_eager",
        9,
        "fused_linear bias+GELU fwd+bwd, same shape: speedup over torch_eager",
        {**GELU, **BF16, "pass": "fwd+bwd", "impl": "smptk"},
        SPEEDUP,
        ">=",
        1.1,
        baseline={"impl": "torch_eager"},
    ),
    Target(
        "linear.swiglu_fwd_vs_eager",
        9,
        "swiglu fwd, M=16384 K=4096 N=14336 bf16: speedup over torch_eager",
        {**SWIGLU, **BF16, "pass": "fwd", "impl": "smptk"},
        SPEEDUP,
        ">=",
        1.2,
        baseline={"impl": "torch_eager"},
    ),
    Target(
        "moe.grouped_vs_dense_85",
        9,
        "grouped GEMM fwd (Mixtral-like T=16384: M=32768 K=4096 N=14336 E=8): % of a dense cuBLAS "
        "GEMM's TFLOP/s at equal FLOPs",
        {**GROUPED, "impl": "smptk"},
        TFLOPS_PCT,
        ">=",
        85,
        baseline={"impl": "torch_matmul"},
    ),
    # Before the layer targets: its routing cases must run before the smptk layer rows they share a tier
    # with, so that those rows carry routing_share (bench/test_bench_moe.py reads the routing median).
    Target(
        "moe.routing_share",
        4,
        "MoE route + dispatch + combine as % of the smptk layer's time, T=16384 (both configs and "
        "passes: worst)",
        {"suite": "moe", "op": "moe_routing", "tokens": MOE_T, "impl": "smptk_routing"},
        TIME_PCT,
        "<=",
        10,
        baseline={"op": "moe_layer", "impl": "smptk"},
    ),
    Target(
        "moe.layer_vs_eager_loop",
        4,
        "MoE layer fwd+bwd, T=16384: speedup over the eager per-expert loop (both configs: worst)",
        LAYER,
        SPEEDUP,
        ">=",
        3.0,
        baseline={"impl": "eager_loop"},
    ),
    Target(
        "moe.layer_vs_grouped_mm",
        4,
        "MoE layer fwd+bwd, T=16384: speedup over torch._grouped_mm experts (both configs: worst)",
        LAYER,
        SPEEDUP,
        ">=",
        1.0,
        baseline={"impl": "torch_grouped_mm"},
    ),
    Target(
        "moe.grouped_vs_dense_70",
        4,
        "grouped GEMM fwd (same shape): % of the dense cuBLAS GEMM's TFLOP/s",
        {**GROUPED, "impl": "smptk"},
        TFLOPS_PCT,
        ">=",
        70,
        baseline={"impl": "torch_matmul"},
    ),
    Target(
        "comm.simulated_peer_gbps",
        3,
        "simulated world W=8: peer traffic one rank reads, at 1..8 SMs, sizes >= 64 MiB (best case; the "
        "copy-engine rows, 0 SMs, are local device copies on one GPU and do not count)",
        {
            "suite": "comm_simulated",
            "copy_path": DEFAULT_COPY_PATH,
            "world": 8,
            "max_sms": lambda k: 1 <= k <= 8,
            "size_bytes": lambda n: n >= 64 * MiB,
        },
        PEER_GBPS,
        ">=",
        450,
        aggregate="best",
    ),
    Target(
        "comm.gemm_slowdown",
        3,
        "GEMM slowdown beside a k-SM smptk collective over its bound 1 + 1.2 k / SMs (copy engine, k = 0: "
        "1.03; every case: worst)",
        {"suite": ("comm_interference", "comm_dist_interference"), "impl": "smptk"},
        SLOWDOWN_OVER_BOUND,
        "<=",
        1.0,
        bench_ids=("test_comm_dist[interference]",),
    ),
    Target(
        "comm.busbw_vs_nccl",
        3,
        "busbw over NCCL's (default communicator) at <= 1/3 of the CTAs NCCL launched, largest size, "
        "each collective: worst",
        {"suite": ("comm_dist_bandwidth", "comm_dist_nccl")},
        Metric("x", lambda r, b: None, lambda r: ""),
        ">=",
        1.0,
        min_gpus=2,
        candidates=_busbw_vs_nccl,
        bench_ids=("test_comm_dist[bandwidth]", "test_comm_dist[nccl]"),
    ),
    Target(
        "comm.simulated_gbps_per_sm",
        10,
        "simulated world W=8: peer traffic per SM at 1..8 SMs, sizes >= 64 MiB, every collective (worst)",
        {
            "suite": "comm_simulated",
            "copy_path": DEFAULT_COPY_PATH,
            "world": 8,
            "max_sms": lambda k: 1 <= k <= 8,
            "size_bytes": lambda n: n >= 64 * MiB,
        },
        PEER_GBPS_PER_SM,
        ">=",
        65,
    ),
    *(
        Target(
            f"comm.simulated_{coll}_gbps",
            10,
            f"simulated world W=8: {coll} peer traffic at <= 8 SMs, sizes >= 64 MiB (best case)",
            {
                "suite": "comm_simulated",
                "copy_path": DEFAULT_COPY_PATH,
                "world": 8,
                "op": coll,
                "max_sms": lambda k: 1 <= k <= 8,
                "size_bytes": lambda n: n >= 64 * MiB,
            },
            PEER_GBPS,
            ">=",
            480,
            aggregate="best",
        )
        for coll in ("all_gather", "reduce_scatter")
    ),
    Target(
        "comm.busbw_vs_nccl_same_ctas",
        10,
        "busbw over NCCL's (default communicator) at no more SMs than the CTAs NCCL launched, largest size, "
        "each collective: worst",
        {"suite": ("comm_dist_bandwidth", "comm_dist_nccl")},
        Metric("x", lambda r, b: None, lambda r: ""),
        ">=",
        1.0,
        min_gpus=2,
        candidates=functools.partial(_busbw_vs_nccl, cta_share=1.0),
        bench_ids=("test_comm_dist[bandwidth]", "test_comm_dist[nccl]"),
    ),
    Target(
        "comm.copy_engine_all_gather_vs_nccl",
        10,
        "copy-engine all-gather (0 SMs) busbw over NCCL's (default communicator), largest size",
        {"suite": ("comm_dist_bandwidth", "comm_dist_nccl")},
        Metric("x", lambda r, b: None, lambda r: ""),
        ">=",
        0.9,
        min_gpus=2,
        candidates=functools.partial(_busbw_vs_nccl, copy_engine=True, collectives=("all_gather",)),
        bench_ids=("test_comm_dist[bandwidth]", "test_comm_dist[nccl]"),
    ),
    Target(
        "tp.fused_pair_vs_dtensor",
        11,
        "TP column+row MLP pair fwd with SP at TP=8 (S=8192 H=8192 F=28672 bf16), fused all-gather GEMM "
        "at comm_max_sms=8: speedup over torch DTensor Colwise/Rowwise (non-overlapped)",
        TP_FUSED,
        SPEEDUP,
        ">=",
        1.15,
        baseline={"impl": "torch_dtensor", "path": "dtensor", "comm_max_sms": None},
        min_gpus=8,
        bench_ids=("test_tp_dist",),
    ),
    Target(
        "tp.fused_pair_vs_sequential_sim",
        11,
        "same pair and shape, simulated world (TP=8 on one GPU: one rank's kernels, peers' data in its own "
        "memory), both fused kernels at comm_max_sms=8: speedup over the same rank's non-overlapped torch "
        "path on the same buffers (gather copy, cuBLAS, cuBLAS, sum of the partial blocks)",
        {**TP_SIM, "impl": "smptk_fused", "comm_max_sms": 8},
        SPEEDUP,
        ">=",
        1.15,
        baseline={"impl": "torch_sequential", "comm_max_sms": None},
        bench_ids=("test_tp_sim",),
    ),
    Target(
        "planner.memory_error_1b",
        12,
        "a ~1B Llama-shaped model's training step on one GPU (bf16 FSDP2, AdamW; no, selective and full "
        "checkpointing): |estimate_memory - torch.cuda.max_memory_allocated| / measured, the worst case",
        PLANNER,
        MEMORY_ERROR_PCT,
        "<=",
        10.0,
        bench_ids=("test_planner_memory",),
    ),
    Target(
        "tp.fused_pair_vs_async_tp",
        11,
        "same pair and shape: speedup over torch async TP (symm_mem fused_all_gather_matmul / "
        "fused_matmul_reduce_scatter)",
        TP_FUSED,
        SPEEDUP,
        ">=",
        1.0,
        baseline={"impl": "torch_async_tp", "path": "async_tp", "comm_max_sms": None},
        min_gpus=8,
        bench_ids=("test_tp_dist",),
    ),
)


# ----------------------------------------------------------------------------- evaluation
@dataclasses.dataclass(frozen=True)
class Result:
    """A target judged on one run: status "met", "not met" or "not measured" (then ``reason`` says why)."""

    target: Target
    status: str
    value: float | None = None
    case: str = ""
    measured: str = ""
    baseline: str = ""
    reason: str | None = None
    test_ids: tuple[str, ...] = ()

    @property
    def value_text(self) -> str:
        return "—" if self.value is None else f"{self.value:.4g}{self.target.metric.unit}"

    @property
    def status_text(self) -> str:
        return f"not measured ({self.reason})" if self.status == "not measured" else self.status

    def as_dict(self) -> dict[str, Any]:
        t = self.target
        return {
            "id": t.id,
            "issue": t.issue,
            "target": t.description,
            "status": self.status,
            "value": self.value,
            "value_text": self.value_text,
            "threshold": t.threshold,
            "op": t.op,
            "threshold_text": t.threshold_text,
            "unit": t.metric.unit.strip(),
            "case": self.case,
            "measured": self.measured,
            "baseline": self.baseline,
            "reason": self.reason,
            "test_ids": list(self.test_ids),
        }


def _case_label(row: Row) -> str:
    parts = [row.get("config"), row.get("pass")]
    if row.get("tokens") is not None:
        parts.append(f"T={row['tokens']}")
    return " ".join(str(p) for p in parts if p)


def _same_case(row: Row, other: Row, changed: Iterable[str]) -> bool:
    return all(row.get(k) == other.get(k) for k in CASE_KEYS if k not in changed)


def _why_missing(target: Target, rows: Sequence[Row]) -> str:
    """Why no eligible row matched the measured selector: quick-mode rows, a skipped or failed case, a
    run with no measurement at all, or no row."""
    hits = [r for r in rows if matches(r, target.measured)]
    quick = [r for r in hits if r.get("kind") == "measurement" and not is_measurement(r)]
    if quick:
        return f"only rows that are not measurements: {quick[-1].get('note') or quick[-1].get('mode')}"
    other = [r for r in hits if r.get("kind") in ("skipped", "failed")]
    if other:
        return f"{other[-1]['kind']}: {str(other[-1].get('reason'))[:200]}"
    notes = {r.get("note") for r in rows if r.get("kind") == "measurement" and not is_measurement(r)}
    if rows and not any(is_measurement(r) for r in rows) and notes:
        return f"no measurement in this run: {'; '.join(sorted(str(n) for n in notes))}"
    return "no row in this run: not reached in the time budget, filtered out, or not run"


def _pair_candidates(target: Target, eligible: Sequence[Row]) -> list[Candidate | Missing] | str:
    measured = [r for r in eligible if matches(r, target.measured)]
    if not measured:
        return ""
    out: list[Candidate] = []
    missing: list[Missing] = []
    changed = ", ".join(f"{k}={v}" for k, v in (target.baseline or {}).items())
    no_baseline = f"no baseline row ({changed}) in this run"
    for row in measured:
        base = None
        if target.baseline:
            found = [
                b
                for b in eligible
                if matches(b, target.baseline) and _same_case(row, b, target.baseline) and b is not row
            ]
            if not found:
                missing.append(Missing(_case_label(row), no_baseline))
                continue
            base = found[-1]
        value = target.metric.value(row, base)
        if value is None:
            missing.append(Missing(_case_label(row), "the rows lack the fields this target reads"))
            continue
        out.append(
            Candidate(
                value=value,
                label=_case_label(row),
                measured=target.metric.measured(row),
                baseline=target.metric.baseline(base) if base is not None else "—",
                test_ids=tuple(str(r.get("test_id")) for r in (row, base) if r is not None),
            )
        )
    return [*out, *missing] if out else "; ".join(dict.fromkeys(m.reason for m in missing))


def evaluate_one(target: Target, rows: Sequence[Row], gpu_count: int | None = None) -> Result:
    """Judge ``target`` on ``rows`` (one run's rows); ``gpu_count`` defaults to the rows' env."""
    if gpu_count is None:
        gpu_count = max((len((r.get("env") or {}).get("gpus") or []) for r in rows), default=0)
    if target.min_gpus > 1 and gpu_count < target.min_gpus:
        return Result(
            target, "not measured", reason=f"needs >= {target.min_gpus} GPUs; this run had {gpu_count}"
        )
    eligible = [r for r in rows if is_measurement(r)]
    found = target.candidates(eligible) if target.candidates else _pair_candidates(target, eligible)
    if isinstance(found, str):
        return Result(target, "not measured", reason=found or _why_missing(target, rows))
    judged = [c for c in found if isinstance(c, Candidate)]
    missing = [m for m in found if isinstance(m, Missing)]
    pick = min if (target.aggregate == "worst") == (target.op == ">=") else max
    best = pick(judged, key=lambda c: c.value)
    met = target.met(best.value)
    case = best.label + (f" ({target.aggregate} of {len(judged)})" if len(judged) > 1 else "")
    if missing:
        # The cases left out could only make a worst case worse (a best case better): the verdict of the
        # cases judged stands when it is "not met" for a worst case ("met" for a best case); otherwise the
        # run cannot decide.
        left = "; ".join(f"{m.label}: {m.reason}" for m in missing)
        left = f"{len(missing)} of {len(found)} cases not judged ({left})"
        if met == (target.aggregate == "worst"):
            verdict = "met" if met else "not met"
            return Result(
                target,
                "not measured",
                reason=f"{left}; the {len(judged)} judged give {best.value:.4g}{target.metric.unit} "
                f"({verdict}) at {best.label}",
            )
        case = f"{case}; {left}"
    return Result(
        target,
        "met" if met else "not met",
        value=best.value,
        case=case,
        measured=best.measured,
        baseline=best.baseline,
        test_ids=best.test_ids,
    )


def evaluate(
    rows: Sequence[Row],
    *,
    gpu_count: int | None = None,
    run_id: str | None = None,
    targets: Sequence[Target] = TARGETS,
) -> list[Result]:
    """Every target judged on ``rows`` (only those of ``run_id`` when given), in table order.

    Without ``run_id`` the rows must come from one run: a case and its baseline are compared only within
    a run (a ValueError names the runs found otherwise).
    """
    if run_id is not None:
        rows = [r for r in rows if r.get("run_id") == run_id]
    else:
        runs = sorted({str(r.get("run_id")) for r in rows})
        if len(runs) > 1:
            raise ValueError(
                f"rows from {len(runs)} runs ({', '.join(runs)}): pass run_id= to judge one of them"
            )
    return [evaluate_one(t, rows, gpu_count) for t in targets]


TABLE_COLUMNS = ("issue", "target", "measured", "baseline (same run)", "threshold", "status")


def table_cells(target: dict[str, Any]) -> tuple[str, ...]:
    """A judged target (:meth:`bench.targets.Result.as_dict`, as ``<stem>.targets.json`` stores it) as the
    targets table's cells, in :data:`TABLE_COLUMNS` order: ``make gpu-check``'s table and the report's."""
    value = target.get("value")
    measured = (
        "—"
        if value is None
        else f"{target.get('value_text')} ({target.get('case')}: {target.get('measured')})"
    )
    status = str(target.get("status"))
    if status == "not measured":
        status = f"not measured ({target.get('reason')})"
    return (
        str(target.get("issue")),
        str(target.get("id")),
        measured,
        target.get("baseline") or "—",
        str(target.get("threshold_text")),
        status,
    )


def markdown_table(targets: Sequence[Target] = TARGETS) -> str:
    """The targets as the README lists them (a test keeps that list equal to this one).

    >>> print(markdown_table(TARGETS[:1]).splitlines()[-1][:60])
    | `linear.gelu_fwd_vs_eager` | >= 1.15x | fused_linear bias+
    """
    rows = ["| target | threshold | what is measured |", "| --- | --- | --- |"]
    rows += [f"| `{t.id}` | {t.threshold_text} | {t.description.replace('|', '/')} |" for t in targets]
    return "\n".join(rows)


def priority(fields: dict[str, Any] | None, nodeid: str, targets: Sequence[Target] = TARGETS) -> int:
    """The index of the first target that needs this benchmark case (``len(targets)`` when none does).

    ``fields`` are the case's row fields (``case.fields()``), None for tests without a case. A case on
    another copy path (``copy_path="tma"``, the A/B beside the default) ranks with its default-path twin, so
    a GPU run with little time still compares the two where the targets look.
    """
    if fields is not None and fields.get("copy_path") not in DEFAULT_COPY_PATH:
        fields = {**fields, "copy_path": DEFAULT_COPY_PATH[0]}
    for i, target in enumerate(targets):
        if fields is not None and any(matches(fields, s) for s in target.selectors()):
            return i
        if any(b in nodeid for b in target.bench_ids):
            return i
    return len(targets)
