"""The SPD tick protocol as one pure state machine (docs/design.md 3.3, 3.4). No torch.

Every user of the tick arithmetic drives the same two calls: `TickState.plan()` says what this
tick does (which token enters stage 0, which anchor messages the PDM rows need, which rows
the PDM runs over, which token leaves the last stage and what it verifies), and
`TickState.advance(drafts, verdict)` applies what the tick produced (the draft for the next
position; the verification's verdict when a token left the pipeline). The runtime driver
(engine/runtime/driver.py), the printable schedule (engine/protocol/schedule.py), the exact T=0 replay
(train/fast_eval.py), the distributed tick replay (bench/tick_replay.py) and the cost
model's simulation (costmodel/cost_model_spd.py) all run this loop; only what a token *is*
differs (a real id, a correctness bit, a timestamp).

Tokens are `Entry`s: position, token id, the epoch they were sent with, the fill of the tick
that drafted them (0 for the first token and for corrections, which are never verified as
drafts) and the tick at which they entered stage 0. `drafts` is a sequence: one draft, or a
branch point's candidates (3.11). A draft may carry a run: the tokens that follow it in a suffix
match, which travel with it as one entry of consecutive positions (a suffix run, 3.13); the
exiting entry's logits then verify its own run first, and one tick can commit several tokens.

The records are named tuples: the driver builds a plan, entries and rows on every tick, between
two computes, where a frozen dataclass's per-field setattr costs (docs/results/tick-cost-2core.md, "Cold caches").
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from spd_engine.engine.protocol.metrics import Counters


class Entry(NamedTuple):
    """A token that enters stage 0 (and is in flight until it leaves the last stage)."""

    pos: int
    token: int
    epoch: int
    fill: int  # fill of the tick that drafted it; 0: the first token or a correction
    tick: int  # decode tick at which it enters stage 0 (1-based)
    chains: tuple[int, ...] = ()  # the branch's chains' tokens at pos, one message row each; () one token
    row: int = 0  # the representative chain's row in the message (the survivor's once resolved)
    branch: int = -1  # the branch point's position (chains, and the message naming the survivor); -1 none
    survivor: int = -1  # on the first message after a branch point resolved: the surviving row
    run: tuple[int, ...] = ()  # a suffix run: the tokens at pos + 1, pos + 2, ... carried with `token` (3.13)

    @property
    def rows(self) -> int:
        """Token rows of the message this entry travels in."""
        return max(1, len(self.chains)) + len(self.run)

    @property
    def end(self) -> int:
        """The last position this entry carries."""
        return self.pos + len(self.run)

    @property
    def tokens(self) -> tuple[int, ...]:
        """The ids at pos, pos + 1, ..., end."""
        return (self.token, *self.run)


class Draft(NamedTuple):
    """A candidate for position `pos` made by the tick's drafting (`source`: pdm, policy, ...)."""

    pos: int
    token: int
    source: str = "pdm"
    run: tuple[int, ...] = ()  # tokens for pos + 1, pos + 2, ... that travel with it (a suffix run, 3.13)


class Verdict(NamedTuple):
    """The verification of the token proposed behind the exiting one: `token` is what is committed
    (the draft when accepted, else the correction)."""

    accepted: bool
    token: int
    chain: int = 0  # a branch point's verdict: the index of the accepted candidate (its chain survives)
    run: int = 0  # of the exiting entry's run, the tokens accepted; fewer than it carries: `token` is the
    # correction at the first rejected one, `accepted` is False and the token behind was never verified


class Row(NamedTuple):
    """One PDM input row: position `pos` aggregated at `depth` (n: full depth); `pending`: the
    full-depth row that stays in the PDM cache after this tick."""

    pos: int
    depth: int
    pending: bool = False


class TickPlan(NamedTuple):
    tick: int
    enter: tuple[Entry, ...]  # tokens entering stage 0 this tick (one today)
    inflight: tuple[Entry, ...]  # live tokens after the entry, oldest first; index j from the end = lag j
    anchor_reads: tuple[tuple[int, Entry], ...]  # (stage, token): anchors produced last tick that rows need
    rows: tuple[Row, ...]  # pending full-depth row first, then the staircase oldest -> newest
    pdm_pos: int  # PDM position of rows[0] (the PDM cache holds positions < pdm_pos)
    draft_pos: int  # the position this tick's draft is for (the newest live entry's end + 1)
    exit: Entry | None  # the live token leaving the last stage this tick, if any
    proposed: Entry | None  # the draft behind it that its logits verify (None: this tick's own draft, n = 1)
    branch: int | None = None  # the unresolved branch point in flight (its chains draft one token each)
    width: int = 1  # chains of that branch point

    def chain_tokens(self, chain: int) -> list[int]:
        """The in-flight tokens of one chain, oldest first (the representative's for chain 0)."""
        return [e.chains[chain] if self.branch is not None and e.pos >= self.branch else e.token
                for e in self.inflight]

    @property
    def fill(self) -> int:
        """Live tokens in the pipeline this tick (n when full)."""
        return len(self.inflight)

    @property
    def verify_pos(self) -> int | None:
        """The position of the draft behind the exiting entry (after its run, if it carries one)."""
        return None if self.exit is None else self.exit.end + 1


class TickState:
    """One request's decode loop on `n` stages, from the first generated token at position P.

    `anchor_stages`: the stages whose messages carry anchors the PDM reads (the last stage's
    exit message is read when its token leaves, never as an anchor read).
    """

    def __init__(self, n: int, first_pos: int, first_token: int, anchor_stages: Iterable[int] = (),
                 epoch: int = 0, counters: Counters | None = None) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self.anchor_stages = frozenset(s for s in anchor_stages if 0 <= s < n - 1)
        self.epoch = epoch
        self.tick = 0
        self.inflight: deque[Entry] = deque()
        self.entry = Entry(first_pos, first_token, epoch, 0, 1)
        self.pdm_len = first_pos  # the PDM cache holds full-depth rows of positions < pdm_len
        self.pending = 0  # full-depth rows of positions pdm_len, pdm_len + 1, ... that join this tick's rows
        self.rejected_last = False
        self.committed = 1  # tokens committed, the first (prefill) token included
        self.branch: int | None = None  # the unresolved branch point in flight
        self.width = 1  # its chains
        self.counts = counters if counters is not None else Counters()  # counted into, not copied
        self._plan: TickPlan | None = None

    def plan(self) -> TickPlan:
        """What the coming tick does; call once per tick, then `advance`."""
        assert self._plan is None, "plan() twice without advance()"
        self.tick += 1
        self.counts.ticks += 1
        entry = self.entry
        assert entry.tick == self.tick and entry.epoch == self.epoch, (entry, self.tick, self.epoch)
        self.inflight.append(entry)
        live = tuple(self.inflight)
        L = len(live)
        # the token at lag j (0 = newest) finished stage j-1 last tick: its anchors are read now
        reads = tuple([(j - 1, live[L - 1 - j]) for j in range(1, L) if j - 1 in self.anchor_stages])
        rows = [Row(self.pdm_len + i, self.n, True) for i in range(self.pending)]
        for e, j in zip(live, range(L - 1, -1, -1)):  # the staircase, oldest (lag L - 1) first
            rows.extend(Row(p, j) for p in range(e.pos, e.end + 1))  # a run's positions share its depth
        # consecutive positions from the PDM cache end (the driver indexes its ring by that)
        assert rows[0].pos == self.pdm_len and all(b.pos == a.pos + 1 for a, b in zip(rows, rows[1:])), rows
        exiting = live[0] if L == self.n else None
        proposed = (live[1] if L > 1 else None) if exiting is not None else None
        self._plan = TickPlan(self.tick, (entry,), live, reads, tuple(rows), self.pdm_len,
                              live[-1].end + 1, exiting, proposed, self.branch, self.width)
        return self._plan

    def advance(self, drafts: Sequence[Draft], verdict: Verdict | None = None) -> Entry | None:
        """Apply the tick's drafts (for plan.draft_pos: one; several candidates to start a branch
        point; one per chain while one is in flight) and, when a token left the pipeline, the
        verdict on the token behind it. Returns the committed token (None while filling)."""
        plan, self._plan = self._plan, None
        assert plan is not None, "advance() without plan()"
        draft = self._draft_entry(plan, drafts)
        self.pdm_len += self.pending  # crop back: only the pending full-depth rows stay
        self.pending = 0
        if plan.exit is None:
            assert verdict is None, "no token left the pipeline: nothing to verify"
            self.entry = draft
            return None
        assert verdict is not None, f"tick {plan.tick}: token at {plan.exit.pos} left, a verdict is due"
        self.inflight.popleft()
        if plan.exit.run:
            assert 0 <= verdict.run <= len(plan.exit.run), (verdict, plan.exit)
            self.counts.count(plan.exit.fill, True, verdict.run)
            if verdict.run < len(plan.exit.run):
                return self._reject_in_run(plan.exit, verdict)
        else:
            assert verdict.run == 0, (verdict, plan.exit)
        proposed = plan.proposed if plan.proposed is not None else draft
        at_branch = proposed.pos == self.branch
        assert not verdict.accepted or verdict.token == (proposed.chains[verdict.chain] if at_branch
                                                        else proposed.token), (verdict, proposed)
        if self.rejected_last:
            self.counts.rejections += 1
        self.counts.count(proposed.fill, verdict.accepted)
        if at_branch:
            self.counts.branch_points += 1
            self.counts.branch_saves += int(verdict.accepted and verdict.chain > 0)
        self.committed += 1 + verdict.run
        self.pending = 1 + verdict.run  # the exiting entry's full-depth rows reach the PDM next tick
        self.rejected_last = not verdict.accepted
        if verdict.accepted:
            if at_branch:
                proposed, draft = self._resolve(proposed, draft, verdict.chain)
            # n = 1: the tick's own draft was just verified; it enters as a committed token
            self.entry = draft if self.inflight else draft._replace(fill=0, chains=(), row=0, branch=-1, survivor=-1,
                                                                     run=())
            committed = proposed._replace(run=())
        else:
            committed = self._flush(proposed.pos, verdict.token)
        if verdict.run:  # the run's accepted tokens are committed before it
            committed = Entry(plan.exit.pos + 1, plan.exit.run[0], committed.epoch, committed.fill, committed.tick,
                              run=(*plan.exit.run[1:verdict.run], committed.token))
        return committed

    def _flush(self, pos: int, correction: int) -> Entry:
        """A rejection: everything in flight is stale; the correction at `pos` enters stage 0 next tick."""
        self.epoch += 1
        self.inflight.clear()
        self.branch, self.width = None, 1
        self.entry = Entry(pos, correction, self.epoch, 0, self.tick + 1)
        return self.entry

    def _reject_in_run(self, exiting: Entry, verdict: Verdict) -> Entry:
        """The exiting entry's run was rejected at its token verdict.run: the tokens before it and the
        correction are committed (one entry: pos, then run), the rest of the run and everything behind flush."""
        k = verdict.run
        assert not verdict.accepted and exiting.chains == (), (verdict, exiting)
        if self.rejected_last:
            self.counts.rejections += 1
        self.counts.count(exiting.fill, False)
        self.committed += k + 1
        self.pending = 1 + k  # the entry's token and its accepted run tokens are full depth
        self.rejected_last = True
        correction = self._flush(exiting.pos + 1 + k, verdict.token)
        if k == 0:
            return correction
        return Entry(exiting.pos + 1, exiting.run[0], self.epoch, 0, self.tick + 1,
                     run=(*exiting.run[1:k], verdict.token))

    def _draft_entry(self, plan: TickPlan, drafts: Sequence[Draft]) -> Entry:
        """The entry of this tick's drafts: one token, a new branch point's candidates, or the chains' drafts."""
        if self.branch is None and len(drafts) == 1:  # the common tick: one draft, no branch point
            assert drafts[0].pos == plan.draft_pos, (drafts, plan.draft_pos)
            return Entry(plan.draft_pos, drafts[0].token, self.epoch, plan.fill, self.tick + 1, run=drafts[0].run)
        assert drafts and all(d.pos == plan.draft_pos and not d.run for d in drafts), (drafts, plan.draft_pos)
        tokens = tuple(d.token for d in drafts)
        if self.branch is None:  # candidates: the position becomes the branch point
            assert len(set(tokens)) == len(tokens), f"branch candidates repeat a token: {tokens}"
            self.branch, self.width = plan.draft_pos, len(tokens)
        assert len(tokens) == self.width, f"{len(tokens)} drafts for {self.width} chains"
        return Entry(plan.draft_pos, tokens[0], self.epoch, plan.fill, self.tick + 1, tokens, 0, self.branch)

    def _resolve(self, proposed: Entry, draft: Entry, k: int) -> tuple[Entry, Entry]:
        """The branch point was accepted with candidate k: its chain is the representative now.
        Returns the committed entry and the next entering one (which names the survivor)."""
        q = self.branch
        self.branch, self.width = None, 1
        self.inflight = deque(e._replace(token=e.chains[k], row=k) if e.chains else e for e in self.inflight)
        committed = proposed._replace(token=proposed.chains[k], row=k)
        if draft.chains:  # n >= 2: the survivor's draft enters alone and names the survivor
            draft = draft._replace(token=draft.chains[k], chains=(), row=0, branch=q, survivor=k)
        return committed, draft

    def finish(self) -> Counters:
        """The request's counters; a correction that ended the run costs no refill."""
        assert self._plan is None
        return self.counts
