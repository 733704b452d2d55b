"""The serial eagle baseline in the cost model (docs/design.md 3.10): one device; per round, k
draft-head steps in series, then one target pass of k + 1 tokens; tokens per round = the
acceptance length. From the same profile inputs as the SPD and AR rows. Pure arithmetic: no torch.
Times are milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass

from spd_engine.costmodel.cost_alternatives import ar_token_ms
from spd_engine.costmodel.cost_inputs import Profile, note

MAX_K = 8  # the chain lengths searched when only a per-draft alpha is given


@dataclass(frozen=True)
class EagleInputs:
    """Acceptance of the eagle head: a measured acceptance length at k (spd eval --mode eagle), or a
    per-draft alpha (i.i.d. drafts) with k, or with k None the best k in 1..MAX_K for that alpha."""

    alpha: float | None = None
    acceptance_length: float | None = None
    k: int | None = None

    def __post_init__(self) -> None:
        if (self.alpha is None) == (self.acceptance_length is None):
            raise ValueError("eagle: give a per-draft alpha or a measured acceptance length, not both")
        if self.alpha is not None and not 0 <= self.alpha <= 1:
            raise ValueError(f"eagle alpha must be in [0, 1], got {self.alpha}")
        if self.k is not None and self.k < 1:
            raise ValueError(f"eagle k must be >= 1, got {self.k}")
        if self.acceptance_length is not None and (self.k is None or not 1 <= self.acceptance_length <= self.k + 1):
            raise ValueError(f"a measured acceptance length needs its k and lies in [1, k + 1], got "
                             f"{self.acceptance_length} at k={self.k}")


def tokens_per_round(alpha: float, k: int) -> float:
    """Expected tokens a round commits with i.i.d. per-draft acceptance alpha: 1 + a + ... + a^k."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def draft_step_ms(profile: Profile, notes: list[str]) -> float:
    """One draft-head step: one decoder layer of the target's shape and the head (the fuse and
    input projections are two H-wide matmuls, left out)."""
    note(notes, "ASSUMPTION: an eagle draft step = one target layer + stage_fixed_ms + verify_ms (the head over "
                "the full vocabulary; a draft vocabulary makes it cheaper)")
    return sum(profile.layer_ms) / profile.num_layers + profile.stage_fixed_ms + profile.verify_ms


def target_pass_ms(profile: Profile, notes: list[str]) -> float:
    """The verification pass of k + 1 tokens, as one batch-1 decode step."""
    note(notes, "ASSUMPTION: an eagle target pass of k+1 tokens costs one decode step (weight-read bound at "
                "batch 1; flatters eagle as k grows)")
    return ar_token_ms(profile)


def eagle_row(profile: Profile, inputs: EagleInputs, notes: list[str]) -> dict:
    """The eagle prediction: round time, tokens per round, ms per token, tok/s, speedup vs AR."""
    step, target = draft_step_ms(profile, notes), target_pass_ms(profile, notes)

    def row(k: int, length: float) -> dict:
        round_ms = k * step + target
        return {"method": "eagle", "n": 1, "devices": 1, "k": k, "alpha": inputs.alpha,
                "acceptance_length": length, "draft_step_ms": step, "target_pass_ms": target,
                "round_ms": round_ms, "token_ms": round_ms / length, "tok_s": 1e3 * length / round_ms,
                "speedup_vs_ar": ar_token_ms(profile) * length / round_ms}

    if inputs.acceptance_length is not None:
        return {**row(inputs.k, inputs.acceptance_length), "source": "measured acceptance length"}
    ks = [inputs.k] if inputs.k is not None else list(range(1, MAX_K + 1))
    best = max((row(k, tokens_per_round(inputs.alpha, k)) for k in ks), key=lambda r: r["tok_s"])
    return {**best, "source": "alpha, i.i.d. drafts" + ("" if inputs.k is not None else f", best k in 1..{MAX_K}")}


def eagle_inputs_from_eval(report: dict, k: int | None) -> EagleInputs:
    """EagleInputs of an `spd eval --mode eagle --json` report (its measured acceptance length at its k)."""
    if report.get("mode") != "eagle":
        raise ValueError("--eagle-json needs the JSON of `spd eval --mode eagle`")
    measured_k = report.get("eagle_k")
    if k is not None and k != measured_k:
        raise ValueError(f"--eagle-k {k}: the eval measured k={measured_k}; the acceptance length is k's own")
    return EagleInputs(acceptance_length=float(report["overall"]["eal"]), k=int(measured_k))
