"""The whole check (`spd gpu-check`, `make gpu-check`): the sections in order under one time
guard, then OUT/gpu-check.json and OUT/gpu-check.md."""
from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from spd_engine.bench.device_check.check_env import environment, label
from spd_engine.bench.device_check.check_lossless import run_lossless
from spd_engine.bench.device_check.check_plan import NOT_CHECKED, REPORT_KEYS, SCHEMA, Deadline, dry_plan, gpu_plan
from spd_engine.bench.device_check.check_report import markdown, summary
from spd_engine.bench.device_check.check_timings import run_timings
from spd_engine.bench.device_check.check_training import run_training


def run_check(out_dir: str | Path, dry: bool, log: Callable[[str], None] = print, device: str = "cuda",
              spd_main: Callable[[list[str]], int] | None = None, budget_s: float | None = None) -> dict:
    """The whole check; writes OUT/gpu-check.json and OUT/gpu-check.md; returns the report.
    `spd_main`: the `spd` command's main, to run `spd train` in this process (else a child).
    `budget_s`: the time guard's budget in place of the plan's (a GPU window's shorter check)."""
    if not dry:
        if not torch.cuda.is_available():
            raise ValueError("gpu-check needs a CUDA device and torch with CUDA; none is available here "
                             "(`make gpu-check-dry` runs the same checks on the CPU)")
    plan = dry_plan() if dry else gpu_plan(device)
    if budget_s is not None:
        plan = dataclasses.replace(plan, budget_s=budget_s)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dl = Deadline(plan.budget_s)
    env = environment(plan.device)
    log(f"# spd gpu-check{' --dry' if dry else ''}: {label(env)}")
    if not dry:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in the lossless and timing figures
    threads = torch.get_num_threads()
    if dry:
        torch.set_num_threads(1)  # the default test suite runs beside other work
    report: dict = {"schema": SCHEMA, "mode": "dry (cpu, tiny shapes)" if dry else "gpu",
                    "environment": env, "plan": dataclasses.asdict(plan)}
    shares = dict(plan.shares)
    work = out / "work"
    if work.exists():  # a previous run's corpus and train runs: `spd train` would resume them
        shutil.rmtree(work)
    try:
        dl.start_section(shares["lossless"] * plan.budget_s)
        log("## lossless")
        report["lossless"] = run_lossless(plan, dl, log)
        dl.start_section(shares["timings"] * plan.budget_s)
        log("## timings")
        report["timings"] = run_timings(plan, env, out, dl, log)
        dl.start_section(max(shares["training"] * plan.budget_s, plan.budget_s - dl.elapsed()))
        log("## training")
        report["training"] = run_training(plan, work, dl, log, spd_main)
    finally:
        torch.set_num_threads(threads)
    report["not_checked"] = list(NOT_CHECKED)
    report["summary"] = summary(report)
    report["summary"]["seconds"] = round(dl.elapsed(), 1)
    assert tuple(report) == REPORT_KEYS, tuple(report)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu-check.md").write_text(markdown(report))
    log(f"wrote {out}/gpu-check.json and {out}/gpu-check.md: {report['summary']}")
    return report
