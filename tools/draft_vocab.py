"""`spd draft-vocab`: the K most frequent target token ids of a training corpus, as JSON.

    spd draft-vocab --corpus DIR --size K --out FILE

EOS ids and the chat special tokens are always included; coverage (fraction of corpus tokens
whose id is in the set) is printed and saved.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from spd_engine.train.corpus import Corpus
from spd_engine.train.draft_vocab_build import build_draft_vocab, save_draft_vocab


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", type=Path, required=True, help="corpus directory built by `spd data`")
    parser.add_argument("--size", type=int, required=True, help="number of token ids K")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--split", default="train", help="corpus split to count (default train)")


def run(args: argparse.Namespace) -> int:
    vocab = build_draft_vocab(Corpus(args.corpus), args.size, args.split)
    save_draft_vocab(vocab, args.out)
    held = vocab["holdout_coverage"]
    print(f"draft vocabulary: {vocab['size']} of {vocab['vocab_size']} ids, "
          f"coverage {vocab['coverage']:.4f} of {vocab['corpus_tokens']} {args.split} tokens"
          + (f", holdout coverage {held:.4f}" if held is not None else "") + f" -> {args.out}")
    return 0
