"""Subprocess for the Megatron-core interop tests: megatron-core's own GPTModel on CPU (local layer spec,
single-rank gloo group), through the helpers of checkpoint_tools/megatron_reference.py (which also
holds the CUDA shims, `cpu_shims`).

  python megatron_worker.py TOKENS_JSON CKPT_DIR OUT_PT [CKPT_DIR OUT_PT ...]
      for each checkpoint (our export): build `GPTModel` from the engine config it records, load it
      with `dist_checkpointing.load`, save its logits for the given tokens
  python megatron_worker.py save SPECS_JSON TOKENS_JSON OUT_ROOT
      for each {name: args} of SPECS_JSON: build `GPTModel` from Megatron-LM-style args (the names
      Megatron-LM's argparse gives them), with random non-zero biases and norm weights, save it as
      Megatron-LM does (`dist_checkpointing.save` of {"args": Namespace, "iteration",
      "checkpoint_version", "model": sharded state} into OUT_ROOT/name/iter_0000100 + the tracker
      file), and save its logits and greedy continuation (args "new_tokens", default 8) as OUT_ROOT/name.pt;
      with apply_layernorm_1p the norm weights are saved as gamma - 1 (megatron_reference.shift_norms_1p)
  python megatron_worker.py resave-tp2 SRC DST
      two ranks (tensor parallel 2) load SRC, a checkpoint `save` wrote, into their GPTModel shards and
      save it again into DST/iter_0000100: Megatron's TP-sharded chunks of the same weights
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from spd_engine.checkpoint_tools import megatron_reference as ref


def perturb_(model, seed: int) -> None:
    """Non-zero biases and norm weights (Megatron initialises them to 0 and 1: a zero bias would not
    show a dropped tensor)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def greedy(model, tokens: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation [B, new_tokens] by full recomputation each step."""
    for _ in range(new_tokens):
        nxt = ref.forward_logits(model, tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, -new_tokens:]


def save_megatron_lm(a: dict, tokens: torch.Tensor, out_dir: Path, result: Path) -> None:
    """Build one model, save it as Megatron-LM does, record logits + greedy tokens (module docstring)."""
    from megatron.core import dist_checkpointing

    args = {**ref.ARG_DEFAULTS, **a}
    torch.manual_seed(a.get("seed", 0))
    model = ref.build_gpt(args, args["padded_vocab_size"], init_std=0.1).eval()
    perturb_(model, a.get("seed", 0))
    torch.save({"logits": ref.forward_logits(model, tokens), "greedy": greedy(model, tokens, a.get("new_tokens", 8))},
               result)
    if args["apply_layernorm_1p"]:
        ref.shift_norms_1p(model, -1)  # the stored form: gamma - 1
    ckpt = out_dir / "iter_0000100"
    ckpt.mkdir(parents=True)
    state = {"args": argparse.Namespace(**a), "checkpoint_version": 3.0, "iteration": 100,
             "model": model.sharded_state_dict()}
    dist_checkpointing.save(state, str(ckpt))
    (out_dir / "latest_checkpointed_iteration.txt").write_text("100")


def save_all(specs_json: str, tokens_json: str, out_root: str) -> None:
    tokens = torch.tensor(json.loads(Path(tokens_json).read_text()))  # [B, T]
    for name, a in json.loads(Path(specs_json).read_text()).items():
        save_megatron_lm(a, tokens, Path(out_root) / name, Path(out_root) / f"{name}.pt")


def load_exports(tokens_json: str, pairs: list[str]) -> None:
    """Our exports into GPTModel through megatron-core's full dist_checkpointing.load (common.pt included)."""
    from megatron.core import dist_checkpointing

    from spd_engine.checkpoint_tools.megatron_dcp import CONFIG_KEY, read_common
    from spd_engine.engine.model.model_config import ModelConfig

    tokens = torch.tensor(json.loads(Path(tokens_json).read_text()))  # [B, T]
    for ckpt, out in zip(pairs[0::2], pairs[1::2]):
        cfg = ModelConfig.from_dict(read_common(Path(ckpt))[CONFIG_KEY])
        args = ref.args_of_config(cfg)
        assert args is not None, "the test configs use the llama3 factors Megatron hard-codes"
        model = ref.build_gpt({**ref.ARG_DEFAULTS, **args}, cfg.vocab_size)
        loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt)
        missing, unexpected = model.load_state_dict(
            {k: v for k, v in loaded.items() if k not in ("checkpoint_version", CONFIG_KEY)}, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        assert not missing and not unexpected, (missing, unexpected)
        if cfg.norm_1p:
            ref.shift_norms_1p(model)
        torch.save({"logits": ref.forward_logits(model.eval(), tokens), "loaded_keys": sorted(loaded)}, out)


def _resave_rank(rank: int, src: str, dst: str, rendezvous: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    from spd_engine.checkpoint_tools.megatron_dcp import checkpoint_dir, read_common

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    ref.cpu_shims()
    parallel_state.initialize_model_parallel(2, 1)
    ckpt = checkpoint_dir(src)
    a = vars(read_common(ckpt)["args"])
    model = ref.build_gpt({**ref.ARG_DEFAULTS, **a}, a["padded_vocab_size"])
    one_p = a.get("apply_layernorm_1p", False)
    ref.load_weights(model, str(ckpt), one_p)
    if one_p:
        ref.shift_norms_1p(model, -1)  # saved again in the stored form
    out = Path(dst) / "iter_0000100"
    if rank == 0:
        out.mkdir(parents=True)
        (Path(dst) / "latest_checkpointed_iteration.txt").write_text("100")
    dist.barrier()
    dist_checkpointing.save({"args": argparse.Namespace(**a), "model": model.sharded_state_dict()}, str(out))
    dist.destroy_process_group()


def resave_tp2(src: str, dst: str) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_resave_rank, args=(src, dst, str(Path(tmp) / "rendezvous")), nprocs=2)


if __name__ == "__main__" and sys.argv[1] == "resave-tp2":
    resave_tp2(*sys.argv[2:4])
elif __name__ == "__main__":
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        ref.init_single_rank(str(Path(tmp) / "rendezvous"))
        if sys.argv[1] == "save":
            save_all(*sys.argv[2:5])
        else:
            load_exports(sys.argv[1], sys.argv[2:])
        import torch.distributed as dist

        dist.destroy_process_group()
