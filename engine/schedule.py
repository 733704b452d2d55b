"""Tick arithmetic and a printable simulation of the SPD decode loop. Pure logic, no torch.

With N generated tokens (the first from the prefill logits) and R rejections that are followed
by at least one more committed token, decoding takes `(N-1) + (n-1)(1+R)` ticks: one per
committed token after the first, plus an (n-1)-tick fill at the start and after every such
rejection. `simulate` plays the tick loop itself (which stage holds which token, the PDM rows,
the PDM cache, verification, flush, the stages' lazy KV rollback) so the formula and the
runtime's bookkeeping can be checked against it. Positions are offsets from P, the position
of the first generated token x_P; the prompt is at offsets < 0.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

FIRST, DRAFT, CORRECTION, STALE = "first", "draft", "correction", "stale"


def decode_ticks(tokens: int, n: int, rejections: int) -> int:
    """Decode ticks for N generated tokens on n stages with R rejections followed by a token."""
    if tokens < 1 or n < 1:
        raise ValueError(f"need tokens >= 1 and n >= 1, got tokens={tokens}, n={n}")
    if not 0 <= rejections <= max(tokens - 2, 0):
        raise ValueError(f"{rejections} rejections followed by another token is impossible with {tokens} tokens")
    return 0 if tokens == 1 else (tokens - 1) + (n - 1) * (1 + rejections)


def eal(n: int, decode_tokens: int, ticks: int) -> float:
    """Equivalent accept length n * decode tokens / ticks (nan when nothing was decoded)."""
    if ticks < 0 or decode_tokens < 0 or (ticks == 0) != (decode_tokens == 0):
        raise ValueError(f"inconsistent counts: {decode_tokens} decode tokens in {ticks} ticks")
    return float("nan") if ticks == 0 else n * decode_tokens / ticks


def pooled_eal(n: int, tokens: Iterable[int], ticks: Iterable[int]) -> float:
    """EAL over a prompt set: n * sum(N - 1) / sum(ticks), with N the tokens of each prompt."""
    return eal(n, sum(t - 1 for t in tokens), sum(ticks))


def expected_eal(n: int, alpha: float) -> float:
    """Long-run EAL for per-draft acceptance alpha: n / (1 + (n-1)(1-alpha))."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return n / (1 + (n - 1) * (1 - alpha))


@dataclass(frozen=True)
class Token:
    """A token in the pipeline. epoch = flushes before it was made (a draft prints that many primes)."""

    position: int
    kind: str  # FIRST | DRAFT | CORRECTION | STALE (a draft in flight when a flush dropped it)
    epoch: int


@dataclass(frozen=True)
class Row:
    """One PDM input row: position `pos` aggregated at `depth`; pending = full-depth row cached this tick."""

    position: int
    depth: int
    pending: bool = False


@dataclass(frozen=True)
class Verification:
    exiting: Token  # the token that left the last stage; its logits verify `draft`
    draft: Token
    accepted: bool


@dataclass(frozen=True)
class TickRecord:
    tick: int  # 1-based decode tick
    stages: tuple[Token | None, ...]  # token stage p computes during the tick
    rollback: tuple[int | None, ...]  # KV length stage p cuts back to before writing, None if no cut
    rows: tuple[Row, ...]  # PDM rows: pending full-depth row first, then the staircase by position
    draft: Token  # the PDM's draft for the position after the newest live token
    cache_end: int  # after the tick the PDM cache holds the full-depth rows of positions < cache_end
    verify: Verification | None
    committed: Token | None  # token committed after the tick (accepted draft or correction)
    tokens: int  # committed tokens after the tick, x_P included

    @property
    def flushed(self) -> bool:
        return self.verify is not None and not self.verify.accepted


def simulate(n: int, verdicts: Iterable[bool], max_tokens: int | None = None) -> list[TickRecord]:
    """Play decode ticks on n stages, taking each verification's accept/reject from `verdicts`.

    Stops once `max_tokens` tokens are committed (x_P counts as the first); by default
    1 + len(verdicts), i.e. every verdict is used. The run ends right after its last commit,
    so a correction that ends the run costs no refill.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    verdicts = list(verdicts)
    if max_tokens is None:
        max_tokens = 1 + len(verdicts)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if len(verdicts) < max_tokens - 1:
        raise ValueError(f"{len(verdicts)} verdicts cannot commit {max_tokens} tokens (needs {max_tokens - 1})")
    pipe: list[Token | None] = [Token(0, FIRST, 0)] + [None] * (n - 1)  # token at stage p next tick
    kv = [0] * n  # KV length of each stage (offsets): the prompt fills positions < P
    records: list[TickRecord] = []
    tokens, epoch, cache_end, pending, used = 1, 0, 0, None, 0
    while tokens < max_tokens:
        live = [(p, t) for p, t in enumerate(pipe) if t is not None and t.kind != STALE]
        rows = ([Row(pending, n, True)] if pending is not None else []) + \
               [Row(t.position, p) for p, t in reversed(live)]
        draft = Token(pipe[0].position + 1, DRAFT, epoch)  # stage 0 always holds the newest live token
        if pending is not None:
            cache_end = pending + 1  # the pending row stays in the cache, the staircase is cropped
        rollback = []
        for p, t in enumerate(pipe):
            # a stage sets its KV length to the incoming position before writing (lazy rollback)
            rollback.append(t.position if t is not None and t.position < kv[p] else None)
            if t is not None:
                kv[p] = t.position + 1
        exiting, verify, committed, pending = pipe[-1], None, None, None
        if exiting is not None and exiting.kind != STALE:
            target = pipe[-2] if n > 1 else draft
            assert target is not None and target.kind == DRAFT and target.position == exiting.position + 1
            accepted = bool(verdicts[used])
            used += 1
            verify = Verification(exiting, target, accepted)
            committed = target if accepted else Token(target.position, CORRECTION, epoch + 1)
            tokens += 1
            pending = exiting.position  # its full-depth row reaches the PDM next tick
        records.append(TickRecord(len(records) + 1, tuple(pipe), tuple(rollback), tuple(rows), draft,
                                  cache_end, verify, committed, tokens))
        if verify is not None and not verify.accepted:
            epoch += 1  # flush: the correction enters stage 0, in-flight drafts go stale
            pipe = [committed] + [replace(t, kind=STALE) if t is not None else None for t in pipe[:-1]]
        else:
            pipe = [draft] + pipe[:-1]
    return records


def _pos(position: int) -> str:
    return "P" if position == 0 else f"P{position:+d}"


def _label(token: Token) -> str:
    if token.kind == FIRST:
        return f"x_{_pos(token.position)}"
    if token.kind == CORRECTION:
        return f"c_{{{_pos(token.position)}}}"
    return f"d{chr(39) * token.epoch}_{{{_pos(token.position)}}}"


def _stage_cell(token: Token | None) -> str:
    if token is None:
        return ""
    return "(stale)" if token.kind == STALE else _label(token)


def _rows_cell(record: TickRecord, previous: TickRecord | None) -> str:
    rows = ", ".join(f"{_pos(r.position)}@{r.depth}{'*' if r.pending else ''}" for r in record.rows)
    cell = f"[{rows}] -> {_label(record.draft)}"
    if previous is None or previous.cache_end != record.cache_end:
        cell += f"; cache 0..{_pos(record.cache_end - 1)}"
    return cell


def _verify_cells(record: TickRecord) -> tuple[str, str]:
    v = record.verify
    if v is None:
        return "", ""
    verdict = "accept" if v.accepted else "reject"
    verify = f"logits({_label(v.exiting)}) vs {_label(v.draft)}: {verdict}"
    if v.accepted:
        return verify, f"emit {_pos(v.draft.position)}"
    result = f"emit {_label(record.committed)}, flush"
    if record.draft != v.draft:  # with n = 1 the tick's own draft is the one just rejected
        result += f"; {_label(record.draft)} dropped"
    return verify, result


def format_schedule(records: list[TickRecord]) -> str:
    """A Markdown table of the ticks, in the layout of the worked example in DESIGN 3.3."""
    if not records:
        return "(no decode ticks: the run ended with the prefill token)"
    n = len(records[0].stages)
    lines = ["| tick | " + " | ".join(f"S{p}" for p in range(n)) + " | PDM rows -> draft | verify | result |",
             "|---" * (n + 4) + "|"]
    previous = None
    for record in records:
        cells = [str(record.tick)] + [_stage_cell(t) for t in record.stages]
        cells += [_rows_cell(record, previous), *_verify_cells(record)]
        lines.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
        previous = record
    return "\n".join(lines)
