"""Tensor- and sequence-parallel layers with DTensor parameters on the ``tp`` mesh (styles: tp_styles.py).

Legend: ``T`` the tensor-parallel size (``tp`` mesh), ``r`` this rank's coordinate on it, ``s`` sequence
length, ``K`` / ``N`` input / output features, ``V`` vocabulary size; ``[..]`` any leading dims.

- :class:`ColumnParallelLinear`: weight ``[N, K]`` as DTensor ``Shard(0)`` (rank r holds rows
  ``r*N/T .. (r+1)*N/T``), bias ``Shard(0)``; ``y_local = act(x @ w_local.T + b_local)`` ``[.., N/T]``,
  or with ``swiglu=True`` a gate/up pair ``silu(x @ wg_local.T) * (x @ wu_local.T)``. Input: the
  replicated ``[.., K]``, or with ``sequence_parallel=True`` this rank's sequence block (all-gathered
  along ``sequence_dim`` before the GEMM; backward: reduce-scatter; the GEMM's backward keeps the block
  and gathers it again for the weight gradient, :func:`smptk.comm.functional.saved_as_shard`).
  ``gather_output=True`` returns the full ``[.., N]`` on every rank.
- :class:`RowParallelLinear`: weight ``[N, K]`` as ``Shard(1)``, bias replicated; input ``[.., K/T]``
  (``input_is_parallel=True``: a column-parallel layer's output) or the replicated ``[.., K]``;
  ``y = sum_r x_r @ w_r.T`` by all-reduce, or with ``sequence_parallel=True`` reduce-scattered along
  ``sequence_dim`` (``[.., s/T, .., N]``); the bias is added once, after the reduction. The GEMM and its
  reduction are one dispatcher op, so selective checkpointing keeps the reduced output only, not the
  partial product over the whole sequence.
- :class:`VocabParallelEmbedding`: weight ``[V, H]`` as ``Shard(0)`` over the vocabulary; ids outside
  this rank's rows look up zeros, then all-reduce (or reduce-scatter along ``sequence_dim``).
- :func:`smptk.parallel.loss.vocab_parallel_cross_entropy` takes the vocab-sharded logits of a
  column-parallel head (``gather_output=False``).
- ParallelStyles for ``torch.distributed.tensor.parallel.parallelize_module``
  (:mod:`smptk.parallel.tp_styles`): ``SmptkColwiseParallel`` and ``SmptkRowwiseParallel`` turn an
  ``nn.Linear`` into the layers above, ``SmptkVocabParallel`` an ``nn.Embedding``, with its weights.

Parameters are DTensors on the 1-D ``tp`` mesh (default ``smptk.parallel.current().submesh("tp")``),
so FSDP2's ``fully_shard`` and ``torch.distributed.checkpoint`` handle them as they handle torch's own
tensor-parallel parameters; the forward runs ``smptk.kernels.fused_linear`` / ``swiglu`` /
``F.embedding`` on the local shards (``to_local()``) and the collectives of :mod:`smptk.comm.functional`
(so ``smptk.comm``'s symmetric heap, its torch.distributed fallback and the ``max_sms`` that
``smptk.parallel.init`` configures from ``comm_max_sms`` apply). Outputs are plain local tensors.
Feature and vocabulary sizes that are sharded must be divisible by T (an error names the numbers;
pad the vocabulary to a multiple of T, as Megatron-LM's ``make_vocab_size_divisible_by`` does).

Sequence dim. Activations in a sequence-parallel region are split along ``sequence_dim`` (default 1:
``[b, s, h]``, torchtitan's layout; pass 0 for Megatron-LM's ``[s, b, h]``, negative values count from
the end, so -2 serves both ``[b, s, h]`` and ``[s, h]``). Rank r holds sequence block r.

Gradients follow :mod:`smptk.comm.functional`'s convention: the objective is the sum of the ranks'
losses, where a rank's loss covers what it holds; a replicated tensor's loss counts once. So a
replicated input enters through ``copy_to_group`` (its gradient is all-reduced), a partial sum leaves a
replicated region through ``reduce_from_group``, and a replicated parameter that sees only this rank's
sequence block (the row-parallel bias under sequence parallelism) gets its gradient all-reduced, so
every rank holds the whole gradient of every replicated parameter.

Paths. ``last_path`` on each layer names the path of its last forward: "fused" or "unfused" (the
collective, then the GEMM on the local shard). A column-parallel layer with ``sequence_parallel`` and
``sequence_dim=0`` (Megatron-LM's ``[s, b, h]``, where the ranks' blocks stack as rows), no SwiGLU pair
and no ``gather_output`` runs :func:`smptk.comm.fused_linear.all_gather_linear`: one Triton kernel that
all-gathers the blocks through the symmetric heap within ``max_sms`` SMs while its GEMM tiles start as
their rows arrive. A row-parallel layer with ``sequence_parallel`` and ``sequence_dim=0`` runs
:func:`smptk.comm.fused_linear.linear_reduce_scatter`: one Triton kernel whose GEMM epilogue stores each
tile into the heap slot of the rank that owns its rows, where ``max_sms`` programs sum the slots. Each
one's backward runs the other's kernel (the column layer's input gradient is a GEMM + reduce-scatter, the
row layer's an all-gather GEMM). Where the heap does not apply a layer falls back to the unfused pair
and ``last_fused_reason`` says why (also when the layer's config has no fused path: no sequence
parallelism, sequence dim 1, a SwiGLU pair, ``gather_output``). ``last_kernel_path`` names the kernel
path ("triton" or "torch", :func:`smptk.kernels.runtime.select_path`); ``smptk.comm.last_path()`` names
the collective's.

Initialization (``reset_parameters``) reproduces the unsharded module exactly: each rank draws the full
weight from one generator, in ``nn.Linear`` / ``nn.Embedding``'s order, and keeps its slice
(:mod:`smptk.parallel.shard_init`: which generator, and the time / memory trade-off). Construction with
``device="meta"`` allocates and draws nothing; ``to_empty(device=...)`` then ``reset_parameters()``
materializes the shards (also after ``fully_shard``).

Example (every rank of a 2-rank tensor-parallel job)::

    >>> import smptk.parallel as sp
    >>> state = sp.init({"tensor_parallel_degree": 2})
    >>> up = sp.ColumnParallelLinear(64, 256, activation="gelu")   # weight: DTensor [256, 64], Shard(0)
    >>> down = sp.RowParallelLinear(256, 64)                       # weight: DTensor [64, 256], Shard(1)
    >>> y = down(up(torch.randn(4, 16, 64)))                       # [4, 16, 64], equal on both ranks
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import smptk.comm.functional as cf
from smptk.comm import collectives as _coll
from smptk.comm.fused_linear import all_gather_linear, linear_reduce_scatter
from smptk.kernels import fused_linear, runtime
from smptk.kernels import swiglu as swiglu_kernel
from smptk.kernels._checks import SUPPORTED_DTYPES, autocast_inputs, check_activation
from smptk.kernels._dispatch import dispatcher_op, first_derivative_only, gemm_flops
from smptk.kernels._triton import kernel_module
from smptk.parallel.shard_init import fill_shard, init_generator, init_linear, local

PATHS = ("fused", "unfused")  # what ``last_path`` can say
_fl = kernel_module("smptk.kernels.fused_linear")
_epilogue = kernel_module("smptk.kernels._epilogue")


# --------------------------------------------------------------------------------------------- helpers


def _tp_mesh(mesh: DeviceMesh | None) -> DeviceMesh:
    """``mesh``, checked to be 1-D, or the current state's ``tp`` submesh."""
    if mesh is None:
        from smptk.parallel.config import current

        return current().submesh("tp")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh: expected a 1-D DeviceMesh (e.g. state.submesh('tp')), got {type(mesh).__name__}"
        )
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names or tuple(range(mesh.ndim))
        raise ValueError(
            f"mesh: expected a 1-D DeviceMesh, got {mesh.ndim} dimensions {tuple(names)}; pass mesh['tp']"
        )
    return mesh


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def _check_divisible(name: str, value: int, tp: int, what: str = "") -> int:
    if value % tp:
        hint = what or f"pad it to a multiple of {tp} (e.g. {-(-value // tp) * tp})"
        raise ValueError(
            f"{name} {value} is not divisible by the tensor-parallel size {tp}: each of the {tp} ranks "
            f"holds an equal shard; {hint}"
        )
    return value // tp


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return value


def _check_sequence_dim(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"sequence_dim: expected an int, got {type(value).__name__} {value!r}")
    return value


def _param_device(mesh: DeviceMesh, device: torch.device | str | None) -> torch.device:
    """``device``; else "meta" inside ``with torch.device("meta")`` (delayed initialization), else the mesh's
    device (the current CUDA device for a CUDA mesh)."""
    if device is not None:
        return torch.device(device)
    if torch.get_default_device().type == "meta":
        return torch.device("meta")
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _sharded_param(
    full_shape: tuple[int, ...], placement, mesh: DeviceMesh, device: torch.device, dtype: torch.dtype
) -> nn.Parameter:
    """An uninitialized DTensor parameter of global ``full_shape``; only this rank's shard is allocated."""
    local_shape = list(full_shape)
    if isinstance(placement, Shard):
        local_shape[placement.dim] //= mesh.size()
    local = torch.empty(local_shape, device=device, dtype=dtype)
    stride = torch.empty(full_shape, device="meta").stride()
    dt = DTensor.from_local(
        local, mesh, [placement], run_check=False, shape=torch.Size(full_shape), stride=stride
    )
    return nn.Parameter(dt)


def _linear_dtype(dtype: torch.dtype | None) -> torch.dtype:
    """The linears' parameter dtype, ``dtype`` or torch's default: one smptk's GEMMs take (checked here, not
    at the first forward)."""
    dtype = dtype or torch.get_default_dtype()
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"dtype: {dtype} is not supported by smptk's linears; expected float32, float16 or bfloat16"
        )
    return dtype


def _shard_of(full: torch.Tensor, placement, mesh: DeviceMesh, src_data_rank: int | None) -> nn.Parameter:
    """``full`` (the same on every rank, or taken from ``src_data_rank``) as a DTensor parameter; a frozen
    ``full`` (``requires_grad`` False) gives a frozen parameter."""
    if full.is_meta:
        param = _sharded_param(tuple(full.shape), placement, mesh, full.device, full.dtype)
    else:
        param = nn.Parameter(distribute_tensor(full.detach(), mesh, [placement], src_data_rank=src_data_rank))
    return param.requires_grad_(full.requires_grad)


# What a subclass may define and still convert: construction, and how it prints.
_HARMLESS_OVERRIDES = frozenset({"__init__", "extra_repr", "__repr__"})


def _own_methods(cls: type, base: type) -> list[str]:
    """The methods and properties ``cls`` defines between itself and ``base`` (``forward`` first)."""
    names = {
        name
        for klass in cls.__mro__[: cls.__mro__.index(base)]
        for name, value in vars(klass).items()
        if name not in _HARMLESS_OVERRIDES
        and (callable(value) or isinstance(value, (property, classmethod, staticmethod)))
    }
    return sorted(names, key=lambda n: (n != "forward", n))


def _check_plain(module: nn.Module, base: type[nn.Module], name: str, state: tuple[str, ...]) -> None:
    """``module`` is a ``base`` whose conversion loses nothing: a subclass with its own ``forward`` or other
    methods (a ``reset_parameters`` with its own init), or with parameters, buffers or submodules beyond
    ``state``, would have them dropped silently (a scaled embedding lost its scale; a zero-init layer
    materialized with nn.Linear's init), so it is refused; so is a module another style already
    parallelized (DTensor parameters)."""
    if not isinstance(module, base):
        raise TypeError(f"{name}: expected an nn.{base.__name__}, got {type(module).__name__}")
    cls = type(module)
    methods = _own_methods(cls, base)
    extra = [n for n, _ in module.named_parameters(recurse=False) if n not in state]
    extra += [n for n, _ in module.named_buffers(recurse=False)] + list(module._modules)
    if methods or extra:
        what = f"its own {', '.join(methods)}" if methods else ""
        what += (" and " if what and extra else "") + (f"state {extra}" if extra else "")
        raise TypeError(
            f"{name}: {cls.__name__} subclasses nn.{base.__name__} with {what}, which the tensor-parallel "
            f"layer would drop; convert a plain nn.{base.__name__} (apply the extra computation around it)"
        )
    sharded = [n for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)]
    if sharded:
        raise TypeError(
            f"{name}: its parameters {sharded} are DTensors already (parallelized by another style, or "
            f"sharded); convert the plain nn.{base.__name__}, once"
        )


def _from_linear(cls, linear, w_placement, b_placement, mesh, src_data_rank, options):
    """A ``cls`` layer (built on meta) holding ``linear``'s weight and bias under the given placements."""
    _check_plain(linear, nn.Linear, "linear", ("weight", "bias"))
    w, b = linear.weight, linear.bias
    layer = cls(
        linear.in_features,
        linear.out_features,
        b is not None,
        mesh=mesh,
        device="meta",
        dtype=w.dtype,
        **options,
    )
    layer.weight = _shard_of(w, w_placement, layer.mesh, src_data_rank)
    if b is not None:
        layer.bias = _shard_of(b, b_placement, layer.mesh, src_data_rank)
    return layer


def _unfused_by_design(sequence_parallel: bool, sequence_dim: int) -> str:
    """Why a layer whose config has no fused path ran unfused (``last_fused_reason``)."""
    if not sequence_parallel:
        return "no sequence parallelism (the fused linears gather or scatter the sequence)"
    return (
        f"sequence_dim {sequence_dim}: the fused linears need the sequence as dim 0 ([s, b, h]), where each "
        "rank's block is whole rows"
    )


def _local_input(x: object, mesh: DeviceMesh, name: str, shard_dim: int | None = None) -> torch.Tensor:
    """``x`` as this rank's local tensor: a plain tensor, or a DTensor on ``mesh`` that is Replicate (or,
    when ``shard_dim`` is given, sharded along that dim of ``x``; negative counts from the end, and the
    dim's global length must divide by the mesh size: the layers gather equal blocks)."""
    if isinstance(x, DTensor):
        if x.device_mesh != mesh:
            raise ValueError(
                f"{name}: a DTensor on mesh {x.device_mesh}, but the layer's parameters are on {mesh}"
            )
        allowed = [(Replicate(),)] if shard_dim is None else [(Shard(shard_dim % x.dim()),)]
        if tuple(x.placements) not in allowed:
            raise ValueError(
                f"{name}: a DTensor with placements {tuple(x.placements)}; this layer takes {allowed[0]} "
                "(or a plain local tensor)"
            )
        if shard_dim is not None:  # torch splits an uneven length into unequal blocks (3, 3, 1 for 7 / 3)
            d = shard_dim % x.dim()
            _check_seq_divisible(name, x.shape[d], d, tuple(x.shape), mesh.size())
        return x.to_local()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or DTensor, got {type(x).__name__}")
    return x


def _local_param(layer: nn.Module, name: str) -> torch.Tensor | None:
    """``layer.<name>`` (a DTensor on the layer's ``tp`` mesh, or None) as this rank's shard. Raises where it
    is on another mesh: FSDP2's sharded parameter, which its unit gathers only inside the unit's forward, so
    a submodule called directly (not through the module FSDP2 wrapped) would compute with a piece of it."""
    p = getattr(layer, name)
    if p is None:
        return None
    if p.device_mesh is not layer.mesh and p.device_mesh != layer.mesh:
        raise RuntimeError(
            f"{type(layer).__name__}.{name}: a DTensor on mesh dims {p.device_mesh.mesh_dim_names}, not this "
            f"layer's {layer.mesh.mesh_dim_names}: FSDP2's sharded parameter, not gathered. Call the module "
            "that apply_data_parallel returned (the root), not its submodules: its units gather their "
            "parameters in their own forwards, the root's (embeddings, heads, norms) in the root's."
        )
    return p.to_local()


def _seq_dim(sequence_dim: int, ndim: int, name: str, shape: tuple) -> int:
    """``sequence_dim`` as an index into an activation of ``ndim`` dims, which must not be the feature dim."""
    if not -ndim <= sequence_dim < ndim or sequence_dim % ndim == ndim - 1:
        raise ValueError(
            f"{name}: sequence_dim {sequence_dim} does not name a sequence dimension of shape {shape} "
            f"(the last dimension holds the features)"
        )
    return sequence_dim % ndim


def _check_seq_divisible(name: str, length: int, dim: int, shape: tuple, tp: int) -> None:
    if length % tp:
        raise ValueError(
            f"{name}: sequence length {length} (dim {dim} of shape {shape}) is not divisible by the "
            f"tensor-parallel size {tp}; sequence_parallel=True gives each rank an equal block"
        )


# ------------------------------------------------------------------------------------------------ layers


def _check_versions_in_backward(layer: nn.Module, args: tuple, out: object) -> None:
    """A forward hook: backward through ``out`` raises, as autograd does for a saved tensor, where one of the
    layer's parameters was modified in place after the forward (an optimizer step, ``weight.mul_()``).

    The kernels get each DTensor parameter's local shard (``to_local()``), whose version counter an in-place
    op on the DTensor does not move: autograd's own check cannot see the update, and the backward computed
    the input gradient with the new weights (torch's ``nn.Linear`` and DTensor styles raise). FSDP2's
    gathered parameters are new tensors every forward, so their shards' updates never show here.
    """
    if not isinstance(out, torch.Tensor) or not out.requires_grad or torch.compiler.is_compiling():
        return
    seen = [(name, p, p._version) for name, p in layer.named_parameters(recurse=False)]

    def check(grad: torch.Tensor) -> None:
        for name, p, version in seen:
            if p._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: {type(layer).__name__}.{name} is at version {p._version}; expected version "
                    f"{version} (it was updated between this layer's forward and its backward, e.g. by an "
                    "optimizer step: step after backward)"
                )

    out.register_hook(check)


class _GatherSequence(torch.autograd.Function):
    """All-gather the sequence blocks (``dim``) of a tp group into a region whose input gradient is whole
    and equal on every tp rank (its column-parallel layers all-reduce it already, or it runs whole on
    every rank, as a MoE layer does): backward keeps this rank's block of that gradient, where an
    all-gather's reduce-scatter would add the tp equal copies."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, tp: int, rank: int, dim: int) -> torch.Tensor:
        ctx.tp, ctx.rank, ctx.dim = tp, rank, dim
        return cf.all_gather(x, group, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.tp, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None, None


class _TensorParallelLayer(nn.Module):
    """What every layer here shares: the mesh and its group, the sequence-parallel settings, the paths."""

    def _setup(self, mesh: DeviceMesh | None, sequence_parallel: bool, sequence_dim: int) -> None:
        self.mesh = _tp_mesh(mesh)
        self.tp_size = self.mesh.size()
        self.tp_rank = self.mesh.get_local_rank()
        self._group_ranks = tuple(dist.get_process_group_ranks(self.mesh.get_group()))
        self.sequence_parallel = _check_bool("sequence_parallel", sequence_parallel)
        self.sequence_dim = _check_sequence_dim(sequence_dim)
        self.last_path: str | None = None
        self.last_fused_reason: str | None = None  # why the fused path did not run (linear layers)
        self.last_kernel_path: str | None = None
        self.register_forward_hook(_check_versions_in_backward)

    @property
    def group(self):
        """The ProcessGroup of :attr:`mesh` (not stored: a module holding one could not be deep-copied).

        A mesh finds its group by name, and names are reused after ``destroy_process_group``: a layer built
        in an earlier process group raises here instead of running on whatever group now has its name."""
        try:
            group = self.mesh.get_group()
            ranks = tuple(dist.get_process_group_ranks(group))
        except (RuntimeError, KeyError, ValueError) as e:
            ranks, cause = None, str(e)
        else:
            cause = f"its mesh now names the group of ranks {list(ranks)}"
        built = getattr(self, "_group_ranks", ranks)
        if ranks != built:
            raise RuntimeError(
                f"{type(self).__name__}: built for the tensor-parallel group of ranks {list(built)}, but "
                f"{cause}: the process group it was built in has been destroyed (destroy_process_group); "
                "build the model again in this one"
            )
        return group


class ColumnParallelLinear(_TensorParallelLayer):
    """``act(x @ W.T + b)`` with ``W [N, K]`` split by output rows over the ``tp`` mesh: ``[.., N/T]`` a rank.

    Args:
        in_features, out_features: K and N; N must be divisible by T.
        bias: learn a bias ``[N]`` (``Shard(0)``). Not with ``swiglu``.
        activation: None, "relu", "gelu", "gelu_tanh" or "silu", fused into the GEMM's epilogue.
        swiglu: hold a gate/up pair ``weight_gate``, ``weight_up`` (``[N, K]`` each, ``Shard(0)``) and
            return ``silu(x @ Wg.T) * (x @ Wu.T)`` (``smptk.kernels.swiglu``), a Llama MLP's first half.
        sequence_parallel: ``x`` is this rank's block of the sequence along ``sequence_dim``; it is
            all-gathered before the GEMM (backward: reduce-scatter of its gradient).
        sequence_dim: see the module docstring (default 1: ``[b, s, h]``).
        gather_output: all-gather the output's features, returning ``[.., N]`` on every rank (for a
            replicated consumer; backward keeps this rank's slice of the gradient).
        mesh: 1-D DeviceMesh; default ``smptk.parallel.current().submesh("tp")``.
        device, dtype: of the local shards; device defaults to the mesh's; "meta" allocates nothing.

    Input ``x [.., K]`` (plain, or a DTensor: Replicate, or ``Shard(sequence_dim)`` with sequence
    parallelism). Output: local ``[.., N/T]`` (the sequence gathered with sequence parallelism).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        activation: str | None = None,
        swiglu: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        gather_output: bool = False,
        mesh: DeviceMesh | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self._setup(mesh, sequence_parallel, sequence_dim)
        self.in_features = _check_size("in_features", in_features)
        self.out_features = _check_size("out_features", out_features)
        _check_divisible("out_features", out_features, self.tp_size, "choose out_features divisible by it")
        check_activation(activation)
        self.swiglu = _check_bool("swiglu", swiglu)
        if swiglu and activation is not None:
            raise ValueError(
                f"activation: swiglu=True applies silu to the gate itself; got activation={activation!r}"
            )
        if swiglu and bias:
            raise ValueError(
                "bias: the SwiGLU pair has no bias (smptk.kernels.swiglu takes none); pass bias=False"
            )
        self.activation = activation
        self.gather_output = _check_bool("gather_output", gather_output)
        device = _param_device(self.mesh, device)
        dtype = _linear_dtype(dtype)
        self._weights = ("weight_gate", "weight_up") if swiglu else ("weight",)
        for name in self._weights:
            self.register_parameter(
                name, _sharded_param((out_features, in_features), Shard(0), self.mesh, device, dtype)
            )
        b = _sharded_param((out_features,), Shard(0), self.mesh, device, dtype) if bias else None
        self.register_parameter("bias", b)
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Each weight (gate, then up) as ``nn.Linear(K, N)`` draws it, then the bias (module docstring)."""
        init_linear(self, self._weights, generator)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, mesh: DeviceMesh | None = None, src_data_rank: int | None = 0, **options
    ) -> ColumnParallelLinear:
        """A new layer holding ``linear``'s weight and bias, split by rows (``linear`` is left as it is).

        ``src_data_rank``: the group rank whose weights every rank receives (torch scatters them), or None
        when every rank holds the same ones already. ``options``: the constructor's keyword arguments.
        """
        return _from_linear(cls, linear, Shard(0), Shard(0), mesh, src_data_rank, options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _local_input(x, self.mesh, "x", self.sequence_dim if self.sequence_parallel else None)
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"x: expected [..., {self.in_features}] (in_features), got shape {tuple(x.shape)}"
            )
        weights = [_local_param(self, n) for n in self._weights]
        # In the dtype the GEMM reads under autocast, before any gather: the all-gather moves the compute
        # dtype, backward keeps this rank's block (the GEMM's own cast of the gathered x made a new tensor
        # that saved_as_shard does not know, so the whole gathered input was saved), last_kernel_path is
        # the GEMM's
        (x,) = autocast_inputs(x)
        keep = contextlib.nullcontext()
        if self.sequence_parallel:
            d = _seq_dim(self.sequence_dim, x.dim(), "x", tuple(x.shape))
            if d == 0 and not self.swiglu and not self.gather_output:
                return self._fused_forward(x, weights[0])
            x_local, x = x, cf.all_gather(x, self.group, dim=d)
            keep = cf.saved_as_shard(x, x_local, self.group, dim=d)  # backward gathers it again
        else:
            x = cf.copy_to_group(x, self.group)
        self.last_kernel_path = runtime.select_path(x, weights[0])
        with keep:
            if self.swiglu:
                y = swiglu_kernel(x, *weights)
            else:
                b = _local_param(self, "bias")
                y = fused_linear(x, weights[0], b, activation=self.activation)
        if self.gather_output:
            # Zero-pad this rank's features into place and sum: the gather, with a backward that keeps
            # this rank's slice (the consumer is replicated); an all-gather's backward would sum T copies.
            n = y.shape[-1]
            y = F.pad(y, (self.tp_rank * n, (self.tp_size - 1 - self.tp_rank) * n))
            y = cf.reduce_from_group(y, self.group)
        self.last_path = "unfused"
        self.last_fused_reason = (
            "a SwiGLU pair (the fused all-gather GEMM takes one weight)"
            if self.swiglu
            else "gather_output (the fused all-gather GEMM leaves its output sharded)"
            if self.gather_output
            else _unfused_by_design(self.sequence_parallel, self.sequence_dim)
        )
        return y

    def _fused_forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Sequence dim 0: the ranks' blocks stack as rows, so :func:`all_gather_linear` gathers them inside
        the GEMM (its fallback, where the heap does not apply, is the unfused pair)."""
        b = _local_param(self, "bias")
        rows = x.reshape(-1, x.shape[-1])
        y, path = all_gather_linear(rows, w, b, group=self.group, activation=self.activation)
        self.last_kernel_path = runtime.select_path(rows, w)
        self.last_path = "fused" if path == "fused" else "unfused"
        self.last_fused_reason = None if path == "fused" else path.removeprefix("unfused: ")
        return y.reshape(self.tp_size * x.shape[0], *x.shape[1:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, activation={self.activation}, swiglu={self.swiglu}, "
            f"sequence_parallel={self.sequence_parallel}, "
            f"sequence_dim={self.sequence_dim}, gather_output={self.gather_output}, tp={self.tp_size}"
        )


# The row-parallel layer's unfused forward, its partial product and the reduction of it, as one dispatcher op
# (smptk.kernels._dispatch): selective checkpointing then keeps only the reduced output, not also the
# partial product ([.., N] over the whole sequence) that nothing in backward reads.
def _row_parallel_fake(x, w, group_name, dim, max_sms):
    shape = [*x.shape[:-1], w.shape[0]]
    if dim >= 0:
        shape[dim] //= torch.distributed.get_world_size(_coll._named_group(group_name))
    return x.new_empty(shape)


def _row_parallel_flops(x, w, *_, out_shape):
    return gemm_flops(math.prod(x[:-1]), x[-1], w[0])  # this rank's partial product (the reduction adds)


@dispatcher_op("row_parallel_linear_fwd", fake=_row_parallel_fake, flops=_row_parallel_flops)
def _row_parallel_fwd(
    x: torch.Tensor, w: torch.Tensor, group_name: str, dim: int, max_sms: int | None
) -> torch.Tensor:
    """``x @ w.T`` on this rank, reduce-scattered along ``dim`` over the named group (sequence parallelism),
    or all-reduced where ``dim`` is -1."""
    partial = fused_linear(x, w)
    if dim >= 0:
        return cf._reduce_scatter_fwd(partial, group_name, dim, "sum", max_sms)
    return cf._all_reduce_fwd(partial, group_name, "sum", max_sms)


class _RowParallelLinearFunction(torch.autograd.Function):
    """:func:`_row_parallel_fwd` with its backward: the reduce-scatter's (all-gather the gradient along the
    sequence) or the replicated region's (identity), then the GEMM's (``dx = g @ w``, ``dw = g.T @ x``)."""

    @staticmethod
    def forward(ctx, x, w, group, dim: int, max_sms):
        ctx.save_for_backward(x, w)
        ctx.group, ctx.dim, ctx.max_sms = group, dim, max_sms
        return _row_parallel_fwd(x, w, group.group_name, dim, max_sms)

    @staticmethod
    @first_derivative_only("RowParallelLinear")
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        if ctx.dim >= 0:
            g = cf._all_gather_fwd(g.contiguous(), ctx.group.group_name, ctx.dim, ctx.max_sms)
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        need_dx, need_dw = ctx.needs_input_grad[:2]
        if runtime.select_path(x, w) == "triton":
            dx, dw, _ = _fl.fused_linear_bwd(
                g2.contiguous(), x2, w, None, _epilogue.ACT_NONE, (need_dx, need_dw, False)
            )
        else:
            dx = g2 @ w if need_dx else None
            dw = g2.t() @ x2 if need_dw else None
        return (dx.view(x.shape) if dx is not None else None), dw, None, None, None


class RowParallelLinear(_TensorParallelLayer):
    """``x @ W.T + b`` with ``W [N, K]`` split by input columns over the ``tp`` mesh; partial sums reduced.

    Args:
        in_features, out_features: K and N; K must be divisible by T.
        bias: learn a bias ``[N]``, replicated, added once after the reduction.
        sequence_parallel: reduce-scatter the output along ``sequence_dim`` (each rank keeps its
            sequence block; the sequence length must be divisible by T) instead of all-reducing it.
        sequence_dim: see the module docstring (default 1: ``[b, s, h]``).
        input_is_parallel: ``x`` is ``[.., K/T]``, this rank's features (a column-parallel layer's
            output); False: ``x`` is the replicated ``[.., K]`` and each rank takes its slice.
        mesh, device, dtype: as for :class:`ColumnParallelLinear`.

    Output: ``[.., N]`` on every rank, or with sequence parallelism this rank's sequence block.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        input_is_parallel: bool = True,
        mesh: DeviceMesh | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self._setup(mesh, sequence_parallel, sequence_dim)
        self.in_features = _check_size("in_features", in_features)
        self.out_features = _check_size("out_features", out_features)
        self.in_local = _check_divisible(
            "in_features", in_features, self.tp_size, "choose in_features divisible by it"
        )
        self.input_is_parallel = _check_bool("input_is_parallel", input_is_parallel)
        device = _param_device(self.mesh, device)
        dtype = _linear_dtype(dtype)
        self.weight = _sharded_param((out_features, in_features), Shard(1), self.mesh, device, dtype)
        b = _sharded_param((out_features,), Replicate(), self.mesh, device, dtype) if bias else None
        self.register_parameter("bias", b)
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """The weight and bias as ``nn.Linear(K, N)`` draws them; see the module docstring."""
        init_linear(self, ("weight",), generator)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, mesh: DeviceMesh | None = None, src_data_rank: int | None = 0, **options
    ) -> RowParallelLinear:
        """A new layer holding ``linear``'s weight (split by columns) and bias (replicated); see
        :meth:`ColumnParallelLinear.from_linear`."""
        return _from_linear(cls, linear, Shard(1), Replicate(), mesh, src_data_rank, options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_is_parallel:
            x = _local_input(x, self.mesh, "x", -1)
            if x.dim() < 1 or x.shape[-1] != self.in_local:
                raise ValueError(
                    f"x: expected this rank's features [..., {self.in_local}] (in_features "
                    f"{self.in_features} / tensor-parallel size {self.tp_size}, input_is_parallel=True), "
                    f"got shape {tuple(x.shape)}"
                )
        else:
            x = _local_input(x, self.mesh, "x")
            if x.dim() < 1 or x.shape[-1] != self.in_features:
                raise ValueError(
                    f"x: expected the replicated [..., {self.in_features}] (in_features, "
                    "input_is_parallel=False), "
                    f"got shape {tuple(x.shape)}"
                )
            x = cf.copy_to_group(x, self.group).narrow(-1, self.tp_rank * self.in_local, self.in_local)
        (x,) = autocast_inputs(x)  # the dtype the GEMM computes in: last_kernel_path is the GEMM's
        w = _local_param(self, "weight")
        self.last_kernel_path = runtime.select_path(x, w)
        if self.sequence_parallel:
            d = _seq_dim(self.sequence_dim, x.dim(), "x", tuple(x.shape))
            _check_seq_divisible("x", x.shape[d], d, tuple(x.shape), self.tp_size)
            if d == 0:
                return self._fused_forward(x, w)
        x, w = autocast_inputs(x, w)  # as fused_linear would, so backward sees what the GEMM read
        y = _RowParallelLinearFunction.apply(x, w, self.group, d if self.sequence_parallel else -1, None)
        if self.bias is not None:
            (b,) = autocast_inputs(_local_param(self, "bias"))  # F.linear's bias too: y keeps its dtype
            if self.sequence_parallel:  # each rank's bias gradient covers its tokens only: sum them
                b = cf.copy_to_group(b, self.group)
            y = y + b
        self.last_path = "unfused"
        self.last_fused_reason = _unfused_by_design(self.sequence_parallel, self.sequence_dim)
        return y

    def _fused_forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Sequence dim 0: this rank's sequence block is a block of rows, so :func:`linear_reduce_scatter`
        reduce-scatters inside the GEMM (its fallback, where the heap does not apply, is the unfused
        pair)."""
        b = _local_param(self, "bias")
        rows = x.reshape(-1, x.shape[-1])
        y, path = linear_reduce_scatter(rows, w, b, group=self.group)
        self.last_path = "fused" if path == "fused" else "unfused"
        self.last_fused_reason = None if path == "fused" else path.removeprefix("unfused: ")
        return y.reshape(x.shape[0] // self.tp_size, *x.shape[1:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}, "
            f"sequence_dim={self.sequence_dim}, "
            f"input_is_parallel={self.input_is_parallel}, tp={self.tp_size}"
        )


class VocabParallelEmbedding(_TensorParallelLayer):
    """``nn.Embedding`` with its ``[V, H]`` table split by vocabulary rows over the ``tp`` mesh.

    Rank r holds ids ``r*V/T .. (r+1)*V/T``: it looks up the ids in its range, zeros the others, and the
    partial rows are summed by an all-reduce (or, with ``sequence_parallel``, a reduce-scatter along
    ``sequence_dim`` of the output). V must be divisible by T (pad the vocabulary; the padded columns of
    the logits then need masking in the loss: see :func:`~smptk.parallel.vocab_parallel_cross_entropy`).

    Args:
        num_embeddings, embedding_dim: V and H.
        padding_idx: as ``nn.Embedding``'s: that row starts at zero and gets no gradient.
        sequence_parallel, sequence_dim: the output's sequence split (``sequence_dim`` indexes the
            output ``[.., H]``; default 1: ids ``[b, s]`` give ``[b, s/T, H]``).
        mesh, device, dtype: as for :class:`ColumnParallelLinear`.

    Input: int64 or int32 ids ``[..]`` in ``0 .. V-1``, replicated (the same on every rank); an id out of
    range raises IndexError (on CUDA a device-side assert, as ``nn.Embedding``'s, without a host sync).
    Output: ``[.., H]``, or this rank's sequence block of it.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        padding_idx: int | None = None,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        mesh: DeviceMesh | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self._setup(mesh, sequence_parallel, sequence_dim)
        self.num_embeddings = _check_size("num_embeddings", num_embeddings)
        self.embedding_dim = _check_size("embedding_dim", embedding_dim)
        self.vocab_local = _check_divisible("num_embeddings", num_embeddings, self.tp_size)
        self.vocab_start = self.tp_rank * self.vocab_local
        if padding_idx is not None:
            if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
                raise TypeError(f"padding_idx: expected an int or None, got {padding_idx!r}")
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx: {padding_idx} is outside the vocabulary of {num_embeddings}")
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        device = _param_device(self.mesh, device)
        dtype = dtype or torch.get_default_dtype()
        self.weight = _sharded_param((num_embeddings, embedding_dim), Shard(0), self.mesh, device, dtype)
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """N(0, 1) as ``nn.Embedding`` draws it, the padding row zeroed; see the module docstring."""
        if local(self.weight).is_meta:
            return
        first_row = [0]  # fill_shard draws the full table's row blocks in order

        def draw(block: torch.Tensor, gen: torch.Generator) -> None:
            nn.init.normal_(block, generator=gen)
            pad = None if self.padding_idx is None else self.padding_idx - first_row[0]
            if pad is not None and 0 <= pad < block.shape[0]:
                block[pad].zero_()  # in the full table's rows: right under any further sharding (FSDP2)
            first_row[0] += block.shape[0]

        fill_shard(self.weight, draw, init_generator(generator))

    def _local_padding_idx(self) -> int | None:
        p = self.padding_idx
        if p is not None and self.vocab_start <= p < self.vocab_start + self.vocab_local:
            return p - self.vocab_start
        return None

    @classmethod
    def from_embedding(
        cls,
        embedding: nn.Embedding,
        *,
        mesh: DeviceMesh | None = None,
        src_data_rank: int | None = 0,
        **options,
    ) -> VocabParallelEmbedding:
        """A new layer holding ``embedding``'s table split by rows (see ColumnParallelLinear.from_linear).

        ``padding_idx`` carries over; an embedding with ``max_norm``, ``scale_grad_by_freq`` or ``sparse``
        set is refused (the layer has none of them)."""
        _check_plain(embedding, nn.Embedding, "embedding", ("weight",))
        unsupported = [
            f"{name}={value!r} (expected {default!r})"
            for name, default in (("max_norm", None), ("scale_grad_by_freq", False), ("sparse", False))
            if (value := getattr(embedding, name)) != default
        ]
        if unsupported:
            raise ValueError(
                f"embedding: {', '.join(unsupported)} is not supported by VocabParallelEmbedding; build the "
                "nn.Embedding without it"
            )
        w = embedding.weight
        layer = cls(
            embedding.num_embeddings, embedding.embedding_dim, padding_idx=embedding.padding_idx,
            mesh=mesh, device="meta", dtype=w.dtype, **options,
        )  # fmt: skip
        layer.weight = _shard_of(w, Shard(0), layer.mesh, src_data_rank)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = _local_input(ids, self.mesh, "ids")
        if ids.dtype not in (torch.int64, torch.int32):  # F.embedding's index dtypes
            raise TypeError(f"ids: expected an int64 or int32 tensor (as nn.Embedding), got {ids.dtype}")
        _check_index_range("ids", ids, self.num_embeddings)
        if self.sequence_parallel:
            d = _seq_dim(self.sequence_dim, ids.dim() + 1, "ids", (*ids.shape, self.embedding_dim))
            _check_seq_divisible("ids", ids.shape[d], d, tuple(ids.shape), self.tp_size)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.vocab_local)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        y = F.embedding(local_ids, _local_param(self, "weight"), self._local_padding_idx())
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            y = cf.reduce_scatter(y, self.group, dim=d)
        else:
            y = cf.reduce_from_group(y, self.group)
        self.last_path = "unfused"
        self.last_kernel_path = "torch"
        return y

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
            f"sequence_parallel={self.sequence_parallel}, sequence_dim={self.sequence_dim}, tp={self.tp_size}"
        )


def _check_index_range(name: str, idx: torch.Tensor, size: int, ignore_index: int | None = None) -> None:
    """Raise IndexError when an element of ``idx`` (other than ``ignore_index``) is outside ``0 .. size-1``.

    CPU: a host check naming the offending value. CUDA: ``torch._assert_async`` (a device-side assert,
    as ``nn.Embedding`` and ``F.cross_entropy`` raise there), so no host sync stalls the step.
    """
    bad = (idx < 0) | (idx >= size)
    if ignore_index is not None:
        bad &= idx != ignore_index
    if idx.device.type == "cuda":
        torch._assert_async(~bad.any(), f"{name}: an index is outside 0..{size - 1}")
    elif idx.device.type != "meta" and bool(bad.any()):
        value = idx[bad].flatten()[0].item()
        raise IndexError(f"{name}: index {value} is outside 0..{size - 1}")


__all__ = [
    "PATHS",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
]
