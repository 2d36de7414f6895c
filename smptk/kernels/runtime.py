"""Which implementation a kernel call runs: the Triton kernels or the pure-PyTorch path.

One switch, the environment variable ``SMPTK_KERNELS``, read at every call:

- ``triton``: always the Triton kernels. Needs CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1``
  (Triton's interpreter); anything else is an error rather than a silent fallback.
- ``torch``: always the pure-PyTorch path (runs wherever torch runs; autograd does the backward).
- unset or ``auto`` (default): Triton on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1``;
  the PyTorch path otherwise. So every public function works on any machine.

One exception: Triton's interpreter computes ``tl.dot`` on bfloat16 inputs wrongly (seen with Triton 3.9:
results off by orders of magnitude), so bf16 CPU tensors take the PyTorch path under ``auto`` and are an
error under ``triton``; bf16 runs on Triton on CUDA.

``TRITON_INTERPRET`` itself is read by Triton when a kernel module is imported, so set it before
``import smptk.kernels``.

Example::

    >>> from smptk.kernels import runtime
    >>> runtime.select_path(torch.empty(2, device="cpu"))  # no interpreter, CPU tensor
    'torch'
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

KERNELS_ENV = "SMPTK_KERNELS"
PATHS = ("triton", "torch")


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to interpret kernels on the host."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package is installed (it is on Linux; elsewhere only the torch path runs)."""
    return importlib.util.find_spec("triton") is not None


def requested_path() -> str:
    """The value of ``SMPTK_KERNELS`` ("triton", "torch" or "auto"), validated."""
    value = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if value not in (*PATHS, "auto"):
        raise ValueError(f"{KERNELS_ENV}={value!r}: expected one of 'triton', 'torch' or 'auto'")
    return value


def _triton_blocker(device: torch.device, dtype: torch.dtype | None = None) -> str | None:
    """Why the Triton kernels cannot run on ``device`` / ``dtype`` here, or None when they can."""
    if not triton_available():
        return "triton is not installed"
    if device.type == "cuda":
        return None
    if device.type != "cpu" or not interpreter_enabled():
        return f"tensors are on {device}; Triton runs on CUDA, or on CPU with TRITON_INTERPRET=1"
    if dtype == torch.bfloat16:
        return "Triton's interpreter computes bf16 tl.dot wrongly; use float16/float32 on CPU, or CUDA"
    return None


def select_path(*tensors: torch.Tensor) -> str:
    """Return "triton" or "torch" for a call whose tensor arguments are ``tensors``.

    Raises ``RuntimeError`` when ``SMPTK_KERNELS=triton`` is forced on tensors Triton cannot run on.
    """
    requested = requested_path()
    if requested == "torch":
        return "torch"
    blocker = _triton_blocker(tensors[0].device, tensors[0].dtype)
    if requested == "triton" and blocker is not None:
        raise RuntimeError(f"{KERNELS_ENV}=triton but {blocker}")
    return "triton" if blocker is None else "torch"


def describe() -> dict[str, str]:
    """What each device type would run now; used by ``smptk info``."""
    requested = requested_path()
    out = {"requested": requested, "interpreter": "on" if interpreter_enabled() else "off"}
    for dev in ("cpu", "cuda"):
        if requested == "torch":
            out[dev] = "torch"
        elif _triton_blocker(torch.device(dev)) is None:
            if not interpreter_enabled():
                out[dev] = "triton"
            else:
                out[dev] = (
                    "triton (interpreter)" if dev == "cuda" else "triton (interpreter; bfloat16: torch)"
                )
        else:
            out[dev] = "torch" if requested == "auto" else "error: triton cannot run here"
    return out
