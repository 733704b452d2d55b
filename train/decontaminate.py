"""Decontamination: drop every training sample that shares a token 13-gram with the evaluation data.

The n-grams are taken over the target tokenizer's ids (an `encode` callable), from every turn and
every reference answer of the EAGLE-format eval files. Lookup is a vectorised 64-bit rolling hash
of each window against a sorted array of eval hashes; every hash hit is then confirmed against
the exact eval n-grams, so a hash collision can never drop a sample. Eval texts shorter than `n`
tokens cannot share an `n`-gram; a sample whose text contains such a short prompt turn (after
whitespace and case normalisation; turns of at least `MIN_SHORT_WORDS` words) is dropped too.
Short reference answers ("West", "280") are not matched that way: they leak nothing.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

NGRAM = 13
MIN_SHORT_WORDS = 3  # a shorter prompt turn ("Why?") would match half the corpus
EVAL_SETS = ("mt_bench", "humaneval", "gsm8k")
_NON_TEXT_FIELDS = frozenset({"question_id", "category"})
# odd 64-bit multiplier of the rolling hash (arithmetic wraps mod 2**64 in numpy uint64)
_MULT = np.uint64(0x9E3779B97F4A7C15)


def window_hashes(ids: Sequence[int] | np.ndarray, n: int = NGRAM) -> np.ndarray:
    """Hash of every length-`n` window of `ids`: [len(ids) - n + 1] uint64 (empty if too short)."""
    arr = np.asarray(ids, dtype=np.uint64)  # [T]
    count = arr.shape[0] - n + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    h = np.zeros(count, dtype=np.uint64)  # [T-n+1]
    with np.errstate(over="ignore"):  # wrap-around is the hash
        for k in range(n):
            h = h * _MULT + arr[k:k + count] + np.uint64(1)
    return h


def normalise(text: str) -> str:
    return " ".join(text.split()).casefold()


def eval_texts(record: dict) -> list[tuple[str, str]]:
    """(field, text) of every prompt turn and reference answer of one eval record (any string
    field but the ids)."""
    texts: list[tuple[str, str]] = []
    for key, value in record.items():
        if key in _NON_TEXT_FIELDS:
            continue
        values = value if isinstance(value, list) else [value]
        texts.extend((key, v) for v in values if isinstance(v, str) and v.strip())
    return texts


class Decontaminator:
    """Holds the eval n-grams and counts what it drops per source."""

    def __init__(self, encode: Callable[[str], list[int]], n: int = NGRAM) -> None:
        if n <= 0:
            raise ValueError(f"n-gram length must be positive, got {n}")
        self.encode = encode
        self.n = n
        self._exact: set[tuple[int, ...]] = set()  # eval n-grams, to confirm hash hits
        self._short: set[str] = set()  # normalised eval prompt turns shorter than n tokens
        self._hashes = np.empty(0, dtype=np.uint64)  # sorted, unique
        self.eval_files: dict[str, str] = {}  # name -> sha256
        self.checked: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()

    # ---- the eval side
    def add_reference(self, text: str, is_prompt: bool = True) -> None:
        """Add one eval text; a prompt shorter than n tokens is remembered for text matching.

        The text is encoded as it stands and after a space: a BPE tokenizer gives the first word
        another id mid-sentence (" Take" vs "Take"), which would hide a text of exactly n tokens.
        """
        ids = self.encode(text)
        if len(ids) < self.n:
            if is_prompt and len(text.split()) >= MIN_SHORT_WORDS:
                self._short.add(normalise(text))
            return
        variants = [ids] if text[:1].isspace() else [ids, self.encode(" " + text)]
        for v in variants:
            self._exact.update(tuple(v[i:i + self.n]) for i in range(len(v) - self.n + 1))
            self._hashes = np.union1d(self._hashes, window_hashes(v, self.n))

    def add_eval_file(self, path: Path) -> int:
        """Add every turn and reference of an EAGLE-format jsonl file; returns its record count."""
        raw = Path(path).read_bytes()
        count = 0
        for lineno, line in enumerate(raw.decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
            if not isinstance(record, dict) or "turns" not in record:
                raise ValueError(f"{path}:{lineno}: an eval record needs a 'turns' field")
            for field, text in eval_texts(record):
                self.add_reference(text, is_prompt=field == "turns")
            count += 1
        self.eval_files[Path(path).name] = hashlib.sha256(raw).hexdigest()
        return count

    @classmethod
    def from_eval_dir(cls, eval_dir: Path, encode: Callable[[str], list[int]], n: int = NGRAM,
                      names: Iterable[str] = EVAL_SETS) -> "Decontaminator":
        dec = cls(encode, n)
        for name in names:
            path = Path(eval_dir) / f"{name}.jsonl"
            if not path.is_file():
                raise ValueError(f"eval file {path} is missing; refusing to build an undecontaminated corpus")
            dec.add_eval_file(path)
        return dec

    @property
    def num_ngrams(self) -> int:
        return len(self._exact)

    # ---- the sample side
    def contaminated(self, ids: Sequence[int] | np.ndarray) -> bool:
        """True if `ids` shares an n-gram with the eval data."""
        arr = np.asarray(ids, dtype=np.int64)  # [T]
        if arr.shape[0] < self.n or self._hashes.size == 0:
            return False
        h = window_hashes(arr, self.n)
        pos = np.searchsorted(self._hashes, h)
        pos[pos == self._hashes.size] = 0
        for i in np.flatnonzero(self._hashes[pos] == h):  # hash hits: confirm exactly
            if tuple(arr[i:i + self.n].tolist()) in self._exact:
                return True
        return False

    def contains_short_eval(self, text: str) -> bool:
        norm = normalise(text)
        return any(short in norm for short in self._short)

    def keep(self, source: str, ids: Sequence[int] | np.ndarray, texts: Iterable[str] = ()) -> bool:
        """Check one sample (its token ids and its raw texts, e.g. one per message); count it."""
        self.checked[source] += 1
        if self.contaminated(ids) or any(self.contains_short_eval(t) for t in texts):
            self.dropped[source] += 1
            return False
        return True

    def report(self) -> dict:
        return {"ngram": self.n, "eval_files": dict(self.eval_files), "eval_ngrams": self.num_ngrams,
                "eval_short_texts": len(self._short),
                "checked": dict(self.checked), "dropped": dict(self.dropped)}
