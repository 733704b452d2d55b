"""Decontamination: eval 13-grams in token space drop a sample; 12-gram near-misses are kept."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spd_engine.train.decontaminate import NGRAM, Decontaminator, eval_texts, window_hashes

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file


class WordEncoder:
    """A fake tokenizer: one id per distinct whitespace-separated word."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def __call__(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]


EVAL_PROMPT = ("natalia sold clips to forty eight of her friends in april and then she sold half "
               "as many clips in may how many clips did natalia sell altogether")
EVAL_ANSWER = "in may natalia sold forty eight divided by two which is twenty four clips in total"


def write_evals(tmp_path: Path) -> Path:
    rows = {
        "gsm8k": [{"question_id": 1, "category": "math", "turns": [EVAL_PROMPT], "reference": [EVAL_ANSWER]}],
        "mt_bench": [{"question_id": 81, "category": "writing",
                      "turns": ["compose an engaging travel blog post about a recent trip to hawaii "
                                "highlighting cultural experiences and must see attractions",
                                "prove the pythagorean theorem"]},
                     {"question_id": 82, "category": "reasoning", "turns": ["which direction"],
                      "reference": ["west"]}],
        "humaneval": [{"question_id": 0, "category": "code",
                       "turns": ["complete the code def below_threshold l t return true if all numbers "
                                 "in the list l are below threshold t"]}],
    }
    for name, records in rows.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


@pytest.fixture()
def decon(tmp_path: Path) -> tuple[Decontaminator, WordEncoder]:
    enc = WordEncoder()
    return Decontaminator.from_eval_dir(write_evals(tmp_path), enc), enc


def test_window_hashes_match_python_tuples() -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, size=200)
    h = window_hashes(ids, 5)
    assert h.shape == (196,)
    # equal windows hash equally; distinct windows (almost surely) differ
    windows = [tuple(ids[i:i + 5]) for i in range(196)]
    by_window: dict[tuple, set[int]] = {}
    for w, v in zip(windows, h.tolist()):
        by_window.setdefault(w, set()).add(v)
    assert all(len(v) == 1 for v in by_window.values())
    assert len(set(h.tolist())) == len(by_window)
    assert window_hashes(ids[:4], 5).size == 0


def test_sample_with_eval_13gram_is_dropped(decon) -> None:
    dec, enc = decon
    words = EVAL_PROMPT.split()
    inner = " ".join(words[5:5 + NGRAM])  # 13 consecutive eval words inside other text
    sample = f"some unrelated words before {inner} and after"
    assert dec.contaminated(enc(sample))
    assert not dec.keep("src", enc(sample), [sample])
    assert dec.dropped["src"] == 1 and dec.checked["src"] == 1


def test_reference_answers_are_decontaminated_too(decon) -> None:
    dec, enc = decon
    sample = "the answer " + " ".join(EVAL_ANSWER.split()[:NGRAM])
    assert dec.contaminated(enc(sample))


def test_12gram_near_miss_is_kept(decon) -> None:
    dec, enc = decon
    words = EVAL_PROMPT.split()
    near = " ".join(words[:NGRAM - 1])  # only 12 consecutive eval words
    sample = f"{near} zebra " + " ".join(words[NGRAM - 1:NGRAM + 10])  # broken before word 13
    assert not dec.contaminated(enc(sample))
    assert dec.keep("src", enc(sample), [sample])
    assert dec.dropped["src"] == 0 and dec.checked["src"] == 1


def test_every_turn_is_used(decon) -> None:
    dec, enc = decon
    second_turn_only = ("compose an engaging travel blog post about a recent trip to hawaii "
                        "highlighting cultural experiences")
    assert dec.contaminated(enc(second_turn_only))
    humaneval = "def below_threshold l t return true if all numbers in the list l are below"
    assert dec.contaminated(enc(humaneval))


def test_short_prompt_turn_matched_as_text_but_short_reference_not(decon) -> None:
    dec, enc = decon
    assert not dec.keep("chat", enc("hi"), ["hello", "  Prove the Pythagorean   theorem "])
    assert not dec.keep("chat", enc("hi"), ["now prove the pythagorean theorem, please"])
    assert dec.keep("chat", enc("hi"), ["prove the pythagorean law"])
    assert dec.keep("chat", enc("hi"), ["which direction"])  # a 2-word turn is too short to match on
    assert dec.keep("chat", enc("hi"), ["west"])  # a short reference answer leaks nothing


def test_report_and_fingerprints(decon) -> None:
    dec, enc = decon
    dec.keep("a", enc(EVAL_PROMPT), [EVAL_PROMPT])
    dec.keep("b", enc("nothing here"), ["nothing here"])
    rep = dec.report()
    assert rep["dropped"] == {"a": 1}
    assert rep["checked"] == {"a": 1, "b": 1}
    assert set(rep["eval_files"]) == {"mt_bench.jsonl", "humaneval.jsonl", "gsm8k.jsonl"}
    assert rep["eval_ngrams"] > 0


def test_missing_eval_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "gsm8k.jsonl").write_text("")
    with pytest.raises(ValueError, match="missing"):
        Decontaminator.from_eval_dir(tmp_path, WordEncoder())


def test_eval_texts_reads_turns_and_references() -> None:
    rec = {"question_id": 3, "category": "x", "turns": ["a b", "c"], "reference": ["d"], "extra": 5}
    assert eval_texts(rec) == [("turns", "a b"), ("turns", "c"), ("reference", "d")]


def test_real_eval_files_drop_their_own_prompts() -> None:
    """Every prompt of the shared eval set must be caught when it appears in a sample."""
    eval_dir = Path(__file__).resolve().parents[2] / "train" / "evalsets"
    enc = WordEncoder()
    dec = Decontaminator.from_eval_dir(eval_dir, enc)
    for name in ("mt_bench", "humaneval", "gsm8k"):
        for line in (eval_dir / f"{name}.jsonl").read_text().splitlines():
            turn = json.loads(line)["turns"][0]
            assert not dec.keep(name, enc("Question: " + turn), ["Question: " + turn]), turn[:60]


class SpaceWordEncoder(WordEncoder):
    """Like a byte-level BPE: a word keeps its leading space, so "take" and " take" differ."""

    def __call__(self, text: str) -> list[int]:
        import re

        return [self.vocab.setdefault(w, len(self.vocab)) for w in re.findall(r" ?\S+|\s", text)]


def test_exactly_n_token_turn_found_mid_sentence(tmp_path: Path) -> None:
    turn = "take your previous response and rephrase it as a limerick about two cats"
    enc = SpaceWordEncoder()
    assert len(enc(turn)) == NGRAM
    for name in ("mt_bench", "humaneval", "gsm8k"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"turns": [turn]}) + "\n")
    dec = Decontaminator.from_eval_dir(tmp_path, enc)
    assert dec.contaminated(enc(turn))
    assert dec.contaminated(enc("well, " + turn))  # first word now " take"
    assert not dec.contaminated(enc("well, " + turn.replace("cats", "dogs")))
