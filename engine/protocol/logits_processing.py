"""Logits processing before sampling: vLLM's repetition, presence and frequency penalties and
min_tokens. Pure torch, no torch.distributed.

The processed logits replace the target's raw logits wherever a token is chosen or verified: T = 0
takes their argmax, T > 0 their `target_probs` (engine/protocol/sampling.py), and the drafts are
verified against that distribution, so the output is exactly the processed distribution's. The
rules are vLLM's, in its order:

- repetition_penalty r: every token of the prompt or the output so far has its logit divided by r
  where it is > 0, multiplied by r otherwise;
- then frequency f and presence p over the output so far: logit -= f * count, then -= p * (count > 0);
- min_tokens m: EOS ids get -inf while the output holds fewer than m tokens.

`TokenHistory` holds what those rules read for one request (its prompt and committed output) and
processes the logits of one position; tokens not yet committed but before that position (a suffix
run's, verified in one go) are passed as `pending`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from spd_engine.engine.protocol.sampling import SamplingParams


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, sp: SamplingParams
                    ) -> torch.Tensor:
    """vLLM's penalties on logits [..., V] (fp32; a new tensor): seen [..., V] bool marks the prompt's
    and the output's tokens (repetition), counts [..., V] fp32 each token's count in the output."""
    x = logits
    if sp.repetition_penalty != 1:
        r = sp.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if sp.frequency_penalty != 0:
        x = x - sp.frequency_penalty * counts
    if sp.presence_penalty != 0:
        x = x - sp.presence_penalty * (counts > 0).to(x.dtype)
    return x


def mask_ids(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with the ids [K] (int64) set to -inf (a new tensor)."""
    return logits.index_fill(-1, ids, -math.inf)


class TokenHistory:
    """One request's prompt and committed output, as the processing reads them; counts on the
    logits' device, made at the first position processed and kept up to date by `extend`."""

    def __init__(self, sp: SamplingParams, prompt: Sequence[int], eos: Iterable[int]) -> None:
        if len(prompt) == 0:
            raise ValueError("a token history needs a prompt of at least one token")
        self.sp = sp
        self.prompt = list(prompt)
        self.first_pos = len(self.prompt)  # the position of the first output token
        self.eos = sorted(set(eos))
        self.output: list[int] = []
        self._prompt_seen: torch.Tensor | None = None  # [V] bool
        self._counts: torch.Tensor | None = None  # [V] fp32: each token's count in the output
        self._eos: torch.Tensor | None = None  # [K] int64

    def extend(self, tokens: Iterable[int]) -> None:
        """Committed output tokens, in order."""
        for t in tokens:
            self.output.append(t)
            if self._counts is not None:
                self._counts[t] += 1

    def _state(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt seen [V], output counts [V]) on the device of `like` [..., V]."""
        if self._counts is None:
            V, device = like.shape[-1], like.device
            bad = [t for t in self.prompt + self.output if not 0 <= t < V]
            assert not bad, f"token ids outside a vocabulary of {V}: {bad[:5]}"
            self._prompt_seen = torch.zeros(V, dtype=torch.bool, device=device)
            self._prompt_seen[torch.tensor(self.prompt, dtype=torch.long, device=device)] = True
            self._counts = torch.bincount(torch.tensor(self.output, dtype=torch.long), minlength=V).float().to(device)
            self._eos = torch.tensor(self.eos, dtype=torch.long, device=device)
        return self._prompt_seen, self._counts

    def process(self, logits: torch.Tensor, pos: int, pending: Sequence[int] = ()) -> torch.Tensor:
        """The processed fp32 logits [V] (a new tensor) of the token at `pos` from the raw logits [V],
        the output before it being the committed tokens and then `pending`."""
        assert logits.dim() == 1, f"process expects logits [V], got {tuple(logits.shape)}"
        done = len(self.output) + len(pending)  # output tokens before pos
        assert self.first_pos + done == pos, \
            f"position {pos}: the history holds {done} output tokens after a prompt of {self.first_pos}"
        prompt_seen, counts = self._state(logits)
        if pending:
            counts = counts.clone()
            counts.index_put_((torch.tensor(list(pending), dtype=torch.long, device=counts.device),),
                              torch.ones(len(pending), device=counts.device), accumulate=True)
        x = apply_penalties(logits.float(), prompt_seen | (counts > 0), counts, self.sp)
        if done < self.sp.min_tokens and self.eos:
            x = mask_ids(x, self._eos)
        return x if x is not logits else x.clone()


def refuse_processing(sp: SamplingParams, runtime: str) -> None:
    """ValueError when `sp` processes the logits and `runtime` (a mode without it) would ignore that."""
    if sp.processes:
        raise ValueError(f"repetition_penalty, presence_penalty, frequency_penalty and min_tokens are applied "
                         f"by --mode spd; {runtime} does not apply them")
