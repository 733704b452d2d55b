"""Suffix drafts (engine/protocol/suffix.py, engine/protocol/drafting.py): the index on its own, the runtime with
suffix drafts on (lossless against greedy decoding on every topology, the tick formula, the
suffix source really drafting), and the exact T=0 replay agreeing with the runtime."""
from __future__ import annotations

import math

import pytest
from helpers import full_model, random_prompts, reference, tiny_engine_config

from spd_engine.engine.protocol.drafting import PDM, SUFFIX, DraftChooser
from spd_engine.engine.protocol.suffix import SuffixIndex, SuffixSettings
from spd_engine.engine.runtime.reference import ReferenceExecutor
from spd_engine.train.fast_eval import fast_generate

NEW = 48


def test_index_proposes_the_follower_of_the_longest_earlier_match():
    index = SuffixIndex(SuffixSettings(max_len=4, min_match=1))
    index.extend([1, 2, 3, 9, 1, 2, 3])
    p = index.propose([9, 1, 2, 3], 7)  # context ends ... 1 2 3: earlier "1 2 3" was followed by 9
    assert (p.token, p.length) == (9, 3)
    # unverified in-flight tokens: context = history + [4, 5]; "3 4 5" never occurred, "5" neither
    assert index.propose([1, 2, 3, 4, 5], 9) is None
    # the suffix "2 3" ending in flight: history has "2 3" twice, the latest one is followed by the
    # first in-flight token
    index2 = SuffixIndex(SuffixSettings(max_len=4, min_match=2))
    index2.extend([7, 2, 3, 8, 2, 3])
    p = index2.propose([3, 6, 2, 3], 9)  # context = history + in-flight [6, 2, 3]
    assert p.token == 6 and p.length == 2  # the latest earlier "2 3" (history end) is followed by 6


def test_index_never_matches_the_suffix_with_itself_and_respects_min_match():
    index = SuffixIndex(SuffixSettings(max_len=8, min_match=3))
    index.extend([5, 6, 7])
    assert index.propose([5, 6, 7], 3) is None  # the only occurrence is the suffix itself
    index.extend([1, 5, 6])
    assert index.propose([7, 1, 5, 6], 6) is None  # "5 6" matches, but is shorter than min_match 3
    with pytest.raises(ValueError, match="min_match"):
        SuffixSettings(max_len=2, min_match=3)


def test_chooser_rule():
    from spd_engine.engine.protocol.suffix import SuffixProposal

    c = DraftChooser(SuffixSettings(16, 2), pdm_margin=3.0)
    assert c.choose(4, 1.0, SuffixProposal(9, 2)) == (9, SUFFIX)
    assert c.choose(4, 5.0, SuffixProposal(9, 2)) == (4, PDM)  # the PDM is confident
    assert c.choose(4, 1.0, SuffixProposal(9, 1)) == (4, PDM)  # match too short
    assert c.choose(4, 1.0, None) == (4, PDM)


@pytest.mark.parametrize("arch,n,colocate,step_mode", [("llama", 1, False, "eager"), ("llama", 2, False, "eager"),
                                                        ("qwen2", 3, False, "eager"), ("qwen3", 4, True, "eager"),
                                                        ("llama", 3, False, "static")])
def test_suffix_drafts_are_lossless_and_draft(arch, n, colocate, step_mode, one_thread):
    ecfg = tiny_engine_config(arch, n, colocate, step_mode=step_mode, suffix_drafts=True, suffix_min_match=1)
    prompts = random_prompts(ecfg.model.cfg, (5, 23, 40), seed=3)
    drafted = verified = 0
    with ReferenceExecutor(ecfg) as ex:
        for p in prompts:
            want = reference(ecfg, p, NEW)
            res = ex.generate(p, NEW, ())
            assert res.tokens == want
            R = res.rejections
            assert res.ticks == (len(want) - 1) + (n - 1) * (1 + R)
            sfx = res.by_source.get(SUFFIX, [0, 0, 0])
            drafted, verified = drafted + sfx[0], verified + sfx[1]
            assert sum(v[1] for v in res.by_source.values()) == res.verified
            assert sum(v[2] for v in res.by_source.values()) == res.accepted
    assert drafted > 0 and verified > 0  # the suffix source really drafted


@pytest.mark.parametrize("n,margin", [(2, math.inf), (4, 2.0)])
def test_fast_replay_equals_the_runtime_with_suffix_drafts(n, margin, one_thread):
    ecfg = tiny_engine_config("llama", n, suffix_drafts=True, suffix_min_match=2, suffix_pdm_margin=margin)
    target = full_model(ecfg)
    with ReferenceExecutor(ecfg) as ex:
        for p in random_prompts(ecfg.model.cfg, (7, 30), seed=5):
            res = ex.generate(p, NEW, ())
            fast = fast_generate(target, ex.driver.pdm, p, NEW, (), chunk=ecfg.runtime.prefill_chunk, chooser=ecfg.chooser())
            assert fast.tokens == res.tokens
            a = fast.acceptance
            assert (a.ticks, a.verified, a.accepted, a.rejections) == (res.ticks, res.verified, res.accepted,
                                                                       res.rejections)
            assert {k: v for k, v in a.by_source.items()} == {k: v[1:] for k, v in res.by_source.items() if v[1]}


def test_cross_request_history_never_proposes_a_separator_and_is_bounded():
    from spd_engine.engine.protocol.suffix import CrossRequestHistory

    cross = CrossRequestHistory(SuffixSettings(max_len=4, min_match=2), max_tokens=10)
    cross.add([1, 2], [3, 4])  # history 1 2 3 4 SEP
    assert cross.propose([9, 2, 3]).token == 4  # "2 3" was followed by 4
    assert cross.propose([9, 3, 4]) is None  # "3 4" was followed by the separator only
    cross.add([5, 6], [7, 8, 9])  # 5 + 6 tokens > 10: the history starts over with this request
    assert cross.propose([0, 2, 3]) is None and cross.propose([0, 6, 7]).token == 8


def test_fast_replay_equals_the_runtime_with_cross_request_drafts(one_thread):
    ecfg = tiny_engine_config("llama", 3, suffix_drafts=True, suffix_min_match=2, suffix_cross_request=True)
    target = full_model(ecfg)
    prompts = random_prompts(ecfg.model.cfg, (9, 12, 9), seed=7)
    prompts[2] = list(prompts[0])  # a repeated request: its whole answer is in the history
    cross = ecfg.chooser().new_history()
    alphas = []
    with ReferenceExecutor(ecfg) as ex:
        for p in prompts:
            res = ex.generate(p, NEW, ())
            assert res.tokens == reference(ecfg, p, NEW)
            fast = fast_generate(target, ex.driver.pdm, p, NEW, (), chunk=ecfg.runtime.prefill_chunk, chooser=ecfg.chooser(),
                                 cross=cross)
            cross.add(p, fast.tokens)
            a = fast.acceptance
            assert (a.ticks, a.verified, a.accepted) == (res.ticks, res.verified, res.accepted)
            alphas.append(res.alpha)
    assert alphas[2] > alphas[0]  # the repeated request drafts from the first one's answer
