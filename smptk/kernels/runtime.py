"""Which implementation a kernel call runs: the Triton kernels or the pure-PyTorch path.

One switch, the environment variable ``SMPTK_KERNELS``, read at every call:

- ``triton``: always the Triton kernels. Needs CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1``
  (Triton's interpreter); anything else is an error rather than a silent fallback.
- ``torch``: always the pure-PyTorch path (runs wherever torch runs; autograd does the backward).
- unset or ``auto`` (default): Triton on CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1``;
  the PyTorch path otherwise. So every public function works on any machine.

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


def _triton_can_run_on(device: torch.device) -> bool:
    if not triton_available():
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreter_enabled())


def select_path(*tensors: torch.Tensor) -> str:
    """Return "triton" or "torch" for a call whose tensor arguments are ``tensors``.

    Raises ``RuntimeError`` when ``SMPTK_KERNELS=triton`` is forced on tensors Triton cannot run on.
    """
    device = tensors[0].device
    requested = requested_path()
    if requested == "torch":
        return "torch"
    runnable = _triton_can_run_on(device)
    if requested == "triton" and not runnable:
        why = (
            "triton is not installed"
            if not triton_available()
            else (f"tensors are on {device}; Triton runs on CUDA, or on CPU with TRITON_INTERPRET=1")
        )
        raise RuntimeError(f"{KERNELS_ENV}=triton but {why}")
    return "triton" if runnable else "torch"


def describe() -> dict[str, str]:
    """What each device type would run now; used by ``smptk info``."""
    requested = requested_path()
    out = {"requested": requested, "interpreter": "on" if interpreter_enabled() else "off"}
    for dev in ("cpu", "cuda"):
        if requested == "torch":
            out[dev] = "torch"
        elif _triton_can_run_on(torch.device(dev)):
            out[dev] = "triton (interpreter)" if interpreter_enabled() else "triton"
        else:
            out[dev] = "torch" if requested == "auto" else "error: triton cannot run here"
    return out
