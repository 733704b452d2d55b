"""Several requests in one pipeline, simulated tick by tick (docs/design.md 3.12). Pure logic, no torch.

Each request plays its own tick protocol (engine/protocol/tick.py TickState) with scripted
accept/reject verdicts; engine/protocol/batch_policy.py decides per tick who enters stage 0. This
adds what each stage step carries (a token entering stage 0 at tick t is at stage p at tick t + p:
every request's rows, stale ones included, and newcomers' prompt chunks), the stage utilization
(the share of stage-ticks doing useful work, per stage and overall) and the table of the worked
example. Positions are offsets from each request's own P (its first generated token x_P); a prompt
is at offsets < 0. The cost model's replay of several requests (costmodel/cost_batch.py) runs this.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spd_engine.engine.protocol.batch_policy import BATCH, LATENCY_CLASSES, BatchLimits, RequestView, RowPlan, plan_rows
from spd_engine.engine.protocol.schedule import CORRECTION, DRAFT, FIRST, STALE, Token, Verification, position_label, token_label
from spd_engine.engine.protocol.tick import Draft, Entry, TickState, Verdict

PROMPT = "prompt"  # a Token kind here: a prompt chunk (position: its first offset, always < 0)
_FIRST_ID, _DRAFT_ID, _CORRECTION_ID = 0, 1, 2  # token ids that stand for the kinds in the state machine
_KINDS = {_FIRST_ID: FIRST, _DRAFT_ID: DRAFT, _CORRECTION_ID: CORRECTION}


@dataclass(frozen=True)
class RequestScript:
    """One simulated request: its class, when it arrives, its prompt and its verdicts."""

    name: str
    verdicts: tuple[bool, ...]  # accept / reject of each verification, in order
    latency: str = BATCH
    priority: int = 0
    arrival_tick: int = 1  # the tick from which it may be live (a slot of max_batch permitting)
    prompt: int = 0  # prompt tokens sent through the stages first (0: x_P known on arrival)
    tokens: int | None = None  # tokens to commit, x_P included (default: one per verdict, plus x_P)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must be non-empty")
        if self.latency not in LATENCY_CLASSES:
            raise ValueError(f"latency must be one of {LATENCY_CLASSES}, got {self.latency!r}")
        if self.arrival_tick < 1 or self.prompt < 0:
            raise ValueError(f"request {self.name}: arrival_tick must be >= 1 and prompt >= 0, "
                             f"got {self.arrival_tick} and {self.prompt}")
        if self.tokens is not None and not 1 <= self.tokens <= 1 + len(self.verdicts):
            raise ValueError(f"request {self.name}: tokens must be in 1..{1 + len(self.verdicts)} "
                             f"(one verdict per token after x_P), got {self.tokens}")

    @property
    def goal(self) -> int:
        return 1 + len(self.verdicts) if self.tokens is None else self.tokens


@dataclass(frozen=True)
class StageRow:
    """A request's rows in one stage step: a token (one row) or a prompt chunk (`rows` tokens)."""

    request: str
    token: Token  # kind STALE: flushed, or its request has finished (computed, never used)
    rows: int = 1

    @property
    def live(self) -> bool:
        return self.token.kind != STALE


@dataclass(frozen=True)
class Outcome:
    """What a tick did for one request: its verification and the token it committed (x_P when its
    prefill's last chunk left the pipeline)."""

    request: str
    verify: Verification | None = None
    committed: Token | None = None


@dataclass(frozen=True)
class BatchTick:
    tick: int
    stages: tuple[tuple[StageRow, ...], ...]  # stage p: the rows it computes this tick, in arrival order
    plan: RowPlan  # the policy's decision (request ids: indexes into the scripts)
    outcomes: tuple[Outcome, ...]  # requests that verified or committed this tick


@dataclass(frozen=True)
class RequestRecord:
    """One request's life in global ticks (0: not reached)."""

    name: str
    latency: str
    live_tick: int  # it took a slot of max_batch
    first_token_tick: int  # x_P known (end of that tick)
    first_entry_tick: int  # x_P entered stage 0
    done_tick: int  # its last token committed
    tokens: int  # committed, x_P included
    own_ticks: int  # ticks it entered a token (its own tick protocol's ticks)


@dataclass(frozen=True)
class BatchRun:
    n: int
    limits: BatchLimits
    scripts: tuple[RequestScript, ...]
    ticks: tuple[BatchTick, ...]
    requests: tuple[RequestRecord, ...]


@dataclass
class _Req:
    script: RequestScript
    rid: int
    state: TickState | None = None
    used: int = 0  # verdicts used
    sent: int = 0  # prompt tokens sent
    live_tick: int = 0
    prompt_done: int = 0  # tick its last prompt chunk entered
    first_token_tick: int = 0
    first_entry_tick: int = 0
    done_tick: int = 0

    def view(self) -> RequestView:
        s = self.script
        return RequestView(self.rid, self.rid, s.latency, s.priority,
                           len(self.state.inflight) if self.state is not None else 0, 1, s.prompt - self.sent,
                           self.state is not None)


def simulate_batch(n: int, scripts: Sequence[RequestScript], limits: BatchLimits,
                   max_ticks: int = 1_000_000) -> BatchRun:
    """Play every request to its last token under the policy. Requests take a slot of
    `limits.max_batch` in the order given (their arrival order) from their arrival tick, and give
    it back the tick after their last commit; their tokens still in flight are then stale."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not scripts or len({s.name for s in scripts}) != len(scripts):
        raise ValueError("scripts: at least one request, names unique")
    reqs = [_Req(s, i) for i, s in enumerate(scripts)]
    entered: list[list[tuple[_Req, Entry | tuple[int, int]]]] = [[]]  # entered[t]: what entered stage 0 at tick t
    live: list[_Req] = []
    ticks: list[BatchTick] = []
    t = 0
    while any(r.done_tick == 0 for r in reqs):
        t += 1
        if t > max_ticks:
            raise ValueError(f"no end after {max_ticks} ticks")
        live = [r for r in live if r.done_tick == 0]
        for r in reqs:  # join in arrival order while a slot is free
            if not r.live_tick and r.script.arrival_tick <= t and len(live) < limits.max_batch:
                r.live_tick = t
                live.append(r)
                if r.script.prompt == 0:
                    _first_token(r, n, t - 1)  # x_P known before the first tick it may enter
        # a request done before this tick (one that has nothing to decode) holds its slot, never a row
        plan = plan_rows([r.view() for r in live if not r.done_tick], limits)
        by_id = {r.rid: r for r in live}
        now: list[tuple[_Req, Entry | tuple[int, int]]] = []
        tick_plans = {}
        for rid in plan.enter:
            r = by_id[rid]
            tick_plans[rid] = r.state.plan()
            r.first_entry_tick = r.first_entry_tick or t
            now.append((r, tick_plans[rid].enter[0]))
        for rid, k in plan.prefill:
            r = by_id[rid]
            now.append((r, (r.sent - r.script.prompt, k)))  # (first offset, tokens): the prompt is at offsets < 0
            r.sent += k
            if r.sent == r.script.prompt:
                r.prompt_done = t
        entered.append(sorted(now, key=lambda x: x[0].rid))
        stages = tuple(tuple(_stage_row(r, e, t) for r, e in entered[t - p]) if t - p >= 1 else ()
                       for p in range(n))
        outcomes = []
        for rid, tp in tick_plans.items():
            outcomes.extend(_advance(by_id[rid], tp, t))
        for r in live:  # the last prompt chunk leaves the last stage: x_P from its logits
            if r.prompt_done and r.state is None and r.prompt_done + n - 1 == t:
                outcomes.extend(_first_token(r, n, t))
        ticks.append(BatchTick(t, stages, plan, tuple(sorted(outcomes, key=lambda o: o.request))))
    records = tuple(RequestRecord(r.script.name, r.script.latency, r.live_tick, r.first_token_tick,
                                  r.first_entry_tick, r.done_tick, r.state.committed, r.state.counts.ticks)
                    for r in reqs)
    return BatchRun(n, limits, tuple(scripts), tuple(ticks), records)


def _first_token(r: _Req, n: int, t: int) -> list[Outcome]:
    r.state = TickState(n, 0, _FIRST_ID)
    r.first_token_tick = t
    if r.script.goal == 1:  # nothing to decode: the request ends with its prefill token
        r.done_tick = max(t, 1)
    return [Outcome(r.script.name, None, Token(0, FIRST, 0))] if t >= 1 else []


def _token(e: Entry, live: bool) -> Token:
    return Token(e.pos, _KINDS[e.token] if live else STALE, e.epoch)


def _stage_row(r: _Req, e: Entry | tuple[int, int], t: int) -> StageRow:
    if not isinstance(e, Entry):  # a prompt chunk (first offset, tokens): always useful work
        return StageRow(r.script.name, Token(e[0], PROMPT, 0), e[1])
    # stale: flushed since it entered, or its request already ended (ends at the tick of its last commit)
    live = e.epoch == r.state.epoch and not (r.done_tick and r.done_tick < t)
    return StageRow(r.script.name, _token(e, live))


def _advance(r: _Req, tp, t: int) -> list[Outcome]:
    state = r.state
    draft = Token(tp.draft_pos, DRAFT, state.epoch)
    verdict = verify = None
    if tp.exit is not None:
        accepted = bool(r.script.verdicts[r.used])
        r.used += 1
        verdict = Verdict(accepted, _DRAFT_ID if accepted else _CORRECTION_ID)
        behind = _token(tp.proposed, True) if tp.proposed is not None else draft
        verify = Verification(_token(tp.exit, True), behind, accepted)
    committed = state.advance([Draft(tp.draft_pos, _DRAFT_ID)], verdict)
    if committed is not None and state.committed == r.script.goal:
        r.done_tick = t
    return [] if verify is None else [Outcome(r.script.name, verify, _token(committed, True))]


# ---- stage utilization ----

@dataclass(frozen=True)
class Utilization:
    """Stage utilization over `ticks` ticks: a stage-tick is useful when it computes at least one
    live row (a live token of some request, or a prompt chunk); idle and stale-only steps are not."""

    ticks: int
    useful: tuple[int, ...]  # per stage: useful stage-ticks
    rows: tuple[int, ...]  # per stage: rows computed, stale ones included (a prompt chunk: its tokens)
    live_rows: tuple[int, ...]  # per stage: of them, live
    steps: tuple[int, ...]  # per stage: busy stage steps (any row)

    @property
    def per_stage(self) -> tuple[float, ...]:
        return tuple(u / self.ticks for u in self.useful)

    @property
    def overall(self) -> float:
        """Useful stage-ticks over all stage-ticks (n per tick)."""
        return sum(self.useful) / (len(self.useful) * self.ticks)

    @property
    def rows_per_step(self) -> float:
        """Rows per busy stage step (any row, stale ones included), over every stage."""
        return sum(self.rows) / sum(self.steps) if sum(self.steps) else 0.0


def utilization(run: BatchRun, first: int = 1, last: int | None = None) -> Utilization:
    """Stage utilization of ticks first..last (default: the whole run)."""
    last = len(run.ticks) if last is None else last
    if not 1 <= first <= last <= len(run.ticks):
        raise ValueError(f"ticks {first}..{last} are not inside the run's 1..{len(run.ticks)}")
    window = run.ticks[first - 1:last]
    n = run.n
    useful = tuple(sum(any(row.live for row in bt.stages[p]) for bt in window) for p in range(n))
    rows = tuple(sum(row.rows for bt in window for row in bt.stages[p]) for p in range(n))
    live = tuple(sum(row.rows for bt in window for row in bt.stages[p] if row.live) for p in range(n))
    steps = tuple(sum(bool(bt.stages[p]) for bt in window) for p in range(n))
    return Utilization(len(window), useful, rows, live, steps)


# ---- the table of docs/design.md 3.12 ----

def label(row: StageRow | None) -> str:
    """A stage row as the tables of docs/design.md write it (3.3's labels; '-' no row)."""
    if row is None:
        return "-"
    t = row.token
    if t.kind == STALE:
        return "(stale)"
    if t.kind == PROMPT:
        return f"prompt {position_label(t.position)}..{position_label(t.position + row.rows - 1)}"
    return token_label(t)


def _outcome_cell(o: Outcome | None) -> str:
    if o is None:
        return ""
    if o.verify is None:
        return f"{label(StageRow(o.request, o.committed))} from the prefill"
    if o.verify.accepted:
        return f"accept: emit {position_label(o.verify.draft.position)}"
    return f"reject: emit {label(StageRow(o.request, o.committed))}, flush"


def format_batch(run: BatchRun) -> str:
    """A Markdown table: per tick each stage's rows (one slot per request, in arrival order, '-'
    none), the rows entering stage 0, and what each request's verification did."""
    names = [s.name for s in run.scripts]
    who = " / ".join(names)
    lines = ["| tick | " + " | ".join(f"S{p} ({who})" for p in range(run.n)) + " | rows | "
             + " | ".join(f"{s.name} ({s.latency})" for s in run.scripts) + " |",
             "|---" * (run.n + 2 + len(names)) + "|"]
    for bt in run.ticks:
        cells = [str(bt.tick)]
        for rows in bt.stages:
            by = {r.request: r for r in rows}
            cells.append(" / ".join(label(by.get(name)) for name in names))
        cells.append(str(bt.plan.rows + bt.plan.prefill_tokens))
        outs = {o.request: o for o in bt.outcomes}
        cells += [_outcome_cell(outs.get(name)) for name in names]
        lines.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
    return "\n".join(lines)


def format_utilization(u: Utilization) -> str:
    """'S0 10/10, S1 9/10, ...; overall 34/40 = 0.85'."""
    stages = ", ".join(f"S{p} {k}/{u.ticks}" for p, k in enumerate(u.useful))
    total = len(u.useful) * u.ticks
    return f"{stages}; overall {sum(u.useful)}/{total} = {u.overall:.2f}"
