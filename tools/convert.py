"""`spd convert`: checkpoint conversion between HF, the engine format and Megatron-core torch_dist.

  spd convert hf2engine HF_DIR OUT [--stages N | --stage-layers 8,8,7,7] [--tp N] [--dtype D] [--force]
  spd convert engine2hf ENGINE_DIR OUT [--dtype D] [--max-shard-size GB] [--force]
  spd convert export-megatron SRC OUT [--release-layout] [--force]   (SRC: engine or HF directory)
  spd convert import-megatron MEGATRON_DIR OUT [--stages/--stage-layers/--tp] [--dtype D] [--hf-config DIR]
                              [--tokenizer PATH] [--force]
  spd convert verify A B [--atol X] [--min-agreement F] [--prompts N] [--length T]
  spd convert head SRC OUT --dtype int4|int8|float16|bfloat16|float32 [--zlib]   (a head's weights, engine/model/pdm_quant.py)

hf2engine and engine2hf write and read the engine's own checkpoint format (index.json and its
shards); their former names hf2mcore and mcore2hf still work, with a note. Megatron-core's format
is export-megatron's and import-megatron's. import-megatron carries a tokenizer into the engine
checkpoint (checkpoint_tools/tokenizer_files.py). Megatron-LM's spellings of the split flags
(--pipeline-model-parallel-size, --tensor-model-parallel-size) and of --tokenizer-model are accepted.
Every action but verify and head writes OUT whole or not at all (a temporary sibling renamed into
place, checkpoint_tools/output_dir.py); a non-empty OUT is refused unless --force, which replaces
only a previous checkpoint.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from spd_engine.checkpoint_tools import hf, megatron_dcp, output_dir, shard, tokenizer_files
from spd_engine.checkpoint_tools import verify_checkpoint as verify
from spd_engine.engine.model.checkpoint import parse_dtype
from spd_engine.tools.cli_conventions import add_dtype_argument, dtype_name

RENAMED = {"hf2mcore": "hf2engine", "mcore2hf": "engine2hf"}  # former names, still accepted
RENAMED_WHY = {"hf2mcore": "it writes the engine's own format, which megatron-core does not load; export-megatron "
                           "writes Megatron-core's",
               "mcore2hf": "it reads the engine's own format; import-megatron reads Megatron-core's"}


def _split_args(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--stages", "--pipeline-model-parallel-size", dest="stages", type=int, default=None,
                       help="pipeline stages the checkpoint is stored in, evenly split (default 1)")
    group.add_argument("--stage-layers", default=None, help="explicit layer counts per stage, e.g. 8,8,7,7")
    p.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel ranks per stage (default 1)")


def _dtype_arg(p: argparse.ArgumentParser) -> None:
    add_dtype_argument(p, None, "cast the weights (default: keep the source dtype; only then is a round trip "
                       "bit-identical)")


def _force_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true",
                   help="replace a previous checkpoint at DST (a directory of anything else is still refused)")


def _paths(p: argparse.ArgumentParser, src: str, dst: str) -> None:
    p.add_argument("src", help=src)
    p.add_argument("dst", help=dst)


def _head_dtype(text: str) -> str:
    """int4, int8, or a float dtype under any of its spellings (tools/cli_conventions.py dtype_name)."""
    return text if text in ("int4", "int8") else dtype_name(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    def action(name: str, help_text: str) -> argparse.ArgumentParser:  # formatted and strict like every spd command
        return sub.add_parser(name, help=help_text, formatter_class=parser.formatter_class, allow_abbrev=False)

    for name in ("hf2engine", "hf2mcore"):
        p = action(name, "HF directory -> engine checkpoint split by stage and TP rank" if name == "hf2engine" else
                   "former name of hf2engine (the engine's format, not Megatron-core's)")
        _paths(p, "HF model directory", "engine checkpoint directory to write")
        _split_args(p), _dtype_arg(p), _force_arg(p)
    for name in ("engine2hf", "mcore2hf"):
        p = action(name, "engine checkpoint -> HF directory (stages and TP ranks merged)" if name == "engine2hf" else
                   "former name of engine2hf (reads the engine's format, not Megatron-core's)")
        _paths(p, "engine checkpoint directory", "HF directory to write")
        _dtype_arg(p), _force_arg(p)
        p.add_argument("--max-shard-size", type=float, default=5.0, help="max GB per safetensors file (default 5)")
    p = action("export-megatron", "engine or HF checkpoint -> Megatron-core torch_dist")
    _paths(p, "engine checkpoint or HF directory", "Megatron-core torch_dist directory to write")
    p.add_argument("--release-layout", action="store_true",
                   help="write Megatron-LM's --load layout (DST/release + latest_checkpointed_iteration.txt)")
    _force_arg(p)
    p = action("import-megatron", "Megatron-core torch_dist -> engine checkpoint")
    _paths(p, "Megatron-core torch_dist directory", "engine checkpoint directory to write")
    _split_args(p), _dtype_arg(p), _force_arg(p)
    p.add_argument("--hf-config", default=None,
                   help="HF directory whose config.json describes the model (for checkpoints that record none)")
    p.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer", default=None, metavar="PATH",
                   help="tokenizer copied into the engine checkpoint: an HF tokenizer directory, a tokenizer.json "
                        "or a SentencePiece .model (default: the checkpoint's own tokenizer/ directory, else the "
                        "tokenizer files beside --hf-config's config.json)")
    p = action("verify", "compare the logits of two checkpoints (HF, engine or Megatron)")
    p.add_argument("a", help="first checkpoint (HF, engine or Megatron directory)")
    p.add_argument("b", help="second checkpoint, compared with A")
    p.add_argument("--atol", type=float, default=1e-4, help="max allowed |logit difference| (default 1e-4)")
    p.add_argument("--min-agreement", type=float, default=1.0, help="min argmax agreement (default 1.0)")
    p.add_argument("--prompts", type=int, default=3, help="number of random prompts (default 3)")
    p.add_argument("--length", type=int, default=16, help="tokens per prompt (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--hf-config", default=None, help="HF directory describing a Megatron checkpoint's model")
    p.add_argument("--reference", choices=verify.REFERENCES, default="auto",
                   help="auto: an HF side runs in transformers and a Megatron side in megatron-core where installed "
                        "(independent of the engine's importers); engine: both sides in the engine's model")
    p = action("head", "a PDM head directory -> the same head with its weights stored as --dtype")
    _paths(p, "PDM head directory", "head directory to write")
    p.add_argument("--dtype", required=True, type=_head_dtype, metavar="{int4,int8,float16,bfloat16,float32}",
                   help="int8: per-row int8 matrices with fp16 scales; int4: groups of 32 weights with one fp16 scale "
                        "(engine/model/head_int4.py); both dequantized when loaded (aliases fp32, bf16, fp16)")
    p.add_argument("--zlib", action="store_true",
                   help="store the weights file zlib-compressed (the same bytes, smaller; engine/model/head_zlib.py)")


def run(args: argparse.Namespace) -> int:
    if args.action == "head":
        import torch

        from spd_engine.engine.model.pdm_quant import convert_head

        dtype = "int4" if args.dtype == "int4" else getattr(torch, args.dtype)
        print(f"wrote {convert_head(args.src, args.dst, dtype, compress=args.zlib)}")
        return 0
    if args.action in RENAMED:
        print(f"spd convert: {args.action} is now named {RENAMED[args.action]} ({RENAMED_WHY[args.action]})",
              file=sys.stderr)
        args.action = RENAMED[args.action]
    if args.action in ("hf2engine", "engine2hf") and megatron_dcp.is_megatron_dir(args.src):
        raise ValueError(f"{args.src} is a Megatron checkpoint: spd convert import-megatron {args.src} DST reads it "
                         f"into an engine checkpoint")
    dtype = parse_dtype(args.dtype) if getattr(args, "dtype", None) else None
    if args.action == "hf2engine":
        index = shard.hf2mcore(args.src, args.dst, pp=args.stages, stage_layers=args.stage_layers, tp=args.tp,
                               dtype=dtype, force=args.force)
        print(f"wrote {args.dst}: stages {list(index.stage_layers)}, tp {index.tp}, {index.dtype}, "
              f"content hash {index.content_hash[:16]}")
    elif args.action == "engine2hf":
        if args.max_shard_size <= 0:
            raise ValueError(f"--max-shard-size must be positive, got {args.max_shard_size}")
        shard.mcore2hf(args.src, args.dst, dtype=dtype, max_shard_bytes=int(args.max_shard_size * 1024**3),
                       force=args.force)
        print(f"wrote {args.dst}")
    elif args.action == "export-megatron":
        print(f"wrote {_export_megatron(args)}")
    elif args.action == "import-megatron":
        _import_megatron(args, dtype)
    else:
        if args.prompts < 1 or args.length < 1:
            raise ValueError("--prompts and --length must be >= 1")
        result = verify.verify(args.a, args.b, atol=args.atol, min_agreement=args.min_agreement,
                               hf_config=args.hf_config, prompt_count=args.prompts, prompt_length=args.length,
                               seed=args.seed, reference=args.reference)
        print(result.summary())
        return 0 if result.passed else 1
    return 0


def _export_megatron(args: argparse.Namespace) -> Path:
    """`export-megatron`, written whole into a temporary sibling of DST and renamed into place."""
    sources = (Path(args.src),)
    output_dir.check_destination(Path(args.dst), args.force, sources)  # refused before the weights are read
    cfg, state = verify.load_any(args.src)
    kind = verify.detect_kind(args.src)
    with output_dir.atomic_output(args.dst, force=args.force, sources=sources) as tmp:
        out = megatron_dcp.export_megatron(tmp, cfg, state, release_layout=args.release_layout,
                                           tokenizer_src=args.src if kind in ("engine", "hf") else None)
    return Path(args.dst) / out.relative_to(tmp)


def _import_megatron(args: argparse.Namespace, dtype) -> None:
    """`import-megatron`: the weights and the tokenizer (loaded first: a bad one is refused before the
    weights are read) into one engine checkpoint, written atomically."""
    from spd_engine.engine.model.tokenizer import Tokenizer
    from spd_engine.tools.model_args import check_tokenizer

    output_dir.check_destination(Path(args.dst), args.force, (Path(args.src),))  # before the weights are read
    tok_src = tokenizer_files.import_source(args.tokenizer, megatron_dcp.tokenizer_dir(args.src), args.hf_config)
    if args.tokenizer is not None:  # one found with the checkpoint is carried as it is
        Tokenizer.from_dir(tok_src)
    cfg = hf.read_hf_config(args.hf_config)[0] if args.hf_config else None
    cfg, state = megatron_dcp.import_megatron(args.src, cfg)
    if args.tokenizer is not None:
        check_tokenizer(tok_src, cfg)  # its vocabulary fits the model's
    state = shard.cast_state(state, dtype)
    with tempfile.TemporaryDirectory() as staging:
        staged = tokenizer_files.staged_dir(tok_src, Path(staging) / "tokenizer") if tok_src is not None else None
        index = shard.write_engine(args.dst, cfg, state, pp=args.stages, stage_layers=args.stage_layers, tp=args.tp,
                                   tokenizer_src=staged, force=args.force, sources=(Path(args.src),))
    carried = tok_src is not None and tokenizer_files.has_tokenizer(tok_src)
    print(f"wrote {args.dst}: stages {list(index.stage_layers)}, tp {index.tp}, {index.dtype}, "
          f"tokenizer {tok_src if carried else 'none'}")
    if not carried:
        print("spd convert: no tokenizer carried, so text prompts will be refused; import again with "
              "--tokenizer PATH, or give --tokenizer PATH to generate and serve", file=sys.stderr)
