"""Delayed parameter initialization: build on the meta device, shard, then materialize each rank's shards.

With ``delayed_parameter_initialization``, a model too large for one device is built under
``torch.device("meta")`` (no memory, no random draws), parallelized there (tensor / expert parallelism,
:func:`~smptk.parallel.apply_activation_checkpointing`, :func:`~smptk.parallel.apply_data_parallel` on
FSDP2: all take meta parameters; its replicated DDP path takes the materialized model), and only then
given memory: :func:`materialize` allocates every parameter and buffer on the state's device, each rank
only its own shards (``nn.Module.to_empty`` keeps DTensor placements),
then seeds torch's generators with ``state.seed_for()`` (the same on every rank) and runs every
submodule's ``reset_parameters()`` in ``model.modules()`` order, smptk's layers drawing from torch's
default CPU generator too (their ``generator=`` argument). No rank ever holds the full model.

What the values are: smptk's layers (:class:`~smptk.parallel.ColumnParallelLinear`, ...) draw exactly the
unsharded module's values (they draw the full tensor from the generator and keep their slice, see
:mod:`smptk.parallel.shard_init`), so a model of smptk layers and unsharded torch layers gets the
values the same resets in the same order give the unsharded model. A torch module whose own parameters
are DTensors (sharded by ``fully_shard`` or a torch ParallelStyle): on CUDA its ``reset_parameters``
draws with torch's DTensor random-number tracker (the values a full-tensor draw on the GPU would give
each shard); on CPU, where the tracker draws every shard locally (each rank the same numbers, and fewer
of them than the whole tensor), it runs on full-size CPU stand-ins of those parameters and each rank
keeps its piece, so the module and every later one get the unsharded model's values. Where values must
equal a checkpoint, load it afterwards
(:func:`~smptk.parallel.load_full_state_dict` or :func:`~smptk.parallel.load_checkpoint`). Buffers come
back uninitialized unless their module's ``reset_parameters`` refills them (torch's norms do): a module
with a computed buffer (a rotary table, say) must recompute it there. A module that holds parameters or
buffers of its own and has no ``reset_parameters`` is refused before anything is allocated (its values
would be whatever memory ``to_empty`` gave), and every floating parameter and buffer is filled with NaN
before the resets and checked after them, so one that no reset wrote (a subclass adding parameters its
inherited reset does not know) is named in a RuntimeError; ``allow_uninitialized=True`` allows both when
a checkpoint load follows.

Order: the resets run in ``model.modules()`` order, so the values are the eager build's when the model
builds its submodules in the order it registers them and initializes them only in ``reset_parameters``
(an init written in a parent's ``__init__`` is not replayed). A module whose own tensors an ancestor's
reset already wrote (:class:`~smptk.parallel.MoE`'s reset resets its experts) is not reset again. A
parameter shared by several modules (an embedding tied to the head) stays one tensor (``to_empty`` would
untie it) and keeps the draw of its first owner in that order; the later owners' resets still draw, as
their eager construction did, and their values are discarded, as the tie assigned after construction
discards them.

Example::

    >>> state = smptk.parallel.init({"delayed_parameter_initialization": True})
    >>> with torch.device("meta"):
    ...     model = build_model()
    >>> model, report = apply_data_parallel(model, state)
    >>> materialize(model, state)                     # this rank's shards, on state's device
    12
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from smptk.parallel.config import ParallelState, current
from smptk.parallel.shard_init import local as _local


def _device(state: ParallelState) -> torch.device:
    if state.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(state.device_type)


def materialize(
    model: nn.Module,
    state: ParallelState | None = None,
    *,
    device: torch.device | str | None = None,
    allow_uninitialized: bool = False,
) -> int:
    """Give a meta-built (and possibly sharded) ``model`` memory and initial values; see the module
    docstring. Collective only in what ``reset_parameters`` does (nothing for torch's and smptk's layers).

    Args:
        model: a model whose parameters and buffers are all on the meta device.
        state: the :func:`smptk.parallel.init` state (default :func:`~smptk.parallel.current`): its device
            type and ``seed_for()``.
        device: where to allocate (default: the state's device; CUDA: the current device).
        allow_uninitialized: allow modules that hold parameters or buffers and have no
            ``reset_parameters`` (a Hugging Face model's norms), whose values stay uninitialized memory:
            for a caller that loads a checkpoint next (:func:`~smptk.parallel.load_hf_state_dict`,
            :func:`~smptk.parallel.load_full_state_dict`, :func:`~smptk.parallel.load_checkpoint`).

    Returns:
        The number of modules whose ``reset_parameters`` ran.

    Raises:
        ValueError: a parameter or buffer is not on the meta device (materializing would discard its
            values), or a module holding parameters or buffers has no ``reset_parameters`` (nothing would
            give them values); raised before anything is allocated.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    state = state if state is not None else current()
    real = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if not t.is_meta]
    if real:
        shown = ", ".join(real[:3]) + (f" and {len(real) - 3} more" if len(real) > 3 else "")
        raise ValueError(
            f"model: {shown} not on the meta device; materialize() allocates a meta-built model (build it "
            "under torch.device('meta')) and would discard these values"
        )
    silent = [
        name or type(m).__name__
        for name, m in model.named_modules()
        if next(iter((*m.parameters(recurse=False), *m.buffers(recurse=False))), None) is not None
        and not callable(getattr(m, "reset_parameters", None))
    ]
    if silent and not allow_uninitialized:
        shown = ", ".join(silent[:3]) + (f" and {len(silent) - 3} more" if len(silent) > 3 else "")
        raise ValueError(
            f"model: {shown} hold parameters or buffers but have no reset_parameters(), through which "
            "materialize() gives them values (they would keep uninitialized memory); define one, or pass "
            "allow_uninitialized=True when a checkpoint is loaded next"
        )
    target = torch.device(device) if device is not None else _device(state)
    ties = _shared_parameters(model)
    model.to_empty(device=target)  # unties shared parameters (each slot gets its own new tensor)
    for slots in ties:
        first = slots[0][0]._parameters[slots[0][1]]
        for module, name in slots[1:]:
            module._parameters[name] = first
    values = _floating_values(model)
    with torch.no_grad():
        for _, t in values:
            t.fill_(float("nan"))  # what no reset_parameters wrote shows up below
    devices = []
    if target.type == "cuda":
        devices = [target.index if target.index is not None else torch.cuda.current_device()]
    ran = 0
    done: set[int] = set()  # parameters a reset has given values (a shared one keeps its first owner's)
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(state.seed_for())
        with torch.no_grad():
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if not callable(reset):
                    continue
                own = list(module.parameters(recurse=False))
                # written by an ancestor's reset that resets its children (MoE's); a tied parameter written
                # by its first owner (in ``done``) is no reason: that module's reset still draws, as eager
                if not any(id(p) in done for p in own) and _written_already(module):
                    done.update(id(p) for p in own)
                    continue
                kept = [(p, _local(p).clone()) for p in own if id(p) in done]
                if "generator" in inspect.signature(reset).parameters:  # smptk's layers: one stream
                    reset(generator=torch.default_generator)
                else:
                    _reset_torch_module(module, reset)
                for p, value in kept:  # as the tie assigned after both modules were built: the draw is lost
                    _local(p).copy_(value)
                done.update(id(p) for p in own)
                ran += 1
    if not allow_uninitialized:
        _check_all_written(values)
    return ran


def _written_already(module: nn.Module) -> bool:
    """Whether an earlier reset wrote every floating tensor of ``module``'s own (none holds materialize's
    NaN fill any more): a parent whose ``reset_parameters`` resets its children, as the eager build's
    constructor did once; resetting the child again would draw its values a second time."""
    own = [_local(t) for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))]
    own = [t for t in own if t.is_floating_point() and t.numel()]
    return bool(own) and not torch.stack([t.isnan().any() for t in own]).any().item()


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, name) slots of each parameter held in more than one slot (a tied embedding and head)."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, name))
    return [s for s in slots.values() if len(s) > 1]


def _floating_values(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, local value) of every floating parameter and buffer, each tensor once."""
    seen: dict[int, tuple[str, torch.Tensor]] = {}
    with torch.no_grad():  # a DTensor's to_local() is then its local tensor itself
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            local = _local(t)
            if local.is_floating_point():
                seen.setdefault(id(t), (name, local))
    return list(seen.values())


def _check_all_written(values: list[tuple[str, torch.Tensor]]) -> None:
    """Raise, naming them, when parameters or buffers still hold the NaN that materialize filled them with:
    a ``reset_parameters`` that does not cover all of its module's tensors (a subclass that adds
    parameters and inherits its parent's reset) left them uninitialized."""
    if not values:
        return
    flags = torch.stack([t.isnan().any() for _, t in values]).tolist()  # one host sync
    names = [name for (name, _), bad in zip(values, flags, strict=True) if bad]
    if not names:
        return
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    raise RuntimeError(
        f"materialize: no reset_parameters() gave {shown} values (their module's reset does not cover "
        "them, or wrote NaN); initialize them there, or pass allow_uninitialized=True when a checkpoint "
        "is loaded next"
    )


def _reset_torch_module(module: nn.Module, reset) -> None:
    """``reset()``; where ``module``'s own parameters include CPU DTensors, on full-size CPU stand-ins of
    them, each rank then keeping its piece (``distribute_tensor`` without communication), as the module
    docstring says."""
    sharded = {
        name: p
        for name, p in module.named_parameters(recurse=False)
        if isinstance(p, DTensor) and p.device.type == "cpu"
    }
    if not sharded:
        reset()
        return
    stand_ins = {name: nn.Parameter(torch.empty(p.shape, dtype=p.dtype)) for name, p in sharded.items()}
    try:
        for name, full in stand_ins.items():
            module._parameters[name] = full
        reset()
    finally:
        for name, p in sharded.items():
            module._parameters[name] = p
    for name, p in sharded.items():
        piece = distribute_tensor(stand_ins[name].detach(), p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(piece.to_local())


__all__ = ["materialize"]
