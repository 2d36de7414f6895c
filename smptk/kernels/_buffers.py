"""Output allocation for kernel launchers, with an opt-in poison to catch unwritten elements.

``SMPTK_POISON_OUTPUTS=1`` fills every buffer a launcher allocates with NaN (integer buffers: the dtype's
minimum) before the kernel runs, so an element the kernel forgets to write shows up instead of stale memory
that happens to look right. Tests switch it on; it costs one fill per buffer, so it is off by default.
"""

from __future__ import annotations

import torch

from smptk import settings


def new_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape)``; NaN-filled when ``SMPTK_POISON_OUTPUTS=1``."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if settings.poison_outputs():  # read at every allocation
        out.fill_(float("nan"))
    return out


def new_index_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` for an integer output; under ``SMPTK_POISON_OUTPUTS=1`` filled with the dtype's
    minimum (NaN does not exist for integers), which no kernel here ever writes."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if settings.poison_outputs():
        out.fill_(torch.iinfo(dtype).min)
    return out
