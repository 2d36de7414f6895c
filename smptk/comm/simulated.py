"""A single-GPU "simulated world": one rank's collective kernel run against W buffers in one device's memory.

What this is, plainly: **one rank's kernel, W buffers in one GPU's memory, no peer, no barrier waits;
all traffic is local HBM.** :class:`SimulatedWorld` allocates W "peer" data regions side by side in one
device's memory and builds the address tables a symmetric heap has (``data_ptrs``, ``signal_ptrs``, an
int32 ``status [2W]``). It is a thin mode of the one launch path of :mod:`smptk.comm.collectives`: the
same per-kernel launch functions that the collectives call for each chunk (argument set-up, grid, block
size, checks) launch the real kernels of :mod:`smptk.kernels.collectives` on these tables, as rank
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
- two-shot all-reduce of ``x [n]`` with slices of ``s = ceil(n / W)`` rounded up to whole 16-byte vectors
  (``V = 16 / element size`` elements; slice q is ``[q * s, min((q + 1) * s, n))``, empty for the last
  ranks when n is small): slice r of ``out`` is ``reduce(x[slice r], R_q[slice r] for q != r)``; slice
  q != r is ``R_q[slice q]`` (on a real node, the reduction peer q wrote there).
- all-gather of ``x [n]`` into ``out [W * n]``: block r is ``x``, block q != r is ``R_q[:n]``.
- reduce-scatter of ``x [W * n]`` into ``out [n]``: ``reduce(x[r*n:(r+1)*n], R_q[r*n:(r+1)*n] for q != r)``.
- all-to-all (equal splits) of ``x [W * n]`` into ``out [W * n]``: block r is ``x[r*n:(r+1)*n]``, block
  q != r is ``R_q[r*n:(r+1)*n]`` (what peer q staged for rank r).

Reductions accumulate in fp32 (int32 for int32), in rank order 0..W-1, as on a real node.

Messages must fit in one region (no chunking here, unlike :mod:`smptk.comm.collectives`); every launch
is asynchronous on CUDA (no host sync inside a launch), so CUDA events can time it. ``max_sms=0`` runs
all-gather and all-to-all as the collectives' ``algorithm="copy_engine"``.

Example (one process; on CPU under ``TRITON_INTERPRET=1``, set before smptk.kernels is imported)::

    >>> import torch
    >>> from smptk.comm.simulated import SimulatedWorld
    >>> device = "cuda" if torch.cuda.is_available() else "cpu"
    >>> sim = SimulatedWorld(world=8, heap_bytes=1 << 20, device=device)
    >>> sim.fill_peers(lambda q: torch.full((1000,), float(q), dtype=torch.bfloat16, device=device))
    >>> x = torch.ones(1000, dtype=torch.bfloat16, device=device)
    >>> sim.all_reduce(x, max_sms=4).unique()   # 1 + (1 + 2 + ... + 7) = 29 everywhere
    tensor([29.], dtype=torch.bfloat16)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from smptk.comm import collectives as C
from smptk.kernels import runtime
from smptk.kernels.heap_layout import CONTROL_BYTES, MAX_WORLD, SIGNAL_BYTES

# Collective names as bench.counts.COLLECTIVES spells them; :meth:`SimulatedWorld.run` takes these.
KINDS = ("all_reduce_one_shot", "all_reduce_two_shot", "all_gather", "reduce_scatter", "all_to_all")
_REGION_ALIGN = 4096  # every region starts on a 4 KiB boundary, as the heaps' segments do


def _check_kernels_take(dtype: torch.dtype, op: str | None = None, name: str = "input") -> None:
    """Raise what the collectives would fall back on: a dtype or op the kernels do not have."""
    refusal = C._kernels_refuse(dtype, op, name)
    if refusal is not None:
        raise refusal


def world_mode_label(world: int, device: str | torch.device = "cuda") -> str:
    """The label every row measured in a simulated world carries.

    Example::

        >>> from smptk.comm.simulated import world_mode_label
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

    Attributes, named as :class:`smptk.comm.heap.SymmetricHeap`'s so that the launch path takes either:
    ``rank``, ``world_size``, ``heap_bytes``, ``device``, ``data_ptrs`` / ``signal_ptrs`` (int64 ``[world]``
    addresses of each region and signal pad), ``status`` (int32 ``[2 * world]``; stays zero, since nothing
    waits), ``calls`` (launches so far); and ``label`` (see :func:`world_mode_label`). Regions and pads
    start zeroed. Data types are chosen per call.

    Example (one process; on CPU under ``TRITON_INTERPRET=1``, set before smptk.kernels is imported)::

        >>> import torch
        >>> from smptk.comm.simulated import SimulatedWorld
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> sim = SimulatedWorld(world=4, heap_bytes=4096, device=device)
        >>> sim.data_ptrs.shape, sim.status.shape
        (torch.Size([4]), torch.Size([8]))
    """

    def __init__(self, world: int, heap_bytes: int, device: str | torch.device = "cuda", *, rank: int = 0):
        world = C._as_int("world", world)
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world: expected 1..{MAX_WORLD} ranks, got {world}")
        rank = C._as_int("rank", rank)
        if not 0 <= rank < world:
            raise ValueError(f"rank: expected 0..{world - 1} for world={world}, got {rank}")
        heap_bytes = C._as_int("heap_bytes", heap_bytes)
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

        self.world_size, self.rank, self.heap_bytes, self.device = world, rank, heap_bytes, device
        self.calls = 0
        self.region_stride = -(-heap_bytes // _REGION_ALIGN) * _REGION_ALIGN
        pad_bytes = -(-(SIGNAL_BYTES + CONTROL_BYTES) // _REGION_ALIGN) * _REGION_ALIGN
        # One allocation per kind, base rounded up to the alignment: the caching allocator's blocks are
        # 512-byte aligned, torch.zeros on a CPU 64-byte aligned.
        self._data = torch.zeros(world * self.region_stride + _REGION_ALIGN, dtype=torch.uint8, device=device)
        self._pads = torch.zeros(world * pad_bytes + _REGION_ALIGN, dtype=torch.uint8, device=device)
        self._data_base = (-self._data.data_ptr()) % _REGION_ALIGN
        pad_base = self._pads.data_ptr() + (-self._pads.data_ptr()) % _REGION_ALIGN
        data0 = self._data.data_ptr() + self._data_base
        self.data_ptrs = torch.tensor(
            [data0 + q * self.region_stride for q in range(world)], dtype=torch.int64, device=device
        )
        self.signal_ptrs = torch.tensor(
            [pad_base + q * pad_bytes for q in range(world)], dtype=torch.int64, device=device
        )
        self.status = torch.zeros(2 * world, dtype=torch.int32, device=device)
        self._a2a_tables: dict[int, torch.Tensor] = {}

    @property
    def label(self) -> str:
        """:func:`world_mode_label` for this world (put it in every row measured here).

        Example (one process; on CPU under ``TRITON_INTERPRET=1``, set before smptk.kernels is imported)::

            >>> import torch
            >>> from smptk.comm.simulated import SimulatedWorld
            >>> device = "cuda" if torch.cuda.is_available() else "cpu"
            >>> sim = SimulatedWorld(world=4, heap_bytes=4096, device=device)
            >>> row = {"world_mode": sim.label}      # a benchmark row
            >>> row["world_mode"].startswith("simulated world: 4 peer buffers in one")
            True
        """
        return world_mode_label(self.world_size, self.device)

    # ------------------------------------------------------------------------------------ peer regions
    def peer_region(self, q: int, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
        """Rank q's data region as a ``dtype`` tensor of ``numel`` elements (default: the whole region).

        A view: writing it stages data as peer q would have. Region ``self.rank`` is the running rank's
        own staging buffer, which every launch overwrites.

        Example (one process; on CPU under ``TRITON_INTERPRET=1``, set before smptk.kernels is imported)::

            >>> import torch
            >>> from smptk.comm.simulated import SimulatedWorld
            >>> device = "cuda" if torch.cuda.is_available() else "cpu"
            >>> sim = SimulatedWorld(world=4, heap_bytes=4096, device=device)
            >>> _ = sim.peer_region(1, torch.float16, 7).fill_(3.0)    # stage what peer 1 would
            >>> sim.peer_region(1, torch.float16, 3).tolist()
            [3.0, 3.0, 3.0]
        """
        q = C._as_int("q", q)
        if not 0 <= q < self.world_size:
            raise ValueError(f"q: expected a rank in 0..{self.world_size - 1}, got {q}")
        _check_kernels_take(dtype, name="dtype")
        elem = torch.empty((), dtype=dtype).element_size()
        numel = self.heap_bytes // elem if numel is None else C._as_int("numel", numel)
        if not 0 <= numel * elem <= self.heap_bytes:
            raise ValueError(
                f"numel: {numel} elements of {dtype} need {numel * elem} bytes, but a region holds "
                f"heap_bytes={self.heap_bytes}"
            )
        start = self._data_base + q * self.region_stride
        return self._data[start : start + numel * elem].view(dtype)

    def peer_data(self, rank: int, dtype: torch.dtype, numel: int, offset: int = 0) -> torch.Tensor:
        """Elements ``[offset, offset + numel)`` of rank ``rank``'s region, as ``SymmetricHeap.peer_data``
        gives them (what the copy-engine algorithm stages into and copies from)."""
        return self.peer_region(rank, dtype, offset + numel)[offset:]

    def fill_peers(self, values: Callable[[int], torch.Tensor]) -> None:
        """For every rank q != ``self.rank``: copy ``values(q)`` (flattened) to the start of region q.

        Example (one process; on CPU under ``TRITON_INTERPRET=1``, set before smptk.kernels is imported)::

            >>> import torch
            >>> from smptk.comm.simulated import SimulatedWorld
            >>> device = "cuda" if torch.cuda.is_available() else "cpu"
            >>> sim = SimulatedWorld(world=4, heap_bytes=4096, device=device)
            >>> sim.fill_peers(lambda q: torch.full((1000,), float(q), dtype=torch.bfloat16, device=device))
            >>> [sim.peer_region(q, torch.bfloat16, 2).tolist() for q in range(4)]   # region 0: this rank's
            [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
        """
        for q in range(self.world_size):
            if q == self.rank:
                continue
            data = values(q)
            if not isinstance(data, torch.Tensor):
                raise TypeError(f"values({q}): expected a torch.Tensor, got {type(data).__name__}")
            self.peer_region(q, data.dtype, data.numel()).copy_(data.reshape(-1))

    # ------------------------------------------------------------------------------------ launches
    def _io(
        self, inp: torch.Tensor, out: torch.Tensor | None, out_numel: int, what: str, op: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The checks of a call on ``inp`` (already a contiguous tensor): dtype and op the kernels have, this
        world's device, fits a region; ``out`` allocated or checked. Returns both flat."""
        _check_kernels_take(inp.dtype, op)
        if inp.device != self.device:
            raise ValueError(f"input: on {inp.device}, but the simulated world lives on {self.device}")
        nbytes = inp.numel() * inp.element_size()
        if nbytes > self.heap_bytes:
            raise ValueError(
                f"input: {what} stages all {inp.numel()} elements ({nbytes} bytes) in a region, which holds "
                f"heap_bytes={self.heap_bytes}; build the SimulatedWorld with heap_bytes >= {nbytes}"
            )
        out = torch.empty(out_numel, dtype=inp.dtype, device=self.device) if out is None else out
        C._check_tensor("out", out)
        C._check_pair("out", out, "input", inp)
        if out.numel() != out_numel:
            raise ValueError(f"out: expected {out_numel} elements for {what}, got {out.numel()}")
        return inp.view(-1), out.view(-1)

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

        Example (one process; on CPU under ``TRITON_INTERPRET=1``, set before smptk.kernels is imported)::

            >>> import torch
            >>> from smptk.comm.simulated import SimulatedWorld
            >>> device = "cuda" if torch.cuda.is_available() else "cpu"
            >>> sim = SimulatedWorld(world=4, heap_bytes=4096, device=device)
            >>> sim.fill_peers(lambda q: torch.full((8,), float(q), device=device))
            >>> x = torch.zeros(8, device=device)
            >>> sim.all_reduce(x, op="max", algorithm="two_shot", max_sms=2).tolist()   # slices of 4 fp32
            [3.0, 3.0, 3.0, 3.0, 1.0, 1.0, 1.0, 1.0]

        Slice 0 (this rank's) is the maximum; slice 1 is what peer 1 left in its region (on a real node,
        its reduction), see the module docstring.
        """
        if algorithm not in ("one_shot", "two_shot"):
            raise ValueError(f"algorithm: expected 'one_shot' or 'two_shot', got {algorithm!r}")
        C._check_tensor("input", input)
        code, p = C._op_code(op), C._max_sms(max_sms)
        src, dst = self._io(input, out, input.numel(), f"all_reduce ({algorithm})", op)
        if src.numel():
            C._launch_all_reduce(self, src, dst, p, code, algorithm, src.numel())
        return dst

    def all_gather(
        self, input: torch.Tensor, out: torch.Tensor | None = None, *, max_sms: int = 8
    ) -> torch.Tensor:
        """Rank ``self.rank``'s all-gather of ``input [n]`` into ``out [world * n]`` (block q from rank q).

        ``max_sms=0``: the copy-engine algorithm of ``smptk.comm`` (``algorithm="copy_engine"``): the staging
        copy, the one-program signal kernel (which waits for no peer here), one tensor copy per region,
        the closing signal kernel.

        Example (one process; on CPU under ``TRITON_INTERPRET=1``, set before smptk.kernels is imported)::

            >>> import torch
            >>> from smptk.comm.simulated import SimulatedWorld
            >>> device = "cuda" if torch.cuda.is_available() else "cpu"
            >>> sim = SimulatedWorld(world=4, heap_bytes=4096, device=device)
            >>> sim.fill_peers(lambda q: torch.full((5,), q, dtype=torch.int32, device=device))
            >>> out = sim.all_gather(torch.arange(5, dtype=torch.int32, device=device), max_sms=1)
            >>> out.view(4, 5).tolist()                      # 4 * 5 elements: block q from rank q
            [[0, 1, 2, 3, 4], [1, 1, 1, 1, 1], [2, 2, 2, 2, 2], [3, 3, 3, 3, 3]]
        """
        C._check_tensor("input", input)
        p = 0 if max_sms == 0 else C._max_sms(max_sms)
        src, dst = self._io(input, out, self.world_size * input.numel(), "all_gather")
        n = src.numel()
        if n and p == 0:
            C._all_gather_copy_engine(self, src, dst, n)
        elif n:
            C._launch_all_gather(self, src, dst, n, n, p, n)
        return dst

    def reduce_scatter(
        self, input: torch.Tensor, out: torch.Tensor | None = None, *, op: str = "sum", max_sms: int = 8
    ) -> torch.Tensor:
        """Rank ``self.rank``'s reduce-scatter of ``input [world * n]`` into ``out [n]`` (block ``rank``).

        Example (one process; on CPU under ``TRITON_INTERPRET=1``, set before smptk.kernels is imported)::

            >>> import torch
            >>> from smptk.comm.simulated import SimulatedWorld
            >>> device = "cuda" if torch.cuda.is_available() else "cpu"
            >>> sim = SimulatedWorld(world=4, heap_bytes=4096, device=device)
            >>> sim.fill_peers(lambda q: torch.ones(4 * 5, device=device))     # the peers' inputs
            >>> sim.reduce_scatter(torch.ones(4 * 5, device=device), op="sum", max_sms=3).tolist()
            [4.0, 4.0, 4.0, 4.0, 4.0]
        """
        C._check_tensor("input", input)
        code, p = C._op_code(op), C._max_sms(max_sms)
        if input.numel() % self.world_size:
            raise ValueError(
                f"input: reduce_scatter needs a multiple of world={self.world_size} elements, "
                f"got {input.numel()}"
            )
        n = input.numel() // self.world_size
        src, dst = self._io(input, out, n, "reduce_scatter", op)
        if n:
            C._launch_reduce_scatter(self, src, dst, n, n, p, code, n)
        return dst

    def all_to_all(
        self, input: torch.Tensor, out: torch.Tensor | None = None, *, max_sms: int = 8
    ) -> torch.Tensor:
        """Rank ``self.rank``'s all-to-all with equal splits: ``input [world * n]`` -> ``out [world * n]``.

        Block d of ``input`` goes to rank d; block q of ``out`` comes from rank q. ``max_sms=0``: the
        copy-engine algorithm, as in :meth:`all_gather`.

        Example (one process; on CPU under ``TRITON_INTERPRET=1``, set before smptk.kernels is imported)::

            >>> import torch
            >>> from smptk.comm.simulated import SimulatedWorld
            >>> device = "cuda" if torch.cuda.is_available() else "cpu"
            >>> sim = SimulatedWorld(world=4, heap_bytes=4096, device=device)
            >>> sim.fill_peers(lambda q: torch.full((4 * 3,), q, dtype=torch.int32, device=device))
            >>> sim.all_to_all(torch.arange(4 * 3, dtype=torch.int32, device=device), max_sms=2).tolist()
            [0, 1, 2, 1, 1, 1, 2, 2, 2, 3, 3, 3]
        """
        C._check_tensor("input", input)
        p = 0 if max_sms == 0 else C._max_sms(max_sms)
        world = self.world_size
        if input.numel() % world:
            raise ValueError(
                f"input: all_to_all with equal splits needs a multiple of world={world} elements, "
                f"got {input.numel()}"
            )
        seg = input.numel() // world
        src, dst = self._io(input, out, input.numel(), "all_to_all")
        if seg and p == 0:  # one round with a slot of one block: block d staged at d * seg
            blocks = ([seg] * world, [q * seg for q in range(world)])
            C._all_to_all_copy_engine(self, src, dst, blocks, blocks, seg, 1)
        elif seg:
            C._launch_all_to_all(self, src, dst, self._a2a_windows(seg), seg, p, 1)
        return dst

    def _a2a_windows(self, seg: int) -> torch.Tensor:
        """int64 ``[4, world]``: offsets ``q * seg`` and lengths ``seg`` of the input's and the output's
        blocks (equal splits), made once on the device, so a launch copies nothing from the host."""
        if seg not in self._a2a_tables:
            offs = torch.arange(self.world_size, dtype=torch.int64, device=self.device) * seg
            self._a2a_tables[seg] = torch.stack([offs, torch.full_like(offs, seg)] * 2)
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

        Example (one process; on CPU under ``TRITON_INTERPRET=1``, set before smptk.kernels is imported)::

            >>> import torch
            >>> from smptk.comm.simulated import SimulatedWorld
            >>> device = "cuda" if torch.cuda.is_available() else "cpu"
            >>> sim = SimulatedWorld(world=4, heap_bytes=4096, device=device)
            >>> sim.fill_peers(lambda q: torch.ones(8, device=device))
            >>> x, out = torch.ones(8, device=device), torch.empty(8, device=device)
            >>> sim.run("all_reduce_two_shot", x, out, max_sms=4).tolist()   # slice 1: peer 1's region
            [4.0, 4.0, 4.0, 4.0, 1.0, 1.0, 1.0, 1.0]
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

            >>> import torch
            >>> from smptk.comm.simulated import SimulatedWorld
            >>> SimulatedWorld.io_numel("all_gather", 8, 8 << 20, torch.bfloat16)
            (524288, 4194304)
        """
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        _check_kernels_take(dtype, name="dtype")
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
