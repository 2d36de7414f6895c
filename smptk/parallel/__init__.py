"""Parallelism layer: ParallelConfig, DeviceMesh setup, TP/SP/EP layers, FSDP2 hybrid sharding, transform().

Imports go one way (kernels <- comm <- parallel). It exports nothing yet: each capability arrives with
its own issue (see DESIGN.md, "Public surface"), and nothing here pretends to implement it before then.
"""

__all__: list[str] = []
