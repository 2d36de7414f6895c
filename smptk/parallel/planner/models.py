"""Model descriptions for the planner: a :class:`ModelSpec` from a Hugging Face config or a named preset.

A ModelSpec holds the shape facts that decide memory and FLOPs (vocabulary, hidden size, layers, heads,
MLP kind, MoE and MLA dimensions). :meth:`ModelSpec.tensors` lists every parameter tensor in smptk's layout
(the layout the parallel layers shard: ``[out, in]`` linears, experts stacked ``[E, F, H]`` as
:class:`smptk.parallel.moe.GroupedExperts` holds them) with how smptk divides it:

- ``"tp"``: a column- or row-parallel linear (or its sharded bias), ``1 / tensor_parallel_degree`` per
  rank along ``tp_dim``;
- ``"vocab"``: the embedding and an untied LM head, vocabulary rows split over ``tp``;
- ``"replicated"``: norms, a row-parallel bias, routers, MoE shared experts, learned positions and MLA's
  down-projections (every tp rank holds all of it);
- ``"experts"``: routed experts, ``num_experts / expert_parallel_degree`` per rank, replicated over ``tp``.

Counts are exact: :func:`num_parameters` equals ``sum(p.numel() for p in model.parameters())`` of the
Hugging Face model built from the same config (tests/test_planner_models.py builds every preset on the
meta device). Buffers (rotary tables, DeepSeek-V3's ``e_score_correction_bias``) are not parameters and
are not counted.

Presets (:data:`PRESETS`) are the configs published with each model (the ``config.json`` of its Hugging
Face repository; GPT-3 175B from Brown et al. 2020, Table 2.1, with GPT-2's vocabulary and tied
embeddings), given in Hugging Face's own keys, so the test that builds them exercises the same parser a
user's config takes. Published sizes, which the counts reproduce: Llama 2 7B 6.74B, Llama 3.1 8B 8.03B,
Mixtral 8x7B 46.7B total / 12.9B active, DeepSeek-V3 671B total / 37B active (without its multi-token
prediction module, which Hugging Face does not build).

Example::

    >>> from smptk.parallel.planner import model_spec
    >>> spec = model_spec("llama2-7b")
    >>> spec.num_parameters()
    6738415616
    >>> m = model_spec("mixtral-8x7b")
    >>> round(m.num_parameters() / 1e9, 1), round(m.num_parameters(active=True) / 1e9, 1)
    (46.7, 12.9)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

SPLITS = ("tp", "vocab", "replicated", "experts")


@dataclasses.dataclass(frozen=True)
class ParamTensor:
    """``count`` parameter tensors of one ``shape`` (over all layers), and how smptk divides them.

    ``split``: one of :data:`SPLITS`; ``tp_dim``: the dim split over ``tp`` (``"tp"`` / ``"vocab"``);
    ``active``: the elements one token uses (experts: ``experts_per_token / num_experts`` of them);
    ``unit``: ``"layer"`` (inside a transformer block, FSDP2 unit per block) or ``"root"`` (embeddings,
    final norm, LM head: the root unit).

    Example::

        >>> from smptk.parallel.planner import model_spec
        >>> spec = model_spec("mixtral-8x7b")
        >>> experts = next(t for t in spec.tensors() if t.split == "experts")
        >>> experts   # gate and up of 8 experts, stacked [E, F, H], in each of 32 layers: count 64
        ParamTensor(name='moe.experts.w_gate_up', shape=(8, 14336, 4096), count=64, split='experts',
                    tp_dim=None, unit='layer')
        >>> experts.numel == 64 * 8 * 14336 * 4096
        True
        >>> sum(t.numel for t in spec.tensors()) == spec.num_parameters()
        True
    """

    name: str
    shape: tuple[int, ...]
    count: int
    split: str
    tp_dim: int | None = None
    unit: str = "layer"

    @property
    def numel(self) -> int:
        return self.count * math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer (see the module docstring for the layout).

    Attention: ``num_heads`` query heads and ``num_kv_heads`` key / value heads of ``head_dim`` (grouped
    query attention when fewer), or, with ``kv_lora_rank > 0``, multi-head latent attention (DeepSeek-V2/3:
    queries through a ``q_lora_rank`` bottleneck, keys / values through a ``kv_lora_rank`` latent, heads of
    ``qk_nope_head_dim + qk_rope_head_dim`` for q / k and ``v_head_dim`` for v). ``qk_norm``: per-head
    RMSNorm of q and k (Qwen3). MLP: ``"swiglu"`` (gate, up, down) or ``"gelu"`` (fc, proj; GPT).
    MoE (``num_experts > 0``): every layer not in ``dense_layers`` replaces its MLP by a router
    ``[E, H]`` and ``num_experts`` SwiGLU experts of ``moe_intermediate_size`` (top ``experts_per_token``),
    plus a shared SwiGLU MLP of ``shared_expert_intermediate_size`` when that is > 0.
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mlp: str = "swiglu"
    norm: str = "rmsnorm"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    learned_positions: int = 0
    max_position_embeddings: int = 4096
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            _positive(self.name, key, getattr(self, key))
        widths = ("intermediate_size", "learned_positions", "max_position_embeddings", "num_experts")
        widths += ("experts_per_token", "moe_intermediate_size", "shared_expert_intermediate_size")
        widths += ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for key in widths:  # 0 means "none" for the optional ones; a negative size shrank the count
            _not_negative(self.name, key, getattr(self, key))
        if not self.num_experts or len(self.dense_layers) > 0:  # some layer has a dense MLP
            _positive(self.name, "intermediate_size", self.intermediate_size)
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"{self.name}: mlp must be 'swiglu' or 'gelu', got {self.mlp!r}")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"{self.name}: norm must be 'rmsnorm' or 'layernorm', got {self.norm!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_kv_heads {self.num_kv_heads} does not divide num_heads {self.num_heads}"
            )
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise ValueError(
                    f"{self.name}: experts_per_token must be in 1..num_experts ({self.num_experts}), "
                    f"got {self.experts_per_token}"
                )
            _positive(self.name, "moe_intermediate_size", self.moe_intermediate_size)
        if self.kv_lora_rank and not (self.qk_rope_head_dim and self.v_head_dim):
            raise ValueError(f"{self.name}: MLA (kv_lora_rank > 0) needs qk_rope_head_dim and v_head_dim")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"{self.name}: dense_layers {bad} outside 0..{self.num_layers - 1}")

    # -- structure ---------------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - len(set(self.dense_layers)) if self.is_moe else 0

    def check_seq_len(self, seq_len: int) -> None:
        """``ValueError`` when the model cannot take ``seq_len`` tokens: a learned position table (GPT-2's
        ``n_positions``) has no row past its length. Rotary models take longer sequences than
        ``max_position_embeddings`` (context extension), so that is not an error."""
        if self.learned_positions and seq_len > self.learned_positions:
            raise ValueError(
                f"seq_len {seq_len} exceeds {self.name}'s {self.learned_positions} learned positions (its "
                "position embedding table has no row for a later token)"
            )

    def is_moe_layer(self, i: int) -> bool:
        return self.is_moe and i not in self.dense_layers

    @property
    def q_head_dim(self) -> int:
        """Per-head width of q and k (MLA: nope + rope part)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    def tensors(self) -> list[ParamTensor]:
        """Every parameter tensor (grouped by shape over the layers), in smptk's layout."""
        h, n_moe = self.hidden_size, self.num_moe_layers
        n_dense = self.num_layers - n_moe
        out: list[ParamTensor] = []

        def add(name, shape, count, split, tp_dim=None, unit="layer"):
            if count:
                out.append(ParamTensor(name, tuple(shape), count, split, tp_dim, unit))

        out_bias = self.attention_out_bias
        norm_count = 2 if self.norm == "layernorm" else 1  # weight (+ bias)
        L = self.num_layers
        add("attn_norm", (h,), L * norm_count, "replicated")
        add("mlp_norm", (h,), L * norm_count, "replicated")
        a, g = self.num_heads, self.num_kv_heads
        if self.is_mla:
            qd = self.q_head_dim
            if self.q_lora_rank:
                add("q_a_proj", (self.q_lora_rank, h), L, "replicated")
                add("q_a_norm", (self.q_lora_rank,), L, "replicated")
                add("q_b_proj", (a * qd, self.q_lora_rank), L, "tp", 0)
            else:
                add("q_proj", (a * qd, h), L, "tp", 0)
            add("kv_a_proj", (self.kv_lora_rank + self.qk_rope_head_dim, h), L, "replicated")
            add("kv_a_norm", (self.kv_lora_rank,), L, "replicated")
            add("kv_b_proj", (a * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank), L, "tp", 0)
            add("o_proj", (h, a * self.v_head_dim), L, "tp", 1)
        else:
            d = self.head_dim
            add("q_proj", (a * d, h), L, "tp", 0)
            add("k_proj", (g * d, h), L, "tp", 0)
            add("v_proj", (g * d, h), L, "tp", 0)
            if self.attention_bias:
                add("q_bias", (a * d,), L, "tp", 0)
                add("kv_bias", (g * d,), 2 * L, "tp", 0)
            add("o_proj", (h, a * d), L, "tp", 1)
            if self.qk_norm:
                add("qk_norm", (d,), 2 * L, "replicated")
        if out_bias:
            add("o_bias", (h,), L, "replicated")
        f = self.intermediate_size
        if self.mlp == "swiglu":
            add("mlp.gate_up", (f, h), 2 * n_dense, "tp", 0)
            add("mlp.down", (h, f), n_dense, "tp", 1)
            if self.mlp_bias:
                add("mlp.gate_up_bias", (f,), 2 * n_dense, "tp", 0)
                add("mlp.down_bias", (h,), n_dense, "replicated")
        else:
            add("mlp.fc", (f, h), n_dense, "tp", 0)
            add("mlp.proj", (h, f), n_dense, "tp", 1)
            if self.mlp_bias:
                add("mlp.fc_bias", (f,), n_dense, "tp", 0)
                add("mlp.proj_bias", (h,), n_dense, "replicated")
        if n_moe:
            E, fm, fs = self.num_experts, self.moe_intermediate_size, self.shared_expert_intermediate_size
            add("moe.router", (E, h), n_moe, "replicated")
            add("moe.experts.w_gate_up", (E, fm, h), 2 * n_moe, "experts")
            add("moe.experts.w_down", (E, h, fm), n_moe, "experts")
            if fs:
                # smptk's MoE keeps its shared experts whole on every tp rank (it is not tensor-parallel)
                add("moe.shared.gate_up", (fs, h), 2 * n_moe, "replicated")
                add("moe.shared.down", (h, fs), n_moe, "replicated")
        add("embed_tokens", (self.vocab_size, h), 1, "vocab", 0, unit="root")
        if self.learned_positions:
            add("position_embeddings", (self.learned_positions, h), 1, "replicated", unit="root")
        add("final_norm", (h,), norm_count, "replicated", unit="root")
        if not self.tie_word_embeddings:
            add("lm_head", (self.vocab_size, h), 1, "vocab", 0, unit="root")
        return out

    def num_parameters(self, *, active: bool = False) -> int:
        """All parameters, or with ``active=True`` those one token uses (``experts_per_token`` of the
        routed experts; every other parameter counts fully)."""
        total = 0
        for t in self.tensors():
            if t.split == "experts" and active:
                total += t.numel * self.experts_per_token // self.num_experts
            else:
                total += t.numel
        return total

    def layer_parameters(self, i: int) -> int:
        """Parameters of block ``i`` (an FSDP2 unit)."""
        moe = self.is_moe_layer(i)
        n_moe, n_dense = self.num_moe_layers, self.num_layers - self.num_moe_layers
        total = 0
        for t in self.tensors():
            if t.unit != "layer":
                continue
            if t.name.startswith("moe."):
                total += t.numel // n_moe if moe else 0
            elif t.name.startswith("mlp."):
                total += t.numel // n_dense if not moe else 0
            else:
                total += t.numel // self.num_layers
        return total

    def describe(self) -> str:
        kind = f"MoE {self.num_experts}x top-{self.experts_per_token}" if self.is_moe else "dense"
        attn = "MLA" if self.is_mla else f"GQA {self.num_heads}/{self.num_kv_heads}"
        return (
            f"{self.name}: {self.num_parameters() / 1e9:.2f}B parameters"
            + (f" ({self.num_parameters(active=True) / 1e9:.2f}B active)" if self.is_moe else "")
            + f", {self.num_layers} layers, hidden {self.hidden_size}, {attn}, {kind}"
            + f", vocab {self.vocab_size}"
        )


def _positive(name: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: {key} must be a positive int, got {value!r}")


def _not_negative(name: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: {key} must be an int >= 0, got {value!r}")


# -- Hugging Face configs ------------------------------------------------------------------------------

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gpt2")


def _hf(vocab, h, ffn, layers, heads, kv, max_pos, **extra) -> dict[str, Any]:
    d = {
        "vocab_size": vocab, "hidden_size": h, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "max_position_embeddings": max_pos,
        "tie_word_embeddings": False,
    }  # fmt: skip
    d.update(extra)
    return d


# The defaults of transformers' config classes (5.x) for the keys the parser reads.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _hf(32000, 4096, 11008, 32, 32, None, 2048, attention_bias=False, mlp_bias=False),
    "mistral": _hf(32000, 4096, 14336, 32, 32, 8, 131072),
    "mixtral": _hf(32000, 4096, 14336, 32, 32, 8, 131072, num_local_experts=8, num_experts_per_tok=2),
    "qwen2": _hf(151936, 4096, 22016, 32, 32, 32, 32768),
    "qwen3": _hf(151936, 4096, 22016, 32, 32, 32, 32768, head_dim=128, attention_bias=False),
    "qwen3_moe": _hf(
        151936,
        2048,
        6144,
        24,
        32,
        4,
        32768,
        attention_bias=False,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "deepseek_v3": _hf(
        129280,
        7168,
        18432,
        61,
        128,
        128,
        4096,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    "gpt2": {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024},
}


def from_hf_config(config: Any, name: str | None = None) -> ModelSpec:
    """A ModelSpec from a Hugging Face config: a ``PretrainedConfig``, its dict, or a ``config.json`` path.

    ``model_type`` picks the architecture (:data:`SUPPORTED_MODEL_TYPES`); the keys read are the ones each
    architecture's modeling code reads, with the same defaults. What transformers refuses to build is
    refused: a hidden size not divisible by the attention heads for GPT-2 and Llama (Llama even with
    ``head_dim`` given; Mistral, Mixtral, Qwen2 / Qwen3 build ``heads x head_dim`` wide attention from an
    explicit ``head_dim``, else ``hidden_size // heads``, and so does the count), and
    ``num_key_value_heads`` 0 (None or no key: one per query head).

    Example (the keys of Llama 2 7B's ``config.json``; ``from_hf_config("path/to/checkpoint")`` reads the
    file, ``from_hf_config(transformers.AutoConfig.from_pretrained(...))`` takes the config object)::

        >>> from smptk.parallel.planner import from_hf_config
        >>> config = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
        ...           "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32}
        >>> spec = from_hf_config(config, name="my-llama")
        >>> spec.num_parameters(), spec.num_kv_heads   # num_key_value_heads left out: one per head
        (6738415616, 32)
        >>> spec.describe()
        'my-llama: 6.74B parameters, 32 layers, hidden 4096, GQA 32/32, dense, vocab 32000'
    """
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"config: {path!r} does not exist (expected a Hugging Face config.json, or a checkpoint "
                "directory holding one)"
            )
        with open(path, "rb") as f:
            try:
                config = json.load(f)  # bytes: JSON's own encodings (UTF-8/16/32), not the locale's
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"config: {path!r} is not a JSON Hugging Face config: {e}") from None
    elif hasattr(config, "to_dict") and not isinstance(config, Mapping):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise TypeError(
            "config: expected a Hugging Face config, a dict or a config.json path, "
            f"got {type(config).__name__}"
        )
    mt = config.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    # A key the config leaves out takes the architecture's default (transformers' config classes).
    c = {**_HF_DEFAULTS[mt], **config}
    name = name or c.get("_name_or_path") or mt
    if mt == "gpt2":
        h = c.get("n_embd", 768)
        _positive(name, "n_embd", h)  # a str or bool would break or pass the check below
        heads = c.get("n_head", 12)
        _positive(name, "n_head", heads)
        if h % heads:  # GPT2Attention refuses it; GPT-2 has no head_dim key
            raise ValueError(
                f"{name}: n_embd {h} is not divisible by n_head {heads} (Hugging Face's GPT2Attention "
                "refuses it)"
            )
        return ModelSpec(
            name=name,
            vocab_size=c.get("vocab_size", 50257),
            hidden_size=h,
            num_layers=c.get("n_layer", 12),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=h // heads,
            intermediate_size=c.get("n_inner") or 4 * h,
            mlp="gelu",
            norm="layernorm",
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
            attention_bias=True,
            attention_out_bias=True,
            mlp_bias=True,
            learned_positions=c.get("n_positions", 1024),
            max_position_embeddings=c.get("n_positions", 1024),
        )
    h = c["hidden_size"]
    _positive(name, "hidden_size", h)  # a str or bool would break or pass the check below
    heads = c["num_attention_heads"]
    _positive(name, "num_attention_heads", heads)
    # None (or no key) is one key / value head per query head, as transformers reads it; 0 is an error
    kv = heads if c.get("num_key_value_heads") is None else c["num_key_value_heads"]
    _positive(name, "num_key_value_heads", kv)
    if mt == "llama" and h % heads:  # LlamaConfig's validate_architecture, even with an explicit head_dim
        raise ValueError(
            f"{name}: hidden_size {h} is not divisible by num_attention_heads {heads} (Hugging Face's "
            "LlamaConfig refuses it, even with head_dim given)"
        )
    common = dict(
        name=name,
        vocab_size=c["vocab_size"],
        hidden_size=h,
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=c.get("head_dim") or h // heads,
        intermediate_size=c["intermediate_size"],
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_position_embeddings=c.get("max_position_embeddings", 4096),
    )
    if mt in ("llama", "qwen3", "qwen3_moe"):  # Mistral's and Mixtral's attention has no biases
        bias = bool(c.get("attention_bias", False))
        common.update(attention_bias=bias, attention_out_bias=bias)
    if mt == "llama":
        common["mlp_bias"] = bool(c.get("mlp_bias", False))
    if mt == "qwen2":
        common["attention_bias"] = True  # q, k, v biases; o_proj has none
    if mt in ("qwen3", "qwen3_moe"):
        common["qk_norm"] = True
    if mt == "mixtral":
        common.update(
            num_experts=c.get("num_local_experts", 8),
            experts_per_token=c.get("num_experts_per_tok", 2),
            moe_intermediate_size=c["intermediate_size"],
        )
    if mt == "qwen3_moe":
        step = c.get("decoder_sparse_step", 1)
        only = set(c.get("mlp_only_layers") or ())
        n_exp = c.get("num_experts", c.get("num_local_experts", 128))  # to_dict() writes num_local_experts
        L = c["num_hidden_layers"]
        _positive(name, "num_hidden_layers", L)  # the layer walk below needs ints
        _positive(name, "decoder_sparse_step", step)
        _not_negative(name, "num_experts", n_exp)
        dense = tuple(i for i in range(L) if i in only or not (n_exp > 0 and (i + 1) % step == 0))
        common.update(
            num_experts=n_exp,
            experts_per_token=c.get("num_experts_per_tok", 8),
            moe_intermediate_size=c.get("moe_intermediate_size", 0),
            dense_layers=dense,
        )
    if mt == "deepseek_v3":
        first = c.get("first_k_dense_replace", 3)
        _not_negative(name, "first_k_dense_replace", first)  # the dense-layer range below needs ints
        _positive(name, "num_hidden_layers", c["num_hidden_layers"])
        common.update(
            num_experts=c.get("n_routed_experts", 256),
            experts_per_token=c.get("num_experts_per_tok", 8),
            moe_intermediate_size=c["moe_intermediate_size"],
            shared_expert_intermediate_size=c["moe_intermediate_size"] * (c["n_shared_experts"] or 0),
            dense_layers=tuple(range(min(first, c["num_hidden_layers"]))),
            q_lora_rank=c["q_lora_rank"] or 0,  # None: queries without the low-rank bottleneck
            kv_lora_rank=c["kv_lora_rank"],
            qk_nope_head_dim=c["qk_nope_head_dim"],
            qk_rope_head_dim=c["qk_rope_head_dim"],
            v_head_dim=c["v_head_dim"],
            attention_bias=False,
        )
        if c.get("attention_bias"):
            raise ValueError("config: deepseek_v3 with attention_bias=True is not modeled by the planner")
    return ModelSpec(**common)


def _llama(vocab, h, layers, heads, kv, ffn, *, theta=10000.0, max_pos=4096, model_type="llama", **extra):
    cfg = {
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": h,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": ffn,
        "rope_theta": theta,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    cfg.update(extra)
    return cfg


# Hugging Face config keys of each model (the values of its published config.json; GPT-3 from its paper).
PRESETS: dict[str, dict[str, Any]] = {
    "llama2-7b": _llama(32000, 4096, 32, 32, 32, 11008),
    "llama2-13b": _llama(32000, 5120, 40, 40, 40, 13824),
    "llama2-70b": _llama(32000, 8192, 80, 64, 8, 28672),
    "llama3.1-8b": _llama(128256, 4096, 32, 32, 8, 14336, theta=500000.0, max_pos=131072),
    "llama3.1-70b": _llama(128256, 8192, 80, 64, 8, 28672, theta=500000.0, max_pos=131072),
    "llama3.1-405b": _llama(128256, 16384, 126, 128, 8, 53248, theta=500000.0, max_pos=131072),
    "mistral-7b": _llama(32000, 4096, 32, 32, 8, 14336, max_pos=32768, model_type="mistral"),
    "mixtral-8x7b": _llama(
        32000,
        4096,
        32,
        32,
        8,
        14336,
        theta=1e6,
        max_pos=32768,
        model_type="mixtral",
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "mixtral-8x22b": _llama(
        32768,
        6144,
        56,
        48,
        8,
        16384,
        theta=1e6,
        max_pos=65536,
        model_type="mixtral",
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    "qwen3-8b": _llama(
        151936,
        4096,
        36,
        32,
        8,
        12288,
        theta=1e6,
        max_pos=40960,
        model_type="qwen3",
        head_dim=128,
        rms_norm_eps=1e-6,
    ),
    "qwen3-32b": _llama(
        151936,
        5120,
        64,
        64,
        8,
        25600,
        theta=1e6,
        max_pos=40960,
        model_type="qwen3",
        head_dim=128,
        rms_norm_eps=1e-6,
    ),
    "qwen3-30b-a3b": _llama(
        151936,
        2048,
        48,
        32,
        4,
        6144,
        theta=1e6,
        max_pos=40960,
        model_type="qwen3_moe",
        head_dim=128,
        rms_norm_eps=1e-6,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "qwen3-235b-a22b": _llama(
        151936,
        4096,
        94,
        64,
        4,
        12288,
        theta=1e6,
        max_pos=40960,
        model_type="qwen3_moe",
        head_dim=128,
        rms_norm_eps=1e-6,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "gpt3-175b": {
        "model_type": "gpt2",
        "vocab_size": 50257,
        "n_embd": 12288,
        "n_layer": 96,
        "n_head": 96,
        "n_positions": 2048,
    },
    "deepseek-v3": _llama(
        129280,
        7168,
        61,
        128,
        128,
        18432,
        theta=10000.0,
        max_pos=163840,
        model_type="deepseek_v3",
        rms_norm_eps=1e-6,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        moe_layer_freq=1,
        n_group=8,
        topk_group=4,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
}


def model_spec(model: str | ModelSpec | Mapping | Any) -> ModelSpec:
    """A ModelSpec from a preset name (:data:`PRESETS`), a ModelSpec, a Hugging Face config (object or
    dict) or a ``config.json`` path (a file, or a checkpoint directory holding one). A string that names
    a file or a directory holding a ``config.json`` is a path (``my_llama`` as well as ``./my_llama``),
    even if a preset has its name; else a preset name. An unknown name raises ValueError listing the
    presets."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str) and not (os.path.sep in model or model.endswith(".json")):
        is_config = os.path.isfile(model) or os.path.isfile(os.path.join(model, "config.json"))
        key = model.lower()
        if not is_config and key in PRESETS:
            return from_hf_config(PRESETS[key], name=key)
        if not is_config and not os.path.isdir(model):  # a directory without one: from_hf_config says so
            raise ValueError(
                f"unknown model {model!r}; presets: {', '.join(PRESETS)} (or a config.json path)"
            )
    return from_hf_config(model)
