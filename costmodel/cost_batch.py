"""Predicted throughput and per-request latency with B requests in the pipeline (docs/design.md
3.12, `spd plan --batch 1,2,4,8`). Pure arithmetic: no torch. Times are milliseconds.

PREDICTED, never measured here: the runtime serves one request at a time today. Per B:

- Acceptance: B streams of requests (`--max-batch B`, a finished request's slot taken by the next
  at once) play the tick protocol under the batch policy (engine/protocol/batch_schedule.py
  simulate_batch) with seeded accept draws at alpha; the replay counts the ticks, every request's
  ticks from its first token to its last, the rows of every stage step (stale ones included: a
  flushed token is computed, 3.4) and the stage utilization.
- Cost of a step: a stage step carrying R rows costs `stage_ms * width_cost(R)`, from a measured
  W-row step over a one-row step (`spd measure stage-width-time`, docs/results/branch-width-step.md; `--width-cost`,
  as costmodel/cost_branches.py prices branch chains). That measurement is W tokens of one sequence
  (a tree step); B requests' rows share its matrix products but attend to B caches of their own:
  the same ratio is assumed. Between measured widths the ratio is interpolated (noted); beyond the
  widest it is refused. Each stage's time is its mean over its busy steps. The PDM runs once per
  tick over every entering request's rows and the head over every row of the last stage: both are
  scaled as a step of those rows (assumed, noted). Messages carry B rows.
- Tick: the steady critical cycle of costmodel/cost_model_spd.py on those times (every tick
  verifying; refill ticks verify nothing, so this is an upper bound on the mean tick).
- Throughput: decode tokens of all requests / (ticks * tick); per-request latency (TPOT): tick *
  the request's ticks from its first token to its last / its decode tokens (a live request's
  waits for a row included; a queued one's wait for a slot of B is not). Prefill is not priced
  (requests arrive with x_P known).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from spd_engine.costmodel.cost_inputs import Profile, note
from spd_engine.costmodel.cost_model_spd import build_spd_case, spd_cycles
from spd_engine.costmodel.cost_partitions import stage_times
from spd_engine.engine.protocol.batch_policy import BatchLimits
from spd_engine.engine.protocol.batch_schedule import BatchRun, RequestScript, simulate_batch, utilization
from spd_engine.engine.protocol.topology import default_stage_layers


def width_ratio(width_cost: dict[int, float], rows: int, notes: list[str]) -> float:
    """A `rows`-row stage step's time over a one-row step's: as given (`--width-cost`, measured or
    labelled assumed), or linear between two given widths (noted); beyond the widest a ValueError."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    table = {1: 1.0, **width_cost}
    if rows in table:
        return table[rows]
    widest = max(table)
    if rows > widest:
        raise ValueError(f"no width cost for {rows} rows: give --width-cost {rows}:RATIO "
                         f"(spd measure stage-width-time --widths 1,{rows})")
    lo = max(w for w in table if w < rows)
    hi = min(w for w in table if w > rows)
    note(notes, "width costs between two given widths interpolated linearly (a replay's steps of fewer than B "
                "rows: a request leaving, the last ones draining)")
    return table[lo] + (table[hi] - table[lo]) * (rows - lo) / (hi - lo)


@dataclass(frozen=True)
class BatchReplay:
    """What the tick protocol's replay of B request streams counts (no times)."""

    batch: int
    max_rows: int
    ticks: int
    decode_tokens: int  # all requests'
    requests: int
    stage_rows: tuple[tuple[int, ...], ...]  # stage p: the rows of each of its busy steps
    entering: tuple[int, ...]  # rows entering stage 0 on each tick that any entered
    latency_ticks_per_token: float  # mean over requests: ticks from x_P known to its last token / decode tokens
    own_ticks_per_token: float  # mean over requests: ticks it entered a token / decode tokens (n / its EAL)
    utilization: tuple[float, ...]  # per stage
    overall_utilization: float
    rows_per_step: float


def replay_batch(n: int, batch: int, alpha: float, requests: int = 32, tokens: int = 128, seed: int = 0,
                 max_rows: int | None = None) -> BatchReplay:
    """`requests` requests of `tokens` tokens (x_P included), all waiting at tick 1, drafts
    accepted with probability alpha (seeded per request), under `--max-batch batch` and
    `max_rows` rows per stage step (default batch: every live request gets its row every tick)."""
    for name, value, least in (("batch", batch, 1), ("requests", requests, 1), ("tokens", tokens, 2)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    scripts = []
    for i in range(requests):
        # one seeded stream per request: every B replays the same requests, so only the batching differs
        rng = random.Random(seed * 1_000_003 + i)
        scripts.append(RequestScript(f"r{i}", tuple(rng.random() < alpha for _ in range(tokens - 1))))
    run = simulate_batch(n, scripts, BatchLimits(batch, max_rows or batch, 1))
    return summarize(run)


def summarize(run: BatchRun) -> BatchReplay:
    """The counts of a simulated run that the pricing reads."""
    decode = [r.tokens - 1 for r in run.requests]
    if min(decode) < 1:
        raise ValueError("every request must decode at least one token")
    stage_rows = tuple(tuple(sum(row.rows for row in bt.stages[p]) for bt in run.ticks if bt.stages[p])
                       for p in range(run.n))
    entering = tuple(k for k in (bt.plan.rows for bt in run.ticks) if k)
    # from x_P known to the last token: a live request's wait for a row counts, queueing for a slot does not
    lat = [(r.done_tick - r.first_token_tick) / d for r, d in zip(run.requests, decode)]
    own = [r.own_ticks / d for r, d in zip(run.requests, decode)]
    u = utilization(run)
    return BatchReplay(run.limits.max_batch, run.limits.max_rows, len(run.ticks), sum(decode), len(decode),
                       stage_rows, entering, sum(lat) / len(lat), sum(own) / len(own), u.per_stage, u.overall,
                       u.rows_per_step)


def _mean_ratio(rows: tuple[int, ...], width_cost: dict[int, float], notes: list[str]) -> float:
    return sum(width_ratio(width_cost, k, notes) for k in rows) / len(rows) if rows else 1.0


def batch_row(profile: Profile, link_of, replay: BatchReplay, alpha: float, colocate: bool,
              width_cost: dict[int, float], notes: list[str], verify_on_last: bool = True) -> dict:
    """One predicted row: the replay's B priced on a profile and links."""
    n = len(replay.stage_rows)
    base = list(profile.stage_ms[n]) if n in profile.stage_ms else \
        stage_times(profile, default_stage_layers(profile.num_layers, n))
    ratios = [_mean_ratio(rows, width_cost, notes) for rows in replay.stage_rows]
    pdm_ratio = _mean_ratio(replay.entering, width_cost, notes)  # the PDM's rows: every entering request's
    if replay.batch > 1:
        note(notes, "several requests: the PDM pass and the head over B requests' rows are priced as a B-row "
                    "stage step (--width-cost), an assumption")
    case = build_spd_case([c * r for c, r in zip(base, ratios)], profile.driver_work_for(n, notes) * pdm_ratio,
                          profile.verify_ms * ratios[-1], alpha, colocate,
                          profile.hidden * replay.max_rows,  # a message carries every row: B hidden states
                          profile.dtype_bytes, profile.anchors, link_of, verify_on_last=verify_on_last)
    tick = max(spd_cycles(case).values())
    return {"B": replay.batch, "max_rows": replay.max_rows, "n": n, "layout": "coloc" if colocate else "sep",
            "alpha": alpha, "rows_per_step": replay.rows_per_step, "stage_width_cost": ratios,
            "utilization": replay.overall_utilization, "stage_utilization": list(replay.utilization),
            "tick_ms": tick, "tok_s": 1e3 * replay.decode_tokens / (replay.ticks * tick),
            "tpot_ms": tick * replay.latency_ticks_per_token, "eal": n / replay.own_ticks_per_token,
            "predicted": True}


def batch_rows(profile: Profile, link_of, n: int, alpha: float, batches: list[int], colocate: bool,
               width_cost: dict[int, float], notes: list[str], verify_on_last: bool = True,
               replays: dict[int, BatchReplay] | None = None, seed: int = 0) -> list[dict]:
    """Predicted rows for each B, with each one's throughput and TPOT against B = the first one's
    (`x_first`); `replays` (B -> replay) are reused when given."""
    if not batches or min(batches) < 1:
        raise ValueError(f"--batch takes request counts >= 1, got {batches}")
    rows = []
    for b in batches:
        replay = replays[b] if replays and b in replays else replay_batch(n, b, alpha, seed=seed)
        rows.append(batch_row(profile, link_of, replay, alpha, colocate, width_cost, notes, verify_on_last))
    for r in rows:
        r["tok_s_x"] = r["tok_s"] / rows[0]["tok_s"]
        r["tpot_x"] = r["tpot_ms"] / rows[0]["tpot_ms"]
    return rows


def parse_batches(text: str) -> list[int]:
    """"1,2,4,8" -> [1, 2, 4, 8]."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--batch takes request counts, e.g. 1,2,4,8, got {text!r}") from None
    if not out or min(out) < 1:
        raise ValueError(f"--batch takes request counts >= 1, got {text!r}")
    return out
