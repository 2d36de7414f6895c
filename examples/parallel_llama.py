"""A small Llama-shaped model trained with tensor parallelism x sharded data parallelism under torchrun.

The model (built from ``MODEL`` below, no download): vocab-parallel embedding, ``layers`` blocks of
RMSNorm -> attention (RoPE, grouped-query heads, ``F.scaled_dot_product_attention``) and RMSNorm ->
SwiGLU MLP, a final RMSNorm and a vocab-parallel LM head whose sharded logits go straight into
``vocab_parallel_cross_entropy`` (no rank holds the full ``[b, s, vocab]`` logits). How it is split:

- ``smptk.parallel.init`` builds the mesh ``(dp_replicate, dp_shard, tp)`` from the config;
- ``parallelize_module`` with smptk's styles over ``tp``: column-parallel q / k / v and gate / up (each rank
  computes ``heads / tp`` heads and ``ffn / tp`` features), row-parallel o and down (their all-reduce
  restores the replicated hidden state), vocab-parallel embedding and head;
- ``apply_data_parallel`` shards every block, then the root, with FSDP2 over ``(dp_replicate, dp_shard)``
  (``hybrid_shard_degree`` 0: shard over all data-parallel ranks; k: shard within groups of k, replicate
  across them; 1: replicate);
- AdamW trains it on a synthetic next-token task (``x[t+1] = (5 x[t] + 3) mod vocab``, random starts:
  learnable, so the loss falls); each data-parallel rank takes an equal share of the global batch (the
  data-parallel size must divide its rows).

Checkpoints: after ``--save-at`` steps the run saves model and optimizer (and, in fp16, the loss scaler)
with ``smptk.parallel.dcp.save_checkpoint`` (torch.distributed.checkpoint, one shard file per rank) into
``--ckpt-dir``/step<N> and trains on. Then it builds a fresh model from another seed, loads that
checkpoint and trains the same steps again: the losses must match the first pass (exactly in fp32), and
a loss that is not finite on either pass is a mismatch. Without ``--ckpt-dir`` the checkpoint goes to a
temporary directory, removed at the end. ``--resume`` instead trains ``--steps`` steps from the
checkpoint step<N> in ``--ckpt-dir`` with the highest N, under whatever config this run has
(checkpoints reshard), and saves none. It picks by step number, not by time: in a directory that several
runs share, the checkpoint furthest into training wins, whichever run wrote it last.

A ``--config`` file (in place of ``--tp`` / ``--hybrid-shard``) may set any key of
:class:`smptk.parallel.ParallelConfig`, and the keys it leaves out take ParallelConfig's defaults:
``mixed_precision`` "bf16", on a CPU too, where ``--tp`` trains in fp32 (the first line printed says which
precision runs). ``activation_checkpointing`` (with ``sm_activation_offloading``) and
``delayed_parameter_initialization`` apply to the model (see ``build``); with ``mixed_precision`` "fp16"
the loss is scaled with torch's ``ShardedGradScaler`` (README, ``mixed_precision``), whose state the
checkpoint keeps.

Run (CPU: gloo and PyTorch kernels; GPUs: NCCL, bf16 parameters with fp32 reduction)::

    torchrun --standalone --nproc-per-node 2 examples/parallel_llama.py --tp 2
    torchrun --standalone --nproc-per-node 4 examples/parallel_llama.py --tp 2 --ckpt-dir /tmp/llama
    torchrun --standalone --nproc-per-node 2 examples/parallel_llama.py --tp 1 --ckpt-dir /tmp/llama --resume
    torchrun --standalone --nproc-per-node 8 examples/parallel_llama.py --tp 2 --hybrid-shard 2   # TP x HSDP
    torchrun --standalone --nproc-per-node 4 examples/parallel_llama.py --config my_config.json

On a CPU the kernels take smptk's PyTorch path (``SMPTK_KERNELS=torch``) unless ``TRITON_INTERPRET`` is
set, which runs the Triton kernels in the interpreter (correct, and far slower).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    # smptk picks its kernel path when smptk.kernels is imported: this must come first.
    os.environ.setdefault("SMPTK_KERNELS", "torch")

import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor.parallel import parallelize_module

import smptk.parallel as sp
from smptk.kernels import runtime
from smptk.parallel.dcp import EXTRA_KEY, checkpoint_keys, load_checkpoint, save_checkpoint
from smptk.parallel.fsdp import apply_data_parallel

# The model: Llama's shape at toy size. heads and kv_heads must be divisible by the tensor-parallel degree,
# and so must ffn and vocab.
MODEL = {
    "vocab": 256,
    "hidden": 64,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "ffn": 128,
    "rope_theta": 10000.0,
    "norm_eps": 1e-5,
}
SEQ, BATCH = 32, 8  # global batch: BATCH sequences of SEQ + 1 tokens per step


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim, computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(seq: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[seq, head_dim / 2]`` for rotary embeddings (rotating pairs ``(x[2i], x[2i+1])``)."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, s, h, head_dim]`` by position; cos / sin ``[s, head_dim / 2]``."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention. Under TP each rank holds ``heads / tp`` query heads and
    ``kv_heads / tp`` key / value heads (column-parallel q, k, v), and o_proj sums the ranks' parts."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h, d = cfg["hidden"], cfg["hidden"] // cfg["heads"]
        self.head_dim = d
        self.q_proj = nn.Linear(h, cfg["heads"] * d, bias=False)
        self.k_proj = nn.Linear(h, cfg["kv_heads"] * d, bias=False)
        self.v_proj = nn.Linear(h, cfg["kv_heads"] * d, bias=False)
        self.o_proj = nn.Linear(cfg["heads"] * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Local head counts come from the local output widths, so the same code runs at any tp.
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = q.shape[2] // k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, head_dim]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; gate / up column-parallel, down row-parallel."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg["hidden"], cfg["ffn"], bias=False)
        self.up_proj = nn.Linear(cfg["hidden"], cfg["ffn"], bias=False)
        self.down_proj = nn.Linear(cfg["ffn"], cfg["hidden"], bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg["hidden"], cfg["norm_eps"])
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg["hidden"], cfg["norm_eps"])
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """ids ``[b, s]`` -> logits ``[b, s, vocab]`` (``[b, s, vocab / tp]``, vocab-sharded, under TP)."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab"], cfg["hidden"])
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg["layers"])])
        self.norm = RMSNorm(cfg["hidden"], cfg["norm_eps"])
        self.lm_head = nn.Linear(cfg["hidden"], cfg["vocab"], bias=False)
        self.cfg = cfg
        cos, sin = rope_tables(SEQ, cfg["hidden"] // cfg["heads"], cfg["rope_theta"])
        self.register_buffer("rope_cos", cos, persistent=False)  # derived: not in checkpoints
        self.register_buffer("rope_sin", sin, persistent=False)

    def reset_parameters(self) -> None:
        """The rotary tables again: ``materialize`` (delayed initialization) allocates buffers empty."""
        cos, sin = rope_tables(SEQ, self.cfg["hidden"] // self.cfg["heads"], self.cfg["rope_theta"])
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def tp_plan(layers: int) -> dict:
    """smptk's ParallelStyles for every linear and the embedding (module names as in the HF Llama)."""
    plan = {"embed_tokens": sp.SmptkVocabParallel(), "lm_head": sp.SmptkColwiseParallel()}
    for i in range(layers):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = sp.SmptkColwiseParallel()
        plan[f"layers.{i}.attn.o_proj"] = sp.SmptkRowwiseParallel()
        plan[f"layers.{i}.mlp.down_proj"] = sp.SmptkRowwiseParallel()
    return plan


def check_model_config(cfg: dict, tp: int, dp: int) -> None:
    for key in ("heads", "kv_heads", "ffn", "vocab"):
        if cfg[key] % tp:
            raise ValueError(f"MODEL[{key!r}] {cfg[key]} is not divisible by tensor_parallel_degree {tp}")
    if BATCH % dp:  # uneven rows: equal-weight gradient averaging would train another model
        raise ValueError(
            f"the {dp} data-parallel ranks do not divide the global batch of {BATCH} rows (each takes an "
            "equal share): use a data-parallel size that divides it"
        )
    if cfg["heads"] % cfg["kv_heads"] or cfg["hidden"] % cfg["heads"]:
        raise ValueError("MODEL: heads must divide hidden, and kv_heads must divide heads")


def build(state, device: torch.device, seed: int, lr: float):
    """The parallelized model, its AdamW, a ``ShardedGradScaler`` (enabled in fp16 only: its overflow
    check is all-reduced over the world, so every rank skips the same steps) and the data-parallel report;
    parameters drawn from ``seed`` (the same on every rank).

    The config's ``activation_checkpointing`` (with ``sm_activation_offloading``) applies to the blocks;
    with ``delayed_parameter_initialization`` the model is built on the meta device, parallelized there,
    and ``materialize`` then gives each rank its shards, drawn from ``random_seed`` (not ``seed``).
    """
    delayed = state.config.delayed_parameter_initialization
    torch.manual_seed(seed)
    with torch.device("meta") if delayed else device:
        model = Llama(MODEL)
    parallelize_module(model, state.submesh("tp"), tp_plan(MODEL["layers"]))
    blocks = sp.apply_activation_checkpointing(model, state)
    model, report = apply_data_parallel(model, state)
    if delayed:
        sp.materialize(model, state, device=device)
    if blocks:
        say(f"activation checkpointing ({state.config.activation_checkpointing}): {len(blocks)} blocks")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scaler = ShardedGradScaler(device.type, enabled=state.config.mixed_precision == "fp16")
    return model, opt, scaler, report


def scaler_extra(scaler: ShardedGradScaler, path: str | None = None) -> dict | None:
    """``extra`` for ``save_checkpoint`` / ``load_checkpoint``: the fp16 loss scale, which a resume needs to
    skip and scale as the first pass did. None without a scaler, or to load a checkpoint ``path`` that holds
    none (saved by a bf16 / fp32 run: the scaler starts from its initial scale)."""
    if not scaler.is_enabled():
        return None
    if path is not None and f"{EXTRA_KEY}.grad_scaler" not in checkpoint_keys(path):
        say(f"{path} holds no loss scale (saved without fp16): the scaler starts from its initial scale")
        return None
    return {"grad_scaler": scaler}


def global_batch(step: int, vocab: int) -> torch.Tensor:
    """``[BATCH, SEQ + 1]`` token ids of step ``step``: ``x[t+1] = (5 x[t] + 3) mod vocab``, random starts,
    every 8th token random (so the task is learnable but not trivial)."""
    gen = torch.Generator().manual_seed(10_000 + step)
    x = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (BATCH,), generator=gen)
    noise = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    for t in range(SEQ):
        x[:, t + 1] = (5 * x[:, t] + 3) % vocab
        if (t + 1) % 8 == 0:
            x[:, t + 1] = noise[:, t + 1]
    return x


def train(model, opt, scaler, state, device, steps: range) -> list[float]:
    """One AdamW step per entry of ``steps`` (fp16: skipped where ``scaler`` finds an overflow); returns the
    loss of each, averaged over the dp ranks."""
    dp, d = state.sizes["dp"], state.coords["dp"]
    rows = slice(d * BATCH // dp, (d + 1) * BATCH // dp)
    losses = []
    for step in steps:
        tokens = global_batch(step, MODEL["vocab"])[rows].to(device)
        logits = model(tokens[:, :-1])  # [b, s, vocab / tp]
        loss = sp.vocab_parallel_cross_entropy(logits, tokens[:, 1:], group=state.group("tp"))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # scaling, unscaling and the overflow check: fp16 only
        scaler.step(opt)
        scaler.update()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=state.group("dp"))  # the same on every tp rank: count one per dp rank
        losses.append(mean.item() / dp)
        say(f"step {step:3d}  loss {losses[-1]:.6f}")
    return losses


def say(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def latest_checkpoint(ckpt_dir: str) -> tuple[str, int]:
    """The path and N of the ``step<N>`` directory in ``ckpt_dir`` with the highest N. By step, not by
    modification time: a copy keeps the step and loses the time, and the furthest checkpoint is the one to
    continue from."""
    steps = [int(p.name[4:]) for p in Path(ckpt_dir).glob("step*") if p.name[4:].isdigit()]
    if not steps:
        raise FileNotFoundError(f"--resume: no step<N> checkpoint in --ckpt-dir {ckpt_dir!r}")
    return os.path.join(ckpt_dir, f"step{max(steps)}"), max(steps)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, help="tensor_parallel_degree (default 1; not with --config)")
    p.add_argument(
        "--hybrid-shard", type=int,
        help="hybrid_shard_degree: 0 full shard (default), 1 replicate, k HSDP; not with --config",
    )  # fmt: skip
    p.add_argument(
        "--config",
        help="a ParallelConfig JSON file, in place of --tp / --hybrid-shard; keys it leaves out take "
        'ParallelConfig\'s defaults (mixed_precision "bf16", on a CPU too)',
    )
    p.add_argument(
        "--steps", type=int, default=8, help="optimizer steps (default 8; at least 2 without --resume)"
    )
    p.add_argument(
        "--save-at", type=int,
        help="save a checkpoint after this many steps, 0 < save-at < steps (default steps / 2); not with "
        "--resume",
    )  # fmt: skip
    p.add_argument(
        "--ckpt-dir",
        help="checkpoint directory (default: a temporary directory, removed at the end of the run)",
    )
    p.add_argument(
        "--resume", action="store_true",
        help="train --steps steps from the checkpoint step<N> in --ckpt-dir with the highest N (by step, not "
        "by time: in a directory several runs share, the furthest checkpoint), saving none",
    )  # fmt: skip
    p.add_argument(
        "--lr", type=float, default=3e-3,
        help="AdamW's learning rate (default 3e-3); a --resume run keeps the checkpoint's",
    )  # fmt: skip
    args = p.parse_args(argv)
    flags = [f"--{f.replace('_', '-')}" for f in ("tp", "hybrid_shard") if getattr(args, f) is not None]
    if args.config and flags:
        p.error(
            f"--config and {' / '.join(flags)} together: the flags would be ignored; set "
            "tensor_parallel_degree / hybrid_shard_degree in the config file"
        )
    args.tp = 1 if args.tp is None else args.tp
    args.hybrid_shard = 0 if args.hybrid_shard is None else args.hybrid_shard
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    if args.resume and args.save_at is not None:
        p.error(f"--save-at {args.save_at} with --resume: a resumed run saves no checkpoint")
    if args.steps < 1:
        p.error(f"--steps {args.steps}: expected at least 1")
    if not args.resume and args.save_at is None and args.steps < 2:
        p.error(f"--steps {args.steps}: saving and resuming mid-run needs at least 2 (or pass --resume)")
    if args.save_at is not None and not 0 < args.save_at < args.steps:
        p.error(f"--save-at {args.save_at}: expected 0 < save-at < --steps {args.steps}")
    if args.ckpt_dir and os.path.exists(args.ckpt_dir) and not os.path.isdir(args.ckpt_dir):
        p.error(f"--ckpt-dir {args.ckpt_dir}: exists and is not a directory")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        sys.exit("launch with torchrun: torchrun --standalone --nproc-per-node 2 examples/parallel_llama.py")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        if args.config:
            config = sp.ParallelConfig.from_json(args.config)
        else:
            config = {
                "tensor_parallel_degree": args.tp,
                "hybrid_shard_degree": args.hybrid_shard,
                # bf16 parameters / fp32 reduction on GPUs; fp32 on a CPU, where resume is then bit-exact.
                "mixed_precision": "bf16" if device.type == "cuda" else "fp32",
            }
        state = sp.init(config)
        check_model_config(MODEL, state.sizes["tp"], state.sizes["dp"])
        temporary = args.ckpt_dir is None  # this run's own directory: removed at the end
        holder = [
            args.ckpt_dir or (tempfile.mkdtemp(prefix="parallel_llama-") if dist.get_rank() == 0 else None)
        ]
        dist.broadcast_object_list(holder, src=0)  # every rank writes its shard into the same directory
        try:
            code = run(args, state, device, holder[0])
            dist.barrier()  # before the exit (README: "Ending a job") and the removal; not after an error
        finally:
            if temporary and dist.get_rank() == 0:
                shutil.rmtree(holder[0], ignore_errors=True)
        if temporary:
            say(f"removed the temporary checkpoint directory {holder[0]} (--ckpt-dir keeps one)")
        return code
    finally:
        sp.reset()
        dist.destroy_process_group()


def compare_resumed(rest: list[float], again: list[float], tol: float) -> tuple[float, bool]:
    """The largest ``|again - rest|`` over the steps both passes trained, and whether it is within ``tol``.
    A loss that is not finite on either side makes it nan, a mismatch (``max`` may drop a nan, and
    ``nan <= tol`` is False where ``nan > tol`` is too)."""
    if not all(math.isfinite(v) for v in rest + again):
        return math.nan, False
    diff = max(abs(a - b) for a, b in zip(again, rest, strict=True))
    return diff, diff <= tol


def run(args, state, device, ckpt_dir: str) -> int:
    sizes = ", ".join(f"{k} {state.sizes[k]}" for k in ("tp", "dp_replicate", "dp_shard"))
    precision = state.config.mixed_precision
    say(
        f"parallel_llama: world {state.world_size} ({sizes}), {device.type}, mixed_precision {precision}"
        f"{' (loss scaled by ShardedGradScaler)' if precision == 'fp16' else ''}, "
        f"kernels {runtime.requested_path()}"
    )
    model, opt, scaler, report = build(state, device, seed=state.config.random_seed, lr=args.lr)
    say(report.describe().splitlines()[0])
    if args.resume:
        path, start = latest_checkpoint(ckpt_dir)
        loaded = load_checkpoint(path, model, opt, extra=scaler_extra(scaler, path))
        say(f"resumed from {path} (saved after {loaded} steps)")
        train(model, opt, scaler, state, device, range(start, start + args.steps))
        return 0

    save_at = args.save_at if args.save_at is not None else args.steps // 2
    first = train(model, opt, scaler, state, device, range(save_at))
    path = os.path.join(ckpt_dir, f"step{save_at}")
    save_checkpoint(path, model, opt, step=save_at, extra=scaler_extra(scaler))
    say(f"saved checkpoint {path} after {save_at} steps")
    rest = train(model, opt, scaler, state, device, range(save_at, args.steps))
    losses = first + rest

    # Resume: a fresh model from another seed, the checkpoint loaded, the same steps again.
    model, opt, scaler, _ = build(state, device, seed=state.config.random_seed + 1, lr=args.lr)
    load_checkpoint(path, model, opt, extra=scaler_extra(scaler, path))
    say(f"resume: loaded {path} into a fresh model; steps {save_at}..{args.steps - 1} again")
    again = train(model, opt, scaler, state, device, range(save_at, args.steps))
    tol = 0.0 if precision == "fp32" and device.type == "cpu" else 1e-3 * max(rest)
    diff, match = compare_resumed(rest, again, tol)
    decreased = losses[-1] < losses[0]
    say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} ({'decreased' if decreased else 'DID NOT DECREASE'})")
    say(
        f"resume: max |loss diff| {diff:.3g} over {len(rest)} steps (tolerance {tol:.3g}): "
        + ("match" if match else "MISMATCH")
    )
    return 0 if match and decreased and all(math.isfinite(v) for v in losses) else 1


if __name__ == "__main__":
    sys.exit(main())
