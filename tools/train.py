"""`spd train`: distil a PDM head from the frozen target (docs/design.md 3.7), resumable.

Batches alternate between self-distilled sequences (the target's own answers; generated first
with --self-distill N) and the offline corpus text. The result is a PDM directory under
OUT/pdm that `spd generate --spec` and `spd eval --spec` take; `--method eagle` trains the eagle
baseline's head instead (train/eagle.py), exported to OUT/eagle for `--eagle-head`. Under torchrun every process is
one data-parallel rank (train/data_parallel.py; gloo on CPU, NCCL with --device cuda).
"""
from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator

import numpy as np
import torch

from spd_engine.engine.protocol.topology import Topology
from spd_engine.tools.cli_conventions import add_dtype_argument
from spd_engine.tools.model_args import model_config, resolve_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="built-in name, checkpoint, HF dir, GGUF or random:<preset>")
    p.add_argument("--method", choices=("pdm", "eagle"), default="pdm",
                   help="pdm: SPD's speculation module; eagle: the serial eagle baseline's head")
    p.add_argument("--corpus", required=True, help="corpus directory from `spd data`")
    p.add_argument("--out", required=True, help="run directory (resumes if it holds state.pt)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages n the head is trained for")
    p.add_argument("--stage-layers", default=None, help="explicit split, e.g. 8,8,7,7 (default: even split)")
    p.add_argument("--anchors", default=None, help="explicit anchors, e.g. 0,8,23,29 (default: the stage bounds)")
    p.add_argument("--pdm-layers", type=int, default=1, help="K: decoder layers of the head")
    p.add_argument("--ttt-steps", type=int, default=3, help="--method eagle: draft steps unrolled in training")
    p.add_argument("--draft-vocab", default=None, help="JSON from `spd draft-vocab` (default: the full vocabulary)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps in all (a resumed run continues to it)")
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate")
    p.add_argument("--save-every", type=int, default=50, help="steps between resumable saves")
    p.add_argument("--keep-every", type=int, default=0,
                   help="also keep OUT/snapshots/step-N every N steps (for acceptance-vs-tokens curves)")
    add_dtype_argument(p, "bfloat16", "PDM compute dtype (weights stay fp32; float32 = autocast off)", "--autocast")
    add_dtype_argument(p, "bfloat16", "dtype of the frozen target (bfloat16 or float32)", "--target-dtype")
    p.add_argument("--fill-weights", default=None,
                   help="n comma-separated weights of the fills 1..n a batch simulates (default: half full, "
                        "the rest uniform), e.g. how often `spd eval --json` says the driver drafts at each")
    p.add_argument("--init-head", default=None, metavar="DIR",
                   help="start from this exported PDM instead of from the target's layers (its K and draft "
                        "vocabulary must equal the run's; a head of another stage split warm-starts this one: "
                        "layers and head copied, projections mapped by anchor depth)")
    p.add_argument("--schedule", default="cosine", choices=("cosine", "wsd"),
                   help="learning rate after warmup: cosine over the run, or warmup-stable-decay (extendable)")
    p.add_argument("--decay-frac", type=float, default=0.2, help="wsd: the last fraction of the steps decays")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0, help="seed of the head's initialisation and the batch order")
    p.add_argument("--self-distill", type=int, default=0, help="generate answers for N corpus prompts first")
    p.add_argument("--gen-tokens", type=int, default=192, help="max answer length for --self-distill")
    p.add_argument("--gen-batch", type=int, default=32, help="prompts per batched greedy decode")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="after training, draw loss and acceptance against training tokens from the run's "
                        "history.json to this PNG (matplotlib; a finished run only draws)")


def batches(corpus, seq_len: int, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless [batch, seq_len] batches alternating self-distilled and offline sequences."""
    def stream(kinds):
        for epoch in itertools.count():
            yield from corpus.sequences(seq_len, kinds=kinds, seed=seed + epoch)

    has_gen = any(g["split"] == "train" for g in corpus.manifest["generated"])
    streams = [stream(("generated",)), stream(("prompt", "text", "conversation"))] if has_gen else \
        [stream(None)]
    for i in itertools.count():
        s = streams[i % len(streams)]
        yield torch.from_numpy(np.stack(list(itertools.islice(s, batch))).astype(np.int64))


def _fill_weights(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--fill-weights takes comma-separated numbers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from spd_engine.engine.runtime.build import build_stage_model
    from spd_engine.engine.runtime.run_config import ModelSpec, ParallelLayout, RunConfig, Runtime
    from spd_engine.train.corpus import Corpus
    from spd_engine.train.data_parallel import DataParallel
    from spd_engine.train.distill import TrainConfig, Trainer
    from spd_engine.train.draft_vocab_build import load_draft_vocab
    from spd_engine.train.self_distill import self_distill

    _check_method_flags(args)
    if args.plot:  # a missing matplotlib or an unwritable path is refused before training, not after it
        from spd_engine.tools.cli_conventions import check_output_path

        check_output_path(args.plot, "--plot")
        import matplotlib  # noqa: F401
    if args.target_dtype not in ("bfloat16", "float32"):
        raise ValueError(f"--target-dtype must be bfloat16 or float32, got {args.target_dtype}")
    if args.threads:
        torch.set_num_threads(args.threads)
    engine_dir, tok_dir = resolve_model(args.model)
    cfg = model_config(engine_dir)
    topo = Topology.build(cfg.num_layers, n=None if args.stage_layers else args.stages, stage_layers=args.stage_layers)
    corpus = Corpus(args.corpus)
    if corpus.vocab_size != cfg.vocab_size:
        raise ValueError(f"corpus was tokenized for a vocabulary of {corpus.vocab_size}, the model has {cfg.vocab_size}")
    dp = DataParallel.from_env(args.device)
    device = dp.device(args.device)
    ecfg = RunConfig(model=ModelSpec(source=engine_dir, cfg=cfg, dtype=args.target_dtype),
                     parallel=ParallelLayout(topology=topo, device=device),
                     runtime=Runtime(capacity=min(2048, cfg.max_position), seed=args.seed))
    target = build_stage_model(ecfg, range(cfg.num_layers), embedding=True, head=True)  # random:<preset> too
    for p in target.parameters():
        p.requires_grad_(False)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    done = sum(s["samples"] for s in corpus.manifest["sources"] if s["name"] == "self-distilled")
    if args.self_distill > done:  # resuming with the same command must not generate again
        if dp.world > 1:
            raise ValueError("--self-distill writes the corpus: run it in one process before starting torchrun")
        eos = corpus.manifest["tokenizer"]["eos_ids"]
        self_distill(corpus, target, args.self_distill - done, args.gen_tokens, eos, batch=args.gen_batch,
                     seed=args.seed, skip=done, log=log)
    dv = tuple(load_draft_vocab(args.draft_vocab)) if args.draft_vocab else None
    if args.method == "eagle":
        return _train_eagle(args, target, corpus, dv, device, dp, log)
    anchors = tuple(int(x) for x in args.anchors.split(",")) if args.anchors else None
    tcfg = TrainConfig(out=args.out, stage_layers=tuple(topo.stage_layers), anchors=anchors,
                       pdm_layers=args.pdm_layers, seq_len=args.seq_len, batch=args.batch, steps=args.steps,
                       lr=args.lr, target_dtype=args.target_dtype, device=device, seed=args.seed,
                       save_every=args.save_every, keep_every=args.keep_every, autocast=args.autocast,
                       fill_weights=_fill_weights(args.fill_weights), schedule=args.schedule,
                       decay_frac=args.decay_frac, init_head=args.init_head)
    return _run_trainer(Trainer, target, tcfg, corpus, dv, dp, log, args, "pdm")


def _run_trainer(trainer_cls, target, tcfg, corpus, dv, dp, log, args: argparse.Namespace, head: str) -> int:
    """Train on this rank's shard of the corpus stream; the main rank prints the exported head's path."""
    stream = dp.shard(batches(corpus, args.seq_len, args.batch, args.seed))
    trainer_cls(target, tcfg, stream, dv, log=log, dp=dp).run()
    dp.close()
    if dp.is_main:
        if args.plot:
            plot_run(args.out, args.plot, f"spd train --method {args.method}")
            print(f"spd train: plot written to {args.plot}", file=sys.stderr)
        print(f"{args.out}/{head}")
    return 0


def plot_run(out: str, png: str, title: str) -> None:
    """Draw a run directory's history.json (one record per step) to `png`."""
    import json
    from pathlib import Path

    from spd_engine.bench.plot import plot_training

    path = Path(out) / "history.json"
    if not path.is_file():
        raise ValueError(f"{path}: no history to plot (the run saved no step)")
    plot_training(json.loads(path.read_text()), png, title)


def _check_method_flags(args: argparse.Namespace) -> None:
    from spd_engine.tools.cli_conventions import refuse_ignored

    if args.method == "eagle":
        refuse_ignored(args, ["stages", "stage_layers", "anchors", "pdm_layers", "init_head"],
                       "with --method eagle (one rank)")
    else:
        refuse_ignored(args, ["ttt_steps"], "with --method pdm")


def _train_eagle(args: argparse.Namespace, target, corpus, dv, device: str, dp, log) -> int:
    from spd_engine.train.eagle import EagleTrainConfig, EagleTrainer

    tcfg = EagleTrainConfig(out=args.out, ttt_steps=args.ttt_steps, seq_len=args.seq_len, batch=args.batch,
                            steps=args.steps, lr=args.lr, target_dtype=args.target_dtype, device=device,
                            seed=args.seed, save_every=args.save_every, keep_every=args.keep_every,
                            autocast=args.autocast)
    return _run_trainer(EagleTrainer, target, tcfg, corpus, dv, dp, log, args, "eagle")
