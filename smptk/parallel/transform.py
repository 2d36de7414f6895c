"""``transform``: a stock Hugging Face causal LM made tensor-, expert- and sharded-data-parallel in place.

Supported architectures (``model.config.model_type``): ``llama``, ``mistral``, ``qwen2``, ``qwen3``,
``gemma``, ``gemma2``, ``gemma3_text``, ``granite``, ``olmo``, ``exaone4`` (dense) and ``mixtral``,
``qwen3_moe`` (sparse MoE blocks with stacked experts, the layout of transformers 5). Gemma's embedding, which
scales its rows by ``sqrt(hidden_size)`` in its own forward, becomes a plain vocab-parallel embedding with
that scale (rounded to the output's dtype, as Gemma rounds it to the weight's) applied to its output; the
norms around the attention's and the MLP's outputs (Gemma 2 / 3, EXAONE 4) are sequence-parallel like the
others.

The model is recognized by structure, as these architectures share it: ``model.model.embed_tokens``,
``model.model.layers[i].self_attn.{q,k,v,o}_proj``, ``layers[i].mlp`` either dense (``{gate,up,down}_proj``)
or a sparse block (``gate.weight [E, H]``, ``experts.gate_up_proj [E, 2F, H]``,
``experts.down_proj [E, H, F]``), and ``model.lm_head``. A base model (``LlamaModel``...) works too.

What :func:`transform` does, under the :class:`~smptk.parallel.ParallelState` of ``config`` (or the
current one), in the order a model is prepared:

1. **MoE blocks become** :class:`smptk.parallel.MoE` (softmax router, top-k renormalized as the
   architecture does, SwiGLU experts on smptk's grouped kernels) holding the block's weights: the router's
   ``[E, H]``, ``gate_up_proj`` split into ``w_gate`` / ``w_up`` and ``down_proj`` as ``w_down``. The
   block's output is the same function of its input. The load-balancing loss: with the model config's
   ``output_router_logits``, :func:`moe_aux_loss` gives Hugging Face's (``router_aux_loss_coef`` times
   the layers' pooled loss, from the router probabilities each MoE records) to add to the training loss,
   and the Hugging Face loss no longer adds its own (it reads router logits the swapped blocks do not
   record: every call gets ``output_router_logits=False``, and one asking for True raises ``ValueError``
   saying so). The model's config is not changed, so ``save_pretrained`` writes the model's own. As in
   Hugging Face's, padding tokens (the call's ``attention_mask``) do not count.
2. **Tensor parallelism** (``tensor_parallel_degree`` > 1), smptk's styles through torch's
   ``parallelize_module``: q / k / v and the dense MLP's gate / up column-parallel, o and down
   row-parallel, the embedding vocab-parallel, and ``lm_head`` column-parallel with its logits gathered
   (full ``[..., V]`` logits on every rank, so the model's own loss and generation work unchanged, the
   latter without ``sequence_parallel``, which needs every length divisible by ``tp``; for a
   loss that never materializes them, build with :func:`smptk.parallel.vocab_parallel_cross_entropy`
   directly). Attention then runs on each rank's ``heads / tp`` heads (the architectures reshape with
   ``-1`` heads); Qwen3's per-head q / k norms get their weight gradients summed over ``tp`` (their
   weights become Replicate DTensors, their input sharded on the heads dim). The MoE layers stay whole
   on every tp rank, as smptk's MoE is. With ``sequence_parallel=True`` the residual
   stream between the layers is split along the sequence: the first layer takes this rank's part of the
   embedding output (the model computed its causal mask and rotary positions from the full sequence
   first), the norms run on it with their weight gradients summed over ``tp``, the attention and the MLP
   each gather the sequence once at their input (one all-gather for q / k / v together, one for gate /
   up; what the projections save of it for backward is kept as this rank's block and gathered again in
   backward, :func:`smptk.comm.functional.saved_as_shard`, as Megatron-LM does), their row-parallel
   output layer reduce-scatters it, and the head gathers it back. A MoE layer (``MoE(...,
   sequence_parallel=True)``) gathers the sequence, runs whole on every tp rank (holding the whole
   sequence's activations) and keeps this rank's block of its output. A head tied to the embedding
   (``tie_word_embeddings``, as in Llama 3.2 1B / 3B and the small Qwen2.5 / Qwen3 models) stays one
   parameter: both styles split the ``[V, H]`` table by vocabulary rows and hold one DTensor, whose
   gradient sums the two uses, as the stock model's does; Hugging Face's ``tie_weights()`` keeps it so.
   Resize the vocabulary (``resize_token_embeddings``) before ``transform``: Hugging Face's resize takes
   an ``nn.Embedding`` and refuses the vocab-parallel one with a ``TypeError``.
3. **Expert parallelism** (``expert_parallel_degree`` > 1): :func:`~smptk.parallel.apply_expert_parallel`.
4. **Activation checkpointing** (``activation_checkpointing``, ``sm_activation_offloading``) of every
   decoder layer: :func:`~smptk.parallel.apply_activation_checkpointing`. The key-value cache is then
   off while training (every train-mode call gets ``use_cache=False``; the config is not changed), as
   under Hugging Face's own gradient checkpointing: a recomputed layer would append its keys to the
   cache a second time.
5. **Data parallelism**: :func:`~smptk.parallel.apply_data_parallel` with one FSDP2 unit per decoder layer
   (or DDP for ``hybrid_shard_degree`` 1 where it applies).

Checked up front, with the numbers in the message: the architecture, heads and KV heads divisible by the
tensor-parallel degree (a split inside a head would be silently wrong), the MLP width, router jitter
noise, non-SiLU experts, attention dropout under tensor parallelism (Hugging Face's masks come from the
global generator, the same on every tp rank). Under tensor parallelism ``output_attentions`` returns each
rank's own heads; under sequence parallelism a call with ``logits_to_keep`` or ``output_hidden_states``
raises (both would see this rank's block of the sequence only).

Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU; a tiny random model, no download)::

    >>> import torch.distributed as dist
    >>> import transformers
    >>> import smptk.parallel as sp
    >>> dist.init_process_group("gloo")
    >>> cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
    ...                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.LlamaForCausalLM(cfg)
    >>> model, report = sp.transform(model, {"tensor_parallel_degree": 2, "mixed_precision": "fp32"})
    >>> report.tensor_parallel[:2]
    ['model.embed_tokens', 'model.layers.0.self_attn.q_proj']
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from smptk.parallel.config import ParallelState, current, init
from smptk.parallel.delayed_init import HF_BLOCK, refill_rotary
from smptk.parallel.moe import MoE
from smptk.parallel.tensor_parallel import _GatherSequence

DENSE_ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite", "olmo", "exaone4"
)  # fmt: skip
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")
SUPPORTED = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
_ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_LAYER_NORMS = (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"
)  # fmt: skip


@dataclasses.dataclass
class TransformReport:
    """What :func:`transform` did on this rank.

    Attributes:
        architecture: the model's ``config.model_type``.
        sizes: the state's mesh sizes (``tp``, ``ep``, ``dp_shard``...).
        moe_layers: qualified names of the MoE blocks replaced by :class:`smptk.parallel.MoE`.
        tensor_parallel: qualified names of the modules made tensor-parallel, in model order.
        expert_parallel: the MoE layers made expert-parallel.
        checkpointed: the decoder layers whose activations are checkpointed.
        data_parallel: :func:`~smptk.parallel.apply_data_parallel`'s report.

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> import transformers
        >>> import smptk.parallel as sp
        >>> dist.init_process_group("gloo")
        >>> cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
        ...                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> model, report = sp.transform(transformers.LlamaForCausalLM(cfg), {"tensor_parallel_degree": 2})
        >>> report.architecture, report.sizes["tp"], report.moe_layers, report.expert_parallel
        ('llama', 2, [], [])
        >>> report.tensor_parallel[-1], len(report.checkpointed)
        ('lm_head', 0)
    """

    architecture: str
    sizes: dict
    moe_layers: list
    tensor_parallel: list
    expert_parallel: list
    checkpointed: list
    data_parallel: Any


def _decoder(model: nn.Module) -> tuple[str, nn.Module]:
    """``(prefix, base model)``: the module holding ``embed_tokens`` and ``layers``."""
    for prefix, base in (("model.", getattr(model, "model", None)), ("", model)):
        layers, embed = getattr(base, "layers", None), getattr(base, "embed_tokens", None)
        if isinstance(layers, nn.ModuleList) and isinstance(embed, nn.Embedding):
            return prefix, base
    raise ValueError(
        f"model: {type(model).__name__} has no embed_tokens + layers (a ModuleList) under .model or "
        "itself: not one of the supported decoder layouts"
    )


def _is_sparse_block(mlp: nn.Module) -> bool:
    experts = getattr(mlp, "experts", None)
    return isinstance(getattr(getattr(mlp, "gate", None), "weight", None), torch.Tensor) and isinstance(
        getattr(experts, "gate_up_proj", None), torch.Tensor
    )


def _is_dense_mlp(mlp: nn.Module | None) -> bool:
    return all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))


def _check(model: nn.Module, state: ParallelState) -> tuple[str, Any]:
    cfg = getattr(model, "config", None)
    arch = getattr(cfg, "model_type", None)
    if arch not in SUPPORTED:
        raise NotImplementedError(
            f"model: config.model_type {arch!r} is not supported by smptk.parallel.transform; supported: "
            f"{', '.join(SUPPORTED)}"
        )
    tp = state.sizes["tp"]
    if tp > 1:
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        for key, value in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
            if value % tp:
                raise ValueError(
                    f"{arch}: config.{key} {value} is not divisible by tensor_parallel_degree {tp} "
                    "(each rank computes whole heads)"
                )
        if getattr(cfg, "attention_dropout", 0.0):
            raise NotImplementedError(
                f"{arch}: config.attention_dropout {cfg.attention_dropout} under tensor_parallel_degree "
                f"{tp}: Hugging Face's attention draws its dropout masks from torch's global generator, "
                "the same on every tp rank, so heads on different ranks would share masks; set "
                "config.attention_dropout = 0 (every supported checkpoint's value) or use "
                "tensor_parallel_degree 1"
            )
    return arch, cfg


def _check_moe_block(block: nn.Module, cfg: Any) -> None:
    """Refuse a sparse block smptk's MoE cannot compute exactly."""
    if getattr(cfg, "router_jitter_noise", 0.0):
        raise NotImplementedError(
            f"router_jitter_noise {cfg.router_jitter_noise}: smptk's MoE has no router jitter; set it to 0"
        )
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act {act!r}: smptk's experts are SwiGLU (silu); got another")
    gate_up, down, router = block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight
    E, F2, H = gate_up.shape
    if F2 % 2 or down.shape != (E, H, F2 // 2) or router.shape != (E, H):
        raise ValueError(
            f"MoE block: expected gate_up_proj [E, 2F, H], down_proj [E, H, F] and a router [E, H], got "
            f"{tuple(gate_up.shape)}, {tuple(down.shape)} and {tuple(router.shape)}"
        )


def _check_split_sizes(model: nn.Module, plan: dict[str, Any], tp: int) -> None:
    """Every dimension the plan splits over ``tp`` ranks divides (checked here, before anything changes,
    rather than by the layers as the plan converts them one by one)."""
    from smptk.parallel.tp_styles import SmptkColwiseParallel, SmptkRowwiseParallel, SmptkVocabParallel

    split = {SmptkColwiseParallel: "out_features", SmptkRowwiseParallel: "in_features"}
    split[SmptkVocabParallel] = "num_embeddings"
    for name, style in plan.items():
        attr = split.get(type(style))
        size = getattr(model.get_submodule(name), attr) if attr else 0
        if size % tp:
            raise ValueError(
                f"{name}: {attr} {size} is not divisible by tensor_parallel_degree {tp} (each rank holds an "
                "equal slice)"
            )


def _swap_moe(block: nn.Module, cfg: Any, tp_mesh: Any = None) -> MoE:
    """An smptk MoE holding ``block``'s weights (same device and dtype; checked by _check_moe_block);
    ``tp_mesh``: sequence parallelism over it (the layer gathers the sequence and runs whole)."""
    gate_up, down, router = block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight
    E, F2, H = gate_up.shape
    F = F2 // 2
    renormalize = bool(getattr(cfg, "norm_topk_prob", True))  # Mixtral always renormalizes
    aux = getattr(cfg, "router_aux_loss_coef", 0.0) if getattr(cfg, "output_router_logits", False) else 0.0
    moe = MoE(
        H, F, E, int(cfg.num_experts_per_tok), score_func="softmax", renormalize=renormalize,
        sequence_parallel=tp_mesh is not None, tp_mesh=tp_mesh, device=gate_up.device, dtype=gate_up.dtype,
    )  # fmt: skip
    # Hugging Face's load-balancing loss pools the layers (see moe_aux_loss): each layer records its tokens'
    # router probabilities, the model's pre-hook the call's attention mask, and moe_aux_loss combines them
    # with this coefficient.
    moe.hf_aux_loss_coef = float(aux)
    moe.hf_attention_mask = None
    moe.record_router_probs = aux > 0
    with torch.no_grad():
        moe.router_weight.copy_(router)
        moe.experts.w_gate.copy_(gate_up[:, :F])
        moe.experts.w_up.copy_(gate_up[:, F:])
        moe.experts.w_down.copy_(down)
    # a frozen block stays frozen (fine-tuning with the experts or the router fixed)
    moe.router_weight.requires_grad_(router.requires_grad)
    moe.experts.w_gate.requires_grad_(gate_up.requires_grad)
    moe.experts.w_up.requires_grad_(gate_up.requires_grad)
    moe.experts.w_down.requires_grad_(down.requires_grad)
    if gate_up.is_meta:  # a meta-built model: materialize gives the MoE what _init_weights gives the block
        moe.__dict__[HF_BLOCK] = block  # outside the module tree: no parameters, no state dict entries
    return moe


def _tp_plan(prefix: str, base: nn.Module, model: nn.Module, sp: bool) -> dict[str, nn.Module]:
    from torch.distributed.tensor.parallel import SequenceParallel

    from smptk.parallel.tp_styles import SmptkColwiseParallel, SmptkRowwiseParallel, SmptkVocabParallel

    def row():
        return SmptkRowwiseParallel(sequence_parallel=sp)

    def norm(dim: int = 1):  # a replicated weight over a sharded input: its gradient summed over tp
        return SequenceParallel(sequence_dim=dim, use_local_output=True)

    plan: dict[str, Any] = {f"{prefix}embed_tokens": SmptkVocabParallel()}
    for i, layer in enumerate(base.layers):
        at = f"{prefix}layers.{i}"
        # Under sequence parallelism the attention and the MLP gather the sequence once at their input
        # (the architectures view q / k / v with their input's length), so the column-parallel layers
        # inside take the full sequence; the row-parallel ones reduce-scatter it again.
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{at}.self_attn.{name}"] = SmptkColwiseParallel()
        plan[f"{at}.self_attn.o_proj"] = row()
        # Qwen3's per-head RMSNorms see only this rank's heads: their weights become Replicate DTensors and
        # their input a Shard(2) (heads) DTensor, so autograd sums the weight gradients over tp.
        for name in ("q_norm", "k_norm"):
            if isinstance(getattr(layer.self_attn, name, None), nn.Module):
                plan[f"{at}.self_attn.{name}"] = norm(dim=2)
        extra = [
            n for n, _ in layer.self_attn.named_parameters() if n.split(".")[0] not in _ATTENTION_MODULES
        ]
        if extra:
            raise NotImplementedError(
                f"{at}.self_attn has parameters transform does not know how to split under tensor "
                f"parallelism: {extra}"
            )
        if _is_dense_mlp(layer.mlp):  # MoE layers stay whole on every tp rank
            plan[f"{at}.mlp.gate_proj"] = SmptkColwiseParallel()
            plan[f"{at}.mlp.up_proj"] = SmptkColwiseParallel()
            plan[f"{at}.mlp.down_proj"] = row()
        if sp:
            # Gemma 2 / 3 norm the attention's and the MLP's outputs too: every norm of the layer sees the
            # residual stream's block or a row-parallel layer's reduce-scattered output
            norms = [n for n in _LAYER_NORMS if isinstance(getattr(layer, n, None), nn.Module)]
            for name in norms:
                plan[f"{at}.{name}"] = norm()
            covered = ("self_attn", "mlp", *norms)
            extra = [n for n, _ in layer.named_parameters() if n.split(".")[0] not in covered]
            if extra:
                raise NotImplementedError(
                    f"sequence_parallel: {at} has parameters outside its attention, MLP and two norms, "
                    f"which transform does not know how to split: {extra}"
                )
    if sp:
        plan[f"{prefix}norm"] = norm()
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        plan["lm_head"] = SmptkColwiseParallel(sequence_parallel=sp, gather_output=True)
    return plan


def _unscaled_embedding(base: nn.Module) -> float | None:
    """Gemma's embedding (``...ScaledWordEmbedding``: an ``nn.Embedding`` whose forward multiplies the rows
    by ``embed_scale``, sqrt(hidden_size), in the weight's dtype) made a plain ``nn.Embedding`` on the same
    weight, so the vocab-parallel style converts it; returns the scale, which :func:`_scale_rows` applies
    to the converted layer's output. None (nothing changed) for any other embedding."""
    embed = base.embed_tokens
    scale = getattr(embed, "scalar_embed_scale", None)
    plain_args = (embed.max_norm, embed.scale_grad_by_freq, embed.sparse) == (None, False, False)
    buffers = [n for n, _ in embed.named_buffers(recurse=False)]
    if not type(embed).__name__.endswith("ScaledWordEmbedding") or scale is None or not plain_args:
        return None
    if buffers != ["embed_scale"] or list(embed._modules):
        return None
    buffer = embed.embed_scale
    if not buffer.is_meta and not torch.equal(torch.tensor(float(scale)).to(buffer.dtype), buffer.cpu()):
        return None  # the forward multiplies by the buffer: another value than the scale it was built with
    with torch.device("meta"):
        plain = nn.Embedding(embed.num_embeddings, embed.embedding_dim, embed.padding_idx)
    plain.weight = embed.weight  # the same Parameter: a head tied to it stays tied
    base.embed_tokens = plain
    return float(scale)


def _scale_rows(scale: float):
    """Forward hook: the output times ``scale`` rounded to the output's dtype, as Gemma's embedding
    multiplies by its fp32 ``embed_scale`` cast to the weight's dtype."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output * torch.tensor(scale, dtype=torch.float32).to(output.dtype).item()

    return hook


def _replace_hidden_states(args: tuple, kwargs: dict, fn) -> tuple[tuple, dict]:
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}


def _gather_sequence(module: nn.Module, group: Any, tp: int, rank: int) -> None:
    """Hooks on an attention or MLP module under sequence parallelism (see ``_tp_plan``): the pre-hook
    gathers the sequence of the module's input and enters :func:`smptk.comm.functional.saved_as_shard`, so
    what the projections save of the gathered input is kept as this rank's block (gathered again in
    backward); the forward hook (run on an exception too) leaves it."""
    import smptk.comm.functional as cf

    open_contexts: list[contextlib.ExitStack] = []

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = args[0] if args else kwargs["hidden_states"]
        full = _GatherSequence.apply(x, group, tp, rank, 1)
        stack = contextlib.ExitStack()
        stack.enter_context(cf.saved_as_shard(full, x, group, dim=1))
        open_contexts.append(stack)
        return _replace_hidden_states(args, kwargs, lambda _: full)

    def leave(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if open_contexts:
            open_contexts.pop().close()

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, with_kwargs=True, always_call=True)


def _router_call_hook(moe_layers: list[MoE]):
    """The pre-hook of a transformed MoE model. Every call gets ``output_router_logits=False``: the swapped
    blocks record no router logits, so Hugging Face's loss would index an empty tuple (an IndexError deep
    in ``load_balancing_loss_func``). The config is left as it is (a saved config keeps the model's own
    setting); a call asking for router logits raises, saying what to use instead. The call's attention
    mask is handed to the MoE layers, so :func:`moe_aux_loss` leaves padding out as Hugging Face's does."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("output_router_logits"):
            raise ValueError(
                "output_router_logits=True: transform replaced the sparse MoE blocks with "
                "smptk.parallel.MoE, which records no router logits; their load-balancing loss is "
                "smptk.parallel.moe_aux_loss(model) (set model.config.output_router_logits = True before "
                "transform so each MoE computes it with router_aux_loss_coef)"
            )
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        for moe in moe_layers:
            moe.hf_attention_mask = mask if isinstance(mask, torch.Tensor) else None
        return args, {**kwargs, "output_router_logits": False}

    return hook


def _split_sequence_hook(group: Any, tp: int, rank: int):
    """A forward pre-hook for the first decoder layer under sequence parallelism: it hands the layer this
    rank's ``1 / tp`` of the sequence (dim 1) of the replicated embedding output. Backward sums the
    ranks' pieces of the gradient (an all-reduce of the zero-padded pieces), so the embedding sees the
    full gradient. The model computed its causal mask and rotary positions from the full sequence before
    the layers, and every column-parallel layer gathers the sequence again.

    It runs ahead of the layer's checkpoint (``prepend=True``), so a checkpointed layer saves this rank's
    block, ``T / tp`` tokens, not the whole sequence; the recompute calls the layer with that saved block,
    which the hook then passes through (:func:`~smptk.parallel.checkpointing.recomputing`)."""
    import smptk.comm.functional as cf
    from smptk.parallel.checkpointing import recomputing

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if recomputing(module):
            return None
        x = args[0] if args else kwargs["hidden_states"]
        if x.dim() != 3 or x.shape[1] % tp:
            raise ValueError(
                f"sequence_parallel: the hidden states {tuple(x.shape)} must be [batch, seq, hidden] with "
                f"the sequence length divisible by tensor_parallel_degree {tp}, in eval mode too (so "
                "generate(), whose decode steps feed one token, cannot run on a model transformed with "
                "sequence_parallel=True: generate with one transformed without it, from the same weights)"
            )
        return _replace_hidden_states(
            args, kwargs, lambda x: cf.copy_to_group(x, group).chunk(tp, dim=1)[rank].contiguous()
        )

    return hook


def _sequence_parallel_call_hook(config: Any):
    """The pre-hook of a model transformed with sequence parallelism: refuse what would see only this
    rank's block of the sequence. Hugging Face slices ``hidden_states[:, -logits_to_keep:]`` between the
    final norm (sequence-split) and the head (which gathers): each rank would keep the last positions of
    its own block. Hidden states returned by ``output_hidden_states`` are this rank's block too."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        keep = kwargs.get("logits_to_keep", 0)
        if not (isinstance(keep, int) and keep == 0):
            raise ValueError(
                f"logits_to_keep={keep!r} under sequence_parallel: Hugging Face slices the positions before "
                "the head gathers the sequence, so each rank would keep the last ones of its own block; "
                "pass 0 and slice the logits, or transform without sequence_parallel (generate() passes "
                "logits_to_keep=1: generate with a model transformed without it, from the same weights)"
            )
        wanted = kwargs.get("output_hidden_states")
        if wanted is None:
            wanted = getattr(config, "output_hidden_states", False)
        if wanted:
            raise ValueError(
                "output_hidden_states under sequence_parallel: the layers' hidden states are split along "
                "the sequence (each rank holds 1 / tp of it); transform without sequence_parallel for them"
            )

    return hook


_TRANSFORMED = "_smptk_transformed"  # set on a model transform has converted


def transform(
    model: nn.Module,
    config: Any = None,
    *,
    state: ParallelState | None = None,
    sequence_parallel: bool = False,
    use_smptk_collectives: str | bool = "auto",
    ddp_options: Mapping[str, Any] | None = None,
) -> tuple[nn.Module, TransformReport]:
    """Make a supported Hugging Face model parallel in place (see the module docstring).

    Collective: every rank calls it with the same model (same weights: the tensor-parallel shards and the
    experts are cut from group rank 0's) after ``torch.distributed.init_process_group``.

    Args:
        model: a ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
            ``GemmaForCausalLM``, ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``, ``GraniteForCausalLM``,
            ``OlmoForCausalLM``, ``Exaone4ForCausalLM``, ``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` or
            their base models, on the state's device.
        config: a ParallelConfig, dict or JSON path: :func:`smptk.parallel.init` runs with it. None: the
            ``state`` given, or the current one.
        state: a ParallelState to use (give ``config`` or ``state``, not both).
        sequence_parallel: with tensor parallelism, split the residual stream between the decoder layers
            along the sequence (dim 1) over ``tp`` (Megatron's sequence parallelism): the norms run on
            ``1 / tp`` of the tokens and the activations between the tensor-parallel regions shrink by
            ``tp`` (a MoE layer gathers the sequence and runs whole). Needs a causal LM head and
            sequence lengths divisible by ``tp`` in every forward, eval too (so no ``generate()``: its
            decode steps feed one token); nothing changes at ``tp`` 1.
        use_smptk_collectives, ddp_options: passed to :func:`~smptk.parallel.apply_data_parallel`.

    Returns:
        ``(module, report)``: the module to train (``model`` itself, now an FSDPModule, or a DDP wrapper)
        and the :class:`TransformReport`.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from smptk.parallel.checkpointing import apply_activation_checkpointing
    from smptk.parallel.expert_parallel import apply_expert_parallel
    from smptk.parallel.fsdp import apply_data_parallel

    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a Hugging Face nn.Module, got {type(model).__name__}")
    if config is not None and state is not None:
        raise ValueError("config, state: give at most one (config builds a new state)")
    if any(getattr(m, _TRANSFORMED, False) for m in (model, getattr(model, "module", None))):
        raise ValueError(
            "model: transform has run on this model already (it converts the model in place); to run it "
            "under another config, build or load the model again"
        )
    if config is not None:
        state = init(config)
    elif state is None:
        state = current()
    arch, cfg = _check(model, state)
    prefix, base = _decoder(model)

    # Everything is checked before anything changes: a refused model is left as it was.
    sparse = []
    for i, layer in enumerate(base.layers):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and _is_sparse_block(mlp):
            _check_moe_block(mlp, cfg)
            sparse.append(i)
        elif not _is_dense_mlp(mlp):
            hf = sys.modules.get("transformers")
            raise NotImplementedError(
                f"{arch}: layer {i} has neither a dense MLP (gate/up/down_proj) nor a sparse MoE block with "
                f"stacked experts (gate_up_proj [E, 2F, H], the layout of transformers >= 5; installed: "
                f"{getattr(hf, '__version__', 'unknown')})"
            )
    tp = state.sizes["tp"]
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel: expected a bool, got {type(sequence_parallel).__name__}")
    sp = sequence_parallel and tp > 1
    if sp and not isinstance(getattr(model, "lm_head", None), nn.Linear):
        raise NotImplementedError(
            "sequence_parallel needs the causal LM head (it gathers the sequence back); "
            f"{type(model).__name__} has none"
        )
    ep = state.sizes["ep"]
    if ep > 1 and not sparse:
        raise ValueError(f"expert_parallel_degree {ep}: {arch} model has no MoE layers")
    for i in sparse:
        E = base.layers[i].mlp.gate.weight.shape[0]
        if E % ep:
            raise ValueError(
                f"{prefix}layers.{i}.mlp: num_experts {E} is not divisible by expert_parallel_degree {ep} "
                "(each rank holds an equal number of experts)"
            )
    plan = _tp_plan(prefix, base, model, sp) if tp > 1 else {}  # raises on parameters it cannot split
    _check_split_sizes(model, plan, tp)

    setattr(model, _TRANSFORMED, True)  # every check passed: from here on the model is changed in place
    moe_layers = []
    for i in sparse:
        base.layers[i].mlp = _swap_moe(base.layers[i].mlp, cfg, state.submesh("tp") if sp else None)
        moe_layers.append(f"{prefix}layers.{i}.mlp")
    if moe_layers:  # the swapped blocks record no router logits; see moe_aux_loss
        swapped = [base.layers[i].mlp for i in sparse]
        model.register_forward_pre_hook(_router_call_hook(swapped), with_kwargs=True)

    tensor_parallel: list[str] = []
    if tp > 1:
        tp_mesh = state.submesh("tp")
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        scale = _unscaled_embedding(base)
        parallelize_module(model, tp_mesh, plan)
        if scale is not None:
            base.embed_tokens.register_forward_hook(_scale_rows(scale))
        # torch's SequenceParallel (the norms' style) makes new Parameters, trainable: a norm frozen before
        # stays frozen, as the MoE weights and smptk's styles keep theirs
        for n, p in model.named_parameters():
            if n in frozen:
                p.requires_grad_(False)
        tensor_parallel = list(plan)

    expert_parallel = apply_expert_parallel(model, state) if moe_layers and state.sizes["ep"] > 1 else []

    layers = [f"{prefix}layers.{i}" for i in range(len(base.layers))]
    checkpointed = apply_activation_checkpointing(model, state, modules=layers)  # and use_cache=False
    if sp:
        model.register_forward_pre_hook(_sequence_parallel_call_hook(cfg), with_kwargs=True)
        group, rank = tp_mesh.get_group(), tp_mesh.get_local_rank()
        # ahead of the checkpoint's and the offloader's hooks: the layer saves (and offloads) its block only
        split = _split_sequence_hook(group, tp, rank)
        base.layers[0].register_forward_pre_hook(split, prepend=True, with_kwargs=True)
        for layer in base.layers:
            for module in (layer.self_attn, layer.mlp):
                if not isinstance(module, MoE):  # smptk's MoE gathers the sequence itself and runs whole
                    _gather_sequence(module, group, tp, rank)
    module, dp_report = apply_data_parallel(
        model, state, modules=layers, use_smptk_collectives=use_smptk_collectives, ddp_options=ddp_options
    )
    report = TransformReport(
        architecture=arch,
        sizes=dict(state.sizes),
        moe_layers=moe_layers,
        tensor_parallel=tensor_parallel,
        expert_parallel=expert_parallel,
        checkpointed=checkpointed,
        data_parallel=dp_report,
    )
    return module, report


def _check_mapping(tensors: object, fn: str) -> None:
    if not isinstance(tensors, Mapping):
        raise TypeError(f"{fn}: expected a {{name: tensor}} mapping, got {type(tensors).__name__}")


def _lacking(tensors: Mapping[str, Any], names: list[str], have: str) -> None:
    lacking = [n for n in names if n not in tensors]
    if lacking:
        raise ValueError(f"{have} is there but not {lacking}: a sparse block's experts need all of them")


def _tensors(*named: object) -> None:
    for name, value in zip(named[::2], named[1::2], strict=True):
        if not torch.is_tensor(value):
            raise TypeError(f"{name}: expected a tensor, got {type(value).__name__}")


def hf_layout(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of a transformed model (full tensors) in the Hugging Face model's names and
    layouts: each smptk MoE's ``router_weight`` back to ``gate.weight``, ``experts.w_gate`` and ``w_up``
    concatenated into ``experts.gate_up_proj`` ``[E, 2F, H]``, ``experts.w_down`` to ``experts.down_proj``;
    every other name is already the model's own. A new dict; the tensors are not copied. A block missing
    one of its four tensors, or ``w_gate`` and ``w_up`` of different shapes, raise ValueError; a
    non-mapping, or a non-tensor ``w_gate`` / ``w_up``, TypeError.

    Example::

        >>> import torch
        >>> from smptk.parallel import hf_layout
        >>> sd = {"mlp.experts.w_gate": torch.zeros(4, 8, 16), "mlp.experts.w_up": torch.ones(4, 8, 16),
        ...       "mlp.experts.w_down": torch.zeros(4, 16, 8), "mlp.router_weight": torch.zeros(4, 16)}
        >>> for name, t in hf_layout(sd).items():
        ...     print(name, tuple(t.shape))
        mlp.experts.gate_up_proj (4, 16, 16)
        mlp.experts.down_proj (4, 16, 8)
        mlp.gate.weight (4, 16)
    """
    _check_mapping(tensors, "hf_layout")
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith(".experts.w_gate")]:
        block = name[: -len("experts.w_gate")]
        _lacking(out, [block + k for k in ("experts.w_up", "experts.w_down", "router_weight")], name)
        gate, up = out.pop(name), out.pop(block + "experts.w_up")
        _tensors(name, gate, block + "experts.w_up", up)
        if gate.dim() != 3 or gate.shape != up.shape:
            raise ValueError(
                f"{name} {tuple(gate.shape)} and {block}experts.w_up {tuple(up.shape)}: expected two "
                "[E, F, H] tensors of one shape"
            )
        out[block + "experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[block + "experts.down_proj"] = out.pop(block + "experts.w_down")
        out[block + "gate.weight"] = out.pop(block + "router_weight")
    return out


def smptk_layout(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_layout`: a Hugging Face state dict in a transformed model's names (each
    sparse block's ``experts.gate_up_proj`` ``[E, 2F, H]`` split into ``w_gate`` / ``w_up``, ``down_proj``
    to ``w_down``, ``gate.weight`` to ``router_weight``). A new dict of views; nothing is copied. A block
    missing ``down_proj`` or ``gate.weight``, or a ``gate_up_proj`` that is not ``[E, 2F, H]``, raise
    ValueError; a non-mapping, or a non-tensor ``gate_up_proj``, TypeError.

    Example::

        >>> import torch
        >>> from smptk.parallel import smptk_layout
        >>> sd = {"mlp.experts.gate_up_proj": torch.zeros(4, 16, 16),
        ...       "mlp.experts.down_proj": torch.zeros(4, 16, 8), "mlp.gate.weight": torch.zeros(4, 16)}
        >>> for name, t in smptk_layout(sd).items():
        ...     print(name, tuple(t.shape))
        mlp.experts.w_gate (4, 8, 16)
        mlp.experts.w_up (4, 8, 16)
        mlp.experts.w_down (4, 16, 8)
        mlp.router_weight (4, 16)
    """
    _check_mapping(tensors, "smptk_layout")
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith(".experts.gate_up_proj")]:
        block = name[: -len("experts.gate_up_proj")]
        _lacking(out, [block + "experts.down_proj", block + "gate.weight"], name)
        gate_up = out.pop(name)
        _tensors(name, gate_up)
        if gate_up.dim() != 3 or gate_up.shape[1] % 2:
            raise ValueError(
                f"{name}: expected [E, 2F, H] (the gate and up projections stacked), got "
                f"{tuple(gate_up.shape)}"
            )
        F = gate_up.shape[1] // 2
        out[block + "experts.w_gate"], out[block + "experts.w_up"] = gate_up[:, :F], gate_up[:, F:]
        out[block + "experts.w_down"] = out.pop(block + "experts.down_proj")
        out[block + "router_weight"] = out.pop(block + "gate.weight")
    return out


_HEAD_KEY, _EMBED_KEY = "lm_head.weight", "model.embed_tokens.weight"


def _unwrapped(model: nn.Module) -> nn.Module:
    """``model``, or the model inside its DDP wrapper."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _tied_head(model: nn.Module) -> bool:
    """Whether ``model`` (or the model inside its DDP wrapper) holds its head's weight and its embedding
    table as one parameter (``tie_word_embeddings``; :func:`transform` keeps the tie)."""
    inner = _unwrapped(model)
    head = getattr(inner, "lm_head", None)
    embed = getattr(getattr(inner, "model", None), "embed_tokens", None)
    return head is not None and embed is not None and head.weight is embed.weight


def _ignored_on_load(model: nn.Module) -> re.Pattern | None:
    """What ``from_pretrained`` drops of a checkpoint's names that ``model`` lacks, as one regex (searched):
    the model's ``_keys_to_ignore_on_load_unexpected`` patterns (with transformers 5, its submodules' too),
    and, as transformers 5 adds them, the per-layer ``rotary_emb.inv_freq`` of old checkpoints where the
    model has such a buffer and ``position_ids`` where it has that buffer. None when there is nothing."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [n for n, _ in model.named_buffers()]
    if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else None


def _in_model_layout(model: nn.Module, hf_state: object) -> dict[str, torch.Tensor]:
    """Rank 0's Hugging Face state dict checked against ``model`` in the Hugging Face names (the names the
    caller passed) and put in the model's layout: the sparse blocks ``transform`` swapped in smptk's,
    every other name as it is (an untransformed model loads as the stock one would)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from smptk.parallel.dcp import _some

    if not isinstance(hf_state, Mapping):
        raise TypeError(
            f"hf_state: rank 0 must pass the Hugging Face state dict, got {type(hf_state).__name__}"
        )
    hf = dict(hf_state)
    if _tied_head(model) and _HEAD_KEY not in hf and _EMBED_KEY in hf:
        # save_pretrained writes a tied head's weight once, as the embedding's: the strict load names both
        hf[_HEAD_KEY] = hf[_EMBED_KEY]
    own = get_model_state_dict(model)  # global shapes (DTensors carry them): nothing is gathered
    meta = {k: torch.empty(v.shape, device="meta") if torch.is_tensor(v) else v for k, v in own.items()}
    expected = hf_layout(meta)  # non-tensor entries (a module's extra state) by name only
    shapes = {k: tuple(v.shape) for k, v in expected.items() if torch.is_tensor(v)}
    bad = [
        f"{k}: {tuple(v.shape) if torch.is_tensor(v) else type(v).__name__}, the model's {shapes[k]}"
        for k, v in hf.items()
        if k in shapes and (not torch.is_tensor(v) or tuple(v.shape) != shapes[k])
    ]
    if bad:
        raise ValueError("hf_state: tensors of the wrong shape: " + _some(bad))
    ignored = _ignored_on_load(_unwrapped(model))
    if ignored is not None:  # as from_pretrained: dropped only where the model has no such name
        hf = {k: v for k, v in hf.items() if k in expected or ignored.search(k) is None}
    missing, unexpected = sorted(set(expected) - set(hf)), sorted(set(hf) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"hf_state does not match the model's Hugging Face names: missing {_some(missing)}, unexpected "
            f"{_some(unexpected)}"
        )
    blocks = tuple(n[: -len("experts.w_gate")] for n in own if n.endswith(".experts.w_gate"))
    swapped = {k: v for k, v in hf.items() if k.startswith(blocks)} if blocks else {}
    return {**{k: v for k, v in hf.items() if k not in swapped}, **smptk_layout(swapped)}


def load_hf_state_dict(model: nn.Module, hf_state: Mapping[str, torch.Tensor] | None) -> None:
    """Load a Hugging Face state dict into a transformed model, each rank keeping its shards (collective).

    For models too large to load whole on every rank: build the Hugging Face model under
    ``torch.device("meta")``, :func:`transform` it, :func:`~smptk.parallel.materialize` it
    (``allow_uninitialized=True`` skips the check that every tensor got a value: the load gives them), then
    call this with the checkpoint's state dict on rank 0 (``safetensors.torch.load_file``...) and None
    elsewhere. Rank 0's dict is checked against the model in the Hugging Face names (every tensor there, none
    more, the global shapes; dtypes are cast to the model's); names ``from_pretrained`` ignores for the model
    (e.g. the per-layer ``rotary_emb.inv_freq`` of old Llama checkpoints) are skipped, as it skips them. Then
    the sparse blocks ``transform`` swapped are put in smptk's layout (:func:`smptk_layout`; an untransformed
    model's names stay as they are) and the tensors broadcast one at a time
    (:func:`smptk.parallel.load_full_state_dict`). Whatever rank 0 finds wrong, every rank raises; nothing is
    loaded then. ``model`` may be the DDP wrapper; without a process group (one process) the checked dict is
    loaded with ``model.load_state_dict``. The rotary tables, buffers no checkpoint holds and ``materialize``
    leaves uninitialized, are recomputed from the model's config.

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU). In real use rank 0 passes
    ``safetensors.torch.load_file("model.safetensors")``, here a stock model's state dict::

        >>> import torch
        >>> import torch.distributed as dist
        >>> import transformers
        >>> import smptk.parallel as sp
        >>> dist.init_process_group("gloo")
        >>> cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
        ...                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> _ = torch.manual_seed(0)
        >>> stock = transformers.LlamaForCausalLM(cfg)
        >>> with torch.device("meta"):
        ...     model = transformers.LlamaForCausalLM(cfg)
        >>> model, report = sp.transform(model, {"tensor_parallel_degree": 2, "mixed_precision": "fp32"})
        >>> sp.materialize(model, allow_uninitialized=True)     # the modules whose reset_parameters ran
        16
        >>> sp.load_hf_state_dict(model, stock.state_dict() if dist.get_rank() == 0 else None)
        >>> ids = torch.arange(8)[None]
        >>> torch.allclose(model(ids).logits, stock(ids).logits, atol=1e-5)
        True
    """
    import torch.distributed as dist

    from smptk.parallel.dcp import _load_full, _portable

    if not (dist.is_available() and dist.is_initialized()):  # one process, no group: a plain load
        model.load_state_dict(_in_model_layout(model, hf_state), strict=True)
        refill_rotary(model)
        return
    mapped, problem = None, None
    if dist.get_rank() == 0:
        try:  # rank 0's problem is every rank's: raised alone, it left the others in the broadcast
            mapped = _in_model_layout(model, hf_state)
        except Exception as e:
            problem = _portable(e)
    _load_full(model, mapped, None, None, True, problem)
    refill_rotary(model)


def hf_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The full state dict of a transformed model in the Hugging Face layout (:func:`hf_layout`), for
    ``save_pretrained(path, state_dict=...)`` or ``load_state_dict`` into the stock model (collective).

    Every tensor is gathered whole (:func:`smptk.parallel.get_full_state_dict`): with ``rank0_only``
    (default) on rank 0's CPU, the other ranks getting an empty dict; otherwise on every rank. A head tied
    to the embedding (``tie_word_embeddings``) gives one tensor under both names, as the stock model's
    ``state_dict`` does, so ``save_pretrained`` writes it once.

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU). After training, rank 0 would
    call ``model.save_pretrained("out", state_dict=sd)`` on the default ``rank0_only`` dict::

        >>> import torch
        >>> import torch.distributed as dist
        >>> import transformers
        >>> import smptk.parallel as sp
        >>> dist.init_process_group("gloo")
        >>> cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
        ...                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        >>> _ = torch.manual_seed(0)
        >>> stock = transformers.LlamaForCausalLM(cfg)
        >>> model, report = sp.transform(stock, {"tensor_parallel_degree": 2, "mixed_precision": "fp32"})
        >>> sd = sp.hf_state_dict(model, rank0_only=False)     # every rank: every tensor whole, on CPU
        >>> again = transformers.LlamaForCausalLM(cfg)
        >>> again.load_state_dict(sd)                          # the stock model's keys and shapes
        <All keys matched successfully>
    """
    from smptk.parallel.dcp import get_full_state_dict

    out = hf_layout(get_full_state_dict(model, rank0_only=rank0_only)["model"])
    if _tied_head(model) and _HEAD_KEY in out and _EMBED_KEY in out:
        # one tensor under both names, as the stock model's state_dict gives (gathered, they were two
        # copies, and save_pretrained, which drops a tied name only when the tensors share memory, wrote both)
        out[_HEAD_KEY] = out[_EMBED_KEY]
    return out


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """The load-balancing loss of a transformed MoE model's last forward (0-d fp32, differentiable; zero
    without MoE layers or coefficients): add it to the training loss.

    For the layers :func:`transform` made from a model whose config sets ``output_router_logits``, it is
    Hugging Face's ``router_aux_loss_coef * load_balancing_loss_func(...)``, the loss the stock model adds
    to ``out.loss``: the layers' routings pooled, ``E * sum_e f_e * P_e`` with ``f_e`` the share of the
    (token, chosen expert) pairs over all layers' tokens that went to expert e (each token counts k
    times, once per chosen expert) and ``P_e`` the router's softmax probability of e averaged over all
    layers' tokens. Tokens the call's ``attention_mask`` marks as padding (0) count in neither, as in
    Hugging Face's; a batch of padding only gives 0. So ``out.loss + moe_aux_loss(model)`` is the stock
    model's ``out.loss`` (checked in the tests, padded batches included). Other smptk MoE layers add their
    own ``aux_loss`` (``aux_loss_coef`` times the per-layer Switch loss, plus the z-loss).

    Raises ``ValueError`` when the attention mask does not have one entry per token a MoE layer routed
    (a 4-D mask, or a mask of another batch than the last forward's).

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import copy
        >>> import torch
        >>> import torch.distributed as dist
        >>> import transformers
        >>> import smptk.parallel as sp
        >>> dist.init_process_group("gloo")
        >>> cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        ...     num_experts_per_tok=2, output_router_logits=True)
        >>> _ = torch.manual_seed(0)
        >>> stock = transformers.MixtralForCausalLM(cfg)
        >>> model, report = sp.transform(copy.deepcopy(stock), {"mixed_precision": "fp32"})
        >>> ids = torch.arange(8)[None]
        >>> loss = model(ids, labels=ids).loss + sp.moe_aux_loss(model)
        >>> torch.allclose(loss, stock(ids, labels=ids).loss, atol=1e-5)   # the stock model's loss
        True
    """
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    losses = [m.aux_loss.float() for m in layers if m.aux_loss is not None]
    pooled = [m for m in layers if getattr(m, "hf_aux_loss_coef", 0.0) and m.last_router_probs is not None]
    if pooled:
        losses.append(_pooled_balance_loss(pooled))
    if not losses:
        first = next(model.parameters(), None)
        device = first.device if first is not None else None
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([loss.to(losses[0].device) for loss in losses]).sum()


def _pooled_balance_loss(layers: list[MoE]) -> torch.Tensor:
    """Hugging Face's ``load_balancing_loss_func`` times the coefficient, from each layer's last routing
    (its tokens' chosen experts and router probabilities), each token weighted by the attention mask."""
    E = layers[0].num_experts
    device = layers[0].last_router_probs.device
    counts = torch.zeros(E, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(E, dtype=torch.float32, device=device)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for m in layers:
        ids, probs = m.last_routing.expert_ids, m.last_router_probs
        T, k = ids.shape
        mask = getattr(m, "hf_attention_mask", None)
        if mask is None:
            w = torch.ones(T, dtype=torch.float32, device=device)
        elif mask.numel() != T:
            raise ValueError(
                f"moe_aux_loss: the call's attention_mask {tuple(mask.shape)} has {mask.numel()} entries, "
                f"but the MoE layers routed {T} tokens: give a [batch, seq] mask of 0 (padding) and 1, one "
                "entry per token"
            )
        else:
            w = mask.reshape(-1).to(device=device, dtype=torch.float32)
        counts = counts.scatter_add(0, ids.reshape(-1).long(), w.repeat_interleave(k))
        prob_sum = prob_sum + (probs * w[:, None]).sum(0)
        total = total + w.sum()
    total = total.clamp_min(1.0)  # padding only: counts and prob_sum are 0, and so is the loss
    return layers[0].hf_aux_loss_coef * E * (counts / total * (prob_sum / total)).sum()


__all__ = [
    "DENSE_ARCHITECTURES",
    "MOE_ARCHITECTURES",
    "SUPPORTED",
    "TransformReport",
    "hf_layout",
    "hf_state_dict",
    "load_hf_state_dict",
    "moe_aux_loss",
    "smptk_layout",
    "transform",
]
