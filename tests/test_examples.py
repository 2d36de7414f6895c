"""examples/ run as a user runs them: a fresh process, no TRITON_INTERPRET and no SMPTK_* from this one.

``examples/llama_mlp.py`` must run the Triton kernels wherever Triton is installed (the interpreter on a
CPU, which the script switches on itself), say which path ran, and pass its own error bound; with
``SMPTK_KERNELS=torch`` it must say that it compared PyTorch with itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smptk.kernels import runtime

ROOT = Path(__file__).resolve().parent.parent
LLAMA_MLP = ROOT / "examples" / "llama_mlp.py"


def _run(*args: str, **env_extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("SMPTK_")}
    env.update(PYTHONPATH=str(ROOT), **env_extra)
    return subprocess.run(
        [sys.executable, str(LLAMA_MLP), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _errors(out: str) -> dict[str, float]:
    return {
        m[0].strip(): float(m[1]) for m in re.findall(r"^(.+?)\s+rel\. error vs eager: (\S+)$", out, re.M)
    }


@pytest.mark.skipif(
    not runtime.triton_available(), reason="triton is not installed: only the torch path runs"
)
def test_llama_mlp_runs_the_kernels_and_passes():
    proc = _run()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    expected = "path=triton" if torch.cuda.is_available() else "path=triton (interpreter)"
    first = proc.stdout.splitlines()[0]
    assert expected in first, first
    errors = _errors(proc.stdout)
    assert set(errors) == {"output", "grad x", "grad w_gate", "grad w_up", "grad w_down"}, proc.stdout
    # A Triton run differs from eager somewhere (other summation order); exactly 0 everywhere would mean
    # the comparison ran PyTorch against itself.
    assert max(errors.values()) > 0, proc.stdout
    assert "ok: every relative error" in proc.stdout


def test_llama_mlp_odd_shapes_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("the CPU default shapes are what this checks; the GPU run is the test above")
    proc = _run("--tokens", "7", "--hidden", "40", "--ffn", "17")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "shape=7x40->17" in proc.stdout


def test_llama_mlp_says_when_it_compares_torch_with_itself():
    proc = _run("--tokens", "4", "--hidden", "16", "--ffn", "24", SMPTK_KERNELS="torch")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "path=torch" in proc.stdout
    assert "compares PyTorch with itself (SMPTK_KERNELS=torch" in proc.stdout
    assert max(_errors(proc.stdout).values()) == 0.0
