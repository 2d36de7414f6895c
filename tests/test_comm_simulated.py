"""smptk.comm.simulated: the single-GPU "simulated world" moves exactly the bytes one rank would move.

Every test pre-fills the peers' regions with small random integers, runs one rank's kernel, and compares
the output with what the kernels' code says rank r must produce from its input and those regions
(worked out in :func:`expected` below from the kernel bodies, written independently of
``smptk.comm.simulated``):

- one-shot all-reduce: ``reduce(x, R_q[:n] for q != r)``;
- two-shot all-reduce: slice r is ``reduce(x[slice r], R_q[slice r])``, slice q != r is ``R_q[slice q]``,
  with slices of ``ceil(n / W)`` rounded up to whole 16-byte vectors (:func:`two_shot_slice`);
- all-gather: block r is ``x``, block q != r is ``R_q[:n]``;
- reduce-scatter: ``reduce(x[block r], R_q[block r] for q != r)``;
- all-to-all: block r is ``x[block r]``, block q != r is ``R_q[block r]``.

Values are integers in [-50, 50], so every input is exact in every dtype and the fp32 (int32) accumulator
holds the exact sum; the kernels then round once to the dtype, and so does :func:`expected` (avg: exact
sum / W in fp32, rounded once; under the interpreter bf16 rounds toward zero, see :func:`_round`).
Equality is therefore exact, with no tolerance. Outputs start NaN-poisoned (int32: a sentinel outside
the value range), so an element the kernel never writes fails the comparison. After each launch the
test also checks that the peers' regions are untouched and that the running rank's own region holds
what it staged.

CPU cases run the kernels under Triton's interpreter (conftest sets TRITON_INTERPRET=1 where no GPU is
visible); the CUDA cases (``gpu`` marker) run the same checks on a GPU. Every test runs with each copy path
(``smptk.comm.configure(copy_path=...)``: "pointer", and "tma", whose copies load through TMA descriptors;
the interpreter runs descriptors, and on a GPU without TMA the pointer path runs).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import DEVICES, NO_INTERPRETER_REASON

from smptk import comm
from smptk.comm.simulated import KINDS, SimulatedWorld, world_mode_label
from smptk.kernels import runtime


@pytest.fixture(autouse=True, params=comm.COPY_PATHS)
def copy_path(request: pytest.FixtureRequest):
    """Each test once per copy path; the previous setting comes back afterwards."""
    before = comm.settings()["copy_path"]
    comm.configure(copy_path=request.param)
    try:
        yield request.param
    finally:
        comm.configure(copy_path=before)


REDUCING = ("all_reduce_one_shot", "all_reduce_two_shot", "reduce_scatter")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)
SENTINEL_INT = -(2**31) + 7  # never a value the integer data can produce
# CPU tests need the interpreter; on a GPU machine conftest leaves it off, and only the CUDA cases run.
needs_interpreter = pytest.mark.skipif(not runtime.interpreter_enabled(), reason=NO_INTERPRETER_REASON)


def _device(device: str) -> str:
    if device == "cpu" and not runtime.interpreter_enabled():
        pytest.skip(NO_INTERPRETER_REASON)
    return device


def _input_numel(kind: str, world: int, n: int) -> int:
    """Elements of rank r's input when each rank contributes n per block (all-reduce: n in total)."""
    return world * n if kind in ("reduce_scatter", "all_to_all") else n


def _round(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernels' final cast. Triton's interpreter rounds fp32 -> bf16 toward zero (seen with Triton 3.9:
    58/3 -> 19.25 where round-to-nearest gives 19.375); compiled kernels round to nearest even, as torch."""
    if dtype == torch.bfloat16 and acc.device.type == "cpu" and runtime.interpreter_enabled():
        bits = acc.to(torch.float32).view(torch.int32) & -65536  # keep sign, exponent, 7 mantissa bits
        return bits.view(torch.float32).to(dtype)  # now exact in bf16: the cast does not round
    return acc.to(dtype)


def _reduce(parts: list[torch.Tensor], op: str, world: int, dtype: torch.dtype) -> torch.Tensor:
    """Reduce over ranks in the kernels' accumulator (fp32, or int32 for int32), then round once."""
    acc_dtype = torch.int32 if dtype == torch.int32 else torch.float32
    stacked = torch.stack([p.to(acc_dtype) for p in parts])
    if op == "max":
        acc = stacked.amax(dim=0)
    elif op == "min":
        acc = stacked.amin(dim=0)
    else:
        acc = stacked.sum(dim=0, dtype=acc_dtype)
        if op == "avg":
            acc = acc / world
    return _round(acc, dtype)


def two_shot_slice(n: int, world: int, dtype: torch.dtype) -> int:
    """Elements per two-shot slice: ceil(n / W), rounded up to a multiple of 16 bytes of ``dtype``."""
    per_vector = 16 // torch.empty((), dtype=dtype).element_size()
    return math.ceil(math.ceil(n / world) / per_vector) * per_vector


def expected(
    kind: str, x: torch.Tensor, peers: dict[int, torch.Tensor], world: int, rank: int, op: str
) -> torch.Tensor:
    """Rank ``rank``'s output given its input ``x`` and the peers' regions ``peers[q]`` (flat, q != rank)."""

    def part(q: int, lo: int, hi: int) -> torch.Tensor:
        return x[lo:hi] if q == rank else peers[q][lo:hi]

    total = x.numel()
    if kind == "all_reduce_one_shot":
        return _reduce([part(q, 0, total) for q in range(world)], op, world, x.dtype)
    if kind == "all_reduce_two_shot":
        s = two_shot_slice(total, world, x.dtype)
        out = torch.empty_like(x)
        for q in range(world):
            lo, hi = q * s, min((q + 1) * s, total)
            if lo >= hi:
                continue
            if q == rank:
                out[lo:hi] = _reduce([part(p, lo, hi) for p in range(world)], op, world, x.dtype)
            else:
                out[lo:hi] = peers[q][lo:hi]
        return out
    if kind == "all_gather":
        return torch.cat([x if q == rank else peers[q][:total] for q in range(world)])
    n = total // world
    lo, hi = rank * n, (rank + 1) * n
    if kind == "reduce_scatter":
        return _reduce([x[lo:hi] if q == rank else peers[q][lo:hi] for q in range(world)], op, world, x.dtype)
    assert kind == "all_to_all"
    # Block q of the output came from rank q: its block for rank r, staged at r * n of its region.
    return torch.cat([x[lo:hi] if q == rank else peers[q][lo:hi] for q in range(world)])


def _ints(numel: int, dtype: torch.dtype, gen: torch.Generator, device: str) -> torch.Tensor:
    return torch.randint(-50, 51, (numel,), generator=gen, dtype=torch.int32).to(device=device, dtype=dtype)


def _poisoned(numel: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    fill = SENTINEL_INT if dtype == torch.int32 else float("nan")
    return torch.full((numel,), fill, dtype=dtype, device=device)


def run_and_check(
    kind: str,
    *,
    world: int,
    n: int,
    max_sms: int,
    dtype: torch.dtype,
    op: str = "sum",
    rank: int = 0,
    device: str = "cpu",
    seed: int = 0,
    offset: int = 0,
) -> None:
    """Fill the peers, run ``kind`` once as ``rank``; assert exact output, untouched peers, own staging.

    ``offset``: input and output are views that start ``offset`` elements into their buffers (1: every
    tensor address off 16-byte alignment, so the copies that touch them take the kernels' scalar path)."""
    gen = torch.Generator().manual_seed(seed)
    numel = _input_numel(kind, world, n)
    elem = torch.empty((), dtype=dtype).element_size()
    heap_bytes = -(-(numel * elem) // 16) * 16  # the smallest legal region: the message fills it
    sim = SimulatedWorld(world, heap_bytes, device, rank=rank)
    region_numel = heap_bytes // elem
    peers = {q: _ints(region_numel, dtype, gen, device) for q in range(world) if q != rank}
    sim.fill_peers(lambda q: peers[q])
    x = _ints(numel + offset, dtype, gen, device)[offset:]
    x_before = x.clone()
    out_numel = {"all_gather": world * numel, "reduce_scatter": n}.get(kind, numel)
    out = _poisoned(out_numel + offset, dtype, device)[offset:]

    returned = sim.run(kind, x, out, op=op, max_sms=max_sms)

    want = expected(kind, x_before, peers, world, rank, op)
    what = f"{kind} W={world} rank={rank} n={n} max_sms={max_sms} {dtype} {op} offset={offset}"
    assert returned.data_ptr() == out.data_ptr(), f"{what}: did not return the given output"
    assert torch.equal(out, want), (
        f"{what}: output differs at {(out != want).nonzero()[:8].flatten().tolist()}"
    )
    assert torch.equal(x, x_before), f"{what}: the input was modified"
    for q, region in peers.items():
        assert torch.equal(sim.peer_region(q, dtype, region_numel), region), (
            f"{what}: peer {q}'s region written"
        )
    own = sim.peer_region(rank, dtype, numel)
    if kind == "all_reduce_two_shot":  # staged input, then the reduction written over its own slice
        s = two_shot_slice(numel, world, dtype)
        lo, hi = rank * s, min((rank + 1) * s, numel)
        staged = x_before.clone()
        if lo < hi:
            staged[lo:hi] = want[lo:hi]
    else:
        staged = x_before  # equal splits: every kind stages its whole input in order
    assert torch.equal(own, staged), f"{what}: own region does not hold the staged input"
    assert int(sim.status.abs().sum()) == 0, f"{what}: a simulated kernel recorded a missing peer"
    launches = 2 if max_sms == 0 else 1  # the copy engine: its two signal kernels
    assert sim.calls == launches, f"{what}: {sim.calls} launches, expected {launches}"


# ----------------------------------------------------------------------------------- data movement
@needs_interpreter
@pytest.mark.parametrize("max_sms", (1, 3))
@pytest.mark.parametrize("n", (1, 7, 1000))
@pytest.mark.parametrize("world", (2, 3, 4))
@pytest.mark.parametrize("kind", KINDS)
def test_moves_the_right_bytes(kind: str, world: int, n: int, max_sms: int) -> None:
    run_and_check(kind, world=world, n=n, max_sms=max_sms, dtype=torch.float16, seed=world * 1000 + n)


OP_DTYPE = [
    pytest.param(op, dtype, id=f"{op}-{str(dtype).removeprefix('torch.')}")
    for op in ("sum", "avg", "max", "min")
    for dtype in DTYPES
    if not (op == "avg" and dtype == torch.int32)  # rejected; test_bad_arguments checks the error
]


@needs_interpreter
@pytest.mark.parametrize(("op", "dtype"), OP_DTYPE)
@pytest.mark.parametrize("kind", REDUCING)
def test_reduction_ops_and_dtypes(kind: str, op: str, dtype: torch.dtype) -> None:
    run_and_check(kind, world=3, n=257, max_sms=3, dtype=dtype, op=op, seed=7)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind", ("all_gather", "all_to_all"))
def test_copies_every_dtype(kind: str, dtype: torch.dtype) -> None:
    run_and_check(kind, world=3, n=7, max_sms=3, dtype=dtype, seed=11)


@needs_interpreter
@pytest.mark.parametrize("rank", (0, 2))
@pytest.mark.parametrize("n", (1, 7, 1000))
@pytest.mark.parametrize("kind", ("all_gather", "all_to_all"))
def test_copy_engine_moves_the_same_bytes(kind: str, n: int, rank: int) -> None:
    """max_sms=0 (tensor copies between the two signal kernels): the output and own region the kernel
    path gives."""
    run_and_check(kind, world=3, n=n, max_sms=0, dtype=torch.bfloat16, rank=rank, seed=n + rank)


@needs_interpreter
@pytest.mark.parametrize("rank", (1, 3))
@pytest.mark.parametrize("kind", KINDS)
def test_other_ranks(kind: str, rank: int) -> None:
    # n=5 int32 over 4 ranks: two-shot slices of 4 (one 16-byte vector), rank 1's has one element and
    # ranks 2 and 3 have none.
    run_and_check(kind, world=4, n=5, max_sms=3, dtype=torch.int32, rank=rank, op="max", seed=rank)


@needs_interpreter
def test_world_of_one_and_many_programs() -> None:
    run_and_check("all_reduce_one_shot", world=1, n=7, max_sms=1, dtype=torch.float32)
    run_and_check("all_reduce_two_shot", world=3, n=1000, max_sms=256, dtype=torch.float32)


@needs_interpreter
def test_in_place_all_reduce_and_reuse() -> None:
    """``out`` may alias the input; a second launch sees the new input, not the previous call's staging."""
    gen = torch.Generator().manual_seed(3)
    for algorithm in ("one_shot", "two_shot"):
        kind = f"all_reduce_{algorithm}"
        sim = SimulatedWorld(3, 4096, "cpu")
        peers = {q: _ints(1024, torch.float32, gen, "cpu") for q in (1, 2)}
        sim.fill_peers(lambda q, peers=peers: peers[q])
        for _ in range(2):
            x = _ints(1000, torch.float32, gen, "cpu")
            want = expected(kind, x.clone(), peers, 3, 0, "sum")
            got = sim.all_reduce(x, x, algorithm=algorithm, max_sms=3)
            assert got.data_ptr() == x.data_ptr() and torch.equal(x, want), kind


@needs_interpreter
def test_fill_peers_and_peer_region() -> None:
    sim = SimulatedWorld(3, 64, "cpu", rank=2)
    sim.fill_peers(lambda q: torch.full((4,), q + 1, dtype=torch.int32))
    assert sim.peer_region(0, torch.int32, 4).tolist() == [1, 1, 1, 1]
    assert sim.peer_region(1, torch.int32, 4).tolist() == [2, 2, 2, 2]
    assert sim.peer_region(2, torch.int32, 4).tolist() == [0, 0, 0, 0]  # own region: not filled
    assert sim.peer_region(1, torch.float16).numel() == 32  # default: the whole region
    addresses = sim.data_ptrs.tolist()
    assert [b - a for a, b in itertools.pairwise(addresses)] == [sim.region_stride] * 2
    assert all(a % 4096 == 0 for a in addresses + sim.signal_ptrs.tolist())
    assert sim.peer_region(1, torch.int32, 1).data_ptr() == addresses[1]


@needs_interpreter
def test_label_says_simulated_and_not_multi_gpu() -> None:
    label = world_mode_label(8, "cuda")
    assert label.startswith("simulated world: 8 peer buffers in one GPU's memory")
    assert "not a multi-GPU measurement" in label
    assert SimulatedWorld(2, 16, "cpu").label == world_mode_label(2, "cpu")


def test_io_numel_follows_nccl_tests_sizes() -> None:
    bf16 = torch.bfloat16
    assert SimulatedWorld.io_numel("all_reduce_one_shot", 8, 1 << 20, bf16) == (1 << 19, 1 << 19)
    assert SimulatedWorld.io_numel("all_gather", 8, 8 << 20, bf16) == (1 << 19, 1 << 22)
    assert SimulatedWorld.io_numel("reduce_scatter", 8, 8 << 20, bf16) == (1 << 22, 1 << 19)
    assert SimulatedWorld.io_numel("all_to_all", 3, 12, torch.float16) == (6, 6)
    with pytest.raises(ValueError, match="world=3 equal blocks"):
        SimulatedWorld.io_numel("all_gather", 3, 8, torch.float16)
    with pytest.raises(ValueError, match="whole number of 2-byte"):
        SimulatedWorld.io_numel("all_reduce_two_shot", 3, 7, torch.float16)


# ----------------------------------------------------------------------------------- vector and scalar paths
# Each copy and reduction of the kernels takes 128-bit accesses where its addresses are 16-byte aligned and
# its offsets whole multiples of 16 bytes, else a masked scalar path, with a masked last tile on both
# (smptk.kernels.collectives, "Data path"). The interpreter ignores the alignment hints but runs the same
# branches, so these cases drive both paths and their tails on CPU; the CUDA cases run the compiled 128-bit
# accesses. Sizes: 1 and 7 (a partial tile only), 8 (one 16-byte vector of 16-bit elements), 1000 and 4099
# (whole tiles of the interpreter's 256 elements and a tail; at W=3 the two-shot slices are 336 and 1368,
# ceil(n / 3) rounded up to 16 bytes, so every slice starts aligned, while rank 1's reduce-scatter block
# starts 4099 elements in and takes the scalar path), 4096 at W=2 and 2056 at W=8 (every offset aligned;
# the reductions' own loops for 2 and 8 ranks, and their TMA versions); on CUDA also 3 x 8192 + 5 (whole
# 8192-element tiles). offset=1: misaligned input and output tensors.
_PATH_SIZES = ((3, 1), (3, 7), (3, 8), (3, 1000), (2, 4096), (8, 2056), (3, 4099))
_CUDA_PATH_SIZES = ((3, 3 * 8192 + 5), (2, 4 * 8192))


def _path_cases() -> list:
    cases = []
    for device in ("cpu", "cuda"):
        marks = (pytest.mark.gpu,) if device == "cuda" else ()
        for world, n in _PATH_SIZES + (_CUDA_PATH_SIZES if device == "cuda" else ()):
            for offset in (0, 1):
                case_id = f"{device}-W{world}-n{n}-off{offset}"
                cases.append(pytest.param(device, world, n, offset, id=case_id, marks=marks))
    return cases


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=("bf16", "fp32"))
@pytest.mark.parametrize(("device", "world", "n", "offset"), _path_cases())
@pytest.mark.parametrize("kind", KINDS)
def test_vector_and_scalar_paths(
    kind: str, device, world: int, n: int, offset: int, dtype: torch.dtype
) -> None:
    dev = _device(device)
    if dev == "cuda" and runtime.interpreter_enabled():
        pytest.skip("TRITON_INTERPRET=1 is set, so the kernels cannot compile for the GPU in this process")
    op = "max" if dtype == torch.float32 else "sum"
    run_and_check(
        kind,
        world=world,
        n=n,
        max_sms=3,
        dtype=dtype,
        op=op,
        rank=1,
        device=dev,
        seed=n + offset,
        offset=offset,
    )


# ----------------------------------------------------------------------------------- bad input
@needs_interpreter
def test_bad_arguments() -> None:
    x = torch.zeros(8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"world: expected 1\.\.64"):
        SimulatedWorld(0, 64, "cpu")
    with pytest.raises(ValueError, match=r"world: expected 1\.\.64"):
        SimulatedWorld(65, 64, "cpu")
    with pytest.raises(ValueError, match=r"rank: expected 0\.\.1"):
        SimulatedWorld(2, 64, "cpu", rank=2)
    with pytest.raises(ValueError, match="heap_bytes: expected a positive multiple of 16"):
        SimulatedWorld(2, 100, "cpu")
    with pytest.raises(ValueError, match="device: expected 'cuda' or 'cpu'"):
        SimulatedWorld(2, 64, "meta")
    sim = SimulatedWorld(2, 16, "cpu")  # 16 bytes: 8 fp16 elements fit, 9 do not
    with pytest.raises(ValueError, match=r"18 bytes\) in a region, which holds heap_bytes=16"):
        sim.all_reduce(torch.zeros(9, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"heap_bytes >= 32"):
        sim.all_gather(torch.zeros(8, dtype=torch.float32))
    for bad in (0, 257, 1.5, True):
        with pytest.raises(ValueError, match="max_sms"):
            sim.all_reduce(x, max_sms=bad)
    for dtype in (torch.float64, torch.int64, torch.int8):
        with pytest.raises(TypeError, match="is not one the kernels have"):
            sim.all_gather(torch.zeros(2, dtype=dtype))
    with pytest.raises(ValueError, match="op: expected one of"):
        sim.all_reduce(x, op="prod")
    with pytest.raises(ValueError, match="'avg' is not supported for int32"):
        sim.reduce_scatter(torch.zeros(4, dtype=torch.int32), op="avg")
    with pytest.raises(ValueError, match="algorithm"):
        sim.all_reduce(x, algorithm="ring")
    with pytest.raises(ValueError, match="out: expected 16 elements for all_gather"):
        sim.all_gather(x, torch.empty(8, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"out: dtype torch\.float32 does not match"):
        sim.all_reduce(x, torch.empty(8))
    with pytest.raises(ValueError, match="input: must be contiguous"):
        sim.all_reduce(torch.zeros(4, 2, dtype=torch.float16).t())
    with pytest.raises(ValueError, match="multiple of world=2"):
        sim.reduce_scatter(torch.zeros(7, dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of world=2"):
        sim.all_to_all(torch.zeros(7, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"input: expected a torch\.Tensor"):
        sim.all_reduce([1.0, 2.0])
    with pytest.raises(ValueError, match="kind: expected one of"):
        sim.run("broadcast", x)
    with pytest.raises(ValueError, match=r"q: expected a rank in 0\.\.1"):
        sim.peer_region(2, torch.float16)
    with pytest.raises(ValueError, match="need 18 bytes"):
        sim.peer_region(1, torch.float16, 9)
    with pytest.raises(TypeError, match=r"values\(1\): expected a torch.Tensor"):
        sim.fill_peers(lambda q: [q])


# ----------------------------------------------------------------------------------- CUDA
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_same_checks_per_device(kind: str, device: str) -> None:
    """The CPU case repeats one check above; the CUDA case is the real kernels compiled with SIMULATED."""
    dev = _device(device)
    if dev == "cuda" and runtime.interpreter_enabled():
        pytest.skip("TRITON_INTERPRET=1 is set, so the kernels cannot compile for the GPU in this process")
    for dtype in (torch.bfloat16, torch.int32):
        run_and_check(kind, world=8, n=4099, max_sms=5, dtype=dtype, device=dev, op="sum", seed=5)
