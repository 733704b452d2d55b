"""`make gpu-window-dry` (the GPU window on the CPU, tiny shapes): the check, head training under
the time guard and the evaluation in one command, well inside 2 minutes, with OUT packed to what
a GPU host hands back; the guard stops training before the limit and still saves, exports and
reports; the target's carried parts are joined only when every one is there and intact."""
from __future__ import annotations

import dataclasses
import io
import json
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from spd_engine.bench.device_check.window_plan import OUT_MAX_FILE_BYTES, OUT_MAX_FILES, WINDOW_KEYS, dry_window_plan
from spd_engine.bench.device_check.window_target import assemble_target, missing_parts, stage_target

ROOT = Path(__file__).resolve().parents[2]


def _archive(out: Path) -> tarfile.TarFile:
    parts = sorted(out.glob("gpu-window-files.tar.*"))
    return tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts)))


def _heads_load(out: Path, tmp: Path, cfg_name: str, plan) -> None:
    """Every trained head in the archive loads as the engine loads a shipped head."""
    from spd_engine.engine.model.pdm import load_pdm
    from spd_engine.engine.runtime.run_config import random_preset

    dest = tmp / "unpacked"
    _archive(out).extractall(dest, filter="data")
    for run in plan.runs:
        pdm = load_pdm(dest / "heads" / run.name, random_preset(cfg_name), run.stage_layers)
        assert pdm.pcfg.num_layers == run.pdm_layers
        assert json.loads((dest / "heads" / run.name / "train_history.json").read_text())


def _make_window(out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    if shutil.which("make") is None:
        pytest.skip("needs make")
    t0 = time.perf_counter()
    proc = subprocess.run(["make", "-s", "-C", str(ROOT), "gpu-window-dry", f"OUT={out}", f"GPU_PY={sys.executable}",
                           *extra], capture_output=True, text=True, timeout=300)
    return proc, time.perf_counter() - t0


@pytest.mark.slow  # the check's part is tests/bench/test_gpu_check.py's in the default run
def test_make_gpu_window_dry_with_the_check_within_two_minutes(tmp_path: Path) -> None:
    proc, wall = _make_window(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert wall < 120, f"the dry window took {wall:.0f} s"
    report = json.loads((tmp_path / "gpu-window.json").read_text())
    assert report["check"]["status"] == "pass" and report["summary"]["ok"]
    assert "check/gpu-check.json" in _archive(tmp_path).getnames()


def test_make_gpu_window_dry_trains_evaluates_and_packs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc, wall = _make_window(out, "WINDOW_ARGS=--no-check")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert wall < 120, f"the dry window took {wall:.0f} s"
    report = json.loads((out / "gpu-window.json").read_text())
    assert tuple(report) == WINDOW_KEYS and report["mode"].startswith("dry")
    s = report["summary"]
    assert s["ok"] and s["within_budget"] and report["check"]["status"].startswith("not run")
    plan = dry_window_plan()
    assert s["trained"] == [r.name for r in plan.runs] and not s["guard_stopped"]
    for run in plan.runs:
        r = report["training"][run.name]
        assert r["steps"] == plan.max_steps and r["tokens"] == plan.max_steps * plan.batch * plan.seq_len
        assert r["loss_last"] == r["loss_last"] and r["head_bytes"] > 0
        ev = report["evaluation"]["heads"][run.name]
        assert ev["status"] == "measured" and 0 <= ev["agree_trained"] <= 1
        assert set(ev["trained"]) == {str(f) for f in range(1, len(run.stage_layers) + 1)}
    # the run warm-started from the first run's head was scored against that start
    assert report["evaluation"]["heads"]["n2-k1"]["agree_start"] is not None
    assert report["corpus"]["self_distill"]["tokens"] > 0
    # what comes back: few files, each under the limit; nothing else in OUT but the package link
    files = [p for p in out.iterdir() if p.name != ".pkg"]
    assert {p.name for p in files} == {"gpu-window.json", "gpu-window.md", *report["outputs"]["files"]}
    assert len(files) <= OUT_MAX_FILES and all(p.stat().st_size <= OUT_MAX_FILE_BYTES for p in files)
    _heads_load(out, tmp_path, "random:tiny-llama", plan)
    md = (out / "gpu-window.md").read_text()
    assert "| n2-k1 | 2 | 1 | n4-k1 |" in md and "OK:" in md


def test_time_guard_stops_every_run_before_the_limit_and_still_saves(tmp_path: Path, one_thread) -> None:
    from spd_engine.bench.device_check.window_run import run_window
    from spd_engine.tools.train import batches

    # no calibration and no step cap: only the guard can end a run
    plan = dataclasses.replace(dry_window_plan(check=False), budget_s=14.0, calib_steps=10**6, max_steps=10**6,
                               self_distill=0, min_run_s=0.2)
    t0 = time.perf_counter()
    report = run_window(tmp_path / "out", tmp_path / "work", plan, tmp_path / "no-carry", batches, lambda m: None,
                        t0=t0)
    wall = time.perf_counter() - t0
    s = report["summary"]
    assert s["ok"] and wall < plan.budget_s, (wall, s)
    started = [n for n, r in report["training"].items() if r["status"] != "skipped (time budget)"]
    assert started and s["guard_stopped"] == started
    for name in started:
        r = report["training"][name]
        assert r["stopped_by"] == "guard" and r["steps"] >= 1 and r["head_bytes"] > 0
    assert report["outputs"]["files"] and (tmp_path / "out" / "gpu-window.md").is_file()


def test_target_parts_join_only_when_all_are_there_and_intact(tmp_path: Path) -> None:
    src = tmp_path / "model.gguf"
    src.write_bytes(bytes(range(256)) * 9000)  # 2.2 MiB
    carry = tmp_path / "carry"
    manifest = stage_target(src, carry, part_mib=1.0)
    assert [p["name"] for p in manifest["parts"]] == ["target.part00", "target.part01", "target.part02"]
    assert all((carry / p["name"]).stat().st_size <= 2**20 for p in manifest["parts"])
    (carry / "target.part01").rename(tmp_path / "held-back")
    assert missing_parts(carry) == ["target.part01"]
    with pytest.raises(ValueError, match="target.part01"):
        assemble_target(carry, tmp_path / "work")
    data = bytearray((tmp_path / "held-back").read_bytes())
    data[7] ^= 1
    (carry / "target.part01").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        assemble_target(carry, tmp_path / "work")
    (carry / "target.part01").write_bytes((tmp_path / "held-back").read_bytes())
    assert assemble_target(carry, tmp_path / "work").read_bytes() == src.read_bytes()


def test_window_without_a_staged_target_reports_why_and_trains_nothing(tmp_path: Path) -> None:
    from spd_engine.bench.device_check.window_run import _target

    plan = dataclasses.replace(dry_window_plan(check=False), model="staged")
    entry, spec, cfg = _target(plan, tmp_path / "empty", tmp_path / "work")
    assert entry["status"] == "error" and "gpu-window-stage" in entry["error"] and spec is None


@pytest.mark.slow
def test_window_plan_on_the_real_staged_target_on_the_cpu(tmp_path: Path, smollm2_gguf, one_thread) -> None:
    """The GPU plan itself at tiny batches on the CPU: the staged GGUF joined and converted, the
    shipped n = 4 head continued (same target fingerprint, draft vocabulary, anchors), n = 2 and
    n = 8 warm-started from it, the deeper head from the target's layers; every head scored and packed."""
    from spd_engine.bench.device_check.window_plan import gpu_window_plan
    from spd_engine.bench.device_check.window_run import run_window
    from spd_engine.tools.train import batches

    carry = tmp_path / "carry"
    stage_target(Path(smollm2_gguf), carry, part_mib=20.0)
    plan = dataclasses.replace(gpu_window_plan(device="cpu", check=False), budget_s=1800.0, batch=2, seq_len=32,
                               max_steps=2, calib_steps=10**6, eval_seqs=1, eval_s=300.0, margin_s=10.0)
    report = run_window(tmp_path / "out", tmp_path / "work", plan, carry, batches, lambda m: None)
    assert report["summary"]["ok"], report["summary"]
    assert report["summary"]["trained"] == [r.name for r in plan.runs]
    heads = report["evaluation"]["heads"]
    assert all(heads[r.name]["status"] == "measured" for r in plan.runs)
    # warm-started heads start where the shipped head is: well above an untrained head
    assert heads["n4-k2"]["agree_start"] > 0.2 and heads["n4-k4"]["agree_start"] is None
    assert not report["outputs"]["left_out"] and len(report["outputs"]["files"]) <= OUT_MAX_FILES - 2


def test_a_check_that_overruns_is_killed_and_the_window_goes_on(tmp_path: Path) -> None:
    from spd_engine.bench.device_check.window_run import _check

    plan = dataclasses.replace(dry_window_plan(), check_budget_s=0.1, check_overrun_s=0.5)
    t0 = time.perf_counter()
    entry = _check(plan, tmp_path, lambda m: None)
    assert entry["status"] == "error" and entry["error"].startswith("killed after")
    assert time.perf_counter() - t0 < 5


def test_runs_fit_their_step_counts_to_their_share(tmp_path: Path, one_thread) -> None:
    from spd_engine.bench.device_check.window_run import run_window
    from spd_engine.tools.train import batches

    # no step cap: each run's step count comes from its own timing
    plan = dataclasses.replace(dry_window_plan(check=False), budget_s=16.0, max_steps=10**6, calib_steps=4,
                               self_distill=0, min_run_s=0.2)
    t0 = time.perf_counter()
    report = run_window(tmp_path / "out", tmp_path / "work", plan, tmp_path / "no-carry", batches, lambda m: None,
                        t0=t0)
    assert report["summary"]["ok"] and time.perf_counter() - t0 < plan.budget_s
    ran = {n: r for n, r in report["training"].items() if r["status"] == "pass"}
    assert ran
    for r in ran.values():
        assert r["calibrated_steps"] is not None and plan.calib_steps <= r["calibrated_steps"] < 10**6
        assert r["steps"] == r["calibrated_steps"] if r["stopped_by"] == "plan" else r["stopped_by"] == "guard"


def test_outputs_leave_out_whole_heads_past_the_size_limit(tmp_path: Path, monkeypatch) -> None:
    from spd_engine.bench.device_check import window_outputs

    plan = dry_window_plan()
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    for i, run in enumerate(plan.runs):  # heads of 1, 2, 3 MiB
        head = work / "heads" / run.name
        head.mkdir(parents=True)
        (head / "pdm.json").write_text("{}")
        (head / "pdm.safetensors.zlib").write_bytes(b"\1" * ((i + 1) << 20))
    report = {"training": {r.name: {"status": "pass"} for r in plan.runs}}
    monkeypatch.setattr(window_outputs, "OUT_MAX_FILE_BYTES", 2 << 20)
    monkeypatch.setattr(window_outputs, "OUT_MAX_BYTES", 6 << 20)
    monkeypatch.setattr(window_outputs, "REPORT_ROOM", 1 << 20)
    got = window_outputs.pack_outputs(plan, report, work, out)
    # 5 MiB of room: the first two heads (3 MiB) go in, the third (3 MiB more) is left out whole
    assert got["left_out"] == [plan.runs[2].name]
    assert all(not m.startswith(f"heads/{plan.runs[2].name}/") for m in got["members"])
    assert got["files"] == ["gpu-window-files.tar.00", "gpu-window-files.tar.01"]
    assert all((out / f).stat().st_size <= 2 << 20 for f in got["files"])
    names = _archive(out).getnames()
    assert f"heads/{plan.runs[1].name}/pdm.safetensors.zlib" in names


def test_make_gpu_window_refuses_without_cuda(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    if shutil.which("make") is None:
        pytest.skip("needs make")
    proc = subprocess.run(["make", "-s", "-C", str(ROOT), "gpu-window", f"OUT={tmp_path}", f"GPU_PY={sys.executable}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no CUDA device is available" in proc.stderr
    assert not (tmp_path / "gpu-window.json").exists()
