"""What every `spd` subcommand shares in its flags: run-config defaults are RunConfig's own field
defaults; `--json [FILE]` writes JSON to stdout, or to FILE; dtypes are float32 / bfloat16 /
float16 or fp32 / bf16 / fp16; float flags are finite (finite_float); a flag the command would ignore
is refused; --max-batch / --max-rows."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path

from spd_engine.engine.runtime.run_config import run_fields

DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def run_default(name: str):
    """The default of a RunConfig setting by its dotted name (`runtime.prefill_chunk`, run_fields): the one
    place run defaults are written."""
    field = run_fields()[name]
    assert field.default is not dataclasses.MISSING, f"RunConfig.{name} has no default"
    return field.default.value if hasattr(field.default, "value") else field.default


def dtype_name(text: str) -> str:
    """argparse type: a dtype name or alias (bf16, fp16, fp32) -> its canonical name."""
    name = DTYPE_ALIASES.get(text, text)
    if name not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose from {', '.join(DTYPE_NAMES)} "
                                         f"(or {', '.join(DTYPE_ALIASES)})")
    return name


def engine_dtype_name(text: str) -> str:
    """argparse type of the engine's --dtype: `auto` (resolved by the device in engine_config) or a dtype."""
    return "auto" if text == "auto" else dtype_name(text)


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto`: bfloat16 on CUDA (the GPUs' native half type), float32 on CPU (bf16 matmuls are slow there)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if str(device).startswith("cuda") else "float32"


def add_dtype_argument(p, default: str | None, help_text: str, flag: str = "--dtype") -> None:
    p.add_argument(flag, type=dtype_name, default=default, metavar="{float32,bfloat16,float16}",
                   help=f"{help_text} (aliases fp32, bf16, fp16)")


def add_json_argument(p, what: str) -> None:
    """`--json` prints JSON to stdout; `--json FILE` writes it to FILE."""
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help=f"{what} as JSON: to stdout, or to FILE when given")


def check_output_path(target: str | None, flag: str) -> None:
    """ValueError, before any work, when `target` (a file to write; None or '-' = stdout) cannot be written."""
    if target in (None, "-"):
        return
    path = Path(target).expanduser()
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ValueError(f"{flag} {target}: is a directory; give a file name")
    if not parent.is_dir():
        raise ValueError(f"{flag} {target}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {target}: not writable")


def write_json(target: str, doc, indent: int | None = 1) -> None:
    """`doc` to stdout ('-') or to the file `target`."""
    text = json.dumps(doc, indent=indent)
    if target == "-":
        print(text, flush=True)
    else:
        Path(target).write_text(text + "\n")


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the command line set `dest` explicitly (cli.main records it; False when unknown)."""
    return dest in getattr(args, "given", ())


def refuse_ignored(args: argparse.Namespace, dests: list[str], why: str) -> None:
    """ValueError if any of these flags was given: the command would silently ignore it."""
    bad = [d for d in dests if given(args, d)]
    if bad:
        flags = ", ".join("--" + d.replace("_", "-") for d in bad)
        raise ValueError(f"{flags}: not used {why}")


SERVE_CPU_BATCH = 4  # spd serve's --max-batch on a CPU: a lone request measured as fast as at B = 1 (docs/serve.md)


def add_batch_arguments(g, what: str, auto: bool = False) -> None:
    """--max-batch and --max-rows (generate, serve): `what` says what joins the pipeline; `auto`: the
    default B is resolve_max_batch's."""
    default = "auto: %d for SPD on a CPU, else 1 (batch steps run without CUDA graphs)" % SERVE_CPU_BATCH \
        if auto else "1"
    g.add_argument("--max-batch", type=int, default=None if auto else 1, metavar="B",
                   help=f"SPD: up to B {what} in the pipeline at once (docs/design.md 3.12); each gets the tokens "
                        "it gets alone (batch-invariant, 3.16), but not with --weight-layout mixed, on CUDA-graph "
                        "steps, or in steps of more rows than the kernels' probed ceiling (16 or 15 on CPUs "
                        f"measured) (default {default})")
    g.add_argument("--max-rows", type=int, default=None, metavar="R",
                   help="with --max-batch: at most R decode rows per stage step (default: every live request's "
                        "entry every tick, suffix runs included); a request whose pipeline holds no live token of it "
                        "waits for a row; under R, entries carry one token (no suffix runs)")


def check_batch_arguments(args: argparse.Namespace) -> None:
    """--max-batch / --max-rows, before any model loads; --suffix-run K > 1 with --max-rows is
    refused: under a row bound the user set, entries inside a batch carry one token (docs/design.md 3.12)."""
    if args.max_batch is not None and args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_rows is not None and (args.max_rows < 1 or (args.max_batch or SERVE_CPU_BATCH) < 2):
        raise ValueError(f"--max-rows {args.max_rows}: needs --max-batch B >= 2 and R >= 1")
    run = getattr(args, "suffix_run", None)
    if args.max_rows is not None and run is not None and run > 1:
        raise ValueError(f"--suffix-run {run}: not used with --max-rows {args.max_rows} (under a row bound "
                         "entries inside a batch carry one token)")


def resolve_max_batch(args: argparse.Namespace, mode: object, device: str) -> int:
    """--max-batch as given, else (serve's auto) SERVE_CPU_BATCH for SPD on a CPU and 1 otherwise:
    on a GPU a lone request's one-row steps run as CUDA graphs, a batch's steps eagerly."""
    if args.max_batch is not None:
        return args.max_batch
    from spd_engine.engine.runtime.run_config import Mode

    return SERVE_CPU_BATCH if mode is Mode.SPD and device == "cpu" else 1


def finite_float(text: str) -> float:
    """argparse type: a float that is finite (`nan` and `inf` would turn every comparison with it false)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def parse_names(text: str, choices, what: str) -> list[str]:
    """A comma-separated list of names, each one of `choices` (ValueError naming the bad ones)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in choices]
    if bad or not names:
        raise ValueError(f"unknown {what} {bad or text!r}; choose from {', '.join(sorted(choices))}")
    return names
