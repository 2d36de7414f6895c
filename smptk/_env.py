"""The environment a result was produced in: versions, GPUs, git state, world size, kernel path.

One function, :func:`collect_environment`, shared by ``smptk info`` and every benchmark row, so a number
can always be traced to the GPU, clocks, driver, library versions and commit that produced it.

Rules it keeps:

- **Never raises.** Each part is collected on its own; a part that fails becomes ``None`` (or, for GPUs,
  an empty list plus ``gpu_note`` saying why), so ``smptk info`` works on a laptop with no driver.
- **No personal data.** No hostname, user name or filesystem path is included: ``platform`` is the OS
  and libc string, git reports only the commit sha and a dirty flag, and GPUs are identified by model
  name (their UUID and PCI address are used only to match NVML devices with torch devices).
- **CUDA-only calls are guarded**: NVML (``pynvml`` from nvidia-ml-py) and ``torch.cuda`` are queried only
  when present; ``smptk.kernels`` is imported lazily, and triton not at all (its version comes from its
  package metadata).

Example::

    >>> from smptk._env import collect_environment
    >>> env = collect_environment()
    >>> env["gpus"], env["gpu_note"]  # on a machine without an NVIDIA driver
    ([], 'no NVIDIA driver found (NVML: NVML Shared Library Not Found)')
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

GIT_TIMEOUT_S = 3.0
_CHECKOUT = Path(__file__).resolve().parent.parent


def _torch_versions() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": None, "cuda": None, "nccl": None, "cuda_available": False}
    try:
        import torch
    except Exception as exc:  # torch is a dependency, but info must still print when it is broken
        out["torch_note"] = f"torch failed to import: {exc}"
        return out
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    try:
        out["cuda_available"] = bool(torch.cuda.is_available())
    except Exception:
        out["cuda_available"] = False
    if out["cuda_available"]:
        try:
            ver = torch.cuda.nccl.version()
            out["nccl"] = ".".join(str(part) for part in ver) if isinstance(ver, tuple) else str(ver)
        except Exception:
            out["nccl"] = None
    return out


def _triton_version() -> str | None:
    """The importable triton's version, read from its package metadata: importing triton (0.2 s, and its
    CUDA backend) is left to the first Triton-path call (:mod:`smptk.kernels._triton`)."""
    loaded = sys.modules.get("triton")
    if loaded is not None:
        return getattr(loaded, "__version__", None)
    try:
        from smptk.kernels import _triton

        if not _triton.available():
            return None
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version("triton")
        # A build that ships the module under another distribution name ("pytorch-triton").
        names = importlib.metadata.packages_distributions().get("triton")
        return importlib.metadata.version(names[0]) if names else None
    except Exception:
        pass
    return None


def _git_state(checkout: Path = _CHECKOUT) -> tuple[str | None, bool | None]:
    """(sha, dirty) of the checkout smptk is imported from; (None, None) when it is not a git checkout.

    git must report ``checkout`` itself as the top level: an installed copy inside some other repository
    (a site-packages under a home directory that is a git repo, say) must not report that repo's sha.
    """

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(
                ["git", "-C", str(checkout), *args],
                capture_output=True,
                text=True,
                timeout=GIT_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != checkout.resolve():
        return None, None
    sha = git("rev-parse", "HEAD")
    if sha is None:  # a repository with no commit yet
        return None, None
    # Untracked files count: a new source file changes what runs. Ignored files (results, venv) do not.
    status = git("status", "--porcelain")
    return sha, (None if status is None else bool(status))


def _world() -> tuple[int, int]:
    """(world_size, rank): torch.distributed when initialized, else WORLD_SIZE / RANK, else (1, 0)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
    except Exception:
        pass

    def env_int(name: str, default: int) -> int:
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default

    return env_int("WORLD_SIZE", 1), env_int("RANK", 0)


def _kernel_path() -> tuple[bool | None, dict[str, str] | str | None]:
    """(interpreter flag, runtime.describe()) from smptk.kernels.runtime, imported only now."""
    try:
        from smptk.kernels import runtime
    except Exception as exc:
        return None, f"smptk.kernels failed to import: {exc}"
    try:
        return runtime.interpreter_enabled(), runtime.describe()
    except Exception as exc:  # e.g. SMPTK_KERNELS set to an invalid value
        return runtime.interpreter_enabled(), f"error: {exc}"


def _settings() -> dict[str, Any]:
    """``{name: {"value", "set"}}`` of every variable in :data:`smptk.settings.VARIABLES` (bad values as
    "error: ...", paths as "<a path>": no personal data); the meanings stay in the table.

    A free-text value that holds a path or a URL (``SMPTK_TORCH_SPEC="torch @ file:///home/me/torch.whl"``,
    a pip requirement) is shown as "<a path>" too: benchmark rows carry this dict into committed results.
    """
    from smptk import settings

    out = {}
    for name, row in settings.snapshot().items():
        value, kind = row["value"], settings.VARIABLES[name].kind
        holds_path = kind == "text" and isinstance(value, str) and ("/" in value or "\\" in value)
        if row["set"] and (kind == "path" or holds_path):
            value = "<a path>"
        out[name] = {"value": value, "set": row["set"]}
    return out


def _norm_uuid(value: object) -> str:
    """Hex digits only: torch prints ``8-4-4-4-12`` hex, NVML the same after ``GPU-``."""
    text = str(value).strip().lower().removeprefix("gpu-")
    return re.sub(r"[^0-9a-f]", "", text)


def _torch_gpus() -> list[dict[str, Any]]:
    """Properties of the GPUs torch sees (index = torch device index); [] without CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        out = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out.append(
                {
                    "torch_index": i,
                    "name": props.name,
                    "sm_count": props.multi_processor_count,
                    "l2_cache_bytes": getattr(props, "L2_cache_size", None),
                    "compute_capability": f"{props.major}.{props.minor}",
                    "memory_total_bytes": props.total_memory,
                    "_uuid": _norm_uuid(getattr(props, "uuid", "")),
                }
            )
        return out
    except Exception:
        return []


def _nvml_gpus() -> tuple[list[dict[str, Any]], str | None]:
    """One dict per physical GPU from NVML, or ([], why) when NVML cannot be used."""
    try:
        import pynvml
    except Exception as exc:
        return [], f"nvidia-ml-py (pynvml) is not installed ({exc})"
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return [], f"no NVIDIA driver found (NVML: {exc})"
    gpus = []
    try:
        driver = _nvml_call(pynvml.nvmlSystemGetDriverVersion)
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = _nvml_call(pynvml.nvmlDeviceGetMemoryInfo, handle)
            gpus.append(
                {
                    "nvml_index": i,
                    "name": _nvml_call(pynvml.nvmlDeviceGetName, handle),
                    "memory_total_bytes": getattr(memory, "total", None),
                    "sm_clock_max_mhz": _nvml_call(
                        pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_SM
                    ),
                    "sm_clock_mhz": _nvml_call(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM),
                    "mem_clock_max_mhz": _nvml_call(
                        pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_MEM
                    ),
                    "driver_version": driver,
                    "_uuid": _norm_uuid(_nvml_call(pynvml.nvmlDeviceGetUUID, handle) or ""),
                }
            )
    except Exception as exc:
        return gpus, f"NVML query failed part-way: {exc}"
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return gpus, None


def _nvml_call(fn: Any, *args: Any) -> Any:
    try:
        value = fn(*args)
    except Exception:
        return None
    return value.decode() if isinstance(value, bytes) else value


def _merge_gpus(nvml: list[dict[str, Any]], torch_gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """NVML's list with torch's SM count and L2 size attached, matched by UUID.

    NVML numbers every GPU in the machine while torch numbers only those in CUDA_VISIBLE_DEVICES, so
    indices are matched by UUID; by position only when no UUID matches, the counts agree and
    CUDA_VISIBLE_DEVICES does not reorder or hide devices. GPUs torch sees but NVML does not (no NVML)
    are listed from torch alone.
    """
    by_uuid = {t["_uuid"]: t for t in torch_gpus if t["_uuid"]}
    any_match = any(gpu["_uuid"] in by_uuid for gpu in nvml)
    positional = not any_match and len(nvml) == len(torch_gpus) and not os.environ.get("CUDA_VISIBLE_DEVICES")
    merged = []
    for pos, gpu in enumerate(nvml):
        match = by_uuid.get(gpu["_uuid"]) or (torch_gpus[pos] if positional else None)
        entry = {k: v for k, v in gpu.items() if not k.startswith("_")}
        entry["torch_index"] = match["torch_index"] if match else None
        entry["sm_count"] = match["sm_count"] if match else None
        entry["l2_cache_bytes"] = match["l2_cache_bytes"] if match else None
        entry["compute_capability"] = match["compute_capability"] if match else None
        merged.append(entry)
    if not nvml:
        for t in torch_gpus:
            merged.append({k: v for k, v in t.items() if not k.startswith("_")})
    return merged


def collect_environment() -> dict[str, Any]:
    """Versions, GPUs, git state, world size and kernel path of this process, as a JSON-ready dict.

    Keys: ``smptk``, ``torch``, ``triton``, ``python``, ``cuda`` (torch.version.cuda), ``nccl``,
    ``cuda_available``, ``platform``, ``cpu_count``, ``git_sha``, ``git_dirty``, ``world_size``, ``rank``,
    ``interpreter`` (TRITON_INTERPRET), ``kernel_path`` (:func:`smptk.kernels.runtime.describe`),
    ``settings`` (every variable of :mod:`smptk.settings`: ``{name: {"value": ..., "set": bool}}``),
    ``gpus`` (one dict per GPU: ``name``, ``memory_total_bytes``, ``sm_count``, ``l2_cache_bytes``,
    ``sm_clock_max_mhz``, ``sm_clock_mhz``, ``mem_clock_max_mhz``, ``driver_version``, ``torch_index``...)
    ``gpu_note`` (None, or why ``gpus`` is empty or incomplete) and ``symmetric_heaps`` (this process's
    :func:`smptk.comm.heaps`; empty unless ``smptk.comm`` has built one here, so ``smptk info`` on the
    command line shows none and the same call inside a training job shows the job's). Never raises.

    Example::

        >>> env = collect_environment()
        >>> sorted(env)[:3]
        ['cpu_count', 'cuda', 'cuda_available']
    """
    from smptk import __version__

    env: dict[str, Any] = {"smptk": __version__}
    env.update(_torch_versions())
    env["triton"] = _triton_version()
    env["python"] = platform.python_version()
    env["platform"] = platform.platform()
    env["cpu_count"] = os.cpu_count()
    env["git_sha"], env["git_dirty"] = _git_state()
    env["world_size"], env["rank"] = _world()
    env["interpreter"], env["kernel_path"] = _kernel_path()
    env["settings"] = _settings()

    nvml, note = _nvml_gpus()
    torch_gpus = _torch_gpus()
    env["gpus"] = _merge_gpus(nvml, torch_gpus)
    if not env["gpus"] and note is None:
        note = "NVML reports no GPU"
    if nvml and not torch_gpus and note is None:
        note = "NVML sees GPUs but torch has no CUDA (CPU build of torch?); SM count and L2 size unknown"
    env["gpu_note"] = note
    env["python_implementation"] = sys.implementation.name
    env["symmetric_heaps"] = _symmetric_heaps()
    return env


def _symmetric_heaps() -> list[dict[str, Any]]:
    """:func:`smptk.comm.heaps` when smptk.comm is loaded in this process (never imported here), else []."""
    collectives = sys.modules.get("smptk.comm.collectives")
    if collectives is None:
        return []
    try:
        return [{**h, "ranks": list(h["ranks"])} for h in collectives.heaps()]
    except Exception:  # a torch.distributed state torn down under us: report none rather than raise
        return []


def current_sm_clock_mhz(nvml_index: int) -> int | None:
    """The SM clock of NVML device ``nvml_index`` now, in MHz; None without NVML. Never raises.

    Benchmarks sample it right after their timed rounds, so a throttled GPU shows in the row.

    Example (the value of an H100 SXM under load, its top boost clock: other GPUs read other clocks, and
    a machine without NVML reads None)::

        >>> current_sm_clock_mhz(0)  # an H100's; needs an NVIDIA GPU  # doctest: +SKIP
        1980
    """
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
        return _nvml_call(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM)
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def short_sha(env: dict[str, Any]) -> str:
    """The first 8 hex digits of ``env["git_sha"]``, or "nogit"."""
    sha = env.get("git_sha")
    return sha[:8] if sha else "nogit"
