"""The training section: a few bf16 steps of `spd train` (PDM) and `spd train --method eagle` on a
synthetic corpus (no tokenizer files, no network on a GPU host): losses finite and falling."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from spd_engine.bench.device_check.check_env import error_line
from spd_engine.bench.device_check.check_plan import CheckPlan, Deadline


class _SyntheticTokenizer:
    """Text -> ids folded into the model's vocabulary, for a synthetic corpus (no tokenizer files,
    no network on the GPU host): what `spd train` needs of a corpus is token ids."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size, self.eos_ids, self.special_ids = vocab_size, (2,), frozenset({0, 1, 2})
        self.fingerprint = f"synthetic-bytes-{vocab_size}"

    def encode(self, text: str) -> list[int]:
        return [3 + (b * 131 + i) % (self.vocab_size - 3) for i, b in enumerate(text.encode())]

    def chat_ids(self, text: str) -> list[int]:
        return [1] + self.encode(text) + [2]

    def conversation_ids(self, messages: list[dict]) -> list[int]:
        return [i for m in messages for i in self.chat_ids(m["content"])]


def synthetic_corpus(out: Path, vocab_size: int, holdout: float = 0.0, prompts: int = 0) -> Path:
    """64 synthetic texts (and `prompts` short prompts, for self-distillation), `holdout` of them held out."""
    from spd_engine.train.corpus import BuildOptions, build_corpus
    from spd_engine.train.decontaminate import Decontaminator

    tok = _SyntheticTokenizer(vocab_size)
    texts = [{"source": "synthetic", "licence": "CC0-1.0", "kind": "text",
              "text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 12} for i in range(64)]
    asks = [{"source": "synthetic-prompts", "licence": "CC0-1.0", "kind": "prompt",
             "text": f"what is f{i}(3)?"} for i in range(prompts)]
    build_corpus(out, [texts, asks], tok, Decontaminator(tok.encode),
                 BuildOptions(holdout_fraction=holdout, build_command="spd gpu-check"))
    return out


def train_run(method: str, plan: CheckPlan, work: Path, budget_s: float,
              spd_main: Callable[[list[str]], int] | None = None) -> dict:
    """A few steps of `spd train` in this process (bf16 autocast and target on CUDA; on the CPU
    fp32, which is what the CPU supports fast), from history.json: losses, tokens per second."""
    from spd_engine.engine.runtime.run_config import random_preset

    cfg = random_preset(plan.train_model)
    corpus = work / "corpus"
    if not (corpus / "manifest.json").exists():
        synthetic_corpus(corpus, cfg.vocab_size)
    out = work / f"run-{method}"
    dtype = "bfloat16" if plan.device.startswith("cuda") else "float32"
    n = 4 if cfg.num_layers >= 4 else 2
    # one fill only (the full pipeline): the losses of successive steps are then comparable
    split = ["--stages", str(n), "--fill-weights", ",".join(["0"] * (n - 1) + ["1"])] if method == "pdm" else []
    argv = ["train", "--model", plan.train_model, "--method", method, "--corpus", str(corpus), "--out", str(out),
            *split, "--seq-len", str(plan.train_seq), "--batch", str(plan.train_batch), "--steps",
            str(plan.train_steps), "--save-every", str(plan.train_steps), "--autocast", dtype, "--target-dtype",
            dtype, "--device", plan.device, "--lr", "3e-3"]
    t0 = time.perf_counter()
    if spd_main is not None:  # `spd` itself in this process (tools/gpu_check.py passes it)
        rc, err_tail = spd_main(argv), []
    else:  # the command in a child process that imports spd_engine as this one does (the package
        # layering keeps bench from importing tools)
        from spd_engine.engine.runtime.launch import spd_command

        env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.getcwd() if p == "" else p for p in sys.path))
        proc = subprocess.run([*spd_command(), *argv], capture_output=True,
                              text=True, env=env, timeout=max(30.0, budget_s))
        rc, err_tail = proc.returncode, proc.stderr.strip().splitlines()[-3:]
    seconds = time.perf_counter() - t0
    hist = json.loads((out / "history.json").read_text()) if (out / "history.json").exists() else []
    losses = [h["loss"] for h in hist]
    finite = bool(losses) and all(isinstance(x, float) and x == x and abs(x) != float("inf") for x in losses)
    third = max(1, len(losses) // 3)
    falling = finite and len(losses) >= 2 and statistics.mean(losses[-third:]) < statistics.mean(losses[:third])
    tokens = hist[-1].get("tokens", 0) if hist else 0
    return {"status": "pass" if rc == 0 and finite and falling else "fail", "rc": rc, "dtype": dtype,
            "stderr_tail": err_tail if rc else [],
            "steps": len(losses), "losses": losses, "finite": finite, "falling": falling, "tokens": tokens,
            "seconds": round(seconds, 2), "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "command": "spd " + " ".join(argv[:1] + [a if "/" not in a else Path(a).name for a in argv[1:]])}


def run_training(plan: CheckPlan, work: Path, dl: Deadline, log: Callable[[str], None],
                 spd_main: Callable[[list[str]], int] | None = None) -> dict:
    out = {}
    for method in ("pdm", "eagle"):
        if dl.left() <= 0:
            out[method] = {"status": "skipped (time budget)"}
            continue
        try:
            out[method] = train_run(method, plan, work, dl.left(), spd_main)
        except Exception as err:  # reported, the other method still runs
            out[method] = {"status": "error", "error": error_line(err)}
        log(f"  train {method}: {out[method]['status']}")
    return out
