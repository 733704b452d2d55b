"""A tokenizer small enough for the tiny test models (vocabulary <= 96): a Metaspace BPE trained on a
few sentences, with <unk>, <s> and </s> at ids 0, 1, 2 (tiny_config's BOS and EOS)."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = ["hello world, the quick brown fox jumps over the lazy dog", "a tiny model says hello to the world"] * 20


def write_tiny_tokenizer(path: Path, vocab_size: int = 80) -> Path:
    """tokenizer.json (exactly `vocab_size` tokens) and tokenizer_config.json (eos </s>) in `path`."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.add_tokens([f"<extra_{i}>" for i in range(vocab_size - tok.get_vocab_size())])  # exactly vocab_size
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "unk_token": "<unk>"}))
    return path
