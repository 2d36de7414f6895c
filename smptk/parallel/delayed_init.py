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
:mod:`smptk.parallel.shard_init`), so a model of smptk layers and unsharded torch layers gets the values
the same resets in the same order give the unsharded model. A torch module whose own parameters are
DTensors (sharded by ``fully_shard`` or a torch ParallelStyle): on CUDA its ``reset_parameters`` draws
with torch's DTensor random-number tracker (the values a full-tensor draw on the GPU would give each
shard); on CPU, where the tracker draws every shard locally (each rank the same numbers, and fewer of
them than the whole tensor), it runs on full-size CPU stand-ins of those parameters and each rank keeps
its piece of those the reset wrote, so the module and every later one get the unsharded model's values.
Where values must equal a checkpoint, load it afterwards (:func:`~smptk.parallel.load_full_state_dict` or
:func:`~smptk.parallel.load_checkpoint`). Buffers come back uninitialized unless their module's
``reset_parameters`` refills them (torch's norms do): a module with a computed buffer must recompute it
there (Hugging Face's rotary modules, which have no reset, are refilled from their config:
:func:`refill_rotary`). A module that holds parameters or buffers of its own and has no ``reset_parameters``
(outside a Hugging Face model, see below) is refused before anything is allocated (its values would be
whatever memory ``to_empty`` gave), and every floating parameter and buffer is filled with NaN before the
resets; after them each one's version counter (the same on every rank, an empty shard's too) says that a reset
wrote it, and the floating ones must hold no NaN (a reset that wrote part of one), so one that no reset wrote
(a subclass adding parameters its inherited reset does not know, a position-id or mask buffer built in
``__init__``) is named in a RuntimeError; ``allow_uninitialized=True`` allows both when a checkpoint load
follows.

Hugging Face models (a ``transformers`` ``PreTrainedModel`` anywhere in ``model``, detected without
importing transformers): the values are the eager build's, equal to it bit for bit, as for training from
scratch (materialized on the CPU; on CUDA the modules initialized in place draw from the CUDA generator, as an
eager build on CUDA does, while smptk's layers and the MoE blocks draw on the CPU: the same distributions,
other values).

An eager build draws torch's default init in each module's constructor, then, where each Hugging Face model's
constructor ends, its ``post_init()`` draws again: ``_init_weights`` on every module of its subtree, children
before parents (``normal(0, initializer_range)`` for Linear and Embedding, zero biases, ones for norm weights,
the padding row zeroed), skipping what a nested model's ``post_init`` marked ``_is_hf_initialized``, and only
then ties the head to the embedding. :func:`materialize` replays that: the resets in ``model.modules()``
order, and each model's ``_initialize_weights`` walk after the last module of its subtree, before the modules
its parent builds next. So its modules need no ``reset_parameters`` (the norms), and one its ``_init_weights``
leaves unwritten is named as above. smptk's layers that :func:`~smptk.parallel.transform` swapped in
(ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding) take the values ``_init_weights`` gives the
``nn.Linear`` / ``nn.Embedding`` they replace, and each :class:`~smptk.parallel.MoE` it swapped in the values
the Hugging Face sparse block it replaces gets (router and experts ``normal(0, initializer_range)``; transform
keeps the meta-built block for this), drawn full-size on the CPU (each rank keeps its piece; one layer at a
time, so the host needs room for the largest one: a Mixtral-8x7B block is 1.4 G values), so a transformed
model equals the eager model too (checked at tp 2 with a tied, padded embedding and biases, at ep 2 and at tp
2 x ep 2). Not replayed: an init a module's ``__init__`` draws with no ``reset_parameters`` (GPT-2's
``Conv1D``: the later draws then differ, their distributions do not).

Order: the resets run in ``model.modules()`` order (a parent before its children), so the values are the
eager build's when the model builds its submodules in the order it registers them and initializes them
only in ``reset_parameters``, where only leaf modules draw, or a parent's reset draws only for children
whose constructors draw nothing (:class:`~smptk.parallel.MoE` and its experts). An init written in a
parent's ``__init__`` is not replayed. A module whose own tensors an ancestor's reset already wrote, all
of them (MoE's reset resets its experts), is not reset again; one that reset wrote in part (a parent
zero-initializing a child's weight, not its bias) is reset and keeps what the ancestor wrote, as the
eager build, where the parent's reset ran last, keeps it. What was written is read from the tensors'
version counters, the same on every rank (an empty shard's too); during the resets ``t.data`` of the
model's tensors is ``t.detach()``, which shares ``t``'s counter, so a write through ``.data`` counts too.
Where a parent's reset draws random values for itself or its children, it draws them here before its
children's draws and, eager, after them: the same distribution, other values (in the modules after it
too). A buffer several modules register stays one tensor (``to_empty`` would untie it), and so does a
parameter shared by several modules (an embedding tied to the head), which keeps the draw of its first
owner in that order; the later owners' resets still draw, as their eager construction did, and their
values are discarded. That is the eager build's values when the tie gives the later module the earlier
one's parameter (Hugging Face's ``lm_head.weight = embed_tokens.weight``); the opposite tie (nanoGPT's
``wte.weight = lm_head.weight``, whose eager values are the head's draw) gets the embedding's draw.

Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

    >>> import torch
    >>> import torch.distributed as dist
    >>> from torch import nn
    >>> import smptk.parallel as sp
    >>> dist.init_process_group("gloo")
    >>> def build_model():
    ...     return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    >>> state = sp.init({"delayed_parameter_initialization": True})
    >>> with torch.device("meta"):
    ...     model = build_model()
    >>> model, report = sp.apply_data_parallel(model, state)
    >>> sp.materialize(model, state)                  # this rank's shards, on state's device
    3
    >>> _ = torch.manual_seed(state.seed_for())
    >>> eager = build_model()                         # the values an eager build draws
    >>> torch.equal(model[2].weight.full_tensor(), eager[2].weight)
    True
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator

import torch
from torch import nn
from torch.autograd.graph import increment_version
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from smptk.parallel.config import ParallelState, state_or_current
from smptk.parallel.shard_init import local as _local
from smptk.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

# where transform keeps, outside the module tree, the meta-built Hugging Face sparse block a MoE replaces
HF_BLOCK = "_hf_block"


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
    """Give a meta-built (and possibly sharded) ``model`` memory and initial values: its modules'
    ``reset_parameters``, and a Hugging Face model's ``_init_weights`` where its eager constructor ran them,
    so the values are the eager build's (see the module docstring). Collective only in what
    ``reset_parameters`` does (nothing for torch's and smptk's layers).

    Args:
        model: a model whose parameters and buffers are all on the meta device.
        state: the :func:`smptk.parallel.init` state (default :func:`~smptk.parallel.current`): its device
            type and ``seed_for()``.
        device: where to allocate (default: the state's device; CUDA: the current device).
        allow_uninitialized: allow modules that hold parameters or buffers and have no
            ``reset_parameters`` (outside a Hugging Face model, whose ``_init_weights`` initializes its
            modules), and tensors no reset or ``_init_weights`` wrote: floating ones
            are then NaN, the others uninitialized memory. For a caller that loads a checkpoint next
            (:func:`~smptk.parallel.load_hf_state_dict`, :func:`~smptk.parallel.load_full_state_dict`,
            :func:`~smptk.parallel.load_checkpoint`).

    Returns:
        The number of modules whose ``reset_parameters`` ran.

    Raises:
        TypeError: ``model`` is not an nn.Module, or ``state`` not a ParallelState (a config dict, say).
        ValueError: a parameter or buffer is not on the meta device (materializing would discard its
            values), a module holding parameters or buffers has no ``reset_parameters`` (nothing would
            give them values), or ``device`` is the meta device; raised before anything is allocated.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    state = state_or_current(state)
    real = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if not t.is_meta]
    if real:
        shown = ", ".join(real[:3]) + (f" and {len(real) - 3} more" if len(real) > 3 else "")
        raise ValueError(
            f"model: {shown} not on the meta device; materialize() allocates a meta-built model (build it "
            "under torch.device('meta')) and would discard these values"
        )
    hf_class = _hf_model_class()
    hf_built = {id(m) for pm in model.modules() if _is_hf_model(pm, hf_class) for m in pm.modules()}
    blocks = [b for m in model.modules() if (b := _hf_block(m, hf_built)) is not None]
    silent = [
        name or type(m).__name__
        for name, m in model.named_modules()
        if next(iter((*m.parameters(recurse=False), *m.buffers(recurse=False))), None) is not None
        and not callable(getattr(m, "reset_parameters", None))
        and not _is_hf_rotary(m)  # refilled from its config
        and id(m) not in hf_built  # initialized by the Hugging Face model's _init_weights
    ]
    if silent and not allow_uninitialized:
        shown = ", ".join(silent[:3]) + (f" and {len(silent) - 3} more" if len(silent) > 3 else "")
        raise ValueError(
            f"model: {shown} hold parameters or buffers but have no reset_parameters(), through which "
            "materialize() gives them values (they would keep uninitialized memory); define one, or pass "
            "allow_uninitialized=True when a checkpoint is loaded next"
        )
    target = torch.device(device) if device is not None else _device(state)
    if target.type == "meta":  # to_empty would keep the model on meta and the resets could not write it
        raise ValueError(
            f"device: expected a device with memory (cpu, cuda...), got {target}; materialize() allocates "
            "the meta-built model there"
        )
    ties = _shared_tensors(model)
    model.to_empty(device=target)  # unties shared tensors (each slot gets its own new tensor)
    for slots in ties:
        owner, kind, key = slots[0]
        first = getattr(owner, kind)[key]
        for module, kind, name in slots[1:]:
            getattr(module, kind)[name] = first
    values = _floating_values(model)
    with torch.no_grad():
        for _, t in values:
            t.fill_(float("nan"))  # what no reset_parameters wrote shows up below
    # Every write bumps a tensor's version counter, empty shards' included, so what the versions say was
    # written is the same on every rank (a NaN test of the local values is not: an empty FSDP2 shard
    # holds none, and that rank alone reset an MoE's experts again, shifting its random stream)
    unwritten = _versions(model)
    devices = []
    if target.type == "cuda":
        devices = [target.index if target.index is not None else torch.cuda.current_device()]
    ran = 0
    done: set[int] = set()  # tensors a reset has given values (a shared one keeps its first owner's)
    hf_done: set[int] = set()  # tensors a Hugging Face model's _init_weights has given values
    for m in (*(m for m in model.modules() if id(m) in hf_built), *(m for b in blocks for m in b.modules())):
        m.__dict__.pop("_is_hf_initialized", None)  # no values yet: every module is initialized
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(state.seed_for())
        with torch.no_grad(), _DataWritesCount(unwritten):
            for module, step in _construction_order(model, hf_class, hf_built):
                if step == "post_init":  # a Hugging Face model's post_init(), at the end of its construction
                    _hf_post_init(module, hf_class, hf_done, hf_built)
                    continue
                if step == "hf_block":  # a MoE transform swapped in: the resets its block's constructor ran
                    ran += _reset_hf_block(_hf_block(module, hf_built))
                    continue
                reset = getattr(module, "reset_parameters", None)
                if not callable(reset):
                    continue
                own = list(module.parameters(recurse=False))
                tensors = [*own, *module.buffers(recurse=False)]
                written = [t for t in tensors if _version(t) != unwritten[id(t)]]
                # all written by an ancestor's reset that resets its children (MoE's): not drawn again. A
                # tied parameter or shared buffer written by its first owner (in ``done``) is no reason:
                # that module's reset still runs, as eager
                if tensors and len(written) == len(tensors) and not any(id(t) in done for t in tensors):
                    done.update(id(t) for t in tensors)
                    continue
                # the rest keep their values through this reset (which still draws, as eager): a tied
                # parameter its first owner drew (the tie assigned after both modules were built lost the
                # later draw), and what an ancestor's reset wrote (a zero-initialized output projection:
                # eager, that reset ran after this one, at the end of the parent's constructor)
                kept = [(t, _local(t).clone()) for t in written]
                if "generator" in inspect.signature(reset).parameters:  # smptk's layers: one stream
                    reset(generator=torch.default_generator)
                else:
                    _reset_torch_module(module, reset)
                for t, value in kept:
                    _local(t).copy_(value)
                done.update(id(t) for t in tensors)
                ran += 1
    refill_rotary(model)
    if not allow_uninitialized:
        _check_all_written(model, values, unwritten)
    return ran


def _hf_model_class() -> type | None:
    """transformers' ``PreTrainedModel`` where transformers is loaded (never imported here: a model built
    from it has loaded it), else None."""
    return getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)


def _is_hf_model(module: nn.Module, hf_class: type | None) -> bool:
    return hf_class is not None and isinstance(module, hf_class)


def _hf_block(module: nn.Module, hf_built: set[int]) -> nn.Module | None:
    """The meta-built Hugging Face sparse block a MoE inside a Hugging Face model replaces (kept by
    :func:`~smptk.parallel.transform` when the model was built on meta), else None."""
    return module.__dict__.get(HF_BLOCK) if id(module) in hf_built else None


def _construction_order(
    model: nn.Module, hf_class: type | None, hf_built: set[int]
) -> Iterator[tuple[nn.Module, str]]:
    """``(module, "reset")`` for every module in ``model.modules()`` order (the order an eager build
    constructs them), and ``(hf_model, "post_init")`` after the last module of each Hugging Face model's
    subtree: where its constructor ends in ``post_init()``, before the modules its parent builds next. A
    MoE that replaces a Hugging Face block gives ``(moe, "hf_block")`` instead of its subtree: eager, the
    block was built there."""
    seen: set[int] = set()

    def walk(module: nn.Module) -> Iterator[tuple[nn.Module, str]]:
        seen.add(id(module))
        if _hf_block(module, hf_built) is not None:
            yield module, "hf_block"
            return
        yield module, "reset"
        for child in module.children():
            if id(child) not in seen:
                yield from walk(child)
        if _is_hf_model(module, hf_class):
            yield module, "post_init"

    return walk(model)


def _reset_hf_block(block: nn.Module) -> int:
    """Run the resets an eager build of ``block`` (meta) ran in its constructor, on a full-size CPU copy
    held until its model's ``post_init``; a block without any (Mixtral's, Qwen3-MoE's: their constructors
    draw nothing) stays on meta until then, so one block at a time is allocated. Returns how many ran."""
    resets = [r for m in block.modules() if callable(r := getattr(m, "reset_parameters", None))]
    if resets:
        _allocate(block)
        for reset in resets:
            reset()
    return len(resets)


def _allocate(block: nn.Module) -> None:
    """Give a meta-built module CPU memory, its floating tensors NaN (what nothing writes shows up)."""
    if any(t.is_meta for t in (*block.parameters(), *block.buffers())):
        block.to_empty(device="cpu")
        for t in (*block.parameters(), *block.buffers()):
            if t.is_floating_point():
                t.detach().fill_(float("nan"))


def _take_block_values(moe: nn.Module, block: nn.Module, written: set[int]) -> None:
    """Write into ``moe`` (each rank its piece) the values ``block``, the Hugging Face block it replaces,
    holds, in smptk's layout (:func:`~smptk.parallel.smptk_layout`); its buffers, which the block has no
    counterpart for (the load counts, the expert bias), start at zero, as ``MoE.reset_parameters`` sets
    them (without its draws, which eager does not make there). ``block`` goes back to meta."""
    from smptk.parallel.transform import smptk_layout  # transform imports this module

    for buffer in moe.buffers():
        _local(buffer).zero_()
    values = smptk_layout({f"b.{n}": t for n, t in (*block.named_parameters(), *block.named_buffers())})
    for name, value in values.items():
        target = moe.get_parameter(name[2:])
        _keep_piece(target, value.detach())
        written.add(id(target))
    for m in moe.modules():
        m._is_hf_initialized = True
    # the walk recorded the block's tensors as written: freed now, their ids may come back as another's
    written.difference_update(id(t) for t in (*block.parameters(), *block.buffers()))
    block.to_empty(device="meta")


def _hf_post_init(hf_model: nn.Module, hf_class: type, written: set[int], hf_built: set[int]) -> None:
    """The values ``hf_model.post_init()`` gives at the end of its eager construction, in the same random
    draws: ``initialize_weights()``'s walk (``smart_apply``: children before their parent, a nested Hugging
    Face model's modules by that model's ``_initialize_weights``), which initializes each module not yet
    marked ``_is_hf_initialized`` (a nested model's ``post_init`` ran first and marked its own) and marks
    it. A tensor an earlier module's ``_init_weights`` wrote (in ``written``) keeps those values: eager,
    the tie (``lm_head.weight = embed_tokens.weight``) comes after the draws, and the head's is discarded.
    CPU DTensors are initialized as full-size stand-ins (:func:`_reset_torch_module`); a MoE that replaces a
    Hugging Face block takes the values the walk gives that block (full-size on the CPU)."""
    guard = getattr(sys.modules.get("transformers.initialization"), "guard_torch_init_functions", None)
    custom = hf_model.is_custom_code() if callable(getattr(hf_model, "is_custom_code", None)) else None

    def walk(module: nn.Module, owner: nn.Module) -> Iterator[tuple[nn.Module, nn.Module]]:
        block = _hf_block(module, hf_built)
        if block is not None:  # the block's modules, then the MoE takes the block's values
            _allocate(block)
            yield from walk(block, owner)
        else:
            for child in module.children():
                yield from walk(child, child if _is_hf_model(child, hf_class) else owner)
        yield module, owner

    def initialize(module: nn.Module, owner: nn.Module) -> None:
        if custom is None:  # transformers < 5: _initialize_weights(module)
            owner._initialize_weights(module)
        else:
            owner._initialize_weights(module, custom)

    with guard() if guard is not None else contextlib.nullcontext():
        for module, owner in walk(hf_model, hf_model):
            if getattr(module, "_is_hf_initialized", False):
                continue
            block = _hf_block(module, hf_built)
            if block is not None:
                _take_block_values(module, block, written)
                continue
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            kept = [(t, _local(t).clone()) for t in tensors if id(t) in written]
            stand_in = _torch_equivalent(module)
            if stand_in is None:
                _reset_torch_module(module, lambda m=module, o=owner: initialize(m, o))
            else:  # a layer transform swapped in: the values _init_weights gives the layer it replaced
                before = {name: full._version for name, full in stand_in.named_parameters()}
                initialize(stand_in, owner)
                module._is_hf_initialized = True
                for name, full in stand_in.named_parameters():
                    if full._version != before[name]:  # else it stays unwritten, and is named as such
                        _keep_piece(getattr(module, name), full.detach())
            for t, value in kept:
                _local(t).copy_(value)
            written.update(id(t) for t in tensors)


def _torch_equivalent(module: nn.Module) -> nn.Module | None:
    """For smptk's ColumnParallelLinear (one weight), RowParallelLinear and VocabParallelEmbedding: the
    ``nn.Linear`` / ``nn.Embedding`` they stand for, full-size on the CPU, uninitialized (built on meta:
    no draws), for a Hugging Face ``_init_weights`` that recognizes torch's classes; else None."""
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and not getattr(module, "swiglu", False):
        shape, bias = (module.in_features, module.out_features), module.bias is not None
        torch_module = nn.Linear(*shape, bias=bias, device="meta", dtype=module.weight.dtype)
    elif isinstance(module, VocabParallelEmbedding):
        shape = (module.num_embeddings, module.embedding_dim, module.padding_idx)
        torch_module = nn.Embedding(*shape, device="meta", dtype=module.weight.dtype)
    else:
        return None
    _allocate(torch_module)  # NaN: a part _init_weights leaves shows up as materialize's own fill does
    return torch_module


_DATA = torch._C.TensorBase.__dict__["data"]  # the descriptor whose __get__ is ``tensor.data``


class _DataWritesCount(TorchFunctionMode):
    """While the resets run, ``t.data`` of the model's parameters and buffers (ids in ``tracked``) is
    ``t.detach()``: the same memory, and the version counter shared with ``t`` (``.data`` gets a counter
    of its own), so a reset that writes ``child.weight.data.zero_()`` counts as writing ``child.weight``;
    ``t.data = value`` sets and counts as a write too."""

    def __init__(self, tracked: dict[int, tuple[int, int]]) -> None:
        super().__init__()
        self.tracked = tracked

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is not _DATA or id(args[0]) not in self.tracked:
            return func(*args, **(kwargs or {}))
        if func.__name__ == "__get__":
            return args[0].detach()
        out = func(*args, **(kwargs or {}))  # ``t.data = value``: a write too
        increment_version(args[0])
        return out


def _version(t: torch.Tensor) -> tuple[int, int]:
    """``t``'s version counter and its local tensor's (a write to a DTensor's shard moves only the latter)."""
    return t._version, _local(t)._version


def _versions(model: nn.Module) -> dict[int, tuple[int, int]]:
    """:func:`_version` of every parameter and buffer of ``model``, by id."""
    with torch.no_grad():  # a DTensor's to_local() is then its local tensor itself
        return {id(t): _version(t) for t in (*model.parameters(), *model.buffers())}


def _is_hf_rotary(module: nn.Module) -> bool:
    """A Hugging Face rotary-embedding module: computed buffers (``inv_freq``), no ``reset_parameters``
    (a module of that name that has one refills its own buffers, and may take other constructor arguments)."""
    return (
        type(module).__name__.endswith("RotaryEmbedding")
        and hasattr(module, "config")
        and not callable(getattr(module, "reset_parameters", None))
    )


def refill_rotary(model: nn.Module) -> int:
    """Recompute every Hugging Face rotary module's buffers (``inv_freq``...) from a fresh instance built
    from its config on the CPU; returns how many modules were refilled. :func:`materialize` runs it (these
    modules have no ``reset_parameters``, and a checkpoint does not hold their non-persistent buffers).

    Example (one process)::

        >>> import torch
        >>> import transformers
        >>> from smptk.parallel.delayed_init import refill_rotary
        >>> cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
        ...                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
        >>> with torch.device("meta"):
        ...     model = transformers.LlamaForCausalLM(cfg)
        >>> model = model.to_empty(device="cpu")          # the rotary tables are uninitialized memory now
        >>> refill_rotary(model)
        1
        >>> fresh = transformers.LlamaForCausalLM(cfg)
        >>> torch.equal(model.model.rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq)
        True
    """
    done = 0
    for module in model.modules():
        if not _is_hf_rotary(module):
            continue
        with torch.device("cpu"):
            fresh = type(module)(module.config)
        with torch.no_grad():
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf)
        for key, value in vars(fresh).items():  # attention_scaling and the like
            if not key.startswith("_") and isinstance(value, (int, float)):
                setattr(module, key, value)
        done += 1
    return done


def _shared_tensors(model: nn.Module) -> list[list[tuple[nn.Module, str, str]]]:
    """The (module, ``"_parameters"`` or ``"_buffers"``, name) slots of each parameter or buffer held in more
    than one slot (a tied embedding and head, a table several layers register)."""
    slots: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is not None:
                    slots.setdefault(id(t), []).append((module, kind, name))
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


def _check_all_written(
    model: nn.Module, values: list[tuple[str, torch.Tensor]], unwritten: dict[int, tuple[int, int]]
) -> None:
    """Raise, naming them, when parameters or buffers were never written (their version counters, the same
    on every rank, an empty shard's too) or still hold the NaN that materialize filled the floating ones
    with (a reset that wrote part of one): a ``reset_parameters`` that does not cover all of its module's
    tensors (a subclass that adds parameters and inherits its parent's reset, a position-id or mask buffer
    built in ``__init__``) left them uninitialized."""
    flags = torch.stack([t.isnan().any() for _, t in values]).tolist() if values else []  # one host sync
    names = [name for (name, _), bad in zip(values, flags, strict=True) if bad]
    with torch.no_grad():
        seen: set[int] = set()
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            if id(t) not in seen and name not in names and t.numel() > 0 and _version(t) == unwritten[id(t)]:
                names.append(name)
            seen.add(id(t))
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
    for full in stand_ins.values():
        if full.is_floating_point():
            full.fill_(float("nan"))  # a part the reset leaves shows up as materialize's own fill does
    before = {name: full._version for name, full in stand_ins.items()}
    try:
        for name, full in stand_ins.items():
            module._parameters[name] = full
        reset()
    finally:
        for name, p in sharded.items():
            module._parameters[name] = p
    for name, p in sharded.items():
        if stand_ins[name]._version == before[name]:
            continue  # the reset did not write it (a parameter a subclass adds): it stays unwritten
        _keep_piece(p, stand_ins[name].detach())


def _keep_piece(p: torch.Tensor, full: torch.Tensor) -> None:
    """Write into ``p`` (a DTensor: this rank's piece, ``distribute_tensor`` without communication) the
    values of the full-size ``full``."""
    if isinstance(p, DTensor):
        full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
        p = p.to_local()
    p.copy_(full)


__all__ = ["materialize", "refill_rotary"]
