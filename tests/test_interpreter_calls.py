"""smptk's wrapper of the Triton interpreter's language patching (``smptk.kernels._triton``): a ``@jit``
helper called inside a running kernel no longer re-patches ``triton.language``, the kernel's results are
unchanged, the modules are restored when the kernel ends (also when it raises), and
``SMPTK_INTERPRETER_FAST_CALLS=0`` leaves Triton as shipped.

The patching is counted through ``triton.runtime.interpreter._patch_builtin``, which Triton's
``_patch_lang`` calls for every module it patches.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import NO_INTERPRETER_REASON

from smptk.kernels import _triton, runtime

pytestmark = pytest.mark.skipif(not runtime.interpreter_enabled(), reason=NO_INTERPRETER_REASON)

tl = _triton.tl
triton = _triton.triton


@triton.jit
def _plus_one(x):
    return x + 1


@triton.jit
def _add_calls_kernel(x_ptr, out_ptr, N: tl.constexpr, CALLS: tl.constexpr, FAIL: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    for _ in range(CALLS):
        x = _plus_one(x)
    tl.static_assert(not FAIL, "planted failure")
    tl.store(out_ptr + offs, x)


def _launch(calls: int, fail: bool = False) -> torch.Tensor:
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty_like(x)
    _add_calls_kernel[(1,)](x, out, N=8, CALLS=calls, FAIL=fail)
    return out


@pytest.fixture
def patches(monkeypatch):
    """Count the modules Triton patches during a launch: ``patches(calls)`` -> (count, result)."""
    from triton.runtime import interpreter

    seen = []
    original = interpreter._patch_builtin

    def counting(pkg, *args, **kwargs):
        seen.append(pkg)
        return original(pkg, *args, **kwargs)

    monkeypatch.setattr(interpreter, "_patch_builtin", counting)

    def run(calls: int) -> tuple[int, torch.Tensor]:
        seen.clear()
        out = _launch(calls)
        return len(seen), out

    return run


def _expected(calls: int) -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32) + calls


def test_helpers_do_not_repatch_the_language(patches):
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "smptk_wrapped", False)
    once, out1 = patches(1)
    many, out9 = patches(9)
    assert once > 0
    assert many == once, f"9 helper calls patched {many} modules, 1 call {once}: the helpers re-patch"
    torch.testing.assert_close(out1, _expected(1), rtol=0, atol=0)
    torch.testing.assert_close(out9, _expected(9), rtol=0, atol=0)


def test_triton_as_shipped_repatches_at_every_helper_call(patches, monkeypatch):
    """The count above can fail: Triton's own function patches again at every helper call."""
    from triton.runtime import interpreter

    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang.triton_patch_lang)
    once, _ = patches(1)
    many, out9 = patches(9)
    assert many > once
    torch.testing.assert_close(out9, _expected(9), rtol=0, atol=0)


def test_language_restored_after_a_kernel_and_after_a_failing_one():
    _launch(3)
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.tensor.__add__)
    with pytest.raises(Exception, match="planted failure"):
        _launch(3, fail=True)
    assert tl.core.is_builtin(tl.load)
    assert not getattr(_triton._kernel_langs, "stack", [])
    torch.testing.assert_close(_launch(2), _expected(2), rtol=0, atol=0)


def test_switch_off_leaves_triton_as_shipped():
    code = (
        "import torch\n"
        "from smptk.kernels import _triton\n"
        "_triton._load()\n"
        "from triton.runtime import interpreter\n"
        "print(getattr(interpreter._patch_lang, 'smptk_wrapped', False))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "SMPTK_INTERPRETER_FAST_CALLS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
