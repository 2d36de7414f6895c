"""Whether torch lets fp32 CUDA matmuls run in TF32: read once here for the kernels and the references.

Torch has two ways to set it: the legacy ``torch.backends.cuda.matmul.allow_tf32`` /
``torch.set_float32_matmul_precision`` and, since 2.9, ``torch.backends.cuda.matmul.fp32_precision`` (or
``torch.backends.fp32_precision``). Once the new one is set, reading the legacy ``allow_tf32`` raises
("you have used mix of the legacy and new APIs"), while ``fp32_precision`` answers for both ("tf32" after
either way of turning TF32 on); Inductor reads it the same way.

Example::

    >>> import torch
    >>> torch.backends.cuda.matmul.fp32_precision = "tf32"
    >>> tf32_matmul()
    True
    >>> torch.backends.cuda.matmul.fp32_precision = "none"   # torch's default: IEEE fp32
    >>> tf32_matmul()
    False
"""

from __future__ import annotations

import torch


def tf32_matmul() -> bool:
    """True when an fp32 CUDA matmul in torch may use TF32 (set through either of torch's APIs)."""
    matmul = torch.backends.cuda.matmul
    try:
        return matmul.fp32_precision == "tf32"
    except AttributeError:  # torch before 2.9 has only the legacy flag
        return bool(matmul.allow_tf32)
