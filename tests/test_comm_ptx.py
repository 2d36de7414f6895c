"""The collective kernels move data with 128-bit accesses on sm_90 (H100), without spills: no GPU needed.

The CPU tests run the collectives under Triton's interpreter, which ignores alignment hints, so they prove
the data path's logic (both paths, tails, unaligned offsets) but not what it compiles to. Here every
collective kernel that moves data is lowered for sm_90 in each dtype the launchers use (fp32, bf16, fp16,
int32; every op; the large-size and SIMULATED variants) by the compile harness (``_compile_kernels.py``,
with the kernels' own launch options), and its PTX and ``ptxas -v`` must show:

- ``test_data_path_is_128_bit``: 128-bit global loads and stores (``ld.global.v4.b32``, ``st.global.v4.b32``),
  at least as many loads as one step of the bulk loop puts in flight per thread: a copy kernel one tile of
  2 * BLOCK bytes (32 KiB / (16 B x 256 threads) = 8 loads at 8 warps), a reduction a 2 * SUB_BLOCK-byte
  piece of each of PEERS + 1 ranks (9 loads; the loops for 2, 4 and 8 ranks add more). A kernel whose
  addresses the compiler cannot prove aligned has none (before the vector path: 0 in every variant, each
  element moved by an ``ld.global.b16`` / ``.b32``).
- ``test_no_spills``: ptxas spills 0 bytes; also for the one-program signal kernel of the copy-engine
  collectives (``_signal_kernel``, which moves no data), on sm_90 and sm_80.

Scalar accesses remain, and are reported in the failure texts: the masked last tile of every range, the
path for unaligned offsets, and the 32/64-bit control words of the barrier protocol.

Skipped, with the reason, only where Triton's CUDA backend or its ptxas cannot run on this machine. The
compiles run once per module for the selected tests, in Triton's cache (``TRITON_CACHE_DIR``) beside the
other compile checks'.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed: no CUDA backend to compile with", allow_module_level=True)

import _compile_kernels as ck

from smptk.kernels import collectives

# The kernels that move data (another kernel of the module, the signal-only one, moves none).
COPIES = ("_all_gather_kernel", "_all_to_all_kernel")
REDUCTIONS = ("_all_reduce_one_shot_kernel", "_all_reduce_two_shot_kernel", "_reduce_scatter_kernel")
DTYPES = ("fp32", "bf16", "fp16", "i32")
_COLLECTIVES = [v for v in ck.variants() if v.kernel.startswith(ck._COLL)]
_DATA = [v for v in _COLLECTIVES if v.kernel_name in COPIES + REDUCTIONS and v.arch == 90]
VARIANTS = {v.id: v for v in _DATA if not v.id.endswith("-tma")}  # the pointer path (default)
TMA = {v.id: v for v in _DATA if v.id.endswith("-tma")}  # copy_path="tma"
SIGNAL = {v.id: v for v in _COLLECTIVES if v.kernel_name == "_signal_kernel"}  # sm_90 and sm_80
CHECKED = {**VARIANTS, **TMA, **SIGNAL}


def _loads_in_flight(kernel: str) -> int:
    """128-bit loads per thread that one step of the kernel's bulk loop issues before it waits (BLOCK and
    SUB_BLOCK count 16-bit elements: the same bytes in every dtype)."""
    bytes_per_load = 16 * 32 * collectives.LAUNCH_OPTIONS["num_warps"]  # one 128-bit load per thread
    if kernel in COPIES:
        return 2 * collectives.BLOCK // bytes_per_load
    return (collectives.PEERS + 1) * max(2 * collectives.SUB_BLOCK // bytes_per_load, 1)


def test_every_kernel_and_dtype_is_checked() -> None:
    """The variant table covers each data kernel in each dtype (a renamed kernel must not drop out)."""
    seen = {(v.kernel_name, v.dtype) for v in VARIANTS.values()}
    missing = {(k, d) for k in COPIES + REDUCTIONS for d in DTYPES} - seen
    assert not missing, f"no sm_90 compile variant for {sorted(missing)}"
    assert {v.arch for v in SIGNAL.values()} == {80, 90}, f"signal kernel variants: {sorted(SIGNAL)}"
    missing = {(k, d) for k in COPIES + REDUCTIONS for d in DTYPES} - {
        (v.kernel_name, v.dtype) for v in TMA.values()
    }
    assert not missing, f"no sm_90 TMA copy-path variant for {sorted(missing)}"


@pytest.fixture(scope="module")
def compile_results(request: pytest.FixtureRequest) -> dict[str, dict]:
    """``{variant id: result}`` for this module's selected tests, compiled in one go."""
    selected = {
        item.callspec.params["variant_id"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    try:
        return ck.compile_variants([vid for vid in CHECKED if vid in selected])
    except ck.CompilerUnavailable as e:
        pytest.skip(f"cannot compile for CUDA targets here: {e}")


def _compiled(compile_results: dict[str, dict], variant_id: str) -> dict:
    variant = CHECKED[variant_id]
    r = compile_results.get(variant_id)
    assert r is not None, f"{variant_id}: no result came back from the compile workers"
    if not r["ok"]:
        pytest.fail(f"{variant_id} does not compile\n{variant.describe()}\n\n{r['error']}", pytrace=False)
    if "ptxas_error" in r:
        pytest.fail(f"{variant_id}: compiled, but no ptxas numbers: {r['ptxas_error']}", pytrace=False)
    return r


def _facts(r: dict) -> str:
    keys = ("v128_loads", "v128_stores", "scalar_loads", "scalar_stores", "registers", "spill_stores")
    return ", ".join(f"{k}={r[k]}" for k in keys)


@pytest.mark.slow
@pytest.mark.parametrize("variant_id", list(VARIANTS))
def test_data_path_is_128_bit(compile_results: dict[str, dict], variant_id: str) -> None:
    variant = VARIANTS[variant_id]
    r = _compiled(compile_results, variant_id)
    want = _loads_in_flight(variant.kernel_name)
    if r["v128_loads"] < want or r["v128_stores"] < 1:
        pytest.fail(
            f"{variant_id}: expected >= {want} 128-bit loads (one bulk step's) and >= 1 128-bit store; "
            f"PTX has {_facts(r)}\n{variant.describe()}",
            pytrace=False,
        )


@pytest.mark.slow
@pytest.mark.parametrize("variant_id", list(CHECKED))
def test_no_spills(compile_results: dict[str, dict], variant_id: str) -> None:
    r = _compiled(compile_results, variant_id)
    if r["spill_stores"] or r["spill_loads"]:
        pytest.fail(
            f"{variant_id} spills {r['spill_stores']} B stores, {r['spill_loads']} B loads "
            f"({_facts(r)})\n{CHECKED[variant_id].describe()}",
            pytrace=False,
        )


# Two programs must still fit an SM (the register budget allows two: see collectives.LAUNCH_OPTIONS), so
# the TMA path's shared-memory buffers stay within half of an H100 SM's 227 KiB.
SHARED_PER_PROGRAM = 232448 // 2


@pytest.mark.slow
@pytest.mark.parametrize("variant_id", list(TMA))
def test_tma_copy_path(compile_results: dict[str, dict], variant_id: str) -> None:
    """copy_path="tma" on sm_90: the copies' loads are TMA bulk tensor copies, pipelined (each copy loop has
    TMA_STAGES load sites: Triton's prologue loads the next stages ahead; and the shared memory holds
    TMA_STAGES - 1 tiles; a reduction's loops for 2, 4 and 8 ranks load each rank's piece so), the stores
    stay 128-bit, the async-proxy fence comes before the peers' regions are read, and the buffers leave room
    for a second program on the SM."""
    variant = TMA[variant_id]
    r = _compiled(compile_results, variant_id)
    problems = []
    # a copy loop has TMA_STAGES load sites; a reduction adds loops for 2, 4 and 8 ranks, a site per rank
    want = collectives.TMA_STAGES * (1 + (2 + 4 + 8) * (variant.kernel_name in REDUCTIONS))
    if r["tma_loads"] < want:
        problems.append(f"{r['tma_loads']} TMA loads (want >= {want}: the pipelines')")
    buffers = collectives.TMA_STAGES - 1  # 32 KiB tiles, for this loop Triton keeps stages - 1 of them
    if r["shared"] < buffers * 32768:
        problems.append(f"{r['shared']} B of shared memory: fewer than {buffers} tiles can be in flight")
    if r["v128_stores"] < 1:
        problems.append("no 128-bit store")
    if r["async_global_fences"] < 1:
        problems.append("no fence.proxy.async.global before the TMA reads of the peers' regions")
    if r["shared"] > SHARED_PER_PROGRAM:
        problems.append(f"{r['shared']} B of shared memory: two programs no longer fit an SM")
    if problems:
        pytest.fail(f"{variant_id}: {'; '.join(problems)} ({_facts(r)})\n{variant.describe()}", pytrace=False)
