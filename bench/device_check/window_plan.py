"""What one GPU window runs (`spd gpu-check --window`, `make gpu-window`), chosen before it opens:
the time budget and its safety margin, the heads trained in order with their share of the
training time, and the sizes of the CPU dry run. Pure data, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field

WINDOW_SCHEMA = "spd-gpu-window/1"
WINDOW_KEYS = ("schema", "mode", "environment", "plan", "check", "target", "corpus", "training", "evaluation",
               "outputs", "summary")
# what a GPU host hands back: at most this many files of at most this size, this much in all
OUT_MAX_FILES = 8
OUT_MAX_FILE_BYTES = 15 * 2**20
OUT_MAX_BYTES = 60 * 2**20

# the shipped n = 4 head (K = 2, 8192-id draft vocabulary) and the recipe of its last fine-tune
SHIPPED_N4 = "heads/smollm2-135m-n4"
SHIPPED_FILL_WEIGHTS = (14039.0, 5188.0, 2087.0, 2074.0)  # fills 1..4 as `spd eval --json` counted them


@dataclass(frozen=True)
class HeadRun:
    """One head trained in the window."""
    name: str  # OUT's archive member and the report's key
    stage_layers: tuple[int, ...]
    anchors: tuple[int, ...] | None  # None: the stage bounds
    pdm_layers: int
    share: float  # of the training time left when this run starts, against the shares still to run
    lr: float
    init_head: str | None = None  # a shipped head or an earlier run's name (its export); None: the target's layers
    fill_weights: tuple[float, ...] | None = None


@dataclass(frozen=True)
class WindowPlan:
    device: str
    model: str  # random:<preset> (dry run), or "staged": the GGUF carried in parts (window_target.py)
    budget_s: float  # the whole window from the process's start; the guard keeps `margin_s` of it
    margin_s: float  # kept free at the end: the last save, the evaluation's overrun, the report, exit
    check: bool  # run the GPU check first (`spd gpu-check`)
    check_budget_s: float  # its time guard's budget (its own plan orders the items so a cut keeps every shape)
    check_overrun_s: float  # past its budget the check is killed (imports, compilations, one item's overrun)
    eval_s: float  # reserved after training for the evaluation on the device
    runs: tuple[HeadRun, ...]
    seq_len: int
    batch: int
    max_steps: int  # a cap per run; the run's own time share sets its steps (calibrated)
    calib_steps: int  # steps timed before a run fixes its step count (the first `warm_steps` not counted)
    warm_steps: int
    min_run_s: float  # a run starts only with this much time left (else: skipped, time budget)
    eval_seqs: int  # held-out sequences per fill in the evaluation
    self_distill: int  # corpus prompts the target answers on the device before training (0: none)
    gen_tokens: int
    gen_batch: int
    dtype: str  # autocast and target dtype
    corpus: str  # a corpus directory (`spd data`) or its .tar.xz, or "synthetic" (dry run)
    notes: tuple[str, ...] = field(default=())


def gpu_window_plan(budget_s: float = 540.0, device: str = "cuda", check: bool = True) -> WindowPlan:
    """The window: the GPU check, then the shipped n = 4 head trained on (the one head the tracked
    tree has room to replace), a deeper n = 4 head (K = 4: on the H200 profiles the PDM hides
    behind a stage up to K = 6 at n = 4, docs/results/head-smollm2-n4.md), and n = 2 and n = 8 heads warm-started
    from the shipped one (train/head_transplant.py; the anchors of their carried heads)."""
    runs = (
        HeadRun("n4-k2", (8, 8, 7, 7), (0, 8, 23, 29), 2, 0.5, 3e-4, SHIPPED_N4, SHIPPED_FILL_WEIGHTS),
        HeadRun("n4-k4", (8, 8, 7, 7), (0, 8, 23, 29), 4, 0.25, 5e-4, None, SHIPPED_FILL_WEIGHTS),
        HeadRun("n2-k2", (15, 15), (0, 15, 29), 2, 0.125, 3e-4, SHIPPED_N4),
        HeadRun("n8-k2", (4, 4, 4, 4, 4, 4, 3, 3), (0, 4, 12, 24, 29), 2, 0.125, 3e-4, SHIPPED_N4),
    )
    return WindowPlan(device=device, model="staged", budget_s=budget_s, margin_s=45.0, check=check,
                      check_budget_s=150.0, check_overrun_s=90.0, eval_s=30.0,
                      runs=runs, seq_len=256, batch=64, max_steps=100_000, calib_steps=12, warm_steps=4,
                      min_run_s=20.0, eval_seqs=64, self_distill=0, gen_tokens=192, gen_batch=128,
                      dtype="bfloat16", corpus="data/smollm2-135m-corpus.tar.xz")


def dry_window_plan(budget_s: float = 90.0, check: bool = True) -> WindowPlan:
    """The same steps on the CPU, tiny shapes: a head from the target's layers, a second split
    warm-started from it (the transplant path), a deeper one."""
    runs = (
        HeadRun("n4-k1", (2, 2, 1, 1), None, 1, 0.4, 3e-3),
        HeadRun("n2-k1", (3, 3), None, 1, 0.3, 3e-3, "n4-k1"),
        HeadRun("n4-k2", (2, 2, 1, 1), None, 2, 0.3, 3e-3, None, (4.0, 2.0, 1.0, 1.0)),
    )
    return WindowPlan(device="cpu", model="random:tiny-llama", budget_s=budget_s, margin_s=5.0, check=check,
                      check_budget_s=50.0, check_overrun_s=60.0, eval_s=3.0, runs=runs, seq_len=16, batch=2,
                      max_steps=12, calib_steps=4, warm_steps=1, min_run_s=0.5, eval_seqs=4, self_distill=4,
                      gen_tokens=6, gen_batch=4, dtype="float32", corpus="synthetic")


def run_budget(share: float, later_shares: float, left_s: float) -> float:
    """A run's seconds: its share of what is left, against the shares of the runs still to come."""
    assert share > 0 and later_shares >= 0
    return left_s * share / (share + later_shares)
