"""The OpenAI response side of `spd serve`: completion and chat bodies, stream chunks and SSE framing.
Pure logic.

A finished reply carries `usage` (the prompt counted once, the completion tokens of every choice
summed) and, besides OpenAI's fields, `spd`: the request's SPD counters (ticks, verified and
accepted drafts, rejections, EAL, prefill and decode seconds), a list of them, one per choice,
when `n` > 1. Log-probabilities, when asked, come in OpenAI's shapes: a completion's legacy
object (per token its text, its log-probability under the target, the most likely alternatives
and its offset in the text) and a chat's `content` list (per token its text, log-probability,
UTF-8 bytes and alternatives); a stream chunk carries those of the tokens behind its text.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from spd_engine.engine.model.tokenizer import Tokenizer

DONE = "data: [DONE]\n\n"
Scored = tuple[int, float, list[tuple[int, float]]]  # (token, its log-probability, the likeliest alternatives)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class Summary:
    """How a reply ended: finish_reason (stop / length), token counts, SPD counters."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    spd: dict = field(default_factory=dict)
    logprobs: list[Scored] | None = None  # per completion token, when asked

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def token_text(i: int, tok: Tokenizer | None) -> str:
    """A token's text alone (special tokens included; a model without a tokenizer writes the id and
    a space, as its replies)."""
    return tok.decode([i]) if tok is not None else f"{i} "


def completion_logprobs(entries: list[Scored], tok: Tokenizer | None, start: int = 0) -> dict:
    """OpenAI's legacy `logprobs` object from (token, log-probability, alternatives) per token;
    text_offset: where each token's text starts in the reply's text (the first at `start`)."""
    tokens = [token_text(t, tok) for t, _, _ in entries]
    offsets, at = [], start
    for piece in tokens:
        offsets.append(at)
        at += len(piece)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{token_text(i, tok): lp for i, lp in alts} for _, _, alts in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[Scored], tok: Tokenizer | None) -> dict:
    """A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}; `bytes` are
    the UTF-8 bytes of the token's text (as vLLM writes them: a token that ends inside a character
    has the replacement character's)."""
    def item(i: int, lp: float) -> dict:
        text = token_text(i, tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(t, lp), "top_logprobs": [item(i, a) for i, a in alts]} for t, lp, alts in entries]}


class ReplyBuilder:
    """Bodies and chunks of one reply (one id and creation time for all of them)."""

    def __init__(self, chat: bool, model: str, tok: Tokenizer | None = None) -> None:
        self.chat, self.model, self.tok = chat, model, tok
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._offsets: dict[int, int] = {}  # a streamed completion choice's tokens' text so far (text_offset)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, entries: list[Scored] | None, index: int = 0) -> dict | None:
        """The `logprobs` of (the next tokens of) choice `index`; None when not asked."""
        if entries is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.tok)
        # offsets count the tokens' texts, as the whole reply's do (a chunk's text may lag its
        # tokens': text that might begin a stop string is held back)
        obj = completion_logprobs(entries, self.tok, self._offsets.get(index, 0))
        self._offsets[index] = self._offsets.get(index, 0) + sum(len(t) for t in obj["tokens"])
        return obj

    def full(self, outcomes: list[tuple[str, Summary]]) -> dict:
        """The body of a finished reply: (text, Summary) per choice, in choice order."""
        choices = []
        for index, (text, summary) in enumerate(outcomes):
            logprobs = self._logprobs(summary.logprobs, index)
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": logprobs, "finish_reason": summary.finish_reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": summary.finish_reason})
        spd = [s.spd for _, s in outcomes]
        return {**self._head(self.object), "choices": choices, "usage": usage([s for _, s in outcomes]),
                "spd": spd[0] if len(spd) == 1 else spd}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False, index: int = 0,
              logprobs: list[Scored] | None = None) -> str:
        """One SSE event of choice `index`: a text piece (with the log-probabilities of its tokens,
        when asked), the opening chat chunk (first: role only), or the closing one."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        scored = self._logprobs(logprobs, index)
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": scored, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": scored, "finish_reason": finish_reason}
        return sse({**self._head(obj), "choices": [choice]})

    def usage_chunk(self, summaries: list[Summary]) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        spd = [s.spd for s in summaries]
        return sse({**self._head(obj), "choices": [], "usage": usage(summaries),
                    "spd": spd[0] if len(spd) == 1 else spd})


def usage(summaries: list[Summary]) -> dict:
    """OpenAI's usage of a reply of these choices: the prompt once, every choice's tokens."""
    if len(summaries) == 1:
        return summaries[0].usage()
    prompt, completion = summaries[0].prompt_tokens, sum(s.completion_tokens for s in summaries)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
