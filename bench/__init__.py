"""smptk benchmark suite: pytest-benchmark tests timed with CUDA events, written as JSON lines + HTML.

Run it with ``make bench`` / ``python -m bench`` (see :mod:`bench.__main__`), or as plain pytest:
``pytest bench --benchmark-json=out.json``.

Modules:

- :mod:`bench.config`: measure mode (GPU, LLM shapes, bf16) or quick mode (CPU interpreter or
  ``--quick``: tiny shapes, functional only), chosen before ``smptk.kernels`` is imported.
- :mod:`bench.timing`: the CUDA-event clock handed to pytest-benchmark, L2 flushing, statistics.
- :mod:`bench.counts`: analytic FLOP and byte counts.
- :mod:`bench.rows`: the JSON-lines row schema and writer.
- :mod:`bench.report`: the self-contained HTML report (tables + inline SVG).
- :mod:`bench.progress`: the progress display plugin used by ``python -m bench``.
- :mod:`bench.targets`: the performance targets table and how a run's rows are judged against it.
- :mod:`bench.gpu_check`: ``make gpu-check``: GPU tests, every suite (targets' cases first) and the targets
  table within one time budget.
- ``test_bench_*.py``: the suites (first one: :mod:`bench.test_bench_linear`).

Nothing in this package imports ``smptk.kernels`` at import time: on a CPU, ``TRITON_INTERPRET=1`` has to
be set first (:func:`bench.config.prepare_process` does it).
"""
