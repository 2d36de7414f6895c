"""Compile every smptk Triton kernel for real GPU targets (sm_90 H100, sm_80 A100) without a GPU.

The CPU test suite runs the kernels under ``TRITON_INTERPRET=1``, which never lowers them: errors that only
the compiler raises (plain Python globals read inside ``@triton.jit``, mismatched types across an if/while,
unsupported dtypes or ops for a target, bad inline asm, ptxas failures) stay hidden until a GPU run. This
module lowers each kernel all the way to a cubin with ``triton.compile(ASTSource(...), GPUTarget(...))``
(Triton's own code generator, LLVM and the bundled ptxas; no driver, no device).

Layout (used by ``tests/test_kernels_compile.py``, and runnable on its own):

- ``variants(full=False)``: the variant table as plain data (ids and specs). Building it imports the kernel
  modules only to read their configs, block sizes and codes; nothing is compiled in the calling process.
- ``compile_variants(ids)``: runs worker processes (``python tests/_compile_kernels.py --worker``) with
  ``TRITON_INTERPRET`` removed from their environment (with it set, ``@triton.jit`` returns interpreter
  objects that cannot be compiled), feeds them variant ids one at a time and collects one JSON result per
  id. A worker that dies (an LLVM/MLIR abort) costs only the variant it was compiling; it is restarted.
- ``python tests/_compile_kernels.py [-k SUBSTR] [--all] [--jobs N] [--list]``: prints one JSON line per
  variant (``{"id", "kernel", "ok", "error", "seconds", "shared", "cubin_bytes"}``), then a summary on
  stderr (with the variants whose shared memory exceeds the target's limit), and exits 1 if any failed.

Variants mirror what a real launch compiles: signature types from the argument values (pointers ``*bf16``,
int64 address tables ``*i64``, ints ``i32``/``i64``), integer arguments equal to 1 turned into constexprs (as
Triton's launcher does for unit strides and sizes unless the argument is in ``do_not_specialize``), 16-byte
divisibility on pointers and aligned ints, constexprs left out take the kernel's defaults, and
``num_warps``/``num_stages`` from the kernel's configs. A "generic" layout (no specialization: odd sizes,
strided views) covers the unspecialized code path.

Coverage, identical for sm_90 and sm_80. The quick set (default) is below; ``--all`` / ``SMPTK_COMPILE_ALL=1``
adds what the quick set drops (about twice the compile time):

- ``_matmul_kernel`` on the smallest and the largest of ``_CUDA_CONFIGS`` (by tile volume):
  smallest: every activation x HAS_SECOND on/off with HAS_BIAS and STORE_Z, in bf16; each activation once in
  fp16 and in fp32 "ieee" (HAS_SECOND alternating; full: the whole grid per dtype); the dw and generic-stride
  backward GEMMs per dtype (full: also the plain dx and the two-pair dx); M = 1, K = 1 and N = 1 forwards.
  largest: per dtype, a plain-epilogue forward and a gelu + bias + z + HAS_SECOND dx (full: also in fp32),
  bf16 dw and generic (full: every dtype, plus dx and two-pair dx).
  fp32 "tf32": a forward on both configs and a dw on the smallest.
- ``_swiglu_fwd_kernel``: smallest config, STORE_H on/off x bf16/fp16/fp32, generic strides in bf16 and fp32
  (full: fp16 too), M = 1 in bf16; largest config, STORE_H in every dtype (full: STORE_H off, generic).
- ``_act_bwd_kernel`` (every activation x the STORE_DZ/COLSUM pairs the launcher uses, every dtype, one
  generic-stride variant), ``_colsum_kernel`` and ``_swiglu_bwd_kernel`` in every dtype.
- collectives, USE_CLOCK=True (the CUDA path, ``%globaltimer`` inline PTX): every op valid for each of
  fp32/bf16/fp16/int32 (ACC fp32, or int32 for int32; no int32 "avg", which the host never launches) with
  the default 300 s timeout (an i64 argument); per kernel one bf16 variant with an i32 timeout and i64 sizes,
  and one with SIMULATED=True where the kernel has that flag.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import queue
import selectors
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ARCHS = (90, 80)  # sm_90 (H100), sm_80 (A100)
# Max shared memory per block (opt-in) per arch; a config above it compiles but cannot launch there (the
# autotuner skips it as OutOfResources), so it is reported, not failed.
SMEM_LIMIT = {90: 232448, 80: 166912}
WORKER_START_TIMEOUT_S = 300.0  # importing torch + triton on a loaded machine
VARIANT_TIMEOUT_S = 600.0  # one compile; the largest matmul tiles take a few seconds

# Triton pointer element type of each dtype name used in ids.
_TT = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "i32": "i32"}
_FLOAT_DTYPES = ("bf16", "fp16", "fp32")


@dataclasses.dataclass(frozen=True)
class TlDtype:
    """A ``tl.<name>`` constexpr value, resolved in the worker (this module never imports triton)."""

    name: str


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compilation: ``kernel`` ("module:function") for ``sm_<arch>`` with the given specialization.

    ``types``: signature type by argument name for every non-constexpr argument not defaulted to "i32"
    (every pointer must be listed); ``constexprs``: value by name (unit strides included); ``aligned``: the
    arguments that carry ``tt.divisibility = 16``.
    """

    id: str
    kernel: str
    arch: int
    types: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    aligned: tuple[str, ...]
    num_warps: int = 4
    num_stages: int = 3
    cost: int = 1  # rough relative compile cost, heaviest first for load balance

    @property
    def kernel_name(self) -> str:
        return self.kernel.split(":")[1]

    def describe(self) -> str:
        """The specialization in one paragraph, for failure messages."""
        consts = ", ".join(f"{k}={c.name if isinstance(c, TlDtype) else c!r}" for k, c in self.constexprs)
        types = ", ".join(f"{k}: {t}" for k, t in self.types)
        return (
            f"{self.kernel} for sm_{self.arch}, num_warps={self.num_warps}, num_stages={self.num_stages}\n"
            f"  constexprs: {consts}\n  types (others i32): {types}\n"
            f"  16-byte aligned: {', '.join(self.aligned) or 'none'}"
        )


def _variant(vid, kernel, arch, types, constexprs, aligned, num_warps=4, num_stages=3, cost=1) -> Variant:
    return Variant(
        id=vid,
        kernel=kernel,
        arch=arch,
        types=tuple(types.items()),
        constexprs=tuple(constexprs.items()),
        aligned=tuple(aligned),
        num_warps=num_warps,
        num_stages=num_stages,
        cost=cost,
    )


# --- matmul ---------------------------------------------------------------------------------------------

_MM_PTRS = ("a_ptr", "b_ptr", "a2_ptr", "b2_ptr", "c_ptr", "bias_ptr", "z_ptr")
_MM_INTS = ("M", "N", "K", "K2", "M_BUCKET")
_MM_STRIDES = (
    "stride_am",
    "stride_ak",
    "stride_bk",
    "stride_bn",
    "stride_a2m",
    "stride_a2k",
    "stride_b2k",
    "stride_b2n",
    "stride_cm",
    "stride_cn",
    "stride_zm",
    "stride_zn",
)
# Unit strides per launch layout (the launcher turns each into a constexpr 1). Unused pairs alias the
# first (a2 = a, b2 = b) and z / bias alias the output, so their strides follow.
#   fwd: z = x @ w.T (A = x row-major, B = w viewed [K, N]: unit K stride).
#   dx:  dx = dz @ w, and SwiGLU's dg @ wg + du @ wu (dh halves row-major, weights row-major).
#   dw:  dw = dz.T @ x (A = dz viewed [N, M]: unit M stride).
_MM_LAYOUT_ONES = {
    "fwd": ("stride_ak", "stride_bk", "stride_a2k", "stride_b2k", "stride_cn", "stride_zn"),
    "dx": ("stride_ak", "stride_bn", "stride_a2k", "stride_b2n", "stride_cn", "stride_zn"),
    "dw": ("stride_am", "stride_bn", "stride_a2m", "stride_b2n", "stride_cn", "stride_zn"),
    "generic": (),
}
# Degenerate sizes the CUDA tests use (size 1 becomes a constexpr too): decode-style M = 1 (M_BUCKET = 1);
# K = 1 (x [M, 1] and w [N, 1] have all-unit strides); N = 1 (w [1, K], out [M, 1]).
_MM_FWD = _MM_LAYOUT_ONES["fwd"]
_MM_LAYOUT_ONES["fwd_m1"] = (*_MM_FWD, "M", "M_BUCKET")
_MM_LAYOUT_ONES["fwd_k1"] = (*_MM_FWD, "K", "K2", "stride_am", "stride_bn", "stride_a2m", "stride_b2n")
_MM_LAYOUT_ONES["fwd_n1"] = (*_MM_FWD, "N", "stride_cm", "stride_zm")


def _cfg_name(cfg: dict) -> str:
    k = cfg["kwargs"]
    return f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']}w{cfg['num_warps']}s{cfg['num_stages']}"


def _configs(triton_configs) -> list[dict]:
    return [
        {"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages}
        for c in triton_configs
    ]


def _largest_smallest(configs: list[dict]) -> tuple[dict, dict]:
    def vol(c):
        k = c["kwargs"]
        return k["BLOCK_M"] * k["BLOCK_N"] * k["BLOCK_K"]

    largest = max(configs, key=lambda c: (vol(c), c["num_warps"], c["num_stages"]))
    smallest = min(configs, key=lambda c: (vol(c), c["num_warps"], -c["num_stages"]))
    return largest, smallest


def _layout_spec(ptrs, ints, strides, dtype, layout):
    """(types, unit-stride constexprs, aligned args) for a launch layout."""
    ones = _MM_LAYOUT_ONES[layout] if isinstance(layout, str) else layout
    types = {p: "*" + _TT[dtype] for p in ptrs}
    consts = {s: 1 for s in ones}
    aligned_ok = ones != ()
    aligned = [a for a in (*ptrs, *ints, *strides) if aligned_ok and a not in consts]
    return types, consts, aligned


def _matmul_variants(arch: int, configs: list[dict], act_names: dict[int, str], full: bool) -> list[Variant]:
    largest, smallest = _largest_smallest(configs)
    out = []

    def add(cfg, dtype, act, bias, store_z, second, layout, precision=None):
        precision = precision or ("ieee" if dtype == "fp32" else "tf32")
        types, consts, aligned = _layout_spec(_MM_PTRS, _MM_INTS, _MM_STRIDES, dtype, layout)
        consts.update(
            ACTIVATION=act,
            HAS_BIAS=bias,
            STORE_Z=store_z,
            HAS_SECOND=second,
            INPUT_PRECISION=precision,
            **cfg["kwargs"],
        )
        flags = "-".join(f for f, on in (("bias", bias), ("z", store_z), ("second", second)) if on) or "plain"
        prec = f"-{precision}" if dtype == "fp32" else ""
        vid = f"matmul-sm{arch}-{dtype}{prec}-{act_names[act]}-{flags}-{layout}-{_cfg_name(cfg)}"
        k = cfg["kwargs"]
        cost = k["BLOCK_M"] * k["BLOCK_N"] * (2 if second else 1) // 256
        out.append(
            _variant(
                vid,
                "smptk.kernels._matmul:_matmul_kernel",
                arch,
                types,
                consts,
                aligned,
                cfg["num_warps"],
                cfg["num_stages"],
                cost,
            )
        )

    # Smallest config: the epilogue grid, every activation x HAS_SECOND (bias and z stored). The epilogue
    # runs in fp32 whatever the input dtype, so the quick set takes the whole grid in bf16 only and each
    # activation once per other dtype, HAS_SECOND alternating.
    for dtype in _FLOAT_DTYPES:
        for act in sorted(act_names):
            for second in (False, True):
                if full or dtype == "bf16" or second == bool((act + (dtype == "fp32")) % 2):
                    add(smallest, dtype, act, True, True, second, "dx" if second else "fwd")
    # Backward GEMMs (no epilogue): fused_linear's dx and dw, SwiGLU's two-pair dx, generic strides. The quick
    # set drops the plain dx ones (the dx layout is in the grid above, with and without the second pair).
    for cfg in (smallest, largest):
        for dtype in _FLOAT_DTYPES:
            if full:
                add(cfg, dtype, 0, False, False, False, "dx")
                add(cfg, dtype, 0, False, False, True, "dx")
            if full or cfg is smallest or dtype == "bf16":
                add(cfg, dtype, 0, False, False, False, "dw")
                add(cfg, dtype, 0, False, False, False, "generic")
    # Largest config (the tile shape drives the MMA and pipeline lowering, not the epilogue): one light and
    # one heavy epilogue per dtype.
    for dtype in _FLOAT_DTYPES:
        add(largest, dtype, 0, True, True, False, "fwd")
        if full or dtype != "fp32":
            add(largest, dtype, 2, True, True, True, "dx")
    # Degenerate sizes, forward with the whole epilogue.
    for layout in ("fwd_m1", "fwd_k1", "fwd_n1"):
        add(smallest, "bf16", 4, True, True, False, layout)
    # fp32 with TF32 allowed (torch.backends.cuda.matmul.allow_tf32 = True), also with an M-major A (dw).
    for cfg in (smallest, largest):
        add(cfg, "fp32", 0, True, True, False, "fwd", precision="tf32")
    add(smallest, "fp32", 0, False, False, False, "dw", precision="tf32")
    return out


# --- swiglu ---------------------------------------------------------------------------------------------

_SW_PTRS = ("x_ptr", "wg_ptr", "wu_ptr", "y_ptr", "h_ptr")
_SW_INTS = ("M", "N", "K", "M_BUCKET")
_SW_STRIDES = (
    "stride_xm",
    "stride_xk",
    "stride_wgn",
    "stride_wgk",
    "stride_wun",
    "stride_wuk",
    "stride_ym",
    "stride_yn",
    "stride_hm",
    "stride_hn",
)
_SW_FWD_ONES = ("stride_xk", "stride_wgk", "stride_wuk", "stride_yn", "stride_hn")


def _swiglu_fwd_variants(arch: int, configs: list[dict], full: bool) -> list[Variant]:
    largest, smallest = _largest_smallest(configs)
    out = []
    for cfg in (smallest, largest):
        for dtype in _FLOAT_DTYPES:
            for store_h, layout in ((True, "fwd"), (False, "fwd"), (True, "generic"), (True, "fwd_m1")):
                # Quick set: STORE_H on/off in every dtype on the smallest tile, generic strides in bf16 and
                # fp32; the largest tile with STORE_H in every dtype.
                if layout == "fwd_m1" and (cfg is largest or dtype != "bf16"):
                    continue  # decode-style M = 1: once per target
                if not full and (
                    (cfg is largest and (not store_h or layout == "generic"))
                    or (layout == "generic" and dtype == "fp16")
                ):
                    continue
                ones = {"fwd": _SW_FWD_ONES, "fwd_m1": (*_SW_FWD_ONES, "M", "M_BUCKET")}.get(
                    layout, "generic"
                )
                types, consts, aligned = _layout_spec(_SW_PTRS, _SW_INTS, _SW_STRIDES, dtype, ones)
                consts.update(
                    STORE_H=store_h, INPUT_PRECISION="ieee" if dtype == "fp32" else "tf32", **cfg["kwargs"]
                )
                h = "store_h" if store_h else "no_h"
                k = cfg["kwargs"]
                out.append(
                    _variant(
                        f"swiglu_fwd-sm{arch}-{dtype}-{h}-{layout}-{_cfg_name(cfg)}",
                        "smptk.kernels.swiglu:_swiglu_fwd_kernel",
                        arch,
                        types,
                        consts,
                        aligned,
                        cfg["num_warps"],
                        cfg["num_stages"],
                        2 * k["BLOCK_M"] * k["BLOCK_N"] // 256,
                    )
                )
    return out


def _elementwise_variants(arch: int, blocks: dict) -> list[Variant]:
    out = []
    act_bwd_strides = ("stride_dym", "stride_dyn", "stride_zm", "stride_zn", "stride_dzm", "stride_dzn")
    for dtype in _FLOAT_DTYPES:
        for act, act_name in sorted(blocks["act_names"].items()):
            # The launcher's pairs: dz is stored iff there is an activation; with none, only the colsum.
            for store_dz, colsum in ((False, True),) if act == 0 else ((True, False), (True, True)):
                types = {"dy_ptr": f"*{dtype}", "z_ptr": f"*{dtype}", "dz_ptr": f"*{dtype}"}
                types["partial_ptr"] = "*fp32" if colsum else f"*{dtype}"
                consts = {"stride_dyn": 1, "stride_zn": 1, "stride_dzn": 1}
                consts.update(ACTIVATION=act, STORE_DZ=store_dz, COLSUM=colsum, **blocks["act_bwd"])
                aligned = [*types, "M", "N", *(s for s in act_bwd_strides if s not in consts)]
                flags = "-".join(f for f, on in (("dz", store_dz), ("colsum", colsum)) if on)
                # Contiguous dy/z/dz; one generic-strides variant (dy from autograd may be any view).
                layouts = ("contig", "generic") if (dtype, act, colsum) == ("bf16", 4, True) else ("contig",)
                for layout in layouts:
                    lconsts = dict(consts)
                    if layout == "generic":
                        lconsts = {k: c for k, c in consts.items() if not k.startswith("stride")}
                    out.append(
                        _variant(
                            f"act_bwd-sm{arch}-{dtype}-{act_name}-{flags}-{layout}",
                            "smptk.kernels.fused_linear:_act_bwd_kernel",
                            arch,
                            types,
                            lconsts,
                            aligned if layout == "contig" else [],
                        )
                    )
        out.append(
            _variant(
                f"colsum-sm{arch}-fp32_to_{dtype}",
                "smptk.kernels.fused_linear:_colsum_kernel",
                arch,
                {"partial_ptr": "*fp32", "out_ptr": f"*{dtype}"},
                {"BLOCK_N": blocks["colsum"]},
                ["partial_ptr", "out_ptr", "N"],
            )
        )
        sw_types = {"dy_ptr": f"*{dtype}", "h_ptr": f"*{dtype}", "dh_ptr": f"*{dtype}"}
        out.append(
            _variant(
                f"swiglu_bwd-sm{arch}-{dtype}",
                "smptk.kernels.swiglu:_swiglu_bwd_kernel",
                arch,
                sw_types,
                {"stride_dyn": 1, "stride_hn": 1, "stride_dhn": 1, **blocks["swiglu_bwd"]},
                [*sw_types, "M", "N", "stride_dym", "stride_hm", "stride_dhm"],
            )
        )
    return out


# --- collectives ----------------------------------------------------------------------------------------

_COLL_DTYPES = ("fp32", "bf16", "fp16", "i32")
_COLL = "smptk.kernels.collectives:"
# kernel -> (has OP/ACC, extra int64 address-table pointers)
_COLL_KERNELS = {
    "_all_reduce_one_shot_kernel": (True, ()),
    "_all_reduce_two_shot_kernel": (True, ()),
    "_all_gather_kernel": (False, ()),
    "_reduce_scatter_kernel": (True, ()),
    "_all_to_all_kernel": (False, ("in_off_W", "in_len_W", "out_off_W", "out_len_W")),
}
_COLL_SHORT = {
    "_all_reduce_one_shot_kernel": "all_reduce_one_shot",
    "_all_reduce_two_shot_kernel": "all_reduce_two_shot",
    "_all_gather_kernel": "all_gather",
    "_reduce_scatter_kernel": "reduce_scatter",
    "_all_to_all_kernel": "all_to_all",
}
# The size-like ints of each kernel (i64 in the large-size variant); rank and world stay i32.
_COLL_SIZES = {
    "_all_reduce_one_shot_kernel": ("n",),
    "_all_reduce_two_shot_kernel": ("n", "slice_n"),
    "_all_gather_kernel": ("n", "out_stride"),
    "_reduce_scatter_kernel": ("n", "in_stride"),
    "_all_to_all_kernel": ("slot",),
}


def _collective_variants(arch: int, block: int, ops: dict[str, int], params: dict[str, list[str]]) -> list:
    """``params``: each kernel's argument names (a SIMULATED variant is added where the kernel has one)."""
    out = []
    for name, (has_op, tables) in _COLL_KERNELS.items():
        modes = ["default", "i32_timeout-i64_sizes"]
        if "SIMULATED" in params[name]:
            modes.append("simulated")
        for dtype in _COLL_DTYPES:
            op_items = sorted(ops.items(), key=lambda kv: kv[1]) if has_op else [(None, None)]
            for op_name, op in op_items:
                if dtype == "i32" and op_name == "avg":
                    continue  # the host takes torch.distributed's path for int32 avg
                for mode in modes:
                    if mode != "default" and not (dtype == "bf16" and op in (None, 0)):
                        continue  # one variant per kernel for the other int widths and SIMULATED
                    types = {"in_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
                    types.update({t: "*i64" for t in ("data_W", "signal_W", *tables)})
                    types["status_ptr"] = "*i32"
                    types["timeout_ns"] = "i64"  # default timeout 300 s = 3e11 ns
                    if mode != "simulated":  # simulated launches leave the call words at their default 0
                        types["call_tag"] = "i64"  # bit 62 set: always an int64 (see smptk.comm)
                    if mode == "i32_timeout-i64_sizes":
                        types["timeout_ns"] = "i32"
                        types.update({s: "i64" for s in _COLL_SIZES[name]})
                    consts = {"BLOCK": block, "USE_CLOCK": True}
                    if mode == "simulated":
                        consts["SIMULATED"] = True
                    if has_op:
                        consts.update(OP=op, ACC=TlDtype("int32" if dtype == "i32" else "float32"))
                    # do_not_specialize: no int alignment; pointers (table entries, heap buffers) aligned.
                    aligned = [p for p, t in types.items() if t.startswith("*")]
                    op_part = f"-{op_name}" if has_op else ""
                    out.append(
                        _variant(
                            f"{_COLL_SHORT[name]}-sm{arch}-{dtype}{op_part}-{mode}",
                            _COLL + name,
                            arch,
                            types,
                            consts,
                            aligned,
                            cost=2,
                        )
                    )
    return out


def variants(full: bool | None = None) -> list[Variant]:
    """The variants, heaviest first: the quick set, or every one with ``full`` (default: SMPTK_COMPILE_ALL=1).

    Imports the kernel modules for their configs, block sizes and codes only.
    """
    if full is None:
        full = os.environ.get("SMPTK_COMPILE_ALL", "0") == "1"
    import importlib

    # Modules by full name: ``smptk.kernels.fused_linear`` / ``.swiglu`` are shadowed by the functions.
    _matmul, collectives, fused_linear, swiglu = (
        importlib.import_module(f"smptk.kernels.{m}")
        for m in ("_matmul", "collectives", "fused_linear", "swiglu")
    )

    act_names = {code: (name or "noact") for name, code in _matmul.ACTIVATION_CODES.items()}
    blocks = {
        "act_names": act_names,
        "act_bwd": dict(fused_linear._BWD_BLOCK),
        "colsum": fused_linear._COLSUM_BLOCK_N,
        "swiglu_bwd": dict(swiglu._BWD_BLOCK),
    }
    coll_params = {
        name: list(inspect.signature(getattr(collectives, name).fn).parameters) for name in _COLL_KERNELS
    }
    out = []
    for arch in ARCHS:
        out += _matmul_variants(arch, _configs(_matmul._CUDA_CONFIGS), act_names, full)
        out += _swiglu_fwd_variants(arch, _configs(swiglu._CUDA_CONFIGS), full)
        out += _elementwise_variants(arch, blocks)
        out += _collective_variants(arch, collectives.BLOCK, collectives.OPS, coll_params)
    ids = [v.id for v in out]
    assert len(set(ids)) == len(ids), "variant ids must be unique"
    return sorted(out, key=lambda v: -v.cost)


# --- worker (child process, no TRITON_INTERPRET) --------------------------------------------------------


def _probe() -> str | None:
    """None when the CUDA backend and its ptxas can compile here, else the reason they cannot."""
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia.compiler import get_ptxas, get_ptxas_version
    except Exception as e:  # ImportError, or a backend that fails to initialise
        return f"Triton's CUDA backend is not importable: {type(e).__name__}: {e}"
    for arch in ARCHS:
        try:
            tool = get_ptxas(arch)
            get_ptxas_version(arch)
        except Exception as e:
            return f"ptxas for sm_{arch} is not available: {type(e).__name__}: {e}"
        if tool is None or not os.access(tool.path, os.X_OK):
            return f"ptxas for sm_{arch} is not executable: {getattr(tool, 'path', None)}"
    return None


@contextlib.contextmanager
def _capture_output():
    """Route fds 1 and 2 into a buffer for one compile: MLIR/LLVM print their diagnostics there (not in the
    exception), and Triton prints the failing PTX to stdout."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        box = {"text": ""}
        try:
            yield box
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, dup in zip((1, 2), saved, strict=True):
                os.dup2(dup, fd)
                os.close(dup)
            tmp.seek(0)
            box["text"] = tmp.read().decode("utf-8", "replace")


def _diagnostics(text: str, limit: int = 6000) -> str:
    """The compiler's own output, without the PTX listing Triton dumps on a ptxas error (the ptxas messages
    are in the exception) and cut to ``limit`` characters."""
    cut = text.find("// Generated by LLVM NVPTX Back-End")
    if cut >= 0:
        text = text[: text.rfind("\n", 0, max(cut - 3, 0)) + 1] + "[PTX listing omitted]\n"
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters]"


def _compile_one(v: Variant) -> dict:
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = v.kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    arg_names = list(fn.arg_names)
    types, consts = dict(v.types), dict(v.constexprs)
    unknown = sorted((set(types) | set(consts) | set(v.aligned)) - set(arg_names))
    if unknown:
        raise ValueError(f"variant names arguments the kernel does not have: {unknown} (args: {arg_names})")
    consts = {k: getattr(tl, c.name) if isinstance(c, TlDtype) else c for k, c in consts.items()}
    for param in fn.params:  # constexprs the launcher would fill from their defaults
        if param.is_constexpr and param.name not in consts:
            if not param.has_default:
                raise ValueError(f"variant gives no value for constexpr argument {param.name!r}")
            consts[param.name] = param.default
    signature = {}
    for a in arg_names:
        if a in consts:
            signature[a] = "constexpr"
        elif a in types:
            signature[a] = types[a]
        elif a.endswith(("_ptr", "_W")):
            raise ValueError(f"variant gives no pointer type for argument {a!r}")
        else:
            signature[a] = "i32"
    attrs = {(arg_names.index(a),): [["tt.divisibility", 16]] for a in v.aligned if a not in consts}
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    kernel = triton.compile(
        src,
        target=GPUTarget("cuda", v.arch, 32),
        options={"num_warps": v.num_warps, "num_stages": v.num_stages},
    )
    cubin = kernel.asm.get("cubin")
    if not cubin:
        raise RuntimeError("compiled without a cubin (ptxas did not run)")
    return {"shared": int(getattr(kernel.metadata, "shared", 0) or 0), "cubin_bytes": len(cubin)}


def _worker() -> int:
    # Protocol on the original stdout; anything else printing to fd 1 (C++ or Python) goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        proto.write(json.dumps({"fatal": "TRITON_INTERPRET is set in the worker's environment"}) + "\n")
        return 2
    reason = _probe()
    if reason is not None:
        proto.write(json.dumps({"unavailable": reason}) + "\n")
        return 0
    try:
        table = {v.id: v for v in variants(full=True)}
    except Exception:
        proto.write(
            json.dumps({"fatal": "building the variant table failed:\n" + traceback.format_exc()}) + "\n"
        )
        return 2
    proto.write(json.dumps({"ready": True}) + "\n")
    while line := sys.stdin.readline():
        vid = line.strip()
        if not vid:
            continue
        v = table.get(vid)
        t0 = time.perf_counter()
        res = {"id": vid, "kernel": v.kernel_name if v else None}
        if v is None:
            res.update(ok=False, error=f"unknown variant id {vid!r}")
        else:
            with _capture_output() as captured:
                try:
                    res.update(ok=True, error=None, **_compile_one(v))
                except Exception as e:
                    res.update(ok=False, error=f"{type(e).__name__}: {e}")
            if not res["ok"]:  # what the compiler printed, less what the exception already says
                extra = [
                    ln
                    for ln in _diagnostics(captured["text"]).splitlines()
                    if ln.strip() and ln.strip() not in res["error"] and set(ln.strip()) != {"="}
                ]
                if extra and extra != ["[PTX listing omitted]"]:
                    res["error"] += "\n--- compiler output ---\n" + "\n".join(extra)
        res["seconds"] = round(time.perf_counter() - t0, 3)
        proto.write(json.dumps(res) + "\n")
    return 0


# --- parent: drive the workers --------------------------------------------------------------------------


class CompilerUnavailable(RuntimeError):
    """The CUDA backend or ptxas cannot run here (the message says which)."""


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    env["PYTHONUNBUFFERED"] = "1"
    return env


def default_jobs() -> int:
    if os.environ.get("SMPTK_COMPILE_JOBS"):
        return max(1, int(os.environ["SMPTK_COMPILE_JOBS"]))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


class _Worker:
    def __init__(self):
        self.err = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the worker; close() closes it)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker"],
            cwd=REPO_ROOT,
            env=worker_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
        )
        self.timed_out = False
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)

    def readline(self, timeout: float) -> str | None:
        """One protocol line, or None when the worker died or timed out (then it is killed)."""
        if not self.sel.select(timeout):
            self.timed_out = True
            self.proc.kill()
            self.proc.wait()
            return None
        line = self.proc.stdout.readline()
        return line or None

    def stderr_tail(self, n: int = 4000) -> str:
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)
        self.err.seek(0)
        return self.err.read().decode("utf-8", "replace")[-n:]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=30)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.sel.close()
        self.err.close()


def _start_worker() -> _Worker:
    w = _Worker()
    line = w.readline(WORKER_START_TIMEOUT_S)
    msg = json.loads(line) if line else {"fatal": f"worker exited at start (rc {w.proc.poll()})"}
    if "ready" in msg:
        return w
    tail = w.stderr_tail()
    w.close()
    if "unavailable" in msg:
        raise CompilerUnavailable(msg["unavailable"])
    raise RuntimeError(f"compile worker failed to start: {msg.get('fatal')}\n--- worker stderr ---\n{tail}")


def compile_variants(ids: list[str], jobs: int | None = None, on_result=None) -> dict[str, dict]:
    """Compile the given variant ids in ``jobs`` worker processes; returns ``{id: result}``.

    Raises CompilerUnavailable if the CUDA backend/ptxas cannot run here. ``on_result(result)`` is called as
    each result arrives (from the driving threads, one at a time).
    """
    if not ids:
        return {}
    jobs = min(jobs or default_jobs(), len(ids))
    todo: queue.Queue[str] = queue.Queue()
    for vid in ids:
        todo.put(vid)
    results: dict[str, dict] = {}
    lock = threading.Lock()
    failures: list[BaseException] = []

    def record(res):
        with lock:
            results[res["id"]] = res
            if on_result is not None:
                on_result(res)

    def drive():
        w = None
        try:
            while not failures:
                try:
                    vid = todo.get_nowait()
                except queue.Empty:
                    break
                for attempt in (1, 2):  # a worker found dead between variants is restarted once
                    if w is None:
                        w = _start_worker()
                    try:
                        w.proc.stdin.write(vid + "\n")
                        w.proc.stdin.flush()
                        break
                    except OSError:
                        w.close()
                        w = None
                        if attempt == 2:
                            raise
                t0 = time.perf_counter()
                line = w.readline(VARIANT_TIMEOUT_S)
                if line is None:
                    how = (
                        f"timed out after {VARIANT_TIMEOUT_S:.0f} s"
                        if w.timed_out
                        else f"died (exit status {w.proc.poll()})"
                    )
                    record(
                        {
                            "id": vid,
                            "kernel": None,
                            "ok": False,
                            "seconds": round(time.perf_counter() - t0, 3),
                            "error": f"the compile worker {how} on this variant"
                            f"\n--- worker stderr (tail) ---\n{w.stderr_tail()}",
                        }
                    )
                    w.close()
                    w = None
                    continue
                record(json.loads(line))
        except BaseException as e:
            failures.append(e)
        finally:
            if w is not None:
                w.close()

    threads = [threading.Thread(target=drive, daemon=True) for _ in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        unavailable = [e for e in failures if isinstance(e, CompilerUnavailable)]
        raise unavailable[0] if unavailable else failures[0]
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-k", dest="filter", default="", help="only variant ids containing this substring")
    p.add_argument("--jobs", type=int, default=None, help="worker processes (default: usable CPUs)")
    p.add_argument("--list", action="store_true", help="print the variant ids and exit")
    p.add_argument(
        "--all", action="store_true", help="the full table, not the quick set (SMPTK_COMPILE_ALL=1)"
    )
    args = p.parse_args(argv)
    if args.worker:
        return _worker()
    os.environ.pop("TRITON_INTERPRET", None)  # this process only builds the table
    sys.path.insert(0, str(REPO_ROOT))
    ids = [v.id for v in variants(full=args.all or None) if args.filter in v.id]
    if args.list:
        print("\n".join(ids))
        return 0
    t0 = time.perf_counter()

    def show(res):
        print(json.dumps(res), flush=True)

    try:
        results = compile_variants(ids, args.jobs, on_result=show)
    except CompilerUnavailable as e:
        print(f"skipped: {e}", file=sys.stderr)
        return 0
    failed = sorted(r["id"] for r in results.values() if not r["ok"])
    arch_of = {v.id: v.arch for v in variants(full=True)}
    for r in sorted(results.values(), key=lambda r: r["id"]):
        if r["ok"] and r.get("shared", 0) > SMEM_LIMIT[arch_of[r["id"]]]:
            limit = SMEM_LIMIT[arch_of[r["id"]]]
            print(
                f"note: {r['id']}: {r['shared']} B shared > {limit} B, cannot launch there", file=sys.stderr
            )
    print(
        f"{len(results)} variants in {time.perf_counter() - t0:.1f} s "
        f"with {min(args.jobs or default_jobs(), max(len(ids), 1))} jobs; "
        f"{len(failed)} failed" + "".join(f"\n  FAILED {f}" for f in failed),
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
