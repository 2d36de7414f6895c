"""GPU time for pytest-benchmark: a CUDA-event clock, L2 flushing, and the statistics a row reports.

How a round is timed (``benchmark.pedantic(target, setup=..., rounds=R, warmup_rounds=W)``)
-------------------------------------------------------------------------------------------
pytest-benchmark 5.x times one pedantic round as ``start = timer(); target(); end = timer()`` and stores
``end - start`` (``BenchmarkFixture._make_runner``); the timer comes from the ``benchmark`` marker's
``timer=`` keyword. :data:`CLOCK` is that timer. On CUDA its calls alternate:

- the **start** call records a CUDA event on the current stream and returns 0.0, *without*
  synchronizing;
- the **stop** call records a second event, synchronizes on it and returns the GPU time between the two
  events in seconds.

So ``end - start`` is the GPU time of the work enqueued between the two events. The start call does not
synchronize on purpose: an event recorded on an idle GPU is stamped at once, and the interval would then
also hold the host's time to launch the first kernel (Python checks, Triton's launcher, torch.compile's
guards: 10-100 us, which is 5-50% of a 0.2 ms GEMM). Instead the untimed setup leaves the GPU busy
(:meth:`L2Flusher.flush` writes a 256 MiB buffer, then a short spin kernel runs), so the host enqueues the
target while the GPU is still working and the interval holds GPU work only. If the host is slower than
that, the gap shows up in the measurement, as it would in a real training step.

Use the clock with ``benchmark.pedantic`` only: it relies on pytest-benchmark calling it in start/stop
pairs, which pedantic's runner does (warm-up rounds included). :meth:`BenchClock.reset` clears a pair
left open by a failed round; the bench conftest calls it before every test.

On a CPU (quick mode) the clock is the host's ``time.perf_counter`` and rows say ``timer: host``.

Example::

    >>> CLOCK.use("cuda")
    >>> start = CLOCK(); y = x @ w.T; end = CLOCK()
    >>> end - start  # GPU seconds between the two events
    0.000213
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

L2_FLUSH_BYTES = 256 * 1024 * 1024  # > 5x the 50 MiB L2 of an H100; also covers the 126 MiB of a B200
SPIN_US = 200  # GPU busy time left after the flush so the host can enqueue the target; see module doc
_FALLBACK_SM_HZ = 1.98e9  # H100 SXM max boost clock; only used when torch does not report clock_rate


class BenchClock:
    """pytest-benchmark timer: CUDA-event pairs on CUDA, ``time.perf_counter`` elsewhere.

    Example::

        >>> clock = BenchClock()
        >>> clock.use("cpu")
        >>> clock.kind
        'host'
    """

    __name__ = "BenchClock"

    def __init__(self) -> None:
        self.kind = "host"
        self._start: Any = None

    def use(self, device: str) -> None:
        """Time work on ``device`` ("cuda" or "cpu") from the next call on; clears an open pair."""
        self.kind = "cuda_event" if device == "cuda" else "host"
        self._start = None

    def reset(self) -> None:
        """Forget a start event whose stop never came (a round that raised)."""
        self._start = None

    def __call__(self) -> float:
        if self.kind == "host":
            return time.perf_counter()
        if self._start is None:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
            return 0.0
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        stop.synchronize()
        start, self._start = self._start, None
        return start.elapsed_time(stop) / 1e3  # elapsed_time is in milliseconds

    def __repr__(self) -> str:
        return f"bench.timing.BenchClock({self.kind})"


CLOCK = BenchClock()


class L2Flusher:
    """Evicts the GPU's L2 before each round by writing a buffer larger than it, then keeps the GPU busy.

    ``flush()`` is meant for pedantic's untimed ``setup``: it only enqueues work (no sync). On a CPU it
    does nothing (quick mode is not a measurement, and the host caches are not what is being studied);
    ``nbytes`` is 0 there so rows say so.

    Example::

        >>> flusher = L2Flusher("cuda")
        >>> flusher.flush()  # enqueues a 256 MiB memset and a 200 us spin kernel
    """

    def __init__(self, device: str, nbytes: int = L2_FLUSH_BYTES, spin_us: float = SPIN_US) -> None:
        self.device = device
        self.nbytes = nbytes if device == "cuda" else 0
        self._buffer = torch.empty(self.nbytes, dtype=torch.int8, device=device) if self.nbytes else None
        self.spin_us = 0.0
        self._spin_cycles = 0
        if device == "cuda" and hasattr(torch.cuda, "_sleep"):
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            khz = getattr(props, "clock_rate", 0) or _FALLBACK_SM_HZ / 1e3
            self._spin_cycles = int(khz * 1e3 * spin_us * 1e-6)
            self.spin_us = float(spin_us)

    def flush(self) -> None:
        if self._buffer is not None:
            self._buffer.zero_()
        if self._spin_cycles:
            torch.cuda._sleep(self._spin_cycles)

    def release(self) -> None:
        self._buffer = None


def summarize(durations_s: list[float]) -> dict[str, float | int]:
    """Median and spread of per-round durations (seconds): the numbers a row and the report show.

    ``q1``/``q3`` are the inclusive quartiles; ``iqr_rel`` is the IQR over the median.

    Example::

        >>> summarize([1.0, 2.0, 3.0, 4.0])["median"]
        2.5
    """
    if not durations_s:
        raise ValueError("durations_s: expected at least one round, got none")
    data = sorted(float(d) for d in durations_s)
    if len(data) >= 2:
        q1, _, q3 = statistics.quantiles(data, n=4, method="inclusive")
    else:
        q1 = q3 = data[0]
    median = statistics.median(data)
    return {
        "rounds": len(data),
        "median": median,
        "q1": q1,
        "q3": q3,
        "iqr": q3 - q1,
        "iqr_rel": (q3 - q1) / median if median > 0 else 0.0,
        "min": data[0],
        "max": data[-1],
        "mean": statistics.fmean(data),
        "stdev": statistics.stdev(data) if len(data) >= 2 else 0.0,
    }
