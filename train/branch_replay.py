"""The exact T=0 replay with branch width W (engine/protocol/branching.py): what W chains would buy,
before any runtime carries them.

At T=0 only the chain whose tokens are the greedy reference's matters: the others die when their
branch point is verified. That chain's drafts are made from its own staircase, the teacher-forced
one the draft table holds, so the replay of train/fast_eval.py stays exact once a branch point's
draft counts as right when the reference token is among its candidates (the table keeps the
PDM's top-4 per state: W <= 4 plus the suffix proposal). Also counted: the tokens each stage step
carries (W for in-flight positions at or after an unresolved branch point, else 1), the price of
the extra chains in stage compute.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from spd_engine.engine.protocol.branching import BranchPolicy
from spd_engine.engine.protocol.drafting import DraftChooser
from spd_engine.engine.protocol.tick import TickPlan
from spd_engine.train.fast_eval import Acceptance, DraftTable, replay, suffix_table


@dataclass
class BranchRun:
    acceptance: Acceptance
    stage_tokens: int = 0  # tokens carried by stage steps, summed over ticks and in-flight positions
    stage_slots: int = 0  # in-flight positions, summed over ticks (= stage_tokens at W = 1)
    branch_points: int = 0
    branch_saves: int = 0  # branch points whose first candidate was wrong and another right
    consulted: set[tuple[int, int]] = field(default_factory=set)  # (fill, t) of the drafts whose correctness was asked

    @property
    def tokens_per_step(self) -> float:
        return self.stage_tokens / self.stage_slots if self.stage_slots else 1.0


def replay_branches(table: DraftTable, y: Sequence[int], P: int, n: int, chooser: DraftChooser,
                    policy: BranchPolicy, prompt: Sequence[int] = ()) -> BranchRun:
    """The replay of one request under `policy` (T=0, one draft table per request)."""
    drafts, margins, top = table.drafts.tolist(), table.margins.tolist(), table.top.tolist()
    ranked = len(top[0][0]) if top and top[0] else policy.width
    if policy.width > ranked:
        raise ValueError(f"the draft table ranks {ranked} PDM drafts per state: W={policy.width} needs more")
    proposals = suffix_table(chooser, prompt, y, n) if chooser.uses_suffix else None
    run = BranchRun(Acceptance(n=n, tokens=len(y)))
    pending: list[int] = []  # index of the unresolved branch point, if any
    sources: dict[tuple[int, int], str] = {}

    def correct(f: int, t: int) -> bool:
        run.consulted.add((f, t))
        prop = proposals[f - 1][t] if proposals is not None else None
        chosen = chooser.choose(drafts[f - 1][t], margins[f - 1][t], prop)
        if not policy.branches(f, bool(pending)):
            sources[(f, t)] = chosen[1]
            return chosen[0] == y[t + 1]
        run.branch_points += 1
        pending.append(t + 1)
        suffix = prop.token if prop is not None and prop.length >= chooser.suffix.min_match else None
        cands = policy.candidates(chosen, top[f - 1][t], suffix)
        hit = next((src for tok, src in cands if tok == y[t + 1]), None)
        run.branch_saves += int(hit is not None and chosen[0] != y[t + 1])
        sources[(f, t)] = hit or chosen[1]
        return hit is not None

    def on_verify(f: int, t: int, ok: bool) -> None:
        src = run.acceptance.by_source.setdefault(sources[(f, t)], [0, 0])
        src[0], src[1] = src[0] + 1, src[1] + int(ok)
        if pending and (t + 1 == pending[0] or not ok):  # resolved, or flushed by a rejection
            pending.clear()

    def on_plan(plan: TickPlan) -> None:
        for e in plan.inflight:
            run.stage_slots += 1
            run.stage_tokens += policy.width if pending and e.pos >= pending[0] else 1

    acc = replay(len(y), n, correct, on_verify, on_plan)
    acc.by_source = run.acceptance.by_source
    run.acceptance = acc
    return run


def score_branches(table: DraftTable, y: Sequence[int], prompt: Sequence[int], n: int,
                   choosers: dict[str, DraftChooser], policies: Sequence[BranchPolicy]) -> dict[str, BranchRun]:
    """Every (chooser, policy) pair on one request: "W=2 refill suffix>=2" -> its run."""
    return {f"W={p.width} {p.when} {name}": replay_branches(table, y, len(prompt), n, c, p, prompt)
            for p in policies for name, c in choosers.items()}


def pooled(runs: Sequence[BranchRun], n: int) -> dict:
    """alpha, pooled EAL and stage tokens per step over requests."""
    acc = [r.acceptance for r in runs]
    ver, ok = sum(a.verified for a in acc), sum(a.accepted for a in acc)
    ticks, dec = sum(a.ticks for a in acc), sum(a.tokens - 1 for a in acc)
    slots = sum(r.stage_slots for r in runs)
    return {"prompts": len(runs), "alpha": ok / ver if ver else None, "eal": n * dec / ticks if ticks else None,
            "tokens_per_step": sum(r.stage_tokens for r in runs) / slots if slots else 1.0,
            "branch_points": sum(r.branch_points for r in runs), "branch_saves": sum(r.branch_saves for r in runs)}
