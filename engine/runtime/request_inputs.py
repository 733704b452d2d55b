"""What a request brings before it reaches the ranks: its prompt ids (text through the chat
template, or a chat of messages) and its sampling parameters (the model's generation_config.json
read as HF reads it, explicit values on top). Shared by `spd generate`, `spd bench`, `spd plan`
and the server.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spd_engine.engine.protocol.sampling import SamplingParams


def sampling_params(overrides: dict, tok_dir: Path | None) -> SamplingParams:
    """generation_config.json in tok_dir (if any) read as HF does, then the explicit flags on top."""
    # imported here: the server's tokenizer process encodes prompts with this module and never needs torch
    from spd_engine.engine.protocol.sampling import SamplingParams

    path = Path(tok_dir) / "generation_config.json" if tok_dir is not None else None
    if path is None or not path.is_file():
        return SamplingParams(**{k: v for k, v in overrides.items() if v is not None})
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON: {err}") from None
    return SamplingParams.from_generation_config(config, **overrides)


def encode_prompts(texts: list, tok, chat: bool, vocab_size: int) -> list[list[int]]:
    """Prompt ids: text (chat template with `chat`) or a chat (a list of messages: always the template)."""
    return [encode_prompt(t, tok, chat, vocab_size) for t in texts]


def encode_prompt(prompt, tok, chat: bool, vocab_size: int) -> list[int]:
    if isinstance(prompt, list):
        if tok is None:
            raise ValueError("a chat (--messages-file) needs a model with a tokenizer and chat template")
        return tok.chat_ids_messages(prompt)
    if tok is None:  # random-weight models have no tokenizer: map bytes into the vocabulary
        return [3 + b % (vocab_size - 3) for b in prompt.encode()]
    return tok.chat_ids(prompt) if chat else tok.encode(prompt)
