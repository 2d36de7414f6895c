"""Per-GPU memory of a training step: :func:`estimate_memory` and its :class:`MemoryEstimate`.

Legend: ``b`` micro-batch (sequences per data-parallel rank), ``s`` sequence length, ``T = b*s`` tokens,
``h`` hidden, ``a`` / ``g`` query / key-value heads of ``d``, ``f`` MLP width, ``V`` vocabulary, ``t`` the
tensor-parallel degree (``a_t = a/t``, ``g_t = g/t``, ``f_t = f/t``, ``V_t = V/t``), ``T_r`` the tokens a
rank holds between the tensor-parallel regions (``T/t`` with sequence parallelism, else ``T``), ``B`` the
compute dtype's bytes (2 for bf16 / fp16, 4 for fp32). Bytes are those of the busiest rank (rank 0).

**Model states**, divided as smptk divides them (:meth:`ModelSpec.tensors` says which split each tensor
takes): column / row-parallel weights and the vocabulary over ``tp``, norms and routers replicated over
``tp``, routed experts over ``ep`` (replicated over ``tp``); then FSDP2 shards every tensor's dim 0 over
``dp_shard`` (experts over ``edp_shard``), padding it to a multiple of the shard count as FSDP2 does (rank
0 holds ``ceil(dim0 / shard)`` rows), except stacked experts whose local count does not divide by
``edp_shard``: smptk shards those on dim 1 when it divides (``expert_parallel.expert_shard_dim``); HSDP
replicas (``dp_replicate``) hold copies. Under FSDP2 mixed
precision (``MixedPrecisionPolicy(bf16, reduce fp32)``, :mod:`smptk.parallel.fsdp`) the sharded parameters
stay fp32 (4 bytes: they are the master weights), their gradients are fp32 (4) and Adam keeps two fp32
moments (8): 16 bytes per sharded parameter. The bf16 copies the usual "20 bytes per parameter" counts
(bf16 parameter 2 + bf16 gradient 2) exist only for the FSDP2 unit being computed and are transient
below. ``hybrid_shard_degree=1`` with fp32 and no TP runs DDP: full fp32 parameters, gradients, Adam
moments, and DDP's gradient buckets (a second copy of the gradients, 4 bytes per parameter); not under
``delayed_parameter_initialization``, whose model is built on the meta device, which DDP cannot take
(``apply_data_parallel`` replicates it on FSDP2: no buckets, no heap over ``dp``). Other
optimizers: ``"sgd"`` 0 bytes of state, ``"sgd_momentum"`` 4, ``"adamw"`` / ``"adam"`` 8.

**Activations** are what autograd keeps from forward to backward in smptk's reference transformer
(:mod:`smptk.testing.transformer`: RMSNorm, GQA attention with RoPE, SwiGLU, parallelized with smptk's
layers), term by term per block (no checkpointing):

- each RMSNorm its input and fp32 rstd: ``2 (T_r h B + 4 T_r)``;
- the inputs of the column-parallel projections: one replicated ``T h B`` shared by q / k / v and one
  by gate / up; with sequence parallelism the sequence block ``T_r h B`` instead (smptk's column layers
  keep this rank's block and gather it again in backward, as Megatron-LM does:
  :func:`smptk.comm.functional.saved_as_shard`), and the same for the LM head's input;
- attention, ``"flash"`` (``F.scaled_dot_product_attention``'s flash kernels): q, k, v, the output and
  its fp32 log-sum-exp, ``T d (2 a_t + 2 g_t) B + 4 T a_t``; the kernel writes the output as
  ``[b, s, heads, d]``, so o_proj's input is a view of it, not a second tensor. ``"materialized"``
  (softmax(QK^T) V written out): q and k, v expanded to the query heads, the ``b a_t s^2``
  probabilities, the causal mask (bool, ``s^2``) and o_proj's input (the ``[b, heads, s, d]`` output
  copied into ``[b, s, heads d]``), ``4 T a_t d B + b a_t s^2 B + s^2``;
- SwiGLU: gate and up outputs, silu(gate) and down's input, ``4 T f_t B`` (GELU MLP: ``2 T f_t B``);
- MoE layers instead (:class:`smptk.parallel.MoE` on smptk's Triton kernels, the GPU path): the normed
  input ``T h B`` (and under 16-bit compute the router's fp32 copy of it, ``4 T h``), the router's fp32
  logits ``4 T E``, the routing (fp32 weights, int32 expert ids, int64 destinations, source tokens and
  source pairs: ``32`` bytes per routed row, ``T k`` rows, plus ``24 E`` of counts; the layer also
  keeps it as ``last_routing`` / ``last_plan``), the dispatched rows ``T k h B``, per routed row the
  grouped SwiGLU's gate and up pre-activations and down's input ``3 f_m B`` and the expert output
  ``h B`` (balanced routing), and the shared experts' ``3 T f_s B`` (the same kernels per token).
  smptk's PyTorch fallback (``SMPTK_KERNELS=torch``, CPU) keeps more: per-expert GEMM outputs and
  ``index_add``'s input (tests/test_planner_validation.py measured 1.2x this without checkpointing);
- MLA attention: the down-projected latents and the attention of ``d_qk = nope + rope``, ``d_v`` heads,
  derived the same way but not checked against a reference (smptk's reference transformer has none).

Outside the blocks: the token ids and the loss's targets (int64, ``16 T``; under tensor parallelism
also the bool masks of the vocab-parallel embedding, ``T``, and loss, ``2 T``, which a ``"gathered"``
loss does not have), the final norm, the LM head's
input ``T_r h B`` and the loss's fp32 softmax ``4 T V_t`` (``F.cross_entropy`` and
:func:`smptk.parallel.vocab_parallel_cross_entropy` both keep it). Checkpointing: ``"full"`` keeps each
block's input ``T_r h B`` (a MoE block also its routing, which the layer holds as attributes) and
recomputes one block at a time in backward (that block's activations are transient); ``"selective"``
(:func:`smptk.parallel.checkpointing.saved_ops`) keeps the input and the outputs of the matrix products,
attention kernels and collectives: q, k, v, o, gate, up, down, attention output and log-sum-exp; under
tensor parallelism o's and down's outputs are the row-parallel layers' reduced outputs (their GEMM and
reduction are one op, so the partial products are not kept), ``T_r h B`` each with sequence parallelism,
and the all-gathers are recomputed; in a MoE block the router's
logits, the routing, the grouped SwiGLU's output and ``[g | u]`` and the grouped down projection's
output per routed row, the shared experts' the same per token, and under expert parallelism the two
all-to-alls' outputs (``2 T k h B``, derived, not measured; MLA's tensor-parallel collectives are not
counted). smptk's Triton GEMMs and collectives are kept like torch's: their forwards are dispatcher ops
under the policy's mode. Offloading moves the
checkpointed inputs to pinned host memory and keeps at most ``activation_loading_horizon`` of them on
the GPU; the host bytes are reported (not in the GPU total). Korthikanti et al. (2022) count
``sbh(34 + 5as/h)`` per GPT layer with dropout; this model has no dropout and a SwiGLU MLP, so its
terms differ, and they are checked against what autograd really keeps (tests/test_planner_validation.py:
within 10%; the dense, tensor-parallel and MoE terms come out within 0.5% at its small shapes). A Hugging
Face Llama prepared with :func:`~smptk.parallel.transform` keeps more, measured exactly at tp 1 and at tp 2
with and without sequence parallelism: ``4 T_r h`` per Hugging Face RMSNorm autograd keeps (all ``2L + 1``
with no checkpointing, the final one under "full" and "selective"), RoPE's ``[1, s, d]`` cos and sin
``2 s d B``, under checkpointing the blocks' position ids ``8 s`` (and eager attention's additive mask
``b s^2 B``; the first block keeps its sequence block, as the others do: transform splits the sequence
ahead of its checkpoint), eager without checkpointing no boolean mask but in 16 bits its fp32 softmax
``4 b a_t s^2`` per block (README, Memory planning). ``implementation="hf"`` adds that excess to the plan as
its own activation term.

**Transient**: FSDP2's all-gathered units in the compute dtype (the root unit, embeddings and head, stays
gathered from forward to backward; a block and its prefetched successor; on a 1-rank shard group FSDP2 copies
the parameters instead of gathering them, so fp32 without sharding holds them too), the gathered gradients of
one unit before its reduce-scatter (compute dtype, then the fp32 reduce-scatter input); the logits ``T V_t B``
and their fp32 gradient during the loss; one recomputed block under checkpointing; the MoE all-to-all send and
receive buffers ``2 T k h B``. **smptk's symmetric heaps**: one per group that uses them (tp, dp_shard, ep
with more than one rank, inside one node; dp_shard and ep that both span every rank are one group, torch's
default), ``heap_bytes`` each (by default what :mod:`smptk.comm` uses in this process:
``SMPTK_COMM_HEAP_BYTES`` or ``comm.configure``'s, 64 MiB unset) plus the signal pad and control words, in
whole 4 KiB pages (:func:`smptk.comm.heap.segment_bytes`, what a rank allocates). **Allocator margin**: 5% of
the allocated bytes (fragmentation in PyTorch's caching allocator; the CUDA context, ~0.5 GiB outside the
allocator, is left to the fit check of :func:`smptk.parallel.planner.advise`).

Example::

    >>> from smptk.parallel.planner import estimate_memory
    >>> est = estimate_memory("llama2-7b", {"hybrid_shard_degree": 0}, seq_len=4096, micro_batch=1,
    ...                       cluster="p4d.24xlarge")
    >>> est.parameter_bytes == est.gradient_bytes == est.optimizer_bytes // 2
    True
    >>> round(est.total_bytes / 2**30, 1) < 40
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from smptk import comm
from smptk.comm.collectives import check_heap_bytes
from smptk.comm.heap import segment_bytes
from smptk.parallel.config import ParallelConfig
from smptk.parallel.expert_parallel import expert_shard_dim
from smptk.parallel.planner.clusters import Cluster
from smptk.parallel.planner.clusters import cluster as _cluster
from smptk.parallel.planner.models import ModelSpec, model_spec

OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 0, "sgd_momentum": 4}
ATTENTION = ("flash", "materialized")
LOSSES = ("vocab_parallel", "gathered")  # how the logits meet the loss at tp > 1 (see estimate_memory)
# whose layers the activations are those of (see estimate_memory): smptk's reference transformer, or a Hugging
# Face model prepared with transform (Hugging Face's norms, RoPE and loss, and their measured excess)
IMPLEMENTATIONS = ("smptk", "hf")
ALLOCATOR_MARGIN = 0.05
_COMPUTE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
KINDS = ("parameters", "gradients", "optimizer", "activations", "transient", "comm", "margin")


@dataclasses.dataclass(frozen=True)
class MemoryTerm:
    """One line of the breakdown: ``bytes`` on the busiest GPU, its ``kind`` (:data:`KINDS`), and how
    it was counted.

    Example::

        >>> from smptk.parallel.planner import estimate_memory
        >>> est = estimate_memory("llama2-7b", {"hybrid_shard_degree": 0}, seq_len=4096,
        ...                       cluster="p4d.24xlarge")
        >>> est.terms[0]   # 6.74B fp32 parameters sharded over 8 GPUs: 842,301,952 x 4 bytes
        MemoryTerm(name='parameters (fp32 master)', bytes=3369207808, kind='parameters',
                   detail='842,301,952 elements on rank 0 (tp 1, ep 1, dp_shard 8)')
        >>> [t.name for t in est.terms if t.kind == "activations"]
        ['activations: 32 dense blocks', 'activations: embedding, final norm, head, loss']
    """

    name: str
    bytes: int
    kind: str
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """The per-GPU bytes of one training step, term by term (see the module docstring).

    Example::

        >>> from smptk.parallel.planner import estimate_memory
        >>> est = estimate_memory("llama2-7b", {"hybrid_shard_degree": 0}, seq_len=4096,
        ...                       cluster="p4d.24xlarge")
        >>> est.engine, est.sizes["dp_shard"], len(est.terms)
        ('fsdp2 full_shard', 8, 10)
        >>> round(est.parameter_bytes / 2**30, 2), round(est.activation_bytes / 2**30, 2)  # GiB
        (3.14, 19.32)
        >>> round(est.total_bytes / 2**30, 2), est.fits(), est.fits(memory_bytes=24 * 2**30)
        (36.79, True, False)
        >>> print(est.table().splitlines()[0])    # est.table(): one row per term, then the total
        llama2-7b on 8 GPUs: tp 1 x dp_shard 8 x dp_replicate 1, fsdp2 full_shard, seq 4096 x micro-batch 1,
        checkpointing none
        >>> config = {"hybrid_shard_degree": 0, "activation_checkpointing": "full"}
        >>> full = estimate_memory("llama2-7b", config, seq_len=4096, cluster="p4d.24xlarge")
        >>> round(full.activation_bytes / 2**30, 2)  # each block keeps only its input
        1.55
    """

    model: ModelSpec
    config: ParallelConfig
    world_size: int
    sizes: dict
    seq_len: int
    micro_batch: int
    optimizer: str
    attention: str
    sequence_parallel: bool
    engine: str
    terms: tuple[MemoryTerm, ...]
    host_bytes: int
    cluster: Cluster | None = None
    implementation: str = "smptk"

    def bytes_of(self, kind: str) -> int:
        return sum(t.bytes for t in self.terms if t.kind == kind)

    @property
    def parameter_bytes(self) -> int:
        return self.bytes_of("parameters")

    @property
    def gradient_bytes(self) -> int:
        return self.bytes_of("gradients")

    @property
    def optimizer_bytes(self) -> int:
        return self.bytes_of("optimizer")

    @property
    def activation_bytes(self) -> int:
        return self.bytes_of("activations")

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def gpu_memory_bytes(self) -> int | None:
        return self.cluster.gpu.memory_bytes if self.cluster else None

    def fits(self, memory_bytes: int | None = None, reserve_bytes: int = 2**29) -> bool:
        """Whether ``total_bytes`` fits in ``memory_bytes`` (default: the cluster's GPU) less
        ``reserve_bytes`` (the CUDA context, 0.5 GiB)."""
        memory = memory_bytes if memory_bytes is not None else self.gpu_memory_bytes
        if memory is None:
            raise ValueError("fits: no cluster given; pass memory_bytes")
        return self.total_bytes <= memory - reserve_bytes

    def to_dict(self) -> dict:
        return {
            "model": self.model.name,
            "config": dataclasses.asdict(self.config),
            "world_size": self.world_size,
            "sizes": dict(self.sizes),
            "seq_len": self.seq_len,
            "micro_batch": self.micro_batch,
            "optimizer": self.optimizer,
            "attention": self.attention,
            "sequence_parallel": self.sequence_parallel,
            "engine": self.engine,
            "implementation": self.implementation,
            "terms": [dataclasses.asdict(t) for t in self.terms],
            "total_bytes": self.total_bytes,
            "host_bytes": self.host_bytes,
            "gpu_memory_bytes": self.gpu_memory_bytes,
        }

    def rows(self) -> list[tuple[str, str, str, str]]:
        """``(term, kind, GiB, detail)`` per term, then the total."""
        out = [(t.name, t.kind, f"{t.bytes / 2**30:.2f}", t.detail) for t in self.terms]
        total = f"{self.total_bytes / 2**30:.2f}"
        cap = self.gpu_memory_bytes
        out.append(("total", "", total, f"of {cap / 2**30:.1f} GiB per GPU" if cap else ""))
        if self.host_bytes:
            out.append(("host (pinned, offloaded)", "", f"{self.host_bytes / 2**30:.2f}", "not in the total"))
        return out

    def title(self) -> str:
        sz = self.sizes
        return (
            f"{self.model.name} on {self.world_size} GPUs: tp {sz['tp']} x dp_shard {sz['dp_shard']} x "
            f"dp_replicate {sz['dp_replicate']}"
            + (f", ep {sz['ep']}" if sz["ep"] > 1 else "")
            + (", sequence parallel" if self.sequence_parallel else "")
            + f", {self.engine}, seq {self.seq_len} x micro-batch {self.micro_batch}, "
            f"checkpointing {self.config.activation_checkpointing}"
            + (
                f" + offload (horizon {self.config.activation_loading_horizon})"
                if self.config.sm_activation_offloading
                else ""
            )
        )

    def table(self) -> str:
        rows = self.rows()
        widths = [max(len(r[i]) for r in [*rows, ("term", "kind", "GiB", "how")]) for i in range(4)]
        line = lambda r: "  ".join(
            (r[i].rjust(widths[i]) if i == 2 else r[i].ljust(widths[i])) for i in range(4)
        ).rstrip()
        return "\n".join([self.title(), line(("term", "kind", "GiB", "how"))] + [line(r) for r in rows])

    def __str__(self) -> str:
        return self.table()

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def parallel_config(config: ParallelConfig | Mapping[str, Any] | str | None) -> ParallelConfig:
    return ParallelConfig.from_any(config if config is not None else {})


def estimate_memory(
    model: Any,
    config: ParallelConfig | Mapping[str, Any] | str | None = None,
    *,
    seq_len: int,
    micro_batch: int = 1,
    cluster: str | Cluster | Mapping | None = None,
    world_size: int | None = None,
    optimizer: str = "adamw",
    attention: str = "flash",
    sequence_parallel: bool | None = None,
    heap_bytes: int | None = None,
    loss: str | None = None,
    implementation: str = "smptk",
) -> MemoryEstimate:
    """Per-GPU memory of one training step of ``model`` under ``config``.

    Args:
        model: a preset name, a :class:`ModelSpec`, a Hugging Face config (object, dict, config.json).
        config: a :class:`~smptk.parallel.ParallelConfig`, its dict or a JSON path (None: defaults).
        seq_len, micro_batch: tokens per sequence and sequences per data-parallel rank per step.
        cluster: a preset name, a :class:`Cluster` or a custom dict; gives the world size (and the
            memory :meth:`MemoryEstimate.fits` checks). Or ``world_size`` alone.
        optimizer: one of :data:`OPTIMIZER_STATE_BYTES`.
        attention: ``"flash"`` or ``"materialized"``.
        sequence_parallel: the tensor-parallel layers' ``sequence_parallel`` (read when tp > 1): None
            (default) is True for a dense model and False for one with MoE layers, which smptk runs
            without it (``transform`` refuses it there: True raises); pass what the model will run with
            (``transform``'s own default is False).
        heap_bytes: the data region of smptk's symmetric heap per group, checked as
            :func:`smptk.comm.configure` checks it (a multiple of 16, at least 4096); None (default):
            what smptk.comm uses in this process (:func:`heap_bytes_in_force`).
        loss: how the logits meet the loss at tp > 1 (one of :data:`LOSSES`): ``"vocab_parallel"``,
            smptk's vocab-parallel cross-entropy on ``[T, V/tp]`` logits (the reference Transformer,
            ``examples/parallel_llama.py``); ``"gathered"``, the full ``[T, V]`` logits on every rank, as
            :func:`~smptk.parallel.transform` gives Hugging Face's ``labels=`` loss. None (default):
            ``"gathered"`` for ``implementation="hf"``, else ``"vocab_parallel"``.
        implementation: whose layers run (one of :data:`IMPLEMENTATIONS`): ``"smptk"`` (default), smptk's
            reference transformer (smptk's norms, RoPE and loss), what the activation terms describe;
            ``"hf"``, a Hugging Face model prepared with :func:`~smptk.parallel.transform`, which keeps
            more (README, Memory planning): the plan adds that excess as its own term, "activations:
            Hugging Face layers (transform)", and gathers the logits. The excess is measured on Llama, so
            ``"hf"`` takes the dense Llama-structured models only (RMSNorm, SwiGLU, RoPE, no q / k norms,
            no MoE layers, no MLA); a model built from a Hugging Face ``config.json`` is estimated with
            smptk's layers unless this says ``"hf"``.
    """
    spec = model_spec(model)
    cfg = parallel_config(config)
    cl = _cluster(cluster) if cluster is not None else None
    if world_size is None:
        if cl is None:
            raise ValueError("estimate_memory: pass cluster= or world_size=")
        world_size = cl.world_size
    elif cl is not None and cl.world_size != world_size:
        raise ValueError(f"world_size {world_size} disagrees with the cluster's {cl.world_size} GPUs")
    sizes = cfg.validate(world_size)
    for key, value in (("seq_len", seq_len), ("micro_batch", micro_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}: expected an int >= 1, got {value!r}")
    spec.check_seq_len(seq_len)
    loss = resolve_loss(spec, implementation, loss)
    check_choices(optimizer, attention, loss)
    if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel: expected True, False or None, got {sequence_parallel!r}")
    if sequence_parallel and spec.is_moe:
        raise ValueError(
            f"sequence_parallel: {spec.name} has MoE layers, which smptk runs without sequence parallelism "
            "(transform refuses it); pass sequence_parallel=False or None"
        )
    heap_bytes = heap_bytes_in_force(heap_bytes)
    t = sizes["tp"]
    sp = (not spec.is_moe if sequence_parallel is None else sequence_parallel) and t > 1
    _check_model_fits_degrees(spec, sizes, seq_len, sp)

    engine = _engine(cfg, sizes)
    terms: list[MemoryTerm] = []
    terms += _model_state_terms(spec, cfg, sizes, engine, optimizer)
    acts, host, per_block = _activation_terms(spec, cfg, sizes, seq_len, micro_batch, attention, sp, loss)
    terms += acts
    if implementation == "hf":
        terms.append(_hf_excess_term(spec, cfg, sizes, seq_len, micro_batch, attention, sp))
    terms += _transient_terms(spec, cfg, sizes, engine, seq_len, micro_batch, per_block, loss)
    terms += _heap_terms(sizes, cl, heap_bytes, engine)
    allocated = sum(x.bytes for x in terms)
    terms.append(
        MemoryTerm(
            "allocator margin", int(ALLOCATOR_MARGIN * allocated), "margin",
            f"{ALLOCATOR_MARGIN:.0%} of the allocated bytes (caching-allocator fragmentation)",
        )
    )  # fmt: skip
    return MemoryEstimate(
        spec, cfg, world_size, dict(sizes), seq_len, micro_batch, optimizer, attention, sp, engine,
        tuple(terms), host, cl, implementation,
    )  # fmt: skip


def check_choices(optimizer: str, attention: str, loss: str) -> None:
    """``ValueError`` naming the argument when ``optimizer``, ``attention`` or ``loss`` is none of the
    choices (:data:`OPTIMIZER_STATE_BYTES`, :data:`ATTENTION`, :data:`LOSSES`)."""
    for key, value, choices in (
        ("optimizer", optimizer, OPTIMIZER_STATE_BYTES),
        ("attention", attention, ATTENTION),
        ("loss", loss, LOSSES),
    ):
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{key}: expected one of {', '.join(choices)}, got {value!r}")


def resolve_loss(spec: ModelSpec, implementation: str, loss: str | None) -> str:
    """The loss a plan counts for ``implementation`` (see :func:`estimate_memory`; :func:`check_choices`
    checks it): ``ValueError`` naming the argument for an implementation outside :data:`IMPLEMENTATIONS`,
    for ``"hf"`` with a model the measured excess does not describe, and for ``"hf"`` with
    ``"vocab_parallel"`` (transform gathers the logits)."""
    if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation: expected one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}"
        )
    if implementation == "smptk":
        return "vocab_parallel" if loss is None else loss
    unlike = [
        what
        for what, differs in (
            ("MoE layers", spec.is_moe),
            ("MLA attention", spec.is_mla),
            ("q / k norms", spec.qk_norm),
            (f"a {spec.mlp} MLP", spec.mlp != "swiglu"),
            (f"{spec.norm} norms", spec.norm != "rmsnorm"),
            ("learned positions", bool(spec.learned_positions)),
        )
        if differs
    ]
    if unlike:
        raise ValueError(
            f"implementation: 'hf' adds the excess measured on Hugging Face's Llama through transform; "
            f"{spec.name} has {', '.join(unlike)}, which it does not describe (estimate with 'smptk' and "
            "measure the difference)"
        )
    if loss == "vocab_parallel":
        raise ValueError(
            "loss: 'vocab_parallel' with implementation 'hf': transform gathers the logits for Hugging "
            "Face's labels= loss; pass 'gathered' or None"
        )
    return "gathered" if loss is None else loss  # anything else goes on to check_choices


def heap_bytes_in_force(heap_bytes: int | None = None) -> int:
    """The symmetric heap's data-region bytes a plan counts: ``heap_bytes`` checked by smptk.comm's rule
    (:func:`smptk.comm.collectives.check_heap_bytes`), or for None what smptk.comm uses in this process
    (``comm.settings()["heap_bytes"]``: ``SMPTK_COMM_HEAP_BYTES``, or ``comm.configure``'s value)."""
    return int(comm.settings()["heap_bytes"]) if heap_bytes is None else check_heap_bytes(heap_bytes)


def tp_problem(spec: ModelSpec, t: int) -> str | None:
    """Why smptk's tensor-parallel layers cannot split ``spec`` ``t`` ways (None: they can)."""
    if t == 1:
        return None
    checks = [("num_heads", spec.num_heads)]
    if spec.num_layers > spec.num_moe_layers:  # some block has a dense MLP (an all-MoE model has none)
        checks.append(("intermediate_size", spec.intermediate_size))
    if not spec.is_mla:
        checks.append(("num_kv_heads", spec.num_kv_heads))
    checks.append(("vocab_size", spec.vocab_size))  # VocabParallelEmbedding and the head: no padding
    for key, value in checks:
        if value % t:
            return (
                f"{spec.name}: {key} {value} is not divisible by tensor_parallel_degree {t} (smptk's "
                "tensor-parallel layers split it evenly)"
            )
    return None


def _check_model_fits_degrees(spec: ModelSpec, sizes: dict, seq_len: int, sp: bool) -> None:
    t, ep = sizes["tp"], sizes["ep"]
    problem = tp_problem(spec, t)
    if problem:
        raise ValueError(problem)
    if ep > 1 and (not spec.is_moe or spec.num_experts % ep):
        what = f"num_experts {spec.num_experts}" if spec.is_moe else "a dense model (no experts)"
        raise ValueError(f"{spec.name}: expert_parallel_degree {ep} needs experts divisible by it; {what}")
    if sp and seq_len % t:
        raise ValueError(
            f"seq_len {seq_len} is not divisible by tensor_parallel_degree {t} (sequence parallelism "
            "splits it)"
        )


def _engine(cfg: ParallelConfig, sizes: dict) -> str:
    """The engine ``apply_data_parallel`` picks: DDP replicates fp32 parameters that are neither DTensors
    (tp 1) nor on the meta device (delayed initialization's flow builds the model there); FSDP2 the rest."""
    replicate = sizes["dp_shard"] == 1 and sizes["dp"] > 1
    if (
        replicate
        and sizes["tp"] == 1
        and cfg.mixed_precision == "fp32"
        and not cfg.delayed_parameter_initialization
    ):
        return "ddp"
    if sizes["dp_replicate"] > 1 and sizes["dp_shard"] > 1:
        return "fsdp2 hybrid_shard"
    return "fsdp2 full_shard" if sizes["dp_shard"] > 1 else "fsdp2 (unsharded)"


def local_numel(spec: ModelSpec, sizes: dict, *, unit: str | None = None, fsdp: bool = True) -> int:
    """Parameter elements rank 0 holds: tensor / expert split, then FSDP2's dim-0 shard (padded)."""
    total = 0
    for p in spec.tensors():
        if unit is not None and p.unit != unit:
            continue
        total += p.count * _rank0_numel(p.shape, p.split, p.tp_dim, sizes, fsdp)
    return total


def _rank0_numel(shape, split, tp_dim, sizes, fsdp: bool) -> int:
    shape = list(shape)
    t = sizes["tp"]
    if split in ("tp", "vocab"):
        shape[tp_dim] = -(-shape[tp_dim] // t)  # the vocabulary padded to a multiple of t
    if split == "experts":
        shape[0] //= sizes["ep"]
    if fsdp:
        shard = sizes["edp_shard"] if split == "experts" else sizes["dp_shard"]
        dim = expert_shard_dim(shape, shard) if split == "experts" else 0  # as smptk places experts
        shape[dim] = -(-shape[dim] // shard)
    return math.prod(shape)


def _model_state_terms(spec, cfg, sizes, engine, optimizer) -> list[MemoryTerm]:
    fsdp = engine != "ddp"
    n = local_numel(spec, sizes, fsdp=fsdp)
    shard = f"dp_shard {sizes['dp_shard']}" + (
        f", experts edp_shard {sizes['edp_shard']}" if spec.is_moe else ""
    )
    how = f"{n:,} elements on rank 0 (tp {sizes['tp']}, ep {sizes['ep']}, {shard}"
    how += ")" if fsdp else ", replicated)"
    state_bytes = OPTIMIZER_STATE_BYTES[optimizer]
    terms = [
        MemoryTerm("parameters (fp32 master)", 4 * n, "parameters", how),
        MemoryTerm("gradients (fp32)", 4 * n, "gradients", "one per parameter, sharded like it"),
        MemoryTerm(
            f"optimizer ({optimizer})", state_bytes * n, "optimizer", f"{state_bytes} bytes per parameter"
        ),
    ]
    if engine == "ddp":
        terms.append(
            MemoryTerm("DDP gradient buckets", 4 * n, "gradients", "a bucketed copy of the gradients")
        )
    return terms


def _block_bytes(spec: ModelSpec, layer_moe: bool, sizes, seq_len, micro_batch, attention, sp, B) -> dict:
    """Bytes one block keeps, by checkpointing mode: {"none": .., "full": .., "selective": ..}."""
    t = sizes["tp"]
    b, s = micro_batch, seq_len
    T = b * s
    Tr = T // t if sp else T
    h = spec.hidden_size
    a_t = spec.num_heads // t
    norm = lambda rows: rows * h * B + 4 * rows  # input + fp32 rstd
    none = 2 * norm(Tr)
    sel = Tr * h * B  # the checkpointed input
    # attention
    if spec.is_mla:
        dqk, dv = spec.q_head_dim, spec.v_head_dim
        ql, kvl, rope = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim
        none += T * h * B  # the normed input, shared by the two down-projections (replicated)
        if ql:
            none += T * ql * B + norm(T) - T * h * B + T * ql * B  # q_a out (norm input) + rstd + q_b input
            sel += T * ql * B + T * a_t * dqk * B
        else:
            sel += T * a_t * dqk * B
        none += T * (kvl + rope) * B + T * kvl * 4 + T * kvl * B  # kv_a out, rstd, kv_b input
        sel += T * (kvl + rope) * B + T * a_t * (dqk - rope + dv) * B
        q_el, kv_el, out_el = a_t * dqk, a_t * (dqk + dv), a_t * dv
    else:
        d = spec.head_dim
        g_t = spec.num_kv_heads // t
        none += Tr * h * B  # q / k / v's input (under SP the sequence block: they gather it again)
        if spec.qk_norm:
            none += T * (a_t + g_t) * (d * B + 4)
        sel += T * (a_t + 2 * g_t) * d * B
        q_el, kv_el, out_el = a_t * d, 2 * g_t * d, a_t * d
    if attention == "flash":
        # the kernel writes its output [b, s, heads, d]: o_proj's input is a view of it, not a copy
        core = T * (q_el + kv_el + out_el) * B + 4 * T * a_t
        sel += T * out_el * B + 4 * T * a_t
    else:
        k_el = q_el  # k, v expanded to the query heads
        v_el = out_el
        # + the bool causal mask masked_fill keeps, + o_proj's input (the [b, heads, s, d] output copied)
        core = T * (q_el + k_el + v_el) * B + b * a_t * s * s * B + s * s + T * out_el * B
        sel += b * a_t * s * s * B + T * out_el * B
    none += core
    sel += Tr * h * B  # o_proj's output (under TP one op with its reduction: only the reduced output)
    # MLP
    routing = 0
    if layer_moe:
        E, k, fm, fs = (
            spec.num_experts,
            spec.experts_per_token,
            spec.moe_intermediate_size,
            spec.shared_expert_intermediate_size,
        )
        rows = T * k
        # the layer's routing, kept by autograd and as the layer's last_routing / last_plan: fp32 weights,
        # int32 expert ids, int64 destinations, source tokens and source pairs (32 bytes a row), [E] counts
        routing = 32 * rows + 24 * E
        mlp_in = T * h * B + (4 * T * h if B != 4 else 0)  # + the router's fp32 copy of a 16-bit input
        # smptk's Triton kernels: the dispatched rows, the grouped SwiGLU's gate and up pre-activations
        # and down's input, the expert outputs (combine's input); the shared experts the same per token
        moe = 4 * T * E + routing + rows * h * B + rows * 3 * fm * B + rows * h * B
        moe += 3 * T * fs * B  # the shared experts read the same input, whole on every tp rank
        none += mlp_in + moe
        # the router's GEMM and the routing; the GEMM ops' outputs: the grouped SwiGLU's y and [g | u]
        # and the grouped down projection's output per routed row, the shared experts' the same per token
        sel += 4 * T * E + routing + rows * (3 * fm + h) * B + T * (3 * fs + (h if fs else 0)) * B
        if sizes["ep"] > 1:
            sel += 2 * rows * h * B  # the two all-to-alls' outputs (derived, not measured)
    elif spec.mlp == "swiglu":
        f_t = spec.intermediate_size // t
        none += Tr * h * B + 4 * T * f_t * B
        sel += 2 * T * f_t * B + Tr * h * B
    else:
        f_t = spec.intermediate_size // t
        none += Tr * h * B + 2 * T * f_t * B
        sel += T * f_t * B + Tr * h * B
    return {"none": none, "full": Tr * h * B + routing, "selective": sel}


def _logits_width(spec: ModelSpec, t: int, loss: str) -> tuple[int, str]:
    """Columns of the logits the loss reads on one rank, and how the plan names them."""
    if t > 1 and loss == "gathered":
        return spec.vocab_size, "[T, V] (gathered)"
    return -(-spec.vocab_size // t), "[T, V/tp]"


def _activation_terms(spec, cfg, sizes, seq_len, micro_batch, attention, sp, loss):
    B = _COMPUTE_BYTES[cfg.mixed_precision]
    t = sizes["tp"]
    T = micro_batch * seq_len
    Tr = T // t if sp else T
    mode = cfg.activation_checkpointing
    n_moe = spec.num_moe_layers
    n_dense = spec.num_layers - n_moe
    dense = _block_bytes(spec, False, sizes, seq_len, micro_batch, attention, sp, B)
    moe = _block_bytes(spec, True, sizes, seq_len, micro_batch, attention, sp, B) if n_moe else None
    kept_dense = dense[mode]
    kept_moe = moe[mode] if moe else 0
    host = 0
    terms = []
    detail = {
        "none": "everything autograd keeps",
        "full": "each block's input (full recomputation)",
        "selective": "block input + GEMM and attention outputs",
    }[mode]
    if cfg.sm_activation_offloading:
        inp = Tr * spec.hidden_size * B
        horizon = min(cfg.activation_loading_horizon, spec.num_layers)
        host = spec.num_layers * inp
        on_gpu = (
            spec.num_layers * (kept_dense - inp)
            if not n_moe
            else n_dense * (kept_dense - inp) + n_moe * (kept_moe - inp)
        )
        terms.append(
            MemoryTerm(
                "activations: blocks", on_gpu + horizon * inp, "activations",
                f"{detail}; inputs offloaded, {horizon} on the GPU (activation_loading_horizon)",
            )
        )  # fmt: skip
    else:
        if n_dense:
            terms.append(
                MemoryTerm(
                    f"activations: {n_dense} dense blocks", n_dense * kept_dense, "activations",
                    f"{detail}: {kept_dense / 2**20:.1f} MiB per block",
                )
            )  # fmt: skip
        if n_moe:
            terms.append(
                MemoryTerm(
                    f"activations: {n_moe} MoE blocks", n_moe * kept_moe, "activations",
                    f"{detail}: {kept_moe / 2**20:.1f} MiB per block",
                )
            )  # fmt: skip
    V_t, shape = _logits_width(spec, t, loss)
    h = spec.hidden_size
    # int64 ids and targets; at tp > 1 the vocab-parallel embedding's bool mask, and the vocab-parallel
    # loss's two (a gathered loss has none)
    ids = 16 * T + ((T + (2 * T if loss == "vocab_parallel" else 0)) if t > 1 else 0)
    outside = ids + Tr * h * B + 4 * Tr + Tr * h * B + 4 * T * V_t  # head input: the block under SP
    terms.append(
        MemoryTerm(
            "activations: embedding, final norm, head, loss", outside, "activations",
            f"token ids and targets, norm input, head input, fp32 softmax {shape} = "
            f"{4 * T * V_t / 2**20:.1f} MiB",
        )
    )  # fmt: skip
    per_block = max(dense["none"] if n_dense else 0, moe["none"] if moe else 0)  # the kinds it has
    return terms, host, per_block


def _hf_excess_term(spec, cfg, sizes, seq_len, micro_batch, attention, sp) -> MemoryTerm:
    """What a Hugging Face Llama prepared with transform keeps beyond smptk's reference transformer, by the
    rule measured exactly at tp 1 and 2 (module docstring; README, Memory planning)."""
    B = _COMPUTE_BYTES[cfg.mixed_precision]
    t = sizes["tp"]
    b, s, h, L, d = micro_batch, seq_len, spec.hidden_size, spec.num_layers, spec.head_dim
    T = b * s
    Tr = T // t if sp else T
    full = cfg.activation_checkpointing == "none"
    norms = (2 * L + 1 if full else 1) * 4 * Tr * h  # Hugging Face's RMSNorm: fp32 product or input copy
    excess = norms + 2 * s * d * B + 4 + (8 if b == 1 else 0)  # RoPE's cos and sin; the loss
    if not full:  # the position ids (and eager's additive mask) the checkpointed blocks are called with
        excess += 8 * s + (b * s * s * B if attention == "materialized" else 0)
    elif attention == "materialized":  # no boolean mask; in 16 bits an fp32 softmax over a / tp heads
        excess += -L * s * s + (4 * L * b * (spec.num_heads // t) * s * s if B == 2 else 0)
    which = f"{2 * L + 1} RMSNorms'" if full else "the final RMSNorm's"
    return MemoryTerm(
        "activations: Hugging Face layers (transform)", excess, "activations",
        f"{which} fp32 copies, RoPE cos / sin, call arguments, loss (measured on Llama)",
    )  # fmt: skip


def _transient_terms(spec, cfg, sizes, engine, seq_len, micro_batch, per_block, loss) -> list[MemoryTerm]:
    B = _COMPUTE_BYTES[cfg.mixed_precision]
    terms = []
    if engine != "ddp":
        gathered = {k: v for k, v in sizes.items()}
        unit = max(_layer_local_numel(spec, i, gathered) for i in _layer_kinds(spec))
        root = local_numel(spec, sizes, unit="root", fsdp=False)
        # FSDP2 computes on unsharded copies of a unit's parameters and copies the gradients into a
        # reduce-scatter input, on a 1-rank shard group as well (it copies instead of gathering)
        terms.append(
            MemoryTerm(
                "FSDP2 gathered parameters", (root + 2 * unit) * B, "transient",
                f"root unit {root:,} + 2 blocks x {unit:,} elements (current + prefetched), {B}-byte",
            )
        )  # fmt: skip
        terms.append(
            MemoryTerm(
                "FSDP2 unsharded gradients", unit * (B + 4), "transient",
                "one block's gradients before reduce-scatter, and its fp32 reduce-scatter input",
            )
        )  # fmt: skip
    T = micro_batch * seq_len
    V_t, shape = _logits_width(spec, sizes["tp"], loss)
    terms.append(
        MemoryTerm("logits and their gradient", T * V_t * (B + 4), "transient", f"{shape}, dtype + fp32")
    )
    if cfg.activation_checkpointing != "none":
        terms.append(
            MemoryTerm("recomputed block", per_block, "transient", "one block's activations in backward")
        )
    if spec.is_moe:
        rows = T * spec.experts_per_token
        terms.append(
            MemoryTerm(
                "MoE dispatch buffers", 2 * rows * spec.hidden_size * B, "transient",
                "routed rows sent and received (balanced routing)",
            )
        )  # fmt: skip
    return terms


def _layer_kinds(spec: ModelSpec) -> list[int]:
    """One layer index of each kind (dense, MoE)."""
    out = []
    dense = [i for i in range(spec.num_layers) if not spec.is_moe_layer(i)]
    moe = [i for i in range(spec.num_layers) if spec.is_moe_layer(i)]
    return out + dense[:1] + moe[:1]


def _layer_local_numel(spec: ModelSpec, i: int, sizes: dict) -> int:
    """Elements of block ``i`` after tensor / expert splitting (FSDP2 gathers over dp_shard)."""
    moe = spec.is_moe_layer(i)
    n_moe = spec.num_moe_layers
    n_dense = spec.num_layers - n_moe
    total = 0
    for p in spec.tensors():
        if p.unit != "layer":
            continue
        if p.name.startswith("moe."):
            if not moe:
                continue
            per = p.count // n_moe
        elif p.name.startswith("mlp."):
            if moe:
                continue
            per = p.count // n_dense
        else:
            per = p.count // spec.num_layers
        total += per * _rank0_numel(p.shape, p.split, p.tp_dim, sizes, fsdp=False)
    return total


def _heap_terms(sizes: dict, cl: Cluster | None, heap_bytes: int, engine: str) -> list[MemoryTerm]:
    per_node = cl.gpus_per_node if cl else None
    world = sizes["dp"] * sizes["tp"]
    groups, names = [], []
    # tp innermost: a tp group spans tp ranks; dp_shard spans dp_shard * tp; ep spans ep * tp. DDP (tp 1)
    # all-reduces its gradient buckets over the whole dp group through smptk's hook. A heap belongs to a
    # process group, and a mesh dim over every rank is torch's default group (DeviceMesh): with ep equal to
    # a dp_shard that spans the world, the two dims are one group and hold one heap.
    for dim, span in (
        ("tp", sizes["tp"]),
        ("dp_shard", sizes["dp_shard"] * sizes["tp"]),
        ("ep", sizes["ep"] * sizes["tp"]),
        *([("dp", sizes["dp"])] if engine == "ddp" else []),
    ):
        if sizes[dim] > 1 and (per_node is None or span <= per_node):
            group = "world" if sizes[dim] == world else dim
            if group in groups:
                names[groups.index(group)] += f" = {dim}"
            else:
                groups.append(group)
                names.append(dim)
    if not groups:
        return []
    seg = segment_bytes(heap_bytes)
    return [
        MemoryTerm(
            "smptk symmetric heaps", len(groups) * seg, "comm",
            f"{len(groups)} group(s) inside a node ({', '.join(names)}), "
            f"{heap_bytes / 2**20:.0f} MiB + control each",
        )
    ]  # fmt: skip
