"""`spd eval` and train/evaluate.py: prompt sets, pooled metrics, the three executors agreeing,
the lossless check failing loudly, and the CLI's errors and JSON output."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import spd_engine.train.evaluate as ev
from spd_engine.engine.model.pdm import random_pdm
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.run_config import PRESETS, ModelSpec, ParallelLayout, RunConfig, Runtime
from spd_engine.tools.cli import main
from spd_engine.train.fast_eval import Acceptance

ARGS_TINY = ["--model", "random:tiny-llama", "--capacity", "256", "--prefill-chunk", "16"]
TEXTS = {"mt_bench": ["Tell me a story.", "Why is the sky blue?", "hello"],
         "humaneval": ["def add(a, b):", "def f(x): return x"],
         "gsm8k": ["2 + 2 = ?", "Tom has 3 apples."]}


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "eval"
    d.mkdir()
    for name, texts in TEXTS.items():
        lines = [json.dumps({"question_id": 100 + i, "turns": [t, "a second turn, never used"]})
                 for i, t in enumerate(texts)]
        (d / f"{name}.jsonl").write_text("\n".join(lines) + "\n\n")
    return d


# ---- prompt sets and settings ----

def test_load_dataset_takes_first_turns_in_order_with_limit(data_dir):
    got = ev.load_dataset(data_dir, "mt_bench")
    assert [p.text for p in got] == TEXTS["mt_bench"]
    assert [p.question_id for p in got] == [100, 101, 102] and [p.index for p in got] == [0, 1, 2]
    assert [p.text for p in ev.load_dataset(data_dir, "mt_bench", limit=2)] == TEXTS["mt_bench"][:2]


def test_load_dataset_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="prompt set not found"):
        ev.load_dataset(tmp_path, "gsm8k")
    (tmp_path / "gsm8k.jsonl").write_text('{"turns": ["ok"]}\n{not json\n')
    with pytest.raises(ValueError, match=r"gsm8k.jsonl:2: not JSON"):
        ev.load_dataset(tmp_path, "gsm8k")
    (tmp_path / "gsm8k.jsonl").write_text('{"prompt": "no turns"}\n')
    with pytest.raises(ValueError, match="EAGLE format"):
        ev.load_dataset(tmp_path, "gsm8k")


def test_default_data_dir_is_the_shipped_prompt_sets():
    d = ev.default_data_dir()
    assert d == Path(ev.__file__).resolve().parent / "evalsets"
    for name in ("mt_bench", "humaneval", "gsm8k"):
        assert len(ev.load_dataset(d, name)) == 40, name


def test_settings_reject_sampling_and_bad_values():
    with pytest.raises(ValueError, match="sampling evaluation .* needs the executor with sampling support"):
        ev.check_settings(ev.EvalSettings(temperature=0.7))
    for bad in (ev.EvalSettings(temperature=-1), ev.EvalSettings(executor="gpu"), ev.EvalSettings(max_new_tokens=0),
                ev.EvalSettings(limit=0)):
        with pytest.raises(ValueError):
            ev.check_settings(bad)
    ev.check_settings(ev.EvalSettings())


def test_encode_prompt_without_tokenizer_stays_in_the_vocabulary():
    ids = ev.encode_prompt("héllo wörld " * 10, None, 96)
    assert ids and all(3 <= i < 96 for i in ids)


# ---- pooled metrics ----

def record(dataset: str, acc: Acceptance, lossless=None) -> ev.PromptRecord:
    return ev.PromptRecord(dataset, 0, None, 5, acc, 1.0, lossless, 0)


def test_summary_pools_over_prompts_and_splits_by_fill():
    a = Acceptance(n=4, tokens=11, ticks=16, verified=10, accepted=8, rejections=1,
                   verified_by_fill={1: 2, 2: 1, 3: 1, 4: 6}, accepted_by_fill={1: 1, 2: 1, 3: 1, 4: 5})
    b = Acceptance(n=4, tokens=3, ticks=5, verified=2, accepted=1, rejections=0,
                   verified_by_fill={1: 1, 2: 1}, accepted_by_fill={1: 1, 2: 0})
    c = Acceptance(n=4, tokens=1)  # ended with the prefill token: no ticks, nothing verified
    s = ev.summarize([record("x", a), record("x", b), record("y", c, False)], 4)
    assert (s.prompts, s.tokens, s.ticks, s.verified, s.accepted, s.failures) == (3, 15, 21, 12, 9, 1)
    assert s.eal == pytest.approx(4 * (10 + 2 + 0) / 21)  # pooled, not a mean of per-prompt EALs
    assert s.alpha == pytest.approx(9 / 12)
    assert s.alpha_full == pytest.approx(5 / 6) and s.alpha_refill == pytest.approx(4 / 6)
    assert s.alpha_by_fill == pytest.approx({1: 2 / 3, 2: 1 / 2, 3: 1.0, 4: 5 / 6})
    assert s.to_json()["alpha_by_fill"] == s.alpha_by_fill
    empty = ev.summarize([record("y", c)], 4)
    assert empty.alpha is None and empty.eal is None and empty.alpha_full is None


def test_table_has_a_row_per_dataset_and_overall():
    a = Acceptance(n=2, tokens=3, ticks=3, verified=2, accepted=1, verified_by_fill={1: 1, 2: 1},
                   accepted_by_fill={1: 0, 2: 1})
    rep = ev.EvalReport(n=2, records=[record("gsm8k", a), record("mt_bench", a)])
    rep.records[0].loops, rep.records[1].loops = False, True  # only the first output does not loop
    lines = ev.format_table(rep).splitlines()
    assert [ln.split()[0] for ln in lines] == ["dataset", "gsm8k", "mt_bench", "overall", "non-looping"]
    assert lines[-2].split()[1:6] == ["2", "6", "6", "0.500", "1.333"]
    assert lines[-1].split()[1:4] == ["1", "3", "3"]


# ---- executors agree ----

def tiny_ecfg(n: int, **kw) -> RunConfig:
    cfg = PRESETS["tiny-qwen2"]
    base = RunConfig(model=ModelSpec(source="random:tiny-qwen2", cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, n)),
                     runtime=Runtime(capacity=256, prefill_chunk=16, timeout_s=30.0))
    return base.replace(**kw)


def run_eval(ecfg: RunConfig, data_dir: Path, executor: str, max_new: int = 24, cache: Path | None = None
             ) -> ev.EvalReport:
    settings = ev.EvalSettings(max_new, 0.0, executor)
    prompts = [(p, ev.encode_prompt(p.text, None, ecfg.model.cfg.vocab_size))
               for name in ev.DATASETS for p in ev.load_dataset(data_dir, name)]
    with ev.open_runner(ecfg, settings, cache) as runner:
        report = ev.evaluate(runner, prompts, ecfg.parallel.topology.n, settings, ecfg.model.cfg.eos_token_ids)
        report.cache_hits = runner.cache.hits if cache is not None else None
        return report


@pytest.mark.parametrize("n", [1, 3])
def test_fast_and_reference_executors_give_identical_records(data_dir, n, one_thread):
    ecfg = tiny_ecfg(n, pdm_layers=2)
    fast, ref = run_eval(ecfg, data_dir, "fast"), run_eval(ecfg, data_dir, "reference")
    assert len(fast.records) == len(ref.records) == 7
    assert [r.acceptance for r in fast.records] == [r.acceptance for r in ref.records]
    assert all(r.lossless is True for r in ref.records) and all(r.lossless is None for r in fast.records)
    assert fast.summary().to_json()["eal"] == ref.summary().to_json()["eal"]


def test_outside_vocab_counts_reference_tokens_the_draft_vocabulary_lacks(data_dir, one_thread):
    ecfg = tiny_ecfg(2)
    rep = run_eval(ecfg, data_dir, "fast", 12)
    vocab = tuple(range(0, ecfg.model.cfg.vocab_size, 2))  # even ids only
    settings = ev.EvalSettings(12, 0.0, "fast")
    prompts = [(p, ev.encode_prompt(p.text, None, ecfg.model.cfg.vocab_size))
               for name in ev.DATASETS for p in ev.load_dataset(data_dir, name)]
    with ev.open_runner(ecfg, settings) as runner:
        runner.pdm = random_pdm(ecfg.model.cfg, tuple(ecfg.parallel.topology.stage_layers), draft_vocab=vocab)
        odd = ev.evaluate(runner, prompts, 2, settings, ecfg.model.cfg.eos_token_ids)
    full = ev.full_target(ecfg)
    refs = [ev.greedy_generate(full, ids, 12, eos_ids=ecfg.model.cfg.eos_token_ids, chunk=ecfg.runtime.prefill_chunk)
            for _, ids in prompts]
    want = [sum(t % 2 for t in y[1:]) for y in refs]  # verified tokens with odd ids
    assert [r.outside_vocab for r in odd.records] == want and sum(want) > 0
    assert odd.summary().outside_vocab == sum(want) and rep.summary().outside_vocab == 0


def test_reference_cache_reuses_outputs_and_keys_on_the_weights(data_dir, tmp_path, one_thread, monkeypatch):
    ecfg = tiny_ecfg(2)
    plain = run_eval(ecfg, data_dir, "fast", 12)
    first = run_eval(ecfg, data_dir, "fast", 12, tmp_path / "refs")
    assert first.cache_hits == 0 and len(list((tmp_path / "refs").glob("*.json"))) == 7
    calls = []
    monkeypatch.setattr(ev, "greedy_generate", lambda *a, **k: calls.append(1))  # a hit must not decode
    second = run_eval(ecfg, data_dir, "fast", 12, tmp_path / "refs")
    assert second.cache_hits == 7 and not calls
    assert [r.acceptance for r in plain.records] == [r.acceptance for r in first.records] == \
        [r.acceptance for r in second.records]
    monkeypatch.undo()
    other = run_eval(tiny_ecfg(2, seed=1), data_dir, "fast", 12, tmp_path / "refs")  # other weights: new keys
    assert other.cache_hits == 0 and len(list((tmp_path / "refs").glob("*.json"))) == 14
    for f in (tmp_path / "refs").glob("*.json"):
        f.write_text("{truncated")  # unreadable entries: decoded again and rewritten
    again = run_eval(ecfg, data_dir, "fast", 12, tmp_path / "refs")
    assert again.cache_hits == 0 and [r.acceptance for r in again.records] == [r.acceptance for r in plain.records]
    assert run_eval(ecfg, data_dir, "fast", 12, tmp_path / "refs").cache_hits == 7
    with pytest.raises(ValueError, match="fast executor only"):
        run_eval(ecfg, data_dir, "reference", 12, tmp_path / "refs")


@pytest.mark.multiproc
def test_dist_executor_matches_fast(data_dir, tmp_path):
    ecfg = tiny_ecfg(2, threads=1)
    fast, dist = run_eval(ecfg, data_dir, "fast", 12), run_eval(ecfg, data_dir, "dist", 12)
    assert [r.acceptance for r in fast.records] == [r.acceptance for r in dist.records]
    assert all(r.lossless is True for r in dist.records)


# ---- CLI ----

def test_cli_writes_table_and_json(data_dir, tmp_path, capsys, one_thread):
    out = tmp_path / "eval.json"
    rc = main(["eval", *ARGS_TINY, "--stages", "2", "--data-dir", str(data_dir), "--limit", "2",
               "--max-new-tokens", "16", "--json", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "overall" in captured.out and "alpha@full" in captured.out
    assert "[6/6] gsm8k#1" in captured.err  # progress on stderr, one line per prompt
    rep = json.loads(out.read_text())
    assert rep["n"] == 2 and rep["executor"] == "fast" and set(rep["datasets"]) == set(ev.DATASETS)
    recs = rep["records"]
    assert len(recs) == 6 and all(1 <= r["tokens"] <= 16 for r in recs)
    assert rep["overall"]["ticks"] == sum(r["ticks"] for r in recs) > 0
    verified = sum(sum(r["verified_by_fill"].values()) for r in recs)
    assert verified == rep["overall"]["verified"] == sum(r["tokens"] - 1 for r in recs)
    # the untrained tiny head has the full vocabulary: nothing can be outside it
    assert rep["overall"]["outside_vocab"] == 0 and all(r["outside_vocab"] == 0 for r in recs)
    assert "0 of" in captured.out and "outside the draft vocabulary" in captured.out


def test_cli_user_errors(data_dir, capsys):
    assert main(["eval", *ARGS_TINY, "--data-dir", str(data_dir), "--temperature", "0.8", "--executor", "fast"]) == 2
    assert "needs the executor with sampling support" in capsys.readouterr().err
    assert main(["eval", *ARGS_TINY, "--data-dir", str(data_dir), "--datasets", "mmlu"]) == 2
    assert "unknown dataset" in capsys.readouterr().err
    assert main(["eval", *ARGS_TINY, "--data-dir", str(data_dir / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["eval", *ARGS_TINY, "--data-dir", str(data_dir), "--max-new-tokens", "250"]) == 2
    assert "exceeds --capacity" in capsys.readouterr().err


def test_cli_reports_an_output_mismatch_as_failure(data_dir, monkeypatch, capsys, one_thread):
    """With the runtime executors every output is checked against greedy decoding: break the
    oracle and the run must fail with exit code 1 and name the prompt."""
    real = ev.greedy_generate

    def broken(*args, **kwargs):
        out = real(*args, **kwargs)
        return out[:-1] + [(out[-1] + 1) % 96]

    monkeypatch.setattr(ev, "greedy_generate", broken)
    rc = main(["eval", *ARGS_TINY, "--stages", "2", "--data-dir", str(data_dir), "--datasets", "gsm8k",
               "--limit", "1", "--max-new-tokens", "8", "--executor", "reference"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "OUTPUT DIFFERS FROM GREEDY" in err and "FAIL: gsm8k#0" in err
