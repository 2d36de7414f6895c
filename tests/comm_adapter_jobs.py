"""Per-rank jobs for ``tests/test_comm_adapters.py``: DDP and FSDP2 training with and without smptk.comm.

Each job trains two copies of the same model on the same per-rank data, one with the engine's default
collectives and one with smptk's adapters, and returns what the pytest process compares: the largest
parameter difference and how many collectives took smptk's symmetric path.
"""

from __future__ import annotations

import torch

STEPS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.Linear(33, 7))


def _train(model: torch.nn.Module, rank: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * step + rank)  # different data on every rank
        x, y = torch.randn(5, 16, generator=gen), torch.randn(5, 7, generator=gen)
        loss = (model(x) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


class _PathCounter:
    """Counts the calls of smptk.comm collectives that took the symmetric path."""

    def __init__(self, names: tuple[str, ...], paths: tuple[str, ...] = ("symmetric",)):
        import smptk.comm as comm
        import smptk.comm.adapters as adapters

        self.count = 0
        for name in names:
            original = getattr(adapters, name)

            def wrapped(*args, _original=original, **kwargs):
                out = _original(*args, **kwargs)
                self.count += comm.last_path() in paths
                return out

            setattr(adapters, name, wrapped)


def ddp(rank: int, world: int) -> dict[str, float]:
    import smptk.comm as comm
    from smptk.comm.adapters import SmptkHookState, ddp_comm_hook

    comm.configure(heap_bytes=4096, timeout_s=60, max_sms=2)  # 4 KiB heap: the buckets are chunked
    counter = _PathCounter(("all_reduce",))
    baseline = torch.nn.parallel.DistributedDataParallel(_model())
    hooked = torch.nn.parallel.DistributedDataParallel(_model())
    hooked.register_comm_hook(SmptkHookState(max_sms=3), ddp_comm_hook)
    _train(baseline, rank)
    _train(hooked, rank)
    pairs = zip(baseline.parameters(), hooked.parameters(), strict=True)
    diff = max((a - b).abs().max().item() for a, b in pairs)
    return {"max_diff": diff, "symmetric_calls": counter.count}


def fsdp2(rank: int, world: int, all_gather_sms: int | None = None) -> dict[str, float]:
    """``all_gather_sms=0``: the all-gathers take the copy-engine path, and only those are counted."""
    from torch.distributed.fsdp import fully_shard

    import smptk.comm as comm
    from smptk.comm.adapters import SmptkAllGather, SmptkReduceScatter

    comm.configure(heap_bytes=4096, timeout_s=60, max_sms=2)
    if all_gather_sms == 0:
        counter = _PathCounter(("all_gather_into_tensor",), paths=("copy_engine",))
    else:
        counter = _PathCounter(("all_gather_into_tensor", "reduce_scatter_tensor"))
    models = [_model(), _model()]
    for model in models:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    for module in [*models[1], models[1]]:
        if hasattr(module, "set_custom_all_gather"):
            module.set_custom_all_gather(SmptkAllGather(max_sms=all_gather_sms))
            module.set_custom_reduce_scatter(SmptkReduceScatter())
    for model in models:
        _train(model, rank)
    diff = max(
        (a.full_tensor() - b.full_tensor()).abs().max().item()
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True)
    )
    return {"max_diff": diff, "symmetric_calls": counter.count}


def fsdp2_copy_engine(rank: int, world: int) -> dict[str, float]:
    return fsdp2(rank, world, all_gather_sms=0)


ENGINES = {"ddp": ddp, "fsdp2": fsdp2, "fsdp2_copy_engine": fsdp2_copy_engine}


def edges(rank: int, world: int) -> dict[str, float]:
    """What the adapters meet beyond dense fp32 buckets:

    - ``sparse``: DDP over ``nn.Embedding(sparse=True)``: the hook used to refuse the sparse bucket ("must
      be contiguous"); it goes to torch's hook, and the parameters match plain DDP's;
    - ``fp16_avg`` / ``fp16_avg_rs``: the fallback's average of fp16 values of 40000 (gloo has no AVG: a
      sum, then a division) used to overflow to inf in the sum; the result must be 40000.
    """
    from smptk.comm import collectives
    from smptk.comm.adapters import SmptkHookState, ddp_comm_hook

    def embedding() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Embedding(10, 4, sparse=True)

    baseline = torch.nn.parallel.DistributedDataParallel(embedding())
    hooked = torch.nn.parallel.DistributedDataParallel(embedding())
    hooked.register_comm_hook(SmptkHookState(), ddp_comm_hook)
    for model in (baseline, hooked):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            ids = torch.tensor([rank, step, (rank + step) % 10])
            opt.zero_grad()
            model(ids).square().sum().backward()
            opt.step()
    sparse = (baseline.module.weight - hooked.module.weight).abs().max().item()
    big = torch.full((4,), 40000.0, dtype=torch.float16)
    collectives._torch_all_reduce(big, "avg", torch.distributed.group.WORLD)
    out = torch.empty(2, dtype=torch.float16)
    collectives._torch_reduce_scatter(
        out, torch.full((2 * world,), 40000.0, dtype=torch.float16), "avg", torch.distributed.group.WORLD
    )
    return {
        "sparse": sparse,
        "fp16_avg": (big.float() - 40000).abs().max().item(),
        "fp16_avg_rs": (out.float() - 40000).abs().max().item(),
    }


def all_engines(rank: int, world: int) -> dict[str, dict[str, float]]:
    """Every engine's job in turn, in one process group (spawning the ranks costs more than a job)."""
    return {**{name: job(rank, world) for name, job in ENGINES.items()}, "edges": edges(rank, world)}
