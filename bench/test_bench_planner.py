"""Benchmark: the memory planner's prediction against a real training step's peak memory (GPU only).

A ~1B Llama-shaped model (:data:`SPEC`: smptk's reference transformer, :mod:`smptk.testing.transformer`)
trains on one GPU the way smptk sets a run up: ``smptk.parallel.init`` with bf16 mixed precision (world 1),
:func:`smptk.parallel.apply_activation_checkpointing` as the case asks, :func:`smptk.parallel.
apply_data_parallel` (FSDP2 over a 1-rank mesh: fp32 sharded parameters, bf16 compute, fp32 gradients)
and AdamW. After two warm-up steps (the optimizer's states exist from the first), the peak of
``torch.cuda.max_memory_allocated`` over one more step is compared with
:func:`smptk.parallel.planner.estimate_memory` for the same model, config, sequence and micro-batch,
less the allocator margin (``max_memory_allocated`` counts allocations, not the caching allocator's
reserve, which ``max_memory_reserved`` and the margin cover). The row carries both numbers, the
per-term prediction and ``memory_error_pct = 100 * |predicted - measured| / measured``; the target
``planner.memory_error_1b`` asks for <= 10%. The step is timed too (``time_s``), not judged.

On a CPU there is no allocator peak to read: the case skips, saying so (tests/test_planner_validation.py
checks the same terms on CPU against the tensors autograd keeps).

Select with ``-k``: ids read ``planner-<checkpointing>``, e.g. ``python -m bench --filter planner``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from bench.config import current_mode
from bench.timing import CLOCK
from smptk.parallel.planner import ModelSpec, estimate_memory

pytestmark = pytest.mark.benchmark(timer=CLOCK, disable_gc=True, warmup=False)

MODE = current_mode()
SUITE = "planner"
# ~0.98B parameters: Llama's shape at 2048 hidden, 18 layers, GQA 16 / 8 heads of 128, SwiGLU 5632.
SPEC = ModelSpec(
    "llama-1b (reference transformer)", vocab_size=32000, hidden_size=2048, num_layers=18, num_heads=16,
    num_kv_heads=8, head_dim=128, intermediate_size=5632,
)  # fmt: skip
SEQ, MICRO_BATCH = (4096, 2) if not MODE.quick else (256, 1)


@dataclasses.dataclass(frozen=True)
class MemoryCase:
    checkpointing: str

    @property
    def id(self) -> str:
        return f"{SUITE}-{self.checkpointing}"

    def fields(self) -> dict[str, Any]:
        return {
            "suite": SUITE,
            "op": "train_step_memory",
            "impl": "reference_transformer",
            "pass": "fwd+bwd+adamw",
            "config": self.checkpointing,
            "dtype": "bfloat16",
            "world": 1,
            "shape": {"params": SPEC.num_parameters(), "seq": SEQ, "micro_batch": MICRO_BATCH},
        }


CASES = [MemoryCase(mode) for mode in ("none", "selective", "full")]


_OWN_GROUP: list[bool] = []  # whether _setup made the process group (then the module fixture ends it)


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group() -> Any:
    """After this suite: smptk.parallel's state reset and the one-rank NCCL group _setup made destroyed,
    so later suites in the same benchmark process inherit neither (an open NCCL group also warns, or
    hangs, at exit)."""
    yield
    if _OWN_GROUP:
        import torch.distributed as dist

        import smptk.parallel as sp

        sp.reset()
        if dist.is_initialized():
            dist.destroy_process_group()
        _OWN_GROUP.clear()


def _setup(case: MemoryCase):
    import torch.distributed as dist

    import smptk.parallel as sp
    from smptk.testing.transformer import Transformer, loss

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        _OWN_GROUP.append(True)
    sp.reset()
    config = {"mixed_precision": "bf16", "activation_checkpointing": case.checkpointing}
    state = sp.init(config)
    torch.manual_seed(0)
    model = Transformer(SPEC, max_seq_len=SEQ, device="cuda")
    sp.apply_activation_checkpointing(model, state)
    model, _ = sp.apply_data_parallel(model, state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, SPEC.vocab_size, (MICRO_BATCH, SEQ + 1), device="cuda")

    def step() -> None:
        loss(model(ids[:, :-1]), ids[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return config, step


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_planner_memory(benchmark: Any, case: MemoryCase, record: Callable[..., Any]) -> None:
    if MODE.device != "cuda":
        pytest.skip("the planner's GPU validation reads torch.cuda.max_memory_allocated: it needs a GPU")
    config, step = _setup(case)
    step()
    step()  # AdamW's states now exist; the next step is the steady state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    est = estimate_memory(SPEC, config, seq_len=SEQ, micro_batch=MICRO_BATCH, world_size=1)
    margin = est.bytes_of("margin")
    predicted = est.total_bytes - margin
    benchmark.group = SUITE
    benchmark.pedantic(step, rounds=MODE.rounds, warmup_rounds=0)
    record(
        benchmark,
        flops=0,
        nbytes=0,
        measured_bytes=measured,
        reserved_bytes=reserved,
        predicted_bytes=predicted,
        predicted_with_margin_bytes=est.total_bytes,
        memory_error_pct=100 * abs(predicted - measured) / measured,
        terms={t.name: t.bytes for t in est.terms},
        path="smptk.parallel: init, apply_activation_checkpointing, apply_data_parallel (FSDP2, bf16), AdamW",
        kernel_path="smptk kernels (as selected)",
    )
    del step
    torch.cuda.empty_cache()
