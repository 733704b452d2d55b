"""Stage worker: receive a token (or prefill chunk), run layers [a, b), send the output downstream
and the anchor states to the driver.

Rollback is lazy (docs/design.md 3.4): a message at position `q` writes its K/V at slot `q`, so whatever
a stale token left there is overwritten; there is no control message, collective or barrier.
The chains of a branch point (docs/design.md 3.11) travel as one message of W rows at one
position, written to the chain slots of engine/model/kv_cache.py; the message naming the survivor
moves that chain's entries down before it is computed. A suffix run (docs/design.md 3.13) travels as
one TOKEN message of `length` consecutive positions, computed like a prefill chunk (eagerly).
What each message carries is engine/protocol/messages.py's WireFormat: every token or prefill message a
reporting stage computes produces exactly one message to the driver, which the driver counts
on to drain its links at the end of a request.
Several requests in the pipeline (docs/design.md 3.12): each request slot has its own KV cache;
a BATCH message carries one token of each of several requests, computed as one step whose
matmuls run over all its rows while each row attends to its own request's cache
(engine/model/kv_cache.py RowCaches). On a TP stage a BATCH message travels as a TOKEN does (TP rank t
from TP rank t of the stage before): every TP rank computes the same rows on its shard of each
slot's cache, and a verifying last stage picks every row's argmax across its ranks.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from spd_engine.engine.protocol.anchors import AnchorPlan
from spd_engine.engine.model.graphs import StageStep, VerifyStep
from spd_engine.engine.model.kv_cache import KVCache, RowCaches, chain_mask, chain_slot0
from spd_engine.engine.protocol.messages import (CONFIG_LEN, META_FIELDS, META_LEN, Header, Kind, WireFormat,
                                                 parse_sampling_payload)
from spd_engine.engine.protocol.metrics import StageStats
from spd_engine.engine.protocol.sampling import SamplingParams, keyed_generator, sample, target_probs
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.runtime.run_config import RankOptions, StepMode
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.model.tp_model import resident_bytes
from spd_engine.engine.comm.transport import Transport


MAX_SLOTS = 64  # request slots a stage accepts (one KV cache each, made on first use)
_POSITION, _TOKEN, _REPLY = (META_FIELDS.index(f) for f in ("position", "token", "reply"))
_CHAIN_FIELDS = [META_FIELDS.index(f) for f in ("slot", "position", "branch", "chain", "width", "survivor")]


def wire_format(topo: Topology, plan: AnchorPlan | None, hidden: int, verify_on_last: bool = False) -> WireFormat:
    """The run's wire format: SPD stages send their anchors (and the last its exit state, with
    T=0 verification's argmax when it verifies) to the driver; a plain pipeline (plan None) has
    the head on its last stage, which replies a token."""
    if plan is None:
        return WireFormat(hidden, (0,) * topo.n, head_on_last=True)
    return WireFormat(hidden, tuple(len(plan.anchors_of_stage(s)) for s in range(topo.n)),
                      verify_on_last=verify_on_last)


class StageWorker:
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
        self.capacity, self.timeout = opts.capacity, opts.timeout_s
        self.min_step_s = opts.min_step_s  # synthetic stage time (benchmarks, bubble tests): pad compute to this
        self.tp_rank = tp_rank
        self.prev = topo.driver_rank if stage == 0 else topo.stage_rank(stage - 1, tp_rank)
        self.next = topo.stage_rank(stage + 1, tp_rank) if stage + 1 < topo.n else None
        self.driver = topo.driver_rank
        self.choose = getattr(model, "choose_token", None)  # a vocab-parallel head: the token across TP ranks
        self.anchor_ids = plan.anchors_of_stage(stage) if plan is not None else ()
        self.anchor_layers = [plan.anchor_layer(a) for a in self.anchor_ids] if plan is not None else []
        self.capture = frozenset(self.anchor_layers)
        H = model.cfg.hidden_size
        self.wire = wire_format(topo, plan, H, opts.verify_on_last)
        assert self.wire.head_on_last_stage == model.has_head or self.next is not None
        self.verifies = self.wire.verify_on_last and self.next is None  # T=0 verification's argmax here
        self.reports = self.wire.reports_to_driver(stage) and tp_rank == 0
        p = next(model.parameters())
        chunk = opts.prefill_chunk
        width = opts.branches.width
        # chain slots of a branch point reach (n - 1) W past its position (engine/model/kv_cache.py)
        self.cache = model.new_cache(1, opts.capacity + ((topo.n - 1) * width if width > 1 else 0))
        self.chain_width = 1  # rows of the last chain message: the width of the branch point in flight
        self.slot_caches: dict[int, KVCache] = {0: self.cache}  # several requests: one cache per request slot
        rows = max(chunk, width)
        self.h_in = torch.empty(rows, H, device=p.device, dtype=p.dtype)  # [chunk, H] received hidden
        # a decode message's buffers, pinned with the transport: the hidden state in, the output row
        # out (downstream and, from the last stage, the exit), the anchors to the driver
        self.h_in1 = self.h_in[:1]  # [1, H]
        self.h_in1_3d = self.h_in1.view(1, 1, H)  # [1, 1, H]: the same bytes as the model's input
        k = len(self.anchor_layers)
        self.anchors1 = torch.empty(1, k, H, device=p.device, dtype=p.dtype)  # [1, k, H]
        self._anchor_rows = [self.anchors1[:, j:j + 1] for j in range(k)]  # [1, 1, H] each
        last = model.layer_range[-1] if len(model.layer_range) else None
        if k and self.anchor_layers[-1] == last:  # the last anchor is the stage's output: one row for both
            self.out1 = self.anchors1[0, k - 1:]  # [1, H]
        else:
            self.out1 = torch.empty(1, H, device=p.device, dtype=p.dtype)  # [1, H]
        self.out1_3d = self.out1.view(1, 1, H)  # [1, 1, H]: the same bytes, the model output's shape
        # a one-row decode report's payloads in wire order, looked up once: the pinned rows
        names = [p.name for p in self.wire.to_driver(stage, Header(Kind.TOKEN))]
        self._report1 = [self.anchors1 if name == "anchors" else self.out1 for name in names]
        self.pinned = transport.pins_buffers  # decode outputs land in out1 / anchors1
        # an eager one-row decode step's layers write their outputs straight into those rows
        self._into1 = {layer: row for layer, row in zip(self.anchor_layers, self._anchor_rows) if self.reports}
        if last is not None and (self.next is not None or "exit" in names):
            self._into1[last] = self.out1_3d
        for buf in (self.h_in1, self.out1, self.anchors1):
            transport.pin(buf)
        self.ids_in = torch.empty(rows, dtype=torch.long, device=p.device)  # [chunk] stage 0 prefill / chain ids
        self.tok = torch.empty(1, 1, dtype=torch.long, device=p.device)
        self.in_request = False
        self.param_bytes = float(resident_bytes(model))  # this rank's (a TP rank: its shard)
        self.sampling = SamplingParams()  # used only by a head stage (pp / ar baselines, an SPD last stage that verifies)
        self.cfg_in = torch.empty(CONFIG_LEN, dtype=torch.int64)
        self.stats = StageStats()  # this request's decode statistics (host floats: no per-tick tensors)
        self.group = getattr(model, "group", None)  # a TP rank's stage group (engine/comm/tp_group.py)
        self.handled = 0  # messages handled this request (the tick named in receive errors)
        self.trace: list[float] | None = [] if opts.trace else None  # (recv start, compute start, compute end)*
        # co-located stage 0: (header, captured layer outputs, its embedding [1, 1, H] or None from
        # a static step) of a token the driver handed over in-process (step_local); its anchors then
        # go straight to the driver's ring, no message
        self.local_reports: Callable[[Header, dict[int, torch.Tensor], torch.Tensor | None], None] | None = None
        graphs = opts.step_mode == StepMode.GRAPH
        # a verifying SPD stage runs the head as its own step, only at T=0 (the pp head stage's is inside)
        self.static = None if opts.step_mode == StepMode.EAGER else \
            StageStep(model, self.cache, graphs=graphs, capture=self.capture, head=model.has_head and self.wire.head_on_last)
        self.verify_step = VerifyStep(model, graphs=graphs) if self.static is not None and self.verifies else None
        if self.static is not None:
            self.static.prepare()  # every length bucket now, not inside a timed request

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
            self.t.recv_into(self.prev, self.cfg_in, self.timeout)
            temperature, top_k, top_p, seed = parse_sampling_payload(self.cfg_in)
            self.sampling = SamplingParams(temperature, top_k, top_p, seed)
            if self.next is not None:
                self.t.send(self.next, hdr, [self.cfg_in.clone()])
            return True
        if self.next is not None:
            self.t.send(self.next, hdr)
        if hdr.kind == Kind.END:
            if self.tp_rank == 0:
                payload = torch.tensor([*self.stats.values(), self.param_bytes, *(self.trace or [])], dtype=torch.float64)
                self.t.send(self.driver, Header(Kind.STATS, length=payload.numel()), [payload])
            self.t.flush()
            self.stats = StageStats()
            self.handled = 0
            if self.trace is not None:
                self.trace.clear()
            self.in_request = False
            return True
        assert hdr.kind == Kind.SHUTDOWN, hdr
        self.t.flush()
        return False

    def step_local(self, hdr: Header, ids: torch.Tensor | None = None) -> None:
        """A decode token (or a suffix run, its ids [T] in `ids`) handed over in-process by the
        co-located driver: the same computation as a received TOKEN message, without the message
        (no loopback header to queue and pop)."""
        assert self.stage == 0 and hdr.kind == Kind.TOKEN and hdr.rows == 1, hdr
        assert (ids is None) == (hdr.num_tokens == 1), hdr
        self.in_request = True
        self._compute(hdr, time.perf_counter(), local=True, local_ids=ids)

    def _compute(self, hdr: Header, t0: float, local: bool = False, local_ids: torch.Tensor | None = None) -> None:
        if torch.is_grad_enabled():  # serve() and the driver run under no_grad already: entering it
            with torch.no_grad():  # again per message costs tens of microseconds after a compute
                return self._compute(hdr, t0, local, local_ids)
        T = hdr.num_tokens
        pos = hdr.position
        chains = hdr.kind == Kind.TOKEN and hdr.rows > 1
        one = hdr.kind == Kind.TOKEN and T == 1  # a one-token decode step (not chains, not a suffix run)
        end, limit = (chain_slot0(hdr.branch, pos, T) + T, self.cache.capacity) if chains else (pos + T, self.capacity)
        if pos >= self.capacity or end > limit or T > self.h_in.shape[0]:
            raise RuntimeError(f"stage {self.stage}: message {hdr} exceeds KV capacity {self.capacity} "
                               f"or prefill chunk {self.h_in.shape[0]}")
        assert not (chains and self.wire.head_on_last), "branch chains travel SPD stages only"
        calls0, coll0 = (self.group.calls, self.group.collective_s) if self.group is not None else (0, 0.0)
        if hdr.survivor >= 0:  # the branch point resolved: keep the survivor's entries
            self.cache.keep_chain(hdr.branch, self.chain_width, hdr.survivor, pos - hdr.branch)
        if self.stage == 0:
            if one:
                ids = self.tok.fill_(hdr.token)
            elif local_ids is not None:
                ids = local_ids[None]  # [1, T]
            else:
                ids = self.t.recv_into(self.prev, self.ids_in[:T], self.timeout, self.handled)[None]
            t1 = time.perf_counter()
        elif T == 1:
            ids = None
            self.t.recv_into(self.prev, self.h_in1, self.timeout, self.handled)
            h = self.h_in1_3d  # [1, 1, H]
            t1 = time.perf_counter()
        else:
            ids = None
            h = self.t.recv_into(self.prev, self.h_in[:T], self.timeout, self.handled)[None]
            t1 = time.perf_counter()
        greedy_dev = None  # the static step's argmax token [1] (a head stage only)
        into = None  # the pinned rows an eager one-row decode step writes its outputs into
        emb = None  # stage 0's embedding of the token [1, T, H] (eager steps): a local report's anchor 0
        if self.static is not None and one:
            # static buffers that the next step rewrites: everything that leaves this step is copied
            # out below, before it returns (out1 and anchors1 into the transport, anchors into the
            # co-located driver's ring), so no clone is needed
            out, caps, greedy_dev = self.static.run(pos, h=None if self.stage == 0 else h, token=ids)
        else:
            h = emb = self.model.embed(ids) if self.stage == 0 else h  # [1, T, H]
            into = self._into1 if T == 1 and self.pinned and hdr.kind == Kind.TOKEN else None
            cache = self.cache if hdr.slot == 0 else self._cache_of(hdr.slot)
            out, caps = self._forward(h, hdr) if chains else \
                self.model.forward_layers(h, cache, pos, capture=self.capture, into=into)
        replies = None  # a suffix run's rows' T=0 argmaxes [T] (int64, host), when this stage verifies
        if self.verifies:  # the target's argmax behind a one-row decode exit at T=0, else -1
            token = -1
            run = hdr.kind == Kind.TOKEN and hdr.length > 1
            if (one or run) and self.sampling.greedy:
                tv = time.perf_counter()
                if run:
                    replies = self._argmax_rows(out[0])
                    token = int(replies[-1])
                else:
                    token = self._verify_token(out, pos)
                self.stats.verify_s += time.perf_counter() - tv
            elif run:
                replies = torch.full((T,), -1, dtype=torch.int64)
        elif self.model.has_head:  # the pp/ar head stage: its logits and token are part of its compute
            if greedy_dev is not None and self.sampling.greedy:
                token = int(greedy_dev)  # host sync: the id goes in the header; the step ran the head
            else:  # eager steps, prefill, and sampling (which needs the logits, not the argmax)
                token = self._next_token(out[0, -1], pos + T)
        if self.min_step_s > 0 and hdr.kind == Kind.TOKEN:
            time.sleep(max(0.0, self.min_step_s - (time.perf_counter() - t1)))
        t2 = time.perf_counter()
        self.handled += 1
        if hdr.kind == Kind.TOKEN:
            self.stats.compute_s += t2 - t1
            self.stats.messages += 1
            self.stats.wait_s += t1 - t0
            if self.group is not None:
                self.stats.tp_collectives += self.group.calls - calls0
                self.stats.tp_collective_s += self.group.collective_s - coll0
        if self.trace is not None and hdr.kind == Kind.TOKEN:
            self.trace += [t0, t1, t2]
        via_report = self.reports and not (local and self.local_reports is not None)
        row = self._rows_out(out, caps, T, via_report, into is not None)
        if self.next is not None:
            self.t.send(self.next, hdr, [row])
        if local and self.local_reports is not None:
            self.local_reports(hdr, caps, emb if self.stage == 0 else None)
        elif via_report:
            self._report(hdr.with_reply(token) if self.model.has_head else hdr, row, caps, replies)
        if hdr.kind == Kind.TOKEN:
            self.stats.send_s += time.perf_counter() - t2

    def _cache_of(self, slot: int) -> KVCache:
        """Request slot `slot`'s KV cache, made on its first use."""
        cache = self.slot_caches.get(slot)
        if cache is None:
            if not 0 <= slot < MAX_SLOTS:
                raise RuntimeError(f"stage {self.stage}: request slot {slot} is outside 0..{MAX_SLOTS - 1}")
            # the chain slots' headroom too (3.11): its request may branch
            cache = self.slot_caches[slot] = self.model.new_cache(1, self.cache.capacity)
        return cache

    def _batch_caches(self, meta: torch.Tensor, device: torch.device) -> RowCaches:
        """Where a BATCH step's rows go: a request's token at its position in its slot's cache; the W
        chains of its branch point (consecutive rows) as one group at their chain slots under the
        tree mask (3.11). A survivor row first moves the surviving chain's entries down, as a
        TOKEN message naming it does: FIFO links brought every chain row of its branch point first."""
        groups = []  # (cache, first slot, rows, mask or None)
        for slot, pos, branch, chain, width, survivor in meta[:, _CHAIN_FIELDS].tolist():
            cache = self._cache_of(slot)
            if survivor >= 0:
                cache.keep_chain(branch, width, survivor, pos - branch)
            if branch < 0 or survivor >= 0:  # one token
                groups.append((cache, pos, 1, None))
            elif chain == 0:
                groups.append((cache, chain_slot0(branch, pos, width), width,
                               chain_mask(branch, pos, width, device)[0, 0]))  # [W, slot0 + W]
        caches, starts, counts, masks = (list(x) for x in zip(*groups))
        assert sum(counts) == len(meta), f"stage {self.stage}: a BATCH message's chain rows are not grouped"
        return RowCaches(caches, starts, counts, masks)

    def _compute_batch(self, hdr: Header, t0: float) -> None:
        """The tokens of several requests (one each, or a branch point's W chains) as one step
        (eager): the table, then the rows."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._compute_batch(hdr, t0)
        R, H = hdr.rows, self.model.cfg.hidden_size
        p = next(self.model.parameters())
        calls0, coll0 = (self.group.calls, self.group.collective_s) if self.group is not None else (0, 0.0)
        meta = self.t.recv_into(self.prev, torch.empty(R, META_LEN, dtype=torch.int64), self.timeout, self.handled)
        if self.stage == 0:
            h = self.model.embed(meta[None, :, _TOKEN].to(p.device))  # [1, R, H]
        else:
            h = self.t.recv_into(self.prev, torch.empty(R, H, device=p.device, dtype=p.dtype), self.timeout,
                                 self.handled)[None]  # [1, R, H]
        t1 = time.perf_counter()
        caches = self._batch_caches(meta, p.device)
        out, caps = self.model.forward_layers(h, caches, 0, positions=meta[None, :, _POSITION].to(p.device),
                                              capture=self.capture)  # [1, R, H]
        if self.verifies:  # every row's T=0 argmax; the driver uses those of its greedy requests
            tv = time.perf_counter()
            meta[:, _REPLY] = self._argmax_rows(out[0])
            self.stats.verify_s += time.perf_counter() - tv
        t2 = time.perf_counter()
        self.handled += 1
        self.stats.compute_s += t2 - t1
        self.stats.messages += 1
        self.stats.rows += R
        self.stats.wait_s += t1 - t0
        if self.group is not None:
            self.stats.tp_collectives += self.group.calls - calls0
            self.stats.tp_collective_s += self.group.collective_s - coll0
        if self.trace is not None:
            self.trace += [t0, t1, t2]
        if self.next is not None:
            self.t.send(self.next, hdr, [meta, out[0]])
        if self.reports:
            tensors = {"meta": lambda: meta, "exit": lambda: out[0],
                       "anchors": lambda: torch.stack([caps[layer][0] for layer in self.anchor_layers], dim=1)}
            self.t.send(self.driver, hdr, [tensors[q.name]() for q in self.wire.to_driver(self.stage, hdr)])
        self.stats.send_s += time.perf_counter() - t2

    def _argmax_rows(self, out: torch.Tensor) -> torch.Tensor:
        """The target's argmax of each row of a BATCH step's or a suffix run's exit out [R, H]: ids [R]
        (int64, host).
        A vocab-parallel head (a TP stage) picks them across its ranks, every TP rank taking part;
        a screened head (kernels/screened_argmax.py) settles each row exactly from one int8 product
        for all rows, as a one-row step's verification does (the full fp32 head over R rows cost a
        batch's last stage most of its step on a CPU)."""
        if self.choose is None and self.model.screen is not None:
            return torch.tensor(self.model.greedy_tokens(out), dtype=torch.int64)  # host: the ids go in the table
        logits = self.model.logits_rows(out)  # [R, V], or this TP rank's [R, V/T]
        if self.choose is not None:
            return self.model.argmax_rows(logits)
        return logits.argmax(-1).cpu()  # host sync: the ids go in the table

    def _rows_out(self, out: torch.Tensor, caps: dict[int, torch.Tensor], T: int, report: bool,
                  written: bool) -> torch.Tensor:
        """The output rows to send, out [1, T, H] -> [T, H]: a one-row decode output in out1 (and,
        when this stage reports by message, its anchors in their rows), the buffers pinned with
        the transport; an eager step's layers wrote them already (`written`), a static step's are
        copied from its own buffers. Else a view of out."""
        if T > 1 or not self.pinned or (self.next is None and not report):
            return out[0]  # [T, H]
        if not written:
            self.out1_3d.copy_(out)
            if report:
                for dst, layer in zip(self._anchor_rows, self.anchor_layers):
                    dst.copy_(caps[layer])  # [1, 1, H]
        return self.out1  # [1, H]

    def _report(self, hdr: Header, row: torch.Tensor, caps: dict[int, torch.Tensor],
                replies: torch.Tensor | None = None) -> None:
        """The message to the driver: the anchors [T, k, H] (ascending) and, from the last stage, the
        exit `row` [T, H] and a suffix run's `replies` [T], as the wire format orders them."""
        if row is self.out1:  # a one-row decode report: the payloads are the pinned rows (_rows_out)
            self.t.send(self.driver, hdr, self._report1)
            return
        tensors = {"exit": lambda: row, "replies": lambda: replies}
        if self.anchor_ids:
            tensors["anchors"] = lambda: torch.stack([caps[layer][0] for layer in self.anchor_layers], dim=1)
        self.t.send(self.driver, hdr, [tensors[p.name]() for p in self.wire.to_driver(self.stage, hdr)])

    def _verify_token(self, out: torch.Tensor, pos: int) -> int:
        """T=0 verification's device work on the exit out [1, 1, H]: the target's argmax for pos + 1
        (at T > 0 the driver verifies against its q). Every TP rank of the stage computes it: a
        vocab-parallel head picks the token with a collective."""
        if self.verify_step is not None:
            return int(self.verify_step.run(out[0, -1]))  # host sync: the id goes in the header
        return self._next_token(out[0, -1], pos + 1)

    def _forward(self, h: torch.Tensor, hdr: Header) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The chains of a branch point: h [1, W, H], every row at `position`, each seeing the
        shared prefix and its own chain (engine/model/kv_cache.py chain slots)."""
        W, q, pos = hdr.rows, hdr.branch, hdr.position
        self.chain_width = W
        positions = torch.full((1, W), pos, dtype=torch.long, device=h.device)  # [1, W]
        mask = chain_mask(q, pos, W, h.device)  # [1, 1, W, slot0 + W]
        return self.model.forward_layers(h, self.cache, chain_slot0(q, pos, W), positions, mask, self.capture)

    def _next_token(self, h: torch.Tensor, pos: int) -> int:
        """The head stage's token for position `pos` from the hidden state h [H] (argmax, or a keyed draw from p)."""
        if self.choose is not None:  # logits: this TP rank's vocabulary shard
            return self.choose(self.model.logits(h), self.sampling, pos)
        if self.sampling.greedy:
            return self.model.greedy_token(h)  # host sync inside: the id goes in the header
        probs = target_probs(self.model.logits(h), self.sampling)
        return sample(probs, keyed_generator(self.sampling.seed, pos, "target"))


def receive_stats(t: Transport, rank: int, timeout: float) -> dict:
    """A stage's STATS reply: per-request decode compute/wait/send seconds, decode message count, TP
    collectives and their seconds (inside the compute), verify seconds (inside the compute), the
    resident parameter bytes, all of the reporting rank (TP rank 0 of the stage), optional trace."""
    hdr = t.recv_header(rank, timeout)
    assert hdr.kind == Kind.STATS, hdr
    return StageStats.from_reply(t.recv_into(rank, torch.empty(hdr.length, dtype=torch.float64), timeout).tolist())
