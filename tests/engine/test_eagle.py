"""The serial eagle baseline on tiny models: greedy output (T=0) against greedy decoding, the
round counters against a count made from the draft policy alone, rollback after rejections,
EOS inside a chain, the head's checkpoint format, and config validation.

A round verifies k + 1 tokens in one target forward, another computation shape than greedy's
one-token steps, so the oracle comparison is claim 2 of docs/testing.md: equal tokens, or a first
difference at a near-tie (counted and printed; none is expected on these fp32 tiny models).
"""
from __future__ import annotations

import pytest
import torch
from helpers import ARCHS, Policy, full_model, random_prompts, reference, tiny_engine_config
from near_ties import assert_greedy_agrees, teacher_forced

from spd_engine.engine.model.eagle_head import (
    EagleConfig,
    check_eagle_matches,
    default_feature_layers,
    load_eagle,
    random_eagle,
    save_eagle,
)
from spd_engine.engine.model.model_config import tiny_config
from spd_engine.engine.runtime.reference import ReferenceExecutor

TINY_BOUND = 1e-6  # fp32 tiny logits O(1): two computations of the same logits (docs/testing.md)


def eagle_config(arch: str = "llama", k: int = 3, **kw):
    return tiny_engine_config(arch, 1, mode="eagle", eagle_k=k, threads=1, **kw)


def expected_counts(N: int, k: int, wrong: frozenset[int]) -> tuple[int, int, int]:
    """(target passes, verified, accepted) for N tokens when the drafts of token indices in `wrong`
    are rejected and every other draft is right: each round drafts min(k, tokens left - 1) tokens,
    commits the accepted prefix and one target token."""
    done, passes, verified, accepted = 1, 0, 0, 0
    while done < N:
        chain = range(done, done + min(k, N - done - 1))
        passes += 1
        bad = next((i for i in chain if i in wrong), None)
        good = len(chain) if bad is None else bad - done
        verified += good + (bad is not None)
        accepted += good
        done += good + 1
    return passes, verified, accepted


def agrees(ecfg, prompt, got, want, what: str) -> None:
    split = assert_greedy_agrees(got, want, teacher_forced(full_model(ecfg), prompt, want), TINY_BOUND, what)
    if split is not None:
        print(f"{what}: near-tie at token {split}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_untrained_head_is_lossless(arch, k, one_thread):
    ecfg = eagle_config(arch, k)
    with ReferenceExecutor(ecfg) as ex:
        for prompt in random_prompts(ecfg.model.cfg, [1, 7, 40], seed=k):  # 40: three prefill chunks
            want = reference(ecfg, prompt, 48)
            res = ex.generate(prompt, 48)
            agrees(ecfg, prompt, res.tokens, want, f"{arch} k={k} prompt of {len(prompt)}")
            assert res.target_passes == res.ticks >= 1 and res.n == 1
            assert res.acceptance_length == pytest.approx((len(res.tokens) - 1) / res.target_passes)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_counters_and_rollback_with_forced_rejections(k, one_thread):
    """Oracle drafts except at `wrong`: the output is still greedy's (the rejected drafts' KV
    entries are overwritten), and the counters equal the count made from the policy."""
    ecfg = eagle_config("llama", k)
    N = 40
    cases = [frozenset(), frozenset({1}), frozenset({2, 3, 9, 10, 11, 20}), frozenset(range(1, N, 3)),
             frozenset({N - 1}), frozenset(range(1, N))]
    with ReferenceExecutor(ecfg) as ex:
        for prompt in random_prompts(ecfg.model.cfg, [5, 23], seed=1):
            want = reference(ecfg, prompt, N)
            assert len(want) == N
            for wrong in cases:
                policy = Policy(want, len(prompt), ecfg.model.cfg.vocab_size, wrong)
                res = ex.generate(prompt, N, draft_policy=policy)
                assert res.tokens == want, wrong  # the oracle drafts decide every token but the rejected
                passes, verified, accepted = expected_counts(N, k, wrong)
                assert (res.target_passes, res.verified, res.accepted) == (passes, verified, accepted), wrong
    assert expected_counts(N, 4, frozenset()) == (8, 31, 31)  # ceil(39 / 5) rounds of 4 drafts + a bonus


def test_eos_inside_a_chain_and_on_token_stop(one_thread):
    ecfg = eagle_config("llama", 4)
    prompt = random_prompts(ecfg.model.cfg, [9], seed=3)[0]
    want = reference(ecfg, prompt, 30)
    eos = want[6]  # an oracle chain covers tokens 5..8: the EOS is committed mid-chain
    cut = want[:want.index(eos) + 1]
    with ReferenceExecutor(ecfg) as ex:
        res = ex.generate(prompt, 30, (eos,), draft_policy=Policy(want, len(prompt), ecfg.model.cfg.vocab_size))
        assert res.tokens == cut
        seen = []
        res = ex.generate(prompt, 30, draft_policy=Policy(want, len(prompt), ecfg.model.cfg.vocab_size),
                          on_token=lambda t: seen.append(t) if len(seen) < 11 else False)
        assert res.tokens == want[:12] == seen + [want[11]]
        assert ex.generate(prompt, 1).tokens == want[:1] and ex.generate(prompt, 2).tokens == want[:2]


def test_an_accept_everything_verifier_is_caught(one_thread):
    """The oracle comparison above can fail: a verifier that accepts every draft of the untrained
    head commits its drafts, and the output parts from greedy decoding at a clear margin."""
    ecfg = eagle_config("llama", 3)
    prompt = random_prompts(ecfg.model.cfg, [7], seed=0)[0]
    want = reference(ecfg, prompt, 24)
    with ReferenceExecutor(ecfg) as ex:
        ex.driver._verify = lambda logits, pos, proposed, target: (True, proposed)
        got = ex.generate(prompt, 24).tokens
    with pytest.raises(AssertionError, match="not a near-tie"):
        agrees(ecfg, prompt, got, want, "accept-all")


def test_head_checkpoint_round_trip_and_wrong_model(tmp_path, one_thread):
    cfg = tiny_config("llama", tie_embeddings=False)
    head = random_eagle(cfg, seed=4, draft_vocab=tuple(range(3, 60)))
    save_eagle(head, tmp_path / "h", extra={"note": 1})
    back = load_eagle(tmp_path / "h", cfg)
    h = torch.randn(5, cfg.hidden_size)
    assert torch.equal(back.draft_logits(h), head.draft_logits(h))
    assert back.ecfg == head.ecfg and back.draft_ids.tolist() == list(range(3, 60))
    other = tiny_config("llama", tie_embeddings=False, num_layers=8)
    with pytest.raises(ValueError, match="trained for another model"):
        load_eagle(tmp_path / "h", other)
    with pytest.raises(ValueError, match="trained for another model"):
        check_eagle_matches(head.ecfg, other)
    with pytest.raises(ValueError, match="no EAGLE head"):
        load_eagle(tmp_path / "missing", cfg)
    (tmp_path / "h" / "eagle.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="corrupt EAGLE head weights"):
        load_eagle(tmp_path / "h", cfg)


def test_feature_layers_and_config_validation():
    assert default_feature_layers(30) == (1, 14, 26)  # SmolLM2: EAGLE-3's low / mid / high
    assert default_feature_layers(6) == (0, 2, 5)
    for bad in [(1, 2), (3, 2, 1), (0, 1, -1)]:
        with pytest.raises(ValueError, match="feature layers"):
            EagleConfig(bad)
    with pytest.raises(ValueError, match="outside the target"):
        random_eagle(tiny_config("llama"), feature_layers=(0, 1, 6))
    with pytest.raises(ValueError, match="one rank"):
        tiny_engine_config("llama", 2, mode="eagle")
    with pytest.raises(ValueError, match="eagle-k"):
        eagle_config(k=0)
    with pytest.raises(ValueError, match="EAGLE head not found"):
        eagle_config(eagle_head="/nonexistent")
