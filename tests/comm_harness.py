"""Run a function on N gloo ranks on CPU, each in its own spawned process, with a hard wall-clock limit.

Used by ``tests/test_comm.py``: ``run_ranks("comm_jobs:job", world=3, timeout_s=120)`` spawns three processes
with ``torch.multiprocessing`` (start method "spawn"); each one

1. sets ``TRITON_INTERPRET=1`` and drops inherited ``SMPTK_COMM_*`` variables (then applies ``env``), before
   anything imports ``smptk`` — Triton reads the variable when ``smptk.kernels`` is imported, and the
   target is named as ``"module:function"`` so that unpickling it cannot import smptk any earlier;
2. joins a gloo process group through a TCPStore that the pytest process hosts on a port the OS picked
   (port 0), so no free-port guess can race with another job;
3. calls ``target(rank, world, *args)`` and writes ``("ok", value)`` or ``("error", traceback)`` to its own
   pickle file, which the pytest process reads back.

The pytest process waits until every rank exits, or one rank fails (then it gives the others a short
grace period to report their own errors, and kills them), or the deadline passes (then it kills all of
them): a hang fails the test with the ranks that never reported, it does not hang CI. Afterwards it
lists the ``/dev/shm/smptk-*`` entries the job left behind (the CPU symmetric heap unlinks its names once
every rank has mapped them, so there should be none, failed jobs included).

Example::

    >>> job = run_ranks("comm_jobs:smoke", world=2, timeout_s=60)
    >>> job.raise_for_failure()
    >>> job.values        # one return value per rank
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import importlib
import os
import pickle
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import torch.distributed as dist
import torch.multiprocessing as mp

SHM_PATTERN = "/dev/shm/smptk-*"
GRACE_S = 3.0  # after a rank fails: time for its peers to report their own errors before they are killed


@dataclass
class JobResult:
    """What came back from one :func:`run_ranks` job.

    Attributes:
        world: number of ranks.
        values: per rank, the target's return value (None where the rank did not return one).
        errors: rank -> traceback text (or why no result came back) for every rank that did not return.
        timed_out: the deadline passed with ranks still running (they were killed).
        wall_s: seconds from spawning the ranks to the last one exiting.
        exitcodes: per rank, the process exit code (negative: killed by that signal).
        leftover_shm: ``/dev/shm/smptk-*`` entries that appeared during the job and were still there after
            it (the harness removes the ones no process maps any more, so later jobs start clean).
        killed: ranks the harness killed (at the deadline, or after another rank failed).
    """

    world: int
    values: list = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    timed_out: bool = False
    wall_s: float = 0.0
    exitcodes: list = field(default_factory=list)
    leftover_shm: list[str] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and not self.timed_out

    def describe(self) -> str:
        lines = [f"job on {self.world} ranks: wall {self.wall_s:.1f} s, exit codes {self.exitcodes}"]
        if self.timed_out:
            lines.append(
                f"  TIMED OUT: ranks {self.killed} were still running at the deadline and were killed"
            )
        for rank, text in sorted(self.errors.items()):
            lines.append(f"  rank {rank} failed:\n" + "\n".join("    " + s for s in text.splitlines()))
        return "\n".join(lines)

    def raise_for_failure(self) -> None:
        """AssertionError with every rank's traceback unless every rank returned in time."""
        if not self.ok:
            raise AssertionError(self.describe())


def _shm_entries() -> set[str]:
    return set(glob.glob(SHM_PATTERN))


def _mapped_by_some_process(path: str) -> bool:
    """True when a process we can inspect still maps ``path`` (its /proc/PID/maps names it)."""
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                if path in f.read():
                    return True
        except OSError:
            continue
    return False


def _leftovers(before: set[str]) -> list[str]:
    """Entries new since ``before`` that persist (a concurrent job's name lives a few ms; wait that out)."""
    new = _shm_entries() - before
    if new:
        time.sleep(1.0)
        new &= _shm_entries()
    for path in new:
        if not _mapped_by_some_process(path):
            with contextlib.suppress(OSError):
                os.unlink(path)
    return sorted(new)


def _child(
    rank: int,
    world: int,
    port: int,
    target: str,
    args: tuple,
    outdir: str,
    env: dict[str, str],
    pg_timeout_s: float,
) -> None:
    """Entry point of every spawned rank (see the module docstring)."""
    os.environ["TRITON_INTERPRET"] = "1"
    for key in [k for k in os.environ if k.startswith("SMPTK_COMM_")]:
        del os.environ[key]
    os.environ.update(env)
    try:
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        module, name = target.split(":")
        value = getattr(importlib.import_module(module), name)(rank, world, *args)
        payload = ("ok", value)
    except BaseException:
        payload = ("error", traceback.format_exc())
    tmp = os.path.join(outdir, f".rank{rank}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(payload, f)
    os.replace(tmp, os.path.join(outdir, f"rank{rank}.pkl"))
    if dist.is_initialized():
        dist.destroy_process_group()
    if payload[0] == "error":
        raise SystemExit(1)


def run_ranks(
    target: str,
    world: int,
    *,
    args: tuple = (),
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    pg_timeout_s: float = 60.0,
) -> JobResult:
    """Run ``target(rank, world, *args)`` on ``world`` spawned gloo ranks; never waits past ``timeout_s``.

    Args:
        target: ``"module:function"``, importable from the tests directory (e.g. ``"comm_jobs:job"``).
        world: number of ranks.
        args: extra picklable arguments for the target.
        timeout_s: hard wall-clock limit for the whole job, spawning included.
        env: environment variables set in every rank before the target's module is imported.
        pg_timeout_s: the gloo process group's own timeout (a gloo call waiting on a dead peer).

    Returns:
        A :class:`JobResult`; it never raises for a failing rank (call ``raise_for_failure``).
    """
    shm_before = _shm_entries()
    outdir = tempfile.mkdtemp(prefix="smptk-comm-test-")
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    result = JobResult(world=world, values=[None] * world)
    start = time.monotonic()
    ctx = mp.start_processes(
        _child,
        args=(world, store.port, target, args, outdir, dict(env or {}), pg_timeout_s),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    procs = ctx.processes
    try:
        deadline = start + timeout_s
        failed_at = None
        while True:
            alive = [p for p in procs if p.exitcode is None]
            if not alive:
                break
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now >= min(failed_at + GRACE_S, deadline):
                break
            if now >= deadline:
                result.timed_out = True
                break
            wait([p.sentinel for p in alive], timeout=min(deadline - now, 0.5))
    finally:
        for rank, p in enumerate(procs):
            if p.exitcode is None:
                p.kill()
                result.killed.append(rank)
        for p in procs:
            p.join(10)
        result.wall_s = time.monotonic() - start
        result.exitcodes = [p.exitcode for p in procs]
        for f in ctx.error_files:  # torch's own per-process traceback files; ours carry the same text
            if f and os.path.exists(f):
                os.unlink(f)
        del store
    for rank in range(world):
        path = os.path.join(outdir, f"rank{rank}.pkl")
        if not os.path.exists(path):
            if rank in result.killed:
                why = "killed at the deadline" if result.timed_out else "killed after another rank failed"
            else:
                why = f"exit code {result.exitcodes[rank]}"
            result.errors[rank] = f"no result reported ({why})"
            continue
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        if status == "ok":
            result.values[rank] = value
        else:
            result.errors[rank] = value
    shutil.rmtree(outdir, ignore_errors=True)
    result.leftover_shm = _leftovers(shm_before)
    return result
