"""Head training inside a GPU window: the project's PDM trainer (train/distill.py) under a time guard.

A run times its first steps, then fixes its step count to what fits its share of the window (so
its learning-rate schedule ends where the run does); the guard, checked after every step, ends a
run that would overrun: its step count becomes the current step, so the trainer saves and exports
as at a planned end. Each run's head is then stored as int8 rows, zlib-compressed (the form
heads ship in, engine/model/pdm_quant.py), with its training history.
"""
from __future__ import annotations

import json
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from spd_engine.bench.device_check.check_env import error_line, free
from spd_engine.bench.device_check.window_plan import HeadRun, WindowPlan
from spd_engine.train.distill import TrainConfig, Trainer


class GuardedTrainer(Trainer):
    """The PDM trainer whose step count is calibrated to a deadline and cut short by it.

    The step count is fixed at step `calib` from the steps timed after `warm`, and refitted at
    twice that step, four times, ...: steps differ by fill, so early timings are refined, each
    refit moving the schedule's end a little rather than leaving time unused or overrunning."""

    def __init__(self, *args, deadline: float, calib: tuple[int, int], **kwargs) -> None:
        assert calib[1] > calib[0] >= 1, calib
        self.deadline, (self.warm_steps, self.calib_steps) = deadline, calib
        self.stopped_by, self.calibrated_steps, self._t_warm = "plan", None, time.perf_counter()
        self._next_fit = calib[1]
        super().__init__(*args, **kwargs)
        self.max_steps = self.cfg.steps

    def _save_due(self) -> bool:
        now = time.perf_counter()
        if self.step == self.warm_steps:
            self._t_warm = now  # the first steps (allocation, autotuning) are not timed
        elif self.step == self._next_fit and self.step < self.cfg.steps:
            per_step = (now - self._t_warm) / (self.step - self.warm_steps)
            fit = int(max(0.0, self.deadline - now) / per_step)
            self.cfg.steps = self.calibrated_steps = max(self.step, min(self.max_steps, self.step + fit))
            self._next_fit *= 2
        if now >= self.deadline and self.step < self.cfg.steps:
            self.cfg.steps, self.stopped_by = self.step, "guard"  # the loop ends here, after this save
        return super()._save_due()


def train_config(plan: WindowPlan, run: HeadRun, out: Path, init_head: str | None) -> TrainConfig:
    return TrainConfig(out=str(out), stage_layers=run.stage_layers, anchors=run.anchors, pdm_layers=run.pdm_layers,
                       seq_len=plan.seq_len, batch=plan.batch, steps=plan.max_steps, lr=run.lr,
                       target_dtype=plan.dtype, device=plan.device, seed=0, save_every=plan.max_steps,
                       autocast=plan.dtype, fill_weights=run.fill_weights, schedule="cosine",
                       init_head=init_head, warmup=min(30, max(1, plan.max_steps // 10)))


def train_head(plan: WindowPlan, run: HeadRun, target, draft_vocab: tuple[int, ...] | None,
               batches: Iterator[torch.Tensor], work: Path, deadline: float, init_head: str | None,
               log: Callable[[str], None]) -> dict:
    """One guarded run; its head stored as int8 + zlib in work/heads/<name>. Returns its record."""
    from spd_engine.engine.model.pdm_quant import convert_head

    out = work / "runs" / run.name
    if out.exists():  # a fresh run: the trainer would resume an old state.pt
        shutil.rmtree(out)
    cfg = train_config(plan, run, out, init_head)
    t0 = time.perf_counter()
    trainer = GuardedTrainer(target, cfg, batches, draft_vocab, log=log, deadline=deadline,
                             calib=(plan.warm_steps, plan.calib_steps))
    trainer.run()
    seconds = time.perf_counter() - t0
    head = work / "heads" / run.name
    if head.exists():
        shutil.rmtree(head)
    convert_head(out / "pdm", head, torch.int8, compress=True)
    shutil.copyfile(out / "history.json", head / "train_history.json")
    hist = trainer.history
    losses = [h["loss"] for h in hist]
    tail = hist[-max(1, len(hist) // 5):]
    by_fill: dict[int, list[float]] = {}
    for h in tail:
        by_fill.setdefault(h["fill"], []).append(h["agree"])
    tokens, stopped_by, calibrated = trainer.tokens_seen(), trainer.stopped_by, trainer.calibrated_steps
    del trainer
    free(torch.device(plan.device))
    return {"status": "pass" if losses and all(x == x for x in losses) else "fail",
            "stage_layers": list(run.stage_layers), "anchors": list(run.anchors) if run.anchors else None,
            "pdm_layers": run.pdm_layers, "init_head": run.init_head, "lr": run.lr, "steps": len(hist),
            "calibrated_steps": calibrated, "stopped_by": stopped_by,
            "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
            "loss_first": statistics.mean(losses[:10]) if losses else None,
            "loss_last": statistics.mean(losses[-10:]) if losses else None,
            "agree_last_by_fill": {f: round(statistics.mean(v), 4) for f, v in sorted(by_fill.items())},
            "head": str(head), "head_bytes": sum(f.stat().st_size for f in head.iterdir())}


def run_training(plan: WindowPlan, target, draft_vocab: tuple[int, ...] | None, batch_stream: Callable[[int], Iterator],
                 work: Path, train_end: float, resolve_init: Callable[[str | None], str | None],
                 log: Callable[[str], None]) -> dict:
    """Every planned run in order, each with its share of the time left before `train_end`
    (perf_counter seconds); a run with less than `min_run_s` left is skipped."""
    from spd_engine.bench.device_check.window_plan import run_budget

    results: dict[str, dict] = {}
    for i, run in enumerate(plan.runs):
        left = train_end - time.perf_counter()
        if left < plan.min_run_s:
            results[run.name] = {"status": "skipped (time budget)", "seconds_left": round(left, 1)}
            log(f"  {run.name}: skipped, {left:.0f} s left")
            continue
        budget = run_budget(run.share, sum(r.share for r in plan.runs[i + 1:]), left)
        log(f"## train {run.name}: n={len(run.stage_layers)} K={run.pdm_layers}, {budget:.0f} s")
        try:
            init = resolve_init(run.init_head)
            results[run.name] = train_head(plan, run, target, draft_vocab, batch_stream(i), work,
                                           min(train_end, time.perf_counter() + budget), init, log)
        except Exception as err:  # reported; the next run still gets its time
            results[run.name] = {"status": "error", "error": error_line(err)}
        shown = {k: results[run.name].get(k) for k in ("status", "steps", "tokens", "seconds", "stopped_by")}
        log(f"  {run.name}: {json.dumps(shown)}")
    return results
