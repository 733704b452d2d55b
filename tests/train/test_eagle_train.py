"""EAGLE head training (train/eagle.py): the training-time-test mask, training logits equal to the
runtime's chained drafts, the loss falls, a resumed run equals an uninterrupted one, a head
trained on the target's own greedy outputs drafts better and stays lossless, and the CLI path
(`spd train --method eagle`, then `spd eval --mode eagle`)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import Policy, full_model, random_prompts, reference, tiny_engine_config
from test_corpus import build
from test_distill import ModTokenizer, json_steps

from spd_engine.engine.model.eagle_head import load_eagle, random_eagle
from spd_engine.engine.model.greedy import greedy_generate_batch
from spd_engine.engine.runtime.eagle_driver import EagleDriver
from spd_engine.train.eagle import EagleTrainConfig, EagleTrainer, ttt_mask, unrolled_hidden

ECFG = tiny_engine_config("llama", 1, mode="eagle", threads=1)
S = 24


def target():
    m = full_model(ECFG).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def tcfg(out: Path, **kw) -> EagleTrainConfig:
    base = dict(out=str(out), seq_len=S, batch=4, steps=6, lr=2e-3, warmup=2, save_every=3, autocast="float32")
    base.update(kw)
    return EagleTrainConfig(**base)


def stream(batch: int = 4, distinct: int | None = None, seed: int = 0) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cache: list[torch.Tensor] = []
    while True:
        if distinct is not None and len(cache) == distinct:
            yield from cache
            continue
        cache.append(torch.randint(0, ECFG.model.cfg.vocab_size, (batch, S), generator=g))
        yield cache[-1]


def test_ttt_mask():
    m = ttt_mask(4, 3)  # rows (block, position), block by block
    at = lambda i, p, j, q: bool(m[i * 4 + p, j * 4 + q])  # noqa: E731
    assert [at(0, 2, 0, q) for q in range(4)] == [True, True, True, False]  # block 0: causal
    assert [at(1, 2, 0, q) for q in range(4)] == [True, True, False, False]  # true rows up to p - 1
    assert [at(1, 2, 1, q) for q in range(4)] == [False, False, True, False]  # itself only
    assert [at(2, 3, 0, q) for q in range(4)] == [True, True, False, False]  # true rows up to p - 2
    assert [at(2, 3, 1, q) for q in range(4)] == [False, False, True, False]  # chain step 1 at p - 1
    assert [at(2, 3, 2, q) for q in range(4)] == [False, False, False, True]
    assert not m[:4, 4:].any() and not m[4:8, 8:].any()  # no block sees a later block


def test_training_logits_equal_the_runtime_chain(one_thread):
    """Oracle drafts (the greedy output) through the runtime: the head's logits at chain step j
    for position x equal the training unroll's block j at position x - 2."""
    model, k = target(), 3
    head = random_eagle(ECFG.model.cfg, seed=5)
    prompt = random_prompts(ECFG.model.cfg, [9], seed=2)[0]
    want = reference(ECFG, prompt, 20)
    drv = EagleDriver(model, head, k, 64, 16)
    seen: dict[int, tuple[int, torch.Tensor]] = {}
    draft = drv._draft

    def spy(h, pos):
        c = len(drv.req.context)
        seen[pos] = (pos - c, head.draft_logits(h))  # chain step j = pos - c
        return draft(h, pos)

    drv._draft = spy
    res = drv.generate(prompt, 20, draft_policy=Policy(want, len(prompt), ECFG.model.cfg.vocab_size))
    assert res.tokens == want and res.accepted == res.verified
    tokens = torch.tensor([prompt + want])
    with torch.no_grad():
        _, caps = model.forward_layers(model.embed(tokens), model.new_cache(1, tokens.shape[1]), 0,
                                       capture=head.feature_layers)
        S1 = tokens.shape[1] - 1
        fused = head.fused({i: c[:, :S1] for i, c in caps.items()})
        out = unrolled_hidden(head, model.embed(tokens[:, 1:]), fused, k)  # [1, k, S1, H]
        logits = head.draft_logits(out)[0]
    assert {j for j, _ in seen.values()} == set(range(k))
    for pos, (j, got) in seen.items():
        assert torch.allclose(got, logits[j, pos - 2], atol=1e-5, rtol=0), (pos, j)


def test_loss_falls(tmp_path: Path) -> None:
    tr = EagleTrainer(target(), tcfg(tmp_path, steps=60, save_every=60), stream(distinct=2), log=lambda m: None)
    tr.run()
    losses = [h["loss"] for h in tr.history]
    assert sum(losses[-4:]) / 4 < 0.7 * sum(losses[:4]) / 4, losses


class Interrupted(Exception):
    pass


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    straight = EagleTrainer(target(), tcfg(tmp_path / "a"), stream(), log=lambda m: None)
    straight.run()

    def cut(it: Iterator, k: int) -> Iterator:
        for _ in range(k):
            yield next(it)
        raise Interrupted

    with pytest.raises(Interrupted):
        EagleTrainer(target(), tcfg(tmp_path / "b"), cut(stream(), 4), log=lambda m: None).run()
    logs: list[str] = []
    resumed = EagleTrainer(target(), tcfg(tmp_path / "b"), stream(), log=logs.append)
    assert resumed.step == 3 and "resumed from step 3" in logs
    resumed.run()
    want, got = straight.head.state_dict(), resumed.head.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert [h["loss"] for h in straight.history] == [h["loss"] for h in resumed.history]
    back = load_eagle(tmp_path / "b" / "eagle", ECFG.model.cfg)
    assert torch.allclose(back.head.weight.float(), resumed.head.head.weight, atol=1e-3)  # fp16 export


def test_a_trained_head_drafts_better_and_stays_lossless(tmp_path: Path, one_thread) -> None:
    """Trained on the target's own greedy continuations (self-distillation): held-out prompts
    decode to greedy's tokens with a longer acceptance length than the untrained head's."""
    model = target()
    torch.manual_seed(0)
    seqs = greedy_generate_batch(model, random_prompts(ECFG.model.cfg, [6] * 64, seed=11), S - 6)
    data = [torch.tensor(p + s)[:S] for p, s in zip(random_prompts(ECFG.model.cfg, [6] * 64, seed=11), seqs)]
    batches = (torch.stack([data[(8 * i + j) % 64] for j in range(8)]) for i in range(10 ** 6))
    tr = EagleTrainer(model, tcfg(tmp_path, steps=120, save_every=120, batch=8, lr=3e-3), batches, log=lambda m: None)
    trained = tr.run()
    lengths = {}
    for name, head in (("untrained", random_eagle(ECFG.model.cfg, seed=1)), ("trained", trained)):
        drv, decoded, passes = EagleDriver(model, head, 3, 128, 16), 0, 0
        for prompt in random_prompts(ECFG.model.cfg, [6] * 6, seed=99):  # not among the training prompts
            res = drv.generate(prompt, 32)
            assert res.tokens == reference(ECFG, prompt, 32), name
            decoded, passes = decoded + len(res.tokens) - 1, passes + res.target_passes
        lengths[name] = decoded / passes
    print(lengths)
    assert lengths["trained"] > lengths["untrained"] + 0.3, lengths


def test_cli_trains_resumes_and_evaluates(tmp_path: Path, capsys) -> None:
    from spd_engine.tools.cli import main

    corpus_dir, _ = build(tmp_path, tok=ModTokenizer())
    out = tmp_path / "run"
    args = ["train", "--method", "eagle", "--model", "random:tiny-llama", "--seq-len", "16", "--batch", "2",
            "--save-every", "2", "--threads", "1", "--autocast", "float32", "--corpus", str(corpus_dir),
            "--out", str(out)]
    assert main([*args, "--steps", "4"]) == 0 and capsys.readouterr().out.strip() == f"{out}/eagle"
    assert main([*args, "--steps", "6"]) == 0 and json_steps(out) == [1, 2, 3, 4, 5, 6]
    assert main([*args, "--steps", "6", "--stages", "2"]) == 2
    assert "--stages: not used with --method eagle" in capsys.readouterr().err
    assert main(["eval", "--mode", "eagle", "--model", "random:tiny-llama", "--eagle-head", f"{out}/eagle",
                 "--limit", "1", "--max-new-tokens", "4", "--capacity", "256", "--data-dir", str(tmp_path / "eval"),
                 "--datasets", "mt_bench"]) == 0
    assert "acceptance length" in capsys.readouterr().out
    js = tmp_path / "eval.json"
    assert main(["eval", "--mode", "eagle", "--model", "random:tiny-llama", "--limit", "1", "--max-new-tokens", "6",
                 "--capacity", "256", "--data-dir", str(tmp_path / "eval"), "--datasets", "mt_bench",
                 "--temperature", "1", "--sampling-seed", "5", "--json", str(js)]) == 0
    report = json.loads(js.read_text())
    assert report["mode"] == "eagle" and [r["seed"] for r in report["records"]] == [5]
    overall = report["overall"]
    assert overall["eal"] == pytest.approx((overall["tokens"] - 1) / overall["ticks"])  # the acceptance length
    assert main(["eval", "--mode", "eagle", "--model", "random:tiny-llama", "--executor", "fast"]) == 2
