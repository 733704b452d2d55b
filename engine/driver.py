"""The driver (rank 0): pipelined prefill, the SPD tick loop, PDM drafting and verification
(argmax at T=0, speculative sampling at T>0).

Per tick (docs/design.md 3.3): send the entering token to stage 0; take in the anchor states the stages
produced last tick, exactly those the staircase rows need; run the PDM over
[pending full-depth row] + staircase rows; when the oldest in-flight token leaves the last stage,
verify the draft behind it. A rejection bumps the epoch and flushes: stale messages still in the
pipe are recognised by their epoch and dropped, and stages roll back lazily by position.
Anchor states land in a preallocated ring `[num_slots, num_anchors, H]` indexed by position.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from spd_engine.engine.anchors import AnchorPlan
from spd_engine.engine.greedy import check_request, prefill_chunks
from spd_engine.engine.messages import Header, Kind
from spd_engine.engine.metrics import GenerationResult
from spd_engine.engine.model import StageModel
from spd_engine.engine.graphs import PDMStep, VerifyStep
from spd_engine.engine.pdm import PDM, draft_probs_full, greedy_draft
from spd_engine.engine.sampling import SamplingParams, keyed_generator, sample, target_probs
from spd_engine.engine.verify import verify_sampled
from spd_engine.engine.stage_worker import StageWorker, receive_stats
from spd_engine.engine.topology import Topology
from spd_engine.engine.transport import Transport

# (position, PDM draft) -> token to send. Lets benchmarks and tests steer acceptance
# (synthetic alpha, forced rejections) without touching the verification path. At T > 0 the
# policy maps (position, PDM draft distribution q [V]) -> the distribution to sample from.
DraftPolicy = Callable[[int, object], object]
GREEDY = SamplingParams()


@dataclass
class InFlight:
    pos: int
    token: int


class Driver:
    def __init__(self, topo: Topology, plan: AnchorPlan, head: StageModel, pdm: PDM, transport: Transport,
                 capacity: int, chunk: int, timeout: float, local_stage0: StageWorker | None = None,
                 trace: bool = False, step_mode: str = "eager") -> None:
        assert head.has_embedding and head.has_head
        self.topo, self.plan, self.head, self.pdm, self.t = topo, plan, head, pdm, transport
        self.capacity, self.chunk, self.timeout = capacity, chunk, timeout
        self.local_stage0 = local_stage0
        self.n = topo.n
        p = next(head.parameters())
        H, m = head.cfg.hidden_size, plan.num_types
        self.device, self.dtype = p.device, p.dtype
        self.num_slots = self.n + 2
        self.ring = torch.zeros(self.num_slots, m, H, device=p.device, dtype=p.dtype)  # [slots, anchors, H]
        self.exit_buf = torch.empty(chunk, H, device=p.device, dtype=p.dtype)  # [chunk, H]
        self.stage_anchors = [plan.anchors_of_stage(s) for s in range(self.n)]
        for ids in self.stage_anchors:
            assert list(ids) == list(range(ids[0], ids[0] + len(ids))) if ids else True
        self.scratch = [torch.empty(chunk, len(ids), H, device=p.device, dtype=p.dtype) for ids in self.stage_anchors]
        self.reports = [bool(self.stage_anchors[s]) or s == self.n - 1 for s in range(self.n)]
        self.full_type = plan.type_at_depth(self.n)
        self.lag_types = [plan.type_at_depth(j) for j in range(self.n)]
        self.pdm_cache = pdm.new_cache(capacity)
        assert step_mode in ("eager", "static", "graph"), step_mode
        self.step_mode = step_mode
        self.pdm_steps: dict[int, PDMStep] = {}  # static PDM steps by row count (1 .. n + 1)
        self.verify_step: VerifyStep | None = None  # T=0 verification on a static input (graph modes)
        if step_mode != "eager":  # every row count and length bucket now, not inside a timed request
            for rows in range(1, self.n + 2):
                self.pdm_steps[rows] = PDMStep(pdm, self.pdm_cache, rows, graphs=step_mode == "graph")
                self.pdm_steps[rows].prepare()
            self.verify_step = VerifyStep(head, graphs=step_mode == "graph")
        self.epoch = 0
        self.tick = 0
        self.sent = 0
        self.consumed = [0] * self.n
        self.timers = {"pdm": 0.0, "verify": 0.0, "wait": 0.0, "send": 0.0}
        # Optional (newest position, fill, draft logits [Vd]) callback: evaluation by fill state,
        # and the check that training simulates exactly what the driver computes.
        self.draft_observer: Callable[[int, int, torch.Tensor], None] | None = None
        self.trace: list[tuple[int, str, float, float]] | None = [] if trace else None  # (tick, what, t0, t1)

    # ---- transport helpers ----
    def _send_stage0(self, hdr: Header, payloads: Sequence[torch.Tensor] = ()) -> None:
        t0 = time.perf_counter()
        self.t.send(self.topo.stage_rank(0), hdr, payloads)
        if hdr.kind in (Kind.TOKEN, Kind.PREFILL):
            self.sent += 1
        if self.local_stage0 is not None:  # co-located: stage 0 runs inline, in series with the driver
            self.local_stage0.step()
        self._account("send", t0)

    def _recv_stage(self, s: int, kind: Kind, pos: int, ring_slot: int | None) -> Header:
        """Receive stage s's messages until the current-epoch one for `pos`; stale ones are dropped.

        Anchors of the wanted message go to ring[ring_slot] (or scratch when ring_slot is None),
        the last stage's exit hidden states to exit_buf.
        """
        rank = self.topo.stage_rank(s)
        ids = self.stage_anchors[s]
        t0 = time.perf_counter()
        while True:
            hdr = self.t.recv_header(rank, self.timeout, self.tick)
            self.consumed[s] += 1
            T = 1 if hdr.kind == Kind.TOKEN else hdr.token
            wanted = hdr.epoch == self.epoch and hdr.kind == kind and hdr.position == pos
            assert wanted or hdr.epoch < self.epoch, f"stage {s} sent {hdr}, driver expected {kind.name}@{pos}"
            if ids:
                if wanted and ring_slot is not None:
                    dest = self.ring[ring_slot:ring_slot + 1, ids[0]:ids[-1] + 1]  # [1, k, H], contiguous
                else:
                    dest = self.scratch[s][:T]
                self.t.recv_into(rank, dest, self.timeout, self.tick)
            if s == self.n - 1:
                self.t.recv_into(rank, self.exit_buf[:T], self.timeout, self.tick)
            if wanted:
                self._account("wait", t0)
                return hdr

    def _account(self, what: str, t0: float) -> None:
        t1 = time.perf_counter()
        self.timers[what] += t1 - t0
        if self.trace is not None:
            self.trace.append((self.tick, what, t0, t1))

    def _slot(self, pos: int) -> int:
        return pos % self.num_slots

    # ---- prefill ----
    @torch.no_grad()
    def _prefill(self, prompt: Sequence[int]) -> torch.Tensor:
        """Pipelined prefill; fills the PDM cache with full-depth rows; returns logits of the last position."""
        ids = torch.tensor(prompt, dtype=torch.long, device=self.device)
        chunks = prefill_chunks(len(prompt), self.chunk)
        for start, count in chunks:
            self._send_stage0(Header(Kind.PREFILL, start, self.epoch, count), [ids[start:start + count]])
        H, m = self.head.cfg.hidden_size, self.plan.num_types
        anchors = torch.empty(self.chunk, m, H, device=self.device, dtype=self.dtype)  # [chunk, m, H]
        for start, count in chunks:
            anchors[:count, 0] = self.head.embed(ids[None, start:start + count])[0]
            for s in range(self.n):
                if self.reports[s]:
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
                 draft_policy: DraftPolicy | None = None, on_token: Callable[[int], None] | None = None,
                 sampling: SamplingParams = GREEDY) -> GenerationResult:
        check_request(prompt, max_new_tokens, self.capacity, self.head.cfg.vocab_size)
        self.sampling = sampling
        self.q_store: dict[int, torch.Tensor] = {}  # position -> q [V] its current draft was sampled from
        self.epoch += 1  # fresh epoch per request: nothing of an earlier request can match
        self.tick, self.sent, self.consumed = 0, 0, [0] * self.n
        self.timers = dict.fromkeys(self.timers, 0.0)
        if self.trace is not None:
            self.trace.clear()
        res = GenerationResult(tokens=[], n=self.n)
        t0 = time.perf_counter()
        first = self._sample_target(self._prefill(prompt), len(prompt))
        res.prefill_s = time.perf_counter() - t0
        eos = set(eos_ids)
        self._commit(res, first, on_token)
        t1 = time.perf_counter()
        if first not in eos and max_new_tokens > 1:
            self._decode(res, len(prompt), first, max_new_tokens, eos, draft_policy, on_token)
        res.decode_s = time.perf_counter() - t1
        res.ticks = self.tick
        res.driver = dict(self.timers)
        res.stages = self._finish_request()
        if self.trace is not None:
            res.trace = {"driver": list(self.trace), "stages": [st.pop("trace") for st in res.stages]}
        return res

    def _commit(self, res: GenerationResult, token: int, on_token) -> None:
        res.tokens.append(token)
        if on_token is not None:
            on_token(token)

    def _decode(self, res: GenerationResult, P: int, first: int, max_new: int, eos: set[int],
                policy: DraftPolicy | None, on_token) -> None:
        inflight: deque[InFlight] = deque()
        entry = InFlight(P, first)
        pdm_len, pending = P, False
        rejected_last = False
        while True:
            self.tick += 1
            self._send_stage0(Header(Kind.TOKEN, entry.pos, self.epoch, entry.token))
            inflight.append(entry)
            tok = torch.tensor([[entry.token]], device=self.device)
            self.ring[self._slot(entry.pos), 0] = self.head.embed(tok)[0, 0]  # anchor 0 of the newest token
            L = len(inflight)
            for j in range(1, L):  # the token at lag j finished stage j-1 last tick
                s = j - 1
                if s < self.n - 1 and self.stage_anchors[s]:
                    pos = inflight[L - 1 - j].pos
                    self._recv_stage(s, Kind.TOKEN, pos, self._slot(pos))
            tp = time.perf_counter()
            slots, types = ([self._slot(pdm_len)], [self.full_type]) if pending else ([], [])
            first_pos = pdm_len if pending else inflight[0].pos
            assert first_pos == pdm_len, (first_pos, pdm_len)
            for j in range(L - 1, -1, -1):
                slots.append(self._slot(inflight[L - 1 - j].pos))
                types.append(self.lag_types[j])
            rows = self.pdm.rows_from_ring(self.ring, torch.tensor(slots, device=self.device),
                                           torch.tensor(types, device=self.device))  # [R, H]
            h_last, draft_id = self._pdm_step(rows, pdm_len)
            draft = self._draft(h_last, inflight[-1].pos, L, policy, draft_id)
            pdm_len += int(pending)  # crop back: keep only the pending full-depth row
            pending = False
            self._account("pdm", tp)
            if L < self.n:  # filling: no token leaves the pipeline this tick
                entry = InFlight(inflight[-1].pos + 1, draft)
                continue
            oldest = inflight.popleft()
            self._recv_stage(self.n - 1, Kind.TOKEN, oldest.pos, self._slot(oldest.pos))
            tv = time.perf_counter()
            proposed = inflight[0].token if inflight else draft
            accepted, target = self._verify_exit(oldest.pos + 1, proposed)
            self._account("verify", tv)
            pending = True
            res.verified += 1
            if rejected_last:
                res.rejections += 1
            res.accepted += int(accepted)
            self._commit(res, target, on_token)
            if target in eos or len(res.tokens) >= max_new:
                return
            rejected_last = not accepted
            if not accepted:
                self.epoch += 1  # flush: everything in flight is stale now
                inflight.clear()
            entry = InFlight(inflight[-1].pos + 1, draft) if inflight else InFlight(oldest.pos + 1, target)

    # ---- drafting and verification (T = 0: argmax; T > 0: speculative sampling, docs/design.md 3.6) ----
    def _sample_target(self, logits: torch.Tensor, pos: int) -> int:
        """A plain draw from the target distribution p for the token at `pos` (the first token)."""
        if self.sampling.greedy:
            return int(logits.argmax())  # host sync: the id is needed to continue
        return sample(target_probs(logits, self.sampling), keyed_generator(self.sampling.seed, pos, "target"))

    def _pdm_step(self, rows: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """rows [R, H] at PDM positions pos .. pos+R-1 -> (last hidden [H], greedy draft id [1] on
        the device, or None from the eager step)."""
        if self.step_mode == "eager":
            return self.pdm.forward_rows(rows[None], self.pdm_cache, pos)[0, -1], None
        return self.pdm_steps[rows.shape[0]].run(pos, rows)

    def _draft(self, h_last: torch.Tensor, newest: int, fill: int, policy: DraftPolicy | None,
               draft_id: torch.Tensor | None = None) -> int:
        """The draft for position newest + 1 from the PDM's last hidden state [H] (draft_id: the
        static step's greedy draft [1], already on the device)."""
        pos = newest + 1
        if self.draft_observer is not None:
            self.draft_observer(newest, fill, self.pdm.draft_logits(h_last))
        if self.sampling.greedy:
            # host sync: the draft id goes in the next header
            draft = int(draft_id) if draft_id is not None else greedy_draft(self.pdm, h_last)
            return policy(pos, draft) if policy is not None else draft
        q = draft_probs_full(self.pdm, target_probs(self.pdm.draft_logits(h_last), self.sampling))  # [V]
        if policy is not None:
            q = policy(pos, q)
        self._record_q(pos, q)
        return sample(q, keyed_generator(self.sampling.seed, pos, "draft"))

    def _record_q(self, pos: int, q: torch.Tensor) -> None:
        """Keep the exact q the current draft at `pos` came from; a re-draft after a flush replaces it."""
        self.q_store[pos] = q

    def _verify_exit(self, pos: int, proposed: int) -> tuple[bool, int]:
        """_verify on the exit hidden state in exit_buf[0]; at T=0 in the graph step modes the
        final norm + head + argmax run as one static step (sampling needs the logits: eager)."""
        if self.verify_step is not None and self.sampling.greedy:
            target = int(self.verify_step.run(self.exit_buf[0]))  # host sync: verification decides control flow
            return target == proposed, target
        return self._verify(self.head.logits(self.exit_buf[0]), pos, proposed)

    def _verify(self, logits: torch.Tensor, pos: int, proposed: int) -> tuple[bool, int]:
        """(accepted, committed token) for the token proposed at `pos`, from the target logits [V]."""
        if self.sampling.greedy:
            target = int(logits.argmax())  # host sync: verification decides control flow
            return target == proposed, target
        seed = self.sampling.seed
        p = target_probs(logits, self.sampling)
        q = self.q_store.pop(pos)
        for stale in [k for k in self.q_store if k < pos]:
            del self.q_store[stale]
        return verify_sampled(p, q, proposed, keyed_generator(seed, pos, "accept"),
                              keyed_generator(seed, pos, "residual"))

    def _finish_request(self) -> list[dict[str, float]]:
        """END down the pipe, drain what the stages still send, collect their stats."""
        self._send_stage0(Header(Kind.END, 0, self.epoch, 0))
        stats = []
        for s in range(self.n):
            rank = self.topo.stage_rank(s)
            if self.reports[s]:
                while self.consumed[s] < self.sent:
                    hdr = self.t.recv_header(rank, self.timeout, self.tick)
                    T = 1 if hdr.kind == Kind.TOKEN else hdr.token
                    if self.stage_anchors[s]:
                        self.t.recv_into(rank, self.scratch[s][:T], self.timeout, self.tick)
                    if s == self.n - 1:
                        self.t.recv_into(rank, self.exit_buf[:T], self.timeout, self.tick)
                    self.consumed[s] += 1
            stats.append(receive_stats(self.t, rank, self.timeout))
        return stats

    def shutdown(self) -> None:
        self._send_stage0(Header(Kind.SHUTDOWN))
        self.t.flush()
