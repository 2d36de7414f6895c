"""smptk's kernels (forwards, and the backwards that run GEMMs) and collectives as torch dispatcher ops.

A Triton launch is not a dispatcher op: torch's selective activation checkpointing (a dispatch mode that asks
a policy, op by op, what to keep), FakeTensorMode and other modes see only the ``torch.empty`` that
allocates its output, never the GEMM that fills it. :func:`dispatcher_op` registers a forward as the op
``torch.ops.smptk.<name>`` (``torch.library.custom_op``, with a fake implementation that only makes the
outputs' shapes) and returns a caller that

- runs the function directly when no dispatch mode is active (the usual case: no dispatcher overhead), and
- goes through the op when one is, so the mode sees ``smptk::<name>`` as one op with its outputs: selective
  checkpointing (:mod:`smptk.parallel.checkpointing`) keeps those outputs instead of running the kernel
  again in backward, and a FakeTensorMode gets the outputs' shapes without a launch.

``torch.compile`` does not trace the caller (``torch.compiler.disable``): Dynamo cannot trace a Triton
launcher's host code (under the interpreter it traced into the interpreter and failed), so it breaks the
graph there and the op runs as it does eagerly. The ops' autograd Functions are called through
:func:`outside_graphs` too (the MoE kernels, which are not dispatcher ops, take it alone), so a Function's
forward runs eagerly as a whole: otherwise Dynamo compiles the code around the launch in pieces, and under
selective checkpointing with Inductor the piece after it (what the forward saves: :func:`saved_if`'s
stand-in, an ``aten.new_empty``) can run compiled in forward, out of the checkpoint's sight, and eagerly in
the recompute, which then asks for an op the forward never recorded. ``fullgraph=True`` therefore refuses
the Triton path; the PyTorch path (``SMPTK_KERNELS=torch``, and CPU without the interpreter) of the dense ops
is traced into the graph, while the grouped ops and the MoE chain break it where they read token counts on
the host.

FLOPs: ``dispatcher_op(..., flops=formula)`` gives an op its count of matmul FLOPs, taken from the shapes of
its arguments, for ``torch.utils.flop_counter.FlopCounterMode`` (MFU measurements). The GEMM ops' backwards
are dispatcher ops too, so the mode counts a backward's GEMMs as well. As torch counts ``mm`` / ``addmm``
and nothing elementwise, the formulas count only the products: ``2 * M * K * N`` per GEMM, no bias,
activation or SwiGLU epilogue. Importing ``torch.utils.flop_counter`` imports triton, which ``import smptk``
must not (:mod:`smptk.kernels._triton`), so the formulas are registered (``register_flop_formula``) on the
first call under a dispatch mode once that module is loaded, and added to the registry of any
FlopCounterMode already running, which took its copy of the registry when it was made.

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
import sys
from collections.abc import Callable

import torch

NAMESPACE = "smptk"

# Every op registered here (OpOverloads). checkpointing's selective policy keeps the outputs of all of them.
OPS: set = set()

# Matmul FLOP formulas of the ops that have one: OpOverloadPacket -> formula(*argument shapes, out_shape).
FLOPS: dict = {}


def _mode_active() -> bool:
    """Whether a torch dispatch mode (selective checkpointing, FakeTensorMode, ...) is on the stack."""
    return torch._C._len_torch_dispatch_stack() > 0


def _run(op, impl: Callable, args: tuple, packet):
    if not _mode_active():
        return impl(*args)
    _register_flops(packet)
    return op(*args)


# The registry the formulas of FLOPS went into, and how many went (ops register as their modules load).
_REGISTERED: list = [None, 0]


def _register_flops(packet) -> None:
    """Give torch's FLOP counter the formulas in :data:`FLOPS` (see the module docstring): registered once
    ``torch.utils.flop_counter`` is loaded (again only when its registry is replaced or an op joins FLOPS),
    and the formula of ``packet`` (the op being called) added to every FlopCounterMode on the dispatch stack,
    which took its copy of the registry when it was made."""
    counter = sys.modules.get("torch.utils.flop_counter")
    if counter is None:  # no FlopCounterMode can exist yet
        return
    registry = counter.flop_registry
    if _REGISTERED[0] is not registry or _REGISTERED[1] != len(FLOPS):
        for key, formula in FLOPS.items():
            if key not in registry:
                counter.register_flop_formula(key)(formula)
        _REGISTERED[:] = registry, len(FLOPS)
    if packet not in FLOPS:
        return
    for mode in torch.utils._python_dispatch._get_current_dispatch_mode_stack():
        if isinstance(mode, counter._FlopCounterMode):
            mode.counter.flop_registry.setdefault(packet, registry[packet])


def gemm_flops(m: int, k: int, n: int) -> int:
    """Multiply-adds of an ``[m, k] @ [k, n]`` product, counted as torch counts ``mm``: ``2 * m * k * n``."""
    return 2 * m * k * n


def outside_graphs(fn: Callable) -> Callable:
    """``fn`` as ``torch.compile`` leaves it: while compiling, a call is a graph break and ``fn`` runs as it
    does eagerly (``torch.compiler.disable``); otherwise ``fn`` itself runs. For functions whose host code
    Dynamo cannot trace: a Triton launch, or a collective over the symmetric heap (its tensors are real
    tensors on both sides of the break, so an in-place result is seen by the graph that follows).

    The disabled function is ``torch._disable_dynamo``'s, which imports torch._dynamo on its first call, not
    here: at import it would load it, and triton with it (see ``_triton``). The caller returned has a code
    object of its own: after the graph break Dynamo compiles the caller as a frame of its own, guarded on the
    function and its arguments' types, and keeps those compiled frames per code object, so callers sharing a
    closure's code object piled up one per wrapped function and signature until Dynamo's recompile limit (8),
    an error under ``fail_on_recompile_limit_hit``.
    """
    disabled = torch._disable_dynamo(fn)

    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    call.__code__ = call.__code__.replace()  # a copy: see the docstring
    return functools.wraps(fn)(call)


def dispatcher_op(
    name: str, *, fake: Callable, flops: Callable | None = None
) -> Callable[[Callable], Callable]:
    """Register the decorated function as ``torch.ops.smptk.<name>`` and return its caller (see the module
    docstring). ``fake`` takes the same arguments and returns empty outputs of the right shapes; the
    decorated function must be fully annotated (torch infers the op's schema from its annotations).
    ``flops``: the op's matmul FLOPs for FlopCounterMode, from the arguments' shapes (a tensor's
    ``torch.Size``, None and the other arguments as they are) and ``out_shape`` (the outputs' sizes)."""

    def register(impl: Callable) -> Callable:
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(impl)
        op.register_fake(fake)
        packet = getattr(getattr(torch.ops, NAMESPACE), name).default
        OPS.add(packet)
        if flops is not None:
            FLOPS[packet.overloadpacket] = flops

        @outside_graphs  # see the module docstring: under torch.compile, a graph break, then eager
        @functools.wraps(impl)
        def call(*args):
            return _run(op, impl, args, packet.overloadpacket)

        call.op = packet
        return call

    return register


def first_derivative_only(name: str, torch_path: bool = False) -> Callable[[Callable], Callable]:
    """Decorates an autograd Function's ``backward`` that runs kernels autograd cannot see into: asked to
    build a graph of the gradient (``create_graph=True``, for a second derivative such as a gradient
    penalty), it raises, naming the op, instead of returning gradients whose own derivatives would be
    missing. Torch's ``once_differentiable`` defers its error to a node that ``torch.autograd.grad(loss,
    params)`` may never visit, which drops the second-order term silently; this check cannot be skipped.
    ``torch_path``: the op has a PyTorch path (``SMPTK_KERNELS=torch``), which the message then suggests.

    Example::

        >>> class Double(torch.autograd.Function):
        ...     forward = staticmethod(lambda ctx, x: x * 2)
        ...     backward = staticmethod(first_derivative_only("double")(lambda ctx, g: g * 2))
        >>> x = torch.ones(2, requires_grad=True)
        >>> torch.autograd.grad(Double.apply(x).sum(), x)[0]
        tensor([2., 2.])
        >>> torch.autograd.grad(Double.apply(x).sum(), x, create_graph=True)
        Traceback (most recent call last):
        RuntimeError: double: no second derivative (a backward with create_graph=True asked for one)
    """

    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():  # the engine runs backward with grad mode = create_graph
                raise RuntimeError(
                    f"{name}: no second derivative (a backward with create_graph=True asked for one)"
                    + ("; SMPTK_KERNELS=torch runs it with PyTorch ops, which have one" if torch_path else "")
                )
            return backward(ctx, *grads)

        return checked

    return decorate


def grads_wanted(ctx, grad_enabled: bool, n: int) -> tuple[bool, ...]:
    """Which of an autograd Function's first ``n`` inputs backward will differentiate, decided in its
    ``forward``: ``ctx.needs_input_grad``, or none when the caller ran under ``torch.no_grad()``
    (``grad_enabled``: ``torch.is_grad_enabled()`` read before ``apply``; inside ``forward`` grad mode is
    always off, and ``needs_input_grad`` follows ``requires_grad`` whatever the grad mode)."""
    return tuple(grad_enabled and bool(flag) for flag in ctx.needs_input_grad[:n])


def saved_if(t: torch.Tensor, needed: bool) -> torch.Tensor:
    """``t`` to save for backward when ``needed``; else a stand-in with its shape, dtype and device that
    holds one element (a scalar expanded), for a backward that reads only those: an input only another
    input's gradient reads is not kept alive (x with a frozen weight, as torch's own linear does)."""
    return t if needed else t.new_empty(()).expand(t.shape)


def none_if_empty(t: torch.Tensor, made: bool) -> torch.Tensor | None:
    """An op's optional output back to None where the forward did not make it (``made`` false)."""
    return t if made else None
