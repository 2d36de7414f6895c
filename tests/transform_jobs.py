"""The multi-rank side of ``tests/test_transform.py``: ``smptk.parallel.transform`` on Hugging Face models.

One 2-rank gloo job runs every case of ``CASES`` and one 4-rank job those of ``CASES_4``
(``TRITON_INTERPRET=0`` and ``SMPTK_KERNELS=torch``: the PyTorch kernel path and torch.distributed's
collectives; the kernels and smptk's collectives are tested on their own). Every model is a tiny random
one built from a config (no download), fp32, with every rank drawing the same weights, so each rank can
run the unsharded Hugging Face model as its reference. Each training case takes two SGD (momentum) steps
and compares the loss of each step and every parameter after them (``hf_state_dict``: MoE weights back
in the Hugging Face layout) with the reference within 1e-5 relative:

- ``tp2_llama`` (tensor_parallel_degree 2, full activation checkpointing): both ranks feed the same batch
  (data is replicated over ``tp``); logits equal the reference's, loss from the model's own ``labels``.
- ``tp2_qwen2``: q / k / v biases split with their weights; logits and loss equal.
- ``tp2_qwen3``: Qwen3's per-head q / k norms, whose weight gradients must be summed over ``tp``.
- ``tp2_sp_llama``, ``tp2_sp_qwen3``: the same with ``sequence_parallel=True`` (sequence length 10): the
  residual stream split along the sequence, the norms' weight gradients summed over ``tp``;
  ``tp2_sp_selective_llama`` under selective checkpointing (the kept GEMM and reduce-scatter outputs,
  the all-gathers run again); ``tp2_sp_offload_llama`` under full checkpointing with activation
  offloading (the first layer's split runs ahead of both, so they keep and offload its sequence block).
- ``tp2_mixtral``: MoE blocks swapped for smptk's MoE, whole on both tp ranks, attention split;
  ``tp2_sp_mixtral`` with sequence parallelism (the MoE layers gather the sequence and run whole) and
  Hugging Face's load-balancing loss.
- ``dp2_llama`` (full shard over 2 ranks): each rank its own batch; the reference steps on the mean loss.
- ``ep2_mixtral`` (expert_parallel_degree 2): each rank its own batch; experts split over ``ep``.
- ``meta_tp2_llama``, ``meta_ep2_mixtral``, ``meta_dp2_tied_llama`` (tied embeddings, whose saved
  state dict has no ``lm_head.weight``): the big-model flow: built under ``torch.device("meta")``,
  transformed, materialized, then ``load_hf_state_dict`` with rank 0's Hugging Face state dict (the
  rotary tables recomputed): every parameter, the logits and the loss equal the Hugging Face model's.
- ``meta_fresh_tp2_tied_llama`` (tied, padded embedding, MLP biases), ``meta_fresh_dp2_qwen2``,
  ``meta_fresh_ep2_mixtral`` and (4 ranks) ``meta_fresh_tp2_ep2_qwen3_moe``: training from scratch: built
  on meta, transformed, materialized with no checkpoint; every parameter and buffer equals the eager
  unsharded build's from the same seed (Hugging Face's ``_init_weights`` replayed, on the MoE through the
  block it replaces).
- ``dcp_ep2_to_tp2_mixtral``, ``dcp_tp2_to_ep2_mixtral``: a transformed model and its AdamW state after a
  step, saved with ``save_checkpoint`` under one config and loaded with ``load_checkpoint`` into the model
  (other weights) transformed under the other: model and optimizer states equal the saved ones exactly.
- ``tp2_tied_gemma``, ``tp2_sp_tied_gemma2``, ``tp2_sp_gemma3``, ``meta_tp2_gemma2``,
  ``meta_fresh_tp2_tied_gemma3``: Gemma 1 / 2 / 3, whose embedding scales its rows by sqrt(hidden) (the
  scale applied around the vocab-parallel layer) and whose layers 2 / 3 norm the attention's and the MLP's
  outputs too (every norm sequence-parallel): training, the meta-device load and training from scratch;
  (4 ranks) ``tp2_dp2_sp_tied_gemma3``: TP 2 x FSDP 2 with sequence parallelism and full checkpointing.
- ``tp2_sp_tied_granite``, ``tp2_sp_olmo``, ``tp2_sp_exaone4``, ``meta_fresh_tp2_exaone4``: Granite (its four
  multipliers), OLMo (weightless LayerNorms), EXAONE 4 (norms after the attention and the MLP, per-head
  q / k norms) under tp 2 with sequence parallelism; EXAONE 4 trained from scratch.
- ``bad_hf_state``: a wrong Hugging Face state dict on rank 0 (missing tensors, an odd stacked width,
  None) raises on every rank in the names given, loading nothing; an untransformed model loads as it is.
- ``frozen_norms``: norms frozen before ``transform`` (tp 2, sequence parallelism) stay frozen.
- (4 ranks) ``tp2_dp2_sp_llama``: TP 2 x FSDP 2 with sequence parallelism and full checkpointing;
  ``tp2_ep2_mixtral``: TP 2 x EP 2 (ep carved from the data-parallel ranks), the MoE whole on both ranks
  of each tp group. The two ranks of a tp group feed one batch.
- (4 ranks) ``ep2_dp4_mixtral``: EP 2 with the experts FSDP-sharded over edp_shard 2;
  ``hsdp2x2_ep2_mixtral``: HSDP (dp_replicate 2 x dp_shard 2), experts over ep 2 and replicated over
  dp_replicate. Each rank feeds its own batch.
- Every training case checks ``clip_grad_norm_``'s 1-, 3- and inf-norms against torch's on the plain
  model, then clips at ``CLIP_NORM`` (2-norm) and compares the total and the step.
- ``tp2_tied_qwen3``, ``tp2_sp_tied_llama``, ``meta_tp2_tied_qwen3`` and (4 ranks)
  ``tp2_dp2_sp_tied_qwen3``: tied embeddings (``tie_word_embeddings``): the head's weight stays the
  embedding's parameter after transform, Hugging Face's ``tie_weights()``, FSDP2, ``materialize``,
  ``load_hf_state_dict`` and training; its gradient equals the stock model's, and ``hf_state_dict``
  gives one tensor under both names (as the stock ``state_dict``: ``save_pretrained`` writes it once).
- ``bad_input``: heads not divisible by tp, attention dropout under tp, ``resize_token_embeddings``
  after transform at tp 2 (Hugging Face's TypeError naming the vocab-parallel embedding), an attention
  parameter with no tensor-parallel split, sequence parallelism without a head, on an odd
  sequence, with logits_to_keep or output_hidden_states, or not a bool, an unsupported architecture,
  expert parallelism on a dense model, config and state together; sizes that do not split (an MLP width or
  a vocabulary over tp, experts over ep) refused with the model and its config left as they were.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os

import torch
import torch.distributed as dist
from comm_checks import expect_raises
from helpers import compare_rel

REL = 1e-5
VOCAB, SEQ = 96, 9
_close = functools.partial(compare_rel, rel=REL)
_COMMON = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
}  # fmt: skip


def build(kind: str, **overrides):
    """A tiny random Hugging Face causal LM of architecture ``kind`` (seeded: every rank the same)."""
    import transformers

    torch.manual_seed(0)
    opts = {**_COMMON, **overrides}
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**opts))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**opts))
    elif kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**opts))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**opts))
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(**{"num_local_experts": 4, "num_experts_per_tok": 2, **opts})
        model = transformers.MixtralForCausalLM(cfg)
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **opts, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif kind in ("gemma", "gemma2", "gemma3_text"):  # head_dim 8, not the configs' 256
        cfg = transformers.AutoConfig.for_model(kind, **{"head_dim": 8, **opts})
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    elif kind in ("granite", "olmo", "exaone4"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(kind, **opts))
    else:
        raise ValueError(kind)
    with torch.no_grad():  # HF initializes biases and routers to zero / tiny values: make them matter
        for name, p in model.named_parameters():
            if "bias" in name or "gate.weight" in name or "experts" in name or "_norm" in name:
                p.normal_(0, 0.3)
    return model.float()


def hf_named(model, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (``hf_state_dict``), or every parameter's gradient, as full tensors in the Hugging
    Face model's names and layouts."""
    from torch.distributed.tensor import DTensor

    import smptk.parallel as sp
    from smptk.parallel.transform import hf_layout

    if not grads:
        return {k: v.detach() for k, v in sp.hf_state_dict(model, rank0_only=False).items()}
    full = {}
    for name, p in model.named_parameters():
        full[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach()
    return hf_layout(full)


def hf_named_grads(model) -> dict[str, torch.Tensor]:
    return hf_named(model, grads=True)


CLIP_NORM = 0.5  # below every case's gradient norm, so clipping changes each step


def _batch(rank: int, step: int, seq: int = SEQ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (2, seq), generator=gen)


def _nothing():
    return contextlib.nullcontext()


def _train(
    problems: list[str],
    kind: str,
    config: dict,
    *,
    same_batch: bool = False,
    batches: int | None = None,
    sp_: bool = False,
    **overrides,
) -> None:
    """Two SGD steps of the transformed model against the Hugging Face model in this process. Data:
    ``same_batch`` one batch for every rank; else ``batches`` (default: one per rank) distinct batches,
    rank r feeding batch ``r * batches // world`` (the ranks of a tp group share one); the reference
    steps on their mean loss. ``sp_``: sequence parallelism, on an even sequence length."""
    import smptk.parallel as sp

    rank, world = dist.get_rank(), dist.get_world_size()
    if same_batch:
        batches = 1
    batches = batches or world
    mine = rank * batches // world
    seq = SEQ + 1 if sp_ else SEQ
    model = build(kind, **overrides)
    ref = copy.deepcopy(model)
    module, report = sp.transform(model, {"mixed_precision": "fp32", **config}, sequence_parallel=sp_)
    tied = bool(overrides.get("tie_word_embeddings"))
    if tied:
        _check_tied(problems, model, "after transform")
        model.tie_weights()  # as Hugging Face calls it (from_pretrained, resize): keeps one parameter
        _check_tied(problems, model, "after tie_weights")
    seen: list[int] = []  # the tokens a norm inside the layers sees: seq / tp under sequence parallelism
    model.model.layers[0].post_attention_layernorm.register_forward_hook(  # its input: a DTensor under SP
        lambda m, args, out: seen.append(getattr(args[0], "_local_tensor", args[0]).shape[1])
    )
    if not report.checkpointed and config.get("activation_checkpointing", "none") != "none":
        problems.append("no decoder layer checkpointed")
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    saved: list[tuple] = []  # the shapes (a DTensor's local shard's) autograd saves in the first forward

    def record(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(getattr(t, "_local_tensor", t).shape))
        return t

    for step in range(2):
        ids = _batch(mine, step, seq)
        with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t) if step == 0 else _nothing():
            out = module(ids, labels=ids)
        loss = out.loss + sp.moe_aux_loss(module)
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        ref_loss = 0.0
        for b in range(batches):
            rid = _batch(b, step, seq)
            ref_out = ref(rid, labels=rid)
            ref_loss = ref_loss + ref_out.loss / batches
            if step == 0 and b == mine:
                _close(problems, f"logits step {step}", out.logits, ref_out.logits)
        ref_loss.backward()
        if tied:  # one gradient: the embedding's and the head's summed
            grad = model.model.embed_tokens.weight.grad
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            _close(problems, f"tied weight gradient step {step}", grad, ref.model.embed_tokens.weight.grad)
        # Clipping over every mesh the parameters live on (tp, dp, ep; torch's own refuses the mix): the
        # same total norm and, at a max_norm below it, the same clipped step as torch's on the plain model.
        ref_grads = [q.grad for q in ref.parameters() if q.grad is not None]
        for order in (1.0, 3.0, math.inf):  # the other norms, nothing clipped (max_norm inf); a generator
            got = sp.clip_grad_norm_(iter(module.parameters()), math.inf, order)
            _close(
                problems, f"{order}-norm step {step}", got, torch.nn.utils.get_total_norm(ref_grads, order)
            )
        norm = sp.clip_grad_norm_(module.parameters(), CLIP_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP_NORM)
        _close(problems, f"gradient norm step {step}", norm, ref_norm)
        if ref_norm <= CLIP_NORM:
            problems.append(f"step {step}: gradient norm {ref_norm:.3g} <= {CLIP_NORM}: nothing was clipped")
        opt.step()
        opt.zero_grad()
        opt_ref.step()
        opt_ref.zero_grad()
        _close(problems, f"loss step {step}", mean, ref_loss)
    tp = config.get("tensor_parallel_degree", 1)
    if seen[0] != (seq // tp if sp_ else seq):
        problems.append(f"layer 0's norm saw {seen[0]} of {seq} tokens (tp {tp}, sequence_parallel {sp_})")
    # Under sequence parallelism without checkpointing what the projections and the head save of their
    # gathered input is this rank's block (saved_as_shard): no tensor of batch x seq hidden states (in
    # any view: a linear saves its input as [batch * seq, hidden]) is kept, only blocks of seq / tp.
    h = model.config.hidden_size
    kept = [math.prod(s) // (2 * h) for s in saved if s and s[-1] == h]  # sequence positions held
    no_ac = config.get("activation_checkpointing", "none") == "none"
    moe = any(isinstance(m, sp.MoE) for m in module.modules())  # whole on every rank: the whole sequence
    if sp_ and no_ac and not moe and (seq in kept or seq // tp not in kept):
        problems.append(f"saved hidden states of {kept} positions (seq {seq}, tp {tp})")
    got, want = hf_named(module), dict(ref.named_parameters(remove_duplicate=False))
    if set(got) != set(want):
        problems.append(f"parameter names differ: {sorted(set(got) ^ set(want))}")
        return
    if tied:
        _check_tied(problems, model, "after 2 steps")
        head, embed = got["lm_head.weight"], got["model.embed_tokens.weight"]
        if head.data_ptr() != embed.data_ptr():  # one tensor, as the stock state_dict's: saved once
            problems.append("hf_state_dict: lm_head.weight is not the embedding's tensor")
    for name, p in want.items():
        _close(problems, f"{name} after 2 steps", got[name], p)


def _check_tied(problems: list[str], model, when: str) -> None:
    """The tied head's weight is still the embedding's parameter (one tensor, one gradient)."""
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        problems.append(f"{when}: lm_head.weight is no longer model.embed_tokens.weight")


def _meta_load(problems: list[str], kind: str, config: dict, **overrides) -> None:
    """Build on meta, transform, materialize, load rank 0's Hugging Face state dict: the model then
    computes what the Hugging Face model computes (logits and loss), after one step too. With tied
    embeddings the state dict is a saved one's: no ``lm_head.weight`` (save_pretrained writes it once)."""
    import smptk.parallel as sp

    ref = build(kind, **overrides)
    with torch.device("meta"):
        meta = build(kind, **overrides)
    state = sp.init({"mixed_precision": "fp32", **config})
    module, _ = sp.transform(meta, state=state)
    sp.materialize(module, state, allow_uninitialized=True)  # a checkpoint load follows
    saved = ref.state_dict()
    tied = overrides.get("tie_word_embeddings")
    if tied:
        _check_tied(problems, meta, "after materialize")
        del saved["lm_head.weight"]
    sp.load_hf_state_dict(module, saved if dist.get_rank() == 0 else None)
    if tied:
        _check_tied(problems, meta, "after load_hf_state_dict")
    ids = _batch(0, 0)
    out, want = module(ids, labels=ids), ref(ids, labels=ids)
    _close(problems, "logits after load", out.logits, want.logits)
    _close(problems, "loss after load", out.loss, want.loss)
    got = hf_named(module)
    for name, p in ref.state_dict().items():
        _close(problems, f"{name} after load", got[name], p)


def _flat(tree: object, prefix: str = "") -> dict[str, object]:
    """A nested state dict as ``{"a.b.c": leaf}``."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}


def _dcp_reshard(problems: list[str], kind: str, saved_under: dict, loaded_under: dict) -> None:
    """A transformed model and its AdamW state after one step, saved with ``save_checkpoint`` under one
    config and loaded with ``load_checkpoint`` into the same model built (other weights) and transformed
    under another: the full model and optimizer states equal the saved ones exactly, and the step."""
    import shutil
    import tempfile

    import smptk.parallel as sp

    where = [tempfile.mkdtemp(prefix="smptk-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    path = os.path.join(where[0], "ckpt")
    module, _ = sp.transform(build(kind), {"mixed_precision": "fp32", **saved_under})
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    ids = _batch(dist.get_rank(), 0)
    module(ids, labels=ids).loss.backward()
    opt.step()
    want = _flat(sp.get_full_state_dict(module, opt, rank0_only=False))
    sp.save_checkpoint(path, module, opt, step=7)
    other = build(kind)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    module, _ = sp.transform(other, {"mixed_precision": "fp32", **loaded_under})
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    step = sp.load_checkpoint(path, module, opt)
    got = _flat(sp.get_full_state_dict(module, opt, rank0_only=False))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(where[0])
    if step != 7:
        problems.append(f"step {step}, saved 7")
    if got.keys() != want.keys():
        problems.append(f"keys differ: {sorted(got.keys() ^ want.keys())[:4]}")
    differ = [k for k, v in want.items() if torch.is_tensor(v) and k in got and not torch.equal(v, got[k])]
    if differ:
        problems.append(f"{saved_under} -> {loaded_under}: {differ[:4]} differ")


def _meta_fresh(problems: list[str], kind: str, config: dict, **overrides) -> None:
    """Training from scratch: built on meta, transformed, materialized with no checkpoint to load. Every
    parameter and buffer, gathered whole, equals the eager unsharded build from the same seed (the
    swapped-in layers take what Hugging Face's _init_weights gives the layers they replace), the tie holds."""
    import transformers

    import smptk.parallel as sp

    cfg = transformers.AutoConfig.for_model(kind, **{**_COMMON, **overrides})
    state = sp.init({"mixed_precision": "fp32", "random_seed": 5, **config})
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    module, _ = sp.transform(meta, state=state)
    sp.materialize(module, state)
    torch.manual_seed(5)
    want = transformers.AutoModelForCausalLM.from_config(cfg)
    # gathered whole in the Hugging Face names (the MoE blocks' too), and the buffers no state dict holds
    got = {**dict(meta.named_buffers(remove_duplicate=False)), **sp.hf_state_dict(module, rank0_only=False)}
    for name, t in (
        *want.named_parameters(remove_duplicate=False),
        *want.named_buffers(remove_duplicate=False),
    ):
        if name.endswith("embed_tokens.embed_scale") and name not in got:
            continue  # Gemma's scale: transform applies it around the vocab-parallel embedding
        whole = got[name].full_tensor() if hasattr(got[name], "full_tensor") else got[name]
        if not torch.equal(whole, t):
            problems.append(f"{name}: differs from the eager build's by {(whole - t).abs().max().item():.3g}")
    if cfg.tie_word_embeddings:
        _check_tied(problems, meta, "after materialize")


def _odd_sequence(model) -> None:
    model(torch.zeros(1, SEQ, dtype=torch.int64))  # SEQ is odd


def _resize(model) -> None:
    model.resize_token_embeddings(VOCAB + 2)


def _sp_call(**kwargs):
    import smptk.parallel as sp

    model = sp.transform(
        build("llama"), {"mixed_precision": "fp32", "tensor_parallel_degree": 2}, sequence_parallel=True
    )
    return model[0](torch.zeros(1, SEQ + 1, dtype=torch.int64), **kwargs)  # an even length


def _with_sinks(model):
    """An attention parameter transform has no split for (as gpt-oss's attention sinks would be)."""
    model.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    return model


def _bad_input(problems: list[str]) -> None:
    import transformers

    import smptk.parallel as sp

    fp32 = {"mixed_precision": "fp32"}
    tp2 = {**fp32, "tensor_parallel_degree": 2}
    cases = [
        (lambda: sp.transform(build("llama", num_attention_heads=2, num_key_value_heads=1), tp2),
         ValueError, "num_key_value_heads 1 is not divisible by tensor_parallel_degree 2"),
        # the vocabulary is resized before transform: Hugging Face's resize takes an nn.Embedding only
        (lambda: _resize(sp.transform(build("llama", tie_word_embeddings=True), tp2)[0]),
         TypeError, "VocabParallelEmbedding"),
        (lambda: sp.transform(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16,
                                                                                   n_head=2)), fp32),
         NotImplementedError, "'gpt2' is not supported"),
        (lambda: sp.transform(_with_sinks(build("llama")), tp2),
         NotImplementedError, "does not know how to split under tensor parallelism: ['sinks']"),
        (lambda: sp.transform(build("llama").model, tp2, sequence_parallel=True),
         NotImplementedError, "sequence_parallel needs the causal LM head"),
        (lambda: _odd_sequence(sp.transform(build("llama"), tp2, sequence_parallel=True)[0]),
         ValueError, "divisible by tensor_parallel_degree 2"),
        (lambda: sp.transform(build("llama"), tp2, sequence_parallel="yes"), TypeError, "sequence_parallel"),
        # Hugging Face slices logits_to_keep positions of this rank's sequence block; hidden states are split
        (lambda: _sp_call(logits_to_keep=1), ValueError, "logits_to_keep=1 under sequence_parallel"),
        (lambda: _sp_call(output_hidden_states=True), ValueError, "output_hidden_states under sequence_para"),
        (lambda: sp.transform(build("llama", attention_dropout=0.1), tp2),
         NotImplementedError, "config.attention_dropout 0.1 under tensor_parallel_degree 2"),
        (lambda: sp.transform(build("llama"), {**fp32, "expert_parallel_degree": 2}),
         ValueError, "has no MoE layers"),
        (lambda: sp.transform(build("llama"), fp32, state=sp.current()), ValueError, "at most one"),
        (lambda: sp.transform("model", fp32), TypeError, "nn.Module"),
    ]  # fmt: skip
    for i, (call, kind, text) in enumerate(cases):
        problem = expect_raises(call, kind, text)
        if problem is not None:
            problems.append(f"bad input {i}: {problem}")

    # Sizes that do not split: refused before anything changes (the model was half converted).
    ep2 = {**fp32, "expert_parallel_degree": 2}
    refusals = [
        ("llama", {"intermediate_size": 47}, tp2, "layers.0.mlp.gate_proj: out_features 47 is not divisible"),
        ("llama", {"vocab_size": 95}, tp2, "model.embed_tokens: num_embeddings 95 is not divisible"),
        ("mixtral", {"num_local_experts": 3, "output_router_logits": True}, ep2,
         "model.layers.0.mlp: num_experts 3 is not divisible by expert_parallel_degree 2"),
    ]  # fmt: skip
    for kind, overrides, config, text in refusals:
        model = build(kind, **overrides)
        before = ({n: type(m) for n, m in model.named_modules()}, model.config.to_dict())
        problem = expect_raises(lambda: sp.transform(model, config), ValueError, text)  # noqa: B023
        if (
            problem is None
            and ({n: type(m) for n, m in model.named_modules()}, model.config.to_dict()) != before
        ):
            problem = "the refused model changed (its modules or its config)"
        if problem is not None:
            problems.append(f"refusal {kind} {overrides}: {problem}")


def _bad_hf_state(problems: list[str]) -> None:
    """A Hugging Face state dict rank 0 alone holds, wrong: every rank raises, in the names the caller
    passed, and nothing loads (rank 0 raised alone, a KeyError from the layout change, and the other rank
    waited in the broadcast; a wrong shape was named in smptk's names). An untransformed model loads the
    stock layout as it is (it was put in smptk's, and refused)."""
    import smptk.parallel as sp

    rank0 = dist.get_rank() == 0
    stock = build("mixtral")
    good = stock.state_dict()
    block = "model.layers.0.mlp."
    gate_up = good[block + "experts.gate_up_proj"]
    cases = [
        ({k: v for k, v in good.items() if k != block + "experts.down_proj"}, ValueError,
         f"missing ['{block}experts.down_proj']"),
        (None, TypeError, "rank 0 must pass the Hugging Face state dict"),
        ({**good, block + "experts.gate_up_proj": torch.cat([gate_up, gate_up[:, :1]], dim=1)}, ValueError,
         f"{block}experts.gate_up_proj: {(gate_up.shape[0], gate_up.shape[1] + 1, gate_up.shape[2])}, "
         f"the model's {tuple(gate_up.shape)}"),
        ({k: v for k, v in good.items() if k != block + "gate.weight"}, ValueError,
         f"missing ['{block}gate.weight']"),
    ]  # fmt: skip
    state = sp.init({"mixed_precision": "fp32", "expert_parallel_degree": 2})
    module, _ = sp.transform(build("mixtral"), state=state)
    before = copy.deepcopy(hf_named(module))
    for i, (given, kind, text) in enumerate(cases):
        problem = expect_raises(lambda: sp.load_hf_state_dict(module, given if rank0 else None), kind, text)  # noqa: B023
        if problem is not None:
            problems.append(f"bad state {i}: {problem}")
    for name, p in hf_named(module).items():
        if not torch.equal(p, before[name]):
            problems.append(f"{name} changed by a refused load")
    untransformed = copy.deepcopy(stock)
    with torch.no_grad():
        for p in untransformed.parameters():
            p.zero_()
    sp.load_hf_state_dict(untransformed, good if rank0 else None)
    for name, p in untransformed.state_dict().items():
        _close(problems, f"untransformed {name}", p, good[name])

    # A module's extra state (a non-tensor entry) loads by name (rank 0 raised alone on its missing shape).
    class Tagged(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tag = "new"

        def get_extra_state(self):
            return {"tag": self.tag}

        def set_extra_state(self, state) -> None:
            self.tag = state["tag"]

    tagged = build("llama")
    tagged.model.tagged = Tagged()
    tagged.model.tagged.tag = "saved"
    saved = tagged.state_dict()
    tagged.model.tagged.tag = "new"
    sp.load_hf_state_dict(tagged, saved if rank0 else None)
    if tagged.model.tagged.tag != "saved":
        problems.append(f"extra state: {tagged.model.tagged.tag!r}")

    # Tied embeddings behind the DDP wrapper: a saved dict without lm_head.weight loads (the wrapper hid
    # the tie: "missing ['lm_head.weight']").
    tied = build("llama", tie_word_embeddings=True)
    saved = {k: v for k, v in tied.state_dict().items() if k != "lm_head.weight"}
    ddp, _ = sp.transform(
        build("llama", tie_word_embeddings=True), {"mixed_precision": "fp32", "hybrid_shard_degree": 1}
    )
    with torch.no_grad():
        for p in ddp.parameters():
            p.zero_()
    sp.load_hf_state_dict(ddp, saved if rank0 else None)
    for name, p in ddp.module.state_dict().items():
        _close(problems, f"tied under DDP {name}", p, tied.state_dict()[name])


def _frozen_norms(problems: list[str]) -> None:
    """Norms frozen before transform stay frozen under tp 2 with sequence parallelism (torch's
    SequenceParallel style made them new, trainable Parameters: they trained, silently), Qwen3's per-head
    q / k norms included; an SGD step leaves them as they were and trains the rest."""
    import smptk.parallel as sp

    model = build("qwen3")
    for name, p in model.named_parameters():
        if "norm" in name:
            p.requires_grad_(False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    module, _ = sp.transform(
        model, {"mixed_precision": "fp32", "tensor_parallel_degree": 2}, sequence_parallel=True
    )
    got = {n: p.requires_grad for n, p in module.named_parameters()}
    if got != flags:
        problems.append(f"requires_grad changed: {sorted(n for n in flags if got.get(n) != flags[n])}")
    before = copy.deepcopy(hf_named(module))
    opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.5)
    ids = _batch(0, 0, seq=SEQ + 1)
    module(ids, labels=ids).loss.backward()
    opt.step()
    after = hf_named(module)
    moved = sorted(n for n in after if not torch.equal(after[n], before[n]))
    if sorted(n for n in moved if "norm" in n) or not moved:
        problems.append(f"parameters changed by the step: {moved}")


MOE_KINDS = ("mixtral", "qwen3_moe")
MOE_CASES = ("tp2_mixtral", "tp2_sp_mixtral", "ep2_mixtral", "meta_ep2_mixtral", "meta_fresh_ep2_mixtral")
MOE_CASES += ("dcp_ep2_to_tp2_mixtral", "dcp_tp2_to_ep2_mixtral", "bad_hf_state")
AUX_LOSS = {"output_router_logits": True, "router_aux_loss_coef": 0.05}
CASES = {
    "tp2_llama": lambda p: _train(
        p, "llama", {"tensor_parallel_degree": 2, "activation_checkpointing": "full"}, same_batch=True
    ),
    "tp2_qwen2": lambda p: _train(p, "qwen2", {"tensor_parallel_degree": 2}, same_batch=True),
    "tp2_qwen3": lambda p: _train(p, "qwen3", {"tensor_parallel_degree": 2}, same_batch=True),
    "tp2_sp_llama": lambda p: _train(
        p,
        "llama",
        {"tensor_parallel_degree": 2, "activation_checkpointing": "full"},
        same_batch=True,
        sp_=True,
    ),
    "tp2_sp_qwen3": lambda p: _train(p, "qwen3", {"tensor_parallel_degree": 2}, same_batch=True, sp_=True),
    "tp2_sp_selective_llama": lambda p: _train(
        p,
        "llama",
        {"tensor_parallel_degree": 2, "activation_checkpointing": "selective"},
        same_batch=True,
        sp_=True,
    ),
    "tp2_sp_offload_llama": lambda p: _train(
        p,
        "llama",
        {"tensor_parallel_degree": 2, "activation_checkpointing": "full", "sm_activation_offloading": True},
        same_batch=True,
        sp_=True,
    ),
    "meta_tp2_llama": lambda p: _meta_load(p, "llama", {"tensor_parallel_degree": 2}),
    "meta_ep2_mixtral": lambda p: _meta_load(p, "mixtral", {"expert_parallel_degree": 2}),
    "meta_dp2_tied_llama": lambda p: _meta_load(p, "llama", {}, tie_word_embeddings=True),
    "meta_tp2_tied_qwen3": lambda p: _meta_load(
        p, "qwen3", {"tensor_parallel_degree": 2}, tie_word_embeddings=True
    ),
    "meta_fresh_tp2_tied_llama": lambda p: _meta_fresh(
        p, "llama", {"tensor_parallel_degree": 2}, tie_word_embeddings=True, pad_token_id=3, mlp_bias=True
    ),
    "meta_fresh_dp2_qwen2": lambda p: _meta_fresh(p, "qwen2", {"hybrid_shard_degree": 0}),
    # the swapped-in MoE takes the values _init_weights gives the Hugging Face block it replaces
    "meta_fresh_ep2_mixtral": lambda p: _meta_fresh(
        p, "mixtral", {"expert_parallel_degree": 2}, num_local_experts=4, num_experts_per_tok=2
    ),
    # tied embeddings: the vocab-parallel embedding and the column-parallel head hold one DTensor
    "tp2_tied_qwen3": lambda p: _train(
        p, "qwen3", {"tensor_parallel_degree": 2}, same_batch=True, tie_word_embeddings=True
    ),
    "tp2_sp_tied_llama": lambda p: _train(
        p, "llama", {"tensor_parallel_degree": 2}, same_batch=True, sp_=True, tie_word_embeddings=True
    ),
    "tp2_mixtral": lambda p: _train(p, "mixtral", {"tensor_parallel_degree": 2}, same_batch=True),
    # the MoE layers gather the sequence and run whole (sequence parallelism with MoE used to be refused:
    # each tp rank's router and experts would have trained on its own block's gradient alone)
    "tp2_sp_mixtral": lambda p: _train(
        p, "mixtral", {"tensor_parallel_degree": 2}, same_batch=True, sp_=True, **AUX_LOSS
    ),
    "dp2_llama": lambda p: _train(p, "llama", {"hybrid_shard_degree": 0}, same_batch=False),
    # with Hugging Face's load-balancing loss: moe_aux_loss on each rank's tokens, as the stock model's
    "ep2_mixtral": lambda p: _train(
        p, "mixtral", {"expert_parallel_degree": 2}, same_batch=False, **AUX_LOSS
    ),
    # checkpoints of a transformed model reshard: the experts from ep 2 to whole under tp 2, and back
    "dcp_ep2_to_tp2_mixtral": lambda p: _dcp_reshard(
        p, "mixtral", {"expert_parallel_degree": 2}, {"tensor_parallel_degree": 2}
    ),
    "dcp_tp2_to_ep2_mixtral": lambda p: _dcp_reshard(
        p, "mixtral", {"tensor_parallel_degree": 2}, {"expert_parallel_degree": 2}
    ),
    # Gemma: the scaled embedding (its scale applied around the vocab-parallel layer), the norms around the
    # attention's and the MLP's outputs (Gemma 2 / 3) under sequence parallelism, per-head q / k norms (3)
    "tp2_tied_gemma": lambda p: _train(
        p, "gemma", {"tensor_parallel_degree": 2}, same_batch=True, tie_word_embeddings=True
    ),
    "tp2_sp_tied_gemma2": lambda p: _train(
        p, "gemma2", {"tensor_parallel_degree": 2}, same_batch=True, sp_=True, tie_word_embeddings=True
    ),
    "tp2_sp_gemma3": lambda p: _train(  # a 3-token sliding window: its local layers' masks over the gather
        p, "gemma3_text", {"tensor_parallel_degree": 2}, same_batch=True, sp_=True, sliding_window=3
    ),
    "meta_tp2_gemma2": lambda p: _meta_load(p, "gemma2", {"tensor_parallel_degree": 2}),
    "meta_fresh_tp2_tied_gemma3": lambda p: _meta_fresh(
        p, "gemma3_text", {"tensor_parallel_degree": 2}, tie_word_embeddings=True, head_dim=8, pad_token_id=3
    ),
    # Granite's multipliers (embedding, residual, attention, logits), OLMo's weightless LayerNorms, EXAONE 4's
    # norms after the attention and the MLP and per-head q / k norms, all under sequence parallelism
    "tp2_sp_tied_granite": lambda p: _train(
        p,
        "granite",
        {"tensor_parallel_degree": 2},
        same_batch=True,
        sp_=True,
        tie_word_embeddings=True,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        logits_scaling=0.5,
        attention_multiplier=0.3,
    ),
    "tp2_sp_olmo": lambda p: _train(p, "olmo", {"tensor_parallel_degree": 2}, same_batch=True, sp_=True),
    "tp2_sp_exaone4": lambda p: _train(
        p, "exaone4", {"tensor_parallel_degree": 2}, same_batch=True, sp_=True
    ),
    "meta_fresh_tp2_exaone4": lambda p: _meta_fresh(p, "exaone4", {"tensor_parallel_degree": 2}),
    "bad_input": _bad_input,
    "frozen_norms": _frozen_norms,
    "bad_hf_state": _bad_hf_state,
}


# World 4: the compositions, each rank pair of a tp group feeding one batch (dp rank = rank // 2).
CASES_4 = {
    "tp2_dp2_sp_llama": lambda p: _train(
        p, "llama", {"tensor_parallel_degree": 2, "activation_checkpointing": "full"}, batches=2, sp_=True
    ),
    "tp2_ep2_mixtral": lambda p: _train(
        p, "mixtral", {"tensor_parallel_degree": 2, "expert_parallel_degree": 2}, batches=2, **AUX_LOSS
    ),
    "tp2_dp2_sp_tied_qwen3": lambda p: _train(
        p, "qwen3", {"tensor_parallel_degree": 2}, batches=2, sp_=True, tie_word_embeddings=True
    ),
    "tp2_dp2_sp_tied_gemma3": lambda p: _train(
        p,
        "gemma3_text",
        {"tensor_parallel_degree": 2, "activation_checkpointing": "full"},
        batches=2,
        sp_=True,
        tie_word_embeddings=True,
    ),
    "ep2_dp4_mixtral": lambda p: _train(p, "mixtral", {"expert_parallel_degree": 2}),
    "hsdp2x2_ep2_mixtral": lambda p: _train(
        p, "mixtral", {"expert_parallel_degree": 2, "hybrid_shard_degree": 2}
    ),
    "meta_fresh_tp2_ep2_qwen3_moe": lambda p: _meta_fresh(
        p,
        "qwen3_moe",
        {"tensor_parallel_degree": 2, "expert_parallel_degree": 2},
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
    ),
}
# the cases of architectures an older transformers may not have: the test skips them there, naming it
NEWER_ARCHITECTURES = {
    "tp2_tied_gemma": "gemma", "tp2_sp_tied_gemma2": "gemma2", "tp2_sp_gemma3": "gemma3_text",
    "meta_tp2_gemma2": "gemma2", "meta_fresh_tp2_tied_gemma3": "gemma3_text",
    "tp2_sp_tied_granite": "granite", "tp2_sp_olmo": "olmo", "tp2_sp_exaone4": "exaone4",
    "meta_fresh_tp2_exaone4": "exaone4", "tp2_dp2_sp_tied_gemma3": "gemma3_text",
}  # fmt: skip


def installed(model_type: str) -> bool:
    """Whether the installed transformers knows ``model_type``."""
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


MOE_CASES_4 = ("tp2_ep2_mixtral", "ep2_dp4_mixtral", "hsdp2x2_ep2_mixtral", "meta_fresh_tp2_ep2_qwen3_moe")


def run(rank: int, world: int, only: tuple[str, ...] | None = None) -> dict[str, str | None]:
    """Every case (or those in ``only``) on this rank: {case: None or the problems}."""
    os.environ["SMPTK_KERNELS"] = "torch"
    import transformers

    import smptk.parallel as sp

    stacked = int(transformers.__version__.split(".")[0]) >= 5  # else the test skips the MoE cases
    out: dict[str, str | None] = {}
    for name, case in (CASES if world == 2 else CASES_4).items():
        if only is not None and name not in only:
            continue
        if name in MOE_CASES + MOE_CASES_4 and not stacked:
            out[name] = None
            continue
        if name in NEWER_ARCHITECTURES and not installed(NEWER_ARCHITECTURES[name]):
            out[name] = None  # the test skips it
            continue
        problems: list[str] = []
        case(problems)
        out[name] = "\n".join(problems) or None
    sp.reset()
    return out
