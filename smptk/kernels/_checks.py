"""Argument checks shared by the kernel launchers: each error names the argument and what was expected."""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The activations the linear ops take, each with its PyTorch form (the ops' PyTorch path).
TORCH_ACTIVATIONS = {
    None: lambda z: z,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
}
ACTIVATIONS = tuple(TORCH_ACTIVATIONS)


def check_float_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; expected float32, float16 or bfloat16")
    return t


def check_same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """``t`` must have ``ref``'s dtype and device."""
    if t.dtype != ref.dtype:
        raise TypeError(f"{name}: dtype {t.dtype} does not match {ref_name}'s {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name}: on {t.device} but {ref_name} is on {ref.device}")


def check_weight(name: str, w: torch.Tensor, x: torch.Tensor, x_name: str = "x") -> None:
    """``w`` is an nn.Linear weight ``[N, K]`` for input ``x`` (named ``x_name``) of shape ``[..., K]``."""
    check_float_tensor(name, w)
    check_same(name, w, x_name, x)
    if w.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [N, K] weight, got shape {tuple(w.shape)}")
    if w.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{name}: shape {tuple(w.shape)} needs K={w.shape[1]} input features but {x_name} has "
            f"{x.shape[-1]} ({x_name}.shape={tuple(x.shape)})"
        )


def check_bias(bias: object, shape: tuple[int, ...], what: str, x: torch.Tensor, x_name: str = "x") -> None:
    """``bias`` is a float tensor of ``x``'s dtype and device, of shape ``shape`` (that of ``what``)."""
    check_float_tensor("bias", bias)
    check_same("bias", bias, x_name, x)
    if bias.shape != shape:
        raise ValueError(f"bias: expected shape {shape} to match {what}, got {tuple(bias.shape)}")


def check_input(x: torch.Tensor) -> None:
    check_float_tensor("x", x)
    if x.dim() < 1:
        raise ValueError("x: expected shape [..., K] with at least one dimension, got a scalar")


def check_activation(activation: object) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: {activation!r} is not supported; expected one of {ACTIVATIONS}")


# The dtypes autocast casts for a linear op (torch's fp32 / fp16 / bf16 "lower precision" list).
_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)


def autocast_inputs(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Cast floating inputs to the autocast dtype when autocast is on for their device, as F.linear would.

    Inside ``torch.autocast(device_type, dtype)`` a linear op runs in ``dtype`` whatever its inputs' dtype
    (fp32 master weights with bf16 compute is the usual case); outside autocast inputs pass unchanged, as
    they do on ``meta``, which has no autocast (asking would raise). The check is one Dynamo traces on
    torch 2.11 as well (its ``torch.amp.is_autocast_available`` is a builtin Dynamo cannot trace).
    """
    device_type = tensors[0].device.type  # the caller has checked that the first one is a tensor
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    # float64 is left as it is, as autocast leaves it (F.linear then refuses the mix; so does the op's check)
    return tuple(
        t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in _AUTOCAST_CASTS else t for t in tensors
    )
