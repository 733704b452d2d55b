"""Branch chains (docs/design.md 3.11): at a branch point the driver sends W candidates in one
message; until it is verified every chain drafts its own next token from its own staircase (one
PDM pass over every chain's rows under a tree mask; the buffers' rings[c] hold chain c's anchors,
which share ring 0's below the branch point), and the verification of the branch point picks the
survivor, whose anchors and draft records become the representative's. With several requests in
the pipeline (docs/design.md 3.12) each request has its own BranchChains, and its chains' rows join
the tick's one PDM pass over every request (chain_inputs, then chain_lasts of its share).
"""
from __future__ import annotations

import torch

from spd_engine.engine.model.pdm import draft_probs_full
from spd_engine.engine.protocol.branching import BranchPolicy
from spd_engine.engine.protocol.drafting import PDM as PDM_SOURCE
from spd_engine.engine.protocol.sampling import keyed_generator, sample, target_probs
from spd_engine.engine.protocol.tick import Draft, TickPlan
from spd_engine.engine.protocol.verify_multi import Candidate
from spd_engine.engine.runtime.drafter import Drafter
from spd_engine.engine.runtime.request_state import RequestState


class BranchChains:
    def __init__(self, policy: BranchPolicy, drafter: Drafter) -> None:
        self.policy, self.drafter = policy, drafter
        self.pdm, self.buf = drafter.pdm, drafter.buf

    @property
    def width(self) -> int:
        return self.policy.width

    def chain_drafts(self, req: RequestState, plan: TickPlan, h_last: torch.Tensor | None = None) -> list[Draft]:
        """Each chain's draft for plan.draft_pos while the branch point plan.branch is in flight;
        h_last [W, H]: each chain's last hidden state when a pass over several requests' rows
        computed it (chain_lasts), else this request's own pass."""
        h_last = self.chain_pass(plan) if h_last is None else h_last
        return [self.drafter.draft(req, h_last[c], plan, chain=c) for c in range(plan.width)]

    def chain_pass(self, plan: TickPlan) -> torch.Tensor:
        """One PDM pass over every chain of the branch point in flight (chain_inputs); returns each
        chain's last hidden state [W, H]. The PDM cache keeps committed rows only, so the rows
        written here past the pending one are rewritten next tick, as at W = 1."""
        rows, positions, mask = self.chain_inputs(plan)
        h = self.pdm.forward_rows(rows[None], self.drafter.cache, plan.pdm_pos, positions[None], mask[None, None])[0]
        return self.chain_lasts(plan, h)

    def chain_inputs(self, plan: TickPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The PDM rows of every chain of the branch point in flight, written from the PDM cache's
        end: the rows below it once, then each chain's own rows (its anchors, rings[c]). Returns the
        rows [T, H], their RoPE positions [T] and the tree mask keeping the chains apart
        [T, pdm_pos + T]."""
        q, W, p0, buf = plan.branch, plan.width, plan.pdm_pos, self.buf
        dev = buf.ring.device
        S = q - p0  # rows below the branch point: the pending row and the staircase's older part
        C = len(plan.rows) - S  # each chain's own rows: positions q .. draft_pos - 1
        assert S >= 0 and C >= 1, (p0, q, len(plan.rows))
        types = buf.types_of(plan)
        slots = [buf.slot(r.pos) for r in plan.rows[:S]] + \
            [buf.slot(r.pos) + c * buf.num_slots for c in range(W) for r in plan.rows[S:]]
        rows = self.pdm.rows_from_ring(buf.rings.view(-1, *buf.rings.shape[2:]), torch.tensor(slots, device=dev),
                                       torch.cat([types[:S]] + [types[S:]] * W))  # [S + W C, H]
        new = torch.arange(S + W * C, device=dev)
        chain = torch.where(new < S, -1, (new - S) // C)  # [T]: -1 for the shared rows
        depth = torch.where(new < S, new, S + (new - S) % C)  # [T]: offset from p0 of the row's position
        sees = ((chain[None] == -1) | (chain[None] == chain[:, None])) & (depth[None] <= depth[:, None])
        mask = torch.cat([torch.ones(len(new), p0, dtype=torch.bool, device=dev), sees], dim=1)
        return rows, p0 + depth, mask

    @staticmethod
    def chain_lasts(plan: TickPlan, h: torch.Tensor) -> torch.Tensor:
        """Each chain's last hidden state [W, H] from a pass's output h [T, H] over chain_inputs' rows."""
        S = plan.branch - plan.pdm_pos  # the shared rows, then each chain's C rows
        C = len(plan.rows) - S
        return h[S + C - 1::C]

    def candidates(self, req: RequestState, h_last: torch.Tensor, plan: TickPlan) -> list[Draft]:
        """A branch point's candidates (engine/protocol/branching.py): the chooser's draft, then the suffix
        proposal, then the PDM's ranked drafts. At T > 0 the first is drawn from q (or is the
        suffix draft); the others are deterministic given it, so their q is a point mass."""
        pos, sp, policy, chooser = plan.draft_pos, req.sampling, req.policy, self.drafter.chooser
        logits = self.pdm.draft_logits(h_last)  # [Vd]
        self.drafter.observe(plan, logits)
        # width + 1 ranked drafts always suffice: the chosen and the suffix draft repeat at most two
        top = logits.topk(min(self.width + 1, self.pdm.draft_ids.numel()))
        ranked = self.pdm.draft_ids[top.indices].tolist()  # host sync: the candidates go in the header
        vals = top.values.tolist()
        margin = vals[0] - vals[1] if len(vals) > 1 else float("inf")
        proposal = self.drafter.suffix_proposal(req, plan) if req.suffix is not None else None
        chosen = chooser.choose(ranked[0], margin, proposal) if proposal is not None else (ranked[0], PDM_SOURCE)
        q = None
        if sp.greedy:
            if policy is not None:
                chosen = (policy(pos, chosen[0]), chosen[1])
        elif chosen[1] == PDM_SOURCE or policy is not None:
            q = draft_probs_full(self.pdm, target_probs(logits, sp)) if chosen[1] == PDM_SOURCE \
                else self.drafter.point_mass(chosen[0])  # [V]
            if policy is not None:
                q = policy(pos, q)
            chosen = (sample(q, keyed_generator(sp.seed, pos, "draft")), chosen[1])
        suffix = proposal.token if proposal is not None and proposal.length >= chooser.suffix.min_match else None
        cands = self.policy.candidates(chosen, ranked, suffix)
        for _, src in cands:
            req.count_drafted(src)
        req.drafts.keep_candidates(pos, [src for _, src in cands], None if sp.greedy else
                                   [Candidate(tok, q if i == 0 else None) for i, (tok, _) in enumerate(cands)])
        return [Draft(pos, tok, src) for tok, src in cands]

    def adopt(self, req: RequestState, k: int, inflight) -> None:
        """Chain k survived its branch point: its anchors and draft records become the representative's."""
        for e in inflight:
            if e.chains and k:
                slot = self.buf.slot(e.pos)
                self.buf.ring[slot] = self.buf.rings[k, slot]
        req.drafts.adopt(k)
