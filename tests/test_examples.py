"""examples/ run as a user runs them: a fresh process, no TRITON_INTERPRET and no SMPTK_* from this one.

``examples/llama_mlp.py`` must run the Triton kernels wherever Triton is installed (the interpreter on a
CPU, which the script switches on itself), say which path ran, and pass its own error bound; with
``SMPTK_KERNELS=torch`` it must say that it compared PyTorch with itself; NaN errors fail it.
``examples/parallel_llama.py`` runs under torchrun (gloo on a CPU): 4 processes at TP 2 x DP 2 train, save a
checkpoint and resume it exactly, then 2 processes without TP resume that checkpoint and continue the run;
2 processes in fp16 keep the loss scaler in the checkpoint.
``examples/transform_hf.py`` runs on 2 processes: a stock Mixtral transformed for EP 2 x FSDP 2 trains, and
its printed loss is the mean over both data-parallel ranks.
The examples' argument checks and pass / fail functions are called in this process (``_example``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from smptk.kernels import runtime
from smptk.parallel import checkpoint_keys

ROOT = Path(__file__).resolve().parent.parent
LLAMA_MLP = ROOT / "examples" / "llama_mlp.py"


def _run(*args: str, **env_extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("SMPTK_")}
    env.update(PYTHONPATH=str(ROOT), **env_extra)
    return subprocess.run(
        [sys.executable, str(LLAMA_MLP), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _example(name: str):
    """``examples/<name>.py`` imported as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _errors(out: str) -> dict[str, float]:
    return {
        m[0].strip(): float(m[1]) for m in re.findall(r"^(.+?)\s+rel\. error vs eager: (\S+)$", out, re.M)
    }


@pytest.mark.skipif(
    not runtime.triton_available(), reason="triton is not installed: only the torch path runs"
)
def test_llama_mlp_runs_the_kernels_and_passes():
    proc = _run()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    expected = "path=triton" if torch.cuda.is_available() else "path=triton (interpreter)"
    first = proc.stdout.splitlines()[0]
    assert expected in first, first
    errors = _errors(proc.stdout)
    assert set(errors) == {"output", "grad x", "grad w_gate", "grad w_up", "grad w_down"}, proc.stdout
    # A Triton run differs from eager somewhere (other summation order); exactly 0 everywhere would mean
    # the comparison ran PyTorch against itself.
    assert max(errors.values()) > 0, proc.stdout
    assert "ok: every relative error" in proc.stdout


def test_llama_mlp_odd_shapes_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("the CPU default shapes are what this checks; the GPU run is the test above")
    proc = _run("--tokens", "7", "--hidden", "40", "--ffn", "17")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "shape=7x40->17" in proc.stdout


def test_llama_mlp_says_when_it_compares_torch_with_itself():
    proc = _run("--tokens", "4", "--hidden", "16", "--ffn", "24", SMPTK_KERNELS="torch")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "path=torch" in proc.stdout
    assert "compares PyTorch with itself (SMPTK_KERNELS=torch" in proc.stdout
    assert max(_errors(proc.stdout).values()) == 0.0


def test_llama_mlp_fails_on_non_finite_errors_and_refuses_sizes_below_1(monkeypatch, capsys):
    """A NaN or inf error fails the check (``max`` dropped a NaN and ``nan > bound`` is False: NaN outputs
    printed "ok"), and --tokens / --hidden / --ffn below 1 are refused (0 tokens compared nothing and
    printed "ok"; 0 features divided by zero)."""
    example = _example("llama_mlp")
    assert example.failures({"output": 1e-6, "grad x": 0.0}, 1e-5) == []
    errors = {"output": math.nan, "grad x": 1e-6, "grad w_gate": math.inf, "grad w_up": 2e-5}
    assert example.failures(errors, 1e-5) == ["output", "grad w_gate", "grad w_up"]
    assert example.failures({"grad x": 1e-6, "output": math.nan}, 1e-5) == ["output"]  # NaN last, too

    real = example.swiglu
    monkeypatch.setattr(example, "swiglu", lambda x, g, u: real(x, g, u) * math.nan)  # a broken kernel
    assert example.main(["--tokens", "4", "--hidden", "16", "--ffn", "24"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: relative error above" in out and "output nan" in out and "ok:" not in out, out
    for flag in ("--tokens", "--hidden", "--ffn"):
        for value in ("0", "-3"):
            with pytest.raises(SystemExit) as exit_info:
                example.main([flag, value])
            assert exit_info.value.code == 2
            assert f"{flag} {value}: expected at least 1" in capsys.readouterr().err


# --- examples/parallel_llama.py under torchrun --------------------------------------------------------

PARALLEL_LLAMA = ROOT / "examples" / "parallel_llama.py"
_STEP = re.compile(r"^step\s+(\d+)\s+loss (\S+)$", re.M)


def _torchrun(
    nproc: int, *args: str, script: Path = PARALLEL_LLAMA, **env_extra: str
) -> subprocess.CompletedProcess[str]:
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        pytest.skip(f"{nproc} NCCL processes need {nproc} GPUs, this machine has {torch.cuda.device_count()}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("SMPTK_")}
    env.update(PYTHONPATH=str(ROOT), **env_extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run(
        [*cmd, str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def _losses(out: str) -> list[tuple[int, float]]:
    return [(int(s), float(v)) for s, v in _STEP.findall(out)]


@pytest.fixture(scope="module")
def llama_tp2_dp2(tmp_path_factory):
    """4 processes, TP 2 x DP 2: 6 steps, checkpoint after 3, the last 3 again from the checkpoint."""
    ckpt = tmp_path_factory.mktemp("parallel_llama")
    proc = _torchrun(4, "--tp", "2", "--steps", "6", "--save-at", "3", "--ckpt-dir", str(ckpt))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return ckpt, proc.stdout


def test_parallel_llama_trains_and_resumes_under_tp2_dp2(llama_tp2_dp2):
    _, out = llama_tp2_dp2
    assert "world 4 (tp 2, dp_replicate 1, dp_shard 2)" in out, out
    assert f"mixed_precision {'bf16' if torch.cuda.is_available() else 'fp32'}," in out, out
    losses = _losses(out)
    assert [s for s, _ in losses] == [0, 1, 2, 3, 4, 5, 3, 4, 5], out
    first, again = dict(losses[:6]), losses[6:]
    assert first[5] < first[0], out
    # fp32 on a CPU: the resumed pass repeats the same arithmetic, so the losses agree exactly.
    tol = 0.0 if not torch.cuda.is_available() else 1e-3 * first[3]
    assert all(abs(first[s] - v) <= tol for s, v in again), out
    assert "resume: max |loss diff|" in out and ": match" in out, out


def test_parallel_llama_resumes_its_checkpoint_under_another_config(llama_tp2_dp2):
    """The TP 2 x DP 2 checkpoint, loaded by 2 processes without tensor parallelism, continues the run:
    the losses of steps 3..5 agree with the 4-process run's to float rounding (other reduction orders)."""
    ckpt, out4 = llama_tp2_dp2
    proc = _torchrun(2, "--tp", "1", "--steps", "3", "--ckpt-dir", str(ckpt), "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "world 2 (tp 1, dp_replicate 1, dp_shard 2)" in proc.stdout, proc.stdout
    assert "(saved after 3 steps)" in proc.stdout, proc.stdout
    first = dict(_losses(out4)[:6])
    resumed = _losses(proc.stdout)
    assert [s for s, _ in resumed] == [3, 4, 5], proc.stdout
    for s, v in resumed:
        assert v == pytest.approx(first[s], rel=1e-5, abs=0), (s, v, first[s], proc.stdout)


def test_parallel_llama_config_keys_apply_and_keep_the_losses(llama_tp2_dp2, tmp_path):
    """The same TP 2 x DP 2 run from a --config file that also asks for full activation checkpointing with
    offloading and delayed initialization: the example applies them (it used to ignore them silently),
    and the losses are the plain run's exactly (recompute repeats the arithmetic; materialize draws the
    values the eager build drew, FSDP-sharded torch layers included). Without --ckpt-dir it saves into a
    temporary directory of its own and removes it at the end."""
    _, out4 = llama_tp2_dp2
    precision = "bf16" if torch.cuda.is_available() else "fp32"  # what the plain run's --tp 2 takes
    config = {"tensor_parallel_degree": 2, "mixed_precision": precision, "activation_checkpointing": "full"}
    config |= {"sm_activation_offloading": True, "delayed_parameter_initialization": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    proc = _torchrun(4, "--config", str(path), "--steps", "6", "--save-at", "3", TMPDIR=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert f"mixed_precision {precision}," in proc.stdout, proc.stdout
    assert "activation checkpointing (full): 2 blocks" in proc.stdout, proc.stdout
    saved = re.search(r"^saved checkpoint (\S+) after 3 steps$", proc.stdout, re.M)
    assert saved and Path(saved[1]).parent.parent == tmp_path, proc.stdout
    assert not Path(saved[1]).parent.exists() and "removed the temporary checkpoint directory" in proc.stdout
    tol = 0.0 if not torch.cuda.is_available() else 1e-3
    got, want = _losses(proc.stdout), _losses(out4)
    assert [s for s, _ in got] == [s for s, _ in want], proc.stdout
    assert all(abs(a - b) <= tol * abs(b) for (_, a), (_, b) in zip(got, want, strict=True)), (got, want)


# --- examples/transform_hf.py under torchrun ----------------------------------------------------------


def test_parallel_llama_refuses_what_it_cannot_train_faithfully(tmp_path, capsys):
    """A data-parallel size that does not divide the global batch (3 ranks took 2, 3 and 3 rows and the
    equal-weight gradient average trained another model), and bad flags, fail before training."""
    example = _example("parallel_llama")
    example.check_model_config(example.MODEL, 2, 4)
    with pytest.raises(
        ValueError, match=rf"the 3 data-parallel ranks do not divide the global batch of {example.BATCH}"
    ):
        example.check_model_config(example.MODEL, 1, 3)
    afile = tmp_path / "afile"
    afile.write_text("")
    for argv, message in (
        (["--steps", "-3", "--resume", "--ckpt-dir", str(tmp_path)], "--steps -3: expected at least 1"),
        (["--steps", "1"], "--steps 1: saving and resuming mid-run needs at least 2"),
        (["--ckpt-dir", str(afile)], "exists and is not a directory"),
        (["--config", "c.json", "--tp", "2"], "--config and --tp together: the flags would be ignored"),
        (["--config", "c.json", "--hybrid-shard", "1"], "--config and --hybrid-shard together"),
        (["--config", "c.json", "--tp", "1", "--hybrid-shard", "0"], "--config and --tp / --hybrid-shard"),
        (["--resume", "--ckpt-dir", str(tmp_path), "--save-at", "2"], "--save-at 2 with --resume"),
        (["--resume"], "--resume needs --ckpt-dir"),
        (["--save-at", "0"], "--save-at 0: expected 0 < save-at < --steps 8"),
        (["--steps", "4", "--save-at", "4"], "--save-at 4: expected 0 < save-at < --steps 4"),
    ):
        with pytest.raises(SystemExit):
            example.parse_args(argv)
        assert message in capsys.readouterr().err
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "parallel_llama.py"), "--steps", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "needs at least 2" in result.stderr
    with pytest.raises(SystemExit):
        example.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "with the highest N (by step, not by time" in help_text, help_text
    assert 'ParallelConfig\'s defaults (mixed_precision "bf16", on a CPU too)' in help_text, help_text
    assert "not with --resume" in help_text and "removed at the end of the run" in help_text, help_text


def test_parallel_llama_resumes_the_highest_step_and_fails_on_non_finite_losses(tmp_path):
    """--resume takes the step<N> with the highest N, not the newest directory; the resume check is a
    mismatch where a loss on either pass is NaN or inf (a NaN in the resumed losses passed: ``max`` dropped
    it, and only the first pass was checked for finite values)."""
    example = _example("parallel_llama")
    for step, mtime in ((6, 1_000_000), (2, 2_000_000), (10, 0)):
        (tmp_path / f"step{step}").mkdir()
        os.utime(tmp_path / f"step{step}", (mtime, mtime))
    (tmp_path / "step_x").mkdir()
    assert example.latest_checkpoint(str(tmp_path)) == (str(tmp_path / "step10"), 10)
    rest = [5.0, 4.5, 4.0]
    assert example.compare_resumed(rest, list(rest), 0.0) == (0.0, True)
    assert example.compare_resumed(rest, [5.0, 4.5, 4.001], 1e-3 * 5.0) == (pytest.approx(1e-3), True)
    assert example.compare_resumed(rest, [5.0, 4.5, 4.1], 1e-3)[1] is False
    for bad in (math.nan, math.inf, -math.inf):
        for i in range(3):
            again = [bad if j == i else v for j, v in enumerate(rest)]
            for pair in ((rest, again), (again, rest)):
                diff, match = example.compare_resumed(*pair, 1e-3)
                assert math.isnan(diff) and match is False, (pair, diff, match)


def test_parallel_llama_fp16_scales_the_loss_and_checkpoints_the_scaler(tmp_path):
    """mixed_precision fp16 from a --config: the loss goes through a ShardedGradScaler (README), whose
    state the checkpoint holds, so the resumed pass scales and skips as the first did."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"tensor_parallel_degree": 2, "mixed_precision": "fp16"}))
    proc = _torchrun(2, "--config", str(path), "--steps", "2", "--ckpt-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "mixed_precision fp16 (loss scaled by ShardedGradScaler)," in proc.stdout, proc.stdout
    assert "): match" in proc.stdout, proc.stdout
    keys = checkpoint_keys(tmp_path / "step1")
    assert "extra.grad_scaler" in keys, keys  # the scaler's whole state, one value


def test_transform_hf_trains_mixtral_with_expert_parallelism(tmp_path):
    """2 processes, EP 2 x FSDP 2: a stock Mixtral's MoE blocks become smptk's, the loss falls, and the
    trained model saved in the Hugging Face format loads with ``from_pretrained``."""
    hf = pytest.importorskip("transformers", reason="the example needs transformers (planner-tests extra)")
    if int(hf.__version__.split(".")[0]) < 5:
        pytest.skip(f"transformers {hf.__version__}: transform needs the stacked-experts layout of >= 5")
    script = ROOT / "examples" / "transform_hf.py"
    args = ("--model", "mixtral", "--ep", "2", "--steps", "6", "--save", str(tmp_path))
    proc = _torchrun(2, *args, script=script)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "mixtral: sizes" in proc.stdout and "MoE layers 2" in proc.stdout, proc.stdout
    assert "'ep': 2" in proc.stdout and "full_shard on fsdp2" in proc.stdout, proc.stdout
    losses = _losses(proc.stdout)
    assert [s for s, _ in losses] == list(range(6)), proc.stdout
    assert losses[-1][1] < losses[0][1], proc.stdout
    # Step 0's loss is the mean of both data-parallel ranks' (it printed rank 0's): the stock model's loss
    # on each rank's rows, the same weights on both (transform keeps the stock loss: out.loss + aux).
    example = _example("transform_hf")
    stock = example.build("mixtral")
    with torch.no_grad():
        each = [stock(example.batch(0, r), labels=example.batch(0, r)).loss.item() for r in (0, 1)]
    tol = 1e-4 if not torch.cuda.is_available() else 3e-2  # 4 printed decimals in fp32; bf16 on a GPU
    assert losses[0][1] == pytest.approx(sum(each) / 2, abs=tol), (losses[0], each)
    back = hf.MixtralForCausalLM.from_pretrained(tmp_path)
    assert back.config.num_local_experts == 4 and back.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
    # --meta: built on meta, transformed, materialized: on a CPU the eager build's values, so the same losses
    proc = _torchrun(2, "--model", "mixtral", "--ep", "2", "--steps", "6", "--meta", script=script)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    meta = _losses(proc.stdout)
    if torch.cuda.is_available():  # other draws (the CUDA generator): it trains
        assert len(meta) == 6 and meta[-1][1] < meta[0][1], proc.stdout
    else:
        assert meta == losses, (proc.stdout, losses)
