"""Draft vocabulary: the K most frequent target token ids of the training corpus.

The PDM's head predicts only these ids (a sorted subset of the target vocabulary, see docs/design.md 3.5);
the EOS ids and the chat template's special tokens are always included, so the PDM can draft
the end of a turn. Coverage is the fraction of corpus tokens whose id is in the set: an upper
bound on how often a draft can even match the target's token.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

from spd_engine.train.corpus import Corpus


def token_counts(corpus: Corpus, split: str = "train") -> np.ndarray:
    """Occurrences of every token id in a split (generated shards included): [vocab] int64."""
    counts = np.zeros(corpus.vocab_size, dtype=np.int64)
    for name in corpus.shard_names(split):
        tokens = np.load(corpus.path / f"{name}.tokens.npy", mmap_mode="r")  # [N]
        counts += np.bincount(tokens, minlength=corpus.vocab_size)[:corpus.vocab_size]
    return counts


def select_ids(counts: np.ndarray, size: int, always: Iterable[int]) -> np.ndarray:
    """`always` plus the most frequent other ids up to `size` in all, sorted ascending: [size].

    Ties are broken by the smaller id, so the result is deterministic.
    """
    vocab = counts.shape[0]
    forced = sorted(set(int(i) for i in always))
    if not 0 < size <= vocab:
        raise ValueError(f"draft vocabulary size must be in 1..{vocab}, got {size}")
    if forced and (forced[0] < 0 or forced[-1] >= vocab):
        raise ValueError(f"always-included ids {forced} fall outside the vocabulary of {vocab}")
    if len(forced) > size:
        raise ValueError(f"draft vocabulary size {size} is smaller than the {len(forced)} ids "
                         f"that must be included (EOS and chat special tokens)")
    order = np.lexsort((np.arange(vocab), -counts))  # by count descending, then id ascending
    rest = order[~np.isin(order, forced)][:size - len(forced)]
    return np.sort(np.concatenate([np.asarray(forced, dtype=np.int64), rest]))


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0


def build_draft_vocab(corpus: Corpus, size: int, split: str = "train") -> dict:
    """The draft vocabulary of a corpus as a JSON-ready dict."""
    tok = corpus.manifest["tokenizer"]
    always = sorted(set(tok["eos_ids"]) | set(tok["special_ids"]))
    counts = token_counts(corpus, split)
    ids = select_ids(counts, size, always)
    holdout = corpus.manifest["splits"].get("holdout", {})
    held = coverage(token_counts(corpus, "holdout"), ids) if holdout.get("documents") else None
    return {
        "size": int(ids.size),
        "vocab_size": corpus.vocab_size,
        "ids": [int(i) for i in ids],
        "always_included": always,
        "coverage": coverage(counts, ids),
        "holdout_coverage": held,
        "corpus_tokens": int(counts.sum()),
        "tokenizer_fingerprint": tok["fingerprint"],
        "corpus": str(corpus.path),
        "split": split,
    }


def save_draft_vocab(vocab: dict, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(vocab) + "\n")


def load_draft_vocab(path: Path) -> list[int]:
    """The sorted ids of a saved draft vocabulary."""
    data = json.loads(Path(path).read_text())
    ids = [int(i) for i in data["ids"]]
    if ids != sorted(set(ids)):
        raise ValueError(f"{path}: draft vocabulary ids must be unique and sorted ascending")
    return ids
