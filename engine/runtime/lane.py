"""What one request's ticks compute on the driver (docs/design.md 3.3, 3.6): its drafts for the
tick's position (one; a branch point's candidates; one per chain) and the verdict on the draft
behind the exiting token. The driver has one lane; with several requests in the pipeline each
request has its own (engine/runtime/batch_driver.py), over its own buffers and PDM cache.
"""
from __future__ import annotations

import torch

from spd_engine.engine.protocol.tick import Draft, Entry, TickPlan, Verdict
from spd_engine.engine.runtime.branch_chains import BranchChains
from spd_engine.engine.runtime.draft_records import DraftRecord
from spd_engine.engine.runtime.drafter import Drafter
from spd_engine.engine.runtime.request_state import RequestState
from spd_engine.engine.runtime.verifier import Processing, Verifier


def _processing(proc: Processing | None) -> dict:
    """The verifier's `proc` argument, given only when the request processes its logits (a plain
    request's call is the verifier's plain signature)."""
    return {} if proc is None else {"proc": proc}


class Lane:
    def __init__(self, drafter: Drafter, branches: BranchChains, verifier: Verifier) -> None:
        self.drafter, self.branches, self.verifier = drafter, branches, verifier

    def drafts(self, req: RequestState, plan: TickPlan) -> list[Draft]:
        """This tick's drafts for plan.draft_pos: one; a branch point's candidates; or one per chain."""
        if plan.branch is not None:
            return self.branches.chain_drafts(req, plan)
        h_last, draft_id = self.drafter.step(self.drafter.tick_rows(plan), plan.pdm_pos)
        return self.drafts_from(req, plan, h_last, draft_id)

    def drafts_from(self, req: RequestState, plan: TickPlan, h_last: torch.Tensor,
                    draft_id: torch.Tensor | None = None) -> list[Draft]:
        """The drafts from the PDM's last hidden state h_last [H] of this tick's pass (draft_id: the
        static step's greedy draft [1]); a pass over several requests' rows gives each its own."""
        if self.branches.policy.branches(plan.fill, False):
            return self.branches.candidates(req, h_last, plan)
        return [self.drafter.draft(req, h_last, plan, draft_id)]

    def verify_exit(self, req: RequestState, plan: TickPlan, drafts: list[Draft], reply: int) -> Verdict:
        """The verdict of a tick whose entry left the pipeline: its run's tokens first (exit rows
        0 .., docs/design.md 3.13), then the draft behind it, each counted by its source."""
        self.verifier.forget()
        ex, row = plan.exit, plan.exit.row
        if ex.run:
            verdict, reply = self._verify_run(req, ex, reply)
            if verdict is not None:
                return verdict
            row = len(ex.run)
        rec = req.drafts.take(plan.verify_pos)
        if ex.run and (ex.run[-1] in req.eos or ex.end >= req.last_pos):  # the run ended the request:
            # what is behind it is moot, counted rejected as the exact replay counts a draft past the end
            verdict = Verdict(False, ex.run[-1])
        else:
            verdict = self.verify(req, plan, drafts, rec, row, reply)
        req.count_verified(rec.sources[verdict.chain], verdict.accepted)
        return verdict._replace(run=len(ex.run))

    def _verify_run(self, req: RequestState, ex: Entry, reply: int) -> tuple[Verdict | None, int]:
        """The exiting entry's run verified token by token (row i verifies run[i]; at T=0 every
        row's argmax at once, the last stage's when it replied, `reply` >= 0): the verdict at the
        first rejection, else None and the argmax behind the last row (-1 at T>0). A token that
        ends the request (EOS) ends the verification: the next is counted rejected, as the exact
        replay counts it. A request that processes its logits verifies each row on its own (its
        output before row i holds run[:i])."""
        at_once = req.sampling.greedy and req.history is None
        greedy = self.verifier.greedy_rows(len(ex.tokens), reply >= 0) if at_once else None  # rows 0..L-1
        for i, tok in enumerate(ex.run):
            pos = ex.pos + 1 + i
            rec = req.drafts.take(pos)
            if i > 0 and ex.run[i - 1] in req.eos:
                accepted, target = False, tok
            elif greedy is not None:
                accepted, target = greedy[i] == tok, greedy[i]
            else:
                accepted, target = self.verifier.verify(pos, tok, rec.qs[0], req.sampling, i,
                                                        **_processing(req.processing(ex.run[:i])))
            if req.top_logprobs >= 0 and not (i > 0 and ex.run[i - 1] in req.eos):
                req.score(pos, target, self.verifier.logits(i))
            req.count_verified(rec.sources[0], accepted)
            if not accepted:
                return Verdict(False, target, run=i), -1
        return None, greedy[-1] if greedy is not None else -1

    def verify(self, req: RequestState, plan: TickPlan, drafts: list[Draft], rec: DraftRecord, row: int,
               reply: int) -> Verdict:
        """The verdict on the draft behind the exiting token, `rec` its record, on the exit hidden
        state in the verifier's exit_buf[row] (`reply`: the last stage's argmax, or -1)."""
        if not plan.exit.run:  # else verify_exit began this verification with the run's rows
            self.verifier.forget()
        pos = plan.verify_pos
        proc = _processing(req.processing(plan.exit.run))  # the exiting run's tokens come before pos
        if plan.proposed is not None:
            at_branch = plan.proposed.pos == plan.branch
            tokens = plan.proposed.chains if at_branch else (plan.proposed.token,)
        else:  # n = 1: this tick's own draft (or candidates) is verified now
            tokens = tuple(d.token for d in drafts)
        if len(tokens) == 1:
            assert rec.width == 1, f"position {pos}: a chain's draft verified before its branch point resolved"
            accepted, target = self.verifier.verify(pos, tokens[0], rec.qs[0], req.sampling, row, reply, **proc)
            chain = 0
        else:
            index, target = self.verifier.verify_branch(pos, tokens, rec.cands, req.sampling, row, reply, **proc)
            accepted, chain = index is not None, index or 0
        if req.top_logprobs >= 0:
            req.score(pos, target, self.verifier.logits(row))
        return Verdict(accepted, target, chain)
