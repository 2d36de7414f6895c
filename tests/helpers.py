"""Helpers shared by the kernel tests: devices and paths, seeded inputs, and the kernel-vs-reference checks.

Imports nothing from ``smptk.kernels`` at module level (conftest imports this module before it may set
``TRITON_INTERPRET``); the kernels are imported inside the functions that call them.

Legend: M rows of x (all leading dims), K input features, N output features.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import pytest
import torch

from smptk.testing import (
    assert_close,
    linear_error_scales,
    linear_reference,
    relu_kink_mask,
    swiglu_error_scales,
    swiglu_reference,
)

HAS_CUDA = torch.cuda.is_available()
CUDA_SKIP_REASON = "needs a CUDA GPU (none visible to torch)"
INTERPRETER_BF16_REASON = (
    "tl.dot on bf16 inputs is wrong under the Triton interpreter (DESIGN.md); bf16 Triton runs on CUDA"
)
NO_INTERPRETER_REASON = (
    "Triton on CPU tensors needs TRITON_INTERPRET=1 before smptk.kernels is imported "
    "(conftest sets it only where no CUDA device is visible)"
)


def old_interpreter_reason() -> str | None:
    """Why this Triton's interpreter cannot run smptk's persistent kernels, or None (None without triton).

    The interpreter holds ``tl.program_id`` in a 1-element array; Triton 3.9 squeezes it before ``int()``
    when it bounds a ``range``, Triton 3.6 does not, and NumPy 2 refuses ``int()`` of a 1-d array. So the
    CPU interpreter is supported on Triton 3.9 (CI); Triton 3.6 (the GPU image) runs the kernels compiled.
    """
    from importlib import metadata

    try:
        version = tuple(int(p) for p in metadata.version("triton").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return None
    if version < (3, 9):
        return (
            f"Triton {version[0]}.{version[1]}'s interpreter cannot bound a range by tl.program_id under "
            "NumPy 2 (int() of a 1-element array; Triton 3.9 squeezes it): interpreter runs need "
            "Triton >= 3.9"
        )
    return None


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The devices a test runs on; the CUDA one carries the ``gpu`` marker, so it skips with CUDA_SKIP_REASON.
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def act_id(activation: str | None) -> str:
    return activation or "noact"


def device_path_dtype_params(devices: Sequence[str] = ("cpu", "cuda")) -> list:
    """``(device, path, dtype)`` for every dtype on both paths, ids like ``cpu-triton-float16``.

    CUDA cases carry the ``gpu`` marker; CPU Triton bf16 carries a skip with the interpreter's reason.
    """
    params = []
    for device in devices:
        for path in ("triton", "torch"):
            for dtype in DTYPES:
                marks = [pytest.mark.gpu] if device == "cuda" else []
                if device == "cpu" and path == "triton" and dtype == torch.bfloat16:
                    marks.append(pytest.mark.skip(reason=INTERPRETER_BF16_REASON))
                params.append(
                    pytest.param(device, path, dtype, id=f"{device}-{path}-{dtype_id(dtype)}", marks=marks)
                )
    return params


def autocast_params() -> list:
    """``(device, path, autocast dtype)``: fp16 on CPU (bf16 Triton is wrong under the interpreter), bf16
    and fp16 on CUDA, both paths."""
    params = [pytest.param("cpu", p, torch.float16, id=f"cpu-{p}-float16") for p in ("triton", "torch")]
    for path in ("triton", "torch"):
        for dtype in (torch.bfloat16, torch.float16):
            params.append(
                pytest.param("cuda", path, dtype, id=f"cuda-{path}-{dtype_id(dtype)}", marks=pytest.mark.gpu)
            )
    return params


def use_path(monkeypatch: pytest.MonkeyPatch, path: str, device: str) -> None:
    """Force ``SMPTK_KERNELS=path``; on the Triton path also NaN-poison every buffer the launchers allocate.

    With the poison on, an output element a kernel never writes reads as NaN and fails ``assert_close``.
    """
    from smptk.kernels import runtime

    monkeypatch.setenv("SMPTK_KERNELS", path)
    if path == "triton":
        monkeypatch.setenv("SMPTK_POISON_OUTPUTS", "1")
        if device == "cpu" and not runtime.interpreter_enabled():
            pytest.skip(NO_INTERPRETER_REASON)


def generator(device: str | torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape: Sequence[int], *, dtype, device, gen: torch.Generator, std: float = 1.0) -> torch.Tensor:
    """Normal samples drawn in fp32 and rounded to ``dtype`` (drawn directly in ``dtype`` when huge)."""
    shape = tuple(shape)
    if math.prod(shape) > 2**28:
        out = torch.randn(shape, dtype=dtype, device=device, generator=gen)
        return out.mul_(std) if std != 1.0 else out
    return (torch.randn(shape, device=device, generator=gen) * std).to(dtype)


def linear_inputs(
    x_shape: Sequence[int], N: int, *, dtype, device, bias: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x ~ N(0, 1), weight ~ N(0, 1/K) so that z = x @ w.T is O(1) (the activations' curved region),
    bias ~ N(0, 1/4). Leaves that require grad."""
    gen = generator(device, seed)
    K = x_shape[-1]
    x = randn(x_shape, dtype=dtype, device=device, gen=gen).requires_grad_()
    w = randn((N, K), dtype=dtype, device=device, gen=gen, std=1 / math.sqrt(max(K, 1))).requires_grad_()
    b = randn((N,), dtype=dtype, device=device, gen=gen, std=0.5).requires_grad_() if bias else None
    return x, w, b


def swiglu_inputs(
    x_shape: Sequence[int], N: int, *, dtype, device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x ~ N(0, 1) and both weights ~ N(0, 1/K), so g and u are O(1). Leaves that require grad."""
    gen = generator(device, seed)
    K = x_shape[-1]
    std = 1 / math.sqrt(max(K, 1))
    x = randn(x_shape, dtype=dtype, device=device, gen=gen).requires_grad_()
    wg = randn((N, K), dtype=dtype, device=device, gen=gen, std=std).requires_grad_()
    wu = randn((N, K), dtype=dtype, device=device, gen=gen, std=std).requires_grad_()
    return x, wg, wu


def noncontiguous_x(layout: str, M: int, K: int, *, dtype, device, seed: int = 0) -> torch.Tensor:
    """A non-contiguous ``[M, K]`` (or ``[2, M, K]``) view of a larger leaf that requires grad.

    layouts: "transposed" (strides (1, M)), "column-slice" (row stride K + 5, offset 3),
    "every-other" (column stride 2), "permuted-3d" ([2, M, K] from a [M, 2, K] leaf).
    """
    gen = generator(device, seed)
    if layout == "transposed":
        base = randn((K, M), dtype=dtype, device=device, gen=gen).requires_grad_()
        x = base.t()
    elif layout == "column-slice":
        base = randn((M, K + 5), dtype=dtype, device=device, gen=gen).requires_grad_()
        x = base[:, 3 : 3 + K]
    elif layout == "every-other":
        base = randn((M, 2 * K), dtype=dtype, device=device, gen=gen).requires_grad_()
        x = base[:, ::2]
    elif layout == "permuted-3d":
        base = randn((M, 2, K), dtype=dtype, device=device, gen=gen).requires_grad_()
        x = base.permute(1, 0, 2)
    else:
        raise ValueError(f"layout: unknown {layout!r}")
    assert not x.is_contiguous()
    return x


def _grad_inputs(named: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in named.items() if v is not None and v.requires_grad}


def _fp32_leaves(named: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    return {
        k: None if v is None else v.detach().to(torch.float32).requires_grad_(v.requires_grad)
        for k, v in named.items()
    }


def check_fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    *,
    grad_out: torch.Tensor | None = None,
    seed: int = 1,
) -> dict[str, torch.Tensor]:
    """Run ``fused_linear`` and the fp32 reference on the same inputs and compare the output and the
    gradient of every input that requires grad (``dx``, ``dweight``, ``dbias``), each with assert_close.

    ``grad_out`` defaults to seeded N(0, 1) in x's dtype; for relu it is zeroed where the pre-activation
    is within rounding of 0 (see ``relu_kink_mask``). Returns the kernel's output and gradients.
    """
    from smptk.kernels import fused_linear

    dtype = x.dtype
    N = weight.shape[0]
    out = fused_linear(x, weight, bias, activation=activation)
    assert out.dtype == dtype, f"out: dtype {out.dtype}, expected x's {dtype}"
    assert out.shape == (*x.shape[:-1], N), f"out: shape {tuple(out.shape)}, expected {(*x.shape[:-1], N)}"
    assert out.device == x.device
    named = {"x": x, "weight": weight, "bias": bias}
    ref_named = _fp32_leaves(named)
    expected = linear_reference(ref_named["x"], ref_named["weight"], ref_named["bias"], activation)
    wants = _grad_inputs(named)
    if wants and grad_out is None:
        grad_out = randn(out.shape, dtype=dtype, device=x.device, gen=generator(x.device, seed))
        if activation == "relu":
            grad_out = grad_out.masked_fill(relu_kink_mask(x, weight, bias, dtype=dtype), 0)
    scales = linear_error_scales(x, weight, bias, activation, grad_out if wants else None)
    assert_close(out, expected, dtype=dtype, name="out", **scales["out"]._asdict())
    results = {"out": out}
    if not wants:
        return results
    grads = torch.autograd.grad(out, list(wants.values()), grad_out)
    ref_wants = [ref_named[k] for k in wants]
    ref_grads = torch.autograd.grad(expected, ref_wants, grad_out.to(torch.float32))
    for name, grad, ref_grad in zip(wants, grads, ref_grads, strict=True):
        assert grad is not None, f"d{name}: no gradient returned"
        assert_close(grad, ref_grad, dtype=dtype, name=f"d{name}", **scales[name]._asdict())
        results[f"d{name}"] = grad
    return results


def check_swiglu(
    x: torch.Tensor,
    weight_gate: torch.Tensor,
    weight_up: torch.Tensor,
    *,
    grad_out: torch.Tensor | None = None,
    seed: int = 1,
) -> dict[str, torch.Tensor]:
    """Run ``swiglu`` and the fp32 reference on the same inputs and compare the output and the gradient
    of every input that requires grad (``dx``, ``dweight_gate``, ``dweight_up``), each with assert_close.
    Returns the kernel's output and gradients."""
    from smptk.kernels import swiglu

    dtype = x.dtype
    N = weight_gate.shape[0]
    out = swiglu(x, weight_gate, weight_up)
    assert out.dtype == dtype, f"out: dtype {out.dtype}, expected x's {dtype}"
    assert out.shape == (*x.shape[:-1], N), f"out: shape {tuple(out.shape)}, expected {(*x.shape[:-1], N)}"
    assert out.device == x.device
    named = {"x": x, "weight_gate": weight_gate, "weight_up": weight_up}
    ref_named = _fp32_leaves(named)
    expected = swiglu_reference(ref_named["x"], ref_named["weight_gate"], ref_named["weight_up"])
    wants = _grad_inputs(named)
    if wants and grad_out is None:
        grad_out = randn(out.shape, dtype=dtype, device=x.device, gen=generator(x.device, seed))
    scales = swiglu_error_scales(x, weight_gate, weight_up, grad_out if wants else None)
    assert_close(out, expected, dtype=dtype, name="out", **scales["out"]._asdict())
    results = {"out": out}
    if not wants:
        return results
    grads = torch.autograd.grad(out, list(wants.values()), grad_out)
    ref_grads = torch.autograd.grad(expected, [ref_named[k] for k in wants], grad_out.to(torch.float32))
    for name, grad, ref_grad in zip(wants, grads, ref_grads, strict=True):
        assert grad is not None, f"d{name}: no gradient returned"
        assert_close(grad, ref_grad, dtype=dtype, name=f"d{name}", **scales[name]._asdict())
        results[f"d{name}"] = grad
    return results


def compare_rel(
    problems: list[str], name: str, got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5, floor=1e-6
) -> None:
    """Append a line to ``problems`` unless ``max |got - ref| <= rel * max |ref| + floor`` and the shapes
    agree (DTensors are compared whole, through ``full_tensor()``: a collective on their mesh)."""
    from torch.distributed.tensor import DTensor

    got, ref = (t.full_tensor() if isinstance(t, DTensor) else t for t in (got, ref))
    got, ref = got.detach().float(), ref.detach().float()
    if got.shape != ref.shape:
        problems.append(f"{name}: shape {tuple(got.shape)} vs {tuple(ref.shape)}")
        return
    scale = ref.abs().max().item() if ref.numel() else 0.0
    err = (got - ref).abs().max().item() if ref.numel() else 0.0
    if not err <= rel * scale + floor:
        problems.append(f"{name}: max |error| {err:.3g} > {rel} x {scale:.3g}")


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0) -> Iterator[None]:
    """This process as ``rank`` of ``world`` on torch's fake process-group backend (no-op collectives, real
    groups and meshes); ``smptk.parallel.reset()`` and the group's destruction afterwards."""
    import torch.distributed as dist

    import smptk.parallel as parallel

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        parallel.reset()
        dist.destroy_process_group()


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A 1-rank gloo group in this process for the block (created here and destroyed after it), or the one
    already initialized; skips the calling test when a larger group is initialized in this process."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.skip("a process group of more than one rank is already initialized in this process")
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def skip_unless_triton_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip unless smptk's Triton kernels run on CPU tensors here (Triton's interpreter, which conftest turns
    on without CUDA); then force them (``SMPTK_KERNELS=triton``) for the test."""
    from smptk.kernels import runtime

    try:
        path = runtime.select_path(torch.empty(0))
    except RuntimeError as e:  # TRITON_INTERPRET set after triton was imported
        pytest.skip(f"needs smptk's Triton kernels on CPU: {e}")
    if path != "triton":
        pytest.skip("needs smptk's Triton kernels on CPU (TRITON_INTERPRET=1, set by conftest without CUDA)")
    monkeypatch.setenv("SMPTK_KERNELS", "triton")
