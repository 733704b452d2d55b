"""The lossless section: SPD (the head's own drafts and forced drafts) against greedy decoding
through the same steps on the same device, bit for bit; T > 0 keyed sampling twice; branch
width 2, equal up to a near-tie."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from spd_engine.bench.device_check.check_env import error_line, free
from spd_engine.bench.device_check.check_patches import device_random_weights, graph_modes
from spd_engine.bench.device_check.check_plan import CheckPlan, Deadline, LosslessCase


def case_config(case: LosslessCase, plan: CheckPlan, mode: str, colocate: bool = False, **kw):
    from spd_engine.engine.protocol.topology import Topology
    from spd_engine.engine.runtime.run_config import PRESETS, ModelSpec, ParallelLayout, RunConfig, Runtime

    cfg = PRESETS[case.shape]
    if case.layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=case.layers)
    topo = Topology.build(cfg.num_layers, case.n, colocate=colocate)
    base = RunConfig(model=ModelSpec(source=f"random:{case.shape}", cfg=cfg, dtype=case.dtype),
                     parallel=ParallelLayout(topology=topo, device=plan.device), mode=mode,
                     runtime=Runtime(capacity=plan.capacity, step_mode=case.step_mode, timeout_s=120.0, seed=0))
    return base.replace(**kw)  # kw: settings by their own names (RunConfig.replace routes them to their groups)


def prompts_for(plan: CheckPlan, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (plan.prompt_len,), generator=gen).tolist() for _ in range(plan.prompts)]


class ForcedDrafts:
    """Drafts the oracle's token except at every `wrong_every`-th generated index (0: never), where
    a wrong one goes: accepts and rejections both happen (the head's own drafts on random weights
    are mostly wrong)."""

    def __init__(self, ref: list[int], prompt_len: int, vocab: int, wrong_every: int = 3) -> None:
        self.ref, self.P, self.vocab, self.wrong_every = ref, prompt_len, vocab, wrong_every

    def __call__(self, position: int, pdm_draft: int) -> int:
        i = position - self.P
        if not 0 <= i < len(self.ref):
            return pdm_draft
        wrong = self.wrong_every > 0 and i % self.wrong_every == 0
        return (self.ref[i] + 1) % self.vocab if wrong else self.ref[i]


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def lossless_case(case: LosslessCase, plan: CheckPlan) -> dict:
    """SPD (own drafts, forced drafts) against greedy through the same steps on the same device."""
    from spd_engine.engine.runtime.reference import ReferenceExecutor

    t0 = time.perf_counter()
    out = {"case": dataclasses.asdict(case), "status": "error", "oracle": "pp baseline, same split/steps/dtype",
           "prompts": plan.prompts, "new_tokens": plan.new_tokens}
    ecfg = case_config(case, plan, "spd")
    prompts = prompts_for(plan, ecfg.model.cfg.vocab_size)
    with graph_modes() as modes:
        with ReferenceExecutor(case_config(case, plan, "pp"), lockstep=False) as ex:
            refs = [ex.generate(p, plan.new_tokens).tokens for p in prompts]
        own, forced, ticks, accepted = [], [], 0, 0
        with ReferenceExecutor(ecfg, lockstep=False) as ex:
            for p, ref in zip(prompts, refs):
                r = ex.generate(p, plan.new_tokens)
                own.append(r.tokens)
                f = ex.generate(p, plan.new_tokens, draft_policy=ForcedDrafts(ref, len(p), ecfg.model.cfg.vocab_size))
                forced.append(f.tokens)
                ticks += f.ticks
                accepted += f.accepted
    graphed = sum(m == "cuda graph" for m in modes)
    diffs = [_first_diff(got, ref) for got, ref in zip(own + forced, refs + refs)]
    equal = all(d is None for d in diffs)
    out.update(status="pass" if equal else "fail", bit_equal=equal,
               first_difference=[d for d in diffs if d is not None][:1] or None,
               forced_accepted=accepted, forced_ticks=ticks, step_graphs=len(modes), graphed=graphed,
               fallbacks=sorted({m for m in modes if m != "cuda graph"}) if modes else [],
               seconds=round(time.perf_counter() - t0, 2))
    if case.step_mode == "graph" and graphed < len(modes):
        out["status"] = "fail"  # a graph run whose steps ran eagerly did not check the graphs
        out["why"] = f"{len(modes) - graphed} of {len(modes)} step graphs fell back to eager"
    return out


def sampling_checks(plan: CheckPlan) -> dict:
    """T > 0: the same keyed draws give the same tokens twice; branch width 2 at T = 0 equals
    greedy through the same steps, or first differs at a near-tie (docs/testing.md)."""
    from spd_engine.engine.protocol.sampling import SamplingParams
    from spd_engine.engine.runtime.reference import ReferenceExecutor

    case = plan.sampling_case
    ecfg = case_config(case, plan, "spd")
    prompts = prompts_for(plan, ecfg.model.cfg.vocab_size)
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    out: dict = {"case": dataclasses.asdict(case)}
    with ReferenceExecutor(ecfg, lockstep=False) as ex:
        first = [ex.generate(p, plan.new_tokens, sampling=sp).tokens for p in prompts]
        second = [ex.generate(p, plan.new_tokens, sampling=sp).tokens for p in prompts]
    out["sampling_twice"] = {"status": "pass" if first == second else "fail", "temperature": 1.0, "top_p": 0.9,
                             "seed": 7, "tokens": sum(map(len, first))}
    with ReferenceExecutor(case_config(case, plan, "pp"), lockstep=False) as ex:
        refs = [ex.generate(p, plan.new_tokens).tokens for p in prompts]
    with ReferenceExecutor(case_config(case, plan, "spd", branches=2), lockstep=False) as ex:
        got, saves = [], 0
        for p, ref in zip(prompts, refs):
            r = ex.generate(p, plan.new_tokens, draft_policy=ForcedDrafts(ref, len(p), ecfg.model.cfg.vocab_size))
            got.append(r.tokens)
            saves += r.branch_points
    diffs = [_first_diff(g, r) for g, r in zip(got, refs)]
    branch = {"status": "pass", "width": 2, "branch_points": saves, "first_difference": None}
    for p, g, r, d in zip(prompts, got, refs, diffs):
        if d is None:
            continue
        gap = _logit_gap(ecfg, p, r, d, g[d] if d < len(g) else None)
        bound = 2 * _tie_bound(case.dtype)
        branch.update(first_difference=d, logit_gap=gap, near_tie_bound=bound,
                      status="pass (near-tie)" if gap is not None and gap <= bound else "fail")
        break
    out["branch_width_2"] = branch
    return out


def _tie_bound(dtype: str) -> float:
    """A bound on |logit difference| between two computations of the same logits that differ in
    summation order: fp32 as docs/testing.md measures it; bf16 rounds each product to 8 bits."""
    return 1e-4 if dtype == "float32" else 5e-2


@torch.no_grad()
def _logit_gap(ecfg, prompt: list[int], ref: list[int], k: int, other: int | None) -> float | None:
    """|logit(ref[k]) - logit(other)| at the divergence, from the full model teacher-forced."""
    from spd_engine.engine.runtime.build import build_stage_model

    if other is None:
        return None
    model = build_stage_model(ecfg, range(ecfg.model.cfg.num_layers), embedding=True, head=True)
    ids = torch.tensor([list(prompt) + list(ref[:k])], device=ecfg.parallel.device)
    h, _ = model.forward_layers(model.embed(ids), model.new_cache(1, ids.shape[1]), 0)
    logits = model.logits(h[:, -1])[0].float()
    return abs(float(logits[ref[k]] - logits[other]))


def run_lossless(plan: CheckPlan, dl: Deadline, log: Callable[[str], None]) -> dict:
    cases = []
    with device_random_weights():
        for case in plan.lossless:
            if dl.left() <= 0:
                cases.append({"case": dataclasses.asdict(case), "status": "skipped (time budget)"})
                continue
            try:
                res = lossless_case(case, plan)
            except Exception as err:  # one failing configuration must not hide the others' results
                res = {"case": dataclasses.asdict(case), "status": "error", "error": error_line(err)}
            cases.append(res)
            log(f"  lossless {case.shape} n={case.n} {case.step_mode} {case.dtype}: {res['status']}"
                f" ({res.get('seconds', '-')} s)")
            free(torch.device(plan.device))
        if dl.left() > 0:
            try:
                sampling = sampling_checks(plan)
            except Exception as err:  # reported, and the rest of the run goes on
                sampling = {"status": "error", "error": error_line(err)}
        else:
            sampling = {"status": "skipped (time budget)"}
    log(f"  T>0 twice / branch width 2: {sampling.get('sampling_twice', sampling).get('status')} / "
        f"{sampling.get('branch_width_2', sampling).get('status')}")
    return {"cases": cases, "sampling": sampling}
