"""The exact T=0 replay with suffix runs (docs/design.md 3.13): the driver's counters when a suffix
draft may carry the tokens after it through the stages as one entry.

The tick protocol (engine/protocol/tick.py) runs on real token ids here, as the driver runs it. A
draft is moot unless every token in flight before it is the greedy reference's (a wrong one is
verified first and flushes it), so only states with a correct context are drafted for: the suffix
index is the driver's (committed history, then the in-flight tokens), and the PDM's draft is the
draft table's (train/fast_eval.py) when every live entry is one token, the pipeline simulation's
staircase. With a run in flight several positions share a depth, a staircase the table does not
hold: the draft is then computed from the PDM over exactly the rows the driver's pass has (the
full-depth rows of its cache, then the tick's rows at their depths), from the same teacher-forced
anchors. Also counted: the tokens each stage step carries (a run's length, else 1), the price of
the runs in stage compute.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from spd_engine.engine.model.pdm import PDM
from spd_engine.engine.protocol.drafting import SUFFIX, SUFFIX_RUN, DraftChooser
from spd_engine.engine.protocol.suffix import CrossRequestHistory, context_tail
from spd_engine.engine.protocol.tick import Draft, TickPlan, TickState, Verdict
from spd_engine.train.replay_records import Acceptance, DraftTable

MOOT = -1  # the draft of a state whose context is wrong: never verified


@dataclass
class RunReplay:
    acceptance: Acceptance
    stage_tokens: int = 0  # tokens carried by stage steps, summed over ticks and live entries
    stage_slots: int = 0  # live entries summed over ticks (= stage_tokens without runs)
    staircase_drafts: int = 0  # drafts made with a run in flight (computed from the PDM, not the table)
    consulted: set[tuple[int, int]] = field(default_factory=set)  # (fill, t) of the table's drafts asked

    @property
    def tokens_per_step(self) -> float:
        return self.stage_tokens / self.stage_slots if self.stage_slots else 1.0


class _RowsPDM:
    """The PDM's draft for any staircase, from the teacher-forced anchors [1, S, m, H]."""

    def __init__(self, pdm: PDM, anchors: torch.Tensor) -> None:
        plan = pdm.plan
        self.pdm = pdm
        self.by_depth = [pdm.rows_of_type(anchors, plan.type_at_depth(d))[0] for d in range(plan.n + 1)]  # [S, H]

    @torch.no_grad()
    def draft(self, plan: TickPlan, P: int) -> tuple[int, float]:
        """(draft id, top-1 minus top-2 margin) of the pass over the cache's rows and plan.rows."""
        n = self.pdm.plan.n
        rows = torch.cat([self.by_depth[n][:plan.pdm_pos],
                          torch.stack([self.by_depth[r.depth][r.pos] for r in plan.rows])])  # [R, H]
        cache = self.pdm.new_cache(rows.shape[0])
        h = self.pdm.forward_rows(rows[None], cache, 0)[0, -1]  # [H]
        top = self.pdm.draft_logits(h).topk(min(2, self.pdm.draft_ids.numel()))
        vals = top.values.tolist()
        return int(self.pdm.draft_ids[top.indices[0]]), vals[0] - vals[1] if len(vals) > 1 else float("inf")


def replay_runs(acc: Acceptance, table: DraftTable, pdm: PDM, anchors: torch.Tensor, y: Sequence[int],
                prompt: Sequence[int], chooser: DraftChooser, max_new_tokens: int,
                cross: CrossRequestHistory | None = None) -> RunReplay:
    """One request's counters, counted into `acc` (empty), with suffix runs of up to
    chooser.suffix.max_run tokens."""
    assert chooser.uses_suffix, "suffix runs need suffix drafts"
    n, P, N = pdm.plan.n, len(prompt), len(y)
    out = RunReplay(acc)
    if N == 1:
        return out
    drafts, margins = table.drafts.tolist(), table.margins.tolist()
    rows_pdm = _RowsPDM(pdm, anchors)
    index = chooser.new_index(prompt)
    index.extend(y[:1])  # the first token is committed before the first tick
    last_pos = P + max_new_tokens - 1
    sources: dict[int, str] = {}  # position -> source of its latest draft
    state = TickState(n, P, y[0], counters=out.acceptance)

    def right(pos: int, token: int) -> bool:
        return pos - P < N and y[pos - P] == token

    def draft(plan: TickPlan) -> Draft:
        live = [(p, tok) for e in plan.inflight for p, tok in zip(range(e.pos, e.end + 1), e.tokens)]
        if not all(right(p, tok) for p, tok in live) or plan.draft_pos - P > N - 1:
            return Draft(plan.draft_pos, MOOT)
        t = plan.draft_pos - 1 - P
        if any(e.run for e in plan.inflight):
            out.staircase_drafts += 1
            pdm_token, margin = rows_pdm.draft(plan, P)
        else:
            out.consulted.add((plan.fill, t))
            pdm_token, margin = drafts[plan.fill - 1][t], margins[plan.fill - 1][t]
        tail, context_len = context_tail(index, [tok for p, tok in live if p >= len(index.history)])
        proposal = index.propose(tail, context_len)
        if proposal is None and cross is not None:
            proposal = cross.propose(tail)
        token, source = chooser.choose(pdm_token, margin, proposal)
        run = proposal.run[:max(0, last_pos - plan.draft_pos)] if source == SUFFIX else ()
        sources[plan.draft_pos] = source
        for i in range(len(run)):
            sources[plan.draft_pos + 1 + i] = SUFFIX_RUN
        return Draft(plan.draft_pos, token, source, run)

    def verify(pos: int, token: int) -> bool:
        ok = right(pos, token)
        cell = out.acceptance.by_source.setdefault(sources.get(pos, SUFFIX), [0, 0])
        cell[0], cell[1] = cell[0] + 1, cell[1] + int(ok)
        return ok

    def verdict(plan: TickPlan, own: Draft) -> Verdict:
        ex = plan.exit
        for i, tok in enumerate(ex.run):
            pos = ex.pos + 1 + i
            if not verify(pos, tok):
                return Verdict(False, y[pos - P] if pos - P < N else MOOT, run=i)
        pos = plan.verify_pos
        proposed = plan.proposed.token if plan.proposed is not None else own.token
        ok = verify(pos, proposed)
        return Verdict(ok, y[pos - P] if pos - P < N else MOOT, run=len(ex.run))

    while state.committed < N:
        plan = state.plan()
        out.stage_slots += plan.fill
        out.stage_tokens += sum(len(e.tokens) for e in plan.inflight)
        own = draft(plan)
        v = verdict(plan, own) if plan.exit is not None else None
        committed = state.advance([own], v)
        if committed is not None:
            index.extend([tok for tok in committed.tokens][:N - len(index.history) + P])
    return out
