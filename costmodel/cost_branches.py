"""Predicted speed of branch width W (docs/design.md 3.11): `spd plan --branches-json` turns the
offline replay's figures (`spd draft-policies --branches --json`: EAL and stage tokens per step
for each W; the runtime's counts, the replay being exact) into tokens/s on a profile and links.
PREDICTED: a W-token stage step is priced with a given cost ratio to a one-token step
(`bench/stage_width_time.py` measures it; on a GPU profile without that measurement it is an
assumption, labelled).

Per W, with `f = (tokens per step - 1) / (W - 1)` the share of stage steps that carry W tokens:
every stage step costs `stage_ms * (1 + f * (cost_W - 1))` on average; the driver's one PDM pass
over every chain (engine/runtime/driver.py `_chain_pass`) is priced the same way
(`pdm * (1 + f * (cost_W - 1))`: its rows grow as a stage step's do); the tick is the steady
critical cycle of the cost model (costmodel/cost_model_spd.py) and tokens/s = EAL / (n * tick).
With verification on the last stage (`verify_on_last`: costmodel/cost_model_spd.py verifies_on_last
of the run's --verify-at and layout) a one-token exit is verified there, but a branch point's
chains message is verified by the driver (docs/design.md 3.5): the driver verifies a share f of
the exits, the last stage the rest.
"""
from __future__ import annotations

from spd_engine.costmodel.cost_inputs import Profile
from spd_engine.costmodel.cost_model_spd import build_spd_case, spd_cycles
from spd_engine.costmodel.cost_partitions import stage_times
from spd_engine.engine.protocol.topology import default_stage_layers


def read_branch_report(report: dict, policy: str, group: str = "overall") -> dict[int, tuple[float, float]]:
    """{W: (EAL, tokens per step)} of one chooser and branch rule ("refill suffix>=2") from a
    `spd draft-policies --json` report; W = 1 is that chooser without branches."""
    when, _, chooser = policy.partition(" ")
    try:
        out = {1: (float(report["groups"][group][chooser]["eal"]), 1.0)}
        for name, row in report["branches"][group].items():
            w, rule, who = name.split(" ")
            if rule == when and who == chooser:
                out[int(w.removeprefix("W="))] = (float(row["eal"]), float(row["tokens_per_step"]))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"not a spd draft-policies --json report with branches for {policy!r} ({err})") from None
    if len(out) == 1:
        raise ValueError(f"the report has no branch rows for {policy!r} (run spd draft-policies --branches)")
    return out


def branch_rows(profile: Profile, link_of, n: int, colocate: bool, measured: dict[int, tuple[float, float]],
                width_cost: dict[int, float], notes: list[str], verify_on_last: bool = True) -> list[dict]:
    """One predicted row per W."""
    base = list(profile.stage_ms[n]) if n in profile.stage_ms else \
        stage_times(profile, default_stage_layers(profile.num_layers, n))
    rows = []
    for w, (eal, per_step) in sorted(measured.items()):
        if w > 1 and w not in width_cost:
            raise ValueError(f"no W-token step cost for W={w}: give --width-cost {w}:RATIO")
        f = (per_step - 1) / (w - 1) if w > 1 else 0.0
        cost = width_cost.get(w, 1.0)
        stage = [c * (1 + f * (cost - 1)) for c in base]
        pdm = profile.driver_work_for(n, notes) * (1 + f * (cost - 1))
        case = build_spd_case(stage, pdm, profile.verify_ms, 1.0, colocate, profile.hidden, profile.dtype_bytes,
                              profile.anchors, link_of, verify_on_last=verify_on_last, driver_verify_share=f)
        tick = max(spd_cycles(case).values())
        rows.append({"W": w, "eal": eal, "tokens_per_step": per_step, "width_cost": cost, "tick_ms": tick,
                     "tok_s": 1e3 * eal / (n * tick), "predicted": True})
    return rows


def parse_width_cost(text: str) -> dict[int, float]:
    """"2:1.0,4:1.9" -> {2: 1.0, 4: 1.9}."""
    try:
        out = {int(k): float(v) for k, v in (item.split(":") for item in text.split(",") if item.strip())}
    except ValueError:
        raise ValueError(f"--width-cost takes W:RATIO pairs, e.g. 2:1.0,4:1.9, got {text!r}") from None
    if any(w < 2 or r < 1.0 for w, r in out.items()):
        raise ValueError(f"--width-cost: W >= 2 and a ratio >= 1 (a W-token step is never cheaper), got {text!r}")
    return out
