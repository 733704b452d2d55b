"""The training loop that the PDM trainer (train/distill.py) and the EAGLE head trainer
(train/eagle.py) share: run directory, AdamW, the learning-rate schedule, one optimizer step
with data-parallel gradient averaging, logging cadence, atomic `state.pt` writes, the exported
head directory with its snapshots, and the replay of the data stream on resume.

A trainer builds its head, sets `self.model` to it and `self.opt` from `_optimizer`, and keeps its
own loss, state dict and history records (fills, the training-time test) in its own file.
"""
from __future__ import annotations

import json
import pickle
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from spd_engine.engine.model.model import StageModel
from spd_engine.engine.runtime.progress import Progress
from spd_engine.train.data_parallel import DataParallel
from spd_engine.train.lr_schedule import schedule_lr

LOG_EVERY = 10  # steps between log lines (and the last step)


def load_state(path: Path) -> dict:
    """A run's saved state (state.pt, stable.pt) with torch's `weights_only` loader: tensors and plain
    data only, so a file planted in the run directory cannot run code (ValueError instead)."""
    try:
        st = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        first = str(err).strip().splitlines()
        raise ValueError(f"{path} is not a training state this trainer wrote (it holds more than tensors and "
                         f"plain data, or is damaged): {first[0] if first else type(err).__name__}") from None
    if not isinstance(st, dict):
        raise ValueError(f"{path} holds a {type(st).__name__}, not a training state")
    return st


class LoopConfig(Protocol):
    """The fields of a training config (TrainConfig, EagleTrainConfig) that the loop reads."""
    out: str
    seq_len: int
    batch: int
    steps: int
    lr: float
    warmup: int
    grad_clip: float
    seed: int
    save_every: int
    keep_every: int
    export_dtype: str
    autocast: str


def check_loop_config(cfg: LoopConfig, min_seq_len: int) -> None:
    """ValueError for bad values of the loop fields both training configs have."""
    if cfg.seq_len < min_seq_len or cfg.batch < 1 or cfg.steps < 1 or cfg.lr <= 0:
        raise ValueError(f"seq_len >= {min_seq_len}, batch >= 1, steps >= 1 and lr > 0 are required")
    if cfg.autocast not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"autocast must be bfloat16, float16 or float32, got {cfg.autocast!r}")
    if cfg.keep_every < 0 or cfg.save_every < 1:
        raise ValueError("save_every >= 1 and keep_every >= 0 are required")


def lr_at(step: int, cfg: LoopConfig) -> float:
    """Linear warmup, then the run's schedule (train/lr_schedule.py; cosine unless the config says)."""
    return schedule_lr(step, cfg.lr, cfg.steps, cfg.warmup, getattr(cfg, "schedule", "cosine"),
                       getattr(cfg, "decay_frac", 0.2))


class HeadTrainer:
    """Base of a head trainer (train/distill.py's Trainer, train/eagle.py's EagleTrainer)."""

    STATE_KEY: str  # the head's state dict in state.pt
    model: nn.Module
    opt: torch.optim.Optimizer

    def __init__(self, target: StageModel, cfg: LoopConfig, batches: Iterator[torch.Tensor], log: Callable[[str], object],
                 dp: DataParallel) -> None:
        """`batches` is this rank's own stream (DataParallel.shard); only the main rank logs and saves."""
        self.target, self.cfg, self.batches, self.dp = target, cfg, batches, dp
        self.log = log if dp.is_main else (lambda msg: None)
        self.out = Path(cfg.out)
        if dp.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)  # before the head is built: its initialisation draws from it
        self.step = 0
        self.history: list[dict] = []
        self._bar: Progress | None = None  # set while run() steps
        self._bar_start = (0.0, 0)

    def _optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """AdamW over the trainable parameters (the frozen final norm is left out)."""
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)

    # ---- one step ----
    def _set_lr(self) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, self.cfg)

    def _apply(self, loss: torch.Tensor) -> None:
        """Backward, average the gradients over the ranks, clip, step."""
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.dp.average_gradients(self.model.parameters())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step += 1

    def tokens_seen(self) -> int:
        return self.history[-1]["tokens"] if self.history else 0

    def _log_due(self) -> bool:
        return self.step % LOG_EVERY == 0 or self.step == self.cfg.steps

    def _log_step(self, loss: float, top1: str, tokens_seen: int, t0: float) -> None:
        msg = (f"step {self.step}/{self.cfg.steps} loss {loss:.3f} top1 {top1} "
               f"tokens {tokens_seen / 1e6:.3f}M {time.time() - t0:.0f}s")
        if self._bar is not None:
            self._bar.line(msg)  # plain mode prints it; a terminal's bar shows the same figures
        else:
            self.log(msg)

    def _progress(self) -> Progress:
        """The run's bar over its steps, from the step it resumes at (plain step lines off a terminal)."""
        self._bar = Progress(self.cfg.steps, "spd train", self.log, unit="step", initial=self.step,
                             enabled=self.dp.is_main)
        self._bar_start = (time.time(), self.tokens_seen())
        return self._bar

    def _advance(self, loss: float, tokens_seen: int) -> None:
        """One step on the bar: the step's loss and the tokens per second since the run (re)started."""
        if self._bar is None or not self._bar.is_bar:
            return
        t_start, tokens_start = self._bar_start
        rate = (tokens_seen - tokens_start) / max(time.time() - t_start, 1e-9)
        self._bar.update(1, f"loss {loss:.3f}, {rate:,.0f} tok/s, {tokens_seen / 1e6:.3f}M tokens")

    def _end_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar = None

    def _save_due(self) -> bool:
        cfg = self.cfg
        return self.dp.is_main and (self.step % cfg.save_every == 0 or self.step == cfg.steps or
                                    self.step == self._stable_step() or
                                    bool(cfg.keep_every and self.step % cfg.keep_every == 0))

    def _stable_step(self) -> int | None:
        """The step whose state is also kept as stable.pt; None: no such step (the default)."""
        return None

    # ---- files ----
    def _resume(self) -> None:
        """Continue the run from its state.pt, when the run directory has one."""
        path = self.out / "state.pt"
        if not path.is_file():
            return
        st = self._resume_state(load_state(path), path)
        self.model.load_state_dict(st[self.STATE_KEY])
        self.opt.load_state_dict(st["opt"])
        self._restore(st)
        self.step, self.history = st["step"], st["history"]
        for _ in range(self.step):  # replay the data stream to where the run stopped
            next(self.batches)
        self.log(f"resumed from step {self.step}")

    def _resume_state(self, st: dict, path: Path) -> dict:
        """The state to resume from, given the saved `st` (ValueError where it is another run's)."""
        raise NotImplementedError

    def _restore(self, st: dict) -> None:
        """Restore what else a trainer keeps in state.pt (the head, optimizer, step and history are
        restored already); nothing by default."""

    def _write_state(self, st: dict, name: str = "state.pt") -> None:
        """torch.save through a temporary file, so a run stopped mid-write keeps its last state."""
        tmp = self.out / f"{name}.tmp"
        torch.save(st, tmp)
        tmp.replace(self.out / name)

    def _export(self, save: Callable[..., Path], dirname: str, cfg: dict) -> None:
        """The head as `dirname/` (and, every keep_every steps, under snapshots/) + history.json."""
        extra = {"train": {"step": self.step, "tokens": self.tokens_seen(), "config": cfg}}
        dtype = getattr(torch, self.cfg.export_dtype)
        save(self.model, self.out / dirname, extra=extra, dtype=dtype)
        if self.cfg.keep_every and self.step % self.cfg.keep_every == 0:  # for acceptance-vs-tokens curves
            save(self.model, self.out / "snapshots" / f"step-{self.step:06d}", extra=extra, dtype=dtype)
        (self.out / "history.json").write_text(json.dumps(self.history, indent=1))
