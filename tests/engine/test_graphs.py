"""Capturable decode steps (engine/model/graphs.py): length buckets, the device-position KV writes, and
StageStep / PDMStep / VerifyStep against the eager path they replace.

The static steps attend over a whole length bucket with a device-side mask, so attention sums
run over a longer, partly masked prefix: they equal the eager path up to fp32 summation order
(bound below), and the tokens they pick equal the eager argmax up to near-ties
(tests/near_ties.py). Where a step and the check compute the same thing on the same tensor (the
head step's argmax of its own output, verification of a given hidden state), bits are asserted.
On CPU the steps run eagerly ("graphs skipped"); the `gpu` tests capture real CUDA graphs.
"""
from __future__ import annotations

import pytest
import torch
from near_ties import assert_close_and_argmax_agrees

from spd_engine.engine.model.graphs import (
    DevicePositionCache,
    PDMStep,
    StageStep,
    StepGraph,
    VerifyStep,
    bucket_for,
    length_buckets,
)
from spd_engine.engine.model.model import StageModel, init_random_
from spd_engine.engine.model.pdm import greedy_draft, random_pdm
from spd_engine.engine.runtime.run_config import PRESETS

# Observed differences are ~1e-7 (hidden states) and ~1e-7 (logits O(1)); the bounds leave room
# for other BLAS paths.
ATOL = 1e-5
LOGIT_BOUND = 1e-5


@pytest.fixture(autouse=True)
def _threads(one_thread):
    # tiny shapes: extra intra-op threads only spin against other jobs on a shared host
    yield


def test_length_buckets():
    assert length_buckets(1024) == (128, 256, 512, 1024)
    assert length_buckets(1000, smallest=256) == (256, 512, 1000)
    assert length_buckets(64) == (64,)
    assert bucket_for((8, 16, 64), 8) == 8 and bucket_for((8, 16, 64), 9) == 16
    with pytest.raises(ValueError, match="exceeds the KV capacity 64"):
        bucket_for((8, 16, 64), 65)


def test_device_position_cache_writes_only_its_slots():
    cfg = PRESETS["tiny-llama"]
    model = init_random_(StageModel(cfg, range(0, 1))).eval()
    cache = model.new_cache(1, 16)
    k = torch.randn(1, cfg.num_kv_heads, 2, cfg.head_dim)
    view = DevicePositionCache(cache, torch.tensor([5, 6]), 8)
    keys, values = view.write(0, 0, k, -k)
    assert keys.shape[2] == 8 and torch.equal(cache.k[0][:, :, 5:7], k) and torch.equal(cache.v[0][:, :, 5:7], -k)
    untouched = torch.cat([cache.k[0][:, :, :5], cache.k[0][:, :, 7:]], dim=2)
    assert torch.count_nonzero(untouched) == 0


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_stage_step_matches_eager_path_with_rollback(preset):
    """Same outputs, anchors and KV contents as forward_layers, across bucket changes and a
    rollback (stale slots above the position are written with junk first, and masked)."""
    cfg = PRESETS[preset]
    model = init_random_(StageModel(cfg, range(1, 4))).eval()
    ref_cache, cache = model.new_cache(1, 64), model.new_cache(1, 64)
    for i in model.layer_range:  # junk in every slot: only written slots may matter
        cache.k[i].normal_(0, 50)
        cache.v[i].normal_(0, 50)
    step = StageStep(model, cache, buckets=(8, 16, 64), capture=frozenset({2}))
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    with torch.no_grad():
        for pos in [*range(12), 7, 8, 9, 10, 11, 12, 13]:  # 7..: a flush, then new tokens over stale ones
            h = torch.randn(1, 1, cfg.hidden_size, generator=gen)
            ref, caps = model.forward_layers(h, ref_cache, pos, capture=frozenset({2}))
            out, caps2, token = step.run(pos, h=h)
            assert token is None
            worst = max(worst, (ref - out).abs().max().item(), (caps[2] - caps2[2]).abs().max().item())
    assert worst <= ATOL
    for i in model.layer_range:
        assert torch.allclose(cache.k[i][:, :, :14], ref_cache.k[i][:, :, :14], atol=ATOL)
    assert set(step.modes()) == {8, 16}  # one step function per bucket used
    assert all("skipped on cpu" in m for m in step.modes().values())


def test_prepare_builds_every_bucket_and_its_writes_are_harmless():
    cfg = PRESETS["tiny-llama"]
    model = init_random_(StageModel(cfg, range(1, 4))).eval()
    ref_cache, cache = model.new_cache(1, 64), model.new_cache(1, 64)
    step = StageStep(model, cache, buckets=(8, 16, 64))
    step.h_in.normal_(0, 50)  # junk input: prepare's warm-up runs write K/V from it
    assert set(step.prepare()) == {8, 16, 64}  # every bucket, before any real step
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for pos in range(20):  # positions 7, 15 (written by prepare) are rewritten before being read
            h = torch.randn(1, 1, cfg.hidden_size, generator=gen)
            ref, _ = model.forward_layers(h, ref_cache, pos)
            out, _, _ = step.run(pos, h=h)
            assert (ref - out).abs().max().item() <= ATOL
    pdm = random_pdm(cfg, (3, 3), num_layers=1)
    assert set(PDMStep(pdm, pdm.new_cache(32), rows=3, buckets=(16, 32)).prepare()) == {16, 32}


def test_full_model_step_and_verify_give_the_eager_tokens_up_to_near_ties():
    cfg = PRESETS["tiny-qwen3"]
    full = init_random_(StageModel.full(cfg)).eval()
    ref_cache = full.new_cache(1, 32)
    step = StageStep(full, full.new_cache(1, 32))
    verify = VerifyStep(full)
    ties = 0
    with torch.no_grad():
        for pos, tok in enumerate([5, 17, 33, 8, 90, 41]):
            ref, _ = full.forward_layers(full.embed(torch.tensor([[tok]])), ref_cache, pos)
            out, _, token = step.run(pos, token=tok)
            assert (ref - out).abs().max().item() <= ATOL
            assert int(token) == int(full.logits(out[0, -1]).argmax())  # the head step's own argmax
            assert int(verify.run(ref[0, -1])) == int(full.logits(ref[0, -1]).argmax())  # the same computation
            ties += assert_close_and_argmax_agrees(full.logits(out[0, -1])[None], full.logits(ref[0, -1])[None],
                                                   LOGIT_BOUND, f"position {pos}")
    assert "skipped on cpu" in verify.mode
    print(f"{ties} near-ties within {2 * LOGIT_BOUND:g}")


@pytest.mark.parametrize("draft_vocab", [None, tuple(range(0, 96, 3))])
def test_pdm_step_matches_forward_rows(draft_vocab):
    cfg = PRESETS["tiny-llama"]
    pdm = random_pdm(cfg, (3, 3), num_layers=2, draft_vocab=draft_vocab)
    ref_cache = pdm.new_cache(32)
    step = PDMStep(pdm, pdm.new_cache(32), rows=3, buckets=(16, 32))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for pos in [0, 3, 4, 5, 4, 14, 15]:  # the driver appends rows and crops back to pending + 1
            rows = torch.randn(1, 3, cfg.hidden_size, generator=gen)
            h = pdm.forward_rows(rows, ref_cache, pos)
            last, draft = step.run(pos, rows)
            assert torch.allclose(last, h[0, -1], atol=ATOL)
            assert int(draft) == greedy_draft(pdm, last)  # the step's argmax of its own hidden state
            assert_close_and_argmax_agrees(pdm.draft_logits(last)[None], pdm.draft_logits(h[0, -1])[None],
                                           LOGIT_BOUND, f"position {pos}")
            if draft_vocab is not None:
                assert int(draft) in draft_vocab


def test_step_graph_is_eager_off_cuda_and_when_disabled():
    calls = []
    g = StepGraph(lambda: calls.append(1) or len(calls), torch.device("cpu"))
    assert not g.graphed and g.mode == "eager (graphs skipped on cpu)"
    assert g() == 1 and g() == 2  # runs the function every time
    assert StepGraph(lambda: 0, torch.device("cuda"), enabled=False).mode == "eager (graphs disabled)"
    cfg = PRESETS["tiny-llama"]
    model = init_random_(StageModel(cfg, range(0, 2))).eval()
    with pytest.raises(ValueError, match="exceeds the KV capacity"):
        StageStep(model, model.new_cache(1, 8)).run(8, h=torch.zeros(1, 1, cfg.hidden_size))


# ---- real CUDA graphs ----

GPU_ATOL = 1e-4  # fp32 on a GPU: SDPA picks other kernels for the masked bucket than for one token


def assert_argmax_or_near_tie(token: torch.Tensor, logits: torch.Tensor, bound: float) -> None:
    """A token picked on the device by a graph: the argmax of logits [V] computed eagerly, or
    within 2 * bound of it (cuBLAS may pick another kernel inside a capture)."""
    gap = (logits.max() - logits[int(token)]).item()
    assert gap <= 2 * bound, f"token {int(token)} is {gap:.3g} below the argmax {int(logits.argmax())}"


@pytest.mark.gpu
def test_stage_step_graphs_replay_the_eager_path_on_cuda():
    """Captured graphs, replayed across buckets and a rollback, against eager steps on the GPU."""
    cfg = PRESETS["tiny-qwen3"]
    full = init_random_(StageModel.full(cfg)).eval().to("cuda")
    ref_cache = full.new_cache(1, 64)
    step = StageStep(full, full.new_cache(1, 64), buckets=(8, 16, 64))
    verify = VerifyStep(full)
    with torch.no_grad():
        for pos, tok in [*enumerate([5, 17, 33, 8, 90, 41, 7, 2, 60, 11, 3]), (6, 9), (7, 4), (8, 70)]:
            ref, _ = full.forward_layers(full.embed(torch.tensor([[tok]], device="cuda")), ref_cache, pos)
            out, _, token = step.run(pos, token=tok)
            assert (ref - out).abs().max().item() <= GPU_ATOL
            logits = full.logits(ref[0, -1]).cpu()
            assert_argmax_or_near_tie(token, logits, GPU_ATOL)
            assert_argmax_or_near_tie(verify.run(ref[0, -1]), logits, GPU_ATOL)
    assert set(step.modes()) == {8, 16} and all(m == "cuda graph" for m in step.modes().values())
    assert verify.mode == "cuda graph"


@pytest.mark.gpu
def test_pdm_step_graphs_replay_forward_rows_on_cuda():
    cfg = PRESETS["tiny-llama"]
    pdm = random_pdm(cfg, (3, 3), num_layers=2, device="cuda")
    ref_cache = pdm.new_cache(32)
    step = PDMStep(pdm, pdm.new_cache(32), rows=3, buckets=(16, 32))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for pos in [0, 3, 4, 5, 4, 14, 15]:
            rows = torch.randn(1, 3, cfg.hidden_size, generator=gen).to("cuda")
            h = pdm.forward_rows(rows, ref_cache, pos)
            last, draft = step.run(pos, rows)
            assert (last - h[0, -1]).abs().max().item() <= GPU_ATOL
            logits = pdm.draft_logits(h[0, -1]).cpu()  # over the draft vocabulary
            best = int((pdm.draft_ids.cpu() == int(draft)).nonzero()[0])  # the draft's draft-vocabulary index
            assert_argmax_or_near_tie(torch.tensor(best), logits, GPU_ATOL)
    assert all(m == "cuda graph" for m in step.modes().values())
