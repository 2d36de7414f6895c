"""The multi-rank side of ``tests/test_fsdp.py``: ``apply_data_parallel`` training steps on 4 gloo ranks.

One job runs every case in one process group (process start-up dominates a job); each case calls
``smptk.parallel.init`` with its config, builds the model from the same seed, applies (optionally)
torch's tensor parallelism and then :func:`smptk.parallel.fsdp.apply_data_parallel`, and takes
``STEPS`` SGD-with-momentum steps. The global batch of every step is drawn from a generator seeded by
the step; data-parallel rank d trains on rows ``d*B/dp .. (d+1)*B/dp`` (tensor-parallel peers share
theirs), with the loss a mean over its rows, so the data-parallel average of the gradients is the
gradient of the mean over the global batch: the single-process step on the whole batch, which every
rank also runs on its own as the reference. Each case returns the largest difference of every parameter
(gathered whole with ``full_tensor``) from that reference, its loss per step, and the report
(what each collective was set to and the calls it made per path), for the pytest process to check.

Kernels run on the PyTorch path (``SMPTK_KERNELS=torch``, set by the test); smptk's collectives (the
data-parallel ones, and the tensor-parallel ones of smptk's layers) run on the CPU symmetric heap under
the interpreter (``TRITON_INTERPRET=1``, set by the harness).
"""

from __future__ import annotations

import logging
import math
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

STEPS = 3
BATCH, SEQ, IN, HIDDEN, FFN, OUT = 8, 3, 5, 8, 12, 3
LR, MOMENTUM = 0.1, 0.9


class Block(nn.Module):
    """A pre-norm MLP block, ``x + down(gelu(up(norm(x))))`` on ``[b, s, HIDDEN]``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyModel(nn.Module):
    """``[b, s, IN] -> [b, s, OUT]``: an input projection, 2 blocks in a ModuleList, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model() -> TinyModel:
    torch.manual_seed(0)
    return TinyModel()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, SEQ, IN, generator=gen), torch.randn(BATCH, SEQ, OUT, generator=gen)


def train(model: nn.Module, dp_rank: int, dp: int) -> list[float]:
    """STEPS steps on this data-parallel rank's rows of each global batch; the losses it saw."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = (model(x[rows]).float() - y[rows]).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def full_model(model: nn.Module) -> nn.Module:
    """The model itself, out of DDP's wrapper where there is one."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (DTensors gathered), by name, without DDP's ``module.`` prefix."""
    out = {}
    for name, p in full_model(model).named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().float().clone()
    return out


def _tp_plan(styles: str) -> dict:
    """Tensor parallelism of both blocks' MLPs: torch's styles, or smptk's layers ("smptk")."""
    if styles == "smptk":
        from smptk.parallel import SmptkColwiseParallel as Colwise
        from smptk.parallel import SmptkRowwiseParallel as Rowwise
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel as Colwise
        from torch.distributed.tensor.parallel import RowwiseParallel as Rowwise
    plan = {}
    for i in range(2):
        plan[f"blocks.{i}.up"] = Colwise()
        plan[f"blocks.{i}.down"] = Rowwise()
    return plan


# The TP x FSDP case runs torch's ColwiseParallel / RowwiseParallel, the TP x replicate case smptk's layers.
TP_STYLES = {"tp2_fsdp": "torch", "tp2_replicate": "smptk"}
# (case name, config, apply_data_parallel's keyword arguments). smptk.comm runs 1 program per collective
# unless the config says otherwise (the interpreter runs programs one after another: 8 programs took 2.8x
# the time of 1 here); reshard_after_forward=False drops the backward all-gathers (18 calls a case, not 27).
KEEP = {"reshard_after_forward": False}
CASES = (
    ("full_shard_smptk", {"hybrid_shard_degree": 0, "mixed_precision": "fp32"}, {}),
    (
        "full_shard_torch",
        {"hybrid_shard_degree": 0, "mixed_precision": "fp32"},
        {"use_smptk_collectives": False},
    ),
    (
        "hsdp_copy_engine",
        {"hybrid_shard_degree": 2, "mixed_precision": "fp32", "comm_max_sms": 0},
        {"use_smptk_collectives": True, **KEEP},
    ),
    (
        "replicate_ddp",
        {"hybrid_shard_degree": 1, "mixed_precision": "fp32", "comm_max_sms": 2},
        {"ddp_options": {"gradient_as_bucket_view": True, "bucket_cap_mb": 1}},
    ),
    ("tp2_fsdp", {"tensor_parallel_degree": 2, "hybrid_shard_degree": 0, "mixed_precision": "fp32"}, KEEP),
    ("tp2_replicate", {"tensor_parallel_degree": 2, "hybrid_shard_degree": 1, "mixed_precision": "fp32"}, {}),
    ("full_shard_bf16", {"hybrid_shard_degree": 0, "mixed_precision": "bf16"}, KEEP),
    # built on the meta device, blocks checkpointed (full recompute) with their inputs offloaded, sharded,
    # materialized, then given the reference's initial values from rank 0 (see DELAYED)
    (
        "delayed_init_ac",
        {
            "hybrid_shard_degree": 0,
            "mixed_precision": "fp32",
            "activation_checkpointing": "full",
            "sm_activation_offloading": True,
            "activation_loading_horizon": 1,
            "delayed_parameter_initialization": True,
        },
        {"use_smptk_collectives": False},
    ),
)
DELAYED = {"delayed_init_ac"}


def run(rank: int, world: int, case_names: tuple[str, ...] | None = None) -> dict:
    import smptk.comm as comm
    import smptk.parallel as parallel
    from smptk.parallel.fsdp import apply_data_parallel

    # FSDP2 warns that the root returns a view (nothing here writes to it in place); DTensor logs that
    # gathering a TP x FSDP parameter whole takes two all-gathers. Neither concerns these checks.
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    comm.configure(max_sms=1, heap_bytes=64 * 1024, timeout_s=60)  # the largest unit: 531 fp32 values
    reference = build_model()
    ref_losses = train(reference, 0, 1)
    ref = full_params(reference)
    out: dict = {"reference_losses": ref_losses}
    for name, config, kwargs in CASES:
        if case_names is not None and name not in case_names:
            continue
        t0 = time.perf_counter()
        state = parallel.init(config)
        t1 = time.perf_counter()
        if name in DELAYED:
            with torch.device("meta"):
                model = build_model()
        else:
            model = build_model()
        offloader = None
        if name in DELAYED:
            # the config's offloading, its host copies made on the CPU too (offload_cpu), under FSDP2
            horizon = state.config.activation_loading_horizon
            offloader = parallel.ActivationOffloader(horizon, offload_cpu=True)
            checkpointed = parallel.apply_activation_checkpointing(model, state, offloader=offloader)
            assert checkpointed == ["blocks.0", "blocks.1"], checkpointed
        if state.sizes["tp"] > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(model, state.submesh("tp"), _tp_plan(TP_STYLES[name]))
        model, report = apply_data_parallel(model, state, **kwargs)
        init_diff = None
        if name in DELAYED:
            assert parallel.materialize(model, state) > 0
            assert all(not p.is_meta for p in model.parameters())
            # materialize alone gives the reference's initial values (random_seed 0 = build_model's seed);
            # loading them from rank 0 then changes nothing
            got, want = full_params(model), full_params(build_model())
            init_diff = {n: (got[n] - want[n]).abs().max().item() for n in want}
            initial = build_model().state_dict() if state.rank == 0 else None
            parallel.load_full_state_dict(model, initial)
        t2 = time.perf_counter()
        losses = train(model, state.coords["dp"], state.sizes["dp"])
        t3 = time.perf_counter()
        # the last step's gradients' norms (the dp average is the reference's gradient); the head's
        # 3-row parameters leave rank 3's FSDP2 shards empty (torch's inf norm failed on those)
        grads = [p.grad for p in reference.parameters()]
        clip = {
            str(norm): (
                parallel.clip_grad_norm_(model.parameters(), 1e9, norm_type=norm).item(),
                torch.nn.utils.get_total_norm(grads, norm).item(),
            )
            for norm in (2.0, math.inf)
        }
        params = full_params(model)
        out[name] = {
            "diff": {n: (params[n] - ref[n]).abs().max().item() for n in ref},
            "init_diff": init_diff,
            "offload_log": list(offloader.log) if offloader is not None else None,
            "clip": clip,
            "params": params,
            "losses": losses,
            "mode": report.mode,
            "engine": report.engine,
            "reason": report.reason,
            "smptk": report.smptk_collectives,
            "param_dtype": report.param_dtype,
            "reduce_dtype": report.reduce_dtype,
            "heap_bytes": report.heap_bytes,
            "units": [
                (u.name, u.engine, u.num_params, u.all_gather, u.reduce_scatter, u.all_reduce, dict(u.calls))
                for u in report.units
            ],
            "describe": report.describe(),
            "up_layer": type(full_model(model).blocks[0].up).__name__,
            "ddp_options": (
                (model.gradient_as_bucket_view, model.bucket_bytes_cap) if report.engine == "ddp" else None
            ),
            "seconds": {
                "init": t1 - t0,
                "apply": t2 - t1,
                "train": t3 - t2,
                "gather": time.perf_counter() - t3,
            },
        }
    parallel.reset()
    out["clip_edges"] = clip_edges(rank, world)
    out["delayed_init"] = delayed_init_cases()
    out["inference_first"] = inference_first()
    return out


def inference_first() -> dict[str, str | None]:
    """A first forward under torch.inference_mode(), then training, under full shard and TP 2 x FSDP 2:
    {config: None, or what failed}. Torch's FSDP2 made its unsharded parameters inference tensors at that
    first forward: the TP one raised there ("Inference tensors do not track version counter"), the other
    at the next training forward ("Inplace update to inference tensor")."""
    import smptk.parallel as parallel
    from smptk.parallel.fsdp import apply_data_parallel

    out: dict[str, str | None] = {}
    for tp in (1, 2):
        state = parallel.init({"tensor_parallel_degree": tp, "mixed_precision": "fp32"})
        model = build_model()
        if tp > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(model, state.submesh("tp"), _tp_plan("smptk"))
        model, _ = apply_data_parallel(model, state)
        x, _ = batch(0)
        try:
            with torch.inference_mode():
                first = model(x)
            with torch.no_grad():
                again = model(x)
            model(x).sum().backward()
            out[f"tp{tp}"] = (
                None if torch.equal(first, again) else "inference_mode and no_grad outputs differ"
            )
        except RuntimeError as e:
            out[f"tp{tp}"] = f"{type(e).__name__}: {e}"[:300]
        parallel.reset()
    return out


def clip_edges(rank: int, world: int) -> dict:
    """smptk.parallel.clip_grad_norm_'s infinity norms where a max or min over the ranks' pieces is not
    enough: a Partial (sum) gradient whose sum's largest entry, 1.0 * world, is larger than every rank's
    piece (2.0 on rank 0), a NaN in the last rank's shard (a max or min all-reduce drops it by rank order;
    ``nonfinite_raised``: whether error_if_nonfinite raised at -inf), and a one-element gradient that
    leaves every shard but rank 0's empty (torch's -inf norm refuses an empty tensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    import smptk.parallel as parallel

    mesh = init_device_mesh("cpu", (world,))
    partial = nn.Parameter(DTensor.from_local(torch.zeros(3), mesh, [Replicate()]))
    partial.grad = DTensor.from_local(torch.tensor([1.0, -2.0 if rank == 0 else 0.0, 0.5]), mesh, [Partial()])
    plain = nn.Parameter(torch.zeros(2))
    plain.grad = torch.tensor([0.25, -0.5])
    sharded = nn.Parameter(DTensor.from_local(torch.zeros(2), mesh, [Shard(0)]))
    bad = torch.tensor([math.nan, 1.0]) if rank == world - 1 else torch.tensor([2.0, 1.0])
    sharded.grad = DTensor.from_local(bad, mesh, [Shard(0)])
    try:
        parallel.clip_grad_norm_([sharded], 1e9, norm_type=-math.inf, error_if_nonfinite=True)
        nonfinite_raised = False
    except RuntimeError:
        nonfinite_raised = True
    one = torch.tensor([-0.75]) if rank == 0 else torch.zeros(0)
    small = nn.Parameter(DTensor.from_local(torch.zeros(len(one)), mesh, [Shard(0)], shape=(1,), stride=(1,)))
    small.grad = DTensor.from_local(one, mesh, [Shard(0)], shape=(1,), stride=(1,))
    return {
        "partial_inf": parallel.clip_grad_norm_([partial, plain], 1e9, norm_type=math.inf).item(),
        "nan_inf": parallel.clip_grad_norm_([sharded], 1e9, norm_type=math.inf).item(),
        "neg_inf": parallel.clip_grad_norm_([partial, plain], 1e9, norm_type=-math.inf).item(),
        "nan_neg_inf": parallel.clip_grad_norm_([sharded], 1e9, norm_type=-math.inf).item(),
        "nonfinite_raised": nonfinite_raised,
        "empty_neg_inf": parallel.clip_grad_norm_([small], 1e9, norm_type=-math.inf).item(),
    }


class _Norm(nn.Module):
    """A hand-written norm weight with its own reset."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class _Layer(nn.Module):
    """Linears (tensor-parallel in the tp cases), torch's norms, a table shared with the model and, in the
    first layer, smptk's MoE; its reset zeroes the output projection's weight through ``.data``."""

    def __init__(self, table: torch.Tensor, moe: bool) -> None:
        import smptk.parallel as parallel

        super().__init__()
        self.norm = _Norm()
        self.q = nn.Linear(HIDDEN, HIDDEN)
        self.o = nn.Linear(HIDDEN, HIDDEN)
        self.ln = nn.LayerNorm(HIDDEN)
        self.bn = nn.BatchNorm1d(HIDDEN)
        self.register_buffer("table", table, persistent=False)
        if moe:
            self.moe = parallel.MoE(HIDDEN, FFN, num_experts=4, top_k=2, num_shared_experts=1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.o.weight.data.zero_()


class _DelayedNet(nn.Module):
    """What delayed initialization must give the eager values of: a tied, padded embedding and head, the
    layers above, a final norm, and buffers its reset fills (one of them the layers' shared table)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, HIDDEN, padding_idx=11)
        self.register_buffer("table", torch.linspace(0, 1, HIDDEN), persistent=False)
        self.register_buffer("position_ids", torch.arange(16), persistent=False)
        self.layers = nn.ModuleList([_Layer(self.table, moe=True), _Layer(self.table, moe=False)])
        self.final = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, 16, bias=False)
        self.head.weight = self.embed.weight

    def reset_parameters(self) -> None:
        self.table.copy_(torch.linspace(0, 1, HIDDEN))
        self.position_ids.copy_(torch.arange(16))


class _LoRALinear(nn.Linear):
    """Adds a parameter the inherited nn.Linear reset does not know."""

    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        self.lora_a = nn.Parameter(torch.zeros(2, n))


def delayed_init_cases() -> dict:
    """Meta build, tensor / expert / data parallelism, ``materialize``: per config, the problems found
    (every parameter and buffer gathered whole against the eager one-process build from the same seed, the
    tie, the shared table, and each parameter's storage: its local shard's bytes, nothing of the full
    tensor); and what ``materialize`` raised for a LoRA-style parameter no reset writes (its 2 rows leave
    ranks 2 and 3 an empty FSDP2 shard)."""
    from torch.distributed.tensor.parallel import parallelize_module

    import smptk.parallel as parallel

    configs = {
        "fsdp": {"hybrid_shard_degree": 0},
        "hsdp": {"hybrid_shard_degree": 2},
        "tp2_fsdp": {"tensor_parallel_degree": 2, "hybrid_shard_degree": 0},
        "ep2_fsdp": {"expert_parallel_degree": 2, "hybrid_shard_degree": 0},
        "tp2_ep2": {"tensor_parallel_degree": 2, "expert_parallel_degree": 2},
    }
    out: dict = {}
    for name, config in configs.items():
        state = parallel.init({"mixed_precision": "fp32", "random_seed": 5, **config})
        with torch.device("meta"):
            model = _DelayedNet()
        if state.sizes["tp"] > 1:
            plan = {"embed": parallel.SmptkVocabParallel(), "head": parallel.SmptkColwiseParallel()}
            for i in range(2):
                plan[f"layers.{i}.q"] = parallel.SmptkColwiseParallel()
                plan[f"layers.{i}.o"] = parallel.SmptkRowwiseParallel()
            parallelize_module(model, state.submesh("tp"), plan)
        if state.sizes["ep"] > 1:
            parallel.apply_expert_parallel(model, state)
        model, _ = parallel.apply_data_parallel(model, state)
        parallel.materialize(model, state)
        torch.manual_seed(5)
        eager = _DelayedNet()
        problems = []
        got = dict((*model.named_parameters(), *model.named_buffers(remove_duplicate=False)))
        for n, want in (*eager.named_parameters(), *eager.named_buffers(remove_duplicate=False)):
            t = got[n].full_tensor() if hasattr(got[n], "full_tensor") else got[n]
            if not torch.equal(t, want.detach()):
                problems.append(f"{n} differs from the eager build")
        if model.head.weight is not model.embed.weight:
            problems.append("head.weight is no longer embed.weight")
        if any(layer.table is not model.table for layer in model.layers):
            problems.append("the layers' table is no longer the model's")
        for n, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.untyped_storage().nbytes() != local.numel() * local.element_size():
                problems.append(
                    f"{n}: {local.untyped_storage().nbytes()} bytes stored for {tuple(local.shape)}"
                )
        out[name] = problems
        parallel.reset()
    state = parallel.init({"hybrid_shard_degree": 0, "mixed_precision": "fp32"})
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), _LoRALinear(4))
    model, _ = parallel.apply_data_parallel(model, state)
    try:
        parallel.materialize(model, state)
        out["lora"] = None
    except RuntimeError as e:
        out["lora"] = str(e)
    parallel.reset()
    return out
