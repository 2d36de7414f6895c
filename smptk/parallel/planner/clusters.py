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
are the data sheet's GB (1e9 bytes: the H200's 141 GB is 131.3 GiB, GB200's 186 GB 173.2 GiB) or GiB where
the product is sold in GiB (A100: 40 / 80 GiB). A custom cluster's ``memory_gb`` is read as GiB (2**30
bytes, the unit the plan prints), not as the data sheet's GB: write 131.3 for a 141 GB H200 to match the
p5en preset.

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
import math
import numbers
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

    def __post_init__(self) -> None:
        where = f"GPU {self.name!r}"
        _count(where, "memory_bytes", self.memory_bytes)
        _count(where, "sms", self.sms, least=0)
        _number(where, "bf16_tflops", self.bf16_tflops)
        _number(where, "hbm_gbps", self.hbm_gbps, zero_ok=True)


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
        p5.48xlarge: 4 x 8 H100-SXM5-80GB (79.6 GiB, 989 TFLOP/s bf16), NVLink 450 GB/s per GPU, network
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
        where = f"cluster {self.name!r}"
        for key in ("gpus_per_node", "nodes"):
            _count(where, key, getattr(self, key))
        for key in ("intra_node_gbps", "inter_node_gbps"):
            _number(where, key, getattr(self, key))
        for key in ("intra_latency_us", "inter_latency_us"):
            _number(where, key, getattr(self, key), zero_ok=True)

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
            f"({_gib(self.gpu.memory_bytes)} GiB, {self.gpu.bf16_tflops:g} TFLOP/s bf16), "
            f"NVLink {self.intra_node_gbps:g} GB/s per GPU, network {self.inter_node_gbps:g} Gbps per node"
        )


def _gib(n_bytes: float) -> str:
    """GiB to one decimal, the precision of the presets' and a custom cluster's ``memory_gb`` ("79.6",
    "131.3"), without a trailing ".0" ("40")."""
    return f"{n_bytes / 2**30:.1f}".removesuffix(".0")


def _count(where: str, key: str, value: Any, *, least: int = 1) -> int:
    """``value`` if it is an int >= ``least`` (not a bool, not a float: 7.9 GPUs per node is a typo, not 7);
    ValueError naming ``key`` and the value otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{where}: {key} must be an int >= {least}, got {value!r}")
    return int(value)


def _number(where: str, key: str, value: Any, *, zero_ok: bool = False) -> float:
    """``value`` as a float if it is a finite real number > 0 (>= 0 with ``zero_ok``: latencies, and the
    optional rates where 0 means unknown); ValueError naming ``key`` and the value otherwise (a string, a
    bool, NaN, inf, an int too large for a float, a negative latency)."""
    try:
        x = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an int past a double's range: 10**400 GB of memory is not a GPU
        x = math.inf
    if not math.isfinite(x) or x < 0 or (x == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"{where}: {key} must be a finite number {bound}, got {value!r}")
    return x


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
    Cluster, or a custom dict (a custom cluster JSON file holds the same object). ``nodes`` overrides the
    node count. Unknown names raise ValueError listing the presets.

    Custom keys and units:

    - ``gpu``: a name;
    - ``memory_gb``: device memory in GiB (2**30 bytes, as the plan prints it; a data sheet's "GB" is GiB
      for some GPUs and 1e9 bytes for others: the A100 presets hold 40 and 80, the p5en's "141 GB" H200
      131.3);
    - ``bf16_tflops``: peak dense bf16 TFLOP/s per GPU;
    - ``gpus_per_node``: GPUs per node;
    - ``intra_node_gbps``: NVLink GB/s per GPU, each way;
    - ``inter_node_gbps``: the node's network in Gbit/s (all its NICs);
    - optional: ``hbm_gbps`` (GB/s, 0: unknown), ``sms`` (0: unknown), ``intra_latency_us`` /
      ``inter_latency_us`` (microseconds per message, default 5 / 20), ``name``, ``nodes`` (default 1).

    Counts (``gpus_per_node``, ``nodes``, ``sms``) must be ints (7.9 GPUs per node is refused, not read
    as 7); the rates and ``memory_gb`` finite numbers > 0 (``hbm_gbps`` >= 0), the latencies finite
    numbers >= 0. A value that is not raises ValueError naming its key and the value.
    """
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
        name = str(spec.get("name", f"custom {spec['gpu']}"))
        where = f"cluster {name!r}"
        gpu = GPU(
            str(spec["gpu"]),
            int(_number(where, "memory_gb", spec["memory_gb"]) * 2**30),  # GiB
            _number(where, "bf16_tflops", spec["bf16_tflops"]),
            _number(where, "hbm_gbps", spec.get("hbm_gbps", 0.0), zero_ok=True),
            _count(where, "sms", spec.get("sms", 0), least=0),
        )
        c = Cluster(
            name,
            gpu,
            _count(where, "gpus_per_node", spec["gpus_per_node"]),
            _number(where, "intra_node_gbps", spec["intra_node_gbps"]),
            _number(where, "inter_node_gbps", spec["inter_node_gbps"]),
            _count(where, "nodes", spec.get("nodes", 1)),
            _number(where, "intra_latency_us", spec.get("intra_latency_us", 5.0), zero_ok=True),
            _number(where, "inter_latency_us", spec.get("inter_latency_us", 20.0), zero_ok=True),
        )
    else:
        raise TypeError(f"cluster: expected a preset name, a Cluster or a dict, got {type(spec).__name__}")
    return c.with_nodes(nodes) if nodes is not None else c
