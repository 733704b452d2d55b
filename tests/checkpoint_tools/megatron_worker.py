"""Subprocess for the Megatron-core interop tests: megatron-core's own GPTModel on CPU (local layer spec,
single-rank gloo group).

  python megatron_worker.py TOKENS_JSON CKPT_DIR OUT_PT [CKPT_DIR OUT_PT ...]
      for each checkpoint (our export): build `GPTModel` from the engine config it records, load it
      with `dist_checkpointing.load`, save its logits for the given tokens
  python megatron_worker.py save SPECS_JSON TOKENS_JSON OUT_ROOT
      for each {name: args} of SPECS_JSON: build `GPTModel` from Megatron-LM-style args (the names
      Megatron-LM's argparse gives them), with random non-zero biases and norm weights, save it as
      Megatron-LM does (`dist_checkpointing.save` of {"args": Namespace, "iteration",
      "checkpoint_version", "model": sharded state} into OUT_ROOT/name/iter_0000100 + the tracker
      file), and save its logits and greedy continuation (args "new_tokens", default 8) as OUT_ROOT/name.pt
Runs in its own process because it initialises a process group and patches CUDA calls that
Megatron's code makes unconditionally (`cpu_shims`).
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path


def cpu_shims() -> None:
    """Megatron-core 0.16 makes these CUDA calls even on a gloo group; on CPU they have nothing to do.

    The CUDA RNG tracker only seeds dropout, which is off (p = 0) here.
    """
    import contextlib

    import torch
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    mp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def build_gpt(cfg):
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tcfg = TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
        num_query_groups=cfg.num_kv_heads, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=cfg.qkv_bias, qk_layernorm=cfg.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        apply_rope_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False)
    rs = cfg.rope_scaling
    if rs is not None:
        # Megatron hard-codes llama3's low/high factors and original context; the test config matches.
        assert (rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]) == (1, 4, 8192)
    spec = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_norm, normalization="RMSNorm")
    return GPTModel(tcfg, spec, vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position,
                    position_embedding_type="rope", rotary_base=int(cfg.rope_theta),
                    rope_scaling=rs is not None, rope_scaling_factor=rs["factor"] if rs else 8.0,
                    share_embeddings_and_output_weights=cfg.tie_embeddings)


def build_gpt_from_args(a: dict):
    """GPTModel as Megatron-LM builds it from its args (core_transformer_config_from_args, local spec)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    tcfg = TransformerConfig(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], num_attention_heads=a["num_attention_heads"],
        num_query_groups=a["num_query_groups"] if a["group_query_attention"] else None,
        kv_channels=a["kv_channels"], ffn_hidden_size=a["ffn_hidden_size"], normalization=a["normalization"],
        layernorm_epsilon=a["norm_epsilon"], gated_linear_unit=a["swiglu"],
        activation_func=F.silu if a["swiglu"] else F.gelu, add_bias_linear=a["add_bias_linear"],
        add_qkv_bias=a["add_qkv_bias"], qk_layernorm=a["qk_layernorm"], init_method_std=0.1,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        apply_rope_fusion=False, bias_dropout_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)
    spec = get_gpt_layer_local_spec(qk_layernorm=a["qk_layernorm"], normalization=a["normalization"])
    return GPTModel(tcfg, spec, vocab_size=a["padded_vocab_size"], max_sequence_length=a["max_position_embeddings"],
                    position_embedding_type=a["position_embedding_type"], rotary_base=a["rotary_base"],
                    rotary_percent=a["rotary_percent"], rope_scaling=a["use_rope_scaling"],
                    rope_scaling_factor=a["rope_scaling_factor"],
                    share_embeddings_and_output_weights=not a["untie_embeddings_and_output_weights"])


def perturb_(model, seed: int) -> None:
    """Non-zero biases and norm weights (Megatron initialises them to 0 and 1: a zero bias would not
    show a dropped tensor)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def logits_of(model, tokens):
    """Logits [B, T, V] of a full forward (no cache)."""
    import torch

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    T = tokens.shape[1]
    # Megatron's masks are True where attention is NOT allowed; its default mask is made on CUDA.
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)[None, None]  # [1, 1, T, T]
    with torch.no_grad():
        return model(tokens, positions, attention_mask=mask).float()


def greedy(model, tokens, new_tokens: int):
    """Greedy continuation [B, new_tokens] by full recomputation each step."""
    import torch

    for _ in range(new_tokens):
        nxt = logits_of(model, tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, -new_tokens:]


def save_megatron_lm(a: dict, tokens, out_dir: Path, result: Path) -> None:
    """Build one model, save it as Megatron-LM does, record logits + greedy tokens (module docstring)."""
    import argparse

    import torch
    from megatron.core import dist_checkpointing

    torch.manual_seed(a.get("seed", 0))
    model = build_gpt_from_args(a).eval()
    perturb_(model, a.get("seed", 0))
    ckpt = out_dir / "iter_0000100"
    ckpt.mkdir(parents=True)
    state = {"args": argparse.Namespace(**a), "checkpoint_version": 3.0, "iteration": 100,
             "model": model.sharded_state_dict()}
    dist_checkpointing.save(state, str(ckpt))
    (out_dir / "latest_checkpointed_iteration.txt").write_text("100")
    torch.save({"logits": logits_of(model, tokens), "greedy": greedy(model, tokens, a.get("new_tokens", 8))},
               result)


def save_all(specs_json: str, tokens_json: str, out_root: str) -> None:
    import torch

    tokens = torch.tensor(json.loads(Path(tokens_json).read_text()))  # [B, T]
    for name, a in json.loads(Path(specs_json).read_text()).items():
        save_megatron_lm(a, tokens, Path(out_root) / name, Path(out_root) / f"{name}.pt")


def init_process_group() -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    cpu_shims()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)


def main(tokens_json: str, pairs: list[str]) -> None:
    import torch

    from spd_engine.checkpoint_tools.megatron_dcp import CONFIG_KEY, read_common
    from spd_engine.engine.model.model_config import ModelConfig

    tokens = torch.tensor(json.loads(Path(tokens_json).read_text()))  # [B, T]
    for ckpt, out in zip(pairs[0::2], pairs[1::2]):
        cfg = ModelConfig.from_dict(read_common(Path(ckpt))[CONFIG_KEY])
        torch.save(run_one(build_gpt(cfg), ckpt, tokens), out)


def run_one(model, ckpt: str, tokens):
    """Load `ckpt` into `model` and return {"logits" [B, T, V], "loaded_keys"}."""
    import torch
    from megatron.core import dist_checkpointing

    from spd_engine.checkpoint_tools.megatron_dcp import CONFIG_KEY

    loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt)
    missing, unexpected = model.load_state_dict(
        {k: v for k, v in loaded.items() if k not in ("checkpoint_version", CONFIG_KEY)}, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)
    return {"logits": logits_of(model.eval(), tokens), "loaded_keys": sorted(loaded)}


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    init_process_group()
    if sys.argv[1] == "save":
        save_all(*sys.argv[2:5])
    else:
        main(sys.argv[1], sys.argv[2:])
    import torch.distributed as dist

    dist.destroy_process_group()
