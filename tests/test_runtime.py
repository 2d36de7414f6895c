"""The SMPTK_KERNELS switch (smptk.kernels.runtime): values, per-call reading, and which path runs.

``select_path`` is tested directly with the interpreter and the Triton install monkeypatched, and end to
end through ``fused_linear`` / ``swiglu`` by counting launches of the shared Triton GEMM launcher
(``smptk.kernels._gemm._Launch.run``, which every Triton GEMM goes through).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from helpers import (
    NO_INTERPRETER_REASON,
    check_fused_linear,
    check_swiglu,
    linear_inputs,
    old_interpreter_reason,
    one_rank_group,
    swiglu_inputs,
)

from smptk.kernels import _gemm, fused_linear, moe_route, runtime, swiglu

CPU = torch.empty(2, device="cpu")
CPU_BF16 = torch.empty(2, device="cpu", dtype=torch.bfloat16)
# select_path reads only ``.device`` and ``.dtype``; a stand-in lets the CUDA branch run without a GPU.
FAKE_CUDA = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)
FAKE_CUDA_BF16 = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)


@pytest.fixture
def interpreter(monkeypatch):
    """Set what ``runtime.interpreter_enabled()`` reports: ``interpreter(True)`` / ``interpreter(False)``;
    the kernels count as built in that state (``runtime.interpreter_at_import()``)."""

    def set_to(on: bool) -> None:
        monkeypatch.setattr(runtime, "interpreter_enabled", lambda: on)
        monkeypatch.setattr(runtime, "interpreter_at_import", lambda: on)

    return set_to


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "auto"),
        ("", "auto"),
        ("auto", "auto"),
        ("triton", "triton"),
        ("torch", "torch"),
        (" Triton ", "triton"),
        ("TORCH", "torch"),
    ],
    ids=["unset", "empty", "auto", "triton", "torch", "padded-mixed-case", "upper-case"],
)
def test_requested_path_values(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("SMPTK_KERNELS", raising=False)
    else:
        monkeypatch.setenv("SMPTK_KERNELS", value)
    assert runtime.requested_path() == expected


@pytest.mark.parametrize("value", ["cuda", "triton,torch", "1", "pytorch"])
def test_invalid_value_is_an_error(monkeypatch, value):
    monkeypatch.setenv("SMPTK_KERNELS", value)
    with pytest.raises(ValueError, match="SMPTK_KERNELS") as info:
        runtime.select_path(CPU)
    assert repr(value.strip().lower()) in str(info.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True), ("true", True), ("Yes", True), ("ON", True), ("y", True),
        ("0", False), ("", False), ("no", False), ("bogus", False), (" on ", False),
    ],
)  # fmt: skip
def test_interpreter_enabled_reads_triton_interpret_as_triton_does(monkeypatch, value, expected):
    """Triton's reading decides whether kernels are interpreted, so ours must agree with it exactly
    (it lower-cases, does not strip, and takes anything unknown as off)."""
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert runtime.interpreter_enabled() is expected
    if runtime.triton_available():
        from triton._C.libtriton import getenv_bool

        assert getenv_bool("TRITON_INTERPRET", False) is expected


SELECT_CASES = [
    ("auto", True, "cpu", "triton"),
    ("auto", False, "cpu", "torch"),
    ("auto", False, "cuda", "triton"),
    ("auto", True, "cuda", "triton"),
    ("torch", True, "cpu", "torch"),
    ("torch", False, "cuda", "torch"),
    ("triton", True, "cpu", "triton"),
    ("triton", False, "cuda", "triton"),
]


@pytest.mark.parametrize(
    ("requested", "interpret", "device", "expected"),
    [pytest.param(*c, id=f"{c[0]}-{'interp' if c[1] else 'no-interp'}-{c[2]}") for c in SELECT_CASES],
)
def test_select_path(monkeypatch, interpreter, requested, interpret, device, expected):
    monkeypatch.setenv("SMPTK_KERNELS", requested)
    interpreter(interpret)
    assert runtime.select_path(CPU if device == "cpu" else FAKE_CUDA) == expected


def test_forced_triton_on_cpu_without_interpreter_is_an_error(monkeypatch, interpreter):
    monkeypatch.setenv("SMPTK_KERNELS", "triton")
    interpreter(False)
    with pytest.raises(RuntimeError, match=r"SMPTK_KERNELS=triton.*TRITON_INTERPRET=1"):
        runtime.select_path(CPU)


def test_bf16_on_cpu_interpreter_takes_torch_under_auto(monkeypatch, interpreter):
    """Triton's interpreter gets bf16 tl.dot wrong, so auto must not send bf16 CPU tensors there."""
    interpreter(True)
    monkeypatch.setenv("SMPTK_KERNELS", "auto")
    assert runtime.select_path(CPU_BF16) == "torch"
    assert runtime.select_path(CPU) == "triton"
    assert runtime.select_path(FAKE_CUDA_BF16) == "triton"


def test_forced_triton_bf16_on_cpu_interpreter_is_an_error(monkeypatch, interpreter):
    interpreter(True)
    monkeypatch.setenv("SMPTK_KERNELS", "triton")
    with pytest.raises(RuntimeError, match=r"SMPTK_KERNELS=triton.*bf16"):
        runtime.select_path(CPU_BF16)


def test_forced_triton_without_triton_installed_is_an_error(monkeypatch, interpreter):
    monkeypatch.setattr(runtime, "triton_available", lambda: False)
    interpreter(True)
    monkeypatch.setenv("SMPTK_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="not installed"):
        runtime.select_path(FAKE_CUDA)
    monkeypatch.setenv("SMPTK_KERNELS", "auto")
    assert runtime.select_path(FAKE_CUDA) == "torch"
    assert runtime.select_path(CPU) == "torch"


def test_switch_is_read_at_every_call(monkeypatch, interpreter):
    interpreter(True)
    monkeypatch.setenv("SMPTK_KERNELS", "torch")
    assert runtime.select_path(CPU) == "torch"
    monkeypatch.setenv("SMPTK_KERNELS", "triton")
    assert runtime.select_path(CPU) == "triton"
    monkeypatch.setenv("SMPTK_KERNELS", "bogus")
    with pytest.raises(ValueError, match="SMPTK_KERNELS"):
        runtime.select_path(CPU)


@pytest.mark.parametrize(
    ("requested", "interpret", "expected"),
    [
        (
            "auto",
            True,
            {"cpu": "triton (interpreter; bfloat16 GEMMs: torch)", "cuda": "triton (interpreter)"},
        ),
        # forced: a bf16 GEMM under the interpreter raises (it does not fall back)
        (
            "triton",
            True,
            {"cpu": "triton (interpreter; bfloat16 GEMMs: an error)", "cuda": "triton (interpreter)"},
        ),
        ("auto", False, {"cpu": "torch", "cuda": "triton"}),
        ("torch", True, {"cpu": "torch", "cuda": "torch"}),
        ("triton", False, {"cpu": "error: triton cannot run here", "cuda": "triton"}),
    ],
    ids=["auto-interp", "triton-interp", "auto-no-interp", "torch", "triton-no-interp"],
)
def test_describe(monkeypatch, interpreter, requested, interpret, expected):
    monkeypatch.setenv("SMPTK_KERNELS", requested)
    interpreter(interpret)
    got = runtime.describe()
    assert got == {"requested": requested, "interpreter": "on" if interpret else "off", **expected}


# --- end to end: which implementation a public call runs ---------------------------------------------


@pytest.fixture
def launches(monkeypatch):
    """Counts calls of the Triton GEMM launcher while still launching."""
    calls = []
    real = _gemm._Launch.run

    def counting(self):
        calls.append((self.grouping, self.dual))
        return real(self)

    monkeypatch.setattr(_gemm._Launch, "run", counting)
    return calls


def _run_ops():
    check_fused_linear(*linear_inputs((7, 40), 17, dtype=torch.float32, device="cpu", bias=True), "gelu")
    check_swiglu(*swiglu_inputs((7, 40), 17, dtype=torch.float32, device="cpu"))


@pytest.mark.parametrize("requested", ["triton", "auto"])
def test_triton_path_launches_triton(monkeypatch, launches, requested):
    if not runtime.interpreter_enabled():
        pytest.skip(NO_INTERPRETER_REASON)
    monkeypatch.setenv("SMPTK_KERNELS", requested)
    _run_ops()
    # fused_linear: forward, dx, dweight; swiglu: forward, dx, both dweights in one.
    assert len(launches) == 6, launches


def test_torch_path_launches_nothing(monkeypatch, launches):
    monkeypatch.setenv("SMPTK_KERNELS", "torch")
    _run_ops()
    assert launches == []


def test_auto_without_interpreter_runs_torch_on_cpu(monkeypatch, interpreter, launches):
    monkeypatch.setenv("SMPTK_KERNELS", "auto")
    interpreter(False)
    _run_ops()
    assert launches == []


@pytest.mark.parametrize("op", ["fused_linear", "swiglu"])
def test_public_ops_refuse_forced_triton_without_interpreter(monkeypatch, interpreter, launches, op):
    monkeypatch.setenv("SMPTK_KERNELS", "triton")
    interpreter(False)
    x = torch.randn(3, 8)
    w = torch.randn(5, 8)
    with pytest.raises(RuntimeError, match="SMPTK_KERNELS=triton"):
        fused_linear(x, w) if op == "fused_linear" else swiglu(x, w, w)
    assert launches == []


@pytest.mark.parametrize("op", ["fused_linear", "swiglu"])
def test_public_ops_reject_invalid_switch(monkeypatch, op):
    monkeypatch.setenv("SMPTK_KERNELS", "fast")
    x = torch.randn(3, 8)
    w = torch.randn(5, 8)
    with pytest.raises(ValueError, match="SMPTK_KERNELS"):
        fused_linear(x, w) if op == "fused_linear" else swiglu(x, w, w)


@pytest.mark.parametrize("requested", ["auto", "triton"])
def test_dtensor_arguments_take_the_torch_path(monkeypatch, launches, requested):
    """A Triton kernel would read one rank's shard as the whole tensor: DTensor arguments run the PyTorch
    path (DTensor's sharding propagation gives the DTensor torch's ops give) under ``auto``, and are an
    error naming the fix under ``triton``."""
    if not runtime.interpreter_enabled():
        pytest.skip(NO_INTERPRETER_REASON)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    monkeypatch.setenv("SMPTK_KERNELS", requested)
    with one_rank_group():
        mesh = init_device_mesh("cpu", (1,))
        x = distribute_tensor(torch.randn(6, 8), mesh, [Replicate()])
        w = distribute_tensor(torch.randn(5, 8), mesh, [Shard(0)])
        logits = distribute_tensor(torch.randn(6, 4, dtype=torch.bfloat16), mesh, [Replicate()])
        if requested == "triton":
            for call in (lambda: fused_linear(x, w), lambda: swiglu(x, w, w), lambda: moe_route(logits, 2)):
                with pytest.raises(RuntimeError, match=r"DTensor.*to_local"):
                    call()
        else:
            y = fused_linear(x, w, activation="gelu")
            assert isinstance(y, DTensor)
            ref = torch.nn.functional.gelu(x.full_tensor() @ w.full_tensor().T)
            torch.testing.assert_close(y.full_tensor(), ref)
            assert runtime.select_path(logits, dot=False) == "torch"
    assert launches == []


def test_dot_free_kernels_keep_bf16_on_the_interpreter(interpreter, monkeypatch):
    """Kernels without ``tl.dot`` (MoE routing and dispatch) run bf16 on the interpreter: ``dot=False``."""
    monkeypatch.setenv("SMPTK_KERNELS", "auto")
    interpreter(True)
    assert runtime.select_path(CPU_BF16) == "torch"
    assert runtime.select_path(CPU_BF16, dot=False) == "triton"


def test_poison_env_fills_new_buffers_with_nan(monkeypatch):
    """SMPTK_POISON_OUTPUTS=1 is what makes the kernel tests catch unwritten elements: check it does."""
    from smptk.kernels._buffers import new_buffer

    monkeypatch.setenv("SMPTK_POISON_OUTPUTS", "1")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.isnan(new_buffer((3, 5), dtype, torch.device("cpu"))).all()


# --- TRITON_INTERPRET changed after import ------------------------------------------------------------------

LATE_INTERPRETER = textwrap.dedent(
    """
    import os
    import torch
    from smptk.kernels import fused_linear, moe_dispatch, moe_route, runtime, swiglu

    assert runtime.interpreter_at_import() is None  # triton is not imported yet
    import smptk.kernels._gemm  # as the first Triton-path call on a GPU does: triton and compiled kernels
    assert runtime.interpreter_at_import() is False
    os.environ["TRITON_INTERPRET"] = "1"  # too late: the kernels are compiled for a GPU
    assert runtime.interpreter_enabled()
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    calls = {
        "fused_linear": lambda: fused_linear(x, w),
        "swiglu": lambda: swiglu(x, w, w),
        "moe_route": lambda: moe_route(x, 2),
        "moe_dispatch": lambda: moe_dispatch(x, torch.zeros(3, 2, dtype=torch.int64), 4),
    }
    for requested in ("auto", "triton"):
        os.environ["SMPTK_KERNELS"] = requested
        for name, call in calls.items():
            try:
                call()
            except RuntimeError as e:
                assert "set TRITON_INTERPRET=1 before triton is imported" in str(e), (name, str(e))
            else:
                raise AssertionError(f"{name} ran under SMPTK_KERNELS={requested}")
    assert runtime.describe()["cpu"].startswith("error: TRITON_INTERPRET was set after"), runtime.describe()
    import torch.distributed as dist
    import smptk.comm as comm

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:  # the collectives say so too (they failed inside Triton's interpreter: "Cannot call @triton.jit'd")
        comm.all_reduce(torch.ones(4))
    except RuntimeError as e:
        assert "set TRITON_INTERPRET=1 before triton is imported" in str(e), str(e)
    else:
        raise AssertionError("comm.all_reduce ran")
    finally:
        dist.destroy_process_group()
    os.environ["SMPTK_KERNELS"] = "torch"  # the way out the message names
    torch.testing.assert_close(fused_linear(x, w), x @ w.T)
    print("LATE OK")
    """
)

EARLY_THEN_UNSET = textwrap.dedent(
    """
    import os
    import torch
    from smptk.kernels import fused_linear, runtime

    x, w = torch.randn(3, 8), torch.randn(5, 8)
    assert runtime.select_path(x) == "triton"
    torch.testing.assert_close(fused_linear(x, w), x @ w.T)  # builds the kernels, interpreted
    assert runtime.interpreter_at_import() is True
    del os.environ["TRITON_INTERPRET"]  # interpreted kernels, interpreter now off: CPU runs torch
    assert runtime.select_path(x) == "torch"
    torch.testing.assert_close(fused_linear(x, w), x @ w.T)
    print("EARLY OK")
    """
)


def _run_child(code: str, interpret: bool) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("SMPTK_")}
    env["PYTHONPATH"] = str(root)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(not runtime.triton_available(), reason="triton is not installed: no interpreter to set")
def test_interpreter_set_after_import_is_a_clear_error():
    """Triton fixes interpreted-or-compiled when triton is imported; setting TRITON_INTERPRET later
    used to end in Triton's "0 active drivers" crash on CPU tensors. Now every op says what to do."""
    proc = _run_child(LATE_INTERPRETER, interpret=False)
    assert proc.returncode == 0 and "LATE OK" in proc.stdout, proc.stderr[-4000:]


@pytest.mark.skipif(not runtime.triton_available(), reason="triton is not installed: no interpreter to set")
@pytest.mark.skipif(old_interpreter_reason() is not None, reason=str(old_interpreter_reason()))
def test_interpreter_unset_after_import_runs_torch_on_cpu():
    proc = _run_child(EARLY_THEN_UNSET, interpret=True)
    assert proc.returncode == 0 and "EARLY OK" in proc.stdout, proc.stderr[-4000:]


COMPILED_TORCH_PATH = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    import triton  # imported, as on a machine with Triton: the path check then reads what the import found
    from smptk.kernels import fused_linear, runtime, swiglu

    x, w, wu = torch.randn(5, 12), torch.randn(7, 12), torch.randn(7, 12)
    assert runtime.select_path(x, w) == "torch"  # CPU without the interpreter
    f = torch.compile(lambda a, b, c: (fused_linear(a, b, activation="gelu"), swiglu(a, b, c)),
                      fullgraph=True, backend="eager")
    y, s = f(x, w, wu)
    torch.testing.assert_close(y, F.gelu(F.linear(x, w)))
    torch.testing.assert_close(s, F.silu(F.linear(x, w)) * F.linear(x, wu))
    print("COMPILED OK")
    """
)


@pytest.mark.skipif(
    not runtime.triton_available(), reason="triton is not installed: the check reads its import"
)
def test_torch_path_compiles_in_one_graph():
    """``torch.compile(fullgraph=True)`` traces the path choice: it used to stop at a ``globals()`` call in
    the Triton availability check (Dynamo cannot trace that builtin) even where the PyTorch path runs."""
    proc = _run_child(COMPILED_TORCH_PATH, interpret=False)
    assert proc.returncode == 0 and "COMPILED OK" in proc.stdout, proc.stderr[-4000:]


def _transformed_calls():
    """(name, smptk call, plain-torch call) under a torch.func transform or forward-mode AD, each returning
    a tensor computed through the transform."""
    import torch.autograd.forward_ad as fwAD
    import torch.nn.functional as F

    from smptk.kernels import grouped_linear, grouped_swiglu

    g = torch.Generator().manual_seed(0)
    x, w, wu = (torch.randn(*s, generator=g) for s in ((6, 8), (5, 8), (5, 8)))
    b, we, be = torch.randn(5, generator=g), torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, generator=g)
    offsets = torch.tensor([0, 4, 6])
    xb = torch.randn(3, 6, 8, generator=g)

    def grouped_ref(x, w, b):
        return torch.cat([F.linear(x[:4], w[0], b[0]), F.linear(x[4:], w[1], b[1])])

    def dual(fn, *args):
        with fwAD.dual_level():
            return fwAD.unpack_dual(fn(fwAD.make_dual(x, torch.ones_like(x)), *args)).tangent

    grad, vmap, jvp = torch.func.grad, torch.func.vmap, torch.func.jvp
    return [
        ("grad-fused_linear-bias", lambda: grad(lambda b: fused_linear(x, w, b, activation="gelu").sum())(b),
         lambda: grad(lambda b: F.gelu(F.linear(x, w, b)).sum())(b)),
        ("vmap-fused_linear", lambda: vmap(lambda x: fused_linear(x, w, b, activation="silu"))(xb),
         lambda: F.silu(F.linear(xb, w, b))),
        ("jvp-swiglu", lambda: jvp(lambda u: swiglu(x, w, u), (wu,), (torch.ones_like(wu),))[1],
         lambda: F.silu(F.linear(x, w)) * F.linear(x, torch.ones_like(wu))),
        ("grad-swiglu-up", lambda: grad(lambda u: swiglu(x, w, u).square().sum())(wu),
         lambda: grad(lambda u: (F.silu(F.linear(x, w)) * F.linear(x, u)).square().sum())(wu)),
        ("grad-grouped_linear-bias", lambda: grad(lambda b: grouped_linear(x, we, offsets, bias=b).sum())(be),
         lambda: grad(lambda b: grouped_ref(x, we, b).sum())(be)),
        ("vmap-grouped_swiglu", lambda: vmap(lambda x: grouped_swiglu(x, we, we, offsets))(xb),
         lambda: torch.stack([grouped_swiglu(x, we, we, offsets) for x in xb])),
        ("vmap-moe_route", lambda: vmap(lambda lg: moe_route(lg, 2).weights)(xb),
         lambda: torch.stack([moe_route(lg, 2).weights for lg in xb])),
        ("forward_ad-fused_linear", lambda: dual(fused_linear, w, b),
         lambda: F.linear(torch.ones_like(x), w)),
    ]  # fmt: skip


@pytest.mark.parametrize("requested", ["auto", "triton"])
def test_torch_func_transforms_take_the_torch_path(monkeypatch, launches, requested):
    """The Triton ops' autograd Functions define no vmap / jvp rule, so under a torch.func transform or with
    a forward-mode AD tangent torch refused them with an error about ``setup_context`` naming no smptk op:
    under ``auto`` these calls run the PyTorch path and give torch's values; under ``triton`` they are an
    error that names the transform."""
    if not runtime.interpreter_enabled():
        pytest.skip(NO_INTERPRETER_REASON)
    calls = _transformed_calls()  # the references' plain calls outside transforms run with auto
    monkeypatch.setenv("SMPTK_KERNELS", requested)
    for name, call, reference in calls:
        if requested == "triton":
            with pytest.raises(RuntimeError, match=r"SMPTK_KERNELS=triton but (a torch.func|an argument)"):
                call()
            continue
        got = call()
        monkeypatch.setenv("SMPTK_KERNELS", "torch")
        want = reference()
        monkeypatch.setenv("SMPTK_KERNELS", requested)
        torch.testing.assert_close(got, want, msg=name)
    assert launches == []
