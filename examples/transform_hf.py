"""A stock Hugging Face model made parallel by ``smptk.parallel.transform`` and trained under torchrun.

The model is a tiny random ``LlamaForCausalLM`` or ``MixtralForCausalLM`` built from a config in this file
(no download; with a real checkpoint, ``from_pretrained`` it instead). ``transform`` swaps Mixtral's MoE
blocks for smptk's MoE, applies tensor parallelism (``--tp``), expert parallelism (``--ep``), activation
checkpointing and FSDP2 as the config says, and the model trains with its own loss (``labels=``) plus,
for MoE, smptk's load-balancing loss (``moe_aux_loss``); ``--save`` writes the trained model back in the
Hugging Face format (``hf_state_dict`` + ``save_pretrained``). Every rank builds the same weights; the tensor-
and expert-parallel shards are cut from rank 0's. With ``--meta`` (delayed initialization, for a model too
large to build whole on each rank) the model is built on the meta device, transformed there, and
``materialize`` gives each rank only its shards, with the values the eager build has (Hugging Face's
``_init_weights`` replayed, on the swapped-in layers and MoE blocks too), so on a CPU the losses are the
same (on GPUs the layers initialized in place draw from the CUDA generator: other values, the same
distributions).
Each data-parallel rank trains on its own rows, and the loss printed at each step is the mean over the
data-parallel ranks (its own at dp 1).

Run (CPU: gloo and PyTorch kernels; GPUs: NCCL, bf16 parameters with fp32 reduction)::

    torchrun --standalone --nproc-per-node 2 examples/transform_hf.py --tp 2
    torchrun --standalone --nproc-per-node 2 examples/transform_hf.py --model mixtral --ep 2 --save out
    torchrun --standalone --nproc-per-node 2 examples/transform_hf.py --model mixtral --ep 2 --meta
    torchrun --standalone --nproc-per-node 4 examples/transform_hf.py --model mixtral --tp 2 --ep 2

Needs transformers >= 5 (``pip install transformers``).
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ.setdefault("SMPTK_KERNELS", "torch")  # before smptk.kernels is imported

import torch.distributed as dist
import transformers

import smptk.parallel as sp

SHAPE = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
}  # fmt: skip


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    moe = {"num_local_experts": 4, "num_experts_per_tok": 2}
    config = transformers.MixtralConfig(**SHAPE, **moe, output_router_logits=True, router_aux_loss_coef=0.01)
    return transformers.MixtralForCausalLM(config)


def batch(step: int, dp_rank: int, rows: int = 4, seq: int = 32) -> torch.Tensor:
    """A learnable next-token task: random starts, then ``x[t+1] = (5 x[t] + 3) mod vocab``."""
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    ids = torch.empty(rows, seq, dtype=torch.int64)
    ids[:, 0] = torch.randint(0, SHAPE["vocab_size"], (rows,), generator=gen)
    for t in range(1, seq):
        ids[:, t] = (5 * ids[:, t - 1] + 3) % SHAPE["vocab_size"]
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("llama", "mixtral"), default="llama")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_degree")
    parser.add_argument("--ep", type=int, default=1, help="expert_parallel_degree")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save", metavar="DIR", help="save the trained model in the Hugging Face format")
    parser.add_argument(
        "--meta", action="store_true",
        help="build on the meta device and materialize after transform (each rank allocates its shards only)",
    )  # fmt: skip
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    config = {
        "tensor_parallel_degree": args.tp,
        "expert_parallel_degree": args.ep,
        "activation_checkpointing": "full",
        "mixed_precision": "bf16" if cuda else "fp32",
        "random_seed": 0,  # materialize's draws: build()'s seed
    }
    if args.meta:
        with torch.device("meta"):
            model = build(args.model)
        model, report = sp.transform(model, config)
        sp.materialize(model)  # on the state's device: the eager build's values, this rank's shards
    else:
        model, report = sp.transform(build(args.model).to(device), config)
    rank = dist.get_rank()
    if rank == 0:
        print(f"{report.architecture}: sizes {report.sizes}; MoE layers {len(report.moe_layers)}, "
              f"tensor-parallel modules {len(report.tensor_parallel)}, data parallel "
              f"{report.data_parallel.mode} on {report.data_parallel.engine}")  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = sp.current()
    dp, dp_rank = state.sizes["dp"], state.coords["dp"]  # each data-parallel rank draws its own rows
    for step in range(args.steps):
        ids = batch(step, dp_rank).to(device)
        out = model(ids, labels=ids)
        loss = out.loss + sp.moe_aux_loss(model)  # 0 for a dense model
        loss.backward()
        sp.clip_grad_norm_(model.parameters(), max_norm=1.0)  # parameters on tp, dp and ep meshes
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=state.group("dp"))  # the same on every tp rank: count one per dp rank
        if rank == 0:
            print(f"step {step} loss {mean.item() / dp:.4f}")
    if args.save:
        state = sp.hf_state_dict(model)  # collective: whole tensors, Hugging Face layout, on rank 0
        if rank == 0:
            model.save_pretrained(args.save, state_dict=state)  # from_pretrained(args.save) reads it back
            print(f"saved to {args.save}")
    sp.reset()
    dist.barrier()  # before the exit (README: "Ending a job")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
