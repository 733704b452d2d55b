"""The driver (rank 0): pipelined prefill, then the SPD tick loop.

The tick loop is engine/protocol/tick.py's state machine; per tick the driver only does what the
plan says (docs/design.md 3.3): send the entering token (or a suffix run's tokens, 3.13) to
stage 0; take in the anchor states the staircase rows need; run the PDM over [pending full-depth
rows] + staircase rows and draft; when the oldest in-flight entry leaves the last stage, verify
its run and the draft behind it; advance. A rejection
bumps the epoch and flushes: stale messages still in the pipe are recognised by their epoch and
dropped, and stages roll back lazily by position. What each message carries is
engine/protocol/messages.py's WireFormat.

The parts, each an object of its own: the buffers the stages' payloads land in
(driver_buffers.py), the links that read them (stage_links.py), stage 0 in its layouts
(stage0_port.py), drafting (drafter.py), branch chains (branch_chains.py, docs/design.md 3.11),
verification (verifier.py), both per request in a lane (lane.py). Everything of one request lives in its RequestState
(request_state.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from spd_engine.engine.comm.transport import Transport
from spd_engine.engine.model.graphs import PDMStep, VerifyStep
from spd_engine.engine.model.greedy import check_request, prefill_chunks
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.model.pdm import PDM
from spd_engine.engine.protocol.anchors import AnchorPlan
from spd_engine.engine.protocol.messages import Header, Kind, sampling_payload
from spd_engine.engine.protocol.metrics import GenerationResult
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.protocol.tick import Draft, Entry, TickPlan, Verdict
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.batch_driver import BatchDriver, BatchRequest, BatchResult, Intake
from spd_engine.engine.runtime.branch_chains import BranchChains
from spd_engine.engine.runtime.drafter import Drafter, DraftObserver
from spd_engine.engine.runtime.driver_buffers import DriverBuffers
from spd_engine.engine.runtime.lane import Lane
from spd_engine.engine.runtime.request_state import DraftPolicy, OnToken, RequestState
from spd_engine.engine.runtime.run_config import RankOptions, StepMode
from spd_engine.engine.runtime.stage0_port import Stage0Port
from spd_engine.engine.runtime.stage_links import StageLinks
from spd_engine.engine.runtime.stage_worker import StageWorker, receive_stats, wire_format
from spd_engine.engine.runtime.verifier import Verifier

GREEDY = SamplingParams()


class Driver:
    gives_logprobs = True  # generate(top_logprobs=k): the verification's log-probabilities
    def __init__(self, topo: Topology, plan: AnchorPlan, head: StageModel, pdm: PDM, transport: Transport,
                 opts: RankOptions, local_stage0: StageWorker | None = None) -> None:
        assert head.has_embedding and head.has_head
        self.topo, self.plan, self.head, self.pdm, self.t, self.n = topo, plan, head, pdm, transport, topo.n
        self.capacity, self.chunk, self.timeout = opts.capacity, opts.prefill_chunk, opts.timeout_s
        self.step_mode = opts.step_mode
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        W = opts.branches.width
        self.max_run = opts.drafting.suffix.max_run if opts.drafting.uses_suffix else 1  # 3.13
        self.wire = wire_format(topo, plan, head.cfg.hidden_size, opts.verify_on_last)
        self.buf = DriverBuffers(self.n, plan, self.wire, head.cfg.hidden_size, max(self.chunk, W), W, transport,
                                 self.device, self.dtype, self.max_run)
        self.stage_rank = [topo.stage_rank(s) for s in range(self.n)]  # TP rank 0 of each stage
        self.links = StageLinks(transport, self.stage_rank, [self.wire.reports_to_driver(s) for s in range(self.n)],
                                self.timeout, self._read_payloads)
        self.stage0 = Stage0Port(topo, transport, self.links, self.buf, local_stage0, opts.overlap_stage0, W)
        self.anchor_stages = [s for s in range(self.n) if self.buf.stage_anchors[s]]
        self._token_in = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # [1, 1] the entering token
        # a pass over every chain writes (W - 1) n rows past the staircase's (BranchChains.chain_pass)
        self.pdm_cache = pdm.new_cache(opts.capacity + (W - 1) * self.n)
        self.pdm_steps: dict[int, PDMStep] = {}  # static PDM steps by row count (1 .. n + 1)
        verify_step = None  # T=0 verification on a static input (graph modes)
        if self.step_mode != StepMode.EAGER:  # every row count and length bucket now, not inside a timed request
            graphs = self.step_mode == StepMode.GRAPH
            for rows in range(1, self.n + 2):
                self.pdm_steps[rows] = PDMStep(pdm, self.pdm_cache, rows, graphs=graphs)
                self.pdm_steps[rows].prepare()
            verify_step = VerifyStep(head, graphs=graphs)
        self.drafter = Drafter(pdm, self.pdm_cache, self.buf, opts.drafting, opts.drafting.new_history(),
                               self.pdm_steps)
        self.branches = BranchChains(opts.branches, self.drafter)
        self.verifier = Verifier(head, self.buf.exit_buf, verify_step, self.buf.replies)
        self.lane = Lane(self.drafter, self.branches, self.verifier)
        self.epoch = 0  # grows over requests: nothing of an earlier request can match a later one
        self.req: RequestState | None = None  # the live request
        self.batch: BatchDriver | None = None  # several requests at once (generate_batch), made on first use
        self.trace: list[tuple[int, str, float, float]] | None = [] if opts.trace else None  # (tick, what, t0, t1)

    @property
    def draft_observer(self) -> DraftObserver | None:
        return self.drafter.observer

    @draft_observer.setter
    def draft_observer(self, observer: DraftObserver | None) -> None:
        self.drafter.observer = observer

    # ---- receiving ----
    def _read_payloads(self, s: int, hdr: Header, where: tuple[int, int] | None) -> None:
        self.buf.read_payloads(self.stage_rank[s], s, hdr, where, self.timeout, self.req.tick)

    def _recv(self, s: int, kind: Kind, pos: int, row: int = 0, where: bool = True,
              arrived_only: bool = False) -> Header | None:
        """Stage s's current-epoch message for `pos`, its anchors to the position's ring slot (where)."""
        t0, req = time.perf_counter(), self.req
        hdr = self.links.find(s, kind, pos, req.epoch, req.tick, (self.buf.slot(pos), row) if where else None,
                              arrived_only)
        if hdr is not None:
            req.account("wait", t0)
        return hdr

    # ---- prefill ----
    @torch.no_grad()
    def _prefill(self, prompt: Sequence[int]) -> torch.Tensor:
        """Pipelined prefill; fills the PDM cache with full-depth rows; returns logits of the last position."""
        ids = torch.tensor(prompt, dtype=torch.long, device=self.device)
        chunks = prefill_chunks(len(prompt), self.chunk)
        for start, count in chunks:
            self.stage0.send(Header(Kind.PREFILL, start, self.req.epoch, length=count), [ids[start:start + count]],
                             req=self.req)
        H, m = self.head.cfg.hidden_size, self.plan.num_types
        anchors = torch.empty(self.chunk, m, H, device=self.device, dtype=self.dtype)  # [chunk, m, H]
        for start, count in chunks:
            anchors[:count, 0] = self.head.embed(ids[None, start:start + count])[0]
            for s in range(self.n):
                if self.wire.reports_to_driver(s):
                    self._recv(s, Kind.PREFILL, start, where=False)
                    if self.buf.stage_anchors[s]:
                        a = self.buf.stage_anchors[s]
                        anchors[:count, a[0]:a[-1] + 1] = self.buf.scratch[s][:count]
            rows = self.pdm.rows_of_type(anchors[:count], self.buf.full_type)  # [count, H]
            self.pdm.forward_rows(rows[None], self.pdm_cache, start)
        return self.head.logits(self.buf.exit_buf[count - 1])

    # ---- generation ----
    @torch.no_grad()
    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int] = (),
                 draft_policy: DraftPolicy | None = None, on_token: OnToken | None = None,
                 sampling: SamplingParams = GREEDY, top_logprobs: int = -1) -> GenerationResult:
        """top_logprobs >= 0: res.logprobs holds each committed token's log-probability under the
        target and that many alternatives, from the raw logits its verification used."""
        check_request(prompt, max_new_tokens, self.capacity, self.head.cfg.vocab_size)
        self.epoch += 1  # fresh epoch per request
        if self.trace is not None:
            self.trace.clear()
        self.req = req = RequestState(self.n, max_new_tokens, frozenset(eos_ids), sampling, self.epoch, draft_policy,
                                      on_token, self.drafter.chooser.new_index(prompt), self.trace, self.max_run)
        req.top_logprobs = top_logprobs
        self.links.begin()
        res = req.res
        try:
            if self.wire.verify_on_last:  # the last stage verifies at T=0 only: it needs to know which
                # (it never samples, so the seed, which may exceed int64, travels as 0)
                self.stage0.send(Header(Kind.CONFIG), [sampling_payload(sampling.temperature, sampling.top_k,
                                                                        sampling.top_p, 0)], req=req)
            t0 = time.perf_counter()
            logits = self._prefill(prompt)
            first = req.first_token(self.verifier, logits, prompt)
            res.prefill_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            req.start_decode(len(prompt), first, self.anchor_stages)
            if req.commit(first):
                self._decode(req)
            res.decode_s = time.perf_counter() - t1
            res.driver = dict(req.timers)
            res.stages = self._finish_request()
            if self.drafter.cross is not None:
                self.drafter.cross.add(prompt, res.tokens)
        finally:
            self.epoch = req.epoch
            self.req = None
        if self.trace is not None:
            res.trace = {"driver": list(self.trace), "stages": [st.pop("trace") for st in res.stages]}
        return res

    def check_request(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        """ValueError naming the problem if this pipeline cannot serve the request."""
        check_request(prompt, max_new_tokens, self.capacity, self.head.cfg.vocab_size)

    def generate_batch(self, requests: Sequence[BatchRequest], max_batch: int, intake: Intake | None = None,
                       on_done: Callable[[int, GenerationResult], None] | None = None,
                       max_rows: int | None = None) -> BatchResult:
        """Several requests through the pipeline, up to `max_batch` at once (docs/design.md 3.12);
        `intake` hands over more while a slot is free (a server), on_done reports each end;
        `max_rows` bounds the decode rows per stage step (default: every live request's)."""
        if self.batch is None:
            self.batch = BatchDriver(self)
        return self.batch.run(requests, max_batch, intake, on_done, max_rows)

    def _decode(self, req: RequestState) -> None:
        state = req.state
        while True:
            plan = state.plan()
            req.tick = plan.tick
            drafts, verdict = self._tick(plan)
            self.stage0.join(req)
            committed = state.advance(drafts, verdict)
            if state.entry.survivor >= 0:  # a branch point resolved: the entry names its survivor
                self.branches.adopt(req, state.entry.survivor, state.inflight)
            req.epoch = state.epoch
            if committed is not None and not all(req.commit(tok) for tok in committed.tokens):
                break  # all() stops at the token that ends the request: a run's tokens after it are dropped
        state.finish()

    def _send_entry(self, entry: Entry) -> None:
        """The entering token (or a branch point's chains) to stage 0; its anchor 0 (the embedding) to the ring."""
        slot, req = self.buf.slot(entry.pos), self.req
        if entry.run:
            self._send_run(entry)
            return
        if not entry.chains:
            hdr = Header(Kind.TOKEN, entry.pos, entry.epoch, entry.token, branch=entry.branch,
                         survivor=entry.survivor)
            if self.stage0.direct:
                self.stage0.step_direct(hdr, req)
            else:
                self.stage0.send(hdr, overlap=True, req=req)
            if not self.stage0.anchor0_from_stage0:
                self.buf.ring[slot, 0] = self.head.embed(self._token_in.fill_(entry.token))[0, 0]  # anchor 0
            return
        ids = torch.tensor(entry.chains, dtype=torch.long, device=self.device)  # [W]
        self.stage0.send(Header(Kind.TOKEN, entry.pos, entry.epoch, entry.token, rows=entry.rows,
                                branch=entry.branch), [ids], overlap=True, req=req)
        self.buf.rings[:entry.rows, slot, 0] = self.head.embed(ids[None])[0]  # [W, H]: every chain's anchor 0

    def _send_run(self, entry: Entry) -> None:
        """A suffix run (docs/design.md 3.13): its tokens as one message of consecutive positions; each
        position's anchor 0 to its ring slot."""
        ids = torch.tensor(entry.tokens, dtype=torch.long, device=self.device)  # [L]
        hdr = Header(Kind.TOKEN, entry.pos, entry.epoch, entry.token, length=len(entry.tokens))
        if self.stage0.direct:
            self.stage0.step_direct(hdr, self.req, ids)
        else:
            self.stage0.send(hdr, [ids], overlap=True, req=self.req)
        if not self.stage0.anchor0_from_stage0:
            emb = self.head.embed(ids[None])[0]  # [L, H]
            for i in range(len(entry.tokens)):
                self.buf.ring[self.buf.slot(entry.pos + i), 0] = emb[i]

    def _tick(self, plan: TickPlan) -> tuple[list[Draft], Verdict | None]:
        """One tick as planned: (this tick's drafts, the verdict when a token left the pipeline)."""
        (entry,) = plan.enter
        self._send_entry(entry)
        for s, e in plan.anchor_reads:  # the token at lag j finished stage j-1 last tick
            if s > 0 or not self.stage0.direct:  # direct: stage 0's are in the ring already
                self._recv(s, Kind.TOKEN, e.pos, e.row)
        # The exit is read before the PDM when it has already arrived: this tick's rows do not use it
        # (its anchors are next tick's pending row), and on a CPU the read is then not the first
        # code to run after the PDM's weights went through the caches. When it has not arrived the
        # PDM runs first, as it must: it overlaps the wait.
        last, ex = self.n - 1, plan.exit
        exit_hdr = ex is not None and self._recv(last, Kind.TOKEN, ex.pos, ex.row, arrived_only=True)
        tp = time.perf_counter()
        drafts = self.lane.drafts(self.req, plan)
        self.req.account("pdm", tp)
        if ex is None:  # filling: no token leaves the pipeline this tick
            return drafts, None
        exit_hdr = exit_hdr or self._recv(last, Kind.TOKEN, ex.pos, ex.row)
        tv = time.perf_counter()
        verdict = self.lane.verify_exit(self.req, plan, drafts, exit_hdr.reply if self.wire.verify_on_last else -1)
        self.req.account("verify", tv)
        return drafts, verdict

    def _finish_request(self) -> list[dict[str, float]]:
        """END down the pipe, drain what the stages still send, collect their stats."""
        self.stage0.send(Header(Kind.END, 0, self.req.epoch), req=self.req)
        stats = []
        for s in range(self.n):
            self.links.drain(self.req.tick, [s])
            stats.append(receive_stats(self.t, self.topo.stage_rank(s), self.timeout))
        return stats

    def shutdown(self) -> None:
        self.stage0.close()
        self.stage0.send(Header(Kind.SHUTDOWN))
        self.t.flush()
