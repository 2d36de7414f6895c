"""ParallelStyles that turn torch modules into smptk's tensor-parallel layers under ``parallelize_module``.

- :class:`SmptkColwiseParallel`: ``nn.Linear`` -> :class:`~smptk.parallel.ColumnParallelLinear`
  (weight and bias split by output rows; optional fused activation, sequence parallelism, gathered output).
- :class:`SmptkRowwiseParallel`: ``nn.Linear`` -> :class:`~smptk.parallel.RowParallelLinear` (weight split
  by input columns, bias replicated).
- :class:`SmptkVocabParallel`: ``nn.Embedding`` -> :class:`~smptk.parallel.VocabParallelEmbedding`.

They play the part of torch's ``ColwiseParallel`` / ``RowwiseParallel``, with smptk's kernels and
collectives underneath: the converted module holds DTensor parameters on the 1-D mesh it is given and
returns plain local tensors. ``torch.distributed.tensor.parallel.parallelize_module`` ignores what a
style returns for a submodule, so each style converts the module object in place: its class, parameters
and the base class's attributes become the new layer's; its hooks, its train/eval mode and attributes you
set on it stay. A fused activation replaces the one the model applies after the layer: set that one to
``nn.Identity()``.

The converted module is no longer an ``nn.Linear`` / ``nn.Embedding`` (torch's styles keep the class,
and ``fully_shard`` makes a subclass of it): an init function that dispatches on
``isinstance(m, nn.Linear)`` (``model.apply(init_fn)``) skips it. Dispatch on smptk's layer classes too,
or call their ``reset_parameters()`` (:func:`smptk.parallel.materialize` does, after ``to_empty``).

Only plain ``nn.Linear`` / ``nn.Embedding`` modules convert: a subclass with methods of its own (a
``forward``, a ``reset_parameters`` with its own init) or extra state (a scaled embedding, a parametrized
weight) is refused, since the new layer would drop it; so is a module another style already parallelized.
A weight two modules share (an embedding tied to the head, ``lm_head.weight = embed.weight``) stays one
parameter when both convert through these styles (torch's styles untie it): ``SmptkVocabParallel`` on the
embedding and ``SmptkColwiseParallel`` on the head both split the ``[V, H]`` table by vocabulary rows, and
the second conversion takes the first one's DTensor. A shared weight that the two styles would split
differently (a tied ``SmptkRowwiseParallel`` layer) is refused. A module left unconverted keeps the old full
tensor, untied from the converted one: convert both, or tie them again after ``parallelize_module``.

Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU), a tensor-parallel group of 2::

    >>> import torch
    >>> import torch.distributed as dist
    >>> from torch import nn
    >>> from torch.distributed.tensor.parallel import parallelize_module
    >>> import smptk.parallel as sp
    >>> from smptk.parallel import SmptkColwiseParallel, SmptkRowwiseParallel, SmptkVocabParallel
    >>> dist.init_process_group("gloo")
    >>> state = sp.init({"tensor_parallel_degree": 2})
    >>> class MLP(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
    ...     def forward(self, x):
    ...         return self.down(torch.relu(self.up(x)))
    >>> class Model(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed, self.mlp = nn.Embedding(50, 16), MLP()
    ...         self.lm_head = nn.Linear(16, 50, bias=False)
    ...     def forward(self, ids):
    ...         return self.lm_head(self.mlp(self.embed(ids)))
    >>> model = Model()
    >>> model = parallelize_module(model, state.submesh("tp"), {
    ...     "embed": SmptkVocabParallel(),
    ...     "mlp.up": SmptkColwiseParallel(), "mlp.down": SmptkRowwiseParallel(),
    ...     "lm_head": SmptkColwiseParallel(),     # vocab-sharded logits: vocab_parallel_cross_entropy
    ... })
    >>> model(torch.tensor([[1, 2, 3]])).shape      # this rank's half of the vocabulary
    torch.Size([1, 3, 25])
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle
from torch.utils.weak import WeakIdKeyDictionary

from smptk.kernels._checks import check_activation
from smptk.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _check_bool,
    _check_sequence_dim,
    _tp_mesh,
)

_MODULE_KEYS = frozenset(nn.Module().__dict__) - {
    "_parameters",
    "_buffers",
    "_non_persistent_buffers_set",
    "_modules",
}


# The hook registries of a module (dicts keyed by the handles' ids, unique across modules).
_HOOK_KEYS = tuple(k for k, v in nn.Module().__dict__.items() if "hook" in k and isinstance(v, dict))


@functools.cache
def _base_keys(base: type[nn.Module]) -> frozenset[str]:
    """The attributes every ``base`` instance has beyond nn.Module's (nn.Linear's in_features, ...)."""
    return frozenset(vars(base(1, 1, device="meta"))) - _MODULE_KEYS - {"_parameters", "_buffers", "_modules"}


def _become(module: nn.Module, new: nn.Module, base: type[nn.Module]) -> nn.Module:
    """Turn ``module`` into ``new`` in place (class, parameters, ``base``'s attributes), keeping its hooks,
    its mode and the attributes its user set (``lin.init_std = 0.02``); ``new``'s own hooks are added.

    ``parallelize_module`` discards what a style's ``_apply`` returns for a submodule, so a style that
    swaps the layer must change the object the parent holds.
    """
    for key in [
        k for k in module.__dict__ if k in _base_keys(base) or (k in new.__dict__ and k not in _MODULE_KEYS)
    ]:
        del module.__dict__[key]
    for key, value in new.__dict__.items():
        if key not in _MODULE_KEYS:
            module.__dict__[key] = value
    for key in _HOOK_KEYS:  # the layer's own checks (its saved weights unchanged at backward)
        module.__dict__[key].update(new.__dict__[key])
    module.__class__ = new.__class__
    return module


# Each source parameter a style converted -> the DTensor parameter it became, held while the source lives:
# a parameter another module shares (a tied embedding and head) converts once, so the tie holds.
_CONVERTED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _keep_ties(sources: dict[str, nn.Parameter], new: nn.Module, module: nn.Module) -> None:
    """Give ``new`` the DTensor parameter an earlier conversion made of the same source parameter (a weight
    ``module`` shares with a converted module), where it is split the same way; else record ``new``'s."""
    for name, source in sources.items():
        param = getattr(new, name)
        earlier = _CONVERTED.get(source)
        if earlier is None:
            _CONVERTED[source] = param
            continue
        if earlier.device_mesh != param.device_mesh or tuple(earlier.placements) != tuple(param.placements):
            raise ValueError(
                f"{type(module).__name__}.{name}: shared with a module converted before (a tied weight), "
                f"which split it as {tuple(earlier.placements)} over {earlier.device_mesh}; "
                f"{type(new).__name__} splits it as {tuple(param.placements)} over {param.device_mesh}. "
                "A shared weight must be split the same way by both styles (or untie it: give one module "
                "a copy)"
            )
        setattr(new, name, earlier)


class _LayerStyle(ParallelStyle):
    """A style that converts the module in place into the layer ``_convert`` builds from it."""

    _convert: Callable[..., nn.Module]
    _base: type[nn.Module] = nn.Linear
    options: dict

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"device_mesh: expected a DeviceMesh, got {type(device_mesh).__name__}")
        convert = type(self)._convert
        sources = dict(module.named_parameters(recurse=False))
        new = convert(module, mesh=_tp_mesh(device_mesh), src_data_rank=self.src_data_rank, **self.options)
        _keep_ties(sources, new, module)
        return _become(module, new, type(self)._base)


class SmptkColwiseParallel(_LayerStyle):
    """Turn an ``nn.Linear`` into a :class:`ColumnParallelLinear` holding its weights (split by rows).

    Keyword args: ``activation``, ``sequence_parallel``, ``sequence_dim``, ``gather_output``, as for
    :class:`ColumnParallelLinear`. The module is converted in place (its hooks stay); its weights come
    from group rank ``src_data_rank`` of the mesh (``parallelize_module``'s argument; None: each rank's own).

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> from torch.distributed.tensor.parallel import parallelize_module
        >>> import smptk.parallel as sp
        >>> from smptk.parallel import SmptkColwiseParallel, SmptkRowwiseParallel
        >>> dist.init_process_group("gloo")
        >>> state = sp.init({"tensor_parallel_degree": 2})
        >>> mlp = nn.ModuleDict({"up": nn.Linear(8, 32), "down": nn.Linear(32, 8)})
        >>> mlp = parallelize_module(mlp, state.submesh("tp"), {"up": SmptkColwiseParallel(activation="gelu"),
        ...                                                    "down": SmptkRowwiseParallel()})
        >>> type(mlp["up"]).__name__, mlp["up"].weight.to_local().shape     # this rank's 16 of 32 rows
        ('ColumnParallelLinear', torch.Size([16, 8]))
        >>> mlp["down"](mlp["up"](torch.ones(2, 8))).shape
        torch.Size([2, 8])
    """

    _convert = ColumnParallelLinear.from_linear

    def __init__(
        self,
        *,
        activation: str | None = None,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        gather_output: bool = False,
    ) -> None:
        super().__init__()
        check_activation(activation)
        self.options = {
            "activation": activation,
            "sequence_parallel": _check_bool("sequence_parallel", sequence_parallel),
            "sequence_dim": _check_sequence_dim(sequence_dim),
            "gather_output": _check_bool("gather_output", gather_output),
        }


class SmptkRowwiseParallel(_LayerStyle):
    """Turn an ``nn.Linear`` into a :class:`RowParallelLinear` holding its weights (split by columns).

    Keyword args: ``sequence_parallel``, ``sequence_dim``, ``input_is_parallel``, as for
    :class:`RowParallelLinear`; conversion as :class:`SmptkColwiseParallel`'s.
    """

    _convert = RowParallelLinear.from_linear

    def __init__(
        self, *, sequence_parallel: bool = False, sequence_dim: int = 1, input_is_parallel: bool = True
    ):
        super().__init__()
        self.options = {
            "sequence_parallel": _check_bool("sequence_parallel", sequence_parallel),
            "sequence_dim": _check_sequence_dim(sequence_dim),
            "input_is_parallel": _check_bool("input_is_parallel", input_is_parallel),
        }


class SmptkVocabParallel(_LayerStyle):
    """Turn an ``nn.Embedding`` into a :class:`VocabParallelEmbedding` holding its table (split by rows).

    Keyword args: ``sequence_parallel``, ``sequence_dim``, as for :class:`VocabParallelEmbedding`;
    conversion as :class:`SmptkColwiseParallel`'s.
    """

    _convert = VocabParallelEmbedding.from_embedding
    _base = nn.Embedding

    def __init__(self, *, sequence_parallel: bool = False, sequence_dim: int = 1):
        super().__init__()
        self.options = {
            "sequence_parallel": _check_bool("sequence_parallel", sequence_parallel),
            "sequence_dim": _check_sequence_dim(sequence_dim),
        }


__all__ = ["SmptkColwiseParallel", "SmptkRowwiseParallel", "SmptkVocabParallel"]
