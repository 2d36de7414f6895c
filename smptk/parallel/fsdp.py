"""Sharded data parallelism: FSDP2 over the ``(dp_replicate, dp_shard)`` mesh, or DDP for pure replication.

:func:`apply_data_parallel` prepares a model (already tensor-parallel, if the config asks for it) for
data-parallel training under the state of :func:`smptk.parallel.init`, following the config's
``hybrid_shard_degree`` (``dp_shard = hybrid_shard_degree or dp``, ``dp_replicate = dp / dp_shard``, see
:mod:`smptk.parallel.config`):

- 0 (or dp): ``"full_shard"``, FSDP2 ``fully_shard(unit, mesh=state.mesh["dp_replicate", "dp_shard"])``
  with dp_replicate 1: parameters, gradients and optimizer state sharded over every data-parallel rank.
- k, 1 < k < dp: ``"hybrid_shard"`` (HSDP), FSDP2 on the same 2-D mesh: sharded within ``dp_shard``
  (k consecutive dp ranks), gradients all-reduced across ``dp_replicate``.
- 1: ``"replicate"``, ``DistributedDataParallel`` over the ``dp`` group with smptk's DDP comm hook
  (fp32, no tensor parallelism), else FSDP2 on the 2-D mesh, whose ``dp_shard`` dim then has 1 rank.

Why DDP for replication, and why not always. ``hybrid_shard_degree=1`` means gradients all-reduced
through smptk's DDP hook, overlapped with backward (DDP launches each bucket's all-reduce as soon as its
gradients are ready). Three cases cannot take that path, and the FSDP2 engine with a 1-rank shard dim
serves them instead (no parameter is sharded; FSDP2 all-reduces the gradients across ``dp_replicate``
with torch.distributed, and the report says so with the reason):

- tensor parallelism: DDP cannot hold DTensor parameters (its construction broadcasts them with
  ``c10d.broadcast_``, which DTensor has no sharding rule for: NotImplementedError on torch 2.13);
- bf16 / fp16 mixed precision: DDP's mixed precision (``_MixedPrecision``) installs its own comm hook,
  and a DDP module takes only one, so smptk's hook and bf16 parameters with fp32 reduction exclude
  each other; FSDP2's ``MixedPrecisionPolicy`` has no such conflict;
- a model on the meta device (delayed initialization): DDP checks and broadcasts allocated parameters
  at construction, and ``transform`` applies data parallelism before the user's ``materialize``.

Units. FSDP2 groups parameters into units, one all-gather and one reduce-scatter each, and must be
applied bottom-up. ``modules`` picks the units below the root (the root is always one, last): by default
every child of the first ``nn.ModuleList`` in the model (the transformer blocks), else of the first
``nn.ModuleDict`` (torchtitan keeps its blocks in one), or, in a model with neither, every direct child
that holds parameters; or a list of module classes / qualified names (``model.named_modules()`` names;
each must match a submodule); or ``fn(name, module) -> bool``. The DDP path checks ``modules`` too,
though it buckets gradients by size.

Mixed precision (config ``mixed_precision``, :func:`mixed_precision_policy`): "bf16" gives
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: parameters are all-gathered and
computed in bf16, gradients reduced in fp32, and the sharded parameters (what the optimizer steps) stay
in their own dtype (fp32); "fp16" likewise with float16; "fp32" casts nothing.

Collectives. Where smptk's symmetric heap applies to the ``dp_shard`` group (every rank on one host; CUDA
tensors with torch symmetric memory, or CPU tensors under ``TRITON_INTERPRET=1``, the heap's CPU
backend), each unit's all-gather and reduce-scatter go through :class:`smptk.comm.adapters.SmptkAllGather`
and :class:`~smptk.comm.adapters.SmptkReduceScatter` (FSDP2's ``set_custom_all_gather`` /
``set_custom_reduce_scatter``), with the state's ``comm_max_sms`` (0: the all-gather takes the
copy-engine path, no SM moves the parameters; the reduce-scatter, which has no copy-engine path, takes
``smptk.comm``'s default). The DDP path registers :func:`smptk.comm.adapters.ddp_comm_hook`. Elsewhere,
or with ``use_smptk_collectives=False``, torch.distributed runs them. HSDP's all-reduce across
``dp_replicate`` is always FSDP2's own (torch.distributed): FSDP2 takes no custom all-reduce.

The report (:class:`DataParallelReport`, one :class:`DataParallelUnit` per unit) says which path each
collective was set to ("smptk all-gather (max_sms=8)", "torch (reason)") and counts, as training runs,
the path each smptk call really took (``smptk.comm.last_path()``: "symmetric", "copy_engine", or the
torch.distributed fallback a call can still take), so a silent fallback shows.

Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU). A world of 8 takes
``{"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}`` with the same lines::

    >>> import torch
    >>> import torch.distributed as dist
    >>> from torch import nn
    >>> from torch.distributed.tensor.parallel import parallelize_module
    >>> import smptk.parallel as sp
    >>> from smptk.parallel import SmptkColwiseParallel, SmptkRowwiseParallel
    >>> dist.init_process_group("gloo")
    >>> state = sp.init({"tensor_parallel_degree": 2, "mixed_precision": "fp32"})
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    >>> plan = {"0": SmptkColwiseParallel(), "2": SmptkRowwiseParallel()}
    >>> model = parallelize_module(model, state.submesh("tp"), plan)     # tensor parallelism first
    >>> model, report = sp.apply_data_parallel(model, state)
    >>> model(torch.randn(3, 8)).sum().backward()
    >>> for line in report.describe().splitlines()[:2]:   # then a block per unit: its calls, per path
    ...     print(line)
    data parallel: full_shard on fsdp2 (dp_replicate 1, dp_shard 1, tp 2; param as is, reduce as is)
    why: the dp_shard group has 1 rank: there is nothing to gather or scatter
    >>> [unit.name for unit in report.units]
    ['2', '0', '']
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's annotations with
# dist.GradBucket and Future[Tensor] as objects, and strings would not match.

import collections
import dataclasses
import importlib.util
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from smptk import comm
from smptk.comm.adapters import (
    SmptkAllGather,
    SmptkHookState,
    SmptkReduceScatter,
    ddp_comm_hook,
)
from smptk.comm.heap import same_host
from smptk.kernels import runtime
from smptk.kernels.heap_layout import MAX_WORLD
from smptk.parallel.config import ParallelState, state_or_current
from smptk.parallel.expert_parallel import expert_parameter_ids, expert_placement_fn, experts_without_unit
from smptk.parallel.moe import MoE

_MP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}

# What ``modules`` may be (see select_units).
ModuleSpec = Callable[[str, nn.Module], bool] | Sequence[type | str] | None


def mixed_precision_policy(mixed_precision: str) -> MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy`` for a config's ``mixed_precision`` ("bf16", "fp16" or "fp32").

    16-bit parameters and compute with fp32 gradient reduction; "fp32" casts nothing.
    """
    if mixed_precision not in _MP_DTYPES:
        raise ValueError(f"mixed_precision: expected one of {', '.join(_MP_DTYPES)}, got {mixed_precision!r}")
    dtype = _MP_DTYPES[mixed_precision]
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


@dataclasses.dataclass
class DataParallelUnit:
    """One unit of :func:`apply_data_parallel`: what its collectives were set to and what they ran.

    Attributes:
        name: the unit's qualified name in the model ("" for the root).
        engine: "fsdp2" or "ddp".
        num_params: parameters (elements) the unit owns, over the whole model (before sharding).
        all_gather, reduce_scatter, all_reduce: the path each collective is set to, e.g.
            "smptk all-gather (max_sms=8)", "smptk all-gather (copy engine, max_sms=0)",
            "torch (use_smptk_collectives=False)", or "none (...)" where the collective does not run.
        calls: ``(collective, path, dtype) -> count`` of the smptk calls made so far, with the path
            ``smptk.comm.last_path()`` reported after each ("symmetric", "copy_engine", or
            "torch.distributed:<backend>" where a call fell back). Empty for torch's collectives, which
            are not counted.

    Example (under ``TRITON_INTERPRET=1 torchrun --nproc-per-node 2``, every rank; gloo on CPU, where
    smptk's collectives run on the symmetric heap's CPU backend)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> import smptk.parallel as sp
        >>> dist.init_process_group("gloo")
        >>> state = sp.init({"mixed_precision": "fp32"})
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> model, report = sp.apply_data_parallel(model, state)
        >>> model(torch.randn(3, 8)).sum().backward()      # one step: the units' collectives run
        >>> unit = report.units[1]                          # the first Linear: 8 * 16 + 16 parameters
        >>> print(unit.describe())     # all-gathered in forward and again in backward, reduce-scattered once
        0 (fsdp2, 144 parameters)
          all-gather: smptk all-gather (max_sms=8); ran 2 x symmetric float32
          reduce-scatter: smptk reduce-scatter (max_sms=8); ran 1 x symmetric float32
          all-reduce: none (no dp_replicate dim)
        >>> unit.calls[("all-gather", "symmetric", "float32")]
        2
    """

    name: str
    engine: str
    num_params: int
    all_gather: str
    reduce_scatter: str
    all_reduce: str
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def describe(self) -> str:
        label = self.name or "<root>"
        lines = [f"{label} ({self.engine}, {self.num_params} parameters)"]
        for kind, setting in (
            ("all-gather", self.all_gather),
            ("reduce-scatter", self.reduce_scatter),
            ("all-reduce", self.all_reduce),
        ):
            ran = ", ".join(
                f"{n} x {path} {dtype}" for (c, path, dtype), n in sorted(self.calls.items()) if c == kind
            )
            lines.append(f"  {kind}: {setting}" + (f"; ran {ran}" if ran else ""))
        return "\n".join(lines)


@dataclasses.dataclass
class DataParallelReport:
    """What :func:`apply_data_parallel` did on this rank.

    Attributes:
        mode: "full_shard", "hybrid_shard" or "replicate" (see the module docstring).
        engine: "fsdp2" or "ddp".
        sizes: ``{"dp_replicate": R, "dp_shard": S, "tp": T}`` of the mesh the units use.
        param_dtype, reduce_dtype: the mixed-precision dtypes (None: the parameters' own).
        smptk_collectives: whether smptk's collectives serve the unit collectives that run.
        reason: why torch's collectives (or the FSDP2 engine for ``replicate``) were chosen; "" otherwise.
        heap_bytes: bytes of the symmetric heap each rank maps for the group smptk's collectives use
            (``smptk.comm``'s ``heap_bytes``; one heap per group), 0 when they are not used.
        units: one :class:`DataParallelUnit` per unit, bottom-up, the root last.

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU without ``TRITON_INTERPRET``,
    so torch's collectives serve the units, and the report says why)::

        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> import smptk.parallel as sp
        >>> dist.init_process_group("gloo")
        >>> state = sp.init({"mixed_precision": "fp32"})    # tp 1, dp 2, hybrid_shard_degree 0
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> model, report = sp.apply_data_parallel(model, state)
        >>> report.mode, report.engine, report.sizes
        ('full_shard', 'fsdp2', {'dp_replicate': 1, 'dp_shard': 2, 'tp': 1})
        >>> [unit.name for unit in report.units]   # the children with parameters, then the root ("")
        ['2', '0', '']
        >>> report.smptk_collectives, report.reason
        (False, "CPU tensors take smptk's heap only under TRITON_INTERPRET=1 (its CPU backend)")
    """

    mode: str
    engine: str
    sizes: dict
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    smptk_collectives: bool
    reason: str
    heap_bytes: int
    units: list

    def calls(self) -> collections.Counter:
        """``(collective, path, dtype) -> count`` summed over the units."""
        total: collections.Counter = collections.Counter()
        for unit in self.units:
            total.update(unit.calls)
        return total

    def describe(self) -> str:
        sizes = ", ".join(f"{k} {v}" for k, v in self.sizes.items())
        dtypes = f"param {self.param_dtype or 'as is'}, reduce {self.reduce_dtype or 'as is'}"
        head = [f"data parallel: {self.mode} on {self.engine} ({sizes}; {dtypes})"]
        if self.heap_bytes:
            head.append(f"symmetric heap: {self.heap_bytes} bytes per rank on the collectives' group")
        if self.reason:
            head.append(f"why: {self.reason}")
        return "\n".join(head + [u.describe() for u in self.units])


# ---------------------------------------------------------------------------------------------------------
# smptk adapters that count the path each call took


def _record(calls: collections.Counter, kind: str, tensor: torch.Tensor) -> None:
    calls[(kind, comm.last_path(), str(tensor.dtype).removeprefix("torch."))] += 1


class _CountingAllGather(SmptkAllGather):
    def __init__(self, max_sms: int | None, calls: collections.Counter):
        super().__init__(max_sms=max_sms)
        self.calls = calls

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        work = super().__call__(output_tensor, input_tensor, group, async_op)
        _record(self.calls, "all-gather", input_tensor)
        return work


class _CountingReduceScatter(SmptkReduceScatter):
    def __init__(self, max_sms: int | None, calls: collections.Counter):
        super().__init__(max_sms=max_sms)
        self.calls = calls

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        work = super().__call__(output_tensor, input_tensor, group, op, async_op)
        if op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG:  # the ops smptk runs itself
            _record(self.calls, "reduce-scatter", input_tensor)
        else:  # e.g. NCCL's pre-multiplied sum: SmptkReduceScatter hands it to torch.distributed unchanged
            dtype = str(input_tensor.dtype).removeprefix("torch.")
            self.calls[("reduce-scatter", f"torch.distributed ({op})", dtype)] += 1
        return work


class _CountingHookState(SmptkHookState):
    def __init__(self, group: dist.ProcessGroup, max_sms: int | None, calls: collections.Counter):
        super().__init__(group=group, max_sms=max_sms)
        self.calls = calls


def _counting_ddp_hook(
    state: _CountingHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """smptk's DDP hook, counting the path each bucket's all-reduce took."""
    fut = ddp_comm_hook(state, bucket)
    _record(state.calls, "all-reduce", bucket.buffer())
    return fut


# ---------------------------------------------------------------------------------------------------------
# Units


def select_units(model: nn.Module, modules: ModuleSpec = None) -> list[tuple[str, nn.Module]]:
    """The ``(qualified name, module)`` units below the root that ``modules`` picks, bottom-up.

    See the module docstring for what ``modules`` may be. Nested picks come children first (the order
    FSDP2 needs); the root is never among them (:func:`apply_data_parallel` adds it last).
    """
    named = [(n, m) for n, m in model.named_modules() if n]  # pre-order, without the root
    if modules is None:
        # The blocks: the children of the first ModuleList, else of the first ModuleDict (torchtitan's
        # layers), containers without a forward, which FSDP2 refuses as units.
        first_list = model if isinstance(model, (nn.ModuleList, nn.ModuleDict)) else None
        for kind in (nn.ModuleList, nn.ModuleDict):
            if first_list is None:
                first_list = next((m for _, m in named if isinstance(m, kind)), None)
        if first_list is not None:
            picked = {id(m) for m in first_list.children()}
        else:
            picked = {id(m) for m in model.children() if any(True for _ in m.parameters())}
        chosen = [(n, m) for n, m in named if id(m) in picked]
    elif callable(modules) and not isinstance(modules, type):
        chosen = [(n, m) for n, m in named if modules(n, m)]
    elif isinstance(modules, (list, tuple)):
        types_, names = [], set()
        for item in modules:
            if isinstance(item, type) and issubclass(item, nn.Module):
                types_.append(item)
            elif isinstance(item, str):
                names.add(item)
            else:
                raise TypeError(
                    f"modules: expected nn.Module subclasses or qualified module names, got "
                    f"{type(item).__name__} {item!r}"
                )
        missing = sorted(names - {n for n, _ in named})
        if missing:
            known = ", ".join(n for n, _ in named[:12]) + (", ..." if len(named) > 12 else "")
            raise ValueError(
                f"modules: no submodule named {', '.join(map(repr, missing))} (the model has {known})"
            )
        unmatched = [t.__name__ for t in types_ if not any(isinstance(m, t) for _, m in named)]
        if unmatched:
            raise ValueError(
                f"modules: no submodule is a {', '.join(unmatched)} (the root alone would be one unit: the "
                "whole model in one all-gather); pass [] for that"
            )
        chosen = [(n, m) for n, m in named if n in names or (types_ and isinstance(m, tuple(types_)))]
    else:
        raise TypeError(
            "modules: expected None, a callable (name, module) -> bool, or a list of module classes / "
            f"qualified names, got {type(modules).__name__}"
        )
    return list(reversed(chosen))


def _check_units_share_nothing(units: list[tuple[str, nn.Module]]) -> None:
    """FSDP2 shards each unit's parameters on their own: a parameter inside two units neither of which
    contains the other (a module shared by two blocks, ALBERT-style) fails deep in FSDP2 ("Cannot
    concatenate overlapping meshes"). Name it, and say what works."""
    owner: dict[int, tuple[str, str]] = {}  # parameter id -> (unit, the parameter's name in it)
    for unit, module in units:
        for pname, p in module.named_parameters():
            if id(p) not in owner:
                owner[id(p)] = (unit, pname)
                continue
            first, first_name = owner[id(p)]
            if unit.startswith(first + ".") or first.startswith(unit + "."):
                continue  # nested units: the inner one owns it, as FSDP2 does
            raise ValueError(
                f"modules: the parameter {first}.{first_name} is also {unit}.{pname}: a module shared by two "
                "units, which FSDP2 cannot shard separately; pick units that contain it whole (modules=, "
                "e.g. their common parent), or replicate the model (hybrid_shard_degree=1)"
            )


def _check_no_empty_trainable(model: nn.Module) -> None:
    """A trainable parameter with no elements (a ``[0, 8]`` weight) passes fully_shard and then fails in
    FSDP2's gradient reduce-scatter on every rank ("_chunk_cat expects non-empty tensor"): name it now."""
    empty = [n for n, p in model.named_parameters() if p.requires_grad and p.dim() > 0 and p.numel() == 0]
    if empty:
        raise ValueError(
            f"{empty[:4]}: trainable parameters with no elements, which FSDP2's gradient reduce-scatter "
            "cannot take (torch fails in the first backward); freeze or remove them, or replicate the model "
            "(hybrid_shard_degree=1, DDP)"
        )


# ---------------------------------------------------------------------------------------------------------
# Where smptk's heap applies


def _heap_blocker(group: dist.ProcessGroup, device_type: str, group_name: str) -> str | None:
    """Why smptk's symmetric heap cannot serve ``group`` on ``device_type``; None when it can.

    Collective over ``group`` when the local checks pass (``same_host`` gathers host names).
    """
    size = dist.get_world_size(group)
    if size == 1:
        return f"the {group_name} group has 1 rank: there is nothing to gather or scatter"
    if size > MAX_WORLD:
        return f"the {group_name} group has {size} ranks, more than the heap's MAX_WORLD={MAX_WORLD}"
    if not runtime.triton_available():
        return "triton is not installed (smptk's collectives are Triton kernels)"
    if device_type == "cpu" and not runtime.interpreter_enabled():
        return "CPU tensors take smptk's heap only under TRITON_INTERPRET=1 (its CPU backend)"
    if device_type == "cuda":
        if runtime.interpreter_enabled():
            return "TRITON_INTERPRET=1 is set, and the interpreter cannot run kernels on CUDA tensors"
        if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
            return f"torch {torch.__version__} has no torch.distributed._symmetric_memory"
    if device_type not in ("cpu", "cuda"):
        return f"the heap has no backend for device type {device_type!r}"
    if not same_host(group):
        return f"the {group_name} group spans several hosts (the heap maps peers' memory on one host)"
    return None


def _check_args(model, state, reshard_after_forward, use_smptk_collectives) -> ParallelState:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    state = state_or_current(state)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise TypeError(
            "reshard_after_forward: expected a bool, an int or None, got "
            f"{type(reshard_after_forward).__name__}"
        )
    if not (use_smptk_collectives == "auto" or isinstance(use_smptk_collectives, bool)):
        raise ValueError(
            f"use_smptk_collectives: expected 'auto', True or False, got {use_smptk_collectives!r}"
        )
    return state


_DDP_SET_BY_SMPTK = ("self", "module", "device_ids", "output_device", "process_group", "device_mesh")


def _check_ddp_options(options: Mapping[str, Any] | None, use_smptk: str | bool) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"ddp_options: expected a mapping of keyword arguments, got {type(options).__name__}")
    accepted = set(inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters)
    for key in options:
        if key in _DDP_SET_BY_SMPTK:
            raise ValueError(f"ddp_options: {key!r} is set by apply_data_parallel from the ParallelState")
        if key not in accepted:
            known = sorted(accepted.difference(_DDP_SET_BY_SMPTK))
            raise ValueError(
                f"ddp_options: {key!r} is not an argument of DistributedDataParallel; it takes {known}"
            )
        if key == "mixed_precision" and options[key] is not None and use_smptk is not False:
            raise ValueError(
                "ddp_options: DDP's 'mixed_precision' registers its own comm hook, which excludes smptk's "
                "(torch: 'register_comm_hook ... can only be called once'); pass use_smptk_collectives=False "
                "with it, or set the config's mixed_precision (bf16 / fp16 run on FSDP2)"
            )
    return dict(options)


def _numel(module: nn.Module, seen: set[int]) -> int:
    """Elements of ``module``'s parameters not counted yet (``seen`` holds the ids already counted)."""
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


# ---------------------------------------------------------------------------------------------------------
# The entry point


def apply_data_parallel(
    model: nn.Module,
    state: ParallelState | None = None,
    *,
    modules: ModuleSpec = None,
    reshard_after_forward: bool | int | None = True,
    use_smptk_collectives: str | bool = "auto",
    ddp_options: Mapping[str, Any] | None = None,
) -> tuple[nn.Module, DataParallelReport]:
    """Shard (FSDP2) or replicate (DDP) ``model`` over the data-parallel ranks of ``state``.

    Collective: every rank calls it with the same model structure and arguments, after tensor
    parallelism (DTensor parameters on ``state.submesh("tp")`` compose: FSDP2 shards them further over
    the data-parallel dims of the same mesh).

    Args:
        model: the model, on the state's device (FSDP2 moves CPU parameters there; DDP expects them there).
        state: the ParallelState of :func:`smptk.parallel.init` (default: :func:`~smptk.parallel.current`).
        modules: which submodules become FSDP2 units below the root (see :func:`select_units`); unused by
            the DDP path, which buckets gradients by size.
        reshard_after_forward: FSDP2's argument, for every unit: True frees the gathered parameters after
            forward and gathers them again in backward; False keeps them; None lets FSDP2 keep the root's.
        use_smptk_collectives: "auto" (smptk's where its heap applies, else torch's, with the reason in
            the report), True (smptk's; RuntimeError where they cannot apply) or False (torch's).
        ddp_options: keyword arguments for ``DistributedDataParallel`` on the DDP path
            (``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``, ``gradient_as_bucket_view``,
            ``broadcast_buffers``...; not those smptk sets: ``module``, ``device_ids``, ``output_device``,
            ``process_group``, ``device_mesh``). ``ValueError`` when the model runs on FSDP2 instead (the
            report's ``engine``): there they would do nothing.

    Returns:
        ``(module, report)``: the module to train (``model`` itself, now an FSDPModule, or a
        ``DistributedDataParallel`` wrapping it) and the :class:`DataParallelReport`.
    """
    state = _check_args(model, state, reshard_after_forward, use_smptk_collectives)
    ddp_options = _check_ddp_options(ddp_options, use_smptk_collectives)
    sizes = state.sizes
    cfg = state.config
    mode = (
        "replicate"
        if sizes["dp_shard"] == 1
        else "full_shard"
        if sizes["dp_replicate"] == 1
        else "hybrid_shard"
    )
    if sizes["dp"] == 1:
        mode = "full_shard"  # one data-parallel rank: FSDP2 over a 1-rank mesh (nothing moves)
    has_dtensor = any(runtime.is_dtensor(p) for p in model.parameters())
    engine, why_engine = "fsdp2", ""
    if mode == "replicate":
        reasons = []
        if sizes["tp"] > 1:
            reasons.append(
                f"DDP cannot hold the DTensor parameters of tensor parallelism (tensor_parallel_degree "
                f"{sizes['tp']})"
            )
        elif has_dtensor:
            named = next(n for n, p in model.named_parameters() if runtime.is_dtensor(p))
            reasons.append(
                f"DDP cannot hold DTensor parameters ({named}: smptk's parallel layers and torch's styles "
                "make DTensors at tensor_parallel_degree 1 too)"
            )
        if cfg.mixed_precision != "fp32":
            reasons.append(
                f"mixed_precision {cfg.mixed_precision!r} needs 16-bit parameters with fp32 reduction, and "
                "DDP's mixed precision replaces any comm hook"
            )
        on_meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
        if on_meta is not None:  # transform's delayed-init flow cannot materialize before this call
            reasons.append(
                f"DDP needs allocated parameters and {on_meta} is on the meta device (delayed "
                "initialization): FSDP2 takes the meta model, and materialize allocates it after"
            )
        if reasons:
            why_engine = "replicate runs on FSDP2 with a 1-rank dp_shard dim: " + "; ".join(reasons)
        else:
            engine = "ddp"
    policy = mixed_precision_policy(cfg.mixed_precision)
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if engine == "ddp":
        select_units(model, modules)  # checked, though DDP buckets by size: a typo surfaces now, not on FSDP2
        return _apply_ddp(model, state, mode, use_smptk_collectives, ddp_options)
    if cfg.delayed_parameter_initialization and len(meta) < sum(1 for _ in model.parameters()):
        warnings.warn(
            "apply_data_parallel: delayed_parameter_initialization is set, but the model's parameters are "
            "allocated already (every rank built the full model): build it under torch.device('meta'), "
            "then call smptk.parallel.materialize(model, state) after apply_data_parallel",
            stacklevel=2,
        )
    if ddp_options:
        why = f" ({why_engine})" if why_engine else ""
        raise ValueError(
            f"ddp_options {sorted(ddp_options)}: this model runs on FSDP2, mode {mode!r}{why}; DDP's "
            "options apply only where hybrid_shard_degree 1 replicates on DDP"
        )
    return _apply_fsdp2(
        model, state, mode, policy, modules, reshard_after_forward, use_smptk_collectives, why_engine
    )


def _smptk_choice(use_smptk_collectives, blocker: str | None) -> tuple[bool, str]:
    """(use smptk, reason for torch) from the argument and what blocks the heap."""
    if use_smptk_collectives is False:
        return False, "use_smptk_collectives=False"
    if blocker is None:
        return True, ""
    if use_smptk_collectives is True:
        raise RuntimeError(f"use_smptk_collectives=True, but smptk's collectives cannot run here: {blocker}")
    return False, blocker


def _default_max_sms() -> int:
    return int(comm.settings()["max_sms"])


def _apply_fsdp2(model, state, mode, policy, modules, reshard_after_forward, use_smptk, why_engine):
    mesh = state.mesh["dp_replicate", "dp_shard"]
    shard_group = mesh.get_group("dp_shard")
    blocker = None if use_smptk is False else _heap_blocker(shard_group, state.device_type, "dp_shard")
    if blocker is None and not hasattr(FSDPModule, "set_custom_all_gather"):
        blocker = (
            f"torch {torch.__version__}'s FSDP2 has no set_custom_all_gather / set_custom_reduce_scatter"
        )
    smptk_on, why_torch = _smptk_choice(use_smptk, blocker)

    units = [*select_units(model, modules), ("", model)]
    _check_units_share_nothing(units[:-1])
    _check_no_empty_trainable(model)
    loose = experts_without_unit(model)
    if loose:
        raise ValueError(
            f"{loose[:4]}: expert weights split over the ep mesh (ExpertParallel or MoE(ep_mesh=...)) "
            "without an FSDP2 unit of their own, which the data-parallel units around them cannot shard "
            "(torch: 'Cannot concatenate overlapping meshes'): build the MoE layers unsplit and call "
            "smptk.parallel.apply_expert_parallel(model, state) before apply_data_parallel (it splits the "
            "experts and gives each its own unit over the experts' data-parallel ranks)"
        )
    placement = expert_placement_fn(state.sizes["dp_shard"], expert_parameter_ids(model))
    seen: set[int] = set()
    numels = [_numel(module, seen) for _, module in units]  # before fully_shard replaces the parameters
    reports = []
    for (name, module), numel in zip(units, numels, strict=True):  # bottom-up: children before parents
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=policy,
            shard_placement_fn=placement,  # dim 0, except stacked experts (expert_parallel.expert_shard_dim)
        )
        if smptk_on:
            calls: collections.Counter = collections.Counter()
            ag_sms = state.comm_max_sms
            rs_sms = None if state.comm_max_sms == 0 else state.comm_max_sms
            module.set_custom_all_gather(_CountingAllGather(ag_sms, calls))
            module.set_custom_reduce_scatter(_CountingReduceScatter(rs_sms, calls))
            if ag_sms == 0:
                ag = "smptk all-gather (copy engine, max_sms=0)"
                rs = f"smptk reduce-scatter (max_sms={_default_max_sms()}: it has no copy-engine path)"
            else:
                n = ag_sms if ag_sms is not None else _default_max_sms()
                ag, rs = f"smptk all-gather (max_sms={n})", f"smptk reduce-scatter (max_sms={n})"
        else:
            calls = collections.Counter()
            ag = rs = f"torch ({why_torch})"
        if state.sizes["dp_replicate"] == 1:
            ar = "none (no dp_replicate dim)"
        else:
            ar = "torch (FSDP2 all-reduces across dp_replicate itself; it takes no custom all-reduce)"
        reports.append(DataParallelUnit(name, "fsdp2", numel, ag, rs, ar, calls))
    model.register_forward_pre_hook(_unshard_outside_inference_mode(model), prepend=True)
    return model, DataParallelReport(
        mode=mode,
        engine="fsdp2",
        sizes={d: state.sizes[d] for d in ("dp_replicate", "dp_shard", "tp")},
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        smptk_collectives=smptk_on,
        reason="; ".join(r for r in (why_engine, why_torch) if r),
        heap_bytes=int(comm.settings()["heap_bytes"]) if smptk_on else 0,
        units=reports,
    )


def _unshard_outside_inference_mode(root: nn.Module):
    """A root pre-forward hook: before the first forward under ``torch.inference_mode()``, every FSDP2
    unit unshards and reshards once outside it. Torch 2.13's FSDP2 allocates a unit's unsharded parameters
    at its first unshard; made under inference mode they are inference tensors, and FSDP2 failed ("Inference
    tensors do not track version counter" with tensor-parallel parameters; otherwise "Inplace update to
    inference tensor" at the next training forward). Collective, as the forward it precedes."""
    done = []

    def hook(module: nn.Module, args: tuple) -> None:
        if done or not torch.is_inference_mode_enabled():
            return
        with torch.inference_mode(False), torch.no_grad():
            for unit in root.modules():
                if isinstance(unit, FSDPModule):
                    unit.unshard()
                    unit.reshard()
        done.append(True)

    return hook


def _keep_rank_local_buffers(model: nn.Module) -> None:
    """DDP broadcasts rank 0's buffers before every forward (``broadcast_buffers``). A MoE layer's
    ``tokens_per_expert`` counts this rank's tokens since the last ``update_expert_bias``, which sums
    them over the ranks: a broadcast between two accumulated forwards replaced each rank's count with rank
    0's (wrong loads, biases moved the wrong way). Leave those buffers out of DDP's broadcast."""
    moes = [n for n, m in model.named_modules() if isinstance(m, MoE)]
    names = [f"{n}.tokens_per_expert" if n else "tokens_per_expert" for n in moes]
    if names:
        ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, ignored + [n for n in names if n not in ignored]
        )


def _apply_ddp(model, state, mode, use_smptk, options):
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError(
            "model: a DistributedDataParallel already (apply_data_parallel's result?): wrapping it again "
            "would all-reduce every gradient twice; pass the model it wraps (.module)"
        )
    group = state.group("dp")
    blocker = None if use_smptk is False else _heap_blocker(group, state.device_type, "dp")
    smptk_on, why_torch = _smptk_choice(use_smptk, blocker)
    if state.device_type == "cuda":
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    _keep_rank_local_buffers(model)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group, **options)
    calls: collections.Counter = collections.Counter()
    if smptk_on:
        max_sms = state.comm_max_sms or None  # 0 (copy engines) has no all-reduce: smptk's default
        ddp.register_comm_hook(_CountingHookState(group, max_sms, calls), _counting_ddp_hook)
        n = max_sms if max_sms is not None else _default_max_sms()
        note = ": comm_max_sms 0 has no copy-engine all-reduce" if state.comm_max_sms == 0 else ""
        ar = f"smptk all-reduce (DDP comm hook, max_sms={n}{note})"
    else:
        ar = f"torch ({why_torch})"
    unit = DataParallelUnit(
        "",
        "ddp",
        _numel(model, set()),
        "none (replicated parameters)",
        "none (replicated parameters)",
        ar,
        calls,
    )
    return ddp, DataParallelReport(
        mode=mode,
        engine="ddp",
        sizes={d: state.sizes[d] for d in ("dp_replicate", "dp_shard", "tp")},
        param_dtype=None,
        reduce_dtype=None,
        smptk_collectives=smptk_on,
        reason=why_torch,
        heap_bytes=int(comm.settings()["heap_bytes"]) if smptk_on else 0,
        units=[unit],
    )
