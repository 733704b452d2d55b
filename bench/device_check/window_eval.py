"""The evaluation at the end of a GPU window: every trained head against the head it started from,
on held-out corpus sequences, on the device. Per fill of the simulated tick (train/pipeline_sim.py)
the KL from the target and the top-1 agreement of the head's draft with the target's argmax (at
T = 0 a first draft is accepted exactly when they agree). It ranks heads quickly; whether a head
ships is decided on the CPU afterwards, by `spd eval` on the dev prompts (docs/gpu-check.md)."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from spd_engine.bench.device_check.check_env import error_line
from spd_engine.train.distill import distill_loss


@torch.no_grad()
def fill_scores(pdm, target, seqs: torch.Tensor, batch: int, autocast: str) -> dict[int, dict]:
    """{fill: {"kl", "agree"}} over `seqs` [N, S], fills 1..n, token-weighted means."""
    pdm.eval()
    out = {}
    for f in range(1, pdm.pcfg.n + 1):
        kl = agree = 0.0
        for i in range(0, seqs.shape[0], batch):
            chunk = seqs[i:i + batch]
            loss, acc = distill_loss(pdm, target, chunk, f, autocast)
            kl += float(loss) * chunk.shape[0]
            agree += float(acc) * chunk.shape[0]
        out[f] = {"kl": round(kl / seqs.shape[0], 4), "agree": round(agree / seqs.shape[0], 4)}
    return out


def mean_agree(scores: dict[int, dict], weights: tuple[float, ...] | None) -> float:
    """Agreement over fills, weighted as the driver drafts (the run's fill weights; else equal)."""
    w = weights or tuple(1.0 for _ in scores)
    return round(sum(wi * scores[f]["agree"] for wi, f in zip(w, sorted(scores))) / sum(w), 4)


def evaluate_heads(entries: list[dict], target, seqs: torch.Tensor, batch: int, autocast: str,
                   deadline: float, log: Callable[[str], None]) -> dict:
    """`entries`: {"name", "load": () -> trained PDM, "start": () -> starting PDM or None, "weights"};
    each scored until `deadline` (perf_counter seconds), the rest marked skipped."""
    results = {}
    for e in entries:
        if time.perf_counter() >= deadline:
            results[e["name"]] = {"status": "skipped (time budget)"}
            continue
        t0 = time.perf_counter()
        try:
            trained = fill_scores(e["load"](), target, seqs, batch, autocast)
            start_pdm = e["start"]()
            start = fill_scores(start_pdm, target, seqs, batch, autocast) if start_pdm is not None else None
            r = {"status": "measured", "trained": trained, "start": start,
                 "agree_trained": mean_agree(trained, e["weights"]),
                 "agree_start": mean_agree(start, e["weights"]) if start else None}
            r["better_than_start"] = None if start is None else r["agree_trained"] > r["agree_start"]
        except Exception as err:  # reported; the other heads are still scored
            r = {"status": "error", "error": error_line(err)}
        r["seconds"] = round(time.perf_counter() - t0, 2)
        results[e["name"]] = r
        log(f"  eval {e['name']}: {r.get('agree_start')} -> {r.get('agree_trained')} ({r['status']})")
    return results
