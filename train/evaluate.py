"""Acceptance evaluation of a PDM head on prompt sets: alpha and EAL (docs/design.md 3.8), by fill state.

Three executors give the same T=0 counts:
- `fast`: train/fast_eval.py (one greedy decode + one teacher-forced pass per prompt);
- `reference`: the runtime in one process (engine/reference.py);
- `dist`: the runtime over torch.distributed, one process per rank (engine/launch.py).
At T=0 the runtime executors also check every output against `greedy_generate`; a mismatch
is a failure. Drafts are grouped by the fill of the tick that made them: fill == n is the full
pipeline, fill < n the start of a request and the refill after a rejection.

At T>0 (sampling) only the runtime executors apply: the fast path replays greedy decoding.
Outputs are random draws from the target distribution, so nothing is compared token by token;
request k of a run uses seed `seed + k` (keyed draws: a rerun with the same seed repeats every
output, on either runtime executor), and the records carry it.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from spd_engine.engine.build import build_driver_head, build_pdm, build_stage_model, build_tp_stage_model
from spd_engine.engine.run_config import RunConfig
from spd_engine.engine.greedy import greedy_generate
from spd_engine.engine.sampling import SamplingParams
from spd_engine.engine.tp_model import SerialTP
from spd_engine.train.branch_replay import replay_branches
from spd_engine.train.draft_potential import loops
from spd_engine.train.fast_eval import Acceptance, FastRun, draft_table, fast_generate
from spd_engine.train.reference_cache import ReferenceCache

DATASETS = ("mt_bench", "humaneval", "gsm8k")
EXECUTORS = ("fast", "reference", "dist")
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


def default_executor(temperature: float) -> str:
    """fast at T=0 (exact replay of greedy decoding); the reference runtime at T>0."""
    return "fast" if temperature == 0 else "reference"


def check_settings(s: EvalSettings) -> None:
    if s.executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {s.executor!r}")
    if s.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {s.max_new_tokens}")
    if s.limit is not None and s.limit < 1:
        raise ValueError(f"limit must be >= 1 prompt per dataset, got {s.limit}")
    s.sampling()  # temperature, top_k, top_p and seed: SamplingParams names a bad value
    if s.temperature > 0 and s.executor == "fast":
        raise ValueError("sampling evaluation (temperature > 0) needs the executor with sampling support: "
                         "use --executor reference or dist (the fast path replays greedy decoding only)")


# ---- prompt sets ----

def default_data_dir() -> Path | None:
    """The evaluation prompt sets shipped with the package (train/evalsets: MT-Bench, HumanEval,
    GSM8K first turns, EAGLE jsonl format), None if the installation lacks them."""
    d = Path(__file__).resolve().parent / "evalsets"
    return d if d.is_dir() else None


@dataclass(frozen=True)
class Prompt:
    dataset: str
    index: int  # line order within the dataset file
    question_id: object
    text: str


def load_dataset(data_dir: Path, name: str, limit: int | None = None) -> list[Prompt]:
    """First user turn of each record of `<data_dir>/<name>.jsonl` (EAGLE format: `turns`)."""
    path = Path(data_dir) / f"{name}.jsonl"
    if not path.is_file():
        raise ValueError(f"prompt set not found: {path}")
    out: list[Prompt] = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{i + 1}: not JSON: {err}") from None
        turns = rec.get("turns") if isinstance(rec, dict) else None
        if not turns or not isinstance(turns[0], str):
            raise ValueError(f"{path}:{i + 1}: no 'turns' list with a first user turn (EAGLE format)")
        out.append(Prompt(name, len(out), rec.get("question_id"), turns[0]))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def encode_prompt(text: str, tok, vocab_size: int) -> list[int]:
    """Chat-template ids with a tokenizer; without one (random-weight models) bytes mapped into the vocabulary."""
    if tok is not None:
        return tok.chat_ids(text)
    return [3 + b % (vocab_size - 3) for b in text.encode()]


# ---- runners: one request -> tokens and acceptance counts ----

@dataclass
class Outcome:
    tokens: list[int]
    acceptance: Acceptance
    lossless: bool | None  # runtime executors at T=0: output == greedy_generate; else None (not checked)
    near_ties: int | None = None  # fast path: consulted drafts decided by a near tie
    outside_vocab: int | None = None  # fast path: verified reference tokens the draft vocabulary lacks
    seed: int | None = None  # T>0: the seed of this request's draws


def full_target(ecfg: RunConfig):
    """The whole target (embedding, every layer, head) with the weights the stages get; with
    --tp T the same TP split and the driver's head (engine/tp_model.py SerialTP), the greedy
    oracle of an SPD x TP run."""
    L = ecfg.cfg.num_layers
    if ecfg.topology.tp > 1:
        return SerialTP.build(lambda g: build_tp_stage_model(ecfg, range(L), True, True, g), ecfg.topology.tp,
                              build_driver_head(ecfg))
    return build_stage_model(ecfg, range(L), embedding=True, head=True)


def runtime_acceptance(driver, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int],
                       sampling: SamplingParams = SamplingParams()) -> tuple[list[int], Acceptance]:
    """Run one request on a Driver and group its verified drafts by the fill that made them.

    The last draft made for a position is the one verified (a flush re-drafts the positions
    behind a correction), so fills are recorded by position, last one wins. Each committed
    position after the first is verified exactly once; its verdict is read from the driver's
    `_verify_exit` (at T>0 a rejected draft cannot be told from its correction by the tokens alone).
    """
    fills: dict[int, int] = {}
    verdicts: dict[int, bool] = {}
    previous = vars(driver).get("_verify_exit")  # an instance override (tests) stays in place
    previous_branch = vars(driver).get("_verify_branch")
    verify, verify_branch = driver._verify_exit, driver._verify_branch

    def record(position: int, proposed: int, row: int = 0, reply: int = -1) -> tuple[bool, int]:
        accepted, token = verify(position, proposed, row, reply)
        verdicts[position] = accepted
        return accepted, token

    def record_branch(position: int, tokens, row: int, reply: int = -1) -> tuple[int | None, int]:
        index, token = verify_branch(position, tokens, row, reply)
        verdicts[position] = index is not None
        return index, token

    driver.draft_observer = lambda newest, fill, _logits: fills.__setitem__(newest + 1, fill)
    driver._verify_exit, driver._verify_branch = record, record_branch
    try:
        res = driver.generate(prompt, max_new_tokens, eos_ids, sampling=sampling)
    finally:
        driver.draft_observer = None
        for name, prev in (("_verify_exit", previous), ("_verify_branch", previous_branch)):
            if prev is None:
                delattr(driver, name)
            else:
                setattr(driver, name, prev)
    acc = Acceptance(n=res.n, tokens=len(res.tokens), ticks=res.ticks, rejections=res.rejections,
                     by_source={k: v[1:] for k, v in res.by_source.items() if v[1]})
    P = len(prompt)
    for i in range(1, len(res.tokens)):
        acc.count(fills[P + i], verdicts[P + i])
    assert (acc.verified, acc.accepted) == (res.verified, res.accepted), "per-fill counts disagree with the driver"
    return res.tokens, acc


class FastRunner:
    def __init__(self, ecfg: RunConfig, cache: ReferenceCache | None = None) -> None:
        self.target, self.pdm, self.chunk, self.cache = full_target(ecfg), build_pdm(ecfg), ecfg.prefill_chunk, cache
        self.chooser = ecfg.chooser()  # the run's draft sources, as the driver would use them
        self.cross = self.chooser.new_history()  # earlier requests' tokens, as a driver keeps them
        self.branching = ecfg.branch_policy()
        if self.branching.width > 1 and self.cross is not None:
            raise ValueError("the fast executor replays --branches > 1 without cross-request suffix drafts: "
                             "use --executor reference")

    def run(self, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int], request: int = 0
            ) -> Outcome:
        ref = None
        if self.cache is not None:
            ref = self.cache.get_or_compute(prompt, max_new_tokens, eos_ids, self.chunk, lambda: greedy_generate(
                self.target, prompt, max_new_tokens, eos_ids=eos_ids, chunk=self.chunk))
        if self.branching.width > 1:
            fr = self._branched(prompt, max_new_tokens, eos_ids, ref)
        else:
            fr = fast_generate(self.target, self.pdm, prompt, max_new_tokens, eos_ids, chunk=self.chunk,
                               reference=ref, chooser=self.chooser, cross=self.cross)
        if self.cross is not None:
            self.cross.add(prompt, fr.tokens)
        # a ceiling on alpha: no draft can equal a token outside the head's vocabulary
        outside = int((~torch.isin(torch.tensor(fr.tokens[1:], dtype=torch.long),
                                   self.pdm.draft_ids.cpu())).sum())
        return Outcome(fr.tokens, fr.acceptance, None, fr.near_ties(), outside_vocab=outside)


    def _branched(self, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int],
                  ref: Sequence[int] | None) -> FastRun:
        """The exact T=0 replay with branch width W > 1 (train/branch_replay.py)."""
        y = list(ref) if ref is not None else \
            greedy_generate(self.target, prompt, max_new_tokens, eos_ids=eos_ids, chunk=self.chunk)
        if len(y) == 1:
            return fast_generate(self.target, self.pdm, prompt, max_new_tokens, eos_ids, chunk=self.chunk, reference=y)
        table = draft_table(self.target, self.pdm, prompt, y)
        run = replay_branches(table, y, len(prompt), self.pdm.plan.n, self.chooser, self.branching, prompt)
        return FastRun(y, run.acceptance, table, frozenset(run.consulted))


class RuntimeRunner:
    """A launched runtime (reference or dist); at T=0 plus the full target for the lossless check."""

    def __init__(self, driver, ecfg: RunConfig, settings: EvalSettings = EvalSettings()) -> None:
        self.driver, self.chunk, self.settings = driver, ecfg.prefill_chunk, settings
        self.target = full_target(ecfg) if settings.temperature == 0 else None

    def run(self, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int], request: int = 0
            ) -> Outcome:
        sampling = self.settings.sampling(request)
        tokens, acc = runtime_acceptance(self.driver, prompt, max_new_tokens, eos_ids, sampling)
        if not sampling.greedy:  # a random draw: nothing to compare token by token
            return Outcome(tokens, acc, None, seed=sampling.seed)
        want = greedy_generate(self.target, prompt, max_new_tokens, eos_ids=eos_ids, chunk=self.chunk)
        return Outcome(tokens, acc, tokens == want)


@contextlib.contextmanager
def open_runner(ecfg: RunConfig, settings: EvalSettings, reference_cache: str | Path | None = None
                ) -> Iterator[FastRunner | RuntimeRunner]:
    """`reference_cache` (fast executor only): a directory of greedy outputs reused across heads."""
    check_settings(settings)
    if ecfg.mode == "eagle":  # the serial baseline: its own runtime in this process (train/eagle_eval.py)
        from spd_engine.train.eagle_eval import EagleRunner

        yield EagleRunner(ecfg, settings, ReferenceCache(reference_cache, ecfg) if reference_cache is not None else None)
        return
    if ecfg.mode != "spd":
        raise ValueError(f"evaluation measures SPD or eagle acceptance: mode must be spd or eagle, got {ecfg.mode!r}")
    if settings.executor == "fast" and ecfg.topology.tp > 1:
        raise ValueError("the fast executor replays the unsharded model: with --tp use --executor reference or dist")
    if reference_cache is not None and settings.executor != "fast":
        raise ValueError("--reference-cache applies to the fast executor only (the runtimes decode for real)")
    if settings.executor == "fast":
        yield FastRunner(ecfg, ReferenceCache(reference_cache, ecfg) if reference_cache is not None else None)
    elif settings.executor == "reference":
        from spd_engine.engine.reference import ReferenceExecutor

        with ReferenceExecutor(ecfg) as ex:
            yield RuntimeRunner(ex.driver, ecfg, settings)
    else:
        from spd_engine.engine.launch import launch

        with launch(ecfg) as driver:
            yield RuntimeRunner(driver, ecfg, settings)


# ---- records and summaries ----

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


def _ratio(num: float, den: float) -> float | None:
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
        return _ratio(self.accepted, self.verified)

    @property
    def eal(self) -> float | None:
        """Pooled: n * sum(N - 1) / sum(ticks)."""
        return _ratio(self.n * (self.tokens - self.prompts), self.ticks)

    @property
    def alpha_by_fill(self) -> dict[int, float]:
        """Alpha of the drafts made at each fill 1..n (fill 1: the first draft after a rejection)."""
        return {f: acc / ver for f, (ver, acc) in sorted(self.by_fill.items()) if ver}

    @property
    def alpha_full(self) -> float | None:
        return _ratio(self.accepted_full, self.verified_full)

    @property
    def alpha_refill(self) -> float | None:
        return _ratio(self.accepted - self.accepted_full, self.verified - self.verified_full)

    def to_json(self) -> dict:
        return {**asdict(self), "alpha": self.alpha, "eal": self.eal, "alpha_full": self.alpha_full,
                "alpha_refill": self.alpha_refill, "alpha_by_fill": self.alpha_by_fill,
                "alpha_by_source": {k: acc / v for k, (v, acc) in self.by_source.items() if v}}


def summarize(records: Sequence[PromptRecord], n: int) -> Summary:
    s = Summary(n=n)
    for r in records:
        s.add(r)
    return s


# ---- the run ----

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


def evaluate(runner, prompts: Sequence[tuple[Prompt, list[int]]], n: int, settings: EvalSettings,
             eos_ids: Sequence[int], progress: Callable[[str], None] = lambda _: None) -> EvalReport:
    """Run every (prompt, ids) through `runner`; progress gets one line per prompt."""
    report = EvalReport(n=n)
    for k, (p, ids) in enumerate(prompts):
        t0 = time.perf_counter()
        out = runner.run(ids, settings.max_new_tokens, eos_ids, request=k)
        rec = PromptRecord(p.dataset, p.index, p.question_id, len(ids), out.acceptance,
                           time.perf_counter() - t0, out.lossless, out.near_ties, out.seed, out.outside_vocab,
                           loops(ids, out.tokens))
        report.records.append(rec)
        a = out.acceptance
        flag = "" if out.lossless is not False else "  OUTPUT DIFFERS FROM GREEDY"
        progress(f"[{k + 1}/{len(prompts)}] {p.dataset}#{p.index}: {a.tokens} tokens, {a.ticks} ticks, "
                 f"alpha {_fmt(_ratio(a.accepted, a.verified))}, {rec.seconds:.1f}s{flag}")
    return report


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(report: EvalReport) -> str:
    """One row per dataset and one overall; alpha@full / alpha@refill split drafts by fill."""
    head = ("dataset", "prompts", "tokens", "ticks", "alpha", "EAL", "alpha@full", "alpha@refill", "fail")
    rows = [(d, report.summary(d)) for d in report.datasets()] + [("overall", report.summary()),
                                                                  (NON_LOOPING, report.summary(NON_LOOPING))]
    lines = [f"{head[0]:<12}" + "".join(f"{h:>13}" for h in head[1:])]
    for name, s in rows:
        cells = (s.prompts, s.tokens, s.ticks, _fmt(s.alpha), _fmt(s.eal), _fmt(s.alpha_full),
                 _fmt(s.alpha_refill), s.failures)
        lines.append(f"{name:<12}" + "".join(f"{c:>13}" for c in cells))
    overall = report.summary()
    if len(overall.by_source) > 1:  # several draft sources: how often each drafted and was right
        lines.append("by draft source (verified drafts, alpha): " + ", ".join(
            f"{k} {v} ({_fmt(acc / v if v else None)})" for k, (v, acc) in sorted(overall.by_source.items())))
    return "\n".join(lines)

