"""smptk.parallel.transform on Hugging Face models (tiny random ones built from configs, no download).

In process (a 1-rank gloo group): every supported architecture, transformed under a 1-rank state with
full activation checkpointing, gives the Hugging Face model's logits, loss and parameter gradients (MoE
weights mapped back to the Hugging Face layout); the MoE swap keeps the router's renormalization rule;
``output_router_logits`` moves the load-balancing coefficient to smptk's MoE (:func:`moe_aux_loss`); a
MoE block in another layout is refused with the installed version in the message.

Multi-rank: one 2-rank and one 4-rank gloo job (``transform_jobs.py``, where each case is described): tensor
parallelism on Llama, Qwen2 (biases), Qwen3 (per-head norms), Gemma 1 / 2 / 3 (scaled embedding, extra norms)
and Mixtral, sequence parallelism on Llama, Qwen3 and Gemma 2 / 3, tied embeddings (TP 2, with sequence
parallelism, TP 2 x FSDP 2, the meta-device load), full sharding, expert parallelism, and on 4 ranks TP 2 x
FSDP 2 with sequence parallelism and TP 2 x EP 2, two training steps each against the Hugging Face model in
one process; and every bad input with its message.

Needs transformers (the ``planner-tests`` extra); the MoE architectures need the stacked-experts layout of
transformers >= 5.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys

import pytest

transformers = pytest.importorskip(
    "transformers",
    reason="transform works on Hugging Face models: install the planner-tests extra (make test installs it "
    "where a package index is reachable)",
)
import torch  # noqa: E402
import transform_jobs as jobs  # noqa: E402
from comm_harness import JobResult, run_ranks  # noqa: E402
from helpers import NO_INTERPRETER_REASON, one_rank_group  # noqa: E402
from torch import nn  # noqa: E402

import smptk.parallel as sp  # noqa: E402
from smptk.kernels import runtime  # noqa: E402

STACKED_EXPERTS = int(transformers.__version__.split(".")[0]) >= 5
OLD_LAYOUT = f"transformers {transformers.__version__} keeps MoE experts as modules; transform needs >= 5"
ALL = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite", "olmo", "exaone4"]
ALL += ["mixtral", "qwen3_moe"]


def _build(kind: str, **overrides) -> nn.Module:
    if kind in ("mistral", "qwen3"):
        torch.manual_seed(0)
        opts = {**jobs._COMMON, **overrides}
        config = transformers.MistralConfig(**opts) if kind == "mistral" else transformers.Qwen3Config(**opts)
        cls = transformers.MistralForCausalLM if kind == "mistral" else transformers.Qwen3ForCausalLM
        return cls(config).float()
    return jobs.build(kind, **overrides)


@pytest.fixture(scope="module")
def one_rank():
    with one_rank_group():
        yield
        sp.reset()


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("kind", ALL)
def test_one_rank_transform_keeps_the_model(one_rank, monkeypatch, kind: str, mode: str) -> None:
    """Logits, loss and every gradient equal the model's, under full and selective checkpointing. The
    call asks for the key-value cache: checkpointed layers would see their keys twice (selective
    checkpointing's op-by-op replay fails on it), so transform turns it off while training."""
    if not jobs.installed(kind):
        pytest.skip(f"transformers {transformers.__version__} has no model type {kind!r}")
    if kind in jobs.MOE_KINDS and not STACKED_EXPERTS:
        pytest.skip(OLD_LAYOUT)
    monkeypatch.setenv("SMPTK_KERNELS", "torch")
    model = _build(kind)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, jobs.VOCAB, (2, jobs.SEQ), generator=torch.Generator().manual_seed(1))
    config = {"mixed_precision": "fp32", "activation_checkpointing": mode}
    module, report = sp.transform(model, config)
    assert model.config.use_cache is True  # left as it is (a saved config stays the model's own)
    assert report.architecture == kind
    assert report.checkpointed == ["model.layers.0", "model.layers.1"]
    assert report.moe_layers == (
        ["model.layers.0.mlp", "model.layers.1.mlp"] if kind in jobs.MOE_KINDS else []
    )
    assert all(isinstance(m, sp.MoE) for m in module.modules() if type(m).__name__.endswith("SparseMoeBlock"))
    module(ids, labels=ids).loss.backward()  # the config's use_cache=True: off in training too
    module.zero_grad()
    out, want = module(ids, labels=ids, use_cache=True), ref(ids, labels=ids)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    want.loss.backward()
    grads = jobs.hf_named_grads(module)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.skipif(not runtime.interpreter_enabled(), reason=NO_INTERPRETER_REASON)
def test_one_rank_mixtral_on_smptk_kernels(one_rank, monkeypatch) -> None:
    """The swapped MoE blocks on smptk's Triton kernels (routing, dispatch, grouped GEMMs; the
    interpreter on a CPU): logits, loss and gradients equal the Hugging Face model's."""
    if not STACKED_EXPERTS:
        pytest.skip(OLD_LAYOUT)
    monkeypatch.setenv("SMPTK_KERNELS", "triton")  # forced: an error wherever Triton cannot run
    model = jobs.build("mixtral")
    ref = copy.deepcopy(model)
    ids = torch.randint(0, jobs.VOCAB, (2, jobs.SEQ), generator=torch.Generator().manual_seed(4))
    module, _ = sp.transform(model, {"mixed_precision": "fp32"})
    out, want = module(ids, labels=ids), ref(ids, labels=ids)
    assert module.model.layers[0].mlp.last_routing is not None
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)
    out.loss.backward()
    want.loss.backward()
    grads = jobs.hf_named_grads(module)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def _experts(gate_up=(4, 16, 8), down=(4, 8, 8), router=(4, 8), prefix="m.mlp.") -> dict[str, torch.Tensor]:
    shapes = {"experts.gate_up_proj": gate_up, "experts.down_proj": down, "gate.weight": router}
    return {prefix + k: torch.randn(v) for k, v in shapes.items() if v is not None}


def test_layout_round_trip_and_malformed_blocks() -> None:
    """``hf_layout(smptk_layout(sd))`` is ``sd``; a block missing a tensor or of the wrong rank / an odd
    stacked width raises ValueError naming it (was a bare KeyError, or a silent uneven split: w_gate 64
    rows, w_up 65), and a non-mapping a TypeError."""
    sd = {**_experts(), "m.norm.weight": torch.ones(8)}
    back = sp.hf_layout(sp.smptk_layout(sd))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    bad_hf = [
        (_experts(down=None), re.escape("gate_up_proj is there but not ['m.mlp.experts.down_proj']")),
        (_experts(router=None), re.escape("not ['m.mlp.gate.weight']")),
        (_experts(gate_up=(4, 17, 8)), r"m.mlp.experts.gate_up_proj: expected \[E, 2F, H\].*\(4, 17, 8\)"),
        (_experts(gate_up=(16, 8)), r"expected \[E, 2F, H\].*\(16, 8\)"),
    ]
    for given, text in bad_hf:
        with pytest.raises(ValueError, match=text):
            sp.smptk_layout(given)
    ours = sp.smptk_layout(_experts())
    bad_ours = [
        ({k: v for k, v in ours.items() if not k.endswith("w_up")}, re.escape("not ['m.mlp.experts.w_up']")),
        (
            {k: v for k, v in ours.items() if not k.endswith("router_weight")},
            re.escape("not ['m.mlp.router_weight']"),
        ),
        (
            {**ours, "m.mlp.experts.w_up": torch.zeros(4, 7, 8)},
            r"\(4, 8, 8\) and m.mlp.experts.w_up \(4, 7, 8\)",
        ),
    ]
    for given, text in bad_ours:
        with pytest.raises(ValueError, match=text):
            sp.hf_layout(given)
    for fn in (sp.hf_layout, sp.smptk_layout):
        with pytest.raises(TypeError, match=r"expected a \{name: tensor\} mapping, got list"):
            fn(list(sd.items()))
    with pytest.raises(TypeError, match=re.escape("m.mlp.experts.gate_up_proj: expected a tensor, got list")):
        sp.smptk_layout({**_experts(), "m.mlp.experts.gate_up_proj": [1.0]})
    with pytest.raises(TypeError, match=re.escape("m.mlp.experts.w_up: expected a tensor, got NoneType")):
        sp.hf_layout({**ours, "m.mlp.experts.w_up": None})


def test_load_hf_state_dict_without_a_process_group() -> None:
    """In one process without a process group the checked dict loads with load_state_dict (it said to
    call model.load_state_dict, which a transformed MoE model's names refuse); a wrong one is named."""
    script = """
import torch, transformers, smptk.parallel as sp
cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
torch.manual_seed(0)
a, b = transformers.MixtralForCausalLM(cfg), transformers.MixtralForCausalLM(cfg)
sp.load_hf_state_dict(b, a.state_dict())
assert all(torch.equal(p, a.state_dict()[n]) for n, p in b.state_dict().items())
try:
    sp.load_hf_state_dict(b, {k: v for k, v in a.state_dict().items() if "down_proj" not in k})
except ValueError as e:
    assert "missing ['model.layers.0.mlp.experts.down_proj']" in str(e), e
else:
    raise AssertionError("no error")
print("ok")
"""
    env = {**os.environ, "SMPTK_KERNELS": "torch"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "mixtral"])
def test_hf_state_dict_loads_into_the_stock_model(one_rank, monkeypatch, tmp_path, kind: str) -> None:
    """After a training step, the exported state dict loads strictly into a fresh Hugging Face model,
    which then computes what the transformed model computes; so does the model ``save_pretrained`` writes
    with it and ``from_pretrained`` reads back."""
    if kind in jobs.MOE_KINDS and not STACKED_EXPERTS:
        pytest.skip(OLD_LAYOUT)
    monkeypatch.setenv("SMPTK_KERNELS", "torch")
    module, _ = sp.transform(_build(kind), {"mixed_precision": "fp32"})
    ids = torch.randint(0, jobs.VOCAB, (2, jobs.SEQ), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    module(ids, labels=ids).loss.backward()
    opt.step()
    state = sp.hf_state_dict(module)
    fresh = _build(kind)
    assert set(state) == set(fresh.state_dict())
    fresh.load_state_dict(state, strict=True)
    want = module(ids).logits
    torch.testing.assert_close(fresh(ids).logits, want, rtol=1e-5, atol=1e-5)
    module.save_pretrained(tmp_path, state_dict=state)
    back = type(fresh).from_pretrained(tmp_path)
    torch.testing.assert_close(back(ids).logits, want, rtol=1e-5, atol=1e-5)


def test_hf_state_dict_of_a_tied_model_saves_as_the_stock_model(one_rank, monkeypatch, tmp_path) -> None:
    """A head tied to the embedding: ``hf_state_dict`` gives one tensor under both names, as the stock
    model's ``state_dict`` does, so ``save_pretrained`` writes the file the stock model writes (gathered
    as two copies, the head's was written a second time) and ``from_pretrained`` reads it back tied."""
    from safetensors.torch import load_file

    monkeypatch.setenv("SMPTK_KERNELS", "torch")
    stock = _build("qwen3", tie_word_embeddings=True)
    stock.save_pretrained(tmp_path / "stock")
    module, _ = sp.transform(copy.deepcopy(stock), {"mixed_precision": "fp32"})
    state = sp.hf_state_dict(module)
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    module.save_pretrained(tmp_path / "smptk", state_dict=state)
    saved, want = (
        load_file(tmp_path / "smptk" / "model.safetensors"),
        load_file(tmp_path / "stock" / "model.safetensors"),
    )
    assert sorted(saved) == sorted(want)
    back = type(stock).from_pretrained(tmp_path / "smptk")
    assert back.lm_head.weight is back.model.embed_tokens.weight
    ids = torch.arange(jobs.SEQ)[None]
    torch.testing.assert_close(back(ids).logits, stock(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_load_hf_state_dict_skips_what_from_pretrained_ignores(one_rank, monkeypatch, kind: str) -> None:
    """An old checkpoint's per-layer ``rotary_emb.inv_freq`` is skipped, as ``from_pretrained`` skips it
    (it was refused as unexpected); every other name the model lacks is still refused, ``position_ids``
    included (from_pretrained reports both as unexpected: these models have no such buffer)."""
    if kind in jobs.MOE_KINDS and not STACKED_EXPERTS:
        pytest.skip(OLD_LAYOUT)
    monkeypatch.setenv("SMPTK_KERNELS", "torch")
    stock = _build(kind)
    state = stock.state_dict()
    module, _ = sp.transform(_build(kind, initializer_range=0.5), {"mixed_precision": "fp32"})
    old = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(4) for i in range(2)}
    sp.load_hf_state_dict(module, {**state, **old})
    assert sp.hf_state_dict(module).keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in sp.hf_state_dict(module).items())
    for extra in ("model.layers.0.extra", "model.position_ids"):
        with pytest.raises(ValueError, match=re.escape(f"unexpected ['{extra}']")):
            sp.load_hf_state_dict(module, {**state, extra: torch.ones(2)})


def test_renormalization_follows_the_architecture(one_rank) -> None:
    if not STACKED_EXPERTS:
        pytest.skip(OLD_LAYOUT)
    mixtral, _ = sp.transform(jobs.build("mixtral"), {"mixed_precision": "fp32"})
    qwen, _ = sp.transform(jobs.build("qwen3_moe"), {"mixed_precision": "fp32"})  # norm_topk_prob False
    assert {m.renormalize for m in mixtral.modules() if isinstance(m, sp.MoE)} == {True}
    assert {m.renormalize for m in qwen.modules() if isinstance(m, sp.MoE)} == {False}


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_router_aux_loss_equals_hugging_faces(one_rank, monkeypatch, kind: str) -> None:
    """With output_router_logits, out.loss + moe_aux_loss(model) is the stock model's out.loss (which adds
    router_aux_loss_coef times its load-balancing loss pooled over the layers), and so are the gradients:
    the router's, through that loss, too; with a padded batch's attention mask as well."""
    if not STACKED_EXPERTS:
        pytest.skip(OLD_LAYOUT)
    monkeypatch.setenv("SMPTK_KERNELS", "torch")
    model = jobs.build(kind, output_router_logits=True, router_aux_loss_coef=0.05)
    ref = copy.deepcopy(model)
    module, _ = sp.transform(model, {"mixed_precision": "fp32"})
    assert model.config.output_router_logits is True  # left as it is: save_pretrained keeps the setting
    ids = torch.randint(0, jobs.VOCAB, (2, jobs.SEQ), generator=torch.Generator().manual_seed(2))
    out, want = module(ids, labels=ids), ref(ids, labels=ids)
    aux = sp.moe_aux_loss(module)
    assert aux.dim() == 0 and aux.item() > 0 and aux.requires_grad
    assert want.aux_loss is not None and aux.item() == pytest.approx(0.05 * want.aux_loss.item(), rel=1e-5)
    torch.testing.assert_close(out.loss + aux, want.loss, rtol=1e-6, atol=1e-6)
    (out.loss + aux).backward()
    want.loss.backward()
    grads = jobs.hf_named_grads(module)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # A padded batch: the call's attention mask leaves the padding out of the loss, as Hugging Face's does.
    ref.zero_grad()
    for p in module.parameters():
        p.grad = None
    mask = torch.ones_like(ids)
    mask[0, : jobs.SEQ // 2] = 0  # left padding
    out, want = module(ids, attention_mask=mask, labels=ids), ref(ids, attention_mask=mask, labels=ids)
    aux = sp.moe_aux_loss(module)
    assert aux.item() == pytest.approx(0.05 * want.aux_loss.item(), rel=1e-5)
    unmasked = module(ids, labels=ids)  # the mask is the call's: a call without one counts every token
    assert sp.moe_aux_loss(module).item() != pytest.approx(aux.item(), rel=1e-3)
    (out.loss + aux).backward()
    want.loss.backward()
    grads = jobs.hf_named_grads(module)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert unmasked.loss.isfinite()
    module(ids, attention_mask=torch.zeros_like(ids), labels=ids)
    assert sp.moe_aux_loss(module).item() == 0.0  # padding only
    causal = torch.tril(torch.ones(jobs.SEQ, jobs.SEQ, dtype=torch.bool))[None, None].expand(2, 1, -1, -1)
    module(ids, attention_mask=causal, labels=ids)  # a 4-D mask: no entry per token to weigh it by
    S = jobs.SEQ
    message = rf"attention_mask \(2, 1, {S}, {S}\) has {2 * S * S} .*routed {2 * S} "
    with pytest.raises(ValueError, match=message):
        sp.moe_aux_loss(module)
    dense, _ = sp.transform(jobs.build("llama"), {"mixed_precision": "fp32"})
    assert sp.moe_aux_loss(dense).item() == 0.0
    # Asked per call, the router logits do not exist: a clear error, not an IndexError inside transformers.
    with pytest.raises(ValueError, match=r"output_router_logits=True.*moe_aux_loss"):
        module(ids, labels=ids, output_router_logits=True)
    assert module(ids, labels=ids, output_router_logits=False).loss.isfinite()


def test_ddp_options_reach_apply_data_parallel(one_rank) -> None:
    """transform passes ddp_options on: one rank runs on FSDP2, where they are refused by name."""
    with pytest.raises(
        ValueError, match=r"ddp_options \['find_unused_parameters'\]: this model runs on FSDP2"
    ):
        sp.transform(
            jobs.build("llama"), {"mixed_precision": "fp32"}, ddp_options={"find_unused_parameters": True}
        )


def test_transform_twice_is_refused(one_rank, monkeypatch) -> None:
    """A second transform of the same model said "no embed_tokens + layers ... not one of the supported
    decoder layouts" (the embedding had become smptk's) or failed inside torch; now it names the cause and
    leaves the model as the first call made it."""
    monkeypatch.setenv("SMPTK_KERNELS", "torch")
    model = jobs.build("llama")
    with pytest.raises(TypeError, match="sequence_parallel: expected a bool"):  # refused: left as it was
        sp.transform(model, {"mixed_precision": "fp32"}, sequence_parallel="yes")
    module, _ = sp.transform(model, {"mixed_precision": "fp32"})  # so a corrected call converts it
    ids = torch.randint(0, jobs.VOCAB, (2, jobs.SEQ), generator=torch.Generator().manual_seed(4))
    before = module(ids, labels=ids).loss
    with pytest.raises(ValueError, match="transform has run on this model already"):
        sp.transform(module, {"mixed_precision": "fp32"})
    assert module(ids, labels=ids).loss.item() == before.item()


def test_moe_block_in_another_layout_is_refused(one_rank) -> None:
    model = jobs.build("llama")
    model.config.model_type = "mixtral"

    class ModuleListExperts(nn.Module):  # transformers 4's layout: experts as a ModuleList, no gate_proj
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(32, 4, bias=False)
            self.experts = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

    model.model.layers[1].mlp = ModuleListExperts()
    with pytest.raises(NotImplementedError, match=r"layer 1 has neither a dense MLP.*installed: "):
        sp.transform(model, {"mixed_precision": "fp32"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"router_jitter_noise": 0.1}, "router_jitter_noise 0.1"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_refused_moe_leaves_the_model_as_it_was(one_rank, overrides: dict, message: str) -> None:
    if not STACKED_EXPERTS:
        pytest.skip(OLD_LAYOUT)
    model = jobs.build("mixtral", **overrides)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(NotImplementedError, match=message):
        sp.transform(model, {"mixed_precision": "fp32"})
    assert dict(model.named_parameters()).keys() == before.keys()
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"


def test_unsupported_architecture_lists_the_supported(one_rank) -> None:
    with pytest.raises(
        NotImplementedError,
        match="supported: llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, granite, olmo, exaone4, "
        "mixtral, qwen3_moe",
    ):
        sp.transform(nn.Linear(2, 2), {"mixed_precision": "fp32"})


# ------------------------------------------------------------------------------------------ multi-rank

_jobs: dict[int, JobResult] = {}


def job(world: int) -> JobResult:
    if world not in _jobs:
        _jobs[world] = run_ranks("transform_jobs:run", world, timeout_s=300, env={"TRITON_INTERPRET": "0"})
    return _jobs[world]


@pytest.mark.parametrize(
    ("world", "case"), [(2, c) for c in jobs.CASES] + [(4, c) for c in jobs.CASES_4], ids=lambda v: str(v)
)
def test_multi_rank(world: int, case: str) -> None:
    if case in jobs.MOE_CASES + jobs.MOE_CASES_4 and not STACKED_EXPERTS:
        pytest.skip(OLD_LAYOUT)
    arch = jobs.NEWER_ARCHITECTURES.get(case)
    if arch is not None and not jobs.installed(arch):
        pytest.skip(f"transformers {transformers.__version__} has no model type {arch!r}")
    result = job(world)
    result.raise_for_failure()
    problems = [f"rank {r}: {v[case]}" for r, v in enumerate(result.values) if v[case] is not None]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_a_stock_model_turns_its_cache_off_in_training(monkeypatch, mode: str) -> None:
    """apply_activation_checkpointing on a stock Hugging Face model (use_cache on by default): the units'
    recompute would feed the key-value cache twice (selective failed in backward with torch's "not found
    in storage"); the modules around the units pass use_cache=False while training, so the gradients
    equal the plain model's, and an eval forward keeps its cache."""
    monkeypatch.setenv("SMPTK_KERNELS", "torch")
    plain = jobs.build("llama")
    model = copy.deepcopy(plain)
    assert model.config.use_cache
    assert len(sp.apply_activation_checkpointing(model, mode=mode)) == len(model.model.layers)
    ids = torch.randint(0, jobs.VOCAB, (2, jobs.SEQ), generator=torch.Generator().manual_seed(3))
    model(ids, labels=ids).loss.backward()
    plain(ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    model.eval()
    assert model(ids).past_key_values is not None


def test_materialize_refills_the_rotary_tables_of_a_meta_built_model(one_rank) -> None:
    """Built on meta, transformed and materialized for a checkpoint load (``allow_uninitialized``): the
    rotary modules' ``inv_freq`` tables (no ``reset_parameters``, and not in a DCP checkpoint) were left
    NaN, so the resumed model's loss was NaN; materialize now computes them from the config, equal to the
    eager model's."""
    eager = _build("llama")
    with torch.device("meta"):
        lazy = _build("llama")
    lazy, _ = sp.transform(lazy, {"mixed_precision": "fp32"})
    sp.materialize(lazy, allow_uninitialized=True)
    want = dict(eager.named_buffers())
    got = {n: b for n, b in lazy.named_buffers() if "rotary" in n}
    assert got and all(torch.equal(b, want[n]) for n, b in got.items()), got


@pytest.mark.skipif(not STACKED_EXPERTS, reason=OLD_LAYOUT)
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_materialize_gives_a_transformed_moe_the_eager_values(one_rank, kind: str) -> None:
    """Built on meta, transformed and materialized for training from scratch: the MoE that replaced each
    sparse block kept its own reset (router std 0.02, experts uniform: std 0.10 at this size, where Hugging
    Face's _init_weights draws std 0.02), and its draws shifted every later tensor's; now the whole model,
    MoE blocks included, equals the eager build from the same seed."""
    sizes = {"num_experts_per_tok": 2, "moe_intermediate_size": 24}
    sizes["num_local_experts" if kind == "mixtral" else "num_experts"] = 4
    problems: list[str] = []
    jobs._meta_fresh(problems, kind, {}, **sizes)
    assert not problems, "\n".join(problems)


def test_frozen_moe_weights_stay_frozen(one_rank) -> None:
    """A Mixtral whose first layer's experts and router are frozen (requires_grad False): the swapped-in
    MoE's weights came back trainable (they trained and counted in the gradient norm); now each keeps its
    source's flag, and the unfrozen layer's stay trainable."""
    if not STACKED_EXPERTS:
        pytest.skip(OLD_LAYOUT)
    model = jobs.build("mixtral")
    for p in model.model.layers[0].mlp.parameters():
        p.requires_grad_(False)
    module, _ = sp.transform(model, {"mixed_precision": "fp32"})
    frozen, trained = module.model.layers[0].mlp, module.model.layers[1].mlp
    assert [p.requires_grad for p in frozen.parameters()] == [False] * 4
    assert [p.requires_grad for p in trained.parameters()] == [True] * 4
