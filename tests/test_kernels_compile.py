"""Every Triton kernel of smptk compiles for sm_90 (H100) and sm_80 (A100), and the GEMM engine compiles to
the instructions it is built for: no GPU needed.

The CPU tests run the kernels under ``TRITON_INTERPRET=1`` (set by conftest), which never lowers them, so
compiler-only errors (non-constexpr globals in a kernel, type mismatches across if/while, unsupported dtypes
or instructions for a target, bad inline PTX, ptxas failures) and slow code (no tensor-core MMA, no TMA,
register spills) would first show on a GPU machine. Here each variant is lowered to a cubin with Triton's
code generator and its bundled ptxas, in worker processes that run without ``TRITON_INTERPRET``, and the
workers report what the PTX and ``ptxas -v`` say (see ``_compile_kernels.py``: where the variants come from,
the quick set and ``SMPTK_COMPILE_ALL=1`` for the full one).

Checks, one test per variant, so a failure names the kernel, the target, the specialization and the numbers:

- ``test_kernel_compiles``: every variant (GEMM engine, epilogue kernels, collectives, MoE routing and
  dispatch) compiles to a cubin.
- ``test_no_spills``: every variant but the collectives' (``test_comm_ptx.py`` checks those): the GEMM
  engine (both load paths on sm_90, the pointer path on sm_80; which configs the quick set takes:
  ``_compile_kernels.py``), the epilogue kernels, MoE routing and dispatch: ptxas spills 0 bytes.
- ``test_gemm_tma_instructions``: every TMA variant (sm_90, 16-bit) multiplies with ``wgmma.mma_async``
  and both loads and stores its tiles with ``cp.async.bulk.tensor``.

The GEMM variants are ``_gemm.specializations()``, the launchers' own list, specialized as Triton's launcher
specializes the ops' launches (unit strides and E = 1 constexprs, the other sizes and strides multiples of
16); two in-process tests keep that list honest: it pins every ``_gemm_kernel`` constexpr, and every launch
the ops make (both paths, fp32 with TF32 off and on, the interpreter on CPU) is one of its specializations,
integer arguments Triton pins to 1 included.

The compiles run once per module, in ``SMPTK_COMPILE_JOBS`` (default: every usable CPU) workers, for the
selected tests only (``-k gemm-sm90`` compiles only those). Results land in Triton's cache
(``TRITON_CACHE_DIR``), the ptxas numbers beside them, so a rerun with unchanged kernels takes seconds. Under
pytest-xdist, keep this module on one worker (``--dist loadfile``), or each worker compiles the whole set.

Skipped, with the reason, only where Triton's CUDA backend or its ptxas cannot run on this machine.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed: no CUDA backend to compile with", allow_module_level=True)

import _compile_kernels as ck
import torch
import triton
from helpers import HAS_CUDA, use_path

from smptk.kernels import _gemm, runtime

VARIANTS = {v.id: v for v in ck.variants()}
GEMM_IDS = [vid for vid, v in VARIANTS.items() if v.gemm_path]
TMA_IDS = [vid for vid in GEMM_IDS if VARIANTS[vid].gemm_path == "tma"]
# The collectives' spills, access widths and shared memory are test_comm_ptx.py's.
SPILL_IDS = [vid for vid, v in VARIANTS.items() if not v.kernel.startswith("smptk.kernels.collectives:")]
_COMPILE_TESTS = ("test_kernel_compiles", "test_no_spills", "test_gemm_tma_instructions")


@pytest.fixture(scope="module")
def compile_results(request: pytest.FixtureRequest) -> dict[str, dict]:
    """``{variant id: result}`` for the variants of this session's selected tests, compiled in one go."""
    selected = {
        item.callspec.params["variant_id"]
        for item in request.session.items
        if getattr(item, "originalname", None) in _COMPILE_TESTS and hasattr(item, "callspec")
    }
    ids = [vid for vid in VARIANTS if vid in selected]  # VARIANTS is heaviest first: better load balance
    try:
        return ck.compile_variants(ids)
    except ck.CompilerUnavailable as e:
        pytest.skip(f"cannot compile for CUDA targets here: {e}")


def _compiled(compile_results: dict[str, dict], variant_id: str) -> dict:
    """The variant's result; fails, naming it, unless it compiled and, for the GEMM engine, has numbers."""
    variant = VARIANTS[variant_id]
    result = compile_results.get(variant_id)
    assert result is not None, f"{variant_id}: no result came back from the compile workers"
    if not result["ok"]:
        pytest.fail(
            f"{variant.kernel_name} does not compile for sm_{variant.arch} [{variant_id}]\n"
            f"{variant.describe()}\n\n{result['error']}",
            pytrace=False,
        )
    if variant.gemm_path and "ptxas_error" in result:
        pytest.fail(f"{variant_id}: compiled, but no ptxas numbers: {result['ptxas_error']}", pytrace=False)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("variant_id", list(VARIANTS))
def test_kernel_compiles(compile_results: dict[str, dict], variant_id: str) -> None:
    _compiled(compile_results, variant_id)


# Spills that Triton 3.6, the GPU image's version (``make compat-check`` compiles with it), leaves in a
# shipped config where the CI's Triton leaves none: (op kind, tile, pre-activation stored) -> the most bytes
# of spill stores and of spill loads its variants may have there. A new spill, or more bytes, still fails on
# 3.6. (The grouped forward's configs that spilled there are not shipped there: ``_gemm._tma_configs``.)
TRITON_3_6_SPILLS = {
    # 255 registers on 3.6, 184 on 3.9: 3.6 writes the per-expert tensor descriptors from every thread. The
    # spilled values are per tile (its SASS: 4 local stores before the tile loop, 4 loads per tile, none in
    # the wgmma K loop). Kept: it is SwiGLU's largest tile, and the next (128x64) halves it. What the spill
    # costs on an H100 is not measured.
    ("grouped_swiglu_fwd", "128x128x64-s3-w8-e2", True): 16,
}
_TRITON_3_6 = tuple(int(x) for x in triton.__version__.split(".")[:2]) == (3, 6)


def _allowance_key(variant: ck.Variant) -> tuple[str, str, bool]:
    """A GEMM variant's (op kind, tile, STORE_Z), its id being ``gemm-sm<arch>-<kind>[-<epilogue>]-<path>-
    <dtype>-<tile>``."""
    parts = variant.id.split("-")
    return parts[2], "-".join(parts[-4:]), bool(dict(variant.constexprs).get("STORE_Z"))


def test_triton_3_6_spills_name_shipped_variants() -> None:
    """Every allowance names a variant of the table (an allowance outliving its config fails)."""
    keys = {_allowance_key(VARIANTS[vid]) for vid in SPILL_IDS if VARIANTS[vid].gemm_path}
    assert set(TRITON_3_6_SPILLS) <= keys, sorted(set(TRITON_3_6_SPILLS) - keys)


@pytest.mark.slow
@pytest.mark.parametrize("variant_id", SPILL_IDS)
def test_no_spills(compile_results: dict[str, dict], variant_id: str) -> None:
    """A spill is a local-memory round trip (in a GEMM's K loop or epilogue, in a memory-bound kernel's
    loop): no shipped config or block size may have one."""
    r = _compiled(compile_results, variant_id)
    if "ptxas_error" in r:
        pytest.fail(f"{variant_id}: compiled, but no ptxas numbers: {r['ptxas_error']}", pytrace=False)
    variant = VARIANTS[variant_id]
    allowed = TRITON_3_6_SPILLS.get(_allowance_key(variant), 0) if _TRITON_3_6 and variant.gemm_path else 0
    if r["spill_stores"] > allowed or r["spill_loads"] > allowed:
        pytest.fail(
            f"{variant_id} spills on sm_{VARIANTS[variant_id].arch}: {r['spill_stores']} B stores, "
            f"{r['spill_loads']} B loads at {r['registers']} registers/thread "
            f"(shrink the config, or the kernel's block sizes in its launcher)"
            + (f"; Triton 3.6 is allowed {allowed} B here" if allowed else ""),
            pytrace=False,
        )


@pytest.mark.slow
@pytest.mark.parametrize("variant_id", TMA_IDS)
def test_gemm_tma_instructions(compile_results: dict[str, dict], variant_id: str) -> None:
    """The TMA path on sm_90 is warpgroup MMA fed and drained by the tensor-memory engine."""
    variant = VARIANTS[variant_id]
    assert variant.arch >= 90 and variant.dtype in ("bf16", "fp16"), f"{variant_id}: TMA is sm_90+, 16-bit"
    r = _compiled(compile_results, variant_id)
    # The GEMM + reduce-scatter stores its tiles into the owners' heap regions with plain stores (their
    # completion must precede the release that publishes them; see smptk/kernels/_gemm_comm.py): there,
    # 128-bit stores instead of TMA stores.
    pointer_stores = variant.kernel.endswith(":_gemm_reduce_scatter_kernel")
    store_key = "v128_stores" if pointer_stores else "tma_stores"
    counts = {k: r[k] for k in ("wgmma", "tma_loads", store_key)}
    if not all(counts.values()):
        pytest.fail(
            f"{variant_id}: expected wgmma, TMA loads and {'128-bit' if pointer_stores else 'TMA'} stores, "
            f"PTX has {counts}",
            pytrace=False,
        )


# --- the specialization list against the kernel and the launchers (in process, no compile) -------------

# Tile and schedule constexprs: they differ per config (and under the interpreter), not per op kind.
_CONFIG_CONSTEXPRS = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "EPI_SUB", "EXPERT_BLOCK"}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _kernel_constexprs() -> set[str]:
    fn = getattr(_gemm._gemm_kernel, "fn", _gemm._gemm_kernel)  # JITFunction or InterpretedFunction
    return {n for n, p in inspect.signature(fn).parameters.items() if "constexpr" in str(p.annotation)}


def test_specializations_pin_every_constexpr() -> None:
    """A constexpr added to ``_gemm_kernel`` must get a value in every specialization (else the compile
    check would silently take its default, or fail on a missing one). Beyond the kernel's constexprs a
    specialization may pin only integer arguments, to 1 (as Triton's launcher specializes unit strides)."""
    names = _kernel_constexprs()
    assert {"GROUPING", "TMA", "BLOCK_M"} <= names, names
    ints = set(_gemm._gemm_kernel.arg_names) - names
    for full in (False, True):
        for s in _gemm.specializations(full=full):
            missing = names - set(s.constexprs)
            extra = {k: v for k, v in s.constexprs.items() if k not in names and not (k in ints and v == 1)}
            assert not missing and not extra, f"{s.id}: constexprs missing {sorted(missing)}, unknown {extra}"
            sig = s.signature()
            assert list(sig) == list(_gemm._gemm_kernel.arg_names), s.id
            assert {n for n, t in sig.items() if t == "constexpr"} == set(s.constexprs), s.id


def _launch_key(dtype: str, constexprs: dict) -> tuple:
    return (dtype, *sorted((k, v) for k, v in constexprs.items() if k not in _CONFIG_CONSTEXPRS))


def _spec_key(s) -> tuple:
    return _launch_key(s.dtype, s.constexprs)


def _nearest_difference(launch: tuple, specs: set[tuple]) -> str:
    """The launch, and how it differs from the nearest specialization (fewest differing constexprs)."""
    got = dict(launch[1:])

    def diff(spec: tuple) -> dict:
        want = dict(spec[1:])
        keys = sorted(set(got) | set(want))
        out = {k: (got.get(k, "-"), want.get(k, "-")) for k in keys if got.get(k, "-") != want.get(k, "-")}
        if spec[0] != launch[0]:
            out["dtype"] = (launch[0], spec[0])
        return out

    nearest = min((diff(s) for s in specs), key=len)
    what = ", ".join(f"{k}={a} (spec: {b})" for k, (a, b) in nearest.items())
    return f"  {launch[0]} TMA={got['TMA']} GROUPING={got['GROUPING']} DUAL={got['DUAL']}: differs in {what}"


class _Recorder:
    """Stands in for ``_gemm._gemm_kernel``: notes each launch's dtype and constexprs, then launches."""

    def __init__(self, kernel, seen: list):
        self.kernel, self.seen = kernel, seen

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            consts = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
            # Integer arguments equal to 1 become constexprs in Triton's launcher: part of the variant.
            names = self.kernel.arg_names
            consts |= {n: 1 for n, a in zip(names, args, strict=False) if type(a) is int and a == 1}
            self.seen.append(_launch_key(_DTYPE_NAMES[args[0].dtype], consts))
            return launch(*args, **kwargs)

        return run


def _run_every_op(device: str, dtype: torch.dtype, linear_only: bool = False) -> None:
    """Forward and backward of every op that multiplies, with and without the epilogue's extras (only
    fused_linear's with ``linear_only``). K and N are multiples of 8 (16-byte rows in 16-bit types, so
    SMPTK_GEMM_PATH=tma can take TMA). The loss is a sum of squares, so the gradients are dense as in
    training (a plain sum's gradient is an expanded view, stride 0, in fp32: a layout of its own)."""
    from smptk.kernels import fused_linear, grouped_linear, grouped_swiglu, swiglu

    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(shape, generator=g, device=device).to(dtype).requires_grad_()

    M, K, N = 20, 40, 24
    counts = torch.tensor([7, 0, 13], device=device)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    x, w, b = rand(M, K), rand(N, K), rand(N)
    if linear_only:
        fused_linear(x, w, b, activation="gelu").float().square().sum().backward()
        return
    wg, wu, ew, eb, ewg, ewu = rand(N, K), rand(N, K), rand(3, N, K), rand(3, N), rand(3, N, K), rand(3, N, K)
    outs = [
        fused_linear(x, w, b, activation="gelu"),
        fused_linear(x, w),
        swiglu(x, wg, wu),
        grouped_linear(x, ew, offsets, bias=eb, activation="silu"),
        grouped_linear(x, ew, offsets),
        grouped_swiglu(x, ewg, ewu, offsets),
    ]
    sum(o.float().square().sum() for o in outs).backward()
    with torch.no_grad():  # inference: no pre-activation stores
        fused_linear(x, w, b, activation="relu")
        swiglu(x, wg, wu)
        grouped_swiglu(x, ewg, ewu, offsets)


def _launches(monkeypatch, device: str, dtype: torch.dtype, path: str, linear_only: bool) -> list[tuple]:
    seen: list[tuple] = []
    use_path(monkeypatch, "triton", device)
    monkeypatch.setenv("SMPTK_GEMM_PATH", path)
    monkeypatch.setenv("SMPTK_AUTOTUNE", "0")  # every launch through _gemm_kernel[grid](...)
    monkeypatch.setattr(_gemm, "_gemm_kernel", _Recorder(_gemm._gemm_kernel, seen))
    _run_every_op(device, dtype, linear_only)
    assert seen, "no GEMM launch was recorded"
    return seen


def _device_and_dtype() -> tuple[str, torch.dtype]:
    """CPU under the interpreter in fp16 (its bf16 dot is wrong, and 16-bit takes TMA); else sm_90 CUDA."""
    if runtime.interpreter_enabled():
        return "cpu", torch.float16
    if HAS_CUDA and torch.cuda.get_device_capability()[0] >= 9:
        return "cuda", torch.bfloat16
    pytest.skip("needs the Triton interpreter (CPU) or an sm_90+ GPU to take both load paths")


@pytest.mark.slow
def test_specializations_cover_every_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch the ops make (16-bit on both paths; fp32 on the pointer path, with TF32 off and on) is a
    specialization of the full set, and every op kind of the quick set is launched by some op (no kind goes
    unchecked, none is stale). Kinds compare everything but the tile: path, grouping, dual, operand layouts,
    epilogue, dtype and precision."""
    device, half = _device_and_dtype()
    full = {_spec_key(s) for s in _gemm.specializations(full=True)}
    seen = []
    passes = ((half, "tma", False), (half, "pointer", False), (torch.float32, "pointer", False))
    for dtype, path, tf32 in (*passes, (torch.float32, "pointer", True)):
        torch.backends.cuda.matmul.allow_tf32 = tf32  # fp32 precision: ieee / tf32 (conftest restores it)
        launched = _launches(monkeypatch, device, dtype, path, linear_only=tf32)
        assert any(dict(k[1:])["TMA"] for k in launched) == (path == "tma"), f"{path}: path not taken"
        seen += launched
    missing = sorted({k for k in seen if k not in full})
    assert not missing, f"{len(missing)} launches specializations(full=True) does not list:\n" + "\n".join(
        _nearest_difference(k, full) for k in missing
    )

    def kind(key: tuple) -> tuple:
        d = dict(key[1:])
        return tuple(d[k] for k in ("TMA", "GROUPING", "DUAL", "A_T", "B_T", "A2_T", "B2_T"))

    launched_kinds = {kind(k) for k in seen}
    stale = sorted({(s.name, kind(_spec_key(s))) for s in _gemm.specializations()})
    stale = [(name, k) for name, k in stale if k not in launched_kinds]
    assert not stale, f"specializations no op launches (TMA, GROUPING, DUAL, A_T, B_T, A2_T, B2_T): {stale}"
