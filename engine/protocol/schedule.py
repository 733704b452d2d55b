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

from dataclasses import dataclass
from typing import Iterable

from spd_engine.engine.protocol.tick import Draft, Entry, Row, TickState, Verdict

FIRST, DRAFT, CORRECTION, STALE = "first", "draft", "correction", "stale"
_FIRST_ID, _DRAFT_ID, _CORRECTION_ID = 0, 1, 2  # token ids that stand for the kinds in the state machine


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

    The tick loop is engine/protocol/tick.py's state machine; this adds what each stage holds (stale
    tokens included) and the stages' lazy KV rollback. Stops once `max_tokens` tokens are
    committed (x_P counts as the first); by default 1 + len(verdicts), i.e. every verdict is
    used. The run ends right after its last commit, so a correction that ends the run costs no
    refill.
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
    kinds = {_FIRST_ID: FIRST, _DRAFT_ID: DRAFT, _CORRECTION_ID: CORRECTION}
    state = TickState(n, 0, _FIRST_ID)
    entered: list[Entry] = []  # entered[k - 1]: the token that entered stage 0 at tick k
    kv = [0] * n  # KV length of each stage (offsets): the prompt fills positions < P
    records: list[TickRecord] = []
    used = 0
    while state.committed < max_tokens:
        plan = state.plan()
        entered.extend(plan.enter)

        def token(e: Entry, live: bool = True) -> Token:
            return Token(e.pos, kinds[e.token] if live else STALE, e.epoch)

        pipe = [entered[plan.tick - 1 - p] if plan.tick - p >= 1 else None for p in range(n)]
        stages = tuple(None if e is None else token(e, e.epoch == state.epoch) for e in pipe)
        rollback = []
        for p, e in enumerate(pipe):
            # a stage sets its KV length to the incoming position before writing (lazy rollback)
            rollback.append(e.pos if e is not None and e.pos < kv[p] else None)
            if e is not None:
                kv[p] = e.pos + 1
        draft = Token(plan.draft_pos, DRAFT, state.epoch)
        verify, verdict = None, None
        if plan.exit is not None:
            accepted = bool(verdicts[used])
            used += 1
            verdict = Verdict(accepted, _DRAFT_ID if accepted else _CORRECTION_ID)
            behind = token(plan.proposed) if plan.proposed is not None else draft
            verify = Verification(token(plan.exit), behind, accepted)
        committed = state.advance([Draft(plan.draft_pos, _DRAFT_ID)], verdict)
        records.append(TickRecord(plan.tick, stages, tuple(rollback), tuple(plan.rows), draft, state.pdm_len,
                                  verify, None if committed is None else token(committed), state.committed))
    return records


def position_label(position: int) -> str:
    return "P" if position == 0 else f"P{position:+d}"


def token_label(token: Token) -> str:
    if token.kind == FIRST:
        return f"x_{position_label(token.position)}"
    if token.kind == CORRECTION:
        return f"c_{{{position_label(token.position)}}}"
    return f"d{chr(39) * token.epoch}_{{{position_label(token.position)}}}"


def _stage_cell(token: Token | None) -> str:
    if token is None:
        return ""
    return "(stale)" if token.kind == STALE else token_label(token)


def _rows_cell(record: TickRecord, previous: TickRecord | None) -> str:
    rows = ", ".join(f"{position_label(r.pos)}@{r.depth}{'*' if r.pending else ''}" for r in record.rows)
    cell = f"[{rows}] -> {token_label(record.draft)}"
    if previous is None or previous.cache_end != record.cache_end:
        cell += f"; cache 0..{position_label(record.cache_end - 1)}"
    return cell


def _verify_cells(record: TickRecord) -> tuple[str, str]:
    v = record.verify
    if v is None:
        return "", ""
    verdict = "accept" if v.accepted else "reject"
    verify = f"logits({token_label(v.exiting)}) vs {token_label(v.draft)}: {verdict}"
    if v.accepted:
        return verify, f"emit {position_label(v.draft.position)}"
    result = f"emit {token_label(record.committed)}, flush"
    if record.draft != v.draft:  # with n = 1 the tick's own draft is the one just rejected
        result += f"; {token_label(record.draft)} dropped"
    return verify, result


def format_schedule(records: list[TickRecord]) -> str:
    """A Markdown table of the ticks, in the layout of the worked example in docs/design.md 3.3."""
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
