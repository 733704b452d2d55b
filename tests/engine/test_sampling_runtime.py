"""Sampling (T > 0) through the runtime, end to end: seeded determinism, the reference executor and
the distributed run agreeing draw for draw, EOS at every pipeline depth, the pp / ar baselines
against plain keyed autoregressive sampling, degenerate sampling (top-k 1) equal to greedy, and
the sampling options of `spd generate` and `spd eval`.

That the committed tokens follow the target distribution is measured in
test_sampling_distribution.py; here every check is exact (same seed, same tokens)."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from helpers import full_model, random_prompts, reference, summary, tiny_engine_config  # noqa: F401

import spd_engine.train.evaluate as ev
from spd_engine.engine.model.greedy import prefill
from spd_engine.engine.protocol.sampling import SamplingParams, keyed_generator, sample, target_probs
from spd_engine.engine.protocol.schedule import decode_ticks
from spd_engine.engine.runtime import request_inputs
from spd_engine.engine.runtime.launch import launch
from spd_engine.engine.runtime.reference import ReferenceExecutor
from spd_engine.engine.runtime.run_config import PRESETS
from spd_engine.tools.cli import main

NEW = 16
SAMPLING = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=0)
SEEDS = range(4)


def seeded(seed: int, params: SamplingParams = SAMPLING) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)


@torch.no_grad()
def sample_generate(model, prompt: Sequence[int], max_new: int, params: SamplingParams, eos: Sequence[int] = (),
                    chunk: int = 16) -> list[int]:
    """Plain autoregressive sampling on the full model: the token at position t is the keyed
    "target" draw (seed, t) from target_probs of the logits before it."""
    cache = model.new_cache(1, len(prompt) + max_new)
    h = prefill(model, cache, prompt, chunk)  # [H]
    out: list[int] = []
    for pos in range(len(prompt), len(prompt) + max_new):
        token = sample(target_probs(model.logits(h), params), keyed_generator(params.seed, pos, "target"))
        out.append(token)
        if token in eos or len(out) == max_new:
            break
        h = model.forward_layers(model.embed(torch.tensor([[token]])), cache, pos)[0][0, -1]
    return out


# ---- determinism ----

def test_same_seed_same_tokens_and_seeds_differ(one_thread):
    ecfg = tiny_engine_config("llama", 2)
    prompts = random_prompts(ecfg.model.cfg, (3, 21), seed=2)
    cases = [(i, s) for i in range(len(prompts)) for s in SEEDS]
    with ReferenceExecutor(ecfg) as ex:
        first = {c: summary(ex.generate(prompts[c[0]], NEW, (), sampling=seeded(c[1]))) for c in cases}
        again = {c: summary(ex.generate(prompts[c[0]], NEW, (), sampling=seeded(c[1]))) for c in reversed(cases)}
    with ReferenceExecutor(ecfg) as ex:  # a fresh executor: nothing carried over from earlier requests
        fresh = {c: summary(ex.generate(prompts[c[0]], NEW, (), sampling=seeded(c[1]))) for c in cases[::3]}
    assert again == first and all(fresh[c] == first[c] for c in fresh)
    for i in range(len(prompts)):  # other seeds, other samples
        assert len({tuple(first[(i, s)]["tokens"]) for s in SEEDS}) == len(SEEDS)
    runs = list(first.values())
    assert all(len(r["tokens"]) == NEW and r["verified"] == NEW - 1 for r in runs)
    assert any(r["rejections"] > 0 for r in runs) and any(r["accepted"] > 0 for r in runs)  # both verdicts


@pytest.mark.multiproc
def test_reference_executor_and_distributed_run_agree():
    ecfg = tiny_engine_config("qwen2", 3, threads=1)
    prompts = random_prompts(ecfg.model.cfg, (1, 19), seed=3)
    with ReferenceExecutor(ecfg) as ex:
        eos = [ex.generate(prompts[1], NEW, (), sampling=seeded(7)).tokens[5]]  # ends a request early
        cases = [(p, s, e) for p in prompts for s in (7, 2**64 - 1) for e in ((), eos)]
        want = [summary(ex.generate(p, NEW, e, sampling=seeded(s))) for p, s, e in cases]
    with launch(ecfg) as runtime:
        got = [summary(runtime.generate(p, NEW, e, sampling=seeded(s))) for p, s, e in cases]
    assert got == want  # tokens, ticks, verified, accepted, rejections of every request
    assert any(len(r["tokens"]) < NEW for r in got)


# ---- EOS and depth ----

@pytest.mark.parametrize("n", [1, 2, 4])
def test_sampled_eos_stops_at_the_first_committed_eos(n, one_thread):
    """With an EOS list a request is the same run cut at the first committed EOS (included),
    with no unverified draft after it; the tick count follows the schedule formula."""
    ecfg = tiny_engine_config("llama", n)
    prompt = random_prompts(ecfg.model.cfg, [7], seed=4)[0]
    stopped = 0
    with ReferenceExecutor(ecfg) as ex:
        for seed in range(4):
            full = ex.generate(prompt, NEW, (), sampling=seeded(seed))
            assert full.ticks == decode_ticks(NEW, n, full.rejections)
            fresh = [k for k in range(NEW) if full.tokens[k] not in full.tokens[:k]]
            for k in (fresh[0], fresh[len(fresh) // 2], fresh[-1]):  # the prefill token, a middle one, a late one
                eos = [full.tokens[k], ecfg.model.cfg.vocab_size - 1] if full.tokens[k] != ecfg.model.cfg.vocab_size - 1 \
                    else [full.tokens[k]]
                want = next(i for i, t in enumerate(full.tokens) if t in eos)  # another EOS may come first
                res = ex.generate(prompt, NEW, eos, sampling=seeded(seed))
                assert res.tokens == full.tokens[:want + 1]
                assert res.verified == want and res.ticks == decode_ticks(want + 1, n, res.rejections)
                stopped += int(want < NEW - 1)
    assert stopped >= 4


# ---- baselines and degenerate sampling ----

@pytest.mark.parametrize("mode,n,step_mode", [("ar", 1, "eager"), ("pp", 2, "eager"), ("pp", 2, "static")])
def test_baselines_sample_like_plain_autoregressive_sampling(mode, n, step_mode, one_thread):
    # static: the head stage's step computes the argmax; sampling must still draw from its logits
    ecfg = tiny_engine_config("qwen3", n, mode=mode, step_mode=step_mode)
    prompts = random_prompts(ecfg.model.cfg, (5, 18), seed=6)
    model = full_model(ecfg)
    with ReferenceExecutor(ecfg) as ex:
        for p in prompts:
            for s in SEEDS:
                want = sample_generate(model, p, NEW, seeded(s), chunk=ecfg.runtime.prefill_chunk)
                res = ex.generate(p, NEW, (), sampling=seeded(s))
                assert res.tokens == want
            eos = [want[3]]
            assert ex.generate(p, NEW, eos, sampling=seeded(s)).tokens == want[:want.index(want[3]) + 1]


def test_spd_first_token_is_the_keyed_target_draw(one_thread):
    """The prefill token is a plain keyed draw from p, like the baselines' first token."""
    ecfg = tiny_engine_config("qwen3", 2)
    model = full_model(ecfg)
    prompt = random_prompts(ecfg.model.cfg, [9], seed=8)[0]
    with ReferenceExecutor(ecfg) as ex:
        for s in range(8):
            want = sample_generate(model, prompt, 1, seeded(s), chunk=ecfg.runtime.prefill_chunk)
            assert ex.generate(prompt, 1, (), sampling=seeded(s)).tokens == want


@pytest.mark.parametrize("n", [2, 3])
def test_top_k_one_is_greedy_whatever_the_seed(n, one_thread):
    """With top-k 1 both p and q are one-hot: every draft is accepted or corrected to the argmax,
    so the output is greedy decoding exactly."""
    ecfg = tiny_engine_config("qwen2", n)
    prompt = random_prompts(ecfg.model.cfg, [11], seed=9)[0]
    want = reference(ecfg, prompt, NEW)
    with ReferenceExecutor(ecfg) as ex:
        for s in (0, 123):
            res = ex.generate(prompt, NEW, (), sampling=SamplingParams(temperature=0.8, top_k=1, seed=s))
            assert res.tokens == want


# ---- spd generate ----

ARGS_TINY = ["--model", "random:tiny-llama", "--capacity", "64", "--prefill-chunk", "16"]


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--temperature", "1", "--top-p", "1.5"], "top_p must be in"),
    (["--temperature", "1", "--top-p", "0"], "top_p must be in"),
    (["--top-k", "-2"], "top_k must be an integer >= 0"),
    (["--sampling-seed", "-1"], "seed must be an integer"),
])
def test_generate_rejects_bad_sampling_flags(flags, message, capsys):
    assert main(["generate", *ARGS_TINY, "--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spd generate: error: sampling:") and message in err


def test_generate_defaults_from_generation_config(tmp_path):
    none = dict(temperature=None, top_k=None, top_p=None, seed=None)
    assert request_inputs.sampling_params(none, None) == SamplingParams()  # no file: greedy
    assert request_inputs.sampling_params(none, tmp_path) == SamplingParams()
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6,
                                                                 "top_p": 0.9, "eos_token_id": [2]}))
    assert request_inputs.sampling_params(none, tmp_path) == SamplingParams(0.6, 50, 0.9, 0)  # HF's top_k 50
    flags = dict(none, top_k=5, seed=11)
    assert request_inputs.sampling_params(flags, tmp_path) == SamplingParams(0.6, 5, 0.9, 11)
    assert request_inputs.sampling_params(dict(none, temperature=0.0), tmp_path).greedy  # an explicit 0 wins
    assert request_inputs.sampling_params(dict(none, temperature=0.7), None) == SamplingParams(0.7)
    (tmp_path / "generation_config.json").write_text("{broken")
    with pytest.raises(ValueError, match="generation_config.json: not JSON"):
        request_inputs.sampling_params(none, tmp_path)


def printed_tokens(out: str) -> list[list[int]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("[")]


def test_generate_samples_with_the_given_seed(capsys, one_thread):
    """`--mode ar` runs in this process (world size 1): the printed tokens are plain keyed sampling."""
    args = [*ARGS_TINY, "--mode", "ar", "--stages", "1", "--threads", "1", "--prompt", "hello there",
            "--max-new-tokens", "12", "--temperature", "0.9", "--top-k", "30", "--json"]
    runs = {}
    for seed in ("3", "3", "4"):
        assert main(["generate", *args, "--sampling-seed", seed]) == 0
        out = capsys.readouterr().out
        stats = json.loads(out.splitlines()[-1])
        assert stats["sampling"] == {"temperature": 0.9, "top_k": 30, "top_p": 1.0, "seed": int(seed)}
        runs.setdefault(seed, []).append(printed_tokens(out)[0])
    assert runs["3"][0] == runs["3"][1] != runs["4"][0]
    ecfg = tiny_engine_config("llama", 1, mode="ar", cfg=PRESETS["tiny-llama"])  # what the CLI builds
    prompt = request_inputs.encode_prompts(["hello there"], None, False, ecfg.model.cfg.vocab_size)[0]
    assert runs["3"][0] == sample_generate(full_model(ecfg), prompt, 12, SamplingParams(0.9, 30, 1.0, 3))


# ---- spd eval ----

@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "eval"
    d.mkdir()
    texts = ["Tom has 3 apples.", "2 + 2 = ?", "A train leaves at noon."]
    (d / "gsm8k.jsonl").write_text("\n".join(json.dumps({"question_id": i, "turns": [t]})
                                             for i, t in enumerate(texts)) + "\n")
    return d


EVAL_ARGS = ["--model", "random:tiny-llama", "--capacity", "256", "--prefill-chunk", "16", "--stages", "2",
             "--datasets", "gsm8k", "--max-new-tokens", "12", "--threads", "1"]


def test_eval_at_positive_temperature(data_dir, tmp_path, capsys, one_thread):
    out = tmp_path / "eval.json"
    args = ["eval", *EVAL_ARGS, "--data-dir", str(data_dir), "--temperature", "1", "--top-k", "20",
            "--sampling-seed", "5", "--json", str(out)]
    assert main(args) == 0  # the reference executor by default at T>0
    printed = capsys.readouterr()
    assert "sampling T=1.0 top-k 20 top-p 1.0 seeds 5+k" in printed.out and "executor reference" in printed.out
    rep = json.loads(out.read_text())
    assert (rep["executor"], rep["temperature"], rep["top_k"], rep["seed"]) == ("reference", 1.0, 20, 5)
    recs = rep["records"]
    assert [r["seed"] for r in recs] == [5, 6, 7] and all(r["lossless"] is None for r in recs)
    assert all(sum(r["verified_by_fill"].values()) == r["verified"] == r["tokens"] - 1 for r in recs)
    overall = rep["overall"]
    assert overall["verified"] > 0 and overall["alpha"] is not None and overall["eal"] > 0
    assert main(args) == 0  # the same seed: the same records
    again = json.loads(out.read_text())["records"]
    assert [{k: r[k] for k in ("tokens", "ticks", "accepted")} for r in again] == \
           [{k: r[k] for k in ("tokens", "ticks", "accepted")} for r in recs]


def test_eval_runner_draws_what_the_runtime_draws(data_dir, one_thread):
    """Request k of an eval run is the runtime's request with seed + k, and its per-fill verdicts
    add up to the driver's own counters (checked inside runtime_acceptance)."""
    ecfg = tiny_engine_config("llama", 3)
    settings = ev.EvalSettings(NEW, 1.0, "reference", None, top_k=20, top_p=0.95, seed=40)
    prompts = random_prompts(ecfg.model.cfg, (4, 9), seed=10)
    with ev.open_runner(ecfg, settings) as runner:
        outs = [runner.run(p, NEW, (), request=k) for k, p in enumerate(prompts)]
        direct = [runner.driver.generate(p, NEW, (), sampling=SamplingParams(1.0, 20, 0.95, 40 + k)).tokens
                  for k, p in enumerate(prompts)]
    assert [o.tokens for o in outs] == direct and [o.seed for o in outs] == [40, 41]
    assert sum(o.acceptance.rejections for o in outs) > 0


def test_eval_sampling_errors(data_dir, capsys):
    base = ["eval", *EVAL_ARGS, "--data-dir", str(data_dir), "--temperature", "0.8"]
    assert main([*base, "--executor", "fast"]) == 2
    assert "needs the executor with sampling support: use --executor reference or dist" in capsys.readouterr().err
    assert main([*base, "--top-p", "0"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        ev.check_settings(ev.EvalSettings(temperature=-0.5, executor="reference"))
    assert ev.default_executor(0.0) == "fast" and ev.default_executor(0.7) == "reference"
