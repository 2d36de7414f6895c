"""smptk: a Triton-kernel-centric toolkit for training large PyTorch models across many GPUs.

Subpackages (imports go one way: kernels <- comm <- parallel):

- :mod:`smptk.kernels`: single-device Triton kernels with autograd (``fused_linear``, ``swiglu``).
- :mod:`smptk.comm`: low-SM collectives over symmetric memory.
- :mod:`smptk.parallel`: parallel configuration and layers.
- :mod:`smptk.testing`: fp32 references and tolerance tables shared by tests and benchmarks.
- :mod:`smptk.settings`: every ``SMPTK_*`` environment variable, its meaning and its one parser.

``import smptk`` imports no subpackage; each loads on first attribute access, so the package imports on
any machine (no GPU, no driver) and CUDA-only code is touched only when used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBPACKAGES = ("kernels", "comm", "parallel", "testing", "settings")
__all__ = ["__version__", *_SUBPACKAGES]


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"smptk.{name}")
    raise AttributeError(f"module 'smptk' has no attribute {name!r}")
