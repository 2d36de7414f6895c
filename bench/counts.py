"""Analytic FLOP and byte counts, so throughput is work / measured time and never a guess.

FLOPs count the GEMMs only (2 per multiply-add); bias adds and activations are O(M*N) and left out, so
every implementation of an op is credited the same work. Backward = 2x the forward GEMM FLOPs (dx and
dW, one GEMM each per weight).

Bytes are the **compulsory** HBM traffic of the mathematical function: every input read once and every
output written once, in the tensors' dtype. Intermediates an implementation chooses to save or recompute
(pre-activations, gate/up products) are not counted, so bytes / time is a lower bound on the bandwidth
actually used. Backward reads dy, x and the weights and writes dx, dW (and db).

Example::

    >>> linear_flops(m=4096, k=4096, n=14336, backward=False)
    481036337152
    >>> linear_bytes(m=7, k=16, n=24, elem=2, bias=True, backward=False)  # (7*16 + 24*16 + 24 + 7*24) * 2
    1376
"""

from __future__ import annotations


def linear_flops(*, m: int, k: int, n: int, backward: bool, gemms: int = 1) -> int:
    """FLOPs of ``gemms`` GEMMs ``[m, k] x [k, n]`` forward, and 3x that with the backward."""
    forward = 2 * m * n * k * gemms
    return forward * 3 if backward else forward


def linear_bytes(*, m: int, k: int, n: int, elem: int, bias: bool, backward: bool, weights: int = 1) -> int:
    """Compulsory bytes of an ``[m, n]`` result from ``x [m, k]`` and ``weights`` ``[n, k]`` matrices.

    ``weights=2`` is swiglu (gate and up weights, one ``[m, n]`` product). One GEMM against a concatenated
    ``[2n, k]`` weight is ``weights=1`` with ``n`` doubled.
    """
    fwd = m * k + weights * n * k + (n if bias else 0) + m * n
    if not backward:
        return fwd * elem
    # dy, x and the weights are read; dx, dW (and db) written.
    bwd = m * n + m * k + weights * n * k + m * k + weights * n * k + (n if bias else 0)
    return (fwd + bwd) * elem


# Collectives. ``size`` follows nccl-tests (doc/PERFORMANCE.md in NVIDIA/nccl-tests): algbw = size / time,
# where size is the all-reduce buffer, all-gather's whole output, reduce-scatter's whole input and
# all-to-all's whole send buffer; busbw = algbw x a factor that makes it comparable with the link's
# bandwidth whatever the world size. ``peer_bytes`` is what one rank of smptk's kernels reads from its
# peers' buffers (the traffic that crosses NVLink on a real node).
COLLECTIVES = ("all_reduce_one_shot", "all_reduce_two_shot", "all_gather", "reduce_scatter", "all_to_all")


def collective_counts(kind: str, *, world: int, size_bytes: int) -> dict[str, float | int]:
    """nccl-tests' size and bus factor, and the peer bytes one rank reads, for a collective of ``size_bytes``.

    ``size_bytes`` is nccl-tests' size: the all-reduce buffer, all-gather's output, reduce-scatter's input,
    all-to-all's send buffer (equal splits).

    Example::

        >>> collective_counts("all_reduce_two_shot", world=8, size_bytes=1 << 20)
        {'size_bytes': 1048576, 'busbw_factor': 1.75, 'peer_bytes': 1835008}
        >>> collective_counts("all_gather", world=8, size_bytes=8 << 20)["peer_bytes"]  # 7 peers x 1 MiB
        7340032
    """
    if kind not in COLLECTIVES:
        raise ValueError(f"kind: expected one of {COLLECTIVES}, got {kind!r}")
    if world < 1:
        raise ValueError(f"world: expected >= 1, got {world}")
    if size_bytes < 0:
        raise ValueError(f"size_bytes: expected >= 0, got {size_bytes}")
    others = (world - 1) / world
    if kind.startswith("all_reduce"):
        factor = 2 * others
        # one-shot: every peer's whole buffer; two-shot: (W-1) slices of 1/W in each of its two phases.
        peer = (world - 1) * size_bytes if kind == "all_reduce_one_shot" else 2 * others * size_bytes
    else:
        factor = others
        # all-gather / reduce-scatter: (W-1) blocks of size/W; all-to-all: (W-1) of the W segments.
        peer = others * size_bytes
    return {"size_bytes": size_bytes, "busbw_factor": factor, "peer_bytes": round(peer)}


# What each collective's kernel compiled to, as row columns beside its bandwidth (issue: "PTX facts in the
# benchmark rows"): the data-moving kernel of each op in smptk.kernels.collectives.
COLLECTIVE_KERNELS = {
    "all_reduce_one_shot": "_all_reduce_one_shot_kernel",
    "all_reduce_two_shot": "_all_reduce_two_shot_kernel",
    "all_gather": "_all_gather_kernel",
    "reduce_scatter": "_reduce_scatter_kernel",
    "all_to_all": "_all_to_all_kernel",
}
PTX_COLUMNS = ("v128_loads", "v128_stores", "scalar_loads", "scalar_stores", "registers", "local_bytes")


def kernel_code_fields(kind: str, max_sms: int) -> dict[str, object]:
    """The ``ptx`` / ``ptx_note`` fields of a row for ``kind`` just run at ``max_sms`` (0: copy engine).

    ``ptx``: :func:`smptk.kernels._codegen.compiled_facts` of the kernel that ran (its PTX target, counts of
    128-bit and scalar global accesses, registers and local bytes per thread), or None when nothing was
    compiled, ``ptx_note`` saying why: the copy engine moves data with no kernel, and Triton's interpreter
    (a CPU) compiles nothing. Static counts: a loop body counts once, so they tell how wide the accesses
    are, not how many run.

    Example::

        >>> kernel_code_fields("all_gather", 0)["ptx_note"]
        'copy engine: no kernel moves the data (tensor copies)'
    """
    if kind not in COLLECTIVE_KERNELS:
        raise ValueError(f"kind: expected one of {tuple(COLLECTIVE_KERNELS)}, got {kind!r}")
    if max_sms == 0:
        return {"ptx": None, "ptx_note": "copy engine: no kernel moves the data (tensor copies)"}
    from smptk.comm.collectives import last_compiled
    from smptk.kernels import runtime
    from smptk.kernels._codegen import compiled_facts

    facts = compiled_facts(last_compiled(COLLECTIVE_KERNELS[kind]))
    if facts is None and runtime.interpreter_enabled():
        return {
            "ptx": None,
            "ptx_note": "nothing compiled: the kernel ran in Triton's interpreter (CI's compile checks hold "
            "the sm_90 figures: tests/test_comm_ptx.py)",
        }
    if facts is None:
        return {
            "ptx": None,
            "ptx_note": f"no compiled {COLLECTIVE_KERNELS[kind]} was recorded in this process",
        }
    return {
        "ptx": {k: facts[k] for k in ("target", *PTX_COLUMNS)},
        "ptx_note": "static counts in the PTX of the kernel that ran (a loop body counts once); registers "
        "and local bytes per thread as the driver reports them",
    }


# GEMM interference targets: a collective on k of the GPU's SMs may slow a concurrent GEMM by about its
# share of the SMs, with a 20% margin; the copy engines (k = 0: no SM moves data) by at most 3%.
SLOWDOWN_MARGIN = 1.2
COPY_ENGINE_SLOWDOWN = 1.03


def gemm_slowdown_bound(k: int, sm_count: int) -> float:
    """The largest GEMM slowdown a collective on ``k`` of ``sm_count`` SMs should cause.

    ``1 + 1.2 k / sm_count`` for ``k >= 1``; 1.03 for ``k = 0`` (the copy-engine algorithm).

    Example::

        >>> gemm_slowdown_bound(8, 132)  # 1 + 1.2 * 8 / 132
        1.0727272727272728
        >>> gemm_slowdown_bound(0, 132)
        1.03
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k: expected an SM count >= 0, got {k!r}")
    if isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 1:
        raise ValueError(f"sm_count: expected a positive SM count, got {sm_count!r}")
    if k > sm_count:
        raise ValueError(f"k: {k} SMs is more than the GPU's {sm_count}")
    return COPY_ENGINE_SLOWDOWN if k == 0 else 1.0 + SLOWDOWN_MARGIN * k / sm_count


# Mixture-of-Experts. Legend: T tokens, H hidden size, F expert FFN width, E experts, k experts per token,
# P = T * k routed (token, expert) pairs (dropless: every pair is computed).


def moe_layer_flops(*, tokens: int, hidden: int, ffn: int, experts: int, top_k: int, backward: bool) -> int:
    """GEMM FLOPs of a top-k SwiGLU MoE layer: the router ``[T, H] x [H, E]`` plus 3 GEMMs per routed pair.

    Forward = ``2*T*H*E + 3 * 2*T*k*H*F`` (gate, up and down projections of each of the T*k pairs);
    with the backward 3x that (dx and dW, one GEMM each per forward GEMM). Routing, gathers, the SwiGLU
    product and the weighted combine are O(T*k*(H + F)) and not counted, as in :func:`linear_flops`.

    Example::

        >>> moe_layer_flops(tokens=4096, hidden=4096, ffn=14336, experts=8, top_k=2, backward=False)
        2886486458368
    """
    router = 2 * tokens * hidden * experts
    experts_fwd = 3 * 2 * tokens * top_k * hidden * ffn
    forward = router + experts_fwd
    return forward * 3 if backward else forward


def moe_layer_bytes(
    *, tokens: int, hidden: int, ffn: int, experts: int, top_k: int, elem: int, backward: bool
) -> int:
    """Compulsory bytes of the MoE layer as a function of x and its weights, every tensor in ``elem``.

    Forward reads x ``[T, H]``, the router ``[E, H]`` and the expert weights ``3 x [E, F, H]`` and writes
    y ``[T, H]``; the backward reads dy, x and the weights again and writes dx and every weight gradient.
    ``top_k`` does not enter: the grouped rows are intermediates (see :func:`moe_routing_bytes` for them).
    """
    del top_k  # part of the signature so every MoE count takes the same shape arguments
    x = tokens * hidden
    weights = experts * hidden + 3 * experts * ffn * hidden
    fwd = x + weights + x
    if not backward:
        return fwd * elem
    bwd = x + x + weights + x + weights  # dy, x, weights read; dx, dW written
    return (fwd + bwd) * elem


def moe_routing_bytes(
    *, tokens: int, hidden: int, experts: int, top_k: int, elem: int, backward: bool, logit_elem: int = 4
) -> int:
    """Compulsory bytes of moe_route + moe_dispatch + moe_combine, each op's inputs and outputs once.

    Forward: route reads the logits ``[T, E]`` (``logit_elem``, fp32 in the layer) and writes the fp32
    weights and int32 ids ``[T, k]``; dispatch reads x ``[T, H]`` and writes the grouped rows ``[P, H]``;
    combine reads the experts' rows ``[P, H]`` and the weights and writes ``[T, H]``. Backward: combine
    reads dout ``[T, H]``, the weights and the rows and writes drows ``[P, H]`` and dweights ``[P]``
    (fp32); dispatch reads ``[P, H]`` and writes dx ``[T, H]``; route reads dweights and the logits and
    writes dlogits. The dispatch plan's index arrays (O(P) int64) are left out.

    Example::

        >>> moe_routing_bytes(tokens=7, hidden=16, experts=4, top_k=2, elem=2, backward=False)
        1624
    """
    T, H, E, k = tokens, hidden, experts, top_k
    P = T * k
    route = T * E * logit_elem + P * 4 + P * 4
    dispatch = T * H * elem + P * H * elem
    combine = P * H * elem + P * 4 + T * H * elem
    fwd = route + dispatch + combine
    if not backward:
        return fwd
    combine_b = T * H * elem + P * 4 + P * H * elem + P * H * elem + P * 4
    dispatch_b = P * H * elem + T * H * elem
    route_b = P * 4 + 2 * T * E * logit_elem
    return fwd + combine_b + dispatch_b + route_b


def moe_memory_estimate(
    *, tokens: int, hidden: int, ffn: int, experts: int, top_k: int, elem: int, backward: bool
) -> int:
    """Upper estimate of the device bytes one MoE layer benchmark case holds at its peak (not a measurement).

    Weights (and their gradients with the backward), the fp32 copies the router and the fp32 correctness
    reference make (x, logits, the weights once more at 4 bytes, one expert's fp32 intermediates), and
    activations bounded by ``T*H*3 + P*(3*H + 6*F)`` elements: x, dx and y, and per pair the gathered row,
    the expert output and its weighted copy plus six F-wide tensors (gate, up, their SwiGLU product and
    activation, or the saved ``[g | u]`` pre-activation). The backward doubles the activations (their
    gradients). Used to skip a case, with this number in the reason, when the device has less free memory.

    Example::

        >>> moe_memory_estimate(tokens=7, hidden=16, ffn=24, experts=4, top_k=2, elem=2, backward=False)
        36096
    """
    T, H, F, E, k = tokens, hidden, ffn, experts, top_k
    P = T * k
    weights = (E * H + 3 * E * F * H) * elem
    acts = (T * H * 3 + P * (3 * H + 6 * F)) * elem
    fp32_copies = 4 * (T * H + T * E) + 4 * (E * H + 3 * E * F * H) + 4 * (P * 3 * F // max(E, 1) + T * H)
    if backward:
        return 2 * weights + 2 * acts + fp32_copies
    return weights + acts + fp32_copies
