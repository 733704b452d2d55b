"""A SentencePiece `.model` (Megatron-LM's `--tokenizer-model`, Llama-style `tokenizer.model`) behind
the few calls engine/model/tokenizer.py makes of a `tokenizers.Tokenizer`, through the
`sentencepiece` package itself (so ids and text are SentencePiece's own; a control piece's text, such
as a chat template's "</s>", is read as its id, as HF's tokenizers do); without that package
it is refused in one line naming it. `WindowDecodeStream` is the incremental decoder for such a
backend (the `tokenizers` library's DecodeStream takes only its own tokenizers).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Encoding:
    """What `encode` returns: the ids, as a `tokenizers.Encoding` carries them."""

    ids: list[int]


class SentencePieceBackend:
    """encode / decode / token_to_id / id_to_token / get_vocab_size over a SentencePieceProcessor.
    Control pieces (BOS, EOS) are never produced from text, as SentencePiece encodes; decoding
    without skip_special_tokens writes them as their piece text, as HF's tokenizers do."""

    def __init__(self, path: str | Path) -> None:
        try:
            import sentencepiece
        except ImportError:
            raise ValueError(f"{path} is a SentencePiece model: reading it needs the sentencepiece package "
                             f"(pip install sentencepiece)") from None
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.Load(str(path))
        except (OSError, RuntimeError) as err:
            raise ValueError(f"{path}: not a SentencePiece model ({str(err).splitlines()[0]})") from None
        self._control = {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size()) if self.sp.is_control(i)}
        longest_first = sorted(self._control, key=len, reverse=True)
        self._control_split = re.compile(f"({'|'.join(map(re.escape, longest_first))})") if self._control else None

    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, unk_token and pad_token as the model defines them (id -1: none)."""
        ids = {"bos_token": self.sp.bos_id(), "eos_token": self.sp.eos_id(), "unk_token": self.sp.unk_id(),
               "pad_token": self.sp.pad_id()}
        return {name: self.sp.id_to_piece(i) for name, i in ids.items() if i >= 0}

    def encode(self, text: str, add_special_tokens: bool = False) -> Encoding:
        """The ids of `text`, where the text of a control piece ("<s>", "</s>", as a chat template
        writes them) is that piece's id, as HF's tokenizers read special tokens in text (the plain
        runs between them go through SentencePiece). add_special_tokens is Tokenizer's business
        (its BOS rule), as with `tokenizers`."""
        if self._control_split is None:
            return Encoding(list(self.sp.encode(text)))
        ids: list[int] = []
        for i, part in enumerate(self._control_split.split(text)):
            if i % 2:  # the pattern's one group: a control piece's text
                ids.append(self._control[part])
            elif part:
                ids += self.sp.encode(part)
        return Encoding(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; an id past the model's pieces (a padded vocabulary's row) decodes to
        nothing, as the `tokenizers` library decodes an id it lacks."""
        ids = [int(i) for i in ids if 0 <= int(i) < self.sp.get_piece_size()]
        if skip_special_tokens or not any(self.sp.is_control(i) for i in ids):
            return self.sp.decode(ids)  # SentencePiece's own decoding drops control pieces
        out, run = [], []
        for i in ids:  # plain runs decoded together (so spaces and byte pieces join), control pieces as text
            if self.sp.is_control(i):
                out += [self.sp.decode(run), self.sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join(out) + self.sp.decode(run)

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        return None if i == self.sp.unk_id() and token != self.sp.id_to_piece(i) else i

    def id_to_token(self, i: int) -> str | None:
        return self.sp.id_to_piece(int(i)) if 0 <= int(i) < self.sp.get_piece_size() else None

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.sp.get_piece_size()


class WindowDecodeStream:
    """Incremental decoding of any backend: the text of a short window of recent ids is decoded
    with and without the new id, and the difference is the new piece (held back while it ends in
    U+FFFD, an incomplete UTF-8 character). The window keeps the decoder's context (a leading
    space, joined byte pieces) without decoding the whole output again at every token."""

    def __init__(self, skip_special_tokens: bool = False) -> None:
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the window
        self.read = 0  # ids before this one have been emitted

    def step(self, backend, token_id: int) -> str | None:
        self.ids.append(int(token_id))
        done = backend.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        text = backend.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return None
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]
