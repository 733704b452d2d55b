"""A request in its slot of the decode loop (engine/runtime/batch_driver.py, docs/design.md 3.12):
the slot's driver-side buffers and lane, kept over the requests that take the slot (SlotParts), and
the live request (LiveRequest): its state, what arrived for it from the stages, its rows of a
tick's BATCH table and of the PDM pass, and its exiting entry's rows gathered for verification.
"""
from __future__ import annotations

import torch

from spd_engine.engine.model.greedy import prefill_chunks
from spd_engine.engine.protocol.batch_policy import RequestView
from spd_engine.engine.protocol.messages import META_FIELDS
from spd_engine.engine.protocol.tick import Entry, TickPlan
from spd_engine.engine.runtime.batch_links import Payloads
from spd_engine.engine.runtime.branch_chains import BranchChains
from spd_engine.engine.runtime.drafter import Drafter
from spd_engine.engine.runtime.driver_buffers import DriverBuffers
from spd_engine.engine.runtime.lane import Lane
from spd_engine.engine.runtime.request_state import RequestState
from spd_engine.engine.runtime.verifier import Verifier

_EPOCH, _POS, _REPLY, _CHAIN = (META_FIELDS.index(f) for f in ("epoch", "position", "reply", "chain"))


class SlotParts:
    """A request slot's driver-side buffers, made once and kept for every request that takes the
    slot (the transport pins the rings: they must live as long as it): its anchor rings (one per
    chain of a branch point, 3.11), exit rows (ring slot s, chain c at row s W + c), PDM cache and
    the lane over them. Every entry is written before it is read, by position. Slot 0's are the
    driver's own, with its static PDM and verification steps (engine/runtime/driver.py)."""

    def __init__(self, d, slot: int) -> None:
        W, H = d.branches.width, d.head.cfg.hidden_size
        # zeros, not empty: made once a slot; a read of a row never written (a bug, as the sampling
        # checks' broken drivers make) then gives the same wrong answer in every run
        self.exits = torch.zeros(d.buf.num_slots * W, H, device=d.device, dtype=d.dtype)
        if slot == 0:
            self.buf, self.pdm_cache, self.lane = d.buf, d.pdm_cache, d.lane
            self.verify_rows, self.verify_replies = d.verify_rows, d.verify_replies
            return
        self.buf = DriverBuffers(d.n, d.plan, H, W, d.device, d.dtype, d.max_run)
        # a pass over every chain writes (W - 1) n rows past the staircase's (BranchChains.chain_inputs)
        self.pdm_cache = d.pdm.new_cache(d.capacity + (W - 1) * d.n)
        # the exiting entry's exit rows gathered in the order the lane verifies them (Lane.verify_exit:
        # a suffix run's rows 0 .. L, or a branch point's chain rows), and the last stage's argmaxes
        rows = max(W, d.max_run)
        self.verify_rows = torch.empty(rows, H, device=d.device, dtype=d.dtype)  # [rows, H]
        self.verify_replies = torch.full((rows,), -1, dtype=torch.int64)  # [rows]
        drafter = Drafter(d.pdm, self.pdm_cache, self.buf, d.drafter.chooser, d.drafter.cross, {})
        verifier = Verifier(d.head, self.verify_rows, None, self.verify_replies)
        self.lane = Lane(drafter, BranchChains(d.branches.policy, drafter), verifier)


class LiveRequest:
    """One request in its slot: its state, its slot's lane and buffers, what arrived for it."""

    def __init__(self, run, index: int, slot: int, serial: int, request) -> None:
        """run: the decode loop (BatchDriver); request: its BatchRequest."""
        d = run.driver
        self.index, self.slot, self.serial, self.request = index, slot, serial, request
        self.req = RequestState(d.n, request.max_new_tokens, frozenset(request.eos_ids), request.sampling, 0,
                                request.draft_policy, request.on_token,
                                d.drafter.chooser.new_index(request.prompt), request.trace, run.max_run)
        parts = run.parts.get(slot)
        if parts is None:
            parts = run.parts[slot] = SlotParts(d, slot)
        self.buf, self.pdm_cache, self.exits, self.lane = parts.buf, parts.pdm_cache, parts.exits, parts.lane
        self.verify_rows, self.verify_replies = parts.verify_rows, parts.verify_replies
        self.width = d.branches.width
        # the table's reply field: -1 asks a verifying last stage for the row's T=0 argmax, -2 does
        # not (a sampled request, or one processing its logits, never uses it)
        self.ask_reply = -1 if request.sampling.greedy and not request.sampling.processes else -2
        self.replies = [-1] * len(self.exits)  # the last stage's argmax behind each exit row
        self.chain_width = 1  # chains of its last branch point sent: a survivor row names its width
        self.got = [(-1, -1)] * d.n  # per stage: (epoch, position) of its newest report for this request
        self.ids = torch.tensor(list(request.prompt), dtype=torch.long, device=d.device)
        self.chunks = prefill_chunks(len(request.prompt), d.chunk)
        self.sent_chunks = 0
        self.done_chunks = 0  # chunks whose rows are in the PDM cache
        self.chunk_anchors: dict[int, torch.Tensor] = {}  # chunk start -> [count, m, H]
        self.chunk_reports: dict[int, set[int]] = {}  # chunk start -> stages whose report arrived
        self.prefill_exit: torch.Tensor | None = None  # [H] the last chunk's last exit state
        self.decoding = False
        self.finished = False
        self.held = 0  # ticks it had a token to enter and the row bound held it back
        self.epoch_end: dict[int, int] = {}  # epoch -> the tick after which its rows are stale
        self.t_arrival = self.t_slot = self.t_first = self.t_last = 0.0  # arrived, took its slot, first, last token

    def view(self, width: int) -> RequestView:
        """What the row policy sees of it at the start of a tick (engine/protocol/batch_policy.py)."""
        r = self.request
        fill = len(self.req.state.inflight) if self.decoding else 0
        prompt_left = sum(count for _, count in self.chunks[self.sent_chunks:])
        rows = max(width, self.req.state.entry.rows) if self.decoding else width  # a suffix run's rows (3.13)
        return RequestView(self.serial, self.serial, r.latency, r.priority, fill, rows, prompt_left, self.decoding)

    def current(self, serial: int, epoch: int | None = None) -> bool:
        """Whether a report's row of (serial, epoch) is this request's live one (epoch None: any of
        its epochs, a prompt chunk's); else it is stale: flushed, or of an earlier request."""
        return serial == self.serial and epoch in (None, self.req.epoch)

    def take_row(self, s: int, row: list[int], r: int, payloads: Payloads, anchors: slice | None) -> None:
        """Row r of stage s's BATCH report, table row `row`: its anchors [m_s, H] into the rings
        (chain c's to rings[c], ring 0 being rings[0], the survivor's to ring 0 too), its exit [H]
        and the last stage's argmax into every chain's exit row (verification reads the
        representative's, Entry.row)."""
        pos, chain = row[_POS], row[_CHAIN]
        ring = self.buf.slot(pos)
        if anchors is not None:
            self.buf.rings[chain, ring, anchors] = payloads["anchors"][r]
            if chain and chain == self.row_of(pos):  # its branch point resolved before this arrived
                self.buf.ring[ring, anchors] = payloads["anchors"][r]
        if "exit" in payloads:
            self.exits[self.exit_row(pos, chain)] = payloads["exit"][r]
            self.replies[self.exit_row(pos, chain)] = row[_REPLY]
        self.got[s] = (row[_EPOCH], pos)

    def take_chunk(self, s: int, start: int, payloads: Payloads, anchors: slice | None) -> None:
        """Stage s's report of its prompt chunk at `start`: the anchors [count, m_s, H], the last
        stage's exit of the chunk's last row [H]."""
        if anchors is not None:
            self.chunk_anchors[start][:, anchors] = payloads["anchors"]
        if "exit" in payloads:
            self.prefill_exit = payloads["exit"][-1].clone()
        self.chunk_reports[start].add(s)

    def arrived(self, s: int, pos: int) -> bool:
        epoch, got = self.got[s]
        return epoch == self.req.epoch and got >= pos

    def exit_row(self, pos: int, chain: int) -> int:
        """The row of `exits` (and `replies`) holding the exit state of chain `chain`'s token at `pos`."""
        return self.buf.slot(pos) * self.width + chain

    def row_of(self, pos: int) -> int:
        """The representative chain of its in-flight token at `pos`: 0, or the survivor's once its
        branch point resolved (Entry.row)."""
        return next((e.row for e in self.req.state.inflight if e.pos == pos), 0)

    def meta_rows(self, e: Entry) -> list[list[int]]:
        """Its entering entry's rows of a BATCH table (META_FIELDS): one; the W chains of its
        branch point, whose width a later survivor row names again; or a suffix run's tokens, one
        row per position (3.13), which a stage steps as one causal span of its slot's cache."""
        head = [self.slot, self.serial, e.epoch]
        if e.chains:
            self.chain_width = e.rows
            return [head + [e.pos, tok, self.ask_reply, e.branch, c, e.rows, -1] for c, tok in enumerate(e.chains)]
        if e.run:
            assert e.branch < 0 and e.survivor < 0, f"a suffix run at {e.pos} beside a branch point"
            return [head + [e.pos + i, tok, self.ask_reply, -1, 0, 1, -1] for i, tok in enumerate(e.tokens)]
        width = self.chain_width if e.survivor >= 0 else 1
        return [head + [e.pos, e.token, self.ask_reply, e.branch, 0, width, e.survivor]]

    def pdm_inputs(self, plan: TickPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A request's rows of the tick's PDM pass, their positions and mask (None: causal): its
        staircase, or with a branch point in flight every chain's rows (BranchChains.chain_inputs)."""
        if plan.branch is not None:
            return self.lane.branches.chain_inputs(plan)
        rows = self.lane.drafter.tick_rows(plan)  # [R, H]
        return rows, torch.arange(plan.pdm_pos, plan.pdm_pos + len(rows), device=rows.device), None

    def gather_exit(self, ex: Entry, greedy_reply: bool) -> int:
        """The exiting entry's exit rows into verify_rows as Lane.verify_exit reads them (a suffix
        run's rows 0 .. L, each at its position; else its representative chain's at row ex.row) and
        the last stage's argmaxes into verify_replies; returns the reply the lane takes (-1: none)."""
        rows = [(i, self.exit_row(ex.pos + i, 0)) for i in range(len(ex.tokens))] if ex.run else \
            [(ex.row, self.exit_row(ex.pos, ex.row))]
        for dest, src in rows:
            self.verify_rows[dest] = self.exits[src]
            self.verify_replies[dest] = self.replies[src]
        return int(self.verify_replies[rows[0][0]]) if greedy_reply else -1
