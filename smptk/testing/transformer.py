"""A Llama-shaped reference transformer built from a planner :class:`~smptk.parallel.planner.ModelSpec`.

This is the model whose memory :func:`smptk.parallel.planner.estimate_memory` describes term by term,
and the one its validation builds (tests/test_planner_validation.py counts what autograd keeps and
compares; bench/gpu_check.py measures a training step's peak memory on a GPU). Plain PyTorch, written
so that what each op saves for backward is the documented term and nothing more:

- :class:`RMSNorm`: an autograd Function computing in fp32 that saves its input and the fp32 ``rstd``
  (what a fused norm kernel keeps); under sequence parallelism (``sp_group`` set) its weight enters
  through :func:`smptk.comm.functional.copy_to_group`, so each rank's weight gradient sums all ranks'
  tokens.
- :class:`Attention`: q / k / v / o projections, optional per-head q / k norms (Qwen3), rotary
  embeddings, then ``"flash"`` (``F.scaled_dot_product_attention`` with ``enable_gqa``, keeping k and v
  at the key-value heads) or ``"materialized"`` (``softmax(q k^T / sqrt(d)) v`` written out, k and v
  expanded to the query heads).
- :class:`MLP`: SwiGLU ``down(silu(gate(x)) * up(x))``; MoE layers use :class:`smptk.parallel.MoE`.
- :class:`Transformer`: ids ``[b, s]`` -> logits ``[b, s, V]`` (vocab-sharded ``[b, s, V/t]`` once
  :func:`parallelize` has run); :func:`loss` is fp32 cross-entropy on those logits.

:func:`parallelize` applies smptk's tensor-parallel styles (``parallelize_module``) with or without
sequence parallelism. Supported specs: SwiGLU MLP, RMSNorm, GQA attention (not MLA, not GELU / LayerNorm).

Example::

    >>> from smptk.parallel.planner import ModelSpec
    >>> spec = ModelSpec("tiny", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    ...                  head_dim=8, intermediate_size=48)
    >>> model = Transformer(spec, max_seq_len=16)
    >>> ids = torch.randint(0, 64, (2, 16))
    >>> loss(model(ids[:, :-1]), ids[:, 1:]).backward()
    >>> sum(p.numel() for p in model.parameters()) == spec.num_parameters()
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION = ("flash", "materialized")


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        dyf = dy.float()
        dyw = dyf * weight.float()
        dx = rstd * (dyw - xhat * (dyw * xhat).mean(-1, keepdim=True))
        dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim, in fp32; keeps ``x`` and ``rstd`` for backward."""

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.sp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.sp_group is not None:
            from smptk.comm.functional import copy_to_group

            w = copy_to_group(w.to_local() if hasattr(w, "to_local") else w, self.sp_group)
        elif hasattr(w, "to_local"):
            w = w.full_tensor()
        return _RMSNormFn.apply(x, w, self.eps)


def rope_tables(seq: int, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[seq, head_dim / 2]`` for rotary embeddings of pairs ``(x[2i], x[2i+1])``."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, s, heads, d]`` by position (multiplications by the tables keep only the tables)."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, spec, attention: str = "flash", device=None) -> None:
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"attention: expected one of {', '.join(ATTENTION)}, got {attention!r}")
        h, d = spec.hidden_size, spec.head_dim
        self.head_dim, self.attention = d, attention
        qkv_bias = spec.attention_bias
        self.q_proj = nn.Linear(h, spec.num_heads * d, bias=qkv_bias, device=device)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * d, bias=qkv_bias, device=device)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * d, bias=qkv_bias, device=device)
        self.o_proj = nn.Linear(spec.num_heads * d, h, bias=spec.attention_out_bias, device=device)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, device=device)
            self.k_norm = RMSNorm(d, device=device)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, s = q.shape[:2]  # the full sequence, also under sequence parallelism (the projections gather it)
        d = self.head_dim
        q, k, v = q.view(b, s, -1, d), k.view(b, s, -1, d), v.view(b, s, -1, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos[:s], sin[:s]), apply_rope(k, cos[:s], sin[:s])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        if self.attention == "flash":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            scores = (q @ k.transpose(-1, -2)) * d**-0.5
            causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
            out = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, ffn: int, bias: bool = False, device=None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=bias, device=device)
        self.up_proj = nn.Linear(hidden, ffn, bias=bias, device=device)
        self.down_proj = nn.Linear(ffn, hidden, bias=bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, spec, i: int, attention: str = "flash", device=None) -> None:
        super().__init__()
        h = spec.hidden_size
        self.attn_norm = RMSNorm(h, device=device)
        self.attn = Attention(spec, attention, device=device)
        self.mlp_norm = RMSNorm(h, device=device)
        if spec.is_moe_layer(i):
            from smptk.parallel.moe import MoE

            fs = spec.shared_expert_intermediate_size
            self.mlp = MoE(
                h, spec.moe_intermediate_size, spec.num_experts, spec.experts_per_token,
                num_shared_experts=1 if fs else 0, shared_ffn_hidden_size=fs or None, device=device,
            )  # fmt: skip
        else:
            self.mlp = MLP(h, spec.intermediate_size, spec.mlp_bias, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """ids ``[b, s]`` -> logits ``[b, s, V]``; ``max_seq_len`` sizes the rotary tables (buffers)."""

    def __init__(self, spec, *, max_seq_len: int, attention: str = "flash", rope_theta: float = 10000.0,
                 device=None) -> None:  # fmt: skip
        super().__init__()
        if spec.is_mla or spec.mlp != "swiglu" or spec.norm != "rmsnorm" or spec.learned_positions:
            raise ValueError(
                f"{spec.name}: the reference transformer builds RMSNorm / SwiGLU / GQA models (not MLA, GELU,"
                " LayerNorm or learned positions)"
            )
        self.spec = spec
        h = spec.hidden_size
        self.embed_tokens = nn.Embedding(spec.vocab_size, h, device=device)
        self.layers = nn.ModuleList(
            [Block(spec, i, attention, device=device) for i in range(spec.num_layers)]
        )
        self.norm = RMSNorm(h, device=device)
        self.lm_head = (
            None if spec.tie_word_embeddings else nn.Linear(h, spec.vocab_size, bias=False, device=device)
        )
        cos, sin = rope_tables(max_seq_len, spec.head_dim, rope_theta)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        x = self.norm(x)
        if self.lm_head is None:
            return F.linear(x, self.embed_tokens.weight)
        return self.lm_head(x)


def loss(logits: torch.Tensor, target: torch.Tensor, group=None) -> torch.Tensor:
    """Mean fp32 cross-entropy; ``group``: the tensor-parallel group when ``logits`` are vocab-sharded."""
    if group is not None:
        from smptk.parallel.loss import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits, target, group=group)
    return F.cross_entropy(logits.float().flatten(0, -2), target.flatten())


def parallelize(model: Transformer, tp_mesh, *, sequence_parallel: bool = False) -> Transformer:
    """smptk's tensor-parallel styles on every projection, the embedding and the head (``tp_mesh``: 1-D).

    q / k / v / gate / up column-parallel, o / down row-parallel, the embedding and head vocab-parallel
    (the head's logits stay vocab-sharded for :func:`loss` with the group). With ``sequence_parallel``
    the residual stream between the layers is split along the sequence (dim 1) and the norms' weight
    gradients are summed over the group. MoE layers stay whole on every tp rank (as smptk's MoE is).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from smptk.parallel.tp_styles import SmptkColwiseParallel, SmptkRowwiseParallel, SmptkVocabParallel

    if model.lm_head is None:
        raise ValueError("parallelize: tied embeddings are not supported under tensor parallelism here")
    sp = sequence_parallel
    plan = {
        "embed_tokens": SmptkVocabParallel(sequence_parallel=sp),
        "lm_head": SmptkColwiseParallel(sequence_parallel=sp),
    }
    for i, block in enumerate(model.layers):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj"):
            plan[f"layers.{i}.{name}"] = SmptkColwiseParallel(sequence_parallel=sp)
        plan[f"layers.{i}.attn.o_proj"] = SmptkRowwiseParallel(sequence_parallel=sp)
        if isinstance(block.mlp, MLP):
            plan[f"layers.{i}.mlp.gate_proj"] = SmptkColwiseParallel(sequence_parallel=sp)
            plan[f"layers.{i}.mlp.up_proj"] = SmptkColwiseParallel(sequence_parallel=sp)
            plan[f"layers.{i}.mlp.down_proj"] = SmptkRowwiseParallel(sequence_parallel=sp)
        elif sp:
            raise ValueError("parallelize: MoE layers under sequence parallelism are not supported here")
    parallelize_module(model, tp_mesh, plan)
    if sp:
        group = tp_mesh.get_group()
        for m in model.modules():
            if isinstance(m, RMSNorm) and m.weight.shape[0] == model.spec.hidden_size:
                m.sp_group = group
    return model
