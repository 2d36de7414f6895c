"""Activation checkpointing of a model's blocks, as the config's ``activation_checkpointing`` asks.

:func:`apply_activation_checkpointing` makes each unit (by default every block of the model's first
``nn.ModuleList``, the same units :func:`smptk.parallel.apply_data_parallel` picks) recompute in backward
what its forward would have kept for it, through torch's composable ``checkpoint`` (non-reentrant
``torch.utils.checkpoint`` installed as forward hooks: no wrapper module, so parameter names, FSDP2 and
torch.distributed.checkpoint see the model unchanged):

- ``"full"``: a unit keeps only its inputs; its whole forward runs again in backward. Korthikanti et al.
  count ``2sbh`` bytes per transformer layer kept this way, against ``sbh(34 + 5as/h)`` without it.
- ``"selective"``: torch's selective checkpointing with an op-level policy: the outputs of matrix
  products, attention kernels and of collectives are kept (recomputing them costs FLOPs or
  communication), everything else (norms, activation functions, elementwise ops, softmax) is
  recomputed, and so are all-gathers, whose output is the group size times their input (gathering
  again in backward keeps only the input, as Megatron-LM's sequence parallelism does).
  :func:`saved_ops` lists the ops kept: torch's (:data:`SAVED_OPS`) and smptk's own, whose forwards
  (the Triton GEMMs of ``smptk.kernels``, the fused tensor-parallel linears and the collectives of
  ``smptk.comm.functional``) run as dispatcher ops ``torch.ops.smptk.*`` while a dispatch mode such as
  this policy's is active (:mod:`smptk.kernels._dispatch`), so the policy sees them and their
  backward finds the kept outputs instead of launching the kernel again.

Dropout: the recompute draws the forward's masks, so the gradients are those without checkpointing, bit
for bit (tests/test_checkpointing.py: nn.Dropout, F.dropout, attention dropout, full and selective,
offloaded or not). Torch's checkpoint restores the default CPU generator before it and, on CUDA, the
generators of the devices of the unit's positional tensor arguments (torch's ``get_device_states(*args)``:
a unit that gets its tensors only as keyword arguments has its CUDA generator left where backward found
it). A :meth:`~smptk.parallel.ParallelState.fork_rng` region seeds from the CPU generator, so its masks
come back in either case; a generator passed to an op is not replayed (wrong gradients, no error).

Offloading (``sm_activation_offloading``, :class:`ActivationOffloader`): what a checkpointed unit keeps,
its inputs, moves to pinned CPU memory during forward (a copy on a side stream, overlapping the unit's own
compute; the compute stream waits for it where the unit ends, so no later in-place write can race it) and
comes back ahead of backward: when backward reaches a unit forward, the inputs of the horizon - 1 unit
forwards that ran before it (call order: micro-batches in flight and blocks called in any order keep to
their own) start their copies back on another side stream, so at most ``activation_loading_horizon``
units' inputs are on the GPU at once and the copies overlap the backward of the units after them. The
inputs are caught as torch's checkpoint saves them (a saved-tensor hook around each unit's forward,
outside the checkpoint's own): its positional tensor arguments, so the recompute and everything it saves
inside the unit are untouched, and keyword arguments stay on the device (see :class:`ActivationOffloader`).
CPU tensors stay where they are (there is nowhere to offload to); an in-place write to one before backward
raises there, as without offloading.

Apply it before :func:`~smptk.parallel.apply_data_parallel` (as torchtitan applies AC before FSDP): FSDP2
gathers a unit's parameters again for its recompute.

Example (one process, a world of 1; under torchrun every rank runs the same lines)::

    >>> import torch
    >>> import torch.distributed as dist
    >>> from torch import nn
    >>> import smptk.parallel as sp
    >>> class Net(nn.Module):
    ...     def __init__(self, blocks=2):
    ...         super().__init__()
    ...         block = lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU())
    ...         self.layers = nn.ModuleList(block() for _ in range(blocks))
    ...     def forward(self, x):
    ...         for layer in self.layers:
    ...             x = layer(x)
    ...         return x
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> state = sp.init({"activation_checkpointing": "full"})
    >>> model = Net()
    >>> sp.apply_activation_checkpointing(model, state)     # every block of model.layers
    ['layers.0', 'layers.1']
    >>> model, report = sp.apply_data_parallel(model, state)
    >>> model(torch.randn(4, 8)).sum().backward()          # each block's forward runs again in backward
    >>> sp.reset()
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import warnings
import weakref

import torch
from torch import nn

from smptk.kernels import _dispatch
from smptk.parallel.config import ACTIVATION_CHECKPOINTING, ParallelState, current
from smptk.parallel.fsdp import ModuleSpec, select_units

_aten = torch.ops.aten


def _saved_ops() -> frozenset:
    """The ops whose outputs "selective" keeps: the ones this torch build has."""
    names = [
        (_aten, "mm"), (_aten, "addmm"), (_aten, "bmm"), (_aten, "baddbmm"), (_aten, "_scaled_mm"),
        (_aten, "_scaled_dot_product_flash_attention"), (_aten, "_scaled_dot_product_efficient_attention"),
        (_aten, "_scaled_dot_product_cudnn_attention"),
        (_aten, "_scaled_dot_product_flash_attention_for_cpu"),
        (torch.ops._c10d_functional, "reduce_scatter_tensor"), (torch.ops._c10d_functional, "all_reduce"),
        (torch.ops._c10d_functional, "all_to_all_single"),
    ]  # fmt: skip
    ops = []
    for namespace, name in names:
        packet = getattr(namespace, name, None)
        if packet is not None:
            ops.append(packet.default)
    return frozenset(ops)


SAVED_OPS = _saved_ops()

# smptk's dispatcher ops whose outputs "selective" recomputes: an all-gather's output is W times its input,
# and gathering again in backward keeps only the input (Megatron-LM's sequence parallelism does the same;
# torchtitan's policy keeps no all-gather either). torch's functional all-gather is left out of SAVED_OPS
# for the same reason.
RECOMPUTED_SMPTK_OPS = ("smptk::all_gather",)
_kept_smptk: dict[int, frozenset] = {}  # len(_dispatch.OPS) -> the smptk ops kept (ops register on import)


def saved_ops() -> frozenset:
    """Every op whose outputs "selective" keeps: torch's (:data:`SAVED_OPS`) and smptk's dispatcher ops
    (``torch.ops.smptk.*``: the Triton GEMM forwards, the fused tensor-parallel linears, the collectives)
    but those in :data:`RECOMPUTED_SMPTK_OPS`.

    Example::

        >>> import torch
        >>> import smptk.kernels                       # registers the torch.ops.smptk ops
        >>> from smptk.parallel.checkpointing import saved_ops
        >>> torch.ops.smptk.fused_linear_fwd.default in saved_ops()
        True
    """
    n = len(_dispatch.OPS)
    if n not in _kept_smptk:
        _kept_smptk.clear()
        _kept_smptk[n] = SAVED_OPS | frozenset(
            op for op in _dispatch.OPS if op.name() not in RECOMPUTED_SMPTK_OPS
        )
    return _kept_smptk[n]


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    import torch.utils.checkpoint as tc

    # Torch's selective checkpointing replays ops by their count in the region, profiler annotations
    # included; FSDP2 annotates its hooks with record_function, and a nested unit (MoE experts under expert
    # parallelism) runs another number of them in the recompute (FSDP::root_pre_forward) than in the
    # forward, so backward failed with "record_function_enter_new invocation index 2 ... not found in
    # storage". They are no computation: skipped by the replay, as torch's fix upstream does (torchtitan
    # issue 3427). Idempotent: the set is torch's own list of ops the replay skips.
    profiler = torch.ops.profiler
    tc.SAC_IGNORED_OPS.update(
        {profiler._record_function_enter_new.default, profiler._record_function_exit._RecordFunction}
    )
    return tc.create_selective_checkpoint_contexts(_selective_policy)


@dataclasses.dataclass(eq=False)
class _Offloaded:
    """One saved tensor while it is away: its host copy, and where (and whether) it is coming back."""

    unit: int  # the unit's index (what the log names)
    entry: int  # which unit forward saved it: the offloader's count of unit forwards, in call order
    host: torch.Tensor
    device: torch.device
    stride: tuple  # the strides it comes back with: the saved tensor's own (see _layout)
    dtensor: tuple | None = None  # a DTensor's mesh, placements, shape and stride: rebuilt around its shard
    stored: object = None  # CUDA event: the device-to-host copy is done
    back: torch.Tensor | None = None  # the device copy, once loading started
    loaded: object = None  # CUDA event: the host-to-device copy is done
    used: bool = False  # backward has read it: no prefetch brings it back again


@dataclasses.dataclass(eq=False)
class _Kept:
    """A saved tensor that stays where it is, and its version when saved: torch checks no version of what
    saved-tensor hooks keep, so the offloader does (see :meth:`ActivationOffloader._unpack`)."""

    unit: int
    tensor: torch.Tensor
    version: int


LOG_ENTRIES = 4096  # events ActivationOffloader.log keeps (two per unit and step: 20+ steps of 100 units)


class ActivationOffloader:
    """Saved-tensor hooks that keep checkpointed units' inputs in host memory between forward and
    backward, and bring them back while backward is at most ``horizon - 1`` unit forwards before them
    (see the module docstring).

    "Before" is call order: the offloader numbers every unit forward it sees (its *entries*), and when
    backward first reads an input of entry n it loads the rest of entry n's inputs and those of entries
    n-1 .. n-(horizon-1) that backward has not read yet. So blocks called in any order, a block called
    twice in one forward, and several micro-batches' forwards in flight before their backwards
    (F1 F2 B1 B2) all keep at most ``horizon`` entries' inputs on the device (B1 never loads F2's). Each
    input comes back once; its host copy lives as long as the graph that saved it (a graph dropped
    without backward frees its copies).

    What is offloaded: the unit's positional tensor arguments, as torch's checkpoint saves them.
    Keyword arguments and tensors inside containers stay on the device (the checkpoint's recompute keeps
    them; a unit that gets tensors that way and none positionally warns once), and so do parameters
    (leaves that require grad: they stay on the device anyway) and empty or expanded tensors. Each input
    is copied on its own, so two inputs that share memory come back as separate tensors: a unit whose
    forward writes in place to one of them raises (its recompute would not see the write through the
    other, and its gradients would be wrong); plain checkpointing raises there too, in backward. An
    offloaded input keeps the value the unit saw under a later in-place write; an input left where it is
    (CPU tensors without ``offload_cpu``, parameters, empty tensors) and written in place before backward
    raises in backward, as plain checkpointing does (torch checks no version of what saved-tensor hooks
    keep, so the offloader does). An offloaded input comes back with its strides (see :func:`_layout`),
    so the recompute sees the layout the forward saw; a DTensor's local shard moves, and the DTensor is
    rebuilt around it on the way back.

    Args:
        horizon: unit forwards whose inputs may be on the device at once in backward, >= 1 (the
            config's ``activation_loading_horizon``).
        offload_cpu: also copy CPU tensors (to another CPU tensor): the same bookkeeping and order on a
            machine without a GPU, for tests; off by default (a CPU tensor has nowhere to go). Tensors
            of other accelerators than CUDA are copied to CPU memory and back without side streams.

    Attributes:
        log: ``("store", unit)`` / ``("load", unit, "prefetch" | "on demand")`` events, in order: the
            latest :data:`LOG_ENTRIES` (a deque, so a long run does not grow it without bound).

    Example (a machine without a GPU: ``offload_cpu`` runs the bookkeeping on CPU tensors)::

        >>> import torch
        >>> from torch import nn
        >>> from smptk.parallel import ActivationOffloader, apply_activation_checkpointing
        >>> class Net(nn.Module):
        ...     def __init__(self, blocks=2):
        ...         super().__init__()
        ...         block = lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU())
        ...         self.layers = nn.ModuleList(block() for _ in range(blocks))
        ...     def forward(self, x):
        ...         for layer in self.layers:
        ...             x = layer(x)
        ...         return x
        >>> model, x = Net(blocks=3), torch.randn(4, 8)
        >>> off = ActivationOffloader(horizon=2, offload_cpu=True)
        >>> apply_activation_checkpointing(model, mode="full", offloader=off)   # model.layers: 3 blocks
        ['layers.0', 'layers.1', 'layers.2']
        >>> model(x).sum().backward()
        >>> list(off.log)[3:]    # backward: block 2 on demand, each next one prefetched a block ahead
        [('load', 2, 'on demand'), ('load', 1, 'prefetch'), ('load', 0, 'prefetch')]
    """

    def __init__(self, horizon: int = 2, *, offload_cpu: bool = False) -> None:
        if isinstance(horizon, bool) or not isinstance(horizon, int):
            raise TypeError(f"horizon: expected an int >= 1, got {type(horizon).__name__} {horizon!r}")
        if horizon < 1:
            raise ValueError(f"horizon: expected an int >= 1, got {horizon!r}")
        self.horizon = horizon
        self.offload_cpu = offload_cpu
        self.log: collections.deque[tuple] = collections.deque(maxlen=LOG_ENTRIES)
        # entry -> its inputs still away, weakly: the graph that saved them owns them
        self._away: dict[int, list[weakref.ref[_Offloaded]]] = {}
        self._entries = 0  # unit forwards seen
        self._streams: dict[torch.device, tuple] = {}
        self._warned: set[int] = set()

    def _side_streams(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def _pack(self, unit: int, entry: int, seen: list, t: torch.Tensor):
        from torch.distributed.tensor import DTensor

        local, dtensor = t, None
        if isinstance(t, DTensor):  # its local shard moves (a pinned copy is a plain tensor)
            local, dtensor = t._local_tensor, (t.device_mesh, t.placements, t.shape, t.stride())
        small = local.untyped_storage().nbytes() < local.numel() * local.element_size()  # expanded
        stays = (t.is_leaf and t.requires_grad) or t.device.type == "meta"
        if t.numel() == 0 or small or stays or (t.device.type == "cpu" and not self.offload_cpu):
            version = _version(t)
            seen.append((t, version, False))
            # nothing to move (torch 2.11's checkpoint also saves an empty placeholder tensor)
            return t if version is None else _Kept(unit, t, version)
        host_stride, stride = _layout(local)
        if local.device.type == "cuda":
            store, _ = self._side_streams(local.device)
            store.wait_stream(torch.cuda.current_stream(local.device))
            with torch.cuda.stream(store):
                host = torch.empty_strided(local.size(), host_stride, dtype=local.dtype, pin_memory=True)
                host.copy_(local, non_blocking=True)
            local.record_stream(store)  # its memory is not reused before the copy has read it
            away = _Offloaded(unit, entry, host, local.device, stride, dtensor, stored=store.record_event())
        else:  # CPU (offload_cpu: a copy), or another accelerator: to CPU memory, synchronously
            host = torch.empty_strided(local.size(), host_stride, dtype=local.dtype)
            host.copy_(local.detach())
            away = _Offloaded(unit, entry, host, local.device, stride, dtensor)
        seen.append((t, _version(t), True))
        self._away.setdefault(entry, []).append(weakref.ref(away))
        self.log.append(("store", unit))
        return away

    def _load(self, away: _Offloaded, how: str) -> None:
        if away.back is not None or (away.used and how == "prefetch"):
            return
        self.log.append(("load", away.unit, how))
        host = away.host
        if away.device.type != "cuda":
            away.back = torch.empty_strided(host.size(), away.stride, dtype=host.dtype, device=away.device)
            away.back.copy_(host)
            return
        _, load = self._side_streams(away.device)
        if how == "on demand":
            load = torch.cuda.current_stream(away.device)
        load.wait_event(away.stored)
        with torch.cuda.stream(load):
            away.back = torch.empty_strided(host.size(), away.stride, dtype=host.dtype, device=away.device)
            away.back.copy_(host, non_blocking=True)
        away.loaded = load.record_event()

    def _unpack(self, away):
        if isinstance(away, _Kept):
            t = away.tensor
            if _version(t) != away.version:  # what torch reports for a saved tensor without hooks
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: activation offloading: an input of unit {away.unit} "
                    f"({list(t.shape)}, {t.dtype}, on {t.device}, not offloaded) is at version "
                    f"{_version(t)}; expected version {away.version}. Its recompute would read the written "
                    "value and the gradients would be wrong."
                )
            return t
        if not isinstance(away, _Offloaded):
            return away
        self._load(away, "on demand")
        # then the rest of this entry's tensors (backward reads them next), then the entries before it
        for entry in range(away.entry, away.entry - self.horizon, -1):
            for ref in self._away.get(entry, []):
                ahead = ref()
                if ahead is not None:
                    self._load(ahead, "prefetch")
        t = away.back
        if away.loaded is not None:
            current = torch.cuda.current_stream(away.device)
            current.wait_event(away.loaded)
            t.record_stream(current)
        if away.dtensor is not None:
            from torch.distributed.tensor import DTensor

            mesh, placements, shape, stride = away.dtensor
            t = DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)
        away.back = away.loaded = None  # the device copy lives as long as backward needs it, no longer
        away.used = True
        ours = self._away.get(away.entry)
        if ours is not None:  # its host copy goes with the graph (kept for a retain_graph rerun)
            ours[:] = [r for r in ours if r() is not None and r() is not away]
            if not ours:
                del self._away[away.entry]
        return t

    def _forget_dead(self) -> None:
        """Drop the entries whose inputs are all gone (their graphs were freed, read or not)."""
        for entry in [e for e, refs in self._away.items() if all(r() is None for r in refs)]:
            del self._away[entry]

    def _copies_done(self, entry: int) -> None:
        """The compute stream waits for an entry's device-to-host copies (issued as it saved its inputs, so
        they overlapped its forward) before anything after the unit runs: an in-place write to an input
        later on (plain torch reports it in backward; with saved-tensor hooks torch checks nothing) cannot
        race the copy, and backward sees the value the unit saw."""
        for ref in self._away.get(entry, []):
            away = ref()
            if away is not None and away.stored is not None:
                torch.cuda.current_stream(away.device).wait_event(away.stored)

    def _check_unit_forward(self, module: nn.Module, unit: int, seen: list, elsewhere: bool) -> None:
        """After a unit's forward: refuse an in-place write to an offloaded input that shares memory with
        another input (see the class docstring); warn once when the unit's tensors all came in keyword
        arguments or containers (``elsewhere``), which torch's checkpoint keeps on the device."""
        by_storage: dict[tuple, list] = {}
        for t, version, _ in seen:
            if t.device.type != "meta":
                by_storage.setdefault(_storage_key(t), []).append((t, version))
        offloaded = {_storage_key(t) for t, _, moved in seen if moved}
        for key, group in by_storage.items():
            if key in offloaded and len(group) > 1 and any(_version(t) != v for t, v in group):
                raise RuntimeError(
                    f"activation offloading: unit {unit} ({type(module).__name__}) wrote in place to one of "
                    f"{len(group)} inputs that share memory; their offloaded copies are separate tensors, so "
                    "the recompute would not see the write through the others and the gradients would be "
                    "wrong. Pass one tensor (or clones), or do not write to the input in place."
                )
        if elsewhere and not any(moved for _, _, moved in seen) and unit not in self._warned:
            self._warned.add(unit)
            warnings.warn(
                f"activation offloading: unit {unit} ({type(module).__name__}) got its tensors as keyword "
                "arguments or inside containers, which torch's checkpoint keeps on the device: nothing of "
                "it is offloaded. Pass the hidden state positionally.",
                stacklevel=2,
            )

    def attach(self, unit: nn.Module, index: int) -> None:
        """Offload what ``unit`` saves outside its own checkpoint (its positional tensor inputs, see the
        class docstring), naming it ``index`` in the log: a forward pre-hook ahead of every other enters
        the saved-tensor hooks, a forward hook after them leaves."""
        state: list = [None]  # (hooks, entry, seen, elsewhere) of the unit forward in progress
        unpack = torch.compiler.disable(self._unpack)  # one wrapper for every forward (see below)

        def enter(module, args, kwargs):
            # not in backward: a checkpoint's recompute runs the forward again, and must keep its own hooks
            if torch._C._current_graph_task_id() == -1 and torch.is_grad_enabled():
                entry = self._entries
                self._entries += 1
                self._forget_dead()
                self._away[entry] = []
                seen: list = []
                hooks = torch.autograd.graph.saved_tensors_hooks(
                    torch.compiler.disable(functools.partial(self._pack, index, entry, seen)),
                    unpack,
                )
                nested = [v for a in args if not isinstance(a, torch.Tensor) for v in _tensors_in(a)]
                elsewhere = bool(nested) or any(_tensors_in(v) for v in kwargs.values())
                hooks.__enter__()
                state[0] = (hooks, entry, seen, elsewhere)

        def leave(module, args, output):
            if state[0] is not None:
                hooks, entry, seen, elsewhere = state[0]
                state[0] = None
                hooks.__exit__(None, None, None)
                self._copies_done(entry)
                try:
                    self._check_unit_forward(module, index, seen, elsewhere)
                finally:
                    # the pack hook (which holds ``seen``) lives as long as the graph: holding the inputs
                    # here would keep them on the device to backward
                    seen.clear()

        # The hooks (and the pack / unpack hooks they install) run eagerly under a compiled unit
        # (``unit.compile()``): traced, their bookkeeping broke the unit's graph several times and the entry
        # counter, a guard, recompiled it every forward until Dynamo's cache limit sent it back to eager.
        unit.register_forward_pre_hook(torch.compiler.disable(enter), prepend=True, with_kwargs=True)
        unit.register_forward_hook(torch.compiler.disable(leave), always_call=True)


def _layout(t: torch.Tensor) -> tuple[tuple, tuple]:
    """The strides of ``t``'s host copy and of the device copy it comes back as.

    The host copy is dense, its dimensions in ``t``'s memory order (``empty_like``'s ``preserve_format``:
    a transposed or channels-last tensor keeps its strides, a view with gaps is packed). The device copy
    takes ``t``'s own strides, so the recompute runs its ops on the layout the forward saw (a reduction over
    a packed copy of a strided view rounds differently, and a layout-dependent op such as ``contiguous()``
    dispatches differently): a view with gaps comes back in memory spanning its strides, at most the
    storage it viewed. Where ``t``'s elements overlap (an expanded tensor), it comes back dense."""
    host_stride = torch.empty_like(t, device="meta").stride()
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    reach = 1  # elements an index step must clear not to land on an earlier dimension's elements
    for st, n in dims:
        if st < reach:
            return host_stride, host_stride
        reach = st * n
    return host_stride, t.stride()


def _storage_key(t: torch.Tensor) -> tuple:
    """Where ``t``'s memory is (a DTensor's: its local shard's)."""
    t = getattr(t, "_local_tensor", t)
    return t.device, t.untyped_storage().data_ptr()


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (None for an inference tensor, which has none)."""
    return None if t.is_inference() else t._version


def _tensors_in(value) -> list[torch.Tensor]:
    """The tensors in ``value``, looking inside lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    return []


def apply_activation_checkpointing(
    model: nn.Module,
    state: ParallelState | None = None,
    *,
    mode: str | None = None,
    modules: ModuleSpec = None,
    offloader: ActivationOffloader | None = None,
) -> list[str]:
    """Checkpoint the activations of ``model``'s units (see the module docstring); returns their names.

    Args:
        model: the model (before :func:`~smptk.parallel.apply_data_parallel`).
        state: supplies the config's ``activation_checkpointing`` (default :func:`smptk.parallel.current`
            when ``mode`` is not given).
        mode: "none", "full" or "selective"; overrides the config.
        offloader: offload the units' inputs with this :class:`ActivationOffloader`; default: one with the
            config's ``activation_loading_horizon`` when its ``sm_activation_offloading`` is set (when
            ``mode`` is given and ``state`` is not, no offloading unless an offloader is given).
        modules: which submodules are units, as :func:`~smptk.parallel.apply_data_parallel` takes it (default:
            the blocks of the first ``nn.ModuleList``). A unit nested inside another is left to its parent
            (a checkpointed parent recomputes it anyway).

    Returns:
        The qualified names of the units now checkpointed, in model order ([] for "none").

    Limits: the units run torch's composable ``checkpoint``, whose recompute can run once per forward, so
    a second backward through the same graph (``retain_graph=True``) and a gradient of a gradient
    (``create_graph=True``, a gradient penalty) fail inside torch (``'_GeneratorContextManager' object
    has no attribute 'args'``); such a model wraps its blocks in ``torch.utils.checkpoint`` instead.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if state is None and mode is None:
        state = current()
    if mode is None:
        mode = state.config.activation_checkpointing
    if offloader is None and state is not None and state.config.sm_activation_offloading:
        offloader = ActivationOffloader(state.config.activation_loading_horizon)
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(
            f"mode: expected one of {', '.join(map(repr, ACTIVATION_CHECKPOINTING))}, got {mode!r}"
        )
    if mode == "none":
        return []
    from torch.distributed._composable import checkpoint
    from torch.distributed._composable.contract import _get_registry

    units = select_units(model, modules)
    names = [n for n, _ in units]
    outer = [(n, m) for n, m in units if not any(n.startswith(p + ".") for p in names if p != n)]
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    outer.sort(key=lambda nm: order[nm[0]])
    for name, unit in outer:
        registry = _get_registry(unit) or {}
        if "checkpoint" in registry:
            raise ValueError(
                f"modules: {name!r} is checkpointed already (apply_activation_checkpointing twice?)"
            )
    if offloader is not None and not isinstance(offloader, ActivationOffloader):
        raise TypeError(f"offloader: expected an ActivationOffloader or None, got {type(offloader).__name__}")
    kwargs = {"context_fn": _selective_contexts} if mode == "selective" else {}
    for index, (_, unit) in enumerate(outer):
        checkpoint(unit, **kwargs)
        if offloader is not None:
            offloader.attach(unit, index)
    _no_cache_in_training(model, [n for n, _ in outer])
    return [n for n, _ in outer]


def recomputing(unit: nn.Module) -> bool:
    """Whether ``unit``'s forward now running is its own checkpoint's recompute in backward: torch's
    composable ``checkpoint`` turns the unit's checkpoint hooks off around it. A forward pre-hook placed
    ahead of the checkpoint (``prepend=True``) changes the inputs the checkpoint saves, and the recompute
    calls the unit with those saved inputs, so such a hook passes them through when this is True. False
    for a unit that is not checkpointed."""
    from torch.distributed._composable import checkpoint

    state = checkpoint.state(unit)
    return state is not None and not state.enable_hook


def _no_cache_in_training(model: nn.Module, units: list[str]) -> None:
    """Checkpointed units run their forward twice, and a key-value cache (a Hugging Face model's
    ``use_cache``, on by default) would see the keys twice: the recompute's attention then reads 2 x seq
    keys (SDPA's causal path slices them back, so values agree, but selective checkpointing's op-by-op
    replay fails with torch's "aten.slice.Tensor invocation ... not found in storage", and a masked path
    would be wrong). Hugging Face turns ``use_cache`` off under its own gradient checkpointing; here every
    module around the units whose forward takes ``use_cache`` gets a pre-hook passing ``use_cache=False``
    while it trains (generation in eval mode keeps its cache; the model's config is left as it is)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if module.training:
            kwargs = {**kwargs, "use_cache": False}
        return args, kwargs

    for name, module in model.named_modules():
        inside = any(name == u or name.startswith(u + ".") for u in units)
        if inside or not any(u.startswith(name + ".") or not name for u in units):
            continue
        try:
            takes = "use_cache" in inspect.signature(module.forward).parameters
        except (TypeError, ValueError):  # a forward without a signature (a C++ module)
            takes = False
        if takes:
            module.register_forward_pre_hook(hook, with_kwargs=True)


__all__ = [
    "RECOMPUTED_SMPTK_OPS",
    "SAVED_OPS",
    "ActivationOffloader",
    "apply_activation_checkpointing",
    "saved_ops",
]
