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
adds what the quick set drops (about twice the compile time for the kernels through the collectives, about
five times for the MoE ones):

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
- grouped GEMMs (``_grouped_gemm``) on the smallest and the largest of each autotune config list, one MoE
  layer's shapes (T = 16K rows, K = 2048, N = 1408, E = 64): ``_grouped_mm_kernel``'s training forward
  (gelu or silu + bias + z) and SwiGLU's two-pair dx (HAS_SECOND), ``_grouped_swiglu_fwd_kernel`` with
  STORE_H on and off, ``_grouped_dw_kernel``'s dw + db (grouped_linear) and dw into ``[E, 2N, K]``
  (grouped_swiglu); each pair as bf16 on one config and fp32 "ieee" on the other, so both dtypes meet both
  configs. ``_swiglu_dh_kernel`` in bf16. Full: every dtype x config x (plain forward, dx, two-pair dx,
  epilogue forward, generic strides, i64 rows; STORE_H on/off; dw + db, dw, db only), fp32 "tf32" per
  config, the other activations once; the largest config in fp32 with its flag variants and "tf32" only.
- ``moe_route`` and ``moe_dispatch`` kernels (T = 4096 tokens, H = 2048): per kernel the DeepSeek-V2-Lite
  set-up (E = 64, k = 6; bf16 logits and rows, int32 ids, fp32 routing weights, capacity factor 1.25)
  and an int64 one: DeepSeek-V3 routing (E = 256, k = 8, sigmoid + expert bias) in fp32 past 2^31 tokens,
  int64 ids past 2^31 pairs without a capacity (an i64 capacity); ``_route_stats_kernel`` the int64 one
  only, the row kernels bf16 only (``_gather_sum_kernel`` also without weights, dispatch's backward).
  Full: the set-ups E = k = 1, (8, 2), (64, 6), (160, 6) and (256, 8) in every dtype, ids dtype and with
  and without a capacity, every score x renormalize x bias flag, fp16 / fp32 rows with fp32 or same-dtype
  weights, generic strides, top_k = 1, i64 sizes per kernel, and a one-program statistics launch.

The grouped GEMM and MoE variants name the argument values of a concrete launch and derive the signature
from them as the launcher does (``_from_values``). Their ids start with ``grouped_`` / ``moe_`` (select
them with ``-k grouped_`` / ``-k moe_``).
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


# --- MoE: grouped GEMMs, routing, dispatch / combine ----------------------------------------------------
#
# Specialization from argument values (``_from_values``): each variant passes the sizes and strides a real
# launch does, as the launchers in _grouped_gemm.py, moe_route.py and moe_dispatch.py compute them.

_GG = "smptk.kernels._grouped_gemm:"
_ROUTE = "smptk.kernels.moe_route:"
_DISP = "smptk.kernels.moe_dispatch:"
# Grouped GEMMs: one MoE layer (DeepSeek-V2-Lite's experts: hidden K = 2048, expert width N = 1408, E = 64)
# over T = 16K grouped rows.
_GT, _GK, _GN, _GE = 16384, 2048, 1408, 64
# Routing and dispatch: T = 4096 tokens, H = 2048; set-ups (E, top_k, score_func, renormalize, expert
# bias): E = k = 1 (unit sizes become constexprs), Mixtral (8, 2), DeepSeek-V2-Lite (64, 6), DeepSeek-V2
# (160, 6: a padded 256-wide expert block), DeepSeek-V3 (256, 8, sigmoid scores and the selection bias).
_RT, _RH = 4096, 2048
_ROUTE_CASES = (
    (1, 1, "softmax", True, False),
    (8, 2, "softmax", True, False),
    (64, 6, "softmax", False, False),
    (160, 6, "softmax", False, False),
    (256, 8, "sigmoid", True, True),
)
_CAPACITY = (5, 4)  # capacity_factor 1.25, as a fraction: C = ceil(1.25 * P / E)
# "-i64" variants: rows, tokens or pairs past int32 (every index there is int64). _BIG_T tokens x 8 slots
# = 2^31 + 256 pairs.
_BIG = 2**31 + 256
_BIG_T = 2**28 + 32


def _pow2(n: int) -> int:
    """triton.next_power_of_2."""
    return 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _from_values(ptrs: dict[str, str], ints: dict[str, int], layout: str = "contig") -> tuple:
    """(types, constexprs, aligned) as Triton's launcher derives them from the argument values: pointers
    typed as given and 16-byte aligned (fresh buffers, views at 16-byte offsets); an int equal to 1 becomes a
    constexpr, one outside int32 is i64, a multiple of 16 (0 included) is aligned. ``layout="generic"``
    (strided views, odd sizes): nothing specialized or aligned, every int i32."""
    types, consts = dict(ptrs), {}
    if layout == "generic":
        return types, consts, []
    aligned = list(ptrs)
    for name, value in ints.items():
        if value == 1:
            consts[name] = 1
            continue
        if not -(2**31) <= value < 2**31:
            types[name] = "i64"
        if value % 16 == 0:
            aligned.append(name)
    return types, consts, aligned


def _alternate(small: bool, dtype: str, flip: bool = False) -> bool:
    """Quick-set pick for the GEMMs: bf16 on the smallest config and fp32 on the largest (``flip``: fp32 on
    the smallest and bf16 on the largest), so two kernel flavours cover both dtypes on both configs."""
    return dtype != "fp16" and (small == (dtype == "bf16")) != flip


def _slow(small: bool, dtype: str) -> bool:
    """The largest config in fp32: the slowest compiles (several seconds each), and more shared memory than
    sm_80 has for the forward GEMMs. The full set keeps there only the flag variants (the epilogue forward
    and two-pair dx, STORE_H on/off, dw / db) and "tf32"; the plain forward and dx, generic strides and
    i64 rows come from the other dtype / config pairs."""
    return not small and dtype == "fp32"


def _grouped_gemm_variants(arch: int, gg, act_names: dict[int, str], full: bool) -> list[Variant]:
    """``gg``: the ``smptk.kernels._grouped_gemm`` module (autotune configs and block sizes)."""
    out = []
    T, K, N, E = _GT, _GK, _GN, _GE

    def add(
        name, kernel, dtype, tag, layout, cfg, ptrs, ints, consts, quick, precision=None, big=False, dots=1
    ):
        if not (full or quick):
            return
        precision = precision or ("ieee" if dtype == "fp32" else "tf32")
        types, cx, aligned = _from_values(ptrs, ints, layout)
        cx.update(consts)
        nw, ns, cost, suffix = 4, 3, 1, ""  # Triton's defaults: _swiglu_dh_kernel's plain launch
        if cfg is not None:  # the autotuned GEMMs
            cx.update(cfg["kwargs"], PRECISION=precision)
            k = cfg["kwargs"]
            nw, ns, suffix = cfg["num_warps"], cfg["num_stages"], f"-{_cfg_name(cfg)}"
            cost = k["BLOCK_M"] * k["BLOCK_N"] * dots // 256
            if dtype == "fp32":
                dtype = f"fp32-{precision}"
        vid = f"{name}-sm{arch}-{dtype}-{tag}-{layout}{'-i64' if big else ''}{suffix}"
        out.append(_variant(vid, _GG + kernel, arch, types, cx, aligned, nw, ns, cost))

    # _grouped_mm_kernel (grouped_matmul). fwd: a = x [T, K], b = weight.transpose(1, 2) (strides N*K, 1,
    # K), c and z [T, N], bias [E, N] (absent: the output, same row stride); dx: a = dz [T, N], b = weight
    # [E, N, K]; dx2 (grouped_swiglu's dx, HAS_SECOND): a, a2 = the halves of dh [T, 2N], b, b2 = the
    # two weights.
    mm_ptrs = ("a_ptr", "b_ptr", "a2_ptr", "b2_ptr", "c_ptr", "bias_ptr", "z_ptr")

    def add_mm(cfg, dtype, layout, act=0, bias=False, store_z=False, quick=False, precision=None, big=False):
        rows = _BIG if big else T
        R, C, a, b = {
            "fwd": (K, N, (K, 1), (N * K, 1, K)),
            "dx": (N, K, (N, 1), (N * K, K, 1)),
            "dx2": (N, K, (2 * N, 1), (N * K, K, 1)),
        }["fwd" if layout == "generic" else layout]
        ints = dict(T=rows, R=R, C=C, E=E, T_BUCKET=_pow2(rows), s_am=a[0], s_ar=a[1])
        ints.update(s_be=b[0], s_br=b[1], s_bc=b[2], s_a2m=a[0], s_a2r=a[1])
        ints.update(s_b2e=b[0], s_b2r=b[1], s_b2c=b[2], s_cm=C, s_cc=1, s_biase=C, s_zm=C, s_zc=1)
        ptrs = {p: f"*{_TT[dtype]}" for p in mm_ptrs} | {"offsets_ptr": "*i64"}
        consts = dict(ACTIVATION=act, HAS_BIAS=bias, STORE_Z=store_z, HAS_SECOND=layout == "dx2")
        consts["EXPERT_BLOCK"] = gg._EXPERT_BLOCK
        flags = [f for f, on in (("bias", bias), ("z", store_z), ("second", layout == "dx2")) if on]
        tag = "-".join([act_names[act], *flags]) if flags else f"{act_names[act]}-plain"
        add(
            "grouped_mm",
            "_grouped_mm_kernel",
            dtype,
            tag,
            layout,
            cfg,
            ptrs,
            ints,
            consts,
            quick,
            precision,
            big,
            dots=2 if layout == "dx2" else 1,
        )

    largest, smallest = _largest_smallest(_configs(gg._MM_CONFIGS))
    for cfg in (smallest, largest):
        small = cfg is smallest
        for dtype in _FLOAT_DTYPES:
            # Quick: the training forward (gelu on the smallest, silu on the largest, with bias and z) and
            # SwiGLU's two-pair dx, each in bf16 and fp32 across the two configs.
            act = 2 if small else 4
            add_mm(cfg, dtype, "fwd", act, True, True, quick=_alternate(small, dtype))
            add_mm(cfg, dtype, "dx2", quick=_alternate(small, dtype, flip=True))
            if _slow(small, dtype):
                continue
            add_mm(cfg, dtype, "fwd")
            add_mm(cfg, dtype, "dx")
            add_mm(cfg, dtype, "generic")
            add_mm(cfg, dtype, "fwd", 2, True, True, big=True)
        add_mm(cfg, "fp32", "fwd", 2, True, True, precision="tf32")
    for act in sorted(act_names):  # the other epilogues once (the matmul variants cover the whole grid)
        if act not in (0, 2):
            add_mm(smallest, "bf16", "fwd", act, True, act != 4)
    add_mm(smallest, "bf16", "fwd", 0, True)  # bias only

    # _grouped_swiglu_fwd_kernel (grouped_swiglu_fwd): x [T, K], weights [E, N, K], y [T, N], h [T, 2N]
    # (absent: y, row stride N).
    def add_swiglu(cfg, dtype, layout, store_h, quick=False, precision=None, big=False):
        rows = _BIG if big else T
        ints = dict(T=rows, K=K, N=N, E=E, T_BUCKET=_pow2(rows), s_xm=K, s_xk=1)
        ints.update(s_wge=N * K, s_wgn=K, s_wgk=1, s_wue=N * K, s_wun=K, s_wuk=1)
        ints.update(s_ym=N, s_yn=1, s_hm=2 * N if store_h else N, s_hn=1)
        ptrs = {p: f"*{_TT[dtype]}" for p in ("x_ptr", "wg_ptr", "wu_ptr", "y_ptr", "h_ptr")}
        ptrs["offsets_ptr"] = "*i64"
        consts = {"STORE_H": store_h, "EXPERT_BLOCK": gg._EXPERT_BLOCK}
        tag = "store_h" if store_h else "no_h"
        add(
            "grouped_swiglu_fwd",
            "_grouped_swiglu_fwd_kernel",
            dtype,
            tag,
            layout,
            cfg,
            ptrs,
            ints,
            consts,
            quick,
            precision,
            big,
            dots=2,
        )

    largest, smallest = _largest_smallest(_configs(gg._SWIGLU_CONFIGS))
    for cfg in (smallest, largest):
        small = cfg is smallest
        for dtype in _FLOAT_DTYPES:
            add_swiglu(cfg, dtype, "fwd", True, quick=_alternate(small, dtype))
            add_swiglu(cfg, dtype, "fwd", False, quick=_alternate(small, dtype, flip=True))
            if _slow(small, dtype):
                continue
            add_swiglu(cfg, dtype, "generic", True)
            add_swiglu(cfg, dtype, "fwd", True, big=True)
        add_swiglu(cfg, "fp32", "fwd", True, precision="tf32")

    # _grouped_dw_kernel (grouped_weight_grad). dw_db (grouped_linear): dz [T, N], x [T, K], dw [E, N, K],
    # db [E, N]. dw (grouped_swiglu's [dw_gate | dw_up]): dz = dh [T, 2N], dw [E, 2N, K], db a [1, 1]
    # dummy. db (frozen weight): dw a [1, 1, 1] dummy. Dummies have unit strides.
    def add_dw(cfg, dtype, layout, case, quick=False, precision=None, big=False):
        rows = _BIG if big else T
        n = 2 * N if case == "dw" else N
        ints = dict(T=rows, N=n, K=K, T_BUCKET=_pow2(rows), s_dzm=n, s_dzn=1, s_xm=K, s_xk=1)
        ints.update(dict(s_dwe=n * K, s_dwn=K, s_dwk=1) if case != "db" else dict(s_dwe=1, s_dwn=1, s_dwk=1))
        ints["s_dbe"] = 1 if case == "dw" else n
        ptrs = {p: f"*{_TT[dtype]}" for p in ("dz_ptr", "x_ptr", "dw_ptr", "db_ptr")}
        ptrs["offsets_ptr"] = "*i64"
        consts = {"STORE_DW": case != "db", "STORE_DB": case != "dw"}
        add(
            "grouped_dw",
            "_grouped_dw_kernel",
            dtype,
            case,
            layout,
            cfg,
            ptrs,
            ints,
            consts,
            quick,
            precision,
            big,
        )

    largest, smallest = _largest_smallest(_configs(gg._DW_CONFIGS))
    for cfg in (smallest, largest):
        small = cfg is smallest
        for dtype in _FLOAT_DTYPES:
            add_dw(cfg, dtype, "contig", "dw_db", quick=_alternate(small, dtype))
            add_dw(cfg, dtype, "contig", "dw", quick=_alternate(small, dtype, flip=True))
            add_dw(cfg, dtype, "contig", "db")
            if _slow(small, dtype):
                continue
            add_dw(cfg, dtype, "generic", "dw_db")
            add_dw(cfg, dtype, "contig", "dw_db", big=True)
        add_dw(cfg, "fp32", "contig", "dw_db", precision="tf32")

    # _swiglu_dh_kernel (swiglu_dh, a plain launch): dy [T, N], h and dh [T, 2N].
    for dtype in _FLOAT_DTYPES:
        for layout, big in (("contig", False), ("generic", False), ("contig", True)):
            rows = _BIG if big else T
            ints = dict(M=rows, N=N, s_dym=N, s_dyn=1, s_hm=2 * N, s_hn=1, s_dhm=2 * N, s_dhn=1)
            ptrs = {p: f"*{_TT[dtype]}" for p in ("dy_ptr", "h_ptr", "dh_ptr")}
            quick = dtype == "bf16" and layout == "contig" and not big
            add(
                "grouped_swiglu_dh",
                "_swiglu_dh_kernel",
                dtype,
                "dh",
                layout,
                None,
                ptrs,
                ints,
                dict(gg._DH_BLOCK),
                quick,
                big=big,
            )
    return out


def _route_variants(arch: int, blocks: dict, score_funcs: dict[str, int], full: bool) -> list[Variant]:
    """moe_route's three kernels; ``blocks``: ``moe_route._FWD_BLOCKS`` (the CUDA values)."""
    out = []

    def launch_blocks(E):  # moe_route._blocks, without the interpreter's values
        BLOCK_E = _pow2(E)
        BLOCK_T = max(1, min(blocks["TILE_ELEMS"] // BLOCK_E, blocks["MAX_BLOCK_T"], blocks["ROWS_PER_PROG"]))
        stats_b = max(1, min(4096 // BLOCK_E, blocks["MAX_STATS_BLOCK_B"]))
        return BLOCK_E, BLOCK_T, stats_b

    def add(name, kernel, tag, layout, ptrs, ints, consts, quick, big):
        if full or quick:
            types, cx, aligned = _from_values(ptrs, ints, layout)
            vid = f"{name}-sm{arch}-{tag}-{layout}{'-i64' if big else ''}"
            out.append(_variant(vid, _ROUTE + kernel, arch, types, cx | consts, aligned))

    def case_tag(dtype, E, k, score, renorm, bias=False):
        flags = [f for f, on in (("renorm", renorm), ("bias", bias)) if on]
        return "-".join([dtype, f"E{E}k{k}", score, *flags])

    # route_fwd: logits [T, E] (generic: any strides), expert bias [E] fp32 (absent: the logits), weights,
    # ids and the partial rows fresh.
    def fwd(dtype, E, k, score, renorm, bias, layout="contig", quick=False, big=False):
        BLOCK_E, BLOCK_T, _ = launch_blocks(E)
        ptrs = {"logits_ptr": f"*{_TT[dtype]}", "bias_ptr": "*fp32" if bias else f"*{_TT[dtype]}"}
        ptrs |= {"w_ptr": "*fp32", "ids_ptr": "*i32", "cnt_part_ptr": "*i32"}
        ptrs |= {"q_part_ptr": "*fp32", "z_part_ptr": "*fp32"}
        ints = dict(T=_BIG if big else _RT, E=E, top_k=k, stride_lt=E, stride_le=1)
        consts = dict(SCORE_FUNC=score_funcs[score], RENORMALIZE=renorm, HAS_BIAS=bias, BLOCK_T=BLOCK_T)
        consts |= dict(BLOCK_E=BLOCK_E, BLOCK_K=_pow2(k), ROWS_PER_PROG=blocks["ROWS_PER_PROG"])
        tag = case_tag(dtype, E, k, score, renorm, bias)
        add("moe_route_fwd", "_route_fwd_kernel", tag, layout, ptrs, ints, consts, quick, big)

    # route_bwd: as the forward, plus the weights' gradient [T, k] as fp32 (generic: any strides); the
    # expert bias plays no part.
    def bwd(dtype, E, k, score, renorm, layout="contig", quick=False, big=False):
        BLOCK_E, BLOCK_T, _ = launch_blocks(E)
        ptrs = {"logits_ptr": f"*{_TT[dtype]}", "ids_ptr": "*i32", "dw_ptr": "*fp32", "counts_ptr": "*i64"}
        ptrs |= {"daux_ptr": "*fp32", "dz_ptr": "*fp32", "dlogits_ptr": f"*{_TT[dtype]}"}
        ints = dict(
            T=_BIG if big else _RT, E=E, top_k=k, stride_lt=E, stride_le=1, stride_dwt=k, stride_dwk=1
        )
        consts = dict(SCORE_FUNC=score_funcs[score], RENORMALIZE=renorm, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E)
        tag = case_tag(dtype, E, k, score, renorm)
        add("moe_route_bwd", "_route_bwd_kernel", tag, layout, ptrs, ints, consts, quick, big)

    # route_fwd's statistics: the partial rows of cdiv(T, ROWS_PER_PROG) programs.
    def stats(E, k, T, layout="contig", quick=False, big=False):
        BLOCK_E, _, stats_b = launch_blocks(E)
        ptrs = {"cnt_part_ptr": "*i32", "q_part_ptr": "*fp32", "z_part_ptr": "*fp32", "counts_ptr": "*i64"}
        ptrs |= {"aux_ptr": "*fp32", "z_ptr": "*fp32"}
        ints = dict(num_progs=_cdiv(T, blocks["ROWS_PER_PROG"]), T=T, E=E, top_k=k)
        consts = dict(BLOCK_B=stats_b, BLOCK_E=BLOCK_E)
        add("moe_route_stats", "_route_stats_kernel", f"E{E}k{k}", layout, ptrs, ints, consts, quick, big)

    v2_lite, v3 = _ROUTE_CASES[2], _ROUTE_CASES[4]
    for dtype in _FLOAT_DTYPES:
        for case in _ROUTE_CASES:
            quick = (dtype, case) == ("bf16", v2_lite)
            fwd(dtype, *case, quick=quick)
            bwd(dtype, *case[:4], quick=quick)
        fwd(dtype, *v2_lite, layout="generic")
        bwd(dtype, *v2_lite[:4], layout="generic")
    for score in score_funcs:  # every flag combination once
        for renorm in (True, False):
            if (score, renorm) != v2_lite[2:4]:
                bwd("bf16", *v2_lite[:2], score, renorm)
            for bias in (True, False):
                if (score, renorm, bias) != v2_lite[2:]:
                    fwd("bf16", *v2_lite[:2], score, renorm, bias)
    fwd("fp32", *v3, quick=True, big=True)
    bwd("fp32", *v3[:4], quick=True, big=True)
    fwd("bf16", *v2_lite, big=True)
    bwd("bf16", *v2_lite[:4], big=True)
    for E, k, *_ in _ROUTE_CASES:
        stats(E, k, _RT)
    stats(*v2_lite[:2], 200, layout="one_prog")  # T <= ROWS_PER_PROG: num_progs = 1, a constexpr
    stats(*v3[:2], _BIG, quick=True, big=True)
    return out


def _dispatch_variants(arch: int, plan: dict, scan_tile: int, rows: dict, full: bool) -> list[Variant]:
    """moe_dispatch's kernels. ``plan``: ``_PLAN_BLOCKS``; ``scan_tile``: ``_SCAN_TILE_ELEMS``; ``rows``:
    ``_ROW_BLOCKS`` (the CUDA values)."""
    out = []

    def add(name, kernel, tag, layout, ptrs, ints, consts, quick, big):
        if full or quick:
            types, cx, aligned = _from_values(ptrs, ints, layout)
            vid = f"{name}-sm{arch}-{tag}-{layout}{'-i64' if big else ''}"
            out.append(_variant(vid, _DISP + kernel, arch, types, cx | consts, aligned))

    # dispatch_plan: expert_ids [T, k] int32 (moe_route's) or int64 (generic: any strides); the capacity
    # argument is C with a capacity factor, P without one (i64 with i64 pairs).
    def plan_sizes(E, k, capacity, big):
        P = (_BIG_T if big else _RT) * k
        BLOCK_E = _pow2(E)
        BLOCK_P = min(max(plan["CHUNK_ELEMS"] // BLOCK_E, plan["MIN_BLOCK_P"]), 128, plan["PAIRS_PER_PROG"])
        cap = _cdiv(P * _CAPACITY[0], E * _CAPACITY[1]) if capacity else P
        chunk = dict(BLOCK_P=BLOCK_P, BLOCK_E=BLOCK_E, PAIRS_PER_PROG=plan["PAIRS_PER_PROG"])
        return P, cap, BLOCK_E, chunk

    def hist(ids_dtype, E, k, layout="contig", quick=False, big=False):
        P, _, _, chunk = plan_sizes(E, k, False, big)
        ptrs = {"ids_ptr": f"*{ids_dtype}", "hist_ptr": "*i32", "bad_ptr": "*i32"}
        ints = dict(P=P, E=E, top_k=k, stride_it=k, stride_ik=1)
        tag = f"{ids_dtype}_ids-E{E}k{k}"
        add("moe_dispatch_hist", "_dispatch_hist_kernel", tag, layout, ptrs, ints, chunk, quick, big)

    def scan(E, k, capacity, quick=False, big=False):
        P, cap, BLOCK_E, _ = plan_sizes(E, k, capacity, big)
        ptrs = {"hist_ptr": "*i32", "bad_ptr": "*i32"}
        ptrs |= {p: "*i64" for p in ("base_ptr", "offsets_ptr", "kept_ptr", "summary_ptr")}
        ints = dict(num_progs=_cdiv(P, plan["PAIRS_PER_PROG"]), E=E, capacity=cap)
        consts = dict(BLOCK_B=max(1, min(plan["SCAN_BLOCK_B"], scan_tile // BLOCK_E)), BLOCK_E=BLOCK_E)
        tag = f"E{E}k{k}-{'cap' if capacity else 'no_cap'}"
        add("moe_dispatch_scan", "_dispatch_scan_kernel", tag, "contig", ptrs, ints, consts, quick, big)

    def scatter(ids_dtype, E, k, capacity, layout="contig", quick=False, big=False):
        P, cap, _, chunk = plan_sizes(E, k, capacity, big)
        ptrs = {"ids_ptr": f"*{ids_dtype}"}
        ptrs |= {p: "*i64" for p in ("base_ptr", "offsets_ptr", "dest_ptr", "src_token_ptr", "src_pair_ptr")}
        ints = dict(P=P, E=E, top_k=k, capacity=cap, stride_it=k, stride_ik=1)
        tag = f"{ids_dtype}_ids-E{E}k{k}-{'cap' if capacity else 'no_cap'}"
        add("moe_dispatch_scatter", "_dispatch_scatter_kernel", tag, layout, ptrs, ints, chunk, quick, big)

    v2_lite, v3 = _ROUTE_CASES[2][:2], _ROUTE_CASES[4][:2]
    for ids_dtype in ("i32", "i64"):
        for E, k, *_ in _ROUTE_CASES:
            hist(ids_dtype, E, k, quick=(ids_dtype, (E, k)) == ("i32", v2_lite))
            for capacity in (True, False):
                scatter(
                    ids_dtype, E, k, capacity, quick=(ids_dtype, (E, k), capacity) == ("i32", v2_lite, True)
                )
        hist(ids_dtype, *v2_lite, layout="generic")
        scatter(ids_dtype, *v2_lite, True, layout="generic")
        hist(ids_dtype, *v3, quick=ids_dtype == "i64", big=True)
        scatter(ids_dtype, *v3, False, quick=ids_dtype == "i64", big=True)
        scatter(ids_dtype, *v3, True, big=True)
    for E, k, *_ in _ROUTE_CASES:
        for capacity in (True, False):
            scan(E, k, capacity, quick=((E, k), capacity) == (v2_lite, True))
    scan(*v3, False, quick=True, big=True)
    scan(*v3, True, big=True)

    # Row kernels (plain launches): H = 2048, k = 6 slots, R = T * k grouped rows; x, dout [T, H] and the
    # grouped y / dx_grouped [R, H] contiguous (generic: any strides), routing weights [T, k] fp32 (or the
    # activations' dtype), dest [T, k] and the sources [R] int64.
    def row_add(name, kernel, tag, layout, ptrs, ints, consts, quick, big):
        add(name, kernel, tag, layout, ptrs, ints, dict(rows) | consts, quick, big)

    H = _RH

    def gather_rows(dtype, layout="contig", quick=False, big=False):
        ptrs = {"x_ptr": f"*{_TT[dtype]}", "src_ptr": "*i64", "out_ptr": f"*{_TT[dtype]}"}
        ints = dict(R=_BIG if big else _RT * 6, H=H, stride_xt=H, stride_xh=1)
        row_add("moe_gather_rows", "_gather_rows_kernel", dtype, layout, ptrs, ints, {}, quick, big)

    def gather_sum(dtype, w_dtype, k=6, layout="contig", quick=False, big=False):
        """w_dtype None: dispatch's backward (no weights: w = src, strides 0)."""
        ptrs = {"src_ptr": f"*{_TT[dtype]}", "dest_ptr": "*i64", "w_ptr": f"*{_TT[w_dtype or dtype]}"}
        ptrs["out_ptr"] = f"*{_TT[dtype]}"
        sw = (k, 1) if w_dtype else (0, 0)
        ints = dict(T=_BIG if big else _RT, H=H, top_k=k, stride_sr=H, stride_sh=1)
        ints |= dict(stride_wt=sw[0], stride_wk=sw[1])
        tag = f"{dtype}-{f'w_{w_dtype}' if w_dtype else 'no_w'}-k{k}"
        consts = {"HAS_WEIGHTS": w_dtype is not None}
        row_add("moe_gather_sum", "_gather_sum_kernel", tag, layout, ptrs, ints, consts, quick, big)

    def combine_dy(dtype, w_dtype, k=6, layout="contig", quick=False, big=False):
        ptrs = {"dout_ptr": f"*{_TT[dtype]}", "w_ptr": f"*{_TT[w_dtype]}", "src_pair_ptr": "*i64"}
        ptrs["dy_ptr"] = f"*{_TT[dtype]}"
        ints = dict(
            R=_BIG if big else _RT * k, H=H, top_k=k, stride_dt=H, stride_dh=1, stride_wt=k, stride_wk=1
        )
        row_add(
            "moe_combine_dy",
            "_combine_dy_kernel",
            f"{dtype}-w_{w_dtype}-k{k}",
            layout,
            ptrs,
            ints,
            {},
            quick,
            big,
        )

    def combine_dw(dtype, w_dtype, k=6, layout="contig", quick=False, big=False):
        ptrs = {"dout_ptr": f"*{_TT[dtype]}", "y_ptr": f"*{_TT[dtype]}", "dest_ptr": "*i64"}
        ptrs["dw_ptr"] = f"*{_TT[w_dtype]}"
        ints = dict(T=_BIG if big else _RT, H=H, top_k=k, stride_dt=H, stride_dh=1, stride_yr=H, stride_yh=1)
        row_add(
            "moe_combine_dw",
            "_combine_dw_kernel",
            f"{dtype}-w_{w_dtype}-k{k}",
            layout,
            ptrs,
            ints,
            {"BLOCK_K": _pow2(k)},
            quick,
            big,
        )

    for dtype in _FLOAT_DTYPES:
        quick = dtype == "bf16"
        gather_rows(dtype, quick=quick)
        gather_sum(dtype, None, quick=quick)
        for w_dtype in dict.fromkeys(("fp32", dtype)):  # moe_route's fp32 weights, or x's dtype
            quick = (dtype, w_dtype) == ("bf16", "fp32")
            gather_sum(dtype, w_dtype, quick=quick)
            combine_dy(dtype, w_dtype, quick=quick)
            combine_dw(dtype, w_dtype, quick=quick)
    for kw in ({"layout": "generic"}, {"k": 1}, {"big": True}):  # strided views, top_k = 1, i64 rows / tokens
        if "k" not in kw:
            gather_rows("bf16", **kw)
        gather_sum("bf16", None, **kw)
        gather_sum("bf16", "fp32", **kw)
        combine_dy("bf16", "fp32", **kw)
        combine_dw("bf16", "fp32", **kw)
    return out


def variants(full: bool | None = None) -> list[Variant]:
    """The variants, heaviest first: the quick set, or every one with ``full`` (default: SMPTK_COMPILE_ALL=1).

    Imports the kernel modules for their configs, block sizes and codes only.
    """
    if full is None:
        full = os.environ.get("SMPTK_COMPILE_ALL", "0") == "1"
    import importlib

    # Modules by full name: ``smptk.kernels.fused_linear``, ``.swiglu``, ``.moe_route`` and ``.moe_dispatch``
    # are shadowed by the functions.
    _matmul, collectives, fused_linear, swiglu, grouped_gemm, moe_route, moe_dispatch = (
        importlib.import_module(f"smptk.kernels.{m}")
        for m in (
            "_matmul",
            "collectives",
            "fused_linear",
            "swiglu",
            "_grouped_gemm",
            "moe_route",
            "moe_dispatch",
        )
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
        out += _grouped_gemm_variants(arch, grouped_gemm, act_names, full)
        out += _route_variants(arch, dict(moe_route._FWD_BLOCKS), moe_route.SCORE_FUNCS, full)
        out += _dispatch_variants(
            arch,
            dict(moe_dispatch._PLAN_BLOCKS),
            moe_dispatch._SCAN_TILE_ELEMS,
            dict(moe_dispatch._ROW_BLOCKS),
            full,
        )
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
