"""Stage worker: a stage rank's loop. It receives a message, runs its rows through layers [a, b),
sends the output downstream and the anchor states to the driver; each message is handled in three
steps, each in a file of its own:
- prepare the rows (engine/runtime/stage_input.py): receive the token ids or hidden states into
  the stage's buffers (engine/runtime/stage_buffers.py);
- run them (engine/runtime/stage_compute.py) on the request slots' KV caches
  (engine/runtime/slot_caches.py), then the head's token where the stage has one
  (engine/runtime/stage_head.py);
- emit (engine/runtime/stage_emit.py): the output downstream, the report to the driver.
engine/runtime/stage_timing.py keeps the request's statistics, sent to the driver at its end.

Rollback is lazy (docs/design.md 3.4): a message at position `q` writes its K/V at slot `q`, so whatever
a stale token left there is overwritten; there is no control message, collective or barrier.
SPD's decode entries travel as BATCH messages (below), a request alone's as one row; TOKEN messages
are the pp / ar baselines' one decode token.
What each message carries is engine/protocol/messages.py's WireFormat: every token or prefill message a
reporting stage computes produces exactly one message to the driver, which the driver counts
on to drain its links at the end of a request.
Several requests in the pipeline (docs/design.md 3.12): each request slot has its own KV cache;
a BATCH message carries each of several requests' entry (a suffix run's tokens as consecutive rows,
one causal span of its slot's cache), computed as one step whose
matmuls run over all its rows while each row attends to its own request's cache
(engine/model/kv_cache.py RowCaches). On a TP stage a BATCH message travels as a TOKEN does (TP rank t
from TP rank t of the stage before): every TP rank computes the same rows on its shard of each
slot's cache, and a verifying last stage picks every row's argmax across its ranks.
"""
from __future__ import annotations

import time

import torch

from spd_engine.engine.comm.transport import Transport
from spd_engine.engine.model.graphs import StageStep
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.model.tp_model import resident_bytes
from spd_engine.engine.protocol.anchors import AnchorPlan
from spd_engine.engine.protocol.messages import CONFIG_LEN, Header, Kind, WireFormat, parse_sampling_payload
from spd_engine.engine.protocol.metrics import StageStats
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.run_config import RankOptions
from spd_engine.engine.runtime.slot_caches import SlotCaches
from spd_engine.engine.runtime.stage_buffers import StageBuffers
from spd_engine.engine.runtime.stage_compute import StageCompute
from spd_engine.engine.runtime.stage_emit import StageEmit
from spd_engine.engine.runtime.stage_head import StageHead
from spd_engine.engine.runtime.stage_input import StageInput
from spd_engine.engine.runtime.stage_timing import StageTiming


def wire_format(topo: Topology, plan: AnchorPlan | None, hidden: int, verify_on_last: bool = False) -> WireFormat:
    """The run's wire format: SPD stages send their anchors (and the last its exit state, with
    T=0 verification's argmax when it verifies) to the driver; a plain pipeline (plan None) has
    the head on its last stage, which replies a token."""
    if plan is None:
        return WireFormat(hidden, (0,) * topo.n, head_on_last=True)
    return WireFormat(hidden, tuple(len(plan.anchors_of_stage(s)) for s in range(topo.n)),
                      verify_on_last=verify_on_last)


class StageWorker:
    """A stage rank's message loop: each TOKEN, PREFILL or BATCH message prepared (StageInput),
    run (StageCompute, then StageHead) and emitted (StageEmit)."""

    def __init__(self, stage: int, topo: Topology, plan: AnchorPlan | None, model: StageModel, transport: Transport,
                 opts: RankOptions, tp_rank: int = 0) -> None:
        """plan None: a plain pipeline-parallel stage (no anchors). A last stage that holds the
        head replies to the driver with its token in the header instead of its hidden state (the
        `pp`, `tp` and `ar` baselines). opts.step_mode: how one-token steps run; prefill chunks always
        run eagerly. With --tp > 1 (model a TPStageModel) TP rank t takes its input from TP rank t
        of the previous stage (or the driver) and sends its output to TP rank t of the next: after
        the all-reduce every TP rank holds the whole hidden state (docs/design.md 3.9). Only TP
        rank 0 reports to the driver (anchors, exit state, the head's token, statistics)."""
        self.stage, self.topo, self.model, self.t = stage, topo, model, transport
        self.timeout, self.tp_rank = opts.timeout_s, tp_rank
        self.min_step_s = opts.min_step_s  # synthetic stage time (benchmarks, bubble tests): pad compute to this
        self.prev = topo.driver_rank if stage == 0 else topo.stage_rank(stage - 1, tp_rank)
        self.next = topo.stage_rank(stage + 1, tp_rank) if stage + 1 < topo.n else None
        self.driver = topo.driver_rank
        self.anchor_layers = [plan.anchor_layer(a) for a in plan.anchors_of_stage(stage)] if plan is not None else []
        self.wire = wire_format(topo, plan, model.cfg.hidden_size, opts.verify_on_last)
        assert self.wire.head_on_last_stage == model.has_head or self.next is not None
        reports = self.wire.reports_to_driver(stage) and tp_rank == 0
        width = opts.branches.width
        # chain slots of a branch point reach (n - 1) W past its position (engine/model/kv_cache.py)
        caches = SlotCaches(model, stage, opts.capacity + ((topo.n - 1) * width if width > 1 else 0))
        self.buffers = StageBuffers(model, self.wire, stage, self.anchor_layers, reports, self.next is not None,
                                    transport, max(opts.prefill_chunk, width))
        self.rows_in = StageInput(stage, model, transport, self.prev, self.timeout, self.buffers, opts.capacity)
        self.compute = StageCompute(stage, model, caches, frozenset(self.anchor_layers), self.buffers,
                                    opts.step_mode, head=model.has_head and self.wire.head_on_last)
        verifies = self.wire.verify_on_last and self.next is None  # T=0 verification's argmax here
        self.head = StageHead(model, verifies, opts.step_mode)
        self.emit = StageEmit(stage, transport, self.next, self.driver, self.wire, self.buffers, reports,
                              model.has_head)
        self.timing = StageTiming(getattr(model, "group", None), float(resident_bytes(model)), opts.trace)
        self.cfg_in = torch.empty(CONFIG_LEN, dtype=torch.int64)
        self.in_request = False
        self.handled = 0  # messages handled this request (the tick named in receive errors)
        self.compute.prepare()

    @property
    def static(self) -> StageStep | None:
        """The static one-token step (engine/model/graphs.py StageStep), None with eager steps."""
        return self.compute.static

    @property
    def out1(self) -> torch.Tensor:
        """The pinned output row [1, H] of a one-row decode step."""
        return self.buffers.out1

    @property
    def anchors1(self) -> torch.Tensor:
        """The pinned anchor rows [1, k, H] of a one-row decode step."""
        return self.buffers.anchors1

    @property
    def _report1(self) -> list[torch.Tensor]:
        """A one-row decode report's payloads, in wire order: the pinned rows."""
        return self.buffers.report1

    @torch.no_grad()
    def serve(self) -> None:
        """Loop until SHUTDOWN."""
        while self.step():
            pass

    def step(self) -> bool:
        """Handle one message; False after SHUTDOWN."""
        timeout = self.timeout if self.in_request else None  # no timeout while idle between requests
        t0 = time.perf_counter()
        hdr = self.t.recv_header(self.prev, timeout, tick=self.handled)
        if hdr.kind in (Kind.TOKEN, Kind.PREFILL):
            self.in_request = True
            self._compute(hdr, t0)
            return True
        if hdr.kind == Kind.BATCH:
            self.in_request = True
            self._compute_batch(hdr, t0)
            return True
        if hdr.kind == Kind.CONFIG:
            self._configure(hdr)
            return True
        if self.next is not None:
            self.t.send(self.next, hdr)
        if hdr.kind == Kind.END:
            self._end()
            return True
        assert hdr.kind == Kind.SHUTDOWN, hdr
        self.t.flush()
        return False

    def _configure(self, hdr: Header) -> None:
        """A request's sampling parameters (used only by a head stage), passed on down the pipe."""
        self.t.recv_into(self.prev, self.cfg_in, self.timeout)
        temperature, top_k, top_p, seed = parse_sampling_payload(self.cfg_in)
        self.head.sampling = SamplingParams(temperature, top_k, top_p, seed)
        if self.next is not None:
            self.t.send(self.next, hdr, [self.cfg_in.clone()])

    def _end(self) -> None:
        """A request's end: TP rank 0 sends its statistics; the next request starts afresh."""
        if self.tp_rank == 0:
            self.timing.send(self.t, self.driver)
        self.t.flush()
        self.timing.reset()
        self.handled = 0
        self.in_request = False

    def step_local(self, hdr: Header) -> None:
        """A decode token handed over in-process by the co-located pp driver (engine/runtime/
        baselines.py): the same computation as a received TOKEN message, without the message (no
        loopback header to queue and pop)."""
        assert self.stage == 0 and hdr.kind == Kind.TOKEN, hdr
        self.in_request = True
        self._compute(hdr, time.perf_counter())

    def _compute(self, hdr: Header, t0: float) -> None:
        """A TOKEN (pp / ar: one decode token) or PREFILL message received from t0: prepare its
        rows, run them, emit."""
        if torch.is_grad_enabled():  # serve() and the driver run under no_grad already: entering it
            with torch.no_grad():  # again per message costs tens of microseconds after a compute
                return self._compute(hdr, t0)
        decode = hdr.kind == Kind.TOKEN
        self.rows_in.check(hdr)
        mark = self.timing.mark()
        ids, h = self.rows_in.token_rows(hdr, self.handled)
        t1 = time.perf_counter()
        step = self.compute.token(hdr, ids, h)
        token = self.head.reply(hdr, step.out, step.greedy)
        if decode and self.min_step_s > 0:
            self.timing.pad(self.min_step_s, t1)
        t2 = time.perf_counter()
        self.handled += 1
        if decode:
            self.timing.step(t0, t1, t2, mark)
        self.emit.token(hdr, step, token)
        if decode:
            self.timing.stats.send_s += time.perf_counter() - t2

    def _compute_batch(self, hdr: Header, t0: float) -> None:
        """The tokens of several requests (one each, or a branch point's W chains) as one step
        (eager): the table, then the rows."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._compute_batch(hdr, t0)
        mark = self.timing.mark()
        meta, rows = self.rows_in.batch_rows(hdr, self.handled)  # [R, META_LEN]; ids [1, R] or h [1, R, H]
        t1 = time.perf_counter()
        out, caps = self.compute.batch(meta, rows)  # [1, R, H]
        if self.head.verifies:  # the T=0 argmax of the rows that ask for it
            self.head.reply_rows(meta, out, self.timing.stats)
        if self.min_step_s > 0:
            self.timing.pad(self.min_step_s, t1)
        t2 = time.perf_counter()
        self.handled += 1
        self.timing.step(t0, t1, t2, mark, rows=hdr.rows)
        self.emit.batch(hdr, meta, out, caps)
        self.timing.stats.send_s += time.perf_counter() - t2


def receive_stats(t: Transport, rank: int, timeout: float) -> dict:
    """A stage's STATS reply: per-request decode compute/wait/send seconds, decode message count, TP
    collectives and their seconds (inside the compute), verify seconds (inside the compute), the
    resident parameter bytes, all of the reporting rank (TP rank 0 of the stage), optional trace."""
    hdr = t.recv_header(rank, timeout)
    assert hdr.kind == Kind.STATS, hdr
    return StageStats.from_reply(t.recv_into(rank, torch.empty(hdr.length, dtype=torch.float64), timeout).tolist())
