"""Probe: persistent TMA GEMM variants on the installed Triton, timed against cuBLAS in one run.

A development tool for choosing the Hopper path's configs (not part of the benchmark suites): for each
config it compiles a persistent kernel that loads A/B tiles and stores C tiles through device-side tensor
descriptors, checks the result against torch (bf16 inputs, fp32 reference), and times it with CUDA events
(triton.testing.do_bench, median) beside ``torch.matmul`` and eager ``gelu(linear(x, w, b))``.

    python -m bench.probe_gemm --m 16384 --k 4096 --n 14336 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _probe_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    NUM_PROGS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    GELU: tl.constexpr,
    SUBTILE: tl.constexpr,
    WS: tl.constexpr,
    STAGES: tl.constexpr,
):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    if SUBTILE:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN // 2])
    else:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_m * num_n
    in_group = GROUP_M * num_n
    for tile in tl.range(pid, num_tiles, NUM_PROGS, flatten=True, warp_specialize=WS):
        group = tile // in_group
        first_m = group * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % size_m)
        pid_n = (tile % in_group) // size_m
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in tl.range(k_tiles, num_stages=STAGES):
            a = a_desc.load([off_m, kk * BK])
            b = b_desc.load([off_n, kk * BK])
            acc = tl.dot(a, b.T, acc)
        if GELU:
            cols = off_n + tl.arange(0, BN)
            bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
            acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
        if SUBTILE:
            acc = tl.reshape(acc, (BM, 2, BN // 2))
            acc = tl.permute(acc, (0, 2, 1))
            c0, c1 = tl.split(acc)
            c_desc.store([off_m, off_n], c0.to(c_ptr.dtype.element_ty))
            c_desc.store([off_m, off_n + BN // 2], c1.to(c_ptr.dtype.element_ty))
        else:
            c_desc.store([off_m, off_n], acc.to(c_ptr.dtype.element_ty))


def _alloc(size: int, align: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=14336)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    triton.set_allocator(_alloc)
    M, K, N = args.m, args.k, args.n
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flops = 2.0 * M * N * K
    rows = []

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    ref_mm = x.float() @ w.float().T
    ref_gelu = torch.nn.functional.gelu(ref_mm + b.float())
    t_mm = bench(lambda: x @ w.T)
    t_eager = bench(lambda: torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b)))
    rows.append({"impl": "torch_matmul", "ms": t_mm, "tflops": flops / t_mm / 1e9})
    rows.append({"impl": "torch_eager_gelu", "ms": t_eager, "tflops": flops / t_eager / 1e9})
    print(
        f"torch.matmul {t_mm:.3f} ms {flops / t_mm / 1e9:.0f} TFLOP/s; eager gelu {t_eager:.3f} ms",
        flush=True,
    )
    configs = []
    for bm, bn, bk, stages, warps in (
        (128, 256, 64, 3, 8),
        (128, 256, 64, 4, 8),
        (128, 128, 64, 4, 8),
        (128, 128, 64, 5, 4),
        (128, 256, 128, 2, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 128, 3, 8),
    ):
        for gelu, subtile in itertools.product((False, True), (False, True)):
            configs.append((bm, bn, bk, stages, warps, gelu, subtile, False))
    configs += [(128, 256, 64, 3, 8, True, True, True), (128, 128, 64, 4, 8, True, True, True)]
    for bm, bn, bk, stages, warps, gelu, subtile, ws in configs:
        c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        progs = min(sms, triton.cdiv(M, bm) * triton.cdiv(N, bn))
        name = f"BM{bm}-BN{bn}-BK{bk}-s{stages}-w{warps}-gelu{int(gelu)}-sub{int(subtile)}-ws{int(ws)}"

        def run(
            c=c, bm=bm, bn=bn, bk=bk, stages=stages, warps=warps, gelu=gelu, subtile=subtile, ws=ws, p=progs
        ):
            _probe_kernel[(p,)](
                x,
                w,
                c,
                b,
                M,
                N,
                K,
                p,
                bm,
                bn,
                bk,
                8,
                gelu,
                subtile,
                ws,
                stages,
                num_warps=warps,
                num_stages=stages,
            )

        try:
            run()
            torch.cuda.synchronize()
        except Exception as exc:  # a config the installed Triton rejects: record why and go on
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            print(f"{name}: FAILED {msg}", flush=True)
            rows.append({"impl": name, "error": msg})
            continue
        ref = ref_gelu if gelu else ref_mm
        err = ((c.float() - ref).norm() / ref.norm()).item()
        t = bench(run)
        row = {
            "impl": name,
            "ms": t,
            "tflops": flops / t / 1e9,
            "rel_err": err,
            "pct_matmul": 100 * t_mm / t,
            "vs_eager": t_eager / t if gelu else None,
        }
        rows.append(row)
        print(
            f"{name}: {t:.3f} ms {row['tflops']:.0f} TFLOP/s ({row['pct_matmul']:.0f}% of matmul) "
            f"err {err:.1e}" + (f" {t_eager / t:.2f}x eager" if gelu else ""),
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "M": M,
                    "K": K,
                    "N": N,
                    "torch": torch.__version__,
                    "triton": triton.__version__,
                    "gpu": torch.cuda.get_device_name(),
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
