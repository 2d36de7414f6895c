"""A Llama-style MLP block built from smptk kernels, checked against plain PyTorch.

    down(swiglu(x, w_gate, w_up)) + residual, with an fp32 comparison of outputs and gradients.

On a GPU the Triton kernels run at Llama-3-8B's MLP shapes (4096 tokens, 4096 -> 14336, bf16)::

    python examples/llama_mlp.py

On a CPU the script turns on Triton's interpreter (``TRITON_INTERPRET=1``, set before smptk.kernels is
imported, which is when Triton reads it) and uses tiny fp32 shapes, so the kernels themselves run and
the check takes seconds::

    python examples/llama_mlp.py                       # 8 tokens, 64 -> 96
    python examples/llama_mlp.py --tokens 33 --hidden 40 --ffn 17

It prints which path ran (:func:`smptk.kernels.runtime.select_path`); where that is the PyTorch path
(``SMPTK_KERNELS=torch``, ``TRITON_INTERPRET=0``, no Triton) it says the comparison is PyTorch against
itself. Exits with status 1 when an error exceeds the dtype's bound or is not finite (NaN, inf), and with
status 2 (argparse) for a size below 1.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

if not torch.cuda.is_available():
    # Triton decides interpreted-or-compiled when smptk.kernels is imported: this must come first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F

from smptk.kernels import fused_linear, runtime, swiglu

# (tokens, hidden, ffn): Llama-3-8B's MLP on a GPU; tiny on a CPU, where the interpreter runs every
# program in Python.
GPU_SHAPE = (4096, 4096, 14336)
CPU_SHAPE = (8, 64, 96)
# Relative error bounds vs eager: fp32 on CPU (IEEE both sides; 1e-5 leaves room for summation order),
# bf16 on a GPU (a few bf16 roundings of unit roundoff 2^-8 ~ 3.9e-3).
MAX_REL_ERROR = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


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


def describe_path(x: torch.Tensor) -> str:
    """``"triton"``, ``"triton (interpreter)"`` or ``"torch"``: what the smptk calls on ``x`` run."""
    path = runtime.select_path(x)
    if path == "triton" and x.device.type == "cpu":
        return "triton (interpreter)"
    return path


def failures(errors: dict[str, float], bound: float) -> list[str]:
    """The names in ``errors`` whose relative error is above ``bound`` or not finite: NaN compares False
    with anything (so ``nan > bound`` passes it and ``max`` may drop it), and a comparison of NaN outputs
    must fail."""
    return [name for name, err in errors.items() if not (math.isfinite(err) and err <= bound)]


def main(argv: list[str] | None = None) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, hidden, ffn = GPU_SHAPE if device == "cuda" else CPU_SHAPE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--ffn", type=int, default=ffn)
    args = parser.parse_args(argv)
    for flag in ("tokens", "hidden", "ffn"):
        if getattr(args, flag) < 1:  # 0 tokens compare nothing; 0 features divide by zero at init
            parser.error(f"--{flag} {getattr(args, flag)}: expected at least 1")

    # bf16 on a GPU; fp32 on a CPU (the Triton interpreter mishandles bf16 tl.dot).
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    mlp = LlamaMLP(args.hidden, args.ffn, device=device, dtype=dtype)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    path = describe_path(x)
    print(f"device={device} dtype={dtype} shape={args.tokens}x{args.hidden}->{args.ffn} path={path}")
    if path == "torch":
        interpret = "on" if runtime.interpreter_enabled() else "off"
        print(
            "note: smptk ran its PyTorch path, so this compares PyTorch with itself "
            f"(SMPTK_KERNELS={runtime.requested_path()}, TRITON_INTERPRET={interpret}, "
            f"triton installed: {runtime.triton_available()})"
        )

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

    bound = MAX_REL_ERROR[dtype]
    errors = {"output": rel(y, y_ref)}
    names = ("x", "w_gate", "w_up", "w_down")
    errors.update({f"grad {n}": rel(g, r) for n, g, r in zip(names, grads, refs, strict=True)})
    for name, err in errors.items():
        print(f"{name:<12} rel. error vs eager: {err:.2e}")
    failed = failures(errors, bound)
    if failed:
        worst = ", ".join(f"{name} {errors[name]:.2e}" for name in failed)
        print(f"FAIL: relative error above {bound:.0e} or not finite for {dtype}: {worst}")
        return 1
    print(f"ok: every relative error <= {bound:.0e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
