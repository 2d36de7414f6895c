"""Parallelism layer: ParallelConfig, DeviceMesh setup, TP/SP/EP layers, FSDP2 hybrid sharding, transform().

Imports go one way (kernels <- comm <- parallel). Each capability arrives with its own issue (see
DESIGN.md, "Public surface"); what is here today:

- :class:`ParallelConfig` and :func:`init` (:mod:`smptk.parallel.config`): the config keys of managed
  model-parallel libraries, checked against the world size, and one DeviceMesh with dims
  ``(dp_replicate, dp_shard, tp)`` plus the flattened ``dp`` and the expert mesh ``(dp_replicate,
  edp_shard, ep, tp)``; :func:`current` returns the :class:`ParallelState` (meshes, groups, this rank's
  coordinates, seeds) that layers read, :func:`reset` forgets it.
- Tensor / sequence parallelism (:mod:`smptk.parallel.tensor_parallel`): :class:`ColumnParallelLinear`
  (fused activation or SwiGLU pair), :class:`RowParallelLinear`, :class:`VocabParallelEmbedding`, all with
  DTensor parameters on the ``tp`` mesh and a ``sequence_parallel`` option; the ParallelStyles
  :class:`SmptkColwiseParallel`, :class:`SmptkRowwiseParallel`, :class:`SmptkVocabParallel` for
  ``parallelize_module`` (:mod:`smptk.parallel.tp_styles`); :func:`vocab_parallel_cross_entropy`
  (:mod:`smptk.parallel.loss`) on vocab-sharded logits.
- :class:`MoE`: router + SwiGLU experts (+ shared experts), one device or expert-parallel over a process
  group, on smptk's MoE kernels and ``smptk.comm.all_to_all_single``.
"""

from smptk.parallel.config import (
    ParallelConfig,
    ParallelState,
    current,
    init,
    is_initialized,
    reset,
)
from smptk.parallel.loss import vocab_parallel_cross_entropy
from smptk.parallel.moe import MoE
from smptk.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from smptk.parallel.tp_styles import SmptkColwiseParallel, SmptkRowwiseParallel, SmptkVocabParallel

__all__ = [
    "ColumnParallelLinear",
    "MoE",
    "ParallelConfig",
    "ParallelState",
    "RowParallelLinear",
    "SmptkColwiseParallel",
    "SmptkRowwiseParallel",
    "SmptkVocabParallel",
    "VocabParallelEmbedding",
    "current",
    "init",
    "is_initialized",
    "reset",
    "vocab_parallel_cross_entropy",
]
