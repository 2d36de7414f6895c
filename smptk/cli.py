"""The ``smptk`` command line (also ``python -m smptk``).

Subcommands:

- ``smptk info``: versions, GPUs, git state, which kernel path will run and the value of every
  ``SMPTK_*`` setting (:mod:`smptk.settings`), as readable text.
- ``smptk info --json``: the same as one JSON object (:func:`smptk._env.collect_environment`).
- ``smptk plan``: will a model fit, and which parallel configuration to use
  (:mod:`smptk.parallel.planner.report`): the per-GPU memory breakdown and ranked configurations, or
  ``--config`` to evaluate one; ``--json`` for programs. Exit status 0 when a configuration is
  recommended (``--config``: it fits), 3 when none is (it does not), 2 for bad input; the plan is printed
  either way (:mod:`smptk.parallel.planner.report`).

``info`` prints plain text only (no rich needed), so it prints the same in a terminal, a CI log or a bug
report; ``plan`` draws its tables with rich where it is installed.

Example::

    $ smptk info
    smptk 0.1.0  torch 2.13.0+cpu  triton 3.9.0  python 3.11.7
    ...
    GPUs: none (no GPU: no NVIDIA driver found (NVML: NVML Shared Library Not Found))
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _or_unknown(value: Any) -> str:
    return "?" if value is None else str(value)


def _meaning(name: str) -> str:
    """``"  -- what it does"`` from :data:`smptk.settings.VARIABLES`, or "" for a name not in the table."""
    from smptk.settings import VARIABLES

    var = VARIABLES.get(name)
    return f"  {var.meaning}" if var else ""


def format_info(env: dict[str, Any]) -> str:
    """Render :func:`smptk._env.collect_environment`'s dict as the text ``smptk info`` prints.

    Example::

        >>> from smptk._env import collect_environment
        >>> print(format_info(collect_environment()).splitlines()[0])
        smptk 0.1.0  torch 2.13.0+cpu  triton 3.9.0  python 3.11.7
    """
    lines = [
        f"smptk {env.get('smptk')}  torch {_or_unknown(env.get('torch'))}  "
        f"triton {env.get('triton') or 'not installed'}  python {env.get('python')}",
        f"CUDA (torch build): {env.get('cuda') or 'none (CPU build)'}   "
        f"CUDA available: {'yes' if env.get('cuda_available') else 'no'}   "
        f"NCCL: {env.get('nccl') or 'n/a'}",
        f"platform: {env.get('platform')}   CPUs: {_or_unknown(env.get('cpu_count'))}",
    ]
    sha = env.get("git_sha")
    if sha:
        dirty = {True: " (uncommitted changes)", False: " (clean)"}.get(env.get("git_dirty"), "")
        lines.append(f"git: {sha}{dirty}")
    else:
        lines.append("git: not a git checkout")
    lines.append(f"world size: {env.get('world_size')}   rank: {env.get('rank')}")

    path = env.get("kernel_path")
    if isinstance(path, dict):
        lines.append(
            f"kernels: SMPTK_KERNELS={path.get('requested')}  TRITON_INTERPRET={path.get('interpreter')}  "
            f"-> CPU tensors run {path.get('cpu')}, CUDA tensors run {path.get('cuda')}"
        )
    else:
        lines.append(f"kernels: {path}")

    table = env.get("settings")
    if isinstance(table, dict) and table:
        lines.append("settings (* = set in the environment, - = decided at run time; smptk.settings):")
        values = {
            name: "-" if row.get("value") is None else str(row.get("value")) for name, row in table.items()
        }
        name_w, value_w = max(map(len, values)), min(max(map(len, values.values())), 12)
        for name, row in table.items():
            mark = "*" if row.get("set") else " "
            lines.append(f"  {mark} {name:<{name_w}}  {values[name]:<{value_w}}{_meaning(name)}")

    heaps = env.get("symmetric_heaps") or []
    if heaps:
        total = sum(h.get("segment_bytes") or 0 for h in heaps)
        lines.append(f"symmetric heaps (this process): {len(heaps)}, {_fmt_bytes(total)} in all")
        for h in heaps:
            lines.append(
                f"  ranks {h.get('ranks')} (this rank {h.get('rank')})  {h.get('backend')}  data region "
                f"{_fmt_bytes(h.get('heap_bytes'))}  segment {_fmt_bytes(h.get('segment_bytes'))}  "
                f"calls {h.get('calls')}" + (f"  BROKEN: {h['broken']}" if h.get("broken") else "")
            )
    else:
        lines.append("symmetric heaps (this process): none")

    gpus = env.get("gpus") or []
    if not gpus:
        lines.append(f"GPUs: none (no GPU: {env.get('gpu_note') or 'unknown reason'})")
    else:
        lines.append(f"GPUs: {len(gpus)}")
        for i, gpu in enumerate(gpus):
            l2 = gpu.get("l2_cache_bytes")
            lines.append(
                f"  [{i}] {gpu.get('name')}  memory {_fmt_bytes(gpu.get('memory_total_bytes'))}  "
                f"SMs {_or_unknown(gpu.get('sm_count'))}  L2 {_fmt_bytes(l2) if l2 else '?'}  "
                f"CC {_or_unknown(gpu.get('compute_capability'))}  torch index "
                f"{_or_unknown(gpu.get('torch_index'))}"
            )
            lines.append(
                f"      SM clock {_or_unknown(gpu.get('sm_clock_mhz'))}/"
                f"{_or_unknown(gpu.get('sm_clock_max_mhz'))} MHz (now/max)  "
                f"memory clock max {_or_unknown(gpu.get('mem_clock_max_mhz'))} MHz  "
                f"driver {_or_unknown(gpu.get('driver_version'))}"
            )
        if env.get("gpu_note"):
            lines.append(f"  note: {env['gpu_note']}")
    return "\n".join(lines)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smptk",
        description="smptk: Triton kernels and parallelism for training large PyTorch models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="versions, GPUs, git state and which kernel path will run")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    from smptk.parallel.planner.report import add_arguments

    plan = sub.add_parser(
        "plan",
        help="per-GPU memory and recommended parallel configurations for a model on a cluster",
        description="Estimate per-GPU memory and rank parallel configurations (smptk.parallel.planner).",
        epilog="exit status: 0 when at least one configuration is recommended (with --config: when it fits); "
        "3 when none is (with --config: when it does not fit), the tables or --json object still printed; "
        "2 for bad input.",
    )
    add_arguments(plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``smptk`` console script; returns the process exit status.

    With no subcommand it prints the help to stderr and returns 2; ``plan`` returns 3 when no configuration
    fits (:mod:`smptk.parallel.planner.report`). Output into a pipe its reader closed
    (``smptk plan | head -1``) stops quietly with status 1, as the Python docs' recipe for SIGPIPE
    (Python ignores the signal, so the write raises BrokenPipeError): stdout is pointed at devnull so the
    interpreter's final flush cannot fail again, and no traceback is printed.

    Example (it prints what ``smptk info --json`` prints, then returns the exit status)::

        >>> main(["info", "--json"])   # one JSON object, sorted keys: "cpu_count", "cuda", ... "world_size"
        {
          "cpu_count": ...,
          "world_size": ...
        }
        0
    """
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        status = _run(parser, args)
        sys.stdout.flush()  # a closed pipe raises here rather than in the interpreter's exit
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return status


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "info":
        from smptk._env import collect_environment

        env = collect_environment()
        if args.json:
            print(json.dumps(env, indent=2, sort_keys=True, default=str))
        else:
            print(format_info(env))
        return 0
    if args.command == "plan":
        from smptk.parallel.planner.report import run

        return run(args)
    parser.error(f"unknown command {args.command!r}")  # argparse already rejects these; kept for safety
    return 2


if __name__ == "__main__":  # python -m smptk.cli, like python -m smptk
    sys.exit(main())
