"""Lossless sampling with penalties, measured: at T > 0 the tokens SPD commits for a request with
repetition, frequency and presence penalties are distributed exactly as plain sampling from the
penalised target (engine/protocol/logits_processing.py, then target_probs), with a poor draft (many
rejections, re-drafts after flushes) and with suffix runs (a run's second token verified with the
first one counted as output). The machinery is test_sampling_distribution.py's (a 6-token target,
the joint of the first three tokens, chi-square and total variation); only the exact distribution
is computed here, with the penalties. The same draws must fail against the unpenalised joint, so
the check can tell the two apart."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
from helpers import full_model, seed_pool  # noqa: F401
from stats import TEST_LEVEL, chi_square_pvalue, tv_distance
from test_sampling_distribution import (
    ALONE,
    NEW,
    POOR_TOPK,
    RUN_TOPK,
    SEED_BATCH,
    SMALL,
    Conditionals,
    Draws,
    Setup,
    V,
    draw,
    draw_parallel,
    exact_joint,
    judge,
    report,
)

from spd_engine.engine.model.greedy import prefill
from spd_engine.engine.protocol.logits_processing import TokenHistory
from spd_engine.engine.protocol.sampling import target_probs

PENALTIES = dict(repetition_penalty=2.5, frequency_penalty=1.0, presence_penalty=0.5)
POOR_PENALISED = dataclasses.replace(POOR_TOPK, name="poor-topk2-penalties",
                                     params=dataclasses.replace(POOR_TOPK.params, **PENALTIES))
RUN_PENALISED = dataclasses.replace(RUN_TOPK, name="suffix-run-topk2-penalties",
                                    params=dataclasses.replace(RUN_TOPK.params, **PENALTIES))


@torch.no_grad()
def processed_conditionals(setup: Setup) -> Conditionals:
    """p(next | prompt + prefix) from the penalised logits, for every generated prefix shorter than NEW."""
    ecfg = setup.engine_config()
    model = full_model(ecfg)
    out: Conditionals = {}
    for length in range(NEW):
        for prefix in np.ndindex(*(V,) * length):
            prefix = tuple(int(t) for t in prefix)
            ids = list(setup.prompt) + list(prefix)
            h = prefill(model, model.new_cache(1, len(ids)), ids, ecfg.runtime.prefill_chunk)  # [H]
            hist = TokenHistory(setup.params, setup.prompt, ())
            hist.extend(prefix)
            out[prefix] = target_probs(hist.process(model.logits(h), len(ids)), setup.params)
    return out


def check(pool, setup: Setup) -> Draws:
    """SMALL seeded requests of `setup` pass against the penalised joint and fail against the plain one."""
    joint = exact_joint(processed_conditionals(setup))
    unpenalised = dataclasses.replace(setup.params, repetition_penalty=1.0, frequency_penalty=0.0,
                                      presence_penalty=0.0)
    plain = exact_joint(processed_conditionals(dataclasses.replace(setup, params=unpenalised)))
    assert tv_distance(plain, joint) > 0.2  # the penalties move the distribution far
    batch = SEED_BATCH if setup.draft == "pdm" else 1  # a draft policy acts on a lone request
    draws = draw_parallel(pool, setup, range(SMALL), batch=batch)
    if batch > 1:
        assert draws.outputs[:ALONE] == draw(setup, range(ALONE)).outputs  # each request draws what it draws alone
    verdict = judge(draws, joint)
    report(f"{setup.name} correct", draws, verdict)
    assert verdict.passes, verdict
    assert chi_square_pvalue(draws.counts, plain) < TEST_LEVEL  # ... and the draws tell them apart
    return draws


def test_penalised_spd_samples_the_penalised_distribution(seed_pool, one_thread):
    draws = check(seed_pool, POOR_PENALISED)
    assert draws.accepted < 0.7 * draws.verified  # a poor draft: many rejections


def test_penalised_suffix_runs_sample_the_penalised_distribution(seed_pool, one_thread):
    draws = check(seed_pool, RUN_PENALISED)
    assert draws.run_verified > 0.2 * SMALL  # run tokens were verified with the run before them as output
