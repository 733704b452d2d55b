"""The whole GPU window (`spd gpu-check --window`, `make gpu-window`): the GPU check, the target, the
corpus, head training under the time guard, the evaluation on the device, then OUT packed to what
a GPU host hands back (docs/gpu-check.md, "The GPU window")."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from spd_engine.bench.device_check.check_env import environment, error_line, label
from spd_engine.bench.device_check.window_plan import SHIPPED_N4, WINDOW_KEYS, WINDOW_SCHEMA, WindowPlan

ROOT = Path(__file__).resolve().parents[2]  # the checkout: the shipped heads and the packed corpus

BatchesFn = Callable[..., Iterator[torch.Tensor]]  # tools/train.py `batches(corpus, seq_len, batch, seed)`


def _check(plan: WindowPlan, work: Path, log) -> dict:
    """`spd gpu-check` in a child process under a hard timeout: a check that hangs (its CUDA paths
    have their first run in a window) cannot take the training's time, and its device memory is
    freed when it exits."""
    from spd_engine.engine.runtime.launch import spd_command

    if not plan.check:
        return {"status": "not run (--no-check)"}
    out = work / "check"
    argv = [*spd_command(), "gpu-check", "--out", str(out), "--budget-s", str(plan.check_budget_s),
            "--device", plan.device, *(["--dry"] if plan.device == "cpu" else [])]
    # the child imports spd_engine as this process does ("" on sys.path: the working directory)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.getcwd() if p == "" else p for p in sys.path))
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(argv, env=env, timeout=plan.check_budget_s + plan.check_overrun_s).returncode
        rep = json.loads((out / "gpu-check.json").read_text())
        status = "pass" if rc == 0 and rep["summary"]["ok"] else "fail"
        return {"status": status, "rc": rc, "summary": rep["summary"], "seconds": round(time.perf_counter() - t0, 1)}
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"killed after {plan.check_budget_s + plan.check_overrun_s:.0f} s",
                "seconds": round(time.perf_counter() - t0, 1)}
    except (OSError, ValueError, KeyError) as err:  # no report written: the window goes on to training
        return {"status": "error", "error": error_line(err), "seconds": round(time.perf_counter() - t0, 1)}


def _target(plan: WindowPlan, carry: Path, work: Path):
    """(report entry, engine spec or None, its ModelConfig or None)."""
    from spd_engine.bench.device_check.window_target import prepare_target
    from spd_engine.engine.model.checkpoint import read_index
    from spd_engine.engine.runtime.run_config import random_preset

    if plan.model != "staged":
        return {"status": "pass", "model": plan.model, "seconds": 0.0}, plan.model, random_preset(plan.model)
    try:
        info = prepare_target(carry, work)
    except Exception as err:  # no target: nothing to train, the report says why
        return {"status": "error", "error": error_line(err)}, None, None
    return {"status": "pass", **info}, info["engine_dir"], read_index(info["engine_dir"]).cfg


def _corpus(plan: WindowPlan, work: Path, vocab_size: int):
    """(report entry, Corpus) in work/corpus: a copy of the packed corpus (self-distillation adds to it)."""
    from spd_engine.bench.device_check.check_training import synthetic_corpus
    from spd_engine.train.corpus import Corpus

    dest = work / "corpus"
    if dest.exists():
        shutil.rmtree(dest)
    if plan.corpus == "synthetic":
        synthetic_corpus(dest, vocab_size, holdout=0.1, prompts=16)
    elif plan.corpus.endswith(".tar.xz"):  # the tracked form: a third of the .npy files' size
        with tarfile.open(ROOT / plan.corpus, "r:xz") as tar:
            tar.extractall(dest, filter="data")
    else:
        shutil.copytree(ROOT / plan.corpus, dest)
    corpus = Corpus(dest)
    if corpus.vocab_size != vocab_size:
        raise ValueError(f"{plan.corpus} was tokenized for a vocabulary of {corpus.vocab_size}, "
                         f"the target has {vocab_size}")
    return {"path": plan.corpus, "train_tokens": corpus.token_count("train"),
            "holdout_tokens": corpus.token_count("holdout"),
            "decontamination": corpus.manifest.get("decontamination", {}).get("ngram")}, corpus


def _build_target(plan: WindowPlan, spec: str, cfg):
    from spd_engine.engine.protocol.topology import Topology
    from spd_engine.engine.runtime.build import build_stage_model
    from spd_engine.engine.runtime.run_config import ModelSpec, ParallelLayout, RunConfig, Runtime

    ecfg = RunConfig(model=ModelSpec(source=spec, cfg=cfg, dtype=plan.dtype),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, n=1), device=plan.device),
                     runtime=Runtime(capacity=min(2048, cfg.max_position), seed=0))
    target = build_stage_model(ecfg, range(cfg.num_layers), embedding=True, head=True)
    for p in target.parameters():
        p.requires_grad_(False)
    return target


def _self_distill(plan: WindowPlan, corpus, target, log) -> dict:
    from spd_engine.train.self_distill import self_distill

    if plan.self_distill <= 0:
        return {"status": "not run (0 prompts planned)"}
    t0, before = time.perf_counter(), corpus.token_count("train")
    self_distill(corpus, target, plan.self_distill, plan.gen_tokens, corpus.manifest["tokenizer"]["eos_ids"],
                 batch=plan.gen_batch, log=log)
    return {"status": "pass", "prompts": plan.self_distill, "tokens": corpus.token_count("train") - before,
            "seconds": round(time.perf_counter() - t0, 1)}


def _draft_vocab(plan: WindowPlan) -> tuple[int, ...] | None:
    """The shipped n = 4 head's draft vocabulary for the real target; the full vocabulary otherwise."""
    if plan.model != "staged":
        return None
    return tuple(json.loads((ROOT / SHIPPED_N4 / "pdm.json").read_text())["config"]["draft_vocab"])


def _eval_entries(plan: WindowPlan, training: dict, work: Path, target, cfg, resolve_init) -> list[dict]:
    from spd_engine.bench.device_check.window_train import train_config
    from spd_engine.engine.model.pdm import load_pdm
    from spd_engine.train.distill import new_pdm

    dev = torch.device(plan.device)
    entries = []
    for run in plan.runs:
        if training.get(run.name, {}).get("status") != "pass":
            continue
        init = resolve_init(run.init_head)
        start = (lambda run=run, init=init: new_pdm(target, train_config(plan, run, work / "tmp", init),
                                                    _draft_vocab(plan)).to(dev)) if init else (lambda: None)
        entries.append({"name": run.name, "weights": run.fill_weights, "start": start,
                        "load": lambda run=run: load_pdm(work / "heads" / run.name, cfg, run.stage_layers, device=dev)})
    return entries


def run_window(out_dir: str | Path, work_dir: str | Path, plan: WindowPlan, carry: str | Path, batches: BatchesFn,
               log: Callable[[str], None] = print, t0: float | None = None) -> dict:
    """The whole window; writes OUT/gpu-window.json, .md and the packed files; returns the report.
    `t0`: perf_counter time the window's budget counts from (default: now)."""
    from spd_engine.bench.device_check.window_eval import evaluate_heads
    from spd_engine.bench.device_check.window_outputs import pack_outputs
    from spd_engine.bench.device_check.window_report import summary, window_markdown
    from spd_engine.bench.device_check.window_train import run_training

    t0 = time.perf_counter() if t0 is None else t0
    end = t0 + plan.budget_s - plan.margin_s
    out, work = Path(out_dir), Path(work_dir)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = environment(plan.device)
    log(f"# spd gpu-check --window ({plan.device}): {label(env)}; budget {plan.budget_s:.0f} s")
    mode = "gpu" if plan.device != "cpu" else "cpu (the GPU plan, real target)" if plan.model == "staged" \
        else "dry (cpu, tiny shapes)"
    report: dict = {"schema": WINDOW_SCHEMA, "mode": mode,
                    "environment": env, "plan": dataclasses.asdict(plan)}
    report["check"] = _check(plan, work, log)
    t = time.perf_counter()
    report["target"], spec, cfg = _target(plan, Path(carry), work)
    report["corpus"], report["training"], report["evaluation"] = {}, {}, {}
    if spec is not None:
        try:
            _train_and_eval(plan, report, spec, cfg, work, end, batches, log, evaluate_heads, run_training)
        except Exception as err:  # the report is still written, with what ran
            report["training"].setdefault("error", error_line(err))
    report["outputs"] = pack_outputs(plan, report, work, out)
    report["summary"] = summary(report, time.perf_counter() - t0, time.perf_counter() - t)
    assert tuple(report) == WINDOW_KEYS, tuple(report)
    _write(out / "gpu-window.json", json.dumps(report, indent=1, default=str))
    _write(out / "gpu-window.md", window_markdown(report))
    log(f"wrote {out}: {report['summary']}")
    return report


def _train_and_eval(plan: WindowPlan, report: dict, spec: str, cfg, work: Path, end: float, batches: BatchesFn,
                    log, evaluate_heads, run_training) -> None:
    t = time.perf_counter()
    report["corpus"], corpus = _corpus(plan, work, cfg.vocab_size)
    target = _build_target(plan, spec, cfg)
    report["corpus"]["self_distill"] = _self_distill(plan, corpus, target, log)
    report["corpus"]["seconds"] = round(time.perf_counter() - t, 1)

    def resolve_init(name: str | None) -> str | None:
        if name is None:
            return None
        if name in {r.name for r in plan.runs}:
            return str(work / "heads" / name)  # an earlier run's head, as stored (int8)
        return str(ROOT / name)

    report["training"] = run_training(plan, target, _draft_vocab(plan),
                                      lambda i: batches(corpus, plan.seq_len, plan.batch, i), work,
                                      end - plan.eval_s, resolve_init, log)
    held = [s for _, s in zip(range(plan.eval_seqs), corpus.sequences(plan.seq_len, split="holdout"))]
    if not held:
        raise ValueError(f"{plan.corpus} holds no held-out sequence of {plan.seq_len} tokens to evaluate on")
    seqs = torch.from_numpy(np.stack(held)).to(plan.device)
    log(f"## evaluation: {seqs.shape[0]} held-out sequences of {plan.seq_len} tokens")
    entries = _eval_entries(plan, report["training"], work, target, cfg, resolve_init)
    t = time.perf_counter()
    report["evaluation"] = {"sequences": int(seqs.shape[0]), "heads": evaluate_heads(
        entries, target, seqs, plan.batch, plan.dtype, end, log)}
    report["evaluation"]["seconds"] = round(time.perf_counter() - t, 1)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
