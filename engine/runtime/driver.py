"""The driver (rank 0): pipelined prefill, the SPD tick loop, PDM drafting and verification
(argmax at T=0, speculative sampling at T>0).

The tick loop is engine/protocol/tick.py's state machine; per tick the driver only does what the plan
says (docs/design.md 3.3): send the entering token to stage 0; take in the anchor states the
staircase rows need; run the PDM over [pending full-depth row] + staircase rows; when the oldest
in-flight token leaves the last stage, verify the draft behind it; advance. A rejection bumps
the epoch and flushes: stale messages still in the pipe are recognised by their epoch and
dropped, and stages roll back lazily by position. What each message carries is
engine/protocol/messages.py's WireFormat. Anchor states land in a preallocated ring
`[num_slots, num_anchors, H]` indexed by position. Per-request state lives in a `Request`.

Branch width W (docs/design.md 3.11): at a branch point the driver sends W candidates in one
message; until it is verified every chain drafts its own next token from its own staircase (one
PDM pass over every chain's rows under a tree mask; `rings[c]` holds chain c's anchors, which
share the main ring's below the branch point), and the verification of the branch point picks
the survivor (engine/protocol/verify_multi.py); its anchors and draft records become the
representative's (ring 0).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from spd_engine.engine.protocol.anchors import AnchorPlan
from spd_engine.engine.protocol.drafting import PDM as PDM_SOURCE, SUFFIX
from spd_engine.engine.model.greedy import check_request, prefill_chunks
from spd_engine.engine.protocol.messages import Header, Kind, sampling_payload
from spd_engine.engine.protocol.metrics import GenerationResult
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.model.graphs import PDMStep, VerifyStep
from spd_engine.engine.model.pdm import PDM, draft_probs_full, greedy_draft
from spd_engine.engine.runtime.run_config import RankOptions, StepMode
from spd_engine.engine.protocol.sampling import SamplingParams, keyed_generator, sample, target_probs
from spd_engine.engine.runtime.stage0_overlap import Stage0Runner
from spd_engine.engine.runtime.stage_worker import StageWorker, receive_stats, wire_format
from spd_engine.engine.protocol.suffix import SuffixIndex, SuffixProposal
from spd_engine.engine.protocol.tick import Draft, Entry, TickPlan, TickState, Verdict
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.comm.transport import Transport
from spd_engine.engine.protocol.verify import verify_sampled
from spd_engine.engine.protocol.verify_multi import Candidate, verify_candidates, verify_candidates_greedy

# (position, PDM draft) -> token to send. Lets benchmarks and tests steer acceptance
# (synthetic alpha, forced rejections) without touching the verification path. At T > 0 the
# policy maps (position, PDM draft distribution q [V]) -> the distribution to sample from.
DraftPolicy = Callable[[int, object], object]
# Called with every committed token; returning False ends the request after that token (the
# pipeline is drained as at any end, so the next request is unaffected): cancellation, stop
# strings, deadlines.
OnToken = Callable[[int], "bool | None"]
GREEDY = SamplingParams()


@dataclass
class Request:
    """One request's driver-side state."""

    res: GenerationResult
    max_new: int
    eos: frozenset[int]
    sampling: SamplingParams
    policy: DraftPolicy | None
    on_token: OnToken | None
    epoch: int  # the epoch its messages carry (bumped by every flush)
    n: int
    tick: int = 0
    sent: int = 0  # token / prefill messages sent to stage 0
    consumed: list[int] = field(default_factory=list)  # messages read from each stage
    # seconds per part of the tick: send (posting to stage 0), stage0 (co-located stage 0 inline),
    # wait (receiving what the plan needs), pdm (rows + PDM step + draft), verify
    timers: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("send", "stage0", "wait", "pdm", "verify"), 0.0))
    # position -> q [V] of its current draft (a list, one per chain, while a branch point is in flight)
    q_store: dict[int, object] = field(default_factory=dict)
    cands: dict[int, list[Candidate]] = field(default_factory=dict)  # T > 0: a branch point's candidates
    suffix: SuffixIndex | None = None  # prompt + committed tokens, when suffix drafts are on
    source_of: dict[int, object] = field(default_factory=dict)  # position -> source of its draft (list: per chain)

    def __post_init__(self) -> None:
        self.consumed = [0] * self.n


class Driver:
    def __init__(self, topo: Topology, plan: AnchorPlan, head: StageModel, pdm: PDM, transport: Transport,
                 opts: RankOptions, local_stage0: StageWorker | None = None) -> None:
        assert head.has_embedding and head.has_head
        self.topo, self.plan, self.head, self.pdm, self.t = topo, plan, head, pdm, transport
        self.capacity, self.chunk, self.timeout = opts.capacity, opts.prefill_chunk, opts.timeout_s
        self.local_stage0 = local_stage0
        # co-located, n >= 2: stage 0 steps on its own thread while the driver drafts and verifies
        self.stage0_runner = Stage0Runner(local_stage0.step, next(head.parameters()).device) \
            if local_stage0 is not None and opts.overlap_stage0 and topo.n >= 2 else None
        # co-located, stage 0 inline, W = 1: decode tokens go to stage 0 in-process and its anchors
        # straight into the ring (no loopback message either way); prefill and chains use the loopback
        self.direct_stage0 = local_stage0 is not None and self.stage0_runner is None and topo.n >= 2 \
            and topo.tp == 1 and opts.branches.width == 1
        if self.direct_stage0:
            local_stage0.local_reports = self._stage0_anchors
        # direct and eager: stage 0's embedding of the entering token is its anchor 0 (the same
        # weights), so the driver does not embed it again (a static stage 0 step keeps it inside)
        self.anchor0_from_stage0 = self.direct_stage0 and local_stage0.static is None
        self.chooser = opts.drafting
        self.branching = opts.branches  # branch width W and where branch points start
        self.cross = self.chooser.new_history()  # earlier requests' tokens, when cross-request drafts are on
        self.n = topo.n
        p = next(head.parameters())
        H, m = head.cfg.hidden_size, plan.num_types
        self.device, self.dtype = p.device, p.dtype
        self.wire = wire_format(topo, plan, H, opts.verify_on_last)
        self._stage0_reports = int(self.wire.reports_to_driver(0))  # messages a stage 0 step counts as read
        self.num_slots = self.n + 2
        W = self.branching.width
        # [W, slots, anchors, H]: chain c's anchors in rings[c]; ring 0 is the representative's
        self.rings = torch.zeros(W, self.num_slots, m, H, device=p.device, dtype=p.dtype)
        self.ring = self.rings[0]  # [slots, anchors, H]
        rows = max(self.chunk, W)
        self.exit_buf = torch.empty(rows, H, device=p.device, dtype=p.dtype)  # [chunk, H]
        self.stage_anchors = [plan.anchors_of_stage(s) for s in range(self.n)]
        for ids in self.stage_anchors:
            assert list(ids) == list(range(ids[0], ids[0] + len(ids))) if ids else True
        self.scratch = [torch.empty(rows, len(ids), H, device=p.device, dtype=p.dtype)
                        for ids in self.stage_anchors]  # [chunk, k, H]: anchors nobody reads into the ring
        self.anchor_stages = [s for s in range(self.n) if self.stage_anchors[s]]
        # a decode tick's receive destinations, sliced once: stage s's anchors of ring slot i, one exit row
        self._anchor_dest = [[self.ring[i:i + 1, ids[0]:ids[-1] + 1] if ids else None  # [1, k, H]
                              for i in range(self.num_slots)] for ids in self.stage_anchors]
        self._exit_row = self.exit_buf[:1]  # [1, H]
        self._stage_rank = [topo.stage_rank(s) for s in range(self.n)]  # TP rank 0 of each stage
        # what a decode tick's report from stage s carries, in order ("anchors", "exit")
        self._decode_report = [tuple(p.name for p in self.wire.to_driver(s, Header(Kind.TOKEN)))
                               for s in range(self.n)]
        for dest in [self._exit_row] + [d for per_stage in self._anchor_dest for d in per_stage if d is not None]:
            transport.pin(dest)  # a decode tick's receive destinations
        # ring[slot, a] as [1, 1, H], the shape of a co-located stage 0's embedding and captured anchors
        self._ring_rows = [[self.ring[i, a].view(1, 1, H) for a in range(m)] for i in range(self.num_slots)]
        self.full_type = plan.type_at_depth(self.n)
        self.depth_types = [plan.type_at_depth(d) for d in range(self.n + 1)]
        # Per-tick index tensors, built once: a tick's rows are consecutive positions from the PDM
        # cache end (the pending row, then the staircase oldest -> newest), so their ring slots
        # depend only on (first slot, row count) and their types on (pending, fill).
        dev = p.device
        self._row_slots = {(a, R): torch.tensor([(a + i) % self.num_slots for i in range(R)], device=dev)
                           for a in range(self.num_slots) for R in range(1, self.n + 2)}
        self._row_types = {(pending, L): torch.tensor([self.full_type] * pending +
                                                      [self.depth_types[j] for j in range(L - 1, -1, -1)], device=dev)
                           for pending in (0, 1) for L in range(1, self.n + 1)}
        self._token_in = torch.zeros(1, 1, dtype=torch.long, device=dev)  # [1, 1] the entering token
        # a pass over every chain writes (W - 1) n rows past the staircase's (_chain_pass)
        self.pdm_cache = pdm.new_cache(opts.capacity + (W - 1) * self.n)
        self.step_mode = opts.step_mode
        self.pdm_steps: dict[int, PDMStep] = {}  # static PDM steps by row count (1 .. n + 1)
        self.verify_step: VerifyStep | None = None  # T=0 verification on a static input (graph modes)
        if self.step_mode != StepMode.EAGER:  # every row count and length bucket now, not inside a timed request
            graphs = self.step_mode == StepMode.GRAPH
            for rows in range(1, self.n + 2):
                self.pdm_steps[rows] = PDMStep(pdm, self.pdm_cache, rows, graphs=graphs)
                self.pdm_steps[rows].prepare()
            self.verify_step = VerifyStep(head, graphs=graphs)
        self.epoch = 0  # grows over requests: nothing of an earlier request can match a later one
        self.req: Request | None = None
        # Optional (newest position, fill, draft logits [Vd]) callback: evaluation by fill state,
        # and the check that training simulates exactly what the driver computes.
        self.draft_observer: Callable[[int, int, torch.Tensor], None] | None = None
        self.trace: list[tuple[int, str, float, float]] | None = [] if opts.trace else None  # (tick, what, t0, t1)

    # ---- transport helpers ----
    def _send_stage0(self, hdr: Header, payloads: Sequence[torch.Tensor] = (), overlap: bool = False) -> None:
        """Post a message to stage 0; co-located, stage 0 steps on it now, inline, or (overlap, a
        decode tick) on its runner thread until `_join_stage0` at the end of the tick."""
        t0 = time.perf_counter()
        for rank in self.topo.stage_ranks(0):  # every TP rank of stage 0 takes the token (docs/design.md 3.9)
            self.t.send(rank, hdr, payloads)
        if self.req is not None:
            self.req.sent += int(hdr.num_tokens > 0)
            self._account("send", t0)
        if overlap and self.stage0_runner is not None:
            self.stage0_runner.start()
        elif self.local_stage0 is not None:  # co-located: stage 0 runs inline, in series with the driver
            t1 = time.perf_counter()
            self.local_stage0.step()
            if self.req is not None:
                self._account("stage0", t1)

    def _step_stage0_direct(self, hdr: Header) -> None:
        """A decode token to the co-located stage 0, stepped inline without a message."""
        t0 = time.perf_counter()
        self.req.sent += 1
        self.local_stage0.step_local(hdr)
        self._account("stage0", t0)

    def _stage0_anchors(self, hdr: Header, caps: dict[int, torch.Tensor], emb: torch.Tensor | None) -> None:
        """Stage 0's anchors of a token it stepped in-process (and its embedding [1, 1, H], anchor 0,
        unless the step was static), into the ring slot of its position: next tick's anchor read
        of that token (plan.anchor_reads) is then already done. The slot is the entering token's,
        so no live row reads it for anything else (docs/design.md 3.3)."""
        rows = self._ring_rows[hdr.position % self.num_slots]
        if emb is not None:
            rows[0].copy_(emb)  # [1, 1, H]
        for a, layer in zip(self.stage_anchors[0], self.local_stage0.anchor_layers):
            rows[a].copy_(caps[layer])  # [1, 1, H]
        self.req.consumed[0] += self._stage0_reports

    def _join_stage0(self) -> None:
        """The end of an overlapped tick: `stage0` then counts only the wait for stage 0's step."""
        if self.stage0_runner is not None:
            t0 = time.perf_counter()
            self.stage0_runner.join()
            self._account("stage0", t0)

    def _read_header(self, s: int) -> Header:
        self.req.consumed[s] += 1
        return self.t.recv_header(self._stage_rank[s], self.timeout, self.req.tick)

    def _read_payloads(self, s: int, hdr: Header, ring_slot: int | None = None, row: int = 0) -> None:
        """The payloads behind stage s's header: anchors to ring[ring_slot] (else scratch), the
        last stage's exit hidden states to exit_buf. A chains message (hdr.rows = W): chain c's
        anchors to rings[c], and the representative's (`row`) to ring 0."""
        if ring_slot is not None and hdr.kind == Kind.TOKEN and hdr.rows == 1:  # a decode tick's: pinned rows
            for name in self._decode_report[s]:
                dest = self._exit_row if name == "exit" else self._anchor_dest[s][ring_slot]
                self.t.recv_into(self._stage_rank[s], dest, self.timeout, self.req.tick)
            return
        ids = self.stage_anchors[s]
        chains = hdr.kind == Kind.TOKEN and hdr.rows > 1
        for payload in self.wire.to_driver(s, hdr):
            if payload.name == "anchors":
                dest = self.scratch[s][:hdr.num_tokens] if ring_slot is None or chains else \
                    self._anchor_dest[s][ring_slot]  # [1, k, H], contiguous
            else:
                assert payload.name == "exit", payload
                dest = self._exit_row if hdr.num_tokens == 1 else self.exit_buf[:hdr.num_tokens]
            self.t.recv_into(self._stage_rank[s], dest, self.timeout, self.req.tick)
            if payload.name == "anchors" and chains and ring_slot is not None:
                a = slice(ids[0], ids[-1] + 1)
                self.rings[:hdr.rows, ring_slot, a] = dest  # [W, k, H]
                self.ring[ring_slot, a] = dest[row]

    def _recv_stage(self, s: int, kind: Kind, pos: int, ring_slot: int | None, row: int = 0,
                    arrived_only: bool = False) -> Header | None:
        """Receive stage s's messages until the current-epoch one for `pos`; stale ones are dropped
        (`row`: the representative's row of a chains message). arrived_only: stop (None) rather
        than wait for a message that has not arrived yet."""
        t0 = time.perf_counter()
        epoch = self.req.epoch
        while True:
            if arrived_only and not self.t.ready(self._stage_rank[s]):
                return None
            hdr = self._read_header(s)
            wanted = hdr.epoch == epoch and hdr.kind == kind and hdr.position == pos
            assert wanted or hdr.epoch < epoch, f"stage {s} sent {hdr}, driver expected {kind.name}@{pos}"
            self._read_payloads(s, hdr, ring_slot if wanted else None, row)
            if wanted:
                self._account("wait", t0)
                return hdr

    def _account(self, what: str, t0: float) -> None:
        t1 = time.perf_counter()
        self.req.timers[what] += t1 - t0
        if self.trace is not None:
            self.trace.append((self.req.tick, what, t0, t1))

    def _slot(self, pos: int) -> int:
        return pos % self.num_slots

    # ---- prefill ----
    @torch.no_grad()
    def _prefill(self, prompt: Sequence[int]) -> torch.Tensor:
        """Pipelined prefill; fills the PDM cache with full-depth rows; returns logits of the last position."""
        ids = torch.tensor(prompt, dtype=torch.long, device=self.device)
        chunks = prefill_chunks(len(prompt), self.chunk)
        for start, count in chunks:
            self._send_stage0(Header(Kind.PREFILL, start, self.req.epoch, length=count), [ids[start:start + count]])
        H, m = self.head.cfg.hidden_size, self.plan.num_types
        anchors = torch.empty(self.chunk, m, H, device=self.device, dtype=self.dtype)  # [chunk, m, H]
        for start, count in chunks:
            anchors[:count, 0] = self.head.embed(ids[None, start:start + count])[0]
            for s in range(self.n):
                if self.wire.reports_to_driver(s):
                    self._recv_stage(s, Kind.PREFILL, start, None)
                    if self.stage_anchors[s]:
                        a = self.stage_anchors[s]
                        anchors[:count, a[0]:a[-1] + 1] = self.scratch[s][:count]
            rows = self.pdm.rows_of_type(anchors[:count], self.full_type)  # [count, H]
            self.pdm.forward_rows(rows[None], self.pdm_cache, start)
        return self.head.logits(self.exit_buf[count - 1])

    # ---- generation ----
    @torch.no_grad()
    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int] = (),
                 draft_policy: DraftPolicy | None = None, on_token: OnToken | None = None,
                 sampling: SamplingParams = GREEDY) -> GenerationResult:
        check_request(prompt, max_new_tokens, self.capacity, self.head.cfg.vocab_size)
        self.epoch += 1  # fresh epoch per request
        res = GenerationResult(tokens=[], n=self.n)
        self.req = req = Request(res, max_new_tokens, frozenset(eos_ids), sampling, draft_policy, on_token,
                                 self.epoch, self.n, suffix=self.chooser.new_index(prompt))
        if self.trace is not None:
            self.trace.clear()
        try:
            if self.wire.verify_on_last:  # the last stage verifies at T=0 only: it needs to know which
                # (it never samples, so the seed, which may exceed int64, travels as 0)
                self._send_stage0(Header(Kind.CONFIG), [sampling_payload(sampling.temperature, sampling.top_k,
                                                                         sampling.top_p, 0)])
            t0 = time.perf_counter()
            first = self._sample_target(self._prefill(prompt), len(prompt))
            res.prefill_s = time.perf_counter() - t0
            req.timers = dict.fromkeys(req.timers, 0.0)  # the per-tick breakdown is the decode's
            t1 = time.perf_counter()
            if self._commit(first):
                self._decode(len(prompt), first)
            res.decode_s = time.perf_counter() - t1
            res.ticks = req.tick
            res.driver = dict(req.timers)
            res.stages = self._finish_request()
            if self.cross is not None:
                self.cross.add(prompt, res.tokens)
        finally:
            self.epoch = req.epoch
            self.req = None
        if self.trace is not None:
            res.trace = {"driver": list(self.trace), "stages": [st.pop("trace") for st in res.stages]}
        return res

    def _commit(self, token: int) -> bool:
        """Commit a token; False when the request ends here (EOS, max tokens, or on_token said stop)."""
        req = self.req
        req.res.tokens.append(token)
        if req.suffix is not None:
            req.suffix.extend((token,))
        go_on = req.on_token(token) if req.on_token is not None else None
        return token not in req.eos and len(req.res.tokens) < req.max_new and go_on is not False

    def _decode(self, P: int, first: int) -> None:
        req = self.req
        state = TickState(self.n, P, first, self.anchor_stages, epoch=req.epoch)
        while True:
            plan = state.plan()
            req.tick = plan.tick
            drafts, verdict = self._tick(plan)
            self._join_stage0()
            committed = state.advance(drafts, verdict)
            if state.entry.survivor >= 0:  # a branch point resolved: the entry names its survivor
                self._adopt(state.entry.survivor, state.inflight)
            req.epoch = state.epoch
            if committed is not None and not self._commit(committed.token):
                break
        counts = state.finish()
        req.res.verified, req.res.accepted, req.res.rejections = counts.verified, counts.accepted, counts.rejections
        req.res.branch_points, req.res.branch_saves = counts.branch_points, counts.branch_saves

    def _send_entry(self, entry: Entry) -> None:
        """The entering token (or a branch point's chains) to stage 0; its anchor 0 (the embedding) to the ring."""
        slot = self._slot(entry.pos)
        if not entry.chains:
            hdr = Header(Kind.TOKEN, entry.pos, entry.epoch, entry.token, branch=entry.branch,
                         survivor=entry.survivor)
            if self.direct_stage0:
                self._step_stage0_direct(hdr)
            else:
                self._send_stage0(hdr, overlap=True)
            if not self.anchor0_from_stage0:
                self.ring[slot, 0] = self.head.embed(self._token_in.fill_(entry.token))[0, 0]  # anchor 0
            return
        ids = torch.tensor(entry.chains, dtype=torch.long, device=self.device)  # [W]
        self._send_stage0(Header(Kind.TOKEN, entry.pos, entry.epoch, entry.token, rows=entry.rows,
                                 branch=entry.branch), [ids], overlap=True)
        self.rings[:entry.rows, slot, 0] = self.head.embed(ids[None])[0]  # [W, H]: every chain's anchor 0

    def _adopt(self, k: int, inflight) -> None:
        """Chain k survived its branch point: its anchors and draft records become the representative's."""
        req = self.req
        for e in inflight:
            if e.chains and k:
                self.ring[self._slot(e.pos)] = self.rings[k, self._slot(e.pos)]
        for store in (req.q_store, req.source_of):
            for pos, v in store.items():
                if isinstance(v, list):
                    store[pos] = v[k]

    def _tick(self, plan: TickPlan) -> tuple[list[Draft], Verdict | None]:
        """One tick as planned: (this tick's drafts, the verdict when a token left the pipeline)."""
        (entry,) = plan.enter
        self._send_entry(entry)
        for s, e in plan.anchor_reads:  # the token at lag j finished stage j-1 last tick
            if s > 0 or not self.direct_stage0:  # direct: stage 0's are in the ring already
                self._recv_stage(s, Kind.TOKEN, e.pos, self._slot(e.pos), e.row)
        # The exit is read before the PDM when it has already arrived: this tick's rows do not use it
        # (its anchors are next tick's pending row), and on a CPU the read is then not the first
        # code to run after the PDM's weights went through the caches. When it has not arrived the
        # PDM runs first, as it must: it overlaps the wait.
        exit_hdr = plan.exit is not None and self._recv_stage(
            self.n - 1, Kind.TOKEN, plan.exit.pos, self._slot(plan.exit.pos), plan.exit.row, arrived_only=True)
        tp = time.perf_counter()
        drafts = self._drafts(plan)
        self._account("pdm", tp)
        if plan.exit is None:  # filling: no token leaves the pipeline this tick
            return drafts, None
        if not exit_hdr:
            exit_hdr = self._recv_stage(self.n - 1, Kind.TOKEN, plan.exit.pos, self._slot(plan.exit.pos), plan.exit.row)
        tv = time.perf_counter()
        reply = exit_hdr.reply if self.wire.verify_on_last else -1  # the last stage's argmax, when it verified
        pos, row = plan.verify_pos, plan.exit.row
        if plan.proposed is not None:
            at_branch = plan.proposed.pos == plan.branch
            tokens = plan.proposed.chains if at_branch else (plan.proposed.token,)
        else:  # n = 1: this tick's own draft (or candidates) is verified now
            tokens = tuple(d.token for d in drafts)
        if len(tokens) == 1:
            accepted, target = self._verify_exit(pos, tokens[0], row, reply)
            chain = 0
        else:
            index, target = self._verify_branch(pos, tokens, row, reply)
            accepted, chain = index is not None, index or 0
        self._account("verify", tv)
        src = self.req.source_of.pop(pos)
        cell = self.req.res.by_source.setdefault(src[chain] if isinstance(src, list) else src, [0, 0, 0])
        cell[1] += 1
        cell[2] += int(accepted)
        return drafts, Verdict(accepted, target, chain)

    def _drafts(self, plan: TickPlan) -> list[Draft]:
        """This tick's drafts for plan.draft_pos: one; a branch point's candidates; or one per chain."""
        pos, policy = plan.draft_pos, self.req.policy
        if plan.branch is None:
            h_last, draft_id = self._pdm_step(self._rows(plan), plan.pdm_pos)
            if self.branching.branches(plan.fill, False):
                return self._candidates(h_last, plan)
            return [Draft(pos, self._draft(h_last, plan, policy, draft_id))]
        h_last = self._chain_pass(plan)  # [W, H]
        return [Draft(pos, self._draft(h_last[c], plan, policy, chain=c)) for c in range(plan.width)]

    def _chain_pass(self, plan: TickPlan) -> torch.Tensor:
        """One PDM pass over every chain of the branch point in flight: the rows below it once,
        then each chain's own rows (its anchors, rings[c]), a tree mask keeping the chains apart;
        returns each chain's last hidden state [W, H]. The PDM cache keeps committed rows only, so
        the rows written here past the pending one are rewritten next tick, as at W = 1."""
        q, W, p0 = plan.branch, plan.width, plan.pdm_pos
        S = q - p0  # rows below the branch point: the pending row and the staircase's older part
        C = len(plan.rows) - S  # each chain's own rows: positions q .. draft_pos - 1
        assert S >= 0 and C >= 1, (p0, q, len(plan.rows))
        types = self._row_types[(int(plan.rows[0].pending), plan.fill)]
        slots = [self._slot(r.pos) for r in plan.rows[:S]] + \
            [self._slot(r.pos) + c * self.num_slots for c in range(W) for r in plan.rows[S:]]
        rows = self.pdm.rows_from_ring(self.rings.view(-1, *self.rings.shape[2:]),
                                       torch.tensor(slots, device=self.device),
                                       torch.cat([types[:S]] + [types[S:]] * W))  # [S + W C, H]
        new = torch.arange(S + W * C, device=self.device)
        chain = torch.where(new < S, -1, (new - S) // C)  # [T]: -1 for the shared rows
        depth = torch.where(new < S, new, S + (new - S) % C)  # [T]: offset from p0 of the row's position
        sees = ((chain[None] == -1) | (chain[None] == chain[:, None])) & (depth[None] <= depth[:, None])
        mask = torch.cat([torch.ones(len(new), p0, dtype=torch.bool, device=self.device), sees], dim=1)
        h = self.pdm.forward_rows(rows[None], self.pdm_cache, p0, (p0 + depth)[None], mask[None, None])[0]
        return h[S + C - 1::C]  # [W, H]: the last row of each chain

    def _rows(self, plan: TickPlan) -> torch.Tensor:
        """The PDM rows [R, H] of the representative chain, from ring 0."""
        slots = self._row_slots[(self._slot(plan.pdm_pos), len(plan.rows))]
        return self.pdm.rows_from_ring(self.ring, slots, self._row_types[(int(plan.rows[0].pending), plan.fill)])

    # ---- drafting and verification (T = 0: argmax; T > 0: speculative sampling, docs/design.md 3.6) ----
    def _sample_target(self, logits: torch.Tensor, pos: int) -> int:
        """A plain draw from the target distribution p for the token at `pos` (the first token)."""
        sp = self.req.sampling
        if sp.greedy:
            return int(logits.argmax())  # host sync: the id is needed to continue
        return sample(target_probs(logits, sp), keyed_generator(sp.seed, pos, "target"))

    def _pdm_step(self, rows: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """rows [R, H] at PDM positions pos .. pos+R-1 -> (last hidden [H], greedy draft id [1] on
        the device, or None from the eager step)."""
        if self.step_mode == StepMode.EAGER:
            return self.pdm.forward_rows(rows[None], self.pdm_cache, pos)[0, -1], None
        return self.pdm_steps[rows.shape[0]].run(pos, rows)

    def _suffix_proposal(self, plan: TickPlan, chain: int = 0) -> SuffixProposal | None:
        """The suffix draft for plan.draft_pos: committed history, then the chain's unverified in-flight drafts."""
        index = self.req.suffix
        C = len(index.history)  # committed tokens (prompt included) = the first unverified position
        tokens = plan.chain_tokens(chain)
        unverified = [t for e, t in zip(plan.inflight, tokens) if e.pos >= C]
        keep = max(index.settings.max_len, len(unverified))
        tail = (index.history[-keep:] + unverified)[-keep:]
        own = index.propose(tail, C + len(unverified))
        return own if own is not None or self.cross is None else self.cross.propose(tail)

    def _draft(self, h_last: torch.Tensor, plan: TickPlan, policy: DraftPolicy | None,
               draft_id: torch.Tensor | None = None, chain: int = 0) -> int:
        """The draft for plan.draft_pos from the PDM's last hidden state [H] (draft_id: the static
        step's greedy draft [1], already on the device) or from the suffix index (engine/protocol/drafting.py);
        `chain`: which chain of the branch point in flight it extends."""
        pos, req = plan.draft_pos, self.req
        if self.draft_observer is not None and chain == 0:
            self.draft_observer(pos - 1, plan.fill, self.pdm.draft_logits(h_last))
        proposal = self._suffix_proposal(plan, chain) if req.suffix is not None else None
        sp = req.sampling
        token, source = None, PDM_SOURCE  # None: the PDM's greedy draft, read below (T=0) or sampled (T>0)
        if proposal is not None:
            top = self.pdm.draft_logits(h_last).topk(min(2, self.pdm.draft_ids.numel()))
            vals = top.values.tolist()  # host sync: the choice needs the PDM's margin
            margin = vals[0] - vals[1] if len(vals) > 1 else float("inf")
            token, source = self.chooser.choose(int(self.pdm.draft_ids[top.indices[0]]), margin, proposal)
        cell = req.res.by_source.setdefault(source, [0, 0, 0])
        cell[0] += 1
        self._keep(req.source_of, pos, source, chain, plan.width)  # a re-draft after a flush replaces it
        if sp.greedy:
            if token is None:  # host sync: the draft id goes in the next header
                token = int(draft_id) if draft_id is not None else greedy_draft(self.pdm, h_last)
            return policy(pos, token) if policy is not None else token
        q = self._point_mass(token) if source == SUFFIX else \
            draft_probs_full(self.pdm, target_probs(self.pdm.draft_logits(h_last), sp))  # [V]
        if policy is not None:
            q = policy(pos, q)
        if plan.width == 1:
            self._record_q(pos, q)
        else:
            self._keep(req.q_store, pos, q, chain, plan.width)
        if source == SUFFIX and policy is None:
            return token
        return sample(q, keyed_generator(sp.seed, pos, "draft"))

    def _point_mass(self, token: int) -> torch.Tensor:
        """q [V] of a deterministic draft (a suffix draft, the PDM's j-th best)."""
        q = torch.zeros(self.pdm.target_cfg.vocab_size, device=self.device)
        q[token] = 1.0
        return q

    def _record_q(self, pos: int, q: torch.Tensor) -> None:
        """Keep the exact q the current draft at `pos` came from; a re-draft after a flush replaces it."""
        self.req.q_store[pos] = q

    @staticmethod
    def _keep(store: dict, pos: int, value, chain: int, width: int) -> None:
        """Record a draft's source or q for `pos`; while a branch point is in flight one per chain
        (a list; _adopt keeps the survivor's)."""
        if width == 1:
            store[pos] = value
            return
        if chain == 0:
            store[pos] = [None] * width
        store[pos][chain] = value

    def _candidates(self, h_last: torch.Tensor, plan: TickPlan) -> list[Draft]:
        """A branch point's candidates (engine/protocol/branching.py): the chooser's draft, then the suffix
        proposal, then the PDM's ranked drafts. At T > 0 the first is drawn from q (or is the
        suffix draft); the others are deterministic given it, so their q is a point mass."""
        pos, req, sp, policy = plan.draft_pos, self.req, self.req.sampling, self.req.policy
        logits = self.pdm.draft_logits(h_last)  # [Vd]
        if self.draft_observer is not None:
            self.draft_observer(pos - 1, plan.fill, logits)
        # width + 1 ranked drafts always suffice: the chosen and the suffix draft repeat at most two
        top = logits.topk(min(self.branching.width + 1, self.pdm.draft_ids.numel()))
        ranked = self.pdm.draft_ids[top.indices].tolist()  # host sync: the candidates go in the header
        vals = top.values.tolist()
        margin = vals[0] - vals[1] if len(vals) > 1 else float("inf")
        proposal = self._suffix_proposal(plan) if req.suffix is not None else None
        chosen = self.chooser.choose(ranked[0], margin, proposal) if proposal is not None else (ranked[0], PDM_SOURCE)
        q = None
        if sp.greedy:
            if policy is not None:
                chosen = (policy(pos, chosen[0]), chosen[1])
        elif chosen[1] == PDM_SOURCE or policy is not None:
            q = draft_probs_full(self.pdm, target_probs(logits, sp)) if chosen[1] == PDM_SOURCE \
                else self._point_mass(chosen[0])  # [V]
            if policy is not None:
                q = policy(pos, q)
            chosen = (sample(q, keyed_generator(sp.seed, pos, "draft")), chosen[1])
        suffix = proposal.token if proposal is not None and proposal.length >= self.chooser.suffix.min_match else None
        cands = self.branching.candidates(chosen, ranked, suffix)
        for _, src in cands:
            req.res.by_source.setdefault(src, [0, 0, 0])[0] += 1
        req.source_of[pos] = [src for _, src in cands]
        if not sp.greedy:
            req.cands[pos] = [Candidate(tok, q if i == 0 else None) for i, (tok, _) in enumerate(cands)]
        return [Draft(pos, tok, src) for tok, src in cands]

    def _target_argmax(self, row: int, reply: int) -> int | None:
        """T=0: the argmax of the target's logits from exit_buf[row], when it is known without the
        logits: computed by the last stage (`reply` >= 0), or in the graph step modes by the final
        norm + head + argmax as one static step."""
        if reply >= 0:
            assert self.req.sampling.greedy, "the last stage verifies at T=0 only"
            return reply
        if self.verify_step is not None and self.req.sampling.greedy:
            return int(self.verify_step.run(self.exit_buf[row]))  # host sync: verification decides control flow
        return None

    def _verify_exit(self, pos: int, proposed: int, row: int = 0, reply: int = -1) -> tuple[bool, int]:
        """_verify on the exit hidden state in exit_buf[row] (the representative's row); `reply`: the
        last stage's argmax for `pos`, or -1."""
        target = self._target_argmax(row, reply)
        if target is not None:
            return target == proposed, target
        return self._verify(self.head.logits(self.exit_buf[row]), pos, proposed)

    def _verify_branch(self, pos: int, tokens: Sequence[int], row: int, reply: int = -1) -> tuple[int | None, int]:
        """(index of the surviving candidate or None, committed token) for a branch point at `pos`
        (engine/protocol/verify_multi.py: the argmax's candidate at T=0, recursive rejection sampling at T>0)."""
        target = self._target_argmax(row, reply)
        if target is not None:
            return verify_candidates_greedy(target, tokens)
        logits = self.head.logits(self.exit_buf[row])  # [V]
        sp, req = self.req.sampling, self.req
        if sp.greedy:
            return verify_candidates_greedy(int(logits.argmax()), tokens)  # host sync: control flow
        cands = req.cands.pop(pos)
        assert [c.token for c in cands] == list(tokens), (cands, tokens)
        for stale in [k for k in req.q_store if k <= pos]:
            del req.q_store[stale]
        return verify_candidates(target_probs(logits, sp), cands, keyed_generator(sp.seed, pos, "accept"),
                                 keyed_generator(sp.seed, pos, "residual"))

    def _verify(self, logits: torch.Tensor, pos: int, proposed: int) -> tuple[bool, int]:
        """(accepted, committed token) for the token proposed at `pos`, from the target logits [V]."""
        sp, q_store = self.req.sampling, self.req.q_store
        if sp.greedy:
            target = int(logits.argmax())  # host sync: verification decides control flow
            return target == proposed, target
        seed = sp.seed
        p = target_probs(logits, sp)
        q = q_store.pop(pos)
        assert not isinstance(q, list), f"position {pos}: a chain's q verified before its branch point resolved"
        for stale in [k for k in q_store if k < pos]:
            del q_store[stale]
        return verify_sampled(p, q, proposed, keyed_generator(seed, pos, "accept"),
                              keyed_generator(seed, pos, "residual"))

    def _finish_request(self) -> list[dict[str, float]]:
        """END down the pipe, drain what the stages still send, collect their stats."""
        self._send_stage0(Header(Kind.END, 0, self.req.epoch))
        stats = []
        for s in range(self.n):
            if self.wire.reports_to_driver(s):
                while self.req.consumed[s] < self.req.sent:
                    self._read_payloads(s, self._read_header(s))
            stats.append(receive_stats(self.t, self.topo.stage_rank(s), self.timeout))
        return stats

    def shutdown(self) -> None:
        if self.stage0_runner is not None:
            self.stage0_runner.close()
        self._send_stage0(Header(Kind.SHUTDOWN))
        self.t.flush()
