"""The wire format: the integer header every pipeline message carries and what follows it
(docs/design.md 3.4).

A message is a header, then zero or more payload tensors, in an order that is a function of
the header and of who sends it to whom: `WireFormat` is that function, used by the driver,
the stage workers and the pp/ar baselines alike, so sender and receiver cannot disagree on
what follows (a disagreement would hang the end-of-request drain).

The header travels as its own int64 tensor, never inside a bf16 payload (integers above 256
are not exact there). Fields:
- kind: what the message is (Kind)
- position: TOKEN: the token's position; PREFILL: the chunk's first position
- epoch: the driver's flush count when it sent the token; stale messages are recognised by it
- token: TOKEN from the driver to stage 0: the token id entering the pipeline
- length: PREFILL: tokens in the chunk; STATS: float64 values that follow
- reply: a head stage's (pp/ar) token for the position after the message's last one (-1: none;
  SPD's decode rows carry a verifying last stage's argmaxes in their BATCH table)
- rows: BATCH: the rows of its table (a TOKEN message is one token: the pp / ar baselines' decode)
- slot: with several requests in the pipeline (docs/design.md 3.12), a PREFILL chunk's request
  slot, whose KV cache it fills (its `epoch` is then the request's serial); 0 otherwise

A BATCH message carries the entry of each of several requests (a request with a branch point in
flight: its W chains' tokens; a suffix run: a row per token, consecutive positions); its first
payload is an int64 [rows, META_LEN] table, one row per token (META_FIELDS): the request slot whose
KV cache the token uses, the request's serial (which request holds that slot), its epoch in that
request, its position, its id (stage 0 embeds it), the last stage's T=0 argmax behind it (-1: not
computed), and for branch points (docs/design.md 3.11): the branch point's position (-1: none), the
row's chain and the branch point's width W (on a survivor row: the resolved one's), and the surviving
chain (-1: none), whose KV entries each stage keeps.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import torch

HEADER_FIELDS = ("kind", "position", "epoch", "token", "length", "reply", "rows", "slot")
HEADER_LEN = len(HEADER_FIELDS)
META_FIELDS = ("slot", "serial", "epoch", "position", "token", "reply", "branch", "chain", "width", "survivor")
META_LEN = len(META_FIELDS)
CONFIG_LEN = 4  # int64 values of a CONFIG payload (sampling_payload)


class Kind(IntEnum):
    TOKEN = 1  # one token at `position` (stage 0 reads the id from `token`): the pp / ar decode
    PREFILL = 2  # a chunk of `length` tokens starting at `position`
    END = 3  # end of request: stages reply with their stats and idle
    SHUTDOWN = 4  # stop the worker loop
    STATS = 5  # a stage's per-request timing: `length` float64 values follow
    CONFIG = 6  # per-request sampling parameters for a head stage: int64 [CONFIG_LEN] follows
    BATCH = 7  # `rows` token rows (entries of one or more requests): int64 [rows, META_LEN] follows, then the rows


class Header(NamedTuple):
    """A message's integer header. A named tuple, not a dataclass: one is built and one parsed
    per message on the tick's hot path, where a frozen dataclass's per-field setattr is the
    cost (docs/results/tick-cost-2core.md, "Cold caches")."""

    kind: Kind
    position: int = 0
    epoch: int = 0
    token: int = 0
    length: int = 0
    reply: int = 0
    rows: int = 1
    slot: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens whose hidden states the message carries (0 for control messages)."""
        if self.kind == Kind.TOKEN:
            return 1
        if self.kind == Kind.BATCH:
            return self.rows
        return self.length if self.kind == Kind.PREFILL else 0

    def to_ints(self) -> tuple[int, ...]:
        return (int(self.kind), *self[1:])

    @classmethod
    def from_ints(cls, values: Sequence[int]) -> "Header":
        assert len(values) == HEADER_LEN, values
        kind = _KINDS.get(values[0])
        if kind is None:
            raise RuntimeError(f"corrupt message header {list(values)}")
        return _new(cls, (kind, *values[1:]))  # tuple.__new__: a named tuple's own __new__ is Python

    def with_reply(self, reply: int) -> "Header":
        """This header with `reply` set (a head stage's token): `_replace` runs a few Python
        calls, on the path from a stage's head to its report."""
        return _new(Header, (*self[:_REPLY], reply, *self[_REPLY + 1:]))

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(self.to_ints(), dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Header":
        return cls.from_ints([int(x) for x in t.tolist()])


_KINDS = {int(k): k for k in Kind}
assert Header._fields == HEADER_FIELDS
_new = tuple.__new__
_REPLY = HEADER_FIELDS.index("reply")


@dataclass(frozen=True)
class Payload:
    """One tensor that follows a header: `kind` act (the model's dtype), int64 or float64."""

    name: str
    shape: tuple[int, ...]
    kind: str = "act"


@dataclass(frozen=True)
class WireFormat:
    """What follows each header on each link of one run.

    stage_anchors[s]: how many anchor states stage s sends the driver per token (0 for pp/ar);
    head_on_last: the last stage holds the head and replies with a token (pp/ar) instead of
    its exit hidden state (spd).
    verify_on_last: SPD, the last stage holds the head too: its BATCH reports carry the exit hidden
    states as always and, in each row's `reply` that asks for it (T=0), the target's argmax, so that
    the busiest rank, the co-located driver's, never runs the head over the exit rows.
    """

    hidden: int
    stage_anchors: tuple[int, ...]
    head_on_last: bool = False
    verify_on_last: bool = False

    def __post_init__(self) -> None:
        assert not (self.head_on_last and self.verify_on_last), "a head stage replies a token or verifies, not both"

    @property
    def head_on_last_stage(self) -> bool:
        """Whether the last stage holds the final norm and LM head (pp/ar, or SPD verifying there)."""
        return self.head_on_last or self.verify_on_last

    @property
    def n(self) -> int:
        return len(self.stage_anchors)

    def reports_to_driver(self, stage: int) -> bool:
        """Whether every token / prefill message this stage computes produces one message to the driver."""
        last = stage == self.n - 1
        return last if self.head_on_last else (self.stage_anchors[stage] > 0 or last)

    def from_driver(self, hdr: Header) -> tuple[Payload, ...]:
        """What follows a header the driver sends to stage 0."""
        if hdr.kind == Kind.PREFILL:
            return (Payload("ids", (hdr.length,), "int64"),)
        if hdr.kind == Kind.CONFIG:
            return (Payload("sampling", (CONFIG_LEN,), "int64"),)
        if hdr.kind == Kind.BATCH:
            return (_meta(hdr),)  # the ids are in the table
        return ()  # TOKEN: the id is in the header

    def downstream(self, hdr: Header) -> tuple[Payload, ...]:
        """What follows a header stage s sends to stage s + 1."""
        if hdr.kind in (Kind.TOKEN, Kind.PREFILL):
            return (Payload("hidden", (hdr.num_tokens, self.hidden)),)
        if hdr.kind == Kind.BATCH:
            return (_meta(hdr), Payload("hidden", (hdr.rows, self.hidden)))
        if hdr.kind == Kind.CONFIG:
            return (Payload("sampling", (CONFIG_LEN,), "int64"),)
        return ()

    def to_driver(self, stage: int, hdr: Header) -> tuple[Payload, ...]:
        """What follows a header stage `stage` sends to the driver."""
        if hdr.kind == Kind.STATS:
            return (Payload("stats", (hdr.length,), "float64"),)
        if hdr.kind == Kind.BATCH:
            return (_meta(hdr), *_token_report(self, stage, hdr.rows))
        assert hdr.kind in (Kind.TOKEN, Kind.PREFILL), hdr
        return _token_report(self, stage, hdr.num_tokens)


def _meta(hdr: Header) -> Payload:
    """A BATCH message's table: one int64 row of META_FIELDS per token."""
    return Payload("meta", (hdr.rows, META_LEN), "int64")


@functools.lru_cache(maxsize=4096)
def _token_report(wire: WireFormat, stage: int, T: int) -> tuple[Payload, ...]:
    """What follows a token or prefill report of T tokens from `stage` (built once per shape: it is
    asked on every tick)."""
    k = wire.stage_anchors[stage]
    out = []
    if k:
        out.append(Payload("anchors", (T, k, wire.hidden)))  # anchors in ascending order
    if stage == wire.n - 1 and not wire.head_on_last:
        out.append(Payload("exit", (T, wire.hidden)))  # the last stage's output hidden state
    return tuple(out)


def payload_bytes(payloads: tuple[Payload, ...], act_itemsize: int) -> int:
    """Bytes of a payload list: activations in the model's dtype, the rest 8-byte integers/floats."""
    total = 0
    for p in payloads:
        count = 1
        for d in p.shape:
            count *= d
        total += count * (act_itemsize if p.kind == "act" else 8)
    return total


def link_frames(topo, wire: WireFormat, act_itemsize: int, width: int = 1) -> dict[tuple[int, int], int]:
    """Inline payload bytes of every directed link (src rank, dst rank) of a run on `topo`
    (engine/protocol/topology.py Topology): what a decode-tick message carries there, the chains of a
    branch point of `width` included, so that each tick costs one message per hop (larger
    messages, prefill chunks and statistics, send their payloads after the frame)."""
    frames: dict[tuple[int, int], int] = {}

    def add(src: int, dst: int, payloads: tuple[Payload, ...]) -> None:
        if src != dst:  # the co-located driver and stage 0 talk in-process
            frames[(src, dst)] = max(frames.get((src, dst), 0), payload_bytes(payloads, act_itemsize))

    # pp / ar decode a TOKEN a tick; SPD a BATCH message, a request alone's entry one row (W: chains)
    tick = Header(Kind.TOKEN) if wire.head_on_last else Header(Kind.BATCH, rows=width)
    for t in range(topo.tp):  # TP rank t talks to TP rank t of the next stage (docs/design.md 3.9)
        add(topo.driver_rank, topo.stage_rank(0, t), wire.from_driver(tick))
    for s in range(topo.n):
        if s + 1 < topo.n:
            for t in range(topo.tp):
                add(topo.stage_rank(s, t), topo.stage_rank(s + 1, t), wire.downstream(tick))
        if wire.reports_to_driver(s):
            add(topo.stage_rank(s), topo.driver_rank, wire.to_driver(s, tick))
    return frames


def sampling_payload(temperature: float, top_k: int, top_p: float, seed: int) -> torch.Tensor:
    """Sampling parameters as an exact int64 [CONFIG_LEN] payload (floats travel as their bit patterns)."""
    bits = torch.tensor([temperature, top_p], dtype=torch.float64).view(torch.int64)
    return torch.tensor([int(bits[0]), top_k, int(bits[1]), seed], dtype=torch.int64)


def parse_sampling_payload(t: torch.Tensor) -> tuple[float, int, float, int]:
    floats = torch.stack([t[0], t[2]]).view(torch.float64).tolist()
    return floats[0], int(t[1]), floats[1], int(t[3])
