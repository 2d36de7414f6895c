"""Plug smptk's collectives into the engines people already run: DDP and FSDP2.

- :func:`ddp_comm_hook` / :class:`SmptkHookState`: a DDP communication hook that averages each gradient
  bucket with :func:`smptk.comm.all_reduce`. On CUDA the all-reduce runs on the hook state's own stream,
  ordered after the bucket's gradients and overlapping the rest of the backward pass; the returned
  future completes on that stream, so DDP's final copy waits only for the collective.
- :class:`SmptkAllGather` / :class:`SmptkReduceScatter`: FSDP2 comm objects for
  ``module.set_custom_all_gather(...)`` / ``module.set_custom_reduce_scatter(...)`` (torch >= 2.8). FSDP2
  calls them on its own all-gather / reduce-scatter streams; they run there, in stream order.

Example (under ``TRITON_INTERPRET=1 torchrun --nproc-per-node 2``, every rank; gloo on CPU; without the
interpreter the same calls take the torch.distributed fallback)::

    >>> import torch
    >>> import torch.distributed as dist
    >>> from torch import nn
    >>> from torch.distributed.fsdp import fully_shard
    >>> from torch.nn.parallel import DistributedDataParallel
    >>> import smptk.comm as comm
    >>> from smptk.comm.adapters import SmptkAllGather, SmptkHookState, SmptkReduceScatter, ddp_comm_hook
    >>> dist.init_process_group("gloo")
    >>> ddp = DistributedDataParallel(nn.Linear(8, 4))
    >>> ddp.register_comm_hook(SmptkHookState(group=ddp.process_group, max_sms=8), ddp_comm_hook)
    >>> ddp(torch.full((3, 8), float(dist.get_rank()))).sum().backward()
    >>> comm.last_path(), ddp.module.weight.grad.unique()   # averaged: (3 * 0 + 3 * 1) / 2
    ('symmetric', tensor([1.5000]))
    >>> block = fully_shard(nn.Sequential(nn.Linear(8, 8)))
    >>> block.set_custom_all_gather(SmptkAllGather())
    >>> block.set_custom_reduce_scatter(SmptkReduceScatter())
    >>> block(torch.ones(3, 8)).sum().backward()
    >>> comm.last_path(), block[0].bias.grad.full_tensor().unique()   # FSDP2 averages too
    ('symmetric', tensor([3.]))
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the hook's annotations
# with dist.GradBucket and Future[Tensor] as objects, and strings would not match.
from collections.abc import Sequence

import torch
import torch.distributed as dist

from smptk.comm.collectives import _max_sms, all_gather_into_tensor, all_reduce, reduce_scatter_tensor

try:  # FSDP2's comm interfaces (torch >= 2.8); without them the FSDP2 objects refuse to be made
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGatherBase
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - older torch
    _AllGatherBase = _ReduceScatterBase = object


def _check_max_sms(max_sms: object, *, copy_engine: bool = False) -> int | None:
    """``max_sms`` checked now, as the collectives will check it (None: smptk.comm's setting at each call;
    0 only where it names the copy-engine path), not at the first backward inside DDP or FSDP."""
    if max_sms is None or (copy_engine and max_sms == 0 and not isinstance(max_sms, bool)):
        return max_sms
    return _max_sms(max_sms)


class SmptkHookState:
    """State of :func:`ddp_comm_hook`: the process group, the SM budget and (CUDA) the side stream.

    Args:
        group: process group to all-reduce over: DDP's ``process_group``. None is the default (world)
            group, as for torch's own hooks: a hook cannot see DDP's group, so a DDP built on a subgroup
            needs ``SmptkHookState(group=ddp.process_group)`` (with None it would average over every rank).
        max_sms: programs per all-reduce, 1..256 (default: smptk.comm's setting).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, max_sms: int | None = None):
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group: expected a ProcessGroup or None, got {type(group).__name__}")
        self.group = group
        self.max_sms = _check_max_sms(max_sms)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]


def ddp_comm_hook(
    state: SmptkHookState | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket's flattened gradients over the group with smptk.comm.

    Register with ``ddp.register_comm_hook(SmptkHookState(group=ddp.process_group), ddp_comm_hook)``. A
    bucket of sparse gradients (``nn.Embedding(sparse=True)``) goes to torch's own all-reduce hook.
    """
    state = state if state is not None else SmptkHookState()
    tensor = bucket.buffer()
    if tensor.layout != torch.strided:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(state.group, bucket)
    if not tensor.is_cuda:
        all_reduce(tensor, op="avg", group=state.group, max_sms=state.max_sms)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(tensor)
        return fut
    stream = state.stream(tensor.device)
    stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the bucket's gradients are written
    tensor.record_stream(stream)
    fut = torch.futures.Future(devices=[tensor.device])
    with torch.cuda.stream(stream):
        all_reduce(tensor, op="avg", group=state.group, max_sms=state.max_sms)
        fut.set_result(tensor)  # the future's event is recorded on `stream`
    return fut


def _op_name(op: object) -> str | None:
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "avg"
    return None  # e.g. NCCL's pre-multiplied sum: left to torch.distributed


class _SmptkComm:
    """What both FSDP2 comm objects share: the SM budget and plain caching-allocator buffers."""

    _copy_engine = False  # whether max_sms=0 names a path (the all-gather's copy engine)

    def __init__(self, max_sms: int | None = None):
        if _AllGatherBase is object:
            raise RuntimeError(
                f"{type(self).__name__}: torch {torch.__version__} has no FSDP2 custom comm API "
                "(set_custom_all_gather / set_custom_reduce_scatter, torch >= 2.8)"
            )
        self.max_sms = _check_max_sms(max_sms, copy_engine=self._copy_engine)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class SmptkAllGather(_SmptkComm, _AllGatherBase):
    """FSDP2 all-gather through :func:`smptk.comm.all_gather_into_tensor` (``set_custom_all_gather``).

    ``max_sms=0`` takes the copy-engine algorithm: no SM moves the parameters (two one-program signal
    kernels order the copies), so the all-gather does not take SMs from the compute it overlaps.
    """

    _copy_engine = True

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if self.max_sms == 0:
            all_gather_into_tensor(output_tensor, input_tensor, group, algorithm="copy_engine")
        else:
            all_gather_into_tensor(output_tensor, input_tensor, group, max_sms=self.max_sms)
        return None  # done in stream order on FSDP's all-gather stream: nothing to wait on


class SmptkReduceScatter(_SmptkComm, _ReduceScatterBase):
    """FSDP2 reduce-scatter through :func:`smptk.comm.reduce_scatter_tensor` (``set_custom_reduce_scatter``).

    Sum and average run on smptk; any other op FSDP asks for (NCCL's pre-multiplied sum) goes to
    torch.distributed unchanged.
    """

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        name = _op_name(op)
        if name is None:
            return dist.reduce_scatter_tensor(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
        reduce_scatter_tensor(output_tensor, input_tensor, name, group, max_sms=self.max_sms)
        return None
