"""Parallelism layer: ParallelConfig, DeviceMesh setup, TP/SP/EP layers, FSDP2 hybrid sharding, transform().

Imports go one way (kernels <- comm <- parallel). Each capability arrives with its own issue (see
DESIGN.md, "Public surface"); what is here today:

- :class:`MoE`: router + SwiGLU experts (+ shared experts), one device or expert-parallel over a process
  group, on smptk's MoE kernels and ``smptk.comm.all_to_all_single``.
"""

from smptk.parallel.moe import MoE

__all__ = ["MoE"]
