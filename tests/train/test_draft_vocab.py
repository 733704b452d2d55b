"""Draft vocabulary: most frequent ids, EOS and chat specials always in, coverage, the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spd_engine.tools.cli import main as spd_main
from spd_engine.train.corpus import BuildOptions, Corpus, build_corpus
from spd_engine.train.decontaminate import Decontaminator
from spd_engine.train.draft_vocab_build import build_draft_vocab, coverage, load_draft_vocab, select_ids, token_counts


class DigitTokenizer:
    """A fake target tokenizer over 40 ids: digit d -> id 10 + d, 1 = turn start, 2 = EOS."""

    vocab_size = 40
    eos_ids = [2, 3]
    special_ids = [1, 2]
    fingerprint = "digits"

    def encode(self, text: str) -> list[int]:
        return [10 + int(c) for c in text if c.isdigit()]

    def chat_ids(self, text: str) -> list[int]:
        return [1] + self.encode(text) + [2]

    def conversation_ids(self, messages: list[dict]) -> list[int]:
        return [i for m in messages for i in self.chat_ids(m["content"])]


@pytest.fixture()
def corpus(tmp_path: Path) -> Corpus:
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    for name in ("mt_bench", "humaneval", "gsm8k"):
        (eval_dir / f"{name}.jsonl").write_text(json.dumps({"turns": ["no digits in the evals at all"]}) + "\n")
    tok = DigitTokenizer()
    # digit 0 is the most frequent, 9 the least: text i holds digits 0..(9 - i % 10)
    recs = [{"source": "t", "licence": "x", "kind": "text", "text": "".join(str(d) for d in range(10 - i % 10))}
            for i in range(200)]
    recs.append({"source": "p", "licence": "x", "kind": "prompt", "text": "5"})
    build_corpus(tmp_path / "c", [recs], tok, Decontaminator.from_eval_dir(eval_dir, tok.encode),
                 BuildOptions(holdout_fraction=0.1))
    return Corpus(tmp_path / "c")


def brute_counts(corpus: Corpus, split: str = "train") -> np.ndarray:
    counts = np.zeros(corpus.vocab_size, dtype=np.int64)
    for doc in corpus.documents(split):
        for i in doc.tolist():
            counts[i] += 1
    return counts


def test_select_ids_most_frequent_sorted_with_forced() -> None:
    counts = np.array([0, 0, 0, 50, 10, 40, 40, 5])
    ids = select_ids(counts, 4, always=[1])
    assert ids.tolist() == [1, 3, 5, 6]  # 1 forced despite count 0; ties 5/6 both fit
    assert select_ids(counts, 3, always=[]).tolist() == [3, 5, 6]
    assert select_ids(counts, 2, always=[]).tolist() == [3, 5]  # tie broken by the smaller id
    with pytest.raises(ValueError, match="smaller than"):
        select_ids(counts, 1, always=[0, 1])
    with pytest.raises(ValueError, match="size"):
        select_ids(counts, 9, always=[])


def test_counts_and_coverage_match_brute_force(corpus: Corpus) -> None:
    counts = token_counts(corpus)
    np.testing.assert_array_equal(counts, brute_counts(corpus))
    ids = np.array([10, 11, 12])
    assert coverage(counts, ids) == pytest.approx(counts[[10, 11, 12]].sum() / counts.sum())


def test_build_includes_eos_and_specials_and_reports_coverage(corpus: Corpus) -> None:
    vocab = build_draft_vocab(corpus, size=6)
    ids = vocab["ids"]
    assert ids == sorted(ids) and len(ids) == 6
    assert {1, 2, 3} <= set(ids)  # EOS ids 2, 3 (3 never occurs) and chat special 1 always in
    counts = brute_counts(corpus)
    rest = [i for i in ids if i not in (1, 2, 3)]
    assert rest == [10, 11, 12]  # digits 0, 1, 2: the most frequent
    assert vocab["coverage"] == pytest.approx(counts[ids].sum() / counts.sum())
    held = brute_counts(corpus, "holdout")
    assert vocab["holdout_coverage"] == pytest.approx(held[ids].sum() / held.sum())
    full = build_draft_vocab(corpus, size=40)
    assert full["coverage"] == 1.0


def test_generated_shards_are_counted(corpus: Corpus) -> None:
    before = token_counts(corpus)
    corpus.add_generated([[1, 19]], [[19, 19, 2]])
    after = token_counts(corpus)
    assert after[19] - before[19] == 3 and after.sum() - before.sum() == 5


def test_cli(corpus: Corpus, tmp_path: Path, capsys) -> None:
    out = tmp_path / "dv" / "vocab.json"
    assert spd_main(["draft-vocab", "--corpus", str(corpus.path), "--size", "8", "--out", str(out)]) == 0
    assert "coverage" in capsys.readouterr().out
    assert load_draft_vocab(out) == json.loads(out.read_text())["ids"]
    assert len(load_draft_vocab(out)) == 8
    assert spd_main(["draft-vocab", "--corpus", str(corpus.path), "--size", "2", "--out", str(out)]) == 2
    assert spd_main(["draft-vocab", "--corpus", str(tmp_path), "--size", "8", "--out", str(out)]) == 2
