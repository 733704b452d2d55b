"""Exact fast path for T=0 acceptance: the driver's counts without running the pipeline.

At T=0 a verified draft is compared with the greedy reference token, and a draft can only be
verified when every in-flight token before it is correct (a wrong one is verified first and
flushes the pipeline). So one greedy decode (tokens `y`, N of them), one teacher-forced target
pass over prompt + y and, per fill `f = 1..n`, the simulated PDM draft for every position
(train/pipeline_sim.py) decide everything: `replay` runs the driver's tick protocol
(engine/protocol/tick.py, as engine/runtime/driver.py does) with correctness bits instead of tokens and returns
the counts the driver would report (ticks, verified, accepted, rejections), plus verified / accepted drafts grouped by
the fill at which each verified draft was made (fill < n: right after the start or a rejection,
while the pipeline refills; fill == n: full pipeline).

Indices below are token indices: y[0] is the first generated token (from the prefill logits),
at position P = len(prompt). `replay` is pure logic (no torch).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from spd_engine.engine.model.greedy import DEFAULT_PREFILL_CHUNK, greedy_generate
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.model.pdm import PDM
from spd_engine.engine.protocol.drafting import DraftChooser
from spd_engine.engine.protocol.suffix import CrossRequestHistory, SuffixProposal
from spd_engine.engine.protocol.tick import Draft, TickPlan, TickState, Verdict
from spd_engine.train.pipeline_sim import simulated_hidden, target_anchors
from spd_engine.train.replay_records import Acceptance, DraftTable
from spd_engine.train.run_replay import replay_runs

# (fill, newest index t) -> whether the draft made then for index t + 1 equals y[t + 1].
DraftCorrect = Callable[[int, int], bool]
# (position, PDM draft) -> token sent, as engine.driver.DraftPolicy; must be a pure function here.
DraftPolicy = Callable[[int, int], int]


_WRONG, _RIGHT = 0, 1  # token ids of the replay: whether a token equals the reference's


def replay(N: int, n: int, correct: DraftCorrect, on_verify: Callable[[int, int, bool], None] | None = None,
           on_plan: Callable[[TickPlan], None] | None = None) -> Acceptance:
    """The driver's tick loop on correctness bits; `correct` is asked only for t <= N - 2 with
    every in-flight token correct (otherwise the draft is never verified and its value is moot).
    on_verify(fill, t, accepted): every verified draft, made at fill `fill` for index t + 1;
    on_plan(plan): every tick's plan, before its draft (token ids: 1 right, 0 wrong)."""
    if N < 1 or n < 1:
        raise ValueError(f"need N >= 1 generated tokens and n >= 1 stages, got N={N}, n={n}")
    acc = Acceptance(n=n, tokens=N)
    if N == 1:  # the prefill token ended the request (EOS or max_new_tokens == 1): no decode tick
        return acc
    state = TickState(n, 0, _RIGHT, counters=acc)  # positions are token indices: y[0] is the first token
    while state.committed < N:  # the reference stopped at N tokens (EOS or max_new_tokens)
        plan = state.plan()
        if on_plan is not None:
            on_plan(plan)
        t = plan.draft_pos - 1  # index of the newest live token
        chain_ok = all(e.token == _RIGHT for e in plan.inflight)
        ok = chain_ok and t + 1 <= N - 1 and correct(plan.fill, t)
        verdict = None
        if plan.exit is not None:
            assert plan.exit.token == _RIGHT, "the token leaving the pipeline is committed"
            proposed_ok = plan.proposed.token == _RIGHT if plan.proposed is not None else ok
            verdict = Verdict(proposed_ok, _RIGHT)  # the target's token: the draft or the correction
            if on_verify is not None:
                made = plan.proposed if plan.proposed is not None else None
                fill, index = (made.fill, made.pos - 1) if made is not None else (plan.fill, t)
                on_verify(fill, index, proposed_ok)
        state.advance([Draft(plan.draft_pos, _RIGHT if ok else _WRONG)], verdict)
    return state.finish()  # acc, counted into by the tick protocol


@torch.no_grad()
def teacher_anchors(target: StageModel, pdm: PDM, prompt: Sequence[int], y: Sequence[int]) -> torch.Tensor:
    """The anchors [1, S, m, H] (S = P + N - 1, the PDM's dtype) of one target pass over prompt + y[:-1]."""
    device = next(target.parameters()).device
    tokens = torch.tensor([*prompt, *y[:-1]], dtype=torch.long, device=device)[None]  # [1, S]
    anchors, _ = target_anchors(target, pdm.plan, tokens)  # [1, S, m, H]
    return anchors.to(next(pdm.parameters()).dtype)


@torch.no_grad()
def draft_table(target: StageModel, pdm: PDM, prompt: Sequence[int], y: Sequence[int],
                anchors: torch.Tensor | None = None) -> DraftTable:
    """One target pass over prompt + y[:-1] (or its `anchors`), then the pipeline simulation at every fill."""
    n, P, N = pdm.plan.n, len(prompt), len(y)
    device = next(target.parameters()).device
    if anchors is None:
        anchors = teacher_anchors(target, pdm, prompt, y)
    drafts = torch.zeros(n, N - 1, dtype=torch.long, device=device)
    margins = torch.full((n, N - 1), float("inf"), device=device)
    k = min(4, pdm.draft_ids.numel())
    tops = torch.zeros(n, N - 1, k, dtype=torch.long, device=device)
    for f in range(1, n + 1):
        h = simulated_hidden(pdm, anchors, f)[0, P:]  # [N-1, H]: newest token y[t] at position P + t
        top = pdm.draft_logits(h).topk(k, dim=-1)  # values/indices [N-1, k]
        tops[f - 1] = pdm.draft_ids[top.indices]
        drafts[f - 1] = tops[f - 1, :, 0]
        if k >= 2:
            margins[f - 1] = top.values[:, 0] - top.values[:, 1]
    return DraftTable(drafts.cpu(), margins.float().cpu(), tops.cpu())


def suffix_table(chooser: DraftChooser, prompt: Sequence[int], y: Sequence[int], n: int,
                 cross: CrossRequestHistory | None = None) -> list[list[SuffixProposal | None]]:
    """[f - 1][t]: the suffix proposal the driver sees at a tick with fill f whose newest token is
    y[t] and every in-flight token correct: committed history = prompt + y[:t - f + 2], context =
    prompt + y[:t + 1] (the same SuffixIndex calls as the runtime's); `cross`: the earlier
    requests' history, consulted when the request's own has no match, as the driver does."""
    N, P = len(y), len(prompt)
    out: list[list[SuffixProposal | None]] = []
    for f in range(1, n + 1):
        index = chooser.new_index(prompt)
        row: list[SuffixProposal | None] = []
        keep = max(chooser.suffix.max_len, f)
        for t in range(N - 1):
            if t - f + 1 < 0:  # fill f needs f live tokens y[t-f+1..t]
                row.append(None)
                continue
            index.extend(y[len(index.history) - P:t - f + 2])
            context = [*prompt[max(0, P - keep):], *y[:t + 1]][-keep:]
            own = index.propose(context, P + t + 1)
            row.append(own if own is not None or cross is None else cross.propose(context))
        out.append(row)
    return out


@dataclass
class FastRun:
    tokens: list[int]  # the greedy reference output = what SPD commits at T=0
    acceptance: Acceptance
    table: DraftTable | None  # None when the request ended with the prefill token
    consulted: frozenset[tuple[int, int]]  # (fill, t) of the drafts whose correctness was asked
    stage_tokens: int = 0  # with suffix runs (train/run_replay.py): tokens carried by stage steps ...
    stage_slots: int = 0  # ... and live entries, summed over ticks

    def near_ties(self, tol: float = 1e-4) -> int:
        """Consulted drafts whose top-2 draft logits are within `tol`: where the runtime's other
        shapes (last-bit differences) could flip the argmax. Counted, not hidden."""
        if self.table is None:
            return 0
        return sum(1 for f, t in self.consulted if float(self.table.margins[f - 1, t]) < tol)


@torch.no_grad()
def fast_generate(target: StageModel, pdm: PDM, prompt: Sequence[int], max_new_tokens: int,
                  eos_ids: Sequence[int] = (), chunk: int = DEFAULT_PREFILL_CHUNK,
                  draft_policy: DraftPolicy | None = None, reference: Sequence[int] | None = None,
                  chooser: DraftChooser = DraftChooser(), cross: CrossRequestHistory | None = None) -> FastRun:
    """SPD's T=0 counters for one request, from one greedy decode and one teacher-forced pass.

    `chunk` is the prefill chunk of the runtime being modelled (the reference decode then runs
    the same shapes as the pipelined prefill, so its first token is bit-identical). `reference`:
    that greedy output when already known (train/reference_cache.py). `chooser`: the draft
    sources, as the driver runs them (the PDM only by default); with suffix runs the replay is
    train/run_replay.py's.
    """
    y = list(reference) if reference is not None else \
        greedy_generate(target, prompt, max_new_tokens, eos_ids=eos_ids, chunk=chunk)
    N, P = len(y), len(prompt)
    if N == 1:
        return FastRun(y, replay(1, pdm.plan.n, lambda f, t: False), None, frozenset())
    if chooser.uses_suffix and chooser.suffix.max_run > 1 and draft_policy is None:  # as the driver: a
        anchors = teacher_anchors(target, pdm, prompt, y)  # draft policy sends one token per entry
        table = draft_table(target, pdm, prompt, y, anchors)
        run = replay_runs(Acceptance(n=pdm.plan.n, tokens=N), table, pdm, anchors, y, prompt, chooser,
                          max_new_tokens, cross)
        return FastRun(y, run.acceptance, table, frozenset(run.consulted), run.stage_tokens, run.stage_slots)
    table = draft_table(target, pdm, prompt, y)
    return replay_table(table, y, P, pdm.plan.n, chooser, draft_policy, prompt, cross)


def replay_table(table: DraftTable, y: Sequence[int], P: int, n: int, chooser: DraftChooser = DraftChooser(),
                 draft_policy: DraftPolicy | None = None, prompt: Sequence[int] = (),
                 cross: CrossRequestHistory | None = None) -> FastRun:
    """The replay of one request from its draft table (one table serves many choosers)."""
    N = len(y)
    drafts, margins = table.drafts.tolist(), table.margins.tolist()
    proposals = suffix_table(chooser, prompt, y, n, cross) if chooser.uses_suffix else None
    consulted: set[tuple[int, int]] = set()
    source: dict[tuple[int, int], str] = {}

    def correct(f: int, t: int) -> bool:
        consulted.add((f, t))
        d, source[(f, t)] = chooser.choose(drafts[f - 1][t], margins[f - 1][t],
                                           proposals[f - 1][t] if proposals is not None else None)
        if draft_policy is not None:
            d = draft_policy(P + t + 1, d)
        return d == y[t + 1]

    acc_sources: list[tuple[str, bool]] = []
    acc = replay(N, n, correct, lambda f, t, ok: acc_sources.append((source[(f, t)], ok)))
    for src, ok in acc_sources:
        va = acc.by_source.setdefault(src, [0, 0])
        va[0] += 1
        va[1] += int(ok)
    return FastRun(list(y), acc, table, frozenset(consulted))
