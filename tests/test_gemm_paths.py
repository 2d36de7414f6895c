"""The GEMM engine's two load paths, TMA descriptors and pointers, against the fp32 references.

``SMPTK_GEMM_PATH=tma`` makes every launch whose operands allow it take the TMA path, the interpreter
included (it runs tensor descriptors), so the CPU runs both paths; ``pointer`` never takes it. Each test
records every launch's decision (``_gemm._choose_tma``) and asserts the path it asked for really ran, so a
silent fallback fails. Shapes have K and N multiples of 8 (16-byte rows in 16-bit types, which TMA needs)
with row counts that leave partial tiles; one case per op is unaligned and must fall back to pointers.
CPU runs fp16 and fp32 (fp32 always takes the pointer path); CUDA runs bf16 and fp16 (TMA needs sm_90).
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    DEVICES,
    HAS_CUDA,
    check_fused_linear,
    check_swiglu,
    linear_inputs,
    swiglu_inputs,
    use_path,
)
from test_grouped_linear import check_grouped_linear, check_grouped_swiglu, linear_case, swiglu_case

from smptk.kernels import _gemm

PATHS = ("tma", "pointer")
# M rows with a partial tile, K and N multiples of 8 (aligned), K spanning two K steps of the pinned
# interpreter tile (32) plus a tail.
ALIGNED = {"cpu": ((45, 72), 40), "cuda": ((300, 200), 136)}
UNALIGNED = {"cpu": ((9, 21), 13), "cuda": ((130, 77), 45)}
COUNTS = {"cpu": ((20, 0, 13, 12), 72, 40), "cuda": ((300, 0, 70, 130), 200, 136)}


def _dtypes(device: str) -> list:
    return [torch.float16, torch.float32] if device == "cpu" else [torch.bfloat16, torch.float16]


def _cases():
    for dev in DEVICES:
        for dtype in _dtypes(dev.values[0]):
            for path in PATHS:
                yield pytest.param(
                    dev.values[0], dtype, path, marks=dev.marks, id=f"{dev.id}-{str(dtype)[6:]}-{path}"
                )


@pytest.fixture
def decisions(monkeypatch):
    """Every launch's path decision (True = TMA), while still launching."""
    seen = []
    real = _gemm._choose_tma

    def recording(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(_gemm, "_choose_tma", recording)
    return seen


def _setup(monkeypatch, device: str, path: str) -> None:
    use_path(monkeypatch, "triton", device)
    monkeypatch.setenv("SMPTK_GEMM_PATH", path)
    if device == "cuda" and path == "tma" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA path needs sm_90+ (this GPU is older)")


def _expect(decisions: list[bool], path: str, dtype: torch.dtype, n_launches: int) -> None:
    assert len(decisions) == n_launches, f"expected {n_launches} GEMM launches, saw {len(decisions)}"
    want = path == "tma" and dtype != torch.float32
    assert decisions == [want] * n_launches, f"path decisions {decisions}, expected all {want}"


@pytest.mark.parametrize(("device", "dtype", "path"), list(_cases()))
@pytest.mark.parametrize("activation", [None, "gelu", "silu"])
def test_fused_linear_paths(monkeypatch, decisions, device, dtype, path, activation):
    _setup(monkeypatch, device, path)
    x_shape, N = ALIGNED[device]
    check_fused_linear(*linear_inputs(x_shape, N, dtype=dtype, device=device, bias=True), activation)
    _expect(decisions, path, dtype, 3)  # forward, dx, dweight


@pytest.mark.parametrize(("device", "dtype", "path"), list(_cases()))
def test_swiglu_paths(monkeypatch, decisions, device, dtype, path):
    _setup(monkeypatch, device, path)
    x_shape, N = ALIGNED[device]
    check_swiglu(*swiglu_inputs(x_shape, N, dtype=dtype, device=device))
    _expect(decisions, path, dtype, 3)  # forward, dx (two pairs), [dw_gate; dw_up]


@pytest.mark.parametrize(("device", "dtype", "path"), list(_cases()))
def test_grouped_paths(monkeypatch, decisions, device, dtype, path):
    _setup(monkeypatch, device, path)
    counts, K, N = COUNTS[device]
    check_grouped_linear(*linear_case(counts, K, N, dtype=dtype, device=device), "gelu")
    _expect(decisions, path, dtype, 3)  # forward, dx, dweight + dbias
    decisions.clear()
    x, wg, wu, offsets = swiglu_case(counts, K, N, dtype=dtype, device=device)
    check_grouped_swiglu(x, wg, wu, offsets)
    _expect(decisions, path, dtype, 3)


@pytest.mark.parametrize("device", DEVICES)
def test_unaligned_falls_back_to_pointers(monkeypatch, decisions, device):
    """Under SMPTK_GEMM_PATH=tma, rows that are not 16-byte multiples cannot be described to TMA: every
    launch takes the pointer path and the results still match."""
    _setup(monkeypatch, device, "tma")
    dtype = torch.float16
    x_shape, N = UNALIGNED[device]
    check_fused_linear(*linear_inputs(x_shape, N, dtype=dtype, device=device, bias=True), "gelu")
    assert decisions == [False] * 3, decisions


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
def test_empty_reduction(monkeypatch, device, path):
    """K = 0: the product is empty, so y = act(bias) (the Triton path used to crash here)."""
    _setup(monkeypatch, device, path)
    x = torch.randn(5, 0, device=device, dtype=torch.float16, requires_grad=True)
    w = torch.randn(24, 0, device=device, dtype=torch.float16, requires_grad=True)
    b = torch.randn(24, device=device, dtype=torch.float16, requires_grad=True)
    from smptk.kernels import fused_linear

    y = fused_linear(x, w, b, activation="gelu")
    torch.testing.assert_close(
        y, torch.nn.functional.gelu(b.float()).half().expand(5, 24), rtol=1e-3, atol=1e-3
    )
    y.float().sum().backward()
    assert x.grad.shape == (5, 0) and w.grad.shape == (24, 0)
    bf = b.detach().float().requires_grad_()
    (torch.nn.functional.gelu(bf).sum() * 5).backward()  # dbias = 5 rows of gelu'(b)
    torch.testing.assert_close(b.grad.float(), bf.grad, rtol=2e-3, atol=2e-3)


def test_auto_never_picks_tma_off_hopper(monkeypatch, decisions):
    """``auto`` takes TMA only on sm_90+ CUDA devices: under the interpreter (or on an older GPU) it
    launches the pointer path."""
    monkeypatch.setenv("SMPTK_GEMM_PATH", "auto")
    device = "cuda" if HAS_CUDA else "cpu"
    use_path(monkeypatch, "triton", device)
    x_shape, N = ALIGNED[device]
    dtype = torch.float16
    check_fused_linear(*linear_inputs(x_shape, N, dtype=dtype, device=device, bias=False), None)
    hopper = device == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    assert decisions == [hopper] * 3, decisions


@pytest.mark.parametrize(
    ("version", "drops"), [("3.6.0", True), ("3.9.0", False), ("3.10.1+git0a1b2c3", False)]
)
def test_tma_configs_follow_the_installed_triton(monkeypatch, version: str, drops: bool):
    """Before Triton 3.9 a device-side tensor descriptor is filled by every thread, and the grouped forward's
    per-tile ones cost it its 256-wide tiles when it stores the pre-activation (they spilled on sm_90 with
    Triton 3.6): the launcher leaves them out there, and the compile table (``specializations``) lists
    exactly the configs the launcher can pick, per op kind and epilogue."""
    monkeypatch.setattr(_gemm.triton, "__version__", version)
    monkeypatch.setattr(_gemm.runtime, "interpreter_enabled", lambda: False)  # the GPU's config lists
    wide = {c for c in _gemm._TMA_CONFIGS if max(c.block_m, c.block_n) == 256}
    assert len(wide) == 2, "the test expects the 128x256 and 256x128 tiles"
    grouped_z = set(_gemm._configs(True, _gemm.DUAL_NONE, torch.bfloat16, _gemm.GROUP_ROWS, True))
    assert grouped_z == set(_gemm._TMA_CONFIGS) - wide if drops else set(_gemm._TMA_CONFIGS)
    for grouping, store_z in ((_gemm.GROUP_ROWS, False), (_gemm.GROUP_NONE, True), (_gemm.GROUP_NONE, False)):
        assert _gemm._configs(True, _gemm.DUAL_NONE, torch.bfloat16, grouping, store_z) == _gemm._TMA_CONFIGS
    assert (
        _gemm._configs(False, _gemm.DUAL_NONE, torch.bfloat16, _gemm.GROUP_ROWS, True) == _gemm._PTR_CONFIGS
    )
    for full in (False, True):
        for s in _gemm.specializations(full=full):
            c = s.constexprs
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(s.dtype, torch.float32)
            launcher = _gemm._configs(c["TMA"], c["DUAL"], dtype, c["GROUPING"], c["STORE_Z"])
            if s.dtype == "fp32":  # the precision follows torch's TF32 flag at launch; the table names it
                launcher = _gemm._ptr_configs(c["DUAL"], c["PRECISION"])
            assert s.config in launcher, f"{s.id}: a config the launcher does not pick"
    grouped_fwd = [
        s for s in _gemm.specializations(full=True) if s.name.startswith("grouped_fwd-") and s.path == "tma"
    ]
    z_tiles = {s.config for s in grouped_fwd if s.constexprs["STORE_Z"]}
    assert z_tiles.isdisjoint(wide) == drops and z_tiles | wide >= set(_gemm._TMA_CONFIGS)
    plain_tiles = {s.config for s in grouped_fwd if not s.constexprs["STORE_Z"]}
    assert plain_tiles == set(_gemm._TMA_CONFIGS), "only the pre-activation store loses tiles"


@pytest.mark.parametrize("device", DEVICES)
def test_expanded_operand_takes_pointers(monkeypatch, decisions, device):
    """A stride-0 (``expand``-ed) operand is 16-byte aligned but not something a tensor map describes:
    under SMPTK_GEMM_PATH=tma the launches that read it take the pointer path, the others TMA, and the
    values and gradients match the fp32 reference."""
    _setup(monkeypatch, device, "tma")
    from smptk.kernels import fused_linear

    (M, K), N = ALIGNED[device]
    row = torch.randn(1, K, device=device, dtype=torch.float16, requires_grad=True)
    w = torch.randn(N, K, device=device, dtype=torch.float16, requires_grad=True)
    x = row.expand(M, K)
    assert x.stride() == (0, 1)
    y = fused_linear(x, w, activation="gelu")
    dy = torch.randn_like(y)
    y.backward(dy)
    # forward reads x (pointers), dx = dy @ w (TMA), dw = dy^T @ x (pointers)
    assert decisions == [False, True, False], decisions
    rf, wf = row.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    yf = torch.nn.functional.gelu(rf.expand(M, K) @ wf.T)
    yf.backward(dy.float())
    torch.testing.assert_close(y.float(), yf, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(row.grad.float(), rf.grad, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(w.grad.float(), wf.grad, rtol=2e-2, atol=5e-2)
