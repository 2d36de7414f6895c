"""Compile every smptk Triton kernel for real GPU targets (sm_90 H100, sm_80 A100) and read what it became.

The CPU test suite runs the kernels under ``TRITON_INTERPRET=1``, which never lowers them: errors that only
the compiler raises (plain Python globals read inside ``@triton.jit``, mismatched types across an if/while,
unsupported dtypes or ops for a target, bad inline asm, ptxas failures) stay hidden until a GPU run, and so
does what the code turns into (tensor-core MMA or FMA loops, TMA or plain loads, register spills). This
module lowers each kernel all the way to a cubin with ``triton.compile(ASTSource(...), GPUTarget(...))``
(Triton's own code generator, LLVM and the bundled ptxas; no driver, no device) and reports, per variant,
facts about the result:

- from the PTX: ``wgmma`` (``wgmma.mma_async`` instructions), ``tma_loads``
  (``cp.async.bulk.tensor.Nd.shared::cta.global``) and ``tma_stores``
  (``cp.async.bulk.tensor.Nd.global.shared``); ``v128_loads`` / ``v128_stores``, the 128-bit global
  accesses (``ld.global[.qualifiers].v4.b32``, ``.v2.b64`` and the typed spellings), and ``scalar_loads`` /
  ``scalar_stores``, the global accesses of one 8-, 16- or 32-bit element (``ld.global.b16``, ``.b32``...;
  data and control words alike);
- from ``ptxas -v`` (``--gpu-name=sm_90a`` / ``sm_80``, Triton's own flags): ``registers`` per thread and
  ``spill_stores`` / ``spill_loads`` in bytes. The log is the one of the ptxas run that made the cubin
  (``TRITON_DUMP_PTXAS_LOG=1`` in the workers); when Triton's cache answered instead, a cached record keyed
  by the PTX's hash, else a ptxas run of our own (``triton.backends.nvidia.compiler.get_ptxas(arch)``).

Layout (used by ``tests/test_kernels_compile.py``, and runnable on its own):

- ``variants(full=False)``: the variant table as plain data (ids and specs). Building it imports the kernel
  modules only to read their configs, block sizes and codes; nothing is compiled in the calling process.
- ``compile_variants(ids)``: runs worker processes (``python tests/_compile_kernels.py --worker``) with
  ``TRITON_INTERPRET`` removed from their environment (with it set, ``@triton.jit`` returns interpreter
  objects that cannot be compiled), feeds them variant ids one at a time and collects one JSON result per
  id. A worker that dies (an LLVM/MLIR abort) costs only the variant it was compiling; it is restarted.
- ``python tests/_compile_kernels.py [-k SUBSTR] [--all] [--jobs N] [--list]``: prints one JSON line per
  variant (``{"id", "kernel", "ok", "error", "seconds", "shared", "cubin_bytes", "wgmma", "tma_loads",
  "tma_stores", "v128_loads", "v128_stores", "scalar_loads", "scalar_stores", "registers", "spill_stores",
  "spill_loads"}``), then a summary on stderr (variants that
  failed, spill, or need more shared memory than the target has), and exits 1 if any failed to compile.

Coverage. ``SMPTK_COMPILE_ALL=1`` / ``--all`` (``smptk.settings.compile_all()``) takes the full set.

- The GEMM engine (``smptk.kernels._gemm._gemm_kernel``, ids ``gemm-sm<arch>-<specialization id>``): not a
  table here but what the launchers produce, ``_gemm.specializations()``: per op kind (dense /
  rows-by-expert / reduction-by-expert, SwiGLU, two-pair dx, weight grads) and shipped config, the
  heaviest epilogue; TMA variants in bf16, pointer variants in bf16 and fp32 with TF32 off ("ieee") and on
  ("tf32"). Quick set: on sm_90 every TMA variant (46); on sm_90 and on sm_80 (TMA needs sm_90) the
  pointer variants at each op kind's smallest and largest config in bf16 and its smallest in each fp32
  precision (40 per arch, ``_quick_pointer``). Full set: ``specializations(full=True)`` (fp16 too, every
  epilogue) on every config, both archs. Signatures as Triton's launcher specializes the ops' launches
  (``Specialization``): the unit strides and a dense product's E = 1 are constexprs, the other sizes and
  strides i32 with ``tt.divisibility = 16`` (multiples of 16), pointers 16-byte aligned; ``num_warps`` /
  ``num_stages`` from the config.
- ``_act_bwd_kernel`` (every activation x the STORE_DZ/COLSUM pairs the launcher uses, every dtype, one
  generic-stride variant), ``_colsum_kernel`` in every dtype, ``_swiglu_dh_kernel`` in bf16 (full: every
  dtype, generic strides, i64 rows), all from ``smptk.kernels._epilogue``.
- collectives, USE_CLOCK=True (the CUDA path, ``%globaltimer`` inline PTX): every op valid for each of
  fp32/bf16/fp16/int32 (ACC fp32, or int32 for int32; no int32 "avg", which the host never launches) with
  the default 300 s timeout (an i64 argument); per kernel one bf16 variant with an i32 timeout and i64 sizes,
  and one with SIMULATED=True where the kernel has that flag; the one-program ``_signal_kernel`` of the
  copy-engine collectives (no data, no dtype) in the same three modes. Built with each kernel's own launch
  options (``collectives.LAUNCH_OPTIONS``: ``num_warps``, ``maxnreg``; the signal kernel's
  ``SIGNAL_LAUNCH_OPTIONS``: one warp), as the launch path runs them.
- ``moe_route`` and ``moe_dispatch`` kernels (T = 4096 tokens, H = 2048): per kernel the DeepSeek-V2-Lite
  set-up (E = 64, k = 6; bf16 logits and rows, int32 ids, fp32 routing weights, capacity factor 1.25)
  and an int64 one: DeepSeek-V3 routing (E = 256, k = 8, sigmoid + expert bias) in fp32 past 2^31 tokens,
  int64 ids past 2^31 pairs without a capacity (an i64 capacity); ``_route_stats_kernel`` the int64 one
  only, the row kernels bf16 only (``_gather_sum_kernel`` also without weights, dispatch's backward).
  Full: the set-ups E = k = 1, (8, 2), (64, 6), (160, 6) and (256, 8) in every dtype, ids dtype and with
  and without a capacity, every score x renormalize x bias flag, fp16 / fp32 rows with fp32 or same-dtype
  weights, generic strides, top_k = 1, i64 sizes per kernel, and a one-program statistics launch.

The elementwise and MoE variants name the argument values of a concrete launch and derive the signature
from them as Triton's launcher does (``_from_values``: an int equal to 1 becomes a constexpr, a multiple of
16 is aligned); their ids start with ``act_bwd`` / ``colsum`` / ``swiglu_dh`` / ``moe_``. Select a family
with ``-k gemm-`` / ``-k moe_`` / ``-k sm80``.

This file is over 600 lines: the MoE routing and dispatch variants are a table of concrete launches, one
function per kernel family, kept next to the driver that compiles them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
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

from smptk.kernels._codegen import parse_ptxas_log, ptx_counts

REPO_ROOT = Path(__file__).resolve().parent.parent
ARCHS = (90, 80)  # sm_90 (H100), sm_80 (A100)
# Max shared memory per block (opt-in) per arch; a config above it compiles but cannot launch there (the
# autotuner skips it as OutOfResources), so it is reported, not failed.
SMEM_LIMIT = {90: 232448, 80: 166912}
WORKER_START_TIMEOUT_S = 300.0  # importing torch + triton on a loaded machine
VARIANT_TIMEOUT_S = 600.0  # one compile; the largest fp32 GEMM tiles take about a minute on a busy 2-core box

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
    arguments that carry ``tt.divisibility = 16``. GEMM engine variants also carry ``gemm_path`` ("tma" or
    "pointer"); they and the collectives carry ``dtype`` (the data's Triton type), which the instruction-level
    checks read.
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
    gemm_path: str = ""
    dtype: str = ""
    maxnreg: int | None = None  # ptxas register cap (the collectives' launch option), None for none

    @property
    def kernel_name(self) -> str:
        return self.kernel.split(":")[1]

    def describe(self) -> str:
        """The specialization in one paragraph, for failure messages."""
        consts = ", ".join(f"{k}={c.name if isinstance(c, TlDtype) else c!r}" for k, c in self.constexprs)
        types = ", ".join(f"{k}: {t}" for k, t in self.types)
        return (
            f"{self.kernel} for sm_{self.arch}, num_warps={self.num_warps}, num_stages={self.num_stages}"
            f"{'' if self.maxnreg is None else f', maxnreg={self.maxnreg}'}\n"
            f"  constexprs: {consts}\n  types (others i32): {types}\n"
            f"  16-byte aligned: {', '.join(self.aligned) or 'none'}"
        )


def _variant(
    vid, kernel, arch, types, constexprs, aligned, num_warps=4, num_stages=3, cost=1, **gemm
) -> Variant:
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
        **gemm,
    )


# --- signatures from argument values -----------------------------------------------------------------

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


# --- the GEMM engine: what the launchers produce ---------------------------------------------------------

_GEMM = "smptk.kernels._gemm:_gemm_kernel"


def _quick_pointer(specs: list) -> set[str]:
    """Pointer-path specialization ids of the quick set: per op kind, bf16 at the smallest and the largest
    config (by tile volume) and fp32 at the smallest, with TF32 off and on. The configs between, fp16 and
    every epilogue are in the full set (each pointer compile takes 1-5 s with Triton 3.9 on a 2-core
    machine; the configs between are another 192 of them)."""
    by_kind: dict[tuple, list] = {}
    for s in specs:
        if s.path == "pointer":
            by_kind.setdefault((s.name, s.dtype, s.constexprs["PRECISION"]), []).append(s)
    keep = set()
    for (_, dtype, _), group in by_kind.items():
        ranked = sorted(
            group, key=lambda s: (s.config.block_m * s.config.block_n * s.config.block_k, s.config.warps)
        )
        keep |= {ranked[0].id} if dtype == "fp32" else {ranked[0].id, ranked[-1].id}
    return keep


def _gemm_variants(arch: int, specs: list, full: bool) -> list[Variant]:
    """One variant per ``_gemm.Specialization`` this arch can run (TMA ones on sm_90+ only); the quick set
    takes every TMA one and ``_quick_pointer``'s pointer ones, on each arch."""
    quick = None if full else _quick_pointer(specs)
    out = []
    for s in specs:
        if (s.path == "tma" and arch < 90) or (
            quick is not None and s.path == "pointer" and s.id not in quick
        ):
            continue
        sig = s.signature()
        ptrs = {name: t for name, t in sig.items() if t.startswith("*")}
        types = {name: t for name, t in sig.items() if t not in ("constexpr", "i32")}
        c = s.config
        # fp32 "ieee" products are FMA loops unrolled over the tile: the slowest compiles.
        cost = c.block_m * c.block_n * (2 if s.constexprs.get("DUAL") == 2 else 1) // 256
        cost *= 8 if s.constexprs["PRECISION"] == "ieee" else 1
        out.append(
            _variant(
                f"gemm-sm{arch}-{s.id}", s.kernel, arch, types, s.constexprs, [*ptrs, *s.aligned], c.warps,
                c.stages, cost, gemm_path=s.path, dtype=s.dtype,
            )
        )  # fmt: skip
    return out


# --- elementwise kernels of the GEMM engine (_epilogue.py) ----------------------------------------------

_EPI = "smptk.kernels._epilogue:"
# swiglu_dh's launch: dy [T, N], h and dh [T, 2N] (one MoE layer's expert width N = 1408 over 16K rows).
_DH_T, _DH_N = 16384, 1408


def _elementwise_variants(arch: int, blocks: dict, full: bool) -> list[Variant]:
    out = []
    act_bwd_strides = ("s_dym", "s_dyn", "s_zm", "s_zn", "s_dzm", "s_dzn")
    for dtype in _FLOAT_DTYPES:
        for act, act_name in sorted(blocks["act_names"].items()):
            # The launcher's pairs: dz is stored iff there is an activation; with none, only the colsum.
            for store_dz, colsum in ((False, True),) if act == 0 else ((True, False), (True, True)):
                types = {"dy_ptr": f"*{dtype}", "z_ptr": f"*{dtype}", "dz_ptr": f"*{dtype}"}
                types["partial_ptr"] = "*fp32" if colsum else f"*{dtype}"
                consts = {"s_dyn": 1, "s_zn": 1, "s_dzn": 1}
                consts.update(ACTIVATION=act, STORE_DZ=store_dz, COLSUM=colsum, **blocks["act_bwd"])
                aligned = [*types, "M", "N", *(s for s in act_bwd_strides if s not in consts)]
                flags = "-".join(f for f, on in (("dz", store_dz), ("colsum", colsum)) if on)
                # Contiguous dy/z/dz; one generic-strides variant (dy from autograd may be any view).
                layouts = ("contig", "generic") if (dtype, act, colsum) == ("bf16", 4, True) else ("contig",)
                for layout in layouts:
                    lconsts = dict(consts)
                    if layout == "generic":  # no unit strides: the launcher's smaller strided tile
                        lconsts = {k: c for k, c in consts.items() if not k.startswith("s_")}
                        lconsts.update(blocks["act_bwd_strided"])
                    out.append(
                        _variant(
                            f"act_bwd-sm{arch}-{dtype}-{act_name}-{flags}-{layout}",
                            _EPI + "_act_bwd_kernel",
                            arch,
                            types,
                            lconsts,
                            aligned if layout == "contig" else [],
                        )
                    )
        out.append(
            _variant(
                f"colsum-sm{arch}-fp32_to_{dtype}",
                _EPI + "_colsum_kernel",
                arch,
                {"partial_ptr": "*fp32", "out_ptr": f"*{dtype}"},
                {"BLOCK_N": blocks["colsum"]},
                ["partial_ptr", "out_ptr", "N"],
            )
        )
        # _swiglu_dh_kernel (a plain launch, dense and grouped SwiGLU backward): contiguous, any strides,
        # and rows past int32.
        for layout, big in (("contig", False), ("generic", False), ("contig", True)):
            if not (full or (dtype, layout, big) == ("bf16", "contig", False)):
                continue
            rows, N = (_BIG if big else _DH_T), _DH_N
            ints = dict(M=rows, N=N, s_dym=N, s_dyn=1, s_hm=2 * N, s_hn=1, s_dhm=2 * N, s_dhn=1)
            ptrs = {p: f"*{dtype}" for p in ("dy_ptr", "h_ptr", "dh_ptr")}
            types, cx, aligned = _from_values(ptrs, ints, layout)
            vid = f"swiglu_dh-sm{arch}-{dtype}-{layout}{'-i64' if big else ''}"
            out.append(
                _variant(vid, _EPI + "_swiglu_dh_kernel", arch, types, cx | blocks["swiglu_dh"], aligned)
            )
    return out


# --- collectives ----------------------------------------------------------------------------------------

_COLL_DTYPES = ("fp32", "bf16", "fp16", "i32")
_COLL = "smptk.kernels.collectives:"
# kernel -> (has OP/ACC, extra int64 address-table pointers); None: moves no data (no in/out, no dtype)
_COLL_KERNELS = {
    "_all_reduce_one_shot_kernel": (True, ()),
    "_all_reduce_two_shot_kernel": (True, ()),
    "_all_gather_kernel": (False, ()),
    "_reduce_scatter_kernel": (True, ()),
    "_all_to_all_kernel": (False, ("in_off_W", "in_len_W", "out_off_W", "out_len_W")),
    "_signal_kernel": (False, None),  # the copy-engine collectives' barrier: one program
}
_COLL_SHORT = {
    "_all_reduce_one_shot_kernel": "all_reduce_one_shot",
    "_all_reduce_two_shot_kernel": "all_reduce_two_shot",
    "_all_gather_kernel": "all_gather",
    "_reduce_scatter_kernel": "reduce_scatter",
    "_all_to_all_kernel": "all_to_all",
    "_signal_kernel": "signal",
}
# The size-like ints of each kernel (i64 in the large-size variant); rank and world stay i32.
_COLL_SIZES = {
    "_all_reduce_one_shot_kernel": ("n",),
    "_all_reduce_two_shot_kernel": ("n", "slice_n"),
    "_all_gather_kernel": ("n", "out_stride"),
    "_reduce_scatter_kernel": ("n", "in_stride"),
    "_all_to_all_kernel": ("slot",),
    "_signal_kernel": (),
}


def _collective_variants(
    arch: int, block: int, ops: dict[str, int], params: dict[str, list[str]], launch: dict[str, dict]
) -> list:
    """``params``: each kernel's argument names (a SIMULATED variant is added where the kernel has one);
    ``launch``: each kernel's launch options (``num_warps``, ``maxnreg``; empty: Triton's defaults)."""
    out = []
    for name, (has_op, tables) in _COLL_KERNELS.items():
        modes = ["default", "i32_timeout-i64_sizes"]
        if "SIMULATED" in params[name]:
            modes.append("simulated")
        if "TMA" in params[name] and arch >= 90:
            modes.append("tma")  # copy_path="tma": the copies load through TMA descriptors (sm_90+)
        for dtype in _COLL_DTYPES if tables is not None else ("",):
            op_items = sorted(ops.items(), key=lambda kv: kv[1]) if has_op else [(None, None)]
            for op_name, op in op_items:
                if dtype == "i32" and op_name == "avg":
                    continue  # the host takes torch.distributed's path for int32 avg
                for mode in modes:
                    if mode not in ("default", "tma") and not (dtype in ("bf16", "") and op in (None, 0)):
                        continue  # one variant per kernel for the other int widths and SIMULATED
                    if mode == "tma" and op not in (None, 0):
                        continue  # TMA changes the copies only: every dtype, one op
                    types = {"in_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"} if dtype else {}
                    types.update({t: "*i64" for t in ("data_W", "signal_W", *(tables or ()))})
                    types["status_ptr"] = "*i32"
                    types["timeout_ns"] = "i64"  # default timeout 300 s = 3e11 ns
                    types["call_tag"] = "i64"  # bit 62 set: always an int64 (see smptk.comm)
                    if mode == "i32_timeout-i64_sizes":
                        types["timeout_ns"] = "i32"
                        types.update({s: "i64" for s in _COLL_SIZES[name]})
                    consts = {"BLOCK": block, "USE_CLOCK": True}
                    if mode == "simulated":
                        consts["SIMULATED"] = True
                    if mode == "tma":
                        consts["TMA"] = 2  # as smptk.comm.collectives._tma sets it for a GPU
                    if has_op:
                        consts.update(OP=op, ACC=TlDtype("int32" if dtype == "i32" else "float32"))
                    # do_not_specialize: no int alignment; pointers (table entries, heap buffers) aligned.
                    aligned = [p for p, t in types.items() if t.startswith("*")]
                    op_part = f"-{op_name}" if has_op else ""
                    out.append(
                        _variant(
                            f"{_COLL_SHORT[name]}-sm{arch}{'-' * bool(dtype)}{dtype}{op_part}-{mode}",
                            _COLL + name,
                            arch,
                            types,
                            consts,
                            aligned,
                            num_warps=launch[name].get("num_warps", 4),
                            cost=2,
                            dtype=dtype,
                            maxnreg=launch[name].get("maxnreg"),
                        )
                    )
    return out


# --- MoE: routing, dispatch / combine ---------------------------------------------------------------------
#
# Specialization from argument values (``_from_values``): each variant passes the sizes and strides a real
# launch does, as the launchers in moe_route.py and moe_dispatch.py compute them.
_ROUTE = "smptk.kernels._moe_route_kernels:"
_DISP = "smptk.kernels._moe_dispatch_kernels:"
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


def _route_variants(arch: int, blocks: dict, score_funcs: dict[str, int], full: bool) -> list[Variant]:
    """moe_route's three kernels; ``blocks``: ``moe_route._FWD_BLOCKS`` (the CUDA values)."""
    out = []

    def launch_blocks(E):  # the launcher's own choice, with the CUDA block table
        b = importlib.import_module("smptk.kernels.moe_route")._blocks(E, blocks)
        return b["BLOCK_E"], b["BLOCK_T"], b["STATS_BLOCK_B"]

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
        BLOCK_E, BLOCK_P = importlib.import_module("smptk.kernels.moe_dispatch")._chunk_blocks(E, plan)
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
    from smptk import settings
    from smptk.kernels.heap_layout import OPS

    if full is None:
        full = settings.compile_all()
    # Modules by full name: ``smptk.kernels.moe_route`` and ``.moe_dispatch`` are shadowed by the functions.
    gemm, epilogue, collectives, moe_route, moe_dispatch = (
        importlib.import_module(f"smptk.kernels.{m}")
        for m in ("_gemm", "_epilogue", "collectives", "moe_route", "moe_dispatch")
    )

    blocks = {
        "act_names": {code: (name or "noact") for name, code in epilogue.ACTIVATION_CODES.items()},
        "act_bwd": dict(epilogue._ACT_BWD_BLOCK),
        "act_bwd_strided": dict(epilogue._ACT_BWD_BLOCK_STRIDED),
        "colsum": epilogue._COLSUM_BLOCK_N,
        "swiglu_dh": dict(epilogue._DH_BLOCK),
    }
    coll_params = {
        name: list(inspect.signature(getattr(collectives, name).fn).parameters) for name in _COLL_KERNELS
    }
    coll_launch = {name: getattr(getattr(collectives, name), "launch_options", {}) for name in _COLL_KERNELS}
    specs = list(gemm.specializations(full=full))
    specs += importlib.import_module("smptk.kernels._gemm_comm").specializations(full=full)  # all-gather GEMM
    out = []
    for arch in ARCHS:
        out += _gemm_variants(arch, specs, full)
        out += _elementwise_variants(arch, blocks, full)
        out += _collective_variants(arch, collectives.BLOCK, OPS, coll_params, coll_launch)
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


def _compile_one(v: Variant):
    """Compile ``v``; returns (facts about the kernel, its PTX)."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = v.kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    if hasattr(fn, "launch_options"):  # a kernel carrying its launch options (collectives._Launch)
        fn = fn.kernel
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
    options = {"num_warps": v.num_warps, "num_stages": v.num_stages}
    if v.maxnreg is not None:
        options["maxnreg"] = v.maxnreg
    kernel = triton.compile(src, target=GPUTarget("cuda", v.arch, 32), options=options)
    cubin = kernel.asm.get("cubin")
    if not cubin:
        raise RuntimeError("compiled without a cubin (ptxas did not run)")
    facts = {"shared": int(getattr(kernel.metadata, "shared", 0) or 0), "cubin_bytes": len(cubin)}
    return facts, kernel.asm["ptx"]


_GPU_NAME = {90: "sm_90a", 80: "sm_80"}  # Triton's --gpu-name per target (sm_90a: wgmma and TMA)


def _ptxas_facts(arch: int, ptx: str, compile_log: str) -> dict:
    """``parse_ptxas_log`` of the ptxas run that made the cubin. Triton prints its log into the compile's
    captured output (TRITON_DUMP_PTXAS_LOG=1) on a cache miss; the numbers are then kept in Triton's cache
    under the PTX's hash, so a cache hit reads them back. Failing both, ptxas runs here with Triton's flags
    (``-lineinfo -v --regAllocOptLevel=2 --gpu-name=...``)."""
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.runtime.cache import get_cache_manager

    tool = get_ptxas(arch).path
    key = hashlib.sha256(f"{tool}\n{_GPU_NAME[arch]}\n{ptx}".encode()).hexdigest()
    cache = get_cache_manager(key)
    cached = cache.get_file("ptxas_facts.json")
    if cached is not None:
        with open(cached) as f:
            return json.load(f)
    facts = parse_ptxas_log(compile_log)
    if facts is None:
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "kernel.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            cmd = [tool, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={_GPU_NAME[arch]}", src]
            run = subprocess.run(
                [*cmd, "-o", os.path.join(d, "kernel.cubin")], capture_output=True, text=True
            )
        facts = parse_ptxas_log(run.stdout + run.stderr)
        if facts is None:
            raise RuntimeError(
                f"ptxas -v printed no register/spill numbers (rc {run.returncode}):\n{run.stderr}"
            )
    cache.put(json.dumps(facts), "ptxas_facts.json", binary=False)
    return facts


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
        # Both sets: the GEMM engine's quick variants are named apart from the full set's.
        table = {v.id: v for full in (False, True) for v in variants(full=full)}
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
            ptx = None
            with _capture_output() as captured:
                try:
                    facts, ptx = _compile_one(v)
                    res.update(ok=True, error=None, **facts)
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
            else:
                res.update(ptx_counts(ptx))
                try:
                    res.update(_ptxas_facts(v.arch, ptx, captured["text"]))
                except Exception as e:  # compiled, but no numbers: the checks that need them fail
                    res["ptxas_error"] = f"{type(e).__name__}: {e}"
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
    env["TRITON_DUMP_PTXAS_LOG"] = "1"  # the register and spill numbers of each cubin (_ptxas_facts)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def default_jobs() -> int:
    from smptk import settings

    if settings.compile_jobs() is not None:
        return settings.compile_jobs()
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
    arch_of = {v.id: v.arch for full in (False, True) for v in variants(full=full)}
    for r in sorted(results.values(), key=lambda r: r["id"]):
        if r["ok"] and r.get("shared", 0) > SMEM_LIMIT[arch_of[r["id"]]]:
            limit = SMEM_LIMIT[arch_of[r["id"]]]
            print(
                f"note: {r['id']}: {r['shared']} B shared > {limit} B, cannot launch there", file=sys.stderr
            )
        if r["ok"] and (r.get("spill_stores") or r.get("spill_loads")):
            print(
                f"note: {r['id']}: spills ({r['spill_stores']} B stores, {r['spill_loads']} B loads, "
                f"{r['registers']} registers)",
                file=sys.stderr,
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
