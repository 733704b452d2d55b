"""Acceptance evaluation of a PDM head on prompt sets: alpha and EAL (docs/design.md 3.8), by fill state.

Three executors give the same T=0 counts:
- `fast`: train/fast_eval.py (one greedy decode + one teacher-forced pass per prompt);
- `reference`: the runtime in one process (engine/runtime/reference.py);
- `dist`: the runtime over torch.distributed, one process per rank (engine/runtime/launch.py).
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
from dataclasses import dataclass
from pathlib import Path

import torch

from spd_engine.engine.model.greedy import greedy_generate
from spd_engine.engine.model.tp_model import SerialTP
from spd_engine.engine.protocol.sampling import SamplingParams
from spd_engine.engine.runtime.build import build_driver_head, build_pdm, build_stage_model, build_tp_stage_model
from spd_engine.engine.runtime.progress import Progress
from spd_engine.engine.runtime.run_config import Mode, RunConfig
from spd_engine.train.branch_replay import replay_branches
from spd_engine.train.draft_potential import loops
from spd_engine.train.eagle_eval import EagleRunner
from spd_engine.train.eval_records import (  # noqa: F401
    NON_LOOPING,
    EvalReport,
    EvalSettings,
    Outcome,
    PromptRecord,
    Summary,
    fmt,
    ratio,
    summarize,
)
from spd_engine.train.fast_eval import Acceptance, FastRun, draft_table, fast_generate
from spd_engine.train.reference_cache import ReferenceCache

DATASETS = ("mt_bench", "humaneval", "gsm8k")
EXECUTORS = ("fast", "reference", "dist")


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

def full_target(ecfg: RunConfig):
    """The whole target (embedding, every layer, head) with the weights the stages get; with
    --tp T the same TP split and the driver's head (engine/model/tp_model.py SerialTP), the greedy
    oracle of an SPD x TP run."""
    L = ecfg.model.cfg.num_layers
    if ecfg.parallel.topology.tp > 1:
        return SerialTP.build(lambda g: build_tp_stage_model(ecfg, range(L), True, True, g), ecfg.parallel.topology.tp,
                              build_driver_head(ecfg))
    return build_stage_model(ecfg, range(L), embedding=True, head=True)


def runtime_acceptance(driver, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int],
                       sampling: SamplingParams = SamplingParams()) -> tuple[list[int], Acceptance]:
    """Run one request on a Driver: its tokens and its counters, verified drafts by the fill that
    made them included (the tick protocol counts them as the driver runs, engine/protocol/tick.py)."""
    res = driver.generate(prompt, max_new_tokens, eos_ids, sampling=sampling)
    acc = Acceptance(n=res.n, tokens=len(res.tokens), **vars(res.counters()),
                     by_source={k: v[1:] for k, v in res.by_source.items() if v[1]})
    return res.tokens, acc


class FastRunner:
    def __init__(self, ecfg: RunConfig, cache: ReferenceCache | None = None) -> None:
        self.target, self.pdm, self.chunk, self.cache = full_target(ecfg), build_pdm(ecfg), ecfg.runtime.prefill_chunk, cache
        self.chooser = ecfg.chooser()  # the run's draft sources, as the driver would use them
        self.cross = self.chooser.new_history()  # earlier requests' tokens, as a driver keeps them
        self.branching = ecfg.branch_policy()
        self.stage_tokens = self.stage_slots = 0  # with suffix runs: tokens per stage step (run_replay.py)
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
            self.stage_tokens += fr.stage_tokens
            self.stage_slots += fr.stage_slots
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
        self.driver, self.chunk, self.settings = driver, ecfg.runtime.prefill_chunk, settings
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
    if ecfg.mode is Mode.EAGLE:  # the serial baseline: its own runtime in this process (train/eagle_eval.py)
        yield EagleRunner(ecfg, settings, ReferenceCache(reference_cache, ecfg) if reference_cache is not None else None)
        return
    if ecfg.mode is not Mode.SPD:
        raise ValueError(f"evaluation measures SPD or eagle acceptance: mode must be spd or eagle, got {ecfg.mode!r}")
    if settings.executor == "fast" and ecfg.parallel.topology.tp > 1:
        raise ValueError("the fast executor replays the unsharded model: with --tp use --executor reference or dist")
    if reference_cache is not None and settings.executor != "fast":
        raise ValueError("--reference-cache applies to the fast executor only (the runtimes decode for real)")
    if settings.executor == "fast":
        yield FastRunner(ecfg, ReferenceCache(reference_cache, ecfg) if reference_cache is not None else None)
    elif settings.executor == "reference":
        from spd_engine.engine.runtime.reference import ReferenceExecutor

        with ReferenceExecutor(ecfg) as ex:
            yield RuntimeRunner(ex.driver, ecfg, settings)
    else:
        from spd_engine.engine.runtime.launch import launch

        with launch(ecfg) as driver:
            yield RuntimeRunner(driver, ecfg, settings)


# ---- the run ----

def evaluate(runner, prompts: Sequence[tuple[Prompt, list[int]]], n: int, settings: EvalSettings,
             eos_ids: Sequence[int], progress: Callable[[str], None] = lambda _: None,
             bar: Progress | None = None) -> EvalReport:
    """Run every (prompt, ids) through `runner`; progress gets one line per prompt, or, with `bar`,
    the bar advances one prompt per prompt showing the running alpha (its plain mode prints the lines)."""
    report = EvalReport(n=n)
    verified = accepted = 0
    for k, (p, ids) in enumerate(prompts):
        t0 = time.perf_counter()
        out = runner.run(ids, settings.max_new_tokens, eos_ids, request=k)
        rec = PromptRecord(p.dataset, p.index, p.question_id, len(ids), out.acceptance,
                           time.perf_counter() - t0, out.lossless, out.near_ties, out.seed, out.outside_vocab,
                           loops(ids, out.tokens))
        report.records.append(rec)
        a = out.acceptance
        flag = "" if out.lossless is not False else "  OUTPUT DIFFERS FROM GREEDY"
        line = (f"[{k + 1}/{len(prompts)}] {p.dataset}#{p.index}: {a.tokens} tokens, {a.ticks} ticks, "
                f"alpha {fmt(ratio(a.accepted, a.verified))}, {rec.seconds:.1f}s{flag}")
        if bar is None:
            progress(line)
            continue
        verified, accepted = verified + a.verified, accepted + a.accepted
        if flag:  # a failure stays visible above the bar
            bar.write(line)
        else:
            bar.line(line)
        bar.update(1, f"alpha {fmt(ratio(accepted, verified))} {p.dataset}")
    return report


def format_table(report: EvalReport) -> str:
    """One row per dataset and one overall; alpha@full / alpha@refill split drafts by fill."""
    head = ("dataset", "prompts", "tokens", "ticks", "alpha", "EAL", "alpha@full", "alpha@refill", "fail")
    rows = [(d, report.summary(d)) for d in report.datasets()] + [("overall", report.summary()),
                                                                  (NON_LOOPING, report.summary(NON_LOOPING))]
    lines = [f"{head[0]:<12}" + "".join(f"{h:>13}" for h in head[1:])]
    for name, s in rows:
        cells = (s.prompts, s.tokens, s.ticks, fmt(s.alpha), fmt(s.eal), fmt(s.alpha_full),
                 fmt(s.alpha_refill), s.failures)
        lines.append(f"{name:<12}" + "".join(f"{c:>13}" for c in cells))
    overall = report.summary()
    if len(overall.by_source) > 1:  # several draft sources: how often each drafted and was right
        lines.append("by draft source (verified drafts, alpha): " + ", ".join(
            f"{k} {v} ({fmt(acc / v if v else None)})" for k, (v, acc) in sorted(overall.by_source.items())))
    return "\n".join(lines)

