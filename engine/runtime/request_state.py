"""One request's driver-side state, all of it in one object: its result and counters, limits and
sampling, the tick protocol's state, its epoch, its drafts' records, its suffix index and its
timers. The driver holds the live request's; nothing of a request is kept on the driver itself.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from spd_engine.engine.protocol.logits_processing import TokenHistory
from spd_engine.engine.protocol.metrics import GenerationResult
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.protocol.suffix import SuffixIndex
from spd_engine.engine.protocol.tick import TickState
from spd_engine.engine.runtime.draft_records import DraftRecords
from spd_engine.engine.runtime.verifier import Processing, Verifier

# (position, PDM draft) -> token to send. Lets benchmarks and tests steer acceptance
# (synthetic alpha, forced rejections) without touching the verification path. At T > 0 the
# policy maps (position, PDM draft distribution q [V]) -> the distribution to sample from.
DraftPolicy = Callable[[int, object], object]
# Called with every committed token; returning False ends the request after that token (the
# pipeline is drained as at any end, so the next request is unaffected): cancellation, stop
# strings, deadlines. With log-probabilities asked it is called as on_token(token, scored), scored
# being the token's entry of GenerationResult.logprobs.
OnToken = Callable[..., "bool | None"]
# the parts of a tick the driver times: send (posting to stage 0), stage0 (a co-located stage 0),
# wait (receiving what the plan needs), pdm (rows + PDM step + draft), verify
TIMERS = ("send", "stage0", "wait", "pdm", "verify")


class RequestState:
    def __init__(self, n: int, max_new: int, eos: frozenset[int], sampling: SamplingParams, epoch: int,
                 policy: DraftPolicy | None = None, on_token: OnToken | None = None,
                 suffix: SuffixIndex | None = None,
                 trace: list[tuple[int, str, float, float]] | None = None, max_run: int = 1) -> None:
        self.res = GenerationResult(tokens=[], n=n)
        self.n, self.max_new, self.eos, self.sampling = n, max_new, eos, sampling
        self.policy, self.on_token = policy, on_token
        self.epoch = epoch  # the epoch its messages carry (bumped by every flush)
        self.tick = 0
        self.state: TickState | None = None  # the tick protocol's state, from the first token on
        self.last_pos = 0  # the last position the request may commit (from the first token on)
        self.drafts = DraftRecords()
        self.suffix = suffix  # prompt + committed tokens, when suffix drafts are on
        self.max_run = max_run  # tokens a suffix draft may carry as one entry (docs/design.md 3.13)
        self.timers = dict.fromkeys(TIMERS, 0.0)  # seconds per part of the tick
        self.trace = trace  # (tick, what, t0, t1), when tracing
        self.top_logprobs = -1  # >= 0: each committed token's log-probability and this many alternatives
        self.first_pos = 0  # the position of the first generated token
        self.history: TokenHistory | None = None  # prompt and output, when the sampling processes logits
        self._scored: dict[int, tuple[int, float, list[tuple[int, float]]]] = {}

    def start_decode(self, first_pos: int, first_token: int, anchor_stages: list[int]) -> TickState:
        """The tick protocol from the first generated token on, counting into the result."""
        self.timers = dict.fromkeys(TIMERS, 0.0)  # the per-tick breakdown is the decode's
        self.last_pos = first_pos + self.max_new - 1
        self.first_pos = first_pos
        self.state = TickState(self.n, first_pos, first_token, anchor_stages, epoch=self.epoch, counters=self.res)
        return self.state

    def first_token(self, verifier: Verifier, logits: torch.Tensor, prompt: Sequence[int]) -> int:
        """The first generated token from the prefill's logits [V] (`verifier`: the lane's Verifier),
        processed and scored as every later one."""
        pos = len(prompt)
        if self.sampling.processes:
            self.history = TokenHistory(self.sampling, prompt, self.eos)
        token = verifier.sample_target(logits, pos, self.sampling, self.processing())
        self.score(pos, token, logits)
        return token

    def processing(self, pending: Sequence[int] = ()) -> Processing | None:
        """How the logits of a position are processed (None: they are not), the output before it
        being the committed tokens and then `pending` (a suffix run's tokens verified before it)."""
        history = self.history
        if history is None:
            return None
        return lambda logits, pos: history.process(logits, pos, pending)

    def score(self, pos: int, token: int, logits: torch.Tensor) -> None:
        """When log-probabilities are asked: the target's raw logits [V] behind the choice of `token`
        at `pos` (before any processing, temperature or filter), kept until the token is committed."""
        if self.top_logprobs < 0:
            return
        logp = torch.log_softmax(logits.float(), dim=-1)
        top = logp.topk(self.top_logprobs) if self.top_logprobs else None
        alternatives = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
        self._scored[pos] = (token, float(logp[token]), alternatives)

    def commit(self, token: int) -> bool:
        """Commit a token; False when the request ends here (EOS, max tokens, or on_token said stop)."""
        scored = None
        if self.top_logprobs >= 0:
            scored = self._scored.pop(self.first_pos + len(self.res.tokens), None)
            assert scored is not None and scored[0] == token, "a committed token was verified first"
            self.res.logprobs.append(scored)
        self.res.tokens.append(token)
        if self.suffix is not None:
            self.suffix.extend((token,))
        if self.history is not None:
            self.history.extend((token,))
        go_on = None
        if self.on_token is not None:
            go_on = self.on_token(token) if scored is None else self.on_token(token, scored)
        return token not in self.eos and len(self.res.tokens) < self.max_new and go_on is not False

    def account(self, what: str, t0: float) -> None:
        """The time since t0 to one of the tick's parts."""
        self.spend(what, t0, time.perf_counter())

    def spend(self, what: str, t0: float, t1: float, share: float = 1.0) -> None:
        """`share` of the span t0 .. t1 to one of the tick's parts (a part several requests share,
        such as the PDM pass or stage 0's step over a batch, counts a share to each)."""
        self.timers[what] += (t1 - t0) * share
        if self.trace is not None:
            self.trace.append((self.tick, what, t0, t1))

    def count_drafted(self, source: str) -> None:
        self.res.by_source.setdefault(source, [0, 0, 0])[0] += 1

    def count_verified(self, source: str, accepted: bool) -> None:
        cell = self.res.by_source.setdefault(source, [0, 0, 0])
        cell[1] += 1
        cell[2] += int(accepted)
