"""smptk.comm: every collective against torch.distributed (gloo) on 2, 3 and 4 CPU ranks, plus the API
checks that need only this process.

Multi-rank tests. One spawned job per world size (``comm_harness.run_ranks("comm_jobs:run_job", W)``) runs
every case of ``comm_jobs.catalog(W)`` on W gloo ranks under Triton's interpreter, so the symmetric heap
(POSIX shared memory) and the very kernels the GPUs run are what is tested. Each test below reads one
case's outcome; the first test of a world size pays for its job (on 2 CPU cores: W=2 about 25 s, W=3 about
45 s, W=4 about 80 s). A job that crashes or passes its deadline fails every test of its world size with
every rank's traceback; a job that leaves ``/dev/shm/smptk-*`` entries fails ``test_job_leaves_no_shm``.
What each case checks is written in ``comm_jobs.py``.

Single-process tests: ``configure`` / ``settings`` / environment variables, and a one-rank gloo group made
in this process (FileStore) for ``last_path``, the four collectives at world size 1 and bad arguments.

Known smptk bugs are ``xfail(strict=True)`` with the bug in the reason, so fixing one turns its test into
an XPASS failure that asks for the marker to go.

Not tested here (no way to from inside one machine's CPU ranks): CUDA tensors and the "cuda" heap,
groups spanning machines.
"""

from __future__ import annotations

import re
import types

import pytest
import torch
import torch.distributed as dist
from comm_checks import HEAP_BYTES, expect_raises
from comm_harness import JobResult, run_ranks
from comm_jobs import bad_inputs, catalog
from helpers import NO_INTERPRETER_REASON
from torch import nn

import smptk.comm as comm
from smptk.comm import collectives
from smptk.kernels import runtime

WORLDS = (2, 3, 4)
JOB_DEADLINE_S = {2: 150, 3: 240, 4: 400}  # about 5x the measured wall time on 2 CPU cores

_jobs: dict[int, JobResult] = {}


def job(world: int) -> JobResult:
    """The W-rank job, run once per pytest session (the first test that needs it waits for it)."""
    if world not in _jobs:
        _jobs[world] = run_ranks("comm_jobs:run_job", world, timeout_s=JOB_DEADLINE_S[world])
    return _jobs[world]


def assert_case(world: int, cid: str) -> None:
    """Fail with every rank's complaint unless case ``cid`` ran and passed on all W ranks."""
    result = job(world)
    result.raise_for_failure()
    problems = []
    for rank, outcomes in enumerate(result.values):
        if cid not in outcomes:
            problems.append(f"rank {rank}: case not run")
        elif outcomes[cid] is not None:
            problems.append(f"rank {rank}:\n  " + outcomes[cid].replace("\n", "\n  "))
    assert not problems, f"{cid} on {world} ranks:\n" + "\n".join(problems)


def cases(*families: str, xfail: dict[tuple[int, str], str] | None = None) -> list:
    """pytest params ``(world, case id)`` for every case of these families, ids like ``W3-all_reduce-...``."""
    params = []
    for world in WORLDS:
        for spec in catalog(world):
            if spec.family in families:
                reason = (xfail or {}).get((world, spec.cid))
                marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
                params.append(pytest.param(world, spec.cid, id=f"W{world}-{spec.cid}", marks=marks))
    return params


# ------------------------------------------------------------------------------------ multi-rank tests


@pytest.mark.parametrize(("world", "cid"), cases("all_reduce"))
def test_all_reduce_matches_gloo(world: int, cid: str) -> None:
    """Every dtype x op x algorithm; sizes 0, 1, 7, one past the heap (exact) and 1001 (N(0,1), tolerance)."""
    assert_case(world, cid)


@pytest.mark.parametrize(("world", "cid"), cases("all_reduce_shape"))
def test_all_reduce_shapes_and_max_sms(world: int, cid: str) -> None:
    """0-d and 2-d tensors; max_sms 1, 3 and 5 over 4 interpreter tiles (fewer, uneven, more programs)."""
    assert_case(world, cid)


@pytest.mark.parametrize(("world", "cid"), cases("nan"))
def test_max_and_min_propagate_nan(world: int, cid: str) -> None:
    """A NaN on any rank is every rank's max / min there (torch.amax's rule), all-reduce and reduce-scatter,
    with the op given as ``dist.ReduceOp``."""
    assert_case(world, cid)


@pytest.mark.parametrize(("world", "cid"), cases("reduce_scatter", "reduce_scatter_shape"))
def test_reduce_scatter_matches_gloo(world: int, cid: str) -> None:
    assert_case(world, cid)


@pytest.mark.parametrize(("world", "cid"), cases("all_gather", "all_gather_shape"))
def test_all_gather_matches_gloo(world: int, cid: str) -> None:
    assert_case(world, cid)


@pytest.mark.parametrize(("world", "cid"), cases("all_to_all", "all_to_all_equal"))
def test_all_to_all_matches_gloo(world: int, cid: str) -> None:
    """Uneven splits with zero-size splits and [3, 2] rows, silent ranks, segments past the heap, None."""
    assert_case(world, cid)


@pytest.mark.parametrize(("world", "cid"), cases("split_mismatch"))
def test_all_to_all_splits_that_disagree_raise_on_every_rank(world: int, cid: str) -> None:
    """Send and receive splits that disagree between ranks (same totals): CommMismatchError on every rank,
    naming each pair and its sizes (kernel and copy-engine paths); the next call works."""
    assert_case(world, cid)


@pytest.mark.parametrize(("world", "cid"), cases("aliased"))
def test_output_over_input_matches_gloo_on_separate_tensors(world: int, cid: str) -> None:
    """The in-place all-gather and reduce-scatter, and outputs over inputs in other ways (all-to-all
    output = input): gloo's result on separate tensors, on the kernel, copy-engine and fallback paths."""
    assert_case(world, cid)


@pytest.mark.parametrize(("world", "cid"), cases("interleaved"))
def test_interleaved_calls_reuse_signal_pads(world: int, cid: str) -> None:
    assert_case(world, cid)


@pytest.mark.parametrize(("world", "cid"), cases("subgroup", "subgroup_non_member"))
def test_sub_group_collectives(world: int, cid: str) -> None:
    """Ranks 1..W-1 as their own group (own heap, group ranks) next to the default group; rank 0,
    outside it, gets an error naming ``group``."""
    assert_case(world, cid)


@pytest.mark.parametrize(("world", "cid"), cases("fallback"))
def test_fallback_runs_gloo_and_says_so(world: int, cid: str) -> None:
    """float64 (all four collectives) and int32 avg: gloo's result, last_path() 'torch.distributed:gloo'."""
    assert_case(world, cid)


@pytest.mark.parametrize(("world", "cid"), cases("bad_input", "usable_after_errors"))
def test_bad_input_raises_on_every_rank(world: int, cid: str) -> None:
    """The error names the argument; afterwards the group still runs collectives (no rank desynced)."""
    assert_case(world, cid)


@pytest.mark.parametrize(
    ("world", "cid"),
    cases("missing_rank", "missing_at_build"),
)
def test_rank_that_never_calls(world: int, cid: str) -> None:
    """CommTimeoutError naming exactly the skipping rank within [timeout_s, 2 timeout_s]; then CommError
    at once on the broken heap and from check(); reset() on every rank makes the group work again. The
    same when the missing call is the group's first, which builds its heap (a late rank raises too)."""
    assert_case(world, cid)


@pytest.mark.parametrize(("world", "cid"), cases("late_watchdog"))
def test_a_watchdog_that_fires_as_a_call_ends_does_not_fail_the_next(world: int, cid: str) -> None:
    """Under the interpreter a host timer sets the abort word when a launch outlasts timeout_s; one that
    fires after the launch's last wait leaves that call a success, and the next call must not find the
    word still set (it gave up at once, naming live peers)."""
    assert_case(world, cid)


@pytest.mark.parametrize(("world", "cid"), cases("heap_build"))
def test_a_heap_build_that_fails_on_one_rank_raises_on_every_rank(world: int, cid: str) -> None:
    """Another heap_bytes on one rank: CommMismatchError naming it; one rank's /dev/shm full: CommError
    naming it; both on every rank, nothing left in /dev/shm (test_job_leaves_no_shm), then usable."""
    assert_case(world, cid)


@pytest.mark.parametrize(("world", "cid"), cases("mismatch"))
def test_calls_that_differ_between_ranks(world: int, cid: str) -> None:
    """One rank's call differs (dtype, numel, op, algorithm, max_sms, collective): CommMismatchError on
    every rank within seconds, naming the ranks and both calls; CommError until reset(); then usable."""
    assert_case(world, cid)


@pytest.mark.parametrize("world", WORLDS, ids=[f"W{w}" for w in WORLDS])
def test_job_leaves_no_shm(world: int) -> None:
    result = job(world)
    assert result.leftover_shm == [], f"left in /dev/shm after the {world}-rank job: {result.leftover_shm}"


# --------------------------------------------------------------------------------- the harness itself


def test_a_peer_that_moves_on_during_the_call_check_is_no_mismatch() -> None:
    """The call check reads a peer's tag, then its numel / chunk words: a peer that finished the call and
    announced its next one in between made the words the next call's, and identical calls raised a false
    CommMismatchError. The check now counts the words only when the tag, read again after them, is the
    same (see comm_jobs.peer_moves_on_while_read for the pauses that open the window)."""
    result = run_ranks("comm_jobs:peer_moves_on_while_read", 2, timeout_s=150)
    result.raise_for_failure()
    assert [v["error"] for v in result.values] == [None, None], result.values
    assert result.values[0]["slow_reads"] > 0, "the window was never opened: rank 0 did not poll rank 1"


def test_harness_reports_failing_rank_and_kills_its_peer() -> None:
    """Rank 1 raises while rank 0 waits for it inside a kernel: the job fails fast with rank 1's traceback,
    rank 0 is killed, and killing a rank mid-collective leaves nothing in /dev/shm."""
    result = run_ranks("comm_jobs:fail_while_peer_waits", 2, timeout_s=60)
    assert not result.ok
    assert not result.timed_out
    assert "planted failure on rank 1" in result.errors[1]
    assert result.killed == [0], result.describe()
    assert result.wall_s < 30, f"took {result.wall_s:.1f} s to notice a failed rank"
    assert result.leftover_shm == []
    with pytest.raises(AssertionError, match="planted failure on rank 1"):
        result.raise_for_failure()


def test_harness_deadline_kills_a_hung_job() -> None:
    """Both ranks hang (rank 0 in a kernel with timeout_s=300): the harness kills them at its deadline."""
    result = run_ranks("comm_jobs:hang", 2, timeout_s=12)
    assert result.timed_out
    assert result.killed == [0, 1], result.describe()
    assert 12 <= result.wall_s < 25, f"wall {result.wall_s:.1f} s for a 12 s deadline"
    assert result.leftover_shm == []
    with pytest.raises(AssertionError, match="TIMED OUT"):
        result.raise_for_failure()


# ------------------------------------------------------------------------------- single-process tests

COMM_ENV = ("SMPTK_COMM_MAX_SMS", "SMPTK_COMM_TIMEOUT_S", "SMPTK_COMM_HEAP_BYTES", "SMPTK_COMM_COPY_PATH")
DEFAULTS = {"max_sms": 8, "timeout_s": 300.0, "heap_bytes": 64 * 1024 * 1024, "copy_path": "pointer"}


@pytest.fixture
def fresh_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """No SMPTK_COMM_* variables and no settings read yet; the process's settings come back afterwards.

    Settings are read from the environment once per process, on first use, so re-reading them in this
    process means forgetting the private ``collectives._settings`` (monkeypatch restores it).
    """
    for name in COMM_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(collectives, "_settings", None)


@pytest.fixture
def world1(tmp_path, fresh_settings):
    """A one-rank gloo group in this process (FileStore), with the jobs' small heap."""
    assert not dist.is_initialized(), "another test left a process group initialized"
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    comm.configure(max_sms=2, timeout_s=30, heap_bytes=HEAP_BYTES)
    try:
        yield dist.group.WORLD
    finally:
        comm.reset()
        dist.destroy_process_group()


needs_interpreter = pytest.mark.skipif(not runtime.interpreter_enabled(), reason=NO_INTERPRETER_REASON)


def test_fallback_all_gather_takes_a_stacked_output(world1) -> None:
    """float64 takes torch's path; its output may be ``[world, *input.shape]``, as on the heap path."""
    x = torch.arange(6, dtype=torch.float64).view(2, 3)
    out = torch.full((1, 2, 3), float("nan"), dtype=torch.float64)
    comm.all_gather_into_tensor(out, x)
    assert comm.last_path() == "torch.distributed:gloo"
    assert torch.equal(out[0], x)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint16, torch.uint32])
def test_fallback_reduces_the_integers_gloo_lacks(world1, dtype: torch.dtype) -> None:
    """gloo cannot reduce int16, uint16 or uint32 (its "Invalid scalar type" named no argument): the fallback
    reduces them in int64 and writes the values back, the dtype's extremes included."""
    info = torch.iinfo(dtype)
    values = torch.tensor([info.min, info.max, 7], dtype=torch.int64)
    for op in ("sum", "max", "min", "avg"):
        t = values.to(dtype)
        assert comm.all_reduce(t, op=op) is t and t.dtype == dtype
        assert comm.last_path() == "torch.distributed:gloo"
        assert torch.equal(t.long(), values), op
        out = torch.zeros(3, dtype=dtype)
        comm.reduce_scatter_tensor(out, values.to(dtype), op=op)
        assert torch.equal(out.long(), values), op


def test_fallback_refuses_what_gloo_cannot_reduce(world1) -> None:
    """A dtype gloo cannot reduce, even through int64, is refused naming the argument and the dtype."""
    for dtype in (torch.uint64, torch.float8_e4m3fn):
        with pytest.raises(
            TypeError, match=rf"^tensor: dtype {dtype} cannot be reduced on torch.distributed:gloo"
        ):
            comm.all_reduce(torch.zeros(4, dtype=dtype))
        with pytest.raises(TypeError, match=rf"^output: dtype {dtype} cannot be reduced"):
            comm.reduce_scatter_tensor(torch.zeros(4, dtype=dtype), torch.zeros(4, dtype=dtype))


@pytest.mark.parametrize("kind", sorted(collectives._KIND_CODES))
def test_call_tags_name_what_each_rank_called(kind: str) -> None:
    """A mismatch message decodes every field of a call's tag; the fused TP linears have kinds of their own,
    so a rank in the all-gather GEMM and a rank in a plain all-gather of the same size read differently."""
    call = collectives._Call(
        kind, torch.bfloat16, 2 if kind.startswith(("all_reduce", "reduce")) else -1, 96, 48
    )
    tag = call.tag(seq=123456, programs=256)
    text = collectives._describe_call(tag, call.numel, call.chunk)
    assert text.startswith(f"call #123456: {kind} bfloat16 ("), text
    assert "max_sms=256" in text
    assert ("op=max" in text) == (call.op == 2), text
    others = {
        collectives._Call(k, torch.bfloat16, call.op, 96, 48).tag(123456, 256)
        for k in collectives._KIND_CODES
    }
    assert len(others) == len(collectives._KIND_CODES), "two kinds share a tag"
    assert (
        tag < 1 << 63
        and tag & ((1 << collectives.SEQ_SHIFT) - 1)
        == tag - (123456 << collectives.SEQ_SHIFT) - collectives._TAG_MARK
    )


def _gpu(name: str, sms: int):
    return types.SimpleNamespace(name=name, multi_processor_count=sms, regs_per_multiprocessor=65536,
                                 max_threads_per_multi_processor=2048)  # fmt: skip


def test_resident_programs_follow_registers_and_sm_count() -> None:
    """8 warps x 128 registers: 2 programs per SM (64 K registers), so 264 on an H100 and 216 on an A100."""
    options = {"num_warps": 8, "maxnreg": 128}
    assert collectives.resident_programs(_gpu("H100", 132), options) == 264
    assert collectives.resident_programs(_gpu("A100", 108), options) == 216
    assert collectives.resident_programs(_gpu("A100", 108), {"num_warps": 4, "maxnreg": 128}) == 432
    assert collectives.resident_programs(_gpu("A100", 108), {"num_warps": 8, "maxnreg": 255}) == 108


def test_more_programs_than_fit_are_refused_on_cuda(monkeypatch) -> None:
    """A launch whose programs cannot all be resident could leave one waiting for a peer's program queued
    behind it, so it is refused, naming the GPU and the limit; CPU heaps (no residency) are not checked."""
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: _gpu("NVIDIA A100-SXM4-80GB", 108)
    )
    collectives._resident_on.cache_clear()  # asked once per device: no answer from before this fake GPU
    kernel = types.SimpleNamespace(launch_options={"num_warps": 8, "maxnreg": 128})
    collectives._check_resident(kernel, 216, torch.device("cuda", 0))
    with pytest.raises(
        ValueError, match=r"217 programs do not all fit on NVIDIA A100-SXM4-80GB .*max_sms <= 216"
    ):
        collectives._check_resident(kernel, 217, torch.device("cuda", 0))
    collectives._check_resident(kernel, 256, torch.device("cpu"))
    collectives._check_resident(types.SimpleNamespace(), 256, torch.device("cuda", 0))  # no launch options
    collectives._resident_on.cache_clear()  # nor after it


def test_settings_defaults(fresh_settings) -> None:
    assert comm.settings() == DEFAULTS


def test_configure_changes_only_what_it_is_given(fresh_settings) -> None:
    comm.configure(max_sms=3)
    assert comm.settings() == {**DEFAULTS, "max_sms": 3}
    comm.configure(timeout_s=2.5, heap_bytes=8192)
    assert comm.settings() == {"max_sms": 3, "timeout_s": 2.5, "heap_bytes": 8192, "copy_path": "pointer"}
    comm.configure(copy_path="tma")
    assert comm.settings() == {"max_sms": 3, "timeout_s": 2.5, "heap_bytes": 8192, "copy_path": "tma"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_sms": 0}, "max_sms: expected 1..256, got 0"),
        ({"max_sms": 257}, "max_sms: expected 1..256, got 257"),
        ({"max_sms": -4}, "max_sms: expected 1..256, got -4"),
        ({"timeout_s": 0}, "timeout_s: expected seconds in (0, 1e+06], got 0.0"),
        ({"timeout_s": -1}, "timeout_s: expected seconds in (0, 1e+06]"),
        ({"timeout_s": float("nan")}, "timeout_s: expected seconds in (0, 1e+06], got nan"),
        ({"heap_bytes": 4080}, "heap_bytes: expected a multiple of 16 of at least 4096, got 4080"),
        ({"heap_bytes": 4100}, "heap_bytes: expected a multiple of 16 of at least 4096, got 4100"),
        ({"heap_bytes": 0}, "heap_bytes: expected a multiple of 16 of at least 4096, got 0"),
        ({"max_sms": 4, "heap_bytes": 1}, "heap_bytes: expected"),  # nothing of a rejected call applies
        ({"copy_path": "cp.async"}, "copy_path: expected one of ('pointer', 'tma'), got 'cp.async'"),
        # were accepted: int(65536.5) and int("65536") as 65536, float(True) as a 1 s timeout
        ({"heap_bytes": 65536.5}, "heap_bytes: expected an integer, got 65536.5"),
        ({"heap_bytes": "65536"}, "heap_bytes: expected an integer, got '65536'"),
        ({"timeout_s": True}, "timeout_s: expected a number, got True"),
        ({"timeout_s": "30"}, "timeout_s: expected a number, got '30'"),
    ],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else "",
)
def test_configure_rejects_bad_values_and_changes_nothing(fresh_settings, kwargs, message) -> None:
    comm.configure(max_sms=5, timeout_s=7, heap_bytes=8192)
    before = comm.settings()
    with pytest.raises(ValueError, match=re.escape(message)):
        comm.configure(**kwargs)
    assert comm.settings() == before


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e12, 0.0, -1.0])
def test_unusable_timeouts_are_rejected(fresh_settings, value) -> None:
    before = comm.settings()
    with pytest.raises(ValueError, match="timeout_s"):
        comm.configure(timeout_s=value)
    assert comm.settings() == before


def test_env_vars_are_read_on_first_use(monkeypatch, fresh_settings) -> None:
    monkeypatch.setenv("SMPTK_COMM_MAX_SMS", " 4 ")
    monkeypatch.setenv("SMPTK_COMM_TIMEOUT_S", "2.5")
    monkeypatch.setenv("SMPTK_COMM_HEAP_BYTES", "8192")
    monkeypatch.setenv("SMPTK_COMM_COPY_PATH", "TMA")
    assert comm.settings() == {"max_sms": 4, "timeout_s": 2.5, "heap_bytes": 8192, "copy_path": "tma"}
    monkeypatch.setenv("SMPTK_COMM_MAX_SMS", "6")  # read once: later changes do not apply
    assert comm.settings()["max_sms"] == 4
    comm.configure(max_sms=7)  # configure() overrides the environment
    assert comm.settings() == {"max_sms": 7, "timeout_s": 2.5, "heap_bytes": 8192, "copy_path": "tma"}


def test_blank_env_vars_mean_defaults(monkeypatch, fresh_settings) -> None:
    for name in COMM_ENV:
        monkeypatch.setenv(name, "  ")
    assert comm.settings() == DEFAULTS


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("SMPTK_COMM_MAX_SMS", "four", "SMPTK_COMM_MAX_SMS='four': expected an integer"),
        ("SMPTK_COMM_MAX_SMS", "4.0", "SMPTK_COMM_MAX_SMS='4.0': expected an integer"),
        ("SMPTK_COMM_TIMEOUT_S", "30s", "SMPTK_COMM_TIMEOUT_S='30s': expected a number"),
        ("SMPTK_COMM_HEAP_BYTES", "64MiB", "SMPTK_COMM_HEAP_BYTES='64MiB': expected an integer"),
        ("SMPTK_COMM_MAX_SMS", "0", "SMPTK_COMM_MAX_SMS='0': expected an integer >= 1"),
        ("SMPTK_COMM_MAX_SMS", "300", "SMPTK_COMM_MAX_SMS='300': expected an integer >= 1, <= 256"),
        ("SMPTK_COMM_TIMEOUT_S", "-3", "SMPTK_COMM_TIMEOUT_S='-3': expected a finite number > 0"),
        ("SMPTK_COMM_TIMEOUT_S", "2e6", "SMPTK_COMM_TIMEOUT_S='2e6': expected a number <= 1e+06"),
        ("SMPTK_COMM_HEAP_BYTES", "1000", "SMPTK_COMM_HEAP_BYTES='1000': expected an integer >= 4096"),
        (
            "SMPTK_COMM_HEAP_BYTES",
            "5000",
            "SMPTK_COMM_HEAP_BYTES='5000': expected an integer >= 4096, a multiple",
        ),
        ("SMPTK_COMM_COPY_PATH", "fast", "SMPTK_COMM_COPY_PATH='fast': expected one of 'pointer', 'tma'"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_env_vars_raise_naming_them(monkeypatch, fresh_settings, name, value, message) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        comm.settings()


def test_configure_replaces_a_bad_env_var_before_first_use(monkeypatch, fresh_settings) -> None:
    """A value given to configure replaces its variable, which is then not read: a bad SMPTK_COMM_MAX_SMS or
    SMPTK_COMM_TIMEOUT_S used to fail configure(max_sms=4) itself. A bad variable nothing replaces still
    raises, naming it, and the settings stay unread."""
    monkeypatch.setenv("SMPTK_COMM_MAX_SMS", "300")
    monkeypatch.setenv("SMPTK_COMM_TIMEOUT_S", "abc")
    with pytest.raises(ValueError, match=re.escape("SMPTK_COMM_TIMEOUT_S='abc': expected a number")):
        comm.configure(max_sms=4)
    with pytest.raises(ValueError, match=re.escape("SMPTK_COMM_MAX_SMS='300'")):
        comm.settings()
    comm.configure(max_sms=4, timeout_s=30)
    assert comm.settings() == {**DEFAULTS, "max_sms": 4, "timeout_s": 30.0}


def test_configure_reads_values_as_the_variables_do(fresh_settings) -> None:
    """copy_path in any case (as SMPTK_COMM_COPY_PATH), numpy integers and integral floats for counts; an
    infinite max_sms is "expected an integer" (it was an OverflowError)."""
    import numpy as np

    comm.configure(copy_path=" TMA", max_sms=np.int64(6), heap_bytes=8192.0, timeout_s=np.float32(2.5))
    assert comm.settings() == {"max_sms": 6, "timeout_s": 2.5, "heap_bytes": 8192, "copy_path": "tma"}
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match=re.escape(f"max_sms: expected an integer, got {bad}")):
            comm.configure(max_sms=bad)
    with pytest.raises(ValueError, match="copy_path: expected one of"):
        comm.configure(copy_path=1)


def test_collectives_need_an_initialized_process_group(fresh_settings) -> None:
    assert not dist.is_initialized(), "another test left a process group initialized"
    with pytest.raises(RuntimeError, match=re.escape("needs torch.distributed to be initialized")):
        comm.all_reduce(torch.ones(2))


@needs_interpreter
def test_world1_collectives_take_the_symmetric_path(world1) -> None:
    """World size 1: reductions are the identity (avg divides by 1), gathers and all-to-all are copies."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32):
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(-50, 50, (1001,), generator=gen).to(dtype)
        big = torch.randint(-50, 50, (HEAP_BYTES // x.element_size() + 5,), generator=gen).to(dtype)
        for inp in (x, big):
            for op in ("sum", "max", "min") + (("avg",) if dtype.is_floating_point else ()):
                for algorithm in ("one_shot", "two_shot"):
                    y = inp.clone()
                    comm.all_reduce(y, op=op, algorithm=algorithm)
                    assert comm.last_path() == "symmetric"
                    assert torch.equal(y, inp), (dtype, op, algorithm, inp.numel())
            out = torch.full_like(inp, float("nan") if dtype.is_floating_point else -1)
            comm.all_gather_into_tensor(out, inp)
            assert comm.last_path() == "symmetric"
            assert torch.equal(out, inp)
            out = torch.full_like(inp, float("nan") if dtype.is_floating_point else -1)
            comm.reduce_scatter_tensor(out, inp)
            assert comm.last_path() == "symmetric"
            assert torch.equal(out, inp)
            rows = inp[: 3 * (inp.numel() // 3)].view(-1, 3)
            out = torch.full_like(rows, float("nan") if dtype.is_floating_point else -1)
            comm.all_to_all_single(out, rows, [rows.shape[0]], [rows.shape[0]])
            assert comm.last_path() == "symmetric"
            assert torch.equal(out, rows)


@needs_interpreter
def test_heaps_are_reported_in_process(world1) -> None:
    """comm.heaps(), and smptk info's environment, list the group's heap from its first symmetric call."""
    from smptk._env import collect_environment
    from smptk.cli import format_info
    from smptk.kernels.heap_layout import DATA_OFFSET

    assert comm.heaps() == []
    comm.all_reduce(torch.ones(8))
    comm.all_reduce(torch.ones(8))
    want = {"ranks": (0,), "rank": 0, "world_size": 1, "backend": "cpu", "heap_bytes": HEAP_BYTES}
    want |= {"segment_bytes": DATA_OFFSET + HEAP_BYTES, "calls": 2, "broken": None}
    assert comm.heaps() == [want]
    env = collect_environment()
    assert env["symmetric_heaps"] == [dict(want, ranks=[0])]
    assert "symmetric heaps (this process): 1," in format_info(env)
    comm.reset()
    assert comm.heaps() == []
    # segment_bytes is what the rank allocated: whole 4 KiB pages (4112 bytes of data take 8192)
    comm.configure(heap_bytes=4112)
    comm.all_reduce(torch.ones(8))
    (heap,) = comm.heaps()
    assert heap["heap_bytes"] == 4112 and heap["segment_bytes"] == DATA_OFFSET + 8192
    comm.reset()


@needs_interpreter
def test_a_destroyed_groups_heap_is_released(world1) -> None:
    """A group destroyed while something keeps its object alive (DTensor's caches keep the groups of the
    meshes it ran on): its heap is closed at the next comm.heaps() or heap build, and heaps() no longer
    asks torch for the ranks of a group it forgot (a bare KeyError, which hid a heap still mapped)."""
    from smptk.comm import collectives

    g = dist.new_group([0])
    x = torch.ones(8)
    comm.all_reduce(x, group=g)
    heap = collectives._heaps[g]["cpu"]
    assert len(comm.heaps()) == 1 and heap.segments
    dist.destroy_process_group(g)  # ``g`` itself stays referenced here
    assert comm.heaps() == [] and g not in collectives._heaps and not heap.segments
    comm.all_reduce(x)  # the default group's heap builds as usual
    assert [h["ranks"] for h in comm.heaps()] == [(0,)]
    comm.reset()


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["symmetric", "fallback"])
def test_world1_collectives_under_torch_compile(world1, dtype: torch.dtype) -> None:
    """Called inside a ``torch.compile``d function, each in-place collective is a graph break and gives the
    eager result, which the code after it reads (Dynamo used to trace into the launch and fail)."""

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        comm.all_reduce(y, op="max")
        gathered = y.new_empty(y.numel())
        comm.all_gather_into_tensor(gathered, y + 1)
        scattered = y.new_empty(y.numel())
        comm.reduce_scatter_tensor(scattered, gathered * 3)
        swapped = torch.empty_like(scattered)
        comm.all_to_all_single(swapped, scattered - 1)
        return swapped.square()

    x = torch.arange(10, dtype=dtype) - 4
    torch._dynamo.reset()
    got = torch.compile(step, backend="eager")(x)
    assert comm.last_path() == ("symmetric" if dtype == torch.float32 else "torch.distributed:gloo")
    assert torch.equal(got, step(x))
    assert torch.equal(got, ((x * 2 + 1) * 3 - 1).square())


def test_calls_on_one_cuda_heap_are_ordered_across_streams(monkeypatch) -> None:
    """The ordering logic of a CUDA heap, on CPU with stand-in streams and events (no GPU here): a launch
    from another stream waits for the event recorded after the heap's latest launch (FSDP2 runs a group's
    all-gathers and reduce-scatters on two streams; overlapping on one heap, one would stage over the
    other's data). A CPU heap and a simulated world order nothing (their calls are synchronous)."""

    class Stream:
        def __init__(self, name: str) -> None:
            self.name, self.waited = name, []

        def wait_event(self, event) -> None:
            self.waited.append(event.where)

    class Event:
        def record(self, stream) -> None:
            self.where = stream.name

    streams = {"now": Stream("all_gather_stream")}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams["now"])
    monkeypatch.setattr(torch.cuda, "Event", Event)
    t = torch.zeros(1)
    heap = collectives.SymmetricHeap("cuda", 0, 2, 64, t, t, t, t, torch.device("cuda", 0))
    collectives._wait_turn(heap)  # nothing ran on it yet
    assert streams["now"].waited == []
    collectives._took_turn(heap)  # an all-gather launched on FSDP's all-gather stream
    streams["now"] = other = Stream("reduce_scatter_stream")
    collectives._wait_turn(heap)  # the reduce-scatter's launch waits for it
    assert other.waited == ["all_gather_stream"]
    cpu = collectives.SymmetricHeap("cpu", 0, 2, 64, t, t, t, t, torch.device("cpu"))
    collectives._took_turn(cpu)
    collectives._wait_turn(cpu)
    assert cpu.last_use is None and other.waited == ["all_gather_stream"]


def test_world1_last_path_names_the_fallback(world1) -> None:
    y = torch.arange(5, dtype=torch.float64)
    comm.all_reduce(y)
    assert comm.last_path() == "torch.distributed:gloo"
    assert torch.equal(y, torch.arange(5, dtype=torch.float64))
    y = torch.arange(5, dtype=torch.int32)
    comm.all_reduce(y, op="avg")
    assert comm.last_path() == "torch.distributed:gloo"
    assert torch.equal(y, torch.arange(5, dtype=torch.int32))
    if runtime.interpreter_enabled():
        comm.all_reduce(torch.ones(3))
        assert comm.last_path() == "symmetric"


def test_world1_fallback_average_of_complex_and_of_a_leaf_that_requires_grad(world1) -> None:
    """The fallback's "avg" (gloo's sum, then a division): a complex tensor took the integer floor division
    (NotImplementedError for 'div_floor_cpu', the tensor left holding the sum), and a leaf that requires
    grad (a parameter) failed in the in-place division (autograd's leaf check), where dist.all_reduce takes
    it and the symmetric path averages it. A bool average, a logical or divided, is refused before any
    data moves."""
    z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    comm.all_reduce(z, op="avg")
    assert torch.equal(z, torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64))
    out = torch.empty(2, dtype=torch.complex64)
    comm.reduce_scatter_tensor(out, z.clone(), op="avg")
    assert torch.equal(out, z)
    p = nn.Parameter(torch.arange(4, dtype=torch.float64))
    comm.all_reduce(p, op="avg")
    assert comm.last_path() == "torch.distributed:gloo" and p.requires_grad and p.grad_fn is None
    assert torch.equal(p.detach(), torch.arange(4, dtype=torch.float64))
    b = torch.tensor([True, False])
    with pytest.raises(TypeError, match="'avg' of bool tensors is not defined"):
        comm.all_reduce(b, op="avg")
    with pytest.raises(TypeError, match="'avg' of bool tensors is not defined"):
        comm.reduce_scatter_tensor(torch.empty(2, dtype=torch.bool), b, op="avg")
    assert b.tolist() == [True, False]


def test_world1_sparse_tensors_are_refused_by_name(world1) -> None:
    """A sparse tensor (DDP's bucket of nn.Embedding(sparse=True) gradients) was refused as 'must be
    contiguous (got strides (0, 0))'."""
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(TypeError, match=r"expected a dense tensor, got layout torch\.sparse_coo"):
        comm.all_reduce(sparse)
    with pytest.raises(TypeError, match="expected a dense tensor"):
        comm.all_gather_into_tensor(torch.empty(3, 3), sparse)


def test_world1_tensor_subclasses_are_refused_by_name(world1) -> None:
    """A DTensor has no storage of its own: the heap path failed reading its data pointer ("Attempted to
    access the data pointer on an invalid python storage") and the fallback in DTensor's dispatch (no sharding
    strategy for c10d.allreduce_), naming no argument. A Parameter, a plain subclass, still runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    for dtype in (torch.float32, torch.float64):  # the heap path's dtype, the fallback's
        d = distribute_tensor(torch.ones(4, dtype=dtype), mesh, [Shard(0)])
        with pytest.raises(
            TypeError, match=r"^tensor: expected a tensor with storage of its own, got a DTensor"
        ):
            comm.all_reduce(d)
        with pytest.raises(
            TypeError, match=r"^input: expected a tensor with storage of its own, got a DTensor"
        ):
            comm.all_gather_into_tensor(torch.empty(4, dtype=dtype), d)
        with pytest.raises(TypeError, match=r"^output: expected a tensor with storage of its own"):
            comm.reduce_scatter_tensor(d, torch.ones(4, dtype=dtype))
        with pytest.raises(TypeError, match=r"^output: expected a tensor with storage of its own"):
            comm.all_to_all_single(d, torch.ones(4, dtype=dtype))
    p = nn.Parameter(torch.ones(4))
    assert comm.all_reduce(p) is p and torch.equal(p.detach(), torch.ones(4))
    assert torch.equal(comm.all_gather_into_tensor(torch.empty(4), p), torch.ones(4))


@pytest.mark.parametrize(("cid", "call", "exc", "message"), bad_inputs(1), ids=[c[0] for c in bad_inputs(1)])
def test_world1_bad_input(world1, cid, call, exc, message) -> None:
    with pytest.raises(exc, match=re.escape(message)):
        call()


@needs_interpreter
def test_world1_all_to_all_2d_input_into_1d_output(world1) -> None:
    """Input [4, 3] (4 rows of 3) into output [12] (12 rows of 1): gloo copies the 12 elements."""
    inp = torch.arange(12, dtype=torch.float32).view(4, 3)
    expected = torch.empty(12)
    dist.all_to_all_single(expected, inp, [12], [4])
    buf = torch.full((12 + 64,), float("nan"))
    out = buf[:12]
    comm.all_to_all_single(out, inp, [12], [4])
    assert torch.equal(out, expected)
    assert buf[12:].isnan().all(), f"{int((~buf[12:].isnan()).sum())} elements written past the output's end"


@needs_interpreter
def test_world1_all_to_all_1d_input_into_2d_output(world1) -> None:
    """Input [12] (12 rows of 1) into output [4, 3] (4 rows of 3): gloo fills all 12 elements."""
    inp = torch.arange(12, dtype=torch.float32)
    expected = torch.empty(4, 3)
    dist.all_to_all_single(expected, inp, [4], [12])
    out = torch.full((4, 3), float("nan"))
    comm.all_to_all_single(out, inp, [4], [12])
    assert torch.equal(out, expected), f"output {out.flatten().tolist()}"


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["symmetric", "fallback"])
def test_world1_all_to_all_of_0d_tensors(world1, dtype) -> None:
    """A 0-d input and output are one row of one element, as torch takes them with None splits."""
    inp = torch.tensor(5.0, dtype=dtype)
    expected = torch.tensor(-1.0, dtype=dtype)
    dist.all_to_all_single(expected, inp)
    for splits in (None, [1]):
        out = torch.tensor(-1.0, dtype=dtype)
        comm.all_to_all_single(out, inp, splits, splits)
        assert torch.equal(out, expected), f"splits {splits}: {out.item()} on {comm.last_path()}"


def test_world1_collectives_take_meta_tensors(world1) -> None:
    """Meta tensors move no data, and torch.distributed takes them in all four collectives; so do these
    (all_to_all_single read its split exchange back from the meta device: "Cannot copy out of meta
    tensor; no data!", a NotImplementedError naming no argument)."""
    meta = torch.empty(4, 2, device="meta")
    assert comm.all_reduce(meta) is meta
    out = torch.empty(4, 2, device="meta")
    assert comm.all_gather_into_tensor(out, meta) is out
    assert comm.reduce_scatter_tensor(out, meta) is out
    assert comm.all_to_all_single(out, meta) is out
    assert comm.all_to_all_single(out, meta, [4], [4]) is out


def test_expect_raises_can_fail() -> None:
    """The jobs' bad-input checker reports a missing error, a wrong type and a message without the text."""
    assert expect_raises(lambda: None, ValueError, "x") == "no error, expected ValueError containing 'x'"
    assert "raised ValueError" in expect_raises(lambda: int("q"), TypeError, "q")
    assert "lacks 'zzz'" in expect_raises(lambda: int("q"), ValueError, "zzz")
    assert expect_raises(lambda: int("q"), ValueError, "invalid literal") is None
