"""Checkpoints that reshard: model and optimizer state through ``torch.distributed.checkpoint`` (DCP).

A checkpoint saved under one parallel config loads under any other with identical values (TP 2 x DP 2
-> DP 4 -> one process, HSDP -> full shard), because nothing here knows about shards:

- :func:`save_checkpoint` takes the model and optimizer state with
  ``torch.distributed.checkpoint.state_dict.get_state_dict``: keys are the parameters' qualified names
  as in the unsharded model (FSDP2's and DDP's wrappers leave no trace in them), values are what each
  rank holds (DTensors for tensor-parallel and FSDP2 parameters, with their global shape and
  placements; plain tensors elsewhere), and the optimizer state is keyed by those names too, not by
  parameter position. ``dcp.save`` writes each rank's shards with DCP's own format and default planner
  (one ``.distcp`` file per rank plus a ``.metadata`` file mapping every global tensor to its pieces),
  writing a replicated tensor once.
- :func:`load_checkpoint` asks the *target* model for its state dict under its own config (the
  DTensors say which slice this rank needs), ``dcp.load`` reads exactly those slices from whatever
  pieces the checkpoint holds, and ``set_state_dict`` copies them into the model and optimizer. A
  plain ``nn.Module`` on one process (no process group) loads the same checkpoint whole.
- :func:`load_full_state_dict` loads ordinary full state dicts held by rank 0 only (a ``torch.save``
  file, a Hugging Face model's weights): ``StateDictOptions(full_state_dict=True,
  broadcast_from_rank0=True)`` broadcasts tensor by tensor and each rank keeps its slice, so no other
  rank reads the file and no rank holds more than one full tensor beyond its shards.
  :func:`get_full_state_dict` is the way back (rank 0 gets full tensors on CPU).

Layout on disk: the state dict ``{"model": ..., "optim": ..., "step": int, "extra": {...}, "rng": bytes}``
(``optim`` only when an optimizer is given, ``step`` and ``extra`` only when given, ``rng`` unless
``rng=False``), flattened by DCP into keys such as ``model.blocks.0.up.weight`` and
``optim.state.blocks.0.up.weight.exp_avg``.

RNG: ``rng`` holds rank 0's states of torch's default generators (the CPU one, and the current CUDA
device's where CUDA is in use), which :func:`load_checkpoint` gives back to every rank. They are one state
for the whole job because smptk keeps them in step on every rank (``init`` seeds them alike;
``ParallelState.fork_rng`` derives each rank's masks from a draw they all make), so dropout, replicated
or in a ``fork_rng`` region, draws after a resume under the same config the masks the uninterrupted run
would have drawn (under another config each rank holds other slices of the activations, so other masks).
A save whose ranks' states differ (a rank reseeded on its own) warns: the resume gives every rank rank
0's.

Every call is collective over the default process group (every rank calls it with the same path).

Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU). Saved under tensor parallelism and
loaded into the plain model, as a later run under another config, or one process without torchrun, would::

    >>> import tempfile
    >>> import torch
    >>> import torch.distributed as dist
    >>> import smptk.parallel as sp
    >>> from smptk.parallel import load_checkpoint, save_checkpoint
    >>> dist.init_process_group("gloo")
    >>> path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    >>> dist.broadcast_object_list(path)                    # one directory every rank sees
    >>> state = sp.init({"tensor_parallel_degree": 2})
    >>> model = sp.ColumnParallelLinear(8, 4)               # weight Shard(0) over the 2 ranks
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> save_checkpoint(path[0] + "/step100", model, opt, step=100)
    >>> plain = torch.nn.Linear(8, 4)
    >>> load_checkpoint(path[0] + "/step100", plain)
    100
    >>> torch.equal(plain.weight, model.weight.full_tensor())
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from smptk.parallel.shard_init import local as _local

MODEL_KEY, OPTIM_KEY, STEP_KEY, EXTRA_KEY, RNG_KEY = "model", "optim", "step", "extra", "rng"
OPTIM_CLASS_KEY = "optim_class"  # the optimizer's class, "module.QualName" (absent from older checkpoints)


def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_intended():
    """Silence DCP's warning that it saves / loads in one process: without a process group, that is
    what these functions are asked to do."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to (save|load) in a single process"
        )
        yield


def _check_path(path: object) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a directory path (str or os.PathLike), got {type(path).__name__}")
    return os.fspath(path)


def _check_model_optimizer(model: object, optimizer: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer: expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )


def _state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, options=None, *, template: bool = False
) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` as get_state_dict gives them (optim only with an optimizer).

    Torch's ``get_state_dict`` makes the state of an optimizer that has not stepped by running one step at
    learning rate 0 on zero gradients, and skips that (returning no state at all) while any parameter
    holds a ``.grad``. The made-up state is not a fresh one: Adam's step count becomes 1 (the next real
    step's bias correction is then wrong) and with weight decay the moments hold ``wd * p``. So the
    gradients are set aside for the call and put back, and for an optimizer without state the result
    holds no state and the optimizer is left without it (as it was), unless ``template``: a load needs
    the state's structure to fill from the checkpoint (every value is then overwritten, or dropped by
    :func:`load_checkpoint` when the checkpoint holds none).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {MODEL_KEY: get_model_state_dict(model, options=options)}
    fresh = not optimizer.state
    with _grads_set_aside(optimizer):
        msd, osd = get_state_dict(model, optimizer, options=options)
    if fresh and not template:
        osd = {**osd, "state": {}}
        optimizer.state.clear()
    return {MODEL_KEY: msd, OPTIM_KEY: osd}


@contextlib.contextmanager
def _grads_set_aside(optimizer: torch.optim.Optimizer):
    """The optimizer's parameters without ``.grad`` inside the block, and with them again after it: torch
    makes an optimizer's state (which its loads and state dicts work from) only while no parameter holds
    a gradient, and without it ``set_optimizer_state_dict(full_state_dict=True)`` fails ('Expected device
    to be set')."""
    grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    for p, _ in grads:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in grads:
            p.grad = grad


@contextlib.contextmanager
def _empty_groups_set_aside(optimizer: torch.optim.Optimizer, groups: list[dict]):
    """Torch's ``set_optimizer_state_dict`` takes at most one parameter group without parameters (two were
    refused: "DSD only support exactly one param group with zero parameters") and gives it the last saved
    group's settings. Inside the block the optimizer's empty groups are out of it, and the block gets
    ``groups`` (the matched saved groups, in the optimizer's order) without theirs; after a load that did
    not raise they come back in place, each with its matched group's settings."""
    empty = [i for i, g in enumerate(optimizer.param_groups) if not g["params"]]
    aside = [optimizer.param_groups[i] for i in empty]
    optimizer.param_groups[:] = [g for i, g in enumerate(optimizer.param_groups) if i not in empty]
    loaded = False
    try:
        yield [g for i, g in enumerate(groups) if i not in empty]
        loaded = True
    finally:
        for i, group in zip(empty, aside, strict=True):
            if loaded and groups:
                group.update({k: v for k, v in groups[i].items() if k != "params"})
            optimizer.param_groups.insert(i, group)


def _check_materialized(model: nn.Module) -> None:
    """A meta tensor has no memory to load into: DCP would skip it and report nothing."""
    meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if _local(t).is_meta]
    if meta:
        raise RuntimeError(
            f"model: {len(meta)} parameters / buffers are on the meta device ({meta[:4]}"
            f"{' ...' if len(meta) > 4 else ''}); initialize them first (smptk.parallel.materialize), "
            "then load (to_empty alone leaves buffers the checkpoint does not hold, such as a rotary "
            "inv_freq, uninitialized)"
        )


@contextlib.contextmanager
def _checkpoint_errors(what: str):
    """DCP's ``CheckpointException`` derives from BaseException (``except Exception`` misses it) and wraps
    each rank's error in a traceback; re-raised as a RuntimeError whose message is the ranks' errors."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        errors = sorted({str(f[0] if isinstance(f, tuple) else f) for f in e.failures.values()})
        raise RuntimeError(f"{what}: " + "; ".join(errors)) from e


def _matching_keys(saved: set[str], wanted: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(missing, unexpected) model keys: DCP flattens a non-tensor entry (a dict from ``get_extra_state``)
    into ``name.<key>`` keys, which count as that entry."""
    nested = [k for k, v in wanted.items() if not torch.is_tensor(v)]

    def covers(name: str, key: str) -> bool:
        return key.startswith(name + ".")

    missing = [k for k in wanted if k not in saved and not any(covers(k, s) for s in saved)]
    unexpected = [s for s in saved if s not in wanted and not any(covers(n, s) for n in nested)]
    return sorted(missing), sorted(unexpected)


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
) -> None:
    """Write ``model``'s (and ``optimizer``'s) state to the directory ``path`` with DCP.

    Collective over the default process group (or a plain save on one process without one). The
    directory is created; an earlier checkpoint's files there are overwritten where this save writes the
    same names, and the others (a save by more ranks left more ``.distcp`` files) stay, unread. An
    optimizer that has not stepped yet is saved without state (its parameter groups only) and left as it
    was; loading that checkpoint gives an optimizer without state, as a new one.

    Args:
        path: the checkpoint directory (on a filesystem every rank sees, for a multi-node job).
        model: the model as trained: tensor-parallel, FSDP2, DDP-wrapped or plain.
        optimizer: its optimizer (any torch optimizer; its state is saved by parameter name), or None.
        step: the training step, returned by :func:`load_checkpoint`; None saves none.
        extra: more state to resume, ``{name: object with state_dict() / load_state_dict()}`` (an LR
            scheduler, a data loader's position), the same on every rank: rank 0's is written, whole (each
            object's state as one ``torch.save`` value, so a load gets exactly what was saved, keys the new
            object lacks included); pass the same names to :func:`load_checkpoint`.
        rng: save rank 0's states of torch's default generators (CPU, and the current CUDA device's where
            CUDA is initialized), which :func:`load_checkpoint` restores on every rank, so dropout draws
            the masks of the uninterrupted run (see the module docstring). It warns when the ranks'
            states differ. Not Python's ``random`` nor NumPy's, nor generators made with
            ``torch.Generator()`` (for those, pass in ``extra`` an object whose ``state_dict`` and
            ``load_state_dict`` call their ``get_state`` and ``set_state``).

    Not saved unless passed in ``extra``: the LR scheduler, the data position, and
    the token counts an :class:`smptk.parallel.MoE` gathered since its last ``update_expert_bias`` (a
    warning says when some are pending: save right after an update for an exact resume).

    Example (one process, no process group; under torchrun every rank makes the same calls)::

        >>> import tempfile
        >>> import torch
        >>> from smptk.parallel import load_checkpoint, save_checkpoint
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
        >>> opt.step(), sched.step()
        (None, None)
        >>> path = tempfile.mkdtemp() + "/step100"
        >>> save_checkpoint(path, model, opt, step=100, extra={"sched": sched})
        >>> sched2 = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
        >>> load_checkpoint(path, model, opt, extra={"sched": sched2})
        100
        >>> sched2.last_epoch                             # the scheduler restored
        1
    """
    path = _check_path(path)
    _check_model_optimizer(model, optimizer)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step: expected an int >= 0 or None, got {step!r}")
    _check_extra(extra)
    _check_rng(rng)
    _warn_pending_moe_counts(model)
    state = _state_dicts(model, optimizer)
    if optimizer is not None:
        state[OPTIM_CLASS_KEY] = _class_name(optimizer)
    if step is not None:
        state[STEP_KEY] = step
    rank0 = not _distributed() or dist.get_rank() == 0
    if rng:
        states = _rng_states()
        _warn_rng_out_of_step(states)
        if rank0:
            state[RNG_KEY] = _to_bytes(states)
    if extra and rank0:
        # One value per name, torch.save's bytes of the whole state: DCP would drop an empty dict, and a
        # load would read only the keys the new object's state_dict has (a dict grown in training, a
        # data loader's per-source positions, would come back empty). Rank 0's alone is written.
        state[EXTRA_KEY] = {name: _to_bytes(obj.state_dict()) for name, obj in extra.items()}
    Path(path).mkdir(parents=True, exist_ok=True)
    with _single_process_intended(), _checkpoint_errors(f"saving the checkpoint at {path!r}"):
        _dcp().save(state, checkpoint_id=path, no_dist=not _distributed())


def _check_rng(rng: object) -> None:
    if not isinstance(rng, bool):
        raise TypeError(f"rng: expected a bool, got {type(rng).__name__}")


def _rng_states() -> dict[str, torch.Tensor]:
    """This rank's states of torch's default generators: "cpu", and "cuda" (the current device's) where
    CUDA is initialized (asking an uninitialized CUDA would initialize it)."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: Mapping[str, torch.Tensor]) -> None:
    """Restore :func:`_rng_states`'s ``states``; a CUDA state where this process has no CUDA is left out
    (a GPU run's checkpoint resumed on a CPU)."""
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _warn_rng_out_of_step(states: Mapping[str, torch.Tensor]) -> None:
    """Warn (on every rank) when the ranks' generator states differ: the checkpoint keeps rank 0's."""
    if not _distributed() or dist.get_world_size() == 1:
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: v.cpu() for k, v in states.items()})
    first = everyone[0]
    differ = [
        r
        for r, theirs in enumerate(everyone)
        if theirs.keys() != first.keys() or not all(torch.equal(theirs[k], first[k]) for k in first)
    ]
    if differ:
        warnings.warn(
            f"save_checkpoint: torch's default generator states of ranks {differ[:8]}"
            f"{' ...' if len(differ) > 8 else ''} differ from rank 0's (a rank drew or seeded on its own); "
            "the checkpoint keeps rank 0's, which load_checkpoint gives every rank, so those ranks' random "
            "draws after a resume differ from the uninterrupted run's (rng=False saves none)",
            stacklevel=3,
        )


def _class_name(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _same_class(saved: str, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``saved`` (a checkpoint's :func:`_class_name`) names ``optimizer``'s class: by its qualified
    name, whatever module path it was saved under. A class defined in the training script is
    ``__main__.X`` under torchrun, ``__mp_main__.X`` in torch.multiprocessing's spawned workers and
    ``train.X`` when imported; Adam, AdamW and SGD still differ."""
    return saved == _class_name(optimizer) or saved.endswith("." + type(optimizer).__qualname__)


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _check_extra(extra: object) -> None:
    if extra is None:
        return
    if not isinstance(extra, Mapping):
        raise TypeError(f"extra: expected a mapping of names to stateful objects, got {type(extra).__name__}")
    for name, obj in extra.items():
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"extra: names must be non-empty strings without '.', got {name!r}")
        if not (
            callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"extra[{name!r}]: expected an object with state_dict() and load_state_dict() (an LR "
                f"scheduler, ...), got {type(obj).__name__}"
            )


def _warn_pending_moe_counts(model: nn.Module) -> None:
    """MoE layers' token counts since their last update_expert_bias are not saved (a per-rank statistic,
    zeroed at load): say so when some are pending and the layer balances by them."""
    pending = [
        name
        for name, m in model.named_modules()
        if getattr(m, "expert_bias", None) is not None
        and torch.is_tensor(getattr(m, "tokens_per_expert", None))
        and not _local(m.tokens_per_expert).is_meta
        and bool(_local(m.tokens_per_expert).any())
    ]
    if pending:
        warnings.warn(
            f"save_checkpoint: MoE layers {pending[:4]}{' ...' if len(pending) > 4 else ''} hold token "
            "counts gathered since their last update_expert_bias, which the checkpoint does not keep (a "
            "resumed run starts counting afresh): save right after update_expert_bias for an exact resume",
            stacklevel=3,
        )


def checkpoint_keys(path: str | os.PathLike) -> list[str]:
    """The flattened keys a checkpoint holds (``model.<name>``, ``optim.state.<name>.<field>``,
    ``optim_class``, ``step``, ``rng``, ``extra.<name>``).

    Reads only the ``.metadata`` file; FileNotFoundError names ``path`` when there is none.

    Example (one process, no process group; under torchrun every rank may call it)::

        >>> import tempfile
        >>> import torch
        >>> from smptk.parallel import checkpoint_keys, save_checkpoint
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step()                                      # the optimizer now has state to save
        >>> with tempfile.TemporaryDirectory() as path:
        ...     save_checkpoint(path, model, opt, step=1)
        ...     keys = checkpoint_keys(path)
        >>> sorted(k for k in keys if not k.startswith("optim.param_groups."))  # and a key per group option
        ['model.bias', 'model.weight', 'optim.state.bias.exp_avg', 'optim.state.bias.exp_avg_sq',
         'optim.state.bias.step', 'optim.state.weight.exp_avg', 'optim.state.weight.exp_avg_sq',
         'optim.state.weight.step', 'optim_class', 'rng', 'step']
    """
    path = _check_path(path)
    from torch.distributed.checkpoint import FileSystemReader

    if not Path(path, ".metadata").is_file():
        raise FileNotFoundError(
            f"path: {path!r} holds no DCP checkpoint (no .metadata file); save one with save_checkpoint"
        )
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # a truncated or foreign file: pickle's and torch's own errors name no path
        raise ValueError(
            f"path: {path!r}: its .metadata file could not be read ({type(e).__name__}: {e}); the checkpoint "
            "is damaged (a save interrupted?) or not one DCP wrote"
        ) from e
    return list(metadata.state_dict_metadata)


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
) -> int | None:
    """Load a :func:`save_checkpoint` directory into ``model`` (and ``optimizer``), under any config.

    Collective over the default process group (or a plain load on one process without one). Each rank
    reads the slices its own parameters and optimizer state hold under the current config, from
    whatever pieces the saving config wrote. The optimizer may be new (no state yet) or not, and the
    parameters may hold gradients; the model must have memory (after ``materialize``, not on meta).
    Mismatches (shapes, an optimizer of another class than the saved one's where the checkpoint names
    it, as every one ``save_checkpoint`` writes with an optimizer does, compared by qualified name so that
    a class moved to another module still loads; parameter groups that do not
    hold the saved groups' parameters) raise naming the keys, before anything is copied (a refused load
    leaves the model and a new optimizer as they were); DCP's own errors come as RuntimeError.

    Args:
        path: the checkpoint directory.
        model: the model, prepared for this run (tensor parallelism, FSDP2 or DDP) and with the same
            parameter names as the saved one.
        optimizer: its optimizer (same class and parameter groups as the saved one; groups are matched
            by their parameters' names, not their order), or None to load the model only. An LR
            scheduler's state (in ``extra``) is per group position, as torch keeps it: build the groups in
            the saved order when one is resumed (a LambdaLR's ``base_lrs`` would go to the other groups).
        strict: every parameter of ``model`` must be in the checkpoint (and nothing else in
            the model part of it), and each parameter group must hold the parameters of one saved group;
            False loads what matches and warns naming what it did not (a group holding only parameters the
            checkpoint lacks keeps its settings). Either way the model part must match something.
        extra: ``{name: object}`` saved with ``save_checkpoint(..., extra=...)``: each object's
            ``load_state_dict`` gets its saved state (KeyError when the checkpoint has no such name).
        rng: restore the generator states the checkpoint holds (rank 0's at the save, on every rank: see
            :func:`save_checkpoint`); a checkpoint without them (saved with ``rng=False``, or before they
            were saved) leaves the generators as they are, as does False.

    Returns:
        The ``step`` given to :func:`save_checkpoint`, or None when it was given none.
    """
    path = _check_path(path)
    _check_model_optimizer(model, optimizer)

    keys = checkpoint_keys(path)
    _check_materialized(model)
    _check_extra(extra)
    _check_rng(rng)
    absent = [n for n in extra or {} if not _extra_format(keys, n)]
    if absent:
        raise KeyError(
            f"extra: the checkpoint at {path!r} holds no state named {absent} (saved with extra=...)"
        )
    saved_model = {k[len(MODEL_KEY) + 1 :] for k in keys if k.startswith(MODEL_KEY + ".")}
    if not saved_model and (
        next(model.parameters(), None) is not None or next(model.buffers(), None) is not None
    ):
        raise KeyError(
            f"the checkpoint at {path!r} holds no model state (its keys: {sorted(keys)[:4]}"
            f"{' ...' if len(keys) > 4 else ''}); save_checkpoint writes the model under 'model.' (a plain "
            "dcp.save of model.state_dict() loads with torch.distributed.checkpoint.load)"
        )
    saved_state = any(k.startswith(f"{OPTIM_KEY}.state.") for k in keys)
    saved_groups = sorted({int(k.split(".")[2]) for k in keys if k.startswith(f"{OPTIM_KEY}.param_groups.")})
    if optimizer is not None:
        if not saved_groups:
            raise ValueError(
                f"optimizer: the checkpoint at {path!r} holds no optimizer state (it was saved with "
                "optimizer=None); pass optimizer=None to load the model only"
            )
        if strict and len(saved_groups) != len(optimizer.param_groups):
            raise ValueError(
                f"optimizer: the checkpoint at {path!r} holds {len(saved_groups)} parameter groups, the "
                f"optimizer has {len(optimizer.param_groups)} (strict=False loads the groups that hold the "
                "same parameters as saved ones)"
            )
    fresh = optimizer is not None and not optimizer.state
    try:
        return _load(path, keys, model, optimizer, strict, extra, rng, saved_model, saved_state, saved_groups)
    except BaseException:
        if fresh:  # the template's made-up state (a step at lr 0) must not outlive a failed load
            optimizer.state.clear()
        raise


def _saved_groups_template(path: str, saved_groups: list[int]) -> list[dict[str, Any]]:
    """What DCP loads the saved parameter groups into: each group's fields, a tensor of the saved shape and
    dtype where one was saved (``lr=torch.tensor(...)``), else a placeholder the saved value replaces."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(path).read_metadata()
    paths = metadata.planner_data or {}  # each flattened key's path in the saved state dict
    groups: list[dict[str, Any]] = [{} for _ in saved_groups]
    for key, meta in metadata.state_dict_metadata.items():
        parts = key.split(".", 3)
        if not (key.startswith(f"{OPTIM_KEY}.param_groups.") and len(parts) == 4):
            continue
        value = (
            torch.empty(meta.size, dtype=meta.properties.dtype)
            if isinstance(meta, TensorStorageMetadata)
            else None
        )
        # A nested value (a dict of the user's in a group) is flattened by DCP: rebuilt along its path.
        where = paths.get(key, (OPTIM_KEY, "param_groups", int(parts[2]), parts[3]))
        node: Any = groups[saved_groups.index(int(where[2]))]
        for step, nxt in itertools.pairwise(where[3:]):
            if isinstance(node, list):
                node.extend([None] * (step + 1 - len(node)))
            if (node[step] if isinstance(node, list) else node.get(step)) is None:
                node[step] = [] if isinstance(nxt, int) else {}
            node = node[step]
        if isinstance(node, list):
            node.extend([None] * (where[-1] + 1 - len(node)))
        node[where[-1]] = value
    return groups


def _extra_format(keys: list[str], name: str) -> str | None:
    """How ``extra[name]`` was saved: "bytes" (one value), "flat" (DCP's keys, older checkpoints), None."""
    if f"{EXTRA_KEY}.{name}" in keys:
        return "bytes"
    return "flat" if any(k.startswith(f"{EXTRA_KEY}.{name}.") for k in keys) else None


def _load(
    path: str,
    keys: list[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strict: bool,
    extra: Mapping[str, Any] | None,
    rng: bool,
    saved_model: set[str],
    saved_state: bool,
    saved_groups: list[int],
) -> int | None:
    """:func:`load_checkpoint` once its arguments and the checkpoint's keys are checked."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = _state_dicts(model, optimizer, template=True)
    current_groups: list[dict] = []
    stateless: list[str] = []
    if optimizer is not None:
        current_groups = [{**g, "params": list(g["params"])} for g in state[OPTIM_KEY]["param_groups"]]
        # The checkpoint's groups are read as saved (how many there are, which parameters each holds) and
        # matched to the optimizer's by those names below, not by position.
        groups: dict[str, Any] = {OPTIM_KEY: {"param_groups": _saved_groups_template(path, saved_groups)}}
        if OPTIM_CLASS_KEY in keys:  # older checkpoints do not say
            groups[OPTIM_CLASS_KEY] = ""
        with _single_process_intended(), _checkpoint_errors(f"loading the checkpoint at {path!r}"):
            _dcp().load(groups, checkpoint_id=path, no_dist=not _distributed())
        saved_class = groups.get(OPTIM_CLASS_KEY)
        if saved_class and not _same_class(saved_class, optimizer):
            # its settings (an AdamW's decoupled weight decay) would become this one's, its state ignored
            raise ValueError(
                f"optimizer: the checkpoint at {path!r} holds the state of a {saved_class}, this optimizer "
                f"is a {_class_name(optimizer)}: load it into the class it was saved from"
            )
        # Checked before the load (DCP copies into the model's own tensors): a refused load leaves the
        # model and optimizer as they were.
        regrouped = _regroup(groups[OPTIM_KEY]["param_groups"], current_groups, strict)
        state[OPTIM_KEY] = {"state": state[OPTIM_KEY]["state"] if saved_state else {}}
    if optimizer is not None and saved_state:
        # A parameter that had no gradient before the save (an unused branch) has no state there; the
        # template made some for it (a step at lr 0): load it without state, as it was saved.
        with_state = _names_with_state(keys)
        stateless = [n for n in state[OPTIM_KEY]["state"] if n not in with_state]
        state[OPTIM_KEY]["state"] = {n: v for n, v in state[OPTIM_KEY]["state"].items() if n not in stateless}
    missing, unexpected = _matching_keys(saved_model, state[MODEL_KEY])
    if strict and (missing or unexpected):
        raise KeyError(
            f"the checkpoint at {path!r} does not match the model's parameter names: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} (strict=False loads "
            "what matches)"
        )
    if STEP_KEY in keys:
        state[STEP_KEY] = 0
    if rng and RNG_KEY in keys:
        state[RNG_KEY] = b""
    formats = {name: _extra_format(keys, name) for name in extra or {}}
    if extra:
        state[EXTRA_KEY] = {
            name: b"" if formats[name] == "bytes" else obj.state_dict() for name, obj in extra.items()
        }
    with _single_process_intended(), _checkpoint_errors(f"loading the checkpoint at {path!r}"):
        _dcp().load(state, checkpoint_id=path, no_dist=not _distributed(), planner=_planner(strict))
    if optimizer is not None:
        state[OPTIM_KEY]["param_groups"] = regrouped
    set_model_state_dict(model, state[MODEL_KEY], options=StateDictOptions(strict=strict))
    if optimizer is not None:
        # torch's strict check asks for state of every parameter that requires a gradient
        strict_optim = strict and not (saved_state and stateless)
        with _empty_groups_set_aside(optimizer, regrouped) as nonempty:
            state[OPTIM_KEY]["param_groups"] = nonempty
            set_optimizer_state_dict(
                model, optimizer, state[OPTIM_KEY], options=StateDictOptions(strict=strict_optim)
            )
    if optimizer is not None and not saved_state:
        optimizer.state.clear()  # as a new optimizer: its first step makes the state
    for name, obj in (extra or {}).items():
        saved = state[EXTRA_KEY][name]
        obj.load_state_dict(_from_bytes(saved) if formats[name] == "bytes" else saved)
    if RNG_KEY in state:
        _set_rng_states(_from_bytes(state[RNG_KEY]))
    if not strict and (missing or unexpected):
        warnings.warn(
            f"load_checkpoint(strict=False) from {path!r}: {len(missing)} of the model's entries were not in "
            f"the checkpoint and kept their values {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
            f"{len(unexpected)} of the checkpoint's were not loaded "
            f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}",
            stacklevel=3,
        )
    return state.get(STEP_KEY)


def _names_with_state(keys: list[str]) -> set[str]:
    """Every dotted prefix of the checkpoint's ``optim.state.<name>.<field...>`` keys: a parameter named
    ``n`` has saved state when ``n`` is in the set (a field may hold dots of its own)."""
    prefix, out = f"{OPTIM_KEY}.state.", set()
    for k in keys:
        if k.startswith(prefix):
            parts = k[len(prefix) :].split(".")
            out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return out


def _portable(e: Exception) -> Exception:
    """``e`` as an exception every rank can unpickle from a broadcast: built-in types as they are, others
    (whose constructors may take other arguments) as a RuntimeError naming them."""
    return e if type(e) in (ValueError, TypeError, KeyError) else RuntimeError(f"rank 0: {e!r}")


def _some(names: list[str]) -> str:
    return f"{names[:8]}{f' (and {len(names) - 8} more)' if len(names) > 8 else ''}"


def _regroup(saved: list[Mapping[str, Any]], current: list[Mapping[str, Any]], strict: bool) -> list[dict]:
    """The saved parameter groups matched to the optimizer's by the parameters they hold, in the optimizer's
    order: group j gets the settings (lr, ...) of the saved group holding its parameters, and its own
    parameter names. Torch matches an unstepped optimizer's groups by position (a swapped order swapped
    the lrs), and a stepped one's by the last group sharing a parameter (groups split differently left
    one without any setting). A saved group split over two of the optimizer's, or two merged, is refused;
    with ``strict`` every group must hold exactly the saved one's parameters. Under ``strict=False`` a
    group holding only parameters the checkpoint lacks keeps its own settings."""
    home = {n: i for i, g in enumerate(saved) for n in g["params"]}
    now = {n for g in current for n in g["params"]}
    empty = [i for i, g in enumerate(saved) if not g["params"]]
    out, taken, empties = [], {}, 0
    for j, group in enumerate(current):
        names = list(group["params"])
        if not names:  # the k-th empty group takes the k-th saved one's settings
            empties += 1
        homes = sorted({home[n] for n in names if n in home}) if names else empty[empties - 1 : empties]
        if len(homes) > 1:
            raise ValueError(
                f"optimizer: its parameter group {j} holds parameters of the checkpoint's groups {homes} "
                f"({_some(names)}); make the groups hold the parameters they held when saved"
            )
        if not homes:
            if strict:
                raise ValueError(
                    f"optimizer: its parameter group {j} ({_some(names)}) matches none of the checkpoint's "
                    "groups (strict=False keeps that group's own settings)"
                )
            out.append({**group, "params": names})
            continue
        i = homes[0]
        elsewhere = [n for n in saved[i]["params"] if n in now and n not in names]
        if i in taken or elsewhere:
            raise ValueError(
                f"optimizer: the checkpoint's parameter group {i} ({_some(list(saved[i]['params']))}) is "
                "split over several of the optimizer's groups; make the groups hold the parameters they "
                "held when saved"
            )
        if strict and set(saved[i]["params"]) != set(names):
            raise ValueError(
                f"optimizer: its parameter group {j} holds {_some(names)}, the checkpoint's group {i} "
                f"{_some(list(saved[i]['params']))} (strict=False loads what matches)"
            )
        taken[i] = j
        out.append({**{k: v for k, v in saved[i].items() if k != "params"}, "params": names})
    return out


def _planner(strict: bool):
    from torch.distributed.checkpoint import DefaultLoadPlanner

    return DefaultLoadPlanner(allow_partial_load=not strict)


def _check_broadcast_support() -> type:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if "broadcast_from_rank0" not in {f.name for f in dataclasses.fields(StateDictOptions)}:
        raise RuntimeError(
            f"torch {torch.__version__}'s StateDictOptions has no broadcast_from_rank0, which "
            "load_full_state_dict needs; use torch >= 2.4, or load_checkpoint with a DCP checkpoint"
        )
    return StateDictOptions


def load_full_state_dict(
    model: nn.Module,
    model_state: Mapping[str, torch.Tensor] | None,
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state: Mapping[str, Any] | None = None,
    *,
    strict: bool = True,
) -> None:
    """Load full (unsharded) state dicts that only rank 0 holds; every rank keeps its own slice.

    Collective over the default process group. Rank 0 passes an ordinary ``state_dict()`` of the
    unsharded model (e.g. from ``torch.load``) and, optionally, the optimizer state of
    :func:`get_full_state_dict` (keyed by parameter name); the other ranks pass None. Rank 0 broadcasts
    one tensor at a time (``StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)``) and
    each rank copies the slice its DTensor placements ask for.

    Args:
        model: the model under this run's config.
        model_state: on rank 0 ``{parameter name: full tensor}``; None (or anything) elsewhere.
        optimizer: the model's optimizer, or None.
        optimizer_state: on rank 0 the full optimizer state dict (``get_full_state_dict(...)["optim"]``),
            required when ``optimizer`` is given; None elsewhere.
        strict: every parameter must be in ``model_state``, and each parameter group must hold the
            parameters of one group of ``optimizer_state`` (groups are matched by their parameters'
            names, as :func:`load_checkpoint` matches them). A parameter without state there (no gradient
            before the save; all of them for an optimizer that had not stepped) loads without state.

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> import smptk.parallel as sp
        >>> dist.init_process_group("gloo")
        >>> state = sp.init({"mixed_precision": "fp32"})
        >>> _ = torch.manual_seed(dist.get_rank())         # a different draw on each rank...
        >>> full = nn.Linear(4, 2)
        >>> model, report = sp.apply_data_parallel(nn.Linear(4, 2), state)
        >>> sp.load_full_state_dict(model, full.state_dict() if dist.get_rank() == 0 else None)
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(model.weight.full_tensor(), nn.Linear(4, 2).weight)   # ...rank 0's on every rank
        True
    """
    _load_full(model, model_state, optimizer, optimizer_state, strict, None)


def _load_full(
    model: nn.Module,
    model_state: Any,
    optimizer: torch.optim.Optimizer | None,
    optimizer_state: Any,
    strict: bool,
    problem: Exception | None,
) -> None:
    """:func:`load_full_state_dict`; ``problem``: what rank 0's caller already found wrong with its dicts
    (every rank raises it, as every rank raises what this finds: rank 0 raising alone left the others
    waiting in the broadcast)."""
    _check_model_optimizer(model, optimizer)
    options_cls = _check_broadcast_support()
    if not _distributed():
        raise RuntimeError(
            "load_full_state_dict broadcasts from rank 0 of the default process group, and there is none; "
            "in one process call model.load_state_dict(model_state) instead"
        )
    rank0 = dist.get_rank() == 0
    if rank0 and problem is None and not isinstance(model_state, Mapping):
        problem = TypeError(
            f"model_state: rank 0 must pass the full state dict, got {type(model_state).__name__}"
        )
    if rank0 and problem is None and optimizer is not None and not isinstance(optimizer_state, Mapping):
        problem = TypeError(
            "optimizer_state: rank 0 must pass the full optimizer state dict when an optimizer is given, "
            f"got {type(optimizer_state).__name__}"
        )
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # Rank 0 checks what it was given against the model (global shapes: DTensors carry them, no gathering)
    # and broadcasts its verdict, so every rank raises (torch raises on rank 0 only for an unexpected key,
    # and fails on a shape mismatch without a name), with the names of the parameters that have state.
    current = _state_dicts(model, optimizer)[OPTIM_KEY]["param_groups"] if optimizer is not None else []
    verdict: list[Any] = [problem, None, []]  # problem (an exception), names with state, the matched groups
    if rank0 and problem is None:
        try:
            found = _full_state_problem(model, model_state, optimizer_state if optimizer else None, strict)
            verdict[0] = None if found is None else ValueError(found)
            if verdict[0] is None and optimizer is not None:
                # matched by the parameters they hold, as load_checkpoint's
                verdict[2] = _regroup(optimizer_state["param_groups"], current, strict)
                verdict[1] = sorted(optimizer_state["state"])
        except Exception as e:  # anything rank 0 trips on reaches every rank
            verdict[0] = _portable(e)
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise verdict[0]
    groups = verdict[2]
    options = options_cls(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    # torch's broadcast from rank 0 sends a non-contiguous view wrong (the split halves of a stacked
    # tensor arrived as other elements of its storage, torch 2.13): send contiguous copies of those.
    full = {k: v.contiguous() if torch.is_tensor(v) else v for k, v in model_state.items()} if rank0 else {}
    set_model_state_dict(model, full, options=options)
    if optimizer is not None:
        # Torch keeps rank 0's 0-d tensors (Adam's "step") as the optimizer's own: the caller's dict would
        # count up with training. Copies of those (a few bytes each) leave it as it was.
        # The same for every tensor of a parameter that is a plain tensor here (not sharded: a router, a
        # layer off the tp mesh): torch keeps rank 0's as the optimizer's own, and training would change
        # the caller's snapshot (a second load of it then started from the trained state).
        plain = {
            name
            for group, saved in zip(optimizer.param_groups, current, strict=True)
            for p, name in zip(group["params"], saved["params"], strict=True)
            if not isinstance(p, DTensor)
        }
        given = {}
        if rank0:
            per_param = {
                name: _map_tensors(
                    st, lambda t, whole=name in plain: t.clone() if whole or t.dim() == 0 else t
                )
                for name, st in optimizer_state["state"].items()
            }
            given = {**optimizer_state, "state": per_param, "param_groups": groups}
        # A parameter without saved state (no gradient before the save; every one for an optimizer that had
        # not stepped) loads without state, as load_checkpoint's: torch makes some (a step at lr 0: Adam's
        # count 1, moments wd * p) and keeps it for what rank 0's dict lacks, and its strict check refuses.
        with_state = set(verdict[1])
        stateless = [
            p
            for group, saved in zip(optimizer.param_groups, current, strict=True)
            for p, name in zip(group["params"], saved["params"], strict=True)
            if name not in with_state
        ]
        optim_options = dataclasses.replace(options, strict=strict and not stateless)
        with _grads_set_aside(optimizer), _empty_groups_set_aside(optimizer, groups) as nonempty:
            if rank0:
                given["param_groups"] = nonempty
            set_optimizer_state_dict(model, optimizer, given, options=optim_options)
        for p in stateless:
            optimizer.state.pop(p, None)


def _full_state_problem(
    model: nn.Module, model_state: Mapping[str, Any], optimizer_state: Mapping[str, Any] | None, strict: bool
) -> str | None:
    """What is wrong with rank 0's full state dicts for ``model``, or None."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    wanted = get_model_state_dict(model)
    shapes = {k: tuple(v.shape) for k, v in wanted.items() if torch.is_tensor(v)}
    bad = [
        f"{k}: {tuple(v.shape)}, the model's {shapes[k]}"
        for k, v in model_state.items()
        if torch.is_tensor(v) and k in shapes and tuple(v.shape) != shapes[k]
    ]
    if bad:
        more = f" (and {len(bad) - 8} more)" if len(bad) > 8 else ""
        return "model_state: tensors of the wrong shape: " + "; ".join(bad[:8]) + more
    if strict:
        missing = sorted(set(wanted) - set(model_state))
        unexpected = sorted(set(model_state) - set(wanted))
        if missing or unexpected:
            return (
                f"model_state does not match the model's names (strict): missing {_some(missing)}, "
                f"unexpected {_some(unexpected)}"
            )
    if optimizer_state is not None:
        per_param = optimizer_state.get("state")
        if not isinstance(per_param, Mapping) or "param_groups" not in optimizer_state:
            return (
                "optimizer_state: expected {'state': ..., 'param_groups': ...}, get_full_state_dict's 'optim'"
            )
        groups = optimizer_state["param_groups"]
        if not isinstance(groups, list) or not all(
            isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups
        ):
            return "optimizer_state: 'param_groups' must be a list of dicts with 'params' lists"
        foreign = [k for k in per_param if not isinstance(k, str) or k not in wanted]
        foreign += [n for g in groups for n in g["params"] if not isinstance(n, str)]
        if foreign:
            position = any(isinstance(k, int) for k in foreign)
            return (
                f"optimizer_state: its state is keyed by {_some(foreign)}, not by this model's parameter "
                "names"
                + (
                    " (torch's optimizer.state_dict() keys by position; pass get_full_state_dict(model, "
                    "optimizer)['optim'], keyed by name)"
                    if position
                    else ""
                )
            )
    return None


def _map_tensors(obj: Any, fn) -> Any:
    """``obj`` (nested dicts, lists and tuples, as state dicts are) with ``fn`` applied to every tensor."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def get_full_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, rank0_only: bool = True
) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` with every tensor whole, and a copy: none shares memory with the
    live model or optimizer (collective).

    With ``rank0_only`` (default) only rank 0 gets the tensors, on CPU, and the others the same keys
    without tensors (``{"model": {}, "optim": {}}``), so one host's memory holds one copy
    (what :func:`load_full_state_dict` takes back); False gives them to every rank (the tensors then stay
    on the parameters' device).

    Example (one process, no process group; under torchrun every rank calls it, and with the default
    ``rank0_only`` rank 0 gets what is shown here, the other ranks no tensors: ``full["model"] == {}``)::

        >>> import torch
        >>> from smptk.parallel import get_full_state_dict
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> full = get_full_state_dict(model, opt)
        >>> sorted(full), sorted(full["model"]), full["model"]["weight"].shape
        (['model', 'optim'], ['bias', 'weight'], torch.Size([2, 4]))
        >>> with torch.no_grad():
        ...     _ = model.weight.add_(1.0)                 # training goes on...
        >>> torch.equal(full["model"]["weight"], model.weight)   # ...the snapshot is a copy
        False
    """
    _check_model_optimizer(model, optimizer)
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    return _copies(_state_dicts(model, optimizer, options), model, optimizer)


def _copies(state: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
    """``state`` with every tensor that shares memory with the live model or optimizer replaced by a copy.
    Torch returns an unsharded tensor that needed no gathering as the parameter itself (a replicated one,
    or a bias under tensor parallelism; ``cpu_offload`` copies only what is not on the CPU already), so a
    later optimizer step would change the "snapshot"."""
    live = [_local(t) for t in (*model.parameters(), *model.buffers())]
    if optimizer is not None:
        live += [_local(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    storages = {t.untyped_storage().data_ptr() for t in live if t.numel()}

    def fresh(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if t.numel() and t.untyped_storage().data_ptr() in storages else t

    return _map_tensors(state, fresh)


__all__ = [
    "checkpoint_keys",
    "get_full_state_dict",
    "load_checkpoint",
    "load_full_state_dict",
    "save_checkpoint",
]
