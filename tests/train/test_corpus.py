"""Corpus build and reader: round trip, determinism, split, decontamination counts, generated shards."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from spd_engine.tools.cli import main as spd_main
from spd_engine.train.corpus import BuildOptions, Corpus, build_corpus, interleave, record_ids, token_dtype
from spd_engine.train.decontaminate import Decontaminator
from spd_engine.train.draft_vocab_build import build_draft_vocab

EVAL_TURN = ("what is the capital city of the country that hosted the first modern olympic games "
             "in the year eighteen ninety six")


class ByteTokenizer:
    """A fake target tokenizer: byte ids + 3, with a ChatML-like template (1 = start, 2 = end/EOS)."""

    def __init__(self, vocab_size: int = 300) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = [2]
        self.special_ids = [1, 2]
        self.fingerprint = f"bytes-{vocab_size}"

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode()]

    def _turn(self, role: str, content: str) -> list[int]:
        return [1] + self.encode(f"{role}\n{content}") + [2]

    def chat_ids(self, text: str) -> list[int]:
        return self._turn("user", text) + [1] + self.encode("assistant\n")

    def conversation_ids(self, messages: list[dict]) -> list[int]:
        return [i for m in messages for i in self._turn(m["role"], m["content"])]


def records() -> dict[str, list[dict]]:
    prompts = [{"source": "p", "licence": "MIT", "kind": "prompt", "text": f"prompt number {i}"} for i in range(30)]
    prompts.append({"source": "p", "licence": "MIT", "kind": "prompt", "text": "Q: " + EVAL_TURN})
    convs = [{"source": "c", "licence": "MIT", "kind": "conversation",
              "messages": [{"role": "user", "content": f"hello {i}"}, {"role": "assistant", "content": "hi"}]}
             for i in range(10)]
    texts = [{"source": "t", "licence": "PSF-2.0", "kind": "text", "text": f"x = {i}\n" * 5} for i in range(20)]
    return {"p": prompts, "c": convs, "t": texts}


def write_eval_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in ("mt_bench", "humaneval", "gsm8k"):
        turn = EVAL_TURN if name == "mt_bench" else f"{name} placeholder prompt that is long enough to count"
        (path / f"{name}.jsonl").write_text(json.dumps({"question_id": 1, "turns": [turn]}) + "\n")
    return path


def build(tmp_path: Path, name: str = "corpus", tok: ByteTokenizer | None = None, **opts) -> tuple[Path, dict]:
    tok = tok or ByteTokenizer()
    decon = Decontaminator.from_eval_dir(write_eval_dir(tmp_path / "eval"), tok.encode)
    out = tmp_path / name
    manifest = build_corpus(out, list(records().values()), tok, decon, BuildOptions(**opts))
    return out, manifest


def expected_docs(tok: ByteTokenizer) -> list[tuple[int, ...]]:
    docs = []
    for recs in records().values():
        for r in recs:
            if "text" in r and EVAL_TURN in r["text"]:
                continue
            docs.append(tuple(record_ids(r, tok)[0]))
    return docs


def test_round_trip_and_manifest(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    out, manifest = build(tmp_path, holdout_fraction=0.1, build_command="spd data --test")
    corpus = Corpus(out)
    got = [tuple(d.tolist()) for split in ("train", "holdout") for d in corpus.documents(split)]
    assert Counter(got) == Counter(expected_docs(tok))
    assert manifest["splits"]["holdout"]["documents"] == 6  # round(60 * 0.1)
    assert corpus.manifest["tokenizer"]["dtype"] == "uint16"
    by_name = {s["name"]: s for s in manifest["sources"]}
    assert by_name["p"]["samples"] == 30 and by_name["p"]["dropped"] == 1
    assert by_name["t"]["licence"] == "PSF-2.0" and by_name["t"]["kinds"] == ["text"]
    assert manifest["decontamination"]["dropped"] == {"p": 1}
    assert sum(s["tokens"] for s in manifest["sources"]) == sum(len(d) for d in got)
    assert manifest["build_command"] == "spd data --test"
    assert corpus.token_count("train") + corpus.token_count("holdout") == sum(len(d) for d in got)


def test_prompts_are_chat_formatted_prompts_only(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    out, _ = build(tmp_path, holdout_fraction=0.0)
    prompts = {tuple(p.tolist()) for p in Corpus(out).prompts()}
    assert prompts == {tuple(tok.chat_ids(f"prompt number {i}")) for i in range(30)}


def test_text_documents_end_with_separator(tmp_path: Path) -> None:
    out, _ = build(tmp_path, holdout_fraction=0.0)
    texts = list(Corpus(out).documents(kinds=("text",)))
    assert len(texts) == 20 and all(int(t[-1]) == 2 for t in texts)


def test_sequences_pack_documents(tmp_path: Path) -> None:
    out, _ = build(tmp_path, holdout_fraction=0.0)
    corpus = Corpus(out)
    flat = np.concatenate(list(corpus.documents()))
    seqs = list(corpus.sequences(64))
    assert len(seqs) == flat.size // 64
    assert all(s.shape == (64,) for s in seqs)
    np.testing.assert_array_equal(np.concatenate(seqs), flat[:len(seqs) * 64])
    shuffled = list(corpus.sequences(64, seed=3))
    assert len(shuffled) == len(seqs)
    assert not np.array_equal(np.concatenate(shuffled), np.concatenate(seqs))
    assert [s.tolist() for s in corpus.sequences(64, seed=3)] == [s.tolist() for s in shuffled]
    with pytest.raises(ValueError, match="max_len"):
        next(corpus.sequences(0))


def test_build_is_deterministic_and_seeded(tmp_path: Path) -> None:
    a, _ = build(tmp_path, "a", seed=5)
    b, _ = build(tmp_path, "b", seed=5)
    c, _ = build(tmp_path, "c", seed=6)
    read = lambda p: np.load(p / "train.tokens.npy")  # noqa: E731
    np.testing.assert_array_equal(read(a), read(b))
    assert not np.array_equal(read(a), read(c))


def test_limit_tokens_keeps_every_source(tmp_path: Path) -> None:
    out, manifest = build(tmp_path, limit_tokens=500, holdout_fraction=0.0)
    total = manifest["splits"]["train"]["tokens"]
    assert 500 <= total < 500 + 200
    assert {s["name"] for s in manifest["sources"] if s["samples"]} == {"p", "c", "t"}


def test_uint32_for_large_vocabularies(tmp_path: Path) -> None:
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    out, _ = build(tmp_path, tok=ByteTokenizer(vocab_size=70000), holdout_fraction=0.0)
    corpus = Corpus(out)
    assert corpus.dtype == np.uint32 and np.load(out / "train.tokens.npy").dtype == np.uint32


def test_add_generated_shard(tmp_path: Path) -> None:
    out, _ = build(tmp_path, holdout_fraction=0.0)
    corpus = Corpus(out)
    prompts = [p.tolist() for p in list(corpus.prompts())[:3]]
    answers = [[10, 11, 2], [12, 2], [2]]
    before = corpus.token_count()
    name = corpus.add_generated(prompts, answers)
    assert name == "generated-000"
    reread = Corpus(out)  # the manifest on disk records the shard
    gen = [d.tolist() for d in reread.documents(kinds=("generated",))]
    assert gen == [p + a for p, a in zip(prompts, answers)]
    assert reread.token_count() == before + sum(len(p) + len(a) for p, a in zip(prompts, answers))
    assert reread.manifest["generated"][0]["documents"] == 3
    assert reread.add_generated([[5]], [[6]]) == "generated-001"
    with pytest.raises(ValueError, match="vocab"):
        reread.add_generated([[5]], [[10**6]])
    with pytest.raises(ValueError, match="equally many"):
        reread.add_generated([[5]], [])


def test_rebuild_replaces_old_corpus_but_not_other_files(tmp_path: Path) -> None:
    out, _ = build(tmp_path, holdout_fraction=0.0)
    Corpus(out).add_generated([[5]], [[6]])
    (out / "notes.txt").write_text("kept")
    build(tmp_path, holdout_fraction=0.0)
    assert not (out / "generated-000.tokens.npy").exists()
    assert Corpus(out).manifest["generated"] == [] and (out / "notes.txt").exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        build(tmp_path, "other")


def test_interleave_round_robin() -> None:
    assert list(interleave([[1, 2, 3], [10], [20, 21]])) == [1, 10, 20, 2, 21, 3]


def test_not_a_corpus(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="manifest"):
        Corpus(tmp_path)


# ---------------------------------------------------------------- the target-tokenizer adapter and `spd data`
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@pytest.fixture()
def hf_dir(tmp_path: Path) -> Path:
    """A tiny HF tokenizer directory: byte-level BPE trained on a few lines, ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x):\n    return x\n", "hello there, how are you?"] * 20, trainer)
    d = tmp_path / "hf"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    return d


def test_target_tokenizer_matches_engine_tokenizer(hf_dir: Path) -> None:
    from spd_engine.engine.model.tokenizer import Tokenizer
    from spd_engine.tools.data import TargetTokenizer

    tok = TargetTokenizer(hf_dir)
    engine_tok = Tokenizer.from_dir(hf_dir)
    for text in ["hello", "def f(x):\n    return x", "ünïcödé"]:
        assert tok.chat_ids(text) == engine_tok.chat_ids(text)
    conv = tok.conversation_ids([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert engine_tok.decode(conv) == ("<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
                                       "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n")
    assert tok.special_ids == [1, 2] and tok.eos_ids == [2]  # <|endoftext|> is not in the template
    assert len(tok.fingerprint) == 16


def test_spd_data_cli(tmp_path: Path, hf_dir: Path, capsys) -> None:
    out = tmp_path / "out"
    rc = spd_main(["data", "--out", str(out), "--tokenizer", str(hf_dir), "--sources", "stdlib",
                   "--limit-tokens", "3000", "--eval-dir", str(write_eval_dir(tmp_path / "eval"))])
    assert rc == 0
    corpus = Corpus(out)
    assert [s["name"] for s in corpus.manifest["sources"]] == ["stdlib"]
    assert "--limit-tokens 3000" in corpus.manifest["build_command"]
    assert corpus.token_count("train") + corpus.token_count("holdout") >= 3000
    assert "stdlib" in capsys.readouterr().out
    assert spd_main(["data", "--out", str(out), "--tokenizer", str(hf_dir), "--sources", "nope"]) == 2
    assert spd_main(["data", "--out", str(out), "--tokenizer", str(hf_dir), "--sources", "stdlib",
                     "--eval-dir", str(tmp_path / "missing")]) == 2


# ---------------------------------------------------------------- real tokenizer, real sources
def injected_eval_records(eval_dir: Path) -> list[dict]:
    """Every eval turn and reference planted inside otherwise clean samples, as text and as chat."""
    from spd_engine.train.decontaminate import eval_texts

    recs = []
    for name in ("mt_bench", "humaneval", "gsm8k"):
        for line in (eval_dir / f"{name}.jsonl").read_text().splitlines():
            for field, text in eval_texts(json.loads(line)):
                if field != "turns" and len(text.split()) < 12:
                    continue  # short reference answers are not decontaminated (they leak nothing)
                recs.append({"source": "planted", "licence": "-", "kind": "text",
                             "text": f"Here is something I read: {text}\nWhat do you think?"})
                recs.append({"source": "planted", "licence": "-", "kind": "conversation",
                             "messages": [{"role": "user", "content": "hello"},
                                          {"role": "assistant", "content": f"Well. {text} That is all."}]})
    return recs


@pytest.mark.slow
def test_real_corpus_has_no_eval_13gram(tmp_path: Path, smollm2_dir: Path) -> None:
    """Real sources plus planted eval texts through SmolLM2's tokenizer: every planted sample is
    dropped, and a brute-force scan finds no eval 13-gram in what is kept."""
    import itertools

    from spd_engine.tools.data import DEFAULT_EVAL_DIR, TargetTokenizer
    from spd_engine.train.decontaminate import eval_texts
    from spd_engine.train.sources import SOURCES

    if not DEFAULT_EVAL_DIR.is_dir():
        pytest.skip(f"shipped eval prompts not present at {DEFAULT_EVAL_DIR}")
    pytest.importorskip("reasoning_gym", reason="reasoning-gym (the data extra) is not installed")
    tok = TargetTokenizer(smollm2_dir)
    planted = injected_eval_records(DEFAULT_EVAL_DIR)
    streams = [itertools.islice(SOURCES["evals"](max_per_eval=3), 400),
               itertools.islice(SOURCES["chitchat"](), 100),
               SOURCES["reasoning_gym"](per_task=3),
               itertools.islice(SOURCES["stdlib"](), 200), planted]
    decon = Decontaminator.from_eval_dir(DEFAULT_EVAL_DIR, tok.encode)
    manifest = build_corpus(tmp_path / "real", streams, tok, decon, BuildOptions())
    by_name = {s["name"]: s for s in manifest["sources"]}
    assert by_name["planted"]["dropped"] == len(planted) and by_name["planted"]["samples"] == 0
    assert all(by_name[n]["samples"] > 0 for n in ("evals", "chitchat", "reasoning_gym", "stdlib"))
    banned = set()
    for name in ("mt_bench", "humaneval", "gsm8k"):
        for line in (DEFAULT_EVAL_DIR / f"{name}.jsonl").read_text().splitlines():
            for _, text in eval_texts(json.loads(line)):
                ids = tok.encode(text)
                banned.update(tuple(ids[i:i + 13]) for i in range(len(ids) - 12))
    corpus = Corpus(tmp_path / "real")
    for split in ("train", "holdout"):
        for doc in corpus.documents(split):
            d = doc.tolist()
            assert not any(tuple(d[i:i + 13]) in banned for i in range(len(d) - 12))
    vocab = build_draft_vocab(corpus, 4096)
    assert {0, 1, 2} <= set(vocab["ids"]) and 0.5 < vocab["coverage"] < 1.0


def test_spd_data_with_the_users_own_corpora(tmp_path: Path, hf_dir: Path, capsys) -> None:
    """--input jsonl (prompts, texts, chats) and a directory of text files, decontaminated like any source."""
    mine = tmp_path / "mine.jsonl"
    mine.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Write a haiku about rain."},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
        {"text": "a plain document about sorting lists in place"},
        {"prompt": f"Please answer: {EVAL_TURN}"},  # shares a 13-gram with the eval set: dropped
    ]) + "\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("first paragraph\n\nsecond paragraph")
    (docs / "notes.md").write_text("# notes\n\nsome markdown text")
    out = tmp_path / "out"
    rc = spd_main(["data", "--out", str(out), "--tokenizer", str(hf_dir), "--sources", "none",
                   "--input", str(mine), "--input", str(docs), "--holdout", "0",
                   "--eval-dir", str(write_eval_dir(tmp_path / "eval"))])
    assert rc == 0
    manifest = Corpus(out).manifest
    by_name = {s["name"]: s for s in manifest["sources"]}
    assert set(by_name) == {"user:mine.jsonl", "user:docs"}
    assert by_name["user:mine.jsonl"]["samples"] == 3 and by_name["user:mine.jsonl"]["dropped"] == 1
    assert by_name["user:docs"]["samples"] == 2 and by_name["user:docs"]["licence"] == "user-supplied"
    assert f"--input {mine}" in manifest["build_command"]
    assert spd_main(["data", "--out", str(tmp_path / "o2"), "--tokenizer", str(hf_dir), "--sources", "none"]) == 2
    assert spd_main(["data", "--out", str(tmp_path / "o2"), "--tokenizer", str(hf_dir),
                     "--input", str(tmp_path / "missing.jsonl")]) == 2
    assert "corpus input not found" in capsys.readouterr().err
