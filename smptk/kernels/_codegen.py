"""What a compiled kernel's code says about its speed, read from its PTX and ptxas's report: no GPU needed.

One definition of the facts, used by the CI compile checks (``tests/_compile_kernels.py``, which compiles
for sm_90 / sm_80 with Triton's own ptxas) and by the benchmarks (which read them from the kernel that ran,
:func:`compiled_facts`, and put them in their rows beside the bandwidth):

- ``wgmma``: Hopper warp-group MMA instructions (a Hopper-grade GEMM has them);
- ``tma_loads`` / ``tma_stores``: TMA bulk tensor copies (``cp.async.bulk.tensor``) global -> shared and back;
- ``async_global_fences``: ``fence.proxy.async.global``, which TMA reads of data that ordinary stores wrote
  (and a barrier published) need first;
- ``v128_loads`` / ``v128_stores``: 128-bit global accesses (``ld.global.v4.b32``, ``.v2.b64``...), what a
  bandwidth-bound loop needs: a warp then moves 512 bytes per instruction;
- ``scalar_loads`` / ``scalar_stores``: 8- to 32-bit global accesses (a warp moves 32 to 128 bytes);
- from ptxas: ``registers`` per thread and the bytes it spilled to local memory.

Counts are static: instructions in the code, not executions. A loop's body counts once.

Example::

    >>> counts = ptx_counts("ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];\\nst.global.b16 [%rd2], %rs1;")
    >>> counts["v128_loads"], counts["scalar_stores"]
    (1, 1)
"""

from __future__ import annotations

import re
from typing import Any

# Qualifiers (.volatile, cache and eviction hints, .L2::...) may sit between "ld.global" and the vector/type
# suffix; 128 bits = 4 x 32 or 2 x 64 bits.
PTX_COUNTS = {
    "wgmma": re.compile(r"wgmma\.mma_async"),
    # Triton 3.9 writes the destination as shared::cta, 3.6 as shared::cluster (a 1-CTA cluster: same copy)
    "tma_loads": re.compile(r"cp\.async\.bulk\.tensor\.\dd\.shared::(?:cta|cluster)\.global"),
    "tma_stores": re.compile(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared"),
    # orders the generic proxy's global writes (a peer's data, published by a barrier) before TMA reads
    "async_global_fences": re.compile(r"fence\.proxy\.async\.global"),
    "v128_loads": re.compile(r"\bld\.global(?:\.[\w:]+)*?\.(?:v4\.[bfsu]32|v2\.[bfsu]64)\s"),
    "v128_stores": re.compile(r"\bst\.global(?:\.[\w:]+)*?\.(?:v4\.[bfsu]32|v2\.[bfsu]64)\s"),
    "scalar_loads": re.compile(r"\bld\.global(?:\.(?!v\d)[\w:]+)*?\.[bfsu](?:8|16|32)\s"),
    "scalar_stores": re.compile(r"\bst\.global(?:\.(?!v\d)[\w:]+)*?\.[bfsu](?:8|16|32)\s"),
}
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTX_TARGET = re.compile(r"^\s*\.target\s+(sm_\w+)", re.MULTILINE)


def ptx_counts(ptx: str) -> dict[str, int]:
    """``{fact: how many such instructions}`` in PTX text, for every fact of :data:`PTX_COUNTS`."""
    return {name: len(rx.findall(ptx)) for name, rx in PTX_COUNTS.items()}


def parse_ptxas_log(text: str) -> dict[str, int] | None:
    """Registers and spill bytes from a ``ptxas -v`` log (registers: the most of any function; spills:
    summed over functions); None when the log has no such lines.

    Example::

        >>> parse_ptxas_log("Used 94 registers\\n8 bytes spill stores, 8 bytes spill loads")
        {'registers': 94, 'spill_stores': 8, 'spill_loads': 8}
    """
    regs, spills = _PTXAS_REGS.findall(text), _PTXAS_SPILLS.findall(text)
    if not regs or not spills:
        return None
    return {
        "registers": max(int(r) for r in regs),
        "spill_stores": sum(int(s) for s, _ in spills),
        "spill_loads": sum(int(ld) for _, ld in spills),
    }


def compiled_facts(compiled: Any) -> dict[str, Any] | None:
    """The facts of a kernel Triton compiled and loaded (its ``CompiledKernel``, e.g. what a launch returned
    or :func:`smptk.comm.collectives.last_compiled`): :func:`ptx_counts` of its PTX, its ``target``
    (``sm_90a``...), ``registers`` per thread and ``local_bytes`` (local memory per thread, which is where
    spills go: 0 for a kernel that does not spill), as the driver reports them (Triton keeps the local size
    in 4-byte words, ``n_spills``). None without PTX (an interpreted kernel compiles nothing).

    Example (on a GPU, with one of smptk's kernels; a Triton launch returns what it compiled)::

        >>> import torch
        >>> from smptk.kernels import _moe_dispatch_kernels as K  # needs CUDA  # doctest: +SKIP
        >>> x = torch.randn(64, 256, device="cuda")  # needs CUDA  # doctest: +SKIP
        >>> src, out = torch.arange(64, device="cuda"), torch.empty_like(x)  # needs CUDA  # doctest: +SKIP
        >>> compiled = K._gather_rows_kernel[(2, 2)](  # out = x[src]; needs CUDA  # doctest: +SKIP
        ...     x, src, out, 64, 256, x.stride(0), x.stride(1), BLOCK_R=32, BLOCK_H=128)
        >>> facts = compiled_facts(compiled)  # needs CUDA  # doctest: +SKIP
        >>> facts["target"], facts["v128_loads"], facts["registers"]  # needs CUDA  # doctest: +SKIP

    Anything with the attributes of Triton's ``CompiledKernel`` will do, so it runs without a GPU too
    (here a stand-in with one line of PTX)::

        >>> import types
        >>> ptx = ".target sm_90a\\nld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];"
        >>> stand_in = types.SimpleNamespace(asm={"ptx": ptx}, n_regs=32, n_spills=0)
        >>> facts = compiled_facts(stand_in)
        >>> facts["target"], facts["v128_loads"], facts["registers"], facts["local_bytes"]
        ('sm_90a', 1, 32, 0)
        >>> compiled_facts(None) is None  # what an interpreted launch returns: it compiled nothing
        True
    """
    asm = getattr(compiled, "asm", None)
    ptx = asm.get("ptx") if isinstance(asm, dict) else None
    if not ptx:
        return None
    facts: dict[str, Any] = {"target": (m.group(1) if (m := _PTX_TARGET.search(ptx)) else None)}
    facts.update(ptx_counts(ptx))
    init = getattr(compiled, "_init_handles", None)
    if callable(init):  # loads the binary once; fills n_regs / n_spills (a launch has already done it)
        init()
    facts["registers"] = getattr(compiled, "n_regs", None)
    words = getattr(compiled, "n_spills", None)
    facts["local_bytes"] = None if words is None else 4 * int(words)
    return facts
