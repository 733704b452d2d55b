"""What a caller of the Python API passes per request (SamplingParams) and gets back (RequestOutput),
with vLLM's field names; the engine's own sampling rule is engine/protocol/sampling.py."""
from __future__ import annotations

from dataclasses import dataclass, field

from spd_engine.engine.protocol.sampling import SamplingParams as EngineSampling


@dataclass(frozen=True)
class SamplingParams:
    """How one request is generated. None: the model's generation_config.json (read as HF does),
    else greedy. temperature 0 is greedy; top_k 0 and top_p 1 turn those filters off."""

    max_tokens: int = 16  # vLLM's default
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # of the keyed random draws: a seed repeats its text for one configuration
    stop: tuple[str, ...] = ()  # the reply ends before the first of these strings
    ignore_eos: bool = False  # generate max_tokens tokens, past EOS
    # vLLM's penalties and min_tokens, applied to the target's logits (engine/protocol/logits_processing.py)
    repetition_penalty: float = 1.0  # > 0: prompt and output tokens' logits divided (> 0) or multiplied
    presence_penalty: float = 0.0  # [-2, 2]: subtracted from every token the output holds
    frequency_penalty: float = 0.0  # [-2, 2]: times the token's count in the output, subtracted
    min_tokens: int = 0  # EOS held back until the reply has this many tokens

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if isinstance(self.min_tokens, int) and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must not exceed max_tokens ({self.max_tokens}), got {self.min_tokens}")
        object.__setattr__(self, "stop", stop)
        # the engine's checks (finite, ranges) at once, not at the first request
        EngineSampling(**{k: v for k, v in self.overrides().items() if v is not None})

    def overrides(self) -> dict:
        """The sampling fields given (None: the model's default), in the engine's names."""
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                    repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, min_tokens=self.min_tokens)


@dataclass
class CompletionOutput:
    """One generated reply of a request."""

    index: int
    text: str  # without special tokens, cut before a stop string
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stop_reason: str | None = None  # the stop string that ended it, if one did


@dataclass
class RequestOutput:
    """A finished request: its prompt, its reply and what SPD did for it (ticks, EAL, acceptance)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict = field(default_factory=dict)
