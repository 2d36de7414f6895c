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
- Sharded data parallelism (:mod:`smptk.parallel.fsdp`): :func:`apply_data_parallel` applies FSDP2 over the
  ``(dp_replicate, dp_shard)`` mesh (full shard, HSDP) or DDP with smptk's comm hook (replication), with the
  config's mixed precision and smptk's all-gather / reduce-scatter where its heap applies; the
  :class:`DataParallelReport` says which path each collective took.
- Checkpoints that reshard (:mod:`smptk.parallel.dcp`, on ``torch.distributed.checkpoint``):
  :func:`save_checkpoint` / :func:`load_checkpoint` move model and optimizer state between any two
  configs (and one process); :func:`load_full_state_dict` broadcasts a full state dict held by rank 0;
  :func:`get_full_state_dict` gathers one; :func:`checkpoint_keys` lists what a checkpoint holds.
- Activations and initialization: :func:`apply_activation_checkpointing` (:mod:`smptk.parallel.checkpointing`:
  full or selective recomputation of each block, as ``activation_checkpointing`` says, and with
  ``sm_activation_offloading`` an :class:`ActivationOffloader` keeping the blocks' inputs in host memory)
  and
  :func:`materialize` (:mod:`smptk.parallel.delayed_init`: a meta-built, sharded model gets memory and
  initial values, each rank only its shards).
- :func:`clip_grad_norm_` (:mod:`smptk.parallel.clip`): torch's gradient clipping for parameters on several
  meshes (tensor-parallel, FSDP2, expert-parallel and plain ones in one model), where torch's refuses.
- :class:`MoE`: router + SwiGLU experts (+ shared experts), one device or expert-parallel over a process
  group, on smptk's MoE kernels and ``smptk.comm.all_to_all_single``.
- Expert parallelism as DTensors (:mod:`smptk.parallel.expert_parallel`): the ParallelStyle
  :class:`ExpertParallel` splits a MoE's :class:`GroupedExperts` weights ``Shard(0)`` over the ``ep`` mesh
  and exchanges its rows; :func:`apply_expert_parallel` does it for every MoE of a model and makes each
  experts module an FSDP2 unit over ``(dp_replicate, edp_shard)``.
- :func:`transform` (:mod:`smptk.parallel.transform`): a stock Hugging Face Llama, Mistral, Qwen2, Qwen3,
  Mixtral or Qwen3-MoE model made parallel in place: MoE blocks become :class:`MoE`, then tensor, expert
  and data parallelism and activation checkpointing as the config says (:class:`TransformReport`;
  :func:`moe_aux_loss` for the MoE layers' load-balancing loss, :func:`hf_state_dict` to save it back in
  the Hugging Face layout, :func:`load_hf_state_dict` to load Hugging Face weights into a meta-built,
  transformed, materialized model, :func:`hf_layout` / :func:`smptk_layout` to convert a state dict's
  MoE names and layouts either way).
"""

from smptk.parallel.checkpointing import ActivationOffloader, apply_activation_checkpointing
from smptk.parallel.clip import clip_grad_norm_
from smptk.parallel.config import (
    ParallelConfig,
    ParallelState,
    current,
    init,
    is_initialized,
    reset,
)
from smptk.parallel.dcp import (
    checkpoint_keys,
    get_full_state_dict,
    load_checkpoint,
    load_full_state_dict,
    save_checkpoint,
)
from smptk.parallel.delayed_init import materialize
from smptk.parallel.expert_parallel import ExpertParallel, apply_expert_parallel
from smptk.parallel.fsdp import DataParallelReport, DataParallelUnit, apply_data_parallel
from smptk.parallel.loss import vocab_parallel_cross_entropy
from smptk.parallel.moe import GroupedExperts, MoE
from smptk.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from smptk.parallel.tp_styles import SmptkColwiseParallel, SmptkRowwiseParallel, SmptkVocabParallel
from smptk.parallel.transform import (
    TransformReport,
    hf_layout,
    hf_state_dict,
    load_hf_state_dict,
    moe_aux_loss,
    smptk_layout,
    transform,
)

__all__ = [
    "ActivationOffloader",
    "ColumnParallelLinear",
    "DataParallelReport",
    "DataParallelUnit",
    "ExpertParallel",
    "GroupedExperts",
    "MoE",
    "ParallelConfig",
    "ParallelState",
    "RowParallelLinear",
    "SmptkColwiseParallel",
    "SmptkRowwiseParallel",
    "SmptkVocabParallel",
    "TransformReport",
    "VocabParallelEmbedding",
    "apply_activation_checkpointing",
    "apply_data_parallel",
    "apply_expert_parallel",
    "checkpoint_keys",
    "clip_grad_norm_",
    "current",
    "get_full_state_dict",
    "hf_layout",
    "hf_state_dict",
    "init",
    "is_initialized",
    "load_checkpoint",
    "load_full_state_dict",
    "load_hf_state_dict",
    "materialize",
    "moe_aux_loss",
    "reset",
    "save_checkpoint",
    "smptk_layout",
    "transform",
    "vocab_parallel_cross_entropy",
]
