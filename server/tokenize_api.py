"""vLLM's /tokenize and /detokenize, and the model and version answers of `spd serve`.

/tokenize takes a completion's `prompt` (a string; `add_special_tokens`, default true: the ids a
completion's prompt gets) or a chat's `messages` (`add_generation_prompt`, default true, and
`add_special_tokens`, default false, as vLLM's), and `return_token_strs`; it answers `count`,
`max_model_len`, `tokens` and `token_strs` (null unless asked). /detokenize takes `tokens` (at most
max_model_len ids of the vocabulary) and answers `prompt`: the ids decoded with special tokens
kept, as vLLM's does; a model without a tokenizer writes them as decimal text, as its replies.
Both take an optional `model` (the served one) and refuse any other field, naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Any

import jinja2

from spd_engine.server.openai_api import ApiError, ParsedRequest, bad, messages, model_field
from spd_engine.server.request import ModelInfo, check_model_name
from spd_engine.server.text import IdText, tokenize_ids
from spd_engine.server.tokenizing import PromptEncoder

CHAT_FIELDS = {"model", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs"}
PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}


@dataclass(frozen=True)
class TokenizeRequest:
    chat: bool
    payload: Any  # prompt text, or chat turns
    add_generation_prompt: bool
    add_special_tokens: bool
    return_token_strs: bool


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"must be true or false, got {v!r}")
    return v


def _object(body: Any, info: ModelInfo, fields: set[str]) -> dict:
    """A JSON object with only `fields`, naming the served model or none."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    extra = sorted(set(body) - fields)
    if extra:
        raise bad(extra[0], "unknown or unsupported field")
    check_model_name(model_field(body), info)
    return body


def parse_tokenize(body: Any, info: ModelInfo) -> TokenizeRequest:
    chat = isinstance(body, dict) and "messages" in body
    body = _object(body, info, CHAT_FIELDS if chat else PROMPT_FIELDS)
    if chat:
        payload = messages(body)
        if info.tok is None:
            raise bad("messages", "this model has no tokenizer, hence no chat template; tokenize a prompt")
    else:
        payload = body.get("prompt")
        if not isinstance(payload, str) or not payload:
            raise bad("prompt", "is required: a non-empty string (or give `messages`)")
    return TokenizeRequest(chat, payload, _flag(body, "add_generation_prompt", True),
                           _flag(body, "add_special_tokens", not chat), _flag(body, "return_token_strs", False))


async def tokenize(body: Any, info: ModelInfo, encoder: PromptEncoder | None) -> dict:
    """/tokenize's answer; text is encoded in the encoder's worker, never on the event loop."""
    req = parse_tokenize(body, info)
    special = (req.add_generation_prompt, req.add_special_tokens)
    if encoder is not None:
        parsed = ParsedRequest(chat=req.chat, model=None, prompt=None if req.chat else req.payload,
                               messages=req.payload if req.chat else ())
        encoder.check_size(parsed)  # text that cannot fit is refused before it is encoded
    if encoder is not None and info.tok is not None:
        ids = await encoder.encode(req.chat, req.payload, special)
    else:  # no tokenizer: the bytes of the text mapped into the vocabulary, at once
        try:
            ids = tokenize_ids(info.tok, req.payload, req.chat, info.vocab_size, *special)
        except (ValueError, jinja2.TemplateError) as err:
            raise bad("messages" if req.chat else "prompt", str(err)) from None
    strs = None
    if req.return_token_strs:
        strs = [info.tok.backend.id_to_token(i) for i in ids] if info.tok is not None else [str(i) for i in ids]
    return {"count": len(ids), "max_model_len": info.capacity, "tokens": ids, "token_strs": strs}


def detokenize(body: Any, info: ModelInfo) -> dict:
    """/detokenize's answer (bounded: at most max_model_len ids, decoded by the tokenizers library)."""
    body = _object(body, info, {"model", "tokens"})
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad("tokens", f"must be a list of token ids, got {type(ids).__name__}")
    if len(ids) > info.capacity:
        raise bad("tokens", f"at most max_model_len ({info.capacity}) ids, got {len(ids)}")
    outside = [t for t in ids if not 0 <= t < info.vocab_size]
    if outside:
        raise bad("tokens", f"token ids outside the vocabulary [0, {info.vocab_size}): {outside[:5]}")
    if info.tok is None:
        return {"prompt": "".join(IdText().push(t) for t in ids)}
    return {"prompt": info.tok.decode(ids, skip_special_tokens=False)}


def model_card(info: ModelInfo, created: int) -> dict:
    """The served model as /v1/models lists it."""
    return {"id": info.name, "object": "model", "created": created, "owned_by": "spd-engine",
            "max_model_len": info.capacity}


def model_lookup(model_id: str, info: ModelInfo, created: int) -> dict:
    """GET /v1/models/{id}: the served model's card, else a 404 naming it."""
    check_model_name(model_id, info)
    return model_card(info, created)


def server_version() -> dict:
    try:
        return {"version": metadata.version("spd-engine")}
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return {"version": "unknown (not installed)"}
