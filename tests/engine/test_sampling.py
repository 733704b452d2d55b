"""Sampling: parameters, the target distribution (parity with HF's warpers), keyed draws,
and the statistical helpers in tests/stats.py that the sampling and verification tests rely on."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from stats import TEST_LEVEL, chi2_sf, chi_square_pvalue, rejection_rate, tv_distance, worst_case_shift
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import spd_engine.engine.protocol.sampling as sampling
from spd_engine.engine.protocol.sampling import (
    PURPOSES,
    SamplingParams,
    draw_key,
    keyed_generator,
    sample,
    splitmix64,
    target_probs,
    uniform,
)

# ---- parameters ----


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.2), "top_p"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**64), "seed"),
])
def test_params_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_defaults_are_greedy():
    params = SamplingParams()
    assert params.greedy and params.top_k == 0 and params.top_p == 1.0 and params.seed == 0
    assert not SamplingParams(temperature=0.7).greedy


def test_from_generation_config_follows_hf_semantics():
    # no do_sample: greedy, whatever the file says about temperature (HF generate ignores it too)
    assert SamplingParams.from_generation_config({"temperature": 0.6, "bos_token_id": 1}).greedy
    params = SamplingParams.from_generation_config({"do_sample": True, "temperature": 0.6, "top_p": 0.9})
    assert (params.temperature, params.top_k, params.top_p) == (0.6, 50, 0.9)  # HF's default top_k 50
    params = SamplingParams.from_generation_config({"do_sample": True, "top_k": 0, "top_p": None})
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 0, 1.0)


def test_from_generation_config_overrides():
    config = {"do_sample": True, "temperature": 0.6, "top_k": 20}
    params = SamplingParams.from_generation_config(config, temperature=0.0, top_k=None, seed=7)
    assert (params.temperature, params.top_k, params.seed) == (0.0, 20, 7)
    params = SamplingParams.from_generation_config({}, temperature=0.8)
    assert (params.temperature, params.top_k) == (0.8, 50)
    with pytest.raises(ValueError, match="unknown parameters"):
        SamplingParams.from_generation_config({}, do_sample=True)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_generation_config({"do_sample": True, "top_p": 1.5})


# ---- target distribution ----


def hf_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What HF generate samples from, built from its own warpers in its own order."""
    scores = logits.float()
    if params.temperature != 1.0:
        scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores.softmax(dim=-1)


def logits_with_ties(rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3  # [R, V]
    logits[:, 5] = logits[:, 9] = logits[:, 2]  # ties inside the distribution
    return logits


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.6, 10, 0.9), (2.0, 1, 0.5),
    (0.9, 300, 0.95), (1.0, 0, 0.05), (1.0, 0, 1e-9),
])
def test_target_probs_match_hf_warpers(temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    logits = logits_with_ties(6, 200, seed=top_k + int(100 * top_p))
    ours, theirs = target_probs(logits, params), hf_probs(logits, params)
    assert ours.dtype == torch.float32 and ours.shape == (6, 200)
    assert torch.equal(ours == 0, theirs == 0)  # the same tokens filtered out
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.sum(-1), torch.ones(6))
    # a single row [V] gives the same as row 0 of the batch
    torch.testing.assert_close(target_probs(logits[0], params), ours[0])


def test_target_probs_filters_change_the_distribution():
    logits = logits_with_ties(1, 50, seed=3)[0]
    full = target_probs(logits, SamplingParams(temperature=1.0))
    assert int((full > 0).sum()) == 50
    assert int((target_probs(logits, SamplingParams(temperature=1.0, top_k=7)) > 0).sum()) == 7
    nucleus = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    kept = full[nucleus > 0]
    assert kept.sum() > 0.5 and kept.sum() - kept.min() <= 0.5  # smallest head with mass > top_p


@pytest.mark.parametrize("top_p, kept", [(0.75, 3), (0.5, 2), (0.25, 1), (0.7, 3), (0.76, 4)])
def test_top_p_boundary_keeps_exact_mass(top_p, kept):
    """Uniform over 4 tokens: a head of mass exactly top_p is enough, as in HF."""
    logits = torch.zeros(1, 4)
    params = SamplingParams(temperature=1.0, top_p=top_p)
    probs = target_probs(logits, params)
    assert int((probs > 0).sum()) == kept
    assert torch.equal(probs > 0, hf_probs(logits, params) > 0)


def test_greedy_is_one_hot_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, -1.0], [-1.0, -2.0, 0.0, 0.0]])
    probs = target_probs(logits.to(torch.bfloat16), SamplingParams())
    assert probs.dtype == torch.float32
    assert probs.argmax(-1).tolist() == logits.argmax(-1).tolist() == [1, 0, 2]
    assert torch.equal(probs.sum(-1), torch.ones(3)) and torch.equal(probs.max(-1).values, torch.ones(3))


def test_target_probs_rejects_bad_shapes():
    with pytest.raises(ValueError, match="logits"):
        target_probs(torch.zeros(2, 3, 4), SamplingParams())


# ---- keyed draws ----


def test_splitmix64_reference_vector():
    # the published splitmix64 stream from state 0 (splitmix64.c, Java SplittableRandom(0))
    state, outputs = 0, []
    for _ in range(3):
        outputs.append(splitmix64(state))
        state = (state + 0x9E3779B97F4A7C15) & (2**64 - 1)
    assert outputs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_keyed_draws_depend_only_on_the_key():
    first = uniform(keyed_generator(11, 42, "accept"))
    torch.manual_seed(123)  # global RNG state and earlier draws must not matter
    torch.rand(10)
    for position in range(5):
        uniform(keyed_generator(11, position, "draft"))
    assert uniform(keyed_generator(11, 42, "accept")) == first
    others = {uniform(keyed_generator(s, p, purpose)) for s, p, purpose in
              [(12, 42, "accept"), (11, 43, "accept"), (11, 42, "residual"), (11, 42, "draft"),
               (11, 42, "target")]}
    assert first not in others and len(others) == 5


def test_draw_keys_are_distinct_across_many_keys():
    keys = {draw_key(seed, pos, purpose) for seed in range(4) for pos in range(500) for purpose in PURPOSES}
    assert len(keys) == 4 * 500 * len(PURPOSES)


def test_draw_key_validated():
    with pytest.raises(ValueError, match="purpose"):
        draw_key(0, 1, "verify")
    with pytest.raises(ValueError, match="position"):
        draw_key(0, -1, "draft")


def test_same_draws_in_another_process():
    """Keys must not involve Python's salted hash: another process with another hash seed agrees."""
    keys = [(0, 0, "draft"), (5, 17, "accept"), (2**64 - 1, 10**6, "residual")]
    probs = [0.1, 0.2, 0.3, 0.4]
    code = ("import json, sys, torch; from spd_engine.engine.protocol.sampling import keyed_generator, uniform, sample; "
            "keys, probs = json.loads(sys.argv[1]); "
            "print(json.dumps([[uniform(keyed_generator(*k)), sample(torch.tensor(probs), keyed_generator(*k))] "
            "for k in keys]))")
    env = dict(os.environ, PYTHONHASHSEED="4242")
    result = subprocess.run([sys.executable, "-c", code, json.dumps([keys, probs])], env=env,
                            capture_output=True, text=True, check=True, timeout=120)
    here = [[uniform(keyed_generator(*k)), sample(torch.tensor(probs), keyed_generator(*k))] for k in keys]
    assert json.loads(result.stdout) == here


def test_uniform_range_and_distribution():
    draws = np.array([uniform(keyed_generator(3, p, "accept")) for p in range(20000)])
    assert draws.min() >= 0 and draws.max() < 1
    counts = np.histogram(draws, bins=10, range=(0, 1))[0]
    assert chi_square_pvalue(counts, np.full(10, 0.1)) > TEST_LEVEL


def test_sample_matches_distribution_and_skips_zero_weights():
    probs = torch.tensor([0.3, 0.0, 0.05, 0.2, 0.0, 0.25, 0.15, 0.05])
    counts = np.bincount([sample(probs, keyed_generator(9, p, "target")) for p in range(20000)], minlength=8)
    assert counts[1] == 0 and counts[4] == 0
    assert chi_square_pvalue(counts, probs.numpy()) > TEST_LEVEL
    assert tv_distance(counts, probs.numpy()) < 0.015


def test_sample_accepts_unnormalised_weights():
    weights = torch.tensor([0.0, 2.0, 6.0])
    counts = np.bincount([sample(weights, keyed_generator(1, p, "residual")) for p in range(4000)], minlength=3)
    assert counts[0] == 0 and chi_square_pvalue(counts, [0.0, 0.25, 0.75]) > TEST_LEVEL


def test_sample_edges_of_the_uniform(monkeypatch):
    probs = torch.tensor([0.0, 0.25, 0.75, 0.0, 0.0])
    monkeypatch.setattr(sampling, "uniform", lambda gen: 0.0)
    assert sample(probs, torch.Generator()) == 1  # first token with weight, not token 0
    monkeypatch.setattr(sampling, "uniform", lambda gen: 1.0 - 2.0**-53)
    assert sample(probs, torch.Generator()) == 2  # last token with weight, not the last id


def test_sample_refuses_invalid_weights():
    for bad in ([0.0, 0.0], [0.5, math.nan], [1.0, -0.5]):
        with pytest.raises(AssertionError):
            sample(torch.tensor(bad), keyed_generator(0, 0, "target"))


# ---- statistical helpers (tests/stats.py) ----


@pytest.mark.parametrize("x", [0.01, 0.7, 2.0, 5.5, 13.0, 40.0])
def test_chi2_sf_closed_forms(x):
    # df = 1: erfc(sqrt(x/2)); even df: exp(-x/2) * sum_{k < df/2} (x/2)^k / k!
    assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9, abs=1e-15)
    for df in (2, 4, 10, 30):
        exact = math.exp(-x / 2) * sum((x / 2) ** k / math.factorial(k) for k in range(df // 2))
        assert chi2_sf(x, df) == pytest.approx(exact, rel=1e-9, abs=1e-15)


def test_tv_and_impossible_cells():
    assert tv_distance([50, 50, 0], [0.5, 0.5, 0.0]) == 0
    assert tv_distance([100, 0], [0.5, 0.5]) == pytest.approx(0.5)
    assert chi_square_pvalue([10, 10, 1], [0.5, 0.5, 0.0]) == 0.0
    assert chi_square_pvalue([200, 0], [1.0, 0.0]) == 1.0
    assert chi_square_pvalue([900, 100], [0.5, 0.5]) < 1e-100


# the distribution the verification tests use (8 tokens); any 8-cell table gives the same bound
POWER_PROBS = np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])


def test_power_against_tv_shift_of_0_02():
    shifted = worst_case_shift(POWER_PROBS, 0.02)
    assert 0.5 * np.abs(shifted - POWER_PROBS).sum() == pytest.approx(0.02)
    assert rejection_rate(POWER_PROBS, shifted, samples=20000, trials=1000, level=0.05) >= 0.9
    # and at the level the keyed tests use, with their 40,000 draws
    assert rejection_rate(POWER_PROBS, shifted, samples=40000, trials=1000, level=TEST_LEVEL) >= 0.9


def test_true_distribution_accepted_95_percent():
    rate = rejection_rate(POWER_PROBS, POWER_PROBS, samples=20000, trials=2000, level=0.05, seed=1)
    assert 0.035 <= rate <= 0.065  # 5% false alarms, +-3.1 standard errors of 2000 trials
