"""Shard initialization that reproduces the unsharded module's: draw the full tensor, keep this rank's part.

A sharded layer's ``reset_parameters`` reproduces the unsharded module exactly: the full weight is drawn
on the CPU, in the module's dtype, from one generator in ``nn.Linear`` / ``nn.Embedding``'s order
(weight, then bias), and each rank keeps its slice. So ``torch.manual_seed(s)`` + ``nn.Linear(K, N)``
and the same generator state + ``ColumnParallelLinear(K, N)`` assemble to the same weight, for any T.
The generator: the ``generator`` argument, else torch's default CPU generator, the one ``nn.Linear``
draws from on the CPU. :func:`smptk.parallel.init` seeds it with ``random_seed`` on every rank, so a
model built after ``init`` (smptk's layers and torch's in any mix) starts identical on every rank, and,
built on the CPU, equal to the unsharded model built after ``torch.manual_seed(random_seed)`` in the same
order: both draw one stream in construction order. Every rank must keep that generator in step until the
model is built (no per-rank reseeding in between). The trade-off: each rank spends the time of drawing
the whole weight (the generators cannot skip ahead), but memory stays bounded: the draw goes in row
blocks of about ``INIT_BLOCK_ELEMS`` elements whose sizes keep torch's CPU ``normal_`` stream (it draws
16 values at a time) identical to one whole draw. Construction with ``device="meta"`` allocates and
draws nothing; ``to_empty(device=...)`` then ``reset_parameters()`` materializes the shards.

Used by :mod:`smptk.parallel.tensor_parallel`; any DTensor parameter works (a 1-D ``Shard`` /
``Replicate`` one is cut block by block; another layout, e.g. after ``fully_shard``, is drawn whole and
cut by ``distribute_tensor``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

# Rows per initialization draw: about 16 Mi elements (64 MiB in fp32) of host memory at a time. Untuned:
# it bounds memory, the time is the whole weight's draw either way.
INIT_BLOCK_ELEMS = 1 << 24
_NORMAL_GROUP = 16  # torch's CPU normal_ fills 16 values at a time (and redraws the last 16 of a tail)


def init_generator(generator: torch.Generator | None) -> torch.Generator:
    """The generator ``reset_parameters`` draws from (see the module docstring)."""
    if generator is None:
        return torch.default_generator
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        raise TypeError(f"generator: expected a CPU torch.Generator, got {generator!r}")
    return generator


def row_blocks(rows: int, row_elems: int, target: int) -> list[tuple[int, int]]:
    """Row ranges covering ``0 .. rows``: each block a whole number of 16-element groups but the last,
    which has at least 16 elements, so torch's CPU ``normal_`` draws the same values as in one call."""
    if rows * row_elems <= target or row_elems == 0:
        return [(0, rows)]
    unit = _NORMAL_GROUP // math.gcd(row_elems, _NORMAL_GROUP)  # rows per whole number of groups
    per = max(unit, target // row_elems // unit * unit)
    blocks = [(r, min(r + per, rows)) for r in range(0, rows, per)]
    if len(blocks) > 1 and (blocks[-1][1] - blocks[-1][0]) * row_elems < _NORMAL_GROUP:
        blocks[-2:] = [(blocks[-2][0], rows)]
    return blocks


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_region(param: DTensor) -> tuple[slice, ...] | None:
    """This rank's slice of the global tensor for a 1-D-mesh Shard / Replicate DTensor; None otherwise."""
    if param.device_mesh.ndim != 1:
        return None
    (placement,) = param.placements
    region = [slice(0, n) for n in param.shape]
    if isinstance(placement, Shard) and type(placement) is Shard:
        n = param.shape[placement.dim] // param.device_mesh.size()
        r = param.device_mesh.get_local_rank()
        region[placement.dim] = slice(r * n, (r + 1) * n)
    elif not isinstance(placement, Replicate):
        return None
    return tuple(region)


@torch.no_grad()
def fill_shard(
    param: nn.Parameter, draw: Callable[[torch.Tensor, torch.Generator], None], gen: torch.Generator
) -> None:
    """Draw the full ``param`` block by block on the CPU with ``draw(block, gen)`` and keep this rank's part.

    ``draw`` fills a ``[rows, *shape[1:]]`` block as the unsharded module's init fills the whole weight; it
    is called on the full tensor's row blocks in order, from row 0 (so a draw can count rows to find a
    global row, as the embedding's padding row).
    """
    shape, dtype = tuple(param.shape), param.dtype
    local = param.to_local() if isinstance(param, DTensor) else param
    region = _local_region(param) if isinstance(param, DTensor) else tuple(slice(0, n) for n in shape)
    if region is None:  # e.g. after fully_shard: draw it whole, let torch cut this rank's piece
        full = torch.empty(shape, dtype=dtype)
        for r0, r1 in row_blocks(shape[0], math.prod(shape[1:]), INIT_BLOCK_ELEMS):
            draw(full[r0:r1], gen)
        piece = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        local.copy_(piece)
        return
    rows = region[0]
    for r0, r1 in row_blocks(shape[0], math.prod(shape[1:]), INIT_BLOCK_ELEMS):
        block = torch.empty((r1 - r0, *shape[1:]), dtype=dtype)
        draw(block, gen)
        lo, hi = max(r0, rows.start), min(r1, rows.stop)
        if lo < hi:
            local[lo - rows.start : hi - rows.start].copy_(block[(slice(lo - r0, hi - r0), *region[1:])])


def _linear_weight_draw(block: torch.Tensor, gen: torch.Generator) -> None:
    nn.init.kaiming_uniform_(block, a=math.sqrt(5), generator=gen)  # nn.Linear.reset_parameters


def _uniform_draw(bound: float) -> Callable[[torch.Tensor, torch.Generator], None]:
    return lambda block, gen: nn.init.uniform_(block, -bound, bound, generator=gen)


def init_linear(module: nn.Module, weights: tuple[str, ...], generator: torch.Generator | None) -> None:
    """nn.Linear's init of each named weight in turn, then of the bias (bound 1/sqrt(in_features))."""
    if any(local(p).is_meta for p in module.parameters(recurse=False)):
        return  # nothing to draw into; to_empty() then reset_parameters() materializes
    gen = init_generator(generator)
    for name in weights:
        fill_shard(getattr(module, name), _linear_weight_draw, gen)
    if getattr(module, "bias", None) is not None:
        fan_in = module.in_features
        fill_shard(module.bias, _uniform_draw(1 / math.sqrt(fan_in) if fan_in > 0 else 0.0), gen)
