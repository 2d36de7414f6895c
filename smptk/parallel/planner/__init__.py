"""Memory planning and configuration advice: will this model fit, and which configuration should I use?

- :mod:`~smptk.parallel.planner.models`: :class:`ModelSpec` from a Hugging Face config or a preset
  (:data:`PRESETS`), with exact parameter counts (total and active) and the tensors in smptk's layout.
- :mod:`~smptk.parallel.planner.clusters`: :class:`Cluster` presets (p4d, p4de, p5, p5en, DGX H100,
  GB200 NVL72) or custom GPUs and links.
- :mod:`~smptk.parallel.planner.estimate`: :func:`estimate_memory`, per-GPU bytes term by term
  (:class:`MemoryEstimate`), as smptk divides them.
- :mod:`~smptk.parallel.planner.advise`: :func:`advise`, ranked configurations that fit, with a predicted
  step time and MFU, and the reason each was chosen or rejected.

``smptk plan`` (:mod:`smptk.cli`) prints both. Every estimate term is checked against real tensors and
what autograd keeps in tests/test_planner_validation.py.
"""

from smptk.parallel.planner.advise import Advice, Candidate, advise, step_time
from smptk.parallel.planner.clusters import CLUSTERS, GPU, Cluster, cluster
from smptk.parallel.planner.estimate import MemoryEstimate, MemoryTerm, estimate_memory
from smptk.parallel.planner.models import PRESETS, ModelSpec, ParamTensor, from_hf_config, model_spec

__all__ = [
    "CLUSTERS",
    "GPU",
    "PRESETS",
    "Advice",
    "Candidate",
    "Cluster",
    "MemoryEstimate",
    "MemoryTerm",
    "ModelSpec",
    "ParamTensor",
    "advise",
    "cluster",
    "estimate_memory",
    "from_hf_config",
    "model_spec",
    "step_time",
]
