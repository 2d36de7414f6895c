"""The MoE benchmark's pure pieces (FLOP, byte and memory counts, the case grid, the baselines' math) and
one tiny end-to-end ``python -m bench --filter`` run of it.

The baselines are checked against smptk.testing's fp32 MoE reference in fp32 on CPU (values, and the
grouped-mm baseline's gradients against the eager loop's), so a benchmark row never times a wrong
baseline. The end-to-end run selects the T=7 Mixtral-like forward cases without
torch.compile (6 cases, about 6 s here) and checks that the derived fields (``routing_share``,
``pct_of_dense``) are the ratios of the rows' own medians and that the report shows them.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# `bench` lives at the repository root beside `smptk`; pytest's `pythonpath = ["."]` makes it importable.
import bench.test_bench_moe as moe_bench
from bench.counts import (
    linear_flops,
    moe_layer_bytes,
    moe_layer_flops,
    moe_memory_estimate,
    moe_routing_bytes,
)
from bench.report import _fmt
from bench.rows import read_rows
from smptk.testing.moe_layer import moe_layer_reference

ROOT = Path(__file__).resolve().parent.parent
E2E_FILTER = "moe and mixtral and T7 and fwd and not fwd_bwd and not torch_compile"


# ----------------------------------------------------------------------------- counts
@pytest.mark.parametrize(
    ("T", "H", "F", "E", "k"), [(4096, 4096, 14336, 8, 2), (7, 16, 8, 7, 3), (1, 1, 1, 1, 1)]
)
def test_moe_layer_flops_are_router_plus_three_gemms_per_pair(T: int, H: int, F: int, E: int, k: int) -> None:
    fwd = moe_layer_flops(tokens=T, hidden=H, ffn=F, experts=E, top_k=k, backward=False)
    assert fwd == 2 * T * H * E + 3 * 2 * T * k * H * F
    as_gemms = linear_flops(m=T, k=H, n=E, backward=False) + linear_flops(
        m=T * k, k=H, n=F, backward=False, gemms=3
    )
    assert fwd == as_gemms
    assert moe_layer_flops(tokens=T, hidden=H, ffn=F, experts=E, top_k=k, backward=True) == 3 * fwd


def test_moe_layer_flops_mixtral_value() -> None:
    # 2*4096*4096*8 + 6*4096*2*4096*14336
    assert moe_layer_flops(tokens=4096, hidden=4096, ffn=14336, experts=8, top_k=2, backward=False) == (
        268_435_456 + 2_886_218_022_912
    )


def test_moe_layer_bytes() -> None:
    # T=7, H=16, F=24, E=4: x 112, router 64, experts 3*4*24*16 = 4608, y 112; fp16.
    assert moe_layer_bytes(tokens=7, hidden=16, ffn=24, experts=4, top_k=2, elem=2, backward=False) == (
        (112 + 64 + 4608 + 112) * 2
    )
    fwd = 112 + 64 + 4608 + 112
    bwd = 112 + 112 + 4672 + 112 + 4672  # dy, x, weights read; dx, dW written
    assert (
        moe_layer_bytes(tokens=7, hidden=16, ffn=24, experts=4, top_k=2, elem=4, backward=True)
        == (fwd + bwd) * 4
    )


def test_moe_routing_bytes() -> None:
    # T=7, H=16, E=4, k=2 (P=14), fp16 rows, fp32 logits/weights, int32 ids.
    route = 7 * 4 * 4 + 14 * 4 + 14 * 4
    dispatch = 7 * 16 * 2 + 14 * 16 * 2
    combine = 14 * 16 * 2 + 14 * 4 + 7 * 16 * 2
    fwd = route + dispatch + combine
    assert moe_routing_bytes(tokens=7, hidden=16, experts=4, top_k=2, elem=2, backward=False) == fwd == 1624
    bwd = (
        (7 * 16 * 2 + 14 * 4 + 2 * 14 * 16 * 2 + 14 * 4)
        + (14 * 16 * 2 + 7 * 16 * 2)
        + (14 * 4 + 2 * 7 * 4 * 4)
    )
    assert moe_routing_bytes(tokens=7, hidden=16, experts=4, top_k=2, elem=2, backward=True) == fwd + bwd


@pytest.mark.parametrize("shape", moe_bench.MEASURE_SHAPES, ids=lambda s: s.name)
def test_largest_measure_cases_fit_in_80_gb(shape: moe_bench.MoEShape) -> None:
    """The T=32768 fwd+bwd cases must run on an 80 GB GPU (the brief's requirement), by the estimate."""
    s = shape
    est = {
        (T, bwd): moe_memory_estimate(
            tokens=T, hidden=s.H, ffn=s.F, experts=s.E, top_k=s.k, elem=2, backward=bwd
        )
        for T in moe_bench.MEASURE_T
        for bwd in (False, True)
    }
    assert max(est.values()) == est[(32768, True)] < 70 * 2**30  # headroom under 80 GB for the allocator
    # The estimate covers the layer's own weights, their gradients and the grouped rows at the least.
    weights = (s.E * s.H + 3 * s.E * s.F * s.H) * 2
    assert est[(32768, True)] > 2 * weights + 32768 * s.k * (2 * s.H + 2 * s.F) * 2
    assert all(est[(T, False)] < est[(T, True)] for T in moe_bench.MEASURE_T)


# ----------------------------------------------------------------------------- cases
def test_case_grid_and_order() -> None:
    measure, quick = moe_bench.build_cases(quick=False), moe_bench.build_cases(quick=True)
    # measure: 2 configs x 3 T x 2 passes (x 4 impls for the layer); grouped: Mixtral-like x 3 T x 2 x 2
    assert [len(measure[k]) for k in ("routing", "layer", "grouped")] == [12, 48, 12]
    # quick: 2 x 2 x 2; layer 2 x 2 x 2 x 3 + torch_compile at the last T only (2 x 2); grouped 2 x 2 x 2
    assert [len(quick[k]) for k in ("routing", "layer", "grouped")] == [8, 28, 8]
    for cases in (measure, quick):
        ids = [c.id for group in cases.values() for c in group]
        assert len(ids) == len(set(ids))
        grouped = cases["grouped"]
        for dense, ours in zip(grouped[::2], grouped[1::2], strict=True):  # dense runs first, same case
            assert (dense.impl, ours.impl) == ("torch_matmul", "smptk")
            assert (dense.t, dense.pass_) == (ours.t, ours.pass_)
            assert dense.fields()["shape"] == ours.fields()["shape"]  # the report pairs them
        # Every layer case shares (config, T, pass) with a routing case, whose test runs first.
        keys = {(c.shape.name, c.t, c.pass_) for c in cases["routing"]}
        assert {(c.shape.name, c.t, c.pass_) for c in cases["layer"]} == keys
    source = inspect.getsource(moe_bench)
    assert source.index("def test_moe_routing(") < source.index("def test_moe_layer(")
    assert measure["layer"][0].id == "moe_layer-fwd-mixtral-E8-k2-H4096-F14336-T4096-smptk"
    fields = measure["layer"][0].fields()
    assert fields["suite"] == "moe" and fields["shape"] == {"T": 4096, "H": 4096, "F": 14336, "E": 8, "k": 2}


def test_even_offsets() -> None:
    assert moe_bench.even_offsets(14, 4).tolist() == [0, 3, 7, 10, 14]
    assert moe_bench.even_offsets(65536, 8).tolist() == [8192 * e for e in range(9)]
    assert moe_bench.even_offsets(3, 7).tolist() == [0, 0, 0, 1, 1, 2, 2, 3]


# ----------------------------------------------------------------------------- baselines
def _layer_inputs(T: int, H: int, F: int, E: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(T, H, generator=g),
        torch.randn(E, H, generator=g),  # router std 1: a spread of scores, few near-ties
        torch.randn(E, F, H, generator=g) * H**-0.5,
        torch.randn(E, F, H, generator=g) * H**-0.5,
        torch.randn(E, H, F, generator=g) * F**-0.5,
    ]


@pytest.mark.parametrize(("T", "H", "F", "E", "k"), [(33, 16, 8, 7, 3), (7, 16, 24, 4, 2), (1, 8, 8, 3, 3)])
def test_baselines_match_the_fp32_reference(T: int, H: int, F: int, E: int, k: int) -> None:
    args = _layer_inputs(T, H, F, E, seed=T * 100 + E)
    ref, _ = moe_layer_reference(*args, k)
    loop = moe_bench.eager_loop_moe(*args, k)
    torch.testing.assert_close(loop, ref, rtol=1e-5, atol=1e-5)
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    grouped = moe_bench.grouped_mm_moe(*args, k)
    torch.testing.assert_close(grouped, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_grouped_mm_baseline_gradients_match_the_eager_loop() -> None:
    args = [a.requires_grad_() for a in _layer_inputs(33, 16, 8, 7, seed=5)]
    dy = torch.randn(33, 16, generator=torch.Generator().manual_seed(6))
    grads = []
    for fn in (moe_bench.eager_loop_moe, moe_bench.grouped_mm_moe):
        fn(*args, 3).backward(dy)
        grads.append([a.grad.clone() for a in args])
        for a in args:
            a.grad = None
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_routing_case_returns_x() -> None:
    """combine(dispatch(x)) with renormalized weights is x: the routing case's own check."""
    x = torch.randn(33, 16, dtype=torch.float16)
    logits = torch.randn(33, 7)
    out, routing = moe_bench.routing_forward(logits, x, 3, 7)
    assert out.dtype == x.dtype and routing.expert_ids.shape == (33, 3)
    torch.testing.assert_close(out.float(), x.float(), rtol=2e-3, atol=1e-3)


# ----------------------------------------------------------------------------- end to end
def _subprocess_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMPTK_BENCH_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _median(row: dict) -> float:
    return row["time_s"]["median"]


def test_quick_moe_bench_end_to_end(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--filter", E2E_FILTER, "--out", str(tmp_path)],
        cwd=ROOT, env=_subprocess_env(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (jsonl,) = sorted(tmp_path.rglob("*.jsonl"))
    rows = list(read_rows(jsonl))
    assert all(r["kind"] == "measurement" and r["suite"] == "moe" for r in rows), [
        r.get("reason") for r in rows
    ]
    by = {(r["op"], r["impl"]): r for r in rows}
    assert sorted(by) == [
        ("grouped_gemm", "smptk"),
        ("grouped_gemm", "torch_matmul"),
        ("moe_layer", "eager_loop"),
        ("moe_layer", "smptk"),
        ("moe_layer", "torch_grouped_mm"),
        ("moe_routing", "smptk_routing"),
    ]
    for r in rows:
        assert r["pass"] == "fwd" and r["tokens"] == 7 and r["config"] == "mixtral"
        assert r["time_s"]["median"] > 0 and r["check"]["max_abs_err"] <= r["check"]["tol"]
    layer = [r for r in rows if r["op"] == "moe_layer"]
    flops = moe_layer_flops(tokens=7, hidden=16, ffn=24, experts=4, top_k=2, backward=False)
    assert {r["flops"] for r in layer} == {flops}
    assert {str(r["shape"]) for r in layer} == {str({"E": 4, "F": 24, "H": 16, "T": 7, "k": 2})}
    share = by[("moe_layer", "smptk")]["routing_share"]
    assert share == pytest.approx(
        _median(by[("moe_routing", "smptk_routing")]) / _median(by[("moe_layer", "smptk")])
    )
    assert by[("moe_layer", "eager_loop")].get("routing_share") is None
    dense, grouped = by[("grouped_gemm", "torch_matmul")], by[("grouped_gemm", "smptk")]
    assert dense["flops"] == grouped["flops"] == 2 * 14 * 16 * 24
    assert grouped["pct_of_dense"] == pytest.approx(100 * grouped["tflops"] / dense["tflops"])
    assert by[("moe_routing", "smptk_routing")]["flops"] == 0
    page = jsonl.with_suffix(".html").read_text()
    assert "speedup vs eager_loop" in page and "% of layer time" in page
    assert 'aria-label="GB/s by shape' in page  # the routing section counts no FLOPs: charted in GB/s
    assert f"<td>{_fmt(100 * share, 3)}%</td></tr>" in page  # the share column of the smptk row
