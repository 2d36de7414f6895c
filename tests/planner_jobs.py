"""The measuring side of ``tests/test_planner_validation.py``: real model states and saved activations.

Every case builds :class:`smptk.testing.transformer.Transformer` from a small :class:`ModelSpec`, applies
smptk's parallelism as the case's config says (tensor parallelism through ``parallelize``, expert
parallelism, FSDP2 through ``apply_data_parallel``, activation checkpointing), and measures on this rank:

- model states, in bytes of this rank's local tensors (``to_local()`` of DTensors: the shard a rank
  holds): the parameters, their gradients after backward, and AdamW's ``exp_avg`` + ``exp_avg_sq``
  after a step (the scalar ``step`` is not state the planner counts);
- activations, what one forward (model and loss) leaves alive for backward, counted two ways
  (:func:`measure_activations`): the tensors autograd saves, seen by ``saved_tensors_hooks`` (``hooks``),
  and the storages created during the forward that are still alive after it (``live``: a
  ``TorchDispatchMode`` keeps a weak reference to every op output's storage). The hooks cannot see
  what a checkpointed region keeps (torch's checkpoint installs its own hooks inside it, and selective
  checkpointing caches the op outputs it keeps where no hook sees them), so checkpointed runs are read
  from ``live``; with no checkpointing both are returned and must agree.

Parameters, buffers and the loss are never counted, nor FSDP2's unsharded parameters (the planner's
transient "FSDP2 gathered parameters": on a 1-rank shard group FSDP2 copies the parameters into them, so
autograd saves copies, not the parameters). A storage is counted once however many tensors
view it (q / k / v share one input; the attention output is o_proj's input). ``live`` cannot see the
forward's inputs (they exist before it), so the ones autograd saved (the token ids an embedding keeps)
are added to it from the hooks.

Each case first takes one AdamW step (its states are measured then, and anything allocated lazily on the
first step exists before the measured forward), then runs the measured forward alone (its backward would
change nothing that is counted). Multi-rank jobs (``run``, through ``tests/comm_harness.run_ranks``) run
every case of their world size in one process group; the single-process cases (``SINGLE``) run in the
pytest process on a 1-rank gloo group, with ``SMPTK_KERNELS`` chosen per phase (:func:`run_case`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import os
import warnings
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from smptk.parallel.planner import ModelSpec
from smptk.testing.transformer import ATTENTION

SEQ, MICRO_BATCH = 32, 2
# Vocabulary 126 and MLP width 90 do not divide by 4: FSDP2 pads them (rank 0 holds ceil(rows / shard)),
# which the estimate must reproduce; both still divide by the tensor-parallel degree 2.
_SHAPE = {
    "vocab_size": 126, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
    "intermediate_size": 90,
}  # fmt: skip
DENSE = ModelSpec("validation-dense", **_SHAPE)
MOE = ModelSpec(
    "validation-moe", **_SHAPE, num_experts=4, experts_per_token=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)  # fmt: skip
# Two experts: fewer per rank than the 4-rank (ep 1) or 2-rank (ep 2) shard group, so smptk shards them on
# dim 1 (expert_parallel.expert_shard_dim), which the estimate must follow.
MOE2 = dataclasses.replace(MOE, name="validation-moe2", num_experts=2)
SPECS = {"dense": DENSE, "moe": MOE, "moe2": MOE2}


def _case(
    spec: str, what: str = "activations", attention: str = "flash", sp: bool = False, **config
) -> tuple:
    """``(spec name, config, attention, sequence_parallel, what)``: "states" measures the model states,
    "activations" the measured forward too. The config is complete (the estimate takes the same dict)."""
    return (spec, {"mixed_precision": "fp32", **config}, attention, sp, what)


MODES = ("none", "full", "selective")
SINGLE = {
    **{
        f"{a}_{ac}": _case("dense", attention=a, activation_checkpointing=ac)
        for a in ATTENTION
        for ac in MODES
    },
    **{
        f"bf16_flash_{ac}": _case("dense", mixed_precision="bf16", activation_checkpointing=ac)
        for ac in MODES
    },
    **{f"moe_{ac}": _case("moe", activation_checkpointing=ac) for ac in MODES},
}
WORLD2 = {
    **{
        f"tp2{'_sp' if sp else ''}_{ac}": _case(
            "dense", sp=sp, tensor_parallel_degree=2, activation_checkpointing=ac
        )
        for sp in (False, True)
        for ac in MODES
    },
    "fsdp2": _case("dense", "states", hybrid_shard_degree=0),
    "ep2": _case("moe", "states", expert_parallel_degree=2),
}
WORLD4 = {
    "fsdp4": _case("dense", "states", hybrid_shard_degree=0),
    "hsdp2x2": _case("dense", "states", hybrid_shard_degree=2),
    "tp2_fsdp2": _case("dense", "states", tensor_parallel_degree=2),
    "ep2_dp2": _case("moe", "states", expert_parallel_degree=2),
    "ep4": _case("moe", "states", expert_parallel_degree=4),
    "fsdp4_moe2": _case("moe2", "states", hybrid_shard_degree=0),
    "ep2_dp2_moe2": _case("moe2", "states", expert_parallel_degree=2),
}
CASES = {1: SINGLE, 2: WORLD2, 4: WORLD4}
# The MoE layer runs smptk's Triton kernels on a GPU, and its PyTorch fallback keeps more for backward
# (per-expert GEMM outputs, index_add's input): the single-process MoE forwards that the estimate is
# checked on run the Triton path (Triton's interpreter on CPU; ~3 s a forward). "full" keeps only the block
# inputs and the layer's routing, the same tensors on either path, so it runs the fallback.
TRITON_MEASURED = ("moe_none", "moe_selective")


# -- measuring -----------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank stores); a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    return t.untyped_storage()


def storage_bytes(tensors) -> int:
    """Bytes of the storages under ``tensors``' local shards, each storage once: what this rank holds
    (FSDP2's padded shards, and tensors that are views of one buffer, counted as allocated)."""
    storages = {}
    for t in tensors:
        storage = _storage(t)
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class _LiveStorages(TorchDispatchMode):
    """Weak references to the storage of every op output (views included: they name their base)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and not hasattr(t, "_local_tensor"):
                self.refs.append(weakref.ref(t.untyped_storage()))
        return out


def _fsdp_params(model: torch.nn.Module) -> list:
    """The ``FSDPParam`` records of every FSDP2 module under ``model`` (torch's internals: FSDP2 has no
    public way to reach the unsharded parameters it computes on)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        out += group.fsdp_params if group is not None else []
    return out


def _unsharded(fsdp_params: list) -> set[int]:
    """Storage addresses of the allocated unsharded parameters among ``fsdp_params``."""
    tensors = (getattr(p, "_unsharded_param", None) for p in fsdp_params)
    return {_storage(t).data_ptr() for t in tensors if t is not None and _storage(t).nbytes()}


def measure_activations(model: torch.nn.Module, forward, inputs: tuple = ()) -> tuple[torch.Tensor, dict]:
    """Run ``forward()`` (-> the loss) and count what it leaves for backward (see the module docstring).

    ``inputs``: the tensors the forward reads that exist before it (ids, targets). Returns ``(loss,
    {"hooks": bytes, "live": bytes})``.
    """
    tensors = itertools.chain(model.parameters(), model.buffers())
    skip = {_storage(t).data_ptr() for t in tensors}
    older = skip | {_storage(t).data_ptr() for t in inputs}
    fsdp_params = _fsdp_params(model)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        ptr = storage.data_ptr()
        if ptr not in skip and not (fsdp_params and ptr in _unsharded(fsdp_params)):
            saved[ptr] = storage.nbytes()
        return t

    mode = _LiveStorages()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
        loss = forward()
    older.add(_storage(loss).data_ptr())
    older |= _unsharded(fsdp_params)  # the root unit's stay allocated from forward to backward
    gc.collect()
    live: dict[int, int] = {}
    for ref in mode.refs:
        storage = ref()
        if storage is not None and storage.data_ptr() not in older:
            live[storage.data_ptr()] = storage.nbytes()
    older_saved = {ptr: n for ptr, n in saved.items() if ptr not in live}  # the inputs autograd keeps
    return loss, {"hooks": sum(saved.values()), "live": sum(live.values()) + sum(older_saved.values())}


def model_states(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """This rank's bytes of parameters, gradients and AdamW moments (local shards)."""
    params = list(model.parameters())
    moments = [v for p in params for k, v in opt.state[p].items() if k != "step" and torch.is_tensor(v)]
    return {
        "parameters": storage_bytes(params),
        "gradients": storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": storage_bytes(moments),
    }


# -- cases ---------------------------------------------------------------------------------------------


def batch(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """ids ``[b, s]`` and next-token targets, the same on every rank."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (MICRO_BATCH, SEQ + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


@contextlib.contextmanager
def kernels(path: str | None):
    """``SMPTK_KERNELS=path`` inside (read at every kernel call); None leaves it as it is."""
    if path is None:
        yield
        return
    old = os.environ.get("SMPTK_KERNELS")
    os.environ["SMPTK_KERNELS"] = path
    try:
        yield
    finally:
        if old is None:
            del os.environ["SMPTK_KERNELS"]
        else:
            os.environ["SMPTK_KERNELS"] = old


def run_case(
    spec_name,
    config,
    attention,
    sp,
    what,
    *,
    step_kernels=None,
    measure_kernels=None,
    smptk_collectives=False,
) -> dict:
    """Build, parallelize and step one case on this rank; its measurements (see the module docstring).

    ``step_kernels`` / ``measure_kernels``: ``SMPTK_KERNELS`` for the training step and for the measured
    forward (None: as the environment says). ``smptk_collectives``: FSDP2 takes smptk's collectives where
    they apply (``apply_data_parallel``'s "auto"), else torch.distributed's.
    """
    import smptk.parallel as parallel
    from smptk.testing.transformer import Transformer, loss, parallelize

    spec = SPECS[spec_name]
    state = parallel.init(config)
    try:
        torch.manual_seed(0)
        model = Transformer(spec, max_seq_len=SEQ, attention=attention)
        if config["mixed_precision"] == "bf16":
            model = model.to(torch.bfloat16)
        group = None
        if state.sizes["tp"] > 1:
            parallelize(model, state.submesh("tp"), sequence_parallel=sp)
            group = state.group("tp")
        parallel.apply_activation_checkpointing(model, state)
        if state.sizes["ep"] > 1:
            parallel.apply_expert_parallel(model, state)
        if state.sizes["dp"] > 1:
            smptk = "auto" if smptk_collectives else False
            model, _ = parallel.apply_data_parallel(model, state, use_smptk_collectives=smptk)
        x, y = batch(spec)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with kernels(step_kernels):
            loss(model(x), y, group).backward()
            opt.step()
        out = {"states": model_states(model, opt)}
        if what == "activations":
            opt.zero_grad(set_to_none=True)
            with kernels(measure_kernels):
                _, out["activations"] = measure_activations(model, lambda: loss(model(x), y, group), (x, y))
        return out
    finally:
        parallel.reset()


def run(rank: int, world: int) -> dict:
    """Every case of this world size (``CASES[world]``), on this rank; on 4 ranks also the advised
    configurations (``"advised"``: :func:`run_advised`)."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use .*_single", category=FutureWarning)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    out = {name: run_case(*case) for name, case in CASES[world].items()}
    if world == ADVISED_WORLD:
        out["advised"] = run_advised()
    if world == 2:
        out["delayed_init"] = run_delayed_init()
        out["hf_tp2"] = {c: run_hf_activations(*c[:3], tp=2, sequence_parallel=c[3]) for c in HF_TP2}
    return out


# Advice round trip: what advise ranks for two tiny Hugging Face models on a 4-GPU custom cluster whose
# memory (0.56 GiB, 0.5 of it the CUDA context) leaves tensor parallelism, HSDP, full sharding, DDP and
# expert parallelism among the candidates at 8192 tokens. Each runs as a user would run it: transform with
# the candidate's config and sequence parallelism, then one AdamW step (on 16 tokens: model states do not
# depend on the sequence).
ADVISED_WORLD = 4
ADVISED_MODELS = {
    "llama": {
        "model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    },
    "mixtral": {
        "model_type": "mixtral", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2,
    },
}  # fmt: skip
ADVISED_CLUSTER = {
    "gpu": "tiny", "memory_gb": 0.56, "bf16_tflops": 1, "gpus_per_node": ADVISED_WORLD,
    "intra_node_gbps": 100, "inter_node_gbps": 10,
}  # fmt: skip


def advised(model: str) -> dict:
    """``advise``'s candidates for ``ADVISED_MODELS[model]``, one per (tp, hybrid_shard_degree, ep) (the
    checkpointing and micro-batch leave the model states as they are), keyed by that label."""
    from smptk.parallel.planner import advise, from_hf_config

    adv = advise(
        from_hf_config(ADVISED_MODELS[model]), ADVISED_CLUSTER, seq_len=8192, mixed_precision="fp32",
        heap_bytes=4096,
    )  # fmt: skip
    out = {}
    for c in adv.candidates:
        cfg = c.config
        degrees = (cfg.tensor_parallel_degree, cfg.hybrid_shard_degree, cfg.expert_parallel_degree)
        key = "{} tp {} hsd {} ep {}".format(model, *degrees)
        out.setdefault(key, c)
    return out


def run_advised() -> dict:
    """Per advised configuration: this rank's model states after one step of the transformed model."""
    import transformers

    import smptk.parallel as parallel

    out = {}
    for model in ADVISED_MODELS:
        hf = dict(ADVISED_MODELS[model])
        kind = hf.pop("model_type")
        for key, c in advised(model).items():
            torch.manual_seed(0)
            if kind == "llama":
                net = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf))
            else:
                net = transformers.MixtralForCausalLM(transformers.MixtralConfig(**hf))
            try:
                module, _ = parallel.transform(
                    net.float(), c.config, sequence_parallel=c.estimate.sequence_parallel
                )
                out[key] = _step_states(module, c.micro_batch, hf["vocab_size"])
                out[key]["head_gathered"] = out[key].pop("gathered")
            finally:
                parallel.reset()
    return out


def _step_states(module: torch.nn.Module, micro_batch: int, vocab: int) -> dict:
    """One AdamW step of a transformed Hugging Face model on ``micro_batch`` x 16 tokens; its states, and
    whether the LM head's forward read a copy of its weight (``"gathered"``: FSDP2's unsharded parameter)
    rather than the storage of the parameter the optimizer steps."""
    head = next(m for n, m in module.named_modules() if n.endswith("lm_head"))
    stepped = _storage(head.weight).data_ptr()
    used = []
    hook = head.register_forward_hook(lambda m, args, out: used.append(_storage(m.weight).data_ptr()))
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    ids = torch.randint(0, vocab, (micro_batch, 16), generator=torch.Generator().manual_seed(0))
    with kernels("torch"):
        module(ids, labels=ids).loss.backward()
        opt.step()
    hook.remove()
    return {**model_states(module, opt), "gathered": used != [stepped]}


# Delayed initialization (2 ranks): the Llama of ADVISED_MODELS built on the meta device, transformed with
# hybrid_shard_degree 1 in fp32 (replication, which DDP would run for an allocated model), materialized.
DELAYED_INIT = {"hybrid_shard_degree": 1, "mixed_precision": "fp32", "delayed_parameter_initialization": True}


def run_delayed_init() -> dict:
    """This rank's model states after one step of the delayed-initialization flow, and its engine."""
    import transformers

    import smptk.parallel as parallel

    hf = {k: v for k, v in ADVISED_MODELS["llama"].items() if k != "model_type"}
    with torch.device("meta"):
        net = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf))
    state = parallel.init(DELAYED_INIT)
    try:
        module, report = parallel.transform(net, state=state)
        parallel.materialize(module, state, allow_uninitialized=True)  # HF's norms have no reset_parameters
        states = _step_states(module, 1, hf["vocab_size"])
        return {"gathered": states.pop("gathered"), "states": states, "engine": report.data_parallel.engine}
    finally:
        parallel.reset()


# Activations of a Hugging Face Llama prepared with transform (one process, a 1-rank group, tp 1): the
# estimate counts smptk's reference transformer, and test_planner_validation checks that this model keeps
# exactly the README's stated excess over it. MICRO_BATCH 2: RoPE's tables are [1, s, d] whatever the batch.
HF_LLAMA = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
    "max_position_embeddings": SEQ,
}  # fmt: skip


def run_hf_activations(
    attention: str, checkpointing: str, mixed_precision: str, tp: int = 1, sequence_parallel: bool = False
) -> dict:
    """What one forward of ``HF_LLAMA`` (``attn_implementation=attention``) through ``transform`` leaves for
    backward (:func:`measure_activations`), after one forward and backward that allocate what is lazy;
    ``tp`` > 1 (on that many ranks): ``tensor_parallel_degree`` and transform's ``sequence_parallel``."""
    import transformers

    import smptk.parallel as parallel

    config = {
        "activation_checkpointing": checkpointing, "mixed_precision": mixed_precision,
        "tensor_parallel_degree": tp,
    }  # fmt: skip
    torch.manual_seed(0)
    net = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_LLAMA, attn_implementation=attention))
    ids = torch.randint(
        0, HF_LLAMA["vocab_size"], (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(0)
    )
    try:
        module, _ = parallel.transform(net, config, sequence_parallel=sequence_parallel)
        with kernels("torch"):
            module(ids, labels=ids).loss.backward()
            module.zero_grad(set_to_none=True)
            _, measured = measure_activations(module, lambda: module(ids, labels=ids).loss, (ids,))
        return measured
    finally:
        parallel.reset()


# The same at tp 2 in the 2-rank job, as (attention, checkpointing, mixed_precision, sequence_parallel): the
# terms tensor parallelism changes in the stated excess (the norms on the sequence block, eager's 16-bit
# softmax over this rank's heads), the first block's input under checkpointing with sequence parallelism (its
# sequence block, as every block's) and the gathered loss's bool masks (the embedding's alone), each in one
# case at least.
HF_TP2 = (
    ("sdpa", "none", "fp32", False),
    ("sdpa", "none", "fp32", True),
    ("sdpa", "full", "fp32", True),
    ("sdpa", "selective", "bf16", True),
    ("eager", "none", "bf16", False),
    ("eager", "full", "bf16", True),
)


# Symmetric heaps: a training step with smptk's collectives (tensor-parallel layers, FSDP2's all-gather and
# reduce-scatter, the MoE all-to-all) under TRITON_INTERPRET=1, where they take the heap's CPU backend.
# With ep 2 on 2 ranks dp_shard and ep are both the world group: one heap, not two.
HEAP_CASES = {
    "tp2": _case("dense", "states", sp=True, tensor_parallel_degree=2),
    "fsdp2": _case("dense", "states", hybrid_shard_degree=0),
    "ep2": _case("moe", "states", expert_parallel_degree=2),
}


def heaps(rank: int, world: int) -> dict:
    """Per case of ``HEAP_CASES``: the bytes of the symmetric-heap segments this rank allocated in one step
    (``smptk.comm.heaps()``: the segments' own sizes) and the groups' ranks."""
    from smptk import comm

    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use .*_single", category=FutureWarning)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    out = {}
    for name, case in HEAP_CASES.items():
        try:
            run_case(*case, smptk_collectives=True)
            live = comm.heaps()
            out[name] = {"bytes": sum(h["segment_bytes"] for h in live), "ranks": [h["ranks"] for h in live]}
        finally:
            comm.reset()
    return out
