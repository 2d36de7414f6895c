"""``smptk info`` (text and ``--json``) and the environment collector behind it.

The subprocess tests run ``python -m smptk`` exactly as a user would; on a machine without an NVIDIA
driver (CI) they check that it says so plainly instead of failing. The collector's pieces that only
matter on GPU machines (matching NVML GPUs with torch devices, formatting a GPU line) are checked with
synthetic inputs so they run everywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import smptk._env
from smptk._env import _git_state, _merge_gpus, _norm_uuid, collect_environment, current_sm_clock_mhz
from smptk.cli import format_info, main

ROOT = Path(__file__).resolve().parent.parent
HAS_CUDA = torch.cuda.is_available()
ENV_KEYS = {
    "smptk", "torch", "triton", "python", "cuda", "nccl", "cuda_available", "platform", "cpu_count",
    "git_sha", "git_dirty", "world_size", "rank", "interpreter", "kernel_path", "gpus", "gpu_note",
    "settings", "symmetric_heaps",
}  # fmt: skip


def _run_smptk(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "smptk", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _assert_no_personal_data(text: str) -> None:
    host = socket.gethostname()
    if len(host) >= 4:  # a 1-3 letter hostname would match by accident
        assert host not in text, "output contains the hostname"
    home = str(Path.home())
    if home not in ("/", "/root"):
        assert home not in text, "output contains the home directory"
    assert str(ROOT) not in text, "output contains the checkout path"


def test_info_text_runs_and_reports_gpu_state() -> None:
    proc = _run_smptk("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(f"smptk 0.1.0  torch {torch.__version__}"), out
    assert "world size: " in out and "kernels: SMPTK_KERNELS=" in out
    if HAS_CUDA:
        assert "GPUs: none" not in out
        assert torch.cuda.get_device_name(0) in out
    else:
        assert "GPUs: none (no GPU: " in out
    _assert_no_personal_data(out)


def test_info_json_has_every_field() -> None:
    proc = _run_smptk("info", "--json")
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)
    assert set(env) >= ENV_KEYS, f"missing: {sorted(ENV_KEYS - set(env))}"
    assert env["torch"] == torch.__version__
    assert env["cuda"] == torch.version.cuda
    assert env["world_size"] == int(os.environ.get("WORLD_SIZE", 1))
    assert isinstance(env["kernel_path"], dict) and env["kernel_path"]["requested"] in (
        "auto",
        "triton",
        "torch",
    )
    if HAS_CUDA:
        assert env["gpus"], env["gpu_note"]
        gpu = env["gpus"][0]
        assert gpu["sm_count"] == torch.cuda.get_device_properties(0).multi_processor_count
        assert gpu["memory_total_bytes"] > 0
        assert env["nccl"] is not None
    else:
        assert env["gpus"] == []
        assert env["gpu_note"], "an empty GPU list must say why"
        assert env["nccl"] is None
    _assert_no_personal_data(proc.stdout)


def test_no_subcommand_prints_help_and_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "usage: smptk" in err and "info" in err


def test_main_json_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert set(env) >= ENV_KEYS


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--model", "llama2-7b", "--instance", "p4d"],  # the advice
        ["plan", "--model", "llama2-7b", "--instance", "p4d", "--config", "{}"],  # one configuration
        ["info"],
    ],
    ids=["plan", "plan-config", "info"],
)
def test_output_into_a_closed_pipe_stops_quietly(args: list[str]) -> None:
    """``smptk plan | head -1`` printed a BrokenPipeError traceback (and with --config reported the
    closed pipe as bad input). The reader is gone before the first line here, so every write fails."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "smptk", *args],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (1, "")


def test_collect_environment_never_raises_with_bad_kernel_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMPTK_KERNELS", "bogus")
    env = collect_environment()
    assert isinstance(env["kernel_path"], str) and "bogus" in env["kernel_path"]


def test_info_lists_every_setting_with_its_value(monkeypatch: pytest.MonkeyPatch) -> None:
    from smptk.settings import VARIABLES

    monkeypatch.setenv("SMPTK_POISON_OUTPUTS", "Yes")
    monkeypatch.setenv("SMPTK_AUTOTUNE", "maybe")
    monkeypatch.setenv("SMPTK_BENCH_JSONL", str(ROOT / "rows.jsonl"))
    env = collect_environment()
    assert set(env["settings"]) == set(VARIABLES)
    assert env["settings"]["SMPTK_POISON_OUTPUTS"] == {"value": True, "set": True}
    assert env["settings"]["SMPTK_AUTOTUNE"]["value"].startswith("error: SMPTK_AUTOTUNE='maybe'")
    assert env["settings"]["SMPTK_BENCH_JSONL"] == {"value": "<a path>", "set": True}
    text = format_info(env)
    for name in VARIABLES:
        assert name in text
    assert "* SMPTK_POISON_OUTPUTS" in text and "  SMPTK_CHECK_OFFSETS" in text
    _assert_no_personal_data(text)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (f"torch @ file://{ROOT}/wheels/torch-2.13.0-cp311-linux_x86_64.whl", "<a path>"),
        (str(ROOT / "torch-2.13.0-cp311-linux_x86_64.whl"), "<a path>"),
        ("torch==2.11.0", "torch==2.11.0"),
    ],
)
def test_info_keeps_a_path_in_a_text_setting_out(monkeypatch: pytest.MonkeyPatch, value, shown) -> None:
    """SMPTK_TORCH_SPEC is free text, and a pip requirement may be a local wheel: smptk info and every
    benchmark row (which carry this dict into committed results) printed the path as given."""
    monkeypatch.setenv("SMPTK_TORCH_SPEC", value)
    env = collect_environment()
    assert env["settings"]["SMPTK_TORCH_SPEC"] == {"value": shown, "set": True}
    _assert_no_personal_data(format_info(env))
    _assert_no_personal_data(json.dumps(env))


def test_format_info_gpu_line() -> None:
    env = {
        "smptk": "0.1.0", "torch": "2.11.0", "triton": "3.6.0", "python": "3.12.3", "cuda": "12.8",
        "cuda_available": True, "nccl": "2.27.3", "platform": "Linux", "cpu_count": 16,
        "git_sha": "a" * 40, "git_dirty": True, "world_size": 8, "rank": 0,
        "kernel_path": {"requested": "auto", "interpreter": "off", "cpu": "torch", "cuda": "triton"},
        "gpus": [{
            "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 85899345920, "sm_count": 132,
            "l2_cache_bytes": 52428800, "compute_capability": "9.0", "torch_index": 0,
            "sm_clock_mhz": 1755, "sm_clock_max_mhz": 1980, "mem_clock_max_mhz": 2619,
            "driver_version": "570.86.15",
        }],
        "gpu_note": None,
    }  # fmt: skip
    text = format_info(env)
    assert "GPUs: 1" in text
    assert "[0] NVIDIA H100 80GB HBM3  memory 80.0 GiB  SMs 132  L2 50.0 MiB  CC 9.0" in text
    assert "SM clock 1755/1980 MHz (now/max)  memory clock max 2619 MHz  driver 570.86.15" in text
    assert "git: " + "a" * 40 + " (uncommitted changes)" in text
    assert "NCCL: 2.27.3" in text
    assert "symmetric heaps (this process): none" in text


def test_format_info_lists_symmetric_heaps() -> None:
    heap = {"ranks": [0, 1], "rank": 1, "world_size": 2, "backend": "cuda", "heap_bytes": 64 << 20,
            "segment_bytes": (64 << 20) + 69632, "calls": 7, "broken": None}  # fmt: skip
    broken = dict(heap, ranks=[1, 3], rank=0, broken="ranks [3] did not arrive within 300 s")
    text = format_info({"symmetric_heaps": [heap, broken]})
    assert "symmetric heaps (this process): 2, 128.1 MiB in all" in text
    assert "  ranks [0, 1] (this rank 1)  cuda  data region 64.0 MiB  segment 64.1 MiB  calls 7" in text
    assert "BROKEN: ranks [3] did not arrive within 300 s" in text


def test_merge_gpus_matches_by_uuid_not_position() -> None:
    # NVML sees two GPUs; torch sees only the second (CUDA_VISIBLE_DEVICES=1), as its device 0.
    nvml = [
        {"nvml_index": 0, "name": "GPU-A", "_uuid": "aaaa"},
        {"nvml_index": 1, "name": "GPU-B", "_uuid": "bbbb"},
    ]
    torch_gpus = [
        {
            "torch_index": 0, "name": "GPU-B", "sm_count": 132, "l2_cache_bytes": 52428800,
            "compute_capability": "9.0", "memory_total_bytes": 1, "_uuid": "bbbb",
        }
    ]  # fmt: skip
    merged = _merge_gpus(nvml, torch_gpus)
    assert [g["torch_index"] for g in merged] == [None, 0]
    assert [g["sm_count"] for g in merged] == [None, 132]
    assert all("_uuid" not in g for g in merged), "UUIDs are for matching only, never reported"


def test_git_state_outside_a_checkout(tmp_path: Path) -> None:
    assert _git_state(tmp_path) == (None, None)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_state_sha_and_dirty(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip()  # fmt: skip

    git("init", "-q")
    (tmp_path / "a.txt").write_text("1")
    git("add", "a.txt")
    git("commit", "-q", "-m", "first")
    sha = git("rev-parse", "HEAD")
    assert _git_state(tmp_path) == (sha, False)
    (tmp_path / "a.txt").write_text("2")
    assert _git_state(tmp_path) == (sha, True)


def test_collect_environment_with_fake_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NVML path, on any machine: a fake pynvml with one H100, matched to torch's device by UUID."""
    uuid = "1a2b3c4d-0000-1111-2222-333344445555"

    class FakeNVML(types.ModuleType):
        NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2

        def __init__(self) -> None:
            super().__init__("pynvml")
            self.shutdown = False

        def nvmlInit(self) -> None: ...
        def nvmlShutdown(self) -> None:
            self.shutdown = True

        def nvmlSystemGetDriverVersion(self) -> bytes:
            return b"570.86.15"  # older nvidia-ml-py returns bytes

        def nvmlDeviceGetCount(self) -> int:
            return 1

        def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
            return f"handle{i}"

        def nvmlDeviceGetName(self, h: str) -> str:
            return "NVIDIA H100 80GB HBM3"

        def nvmlDeviceGetMemoryInfo(self, h: str) -> types.SimpleNamespace:
            return types.SimpleNamespace(total=85899345920)

        def nvmlDeviceGetMaxClockInfo(self, h: str, kind: int) -> int:
            return {1: 1980, 2: 2619}[kind]

        def nvmlDeviceGetClockInfo(self, h: str, kind: int) -> int:
            return 1755

        def nvmlDeviceGetUUID(self, h: str) -> str:
            return "GPU-" + uuid.upper()

    fake = FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    torch_gpu = {
        "torch_index": 0, "name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "l2_cache_bytes": 52428800,
        "compute_capability": "9.0", "memory_total_bytes": 85899345920, "_uuid": _norm_uuid(uuid),
    }  # fmt: skip
    monkeypatch.setattr(smptk._env, "_torch_gpus", lambda: [torch_gpu])
    env = collect_environment()
    assert env["gpu_note"] is None
    assert env["gpus"] == [
        {
            "nvml_index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 85899345920,
            "sm_clock_max_mhz": 1980, "sm_clock_mhz": 1755, "mem_clock_max_mhz": 2619,
            "driver_version": "570.86.15", "torch_index": 0, "sm_count": 132, "l2_cache_bytes": 52428800,
            "compute_capability": "9.0",
        }
    ]  # fmt: skip
    assert fake.shutdown
    assert current_sm_clock_mhz(0) == 1755
