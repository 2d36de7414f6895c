"""Ranked parallel configurations for a model on a cluster: :func:`advise` and the step-time model.

**Search.** Every combination of tensor-parallel degree (powers of two up to the GPUs of one node that
divide the heads, key-value heads, MLP width and vocabulary, and for a dense model, which it runs with
sequence parallelism, the sequence; a MoE model runs without it and takes any ``seq_len``),
``hybrid_shard_degree`` (1 = replicate, each divisor of the data-parallel size, and full sharding),
expert-parallel degree (MoE models: divisors of the sharding group and of the expert count), activation
checkpointing (none, selective, full, full with offloading) and micro-batch (1, 2, 4, 8, 16 sequences) is
estimated with :func:`~smptk.parallel.planner.estimate_memory`. Gradient accumulation fills the global
batch: ``global_batch_tokens`` when given, else one micro-batch per rank.

**Rules**, each rejection carrying its reason:

1. it must fit: ``total_bytes`` within the GPU's memory less 0.5 GiB of CUDA context;
2. the global batch (``dp x micro_batch x seq_len x accumulation``) stays at or under 4M tokens
   (4 * 2**20): beyond it, large-batch training loses sample efficiency, and more data parallelism
   cannot help; that is when tensor parallelism earns its communication;
3. tensor parallelism only when needed: if some ``tp = 1`` configuration passes 1 and 2 and the sequence
   is shorter than 8192 tokens, configurations with ``tp > 1`` are rejected unless the step-time model
   predicts them faster per token than every ``tp = 1`` one (FSDP does not shard activations, so long
   sequences are where TP's activation split pays; across many nodes FSDP's traffic can cost more than
   TP's inside a node); a tp group always sits inside one node (``tp`` divides the GPUs per node);
4. the smallest sharding degree that fits: for the same tp, ep, checkpointing and micro-batch, only the
   smallest ``dp_shard`` that fits is kept (less sharding keeps the collectives inside fewer, closer
   ranks).

The survivors are ranked by predicted step time per token (fastest first).

**Step time** (:func:`step_time`): compute is the step's hardware FLOPs (``6 N_active`` per token for
the matrix products, incl. the LM head, plus ``6 s d_attn`` per token per layer for causal attention;
recomputation adds one forward of each block under "full", the attention core under "selective") over
the GPU's peak bf16 rate times ``compute_efficiency`` (default 0.6: an assumption, not a measurement;
Llama 3 reports 38-43% MFU at scale on H100, Dubey et al. 2024, Table 4). Communication uses an
alpha-beta model per collective: ``alpha`` (per-hop latency) times the hops of a ring, plus bytes over
the link bandwidth, where the link is NVLink when the group fits in one node and the node's network
share per GPU otherwise. Data-parallel collectives (FSDP2's all-gathers in forward and backward, its
reduce-scatter, HSDP's all-reduce across replicas, DDP's all-reduce) overlap compute (FSDP2 prefetches
the next unit, DDP reduces buckets during backward): only what exceeds the compute time is exposed.
Tensor- and expert-parallel collectives (per layer: with sequence parallelism two all-gathers and two
reduce-scatters of ``[T, h]`` forward and again backward; per MoE layer two all-to-alls each way) are
counted as exposed; smptk's fused TP linears hide part of them, not modeled here. Offloading moves each
block's input over PCIe (assumed 25 GB/s per GPU), overlapped with compute. MFU is the model's FLOPs
(no recomputation) over step time, GPUs and peak.

Example::

    >>> from smptk.parallel.planner import advise
    >>> adv = advise("llama2-7b", "p4d.24xlarge", nodes=2, seq_len=4096)
    >>> best = adv.best
    >>> best.config.tensor_parallel_degree, best.fits
    (1, True)
    >>> 0 < best.mfu < 1
    True
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Mapping
from typing import Any

from smptk.parallel.config import ParallelConfig
from smptk.parallel.planner.clusters import CLUSTERS, Cluster
from smptk.parallel.planner.clusters import cluster as _cluster
from smptk.parallel.planner.estimate import (
    MemoryEstimate,
    check_choices,
    estimate_memory,
    heap_bytes_in_force,
    resolve_loss,
    tp_problem,
)
from smptk.parallel.planner.models import ModelSpec, model_spec

MAX_GLOBAL_BATCH_TOKENS = 4 * 2**20
LONG_SEQUENCE = 8192
CUDA_CONTEXT_BYTES = 2**29
MICRO_BATCHES = (1, 2, 4, 8, 16)
CHECKPOINTING = (("none", False), ("selective", False), ("full", False), ("full", True))
PCIE_BYTES_PER_S = 25e9


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, by part; ``exposed_s`` is what the step waits for."""

    compute_s: float
    dp_comm_s: float
    tp_comm_s: float
    ep_comm_s: float
    offload_s: float
    step_s: float
    model_flops: float
    mfu: float

    def describe(self) -> str:
        return (
            f"step {self.step_s:.2f} s (compute {self.compute_s:.2f}, "
            f"dp comm {self.dp_comm_s:.2f} overlapped, "
            f"tp {self.tp_comm_s:.2f} + ep {self.ep_comm_s:.2f} exposed), MFU {self.mfu:.0%}"
        )


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration: the config, micro-batch and accumulation, its memory and step time, and why it
    was kept or rejected.

    Example::

        >>> from smptk.parallel.planner import advise
        >>> adv = advise("llama2-7b", "p4d.24xlarge", nodes=1, seq_len=4096)
        >>> best = adv.best                         # adv.candidates[0], the fastest that passed every rule
        >>> best.label()
        'tp 1 shard full ac none mb 1 x1'
        >>> best.fits, best.global_batch_tokens, round(best.time.step_s, 2), round(best.mfu, 2)
        (True, 32768, 0.94, 0.6)
        >>> round(best.estimate.total_bytes / 2**30, 1)  # GiB per GPU (the MemoryEstimate behind it)
        36.8
        >>> rejected = adv.rejected[0]
        >>> rejected.label(), rejected.fits, rejected.reason
        ('tp 1 shard replicate ac none mb 1 x1', False, 'does not fit: 129.0 GiB of 39.5 GiB')
    """

    config: ParallelConfig
    micro_batch: int
    grad_accum: int
    global_batch_tokens: int
    estimate: MemoryEstimate
    time: StepTime | None
    fits: bool
    reason: str

    @property
    def mfu(self) -> float:
        return self.time.mfu if self.time else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.global_batch_tokens / self.time.step_s if self.time else 0.0

    def label(self) -> str:
        c = self.config
        ac = c.activation_checkpointing + ("+offload" if c.sm_activation_offloading else "")
        hsd = {0: "full", 1: "replicate"}.get(c.hybrid_shard_degree, f"hsdp {c.hybrid_shard_degree}")
        ep = f" ep {c.expert_parallel_degree}" if c.expert_parallel_degree > 1 else ""
        sp = " sp" if self.estimate.sequence_parallel else ""  # transform(..., sequence_parallel=True)
        return (
            f"tp {c.tensor_parallel_degree}{sp} shard {hsd}{ep} ac {ac} mb {self.micro_batch} "
            f"x{self.grad_accum}"
        )

    def to_dict(self) -> dict:
        return {
            "config": {k: v for k, v in dataclasses.asdict(self.config).items() if v is not None},
            # not a ParallelConfig key: transform's argument, which the estimate assumed
            "sequence_parallel": self.estimate.sequence_parallel,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "global_batch_tokens": self.global_batch_tokens,
            "memory_bytes": self.estimate.total_bytes,
            "fits": self.fits,
            "step_s": self.time.step_s if self.time else None,
            "mfu": self.mfu if self.time else None,
            "tokens_per_s": self.tokens_per_s if self.time else None,
            "reason": self.reason,
        }


@dataclasses.dataclass(frozen=True)
class Advice:
    """:attr:`candidates` ranked (fastest first), :attr:`rejected` with reasons, and when nothing fits,
    :attr:`suggestions` of what would.

    Example (Llama 2 70B does not fit on one node of 40 GB A100s)::

        >>> from smptk.parallel.planner import advise
        >>> adv = advise("llama2-70b", "p4d.24xlarge", nodes=1, seq_len=4096)
        >>> adv.best, len(adv.candidates), len(adv.rejected)
        (None, 0, 200)
        >>> for suggestion in adv.suggestions:
        ...     print(suggestion)
        the smallest configuration (every tp, sharding degree and ep tried; full checkpointing +
        offloading, micro-batch 1) needs 136.5 GiB per GPU; 39.5 GiB are available
        4 nodes (32 GPUs) would fit: 35.3 GiB per GPU
        a larger GPU: 1 x gb200-nvl72 = 72 GPUs (B200 (GB200)) would fit: 16.7 GiB per GPU
        >>> advise("llama2-70b", "p4d.24xlarge", nodes=4, seq_len=4096).best.label()  # taking the advice
        'tp 8 sp shard full ac full+offload mb 8 x1'
    """

    model: ModelSpec
    cluster: Cluster
    seq_len: int
    candidates: tuple[Candidate, ...]
    rejected: tuple[Candidate, ...]
    suggestions: tuple[str, ...]

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    def summary(self, top: int = 5) -> str:
        head = f"{self.model.describe()}\n{self.cluster.describe()}, seq_len {self.seq_len}"
        if not self.candidates:
            fits = any(c.fits for c in self.rejected)
            what = "no configuration is within bounds" if fits else "nothing fits"
            return head + f"\n{what}:\n" + "\n".join(f"- {s}" for s in self.suggestions)
        lines = [head]
        for i, c in enumerate(self.candidates[:top], 1):
            lines.append(
                f"{i}. {c.label()}: {c.estimate.total_bytes / 2**30:.1f} GiB, {c.time.describe()}; {c.reason}"
            )
        return "\n".join(lines)

    def to_dict(self, top: int = 10) -> dict:
        return {
            "model": self.model.name,
            "cluster": self.cluster.name,
            "nodes": self.cluster.nodes,
            "seq_len": self.seq_len,
            "candidates": [c.to_dict() for c in self.candidates[:top]],
            "rejected_count": len(self.rejected),
            "rejected_examples": [c.to_dict() for c in self.rejected[:top]],
            "suggestions": list(self.suggestions),
        }


def _ring(n: int, nbytes: float, bw: float, alpha: float) -> float:
    """Seconds of a ring all-gather / reduce-scatter of ``nbytes`` (the full array) over n ranks."""
    if n <= 1:
        return 0.0
    return (n - 1) * alpha + nbytes * (n - 1) / n / bw


def _link(span: int, cl: Cluster) -> tuple[float, float]:
    """(bytes/s, alpha seconds) for a group spanning ``span`` consecutive ranks."""
    if span <= cl.gpus_per_node:
        return cl.intra_node_gbps * 1e9, cl.intra_latency_us * 1e-6
    return cl.inter_node_bytes_per_gpu, cl.inter_latency_us * 1e-6


def _moe_active_params(spec: ModelSpec) -> float:
    """Parameters of the MoE blocks one token uses (the router, ``experts_per_token`` routed experts, the
    shared experts), summed over the MoE layers; 0 for a dense model."""
    return sum(
        t.numel * (spec.experts_per_token / spec.num_experts if t.split == "experts" else 1)
        for t in spec.tensors()
        if t.name.startswith("moe.")
    )


def model_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token without recomputation: ``6 N_active`` (minus the embedding lookup, plus a
    tied head's product) and causal attention ``6 s d_attn`` per layer (``d_attn``: heads x q/k width,
    halved for causality, plus heads x v width, halved)."""
    n = spec.num_parameters(active=True) - spec.vocab_size * spec.hidden_size * (
        0 if spec.tie_word_embeddings else 1
    )
    attn = 3 * spec.num_layers * seq_len * spec.num_heads * (spec.q_head_dim + spec.v_dim)
    return 6 * n + attn


def step_time(
    model: Any,
    config: ParallelConfig | Mapping | None,
    cluster: str | Cluster | Mapping,
    *,
    seq_len: int,
    micro_batch: int = 1,
    grad_accum: int = 1,
    compute_efficiency: float = 0.6,
) -> StepTime:
    """Predicted time of one step (``grad_accum`` micro-batches of ``micro_batch`` sequences per
    data-parallel rank); see the module docstring for the model and its assumptions.

    Example::

        >>> from smptk.parallel.planner import step_time
        >>> t = step_time("llama2-7b", {"hybrid_shard_degree": 0}, "p4d.24xlarge", seq_len=4096)
        >>> t.describe()   # FSDP2's collectives hide under compute: MFU = compute_efficiency (0.6)
        'step 0.94 s (compute 0.94, dp comm 0.16 overlapped, tp 0.00 + ep 0.00 exposed), MFU 60%'
        >>> t = step_time("llama2-7b", {"tensor_parallel_degree": 2}, "p4d.24xlarge", seq_len=4096,
        ...               micro_batch=2)
        >>> round(t.tp_comm_s, 3), round(t.step_s, 2), round(t.mfu, 2)   # TP's collectives are exposed
        (0.03, 0.97, 0.58)
    """
    spec, cl = model_spec(model), _cluster(cluster)
    cfg = ParallelConfig.from_any(config if config is not None else {})
    sz = cfg.validate(cl.world_size)
    if not 0 < compute_efficiency <= 1:
        raise ValueError(f"compute_efficiency: expected a fraction in (0, 1], got {compute_efficiency}")
    for key, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("grad_accum", grad_accum)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}: expected an int >= 1, got {value!r}")
    t, dp, shard, rep, ep = sz["tp"], sz["dp"], sz["dp_shard"], sz["dp_replicate"], sz["ep"]
    tokens_rank = micro_batch * seq_len * grad_accum  # per data-parallel rank per step
    mflops_tok = model_flops_per_token(spec, seq_len)
    L = spec.num_layers
    attn_core = 3 * L * seq_len * spec.num_heads * (spec.q_head_dim + spec.v_dim) / 3  # one forward
    block_fwd = (mflops_tok - 6 * spec.vocab_size * spec.hidden_size) / 3  # blocks' forward per token
    recompute = {"none": 0.0, "selective": attn_core, "full": block_fwd}[cfg.activation_checkpointing]
    # smptk keeps MoE blocks (router, routed and shared experts) whole on every tp rank: their FLOPs are not
    # split over tp (the recompute's share of them likewise)
    whole = 6 * _moe_active_params(spec) if t > 1 else 0.0
    rec_whole = whole / 3 if cfg.activation_checkpointing == "full" else 0.0
    hw_flops_gpu = tokens_rank * ((mflops_tok - whole + recompute - rec_whole) / t + whole + rec_whole)
    peak = cl.gpu.bf16_tflops * 1e12
    compute = hw_flops_gpu / (peak * compute_efficiency)

    B = 2 if cfg.mixed_precision != "fp32" else 4
    from smptk.parallel.planner.estimate import local_numel

    local_unsharded = local_numel(spec, sz, fsdp=False)  # this tp / ep rank's parameters
    bw, alpha = _link(shard * t, cl)
    dp_comm = 0.0
    if shard > 1:  # FSDP2: all-gather forward and backward, reduce-scatter (fp32) per micro-batch
        per_mb = 2 * _ring(shard, local_unsharded * B, bw, alpha) + _ring(
            shard, local_unsharded * 4, bw, alpha
        )
        dp_comm += grad_accum * per_mb
    if rep > 1:  # all-reduce across replicas (HSDP: the shards; DDP: everything), fp32, once per step
        rbw, ralpha = _link(
            dp * t, cl
        )  # a replica group strides over the shard groups: it spans dp * t ranks
        nbytes = local_unsharded * 4 / shard
        dp_comm += 2 * _ring(rep, nbytes, rbw, ralpha)
    tp_comm = 0.0
    if t > 1:
        tbw, talpha = _link(t, cl)
        act = micro_batch * seq_len * spec.hidden_size * B
        tp_comm = grad_accum * L * 8 * _ring(t, act, tbw, talpha)
    ep_comm = 0.0
    if ep > 1:
        ebw, ealpha = _link(ep * t, cl)
        rows = micro_batch * seq_len * spec.experts_per_token * spec.hidden_size * B
        ep_comm = grad_accum * spec.num_moe_layers * 4 * ((ep - 1) * ealpha + rows * (ep - 1) / ep / ebw)
    offload = 0.0
    if cfg.sm_activation_offloading:
        per_rank = micro_batch * seq_len * spec.hidden_size * B / (t if t > 1 else 1)
        offload = grad_accum * L * 2 * per_rank / PCIE_BYTES_PER_S
    exposed_dp = max(0.0, dp_comm - compute)
    exposed_off = max(0.0, offload - compute)
    step = compute + tp_comm + ep_comm + exposed_dp + exposed_off
    model_flops = tokens_rank * dp * mflops_tok
    mfu = model_flops / (step * cl.world_size * peak)
    return StepTime(compute, dp_comm, tp_comm, ep_comm, offload, step, model_flops, mfu)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_options(spec: ModelSpec, cl: Cluster) -> list[int]:
    out, t = [], 1
    # a tp group must sit inside one node: t divides the node's GPUs (tp 4 on 6-GPU nodes spans two nodes)
    while t <= cl.gpus_per_node and cl.gpus_per_node % t == 0 and cl.world_size % t == 0:
        if tp_problem(spec, t) is None:
            out.append(t)
        t *= 2
    return out


def advise(
    model: Any,
    cluster: str | Cluster | Mapping,
    *,
    seq_len: int,
    global_batch_tokens: int | None = None,
    nodes: int | None = None,
    optimizer: str = "adamw",
    attention: str = "flash",
    mixed_precision: str = "bf16",
    compute_efficiency: float = 0.6,
    suggest: bool = True,
    loss: str | None = None,
    heap_bytes: int | None = None,
    implementation: str = "smptk",
) -> Advice:
    """Ranked configurations for ``model`` on ``cluster`` at ``seq_len`` (see the module docstring).

    ``global_batch_tokens``: the batch the run wants (accumulation fills it; it must be reachable
    within the 4M-token limit); None: one micro-batch per data-parallel rank per step. ``nodes``
    overrides the cluster's node count. When nothing fits, :attr:`Advice.suggestions` says what would.
    ``loss``, ``implementation``: as :func:`~smptk.parallel.planner.estimate_memory`'s (``"hf"`` for a
    Hugging Face model prepared with :func:`~smptk.parallel.transform`: its measured excess over smptk's
    layers, and the logits whole on every tp rank).
    ``heap_bytes``: smptk's symmetric heap per group, as estimate_memory's (None: smptk.comm's setting).
    """
    spec = model_spec(model)
    cl = _cluster(cluster, nodes)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len: expected an int >= 1, got {seq_len!r}")
    spec.check_seq_len(seq_len)
    loss = resolve_loss(spec, implementation, loss)  # up front: the search skips what estimate refuses
    check_choices(optimizer, attention, loss)  # up front too: the search skips what estimate refuses
    heap_bytes = heap_bytes_in_force(heap_bytes)  # checked up front: the search skips what estimate refuses
    if global_batch_tokens is not None and (
        isinstance(global_batch_tokens, bool)
        or not isinstance(global_batch_tokens, int)
        or not seq_len <= global_batch_tokens <= MAX_GLOBAL_BATCH_TOKENS
    ):
        raise ValueError(
            f"global_batch_tokens: expected an int from seq_len ({seq_len}) to the 4M-token limit "
            f"({MAX_GLOBAL_BATCH_TOKENS:,}, rule 2), got {global_batch_tokens!r}"
        )
    memory = cl.gpu.memory_bytes - CUDA_CONTEXT_BYTES
    kept, rejected = [], []
    for t in _tp_options(spec, cl):
        dp = cl.world_size // t
        for hsd in _divisors(dp):
            hsd_key = 0 if hsd == dp and dp > 1 else hsd
            eps = (
                [e for e in _divisors(hsd) if spec.is_moe and spec.num_experts % e == 0]
                if spec.is_moe
                else [1]
            )
            for ep, (ac, off), mb in itertools.product(eps, CHECKPOINTING, MICRO_BATCHES):
                cfg = ParallelConfig(
                    tensor_parallel_degree=t, hybrid_shard_degree=hsd_key, expert_parallel_degree=ep,
                    activation_checkpointing=ac, sm_activation_offloading=off,
                    mixed_precision=mixed_precision,
                )  # fmt: skip
                try:
                    est = estimate_memory(spec, cfg, seq_len=seq_len, micro_batch=mb, cluster=cl,
                                          optimizer=optimizer, attention=attention, loss=loss,
                                          heap_bytes=heap_bytes, implementation=implementation)  # fmt: skip
                except ValueError:  # a degree the model's sizes (or sequence parallelism's seq_len) do
                    continue  # not divide: not a candidate (a MoE model runs tp without SP: any seq_len)
                per_step = dp * mb * seq_len
                accum = 1 if global_batch_tokens is None else max(1, round(global_batch_tokens / per_step))
                gbt = per_step * accum
                fits = est.total_bytes <= memory
                if not fits:
                    reason = f"does not fit: {est.total_bytes / 2**30:.1f} GiB of {memory / 2**30:.1f} GiB"
                    rejected.append(Candidate(cfg, mb, accum, gbt, est, None, False, reason))
                    continue
                if gbt > MAX_GLOBAL_BATCH_TOKENS:
                    reason = (
                        f"global batch {gbt:,} tokens exceeds 4M ({dp} dp ranks x {mb} x {seq_len} x {accum})"
                    )
                    rejected.append(Candidate(cfg, mb, accum, gbt, est, None, True, reason))
                    continue
                if (
                    global_batch_tokens is not None
                    and abs(gbt - global_batch_tokens) > 0.25 * global_batch_tokens
                ):
                    reason = f"global batch {gbt:,} tokens misses the asked {global_batch_tokens:,} by > 25%"
                    rejected.append(Candidate(cfg, mb, accum, gbt, est, None, True, reason))
                    continue
                tm = step_time(spec, cfg, cl, seq_len=seq_len, micro_batch=mb, grad_accum=accum,
                               compute_efficiency=compute_efficiency)  # fmt: skip
                kept.append(Candidate(cfg, mb, accum, gbt, est, tm, True, ""))
    # Rule 3: tensor parallelism only when needed (or predicted faster than every tp 1 configuration).
    tp1 = [c.time.step_s / c.global_batch_tokens for c in kept if c.config.tensor_parallel_degree == 1]
    if seq_len < LONG_SEQUENCE and tp1:
        best_tp1 = min(tp1)
        survivors = []
        for c in kept:
            if c.config.tensor_parallel_degree > 1 and c.time.step_s / c.global_batch_tokens >= best_tp1:
                why = "TP not needed: a tp 1 configuration fits the batch limit and is predicted as fast"
                rejected.append(dataclasses.replace(c, reason=why))
            else:
                survivors.append(c)
        kept = survivors
    # Rule 4: the smallest sharding degree that fits, per (tp, ep, checkpointing, micro-batch).
    smallest: dict[tuple, int] = {}
    for c in kept:
        key = _shape_key(c)
        smallest[key] = min(smallest.get(key, 1 << 30), c.estimate.sizes["dp_shard"])
    survivors = []
    for c in kept:
        k = smallest[_shape_key(c)]
        if c.estimate.sizes["dp_shard"] > k:
            rejected.append(dataclasses.replace(c, reason=f"a smaller sharding degree fits (dp_shard {k})"))
        else:
            survivors.append(c)
    # Fastest per token first; on a tie (recompute hidden under communication), less recompute and no
    # offload before less memory: checkpointing that buys no fit and no speed is not recommended first.
    survivors.sort(
        key=lambda c: (
            c.time.step_s / c.global_batch_tokens,
            _RECOMPUTE[c.config.activation_checkpointing],
            c.config.sm_activation_offloading,
            c.estimate.total_bytes,
        )
    )
    plain = {_fit_key(c) for c in survivors if c.config.activation_checkpointing == "none"}
    tp1_fits = any(c.fits and c.config.tensor_parallel_degree == 1 for c in (*kept, *rejected))
    tp1_kept = any(c.config.tensor_parallel_degree == 1 for c in survivors)
    ranked = []
    for i, c in enumerate(survivors):
        why = _why(c, i == 0, seq_len, needed=_fit_key(c) not in plain, tp1_fits=tp1_fits, tp1_kept=tp1_kept)
        ranked.append(dataclasses.replace(c, reason=why))
    suggestions = (
        _suggestions(
            spec,
            cl,
            seq_len,
            optimizer,
            attention,
            mixed_precision,
            rejected,
            loss,
            heap_bytes,
            implementation,
        )
        if (suggest and not ranked)
        else ()
    )
    return Advice(spec, cl, seq_len, tuple(ranked), tuple(rejected), tuple(suggestions))


def _shape_key(c: Candidate) -> tuple:
    cfg = c.config
    return (cfg.tensor_parallel_degree, cfg.expert_parallel_degree, cfg.activation_checkpointing,
            cfg.sm_activation_offloading, c.micro_batch)  # fmt: skip


_RECOMPUTE = {"none": 0, "selective": 1, "full": 2}


def _fit_key(c: Candidate) -> tuple:
    """A candidate's shape but its checkpointing: where one fits without, checkpointing is optional."""
    cfg = c.config
    return (
        cfg.tensor_parallel_degree,
        cfg.expert_parallel_degree,
        c.estimate.sizes["dp_shard"],
        c.micro_batch,
    )


def _why(
    c: Candidate,
    first: bool,
    seq_len: int,
    needed: bool = True,
    tp1_fits: bool = False,
    tp1_kept: bool = False,
) -> str:
    """``tp1_fits``: some tp 1 configuration fits in memory (but was rejected for its global batch);
    ``tp1_kept``: some tp 1 configuration passed every rule (a tp > 1 one beside it is predicted faster)."""
    sz = c.estimate.sizes
    parts = ["fastest predicted" if first else "fits"]
    parts.append(f"smallest sharding that fits at this shape (dp_shard {sz['dp_shard']})")
    if sz["tp"] > 1:
        if seq_len >= LONG_SEQUENCE:
            parts.append(f"tp {sz['tp']}: long sequence ({seq_len})")
        elif tp1_kept:
            parts.append(f"tp {sz['tp']}: predicted faster per token than every tp 1 configuration")
        elif tp1_fits:
            parts.append(f"tp {sz['tp']}: fewer data-parallel ranks keep the global batch within bounds")
        else:
            parts.append(f"tp {sz['tp']}: needed to fit")
    ac = c.config.activation_checkpointing
    if ac != "none":
        what = f"{ac} checkpointing" + (" + offload" if c.config.sm_activation_offloading else "")
        parts.append(f"{what} to fit" if needed else f"{what}: optional (the same shape fits without it)")
    parts.append(f"global batch {c.global_batch_tokens:,} tokens")
    return "; ".join(parts)


def _min_total(
    spec, cl, seq_len, optimizer, attention, mixed_precision, loss, heap_bytes, implementation
) -> int | None:
    """The smallest estimate over the search's degrees (tp, sharding degree, ep; full checkpointing +
    offloading, micro-batch 1). Not only full sharding: where stacked experts cannot shard evenly over
    every data-parallel rank, a smaller sharding degree can hold less (``expert_shard_dim``)."""
    best = None
    for t in _tp_options(spec, cl):
        dp = cl.world_size // t
        for hsd in _divisors(dp):
            eps = [e for e in _divisors(hsd) if spec.num_experts % e == 0] if spec.is_moe else [1]
            for ep in eps:
                cfg = ParallelConfig(
                    tensor_parallel_degree=t, hybrid_shard_degree=0 if hsd == dp and dp > 1 else hsd,
                    expert_parallel_degree=ep, activation_checkpointing="full", sm_activation_offloading=True,
                    mixed_precision=mixed_precision,
                )  # fmt: skip
                try:
                    est = estimate_memory(spec, cfg, seq_len=seq_len, micro_batch=1, cluster=cl,
                                          optimizer=optimizer, attention=attention, loss=loss,
                                          heap_bytes=heap_bytes, implementation=implementation)  # fmt: skip
                except ValueError:
                    continue
                best = est.total_bytes if best is None else min(best, est.total_bytes)
    return best


def _suggestions(
    spec, cl, seq_len, optimizer, attention, mixed_precision, rejected, loss, heap_bytes, implementation
) -> list[str]:
    fitting = [c for c in rejected if c.fits]
    if fitting:  # memory is not what stops them: the global batch is (more memory would not help)
        over = [c for c in fitting if c.global_batch_tokens > MAX_GLOBAL_BATCH_TOKENS]
        out = []
        if over:
            least = min(over, key=lambda c: c.global_batch_tokens)
            nodes = max(1, cl.nodes * MAX_GLOBAL_BATCH_TOKENS // least.global_batch_tokens)
            out.append(
                f"{len(fitting)} configurations fit in memory, but each exceeds the 4M-token global batch "
                f"(the smallest: {least.global_batch_tokens:,} tokens, {least.estimate.sizes['dp']} "
                f"data-parallel ranks x micro-batch {least.micro_batch} x {seq_len}): use a shorter "
                f"sequence, at most {nodes} nodes, or more tensor parallelism than {cl.gpus_per_node} GPUs "
                "per node allow"
            )
        if len(over) < len(fitting):
            out.append(
                f"{len(fitting) - len(over)} configurations fit in memory but miss the asked global batch by "
                "more than 25%: ask for a global batch that a multiple of dp x micro-batch x seq_len reaches"
            )
        return out
    out = []
    memory = cl.gpu.memory_bytes - CUDA_CONTEXT_BYTES
    least = _min_total(
        spec, cl, seq_len, optimizer, attention, mixed_precision, loss, heap_bytes, implementation
    )

    @functools.cache
    def least_on(nodes: int) -> int | None:
        return _min_total(
            spec,
            cl.with_nodes(nodes),
            seq_len,
            optimizer,
            attention,
            mixed_precision,
            loss,
            heap_bytes,
            implementation,
        )

    def _fits_on(nodes: int) -> bool:
        m = least_on(nodes)
        return m is not None and m <= memory

    if least is not None:
        out.append(
            f"the smallest configuration (every tp, sharding degree and ep tried; full checkpointing + "
            f"offloading, micro-batch 1) needs {least / 2**30:.1f} GiB per GPU; {memory / 2**30:.1f} GiB are "
            "available"
        )
    # The nearest node counts that fit, fewer and more: with stacked experts, more nodes can need more
    # memory per GPU (an expert dimension that no longer divides over the data-parallel ranks)
    near = [n for n in range(max(1, cl.nodes - 8), cl.nodes + 9) if n != cl.nodes]
    far = [cl.nodes * m for m in (16, 32, 64)]
    fewer = next((n for n in reversed(near) if n < cl.nodes and _fits_on(n)), None) if cl.nodes > 1 else None
    more = next((n for n in (*[n for n in near if n > cl.nodes], *far) if _fits_on(n)), None)
    for n in (fewer, more):
        if n is not None:
            gpus = cl.with_nodes(n).world_size
            out.append(f"{n} nodes ({gpus} GPUs) would fit: {least_on(n) / 2**30:.1f} GiB per GPU")
    for name, other in CLUSTERS.items():
        if other.gpu.memory_bytes <= cl.gpu.memory_bytes:
            continue
        o = other.with_nodes(max(1, cl.world_size // other.gpus_per_node))
        m = _min_total(
            spec, o, seq_len, optimizer, attention, mixed_precision, loss, heap_bytes, implementation
        )
        if m is not None and m <= other.gpu.memory_bytes - CUDA_CONTEXT_BYTES:
            out.append(
                f"a larger GPU: {o.nodes} x {name} = {o.world_size} GPUs ({other.gpu.name}) would fit: "
                f"{m / 2**30:.1f} GiB per GPU"
            )
    return out
