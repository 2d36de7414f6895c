"""Symmetric heap: one buffer per rank of a process group, mapped by every rank, plus signal pads.

Every rank of the group owns a segment with the same layout; every rank can load and store every peer's
segment through a table of addresses, which is how the collective kernels in
:mod:`smptk.kernels.collectives` move data without a copy engine or a proxy thread.

Segment layout: :mod:`smptk.kernels.heap_layout` (signal pad, control words with the abort flag, data
region), identical on every rank.

Backends:

- ``"cuda"``: ``torch.distributed._symmetric_memory`` (``empty`` + ``rendezvous``). The peer addresses are
  device pointers usable from any rank's kernels on one node (NVLink / PCIe P2P).
- ``"cpu"``: POSIX shared memory. Each rank creates a segment in /dev/shm with mode 0600 under an
  unguessable name (``smptk-`` + 128 random bits), publishes the name through ``all_gather_object`` on the
  group, maps every peer's segment, and **unlinks its own name as soon as every rank has mapped it**
  (a barrier later). From then on no name exists in /dev/shm at all: the memory lives exactly as long as
  some process maps it, so nothing is left behind by a crash, a killed peer or a failing test. The same
  Triton kernels run on these addresses under ``TRITON_INTERPRET=1``.

Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

    >>> import torch
    >>> import torch.distributed as dist
    >>> from smptk.comm.heap import SymmetricHeap
    >>> dist.init_process_group("gloo")
    >>> heap = SymmetricHeap.create(dist.group.WORLD, heap_bytes=1 << 20, backend="cpu")
    >>> heap.data_ptrs.dtype, heap.data_ptrs.shape    # the address of each rank's data region
    (torch.int64, torch.Size([2]))
    >>> _ = heap.data(torch.float32, 2).fill_(dist.get_rank())   # this rank's own region
    >>> dist.barrier()
    >>> [heap.peer_data(q, torch.float32, 2).tolist() for q in range(2)]   # every rank reads both
    [[0.0, 0.0], [1.0, 1.0]]
    >>> dist.barrier()
    >>> heap.close()
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from smptk.kernels.heap_layout import ABORT_OFFSET, DATA_OFFSET, MAX_WORLD

_ALIGN = 4096  # a segment is whole 4 KiB pages (DATA_OFFSET is a multiple of it; the data region rounds up)


def segment_bytes(heap_bytes: int) -> int:
    """Bytes one rank allocates for a heap whose data region is ``heap_bytes``: the signal pad and control
    words (``DATA_OFFSET``) and the data region, rounded up to a multiple of 4096."""
    return -(-(DATA_OFFSET + heap_bytes) // _ALIGN) * _ALIGN


class HeapUnavailable(RuntimeError):
    """No symmetric heap can serve this group here (the caller falls back to torch.distributed)."""


class HeapBuildError(RuntimeError):
    """The ranks could not build the heap together: ``ranks`` (group ranks) asked for another size
    (``mismatch``) or could not allocate their segment. Raised on every rank, with the same ranks."""

    def __init__(self, message: str, ranks: list[int], mismatch: bool):
        super().__init__(message)
        self.ranks, self.mismatch = ranks, mismatch


def _agree(group: dist.ProcessGroup, heap_bytes: int, payload, error: str | None) -> list:
    """Exchange ``(host, heap_bytes, payload, error)`` over ``group`` and check them; the payloads in rank
    order. Every rank raises the same HeapBuildError when some rank's ``heap_bytes`` differs from rank 0's
    or some rank failed to allocate (``error``), and HeapUnavailable when the ranks span several hosts."""
    rows: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(rows, (socket.gethostname(), heap_bytes, payload, error), group=group)
    sizes = [row[1] for row in rows]
    odd = [q for q, n in enumerate(sizes) if n != sizes[0]]
    if odd:
        raise HeapBuildError(
            f"symmetric heap sizes differ between ranks (heap_bytes by group rank: {sizes}): every rank "
            "must use the same smptk.comm.configure(heap_bytes=...) / SMPTK_COMM_HEAP_BYTES",
            odd,
            mismatch=True,
        )
    failed = {q: row[3] for q, row in enumerate(rows) if row[3] is not None}
    if failed:
        detail = "; ".join(f"rank {q}: {why}" for q, why in failed.items())
        raise HeapBuildError(
            f"could not allocate the {heap_bytes}-byte symmetric heap ({detail}): lower heap_bytes "
            "(smptk.comm.configure / SMPTK_COMM_HEAP_BYTES) or free memory",
            list(failed),
            mismatch=False,
        )
    if len({row[0] for row in rows}) != 1:
        raise HeapUnavailable("the heap needs every rank of the group on one machine")
    return [row[2] for row in rows]


@dataclass
class SymmetricHeap:
    """A group's symmetric heap on this rank; see the module docstring for the layout.

    Attributes:
        backend: "cpu" or "cuda".
        rank, world_size: this process's rank in the group and the group's size.
        heap_bytes: size of each rank's data region.
        data_ptrs, signal_ptrs: int64 ``[world]`` tensors (on the kernels' device) with the address of
            every rank's data region and signal pad.
        local: uint8 tensor over this rank's whole segment (signal pad, control words, data).
        status: int32 ``[2 * world]`` on the kernels' device; kernels set ``status[q] = 1`` when rank q
            never arrived at a barrier in time and ``status[world + q] = 1`` when rank q's call had
            other arguments than this rank's.
        broken: a reason string once a collective failed mid-flight (signal pads are then inconsistent).
        calls: kernel launches on this heap so far; every rank counts the same calls, so the count is
            the sequence number that the kernels compare across ranks (see ``smptk.comm.collectives``).
        segments: uint8 tensors over every rank's whole segment as this rank maps it (``segments[rank]``
            is ``local``): what the copy-engine collectives copy from with plain tensor copies.
    """

    backend: str
    rank: int
    world_size: int
    heap_bytes: int
    data_ptrs: torch.Tensor
    signal_ptrs: torch.Tensor
    local: torch.Tensor
    status: torch.Tensor
    device: torch.device
    broken: str | None = None
    calls: int = 0  # symmetric launches so far: the sequence number in each call's announcement
    last_use: object = None  # CUDA: an event recorded after the latest launch on this heap (any stream)
    segments: list[torch.Tensor] = field(default_factory=list, repr=False)
    _keepalive: list = field(default_factory=list, repr=False)

    @staticmethod
    def create(group: dist.ProcessGroup, heap_bytes: int, backend: str) -> SymmetricHeap:
        """Collective over ``group``: every rank must call it with the same ``heap_bytes`` and backend."""
        if heap_bytes <= 0 or heap_bytes % 16:
            raise ValueError(f"heap_bytes: expected a positive multiple of 16, got {heap_bytes}")
        world = dist.get_world_size(group)
        if world > MAX_WORLD:
            raise HeapUnavailable(f"group of {world} ranks exceeds the heap's MAX_WORLD={MAX_WORLD}")
        if backend == "cpu":
            return _create_cpu(group, heap_bytes)
        if backend == "cuda":
            return _create_cuda(group, heap_bytes)
        raise ValueError(f"backend: expected 'cpu' or 'cuda', got {backend!r}")

    @property
    def abort_flag(self) -> torch.Tensor:
        """int32 view of this rank's abort word (set by the host watchdog under the interpreter)."""
        return self.local[ABORT_OFFSET : ABORT_OFFSET + 4].view(torch.int32)

    def data(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """This rank's data region as a ``dtype`` tensor of ``numel`` elements."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.local[DATA_OFFSET : DATA_OFFSET + nbytes].view(dtype)

    def peer_data(self, rank: int, dtype: torch.dtype, numel: int, offset: int = 0) -> torch.Tensor:
        """Elements ``[offset, offset + numel)`` of rank ``rank``'s data region as a ``dtype`` tensor.

        A view of the peer's memory (shared memory on CPU, a peer mapping on CUDA): copying into or out of
        it moves data between ranks without a kernel of ours (the copy engines on CUDA).
        """
        size = torch.empty((), dtype=dtype).element_size()
        start = DATA_OFFSET + offset * size
        if offset < 0 or numel < 0 or (offset + numel) * size > self.heap_bytes:
            raise ValueError(
                f"peer_data: elements [{offset}, {offset + numel}) of {dtype} exceed the "
                f"{self.heap_bytes}-byte data region"
            )
        return self.segments[rank][start : start + numel * size].view(dtype)

    def close(self) -> None:
        """Drop this rank's mappings (the memory goes when the last rank drops its own)."""
        self._keepalive.clear()
        self.segments = []
        self.broken = self.broken or "closed"


def same_host(group: dist.ProcessGroup) -> bool:
    """True when every rank of ``group`` runs on this machine (collective over the group)."""
    names: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return len(set(names)) == 1


def _create_cpu(group: dist.ProcessGroup, heap_bytes: int) -> SymmetricHeap:
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    size = segment_bytes(heap_bytes)
    name = f"/dev/shm/smptk-{secrets.token_hex(16)}"
    own, error = None, None
    try:
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as e:
        fd, error = None, f"cannot create a segment in /dev/shm: {e}"
    try:
        if fd is not None:
            try:
                # Reserve the pages now: a sparse file accepts any size, and the first touch of a page that
                # /dev/shm cannot hold kills the process with SIGBUS, no exception, in the middle of a call.
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without it: sparse
                        raise
                    os.ftruncate(fd, size)
                own = mmap.mmap(fd, size)
            except OSError as e:
                free = os.statvfs("/dev/shm")
                error = (
                    f"{size} bytes in /dev/shm ({free.f_bavail * free.f_frsize} free) failed: {e}"
                    if e.errno == errno.ENOSPC
                    else f"mapping {size} bytes failed: {e}"
                )
            finally:
                os.close(fd)
        names = _agree(group, heap_bytes, name, error)
        maps, error = [], None
        for peer, peer_name in enumerate(names):
            if peer == rank:
                maps.append(own)
                continue
            try:
                pfd = os.open(peer_name, os.O_RDWR)
                try:
                    maps.append(mmap.mmap(pfd, size))
                finally:
                    os.close(pfd)
            except OSError as e:
                error = f"mapping rank {peer}'s {size}-byte segment failed: {e}"
                break
        _agree(group, heap_bytes, None, error)  # every rank has mapped every segment: the names can go
    finally:
        if fd is not None:
            os.unlink(name)
    views = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    addrs = [v.data_ptr() for v in views]
    local = views[rank]
    local[:DATA_OFFSET].zero_()
    dist.barrier(group=group)  # signal pads are zero everywhere before any kernel runs
    return SymmetricHeap(
        backend="cpu",
        rank=rank,
        world_size=world,
        heap_bytes=heap_bytes,
        data_ptrs=torch.tensor([a + DATA_OFFSET for a in addrs], dtype=torch.int64),
        signal_ptrs=torch.tensor(addrs, dtype=torch.int64),
        local=local,
        status=torch.zeros(2 * world, dtype=torch.int32),
        device=torch.device("cpu"),
        segments=views,
        _keepalive=[maps, views],
    )


def _create_cuda(group: dist.ProcessGroup, heap_bytes: int) -> SymmetricHeap:
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError as e:  # pragma: no cover - every supported torch has it
        raise HeapUnavailable(f"torch.distributed._symmetric_memory unavailable: {e}") from e
    if not torch.cuda.is_available():
        raise HeapUnavailable("the cuda heap needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    size = segment_bytes(heap_bytes)
    local, error = None, None
    try:
        local = symm_mem.empty(size, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError as e:
        error = f"{size} bytes of symmetric memory on {device}: {e}".splitlines()[0]
    _agree(group, heap_bytes, None, error)  # also: every rank on one node, or HeapUnavailable
    local[:DATA_OFFSET].zero_()
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(group.group_name):
        # deprecated in torch 2.11 / 2.13 (a FutureWarning) but still what registers the group's store for
        # symmetric memory there; whether rendezvous works without it is not checked on a GPU yet
        enable(group.group_name)
    handle = symm_mem.rendezvous(local, group.group_name)
    torch.cuda.synchronize(device)
    handle.barrier()  # every rank's signal pad is zero before any kernel signals it
    ptrs = [int(p) for p in handle.buffer_ptrs]
    segments = [
        local if q == handle.rank else handle.get_buffer(q, (size,), torch.uint8)
        for q in range(handle.world_size)
    ]
    return SymmetricHeap(
        backend="cuda",
        rank=handle.rank,
        world_size=handle.world_size,
        heap_bytes=heap_bytes,
        data_ptrs=torch.tensor([p + DATA_OFFSET for p in ptrs], dtype=torch.int64, device=device),
        signal_ptrs=torch.tensor(ptrs, dtype=torch.int64, device=device),
        local=local,
        status=torch.zeros(2 * handle.world_size, dtype=torch.int32, device=device),
        device=device,
        segments=segments,
        _keepalive=[handle],
    )
