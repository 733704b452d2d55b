"""Run metrics, defined once (docs/design.md 3.8) and used by generate, eval and bench.

tokens N includes the first token (from the prefill logits) and a final EOS, never an
unverified draft; decode tokens = N - 1; ticks counts decode ticks including fill and refill;
alpha = accepted / verified drafts; EAL = n * decode tokens / ticks. The serial eagle baseline
counts target passes (one per draft-then-verify round) and its acceptance length = decode tokens /
target passes; its ticks are its target passes and n = 1, so its EAL is that acceptance length.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class Counters:
    """A request's counters, defined once: the tick protocol counts into them (engine/protocol/tick.py),
    the driver's result and the evaluators' records are them (GenerationResult, train/fast_eval.py
    Acceptance), and every report reads them."""

    ticks: int = 0
    verified: int = 0
    accepted: int = 0
    rejections: int = 0  # rejections followed by at least one more committed token
    branch_points: int = 0  # verified branch points (branch width W > 1, docs/design.md 3.11)
    branch_saves: int = 0  # of them, those whose first candidate was wrong and another right
    # verified / accepted drafts by the fill of the tick that made them (fill == n: a full pipeline)
    verified_by_fill: dict[int, int] = field(default_factory=dict)
    accepted_by_fill: dict[int, int] = field(default_factory=dict)

    def count(self, fill: int, accepted: bool, times: int = 1) -> None:
        """`times` verified drafts made at `fill` (a suffix run's tokens share their entry's fill)."""
        self.verified += times
        self.accepted += int(accepted) * times
        self.verified_by_fill[fill] = self.verified_by_fill.get(fill, 0) + times
        self.accepted_by_fill[fill] = self.accepted_by_fill.get(fill, 0) + int(accepted) * times

    def counters(self) -> Counters:
        """The counters alone (a copy), whatever record holds them."""
        return Counters(**{f.name: getattr(self, f.name) for f in fields(Counters)})

    @property
    def alpha(self) -> float:
        return self.accepted / self.verified if self.verified else 0.0


@dataclass
class StageStats:
    """A stage's decode statistics over one request, the head of its STATS reply (float64, in this
    order; then its resident parameter bytes and its optional trace). Decode (TOKEN) messages only:
    prefill chunks are timed by the driver's prefill_s."""

    compute_s: float = 0.0
    messages: float = 0.0
    wait_s: float = 0.0  # receive wait before each message
    tp_collectives: float = 0.0  # TP rank 0: collectives, and the seconds inside them (part of the compute)
    tp_collective_s: float = 0.0
    send_s: float = 0.0  # the frame downstream and the reply to the driver, after the compute
    verify_s: float = 0.0  # a verifying last stage's head and argmax (part of the compute)
    rows: float = 0.0  # token rows over the decode messages (several requests: docs/design.md 3.12)

    def values(self) -> list[float]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_reply(cls, vals: list[float]) -> dict:
        """A STATS payload -> the dict the reports read: the fields, param_bytes and trace."""
        k = len(fields(cls))
        return {**asdict(cls(*vals[:k])), "param_bytes": int(vals[k]),
                "trace": [tuple(vals[i:i + 3]) for i in range(k + 1, len(vals), 3)]}


@dataclass(kw_only=True)
class GenerationResult(Counters):
    """One generated request: its tokens, counters, timings and per-tick breakdown."""

    tokens: list[int]
    n: int
    target_passes: int = 0  # decode forwards of the whole target (the eagle baseline's rounds)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # per-tick breakdown, summed over the run (seconds); stage entries come from the stages
    driver: dict[str, float] = field(default_factory=dict)
    stages: list[dict[str, float]] = field(default_factory=list)
    trace: dict | None = None  # per-tick timestamps (perf_counter, comparable across ranks of one host)
    # draft source (engine/protocol/drafting.py) -> [drafted, verified, accepted]: how often each source drafted,
    # and alpha per source over the verified drafts
    by_source: dict[str, list[int]] = field(default_factory=dict)
    # per committed token, when asked (RequestState.top_logprobs): (token, its log-probability under the
    # target, the `top_logprobs` most likely (token, log-probability) pairs), at T = 0
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)

    @property
    def decode_tokens(self) -> int:
        return max(0, len(self.tokens) - 1)

    @property
    def eal(self) -> float:
        return self.n * self.decode_tokens / self.ticks if self.ticks else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per target pass (the eagle baseline; 0 where no pass was counted)."""
        return self.decode_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def summary(self, mode: str) -> str:
        """One line of what the run did: tokens, ticks, alpha and EAL (SPD / eagle), decode speed."""
        parts = [f"{len(self.tokens)} tokens", f"{self.ticks} ticks at n={self.n}" if mode == "spd" else mode]
        if mode == "spd":
            parts.append(f"alpha {self.alpha:.2f}, EAL {self.eal:.2f}")
        elif mode == "eagle":
            parts.append(f"alpha {self.alpha:.2f}, {self.acceptance_length:.2f} tokens per target pass")
        return (", ".join(parts) + f"; {self.decode_tok_s:.1f} tok/s decode, prefill {self.prefill_s:.2f} s")

    def breakdown_ms_per_tick(self) -> dict[str, float]:
        """Per-tick means in milliseconds: the tick, the driver's parts (they add up to the tick:
        `driver_other_ms` is what no timer covers), each stage's compute and receive wait, and
        driver slack."""
        if not self.ticks:
            return {}
        per = {"tick_ms": 1e3 * self.decode_s / self.ticks}
        per.update({f"driver_{k}_ms": 1e3 * v / self.ticks for k, v in self.driver.items()})
        if self.driver:
            per["driver_other_ms"] = per["tick_ms"] - sum(1e3 * v / self.ticks for v in self.driver.values())
        stage_ms = []
        for i, s in enumerate(self.stages):
            msgs = max(1.0, s.get("messages", 1.0))
            ms = 1e3 * s.get("compute_s", 0.0) / msgs
            stage_ms.append(ms)
            per[f"stage{i}_compute_ms"] = ms
            per[f"stage{i}_wait_ms"] = 1e3 * s.get("wait_s", 0.0) / msgs
            per[f"stage{i}_send_ms"] = 1e3 * s.get("send_s", 0.0) / msgs
            if s.get("verify_s"):  # a last stage that verifies: its head and argmax, inside its compute
                per[f"stage{i}_verify_ms"] = 1e3 * s["verify_s"] / msgs
            if s.get("tp_collectives"):  # TP rank 0: collectives per message and the time inside them
                per[f"stage{i}_tp_collectives"] = s["tp_collectives"] / msgs
                per[f"stage{i}_tp_collective_ms"] = 1e3 * s["tp_collective_s"] / msgs
        if stage_ms and "pdm" in self.driver:  # slack is SPD's: the pp/ar baselines have no PDM
            driver_work = sum(per.get(f"driver_{k}_ms", 0.0) for k in ("pdm", "verify", "send", "stage0"))
            per["driver_slack_ms"] = max(stage_ms) - driver_work
        return per

    def to_json(self) -> dict:
        return {
            "tokens": len(self.tokens), "decode_tokens": self.decode_tokens, "ticks": self.ticks,
            "verified": self.verified, "accepted": self.accepted, "rejections": self.rejections,
            "branch_points": self.branch_points, "branch_saves": self.branch_saves,
            "alpha": self.alpha, "eal": self.eal,
            "target_passes": self.target_passes, "acceptance_length": self.acceptance_length,
            "prefill_s": self.prefill_s, "decode_s": self.decode_s,
            "decode_tok_s": self.decode_tok_s, "breakdown_ms_per_tick": self.breakdown_ms_per_tick(),
            "by_source": {k: dict(zip(("drafted", "verified", "accepted"), v)) for k, v in self.by_source.items()},
            # resident parameter bytes of one rank of each stage (its TP rank 0; every TP rank holds a like shard)
            "stage_param_bytes": [int(s.get("param_bytes", 0)) for s in self.stages],
        }

