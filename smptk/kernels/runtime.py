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

``TRITON_INTERPRET`` itself is read by Triton when triton is imported and when a kernel module is, which
smptk does on the first call that takes the Triton path (:mod:`smptk.kernels._triton`: ``import
smptk.kernels`` imports no triton; other code may import it earlier), so set it before triton is imported.
Setting it afterwards cannot turn compiled kernels into interpreted ones, so a CPU call that would take the
Triton path then raises ``RuntimeError`` saying so, instead of Triton's "0 active drivers" crash; the
state at triton's import is :func:`interpreter_at_import`.

Tensors on the ``meta`` device (shape propagation, delayed initialization) always take the PyTorch path,
under ``SMPTK_KERNELS=triton`` too: there is nothing to compute, only shapes to propagate, and a process
that forces Triton for training must still be able to build and trace its model on meta.

DTensor arguments take the PyTorch path under ``auto``: its ops go through DTensor's sharding propagation,
so the result is the DTensor the same torch code would give. A Triton kernel sees only memory, so it would
compute on one rank's shard as if it were the whole tensor; under ``SMPTK_KERNELS=triton`` a DTensor is an
error that says to pass local shards (``.to_local()``) or use :mod:`smptk.parallel`'s layers, which do.

Under a ``torch.func`` transform (``grad``, ``vjp``, ``vmap``, ``jvp``, ``jacrev``, ...) and for arguments
that carry a forward-mode AD tangent (``torch.autograd.forward_ad``), calls take the PyTorch path under
``auto``: the Triton ops' autograd Functions define no vmap or jvp rule, so torch would refuse them with an
error about ``setup_context`` or ``jvp`` that names none of smptk's ops, while torch's own ops support every
transform. Under ``triton`` these calls are an error that says so.

Without Triton installed (:func:`triton_available` false) every call takes the PyTorch path under ``auto``
and is an error under ``triton``. Nothing here imports triton: availability is a look-up in the import
system, so choosing the PyTorch path never loads it.

Example (one process; it sets ``SMPTK_KERNELS`` and ``TRITON_INTERPRET`` for the rest of it)::

    >>> import os
    >>> import torch
    >>> from smptk.kernels import runtime
    >>> os.environ["SMPTK_KERNELS"] = "auto"
    >>> os.environ["TRITON_INTERPRET"] = "0"
    >>> runtime.select_path(torch.empty(2, device="cpu"))   # no interpreter, CPU tensor
    'torch'
    >>> runtime.select_path(torch.empty(2, device="meta"))  # meta: always the PyTorch path
    'torch'
    >>> os.environ["SMPTK_KERNELS"] = "triton"
    >>> runtime.select_path(torch.empty(2, device="cpu"))
    Traceback (most recent call last):
    RuntimeError: SMPTK_KERNELS=triton but tensors are on cpu; Triton runs on CUDA, or on CPU with ...
    >>> del os.environ["SMPTK_KERNELS"], os.environ["TRITON_INTERPRET"]
"""

from __future__ import annotations

import sys

import torch
from torch.autograd import forward_ad

from smptk import settings
from smptk.kernels import _triton

KERNELS_ENV = "SMPTK_KERNELS"
PATHS = ("triton", "torch")


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET`` asks Triton to interpret kernels on the host (read as Triton does).

    Example (one process; it sets ``TRITON_INTERPRET`` for the rest of it)::

        >>> import os
        >>> from smptk.kernels import runtime
        >>> os.environ["TRITON_INTERPRET"] = "y"         # Triton's words: 1/true/yes/on/y, any case
        >>> runtime.interpreter_enabled()
        True
        >>> os.environ["TRITON_INTERPRET"] = "0"
        >>> runtime.interpreter_enabled()
        False
        >>> del os.environ["TRITON_INTERPRET"]
    """
    return settings.triton_interpret()


def interpreter_at_import() -> bool | None:
    """Whether the kernels are built for Triton's interpreter (``TRITON_INTERPRET`` when triton was imported);
    None while triton is not imported, so the next Triton-path call builds them as the variable is then.

    Example (one process with triton installed; in a fresh process it is None until triton is imported)::

        >>> import triton                                 # by any code, or by smptk's first Triton-path call
        >>> from smptk.kernels import runtime
        >>> runtime.interpreter_at_import() in (True, False)   # fixed from now on, whatever the variable says
        True
    """
    return _triton.interpreter_at_import()


def triton_available() -> bool:
    """True when the ``triton`` package imports (it does on Linux; elsewhere only the torch path runs).
    Does not import it.

    Example (Linux, with triton installed, as smptk's requirements install it)::

        >>> from smptk.kernels import runtime
        >>> runtime.triton_available()
        True
    """
    return _triton.available()


def requested_path() -> str:
    """The value of ``SMPTK_KERNELS`` ("triton", "torch" or "auto"), validated.

    Example (one process; it sets ``SMPTK_KERNELS`` for the rest of it)::

        >>> import os
        >>> from smptk.kernels import runtime
        >>> os.environ["SMPTK_KERNELS"] = " Torch "        # case and surrounding spaces are ignored
        >>> runtime.requested_path()
        'torch'
        >>> del os.environ["SMPTK_KERNELS"]
        >>> runtime.requested_path()                      # unset: the default
        'auto'
    """
    return settings.kernels()


def _interpreter_set_too_late() -> bool:
    """``TRITON_INTERPRET`` is on now, but triton was imported without it: its functions are compiled."""
    return interpreter_enabled() and interpreter_at_import() is False


def _check_interpreter_unchanged() -> None:
    """Raise when ``TRITON_INTERPRET`` was switched on after the kernels were compiled for a GPU."""
    if _interpreter_set_too_late():
        raise RuntimeError(
            "TRITON_INTERPRET is set now but was not when triton was imported (by smptk's first Triton-path "
            "call, or before it by other code: torch's meta kernels import it too), so Triton's functions "
            "are compiled for a GPU and cannot run on CPU tensors; set TRITON_INTERPRET=1 before triton is "
            "imported, e.g. first thing in the process (or use SMPTK_KERNELS=torch)"
        )


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


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor, without importing torch.distributed.tensor (a DTensor loaded it).

    Example (one process; a DTensor needs a process group and a device mesh)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from torch.distributed.tensor import DeviceMesh, distribute_tensor
        >>> from smptk.kernels import runtime
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> dt = distribute_tensor(torch.ones(2), DeviceMesh("cpu", [0]))
        >>> runtime.is_dtensor(dt), runtime.is_dtensor(dt.to_local()), runtime.is_dtensor(None)
        (True, False, False)
        >>> dist.destroy_process_group()
    """
    dtensor = sys.modules.get("torch.distributed.tensor")  # loaded wherever a DTensor exists; never import it
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def _transform_blocker(tensors: tuple) -> str | None:
    """Why an autograd Function without vmap / jvp rules cannot run this call, or None when it can: a
    ``torch.func`` transform is active, or an argument carries a forward-mode AD tangent."""
    if torch._C._are_functorch_transforms_active():
        return "a torch.func transform (grad, vjp, vmap, jvp, jacrev, ...) is active"
    if forward_ad._current_level >= 0 and any(
        isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in tensors
    ):
        return "an argument carries a forward-mode AD tangent (torch.autograd.forward_ad)"
    return None


def select_path(*tensors: torch.Tensor | None, dot: bool = True) -> str:
    """Return "triton" or "torch" for a call whose tensor arguments are ``tensors``.

    ``tensors``: every tensor argument of the call (None entries are skipped); the first one's device and
    dtype decide. Raises ``RuntimeError`` when ``SMPTK_KERNELS=triton`` is forced on tensors Triton cannot run
    on (DTensors included) or under a transform the kernels do not support (see the module docstring), and
    for CPU tensors when ``TRITON_INTERPRET`` was switched on after triton was imported. Meta tensors get
    "torch" whatever ``SMPTK_KERNELS`` says. ``dot=False``: the kernels use no ``tl.dot`` (whose bf16 is wrong
    under the interpreter), so bf16 is not sent to the PyTorch path; the interpreter still truncates fp32 ->
    bf16 conversions where a GPU rounds to nearest (one bf16 ulp at most, where CUDA's error is half of it).
    """
    requested = requested_path()
    device = tensors[0].device
    if requested == "torch" or device.type == "meta":
        return "torch"
    if any(is_dtensor(t) for t in tensors):
        if requested == "triton":
            raise RuntimeError(
                f"{KERNELS_ENV}=triton but an argument is a DTensor: a Triton kernel would compute on this "
                "rank's shard as if it were the whole tensor; pass local tensors (.to_local()) or use "
                "smptk.parallel's layers (ColumnParallelLinear, RowParallelLinear, MoE)"
            )
        return "torch"
    transform = _transform_blocker(tensors)
    if transform is not None:
        if requested == "triton":
            raise RuntimeError(
                f"{KERNELS_ENV}=triton but {transform}: smptk's Triton ops define no vmap or jvp rule; "
                f"{KERNELS_ENV}=auto (or torch) runs such calls with PyTorch ops, which support it"
            )
        return "torch"
    if device.type == "cpu" and triton_available():
        _check_interpreter_unchanged()
    blocker = _triton_blocker(device, tensors[0].dtype if dot else None)
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
        elif dev == "cpu" and triton_available() and _interpreter_set_too_late():
            out[dev] = "error: TRITON_INTERPRET was set after triton was imported"
        elif _triton_blocker(torch.device(dev)) is None:
            if not interpreter_enabled():
                out[dev] = "triton"
            else:
                # the interpreter's bf16 tl.dot is wrong: bf16 GEMMs take torch (an error when forced)
                bf16 = "bfloat16 GEMMs: torch" if requested == "auto" else "bfloat16 GEMMs: an error"
                out[dev] = "triton (interpreter)" if dev == "cuda" else f"triton (interpreter; {bf16})"
        else:
            out[dev] = "torch" if requested == "auto" else "error: triton cannot run here"
    return out
