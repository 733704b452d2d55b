"""Logits of a Megatron torch_dist checkpoint computed by megatron-core itself (the `verify` reference).

megatron-core's `GPTModel` (local layer spec, CPU, a single-rank gloo group) is built from the
checkpoint's Megatron-LM args (or from the engine config our export records), its weights are read
by megatron-core's own `dist_checkpointing.load`, and its forward gives the logits: nothing of the
engine's importer is involved, so a tensor the importer dropped or misread shows up as a difference.
It runs in a subprocess of its own (this module's `_main`, started by `megatron_logits`), which owns the
process group and the CPU shims (`cpu_shims`).

Nothing is unpickled on the way: before megatron-core (whose reader calls `pickle.load` on
`.metadata`) sees the checkpoint, `.metadata` and `common.pt` pass the allowlists of
checkpoint_tools/safe_unpickle.py; megatron-core then reads only tensors (torch's `weights_only`
loader): `common.pt` is not read and the `_extra_state` objects are left out.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from spd_engine.engine.model.model_config import ModelConfig

# Megatron-LM's defaults for the args that shape the model (a field an older namespace lacks).
ARG_DEFAULTS = {
    "group_query_attention": False, "num_query_groups": None, "kv_channels": None, "normalization": "LayerNorm",
    "norm_epsilon": 1e-5, "swiglu": False, "add_bias_linear": True, "add_qkv_bias": False, "qk_layernorm": False,
    "apply_layernorm_1p": False, "bias_gelu_fusion": True, "untie_embeddings_and_output_weights": False,
    "position_embedding_type": "learned_absolute", "rotary_base": 10000, "rotary_percent": 1.0,
    "use_rope_scaling": False, "rope_scaling_factor": 8.0, "max_position_embeddings": None, "seq_length": None,
}
_REQUIRED_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
# Megatron hard-codes llama3 RoPE scaling's low/high frequency factors and original context.
_MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def megatron_available() -> bool:
    """Whether megatron-core is installed (found, not imported: importing it is slow and noisy)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:  # no `megatron` package at all
        return False


def args_of_config(cfg: ModelConfig) -> dict | None:
    """Megatron-LM args for an engine config; None where megatron-core cannot compute it (llama3 RoPE
    scaling with factors other than the ones it hard-codes, a tanh GeLU without biases)."""
    rs = cfg.rope_scaling
    if rs is not None and any(float(rs[k]) != v for k, v in _MEGATRON_LLAMA3.items()):
        return None
    if cfg.activation == "gelu_tanh" and not cfg.linear_bias:
        return None  # Megatron-LM's tanh GeLU is its bias fusion, which needs biases
    return {**ARG_DEFAULTS, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
            "ffn_hidden_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_heads, "group_query_attention": True, "num_query_groups": cfg.num_kv_heads,
            "kv_channels": cfg.head_dim, "normalization": "LayerNorm" if cfg.norm == "layernorm" else "RMSNorm",
            "norm_epsilon": cfg.rms_eps, "swiglu": cfg.gated, "apply_layernorm_1p": cfg.norm_1p,
            "bias_gelu_fusion": cfg.activation == "gelu_tanh", "rotary_percent": cfg.rotary_percent,
            "add_bias_linear": cfg.linear_bias, "add_qkv_bias": cfg.qkv_bias, "qk_layernorm": cfg.qk_norm,
            "untie_embeddings_and_output_weights": not cfg.tie_embeddings, "position_embedding_type": "rope",
            "rotary_base": cfg.rope_theta, "use_rope_scaling": rs is not None,
            "rope_scaling_factor": float(rs["factor"]) if rs else 8.0, "max_position_embeddings": cfg.max_position}


def args_of_namespace(ns: Any) -> dict:
    """The model-shaping fields of a Megatron-LM args namespace (read through the allowlist), as plain JSON."""
    out = {k: getattr(ns, k, d) for k, d in ARG_DEFAULTS.items()}
    for k in _REQUIRED_ARGS:
        out[k] = getattr(ns, k, None)
    bad = {k: v for k, v in out.items() if not isinstance(v, (int, float, str, bool, type(None)))}
    if bad or any(out[k] is None for k in _REQUIRED_ARGS):
        raise ValueError(f"the checkpoint's Megatron-LM args lack or garble {sorted(bad) or list(_REQUIRED_ARGS)}")
    return out


def cpu_shims() -> None:
    """Calls megatron-core 0.16 makes even on a gloo group, which have nothing to do on a CPU:
    - torch.cuda.synchronize (the checkpoint code's timing barriers)
    - torch.cuda.current_device (device placement of loaded tensors)
    - the model-parallel CUDA RNG tracker's fork (it only seeds dropout, which is off here)
    """
    import contextlib

    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    mp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def build_gpt(a: dict, vocab_rows: int, init_std: float = 0.02):
    """GPTModel as Megatron-LM builds it from its args (core_transformer_config_from_args, local spec);
    `init_std` only matters to a model built to be saved (the reference loads its weights).
    With apply_layernorm_1p the model is built without it (see `shift_norms_1p`)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    heads = a["num_attention_heads"]
    tcfg = TransformerConfig(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], num_attention_heads=heads,
        num_query_groups=a["num_query_groups"] if a["group_query_attention"] else None,
        kv_channels=a["kv_channels"] or a["hidden_size"] // heads, ffn_hidden_size=a["ffn_hidden_size"],
        normalization=a["normalization"], layernorm_epsilon=a["norm_epsilon"],
        gated_linear_unit=a["swiglu"],
        activation_func=F.silu if a["swiglu"] else F.gelu, add_bias_linear=a["add_bias_linear"],
        add_qkv_bias=a["add_qkv_bias"], qk_layernorm=a["qk_layernorm"], init_method_std=init_std,
        hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, apply_rope_fusion=False, bias_dropout_fusion=False,
        # Megatron-LM's fused bias-GeLU (its tanh form) where it has biases to fuse (validate_args)
        bias_activation_fusion=bool(not a["swiglu"] and a["add_bias_linear"] and a["bias_gelu_fusion"]),
        masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False)
    spec = get_gpt_layer_local_spec(qk_layernorm=a["qk_layernorm"], normalization=a["normalization"])
    return GPTModel(tcfg, spec, vocab_size=vocab_rows,
                    max_sequence_length=a["max_position_embeddings"] or a["seq_length"],
                    position_embedding_type=a["position_embedding_type"], rotary_base=int(a["rotary_base"]),
                    rotary_percent=a["rotary_percent"], rope_scaling=a["use_rope_scaling"],
                    rope_scaling_factor=a["rope_scaling_factor"],
                    share_embeddings_and_output_weights=not a["untie_embeddings_and_output_weights"])


def shift_norms_1p(model, sign: int = 1) -> None:
    """apply_layernorm_1p on a CPU: megatron-core's torch norm (the local spec without apex) refuses
    layernorm_zero_centered_gamma, so the model is built without it and, its weights being gamma - 1,
    `sign` 1 adds the one apex's and TE's zero-centred norms add inside the kernel (every norm: layers,
    q/k, final); -1 gives the stored form back."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(sign)


def load_weights(model, ckpt: str, one_p: bool = False) -> None:
    """megatron-core's dist_checkpointing.load of the model's tensors (no common.pt, no _extra_state)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class NoCommon(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):  # the model's tensors need nothing from common.pt
            return {}

    wanted = {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")}
    loaded = dist_checkpointing.load(wanted, ckpt, common_strategy=NoCommon())
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"megatron-core's GPTModel and {ckpt} disagree: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    if one_p:
        shift_norms_1p(model)


def forward_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of one full forward (no cache)."""
    T = tokens.shape[1]
    positions = torch.arange(T).expand_as(tokens)
    # Megatron's masks are True where attention is NOT allowed; its default mask is made on CUDA.
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)[None, None]  # [1, 1, T, T]
    with torch.no_grad():
        return model(tokens, positions, attention_mask=mask).float()


def init_single_rank(rendezvous: str) -> None:
    """A one-rank gloo group (file rendezvous: no port to collide on), megatron-core's model-parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    cpu_shims()
    parallel_state.initialize_model_parallel(1, 1)


def _main(ckpt: str, request: str, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    req = json.loads(Path(request).read_text())
    init_single_rank(req["rendezvous"])
    model = build_gpt(req["args"], req["vocab_rows"]).eval()
    load_weights(model, ckpt, req["args"]["apply_layernorm_1p"])
    logits = [forward_logits(model, torch.tensor([p]))[0] for p in req["prompts"]]
    torch.save(logits, out)


def megatron_logits(ckpt: Path, args: dict, vocab_rows: int, prompts: list[list[int]],
                    timeout_s: float = 600.0) -> list[torch.Tensor]:
    """Logits [T, vocab_rows] per prompt from megatron-core, in a subprocess. `ckpt` must have passed
    the allowlists already (megatron_dcp.SafeReader / read_common)."""
    with tempfile.TemporaryDirectory(prefix="spd-megatron-ref-") as tmp:
        request, out = Path(tmp) / "request.json", Path(tmp) / "logits.pt"
        request.write_text(json.dumps({"args": args, "vocab_rows": vocab_rows, "prompts": prompts,
                                       "rendezvous": str(Path(tmp) / "rendezvous")}))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        run = subprocess.run([sys.executable, "-c", _CHILD, str(ckpt), str(request), str(out)], capture_output=True,
                             text=True, timeout=timeout_s, env=env, cwd=tmp)
        if run.returncode != 0:
            last = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise ValueError(f"megatron-core could not run {ckpt}: {last}")
        return torch.load(out, weights_only=True)


# the child: this module's _main, with no directory on sys.path that could shadow installed packages
_CHILD = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
          "from spd_engine.checkpoint_tools.megatron_reference import _main; _main(*sys.argv[1:4])")
