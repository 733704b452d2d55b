"""The OpenAI response side of `spd serve`: completion and chat bodies, stream chunks and SSE framing.
Pure logic.

A finished reply carries `usage` and, besides OpenAI's fields, `spd`: the request's SPD counters
(ticks, verified and accepted drafts, rejections, EAL, prefill and decode seconds). A completion
asked for `logprobs` carries them in OpenAI's legacy shape: per token its text, its
log-probability under the target, the most likely alternatives and its offset in the text.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from spd_engine.engine.model.tokenizer import Tokenizer

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class Summary:
    """How a reply ended: finish_reason (stop / length), token counts, SPD counters."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    spd: dict = field(default_factory=dict)
    logprobs: dict | None = None  # a completion's `logprobs` object, when asked

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def completion_logprobs(entries: list[tuple[int, float, list[tuple[int, float]]]], tok: Tokenizer | None) -> dict:
    """OpenAI's legacy `logprobs` object from (token, log-probability, alternatives) per token: each
    token's text alone (special tokens included; a model without a tokenizer writes the id and a
    space, as its replies), and text_offset, where each token's text starts in the concatenation."""
    def text(i: int) -> str:
        return tok.decode([i]) if tok is not None else f"{i} "

    tokens = [text(t) for t, _, _ in entries]
    offsets, at = [], 0
    for piece in tokens:
        offsets.append(at)
        at += len(piece)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{text(i): lp for i, lp in alts} for _, _, alts in entries], "text_offset": offsets}


class ReplyBuilder:
    """Bodies and chunks of one reply (one id and creation time for all of them)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, summary: Summary) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": summary.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": summary.logprobs, "finish_reason": summary.finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": summary.usage(), "spd": summary.spd}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> str:
        """One SSE event: a text piece, the opening chat chunk (first: role only), or the closing one."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return sse({**self._head(obj), "choices": [choice]})

    def usage_chunk(self, summary: Summary) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._head(obj), "choices": [], "usage": summary.usage(), "spd": summary.spd})
