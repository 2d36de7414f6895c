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

Reductions accumulate in fp32 for fp16/bf16/fp32 and in int32 for int32. Ops (``heap_layout.OPS``): 0 sum,
1 avg, 2 max, 3 min.

Data path (``_copy``, ``_reduce_range``). Every copy and reduction covers a range of n elements in tiles of
2 * BLOCK bytes, tile t of the range being program t % P's, on every path: which path a rank takes never
changes which program wrote what the next phase reads. Each range picks its path at run time, in one uniform
branch: the vector path when every address it adds element offsets to is 16-byte aligned (the tensor
arguments, which Triton's launcher then specializes as aligned, and the data regions) and every base offset
is a whole number of 16 bytes (``VEC = 16 / element size`` elements). There every whole tile moves with
unmasked accesses that the compiler can prove aligned and contiguous, so sm_90 gets 128-bit loads and stores
(``ld.global.v4.b32``; a copy keeps one 32 KiB tile in flight per program, a reduction over W ranks a 4 KiB
piece of each, or of 8 ranks' worth for W = 2 and 4), and only the partial last tile is masked. Otherwise
every tile is masked, which compiles to the scalar accesses of any address Triton knows nothing about. The
only alignment stated with ``tl.multiple_of`` is that of the data regions (``_region``), true on every
path; the offsets' alignment is visible to the compiler from how the vector path rebuilds them
(``_vec_offset``). Reductions combine the ranks in rank order on both paths, so ranks that took different
paths hold bitwise-equal results.

Alignment guarantees: both heaps place every data region on a 4 KiB boundary (``smptk.comm.heap``:
4 KiB-aligned segments, ``DATA_OFFSET`` a multiple of 4096; the simulated world: ``_REGION_ALIGN``), and
``heap_bytes`` is a multiple of 16, so chunk boundaries (``heap_bytes / element size`` elements) keep a
tensor's alignment. Offsets inside a region are the host's (``smptk.comm.collectives``), which makes them
whole 16-byte vectors where it can: the two-shot ``slice_n`` is ``ceil(n / W)`` rounded up to a multiple of
VEC, so every slice ``q * slice_n`` starts aligned at any world size (the last ones may be short or empty);
the all-to-all ``slot`` (about ``heap_bytes / W`` bytes) and the reduce-scatter chunk are rounded down to a
multiple of VEC. The reduce-scatter blocks ``q * n`` are aligned when the chunk n is a multiple of VEC
(every chunk but a message's last), the all-to-all split offsets when the splits are. A range whose
offsets are not (an odd last reduce-scatter chunk, an odd split) takes the scalar path.

TMA copies (``TMA`` constexpr, the host's ``copy_path="tma"``; sm_90+ and the interpreter): on the vector
path a copy loads its whole rows through a tensor descriptor in a loop Triton pipelines over shared memory
(:func:`_copy_rows_tma`), so a program has several tiles in flight instead of one, and a reduction over 2,
4 or 8 ranks loads each rank's pieces so (:func:`_reduce_tiles_tma`, same pieces and order); both store
with the same 128-bit stores, and the rest goes masked as above. Tiles and their owners are the same on
both paths. Before TMA reads of the peers' regions a kernel issues ``fence.proxy.async.global``: TMA
reads go through the async proxy, which the barrier's release / acquire (generic proxy) does not order by
itself.

``SIMULATED=True`` skips every barrier: one rank's kernel moves data through W buffers that all live in
one device's memory, with no peer to wait for. Only the benchmarks' single-GPU "simulated world" uses it;
its numbers are labeled as such and are not multi-GPU measurements.

Worked example, one-shot all-reduce (sum), W=2, n=3: rank 0 holds [1, 2, 3], rank 1 [10, 20, 30].
Phase 0 copies each input into its own data region; barrier; phase 1 has each rank read both regions
and write [11, 22, 33] into its output; a closing barrier keeps the regions alive until both have read.
"""

from __future__ import annotations

from smptk.kernels._triton import tl, triton
from smptk.kernels.heap_layout import (
    ABORT_OFFSET,
    BLOCKS_OFFSET,
    CALL_OFFSET,
    MAX_WORLD,
    SEEN_OFFSET,
    SEQ_SHIFT,
)

# Heap layout constants as tl.constexpr: the Triton compiler rejects plain Python globals in kernels.
_MAX_WORLD = tl.constexpr(MAX_WORLD)
_ABORT_WORD = tl.constexpr(ABORT_OFFSET // 4)  # int32 index of the abort word from the pad's start
_CALL_WORD = tl.constexpr(CALL_OFFSET // 8)  # int64 index of this rank's announced call
_SEEN_WORD = tl.constexpr(SEEN_OFFSET // 8)  # int64 index of the table of peers' differing calls
_BLOCKS_WORD = tl.constexpr(BLOCKS_OFFSET // 8)  # int64 index of the GEMM + reduce-scatter's arrivals
_SEQ_SHIFT = tl.constexpr(SEQ_SHIFT)
# Integer arguments equal to 1 would otherwise become compile-time constants (rank 1, world 1, n 1...):
# one compiled kernel per rank and size class is wasteful, and constants have no ``.to``.
_NO_SPECIALIZE = [
    "rank", "world", "n", "slice_n", "out_stride", "in_stride", "slot", "timeout_ns",
    "call_tag", "call_numel", "call_chunk",
]  # fmt: skip
# Measured on one H100 (Triton 3.6) in the simulated world: W=8 regions in one GPU's HBM, SIMULATED=True,
# bf16, 8 MiB blocks, bytes read + written by one program (one SM), median of 12 launches. Against the
# scalar kernels this data path replaced (BLOCK=1024, 4 warps), with the values below: all_gather 7.8 ->
# 93.1 GB/s, all_to_all 9.2 -> 94.2, one-shot all-reduce 5.6 -> 59.1, reduce_scatter 6.2 -> 71.7,
# two-shot all-reduce 9.8 -> 81.2 (at 16 programs: 63-66 GB/s per SM for the copies, 42-46 for the
# one-shot and reduce-scatter reductions). One program keeps one tile (or one piece per rank) in flight at
# a time, so its rate is those bytes over the memory latency: 8192-element tiles at 4 warps gave 57.6 GB/s
# for all_gather, the reductions 15-32 with the ranks grouped under predicates (ptxas then interleaved
# their loads with the adds). NVLink's latency is longer than local HBM's: untuned there.
#
# Elements per tile, counted in 16-bit elements: a tile is 2 * BLOCK = 32 KiB in every dtype (32-bit types
# take 8192 elements), the unit of work the programs share (tile t of a range is program t % P's). A bulk
# copy moves a whole tile with one load and one store: eight 128-bit loads per thread at 8 warps.
BLOCK = 16384
BLOCK_INTERPRETER = 256  # fewer numpy round trips per tile under the interpreter; untuned
# Piece of a tile that a reduction, and every masked (tail or unaligned) access, works on at once, in
# 16-bit elements (4 KiB): one 128-bit load per thread per rank at 8 warps. A reduction over 2 or 4 ranks
# takes 4 or 2 pieces at once (the bytes in flight of 8 ranks). Half a tile when the tile is smaller (the
# interpreter), so the CPU tests run the loop over pieces.
SUB_BLOCK = 2048
# Ranks that a reduction over other than 2, 4 or 8 ranks loads before it combines them (each load
# predicated on the rank being in the world). Untuned.
PEERS = 8
_SUB_BLOCK = tl.constexpr(SUB_BLOCK)
_PEERS = tl.constexpr(PEERS)
# The TMA copy path (SMPTK_COMM_COPY_PATH=tma; :func:`_copy_rows_tma`): a tile is TILE / TMA_ROW rows of
# TMA_ROW elements (a TMA box side is at most 256 elements), loaded in a loop of TMA_STAGES pipeline stages.
# For this loop (the tile consumed in registers) Triton allocates TMA_STAGES - 1 shared-memory buffers:
# 3 x 32 KiB = 96 KiB a program (Triton 3.6 and 3.9, sm_90), so two programs still fit an SM (H100:
# 227 KiB), as the register budget below allows. Untuned: not yet measured on a GPU.
TMA_ROW = 256
TMA_STAGES = 4
_TMA_ROW = tl.constexpr(TMA_ROW)
_TMA_STAGES = tl.constexpr(TMA_STAGES)
# Launch options of every data-moving kernel (see :class:`_Launch`). 8 warps: 11-68% over 4 warps at one
# program (all_gather 84.0 -> 93.1 GB/s, one-shot 35.2 -> 59.1; bench above). maxnreg=128: without a cap,
# ptxas's occupancy heuristic spills long-lived values to stop at 80 registers (Triton 3.9, sm_90: 4-100
# bytes in 13 of the 63 compile-check variants); with it none spills (80-128 registers), and two 8-warp
# programs fit an SM, so max_sms up to MAX_PROGRAMS=256 stays resident on H100.
LAUNCH_OPTIONS = {"num_warps": 8, "maxnreg": 128}
# The signal kernel moves no data: one program of one warp does its barrier and check. At Triton's default
# 4 warps, Triton 3.6's code for it spilled 4 B on sm_80 (3.9's did not); at one warp neither does.
SIGNAL_LAUNCH_OPTIONS = {"num_warps": 1}


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
def _call_args(peer_call, zero):
    """The (numel, chunk) words of a peer's announced call, each read with acquire: every read after them
    (the tag's second read in :func:`_differs`) stays after them."""
    numel = tl.atomic_add(peer_call + 1, zero, sem="acquire", scope="sys")
    chunk = tl.atomic_add(peer_call + 2, zero, sem="acquire", scope="sys")
    return numel, chunk


@triton.jit
def _differs(peer_call, own_call):
    """1 when the peer has announced a call with our sequence number but different arguments.

    The peer's tag is read with acquire, so the numel and chunk words it wrote before it are current. A
    tag with another sequence number is the peer's previous call (it has not reached this one yet). A
    peer waited for in this call's last barrier can finish the call and announce its next one (numel and
    chunk, then the tag) between this rank's reads: its words are then the next call's, so they count
    only when the tag, read again after them, is unchanged (a seqlock read; the old check paired this
    call's tag with the next call's words and raised a false CommMismatchError).
    """
    mine = tl.load(own_call)
    tag = tl.atomic_add(peer_call, mine * 0, sem="acquire", scope="sys")
    numel, chunk = _call_args(peer_call, mine * 0)
    again = tl.atomic_add(peer_call, mine * 0, sem="acquire", scope="sys")
    same_seq = (tag >> _SEQ_SHIFT) == (mine >> _SEQ_SHIFT)
    other = (numel != tl.load(own_call + 1)) | (chunk != tl.load(own_call + 2))
    return (same_seq & ((tag != mine) | ((again == tag) & other))).to(tl.int32)


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
def _start(USE_CLOCK: tl.constexpr):
    return _now(tl.full((), 0, tl.int64), USE_CLOCK)


@triton.jit
def _aligned(p):
    """1 when the scalar pointer ``p`` is 16-byte aligned."""
    return ((p.to(tl.int64) % 16) == 0).to(tl.int32)


@triton.jit
def _region(data_W, q, DTYPE: tl.constexpr):
    """Rank q's data region as a ``DTYPE`` pointer, stated 16-byte aligned: both heaps place every region on a
    4 KiB boundary (see the module docstring), so the statement holds on every path."""
    return tl.multiple_of(tl.load(data_W + q).to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def _vec_offset(x, VEC: tl.constexpr):
    """``x`` rebuilt as ``(x // VEC) * VEC``: equal to ``x`` where the caller checked ``x % VEC == 0``, and
    visibly a multiple of VEC to the compiler (no hint that could reach another path)."""
    return _i64(x) // VEC * VEC


@triton.jit
def _first_tile(t0, pid, P):
    """The first tile index >= t0 that program ``pid`` of P owns (tile t is program t % P's)."""
    return t0 + (pid - t0 % P + P) % P


@triton.jit
def _async_proxy_fence(TMA: tl.constexpr):
    """TMA == 2 (compiled for a GPU): ``fence.proxy.async.global``, so the TMA loads (the async proxy) that
    follow see what the barrier before them made visible to ordinary loads (the generic proxy)."""
    if TMA == 2:
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _copy_rows_tma(s, d, rows, pid, P, BLOCK: tl.constexpr, TMA: tl.constexpr):
    """d[i] = s[i] for the whole ROW-element rows, i < rows * ROW (ROW = min(TMA_ROW, BLOCK)); tile t (rows
    [t * R, (t + 1) * R), R = BLOCK / ROW: the same elements as tile t of :func:`_copy`) is program t % P's.
    ``s`` and ``d`` are 16-byte aligned.

    Loads go through a tensor descriptor over ``s`` viewed as ``[rows, ROW]`` (a TMA box is at most 256
    elements a side, so a 32 KiB tile is R rows of one box row each), in a loop Triton software-pipelines
    over ``_TMA_STAGES - 1`` shared-memory buffers: while one tile goes out, the next ones are on their way
    in, so a program keeps up to ``_TMA_STAGES - 1`` tiles in flight instead of one, with no registers held
    for them.
    Stores are ordinary 128-bit stores (row-masked in the last tile), so they are ordered with the barrier's
    release as every other store of the kernels is.
    """
    ROW: tl.constexpr = min(_TMA_ROW, BLOCK)  # the interpreter's tiles are shorter than a TMA row
    R: tl.constexpr = BLOCK // ROW
    rows32 = _i64(rows).to(tl.int32)  # TMA coordinates are 32-bit: rows < 2^31 (n < 2^39 elements)
    desc = tl.make_tensor_descriptor(s, shape=[rows32, ROW], strides=[ROW, 1], block_shape=[R, ROW])
    r = tl.arange(0, R)
    c = tl.arange(0, ROW)
    for t in tl.range(pid, tl.cdiv(rows32, R), P, num_stages=_TMA_STAGES):
        x = desc.load([t * R, 0])
        row = _i64(t) * R + r
        tl.store(d + row[:, None] * ROW + c[None, :], x, mask=(row < rows)[:, None])


@triton.jit
def _copy(src, dst, src_base, dst_base, n, pid, P, BLOCK: tl.constexpr, TMA: tl.constexpr = 0):
    """dst[dst_base + i] = src[src_base + i] for i < n; tile t (elements [t * BLOCK, (t + 1) * BLOCK), BLOCK
    in this dtype's elements) is program t % P's on every path.

    ``src`` and ``dst`` are data regions (:func:`_region`) or the kernel's tensor arguments, which Triton's
    launcher specializes as 16-byte aligned exactly when they are. Vector path, when both are 16-byte
    aligned and both bases a whole number of 16 bytes (a uniform branch): every whole tile with one
    unmasked load and store of BLOCK elements, which the compiler can prove aligned and contiguous (128-bit
    accesses); with TMA (1: TMA loads; 2: the same compiled for a GPU, after an async-proxy fence), the
    whole ``_TMA_ROW``-element rows through :func:`_copy_rows_tma` instead. Then the rest masked. Else every
    tile masked, which compiles to scalar accesses. Masked tiles go in SUB-element pieces.
    """
    DTYPE = dst.dtype.element_ty
    VEC: tl.constexpr = 128 // DTYPE.primitive_bitwidth  # elements per 16 bytes
    SUB: tl.constexpr = min(BLOCK // 2, _SUB_BLOCK * 16 // DTYPE.primitive_bitwidth)
    full = n // BLOCK
    vector = _aligned(src) & _aligned(dst) & (_i64(src_base) % VEC == 0).to(tl.int32)
    vector = vector & (_i64(dst_base) % VEC == 0).to(tl.int32)
    done = _i64(0)  # elements [0, done) moved by the vector path: the rest go masked
    if vector != 0:
        s = src + _vec_offset(src_base, VEC)
        d = dst + _vec_offset(dst_base, VEC)
        if TMA != 0:
            ROW: tl.constexpr = min(_TMA_ROW, BLOCK)
            rows = n // ROW
            if rows > 0:
                _copy_rows_tma(s, d, rows, pid, P, BLOCK, TMA)
            done = _i64(rows) * ROW
        else:
            offs = tl.arange(0, BLOCK)
            for t in range(pid, full, P):
                i = _i64(t) * BLOCK + offs
                tl.store(d + i, tl.load(s + i))
            done = _i64(full) * BLOCK
    s = src + src_base
    d = dst + dst_base
    offs_sub = tl.arange(0, SUB)
    for t in range(_first_tile(done // BLOCK, pid, P), tl.cdiv(n, BLOCK), P):
        lo = tl.maximum(_i64(t) * BLOCK, done)  # the rows path can leave the start of its last tile done
        for c in range(0, tl.minimum(_i64(t) * BLOCK + BLOCK, n) - lo, SUB):
            i = lo + c + offs_sub
            m = i < n
            tl.store(d + i, tl.load(s + i, mask=m), mask=m)


@triton.jit
def _load_region(data_W, q, base, i, mask, DTYPE: tl.constexpr):
    """Elements ``base + i`` of rank q's data region (zeros where ``mask`` is off)."""
    return tl.load(_region(data_W, q, DTYPE) + base + i, mask=mask, other=0)


@triton.jit
def _combine(acc, v, OP: tl.constexpr):
    # max / min propagate NaN, as torch.amax does (a NaN on any rank is every rank's result: a max-reduced
    # overflow or NaN check must see it); ints ignore the flag
    if OP == 2:
        out = tl.maximum(acc, v, propagate_nan=tl.PropagateNan.ALL)
    elif OP == 3:
        out = tl.minimum(acc, v, propagate_nan=tl.PropagateNan.ALL)
    else:
        out = acc + v
    return out


@triton.jit
def _reduce_regions(
    data_W,
    world,
    base,
    i,
    mask,
    OP: tl.constexpr,
    ACC: tl.constexpr,
    DTYPE: tl.constexpr,
    GROUPED: tl.constexpr,
):
    """ACC-typed reduction of elements ``base + i`` over every rank's data region, in rank order 0..world-1.

    GROUPED (the vector path): peers 1.. come in groups of PEERS whose loads are all issued before the first
    is combined (a peer past the world is a load switched off and a combine discarded). Else (the masked
    path: a 64-bit address per element) one peer at a time, as few registers as possible. Both combine in
    the same order, so ranks that took different paths hold bitwise-equal results.
    """
    acc = _load_region(data_W, 0, base, i, mask, DTYPE).to(ACC)
    if GROUPED:
        for q0 in range(1, world, _PEERS):
            group = ()  # every load of the group first, in program order: all are in flight at once
            for j in tl.static_range(_PEERS):
                q = tl.minimum(q0 + j, world - 1)
                group = group + (_load_region(data_W, q, base, i, mask & (q0 + j < world), DTYPE),)  # noqa: RUF005
            for j in tl.static_range(_PEERS):
                acc = tl.where(q0 + j < world, _combine(acc, group[j].to(ACC), OP), acc)
    else:
        for q in range(1, world):
            acc = _combine(acc, _load_region(data_W, q, base, i, mask, DTYPE).to(ACC), OP)
    if OP == 1:
        acc = acc / world
    return acc


@triton.jit
def _combine_ranks(vals, WORLD: tl.constexpr, OP: tl.constexpr, ACC: tl.constexpr):
    """The ACC-typed reduction of the WORLD loaded pieces ``vals`` (a tuple), in rank order 0..WORLD-1."""
    acc = vals[0].to(ACC)
    for q in tl.static_range(1, WORLD):
        acc = _combine(acc, vals[q].to(ACC), OP)
    if OP == 1:
        acc = acc / WORLD
    return acc


@triton.jit
def _reduce_tiles_of(
    data_W,
    base,
    dst,
    full,
    pid,
    P,
    WORLD: tl.constexpr,
    OP: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
):
    """The whole tiles of a reduction over exactly WORLD ranks, vector path: dst[i] = reduce over q of (region
    of q)[base + i] for tiles ``pid, pid + P, ... < full``. The region pointers are loaded once; per piece,
    the WORLD loads are issued before the first combine and need no predicate (no peer is past the world).
    Same arithmetic, in the same order, as :func:`_reduce_regions`."""
    DTYPE = dst.dtype.element_ty
    PIECE: tl.constexpr = min(BLOCK, SUB * (8 // WORLD))  # as many bytes in flight as 8 ranks' pieces
    regions = ()
    for q in tl.static_range(WORLD):
        regions = regions + (_region(data_W, q, DTYPE) + base,)  # noqa: RUF005 (no * in Triton)
    offs = tl.arange(0, PIECE)
    for t in range(pid, full, P):
        for c in range(0, BLOCK, PIECE):
            i = _i64(t) * BLOCK + c + offs
            vals = ()
            for q in tl.static_range(WORLD):
                vals = vals + (tl.load(regions[q] + i),)  # noqa: RUF005
            tl.store(dst + i, _combine_ranks(vals, WORLD, OP, ACC).to(DTYPE))


@triton.jit
def _reduce_tiles_tma(
    data_W,
    base,
    dst,
    full,
    pid,
    P,
    WORLD: tl.constexpr,
    OP: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    TMA: tl.constexpr,
):
    """:func:`_reduce_tiles_of` with TMA loads: the same pieces, combined in the same order (so ranks on
    either path hold bitwise-equal results), each rank's piece loaded through a tensor descriptor over its
    region viewed as ``[rows, ROW]``. One flat loop over this program's pieces, which Triton pipelines over
    ``_TMA_STAGES - 1`` shared-memory buffers of WORLD pieces (32 KiB a stage in every dtype and world), so
    the next pieces of every rank are on their way in while one is combined and stored."""
    _async_proxy_fence(TMA)
    DTYPE = dst.dtype.element_ty
    PIECE: tl.constexpr = min(BLOCK, SUB * (8 // WORLD))
    ROW: tl.constexpr = min(_TMA_ROW, PIECE)
    R: tl.constexpr = PIECE // ROW  # rows of a piece
    PIECES: tl.constexpr = BLOCK // PIECE  # pieces of a tile
    ROWS_PER_TILE: tl.constexpr = BLOCK // ROW
    rows = (_i64(full) * ROWS_PER_TILE).to(tl.int32)  # TMA coordinates are 32-bit
    descs = ()
    for q in tl.static_range(WORLD):
        region = _region(data_W, q, DTYPE) + base
        desc = tl.make_tensor_descriptor(region, shape=[rows, ROW], strides=[ROW, 1], block_shape=[R, ROW])
        descs = descs + (desc,)  # noqa: RUF005 (no * in Triton)
    mine = tl.maximum(_i64(full) - pid + P - 1, 0) // P * PIECES  # pieces of tiles pid, pid + P, ... < full
    r = tl.arange(0, R)
    c = tl.arange(0, ROW)
    for k in tl.range(0, mine.to(tl.int32), num_stages=_TMA_STAGES):
        row0 = (pid + (k // PIECES) * P) * ROWS_PER_TILE + (k % PIECES) * R
        vals = ()
        for q in tl.static_range(WORLD):
            vals = vals + (descs[q].load([row0, 0]),)  # noqa: RUF005
        row = _i64(row0) + r
        tl.store(dst + row[:, None] * ROW + c[None, :], _combine_ranks(vals, WORLD, OP, ACC).to(DTYPE))


@triton.jit
def _reduce_range(
    data_W,
    world,
    base,
    dst,
    dst_base,
    n,
    pid,
    P,
    OP: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    TMA: tl.constexpr = 0,
):
    """dst[dst_base + i] = reduce over ranks q of (region of q)[base + i] for i < n; tile t is program t % P's
    (BLOCK in this dtype's elements).

    Vector path when ``dst`` is 16-byte aligned (the regions always are) and ``base`` and ``dst_base`` are
    whole numbers of 16 bytes: whole tiles unmasked, with a loop of its own for 2, 4 and 8 ranks (one
    node's usual groups: every load of a piece in flight, no predicates), PEERS-rank groups otherwise;
    then the partial last tile masked. Else every tile masked. All go in SUB-element pieces, so the loads
    of a piece fit in registers. With TMA (and 2, 4 or 8 ranks) the whole tiles load through descriptors
    instead (:func:`_reduce_tiles_tma`), in the same pieces and order.
    """
    DTYPE = dst.dtype.element_ty
    VEC: tl.constexpr = 128 // DTYPE.primitive_bitwidth  # elements per 16 bytes
    SUB: tl.constexpr = min(BLOCK // 2, _SUB_BLOCK * 16 // DTYPE.primitive_bitwidth)
    offs = tl.arange(0, SUB)
    full = n // BLOCK
    vector = _aligned(dst) & (_i64(base) % VEC == 0).to(tl.int32)
    vector = vector & (_i64(dst_base) % VEC == 0).to(tl.int32)
    if vector != 0:
        b = _vec_offset(base, VEC)
        d = dst + _vec_offset(dst_base, VEC)
        if TMA != 0 and (world == 8 or world == 4 or world == 2) and full > 0:
            if world == 8:
                _reduce_tiles_tma(data_W, b, d, full, pid, P, 8, OP, ACC, BLOCK, SUB, TMA)
            elif world == 4:
                _reduce_tiles_tma(data_W, b, d, full, pid, P, 4, OP, ACC, BLOCK, SUB, TMA)
            else:
                _reduce_tiles_tma(data_W, b, d, full, pid, P, 2, OP, ACC, BLOCK, SUB, TMA)
        elif world == 8:
            _reduce_tiles_of(data_W, b, d, full, pid, P, 8, OP, ACC, BLOCK, SUB)
        elif world == 4:
            _reduce_tiles_of(data_W, b, d, full, pid, P, 4, OP, ACC, BLOCK, SUB)
        elif world == 2:
            _reduce_tiles_of(data_W, b, d, full, pid, P, 2, OP, ACC, BLOCK, SUB)
        else:
            everywhere = tl.full((SUB,), 1, tl.int1)  # constant: the bulk loads need no element mask
            for t in range(pid, full, P):
                for c in range(0, BLOCK, SUB):
                    i = _i64(t) * BLOCK + c + offs
                    acc = _reduce_regions(data_W, world, b, i, everywhere, OP, ACC, DTYPE, True)
                    tl.store(d + i, acc.to(DTYPE))
    d = dst + dst_base
    for t in range(_first_tile(tl.where(vector != 0, full, 0), pid, P), tl.cdiv(n, BLOCK), P):
        lo = _i64(t) * BLOCK
        for c in range(0, tl.minimum(BLOCK, n - lo), SUB):
            i = lo + c + offs
            m = i < n
            acc = _reduce_regions(data_W, world, base, i, m, OP, ACC, DTYPE, False)
            tl.store(d + i, acc.to(DTYPE), mask=m)


class _Launch:
    """A collective kernel with the launch options it is built for: ``kernel[grid](...)`` adds
    :data:`LAUNCH_OPTIONS` (a caller's own ``num_warps`` / ``maxnreg`` win), so the launch paths in
    ``smptk.comm`` pass only arguments and constexprs. Anything else (``fn``, ``arg_names``...) is the
    kernel's; ``kernel`` is the ``@triton.jit`` function itself (the compile checks build it with
    ``launch_options``)."""

    def __init__(self, kernel, launch_options: dict):
        self.kernel = kernel
        self.launch_options = dict(launch_options)

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **{**self.launch_options, **kwargs})

    def __getattr__(self, name: str):
        if name in ("kernel", "launch_options"):  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.kernel, name)


def _launched_with(launch_options: dict):
    """Decorator: the kernel as a :class:`_Launch` with ``launch_options``."""
    return lambda kernel: _Launch(kernel, launch_options)


@_launched_with(LAUNCH_OPTIONS)
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
    TMA: tl.constexpr = 0,
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
    TILE: tl.constexpr = BLOCK * 16 // DTYPE.primitive_bitwidth  # 2 * BLOCK bytes in every dtype
    own = _region(data_W, rank, DTYPE)
    if entered != 0:  # after a failed call the staging buffer is left alone too
        _copy(in_ptr, own, 0, 0, n, pid, P, TILE, TMA)
    ok = _barrier(signal_W, status_ptr, rank, world, pid, entered, start_ns, timeout_ns, USE_CLOCK, SIMULATED)
    ok = _verify(signal_W, status_ptr, rank, world, entered, ok, SIMULATED)
    if ok != 0:
        _reduce_range(data_W, world, 0, out_ptr, 0, n, pid, P, OP, ACC, TILE, TMA)
    _barrier(signal_W, status_ptr, rank, world, pid, ok, start_ns, timeout_ns, USE_CLOCK, SIMULATED)


@_launched_with(LAUNCH_OPTIONS)
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
    TMA: tl.constexpr = 0,
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
    TILE: tl.constexpr = BLOCK * 16 // DTYPE.primitive_bitwidth  # 2 * BLOCK bytes in every dtype
    own = _region(data_W, rank, DTYPE)
    if entered != 0:  # after a failed call the staging buffer is left alone too
        for q in range(0, world):
            base = _i64(q) * slice_n
            _copy(in_ptr, own, base, base, tl.minimum(slice_n, n - base), pid, P, TILE, TMA)
    ok = _barrier(signal_W, status_ptr, rank, world, pid, entered, start_ns, timeout_ns, USE_CLOCK, SIMULATED)
    ok = _verify(signal_W, status_ptr, rank, world, entered, ok, SIMULATED)
    if ok != 0:
        base = _i64(rank) * slice_n
        _reduce_range(
            data_W, world, base, own, base, tl.minimum(slice_n, n - base), pid, P, OP, ACC, TILE, TMA
        )
    ok = _barrier(signal_W, status_ptr, rank, world, pid, ok, start_ns, timeout_ns, USE_CLOCK, SIMULATED)
    if ok != 0:
        _async_proxy_fence(TMA)
        for q in range(0, world):
            peer = _region(data_W, q, DTYPE)
            base = _i64(q) * slice_n
            _copy(peer, out_ptr, base, base, tl.minimum(slice_n, n - base), pid, P, TILE, TMA)
    _barrier(signal_W, status_ptr, rank, world, pid, ok, start_ns, timeout_ns, USE_CLOCK, SIMULATED)


@_launched_with(LAUNCH_OPTIONS)
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
    TMA: tl.constexpr = 0,
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
    TILE: tl.constexpr = BLOCK * 16 // DTYPE.primitive_bitwidth  # 2 * BLOCK bytes in every dtype
    own = _region(data_W, rank, DTYPE)
    if entered != 0:  # after a failed call the staging buffer is left alone too
        _copy(in_ptr, own, 0, 0, n, pid, P, TILE, TMA)
    ok = _barrier(signal_W, status_ptr, rank, world, pid, entered, start_ns, timeout_ns, USE_CLOCK, SIMULATED)
    ok = _verify(signal_W, status_ptr, rank, world, entered, ok, SIMULATED)
    if ok != 0:
        _async_proxy_fence(TMA)
        for q in range(0, world):
            peer = _region(data_W, q, DTYPE)
            _copy(peer, out_ptr, 0, _i64(q) * out_stride, n, pid, P, TILE, TMA)
    _barrier(signal_W, status_ptr, rank, world, pid, ok, start_ns, timeout_ns, USE_CLOCK, SIMULATED)


@_launched_with(LAUNCH_OPTIONS)
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
    TMA: tl.constexpr = 0,
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
    TILE: tl.constexpr = BLOCK * 16 // DTYPE.primitive_bitwidth  # 2 * BLOCK bytes in every dtype
    own = _region(data_W, rank, DTYPE)
    if entered != 0:  # after a failed call the staging buffer is left alone too
        for q in range(0, world):
            _copy(in_ptr, own, _i64(q) * in_stride, _i64(q) * n, n, pid, P, TILE, TMA)
    ok = _barrier(signal_W, status_ptr, rank, world, pid, entered, start_ns, timeout_ns, USE_CLOCK, SIMULATED)
    ok = _verify(signal_W, status_ptr, rank, world, entered, ok, SIMULATED)
    if ok != 0:
        _reduce_range(data_W, world, _i64(rank) * n, out_ptr, 0, n, pid, P, OP, ACC, TILE, TMA)
    _barrier(signal_W, status_ptr, rank, world, pid, ok, start_ns, timeout_ns, USE_CLOCK, SIMULATED)


@_launched_with(LAUNCH_OPTIONS)
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
    TMA: tl.constexpr = 0,
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
    TILE: tl.constexpr = BLOCK * 16 // DTYPE.primitive_bitwidth  # 2 * BLOCK bytes in every dtype
    own = _region(data_W, rank, DTYPE)
    if entered != 0:  # after a failed call the staging buffer is left alone too
        for d in range(0, world):
            _copy(
                in_ptr, own, tl.load(in_off_W + d), _i64(d) * slot, tl.load(in_len_W + d), pid, P, TILE, TMA
            )
    ok = _barrier(signal_W, status_ptr, rank, world, pid, entered, start_ns, timeout_ns, USE_CLOCK, SIMULATED)
    ok = _verify(signal_W, status_ptr, rank, world, entered, ok, SIMULATED)
    if ok != 0:
        _async_proxy_fence(TMA)
        for q in range(0, world):
            peer = _region(data_W, q, DTYPE)
            _copy(
                peer,
                out_ptr,
                _i64(rank) * slot,
                tl.load(out_off_W + q),
                tl.load(out_len_W + q),
                pid,
                P,
                TILE,
                TMA,
            )
    _barrier(signal_W, status_ptr, rank, world, pid, ok, start_ns, timeout_ns, USE_CLOCK, SIMULATED)


@_launched_with(SIGNAL_LAUNCH_OPTIONS)
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
