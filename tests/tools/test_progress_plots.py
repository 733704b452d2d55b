"""Progress bars on a terminal and plain lines elsewhere (engine/runtime/progress.py); the PNGs of
`spd train --plot` and `spd eval --plot` (bench/plot.py), read back as images."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from spd_engine.engine.runtime.progress import Progress
from spd_engine.train.eval_records import Summary

mpl_image = pytest.importorskip("matplotlib.image")


def check_png(path: Path) -> tuple[int, int]:
    """The PNG opens, has pixels, and is not one flat colour."""
    assert path.stat().st_size > 0
    img = mpl_image.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    assert float(img[..., :3].std()) > 0.01  # something was drawn
    return img.shape[0], img.shape[1]


def test_progress_plain_lines_off_a_terminal() -> None:
    logged: list[str] = []
    stream = io.StringIO()
    with Progress(3, "job", logged.append, unit="prompt", tty=False, stream=stream) as bar:
        assert not bar.is_bar
        for k in range(3):
            bar.line(f"[{k + 1}/3] done")
            bar.update(1, "alpha 0.5")
        bar.write("FAIL: one")
    assert logged == ["[1/3] done", "[2/3] done", "[3/3] done", "FAIL: one"]
    assert stream.getvalue() == ""


def test_progress_bar_with_rate_and_eta_on_a_terminal() -> None:
    logged: list[str] = []
    stream = io.StringIO()
    with Progress(5, "spd eval", logged.append, unit="prompt", tty=True, stream=stream) as bar:
        assert bar.is_bar
        for _ in range(3):
            bar.line("a per-prompt line the bar replaces")
            bar.update(1, "alpha 0.512")
        bar.write("FAIL: kept above the bar")
    out = stream.getvalue()
    assert logged == []
    assert "spd eval" in out and "3/5" in out and "alpha 0.512" in out
    assert "prompt/s" in out or "s/prompt" in out  # the rate
    assert "<" in out  # tqdm's "elapsed<remaining": the ETA
    assert "FAIL: kept above the bar" in out


def test_progress_disabled_shows_nothing() -> None:
    logged: list[str] = []
    with Progress(2, "job", logged.append, tty=True, enabled=False) as bar:
        bar.line("x")
        bar.write("y")
        bar.update(1)
    assert logged == []


def test_plot_training_png(tmp_path: Path) -> None:
    from spd_engine.bench.plot import plot_training

    pdm = [{"step": s, "fill": 1 + s % 3, "loss": 6.0 / (1 + 0.05 * s), "agree": min(0.9, 0.1 + 0.01 * s),
            "tokens": 512 * s} for s in range(1, 121)]
    check_png_at = tmp_path / "pdm.png"
    plot_training(pdm, str(check_png_at))
    h, w = check_png(check_png_at)
    assert w > h  # loss and acceptance side by side
    eagle = [{"step": s, "loss": 3.0 / s, "agree": [0.5, 0.3, 0.2], "tokens": 64 * s} for s in range(1, 30)]
    plot_training(eagle, str(tmp_path / "eagle.png"))
    check_png(tmp_path / "eagle.png")
    with pytest.raises(ValueError):
        plot_training([], str(tmp_path / "empty.png"))


def synthetic_report() -> dict:
    def summary(scale: float) -> dict:
        return Summary(n=4, prompts=3, tokens=300, ticks=200, verified=180, accepted=int(120 * scale),
                       by_fill={1: [30, int(12 * scale)], 2: [30, int(15 * scale)], 3: [40, int(24 * scale)],
                                4: [80, int(60 * scale)]},
                       by_source={"pdm": [150, int(110 * scale)], "suffix": [30, int(10 * scale)]}).to_json()

    return {"n": 4, "spec": "heads/demo", "datasets": {"mt_bench": summary(0.8), "gsm8k": summary(1.0)},
            "overall": summary(0.9)}


def test_plot_eval_png(tmp_path: Path) -> None:
    from spd_engine.bench.plot import plot_eval

    plot_eval(synthetic_report(), str(tmp_path / "eval.png"))
    h, w = check_png(tmp_path / "eval.png")
    assert w > 2 * h  # three panels in a row


TRAIN_ARGS = ["--model", "random:tiny-llama", "--stages", "2", "--seq-len", "16", "--batch", "2",
              "--steps", "3", "--save-every", "3", "--threads", "1", "--autocast", "float32"]


def test_cli_train_and_eval_plots(tmp_path: Path, capsys) -> None:
    from test_corpus import build
    from test_distill import ModTokenizer

    from spd_engine.tools.cli import main

    corpus_dir, _ = build(tmp_path, tok=ModTokenizer())
    out = tmp_path / "run"
    rc = main(["train", *TRAIN_ARGS, "--corpus", str(corpus_dir), "--out", str(out),
               "--plot", str(tmp_path / "train.png")])
    captured = capsys.readouterr()
    assert rc == 0 and captured.out.strip() == f"{out}/pdm"
    assert "step 3/3 loss" in captured.err  # off a terminal: the plain step lines, as before
    assert len(json.loads((out / "history.json").read_text())) == 3
    check_png(tmp_path / "train.png")
    rc = main(["eval", "--model", "random:tiny-llama", "--stages", "2", "--spec", f"{out}/pdm", "--limit", "1",
               "--max-new-tokens", "4", "--capacity", "256", "--data-dir", str(tmp_path / "eval"),
               "--datasets", "mt_bench", "--plot", str(tmp_path / "eval.png")])
    assert rc == 0
    assert "[1/1] mt_bench#" in capsys.readouterr().err  # the per-prompt line, as before
    check_png(tmp_path / "eval.png")


def test_cli_plot_without_matplotlib_names_the_extra(tmp_path: Path, monkeypatch, capsys) -> None:
    from spd_engine.tools.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    rc = main(["train", "--model", "random:tiny-llama", "--corpus", str(tmp_path / "none"), "--out",
               str(tmp_path / "run"), "--plot", str(tmp_path / "t.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "pip install 'spd-engine[plot]'" in err[0]
    assert not (tmp_path / "run").exists()  # refused before any work


def test_progress_bar_ends_full_when_a_limit_is_overshot() -> None:
    stream = io.StringIO()
    with Progress(10, "spd data", lambda _: None, unit="tok", tty=True, stream=stream) as bar:
        bar.update(12)  # the last document crosses --limit-tokens
    assert "100%" in stream.getvalue().split("\r")[-1] and "12/12" in stream.getvalue()
