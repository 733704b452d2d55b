"""Subprocess for the Megatron-core interop test: load our torch_dist export into Megatron's GPTModel.

Run as `python megatron_worker.py TOKENS_JSON CKPT_DIR OUT_PT [CKPT_DIR OUT_PT ...]`: for each
checkpoint, builds `GPTModel` with the local layer spec on CPU under a single-rank gloo group, loads
the checkpoint with `dist_checkpointing.load`, and saves its logits for the given tokens. Runs in its own process because it initialises a process
group and patches two CUDA calls that Megatron's checkpoint code makes unconditionally.
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


def main(tokens_json: str, pairs: list[str]) -> None:
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    cpu_shims()
    from megatron.core import parallel_state

    from spd_engine.checkpoint_tools.megatron_dcp import CONFIG_KEY, read_common
    from spd_engine.engine.model.model_config import ModelConfig

    parallel_state.initialize_model_parallel(1, 1)
    tokens = torch.tensor(json.loads(Path(tokens_json).read_text()))  # [B, T]
    for ckpt, out in zip(pairs[0::2], pairs[1::2]):
        cfg = ModelConfig.from_dict(read_common(Path(ckpt))[CONFIG_KEY])
        torch.save(run_one(build_gpt(cfg), ckpt, tokens), out)
    dist.destroy_process_group()


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
    model.eval()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    T = tokens.shape[1]
    # Megatron's masks are True where attention is NOT allowed; its default mask is made on CUDA.
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)[None, None]  # [1, 1, T, T]
    with torch.no_grad():
        logits = model(tokens, positions, attention_mask=mask)  # [B, T, V]
    return {"logits": logits.float(), "loaded_keys": sorted(loaded)}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
