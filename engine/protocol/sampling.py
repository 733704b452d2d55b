"""Sampling: the target distribution `p` and keyed random draws. Pure logic, no torch.distributed.

`target_probs` is exactly the distribution plain autoregressive sampling uses (temperature,
then top-k, then top-p, in fp32, the same steps and tie rules as HF `generate`); at T=0 it
is a one-hot of the argmax. Verification (engine/protocol/verify.py) compares drafts against it.

Every random draw is keyed by (seed, position, purpose) through splitmix64, not drawn from a
shared stream: the reference executor and the distributed runtime make the same draw for a
position whatever happened before (flushes, retries, other processes). This is also sound:
a committed token at position t depends only on the draws keyed at t and on the prefix,
which was decided by draws keyed at positions < t, so the draws stay independent.
A re-drafted position (a new draft after a flush) reuses its draft key; the first draft at
that position was dropped unverified, so it influenced nothing that was committed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

# purpose -> code mixed into the key. "target" is a plain draw from `p` (the first token,
# from the prefill logits, and the autoregressive baseline).
PURPOSES: dict[str, int] = {"draft": 1, "accept": 2, "residual": 3, "target": 4}

_MASK64 = (1 << 64) - 1

# top_k values are below this: no vocabulary comes near it, and larger ones (the same as off) would
# overflow the int64 the ranks receive them in.
TOP_K_LIMIT = 1 << 31

# presence and frequency penalties lie in [-PENALTY_LIMIT, PENALTY_LIMIT] (OpenAI's and vLLM's bound)
PENALTY_LIMIT = 2.0

# HF generation defaults for fields a generation_config.json leaves out.
_HF_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters.
    The penalties and min_tokens (vLLM's) change the logits first (engine/protocol/logits_processing.py);
    their defaults leave them unchanged."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0  # > 0: prompt and output tokens' logits divided (> 0) or multiplied
    presence_penalty: float = 0.0  # [-2, 2]: subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # [-2, 2]: times the token's count in the output, subtracted
    min_tokens: int = 0  # EOS is masked until the output holds this many tokens

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"sampling: {name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"sampling: temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling: top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k < TOP_K_LIMIT:
            raise ValueError(f"sampling: top_k must be an integer >= 0 and below 2**31 (0 = off), got {self.top_k!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= _MASK64:
            raise ValueError(f"sampling: seed must be an integer in [0, 2**64), got {self.seed!r}")
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"sampling: {name} must be a finite number, got {value!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"sampling: repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_LIMIT <= getattr(self, name) <= PENALTY_LIMIT:
                raise ValueError(f"sampling: {name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"sampling: min_tokens must be an integer >= 0, got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes(self) -> bool:
        """Whether the logits are changed before temperature and the filters (a penalty or min_tokens)."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.min_tokens > 0)

    @classmethod
    def from_generation_config(cls, config: dict, **overrides) -> "SamplingParams":
        """Read an HF generation_config.json dict the way HF `generate` does, then apply overrides.

        `do_sample` false or missing means greedy (HF's default); fields the file leaves out take
        HF's defaults (temperature 1.0, top_k 50, top_p 1.0). Overrides set to None are ignored,
        so command-line options can be passed straight through.
        """
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"sampling: unknown parameters {sorted(unknown)}; known: {sorted(known)}")
        values = {name: config.get(name) if config.get(name) is not None else default
                  for name, default in _HF_DEFAULTS.items()}
        if not config.get("do_sample", False):
            values["temperature"] = 0.0
        if config.get("seed") is not None:
            values["seed"] = config["seed"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 probabilities from logits [V] or [R, V]: temperature, then top-k, then top-p.

    T=0 gives a one-hot of the argmax (ties -> lowest id, as torch.argmax). Top-k keeps every
    token tied with the k-th largest logit and top-p keeps the smallest head of the sorted
    distribution whose mass exceeds top_p (at least one token), exactly as HF's warpers do.
    """
    if logits.dim() not in (1, 2):
        raise ValueError(f"target_probs: logits must be [V] or [R, V], got shape {tuple(logits.shape)}")
    x = logits.float()
    single = x.dim() == 1
    if single:
        x = x.unsqueeze(0)  # [1, V]
    if params.greedy:
        top = x.argmax(dim=-1, keepdim=True)  # [R, 1]
        probs = torch.zeros_like(x).scatter_(1, top, 1.0)
    else:
        x = x / params.temperature
        if params.top_k > 0:
            k = min(params.top_k, x.shape[-1])
            kth = torch.topk(x, k, dim=-1).values[:, -1:]  # [R, 1]
            x = x.masked_fill(x < kth, -math.inf)
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(x, dim=-1, descending=False)  # [R, V] ascending
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            # drop the low tail whose total mass is <= 1 - top_p; the largest token always stays
            drop_sorted = cumulative <= (1 - params.top_p)
            drop_sorted[:, -1] = False
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            x = x.masked_fill(drop, -math.inf)
        probs = x.softmax(dim=-1)
    return probs[0] if single else probs


def splitmix64(x: int) -> int:
    """One step of splitmix64 (Steele, Lea, Flood 2014): a bijective 64-bit mix of `x`."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def draw_key(seed: int, position: int, purpose: str) -> int:
    """The 64-bit key of one draw: splitmix64 chained over seed, position and purpose code."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown draw purpose {purpose!r}; choose from {sorted(PURPOSES)}")
    if position < 0:
        raise ValueError(f"draw position must be >= 0, got {position}")
    key = splitmix64(seed & _MASK64)
    key = splitmix64(key ^ (position & _MASK64))
    return splitmix64(key ^ PURPOSES[purpose])


def keyed_generator(seed: int, position: int, purpose: str) -> torch.Generator:
    """A CPU generator for the draw of `purpose` at `position`, independent of any earlier draw.

    It lives on the CPU whatever device the probabilities are on, so the uniform a key gives
    does not depend on the device either.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(draw_key(seed, position, purpose))
    return gen


def uniform(gen: torch.Generator) -> float:
    """One float64 draw from U[0, 1)."""
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    """Draw a token id from probs [V] (any non-negative weights) by inverting the float64 CDF.

    Inversion with one uniform (rather than torch.multinomial) makes the draw a function of the
    key and the weights only, and a zero-weight token is never returned: with u*total in
    [cdf[i-1], cdf[i]) the chosen token i has weight cdf[i] - cdf[i-1] > 0.
    """
    assert probs.dim() == 1, f"sample expects [V], got {tuple(probs.shape)}"
    weights = probs.detach().to(torch.float64)  # [V]
    cdf = torch.cumsum(weights, dim=0)  # [V]
    smallest, total = torch.stack([weights.min(), cdf[-1]]).tolist()
    assert smallest >= 0 and 0 < total < math.inf, f"invalid weights: min {smallest}, total {total}"
    target = torch.tensor([uniform(gen) * total], dtype=torch.float64, device=cdf.device)
    token = int(torch.searchsorted(cdf, target, right=True))
    if token >= weights.shape[0]:  # u*total rounded up to total: take the last token with weight
        token = int(torch.nonzero(weights).max())
    return token
