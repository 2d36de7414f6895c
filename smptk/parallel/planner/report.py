"""``smptk plan``: the memory breakdown and the recommended configurations, as tables or JSON.

Tables go through ``rich`` where it is installed (the ``test`` / ``dev`` extras have it) and as aligned
plain text otherwise, so the command works on any machine. ``--json`` prints one object for programs.

Examples::

    $ smptk plan --model llama2-70b --instance p4d.24xlarge --nodes 32 --seq-len 4096
    $ smptk plan --model llama3.1-8b --instance p5.48xlarge --seq-len 8192 \\
          --config '{"tensor_parallel_degree": 2, "activation_checkpointing": "selective"}' --micro-batch 2
    $ smptk plan --model ./my_model/config.json --instance cluster.json --json

Exit status (:data:`EXIT_OK`, :data:`EXIT_BAD_INPUT`, :data:`EXIT_NOTHING_FITS`), so a launcher can choose a
layout from it: 0 when the advice recommends at least one configuration (with ``--config``: when that
configuration fits); 3 when it recommends none (nothing fits in memory, or what fits breaks the
global-batch rules; the output says which and what would fit) or ``--config``'s configuration does not fit;
2 for bad input (the reason on stderr). The tables or the ``--json`` object are printed in every case but
bad input. ``smptk`` itself returns 1 for output into a closed pipe (:func:`smptk.cli.main`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from smptk.parallel.config import ParallelConfig
from smptk.parallel.planner.advise import Advice, advise, step_time
from smptk.parallel.planner.clusters import CLUSTERS, cluster
from smptk.parallel.planner.estimate import (
    ATTENTION,
    IMPLEMENTATIONS,
    LOSSES,
    OPTIMIZER_STATE_BYTES,
    MemoryEstimate,
    estimate_memory,
)
from smptk.parallel.planner.models import PRESETS, model_spec

EXIT_OK = 0  # the advice recommends a configuration; --config: it fits
EXIT_BAD_INPUT = 2  # argparse's status for a usage error, and the planner's refusals
EXIT_NOTHING_FITS = 3  # no configuration recommended; --config: it does not fit (the plan is still printed)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True,
        help=f"a preset ({', '.join(PRESETS)}), a HF config.json or a directory holding one",
    )  # fmt: skip
    p.add_argument(
        "--instance",
        required=True,
        help=f"a cluster preset ({', '.join(CLUSTERS)}) or a JSON file of a custom cluster",
    )
    p.add_argument(
        "--nodes", type=int, default=None,
        help="nodes of the instance (default: a custom cluster file's \"nodes\", else 1)",
    )  # fmt: skip
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument(
        "--global-batch-tokens", type=int,
        help="the global batch to reach (accumulation fills it; not with --config)",
    )  # fmt: skip
    p.add_argument("--config", help="evaluate this ParallelConfig (a JSON file or an inline JSON object)")
    p.add_argument("--micro-batch", type=int, help="with --config: sequences per rank (default 1)")
    p.add_argument("--grad-accum", type=int, help="with --config: micro-batches per step (default 1)")
    p.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATE_BYTES))
    p.add_argument("--attention", default="flash", choices=ATTENTION)
    p.add_argument(
        "--loss", default=None, choices=LOSSES,
        help="at tp > 1: smptk's vocab-parallel loss on [T, V/tp] logits (the default with --implementation "
        "smptk), or gathered [T, V] logits on every rank, as a model prepared with transform gives Hugging "
        "Face's loss (the default with --implementation hf)",
    )  # fmt: skip
    p.add_argument(
        "--implementation", default="smptk", choices=IMPLEMENTATIONS,
        help="whose layers the activations are: smptk's own (default; the reference transformer), or hf: "
        "a Hugging Face model trained through transform, which keeps more (its measured excess, a term "
        "of its own; dense Llama-structured models)",
    )  # fmt: skip
    p.add_argument(
        "--heap-bytes", type=int, default=None,
        help="smptk's symmetric heap per group, a multiple of 16 of at least 4096 (default: what smptk.comm "
        "uses here: SMPTK_COMM_HEAP_BYTES, else 64 MiB)",
    )  # fmt: skip
    p.add_argument("--top", type=int, help="recommendations to print (default 5; not with --config)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _read_file(flag: str, path: str) -> str:
    """The text of the file ``path`` given to ``flag``; a directory, an unreadable or a non-UTF-8 file is
    refused naming the flag and the path (not with the bare ``[Errno 21] Is a directory``)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag}: {path!r} is a directory, not a JSON file")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag}: {path!r} is not a UTF-8 JSON file: {e}") from None
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path!r}: {e.strerror or e}") from None


def _load_config(text: str) -> ParallelConfig:
    """``--config``: inline JSON or a JSON file, both parsed by ParallelConfig (a key given twice refused)."""
    if text.lstrip().startswith("{"):
        return ParallelConfig.from_json_text(text, "--config")
    if not os.path.exists(text):
        raise ValueError(f"--config: {text!r} is neither a JSON object nor a file")
    return ParallelConfig.from_json_text(_read_file("--config", text), f"config file {text!r}")


def _load_cluster(text: str, nodes: int | None):
    """``--instance``: a preset name, or a custom cluster's JSON file: an existing file of any name, or a
    path (a ``.json`` name or one with a directory), as ``--model`` reads its argument."""
    if os.path.isfile(text) or text.endswith(".json") or os.path.sep in text:
        if not os.path.exists(text):
            raise ValueError(
                f"--instance: {text!r} does not exist (expected a cluster preset: {', '.join(CLUSTERS)}, "
                "or the JSON file of a custom cluster)"
            )
        try:
            spec = json.loads(_read_file("--instance", text))
        except json.JSONDecodeError as e:
            raise ValueError(f"--instance: {text!r} is not valid JSON: {e}") from None
        if not isinstance(spec, dict):  # a list or a string would reach cluster() as something else
            raise ValueError(
                f"--instance: {text!r} holds a JSON {type(spec).__name__}, expected an object (a custom "
                "cluster: gpu, memory_gb, bf16_tflops, gpus_per_node, intra_node_gbps, inter_node_gbps)"
            )
        return cluster(spec, nodes)
    return cluster(text, nodes)


def _table(
    title: str, header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()
) -> str:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        fmt = lambda r: "  ".join(
            str(r[i]).rjust(widths[i]) if i in right else str(r[i]).ljust(widths[i]) for i in range(len(r))
        ).rstrip()
        return "\n".join([title, fmt(header), *(fmt(r) for r in rows)])
    table = Table(title=title, title_justify="left")
    for i, h in enumerate(header):
        table.add_column(h, justify="right" if i in right else "left", overflow="fold")
    for r in rows:
        table.add_row(*(str(x) for x in r))
    console = Console(width=160, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(table)
    return console.export_text().rstrip()


def breakdown_table(est: MemoryEstimate) -> str:
    return _table(est.title(), ("term", "kind", "GiB", "how"), est.rows(), right=(2,))


def advice_table(adv: Advice, top: int) -> str:
    rows = []
    for i, c in enumerate(adv.candidates[:top], 1):
        rows.append(
            (
                str(i), c.label(), f"{c.estimate.total_bytes / 2**30:.1f}", f"{c.time.step_s:.2f}",
                f"{c.mfu:.0%}", f"{c.tokens_per_s:,.0f}", c.reason,
            )
        )  # fmt: skip
    header = ("#", "configuration", "GiB/GPU", "step s", "MFU", "tokens/s", "why")
    return _table("recommended configurations (fastest predicted first)", header, rows, right=(0, 2, 3, 4, 5))


# Keyword arguments of estimate_memory / advise / step_time that the command line takes from a flag.
_FLAG_OF = {
    name: "--" + name.replace("_", "-")
    for name in ("seq_len", "micro_batch", "grad_accum", "global_batch_tokens", "heap_bytes")
}


def implementation_note(implementation: str) -> str:
    """The line under a breakdown saying whose layers its activations are (``--implementation``)."""
    if implementation == "hf":
        return (
            "activations: a Hugging Face model through transform (smptk's layers plus the excess measured "
            "for Hugging Face's, its own term)"
        )
    return (
        "activations: smptk's own layers (the reference transformer); a Hugging Face model trained through "
        "transform keeps more (1.18x with no checkpointing on Llama 3.1 8B): --implementation hf"
    )


def _as_flag(message: str) -> str:
    """A planner error that starts with a keyword argument's name (``seq_len: expected an int >= 1``) as the
    command line's user typed it (``--seq-len: ...``)."""
    name, sep, rest = message.partition(":")
    return f"{_FLAG_OF[name]}{sep}{rest}" if sep and name in _FLAG_OF else message


def run(args: argparse.Namespace, out=None) -> int:
    """``smptk plan`` with parsed ``args``; returns the exit status (the module docstring's: 0 when a
    configuration is recommended or ``--config``'s fits, 3 when none is or it does not, 2 for bad input).

    The input is checked and the plan computed first, then printed: an error writing ``out`` (a closed
    pipe) is not reported as bad input; :func:`smptk.cli.main` ends a closed pipe quietly."""
    out = out or sys.stdout
    try:
        if args.top is not None and args.top < 1:
            raise ValueError(f"--top: expected an int >= 1, got {args.top}")
        if args.nodes is not None and args.nodes < 1:
            raise ValueError(f"--nodes: expected an int >= 1, got {args.nodes}")
        if args.config is None and (args.micro_batch is not None or args.grad_accum is not None):
            raise ValueError(
                "--micro-batch / --grad-accum apply to --config only (advice searches micro-batches and "
                "fills --global-batch-tokens with accumulation itself)"
            )
        if args.config is not None and (args.global_batch_tokens is not None or args.top is not None):
            raise ValueError(
                "--global-batch-tokens / --top apply to the advice only, not to --config (it evaluates one "
                "configuration at --micro-batch and --grad-accum)"
            )
        try:
            spec = model_spec(args.model)
        except (ValueError, OSError) as e:  # from_hf_config names its argument, config: here it is --model
            kind = OSError if isinstance(e, OSError) else ValueError
            raise kind(f"--model: {str(e).removeprefix('config: ')}") from None
        cl = _load_cluster(args.instance, args.nodes)
        if args.config is not None:
            cfg = _load_config(args.config)
            mb = 1 if args.micro_batch is None else args.micro_batch
            accum = 1 if args.grad_accum is None else args.grad_accum
            est = estimate_memory(
                spec, cfg, seq_len=args.seq_len, micro_batch=mb, cluster=cl, optimizer=args.optimizer,
                attention=args.attention, loss=args.loss, heap_bytes=args.heap_bytes,
                implementation=args.implementation,
            )  # fmt: skip
            tm = step_time(spec, est.config, cl, seq_len=args.seq_len, micro_batch=mb, grad_accum=accum)
        else:
            adv = advise(
                spec, cl, seq_len=args.seq_len, global_batch_tokens=args.global_batch_tokens,
                optimizer=args.optimizer, attention=args.attention, loss=args.loss,
                heap_bytes=args.heap_bytes, implementation=args.implementation,
            )  # fmt: skip
    except (ValueError, TypeError, NotImplementedError, OSError) as e:
        print(f"smptk plan: error: {_as_flag(str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.config is not None:
        fits = est.fits()
        status = EXIT_OK if fits else EXIT_NOTHING_FITS
        if args.json:
            print(json.dumps({**est.to_dict(), "fits": fits, "step": tm.__dict__}, indent=2), file=out)
            return status
        print(spec.describe(), file=out)
        print(cl.describe(), file=out)
        print(breakdown_table(est), file=out)
        print(implementation_note(args.implementation), file=out)
        verdict = "fits" if fits else "does NOT fit"
        print(f"{verdict} in {cl.gpu.memory_bytes / 2**30:.1f} GiB (less 0.5 GiB CUDA context)", file=out)
        print(f"predicted {tm.describe()}", file=out)
        return status
    top = 5 if args.top is None else args.top
    status = EXIT_OK if adv.candidates else EXIT_NOTHING_FITS
    if args.json:
        print(json.dumps(adv.to_dict(top=top), indent=2), file=out)
        return status
    print(spec.describe(), file=out)
    print(f"{cl.describe()}, seq_len {args.seq_len}", file=out)
    if not adv.candidates:
        print(adv.summary().split("\n", 2)[2], file=out)  # "nothing fits:" (or why not) and the suggestions
        return status
    print(advice_table(adv, top), file=out)
    print(breakdown_table(adv.best.estimate), file=out)
    print(implementation_note(args.implementation), file=out)
    return status
