"""A Llama-style MLP block built from smptk kernels, checked against plain PyTorch.

    down(swiglu(x, w_gate, w_up)) + residual, with an fp32 comparison of outputs and gradients.

Run on a GPU (Triton kernels)::

    python examples/llama_mlp.py

or on a CPU through Triton's interpreter (small shapes)::

    TRITON_INTERPRET=1 python examples/llama_mlp.py --tokens 8 --hidden 64 --ffn 96
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from smptk.kernels import fused_linear, runtime, swiglu


class LlamaMLP(torch.nn.Module):
    """``x + W_down (silu(W_gate x) * W_up x)`` with the two input projections in one smptk kernel."""

    def __init__(self, hidden: int, ffn: int, *, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.gate = torch.nn.Parameter(torch.randn(ffn, hidden, **kw) * hidden**-0.5)
        self.up = torch.nn.Parameter(torch.randn(ffn, hidden, **kw) * hidden**-0.5)
        self.down = torch.nn.Parameter(torch.randn(hidden, ffn, **kw) * ffn**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + fused_linear(swiglu(x, self.gate, self.up), self.down)

    def forward_eager(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.linear(F.silu(F.linear(x, self.gate)) * F.linear(x, self.up), self.down)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # bf16 on a GPU; fp32 on a CPU (the Triton interpreter mishandles bf16 tl.dot).
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    mlp = LlamaMLP(args.hidden, args.ffn, device=device, dtype=dtype)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    print(f"device={device} dtype={dtype} path={runtime.select_path(x)}")

    y = mlp(x)
    y.float().square().mean().backward()
    grads = [p.grad.clone() for p in (x, mlp.gate, mlp.up, mlp.down)]

    x.grad = None
    mlp.zero_grad()
    y_ref = mlp.forward_eager(x)
    y_ref.float().square().mean().backward()
    refs = [p.grad for p in (x, mlp.gate, mlp.up, mlp.down)]

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()

    print(f"output   rel. error vs eager: {rel(y, y_ref):.2e}")
    for name, g, r in zip(("x", "w_gate", "w_up", "w_down"), grads, refs, strict=True):
        print(f"grad {name:<7} rel. error vs eager: {rel(g, r):.2e}")


if __name__ == "__main__":
    main()
