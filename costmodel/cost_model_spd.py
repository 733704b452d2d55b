"""The SPD case of the cost model: one configuration's tick as a timed event graph, its
steady-state cycle means, a simulation with seeded accept draws, tokens/s, and the prediction
of a tick replay (bench/tick_replay.py). Pure arithmetic: no torch. Times are milliseconds.

SPD is a timed event graph (docs/design.md 3.3). Stage p starts token e when its input arrived and it
finished token e-1; the driver at tick t starts the PDM when it has posted the previous token
and the anchors of tick t-1 that its rows need have arrived, then verifies the exit of the
oldest token (in series: the next token for stage 0 is known only after verification) and
sends the next token. Where T=0 verification's head runs (`verify_on_last`, from the runtime's
`--verify-at` by `verifies_on_last`, docs/design.md 3.5): on the last stage (n >= 2), it is part of
that stage's work on every token step (stale ones too: the stage cannot tell), and the driver's
"verification" is an integer compare, priced as nothing; on the driver, the driver pays it on
every tick that verifies. `simulate_spd` evaluates these max-plus recurrences tick by tick on
the engine's tick protocol (engine/protocol/tick.py) with seeded accept draws (rejections refill the
pipeline for n-1 ticks without verification). With every draft accepted the tick converges
to the largest cycle mean, `spd_cycles` (v = verify_ms; v_L = v on the last stage, else 0;
v_D = v on the driver, else 0):
  stage p:            read its input + c_p (+ v_L for the last) + its send posts
  driver:             PDM + v_D + posts + reads       (co-located: + c_0)
  verify loop:        (h_tok + sum c + (n-1) h_act + h_exit + v) / n
  anchor loop via p:  (h_tok + c_0..c_p + p h_act + h_anchor + PDM + v_D) / (p + 2)
(plus the per-message post and read costs on each path). The verify loop carries v wherever
it runs: on the last stage it is before the exit hop, on the driver after it. The first-order
rule "tick = max(slowest stage, driver work)" is the first two lines; the loops add the hop
latencies.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from spd_engine.costmodel.cost_inputs import MESSAGE_PARTS, LinkModel, message_bytes
from spd_engine.engine.protocol.schedule import eal, expected_eal
from spd_engine.engine.protocol.tick import Draft, TickState, Verdict
from spd_engine.engine.protocol.topology import VERIFY_AT, verifies_on_last  # noqa: F401 (the runtime's rule, re-exported)

_DRAFT, _CORRECTION = 1, 2  # token ids that stand for a draft and a correction in the tick protocol


def eal_for_request(n: int, alpha: float, tokens: int) -> float:
    """Expected EAL of one request that commits `tokens` (N >= 2) tokens: n (N-1) / ticks with
    ticks = (N-1) + (n-1)(1 + R) (engine/protocol/schedule.py decode_ticks) and R = (N-2)(1-alpha) expected
    rejections followed by a token. The initial fill costs n-1 ticks whatever alpha is, so short
    requests fall below the steady state (engine/protocol/schedule.py expected_eal), which this approaches
    as N grows."""
    if tokens < 2 or not 0 <= alpha <= 1:
        raise ValueError(f"need tokens >= 2 and alpha in [0, 1], got tokens={tokens}, alpha={alpha}")
    ticks = (tokens - 1) + (n - 1) * (1 + (tokens - 2) * (1 - alpha))
    return eal(n, tokens - 1, ticks)


@dataclass(frozen=True)
class SpdCase:
    """Everything one SPD configuration's tick depends on. Hops are one-way times in ms."""

    stage_ms: tuple[float, ...]
    pdm_ms: float
    verify_ms: float
    alpha: float
    colocate: bool
    hop_token_ms: float  # driver -> stage 0 (unused when co-located)
    hop_act_ms: tuple[float, ...]  # stage p -> p+1, n-1 entries
    hop_anchor_ms: tuple[float, ...]  # stage p -> driver, n-1 entries (last stage sends the exit)
    hop_exit_ms: float  # last stage -> driver: exit + its anchors
    post_ms: float = 0.0  # a rank's busy time per posted send
    recv_ms: float = 0.0  # a rank's busy time per message it reads (and re-posting the receive)
    late_ms: float = 0.0  # a receive posted after its send was, from posting to completion (rendezvous)
    verify_on_last: bool = True  # T=0 verification's head on the last stage (verifies_on_last), else the driver's
    # with verify_on_last: the share of exits the driver still verifies with its own head (a branch
    # point's chains: the last stage replies -1 for them, docs/design.md 3.5)
    driver_verify_share: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.driver_verify_share <= 1.0:
            raise ValueError(f"driver_verify_share must be in [0, 1], got {self.driver_verify_share}")

    @property
    def n(self) -> int:
        return len(self.stage_ms)

    @property
    def head_on_last(self) -> bool:
        """Whether the last stage runs the head: the runtime's RunConfig.verifies_on_last (at n = 1
        the last stage is stage 0 and the driver verifies)."""
        return self.verify_on_last and self.n >= 2

    @property
    def last_head_ms(self) -> float:
        """The last stage's head time per token step (0 where the driver verifies)."""
        return self.verify_ms * (1.0 - self.driver_verify_share) if self.head_on_last else 0.0

    @property
    def driver_verify_ms(self) -> float:
        """The driver's verification time per verifying tick (its integer compare counts as 0)."""
        return self.verify_ms * self.driver_verify_share if self.head_on_last else self.verify_ms

    @property
    def stage_work_ms(self) -> tuple[float, ...]:
        """Per-stage compute per token step, the last stage's head included where it verifies."""
        return self.stage_ms[:-1] + (self.stage_ms[-1] + self.last_head_ms,)


def _input_parts(p: int) -> int:
    """Tensors of stage p's input message: the token (a header) for stage 0, else an activation."""
    return MESSAGE_PARTS["token" if p == 0 else "activation"]


def _received(posted: float, arrives: float, parts: int, rv: float, late: float) -> float:
    """When a message of `parts` tensors, whose first would arrive at `arrives` were its receive
    waiting, is taken in by a receiver that posts at `posted`: a receive posted after the send
    waits `late` (the rendezvous), and every further tensor is such a receive."""
    return max(posted + late, arrives) + rv + (parts - 1) * late


def spd_cycles(case: SpdCase) -> dict[str, float]:
    """Cycle means (ms per tick) of the steady state with every draft accepted; the tick
    converges to the largest. Per tick the driver reads the anchors of stages first..n-2 in
    order, runs the PDM, then reads the exit and verifies (docs/design.md 3.3). A message the
    receiver finds waiting costs `late_ms` per tensor; on a loop the first tensor is awaited."""
    c, n, po, rv, la = case.stage_work_ms, case.n, case.post_ms, case.recv_ms, case.late_ms
    first = 1 if case.colocate else 0
    anchors, exits = MESSAGE_PARTS["anchors"], MESSAGE_PARTS["exit"]
    v_d = case.driver_verify_ms
    work = "PDM" if case.head_on_last and not case.driver_verify_share else "PDM + verify"
    out = {}
    for p in range(first, n):
        label = f"stage {p} compute" + (" (+ verify)" if p == n - 1 and case.head_on_last else "")
        out[label] = rv + c[p] + (1 if p == n - 1 else 2) * po + _input_parts(p) * la
    reads = (n - first) * rv + ((n - 1 - first) * anchors + exits) * la  # anchors of stages first..n-2, the exit
    if case.colocate:
        out[f"rank 0: stage 0 + driver ({work})"] = c[0] + po + reads + case.pdm_ms + v_d
    else:
        out[f"driver: {work}"] = po + reads + case.pdm_ms + v_d
    tok = 0.0 if case.colocate else case.hop_token_ms
    extra = sum(_input_parts(p) - 1 for p in range(first, n)) + exits - 1  # tensors behind an awaited first one
    # the head is on this loop wherever it runs: c holds the last stage's share, v_d the driver's
    out["verify loop (token through all stages, verify, next token)"] = (
        tok + sum(c) + sum(case.hop_act_ms) + case.hop_exit_ms + (n - first + 1) * rv + v_d + extra * la) / n
    for p in range(first, n - 1):
        extra = sum(_input_parts(q) - 1 for q in range(first, p + 1)) + anchors - 1 \
            + (n - 2 - p) * anchors + exits  # awaited on the loop, then the messages found waiting
        # the driver's verification is on this loop (PDM, read the exit, verify, send); a last
        # stage's head is not: the exit it delays is the verify loop's
        delay = (tok + sum(c[:p + 1]) + sum(case.hop_act_ms[:p]) + (p + 1 - first) * rv + po
                 + case.hop_anchor_ms[p] + (n - 1 - p) * rv + case.pdm_ms + rv + v_d + extra * la)
        out[f"anchor loop via stage {p}"] = delay / (p + 2)
    return out


def simulate_spd(case: SpdCase, decode_tokens: int = 1000, seed: int = 0) -> dict:
    """Evaluate the tick recurrences; returns mean tick time over all ticks incl. refills.
    Which token enters, which anchor messages the rows need and which token leaves come from
    the engine's tick protocol (engine/protocol/tick.py TickState); this adds only the timing. The
    driver reads each stage's messages in FIFO order, paying `recv_ms` per message (and
    `late_ms` per tensor that was waiting), stale ones included, exactly when a later message
    of that stage is needed."""
    n, c, po, rv, la = case.n, case.stage_work_ms, case.post_ms, case.recv_ms, case.late_ms
    rng = random.Random(seed)
    first = 1 if case.colocate else 0
    state = TickState(n, 0, _DRAFT, anchor_stages=range(first, n - 1))
    free = [0.0] * n  # when each stage can start its next token
    msgs = [[0.0] for _ in range(n)]  # msgs[p][k]: arrival at the driver of stage p's message for the tick-k token
    read = [0] * n  # messages the driver has consumed per stage
    prev_send = 0.0  # when the driver made the token of this tick known (x_P at time 0)

    def consume(p: int, entered: int, t: float) -> float:
        parts = MESSAGE_PARTS["exit" if p == n - 1 else "anchors"]
        for m in range(read[p] + 1, entered + 1):
            t = _received(t, msgs[p][m], parts, rv, la)
        read[p] = max(read[p], entered)
        return t

    while True:
        tick = state.plan()
        if case.colocate:  # rank 0 runs stage 0 on this tick's token first
            end0 = prev_send + c[0]
            arrive, ready = end0 + case.hop_act_ms[0], end0 + po
        else:
            arrive, ready = prev_send + case.hop_token_ms, prev_send + po
        for p in range(first, n):  # every token flows through every stage, stale ones included
            end = _received(free[p], arrive, _input_parts(p), rv, la) + c[p]  # take in the input, compute
            if p == n - 1:
                msgs[p].append(end + case.hop_exit_ms)
                free[p] = end + po
            else:
                arrive = end + case.hop_act_ms[p]
                msgs[p].append(end + po + case.hop_anchor_ms[p])
                free[p] = end + 2 * po
        for p, entry in tick.anchor_reads:  # anchors of tick-1 needed by current-epoch rows
            ready = consume(p, entry.tick, ready)
        done = ready + case.pdm_ms
        verdict = None
        if tick.exit is not None:
            done = consume(n - 1, tick.exit.tick, done) + case.driver_verify_ms  # a verifying last stage: in c
            verdict = Verdict(True, _DRAFT) if rng.random() < case.alpha else Verdict(False, _CORRECTION)
        state.advance([Draft(tick.draft_pos, _DRAFT)], verdict)
        if state.committed - 1 == decode_tokens:  # the first token came from the prefill
            return {"tick_ms": done / tick.tick, "ticks": tick.tick, "time_ms": done,
                    "eal_sampled": n * decode_tokens / tick.tick}
        prev_send = done


def build_spd_case(stage_ms: list[float], pdm_ms: float, verify_ms: float, alpha: float, colocate: bool,
                   hidden: int, dtype_bytes: int, anchors: int, link_of, *, verify_on_last: bool = True,
                   driver_verify_share: float = 0.0) -> SpdCase:
    """`link_of(a, b)` gives the LinkModel between devices a and b (driver = device 0;
    stage p is device p+1, or device p when co-located). `stage_ms` excludes the head: with
    `verify_on_last` the case adds `verify_ms` to the last stage (SpdCase)."""
    n = len(stage_ms)
    sizes = message_bytes(hidden, dtype_bytes, anchors)
    dev = (lambda p: p) if colocate else (lambda p: p + 1)
    post = max(link_of(0, dev(p)).post_ms for p in range(n))
    return SpdCase(
        stage_ms=tuple(stage_ms), pdm_ms=pdm_ms, verify_ms=verify_ms, alpha=alpha, colocate=colocate,
        hop_token_ms=link_of(0, dev(0)).hop_ms(sizes["token"]),
        hop_act_ms=tuple(link_of(dev(p), dev(p + 1)).hop_ms(sizes["activation"]) for p in range(n - 1)),
        hop_anchor_ms=tuple(link_of(0, dev(p)).hop_ms(sizes["anchors"]) for p in range(n - 1)),
        hop_exit_ms=link_of(0, dev(n - 1)).hop_ms(sizes["exit"]), post_ms=post,
        recv_ms=max(link_of(0, dev(p)).read_ms for p in range(n)),
        # the runtime's transport posts each link's next decode frame as soon as one arrives
        # (engine/comm/transport.py), so no decode-tick message meets a late receive
        late_ms=0.0, verify_on_last=verify_on_last, driver_verify_share=driver_verify_share)


def predict_spd(case: SpdCase, decode_tokens: int = 1000, seed: int = 0) -> dict:
    """Tick time (simulated, rejections included), EAL from alpha, tokens/s, critical cycle."""
    sim = simulate_spd(case, decode_tokens, seed)
    cycles = spd_cycles(case)
    critical = max(cycles, key=cycles.get)
    eal = expected_eal(case.n, case.alpha)
    token_ms = case.n * sim["tick_ms"] / eal
    driver, slowest = case.pdm_ms + case.driver_verify_ms, max(case.stage_work_ms)
    return {"tick_ms": sim["tick_ms"], "steady_tick_ms": cycles[critical], "critical": critical,
            "eal": eal, "token_ms": token_ms, "tok_s": 1e3 / token_ms,
            "slowest_stage_ms": slowest, "driver_ms": driver, "driver_slack_ms": slowest - driver,
            "verify_at": "last" if case.head_on_last else "driver"}


def predict_replay(replay: dict, link: LinkModel, profiled: bool) -> dict:
    """Predict a tick-replay result (bench/tick_replay.py JSON) from link measurements taken in
    a separate netbench run. profiled=False uses the configured compute times; profiled=True
    uses the compute durations the replay measured (what a profile of the stages would give).
    The simulation draws the same seeded accept sequence as the replay, so it must land on the
    same tick count: only timing is predicted, not luck. The replay's driver sleeps the verify
    time itself (its stages hold no head), so the case verifies on the driver."""
    stage_ms = replay["stage_compute_ms_measured"] if profiled else replay["stage_ms"]
    pdm = replay["pdm_ms_measured"] if profiled else replay["pdm_ms"]
    verify = replay["verify_ms_measured"] if profiled else replay["verify_ms"]
    if profiled and any(c is None for c in stage_ms):
        raise ValueError("replay result lacks measured stage compute times")
    case = build_spd_case(list(stage_ms), pdm, verify, replay["alpha"], replay["colocate"], replay["hidden"],
                          replay["dtype_bytes"], replay["anchors"], lambda a, b: link, verify_on_last=False)
    sim = simulate_spd(case, replay["tokens"] - 1, replay["seed"])
    assert sim["ticks"] == replay["ticks"], f"model ticks {sim['ticks']} != replay ticks {replay['ticks']}"
    cycles = spd_cycles(case)
    return {"tick_ms": sim["tick_ms"], "critical": max(cycles, key=cycles.get),
            "error": sim["tick_ms"] / replay["tick_ms"] - 1.0}
