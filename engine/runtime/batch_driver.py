"""Several requests in the pipeline at once (docs/design.md 3.12): the driver's tick loop over up to
B live requests, each in a request slot with its own tick protocol, drafts, PDM cache, anchor
ring, verification and counters, sharing the stages.

Every tick, each decoding request's entry travels in one BATCH message (one row per token:
engine/protocol/messages.py; a suffix run's tokens, 3.13, as consecutive rows verified as alone by
Lane.verify_exit), so every stage step carries the rows of every request that has an entry there,
stale rows of flushed requests included; a rejection flushes only its own request (its epoch), and
the other requests' rows keep the stages busy. A request joins when a slot is free and its arrival
tick has come: its prompt goes through the same stages in PREFILL chunks, one chunk per tick,
between the BATCH messages, so a newcomer's prefill never stalls the others for more than a chunk;
it decodes from the tick after its first token is known, and leaves at its end, freeing the slot.
The stages report in the order the driver sent; reports are read in that order and each row lands in
its request's ring (stale rows are dropped by (serial, epoch); engine/runtime/batch_links.py).

Who enters stage 0 each tick is engine/protocol/batch_policy.py's `plan_rows` over the live
requests (`max_rows` decode rows per stage step, latency-critical requests first): a request with
live tokens in flight enters every tick; one whose pipeline holds none of its live tokens (its
first token or a correction waits) may be held back a tick, which for it is a tick that did not
happen (its tick protocol does not advance). Newcomers' prompts go one chunk per tick, in the
policy's order. With `max_rows` = B W (the default) every decoding request enters every tick.

The PDM runs once per tick over every decoding request's rows, each request's rows on its own PDM
cache (engine/model/kv_cache.py RowCaches); the drafts and verifications are per request.

Branch width W (docs/design.md 3.11) works per request as alone: a request's branch point puts its
W chains' tokens in the BATCH message as W rows (the table names the branch point, each row's
chain, and on the row after it resolves the survivor), which each stage writes to that request's
chain slots; the request's rows of the PDM pass are every chain's (BranchChains.chain_inputs)
under their tree mask; its chains' anchors land in its rings[c] and its exit rows per chain.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from spd_engine.engine.model.kv_cache import RowCaches
from spd_engine.engine.protocol.batch_policy import BATCH, LATENCY_CLASSES, BatchLimits, plan_rows
from spd_engine.engine.protocol.batch_schedule import Utilization
from spd_engine.engine.protocol.messages import META_FIELDS, Header, Kind
from spd_engine.engine.protocol.metrics import GenerationResult
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.protocol.tick import Entry, TickPlan
from spd_engine.engine.runtime.batch_links import BatchLinks
from spd_engine.engine.runtime.request_slot import LiveRequest, SlotParts
from spd_engine.engine.runtime.request_state import DraftPolicy, OnToken
from spd_engine.engine.runtime.stage_worker import receive_stats

_EPOCH, _POS, _TOKEN, _REPLY, _CHAIN = (META_FIELDS.index(f) for f in ("epoch", "position", "token", "reply", "chain"))


@dataclass
class BatchRequest:
    """One request of a run of several: what `Driver.generate` takes, and the tick from which it may join."""

    prompt: Sequence[int]
    max_new_tokens: int
    eos_ids: Sequence[int] = ()
    sampling: SamplingParams = SamplingParams()
    arrival_tick: int = 1
    draft_policy: DraftPolicy | None = None
    on_token: OnToken | None = None
    latency: str = BATCH  # batch_policy.CRITICAL: keeps its single-stream schedule (docs/design.md 3.12)
    priority: int = 0  # among batch-class requests: higher enters first
    top_logprobs: int = -1  # >= 0: each token's log-probability and this many alternatives (Driver.generate)
    trace: list[tuple[int, str, float, float]] | None = None  # its ticks' (tick, what, t0, t1), when traced


@dataclass
class BatchResult:
    """A run of several requests: each request's result (in the order given), and the run's."""

    results: list[GenerationResult]
    ticks: int
    wall_s: float
    rows: list[int]  # decode rows of each tick's BATCH message (0: none sent)
    held: list[int]  # per tick: ready requests held back by the row bound (batch_policy.plan_rows)
    utilization: Utilization
    stages: list[dict] = field(default_factory=list)  # each stage's statistics over the run
    ttft_s: list[float] = field(default_factory=list)  # per request: arrival (its tick, queue included) to first token
    latency_s: list[float] = field(default_factory=list)  # per request: arrival to its last token
    held_ticks: list[int] = field(default_factory=list)  # per request: ticks the row bound held it back

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tpot_s(self) -> list[float]:
        """Per request: seconds per output token after the first."""
        return [(lat - ttft) / r.decode_tokens if r.decode_tokens else 0.0
                for r, ttft, lat in zip(self.results, self.ttft_s, self.latency_s)]


def check_class(r: BatchRequest) -> None:
    """ValueError naming a bad latency class or priority."""
    if r.latency not in LATENCY_CLASSES:
        raise ValueError(f"latency must be one of {LATENCY_CLASSES}, got {r.latency!r}")
    if not isinstance(r.priority, int) or isinstance(r.priority, bool):
        raise ValueError(f"priority must be an integer, got {r.priority!r}")


# hands over the next request when a slot is free (a server's queue), None when it has none now
Intake = Callable[[], "BatchRequest | None"]


class StageCounts:
    """Stage utilization counted as BATCH messages are sealed, as engine/protocol/batch_schedule.py
    counts it: the message sent at tick t is at stage p at tick t + p; a row there is live unless
    its request flushed that epoch (or finished) before that tick. A message is sealed n - 1
    ticks after it was sent (no later flush can touch its rows), or at the end of the run."""

    def __init__(self, n: int) -> None:
        self.n, self.ticks = n, 0
        self.useful, self.rows, self.live_rows, self.steps = [0] * n, [0] * n, [0] * n, [0] * n

    def add(self, tick: int, batch: list[tuple[LiveRequest, int]], last: int) -> None:
        """The rows of the message sent at `tick` ((request, epoch) each), up to tick `last`."""
        for p in range(min(self.n, last - tick + 1)):
            live = sum(1 for x, epoch in batch if tick + p <= x.epoch_end.get(epoch, last))
            self.steps[p] += 1
            self.rows[p] += len(batch)
            self.live_rows[p] += live
            self.useful[p] += int(live > 0)

    def utilization(self) -> Utilization:
        return Utilization(self.ticks, tuple(self.useful), tuple(self.rows), tuple(self.live_rows), tuple(self.steps))


def _spend(lives: Sequence[LiveRequest], what: str, span: tuple[float, float] | None) -> None:
    """A span of work the decoding requests share (stage 0's step, a BATCH message's send), a share each."""
    if span is not None:
        for x in lives:
            x.req.spend(what, span[0], span[1], 1.0 / len(lives))


class BatchDriver:
    """Runs requests through a Driver's pipeline, up to `max_batch` at once."""

    def __init__(self, driver) -> None:
        self.driver = driver
        self.n, self.t, self.timeout = driver.n, driver.t, driver.timeout
        self.links = BatchLinks(driver.t, driver.stage_rank, driver.wire, driver.buf.stage_anchors, driver.timeout,
                                driver.device, driver.dtype)  # the stages' reports, read in order
        self.serial = 0  # requests taken so far, over every run
        self.parts: dict[int, SlotParts] = {}  # request slot -> its buffers, kept over runs
        self.lifetime = StageCounts(self.n)  # over every run (a server's /metrics)

    def _need(self, s: int, live: LiveRequest, pos: int, arrived_only: bool = False) -> None:
        """Read stage s's reports until the one carrying `live`'s token at `pos` has arrived (arrived_only:
        only those already there)."""
        t0 = time.perf_counter()
        while not live.arrived(s, pos):
            if arrived_only and not self.links.ready(s):
                return
            self.links.pump(s, self.tick)
        live.req.account("wait", t0)

    # ---- prefill: one chunk per tick, between the BATCH messages ----
    def _send_chunk(self, live: LiveRequest) -> None:
        d = self.driver
        start, count = live.chunks[live.sent_chunks]
        live.sent_chunks += 1
        live.chunk_anchors[start] = torch.empty(count, d.plan.num_types, d.head.cfg.hidden_size, device=d.device,
                                                dtype=d.dtype)  # [count, m, H]
        live.chunk_anchors[start][:, 0] = d.head.embed(live.ids[None, start:start + count])[0]
        live.chunk_reports[start] = set()
        self._send(Header(Kind.PREFILL, start, live.serial, length=count, slot=live.slot),
                   [live.ids[start:start + count]])

    def _advance_prefill(self, live: LiveRequest, block: bool) -> None:
        """Put the chunks whose reports have all arrived into the PDM cache, in order; after the
        last, the request's first token. block: wait for the reports of the chunks sent."""
        d = self.driver
        while live.done_chunks < live.sent_chunks:
            start, count = live.chunks[live.done_chunks]
            while len(live.chunk_reports[start]) < len(self.links.reporting):
                missing = [s for s in self.links.reporting if s not in live.chunk_reports[start]]
                ready = [s for s in missing if self.links.ready(s)]
                if not ready and not block:
                    return
                self.links.pump(ready[0] if ready else missing[0], self.tick)
            rows = d.pdm.rows_of_type(live.chunk_anchors.pop(start), d.buf.full_type)  # [count, H]
            d.pdm.forward_rows(rows[None], live.pdm_cache, start)
            live.done_chunks += 1
        if live.done_chunks == len(live.chunks):
            self._first_token(live)

    def _first_token(self, live: LiveRequest) -> None:
        d, req = self.driver, live.req
        P = len(live.request.prompt)
        req.top_logprobs = live.request.top_logprobs
        first = req.first_token(live.lane.verifier, d.head.logits(live.prefill_exit), live.request.prompt)
        live.t_first = time.perf_counter()
        req.res.prefill_s = live.t_first - live.t_slot  # from taking its slot: the queue's wait is not prefill
        req.start_decode(P, first, d.anchor_stages)
        if req.commit(first):
            live.decoding = True
        else:
            self._finish(live)

    # ---- the tick ----
    def _send(self, hdr: Header, payloads: list[torch.Tensor], lives: Sequence[LiveRequest] = ()) -> None:
        t0 = time.perf_counter()
        step = self.driver.stage0.send(hdr, payloads, overlap=hdr.kind == Kind.BATCH)
        self.sent += 1
        _spend(lives, "send", (t0, step[0] if step else time.perf_counter()))
        _spend(lives, "stage0", step)

    def _admit(self) -> None:
        now = time.perf_counter()
        for index, request in self.queue:  # arrived: from this tick on it waits for a slot
            if request.arrival_tick <= self.tick:
                self.t_ready.setdefault(index, now)
        while None in self.slots:
            if not (self.queue and self.queue[0][1].arrival_tick <= self.tick) and not self._take():
                return
            if not self._fits(self.queue[0][1]):
                return  # a critical request waits for a critical one to finish (their rows <= max_rows)
            index, request = self.queue.pop(0)
            slot = self.slots.index(None)
            self.serial += 1
            live = self.slots[slot] = LiveRequest(self, index, slot, self.serial, request)
            live.t_arrival, live.t_slot = self.t_ready[index], time.perf_counter()

    def _fits(self, request: BatchRequest) -> bool:
        """Whether the live critical requests' rows leave room for this one's, if it is critical
        (batch_policy: critical requests' rows together at most max_rows)."""
        if request.latency == BATCH:
            return True
        critical = sum(1 for x in self.slots if x is not None and x.request.latency != BATCH)
        return (critical + 1) * self.width <= self.limits.max_rows

    def _take(self) -> bool:
        """A request from the intake into the queue, arriving now; False if it has none."""
        if self.intake is None:
            return False
        request = self.intake()
        if request is None:
            return False
        self.driver.check_request(request.prompt, request.max_new_tokens)  # the intake hands over checked ones
        check_class(request)
        index = self.count
        self.count += 1
        request.arrival_tick = self.tick
        self.t_ready[index] = time.perf_counter()
        self.queue.insert(0, (index, request))
        return True

    def _tick(self) -> None:
        self.tick += 1
        self._admit()
        lives = [x for x in self.slots if x is not None]
        rows = plan_rows([x.view(self.width) for x in lives], self.limits)
        decoding = [x for x in lives if x.serial in rows.enter]
        self.held.append(len(rows.held))
        for x in lives:
            x.held += x.serial in rows.held
        plans = [x.req.state.plan() for x in decoding]
        for live, plan in zip(decoding, plans):
            live.req.tick = plan.tick
        self.rows.append(self._send_batch(decoding, plans) if decoding else 0)
        for live, plan in zip(decoding, plans):
            for s, e in plan.anchor_reads:  # the token at lag j finished stage j-1 last tick
                self._need(s, live, e.pos)
            # The exit is read before the PDM when it has already arrived: this tick's rows do not use
            # it (its anchors are next tick's pending row), and on a CPU the read is then not the first
            # code to run after the PDM's weights went through the caches. When it has not arrived the
            # PDM runs first, as it must: it overlaps the wait.
            if plan.exit is not None:
                self._need(self.n - 1, live, plan.exit.end, arrived_only=True)
        drafts = self._draft(decoding, plans) if decoding else []
        for live, plan, ds in zip(decoding, plans, drafts):
            self._verify_and_advance(live, plan, ds)
        _spend(decoding, "stage0", self.driver.stage0.join())  # a co-located stage 0's step of this tick
        if rows.prefill:  # after the join: a co-located stage 0 steps on the chunk inline
            newcomer = next(x for x in lives if x.serial == rows.prefill[0][0])
            self._send_chunk(newcomer)
            while not decoding and newcomer.sent_chunks < len(newcomer.chunks):
                self._send_chunk(newcomer)  # nobody decodes: its chunks pipeline as one request's do (3.2)
        for live in lives:
            if not live.decoding and not live.finished:
                self._advance_prefill(live, block=not decoding)
        self._seal(self.tick - (self.n - 1))
        if self.tick >= self.n:  # a tick whose stage steps are all sealed (the rest: at the run's end)
            self.lifetime.ticks += 1

    def _seal(self, upto: int) -> None:
        """Count the BATCH messages sent up to tick `upto` into the run's and the lifetime's stage
        utilization (their rows are final), and let them go."""
        while self.unsealed and self.unsealed[0][0] <= upto:
            tick, batch = self.unsealed.popleft()
            self.counts.add(tick, batch, self.tick)
            self.lifetime.add(tick, batch, self.tick)

    def _draft(self, decoding: list[LiveRequest], plans: list[TickPlan]) -> list[list]:
        """One PDM pass over every decoding request's rows (each on its own PDM cache), then each
        request's drafts: from its last row, or with a branch point in flight from each chain's."""
        d, t0 = self.driver, time.perf_counter()
        if len(decoding) == 1:  # alone: its lane's own pass (slot 0's on the static PDM steps)
            x, plan = decoding[0], plans[0]
            drafts = x.lane.drafts(x.req, plan)
            x.req.account("pdm", t0)
            return [drafts]
        inputs = [x.pdm_inputs(plan) for x, plan in zip(decoding, plans)]  # (rows, positions, mask)
        rows = torch.cat([i[0] for i in inputs])  # [N, H]
        spans = RowCaches([x.pdm_cache for x in decoding], [plan.pdm_pos for plan in plans],
                          [len(i[0]) for i in inputs], [i[2] for i in inputs])
        h = d.pdm.forward_rows(rows[None], spans, 0, positions=torch.cat([i[1] for i in inputs])[None])[0]  # [N, H]
        out = []
        for x, plan, mine in zip(decoding, plans, h.split(spans.counts)):
            if plan.branch is None:
                out.append(x.lane.drafts_from(x.req, plan, mine[-1]))
            else:
                out.append(x.lane.branches.chain_drafts(x.req, plan, x.lane.branches.chain_lasts(plan, mine)))
        _spend(decoding, "pdm", (t0, time.perf_counter()))  # the pass is shared: each request its share
        return out

    def _send_batch(self, decoding: list[LiveRequest], plans: list[TickPlan]) -> int:
        """The entering tokens to stage 0 (one row each; a branch point's chains, W rows); their
        anchor 0 (the embedding) to their rings. Returns the message's rows."""
        d = self.driver
        entries: list[Entry] = [plan.enter[0] for plan in plans]
        tables = [x.meta_rows(e) for x, e in zip(decoding, entries)]
        meta = torch.tensor([row for table in tables for row in table], dtype=torch.int64)  # [R, META_LEN]
        self._send(Header(Kind.BATCH, rows=len(meta)), [meta], decoding)
        emb = d.head.embed(meta[None, :, _TOKEN].to(d.device))[0]  # [R, H]
        for live, e, mine in zip(decoding, entries, emb.split([len(table) for table in tables])):
            if e.run:  # a suffix run: each position's anchor 0 to its ring slot
                live.buf.ring[live.buf.row_slots[(live.buf.slot(e.pos), len(mine))], 0] = mine
            else:
                live.buf.rings[:len(mine), live.buf.slot(e.pos), 0] = mine  # every chain's anchor 0
        self.unsealed.append((self.tick, [(x, e.epoch) for x, e, table in zip(decoding, entries, tables)
                                          for _ in table]))
        return len(meta)

    def _verify_and_advance(self, live: LiveRequest, plan: TickPlan, drafts: list) -> None:
        req, state = live.req, live.req.state
        verdict = None
        if plan.exit is not None:
            self._need(self.n - 1, live, plan.exit.end)
            tv = time.perf_counter()
            # the last stage's argmax is every row's; a sampled request verifies against its q here
            reply = live.gather_exit(plan.exit, self.driver.wire.verify_on_last and req.sampling.greedy)
            verdict = live.lane.verify_exit(req, plan, drafts, reply)
            req.account("verify", tv)
        epoch = state.epoch
        committed = state.advance(drafts, verdict)
        if state.entry.survivor >= 0:  # a branch point resolved: the entry names its survivor
            live.lane.branches.adopt(req, state.entry.survivor, state.inflight)
        if state.epoch != epoch:
            live.epoch_end[epoch] = self.tick
        req.epoch = state.epoch
        # all() stops at the token that ends the request: a run's tokens after it are dropped
        if committed is not None and not all(req.commit(tok) for tok in committed.tokens):
            state.finish()
            self._finish(live)

    def _finish(self, live: LiveRequest) -> None:
        live.finished, live.decoding = True, False
        live.t_last = time.perf_counter()
        live.epoch_end[live.req.epoch] = self.tick
        res = live.req.res
        res.decode_s = live.t_last - live.t_first
        res.driver = dict(live.req.timers)
        if self.driver.drafter.cross is not None:  # later requests may draft from this one's text
            self.driver.drafter.cross.add(live.request.prompt, res.tokens)
        self.done[live.index] = live
        self.slots[live.slot] = None
        if self.on_done is not None:
            self.on_done(live.index, res)

    # ---- a run ----
    @torch.no_grad()
    def run(self, requests: Sequence[BatchRequest], max_batch: int, intake: Intake | None = None,
            on_done: Callable[[int, GenerationResult], None] | None = None, max_rows: int | None = None
            ) -> BatchResult:
        """Run `requests`, up to `max_batch` at once, then whatever `intake` hands over while a slot is
        free, until neither has any left and nothing is live. on_done(index, result) at each
        request's end (index: its place in `requests`, then the intake's in the order taken).
        `max_rows`: decode rows per stage step (default every live request's: max_batch W)."""
        d = self.driver
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.width = d.branches.width
        if max_rows is not None and max_rows < self.width:
            raise ValueError(f"max_rows {max_rows} is below the branch width {self.width}: no request could enter")
        # suffix runs (3.13) ride in the default row bound, every request's longest entry; under a
        # bound the user set, a running request's run could overrun it, so entries carry one token
        self.max_run = d.max_run if max_rows is None else 1
        self.limits = BatchLimits(max_batch, max_rows or max_batch * max(self.width, self.max_run), d.chunk)
        self.max_batch = max_batch
        self.intake, self.on_done, self.count = intake, on_done, len(requests)
        for r in requests:
            d.check_request(r.prompt, r.max_new_tokens)
            if r.arrival_tick < 1:
                raise ValueError(f"arrival_tick must be >= 1, got {r.arrival_tick}")
            check_class(r)
        self.queue = sorted(enumerate(requests), key=lambda ir: (ir[1].arrival_tick, ir[0]))
        self.slots: list[LiveRequest | None] = [None] * self.max_batch
        self.done: dict[int, LiveRequest] = {}
        self.t_ready: dict[int, float] = {}  # request index -> when its arrival tick came
        self.tick, self.sent = 0, 0
        self.links.begin(self.slots)
        self.rows: list[int] = []
        self.held: list[int] = []
        self.unsealed: deque[tuple[int, list[tuple[LiveRequest, int]]]] = deque()  # (tick sent, its rows)
        self.counts = StageCounts(self.n)
        t0 = time.perf_counter()
        while self.queue or any(x is not None for x in self.slots) or self._take():
            self._tick()
        wall = time.perf_counter() - t0
        self._seal(self.tick)
        self.lifetime.ticks += min(self.tick, self.n - 1)  # the last ticks, sealed only now
        self.counts.ticks = self.tick
        stages = self._finish_run()
        lives = [self.done[i] for i in range(self.count)]
        for live in lives:
            live.req.res.stages = stages
        return BatchResult([x.req.res for x in lives], self.tick, wall, self.rows, self.held, self.counts.utilization(),
                           stages,
                           [x.t_first - x.t_arrival for x in lives], [x.t_last - x.t_arrival for x in lives],
                           [x.held for x in lives])

    def _finish_run(self) -> list[dict]:
        """END down the pipe, the reports still on their way, every stage's statistics."""
        d = self.driver
        d.stage0.send(Header(Kind.END, 0, 0))
        self.links.drain(self.sent, self.tick)
        return [receive_stats(self.t, d.topo.stage_rank(s), self.timeout) for s in range(self.n)]
