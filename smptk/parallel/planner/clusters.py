"""Clusters for the planner: GPU facts and node interconnects, as presets or custom.

A :class:`Cluster` is ``nodes`` nodes of ``gpus_per_node`` identical :class:`GPU` s: the memory the
planner fits into, the peak bf16 dense tensor-core rate its step time divides FLOPs by, the per-GPU
NVLink bandwidth inside a node and the node's network bandwidth between nodes (the two links of the
alpha-beta communication model in :mod:`smptk.parallel.planner.advise`).

Sources (vendor data sheets; the figures are the public ones, none is measured here):

- A100 SXM4 40 / 80 GB: 312 TFLOP/s bf16 dense, 108 SMs, NVLink 3 600 GB/s total (300 GB/s each way).
- H100 SXM5 80 GB: 989 TFLOP/s bf16 dense, 132 SMs, NVLink 4 900 GB/s total (450 GB/s each way).
- H200 SXM 141 GB: the H100's compute and NVLink, 141 GB HBM3e.
- GB200 NVL72: 72 Blackwell GPUs in one NVLink 5 domain (1.8 TB/s per GPU total, 900 GB/s each way),
  180 PFLOP/s bf16 dense per rack (2.5 PFLOP/s per GPU), 13.4 TB HBM3e per rack (186 GB per GPU);
  one 400 Gb/s ConnectX-7 NIC per GPU between racks.
- AWS p4d.24xlarge (8 x A100 40 GB, 400 Gbps EFA), p4de.24xlarge (8 x A100 80 GB, 400 Gbps EFA),
  p5.48xlarge (8 x H100 80 GB, 3200 Gbps EFA), p5en.48xlarge (8 x H200, 3200 Gbps EFA);
  NVIDIA DGX H100 (8 x H100, 8 x 400 Gb/s ConnectX-7: 3200 Gb/s).

Memory is what ``torch.cuda.mem_get_info`` reports as total on the 80 GB H100 (81,559 MiB); the others
are the data sheet's GB (1e9 bytes) or GiB where the product is sold in GiB (A100: 40 / 80 GiB).

Example::

    >>> from smptk.parallel.planner import cluster
    >>> c = cluster("p4d.24xlarge", nodes=32)
    >>> c.world_size, c.gpu.name, round(c.gpu.memory_bytes / 2**30)
    (256, 'A100-SXM4-40GB', 40)
    >>> custom = cluster({"gpu": "mygpu", "memory_gb": 96, "bf16_tflops": 700, "gpus_per_node": 4,
    ...                   "intra_node_gbps": 300, "inter_node_gbps": 800}, nodes=2)
    >>> custom.world_size, custom.gpu.bf16_tflops
    (8, 700.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class GPU:
    """One GPU: ``memory_bytes`` of device memory, ``bf16_tflops`` peak dense bf16 tensor-core rate,
    ``hbm_gbps`` memory bandwidth (GB/s), ``sms`` streaming multiprocessors (0: unknown)."""

    name: str
    memory_bytes: int
    bf16_tflops: float
    hbm_gbps: float = 0.0
    sms: int = 0


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``gpus_per_node`` GPUs. ``intra_node_gbps``: NVLink GB/s per GPU, each way;
    ``inter_node_gbps``: the node's network in Gbit/s (all its NICs; bits, as instances are sold);
    latencies per message (alpha) in microseconds, within and between nodes.

    Example::

        >>> from smptk.parallel.planner import cluster
        >>> c = cluster("p5", nodes=4)              # a preset (CLUSTERS) by name or alias
        >>> c.name, c.world_size, c.gpu.name
        ('p5.48xlarge', 32, 'H100-SXM5-80GB')
        >>> c.inter_node_bytes_per_gpu / 1e9       # GB/s: 3200 Gbit/s per node shared by its 8 GPUs
        50.0
        >>> print(c.describe())
        p5.48xlarge: 4 x 8 H100-SXM5-80GB (80 GiB, 989 TFLOP/s bf16), NVLink 450 GB/s per GPU, network
        3200 Gbps per node
        >>> c.with_nodes(1).world_size
        8
    """

    name: str
    gpu: GPU
    gpus_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    nodes: int = 1
    intra_latency_us: float = 5.0
    inter_latency_us: float = 20.0

    def __post_init__(self) -> None:
        for key in ("gpus_per_node", "nodes"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"cluster {self.name!r}: {key} must be an int >= 1, got {v!r}")
        for key in ("intra_node_gbps", "inter_node_gbps"):
            if not getattr(self, key) > 0:
                raise ValueError(f"cluster {self.name!r}: {key} must be > 0, got {getattr(self, key)!r}")
        if not (self.gpu.memory_bytes > 0 and self.gpu.bf16_tflops > 0):
            raise ValueError(f"cluster {self.name!r}: GPU memory and bf16_tflops must be > 0")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def inter_node_bytes_per_gpu(self) -> float:
        """Network bytes/s each GPU gets when all GPUs of a node send at once."""
        return self.inter_node_gbps * 1e9 / 8 / self.gpus_per_node

    def with_nodes(self, nodes: int) -> Cluster:
        return dataclasses.replace(self, nodes=nodes)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.nodes} x {self.gpus_per_node} {self.gpu.name} "
            f"({self.gpu.memory_bytes / 2**30:.0f} GiB, {self.gpu.bf16_tflops:g} TFLOP/s bf16), "
            f"NVLink {self.intra_node_gbps:g} GB/s per GPU, network {self.inter_node_gbps:g} Gbps per node"
        )


A100_40 = GPU("A100-SXM4-40GB", 40 * 2**30, 312.0, 1555.0, 108)
A100_80 = GPU("A100-SXM4-80GB", 80 * 2**30, 312.0, 2039.0, 108)
H100 = GPU("H100-SXM5-80GB", 81559 * 2**20, 989.0, 3350.0, 132)
H200 = GPU("H200-SXM-141GB", 141 * 10**9, 989.0, 4800.0, 132)
B200_GB200 = GPU("B200 (GB200)", 186 * 10**9, 2500.0, 8000.0, 0)

CLUSTERS: dict[str, Cluster] = {
    "p4d.24xlarge": Cluster("p4d.24xlarge", A100_40, 8, 300.0, 400.0),
    "p4de.24xlarge": Cluster("p4de.24xlarge", A100_80, 8, 300.0, 400.0),
    "p5.48xlarge": Cluster("p5.48xlarge", H100, 8, 450.0, 3200.0),
    "p5en.48xlarge": Cluster("p5en.48xlarge", H200, 8, 450.0, 3200.0),
    "dgx-h100": Cluster("dgx-h100", H100, 8, 450.0, 3200.0),
    "gb200-nvl72": Cluster("gb200-nvl72", B200_GB200, 72, 900.0, 72 * 400.0),
}
_ALIASES = {"p4d": "p4d.24xlarge", "p4de": "p4de.24xlarge", "p5": "p5.48xlarge", "p5en": "p5en.48xlarge"}

_CUSTOM_KEYS = ("gpu", "memory_gb", "bf16_tflops", "gpus_per_node", "intra_node_gbps", "inter_node_gbps")


def cluster(spec: str | Cluster | Mapping[str, Any], nodes: int | None = None) -> Cluster:
    """A Cluster from a preset name (:data:`CLUSTERS`, or ``p4d`` / ``p4de`` / ``p5`` / ``p5en``), a
    Cluster, or a custom dict with keys ``gpu`` (a name), ``memory_gb`` (GiB), ``bf16_tflops``,
    ``gpus_per_node``, ``intra_node_gbps`` (GB/s per GPU), ``inter_node_gbps`` (Gbit/s per node) and
    optionally ``hbm_gbps``, ``sms``, ``intra_latency_us``, ``inter_latency_us``, ``name``. ``nodes``
    overrides the node count. Unknown names raise ValueError listing the presets."""
    if isinstance(spec, Cluster):
        c = spec
    elif isinstance(spec, str):
        key = _ALIASES.get(spec.lower(), spec.lower())
        if key not in CLUSTERS:
            raise ValueError(
                f"unknown instance {spec!r}; presets: {', '.join(CLUSTERS)} "
                "(or a custom cluster: gpu, memory_gb, bf16_tflops, gpus_per_node, intra_node_gbps, "
                "inter_node_gbps)"
            )
        c = CLUSTERS[key]
    elif isinstance(spec, Mapping):
        missing = [k for k in _CUSTOM_KEYS if k not in spec]
        allowed = set(_CUSTOM_KEYS) | {
            "hbm_gbps",
            "sms",
            "intra_latency_us",
            "inter_latency_us",
            "name",
            "nodes",
        }
        unknown = sorted(set(spec) - allowed)
        if missing or unknown:
            raise ValueError(
                f"custom cluster: missing keys {missing}, unknown keys {unknown}; "
                f"expected {', '.join(_CUSTOM_KEYS)}"
                " (optional: hbm_gbps, sms, intra_latency_us, inter_latency_us, name, nodes)"
            )
        gpu = GPU(
            str(spec["gpu"]),
            int(float(spec["memory_gb"]) * 2**30),
            float(spec["bf16_tflops"]),
            float(spec.get("hbm_gbps", 0.0)),
            int(spec.get("sms", 0)),
        )
        c = Cluster(
            str(spec.get("name", f"custom {spec['gpu']}")),
            gpu,
            int(spec["gpus_per_node"]),
            float(spec["intra_node_gbps"]),
            float(spec["inter_node_gbps"]),
            int(spec.get("nodes", 1)),
            float(spec.get("intra_latency_us", 5.0)),
            float(spec.get("inter_latency_us", 20.0)),
        )
    else:
        raise TypeError(f"cluster: expected a preset name, a Cluster or a dict, got {type(spec).__name__}")
    return c.with_nodes(nodes) if nodes is not None else c
