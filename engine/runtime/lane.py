"""What one request's ticks compute on the driver (docs/design.md 3.3, 3.6): its drafts for the
tick's position (one; a branch point's candidates; one per chain) and the verdict on the draft
behind the exiting token. The driver has one lane; with several requests in the pipeline each
request has its own (engine/runtime/batch_driver.py), over its own buffers and PDM cache.
"""
from __future__ import annotations

import torch

from spd_engine.engine.protocol.tick import Draft, TickPlan, Verdict
from spd_engine.engine.runtime.branch_chains import BranchChains
from spd_engine.engine.runtime.draft_records import DraftRecord
from spd_engine.engine.runtime.drafter import Drafter
from spd_engine.engine.runtime.request_state import RequestState
from spd_engine.engine.runtime.verifier import Verifier


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
        return [Draft(plan.draft_pos, self.drafter.draft(req, h_last, plan, draft_id))]

    def verify(self, req: RequestState, plan: TickPlan, drafts: list[Draft], rec: DraftRecord, row: int,
               reply: int) -> Verdict:
        """The verdict on the draft behind the exiting token, `rec` its record, on the exit hidden
        state in the verifier's exit_buf[row] (`reply`: the last stage's argmax, or -1)."""
        pos = plan.verify_pos
        if plan.proposed is not None:
            at_branch = plan.proposed.pos == plan.branch
            tokens = plan.proposed.chains if at_branch else (plan.proposed.token,)
        else:  # n = 1: this tick's own draft (or candidates) is verified now
            tokens = tuple(d.token for d in drafts)
        if len(tokens) == 1:
            assert rec.width == 1, f"position {pos}: a chain's draft verified before its branch point resolved"
            accepted, target = self.verifier.verify(pos, tokens[0], rec.qs[0], req.sampling, row, reply)
            chain = 0
        else:
            index, target = self.verifier.verify_branch(pos, tokens, rec.cands, req.sampling, row, reply)
            accepted, chain = index is not None, index or 0
        return Verdict(accepted, target, chain)
