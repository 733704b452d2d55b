"""The driver's verification (docs/design.md 3.6): the token leaving the last stage verifies the draft
behind it. T = 0: the target's argmax, from the last stage's reply when it verified, from a static
head step in the graph step modes, else from the head here; T > 0: speculative sampling against
the exact q the draft was drawn from (engine/protocol/verify.py), and for a branch point's
candidates recursive rejection sampling (engine/protocol/verify_multi.py).

A request whose sampling processes the logits (penalties, min_tokens: engine/protocol/
logits_processing.py) passes its `Processing`: then every choice is made on the processed logits
(T = 0 their argmax; no argmax computed elsewhere, the last stage's or a static step's, is used).
The raw logits a verification computed stay at hand (`logits`) until the next one begins (`forget`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from spd_engine.engine.model.graphs import VerifyStep
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.protocol.sampling import SamplingParams, keyed_generator, sample, target_probs
from spd_engine.engine.protocol.verify import verify_sampled
from spd_engine.engine.protocol.verify_multi import Candidate, verify_candidates, verify_candidates_greedy

# (raw logits [V], position) -> the processed logits (request_state.Processing)
Processing = Callable[[torch.Tensor, int], torch.Tensor]


class Verifier:
    def __init__(self, head: StageModel, exit_buf: torch.Tensor, verify_step: VerifyStep | None,
                 replies: torch.Tensor | None = None) -> None:
        self.head, self.exit_buf, self.verify_step = head, exit_buf, verify_step  # exit_buf [rows, H]
        self.replies = replies  # [rows] int64: a verifying last stage's argmaxes of a suffix run's rows
        self._raw: dict[int, torch.Tensor] = {}  # row -> its raw logits [V], this verification's

    def forget(self) -> None:
        """A new verification begins: the exit rows hold other states now."""
        self._raw.clear()

    def sample_target(self, logits: torch.Tensor, pos: int, sp: SamplingParams, proc: Processing | None = None
                      ) -> int:
        """A plain draw from the target distribution p for the token at `pos` (the first token)."""
        if proc is not None:
            logits = proc(logits, pos)
        if sp.greedy:
            return int(logits.argmax())  # host sync: the id is needed to continue
        return sample(target_probs(logits, sp), keyed_generator(sp.seed, pos, "target"))

    def target_argmax(self, row: int, reply: int, sp: SamplingParams) -> int | None:
        """T=0: the argmax of the target's logits from exit_buf[row] when it is known without the
        logits: computed by the last stage (`reply` >= 0), or in the graph step modes by the final
        norm + head + argmax as one static step."""
        if reply >= 0:
            assert sp.greedy, "the last stage verifies at T=0 only"
            return reply
        if self.verify_step is not None and sp.greedy:
            return int(self.verify_step.run(self.exit_buf[row]))  # host sync: verification decides control flow
        return None

    def logits(self, row: int) -> torch.Tensor:
        """The target's raw logits [V] behind exit_buf[row] (for log-probabilities: the exit hidden
        state reaches the driver whoever computed the argmax), computed once per verification."""
        if row not in self._raw:
            self._raw[row] = self.head.logits(self.exit_buf[row])
        return self._raw[row]

    def greedy_rows(self, rows: int, replied: bool = False) -> list[int]:
        """T=0: the target's argmax behind each of exit_buf[:rows] (a suffix run's exit rows), at once:
        as the last stage computed them (`replied`), else from the head here."""
        if replied:
            assert self.replies is not None, "a run's argmaxes replied to a verifier without their buffer"
            return self.replies[:rows].tolist()
        return self.head.greedy_tokens(self.exit_buf[:rows])  # host sync: verification decides control flow

    def _processed(self, row: int, pos: int, proc: Processing | None) -> torch.Tensor:
        """The logits [V] the token at `pos` is chosen from, behind exit_buf[row]."""
        logits = self.logits(row)
        return logits if proc is None else proc(logits, pos)

    def verify(self, pos: int, proposed: int, q: torch.Tensor | None, sp: SamplingParams, row: int = 0,
               reply: int = -1, proc: Processing | None = None) -> tuple[bool, int]:
        """(accepted, committed token) for the draft `proposed` at `pos` (q [V]: what it was drawn
        from, T > 0), on the exit hidden state in exit_buf[row]; `reply`: the last stage's argmax or -1;
        `proc`: the request's processing of the logits, if any."""
        if proc is None:
            target = self.target_argmax(row, reply, sp)
            if target is not None:
                return target == proposed, target
            if sp.greedy:
                target = self.head.greedy_token(self.exit_buf[row])  # host sync: verification decides control flow
                return target == proposed, target
        logits = self._processed(row, pos, proc)  # [V]
        if sp.greedy:
            target = int(logits.argmax())  # host sync: verification decides control flow
            return target == proposed, target
        assert q is not None, f"position {pos}: no q recorded for its draft"
        return verify_sampled(target_probs(logits, sp), q, proposed, keyed_generator(sp.seed, pos, "accept"),
                              keyed_generator(sp.seed, pos, "residual"))

    def verify_branch(self, pos: int, tokens: Sequence[int], cands: list[Candidate] | None, sp: SamplingParams,
                      row: int, reply: int = -1, proc: Processing | None = None) -> tuple[int | None, int]:
        """(index of the surviving candidate or None, committed token) for a branch point at `pos`:
        the argmax's candidate at T=0, recursive rejection sampling over `cands` at T>0."""
        if proc is None:
            target = self.target_argmax(row, reply, sp)
            if target is not None:
                return verify_candidates_greedy(target, tokens)
            if sp.greedy:  # host sync: control flow
                return verify_candidates_greedy(self.head.greedy_token(self.exit_buf[row]), tokens)
        logits = self._processed(row, pos, proc)  # [V]
        if sp.greedy:  # host sync: control flow
            return verify_candidates_greedy(int(logits.argmax()), tokens)
        assert cands is not None and [c.token for c in cands] == list(tokens), (cands, tokens)
        return verify_candidates(target_probs(logits, sp), cands, keyed_generator(sp.seed, pos, "accept"),
                                 keyed_generator(sp.seed, pos, "residual"))
