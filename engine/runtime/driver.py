"""The driver (rank 0) of an SPD pipeline: the stages' ranks, the PDM, the head, and the decode loop
every request runs in (engine/runtime/batch_driver.py: one request is a batch of one).

Per tick the loop does, for each decoding request, what engine/protocol/tick.py's plan says
(docs/design.md 3.3): send the entering token (or a suffix run's tokens, 3.13) to stage 0; take in
the anchor states the staircase rows need; run the PDM over [pending full-depth rows] + staircase
rows and draft; when the oldest in-flight entry leaves the last stage, verify its run and the draft
behind it; advance. A rejection bumps the request's epoch and flushes: stale rows still in the pipe
are recognised by their (serial, epoch) and dropped, and stages roll back lazily by position.

The parts, each an object of its own: stage 0 in its layouts (stage0_port.py), drafting
(drafter.py), branch chains (branch_chains.py, docs/design.md 3.11), verification (verifier.py),
both per request in a lane (lane.py), over the buffers the stages' payloads land in
(driver_buffers.py). Request slot 0 uses the driver's own lane, buffers and PDM cache, with the
static (CUDA-graph) PDM and verification steps; a request alone runs there. Everything of one
request lives in its RequestState (request_state.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from spd_engine.engine.comm.transport import Transport
from spd_engine.engine.model.graphs import PDMStep, VerifyStep
from spd_engine.engine.model.greedy import check_request
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.model.pdm import PDM
from spd_engine.engine.protocol.anchors import AnchorPlan
from spd_engine.engine.protocol.messages import Header, Kind
from spd_engine.engine.protocol.metrics import GenerationResult
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.batch_driver import BatchDriver, BatchRequest, BatchResult, Intake
from spd_engine.engine.runtime.branch_chains import BranchChains
from spd_engine.engine.runtime.drafter import Drafter, DraftObserver
from spd_engine.engine.runtime.driver_buffers import DriverBuffers
from spd_engine.engine.runtime.lane import Lane
from spd_engine.engine.runtime.request_state import DraftPolicy, OnToken
from spd_engine.engine.runtime.run_config import RankOptions, StepMode
from spd_engine.engine.runtime.stage0_port import Stage0Port
from spd_engine.engine.runtime.stage_worker import StageWorker, wire_format
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
        W, H = opts.branches.width, head.cfg.hidden_size
        self.max_run = opts.drafting.suffix.max_run if opts.drafting.uses_suffix else 1  # 3.13
        self.wire = wire_format(topo, plan, H, opts.verify_on_last)
        self.buf = DriverBuffers(self.n, plan, H, W, self.device, self.dtype, self.max_run)
        self.stage_rank = [topo.stage_rank(s) for s in range(self.n)]  # TP rank 0 of each stage
        self.stage0 = Stage0Port(topo, transport, local_stage0, opts.overlap_stage0, self.device)
        self.anchor_stages = [s for s in range(self.n) if self.buf.stage_anchors[s]]
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
        # slot 0's exiting entry's exit rows in the order its lane verifies them, and the last stage's argmaxes
        rows = max(W, self.max_run)
        self.verify_rows = torch.empty(rows, H, device=self.device, dtype=self.dtype)  # [rows, H]
        self.verify_replies = torch.full((rows,), -1, dtype=torch.int64)  # [rows]
        self.verifier = Verifier(head, self.verify_rows, verify_step, self.verify_replies)
        self.lane = Lane(self.drafter, self.branches, self.verifier)
        self.trace: list[tuple[int, str, float, float]] | None = [] if opts.trace else None  # (tick, what, t0, t1)
        self.batch = BatchDriver(self)

    @property
    def draft_observer(self) -> DraftObserver | None:
        return self.drafter.observer

    @draft_observer.setter
    def draft_observer(self, observer: DraftObserver | None) -> None:
        self.drafter.observer = observer

    @torch.no_grad()
    def generate(self, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int] = (),
                 draft_policy: DraftPolicy | None = None, on_token: OnToken | None = None,
                 sampling: SamplingParams = GREEDY, top_logprobs: int = -1) -> GenerationResult:
        """One request: a run of one through the decode loop. top_logprobs >= 0: res.logprobs holds
        each committed token's log-probability under the target and that many alternatives, from
        the raw logits its verification used."""
        if self.trace is not None:
            self.trace.clear()
        request = BatchRequest(prompt, max_new_tokens, eos_ids, sampling, draft_policy=draft_policy,
                               on_token=on_token, top_logprobs=top_logprobs, trace=self.trace)
        res = self.batch.run([request], 1).results[0]
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
        return self.batch.run(requests, max_batch, intake, on_done, max_rows)

    def shutdown(self) -> None:
        self.stage0.close()
        self.stage0.send(Header(Kind.SHUTDOWN))
        self.t.flush()
