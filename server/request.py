"""A validated request made ready for the pipeline: prompt ids, token budget, sampling, stop strings,
and its latency class and priority.

Everything that can be refused is refused here, before the request queues: an unknown model
name (404), a prompt or chat turns the tokenizer cannot take, prompt + max_tokens beyond the KV
capacity, or sampling values the engine rejects (400, naming the field). Pure logic.
"""
from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from pathlib import Path

import jinja2

from spd_engine.engine.model.tokenizer import Tokenizer
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.runtime.request_inputs import sampling_params
from spd_engine.server.openai_api import ApiError, ParsedRequest, bad
from spd_engine.server.text import chat_ids, completion_ids

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what fits


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP side knows of the served model."""

    name: str  # the id in /v1/models and the `model` field of requests
    tok: Tokenizer | None
    tok_dir: Path | None  # generation_config.json: sampling defaults
    vocab_size: int
    capacity: int  # KV positions per request: prompt + generated tokens
    eos_ids: tuple[int, ...]
    seed_limit: int = 1 << 64  # the pp / ar baselines carry seeds below 2**63


@dataclass(frozen=True)
class ServeRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: tuple[str, ...]
    parsed: ParsedRequest

    @property
    def latency(self) -> str:
        """Its latency class (batch_policy: "batch" or "critical")."""
        return self.parsed.latency

    @property
    def priority(self) -> int:
        """Among waiting requests of its class: higher is served first (the `priority` field negated)."""
        return self.parsed.priority


def _prompt_ids(parsed: ParsedRequest, info: ModelInfo, ids: list[int] | None = None) -> list[int]:
    field = "messages" if parsed.chat else "prompt"
    try:
        if ids is None:
            ids = chat_ids(info.tok, parsed.messages) if parsed.chat else \
                completion_ids(info.tok, parsed.prompt, info.vocab_size)
    except (ValueError, jinja2.TemplateError) as err:
        raise bad(field, str(err)) from None
    if not ids:
        raise bad(field, "encodes to no tokens")
    outside = [t for t in ids if not 0 <= t < info.vocab_size]
    if outside:
        raise bad(field, f"token ids outside the vocabulary [0, {info.vocab_size}): {outside[:5]}")
    return ids


def _sampling(parsed: ParsedRequest, info: ModelInfo) -> SamplingParams:
    """generation_config.json defaults with the request's values on top (as `spd generate` does).
    An unseeded sampled request gets a fresh random seed, as OpenAI servers draw fresh samples."""
    seed = parsed.seed if parsed.seed is not None else secrets.randbelow(info.seed_limit)
    overrides = dict(temperature=parsed.temperature, top_k=parsed.top_k, top_p=parsed.top_p, seed=seed,
                     **parsed.processing())
    try:
        params = sampling_params(overrides, info.tok_dir)
    except ValueError as err:  # "sampling: top_p must be ..." names the field first
        name = str(err).removeprefix("sampling: ").split(" ", 1)[0]
        raise bad(name if name in overrides else "temperature", str(err)) from None
    if params.seed >= info.seed_limit:
        raise bad("seed", f"must be below {info.seed_limit} with this server's mode, got {params.seed}")
    return params


def check_model_name(model: str | None, info: ModelInfo) -> None:
    """404 in OpenAI's shape for a model this server does not serve (None: the served one)."""
    if model is not None and model != info.name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{info.name}`",
                       param="model", code="model_not_found")


def check_model(parsed: ParsedRequest, info: ModelInfo) -> None:
    check_model_name(parsed.model, info)


def prepare(parsed: ParsedRequest, info: ModelInfo, ids: list[int] | None = None) -> ServeRequest:
    """ids: the prompt ids when already encoded (serve_tokenize's worker); checked here all the same."""
    check_model(parsed, info)
    ids = _prompt_ids(parsed, info, ids)
    room = info.capacity - len(ids)
    if room < 1:
        raise bad("messages" if parsed.chat else "prompt",
                  f"the prompt has {len(ids)} tokens; the KV capacity is {info.capacity} positions")
    default = room if parsed.chat else min(room, COMPLETION_DEFAULT_MAX_TOKENS)
    max_tokens = parsed.max_tokens if parsed.max_tokens is not None else default
    if max_tokens > room:
        raise bad("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the KV "
                                f"capacity of {info.capacity} positions")
    sampling = _sampling(parsed, info)
    if sampling.min_tokens > max_tokens:
        raise bad("min_tokens", f"must not exceed max_tokens ({max_tokens}), got {sampling.min_tokens}")
    return ServeRequest(ids, max_tokens, sampling, parsed.stop, parsed)


def choices(req: ServeRequest, info: ModelInfo) -> list[ServeRequest]:
    """The `n` choices of a request, each a request of its own: choice i samples with seed + i
    (mod the seed limit), so a seeded request gives the same n choices again, each a different
    draw; at T = 0 the seed is unused and the choices are equal."""
    return [req] + [dataclasses.replace(req, sampling=dataclasses.replace(
        req.sampling, seed=(req.sampling.seed + i) % info.seed_limit)) for i in range(1, req.parsed.n)]
