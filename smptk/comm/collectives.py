"""The collectives: torch.distributed's call shapes, run by the symmetric-heap kernels with an SM budget.

Each call takes the symmetric path when the group has a heap here (every rank on one machine, a CUDA
tensor with torch symmetric memory, or a CPU tensor under ``TRITON_INTERPRET=1``) and the dtype and op
are ones the kernels have (fp32 / bf16 / fp16 / int32; sum, avg, max, min, avg not for int32); it falls
back to torch.distributed otherwise, and :func:`last_path` says which ran. Messages larger than the heap
are cut into heap-sized chunks, so any size works. Every kernel launch goes through one path (the
``_launch_*`` function of its kernel, then :func:`_launch`), which :mod:`smptk.comm.simulated` runs too.

Settings (:func:`configure`, or the environment before the first call): ``max_sms`` (SMPTK_COMM_MAX_SMS,
default 8) programs per collective, ``timeout_s`` (SMPTK_COMM_TIMEOUT_S, default 300) the budget of one
kernel launch (one chunk of at most ``heap_bytes``), counted from its start: a launch still waiting on a
peer then gives up, so set it well above the slowest launch (under the interpreter, seconds for a few
thousand elements on a loaded machine), ``heap_bytes`` (SMPTK_COMM_HEAP_BYTES, default 64 MiB) per rank.
Every rank of a group must use the same settings and make the same sequence of calls, as with any
collective library. The variables are read through :mod:`smptk.settings`, once per process (on first use).

Under ``torch.compile`` each of the four collectives is a graph break and runs as it does eagerly
(:func:`smptk.kernels._dispatch.outside_graphs`): Dynamo cannot trace a kernel launch on the heap.

Example (under ``TRITON_INTERPRET=1 torchrun --nproc-per-node 2``, every rank; gloo on CPU; on a GPU
node, CUDA tensors and NCCL)::

    >>> import torch
    >>> import torch.distributed as dist
    >>> import smptk.comm as comm
    >>> dist.init_process_group("gloo")
    >>> t = torch.ones(1000)
    >>> comm.all_reduce(t, max_sms=4)[:3]        # in place, like dist.all_reduce; returns t
    tensor([2., 2., 2.])
    >>> comm.last_path()                         # without TRITON_INTERPRET=1: 'torch.distributed:gloo'
    'symmetric'
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import numbers
import threading
import weakref
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import smptk.settings as env_settings
from smptk.comm.heap import HeapBuildError, HeapUnavailable, SymmetricHeap
from smptk.kernels import runtime
from smptk.kernels._dispatch import outside_graphs
from smptk.kernels._triton import ensure_allocator, kernel_module
from smptk.kernels.heap_layout import CALL_OFFSET, MAX_PROGRAMS, OPS, SEEN_OFFSET, SEQ_SHIFT

K = kernel_module("smptk.kernels.collectives")  # imported (with triton) on first use: smptk.kernels._triton

_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32)
ALGORITHMS = ("auto", "one_shot", "two_shot")
# all_gather_into_tensor / all_to_all_single: "kernel" moves the data with max_sms programs of ours;
# "copy_engine" with stream-ordered tensor copies of the peers' heap regions (the GPU's copy engines on
# CUDA: no SM moves data) between two one-program signal kernels. "auto" is "kernel".
COPY_ALGORITHMS = ("auto", "kernel", "copy_engine")
COPY_PATHS = env_settings.COMM_COPY_PATHS  # how the kernels' copies load (configure(copy_path=...))
# all_reduce "auto": one-shot (each rank reads all W buffers: lowest latency) up to this size, two-shot
# (reduce-scatter + all-gather: each rank reads ~2 buffers' worth) above. Untuned; no GPU run yet.
ONE_SHOT_MAX_BYTES = 256 * 1024


class CommError(RuntimeError):
    """A collective could not run (broken heap, inconsistent arguments across ranks).

    The base of :class:`CommTimeoutError` and :class:`CommMismatchError`, which the symmetric path raises
    (the torch.distributed fallback raises torch's own errors, but for all_to_all_single's split check,
    which runs on every path); catch it for either.

    Example (under ``TRITON_INTERPRET=1 torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> import smptk.comm as comm
        >>> dist.init_process_group("gloo")
        >>> try:
        ...     comm.all_reduce(torch.ones(4 + 4 * dist.get_rank()))   # rank 0: 4 elements, rank 1: 8
        ... except comm.CommError as e:
        ...     print(type(e).__name__)
        CommMismatchError
        >>> comm.reset()                    # the heap is marked broken: the next call builds a new one
    """


class CommTimeoutError(CommError):
    """A peer did not arrive at a barrier within ``timeout_s``; ``missing_ranks`` names it (group ranks).

    Raised by the symmetric path of a collective (on CPU as the call returns; on CUDA by :func:`check`,
    or at the call's end with SMPTK_COMM_SYNC_CHECK=1). The heap is then marked broken (:func:`reset`).

    Example (under ``TRITON_INTERPRET=1 torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> import smptk.comm as comm
        >>> dist.init_process_group("gloo")
        >>> comm.configure(timeout_s=2)
        >>> comm.all_reduce(torch.ones(4))            # both ranks: the heap is built
        tensor([2., 2., 2., 2.])
        >>> missing = [1]
        >>> if dist.get_rank() == 0:                  # rank 1 makes no second call
        ...     try:
        ...         comm.all_reduce(torch.ones(4))
        ...     except comm.CommTimeoutError as e:
        ...         missing = e.missing_ranks
        >>> missing                                   # rank 0 waited 2 s for group rank 1
        [1]
        >>> dist.barrier()
        >>> comm.reset()
        >>> comm.configure(timeout_s=300)
    """

    def __init__(self, message: str, missing_ranks: list[int]):
        super().__init__(message)
        self.missing_ranks = missing_ranks


class CommMismatchError(CommError):
    """Ranks made different calls (collective, dtype, size, op, algorithm or max_sms, or calls out of
    step with each other); ``ranks`` names the group ranks whose call differed from this rank's.

    Raised by the symmetric path on every rank of the call, which marks the heap broken (:func:`reset`),
    and by :func:`all_to_all_single` when the ranks' split sizes disagree: that is found before any data
    moves, and the group stays usable without a reset.

    Example (under ``TRITON_INTERPRET=1 torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> import smptk.comm as comm
        >>> dist.init_process_group("gloo")
        >>> rank = dist.get_rank()
        >>> try:
        ...     comm.all_reduce(torch.ones(4), op="max" if rank == 0 else "min")
        ... except comm.CommMismatchError as e:
        ...     print(e.ranks == [1 - rank])     # the other rank
        True
        >>> comm.reset()
    """

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


@dataclasses.dataclass
class _Settings:
    max_sms: int
    timeout_s: float
    heap_bytes: int
    copy_path: str = "pointer"


_settings: _Settings | None = None
# Per group, per backend ("cpu"/"cuda"): the heap, or None where none can be built. Keyed weakly by the
# group object: a destroyed group's heap goes with it, and a new group never finds a stale heap (an
# id() key could be reused by a later group; a group name is reused after destroy_process_group()).
_heaps: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, SymmetricHeap | None]] = (
    weakref.WeakKeyDictionary()
)
# ... but torch can keep a destroyed group object alive (DTensor's caches hold the groups of the meshes it
# ran on): _release_destroyed() closes the heaps of groups torch.distributed no longer knows.
_last_path: str | None = None
_last_compiled: dict[str, object] = {}  # kernel name -> what Triton compiled for its last launch (GPU only)


# Each setting's SMPTK_COMM_* accessor (smptk.settings parses the variable and its range).
_FROM_ENV = {
    "max_sms": env_settings.comm_max_sms,
    "timeout_s": env_settings.comm_timeout_s,
    "heap_bytes": env_settings.comm_heap_bytes,
    "copy_path": env_settings.comm_copy_path,
}


def _from_env(given: dict[str, object]) -> _Settings:
    """The settings of the SMPTK_COMM_* variables, but where ``given`` has a value (not None): a variable
    that is replaced is not read, so :func:`configure` can override a bad one."""
    values = {}
    for field, read in _FROM_ENV.items():
        values[field] = given[field] if given.get(field) is not None else read()
    new = _Settings(**values)
    try:
        _validate(new)
    except ValueError as e:
        field = str(e).split(":")[0]
        if given.get(field) is None:  # the variable's value (smptk.settings checks most of it already)
            raise ValueError(f"SMPTK_COMM_{field.upper()}: {e}") from None
        raise
    return new


def _current() -> _Settings:
    global _settings
    if _settings is None:
        _settings = _from_env({})
    return _settings


_MAX_TIMEOUT_S = 1e6  # the kernels take the budget in int64 nanoseconds; ~11.6 days is plenty


def _validate(s: _Settings) -> None:
    if not 1 <= s.max_sms <= MAX_PROGRAMS:
        raise ValueError(f"max_sms: expected 1..{MAX_PROGRAMS}, got {s.max_sms}")
    if not 0 < s.timeout_s <= _MAX_TIMEOUT_S:  # also rejects nan and inf
        raise ValueError(f"timeout_s: expected seconds in (0, {_MAX_TIMEOUT_S:g}], got {s.timeout_s}")
    check_heap_bytes(s.heap_bytes)
    if s.copy_path not in COPY_PATHS:
        raise ValueError(f"copy_path: expected one of {COPY_PATHS}, got {s.copy_path!r}")


def check_heap_bytes(heap_bytes: object) -> int:
    """``heap_bytes`` as an int if a symmetric heap's data region may have that size (:func:`configure`'s
    rule, and the memory planner's): an integer that is a multiple of 16, so the collectives' chunk
    boundaries stay 16-byte aligned, and at least 4096; ValueError naming ``heap_bytes`` otherwise."""
    n = _as_int("heap_bytes", heap_bytes)
    if n < 4096 or n % 16:
        raise ValueError(f"heap_bytes: expected a multiple of 16 of at least 4096, got {n}")
    return n


def configure(
    *,
    max_sms: int | None = None,
    timeout_s: float | None = None,
    heap_bytes: int | None = None,
    copy_path: str | None = None,
) -> None:
    """Set the defaults of every later call on this rank (call it identically on every rank).

    Each value given replaces its ``SMPTK_COMM_*`` variable (read once, on first use); before that first
    use a replaced variable is not read at all, so a bad value in it does not matter. Values are read as
    the variables are: integral floats and numpy scalars for the counts, ``copy_path`` in any case.

    Changing ``heap_bytes`` drops this rank's heaps; the next collective on a group builds a new one
    (a collective step, so every rank must change it at the same point). ``copy_path`` (one of
    :data:`COPY_PATHS`): how the kernels' copies load, "pointer" (default) or "tma" (TMA descriptors,
    pipelined; see ``smptk.kernels.collectives``). It changes no result and no tile's owner, so ranks
    may differ in it.

    Example (one process; no process group needed)::

        >>> import smptk.comm as comm
        >>> before = comm.settings()
        >>> comm.configure(max_sms=4, timeout_s=30)
        >>> comm.settings()["max_sms"], comm.settings()["timeout_s"]
        (4, 30.0)
        >>> comm.configure(max_sms=before["max_sms"], timeout_s=before["timeout_s"])
    """
    global _settings
    if copy_path is not None and not isinstance(copy_path, str):
        raise ValueError(f"copy_path: expected one of {COPY_PATHS}, got {copy_path!r}")
    given = {
        "max_sms": None if max_sms is None else _as_int("max_sms", max_sms),
        "timeout_s": None if timeout_s is None else _as_number("timeout_s", timeout_s),
        "heap_bytes": None if heap_bytes is None else _as_int("heap_bytes", heap_bytes),
        "copy_path": None if copy_path is None else copy_path.strip().lower(),  # as the variable reads
    }
    if _settings is None:  # first use: the variables a value here replaces are not read
        _settings = _from_env(given)
        return
    new = _Settings(**{f: getattr(_settings, f) if v is None else v for f, v in given.items()})
    _validate(new)
    if new.heap_bytes != _settings.heap_bytes:
        reset()
    _settings.max_sms, _settings.timeout_s, _settings.heap_bytes = new.max_sms, new.timeout_s, new.heap_bytes
    _settings.copy_path = new.copy_path


def settings() -> dict[str, float | str]:
    """The settings in force: ``{"max_sms", "timeout_s", "heap_bytes", "copy_path"}``.

    Example (one process, no SMPTK_COMM_* variable set: the defaults)::

        >>> import smptk.comm as comm
        >>> comm.settings()
        {'max_sms': 8, 'timeout_s': 300.0, 'heap_bytes': 67108864, 'copy_path': 'pointer'}
    """
    return dataclasses.asdict(_current())


def last_path() -> str | None:
    """Which path the last collective on this rank took: "symmetric" (the heap's kernels), "copy_engine"
    (``algorithm="copy_engine"``: tensor copies of the peers' heap regions) or "torch.distributed:<backend>"
    (the fallback); None before the first call."""
    return _last_path


def last_compiled(kernel: str) -> object | None:
    """What Triton compiled for the last launch of collective kernel ``kernel`` (e.g. "_all_gather_kernel")
    in this process: its ``CompiledKernel`` (``.asm["ptx"]``, ``.n_regs``, ``.n_spills``), or None before
    a launch and under the interpreter, which compiles nothing. The benchmarks read their PTX columns
    from it (:func:`smptk.kernels._codegen.compiled_facts`)."""
    return _last_compiled.get(kernel)


def reset(group: dist.ProcessGroup | None = None) -> None:
    """Forget this rank's heap for ``group`` (all groups when None), e.g. after a CommTimeoutError.

    The next symmetric call on the group builds a new heap, collectively.
    """
    groups = list(_heaps.keys()) if group is None else [group]
    for g in groups:
        for heap in (_heaps.pop(g, None) or {}).values():
            if heap is not None:
                heap.close()


def _registered(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is a live group of this process (not destroyed by destroy_process_group)."""
    if not dist.is_initialized():
        return False
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


def _release_destroyed() -> None:
    """Close the heaps of groups that were destroyed while something kept their objects alive."""
    for group in [g for g in list(_heaps.keys()) if not _registered(g)]:
        reset(group)


def heaps() -> list[dict]:
    """This process's live symmetric heaps, one dict per group and device type: ``ranks`` (the group's
    global ranks), ``rank`` (this process's rank in it), ``world_size``, ``backend`` ("cpu" / "cuda"),
    ``heap_bytes`` (the data region), ``segment_bytes`` (what this rank allocates: signal pad, control
    words and data region, in whole 4 KiB pages), ``calls`` (symmetric launches so far) and ``broken``
    (None or why).

    A group holds a heap only after its first symmetric call; each is bounded by ``heap_bytes`` (see
    :func:`configure`) plus ``DATA_OFFSET`` bytes of signals, rounded up to 4 KiB
    (:func:`smptk.comm.heap.segment_bytes`), so a process holds at most one segment
    per group and device type it calls collectives on. ``smptk info`` lists them when run in the process
    (:func:`smptk._env.collect_environment`); :meth:`smptk.parallel.ParallelState.symmetric_heaps`
    keeps the ones of a parallel state's groups.

    Example (under ``TRITON_INTERPRET=1 torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> import smptk.comm as comm
        >>> dist.init_process_group("gloo")
        >>> comm.heaps()
        []
        >>> comm.all_reduce(torch.ones(4))         # the world group's first symmetric call builds its heap
        tensor([2., 2., 2., 2.])
        >>> [(h["ranks"], h["backend"], h["heap_bytes"]) for h in comm.heaps()]
        [((0, 1), 'cpu', 67108864)]
    """
    _release_destroyed()
    out = []
    for group, per_backend in list(_heaps.items()):
        for backend, heap in per_backend.items():
            if heap is None:
                continue
            out.append(
                {
                    "ranks": tuple(dist.get_process_group_ranks(group)),
                    "rank": heap.rank,
                    "world_size": heap.world_size,
                    "backend": backend,
                    "heap_bytes": heap.heap_bytes,
                    "segment_bytes": heap.local.numel(),
                    "calls": heap.calls,
                    "broken": heap.broken,
                }
            )
    return out


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise RuntimeError("smptk.comm needs torch.distributed to be initialized (init_process_group)")
    if group is None:
        return dist.distributed_c10d._get_default_group()
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what dist.new_group returns on ranks outside it
        raise ValueError("group: this rank is not a member of the given process group")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}"
        )
    if dist.get_rank(group) < 0:
        raise ValueError("group: this rank is not a member of the given process group")
    return group


def _named_group(group_name: str) -> dist.ProcessGroup:
    """The ProcessGroup called ``group_name`` (``ProcessGroup.group_name``): how the dispatcher ops of
    :mod:`smptk.kernels._dispatch`, whose arguments must be strings and numbers, name their group."""
    return dist.distributed_c10d._resolve_process_group(group_name)


def _heap(group: dist.ProcessGroup, tensor: torch.Tensor) -> SymmetricHeap | None:
    """The group's heap for ``tensor``'s device type, building it on first use; None when none applies."""
    if tensor.device.type == "cuda" and not runtime.interpreter_enabled():
        backend = "cuda"
    elif tensor.device.type == "cpu" and runtime.interpreter_enabled():
        backend = "cpu"
    else:
        return None
    if not runtime.triton_available():
        return None
    if backend == "cpu":  # the kernels' error where they cannot be interpreted, not one deep inside Triton
        runtime._check_interpreter_unchanged()
    per_group = _heaps.get(group)
    if per_group is None:  # a group's first heap: a moment to drop those of destroyed groups
        _release_destroyed()
        per_group = _heaps.setdefault(group, {})
    if backend not in per_group:
        _all_arrive(group, _current().timeout_s)
        try:
            per_group[backend] = SymmetricHeap.create(group, _current().heap_bytes, backend)
        except HeapUnavailable:
            per_group[backend] = None
        except HeapBuildError as e:  # every rank raises it, naming the same ranks
            rank = dist.get_rank(group)
            if e.mismatch:
                raise CommMismatchError(f"rank {rank}: {e}", e.ranks) from None
            raise CommError(f"rank {rank}: {e}") from None
    return per_group[backend]


# Group name -> heap builds started on it (the same count on every rank). Kept after the group is destroyed:
# torch reuses a destroyed group's name, and the store still holds the old builds' keys, so a new group of
# that name must count on from them (one int per name).
_arrivals: dict[str, int] = {}


def _all_arrive(group: dist.ProcessGroup, timeout_s: float) -> None:
    """Wait, at most ``timeout_s``, until every rank of ``group`` has come to build the group's heap.

    Building it takes plain torch.distributed calls, bounded only by the process group's own timeout
    (30 min on gloo): so each rank first posts its arrival in the job's store and waits for the others'.
    A rank that does not come makes the others raise CommTimeoutError naming it, as a kernel's barrier does;
    a rank that comes after the others gave up raises too, naming them (no one-sided success).
    """
    build = _arrivals[group.group_name] = _arrivals.get(group.group_name, 0) + 1
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    key = f"smptk/heap/{group.group_name}/{build}"
    arrived = [f"{key}/arrived/{q}" for q in range(world)]
    gave_up = [f"{key}/gave_up/{q}" for q in range(world)]
    store.set(arrived[rank], "1")
    try:
        store.wait(arrived, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:  # the store's timeout, or the store itself gone
        try:
            missing = [q for q in range(world) if not store.check([arrived[q]])]
        except RuntimeError:
            raise CommError(
                f"rank {rank}: the job's store (torch.distributed's rendezvous, hosted by the launcher or "
                f"global rank 0) stopped answering while waiting to build the group's symmetric heap: {e}"
            ) from None
        if missing:
            store.set(gave_up[rank], "1")
            raise CommTimeoutError(
                f"rank {rank}: group rank(s) {missing} did not come to build the group's symmetric heap "
                f"(its first collective) within {timeout_s:g} s (timeout_s)",
                missing,
            ) from None
    left = [q for q in range(world) if store.check([gave_up[q]])]
    if left:
        raise CommTimeoutError(
            f"rank {rank}: came to build the group's symmetric heap (its first collective) after group "
            f"rank(s) {left} stopped waiting for it (timeout_s={timeout_s:g} s)",
            left,
        )


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if is_traceable_wrapper_subclass(t):  # a DTensor's data pointer raised "invalid python storage"
        raise TypeError(
            f"{name}: expected a tensor with storage of its own, got a {type(t).__name__} (a wrapper "
            "subclass: pass its local tensor, e.g. DTensor.to_local())"
        )
    if t.layout != torch.strided:
        raise TypeError(
            f"{name}: expected a dense tensor, got layout {t.layout} (sparse tensors: use "
            "torch.distributed's collectives)"
        )
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")
    return t


def _check_pair(out_name: str, out: torch.Tensor, in_name: str, inp: torch.Tensor) -> None:
    if out.dtype != inp.dtype:
        raise TypeError(f"{out_name}: dtype {out.dtype} does not match {in_name}'s {inp.dtype}")
    if out.device != inp.device:
        raise ValueError(f"{out_name}: on {out.device} but {in_name} is on {inp.device}")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the contiguous tensors ``a`` and ``b`` share a byte of memory (on one device)."""
    if a.numel() == 0 or b.numel() == 0 or a.device.type == "meta":
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _is_block(part: torch.Tensor, whole: torch.Tensor, index: int) -> bool:
    """Whether ``part`` is block ``index`` of ``whole`` (contiguous; blocks of ``part.numel()`` elements)."""
    return part.data_ptr() == whole.data_ptr() + index * part.numel() * part.element_size()


def _apart(input: torch.Tensor, output: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """``input``, or a copy of it where it shares memory with ``output``, so that no write to ``output``
    lands on input that a rank has yet to read.

    The kernels' programs run their phases independently (program p writes its output tiles while
    another program may still be staging its own input tiles), a message goes in chunks or rounds, and
    gloo's all_to_all reads its input while it writes; so output over input is safe only where every
    output element is written from the input element at its own address. ``in_place``: the call is the
    in-place pattern engines use (the all-gather's input is this rank's block of its output, the
    reduce-scatter's output this rank's block of its input; see :func:`_is_block`), which runs as given,
    without a copy, on every path.
    """
    if in_place or not _overlaps(input, output):
        return input
    with torch.no_grad():
        return input.clone()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of 1 or 2 dims as its bytes along the last one, for the fallback's collectives
    that only move data: they need no dtype, and gloo moves only some (it refused int16, uint16, uint32,
    uint64 and the float8 types with "Invalid scalar type", naming no argument)."""
    return t.view(torch.uint8)


def _as_int(name: str, value: object) -> int:
    """``value`` as an int: an int, or a float with an integer value (numpy's scalars included)."""
    integral = isinstance(value, numbers.Integral) or (
        isinstance(value, numbers.Real) and float(value).is_integer()
    )
    if isinstance(value, bool) or not integral:  # is_integer: False for inf and NaN
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    return int(value)


def _as_number(name: str, value: object) -> float:
    """``value`` as a float: any real number (numpy's scalars included); ranges are the caller's."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: expected a number, got {value!r}")
    return float(value)


def _max_sms(max_sms: int | None) -> int:
    p = _current().max_sms if max_sms is None else _as_int("max_sms", max_sms)
    if not 1 <= p <= MAX_PROGRAMS:
        raise ValueError(f"max_sms: expected 1..{MAX_PROGRAMS}, got {max_sms}")
    return p


def _op_name(op: object) -> str:
    """``op`` as its name in ``OPS``: "sum", "avg", "max" or "min", or the ``torch.distributed.ReduceOp``
    of the same meaning (torch's call shapes take those)."""
    name = op
    if isinstance(op, (dist.ReduceOp, type(dist.ReduceOp.SUM))):  # not an int: RedOpType.MIN == 3
        name = next((n for n, torch_op in _TORCH_OPS.items() if op == torch_op), op)
    if not isinstance(name, str) or name not in OPS:
        raise ValueError(f"op: expected one of {tuple(OPS)} or the dist.ReduceOp of one, got {op!r}")
    return name


def _op_code(op: str) -> int:
    return OPS[_op_name(op)]


def _kernels_refuse(dtype: torch.dtype, op: str | None = None, name: str = "input") -> Exception | None:
    """Why the kernels cannot run a call on ``dtype`` with ``op``, as the error to raise; None when they can.

    A heap's caller falls back to torch.distributed instead; a simulated world, which has none, raises it.
    """
    if dtype not in KERNEL_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in KERNEL_DTYPES)
        return TypeError(f"{name}: dtype {dtype} is not one the kernels have ({names})")
    if op == "avg" and dtype == torch.int32:
        return ValueError("op: 'avg' is not supported for int32 (the kernels' average would truncate)")
    return None


def _symmetric_ok(heap: SymmetricHeap | None, dtype: torch.dtype, op: str | None = None) -> bool:
    return heap is not None and _kernels_refuse(dtype, op) is None


def _fallback(group: dist.ProcessGroup) -> None:
    global _last_path
    _last_path = f"torch.distributed:{dist.get_backend(group)}"


def _acc_type(dtype: torch.dtype):
    from smptk.kernels._triton import tl

    return tl.int32 if dtype == torch.int32 else tl.float32


# A call's tag: its sequence number on the heap << SEQ_SHIFT | kind (4 bits) | op + 1 (3) | dtype (3) |
# programs (9 bits, from bit 10). With the numel and chunk words it is what ranks compare (see K._verify).
_KIND_CODES = {"all_reduce_one_shot": 1, "all_reduce_two_shot": 2, "all_gather": 3, "reduce_scatter": 4}
_KIND_CODES["all_to_all"] = 5
_KIND_CODES["all_gather_ce"] = 6  # the signals of the copy-engine all-gather
_KIND_CODES["all_to_all_ce"] = 7  # and all-to-all
_KIND_CODES["all_gather_linear"] = 8  # smptk.comm.fused_linear's all-gather GEMM
_KIND_CODES["linear_reduce_scatter"] = 9  # and GEMM + reduce-scatter
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.int32: 4}
_TAG_MARK = 1 << 62


@dataclasses.dataclass(frozen=True)
class _Call:
    """What one kernel launch does, as every rank of the group must agree on it.

    ``numel``: the whole message (all_reduce: the tensor; all_gather: the input; reduce_scatter: the
    output; all_to_all: the number of rounds, since splits differ between ranks); ``chunk``: this
    launch's elements (all_to_all: the slot size).
    """

    kind: str
    dtype: torch.dtype
    op: int  # OPS code, -1 for collectives without one
    numel: int
    chunk: int

    def tag(self, seq: int, programs: int) -> int:
        meta = _KIND_CODES[self.kind] | (self.op + 1) << 4 | _DTYPE_CODES[self.dtype] << 7 | programs << 10
        # Bit 62 keeps every tag an int64 argument: a tag that fitted in 32 bits for the first calls
        # would make Triton compile the kernel a second time once the sequence number grew.
        return _TAG_MARK | seq << SEQ_SHIFT | meta


def _describe_call(tag: int, numel: int, chunk: int) -> str:
    """Human-readable announcement words (the inverse of :meth:`_Call.tag`)."""
    if tag == 0:
        return "no call"
    kinds = {v: k for k, v in _KIND_CODES.items()}
    dtypes = {v: str(k).removeprefix("torch.") for k, v in _DTYPE_CODES.items()}
    ops = {v + 1: k for k, v in OPS.items()}
    kind = kinds.get(tag & 15, "?")
    parts = [f"call #{(tag & ~_TAG_MARK) >> SEQ_SHIFT}: {kind}", dtypes.get(tag >> 7 & 7, "?")]
    if tag >> 4 & 7:
        parts.append(f"op={ops.get(tag >> 4 & 7, '?')}")
    parts.append(f"max_sms={tag >> 10 & 511}")
    if kind.startswith("all_to_all"):
        parts.append(f"rounds={numel}, slot={chunk}")
    elif kind == "all_gather_linear":  # chunk: the blocks' columns (K)
        parts.append(f"block {numel // chunk if chunk else '?'} x {chunk}")
    elif kind == "linear_reduce_scatter":  # chunk: the output's columns (N)
        parts.append(f"output block {numel // chunk if chunk else '?'} x {chunk}")
    else:
        parts.append(f"numel={numel}, chunk={chunk}")
    return " ".join(parts[:2]) + " (" + ", ".join(parts[2:]) + ")"


def resident_programs(props, launch_options: dict) -> int:
    """How many programs of a kernel launched with ``launch_options`` (``num_warps``, ``maxnreg``) a GPU
    with CUDA device properties ``props`` runs at once: per SM, what its registers and threads allow.

    A collective's programs wait for the same program of every peer, so a launch of more programs than
    this could leave a program waiting for a peer's program that is queued behind it: every one must be
    resident. Registers are what binds: 65536 per SM and 128 per thread at 8 warps give 2 per SM, so
    264 on an H100 (132 SMs) and 216 on an A100 (108 SMs).
    """
    threads = 32 * launch_options["num_warps"]
    regs = getattr(props, "regs_per_multiprocessor", 65536)  # every sm_70..sm_100 GPU has 64 K
    by_regs = regs // (threads * launch_options.get("maxnreg", 255))
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    return max(min(by_regs, by_threads), 1) * props.multi_processor_count


@functools.cache
def _resident_on(device_index: int, num_warps: int, maxnreg: int | None) -> tuple[int, str, int]:
    """(:func:`resident_programs`, GPU name, SM count) of CUDA device ``device_index``: asked once per device
    and launch options, not at every launch."""
    props = torch.cuda.get_device_properties(device_index)
    options = {"num_warps": num_warps} | ({} if maxnreg is None else {"maxnreg": maxnreg})
    return resident_programs(props, options), props.name, props.multi_processor_count


def _check_resident(kernel, programs: int, device: torch.device) -> None:
    """Refuse a launch of ``programs`` programs of a collective kernel that do not all fit on ``device``
    at once (see :func:`resident_programs`); CUDA devices only."""
    options = getattr(kernel, "launch_options", None)
    if options is None or device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    fit, name, sms = _resident_on(index, options["num_warps"], options.get("maxnreg"))
    if programs > fit:
        raise ValueError(
            f"max_sms: {programs} programs do not all fit on {name} at once ({fit}: "
            f"{fit // sms} per SM x {sms} SMs at "
            f"{options['num_warps']} warps, {options.get('maxnreg', 255)} registers per thread); the "
            f"collective's programs wait for one another across ranks, so use max_sms <= {fit}"
        )


def _wait_turn(heap) -> None:
    """On a CUDA heap: the current stream waits for the heap's latest launch, whichever stream ran it.

    Every call on a heap shares its data region and signal pads, and is numbered in host order; calls from
    two streams (FSDP2 issues all-gathers and reduce-scatters of one group on two) must not overlap on the
    device, or one would stage over the other's data and take its signals. So the calls on one heap run
    in their host order, as one NCCL communicator's do. A no-op on CPU, where every call ends before the
    next starts, and for a simulated world.
    """
    if isinstance(heap, SymmetricHeap) and heap.backend == "cuda" and heap.last_use is not None:
        torch.cuda.current_stream(heap.device).wait_event(heap.last_use)


def _took_turn(heap) -> None:
    """After a launch on a CUDA heap: mark the current stream's position as the heap's latest use. One
    event per heap, recorded again at every launch (a wait takes the record current when it is issued)."""
    if isinstance(heap, SymmetricHeap) and heap.backend == "cuda":
        if heap.last_use is None:
            heap.last_use = torch.cuda.Event()
        heap.last_use.record(torch.cuda.current_stream(heap.device))


def _launch(heap, kernel, programs: int, data: tuple, sizes: tuple, *, call: _Call, **meta) -> None:
    """Run ``kernel[(programs,)](*data, <heap's tables>, *sizes, timeout_ns, ...)`` and handle its result.

    The one launch of every collective kernel: the tables (``data_ptrs``, ``signal_ptrs``, ``status``,
    ``rank``, ``world_size``), the wait budget, block size, clock and call words come from here. ``heap``:
    a :class:`SymmetricHeap`, or a :class:`smptk.comm.simulated.SimulatedWorld` (the same tables over one
    device's memory), whose launches run with ``SIMULATED=True``: the kernel skips every barrier and call
    check, so nothing waits or is checked afterwards. On a heap, raises CommMismatchError when a peer's call
    differs and CommTimeoutError when a peer never arrived (checked here on CPU; on CUDA at :func:`check`
    or with SMPTK_COMM_SYNC_CHECK=1).
    """
    global _last_path
    simulated = not isinstance(heap, SymmetricHeap)
    if not simulated and heap.broken is not None:
        raise CommError(
            f"rank {heap.rank}: the symmetric heap is unusable ({heap.broken}); call smptk.comm.reset() "
            "on every rank to build a new one"
        )
    if not simulated:
        _check_resident(kernel, programs, heap.status.device)
    timeout_s = _current().timeout_s
    interpreted = runtime.interpreter_enabled()
    timer = None
    if interpreted and not simulated:  # no clock in an interpreted kernel: a host thread sets the abort word
        # ... for this launch only: one that outlasted timeout_s after its last wait returned a success
        # with the word set, and the next launch's first wait would give up at once
        heap.abort_flag.zero_()
        timer = threading.Timer(timeout_s, heap.abort_flag.fill_, args=(1,))
        timer.daemon = True
        timer.start()
    _wait_turn(heap)
    try:
        heap.calls += 1
        compiled = kernel[(programs,)](
            *data,
            heap.data_ptrs,
            heap.signal_ptrs,
            heap.status,
            heap.rank,
            heap.world_size,
            *sizes,
            int(timeout_s * 1e9),
            BLOCK=K.BLOCK_INTERPRETER if interpreted else K.BLOCK,
            USE_CLOCK=not interpreted,
            SIMULATED=simulated,
            call_tag=call.tag(heap.calls, programs),
            call_numel=call.numel,
            call_chunk=call.chunk,
            **meta,
        )
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()  # a timer already firing has set the word before the next launch clears it
    _took_turn(heap)
    if not interpreted and hasattr(compiled, "asm"):
        _last_compiled[getattr(kernel, "__name__", type(kernel).__name__)] = compiled
    if simulated:
        return
    _last_path = "symmetric"
    if heap.backend == "cpu" or (heap.status.is_cuda and _sync_checks()):
        _raise_on_status(heap, timeout_s)


def _sync_checks() -> bool:
    """On CUDA, checking a kernel's status means a host sync; SMPTK_COMM_SYNC_CHECK=1 asks for it."""
    return env_settings.comm_sync_check()


def _raise_on_status(heap: SymmetricHeap, timeout_s: float) -> None:
    status = heap.status.cpu()
    world = heap.world_size
    differ = [q for q in range(world) if int(status[world + q]) != 0]
    if differ:
        own = heap.local[CALL_OFFSET : CALL_OFFSET + 24].view(torch.int64).tolist()
        seen = heap.local[SEEN_OFFSET : SEEN_OFFSET + 24 * world].view(torch.int64).view(world, 3).tolist()
        theirs = "; ".join(f"rank {q} made {_describe_call(*seen[q])}" for q in differ)
        heap.broken = f"ranks {differ} made a different call"
        raise CommMismatchError(
            f"rank {heap.rank}: collective calls differ between ranks: this rank made "
            f"{_describe_call(*own)}; {theirs}. Every rank must make the same calls with the same dtype, "
            "size, op, algorithm and max_sms; the heap is now marked broken (smptk.comm.reset())",
            differ,
        )
    missing = [q for q in range(world) if int(status[q]) != 0]
    if missing:
        heap.broken = f"ranks {missing} did not arrive within {timeout_s:g} s"
        raise CommTimeoutError(
            f"rank {heap.rank}: group rank(s) {missing} did not arrive at a barrier within {timeout_s:g} s "
            "(timeout_s); the heap is now marked broken",
            missing,
        )


def check(group: dist.ProcessGroup | None = None) -> None:
    """Wait for this rank's queued collectives on ``group`` and raise if any timed out (CUDA: syncs).

    On CPU every call is checked as it returns; on CUDA a call returns before its kernel finishes, so a
    timeout surfaces here or, with SMPTK_COMM_SYNC_CHECK=1, at the end of every call.

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> import smptk.comm as comm
        >>> dist.init_process_group("gloo")
        >>> t = comm.all_reduce(torch.ones(4))
        >>> comm.check()                  # returns None: every queued collective arrived in time
        >>> t
        tensor([2., 2., 2., 2.])
    """
    g = _group(group)
    for heap in list(_heaps.get(g, {}).values()):
        if heap is not None:
            if heap.status.is_cuda:
                torch.cuda.synchronize(heap.device)
            _raise_on_status(heap, _current().timeout_s)


def _heap_elems(heap: SymmetricHeap, dtype: torch.dtype) -> int:
    return heap.heap_bytes // torch.empty((), dtype=dtype).element_size()


def _vector_floor(elems: int, dtype: torch.dtype) -> int:
    """``elems`` rounded down to whole 16-byte vectors: staging offsets that are multiples of it keep the
    kernels on their 128-bit path (see smptk.kernels.collectives); 0 when less than one vector."""
    return elems - elems % _per_vector(dtype)


def _per_vector(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in 16 bytes (the kernels' VEC)."""
    return max(1, 16 // torch.empty((), dtype=dtype).element_size())


def _two_shot_slice(n: int, world: int, dtype: torch.dtype) -> int:
    """Elements of each rank's two-shot slice: ``ceil(n / world)`` rounded up to whole 16-byte vectors, so
    every slice starts 16-byte aligned and the kernel's 128-bit path applies at any world size (the last
    ranks' slices may then be short or empty)."""
    per_vector = _per_vector(dtype)
    return -(-n // (world * per_vector)) * per_vector


def _tma(device: torch.device) -> int:
    """The data kernels' TMA constexpr for a launch on ``device``: 0 the pointer path; with copy_path "tma",
    2 where the kernel is compiled for a GPU with TMA (sm_90+: loads through descriptors, after an
    async-proxy fence) and 1 under the interpreter (the same code path, no fence to emit)."""
    if _current().copy_path != "tma":
        return 0
    if runtime.interpreter_enabled():
        return 1
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        ensure_allocator()  # device-side descriptors take scratch memory from Triton's allocator
        return 2
    return 0


# One launch of each kernel, on a heap or a simulated world (see :func:`_launch`): the collectives below
# call these per chunk, and smptk.comm.simulated calls them for its single-launch messages.
def _launch_all_reduce(heap, src, dst, programs: int, code: int, algorithm: str, numel: int) -> None:
    """``dst = reduce over ranks of src`` (both ``[n]``, may alias); a chunk of a ``numel``-element call."""
    n, dtype = src.numel(), src.dtype
    if algorithm == "one_shot":
        kernel, sizes = K._all_reduce_one_shot_kernel, (n,)
    else:
        kernel, sizes = K._all_reduce_two_shot_kernel, (n, _two_shot_slice(n, heap.world_size, dtype))
    call = _Call(f"all_reduce_{algorithm}", dtype, code, numel, n)
    meta = {"OP": code, "ACC": _acc_type(dtype), "TMA": _tma(src.device)}
    _launch(heap, kernel, programs, (src, dst), sizes, call=call, **meta)


def _launch_all_gather(heap, src, dst, n: int, out_stride: int, programs: int, numel: int) -> None:
    """``dst[q * out_stride + i] = (src of rank q)[i]``, ``i < n``; a chunk of a ``numel``-element input."""
    call = _Call("all_gather", src.dtype, -1, numel, n)
    _launch(
        heap, K._all_gather_kernel, programs, (src, dst), (n, out_stride), call=call, TMA=_tma(src.device)
    )


def _launch_reduce_scatter(heap, src, dst, n: int, in_stride: int, programs: int, code: int, numel: int):
    """``dst[i] = reduce over ranks q of (src of q)[rank * in_stride + i]`` for ``i < n``; a chunk of a
    ``numel``-element output."""
    call = _Call("reduce_scatter", src.dtype, code, numel, n)
    acc = _acc_type(src.dtype)
    meta = {"OP": code, "ACC": acc, "TMA": _tma(src.device)}
    _launch(heap, K._reduce_scatter_kernel, programs, (src, dst), (n, in_stride), call=call, **meta)


def _launch_all_to_all(heap, src, dst, windows, slot: int, programs: int, n_rounds: int) -> None:
    """One all-to-all round; ``windows``: int64 ``[4, world]`` on the kernels' device, rows input offset,
    input length, output offset, output length of each rank's window (see ``K._all_to_all_kernel``)."""
    call = _Call("all_to_all", src.dtype, -1, n_rounds, slot)
    _launch(
        heap, K._all_to_all_kernel, programs, (src, dst, *windows), (slot,), call=call, TMA=_tma(src.device)
    )


@outside_graphs
def all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    group: dist.ProcessGroup | None = None,
    *,
    max_sms: int | None = None,
    algorithm: str = "auto",
) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` over ``group`` (like ``dist.all_reduce``); returns ``tensor``.

    Args:
        tensor: contiguous; fp32/bf16/fp16/int32 take the symmetric path (fp32 accumulation for 16-bit;
            the fallback's "avg" sums 16-bit floats in fp32 too where it sums and divides, e.g. gloo,
            and integers narrower than 64 bits in int64, then floors the mean; int16, uint16 and uint32,
            which no backend reduces, go through int64 for every op; on gloo, uint64 and float8 are refused).
        op: "sum", "avg", "max" or "min" (or ``dist.ReduceOp.SUM`` ... ``MIN``).
        group: process group (default: the world).
        max_sms: programs (SMs) the kernel occupies, 1..256 (default: :func:`configure`'s, 8).
        algorithm: "auto", "one_shot" or "two_shot".

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from smptk.comm import all_reduce
        >>> dist.init_process_group("gloo")
        >>> t = torch.full((4,), float(dist.get_rank()))
        >>> all_reduce(t, op="max")       # in place; every rank: world_size - 1
        tensor([1., 1., 1., 1.])
    """
    g = _group(group)
    _check_tensor("tensor", tensor)
    op = _op_name(op)
    _check_avg_dtype(op, tensor.dtype)
    code = OPS[op]
    programs = _max_sms(max_sms)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
    heap = _heap(g, tensor)
    if not _symmetric_ok(heap, tensor.dtype, op):
        _torch_all_reduce(tensor, op, g)
        return tensor
    if algorithm == "auto":
        algorithm = "one_shot" if tensor.numel() * tensor.element_size() <= ONE_SHOT_MAX_BYTES else "two_shot"
    flat = tensor.view(-1)
    chunk = _heap_elems(heap, tensor.dtype)
    # an empty tensor launches once too, as the other collectives do: a rank whose tensor is empty where
    # its peers' are not must meet them, for the call check to see the sizes differ
    for c0 in range(0, max(flat.numel(), 1), chunk):
        part = flat[c0 : c0 + chunk]
        _launch_all_reduce(heap, part, part, programs, code, algorithm, flat.numel())
    return tensor


def _sum_then_divide(op: str, dtype: torch.dtype, g: dist.ProcessGroup) -> bool:
    """Whether the fallback runs "avg" as a sum and a division here: gloo has no AVG, and an integer
    average floors on every backend (NCCL's AVG would truncate toward zero)."""
    exact = not (dtype.is_floating_point or dtype.is_complex)
    return op == "avg" and (dist.get_backend(g) != "nccl" or exact)


# The fallback's sum-then-divide sums these in fp32, as the symmetric kernels do: an fp16 sum over ranks
# overflowed to inf where the average fits (two ranks' 40000), and a bf16 sum rounds at every rank.
_SUM_IN_FP32 = (torch.float16, torch.bfloat16)


def _summed(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it to sum into: fp32 for a 16-bit float, int64 for an integer type narrower than
    64 bits, whose sum over ranks wrapped where the average fits (two ranks' int8 100 averaged to -28)."""
    narrow_int = (
        not (t.is_floating_point() or t.is_complex()) and t.dtype != torch.bool and t.element_size() < 8
    )
    if t.dtype not in _SUM_IN_FP32 and not narrow_int:
        return t
    with torch.no_grad():
        return t.long() if narrow_int else t.float()


# Integer dtypes torch.distributed's backends cannot reduce (gloo: "Invalid scalar type", naming no argument;
# NCCL has no 16-bit integers): the fallback reduces them in int64 and writes the result back, which wraps
# as the dtype's own sum does. Every dtype else that gloo cannot reduce (torch 2.13: uint64, the float8 and
# sub-byte types) is refused before any data moves, naming the argument.
_REDUCE_IN_INT64 = (torch.int16, torch.uint16, torch.uint32)
_GLOO_REDUCES = (
    *(torch.float32, torch.float64, torch.float16, torch.bfloat16),
    *(torch.complex32, torch.complex64, torch.complex128),
    *(torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool),
)


def _reduced(name: str, t: torch.Tensor, g: dist.ProcessGroup) -> torch.Tensor:
    """``t``, or an int64 copy of it for the fallback to reduce (see ``_REDUCE_IN_INT64``); refuses a dtype
    gloo cannot reduce, naming ``name``."""
    if t.dtype in _REDUCE_IN_INT64:
        with torch.no_grad():
            return t.long()
    if t.dtype not in _GLOO_REDUCES and dist.get_backend(g) == "gloo":
        names = ", ".join(str(d).removeprefix("torch.") for d in _GLOO_REDUCES + _REDUCE_IN_INT64)
        raise TypeError(
            f"{name}: dtype {t.dtype} cannot be reduced on torch.distributed:gloo ({names}); cast first"
        )
    return t


def _put_back(acc: torch.Tensor, t: torch.Tensor) -> None:
    if acc is not t:
        with torch.no_grad():
            t.copy_(acc)


def _average(t: torch.Tensor, world: int) -> None:
    """A sum made the mean in place: true division for floating and complex dtypes, the floor for integers.
    Outside autograd, as the collective before it (``t`` may be a leaf that requires grad)."""
    with torch.no_grad():
        if t.is_floating_point() or t.is_complex():
            t.div_(world)
        else:
            t.floor_divide_(world)


def _check_avg_dtype(op: str, dtype: torch.dtype) -> None:
    """Refuse an average of bools before any data moves (the sum would be a logical or)."""
    if op == "avg" and dtype == torch.bool:
        raise TypeError("op: 'avg' of bool tensors is not defined (the sum is a logical or); cast first")


def _torch_all_reduce(tensor: torch.Tensor, op: str, g: dist.ProcessGroup) -> None:
    acc = _reduced("tensor", tensor, g)
    if _sum_then_divide(op, tensor.dtype, g):
        acc = _summed(acc)
        dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=g)
        _average(acc, dist.get_world_size(g))
    else:
        dist.all_reduce(acc, op=_TORCH_OPS[op], group=g)
    _put_back(acc, tensor)
    _fallback(g)


@outside_graphs
def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    max_sms: int | None = None,
    algorithm: str = "auto",
) -> torch.Tensor:
    """Gather every rank's ``input`` into ``output`` (``world * input.numel()`` elements, rank order).

    Same semantics as ``dist.all_gather_into_tensor``: ``output`` may be ``[world * d0, ...]`` or
    ``[world, *input.shape]``; only the element count and dtype must match. Returns ``output``.
    ``input`` may be this rank's block of ``output`` (``output.narrow(0, rank * d0, d0)``: the in-place
    all-gather of FSDP and Megatron), which runs without a copy; an ``input`` that overlaps ``output``
    in any other way is copied first.

    ``algorithm``: "kernel" (``max_sms`` programs move the data), "copy_engine" (no SM moves data: each
    rank copies its input into its heap region, and after a one-program signal kernel copies every
    peer's region into ``output`` with tensor copies, the copy engines on CUDA; a second signal keeps
    the regions until every rank has read them; ``max_sms`` is unused) or "auto" ("kernel").

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from smptk.comm import all_gather_into_tensor
        >>> dist.init_process_group("gloo")
        >>> out = torch.empty(dist.get_world_size() * 3)
        >>> all_gather_into_tensor(out, torch.full((3,), float(dist.get_rank())), algorithm="copy_engine")
        tensor([0., 0., 0., 1., 1., 1.])
    """
    g = _group(group)
    _check_tensor("output", output)
    _check_tensor("input", input)
    _check_pair("output", output, "input", input)
    world = dist.get_world_size(g)
    if output.numel() != world * input.numel():
        raise ValueError(
            f"output: expected world_size * input.numel() = {world} * {input.numel()} elements, "
            f"got {output.numel()} (shape {tuple(output.shape)})"
        )
    programs = _max_sms(max_sms)
    copy_engine = _copy_algorithm(algorithm)
    input = _apart(input, output, in_place=_is_block(input, output, dist.get_rank(g)))
    heap = _heap(g, input)
    if not _symmetric_ok(heap, input.dtype):
        # flat views: gloo takes only a [world * d0, ...] output, the heap path any shape of that size
        dist.all_gather_into_tensor(_bytes(output.view(-1)), _bytes(input.reshape(-1)), group=g)
        _fallback(g)
        return output
    src, dst = input.view(-1), output.view(-1)
    n_total = src.numel()
    chunk = _heap_elems(heap, input.dtype)
    if copy_engine:
        _all_gather_copy_engine(heap, src, dst, chunk)
        global _last_path
        _last_path = "copy_engine"
        return output
    for c0 in range(0, max(n_total, 1), chunk):
        _launch_all_gather(heap, src[c0:], dst[c0:], min(chunk, n_total - c0), n_total, programs, n_total)
    return output


def _copy_algorithm(algorithm: str) -> bool:
    """Whether ``algorithm`` (one of :data:`COPY_ALGORITHMS`) asks for the copy-engine path."""
    if algorithm not in COPY_ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {COPY_ALGORITHMS}, got {algorithm!r}")
    return algorithm == "copy_engine"


def _signal(heap, call: _Call) -> None:
    """One barrier of every rank's one-program signal kernel, with the cross-rank call check."""
    _launch(heap, K._signal_kernel, 1, (), (), call=call)


def _all_gather_copy_engine(heap, src: torch.Tensor, dst: torch.Tensor, chunk: int) -> None:
    """all_gather with tensor copies: stage, signal, copy every peer's region, signal (per heap chunk).

    The copies run on the caller's stream, ordered with the signal kernels; on CUDA a copy between
    device buffers (peer mappings included) is a copy-engine transfer, not a kernel of ours. ``heap``:
    a heap or a simulated world, as for :func:`_launch`.
    """
    n_total, world = src.numel(), heap.world_size
    for c0 in range(0, max(n_total, 1), chunk):
        n = min(chunk, n_total - c0)
        call = _Call("all_gather_ce", src.dtype, -1, n_total, n)
        _wait_turn(heap)  # the staging copy writes the heap: after its previous use (see _wait_turn)
        heap.peer_data(heap.rank, src.dtype, n).copy_(src[c0 : c0 + n])
        _signal(
            heap, call
        )  # every rank's slice is staged (a failed signal raises here on CPU, at check() on CUDA)
        for q in range(world):
            dst[q * n_total + c0 : q * n_total + c0 + n].copy_(heap.peer_data(q, src.dtype, n))
        _signal(heap, call)  # every rank has read: the regions may be staged again


@outside_graphs
def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: str = "sum",
    group: dist.ProcessGroup | None = None,
    *,
    max_sms: int | None = None,
) -> torch.Tensor:
    """Reduce ``input`` (``world * output.numel()`` elements) over ranks; rank r keeps block r in ``output``.

    Same semantics as ``dist.reduce_scatter_tensor``: ``input`` may be ``[world * d0, ...]`` or
    ``[world, *output.shape]``; only the element count and dtype must match. Returns ``output``. ``output``
    may be this rank's block of ``input`` (the in-place reduce-scatter), which runs without a copy; an
    ``output`` that overlaps ``input`` in any other way has ``input`` copied first.

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from smptk.comm import reduce_scatter_tensor
        >>> dist.init_process_group("gloo")
        >>> out = torch.empty(3)
        >>> reduce_scatter_tensor(out, torch.ones(dist.get_world_size() * 3))   # every element: world_size
        tensor([2., 2., 2.])
    """
    g = _group(group)
    _check_tensor("output", output)
    _check_tensor("input", input)
    _check_pair("output", output, "input", input)
    world = dist.get_world_size(g)
    if input.numel() != world * output.numel():
        raise ValueError(
            f"input: expected world_size * output.numel() = {world} * {output.numel()} elements, "
            f"got {input.numel()} (shape {tuple(input.shape)})"
        )
    op = _op_name(op)
    _check_avg_dtype(op, input.dtype)
    code = OPS[op]
    programs = _max_sms(max_sms)
    input = _apart(input, output, in_place=_is_block(output, input, dist.get_rank(g)))
    heap = _heap(g, input)
    if not _symmetric_ok(heap, input.dtype, op):
        _torch_reduce_scatter(output, input, op, g)
        return output
    src, dst = input.view(-1), output.view(-1)
    n_total = dst.numel()
    chunk = max(1, _vector_floor(_heap_elems(heap, input.dtype) // world, input.dtype))
    for c0 in range(0, max(n_total, 1), chunk):
        n = min(chunk, n_total - c0)
        _launch_reduce_scatter(heap, src[c0:], dst[c0:], n, n_total, programs, code, n_total)
    return output


def _torch_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str, g: dist.ProcessGroup) -> None:
    """The fallback's reduce-scatter, on flat views: gloo takes only an ``[world * d0, ...]`` input with a
    ``[d0, ...]`` output (a ``[world, *output.shape]`` input aborted the process on a failed CHECK, a 0-d
    output segfaulted it), the heap path any shapes of those sizes."""
    acc, src = _reduced("output", output, g), _reduced("input", input, g)
    if _sum_then_divide(op, input.dtype, g):
        acc = _summed(acc)
        dist.reduce_scatter_tensor(acc.view(-1), _summed(src).view(-1), op=dist.ReduceOp.SUM, group=g)
        _average(acc, dist.get_world_size(g))
    else:
        dist.reduce_scatter_tensor(acc.view(-1), src.view(-1), op=_TORCH_OPS[op], group=g)
    _put_back(acc, output)
    _fallback(g)


def _split_list(name: str, sizes: object) -> list[int] | None:
    """Split sizes ``sizes`` (argument ``name``) as a list of ints, or None: from any iterable but a string,
    or a 1-D integer tensor (one host read); an entry may be an integral float (2.0), and one that is not an
    integer is refused by its index. Their count and sum are the caller's to check."""
    if sizes is None:
        return None
    if isinstance(sizes, torch.Tensor):
        if sizes.dim() != 1 or sizes.is_floating_point() or sizes.is_complex():
            raise ValueError(
                f"{name}: a tensor of split sizes must be 1-D integer, got {sizes.dtype} {tuple(sizes.shape)}"
            )
        sizes = sizes.tolist()
    elif isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise TypeError(f"{name}: expected a sequence of ints, a 1-D integer tensor or None, got {sizes!r}")
    return [_as_int(f"{name}[{i}]", v) for i, v in enumerate(sizes)]


def _splits(
    name: str, sizes: Sequence[int] | torch.Tensor | None, tensor: torch.Tensor, world: int
) -> list[int]:
    """Row counts per rank from a list, a 1-D integer tensor (read on the host) or None (equal split)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    sizes = _split_list(name, sizes)
    if sizes is None:
        if rows % world:
            raise ValueError(f"{name}: None needs dim 0 ({rows}) divisible by the world size {world}")
        return [rows // world] * world
    if len(sizes) != world or any(s < 0 for s in sizes):
        raise ValueError(f"{name}: expected {world} non-negative sizes, got {sizes}")
    if sum(sizes) != rows:
        raise ValueError(f"{name}: sizes sum to {sum(sizes)} but dim 0 of the tensor is {rows}")
    return sizes


def _exchange_splits(g: dist.ProcessGroup, in_len: list[int], out_len: list[int], dev: torch.device) -> int:
    """Check every rank's send sizes against its receivers' expectations; return the largest of them.

    One all-gather of each rank's ``[send to 0..W-1, expect from 0..W-1]`` element counts and one host
    read. Every rank sees the whole matrix, so on a disagreement every rank raises the same
    :class:`CommMismatchError`, naming each pair.
    """
    world = len(in_len)
    mine = torch.tensor(in_len + out_len, dtype=torch.int64, device=dev)
    every = torch.empty(world * 2 * world, dtype=torch.int64, device=dev)
    all_gather_into_tensor(every.view(torch.int32), mine.view(torch.int32), group=g, max_sms=1)
    table = every.view(world, 2, world).tolist()  # [rank][0: sends to d, 1: expects from q]
    bad = [(q, d, table[q][0][d], table[d][1][q]) for q in range(world) for d in range(world)
           if table[q][0][d] != table[d][1][q]]  # fmt: skip
    if bad:
        pairs = "; ".join(f"rank {q} sends {s} elements to rank {d}, which expects {e}" for q, d, s, e in bad)
        raise CommMismatchError(
            f"rank {dist.get_rank(g)}: all_to_all_single split sizes disagree between ranks: {pairs} "
            "(input_split_sizes[d] on rank q must equal output_split_sizes[q] on rank d, in elements)",
            sorted({q for q, d, _, _ in bad} | {d for q, d, _, _ in bad}),
        )
    return max(max(row[0]) for row in table)


def _window(lengths: list[int], starts: list[int], lo: int, slot: int) -> tuple[list[int], list[int]]:
    """This round's (offsets, sizes) per peer: elements [lo, lo + slot) of each peer's segment."""
    sizes = [min(max(n - lo, 0), slot) for n in lengths]
    offs = [s + lo if z else 0 for s, z in zip(starts, sizes, strict=True)]
    return offs, sizes


@outside_graphs
def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | torch.Tensor | None = None,
    input_split_sizes: Sequence[int] | torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    max_sms: int | None = None,
    algorithm: str = "auto",
    agreed_max_split: int | None = None,
) -> torch.Tensor:
    """Rank r sends rows ``input_split_sizes[d]`` of ``input`` to rank d and receives into ``output``.

    Same semantics as ``dist.all_to_all_single`` (splits along dim 0, as lists or 1-D integer tensors;
    None means equal splits). Every rank's ``input_split_sizes[d]`` must equal rank d's
    ``output_split_sizes[r]``: the call exchanges the sizes (one small all-gather and one host read) and
    on any disagreement every rank raises :class:`CommMismatchError` naming the pairs (meta tensors, which
    move no data, skip the exchange).

    ``agreed_max_split``: the largest split, in rows, that any rank sends in this call, when every rank
    already knows it (e.g. from a count matrix all ranks hold) and passes the same value. The call then
    skips the exchange and its host read, and trusts the splits. ``algorithm``: "kernel", "copy_engine"
    (tensor copies of the peers' heap regions between one-program signal kernels; see
    :func:`all_gather_into_tensor`) or "auto" ("kernel"). Returns ``output``. ``output`` may overlap
    ``input`` (``input`` is then copied first; gloo's own all_to_all_single gives wrong rows there).

    Example (under ``torchrun --nproc-per-node 2``, every rank; gloo on CPU)::

        >>> import torch
        >>> import torch.distributed as dist
        >>> from smptk.comm import all_to_all_single
        >>> dist.init_process_group("gloo")
        >>> rank = dist.get_rank()
        >>> send_counts = [1, 2] if rank == 0 else [3, 1]   # rows this rank sends to rank 0, rank 1
        >>> recv_counts = [1, 3] if rank == 0 else [2, 1]   # rows it receives from rank 0, rank 1
        >>> x = torch.full((sum(send_counts), 2), float(rank))
        >>> out = torch.empty(sum(recv_counts), 2)
        >>> _ = all_to_all_single(out, x, recv_counts, send_counts)
        >>> received = [None, None]
        >>> dist.all_gather_object(received, out[:, 0].tolist())
        >>> received                                        # rank 0's rows, rank 1's rows: by sender
        [[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0]]
    """
    g = _group(group)
    _check_tensor("output", output)
    _check_tensor("input", input)
    _check_pair("output", output, "input", input)
    world = dist.get_world_size(g)
    in_rows = _splits("input_split_sizes", input_split_sizes, input, world)
    out_rows = _splits("output_split_sizes", output_split_sizes, output, world)
    # elements per row from the shape, not from a row: a rank with no rows has rows of the same width, and
    # agreed_max_split * width sizes the rounds every rank must agree on (0 gave it 1 round, the others 2+);
    # a 0-d tensor is one row of one element, as _splits counts it
    row_in = math.prod(input.shape[1:])
    row_out = math.prod(output.shape[1:])
    if input.dim() > 1 and output.dim() > 1 and input.shape[1:] != output.shape[1:]:
        raise ValueError(
            f"output: rows of shape {tuple(output.shape[1:])} but input rows are {tuple(input.shape[1:])}"
        )
    if agreed_max_split is not None:
        agreed_max_split = _as_int("agreed_max_split", agreed_max_split)
        if agreed_max_split < max(in_rows + out_rows):
            raise ValueError(
                f"agreed_max_split: {agreed_max_split} rows, but this rank's splits reach "
                f"{max(in_rows + out_rows)}"
            )
    programs = _max_sms(max_sms)
    copy_engine = _copy_algorithm(algorithm)
    input = _apart(input, output)
    heap = _heap(g, input)
    # Splits count rows of each tensor; a row's element count may differ between input and output (a
    # [4, 3] input into a flat [12] output, as torch.distributed allows), so each side uses its own.
    in_len = [r * row_in for r in in_rows]
    out_len = [r * row_out for r in out_rows]
    if input.device.type == "meta":  # no data moves, and none can be read back to check the splits
        peak = 0
    elif agreed_max_split is None:  # on the fallback too: torch's would fail on one rank and hang another
        peak = _exchange_splits(g, in_len, out_len, input.device)
    else:
        peak = agreed_max_split * max(row_in, row_out)
    if not _symmetric_ok(heap, input.dtype):
        # [rows, elements per row] (a 0-d tensor is one row of one element: torch reads split sizes along
        # dim 0), moved as bytes
        dist.all_to_all_single(
            _bytes(output.view(sum(out_rows), row_out)),
            _bytes(input.view(sum(in_rows), row_in)),
            out_rows,
            in_rows,
            group=g,
        )
        _fallback(g)
        return output
    in_start = [sum(in_len[:d]) for d in range(world)]
    out_start = [sum(out_len[:d]) for d in range(world)]
    slot = _vector_floor(_heap_elems(heap, input.dtype) // world, input.dtype)
    if slot == 0:
        raise CommError(f"heap_bytes={heap.heap_bytes} is too small for {world} ranks")
    n_rounds = max(-(-peak // slot), 1)  # the same on every rank: ranks launch the same calls
    src, dst = input.view(-1), output.view(-1)
    if copy_engine:
        _all_to_all_copy_engine(heap, src, dst, (in_len, in_start), (out_len, out_start), slot, n_rounds)
        global _last_path
        _last_path = "copy_engine"
        return output
    dev = input.device
    for c in range(n_rounds):
        in_off, in_n = _window(in_len, in_start, c * slot, slot)
        out_off, out_n = _window(out_len, out_start, c * slot, slot)
        windows = torch.tensor([in_off, in_n, out_off, out_n], dtype=torch.int64).to(dev, non_blocking=True)
        _launch_all_to_all(heap, src, dst, windows, slot, programs, n_rounds)
    return output


def _all_to_all_copy_engine(
    heap,
    src: torch.Tensor,
    dst: torch.Tensor,
    sends: tuple[list[int], list[int]],
    recvs: tuple[list[int], list[int]],
    slot: int,
    n_rounds: int,
) -> None:
    """all_to_all with tensor copies, per round: stage each destination's window at ``d * slot`` of this
    rank's region, signal, copy the window at ``rank * slot`` of every peer's region into ``dst``, signal.
    ``sends`` / ``recvs``: (lengths, starts) of each rank's segment of ``src`` / ``dst``, in elements."""
    rank, world, dtype = heap.rank, heap.world_size, src.dtype
    for c in range(n_rounds):
        call = _Call("all_to_all_ce", dtype, -1, n_rounds, slot)
        in_off, in_n = _window(*sends, c * slot, slot)
        out_off, out_n = _window(*recvs, c * slot, slot)
        _wait_turn(heap)  # the staging copies write the heap: after its previous use (see _wait_turn)
        for d in range(world):
            if in_n[d]:
                heap.peer_data(rank, dtype, in_n[d], d * slot).copy_(src[in_off[d] : in_off[d] + in_n[d]])
        _signal(heap, call)
        for q in range(world):
            if out_n[q]:
                dst[out_off[q] : out_off[q] + out_n[q]].copy_(heap.peer_data(q, dtype, out_n[q], rank * slot))
        _signal(heap, call)
