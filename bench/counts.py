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
