"""Collective kernels over a symmetric heap: exactly ``max_sms`` persistent programs looping over tiles.

Each rank launches the same kernel with the same number of programs P. Program p of every rank owns
the same tiles (tile t of every slice goes to program ``t % P``), so a barrier between program p of all
ranks is enough to order one phase's writes before the next phase's reads: there is no grid-wide sync.

Inputs every kernel takes (legend: W ranks, n elements, ``*_W`` a table with one entry per rank):

- ``data_W``: int64 ``[W]`` addresses of every rank's data region (the staging buffer of the heap);
  ``tl.load(data_W + q).to(tl.pointer_type(dtype))`` is rank q's buffer.
- ``signal_W``: int64 ``[W]`` addresses of every rank's signal pad, int32 ``[MAX_PROGRAMS, MAX_WORLD]``;
  slot ``[p, q]`` of rank r's pad is where rank q's program p signals rank r.
- ``status_ptr``: int32 ``[2W]`` of this rank; ``status[q] = 1`` when rank q did not arrive in time,
  ``status[W + q] = 1`` when rank q made a different call. Sticky: once set, later kernels on the heap
  do nothing until the host builds a new heap.
- ``call_tag, call_numel, call_chunk``: what this call is (sequence number, collective, dtype, op,
  programs; message size; this launch's size), packed by ``smptk.comm.collectives._Call``.

Barrier (per program; self-resetting, so CUDA-graph replay works): signal every peer by CAS 0 -> 1 on
slot ``[p, me]`` of its pad (release, system scope: the data this program wrote is visible before the
flag), then consume every peer's signal by CAS 1 -> 0 on slot ``[p, q]`` of this rank's pad (acquire).
A put that finds 1 waits for the peer to consume the previous round first.

Cross-rank call check: every program first announces the call in this rank's control words (tag
last, with release), and after the first barrier compares every peer's announcement with its own; a
program that waits for a peer also looks at the peer's announcement now and then, so a peer that runs
fewer programs (another ``max_sms``) cannot leave it waiting. Any difference (collective, dtype, size,
op, algorithm, programs, or the call's number in the heap's sequence) makes every rank skip the rest
of the kernel and record the differing peers; the host raises :class:`smptk.comm.CommMismatchError`.

Bounded waits: on CUDA a wait gives up once ``%globaltimer`` has advanced by ``timeout_ns`` since the
program started; under the interpreter (no clock intrinsic) it gives up when the host watchdog sets the
abort word. A program that gives up records the missing rank in ``status`` and skips all further work
and barriers; the host then raises :class:`smptk.comm.CommTimeoutError`.

Reductions accumulate in fp32 for fp16/bf16/fp32 and in int32 for int32. Ops: 0 sum, 1 avg, 2 max, 3 min.

``SIMULATED=True`` skips every barrier: one rank's kernel moves data through W buffers that all live in
one device's memory, with no peer to wait for. Only the benchmarks' single-GPU "simulated world" uses it;
its numbers are labeled as such and are not multi-GPU measurements.

Worked example, one-shot all-reduce (sum), W=2, n=3: rank 0 holds [1, 2, 3], rank 1 [10, 20, 30].
Phase 0 copies each input into its own data region; barrier; phase 1 has each rank read both regions
and write [11, 22, 33] into its output; a closing barrier keeps the regions alive until both have read.
"""

from __future__ import annotations

from smptk.kernels._triton import tl, triton
from smptk.kernels.heap_layout import ABORT_OFFSET, CALL_OFFSET, MAX_WORLD, SEEN_OFFSET

# Heap layout constants as tl.constexpr: the Triton compiler rejects plain Python globals in kernels.
_MAX_WORLD = tl.constexpr(MAX_WORLD)
_ABORT_WORD = tl.constexpr(ABORT_OFFSET // 4)  # int32 index of the abort word from the pad's start
_CALL_WORD = tl.constexpr(CALL_OFFSET // 8)  # int64 index of this rank's announced call
_SEEN_WORD = tl.constexpr(SEEN_OFFSET // 8)  # int64 index of the table of peers' differing calls
SEQ_SHIFT = 24  # call tag = sequence number << SEQ_SHIFT | what the call is (see smptk.comm.collectives)
_SEQ_SHIFT = tl.constexpr(SEQ_SHIFT)

OP_SUM, OP_AVG, OP_MAX, OP_MIN = 0, 1, 2, 3
# Integer arguments equal to 1 would otherwise become compile-time constants (rank 1, world 1, n 1...):
# one compiled kernel per rank and size class is wasteful, and constants have no ``.to``.
_NO_SPECIALIZE = [
    "rank", "world", "n", "slice_n", "out_stride", "in_stride", "slot", "timeout_ns",
    "call_tag", "call_numel", "call_chunk",
]  # fmt: skip
OPS = {"sum": OP_SUM, "avg": OP_AVG, "max": OP_MAX, "min": OP_MIN}

# Elements per tile: 1024 x 2-byte = 2 KiB per load, enough to keep a program's loads in flight. Untuned.
BLOCK = 1024
BLOCK_INTERPRETER = 256  # fewer numpy round trips per tile under the interpreter; also untuned


@triton.jit
def _i64(x):
    """``x`` as an int64 scalar whether it is a tensor, a constant or (under the interpreter) a Python int."""
    return tl.full((), 0, tl.int64) + x


@triton.jit
def _now(start_ns, USE_CLOCK: tl.constexpr):
    if USE_CLOCK:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        t = start_ns
    return t


@triton.jit
def _expired(start_ns, timeout_ns, abort_ptr, USE_CLOCK: tl.constexpr):
    """1 when this program's wait budget is spent (clock on CUDA, host abort word under the interpreter)."""
    if USE_CLOCK:
        out = (_now(start_ns, USE_CLOCK) - start_ns > timeout_ns).to(tl.int32)
    else:
        out = (tl.load(abort_ptr, volatile=True) != 0).to(tl.int32)
    return out


@triton.jit
def _call_words(signal_W, q):
    """int64 pointer to rank q's announced call: (tag, numel, chunk), in its control words."""
    return tl.load(signal_W + q).to(tl.pointer_type(tl.int64)) + _CALL_WORD


@triton.jit
def _differs(peer_call, own_call):
    """1 when the peer has announced a call with our sequence number but different arguments.

    The peer's tag is read with acquire, so the numel and chunk words it wrote before it are current.
    A tag with another sequence number is the peer's previous call (it has not reached this one yet).
    """
    mine = tl.load(own_call)
    tag = tl.atomic_add(peer_call, mine * 0, sem="acquire", scope="sys")
    same_seq = (tag >> _SEQ_SHIFT) == (mine >> _SEQ_SHIFT)
    other = (tl.load(peer_call + 1, volatile=True) != tl.load(own_call + 1)) | (
        tl.load(peer_call + 2, volatile=True) != tl.load(own_call + 2)
    )
    return (same_seq & ((tag != mine) | other)).to(tl.int32)


@triton.jit
def _spin_cas(
    ptr,
    expect,
    new,
    start_ns,
    timeout_ns,
    abort_ptr,
    peer_call,
    own_call,
    ACQUIRE: tl.constexpr,
    USE_CLOCK: tl.constexpr,
):
    """CAS ``*ptr`` from expect to new, retrying until it succeeds or the wait must end.

    Returns 1 on success, 0 when the wait budget is spent, 2 when the peer being waited for announced
    this call with other arguments (it may never arrive: e.g. it runs fewer programs than this rank).
    """
    if ACQUIRE:
        done = (tl.atomic_cas(ptr, expect, new, sem="acquire", scope="sys") == expect).to(tl.int32)
    else:
        done = (tl.atomic_cas(ptr, expect, new, sem="release", scope="sys") == expect).to(tl.int32)
    expired = done * 0
    differ = done * 0
    spins = done * 0
    while (done == 0) & (expired == 0) & (differ == 0):
        if ACQUIRE:
            done = (tl.atomic_cas(ptr, expect, new, sem="acquire", scope="sys") == expect).to(tl.int32)
        else:
            done = (tl.atomic_cas(ptr, expect, new, sem="release", scope="sys") == expect).to(tl.int32)
        expired = _expired(start_ns, timeout_ns, abort_ptr, USE_CLOCK)
        spins += 1
        if spins % 16 == 0:  # the peer's call is remote memory and a mismatch is rare: look now and then
            differ = _differs(peer_call, own_call)
    return tl.where(done != 0, 1, 2 * differ)


@triton.jit
def _record(status_ptr, signal_W, rank, world, q, result):
    """Record why waiting on rank q failed: ``status[q] = 1`` when it never arrived; ``status[world + q]
    = 1`` when it announced a different call, which is copied into this rank's SEEN table for the host."""
    if result == 0:
        tl.store(status_ptr + q, 1)
    if result == 2:
        tl.store(status_ptr + world + q, 1)
        peer_call = _call_words(signal_W, q)
        seen = _call_words(signal_W, rank) - _CALL_WORD + _SEEN_WORD + _i64(q) * 3
        for w in tl.static_range(3):
            tl.store(seen + w, tl.load(peer_call + w, volatile=True))


@triton.jit
def _failed_before(status_ptr, world):
    """1 when this heap has recorded a failed call (a missing peer or a mismatch) on this rank."""
    lanes = tl.arange(0, 2 * _MAX_WORLD)
    seen = tl.load(status_ptr + lanes, mask=lanes < 2 * world, other=0)
    return (tl.max(seen, axis=0) != 0).to(tl.int32)


@triton.jit
def _enter(signal_W, status_ptr, rank, world, call_tag, call_numel, call_chunk, SIMULATED: tl.constexpr):
    """Start of every collective: 1 when it may run, after announcing the call to the peers.

    0 when an earlier call on this heap failed (the status words are sticky until the host builds a new
    heap): the kernel then does nothing, which keeps calls already queued on CUDA from waiting on peers
    that gave up. The announcement (tag, numel, chunk; the tag last, with release) is what the peers
    compare with their own call after the first barrier, and while they wait for this rank.
    """
    ok = 1 - _failed_before(status_ptr, world)
    if not SIMULATED:
        if (ok != 0) & (call_tag != 0):
            own = _call_words(signal_W, rank)
            tl.atomic_xchg(own + 1, call_numel, sem="relaxed", scope="sys")
            tl.atomic_xchg(own + 2, call_chunk, sem="relaxed", scope="sys")
            tl.atomic_xchg(own, call_tag, sem="release", scope="sys")
    return ok


@triton.jit
def _verify(signal_W, status_ptr, rank, world, entered, ok, SIMULATED: tl.constexpr):
    """After the first barrier: every peer's announced call must equal ours; returns ``ok`` cleared if
    one differs (recorded in ``status[world + q]`` and the SEEN table).

    Runs unless the call did not start (``entered`` 0) or a peer timed out. Every peer then either
    arrived at the barrier (its announcement is visible) or was seen announcing this call with other
    arguments, so each rank names exactly the peers whose call differs from its own, and all ranks of
    a mismatched call skip the rest of the kernel together. The sequence number is part of the tag, so
    ranks whose earlier symmetric calls differ in number are caught too (a rank that made one extra
    call identical to the next one cannot be told apart from it: that ends in a timeout).
    """
    if not SIMULATED:
        if (entered != 0) & (_missing(status_ptr, world) == 0):
            own = _call_words(signal_W, rank)
            for q in range(0, world):
                peer = _call_words(signal_W, q)
                same = tl.load(peer, volatile=True) == tl.load(own)
                same = same & (tl.load(peer + 1, volatile=True) == tl.load(own + 1))
                same = same & (tl.load(peer + 2, volatile=True) == tl.load(own + 2))
                if same == 0:
                    _record(status_ptr, signal_W, rank, world, q, 2)
                    ok = ok * 0
    return ok


@triton.jit
def _missing(status_ptr, world):
    """1 when this rank has recorded a peer that never arrived."""
    lanes = tl.arange(0, _MAX_WORLD)
    seen = tl.load(status_ptr + lanes, mask=lanes < world, other=0)
    return (tl.max(seen, axis=0) != 0).to(tl.int32)


@triton.jit
def _barrier(
    signal_W,
    status_ptr,
    rank,
    world,
    pid,
    ok,
    start_ns,
    timeout_ns,
    USE_CLOCK: tl.constexpr,
    SIMULATED: tl.constexpr,
):
    """Barrier of program ``pid`` across all ranks; returns ``ok`` cleared if a peer never arrived or
    announced a different call.

    A peer seen announcing a different call is not waited for again, but the others still are: so that
    every peer has either arrived or announced when :func:`_verify` compares the calls.
    """
    if not SIMULATED:
        own_pad = tl.load(signal_W + rank).to(tl.pointer_type(tl.int32))
        abort_ptr = own_pad + _ABORT_WORD
        own_call = _call_words(signal_W, rank)
        # Once another program of this rank has recorded a failure, give up without waiting or
        # recording: under the interpreter programs run one after another, and a later program would
        # otherwise find the abort word set and blame live peers that are still in an earlier program.
        if _failed_before(status_ptr, world) != 0:
            ok = ok * 0
        timely = ok
        agree = ok
        if timely != 0:
            for q in range(0, world):
                pad = tl.load(signal_W + q).to(tl.pointer_type(tl.int32))
                r = _spin_cas(
                    pad + pid * _MAX_WORLD + rank,
                    0,
                    1,
                    start_ns,
                    timeout_ns,
                    abort_ptr,
                    _call_words(signal_W, q),
                    own_call,
                    False,
                    USE_CLOCK,
                )
                _record(status_ptr, signal_W, rank, world, q, r)
                timely = timely & (r != 0).to(tl.int32)
                agree = agree & (r != 2).to(tl.int32)
        if timely != 0:
            for q in range(0, world):
                r = _spin_cas(
                    own_pad + pid * _MAX_WORLD + q,
                    1,
                    0,
                    start_ns,
                    timeout_ns,
                    abort_ptr,
                    _call_words(signal_W, q),
                    own_call,
                    True,
                    USE_CLOCK,
                )
                _record(status_ptr, signal_W, rank, world, q, r)
                timely = timely & (r != 0).to(tl.int32)
                agree = agree & (r != 2).to(tl.int32)
        ok = timely & agree
    return ok


@triton.jit
def _reduce_peers(data_W, world, base, offs, mask, OP: tl.constexpr, ACC: tl.constexpr, DTYPE: tl.constexpr):
    """Reduce element ``base + offs`` of every rank's data region; returns the ACC-typed result."""
    peer = tl.load(data_W + 0).to(tl.pointer_type(DTYPE))
    acc = tl.load(peer + base + offs, mask=mask, other=0).to(ACC)
    for q in range(1, world):
        peer = tl.load(data_W + q).to(tl.pointer_type(DTYPE))
        v = tl.load(peer + base + offs, mask=mask, other=0).to(ACC)
        if OP == 2:
            acc = tl.maximum(acc, v)
        elif OP == 3:
            acc = tl.minimum(acc, v)
        else:
            acc += v
    if OP == 1:
        acc = acc / world
    return acc


@triton.jit
def _start(USE_CLOCK: tl.constexpr):
    return _now(tl.full((), 0, tl.int64), USE_CLOCK)


@triton.jit
def _copy_in(src_ptr, dst_ptr, src_base, dst_base, n, pid, P, BLOCK: tl.constexpr):
    """dst[dst_base + i] = src[src_base + i] for i < n, tiles ``pid, pid + P, ...`` of this program."""
    offs = tl.arange(0, BLOCK)
    for t in range(pid, tl.cdiv(n, BLOCK), P):
        i = _i64(t) * BLOCK + offs
        m = i < n
        tl.store(dst_ptr + dst_base + i, tl.load(src_ptr + src_base + i, mask=m), mask=m)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _all_reduce_one_shot_kernel(
    in_ptr,
    out_ptr,
    data_W,
    signal_W,
    status_ptr,
    rank,
    world,
    n,
    timeout_ns,
    OP: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    SIMULATED: tl.constexpr = False,
    call_tag=0,
    call_numel=0,
    call_chunk=0,
):
    """out[:n] = reduce over ranks of in[:n]. in/out: this rank's [n] tensors (out may alias in)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    start_ns = _start(USE_CLOCK)
    entered = _enter(signal_W, status_ptr, rank, world, call_tag, call_numel, call_chunk, SIMULATED)
    DTYPE = in_ptr.dtype.element_ty
    own = tl.load(data_W + rank).to(tl.pointer_type(DTYPE))
    if entered != 0:  # after a failed call the staging buffer is left alone too
        _copy_in(in_ptr, own, 0, 0, n, pid, P, BLOCK)
    ok = _barrier(signal_W, status_ptr, rank, world, pid, entered, start_ns, timeout_ns, USE_CLOCK, SIMULATED)
    ok = _verify(signal_W, status_ptr, rank, world, entered, ok, SIMULATED)
    if ok != 0:
        offs = tl.arange(0, BLOCK)
        for t in range(pid, tl.cdiv(n, BLOCK), P):
            i = _i64(t) * BLOCK + offs
            m = i < n
            acc = _reduce_peers(data_W, world, 0, i, m, OP, ACC, DTYPE)
            tl.store(out_ptr + i, acc.to(DTYPE), mask=m)
    _barrier(signal_W, status_ptr, rank, world, pid, ok, start_ns, timeout_ns, USE_CLOCK, SIMULATED)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _all_reduce_two_shot_kernel(
    in_ptr,
    out_ptr,
    data_W,
    signal_W,
    status_ptr,
    rank,
    world,
    n,
    slice_n,
    timeout_ns,
    OP: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    SIMULATED: tl.constexpr = False,
    call_tag=0,
    call_numel=0,
    call_chunk=0,
):
    """Reduce-scatter then all-gather. Slice q = elements [q * slice_n, min((q + 1) * slice_n, n))."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    start_ns = _start(USE_CLOCK)
    entered = _enter(signal_W, status_ptr, rank, world, call_tag, call_numel, call_chunk, SIMULATED)
    DTYPE = in_ptr.dtype.element_ty
    own = tl.load(data_W + rank).to(tl.pointer_type(DTYPE))
    if entered != 0:  # after a failed call the staging buffer is left alone too
        for q in range(0, world):
            base = _i64(q) * slice_n
            _copy_in(in_ptr, own, base, base, tl.minimum(slice_n, n - base), pid, P, BLOCK)
    ok = _barrier(signal_W, status_ptr, rank, world, pid, entered, start_ns, timeout_ns, USE_CLOCK, SIMULATED)
    ok = _verify(signal_W, status_ptr, rank, world, entered, ok, SIMULATED)
    offs = tl.arange(0, BLOCK)
    if ok != 0:
        base = _i64(rank) * slice_n
        len_r = tl.minimum(slice_n, n - base)
        for t in range(pid, tl.cdiv(len_r, BLOCK), P):
            i = _i64(t) * BLOCK + offs
            m = i < len_r
            acc = _reduce_peers(data_W, world, base, i, m, OP, ACC, DTYPE)
            tl.store(own + base + i, acc.to(DTYPE), mask=m)
    ok = _barrier(signal_W, status_ptr, rank, world, pid, ok, start_ns, timeout_ns, USE_CLOCK, SIMULATED)
    if ok != 0:
        for q in range(0, world):
            peer = tl.load(data_W + q).to(tl.pointer_type(DTYPE))
            base = _i64(q) * slice_n
            _copy_in(peer, out_ptr, base, base, tl.minimum(slice_n, n - base), pid, P, BLOCK)
    _barrier(signal_W, status_ptr, rank, world, pid, ok, start_ns, timeout_ns, USE_CLOCK, SIMULATED)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _all_gather_kernel(
    in_ptr,
    out_ptr,
    data_W,
    signal_W,
    status_ptr,
    rank,
    world,
    n,
    out_stride,
    timeout_ns,
    BLOCK: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    SIMULATED: tl.constexpr = False,
    call_tag=0,
    call_numel=0,
    call_chunk=0,
):
    """out[q * out_stride + i] = (input of rank q)[i] for i < n; input [n], output [world, out_stride]."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    start_ns = _start(USE_CLOCK)
    entered = _enter(signal_W, status_ptr, rank, world, call_tag, call_numel, call_chunk, SIMULATED)
    DTYPE = in_ptr.dtype.element_ty
    own = tl.load(data_W + rank).to(tl.pointer_type(DTYPE))
    if entered != 0:  # after a failed call the staging buffer is left alone too
        _copy_in(in_ptr, own, 0, 0, n, pid, P, BLOCK)
    ok = _barrier(signal_W, status_ptr, rank, world, pid, entered, start_ns, timeout_ns, USE_CLOCK, SIMULATED)
    ok = _verify(signal_W, status_ptr, rank, world, entered, ok, SIMULATED)
    if ok != 0:
        for q in range(0, world):
            peer = tl.load(data_W + q).to(tl.pointer_type(DTYPE))
            _copy_in(peer, out_ptr, 0, _i64(q) * out_stride, n, pid, P, BLOCK)
    _barrier(signal_W, status_ptr, rank, world, pid, ok, start_ns, timeout_ns, USE_CLOCK, SIMULATED)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _reduce_scatter_kernel(
    in_ptr,
    out_ptr,
    data_W,
    signal_W,
    status_ptr,
    rank,
    world,
    n,
    in_stride,
    timeout_ns,
    OP: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    SIMULATED: tl.constexpr = False,
    call_tag=0,
    call_numel=0,
    call_chunk=0,
):
    """out[i] = reduce over ranks q' of (in of q')[rank * in_stride + i], i < n; staging is [world, n]."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    start_ns = _start(USE_CLOCK)
    entered = _enter(signal_W, status_ptr, rank, world, call_tag, call_numel, call_chunk, SIMULATED)
    DTYPE = in_ptr.dtype.element_ty
    own = tl.load(data_W + rank).to(tl.pointer_type(DTYPE))
    if entered != 0:  # after a failed call the staging buffer is left alone too
        for q in range(0, world):
            _copy_in(in_ptr, own, _i64(q) * in_stride, _i64(q) * n, n, pid, P, BLOCK)
    ok = _barrier(signal_W, status_ptr, rank, world, pid, entered, start_ns, timeout_ns, USE_CLOCK, SIMULATED)
    ok = _verify(signal_W, status_ptr, rank, world, entered, ok, SIMULATED)
    if ok != 0:
        offs = tl.arange(0, BLOCK)
        base = _i64(rank) * n
        for t in range(pid, tl.cdiv(n, BLOCK), P):
            i = _i64(t) * BLOCK + offs
            m = i < n
            acc = _reduce_peers(data_W, world, base, i, m, OP, ACC, DTYPE)
            tl.store(out_ptr + i, acc.to(DTYPE), mask=m)
    _barrier(signal_W, status_ptr, rank, world, pid, ok, start_ns, timeout_ns, USE_CLOCK, SIMULATED)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _all_to_all_kernel(
    in_ptr,
    out_ptr,
    in_off_W,
    in_len_W,
    out_off_W,
    out_len_W,
    data_W,
    signal_W,
    status_ptr,
    rank,
    world,
    slot,
    timeout_ns,
    BLOCK: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    SIMULATED: tl.constexpr = False,
    call_tag=0,
    call_numel=0,
    call_chunk=0,
):
    """One round of an uneven all-to-all with ``slot`` staging elements per destination.

    in_off_W/in_len_W (int64 [world]): this round's window of the input bound for each rank;
    out_off_W/out_len_W: where the window received from each rank goes in the output. Rank q's window
    for this rank sits at ``rank * slot`` of q's data region.
    """
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    start_ns = _start(USE_CLOCK)
    entered = _enter(signal_W, status_ptr, rank, world, call_tag, call_numel, call_chunk, SIMULATED)
    DTYPE = in_ptr.dtype.element_ty
    own = tl.load(data_W + rank).to(tl.pointer_type(DTYPE))
    if entered != 0:  # after a failed call the staging buffer is left alone too
        for d in range(0, world):
            _copy_in(in_ptr, own, tl.load(in_off_W + d), _i64(d) * slot, tl.load(in_len_W + d), pid, P, BLOCK)
    ok = _barrier(signal_W, status_ptr, rank, world, pid, entered, start_ns, timeout_ns, USE_CLOCK, SIMULATED)
    ok = _verify(signal_W, status_ptr, rank, world, entered, ok, SIMULATED)
    if ok != 0:
        for q in range(0, world):
            peer = tl.load(data_W + q).to(tl.pointer_type(DTYPE))
            _copy_in(
                peer,
                out_ptr,
                _i64(rank) * slot,
                tl.load(out_off_W + q),
                tl.load(out_len_W + q),
                pid,
                P,
                BLOCK,
            )
    _barrier(signal_W, status_ptr, rank, world, pid, ok, start_ns, timeout_ns, USE_CLOCK, SIMULATED)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _signal_kernel(
    data_W,
    signal_W,
    status_ptr,
    rank,
    world,
    timeout_ns,
    BLOCK: tl.constexpr,
    USE_CLOCK: tl.constexpr,
    SIMULATED: tl.constexpr = False,
    call_tag=0,
    call_numel=0,
    call_chunk=0,
):
    """One program: announce the call, barrier with every rank's program 0, compare the calls, barrier.

    Moves no data: the copy-engine collectives (``smptk.comm``, ``algorithm="copy_engine"``) put one of
    these between their stream-ordered tensor copies, so a rank reads a peer's region only after the
    peer staged it, and restages only after every peer has read. The closing barrier keeps this call's
    announcement in place until every rank has compared it (a fast rank's next call would overwrite
    it), as the data kernels' closing barriers do. data_W and BLOCK are unused (the one launch path
    passes them to every collective kernel).
    """
    start_ns = _start(USE_CLOCK)
    entered = _enter(signal_W, status_ptr, rank, world, call_tag, call_numel, call_chunk, SIMULATED)
    pid = tl.program_id(0)
    ok = _barrier(signal_W, status_ptr, rank, world, pid, entered, start_ns, timeout_ns, USE_CLOCK, SIMULATED)
    ok = _verify(signal_W, status_ptr, rank, world, entered, ok, SIMULATED)
    _barrier(signal_W, status_ptr, rank, world, pid, ok, start_ns, timeout_ns, USE_CLOCK, SIMULATED)
