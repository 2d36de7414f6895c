"""ParallelConfig, init(config) and the DeviceMesh every parallel layer reads.

A run is described by a :class:`ParallelConfig` (the keys users of managed model-parallel libraries
know), given as a dict, a JSON file or the dataclass. :func:`init` checks it against the world size of
the running ``torch.distributed`` job, builds one DeviceMesh and keeps a :class:`ParallelState` that
layers find through :func:`current`.

Mesh layout (row-major, ``tp`` innermost, so a tensor-parallel group is consecutive ranks, normally on one
node)::

    mesh         dims (dp_replicate, dp_shard, tp)         global rank = (r * dp_shard + s) * tp + t
    dp           dp_replicate x dp_shard flattened         dp coordinate = r * dp_shard + s
    expert mesh  dims (dp_replicate, edp_shard, ep, tp)    dp_shard split as s = e_s * ep + e
                 (dp_shard unflattened: ep inner)           ep coordinate e = s % ep, edp_shard e_s = s // ep

Sizes, with ``dp = world / tensor_parallel_degree``:

- ``dp_shard = hybrid_shard_degree or dp`` and ``dp_replicate = dp / dp_shard``: 0 shards over the whole
  data-parallel world, 1 replicates (gradients all-reduced), k shards within groups of k consecutive
  dp ranks and replicates across the ``dp / k`` groups (the meaning of ``hybrid_shard_degree`` in the
  managed library it comes from). Dense parameters are tensor-parallel over ``tp`` and sharded by FSDP2
  over the 2-D ``(dp_replicate, dp_shard)`` mesh.
- ``ep = expert_parallel_degree`` is carved out of ``dp_shard`` (as torchtitan does, which requires ep
  to divide dp_shard x cp): **expert_parallel_degree must divide dp_shard**, not merely dp, and
  ``edp_shard = dp_shard / ep``. Expert weights are split over ``ep`` (each ep rank owns
  ``num_experts / ep`` experts) and sharded by FSDP2 over ``(dp_replicate, edp_shard)``. Two reasons
  for dp_shard rather than dp: the all-to-all of every MoE layer then stays inside the sharding group
  (consecutive dp ranks, the ones hybrid sharding keeps close), and the data-parallel ranks left to the
  expert weights form a regular ``(dp_replicate, edp_shard)`` grid that FSDP2 takes as an HSDP mesh (an
  ep group crossing replicate groups would leave no such grid). With ``hybrid_shard_degree=1`` (no
  sharding) expert parallelism therefore needs ``hybrid_shard_degree`` raised to a multiple of ep.

Worked example: world 8, ``tensor_parallel_degree=2, hybrid_shard_degree=2, expert_parallel_degree=2``
gives dp 4, dp_shard 2, dp_replicate 2, ep 2, edp_shard 1. The mesh is
``[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]`` and the groups are::

    tp            {0, 1} {2, 3} {4, 5} {6, 7}
    dp_shard      {0, 2} {1, 3} {4, 6} {5, 7}
    dp_replicate  {0, 4} {1, 5} {2, 6} {3, 7}
    dp            {0, 2, 4, 6} {1, 3, 5, 7}
    ep            {0, 2} {1, 3} {4, 6} {5, 7}       (ep = dp_shard: ep takes the whole shard group)
    edp_shard     {0} {1} ... {7}                   (size 1: expert weights are not FSDP-sharded,
                                                     only replicated over dp_replicate)

Rank 5 sits at dp_replicate 1, dp_shard 0, tp 1, dp 2, ep 0, edp_shard 0. With world 8,
``hybrid_shard_degree=4, expert_parallel_degree=2`` (tp 1): dp_shard {0..3} {4..7}, ep {0, 1} {2, 3}
{4, 5} {6, 7}, edp_shard {0, 2} {1, 3} {4, 6} {5, 7}.

Seeds (:meth:`ParallelState.seed_for`): ``seed_for()`` is ``random_seed`` on every rank, for parameter
initialization, so parameters start identical across data-parallel replicas and a tensor-parallel layer
draws its full weight from that seed and keeps its slice (the sharded model starts as the one-GPU model).
``init`` seeds torch's generators with it (``torch.manual_seed(random_seed)``, the same on every rank, as
Megatron-LM's and torchtitan's setup do), and smptk's layers draw from torch's default CPU generator like
``nn.Linear``: a model built after ``init``, of smptk's layers and torch's in any mix, starts identical on
every rank and, built on the CPU, equal to the unsharded model built in the same order after
``torch.manual_seed(random_seed)`` (:mod:`smptk.parallel.shard_init`; a meta-built one after
:func:`~smptk.parallel.materialize`). Reseeding per rank before the model is built breaks this; per-rank
randomness takes the generators below.
``seed_for("tp")`` differs across the tp ranks and agrees across every other dim (Megatron-LM's
model-parallel RNG convention); ``seed_for("dp", "tp")`` differs across both. Dropout of a tp-sharded or
sequence-parallel activation, where each tp rank holds different elements, runs inside
:meth:`ParallelState.fork_rng` ``("tp")``, which draws from such a seed and keeps activation
checkpointing's recompute exact; dropout of a replicated activation stays on the default generator,
which is in step on every rank.

``comm_max_sms`` >= 1 becomes ``smptk.comm``'s default ``max_sms`` (``smptk.comm.configure``) for every
collective on this rank until :func:`reset`; 0 (copy engines, no SM moves data) is not a default
``smptk.comm.configure`` accepts, so it is kept on the state (:attr:`ParallelState.comm_max_sms`) for
the layers to pass per call (``SmptkAllGather(max_sms=0)`` takes the copy-engine path).

Example (one process; under torchrun every rank runs the same lines without the store arguments)::

    >>> import torch.distributed as dist
    >>> from smptk.parallel import ParallelConfig, init, current, reset
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> state = init({"tensor_parallel_degree": 1, "hybrid_shard_degree": 0, "random_seed": 7})
    >>> state.sizes["dp_shard"], state.sizes["tp"], state.coords["dp"]
    (1, 1, 0)
    >>> current() is state, state.seed_for()
    (True, 7)
    >>> ParallelConfig(tensor_parallel_degree=3).validate(8)
    Traceback (most recent call last):
    ValueError: tensor_parallel_degree 3 does not divide world size 8
    >>> reset()
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
import os
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from smptk import comm
from smptk.kernels.heap_layout import MAX_PROGRAMS

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
EXPERT_MESH_DIMS = ("dp_replicate", "edp_shard", "ep", "tp")
# Every name ParallelState.sizes / coords / group / seed_for take, in the canonical order seeds use.
DIM_NAMES = ("dp_replicate", "dp_shard", "dp", "edp_shard", "ep", "tp")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
MIXED_PRECISION = ("bf16", "fp16", "fp32")


def _did_you_mean(word: str, options: tuple[str, ...]) -> str:
    """`` (did you mean 'x'?)`` naming the option closest to ``word`` (difflib), or "" when none is close."""
    hint = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def _check_int(key: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{key}: expected an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{key}: expected an int {bound}, got {value}")


def _check_bool(key: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{key}: expected a bool (true/false), got {type(value).__name__} {value!r}")


def _check_choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{key}: expected one of {', '.join(choices)}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(
            f"{key}: expected one of {', '.join(choices)}, got {value!r}{_did_you_mean(value, choices)}"
        )


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How a model is parallelized; checked on construction, and against a world size by :meth:`validate`.

    Attributes:
        tensor_parallel_degree: ranks of a tensor-parallel (and sequence-parallel) group, >= 1.
        hybrid_shard_degree: >= 0. 0 = shard parameters over the whole data-parallel world, 1 = no
            sharding (replicated, gradients all-reduced), k = shard within groups of k data-parallel
            ranks and replicate across groups. Must divide the data-parallel size.
        expert_parallel_degree: ranks that split a MoE layer's experts, >= 1; carved out of the
            sharding group, so it must divide ``dp_shard`` (see the module docstring).
        context_parallel_degree: accepted for compatibility with configs that carry it; only 1 runs
            today (larger values raise NotImplementedError).
        activation_checkpointing: "none", "full" (recompute every checkpointed block in backward) or
            "selective" (recompute the activation-heavy, FLOP-light parts of a block, attention core and
            activation functions, and keep the GEMM outputs, as Korthikanti et al. do); True and False
            are read as "full" and "none" and stored as those strings. Applied by
            :func:`smptk.parallel.apply_activation_checkpointing`.
        sm_activation_offloading: move the saved inputs of checkpointed blocks to CPU memory and bring
            them back ahead of backward; needs activation_checkpointing other than "none". Applied by
            :func:`smptk.parallel.apply_activation_checkpointing` as well.
        activation_loading_horizon: >= 1, default 2 (the managed library's): how many offloaded blocks'
            inputs may be on the GPU at once. Read only when offloading.
        delayed_parameter_initialization: build the model on the meta device and materialize each
            parameter shard on its rank, so no rank ever holds the full model: build under
            ``torch.device("meta")``, parallelize, then :func:`smptk.parallel.materialize`.
            :func:`~smptk.parallel.apply_data_parallel` warns when it is set and the model it gets holds
            real parameters (the full model was allocated, which the key exists to avoid).
        mixed_precision: parameter / compute dtype, "bf16" (default), "fp16" or "fp32".
        comm_max_sms: SMs (programs) per smptk collective, 0..256; None keeps ``smptk.comm``'s setting
            (SMPTK_COMM_MAX_SMS, default 8); 0 = copy engines where the collective has that path.
        random_seed: >= 0 and < 2**63; :func:`init` seeds torch's generators with it (parameter
            initialization) and it is the base of every seed in :meth:`ParallelState.seed_for`.
    """

    tensor_parallel_degree: int = 1
    hybrid_shard_degree: int = 0
    expert_parallel_degree: int = 1
    context_parallel_degree: int = 1
    activation_checkpointing: bool | str = "none"
    sm_activation_offloading: bool = False
    activation_loading_horizon: int = 2
    delayed_parameter_initialization: bool = False
    mixed_precision: str = "bf16"
    comm_max_sms: int | None = None
    random_seed: int = 0

    def __post_init__(self) -> None:
        _check_int("tensor_parallel_degree", self.tensor_parallel_degree, 1)
        _check_int("hybrid_shard_degree", self.hybrid_shard_degree, 0)
        _check_int("expert_parallel_degree", self.expert_parallel_degree, 1)
        _check_int("context_parallel_degree", self.context_parallel_degree, 1)
        if self.context_parallel_degree > 1:
            raise NotImplementedError(
                f"context_parallel_degree {self.context_parallel_degree}: context parallelism is not "
                "supported yet; set context_parallel_degree to 1"
            )
        ac = self.activation_checkpointing
        if isinstance(ac, bool):
            object.__setattr__(self, "activation_checkpointing", "full" if ac else "none")
        else:
            _check_choice("activation_checkpointing", ac, ACTIVATION_CHECKPOINTING)
        _check_bool("sm_activation_offloading", self.sm_activation_offloading)
        _check_int("activation_loading_horizon", self.activation_loading_horizon, 1)
        _check_bool("delayed_parameter_initialization", self.delayed_parameter_initialization)
        _check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISION)
        if self.comm_max_sms is not None:
            _check_int("comm_max_sms", self.comm_max_sms, 0, MAX_PROGRAMS)
        _check_int("random_seed", self.random_seed, 0, 2**63 - 1)
        if self.sm_activation_offloading and self.activation_checkpointing == "none":
            raise ValueError(
                "sm_activation_offloading: offloading moves the inputs of checkpointed blocks to CPU, so it "
                "needs activation_checkpointing 'full' or 'selective' (got 'none')"
            )

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every key a config may carry, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ParallelConfig:
        """A config from ``{key: value}``; unknown keys raise ValueError with the closest known key."""
        known = cls.keys()
        for key in values:
            if not isinstance(key, str):
                raise TypeError(f"config keys must be strings, got {type(key).__name__} {key!r}")
            if key not in known:
                raise ValueError(
                    f"unknown config key {key!r}{_did_you_mean(key, known)}; known keys: {', '.join(known)}"
                )
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> ParallelConfig:
        """A config from a JSON file holding one object of keys (a key given twice is refused)."""
        file = Path(path)
        if not file.is_file() and os.fspath(path).lstrip().startswith("{"):
            raise FileNotFoundError(
                f"config: {os.fspath(path)[:60]!r} is JSON text, not a file path; pass a dict "
                "(json.loads(text)) or the path of a JSON file"
            )
        return cls.from_json_text(file.read_text(), f"config file {os.fspath(path)!r}")

    @classmethod
    def from_json_text(cls, text: str, source: str = "config") -> ParallelConfig:
        """A config from JSON text holding one object of keys (a key given twice is refused, where
        ``json.loads`` would keep the last); ``source`` names the text in errors (a file, a CLI option).

        Example::

            >>> ParallelConfig.from_json_text('{"tensor_parallel_degree": 2}').tensor_parallel_degree
            2
            >>> text = '{"hybrid_shard_degree": 2, "hybrid_shard_degree": 4}'
            >>> ParallelConfig.from_json_text(text, "--config")
            Traceback (most recent call last):
            ...
            ValueError: --config: key 'hybrid_shard_degree' is given more than once
        """

        def no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            keys = [k for k, _ in pairs]
            twice = sorted({k for k in keys if keys.count(k) > 1})
            if twice:
                raise ValueError(f"{source}: key {twice[0]!r} is given more than once")
            return dict(pairs)

        try:
            values = json.loads(text, object_pairs_hook=no_repeats)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source} is not valid JSON: {e}") from None
        if not isinstance(values, dict):
            raise TypeError(f"{source}: expected a JSON object of keys, got {type(values).__name__}")
        return cls.from_dict(values)

    @classmethod
    def from_any(
        cls, config: ParallelConfig | Mapping[str, Any] | str | os.PathLike | None
    ) -> ParallelConfig:
        """``config`` as a ParallelConfig: the dataclass itself, a dict of keys, or a JSON file path.

        None gives the defaults (one data-parallel group sharding over every rank).
        """
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        if isinstance(config, Mapping):
            return cls.from_dict(config)
        if isinstance(config, (str, os.PathLike)):
            return cls.from_json(config)
        raise TypeError(
            "config: expected a ParallelConfig, a dict of keys or a JSON file path, "
            f"got {type(config).__name__}"
        )

    def to_dict(self) -> dict[str, Any]:
        """``{key: value}`` for every key; ``from_dict(to_dict())`` gives an equal config."""
        return dataclasses.asdict(self)

    def validate(self, world_size: int) -> dict[str, int]:
        """Check the degrees against ``world_size``; returns the size of every mesh dim (``DIM_NAMES``).

        Raises ValueError naming the key and the numbers, e.g.
        ``tensor_parallel_degree 3 does not divide world size 8``.
        """
        _check_int("world_size", world_size, 1)
        tp = self.tensor_parallel_degree
        if world_size % tp:
            raise ValueError(f"tensor_parallel_degree {tp} does not divide world size {world_size}")
        dp = world_size // tp
        why_dp = f"data-parallel size {dp} (world size {world_size} / tensor_parallel_degree {tp})"
        hsd = self.hybrid_shard_degree
        if hsd > dp:
            raise ValueError(f"hybrid_shard_degree {hsd} exceeds the {why_dp}")
        if hsd and dp % hsd:
            raise ValueError(f"hybrid_shard_degree {hsd} does not divide the {why_dp}")
        dp_shard = hsd or dp
        ep = self.expert_parallel_degree
        if dp_shard % ep:
            hint = (
                f"; set hybrid_shard_degree to 0 or a multiple of {ep} that divides {dp}"
                if dp % ep == 0
                else ""
            )
            raise ValueError(
                f"expert_parallel_degree {ep} does not divide dp_shard {dp_shard} (the sharding group, "
                f"hybrid_shard_degree {hsd} of the {why_dp}): expert parallelism is carved out of the "
                f"sharding group{hint}"
            )
        return {
            "dp_replicate": dp // dp_shard,
            "dp_shard": dp_shard,
            "dp": dp,
            "edp_shard": dp_shard // ep,
            "ep": ep,
            "tp": tp,
        }


@dataclasses.dataclass(frozen=True, eq=False)
class ParallelState:
    """What :func:`init` built on this rank.

    Attributes:
        config: the validated config.
        mesh: DeviceMesh with dims ``("dp_replicate", "dp_shard", "tp")``; FSDP2 takes
            ``mesh["dp_replicate", "dp_shard"]``, tensor-parallel layers ``mesh["tp"]``.
        dp_mesh: 1-D DeviceMesh ``"dp"`` (dp_replicate x dp_shard flattened), e.g. for the data loader.
        expert_mesh: DeviceMesh with dims ``("dp_replicate", "edp_shard", "ep", "tp")`` on the same
            root: expert weights go on ``expert_mesh["ep"]`` and FSDP2 takes
            ``expert_mesh["dp_replicate", "edp_shard"]`` for them.
        world_size, rank: of the default process group.
        device_type: the meshes' device type ("cuda" or "cpu").
        sizes: dim name -> size, for every name in ``DIM_NAMES``.
        coords: dim name -> this rank's coordinate along it (its rank within that dim's group).
        comm_max_sms: the config's ``comm_max_sms`` (None: ``smptk.comm``'s own setting); layers pass it
            to the collectives that take ``max_sms`` per call (0 for the copy-engine paths).

    Example (one process: a world of 1, where every size is 1; under torchrun every rank calls ``init``)::

        >>> import torch.distributed as dist
        >>> import smptk.parallel as sp
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> state = sp.init({"tensor_parallel_degree": 1})
        >>> state.world_size, state.rank, state.device_type, state.mesh.mesh_dim_names
        (1, 0, 'cpu', ('dp_replicate', 'dp_shard', 'tp'))
        >>> state.sizes["tp"], state.coords["tp"], state.ranks("tp")
        (1, 0, (0,))
        >>> sp.reset()
        >>> dist.destroy_process_group()
    """

    config: ParallelConfig
    mesh: Any
    dp_mesh: Any
    expert_mesh: Any
    world_size: int
    rank: int
    device_type: str
    sizes: Mapping[str, int]
    coords: Mapping[str, int]
    comm_max_sms: int | None

    def submesh(self, name: str):
        """The 1-D DeviceMesh of dim ``name`` (any of ``DIM_NAMES``) that holds this rank."""
        _check_dim(name)
        if name == "dp":
            return self.dp_mesh
        if name in MESH_DIMS:
            return self.mesh[name]
        return self.expert_mesh[name]

    def group(self, name: str) -> dist.ProcessGroup:
        """The ProcessGroup of dim ``name`` that holds this rank (what smptk.comm's calls take)."""
        return self.submesh(name).get_group()

    def ranks(self, name: str) -> tuple[int, ...]:
        """Global ranks of this rank's group along dim ``name``, in group-rank order."""
        return tuple(dist.get_process_group_ranks(self.group(name)))

    def seed_for(self, *dims: str) -> int:
        """A seed that differs across the ranks of ``dims`` and agrees across every other dim.

        ``seed_for()`` is ``random_seed`` (the same on every rank: parameter initialization).
        ``seed_for("tp")`` depends on this rank's tp coordinate only (the base of :meth:`fork_rng`'s
        dropout in sequence-parallel regions); the order of ``dims`` does not matter. A seed is the
        first 63 bits of a SHA-256 of ``random_seed`` and the named coordinates: the same on every run
        and machine, distinct per coordinate in practice (a collision is a 2**-63 event).
        """
        for d in dims:
            _check_dim(d)
        named = [d for d in DIM_NAMES if d in dims]
        if not named:
            return self.config.random_seed
        return _hash_seed(f"{self.config.random_seed}|" + ",".join(f"{d}={self.coords[d]}" for d in named))

    def symmetric_heaps(self) -> list[dict]:
        """The symmetric heaps this rank holds for the groups of this state's meshes (the dims' groups, in
        ``DIM_NAMES`` order, one entry per group and device type; see :func:`smptk.comm.heaps`), each with
        the dims it serves (``"dims"``). A group's heap exists from its first symmetric call, bounded by
        ``smptk.comm``'s ``heap_bytes``; ``sum(h["segment_bytes"] for h in ...)`` is this rank's total.

        Example (every rank of a 2-rank job; not a doctest: it needs the job)::

            state = smptk.parallel.init({"tensor_parallel_degree": 2})
            y, path = all_gather_linear(x, w, group=state.group("tp"))  # builds the tp group's heap
            [(h["dims"], h["heap_bytes"]) for h in state.symmetric_heaps()]  # [(("tp",), 67108864)]
        """
        from smptk import comm

        dims_of: dict[tuple[int, ...], list[str]] = {}
        for d in DIM_NAMES:
            dims_of.setdefault(self.ranks(d), []).append(d)
        return [{**h, "dims": tuple(dims_of[h["ranks"]])} for h in comm.heaps() if h["ranks"] in dims_of]

    def generator(self, *dims: str, device: str | torch.device = "cpu") -> torch.Generator:
        """A fresh ``torch.Generator`` on ``device`` seeded with :meth:`seed_for` ``(*dims)``.

        Not for dropout inside an activation-checkpointed unit: torch's checkpoint replays the default
        generators in its recompute, not a generator passed to an op, so the recompute draws other masks
        than the forward did and the gradients are wrong without an error. :meth:`fork_rng` is the
        region for that.
        """
        return torch.Generator(device=device).manual_seed(self.seed_for(*dims))

    @contextlib.contextmanager
    def fork_rng(self, *dims: str) -> Iterator[None]:
        """A region whose random ops (dropout) draw masks that differ across the ranks of ``dims`` and
        agree across every other dim, new at every call, and drawn again alike by activation checkpointing's
        recompute.

        Entering draws one number from torch's default CPU generator, the same draw on every rank (it stays
        in step, so the dropout of replicated activations outside the region keeps agreeing across ranks),
        and seeds the default generators of the CPU and, when the state's device type is "cuda", of the
        current CUDA device with a hash of that number and :meth:`seed_for` ``(*dims)``; leaving gives
        them back their states (``torch.random.fork_rng``). The draw gives every call (layer, step,
        micro-batch) masks of its own, and a checkpointed unit's recompute, which restores the default CPU
        generator before it runs the unit again, the forward's masks; a run resumed with
        :func:`smptk.parallel.load_checkpoint`, which restores that generator too, the uninterrupted
        run's. Use ``fork_rng("tp")`` around the dropout of a tp-sharded or sequence-parallel activation,
        whose tp ranks hold different elements (Megatron-LM's model-parallel region);
        ``fork_rng("dp", "tp")`` for masks of their own on every data-parallel rank as well.

        Under ``torch.compile``, Dynamo cannot trace the entry (host code: the seed's SHA-256, the draw,
        the generators' states): traced inline, everything from the region to the end of the compiled
        function runs eagerly, and ``fullgraph=True`` refuses it. Put the region in a function of its own
        marked ``@torch.compiler.disable``: the code before and after it compiles, with a graph break at
        the call.

        Example (one process: a world of 1)::

            >>> import torch
            >>> import torch.distributed as dist
            >>> import torch.nn.functional as F
            >>> import smptk.parallel as sp
            >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            >>> state = sp.init({"random_seed": 1})
            >>> x = torch.ones(2, 8)
            >>> with state.fork_rng("tp"):
            ...     a = F.dropout(x, 0.5)
            >>> with state.fork_rng("tp"):
            ...     b = F.dropout(x, 0.5)
            >>> torch.equal(a, b)          # a new mask at every call
            False
            >>> sp.reset()
            >>> dist.destroy_process_group()
        """
        base = self.seed_for(*dims)
        # on the CPU whatever the default device (torch.set_default_device("cuda") would draw from the CUDA
        # generator, which the recompute need not restore, and sync the host at .item())
        draw = int(torch.randint(1 << 62, (), dtype=torch.int64, device="cpu").item())
        seed = _hash_seed(f"fork_rng|{base}|{draw}")
        devices = [torch.cuda.current_device()] if self.device_type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.default_generator.manual_seed(seed)
            if devices:
                torch.cuda.manual_seed(seed)
            yield


def _hash_seed(text: str) -> int:
    """The first 63 bits of the SHA-256 of ``text``: a seed that is the same on every run and machine."""
    return int.from_bytes(hashlib.sha256(f"smptk-seed|{text}".encode()).digest()[:8], "little") >> 1


def _check_dim(name: object) -> None:
    if name not in DIM_NAMES:
        raise ValueError(
            f"dim: expected one of {', '.join(DIM_NAMES)}, got {name!r}{_did_you_mean(str(name), DIM_NAMES)}"
        )


_state: ParallelState | None = None
_saved_max_sms: int | None = None  # smptk.comm's max_sms before init changed it; reset() puts it back


def _default_device_type() -> str:
    """ "cuda" when the default group runs NCCL (alone or as the cuda backend), else "cpu"."""
    return "cuda" if "nccl" in str(dist.get_backend()).lower() else "cpu"


def init(
    config: ParallelConfig | Mapping[str, Any] | str | os.PathLike | None = None,
    *,
    device_type: str | None = None,
) -> ParallelState:
    """Check ``config`` against the running job, build the meshes, and make the state :func:`current`.

    Collective: every rank calls it with the same config, after ``torch.distributed.init_process_group``
    (torchrun sets up the environment it reads). Calling it again replaces the current state (the old
    meshes' process groups stay until ``destroy_process_group``).

    Args:
        config: a ParallelConfig, a dict of keys, a JSON file path, or None for the defaults.
        device_type: the meshes' device type; default "cuda" when the default group runs NCCL, else "cpu".

    Returns:
        The :class:`ParallelState` of this rank.
    """
    global _state, _saved_max_sms
    cfg = ParallelConfig.from_any(config)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "smptk.parallel.init needs torch.distributed's default process group: launch the script with "
            "torchrun (torchrun --nproc-per-node N train.py) and call "
            "torch.distributed.init_process_group() before init"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = cfg.validate(world)
    if device_type is None:
        device_type = _default_device_type()
    elif not isinstance(device_type, str):
        raise TypeError(
            f"device_type: expected a str such as 'cuda' or 'cpu', got {type(device_type).__name__}"
        )

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, tuple(sizes[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    if not hasattr(mesh, "_unflatten"):
        raise RuntimeError(
            f"torch {torch.__version__} has no DeviceMesh._unflatten, which smptk.parallel.init uses to "
            "build the expert mesh; use a newer torch"
        )
    # The dim by index: torch 2.11's _unflatten refuses every dim given by name (its name check is inverted).
    dp_shard = MESH_DIMS.index("dp_shard")
    expert_mesh = mesh._unflatten(dp_shard, (sizes["edp_shard"], sizes["ep"]), ("edp_shard", "ep"))
    coords = {d: mesh.get_local_rank(d) for d in MESH_DIMS}
    coords["dp"] = dp_mesh.get_local_rank()
    coords["edp_shard"] = expert_mesh.get_local_rank("edp_shard")
    coords["ep"] = expert_mesh.get_local_rank("ep")

    torch.manual_seed(cfg.random_seed)  # the model built next starts alike on every rank (module docstring)
    reset()  # a previous init's comm setting goes back before this config's applies
    if cfg.comm_max_sms:  # 0 is no default smptk.comm takes; None leaves its setting alone
        _saved_max_sms = int(comm.settings()["max_sms"])
        comm.configure(max_sms=cfg.comm_max_sms)
    _state = ParallelState(
        config=cfg,
        mesh=mesh,
        dp_mesh=dp_mesh,
        expert_mesh=expert_mesh,
        world_size=world,
        rank=rank,
        device_type=device_type,
        sizes=types.MappingProxyType({d: sizes[d] for d in DIM_NAMES}),
        coords=types.MappingProxyType({d: coords[d] for d in DIM_NAMES}),
        comm_max_sms=cfg.comm_max_sms,
    )
    return _state


def current() -> ParallelState:
    """The state of the last :func:`init` on this process; RuntimeError when there is none."""
    if _state is None:
        raise RuntimeError("no parallel state: call smptk.parallel.init(config) first (on every rank)")
    return _state


def state_or_current(state: object) -> ParallelState:
    """``state`` when it is a :class:`ParallelState`, :func:`current` for None; TypeError naming ``state``
    otherwise (a config dict or a :class:`ParallelConfig` passed where :func:`init`'s result belongs)."""
    if state is None:
        return current()
    if not isinstance(state, ParallelState):
        raise TypeError(
            f"state: expected the ParallelState of smptk.parallel.init (or None for current()), got "
            f"{type(state).__name__}"
        )
    return state


def is_initialized() -> bool:
    """True between :func:`init` and :func:`reset`.

    Example (one process; under torchrun every rank runs the same lines without the store arguments)::

        >>> import torch.distributed as dist
        >>> from smptk.parallel import init, is_initialized, reset
        >>> is_initialized()
        False
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> _ = init({"tensor_parallel_degree": 1})
        >>> is_initialized()
        True
        >>> reset()                                 # the process group stays: it is torch's
        >>> is_initialized(), dist.is_initialized()
        (False, True)
        >>> dist.destroy_process_group()
    """
    return _state is not None


def reset() -> None:
    """Forget the current state and give ``smptk.comm`` back the ``max_sms`` it had before :func:`init`.

    The meshes' process groups are torch's: they go with ``torch.distributed.destroy_process_group()``.
    """
    global _state, _saved_max_sms
    _state = None
    if _saved_max_sms is not None:
        comm.configure(max_sms=_saved_max_sms)
        _saved_max_sms = None
