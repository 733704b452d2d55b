"""Tokenizer: text <-> token ids for the driver, on the `tokenizers` library (no transformers at runtime).

Reads an HF directory: `tokenizer.json`, `tokenizer_config.json` (chat template, special tokens)
and the EOS set from `generation_config.json` / `config.json`. The chat template is rendered with
jinja2 the way HF renders it (sandboxed, trim_blocks + lstrip_blocks), so prompts are byte-identical.
`IncrementalDetokenizer` turns a stream of generated ids into printable text pieces.
"""
from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


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
    def from_dir(cls, hf_dir: str | Path) -> "Tokenizer":
        hf_dir = Path(hf_dir)
        path = hf_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{hf_dir}: no tokenizer.json (is this an HF model directory?)")
        backend = Backend.from_file(str(path))
        tok_cfg = _read_json(hf_dir / "tokenizer_config.json")
        special = {k: _token_text(tok_cfg[k]) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                   if tok_cfg.get(k)}
        eos = cls._eos_ids(hf_dir, backend, special.get("eos_token"))
        return cls(backend, tok_cfg.get("chat_template"), eos, special, bool(tok_cfg.get("add_bos_token", False)))

    @staticmethod
    def _eos_ids(hf_dir: Path, backend: Backend, eos_token: str | None) -> tuple[int, ...]:
        """EOS ids: generation_config.json, else config.json, else the tokenizer's eos_token."""
        for name in ("generation_config.json", "config.json"):
            value = _read_json(hf_dir / name).get("eos_token_id")
            if value is not None:
                return tuple(value) if isinstance(value, list) else (int(value),)
        token_id = backend.token_to_id(eos_token) if eos_token else None
        if token_id is None:
            raise ValueError(f"{hf_dir}: no EOS token id in generation_config.json, config.json or tokenizer_config.json")
        return (token_id,)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (special-token text such as <|im_start|> becomes its id); BOS only if configured."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def chat_text(self, user_text: str) -> str:
        """The chat template rendered for one user turn plus the generation prompt."""
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template; use a plain prompt")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = _tojson
        template = env.from_string(self.chat_template)
        return template.render(messages=[{"role": "user", "content": user_text}],
                               add_generation_prompt=True, **self.special_tokens)

    def chat_ids(self, user_text: str) -> list[int]:
        """Token ids of `chat_text(user_text)`; the template itself places any BOS (as HF does)."""
        return self.backend.encode(self.chat_text(user_text), add_special_tokens=False).ids


class IncrementalDetokenizer:
    """Feed generated ids one at a time, get text pieces back.

    A piece never ends inside a multi-byte UTF-8 character (a token that carries only part of one
    yields "" until the rest arrives), and the pieces plus `flush()` concatenate to
    `tokenizer.decode(all ids)`. Decoding a short window [prefix, end) and subtracting the text of
    [prefix, read) keeps each step O(window) and lets decoders that look at neighbours (e.g. a
    SentencePiece leading space) see one token of context.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: already-emitted context
        self._read = 0  # everything before this is emitted

    def _pending(self) -> str:
        decode = lambda ids: self.tokenizer.decode(ids, self.skip_special_tokens)  # noqa: E731
        before = decode(self.ids[self._prefix:self._read])
        window = decode(self.ids[self._prefix:])
        assert window.startswith(before), "decoding a window must extend the decoded prefix"
        return window[len(before):]

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly "")."""
        self.ids.append(int(token_id))
        piece = self._pending()
        if not piece or piece.endswith("\ufffd"):  # an incomplete character so far: wait for more bytes
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return piece

    def flush(self) -> str:
        """Whatever is still held back (a character the stream never completed decodes as U+FFFD)."""
        piece = self._pending()
        self._prefix = self._read = len(self.ids)
        return piece
