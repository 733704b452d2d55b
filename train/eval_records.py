"""The records of an acceptance evaluation, shared by SPD's (train/evaluate.py) and the eagle
baseline's (train/eagle_eval.py): the settings, one request's outcome, per-prompt records, their
summaries (alpha, EAL, by fill and by draft source) and the report.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.train.fast_eval import Acceptance

NON_LOOPING = "non-looping"  # the summary of the prompts whose output does not repeat itself (docs/eval.md)


@dataclass(frozen=True)
class EvalSettings:
    max_new_tokens: int = 256
    temperature: float = 0.0
    executor: str = "fast"
    limit: int | None = None  # prompts per dataset; None = all
    top_k: int = 0  # sampling filters (T > 0 only); 0 / 1.0 = off
    top_p: float = 1.0
    seed: int = 0  # request k of a run samples with seed + k

    def sampling(self, request: int = 0) -> SamplingParams:
        """The sampling parameters of the run's request number `request` (greedy at T=0)."""
        return SamplingParams(self.temperature, self.top_k, self.top_p, (self.seed + request) % (1 << 64))


@dataclass
class Outcome:
    tokens: list[int]
    acceptance: Acceptance
    lossless: bool | None  # runtime executors at T=0: output == greedy_generate; else None (not checked)
    near_ties: int | None = None  # fast path: consulted drafts decided by a near tie
    outside_vocab: int | None = None  # fast path: verified reference tokens the draft vocabulary lacks
    seed: int | None = None  # T>0: the seed of this request's draws


@dataclass
class PromptRecord:
    dataset: str
    index: int
    question_id: object
    prompt_tokens: int
    acceptance: Acceptance
    seconds: float
    lossless: bool | None
    near_ties: int | None
    seed: int | None = None  # T>0: the seed of this request's draws
    outside_vocab: int | None = None  # fast path: verified reference tokens outside the draft vocabulary
    loops: bool | None = None  # the output repeats itself (train/draft_potential.py `loops`)

    def to_json(self) -> dict:
        a = self.acceptance
        d = {k: v for k, v in asdict(self).items() if k != "acceptance"}
        d.update(tokens=a.tokens, ticks=a.ticks, verified=a.verified, accepted=a.accepted,
                 rejections=a.rejections, alpha=a.accepted / a.verified if a.verified else None,
                 eal=a.n * (a.tokens - 1) / a.ticks if a.ticks else None,
                 verified_by_fill=a.verified_by_fill, accepted_by_fill=a.accepted_by_fill,
                 by_source=a.by_source)
        return d


def ratio(num: float, den: float) -> float | None:
    return num / den if den else None


@dataclass
class Summary:
    n: int
    prompts: int = 0
    tokens: int = 0
    ticks: int = 0
    verified: int = 0
    accepted: int = 0
    rejections: int = 0
    verified_full: int = 0
    accepted_full: int = 0
    seconds: float = 0.0
    failures: int = 0
    near_ties: int = 0
    outside_vocab: int = 0  # fast path: verified reference tokens outside the draft vocabulary
    by_fill: dict[int, list[int]] = field(default_factory=dict)  # fill -> [verified, accepted]
    by_source: dict[str, list[int]] = field(default_factory=dict)  # draft source -> [verified, accepted]

    def add(self, r: PromptRecord) -> None:
        a = r.acceptance
        self.prompts += 1
        self.tokens += a.tokens
        self.ticks += a.ticks
        self.verified += a.verified
        self.accepted += a.accepted
        self.rejections += a.rejections
        for f, v in a.verified_by_fill.items():
            cell = self.by_fill.setdefault(int(f), [0, 0])
            cell[0] += v
            cell[1] += a.accepted_by_fill.get(f, 0)
        for src, (v, acc) in a.by_source.items():
            cell = self.by_source.setdefault(src, [0, 0])
            cell[0] += v
            cell[1] += acc
        self.verified_full += a.verified_by_fill.get(self.n, 0)
        self.accepted_full += a.accepted_by_fill.get(self.n, 0)
        self.seconds += r.seconds
        self.failures += int(r.lossless is False)
        self.near_ties += r.near_ties or 0
        self.outside_vocab += r.outside_vocab or 0

    @property
    def alpha(self) -> float | None:
        return ratio(self.accepted, self.verified)

    @property
    def eal(self) -> float | None:
        """Pooled: n * sum(N - 1) / sum(ticks)."""
        return ratio(self.n * (self.tokens - self.prompts), self.ticks)

    @property
    def alpha_by_fill(self) -> dict[int, float]:
        """Alpha of the drafts made at each fill 1..n (fill 1: the first draft after a rejection)."""
        return {f: acc / ver for f, (ver, acc) in sorted(self.by_fill.items()) if ver}

    @property
    def alpha_full(self) -> float | None:
        return ratio(self.accepted_full, self.verified_full)

    @property
    def alpha_refill(self) -> float | None:
        return ratio(self.accepted - self.accepted_full, self.verified - self.verified_full)

    def to_json(self) -> dict:
        return {**asdict(self), "alpha": self.alpha, "eal": self.eal, "alpha_full": self.alpha_full,
                "alpha_refill": self.alpha_refill, "alpha_by_fill": self.alpha_by_fill,
                "alpha_by_source": {k: acc / v for k, (v, acc) in self.by_source.items() if v}}


def summarize(records: Sequence[PromptRecord], n: int) -> Summary:
    s = Summary(n=n)
    for r in records:
        s.add(r)
    return s


@dataclass
class EvalReport:
    n: int
    records: list[PromptRecord] = field(default_factory=list)

    def datasets(self) -> list[str]:
        return list(dict.fromkeys(r.dataset for r in self.records))

    def summary(self, dataset: str | None = None) -> Summary:
        """One dataset's, all prompts' (None), or NON_LOOPING: the prompts whose output does not loop."""
        if dataset == NON_LOOPING:
            return summarize([r for r in self.records if r.loops is False], self.n)
        return summarize([r for r in self.records if dataset is None or r.dataset == dataset], self.n)

    @property
    def failures(self) -> list[PromptRecord]:
        return [r for r in self.records if r.lossless is False]

    def to_json(self, meta: dict) -> dict:
        """Summaries and records; `alpha_by_n` ({"4": alpha}, pooled over all prompts) is what
        `spd plan --alpha-json` reads."""
        overall = self.summary()
        alpha_by_n = {str(self.n): overall.alpha} if overall.alpha is not None else {}
        return {**meta, "alpha_by_n": alpha_by_n,
                "datasets": {d: self.summary(d).to_json() for d in self.datasets()},
                "overall": overall.to_json(), NON_LOOPING: self.summary(NON_LOOPING).to_json(),
                "records": [r.to_json() for r in self.records]}


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
