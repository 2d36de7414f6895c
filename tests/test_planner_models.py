"""smptk/parallel/planner/models.py: parameter counts of ModelSpec against the Hugging Face models themselves.

The planner sizes memory from :meth:`ModelSpec.tensors`, so a wrong tensor there is a wrong plan. The
reference here is independent of that formula: each config is built by ``transformers`` on the meta device
(no storage, a fraction of a second even for DeepSeek-V3 or Llama 3.1 405B) and its parameters are counted.
Checked against it: the total of every preset, the active count of the MoE presets (routed experts found by
name in the Hugging Face model, scaled by top-k / E), the per-block count :meth:`ModelSpec.layer_parameters`
(the FSDP2 unit), tied embeddings, and small configs that switch on the biases, QK norms, sparse-step MoE
and MLA without a q LoRA. Also: the published sizes of the presets, the inputs ``from_hf_config`` takes,
and the errors it raises.

Configs that omit keys ``transformers`` fills with per-architecture defaults (or that set keys an
architecture ignores) are in ``test_missing_keys_take_hf_defaults``: the parser must take the same defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest

transformers = pytest.importorskip(
    "transformers",
    reason="the reference counts come from transformers models: install the planner-tests extra "
    "(make test installs it where a package index is reachable)",
)
torch = pytest.importorskip("torch")

from smptk.parallel.planner.models import (  # noqa: E402
    PRESETS,
    SUPPORTED_MODEL_TYPES,
    ModelSpec,
    from_hf_config,
    model_spec,
)

MOE_PRESETS = [
    name for name, cfg in PRESETS.items() if cfg["model_type"] in ("mixtral", "qwen3_moe", "deepseek_v3")
]

# A small Llama-shaped config (GQA 4/2, head_dim 16) that the tests below vary.
SMALL = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


def _hf_config(cfg: dict):
    cfg = dict(cfg)
    return transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def _hf_build(cfg: dict):
    """The Hugging Face causal LM of ``cfg`` (a config dict with ``model_type``), on the meta device."""
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(_hf_config(cfg))


@functools.cache
def _hf_preset(name: str):
    return _hf_build(PRESETS[name])


def _numel(module) -> int:
    # parameters() yields a tied weight once, as the planner counts it.
    return sum(p.numel() for p in module.parameters())


def _blocks(model):
    """The transformer blocks of a Hugging Face causal LM (``model.layers``; GPT-2: ``transformer.h``)."""
    base = model.base_model
    return base.layers if hasattr(base, "layers") else base.h


def _num_experts(hf_config) -> int:
    for key in ("num_local_experts", "n_routed_experts", "num_experts"):
        value = getattr(hf_config, key, None)
        if value:
            return value
    raise AssertionError(f"no expert count in {type(hf_config).__name__}")


def _root_numel(spec: ModelSpec) -> int:
    return sum(t.numel for t in spec.tensors() if t.unit == "root")


# -- presets against Hugging Face --------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_total_matches_hf(name):
    assert model_spec(name).num_parameters() == _numel(_hf_preset(name))


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_moe_preset_active_matches_hf(name):
    model = _hf_preset(name)
    total = _numel(model)
    routed = sum(p.numel() for n, p in model.named_parameters() if "experts" in n and "shared" not in n)
    assert 0 < routed < total
    num_experts, top_k = _num_experts(model.config), model.config.num_experts_per_tok
    assert routed * (num_experts - top_k) % num_experts == 0
    active = total - routed * (num_experts - top_k) // num_experts
    assert model_spec(name).num_parameters(active=True) == active
    assert active < total


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_layer_parameters_match_hf_blocks(name):
    spec, model = model_spec(name), _hf_preset(name)
    blocks = _blocks(model)
    assert len(blocks) == spec.num_layers
    per_layer = [spec.layer_parameters(i) for i in range(spec.num_layers)]
    assert per_layer == [_numel(b) for b in blocks]
    assert sum(per_layer) + _root_numel(spec) == spec.num_parameters()
    assert _root_numel(spec) == _numel(model) - sum(_numel(b) for b in blocks)


def test_deepseek_v3_dense_and_moe_blocks():
    """Layers 0-2 are dense, 3-60 MoE: a 5-layer build has both kinds and fixes the full count by scaling."""
    full = model_spec("deepseek-v3")
    reduced_cfg = {**PRESETS["deepseek-v3"], "num_hidden_layers": 5}
    reduced = from_hf_config(reduced_cfg)
    model = _hf_build(reduced_cfg)
    blocks = _blocks(model)
    assert reduced.num_parameters() == _numel(model)
    dense, moe = _numel(blocks[0]), _numel(blocks[3])
    assert dense != moe
    assert _numel(blocks[1]) == _numel(blocks[2]) == dense and _numel(blocks[4]) == moe
    for spec in (full, reduced):
        assert spec.layer_parameters(0) == dense
        assert spec.layer_parameters(3) == moe
        assert spec.layer_parameters(spec.num_layers - 1) == moe
    # The full model is the 5-layer one plus 56 more MoE blocks (counted by Hugging Face, not models.py).
    assert full.num_parameters() == _numel(model) + (full.num_layers - 5) * moe


@pytest.mark.parametrize(
    ("name", "active", "expected", "tol"),
    [
        ("llama2-7b", False, 6.74e9, 0.005e9),
        ("llama2-70b", False, 68.98e9, 0.005e9),
        ("llama3.1-8b", False, 8.03e9, 0.005e9),
        ("mixtral-8x7b", False, 46.7e9, 0.05e9),
        ("mixtral-8x7b", True, 12.9e9, 0.05e9),
        ("deepseek-v3", False, 671e9, 0.5e9),
        ("deepseek-v3", True, 37.5e9, 0.1e9),
        ("gpt3-175b", False, 174.6e9, 0.05e9),
    ],
)
def test_published_sizes(name, active, expected, tol):
    assert abs(model_spec(name).num_parameters(active=active) - expected) <= tol


# -- small configs against Hugging Face ---------------------------------------------------------------

_MLA = {
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 96,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
}
_QWEN3_MOE = {
    **SMALL,
    "model_type": "qwen3_moe",
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
_GPT2 = {
    "model_type": "gpt2",
    "vocab_size": 256,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 32,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param({**SMALL, "attention_bias": True, "mlp_bias": True}, id="llama-biases"),
        pytest.param({**SMALL, "head_dim": 24}, id="llama-head-dim"),
        pytest.param({**SMALL, "model_type": "qwen2"}, id="qwen2-qkv-bias"),
        pytest.param({**SMALL, "model_type": "qwen2", "tie_word_embeddings": True}, id="qwen2-tied"),
        pytest.param({**SMALL, "model_type": "mistral"}, id="mistral"),
        pytest.param({**SMALL, "model_type": "qwen3", "head_dim": 24, "attention_bias": True}, id="qwen3"),
        pytest.param(
            {**SMALL, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}, id="mixtral"
        ),
        pytest.param(_QWEN3_MOE, id="qwen3-moe"),
        pytest.param(
            {**_QWEN3_MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
            id="qwen3-moe-sparse-step",
        ),
        pytest.param({**_MLA, "q_lora_rank": 24, "n_shared_experts": 1}, id="mla-q-lora"),
        pytest.param(
            {**_MLA, "q_lora_rank": None, "n_shared_experts": 2, "first_k_dense_replace": 1},
            id="mla-no-q-lora",
        ),
        pytest.param(_GPT2, id="gpt2"),
        pytest.param({**_GPT2, "n_inner": 100}, id="gpt2-n-inner"),
        # heads x head_dim need not be the hidden size where the architecture takes an explicit head_dim,
        # or floors hidden / heads without one (transformers builds these; Llama refuses them)
        pytest.param({**SMALL, "model_type": "mistral", "hidden_size": 66, "head_dim": 24}, id="mistral-66"),
        pytest.param({**SMALL, "model_type": "mistral", "hidden_size": 66}, id="mistral-66-floor"),
        pytest.param({**SMALL, "model_type": "qwen3", "hidden_size": 66, "head_dim": 16}, id="qwen3-66"),
    ],
)
def test_small_config_matches_hf(cfg):
    spec, model = from_hf_config(cfg), _hf_build(cfg)
    assert spec.num_parameters() == _numel(model)
    assert [spec.layer_parameters(i) for i in range(spec.num_layers)] == [_numel(b) for b in _blocks(model)]
    if spec.is_moe:
        assert spec.num_parameters(active=True) < spec.num_parameters()


def test_qwen2_biases_on_qkv_only():
    """Qwen2 adds q, k and v biases (not o): HF builds them so, and the spec counts exactly those."""
    model = _hf_build({**SMALL, "model_type": "qwen2"})
    attn = _blocks(model)[0].self_attn
    has_bias = {p: getattr(attn, p).bias is not None for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert has_bias == {"q_proj": True, "k_proj": True, "v_proj": True, "o_proj": False}
    heads, kv, head_dim, layers = 4, 2, 16, 2
    qwen2 = from_hf_config({**SMALL, "model_type": "qwen2"}).num_parameters()
    llama = from_hf_config(SMALL).num_parameters()
    assert qwen2 - llama == layers * (heads + 2 * kv) * head_dim


def test_tied_embeddings():
    untied_cfg = {**SMALL, "tie_word_embeddings": False}
    tied_cfg = {**SMALL, "tie_word_embeddings": True}
    untied, tied = from_hf_config(untied_cfg), from_hf_config(tied_cfg)
    assert untied.num_parameters() - tied.num_parameters() == SMALL["vocab_size"] * SMALL["hidden_size"]
    assert tied.num_parameters() == _numel(_hf_build(tied_cfg))
    assert untied.num_parameters() == _numel(_hf_build(untied_cfg))
    assert "lm_head" not in [t.name for t in tied.tensors()]


@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param({**SMALL}, id="llama"),
        pytest.param({k: v for k, v in SMALL.items() if k != "num_key_value_heads"}, id="llama-no-kv"),
        pytest.param({**_GPT2}, id="gpt2"),
        pytest.param(
            {k: v for k, v in SMALL.items() if k != "num_key_value_heads"}
            | {"model_type": "mistral", "num_attention_heads": 8},
            id="mistral-no-kv",
        ),
        pytest.param(
            {**SMALL, "model_type": "mistral", "attention_bias": True},
            id="mistral-attention-bias",
        ),
        pytest.param(
            {**SMALL, "model_type": "qwen3"},
            id="qwen3-no-head-dim",
        ),
        pytest.param(
            {**SMALL, "model_type": "qwen3_moe", "head_dim": 16},
            id="qwen3-moe-no-experts",
        ),
        pytest.param(
            {**_MLA},
            id="deepseek-v3-no-q-lora-rank",
        ),
        pytest.param(
            {**_GPT2, "tie_word_embeddings": False},
            id="gpt2-untied",
        ),
        pytest.param(  # Qwen3MoeConfig has no head_dim: hidden // heads (the planner took Qwen3's 128)
            {k: v for k, v in _QWEN3_MOE.items() if k != "head_dim"},
            id="qwen3-moe-no-head-dim",
        ),
    ],
)
def test_missing_keys_take_hf_defaults(cfg):
    assert from_hf_config(cfg).num_parameters() == _numel(_hf_build(cfg))


# -- inputs and errors --------------------------------------------------------------------------------


def test_from_hf_config_inputs(tmp_path):
    cfg = {**SMALL, "attention_bias": True, "mlp_bias": True}
    reference = from_hf_config(cfg)
    hf_config = _hf_config(cfg)
    json_path = tmp_path / "my_config.json"
    json_path.write_text(json.dumps(cfg))
    checkpoint = tmp_path / "checkpoint"
    hf_config.save_pretrained(checkpoint)  # writes checkpoint/config.json the way transformers does
    assert (checkpoint / "config.json").is_file()
    for source in (hf_config, json_path, str(json_path), checkpoint, str(checkpoint)):
        spec = from_hf_config(source)
        assert dataclasses.replace(spec, name=reference.name) == reference, source
    assert model_spec(str(json_path)) == from_hf_config(json_path)
    assert model_spec(hf_config).num_parameters() == reference.num_parameters()
    assert from_hf_config(cfg, name="mine").name == "mine"
    assert model_spec("LLAMA2-7B") == model_spec("llama2-7b")
    assert model_spec(reference) is reference


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match="llama2-7b") as info:
        model_spec("llama-9000")
    assert "llama-9000" in str(info.value)
    assert all(name in str(info.value) for name in PRESETS)


def test_unsupported_model_type_lists_supported():
    with pytest.raises(ValueError, match="bert") as info:
        from_hf_config({"model_type": "bert", "hidden_size": 768})
    assert all(mt in str(info.value) for mt in SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        pytest.param(
            {**_GPT2, "n_embd": 100, "n_head": 3}, "gpt2: n_embd 100 is not divisible by n_head 3", id="gpt2"
        ),
        pytest.param(
            {**SMALL, "hidden_size": 66},
            "llama: hidden_size 66 is not divisible by num_attention_heads 4",
            id="llama",
        ),
        pytest.param(  # LlamaConfig checks the hidden size even when head_dim is given
            {**SMALL, "hidden_size": 66, "head_dim": 16},
            "llama: hidden_size 66 is not divisible by num_attention_heads 4",
            id="llama-head-dim",
        ),
        pytest.param(  # 0 is not "absent": HF divides by it
            {**SMALL, "num_key_value_heads": 0},
            "llama: num_key_value_heads must be a positive int, got 0",
            id="kv0",
        ),
        pytest.param(
            {**SMALL, "model_type": "mistral", "num_key_value_heads": 0},
            "mistral: num_key_value_heads must be a positive int, got 0",
            id="mistral-kv0",
        ),
        pytest.param(
            {**_MLA, "num_key_value_heads": 0},
            "deepseek_v3: num_key_value_heads must be a positive int, got 0",
            id="mla-kv0",
        ),
        pytest.param(
            {**SMALL, "num_attention_heads": 0},
            "llama: num_attention_heads must be a positive int, got 0",
            id="heads0",
        ),
    ],
)
def test_configs_hf_refuses_are_refused(cfg, match):
    """These were counted (gpt2 100 / 3: 270,794 parameters; kv heads 0 as one per head) though
    transformers refuses to build them."""
    with pytest.raises(Exception):  # noqa: B017 (transformers' own errors differ by model)
        _hf_build(cfg)
    with pytest.raises(ValueError, match=match):
        from_hf_config(cfg)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (
            {**SMALL, "hidden_size": str(SMALL["hidden_size"])},
            "llama: hidden_size must be a positive int, got '",
        ),
        ({**SMALL, "hidden_size": True}, "llama: hidden_size must be a positive int, got True"),
        ({**_GPT2, "n_embd": "768"}, "gpt2: n_embd must be a positive int, got '768'"),
    ],
    ids=["llama-str", "llama-bool", "gpt2-str"],
)
def test_a_hidden_size_that_is_not_an_int_is_named(cfg, match):
    """A config.json with "hidden_size": "4096" failed with the bare TypeError "not all arguments
    converted during string formatting" (the divisibility check ran '4096' % 32), and True passed that
    check and was reported as "hidden_size True is not divisible by num_attention_heads"."""
    with pytest.raises(ValueError, match=match):
        from_hf_config(cfg)


@pytest.mark.parametrize(
    ("preset", "key", "value", "match"),
    [
        (
            "qwen3-30b-a3b",
            "decoder_sparse_step",
            0,
            "qwen3_moe: decoder_sparse_step must be a positive int, got 0",
        ),
        (
            "qwen3-30b-a3b",
            "num_hidden_layers",
            "48",
            "qwen3_moe: num_hidden_layers must be a positive int, got '48'",
        ),
        ("qwen3-30b-a3b", "num_experts", "128", "qwen3_moe: num_experts must be an int >= 0, got '128'"),
        (
            "deepseek-v3",
            "first_k_dense_replace",
            "3",
            "deepseek_v3: first_k_dense_replace must be an int >= 0, got",
        ),
        (
            "deepseek-v3",
            "num_hidden_layers",
            "61",
            "deepseek_v3: num_hidden_layers must be a positive int, got",
        ),
    ],
)
def test_the_moe_layer_plan_keys_are_checked_before_use(preset, key, value, match):
    """The layer walk of qwen3_moe and deepseek_v3 configs used these keys before any check: a
    decoder_sparse_step of 0 raised ZeroDivisionError (a traceback out of smptk plan, which reports only
    ValueError and TypeError), and a number written as a string the bare "'str' object cannot be
    interpreted as an integer" or "'<' not supported between instances of 'str' and 'int'"."""
    with pytest.raises(ValueError, match=match):
        from_hf_config({**PRESETS[preset], key: value})


def test_kv_heads_absent_or_none_is_one_per_head():
    for cfg in (
        {k: v for k, v in SMALL.items() if k != "num_key_value_heads"},
        {**SMALL, "num_key_value_heads": None},
    ):
        assert from_hf_config(cfg).num_kv_heads == SMALL["num_attention_heads"]


def test_a_checkpoint_directory_is_found_without_a_path_separator(tmp_path, monkeypatch):
    """``--model my_llama`` (a directory holding config.json) said "unknown model 'my_llama'" while
    ``./my_llama`` worked; a directory without a config.json does not hide a preset of its name."""
    (tmp_path / "my_llama").mkdir()
    (tmp_path / "my_llama" / "config.json").write_text(json.dumps(SMALL))
    (tmp_path / "llama2-7b").mkdir()  # e.g. an output directory
    (tmp_path / "my.cfg").write_text(json.dumps(SMALL))
    monkeypatch.chdir(tmp_path)
    assert model_spec("my_llama") == from_hf_config(tmp_path / "my_llama")
    assert model_spec("my.cfg") == from_hf_config(tmp_path / "my.cfg")
    assert model_spec("llama2-7b").num_parameters() == 6738415616
    with pytest.raises(ValueError, match="unknown model 'my_mistral'"):
        model_spec("my_mistral")


def test_kv_heads_must_divide_heads():
    with pytest.raises(ValueError, match="num_kv_heads 3 does not divide num_heads 4"):
        from_hf_config({**SMALL, "num_key_value_heads": 3})


@pytest.mark.parametrize("bad", [3, None, [("model_type", "llama")]])
def test_non_config_input_is_type_error(bad):
    with pytest.raises(TypeError, match="expected a Hugging Face config"):
        from_hf_config(bad)
    with pytest.raises(TypeError):
        model_spec(bad)
