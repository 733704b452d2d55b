"""Which live requests get a row in a tick when several share the pipeline (docs/design.md 3.12).
Pure logic: no torch.

With several live requests a stage step carries one row per request that has a token at that
stage (its branch width W rows at a branch point, 3.11). A token that enters stage 0 at tick t is
at stage p at tick t + p whatever happens meanwhile (a flushed one is computed as a stale row,
3.4), so the rows every stage step carries are fixed at stage 0: bounding the rows that *enter*
per tick bounds the rows of every stage step. This module decides, per tick, who enters:

- A request with live tokens in flight (fill > 0) enters every tick until its next rejection: its
  staircase has no gaps (3.3), so it cannot skip a tick without a flush. Only a request whose
  pipeline holds none of its live tokens (fill 0: its first token or a correction waits) may be
  held back.
- Latency-critical requests keep their single-stream schedule: their rows (together at most
  `max_rows`) are reserved from the moment they are live, so no other request starts in them and
  a critical request's first token or correction enters the tick after it is known, as it would
  alone. (If other requests already hold those rows when a critical one joins, it waits for
  their next rejections; no request is preempted.)
- Other requests start, in the order (priority, arrival), in the rows left over, up to
  `max_rows`; they fill the stage steps whose critical rows are stale after a rejection. The
  order is strict: a request that does not fit holds back the ones after it this tick, so a wide
  request (W > 1) is not overtaken forever.
- Newcomers' prompts travel through the same stage steps in chunks of at most `prefill_rows`
  tokens per tick in all (critical first, then priority, then arrival), on top of the decode
  rows: prefill never takes a decode row, and a stage step never carries more than
  `max_rows + prefill_rows` tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CRITICAL, BATCH = "critical", "batch"
LATENCY_CLASSES = (CRITICAL, BATCH)


@dataclass(frozen=True)
class BatchLimits:
    """The bounds of one pipeline: live requests (`--max-batch B`), decode rows per stage step and
    prompt tokens per stage step."""

    max_batch: int
    max_rows: int
    prefill_rows: int

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_rows", "prefill_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @classmethod
    def every_row(cls, max_batch: int, prefill_rows: int = 128) -> "BatchLimits":
        """Every live request gets its row every tick (max_rows = B); prompts in chunks of
        `prefill_rows` (by default the prefill chunk of 3.2)."""
        return cls(max_batch, max_batch, prefill_rows)


@dataclass(frozen=True)
class RequestView:
    """What the policy sees of one live request at the start of a tick."""

    rid: int
    arrival: int  # arrival order, unique among the live requests: earlier first among equals
    latency: str = BATCH  # CRITICAL: keeps its single-stream schedule
    priority: int = 0  # among BATCH requests: higher first
    fill: int = 0  # its live tokens in flight (0: nothing of it is live in the pipeline)
    rows: int = 1  # rows one of its stage steps carries at most (its branch width W)
    prompt_left: int = 0  # prompt tokens not yet sent to stage 0
    ready: bool = True  # it has a token to enter (false until its prefill's last chunk has left the pipeline)

    def __post_init__(self) -> None:
        if self.latency not in LATENCY_CLASSES:
            raise ValueError(f"latency must be one of {LATENCY_CLASSES}, got {self.latency!r}")
        for name in ("arrival", "fill", "prompt_left"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.rows < 1:
            raise ValueError(f"rows must be >= 1, got {self.rows}")
        if self.prompt_left and self.ready:
            raise ValueError(f"request {self.rid}: ready while {self.prompt_left} prompt tokens are unsent")
        if self.fill and not self.ready:
            raise ValueError(f"request {self.rid}: fill {self.fill} but not ready")

    @property
    def critical(self) -> bool:
        return self.latency == CRITICAL

    @property
    def running(self) -> bool:
        """Live tokens in flight: it must enter this tick (3.3's staircase has no gaps)."""
        return self.fill > 0


@dataclass(frozen=True)
class RowPlan:
    """One tick's decision."""

    enter: tuple[int, ...]  # requests entering a decode token: the running ones, then those starting
    started: tuple[int, ...]  # of them, the ones whose pipeline was empty (a first token or a correction)
    held: tuple[int, ...]  # ready requests at fill 0 that wait this tick
    prefill: tuple[tuple[int, int], ...]  # (request, prompt tokens) chunks entering this tick
    rows: int  # decode rows reserved by the entering requests (their widths), <= max_rows

    @property
    def prefill_tokens(self) -> int:
        return sum(k for _, k in self.prefill)


def _order(r: RequestView) -> tuple[int, int, int]:
    return (0 if r.critical else 1, -r.priority, r.arrival)


def plan_rows(requests: Sequence[RequestView], limits: BatchLimits) -> RowPlan:
    """Who enters stage 0 this tick (module docstring). `requests`: the live ones."""
    if len(requests) > limits.max_batch:
        raise ValueError(f"{len(requests)} live requests exceed max_batch {limits.max_batch}")
    if len({r.rid for r in requests}) != len(requests) or len({r.arrival for r in requests}) != len(requests):
        raise ValueError("requests: rid and arrival must be unique")
    wide = [r.rid for r in requests if r.rows > limits.max_rows]
    if wide:
        raise ValueError(f"requests {wide}: rows exceed max_rows {limits.max_rows}: they could never enter")
    critical = sum(r.rows for r in requests if r.critical)
    if critical > limits.max_rows:  # their schedules could not all be kept
        raise ValueError(f"critical requests need {critical} rows, more than max_rows {limits.max_rows}")
    running = [r for r in requests if r.running]
    used = sum(r.rows for r in running)
    if used > limits.max_rows:  # never under this policy: running requests were admitted within the bound
        raise ValueError(f"running requests hold {used} rows, more than max_rows {limits.max_rows}")
    free = limits.max_rows - used
    enter = [r.rid for r in sorted(running, key=_order)]
    started: list[int] = []
    held: list[int] = []
    waiting = sorted((r for r in requests if not r.running and r.ready), key=_order)
    # rows of critical requests not running now (waiting, or still in prefill): reserved for them
    reserved = sum(r.rows for r in requests if r.critical and not r.running)
    blocked = False
    for r in waiting:
        if r.critical:  # first in the order: its reserved rows, as far as running requests left them free
            if r.rows <= free:
                free -= r.rows
                reserved -= r.rows
                started.append(r.rid)
            else:
                held.append(r.rid)
        elif not blocked and r.rows <= free - reserved:
            free -= r.rows
            started.append(r.rid)
        else:
            blocked = True  # strict order among the non-critical ones
            held.append(r.rid)
    budget = limits.prefill_rows
    chunks: list[tuple[int, int]] = []
    for r in sorted((r for r in requests if r.prompt_left), key=_order):
        if budget == 0:
            break
        k = min(r.prompt_left, budget)
        chunks.append((r.rid, k))
        budget -= k
    return RowPlan(tuple(enter + started), tuple(started), tuple(held), tuple(chunks),
                   limits.max_rows - free)
