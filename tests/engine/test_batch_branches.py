"""Branch width W with several requests in the pipeline (engine/runtime/batch_driver.py, docs/design.md
3.11 and 3.12): a request's branch points, chains and survivors travel in the BATCH messages next to
the other requests' rows, and every request's output, ticks, verifications and branch points equal
its own solo run's, greedy and seeded, joining and leaving at different ticks.

The branch points' candidates are forced (as in test_branches_runtime.py): distinct wrong tokens,
with the target's token at a row that varies by position or nowhere, so that a branch point is
accepted by its first chain, saved by a later one (its survivor's KV entries and anchors move down
at every stage and in the driver's rings), or rejected. A chain step computes W rows in one matmul,
so the solo run equals greedy decoding up to a near-tie (test_branches_runtime.py); the batch run
must equal the solo run exactly.
"""
from __future__ import annotations

import pytest
import torch
from helpers import CHUNK, Policy, full_model, random_prompts, reference, solo_results, summary, tiny_cfg, tiny_engine_config
from near_ties import assert_greedy_agrees, teacher_forced
from test_batch_runtime import seeded_requests
from test_branches_runtime import CHAIN_LOGIT_BOUND, truth_row

from spd_engine.engine.model.kv_cache import RowCaches, chain_mask, chain_slot0
from spd_engine.engine.model.model import StageModel, init_random_
from spd_engine.engine.protocol.tick import Draft
from spd_engine.engine.runtime.batch_driver import BatchRequest
from spd_engine.engine.runtime.branch_chains import BranchChains
from spd_engine.engine.runtime.launch import launch
from spd_engine.engine.runtime.reference import ReferenceExecutor

W = 2
NEW = 24


def test_a_chain_group_in_a_step_of_several_requests_equals_the_chains_alone():
    """A stage step whose rows are one request's token and another's branch point chains (RowCaches
    with that request's tree mask) gives each row what its request's own step gives."""
    torch.manual_seed(0)
    cfg = tiny_cfg("qwen3")
    model = init_random_(StageModel(cfg, range(cfg.num_layers), embedding=True), seed=4)
    prompts, q, pos = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9]], 6, 7  # the chains: branch point 6, now at 7
    alone, several = ([model.new_cache(1, 32) for _ in prompts] for _ in range(2))
    for caches in (alone, several):
        for cache, ids in zip(caches, prompts):
            model.forward_layers(model.embed(torch.tensor([ids])), cache, 0)
        chains = model.embed(torch.tensor([[11, 12]]))  # the branch point's two candidates at q
        model.forward_layers(chains, caches[1], chain_slot0(q, q, W), torch.full((1, W), q), chain_mask(q, q, W, None))
    tokens = [[13], [14, 15]]  # request 0's next token; each chain's next token at pos
    want = [model.forward_layers(model.embed(torch.tensor([tokens[0]])), alone[0], len(prompts[0]))[0][0],
            model.forward_layers(model.embed(torch.tensor([tokens[1]])), alone[1], chain_slot0(q, pos, W),
                                 torch.full((1, W), pos), chain_mask(q, pos, W, None))[0][0]]
    rows = RowCaches(several, [len(prompts[0]), chain_slot0(q, pos, W)], [1, W],
                     [None, chain_mask(q, pos, W, None)[0, 0]])
    got, _ = model.forward_layers(model.embed(torch.tensor([tokens[0] + tokens[1]])), rows, 0,
                                  positions=torch.tensor([[len(prompts[0]), pos, pos]]))
    torch.testing.assert_close(got[0], torch.cat(want), rtol=1e-5, atol=1e-5)


def branched(res) -> dict:
    """What must equal the solo run's: summary() and the branch counters."""
    return dict(summary(res), branch_points=res.branch_points, branch_saves=res.branch_saves)


@pytest.fixture
def forced(monkeypatch):
    """Every branch point's candidates forced from its request's reference (its draft policy's)."""
    original = BranchChains.candidates

    def candidates(self, req, h_last, plan):
        out = original(self, req, h_last, plan)  # counts the drafts as the real ones would
        pos, ref, P, V = out[0].pos, req.policy.ref, req.policy.P, req.policy.vocab
        t = ref[pos - P] if pos - P < len(ref) else 0
        tokens = [(t + 1 + r) % V for r in range(self.width)]
        if truth_row(pos, self.width) < self.width:
            tokens[truth_row(pos, self.width)] = t
        req.drafts.keep_candidates(pos, ["pdm"] * self.width, None)
        return [Draft(pos, tok) for tok in tokens]

    monkeypatch.setattr(BranchChains, "candidates", candidates)


def requests(ecfg) -> list[BatchRequest]:
    """Four greedy requests: prompts of one to three prefill chunks, arriving at different ticks,
    of different lengths, with forced rejections; the first and third draft with the (untrained)
    PDM, so their drafts show what its rows were, the others with the oracle, so their chains
    live long."""
    prompts = random_prompts(ecfg.model.cfg, (5, 2 * CHUNK + 3, 9, CHUNK + 1), seed=3)
    lengths, wrongs = (NEW, NEW - 7, NEW, 9), ({2, 9, 15}, {4}, {1, 3, 11, 17}, {5})
    V = ecfg.model.cfg.vocab_size
    return [BatchRequest(p, new, arrival_tick=1 + 3 * i, draft_policy=Policy(
                reference(ecfg, p, new), len(p), V, wrong=frozenset(wrong), oracle=i % 2 == 1))
            for i, (p, new, wrong) in enumerate(zip(prompts, lengths, wrongs))]


def drafts(reqs: list[BatchRequest], run) -> tuple[list, list[dict]]:
    """run()'s results, and each request's last draft per token index (its PDM's, unless forced)."""
    for r in reqs:
        r.draft_policy.drafts.clear()
    results = run()
    return results, [dict(r.draft_policy.drafts) for r in reqs]



@pytest.mark.parametrize("n,colocate,when", [(2, False, "refill"), (2, True, "always"), (4, False, "always"),
                                             (4, True, "refill")])
def test_branch_width_2_every_request_equals_itself_alone(n, colocate, when, forced, one_thread):
    ecfg = tiny_engine_config("llama", n, colocate, branches=W, branch_when=when)
    reqs = requests(ecfg)
    with ReferenceExecutor(ecfg) as ex:
        alone, alone_drafts = drafts(reqs, lambda: solo_results(ex, reqs))
        for r, res in zip(reqs, alone):  # solo: greedy decoding, up to a near-tie
            want = r.draft_policy.ref
            assert_greedy_agrees(res.tokens, want, teacher_forced(full_model(ecfg), r.prompt, want),
                                 CHAIN_LOGIT_BOUND, f"n={n} W={W}")
        for B in (2, 4):
            out, out_drafts = drafts(reqs, lambda: ex.generate_batch(reqs, B))
            assert [branched(r) for r in out.results] == [branched(r) for r in alone], (n, colocate, when, B)
            assert out_drafts == alone_drafts  # the same PDM rows: every chain's anchors where they belong
            # a branch point's W chains shared a stage step with another request's row
            assert max(out.rows) > B
            u = out.utilization
            assert all(lr <= r for lr, r in zip(u.live_rows, u.rows)) and all(k <= u.ticks for k in u.useful)
    points, saves = sum(r.branch_points for r in alone), sum(r.branch_saves for r in alone)
    assert 0 < saves < points and sum(r.rejections for r in alone) > 0  # saved, unsaved and rejected


@pytest.mark.parametrize("n,colocate", [(2, True), (4, False)])
def test_branch_width_2_seeded_sampling_equals_itself_alone(n, colocate, one_thread):
    """T > 0: each request's branch points are verified by recursive rejection sampling on its own
    keys; suffix drafts on (a branch point's second candidate may be the suffix proposal)."""
    ecfg = tiny_engine_config("qwen2", n, colocate, branches=W, branch_when="always", suffix_min_match=1)
    reqs = seeded_requests(ecfg)
    with ReferenceExecutor(ecfg) as ex:
        alone = solo_results(ex, reqs)
        out = ex.generate_batch(reqs, 3)
    assert [branched(r) for r in out.results] == [branched(r) for r in alone]
    assert all(r.branch_points > 0 for r in alone) and max(out.rows) > 3


@pytest.mark.multiproc
def test_branch_width_2_processes_equal_the_reference_executor(forced):
    ecfg = tiny_engine_config("qwen2", 3, False, threads=1, branches=W, branch_when="always")
    reqs = requests(ecfg)
    with ReferenceExecutor(ecfg) as ex:
        want = [branched(r) for r in ex.generate_batch(reqs, 2).results]
    with launch(ecfg) as runtime:
        got = runtime.generate_batch(reqs, 2)
        after = runtime.generate(reqs[0].prompt, NEW, draft_policy=reqs[0].draft_policy)  # alone, after a batch
    assert [branched(r) for r in got.results] == want
    assert after.tokens == want[0]["tokens"] and sum(w["branch_saves"] for w in want) > 0
