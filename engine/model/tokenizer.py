"""Tokenizer: text <-> token ids for the driver, on the `tokenizers` library (no transformers at runtime).

Reads an HF directory: `tokenizer.json`, `tokenizer_config.json` (special tokens, BOS), the chat
template (engine/model/chat_template.py: `chat_template.jinja` or tokenizer_config.json, rendered as HF
renders it, so prompts are byte-identical) and the EOS set from `generation_config.json` /
`config.json`. A SentencePiece `tokenizer.model` (a directory's, or a `.model` file given as such,
as Megatron-LM's `--tokenizer-model`) is read through the `sentencepiece` package
(engine/model/sentencepiece_backend.py); a `tokenizer.json` or `.model` file given as such takes
those other files from its own directory. `chat_ids_messages` takes a whole multi-turn chat
(the CLI's --messages-file, a server's messages). `IncrementalDetokenizer` turns a stream of
generated ids into printable text pieces through the library's own `DecodeStream` (a SentencePiece
model's: a window decoder, engine/model/sentencepiece_backend.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as Backend
from tokenizers.decoders import DecodeStream

from spd_engine.engine.model.chat_template import _raise_exception, _tojson, find_chat_template, render  # noqa: F401
from spd_engine.engine.model.sentencepiece_backend import SentencePieceBackend, WindowDecodeStream


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def check_text(text: str, what: str = "text") -> None:
    """ValueError for text that is not valid Unicode (a lone surrogate such as "\\ud800", which JSON
    allows): the tokenizer cannot take it, and it is the input's fault, not the server's."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate U+{ord(text[err.start]):04X} at "
                         f"character {err.start}") from None


def _token_text(value) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """Byte-level BPE (or any `tokenizers`) tokenizer plus chat template and EOS set of one model."""

    def __init__(self, backend: Backend, chat_template: str | None, eos_ids: tuple[int, ...],
                 special_tokens: dict[str, str], add_bos: bool = False) -> None:
        assert eos_ids, "a tokenizer needs at least one EOS id"
        self.backend = backend
        self.chat_template = chat_template
        self.eos_ids = eos_ids
        self.special_tokens = special_tokens  # bos_token, eos_token, ... -> token text
        self.add_bos = add_bos
        bos = special_tokens.get("bos_token")
        self.bos_id = backend.token_to_id(bos) if bos else None

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """The tokenizer of an HF directory, or of a `tokenizer.json` or SentencePiece `.model` file
        (its directory's tokenizer_config.json, generation_config.json and chat template with it)."""
        path = Path(path)
        if not path.exists():
            raise ValueError(f"tokenizer not found: {path}")
        hf_dir, backend = (path.parent, load_backend(path)) if path.is_file() else (path, cls._dir_backend(path))
        tok_cfg = _read_json(hf_dir / "tokenizer_config.json")
        special = backend.special_tokens() if isinstance(backend, SentencePieceBackend) else {}
        special.update({k: _token_text(tok_cfg[k]) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                        if tok_cfg.get(k)})
        eos = cls._eos_ids(hf_dir, backend, special.get("eos_token"))
        return cls(backend, find_chat_template(hf_dir, tok_cfg), eos, special,
                   bool(tok_cfg.get("add_bos_token", False)))

    @staticmethod
    def _dir_backend(hf_dir: Path):
        """tokenizer.json, else a SentencePiece tokenizer.model."""
        for name in ("tokenizer.json", "tokenizer.model"):
            if (hf_dir / name).is_file():
                return load_backend(hf_dir / name)
        raise ValueError(f"{hf_dir}: no tokenizer.json nor tokenizer.model (is this an HF model directory?)")

    @staticmethod
    def _eos_ids(hf_dir: Path, backend: Backend, eos_token: str | None) -> tuple[int, ...]:
        """EOS ids: generation_config.json, else config.json, else the tokenizer's eos_token."""
        for name in ("generation_config.json", "config.json"):
            value = _read_json(hf_dir / name).get("eos_token_id")
            if value is not None:
                return tuple(value) if isinstance(value, list) else (int(value),)
        token_id = backend.token_to_id(eos_token) if eos_token else None
        if token_id is None:
            raise ValueError(f"{hf_dir}: no EOS token id in generation_config.json, config.json or "
                             f"tokenizer_config.json (nor in a SentencePiece model)")
        return (token_id,)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (special-token text such as <|im_start|> becomes its id); BOS only if configured."""
        check_text(text)
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def text(self, ids: list[int]) -> str:
        """Generated text as users see it: special tokens (EOS, <|im_end|>, ...) left out, as HF's skip_special_tokens."""
        return self.decode(ids, skip_special_tokens=True)

    def chat_text_messages(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template rendered for a multi-turn chat [{"role": ..., "content": ...}, ...]."""
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template (neither chat_template.jinja nor "
                             "tokenizer_config.json has one); use a plain prompt")
        for i, m in enumerate(messages):
            if isinstance(m.get("content"), str):
                check_text(m["content"], f"message {i}'s content")
        return render(self.chat_template, messages, add_generation_prompt, self.special_tokens)

    def chat_ids_messages(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `chat_text_messages`; the template itself places any BOS (as HF does)."""
        text = self.chat_text_messages(messages, add_generation_prompt)
        return self.backend.encode(text, add_special_tokens=False).ids

    def chat_text(self, user_text: str) -> str:
        """The chat template rendered for one user turn plus the generation prompt."""
        return self.chat_text_messages([{"role": "user", "content": user_text}])

    def chat_ids(self, user_text: str) -> list[int]:
        """Token ids of `chat_text(user_text)`."""
        return self.chat_ids_messages([{"role": "user", "content": user_text}])


def load_backend(path: Path):
    """A `tokenizers.Tokenizer` of a tokenizer.json, or a SentencePieceBackend of a `.model` file."""
    if path.suffix == ".model":
        return SentencePieceBackend(path)
    if path.suffix != ".json":
        raise ValueError(f"{path}: a tokenizer is an HF directory, a tokenizer.json or a SentencePiece .model file")
    try:
        return Backend.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the library raises a bare Exception for any file it cannot read
        raise ValueError(f"{path}: not a tokenizer.json the tokenizers library reads ({err})") from None


class IncrementalDetokenizer:
    """Feed generated ids one at a time, get text pieces back (the tokenizers library's DecodeStream, or
    WindowDecodeStream for a SentencePiece model).

    A piece never ends inside a multi-byte UTF-8 character (a token that carries only part of one
    yields "" until the rest arrives), and the pieces plus `flush()` concatenate to
    `tokenizer.decode(all ids, skip_special_tokens)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._stream = (DecodeStream(skip_special_tokens=skip_special_tokens) if isinstance(tokenizer.backend, Backend)
                        else WindowDecodeStream(skip_special_tokens))
        self._emitted: list[str] = []

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly "")."""
        self.ids.append(int(token_id))
        piece = self._stream.step(self.tokenizer.backend, int(token_id)) or ""
        self._emitted.append(piece)
        return piece

    def flush(self) -> str:
        """Whatever is still held back (a character the stream never completed decodes as U+FFFD)."""
        full = self.tokenizer.decode(self.ids, self.skip_special_tokens)
        emitted = "".join(self._emitted)
        assert full.startswith(emitted), "the streamed pieces must be a prefix of the decoded text"
        self._emitted = [full]
        return full[len(emitted):]
