"""Megatron-LM checkpoints import from their own args (common.pt), with no config file: the args map
to the engine's config or are refused by name, and models built and saved by megatron-core itself
give megatron-core's own logits and greedy tokens in the engine's model."""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import assert_same_tensors, tiny_state

from spd_engine.checkpoint_tools import megatron_args, megatron_dcp, shard
from spd_engine.engine.model import checkpoint as engine_ckpt
from spd_engine.engine.model.model import StageModel
from spd_engine.engine.model.model_config import tiny_config
from spd_engine.tools.cli import main

WORKER = Path(__file__).with_name("megatron_worker.py")
ROOT = Path(__file__).resolve().parents[2]

# Megatron-LM's args of a small llama-style model, as its argparse names them after validate_args.
LM_ARGS = dict(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, group_query_attention=True,
    num_query_groups=2, kv_channels=16, padded_vocab_size=128, vocab_size=None, normalization="RMSNorm",
    norm_epsilon=1e-6, swiglu=True, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False,
    untie_embeddings_and_output_weights=True, position_embedding_type="rope", rotary_base=500000,
    rotary_percent=1.0, max_position_embeddings=256, seq_length=128, use_rope_scaling=False,
    rope_scaling_factor=8.0, apply_layernorm_1p=False, num_experts=None, seed=0)


def test_args_map_to_the_engine_config():
    cfg = megatron_args.config_from_args(argparse.Namespace(**LM_ARGS))
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.vocab_size) == (2, 64, 128, 4, 2, 16, 128)
    assert (cfg.rms_eps, cfg.rope_theta, cfg.rope_scaling, cfg.max_position) == (1e-6, 500000.0, None, 256)
    assert (cfg.tie_embeddings, cfg.qkv_bias, cfg.linear_bias, cfg.qk_norm, cfg.arch) == (False, False, False,
                                                                                          False, "llama")
    biased = megatron_args.config_from_args(argparse.Namespace(**{**LM_ARGS, "add_bias_linear": True}))
    assert (biased.qkv_bias, biased.linear_bias, biased.arch) == (True, True, "llama")
    missing = dict(LM_ARGS)
    del missing["add_bias_linear"]  # an older namespace: Megatron-LM's default (biases on)
    assert megatron_args.config_from_args(argparse.Namespace(**missing)).linear_bias
    mha = megatron_args.config_from_args(argparse.Namespace(
        **{**LM_ARGS, "group_query_attention": False, "kv_channels": None, "vocab_size": 100,
           "untie_embeddings_and_output_weights": False, "add_qkv_bias": True, "use_rope_scaling": True}))
    assert (mha.num_kv_heads, mha.head_dim, mha.vocab_size, mha.tie_embeddings, mha.arch) == (4, 16, 100, True, "qwen2")
    assert mha.rope_scaling == {**megatron_args.MEGATRON_LLAMA3, "factor": 8.0}


def test_megatron_lm_variants_map_to_the_engine_config():
    """LayerNorm, apply_layernorm_1p, the GeLU MLP (tanh where Megatron-LM fuses it with a bias), partial RoPE."""
    ns = argparse.Namespace
    plain = megatron_args.config_from_args(ns(**LM_ARGS))
    assert (plain.norm, plain.norm_1p, plain.activation, plain.rotary_percent) == ("rmsnorm", False, "swiglu", 1.0)
    ln = megatron_args.config_from_args(ns(**{**LM_ARGS, "normalization": "LayerNorm", "apply_layernorm_1p": True,
                                              "swiglu": False, "rotary_percent": 0.5, "qk_layernorm": True}))
    assert (ln.norm, ln.norm_1p, ln.activation, ln.rotary_percent, ln.rotary_dim, ln.qk_norm) == (
        "layernorm", True, "gelu", 0.5, 8, True)
    gelu = {**LM_ARGS, "swiglu": False, "add_bias_linear": True}
    assert megatron_args.config_from_args(ns(**gelu)).activation == "gelu_tanh"  # bias_gelu_fusion's default
    assert megatron_args.config_from_args(ns(**gelu, bias_gelu_fusion=False)).activation == "gelu"
    older = {k: v for k, v in LM_ARGS.items() if k != "normalization"}  # Megatron-LM's default: LayerNorm
    assert megatron_args.config_from_args(ns(**older)).norm == "layernorm"
    with pytest.raises(ValueError, match="even, positive"):  # int(16 * 0.1) = 1 dim: RoPE rotates pairs
        megatron_args.config_from_args(ns(**{**LM_ARGS, "rotary_percent": 0.1}))


@pytest.mark.parametrize("change,named", [
    (dict(normalization="L2Norm"), "a norm other than RMSNorm or LayerNorm (normalization='L2Norm')"),
    (dict(squared_relu=True, swiglu=False), "a squared-ReLU MLP"),
    (dict(num_experts=8), "a mixture of experts (num_experts=8)"),
    (dict(position_embedding_type="learned_absolute"), "position embeddings other than RoPE"),
    (dict(rotary_percent=1.5), "a rotary_percent outside"),
    (dict(rotary_interleaved=True), "interleaved RoPE"),
    (dict(multi_latent_attention=True), "multi-latent attention"),
    (dict(position_embedding_type=None), "position embeddings other than RoPE"),  # lacking: Megatron-LM's default
])
def test_args_the_engine_cannot_compute_are_refused_by_name(change, named):
    args = {**LM_ARGS, **change}
    if change.get("position_embedding_type", "") is None:
        del args["position_embedding_type"]
    with pytest.raises(ValueError, match="does not compute: .*" + named.replace("(", r"\(").replace(")", r"\)")):
        megatron_args.config_from_args(argparse.Namespace(**args))


def _args_of(cfg) -> argparse.Namespace:
    """Megatron-LM args describing an engine config (the inverse of the mapping, for the tests)."""
    return argparse.Namespace(**{**LM_ARGS, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                                 "ffn_hidden_size": cfg.intermediate_size, "num_attention_heads": cfg.num_heads,
                                 "num_query_groups": cfg.num_kv_heads, "kv_channels": cfg.head_dim,
                                 "padded_vocab_size": cfg.vocab_size, "norm_epsilon": cfg.rms_eps,
                                 "rotary_base": cfg.rope_theta, "max_position_embeddings": cfg.max_position,
                                 "untie_embeddings_and_output_weights": not cfg.tie_embeddings,
                                 "add_qkv_bias": cfg.qkv_bias, "add_bias_linear": cfg.linear_bias,
                                 "qk_layernorm": cfg.qk_norm})


def test_import_reads_the_args_and_cross_checks_a_given_config(tmp_path, capsys):
    cfg = tiny_config("qwen2", num_layers=2, bos_token_id=None, eos_token_ids=(), rope_theta=1e6)
    state = tiny_state(cfg)
    megatron_dcp.export_megatron(tmp_path / "m", cfg, state)
    torch.save({"args": _args_of(cfg), "checkpoint_version": 3.0, "iteration": 7}, tmp_path / "m" / "common.pt")
    got_cfg, got = megatron_dcp.import_megatron(tmp_path / "m")
    assert got_cfg == cfg
    assert_same_tensors(got, state)
    # A config whose RoPE base or epsilon differs from the args loads the same weights: it is refused.
    with pytest.raises(ValueError, match="rope_theta: config 10000.0, args 1000000.0"):
        megatron_dcp.import_megatron(tmp_path / "m", tiny_config("qwen2", num_layers=2))
    torch.save({"iteration": 7}, tmp_path / "m" / "common.pt")
    assert main(["convert", "import-megatron", str(tmp_path / "m"), str(tmp_path / "e")]) == 2
    assert "pass --hf-config DIR" in capsys.readouterr().err


# ---- checkpoints built and saved by megatron-core itself ----

MATRIX = {
    "gqa_untied": LM_ARGS,
    "mha_tied_qkv_bias": {**LM_ARGS, "group_query_attention": False, "untie_embeddings_and_output_weights": False,
                          "add_qkv_bias": True, "padded_vocab_size": 128, "vocab_size": 100, "seed": 1},
    "qk_norm_rope_scaling": {**LM_ARGS, "qk_layernorm": True, "use_rope_scaling": True, "rotary_base": 10000,
                             "seed": 2},
    # Megatron-LM's defaults: biases on every linear layer, untied, GQA
    "linear_bias": {**LM_ARGS, "add_bias_linear": True, "seed": 3},
    "linear_bias_tied_qk_norm": {**LM_ARGS, "add_bias_linear": True, "qk_layernorm": True,
                                 "untie_embeddings_and_output_weights": False, "seed": 5},
    # Megatron-LM's GPT variants: LayerNorm + GeLU (erf without biases, the fused tanh form with them),
    # apply_layernorm_1p, qk-layernorm with LayerNorm, partial RoPE
    "layernorm_gelu": {**LM_ARGS, "normalization": "LayerNorm", "swiglu": False, "seed": 4},
    "layernorm_gelu_bias": {**LM_ARGS, "normalization": "LayerNorm", "swiglu": False, "add_bias_linear": True,
                            "seed": 6},
    "layernorm_1p": {**LM_ARGS, "normalization": "LayerNorm", "apply_layernorm_1p": True, "seed": 7},
    "layernorm_qk_norm": {**LM_ARGS, "normalization": "LayerNorm", "qk_layernorm": True, "seed": 8},
    "rotary_percent_half": {**LM_ARGS, "rotary_percent": 0.5, "rotary_base": 10000, "seed": 9},
    "learned_positions": {**LM_ARGS, "position_embedding_type": "learned_absolute", "seed": 10},
    "all_variants": {**LM_ARGS, "normalization": "LayerNorm", "apply_layernorm_1p": True, "qk_layernorm": True,
                     "rotary_percent": 0.5, "swiglu": False, "add_bias_linear": True, "seed": 11},
}
REFUSED = {"learned_positions": "position embeddings other than RoPE"}


def _engine_logits_and_greedy(ckpt_dir: Path, tokens: torch.Tensor, new_tokens: int):
    cfg, state = shard.read_engine(ckpt_dir)
    model = StageModel.full(cfg)
    model.load_state_dict({k: v.float() for k, v in state.items()})

    def logits(t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h, _ = model.forward_layers(model.embed(t), model.new_cache(*t.shape), 0)
            return model.logits(h)

    first, seq = logits(tokens), tokens
    for _ in range(new_tokens):
        seq = torch.cat([seq, logits(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return cfg, first, seq[:, -new_tokens:]


TOKENS = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """MATRIX built and saved by megatron-core (one worker process), with its logits and greedy tokens."""
    pytest.importorskip("megatron.core", reason="megatron-core is a test extra")
    root = tmp_path_factory.mktemp("megatron-built")
    (root / "tokens.json").write_text(json.dumps(TOKENS.tolist()))
    (root / "specs.json").write_text(json.dumps(MATRIX))
    run = subprocess.run([sys.executable, str(WORKER), "save", str(root / "specs.json"), str(root / "tokens.json"),
                          str(root)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return root


@pytest.mark.slow
def test_megatron_core_built_checkpoints(built, tmp_path, capsys):
    tokens = TOKENS
    for name, args in MATRIX.items():
        argv = ["convert", "import-megatron", str(built / name), str(tmp_path / f"{name}-engine"), "--stages", "2"]
        code = main(argv)
        err = capsys.readouterr().err
        if name in REFUSED:
            assert code == 2 and REFUSED[name] in err and err.count("\n") == 1, (name, err)
            continue
        assert code == 0, (name, err)
        assert engine_ckpt.read_index(tmp_path / f"{name}-engine").stage_layers == (1, 1)
        theirs = torch.load(built / f"{name}.pt")
        cfg, ours, greedy = _engine_logits_and_greedy(tmp_path / f"{name}-engine", tokens, theirs["greedy"].shape[1])
        V = cfg.vocab_size  # Megatron-LM's padding rows (beyond the recorded vocab_size) are not the model's
        torch.testing.assert_close(ours, theirs["logits"][..., :V], rtol=1e-4, atol=1e-4, msg=name)
        if V == args["padded_vocab_size"]:
            assert torch.equal(greedy, theirs["greedy"]), name
        assert theirs["logits"][..., :V].std() > 0.1, name  # not a degenerate model
    # Control: the imported linear biases matter (without them the logits are not megatron-core's).
    cfg, state = shard.read_engine(tmp_path / "linear_bias-engine")
    assert cfg.linear_bias
    model = StageModel.full(cfg)
    model.load_state_dict({k: torch.zeros_like(v) if k.endswith("fc2.bias") else v for k, v in state.items()})
    with torch.no_grad():
        dropped = model.logits(model.forward_layers(model.embed(tokens), model.new_cache(*tokens.shape), 0)[0])
    assert (dropped - torch.load(built / "linear_bias.pt")["logits"][..., :cfg.vocab_size]).abs().max() > 1e-3
    # Control: the tolerance tells GeLU's tanh form (Megatron-LM's fused bias-GeLU) from its erf form.
    cfg, state = shard.read_engine(tmp_path / "layernorm_gelu_bias-engine")
    assert cfg.activation == "gelu_tanh"
    model = StageModel.full(dataclasses.replace(cfg, activation="gelu"))
    model.load_state_dict(state)
    with torch.no_grad():
        erf = model.logits(model.forward_layers(model.embed(tokens), model.new_cache(*tokens.shape), 0)[0])
    assert (erf - torch.load(built / "layernorm_gelu_bias.pt")["logits"][..., :cfg.vocab_size]).abs().max() > 1e-4


@pytest.mark.slow
def test_verify_does_not_share_the_importer(built, tmp_path, monkeypatch, capsys):
    """An importer that drops a tensor (as the engine once dropped biases) writes a wrong engine checkpoint;
    verify against the Megatron checkpoint catches it, because megatron-core computes that side."""
    real = megatron_dcp.import_megatron

    def drops_fc2_biases(src, cfg=None):
        cfg, state = real(src, cfg)
        return cfg, {k: torch.zeros_like(v) if k.endswith("fc2.bias") else v for k, v in state.items()}

    monkeypatch.setattr(megatron_dcp, "import_megatron", drops_fc2_biases)
    src, dst = str(built / "linear_bias"), str(tmp_path / "e")
    assert main(["convert", "import-megatron", src, dst]) == 0
    capsys.readouterr()
    assert main(["convert", "verify", src, dst, "--reference", "engine", "--prompts", "1"]) == 0  # blind
    assert "PASS" in capsys.readouterr().out
    assert main(["convert", "verify", src, dst, "--prompts", "1"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL") and "A by megatron-core, B by engine" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["linear_bias", "all_variants"])
def test_spd_on_a_megatron_lm_default_checkpoint_gives_megatron_cores_greedy_tokens(built, tmp_path, name):
    """Megatron-LM's defaults (linear biases, untied, GQA, args in common.pt, iter_0000100 + tracker), and
    its GPT variants at once (LayerNorm, apply_layernorm_1p, qk-layernorm, partial RoPE, the fused tanh
    GeLU), imported with no config file into 2 stages: SPD across two stage processes generates what
    megatron-core's own greedy loop generated."""
    from spd_engine.engine.protocol.topology import Topology
    from spd_engine.engine.runtime.launch import launch
    from spd_engine.engine.runtime.run_config import ModelSpec, ParallelLayout, RunConfig, Runtime

    assert main(["convert", "import-megatron", str(built / name), str(tmp_path / "e"), "--stages", "2"]) == 0
    cfg = shard.read_engine(tmp_path / "e")[0]
    if name == "all_variants":
        assert (cfg.norm, cfg.norm_1p, cfg.qk_norm, cfg.rotary_dim, cfg.activation) == (
            "layernorm", True, True, 8, "gelu_tanh")
    want = torch.load(built / f"{name}.pt")["greedy"]  # [B, 8]
    ecfg = RunConfig(model=ModelSpec(source=str(tmp_path / "e"), cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, 2), threads=1), mode="spd",
                     runtime=Runtime(capacity=64, timeout_s=60.0))
    with launch(ecfg) as runtime:
        got = [runtime.generate(TOKENS[b].tolist(), want.shape[1]).tokens for b in range(TOKENS.shape[0])]
    assert got == want.tolist()


@pytest.mark.slow
def test_a_tp2_resave_by_megatron_core_imports_to_the_same_weights(built, tmp_path):
    """megatron-core at tensor parallel 2 loads the biased checkpoint and saves it again (TP-sharded
    chunks: fc1's gate and up halves per rank); the import reads the same tensors as from TP=1."""
    run = subprocess.run([sys.executable, str(WORKER), "resave-tp2", str(built / "linear_bias"), str(tmp_path / "tp2")],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    meta = megatron_dcp.SafeReader(tmp_path / "tp2" / "iter_0000100").read_metadata().state_dict_metadata
    assert len(meta["decoder.layers.mlp.linear_fc1.weight"].chunks) == 4 * LM_ARGS["num_layers"]  # 2 ranks x 2 halves
    cfg1, one = megatron_dcp.import_megatron(built / "linear_bias")
    cfg2, two = megatron_dcp.import_megatron(tmp_path / "tp2")
    assert cfg1 == cfg2 and cfg1.linear_bias
    assert_same_tensors(two, one)
