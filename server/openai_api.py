"""The OpenAI request side of `spd serve`: validate a JSON body into a ParsedRequest. Pure logic.

Every field the engine honours is checked (type and range) and every other field is refused with
a 400 in OpenAI's error shape naming it, never ignored. Fields OpenAI or vLLM define but the engine
does not implement (tools, response formats, min_p, ...) are accepted only at their neutral value,
which asks for nothing the engine does not do. The penalties (`presence_penalty`,
`frequency_penalty` in [-2, 2], vLLM's `repetition_penalty` > 0) and `min_tokens` are honoured
(engine/protocol/logits_processing.py). Log-probabilities are asked for by a completion's
`logprobs` (0-5 alternatives) or a chat's `logprobs: true` with `top_logprobs` (0-20); both are
held as ParsedRequest.logprobs, the number of alternatives. `n` (1-16) asks for that many choices of one prompt. `model` may be
left out (the served model), and the `developer` role is a chat turn as `system` is. Two extra
fields choose how a request is scheduled (docs/design.md 3.12): `latency` ("batch", the default,
or "critical") and `priority` (an integer, default 0, lower served first, as vLLM orders it;
ParsedRequest holds its negation, the engine's order, higher first).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spd_engine.engine.protocol.batch_policy import BATCH, CRITICAL, LATENCY_CLASSES

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_SEED = 1 << 64  # seeds key splitmix64 draws (engine/protocol/sampling.py): [0, 2**64)
MAX_TOP_K = 1 << 31  # sampling.TOP_K_LIMIT, here without importing torch


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        # a message may quote the request (a model name), which may hold a lone surrogate: JSON
        # bodies are UTF-8, so such a character is written as its escape instead of failing the answer
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        param = param.encode("utf-8", "backslashreplace").decode("utf-8") if param is not None else None
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}  # HTTP headers of the answer (Retry-After)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class ParsedRequest:
    """A validated completion or chat request (None: the field was not given)."""

    chat: bool
    model: str | None  # None: the served model
    prompt: str | list[int] | None = None  # completions: text or token ids
    messages: tuple[tuple[str, str], ...] = ()  # chat: (role, text) turns
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # vLLM's extra field: generate max_tokens tokens, past EOS
    latency: str = BATCH  # batch_policy.CRITICAL: keeps its single-stream schedule, taken first from the queue
    priority: int = 0  # among requests of one class, higher first: the request's `priority` negated
    logprobs: int | None = None  # each token's log-probability and this many alternatives (None: not asked)
    n: int = 1  # choices of the one prompt
    repetition_penalty: float | None = None  # vLLM's: > 0 (1 = off), over prompt and output tokens
    presence_penalty: float | None = None  # [-2, 2] (0 = off), over output tokens
    frequency_penalty: float | None = None  # [-2, 2] (0 = off), over output tokens
    min_tokens: int | None = None  # vLLM's: EOS held back until the reply has this many tokens

    def processing(self) -> dict:
        """The penalty and min_tokens fields given, in the engine's SamplingParams names."""
        values = dict(repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                      frequency_penalty=self.frequency_penalty, min_tokens=self.min_tokens)
        return {k: v for k, v in values.items() if v is not None}


def _neutral(*values) -> Callable[[Any], bool]:
    """Accept only these values (and null): the value that asks for nothing."""
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in values)


# OpenAI fields the engine does not implement -> the values that leave them off.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": _neutral(1), "echo": _neutral(False), "suffix": _neutral(),
    "logprobs": _neutral(False), "top_logprobs": _neutral(0), "logit_bias": _neutral({}),
    "tools": _neutral([]), "tool_choice": _neutral("none"), "parallel_tool_calls": _neutral(),
    "functions": _neutral([]), "function_call": _neutral("none"),
    "response_format": _neutral({"type": "text"}), "store": _neutral(False), "metadata": _neutral(),
    "modalities": _neutral(["text"]), "audio": _neutral(), "prediction": _neutral(),
    "reasoning_effort": _neutral(), "service_tier": _neutral(), "web_search_options": _neutral(),
    # vLLM's extra sampling and output fields
    "min_p": _neutral(0, 0.0),
    "length_penalty": _neutral(1, 1.0), "use_beam_search": _neutral(False), "stop_token_ids": _neutral([]),
    "bad_words": _neutral([]), "allowed_token_ids": _neutral(), "include_stop_str_in_output": _neutral(False),
    "skip_special_tokens": _neutral(True), "spaces_between_special_tokens": _neutral(True),
    "prompt_logprobs": _neutral(), "truncate_prompt_tokens": _neutral(), "return_tokens_as_token_ids":
    _neutral(False), "guided_json": _neutral(), "guided_regex": _neutral(), "guided_choice": _neutral(),
    "guided_grammar": _neutral(), "structured_outputs": _neutral(),
}
# vLLM's prompt fields, whose neutral value differs between the endpoints (what each does by default)
CHAT_UNSUPPORTED = {**{k: v for k, v in UNSUPPORTED.items() if k not in ("logprobs", "top_logprobs")},
                    "add_special_tokens": _neutral(False), "add_generation_prompt": _neutral(True),
                    "continue_final_message": _neutral(False), "chat_template": _neutral(),
                    "chat_template_kwargs": _neutral({}), "documents": _neutral()}
COMPLETION_UNSUPPORTED = {**{k: v for k, v in UNSUPPORTED.items() if k != "logprobs"},
                          "add_special_tokens": _neutral(True)}
MAX_LOGPROBS = 5  # OpenAI's bound for /v1/completions
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs
MAX_N = 16  # choices per request: each is a request of its own in the engine
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (sampling.PENALTY_LIMIT)
MAX_REPETITION_PENALTY = 1e6  # finite, as the engine requires: a larger one is no different in effect
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
          "user", "ignore_eos", "latency", "priority", "n", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "min_tokens"}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
ROLES = ("system", "developer", "user", "assistant")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v) or v > hi or v < lo or (lo_open and v == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad(name, f"must be a number in {interval}, got {v!r}")
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or v < lo or (hi is not None and v >= hi):
        upper = f" and below {hi}" if hi is not None else ""
        raise bad(name, f"must be an integer >= {lo}{upper}, got {v!r}")
    return v


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(name, f"must be true or false, got {v!r}")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", f"must be a string or a list of strings, got {v!r}")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(s == "" for s in stops):
        raise bad("stop", "stop strings must not be empty")
    return tuple(stops)


def _prompt(body: dict) -> str | list[int]:
    v = body.get("prompt")
    if v is None:
        raise bad("prompt", "is required")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one prompt
    if isinstance(v, str):
        if not v:
            raise bad("prompt", "must not be empty")
        return v
    if isinstance(v, list) and v and all(_is_int(t) for t in v):
        return list(v)
    if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
        raise bad("prompt", f"batches of prompts are not supported (got {len(v)}); send one request per prompt")
    raise bad("prompt", "must be a non-empty string or a non-empty list of token ids")


def _logprobs(body: dict) -> int | None:
    """/v1/completions' `logprobs`: null, or how many alternatives (0..5) besides each token's own."""
    return _int(body, "logprobs", 0, MAX_LOGPROBS + 1)


def _chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs` (true: asked) and `top_logprobs` (0..20 alternatives, only with logprobs
    true, as OpenAI requires) -> the number of alternatives, or None when not asked."""
    asked = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS + 1)
    if top is not None and not asked:
        raise bad("top_logprobs", "needs logprobs: true")
    return (top or 0) if asked else None


def _latency(body: dict) -> str:
    v = body.get("latency")
    if v is None:
        return BATCH
    if not isinstance(v, str) or v not in LATENCY_CLASSES:
        raise bad("latency", f"must be {BATCH!r} (the default) or {CRITICAL!r}, got {v!r}")
    return v


def _priority(body: dict) -> int:
    v = body.get("priority")
    if v is None:
        return 0
    if not _is_int(v):  # a bool is not an integer here, as for every other integer field
        raise bad("priority", f"must be an integer (lower is served first), got {v!r}")
    return -v  # the engine's order: higher first


def _content(v, where: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        parts = []
        for j, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}[{j}]", "only text content parts ({\"type\": \"text\", \"text\": ...}) "
                                          "are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(where, f"must be a string or a list of text parts, got {type(v).__name__}")


def messages(body: dict) -> tuple[tuple[str, str], ...]:
    v = body.get("messages")
    if not isinstance(v, list) or not v:
        raise bad("messages", "must be a non-empty list of messages")
    turns = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object with 'role' and 'content'")
        if m.get("role") not in ROLES:
            raise bad(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {m.get('role')!r}")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise bad(f"{where}.{extra[0]}", "is not supported")
        turns.append((m["role"], _content(m.get("content"), f"{where}.content")))
    return tuple(turns)


def _max_tokens(body: dict, chat: bool) -> int | None:
    value = _int(body, "max_tokens", 1)
    if chat:
        newer = _int(body, "max_completion_tokens", 1)
        if value is not None and newer is not None and value != newer:
            raise bad("max_completion_tokens", f"disagrees with max_tokens ({newer} != {value})")
        value = newer if newer is not None else value
    return value


def _stream_options(body: dict, stream: bool) -> bool:
    """include_usage of stream_options (only with stream: true)."""
    v = body.get("stream_options")
    if v is None:
        return False
    if not stream:
        raise bad("stream_options", "is only allowed with stream: true")
    if not isinstance(v, dict) or set(v) - {"include_usage"}:
        raise bad("stream_options", f"only {{\"include_usage\": bool}} is supported, got {v!r}")
    return _bool(v, "include_usage")


def model_field(body: dict) -> str | None:
    """The `model` field: a non-empty string, or None when left out (the served model)."""
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad("model", f"must be a non-empty string (see GET /v1/models), got {model!r}")
    return model


def parse_request(body: Any, chat: bool) -> ParsedRequest:
    """A /v1/completions (chat False) or /v1/chat/completions body -> ParsedRequest, or ApiError(400)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unsupported = CHAT_UNSUPPORTED if chat else COMPLETION_UNSUPPORTED
    for name in sorted(body):
        if name in unsupported:
            if not unsupported[name](body[name]):
                raise bad(name, f"is not supported by this server (got {body[name]!r})")
        elif name not in allowed:
            raise bad(name, "unknown or unsupported field")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user", "must be a string")
    stream = _bool(body, "stream")
    top_k = body.get("top_k")
    if _is_int(top_k) and top_k == -1:
        top_k = 0  # vLLM's spelling of "off"
    return ParsedRequest(
        chat=chat, model=model_field(body),
        prompt=None if chat else _prompt(body),
        messages=messages(body) if chat else (),
        max_tokens=_max_tokens(body, chat),
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True),
        top_k=_int({"top_k": top_k}, "top_k", 0, MAX_TOP_K),
        seed=_int(body, "seed", 0, MAX_SEED),
        stop=_stop(body), stream=stream, include_usage=_stream_options(body, stream),
        ignore_eos=_bool(body, "ignore_eos"), latency=_latency(body), priority=_priority(body),
        logprobs=_chat_logprobs(body) if chat else _logprobs(body),
        n=_int(body, "n", 1, MAX_N + 1) or 1,
        repetition_penalty=_number(body, "repetition_penalty", 0.0, MAX_REPETITION_PENALTY, lo_open=True),
        presence_penalty=_number(body, "presence_penalty", -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=_number(body, "frequency_penalty", -MAX_PENALTY, MAX_PENALTY),
        min_tokens=_int(body, "min_tokens", 0))
