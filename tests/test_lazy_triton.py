"""Triton is imported on the first Triton-path call, not when smptk is imported (smptk.kernels._triton).

A child process (no ``TRITON_INTERPRET``, no ``SMPTK_*`` variables) imports every package, runs every public
op and the MoE layer on the PyTorch path (forced, and chosen by ``auto`` for CPU tensors without the
interpreter), runs the four collectives of ``smptk.comm`` on a one-rank gloo group (CPU tensors without the
interpreter: no heap applies, so they fall back to torch.distributed after checking their arguments and
op), collects the environment as ``smptk info`` does, and checks after each step that neither
``triton`` nor any kernel module is in ``sys.modules``. It then sets ``TRITON_INTERPRET=1`` (after
``import smptk.kernels``, which is now early enough) and runs the Triton path: that imports triton, builds the
kernels for the interpreter, and gives the reference results.

A second child runs ops on meta tensors first: torch's meta kernels import ``torch._dynamo``, which imports
triton (without the interpreter), so a ``TRITON_INTERPRET=1`` set afterwards is too late for Triton's own
library functions; the Triton path must then say so instead of crashing inside Triton. One result per step,
so a failure names it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import old_interpreter_reason

from smptk.kernels import _triton

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent(
    r"""
    import json, os, sys, traceback

    KERNELS = ("_gemm", "_epilogue", "_index", "_moe_route_kernels", "_moe_dispatch_kernels", "collectives")
    KERNEL_MODULES = ["smptk.kernels." + m for m in KERNELS]
    results = {}

    def loaded():
        return [m for m in ["triton", *KERNEL_MODULES] if m in sys.modules]

    def check(name, fn, expect_triton=False, torch_may_import_triton=False):
        try:
            fn()
            if expect_triton:
                assert "triton" in sys.modules, "the Triton path ran without importing triton"
            elif torch_may_import_triton:
                assert not [m for m in loaded() if m != "triton"], f"imported: {loaded()}"
            else:
                assert not loaded(), f"imported: {loaded()}"
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=4)

    def imports():
        import smptk, smptk.kernels, smptk.comm, smptk.parallel, smptk.settings, smptk.testing, smptk.cli
        import smptk.comm.adapters, smptk.comm.simulated
        from smptk.kernels import runtime
        assert runtime.triton_available() and runtime.interpreter_at_import() is None

    check("imports", imports)

    import torch
    import torch.nn.functional as F
    from smptk.kernels import (fused_linear, grouped_linear, grouped_swiglu, moe_combine, moe_dispatch,
                               moe_route, runtime, swiglu)
    from smptk.parallel import MoE

    torch.manual_seed(0)
    x, w, b = torch.randn(5, 8, requires_grad=True), torch.randn(6, 8), torch.randn(6)
    w3, offsets = torch.randn(3, 6, 8), torch.tensor([0, 2, 2, 5])
    logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 1.0, 2.0], [1.0, 1.0, 0.0], [1.0, 0.0, 3.0]])

    def close(a, ref):
        torch.testing.assert_close(a, ref, rtol=1e-4, atol=1e-4)

    def every_op():
        y = fused_linear(x, w, b, activation="gelu")
        close(y, F.gelu(F.linear(x, w, b)))
        y.sum().backward()
        close(swiglu(x, w, w * 0.5), F.silu(F.linear(x, w)) * F.linear(x, w * 0.5))
        close(grouped_linear(x, w3, offsets)[:2], x[:2] @ w3[0].T)
        close(grouped_swiglu(x, w3, w3, offsets)[2:], F.silu(x[2:] @ w3[2].T) * (x[2:] @ w3[2].T))
        r = moe_route(logits, 2)
        assert r.expert_ids.tolist() == [[0, 2], [2, 1], [0, 1], [2, 0]], r.expert_ids
        xt = torch.arange(8.0).view(4, 2)
        xg, plan = moe_dispatch(xt, r.expert_ids, 3)
        assert torch.equal(moe_combine(xg, plan, torch.full((4, 2), 0.5)), xt)

    def moe_layer():
        moe = MoE(8, 12, num_experts=4, top_k=2, num_shared_experts=1)
        moe(torch.randn(2, 3, 8)).square().mean().backward()
        assert moe.w_gate.grad is not None

    def forced_torch():
        os.environ["SMPTK_KERNELS"] = "torch"
        try:
            every_op()
            moe_layer()
        finally:
            del os.environ["SMPTK_KERNELS"]

    def auto_on_cpu_without_interpreter():
        assert runtime.select_path(x) == "torch"
        every_op()
        moe_layer()

    def comm_fallback():
        import tempfile
        import torch.distributed as dist
        import smptk.comm as comm
        with tempfile.TemporaryDirectory() as d:
            dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
            try:
                t, out = torch.arange(4.0), torch.full((4,), float("nan"))
                comm.all_reduce(t, op="max")
                comm.reduce_scatter_tensor(out, t, op="avg")
                comm.all_gather_into_tensor(out, t)
                comm.all_to_all_single(out, t, torch.tensor([4]), [4])
                assert torch.equal(out, torch.arange(4.0)), out
                assert comm.last_path() == "torch.distributed:gloo", comm.last_path()
            finally:
                dist.destroy_process_group()

    def info():
        from smptk._env import collect_environment
        env = collect_environment()
        assert env["triton"], env["triton"]  # the version, read from the package metadata
        assert env["kernel_path"]["cpu"] == "torch", env["kernel_path"]

    def meta_tensors():
        # Meta tensors take the PyTorch path whatever is asked. torch's own meta kernels import
        # torch._dynamo, which imports triton (torch.utils._triton.has_triton_package): triton may be
        # loaded afterwards, but not by smptk, and no kernel module is.
        os.environ["SMPTK_KERNELS"] = "triton"
        try:
            xm, wm = torch.empty(5, 8, device="meta"), torch.empty(6, 8, device="meta")
            assert fused_linear(xm, wm).shape == (5, 6) and swiglu(xm, wm, wm).shape == (5, 6)
        finally:
            del os.environ["SMPTK_KERNELS"]

    def interpreter_after_torch_imported_triton():
        assert "triton" in sys.modules and runtime.interpreter_at_import() is False
        os.environ["TRITON_INTERPRET"] = "1"  # too late: triton's library functions are compiled
        try:
            fused_linear(x, w)
        except RuntimeError as e:
            assert "set TRITON_INTERPRET=1 before triton is imported" in str(e), str(e)
        else:
            raise AssertionError("the Triton path ran with compiled library functions on CPU tensors")
        os.environ["SMPTK_KERNELS"] = "torch"  # the way out the message names
        close(fused_linear(x, w), F.linear(x, w))

    def triton_path():
        os.environ["TRITON_INTERPRET"] = "1"  # after import smptk.kernels: the kernels are not built yet
        assert runtime.select_path(x) == "triton" and runtime.interpreter_at_import() is None
        every_op()
        assert runtime.interpreter_at_import() is True
        assert all(m in sys.modules for m in KERNEL_MODULES if not m.endswith("collectives")), loaded()

    if sys.argv[1] == "lazy":
        for fn in (forced_torch, auto_on_cpu_without_interpreter, comm_fallback, info):
            check(fn.__name__, fn)
        check("triton_path", triton_path, expect_triton=True)
    else:
        check("meta_tensors", meta_tensors, torch_may_import_triton=True)
        check("interpreter_after_torch_imported_triton", interpreter_after_torch_imported_triton, True)
    print("RESULTS " + json.dumps(results))
    """
)

CHECKS = {
    "lazy": [
        "imports",
        "forced_torch",
        "auto_on_cpu_without_interpreter",
        "comm_fallback",
        "info",
        "triton_path",
    ],
    "torch-first": ["imports", "meta_tensors", "interpreter_after_torch_imported_triton"],
}


@pytest.fixture(scope="module", params=list(CHECKS))
def child_results(request) -> tuple[str, dict[str, str]]:
    if not _triton.available():
        pytest.skip("triton is not installed: tests/test_no_triton.py covers that case")
    if request.param == "lazy" and old_interpreter_reason():
        pytest.skip(old_interpreter_reason())  # its last check runs a Triton op under the interpreter
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("SMPTK_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, request.param],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return request.param, json.loads(lines[-1].removeprefix("RESULTS "))


def test_triton_imported_on_first_triton_call(child_results: tuple[str, dict[str, str]]) -> None:
    mode, results = child_results
    assert list(results) == CHECKS[mode]
    failed = {name: trace for name, trace in results.items() if trace != "ok"}
    assert not failed, "\n".join(f"{name}:\n{trace}" for name, trace in failed.items())


def test_kernel_module_handle_imports_on_first_attribute(tmp_path, monkeypatch) -> None:
    """The handle imports its module on the first ordinary attribute, once; introspection (``__wrapped__``,
    which doctest and inspect.unwrap ask for) does not import it."""
    (tmp_path / "smptk_lazy_probe.py").write_text("IMPORTS = []\nIMPORTS.append(1)\nVALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "smptk_lazy_probe", raising=False)
    handle = _triton.kernel_module("smptk_lazy_probe")
    assert "not imported yet" in repr(handle)
    assert not hasattr(handle, "__wrapped__")
    assert "smptk_lazy_probe" not in sys.modules
    assert handle.VALUE == 7 and handle.VALUE == 7
    assert sys.modules["smptk_lazy_probe"].IMPORTS == [1] and "(imported)" in repr(handle)
    with pytest.raises(AttributeError):
        _ = handle.MISSING
