"""smptk's forward kernels and collectives as torch dispatcher ops, so torch's dispatch modes can see them.

A Triton launch is not a dispatcher op: torch's selective activation checkpointing (a dispatch mode that asks
a policy, op by op, what to keep), FakeTensorMode and other modes see only the ``torch.empty`` that
allocates its output, never the GEMM that fills it. :func:`dispatcher_op` registers a forward as the op
``torch.ops.smptk.<name>`` (``torch.library.custom_op``, with a fake implementation that only makes the
outputs' shapes) and returns a caller that

- runs the function directly when no dispatch mode is active (the usual case: no dispatcher overhead), and
- goes through the op when one is, so the mode sees ``smptk::<name>`` as one op with its outputs: selective
  checkpointing (:mod:`smptk.parallel.checkpointing`) keeps those outputs instead of running the kernel
  again in backward, and a FakeTensorMode gets the outputs' shapes without a launch.

Both branches run the same function, so what they compute is the same. The ops return tensors only, and
fresh ones (no output aliases an input): an output a forward does not make is an empty tensor, which the
caller turns back into None. :data:`OPS` holds every op registered here.

Example::

    >>> @dispatcher_op("scale2", fake=lambda x: torch.empty_like(x))
    ... def scale2(x: torch.Tensor) -> torch.Tensor:
    ...     return x * 2
    >>> scale2(torch.ones(2))            # no mode active: the function itself
    tensor([2., 2.])
    >>> torch.ops.smptk.scale2.default in OPS
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

NAMESPACE = "smptk"

# Every op registered here (OpOverloads). checkpointing's selective policy keeps the outputs of all of them.
OPS: set = set()


def _mode_active() -> bool:
    """Whether a torch dispatch mode (selective checkpointing, FakeTensorMode, ...) is on the stack."""
    return torch._C._len_torch_dispatch_stack() > 0


def dispatcher_op(name: str, *, fake: Callable) -> Callable[[Callable], Callable]:
    """Register the decorated forward as ``torch.ops.smptk.<name>`` and return its caller (see the module
    docstring). ``fake`` takes the same arguments and returns empty outputs of the right shapes; the
    decorated function must be fully annotated (torch infers the op's schema from its annotations)."""

    def register(impl: Callable) -> Callable:
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(impl)
        op.register_fake(fake)
        packet = getattr(getattr(torch.ops, NAMESPACE), name).default
        OPS.add(packet)

        @functools.wraps(impl)
        def call(*args):
            return op(*args) if _mode_active() else impl(*args)

        call.op = packet
        return call

    return register


def none_if_empty(t: torch.Tensor, made: bool) -> torch.Tensor | None:
    """An op's optional output back to None where the forward did not make it (``made`` false)."""
    return t if made else None
