"""The driver's drafting (docs/design.md 3.3, 3.5): one PDM pass over a tick's rows, then the draft
for the tick's position from the PDM or from the suffix index (engine/protocol/drafting.py chooses).

T = 0: the draft is an id (the PDM's argmax over its draft vocabulary, or the suffix draft). T > 0:
it is drawn from q, the PDM's draft distribution over the target vocabulary (a point mass for a
suffix draft), and that exact q is recorded for its verification. A suffix draft may carry its
run (docs/design.md 3.13): the tokens after it in the same occurrence, each recorded as a draft
of its own position (point masses at T > 0).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from spd_engine.engine.model.graphs import PDMStep
from spd_engine.engine.model.pdm import PDM, draft_probs_full, greedy_draft
from spd_engine.engine.protocol.drafting import PDM as PDM_SOURCE
from spd_engine.engine.protocol.drafting import SUFFIX, SUFFIX_RUN, DraftChooser
from spd_engine.engine.protocol.sampling import keyed_generator, sample, target_probs
from spd_engine.engine.protocol.suffix import CrossRequestHistory, SuffixProposal, context_tail
from spd_engine.engine.protocol.tick import Draft, TickPlan
from spd_engine.engine.runtime.driver_buffers import DriverBuffers
from spd_engine.engine.runtime.request_state import RequestState

# (newest position, fill, draft logits [Vd]): evaluation by fill state, and the check that training
# simulates exactly what the driver computes
DraftObserver = Callable[[int, int, torch.Tensor], None]


class Drafter:
    def __init__(self, pdm: PDM, pdm_cache, buffers: DriverBuffers, chooser: DraftChooser,
                 cross: CrossRequestHistory | None, pdm_steps: dict[int, PDMStep]) -> None:
        self.pdm, self.cache, self.buf, self.chooser, self.cross = pdm, pdm_cache, buffers, chooser, cross
        self.pdm_steps = pdm_steps  # static PDM steps by row count; empty in the eager step mode
        self.observer: DraftObserver | None = None

    def step(self, rows: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """rows [R, H] at PDM positions pos .. pos+R-1 -> (last hidden [H], greedy draft id [1] on
        the device, or None from the eager step)."""
        step = self.pdm_steps.get(rows.shape[0])
        if step is None:  # the eager mode, or more rows than a static step takes (a suffix run in flight)
            return self.pdm.forward_rows(rows[None], self.cache, pos)[0, -1], None
        return step.run(pos, rows)

    def tick_rows(self, plan: TickPlan) -> torch.Tensor:
        """The PDM rows [R, H] of the representative chain, from ring 0."""
        return self.pdm.rows_from_ring(self.buf.ring, self.buf.slots_of(plan), self.buf.types_of(plan))

    def suffix_proposal(self, req: RequestState, plan: TickPlan, chain: int = 0) -> SuffixProposal | None:
        """The suffix draft for plan.draft_pos: committed history, then the chain's unverified in-flight drafts."""
        index = req.suffix
        C = len(index.history)  # committed tokens (prompt included) = the first unverified position
        unverified = [tok for e, t in zip(plan.inflight, plan.chain_tokens(chain))
                      for p, tok in zip(range(e.pos, e.end + 1), (t, *e.run)) if p >= C]
        tail, context_len = context_tail(index, unverified)
        own = index.propose(tail, context_len)
        return own if own is not None or self.cross is None else self.cross.propose(tail)

    def observe(self, plan: TickPlan, logits: torch.Tensor) -> None:
        if self.observer is not None:
            self.observer(plan.draft_pos - 1, plan.fill, logits)

    def draft(self, req: RequestState, h_last: torch.Tensor, plan: TickPlan, draft_id: torch.Tensor | None = None,
              chain: int = 0) -> Draft:
        """The draft for plan.draft_pos from the PDM's last hidden state [H] (draft_id: the static
        step's greedy draft [1], already on the device) or from the suffix index (with its run,
        where runs are on and no branch point is in flight); `chain`: which chain of the branch
        point in flight it extends."""
        pos, sp, policy = plan.draft_pos, req.sampling, req.policy
        if chain == 0 and self.observer is not None:
            self.observe(plan, self.pdm.draft_logits(h_last))
        proposal = self.suffix_proposal(req, plan, chain) if req.suffix is not None else None
        token, source = None, PDM_SOURCE  # None: the PDM's greedy draft, read below (T=0) or sampled (T>0)
        if proposal is not None:
            top = self.pdm.draft_logits(h_last).topk(min(2, self.pdm.draft_ids.numel()))
            vals = top.values.tolist()  # host sync: the choice needs the PDM's margin
            margin = vals[0] - vals[1] if len(vals) > 1 else float("inf")
            token, source = self.chooser.choose(int(self.pdm.draft_ids[top.indices[0]]), margin, proposal)
        req.count_drafted(source)
        run = self._run(req, plan, proposal) if source == SUFFIX and policy is None else ()
        for _ in run:
            req.count_drafted(SUFFIX_RUN)
        if sp.greedy:
            req.drafts.keep(pos, source, None, chain, plan.width)  # a re-draft after a flush replaces it
            for i in range(len(run)):
                req.drafts.keep(pos + 1 + i, SUFFIX_RUN)
            if token is None:  # host sync: the draft id goes in the next header
                token = int(draft_id) if draft_id is not None else greedy_draft(self.pdm, h_last)
            return Draft(pos, policy(pos, token) if policy is not None else token, source, run)
        q = self.point_mass(token) if source == SUFFIX else \
            draft_probs_full(self.pdm, target_probs(self.pdm.draft_logits(h_last), sp))  # [V]
        if policy is not None:
            q = policy(pos, q)
        req.drafts.keep(pos, source, q, chain, plan.width)  # the exact q its verification needs
        for i, tok in enumerate(run):
            req.drafts.keep(pos + 1 + i, SUFFIX_RUN, self.point_mass(tok))
        if source == SUFFIX and policy is None:
            return Draft(pos, token, source, run)
        return Draft(pos, sample(q, keyed_generator(sp.seed, pos, "draft")), source)

    def _run(self, req: RequestState, plan: TickPlan, proposal: SuffixProposal) -> tuple[int, ...]:
        """The suffix draft's run as carried: none while a branch point is in flight or starts, at
        most the request's max_run tokens in all, never
        past the request's last position."""
        if plan.branch is not None or not proposal.run:
            return ()
        return proposal.run[:max(0, min(req.max_run - 1, req.last_pos - plan.draft_pos))]

    def point_mass(self, token: int) -> torch.Tensor:
        """q [V] of a deterministic draft (a suffix draft, the PDM's j-th best)."""
        q = torch.zeros(self.pdm.target_cfg.vocab_size, device=self.buf.ring.device)
        q[token] = 1.0
        return q
