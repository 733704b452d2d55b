"""Text in and out for `spd serve`: prompts and chat turns to token ids, generated ids to text
pieces with stop strings. Pure logic (no torch.distributed).

Pieces come from IncrementalDetokenizer, so they never end inside a UTF-8 character, and a stop
string is matched on that text: the reply is cut right before the first occurrence of any stop
string and text that could still be the start of one is held back until it cannot.
A model without a tokenizer (`random:<preset>`) reads prompt text as bytes mapped into its
vocabulary (as `spd generate` does) and writes each generated id as decimal text plus a space.
"""
from __future__ import annotations

from collections.abc import Sequence

from spd_engine.engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from spd_engine.engine.runtime.request_inputs import encode_prompts


class StopMatcher:
    """Cuts a text stream before the first stop string; holds back only a tail that could still
    become one (so text without stop-string prefixes streams without delay)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.buf = ""

    def _held(self) -> int:
        """Length of the longest tail of buf that is a proper prefix of a stop string."""
        for k in range(min(len(self.buf), self.longest - 1), 0, -1):
            tail = self.buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was found: then nothing more is emitted)."""
        self.buf += text
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[:min(hits)], ""
            return out, True
        cut = len(self.buf) - self._held()
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class IdText:
    """Generated ids as text for models without a tokenizer: '17 204 9 '."""

    def push(self, token_id: int) -> str:
        return f"{int(token_id)} "

    def flush(self) -> str:
        return ""


class TextStream:
    """Generated ids -> text pieces, cut at stop strings. `push` says when a stop string ended the reply."""

    def __init__(self, tok: Tokenizer | None, stops: Sequence[str]) -> None:
        self.detok = IncrementalDetokenizer(tok, skip_special_tokens=True) if tok is not None else IdText()
        self.stop = StopMatcher(stops)
        self.stopped = False

    def push(self, token_id: int) -> str:
        assert not self.stopped, "no tokens after a stop string"
        out, self.stopped = self.stop.push(self.detok.push(token_id))
        return out

    def finish(self) -> str:
        """What is still held back at the end of the reply (nothing after a stop string)."""
        if self.stopped:
            return ""
        out, self.stopped = self.stop.push(self.detok.flush())
        return out + ("" if self.stopped else self.stop.flush())


def template_role(tok: Tokenizer, role: str) -> str:
    """OpenAI's `developer` role reaches a template that does not name it as `system` (as vLLM maps
    it): most chat templates know only system, user and assistant."""
    if role == "developer" and "developer" not in (tok.chat_template or ""):
        return "system"
    return role


def chat_ids(tok: Tokenizer | None, turns: Sequence[tuple[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Prompt ids of chat turns through the model's chat template (one user turn: the same ids as
    `spd generate --chat`)."""
    if tok is None:
        raise ValueError("this model has no tokenizer, hence no chat template; use /v1/completions")
    messages = [{"role": template_role(tok, role), "content": text} for role, text in turns]
    return tok.chat_ids_messages(messages, add_generation_prompt)


def tokenize_ids(tok: Tokenizer | None, payload, chat: bool, vocab_size: int, add_generation_prompt: bool,
                 add_special_tokens: bool) -> list[int]:
    """/tokenize: the ids of a prompt (payload: text or token ids) or of chat turns. With
    add_special_tokens a text prompt gets what a completion's prompt gets (a BOS where the model
    adds one), and chat turns a BOS before the template's text where the model adds one;
    without it neither does."""
    if chat:
        ids = chat_ids(tok, payload, add_generation_prompt)
        bos = tok.bos_id if add_special_tokens and tok.add_bos else None
        return [bos, *ids] if bos is not None and ids[:1] != [bos] else ids
    ids = completion_ids(tok, payload, vocab_size)
    if isinstance(payload, str) and not add_special_tokens and tok is not None and tok.add_bos \
            and ids[:1] == [tok.bos_id]:
        return ids[1:]
    return ids


def completion_ids(tok: Tokenizer | None, prompt: str | list[int], vocab_size: int) -> list[int]:
    """Prompt ids of a completion prompt: token ids as given, text encoded as `spd generate` does."""
    if isinstance(prompt, list):
        return list(prompt)
    return encode_prompts([prompt], tok, False, vocab_size)[0]
