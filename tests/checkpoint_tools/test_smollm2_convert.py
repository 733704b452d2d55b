"""Real weights: SmolLM2-135M (30 layers, 9 heads in 3 query groups, tied embeddings).

Default run: one --pp 4 round trip, the --tp 2 error, and the peak-RSS bound for loading stage 0.
Slow (`-m slow`): every --pp 1..4 x --tp 1,3 round trip, the peak-RSS bound for the tied head stage,
the Megatron round trip, verify, and Megatron-core's GPTModel on the exported real model.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import assert_same_tensors
from near_ties import count_near_ties

from spd_engine.checkpoint_tools import hf, megatron_dcp, shard
from spd_engine.checkpoint_tools import verify_checkpoint as verify
from spd_engine.engine.model import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
MB = 1024 * 1024
SAME_BOUND = 1e-4  # logits of the same weights at other addresses (logit scale ~40; measured 0 here)

RSS_PROBE = """
import json, resource, sys
from spd_engine.engine.model import checkpoint as ckpt
from spd_engine.engine.model.model import StageModel
path, stage = sys.argv[1], int(sys.argv[2])
index = ckpt.read_index(path)
StageModel(index.cfg, range(0, 1), True, True, device="meta")  # imports done before measuring
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = ckpt.load_stage_model(path, stage)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"delta": after - before, "stage_bytes": nbytes, "layers": len(model.layer_range)}))
"""


@pytest.fixture(scope="module")
def source(smollm2_dir):
    return hf.read_hf_state(smollm2_dir)


@pytest.fixture(scope="module")
def pp4(smollm2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "pp4"
    shard.hf2mcore(smollm2_dir, out, pp=4)
    return out


def test_pp4_round_trip_bit_identical(pp4, source, smollm2_dir, tmp_path):
    index = ckpt.read_index(pp4)
    assert index.stage_layers == (8, 8, 7, 7) and index.cfg.num_layers == 30
    shard.mcore2hf(pp4, tmp_path / "hf")
    assert_same_tensors(hf.read_hf_state(tmp_path / "hf"), source)
    assert hf.read_hf_config(tmp_path / "hf")[1] == json.loads((Path(smollm2_dir) / "config.json").read_text())
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (Path(smollm2_dir) / "tokenizer.json").read_bytes()


def test_tp2_is_a_clear_error(smollm2_dir, tmp_path):
    with pytest.raises(ValueError, match="--tp 2 does not divide num_kv_heads=3, num_heads=9"):
        shard.hf2mcore(smollm2_dir, tmp_path / "e", tp=2)


@pytest.mark.parametrize("stage", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_loading_one_stage_peak_rss(pp4, stage):
    """Stage 0 (embedding + 8 layers) and stage 3 (7 layers + the tied head read from stage 0's file)."""
    run = subprocess.run([sys.executable, "-c", RSS_PROBE, str(pp4), str(stage)], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    assert probe["layers"] == (8 if stage == 0 else 7)
    assert probe["stage_bytes"] > 150 * MB  # the embedding / tied head is part of the stage
    assert probe["delta"] <= 1.3 * probe["stage_bytes"] + 100 * MB, probe


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("tp", [1, 3])
def test_round_trip_every_split(smollm2_dir, source, tmp_path, pp, tp):
    index = shard.hf2mcore(smollm2_dir, tmp_path / "e", pp=pp, tp=tp)
    assert index.n == pp and index.tp == tp
    shard.mcore2hf(tmp_path / "e", tmp_path / "hf")
    assert_same_tensors(hf.read_hf_state(tmp_path / "hf"), source)


@pytest.mark.slow
def test_megatron_round_trip_and_verify(pp4, smollm2_dir, tmp_path):
    cfg, state = shard.read_engine(pp4)
    megatron_dcp.export_megatron(tmp_path / "m", cfg, state)
    cfg2, back = megatron_dcp.import_megatron(tmp_path / "m")
    assert cfg2 == cfg
    assert_same_tensors(back, state)  # bit-identical weights; the logits to a bound (other addresses, docs/testing.md)
    model = verify.build_model(cfg, state)
    logits = torch.cat([verify.prompt_logits(model, p) for p in verify.default_prompts(cfg)])
    ties = count_near_ties(logits, SAME_BOUND)  # the only positions whose argmax may differ (1 of 48 here)
    result = verify.verify(smollm2_dir, tmp_path / "m", atol=SAME_BOUND, min_agreement=1 - ties / len(logits),
                           reference="engine")  # the loaders: bit-identical weights, one model
    assert result.passed, result.summary()
    print(f"{result.summary()}; {ties} near-ties within {2 * SAME_BOUND:g}")


@pytest.mark.slow
@pytest.mark.multiproc
def test_megatron_gpt_model_on_real_weights(pp4, tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is a test extra")
    cfg, state = shard.read_engine(pp4)
    megatron_dcp.export_megatron(tmp_path / "m", cfg, state)
    tokens = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    (tmp_path / "tokens.json").write_text(json.dumps(tokens.tolist()))
    worker = Path(__file__).with_name("megatron_worker.py")
    run = subprocess.run([sys.executable, str(worker), str(tmp_path / "tokens.json"), str(tmp_path / "m"),
                          str(tmp_path / "out.pt")], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    theirs = torch.load(tmp_path / "out.pt")["logits"][0]
    ours = verify.prompt_logits(verify.build_model(cfg, state), tokens[0].tolist())
    assert (theirs - ours).abs().max() < 1e-3
    assert (theirs.argmax(-1) == ours.argmax(-1)).all()
