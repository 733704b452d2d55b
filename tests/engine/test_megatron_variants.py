"""The Megatron-LM GPT variants of the engine's model (LayerNorm with a bias, apply_layernorm_1p, a GeLU MLP,
qk-layernorm with either norm, partial RoPE) against plain torch written from Megatron's definitions, and
their tensor-parallel split against the unsharded model."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from spd_engine.engine.model.model import MLP, StageModel, init_random_, make_norm
from spd_engine.engine.model.model_config import ModelConfig, tiny_config
from spd_engine.engine.model.tp_model import SerialTP
from spd_engine.engine.model.tp_shard import merge_state, shard_state
from spd_engine.engine.protocol.topology import Topology
from spd_engine.engine.runtime.build import build_stage_model, build_tp_stage_model
from spd_engine.engine.runtime.run_config import ModelSpec, ParallelLayout, RunConfig, Runtime

VARIANTS = {
    "layernorm_gelu": dict(norm="layernorm", activation="gelu"),
    "layernorm_1p_gelu_tanh_bias": dict(norm="layernorm", norm_1p=True, activation="gelu_tanh", linear_bias=True,
                                        qkv_bias=True),
    "rmsnorm_1p_qk_norm": dict(norm_1p=True, qk_norm=True),
    "layernorm_qk_norm_partial_rope": dict(norm="layernorm", qk_norm=True, rotary_percent=0.5, activation="gelu"),
}


def _cfg(**kw) -> ModelConfig:
    return tiny_config("llama", num_layers=2, rope_scaling=None, **kw)


@pytest.mark.parametrize("norm,one_p", [("rmsnorm", False), ("rmsnorm", True), ("layernorm", False),
                                        ("layernorm", True)])
def test_norms_equal_torchs(norm, one_p):
    cfg = _cfg(norm=norm, norm_1p=one_p)
    ours = make_norm(cfg, 64)
    theirs = (torch.nn.LayerNorm if norm == "layernorm" else torch.nn.RMSNorm)(64, eps=cfg.rms_eps)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(64, generator=g))
        theirs.weight.copy_(ours.weight + 1 if one_p else ours.weight)  # 1p: the stored weight is gamma - 1
        if norm == "layernorm":
            ours.bias.copy_(torch.randn(64, generator=g))
            theirs.bias.copy_(ours.bias)
    assert hasattr(ours, "bias") == (norm == "layernorm")
    x = torch.randn(3, 5, 64, generator=g) * 3 + 1
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
    if one_p:  # a fresh 1p norm is gamma = 1, as Megatron initialises it (weight 0)
        assert torch.equal(make_norm(cfg, 64).weight, torch.zeros(64))


@pytest.mark.parametrize("activation,approximate", [("gelu", "none"), ("gelu_tanh", "tanh")])
def test_gelu_mlp_equals_a_plain_fc1_gelu_fc2(activation, approximate):
    cfg = _cfg(activation=activation, linear_bias=True, qkv_bias=True)
    mlp = MLP(cfg)
    assert mlp.linear_fc1.weight.shape == (cfg.intermediate_size, cfg.hidden_size)  # one projection, no gate
    ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(approximate=approximate), torch.nn.Linear(128, 64))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p, q in zip(mlp.parameters(), ref.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            q.copy_(p)
    x = torch.randn(2, 4, 64, generator=g)
    torch.testing.assert_close(mlp(x), ref(x), rtol=1e-6, atol=1e-6)
    # Megatron-LM's fused bias-GeLU (its tanh form, megatron/core/fusions/fused_bias_gelu.py)
    y = mlp.linear_fc1(x)
    fused = y * 0.5 * (1.0 + torch.tanh(0.79788456 * y * (1 + 0.044715 * y * y)))
    if activation == "gelu_tanh":
        torch.testing.assert_close(mlp.linear_fc2(fused), mlp(x), rtol=1e-5, atol=1e-6)


def _reference_logits(model: StageModel, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits by plain torch from its weights: torch's norms, Megatron's RoPE (inverse
    frequencies over the rotated dims, rotate_half of them, the rest passed through), explicit GQA."""
    cfg, sd = model.cfg, model.state_dict()
    B, T = tokens.shape
    hd, rd, nkv, qpg = cfg.head_dim, cfg.rotary_dim, cfg.num_kv_heads, cfg.q_per_group

    def norm(x: torch.Tensor, prefix: str) -> torch.Tensor:
        w = sd[prefix + ".weight"] + (1 if cfg.norm_1p else 0)
        if cfg.norm == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), w, sd[prefix + ".bias"], cfg.rms_eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_eps) * w

    def linear(x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, sd[prefix + ".weight"], sd.get(prefix + ".bias"))

    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, rd, 2).float() / rd)
    freqs = torch.outer(torch.arange(T).float(), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()  # [T, rd]

    def rope(x: torch.Tensor) -> torch.Tensor:  # [B, T, heads, hd]
        r, rest = x[..., :rd], x[..., rd:]
        rot = torch.cat([-r[..., rd // 2:], r[..., :rd // 2]], -1)
        return torch.cat([r * cos[:, None] + rot * sin[:, None], rest], -1)

    h = sd["embedding.word_embeddings.weight"][tokens]
    causal = torch.ones(T, T).tril().bool()
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        qkv = linear(norm(h, p + "input_layernorm"), p + "self_attention.linear_qkv").view(B, T, nkv, qpg + 2, hd)
        q, k, v = qkv[:, :, :, :qpg].reshape(B, T, -1, hd), qkv[:, :, :, qpg], qkv[:, :, :, qpg + 1]
        if cfg.qk_norm:
            q, k = norm(q, p + "self_attention.q_layernorm"), norm(k, p + "self_attention.k_layernorm")
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(qpg, dim=2), v.repeat_interleave(qpg, dim=2)
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hd)
        att = torch.einsum("bhts,bshd->bthd", scores.masked_fill(~causal, -torch.inf).softmax(-1), v)
        h = h + linear(att.reshape(B, T, -1), p + "self_attention.linear_proj")
        x = linear(norm(h, p + "pre_mlp_layernorm"), p + "mlp.linear_fc1")
        if cfg.activation == "swiglu":
            gate, up = x.chunk(2, -1)
            x = F.silu(gate) * up
        else:
            x = F.gelu(x, approximate="tanh" if cfg.activation == "gelu_tanh" else "none")
        h = h + linear(x, p + "mlp.linear_fc2")
    head = sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"])
    return F.linear(norm(h, "decoder.final_layernorm"), head)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_model_equals_a_plain_torch_forward_and_its_own_cached_decode(variant):
    cfg = _cfg(**VARIANTS[variant])
    model = init_random_(StageModel.full(cfg), seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h, _ = model.forward_layers(model.embed(tokens), model.new_cache(2, 16), 0)
        ours, theirs = model.logits(h), _reference_logits(model, tokens)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        cache = model.new_cache(2, 16)  # one token at a time through the KV cache: the same logits
        steps = [model.logits(model.forward_layers(model.embed(tokens[:, t:t + 1]), cache, t)[0])
                 for t in range(tokens.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), ours, rtol=1e-5, atol=1e-5)
    # the variant's own pieces matter: the same weights read as the default model give other logits
    plain = dataclasses.replace(cfg, norm="rmsnorm", norm_1p=False, rotary_percent=1.0)
    if plain.activation == cfg.activation:
        other = StageModel.full(plain)
        other.load_state_dict({k: v for k, v in model.state_dict().items() if "layernorm.bias" not in k})
        with torch.no_grad():
            diff = other.logits(other.forward_layers(other.embed(tokens), other.new_cache(2, 16), 0)[0]) - ours
        assert diff.abs().max() > 1e-3


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tp2_split_equals_the_unsharded_model(variant):
    cfg = _cfg(**VARIANTS[variant])
    state = init_random_(StageModel.full(cfg), seed=4).state_dict()
    ranks = shard_state(state, cfg, 2)
    if not cfg.gated:  # a GeLU fc1 is split on its rows like any column-parallel layer
        fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
        assert torch.equal(ranks[1][fc1], state[fc1][cfg.intermediate_size // 2:])
    if cfg.norm == "layernorm":  # LayerNorm biases are replicated
        assert torch.equal(ranks[1]["decoder.final_layernorm.bias"], state["decoder.final_layernorm.bias"])
    assert all(torch.equal(a, state[k]) for k, a in merge_state(ranks, cfg).items())
    ecfg = RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, 1)), runtime=Runtime(capacity=32))
    L = cfg.num_layers
    full = build_stage_model(ecfg, range(L), True, True)
    serial = SerialTP.build(lambda g: build_tp_stage_model(ecfg, range(L), True, True, g), 2)
    ids = torch.tensor([[1, 5, 7, 9, 11, 3, 8]])
    with torch.no_grad():
        h, _ = full.forward_layers(full.embed(ids), full.new_cache(1, 16), 0)
        h_tp, _ = serial.forward_layers(serial.embed(ids), serial.new_cache(1, 16), 0)
        torch.testing.assert_close(serial.logits(h_tp), full.logits(h), rtol=1e-5, atol=1e-5)


def test_config_fields_default_to_the_former_model_and_are_checked():
    base = _cfg()
    assert not {"norm", "norm_1p", "activation", "rotary_percent"} & set(base.to_dict())  # hashes unchanged
    cfg = _cfg(**VARIANTS["layernorm_qk_norm_partial_rope"])
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg and cfg.fingerprint() != base.fingerprint()
    assert cfg.rotary_dim == 8
    for bad, match in [(dict(norm="batchnorm"), "norm must be"), (dict(activation="relu"), "activation must be"),
                       (dict(rotary_percent=0.0), "rotary_percent"), (dict(rotary_percent=0.1), "even, positive")]:
        with pytest.raises(ValueError, match=match):
            _cfg(**bad)
    with pytest.raises(ValueError, match="no HF family.*norm='layernorm'.*export-megatron"):
        cfg.to_hf()


@pytest.mark.parametrize("mode,pdm_dtype", [("spd", "int8"), ("spd", "float32"), ("pp", "float32"),
                                            ("ar", "float32")])
def test_runtime_modes_give_the_greedy_tokens_of_a_variant_model(mode, pdm_dtype, one_thread):
    """All variants at once through the runtime's stages (threads): SPD with an int8 or fp32 PDM (whose
    final norm is the target's LayerNorm), pipeline and autoregressive modes, with the head screen and the
    weight layout the runtime picks, reproduce the greedy tokens of the full model."""
    from helpers import random_prompts, reference, tiny_cfg, tiny_engine_config

    from spd_engine.engine.runtime.reference import ReferenceExecutor
    from spd_engine.kernels.int8_linear import int8_kernel_available

    if pdm_dtype == "int8" and not int8_kernel_available():
        pytest.skip("torch has no int8 matmul kernel here")
    cfg = tiny_cfg("llama", rope_scaling=None, **VARIANTS["layernorm_1p_gelu_tanh_bias"], qk_norm=True,
                   rotary_percent=0.5)
    ecfg = tiny_engine_config(cfg=cfg, n=1 if mode == "ar" else 2, mode=mode, pdm_dtype=pdm_dtype)
    with ReferenceExecutor(ecfg) as ex:
        for prompt in random_prompts(cfg, (5, 9), seed=2):
            assert ex.generate(prompt, 12).tokens == reference(ecfg, prompt, 12), (mode, prompt)


def test_draft_heads_take_the_targets_layernorm_with_its_bias():
    """A draft head's final norm is the target's (frozen): a LayerNorm target's bias and 1p weight come along."""
    from spd_engine.engine.model.eagle_head import EagleConfig, EagleHead
    from spd_engine.engine.model.pdm import PDM, PDMConfig

    cfg = _cfg(norm="layernorm", norm_1p=True)
    target = init_random_(StageModel.full(cfg), seed=5)
    norm = target.decoder.final_layernorm
    pdm = PDM(cfg, PDMConfig((1, 1), (0, 1))).init_from_target(None, norm.weight, target.output_weight(), norm.bias)
    eagle = EagleHead(cfg, EagleConfig((0, 0, 1))).init_from_target(target)
    h = torch.randn(3, cfg.hidden_size)
    for head in (pdm, eagle):
        assert not any(p.requires_grad for p in head.final_norm.parameters())
        torch.testing.assert_close(head.draft_logits(h), target.logits(h), rtol=1e-6, atol=1e-6)
