"""README.md runs as written: every ```python block executes as a new user would run it.

Each block is one test case, named after the README section it sits under, run as a script in a fresh
interpreter (cwd and PYTHONPATH = the repository root). A block whose first line is a comment naming
``torchrun --nproc-per-node N`` runs on N processes through ``python -m torch.distributed.run
--standalone`` (gloo and the Triton interpreter on CPU, as the block itself chooses). The child gets no
``TRITON_INTERPRET`` and no ``SMPTK_*`` variables from this process (conftest sets the former), so a block
that forgets to set up the CPU path itself fails here as it would for a reader. A block fails the test
when it exits non-zero or runs past ``TIMEOUT_S``; the message carries its stderr. On a CUDA machine
with fewer GPUs than a torchrun block has ranks, that block is skipped (it needs one GPU per rank).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# Seconds per block. The slowest took 10 s on a 2-core CPU machine (expert-parallel MoE, interpreter on
# 2 ranks) and 30 s on an H100 (fused_linear: Triton compiles every kernel first); 180 s leaves room for
# a loaded machine or a cold cache without letting a hang stall the suite.
TIMEOUT_S = 180

_FENCE = re.compile(r"^```(\w*)\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
_TORCHRUN = re.compile(r"^#\s*torchrun\b.*--nproc[-_]per[-_]node[= ](\d+)")


def _slug(heading: str) -> str:
    """``### `fused_linear(x, weight)` `` -> ``fused-linear``: argument lists dropped, lower case, dashes."""
    return re.sub(r"[^a-z0-9]+", "-", re.sub(r"\(.*?\)", "", heading).lower()).strip("-") or "top"


def python_blocks(text: str) -> list[tuple[str, str]]:
    """``(id, source)`` of every ```python block.

    The id is the slug of the nearest heading above the block, ``-torchrun`` appended for a torchrun
    block, and ``-1``, ``-2``... where one section holds several blocks otherwise alike.
    """
    blocks: list[tuple[str, str]] = []
    heading, lang, lines = "top", None, []
    for line in text.splitlines():
        fence = _FENCE.match(line)
        if lang is None:
            if fence:
                lang, lines = fence.group(1), []
            elif m := _HEADING.match(line):
                heading = _slug(m.group(2))
        elif fence and not fence.group(1):
            if lang == "python":
                source = "\n".join(lines) + "\n"
                blocks.append((heading + ("-torchrun" if _TORCHRUN.match(source) else ""), source))
            lang = None
        else:
            lines.append(line)
    if lang is not None:
        raise ValueError(f"README.md: unclosed ``` block under '{heading}'")
    ids = [h for h, _ in blocks]
    return [
        (h if ids.count(h) == 1 else f"{h}-{ids[:i].count(h) + 1}", src) for i, (h, src) in enumerate(blocks)
    ]


BLOCKS = python_blocks(README.read_text())


def _ranks(source: str) -> int:
    """N for a block whose first line is ``# torchrun --nproc-per-node N ...``, else 1."""
    m = _TORCHRUN.match(source)
    return int(m.group(1)) if m else 1


def _command(source: str, script: Path) -> list[str]:
    m = _TORCHRUN.match(source)
    if m is None:
        return [sys.executable, str(script)]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        m.group(1),
        str(script),
    ]


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 7, f"found {len(BLOCKS)} python blocks in README.md: {[b for b, _ in BLOCKS]}"
    assert any(_TORCHRUN.match(src) for _, src in BLOCKS), "no torchrun block found"


def test_block_ids_follow_sections():
    text = (
        "# A\n```python\nx = 1\n```\n## B: `b()`\n```bash\nls\n```\n```python\n```\n```python\ny = 2\n```\n"
    )
    assert python_blocks(text) == [("a", "x = 1\n"), ("b-b-1", "\n"), ("b-b-2", "y = 2\n")]
    with pytest.raises(ValueError, match="unclosed"):
        python_blocks("# A\n```python\nx = 1\n")


@pytest.mark.parametrize("source", [src for _, src in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_readme_block_runs(source: str, tmp_path: Path):
    script = tmp_path / "block.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("SMPTK_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    cmd = _command(source, script)
    ranks = _ranks(source)
    if ranks > 1 and torch.cuda.is_available() and torch.cuda.device_count() < ranks:
        pytest.skip(
            f"the block needs {ranks} GPUs, one per rank, and this machine has {torch.cuda.device_count()}"
        )
    # Own session, so a timeout kills torchrun's workers too, not only the launcher.
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {TIMEOUT_S} s\nstderr:\n{stderr[-6000:]}\n---\n{source}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\nstderr:\n{stderr[-6000:]}\n---\n{source}")
