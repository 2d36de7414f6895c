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
