"""Speedups as `spd bench` reports them: every ratio between two rows of one run comes with its
spread over repeats and a noisy mark, and a row whose head was trained on fewer tokens than the
PDM heads it is compared with says so.

A ratio is computed per repeat (repeat i of the row over repeat i of the baseline: both ran in the
same launch of the benchmark) and reported as the median of those per-repeat ratios with their
min and max. It is noisy when it rests on a single repeat (no spread to judge it by), or when the
spread (max - min) is wider than the gain |median - 1|: the repeats disagree by more than the
effect they are quoted for. Pure arithmetic over the rows' numbers; no torch, no process.
"""
from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

# Rows every other row is compared with, when the run has them: the row's name and its key suffix.
BASELINES: tuple[tuple[str, str], ...] = (("ar", "ar"), ("pp", "pp"), ("hf", "hf"), ("hf-lookup", "hf_lookup"))

SINGLE_REPEAT = "a single repeat"


def ratio_spread(num: Sequence[float], den: Sequence[float]) -> dict | None:
    """Median, min, max of the per-repeat ratios num[i] / den[i], the ratios themselves, and the
    noisy mark with its reason. None when a repeat of the baseline has no rate (no decode tokens:
    there is nothing to divide by)."""
    if len(num) != len(den):
        raise ValueError(f"per-repeat rates of unequal length ({len(num)} and {len(den)}): ratios pair "
                         "repeats of one run")
    if not num:
        raise ValueError("a ratio needs at least one repeat")
    if any(d <= 0 for d in den):
        return None
    ratios = [a / b for a, b in zip(num, den)]
    median, lo, hi = statistics.median(ratios), min(ratios), max(ratios)
    reason = noisy_reason(median, lo, hi, len(ratios))
    return {"median": median, "min": lo, "max": hi, "per_repeat": ratios, "noisy": reason is not None,
            "noisy_reason": reason}


def noisy_reason(median: float, lo: float, hi: float, repeats: int) -> str | None:
    """Why a ratio cannot be read as a gain or a loss, or None when it can."""
    if repeats < 2:
        return SINGLE_REPEAT
    spread, gain = hi - lo, abs(median - 1.0)
    if spread > gain:
        return f"spread {spread:.3f} wider than the gain {gain:.3f}"
    return None


def add_speedups(rows: list[dict]) -> None:
    """Give every row `speedup_vs_<b>` (the median per-repeat ratio) with `_min`, `_max`,
    `_per_repeat`, `_noisy` and `_noisy_reason` for each baseline row b the run has. Rows carry
    their per-repeat rates in `decode_tok_s_per_repeat`. A baseline against itself is 1 by
    definition, not a measurement: exact and never noisy."""
    by_name = {r["name"]: r for r in rows}
    for base_name, key in BASELINES:
        base = by_name.get(base_name)
        for r in rows:
            prefix = f"speedup_vs_{key}"
            if base is None:
                if key in ("ar", "pp"):  # always in the report, as before: None when the row is absent
                    r[prefix] = None
                continue
            out = ratio_spread(r["decode_tok_s_per_repeat"], base["decode_tok_s_per_repeat"])
            if out is None:
                r[prefix] = None
                continue
            if r is base:
                out.update(noisy=False, noisy_reason=None)
            r[prefix] = out["median"]
            for field in ("min", "max", "per_repeat", "noisy", "noisy_reason"):
                r[f"{prefix}_{field}"] = out[field]


def ratio_cell(row: dict, key: str) -> str:
    """The table cell of one ratio: '1.08 (0.95-1.19) noisy'; the range only when there is one."""
    median = row.get(f"speedup_vs_{key}")
    if median is None:
        return ""
    text = f"{median:.2f}"
    if len(row[f"speedup_vs_{key}_per_repeat"]) > 1 and row[f"speedup_vs_{key}_min"] != row[f"speedup_vs_{key}_max"]:
        text += f" ({row[f'speedup_vs_{key}_min']:.2f}-{row[f'speedup_vs_{key}_max']:.2f})"
    return text + (" noisy" if row[f"speedup_vs_{key}_noisy"] else "")


def noisy_lines(rows: list[dict]) -> list[str]:
    """The reasons behind the noisy marks, one line each; one line for all when every ratio rests
    on a single repeat (the same reason everywhere)."""
    marked = [(r["name"], base, r[f"speedup_vs_{key}_noisy_reason"]) for base, key in BASELINES for r in rows
              if r.get(f"speedup_vs_{key}_noisy")]
    if marked and all(reason == SINGLE_REPEAT for _, _, reason in marked):
        return ["noisy: every ratio rests on a single repeat (--repeats 1): no spread to judge it by"]
    return [f"noisy: {name} x {base}: {reason}" for name, base, reason in marked]


def training_tokens(head_dir: str | Path) -> tuple[int, str] | None:
    """(tokens the head was trained on, the file that says so), or None when nothing records them.
    train_history.json counts every phase (a fine-tune continues the base run's count); the head's
    own metadata (`train.tokens` of pdm.json / eagle.json) only the last phase, so it is the fallback."""
    d = Path(head_dir)
    history = d / "train_history.json"
    if history.is_file():
        entries = json.loads(history.read_text())
        if entries and "tokens" in entries[-1]:
            return int(entries[-1]["tokens"]), str(history)
    for meta in (d / "eagle.json", d / "pdm.json"):
        if meta.is_file():
            tokens = json.loads(meta.read_text()).get("train", {}).get("tokens")
            if tokens is not None:
                return int(tokens), str(meta)
    return None


def head_budget_note(head: str, pdm_heads: dict[str, str]) -> dict:
    """How the eagle row's head was trained against the PDM heads (label -> directory) it is read
    beside: {"head_training_tokens", "head_training_source", "reference", "reference_tokens",
    "under_trained", "note"}. `note` is the short text for the table cell."""
    if head == "random":
        return {"head_training_tokens": 0, "head_training_source": None, "reference": None, "reference_tokens": None,
                "under_trained": True, "note": "untrained (random) head"}
    own = training_tokens(head)
    if own is None:
        return {"head_training_tokens": None, "head_training_source": None, "reference": None,
                "reference_tokens": None, "under_trained": None,
                "note": f"head's training tokens not recorded in {head}"}
    tokens, source = own
    known = {label: t[0] for label, d in pdm_heads.items() if d != "random" and (t := training_tokens(d)) is not None}
    out = {"head_training_tokens": tokens, "head_training_source": source, "reference": None,
           "reference_tokens": None, "under_trained": None, "note": f"head {tokens / 1e6:.2f} M tokens"}
    if known:
        label = max(known, key=known.__getitem__)  # the best-trained PDM head sets the budget to match
        out.update(reference=label, reference_tokens=known[label], under_trained=tokens < known[label])
        if tokens < known[label]:
            out["note"] = (f"under-trained head: {tokens / 1e6:.2f} M tokens against {known[label] / 1e6:.2f} M "
                           f"({label})")
    return out
