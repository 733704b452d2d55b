"""Acceptance of the eagle baseline on prompt sets (`spd eval --mode eagle`): alpha and the
acceptance length (tokens committed per target pass), per dataset, beside SPD's EAL.

The runtime itself runs (one rank, in this process); its verified drafts are grouped by chain step
(1 = the first draft of a round) where SPD's evaluation groups them by fill. At T=0 every output is
compared with greedy decoding (the reference cache of the SPD evaluation serves here too): equal,
or a first difference at a near-tie of the target's own logits (a round's k + 1-token pass is
another computation shape than greedy's steps, docs/testing.md), counted; anything else fails.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from spd_engine.engine.model.greedy import greedy_generate
from spd_engine.engine.runtime.eagle_driver import build_eagle_driver
from spd_engine.engine.runtime.run_config import RunConfig
from spd_engine.train.eval_records import EvalReport, EvalSettings, Outcome, fmt
from spd_engine.train.fast_eval import Acceptance
from spd_engine.train.reference_cache import ReferenceCache

NEAR_TIE = 1e-3  # logit gap under which two computations of fp32 logits may pick either token


class EagleRunner:
    def __init__(self, ecfg: RunConfig, settings: EvalSettings, cache: ReferenceCache | None = None) -> None:
        self.driver, self.settings, self.cache, self.chunk = build_eagle_driver(ecfg), settings, cache, ecfg.runtime.prefill_chunk
        self.target = self.driver.target  # the whole target: the greedy reference decodes on it

    def run(self, prompt: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int], request: int = 0) -> Outcome:
        sampling = self.settings.sampling(request)
        res, steps, verdicts = self._generate(prompt, max_new_tokens, eos_ids, sampling)
        acc = Acceptance(n=1, tokens=len(res.tokens), ticks=res.target_passes, rejections=res.rejections)
        for pos, accepted in verdicts.items():
            acc.count(steps[pos], accepted)
        assert (acc.verified, acc.accepted) == (res.verified, res.accepted), "per-step counts disagree"
        if not sampling.greedy:
            return Outcome(res.tokens, acc, None, seed=sampling.seed)
        want = self._reference(prompt, max_new_tokens, eos_ids)
        tie = self._near_tie(prompt, res.tokens, want)
        return Outcome(res.tokens, acc, res.tokens == want or tie, near_ties=int(tie))

    def _generate(self, prompt, max_new_tokens, eos_ids, sampling):
        """The request, with the chain step of every draft and the verdict of every verified one."""
        drv, steps, verdicts = self.driver, {}, {}
        draft, verify = drv._draft, drv._verify

        def draft_spy(h, pos):
            steps[pos] = pos - len(drv.req.context) + 1  # the chain's drafts follow the committed context
            return draft(h, pos)

        def verify_spy(logits, pos, proposed, target):
            accepted, token = verify(logits, pos, proposed, target)
            verdicts[pos] = accepted
            return accepted, token

        drv._draft, drv._verify = draft_spy, verify_spy
        try:
            res = drv.generate(prompt, max_new_tokens, eos_ids, sampling=sampling)
        finally:
            del drv._draft, drv._verify
        return res, steps, verdicts

    def _reference(self, prompt, max_new_tokens, eos_ids) -> list[int]:
        decode = lambda: greedy_generate(self.target, prompt, max_new_tokens, eos_ids=eos_ids, chunk=self.chunk)  # noqa: E731
        if self.cache is None:
            return decode()
        return self.cache.get_or_compute(prompt, max_new_tokens, eos_ids, self.chunk, decode)

    @torch.no_grad()
    def _near_tie(self, prompt, got: list[int], want: list[int]) -> bool:
        """Whether the outputs part at a token where the target's two candidates are within NEAR_TIE."""
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if k is None:
            return False
        ids = torch.tensor([list(prompt) + want[:k]], device=next(self.target.parameters()).device)
        h, _ = self.target.forward_layers(self.target.embed(ids), self.target.new_cache(1, ids.shape[1]), 0)
        logits = self.target.logits(h[0, -1])
        return abs(float(logits[got[k]] - logits[want[k]])) <= NEAR_TIE


def format_eagle_table(report: EvalReport) -> str:
    """One row per dataset and one overall: alpha, acceptance length, alpha of the first draft of a round."""
    head = ("dataset", "prompts", "tokens", "passes", "alpha", "accept len", "alpha@step1", "near-ties", "fail")
    rows = [(d, report.summary(d)) for d in report.datasets()] + [("overall", report.summary())]
    lines = [f"{head[0]:<12}" + "".join(f"{h:>13}" for h in head[1:])]
    for name, s in rows:
        first = s.by_fill.get(1, [0, 0])
        cells = (s.prompts, s.tokens, s.ticks, fmt(s.alpha), fmt(s.eal), fmt(first[1] / first[0] if first[0] else None),
                 s.near_ties, s.failures)
        lines.append(f"{name:<12}" + "".join(f"{c:>13}" for c in cells))
    by_step = report.summary().alpha_by_fill
    lines.append("alpha by chain step: " + ", ".join(f"{j}: {a:.3f}" for j, a in by_step.items()))
    lines.append("acceptance length = tokens committed per target pass (SPD's EAL counts tokens per stage-time)")
    return "\n".join(lines)
