"""fp32 references and derived tolerances, shared by the tests and the benchmarks.

- :mod:`smptk.testing.references`: plain-PyTorch fp32 implementations of the kernel ops, written from the
  math and independent of :mod:`smptk.kernels` (``linear_reference``, ``swiglu_reference`` and the
  activations).
- :mod:`smptk.testing.moe`, :mod:`smptk.testing.grouped`, :mod:`smptk.testing.moe_layer`: the MoE
  references (routing, dispatch/combine, grouped GEMMs as a per-expert loop, the whole layer), likewise
  written from the math and never importing the kernels.
- :mod:`smptk.testing.tolerances`: ``assert_close`` and the per-dtype tolerance model it applies (final
  rounding, fp32 accumulation over the reduction length, intermediates stored in the low dtype), with the
  per-element error scales of each op.

Importing this package never imports :mod:`smptk.kernels`, so a test can set ``TRITON_INTERPRET`` after
importing it.
"""

from smptk.testing.grouped import (
    grouped_linear_error_scales,
    grouped_linear_reference,
    grouped_swiglu_error_scales,
    grouped_swiglu_reference,
)
from smptk.testing.moe import (
    moe_capacity_reference,
    moe_combine_reference,
    moe_dispatch_reference,
    moe_route_reference,
)
from smptk.testing.moe_layer import moe_layer_reference
from smptk.testing.references import (
    ACTIVATIONS,
    activation_fn,
    gelu,
    gelu_tanh,
    linear_reference,
    relu,
    silu,
    swiglu_reference,
)
from smptk.testing.tolerances import (
    ErrorScale,
    Tolerance,
    assert_close,
    linear_error_scales,
    relu_kink_mask,
    swiglu_error_scales,
    tolerance,
)

__all__ = [
    "ACTIVATIONS",
    "ErrorScale",
    "Tolerance",
    "activation_fn",
    "assert_close",
    "gelu",
    "gelu_tanh",
    "grouped_linear_error_scales",
    "grouped_linear_reference",
    "grouped_swiglu_error_scales",
    "grouped_swiglu_reference",
    "linear_error_scales",
    "linear_reference",
    "moe_capacity_reference",
    "moe_combine_reference",
    "moe_dispatch_reference",
    "moe_layer_reference",
    "moe_route_reference",
    "relu",
    "relu_kink_mask",
    "silu",
    "swiglu_error_scales",
    "swiglu_reference",
    "tolerance",
]
