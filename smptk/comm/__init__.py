"""Collectives over symmetric memory with a bounded SM budget, falling back to torch.distributed.

This package is the home of ``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and
``all_to_all_single`` (see DESIGN.md, "Public surface"). It exports nothing yet: the collectives arrive
with their own issue, and nothing here pretends to implement them before then.
"""

__all__: list[str] = []
