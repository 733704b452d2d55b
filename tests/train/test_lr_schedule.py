"""Training schedules (train/lr_schedule.py) and extending a wsd run without restarting its decay."""
from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_distill import params, stream, target, tcfg

from spd_engine.train.distill import Trainer
from spd_engine.train.lr_schedule import decay_start, draw_fill, schedule_lr

pytestmark = pytest.mark.pure  # the fast tier: logic only, no process, no model file


def test_wsd_is_flat_then_decays_to_a_tenth():
    lrs = [schedule_lr(s, 1.0, 100, 10, "wsd", 0.2) for s in range(100)]
    assert lrs[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert set(lrs[10:80]) == {1.0} and decay_start(100, 10, 0.2) == 80
    assert all(a > b for a, b in zip(lrs[80:], lrs[81:])) and lrs[-1] == pytest.approx(0.1 + 0.9 / 20)
    cos = [schedule_lr(s, 1.0, 100, 10) for s in range(100)]
    assert cos[10] == pytest.approx(1.0) and all(a >= b for a, b in zip(cos[10:], cos[11:]))


def test_fill_weights_draw_as_given():
    rng = random.Random(0)
    counts = Counter(draw_fill(4, 0.5, rng, (0.6, 0.2, 0.0, 0.2)) for _ in range(20000))
    assert counts[3] == 0 and abs(counts[1] / 20000 - 0.6) < 0.02 and abs(counts[4] / 20000 - 0.2) < 0.02
    rng = random.Random(1)
    default = Counter(draw_fill(4, 0.5, rng) for _ in range(20000))
    assert abs(default[4] / 20000 - 0.5) < 0.02
    with pytest.raises(ValueError, match="fill weights"):
        tcfg(Path("x"), fill_weights=(1.0,))  # n = 2 needs two weights


def test_a_wsd_run_extends_from_where_its_decay_began(tmp_path: Path):
    kw = dict(schedule="wsd", decay_frac=0.5, warmup=1, save_every=100)
    short = Trainer(target(), tcfg(tmp_path / "run", steps=6, **kw), stream(), log=lambda m: None)
    short.run()  # decays over steps 3..5; stable.pt holds step 3
    assert (tmp_path / "run" / "stable.pt").is_file()
    logs: list[str] = []
    longer = Trainer(target(), tcfg(tmp_path / "run", steps=10, **kw), stream(), log=logs.append)
    assert longer.step == 3 and any("back to step 3" in m for m in logs)
    longer.run()
    straight = Trainer(target(), tcfg(tmp_path / "straight", steps=10, **kw), stream(), log=lambda m: None)
    straight.run()  # the same 10-step run without the detour
    want, got = params(straight), params(longer)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert [h["loss"] for h in longer.history] == [h["loss"] for h in straight.history]


def test_schedule_changes_are_refused(tmp_path: Path):
    Trainer(target(), tcfg(tmp_path / "cos", steps=3), stream(), log=lambda m: None).run()
    with pytest.raises(ValueError, match="cosine run of 3 steps"):
        Trainer(target(), tcfg(tmp_path / "cos", steps=5), stream(), log=lambda m: None)
    with pytest.raises(ValueError, match="resume it with --schedule cosine"):
        Trainer(target(), tcfg(tmp_path / "cos", steps=3, schedule="wsd"), stream(), log=lambda m: None)
    with pytest.raises(ValueError, match="schedule must be"):
        tcfg(tmp_path, schedule="linear")
