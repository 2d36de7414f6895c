"""A single-GPU "simulated world": one rank's collective kernel run against W buffers in one device's memory.

What this is, plainly: **one rank's kernel, W buffers in one GPU's memory, no peer, no barrier waits;
all traffic is local HBM.** :class:`SimulatedWorld` allocates W "peer" data regions side by side in one
device's memory, builds the address tables the collective kernels of :mod:`smptk.kernels.collectives`
take (``data_W``, ``signal_W``, an int32 ``status [2W]``), and launches those real kernels as rank
``rank`` with exactly ``max_sms`` programs and ``SIMULATED=True``, which skips every barrier. Regions of
ranks q != rank hold whatever the caller put there (:meth:`SimulatedWorld.peer_region`,
:meth:`SimulatedWorld.fill_peers`): what peer q would have staged, or would have left there after its
own phases. Nothing else writes to them.

So the kernel reads and writes exactly the bytes it would on a real node, but the peers' bytes come from
the same GPU's HBM instead of over NVLink, nothing waits for a peer, and no other rank competes for the
memory system. Benchmarks built on it label their rows "simulated world" (:meth:`SimulatedWorld.label`);
the numbers say how fast one rank's kernel moves its bytes at a given SM budget, and they are **not**
multi-GPU measurements.

What rank r's output holds (Legend: W ranks, n elements, ``R_q`` the data region of rank q; r's own
region is overwritten by the kernel's staging phase, peers' regions are only read):

- one-shot all-reduce of ``x [n]``: ``out = reduce(x, R_q[:n] for q != r)``.
- two-shot all-reduce of ``x [n]`` with slices of ``s = ceil(n / W)``: slice r of ``out`` is
  ``reduce(x[slice r], R_q[slice r] for q != r)``; slice q != r is ``R_q[slice q]`` (on a real node, the
  reduction peer q wrote there).
- all-gather of ``x [n]`` into ``out [W * n]``: block r is ``x``, block q != r is ``R_q[:n]``.
- reduce-scatter of ``x [W * n]`` into ``out [n]``: ``reduce(x[r*n:(r+1)*n], R_q[r*n:(r+1)*n] for q != r)``.
- all-to-all (equal splits) of ``x [W * n]`` into ``out [W * n]``: block r is ``x[r*n:(r+1)*n]``, block
  q != r is ``R_q[r*n:(r+1)*n]`` (what peer q staged for rank r).

Reductions accumulate in fp32 (int32 for int32), in rank order 0..W-1, as on a real node.

Messages must fit in one region (no chunking here, unlike :mod:`smptk.comm.collectives`); every launch
is asynchronous on CUDA (no host sync inside a launch), so CUDA events can time it.

Example::

    >>> import torch
    >>> from smptk.comm.simulated import SimulatedWorld
    >>> sim = SimulatedWorld(world=8, heap_bytes=1 << 20, device="cuda")
    >>> sim.fill_peers(lambda q: torch.full((1000,), float(q), dtype=torch.bfloat16, device="cuda"))
    >>> x = torch.ones(1000, dtype=torch.bfloat16, device="cuda")
    >>> out = sim.all_reduce(x, max_sms=4)   # 1 + (1 + 2 + ... + 7) = 29 everywhere
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from smptk.kernels import runtime
from smptk.kernels.heap_layout import CONTROL_BYTES, MAX_PROGRAMS, MAX_WORLD, SIGNAL_BYTES

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32)
OPS = ("sum", "avg", "max", "min")
# Collective names as bench.counts.COLLECTIVES spells them; :meth:`SimulatedWorld.run` takes these.
KINDS = ("all_reduce_one_shot", "all_reduce_two_shot", "all_gather", "reduce_scatter", "all_to_all")
_REGION_ALIGN = 4096  # every region starts on a 4 KiB boundary, as the heaps' segments do
# The kernels take a wait budget, but SIMULATED=True never waits; any valid int64 value would do.
_TIMEOUT_NS = 60 * 10**9


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    return int(value)


def _check_max_sms(max_sms: object) -> int:
    p = _as_int("max_sms", max_sms)
    if not 1 <= p <= MAX_PROGRAMS:
        raise ValueError(f"max_sms: expected 1..{MAX_PROGRAMS}, got {max_sms}")
    return p


def _check_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise TypeError(f"{name}: dtype {dtype} is not one the kernels have ({names})")


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _check_op(op: object, dtype: torch.dtype) -> None:
    if op not in OPS:
        raise ValueError(f"op: expected one of {OPS}, got {op!r}")
    if op == "avg" and dtype == torch.int32:
        raise ValueError("op: 'avg' is not supported for int32 (the kernels' integer average would truncate)")


def world_mode_label(world: int, device: str | torch.device = "cuda") -> str:
    """The label every row measured in a simulated world carries.

    Example::

        >>> world_mode_label(8)
        "simulated world: 8 peer buffers in one GPU's memory, one rank's kernel timed; not a multi-GPU ..."
    """
    where = "one GPU's memory" if torch.device(device).type == "cuda" else "one CPU process's memory"
    return (
        f"simulated world: {world} peer buffers in {where}, one rank's kernel timed; "
        "not a multi-GPU measurement"
    )


class SimulatedWorld:
    """W peer data regions in one device's memory and launchers for the collective kernels on them.

    Args:
        world: ranks simulated, 1..64 (the heap's MAX_WORLD).
        heap_bytes: bytes of each rank's data region (the staging buffer); a message's input must fit.
        device: "cuda" (the kernels compile for the GPU), or "cpu" under ``TRITON_INTERPRET=1``.
        rank: the rank whose kernel runs, 0..world-1.

    Attributes: ``data_W`` / ``signal_W`` (int64 ``[world]`` addresses of each region and signal pad),
    ``status`` (int32 ``[2 * world]``; stays zero, since nothing waits), ``label`` (see
    :func:`world_mode_label`). Regions and pads start zeroed. Data types are chosen per call.

    Example::

        >>> sim = SimulatedWorld(world=4, heap_bytes=4096, device="cpu")   # needs TRITON_INTERPRET=1
        >>> sim.data_W.shape, sim.status.shape
        (torch.Size([4]), torch.Size([8]))
    """

    def __init__(self, world: int, heap_bytes: int, device: str | torch.device = "cuda", *, rank: int = 0):
        world = _as_int("world", world)
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world: expected 1..{MAX_WORLD} ranks, got {world}")
        rank = _as_int("rank", rank)
        if not 0 <= rank < world:
            raise ValueError(f"rank: expected 0..{world - 1} for world={world}, got {rank}")
        heap_bytes = _as_int("heap_bytes", heap_bytes)
        if heap_bytes < 16 or heap_bytes % 16:
            raise ValueError(f"heap_bytes: expected a positive multiple of 16, got {heap_bytes}")
        device = torch.device(device)
        if device.type == "cuda":
            if runtime.interpreter_enabled():
                raise RuntimeError(
                    "device: CUDA tensors need the compiled kernels, but TRITON_INTERPRET=1 is set"
                )
            if not torch.cuda.is_available():
                raise RuntimeError("device: 'cuda' asked for, but torch sees no CUDA device")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        elif device.type == "cpu":
            if not runtime.interpreter_enabled():
                raise RuntimeError(
                    "device: CPU tensors need Triton's interpreter; set TRITON_INTERPRET=1 before "
                    "smptk.kernels is imported"
                )
        else:
            raise ValueError(f"device: expected 'cuda' or 'cpu', got {device}")
        if not runtime.triton_available():
            raise RuntimeError("the simulated world runs Triton kernels, and triton is not installed")

        self.world, self.rank, self.heap_bytes, self.device = world, rank, heap_bytes, device
        self.region_stride = -(-heap_bytes // _REGION_ALIGN) * _REGION_ALIGN
        pad_bytes = -(-(SIGNAL_BYTES + CONTROL_BYTES) // _REGION_ALIGN) * _REGION_ALIGN
        # One allocation per kind, base rounded up to the alignment: the caching allocator's blocks are
        # 512-byte aligned, torch.zeros on a CPU 64-byte aligned.
        self._data = torch.zeros(world * self.region_stride + _REGION_ALIGN, dtype=torch.uint8, device=device)
        self._pads = torch.zeros(world * pad_bytes + _REGION_ALIGN, dtype=torch.uint8, device=device)
        self._data_base = (-self._data.data_ptr()) % _REGION_ALIGN
        pad_base = self._pads.data_ptr() + (-self._pads.data_ptr()) % _REGION_ALIGN
        data0 = self._data.data_ptr() + self._data_base
        self.data_W = torch.tensor(
            [data0 + q * self.region_stride for q in range(world)], dtype=torch.int64, device=device
        )
        self.signal_W = torch.tensor(
            [pad_base + q * pad_bytes for q in range(world)], dtype=torch.int64, device=device
        )
        self.status = torch.zeros(2 * world, dtype=torch.int32, device=device)
        self._a2a_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def label(self) -> str:
        """:func:`world_mode_label` for this world (put it in every row measured here).

        Example::

            >>> row["world_mode"] = sim.label
        """
        return world_mode_label(self.world, self.device)

    # ------------------------------------------------------------------------------------ peer regions
    def peer_region(self, q: int, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
        """Rank q's data region as a ``dtype`` tensor of ``numel`` elements (default: the whole region).

        A view: writing it stages data as peer q would have. Region ``self.rank`` is the running rank's
        own staging buffer, which every launch overwrites.

        Example::

            >>> sim.peer_region(1, torch.float16, 7).fill_(3.0)
        """
        q = _as_int("q", q)
        if not 0 <= q < self.world:
            raise ValueError(f"q: expected a rank in 0..{self.world - 1}, got {q}")
        _check_dtype("dtype", dtype)
        elem = torch.empty((), dtype=dtype).element_size()
        numel = self.heap_bytes // elem if numel is None else _as_int("numel", numel)
        if not 0 <= numel * elem <= self.heap_bytes:
            raise ValueError(
                f"numel: {numel} elements of {dtype} need {numel * elem} bytes, but a region holds "
                f"heap_bytes={self.heap_bytes}"
            )
        start = self._data_base + q * self.region_stride
        return self._data[start : start + numel * elem].view(dtype)

    def fill_peers(self, values: Callable[[int], torch.Tensor]) -> None:
        """For every rank q != ``self.rank``: copy ``values(q)`` (flattened) to the start of region q.

        Example::

            >>> sim.fill_peers(lambda q: torch.full((1000,), float(q), dtype=torch.bfloat16, device="cuda"))
        """
        for q in range(self.world):
            if q == self.rank:
                continue
            data = values(q)
            if not isinstance(data, torch.Tensor):
                raise TypeError(f"values({q}): expected a torch.Tensor, got {type(data).__name__}")
            self.peer_region(q, data.dtype, data.numel()).copy_(data.reshape(-1))

    # ------------------------------------------------------------------------------------ launches
    def _check_io(
        self, inp: torch.Tensor, out: torch.Tensor | None, out_numel: int, what: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_dtype("input", inp.dtype)
        if inp.device != self.device:
            raise ValueError(f"input: on {inp.device}, but the simulated world lives on {self.device}")
        if not inp.is_contiguous():
            raise ValueError(f"input: must be contiguous (got strides {inp.stride()})")
        nbytes = inp.numel() * inp.element_size()
        if nbytes > self.heap_bytes:
            raise ValueError(
                f"input: {what} stages all {inp.numel()} elements ({nbytes} bytes) in a region, which holds "
                f"heap_bytes={self.heap_bytes}; build the SimulatedWorld with heap_bytes >= {nbytes}"
            )
        if out is None:
            out = torch.empty(out_numel, dtype=inp.dtype, device=self.device)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
        if out.dtype != inp.dtype:
            raise TypeError(f"out: dtype {out.dtype} does not match input's {inp.dtype}")
        if out.device != self.device:
            raise ValueError(f"out: on {out.device}, but the simulated world lives on {self.device}")
        if not out.is_contiguous():
            raise ValueError(f"out: must be contiguous (got strides {out.stride()})")
        if out.numel() != out_numel:
            raise ValueError(f"out: expected {out_numel} elements for {what}, got {out.numel()}")
        return inp.view(-1), out.view(-1)

    def _launch(self, kernel, max_sms: int, *args, **meta) -> None:
        interpreted = runtime.interpreter_enabled()
        from smptk.kernels import collectives as K

        block = K.BLOCK_INTERPRETER if interpreted else K.BLOCK
        kernel[(max_sms,)](*args, _TIMEOUT_NS, BLOCK=block, USE_CLOCK=not interpreted, SIMULATED=True, **meta)

    def _common(self) -> tuple:
        return (self.data_W, self.signal_W, self.status, self.rank, self.world)

    @staticmethod
    def _acc(dtype: torch.dtype):
        from smptk.kernels._triton import tl

        return tl.int32 if dtype == torch.int32 else tl.float32

    def all_reduce(
        self,
        input: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        op: str = "sum",
        algorithm: str = "one_shot",
        max_sms: int = 8,
    ) -> torch.Tensor:
        """Rank ``self.rank``'s all-reduce of ``input`` into ``out`` (same numel; may alias ``input``).

        ``algorithm``: "one_shot" (read every region) or "two_shot" (reduce own slice, gather the others).

        Example::

            >>> out = sim.all_reduce(x, op="max", algorithm="two_shot", max_sms=2)
        """
        if algorithm not in ("one_shot", "two_shot"):
            raise ValueError(f"algorithm: expected 'one_shot' or 'two_shot', got {algorithm!r}")
        _check_tensor("input", input)
        p = _check_max_sms(max_sms)
        src, dst = self._check_io(input, out, input.numel(), f"all_reduce ({algorithm})")
        _check_op(op, src.dtype)
        n = src.numel()
        if n == 0:
            return dst
        from smptk.kernels import collectives as K

        meta = {"OP": K.OPS[op], "ACC": self._acc(src.dtype)}
        if algorithm == "one_shot":
            self._launch(K._all_reduce_one_shot_kernel, p, src, dst, *self._common(), n, **meta)
        else:
            slice_n = -(-n // self.world)
            self._launch(K._all_reduce_two_shot_kernel, p, src, dst, *self._common(), n, slice_n, **meta)
        return dst

    def all_gather(
        self, input: torch.Tensor, out: torch.Tensor | None = None, *, max_sms: int = 8
    ) -> torch.Tensor:
        """Rank ``self.rank``'s all-gather of ``input [n]`` into ``out [world * n]`` (block q from rank q).

        ``max_sms=0``: the copy-engine algorithm (``smptk.comm``'s ``algorithm="copy_engine"``): the
        staging copy and one tensor copy per region, no kernel (its signal kernels only wait for peers,
        and a simulated world has none).

        Example::

            >>> out = sim.all_gather(torch.arange(5, dtype=torch.int32), max_sms=1)   # 4 * 5 elements
        """
        _check_tensor("input", input)
        p = 0 if max_sms == 0 else _check_max_sms(max_sms)
        src, dst = self._check_io(input, out, self.world * input.numel(), "all_gather")
        n = src.numel()
        if n == 0:
            return dst
        if p == 0:
            self.peer_region(self.rank, src.dtype, n).copy_(src)
            for q in range(self.world):
                dst[q * n : (q + 1) * n].copy_(self.peer_region(q, src.dtype, n))
            return dst
        from smptk.kernels import collectives as K

        self._launch(K._all_gather_kernel, p, src, dst, *self._common(), n, n)
        return dst

    def reduce_scatter(
        self, input: torch.Tensor, out: torch.Tensor | None = None, *, op: str = "sum", max_sms: int = 8
    ) -> torch.Tensor:
        """Rank ``self.rank``'s reduce-scatter of ``input [world * n]`` into ``out [n]`` (block ``rank``).

        Example::

            >>> out = sim.reduce_scatter(torch.ones(4 * 5), op="sum", max_sms=3)   # 5 elements
        """
        _check_tensor("input", input)
        p = _check_max_sms(max_sms)
        if input.numel() % self.world:
            raise ValueError(
                f"input: reduce_scatter needs a multiple of world={self.world} elements, got {input.numel()}"
            )
        n = input.numel() // self.world
        src, dst = self._check_io(input, out, n, "reduce_scatter")
        _check_op(op, src.dtype)
        if n == 0:
            return dst
        from smptk.kernels import collectives as K

        meta = {"OP": K.OPS[op], "ACC": self._acc(src.dtype)}
        self._launch(K._reduce_scatter_kernel, p, src, dst, *self._common(), n, n, **meta)
        return dst

    def all_to_all(
        self, input: torch.Tensor, out: torch.Tensor | None = None, *, max_sms: int = 8
    ) -> torch.Tensor:
        """Rank ``self.rank``'s all-to-all with equal splits: ``input [world * n]`` -> ``out [world * n]``.

        Block d of ``input`` goes to rank d; block q of ``out`` comes from rank q. ``max_sms=0``: the
        copy-engine algorithm, as in :meth:`all_gather`.

        Example::

            >>> out = sim.all_to_all(torch.arange(4 * 3, dtype=torch.int32), max_sms=2)
        """
        _check_tensor("input", input)
        p = 0 if max_sms == 0 else _check_max_sms(max_sms)
        if input.numel() % self.world:
            raise ValueError(
                f"input: all_to_all with equal splits needs a multiple of world={self.world} elements, "
                f"got {input.numel()}"
            )
        seg = input.numel() // self.world
        src, dst = self._check_io(input, out, input.numel(), "all_to_all")
        if seg == 0:
            return dst
        if p == 0:
            own = self.peer_region(self.rank, src.dtype, self.world * seg)
            own.copy_(src)  # block d staged at d * seg, as the kernel stages it
            for q in range(self.world):
                region = self.peer_region(q, src.dtype, self.world * seg)
                dst[q * seg : (q + 1) * seg].copy_(region[self.rank * seg : (self.rank + 1) * seg])
            return dst
        from smptk.kernels import collectives as K

        offs, lens = self._a2a_table(seg)
        data_W, signal_W, status, rank, world = self._common()
        # Equal splits: the same (offset, length) tables serve the input side and the output side.
        self._launch(
            K._all_to_all_kernel,
            p,
            src,
            dst,
            offs,
            lens,
            offs,
            lens,
            data_W,
            signal_W,
            status,
            rank,
            world,
            seg,
        )
        return dst

    def _a2a_table(self, seg: int) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[world]`` offsets ``q * seg`` and lengths ``seg``, made on the device (no host copy)."""
        if seg not in self._a2a_tables:
            offs = torch.arange(self.world, dtype=torch.int64, device=self.device) * seg
            lens = torch.full((self.world,), seg, dtype=torch.int64, device=self.device)
            self._a2a_tables[seg] = (offs, lens)
        return self._a2a_tables[seg]

    def run(
        self,
        kind: str,
        input: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        op: str = "sum",
        max_sms: int = 8,
    ) -> torch.Tensor:
        """The collective named ``kind`` (one of :data:`KINDS`, as ``bench.counts`` names them).

        Example::

            >>> sim.run("all_reduce_two_shot", x, out, max_sms=4)
        """
        if kind == "all_reduce_one_shot":
            return self.all_reduce(input, out, op=op, algorithm="one_shot", max_sms=max_sms)
        if kind == "all_reduce_two_shot":
            return self.all_reduce(input, out, op=op, algorithm="two_shot", max_sms=max_sms)
        if kind == "all_gather":
            return self.all_gather(input, out, max_sms=max_sms)
        if kind == "reduce_scatter":
            return self.reduce_scatter(input, out, op=op, max_sms=max_sms)
        if kind == "all_to_all":
            return self.all_to_all(input, out, max_sms=max_sms)
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")

    @staticmethod
    def io_numel(kind: str, world: int, size_bytes: int, dtype: torch.dtype) -> tuple[int, int]:
        """(input, output) element counts of ``kind`` for nccl-tests' ``size_bytes`` (bench.counts' size).

        The size is the all-reduce buffer, all-gather's output, reduce-scatter's input and all-to-all's send
        buffer; it must be a whole number of elements (and of ``world`` blocks where the op splits it).
        A region must hold ``input`` elements.

        Example::

            >>> SimulatedWorld.io_numel("all_gather", 8, 8 << 20, torch.bfloat16)
            (524288, 4194304)
        """
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        _check_dtype("dtype", dtype)
        elem = torch.empty((), dtype=dtype).element_size()
        if size_bytes % elem:
            raise ValueError(f"size_bytes: {size_bytes} is not a whole number of {elem}-byte elements")
        total = size_bytes // elem
        if kind.startswith("all_reduce"):
            return total, total
        if total % world:
            raise ValueError(f"size_bytes: {total} elements do not split into world={world} equal blocks")
        if kind == "all_gather":
            return total // world, total
        if kind == "reduce_scatter":
            return total, total // world
        return total, total
