"""smptk.kernels._codegen: the PTX / ptxas facts the compile checks and the benchmark rows share."""

from __future__ import annotations

import doctest
import types

import pytest

from smptk.kernels import _codegen

PTX = """
.version 8.7
.target sm_90a
.address_size 64
    ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    ld.global.L1::evict_last.v4.b32 { %r5, %r6, %r7, %r8 }, [ %rd2 + 0 ];
    ld.global.v2.b64 { %rd3, %rd4 }, [ %rd5 + 0 ];
    st.global.v4.b32 [ %rd6 + 0 ], { %r1, %r2, %r3, %r4 };
    ld.global.b16 %rs1, [ %rd7 + 0 ];
    ld.global.acquire.gpu.b32 %r9, [ %rd8 + 0 ];
    st.global.b32 [ %rd9 + 0 ], %r9;
    ld.shared.v4.b32 { %r1, %r2, %r3, %r4 }, [ %r10 + 0 ];
    wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {...};
    cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2}], [%r4];
    cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [ %rd1, { %r2, %r3 } ], [ %r4 ];
    fence.proxy.async.global;
    fence.proxy.async.shared::cta;
    cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2}], [%r4];
"""


def test_ptx_counts_tell_access_widths_apart() -> None:
    """128-bit accesses (v4.b32 / v2.b64, with cache qualifiers), scalar ones, shared-memory accesses not
    counted as global, and the Hopper instructions."""
    counts = _codegen.ptx_counts(PTX)
    assert counts == {
        "wgmma": 1,
        "tma_loads": 2,  # Triton 3.9's shared::cta and 3.6's shared::cluster
        "tma_stores": 1,
        "async_global_fences": 1,
        "v128_loads": 3,
        "v128_stores": 1,
        "scalar_loads": 2,
        "scalar_stores": 1,
    }


def test_parse_ptxas_log_sums_spills_and_takes_the_most_registers() -> None:
    log = (
        "ptxas info    : Used 94 registers, used 1 barriers\n"
        "ptxas info    : 0 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads\n"
        "ptxas info    : Used 32 registers\n"
        "ptxas info    : 16 bytes stack frame, 12 bytes spill stores, 12 bytes spill loads\n"
    )
    assert _codegen.parse_ptxas_log(log) == {"registers": 94, "spill_stores": 16, "spill_loads": 20}
    assert _codegen.parse_ptxas_log("ptxas info: compiling") is None


def test_compiled_facts_read_a_compiled_kernel() -> None:
    """From a CompiledKernel-like object: the PTX counts, the target, registers and local bytes (Triton keeps
    the local size in 4-byte words); the handles are loaded first when the kernel has not run yet."""
    loaded = []
    compiled = types.SimpleNamespace(asm={"ptx": PTX, "cubin": b"\0"}, n_regs=94, n_spills=3)
    compiled._init_handles = lambda: loaded.append(True)
    facts = _codegen.compiled_facts(compiled)
    assert loaded == [True]
    assert facts["target"] == "sm_90a"
    assert facts["v128_loads"] == 3 and facts["scalar_stores"] == 1
    assert facts["registers"] == 94 and facts["local_bytes"] == 12


@pytest.mark.parametrize(
    "compiled", [None, types.SimpleNamespace(asm={}), types.SimpleNamespace(asm={"ptx": ""})]
)
def test_compiled_facts_without_ptx_are_none(compiled) -> None:
    """An interpreted launch returns nothing compiled: no facts, never zeros that look measured."""
    assert _codegen.compiled_facts(compiled) is None


def test_docstring_examples_run() -> None:
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    ran = 0
    for test in finder.find(_codegen):
        if test.name.endswith(("ptx_counts", "parse_ptxas_log", "_codegen")):
            ran += runner.run(test).attempted
    assert ran >= 3 and runner.failures == 0


def test_benchmark_rows_say_where_their_code_facts_come_from(monkeypatch) -> None:
    """bench.counts.kernel_code_fields: the facts of the kernel that ran, or None with the reason (copy
    engine, interpreter, or no compiled kernel recorded), never zeros that look measured."""
    from bench import counts
    from smptk.comm import collectives
    from smptk.kernels import runtime

    assert counts.kernel_code_fields("all_gather", 0)["ptx_note"].startswith("copy engine")
    monkeypatch.setattr(runtime, "interpreter_enabled", lambda: True)
    monkeypatch.setattr(collectives, "_last_compiled", {})
    assert counts.kernel_code_fields("all_gather", 4)["ptx_note"].startswith("nothing compiled")
    monkeypatch.setattr(runtime, "interpreter_enabled", lambda: False)
    assert "no compiled _all_gather_kernel" in counts.kernel_code_fields("all_gather", 4)["ptx_note"]
    compiled = types.SimpleNamespace(asm={"ptx": PTX}, n_regs=94, n_spills=0)
    monkeypatch.setattr(collectives, "_last_compiled", {"_reduce_scatter_kernel": compiled})
    row = counts.kernel_code_fields("reduce_scatter", 8)
    assert row["ptx"] == {"target": "sm_90a", "v128_loads": 3, "v128_stores": 1, "scalar_loads": 2,
                          "scalar_stores": 1, "registers": 94, "local_bytes": 0}  # fmt: skip
    with pytest.raises(ValueError, match="kind: expected one of"):
        counts.kernel_code_fields("broadcast", 1)
