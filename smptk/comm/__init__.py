"""Collectives over symmetric memory with a bounded SM budget, falling back to torch.distributed.

Same call shapes as torch.distributed; ``max_sms`` bounds the SMs (programs) a collective occupies:

- :func:`all_reduce` (in place), :func:`all_gather_into_tensor`, :func:`reduce_scatter_tensor`,
  :func:`all_to_all_single` (uneven splits).
- :func:`configure` / :func:`settings` (``max_sms``, ``timeout_s``, ``heap_bytes``, ``copy_path``;
  environment variables SMPTK_COMM_MAX_SMS, SMPTK_COMM_TIMEOUT_S, SMPTK_COMM_HEAP_BYTES,
  SMPTK_COMM_COPY_PATH), :func:`last_path`, :func:`reset`, :func:`check`, :func:`heaps` (this process's
  symmetric heaps and their bytes).
- :mod:`smptk.comm.functional`: the same collectives as out-of-place autograd ops whose backward is
  the matching collective (all_gather, reduce_scatter, all_reduce, all_to_all, copy_to_group,
  reduce_from_group), along any dimension, taking a ProcessGroup or a DeviceMesh dimension. A module
  of its own because its ``all_reduce`` is not the in-place one above.
- :class:`CommTimeoutError` when a peer never arrives; :class:`CommMismatchError` when ranks make
  different calls (collective, dtype, size, op, algorithm or max_sms); :class:`CommError`
  for an unusable heap.

The symmetric heap (:mod:`smptk.comm.heap`) uses torch symmetric memory on CUDA and POSIX shared memory
on CPU, where the same Triton kernels run under ``TRITON_INTERPRET=1``.
"""

from smptk.comm import functional
from smptk.comm.collectives import (
    COPY_PATHS,
    CommError,
    CommMismatchError,
    CommTimeoutError,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    check,
    configure,
    heaps,
    last_path,
    reduce_scatter_tensor,
    reset,
    settings,
)

__all__ = [
    "COPY_PATHS",
    "CommError",
    "CommMismatchError",
    "CommTimeoutError",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "check",
    "configure",
    "functional",
    "heaps",
    "last_path",
    "reduce_scatter_tensor",
    "reset",
    "settings",
]
