"""Benchmark: smptk's collective kernels in a single-GPU **simulated world** (issue items 7a and 7c).

Every number here comes from :class:`smptk.comm.simulated.SimulatedWorld`: one rank's kernel, W peer
buffers in one GPU's memory, no peer, no barrier waits; all traffic is local HBM. Every row carries
``world_mode`` saying so ("simulated world: 8 peer buffers in one GPU's memory, one rank's kernel timed;
not a multi-GPU measurement"). The rows say how fast one rank's kernel moves its bytes at a given SM
budget and how much it slows a GEMM sharing the GPU; they are not multi-GPU measurements.

``test_comm_simulated`` (suite "comm_simulated", 7a): bandwidth against the SM budget.
    Collectives {all_reduce_one_shot, all_reduce_two_shot, all_gather, reduce_scatter, all_to_all}
    x max_sms {1, 2, 4, 8, 16, 32}, plus 0 (the copy-engine algorithm) for all_gather and all_to_all,
    x nccl-tests sizes 4 KiB .. 1 GiB at W=8, bf16 (measure mode). Quick
    mode: W in {2, 3}, 4 KiB and 1500 B (750 fp16 elements: no multiple of any block), max_sms
    {1, 2, 4}, fp16. A size is rounded down to whole elements in W equal blocks, as nccl-tests rounds its
    counts (4 KiB at W=3 runs as 4092 B, and the row says 4092). ``size_bytes`` is nccl-tests' size
    (:func:`bench.counts.collective_counts`): the all-reduce buffer, all-gather's output, reduce-scatter's
    input, all-to-all's send buffer. Rows:
    ``algbw_gbps`` = size / median time, ``busbw_gbps`` = algbw x nccl-tests' bus factor,
    ``peer_bytes`` (what one rank reads from its peers' buffers) and ``peer_gbps`` = peer_bytes / median
    (also the row's ``gbps``). Peers' regions and the input hold integers in [-8, 8]; before timing,
    the first call's output is compared element for element with a plain-torch expectation (sums are
    exact in fp32 and in bf16), and the row's ``check`` says so. Each round is one kernel launch, L2
    flushed before it (:class:`bench.timing.L2Flusher`). A case whose rounds would take longer than
    ``CASE_BUDGET_S`` (1 GiB at 1 SM) runs fewer rounds, at least ``MIN_ROUNDS``; the row's ``rounds``
    says how many, and ``rounds_capped`` that it was capped.

    The same cases with ``copy_path="tma"`` (``smptk.comm.configure``; id suffix ``-tma``, row field
    ``copy_path``) beside the default "pointer" ones: every collective at 1, 2, 4 and 8 SMs, 64 and 256 MiB
    (quick mode: all-gather, W=2, 2 SMs, 4 KiB), so one GPU run compares the two copy paths. The targets
    read the default path's rows (bench.targets.DEFAULT_COPY_PATH). Every row carries ``ptx`` (what the
    kernel that ran compiled to: 128-bit and scalar global accesses, registers, local bytes; None on a CPU).

``test_comm_interference`` (suite "comm_interference", 7c): a bf16 8192^3 ``torch.matmul`` timed alone,
    then while a simulated-world collective (each of the five, 64 MiB, W=8) runs at k SMs,
    k in {1, 2, 4, 8, 16, 32}, on a side CUDA stream. How the collective covers the whole GEMM:

    1. The collective's own time ``t_c`` (median of CUDA-event timed calls) and the host's time to
       enqueue one call ``h`` are measured first; the GEMM alone is timed with the same protocol as the
       concurrent rounds (L2 flush + spin, CUDA events).
    2. Each concurrent round (pedantic ``setup``): flush L2 on the main stream; the side stream waits for
       the flush, sleeps ``S_side = 2 h N + 300 us`` (so that all N calls are queued before the first
       starts, and none waits on the host), then runs ``N = ceil((COVER_FACTOR x GEMM alone + 100 us) /
       t_c) + 1`` collective calls back to back, an event after each. The main stream waits until the
       side stream begins its sleep, then sleeps ``S_side + 100 us``, so the GEMM (the timed target)
       starts at least 100 us after the collectives, however late the host enqueued the side's work.
    3. After each round (read at the next round's setup, and after the last), its events prove
       coverage: the first call started before the GEMM started, the last ended after the GEMM ended,
       and the host finished enqueuing before the side sleep ended (so no gaps between calls). A timed
       round without coverage fails the benchmark: no row is written from an uncovered GEMM.

    Rows: ``gemm_alone_s`` / ``time_s`` (concurrent) statistics, ``slowdown`` = concurrent median / alone
    median, ``slowdown_bound`` = 1 + 1.2 k / SM count (``multi_processor_count``) and ``bound_met``;
    ``collective_alone_peer_gbps`` from ``t_c``; ``collective_overlap_peer_gbps``: peer bytes of the calls
    that ran entirely inside the GEMM's window (by their events) over the time they took, summed over
    the timed rounds, None (with ``overlap_gbps_note``) when no call fits inside the GEMM (a call longer
    than the GEMM). Quick mode: a tiny fp16 GEMM (64^3) and a tiny collective (4 KiB, W=2); on a CPU
    they run one after another (no streams), every row's ``concurrency`` says "sequential" and has no
    bound (no SM count): it proves the code runs, not a number. On a GPU, quick mode uses the streams as
    above.

Select with ``-k``: ids read ``comm_simulated-<collective>-W<w>-sms<k>-<size>`` and
``comm_interference-<collective>-W<w>-sms<k>-<size>-gemm<m>``, e.g.
``python -m bench --filter "comm and all_gather and sms8"``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from bench.config import current_mode
from bench.counts import COLLECTIVES, collective_counts, kernel_code_fields, linear_bytes, linear_flops
from bench.timing import _FALLBACK_SM_HZ, CLOCK, summarize
from smptk import comm
from smptk.comm.simulated import SimulatedWorld, world_mode_label

pytestmark = pytest.mark.benchmark(timer=CLOCK, disable_gc=True, warmup=False)

MODE = current_mode()  # bench/conftest.py has already prepared the process (TRITON_INTERPRET on a CPU)
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

if MODE.quick:
    WORLDS = (2, 3)
    SMS = (1, 2, 4)
    SIZES = (4 * KiB, 1500)
    DTYPE = torch.float16
    IF_WORLD, IF_SIZE, IF_GEMM = 2, 4 * KiB, 64
else:
    WORLDS = (8,)
    SMS = (1, 2, 4, 8, 16, 32)
    SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 8 * MiB, 64 * MiB, 256 * MiB, 1 * GiB)
    DTYPE = torch.bfloat16
    IF_WORLD, IF_SIZE, IF_GEMM = 8, 64 * MiB, 8192

CASE_BUDGET_S = 30.0  # GPU seconds of timed + warm-up rounds per bandwidth case before rounds are capped
MIN_ROUNDS = 5
COVER_FACTOR = 3.0  # collective work enqueued per round: 3x the GEMM's time alone (plus 100 us)
LEAD_S = 100e-6  # the collectives start this long before the GEMM
VALUE_RANGE = 8  # data are integers in [-8, 8]: sums over 8 ranks stay exact in bf16 (|sum| <= 64)


def size_label(nbytes: int) -> str:
    """``4096`` -> ``4KiB``, ``1 << 30`` -> ``1GiB``, ``1500`` -> ``1500B``."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class CommCase:
    """One bandwidth benchmark: a collective, a world size, an SM budget and an nccl-tests size."""

    collective: str
    world: int
    max_sms: int
    size_bytes: int
    copy_path: str = (
        "pointer"  # smptk.comm.configure(copy_path=...): "tma" cases are an A/B beside the default
    )

    @property
    def id(self) -> str:
        tail = "" if self.copy_path == "pointer" else f"-{self.copy_path}"
        return (
            f"comm_simulated-{self.collective}-W{self.world}-sms{self.max_sms}-{size_label(self.size_bytes)}"
            f"{tail}"
        )

    def fields(self) -> dict[str, Any]:
        """The case as row fields (see :mod:`bench.rows`)."""
        return {
            "suite": "comm_simulated",
            "op": self.collective,
            "impl": "smptk",
            "pass": "simulated",
            "dtype": _dtype_name(DTYPE),
            "world": self.world,
            "max_sms": self.max_sms,
            "size_bytes": self.size_bytes,
            "copy_path": self.copy_path,
            "shape": {"size_bytes": self.size_bytes, "world": self.world, "max_sms": self.max_sms},
            "world_mode": world_mode_label(self.world, MODE.device),
        }


@dataclasses.dataclass(frozen=True)
class InterferenceCase:
    """One interference benchmark: a GEMM alone and beside a collective at ``max_sms`` SMs."""

    collective: str
    world: int
    max_sms: int
    size_bytes: int
    gemm: int  # M = N = K

    @property
    def id(self) -> str:
        return (
            f"comm_interference-{self.collective}-W{self.world}-sms{self.max_sms}-"
            f"{size_label(self.size_bytes)}-gemm{self.gemm}"
        )

    def fields(self) -> dict[str, Any]:
        return {
            "suite": "comm_interference",
            "op": self.collective,
            "impl": "smptk",
            "pass": "beside torch.matmul",
            "dtype": _dtype_name(DTYPE),
            "world": self.world,
            "max_sms": self.max_sms,
            "size_bytes": self.size_bytes,
            "shape": {"M": self.gemm, "K": self.gemm, "N": self.gemm},
            "world_mode": world_mode_label(self.world, MODE.device),
        }


def fit_size(size_bytes: int, world: int) -> int:
    """``size_bytes`` rounded down to whole elements in ``world`` equal blocks (nccl-tests rounds so)."""
    unit = world * DTYPE.itemsize
    return size_bytes - size_bytes % unit


# max_sms 0: the copy-engine algorithm (tensor copies, no SM moving data), for the collectives that have it.
COPY_ENGINE = ("all_gather", "all_to_all")


def _budgets(collective: str) -> tuple[int, ...]:
    return ((0,) if collective in COPY_ENGINE else ()) + SMS


CASES = [
    CommCase(c, w, k, fit_size(s, w)) for c in COLLECTIVES for w in WORLDS for s in SIZES for k in _budgets(c)
]
# copy_path="tma" beside the default, to decide between them: every collective (each stages its input with a
# copy; all-gather, all-to-all and the two-shot all-reduce also copy the peers' data) at the SM budgets and
# sizes the targets read (quick mode: one case, at 2 SMs).
TMA_SMS, TMA_SIZES = ((2,), (4 * KiB,)) if MODE.quick else ((1, 2, 4, 8), (64 * MiB, 256 * MiB))
CASES += [
    CommCase(c, w, k, fit_size(s, w), copy_path="tma")
    for c in (("all_gather",) if MODE.quick else COLLECTIVES)
    for w in WORLDS[:1]
    for s in TMA_SIZES
    for k in TMA_SMS
]
INTERFERENCE_CASES = [
    InterferenceCase(c, IF_WORLD, k, fit_size(IF_SIZE, IF_WORLD), IF_GEMM)
    for c in COLLECTIVES
    for k in _budgets(c)
]


# ----------------------------------------------------------------------------------- shared helpers
def _kernel_path() -> str:
    return "triton (interpreter), SIMULATED=True" if MODE.device == "cpu" else "triton, SIMULATED=True"


def _sync() -> None:
    if MODE.device == "cuda":
        torch.cuda.synchronize()


def _fill(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Integers in [-VALUE_RANGE, VALUE_RANGE], drawn in place (no temporary as large as ``t``)."""
    return t.random_(0, 2 * VALUE_RANGE + 1, generator=gen).sub_(VALUE_RANGE)


def _needed_bytes(kind: str, world: int, size_bytes: int) -> int:
    """GPU memory a bandwidth case needs: regions, input, output, and the check's fp32 temporaries."""
    elem = DTYPE.itemsize
    n_in, n_out = SimulatedWorld.io_numel(kind, world, size_bytes, DTYPE)
    region = -(-(n_in * elem) // 4096) * 4096
    return world * region + (n_in + n_out) * elem + 2 * 4 * max(n_in, n_out)


def _skip_if_too_big(kind: str, world: int, size_bytes: int) -> None:
    if MODE.device != "cuda":
        return
    need = _needed_bytes(kind, world, size_bytes)
    free, total = torch.cuda.mem_get_info()
    if need > 0.9 * free:
        pytest.skip(
            f"needs about {need / GiB:.1f} GiB of GPU memory ({world} regions, input, output, check); "
            f"{free / GiB:.1f} of {total / GiB:.1f} GiB are free"
        )


class World:
    """A SimulatedWorld staged for one collective: peers' regions and the input filled, output allocated."""

    def __init__(self, kind: str, world: int, size_bytes: int, seed: int) -> None:
        self.kind, self.world = kind, world
        self.n_in, self.n_out = SimulatedWorld.io_numel(kind, world, size_bytes, DTYPE)
        heap = -(-(self.n_in * DTYPE.itemsize) // 16) * 16
        self.sim = SimulatedWorld(world, heap, MODE.device)
        gen = torch.Generator(device=MODE.device).manual_seed(seed)
        for q in range(1, world):
            _fill(self.sim.peer_region(q, DTYPE, self.n_in), gen)
        self.x = _fill(torch.empty(self.n_in, dtype=DTYPE, device=MODE.device), gen)
        self.out = torch.empty(self.n_out, dtype=DTYPE, device=MODE.device)

    def call(self, max_sms: int) -> Callable[[], torch.Tensor]:
        sim, kind, x, out = self.sim, self.kind, self.x, self.out
        return lambda: sim.run(kind, x, out, max_sms=max_sms)

    def check(self, max_sms: int) -> dict[str, Any]:
        """Run once into a NaN-poisoned output and compare exactly with the expectation; the row's check.

        ``first_call_s`` in the result is the host time of that call (Triton's JIT included), not the check.
        """
        self.out.fill_(float("nan"))
        _sync()
        t0 = time.perf_counter()
        self.call(max_sms)()
        _sync()
        first_call_s = time.perf_counter() - t0
        mismatches = 0
        for (lo, hi), want in self._expected_blocks():
            mismatches += int((self.out[lo:hi] != want).sum())  # NaN != anything: unwritten counts too
        assert mismatches == 0, (
            f"{self.kind} W={self.world} max_sms={max_sms}: {mismatches} of {self.n_out} output elements "
            "differ from the expected values"
        )
        return {
            "exact": True,
            "elements": self.n_out,
            "mismatches": 0,
            "reference": "plain torch from the peers' regions, fp32 accumulation",
            "first_call_s": first_call_s,
        }

    def _expected_blocks(self):
        """(output range, expected values) pieces of rank 0's output, per the kernels' semantics."""
        kind, world, x = self.kind, self.world, self.x

        def src(q: int) -> torch.Tensor:
            return x if q == 0 else self.sim.peer_region(q, DTYPE, self.n_in)

        def reduced(lo: int, hi: int) -> torch.Tensor:
            acc = x[lo:hi].float()
            for q in range(1, world):
                acc += src(q)[lo:hi].float()
            return acc.to(DTYPE)

        n = self.n_in
        if kind == "all_reduce_one_shot":
            yield (0, n), reduced(0, n)
        elif kind == "all_reduce_two_shot":
            per_vector = 16 // DTYPE.itemsize  # slices: ceil(n / W) rounded up to whole 16-byte vectors
            s = -(-n // (world * per_vector)) * per_vector
            for q in range(world):
                lo, hi = q * s, min((q + 1) * s, n)
                if lo < hi:
                    yield (lo, hi), reduced(lo, hi) if q == 0 else src(q)[lo:hi]
        elif kind == "all_gather":
            for q in range(world):
                yield (q * n, (q + 1) * n), src(q)[:n]
        elif kind == "reduce_scatter":
            yield (0, self.n_out), reduced(0, self.n_out)
        else:  # all_to_all: block q of the output is what rank q staged for rank 0
            seg = n // world
            for q in range(world):
                yield (q * seg, (q + 1) * seg), src(q)[:seg]


# ----------------------------------------------------------------------------------- 7a: bandwidth
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_comm_simulated(benchmark: Any, case: CommCase, l2_flusher: Any, record: Callable[..., Any]) -> None:
    _skip_if_too_big(case.collective, case.world, case.size_bytes)
    before = comm.settings()["copy_path"]
    comm.configure(copy_path=case.copy_path)
    try:
        _bandwidth_case(benchmark, case, l2_flusher, record)
    finally:
        comm.configure(copy_path=before)


def _bandwidth_case(benchmark: Any, case: CommCase, l2_flusher: Any, record: Callable[..., Any]) -> None:
    w = World(case.collective, case.world, case.size_bytes, seed=case.world * 1009 + case.size_bytes % 997)

    check = w.check(case.max_sms)  # first call: Triton JIT, then the exact comparison
    first_call_s = check.pop("first_call_s")
    target = w.call(case.max_sms)

    t0 = time.perf_counter()
    target()
    _sync()
    one_call_s = time.perf_counter() - t0  # host view of one call, to size the rounds
    rounds = MODE.rounds
    capped = one_call_s * (rounds + MODE.warmup_rounds) > CASE_BUDGET_S and rounds > MIN_ROUNDS
    if capped:
        rounds = max(MIN_ROUNDS, int(CASE_BUDGET_S / one_call_s) - MODE.warmup_rounds)

    benchmark.group = f"comm_simulated {case.collective} W={case.world} {size_label(case.size_bytes)}"
    benchmark.pedantic(target, setup=l2_flusher.flush, rounds=rounds, warmup_rounds=MODE.warmup_rounds)

    counts = collective_counts(case.collective, world=case.world, size_bytes=case.size_bytes)
    median = summarize(list(benchmark.stats.stats.data))["median"]
    algbw = case.size_bytes / median / 1e9 if median > 0 else None
    record(
        benchmark,
        flops=0,
        nbytes=counts["peer_bytes"],
        kernel_path=f"{_kernel_path()}, copy_path={case.copy_path}",
        copy_path=case.copy_path,
        check=check,
        first_call_s=first_call_s,
        l2_flush_bytes=l2_flusher.nbytes,
        spin_us=l2_flusher.spin_us,
        programs=case.max_sms,
        algbw_gbps=algbw,
        busbw_factor=counts["busbw_factor"],
        busbw_gbps=algbw * counts["busbw_factor"] if algbw is not None else None,
        peer_bytes=counts["peer_bytes"],
        peer_gbps=counts["peer_bytes"] / median / 1e9 if median > 0 else None,
        rounds_capped=capped,
        **kernel_code_fields(case.collective, case.max_sms),
    )


# ----------------------------------------------------------------------------------- 7c: interference
def _sleep(seconds: float) -> None:
    """A 1-block spin kernel on the current CUDA stream lasting about ``seconds`` at the SM clock."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    khz = getattr(props, "clock_rate", 0) or _FALLBACK_SM_HZ / 1e3
    torch.cuda._sleep(max(1, int(khz * 1e3 * seconds)))


def _time_rounds(
    target: Callable[[], Any], setup: Callable[[], None], rounds: int, warmup: int
) -> list[float]:
    """Per-round durations with :data:`CLOCK`, exactly as pytest-benchmark's pedantic takes them."""
    durations = []
    for i in range(warmup + rounds):
        setup()
        start = CLOCK()
        target()
        stop = CLOCK()
        if i >= warmup:
            durations.append(stop - start)
    return durations


def _collective_time(call: Callable[[], Any], repeats: int = 5) -> tuple[float, float]:
    """(median GPU seconds of one call, median host seconds to enqueue one), on the current stream."""
    gpu, host = [], []
    for _ in range(repeats):
        _sleep(200e-6)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        call()
        host.append(time.perf_counter() - t0)
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b) / 1e3)
    return sorted(gpu)[len(gpu) // 2], sorted(host)[len(host) // 2]


class Overlap:
    """Enqueues the collectives on a side stream before each timed GEMM and checks coverage afterwards."""

    def __init__(self, call: Callable[[], Any], calls: int, side_sleep_s: float, l2_flusher: Any) -> None:
        self.call, self.calls, self.side_sleep_s, self.l2_flusher = call, calls, side_sleep_s, l2_flusher
        self.side = torch.cuda.Stream()
        self.rounds: list[dict[str, Any]] = []
        self._pending: dict[str, Any] | None = None

    def setup(self) -> None:
        self.finish()  # the previous round's events, read here rather than in a pedantic teardown
        main = torch.cuda.current_stream()
        names = ("ref", "flushed", "side_begin", "side_start", "g0", "g1")
        ev = {k: torch.cuda.Event(enable_timing=True) for k in names}
        ev["ref"].record(main)
        self.l2_flusher.flush()
        ev["flushed"].record(main)
        t0 = time.perf_counter()
        with torch.cuda.stream(self.side):
            self.side.wait_event(ev["flushed"])
            ev["side_begin"].record(self.side)
            _sleep(self.side_sleep_s)  # the side stream idles until every call below is queued
        # Main's sleep starts no earlier than the side's (it waits for side_begin), so the GEMM starts at
        # least LEAD_S after the collectives however late the host enqueued the side's sleep. (Started at
        # the flush instead, an H100 run had the side stream start 0.8 ms after the GEMM.)
        main.wait_event(ev["side_begin"])
        _sleep(self.side_sleep_s + LEAD_S)
        with torch.cuda.stream(self.side):
            ev["side_start"].record(self.side)
            ends = []
            for _ in range(self.calls):
                self.call()
                end = torch.cuda.Event(enable_timing=True)
                end.record(self.side)
                ends.append(end)
        enqueue_s = time.perf_counter() - t0
        self._pending = {"ev": ev, "ends": ends, "enqueue_s": enqueue_s}

    def gemm_target(self, gemm: Callable[[], Any]) -> Callable[[], Any]:
        def target() -> Any:
            ev = self._pending["ev"]
            ev["g0"].record()
            y = gemm()
            ev["g1"].record()
            return y

        return target

    def finish(self) -> None:
        """Wait for the last round's collectives and record its coverage (no-op when none is pending)."""
        if self._pending is None:
            return
        self.side.synchronize()
        torch.cuda.current_stream().synchronize()
        p, self._pending = self._pending, None
        ev = p["ev"]
        t = {k: ev["ref"].elapsed_time(e) / 1e3 for k, e in ev.items() if k != "ref"}
        ends = [ev["ref"].elapsed_time(e) / 1e3 for e in p["ends"]]
        starts = [t["side_start"], *ends[:-1]]
        inside = [(s, e) for s, e in zip(starts, ends, strict=True) if s >= t["g0"] and e <= t["g1"]]
        self.rounds.append(
            {
                "covered": t["side_start"] <= t["g0"] and ends[-1] >= t["g1"]
                and p["enqueue_s"] < self.side_sleep_s,
                "lead_s": t["g0"] - t["side_start"],
                "side_begin_after_flush_s": t["side_begin"] - t["flushed"],
                "tail_s": ends[-1] - t["g1"],
                "enqueue_s": p["enqueue_s"],
                "inside_calls": len(inside),
                "inside_s": (inside[-1][1] - inside[0][0]) if inside else 0.0,
            }
        )  # fmt: skip


@pytest.mark.parametrize("case", INTERFERENCE_CASES, ids=[c.id for c in INTERFERENCE_CASES])
def test_comm_interference(
    benchmark: Any, case: InterferenceCase, l2_flusher: Any, record: Callable[..., Any]
) -> None:
    _skip_if_too_big(case.collective, case.world, case.size_bytes)
    w = World(case.collective, case.world, case.size_bytes, seed=case.max_sms)
    check = w.check(case.max_sms)
    first_call_s = check.pop("first_call_s")
    call = w.call(case.max_sms)
    counts = collective_counts(case.collective, world=case.world, size_bytes=case.size_bytes)

    gen = torch.Generator(device=MODE.device).manual_seed(case.gemm)
    a = torch.randn(case.gemm, case.gemm, generator=gen, device=MODE.device).to(DTYPE)
    b = torch.randn(case.gemm, case.gemm, generator=gen, device=MODE.device).to(DTYPE)

    def gemm() -> torch.Tensor:
        return torch.matmul(a, b)

    alone = summarize(_time_rounds(gemm, l2_flusher.flush, MODE.rounds, MODE.warmup_rounds))
    extra: dict[str, Any] = {}
    benchmark.group = f"comm_interference {case.collective} W={case.world} {size_label(case.size_bytes)}"
    if MODE.device == "cuda":
        t_c, h = _collective_time(call)
        calls = math.ceil((COVER_FACTOR * alone["median"] + LEAD_S) / t_c) + 1
        overlap = Overlap(call, calls, side_sleep_s=2 * h * calls + 300e-6, l2_flusher=l2_flusher)
        benchmark.pedantic(
            overlap.gemm_target(gemm),
            setup=overlap.setup,
            rounds=MODE.rounds,
            warmup_rounds=MODE.warmup_rounds,
        )
        overlap.finish()
        timed = overlap.rounds[-MODE.rounds :]
        uncovered = [r for r in timed if not r["covered"]]
        if uncovered:
            pytest.fail(
                f"{len(uncovered)} of {len(timed)} timed rounds were not covered by the collective "
                f"(first: {uncovered[0]}); {calls} calls of {t_c * 1e3:.3f} ms were enqueued"
            )
        inside_calls = sum(r["inside_calls"] for r in timed)
        inside_s = sum(r["inside_s"] for r in timed)
        sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        extra.update(
            concurrency="side CUDA stream, collectives enqueued to cover the whole GEMM",
            collective_calls_per_round=calls,
            collective_alone_s=t_c,
            collective_alone_peer_gbps=counts["peer_bytes"] / t_c / 1e9,
            collective_lead_s=min(r["lead_s"] for r in timed),
            collective_tail_s=min(r["tail_s"] for r in timed),
            collective_calls_inside_gemm=inside_calls,
            collective_overlap_peer_gbps=inside_calls * counts["peer_bytes"] / inside_s / 1e9
            if inside_calls
            else None,
            sm_count=sm_count,
        )
        if not inside_calls:
            extra["overlap_gbps_note"] = (
                f"one collective call ({t_c * 1e3:.3f} ms alone) is longer than the GEMM, so no call ran "
                "entirely inside it: no honest overlap bandwidth"
            )
    else:

        def setup() -> None:
            call()  # a CPU has no streams: the collective runs before the GEMM, not beside it

        benchmark.pedantic(gemm, setup=setup, rounds=MODE.rounds, warmup_rounds=MODE.warmup_rounds)
        sm_count = None
        extra.update(
            concurrency="sequential: a CPU has no streams; the collective runs before each GEMM round",
            collective_overlap_peer_gbps=None,
            overlap_gbps_note="no concurrency on a CPU",
        )
    concurrent = summarize(list(benchmark.stats.stats.data))
    slowdown = concurrent["median"] / alone["median"] if alone["median"] > 0 else None
    # k SMs: the GEMM may lose about their share (x 1.2); the copy engines (k = 0): at most 3%.
    bound = (1.03 if case.max_sms == 0 else 1 + 1.2 * case.max_sms / sm_count) if sm_count else None
    record(
        benchmark,
        flops=linear_flops(m=case.gemm, k=case.gemm, n=case.gemm, backward=False),
        nbytes=linear_bytes(
            m=case.gemm, k=case.gemm, n=case.gemm, elem=DTYPE.itemsize, bias=False, backward=False
        ),
        kernel_path=f"torch.matmul beside {_kernel_path()}",
        check=check,
        first_call_s=first_call_s,
        l2_flush_bytes=l2_flusher.nbytes,
        spin_us=l2_flusher.spin_us,
        programs=case.max_sms,
        peer_bytes=counts["peer_bytes"],
        gemm_alone_s=alone,
        gemm_concurrent_s=concurrent,
        slowdown=slowdown,
        slowdown_bound=bound,
        bound_met=(slowdown <= bound) if (slowdown is not None and bound is not None) else None,
        **extra,
    )
