"""The driver's drafting (docs/design.md 3.3, 3.5): one PDM pass over a tick's rows, then the draft
for the tick's position from the PDM or from the suffix index (engine/protocol/drafting.py chooses).

T = 0: the draft is an id (the PDM's argmax over its draft vocabulary, or the suffix draft). T > 0:
it is drawn from q, the PDM's draft distribution over the target vocabulary (a point mass for a
suffix draft), and that exact q is recorded for its verification.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from spd_engine.engine.model.graphs import PDMStep
from spd_engine.engine.model.pdm import PDM, draft_probs_full, greedy_draft
from spd_engine.engine.protocol.drafting import PDM as PDM_SOURCE, SUFFIX, DraftChooser
from spd_engine.engine.protocol.sampling import keyed_generator, sample, target_probs
from spd_engine.engine.protocol.suffix import CrossRequestHistory, SuffixProposal
from spd_engine.engine.protocol.tick import TickPlan
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
        if not self.pdm_steps:
            return self.pdm.forward_rows(rows[None], self.cache, pos)[0, -1], None
        return self.pdm_steps[rows.shape[0]].run(pos, rows)

    def tick_rows(self, plan: TickPlan) -> torch.Tensor:
        """The PDM rows [R, H] of the representative chain, from ring 0."""
        return self.pdm.rows_from_ring(self.buf.ring, self.buf.slots_of(plan), self.buf.types_of(plan))

    def suffix_proposal(self, req: RequestState, plan: TickPlan, chain: int = 0) -> SuffixProposal | None:
        """The suffix draft for plan.draft_pos: committed history, then the chain's unverified in-flight drafts."""
        index = req.suffix
        C = len(index.history)  # committed tokens (prompt included) = the first unverified position
        unverified = [t for e, t in zip(plan.inflight, plan.chain_tokens(chain)) if e.pos >= C]
        keep = max(index.settings.max_len, len(unverified))
        tail = (index.history[-keep:] + unverified)[-keep:]
        own = index.propose(tail, C + len(unverified))
        return own if own is not None or self.cross is None else self.cross.propose(tail)

    def observe(self, plan: TickPlan, logits: torch.Tensor) -> None:
        if self.observer is not None:
            self.observer(plan.draft_pos - 1, plan.fill, logits)

    def draft(self, req: RequestState, h_last: torch.Tensor, plan: TickPlan, draft_id: torch.Tensor | None = None,
              chain: int = 0) -> int:
        """The draft for plan.draft_pos from the PDM's last hidden state [H] (draft_id: the static
        step's greedy draft [1], already on the device) or from the suffix index; `chain`: which
        chain of the branch point in flight it extends."""
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
        if sp.greedy:
            req.drafts.keep(pos, source, None, chain, plan.width)  # a re-draft after a flush replaces it
            if token is None:  # host sync: the draft id goes in the next header
                token = int(draft_id) if draft_id is not None else greedy_draft(self.pdm, h_last)
            return policy(pos, token) if policy is not None else token
        q = self.point_mass(token) if source == SUFFIX else \
            draft_probs_full(self.pdm, target_probs(self.pdm.draft_logits(h_last), sp))  # [V]
        if policy is not None:
            q = policy(pos, q)
        req.drafts.keep(pos, source, q, chain, plan.width)  # the exact q its verification needs
        if source == SUFFIX and policy is None:
            return token
        return sample(q, keyed_generator(sp.seed, pos, "draft"))

    def point_mass(self, token: int) -> torch.Tensor:
        """q [V] of a deterministic draft (a suffix draft, the PDM's j-th best)."""
        q = torch.zeros(self.pdm.target_cfg.vocab_size, device=self.buf.ring.device)
        q[token] = 1.0
        return q
