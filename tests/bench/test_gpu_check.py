"""`make gpu-check-dry` (bench/device_check/ on the CPU, tiny shapes): it passes in the default
suite within a minute and writes both reports with the keys the GPU run writes; `make gpu-check`
and `spd gpu-check` refuse clearly without CUDA; the lossless check fails a run that differs."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from spd_engine.bench.device_check import check_lossless, check_patches, check_run
from spd_engine.bench.device_check.check_plan import REPORT_KEYS, TIMING_KEYS, dry_plan

ROOT = Path(__file__).resolve().parents[2]


def _make(target: str, out: Path) -> subprocess.CompletedProcess:
    # the Makefile's own recipe (a link named spd_engine, run from OUT/.pkg), on this interpreter
    if shutil.which("make") is None or not (ROOT / "Makefile").is_file():
        pytest.skip("needs make and the checkout's Makefile")
    return subprocess.run(["make", "-s", "-C", str(ROOT), target, f"OUT={out}", f"GPU_PY={sys.executable}"],
                          capture_output=True, text=True, timeout=300)


def test_make_gpu_check_dry_writes_both_reports_with_the_gpu_keys(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    proc = _make("gpu-check-dry", tmp_path)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    md = (tmp_path / "gpu-check.md").read_text()
    assert tuple(report) == REPORT_KEYS and tuple(report["timings"]) == TIMING_KEYS
    assert report["mode"].startswith("dry") and report["summary"]["ok"] and report["summary"]["failed"] == 0
    assert wall < 60, f"the dry run took {wall:.0f} s"
    # every lossless case and the sampling checks ran and passed (nothing cut by the time guard)
    cases = report["lossless"]["cases"]
    assert len(cases) == len(dry_plan().lossless) and all(c["status"] == "pass" for c in cases)
    assert all(c["forced_accepted"] > 0 for c in cases)  # accepts happened, not only rejections
    assert report["lossless"]["sampling"]["sampling_twice"]["status"] == "pass"
    assert report["lossless"]["sampling"]["branch_width_2"]["status"].startswith("pass")
    for method in ("pdm", "eagle"):
        r = report["training"][method]
        assert r["status"] == "pass" and r["finite"] and r["falling"] and r["steps"] >= 3
    # the CPU cannot run the kernel nor count device syncs: said, not filled in
    assert report["timings"]["anchor_gather"]["status"].startswith("not run")
    assert report["timings"]["syncs_per_tick"]["per_tick"] is None
    # the timed shape gave a profile that the cost model reads
    (shape,) = dry_plan().timing_shapes
    prof_path = tmp_path / report["timings"]["profiles"][shape][0]
    from spd_engine.costmodel.cost_model import Profile

    prof = Profile.from_dict(json.loads(prof_path.read_text()))
    assert prof.num_layers > 0
    measured_plan = report["timings"]["plans"][shape]["profiles"]["measured"]
    assert measured_plan["tok_s_by_n"] and measured_plan["recommendation"]  # `spd plan` ran on it
    # every figure is labelled with the versions; the not-checked list is there
    env = report["environment"]
    assert f"torch {env['torch']}" in md and "Not checked here" in md and "NCCL" in md
    assert report["not_checked"] and all(isinstance(x, str) for x in report["not_checked"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_make_gpu_check_refuses_without_cuda(tmp_path: Path) -> None:
    proc = _make("gpu-check", tmp_path)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("spd gpu-check:")]
    assert len(lines) == 1 and "no CUDA device" in lines[0], proc.stderr
    assert not (tmp_path / "gpu-check.json").exists()


def test_spd_gpu_check_exits_2_with_one_line_without_cuda(tmp_path: Path, monkeypatch, capsys) -> None:
    from spd_engine.tools.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["gpu-check", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="needs a CUDA device"):
        check_run.run_check(tmp_path, dry=False)


def test_lossless_check_fails_a_run_that_differs(monkeypatch, one_thread) -> None:
    """The comparison can fail: an oracle with other weights (seed 1) than SPD's must not pass."""
    plan = dry_plan()
    case = plan.lossless[0]
    original = check_lossless.case_config

    def other_oracle(case, plan, mode, colocate=False, **kw):
        ecfg = original(case, plan, mode, colocate, **kw)
        return ecfg.replace(seed=1) if mode == "pp" else ecfg

    monkeypatch.setattr(check_lossless, "case_config", other_oracle)
    res = check_lossless.lossless_case(case, plan)
    assert res["status"] == "fail" and not res["bit_equal"] and res["first_difference"] is not None


def test_device_random_weights_give_stages_the_full_models_weights_and_restore_the_builders() -> None:
    import spd_engine.engine.runtime.build as build_mod
    import spd_engine.engine.runtime.roles as roles_mod
    from spd_engine.engine.protocol.topology import Topology
    from spd_engine.engine.runtime.run_config import PRESETS, ModelSpec, ParallelLayout, RunConfig, Runtime

    cfg = PRESETS["tiny-llama"]
    ecfg = RunConfig(model=ModelSpec(source="random:tiny-llama", cfg=cfg),
                     parallel=ParallelLayout(topology=Topology.build(cfg.num_layers, 2)), runtime=Runtime(capacity=64))
    saved = (build_mod.build_stage_model, roles_mod.build_stage_model, roles_mod.build_pdm)
    with check_patches.device_random_weights():
        full = build_mod.build_stage_model(ecfg, range(cfg.num_layers), embedding=True, head=True)
        last = roles_mod.build_stage_model(ecfg, range(3, cfg.num_layers), embedding=False, head=True)
        other = build_mod.build_stage_model(ecfg.replace(seed=1), range(3, cfg.num_layers), embedding=False,
                                            head=True)
        pdm = roles_mod.build_pdm(ecfg)
    assert (build_mod.build_stage_model, roles_mod.build_stage_model, roles_mod.build_pdm) == saved
    want = full.state_dict()
    got = last.state_dict()
    assert got and all(torch.equal(v, want[k]) for k, v in got.items())
    assert not torch.equal(other.state_dict()["output_layer.weight"], got["output_layer.weight"])
    assert all(torch.isfinite(p).all() for p in pdm.parameters())
