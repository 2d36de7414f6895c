"""Every Triton kernel of smptk compiles for sm_90 (H100) and sm_80 (A100): no GPU needed.

The CPU tests run the kernels under ``TRITON_INTERPRET=1`` (set by conftest), which never lowers them, so
compiler-only errors (non-constexpr globals in a kernel, type mismatches across if/while, unsupported dtypes
or instructions for a target, bad inline PTX, ptxas failures) would first show on a GPU machine. Here each
variant is lowered to a cubin with Triton's code generator and its bundled ptxas, in worker processes that
run without ``TRITON_INTERPRET`` (see ``_compile_kernels.py``: the variant table, what each variant pins, the
quick set and ``SMPTK_COMPILE_ALL=1`` for the full one).

One test per variant, so a failure names the kernel, the target and the specialization; the compiles run
once per module, in ``SMPTK_COMPILE_JOBS`` (default: every usable CPU) workers, for the selected tests only
(``-k matmul`` compiles only the matmul variants). Results land in Triton's cache (``TRITON_CACHE_DIR``), so
a rerun with unchanged kernels takes seconds. Under pytest-xdist, keep this module on one worker
(``--dist loadfile``), or each worker compiles the whole set.

Skipped, with the reason, only where Triton's CUDA backend or its ptxas cannot run on this machine.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed: no CUDA backend to compile with", allow_module_level=True)

import _compile_kernels as ck

VARIANTS = {v.id: v for v in ck.variants()}


@pytest.fixture(scope="module")
def compile_results(request: pytest.FixtureRequest) -> dict[str, dict]:
    """``{variant id: result}`` for the variants of this session's selected tests, compiled in one go."""
    selected = {
        item.callspec.params["variant_id"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_kernel_compiles" and hasattr(item, "callspec")
    }
    ids = [vid for vid in VARIANTS if vid in selected]  # VARIANTS is heaviest first: better load balance
    try:
        return ck.compile_variants(ids)
    except ck.CompilerUnavailable as e:
        pytest.skip(f"cannot compile for CUDA targets here: {e}")


@pytest.mark.slow
@pytest.mark.parametrize("variant_id", list(VARIANTS))
def test_kernel_compiles(compile_results: dict[str, dict], variant_id: str) -> None:
    variant = VARIANTS[variant_id]
    result = compile_results.get(variant_id)
    assert result is not None, f"{variant_id}: no result came back from the compile workers"
    if not result["ok"]:
        pytest.fail(
            f"{variant.kernel_name} does not compile for sm_{variant.arch} [{variant_id}]\n"
            f"{variant.describe()}\n\n{result['error']}",
            pytrace=False,
        )
