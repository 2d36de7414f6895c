"""Single-device Triton kernels with autograd, each with a pure-PyTorch path for any machine.

Public ops:

- :func:`fused_linear`: ``act(x @ weight.T + bias)`` in one GEMM launch, backward in Triton.
- :func:`swiglu`: ``silu(x @ w_gate.T) * (x @ w_up.T)`` reading x once, backward in Triton.

Which implementation runs is decided per call by :mod:`smptk.kernels.runtime` (``SMPTK_KERNELS``).
Set ``TRITON_INTERPRET=1`` before importing this package to run the Triton kernels on CPU tensors.
"""

from smptk.kernels import runtime
from smptk.kernels.fused_linear import fused_linear
from smptk.kernels.swiglu import swiglu

__all__ = ["fused_linear", "runtime", "swiglu"]
