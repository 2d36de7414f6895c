"""Single-device Triton kernels with autograd, each with a pure-PyTorch path for any machine.

Public ops:

- :func:`fused_linear`: ``act(x @ weight.T + bias)`` in one GEMM launch, backward in Triton.
- :func:`swiglu`: ``silu(x @ w_gate.T) * (x @ w_up.T)`` reading x once, backward in Triton.
- Mixture-of-Experts: :func:`moe_route` (scores, top-k, counts, load-balancing and z losses),
  :func:`moe_dispatch` / :func:`moe_combine` (group token rows by expert and back, with a capacity),
  :func:`grouped_linear` / :func:`grouped_swiglu` (every expert's GEMM in one launch).

Which implementation runs is decided per call by :mod:`smptk.kernels.runtime` (``SMPTK_KERNELS``).
Importing this package does not import triton: the first call that takes the Triton path does
(:mod:`smptk.kernels._triton`). Set ``TRITON_INTERPRET=1`` before that call to run the Triton kernels on CPU
tensors.
The MoE functions shadow their modules' names here; import a module by its full path
(``import smptk.kernels.moe_route``) to reach its other contents.
"""

from smptk.kernels import runtime
from smptk.kernels.fused_linear import fused_linear
from smptk.kernels.grouped_linear import grouped_linear, grouped_swiglu
from smptk.kernels.moe_dispatch import MoEDispatchPlan, moe_combine, moe_dispatch
from smptk.kernels.moe_route import MoERouting, moe_route
from smptk.kernels.swiglu import swiglu

__all__ = [
    "MoEDispatchPlan",
    "MoERouting",
    "fused_linear",
    "grouped_linear",
    "grouped_swiglu",
    "moe_combine",
    "moe_dispatch",
    "moe_route",
    "runtime",
    "swiglu",
]
